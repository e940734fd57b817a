#include "tools/run_file.h"

#include <fmt/format.h>

#include <algorithm>

#include "dsakit/error.h"
#include "tools/cli_common.h"

namespace dsakit::cli {

namespace {

std::vector<int32_t> metadata_list(const SafetensorsFile& f, const char* key) {
  auto it = f.metadata().find(key);
  DSAKIT_CHECK(it != f.metadata().end(), kFormat, f.origin(), ": metadata key '", key,
               "' is missing (write the file with dsakit run --save)");
  if (it->second.empty()) return {};
  return parse_int_list(it->second, key, 0);
}

}  // namespace

RunLengths read_run_lengths(const SafetensorsFile& f, const std::string& path) {
  RunLengths len;
  len.prompt = metadata_list(f, "prompts");
  len.prefix = metadata_list(f, "prefix");
  const auto steps = metadata_list(f, "decode_steps");
  DSAKIT_CHECK(steps.size() == 1, kFormat, path, ": metadata decode_steps must be one integer");
  len.decode_steps = steps[0];
  return len;
}

TokenStore read_run_inputs(const SafetensorsFile& f, const ModelConfig& c, const RunLengths& len,
                           Tensor& kv_b_proj, Fp8KvBProj& kv_b_proj_fp8) {
  TokenStore s;
  s.lengths = len.total();
  const int64_t n = s.rows();
  s.q_nope = f.get("q_nope", DType::kBF16, {n, c.num_heads, c.qk_nope_head_dim});
  s.q_pe = f.get("q_pe", DType::kBF16, {n, c.num_heads, c.qk_rope_head_dim});
  s.c_kv = f.get("c_kv", DType::kBF16, {n, c.kv_lora_rank});
  s.k_pe = f.get("k_pe", DType::kBF16, {n, c.qk_rope_head_dim});
  s.idx_q = f.get("idx_q", DType::kBF16, {n, c.index_n_heads, c.index_head_dim});
  s.idx_k = f.get("idx_k", DType::kBF16, {n, c.index_head_dim});
  s.idx_w = f.get("idx_w", DType::kF32, {n, c.index_n_heads});
  const int64_t w_rows = int64_t(c.num_heads) * (c.qk_nope_head_dim + c.v_head_dim);
  kv_b_proj_fp8 = {};
  if (!f.has("kv_b_proj_fp8")) {
    kv_b_proj = f.get("kv_b_proj", DType::kBF16, {w_rows, c.kv_lora_rank});
    return s;
  }
  DSAKIT_CHECK(c.kv_lora_rank % kFp8TileSize == 0, kFormat, f.origin(),
               ": kv_b_proj_fp8 needs d_c a multiple of ", kFp8TileSize, ", the config's is ",
               c.kv_lora_rank);
  Fp8KvBProj& w = kv_b_proj_fp8;
  w.codes = f.get("kv_b_proj_fp8", DType::kU8, {w_rows, c.kv_lora_rank});
  w.scales = f.get("kv_b_proj_fp8_scales", DType::kF32,
                   {(w_rows + kFp8TileSize - 1) / kFp8TileSize, c.kv_lora_rank / kFp8TileSize});
  w.bf16 = decode_fp8_kv_b_proj(w.codes, w.scales, DType::kBF16);
  if (f.has("kv_b_proj")) {
    const Tensor& given = f.get("kv_b_proj", DType::kBF16, {w_rows, c.kv_lora_rank});
    const bf16_t* a = given.ptr<const bf16_t>();
    const bf16_t* b = w.bf16.ptr<const bf16_t>();
    for (int64_t i = 0; i < w_rows * c.kv_lora_rank; ++i)
      DSAKIT_CHECK(a[i].bits == b[i].bits, kFormat, f.origin(),
                   ": kv_b_proj and kv_b_proj_fp8 hold different weights: element [",
                   i / c.kv_lora_rank, ", ", i % c.kv_lora_rank, "] is ", bf16_to_f32(a[i]),
                   " in kv_b_proj and ", bf16_to_f32(b[i]),
                   " as bf16(e4m3(code) * block scale); leave kv_b_proj out to use the FP8 form "
                   "alone");
  }
  kv_b_proj = w.bf16;
  return s;
}

void write_run_file(const std::string& path, const RunOptions& opt, const RunState& run,
                    const std::string& plan_text) {
  const ModelConfig& cfg = run.cfg;
  const TokenStore& tokens = run.tokens;
  const RunOutputs& out = run.out;
  const KvPoolDesc& kd = run.kd;
  SafetensorsWriter w;
  w.add("q_nope", tokens.q_nope);
  w.add("q_pe", tokens.q_pe);
  w.add("c_kv", tokens.c_kv);
  w.add("k_pe", tokens.k_pe);
  w.add("idx_q", tokens.idx_q);
  w.add("idx_k", tokens.idx_k);
  w.add("idx_w", tokens.idx_w);
  w.add("kv_b_proj", run.kv_b_proj_host);
  if (run.kv_b_proj_fp8_host.codes.defined()) {
    w.add("kv_b_proj_fp8", run.kv_b_proj_fp8_host.codes);
    w.add("kv_b_proj_fp8_scales", run.kv_b_proj_fp8_host.scales);
  }
  const int64_t rows = tokens.rows(), h = cfg.num_heads, dv = cfg.v_head_dim;
  Tensor o_bf16 = Tensor::host(DType::kBF16, {rows, h, dv});
  for (int64_t i = 0; i < o_bf16.numel(); ++i)
    o_bf16.ptr<bf16_t>()[i] = f32_to_bf16(out.o.ptr<float>()[i]);
  w.add("o", o_bf16);
  w.add("lse", out.lse);
  if (std::any_of(out.steps.begin(), out.steps.end(),
                  [](const StepRecord& s) { return s.plan.path != AttentionPath::kDenseMha; }))
    w.add("topk", out.topk);
  // Pool rows of every token in position order (row order of the inputs).
  const Tensor kv_host = run.be->to_host(run.kv_pool.storage());
  const Tensor ix_host = run.be->to_host(run.index_pool.storage());
  const int bpt = kd.bytes_per_token(), di = cfg.index_head_dim, ips = di + 4;
  Tensor kv_rows = Tensor::host(DType::kU8, {rows, bpt});
  Tensor ix_rows = Tensor::host(DType::kU8, {rows, ips});
  for (size_t r = 0; r < tokens.lengths.size(); ++r)
    for (int32_t p = 0; p < tokens.lengths[r]; ++p) {
      const int64_t row = tokens.offset(int(r)) + p;
      const int64_t loc = location_of(run.tables[r], opt.page_size, p);
      std::copy_n(kv_host.ptr<uint8_t>() + loc * bpt, bpt, kv_rows.ptr<uint8_t>() + row * bpt);
      const uint8_t* page =
          ix_host.ptr<uint8_t>() + (loc / opt.page_size) * run.index_pool.desc().page_bytes();
      const int slot = int(loc % opt.page_size);
      std::copy_n(page + slot * di, di, ix_rows.ptr<uint8_t>() + row * ips);
      std::copy_n(page + int64_t(opt.page_size) * di + slot * 4, 4,
                  ix_rows.ptr<uint8_t>() + row * ips + di);
    }
  w.add("kv_pool", kv_rows);
  w.add("index_pool", ix_rows);
  w.set_metadata("format", "dsakit-run-v1");
  w.set_metadata("config", cfg.to_json());
  w.set_metadata("layout", to_string(kd.layout));
  w.set_metadata("scale_policy", to_string(kd.scale_policy));
  w.set_metadata("page_size", std::to_string(opt.page_size));
  w.set_metadata("prompts", join_int_list(run.len.prompt));
  w.set_metadata("prefix", join_int_list(run.len.prefix));
  w.set_metadata("decode_steps", std::to_string(run.len.decode_steps));
  w.set_metadata("chunk", std::to_string(opt.chunk));
  w.set_metadata("sm_scale", fmt::format("{:.17g}", run.layer->sm_scale()));
  w.set_metadata("plan", plan_text);
  w.write(path);
}

}  // namespace dsakit::cli
