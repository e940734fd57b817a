// DcpComm over an NCCL communicator (include/dsakit/dcp.h): all_gather is one ncclAllGather of
// bytes on the CUDA backend's stream. The communicator belongs to the caller.
#include <nccl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <vector>

#include "dsakit/dcp.h"
#include "dsakit/error.h"
#include "src/cuda/cuda_backend.h"

namespace dsakit {

namespace {

void check_nccl(ncclResult_t r, const char* what) {
  DSAKIT_CHECK(r == ncclSuccess, kBackend, what, ": ", ncclGetErrorString(r));
}

class NcclDcpComm final : public DcpComm {
 public:
  explicit NcclDcpComm(ncclComm_t comm) : comm_(comm) {
    DSAKIT_CHECK_ARG(comm != nullptr, "make_nccl_dcp_comm: null communicator");
    check_nccl(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    check_nccl(ncclCommCount(comm_, &world_), "ncclCommCount");
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }

  void all_gather(Backend& be, const TensorView& send, const TensorView& recv) override {
    auto* cuda = dynamic_cast<cuda::CudaBackend*>(&be);
    DSAKIT_CHECK_ARG(cuda != nullptr, "dcp over NCCL: all_gather needs a CUDA backend, got ",
                     be.capabilities().device_name);
    DSAKIT_CHECK_ARG(send.is_contiguous() && send.device == Device::kCuda,
                     "all_gather send: expected a contiguous CUDA tensor");
    DSAKIT_CHECK_ARG(
        recv.is_contiguous() && recv.dtype == send.dtype && recv.device == Device::kCuda &&
            recv.numel() == int64_t(world_) * send.numel(),
        "all_gather recv: expected a contiguous ", to_string(send.dtype), " CUDA tensor of ",
        world_, " x ", send.numel(), " elements, got ", recv.shape_str());
    if (send.numel() == 0) return;
    check_nccl(ncclAllGather(send.data, recv.data, send.nbytes(), ncclUint8, comm_, cuda->stream()),
               "ncclAllGather");
  }

 private:
  ncclComm_t comm_;
  int rank_ = 0, world_ = 1;
};

}  // namespace

bool nccl_compiled() {
  return true;
}

std::unique_ptr<DcpComm> make_nccl_dcp_comm(ncclComm* comm) {
  return std::make_unique<NcclDcpComm>(comm);
}

namespace {

bool write_all(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::write(fd, p, n);
    if (k <= 0) return false;
    p += k, n -= size_t(k);
  }
  return true;
}

bool read_all(int fd, void* data, size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = ::read(fd, p, n);
    if (k <= 0) return false;
    p += k, n -= size_t(k);
  }
  return true;
}

// The body of rank w's process; returns its exit code.
int run_rank(int world, int w, const std::vector<int>& id_pipes,
             const std::function<int(int, Backend&, DcpComm&)>& fn) {
  try {
    std::unique_ptr<Backend> be = make_cuda_backend(w);  // selects device w
    ncclUniqueId id{};
    if (w == 0) {
      check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
      for (int r = 1; r < world; ++r)
        DSAKIT_CHECK(write_all(id_pipes[size_t(r)], &id, sizeof(id)), kBackend,
                     "dcp: sending the NCCL id to rank ", r, " failed");
    } else {
      DSAKIT_CHECK(read_all(id_pipes[size_t(w)], &id, sizeof(id)), kBackend,
                   "dcp: rank 0 sent no NCCL id (it failed before)");
    }
    ncclComm_t comm = nullptr;
    check_nccl(ncclCommInitRank(&comm, world, id, w), "ncclCommInitRank");
    int rc = 0;
    {
      const std::unique_ptr<DcpComm> dcp = make_nccl_dcp_comm(comm);
      rc = fn(w, *be, *dcp);
      be->synchronize();
    }
    ncclCommDestroy(comm);
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsakit: rank %d: %s\n", w, e.what());
    return 2;
  }
}

}  // namespace

int run_dcp_on_gpus(int world, const std::function<int(int, Backend&, DcpComm&)>& fn) {
  DSAKIT_CHECK_ARG(world >= 1 && world <= 64, "dcp world size: expected 1..64, got ", world);
  // The GPU count is read in a child: this process must not initialize CUDA before forking.
  int pipe_count[2];
  DSAKIT_CHECK(::pipe(pipe_count) == 0, kBackend, "dcp: pipe() failed");
  std::fflush(nullptr);
  const pid_t probe = ::fork();
  DSAKIT_CHECK(probe >= 0, kBackend, "dcp: fork() failed");
  if (probe == 0) {
    const int n = cuda_device_count();
    write_all(pipe_count[1], &n, sizeof(n));
    ::_exit(0);
  }
  ::close(pipe_count[1]);
  int gpus = 0;
  const bool got = read_all(pipe_count[0], &gpus, sizeof(gpus));
  ::close(pipe_count[0]);
  ::waitpid(probe, nullptr, 0);
  DSAKIT_CHECK(got, kBackend, "dcp: could not count the GPUs");
  DSAKIT_CHECK_ARG(world <= gpus, "--dcp ", world, ": needs ", world, " GPUs, this machine has ",
                   gpus);

  // id_pipes[w]: rank 0 -> rank w (w >= 1).
  std::vector<int> read_end(size_t(world), -1), write_end(size_t(world), -1);
  for (int w = 1; w < world; ++w) {
    int fds[2];
    DSAKIT_CHECK(::pipe(fds) == 0, kBackend, "dcp: pipe() failed");
    read_end[size_t(w)] = fds[0], write_end[size_t(w)] = fds[1];
  }
  std::vector<pid_t> pids(size_t(world), -1);
  for (int w = 0; w < world; ++w) {
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (int r = 0; r < w; ++r) ::kill(pids[size_t(r)], SIGTERM);
      DSAKIT_FAIL(kBackend, "dcp: fork() failed");
    }
    if (pid == 0) {
      std::vector<int> mine(size_t(world), -1);
      for (int r = 1; r < world; ++r) {
        if (w == 0) {
          ::close(read_end[size_t(r)]);
          mine[size_t(r)] = write_end[size_t(r)];
        } else {
          ::close(write_end[size_t(r)]);
          if (r == w)
            mine[size_t(r)] = read_end[size_t(r)];
          else
            ::close(read_end[size_t(r)]);
        }
      }
      const int rc = run_rank(world, w, mine, fn);
      std::fflush(nullptr);
      ::_exit(rc);
    }
    pids[size_t(w)] = pid;
  }
  for (int w = 1; w < world; ++w) ::close(read_end[size_t(w)]), ::close(write_end[size_t(w)]);

  int result = 0, running = world;
  while (running > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) break;
    --running;
    for (pid_t& p : pids)
      if (p == pid) p = -1;  // reaped: never signalled again
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code != 0 && result == 0) {
      result = code;
      for (const pid_t other : pids)
        if (other > 0) ::kill(other, SIGTERM);
    }
  }
  return result;
}

}  // namespace dsakit
