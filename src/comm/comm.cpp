// comm.cpp — the process world, timeouts, the self group and the checks every group shares.
#include "comm/comm.h"

#include <mpi.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

namespace bb::comm {

GroupPtr make_mpi_world();   // comm/mpi_group.cpp
GroupPtr make_nccl_world();  // comm/nccl_group_cuda.cpp (CUDA builds)

namespace {

World g_world;
bool g_inited = false;
double g_timeout_s = 50.0;
char g_op[256] = "";  // read by the signal handler: plain bytes, written only by the main thread

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return end && *end == '\0' ? static_cast<int>(x) : fallback;
}

volatile std::sig_atomic_t g_stop_signal = 0;  // the first SIGTERM / SIGINT received, 0: none
volatile std::sig_atomic_t g_graceful = 0;     // catch_stop_signals() was called

// SIGTERM / SIGINT. After catch_stop_signals(): the first asks the run to stop after its current
// step (the trainer saves a checkpoint then: comm.h stop_signal), a second one ends the process
// at once. Otherwise (a job of several ranks) the process ends at once. Under a launcher the
// signal may also be the launcher ending the job because a peer failed (it kills what is left
// shortly after); the message says what the rank was in.
void on_terminate(int sig) {
  // Async-signal-safe: write(2) of prepared bytes only.
  char buf[640];
  int n = 0;
  auto put = [&](const char* s) {
    while (*s && n < static_cast<int>(sizeof buf) - 1) buf[n++] = *s++;
  };
  char num[16];
  int r = g_world.rank, k = 0;
  char tmp[16];
  do { tmp[k++] = static_cast<char>('0' + r % 10); r /= 10; } while (r > 0 && k < 15);
  for (int i = 0; i < k; ++i) num[i] = tmp[k - 1 - i];
  num[k] = '\0';
  // Recorded first: the handler runs with both signals blocked (install_handler), so a second
  // one is delivered after this one returned and finds it set.
  const bool second = g_stop_signal != 0 || !g_graceful;
  if (g_stop_signal == 0) g_stop_signal = sig;
  put("bumblebee: ");
  if (g_world.size > 1) {
    put("[rank ");
    put(num);
    put("] ");
  }
  put(sig == SIGINT ? "received SIGINT" : "received SIGTERM");
  if (g_op[0]) {
    put(" while in ");
    put(g_op);
  }
  if (!g_graceful) {
    put(" (a peer rank may have failed, or the job is being stopped): stopping now\n");
  } else if (second) {
    put(": a second signal, stopping now (the last checkpoint stays)\n");
  } else {
    put(": stopping after the current step and saving a checkpoint (when checkpoint.dir is set); a second "
        "signal stops at once");
    if (g_world.size > 1) put(" (under a launcher: a peer rank may have failed, or the job is being stopped)");
    put("\n");
  }
  ssize_t ignored = ::write(2, buf, static_cast<size_t>(n));
  (void)ignored;
  if (second) ::_exit(128 + sig);
}

// SIGTERM and SIGINT to on_terminate, each blocking both while it runs.
void install_handler() {
  struct sigaction sa {};
  sa.sa_handler = on_terminate;
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGTERM);
  sigaddset(&sa.sa_mask, SIGINT);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

class SelfGroup final : public Group {
 public:
  explicit SelfGroup(const std::string& name) : Group(name, 0, 1, {g_world.rank}) {}
  Backend backend() const override { return Backend::self; }
  WorkPtr all_reduce(const Tensor&, ReduceOp, Stream) override { return done_work(); }
  WorkPtr reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp, Stream) override {
    check_reduce_scatter(in, out);
    Tensor o = out;
    o.copy_from(in);
    return done_work();
  }
  WorkPtr all_gather(const Tensor& in, const Tensor& out, Stream) override {
    check_all_gather(in, out);
    if (in.raw() != out.raw()) {
      Tensor o = out;
      o.copy_from(in);
    }
    return done_work();
  }
  WorkPtr all_gather_v(const Tensor& in, const Tensor& out, const std::vector<int64_t>& counts,
                       Stream s) override {
    check_counts("all_gather_v", counts);
    BB_CHECK(rows_of(in) == counts[0] && rows_of(out) == counts[0], "all_gather_v on group ", name(),
             ": in has ", rows_of(in), " rows and out ", rows_of(out), ", counts say ", counts[0]);
    return all_gather(in, out, s);
  }
  WorkPtr all_to_all_v(const Tensor& in, const std::vector<int64_t>& sc, const Tensor& out,
                       const std::vector<int64_t>& rc, Stream) override {
    check_counts("all_to_all_v", sc);
    check_counts("all_to_all_v", rc);
    BB_CHECK(sc[0] == rc[0] && rows_of(in) == sc[0] && rows_of(out) == rc[0], "all_to_all_v on group ",
             name(), ": one rank sends ", sc[0], " rows and receives ", rc[0], " (in ", rows_of(in),
             ", out ", rows_of(out), " rows)");
    Tensor o = out;
    if (in.numel() > 0) o.copy_from(in);
    return done_work();
  }
  WorkPtr send(const Tensor&, int peer, Stream) override {
    BB_FAIL("send on group ", name(), " of one rank: there is no peer ", peer);
  }
  WorkPtr recv(const Tensor&, int peer, Stream) override {
    BB_FAIL("recv on group ", name(), " of one rank: there is no peer ", peer);
  }
  WorkPtr broadcast(const Tensor&, int root, Stream) override {
    BB_CHECK(root == 0, "broadcast on group ", name(), ": root ", root, " is not a member");
    return done_work();
  }
  void barrier() override {}
  void all_reduce_host(double*, int64_t, ReduceOp) override {}
  void all_reduce_host(int64_t*, int64_t, ReduceOp) override {}
  void broadcast_host(std::string&, int) override {}
  void all_to_all_host(const int64_t* send, int64_t* recv, int64_t n) override {
    BB_CHECK(n >= 0, "all_to_all_host on group ", name(), ": negative count ", n);
    if (n > 0 && send != recv) std::memmove(recv, send, static_cast<size_t>(n) * sizeof(int64_t));
  }
  void all_gather_host(const int64_t* mine, int64_t* all, int64_t n) override {
    BB_CHECK(n >= 0, "all_gather_host on group ", name(), ": negative count ", n);
    if (n > 0) std::memmove(all, mine, static_cast<size_t>(n) * sizeof(int64_t));
  }
  GroupPtr split(int, int, const std::string& n) override { return std::make_shared<SelfGroup>(n); }
};

