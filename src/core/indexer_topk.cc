// The indexer driver every backend shares: validation up front, then quantize -> logits -> top-k
// one block of query rows at a time through the backend's ops. Backends provide only those
// three ops; the blocking, the identity shortcut and the workspace bound live here once.
#include <algorithm>
#include <cstdlib>

#include "dsakit/backend.h"
#include "dsakit/error.h"
#include "src/core/validate.h"

namespace dsakit {

int64_t indexer_block_bytes() {
  constexpr const char* kEnv = "DSAKIT_INDEXER_WORKSPACE_BYTES";
  const char* s = std::getenv(kEnv);
  if (s == nullptr || *s == 0) return kIndexerBlockBytes;
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  DSAKIT_CHECK_ARG(*end == 0 && v > 0, kEnv, ": expected a positive byte count, got '", s, "'");
  return int64_t(v);
}

IndexerBlocks IndexerBlocks::plan(int64_t tokens, int64_t h_i, int64_t d_i, int64_t num_kv, int k,
                                  int64_t block_bytes) {
  IndexerBlocks b;
  if (tokens <= 0 || num_kv <= k) return b;
  b.width = num_kv;
  const int64_t row_bytes = h_i * d_i + 4 * h_i + 4 * b.width;  // q8 + gate + logits row
  b.rows = std::clamp<int64_t>(block_bytes / row_bytes, 1, tokens);
  b.bytes = b.rows * row_bytes;
  return b;
}

namespace {

// The block loop both entry points share, after their validation: identity rows by top-k alone
// when the whole kv range fits in k, else per IndexerBlocks block of rows its logits and top-k.
// `quantize(r0, r1, block)` leaves rows [r0, r1)'s q8 and gate in block.q8 / block.gate.
template <typename Quantize>
void indexer_topk_blocks(Backend& be, const IndexerArgs& layout, const IndexerBlocks& blocks,
                         int64_t tokens, int k, const TensorView& out, const Quantize& quantize) {
  if (tokens == 0) return;

  // Every index below was validated by the caller: the block ops skip their own value checks.
  const IndexValueChecksOff checks_off(be);

  // ctx_len <= N_kv for every row, so when the whole kv range fits in k every row is the
  // identity: top-k alone, no query quantization and no logits.
  if (blocks.rows == 0) {
    be.topk(make_view(nullptr, DType::kF32, be.device(), {tokens, 0}), layout.ctx_len, k, out);
    return;
  }

  const Tensor logits = be.empty(DType::kF32, {blocks.rows, blocks.width});
  IndexerLogitsOptions options;
  options.skip_ctx_at_most = k;  // identity rows: top-k writes 0 … ctx-1 without logits
  options.fill_masked = false;   // top-k reads only [0, ctx_len)
  for (int64_t r0 = 0; r0 < tokens; r0 += blocks.rows) {
    const int64_t r1 = std::min(tokens, r0 + blocks.rows), rows = r1 - r0;
    // The block is a batch of its own: its row i is token r0 + i.
    IndexerArgs block = layout;
    block.kv_start = slice_rows(layout.kv_start, r0, r1);
    block.ctx_len = slice_rows(layout.ctx_len, r0, r1);
    const TensorView block_logits = slice_rows(logits, 0, rows);
    quantize(r0, r1, block);
    be.indexer_logits(block, 0, rows, block_logits, options);
    be.topk(block_logits, block.ctx_len, k, slice_rows(out, r0, r1));
  }
}

}  // namespace

void Backend::indexer_topk(const TensorView& idx_q, const TensorView& idx_w,
                           const IndexerArgs& layout, int k, const TensorView& out) {
  const HostIndexValues kv_locs = host_index_values(layout.kv_locs),
                        kv_start = host_index_values(layout.kv_start),
                        ctx_len = host_index_values(layout.ctx_len);
  validate::indexer_topk(idx_q, idx_w, layout, k, out, device(), kv_locs.data, kv_start.data,
                         ctx_len.data);
  const int64_t tokens = idx_q.shape[0], h_i = idx_q.shape[1], d_i = idx_q.shape[2];
  const IndexerBlocks blocks =
      IndexerBlocks::plan(tokens, h_i, d_i, layout.kv_locs.numel(), k, indexer_block_bytes());
  Tensor q8, gate;  // one block's quantized queries
  if (blocks.rows > 0) {
    q8 = empty(DType::kU8, {blocks.rows, h_i, d_i});
    gate = empty(DType::kF32, {blocks.rows, h_i});
  }
  indexer_topk_blocks(*this, layout, blocks, tokens, k, out,
                      [&](int64_t r0, int64_t r1, IndexerArgs& block) {
                        block.q8 = slice_rows(q8, 0, r1 - r0);
                        block.gate = slice_rows(gate, 0, r1 - r0);
                        indexer_quantize_q(slice_rows(idx_q, r0, r1), slice_rows(idx_w, r0, r1),
                                           block.q8, block.gate);
                      });
}

void Backend::indexer_topk(const IndexerArgs& args, int k, const TensorView& out) {
  const HostIndexValues kv_locs = host_index_values(args.kv_locs),
                        kv_start = host_index_values(args.kv_start),
                        ctx_len = host_index_values(args.ctx_len);
  validate::indexer_topk(args, k, out, device(), kv_locs.data, kv_start.data, ctx_len.data);
  const int64_t tokens = args.q8.shape[0];
  // The plan's bytes count a block's q8 and gate, which are the caller's here: an upper bound.
  const IndexerBlocks blocks = IndexerBlocks::plan(tokens, args.q8.shape[1], args.q8.shape[2],
                                                   args.kv_locs.numel(), k, indexer_block_bytes());
  indexer_topk_blocks(*this, args, blocks, tokens, k, out,
                      [&](int64_t r0, int64_t r1, IndexerArgs& block) {
                        block.q8 = slice_rows(args.q8, r0, r1);
                        block.gate = slice_rows(args.gate, r0, r1);
                      });
}

}  // namespace dsakit
