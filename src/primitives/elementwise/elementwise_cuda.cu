// elementwise_cuda.cu — one grid-stride kernel shape for every pointwise op: V = 4 elements per
// step (a 16-byte f32 or 8-byte bf16 access) when all pointers are aligned, then a scalar tail;
// V = 1 otherwise. Each op is a small functor that loads, computes in fp32 and stores.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/check.cuh"
#include "backend/cuda/vec.cuh"
#include "primitives/elementwise/elementwise_cuda.h"

namespace bb::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;

// Elements [0, n): vectors of V first, then the n % V tail one by one.
template <int V, class Op>
__global__ void __launch_bounds__(kThreads) flat_kernel(int64_t n, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nv = n / V;
  for (int64_t i = gid; i < nv; i += stride) op.template apply<V>(i * V);
  for (int64_t i = nv * V + gid; i < n; i += stride) op.template apply<1>(i);
}

template <class TB>
struct Axpy {
  float* a;
  const TB* b;
  float s;
  template <int M>
  __device__ void apply(int64_t i) const {
    float av[M], bv[M];
    load<float, M>(a + i, av);
    load<TB, M>(b + i, bv);
#pragma unroll
    for (int k = 0; k < M; ++k) av[k] += s * bv[k];
    store<float, M>(a + i, av);
  }
};

template <class TA, class TB>
struct Add {
  float* out;
  const TA* a;
  const TB* b;
  template <int M>
  __device__ void apply(int64_t i) const {
    float av[M], bv[M];
    load<TA, M>(a + i, av);
    load<TB, M>(b + i, bv);
#pragma unroll
    for (int k = 0; k < M; ++k) av[k] += bv[k];
    store<float, M>(out + i, av);
  }
};

// M elements never straddle a row: the host picks V = kVec only when kVec divides H.
template <class TX>
struct ScaleRows {
  float* out;
  const TX* x;
  const void* g;
  bool g_bf16;
  int64_t H;
  template <int M>
  __device__ void apply(int64_t i) const {
    const int64_t t = i / H;
    const float gt =
        g_bf16 ? to_f32(static_cast<const bf16_t*>(g)[t]) : static_cast<const float*>(g)[t];
    float xv[M];
    load<TX, M>(x + i, xv);
#pragma unroll
    for (int k = 0; k < M; ++k) xv[k] *= gt;
    store<float, M>(out + i, xv);
  }
};

template <class TX>
struct Sigmoid {
  float* out;
  const TX* x;
  template <int M>
  __device__ void apply(int64_t i) const {
    float xv[M];
    load<TX, M>(x + i, xv);
#pragma unroll
    for (int k = 0; k < M; ++k) xv[k] = 1.0f / (1.0f + expf(-xv[k]));
    store<float, M>(out + i, xv);
  }
};

// y = x * sigmoid(z) (y in x's storage type).
template <class TX, class TZ>
struct SigmoidMul {
  TX* y;
  const TX* x;
  const TZ* z;
  template <int M>
  __device__ void apply(int64_t i) const {
    float xv[M], zv[M];
    load<TX, M>(x + i, xv);
    load<TZ, M>(z + i, zv);
#pragma unroll
    for (int k = 0; k < M; ++k) xv[k] = xv[k] / (1.0f + expf(-zv[k]));
    store<TX, M>(y + i, xv);
  }
};

template <class TG, class TX, class TZ>
struct SigmoidMulBackward {
  float* d_x;
  float* d_z;
  const TG* d_y;
  const TX* x;
  const TZ* z;
  template <int M>
  __device__ void apply(int64_t i) const {
    float gv[M], xv[M], zv[M], dx[M], dz[M];
    load<TG, M>(d_y + i, gv);
    load<TX, M>(x + i, xv);
    load<TZ, M>(z + i, zv);
#pragma unroll
    for (int k = 0; k < M; ++k) {
      const float s = 1.0f / (1.0f + expf(-zv[k]));
      dx[k] = gv[k] * s;
      dz[k] = gv[k] * xv[k] * s * (1.0f - s);
    }
    store<float, M>(d_x + i, dx);
    store<float, M>(d_z + i, dz);
  }
};

// Element i of an [R, C] half: row i / C, column i % C of the [R, 2C] whole. M elements never
// straddle a row: the host picks V = kVec only when kVec divides C.
template <class T>
struct SplitHalves {
  T* a;
  T* b;
  const T* x;
  int64_t C;
  template <int M>
  __device__ void apply(int64_t i) const {
    const int64_t r = i / C, c = i % C;
    float v[M];
    load<T, M>(x + r * 2 * C + c, v);
    store<T, M>(a + i, v);
    load<T, M>(x + r * 2 * C + C + c, v);
    store<T, M>(b + i, v);
  }
};

