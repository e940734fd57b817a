// float64 reference (docs/design.md#what-the-library-computes, docs/formats.md). Number formats are
// derived from their definitions (sign, exponent and mantissa fields; neighbour search in double),
// not from formats.h's bit manipulation, so the two implementations check each other. Loops are
// plain and ordered so the innermost one walks contiguous memory.
#include "src/reference/reference.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "dsakit/error.h"

namespace dsakit::reference {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr int kMaxFiniteE4m3 = 0x7E;  // 448

// The 127 non-negative finite e4m3fn values, indexed by code 0x00 … 0x7E (ascending).
const std::array<double, kMaxFiniteE4m3 + 1>& e4m3_table() {
  static const std::array<double, kMaxFiniteE4m3 + 1> table = [] {
    std::array<double, kMaxFiniteE4m3 + 1> t{};
    for (int c = 0; c <= kMaxFiniteE4m3; ++c) t[size_t(c)] = e4m3_value(uint8_t(c));
    return t;
  }();
  return table;
}

// Little-endian fp32 at `p`.
float load_f32(const uint8_t* p) {
  uint32_t u = uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void store_f32(float f, uint8_t* p) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(u >> (8 * i));
}

// Little-endian bf16 bytes of x rounded to bf16, and back.
void store_bf16(double x, uint8_t* p) {
  const float f = float(bf16_round(x));
  uint32_t u;
  std::memcpy(&u, &f, 4);
  p[0] = uint8_t(u >> 16);
  p[1] = uint8_t(u >> 24);
}

double load_bf16(const uint8_t* p) {
  const uint32_t u = uint32_t(p[0]) << 16 | uint32_t(p[1]) << 24;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Smallest power of two >= v, for v > 0 (exact: frexp gives v = m·2^e, m in [0.5, 1)).
double pow2_at_least(double v) {
  if (!std::isfinite(v)) return v;
  int e = 0;
  const double m = std::frexp(v, &e);
  return m == 0.5 ? v : std::ldexp(1.0, e);
}

// Reference inputs come from tests: a wrong size is a caller bug, reported by argument name.
template <typename T>
void check_size(const std::vector<T>& v, int64_t expected, const char* fn, const char* name) {
  DSAKIT_CHECK_ARG(int64_t(v.size()) == expected, "reference::", fn, " ", name, ": expected ",
                   expected, " values, got ", v.size());
}

double max_abs(const double* x, int n) {
  double a = 0;
  for (int i = 0; i < n; ++i) a = std::max(a, std::fabs(x[i]));
  return a;
}

// Row i of W_UK[h] (i < d_nope) or of W_UV[h] (i < d_v) in kv_b_proj [H*(d_nope+d_v), d_c].
struct KvBProj {
  const Vec& w;
  int d_nope, d_v, d_c;
  const double* uk_row(int h, int i) const {
    return w.data() + (int64_t(h) * (d_nope + d_v) + i) * d_c;
  }
  const double* uv_row(int h, int i) const { return uk_row(h, d_nope + i); }
};

// out[h, i] = row(h, i) · x_h for every head h and i < n_rows, where x_h = x + h·x_head_stride
// has d_c values (x_head_stride 0: every head reads the same vector).
template <typename RowFn>
void per_head_matvec(const double* x, int64_t x_head_stride, int H, int n_rows, int d_c, RowFn row,
                     double* out) {
  for (int h = 0; h < H; ++h) {
    const double* x_h = x + h * x_head_stride;
    for (int i = 0; i < n_rows; ++i) {
      const double* w_row = row(h, i);
      double acc = 0;
      for (int c = 0; c < d_c; ++c) acc += w_row[c] * x_h[c];
      out[int64_t(h) * n_rows + i] = acc;
    }
  }
}

}  // namespace

RowStats attend_row(const double* q, const std::vector<const double*>& keys,
                    const std::vector<const double*>& values, int d_qk, int d_v, double sm_scale,
                    double* o) {
  std::fill(o, o + d_v, 0.0);
  if (keys.empty()) return {kInf, -kInf};
  std::vector<double> s(keys.size());
  double m = -kInf;
  bool has_nan = false;
  for (size_t j = 0; j < keys.size(); ++j) {
    double dot = 0;
    for (int d = 0; d < d_qk; ++d) dot += q[d] * keys[j][d];
    s[j] = sm_scale * dot;
    has_nan = has_nan || std::isnan(s[j]);
    m = std::max(m, s[j]);
  }
  if (has_nan || std::isinf(m)) {
    std::fill(o, o + d_v, kNaN);
    return {kNaN, has_nan ? kNaN : m};
  }
  double sum = 0;
  for (size_t j = 0; j < keys.size(); ++j) {
    const double w = std::exp(s[j] - m);
    sum += w;
    for (int d = 0; d < d_v; ++d) o[d] += w * values[j][d];
  }
  for (int d = 0; d < d_v; ++d) o[d] /= sum;
  return {m + std::log(sum), m};
}

namespace {

Attention make_attention(int64_t T, int H, int d_v) {
  Attention a;
  a.o.assign(size_t(T * H * d_v), 0.0);
  a.lse.assign(size_t(T * H), kInf);
  a.max_logit.assign(size_t(T * H), -kInf);
  return a;
}

}  // namespace

Vec to_vec(const TensorView& host) {
  DSAKIT_CHECK_ARG(host.device == Device::kCpu && host.is_contiguous(),
                   "reference::to_vec: expected a contiguous host tensor, got ",
                   to_string(host.device), " ", host.shape_str());
  const int64_t n = host.numel();
  Vec out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    switch (host.dtype) {
      case DType::kBF16:
        out[size_t(i)] = load_bf16(reinterpret_cast<const uint8_t*>(host.ptr<const bf16_t>() + i));
        break;
      case DType::kF32:
        out[size_t(i)] = host.ptr<const float>()[i];
        break;
      case DType::kF64:
        out[size_t(i)] = host.ptr<const double>()[i];
        break;
      case DType::kI32:
        out[size_t(i)] = host.ptr<const int32_t>()[i];
        break;
      case DType::kU8:
        out[size_t(i)] = host.ptr<const uint8_t>()[i];
        break;
    }
  }
  return out;
}

