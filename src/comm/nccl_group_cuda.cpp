// nccl_group_cuda.cpp — comm::Group over NCCL (comm.h): GPU tensors of the current device, one
// GPU per rank, every operation issued in stream order on the stream it is given.
//
// Bootstrap goes through MPI: rank 0 of a group makes the NCCL unique id and broadcasts it over
// the group's own MPI communicator (kept for split() and the host operations); a single process
// without a launcher makes a one-rank communicator locally. split() splits the MPI communicator
// and builds a fresh NCCL communicator the same way (no ncclCommSplit: one code path for both).
//
// NCCL runs the operations of one communicator one after another, whatever streams they are
// issued on. So that traffic classes overlap (core/stream.h: ep, gather, reduce, cp, comm), a
// group keeps one communicator per stream it issues on: the first stream used gets the group's
// own, each further one a communicator of the same ranks made at its first use. Every rank
// issues a group's operations in the same order, so every rank makes a lane at the same
// operation.
//
// An operation makes stream `s` wait for the caller's current stream, enqueues the NCCL call on
// `s` and records an event after it; Work::wait() makes the caller's current stream wait for that
// event (the host never blocks). Uneven all-gather is a group of broadcasts (one per rank, over
// the rings NCCL already has), all-to-all-v a group of send/recv pairs. NCCL counts are size_t:
// no 2^31 limit. The host blocks only in barrier() (polled against the job's deadline, with
// NCCL's asynchronous error state) and in the host operations, which go through MPI.
#include <nccl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <chrono>
#include <climits>
#include <cstdio>
#include <thread>

#include "backend/cuda/check.cuh"  // cuda::stream_of: the cudaStream_t of a named stream
#include "backend/cuda/runtime.h"
#include "comm/mpi_group.h"
#include "comm/watchdog.h"

namespace bb::comm {

namespace {

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

ncclDataType_t nccl_type(DType dt) {
  switch (dt) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::i16: return ncclFloat16;  // NCCL has no 16-bit integer: the bits move unchanged (no reductions)
    case DType::u8:
    case DType::boolean: return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  return ncclSum;
}

// Throws bb::Error naming the NCCL call, the group and NCCL's own account of the failure.
void nccl_check(ncclResult_t r, ncclComm_t comm, const char* what, const std::string& group) {
  if (r == ncclSuccess) return;
  set_current_op("", "", 0);
  const char* last = ncclGetLastError(comm);
  BB_FAIL("NCCL error in ", what, " on group ", group, ": ", ncclGetErrorString(r),
          last && *last ? " (" : "", last && *last ? last : "", last && *last ? ")" : "",
          r == ncclInvalidUsage && std::string(what) == "ncclCommInitRank"
              ? "; NCCL needs one GPU per rank (ranks sharing a GPU need parallel.comm = 'mpi')"
              : "");
}

// Bytes from the start of `t` to its row `row`.
size_t row_offset(const Tensor& t, int64_t row) {
  return static_cast<size_t>(row) * static_cast<size_t>(row_elems(t)) * dtype_size(t.dtype());
}
char* at_row(const Tensor& t, int64_t row) {
  return static_cast<char*>(t.raw()) + row_offset(t, row);
}

// ncclCommInitRank with the job's deadline: the watchdog watches the call (comm/watchdog.h), so
// that a rank that never joins (dead, hung, or started with another layout) ends the job with a
// message naming the group instead of a hang.
ncclComm_t init_comm(int size, const ncclUniqueId& id, int rank, const std::string& group) {
  auto finished = std::make_shared<std::atomic<bool>>(false);
  watch([finished] { return finished->load(); },
        "ncclCommInitRank on group '" + group + "' (" + std::to_string(size) + " ranks)");
  ncclComm_t c = nullptr;
  const ncclResult_t r = ncclCommInitRank(&c, size, id, rank);
  finished->store(true);
  nccl_check(r, nullptr, "ncclCommInitRank", group);
  return c;
}

class NcclWork final : public Work {
 public:
  NcclWork(Event done, std::vector<Tensor> keep) : done_(std::move(done)), keep_(std::move(keep)) {}
  // Orders the caller's current stream after the operation; the host does not wait. A Work
  // dropped without wait() completes anyway (the operation is already queued).
  void wait() override { done_.wait(current_stream()); }