class DoneWork final : public Work {
 public:
  void wait() override {}
};

}  // namespace

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::self: return "self";
    case Backend::mpi: return "mpi";
    case Backend::nccl: return "nccl";
    case Backend::emulated: return "emulated";
  }
  return "?";
}

void init(int* argc, char*** argv) {
  if (g_inited) return;
  g_inited = true;
  std::string launcher = "none";
  if (std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK"))
    launcher = "mpirun";
  if (std::getenv("SLURM_STEP_ID") && std::getenv("SLURM_PROCID")) launcher = "srun";
  g_world.launcher = launcher;
  if (launcher == "none") return;  // a world of one, no MPI
  int provided = 0;
  if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
    std::fprintf(stderr, "bumblebee: MPI_Init failed (launcher %s)\n", launcher.c_str());
    std::exit(2);
  }
  g_world.mpi = true;
  MPI_Comm_rank(MPI_COMM_WORLD, &g_world.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_world.size);
  // A launcher that started N tasks whose MPI cannot see them (srun without PMI support) would
  // train N independent copies: refuse instead.
  const int expected = launcher == "srun" ? env_int("SLURM_STEP_NUM_TASKS", env_int("SLURM_NTASKS", g_world.size))
                                          : env_int("OMPI_COMM_WORLD_SIZE", env_int("PMI_SIZE", g_world.size));
  if (expected != g_world.size) {
    std::fprintf(stderr,
                 "bumblebee: the launcher (%s) started %d processes but MPI sees a world of %d; "
                 "under SLURM use srun --mpi=pmix (or pmi2), or launch with mpirun\n",
                 launcher.c_str(), expected, g_world.size);
    MPI_Finalize();
    std::exit(2);
  }
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g_world.rank, MPI_INFO_NULL, &local);
  MPI_Comm_rank(local, &g_world.local_rank);
  MPI_Comm_size(local, &g_world.local_size);
  MPI_Comm_free(&local);
  if (g_world.size > 1) install_handler();  // the job ends at once, with a line naming what this rank was in
  // The launcher's own idea of the local rank wins where it has one (srun's task placement).
  g_world.local_rank = env_int("SLURM_LOCALID", env_int("OMPI_COMM_WORLD_LOCAL_RANK", g_world.local_rank));
  // NVLink multicast (NVLS) stays off unless the user asked for it explicitly.
  ::setenv("NCCL_NVLS_ENABLE", "0", 0);
}

