// attention_cpu_fast.h — blocked, BLAS-based f32 CPU kernels for GQA attention over packed
// sequences (`sdpa`), queries and keys packed separately.
//
// Same math, layouts, masks and conventions as the reference in attention_ref.h (read its header
// for the formulas); this is the path the Tensor-level API takes on the CPU. The reference stays
// the oracle (plain loops, double sums); these kernels trade that for speed:
//   - per sequence, per query head h (kv head h / G), queries are tiled in blocks of
//     `block_rows` rows; S = scale * Q_blk K^T, P V, dO V^T, dS K, dS^T Q and P^T dO are
//     cpu::gemm<float> calls straight on the strided [T, H, D] layouts (no copies);
//   - a block only computes key columns up to the last one its last row sees (causal masks);
//     the entries a row does not see inside that range are zeroed in P;
//   - softmax in f32 with a vectorizable exp (< 1 ulp); GEMM sums accumulate in f32, so
//     results differ from the reference at the 1e-6 relative level;
//   - a sequence's results do not depend on the other sequences' values (bit for bit), but can
//     change by an ulp when the same tokens are packed or tiled differently: BLAS picks its
//     kernels (and summation order) by matrix shape.
// Legend: Tq / Tkv query / key tokens (packed), B sequences, Skv a sequence's key count, Hq query
// heads, Hkv kv heads, G = Hq / Hkv, D head dim, R = block_rows.
//   q, o, dq, d_o  [Tq, Hq, D]    f32 host pointers, row-major
//   k, v, dk, dv   [Tkv, Hkv, D]  f32
//   lse            [Hq, Tq]       f32 (-inf for a query that sees no key)
//   cq, ck         [B+1]          i32 query / key sequence offsets (validated by the caller)
//   mask           ref::RefMask   (attention_ref.h)
//   workspace      attention_fast_workspace_floats(max Sq, max Skv, R) floats of scratch:
//                  [min(R, max Sq), max Skv] for the forward, twice that (+ a row) for the
//                  backward. Never T x T.
// Backward: dq, dk, dv are activation gradients, WRITTEN (=); the kernel zeroes dk and dv before
// summing the G query heads of each kv head into them. No parameters.
#pragma once

#include <cstdint>

#include "primitives/attention/attention_ref.h"

namespace bb::cpu {

// Query rows per tile. Measured flat between 32 and 128 rows (64 best by ~5%) for D = 32..128 on
// 1K-token packs; larger tiles waste more of the diagonal block.
constexpr int64_t kAttnBlockRows = 64;

// Floats of scratch both kernels need for sequences of up to max_q_len queries and max_kv_len
// keys (0 allowed).
int64_t attention_fast_workspace_floats(int64_t max_q_len, int64_t max_kv_len,
                                        int64_t block_rows = kAttnBlockRows);

// o written; lse written unless null.
void attention_forward_fast(float* o, float* lse, const float* q, const float* k, const float* v,
                            const int32_t* cq, const int32_t* ck, int64_t num_seqs,
                            int64_t num_q_tokens, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                            ref::RefMask mask, float* workspace, int64_t block_rows = kAttnBlockRows);

// dq, dk, dv written; d_o, o and lse as from the forward with the same offsets, scale and mask.
void attention_backward_fast(float* dq, float* dk, float* dv, const float* d_o, const float* q,
                             const float* k, const float* v, const float* o, const float* lse,
                             const int32_t* cq, const int32_t* ck, int64_t num_seqs,
                             int64_t num_q_tokens, int64_t num_kv_tokens, int64_t Hq, int64_t Hkv,
                             int64_t D, float scale, ref::RefMask mask, float* workspace,
                             int64_t block_rows = kAttnBlockRows);

}  // namespace bb::cpu
