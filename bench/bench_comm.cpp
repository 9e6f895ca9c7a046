// bench_comm — bus bandwidth of the collectives the trainer uses (all-gather, reduce-scatter,
// all-reduce, all-to-all-v with an even split), issued through bumblebee's comm layer
// (comm::Group over the world) rather than through NCCL directly, so what is measured is what
// FSDP, zero1 and the MoE dispatchers get (skills/multigpu-bench.md).
//
//   mpirun -np P bench_comm [--sizes 1M,2M,...,1G] [--iters 20] [--warmup 5] [--device cpu|cuda]
//                           [--ops all_gather,reduce_scatter,all_reduce,all_to_all] [--dtype
//                           f32|bf16]
//
// Device and communication, as the trainer and bench_moe_layer choose them: --device cuda puts
// rank r on GPU (local rank % GPUs) and uses nccl when every process of a host has its own GPU,
// else the staged mpi backend (processes sharing a GPU: correct, but bounded by host copies);
// --device cpu: CPU tensors over mpi. One process without a launcher is a group of one.
//
// Sizes (NCCL-tests' conventions; S = the size in the table, n = ranks, rounded down so that it
// splits into n equal blocks):
//   all_reduce      S bytes in place                  busbw = algbw x 2 (n-1) / n
//   reduce_scatter  S bytes in, S / n out             busbw = algbw x (n-1) / n
//   all_gather      S / n in, S bytes out             busbw = algbw x (n-1) / n
//   all_to_all      S bytes in and out, S / n per peer (all_to_all_v, even counts)
//                                                     busbw = algbw x (n-1) / n
//   algbw = S / time (GB = 1e9 bytes). time = one operation (issue + Work::wait, as the trainer
//   calls it), averaged over --iters after --warmup, then averaged over ranks (NCCL-tests'
//   default); the slowest rank's time is printed beside it. GPU: CUDA events on the compute
//   stream around the loop; CPU: a steady clock (every wait blocks the host there).
//
// Correctness: before timing, each op runs once on values that encode the source rank, the
// destination block and the position (small integers, exact in f32 and, up to 8 ranks, in
// bf16), and every element of the result is compared exactly with what the formula predicts.
// Any mismatch on any rank marks the row FAIL, prints the first bad element and makes the
// program exit 1. Rank 0 prints a markdown table and, per op, the best busbw at >= 256 MiB.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/dtype.h"
#include "core/stream.h"
#include "core/tensor.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/check.cuh"
#include "backend/cuda/runtime.h"
#endif

