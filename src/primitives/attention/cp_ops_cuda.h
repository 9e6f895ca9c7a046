// cp_ops_cuda.h — host-side declarations of the CUDA kernels behind cp_ops.h. Raw device
// pointers; `rows` are device int32 lists; launches go on cuda::stream().
#pragma once

#include <cstdint>

#include "core/dtype.h"

#ifdef BB_WITH_CUDA
namespace bb::cuda::cp {

// out[i] = src[rows[i]] for rows of `row_elems` elements of `elem_bytes` (2 or 4) bytes.
void gather_rows(void* out, const void* src, const int32_t* rows, int64_t n, int64_t row_elems, int elem_bytes);
// dst [., W] f32: dst[rows[i]] += src[i] (src_dtype f32 or bf16).
void scatter_add_rows(float* dst, const void* src, DType src_dtype, const int32_t* rows, int64_t n, int64_t W);
// out [H, n] = lse [H, T] columns rows.
void gather_cols(float* out, const float* lse, const int32_t* rows, int64_t H, int64_t T, int64_t n);
// cp_ops.h merge_partial.
void merge_partial(float* o_acc, float* lse_acc, const void* o_p, DType p_dtype, const float* lse_p,
                   const int32_t* rows, int64_t n, int64_t T, int64_t H, int64_t D);
// out [P T, hc, D] from src [T, H, D]; start [P] device int32.
void split_heads(void* out, const void* src, int elem_bytes, const int32_t* start, int64_t P, int64_t T,
                 int64_t H, int64_t hc, int64_t D);
// dst [T, H, D] = src [P T, hc, D] blocks (same dtype); start [P] device int32.
void join_heads(void* dst, const void* src, int elem_bytes, const int32_t* start, int64_t P, int64_t T, int64_t H,
                int64_t hc, int64_t D);
// dst [T, H, D] f32, heads [start, start + hc) += one block src [T, hc, D].
void join_heads_add(float* dst, const void* src, DType src_dtype, int64_t start, int64_t T, int64_t H, int64_t hc,
                    int64_t D);

}  // namespace bb::cuda::cp
#endif
