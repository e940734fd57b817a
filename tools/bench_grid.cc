#include "tools/bench_grid.h"

#include "dsakit/error.h"
#include "tools/bench_command.h"
#include "tools/cli_common.h"

namespace dsakit::cli {

BenchGrid BenchGrid::named(const std::string& name) {
  BenchGrid g;
  auto mixed = [](std::vector<int32_t> p, std::vector<int32_t> e) {
    return BenchShape{"mixed", std::move(p), std::move(e)};
  };
  if (name == "quick") {
    g.fresh = {128, 512};
    g.prefixes = {384};
    g.extends = {1, 64};
    g.mixed = {mixed({0, 448}, {256, 64})};
  } else if (name == "small") {
    g.fresh = {128, 256, 512, 1024, 2048};
    g.prefixes = {512, 1536, 1984};
    g.extends = {1, 16, 64, 256};
    g.mixed = {mixed({0, 0}, {1500, 700}), mixed({1984, 0}, {16, 1024}),
               mixed({0, 0, 0, 0}, {256, 256, 256, 256}), mixed({1920, 0, 1980}, {64, 512, 32})};
  } else if (name == "full") {
    g.fresh = {256, 512, 1024, 1536, 2048, 4096, 8192, 16384, 32768, 65536};
    g.prefixes = {256, 1024, 1536, 1792, 1984, 4096, 32768};
    g.extends = {1, 16, 64, 256, 1024, 8192};
    g.mixed = {mixed({0, 0}, {1500, 700}),
               mixed({1984, 0}, {16, 1024}),
               mixed({0, 0, 0, 0, 0, 0, 0, 0}, {256, 256, 256, 256, 256, 256, 256, 256}),
               mixed({0, 0}, {2048, 4096}),
               mixed({1920, 0, 1980}, {64, 512, 32}),
               mixed({0, 1900, 0, 6000}, {100, 16, 300, 2000})};
  } else {
    DSAKIT_FAIL(kInvalidArgument, "--grid: expected quick, small or full, got '", name, "'");
  }
  return g;
}

std::vector<BenchShape> BenchGrid::shapes(bool with_mixed) const {
  std::vector<BenchShape> out;
  for (int32_t t : fresh) out.push_back({"fresh", {0}, {t}});
  for (int32_t p : prefixes)
    for (int32_t e : extends) out.push_back({"prefix", {p}, {e}});
  if (with_mixed) out.insert(out.end(), mixed.begin(), mixed.end());
  return out;
}

std::vector<BenchShape> bench_shapes(const BenchOptions& o, Device device) {
  BenchGrid grid =
      BenchGrid::named(o.grid.empty() ? (device == Device::kCpu ? "small" : "full") : o.grid);
  if (!o.fresh.empty()) grid.fresh = parse_int_list(o.fresh, "--fresh", 1);
  if (!o.prefixes.empty()) grid.prefixes = parse_int_list(o.prefixes, "--prefixes", 0);
  if (!o.extends.empty()) grid.extends = parse_int_list(o.extends, "--extends", 1);
  std::vector<BenchShape> shapes = grid.shapes(!o.no_mixed);
  DSAKIT_CHECK_ARG(!shapes.empty(), "the grid has no shapes");
  for (const auto& s : shapes)
    DSAKIT_CHECK_ARG(s.tokens() <= (int64_t(1) << 20) && s.max_len() <= (int64_t(1) << 20),
                     "shape ", s.label(), ": at most 2^20 tokens");
  return shapes;
}

// Contexts within index_topk (both paths exact: where the choice is made), a few beyond it for
// the sparse terms, and mixed batches for the per-request terms (with and without long cached
// prefixes).
std::vector<BenchShape> calibration_shapes(int index_topk, bool long_prompts) {
  const int32_t k = index_topk;
  std::vector<BenchShape> s;
  for (int32_t t : {64, 128, 256, 512, 1024, 1536, 2048})
    if (t <= k) s.push_back({"fresh", {0}, {t}});
  const std::vector<std::pair<int32_t, int32_t>> pe = {
      {512, 1},    {1024, 1},   {2000, 1},   {1024, 16},  {1984, 16},   {1536, 64}, {1984, 64},
      {1792, 256}, {1024, 512}, {1536, 512}, {256, 1024}, {1024, 1024}, {2040, 8}};
  for (auto [p, e] : pe)
    if (p + e <= k) s.push_back({"prefix", {p}, {e}});
  s.push_back({"mixed", {0, 0, 0, 0}, {256, 256, 256, 256}});
  s.push_back({"mixed", {0, 1024, 0}, {1024, 64, 64}});
  s.push_back({"mixed", std::vector<int32_t>(8, 0), std::vector<int32_t>(8, 128)});
  // Mixed batches whose positions are mostly long cached prefixes (chunked prefill next to a
  // fresh prompt): without samples near them the linear terms misprice them by 10-20% (H200).
  for (BenchShape m : {BenchShape{"mixed", {1792, 0, 2000}, {64, 256, 16}},
                       BenchShape{"mixed", {1536, 0, 1984}, {128, 384, 64}},
                       BenchShape{"mixed", {1024, 1984}, {256, 64}}})
    if (m.max_len() <= k) s.push_back(std::move(m));
  // Beyond index_topk (sparse only): separates the indexer's Σctx from attention's Σmin(ctx,k).
  s.push_back({"prefix", {k}, {512}});
  s.push_back({"prefix", {2 * k}, {64}});
  s.push_back({"prefix", {4 * k}, {16}});
  if (long_prompts) {
    s.push_back({"fresh", {0}, {2 * k}});
    s.push_back({"fresh", {0}, {4 * k}});
    s.push_back({"fresh", {0}, {8 * k}});
  }
  return s;
}

bool mode_allowed(DispatchMode mode, const BenchShape& s, const ModelConfig& c,
                  const Capabilities& caps) {
  if (mode != DispatchMode::kDense) return true;
  return s.max_len() <= c.index_topk && dense_mha_available(caps, c);
}

}  // namespace dsakit::cli
