// Kernel-level ops in the peers' calling conventions (docs/python.md#ops): each maps the peer's
// tensors onto the Backend op that computes the same function, zero-copy where the layouts agree
// and with the documented row copies where they do not. Outputs and scratch come allocated from
// the Python side (in the caller's framework); nothing here computes.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "dsakit/error.h"
#include "python/src/backends.h"
#include "python/src/bindings.h"

namespace dsakit::py {

namespace {

using namespace nb::literals;

constexpr int64_t kDc = 512, kDrope = 64, kDqk = kDc + kDrope;  // FlashMLA's 576 / 512 rows

// Columns [begin, end) of the last dim (same strides).
TensorView columns(const TensorView& v, int64_t begin, int64_t end) {
  TensorView c = v;
  c.shape[size_t(v.ndim - 1)] = end - begin;
  c.data = static_cast<char*>(v.data) + begin * int64_t(dtype_size(v.dtype));
  return c;
}

// v without its dim d (of extent 1).
TensorView drop_dim(const TensorView& v, int d) {
  TensorView r = v;
  for (int i = d; i + 1 < v.ndim; ++i) {
    r.shape[size_t(i)] = v.shape[size_t(i + 1)];
    r.stride[size_t(i)] = v.stride[size_t(i + 1)];
  }
  r.ndim = v.ndim - 1;
  r.shape[size_t(r.ndim)] = 0;
  r.stride[size_t(r.ndim)] = 0;
  return r;
}

// Dims 0 and 1 as one (the peers' [b, s_q, ...] as dsakit's [T = b·s_q, ...]).
TensorView merge01(const TensorView& v, const char* name) {
  DSAKIT_CHECK_ARG(v.ndim >= 2, name, ": expected at least 2 dims, got ", v.shape_str());
  DSAKIT_CHECK_ARG(v.shape[0] <= 1 || v.shape[1] == 0 || v.stride[0] == v.shape[1] * v.stride[1],
                   name, ": dims 0 and 1 must be one run of rows (stride[0] == shape[1] * ",
                   "stride[1]), got shape ", v.shape_str());
  TensorView r = drop_dim(v, 1);
  r.shape[0] = v.shape[0] * v.shape[1];
  r.stride[0] = v.stride[1];
  return r;
}

// A view as rows [n, width] of one pitch (a contiguous tensor, or a column range of one).
TensorView as_rows(const TensorView& v, const char* name) {
  const Rows r = rows_of(v, name);
  TensorView t = v;
  t.ndim = 2;
  t.shape = {r.rows, v.shape[size_t(v.ndim - 1)], 0, 0};
  t.stride = {r.pitch_bytes / int64_t(dtype_size(v.dtype)), 1, 0, 0};
  return t;
}

// The rows of a contiguous view as [n, width].
TensorView contiguous_rows(const TensorView& v, const char* name, int64_t width) {
  DSAKIT_CHECK_ARG(v.is_contiguous(), name, ": expected a contiguous tensor, got shape ",
                   v.shape_str());
  DSAKIT_CHECK_ARG(v.shape[size_t(v.ndim - 1)] == width, name, ": expected a last dim of ", width,
                   ", got shape ", v.shape_str());
  return make_view(v.data, v.dtype, v.device, {v.numel() / std::max<int64_t>(width, 1), width});
}

// Host copies of an i32 [n] index tensor: read in place on the host, else copied (a sync).
std::vector<int32_t> host_i32(Backend& be, const TensorView& t, const char* name) {
  check_tensor(t, name, DType::kI32, t.device, {-1});
  std::vector<int32_t> out(size_t(t.numel()));
  if (t.device == Device::kCpu) {
    if (!out.empty()) std::memcpy(out.data(), t.data, out.size() * 4);
  } else {
    DSAKIT_CHECK_ARG(!capturing(be), name,
                     ": its host copy is needed and cannot be made while a CUDA graph is being "
                     "captured; pass it (e.g. cu_seqlens_q_host=)");
    be.copy(make_view(out.data(), DType::kI32, Device::kCpu, {t.numel()}), t);
  }
  return out;
}

// ---- FlashMLA: sparse attention over a bf16 kv [s_kv, 1, 576] or a paged kcache -----------------

// q_abs / q_pe: the [.., :512] and [.., 512:] column views of q [T, H, 576].
void sparse_mla_call(const DeviceRef& dev, std::optional<uint64_t> stream, const TensorView& q,
                     const PagedKvPool& pool, const TensorView& indices,
                     const TensorView& topk_length, double sm_scale, const TensorView& out,
                     const TensorView& max_logits, const TensorView& lse) {
  check_strided_tensor(q, "q", {DType::kBF16}, dev.type, {-1, -1, kDqk});
  SparseMlaArgs a;
  a.q_abs = columns(q, 0, kDc);
  a.q_pe = columns(q, kDc, kDqk);
  a.kv = &pool;
  a.indices = indices;
  a.topk_length = topk_length;
  a.sm_scale = sm_scale;
  a.o_lat = out;
  a.lse = lse;
  a.max_logits = max_logits;
  BackendSlot& slot = backend_for(dev);
  nb::gil_scoped_release nogil;
  Call call(slot, stream);
  call.be.sparse_mla(a);
}

void sparse_mla_prefill(nb::handle q_obj, nb::handle kv_obj, nb::handle indices_obj,
                        double sm_scale, int d_v, nb::handle topk_length_obj, nb::handle out_obj,
                        nb::handle max_logits_obj, nb::handle lse_obj,
                        std::optional<uint64_t> stream) {
  const Arg q = arg(q_obj, "q"), kv = arg(kv_obj, "kv"), indices = arg(indices_obj, "indices"),
            topk_length = arg(topk_length_obj, "topk_length", false, true),
            out = arg(out_obj, "out", true), lse = arg(lse_obj, "lse", true),
            max_logits = arg(max_logits_obj, "max_logits", true, true);
  const DeviceRef dev = q.device;
  check_same_device(dev, {&kv, &indices, &topk_length, &out, &lse, &max_logits});
  DSAKIT_CHECK_ARG(d_v == kDc, "d_v: expected ", kDc,
                   " (the value is the first 512 of the 576 kv columns), got ", d_v);
  // kv [s_kv, 1, 576] bf16 is a bf16 pool of page size 1: token n's 1152 bytes at location n.
  check_tensor(kv.view, "kv", DType::kBF16, dev.type, {-1, 1, kDqk});
  const int64_t s_kv = kv.view.shape[0];
  DSAKIT_CHECK_ARG(s_kv >= 1, "kv: expected at least one token row, got shape ",
                   kv.view.shape_str());
  KvPoolDesc d;
  d.layout = KvLayout::kBf16;
  d.page_size = 1;
  d.num_pages = s_kv;
  const PagedKvPool pool(
      d, borrowed(make_view(kv.view.data, DType::kU8, dev.type, {s_kv, d.bytes_per_token()})));
  check_strided_tensor(q.view, "q", {DType::kBF16}, dev.type, {-1, -1, kDqk});
  const int64_t s_q = q.view.shape[0], h_q = q.view.shape[1];
  check_tensor(indices.view, "indices", DType::kI32, dev.type, {s_q, 1, -1});
  if (topk_length.given())
    check_tensor(topk_length.view, "topk_length", DType::kI32, dev.type, {s_q});
  check_tensor(out.view, "out", {DType::kBF16, DType::kF32}, dev.type, {s_q, h_q, kDc});
  check_tensor(lse.view, "lse", DType::kF32, dev.type, {s_q, h_q});
  if (max_logits.given())
    check_tensor(max_logits.view, "max_logits", DType::kF32, dev.type, {s_q, h_q});
  sparse_mla_call(dev, stream, q.view, pool, drop_dim(indices.view, 1), topk_length.view, sm_scale,
                  out.view, max_logits.view, lse.view);
}

void sparse_mla_decode(nb::handle q_obj, nb::handle kcache_obj, nb::handle indices_obj,
                       double sm_scale, int d_v, nb::handle topk_length_obj, nb::handle out_obj,
                       nb::handle lse_obj, std::optional<uint64_t> stream) {
  const Arg q = arg(q_obj, "q"), kc = arg(kcache_obj, "k_cache"),
            indices = arg(indices_obj, "indices"),
            topk_length = arg(topk_length_obj, "topk_length", false, true),
            out = arg(out_obj, "out", true), lse = arg(lse_obj, "lse", true);
  const DeviceRef dev = q.device;
  check_same_device(dev, {&kc, &indices, &topk_length, &out, &lse});
  DSAKIT_CHECK_ARG(d_v == kDc, "d_v: expected ", kDc, ", got ", d_v);
  check_strided_tensor(q.view, "q", {DType::kBF16}, dev.type, {-1, -1, -1, kDqk});
  const int64_t b = q.view.shape[0], s_q = q.view.shape[1];
  // k_cache [num_blocks, page_size, (1,) row]: FlashMLA's 656-byte FP8 tokens (u8 or
  // float8_e4m3fn), or bf16 rows of 576.
  TensorView kv = kc.view;
  if (kv.ndim == 4) {
    DSAKIT_CHECK_ARG(kv.shape[2] == 1, "k_cache: expected one kv head, got shape ", kv.shape_str());
    kv = drop_dim(kv, 2);
  }
  DSAKIT_CHECK_ARG(kv.ndim == 3 && kv.is_contiguous(),
                   "k_cache: expected a contiguous [num_blocks, page_size, (1,) row] tensor, "
                   "got shape ",
                   kc.view.shape_str());
  KvPoolDesc d;
  const int64_t row_bytes = kv.shape[2] * int64_t(dtype_size(kv.dtype));
  if (kv.dtype == DType::kBF16) {
    d.layout = KvLayout::kBf16;
  } else {
    DSAKIT_CHECK_ARG(kv.dtype == DType::kU8,
                     "k_cache: expected FP8 bytes (u8 or float8_e4m3fn) or ", "bf16, got ",
                     to_string(kv.dtype));
    d.layout = KvLayout::kFp8Scaled;
  }
  d.page_size = int(kv.shape[1]);
  d.num_pages = kv.shape[0];
  const PagedKvPool pool(d, borrowed(make_view(kv.data, DType::kU8, dev.type,
                                               {kv.shape[0] * kv.shape[1], row_bytes})));
  check_tensor(indices.view, "indices", DType::kI32, dev.type, {b, s_q, -1});
  TensorView lengths = topk_length.view;
  if (topk_length.given()) {
    if (lengths.ndim == 1) {
      DSAKIT_CHECK_ARG(s_q == 1, "topk_length: expected shape [", b, ", ", s_q,
                       "] (one length per query), got ", lengths.shape_str());
      check_tensor(lengths, "topk_length", DType::kI32, dev.type, {b});
    } else {
      check_tensor(lengths, "topk_length", DType::kI32, dev.type, {b, s_q});
      lengths = merge01(lengths, "topk_length");
    }
  }
  check_tensor(out.view, "out", {DType::kBF16, DType::kF32}, dev.type, {b, s_q, -1, kDc});
  check_tensor(lse.view, "lse", DType::kF32, dev.type, {b, s_q, q.view.shape[2]});
  sparse_mla_call(dev, stream, merge01(q.view, "q"), pool, merge01(indices.view, "indices"),
                  lengths, sm_scale, merge01(out.view, "out"), TensorView{},
                  merge01(lse.view, "lse"));
}

// ---- FlashMLA's FP8 cache: quantize / dequantize through store_kv / gather_kv ------------------

KvPoolDesc row_pool_desc(const std::string& layout, const std::string& scales, float k_scale,
                         int64_t n) {
  KvPoolDesc d;
  d.layout = parse_kv_layout(layout);
  d.scale_policy = parse_scale_policy(scales);
  d.k_scale = k_scale;
  d.page_size = 1;
  d.num_pages = n;
  return d;
}

void quantize_kv(nb::handle kv_obj, nb::handle packed_obj, const std::string& layout,
                 const std::string& scales, float k_scale, nb::handle locs_obj,
                 std::optional<uint64_t> stream) {
  const Arg kv = arg(kv_obj, "kv"), packed = arg(packed_obj, "packed", true),
            locs = arg(locs_obj, "locs");
  const DeviceRef dev = kv.device;
  check_same_device(dev, {&packed, &locs});
  DSAKIT_CHECK_ARG(kv.view.dtype == DType::kBF16, "kv: expected dtype bf16, got ",
                   to_string(kv.view.dtype));
  DSAKIT_CHECK_ARG(kv.view.shape[size_t(kv.view.ndim - 1)] == kDqk, "kv: expected a last dim of ",
                   kDqk, ", got shape ", kv.view.shape_str());
  const TensorView rows = as_rows(kv.view, "kv");
  const int64_t n = rows.shape[0];
  if (n == 0) return;
  const KvPoolDesc d = row_pool_desc(layout, scales, k_scale, n);
  d.validate();
  PagedKvPool pool(d, borrowed(contiguous_rows(packed.view, "packed", d.bytes_per_token())));
  check_tensor(locs.view, "locs", DType::kI32, dev.type, {n});
  BackendSlot& slot = backend_for(dev);
  nb::gil_scoped_release nogil;
  Call call(slot, stream);
  const IndexValueChecksOff unchecked(call.be);  // locs is 0 … n-1, made by the Python side
  // Straight from the two column ranges of kv (store_kv takes row-strided inputs).
  call.be.store_kv(pool, locs.view, columns(rows, 0, kDc), columns(rows, kDc, kDqk));
}

void dequantize_kv(nb::handle packed_obj, nb::handle out_obj, const std::string& layout,
                   float k_scale, nb::handle locs_obj, std::optional<uint64_t> stream) {
  const Arg packed = arg(packed_obj, "packed"), out = arg(out_obj, "out", true),
            locs = arg(locs_obj, "locs");
  const DeviceRef dev = packed.device;
  check_same_device(dev, {&out, &locs});
  KvPoolDesc d = row_pool_desc(layout, "amax", k_scale, 1);
  const TensorView prow = contiguous_rows(packed.view, "packed", d.bytes_per_token());
  const int64_t n = prow.shape[0];
  DSAKIT_CHECK_ARG(out.view.shape[size_t(out.view.ndim - 1)] == kDqk,
                   "out: expected a last dim of ", kDqk, ", got shape ", out.view.shape_str());
  DSAKIT_CHECK_ARG(out.view.dtype == DType::kBF16 || out.view.dtype == DType::kF32,
                   "out: expected dtype bf16 or f32, got ", to_string(out.view.dtype));
  const TensorView orow = as_rows(out.view, "out");
  DSAKIT_CHECK_ARG(orow.shape[0] == n, "out: expected ", n, " rows, got shape ",
                   out.view.shape_str());
  if (n == 0) return;
  d.num_pages = n;
  const PagedKvPool pool(d, borrowed(prow));
  check_tensor(locs.view, "locs", DType::kI32, dev.type, {n});
  BackendSlot& slot = backend_for(dev);
  nb::gil_scoped_release nogil;
  Call call(slot, stream);
  const IndexValueChecksOff unchecked(call.be);  // locs is 0 … n-1, made by the Python side
  // Straight into the two column ranges of out (gather_kv takes row-strided outputs).
  call.be.gather_kv(pool, locs.view, columns(orow, 0, kDc), columns(orow, kDc, kDqk));
}

// ---- DeepGEMM: fp8_mqa_logits through indexer_logits --------------------------------------------

// DeepGEMM's indexer inputs as dsakit's IndexerArgs over an index-key pool of one page: s_kv
// keys, s_kv·d e4m3 bytes then s_kv fp32 scales. kv and kv_scales are that page already when the
// scales follow the keys in memory; otherwise copy_keys() copies both into key_scratch
// (s_kv·(d + 4) bytes). Shapes checked; the caller sets args.kv_start and args.ctx_len.
struct DeepGemmIndexer {
  int64_t s_q = 0, h = 0, d_i = 0, s_kv = 0;
  bool adjacent = true;
  const Arg &kv, &scales, &scratch;
  std::optional<IndexKeyPool> pool;
  IndexerArgs args;

