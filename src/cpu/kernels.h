// CPU kernels, one function per op of the Backend interface (dsakit/backend.h documents the
// arguments and shapes). Arguments arrive validated by CpuBackend; kernels only compute.
// Parallel over OpenMP with ctx.threads threads; GEMMs through CBLAS (OpenBLAS).
#pragma once

#include <array>

#include "dsakit/backend.h"
#include "src/core/fp8_decode.h"

namespace dsakit::cpu {

struct CpuContext {
  int threads = 1;
};

// pool/kv_store_gather.cc
void store_kv(const CpuContext& ctx, PagedKvPool& pool, const TensorView& locs,
              const TensorView& c_kv, const TensorView& k_pe);
void gather_kv(const CpuContext& ctx, const PagedKvPool& pool, const TensorView& locs,
               const TensorView& c_kv, const TensorView& k_pe);
void store_index_keys(const CpuContext& ctx, IndexKeyPool& pool, const TensorView& locs,
                      const TensorView& idx_k);
// indexer/indexer.cc
void indexer_quantize_q(const CpuContext& ctx, const TensorView& idx_q, const TensorView& idx_w,
                        const TensorView& q8, const TensorView& gate);
void indexer_logits(const CpuContext& ctx, const IndexerArgs& args, int64_t row_begin,
                    int64_t row_end, const TensorView& logits, const IndexerLogitsOptions& options);
// indexer/topk.cc
void topk(const CpuContext& ctx, const TensorView& logits, const TensorView& ctx_len, int k,
          const TensorView& out);

// gemm/projections.cc
void absorb_q(const CpuContext& ctx, const TensorView& q_nope, const TensorView& kv_b_proj, int d_v,
              const TensorView& q_abs);
void up_proj_v(const CpuContext& ctx, const TensorView& o_lat, const TensorView& kv_b_proj,
               int d_nope, const TensorView& o);
void up_proj_kv(const CpuContext& ctx, const TensorView& c_kv, const TensorView& kv_b_proj,
                const TensorView& k_nope, const TensorView& v);
void up_proj_kv_fp8(const CpuContext& ctx, const PagedKvPool& pool, const TensorView& locs,
                    const Fp8BlockWeights& w, const TensorView& k_nope, const TensorView& v,
                    const TensorView& k_pe);

// attention/sparse_mla.cc, attention/dense_mha.cc, attention/merge.cc
void sparse_mla(const CpuContext& ctx, const SparseMlaArgs& args);
void dense_mha(const CpuContext& ctx, const DenseMhaArgs& args);
void merge_partials(const CpuContext& ctx, const TensorView& o_parts, const TensorView& lse_parts,
                    const TensorView& o, const TensorView& lse);

// dcp/dcp_ops.cc
void select_rows(const CpuContext& ctx, const TensorView& src, const TensorView& rows,
                 const TensorView& dst);
void merge_topk(const CpuContext& ctx, const TensorView& scores, const TensorView& positions, int k,
                const TensorView& out);

}  // namespace dsakit::cpu
