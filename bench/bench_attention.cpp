// bench_attention — causal GQA attention on one GPU through the cuDNN path: forward and
// forward+backward time and TFLOP/s for one sequence of S tokens, at several S.
//
//   bench_attention [--seq 8192,32768,65536,131072] [--hq 32] [--hkv 4] [--d 128]
//                   [--iters 5] [--warmup 2]
// FLOPs (DESIGN.md sec. 6): forward 4 * S^2/2 * Hq * D (QK^T and PV over the causal half),
// backward 2.5x that; forward+backward 3.5x. Times are CUDA events on the compute stream,
// median of --iters runs after --warmup runs (the first run also builds the cuDNN graph).
// A size that fails (out of memory, unsupported) prints a line saying why and the rest go on.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "primitives/attention/attention.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/check.cuh"
#include "backend/cuda/runtime.h"
#include "primitives/attention/attention_cudnn.h"
#endif

using namespace bb;

namespace {

#ifdef BB_WITH_CUDA
// A [S, H, D] bf16 device tensor filled by tiling a random block of up to 4096 tokens (timing
// does not depend on the values; generating S * H * D normals on the host would dominate).
Tensor random_device(int64_t S, int64_t H, int64_t D, uint64_t seed) {
  const int64_t P = std::min<int64_t>(S, 4096);
  std::vector<float> v(static_cast<size_t>(P * H * D));
  for (size_t i = 0; i < v.size(); ++i) v[i] = philox_normal(seed, i);
  Tensor block = Tensor::from_floats(v, {P, H, D}, DType::bf16).to(Device::cuda(0));
  Tensor out = Tensor::empty({S, H, D}, DType::bf16, Device::cuda(0), MemCategory::other);
  for (int64_t off = 0; off < S; off += P) {
    const int64_t n = std::min(P, S - off);
    out.narrow(off, n).copy_from(block.narrow(0, n));
  }
  return out;
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

// Median milliseconds of fn() over `iters` runs after `warmup` runs.
template <class Fn>
double time_ms(Fn&& fn, int64_t warmup, int64_t iters) {
  for (int64_t i = 0; i < warmup; ++i) fn();
  cudaEvent_t a, b;
  BB_CHECK_CUDA(cudaEventCreate(&a));
  BB_CHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int64_t i = 0; i < iters; ++i) {
    BB_CHECK_CUDA(cudaEventRecord(a, cuda::stream()));
    fn();
    BB_CHECK_CUDA(cudaEventRecord(b, cuda::stream()));
    BB_CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    BB_CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(ms);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> seqs = {8192, 32768, 65536, 131072};
  int64_t Hq = 32, Hkv = 4, D = 128, iters = 5, warmup = 2;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value after %s\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--seq") seqs = bench::parse_list(next());
    else if (a == "--hq") Hq = std::stoll(next());
    else if (a == "--hkv") Hkv = std::stoll(next());
    else if (a == "--d") D = std::stoll(next());
    else if (a == "--iters") iters = std::stoll(next());
    else if (a == "--warmup") warmup = std::stoll(next());
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
#ifndef BB_WITH_CUDA
  std::printf("bench_attention: this build has no CUDA backend; nothing to measure\n");
  return 0;
#else
  if (cuda::device_count() == 0) {
    std::printf("bench_attention: no usable CUDA device (%s); nothing to measure\n",
                cuda::unavailable_reason());
    return 0;
  }
  cudaDeviceProp prop{};
  BB_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  int64_t ver = 0;
  try {
    ver = cudnn_runtime_version();
  } catch (const Error& e) {
    std::printf("bench_attention: %s\n", e.what());
    return 1;
  }
  std::printf("attention sdpa (cuDNN %lld.%lld.%lld) on %s: Hq=%lld Hkv=%lld D=%lld, bf16, "
              "causal, one sequence of S tokens; median of %lld after %lld warm-up\n",
              static_cast<long long>(ver / 10000), static_cast<long long>(ver / 100 % 100),
              static_cast<long long>(ver % 100), prop.name, static_cast<long long>(Hq),
              static_cast<long long>(Hkv), static_cast<long long>(D),
              static_cast<long long>(iters), static_cast<long long>(warmup));
  std::printf("%8s %10s %12s %12s %16s %15s\n", "S", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms",
              "fwd+bwd TFLOP/s", "workspace peak");
  Allocator& alloc = allocator_for(Device::cuda(0));
  for (int64_t S : seqs) {
    try {
      const float scale = 1.0f / std::sqrt(static_cast<float>(D));
      Tensor q = random_device(S, Hq, D, 1), k = random_device(S, Hkv, D, 2);
      Tensor v = random_device(S, Hkv, D, 3), d_o = random_device(S, Hq, D, 4);
      Tensor cu = Tensor::from_ints({0, static_cast<int32_t>(S)}, {2});
      alloc.reset_peak();
      const int64_t ws_before = alloc.stats().live_of(MemCategory::workspace);
      AttentionSaved saved;
      Tensor o;
      const double fwd = time_ms([&] { o = attention_forward(q, k, v, AttentionArgs::causal_self(cu, scale), &saved); },
                                 warmup, iters);
      const double both = time_ms(
          [&] {
            AttentionSaved s2;
            Tensor o2 = attention_forward(q, k, v, AttentionArgs::causal_self(cu, scale), &s2);
            attention_backward(d_o, q, k, v, o2, AttentionArgs::causal_self(cu, scale), s2);
          },
          warmup, iters);
      const int64_t ws_peak = alloc.stats().peak_of(MemCategory::workspace) - ws_before;
      const double flops_fwd = 4.0 * (static_cast<double>(S) * S / 2.0) * Hq * D;
      std::printf("%8lld %10.3f %12.1f %12.3f %16.1f %15s\n", static_cast<long long>(S), fwd,
                  flops_fwd / (fwd * 1e-3) / 1e12, both, 3.5 * flops_fwd / (both * 1e-3) / 1e12,
                  format_bytes(ws_peak).c_str());
    } catch (const Error& e) {
      std::string msg = e.what();
      msg = msg.substr(0, msg.find('\n'));
      std::printf("%8lld skipped: %s\n", static_cast<long long>(S), msg.c_str());
    }
    std::fflush(stdout);
  }
  return 0;
#endif
}
