// mpi_group.cpp — comm::Group over MPI (comm.h): CPU tensors in place, GPU tensors and
// reductions of 16-bit floats staged through host memory (f32 on the host for the arithmetic).
//
// Every operation is a non-blocking MPI call; Work::wait() polls it against the job's deadline,
// then copies staged results back. A Work destroyed without wait() waits in its destructor, so
// the result always lands. Sizes above 2^31 - 1 per call (rows for the row-counted operations,
// elements for reductions and all_gather) are refused with an error naming the limit (use nccl
// for such messages on GPUs).
#include "comm/mpi_group.h"

#include <chrono>
#include <climits>
#include <thread>

namespace bb::comm {

namespace {

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

MPI_Datatype base_type(DType dt) {
  switch (dt) {
    case DType::f32: return MPI_FLOAT;
    case DType::bf16:
    case DType::f16: return MPI_UINT16_T;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::i16: return MPI_INT16_T;
    case DType::u8:
    case DType::boolean: return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

// A tensor as MPI sees it: the user's tensor, or a host copy (GPU tensors; f32 for reductions of
// 16-bit floats) whose contents go back on completion when `back` is set.
struct Staged {
  Tensor user, host;
  bool back = false;
  void* ptr() const { return host.raw(); }
};

// A GPU tensor is read (copied to the host) and written back on the caller's current stream;
// the producer may have written it on another stream (a gradient rounded to bf16 on the reduce
// stream) and a consumer may read it on another: MPI takes no stream, so the copies are ordered
// after the work of every stream, and every stream after the copy back.
void order_after_all_streams(const Device& d) {
  if (!d.is_cuda()) return;
  for (int i = 0; i < kNumStreams; ++i) Event::record(d, static_cast<Stream>(i)).wait(current_stream());
}
void order_all_streams_after(const Device& d) {
  if (!d.is_cuda()) return;
  const Event e = Event::record(d, current_stream());
  for (int i = 0; i < kNumStreams; ++i) e.wait(static_cast<Stream>(i));
}

Staged stage(const Tensor& t, bool reduce, bool copy_in, bool copy_back) {
  Staged s;
  s.user = t;
  if (copy_in) order_after_all_streams(t.device());
  const bool narrow_float = t.dtype() == DType::bf16 || t.dtype() == DType::f16;
  if (t.device().is_cpu() && !(reduce && narrow_float)) {
    s.host = t;
    return s;
  }
  const DType hdt = reduce && narrow_float ? DType::f32 : t.dtype();
  if (copy_in) {
    // A host copy of a GPU tensor, or (reductions of 16-bit floats) an f32 copy of either.
    Tensor h = t.device().is_cpu() ? t : t.to(Device::cpu(), MemCategory::comm);
    s.host = h.dtype() == hdt ? h : h.to_dtype(hdt, MemCategory::comm);
  } else {
    s.host = Tensor::empty(t.shape(), hdt, Device::cpu(), MemCategory::comm);
  }
  s.back = copy_back;
  return s;
}

void unstage(Staged& s) {
  if (!s.back) return;
  Tensor u = s.user;
  if (s.host.dtype() != u.dtype()) u.copy_from(s.host.to_dtype(u.dtype(), MemCategory::comm).to(u.device()));
  else u.copy_from(s.host);
  order_all_streams_after(u.device());
}

class MpiWork final : public Work {
 public:
  MpiWork(std::string group, int size, const char* op, uint64_t seq)
      : group_(std::move(group)), size_(size), op_(op), seq_(seq) {}
  ~MpiWork() override { wait(); }
  void wait() override {
    if (finished_) return;
    finished_ = true;
    mpi_timed_wait(&req_, group_, size_, op_, seq_);
    for (Staged& s : staged_) unstage(s);
    staged_.clear();
    for (MPI_Datatype& t : types_) MPI_Type_free(&t);
    types_.clear();
  }
  MPI_Request req_ = MPI_REQUEST_NULL;
  std::vector<Staged> staged_;
  std::vector<MPI_Datatype> types_;
  std::vector<int> counts_a_, displs_a_, counts_b_, displs_b_;  // alive until completion

 private:
  std::string group_;
  int size_;
  const char* op_;
  uint64_t seq_;
  bool finished_ = false;
};

class MpiGroup final : public Group {
 public:
  MpiGroup(MPI_Comm comm, const std::string& name, int rank, int size, std::vector<int> wr)
      : Group(name, rank, size, std::move(wr)), comm_(comm) {}
  ~MpiGroup() override {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin && comm_ != MPI_COMM_WORLD) MPI_Comm_free(&comm_);
  }
  Backend backend() const override { return Backend::mpi; }
  MPI_Comm comm() const { return comm_; }

  WorkPtr all_reduce(const Tensor& t, ReduceOp op, Stream) override {
    auto w = start("all_reduce");
    Staged s = stage(t, true, true, true);
    const int n = mpi_count(t.numel(), "all_reduce", name());
    MPI_Iallreduce(MPI_IN_PLACE, s.ptr(), n, base_type(s.host.dtype()), mpi_reduce_op(op), comm_, &w->req_);
    w->staged_.push_back(std::move(s));
    return finish(w);
  }

  WorkPtr reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op, Stream) override {
    check_reduce_scatter(in, out);
    auto w = start("reduce_scatter");
    Staged si = stage(in, true, true, false), so = stage(out, true, false, true);
    const int n = mpi_count(out.numel(), "reduce_scatter", name());
    MPI_Ireduce_scatter_block(si.ptr(), so.ptr(), n, base_type(so.host.dtype()), mpi_reduce_op(op), comm_, &w->req_);
    w->staged_.push_back(std::move(si));
    w->staged_.push_back(std::move(so));
    return finish(w);
  }

  WorkPtr all_gather(const Tensor& in, const Tensor& out, Stream) override {
    check_all_gather(in, out);
    auto w = start("all_gather");
    const int n = mpi_count(in.numel(), "all_gather", name());
    const bool in_place = out.device() == in.device() &&
                          static_cast<const char*>(in.raw()) ==
                              static_cast<const char*>(out.raw()) + static_cast<size_t>(rank()) * in.nbytes();
    Staged so = stage(out, false, in_place, true);
    if (in_place) {
      MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, so.ptr(), n, base_type(in.dtype()), comm_, &w->req_);
    } else {
      Staged si = stage(in, false, true, false);
      MPI_Iallgather(si.ptr(), n, base_type(in.dtype()), so.ptr(), n, base_type(in.dtype()), comm_, &w->req_);
      w->staged_.push_back(std::move(si));
    }
    w->staged_.push_back(std::move(so));
    return finish(w);
  }