namespace bb {
namespace {

enum class Op { all_gather, reduce_scatter, all_reduce, all_to_all };
const char* op_name(Op op) {
  switch (op) {
    case Op::all_gather:
      return "all_gather";
    case Op::reduce_scatter:
      return "reduce_scatter";
    case Op::all_reduce:
      return "all_reduce";
    case Op::all_to_all:
      return "all_to_all";
  }
  return "?";
}
// NCCL-tests' bus-bandwidth factor: what a ring moves per rank relative to S.
double busbw_factor(Op op, int n) {
  if (n <= 1) return 0.0;
  const double f = static_cast<double>(n - 1) / n;
  return op == Op::all_reduce ? 2.0 * f : f;
}

struct Args {
  std::vector<int64_t> sizes;  // bytes
  std::vector<Op> ops{Op::all_gather, Op::reduce_scatter, Op::all_reduce, Op::all_to_all};
  int iters = 20, warmup = 5;
  std::string device = "auto", dtype = "f32";
};

// "1M" = 2^20 bytes, "512K", "1G", or plain bytes.
int64_t parse_size(const std::string& s) {
  BB_CHECK(!s.empty(), "--sizes: empty entry");
  int64_t mult = 1;
  std::string num = s;
  const char last = s.back();
  if (last == 'K' || last == 'k')
    mult = int64_t{1} << 10;
  else if (last == 'M' || last == 'm')
    mult = int64_t{1} << 20;
  else if (last == 'G' || last == 'g')
    mult = int64_t{1} << 30;
  if (mult != 1) num = s.substr(0, s.size() - 1);
  size_t used = 0;
  const int64_t v = std::stoll(num, &used);
  BB_CHECK(used == num.size() && v > 0, "--sizes: '", s,
           "' is not a positive size (e.g. 1M, 256M, 1G)");
  return v * mult;
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(item);
  return out;
}

Op parse_op(const std::string& s) {
  if (s == "all_gather" || s == "ag") return Op::all_gather;
  if (s == "reduce_scatter" || s == "rs") return Op::reduce_scatter;
  if (s == "all_reduce" || s == "ar") return Op::all_reduce;
  if (s == "all_to_all" || s == "a2a") return Op::all_to_all;
  BB_CHECK(false, "--ops: unknown op '", s,
           "' (all_gather, reduce_scatter, all_reduce, all_to_all)");
  return Op::all_reduce;
}

std::string human_bytes(int64_t b) {
  char buf[32];
  if (b >= (int64_t{1} << 30) && b % (int64_t{1} << 30) == 0)
    std::snprintf(buf, sizeof buf, "%lld GiB", static_cast<long long>(b >> 30));
  else if (b >= (int64_t{1} << 20) && b % (int64_t{1} << 20) == 0)
    std::snprintf(buf, sizeof buf, "%lld MiB", static_cast<long long>(b >> 20));
  else if (b >= (int64_t{1} << 10) && b % (int64_t{1} << 10) == 0)
    std::snprintf(buf, sizeof buf, "%lld KiB", static_cast<long long>(b >> 10));
  else
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  return buf;
}

// A timed region on the compute stream: CUDA events on a GPU, the wall clock on the CPU.
class Timer {
 public:
  explicit Timer(Device dev) : dev_(dev) {
#ifdef BB_WITH_CUDA
    if (dev_.is_cuda()) {
      BB_CHECK_CUDA(cudaEventCreate(&start_));
      BB_CHECK_CUDA(cudaEventCreate(&stop_));
    }
#endif
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  ~Timer() {
#ifdef BB_WITH_CUDA
    if (start_) cudaEventDestroy(start_);
    if (stop_) cudaEventDestroy(stop_);
#endif
  }
  void start() {
#ifdef BB_WITH_CUDA
    if (dev_.is_cuda()) {
      BB_CHECK_CUDA(cudaEventRecord(start_, cuda::stream()));
      return;
    }
#endif
    t0_ = std::chrono::steady_clock::now();
  }
  // Milliseconds since start(), after the device finished everything queued.
  double stop_ms() {
#ifdef BB_WITH_CUDA
    if (dev_.is_cuda()) {
      BB_CHECK_CUDA(cudaEventRecord(stop_, cuda::stream()));
      synchronize_device(dev_);
      float ms = 0;
      BB_CHECK_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
      return ms;
    }
#endif
    synchronize_device(dev_);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_)
        .count();
  }

