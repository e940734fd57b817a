#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into fuzz/corpus/<target>/ (small valid and broken
inputs). Run from anywhere; the files are committed, so this only needs re-running to change them."""
import json
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "corpus"


def safetensors(header, data=b"", pad=True):
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
    raw = text.encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def write(target, files):
    out = ROOT / target
    out.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (out / name).write_bytes(content if isinstance(content, bytes) else content.encode())


write("safetensors", {
    "empty_header": safetensors({}),
    "one_f32": safetensors({"x": entry("F32", [2, 2], 0, 16)}, bytes(range(16))),
    "all_dtypes": safetensors({
        "__metadata__": {"seed": "1", "what": "seed"},
        "a": entry("BF16", [3], 0, 6), "b": entry("F32", [1, 2], 6, 14),
        "c": entry("F64", [1], 14, 22), "d": entry("I32", [2, 1, 1], 22, 30),
        "e": entry("U8", [1, 1, 1, 3], 30, 33), "f": entry("F8_E4M3", [2], 33, 35),
        "z": entry("F32", [0, 4], 35, 35)}, bytes(range(35))),
    "overlap": safetensors({"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)}, bytes(6)),
    "duplicate_key": safetensors('{"a":' + json.dumps(entry("U8", [1], 0, 1)) + ',"a":'
                                 + json.dumps(entry("U8", [1], 1, 2)) + "}", bytes(2)),
    "bad_size": safetensors({"a": entry("F32", [3], 0, 8)}, bytes(8)),
    "bad_dtype": safetensors({"a": entry("F16", [2], 0, 4)}, bytes(4)),
    "huge_shape": safetensors({"a": entry("U8", [4294967296, 4294967296], 0, 1)}, bytes(1)),
    "truncated": safetensors({"x": entry("F32", [4], 0, 16)}, bytes(16))[:-3],
    "short": b"\x05\x00\x00",
})

CONFIG_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "configs"
deepseek = json.loads((CONFIG_DIR / "deepseek-v3.2.json").read_text())
minimal = {k: deepseek[k] for k in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                                     "qk_rope_head_dim", "v_head_dim", "index_n_heads",
                                     "index_head_dim", "index_topk", "hidden_size")}
write("config", {
    "deepseek_v32.json": (CONFIG_DIR / "deepseek-v3.2.json").read_text(),
    "glm_5.json": (CONFIG_DIR / "glm-5.json").read_text(),
    "minimal.json": json.dumps(minimal),
    "rope_parameters.json": json.dumps({**minimal, "q_lora_rank": None, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 0.5}}),
    "tp.json": json.dumps({**minimal, "dsakit_tp_size": 8, "model_type": "x"}),
    "float_dim.json": json.dumps({**minimal, "kv_lora_rank": 512.0}),
    "bad_rope.json": json.dumps({**minimal, "rope_scaling": {"type": "yarn", "factor": -1}}),
    "not_object.json": "[1, 2, 3]",
    "truncated.json": json.dumps(minimal)[:40],
})

# fuzz_cli: one argument per line (fuzz/fuzz_cli.cc rewrites models and file names).
write("cli", {f"seed_{i:02d}": "\n".join(args) for i, args in enumerate([
    ["run", "--device", "cpu", "--prompts", "20,9", "--prefix", "5,0", "--verify"],
    ["run", "--prompts", "30", "--chunk", "7", "--kv", "bf16", "--verify", "--json"],
    ["run", "--prompts=12,12", "--decode-steps", "2", "--kv", "fp8-raw", "--page-size", "1"],
    ["run", "--inputs", "x", "--verify", "--quiet"],
    ["run", "--prompts", "16", "--dispatch", "sparse", "--save", "x", "--max-workspace-mb", "1"],
    ["run", "--prompts", "24,3,5", "--dispatch", "dense", "--allow-approx", "--scale-policy",
     "pow2", "--threads", "1", "--seed", "7", "--verify-tokens", "3", "--verify-tol", "0.5"],
    ["run", "--prompts", "5", "--threshold", "-3", "--sm-scale", "0.1", "--k-scale", "2"],
    ["run", "--prompts", "0", "--device", "cuda"],
    ["plan", "--prompts", "1950", "--prefix", "1900", "--mode", "extend", "--json"],
    ["plan", "--model", "glm-5", "--tp", "4", "--device", "cuda", "--arch", "100",
     "--speculative", "--cuda-graph", "--hisparse", "--context-parallel"],
    ["plan", "--prompts", "3000,10", "--dispatch", "cost", "--chunk-capacity", "100"],
    ["info"],
    ["--help"],
    ["run", "--help"],
    ["--version"],
    ["bogus"],
])})

# fuzz_layer: FuzzedDataProvider bytes; any bytes are a valid input, these reach deeper faster.
write("layer", {f"seed_{i:02d}": bytes((i * 37 + j * (11 + i)) % 256 for j in range(96 + 16 * i))
                for i in range(8)})