template <class TO, class TA, class TB>
struct JoinHalves {
  TO* out;
  const TA* a;
  const TB* b;
  int64_t C;
  template <int M>
  __device__ void apply(int64_t i) const {
    const int64_t r = i / C, c = i % C;
    float v[M];
    load<TA, M>(a + i, v);
    store<TO, M>(out + r * 2 * C + c, v);
    load<TB, M>(b + i, v);
    store<TO, M>(out + r * 2 * C + C + c, v);
  }
};

// Calls f(TypeTag<T>{}) with T the storage type of dt (f32 or bf16).
template <class T>
struct TypeTag {
  using type = T;
};
template <class F>
void with_type(DType dt, F&& f) {
  if (dt == DType::bf16) f(TypeTag<bf16_t>{});
  else f(TypeTag<float>{});
}

template <class Op>
void launch(int64_t n, bool vec, const Op& op) {
  if (n == 0) return;
  const unsigned blocks = grid_stride_blocks(vec ? ceil_div(n, kVec) : n, kThreads);
  if (vec)
    flat_kernel<kVec, Op><<<blocks, kThreads, 0, stream()>>>(n, op);
  else
    flat_kernel<1, Op><<<blocks, kThreads, 0, stream()>>>(n, op);
  BB_CHECK_LAUNCH();
}

size_t vec_bytes(DType dt) { return kVec * dtype_size(dt); }

template <class TA, class TB>
__global__ void __launch_bounds__(kThreads)
    gate_backward_kernel(float* d_z, const TA* d_y, const TB* s, const void* g, bool g_bf16,
                         int64_t T, int64_t H) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= T) return;
  float acc = 0.0f;
  for (int64_t h = lane; h < H; h += 32)
    acc += to_f32(d_y[row * H + h]) * to_f32(s[row * H + h]);
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) {
    const float gt =
        g_bf16 ? to_f32(static_cast<const bf16_t*>(g)[row]) : static_cast<const float*>(g)[row];
    d_z[row] = acc * gt * (1.0f - gt);
  }
}

template <class TA, class TB>
void launch_gate_backward(float* d_z, const void* d_y, const void* s, const void* g, bool g_bf16,
                          int64_t T, int64_t H) {
  if (T == 0) return;
  const auto blocks = static_cast<unsigned>(ceil_div(T, int64_t{kThreads / 32}));
  gate_backward_kernel<TA, TB><<<blocks, kThreads, 0, stream()>>>(
      d_z, static_cast<const TA*>(d_y), static_cast<const TB*>(s), g, g_bf16, T, H);
  BB_CHECK_LAUNCH();
}

}  // namespace

void sigmoid_gate_backward(float* d_z, const void* d_y, DType dy_dtype, const void* s,
                           DType s_dtype, const void* g, DType g_dtype, int64_t T, int64_t H) {
  const bool gb = g_dtype == DType::bf16;
  const bool a16 = dy_dtype == DType::bf16, b16 = s_dtype == DType::bf16;
  if (a16 && b16)
    launch_gate_backward<bf16_t, bf16_t>(d_z, d_y, s, g, gb, T, H);
  else if (a16)
    launch_gate_backward<bf16_t, float>(d_z, d_y, s, g, gb, T, H);
  else if (b16)
    launch_gate_backward<float, bf16_t>(d_z, d_y, s, g, gb, T, H);
  else
    launch_gate_backward<float, float>(d_z, d_y, s, g, gb, T, H);
}

void axpy_inplace(float* a, float s, const void* b, DType b_dtype, int64_t n) {
  const bool vec = aligned(a, 16) && aligned(b, vec_bytes(b_dtype));
  if (b_dtype == DType::bf16)
    launch(n, vec, Axpy<bf16_t>{a, static_cast<const bf16_t*>(b), s});
  else
    launch(n, vec, Axpy<float>{a, static_cast<const float*>(b), s});
}

void add(float* out, const void* a, DType a_dtype, const void* b, DType b_dtype, int64_t n) {
  const bool vec = aligned(out, 16) && aligned(a, vec_bytes(a_dtype)) &&
                   aligned(b, vec_bytes(b_dtype));
  const bool ab = a_dtype == DType::bf16, bb = b_dtype == DType::bf16;
  const auto* a16 = static_cast<const bf16_t*>(a);
  const auto* a32 = static_cast<const float*>(a);
  const auto* b16 = static_cast<const bf16_t*>(b);
  const auto* b32 = static_cast<const float*>(b);
  if (ab && bb)
    launch(n, vec, Add<bf16_t, bf16_t>{out, a16, b16});
  else if (ab)
    launch(n, vec, Add<bf16_t, float>{out, a16, b32});
  else if (bb)
    launch(n, vec, Add<float, bf16_t>{out, a32, b16});
  else
    launch(n, vec, Add<float, float>{out, a32, b32});
}

