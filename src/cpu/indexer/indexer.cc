// CPU lightning indexer (docs/design.md, "Lightning indexer"): FP8 quantization of idx_q and the
// logits over the index-key pool. The whole indexer (blocks, identity shortcut) is the shared
// driver Backend::indexer_topk (src/core/indexer_topk.cc).
//
// Logits are computed per work item = (row tile, key tile). A row tile is up to
// kGemmRows / H_i consecutive tokens with the same kv_start (tokens of one request), so they read
// the same key sequence; its key tiles cover [0, max ctx_len of the tile) in kKeyTile steps.
// One item, on one thread, with BLAS single-threaded:
//   Qf [rows·H_i, d_i]   e4m3 values of q8 (unscaled; s_q is folded into the gate)
//   Kf [n, d_i]          e4m3 values of the tile's keys (unscaled), s_k [n] their scales
//   S  = Qf · Kfᵀ        [rows·H_i, n], fp32 (CBLAS sgemm)
//   logits[t, p] = s_k[p] · Σ_h gate[t,h] · ReLU(S[t·H_i + h, p])   for p < ctx_len[t]
// ReLU keeps NaN, so a NaN query, weight or key yields NaN logits for the tokens it touches.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "dsakit/error.h"
#include "src/cpu/gemm/blas.h"
#include "src/cpu/kernels.h"

namespace dsakit::cpu {
namespace {

constexpr int64_t kGemmRows = 512;  // target rows·H_i of one GEMM
constexpr int64_t kKeyTile = 256;   // keys per GEMM
// Addressing of the index-key pool (include/dsakit/pool.h): location loc is slot
// loc % page_size of page loc / page_size; a page holds page_size·d_i e4m3 codes, then
// page_size fp32 scales.
struct IndexKeyReader {
  const uint8_t* base;
  int64_t page_bytes;
  int64_t page_size;
  int64_t d_i;

  explicit IndexKeyReader(const IndexKeyPool& pool)
      : base(pool.storage().ptr<const uint8_t>()),
        page_bytes(pool.desc().page_bytes()),
        page_size(pool.desc().page_size),
        d_i(pool.desc().d_i) {}

  const uint8_t* codes(int32_t loc) const {
    return base + (loc / page_size) * page_bytes + (loc % page_size) * d_i;
  }
  float scale(int32_t loc) const {
    float s;
    std::memcpy(&s, base + (loc / page_size) * page_bytes + page_size * d_i + (loc % page_size) * 4,
                sizeof s);
    return s;
  }
};

// The gate's constant factor H_i^-0.5 · d_i^-0.5, rounded to fp32 once. The gate is then
// fp32(idx_w · norm) · s_q, exact in the last step since s_q is a power of two.
float gate_norm(int64_t h_i, int64_t d_i) {
  return float(1.0 / std::sqrt(double(h_i * d_i)));
}

// One token: x bf16 [H_i, d_i], w f32 [H_i] -> codes u8 [H_i, d_i], gate f32 [H_i].
// Per head, s = indexer_fp8_scale(amax of |x|, NaN ignored), codes = e4m3(x / s).
void quantize_token(const bf16_t* x, const float* w, int64_t h_i, int64_t d_i, float norm,
                    uint8_t* codes, float* gate) {
  for (int64_t h = 0; h < h_i; ++h) {
    const bf16_t* xh = x + h * d_i;
    float amax = 0.f;
    for (int64_t c = 0; c < d_i; ++c) {
      const float a = std::fabs(bf16_to_f32(xh[c]));
      amax = a > amax ? a : amax;
    }
    const float s = indexer_fp8_scale(amax);
    for (int64_t c = 0; c < d_i; ++c) codes[h * d_i + c] = quantize_e4m3(bf16_to_f32(xh[c]), s);
    gate[h] = (w[h] * norm) * s;
  }
}

// Consecutive rows [begin, end) sharing kv_start; its items are first_item … first_item +
// ceil(max_ctx / kKeyTile) - 1.
struct RowTile {
  int64_t begin, end;
  int64_t max_ctx;
  int64_t first_item;
};

// Per-thread buffers of one work item.
struct ItemWorkspace {
  std::vector<float> q;        // [rows·H_i, d_i]
  std::vector<float> k;        // [kKeyTile, d_i]
  std::vector<float> k_scale;  // [kKeyTile]
  std::vector<float> scores;   // [rows·H_i, kKeyTile]
  std::vector<float> acc;      // [kKeyTile]
  int64_t q_tile = -1;         // row tile whose queries `q` holds
};

struct LogitsProblem {
  const uint8_t* q8;  // [T, H_i, d_i]
  const float* gate;  // [T, H_i]
  const int32_t* kv_locs;
  const int32_t* kv_start;
  const int32_t* ctx_len;
  IndexKeyReader keys;
  int64_t h_i, d_i;
  float* logits;  // [row_end - row_begin, width], row t at (t - row_begin)
  int64_t width;
  int64_t row_begin;
};

void score_item(const LogitsProblem& pb, const RowTile& tile, int64_t tile_index, int64_t key_begin,
                ItemWorkspace& ws) {
  const auto& e4m3 = e4m3_values();
  const int64_t h_i = pb.h_i, d_i = pb.d_i;
  const int64_t rows = tile.end - tile.begin, m = rows * h_i;
  const int64_t n = std::min(kKeyTile, tile.max_ctx - key_begin);
  if (ws.q_tile != tile_index) {
    const uint8_t* q8 = pb.q8 + tile.begin * h_i * d_i;
    for (int64_t i = 0; i < m * d_i; ++i) ws.q[size_t(i)] = e4m3[q8[i]];
    ws.q_tile = tile_index;
  }
  const int32_t* locs = pb.kv_locs + pb.kv_start[tile.begin] + key_begin;
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* codes = pb.keys.codes(locs[j]);
    float* kj = ws.k.data() + j * d_i;
    for (int64_t c = 0; c < d_i; ++c) kj[c] = e4m3[codes[c]];
    ws.k_scale[size_t(j)] = pb.keys.scale(locs[j]);
  }
  sgemm(/*trans_b=*/true, m, n, d_i, 1.0f, ws.q.data(), d_i, ws.k.data(), d_i, 0.0f,
        ws.scores.data(), kKeyTile);
  float* acc = ws.acc.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = tile.begin + r;
    const int64_t valid = std::min<int64_t>(n, pb.ctx_len[t] - key_begin);
    if (valid <= 0) continue;
    std::fill_n(acc, valid, 0.f);
    for (int64_t h = 0; h < h_i; ++h) {
      const float g = pb.gate[t * h_i + h];
      const float* s = ws.scores.data() + (r * h_i + h) * kKeyTile;
      for (int64_t j = 0; j < valid; ++j) acc[j] += g * (s[j] < 0.f ? 0.f : s[j]);
    }
    float* out = pb.logits + (t - pb.row_begin) * pb.width + key_begin;
    for (int64_t j = 0; j < valid; ++j) out[j] = acc[j] * ws.k_scale[size_t(j)];
  }
}

}  // namespace

