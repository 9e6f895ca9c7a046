// embedding_cuda.h — host-side declarations of the embedding CUDA kernels (plain C++ header).
//
// Raw device pointers, sizes and dtypes; launches go on cuda::stream(). Legend: T tokens,
// V vocab, H hidden, U distinct ids in the batch.
// Accumulation convention: d_table is ACCUMULATED (+=).
#pragma once

#include <cstdint>

#include "core/dtype.h"

#ifdef BB_WITH_CUDA
namespace bb::cuda {

// y [T, row_bytes] <- table[ids[t]] rows, a byte copy (any dtype). ids [T] i32 on the device,
// already range-checked by the caller.
void embedding_forward(void* y, const void* table, const int32_t* ids, int64_t T,
                       int64_t row_bytes);

// d_table [V, H] f32 (+=) from d_y [T, H] (f32 or bf16). The batch is given grouped by id (the
// caller sorts on the host): for group u, token rows order[seg_start[u] .. seg_start[u+1]) in
// ascending t all belong to id seg_id[u]. One block column per group adds them in that order
// onto d_table's row: no atomics, and the same rounding as the CPU loop (bitwise equal for f32).
// order [T], seg_start [U+1], seg_id [U]: i32 on the device.
void embedding_backward(float* d_table, const void* d_y, DType dy_dtype, const int32_t* order,
                        const int32_t* seg_start, const int32_t* seg_id, int64_t U, int64_t H);

}  // namespace bb::cuda
#endif
