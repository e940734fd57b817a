// In-process simulation of decode context parallelism (DCP) over W ranks (docs/layer.md).
// Position p of a request lives on rank p % W at local row p / W; each rank has its own pools and
// page tables. Each rank computes partial attention (output + lse) over the tokens it owns;
// partials merge exactly by lse. Sparse top-k: every rank proposes its local top-k by score and
// the global top-k is the merge of those candidates, so no globally selected token is dropped.
#pragma once

#include <memory>
#include <vector>

#include "dsakit/layer.h"

namespace dsakit {

class DcpSimulation {
 public:
  // max_lengths: the most positions each request will reach (sizes the per-rank page tables).
  // pool: the per-rank pool description (num_pages is per rank). kv_b_proj on backend's device.
  DcpSimulation(ModelConfig config, Backend& backend, int world, const KvPoolDesc& pool,
                const std::vector<int32_t>& max_lengths, TensorView kv_b_proj,
                LayerOptions options = {});

  int world() const { return world_; }
  // Same contract as DsaAttention::forward, for a batch whose page tables are ignored (each
  // rank uses its own). Inputs on the backend's device.
  LayerResult forward(const Batch& batch, const LayerInputs& inputs);

 private:
  struct Rank {
    PagedKvPool kv;
    IndexKeyPool index;
    std::vector<std::vector<int32_t>> page_tables;  // per request, local rows
  };
  ModelConfig config_;
  Backend& backend_;
  int world_;
  std::vector<int32_t> max_lengths_;
  TensorView kv_b_proj_;
  LayerOptions options_;
  double sm_scale_ = 0;
  std::vector<Rank> ranks_;
};

}  // namespace dsakit