void indexer_quantize_q(const CpuContext& ctx, const TensorView& idx_q, const TensorView& idx_w,
                        const TensorView& q8, const TensorView& gate) {
  const int64_t t_total = idx_q.shape[0], h_i = idx_q.shape[1], d_i = idx_q.shape[2];
  const float norm = gate_norm(h_i, d_i);
  const bf16_t* x = idx_q.ptr<const bf16_t>();
  const float* w = idx_w.ptr<const float>();
#pragma omp parallel for num_threads(ctx.threads) schedule(static)
  for (int64_t t = 0; t < t_total; ++t)
    quantize_token(x + t * h_i * d_i, w + t * h_i, h_i, d_i, norm,
                   q8.ptr<uint8_t>() + t * h_i * d_i, gate.ptr<float>() + t * h_i);
}

void indexer_logits(const CpuContext& ctx, const IndexerArgs& args, int64_t row_begin,
                    int64_t row_end, const TensorView& logits,
                    const IndexerLogitsOptions& options) {
  const LogitsProblem pb{args.q8.ptr<const uint8_t>(),
                         args.gate.ptr<const float>(),
                         args.kv_locs.ptr<const int32_t>(),
                         args.kv_start.ptr<const int32_t>(),
                         args.ctx_len.ptr<const int32_t>(),
                         IndexKeyReader(*args.keys),
                         args.q8.shape[1],
                         args.q8.shape[2],
                         logits.ptr<float>(),
                         logits.shape[1],
                         row_begin};
  const int64_t rows_per_tile = std::max<int64_t>(1, kGemmRows / pb.h_i);

  std::vector<RowTile> tiles;
  std::vector<int64_t> item_tile;  // work item -> its row tile
  // Rows the caller's top-k makes the identity are skipped and end a tile (tiles are runs).
  bool tile_open = false;
  for (int64_t t = row_begin; t < row_end; ++t) {
    if (pb.ctx_len[t] <= options.skip_ctx_at_most) {
      tile_open = false;
      continue;
    }
    if (!tile_open || tiles.back().end - tiles.back().begin == rows_per_tile ||
        pb.kv_start[t] != pb.kv_start[tiles.back().begin])
      tiles.push_back({t, t, 0, 0});
    tile_open = true;
    tiles.back().end = t + 1;
    tiles.back().max_ctx = std::max<int64_t>(tiles.back().max_ctx, pb.ctx_len[t]);
  }
  for (size_t i = 0; i < tiles.size(); ++i) {
    tiles[i].first_item = int64_t(item_tile.size());
    item_tile.insert(item_tile.end(), size_t((tiles[i].max_ctx + kKeyTile - 1) / kKeyTile),
                     int64_t(i));
  }
  const int64_t num_items = int64_t(item_tile.size());

  const ScopedBlasThreads single_thread_blas(1);  // items call sgemm on OpenMP threads
#pragma omp parallel num_threads(ctx.threads)
  {
    // -inf beyond each row's context; the items write the positions before it.
    if (options.fill_masked) {
#pragma omp for schedule(static)
      for (int64_t t = row_begin; t < row_end; ++t) {
        if (pb.ctx_len[t] <= options.skip_ctx_at_most) continue;
        float* row = pb.logits + (t - row_begin) * pb.width;
        std::fill(row + pb.ctx_len[t], row + pb.width, -std::numeric_limits<float>::infinity());
      }
    }
    ItemWorkspace ws;
    ws.q.resize(size_t(rows_per_tile * pb.h_i * pb.d_i));
    ws.k.resize(size_t(kKeyTile * pb.d_i));
    ws.k_scale.resize(size_t(kKeyTile));
    ws.scores.resize(size_t(rows_per_tile * pb.h_i * kKeyTile));
    ws.acc.resize(size_t(kKeyTile));
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t ti = item_tile[size_t(item)];
      const RowTile& tile = tiles[size_t(ti)];
      score_item(pb, tile, ti, (item - tile.first_item) * kKeyTile, ws);
    }
  }
}

}  // namespace dsakit::cpu
