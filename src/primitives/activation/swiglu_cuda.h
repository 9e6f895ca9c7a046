// swiglu_cuda.h — host-side declarations of the SwiGLU CUDA kernels (plain C++ header).
//
// Raw device pointers, sizes and dtypes (f32 or bf16 storage, fp32 math); launches go on
// cuda::stream(). Legend: N rows, F ffn dim; gate_up rows are [gate (F) | up (F)].
// No parameters; the backward WRITES d_gate_up (=).
#pragma once

#include <cstdint>

#include "core/dtype.h"

#ifdef BB_WITH_CUDA
namespace bb::cuda {

// gate_up [N, 2F] (dtype) in; h [N, F] (dtype) out:  h = silu(gate) * up.
void swiglu_forward(void* h, const void* gate_up, DType dtype, int64_t N, int64_t F);

// d_h [N, F] (dh_dtype), gate_up [N, 2F] (dtype) in; d_gate_up [N, 2F] (dtype) out:
//   d_gate = d_h * up * s * (1 + gate * (1 - s)),  d_up = d_h * gate * s,  s = sigmoid(gate).
void swiglu_backward(void* d_gate_up, const void* d_h, DType dh_dtype, const void* gate_up,
                     DType dtype, int64_t N, int64_t F);

}  // namespace bb::cuda
#endif
