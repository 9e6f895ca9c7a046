// comm.h — the communication interface (DESIGN.md sec. 4): the process world, groups of ranks
// and the collectives every multi-rank path goes through.
//
// A Group is a communicator over some ranks. Its operations take tensors on one device and are
// issued in stream order: on a GPU an operation runs on stream `s` (by default Stream::comm)
// after the work the caller's current stream has queued so far, and the returned Work's wait()
// makes the caller's current stream wait for it (the host does not block). On the CPU, and for
// GPU tensors staged through host memory, wait() blocks the host until the operation is done.
// A Work that is dropped without wait() still completes; a tensor given to an operation must
// stay alive until then (the Work holds a reference to every tensor it uses).
//
// Implementations (comm/mpi_group.cpp, comm/nccl_group_cuda.cpp):
//   self  one rank: every operation is a copy or nothing (single-process runs need no launcher)
//   mpi   CPU tensors directly; GPU tensors staged through host memory, so several processes can
//         share one GPU and run every GPU path of the distributed layer (NCCL refuses that)
//   nccl  GPU tensors on distinct GPUs; all-to-all-v as grouped send/recv, uneven all-gather as
//         grouped broadcasts
//   emulated  one process plays one rank of an N-rank job on one GPU: real streams, bytes and
//         memory, modelled wire time (comm/emulated.h); a timing and memory tool
//
// Timeouts (set_timeout, default 50 s): every wait of the mpi backend, and on nccl the barrier,
// the host operations and the trainer's end-of-step wait for the GPU, have a deadline. A wait
// that expires prints which operation on which group and rank did not finish and aborts the
// whole job, so a dead or hung rank makes every other rank exit non-zero instead of hanging.
// (A Work's wait() on nccl is a stream wait: it cannot expire; the end-of-step wait catches it.)
//
// Sizes: reduce_scatter's input is [size * n, ...] and its output [n, ...]; all_gather the
// reverse; the *_v operations count rows of the leading dimension per peer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/stream.h"
#include "core/tensor.h"

namespace bb::comm {

enum class ReduceOp : uint8_t { sum, max, min };
enum class Backend : uint8_t { self, mpi, nccl, emulated };
const char* backend_name(Backend b);

// How this process was started and where it sits.
struct World {
  int rank = 0, size = 1;              // in the job
  int local_rank = 0, local_size = 1;  // among the processes of this host
  std::string launcher = "none";       // none | mpirun | srun
  bool mpi = false;                    // MPI is initialised
};

// Reads the launcher's environment (Open MPI, PMIx, SLURM) and initialises MPI when the process
// was started by a launcher; a plain start is a world of one and needs no MPI. Call once, first.
void init(int* argc, char*** argv);
// Finalises MPI if init started it. Idempotent.
void finalize();
const World& world();
// Ends the whole job now: prints `msg` (prefixed with the rank) to stderr and, under a launcher,
// aborts every rank; exit status `code`.
[[noreturn]] void abort_job(int code, const std::string& msg);

// Deadline of every wait, in seconds (> 0).
void set_timeout(double seconds);
double timeout();

// Which operation this process is in (for the messages of timeouts and of termination by the
// launcher when a peer died). Set by the implementations; "" outside any.
void set_current_op(const char* group, const char* op, uint64_t seq);

// SIGTERM / SIGINT. init() makes a job of several ranks end at once on either, with a line
// naming the operation the rank was in (exit status 128 + signal). After catch_stop_signals()
// (the train command) the first one only records itself, with such a line, so that the run can
// stop after its current step and save a checkpoint (the trainer agrees on it over all ranks);
// a second one ends the process at once. stop_signal(): the first one recorded, 0 if none.
void catch_stop_signals();
int stop_signal();

class Work {
 public:
  virtual ~Work() = default;
  // Orders the caller after the operation (see the file comment).
  virtual void wait() = 0;
};
using WorkPtr = std::shared_ptr<Work>;
// A Work that is already complete.
WorkPtr done_work();

class Group {
 public:
  Group(std::string name, int rank, int size, std::vector<int> world_ranks)
      : name_(std::move(name)), rank_(rank), size_(size), world_ranks_(std::move(world_ranks)) {}
  virtual ~Group() = default;
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  // The world rank of each member, in group order.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  virtual Backend backend() const = 0;