// ---- number formats ------------------------------------------------------------------------

double e4m3_value(uint8_t code) {
  const int sign = code >> 7;
  const int exp = (code >> 3) & 0xF;
  const int man = code & 0x7;
  if (exp == 0xF && man == 0x7) return kNaN;
  // bias 7; exponent field 0 is subnormal: 0.man · 2^-6.
  const double mag = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
  return sign ? -mag : mag;
}

uint8_t e4m3_encode(double x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return uint8_t(sign | 0x7F);
  const double a = std::fabs(x);
  const auto& table = e4m3_table();
  if (a >= table[kMaxFiniteE4m3]) return uint8_t(sign | kMaxFiniteE4m3);
  // table[hi - 1] <= a < table[hi]: choose the nearer, the even code on a tie.
  const int hi = int(std::upper_bound(table.begin(), table.end(), a) - table.begin());
  const int lo = hi - 1;
  const double below = a - table[size_t(lo)], above = table[size_t(hi)] - a;
  const int code = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
  return uint8_t(sign | code);
}

double bf16_round(double x) {
  if (!std::isfinite(x) || x == 0) return x;
  // bf16: 8 significant bits, exponent range of fp32 (min normal 2^-126, subnormal ulp 2^-133).
  int e = 0;
  std::frexp(x, &e);  // |x| = m·2^e, m in [0.5, 1): the leading bit has weight 2^(e-1)
  const double ulp = std::ldexp(1.0, std::max(e, -125) - 8);
  const double a = std::fabs(x);
  const double units = std::floor(a / ulp);  // exact: a / ulp only rescales
  const double below = units * ulp, above = (units + 1) * ulp;
  const double da = a - below, db = above - a;
  double r = da < db ? below : db < da ? above : (std::fmod(units, 2.0) == 0 ? below : above);
  if (r >= std::ldexp(1.0, 128)) r = kInf;
  return std::copysign(r, x);
}

