// bench_moe_layer — one sparse MoE layer (MoeBlock: norm, router, permute, dispatcher, grouped
// experts, the shared expert when the shape has one) forward and backward over the MPI world as
// the expert-parallel group (EP = world size), for `alltoall` against `chunked_alltoall:N`: how
// much of the dispatch / combine communication chunking hides behind the expert GEMMs
// (skills/bench-moe-layer.md).
//
//   mpirun -np P bench_moe_layer [--shape qwen3.5|qwen3|both] [--tokens 16384,32768,65536]
//                                [--chunks 2,3,4] [--steps 5] [--warmup 2] [--device cpu|cuda]
//                                [--experts grouped|sequential] [--permute standard|memory_efficient]
//                                [--dtype auto|f32|bf16] [--small]
//   Shapes: qwen3.5 = Qwen3.5-35B-A3B's MoE layer (H 2048, 256 experts top-8, F 512, shared
//   expert 512, zero-centred norm); qwen3 = Qwen3-30B-A3B's (H 2048, 128 experts top-8, F 768,
//   no shared expert). --small: H 64, 16 experts top-8, F 32 / 48, shared 32 (CPU smoke runs).
//   Tokens are per rank; each rank routes its own random tokens with the block's router.
//
// Device and communication, as the trainer chooses them: --device cuda puts rank r on GPU
// (local rank % GPUs) and uses nccl when every process of a host has its own GPU, else the
// staged mpi backend (processes sharing a GPU); --device cpu: CPU tensors over mpi. One process
// without a launcher is a group of one (chunked_alltoall still chunks there; nothing moves).
//
// What is timed (each number: the median over --steps after --warmup, then the maximum over
// ranks; GPU: CUDA events on the compute stream, CPU: wall clock):
//   fwd / bwd ms   MoeBlock::forward, and backward_data + backward_weight (wgrad not deferred),
//                  of the layer with this dispatcher (every rank starts after a barrier)
//   disp / comb    the member's own communication with no expert work: the same rows and counts
//                  through the dispatcher with experts that return their input. fwd disp =
//                  forward_for_backward (the dispatch alone); fwd comb = forward - that. bwd
//                  disp = d_y_perm moved to the experts (forward_for_backward of d_y_perm, the
//                  combine's backward), bwd comb = backward - bwd disp (d_x and d_row_prob back)
//   experts        the expert MLPs inside a dispatcher run of the same rows: the sum over the
//                  member's chunks of the experts' forward calls (fwd) and of their dgrad calls
//                  plus the wgrad (bwd), each between events on the compute stream
//   hidden         (layer ms of alltoall - layer ms of the member) / (disp + comb of alltoall),
//                  per direction: the part of the unchunked communication time that the member
//                  took off the layer's time (100 %: all of it hidden; negative: chunking cost
//                  more than it hid). The non-dispatch work (router, permute, shared expert)
//                  is the same in both and cancels. n/a on one rank (nothing moves). On CPU
//                  ranks the communication is a small, noisy part of the layer: the column is
//                  meaningful on GPUs; the CPU run checks that everything runs.
// The table is printed by rank 0 at the end, in markdown.
//
// One rank of an EP = N job on one GPU, without N GPUs: --emulate N (comm/emulated.h; EP = N
// emulated ranks on nodes of --gpus-per-node, default 8, with --intra-gbps / --inter-gbps /
// --intra-latency-us / --inter-latency-us for the link model, --wire-scale to stretch or drop
// its wire time and --comm-blocks for the SMs an emulated collective holds, default 16).
// Routing is then balanced (every expert gets T x top-k / E rows per rank) and every peer is a
// copy of this rank; the table is labelled EMULATED with the link model.
// --timeline PREFIX (CUDA): one more forward + backward of each member is traced with CUPTI and
// written as a Chrome trace PREFIX-<shape>-<tokens>-<member>.json, and the table gets each
// direction's hidden share of the wire time read from that timeline (bench/timeline.h).
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "comm/comm.h"
#include "comm/emulated.h"
#include "comm/mesh.h"
#include "core/rng.h"
#include "core/stream.h"
#include "models/moe_block.h"
#include "models/params.h"
#include "primitives/moe/dispatcher.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/check.cuh"
#include "backend/cuda/runtime.h"
#include "timeline.h"
#endif

