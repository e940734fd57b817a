// Decode/prefill context parallelism (DCP) over W ranks (docs/layer.md, "Context parallelism").
// Position p of a request lives on rank p % W at local row p / W; each rank has its own pools.
// Every rank receives the whole batch and its inputs, stores the new tokens it owns, and computes
// partial attention (output + lse) over its own keys; the partials merge exactly by lse. Sparse
// top-k: each rank proposes its local top-k with their scores, and every rank selects the same
// global top-k from the W·k candidates, so no globally selected token is dropped and the sets equal
// one rank's under the tie rules.
//
// The communication is behind DcpComm: InProcessDcpGroup (W threads of one process: the tests and
// DcpSimulation) or NCCL across GPUs (make_nccl_dcp_comm; run_dcp_on_gpus below forks one process
// per GPU for the CLI).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "dsakit/layer.h"

struct ncclComm;  // nccl.h: typedef struct ncclComm* ncclComm_t

namespace dsakit {

// Positions p < length that rank `rank` of `world` owns (p % world == rank): its local rows.
inline int32_t dcp_owned_positions(int32_t length, int rank, int world) {
  return length > rank ? (length - 1 - rank) / world + 1 : 0;
}

// One rank's handle on a group of W ranks.
class DcpComm {
 public:
  virtual ~DcpComm() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // Collective: every rank calls it in the same order with `send` of one dtype and shape
  // (contiguous, on `backend`'s device); recv [W, send...] (contiguous) receives rank w's send at
  // index w. Ordered with `backend`'s work (CUDA: its stream).
  virtual void all_gather(Backend& backend, const TensorView& send, const TensorView& recv) = 0;
};

// W ranks in one process, each driven by its own thread. A rank that fails calls abort(): every
// rank waiting in (or later entering) all_gather then throws instead of waiting forever; reset()
// makes the group usable again once all threads have left it.
class InProcessDcpGroup {
 public:
  explicit InProcessDcpGroup(int world);
  ~InProcessDcpGroup();
  InProcessDcpGroup(const InProcessDcpGroup&) = delete;
  InProcessDcpGroup& operator=(const InProcessDcpGroup&) = delete;
  int world() const;
  DcpComm& comm(int rank);
  void abort();
  static constexpr const char* kAbortedMessage = "another rank of the in-process group failed";
  void reset();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// A DcpComm over an NCCL communicator the caller created and keeps alive (engines already have
// one; dsakit never initializes MPI or chooses devices). The backend passed to all_gather must be
// a CUDA backend on the communicator's device; the collective runs on its stream. Throws
// kUnsupported when dsakit was built without NCCL (nccl_compiled()).
std::unique_ptr<DcpComm> make_nccl_dcp_comm(ncclComm* comm);
bool nccl_compiled();

// For tools and tests: forks `world` processes, rank w on CUDA device w, each with its own CUDA
// backend and an NCCL communicator over the group (rank 0 makes the NCCL id; it reaches the
// others through pipes), and runs fn(rank, backend, comm) in each. Call it before this process
// initializes CUDA (a forked child cannot use a parent's CUDA context). Returns 0 when every
// rank's fn returned 0; otherwise the first failing rank's code (128 + signal for a rank killed
// by one), having terminated the ranks still running (a rank left waiting in a collective
// would never return). An exception in fn is printed as "dsakit: rank w: ..." and exits 2.
// Throws kUnsupported without NCCL, kInvalidArgument when world exceeds the GPUs present.
int run_dcp_on_gpus(int world,
                    const std::function<int(int rank, Backend& backend, DcpComm& comm)>& fn);

// One rank of a DCP group: its shard of the KV and index-key pools and its part of the layer.
class DcpRank {
 public:
  // max_lengths: the most positions each request will reach (sizes this rank's page tables).
  // pool: this rank's pool description (num_pages per rank). kv_b_proj on backend's device.
  DcpRank(ModelConfig config, Backend& backend, DcpComm& comm, const KvPoolDesc& pool,
          const std::vector<int32_t>& max_lengths, TensorView kv_b_proj, LayerOptions options = {});

  int rank() const { return comm_.rank(); }
  int world() const { return comm_.world(); }
  const PagedKvPool& kv_pool() const { return kv_; }
  const IndexKeyPool& index_pool() const { return index_; }

  // Collective: every rank calls it with the same batch (its page tables are ignored: each rank
  // keeps its own) and the same inputs (on this rank's device). requests[i]: which of the
  // max_lengths requests batch entry i is (distinct); empty: entry i is request i, and the batch
  // holds all of them. Same contract and results as DsaAttention::forward on one rank, on every
  // rank. A rejected call (validated before anything is stored) throws on every rank alike and
  // leaves the pools byte-identical.
  LayerResult forward(const Batch& batch, const LayerInputs& inputs,
                      const std::vector<int32_t>& requests = {});

 private:
  ModelConfig config_;
  Backend& be_;
  DcpComm& comm_;
  std::vector<int32_t> max_lengths_;
  TensorView kv_b_proj_;
  LayerOptions options_;
  double sm_scale_ = 0;
  PagedKvPool kv_;
  IndexKeyPool index_;
  std::vector<std::vector<int32_t>> page_tables_;  // per request, this rank's local rows
};

// W DcpRanks on W threads of this process over InProcessDcpGroup: the DCP logic on one device.
// Rank 0 runs on `backend`; the others on backends of their own on the same device
// (Backend::make_peer), so each rank has its own stream and memory, as on separate GPUs.
class DcpSimulation {
 public:
  DcpSimulation(ModelConfig config, Backend& backend, int world, const KvPoolDesc& pool,
                const std::vector<int32_t>& max_lengths, TensorView kv_b_proj,
                LayerOptions options = {});
  ~DcpSimulation();

  int world() const;
  // DcpRank::forward on every rank; returns rank 0's result (on `backend`).
  LayerResult forward(const Batch& batch, const LayerInputs& inputs,
                      const std::vector<int32_t>& requests = {});

 private:
  Backend& backend_;
  std::vector<std::unique_ptr<Backend>> peers_;  // ranks 1 … W-1
  InProcessDcpGroup group_;
  std::vector<std::unique_ptr<DcpRank>> ranks_;
};

}  // namespace dsakit
