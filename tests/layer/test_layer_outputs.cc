// The layer's caller-given outputs (LayerOutputs) and prepared batches (DsaAttention::prepare),
// the C++ side of the Python binding's `forward(..., o=, lse=, topk=)` and CUDA-graph capture
// (docs/python.md): the same bits as a plain forward, written where the caller said, checked
// before anything is written, and a prepared batch usable only by the layer that made it.
#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "dsakit/driver.h"
#include "dsakit/error.h"
#include "tests/common/test_util.h"
#include "tools/harness.h"

namespace dsakit {
namespace {

using testing::fresh_seed;

// One layer over fresh pools of `layout` (page size 16), inputs for `lengths` from `seed`.
struct Fixture {
  ModelConfig cfg;
  std::unique_ptr<Backend> be;
  PagedKvPool kv;
  IndexKeyPool ix;
  Tensor w;
  TokenStore tokens;
  std::vector<std::vector<int32_t>> tables;
  std::unique_ptr<DsaAttention> layer;

  Fixture(const std::string& backend, KvLayout layout, DispatchMode mode,
          const std::vector<int32_t>& lengths, uint64_t seed)
      : cfg(ModelConfig::preset("deepseek-v3.2").with_tp(8)), be(make_backend(backend)) {
    cfg.index_topk = 64;  // both paths and mixed plans at small lengths
    KvPoolDesc kd;
    kd.layout = layout;
    kd.page_size = 16;
    int64_t pages = 2;
    for (int32_t l : lengths) pages += (l + 15) / 16;
    kd.num_pages = pages;
    kv = be->make_kv_pool(kd);
    ix = be->make_index_pool({16, pages, cfg.index_head_dim});
    w = be->to_device(random_kv_b_proj(cfg, seed + 1));
    tokens = random_token_store(cfg, lengths, seed);
    tables = allocate_pages(lengths, 16, pages, seed + 2);
    LayerOptions o;
    o.policy.mode = mode;
    layer = std::make_unique<DsaAttention>(cfg, *be, kv, ix, w, o);
  }

