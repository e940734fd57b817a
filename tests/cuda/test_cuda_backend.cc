// The CUDA backend against the CPU backend (bit-exact for pool bytes, gathers and top-k) and the
// float64 reference (GEMMs, logits, merge), plus what only a GPU backend has: determinism,
// workspace reuse, user streams and CUDA-graph capture. Skipped without a CUDA device.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/error.h"
#include "src/cuda/common/fast_divmod.h"
#include "src/cuda/cuda_backend.h"
#include "src/reference/reference.h"
#include "tests/common/test_util.h"

namespace dsakit {
namespace {

using testing::Rng;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

Tensor host_i32(const std::vector<int32_t>& v, std::vector<int64_t> shape = {}) {
  if (shape.empty()) shape = {int64_t(v.size())};
  Tensor t = Tensor::host(DType::kI32, shape);
  std::copy(v.begin(), v.end(), t.ptr<int32_t>());
  return t;
}

std::vector<int32_t> i32_values(const Tensor& host) {
  return std::vector<int32_t>(host.ptr<const int32_t>(), host.ptr<const int32_t>() + host.numel());
}

std::vector<int64_t> shape_of(const Tensor& t) {
  const TensorView v = t.view();
  return std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.ndim);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.view().data, b.view().data, a.nbytes()) == 0;
}

// n distinct locations in [0, num_locations), in random order.
std::vector<int32_t> distinct_locations(Rng& rng, int64_t n, int64_t num_locations) {
  std::vector<int32_t> all(static_cast<size_t>(num_locations));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng.gen());
  all.resize(size_t(n));
  return all;
}

// bf16 [rows, cols] whose 128-value tiles have different magnitudes (normal, x100, x1e-6, zero,
// x3000), so FP8 scales differ tile by tile, including the amax floors.
Tensor tiled_bf16(Rng& rng, int64_t rows, int64_t cols) {
  Tensor t = testing::random_tensor(rng, DType::kBF16, {rows, cols});
  const float factors[] = {1.f, 100.f, 1e-6f, 0.f, 3000.f};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c0 = 0; c0 < cols; c0 += 128) {
      const float f = factors[rng.randint(0, 4)];
      for (int64_t c = c0; c < std::min(cols, c0 + 128); ++c) {
        bf16_t& v = t.ptr<bf16_t>()[r * cols + c];
        v = f32_to_bf16(bf16_to_f32(v) * f);
      }
    }
  return t;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
    seed_ = testing::fresh_seed();
    rng_ = std::make_unique<Rng>(seed_);
    gpu_ = make_cuda_backend(0);
    cpu_ = make_cpu_backend();
  }
  std::string trace() const { return "seed " + std::to_string(seed_); }
  cuda::CudaBackend& cuda() { return dynamic_cast<cuda::CudaBackend&>(*gpu_); }
  Rng& rng() { return *rng_; }

  Tensor poisoned(DType dtype, const std::vector<int64_t>& shape) {
    return testing::poisoned(*gpu_, dtype, shape);
  }

  uint64_t seed_ = 0;
  std::unique_ptr<Rng> rng_;
  std::unique_ptr<Backend> gpu_, cpu_;
};

struct PoolCase {
  KvLayout layout;
  ScalePolicy policy;
  float k_scale;
  int page_size;
};

std::string name_of(const PoolCase& c) {
  return std::string(to_string(c.layout)) + "/" + to_string(c.policy) + "/page " +
         std::to_string(c.page_size);
}

const std::vector<PoolCase> kPoolCases = {
    {KvLayout::kBf16, ScalePolicy::kAmax, 1.f, 64},
    {KvLayout::kFp8Scaled, ScalePolicy::kAmax, 1.f, 64},
    {KvLayout::kFp8Scaled, ScalePolicy::kPow2, 1.f, 1},
    {KvLayout::kFp8Raw, ScalePolicy::kAmax, 0.37f, 64},
};

// ---- capabilities -------------------------------------------------------------------------

// The launch-time divider of the kernels (common/fast_divmod.h) against integer division, on
// the host (the same formula the kernels run with __umulhi): divisors from 1 to 2^31 - 1,
// numerators at the ends of [0, 2^31) and around multiples of the divisor.
TEST(FastDivmod, EqualsIntegerDivisionBelow2To31) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  std::vector<uint32_t> divisors = {1, 2, 3, 7, 12, 64, 100, 65535, 65536, 65537, 0x7fffffffu};
  for (int i = 0; i < 2000; ++i) divisors.push_back(uint32_t(rng.randint(1, 0x7fffffff)));
  for (int i = 0; i < 200; ++i) divisors.push_back(uint32_t(rng.randint(1, 4096)));
  for (const uint32_t d : divisors) {
    const cuda::FastDivmod f(d);
    std::vector<uint32_t> ns = {0, 1, d - 1, d, d + 1, 0x7ffffffeu, 0x7fffffffu};
    for (int i = 0; i < 50; ++i) ns.push_back(uint32_t(rng.randint(0, 0x7fffffff)));
    for (int i = 0; i < 20; ++i) {
      const uint64_t m = uint64_t(d) * uint64_t(rng.randint(0, int64_t(0x7fffffff / d)));
      for (const uint64_t n : {m, m + d - 1})
        if (n < 0x80000000u) ns.push_back(uint32_t(n));
    }
    for (const uint32_t n : ns) {
      if (n >= 0x80000000u) continue;
      ASSERT_EQ(f.div(n), n / d) << n << " / " << d;
    }
  }
}

TEST_F(CudaBackendTest, CapabilitiesAndDeviceChoice) {
  const Capabilities& caps = gpu_->capabilities();
  EXPECT_EQ(caps.device, Device::kCuda);
  EXPECT_EQ(caps.sm_arch, 90);
  EXPECT_TRUE(caps.dense_mha);
  EXPECT_EQ(caps.intermediate_dtype, DType::kBF16);
  EXPECT_FALSE(caps.device_name.empty());
  EXPECT_TRUE(cuda_backend_compiled());
  try {
    make_cuda_backend(cuda_device_count());
    ADD_FAILURE() << "a missing device index was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << e.what();
  }
}

// ---- pool -----------------------------------------------------------------------------------

// Host -> device copies return without waiting for the stream (pinned staging ring): each
// device tensor keeps the bytes its host buffer held at copy() time, even when the buffer is
// overwritten at once, when more copies than the ring's slots are queued behind a kernel, and
// for a copy too large for staging (the synchronizing path).
TEST_F(CudaBackendTest, HostToDeviceCopiesKeepTheBytesOfTheirCallTime) {
  SCOPED_TRACE(trace());
  Tensor busy = gpu_->empty(DType::kF32, {int64_t(1) << 24});
  std::vector<std::vector<int32_t>> want;
  std::vector<Tensor> got;
  for (int k = 0; k < 21; ++k) {
    gpu_->poison(busy);  // work ahead of the copy on the stream
    const int64_t n = k == 20 ? int64_t(cuda::PinnedStaging::kMaxBytes / 4 + 1) : 1 + 997 * k;
    std::vector<int32_t> host(static_cast<size_t>(n));
    for (auto& x : host) x = int32_t(rng().randint(-1000000, 1000000));
    want.push_back(host);
    got.push_back(gpu_->to_device(make_view(host.data(), DType::kI32, Device::kCpu, {n})));
    std::fill(host.begin(), host.end(), -7);
  }
  for (size_t k = 0; k < want.size(); ++k)
    EXPECT_EQ(i32_values(gpu_->to_host(got[k])), want[k]) << "copy " << k;
}

