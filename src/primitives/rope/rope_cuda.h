// rope_cuda.h — host-side declaration of the rotary position embedding CUDA kernel.
//
// Raw device pointers, sizes and dtypes (f32 or bf16 storage, fp32 math); the launch goes on
// cuda::stream(). rope.h's Tensor API checks shapes and calls this. The backward is the same
// kernel with sign = -1 (rotation by -a) and an f32 output.
#pragma once

#include <cstdint>

#include "core/dtype.h"

#ifdef BB_WITH_CUDA
namespace bb::cuda {

// Largest R/2 the kernel takes: the inverse frequencies travel as a kernel argument.
constexpr int64_t kRopeMaxHalf = 256;

// x [T, n, D] (x_dtype) in, y [T, n, D] (y_dtype) out, positions [T] i32 on the device.
// inv_freq [R/2] is a HOST array (ref::rope_inv_freq, so angles equal the CPU's bit for bit):
//   a = float(pos_t) * inv_freq_i,  y_i = x_i cos a - x_{i+R/2} s,  y_{i+R/2} = x_{i+R/2} cos a
//   + x_i s,  s = sign * sin a;  y_j = x_j for R <= j < D.
void rope_apply(void* y, DType y_dtype, const void* x, DType x_dtype, const int32_t* positions,
                int64_t T, int64_t heads, int64_t D, int64_t R, const float* inv_freq, int sign);

}  // namespace bb::cuda
#endif
