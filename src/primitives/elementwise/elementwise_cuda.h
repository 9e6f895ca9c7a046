// elementwise_cuda.h — host-side declarations of the pointwise CUDA kernels behind
// elementwise.h (residual adds, axpy, row gates, sigmoid). Plain C++ header: raw device
// pointers, element counts and dtypes (inputs f32 or bf16; outputs f32); launches go on
// cuda::stream(). Each kernel is one pass over memory.
#pragma once

#include <cstdint>

#include "core/dtype.h"

#ifdef BB_WITH_CUDA
namespace bb::cuda {

// a [n] f32 (in/out) += s * b [n] (b_dtype).
void axpy_inplace(float* a, float s, const void* b, DType b_dtype, int64_t n);
// out [n] f32 = a [n] (a_dtype) + b [n] (b_dtype).
void add(float* out, const void* a, DType a_dtype, const void* b, DType b_dtype, int64_t n);
// out [T, H] f32 = x [T, H] (x_dtype) * g [T] (g_dtype) per row.
void scale_rows(float* out, const void* x, DType x_dtype, const void* g, DType g_dtype, int64_t T,
                int64_t H);
// out [n] f32 = 1 / (1 + exp(-x)), x [n] (x_dtype).
void sigmoid(float* out, const void* x, DType x_dtype, int64_t n);
// d_z [T] f32 = (sum_h d_y[t, h] * s[t, h]) * g[t] * (1 - g[t]); one warp per row.
void sigmoid_gate_backward(float* d_z, const void* d_y, DType dy_dtype, const void* s,
                           DType s_dtype, const void* g, DType g_dtype, int64_t T, int64_t H);
// y [n] (x_dtype) = x * sigmoid(z) element-wise.
void sigmoid_mul(void* y, const void* x, DType x_dtype, const void* z, DType z_dtype, int64_t n);
// d_x [n] f32 = d_y * s, d_z [n] f32 = d_y * x * s * (1 - s), s = sigmoid(z).
void sigmoid_mul_backward(float* d_x, float* d_z, const void* d_y, DType dy_dtype, const void* x,
                          DType x_dtype, const void* z, DType z_dtype, int64_t n);
// a, b [R, C] = the halves of x [R, 2C] (one dtype).
void split_halves(void* a, void* b, const void* x, DType dtype, int64_t R, int64_t C);
// out [R, 2C] (out_dtype) = [a | b], a, b [R, C].
void join_halves(void* out, DType out_dtype, const void* a, DType a_dtype, const void* b,
                 DType b_dtype, int64_t R, int64_t C);

}  // namespace bb::cuda
#endif
