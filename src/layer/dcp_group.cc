// InProcessDcpGroup: W ranks on W threads of one process exchange tensors through shared views
// (include/dsakit/dcp.h). all_gather is two rendezvous: after the first every rank's send is
// complete and published; each rank copies all sends into its recv on its own backend and waits
// for its copies; after the second every send may be reused.
#include <condition_variable>
#include <mutex>

#include "dsakit/dcp.h"
#include "dsakit/error.h"

namespace dsakit {

struct InProcessDcpGroup::State {
  int world = 0;
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool broken = false;
  std::vector<TensorView> sends;  // [world], valid between the two rendezvous of a gather

  // Blocks until all `world` ranks have arrived (or the group is aborted: throws).
  void rendezvous() {
    std::unique_lock<std::mutex> lock(mutex);
    DSAKIT_CHECK(!broken, kBackend, "dcp: ", kAbortedMessage);
    const uint64_t gen = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(lock, [&] { return generation != gen || broken; });
    DSAKIT_CHECK(generation != gen, kBackend, "dcp: ", kAbortedMessage);
  }

  class Comm;
  std::vector<std::unique_ptr<Comm>> comms;
};

class InProcessDcpGroup::State::Comm final : public DcpComm {
 public:
  Comm(State& state, int rank) : state_(state), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return state_.world; }

  void all_gather(Backend& be, const TensorView& send, const TensorView& recv) override {
    DSAKIT_CHECK_ARG(send.is_contiguous() && send.device == be.device(),
                     "all_gather send: expected a contiguous tensor on ", to_string(be.device()));
    DSAKIT_CHECK_ARG(
        recv.is_contiguous() && recv.dtype == send.dtype && recv.device == send.device &&
            recv.numel() == int64_t(state_.world) * send.numel(),
        "all_gather recv: expected a contiguous ", to_string(send.dtype), " tensor of ",
        state_.world, " x ", send.numel(), " elements, got ", recv.shape_str());
    be.synchronize();  // this rank's send is complete before others read it
    {
      std::lock_guard<std::mutex> lock(state_.mutex);
      state_.sends[size_t(rank_)] = send;
    }
    state_.rendezvous();
    const int64_t n = send.numel();
    const TensorView flat = make_view(recv.data, recv.dtype, recv.device, {recv.numel()});
    for (int w = 0; w < state_.world; ++w) {
      const TensorView& src = state_.sends[size_t(w)];
      DSAKIT_CHECK(src.numel() == n && src.dtype == send.dtype, kInvalidArgument,
                   "all_gather: rank ", w, " sent ", src.shape_str(), " ", to_string(src.dtype),
                   ", rank ", rank_, " ", send.shape_str(), " ", to_string(send.dtype));
      if (n == 0) continue;
      be.copy(slice_rows(flat, w * n, (w + 1) * n),
              make_view(src.data, src.dtype, src.device, {n}));
    }
    be.synchronize();  // this rank's reads of the others' sends are done
    state_.rendezvous();
  }

 private:
  State& state_;
  int rank_;
};

InProcessDcpGroup::InProcessDcpGroup(int world) : state_(std::make_unique<State>()) {
  DSAKIT_CHECK_ARG(world >= 1 && world <= 64, "dcp world size: expected 1..64, got ", world);
  state_->world = world;
  state_->sends.resize(size_t(world));
  for (int w = 0; w < world; ++w)
    state_->comms.push_back(std::make_unique<State::Comm>(*state_, w));
}

InProcessDcpGroup::~InProcessDcpGroup() = default;

int InProcessDcpGroup::world() const {
  return state_->world;
}

DcpComm& InProcessDcpGroup::comm(int rank) {
  DSAKIT_CHECK_ARG(rank >= 0 && rank < state_->world, "dcp rank ", rank, " of ", state_->world);
  return *state_->comms[size_t(rank)];
}

void InProcessDcpGroup::abort() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->broken = true;
  state_->cv.notify_all();
}

void InProcessDcpGroup::reset() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->broken = false;
  state_->arrived = 0;
  for (TensorView& s : state_->sends) s = TensorView{};
}

#if !defined(DSAKIT_WITH_NCCL)
bool nccl_compiled() {
  return false;
}
std::unique_ptr<DcpComm> make_nccl_dcp_comm(ncclComm*) {
  DSAKIT_FAIL(kUnsupported,
              "dcp over NCCL: this dsakit build has no NCCL communicator (configure with the CUDA "
              "toolkit's NCCL or NCCL_ROOT to build it)");
}
int run_dcp_on_gpus(int, const std::function<int(int, Backend&, DcpComm&)>&) {
  DSAKIT_FAIL(kUnsupported,
              "dcp on GPUs: this dsakit build has no NCCL communicator (configure with the CUDA "
              "toolkit's NCCL or NCCL_ROOT to build it)");
}
#endif

}  // namespace dsakit