TEST_F(CudaBackendTest, StoreAndGatherAreBitIdenticalToCpu) {
  SCOPED_TRACE(trace());
  for (const PoolCase& c : kPoolCases) {
    SCOPED_TRACE(name_of(c));
    KvPoolDesc desc;
    desc.layout = c.layout;
    desc.page_size = c.page_size;
    desc.num_pages = 256 / c.page_size;
    desc.scale_policy = c.policy;
    desc.k_scale = c.k_scale;
    const int64_t n = 150;
    const std::vector<int32_t> locs = distinct_locations(rng(), n, desc.num_locations());
    const Tensor c_kv = tiled_bf16(rng(), n, desc.d_c);
    Tensor k_pe = testing::random_tensor(rng(), DType::kBF16, {n, desc.d_rope});
    // NaN and inf propagate to their own token only, with the CPU backend's NaN bytes.
    k_pe.ptr<bf16_t>()[5] = f32_to_bf16(kNaN);
    c_kv.ptr<bf16_t>()[7 * desc.d_c + 300] = f32_to_bf16(-kInf);
    c_kv.ptr<bf16_t>()[9 * desc.d_c + 20] = f32_to_bf16(kNaN);

    PagedKvPool gpu_pool = gpu_->make_kv_pool(desc), cpu_pool = cpu_->make_kv_pool(desc);
    gpu_->store_kv(gpu_pool, gpu_->to_device(host_i32(locs)), gpu_->to_device(c_kv),
                   gpu_->to_device(k_pe));
    cpu_->store_kv(cpu_pool, host_i32(locs), c_kv, k_pe);
    const Tensor gpu_bytes = gpu_->to_host(gpu_pool.storage());
    EXPECT_TRUE(same_bytes(gpu_bytes, cpu_->to_host(cpu_pool.storage())));
    EXPECT_NE(testing::checksum(gpu_bytes), testing::checksum(Tensor::host(DType::kU8, {1})));

    // Gather every location of the pool (written or not) plus a permutation, in each dtype pair.
    std::vector<int32_t> read(size_t(desc.num_locations()));
    std::iota(read.begin(), read.end(), 0);
    std::shuffle(read.begin(), read.end(), rng().gen());
    const int64_t m = int64_t(read.size());
    for (DType c_dtype : {DType::kBF16, DType::kF32}) {
      for (DType r_dtype : {DType::kBF16, DType::kF32}) {
        SCOPED_TRACE(std::string(to_string(c_dtype)) + "/" + to_string(r_dtype));
        const Tensor gc = poisoned(c_dtype, {m, desc.d_c}),
                     gr = poisoned(r_dtype, {m, desc.d_rope});
        gpu_->gather_kv(gpu_pool, gpu_->to_device(host_i32(read)), gc, gr);
        Tensor cc = Tensor::host(c_dtype, {m, desc.d_c}),
               cr = Tensor::host(r_dtype, {m, desc.d_rope});
        cpu_->gather_kv(cpu_pool, host_i32(read), cc, cr);
        EXPECT_TRUE(same_bytes(gpu_->to_host(gc), cc));
        EXPECT_TRUE(same_bytes(gpu_->to_host(gr), cr));
      }
    }
  }
}

TEST_F(CudaBackendTest, IndexKeysAreBitIdenticalToCpu) {
  SCOPED_TRACE(trace());
  for (int page_size : {1, 64}) {
    const IndexKeyPoolDesc desc{page_size, 192 / page_size, 128};
    const int64_t n = 100;
    const std::vector<int32_t> locs = distinct_locations(rng(), n, desc.num_locations());
    const Tensor keys = tiled_bf16(rng(), n, desc.d_i);
    IndexKeyPool gpu_pool = gpu_->make_index_pool(desc), cpu_pool = cpu_->make_index_pool(desc);
    gpu_->store_index_keys(gpu_pool, gpu_->to_device(host_i32(locs)), gpu_->to_device(keys));
    cpu_->store_index_keys(cpu_pool, host_i32(locs), keys);
    EXPECT_TRUE(same_bytes(gpu_->to_host(gpu_pool.storage()), cpu_->to_host(cpu_pool.storage())))
        << "page_size " << page_size;
  }
}

TEST_F(CudaBackendTest, RejectedStoreNamesTheArgumentAndWritesNothing) {
  SCOPED_TRACE(trace());
  KvPoolDesc desc;
  desc.layout = KvLayout::kFp8Scaled;
  desc.num_pages = 2;
  PagedKvPool pool = gpu_->make_kv_pool(desc);
  const int64_t n = 4;
  const Tensor c_kv = gpu_->to_device(tiled_bf16(rng(), n, desc.d_c));
  const Tensor k_pe =
      gpu_->to_device(testing::random_tensor(rng(), DType::kBF16, {n, desc.d_rope}));
  gpu_->store_kv(pool, gpu_->to_device(host_i32({0, 1, 2, 3})), c_kv, k_pe);
  const uint64_t before = testing::checksum(gpu_->to_host(pool.storage()));
  auto expect_rejected = [&](const std::vector<int32_t>& locs, const TensorView& c,
                             const std::string& arg) {
    try {
      gpu_->store_kv(pool, gpu_->to_device(host_i32(locs)), c, k_pe);
      ADD_FAILURE() << "accepted a bad " << arg;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(arg), std::string::npos) << e.what();
    }
    EXPECT_EQ(testing::checksum(gpu_->to_host(pool.storage())), before);
  };
  expect_rejected({5, 6, 128, 7}, c_kv, "locs");  // 128 == num_locations
  expect_rejected({5, -1, 8, 7}, c_kv, "locs");
  expect_rejected({5, 6, 5, 7}, c_kv, "locs");  // duplicate
  const Tensor c_f32 = gpu_->empty(DType::kF32, {n, desc.d_c});
  expect_rejected({5, 6, 8, 7}, c_f32, "c_kv");
  const Tensor host_c = tiled_bf16(rng(), n, desc.d_c);
  expect_rejected({5, 6, 8, 7}, host_c, "c_kv");  // a host tensor on the cuda backend
}

TEST_F(CudaBackendTest, KernelsSkipOutOfRangeLocationsWithoutHostChecks) {
  SCOPED_TRACE(trace());
  KvPoolDesc desc;
  desc.layout = KvLayout::kFp8Scaled;
  desc.num_pages = 1;
  PagedKvPool pool = gpu_->make_kv_pool(desc);
  cuda().options().host_value_checks = false;
  const int64_t n = 3;
  const std::vector<int32_t> locs = {2, 1 << 30, -7};
  gpu_->store_kv(pool, gpu_->to_device(host_i32(locs)),
                 gpu_->to_device(tiled_bf16(rng(), n, desc.d_c)),
                 gpu_->to_device(testing::random_tensor(rng(), DType::kBF16, {n, desc.d_rope})));
  const Tensor c = poisoned(DType::kF32, {n, desc.d_c}),
               r = poisoned(DType::kF32, {n, desc.d_rope});
  gpu_->gather_kv(pool, gpu_->to_device(host_i32(locs)), c, r);
  const Tensor ch = gpu_->to_host(c);
  for (int64_t i = 1; i < n; ++i)  // invalid locations gather as zeros
    for (int64_t e = 0; e < desc.d_c; ++e) ASSERT_EQ(ch.ptr<float>()[i * desc.d_c + e], 0.f);
  // Only location 2's row changed.
  const Tensor bytes = gpu_->to_host(pool.storage());
  const int bpt = desc.bytes_per_token();
  for (int64_t loc = 0; loc < desc.num_locations(); ++loc) {
    if (loc == 2) continue;
    const uint8_t* row = bytes.ptr<const uint8_t>() + loc * bpt;
    ASSERT_TRUE(std::all_of(row, row + bpt, [](uint8_t b) { return b == 0; })) << "loc " << loc;
  }
}

// ---- indexer --------------------------------------------------------------------------------

// Every block size of the top-k kernel (and the choice by width) on rows past the keys it keeps
// in shared memory (70000), rows that fit (3000, 20000), and both ways to the k-th key: through
// the candidate list (normal scores) and over the whole row when the k-th key's coarse bin holds
// more keys than the list takes (scores on a quarter grid, 70000 wide: thousands equal).
TEST_F(CudaBackendTest, TopkIsBitIdenticalToCpuOnWideRows) {
  SCOPED_TRACE(trace());
  for (const auto& [width, k] :
       {std::pair<int64_t, int>{70000, 2048}, {20000, 2048}, {3000, 512}, {300, 1}}) {
    SCOPED_TRACE("width " + std::to_string(width) + " k " + std::to_string(k));
    const int64_t rows = 5;
    Tensor logits = Tensor::host(DType::kF32, {rows, width});
    std::vector<int32_t> ctx = {int32_t(width), int32_t(width) - 17, k, k + 1, 0};
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t p = 0; p < width; ++p) {
        float v = rng().normal();
        if (r == 1) v = std::round(v * 4.f) / 4.f;  // many ties at the threshold
        if (p % 97 == 3) v = kNaN;
        if (p % 101 == 5) v = -kInf;
        if (p % 89 == 7) v = (p & 1) ? 0.f : -0.f;
        logits.ptr<float>()[r * width + p] = v;
      }
    Tensor want = Tensor::host(DType::kI32, {rows, k});
    cpu_->topk(logits, host_i32(ctx), k, want);
    EXPECT_EQ(i32_values(want),
              reference::topk(reference::to_vec(logits.view()), rows, width, ctx, k));
    const Tensor device_logits = gpu_->to_device(logits),
                 device_ctx = gpu_->to_device(host_i32(ctx));
    for (int threads : {0, 256, 512, 1024}) {
      SCOPED_TRACE("threads " + std::to_string(threads));
      cuda().options().topk_threads = threads;
      const Tensor out = poisoned(DType::kI32, {rows, k});
      gpu_->topk(device_logits, device_ctx, k, out);
      EXPECT_EQ(i32_values(gpu_->to_host(out)), i32_values(want));
    }
  }
  cuda().options().topk_threads = 384;
  const Tensor out = poisoned(DType::kI32, {1, 1});
  EXPECT_THROW(gpu_->topk(gpu_->to_device(Tensor::host(DType::kF32, {1, 4})),
                          gpu_->to_device(host_i32({4})), 1, out),
               Error);
}

