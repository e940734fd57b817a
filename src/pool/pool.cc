#include "dsakit/pool.h"

#include <cmath>
#include <sstream>

#include "dsakit/error.h"

namespace dsakit {

const char* to_string(KvLayout layout) {
  switch (layout) {
    case KvLayout::kBf16:
      return "bf16";
    case KvLayout::kFp8Scaled:
      return "fp8";
    case KvLayout::kFp8Raw:
      return "fp8-raw";
  }
  return "?";
}

KvLayout parse_kv_layout(const std::string& name) {
  if (name == "bf16") return KvLayout::kBf16;
  if (name == "fp8") return KvLayout::kFp8Scaled;
  if (name == "fp8-raw") return KvLayout::kFp8Raw;
  DSAKIT_FAIL(kInvalidArgument, "kv layout: expected bf16, fp8 or fp8-raw, got '", name, "'");
}

const char* to_string(ScalePolicy policy) {
  return policy == ScalePolicy::kAmax ? "amax" : "pow2";
}

ScalePolicy parse_scale_policy(const std::string& name) {
  if (name == "amax") return ScalePolicy::kAmax;
  if (name == "pow2") return ScalePolicy::kPow2;
  DSAKIT_FAIL(kInvalidArgument, "fp8 scale policy: expected amax or pow2, got '", name, "'");
}

void KvPoolDesc::validate() const {
  DSAKIT_CHECK_ARG(page_size >= 1, "kv pool page_size: expected >= 1, got ", page_size);
  DSAKIT_CHECK_ARG(num_pages >= 1, "kv pool num_pages: expected >= 1, got ", num_pages);
  DSAKIT_CHECK_ARG(num_locations() <= INT32_MAX,
                   "kv pool: num_pages * page_size = ", num_locations(),
                   " exceeds the int32 location range");
  DSAKIT_CHECK_ARG(d_c > 0 && d_c % kFp8TileSize == 0,
                   "kv pool d_c: expected a positive multiple of 128, got ", d_c);
  DSAKIT_CHECK_ARG(d_rope > 0 && d_rope % 8 == 0,
                   "kv pool d_rope: expected a positive multiple of 8, got ", d_rope);
  DSAKIT_CHECK_ARG(layout != KvLayout::kFp8Raw || (k_scale > 0 && k_scale < 1e30f),
                   "kv pool k_scale: expected a finite value > 0, got ", k_scale);
}

std::string KvPoolDesc::summary() const {
  std::ostringstream os;
  os << to_string(layout) << " (" << bytes_per_token() << " B/token";
  if (layout == KvLayout::kFp8Scaled) os << ", " << to_string(scale_policy) << " scales";
  if (layout == KvLayout::kFp8Raw) os << ", k_scale " << k_scale;
  os << "), " << num_pages << " pages x " << page_size;
  return os.str();
}

void IndexKeyPoolDesc::validate() const {
  DSAKIT_CHECK_ARG(page_size >= 1, "index pool page_size: expected >= 1, got ", page_size);
  DSAKIT_CHECK_ARG(num_pages >= 1, "index pool num_pages: expected >= 1, got ", num_pages);
  DSAKIT_CHECK_ARG(num_locations() <= INT32_MAX,
                   "index pool: num_pages * page_size = ", num_locations(),
                   " exceeds the int32 location range");
  DSAKIT_CHECK_ARG(d_i > 0 && d_i % 16 == 0,
                   "index pool d_i: expected a positive multiple of 16, got ", d_i);
}

PagedKvPool::PagedKvPool(const KvPoolDesc& desc, Tensor storage)
    : desc_(desc), storage_(std::move(storage)) {
  desc_.validate();
  // Rows of another layout's width: the classic "576 != 656" mix-up, named as such.
  const TensorView& st = storage_.view();
  if (st.ndim == 2 && st.shape[1] != desc_.bytes_per_token()) {
    for (KvLayout other : {KvLayout::kBf16, KvLayout::kFp8Scaled, KvLayout::kFp8Raw}) {
      const KvRowLayout row{other, desc_.d_c, desc_.d_rope};
      DSAKIT_CHECK(st.shape[1] != row.bytes_per_token(), kLayoutMismatch,
                   "kv pool storage: rows of ", st.shape[1], " B are the ", to_string(other),
                   " layout, but the pool is declared ", to_string(desc_.layout), " (",
                   desc_.bytes_per_token(), " B/token)");
    }
  }
  check_tensor(storage_.view(), "kv pool storage", DType::kU8, storage_.device(),
               {desc_.num_locations(), desc_.bytes_per_token()});
}

void PagedKvPool::expect_layout(KvLayout expected, const char* who) const {
  if (expected == desc_.layout) return;
  const KvRowLayout want{expected, desc_.d_c, desc_.d_rope};
  DSAKIT_FAIL(kLayoutMismatch, who, ": pool layout is ", to_string(desc_.layout), " (",
              desc_.bytes_per_token(), " B/token) but the caller expects ", to_string(expected),
              " (", want.bytes_per_token(), " B/token)");
}

IndexKeyPool::IndexKeyPool(const IndexKeyPoolDesc& desc, Tensor storage)
    : desc_(desc), storage_(std::move(storage)) {
  desc_.validate();
  check_tensor(storage_.view(), "index pool storage", DType::kU8, storage_.device(),
               {desc_.num_pages, desc_.page_bytes()});
}

bool bf16_holds_pool_values(const KvPoolDesc& desc) {
  switch (desc.layout) {
    case KvLayout::kBf16:
      return true;
    case KvLayout::kFp8Scaled:
      return desc.scale_policy == ScalePolicy::kPow2;
    case KvLayout::kFp8Raw: {
      // A power of two whose smallest product (the subnormal code 2^-9) is a normal bf16.
      int exponent = 0;
      return std::frexp(desc.k_scale, &exponent) == 0.5f && exponent - 1 - 9 >= -126;
    }
  }
  return false;
}

void check_locations(const TensorView& locs, int64_t num_locations, const char* name) {
  check_tensor(locs, name, DType::kI32, Device::kCpu, {-1});
  const int32_t* p = locs.ptr<const int32_t>();
  for (int64_t i = 0; i < locs.numel(); ++i) {
    DSAKIT_CHECK_ARG(p[i] >= 0 && p[i] < num_locations, name, "[", i,
                     "]: expected a pool location in [0, ", num_locations, "), got ", p[i]);
  }
}

}  // namespace dsakit