  WorkPtr all_gather_v(const Tensor& in, const Tensor& out, const std::vector<int64_t>& counts,
                       Stream) override {
    check_counts("all_gather_v", counts);
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    BB_CHECK(rows_of(in) == counts[static_cast<size_t>(rank())] && rows_of(out) == total &&
                 in.dtype() == out.dtype() && row_elems(in) == row_elems(out),
             "all_gather_v on group ", name(), ": in ", in.str(), " (", counts[static_cast<size_t>(rank())],
             " rows expected) and out ", out.str(), " (", total, " rows expected) do not match the counts");
    auto w = start("all_gather_v");
    MPI_Datatype row = row_type(in, *w);
    int64_t off = 0;
    for (int64_t c : counts) {
      w->counts_a_.push_back(mpi_count(c, "all_gather_v", name()));
      w->displs_a_.push_back(mpi_count(off, "all_gather_v", name()));
      off += c;
    }
    Staged si = stage(in, false, true, false), so = stage(out, false, false, true);
    MPI_Iallgatherv(si.ptr(), w->counts_a_[static_cast<size_t>(rank())], row, so.ptr(), w->counts_a_.data(),
                    w->displs_a_.data(), row, comm_, &w->req_);
    w->staged_.push_back(std::move(si));
    w->staged_.push_back(std::move(so));
    return finish(w);
  }