// Every bf16 bit pattern through the query quantizer, at d_i = 128 (the multi-row kernel) and
// d_i = 64 (the one-row kernel): rows of consecutive patterns (each row's scale from its own
// amax, with rows of subnormals, of infinities and of NaNs) and the same patterns shuffled (small
// values under large scales, saturation at ±448); codes and gates byte-identical to the CPU's.
TEST_F(CudaBackendTest, QuantizeQIsBitIdenticalToCpuForEveryBf16) {
  SCOPED_TRACE(trace());
  std::vector<uint16_t> patterns(65536);
  std::iota(patterns.begin(), patterns.end(), uint16_t{0});
  for (bool shuffled : {false, true}) {
    if (shuffled)
      for (size_t i = patterns.size() - 1; i > 0; --i)
        std::swap(patterns[i], patterns[size_t(rng().randint(0, int64_t(i)))]);
    for (int64_t d : {128, 64}) {
      SCOPED_TRACE((shuffled ? "shuffled, d " : "ordered, d ") + std::to_string(d));
      const int64_t h = 4, t = int64_t(patterns.size()) / (h * d);
      Tensor x = Tensor::host(DType::kBF16, {t, h, d});
      std::memcpy(x.ptr<bf16_t>(), patterns.data(), patterns.size() * sizeof(uint16_t));
      const Tensor w = testing::random_tensor(rng(), DType::kF32, {t, h});
      const Tensor q8 = poisoned(DType::kU8, {t, h, d}), gate = poisoned(DType::kF32, {t, h});
      gpu_->indexer_quantize_q(gpu_->to_device(x), gpu_->to_device(w), q8, gate);
      Tensor q8_cpu = Tensor::host(DType::kU8, {t, h, d});
      Tensor gate_cpu = Tensor::host(DType::kF32, {t, h});
      cpu_->indexer_quantize_q(x, w, q8_cpu, gate_cpu);
      EXPECT_TRUE(same_bytes(gpu_->to_host(q8), q8_cpu));
      EXPECT_TRUE(same_bytes(gpu_->to_host(gate), gate_cpu));
    }
  }
}

// A single request of `ctx` positions whose keys sit in an index-key pool on the GPU.
struct IndexerScene {
  IndexKeyPool pool;
  Tensor idx_q, idx_w;                // host
  Tensor kv_locs, kv_start, ctx_len;  // device
  std::vector<int32_t> ctx_host;
  IndexerArgs layout() const {
    IndexerArgs a;
    a.keys = &pool;
    a.kv_locs = kv_locs.view();
    a.kv_start = kv_start.view();
    a.ctx_len = ctx_len.view();
    return a;
  }
};

IndexerScene make_indexer_scene(Backend& be, Rng& rng, int prefix, int extend, int h_i) {
  IndexerScene s;
  const int d_i = 128, page = 64, total = prefix + extend;
  const int64_t pages = (total + page - 1) / page + 2;
  s.pool = be.make_index_pool({page, pages, d_i});
  const std::vector<int32_t> locs = distinct_locations(rng, total, pages * page);
  be.store_index_keys(s.pool, be.to_device(host_i32(locs)),
                      be.to_device(tiled_bf16(rng, total, d_i)));
  s.idx_q = testing::random_tensor(rng, DType::kBF16, {extend, h_i, d_i});
  s.idx_w = testing::random_tensor(rng, DType::kF32, {extend, h_i});
  for (int i = 0; i < extend; ++i) s.ctx_host.push_back(prefix + i + 1);
  s.kv_locs = be.to_device(host_i32(locs));
  s.kv_start = be.to_device(host_i32(std::vector<int32_t>(size_t(extend), 0)));
  s.ctx_len = be.to_device(host_i32(s.ctx_host));
  return s;
}

TEST_F(CudaBackendTest, IndexerTopkEqualsTopkOfItsLogitsInEveryChunking) {
  SCOPED_TRACE(trace());
  const int k = 64, extend = 40, prefix = 300, h_i = 64;
  const IndexerScene s = make_indexer_scene(*gpu_, rng(), prefix, extend, h_i);
  const Tensor idx_q = gpu_->to_device(s.idx_q), idx_w = gpu_->to_device(s.idx_w);
  auto run = [&] {
    const Tensor out = poisoned(DType::kI32, {extend, k});
    gpu_->indexer_topk(idx_q, idx_w, s.layout(), k, out);
    return i32_values(gpu_->to_host(out));
  };
  const std::vector<int32_t> whole = run();
  for (size_t chunk : {size_t(1), size_t(3) * (h_i * 132 + 4 * (prefix + extend))}) {
    // One row, then three rows per block (IndexerBlocks).
    ::setenv("DSAKIT_INDEXER_WORKSPACE_BYTES", std::to_string(chunk).c_str(), 1);
    const std::vector<int32_t> blocked = run();
    ::unsetenv("DSAKIT_INDEXER_WORKSPACE_BYTES");
    EXPECT_EQ(blocked, whole) << "block bytes " << chunk;
  }
  EXPECT_EQ(run(), whole) << "second run";  // determinism

  // The same selection from the op-by-op path.
  IndexerArgs a = s.layout();
  const Tensor q8 = poisoned(DType::kU8, {extend, h_i, 128}),
               gate = poisoned(DType::kF32, {extend, h_i});
  gpu_->indexer_quantize_q(idx_q, idx_w, q8, gate);
  a.q8 = q8.view();
  a.gate = gate.view();
  const int64_t width = prefix + extend;
  const Tensor logits = poisoned(DType::kF32, {extend, width});
  gpu_->indexer_logits(a, 0, extend, logits);
  const Tensor out = poisoned(DType::kI32, {extend, k});
  gpu_->topk(logits, s.ctx_len, k, out);
  EXPECT_EQ(i32_values(gpu_->to_host(out)), whole);

  // Logits against float64 from the same codes and scales; q8 and gate bit-identical to CPU.
  Tensor q8_cpu = Tensor::host(DType::kU8, {extend, h_i, 128});
  Tensor gate_cpu = Tensor::host(DType::kF32, {extend, h_i});
  cpu_->indexer_quantize_q(s.idx_q, s.idx_w, q8_cpu, gate_cpu);
  EXPECT_TRUE(same_bytes(gpu_->to_host(q8), q8_cpu));
  EXPECT_TRUE(same_bytes(gpu_->to_host(gate), gate_cpu));
  const Tensor keys = gpu_->to_host(s.pool.storage());
  const IndexKeyPoolDesc& kd = s.pool.desc();
  reference::Vec q(size_t(q8_cpu.numel())), k_val(size_t(kd.num_locations() * kd.d_i)),
      k_scale(size_t(kd.num_locations()));
  for (int64_t i = 0; i < q8_cpu.numel(); ++i)
    q[size_t(i)] = reference::e4m3_value(q8_cpu.ptr<uint8_t>()[i]);
  for (int64_t loc = 0; loc < kd.num_locations(); ++loc) {
    const uint8_t* page = keys.ptr<const uint8_t>() + (loc / kd.page_size) * kd.page_bytes();
    const int64_t slot = loc % kd.page_size;
    for (int e = 0; e < kd.d_i; ++e)
      k_val[size_t(loc * kd.d_i + e)] = reference::e4m3_value(page[slot * kd.d_i + e]);
    float sc;
    std::memcpy(&sc, page + int64_t(kd.page_size) * kd.d_i + 4 * slot, 4);
    k_scale[size_t(loc)] = sc;
  }
  const reference::Vec ref =
      reference::indexer_logits(q, reference::to_vec(gate_cpu.view()), k_val, k_scale, extend, h_i,
                                kd.d_i, i32_values(gpu_->to_host(s.kv_locs)),
                                std::vector<int32_t>(size_t(extend), 0), s.ctx_host, width);
  const std::vector<double> got = testing::to_double(gpu_->to_host(logits));
  std::vector<double> got_finite, ref_finite;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      EXPECT_EQ(got[i], ref[i]) << "entry " << i;
      continue;
    }
    got_finite.push_back(got[i]);
    ref_finite.push_back(ref[i]);
  }
  EXPECT_LE(testing::rel_l2(got_finite, ref_finite), testing::kTolF32);
}

// Two requests in one batch (prefix 150 + 13 new tokens, then 20 new tokens with no prefix),
// so CTA row groups straddle a kv_start change, contexts are ragged and a few tokens fall under
// the identity shortcut. The same keys are stored in a GPU and a CPU index-key pool.
struct BatchIndexer {
  IndexKeyPool gpu_pool, cpu_pool;
  Tensor q8, gate;                    // host, from the CPU quantizer
  Tensor kv_locs, kv_start, ctx_len;  // host
  Tensor d_q8, d_gate, d_kv_locs, d_kv_start, d_ctx_len;
  int64_t tokens = 0, width = 0;
  int h_i = 0;

