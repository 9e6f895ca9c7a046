// linear_ce.h — the streaming loss head: same result as full_ce (cross_entropy.h) without ever
// holding the [T, V] logits. Tokens are cut into chunks of cfg.chunk_tokens rows and the
// vocabulary into chunks of cfg.chunk_vocab rows of w; one [ct, cv] f32 logits block (category
// logits, ct = min(chunk_tokens, T), cv = min(chunk_vocab, V)) is reused for every chunk pair,
// so the logits peak is exactly ct * cv * 4 bytes in forward and in backward.
//
// Legend: T tokens, H hidden, V vocab. Tensors and formulas as in cross_entropy.h:
//   h [T, H] f32/bf16, w [V, H] f32/bf16, targets [T] i32 (< 0 = masked)
//   loss_sum = sum_{t valid} (lse_t - (h_t . w_{target_t}))
// Forward: per token chunk, an online (running max, running sum) logsumexp over the vocab
// chunks plus the target logit; saves only lse [T] f32 (category activations).
// Backward: recomputes each logits block, turns it into scale * (softmax - onehot) in place using
// the saved lse, then d_h[tchunk] = sum over vchunks of block @ w[vchunk] and
// d_w[vchunk] += block^T @ h[tchunk].
// Fused training mode (linear_ce_fused): when the loss scale is known before the forward (it is
// in training: 1 / valid tokens of the step), loss and gradients come out of ONE pass and the
// logits GEMM is not recomputed. Per token chunk of ct = min(cfg.fused_chunk_tokens, T) rows:
//   x = h[tc] @ w^T                       [ct, V] f32, the whole vocabulary (category logits)
//   per row: lse, target logit, then x <- scale * (softmax - onehot) IN PLACE (0 on masked
//            rows; bf16 for bf16 h/w, packed into the first half of each f32 row on CUDA)
//   d_h[tc] (=) x @ w;  d_w (+=) x^T @ h[tc]
// Logits peak: exactly ct * V * 4 bytes (linear_ce_fused_logits_bytes). FLOPs 6TVH as full_ce.
// cfg.bf16_logits: the logits are taken at bf16 precision (as transformers and Megatron-Core
// compute them: a bf16 lm_head GEMM, the softmax in fp32); on CUDA with bf16 h/w the block is
// bf16 ([ct, V] x 2 bytes), the gradient written over it; elsewhere f32 values rounded to bf16.
// The two-pass forward/backward stays for evaluation and whenever the scale is only known after
// the forward.
// Accumulation convention: d_w ACCUMULATED (+=, f32 [V, H]); d_h WRITTEN (=, any float dtype,
// allocated as f32 under activations when undefined on entry).
#pragma once

#include "primitives/loss/cross_entropy.h"

namespace bb {

// cfg.chunk_tokens and cfg.chunk_vocab must be > 0. `saved` may be null; it receives lse only
// (saved->logits is reset to undefined).
LossResult linear_ce_forward(const Tensor& h, const Tensor& w, const Tensor& targets,
                             const LossHeadConfig& cfg, LossHeadSaved* saved);
// scale = d(total loss) / d(loss_sum). The same cfg as the forward is expected but not required
// (any chunking gives the same gradients up to fp32 rounding).
void linear_ce_backward(float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                        const LossHeadConfig& cfg, const LossHeadSaved& saved, Tensor& d_h,
                        Tensor& d_w);

// Bytes of the one logits block linear_ce keeps alive (what the memory estimator should add): 4
// bytes a logit also with cfg.bf16_logits (the two-pass backward's block stays f32; only the
// forward's block narrows to bf16 on CUDA).
int64_t linear_ce_logits_bytes(int64_t num_tokens, int64_t vocab, const LossHeadConfig& cfg);

// Loss and gradients in one pass (training). Same result as linear_ce_forward followed by
// linear_ce_backward(scale, ...); saves nothing (no lse, no logits).
//   h [T, H], w [V, H]: f32 or bf16 (on CUDA: one dtype for both); targets [T] i32 (< 0 masked)
//   scale: d(total loss) / d(loss_sum), known up front (e.g. 1 / valid tokens of the step)
//   d_h [T, H] (=): any float dtype; if undefined on entry, allocated f32 under activations
//   d_w [V, H] f32 (+=, or = with overwrite_dw: its old contents are not read): must be defined
// Uses cfg.fused_chunk_tokens only (> 0). Returns loss_sum and num_valid as linear_ce_forward.
// Device targets are range-checked by the pass itself: a target >= V throws at the end, after
// d_h and d_w were written (they are then meaningless); host targets are checked up front.
LossResult linear_ce_fused(float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                           const LossHeadConfig& cfg, Tensor& d_h, Tensor& d_w, bool overwrite_dw = false);

// Bytes of the logits block linear_ce_fused keeps alive: min(fused_chunk_tokens, T) * V * 4 (2
// with cfg.bf16_logits, bf16 operands on CUDA).
int64_t linear_ce_fused_logits_bytes(int64_t num_tokens, int64_t vocab, const LossHeadConfig& cfg,
                                     DType operands = DType::f32, bool on_cuda = false);

}  // namespace bb
