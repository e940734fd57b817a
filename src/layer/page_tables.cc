#include "src/layer/page_tables.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "dsakit/error.h"

namespace dsakit {

std::vector<std::vector<int32_t>> allocate_pages(const std::vector<int32_t>& lengths, int page_size,
                                                 int64_t num_pages, uint64_t seed) {
  DSAKIT_CHECK_ARG(page_size >= 1, "page_size: expected >= 1, got ", page_size);
  int64_t needed = 0;
  for (int32_t l : lengths) needed += (int64_t(l) + page_size - 1) / page_size;
  DSAKIT_CHECK(needed <= num_pages, kResource, "the requests need ", needed, " pages of ",
               page_size, " tokens but the pool has ", num_pages);
  std::vector<int32_t> ids(static_cast<size_t>(num_pages));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 gen(seed);
  std::shuffle(ids.begin(), ids.end(), gen);
  std::vector<std::vector<int32_t>> tables(lengths.size());
  size_t next = 0;
  for (size_t r = 0; r < lengths.size(); ++r) {
    const int64_t pages = (int64_t(lengths[r]) + page_size - 1) / page_size;
    tables[r].assign(ids.begin() + int64_t(next), ids.begin() + int64_t(next) + pages);
    next += size_t(pages);
  }
  return tables;
}

}  // namespace dsakit