  IndexerArgs args(bool on_gpu) const {
    IndexerArgs a;
    a.keys = on_gpu ? &gpu_pool : &cpu_pool;
    a.q8 = (on_gpu ? d_q8 : q8).view();
    a.gate = (on_gpu ? d_gate : gate).view();
    a.kv_locs = (on_gpu ? d_kv_locs : kv_locs).view();
    a.kv_start = (on_gpu ? d_kv_start : kv_start).view();
    a.ctx_len = (on_gpu ? d_ctx_len : ctx_len).view();
    return a;
  }
};

// paged: each request's positions laid out by a page table of its own (shuffled pages), as the
// layer lays them out (a run of page_size consecutive locations per page); else distinct random
// locations.
BatchIndexer make_batch_indexer(Backend& gpu, Backend& cpu, Rng& rng, int h_i, int page_size,
                                bool paged = false) {
  constexpr int kDim = 128;
  // (prefix, extend): the short requests put three to five requests in one row group of the
  // wgmma kernel (6, 8, 12 or 16 rows), so its segments and the finishers' per-segment state
  // are reused within a CTA.
  const std::vector<std::pair<int, int>> requests = {{150, 13}, {0, 20}, {40, 1},
                                                     {7, 2},    {0, 2},  {300, 4}};
  BatchIndexer b;
  b.h_i = h_i;
  std::vector<int32_t> start, ctx;
  int64_t n_kv = 0;
  for (const auto& [prefix, extend] : requests) {
    for (int i = 0; i < extend; ++i) {
      start.push_back(int32_t(n_kv));
      ctx.push_back(prefix + i + 1);
    }
    n_kv += prefix + extend;
  }
  b.tokens = int64_t(ctx.size());
  b.width = n_kv;  // wider than every context: the -inf fill is exercised
  int64_t pages_needed = 0;
  for (const auto& [prefix, extend] : requests)
    pages_needed += (prefix + extend + page_size - 1) / page_size;
  const IndexKeyPoolDesc desc{page_size, paged ? pages_needed + 3 : 1024 / page_size, kDim};
  std::vector<int32_t> locs;
  if (paged) {
    std::vector<int32_t> pages(static_cast<size_t>(desc.num_pages));
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng.gen());
    size_t next_page = 0;
    for (const auto& [prefix, extend] : requests) {
      std::vector<int32_t> table;
      for (int p = 0; p < prefix + extend; ++p) {
        if (p % page_size == 0) table.push_back(pages[next_page++]);
        locs.push_back(table.back() * page_size + p % page_size);
      }
    }
  } else {
    locs = distinct_locations(rng, n_kv, desc.num_locations());
  }
  const Tensor keys = tiled_bf16(rng, n_kv, kDim);
  b.gpu_pool = gpu.make_index_pool(desc);
  b.cpu_pool = cpu.make_index_pool(desc);
  gpu.store_index_keys(b.gpu_pool, gpu.to_device(host_i32(locs)), gpu.to_device(keys));
  cpu.store_index_keys(b.cpu_pool, host_i32(locs), keys);

  const Tensor idx_q = testing::random_tensor(rng, DType::kBF16, {b.tokens, h_i, kDim});
  const Tensor idx_w = testing::random_tensor(rng, DType::kF32, {b.tokens, h_i});
  b.q8 = Tensor::host(DType::kU8, {b.tokens, h_i, kDim});
  b.gate = Tensor::host(DType::kF32, {b.tokens, h_i});
  cpu.indexer_quantize_q(idx_q, idx_w, b.q8, b.gate);
  b.kv_locs = host_i32(locs);
  b.kv_start = host_i32(start);
  b.ctx_len = host_i32(ctx);
  b.d_q8 = gpu.to_device(b.q8);
  b.d_gate = gpu.to_device(b.gate);
  b.d_kv_locs = gpu.to_device(b.kv_locs);
  b.d_kv_start = gpu.to_device(b.kv_start);
  b.d_ctx_len = gpu.to_device(b.ctx_len);
  return b;
}

// rel-L2 over the finite entries of `ref`; every infinite entry of `ref` must be equal in `got`.
double finite_rel_l2(const std::vector<double>& got, const std::vector<double>& ref) {
  std::vector<double> got_finite, ref_finite;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      EXPECT_EQ(got[i], ref[i]) << "masked entry " << i;
      continue;
    }
    EXPECT_FALSE(std::isinf(got[i])) << "entry " << i << " masked, expected " << ref[i];
    got_finite.push_back(got[i]);
    ref_finite.push_back(ref[i]);
  }
  EXPECT_FALSE(ref_finite.empty());
  return testing::rel_l2(got_finite, ref_finite);
}

// Largest allowed relative difference between tensor-core and scalar (or CPU) logits: fp32
// results of the same FP8 codes that differ only in summation order. Also the tie window of
// the top-k comparison.
constexpr double kTolTensorCoreLogits = 1e-5;

// The wgmma kernel's bound against the scalar kernel and the CPU: the FP8 tensor cores'
// accumulation keeps fewer bits than fp32 (docs/numerics.md); its error is printed. The exact
// wgmma kernel widens the codes to f16, the tensor-core path the mma.sync kernel compiles to:
// it is held to the mma.sync bound.
constexpr double kTolWgmmaLogits = 1e-3;

const char* logits_kernel_name(cuda::IndexerKernel kernel) {
  switch (kernel) {
    case cuda::IndexerKernel::kScalar:
      return "scalar";
    case cuda::IndexerKernel::kTensorCore:
      return "mma.sync";
    case cuda::IndexerKernel::kWgmmaExact:
      return "wgmma exact";
    case cuda::IndexerKernel::kWgmma:
      return "wgmma";
  }
  return "?";
}

TEST_F(CudaBackendTest, TensorCoreLogitsMatchScalarKernelAndCpu) {
  SCOPED_TRACE(trace());
  for (int h_i : {64, 32}) {
    // Page size 1 leaves key rows 4-byte aligned: the wgmma kernel falls back to mma.sync.
    // 12: a page size that is not a power of two (the wgmma kernel's location divider).
    for (int page_size : {1, 12, 16, 64}) {
      SCOPED_TRACE("H_i " + std::to_string(h_i) + " page " + std::to_string(page_size));
      const BatchIndexer b = make_batch_indexer(*gpu_, *cpu_, rng(), h_i, page_size);
      auto gpu_logits = [&](cuda::IndexerKernel kernel, int64_t row_begin, int64_t row_end) {
        cuda().options().indexer_kernel = kernel;
        const Tensor out = poisoned(DType::kF32, {row_end - row_begin, b.width});
        gpu_->indexer_logits(b.args(true), row_begin, row_end, out);
        return testing::to_double(gpu_->to_host(out));
      };
      Tensor cpu_out = Tensor::host(DType::kF32, {b.tokens, b.width});
      cpu_->indexer_logits(b.args(false), 0, b.tokens, cpu_out);
      const std::vector<double> cpu = testing::to_double(cpu_out);
      const std::vector<double> scalar = gpu_logits(cuda::IndexerKernel::kScalar, 0, b.tokens);
      EXPECT_LE(finite_rel_l2(scalar, cpu), testing::kTolF32);
      std::vector<double> mma_sync;  // the first kernel's logits, for the fallback check
      for (const cuda::IndexerKernel kernel :
           {cuda::IndexerKernel::kTensorCore, cuda::IndexerKernel::kWgmmaExact,
            cuda::IndexerKernel::kWgmma}) {
        const bool wgmma = kernel != cuda::IndexerKernel::kTensorCore;
        SCOPED_TRACE(logits_kernel_name(kernel));
        const std::vector<double> got = gpu_logits(kernel, 0, b.tokens);
        const double vs_scalar = finite_rel_l2(got, scalar), vs_cpu = finite_rel_l2(got, cpu);
        std::printf("%s logits H_i %d page %d: rel-L2 %.3g vs scalar, %.3g vs cpu\n",
                    logits_kernel_name(kernel), h_i, page_size, vs_scalar, vs_cpu);
        const double tol =
            kernel == cuda::IndexerKernel::kWgmma ? kTolWgmmaLogits : kTolTensorCoreLogits;
        EXPECT_LE(vs_scalar, tol);
        EXPECT_LE(vs_cpu, tol);
        // Every entry, not only the sum: max |got - scalar| <= tol · max |scalar| (DeepGEMM's
        // tolerance, docs/numerics.md).
        double max_ref = 0, max_err = 0;
        for (size_t i = 0; i < scalar.size(); ++i) {
          if (std::isinf(scalar[i])) continue;
          max_ref = std::max(max_ref, std::abs(scalar[i]));
          max_err = std::max(max_err, std::abs(got[i] - scalar[i]));
        }
        EXPECT_LE(max_err, tol * max_ref) << "largest entry error";
        EXPECT_EQ(got, gpu_logits(kernel, 0, b.tokens)) << "determinism";
        if (!wgmma) mma_sync = got;
        if (wgmma && page_size % 4 != 0) {
          EXPECT_EQ(got, mma_sync) << "fallback to the mma.sync kernel";
        } else if (wgmma) {
          EXPECT_NE(got, mma_sync) << "the wgmma kernel ran (its sums differ from mma.sync's)";
          // Gates 4 bytes past a 16-byte boundary: the wgmma kernel copies them 16 bytes at a
          // time, so the call falls back to the mma.sync kernel, whose logits these are.
          const Tensor padded = gpu_->empty(DType::kF32, {b.tokens * h_i + 1});
          const TensorView gate_view =
              make_view(padded.ptr<float>() + 1, DType::kF32, Device::kCuda, {b.tokens, h_i});
          gpu_->copy(gate_view, b.d_gate.view());
          IndexerArgs misaligned = b.args(true);
          misaligned.gate = gate_view;
          const Tensor out = poisoned(DType::kF32, {b.tokens, b.width});
          gpu_->indexer_logits(misaligned, 0, b.tokens, out);
          EXPECT_EQ(testing::to_double(gpu_->to_host(out)), mma_sync)
              << "gates not 16-byte aligned: the mma.sync kernel's logits";
        }

        // The wgmma kernel's key splits (more CTAs than tiles included), and persistent grids
        // of 1-3 CTAs, each over many work items (both query buffers reused, segments of
        // several requests one item after another): the same bits.
        for (int splits : wgmma ? std::vector<int>{2, 3, 5} : std::vector<int>{}) {
          cuda().options().indexer_key_splits = splits;
          EXPECT_EQ(gpu_logits(kernel, 0, b.tokens), got) << "key splits " << splits;
        }
        for (int ctas : wgmma ? std::vector<int>{1, 2, 3} : std::vector<int>{})
          for (int splits : {1, 3}) {
            cuda().options().indexer_logits_ctas = ctas;
            cuda().options().indexer_key_splits = splits;
            EXPECT_EQ(gpu_logits(kernel, 0, b.tokens), got)
                << ctas << " CTAs, key splits " << splits;
            EXPECT_EQ(gpu_logits(kernel, 3, b.tokens - 1),
                      std::vector<double>(got.begin() + 3 * b.width,
                                          got.begin() + (b.tokens - 1) * b.width))
                << ctas << " CTAs, key splits " << splits << ", rows [3, tokens - 1)";
          }
        cuda().options().indexer_logits_ctas = 0;
        cuda().options().indexer_key_splits = 0;

        // A row range starting mid-batch (row_begin not a multiple of the CTA's row group).
        const int64_t r0 = 5, r1 = b.tokens - 3;
        const std::vector<double> part = gpu_logits(kernel, r0, r1);
        EXPECT_TRUE(std::equal(part.begin(), part.end(), got.begin() + r0 * b.width))
            << "rows [" << r0 << ", " << r1 << ")";
      }
    }
  }
  cuda().options().indexer_kernel = cuda::CudaBackendOptions{}.indexer_kernel;
}