 private:
  Event done_;                // recorded on the operation's stream right after it
  std::vector<Tensor> keep_;  // the operation's tensors, alive until the Work goes (comm.h)
};

class NcclGroup final : public Group {
 public:
  NcclGroup(MPI_Comm mpi, ncclComm_t nccl, int dev, const std::string& name, int rank, int size,
            std::vector<int> wr)
      : Group(name, rank, size, std::move(wr)), mpi_(mpi), nccl_(nccl), dev_(dev) {
    // The watchdog polls every communicator's asynchronous error state and aborts them when it
    // ends the job (comm/watchdog.h).
    // Both run on the watchdog's thread: the group's device made current there first.
    health_ = add_health_check(
        [this] {
          cuda::set_device(dev_);
          return async_error();
        },
        [this] {
          cuda::set_device(dev_);
          abort_comm();
        });
  }
  ~NcclGroup() override {
    remove_health_check(health_);
    // A communicator in an error state cannot be finalised cleanly (destroy would wait for
    // peers that are gone): abort it instead.
    for (ncclComm_t c : comms()) {
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(c, &async) != ncclSuccess || (async != ncclSuccess && async != ncclInProgress))
        ncclCommAbort(c);
      else
        ncclCommDestroy(c);
    }
    if (mpi_ != MPI_COMM_NULL) {
      int fin = 0;
      MPI_Finalized(&fin);
      if (!fin) MPI_Comm_free(&mpi_);
    }
  }
  Backend backend() const override { return Backend::nccl; }

  WorkPtr all_reduce(const Tensor& t, ReduceOp op, Stream s) override {
    check_tensor("all_reduce", "t", t);
    if (t.numel() == 0) return done_work();
    const auto [cs, nc] = enter("all_reduce", s);
    nccl_check(ncclAllReduce(t.raw(), t.raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()),
                             nccl_op(op), nc, cs),
               nc, "all_reduce", name());
    return leave(s, {t});
  }

