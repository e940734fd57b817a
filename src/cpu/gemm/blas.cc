#include "src/cpu/gemm/blas.h"

#include <mutex>

namespace dsakit::cpu {
namespace {

// The guards' shared state (see ScopedBlasThreads): how many are alive and the count to restore.
std::mutex g_blas_mutex;
int g_blas_guards = 0;
int g_blas_saved = 0;

}  // namespace

ScopedBlasThreads::ScopedBlasThreads(int threads) {
  const std::lock_guard<std::mutex> lock(g_blas_mutex);
  if (g_blas_guards++ > 0) return;
  g_blas_saved = openblas_get_num_threads();
  if (g_blas_saved != threads) openblas_set_num_threads(threads);
}

ScopedBlasThreads::~ScopedBlasThreads() {
  const std::lock_guard<std::mutex> lock(g_blas_mutex);
  if (--g_blas_guards > 0) return;
  if (openblas_get_num_threads() != g_blas_saved) openblas_set_num_threads(g_blas_saved);
}

}  // namespace dsakit::cpu
