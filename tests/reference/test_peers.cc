// Agreement with the golden outputs of the peer kernels (docs/numerics.md; conventions and shapes
// in tests/data/peers/README.md): FlashMLA's FP8 quantizer, sparse prefill and FP8 sparse decode,
// and DeepGEMM's FP8 indexer logits. Each file is checked against the float64 reference and against
// every backend of testing::test_backends(). Measured figures are printed as "[ measure ] ..."
// lines (and recorded as test properties); docs/numerics.md lists them.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>

#include "dsakit/backend.h"
#include "dsakit/safetensors.h"
#include "src/reference/reference.h"
#include "tests/common/test_util.h"

namespace dsakit {
namespace {

namespace ref = reference;
using ref::Vec;
constexpr double kInf = std::numeric_limits<double>::infinity();

// FlashMLA's sm_scale for DeepSeek-V3.2 (tests/data/peers/README.md); the files' metadata
// repeats it.
constexpr double kPeerSmScale = 0.1352;

// Indexer logits: the peer itself is 1.25e-4 rel-L2 and 0.047 max abs (of logits up to ~311)
// away from float64, above fp32 rounding. Allow 8x that rel-L2 and a max abs error of 1e-3 of
// the largest logit magnitude.
constexpr double kTolIndexerRel = 1e-3;
constexpr double kTolIndexerAbsOfMax = 1e-3;

SafetensorsFile load_peer(const std::string& file) {
  return SafetensorsFile::read(testing::peers_dir() + "/" + file);
}

double metadata_sm_scale(const SafetensorsFile& f) {
  const auto it = f.metadata().find("sm_scale");
  return it == f.metadata().end() ? kPeerSmScale : std::stod(it->second);
}

void report(const std::string& what, double value) {
  std::ostringstream os;
  os << std::setprecision(3) << value;
  std::printf("[ measure ] %s = %s\n", what.c_str(), os.str().c_str());
  ::testing::Test::RecordProperty(what, os.str());
}

// ---- host tensor plumbing ------------------------------------------------------------------

// Columns [begin, end) of a row-major host tensor seen as [rows, cols] (any dtype): a new
// contiguous [rows, end - begin] tensor, or [lead..., end - begin] when `shape` is given.
Tensor columns(const TensorView& src, int64_t cols, int64_t begin, int64_t end,
               std::vector<int64_t> shape = {}) {
  const int64_t rows = src.numel() / cols, width = end - begin;
  const size_t elem = dtype_size(src.dtype);
  if (shape.empty()) shape = {rows, width};
  Tensor out = Tensor::host(src.dtype, shape);
  const auto* s = static_cast<const uint8_t*>(src.data);
  auto* d = out.ptr<uint8_t>();
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(d + r * width * elem, s + (r * cols + begin) * elem, size_t(width) * elem);
  return out;
}

// The same bytes under another shape.
Tensor reshaped(const TensorView& src, const std::vector<int64_t>& shape) {
  return columns(src, src.numel(), 0, src.numel(), shape);
}

Tensor i32_tensor(const std::vector<int32_t>& values) {
  Tensor t = Tensor::host(DType::kI32, {int64_t(values.size())});
  std::copy(values.begin(), values.end(), t.ptr<int32_t>());
  return t;
}

std::vector<int32_t> i32_values(const TensorView& t) {
  const int32_t* p = t.ptr<const int32_t>();
  return std::vector<int32_t>(p, p + t.numel());
}

std::vector<int32_t> iota_i32(int64_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

size_t count_bit_mismatches(const TensorView& a, const TensorView& b) {
  EXPECT_EQ(a.nbytes(), b.nbytes());
  const auto *pa = static_cast<const uint8_t*>(a.data), *pb = static_cast<const uint8_t*>(b.data);
  const size_t elem = dtype_size(a.dtype);
  size_t bad = 0;
  for (size_t i = 0; i < std::min(a.nbytes(), b.nbytes()); i += elem)
    bad += std::memcmp(pa + i, pb + i, elem) != 0;
  return bad;
}

// ---- fp8_656_pow2 ----------------------------------------------------------------------------

constexpr KvRowLayout kFp8Row{KvLayout::kFp8Scaled, 512, 64};
constexpr int kTilesPerToken = 512 / kFp8TileSize;

// Compares 656-byte tokens tile by tile (128 code bytes + the tile's fp32 scale) and the rope
// bytes; returns one line per differing tile or rope. A tile with the "one ulp above a power of
// two" quirk (docs/formats.md#scale-rules) would show up here by token, tile and kind.
std::vector<std::string> fp8_token_diffs(const uint8_t* got, const uint8_t* want, int64_t tokens,
                                         const uint8_t* tile_kind) {
  std::vector<std::string> diffs;
  const int bytes = kFp8Row.bytes_per_token();
  for (int64_t n = 0; n < tokens; ++n) {
    const uint8_t *g = got + n * bytes, *w = want + n * bytes;
    for (int tile = 0; tile < kTilesPerToken; ++tile) {
      const int codes = tile * kFp8TileSize, scale = kFp8Row.scales_offset() + 4 * tile;
      if (std::memcmp(g + codes, w + codes, kFp8TileSize) != 0 ||
          std::memcmp(g + scale, w + scale, 4) != 0) {
        float sg, sw;
        std::memcpy(&sg, g + scale, 4);
        std::memcpy(&sw, w + scale, 4);
        std::ostringstream os;
        os << "token " << n << " tile " << tile << " (kind "
           << int(tile_kind[n * kTilesPerToken + tile]) << "): scale " << sg << " vs " << sw;
        diffs.push_back(os.str());
      }
    }
    const int rope = kFp8Row.rope_offset();
    if (std::memcmp(g + rope, w + rope, size_t(bytes - rope)) != 0)
      diffs.push_back("token " + std::to_string(n) + ": rope bytes differ");
  }
  return diffs;
}

void expect_no_fp8_diffs(const std::string& who, const std::vector<std::string>& diffs) {
  report(who + " fp8 pow2 tiles or ropes differing from FlashMLA", double(diffs.size()));
  EXPECT_EQ(diffs.size(), 0u) << "differing tiles or ropes (first ones below)";
  for (size_t i = 0; i < diffs.size() && i < 8; ++i) ADD_FAILURE() << diffs[i];
}

// bf16 values read back vs FlashMLA's dequantize_k_cache: bit-exact.
void expect_same_bf16(const std::string& who, const TensorView& got, const TensorView& want) {
  const size_t bad = count_bit_mismatches(got, want);
  report(who + " bf16 values differing from dequantize_k_cache", double(bad));
  EXPECT_EQ(bad, 0u);
}

struct Fp8Golden {
  Tensor input, packed, dequantized, tile_kind;
  int64_t tokens = 0;
  static Fp8Golden load() {
    const SafetensorsFile f = load_peer("fp8_656_pow2.safetensors");
    Fp8Golden g;
    g.input = f.get("input", DType::kBF16, {-1, 576});
    g.tokens = g.input.size(0);
    g.packed = f.get("packed", DType::kU8, {g.tokens, 656});
    g.dequantized = f.get("dequantized", DType::kBF16, {g.tokens, 576});
    g.tile_kind = f.get("tile_kind", DType::kU8, {g.tokens, kTilesPerToken});
    return g;
  }
};

TEST(PeerReference, Fp8QuantizerPow2MatchesFlashMla) {
  const Fp8Golden g = Fp8Golden::load();
  const Vec input = ref::to_vec(g.input);
  const uint8_t* packed = g.packed.ptr<uint8_t>();
  std::vector<uint8_t> encoded;
  Tensor decoded = Tensor::host(DType::kBF16, {g.tokens, 576});
  Vec c_kv(512), k_pe(64);
  for (int64_t n = 0; n < g.tokens; ++n) {
    const double* x = input.data() + n * 576;
    const auto row = ref::encode_kv_row(kFp8Row, x, x + 512, ScalePolicy::kPow2, 1.0);
    encoded.insert(encoded.end(), row.begin(), row.end());
    ref::decode_kv_row(kFp8Row, packed + n * 656, 1.0, c_kv.data(), k_pe.data());
    for (int i = 0; i < 576; ++i)
      decoded.ptr<bf16_t>()[n * 576 + i] =
          f32_to_bf16(float(ref::bf16_round(i < 512 ? c_kv[size_t(i)] : k_pe[size_t(i - 512)])));
  }
  expect_no_fp8_diffs(
      "reference", fp8_token_diffs(encoded.data(), packed, g.tokens, g.tile_kind.ptr<uint8_t>()));
  expect_same_bf16("reference", decoded, g.dequantized);
}

TEST(PeerBackend, Fp8StoreAndGatherMatchFlashMla) {
  const Fp8Golden g = Fp8Golden::load();
  const Tensor c_kv = columns(g.input, 576, 0, 512), k_pe = columns(g.input, 576, 512, 576);
  for (const std::string& name : testing::test_backends()) {
    SCOPED_TRACE(name);
    auto be = make_backend(name);
    KvPoolDesc desc;
    desc.layout = KvLayout::kFp8Scaled;
    desc.scale_policy = ScalePolicy::kPow2;
    desc.page_size = 64;
    desc.num_pages = 8;
    ASSERT_EQ(desc.num_locations(), g.tokens);
    PagedKvPool pool = be->make_kv_pool(desc);
    const Tensor locs = be->to_device(i32_tensor(iota_i32(g.tokens)));  // token n at location n
    be->store_kv(pool, locs, be->to_device(c_kv), be->to_device(k_pe));
    const Tensor stored = be->to_host(pool.storage());
    expect_no_fp8_diffs(name, fp8_token_diffs(stored.ptr<uint8_t>(), g.packed.ptr<uint8_t>(),
                                              g.tokens, g.tile_kind.ptr<uint8_t>()));

    Tensor c_out = be->empty(DType::kBF16, {g.tokens, 512});
    Tensor pe_out = be->empty(DType::kBF16, {g.tokens, 64});
    be->poison(c_out);
    be->poison(pe_out);
    be->gather_kv(pool, locs, c_out, pe_out);
    expect_same_bf16(name + " gather c_kv", be->to_host(c_out),
                     columns(g.dequantized, 576, 0, 512));
    expect_same_bf16(name + " gather k_pe", be->to_host(pe_out),
                     columns(g.dequantized, 576, 512, 576));
  }
}

// ---- sparse_prefill --------------------------------------------------------------------------

struct PrefillGolden {
  static constexpr int64_t kQueries = 32, kHeads = 64, kKv = 700, kTopk = 256;
  Tensor q, kv, indices, topk_length;
  Tensor out, lse, max_logits;           // plain call
  Tensor out_tl, lse_tl, max_logits_tl;  // with topk_length
  double sm_scale = kPeerSmScale;

  static PrefillGolden load() {
    const SafetensorsFile in = load_peer("sparse_prefill.safetensors");
    const SafetensorsFile plain = load_peer("sparse_prefill_out.safetensors");
    const SafetensorsFile tl = load_peer("sparse_prefill_topk_length.safetensors");
    PrefillGolden g;
    g.q = in.get("q", DType::kBF16, {kQueries, kHeads, 576});
    g.kv = in.get("kv", DType::kBF16, {kKv, 1, 576});
    g.indices = in.get("indices", DType::kI32, {kQueries, 1, kTopk});
    g.sm_scale = metadata_sm_scale(in);
    g.out = plain.get("out", DType::kBF16, {kQueries, kHeads, 512});
    g.lse = plain.get("lse", DType::kF32, {kQueries, kHeads});
    g.max_logits = plain.get("max_logits", DType::kF32, {kQueries, kHeads});
    g.topk_length = tl.get("topk_length", DType::kI32, {kQueries});
    g.out_tl = tl.get("out_tl", DType::kBF16, {kQueries, kHeads, 512});
    g.lse_tl = tl.get("lse_tl", DType::kF32, {kQueries, kHeads});
    g.max_logits_tl = tl.get("max_logits_tl", DType::kF32, {kQueries, kHeads});
    return g;
  }
};

// Every head of query t has o = 0 exactly and lse = +inf.
void expect_empty_query(const Vec& o, const Vec& lse, int64_t t, int64_t heads, int64_t d_v) {
  for (int64_t i = t * heads * d_v; i < (t + 1) * heads * d_v; ++i)
    ASSERT_EQ(o[size_t(i)], 0.0) << "query " << t << " entry " << i;
  for (int64_t h = 0; h < heads; ++h) ASSERT_EQ(lse[size_t(t * heads + h)], kInf) << "query " << t;
}

TEST(PeerReference, SparsePrefillMatchesFlashMla) {
  using G = PrefillGolden;
  const G g = G::load();
  const Vec q = ref::to_vec(g.q), kv = ref::to_vec(g.kv);
  const std::vector<int32_t> indices = i32_values(g.indices), lengths = i32_values(g.topk_length);
  struct Call {
    const char* name;
    const std::vector<int32_t>* topk_length;
    const Tensor &out, &lse, &max_logits;
  };
  for (const Call& c : {Call{"plain", nullptr, g.out, g.lse, g.max_logits},
                        Call{"topk_length", &lengths, g.out_tl, g.lse_tl, g.max_logits_tl}}) {
    SCOPED_TRACE(c.name);
    const auto a = ref::sparse_attention(q, kv, G::kQueries, G::kHeads, 576, 512, G::kKv, indices,
                                         G::kTopk, c.topk_length, g.sm_scale);
    const double out_err = testing::rel_l2(ref::to_vec(c.out), a.o);
    const double lse_err = testing::max_abs_diff(ref::to_vec(c.lse), a.lse);
    const double max_err = testing::max_abs_diff(ref::to_vec(c.max_logits), a.max_logit);
    report(std::string("prefill ") + c.name + " reference vs FlashMLA out rel-L2", out_err);
    report(std::string("prefill ") + c.name + " reference vs FlashMLA lse max abs", lse_err);
    report(std::string("prefill ") + c.name + " reference vs FlashMLA max_logits max abs", max_err);
    EXPECT_LE(out_err, testing::kTolBf16);
    EXPECT_LE(lse_err, testing::kTolLse);
    EXPECT_LE(max_err, testing::kTolLse);
    expect_empty_query(a.o, a.lse, 5, G::kHeads, 512);
    EXPECT_EQ(a.max_logit[5 * G::kHeads], -kInf);
  }
}

TEST(PeerBackend, SparsePrefillMatchesFlashMla) {
  using G = PrefillGolden;
  const G g = G::load();
  // The absorbed query as given: [q_abs (512) | q_pe (64)]; no projection.
  const Tensor q_abs = columns(g.q, 576, 0, 512, {G::kQueries, G::kHeads, 512});
  const Tensor q_pe = columns(g.q, 576, 512, 576, {G::kQueries, G::kHeads, 64});
  const Tensor c_kv = columns(g.kv, 576, 0, 512), k_pe = columns(g.kv, 576, 512, 576);
  const Tensor indices = reshaped(g.indices, {G::kQueries, G::kTopk});

  for (const std::string& name : testing::test_backends()) {
    SCOPED_TRACE(name);
    auto be = make_backend(name);
    // Exactly 700 locations (20 pages of 35), token n at location n, so that the file's invalid
    // indices 700, 701, 763, ... fall outside the pool.
    KvPoolDesc desc;
    desc.layout = KvLayout::kBf16;
    desc.page_size = 35;
    desc.num_pages = 20;
    ASSERT_EQ(desc.num_locations(), G::kKv);
    PagedKvPool pool = be->make_kv_pool(desc);
    be->store_kv(pool, be->to_device(i32_tensor(iota_i32(G::kKv))), be->to_device(c_kv),
                 be->to_device(k_pe));

    const Tensor q_abs_d = be->to_device(q_abs), q_pe_d = be->to_device(q_pe);
    const Tensor indices_d = be->to_device(indices), lengths_d = be->to_device(g.topk_length);
    struct Call {
      const char* name;
      const Tensor* topk_length;
      const Tensor &out, &lse;
    };
    for (const Call& c : {Call{"plain", nullptr, g.out, g.lse},
                          Call{"topk_length", &lengths_d, g.out_tl, g.lse_tl}}) {
      SCOPED_TRACE(c.name);
      SparseMlaArgs args;
      args.q_abs = q_abs_d;
      args.q_pe = q_pe_d;
      args.kv = &pool;
      args.indices = indices_d;
      if (c.topk_length) args.topk_length = *c.topk_length;
      args.sm_scale = g.sm_scale;
      Tensor o_lat = be->empty(DType::kBF16, {G::kQueries, G::kHeads, 512});
      Tensor lse = be->empty(DType::kF32, {G::kQueries, G::kHeads});
      be->poison(o_lat);
      be->poison(lse);
      args.o_lat = o_lat;
      args.lse = lse;
      be->sparse_mla(args);
      const Vec o_got = ref::to_vec(be->to_host(o_lat)), lse_got = ref::to_vec(be->to_host(lse));
      const double out_err = testing::rel_l2(o_got, ref::to_vec(c.out));
      const double lse_err = testing::max_abs_diff(lse_got, ref::to_vec(c.lse));
      report(name + " prefill " + c.name + " vs FlashMLA out rel-L2", out_err);
      report(name + " prefill " + c.name + " vs FlashMLA lse max abs", lse_err);
      EXPECT_LE(out_err, testing::kTolBf16);
      EXPECT_LE(lse_err, testing::kTolLse);  // also +inf exactly where FlashMLA has +inf
      expect_empty_query(o_got, lse_got, 5, G::kHeads, 512);
      if (c.topk_length) expect_empty_query(o_got, lse_got, 1, G::kHeads, 512);
    }
  }
}

// ---- indexer_logits --------------------------------------------------------------------------

struct IndexerGolden {
  static constexpr int64_t kS = 256, kHeads = 64, kDim = 128;
  Tensor q_fp8, k_fp8, k_scale, weights, ks, ke, logits;

  static IndexerGolden load() {
    const SafetensorsFile f = load_peer("indexer_logits.safetensors");
    IndexerGolden g;
    g.q_fp8 = f.get("q_fp8", DType::kU8, {kS, kHeads, kDim});
    g.k_fp8 = f.get("k_fp8", DType::kU8, {kS, kDim});
    g.k_scale = f.get("k_scale", DType::kF32, {kS});
    g.weights = f.get("weights", DType::kF32, {kS, kHeads});
    g.ks = f.get("ks", DType::kI32, {kS});
    g.ke = f.get("ke", DType::kI32, {kS});
    g.logits = f.get("logits", DType::kF32, {kS, kS});
    return g;
  }
  // Query i reads keys [ks[i], ke[i]) of the identity location list.
  std::vector<int32_t> ctx_len() const {
    std::vector<int32_t> n = i32_values(ke), start = i32_values(ks);
    for (size_t i = 0; i < n.size(); ++i) n[i] -= start[i];
    return n;
  }
};

// Compares logits: rel-L2 and max abs over the entries p < ctx_len[t]; -inf exactly elsewhere.
void expect_indexer_logits(const std::string& who, const Vec& got, const Vec& want,
                           const std::vector<int32_t>& ctx_len, int64_t width) {
  Vec got_valid, want_valid;
  size_t masked_wrong = 0;
  double want_max = 0;
  for (size_t t = 0; t < ctx_len.size(); ++t)
    for (int64_t p = 0; p < width; ++p) {
      const size_t i = t * size_t(width) + size_t(p);
      if (p < ctx_len[t]) {
        got_valid.push_back(got[i]);
        want_valid.push_back(want[i]);
        want_max = std::max(want_max, std::fabs(want[i]));
      } else {
        masked_wrong += !(got[i] == -kInf && want[i] == -kInf);
      }
    }
  const double rel = testing::rel_l2(got_valid, want_valid);
  const double abs = testing::max_abs_diff(got_valid, want_valid);
  report(who + " vs DeepGEMM logits rel-L2", rel);
  report(who + " vs DeepGEMM logits max abs", abs);
  EXPECT_LE(rel, kTolIndexerRel);
  EXPECT_LE(abs, kTolIndexerAbsOfMax * want_max);
  EXPECT_EQ(masked_wrong, 0u) << "masked entries that are not exactly -inf";
}

TEST(PeerReference, IndexerLogitsMatchDeepGemm) {
  using G = IndexerGolden;
  const G g = G::load();
  Vec q = ref::to_vec(g.q_fp8), k = ref::to_vec(g.k_fp8);
  for (double& x : q) x = ref::e4m3_value(uint8_t(x));
  for (double& x : k) x = ref::e4m3_value(uint8_t(x));
  const auto ctx_len = g.ctx_len();
  const Vec logits =
      ref::indexer_logits(q, ref::to_vec(g.weights), k, ref::to_vec(g.k_scale), G::kS, G::kHeads,
                          G::kDim, iota_i32(G::kS), i32_values(g.ks), ctx_len, G::kS);
  expect_indexer_logits("reference", logits, ref::to_vec(g.logits), ctx_len, G::kS);
}

TEST(PeerBackend, IndexerLogitsMatchDeepGemm) {
  using G = IndexerGolden;
  const G g = G::load();
  // Index-key pool, token j at location j; each page holds page_size·d_i e4m3 bytes, then
  // page_size fp32 scales.
  IndexKeyPoolDesc desc;
  desc.page_size = 64;
  desc.num_pages = 4;
  desc.d_i = int(G::kDim);
  ASSERT_EQ(desc.num_locations(), G::kS);
  Tensor storage = Tensor::host(DType::kU8, {desc.num_pages, desc.page_bytes()});
  for (int64_t page = 0; page < desc.num_pages; ++page) {
    uint8_t* dst = storage.ptr<uint8_t>() + page * desc.page_bytes();
    const int64_t first = page * desc.page_size;
    std::memcpy(dst, g.k_fp8.ptr<uint8_t>() + first * G::kDim, size_t(desc.page_size * G::kDim));
    std::memcpy(dst + desc.page_size * G::kDim, g.k_scale.ptr<float>() + first,
                size_t(desc.page_size) * sizeof(float));
  }
  const auto ctx_len = g.ctx_len();

  for (const std::string& name : testing::test_backends()) {
    SCOPED_TRACE(name);
    auto be = make_backend(name);
    IndexKeyPool pool = be->make_index_pool(desc);
    be->copy(pool.storage(), storage);
    // k_scale is per key and q carries no scale, so the gate is the raw head weight.
    const Tensor q8 = be->to_device(g.q_fp8), gate = be->to_device(g.weights);
    const Tensor kv_locs = be->to_device(i32_tensor(iota_i32(G::kS)));
    const Tensor kv_start = be->to_device(g.ks), ctx = be->to_device(i32_tensor(ctx_len));
    IndexerArgs args;
    args.q8 = q8;
    args.gate = gate;
    args.keys = &pool;
    args.kv_locs = kv_locs;
    args.kv_start = kv_start;
    args.ctx_len = ctx;
    Tensor logits = be->empty(DType::kF32, {G::kS, G::kS});
    be->poison(logits);
    be->indexer_logits(args, 0, G::kS, logits);
    expect_indexer_logits(name, ref::to_vec(be->to_host(logits)), ref::to_vec(g.logits), ctx_len,
                          G::kS);
  }
}

// ---- sparse_decode_fp8 -----------------------------------------------------------------------

struct DecodeGolden {
  static constexpr int64_t kBatch = 4, kHeads = 64, kTopk = 128, kPages = 68, kPageSize = 64;
  Tensor q, kcache, block_table, abs_indices, indices, out, lse;
  double sm_scale = kPeerSmScale;

  static DecodeGolden load() {
    const SafetensorsFile f = load_peer("sparse_decode_fp8.safetensors");
    DecodeGolden g;
    g.q = f.get("q", DType::kBF16, {kBatch, 1, kHeads, 576});
    g.kcache = f.get("kcache", DType::kU8, {kPages, kPageSize, 656});
    g.block_table = f.get("block_table", DType::kI32, {kBatch, -1});
    g.abs_indices = f.get("abs_indices", DType::kI32, {kBatch, 1, kTopk});
    g.indices = f.get("indices", DType::kI32, {kBatch, 1, kTopk});
    g.out = f.get("out", DType::kBF16, {kBatch, 1, kHeads, 512});
    g.lse = f.get("lse", DType::kF32, {kBatch, 1, kHeads});
    g.sm_scale = metadata_sm_scale(f);
    return g;
  }

  // The whole pool dequantized by the reference: [kPages·kPageSize, 576].
  Vec dequantized_pool() const {
    const int64_t n = kPages * kPageSize;
    Vec kv(size_t(n * 576));
    for (int64_t loc = 0; loc < n; ++loc)
      ref::decode_kv_row(kFp8Row, kcache.ptr<uint8_t>() + loc * 656, 1.0, &kv[size_t(loc * 576)],
                         &kv[size_t(loc * 576 + 512)]);
    return kv;
  }

  ref::Attention reference() const {
    return ref::sparse_attention(ref::to_vec(q), dequantized_pool(), kBatch, kHeads, 576, 512,
                                 kPages * kPageSize, i32_values(indices), kTopk, nullptr, sm_scale);
  }
};

TEST(PeerReference, SparseDecodeFp8MatchesFlashMla) {
  using G = DecodeGolden;
  const G g = G::load();
  // The golden indices are the block-table mapping of the per-request positions.
  const auto pos = i32_values(g.abs_indices), locs = i32_values(g.indices);
  const auto table = i32_values(g.block_table);
  const int64_t pages_per_req = g.block_table.size(1);
  for (int64_t r = 0; r < G::kBatch; ++r)
    for (int64_t j = 0; j < G::kTopk; ++j) {
      const int32_t p = pos[size_t(r * G::kTopk + j)];
      const int32_t want =
          p < 0 ? -1
                : table[size_t(r * pages_per_req + p / G::kPageSize)] * int32_t(G::kPageSize) +
                      p % int32_t(G::kPageSize);
      ASSERT_EQ(locs[size_t(r * G::kTopk + j)], want) << "request " << r << " slot " << j;
    }
  const auto a = g.reference();
  const double out_err = testing::rel_l2(ref::to_vec(g.out), a.o);
  const double lse_err = testing::max_abs_diff(ref::to_vec(g.lse), a.lse);
  report("decode fp8 reference vs FlashMLA out rel-L2", out_err);
  report("decode fp8 reference vs FlashMLA lse max abs", lse_err);
  EXPECT_LE(out_err, testing::kTolBf16);
  EXPECT_LE(lse_err, testing::kTolLse);
}

TEST(PeerBackend, SparseDecodeFp8MatchesFlashMla) {
  using G = DecodeGolden;
  const G g = G::load();
  const Tensor q_abs = columns(g.q, 576, 0, 512, {G::kBatch, G::kHeads, 512});
  const Tensor q_pe = columns(g.q, 576, 512, 576, {G::kBatch, G::kHeads, 64});
  const Tensor indices = reshaped(g.indices, {G::kBatch, G::kTopk});
  const Tensor cache = reshaped(g.kcache, {G::kPages * G::kPageSize, 656});
  const auto want = g.reference();

  for (const std::string& name : testing::test_backends()) {
    SCOPED_TRACE(name);
    auto be = make_backend(name);
    KvPoolDesc desc;
    desc.layout = KvLayout::kFp8Scaled;
    desc.scale_policy = ScalePolicy::kPow2;
    desc.page_size = int(G::kPageSize);
    desc.num_pages = G::kPages;
    PagedKvPool pool = be->make_kv_pool(desc);
    be->copy(pool.storage(), cache);

    const Tensor q_abs_d = be->to_device(q_abs), q_pe_d = be->to_device(q_pe);
    const Tensor indices_d = be->to_device(indices);
    Tensor o_lat = be->empty(DType::kBF16, {G::kBatch, G::kHeads, 512});
    Tensor lse = be->empty(DType::kF32, {G::kBatch, G::kHeads});
    be->poison(o_lat);
    be->poison(lse);
    SparseMlaArgs args;
    args.q_abs = q_abs_d;
    args.q_pe = q_pe_d;
    args.kv = &pool;
    args.indices = indices_d;
    args.sm_scale = g.sm_scale;
    args.o_lat = o_lat;
    args.lse = lse;
    be->sparse_mla(args);
    const Vec o_got = ref::to_vec(be->to_host(o_lat)), lse_got = ref::to_vec(be->to_host(lse));

    const double out_err = testing::rel_l2(o_got, ref::to_vec(g.out));
    const double lse_err = testing::max_abs_diff(lse_got, ref::to_vec(g.lse));
    const double out_ref_err = testing::rel_l2(o_got, want.o);
    const double lse_ref_err = testing::max_abs_diff(lse_got, want.lse);
    report(name + " decode fp8 vs FlashMLA out rel-L2", out_err);
    report(name + " decode fp8 vs FlashMLA lse max abs", lse_err);
    report(name + " decode fp8 vs reference (same dequantized pool) out rel-L2", out_ref_err);
    EXPECT_LE(out_err, testing::kTolBf16);
    EXPECT_LE(lse_err, testing::kTolLse);
    EXPECT_LE(out_ref_err, testing::kTolBf16);
    EXPECT_LE(lse_ref_err, testing::kTolLse);
  }
}

}  // namespace
}  // namespace dsakit
