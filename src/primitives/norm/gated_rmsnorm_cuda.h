// gated_rmsnorm_cuda.h — host-side declarations of the gated RMSNorm CUDA kernels (equations in
// gated_rmsnorm_ref.h). Raw device pointers; storage f32 or bf16 per argument, math fp32;
// launches on cuda::stream().
#pragma once

#include <cstdint>

#include "core/dtype.h"

#ifdef BB_WITH_CUDA
namespace bb::cuda {

// y [rows, D] (x's dtype) = w * x / rms(x) * silu(z); x, z [rows, D], w [D].
void gated_rmsnorm_forward(void* y, const void* x, DType x_dtype, const void* z, DType z_dtype,
                           const void* w, DType w_dtype, int64_t rows, int64_t D, float eps);

// f32 elements of the workspace gated_rmsnorm_backward needs (per-block d_w partials).
int64_t gated_rmsnorm_backward_workspace(int64_t rows, int64_t D);

// dx, dz [rows, D] f32 written; dw [D] f32 accumulated (+=), summed in a fixed order
// (per-warp, per-block partials, then the blocks in order): deterministic on a given device.
void gated_rmsnorm_backward(float* dx, float* dz, float* dw, float* workspace, const void* dy,
                            DType dy_dtype, const void* x, DType x_dtype, const void* z,
                            DType z_dtype, const void* w, DType w_dtype, int64_t rows, int64_t D,
                            float eps);

}  // namespace bb::cuda
#endif
