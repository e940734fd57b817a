#include "dsakit/batch.h"

#include <algorithm>
#include <unordered_map>

#include "dsakit/error.h"

namespace dsakit {

const char* to_string(ForwardMode mode) {
  switch (mode) {
    case ForwardMode::kExtend:
      return "extend";
    case ForwardMode::kDecode:
      return "decode";
    case ForwardMode::kTargetVerify:
      return "target-verify";
    case ForwardMode::kDraftExtend:
      return "draft-extend";
  }
  return "?";
}

ForwardMode parse_forward_mode(const std::string& name) {
  if (name == "extend") return ForwardMode::kExtend;
  if (name == "decode") return ForwardMode::kDecode;
  if (name == "target-verify") return ForwardMode::kTargetVerify;
  if (name == "draft-extend") return ForwardMode::kDraftExtend;
  DSAKIT_FAIL(kInvalidArgument,
              "forward mode: expected extend, decode, target-verify or draft-extend, got '", name,
              "'");
}

Batch Batch::slice(int first, int count) const {
  DSAKIT_CHECK_ARG(first >= 0 && count >= 0 && first + count <= num_requests(),
                   "Batch::slice: requests [", first, ", ", first + count, ") of ", num_requests());
  DSAKIT_CHECK_ARG(
      extend_lens.size() == prefix_lens.size() && page_tables.size() == prefix_lens.size(),
      "Batch::slice: prefix_lens, extend_lens and page_tables differ in size");
  Batch b = *this;
  auto cut = [&](auto& v) {
    v.erase(v.begin() + first + count, v.end());
    v.erase(v.begin(), v.begin() + first);
  };
  cut(b.prefix_lens);
  cut(b.extend_lens);
  cut(b.page_tables);
  return b;
}

int64_t Batch::num_new_tokens() const {
  int64_t t = 0;
  for (int32_t e : extend_lens) t += e;
  return t;
}

int64_t Batch::total_kv_len() const {
  int64_t n = 0;
  for (size_t r = 0; r < prefix_lens.size(); ++r) n += int64_t(prefix_lens[r]) + extend_lens[r];
  return n;
}

int32_t Batch::max_kv_len() const {
  int64_t m = 0;
  for (size_t r = 0; r < prefix_lens.size(); ++r)
    m = std::max<int64_t>(m, int64_t(prefix_lens[r]) + extend_lens[r]);
  return int32_t(m);
}

void Batch::validate(int page_size, int64_t num_pages) const {
  const size_t b = prefix_lens.size();
  DSAKIT_CHECK_ARG(b >= 1, "batch: expected at least one request");
  DSAKIT_CHECK_ARG(extend_lens.size() == b, "batch extend_lens: expected ", b,
                   " entries (one per request), got ", extend_lens.size());
  DSAKIT_CHECK_ARG(page_tables.size() == b, "batch page_tables: expected ", b,
                   " tables (one per request), got ", page_tables.size());
  // page -> (request, first position it holds)
  std::unordered_map<int32_t, int32_t> owner;
  int64_t total = 0;
  for (size_t r = 0; r < b; ++r) {
    const int64_t p = prefix_lens[r], e = extend_lens[r];
    DSAKIT_CHECK_ARG(p >= 0, "request ", r, " prefix_len: expected >= 0, got ", p);
    DSAKIT_CHECK_ARG(e >= 0, "request ", r, " extend_len: expected >= 0, got ", e);
    if (mode == ForwardMode::kDecode)
      DSAKIT_CHECK_ARG(e == 1, "request ", r, " extend_len: decode expects 1, got ", e);
    const int64_t len = p + e;
    DSAKIT_CHECK_ARG(len <= INT32_MAX, "request ", r, ": length ", len, " exceeds int32");
    total += len;
    DSAKIT_CHECK_ARG(total <= INT32_MAX, "batch: total KV length exceeds int32");
    const int64_t pages_needed = (len + page_size - 1) / page_size;
    const auto& table = page_tables[r];
    DSAKIT_CHECK_ARG(int64_t(table.size()) >= pages_needed, "request ", r, ": length ", len,
                     " (prefix ", p, " + extend ", e, ") needs ", pages_needed, " pages of ",
                     page_size, " but its page table has ", table.size());
    for (int64_t i = 0; i < pages_needed; ++i) {
      const int32_t id = table[size_t(i)];
      DSAKIT_CHECK_ARG(id >= 0 && id < num_pages, "request ", r, " page_table[", i,
                       "]: expected a page id in [0, ", num_pages, "), got ", id);
      auto [it, fresh] = owner.emplace(id, int32_t(r));
      if (fresh) continue;
      DSAKIT_CHECK_ARG(it->second != int32_t(r), "request ", r, " page_table[", i, "]: page ", id,
                       " is listed twice in one table");
      // Shared page: allowed only for declared shared prefixes, never for a written page.
      const bool read_only_here = (i + 1) * page_size <= p;
      DSAKIT_CHECK_ARG(shared_prefix_pages && read_only_here, "request ", r, " page_table[", i,
                       "]: page ", id, " is also used by request ", it->second,
                       shared_prefix_pages ? " and would be written by this request"
                                           : " (declare shared_prefix_pages to share it)");
    }
  }
  // A shared page must be read-only for its first owner too.
  if (shared_prefix_pages) {
    std::unordered_map<int32_t, int> count;
    for (size_t r = 0; r < b; ++r) {
      const int64_t len = int64_t(prefix_lens[r]) + extend_lens[r];
      for (int64_t i = 0; i < (len + page_size - 1) / page_size; ++i)
        ++count[page_tables[r][size_t(i)]];
    }
    for (size_t r = 0; r < b; ++r) {
      const int64_t len = int64_t(prefix_lens[r]) + extend_lens[r];
      for (int64_t i = 0; i < (len + page_size - 1) / page_size; ++i) {
        const int32_t id = page_tables[r][size_t(i)];
        DSAKIT_CHECK_ARG(count[id] == 1 || (i + 1) * page_size <= prefix_lens[r], "request ", r,
                         " page_table[", i, "]: shared page ", id,
                         " would be written by this request");
      }
    }
  }
}

BatchIndex BatchIndex::build(const Batch& batch, int page_size) {
  BatchIndex x;
  const int b = batch.num_requests();
  x.cu_q.assign(size_t(b) + 1, 0);
  x.cu_kv.assign(size_t(b) + 1, 0);
  x.prefix_lens = batch.prefix_lens;
  for (int r = 0; r < b; ++r) {
    x.cu_q[size_t(r) + 1] = x.cu_q[size_t(r)] + batch.extend_lens[size_t(r)];
    x.cu_kv[size_t(r) + 1] =
        x.cu_kv[size_t(r)] + batch.prefix_lens[size_t(r)] + batch.extend_lens[size_t(r)];
  }
  const size_t t_total = size_t(x.cu_q.back());
  x.token_request.resize(t_total);
  x.token_pos.resize(t_total);
  x.token_ctx_len.resize(t_total);
  x.token_kv_start.resize(t_total);
  x.new_locs.resize(t_total);
  x.kv_locs.resize(size_t(x.cu_kv.back()));
  for (int r = 0; r < b; ++r) {
    const auto& table = batch.page_tables[size_t(r)];
    const int32_t p0 = batch.prefix_lens[size_t(r)];
    const int32_t len = x.cu_kv[size_t(r) + 1] - x.cu_kv[size_t(r)];
    // location_of(table, page_size, p) for p < len, a page at a time.
    int32_t* locs = x.kv_locs.data() + x.cu_kv[size_t(r)];
    for (int32_t first = 0, page = 0; first < len; first += page_size, ++page) {
      const int64_t base = int64_t(table[size_t(page)]) * page_size;
      const int32_t end = std::min<int64_t>(len, int64_t(first) + page_size);
      for (int32_t p = first; p < end; ++p) locs[p] = int32_t(base + (p - first));
    }
    for (int32_t i = 0; i < batch.extend_lens[size_t(r)]; ++i) {
      const size_t t = size_t(x.cu_q[size_t(r)] + i);
      x.token_request[t] = r;
      x.token_pos[t] = p0 + i;
      x.token_ctx_len[t] = p0 + i + 1;
      x.token_kv_start[t] = x.cu_kv[size_t(r)];
      x.new_locs[t] = locs[p0 + i];
    }
  }
  return x;
}

}  // namespace dsakit