void finalize() {
  if (g_world.mpi) {
    int done = 0;
    MPI_Finalized(&done);
    if (!done) MPI_Finalize();
    g_world.mpi = false;
  }
}

const World& world() { return g_world; }

void abort_job(int code, const std::string& msg) {
  std::fprintf(stderr, "bumblebee: [rank %d] %s\n", g_world.rank, msg.c_str());
  std::fflush(stderr);
  if (g_world.mpi && g_world.size > 1) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

void set_timeout(double seconds) {
  BB_CHECK(seconds > 0, "communication timeout must be > 0 seconds, got ", seconds);
  g_timeout_s = seconds;
}
double timeout() { return g_timeout_s; }

void catch_stop_signals() {
  g_graceful = 1;
  install_handler();
}

int stop_signal() { return static_cast<int>(g_stop_signal); }

void set_current_op(const char* group, const char* op, uint64_t seq) {
  if (!op || !*op) {
    g_op[0] = '\0';
    return;
  }
  std::snprintf(g_op, sizeof g_op, "%s on group '%s' (operation #%llu)", op, group,
                static_cast<unsigned long long>(seq));
}

WorkPtr done_work() {
  static WorkPtr w = std::make_shared<DoneWork>();
  return w;
}

int64_t rows_of(const Tensor& t) { return t.dim() == 0 ? 1 : t.size(0); }
int64_t row_elems(const Tensor& t) {
  const int64_t r = rows_of(t);
  return r == 0 ? shape_numel(Shape(t.shape().begin() + (t.dim() > 0 ? 1 : 0), t.shape().end()))
                : t.numel() / r;
}

void Group::check_reduce_scatter(const Tensor& in, const Tensor& out) const {
  BB_CHECK(in.defined() && out.defined() && in.dtype() == out.dtype() && in.device() == out.device(),
           "reduce_scatter on group ", name_, ": in ", in.str(), " and out ", out.str(),
           " must be defined, of one dtype, on one device");
  BB_CHECK(in.numel() == out.numel() * size_, "reduce_scatter on group ", name_, " (", size_,
           " ranks): in has ", in.numel(), " elements, out ", out.numel(), "; in must have size x out");
}

void Group::check_all_gather(const Tensor& in, const Tensor& out) const {
  BB_CHECK(in.defined() && out.defined() && in.dtype() == out.dtype() && in.device() == out.device(),
           "all_gather on group ", name_, ": in ", in.str(), " and out ", out.str(),
           " must be defined, of one dtype, on one device");
  BB_CHECK(out.numel() == in.numel() * size_, "all_gather on group ", name_, " (", size_,
           " ranks): in has ", in.numel(), " elements, out ", out.numel(), "; out must have size x in");
}

void Group::check_counts(const char* op, const std::vector<int64_t>& counts) const {
  BB_CHECK(static_cast<int>(counts.size()) == size_, op, " on group ", name_, ": ", counts.size(),
           " counts for ", size_, " ranks");
  for (int64_t c : counts) BB_CHECK(c >= 0, op, " on group ", name_, ": negative count ", c);
}

GroupPtr self_group(const std::string& name) { return std::make_shared<SelfGroup>(name); }

GroupPtr world_group(Backend b) {
  switch (b) {
    case Backend::self:
      BB_CHECK(g_world.size == 1, "the self communicator is a world of one, but ", g_world.size,
               " ranks were launched");
      return self_group("world");
    case Backend::mpi:
      BB_CHECK(g_world.mpi, "the mpi communicator needs a launch by mpirun or srun");
      return make_mpi_world();
    case Backend::nccl:
      return make_nccl_world();
    case Backend::emulated:
      BB_FAIL("the emulated world needs its [emulate] settings: comm::make_emulated_world");
  }
  BB_FAIL("unknown backend");
}

#ifndef BB_WITH_CUDA
GroupPtr make_nccl_world() {
  BB_FAIL("parallel.comm = 'nccl' needs a CUDA build (this one is CPU only); use 'mpi'");
}
#endif

}  // namespace bb::comm