  DeepGemmIndexer(const Arg& q, const Arg& kv_, const Arg& scales_, const Arg& w,
                  const Arg& kv_locs, const Arg& scratch_)
      : kv(kv_), scales(scales_), scratch(scratch_) {
    const Device dev = q.device.type;
    check_tensor(q.view, "q", DType::kU8, dev, {-1, -1, -1});
    s_q = q.view.shape[0], h = q.view.shape[1], d_i = q.view.shape[2];
    check_tensor(kv.view, "kv", DType::kU8, dev, {-1, d_i});
    s_kv = kv.view.shape[0];
    check_tensor(scales.view, "kv_scales", DType::kF32, dev, {s_kv});
    check_tensor(w.view, "weights", DType::kF32, dev, {s_q, h});
    check_tensor(kv_locs.view, "kv_locs", DType::kI32, dev, {s_kv});
    args.q8 = q.view;
    args.gate = w.view;  // DeepGEMM's weights are dsakit's gate (H_i^-0.5·d_i^-0.5·s_q folded in)
    args.kv_locs = kv_locs.view;
    if (s_kv == 0 || s_q == 0) return;  // no pool: the caller writes nothing or padding
    IndexKeyPoolDesc d{int(s_kv), 1, int(d_i)};
    d.validate();
    const auto* keys = static_cast<const uint8_t*>(kv.view.data);
    adjacent = static_cast<const uint8_t*>(scales.view.data) == keys + s_kv * d_i;
    if (!adjacent) {
      DSAKIT_CHECK_ARG(scratch.given(), "key scratch: needed when kv_scales do not follow kv");
      check_tensor(scratch.view, "key scratch", DType::kU8, dev, {d.page_bytes()});
    }
    pool.emplace(d, borrowed(make_view(adjacent ? kv.view.data : scratch.view.data, DType::kU8, dev,
                                       {1, d.page_bytes()})));
    args.keys = &*pool;
  }
  DeepGemmIndexer(const DeepGemmIndexer&) = delete;
  DeepGemmIndexer& operator=(const DeepGemmIndexer&) = delete;

