// gated_delta_rule.h — the gated delta rule of Gated DeltaNet layers (Qwen3.5 linear attention)
// over packed variable-length sequences: a K x V state per value head, decayed by exp(g), updated
// with the delta rule at rate beta, read by q (gated_delta_rule_ref.h has the equations).
//
// Tensors (legend: T tokens, Hk key heads, Hv value heads = G x Hk, K key dim, V value dim):
//   q, k        [T, Hk, K]  f32 (CPU); f32 or bf16 (CUDA)   queries and keys (L2-normalised inside
//                                                           when opts.l2norm)
//   v           [T, Hv, V]  q's dtype    values; value head h reads key head h / G (GVA)
//   g           [T, Hv]     f32          log decay (<= 0 in the model: -exp(A_log) softplus(a + dt_bias))
//   beta        [T, Hv]     f32          write strength (sigmoid(b) in the model)
//   cu_seqlens  [n + 1]     i32, host    sequence i = tokens [cu[i], cu[i+1]); the state starts at
//                                        zero in every sequence and never crosses a boundary; empty
//                                        sequences are allowed
//   o           [T, Hv, V]  v's dtype    output, category `out_cat`
// Backward: d_o [T, Hv, V] in f32 or v's dtype; every input's gradient written (=), f32, category
// activations. The states are rebuilt in backward; a forward may keep chunk_prep's outputs for it
// (GatedDeltaPrep below).
// Devices (all tensors but cu_seqlens on one device):
//   CPU   the reference (recurrent form), f32 only.
//   CUDA  chunked kernels (gated_delta_rule_cuda.cu: chunk 64, fp32 state, bf16 tensor-core
//         products, split-bf16 for f32 inputs), on the current stream; K, V <= 128 and multiples
//         of 8. Workspace (category workspace, freed on return), bytes per token (full chunks),
//         bf16 inputs: forward 512 Hk + 644 Hv, backward 512 Hk + 3336 Hv (+ 256 Hv when d_o is
//         f32 or V < 128); f32 inputs: forward 1024 Hk + 1284 Hv, backward 1024 Hk + 5640 Hv
//         (+ 512 Hv). Qwen3.5 (Hk 16, Hv 32, bf16): 28.1 KiB forward, 112 KiB backward per token
//         (skills/gated-delta-rule.md has the breakdown). Other dtypes are a clear error.
#pragma once

#include <vector>

#include "core/tensor.h"

namespace bb {

struct GatedDeltaOptions {
  double scale = 0;   // multiplies q after the norm; 0 = 1 / sqrt(K)
  bool l2norm = true; // q and k scaled to unit L2 norm (x * rsqrt(|x|^2 + eps)) first
  double eps = 1e-6;
  // CUDA: the most workspace one call takes. A call whose workspace would exceed it runs in
  // time segments: token ranges of the batch, the longest that fit, cut at whole chunks of the
  // sequence they cut; a cut sequence carries its K x V states (f32, 64 KiB a value head) from
  // one segment to the next, and the backward first sweeps the segments' end states, then runs
  // them last to first carrying the states' gradients. Bit-identical to one call, with every
  // head in every segment. Long sequences then fit: 256K tokens of Qwen3.5 need 28 GiB of
  // backward workspace in one call, under 4 GiB a segment. Cost: the backward's sweep (about a
  // forward's prep and state pass over all but the last segment).
  size_t max_workspace_bytes = size_t{4} << 30;
};

struct GatedDeltaGrads {
  Tensor d_q, d_k, d_v, d_g, d_beta;
};

// What a CUDA forward can keep for its backward: chunk_prep's outputs (the normalised q and k;
// W, U, P, T and the gamma cumsum; skills/gated-delta-rule.md), so that the backward skips
// qk_norm and chunk_prep. Bytes per token for full chunks, bf16 inputs: 512 Hk + 772 Hv
// (Qwen3.5: 32.1 KiB per GDN layer); f32 inputs: 1024 Hk + 1540 Hv. Made by a forward given
// `keep`, consumed (released) by the backward given it; gradients are bitwise the same either
// way. A CPU forward, or one whose prep would exceed max_workspace_bytes (it then runs in head
// groups), leaves it empty, and the backward works as without it. Opaque to callers.
struct GatedDeltaPrep {
  Tensor buffer;  // device bytes, category activations
  Tensor table;   // the chunk table on the device
  std::vector<int32_t> cu;
  Shape q_shape, v_shape;
  DType dtype = DType::f32;
  double scale = 0, eps = 0;
  bool l2norm = true;
  bool defined() const { return buffer.defined(); }
};

// initial_state: null (every sequence starts from zero) or f32 [n, Hv, K, V], sequence i's start
// state (context parallelism by state summaries, below). A call with start states does not keep
// a prep.
Tensor gated_delta_rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, const Tensor& cu_seqlens,
                                const GatedDeltaOptions& opts = {},
                                MemCategory out_cat = MemCategory::activations,
                                GatedDeltaPrep* keep = nullptr, const Tensor* initial_state = nullptr);

// prep: what the forward on these inputs kept (or null / empty). A prep made for other inputs
// (shapes, dtype, cu_seqlens, options) is an error; it is released when the call returns.
// initial_state: the forward's (null: zero); d_final_state: null or f32 [n, Hv, K, V], the
// gradient reaching sequence i's end state from beyond the call (the later ranks' tokens).
GatedDeltaGrads gated_delta_rule_backward(const Tensor& d_o, const Tensor& q, const Tensor& k,
                                          const Tensor& v, const Tensor& g, const Tensor& beta,
                                          const Tensor& cu_seqlens,
                                          const GatedDeltaOptions& opts = {},
                                          GatedDeltaPrep* prep = nullptr,
                                          const Tensor* initial_state = nullptr,
                                          const Tensor* d_final_state = nullptr);

// Context parallelism by state summaries (skills/gdn-cp-states.md). A sequence maps its start
// state affinely, S_end = P S_start + E (per value head; P [K, K] the product of its tokens'
// exp(g_t) (I - beta_t k_t k_t^T), E the end state from a zero start), and the gradient of its
// start state is P^T dS_end + D, D what its own outputs give. Tensors f32, category `cat`:
//   transition [n, Hv, K, K]   P of each sequence of cu_seqlens (the identity for an empty one)
//   end_state  [n, Hv, K, V]   E
//   start_grad [n, Hv, K, V]   D from d_o (independent of the start state and of v)
// q and v are checked with the rest (shapes, devices) but summary reads neither q nor, for
// transition, v. CUDA: one call per sequence of the existing chunked kernels (skills page:
// costs).
struct GatedDeltaSummary {
  Tensor transition, end_state;
};
GatedDeltaSummary gated_delta_rule_summary(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                           const Tensor& beta, const Tensor& cu_seqlens,
                                           const GatedDeltaOptions& opts = {},
                                           MemCategory cat = MemCategory::activations);
Tensor gated_delta_rule_start_grad(const Tensor& d_o, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                   const GatedDeltaOptions& opts = {},
                                   MemCategory cat = MemCategory::workspace);

}  // namespace bb
