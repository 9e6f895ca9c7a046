// linear.h — dense projections (the GEMM primitive), Hugging Face weight layout [out, in].
//
//   x   [T, in]   f32 or bf16       activations
//   w   [out, in] f32 or bf16       weight (params)
//   b   [out]     optional bias (Qwen2 q/k/v projections)
//   y   [T, out]  x's dtype, category `out_cat`:   y = x @ w^T (+ b)
// Backward is split so the runtime can delay wgrad:
//   linear_backward_data:   d_x = d_y @ w            (written, f32, or bf16 rounded once from the
//                                                     f32 accumulator; _acc: added, d_x += d_y @ w)
//   linear_backward_weight: d_w += d_y^T @ x ; d_b += sum_t d_y   (accumulated, f32)
// `matmul` is the general form used by other primitives: all transpose combinations,
// C = alpha * op(A) @ op(B) + beta * C, fp32 accumulation.
#pragma once

#include "core/tensor.h"

namespace bb {

// c is f32 [M, N]; a, b f32 or bf16 (2-d). op(A) = A or A^T, op(B) = B or B^T.
void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
            float alpha = 1.0f, float beta = 0.0f);
// The same for n independent products of one shape: a [n, ., .], b [n, ., .], c [n, M, N] f32
// (3-d, contiguous); one cuBLASLt call on a GPU.
void matmul_batched(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                    float alpha = 1.0f, float beta = 0.0f);

Tensor linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias /* may be undefined */,
                      MemCategory out_cat = MemCategory::activations);
// out_dtype bf16: the consumer wants bf16 (e.g. attention's d_o), so the GEMM writes it directly
// instead of an f32 d_x and a separate conversion (the same bits up to the GEMM's own order).
Tensor linear_backward_data(const Tensor& d_y, const Tensor& w, DType out_dtype = DType::f32);
// d_x += d_y @ w into an existing f32 [T, in] gradient, in the GEMM (beta = 1).
void linear_backward_data_acc(const Tensor& d_y, const Tensor& w, Tensor& d_x);
void linear_backward_weight(const Tensor& d_y, const Tensor& x, Tensor& d_w,
                            Tensor* d_bias /* may be null */);

}  // namespace bb
