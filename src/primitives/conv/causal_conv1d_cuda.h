// causal_conv1d_cuda.h — host-side declarations of the depthwise causal conv1d CUDA kernels
// (equations in causal_conv1d_ref.h). Raw device pointers, f32; launches on cuda::stream().
#pragma once

#include <cstdint>

#ifdef BB_WITH_CUDA
namespace bb::cuda {

// y [T, C] written from x [T, C], w [C, W] (W in 1..4); cu [nseq + 1] i32 on the device.
// y: f32, or bf16 when y_bf16 (rounded to nearest even).
void causal_conv1d_forward(void* y, bool y_bf16, const float* x, const float* w, const int32_t* cu, int64_t nseq,
                           int64_t T, int64_t C, int64_t W, bool silu);

// Floats of workspace causal_conv1d_backward needs for T tokens, C channels, width W.
int64_t causal_conv1d_backward_workspace(int64_t T, int64_t C, int64_t W);
// dx [T, C] written, dw [C, W] accumulated (+=). Deterministic: dw is summed per fixed token
// chunk into `ws`, then the chunks in order.
void causal_conv1d_backward(float* dx, float* dw, float* ws, const float* dy, const float* x, const float* w,
                            const int32_t* cu, int64_t nseq, int64_t T, int64_t C, int64_t W, bool silu);

}  // namespace bb::cuda
#endif
