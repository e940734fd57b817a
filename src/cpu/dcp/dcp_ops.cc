// CPU ops of context parallelism (docs/layer.md): row selection and the merge of the shards'
// top-k candidates.
//
// merge_topk ranks a row's candidates by a 64-bit key, larger = better:
//   invalid (position < 0)  -> 0
//   valid                   -> ordered(score) << 32 | (0xFFFFFFFF - position)
// ordered() maps floats to uint32 in float order (-0 and +0 share one key, as a float comparison
// treats them) with every NaN at 1, below -inf (0x007FFFFF) and above an invalid candidate. With
// distinct positions the keys of a row are distinct, so the k largest are one set: higher score
// first, ties to the lower position. The chosen positions are written in ascending order.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "src/cpu/kernels.h"

namespace dsakit::cpu {
namespace {

inline uint32_t ordered(float score) {
  uint32_t u = f32_bits(score);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return 1u;  // NaN
  if (magnitude == 0u) u = 0u;             // -0.0 ranks as +0.0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline uint64_t candidate_key(float score, int32_t position) {
  if (position < 0) return 0;
  return uint64_t(ordered(score)) << 32 | (0xFFFFFFFFu - uint32_t(position));
}

}  // namespace

void select_rows(const CpuContext& ctx, const TensorView& src, const TensorView& rows,
                 const TensorView& dst) {
  const int64_t m = rows.shape[0], n = src.shape[0];
  if (m == 0) return;
  const size_t row_bytes = dst.nbytes() / size_t(m);
  if (row_bytes == 0) return;
  const int32_t* index = rows.ptr<const int32_t>();
  const char* from = static_cast<const char*>(src.data);
  char* to = static_cast<char*>(dst.data);
  // Threads only pay off for many bytes; a row index out of [0, N) writes nothing.
  const bool parallel = int64_t(row_bytes) * m >= (int64_t(1) << 20);
#pragma omp parallel for num_threads(ctx.threads) schedule(static) if (parallel)
  for (int64_t i = 0; i < m; ++i) {
    const int32_t r = index[i];
    if (r >= 0 && r < n)
      std::memcpy(to + size_t(i) * row_bytes, from + size_t(r) * row_bytes, row_bytes);
  }
}

void merge_topk(const CpuContext& ctx, const TensorView& scores, const TensorView& positions, int k,
                const TensorView& out) {
  const int64_t shards = scores.shape[0], tokens = scores.shape[1], c = scores.shape[2];
  const float* score = scores.ptr<const float>();       // [W, T, C]
  const int32_t* pos = positions.ptr<const int32_t>();  // [W, T, C]
  int32_t* selected = out.ptr<int32_t>();               // [T, k]
#pragma omp parallel num_threads(ctx.threads)
  {
    std::vector<uint64_t> keys;
    std::vector<int32_t> chosen;
#pragma omp for schedule(dynamic, 16)
    for (int64_t t = 0; t < tokens; ++t) {
      chosen.clear();
      for (int64_t w = 0; w < shards; ++w)
        for (int64_t j = 0; j < c; ++j) {
          const int32_t p = pos[(w * tokens + t) * c + j];
          if (p >= 0) chosen.push_back(p);
        }
      if (chosen.size() > size_t(k)) {  // rank by key; a row of at most k reads no scores
        keys.clear();
        for (int64_t w = 0; w < shards; ++w)
          for (int64_t j = 0; j < c; ++j) {
            const int64_t i = (w * tokens + t) * c + j;
            if (pos[i] >= 0) keys.push_back(candidate_key(score[i], pos[i]));
          }
        std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(),
                         std::greater<uint64_t>());
        chosen.resize(size_t(k));
        for (int j = 0; j < k; ++j)
          chosen[size_t(j)] = int32_t(0xFFFFFFFFu - uint32_t(keys[size_t(j)]));
      }
      std::sort(chosen.begin(), chosen.end());
      int32_t* row_out = selected + t * k;
      std::copy(chosen.begin(), chosen.end(), row_out);
      std::fill(row_out + chosen.size(), row_out + k, -1);
    }
  }
}

}  // namespace dsakit::cpu