  WorkPtr all_to_all_v(const Tensor& in, const std::vector<int64_t>& sc, const Tensor& out,
                       const std::vector<int64_t>& rc, Stream) override {
    check_counts("all_to_all_v", sc);
    check_counts("all_to_all_v", rc);
    int64_t ns = 0, nr = 0;
    for (int64_t c : sc) ns += c;
    for (int64_t c : rc) nr += c;
    BB_CHECK(rows_of(in) == ns && rows_of(out) == nr && in.dtype() == out.dtype() &&
                 row_elems(in) == row_elems(out),
             "all_to_all_v on group ", name(), ": in ", in.str(), " must have ", ns, " rows and out ",
             out.str(), " ", nr, " rows of the same width and dtype");
    auto w = start("all_to_all_v");
    MPI_Datatype row = row_type(in, *w);
    int64_t os = 0, orr = 0;
    for (int p = 0; p < size(); ++p) {
      w->counts_a_.push_back(mpi_count(sc[static_cast<size_t>(p)], "all_to_all_v", name()));
      w->displs_a_.push_back(mpi_count(os, "all_to_all_v", name()));
      w->counts_b_.push_back(mpi_count(rc[static_cast<size_t>(p)], "all_to_all_v", name()));
      w->displs_b_.push_back(mpi_count(orr, "all_to_all_v", name()));
      os += sc[static_cast<size_t>(p)];
      orr += rc[static_cast<size_t>(p)];
    }
    Staged si = stage(in, false, true, false), so = stage(out, false, false, true);
    MPI_Ialltoallv(si.ptr(), w->counts_a_.data(), w->displs_a_.data(), row, so.ptr(), w->counts_b_.data(),
                   w->displs_b_.data(), row, comm_, &w->req_);
    w->staged_.push_back(std::move(si));
    w->staged_.push_back(std::move(so));
    return finish(w);
  }

  WorkPtr send(const Tensor& t, int peer, Stream) override {
    check_peer("send", peer);
    auto w = start("send");
    MPI_Datatype row = row_type(t, *w);
    Staged s = stage(t, false, true, false);
    MPI_Isend(s.ptr(), mpi_count(rows_of(t), "send", name()), row, peer, 0, comm_, &w->req_);
    w->staged_.push_back(std::move(s));
    return finish(w);
  }

  WorkPtr recv(const Tensor& t, int peer, Stream) override {
    check_peer("recv", peer);
    auto w = start("recv");
    MPI_Datatype row = row_type(t, *w);
    Staged s = stage(t, false, false, true);
    MPI_Irecv(s.ptr(), mpi_count(rows_of(t), "recv", name()), row, peer, 0, comm_, &w->req_);
    w->staged_.push_back(std::move(s));
    return finish(w);
  }

  WorkPtr broadcast(const Tensor& t, int root, Stream) override {
    check_peer("broadcast", root);
    auto w = start("broadcast");
    MPI_Datatype row = row_type(t, *w);
    Staged s = stage(t, false, rank() == root, rank() != root);
    MPI_Ibcast(s.ptr(), mpi_count(rows_of(t), "broadcast", name()), row, root, comm_, &w->req_);
    w->staged_.push_back(std::move(s));
    return finish(w);
  }

  void barrier() override {
    MPI_Request r;
    const uint64_t seq = ++seq_;
    set_current_op(name().c_str(), "barrier", seq);
    MPI_Ibarrier(comm_, &r);
    mpi_timed_wait(&r, name(), size(), "barrier", seq);
  }

