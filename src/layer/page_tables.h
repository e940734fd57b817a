// Page tables for a set of requests: disjoint pages drawn from a shuffled pool. Library-internal
// (the DCP simulation's per-rank tables); the CLI, tests and benchmarks reach it through
// tools/harness.h.
#pragma once

#include <cstdint>
#include <vector>

namespace dsakit {

// Page tables for `lengths` tokens per request: disjoint pages from a shuffled pool of
// `num_pages` (seeded). Throws if the pool is too small.
std::vector<std::vector<int32_t>> allocate_pages(const std::vector<int32_t>& lengths, int page_size,
                                                 int64_t num_pages, uint64_t seed);

}  // namespace dsakit
