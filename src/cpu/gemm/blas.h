// fp32 GEMM plumbing shared by the CPU projection and attention kernels: row-major CBLAS
// wrappers, the OpenBLAS thread scope, and staging of bf16 | f32 tensors as fp32 operands.
//
// Threading model: every CPU kernel parallelizes with OpenMP (ctx.threads) and calls sgemm from
// inside its parallel region on small per-thread tiles, so OpenBLAS must not start threads of its
// own (nested pools oversubscribe the cores, and OpenBLAS's pthread server serializes concurrent
// multi-threaded calls). Kernels hold a ScopedBlasThreads(1) for their duration.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "dsakit/formats.h"
#include "dsakit/tensor.h"

namespace dsakit::cpu {

// Holds OpenBLAS's (process-wide) thread count at `threads` while any guard is alive: the first
// guard to enter saves the count and sets it, the last to leave restores it, so concurrent CPU
// kernels on several host threads (all asking for 1) never see it change under them. A guard
// asking for another count while others are alive keeps theirs (only the benchmark's ceiling
// GEMM asks for more than 1).
class ScopedBlasThreads {
 public:
  explicit ScopedBlasThreads(int threads);
  ~ScopedBlasThreads();
  ScopedBlasThreads(const ScopedBlasThreads&) = delete;
  ScopedBlasThreads& operator=(const ScopedBlasThreads&) = delete;
};

// Row-major C[m, n] = alpha · A[m, k] · op(B) + beta · C, op(B) = B [k, n] or B^T with B [n, k].
// beta == 0 overwrites C without reading it (NaN in stale C does not leak).
inline void sgemm(bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                  int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, int(m), int(n),
              int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
}

// n consecutive elements of a bf16 | f32 tensor, from element `offset`, as fp32.
inline void load_f32(const TensorView& t, int64_t offset, int64_t n, float* dst) {
  if (t.dtype == DType::kF32) {
    const float* src = t.ptr<const float>() + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
  } else {
    const bf16_t* src = t.ptr<const bf16_t>() + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
  }
}

// Writes n fp32 values into a bf16 | f32 tensor from element `offset` (bf16: round to nearest).
inline void store_f32(const TensorView& t, int64_t offset, int64_t n, const float* src) {
  if (t.dtype == DType::kF32) {
    float* dst = t.ptr<float>() + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
  } else {
    bf16_t* dst = t.ptr<bf16_t>() + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
  }
}

// Calls fn(begin, count) over [0, n) in chunks spread across `threads` OpenMP threads.
template <typename Fn>
void parallel_chunks(int64_t n, int threads, Fn&& fn) {
  constexpr int64_t kChunk = 1 << 14;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) fn(c * kChunk, std::min(kChunk, n - c * kChunk));
}

inline std::unique_ptr<float[]> alloc_f32(int64_t n) {
  return std::unique_ptr<float[]>(new float[size_t(n > 0 ? n : 1)]);
}

// A bf16 | f32 tensor as contiguous fp32: the tensor's own storage when it is f32, else a copy
// converted once (in parallel) at construction.
class F32Operand {
 public:
  F32Operand(const TensorView& t, int threads) {
    if (t.dtype == DType::kF32) {
      data_ = t.ptr<const float>();
      return;
    }
    copy_ = alloc_f32(t.numel());
    float* dst = copy_.get();
    parallel_chunks(t.numel(), threads,
                    [&](int64_t begin, int64_t n) { load_f32(t, begin, n, dst + begin); });
    data_ = dst;
  }
  const float* data() const { return data_; }

 private:
  const float* data_ = nullptr;
  std::unique_ptr<float[]> copy_;
};

// An fp32 destination for a bf16 | f32 output tensor: kernels write data() (contiguous, the
// tensor's shape); commit() rounds it into a bf16 tensor (a no-op for f32, written in place).
class F32Result {
 public:
  explicit F32Result(const TensorView& t) : out_(t) {
    if (t.dtype == DType::kF32) {
      data_ = t.ptr<float>();
    } else {
      staging_ = alloc_f32(t.numel());
      data_ = staging_.get();
    }
  }
  float* data() const { return data_; }
  void commit(int threads) const {
    if (!staging_) return;
    parallel_chunks(out_.numel(), threads,
                    [&](int64_t begin, int64_t n) { store_f32(out_, begin, n, data_ + begin); });
  }

 private:
  TensorView out_;
  float* data_ = nullptr;
  std::unique_ptr<float[]> staging_;
};

}  // namespace dsakit::cpu
