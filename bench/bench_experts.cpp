// bench_experts — the expert MLP GEMMs on one GPU: every grouped-GEMM algorithm per stage, and
// the whole experts forward + backward through the public API. One table per shape, so one GPU
// run says which GroupedAlgo should be the default for which stage (skills/experts.md).
//
//   Shapes (default: two runs, T = 32768 and T = 4096 tokens): top-K = 8, so N = T K permuted
//   rows; E = 128 local experts, H = 2048, F = 768; bf16 data and weights, f32 weight
//   gradients. Routing: every token picks K distinct experts uniformly at random (fixed seed),
//   so each count is about N / E with a spread of its square root, almost never a multiple of
//   128.
//   Stages, as experts.cpp issues them (two GEMM calls each, 6 N H F FLOPs per stage):
//     fwd:   gate_up_e = x_e W_gu[e]^T                 y_e = a_e W_down[e]^T        (bf16 C)
//     dgrad: d_a_e = d_y_e W_down[e]                   d_x_e = d_gu_e W_gu[e]       (bf16 C)
//     wgrad: d_W_down[e] += d_y_e^T a_e                d_W_gu[e] += d_gu_e^T x_e    (f32 C)
//     wgrad0: the same written (beta 0: the first wgrad of a step, the expert gradients being
//             zeroed lazily)
//   Algorithms: sequential (one cuda::gemm per expert, compute stream only), cublas (one
//   cublasGemmGroupedBatchedEx; it refuses bf16 -> f32, so no wgrad row), multi_stream with
//   S = 1, 2, 4, 8 side streams, wmma (wgrad only), our mma tile kernels (grouped_mma.h, every
//   stage: automatic = the TMA kernel where it applies (sm_90, the forward and dgrad), the same
//   with the TMA kernel off (the wgmma kernel for the forward), and the mma.sync kernel with 64-
//   and 128-row tiles), and sequential / multi_stream S=4 with the
//   plan cache cleared before every timed call ("cold": what a step pays for expert sizes never
//   seen before, one cuBLASLt heuristic query per new shape).
//   Columns: ms = median over --iters calls of CUDA events on the compute stream around the call
//   (the GPU is idle at the start event, so a host-bound enqueue shows up in it); TFLOP/s;
//   % of the ceiling = an 8192^3 bf16 -> bf16 cuda::gemm measured in this binary; host ms = the
//   wall time of the enqueue alone; rel err = relative L2 error against the sequential result
//   on the outputs of three experts (first, middle, last), after one call into zeroed outputs.
//   Then the full experts forward + backward_data + backward_weight (public API, no row_prob)
//   with FLOPs 18 N H F, for `sequential` and for `grouped` under several GroupedDefaults.
//
//   build/bench/bench_experts [--tokens T] [--topk 8] [--experts 128] [--hidden 2048]
//                             [--ffn 768] [--iters 10] [--warmup 2] [--skip-wmma]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/tensor.h"
#include "primitives/moe/experts.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/check.cuh"
#include "backend/cuda/gemm.h"
#include "backend/cuda/rng_cuda.h"
#include "backend/cuda/runtime.h"
#endif

