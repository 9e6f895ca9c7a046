// rope_cuda.cu — rotary position embedding kernel (rotate-half, full or partial rotary).
//
// One block per token: its threads first compute cos/sin of the R/2 angles once into shared
// memory (precise cosf/sinf, not the fast-math intrinsics, which lose accuracy for the large
// angles of long sequences), then rotate every head's pairs with 16-byte vectors when D, R/2
// and the pointers allow. The inverse frequencies come from the host (the same function the
// CPU reference uses) as a by-value kernel argument, so a = float(pos) * inv_freq is the same
// fp32 product on both sides and no host-to-device copy (or sync) is needed.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "backend/cuda/check.cuh"
#include "backend/cuda/vec.cuh"
#include "primitives/rope/rope_cuda.h"

namespace bb::cuda {
namespace {

constexpr int kThreads = 256;

struct InvFreq {
  float v[kRopeMaxHalf];
};

// x, y [T, heads, D]; pos [T]. N divides R/2 and D - R.
template <class TI, class TO, int N>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(TO* __restrict__ y, const TI* __restrict__ x, const int32_t* __restrict__ pos,
                const InvFreq f, int heads, int D, int R, float sign) {
  __shared__ float cs[kRopeMaxHalf], sn[kRopeMaxHalf];
  const int half = R / 2;
  const int64_t t = blockIdx.x;
  const float p = static_cast<float>(pos[t]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float a = p * f.v[i];
    cs[i] = cosf(a);
    sn[i] = sign * sinf(a);
  }
  __syncthreads();
  const int64_t base = t * heads * D;
  const int hv = half / N;  // vectors per half-rotation, per head
  for (int idx = threadIdx.x; idx < heads * hv; idx += blockDim.x) {
    const int h = idx / hv, i0 = (idx - h * hv) * N;
    const TI* xr = x + base + static_cast<int64_t>(h) * D;
    TO* yr = y + base + static_cast<int64_t>(h) * D;
    float x1[N], x2[N], y1[N], y2[N];
    load<TI, N>(xr + i0, x1);
    load<TI, N>(xr + i0 + half, x2);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float c = cs[i0 + k], s = sn[i0 + k];
      y1[k] = x1[k] * c - x2[k] * s;
      y2[k] = x2[k] * c + x1[k] * s;
    }
    store<TO, N>(yr + i0, y1);
    store<TO, N>(yr + i0 + half, y2);
  }
  const int tv = (D - R) / N;  // pass-through tail of partial rotary
  for (int idx = threadIdx.x; idx < heads * tv; idx += blockDim.x) {
    const int h = idx / tv, j = R + (idx - h * tv) * N;
    float v[N];
    load<TI, N>(x + base + static_cast<int64_t>(h) * D + j, v);
    store<TO, N>(y + base + static_cast<int64_t>(h) * D + j, v);
  }
}

template <class TI, class TO>
void launch(void* y, const void* x, const int32_t* positions, int64_t T, int64_t heads, int64_t D,
            int64_t R, const InvFreq& f, float sign) {
  constexpr int N = 16 / sizeof(TI);
  const int64_t half = R / 2;
  const bool vec = half % N == 0 && (D - R) % N == 0 && aligned(x, 16) && aligned(y, 16);
  auto* yo = static_cast<TO*>(y);
  auto* xi = static_cast<const TI*>(x);
  const int n = static_cast<int>(heads), d = static_cast<int>(D), r = static_cast<int>(R);
  if (vec)
    rope_kernel<TI, TO, N><<<static_cast<unsigned>(T), kThreads, 0, stream()>>>(yo, xi, positions,
                                                                              f, n, d, r, sign);
  else
    rope_kernel<TI, TO, 1><<<static_cast<unsigned>(T), kThreads, 0, stream()>>>(yo, xi, positions,
                                                                              f, n, d, r, sign);
  BB_CHECK_LAUNCH();
}

}  // namespace

void rope_apply(void* y, DType y_dtype, const void* x, DType x_dtype, const int32_t* positions,
                int64_t T, int64_t heads, int64_t D, int64_t R, const float* inv_freq, int sign) {
  BB_CHECK(R / 2 <= kRopeMaxHalf, "rope: rotary_dim ", R, " exceeds the CUDA kernel's limit ",
           2 * kRopeMaxHalf);
  if (T == 0 || heads == 0) return;
  InvFreq f{};
  std::memcpy(f.v, inv_freq, static_cast<size_t>(R / 2) * sizeof(float));
  const float s = sign < 0 ? -1.0f : 1.0f;
  const bool xb = x_dtype == DType::bf16, yb = y_dtype == DType::bf16;
  if (xb && yb)
    launch<bf16_t, bf16_t>(y, x, positions, T, heads, D, R, f, s);
  else if (xb)
    launch<bf16_t, float>(y, x, positions, T, heads, D, R, f, s);
  else if (yb)
    launch<float, bf16_t>(y, x, positions, T, heads, D, R, f, s);
  else
    launch<float, float>(y, x, positions, T, heads, D, R, f, s);
}

}  // namespace bb::cuda