  void all_reduce_host(double* v, int64_t n, ReduceOp op) override {
    mpi_host_all_reduce(comm_, name(), size(), seq_, v, n, MPI_DOUBLE, op);
  }
  void all_reduce_host(int64_t* v, int64_t n, ReduceOp op) override {
    mpi_host_all_reduce(comm_, name(), size(), seq_, v, n, MPI_INT64_T, op);
  }
  void broadcast_host(std::string& bytes, int root) override {
    check_peer("broadcast_host", root);
    mpi_host_broadcast(comm_, name(), size(), seq_, bytes, root);
  }
  void all_to_all_host(const int64_t* send, int64_t* recv, int64_t n) override {
    mpi_host_all_to_all(comm_, name(), size(), seq_, send, recv, n);
  }
  void all_gather_host(const int64_t* mine, int64_t* all, int64_t n) override {
    mpi_host_all_gather(comm_, name(), size(), seq_, mine, all, n);
  }

  GroupPtr split(int color, int key, const std::string& n) override {
    MPI_Comm c;
    MPI_Comm_split(comm_, color, key, &c);
    return make_mpi_group(c, n);
  }

 private:
  std::shared_ptr<MpiWork> start(const char* op) {
    const uint64_t seq = ++seq_;
    set_current_op(name().c_str(), op, seq);
    return std::make_shared<MpiWork>(name(), size(), op, seq);
  }
  WorkPtr finish(const std::shared_ptr<MpiWork>& w) {
    set_current_op("", "", 0);
    return w;
  }
  MPI_Datatype row_type(const Tensor& t, MpiWork& w) {
    MPI_Datatype row;
    MPI_Type_contiguous(mpi_count(std::max<int64_t>(1, row_elems(t)), "row", name()), base_type(t.dtype()), &row);
    MPI_Type_commit(&row);
    w.types_.push_back(row);
    return row;
  }
  void check_peer(const char* op, int peer) const {
    BB_CHECK(peer >= 0 && peer < size(), op, " on group ", name(), ": rank ", peer, " is not in [0, ",
             size(), ")");
  }
  MPI_Comm comm_;
  uint64_t seq_ = 0;
};

}  // namespace

void mpi_timed_wait(MPI_Request* req, const std::string& group, int group_size, const char* op,
                    uint64_t seq) {
  set_current_op(group.c_str(), op, seq);
  int flag = 0;
  MPI_Test(req, &flag, MPI_STATUS_IGNORE);
  // Poll without sleeping: MPI moves large messages only while it is being called (every
  // fragment of a rendezvous transfer needs a progress call), so a sleep between tests would
  // stretch a 2 GB all-reduce to minutes. Yielding keeps oversubscribed ranks (CI: 4 ranks on 2
  // cores) from starving the ones still computing.
  const double t0 = now_s();
  uint64_t polls = 0;
  while (!flag) {
    if ((++polls & 1023) == 0 && now_s() - t0 > timeout()) {
      char msg[512];
      std::snprintf(msg, sizeof msg,
                    "communication timeout: %s on group '%s' (%d ranks, operation #%llu) did not finish "
                    "within %.0f s; a peer rank is dead or hung. Aborting the job.",
                    op, group.c_str(), group_size, static_cast<unsigned long long>(seq), timeout());
      abort_job(3, msg);
    }
    std::this_thread::yield();
    MPI_Test(req, &flag, MPI_STATUS_IGNORE);
  }
  set_current_op("", "", 0);
}

MPI_Op mpi_reduce_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return MPI_SUM;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::min: return MPI_MIN;
  }
  return MPI_SUM;
}

int mpi_count(int64_t v, const char* op, const std::string& group) {
  BB_CHECK(v >= 0 && v <= INT_MAX, op, " on group ", group, ": ", v,
           " exceeds the mpi backend's limit of 2^31 - 1 per call (rows, or elements for reductions); "
           "use parallel.comm = 'nccl' on GPUs or smaller units");
  return static_cast<int>(v);
}

std::vector<int> mpi_world_ranks(MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  MPI_Group g, wg;
  MPI_Comm_group(comm, &g);
  MPI_Comm_group(MPI_COMM_WORLD, &wg);
  std::vector<int> mine(static_cast<size_t>(size)), wr(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) mine[static_cast<size_t>(i)] = i;
  MPI_Group_translate_ranks(g, size, mine.data(), wg, wr.data());
  MPI_Group_free(&g);
  MPI_Group_free(&wg);
  return wr;
}

