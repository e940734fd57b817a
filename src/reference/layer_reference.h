// float64 reference of whole layer outputs for chosen tokens, read back from pool snapshots
// (docs/design.md#what-the-library-computes, docs/numerics.md): the KV a token attends to is
// decoded from the pool bytes by the reference's own decoder, the top-k comes from the reference
// indexer over the index-key pool.
#pragma once

#include <cstdint>
#include <vector>

#include "dsakit/config.h"
#include "dsakit/pool.h"
#include "dsakit/tensor.h"
#include "src/reference/reference.h"

namespace dsakit::reference {

struct LayerSnapshot {
  const ModelConfig* config = nullptr;
  double sm_scale = 0;
  // Host tensors over every position of every request (row offset(r) + p), as TokenStore.
  std::vector<int32_t> lengths;
  TensorView q_nope, q_pe, idx_q, idx_w;  // [rows, ...]
  TensorView kv_b_proj;                   // bf16 [H*(d_nope+d_v), d_c]
  // Host copies of the pools after the run, and each request's page table.
  KvPoolDesc kv_desc;
  TensorView kv_storage;  // u8 [locations, bytes_per_token]
  IndexKeyPoolDesc index_desc;
  TensorView index_storage;  // u8 [pages, page_bytes]
  std::vector<std::vector<int32_t>> page_tables;
  // Round at the backend's intermediate points (CUDA: bf16 q_abs and o_lat on the sparse path,
  // bf16 up-projected k_nope / v on the dense path), so the comparison measures the kernels, not
  // the precision the intermediates were designed with.
  bool bf16_intermediates = false;
  // With bf16_intermediates: the dense path's K/V came from the FP8 up-projection, whose
  // block-scaled GEMM reads the latent as the pool decodes it (e4m3 codes and tile scales), not
  // rounded to bf16 by a gather.
  bool fp8_up_projection = false;
  // The weights the dense path's K/V came from where they differ from kv_b_proj (f32 or f64,
  // same shape): FP8 block weights decoded, e4m3(code) · block scale, of which kv_b_proj is the
  // bf16 rounding. Empty: kv_b_proj. Dense queries (all_positions) read it, sparse ones
  // kv_b_proj, as the layer's two paths do.
  TensorView kv_b_proj_dense;
};

struct TokenQuery {
  int request = 0;
  int32_t pos = 0;
  bool all_positions = false;  // attend to every visible position (dense path), else top-k
  // Attend through the dense path's up-projected K/V (its weights and, with bf16_intermediates,
  // its bf16 roundings) rather than the absorbed form: the dense path, and the sparse path's
  // masked-MHA form (LayerOptions::sparse_form) over the top-k. all_positions implies it.
  bool dense_kv = false;
};

struct LayerReference {
  Vec o;                                       // [queries, H, d_v]
  Vec lse;                                     // [queries, H]
  std::vector<std::vector<int32_t>> selected;  // positions attended, ascending, per query
};

LayerReference layer_outputs(const LayerSnapshot& snap, const std::vector<TokenQuery>& queries);

// The largest lse difference between two correct runs with bf16 intermediates that round at
// different points (dense vs sparse path: bf16 k_nope against bf16 q_abs, each a 2^-9 relative
// perturbation per element; docs/numerics.md).
inline constexpr double kLseBoundAcrossPaths = 3e-2;

// The largest lse difference a correct backend may show against layer_outputs(snap)
// (docs/numerics.md#layer-level-bounds-with-bf16-intermediates--a-decision): 1e-3 with f32
// intermediates; 5e-3 with bf16 ones (a product within fp32-accumulation error of a bf16 rounding
// boundary may round either way); 3e-2 after the FP8 up-projection, whose tensor-core
// accumulation within each 128-wide k block is narrower than fp32, so K elements land on the
// neighbouring bf16 value far more often than the reference can mirror (score noise at most that
// of rounding every K element independently: the cross-path bound).
double lse_bound(const LayerSnapshot& snap);

}  // namespace dsakit::reference