// ---- pool rows ---------------------------------------------------------------------------

std::vector<uint8_t> encode_kv_row(const KvRowLayout& row, const double* c_kv, const double* k_pe,
                                   ScalePolicy policy, double k_scale) {
  std::vector<uint8_t> bytes(size_t(row.bytes_per_token()), 0);
  uint8_t* rope = bytes.data() + row.rope_offset();
  switch (row.layout) {
    case KvLayout::kBf16:
      for (int i = 0; i < row.d_c; ++i) store_bf16(c_kv[i], bytes.data() + 2 * i);
      for (int i = 0; i < row.d_rope; ++i) store_bf16(k_pe[i], rope + 2 * i);
      break;
    case KvLayout::kFp8Scaled:
      for (int tile = 0; tile < row.d_c / kFp8TileSize; ++tile) {
        const double* x = c_kv + tile * kFp8TileSize;
        // fp32 arithmetic, as the stored scale and the quantizing division are fp32.
        const float v = float(max_abs(x, kFp8TileSize)) / 448.0f;
        float s = 0;
        if (policy == ScalePolicy::kAmax) {
          s = std::max(v, std::numeric_limits<float>::min());
        } else {
          s = float(pow2_at_least(std::max(double(v), 1e-4)));
        }
        for (int i = 0; i < kFp8TileSize; ++i)
          bytes[size_t(tile * kFp8TileSize + i)] = e4m3_encode(float(x[i]) / s);
        store_f32(s, bytes.data() + row.scales_offset() + 4 * tile);
      }
      for (int i = 0; i < row.d_rope; ++i) store_bf16(k_pe[i], rope + 2 * i);
      break;
    case KvLayout::kFp8Raw: {
      const float s = float(k_scale);
      for (int i = 0; i < row.d_c; ++i) bytes[size_t(i)] = e4m3_encode(float(c_kv[i]) / s);
      for (int i = 0; i < row.d_rope; ++i) rope[i] = e4m3_encode(float(k_pe[i]) / s);
      break;
    }
  }
  return bytes;
}

void decode_kv_row(const KvRowLayout& row, const uint8_t* bytes, double k_scale, double* c_kv,
                   double* k_pe) {
  const uint8_t* rope = bytes + row.rope_offset();
  switch (row.layout) {
    case KvLayout::kBf16:
      for (int i = 0; i < row.d_c; ++i) c_kv[i] = load_bf16(bytes + 2 * i);
      for (int i = 0; i < row.d_rope; ++i) k_pe[i] = load_bf16(rope + 2 * i);
      break;
    case KvLayout::kFp8Scaled:
      for (int i = 0; i < row.d_c; ++i) {
        const double s = load_f32(bytes + row.scales_offset() + 4 * (i / kFp8TileSize));
        c_kv[i] = e4m3_value(bytes[i]) * s;
      }
      for (int i = 0; i < row.d_rope; ++i) k_pe[i] = load_bf16(rope + 2 * i);
      break;
    case KvLayout::kFp8Raw: {
      const double s = float(k_scale);
      for (int i = 0; i < row.d_c; ++i) c_kv[i] = e4m3_value(bytes[i]) * s;
      for (int i = 0; i < row.d_rope; ++i) k_pe[i] = e4m3_value(rope[i]) * s;
      break;
    }
  }
}

void indexer_quantize(const double* x, int d, uint8_t* codes, double* scale) {
  const float amax = std::max(float(max_abs(x, d)), 1e-4f);
  const float s = float(pow2_at_least(double(amax / 448.0f)));
  for (int i = 0; i < d; ++i) codes[i] = e4m3_encode(float(x[i]) / s);
  *scale = s;
}

// ---- indexer and top-k ---------------------------------------------------------------------