  WorkPtr reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op, Stream s) override {
    check_reduce_scatter(in, out);
    check_tensor("reduce_scatter", "in", in);
    check_tensor("reduce_scatter", "out", out);
    if (out.numel() == 0) return done_work();
    const auto [cs, nc] = enter("reduce_scatter", s);
    nccl_check(ncclReduceScatter(in.raw(), out.raw(), static_cast<size_t>(out.numel()),
                                 nccl_type(out.dtype()), nccl_op(op), nc, cs),
               nc, "reduce_scatter", name());
    return leave(s, {in, out});
  }

  WorkPtr all_gather(const Tensor& in, const Tensor& out, Stream s) override {
    check_all_gather(in, out);
    check_tensor("all_gather", "in", in);
    check_tensor("all_gather", "out", out);
    if (in.numel() == 0) return done_work();
    const auto [cs, nc] = enter("all_gather", s);
    // In place (in is out's rank-th block) is NCCL's own in-place case: no special path.
    nccl_check(ncclAllGather(in.raw(), out.raw(), static_cast<size_t>(in.numel()),
                             nccl_type(in.dtype()), nc, cs),
               nc, "all_gather", name());
    return leave(s, {in, out});
  }

  WorkPtr all_gather_v(const Tensor& in, const Tensor& out, const std::vector<int64_t>& counts,
                       Stream s) override {
    check_counts("all_gather_v", counts);
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    const int64_t mine = counts[static_cast<size_t>(rank())];
    BB_CHECK(rows_of(in) == mine && rows_of(out) == total && in.dtype() == out.dtype() &&
                 row_elems(in) == row_elems(out),
             "all_gather_v on group ", name(), ": in ", in.str(), " (", mine,
             " rows expected) and out ", out.str(), " (", total,
             " rows expected) do not match the counts");
    check_tensor("all_gather_v", "in", in);
    check_tensor("all_gather_v", "out", out);
    const int64_t width = row_elems(out);
    if (total == 0 || width == 0) return done_work();
    const auto [cs, nc] = enter("all_gather_v", s);
    // One broadcast per rank with rows, rooted there, into that rank's slice of out; the root
    // sends from `in` (NCCL copies it into its own slice, or not at all when in is that slice).
    // Counts are the same on every rank, so every rank skips the same empty ones.
    const ncclDataType_t type = nccl_type(out.dtype());
    nccl_check(ncclGroupStart(), nc, "all_gather_v (ncclGroupStart)", name());
    ncclResult_t r = ncclSuccess;
    int64_t off = 0;
    for (int p = 0; p < size() && r == ncclSuccess; ++p) {
      const int64_t c = counts[static_cast<size_t>(p)];
      if (c > 0) {
        void* dst = at_row(out, off);
        const void* src = p == rank() ? in.raw() : dst;  // only the root's send buffer is read
        r = ncclBroadcast(src, dst, static_cast<size_t>(c * width), type, p, nc, cs);
      }
      off += c;
    }
    const ncclResult_t end = ncclGroupEnd();  // closes the group even after a failed call
    nccl_check(r != ncclSuccess ? r : end, nc, "all_gather_v (ncclBroadcast)", name());
    return leave(s, {in, out});
  }

  WorkPtr all_to_all_v(const Tensor& in, const std::vector<int64_t>& sc, const Tensor& out,
                       const std::vector<int64_t>& rc, Stream s) override {
    check_counts("all_to_all_v", sc);
    check_counts("all_to_all_v", rc);
    int64_t ns = 0, nr = 0;
    for (int64_t c : sc) ns += c;
    for (int64_t c : rc) nr += c;
    BB_CHECK(rows_of(in) == ns && rows_of(out) == nr && in.dtype() == out.dtype() &&
                 row_elems(in) == row_elems(out),
             "all_to_all_v on group ", name(), ": in ", in.str(), " must have ", ns,
             " rows and out ", out.str(), " ", nr, " rows of the same width and dtype");
    const size_t me = static_cast<size_t>(rank());
    BB_CHECK(sc[me] == rc[me], "all_to_all_v on group ", name(), ": rank ", rank(), " sends ",
             sc[me], " rows to itself but expects ", rc[me]);
    check_tensor("all_to_all_v", "in", in);
    check_tensor("all_to_all_v", "out", out);
    const int64_t width = row_elems(in);
    if ((ns == 0 && nr == 0) || width == 0) return done_work();
    const auto [cs, nc] = enter("all_to_all_v", s);
    const ncclDataType_t type = nccl_type(in.dtype());
    int64_t os = 0, orr = 0;
    for (int p = 0; p < rank(); ++p) {
      os += sc[static_cast<size_t>(p)];
      orr += rc[static_cast<size_t>(p)];
    }
    // This rank's own rows: a device copy on the same stream, outside NCCL.
    if (sc[me] > 0) {
      BB_CHECK_CUDA(cudaMemcpyAsync(at_row(out, orr), at_row(in, os), row_offset(in, sc[me]),
                                    cudaMemcpyDeviceToDevice, cs));
    }
    // Counts match pairwise (what p sends me is what I expect from p), so both sides of every
    // pair skip the same empty transfers.
    nccl_check(ncclGroupStart(), nc, "all_to_all_v (ncclGroupStart)", name());
    ncclResult_t r = ncclSuccess;
    os = 0;
    orr = 0;
    for (int p = 0; p < size() && r == ncclSuccess; ++p) {
      const int64_t c_s = sc[static_cast<size_t>(p)], c_r = rc[static_cast<size_t>(p)];
      if (p != rank()) {
        if (c_s > 0)
          r = ncclSend(at_row(in, os), static_cast<size_t>(c_s * width), type, p, nc, cs);
        if (r == ncclSuccess && c_r > 0)
          r = ncclRecv(at_row(out, orr), static_cast<size_t>(c_r * width), type, p, nc, cs);
      }
      os += c_s;
      orr += c_r;
    }
    const ncclResult_t end = ncclGroupEnd();
    nccl_check(r != ncclSuccess ? r : end, nc, "all_to_all_v (ncclSend/ncclRecv)", name());
    return leave(s, {in, out});
  }

  WorkPtr send(const Tensor& t, int peer, Stream s) override {
    check_peer("send", peer);
    check_tensor("send", "t", t);
    if (t.numel() == 0) return done_work();
    const auto [cs, nc] = enter("send", s);
    nccl_check(
        ncclSend(t.raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), peer, nc, cs),
        nc, "send", name());
    return leave(s, {t});
  }

  WorkPtr recv(const Tensor& t, int peer, Stream s) override {
    check_peer("recv", peer);
    check_tensor("recv", "t", t);
    if (t.numel() == 0) return done_work();
    const auto [cs, nc] = enter("recv", s);
    nccl_check(
        ncclRecv(t.raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), peer, nc, cs),
        nc, "recv", name());
    return leave(s, {t});
  }

  WorkPtr broadcast(const Tensor& t, int root, Stream s) override {
    BB_CHECK(root >= 0 && root < size(), "broadcast on group ", name(), ": root ", root,
             " is not in [0, ", size(), ")");
    check_tensor("broadcast", "t", t);
    if (t.numel() == 0) return done_work();
    const auto [cs, nc] = enter("broadcast", s);
    nccl_check(ncclBroadcast(t.raw(), t.raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()),
                             root, nc, cs),
               nc, "broadcast", name());
    return leave(s, {t});
  }

  void barrier() override {
    check_device("barrier");
    const Device d = Device::cuda(dev_);
    Tensor one = Tensor::empty({1}, DType::i32, d, MemCategory::comm);  // the value is irrelevant
    const auto [cs, nc] = enter("barrier", Stream::comm);
    // "Every queued operation finished" (comm.h): the comm stream also waits for the streams
    // other than the caller's.
    for (int i = 0; i < kNumStreams; ++i) {
      const Stream other = static_cast<Stream>(i);
      if (other != Stream::comm && other != current_stream())
        Event::record(d, other).wait(Stream::comm);
    }
    nccl_check(ncclAllReduce(one.raw(), one.raw(), 1, ncclInt32, ncclSum, nc, cs), nc, "barrier", name());
    one.record_stream(Stream::comm);
    const uint64_t seq = seq_;
    const Event done = Event::record(d, Stream::comm);
    set_current_op(name().c_str(), "barrier", seq);  // the wait below is where a dead peer shows
    const double t0 = now_s();
    int sleep_us = 0;
    while (!done.done()) {
      // The barrier waits for every lane's operations: any communicator's error ends it.
      if (const std::string e = async_error(); !e.empty()) {
        abort_comm();  // frees the stuck kernels so that the process can exit
        abort_job(3, e + ". Aborting the job.");
      }
      if (now_s() - t0 > timeout()) {
        char msg[512];
        std::snprintf(msg, sizeof msg,
                      "communication timeout: barrier on group '%s' (%d ranks, operation #%llu) "
                      "did not finish within %.0f s; a peer rank is dead or hung. Aborting the job.",
                      name().c_str(), size(), static_cast<unsigned long long>(seq), timeout());
        abort_comm();
        abort_job(3, msg);
      }
      if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      sleep_us = std::min(1000, sleep_us == 0 ? 2 : sleep_us * 2);
    }
    cuda::note_host_sync();  // a deliberate host block, counted like Event::synchronize
    set_current_op("", "", 0);
  }

  // Host values go over the bootstrap MPI communicator (a single process: nothing to exchange).
  void all_reduce_host(double* v, int64_t n, ReduceOp op) override {
    if (mpi_ != MPI_COMM_NULL) mpi_host_all_reduce(mpi_, name(), size(), seq_, v, n, MPI_DOUBLE, op);
  }
  void all_reduce_host(int64_t* v, int64_t n, ReduceOp op) override {
    if (mpi_ != MPI_COMM_NULL) mpi_host_all_reduce(mpi_, name(), size(), seq_, v, n, MPI_INT64_T, op);
  }
  void broadcast_host(std::string& bytes, int root) override {
    BB_CHECK(root >= 0 && root < size(), "broadcast_host on group ", name(), ": root ", root,
             " is not in [0, ", size(), ")");
    if (mpi_ != MPI_COMM_NULL) mpi_host_broadcast(mpi_, name(), size(), seq_, bytes, root);
  }
  void all_to_all_host(const int64_t* send, int64_t* recv, int64_t n) override {
    if (mpi_ != MPI_COMM_NULL) {
      mpi_host_all_to_all(mpi_, name(), size(), seq_, send, recv, n);
    } else {  // a single process: its own values
      BB_CHECK(n >= 0, "all_to_all_host on group ", name(), ": negative count ", n);
      if (n > 0 && send != recv) std::copy(send, send + n, recv);
    }
  }

  void all_gather_host(const int64_t* mine, int64_t* all, int64_t n) override {
    if (mpi_ != MPI_COMM_NULL) {
      mpi_host_all_gather(mpi_, name(), size(), seq_, mine, all, n);
    } else {  // a single process: its own values
      BB_CHECK(n >= 0, "all_gather_host on group ", name(), ": negative count ", n);
      if (n > 0) std::copy(mine, mine + n, all);
    }
  }

  GroupPtr split(int color, int key, const std::string& n) override;

 private:
  // Forgets the communicator too: a static owner destroyed by exit() after abort_job must not
  // touch it again.
  void abort_comm() {
    std::lock_guard<std::mutex> lock(comms_mu_);
    for (ncclComm_t c : comms()) ncclCommAbort(c);
    nccl_ = nullptr;
    lanes_.fill(nullptr);
  }
  // Every distinct communicator of the group (its own first).
  std::vector<ncclComm_t> comms() const {
    std::vector<ncclComm_t> out;
    if (nccl_) out.push_back(nccl_);
    for (ncclComm_t c : lanes_)
      if (c && std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
    return out;
  }
  // The communicator of stream `s` (see the top of the file); a new one is a collective call
  // over the group, made with the job's deadline on the id exchange.
  ncclComm_t lane(Stream s) {
    ncclComm_t& l = lanes_[static_cast<size_t>(s)];
    if (l) return l;
    if (!own_taken_) {
      own_taken_ = true;
      return l = nccl_;
    }
    ncclUniqueId id{};
    if (rank() == 0) nccl_check(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId", name());
    if (mpi_ != MPI_COMM_NULL && size() > 1) {
      MPI_Request r;
      MPI_Ibcast(&id, static_cast<int>(sizeof id), MPI_BYTE, 0, mpi_, &r);
      mpi_timed_wait(&r, name(), size(), "nccl_init", 0);
    }
    ncclComm_t c = init_comm(size(), id, rank(), name() + " (" + stream_name(s) + " stream)");
    std::lock_guard<std::mutex> lock(comms_mu_);
    return l = c;
  }
  void check_device(const char* op) const {
    const int cur = cuda::current_device();
    BB_CHECK(cur == dev_, op, " on group ", name(), " (nccl): the current device is cuda:", cur,
             " but the group's communicator was made on cuda:", dev_);
  }
  void check_tensor(const char* op, const char* arg, const Tensor& t) const {
    check_device(op);
    BB_CHECK(t.defined(), op, " on group ", name(), " (nccl): ", arg, " is undefined");
    BB_CHECK(t.device() == Device::cuda(dev_), op, " on group ", name(), " (nccl): ", arg, " ",
             t.str(), " must be a CUDA tensor on the current device cuda:", dev_,
             " (CPU tensors need parallel.comm = 'mpi')");
  }
  void check_peer(const char* op, int peer) const {
    BB_CHECK(peer >= 0 && peer < size(), op, " on group ", name(), ": rank ", peer,
             " is not in [0, ", size(), ")");
    // A lone send (or recv) to oneself never matches: NCCL pairs them only inside one group call.
    BB_CHECK(peer != rank(), op, " on group ", name(), ": rank ", peer, " is this rank");
  }

  // Starts an operation: refuses a communicator NCCL has marked failed, orders stream `s` after
  // the caller's queued work and returns the CUDA stream to issue on.
  struct Issue {
    cudaStream_t cs;
    ncclComm_t nc;
  };
  Issue enter(const char* op, Stream s) {
    const uint64_t seq = ++seq_;
    op_ = op;
    set_current_op(name().c_str(), op, seq);
    ncclComm_t nc = lane(s);
    ncclResult_t async = ncclSuccess;
    nccl_check(ncclCommGetAsyncError(nc, &async), nc, "ncclCommGetAsyncError", name());
    if (async != ncclInProgress)
      nccl_check(async, nc, (std::string(op) + " (the communicator failed earlier)").c_str(), name());
    const Stream cur = current_stream();
    if (cur != s) Event::record(Device::cuda(dev_), cur).wait(s);
    return {cuda::stream_of(dev_, s), nc};
  }
  // Ends an operation issued on `s`: the tensors are marked as used there (their memory is not
  // reused before `s` passes this point) and the Work's event is recorded right after it.
  WorkPtr leave(Stream s, std::vector<Tensor> used) {
    for (const Tensor& t : used) t.record_stream(s);
    const Event done = Event::record(Device::cuda(dev_), s);
    // The watchdog gives it the job's deadline: Work::wait() is a stream wait and never does.
    watch(done, dev_, std::string(op_) + " on group '" + name() + "' (" + std::to_string(size()) + " ranks, " +
                    stream_name(s) + " stream, operation #" + std::to_string(seq_) + ")");
    auto w = std::make_shared<NcclWork>(done, std::move(used));
    set_current_op("", "", 0);
    return w;
  }
  // NCCL's asynchronous error of any communicator of the group ("" while none): the watchdog's
  // health check, polled from its thread (ncclCommGetAsyncError is safe there).
  std::string async_error() {
    std::lock_guard<std::mutex> lock(comms_mu_);
    for (ncclComm_t c : comms()) {
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(c, &async) != ncclSuccess) continue;
      if (async != ncclSuccess && async != ncclInProgress) {
        const char* last = ncclGetLastError(c);
        return std::string("NCCL error on group '") + name() + "' (" + std::to_string(size()) +
               " ranks, last operation: " + (op_ ? op_ : "none") + " #" + std::to_string(seq_) + "): " +
               ncclGetErrorString(async) + (last && *last ? std::string(" (") + last + ")" : std::string());
      }
    }
    return "";
  }

  MPI_Comm mpi_;  // the bootstrap communicator; MPI_COMM_NULL for a single process without MPI
  ncclComm_t nccl_;  // the group's own communicator: the lane of the first stream used
  std::array<ncclComm_t, kNumStreams> lanes_{};
  bool own_taken_ = false;
  std::mutex comms_mu_;        // the communicators, against the watchdog thread's reads
  const char* op_ = nullptr;   // the operation issued last
  int64_t health_ = 0;         // the watchdog's health check
  int dev_;  // the CUDA device the communicator was made on
  uint64_t seq_ = 0;
};