  // Positions [begin_r, end_r) of every request as one extend.
  Batch batch(const std::vector<int32_t>& begin, const std::vector<int32_t>& end) const {
    Batch b;
    for (size_t r = 0; r < begin.size(); ++r) {
      b.prefix_lens.push_back(begin[r]);
      b.extend_lens.push_back(end[r] - begin[r]);
      b.page_tables.push_back(tables[r]);
    }
    return b;
  }
  TokenStore::DeviceInputs inputs(const std::vector<int32_t>& begin,
                                  const std::vector<int32_t>& end) const {
    std::vector<int64_t> rows;
    for (size_t r = 0; r < begin.size(); ++r)
      for (int32_t p = begin[r]; p < end[r]; ++p) rows.push_back(tokens.offset(int(r)) + p);
    return tokens.slice(*be, rows);
  }
  std::vector<uint8_t> bytes(const TensorView& t) const {
    const Tensor h = be->to_host(t);
    const auto* p = h.ptr<uint8_t>();
    return std::vector<uint8_t>(p, p + h.nbytes());
  }
  std::vector<uint8_t> pools() const {
    std::vector<uint8_t> a = bytes(kv.storage()), b = bytes(ix.storage());
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }
};

class LayerOutputsTest : public ::testing::TestWithParam<std::string> {};

// A forward into given outputs (and over a prepared batch) gives the plain forward's bits, for
// every path: the two runs start from equal pools (a cached prefix stored the same way).
TEST_P(LayerOutputsTest, GivenOutputsAndPreparedBatchesGiveThePlainForwardsBits) {
  for (DispatchMode mode : {DispatchMode::kDense, DispatchMode::kSparse, DispatchMode::kRule}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " mode " << to_string(mode));
    // Forced dense needs every context within index_topk (64); the others go past it.
    const std::vector<int32_t> lengths = mode == DispatchMode::kDense
                                             ? std::vector<int32_t>{60, 40}
                                             : std::vector<int32_t>{90, 40},
                               begin = {30, 0};
    Fixture a(GetParam(), KvLayout::kFp8Scaled, mode, lengths, seed);
    Fixture b(GetParam(), KvLayout::kFp8Scaled, mode, lengths, seed);
    for (Fixture* s : {&a, &b})
      s->layer->forward(s->batch({0, 0}, begin), s->inputs({0, 0}, begin).view());

    const Batch batch = a.batch(begin, lengths);
    const auto in = a.inputs(begin, lengths);
    const LayerResult plain = a.layer->forward(batch, in.view());

    const int64_t t = batch.num_new_tokens(), h = a.cfg.num_heads;
    Tensor o = b.be->empty(DType::kBF16, {t, h, a.cfg.v_head_dim});
    Tensor lse = b.be->empty(DType::kF32, {t, h});
    Tensor topk = b.be->empty(DType::kI32, {t, a.cfg.index_topk});
    for (const Tensor* x : {&o, &lse, &topk}) b.be->poison(*x);
    const PreparedBatch prepared = b.layer->prepare(batch);
    EXPECT_EQ(prepared.plan().path, plain.plan.path);
    const LayerResult given = b.layer->forward(prepared, in.view(), {o, lse, topk});

    EXPECT_EQ(given.o.view().data, o.view().data);
    EXPECT_EQ(given.lse.view().data, lse.view().data);
    EXPECT_EQ(a.bytes(plain.o), b.bytes(o));
    EXPECT_EQ(a.bytes(plain.lse), b.bytes(lse));
    ASSERT_EQ(plain.topk.defined(), given.topk.defined());
    if (plain.topk.defined()) {
      EXPECT_EQ(given.topk.view().data, topk.view().data);
      EXPECT_EQ(a.bytes(plain.topk), b.bytes(topk));
    }
    EXPECT_EQ(a.pools(), b.pools());

    // A batch prepared once runs again (new inputs at the same positions: the pools are
    // rewritten with the same values, so the outputs repeat bit for bit).
    const LayerResult again = b.layer->forward(prepared, in.view());
    EXPECT_EQ(a.bytes(plain.o), b.bytes(again.o));
  }
}

// Wrong outputs are refused before anything is written; so is a batch prepared elsewhere.
TEST_P(LayerOutputsTest, BadOutputsAndForeignPreparedBatchesAreRefusedUntouched) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const std::vector<int32_t> lengths = {30, 20}, zero = {0, 0};
  Fixture s(GetParam(), KvLayout::kBf16, DispatchMode::kRule, lengths, seed);
  Fixture other(GetParam(), KvLayout::kBf16, DispatchMode::kRule, lengths, seed);
  const Batch batch = s.batch(zero, lengths);
  const auto in = s.inputs(zero, lengths);
  const auto before = s.pools();
  const int64_t t = 50, h = s.cfg.num_heads;
  const auto expect_refused = [&](const std::function<void()>& call, const char* needle) {
    try {
      call();
      ADD_FAILURE() << needle << ": expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.pools(), before) << needle;
  };
  Tensor o_f32 = s.be->empty(DType::kF32, {t, h, s.cfg.v_head_dim});
  expect_refused([&] { s.layer->forward(batch, in.view(), {o_f32, {}, {}}); }, "o: expected dtype");
  Tensor lse_short = s.be->empty(DType::kF32, {t - 1, h});
  expect_refused(
      [&] {
        s.layer->forward(batch, in.view(), {{}, lse_short, {}});
      },
      "lse: expected shape");
  Tensor topk_wide = s.be->empty(DType::kI32, {t, s.cfg.index_topk + 1});
  expect_refused(
      [&] {
        s.layer->forward(batch, in.view(), {{}, {}, topk_wide});
      },
      "topk: expected shape");
  TensorView strided = s.be->empty(DType::kF32, {t, h * 2}).view();
  strided.shape[1] = h;  // every other column: not contiguous
  expect_refused(
      [&] {
        s.layer->forward(batch, in.view(), {{}, strided, {}});
      },
      "lse: expected a contiguous");
  const PreparedBatch foreign = other.layer->prepare(batch);
  expect_refused([&] { s.layer->forward(foreign, in.view()); }, "prepared by another layer");
  expect_refused([&] { s.layer->forward(PreparedBatch{}, in.view()); }, "prepared batch is empty");
  EXPECT_THROW(PreparedBatch{}.plan(), Error);
  // Inputs for another T than the prepared batch's.
  const PreparedBatch mine = s.layer->prepare(batch);
  const auto fewer = s.inputs(zero, {30, 19});
  expect_refused([&] { s.layer->forward(mine, fewer.view()); }, "expected shape");
  // A bad batch is refused by prepare() itself, before anything is uploaded or written.
  Batch bad = batch;
  bad.page_tables[0][0] = 1000;
  expect_refused([&] { s.layer->prepare(bad); }, "page_table");
}

INSTANTIATE_TEST_SUITE_P(Backends, LayerOutputsTest, ::testing::ValuesIn(testing::test_backends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace dsakit