void scale_rows(float* out, const void* x, DType x_dtype, const void* g, DType g_dtype, int64_t T,
                int64_t H) {
  const bool vec = H % kVec == 0 && aligned(out, 16) && aligned(x, vec_bytes(x_dtype));
  const bool gb = g_dtype == DType::bf16;
  if (x_dtype == DType::bf16)
    launch(T * H, vec, ScaleRows<bf16_t>{out, static_cast<const bf16_t*>(x), g, gb, H});
  else
    launch(T * H, vec, ScaleRows<float>{out, static_cast<const float*>(x), g, gb, H});
}

void sigmoid(float* out, const void* x, DType x_dtype, int64_t n) {
  const bool vec = aligned(out, 16) && aligned(x, vec_bytes(x_dtype));
  if (x_dtype == DType::bf16)
    launch(n, vec, Sigmoid<bf16_t>{out, static_cast<const bf16_t*>(x)});
  else
    launch(n, vec, Sigmoid<float>{out, static_cast<const float*>(x)});
}

void sigmoid_mul(void* y, const void* x, DType x_dtype, const void* z, DType z_dtype, int64_t n) {
  const bool vec = aligned(y, vec_bytes(x_dtype)) && aligned(x, vec_bytes(x_dtype)) &&
                   aligned(z, vec_bytes(z_dtype));
  with_type(x_dtype, [&](auto tx) {
    using TX = typename decltype(tx)::type;
    with_type(z_dtype, [&](auto tz) {
      using TZ = typename decltype(tz)::type;
      launch(n, vec, SigmoidMul<TX, TZ>{static_cast<TX*>(y), static_cast<const TX*>(x),
                                        static_cast<const TZ*>(z)});
    });
  });
}

void sigmoid_mul_backward(float* d_x, float* d_z, const void* d_y, DType dy_dtype, const void* x,
                          DType x_dtype, const void* z, DType z_dtype, int64_t n) {
  const bool vec = aligned(d_x, 16) && aligned(d_z, 16) && aligned(d_y, vec_bytes(dy_dtype)) &&
                   aligned(x, vec_bytes(x_dtype)) && aligned(z, vec_bytes(z_dtype));
  with_type(dy_dtype, [&](auto tg) {
    using TG = typename decltype(tg)::type;
    with_type(x_dtype, [&](auto tx) {
      using TX = typename decltype(tx)::type;
      with_type(z_dtype, [&](auto tz) {
        using TZ = typename decltype(tz)::type;
        launch(n, vec,
               SigmoidMulBackward<TG, TX, TZ>{d_x, d_z, static_cast<const TG*>(d_y),
                                              static_cast<const TX*>(x), static_cast<const TZ*>(z)});
      });
    });
  });
}

void split_halves(void* a, void* b, const void* x, DType dtype, int64_t R, int64_t C) {
  const bool vec = C % kVec == 0 && aligned(a, vec_bytes(dtype)) && aligned(b, vec_bytes(dtype)) &&
                   aligned(x, vec_bytes(dtype));
  with_type(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    launch(R * C, vec,
           SplitHalves<T>{static_cast<T*>(a), static_cast<T*>(b), static_cast<const T*>(x), C});
  });
}

void join_halves(void* out, DType out_dtype, const void* a, DType a_dtype, const void* b,
                 DType b_dtype, int64_t R, int64_t C) {
  const bool vec = C % kVec == 0 && aligned(out, vec_bytes(out_dtype)) &&
                   aligned(a, vec_bytes(a_dtype)) && aligned(b, vec_bytes(b_dtype));
  with_type(out_dtype, [&](auto to) {
    using TO = typename decltype(to)::type;
    with_type(a_dtype, [&](auto ta) {
      using TA = typename decltype(ta)::type;
      with_type(b_dtype, [&](auto tb) {
        using TB = typename decltype(tb)::type;
        launch(R * C, vec,
               JoinHalves<TO, TA, TB>{static_cast<TO*>(out), static_cast<const TA*>(a),
                                      static_cast<const TB*>(b), C});
      });
    });
  });
}

}  // namespace bb::cuda
