// The paged MLA KV pool and the indexer-key pool (docs/formats.md).
//
// Location of position p of a request: loc = page_table[p / page_size] * page_size + p % page_size.
// A latent pool's storage is u8 [num_pages * page_size, bytes_per_token]: one row per location.
//
// Latent layouts, bytes per token for d_c = 512, d_rope = 64:
//   bf16     1152 B  [0, 2*d_c) c_kv bf16 | [2*d_c, 2*d_c + 2*d_rope) k_pe bf16
//   fp8       656 B  [0, d_c) c_kv e4m3 | [d_c, d_c + 4*d_c/128) fp32 LE scale per 128-tile |
//                    then d_rope bf16 k_pe (not quantized)
//   fp8-raw   576 B  d_c + d_rope e4m3 values of x / k_scale (one fp32 k_scale per pool)
// Index-key pool storage is u8 [num_pages, page_size * (d_i + 4)]: per page, page_size * d_i e4m3
// bytes, then page_size fp32 scales (power-of-two, docs/formats.md#scale-rules).
#pragma once

#include <cstdint>
#include <string>

#include "dsakit/formats.h"
#include "dsakit/tensor.h"

namespace dsakit {

const char* to_string(KvLayout layout);             // "bf16" | "fp8" | "fp8-raw"
KvLayout parse_kv_layout(const std::string& name);  // throws naming the accepted names
const char* to_string(ScalePolicy policy);          // "amax" | "pow2"
ScalePolicy parse_scale_policy(const std::string& name);

struct KvPoolDesc {
  KvLayout layout = KvLayout::kBf16;
  int page_size = 64;
  int64_t num_pages = 0;
  int d_c = 512;
  int d_rope = 64;
  // fp8 only. What the pool's tile scales are: amax reads any scales exactly (the mma.sync sparse
  // kernel); declare pow2 only for scales that are powers of two (the wgmma kernel reads those).
  // dsakit's own writers (dsakit run / bench / calibrate, Python KvPool) default to pow2.
  ScalePolicy scale_policy = ScalePolicy::kAmax;
  float k_scale = 1.0f;  // fp8-raw only

  KvRowLayout row() const { return {layout, d_c, d_rope}; }
  int bytes_per_token() const { return row().bytes_per_token(); }
  int64_t num_locations() const { return num_pages * page_size; }
  void validate() const;  // throws naming the field
  std::string summary() const;
};

struct IndexKeyPoolDesc {
  int page_size = 64;
  int64_t num_pages = 0;
  int d_i = 128;

  int bytes_per_token() const { return d_i + 4; }
  int64_t page_bytes() const { return int64_t(page_size) * bytes_per_token(); }
  int64_t num_locations() const { return num_pages * page_size; }
  void validate() const;
};

// A latent KV pool: a typed description plus its storage on one device.
class PagedKvPool {
 public:
  PagedKvPool() = default;
  // storage: u8 [num_locations, bytes_per_token], contiguous.
  PagedKvPool(const KvPoolDesc& desc, Tensor storage);

  const KvPoolDesc& desc() const { return desc_; }
  KvLayout layout() const { return desc_.layout; }
  Device device() const { return storage_.device(); }
  const TensorView& storage() const { return storage_.view(); }
  // The storage with its ownership (a view taken from it keeps the memory alive).
  const Tensor& storage_tensor() const { return storage_; }

  // Typed access: throws Error(kLayoutMismatch) naming both layouts, e.g.
  //   "gather_kv: pool layout is fp8-raw (576 B/token) but the caller expects fp8 (656 B/token)".
  void expect_layout(KvLayout expected, const char* who) const;

 private:
  KvPoolDesc desc_;
  Tensor storage_;
};

class IndexKeyPool {
 public:
  IndexKeyPool() = default;
  // storage: u8 [num_pages, page_bytes], contiguous.
  IndexKeyPool(const IndexKeyPoolDesc& desc, Tensor storage);

  const IndexKeyPoolDesc& desc() const { return desc_; }
  Device device() const { return storage_.device(); }
  const TensorView& storage() const { return storage_.view(); }
  const Tensor& storage_tensor() const { return storage_; }

 private:
  IndexKeyPoolDesc desc_;
  Tensor storage_;
};

// True when bf16 holds every value the pool's rows can decode to, so a bf16 copy of its rows is
// the pool exactly: bf16 pools; fp8 pools with pow2 tile scales; fp8-raw pools whose k_scale is
// a power of two (an e4m3 value has 4 significant bits, bf16 8, and the exponents stay in
// bf16's normal range).
bool bf16_holds_pool_values(const KvPoolDesc& desc);

// Checks a location list (i32 [n]) on the host: every entry in [0, num_locations).
void check_locations(const TensorView& locs, int64_t num_locations, const char* name);

}  // namespace dsakit
