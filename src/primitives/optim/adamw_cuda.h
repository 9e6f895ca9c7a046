// adamw_cuda.h — host-side declarations of the optimizer CUDA kernels: the fused AdamW update
// and deterministic sums of squares for gradient norms. Plain C++ header: raw device pointers,
// element counts and dtypes; launches go on cuda::stream().
#pragma once

#include <cstdint>

#include "core/dtype.h"

#ifdef BB_WITH_CUDA
namespace bb::cuda {

// Per-call scalars, computed on the host exactly as the CPU path computes them.
struct AdamWScalars {
  float step_size;     // lr / (1 - beta1^t)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t)
  float decay;         // 1 - lr * weight_decay
  float beta1, beta2, eps;
  float grad_scale;    // g is read as grad_scale * grad
};

// master, grad, exp_avg, exp_avg_sq [n] f32; model [n] (model_dtype f32 or bf16) or null.
// One pass: g = grad_scale * grad; p *= decay; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps); model = p (rounded to model_dtype).
// nonfinite (device i32, may be null) is set to 1 when any new p, m or v is Inf/NaN.
void adamw_step(float* master, const float* grad, float* exp_avg, float* exp_avg_sq, void* model,
                DType model_dtype, int64_t n, const AdamWScalars& s, int32_t* nonfinite = nullptr);

// *flag (device i32) = 1 when x [n] (f32 or bf16) holds an Inf or NaN; untouched otherwise.
void mark_nonfinite(int32_t* flag, const void* x, DType dtype, int64_t n);

// Slots per tensor in the partial-sum buffer below.
constexpr int kSumSquaresSlots = 1024;

// partial [kSumSquaresSlots] doubles (device) <- per-block sums of x^2 over x [n] (f32 or bf16);
// unused slots are written as 0. Fixed grid for a given n: deterministic.
void sum_squares_partial(double* partial, const void* x, DType dtype, int64_t n);
// out[k] = sum of partial[k * kSumSquaresSlots + j], j in a fixed order, for k < num_tensors.
void sum_squares_finish(double* out, const double* partial, int64_t num_tensors);

// g [n] f32 *= s.
void scale_inplace(float* g, float s, int64_t n);

}  // namespace bb::cuda
#endif
