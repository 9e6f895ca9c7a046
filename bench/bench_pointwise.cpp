// bench_pointwise — time and achieved bandwidth of the memory-bound CUDA primitives at
// realistic sizes (T = 32768 tokens, H = 2048, 32 query heads x 128, MoE rows = T x 8 with
// F = 768, a 64M-element parameter for AdamW). Each op is timed with device events on the
// compute stream after 3 warm-up calls. GB/s counts the bytes the op must move (reads + writes
// of its tensors once), not cache traffic. Ops that read ids or norms back to the host
// (embedding, global_grad_norm) include that round trip.
//
//   build/bench/bench_pointwise            (needs a CUDA build and a GPU)
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "primitives/activation/swiglu.h"
#include "primitives/elementwise/elementwise.h"
#include "primitives/embedding/embedding.h"
#include "primitives/norm/rmsnorm.h"
#include "primitives/optim/adamw.h"
#include "primitives/rope/rope.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/check.cuh"
#include "backend/cuda/runtime.h"
#endif

namespace bb {
namespace {

#ifdef BB_WITH_CUDA
const Device kGpu = Device::cuda(0);

// Device tensor of uniform values in [-1, 1) (filled on the host once: benches only).
Tensor rand_dev(const Shape& s, DType dt, MemCategory cat = MemCategory::other, float lo = -1,
                float hi = 1) {
  const int64_t n = shape_numel(s);
  std::vector<float> v(static_cast<size_t>(n));
  uint32_t x = 12345;
  for (auto& e : v) {
    x = x * 1664525u + 1013904223u;
    e = lo + (hi - lo) * static_cast<float>(x >> 8) / 16777216.0f;
  }
  return Tensor::from_floats(v, s, dt, cat).to(kGpu);
}

// Median over 9 samples of the mean time of 10 back-to-back calls (the host runs ahead, so
// launch overhead is hidden as it is in a training step).
double median_ms(const std::function<void()>& fn) {
  cudaEvent_t a, b;
  BB_CHECK_CUDA(cudaEventCreate(&a));
  BB_CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  std::vector<float> ms;
  for (int i = 0; i < 9; ++i) {
    BB_CHECK_CUDA(cudaEventRecord(a, cuda::stream()));
    for (int k = 0; k < 10; ++k) fn();
    BB_CHECK_CUDA(cudaEventRecord(b, cuda::stream()));
    BB_CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    BB_CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t / 10);
  }
  BB_CHECK_CUDA(cudaEventDestroy(a));
  BB_CHECK_CUDA(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void row(const std::string& name, const std::string& shape, double bytes,
         const std::function<void()>& fn) {
  const double ms = median_ms(fn);
  std::printf("%-24s %-34s %9.3f ms %9.1f GB/s\n", name.c_str(), shape.c_str(), ms,
              bytes / (ms * 1e-3) / 1e9);
}

int run() {
  if (cuda::device_count() == 0) {
    std::printf("bench_pointwise: no usable CUDA device (%s)\n", cuda::unavailable_reason());
    return 0;
  }
  const int64_t T = 32768, H = 2048, nq = 32, D = 128, K = 8, F = 768, V = 151936;
  const double b16 = 2, b32 = 4;
  std::printf("%-24s %-34s %12s %14s\n", "op", "shape", "time", "bandwidth");

  {  // RMSNorm on the hidden state, bf16, f32 upstream gradient
    Tensor x = rand_dev({T, H}, DType::bf16), w = rand_dev({H}, DType::bf16, MemCategory::params);
    Tensor dy = rand_dev({T, H}, DType::f32);
    Tensor dw = Tensor::zeros({H}, DType::f32, kGpu, MemCategory::grads);
    RMSNormSaved s;
    rmsnorm_forward(x, w, 1e-6, &s);
    const double n = static_cast<double>(T * H);
    row("rmsnorm fwd", "x bf16 [32768, 2048]", n * (b16 + b16) + T * b32,
        [&] { rmsnorm_forward(x, w, 1e-6, &s); });
    row("rmsnorm bwd", "dy f32, dx f32 [32768, 2048]", n * (b32 + b16 + b32) + T * b32,
        [&] { rmsnorm_backward(dy, x, w, s, dw); });
  }
  {  // QK norm, bf16 q [T, 32, 128]
    Tensor q = rand_dev({T, nq, D}, DType::bf16), w = rand_dev({D}, DType::bf16);
    Tensor dy = rand_dev({T, nq, D}, DType::f32);
    Tensor dw = Tensor::zeros({D}, DType::f32, kGpu, MemCategory::grads);
    RMSNormSaved s;
    qk_norm_forward(q, w, 1e-6, &s);
    const double n = static_cast<double>(T * nq * D);
    row("qk_norm fwd", "q bf16 [32768, 32, 128]", n * (b16 + b16) + T * nq * b32,
        [&] { qk_norm_forward(q, w, 1e-6, &s); });
    row("qk_norm bwd", "dy f32, dx f32 [32768, 32, 128]", n * (b32 + b16 + b32) + T * nq * b32,
        [&] { qk_norm_backward(dy, q, w, s, dw); });
  }
  {  // RoPE on q, positions of a packed batch already on the device
    Tensor q = rand_dev({T, nq, D}, DType::bf16);
    std::vector<int32_t> pv(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) pv[t] = static_cast<int32_t>(t);
    Tensor pos = Tensor::from_ints(pv, {T}).to(kGpu);
    const RopeConfig cfg{1000000.0, 0};
    const double n = static_cast<double>(T * nq * D);
    row("rope fwd", "q bf16 [32768, 32, 128]", n * (b16 + b16),
        [&] { rope_forward(q, pos, cfg); });
    row("rope bwd", "dq bf16 -> f32 [32768, 32, 128]", n * (b16 + b32),
        [&] { rope_backward(q, pos, cfg); });
  }
  {  // SwiGLU on permuted expert rows
    Tensor gu = rand_dev({T * K, 2 * F}, DType::bf16, MemCategory::other, -4, 4);
    Tensor dh = rand_dev({T * K, F}, DType::bf16);
    const double n = static_cast<double>(T * K * F);
    row("swiglu fwd", "gate_up bf16 [262144, 1536]", n * (2 * b16 + b16),
        [&] { swiglu_forward(gu); });
    row("swiglu bwd", "d_h bf16 [262144, 768]", n * (2 * b16 + b16 + 2 * b16),
        [&] { swiglu_backward(dh, gu); });
  }
  {  // Residual add and the gated-shared-expert row scale
    Tensor a = rand_dev({T, H}, DType::bf16), b = rand_dev({T, H}, DType::bf16);
    Tensor acc = rand_dev({T, H}, DType::f32), g = rand_dev({T}, DType::f32);
    const double n = static_cast<double>(T * H);
    row("add", "bf16 + bf16 -> f32 [32768, 2048]", n * (b16 + b16 + b32),
        [&] { add(a, b, MemCategory::activations); });
    row("add_inplace", "f32 += bf16 [32768, 2048]", n * (b32 + b16 + b32),
        [&] { add_inplace(acc, b); });
    row("scale_rows", "bf16 * g -> f32 [32768, 2048]", n * (b16 + b32),
        [&] { scale_rows(a, g, MemCategory::activations); });
  }
  {  // Embedding: lookup, and backward (host grouping of ids + upload included)
    Tensor table = rand_dev({V, H}, DType::bf16, MemCategory::params);
    std::vector<int32_t> iv(static_cast<size_t>(T));
    uint32_t x = 7;
    for (auto& e : iv) e = static_cast<int32_t>((x = x * 1664525u + 1013904223u) % V);
    Tensor ids = Tensor::from_ints(iv, {T});
    Tensor dy = rand_dev({T, H}, DType::f32);
    Tensor dtab = Tensor::zeros({V, H}, DType::f32, kGpu, MemCategory::grads);
    const double n = static_cast<double>(T * H);
    row("embedding fwd", "ids [32768] -> bf16 [32768, 2048]", n * (b16 + b16),
        [&] { embedding_forward(ids, table); });
    row("embedding bwd", "dy f32 -> d_table f32 rows", n * (b32 + 2 * b32),
        [&] { embedding_backward(dy, ids, dtab); });
  }
  {  // AdamW over one 64M-element parameter, bf16 model copy written in the same pass
    const int64_t n = 64LL << 20;
    Tensor p = rand_dev({n}, DType::f32, MemCategory::optimizer);
    Tensor g = rand_dev({n}, DType::f32, MemCategory::grads);
    Tensor m = Tensor::zeros({n}, DType::f32, kGpu, MemCategory::optimizer);
    Tensor v = Tensor::zeros({n}, DType::f32, kGpu, MemCategory::optimizer);
    Tensor model = Tensor::zeros({n}, DType::bf16, kGpu, MemCategory::params);
    int64_t step = 0;
    const AdamWConfig cfg;
    row("adamw_step", "64M params, bf16 model", static_cast<double>(n) * (4 * b32 + 3 * b32 + b16),
        [&] { adamw_step(p, g, m, v, ++step, 1e-4, 0.1, cfg, &model); });
    row("global_grad_norm", "64M f32 (incl. host read)", static_cast<double>(n) * b32,
        [&] { global_grad_norm({g}); });
    row("scale_inplace", "64M f32", static_cast<double>(n) * 2 * b32,
        [&] { scale_inplace(g, 0.999f); });
  }
  return 0;
}
#else
int run() {
  std::printf("bench_pointwise: this build has no CUDA backend (BUMBLEBEE_CUDA=OFF)\n");
  return 0;
}
#endif

}  // namespace
}  // namespace bb

int main() {
  try {
    return bb::run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_pointwise: %s\n", e.what());
    return 1;
  }
}