namespace bb {
namespace {

struct Shape3 {
  std::string name;
  int64_t hidden, experts, top_k, ffn, shared_ffn;
  bool zero_centered_norm;
};

Shape3 qwen35(bool small) {
  return small ? Shape3{"qwen3.5 (small)", 64, 16, 8, 32, 32, true} : Shape3{"qwen3.5", 2048, 256, 8, 512, 512, true};
}
Shape3 qwen3(bool small) {
  return small ? Shape3{"qwen3 (small)", 64, 16, 8, 48, 0, false} : Shape3{"qwen3", 2048, 128, 8, 768, 0, false};
}

struct Args {
  std::string shape = "both";
  std::vector<int64_t> tokens{16384, 32768, 65536};
  std::vector<int64_t> chunks{2, 3, 4};
  int steps = 5, warmup = 2;
  std::string device = "auto", experts = "grouped", permute = "standard", dtype = "auto";
  bool small = false;
  int64_t emulate = 0;  // --emulate N: ranks of the emulated EP group (0: a real group)
  comm::LinkModel link;
  double wire_scale = 1;
  int64_t comm_blocks = 16;
  std::string timeline;
};

// Time marks on the compute stream: CUDA events on a GPU (read after a synchronize), the wall
// clock on the CPU (where every call is synchronous).
class Marks {
 public:
  explicit Marks(Device dev) : dev_(dev) {}
  Marks(const Marks&) = delete;
  Marks& operator=(const Marks&) = delete;
  ~Marks() { clear(); }
  int mark() {
#ifdef BB_WITH_CUDA
    if (dev_.is_cuda()) {
      cudaEvent_t e = nullptr;
      BB_CHECK_CUDA(cudaEventCreate(&e));
      BB_CHECK_CUDA(cudaEventRecord(e, cuda::stream()));
      events_.push_back(e);
      return static_cast<int>(events_.size()) - 1;
    }
#endif
    wall_.push_back(std::chrono::steady_clock::now());
    return static_cast<int>(wall_.size()) - 1;
  }
  // Milliseconds from mark a to mark b; the marks must be complete (after sync()).
  double ms(int a, int b) const {
#ifdef BB_WITH_CUDA
    if (dev_.is_cuda()) {
      float e = 0;
      BB_CHECK_CUDA(cudaEventElapsedTime(&e, events_[static_cast<size_t>(a)], events_[static_cast<size_t>(b)]));
      return e;
    }
#endif
    return std::chrono::duration<double, std::milli>(wall_[static_cast<size_t>(b)] - wall_[static_cast<size_t>(a)])
        .count();
  }
  void sync() const { synchronize_device(dev_); }
  void clear() {
#ifdef BB_WITH_CUDA
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    events_.clear();
#endif
    wall_.clear();
  }

