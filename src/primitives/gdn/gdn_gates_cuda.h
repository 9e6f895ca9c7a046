// gdn_gates_cuda.h — host-side declarations of the Gated DeltaNet gate kernels (equations in
// gdn_gates_ref.h). Raw device pointers; a, b f32 or bf16, everything else f32; launches on
// cuda::stream().
#pragma once

#include <cstdint>

#include "core/dtype.h"

#ifdef BB_WITH_CUDA
namespace bb::cuda {

void gdn_gates_forward(float* g, float* beta, const void* a, DType a_dtype, const void* b, DType b_dtype,
                       const float* a_log, const float* dt, int64_t rows, int64_t Hv);

// f32 elements of workspace gdn_gates_backward needs (per-block partial sums).
int64_t gdn_gates_backward_workspace(int64_t rows, int64_t Hv);

// d_a, d_b written; d_a_log, d_dt accumulated. Deterministic: per-block partial sums over a
// fixed token range, then the blocks in order.
void gdn_gates_backward(float* d_a, float* d_b, float* d_a_log, float* d_dt, float* workspace, const float* d_g,
                        const float* d_beta, const void* a, DType a_dtype, const float* g, const float* beta,
                        const float* a_log, const float* dt, int64_t rows, int64_t Hv);

}  // namespace bb::cuda
#endif
