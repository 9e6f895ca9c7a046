// attention.h — GQA attention over packed sequences: the `sdpa` family baseline, with queries and
// keys packed separately so that context parallelism can call it on a query block against a key
// block (and merge the partial results by their log-sum-exp).
//
// Legend: Tq / Tkv query / key tokens (all sequences packed back to back), B sequences, Hq query
// heads, Hkv kv heads (Hq % Hkv == 0; query head h reads kv head h / (Hq / Hkv)), D head dim,
// Sq / Skv one sequence's query / key count.
//   q                    [Tq, Hq, D]   f32 or bf16            in
//   k, v                 [Tkv, Hkv, D] q's dtype              in
//   args.cu_seqlens_q    [B+1]         i32, host              in   sequence b = queries [cq[b], cq[b+1])
//   args.cu_seqlens_kv   [B+1]         i32, host or undefined in   keys [ck[b], ck[b+1]); undefined:
//                                                                   the same as cu_seqlens_q
//                                      (offsets: 0 first, non-decreasing, Tq / Tkv last; empty
//                                      sequences allowed)
//   o                    [Tq, Hq, D]   q's dtype, activations out  o_i = softmax_{j visible}(scale q_i.k_j) v
//   saved.lse            [Hq, Tq]      f32, activations       out  log sum_{j visible} exp(scale q_i.k_j)
// Which keys query i (0-based in its sequence) sees, by args.mask:
//   causal               j <= i                 top-left aligned; self-attention (Sq = Skv)
//   causal_bottom_right  j <= i + (Skv - Sq)    causal with a kv offset: the queries are the last
//                                               Sq of the Skv key positions (needs Skv >= Sq)
//   none                 every key of the sequence (a key block wholly before the query block)
// Nothing is attended across a sequence boundary. A query that sees no key (Skv = 0) gets o = 0
// and lse = -inf (the CPU path; the CUDA path refuses such batches). The CPU path sums in f32
// through blocked BLAS; the plain-loop reference (attention_ref.h) in double.
//
// Backward: dq, dk, dv are activation gradients, WRITTEN (=) into new tensors with the shapes and
// dtypes of q, k, v (category activations). It needs q, k, v, o and saved.lse and the same args;
// the softmax matrix is recomputed from lse (flash-attention style), never stored.
// The family's members as a decoder layer calls them (sdpa, cp_ring, cp_a2a) are in
// context_parallel.h; they call these functions on their query and key blocks.
#pragma once

#include "core/tensor.h"

namespace bb {

enum class AttentionMask : uint8_t { causal, causal_bottom_right, none };
const char* attention_mask_name(AttentionMask m);

struct AttentionArgs {
  Tensor cu_seqlens_q;
  Tensor cu_seqlens_kv;  // undefined: the queries' offsets (self-attention)
  AttentionMask mask = AttentionMask::causal;
  float softmax_scale = 1.0f;

  // Causal self-attention over the packed sequences `cu_seqlens` (what a decoder layer calls).
  static AttentionArgs causal_self(const Tensor& cu_seqlens, float softmax_scale) {
    return {cu_seqlens, Tensor(), AttentionMask::causal, softmax_scale};
  }
  const Tensor& kv_offsets() const { return cu_seqlens_kv.defined() ? cu_seqlens_kv : cu_seqlens_q; }
};

struct AttentionSaved {
  Tensor lse;  // [Hq, Tq] f32, category activations: log-sum-exp of the scaled scores
  // Kept by the context-parallel all-to-all member only (context_parallel.h): its head-sharded
  // inputs and output over the whole sequences (lse is then theirs).
  Tensor q, k, v, o;
};

// Returns o [Tq, Hq, D] (q's dtype, activations). `saved` may be null (inference, or a recompute
// that only needs o); otherwise it receives the log-sum-exp.
Tensor attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                         const AttentionArgs& args, AttentionSaved* saved);

struct AttentionGrads {
  Tensor dq;  // [Tq, Hq, D]    q's dtype, activations
  Tensor dk;  // [Tkv, Hkv, D]  k's dtype, activations (summed over the kv head's query heads)
  Tensor dv;  // [Tkv, Hkv, D]  v's dtype, activations (summed over the kv head's query heads)
};

// d_o and o: [Tq, Hq, D] in q's dtype; the other arguments exactly as given to / returned by the
// forward.
AttentionGrads attention_backward(const Tensor& d_o, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& o, const AttentionArgs& args,
                                  const AttentionSaved& saved);

}  // namespace bb