  void copy_keys(Backend& be) const {
    if (adjacent) return;
    const Device dev = kv.device.type;
    auto* base = static_cast<uint8_t*>(scratch.view.data);
    be.copy(make_view(base, DType::kU8, dev, {s_kv * d_i}),
            make_view(kv.view.data, DType::kU8, dev, {s_kv * d_i}));
    be.copy(make_view(base + s_kv * d_i, DType::kF32, dev, {s_kv}), scales.view);
  }
};

void mqa_logits(nb::handle q_obj, nb::handle kv_obj, nb::handle scales_obj, nb::handle w_obj,
                nb::handle ke_obj, nb::handle logits_obj, nb::handle kv_locs_obj,
                nb::handle kv_start_obj, nb::handle scratch_obj, std::optional<uint64_t> stream) {
  const Arg q = arg(q_obj, "q"), kv = arg(kv_obj, "kv"), scales = arg(scales_obj, "kv_scales"),
            w = arg(w_obj, "weights"), ke = arg(ke_obj, "ke"),
            logits = arg(logits_obj, "logits", true), kv_locs = arg(kv_locs_obj, "kv_locs"),
            kv_start = arg(kv_start_obj, "kv_start"),
            scratch = arg(scratch_obj, "key scratch", true, true);
  const DeviceRef dev = q.device;
  check_same_device(dev, {&kv, &scales, &w, &ke, &logits, &kv_locs, &kv_start, &scratch});
  DeepGemmIndexer x(q, kv, scales, w, kv_locs, scratch);
  check_tensor(ke.view, "ke", DType::kI32, dev.type, {x.s_q});
  check_tensor(logits.view, "logits", DType::kF32, dev.type, {x.s_q, x.s_kv});
  check_tensor(kv_start.view, "kv_start", DType::kI32, dev.type, {x.s_q});
  if (x.s_kv == 0 || x.s_q == 0) return;
  x.args.kv_start = kv_start.view;
  x.args.ctx_len = ke.view;  // keys [0, ke): the Python side masks [0, ks) to -inf afterwards
  BackendSlot& slot = backend_for(dev);
  nb::gil_scoped_release nogil;
  Call call(slot, stream);
  x.copy_keys(call.be);
  call.be.indexer_logits(x.args, 0, x.s_q, logits.view);
}

// The indexer's top-k of DeepGEMM's inputs without the [s_q, s_kv] logits: row i scores keys
// [ks[i], ke[i]) (kv_start = ks, ctx_len = ke - ks, made on the host after checking
// 0 <= ks <= ke <= s_kv) and out [s_q, k] gets positions p within that range (column ks[i] + p).
// ks / ke may live on the host for a CUDA call: read in place then, no device-to-host copy.
void mqa_topk(nb::handle q_obj, nb::handle kv_obj, nb::handle scales_obj, nb::handle w_obj,
              nb::handle ks_obj, nb::handle ke_obj, int k, nb::handle out_obj,
              nb::handle kv_locs_obj, nb::handle scratch_obj, std::optional<uint64_t> stream) {
  const Arg q = arg(q_obj, "q"), kv = arg(kv_obj, "kv"), scales = arg(scales_obj, "kv_scales"),
            w = arg(w_obj, "weights"), ks = arg(ks_obj, "ks"), ke = arg(ke_obj, "ke"),
            out = arg(out_obj, "out", true), kv_locs = arg(kv_locs_obj, "kv_locs"),
            scratch = arg(scratch_obj, "key scratch", true, true);
  const DeviceRef dev = q.device;
  check_same_device(dev, {&kv, &scales, &w, &out, &kv_locs, &scratch});
  DeepGemmIndexer x(q, kv, scales, w, kv_locs, scratch);
  DSAKIT_CHECK_ARG(k >= 1, "k: expected >= 1, got ", k);
  for (const Arg* a : {&ks, &ke}) {
    DSAKIT_CHECK_ARG(a->device == dev || a->device.type == Device::kCpu, a->name,
                     ": expected a tensor on ", dev.str(), " or the cpu, got one on ",
                     a->device.str());
    check_tensor(a->view, a->name, DType::kI32, a->device.type, {x.s_q});
  }
  check_tensor(out.view, "out", DType::kI32, dev.type, {x.s_q, k});
  if (x.s_q == 0) return;
  BackendSlot& slot = backend_for(dev);
  nb::gil_scoped_release nogil;
  Call call(slot, stream);
  const auto on_host = [&](const Arg& a) {
    return a.device.type == Device::kCpu ? borrowed(a.view) : call.be.to_host(a.view);
  };
  const Tensor starts = on_host(ks), ends = on_host(ke);
  Tensor lengths = Tensor::host(DType::kI32, {x.s_q});
  for (int64_t i = 0; i < x.s_q; ++i) {
    const int32_t s = starts.ptr<int32_t>()[i], e = ends.ptr<int32_t>()[i];
    DSAKIT_CHECK_ARG(0 <= s && s <= e && e <= x.s_kv, "ks[", i, "], ke[", i, "] = ", s, ", ", e,
                     ": expected 0 <= ks <= ke <= ", x.s_kv, " (the keys of kv)");
    lengths.ptr<int32_t>()[i] = e - s;
  }
  if (x.s_kv == 0) {  // every range empty: all padding
    call.be.fill_bytes(out.view, 0xFF);
    return;
  }
  const Tensor ctx_len = call.be.to_device(lengths);
  const Tensor kv_start = ks.device == dev ? borrowed(ks.view) : call.be.to_device(ks.view);
  x.args.kv_start = kv_start.view();
  x.args.ctx_len = ctx_len.view();
  x.copy_keys(call.be);
  const IndexValueChecksOff unchecked(
      call.be);  // the ranges were checked above, kv_locs is 0 … s_kv-1
  call.be.indexer_topk(x.args, k, out.view);
}

void topk(nb::handle logits_obj, nb::handle lengths_obj, int k, nb::handle out_obj,
          std::optional<uint64_t> stream) {
  const Arg logits = arg(logits_obj, "logits"), lengths = arg(lengths_obj, "lengths"),
            out = arg(out_obj, "out", true);
  const DeviceRef dev = logits.device;
  check_same_device(dev, {&lengths, &out});
  BackendSlot& slot = backend_for(dev);
  nb::gil_scoped_release nogil;
  Call call(slot, stream);
  call.be.topk(logits.view, lengths.view, k, out.view);
}

// ---- FlashAttention varlen: dense_mha_prefill through dense_mha ---------------------------------

struct DenseCall {
  nb::handle q, k, v, cu_q, cu_k, cu_q_host, cu_k_host, out, lse, q_nope, q_pe, k_nope, k_pe,
      kv_visible, kv_mask;
};

void dense_mha(const DenseCall& h, double sm_scale, bool causal, int d_rope, bool check_rope,
               std::optional<uint64_t> stream) {
  const Arg q = arg(h.q, "q"), k = arg(h.k, "k"), v = arg(h.v, "v"),
            cu_q = arg(h.cu_q, "cu_seqlens_q"), cu_k = arg(h.cu_k, "cu_seqlens_k"),
            cu_q_host = arg(h.cu_q_host, "cu_seqlens_q_host", false, true),
            cu_k_host = arg(h.cu_k_host, "cu_seqlens_k_host", false, true),
            out = arg(h.out, "out", true), lse = arg(h.lse, "lse", true),
            q_nope = arg(h.q_nope, "q_nope scratch", true),
            q_pe = arg(h.q_pe, "q_pe scratch", true),
            k_nope = arg(h.k_nope, "k_nope scratch", true),
            k_pe = arg(h.k_pe, "k_pe scratch", true),
            kv_visible = arg(h.kv_visible, "kv_visible scratch", true, true),
            kv_mask = arg(h.kv_mask, "kv_mask", false, true);
  const DeviceRef dev = q.device;
  check_same_device(dev, {&k, &v, &cu_q, &cu_k, &out, &lse, &q_nope, &q_pe, &k_nope, &k_pe,
                          &kv_visible, &kv_mask});
  for (const Arg* a : {&cu_q_host, &cu_k_host})
    if (a->given())
      DSAKIT_CHECK_ARG(a->device.type == Device::kCpu, a->name, ": expected a cpu tensor");
  const auto floats = {DType::kBF16, DType::kF32};
  check_strided_tensor(q.view, "q", floats, dev.type, {-1, -1, -1});
  const int64_t t = q.view.shape[0], heads = q.view.shape[1], d_qk = q.view.shape[2];
  DSAKIT_CHECK_ARG(d_rope > 0 && d_rope < d_qk, "d_rope: expected in (0, ", d_qk, "), got ",
                   d_rope);
  const int64_t d_nope = d_qk - d_rope;
  check_strided_tensor(k.view, "k", {q.view.dtype}, dev.type, {-1, heads, d_qk});
  const int64_t n = k.view.shape[0];
  check_tensor(v.view, "v", {q.view.dtype}, dev.type, {n, heads, -1});
  check_tensor(cu_q.view, "cu_seqlens_q", DType::kI32, dev.type, {-1});
  const int64_t b = cu_q.view.shape[0] - 1;
  DSAKIT_CHECK_ARG(b >= 1, "cu_seqlens_q: expected at least 2 entries, got ",
                   cu_q.view.shape_str());
  check_tensor(cu_k.view, "cu_seqlens_k", DType::kI32, dev.type, {b + 1});
  check_tensor(q_nope.view, "q_nope scratch", {q.view.dtype}, dev.type, {t, heads, d_nope});
  check_tensor(q_pe.view, "q_pe scratch", {q.view.dtype}, dev.type, {t, heads, d_rope});
  check_tensor(k_nope.view, "k_nope scratch", {q.view.dtype}, dev.type, {n, heads, d_nope});
  check_tensor(k_pe.view, "k_pe scratch", {q.view.dtype}, dev.type, {n, d_rope});

  BackendSlot& slot = backend_for(dev);
  DSAKIT_CHECK(causal || slot.backend->capabilities().dense_kv_visible, kUnsupported,
               "dense_mha_prefill: causal=False needs per-query visible counts, which the dense ",
               "kernel of ", slot.backend->capabilities().device_name, " does not have");
  nb::gil_scoped_release nogil;
  Call call(slot, stream);
  Backend& be = call.be;
  const std::vector<int32_t> hq = host_i32(be, cu_q_host.given() ? cu_q_host.view : cu_q.view,
                                           "cu_seqlens_q_host"),
                             hk = host_i32(be, cu_k_host.given() ? cu_k_host.view : cu_k.view,
                                           "cu_seqlens_k_host");
  DSAKIT_CHECK_ARG(int64_t(hq.size()) == b + 1 && int64_t(hk.size()) == b + 1,
                   "cu_seqlens_*_host: expected ", b + 1, " entries");
  // dsakit's dense kernel is MLA's: one k_pe per token, shared by every head. k's rope columns
  // must therefore agree across heads (k = [k_nope, k_pe.expand(H)]); checked on a host copy.
  if (check_rope && heads > 1 && n > 0 && !capturing(be)) {
    const TensorView rope = columns(k.view, d_nope, d_qk);
    const int64_t row = d_rope * int64_t(dtype_size(k.view.dtype));
    std::vector<uint8_t> host(size_t(n * heads * row));
    Rows dst{host.data(), n * heads, row, row, Device::kCpu};
    copy_rows(be, dst, rows_of(rope, "k"));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t hh = 1; hh < heads; ++hh)
        DSAKIT_CHECK_ARG(std::memcmp(host.data() + (i * heads + hh) * row,
                                     host.data() + i * heads * row, size_t(row)) == 0,
                         "k: the rope columns [", d_nope, ", ", d_qk, ") of row ", i, " differ ",
                         "between heads 0 and ", hh, "; dsakit's dense kernel shares one k_pe per ",
                         "token across heads (MLA: k = [k_nope, k_pe.expand(H)]); ",
                         "check_rope=False skips this check");
  }
  // The kernel takes the no-position and RoPE parts as separate contiguous tensors: q and k are
  // split by row copies (k_pe from head 0).
  copy_rows(be, rows_of(q_nope.view, "q_nope"), rows_of(columns(q.view, 0, d_nope), "q"));
  copy_rows(be, rows_of(q_pe.view, "q_pe"), rows_of(columns(q.view, d_nope, d_qk), "q"));
  copy_rows(be, rows_of(k_nope.view, "k_nope"), rows_of(columns(k.view, 0, d_nope), "k"));
  TensorView k_head0 = columns(drop_dim(k.view, 1), d_nope, d_qk);  // [n, d_rope], stride H·d_qk
  k_head0.stride[0] = heads * d_qk;
  copy_rows(be, rows_of(k_pe.view, "k_pe"), rows_of(k_head0, "k"));

