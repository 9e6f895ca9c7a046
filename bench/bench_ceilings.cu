// bench_ceilings — the two ceilings every GPU number is read against (DESIGN.md sec. 6,
// METHOD: "two numbers first"): dense bf16 GEMM rate and device-memory bandwidth.
//
//   bench_ceilings [--n 8192] [--gib 1] [--iters 20] [--warmup 3]
// Rows of the table:
//   gemm bf16      C[n,n] (bf16) = A[n,n] B[n,n]^T through cuda::gemm (cuBLASLt, fp32 accumulate);
//                  FLOPs 2 n^3; random data (zeros run faster and would flatter the number).
//   gemm bf16->f32 the same product written in f32 (the wgrad / dgrad shape of our GEMMs).
//   d2d copy       cudaMemcpyAsync of --gib GiB; bytes counted = read + written = 2 x size.
//   copy kernel    y = x * 1.0001 over --gib GiB of f32 with 16-byte loads/stores; bytes as above.
// Times are CUDA events on the compute stream around each run, median of --iters runs after
// --warmup runs. Without a GPU (or in a build without CUDA) it says so and exits with code 0.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifdef BB_WITH_CUDA
#include <cuda_bf16.h>

#include "backend/cuda/check.cuh"
#include "backend/cuda/gemm.h"
#include "backend/cuda/runtime.h"
#include "core/tensor.h"
#endif

namespace {

struct Args {
  int64_t n = 8192;
  double gib = 1.0;
  int iters = 20, warmup = 3;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--n")
      a.n = std::stoll(v);
    else if (k == "--gib")
      a.gib = std::stod(v);
    else if (k == "--iters")
      a.iters = std::max(1, std::stoi(v));
    else if (k == "--warmup")
      a.warmup = std::max(0, std::stoi(v));
    else {
      std::fprintf(stderr, "bench_ceilings: unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

#ifdef BB_WITH_CUDA
using namespace bb;

// Uniform values in [-1, 1) from a hash of the index (no host round trip for 128M elements).
__global__ void fill_random_bf16(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32);
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16_rn(static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f);
  }
}

__global__ void scale_copy(float4* __restrict__ y, const float4* __restrict__ x, int64_t n4) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float4 v = x[i];
    v.x *= 1.0001f;
    v.y *= 1.0001f;
    v.z *= 1.0001f;
    v.w *= 1.0001f;
    y[i] = v;
  }
}

// Median milliseconds of `fn` over iters runs after warmup runs.
template <class Fn>
double time_ms(const Args& a, Fn&& fn) {
  cudaEvent_t e0, e1;
  BB_CHECK_CUDA(cudaEventCreate(&e0));
  BB_CHECK_CUDA(cudaEventCreate(&e1));
  for (int i = 0; i < a.warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < a.iters; ++i) {
    BB_CHECK_CUDA(cudaEventRecord(e0, cuda::stream()));
    fn();
    BB_CHECK_CUDA(cudaEventRecord(e1, cuda::stream()));
    BB_CHECK_CUDA(cudaEventSynchronize(e1));
    float t = 0;
    BB_CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int run(const Args& a) {
  const Device dev = Device::cuda(0);
  cudaDeviceProp prop{};
  BB_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (%d SMs), iters %d (median), warmup %d\n\n", prop.name,
              prop.multiProcessorCount, a.iters, a.warmup);
  std::printf("%-16s %-34s %10s %12s\n", "what", "size", "ms", "rate");

  {  // GEMM
    const int64_t n = a.n;
    Tensor A = Tensor::empty({n, n}, DType::bf16, dev, MemCategory::other);
    Tensor B = Tensor::empty({n, n}, DType::bf16, dev, MemCategory::other);
    const int blocks = 4096;
    fill_random_bf16<<<blocks, 256, 0, cuda::stream()>>>(static_cast<__nv_bfloat16*>(A.raw()),
                                                         n * n, 1u);
    BB_CHECK_LAUNCH();
    fill_random_bf16<<<blocks, 256, 0, cuda::stream()>>>(static_cast<__nv_bfloat16*>(B.raw()),
                                                         n * n, 2u);
    BB_CHECK_LAUNCH();
    const double flops = 2.0 * static_cast<double>(n) * n * n;
    for (DType out : {DType::bf16, DType::f32}) {
      Tensor C = Tensor::empty({n, n}, out, dev, MemCategory::other);
      const double ms = time_ms(a, [&] {
        cuda::gemm(false, true, n, n, n, 1.0f, A.raw(), DType::bf16, n, B.raw(), DType::bf16, n,
                   0.0f, C.raw(), out, n, 0);
      });
      const std::string what = out == DType::bf16 ? "gemm bf16" : "gemm bf16->f32";
      const std::string size = std::to_string(n) + "^3, C " + dtype_name(out);
      std::printf("%-16s %-34s %10.3f %8.1f TFLOP/s\n", what.c_str(), size.c_str(), ms,
                  flops / (ms * 1e-3) / 1e12);
    }
  }
  {  // bandwidth
    const int64_t bytes = static_cast<int64_t>(a.gib * (1 << 30)) / 16 * 16;
    Tensor x = Tensor::empty({bytes / 4}, DType::f32, dev, MemCategory::other);
    Tensor y = Tensor::empty({bytes / 4}, DType::f32, dev, MemCategory::other);
    x.fill_(1.0);
    const double moved = 2.0 * static_cast<double>(bytes);  // read + write
    char size[64];
    std::snprintf(size, sizeof(size), "%.2f GiB (counted 2x: read+write)", bytes / double(1 << 30));
    double ms = time_ms(a, [&] {
      BB_CHECK_CUDA(cudaMemcpyAsync(y.raw(), x.raw(), static_cast<size_t>(bytes),
                                    cudaMemcpyDeviceToDevice, cuda::stream()));
    });
    std::printf("%-16s %-34s %10.3f %8.1f GB/s\n", "d2d copy", size, ms, moved / (ms * 1e-3) / 1e9);
    const int64_t n4 = bytes / 16;
    const int blocks = prop.multiProcessorCount * 8;
    ms = time_ms(a, [&] {
      scale_copy<<<blocks, 512, 0, cuda::stream()>>>(static_cast<float4*>(y.raw()),
                                                     static_cast<const float4*>(x.raw()), n4);
      BB_CHECK_LAUNCH();
    });
    std::printf("%-16s %-34s %10.3f %8.1f GB/s\n", "copy kernel", size, ms,
                moved / (ms * 1e-3) / 1e9);
    // The kernel must have done its job (a bandwidth number for a no-op would be meaningless).
    const std::vector<float> head = y.narrow(0, 4).to_floats();
    for (float v : head)
      BB_CHECK(v == 1.0001f, "bench_ceilings: copy kernel produced ", v, ", expected 1.0001");
  }
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
#ifdef BB_WITH_CUDA
  if (bb::cuda::device_count() == 0) {
    std::printf("bench_ceilings: no usable CUDA device (%s); nothing to measure.\n",
                bb::cuda::unavailable_reason());
    return 0;
  }
  try {
    return run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_ceilings: %s\n", e.what());
    return 1;
  }
#else
  (void)a;
  std::printf(
      "bench_ceilings: this build has no CUDA backend (BUMBLEBEE_CUDA=OFF); nothing to "
      "measure.\n");
  return 0;
#endif
}