 private:
  Device dev_;
#ifdef BB_WITH_CUDA
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
#endif
  std::chrono::steady_clock::time_point t0_;
};

// The check values (see the file comment): small integers, so every partial sum is exact.
//   all_reduce:      rank src holds (src + 1) + 2 (i % 3)
//   reduce_scatter:  rank src's block b holds (src + 1) + 2 ((b + i) % 3)
//   all_gather:      rank src holds (src + 1) + (n + 1) (i % 3)
//   all_to_all:      rank src's block for dst holds 1 + src n + dst + (n n + 1) (i % 3)
// (i: the element's index within its block.)
struct Pattern {
  int n = 1;
  double ar(int src, int64_t i) const { return (src + 1) + 2.0 * (i % 3); }
  double rs(int src, int64_t b, int64_t i) const { return (src + 1) + 2.0 * ((b + i) % 3); }
  double ag(int src, int64_t i) const { return (src + 1) + (n + 1.0) * (i % 3); }
  double a2a(int src, int dst, int64_t i) const {
    return 1.0 + static_cast<double>(src) * n + dst + (static_cast<double>(n) * n + 1.0) * (i % 3);
  }
  // Sum over ranks of (src + 1).
  double rank_sum() const { return n * (n + 1) / 2.0; }
};

struct Buffers {
  Tensor in, out;  // all_reduce: in only (in place)
};

Tensor host_to(const std::vector<float>& v, DType dt, Device dev) {
  Tensor h = Tensor::from_floats(v, {static_cast<int64_t>(v.size())}, dt, MemCategory::comm);
  return dev.is_cuda() ? h.to(dev, MemCategory::comm) : h;
}

// block = elements per rank block; the op's buffers filled with the check values of `rank`.
Buffers make_buffers(Op op, int rank, const Pattern& p, int64_t block, DType dt, Device dev) {
  const int n = p.n;
  const int64_t whole = block * n;
  Buffers b;
  std::vector<float> v;
  switch (op) {
    case Op::all_reduce:
      v.resize(static_cast<size_t>(whole));
      for (int64_t i = 0; i < whole; ++i)
        v[static_cast<size_t>(i)] = static_cast<float>(p.ar(rank, i));
      b.in = host_to(v, dt, dev);
      break;
    case Op::reduce_scatter:
      v.resize(static_cast<size_t>(whole));
      for (int64_t k = 0; k < n; ++k)
        for (int64_t i = 0; i < block; ++i)
          v[static_cast<size_t>(k * block + i)] = static_cast<float>(p.rs(rank, k, i));
      b.in = host_to(v, dt, dev);
      b.out = Tensor::zeros({block}, dt, dev, MemCategory::comm);
      break;
    case Op::all_gather:
      v.resize(static_cast<size_t>(block));
      for (int64_t i = 0; i < block; ++i)
        v[static_cast<size_t>(i)] = static_cast<float>(p.ag(rank, i));
      b.in = host_to(v, dt, dev);
      b.out = Tensor::zeros({whole}, dt, dev, MemCategory::comm);
      break;
    case Op::all_to_all:
      v.resize(static_cast<size_t>(whole));
      for (int dst = 0; dst < n; ++dst)
        for (int64_t i = 0; i < block; ++i)
          v[static_cast<size_t>(dst * block + i)] = static_cast<float>(p.a2a(rank, dst, i));
      b.in = host_to(v, dt, dev);
      b.out = Tensor::zeros({whole}, dt, dev, MemCategory::comm);
      break;
  }
  return b;
}

comm::WorkPtr issue(Op op, comm::Group& g, const Buffers& b, const std::vector<int64_t>& counts) {
  switch (op) {
    case Op::all_reduce:
      return g.all_reduce(b.in);
    case Op::reduce_scatter:
      return g.reduce_scatter(b.in, b.out);
    case Op::all_gather:
      return g.all_gather(b.in, b.out);
    case Op::all_to_all:
      return g.all_to_all_v(b.in, counts, b.out, counts);
  }
  return comm::done_work();
}

// Compares the op's result on `rank` with the formula; "" when every element matches, else the
// first mismatch.
std::string check_result(Op op, int rank, const Pattern& p, int64_t block, const Buffers& b) {
  const int n = p.n;
  const std::vector<float> got = (op == Op::all_reduce ? b.in : b.out).to_floats();
  auto want_at = [&](int64_t j) -> double {
    switch (op) {
      case Op::all_reduce:
        return p.rank_sum() + n * 2.0 * (j % 3);
      case Op::reduce_scatter:
        return p.rank_sum() + n * 2.0 * ((rank + j) % 3);
      case Op::all_gather:
        return p.ag(static_cast<int>(j / block), j % block);
      case Op::all_to_all:
        return p.a2a(static_cast<int>(j / block), rank, j % block);
    }
    return 0;
  };
  for (int64_t j = 0; j < static_cast<int64_t>(got.size()); ++j) {
    const float want = static_cast<float>(want_at(j));
    if (got[static_cast<size_t>(j)] != want) {
      std::ostringstream m;
      m << "rank " << rank << ": element " << j << " of " << got.size() << " is "
        << got[static_cast<size_t>(j)] << ", expected " << want;
      return m.str();
    }
  }
  return "";
}

struct Row {
  Op op;
  int64_t bytes = 0, block = 0;
  double avg_ms = 0, max_ms = 0, algbw = 0, busbw = 0;
  bool ok = true;
  std::string err;
};

int usage(const std::string& msg) {
  std::fprintf(stderr, "%s (see the header of bench/bench_comm.cpp)\n", msg.c_str());
  return 2;
}

int run(int argc, char** argv) {
  Args args;
  for (int64_t s = int64_t{1} << 20; s <= int64_t{1} << 30; s *= 2) args.sizes.push_back(s);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value after %s\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--sizes") {
      args.sizes.clear();
      for (const std::string& s : split_commas(next())) args.sizes.push_back(parse_size(s));
    } else if (a == "--ops") {
      args.ops.clear();
      for (const std::string& s : split_commas(next())) args.ops.push_back(parse_op(s));
    } else if (a == "--iters")
      args.iters = std::stoi(next());
    else if (a == "--warmup")
      args.warmup = std::stoi(next());
    else if (a == "--device")
      args.device = next();
    else if (a == "--dtype")
      args.dtype = next();
    else
      return usage("unknown argument " + a);
  }
  if (args.iters < 1 || args.warmup < 0) return usage("--iters must be >= 1 and --warmup >= 0");
  if (args.sizes.empty() || args.ops.empty())
    return usage("--sizes and --ops need at least one entry");
  if (args.dtype != "f32" && args.dtype != "bf16") return usage("--dtype must be f32 or bf16");
  if (args.device != "auto" && args.device != "cpu" && args.device != "cuda")
    return usage("--device must be cpu or cuda");