  DenseMhaArgs a;
  a.q_nope = q_nope.view;
  a.q_pe = q_pe.view;
  a.k_nope = k_nope.view;
  a.k_pe = k_pe.view;
  a.v = v.view;
  a.cu_q = cu_q.view;
  a.cu_kv = cu_k.view;
  a.cu_q_host = hq.data();
  a.cu_kv_host = hk.data();
  a.num_requests = int(b);
  a.sm_scale = sm_scale;
  a.o = out.view;
  a.lse = lse.view;
  if (kv_mask.given()) a.kv_mask = kv_mask.view;  // checked by the backend (dense_mha)
  std::vector<int32_t> visible;
  if (!causal) {  // every query sees its request's whole kv range
    DSAKIT_CHECK_ARG(kv_visible.given(), "kv_visible scratch: needed when causal=False");
    check_tensor(kv_visible.view, "kv_visible scratch", DType::kI32, dev.type, {t});
    visible.assign(size_t(t), 0);
    for (int64_t r = 0; r < b; ++r)
      for (int32_t i = hq[size_t(r)]; i < hq[size_t(r + 1)] && i < t; ++i)
        if (i >= 0) visible[size_t(i)] = hk[size_t(r + 1)] - hk[size_t(r)];
    be.copy(kv_visible.view, make_view(visible.data(), DType::kI32, Device::kCpu, {t}));
    a.kv_visible = kv_visible.view;
    a.kv_visible_host = visible.data();
  }
  be.dense_mha(a);
}

// ---- top-k positions -> dense_mha_prefill's kv_mask
// -----------------------------------------------

void topk_to_kv_mask(nb::handle positions_h, nb::handle out_h, std::optional<uint64_t> stream) {
  const Arg positions = arg(positions_h, "positions"), out = arg(out_h, "out", true);
  check_same_device(positions.device, {&out});
  BackendSlot& slot = backend_for(positions.device);
  nb::gil_scoped_release nogil;
  Call call(slot, stream);
  call.be.topk_to_kv_mask(positions.view, out.view);
}

nb::object empty(const std::string& dtype, const std::vector<int64_t>& shape,
                 const std::string& device) {
  const DeviceRef dev = parse_device(device);
  BackendSlot& slot = backend_for(dev);
  Tensor t;
  {
    nb::gil_scoped_release nogil;
    Call call(slot, std::nullopt);
    t = call.be.empty(parse_dtype(dtype), shape);
  }
  return export_tensor(t, dev);
}

}  // namespace