 private:
  Device dev_;
#ifdef BB_WITH_CUDA
  std::vector<cudaEvent_t> events_;
#endif
  std::vector<std::chrono::steady_clock::time_point> wall_;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Every rank waits for its device, then for the others: the timed region starts together.
void align(const comm::GroupPtr& g, Device dev) {
  synchronize_device(dev);
  g->barrier();
}

// The member's times for one layer at one token count (rank-local medians; maxed over ranks
// before printing).
struct Times {
  double fwd = 0, bwd = 0;                  // the layer
  double fwd_disp = 0, fwd_comb = 0;        // communication alone, forward
  double bwd_disp = 0, bwd_comb = 0;        // communication alone, backward
  double fwd_experts = 0, bwd_experts = 0;  // the expert MLPs inside a dispatcher run
  int64_t rows = 0;                         // M, rows this rank's experts received
  std::string err;
  std::string overlap_fwd, overlap_bwd;  // --timeline: hidden share of the wire, per direction
};

struct Setup {
  Device dev;
  DType dt;
  comm::GroupPtr ep;
  ExpertsImpl experts;
  PermuteMode permute;
  int steps, warmup;
  bool balanced = false;  // emulated: every rank routes with balanced_routing
  std::string timeline;   // --timeline PREFIX
};

std::unique_ptr<Dispatcher> make_member(int64_t chunks, int64_t num_experts, const comm::GroupPtr& ep) {
  DispatcherConfig dc;
  dc.num_experts = num_experts;
  dc.group = ep;
  dc.num_chunks = chunks;
  return chunks == 0 ? make_alltoall_dispatcher(dc) : make_chunked_alltoall_dispatcher(dc);
}

// The expert MLPs on the block's weights, each call between two marks (fwd: forward calls;
// bwd: backward_data and backward_weight calls).
ExpertCalls timed_experts(ExpertsImpl impl, Param& gu, Param& down, Marks& m, std::vector<std::pair<int, int>>& fwd,
                          std::vector<std::pair<int, int>>& bwd) {
  ExpertCalls c;
  c.forward = [&, impl](const Tensor& rows, const Tensor& p, const std::vector<int64_t>& cnt, ExpertsSaved* s) {
    const int a = m.mark();
    Tensor y = experts_forward(impl, rows, cnt, gu.value, down.value, p, s);
    fwd.emplace_back(a, m.mark());
    return y;
  };
  c.rebuild = [&, impl](const Tensor& rows, const Tensor& p, const std::vector<int64_t>& cnt, ExpertsSaved* s) {
    experts_forward_saved(impl, rows, cnt, gu.value, down.value, p, *s);
  };
  c.backward_data = [&, impl](const Tensor& dy, const Tensor& p, const std::vector<int64_t>& cnt,
                              const ExpertsSaved& s) {
    const int a = m.mark();
    ExpertsDgrad g = experts_backward_data(impl, dy, cnt, gu.value, down.value, p, s);
    bwd.emplace_back(a, m.mark());
    return g;
  };
  c.backward_weight = [&, impl](const Tensor& dy, const Tensor& rows, const Tensor& p, const std::vector<int64_t>& cnt,
                                const ExpertsSaved& s, const Tensor& dgu) {
    const int a = m.mark();
    ExpertsDgrad g;
    g.d_gate_up = dgu;
    experts_backward_weight(impl, dy, rows, cnt, p, s, g, gu.grad, down.grad);
    bwd.emplace_back(a, m.mark());
  };
  return c;
}

// Experts that do nothing: y = the rows, d_x = d_y, saved tensors of one column (so the chunked
// member's copies into the whole layout stay negligible). Only the movement is left.
ExpertCalls null_experts() {
  ExpertCalls c;
  auto stub = [](const Tensor& rows, ExpertsSaved* s) {
    s->gate_up = Tensor::empty({rows.size(0), 1}, rows.dtype(), rows.device(), MemCategory::workspace);
    s->act = s->gate_up;
  };
  c.forward = [stub](const Tensor& rows, const Tensor&, const std::vector<int64_t>&, ExpertsSaved* s) {
    stub(rows, s);
    return rows;
  };
  c.rebuild = [stub](const Tensor& rows, const Tensor&, const std::vector<int64_t>&, ExpertsSaved* s) {
    stub(rows, s);
  };
  c.backward_data = [](const Tensor& dy, const Tensor& p, const std::vector<int64_t>&, const ExpertsSaved& s) {
    ExpertsDgrad g;
    g.d_x = dy;
    g.d_row_prob = p;
    g.d_gate_up = s.gate_up;
    return g;
  };
  c.backward_weight = [](const Tensor&, const Tensor&, const Tensor&, const std::vector<int64_t>&,
                         const ExpertsSaved&, const Tensor&) {};
  return c;
}

Tensor randn(const Shape& s, DType dt, Device dev, uint64_t seed, float std = 1.0f) {
  Tensor t = Tensor::empty(s, dt, dev, MemCategory::activations);
  fill_normal(t, seed, 0, 0.0f, std);
  return t;
}

// One member (chunks = 0: alltoall) of one shape at T tokens per rank.
Times run_member(const Setup& su, const Shape3& sh, int64_t T, int64_t chunks) {
  Times out;
  const int rank = su.ep->rank();
  ParamStore store;
  ParamUnit& dense = store.add_unit("layers.0.dense", UnitKind::dense, 0);
  ParamUnit& expert_unit = store.add_unit("layers.0.experts", UnitKind::experts, 0);
  MoeBlockConfig mc;
  mc.hidden = sh.hidden;
  mc.num_experts = sh.experts;
  mc.top_k = sh.top_k;
  mc.expert_ffn = sh.ffn;
  mc.shared_ffn = sh.shared_ffn;
  mc.zero_centered_norm = sh.zero_centered_norm;
  mc.experts = su.experts;
  mc.permute = su.permute;
  const std::string prefix = "model.layers.0.";
  MoeBlock blk(store, dense, expert_unit, prefix, mc, make_member(chunks, sh.experts, su.ep));
  store.allocate(su.dev, su.dt);
  uint64_t index = 0;
  for (Param* p : store.params()) {
    // Every rank's experts differ (offset by rank); the dense weights are the same everywhere.
    const uint64_t off = (index++ << 40) + (p->unit == &expert_unit ? static_cast<uint64_t>(rank) << 36 : 0);
    if (p->init == ParamInit::ones) p->value.fill_(1.0);
    else if (p->init == ParamInit::zeros) p->value.fill_(0.0);
    else fill_normal(p->value, 7, off, 0.0f, 0.02f);
  }
  Tensor x = randn({T, sh.hidden}, su.dt, su.dev, 100 + static_cast<uint64_t>(rank));
  Tensor d_y = randn({T, sh.hidden}, su.dt, su.dev, 200 + static_cast<uint64_t>(rank));

  RoutingStash stash;
  stash.layers.resize(1);
  if (su.balanced)  // the routing a balanced job gives every rank, steering the block's router
    stash.layers[0].logit_bias =
        routing_logit_bias(balanced_routing(T, sh.experts, sh.top_k, Device::cpu()), sh.experts, 1000.0f, su.dev);
  BatchContext ctx;
  ctx.pass = Pass::train;
  ctx.routing = &stash;
  Marks m(su.dev);

  // The layer.
  std::vector<double> fwd, bwd;
  for (int i = 0; i < su.warmup + su.steps; ++i) {
    store.zero_grad();
    align(su.ep, su.dev);
    m.clear();
    std::unique_ptr<BlockSaved> saved = blk.make_saved();
    const int a = m.mark();
    Tensor y = blk.forward(x, ctx, saved.get());
    const int b = m.mark();
    Tensor d_x = blk.backward_data(d_y, ctx, *saved);
    blk.backward_weight(ctx, *saved);
    const int c = m.mark();
    m.sync();
    if (i >= su.warmup) {
      fwd.push_back(m.ms(a, b));
      bwd.push_back(m.ms(b, c));
    }
  }
  out.fwd = median(fwd);
  out.bwd = median(bwd);
#ifdef BB_WITH_CUDA
  if (!su.timeline.empty() && su.dev.is_cuda()) {
    // One more layer under CUPTI, its forward and backward windows apart (a first traced run
    // absorbs CUPTI's setup).
    static bench::GpuActivity activity;
    if (!activity.usable()) {
      out.overlap_fwd = out.overlap_bwd = "not traced: " + activity.error;
    } else {
      for (int pass = 0; pass < 2; ++pass) {
        store.zero_grad();
        align(su.ep, su.dev);
        std::unique_ptr<BlockSaved> saved = blk.make_saved();
        activity.begin();
        bench::StreamMarker marker(su.dev);
        Tensor y = blk.forward(x, ctx, saved.get());
        synchronize_device(su.dev);
        const bench::GpuActivity::Result f = activity.end();
        activity.begin();
        Tensor d_x = blk.backward_data(d_y, ctx, *saved);
        blk.backward_weight(ctx, *saved);
        synchronize_device(su.dev);
        const bench::GpuActivity::Result b = activity.end();
        if (pass == 0) continue;
        auto hidden = [](const bench::GpuActivity::Result& r) {
          const std::vector<bench::CommOverlap> o = bench::comm_overlap(r);
          if (o.empty()) return std::string("-");
          char buf[64];
          std::snprintf(buf, sizeof buf, "%.0f %% of %.2f", 100 * o.back().hidden_ms / std::max(1e-9, o.back().wire_ms),
                        o.back().wire_ms);
          return std::string(buf);
        };
        out.overlap_fwd = hidden(f);
        out.overlap_bwd = hidden(b);
        const std::string member = blk.dispatcher().name() + std::string(chunks > 0 ? std::to_string(chunks) : "");
        std::string shape = sh.name;
        for (char& ch : shape)
          if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '.') ch = '_';
        const std::string base = su.timeline + "-" + shape + "-" + std::to_string(T) + "-" + member;
        const std::string what = sh.name + ", " + std::to_string(T) + " tokens per rank, " + member;
        bench::write_chrome_trace(base + "-fwd.json", f, marker.names(f), what + ": forward");
        bench::write_chrome_trace(base + "-bwd.json", b, marker.names(f), what + ": backward");
      }
    }
  }
#endif