// Key pools laid out by page tables: the e4m3 wgmma kernel loads each half tile that is a run of
// a page by one TMA box. The same bits as every row by cp.async (CudaBackendOptions::
// logits_page_tma off), for pages of 32 (every half tile a run), 48 (runs and half tiles across
// two pages), 64 and 128, and the logits within the kernel's tolerance of the CPU's.
TEST_F(CudaBackendTest, WgmmaLogitsPageRunsByTmaKeepTheBits) {
  SCOPED_TRACE(trace());
  for (int h_i : {64, 32}) {
    for (int page_size : {32, 48, 64, 128}) {
      SCOPED_TRACE("H_i " + std::to_string(h_i) + " page " + std::to_string(page_size));
      const BatchIndexer b = make_batch_indexer(*gpu_, *cpu_, rng(), h_i, page_size, true);
      cuda().options().indexer_kernel = cuda::IndexerKernel::kWgmma;
      auto gpu_logits = [&](bool page_tma, int splits) {
        cuda().options().logits_page_tma = page_tma;
        cuda().options().indexer_key_splits = splits;
        const Tensor out = poisoned(DType::kF32, {b.tokens, b.width});
        gpu_->indexer_logits(b.args(true), 0, b.tokens, out);
        return testing::to_double(gpu_->to_host(out));
      };
      const std::vector<double> by_tma = gpu_logits(true, 0);
      EXPECT_EQ(by_tma, gpu_logits(false, 0)) << "page runs by TMA vs rows by cp.async";
      EXPECT_EQ(by_tma, gpu_logits(true, 3)) << "key splits";
      Tensor cpu_out = Tensor::host(DType::kF32, {b.tokens, b.width});
      cpu_->indexer_logits(b.args(false), 0, b.tokens, cpu_out);
      EXPECT_LE(finite_rel_l2(by_tma, testing::to_double(cpu_out)), kTolWgmmaLogits);
    }
  }
  cuda().options() = cuda::CudaBackendOptions{};
}

// A few rows over a long context: the wgmma kernel's own choice splits the key range (four row
// groups on a 132-SM device), and the logits are the bits of the unsplit grid; rows past the
// context keep their poison (fill_masked off, as indexer_topk runs it).
TEST_F(CudaBackendTest, WgmmaLogitsKeySplitsKeepTheBits) {
  SCOPED_TRACE(trace());
  const int extend = 20, prefix = 3000, h_i = 64;
  const IndexerScene s = make_indexer_scene(*gpu_, rng(), prefix, extend, h_i);
  IndexerArgs a = s.layout();
  const Tensor q8 = poisoned(DType::kU8, {extend, h_i, 128}),
               gate = poisoned(DType::kF32, {extend, h_i});
  gpu_->indexer_quantize_q(gpu_->to_device(s.idx_q), gpu_->to_device(s.idx_w), q8, gate);
  a.q8 = q8.view();
  a.gate = gate.view();
  const int64_t width = prefix + extend + 100;
  for (const cuda::IndexerKernel kernel :
       {cuda::IndexerKernel::kWgmmaExact, cuda::IndexerKernel::kWgmma}) {
    SCOPED_TRACE(logits_kernel_name(kernel));
    cuda().options().indexer_kernel = kernel;
    auto logits = [&](int splits, bool fill) {
      cuda().options().indexer_key_splits = splits;
      IndexerLogitsOptions o;
      o.fill_masked = fill;
      const Tensor out = poisoned(DType::kF32, {extend, width});
      gpu_->indexer_logits(a, 0, extend, out, o);
      return gpu_->to_host(out);
    };
    const Tensor one = logits(1, true);
    EXPECT_TRUE(same_bytes(logits(0, true), one));
    EXPECT_TRUE(same_bytes(logits(7, true), one));
    // 21 work items on a persistent grid of 2 CTAs.
    cuda().options().indexer_logits_ctas = 2;
    EXPECT_TRUE(same_bytes(logits(7, true), one));
    cuda().options().indexer_logits_ctas = 0;
    const Tensor unfilled = logits(0, false), poison = poisoned(DType::kF32, {extend, width});
    const Tensor poison_host = gpu_->to_host(poison);
    for (int64_t r = 0; r < extend; ++r) {
      const int64_t ctx = prefix + r + 1, row = r * width;
      EXPECT_EQ(std::memcmp(unfilled.ptr<float>() + row, one.ptr<float>() + row, 4 * size_t(ctx)),
                0)
          << "row " << r;
      EXPECT_EQ(std::memcmp(unfilled.ptr<float>() + row + ctx, poison_host.ptr<float>() + row + ctx,
                            4 * size_t(width - ctx)),
                0)
          << "row " << r << " past its context";
    }
  }
  cuda().options() = cuda::CudaBackendOptions{};
}