void bind_ops(nb::module_& m) {
  nb::module_ ops = m.def_submodule("ops", "Kernel-level ops (raw: outputs and scratch given)");
  ops.def("sparse_mla_prefill", &sparse_mla_prefill, "q"_a.none(), "kv"_a.none(),
          "indices"_a.none(), "sm_scale"_a, "d_v"_a, "topk_length"_a.none(), "out"_a.none(),
          "max_logits"_a.none(), "lse"_a.none(), "stream"_a.none());
  ops.def("sparse_mla_decode", &sparse_mla_decode, "q"_a.none(), "k_cache"_a.none(),
          "indices"_a.none(), "sm_scale"_a, "d_v"_a, "topk_length"_a.none(), "out"_a.none(),
          "lse"_a.none(), "stream"_a.none());
  ops.def("quantize_kv", &quantize_kv, "kv"_a.none(), "packed"_a.none(), "layout"_a, "scales"_a,
          "k_scale"_a, "locs"_a.none(), "stream"_a.none());
  ops.def("dequantize_kv", &dequantize_kv, "packed"_a.none(), "out"_a.none(), "layout"_a,
          "k_scale"_a, "locs"_a.none(), "stream"_a.none());
  ops.def("mqa_logits", &mqa_logits, "q"_a.none(), "kv"_a.none(), "kv_scales"_a.none(),
          "weights"_a.none(), "ke"_a.none(), "logits"_a.none(), "kv_locs"_a.none(),
          "kv_start"_a.none(), "key_scratch"_a.none(), "stream"_a.none());
  ops.def("mqa_topk", &mqa_topk, "q"_a.none(), "kv"_a.none(), "kv_scales"_a.none(),
          "weights"_a.none(), "ks"_a.none(), "ke"_a.none(), "k"_a, "out"_a.none(),
          "kv_locs"_a.none(), "key_scratch"_a.none(), "stream"_a.none());
  ops.def("topk", &topk, "logits"_a.none(), "lengths"_a.none(), "k"_a.none(), "out"_a.none(),
          "stream"_a.none());
  ops.def(
      "dense_mha",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle cu_q, nb::handle cu_k,
         nb::handle cu_q_host, nb::handle cu_k_host, double sm_scale, bool causal, int d_rope,
         bool check_rope, nb::handle out, nb::handle lse, nb::handle q_nope, nb::handle q_pe,
         nb::handle k_nope, nb::handle k_pe, nb::handle kv_visible, nb::handle kv_mask,
         std::optional<uint64_t> stream) {
        dense_mha({q, k, v, cu_q, cu_k, cu_q_host, cu_k_host, out, lse, q_nope, q_pe, k_nope, k_pe,
                   kv_visible, kv_mask},
                  sm_scale, causal, d_rope, check_rope, stream);
      },
      "q"_a.none(), "k"_a.none(), "v"_a.none(), "cu_q"_a.none(), "cu_k"_a.none(),
      "cu_q_host"_a.none(), "cu_k_host"_a.none(), "sm_scale"_a, "causal"_a, "d_rope"_a,
      "check_rope"_a, "out"_a.none(), "lse"_a.none(), "q_nope"_a.none(), "q_pe"_a.none(),
      "k_nope"_a.none(), "k_pe"_a.none(), "kv_visible"_a.none(), "kv_mask"_a.none(),
      "stream"_a.none());
  ops.def("topk_to_kv_mask", &topk_to_kv_mask, "positions"_a.none(), "out"_a.none(),
          "stream"_a.none());
  m.def("empty", &empty, "dtype"_a, "shape"_a, "device"_a,
        "An uninitialized dsakit-allocated tensor (DLPack-capable), for callers without a "
        "framework of their own.");
}

}  // namespace dsakit::py