  // The dispatcher alone on this rank's routed rows (the last step's counts).
  Dispatcher& d = blk.dispatcher();
  const std::vector<int64_t> counts = stash.layers[0].tokens_per_expert;
  int64_t N = 0;
  for (int64_t c : counts) N += c;
  Tensor x_perm = randn({N, sh.hidden}, su.dt, su.dev, 300 + static_cast<uint64_t>(rank));
  Tensor d_y_perm = randn({N, sh.hidden}, su.dt, su.dev, 400 + static_cast<uint64_t>(rank));
  Tensor row_prob = su.permute == PermuteMode::memory_efficient
                        ? Tensor::zeros({N}, DType::f32, su.dev, MemCategory::activations)
                        : Tensor();
  Param& gu = *store.find(prefix + "mlp.experts.gate_up_proj");
  Param& down = *store.find(prefix + "mlp.experts.down_proj");
  const ExpertCalls none = null_experts();
  std::vector<double> xf, xb, df, dcf, db, dcb;
  for (int i = 0; i < su.warmup + su.steps; ++i) {
    const bool keep = i >= su.warmup;
    std::vector<std::pair<int, int>> ef, eb;
    // Real experts inside the member's run.
    align(su.ep, su.dev);
    m.clear();
    {
      const ExpertCalls real = timed_experts(su.experts, gu, down, m, ef, eb);
      DispatchState st;
      d.forward(x_perm, row_prob, counts, real, st);
      out.rows = st.num_rows();
      d.backward(d_y_perm, real, st);
      m.sync();
      double f = 0, b = 0;
      for (auto [a, z] : ef) f += m.ms(a, z);
      for (auto [a, z] : eb) b += m.ms(a, z);
      if (keep) {
        xf.push_back(f);
        xb.push_back(b);
      }
    }
    // Communication alone: forward_for_backward (dispatch), forward (dispatch + combine), the
    // d_y movement alone, backward (both backward movements).
    auto timed = [&](const std::function<void()>& fn) {
      align(su.ep, su.dev);
      m.clear();
      const int a = m.mark();
      fn();
      const int b = m.mark();
      m.sync();
      return m.ms(a, b);
    };
    DispatchState st;
    const double t_d = timed([&] { d.forward_for_backward(x_perm, row_prob, counts, none, st); });
    st = DispatchState{};
    const double t_dc = timed([&] { d.forward(x_perm, row_prob, counts, none, st); });
    DispatchState st_b;
    const double t_b = timed([&] { d.forward_for_backward(d_y_perm, Tensor(), counts, none, st_b); });
    st_b = DispatchState{};
    const double t_bx = timed([&] { d.backward(d_y_perm, none, st); });
    if (keep) {  // a difference of two timings: clamped at 0 where noise exceeds it
      df.push_back(t_d);
      dcf.push_back(std::max(0.0, t_dc - t_d));
      db.push_back(t_b);
      dcb.push_back(std::max(0.0, t_bx - t_b));
    }
  }
  out.fwd_experts = median(xf);
  out.bwd_experts = median(xb);
  out.fwd_disp = median(df);
  out.fwd_comb = median(dcf);
  out.bwd_disp = median(db);
  out.bwd_comb = median(dcb);
  return out;
}

// Every rank's medians -> the slowest rank's (the layer is as slow as it); an error on any rank
// is reported by rank 0 as "failed".
void max_over_ranks(const comm::GroupPtr& g, Times& t) {
  double v[9] = {t.fwd, t.bwd, t.fwd_disp, t.fwd_comb, t.bwd_disp, t.bwd_comb, t.fwd_experts, t.bwd_experts,
                 t.err.empty() ? 0.0 : 1.0};
  g->all_reduce_host(v, 9, comm::ReduceOp::max);
  t.fwd = v[0];
  t.bwd = v[1];
  t.fwd_disp = v[2];
  t.fwd_comb = v[3];
  t.bwd_disp = v[4];
  t.bwd_comb = v[5];
  t.fwd_experts = v[6];
  t.bwd_experts = v[7];
  if (v[8] > 0 && t.err.empty()) t.err = "failed on another rank";
  t.rows = g->max(t.rows);
}

struct Row {
  std::string shape, member;
  int64_t tokens = 0;
  Times t;
  bool base = false, hidden = false;  // hidden: hid_f / hid_b defined
  double hid_f = 0, hid_b = 0;
};

std::string pct(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.0f %%", 100.0 * v);
  return b;
}

int usage(const char* msg) {
  std::fprintf(stderr, "%s (see the header of bench/bench_moe_layer.cpp)\n", msg);
  return 2;
}

int run(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value after %s\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--shape") args.shape = next();
    else if (a == "--tokens") args.tokens = bench::parse_list(next());
    else if (a == "--chunks") args.chunks = bench::parse_list(next());
    else if (a == "--steps") args.steps = std::stoi(next());
    else if (a == "--warmup") args.warmup = std::stoi(next());
    else if (a == "--device") args.device = next();
    else if (a == "--experts") args.experts = next();
    else if (a == "--permute") args.permute = next();
    else if (a == "--dtype") args.dtype = next();
    else if (a == "--small") args.small = true;
    else if (a == "--emulate") args.emulate = std::stoll(next());
    else if (a == "--gpus-per-node") args.link.gpus_per_node = std::stoll(next());
    else if (a == "--intra-gbps") args.link.intra_gbps = std::stod(next());
    else if (a == "--inter-gbps") args.link.inter_gbps = std::stod(next());
    else if (a == "--intra-latency-us") args.link.intra_latency_us = std::stod(next());
    else if (a == "--inter-latency-us") args.link.inter_latency_us = std::stod(next());
    else if (a == "--wire-scale") args.wire_scale = std::stod(next());
    else if (a == "--comm-blocks") args.comm_blocks = std::stoll(next());
    else if (a == "--timeline") args.timeline = next();
    else return usage(("unknown argument " + a).c_str());
  }
  if (args.shape != "qwen3.5" && args.shape != "qwen3" && args.shape != "both")
    return usage("--shape must be qwen3.5, qwen3 or both");
  if (args.experts != "grouped" && args.experts != "sequential") return usage("--experts must be grouped or sequential");
  if (args.permute != "standard" && args.permute != "memory_efficient")
    return usage("--permute must be standard or memory_efficient");
  if (args.steps < 1 || args.warmup < 0) return usage("--steps must be >= 1 and --warmup >= 0");
  for (int64_t c : args.chunks)
    if (c < 1 || c > kMaxDispatchChunks) return usage("--chunks: every count must be in [1, 64]");

