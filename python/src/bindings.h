// The binding's Python-facing objects (docs/python.md) and its registration functions.
#pragma once

#include <memory>
#include <optional>

#include "dsakit/layer.h"
#include "python/src/backends.h"
#include "python/src/convert.h"

namespace dsakit::py {

// A latent KV pool owned by Python: made by dsakit on a device, or wrapping the caller's memory
// (`owner` then holds the caller's array). Freed (free()) pools refuse every use.
struct PyKvPool {
  DeviceRef device;
  std::optional<PagedKvPool> pool;
  Arg owner;             // the caller's memory, when wrapped
  nb::object owner_obj;  // ... and the Python object it came from

  PyKvPool() = default;
  PyKvPool(const KvPoolDesc& desc, const DeviceRef& device);
  const PagedKvPool& get(const char* who) const;  // throws kInvalidArgument once freed
  PagedKvPool& get(const char* who);
};

struct PyIndexPool {
  DeviceRef device;
  std::optional<IndexKeyPool> pool;
  Arg owner;
  nb::object owner_obj;

  const IndexKeyPool& get(const char* who) const;
  IndexKeyPool& get(const char* who);
};

// A PreparedBatch and the layer (Python object) it belongs to.
struct PyPrepared {
  PreparedBatch batch;
  nb::object layer_ref;
};

// The tensors of one layer call as Python handed them (o, lse, topk may be None).
struct LayerCallArgs {
  nb::handle q_nope, q_pe, c_kv, k_pe, idx_q, idx_k, idx_w, o, lse, topk;
};

// DsaAttention over two Python pools (kept alive and checked for use after free) and the
// caller's kv_b_proj (kept alive).
struct PyLayer {
  nb::object kv_ref, ix_ref;
  PyKvPool* kv = nullptr;
  PyIndexPool* ix = nullptr;
  Arg weights;
  Arg fp8_codes, fp8_scales;  // kv_b_proj's FP8 form (LayerOptions::kv_b_proj_fp8), optional
  BackendSlot* slot = nullptr;
  std::unique_ptr<DsaAttention> layer;

  PyLayer(const ModelConfig& config, nb::object kv_pool, nb::object index_pool,
          nb::handle kv_b_proj, const LayerOptions& options, nb::handle kv_b_proj_fp8_codes,
          nb::handle kv_b_proj_fp8_scales);
  void check_pools(const char* who) const;
  // (o, lse, topk or None, plan, stages): the given outputs are returned as given.
  nb::tuple forward(nb::handle batch, const LayerCallArgs& args, std::optional<uint64_t> stream);
  // Microseconds per C++ forward over `batch` in a loop of `repeats` (benchmark).
  double time_forward(const Batch& batch, const LayerCallArgs& args, int repeats);
};

void bind_layer(nb::module_& m);
void bind_ops(nb::module_& m);

}  // namespace dsakit::py
