// CPU top-k over indexer logits (docs/design.md#top-k).
//
// Ranking: larger scores first; -0.0 and +0.0 are equal; every NaN ranks below every number
// (-inf included) and NaNs are equal to each other; equal scores go to the lower position.
// A row with ctx_len <= k selects all of 0 … ctx_len-1 without reading its scores.
//
// A row with ctx_len > k is solved by radix select on order-preserving 32-bit keys: three digit
// passes find the key of the k-th best entry (the threshold) and how many entries equal to it
// are still needed; one scan in position order then emits every entry above the threshold and
// the first `needed` entries equal to it. The output is ascending by construction.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "src/cpu/kernels.h"

namespace dsakit::cpu {
namespace {

// Unsigned order of the key = ranking order of the score (see the file comment). NaN -> 0,
// which no number reaches (-inf maps to 0x007FFFFF).
inline uint32_t rank_key(float score) {
  uint32_t u = f32_bits(score);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0;  // NaN
  if (u == 0x80000000u) u = 0;                    // -0.0 ranks as +0.0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Radix digits, most significant first: bits [21, 32), [10, 21), [0, 10).
constexpr int kNumDigits = 3;
constexpr std::array<int, kNumDigits> kDigitShift = {21, 10, 0};
constexpr std::array<int, kNumDigits> kDigitBits = {11, 11, 10};
constexpr int kMaxBins = 1 << 11;

// Selects the k best of scores[0, ctx) (ctx > k) into out[0, k), ascending.
// candidates: scratch of at least ctx entries.
void select_row(const float* scores, int64_t ctx, int k, uint32_t* candidates, int32_t* out) {
  std::array<int64_t, kMaxBins> hist;
  uint32_t prefix = 0;  // digits of the threshold key chosen so far
  int64_t needed = k;   // entries still to take among keys matching `prefix`
  int64_t num_candidates = 0;
  for (int d = 0; d < kNumDigits; ++d) {
    const int shift = kDigitShift[size_t(d)];
    const uint32_t bins = 1u << kDigitBits[size_t(d)];
    std::fill_n(hist.begin(), bins, 0);
    if (d == 0) {
      for (int64_t p = 0; p < ctx; ++p) {
        const uint32_t key = rank_key(scores[p]);
        candidates[p] = key;
        ++hist[key >> shift];
      }
      num_candidates = ctx;
    } else {
      for (int64_t i = 0; i < num_candidates; ++i) ++hist[(candidates[i] >> shift) & (bins - 1)];
    }
    // The bin holding the needed-th best key, counting from the top bin down.
    uint32_t bin = bins - 1;
    while (hist[bin] < needed) needed -= hist[bin--];
    prefix |= bin << shift;
    if (d + 1 == kNumDigits) break;
    // Keep only the keys that still match the threshold's digits so far.
    const uint32_t high_mask = ~0u << shift;
    int64_t kept = 0;
    for (int64_t i = 0; i < num_candidates; ++i)
      if ((candidates[i] & high_mask) == prefix) candidates[kept++] = candidates[i];
    num_candidates = kept;
  }
  const uint32_t threshold = prefix;
  int n = 0;
  for (int64_t p = 0; p < ctx && n < k; ++p) {
    const uint32_t key = rank_key(scores[p]);
    if (key > threshold || (key == threshold && needed-- > 0)) out[n++] = int32_t(p);
  }
}

}  // namespace

void topk(const CpuContext& ctx, const TensorView& logits, const TensorView& ctx_len, int k,
          const TensorView& out) {
  const int64_t rows = logits.shape[0], width = logits.shape[1];
  const float* scores = logits.ptr<const float>();
  const int32_t* lens = ctx_len.ptr<const int32_t>();
  int32_t* selected = out.ptr<int32_t>();
#pragma omp parallel num_threads(ctx.threads)
  {
    std::vector<uint32_t> candidates;
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t len = lens[r];
      int32_t* row_out = selected + r * k;
      const int64_t n = std::min<int64_t>(len, k);
      if (len <= k) {
        for (int64_t j = 0; j < n; ++j) row_out[j] = int32_t(j);
      } else {
        candidates.resize(size_t(len));
        select_row(scores + r * width, len, k, candidates.data(), row_out);
      }
      std::fill(row_out + n, row_out + k, -1);
    }
  }
}

}  // namespace dsakit::cpu