namespace bb {
namespace {

struct Args {
  std::vector<int64_t> tokens{32768, 4096};
  int64_t topk = 8, experts = 128, hidden = 2048, ffn = 768;
  int iters = 10, warmup = 2;
  bool skip_wmma = false;
};

#ifdef BB_WITH_CUDA
const Device kGpu = Device::cuda(0);

using bench::randn_dev;

struct Timing {
  double ms = 0, host_ms = 0;
};

// Median GPU time (events on the compute stream) and host enqueue time of fn(); `before` runs
// outside the timed region (host-only work such as clearing the plan cache).
Timing time_it(const std::function<void()>& fn, int warmup, int iters,
               const std::function<void()>& before = {}) {
  for (int i = 0; i < warmup; ++i) {
    if (before) before();
    fn();
  }
  cuda::synchronize();
  cudaEvent_t start = nullptr, stop = nullptr;
  BB_CHECK_CUDA(cudaEventCreate(&start));
  BB_CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> ms, host;
  for (int i = 0; i < iters; ++i) {
    if (before) before();
    BB_CHECK_CUDA(cudaEventRecord(start, cuda::stream()));
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    BB_CHECK_CUDA(cudaEventRecord(stop, cuda::stream()));
    BB_CHECK_CUDA(cudaEventSynchronize(stop));
    float e = 0;
    BB_CHECK_CUDA(cudaEventElapsedTime(&e, start, stop));
    ms.push_back(e);
    host.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  std::sort(host.begin(), host.end());
  return {ms[ms.size() / 2], host[host.size() / 2]};
}

// Every token picks `K` distinct experts uniformly at random (splitmix64, fixed seed).
std::vector<int64_t> uniform_counts(int64_t T, int64_t K, int64_t E) {
  std::vector<int64_t> counts(E, 0), perm(E);
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&] {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) perm[e] = e;
    for (int64_t k = 0; k < K; ++k) {  // partial Fisher-Yates
      const int64_t j = k + static_cast<int64_t>(next() % static_cast<uint64_t>(E - k));
      std::swap(perm[k], perm[j]);
      ++counts[perm[k]];
    }
  }
  return counts;
}

// One grouped-GEMM call of a stage: the problems of all experts with rows.
struct Call {
  bool ta = false, tb = false;
  std::vector<cuda::GemmProblem> ps;
  int64_t lda = 0, ldb = 0, ldc = 0;
  DType c_dt = DType::bf16;
  float beta = 0.0f;
  Tensor out;  // the tensor holding every C_g (zeroed before the correctness run)
};

struct Stage {
  const char* name;
  std::vector<Call> calls;
};

const char* at(const Tensor& t, int64_t elems) {
  return static_cast<const char*>(t.raw()) + elems * static_cast<int64_t>(dtype_size(t.dtype()));
}

// out[rows of e] = rows[rows of e] op(W[e]): rows [N, Kd], W [E, Out, Kd] (trans_w) or
// [E, Kd, Out], out [N, Out] — experts.cpp's project().
Call project(const Tensor& rows, const std::vector<int64_t>& counts, const Tensor& W, bool trans_w,
             const Tensor& out) {
  Call c;
  const int64_t Kd = rows.size(1), Out = out.size(1);
  c.tb = trans_w;
  c.lda = Kd;
  c.ldb = trans_w ? Kd : Out;
  c.ldc = Out;
  c.out = out;
  int64_t off = 0;
  for (size_t e = 0; e < counts.size(); off += counts[e], ++e) {
    if (counts[e] == 0) continue;
    cuda::GemmProblem p;
    p.M = counts[e];
    p.N = Out;
    p.K = Kd;
    p.A = at(rows, off * Kd);
    p.B = at(W, static_cast<int64_t>(e) * Out * Kd);
    p.C = const_cast<char*>(at(out, off * Out));
    c.ps.push_back(p);
  }
  return c;
}

// dW[e] += A[rows of e]^T B[rows of e]: A [N, M], B [N, Nc], dW [E, M, Nc] f32 —
// experts.cpp's weight_grad().
Call weight_grad(const Tensor& A, const Tensor& B, const std::vector<int64_t>& counts,
                 const Tensor& dW, float beta = 1.0f) {
  Call c;
  const int64_t M = A.size(1), Nc = B.size(1);
  c.ta = true;
  c.lda = M;
  c.ldb = Nc;
  c.ldc = Nc;
  c.c_dt = dW.dtype();
  c.beta = beta;
  c.out = dW;
  int64_t off = 0;
  for (size_t e = 0; e < counts.size(); off += counts[e], ++e) {
    if (counts[e] == 0) continue;
    cuda::GemmProblem p;
    p.M = M;
    p.N = Nc;
    p.K = counts[e];
    p.A = at(A, off * M);
    p.B = at(B, off * Nc);
    p.C = const_cast<char*>(at(dW, static_cast<int64_t>(e) * M * Nc));
    c.ps.push_back(p);
  }
  return c;
}

struct Algo {
  std::string name;
  bool sequential = false;
  cuda::GroupedConfig cfg;
  bool cold = false;
};

void run_stage(const Stage& st, const Algo& a) {
  for (const Call& c : st.calls) {
    if (a.sequential) {
      for (const cuda::GemmProblem& p : c.ps)
        cuda::gemm(c.ta, c.tb, p.M, p.N, p.K, 1.0f, p.A, DType::bf16, c.lda, p.B, DType::bf16,
                   c.ldb, c.beta, p.C, c.c_dt, c.ldc, 0);
    } else {
      cuda::gemm_grouped(c.ta, c.tb, c.ps, 1.0f, DType::bf16, c.lda, c.ldb, c.beta, c.c_dt, c.ldc,
                         0, a.cfg);
    }
  }
}

// The outputs of the first, middle and last problem of every call, as floats (host).
std::vector<float> sample(const Stage& st) {
  std::vector<float> v;
  for (const Call& c : st.calls) {
    const size_t n = c.ps.size();
    for (size_t i : {size_t{0}, n / 2, n - 1}) {
      const cuda::GemmProblem& p = c.ps[i];
      const int64_t elems = p.M * c.ldc;
      if (c.c_dt == DType::f32) {
        std::vector<float> h(static_cast<size_t>(elems));
        cuda::memcpy(h.data(), Device::cpu(), p.C, kGpu, h.size() * 4);
        v.insert(v.end(), h.begin(), h.end());
      } else {  // bf16: the high half of an f32
        std::vector<uint16_t> h(static_cast<size_t>(elems));
        cuda::memcpy(h.data(), Device::cpu(), p.C, kGpu, h.size() * 2);
        for (uint16_t b : h) {
          const uint32_t u = static_cast<uint32_t>(b) << 16;
          float f;
          std::memcpy(&f, &u, 4);
          v.push_back(f);
        }
      }
    }
  }
  return v;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < ref.size(); ++i) {
    const double d = static_cast<double>(a[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return a.size() == ref.size() && den > 0 ? std::sqrt(num / den) : NAN;
}

double gemm_ceiling(int warmup, int iters) {
  const int64_t n = 8192;
  Tensor a = randn_dev({n, n}, DType::bf16, 1.0f, 11, MemCategory::other);
  Tensor b = randn_dev({n, n}, DType::bf16, 1.0f, 12, MemCategory::other);
  Tensor c = Tensor::empty({n, n}, DType::bf16, kGpu, MemCategory::other);
  const Timing t = time_it(
      [&] {
        cuda::gemm(false, true, n, n, n, 1.0f, a.raw(), DType::bf16, n, b.raw(), DType::bf16, n,
                   0.0f, c.raw(), DType::bf16, n, 0);
      },
      warmup, iters);
  return 2.0 * n * n * n / t.ms * 1e-9;
}

void bench_shape(const Args& args, int64_t T, double ceiling) {
  const int64_t K = args.topk, E = args.experts, H = args.hidden, F = args.ffn, N = T * K;
  const std::vector<int64_t> counts = uniform_counts(T, K, E);
  const auto [cmin, cmax] = std::minmax_element(counts.begin(), counts.end());
  int64_t mult128 = 0;
  for (int64_t c : counts) mult128 += c % 128 == 0;
  std::printf(
      "\nexperts GEMMs: T = %lld tokens, top-%lld, N = %lld rows, E = %lld, H = %lld, F = %lld; "
      "bf16 data, f32 weight grads\ncounts: min %lld, max %lld, mean %.1f, %lld multiple(s) of "
      "128; ceiling (8192^3 bf16 cuda::gemm) %.1f TFLOP/s\n",
      static_cast<long long>(T), static_cast<long long>(K), static_cast<long long>(N),
      static_cast<long long>(E), static_cast<long long>(H), static_cast<long long>(F),
      static_cast<long long>(*cmin), static_cast<long long>(*cmax),
      static_cast<double>(N) / static_cast<double>(E), static_cast<long long>(mult128), ceiling);

  const MemCategory act = MemCategory::activations;
  Tensor x = randn_dev({N, H}, DType::bf16, 1.0f, 21, MemCategory::moe);
  Tensor wgu = randn_dev({E, 2 * F, H}, DType::bf16, 0.02f, 22, MemCategory::params);
  Tensor wd = randn_dev({E, H, F}, DType::bf16, 0.02f, 23, MemCategory::params);
  Tensor a = randn_dev({N, F}, DType::bf16, 1.0f, 24, act);  // stands for p * act
  Tensor d_y = randn_dev({N, H}, DType::bf16, 1.0f, 25, MemCategory::moe);
  Tensor d_gu = randn_dev({N, 2 * F}, DType::bf16, 1.0f, 26, act);  // stands for d_gate_up
  Tensor gate_up = Tensor::empty({N, 2 * F}, DType::bf16, kGpu, act);
  Tensor y = Tensor::empty({N, H}, DType::bf16, kGpu, MemCategory::moe);
  Tensor d_a = Tensor::empty({N, F}, DType::bf16, kGpu, MemCategory::workspace);
  Tensor d_x = Tensor::empty({N, H}, DType::bf16, kGpu, MemCategory::moe);
  Tensor dwgu = Tensor::zeros({E, 2 * F, H}, DType::f32, kGpu, MemCategory::grads);
  Tensor dwd = Tensor::zeros({E, H, F}, DType::f32, kGpu, MemCategory::grads);

  const std::vector<Stage> stages = {
      {"fwd", {project(x, counts, wgu, true, gate_up), project(a, counts, wd, true, y)}},
      {"dgrad", {project(d_y, counts, wd, false, d_a), project(d_gu, counts, wgu, false, d_x)}},
      {"wgrad", {weight_grad(d_y, a, counts, dwd), weight_grad(d_gu, x, counts, dwgu)}},
      {"wgrad0", {weight_grad(d_y, a, counts, dwd, 0.0f), weight_grad(d_gu, x, counts, dwgu, 0.0f)}},
  };
  const double flop = 6.0 * static_cast<double>(N) * H * F;

  std::vector<Algo> algos;
  algos.push_back({"sequential", true, {}, false});
  algos.push_back({"cublas grouped", false, {cuda::GroupedAlgo::cublas, 0}, false});
  for (int s : {1, 2, 4, 8})
    algos.push_back({"multi_stream S=" + std::to_string(s),
                     false,
                     {cuda::GroupedAlgo::multi_stream, s},
                     false});
  if (!args.skip_wmma) algos.push_back({"wmma", false, {cuda::GroupedAlgo::wmma, 0}, false});
  algos.push_back({"mma auto (TMA where it applies)", false, {cuda::GroupedAlgo::mma, 0, 0, true}, false});
  algos.push_back({"mma auto, no TMA (wgmma fwd)", false, {cuda::GroupedAlgo::mma, 0, 0, false}, false});
  for (int tm : {64, 128})
    algos.push_back({"mma.sync BM=" + std::to_string(tm), false, {cuda::GroupedAlgo::mma, 0, tm}, false});
  algos.push_back({"sequential, cold plans", true, {}, true});
  algos.push_back(
      {"multi_stream S=4, cold plans", false, {cuda::GroupedAlgo::multi_stream, 4}, true});

  std::printf("%-6s %-30s %9s %9s %7s %9s %9s\n", "stage", "algorithm", "ms", "TFLOP/s", "% ceil",
              "host ms", "rel err");
  for (const Stage& st : stages) {
    std::vector<float> ref;
    for (const Algo& al : algos) {
      try {
        // Correctness first: one call into zeroed outputs, compared with sequential's.
        for (const Call& c : st.calls) cuda::memset_zero(c.out.raw(), c.out.nbytes());
        run_stage(st, al);
        const std::vector<float> got = sample(st);
        if (al.sequential && !al.cold) ref = got;
        const Timing t = time_it([&] { run_stage(st, al); }, args.warmup, args.iters,
                                 al.cold ? std::function<void()>(cuda::gemm_clear_cache) : nullptr);
        std::printf("%-6s %-30s %9.3f %9.1f %7.1f %9.3f %9.2e\n", st.name, al.name.c_str(), t.ms,
                    flop / t.ms * 1e-9, 100.0 * flop / t.ms * 1e-9 / ceiling, t.host_ms,
                    rel_err(got, ref));
      } catch (const Error& e) {
        const std::string msg = e.what();
        std::printf("%-6s %-30s unsupported: %s\n", st.name, al.name.c_str(),
                    msg.substr(0, std::min<size_t>(msg.size(), 110)).c_str());
      }
    }
  }

  // The whole expert MLP through the public API (no row_prob: the standard permute).
  const double flop_all = 3.0 * flop;
  struct Whole {
    std::string name;
    ExpertsImpl impl;
    cuda::GroupedDefaults defaults;
  };
  const cuda::GroupedDefaults d0 = cuda::grouped_defaults();
  std::vector<Whole> wholes = {
      {"sequential", ExpertsImpl::sequential, d0},
      {std::string("grouped (defaults: ") + cuda::grouped_algo_name(d0.same_dtype) + " / " +
           cuda::grouped_algo_name(d0.widening) + " S=" + std::to_string(d0.num_streams) + ")",
       ExpertsImpl::grouped, d0},
      {"grouped (multi_stream S=4 / multi_stream S=4)",
       ExpertsImpl::grouped,
       {cuda::GroupedAlgo::multi_stream, cuda::GroupedAlgo::multi_stream, 4}},
      {"grouped (cublas / multi_stream S=8)",
       ExpertsImpl::grouped,
       {cuda::GroupedAlgo::cublas, cuda::GroupedAlgo::multi_stream, 8}},
  };
  {
    cuda::GroupedDefaults m{cuda::GroupedAlgo::mma, cuda::GroupedAlgo::mma, 4};
    m.multi_stream_min_flops = 1e30;  // every call on the mma kernel
    wholes.push_back({"grouped (mma / mma)", ExpertsImpl::grouped, m});
    cuda::GroupedDefaults h{cuda::GroupedAlgo::mma, cuda::GroupedAlgo::multi_stream, 4};
    h.multi_stream_min_flops = 1e30;
    wholes.push_back({"grouped (mma / multi_stream S=4)", ExpertsImpl::grouped, h});
    cuda::GroupedDefaults o = d0;
    o.tma = false;
    wholes.push_back({"grouped (defaults, TMA off: the previous defaults)", ExpertsImpl::grouped, o});
  }
  if (!args.skip_wmma)
    wholes.push_back({"grouped (cublas / wmma): the old default",
                      ExpertsImpl::grouped,
                      {cuda::GroupedAlgo::cublas, cuda::GroupedAlgo::wmma, 4}});
  std::printf(
      "\nexperts forward + backward_data + backward_weight (public API; fwd / dgrad "
      "algorithm / wgrad algorithm), 18 N H F = %.2f TFLOP\n",
      flop_all * 1e-12);
  std::printf("%-52s %9s %9s %7s %9s\n", "experts", "ms", "TFLOP/s", "% ceil", "host ms");
  for (const Whole& w : wholes) {
    try {
      cuda::set_grouped_defaults(w.defaults);
      const Timing t = time_it(
          [&] {
            ExpertsSaved saved;
            experts_forward(w.impl, x, counts, wgu, wd, Tensor(), &saved);
            const ExpertsDgrad g =
                experts_backward_data(w.impl, d_y, counts, wgu, wd, Tensor(), saved);
            experts_backward_weight(w.impl, d_y, x, counts, Tensor(), saved, g, dwgu, dwd);
          },
          args.warmup, args.iters);
      std::printf("%-52s %9.3f %9.1f %7.1f %9.3f\n", w.name.c_str(), t.ms, flop_all / t.ms * 1e-9,
                  100.0 * flop_all / t.ms * 1e-9 / ceiling, t.host_ms);
    } catch (const Error& e) {
      std::printf("%-52s failed: %s\n", w.name.c_str(), e.what());
    }
  }
  cuda::set_grouped_defaults(d0);
}
#endif

}  // namespace
}  // namespace bb

int main(int argc, char** argv) {
  bb::Args args;
  bool tokens_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> int64_t {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_experts: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::stoll(argv[++i]);
    };
    if (a == "--tokens") {
      if (!tokens_given) args.tokens.clear();
      tokens_given = true;
      args.tokens.push_back(next());
    } else if (a == "--topk") {
      args.topk = next();
    } else if (a == "--experts") {
      args.experts = next();
    } else if (a == "--hidden") {
      args.hidden = next();
    } else if (a == "--ffn") {
      args.ffn = next();
    } else if (a == "--iters") {
      args.iters = static_cast<int>(std::max<int64_t>(1, next()));
    } else if (a == "--warmup") {
      args.warmup = static_cast<int>(std::max<int64_t>(0, next()));
    } else if (a == "--skip-wmma") {
      args.skip_wmma = true;
    } else {
      std::fprintf(stderr,
                   "usage: bench_experts [--tokens T]... [--topk K] [--experts E] [--hidden H] "
                   "[--ffn F] [--iters N] [--warmup N] [--skip-wmma]\n");
      return 2;
    }
  }
  if (args.topk < 1 || args.topk > args.experts) {
    std::fprintf(stderr, "bench_experts: need 1 <= topk <= experts\n");
    return 2;
  }
#ifndef BB_WITH_CUDA
  std::printf(
      "bench_experts: this build has no CUDA backend (BUMBLEBEE_CUDA=OFF); nothing to "
      "measure\n");
  return 0;
#else
  if (bb::cuda::device_count() == 0) {
    std::printf("bench_experts: no usable CUDA device (%s); nothing to measure\n",
                bb::cuda::unavailable_reason());
    return 0;
  }
  try {
    const double ceiling = bb::gemm_ceiling(args.warmup, args.iters);
    for (int64_t T : args.tokens) bb::bench_shape(args, T, ceiling);
  } catch (const bb::Error& e) {
    std::fprintf(stderr, "bench_experts: %s\n", e.what());
    return 1;
  }
  return 0;
#endif
}
