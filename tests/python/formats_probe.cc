// Exposes dsakit's number formats and CPU pool quantizers to tests/python/test_formats.py, which
// checks them against numpy + ml_dtypes. All files are raw little-endian arrays.
//
//   dsakit_formats_probe convert IN.f32 OUT.e4m3 OUT.bf16
//       n fp32 values -> n e4m3fn bytes (f32_to_e4m3) and n bf16 bit patterns (f32_to_bf16).
//   dsakit_formats_probe store-kv LAYOUT POLICY K_SCALE IN.bf16 OUT.bin
//       IN holds n tokens of 576 bf16 (c_kv [512] then k_pe [64]); they are stored at locations
//       0 … n-1 of a page-size-1 pool of LAYOUT (bf16 | fp8 | fp8-raw) through the CPU backend;
//       OUT receives the pool bytes [n, bytes_per_token].
//   dsakit_formats_probe store-index IN.bf16 OUT.bin
//       IN holds n keys of 128 bf16; OUT receives a page-size-1 index-key pool: per key 128
//       e4m3 bytes then its fp32 scale.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/error.h"

namespace {

using namespace dsakit;

constexpr int kDc = 512, kDrope = 64, kDi = 128;

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DSAKIT_CHECK(in.good(), kFormat, path, ": cannot open");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), std::streamsize(bytes));
  DSAKIT_CHECK(out.good(), kFormat, path, ": write failed");
}

// Host bf16 tensor [n, width] from a file of n * width bf16 values.
Tensor read_bf16_rows(const std::string& path, int width) {
  const std::vector<char> bytes = read_file(path);
  const size_t row_bytes = size_t(width) * sizeof(bf16_t);
  DSAKIT_CHECK_ARG(bytes.size() % row_bytes == 0, path, ": ", bytes.size(),
                   " bytes is not a whole number of ", width, "-value bf16 rows");
  Tensor t = Tensor::host(DType::kBF16, {int64_t(bytes.size() / row_bytes), width});
  std::memcpy(t.ptr<bf16_t>(), bytes.data(), bytes.size());
  return t;
}

Tensor iota_locations(int64_t n) {
  Tensor locs = Tensor::host(DType::kI32, {n});
  for (int64_t i = 0; i < n; ++i) locs.ptr<int32_t>()[i] = int32_t(i);
  return locs;
}

void convert(const std::string& in, const std::string& out_e4m3, const std::string& out_bf16) {
  const std::vector<char> bytes = read_file(in);
  const size_t n = bytes.size() / sizeof(float);
  std::vector<uint8_t> e4m3(n);
  std::vector<uint16_t> bf16(n);
  for (size_t i = 0; i < n; ++i) {
    float x;
    std::memcpy(&x, bytes.data() + i * sizeof(float), sizeof(float));
    e4m3[i] = f32_to_e4m3(x);
    bf16[i] = f32_to_bf16(x).bits;
  }
  write_file(out_e4m3, e4m3.data(), e4m3.size());
  write_file(out_bf16, bf16.data(), bf16.size() * sizeof(uint16_t));
}

void store_kv(const std::string& layout, const std::string& policy, const std::string& k_scale,
              const std::string& in, const std::string& out) {
  const Tensor tokens = read_bf16_rows(in, kDc + kDrope);
  const int64_t n = tokens.size(0);
  Tensor c_kv = Tensor::host(DType::kBF16, {n, kDc});
  Tensor k_pe = Tensor::host(DType::kBF16, {n, kDrope});
  for (int64_t i = 0; i < n; ++i) {
    const bf16_t* row = tokens.ptr<bf16_t>() + i * (kDc + kDrope);
    std::memcpy(c_kv.ptr<bf16_t>() + i * kDc, row, kDc * sizeof(bf16_t));
    std::memcpy(k_pe.ptr<bf16_t>() + i * kDrope, row + kDc, kDrope * sizeof(bf16_t));
  }
  KvPoolDesc desc;
  desc.layout = parse_kv_layout(layout);
  desc.scale_policy = parse_scale_policy(policy);
  desc.k_scale = std::stof(k_scale);
  desc.page_size = 1;
  desc.num_pages = n;
  auto backend = make_cpu_backend();
  PagedKvPool pool = backend->make_kv_pool(desc);
  backend->store_kv(pool, iota_locations(n), c_kv, k_pe);
  write_file(out, pool.storage().data, pool.storage().nbytes());
}

void store_index(const std::string& in, const std::string& out) {
  const Tensor keys = read_bf16_rows(in, kDi);
  const int64_t n = keys.size(0);
  IndexKeyPoolDesc desc;
  desc.page_size = 1;
  desc.num_pages = n;
  desc.d_i = kDi;
  auto backend = make_cpu_backend();
  IndexKeyPool pool = backend->make_index_pool(desc);
  backend->store_index_keys(pool, iota_locations(n), keys);
  write_file(out, pool.storage().data, pool.storage().nbytes());
}

int usage() {
  std::fprintf(stderr,
               "usage: dsakit_formats_probe convert IN.f32 OUT.e4m3 OUT.bf16\n"
               "       dsakit_formats_probe store-kv LAYOUT POLICY K_SCALE IN.bf16 OUT.bin\n"
               "       dsakit_formats_probe store-index IN.bf16 OUT.bin\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 4 && args[0] == "convert") {
      convert(args[1], args[2], args[3]);
    } else if (args.size() == 6 && args[0] == "store-kv") {
      store_kv(args[1], args[2], args[3], args[4], args[5]);
    } else if (args.size() == 3 && args[0] == "store-index") {
      store_index(args[1], args[2]);
    } else {
      return usage();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsakit_formats_probe: %s\n", e.what());
    return 1;
  }
  return 0;
}
