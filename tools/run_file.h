// The --save / --inputs file of `dsakit run` (docs/cli.md): safetensors holding every position's
// inputs, the outputs and each token's pool rows, with the run's lengths and settings as metadata.
#pragma once

#include <string>

#include "tools/run_command.h"
#include "tools/run_state.h"

namespace dsakit::cli {

// The lengths in the file's metadata (prompts, prefix, decode_steps); `path` names the file in
// errors.
RunLengths read_run_lengths(const SafetensorsFile& file, const std::string& path);

// The file's inputs for `lengths` and its kv_b_proj, shapes checked against the config. With
// kv_b_proj_fp8 (u8 or F8_E4M3 codes) and kv_b_proj_fp8_scales (f32 128 x 128 block scales) in the
// file, kv_b_proj_fp8 gets them, and kv_b_proj — when the file has none — their bf16 rounding
// (decode_fp8_kv_b_proj); a file holding both forms must hold that rounding (Error(kFormat) names
// the first element that differs), since the layer takes them as the same weights.
TokenStore read_run_inputs(const SafetensorsFile& file, const ModelConfig& config,
                           const RunLengths& lengths, Tensor& kv_b_proj, Fp8KvBProj& kv_b_proj_fp8);

// Writes the run to `path`; `plan_text` is the metadata's plan (one "path | reason" a line).
void write_run_file(const std::string& path, const RunOptions& options, const RunState& run,
                    const std::string& plan_text);

}  // namespace dsakit::cli