  const comm::World& w = comm::world();
  Device dev = Device::cpu();
  std::string backend = "mpi";
#ifdef BB_WITH_CUDA
  if (args.device == "auto" && cuda::device_count() > 0) args.device = "cuda";
  if (args.device == "cuda") {
    const int n = cuda::device_count();
    if (n == 0) {
      std::fprintf(stderr, "--device cuda: no GPU visible (%s)\n", cuda::unavailable_reason());
      return 2;
    }
    dev = Device::cuda(w.local_rank % n);
    cuda::set_device(dev.index);
    // NCCL needs one GPU per process; processes sharing a GPU use the staged mpi backend.
    if (w.local_size <= n) backend = "nccl";
  }
#else
  if (args.device == "cuda") return usage("--device cuda: this build has no CUDA backend");
#endif
  if (w.size == 1) backend = "self";
  const DType dt = args.dtype == "bf16" ? DType::bf16 : DType::f32;

  comm::GroupPtr g = backend == "self"   ? comm::self_group("world")
                     : backend == "nccl" ? comm::world_group(comm::Backend::nccl)
                                         : comm::world_group(comm::Backend::mpi);
  const int n = g->size(), rank = g->rank();
  // bf16 holds every integer up to 256 exactly; the check values stay below that up to 8 ranks.
  if (dt == DType::bf16 && n > 8)
    return usage("--dtype bf16: the exact check holds up to 8 ranks; use f32");
  const bool root = rank == 0;
  Pattern pat;
  pat.n = n;
  const int64_t esize = static_cast<int64_t>(dtype_size(dt));
  std::vector<Row> rows;
  bool all_ok = true;
  Timer timer(dev);
  for (Op op : args.ops)
    for (int64_t size : args.sizes) {
      Row r;
      r.op = op;
      r.block = size / (esize * n);
      r.bytes = r.block * n * esize;
      if (r.block == 0) {
        r.ok = false;
        r.err = "size below one element per rank";
      }
      const std::vector<int64_t> counts(static_cast<size_t>(n), r.block);
      try {
        if (r.block > 0) {
          // Correctness on the check values.
          Buffers b = make_buffers(op, rank, pat, r.block, dt, dev);
          synchronize_device(dev);
          g->barrier();
          issue(op, *g, b, counts)->wait();
          synchronize_device(dev);
          r.err = check_result(op, rank, pat, r.block, b);
          // Timing on the same buffers (all_reduce in place: zeros, so repeated sums stay 0).
          if (op == Op::all_reduce) b.in.fill_(0.0);
          for (int it = 0; it < args.warmup; ++it) issue(op, *g, b, counts)->wait();
          synchronize_device(dev);
          g->barrier();
          timer.start();
          for (int it = 0; it < args.iters; ++it) issue(op, *g, b, counts)->wait();
          r.avg_ms = timer.stop_ms() / args.iters;
        }
      } catch (const std::exception& e) {
        r.err = e.what();
      }
      // Every rank's verdict and time: the average (NCCL-tests' default) and the slowest.
      double v[2] = {r.avg_ms, r.err.empty() ? 0.0 : 1.0};
      double mx[1] = {r.avg_ms};
      g->all_reduce_host(v, 2, comm::ReduceOp::sum);
      g->all_reduce_host(mx, 1, comm::ReduceOp::max);
      if (!r.err.empty())
        std::fprintf(stderr, "[bench_comm] %s %s FAILED: %s\n", op_name(op),
                     human_bytes(size).c_str(), r.err.c_str());
      r.ok = v[1] == 0.0;
      r.avg_ms = v[0] / n;
      r.max_ms = mx[0];
      if (r.ok && r.avg_ms > 0) {
        r.algbw = static_cast<double>(r.bytes) / (r.avg_ms * 1e-3) / 1e9;
        r.busbw = r.algbw * busbw_factor(op, n);
      }
      all_ok = all_ok && r.ok;
      if (root)
        std::fprintf(stderr, "[bench_comm] %s %s: %.1f us, busbw %.2f GB/s, %s\n", op_name(op),
                     human_bytes(r.bytes).c_str(), r.avg_ms * 1e3, r.busbw, r.ok ? "ok" : "FAIL");
      rows.push_back(r);
    }
  if (root) {
    std::printf(
        "\n## Collectives through the comm layer: %d rank(s) over %s (%s%s), %s, %d iters after %d "
        "warm-up\n\n",
        n, comm::backend_name(g->backend()), dev.str().c_str(), dev.is_cuda() ? " on rank 0" : "",
        dtype_name(dt), args.iters, args.warmup);
    std::printf(
        "time: one operation (issue + wait), mean over iters, averaged over ranks (max: slowest "
        "rank). "
        "algbw = bytes / time; busbw = algbw x 2(n-1)/n (all_reduce) or (n-1)/n (the others). "
        "GB = 1e9 bytes.\n\n");
    std::printf(
        "| op | bytes | elements per rank block | time us | max time us | algbw GB/s | busbw GB/s "
        "| check |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|---|\n");
    for (const Row& r : rows)
      std::printf("| %s | %s | %lld | %.1f | %.1f | %.2f | %.2f | %s |\n", op_name(r.op),
                  human_bytes(r.bytes).c_str(), static_cast<long long>(r.block), r.avg_ms * 1e3,
                  r.max_ms * 1e3, r.algbw, r.busbw, r.ok ? "ok" : "FAIL");
    std::printf("\n");
    // The issue's goal is stated at >= 256 MiB: the best busbw there, per op.
    for (Op op : args.ops) {
      double best = -1;
      int64_t at = 0;
      for (const Row& r : rows)
        if (r.op == op && r.ok && r.bytes >= (int64_t{256} << 20) && r.busbw > best) {
          best = r.busbw;
          at = r.bytes;
        }
      if (best >= 0)
        std::printf("best busbw at >= 256 MiB: %s %.2f GB/s (%s, %d ranks)\n", op_name(op), best,
                    human_bytes(at).c_str(), n);
    }
    std::printf("bench_comm: %s\n", all_ok ? "PASS (every result checked exactly)"
                                           : "FAIL (a collective returned wrong values)");
    std::fflush(stdout);
  }
  g.reset();
  return all_ok ? 0 : 1;
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
    std::fprintf(stderr, "bench_comm: %s\n", e.what());
    bb::comm::abort_job(2, e.what());
  }
  bb::comm::finalize();
  return rc;
}
