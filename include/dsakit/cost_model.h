// The cost model behind cost-mode dispatch (docs/dispatch.md#cost-mode): per-device predictions of
// the whole layer call's time through each path, fitted by `dsakit calibrate` and stored as a JSON
// profile keyed by device name, model dimensions and pool layout.
//
// A prediction is a sum of terms, each a coefficient (ms) times a feature of the (sub-)batch:
//   1      one layer call                 R      requests
//   T      new tokens Σ E_r               N      positions Σ L_r (prefix + extend)
//   C*Hi   indexer work Σ_t ctx_t · H_i   K*H    sparse attention Σ_t min(ctx_t, k) · H
//   C*H    dense attention Σ_t ctx_t · H  N*H    K/V up-projection Σ L_r · H
//   T*H    query-side projections
// where ctx_t = P_r + i + 1 is what new token t of request r attends to and H the heads per rank.
// Each path's total uses a fixed set of terms (the sparse path one set per form: MLA's, and the
// masked-MHA form's, which prices dense attention, the K/V up-projection and the indexer);
// coefficients are fitted by non-negative least squares on relative error, so the model cannot
// predict a negative time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dsakit/batch.h"
#include "dsakit/config.h"
#include "dsakit/pool.h"

namespace dsakit {

enum class AttentionPath : uint8_t;
enum class SparseForm : uint8_t;  // plan.h; value 0 is kMla

// The profile format and the kernel revision a profile was measured with: profiles with another
// value of either are refused as stale. The format changes with a profile's meaning (terms,
// units); the revision when the kernels change speed enough that old profiles would mislead
// (what each revision changed: docs/dispatch.md, cost mode).
inline constexpr int kCostProfileFormat = 2;  // 2: samples stored, local correction
inline constexpr int kCostKernelRevision = 17;

// The terms of the table above; names as written in profiles.
enum class CostTerm : uint8_t { kOne, kR, kT, kN, kTH, kNH, kCH, kKH, kCHi };
CostTerm parse_cost_term(const std::string& name);  // "1", "R", ..., "C*Hi"; throws otherwise

// Features of requests [first, first + count) of a batch (see the table above).
struct CostFeatures {
  double calls = 1, requests = 0, tokens = 0, positions = 0;
  double ctx = 0;       // Σ_t ctx_t
  double ctx_topk = 0;  // Σ_t min(ctx_t, index_topk)
  double heads = 0, index_heads = 0;

  static CostFeatures of(const Batch& batch, const ModelConfig& config, int first = 0,
                         int count = -1);
  double term(CostTerm t) const;
  double term(const std::string& name) const { return term(parse_cost_term(name)); }
};

// A fitted linear model: ms = Σ coef[i] · term(names[i]).
struct CostTerms {
  std::vector<std::string> names;
  std::vector<double> coef_ms;
  double max_rel_error = 0;   // over the calibration samples
  std::vector<CostTerm> ids;  // names parsed (filled by the fit and the reader; else parsed)
  double predict_ms(const CostFeatures& f) const;
};

// The terms each path's total (the sparse path's in `form`, kMla or kMaskedMha; and each stage)
// is fitted with.
const std::vector<std::string>& cost_terms(AttentionPath path, SparseForm form = SparseForm{});
const std::vector<std::string>& cost_stage_terms(const std::string& stage);

// The profile key: what a measurement depends on.
struct CostKey {
  std::string device;  // Capabilities::device_name, e.g. "NVIDIA H200", "cpu (2 threads)"
  std::string model;   // config name (informational; matching uses the dimensions)
  int heads = 0, d_nope = 0, d_rope = 0, d_v = 0, d_c = 0, index_heads = 0, index_dim = 0,
      index_topk = 0;
  std::string layout;  // "bf16" | "fp8" | "fp8-raw"

  static CostKey of(const std::string& device, const ModelConfig& config, KvLayout layout);
  bool matches(const CostKey& other) const;  // all but `model`
  std::string describe() const;  // "NVIDIA H200, deepseek-v3.2 H=128 (128/64/128, ...), fp8"
};

// One calibration measurement: a batch's features, which path (and, for the sparse path, which
// form), the whole-call time and the per-stage times (stage timing synchronizes around stages,
// so the stages do not sum to ms).
struct CostSample {
  AttentionPath path;
  CostFeatures features;
  double ms = 0;
  std::map<std::string, double> stage_ms;
  SparseForm form{};  // kMla
};

// A profile entry. Prediction = the path's linear model times a local correction: the
// calibration samples of that path near the batch (in log2 of tokens, positions and requests)
// pull the prediction toward what was measured there (Gaussian weights, sigma 0.5 octave, shrunk
// toward no correction when no sample is close). Far from every sample the linear model alone
// decides; at a calibration shape the prediction is within a few % of the measurement.
struct CostEntry {
  CostKey key;
  CostTerms dense, sparse;  // whole layer call through each path (sparse: the MLA form)
  CostTerms masked;         // the sparse path in the masked-MHA form; no names: not calibrated
  std::map<std::string, CostTerms> stages;  // per-stage fits (reported, not used to decide)
  std::vector<CostSample> samples;          // the calibration measurements (stage times dropped)
  std::string created;                      // ISO date of the calibration

  bool prices_masked() const { return !masked.names.empty(); }
  // `form` matters for the sparse path only; kMaskedMha without masked fits is priced as kMla.
  double linear_ms(AttentionPath path, const CostFeatures& f, SparseForm form = SparseForm{}) const;
  double predict_ms(AttentionPath path, const CostFeatures& f,
                    SparseForm form = SparseForm{}) const;

  // Caches each sample's log2 features and log residual against the fits (and the terms' ids),
  // so predict_ms() is a few µs for a whole plan (the planner runs on every layer call). The
  // reader, the fit and CostProfile::put() call it; after editing samples or fits by hand, call
  // it again: predict_ms() corrects with the cached neighbours only.
  void prepare();
  struct Neighbor {
    AttentionPath path;
    SparseForm form;
    double log2_tokens, log2_positions, log2_requests, log_residual;
  };
  std::vector<Neighbor> neighbors;
};

// A profile file: entries for any number of (device, model, layout) keys.
struct CostProfile {
  int format = kCostProfileFormat;
  int kernel_revision = kCostKernelRevision;
  std::vector<CostEntry> entries;
  std::string source;  // file it was read from ("" when built in memory)

  // Reads and validates a profile; throws Error(kInvalidArgument) naming the file for a missing,
  // malformed, stale (other format or kernel revision) profile.
  static CostProfile load(const std::string& path);
  void save(const std::string& path) const;  // atomic (write + rename)
  std::string to_json() const;
  static CostProfile from_json(const std::string& text, const std::string& source);

  // The entry for `key`; throws Error(kInvalidArgument) listing the keys the profile holds.
  const CostEntry& find(const CostKey& key) const;
  // Adds `entry`, replacing one with the same key.
  void put(CostEntry entry);
};

// Fits `terms` to (features, ms) pairs by non-negative least squares on relative error.
CostTerms fit_cost_terms(const std::vector<std::string>& terms,
                         const std::vector<CostFeatures>& features, const std::vector<double>& ms);

// Fits both paths' totals, the masked-MHA form's where `samples` hold enough of it, and every
// stage seen in the samples of the dense path and the MLA form.
CostEntry fit_cost_entry(const CostKey& key, const std::vector<CostSample>& samples);

}  // namespace dsakit
