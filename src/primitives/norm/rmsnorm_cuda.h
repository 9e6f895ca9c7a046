// rmsnorm_cuda.h — host-side declarations of the RMSNorm CUDA kernels (plain C++ header).
//
// Raw device pointers, sizes and dtypes only; all launches go on cuda::stream(). Storage
// dtypes are f32 or bf16, math is fp32. The Tensor-level API in rmsnorm.h checks shapes and
// devices and then calls these.
//
// Accumulation convention: d_w is ACCUMULATED (+=), d_x is WRITTEN (=).
#pragma once

#include <cstdint>

#include "core/dtype.h"

#ifdef BB_WITH_CUDA
namespace bb::cuda {

// x [rows, H] (x_dtype) and w [H] (w_dtype) in; y [rows, H] (x_dtype) and rstd [rows] f32 out:
//   rstd_t = 1 / sqrt(mean_h x_th^2 + eps),  y_th = (w_offset + w_h) * (x_th * rstd_t).
// w_offset is 0 for the classic norm, 1 for the zero-centred one (Qwen3-Next / Qwen3.5).
void rmsnorm_forward(void* y, float* rstd, const void* x, DType x_dtype, const void* w,
                     DType w_dtype, float w_offset, int64_t rows, int64_t H, float eps);

// Number of f32 elements of the workspace rmsnorm_backward needs (per-block d_w partials).
int64_t rmsnorm_backward_workspace(int64_t rows, int64_t H);

// d_y [rows, H] (dy_dtype), x [rows, H] (x_dtype), w [H] (w_dtype), rstd [rows] f32 in;
// d_x [rows, H] written in dx_dtype (f32, or bf16 rounded once from the f32 value); d_w [H] f32
// accumulated; workspace f32 of the size above.
//   d_x = rstd * (d_y w' - xhat * mean_h(d_y w' xhat)),  d_w += sum_t d_y * xhat,
// w' = w_offset + w.
// d_w is summed in a fixed order (per-block partials, then one reduce): deterministic.
// residual (optional, f32 [rows, H], not dx): added to d_x in the same pass, rounded as adding
// it afterwards would (the residual stream's gradient without its own read-modify-write pass).
void rmsnorm_backward(void* dx, DType dx_dtype, float* dw, float* workspace, const void* dy,
                      DType dy_dtype, const void* x, DType x_dtype, const void* w, DType w_dtype,
                      float w_offset, const float* rstd, int64_t rows, int64_t H,
                      const float* residual = nullptr);

}  // namespace bb::cuda
#endif