Vec indexer_logits(const Vec& q, const Vec& gate, const Vec& k, const Vec& k_scale, int64_t T,
                   int h_i, int d_i, const std::vector<int32_t>& kv_locs,
                   const std::vector<int32_t>& kv_start, const std::vector<int32_t>& ctx_len,
                   int64_t width) {
  check_size(q, T * h_i * d_i, "indexer_logits", "q");
  check_size(gate, T * h_i, "indexer_logits", "gate");
  check_size(k, int64_t(k_scale.size()) * d_i, "indexer_logits", "k");
  check_size(kv_start, T, "indexer_logits", "kv_start");
  check_size(ctx_len, T, "indexer_logits", "ctx_len");
  for (int64_t t = 0; t < T; ++t) {
    const int64_t start = kv_start[size_t(t)], len = ctx_len[size_t(t)];
    DSAKIT_CHECK_ARG(
        len >= 0 && len <= width && start >= 0 && start + len <= int64_t(kv_locs.size()),
        "reference::indexer_logits ctx_len[", t, "] = ", len, ", kv_start[", t, "] = ", start,
        ": outside width ", width, " or kv_locs (", kv_locs.size(), ")");
    for (int64_t p = 0; p < len; ++p) {
      const int64_t loc = kv_locs[size_t(start + p)];
      DSAKIT_CHECK_ARG(loc >= 0 && loc < int64_t(k_scale.size()),
                       "reference::indexer_logits kv_locs[", start + p, "] = ", loc,
                       ": expected a location in [0, ", k_scale.size(), ")");
    }
  }
  Vec logits(size_t(T * width), -kInf);
  for (int64_t t = 0; t < T; ++t) {
    const double* q_t = q.data() + t * h_i * d_i;
    for (int64_t p = 0; p < ctx_len[size_t(t)]; ++p) {
      const int64_t loc = kv_locs[size_t(kv_start[size_t(t)] + p)];
      const double* k_p = k.data() + loc * d_i;
      double score = 0;
      for (int h = 0; h < h_i; ++h) {
        double dot = 0;
        for (int d = 0; d < d_i; ++d) dot += q_t[h * d_i + d] * k_p[d];
        score += gate[size_t(t * h_i + h)] * std::max(dot, 0.0);
      }
      logits[size_t(t * width + p)] = k_scale[size_t(loc)] * score;
    }
  }
  return logits;
}

std::vector<int32_t> topk(const Vec& logits, int64_t rows, int64_t width,
                          const std::vector<int32_t>& ctx_len, int k) {
  check_size(logits, rows * width, "topk", "logits");
  check_size(ctx_len, rows, "topk", "ctx_len");
  DSAKIT_CHECK_ARG(k >= 1, "reference::topk k: expected >= 1, got ", k);
  for (int64_t r = 0; r < rows; ++r)
    DSAKIT_CHECK_ARG(ctx_len[size_t(r)] >= 0 && ctx_len[size_t(r)] <= width,
                     "reference::topk ctx_len[", r, "] = ", ctx_len[size_t(r)], ": expected 0 … ",
                     width);
  std::vector<int32_t> out(size_t(rows * k), -1);
  std::vector<int32_t> pos;
  for (int64_t r = 0; r < rows; ++r) {
    const double* row = logits.data() + r * width;
    pos.resize(size_t(ctx_len[size_t(r)]));
    std::iota(pos.begin(), pos.end(), 0);
    // Strict ranking: larger score first, NaN after every number, ties by lower position.
    auto ranks_before = [row](int32_t a, int32_t b) {
      const bool na = std::isnan(row[a]), nb = std::isnan(row[b]);
      if (na != nb) return nb;
      if (!na && row[a] != row[b]) return row[a] > row[b];
      return a < b;
    };
    const size_t n = std::min(pos.size(), size_t(k));
    std::partial_sort(pos.begin(), pos.begin() + ptrdiff_t(n), pos.end(), ranks_before);
    std::sort(pos.begin(), pos.begin() + ptrdiff_t(n));
    std::copy_n(pos.begin(), n, out.begin() + r * k);
  }
  return out;
}

