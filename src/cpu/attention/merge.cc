// Exact merge of partial attention results by their log-sum-exp (DCP, docs/layer.md).
//
// For each (token, head): over the W parts whose lse is not +inf (+inf marks a part with no valid
// key), m = max lse_w, lse = m + log Σ exp(lse_w - m), o = Σ exp(lse_w - lse) · o_w.
// No such part: o = 0, lse = +inf (all such parts at lse = -inf: o = 0, lse = -inf). NaN in a
// part's lse or o propagates to that (token, head). bf16 parts are widened to fp32 exactly, so
// they merge as the f32 parts of the same values would.
#include <cmath>
#include <limits>
#include <vector>

#include "src/cpu/gemm/blas.h"
#include "src/cpu/kernels.h"

namespace dsakit::cpu {

void merge_partials(const CpuContext& ctx, const TensorView& o_parts, const TensorView& lse_parts,
                    const TensorView& o, const TensorView& lse) {
  const int64_t parts = o_parts.shape[0];
  const int64_t rows = o_parts.shape[1] * o_parts.shape[2];  // (token, head) pairs
  const int64_t dim = o_parts.shape[3];
  const bool parts_f32 = o_parts.dtype == DType::kF32;  // else bf16; [W, rows, dim]
  const float* lse_in = lse_parts.ptr<const float>();   // [W, rows]
  float* lse_out = lse.ptr<float>();
  constexpr float kInf = std::numeric_limits<float>::infinity();

#pragma omp parallel num_threads(ctx.threads)
  {
    std::vector<float> acc(static_cast<size_t>(dim));
    std::vector<float> widened(parts_f32 ? 0 : static_cast<size_t>(dim));  // one bf16 part row
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      float max = -kInf;
      bool any = false, nan = false;
      for (int64_t w = 0; w < parts; ++w) {
        const float l = lse_in[w * rows + row];
        nan |= std::isnan(l);
        if (l == kInf) continue;
        any = true;
        max = std::max(max, l);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      float merged_lse = kInf;
      if (nan) {
        std::fill(acc.begin(), acc.end(), std::numeric_limits<float>::quiet_NaN());
        merged_lse = std::numeric_limits<float>::quiet_NaN();
      } else if (any && max == -kInf) {  // every non-empty part has zero mass
        merged_lse = -kInf;
      } else if (any) {
        float sum = 0.0f;
        for (int64_t w = 0; w < parts; ++w) {
          const float l = lse_in[w * rows + row];
          if (l != kInf) sum += std::exp(l - max);
        }
        merged_lse = max + std::log(sum);
        for (int64_t w = 0; w < parts; ++w) {
          const float l = lse_in[w * rows + row];
          if (l == kInf) continue;
          const float weight = std::exp(l - merged_lse);
          const int64_t offset = (w * rows + row) * dim;
          const float* src = widened.data();
          if (parts_f32)
            src = o_parts.ptr<const float>() + offset;
          else
            load_f32(o_parts, offset, dim, widened.data());
          for (int64_t d = 0; d < dim; ++d) acc[size_t(d)] += weight * src[d];
        }
      }
      lse_out[row] = merged_lse;
      store_f32(o, row * dim, dim, acc.data());
    }
  }
}

}  // namespace dsakit::cpu
