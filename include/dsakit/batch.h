// A batch of requests at the attention-backend boundary (docs/design.md#paged-pool).
//
// Request r has P_r cached prefix tokens and E_r new tokens; new token i sits at position
// P_r + i and sees positions 0 … P_r + i. T = Σ E_r. The batch's new tokens are laid out in
// request order (all of request 0's, then request 1's, …) in every [T, …] tensor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dsakit {

enum class ForwardMode : uint8_t { kExtend, kDecode, kTargetVerify, kDraftExtend };
const char* to_string(ForwardMode mode);
ForwardMode parse_forward_mode(const std::string& name);

struct Batch {
  ForwardMode mode = ForwardMode::kExtend;
  std::vector<int32_t> prefix_lens;               // P_r
  std::vector<int32_t> extend_lens;               // E_r (decode: 1)
  std::vector<std::vector<int32_t>> page_tables;  // page ids of request r, in position order
  // Pages may appear in two requests' tables only when this is set (shared cached prefix);
  // such pages must then lie wholly inside both requests' prefixes (never written).
  bool shared_prefix_pages = false;

  // Engine state the dispatcher reads (docs/dispatch.md).
  bool cuda_graph = false;                 // capturing or replaying a CUDA graph
  bool speculative = false;                // extend with speculative decoding
  bool context_parallel = false;           // prefill context parallelism on
  bool hierarchical_sparse_cache = false;  // host-offloaded sparse KV attached

  int num_requests() const { return int(prefix_lens.size()); }
  int64_t num_new_tokens() const;  // T
  int64_t total_kv_len() const;    // Σ L_r
  int32_t max_kv_len() const;      // max L_r
  // Requests [first, first + count) as a batch of their own (engine-state flags kept).
  Batch slice(int first, int count) const;

  // Throws Error(kInvalidArgument) naming the request and field: sizes agree, lengths >= 0,
  // L_r fits the page table, page ids in [0, num_pages), no page shared between requests
  // (unless shared_prefix_pages), no page listed twice in one table, decode has E_r == 1.
  void validate(int page_size, int64_t num_pages) const;
};

inline int64_t location_of(const std::vector<int32_t>& page_table, int page_size, int64_t pos) {
  return int64_t(page_table[size_t(pos / page_size)]) * page_size + pos % page_size;
}

// Host-side index arrays derived from a validated Batch, built once per batch.
struct BatchIndex {
  std::vector<int32_t> cu_q;            // [B+1] prefix sums of E_r
  std::vector<int32_t> cu_kv;           // [B+1] prefix sums of L_r
  std::vector<int32_t> prefix_lens;     // [B]   P_r
  std::vector<int32_t> token_request;   // [T]   request of each new token
  std::vector<int32_t> token_pos;       // [T]   position P_r + i
  std::vector<int32_t> token_ctx_len;   // [T]   visible positions P_r + i + 1
  std::vector<int32_t> token_kv_start;  // [T]   cu_kv[request]: offset of its request in kv_locs
  std::vector<int32_t> new_locs;        // [T]   pool location of each new token
  std::vector<int32_t> kv_locs;         // [Σ L_r] locations of positions 0 … L_r-1, batch order

  static BatchIndex build(const Batch& batch, int page_size);
};

}  // namespace dsakit