// ---- projections ---------------------------------------------------------------------------
Vec absorb_q(const Vec& q_nope, const Vec& w, int64_t T, int H, int d_nope, int d_v, int d_c) {
  check_size(q_nope, T * H * d_nope, "absorb_q", "q_nope");
  check_size(w, int64_t(H) * (d_nope + d_v) * d_c, "absorb_q", "kv_b_proj");
  const KvBProj proj{w, d_nope, d_v, d_c};
  Vec q_abs(size_t(T * H * d_c), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      // q_abs[t,h] = Σ_i q_nope[t,h,i] · W_UK[h][i, :], accumulated row by row.
      double* out = q_abs.data() + (t * H + h) * d_c;
      const double* qn = q_nope.data() + (t * H + h) * d_nope;
      for (int i = 0; i < d_nope; ++i) {
        const double* w_row = proj.uk_row(h, i);
        for (int c = 0; c < d_c; ++c) out[c] += qn[i] * w_row[c];
      }
    }
  return q_abs;
}

Vec up_proj_v(const Vec& o_lat, const Vec& w, int64_t T, int H, int d_nope, int d_v, int d_c) {
  check_size(o_lat, T * H * d_c, "up_proj_v", "o_lat");
  check_size(w, int64_t(H) * (d_nope + d_v) * d_c, "up_proj_v", "kv_b_proj");
  const KvBProj proj{w, d_nope, d_v, d_c};
  const auto uv = [&](int h, int i) { return proj.uv_row(h, i); };
  Vec o(size_t(T * H * d_v));
  for (int64_t t = 0; t < T; ++t)
    per_head_matvec(o_lat.data() + t * H * d_c, d_c, H, d_v, d_c, uv, o.data() + t * H * d_v);
  return o;
}

void up_proj_kv(const Vec& c_kv, const Vec& w, int64_t N, int H, int d_nope, int d_v, int d_c,
                Vec& k_nope, Vec& v) {
  check_size(c_kv, N * d_c, "up_proj_kv", "c_kv");
  check_size(w, int64_t(H) * (d_nope + d_v) * d_c, "up_proj_kv", "kv_b_proj");
  const KvBProj proj{w, d_nope, d_v, d_c};
  const auto uk = [&](int h, int i) { return proj.uk_row(h, i); };
  const auto uv = [&](int h, int i) { return proj.uv_row(h, i); };
  k_nope.assign(size_t(N * H * d_nope), 0.0);
  v.assign(size_t(N * H * d_v), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const double* c = c_kv.data() + n * d_c;  // shared by all heads
    per_head_matvec(c, 0, H, d_nope, d_c, uk, k_nope.data() + n * H * d_nope);
    per_head_matvec(c, 0, H, d_v, d_c, uv, v.data() + n * H * d_v);
  }
}

// ---- attention -----------------------------------------------------------------------------

Attention sparse_attention(const Vec& q, const Vec& kv, int64_t T, int H, int d_qk, int d_v,
                           int64_t N, const std::vector<int32_t>& indices, int k,
                           const std::vector<int32_t>* topk_length, double sm_scale) {
  check_size(q, T * H * d_qk, "sparse_attention", "q");
  check_size(kv, N * d_qk, "sparse_attention", "kv");
  check_size(indices, T * k, "sparse_attention", "indices");
  if (topk_length) check_size(*topk_length, T, "sparse_attention", "topk_length");
  DSAKIT_CHECK_ARG(d_v <= d_qk, "reference::sparse_attention d_v: expected <= d_qk (", d_qk,
                   "), got ", d_v);
  Attention a = make_attention(T, H, d_v);
  std::vector<const double*> rows;
  for (int64_t t = 0; t < T; ++t) {
    const int slots = topk_length ? std::clamp((*topk_length)[size_t(t)], 0, k) : k;
    rows.clear();
    for (int j = 0; j < slots; ++j) {
      const int64_t idx = indices[size_t(t * k + j)];
      if (idx >= 0 && idx < N) rows.push_back(kv.data() + idx * d_qk);  // one entry per slot
    }
    for (int h = 0; h < H; ++h) {
      const int64_t th = t * H + h;
      const RowStats st =
          attend_row(q.data() + th * d_qk, rows, rows, d_qk, d_v, sm_scale, a.o.data() + th * d_v);
      a.lse[size_t(th)] = st.lse;
      a.max_logit[size_t(th)] = st.max_logit;
    }
  }
  return a;
}

