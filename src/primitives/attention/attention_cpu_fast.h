// attention_cpu_fast.h — blocked, BLAS-based f32 CPU kernels for causal GQA attention (`sdpa`).
//
// Same math, layouts and conventions as the reference in attention_ref.h (read its header for the
// formulas); this is the path the Tensor-level API takes on the CPU. The reference stays the
// oracle (plain loops, double sums); these kernels trade that for speed:
//   - per sequence, per query head h (kv head h / G), queries are tiled in blocks of
//     `block_rows` rows; S = scale * Q_blk K^T, P V, dO V^T, dS K, dS^T Q and P^T dO are
//     cpu::gemm<float> calls straight on the strided [T, H, D] layouts (no copies);
//   - causal: a block only computes key columns up to its own last row; the few entries above
//     the diagonal inside that range are zeroed in P;
//   - softmax in f32 with a vectorizable exp (< 1 ulp); GEMM sums accumulate in f32, so
//     results differ from the reference at the 1e-6 relative level;
//   - a sequence's results do not depend on the other sequences' values (bit for bit), but can
//     change by an ulp when the same tokens are packed or tiled differently: BLAS picks its
//     kernels (and summation order) by matrix shape.
// Legend: T tokens (packed), B sequences, S a sequence's length, Hq query heads, Hkv kv heads,
// G = Hq / Hkv, D head dim, R = block_rows.
//   q, o, dq, d_o  [T, Hq, D]   f32 host pointers, row-major
//   k, v, dk, dv   [T, Hkv, D]  f32
//   lse            [Hq, T]      f32
//   cu             [B+1]        i32 sequence offsets (validated by the caller)
//   workspace      attention_fast_workspace_floats(max S, R) floats of scratch: [R, max S] for
//                  the forward, 2 x [R, max S] for the backward. Never T x T.
// Backward: dq, dk, dv are activation gradients, WRITTEN (=); the kernel zeroes dk and dv before
// summing the G query heads of each kv head into them. No parameters.
#pragma once

#include <cstdint>

namespace bb::cpu {

// Query rows per tile. Measured flat between 32 and 128 rows (64 best by ~5%) for D = 32..128 on
// 1K-token packs; larger tiles waste more of the diagonal block.
constexpr int64_t kAttnBlockRows = 64;

// Floats of scratch both kernels need for sequences up to `max_seq_len` tokens (0 allowed).
int64_t attention_fast_workspace_floats(int64_t max_seq_len, int64_t block_rows = kAttnBlockRows);

// o written; lse written unless null.
void attention_forward_fast(float* o, float* lse, const float* q, const float* k, const float* v,
                            const int32_t* cu, int64_t num_seqs, int64_t num_tokens, int64_t Hq,
                            int64_t Hkv, int64_t D, float scale, float* workspace,
                            int64_t block_rows = kAttnBlockRows);

// dq, dk, dv written; d_o, o and lse as from the forward with the same cu and scale.
void attention_backward_fast(float* dq, float* dk, float* dv, const float* d_o, const float* q,
                             const float* k, const float* v, const float* o, const float* lse,
                             const int32_t* cu, int64_t num_seqs, int64_t num_tokens, int64_t Hq,
                             int64_t Hkv, int64_t D, float scale, float* workspace,
                             int64_t block_rows = kAttnBlockRows);

}  // namespace bb::cpu