void mpi_host_all_reduce(MPI_Comm comm, const std::string& group, int size, uint64_t& seq, void* v, int64_t n,
                         MPI_Datatype type, ReduceOp op) {
  const uint64_t s = ++seq;
  set_current_op(group.c_str(), "all_reduce_host", s);
  MPI_Request r;
  MPI_Iallreduce(MPI_IN_PLACE, v, mpi_count(n, "all_reduce_host", group), type, mpi_reduce_op(op), comm, &r);
  mpi_timed_wait(&r, group, size, "all_reduce_host", s);
}

void mpi_host_broadcast(MPI_Comm comm, const std::string& group, int size, uint64_t& seq, std::string& bytes,
                        int root) {
  auto bcast = [&](void* v, int64_t n, MPI_Datatype type) {
    const uint64_t s = ++seq;
    set_current_op(group.c_str(), "broadcast_host", s);
    MPI_Request r;
    MPI_Ibcast(v, mpi_count(n, "broadcast_host", group), type, root, comm, &r);
    mpi_timed_wait(&r, group, size, "broadcast_host", s);
  };
  int64_t n = static_cast<int64_t>(bytes.size());
  bcast(&n, 1, MPI_INT64_T);
  bytes.resize(static_cast<size_t>(n));
  bcast(bytes.data(), n, MPI_CHAR);
}

namespace {
// n int64 values per rank to or from every member through `exchange` (MPI_Ialltoall or
// MPI_Iallgather: the same arguments), with the job's deadline.
using HostExchange = int (*)(const void*, int, MPI_Datatype, void*, int, MPI_Datatype, MPI_Comm, MPI_Request*);
void host_exchange(HostExchange exchange, const char* op, MPI_Comm comm, const std::string& group, int size,
                   uint64_t& seq, const int64_t* send, int64_t* recv, int64_t n) {
  BB_CHECK(n >= 0, op, " on group ", group, ": negative count ", n);
  if (n == 0) return;  // every rank passes the same n
  BB_CHECK(send != recv, op, " on group ", group, ": the two buffers must not be the same");
  const uint64_t s = ++seq;
  set_current_op(group.c_str(), op, s);
  MPI_Request r;
  const int c = mpi_count(n, op, group);
  exchange(send, c, MPI_INT64_T, recv, c, MPI_INT64_T, comm, &r);
  mpi_timed_wait(&r, group, size, op, s);
}
}  // namespace

void mpi_host_all_to_all(MPI_Comm comm, const std::string& group, int size, uint64_t& seq, const int64_t* send,
                         int64_t* recv, int64_t n) {
  host_exchange(MPI_Ialltoall, "all_to_all_host", comm, group, size, seq, send, recv, n);
}

void mpi_host_all_gather(MPI_Comm comm, const std::string& group, int size, uint64_t& seq, const int64_t* mine,
                         int64_t* all, int64_t n) {
  host_exchange(MPI_Iallgather, "all_gather_host", comm, group, size, seq, mine, all, n);
}

GroupPtr make_mpi_group(MPI_Comm comm, const std::string& name) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  return std::make_shared<MpiGroup>(comm, name, rank, size, mpi_world_ranks(comm));
}

MPI_Comm dup_mpi_comm(const Group& g) {
  const auto* m = dynamic_cast<const MpiGroup*>(&g);
  BB_CHECK(m, "group ", g.name(), " is not an mpi group (", backend_name(g.backend()), ")");
  MPI_Comm c;
  MPI_Comm_dup(m->comm(), &c);
  return c;
}

GroupPtr make_mpi_world() {
  MPI_Comm c;
  MPI_Comm_dup(MPI_COMM_WORLD, &c);
  return make_mpi_group(c, "world");
}

}  // namespace bb::comm