TEST_F(CudaBackendTest, TensorCoreTopkDiffersFromCpuOnlyAtNearTies) {
  SCOPED_TRACE(trace());
  const int k = 32;
  for (const cuda::IndexerKernel kernel :
       {cuda::IndexerKernel::kTensorCore, cuda::IndexerKernel::kWgmmaExact,
        cuda::IndexerKernel::kWgmma})
    for (int h_i : {64, 32}) {
      const char* kernel_name = logits_kernel_name(kernel);
      SCOPED_TRACE(std::string(kernel_name) + " H_i " + std::to_string(h_i));
      const BatchIndexer b = make_batch_indexer(*gpu_, *cpu_, rng(), h_i, 64);
      // indexer_topk quantizes idx_q itself; feed both backends the same bf16 queries.
      const Tensor idx_q = testing::random_tensor(rng(), DType::kBF16, {b.tokens, h_i, 128});
      const Tensor idx_w = testing::random_tensor(rng(), DType::kF32, {b.tokens, h_i});
      cuda().options().indexer_kernel = kernel;
      const Tensor out = poisoned(DType::kI32, {b.tokens, k});
      gpu_->indexer_topk(gpu_->to_device(idx_q), gpu_->to_device(idx_w), b.args(true), k, out);
      const std::vector<int32_t> got = i32_values(gpu_->to_host(out));
      Tensor want_t = Tensor::host(DType::kI32, {b.tokens, k});
      cpu_->indexer_topk(idx_q, idx_w, b.args(false), k, want_t);
      const std::vector<int32_t> want = i32_values(want_t);

      // The CPU's logits of the same queries, for the tie window.
      IndexerArgs a = b.args(false);
      Tensor q8 = Tensor::host(DType::kU8, {b.tokens, h_i, 128});
      Tensor gate = Tensor::host(DType::kF32, {b.tokens, h_i});
      cpu_->indexer_quantize_q(idx_q, idx_w, q8, gate);
      a.q8 = q8.view();
      a.gate = gate.view();
      Tensor logits = Tensor::host(DType::kF32, {b.tokens, b.width});
      cpu_->indexer_logits(a, 0, b.tokens, logits);

      int rows_over_k = 0, differing = 0;
      for (int64_t t = 0; t < b.tokens; ++t) {
        const int32_t ctx = b.ctx_len.ptr<const int32_t>()[t];
        const float* row = logits.ptr<const float>() + t * b.width;
        std::vector<int32_t> g(got.begin() + t * k, got.begin() + (t + 1) * k),
            w(want.begin() + t * k, want.begin() + (t + 1) * k);
        if (ctx <= k) {  // identity shortcut: exact
          EXPECT_EQ(g, w) << "row " << t;
          continue;
        }
        ++rows_over_k;
        std::vector<float> sorted(row, row + ctx);
        std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<>());
        const double kth = sorted[size_t(k - 1)];
        double row_max_abs = 0;
        for (int32_t p = 0; p < ctx; ++p)
          row_max_abs = std::max(row_max_abs, std::abs(double(row[p])));
        std::vector<int32_t> diff;
        std::set_symmetric_difference(g.begin(), g.end(), w.begin(), w.end(),
                                      std::back_inserter(diff));
        for (int32_t pos : diff) {
          ASSERT_GE(pos, 0) << "row " << t;
          ASSERT_LT(pos, ctx) << "row " << t;
          // The kernels' entry-error bounds: mma.sync and exact wgmma relative to the k-th
          // logit, fp8-accumulating wgmma relative to the row's largest (DeepGEMM's tolerance).
          const double window = kernel == cuda::IndexerKernel::kWgmma
                                    ? kTolWgmmaLogits * row_max_abs
                                    : kTolTensorCoreLogits * std::abs(kth);
          EXPECT_LE(std::abs(double(row[pos]) - kth), window)
              << "row " << t << " position " << pos << ": logit " << row[pos] << ", k-th " << kth;
        }
        differing += int(diff.size()) / 2;
      }
      EXPECT_GT(rows_over_k, 0);
      std::printf("%s top-k H_i %d: %d of %d rows past k, %d swapped near-ties\n", kernel_name, h_i,
                  rows_over_k, int(b.tokens), differing);
    }
}

TEST_F(CudaBackendTest, PositionsToLocationsMatchesCpu) {
  SCOPED_TRACE(trace());
  const int64_t t = 6, k = 8, n_kv = 50;
  std::vector<int32_t> locs(n_kv), pos(size_t(t * k)), start(t), ctx(t);
  for (auto& l : locs) l = int32_t(rng().randint(0, 1000));
  for (int64_t i = 0; i < t; ++i) {
    start[size_t(i)] = int32_t(rng().randint(0, 20));
    ctx[size_t(i)] = int32_t(rng().randint(0, n_kv - start[size_t(i)]));
  }
  for (auto& p : pos) p = int32_t(rng().randint(-2, 40));
  const Tensor out = poisoned(DType::kI32, {t, k});
  gpu_->positions_to_locations(gpu_->to_device(host_i32(pos, {t, k})),
                               gpu_->to_device(host_i32(locs)), gpu_->to_device(host_i32(start)),
                               gpu_->to_device(host_i32(ctx)), out);
  Tensor want = Tensor::host(DType::kI32, {t, k});
  cpu_->positions_to_locations(host_i32(pos, {t, k}), host_i32(locs), host_i32(start),
                               host_i32(ctx), want);
  EXPECT_EQ(i32_values(gpu_->to_host(out)), i32_values(want));
}

// The device topk_to_kv_mask against the CPU backend's bits: rows of random positions (-1
// padding, repeats) over a mask of 5,000 words (two of the kernel's shared-memory windows); a
// position past the mask refused naming it with the mask untouched; without host checks the
// kernel skips such a position and writes every other bit.
TEST_F(CudaBackendTest, TopkToKvMaskMatchesCpu) {
  SCOPED_TRACE(trace());
  const int64_t t = 37, k = 700, words = 5000;
  std::vector<int32_t> pos(size_t(t * k));
  for (auto& p : pos) p = rng().randint(0, 9) == 0 ? -1 : int32_t(rng().randint(0, words * 32 - 1));
  pos[3] = pos[2];  // a repeat
  const Tensor want = Tensor::host(DType::kI32, {t, words});
  cpu_->topk_to_kv_mask(host_i32(pos, {t, k}), want);
  const Tensor got = poisoned(DType::kI32, {t, words});
  gpu_->topk_to_kv_mask(gpu_->to_device(host_i32(pos, {t, k})), got);
  EXPECT_EQ(i32_values(gpu_->to_host(got)), i32_values(want));

  std::vector<int32_t> far = pos;
  far[size_t(5 * k + 1)] = int32_t(words * 32);
  const Tensor kept = poisoned(DType::kI32, {t, words});
  const uint64_t before = testing::checksum(gpu_->to_host(kept));
  try {
    gpu_->topk_to_kv_mask(gpu_->to_device(host_i32(far, {t, k})), kept);
    ADD_FAILURE() << "accepted a position past the mask";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("positions[5, 1]"), std::string::npos) << e.what();
  }
  EXPECT_EQ(testing::checksum(gpu_->to_host(kept)), before);
  cuda().options().host_value_checks = false;
  gpu_->topk_to_kv_mask(gpu_->to_device(host_i32(far, {t, k})), kept);
  far[size_t(5 * k + 1)] = -1;  // what the kernel wrote: the far position skipped
  const Tensor skipped = Tensor::host(DType::kI32, {t, words});
  cpu_->topk_to_kv_mask(host_i32(far, {t, k}), skipped);
  EXPECT_EQ(i32_values(gpu_->to_host(kept)), i32_values(skipped));
}

// ---- projections ----------------------------------------------------------------------------

struct ProjectionCase {
  DType in, out;
  double tol;
};

TEST_F(CudaBackendTest, ProjectionsMatchReference) {
  SCOPED_TRACE(trace());
  const int64_t t = 37, n = 45;
  const int h = 3, dn = 128, dv = 128, dc = 512;
  const Tensor w = testing::random_tensor(rng(), DType::kBF16, {h * (dn + dv), dc}, 0.05f);
  const Tensor wd = gpu_->to_device(w);
  const reference::Vec wv = reference::to_vec(w.view());
  for (const ProjectionCase& c : {ProjectionCase{DType::kBF16, DType::kBF16, testing::kTolBf16},
                                  ProjectionCase{DType::kBF16, DType::kF32, 1e-5},
                                  ProjectionCase{DType::kF32, DType::kF32, testing::kTolF32},
                                  ProjectionCase{DType::kF32, DType::kBF16, testing::kTolBf16}}) {
    SCOPED_TRACE(std::string(to_string(c.in)) + " -> " + to_string(c.out));
    const Tensor q_nope = testing::random_tensor(rng(), c.in, {t, h, dn});
    const Tensor q_abs = poisoned(c.out, {t, h, dc});
    gpu_->absorb_q(gpu_->to_device(q_nope), wd, dv, q_abs);
    EXPECT_LE(testing::rel_l2(
                  testing::to_double(gpu_->to_host(q_abs)),
                  reference::absorb_q(reference::to_vec(q_nope.view()), wv, t, h, dn, dv, dc)),
              c.tol);

    const Tensor o_lat = testing::random_tensor(rng(), c.in, {t, h, dc});
    const Tensor o = poisoned(c.out, {t, h, dv});
    gpu_->up_proj_v(gpu_->to_device(o_lat), wd, dn, o);
    EXPECT_LE(testing::rel_l2(
                  testing::to_double(gpu_->to_host(o)),
                  reference::up_proj_v(reference::to_vec(o_lat.view()), wv, t, h, dn, dv, dc)),
              c.tol);

    const Tensor c_kv = testing::random_tensor(rng(), c.in, {n, dc});
    const Tensor k_nope = poisoned(c.out, {n, h, dn}), v = poisoned(c.out, {n, h, dv});
    gpu_->up_proj_kv(gpu_->to_device(c_kv), wd, k_nope, v);
    reference::Vec k_ref, v_ref;
    reference::up_proj_kv(reference::to_vec(c_kv.view()), wv, n, h, dn, dv, dc, k_ref, v_ref);
    EXPECT_LE(testing::rel_l2(testing::to_double(gpu_->to_host(k_nope)), k_ref), c.tol);
    EXPECT_LE(testing::rel_l2(testing::to_double(gpu_->to_host(v)), v_ref), c.tol);
  }
}