  const comm::World& w = comm::world();
  Setup su;
  su.dev = Device::cpu();
  std::string backend = "mpi";
#ifdef BB_WITH_CUDA
  if (args.device == "auto" && cuda::device_count() > 0) args.device = "cuda";
  if (args.device == "cuda") {
    const int n = cuda::device_count();
    if (n == 0) {
      std::fprintf(stderr, "--device cuda: no GPU visible (%s)\n", cuda::unavailable_reason());
      return 2;
    }
    su.dev = Device::cuda(w.local_rank % n);
    cuda::set_device(su.dev.index);
    // NCCL needs one GPU per process; processes sharing a GPU use the staged mpi backend.
    if (w.local_size <= n) backend = "nccl";
  }
#else
  if (args.device == "cuda") return usage("--device cuda: this build has no CUDA backend");
#endif
  if (args.device != "auto" && args.device != "cpu" && args.device != "cuda")
    return usage("--device must be cpu or cuda");
  if (w.size == 1) backend = "self";
  comm::EmulateConfig ec;
  if (args.emulate > 0) {
    if (w.size > 1) return usage("--emulate: one process plays one rank; start it without mpirun");
    backend = "emulated";
    ec.ranks = args.emulate;
    ec.link = args.link;
    ec.wire_scale = args.wire_scale;
    ec.comm_blocks = args.comm_blocks;
    ec.validate();
  }
  su.balanced = args.emulate > 0;
  su.timeline = args.timeline;
  su.dt = args.dtype == "auto" ? (su.dev.is_cuda() ? DType::bf16 : DType::f32)
          : args.dtype == "bf16" ? DType::bf16
          : args.dtype == "f32"  ? DType::f32
                                 : DType::u8;
  if (su.dt == DType::u8) return usage("--dtype must be auto, f32 or bf16");
  su.experts = args.experts == "grouped" ? ExpertsImpl::grouped : ExpertsImpl::sequential;
  su.permute = args.permute == "standard" ? PermuteMode::standard : PermuteMode::memory_efficient;
  su.steps = args.steps;
  su.warmup = args.warmup;