  // t = op over ranks of t (in place).
  virtual WorkPtr all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum, Stream s = Stream::comm) = 0;
  // out = op over ranks of the rank-th of `size` equal blocks of in. in and out must not overlap.
  virtual WorkPtr reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op = ReduceOp::sum,
                                 Stream s = Stream::comm) = 0;
  // out = concatenation over ranks of in (in may be out's own rank-th block: in place).
  virtual WorkPtr all_gather(const Tensor& in, const Tensor& out, Stream s = Stream::comm) = 0;
  // Uneven: in has counts[rank] rows, out sum(counts) rows, rank r's rows at sum(counts[<r]).
  virtual WorkPtr all_gather_v(const Tensor& in, const Tensor& out, const std::vector<int64_t>& counts,
                               Stream s = Stream::comm) = 0;
  // in: send_counts[p] rows for each peer p, in peer order; out: recv_counts[p] rows from each.
  virtual WorkPtr all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_counts, const Tensor& out,
                               const std::vector<int64_t>& recv_counts, Stream s = Stream::comm) = 0;
  virtual WorkPtr send(const Tensor& t, int peer, Stream s = Stream::comm) = 0;
  virtual WorkPtr recv(const Tensor& t, int peer, Stream s = Stream::comm) = 0;
  virtual WorkPtr broadcast(const Tensor& t, int root, Stream s = Stream::comm) = 0;
  // Blocks the host until every rank arrived (nccl: and every operation queued on the group's
  // stream finished; mpi: Works not yet waited for are not part of it).
  virtual void barrier() = 0;

  // Control values on the host (token counts, losses, norms, memory peaks); blocking.
  virtual void all_reduce_host(double* v, int64_t n, ReduceOp op) = 0;
  virtual void all_reduce_host(int64_t* v, int64_t n, ReduceOp op) = 0;
  // Replaces `bytes` on every rank by root's.
  virtual void broadcast_host(std::string& bytes, int root) = 0;
  // send holds n values for each peer in peer order ([size x n]); recv receives n from each
  // peer in peer order ([size x n]). The MoE dispatcher's per-expert counts.
  virtual void all_to_all_host(const int64_t* send, int64_t* recv, int64_t n) = 0;
  // all [size x n] receives every member's n values of `mine`, in rank order (this rank's at
  // rank() x n). `mine` and `all` must not overlap.
  virtual void all_gather_host(const int64_t* mine, int64_t* all, int64_t n) = 0;
  double sum(double v) { all_reduce_host(&v, 1, ReduceOp::sum); return v; }
  int64_t sum(int64_t v) { all_reduce_host(&v, 1, ReduceOp::sum); return v; }
  int64_t max(int64_t v) { all_reduce_host(&v, 1, ReduceOp::max); return v; }

  // A group of the members with the same `color`, ordered by `key` (ties by rank). Collective
  // over this group: every member calls it with the same name.
  virtual std::shared_ptr<Group> split(int color, int key, const std::string& name) = 0;
  // split() for a caller that knows every member's color and key ([size] each, the same on every
  // member; the mesh computes them from the layout). The emulated backend, whose peers do not
  // exist to tell theirs, needs them; the others read their own and split as above.
  virtual std::shared_ptr<Group> split_known(const std::vector<int>& colors, const std::vector<int>& keys,
                                             const std::string& name) {
    BB_CHECK(static_cast<int>(colors.size()) == size_ && static_cast<int>(keys.size()) == size_, "split_known of group ",
             name_, " into '", name, "': ", colors.size(), " colors and ", keys.size(), " keys for ", size_, " ranks");
    return split(colors[static_cast<size_t>(rank_)], keys[static_cast<size_t>(rank_)], name);
  }

 protected:
  // Checks shared by the implementations (name the op and the argument on mismatch).
  void check_reduce_scatter(const Tensor& in, const Tensor& out) const;
  void check_all_gather(const Tensor& in, const Tensor& out) const;
  void check_counts(const char* op, const std::vector<int64_t>& counts) const;

 private:
  std::string name_;
  int rank_, size_;
  std::vector<int> world_ranks_;
};
using GroupPtr = std::shared_ptr<Group>;

// A group of one (this process).
GroupPtr self_group(const std::string& name = "self");
// Every rank of the job over `b`: mpi needs init() under a launcher; nccl needs a CUDA build and
// this process's GPU selected; self is the world of a single process. (emulated: its world
// comes from make_emulated_world, comm/emulated.h.)
GroupPtr world_group(Backend b);

// Rows of the leading dimension (1 for a 0-d tensor) and elements per row.
int64_t rows_of(const Tensor& t);
int64_t row_elems(const Tensor& t);

}  // namespace bb::comm