// K and V as the halves of one [n, H, d_nope + d_v] buffer: one GEMM over all heads' W rows
// (GLM-5's unequal d_nope / d_v, so a head or half offset mix-up shows).
TEST_F(CudaBackendTest, UpProjKvIntoHalvesMatchesReference) {
  SCOPED_TRACE(trace());
  const int64_t n = 45;
  const int h = 3, dn = 192, dv = 256, dc = 512;
  const Tensor w = testing::random_tensor(rng(), DType::kBF16, {h * (dn + dv), dc}, 0.05f);
  const Tensor c_kv = testing::random_tensor(rng(), DType::kBF16, {n, dc});
  const Tensor kv = poisoned(DType::kBF16, {n, h, dn + dv});
  const KvHalves halves = kv_halves(kv, dn);
  gpu_->up_proj_kv(gpu_->to_device(c_kv), gpu_->to_device(w), halves.k_nope, halves.v);
  reference::Vec k_ref, v_ref;
  reference::up_proj_kv(reference::to_vec(c_kv.view()), reference::to_vec(w.view()), n, h, dn, dv,
                        dc, k_ref, v_ref);
  const std::vector<double> all = testing::to_double(gpu_->to_host(kv));
  std::vector<double> k_got, v_got;
  for (int64_t rh = 0; rh < n * h; ++rh) {
    const auto row = all.begin() + rh * (dn + dv);
    k_got.insert(k_got.end(), row, row + dn);
    v_got.insert(v_got.end(), row + dn, row + dn + dv);
  }
  EXPECT_LE(testing::rel_l2(k_got, k_ref), testing::kTolBf16);
  EXPECT_LE(testing::rel_l2(v_got, v_ref), testing::kTolBf16);
}

// ---- merge ----------------------------------------------------------------------------------