  comm::GroupPtr base = backend == "self"       ? comm::self_group("world")
                        : backend == "emulated" ? comm::make_emulated_world(ec)
                        : backend == "nccl"     ? comm::world_group(comm::Backend::nccl)
                                                : comm::world_group(comm::Backend::mpi);
  const int64_t P = base->size();
  std::vector<Shape3> shapes;
  if (args.shape != "qwen3") shapes.push_back(qwen35(args.small));
  if (args.shape != "qwen3.5") shapes.push_back(qwen3(args.small));
  std::vector<Row> rows;
  {
    ParallelLayout layout;
    layout.dp = P;
    layout.ep = P;
    for (const Shape3& sh : shapes) layout.validate(P, sh.experts);
    Mesh mesh(base, layout);
    su.ep = mesh.ep();
    const bool root = su.ep->rank() == 0;
    for (const Shape3& sh : shapes)
      for (int64_t T : args.tokens) {
        std::vector<int64_t> members = {0};
        members.insert(members.end(), args.chunks.begin(), args.chunks.end());
        for (int64_t c : members) {
          Row r;
          r.shape = sh.name;
          r.tokens = T;
          r.member = c == 0 ? "alltoall" : "chunked_alltoall:" + std::to_string(c);
          r.base = c == 0;
          try {
            r.t = run_member(su, sh, T, c);
          } catch (const std::exception& e) {
            r.t.err = e.what();
          }
          max_over_ranks(su.ep, r.t);
          if (root)
            std::fprintf(stderr, "[bench_moe_layer] %s T=%lld %s: fwd %.3f ms bwd %.3f ms%s%s\n", sh.name.c_str(),
                         static_cast<long long>(T), r.member.c_str(), r.t.fwd, r.t.bwd, r.t.err.empty() ? "" : " ",
                         r.t.err.c_str());
          rows.push_back(r);
        }
      }
    // hidden = (alltoall's layer time - the member's) / (alltoall's disp + comb), per direction.
    const Row* b = nullptr;
    for (Row& r : rows) {
      if (r.base) {
        b = &r;
        continue;
      }
      if (!b || !b->t.err.empty() || !r.t.err.empty()) continue;
      // One rank moves nothing: there is no communication to hide.
      const double cf = b->t.fwd_disp + b->t.fwd_comb, cb = b->t.bwd_disp + b->t.bwd_comb;
      if (P == 1 || cf <= 0 || cb <= 0) continue;
      r.hidden = true;
      r.hid_f = (b->t.fwd - r.t.fwd) / cf;
      r.hid_b = (b->t.bwd - r.t.bwd) / cb;
    }
    if (root) {
      std::printf("\n## One MoE layer, EP = %lld (%s, %s, %s), experts %s, permute %s, median of %d steps after %d\n\n",
                  static_cast<long long>(P), comm::backend_name(su.ep->backend()), su.dev.str().c_str(),
                  dtype_name(su.dt), args.experts.c_str(), args.permute.c_str(), args.steps, args.warmup);
      if (args.emulate > 0)
        std::printf("%s. EMULATED: this rank's compute and memory measured, the wire time modelled; balanced routing "
                    "(rows M = tokens x top-k).\n\n", ec.str().c_str());
      std::printf(
          "ms per layer; slowest rank. disp / comb: the member's communication with no expert work (bwd disp = "
          "d_y_perm to the experts, bwd comb = d_x back); experts: the expert MLPs inside a run (bwd: dgrad + "
          "wgrad); hidden = (alltoall ms - member ms) / (alltoall disp + comb).\n\n");
      const bool traced = !args.timeline.empty();
      std::printf("| shape | tokens/rank | rows M | dispatch | fwd ms | fwd disp | fwd experts | fwd comb | fwd hidden "
                  "| bwd ms | bwd disp | bwd experts | bwd comb | bwd hidden |%s\n",
                  traced ? " fwd wire hidden (timeline) | bwd wire hidden (timeline) |" : "");
      std::printf("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|%s\n", traced ? "---:|---:|" : "");
      for (const Row& r : rows) {
        if (!r.t.err.empty()) {
          std::printf("| %s | %lld | | %s | failed: %s | | | | | | | | | |\n", r.shape.c_str(),
                      static_cast<long long>(r.tokens), r.member.c_str(), r.t.err.c_str());
          continue;
        }
        const char* none = r.base ? "-" : "n/a";
        const std::string hf = r.hidden ? pct(r.hid_f) : none, hb = r.hidden ? pct(r.hid_b) : none;
        std::printf("| %s | %lld | %lld | %s | %.3f | %.3f | %.3f | %.3f | %s | %.3f | %.3f | %.3f | %.3f | %s |",
                    r.shape.c_str(), static_cast<long long>(r.tokens), static_cast<long long>(r.t.rows),
                    r.member.c_str(), r.t.fwd, r.t.fwd_disp, r.t.fwd_experts, r.t.fwd_comb, hf.c_str(), r.t.bwd,
                    r.t.bwd_disp, r.t.bwd_experts, r.t.bwd_comb, hb.c_str());
        if (traced) std::printf(" %s | %s |", r.t.overlap_fwd.c_str(), r.t.overlap_bwd.c_str());
        std::printf("\n");
      }
      std::fflush(stdout);
    }
    su.ep.reset();
  }
  base.reset();
  return 0;
}

}  // namespace
}  // namespace bb

int main(int argc, char** argv) {
  bb::comm::init(&argc, &argv);
  bb::comm::set_timeout(600);
  int rc = 0;
  try {
    rc = bb::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_moe_layer: %s\n", e.what());
    bb::comm::abort_job(1, e.what());
  }
  bb::comm::finalize();
  return rc;
}