Attention dense_attention(const Vec& q, const Vec& k, const Vec& v, int H, int d_qk, int d_v,
                          const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_kv,
                          double sm_scale, const std::vector<uint32_t>* kv_mask,
                          int64_t mask_words) {
  DSAKIT_CHECK_ARG(cu_q.size() >= 2 && cu_q.size() == cu_kv.size() && cu_q[0] == 0 && cu_kv[0] == 0,
                   "reference::dense_attention cu_q / cu_kv: expected equal sizes >= 2 starting "
                   "at 0, got ",
                   cu_q.size(), " and ", cu_kv.size(), " entries");
  const int64_t T = cu_q.back(), N = cu_kv.back();
  for (size_t r = 0; r + 1 < cu_q.size(); ++r)
    DSAKIT_CHECK_ARG(cu_q[r + 1] >= cu_q[r] && cu_kv[r + 1] - cu_kv[r] >= cu_q[r + 1] - cu_q[r],
                     "reference::dense_attention request ", r, ": expected 0 <= extend (",
                     cu_q[r + 1] - cu_q[r], ") <= kv length (", cu_kv[r + 1] - cu_kv[r], ")");
  check_size(q, T * H * d_qk, "dense_attention", "q");
  check_size(k, N * H * d_qk, "dense_attention", "k");
  check_size(v, N * H * d_v, "dense_attention", "v");
  if (kv_mask) {
    DSAKIT_CHECK_ARG(mask_words > 0 && int64_t(kv_mask->size()) == T * mask_words,
                     "reference::dense_attention kv_mask: expected ", T, " x ", mask_words,
                     " words, got ", kv_mask->size());
    for (size_t r = 0; r + 1 < cu_kv.size(); ++r)
      DSAKIT_CHECK_ARG(cu_kv[r + 1] - cu_kv[r] <= mask_words * 32,
                       "reference::dense_attention kv_mask: ", mask_words,
                       " words a row cover fewer positions than request ", r, "'s ",
                       cu_kv[r + 1] - cu_kv[r]);
  }
  const auto kept = [&](int64_t t, int64_t p) {
    return kv_mask == nullptr || ((*kv_mask)[size_t(t * mask_words + p / 32)] >> (p % 32)) & 1u;
  };
  Attention a = make_attention(T, H, d_v);
  std::vector<const double*> keys, values;
  for (size_t r = 0; r + 1 < cu_q.size(); ++r) {
    const int64_t extend = cu_q[r + 1] - cu_q[r];
    const int64_t prefix = (cu_kv[r + 1] - cu_kv[r]) - extend;
    for (int64_t i = 0; i < extend; ++i) {
      const int64_t t = cu_q[r] + i;
      const int64_t visible = prefix + i + 1;  // kv rows cu_kv[r] … cu_kv[r] + prefix + i
      for (int h = 0; h < H; ++h) {
        keys.clear();
        values.clear();
        for (int64_t p = 0; p < visible; ++p) {
          if (!kept(t, p)) continue;
          const int64_t row = cu_kv[r] + p;
          keys.push_back(k.data() + (row * H + h) * d_qk);
          values.push_back(v.data() + (row * H + h) * d_v);
        }
        const int64_t th = t * H + h;
        const RowStats st = attend_row(q.data() + th * d_qk, keys, values, d_qk, d_v, sm_scale,
                                       a.o.data() + th * d_v);
        a.lse[size_t(th)] = st.lse;
        a.max_logit[size_t(th)] = st.max_logit;
      }
    }
  }
  return a;
}

}  // namespace dsakit::reference