// A K/V up-projection large enough that the backend times cuBLASLt's candidates for it
// (gemm_plans.h): the chosen algorithm gives the bits of cuBLAS's own choice for the same GEMM,
// on the first call (timed) and the next (cached); sampled rows against float64.
TEST_F(CudaBackendTest, TimedUpProjectionKeepsCublasBits) {
  SCOPED_TRACE(trace());
  const int64_t n = 2048;
  const int h = 16, dn = 128, dv = 128, dc = 512;  // DeepSeek-V3.2 at 16 heads: 8.6 GFLOP
  ASSERT_GE(2.0 * h * (dn + dv) * double(n) * dc, cuda::GemmPlans::kTuneMinFlop);
  const Tensor w = testing::random_tensor(rng(), DType::kBF16, {h * (dn + dv), dc}, 0.05f);
  const Tensor c_kv = testing::random_tensor(rng(), DType::kBF16, {n, dc});
  const Tensor d_w = gpu_->to_device(w), d_c = gpu_->to_device(c_kv);
  const auto project = [&] {
    const Tensor kv = poisoned(DType::kBF16, {n, h, dn + dv});
    const KvHalves halves = kv_halves(kv, dn);
    gpu_->up_proj_kv(d_c, d_w, halves.k_nope, halves.v);
    return gpu_->to_host(kv);
  };
  const Tensor first = project(), second = project();
  // cuBLAS's choice: Out^T [H (dn + dv), n] = W [H (dn + dv), dc] · c_kv^T, as one GEMM.
  const Tensor want = gpu_->empty(DType::kBF16, {n, h, dn + dv});
  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(
      cublasSetMathMode(handle, cublasMath_t(CUBLAS_DEFAULT_MATH |
                                             CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
      CUBLAS_STATUS_SUCCESS);
  const float one = 1.0f, zero = 0.0f;
  const int m = h * (dn + dv);
  const cublasStatus_t status =
      cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, m, int(n), dc, &one, d_w.view().data,
                   CUDA_R_16BF, dc, d_c.view().data, CUDA_R_16BF, dc, &zero, want.view().data,
                   CUDA_R_16BF, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  ASSERT_CUDA(cudaDeviceSynchronize());
  cublasDestroy(handle);
  ASSERT_EQ(status, CUBLAS_STATUS_SUCCESS);
  const Tensor want_host = gpu_->to_host(want);
  EXPECT_TRUE(same_bytes(first, want_host)) << "timed plan vs cuBLAS";
  EXPECT_TRUE(same_bytes(second, want_host)) << "cached plan vs cuBLAS";
  std::vector<double> got, ref;
  for (int64_t r : {int64_t(0), n / 3, n - 1}) {
    for (int j = 0; j < m; ++j) {
      double acc = 0;
      for (int c = 0; c < dc; ++c)
        acc += double(bf16_to_f32(w.ptr<bf16_t>()[int64_t(j) * dc + c])) *
               bf16_to_f32(c_kv.ptr<bf16_t>()[r * dc + c]);
      ref.push_back(acc);
      got.push_back(bf16_to_f32(first.ptr<bf16_t>()[r * m + j]));
    }
  }
  EXPECT_LE(testing::rel_l2(got, ref), testing::kTolBf16);
}

TEST_F(CudaBackendTest, MergePartialsMatchesFloat64) {
  SCOPED_TRACE(trace());
  const int64_t parts = 3, t = 5, h = 4;  // 20 rows: the last CTA's warps past them idle
  // d = 64: every row 16-byte aligned, four values a lane by vector loads; d = 37: one at a time.
  for (const int64_t d : {int64_t(64), int64_t(37)}) {
    SCOPED_TRACE("d = " + std::to_string(d));
    Tensor o_parts = testing::random_tensor(rng(), DType::kF32, {parts, t, h, d});
    Tensor lse_parts = testing::random_tensor(rng(), DType::kF32, {parts, t, h}, 3.f);
    lse_parts.ptr<float>()[0 * t * h + 1] = kInf;  // part 0 of row 1 saw no key
    for (int64_t w = 0; w < parts; ++w)
      lse_parts.ptr<float>()[w * t * h + 2] = kInf;  // row 2: none
    const Tensor o = poisoned(DType::kF32, {t, h, d}), lse = poisoned(DType::kF32, {t, h});
    gpu_->merge_partials(gpu_->to_device(o_parts), gpu_->to_device(lse_parts), o, lse);
    std::vector<double> o_ref(size_t(t * h * d), 0.0), lse_ref(size_t(t * h));
    for (int64_t r = 0; r < t * h; ++r) {
      double m = -kInf;
      for (int64_t w = 0; w < parts; ++w) {
        const double l = lse_parts.ptr<float>()[w * t * h + r];
        if (!std::isinf(l)) m = std::max(m, l);
      }
      if (std::isinf(m)) {
        lse_ref[size_t(r)] = kInf;
        continue;
      }
      double sum = 0;
      for (int64_t w = 0; w < parts; ++w) {
        const double l = lse_parts.ptr<float>()[w * t * h + r];
        if (!std::isinf(l)) sum += std::exp(l - m);
      }
      lse_ref[size_t(r)] = m + std::log(sum);
      for (int64_t w = 0; w < parts; ++w) {
        const double l = lse_parts.ptr<float>()[w * t * h + r];
        if (std::isinf(l)) continue;
        for (int64_t e = 0; e < d; ++e)
          o_ref[size_t(r * d + e)] +=
              std::exp(l - lse_ref[size_t(r)]) * o_parts.ptr<float>()[(w * t * h + r) * d + e];
      }
    }
    const std::vector<double> o_got = testing::to_double(gpu_->to_host(o));
    EXPECT_LE(testing::rel_l2(o_got, o_ref), testing::kTolF32);
    EXPECT_LE(testing::max_abs_diff(testing::to_double(gpu_->to_host(lse)), lse_ref),
              testing::kTolLse);
    for (int64_t e = 0; e < d; ++e) ASSERT_EQ(o_got[size_t(2 * d + e)], 0.0) << "row 2 has no part";
  }
}

// ---- streams, workspace, graphs -------------------------------------------------------------

// One sparse-path forward on fixed device buffers, every op of the CUDA backend's sparse path:
// KV and index-key stores of the new tokens, indexer top-k, positions -> pool locations,
// q absorption, sparse MLA over the selected locations and the V up-projection.
struct ForwardBuffers {
  PagedKvPool kv;
  IndexerScene indexer;
  Tensor locs, c_kv, k_pe, idx_k, idx_q, idx_w, topk_out, topk_locs, q_nope, q_pe, w, q_abs, o_lat,
      lse, o;
  int k = 32;

  void run(Backend& be) const {
    PagedKvPool pool = kv;  // shares the storage
    IndexKeyPool keys = indexer.pool;
    be.store_kv(pool, locs, c_kv, k_pe);
    be.store_index_keys(keys, locs, idx_k);
    be.indexer_topk(idx_q, idx_w, indexer.layout(), k, topk_out);
    be.positions_to_locations(topk_out, indexer.kv_locs, indexer.kv_start, indexer.ctx_len,
                              topk_locs);
    be.absorb_q(q_nope, w, 128, q_abs);
    SparseMlaArgs a;
    a.q_abs = q_abs.view();
    a.q_pe = q_pe.view();
    a.kv = &kv;
    a.indices = topk_locs.view();
    a.sm_scale = 1.0 / std::sqrt(double(128 + 64));
    a.o_lat = o_lat.view();
    a.lse = lse.view();
    be.sparse_mla(a);
    be.up_proj_v(o_lat, w, 128, o);
  }
};

// The KV pool holds every context token (the prefix stored once, eagerly); each forward stores
// the new tokens at the locations the indexer's kv_locs give them.
ForwardBuffers make_forward(Backend& be, Rng& rng) {
  ForwardBuffers f;
  const int extend = 24, prefix = 100, h = 4;
  f.indexer = make_indexer_scene(be, rng, prefix, extend, 32);
  KvPoolDesc desc;
  desc.layout = KvLayout::kFp8Scaled;
  desc.num_pages = f.indexer.pool.desc().num_pages * f.indexer.pool.desc().page_size /
                   desc.page_size;  // the index pool's locations
  f.kv = be.make_kv_pool(desc);
  const std::vector<int32_t> all_locs = i32_values(be.to_host(f.indexer.kv_locs));
  be.store_kv(f.kv, f.indexer.kv_locs, be.to_device(tiled_bf16(rng, prefix + extend, desc.d_c)),
              be.to_device(testing::random_tensor(rng, DType::kBF16, {prefix + extend, 64})));
  f.locs = be.to_device(host_i32(std::vector<int32_t>(all_locs.end() - extend, all_locs.end())));
  f.c_kv = be.to_device(tiled_bf16(rng, extend, desc.d_c));
  f.k_pe = be.to_device(testing::random_tensor(rng, DType::kBF16, {extend, desc.d_rope}));
  f.idx_k = be.to_device(tiled_bf16(rng, extend, 128));
  f.idx_q = be.to_device(f.indexer.idx_q);
  f.idx_w = be.to_device(f.indexer.idx_w);
  f.topk_out = be.empty(DType::kI32, {extend, f.k});
  f.topk_locs = be.empty(DType::kI32, {extend, f.k});
  f.q_nope = be.to_device(testing::random_tensor(rng, DType::kBF16, {extend, h, 128}));
  f.q_pe = be.to_device(testing::random_tensor(rng, DType::kBF16, {extend, h, desc.d_rope}));
  f.w = be.to_device(testing::random_tensor(rng, DType::kBF16, {h * 256, 512}, 0.05f));
  f.q_abs = be.empty(DType::kBF16, {extend, h, 512});
  f.o_lat = be.empty(DType::kBF16, {extend, h, 512});
  f.lse = be.empty(DType::kF32, {extend, h});
  f.o = be.empty(DType::kBF16, {extend, h, 128});
  return f;
}

struct ForwardResult {
  Tensor kv, keys, topk, topk_locs, q_abs, o_lat, lse, o;
};

ForwardResult read_back(Backend& be, const ForwardBuffers& f) {
  return {be.to_host(f.kv.storage()), be.to_host(f.indexer.pool.storage()),
          be.to_host(f.topk_out),     be.to_host(f.topk_locs),
          be.to_host(f.q_abs),        be.to_host(f.o_lat),
          be.to_host(f.lse),          be.to_host(f.o)};
}

void expect_same(const ForwardResult& a, const ForwardResult& b) {
  EXPECT_TRUE(same_bytes(a.kv, b.kv)) << "kv pool";
  EXPECT_TRUE(same_bytes(a.keys, b.keys)) << "index-key pool";
  EXPECT_TRUE(same_bytes(a.topk, b.topk)) << "top-k";
  EXPECT_TRUE(same_bytes(a.topk_locs, b.topk_locs)) << "top-k locations";
  EXPECT_TRUE(same_bytes(a.q_abs, b.q_abs)) << "q_abs";
  EXPECT_TRUE(same_bytes(a.o_lat, b.o_lat)) << "o_lat";
  EXPECT_TRUE(same_bytes(a.lse, b.lse)) << "lse";
  EXPECT_TRUE(same_bytes(a.o, b.o)) << "o";
}

// Poisons every output a forward writes (the pools are inputs too and stay).
void poison_outputs(Backend& be, const ForwardBuffers& f) {
  for (const Tensor* t : {&f.topk_out, &f.topk_locs, &f.q_abs, &f.o_lat, &f.lse, &f.o})
    be.poison(t->view());
}

TEST_F(CudaBackendTest, DeterministicAndNoAllocationWhenWarm) {
  SCOPED_TRACE(trace());
  const ForwardBuffers f = make_forward(*gpu_, rng());
  f.run(*gpu_);
  const ForwardResult first = read_back(*gpu_, f);
  const cuda::MemoryStats warm = cuda().memory_stats();
  for (int i = 0; i < 3; ++i) {
    f.run(*gpu_);
    expect_same(read_back(*gpu_, f), first);
    // Fresh outputs of the same shapes come from the arena's cache.
    const Tensor scratch = gpu_->empty(DType::kF32, {24, 4, 512});
    gpu_->poison(scratch.view());
  }
  const cuda::MemoryStats after = cuda().memory_stats();
  EXPECT_LE(after.device_mallocs, warm.device_mallocs + 1) << "one arena block for `scratch`";
  EXPECT_EQ(after.workspace_bytes, warm.workspace_bytes);
}

TEST_F(CudaBackendTest, RunsOnACallerStream) {
  SCOPED_TRACE(trace());
  const ForwardBuffers f = make_forward(*gpu_, rng());
  f.run(*gpu_);
  const ForwardResult own_stream = read_back(*gpu_, f);
  cudaStream_t stream = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cuda().set_stream(stream);
  EXPECT_EQ(cuda().stream(), stream);
  f.run(*gpu_);
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  expect_same(read_back(*gpu_, f), own_stream);
  cuda().set_stream(nullptr);
  ASSERT_CUDA(cudaStreamDestroy(stream));
}

TEST_F(CudaBackendTest, SparseForwardCapturesIntoACudaGraph) {
  SCOPED_TRACE(trace());
  for (cuda::IndexerKernel kernel :
       {cuda::IndexerKernel::kScalar, cuda::IndexerKernel::kTensorCore,
        cuda::IndexerKernel::kWgmmaExact, cuda::IndexerKernel::kWgmma}) {
    SCOPED_TRACE(std::string(logits_kernel_name(kernel)) + " logits");
    cuda().options().indexer_kernel = kernel;
    ForwardBuffers f = make_forward(*gpu_, rng());
    cudaStream_t stream = nullptr;
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cuda().set_stream(stream);
    f.run(*gpu_);  // warm-up: workspace and cuBLAS settle
    gpu_->synchronize();
    const cuda::MemoryStats warm = cuda().memory_stats();

    cudaGraph_t graph = nullptr;
    ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    f.run(*gpu_);  // no host sync, no allocation: value checks are skipped while capturing
    ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    EXPECT_EQ(cuda().memory_stats().device_mallocs, warm.device_mallocs);
    size_t nodes = 0;
    ASSERT_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
    EXPECT_GE(nodes, size_t(7)) << "one or more kernels per op";

    // New inputs in the same buffers (every op's activations change), then replay; compare
    // with an eager run on those inputs.
    auto refill = [&](const Tensor& dst, const Tensor& host) { gpu_->copy(dst, host); };
    refill(f.c_kv, tiled_bf16(rng(), f.c_kv.size(0), f.c_kv.size(1)));
    refill(f.idx_k, tiled_bf16(rng(), f.idx_k.size(0), f.idx_k.size(1)));
    refill(f.idx_q, testing::random_tensor(rng(), DType::kBF16, shape_of(f.indexer.idx_q)));
    refill(f.q_nope, testing::random_tensor(rng(), DType::kBF16, shape_of(f.q_nope)));
    refill(f.q_pe, testing::random_tensor(rng(), DType::kBF16, shape_of(f.q_pe)));
    const ForwardResult before = read_back(*gpu_, f);
    poison_outputs(*gpu_, f);
    ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    ASSERT_CUDA(cudaStreamSynchronize(stream));
    const ForwardResult replayed = read_back(*gpu_, f);
    EXPECT_FALSE(same_bytes(replayed.kv, before.kv)) << "the replay stored the new tokens";
    const std::vector<int32_t> locs = i32_values(replayed.topk_locs);
    EXPECT_TRUE(std::all_of(locs.begin(), locs.end(), [](int32_t l) { return l >= -1; }));
    const std::vector<double> o = testing::to_double(replayed.o);
    EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](double v) { return std::isfinite(v); }));

    poison_outputs(*gpu_, f);
    f.run(*gpu_);
    expect_same(replayed, read_back(*gpu_, f));

    ASSERT_CUDA(cudaGraphExecDestroy(exec));
    ASSERT_CUDA(cudaGraphDestroy(graph));
    cuda().set_stream(nullptr);
    ASSERT_CUDA(cudaStreamDestroy(stream));
  }
}

}  // namespace
}  // namespace dsakit