// A group over `mpi` (owned from now on; MPI_COMM_NULL: this process alone) on the current
// device: rank 0 makes the unique id, every rank gets it over MPI and joins.
GroupPtr make_nccl_group(MPI_Comm mpi, const std::string& name) {
  int rank = 0, size = 1;
  std::vector<int> wr{world().rank};
  ncclComm_t nc = nullptr;
  bool made = false;  // a failed init leaves `nc` unspecified
  try {
    if (mpi != MPI_COMM_NULL) {
      MPI_Comm_rank(mpi, &rank);
      MPI_Comm_size(mpi, &size);
      wr = mpi_world_ranks(mpi);
    }
    ncclUniqueId id{};
    if (rank == 0) nccl_check(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId", name);
    if (size > 1) {
      // Non-blocking with the job's deadline: a rank that died before this point shows up as a
      // timeout naming the group instead of a hang.
      MPI_Request r;
      MPI_Ibcast(&id, static_cast<int>(sizeof id), MPI_BYTE, 0, mpi, &r);
      mpi_timed_wait(&r, name, size, "nccl_init", 0);
    }
    const int dev = cuda::current_device();
    nc = init_comm(size, id, rank, name);
    made = true;
    return std::make_shared<NcclGroup>(mpi, nc, dev, name, rank, size, std::move(wr));
  } catch (...) {
    if (made) ncclCommDestroy(nc);
    if (mpi != MPI_COMM_NULL) MPI_Comm_free(&mpi);
    throw;
  }
}

GroupPtr NcclGroup::split(int color, int key, const std::string& n) {
  if (mpi_ == MPI_COMM_NULL) return make_nccl_group(MPI_COMM_NULL, n);  // a single process
  MPI_Comm c = MPI_COMM_NULL;
  MPI_Comm_split(mpi_, color, key, &c);
  BB_CHECK(c != MPI_COMM_NULL, "split of group ", name(), " into ", n, ": color ", color,
           " gives no group");
  return make_nccl_group(c, n);
}

}  // namespace

GroupPtr make_nccl_world() {
  const World& w = world();
  BB_CHECK(w.mpi || w.size == 1, "parallel.comm = 'nccl' with ", w.size,
           " ranks needs MPI (a launch by mpirun or srun) to exchange NCCL's unique id");
  BB_CHECK(cuda::device_count() > 0,
           "parallel.comm = 'nccl' needs a GPU: ", cuda::unavailable_reason());
  if (!w.mpi) return make_nccl_group(MPI_COMM_NULL, "world");
  MPI_Comm c;
  MPI_Comm_dup(MPI_COMM_WORLD, &c);
  return make_nccl_group(c, "world");
}

}  // namespace bb::comm
