// cross_entropy.cpp — Tensor-level cross-entropy and the full_ce loss head (CPU path).
//
// Boundary checks live here; the arithmetic is in cross_entropy_ref.h (plus BLAS for the two
// GEMMs of the head). Parameter gradients accumulate (+=), activation gradients are written (=).
#include "primitives/loss/cross_entropy.h"

#include "backend/cpu/gemm.h"
#include "backend/cpu/util.h"
#include "primitives/loss/cross_entropy_ref.h"

namespace bb {

namespace {

void check_cpu(const Tensor& t, const char* op, const char* arg) {
  BB_CHECK(t.device().is_cpu(), op, ": not implemented on ", t.device().str(), " yet (argument '",
           arg, "' is ", t.str(), ")");
}

// targets: [T] i32 on the CPU, every value < V (negative = masked).
void check_targets(const Tensor& targets, int64_t T, int64_t V, const char* op) {
  check_dtype(targets, DType::i32, op, "targets");
  check_shape(targets, {T}, op, "targets");
  check_cpu(targets, op, "targets");
  const int32_t* tg = targets.data<int32_t>();
  for (int64_t t = 0; t < T; ++t)
    BB_CHECK(tg[t] < V, op, ": targets[", t, "] = ", tg[t], " is out of range for vocab size ", V,
             " (valid: 0..", V - 1, ", or negative to mask the position)");
}

void check_logits(const Tensor& logits, const char* op) {
  check_float(logits, op, "logits");
  BB_CHECK(logits.dim() == 2, op, ": argument 'logits' must be [T, V], got ",
           shape_str(logits.shape()));
  BB_CHECK(logits.size(0) > 0, op, ": empty batch (T = 0 tokens); skip the loss instead");
  BB_CHECK(logits.size(1) > 0, op, ": vocab size is 0");
  check_cpu(logits, op, "logits");
}

}  // namespace

LossResult cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor* lse_out) {
  const char* op = "cross_entropy_forward";
  check_logits(logits, op);
  const int64_t T = logits.size(0), V = logits.size(1);
  check_targets(targets, T, V, op);
  float* lse = nullptr;
  if (lse_out) {
    if (!lse_out->defined())
      *lse_out = Tensor::empty({T}, DType::f32, Device::cpu(), MemCategory::activations);
    check_shape(*lse_out, {T}, op, "lse_out");
    check_dtype(*lse_out, DType::f32, op, "lse_out");
    check_cpu(*lse_out, op, "lse_out");
    lse = lse_out->data<float>();
  }
  Tensor lf = cpu::as_f32(logits);
  LossResult r;
  ref::cross_entropy_forward<float>(lse, &r.loss_sum, &r.num_valid, lf.data<float>(),
                                    targets.data<int32_t>(), T, V);
  return r;
}

Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                              float scale) {
  const char* op = "cross_entropy_backward";
  check_logits(logits, op);
  const int64_t T = logits.size(0), V = logits.size(1);
  check_targets(targets, T, V, op);
  check_shape(lse, {T}, op, "lse");
  check_dtype(lse, DType::f32, op, "lse");
  check_cpu(lse, op, "lse");
  Tensor lf = cpu::as_f32(logits);
  Tensor d = Tensor::empty({T, V}, DType::f32, Device::cpu(), MemCategory::logits);
  ref::cross_entropy_backward<float>(d.data<float>(), lf.data<float>(), targets.data<int32_t>(),
                                     lse.data<float>(), scale, T, V);
  return d;
}

namespace detail {

LossHeadDims check_loss_head_inputs(const Tensor& h, const Tensor& w, const Tensor& targets,
                                    const char* op) {
  check_float(h, op, "h");
  check_float(w, op, "w");
  BB_CHECK(h.dim() == 2, op, ": argument 'h' must be [T, H], got ", shape_str(h.shape()));
  BB_CHECK(w.dim() == 2, op, ": argument 'w' must be [V, H], got ", shape_str(w.shape()));
  LossHeadDims d{h.size(0), w.size(0), h.size(1)};
  BB_CHECK(d.num_tokens > 0, op, ": empty batch (T = 0 tokens); skip the loss instead");
  BB_CHECK(d.hidden > 0, op, ": hidden size is 0 (h is ", shape_str(h.shape()), ")");
  BB_CHECK(w.size(1) == d.hidden, op, ": hidden size mismatch: h is ", shape_str(h.shape()),
           " and w is ", shape_str(w.shape()), "; expected w of shape [V, ", d.hidden, "]");
  BB_CHECK(d.vocab > 0, op, ": vocab size is 0 (w is ", shape_str(w.shape()), ")");
  check_cpu(h, op, "h");
  check_cpu(w, op, "w");
  check_targets(targets, d.num_tokens, d.vocab, op);
  return d;
}

void check_loss_head_grads(const LossHeadDims& dims, const Tensor& h, const LossHeadSaved& saved,
                           Tensor& d_h, const Tensor& d_w, const char* op) {
  BB_CHECK(saved.lse.defined(), op,
           ": saved.lse is undefined; pass the LossHeadSaved filled by "
           "the forward");
  check_shape(saved.lse, {dims.num_tokens}, op, "saved.lse");
  check_dtype(saved.lse, DType::f32, op, "saved.lse");
  check_cpu(saved.lse, op, "saved.lse");
  BB_CHECK(d_w.defined(), op, ": d_w is undefined; it accumulates (+=), pass a zeroed [V, H] f32");
  check_shape(d_w, {dims.vocab, dims.hidden}, op, "d_w");
  check_dtype(d_w, DType::f32, op, "d_w");
  check_cpu(d_w, op, "d_w");
  if (!d_h.defined())
    d_h = Tensor::empty({dims.num_tokens, dims.hidden}, DType::f32, Device::cpu(),
                        MemCategory::activations);
  check_shape(d_h, h.shape(), op, "d_h");
  check_float(d_h, op, "d_h");
  check_cpu(d_h, op, "d_h");
}

}  // namespace detail

Tensor lm_head_logits(const Tensor& h, const Tensor& w) {
  const char* op = "lm_head_logits";
  check_float(h, op, "h");
  check_float(w, op, "w");
  BB_CHECK(h.dim() == 2 && w.dim() == 2 && h.size(1) == w.size(1), op,
           ": expected h [T, H] and w [V, H], got h ", shape_str(h.shape()), " and w ",
           shape_str(w.shape()));
  check_cpu(h, op, "h");
  check_cpu(w, op, "w");
  const int64_t T = h.size(0), V = w.size(0), H = h.size(1);
  Tensor hf = cpu::as_f32(h), wf = cpu::as_f32(w);
  Tensor logits = Tensor::empty({T, V}, DType::f32, Device::cpu(), MemCategory::logits);
  cpu::gemm<float>(false, true, T, V, H, 1.0f, hf.data<float>(), wf.data<float>(), 0.0f,
                   logits.data<float>());
  return logits;
}

LossResult full_ce_forward(const Tensor& h, const Tensor& w, const Tensor& targets,
                           LossHeadSaved* saved) {
  const char* op = "full_ce_forward";
  const detail::LossHeadDims dims = detail::check_loss_head_inputs(h, w, targets, op);
  Tensor logits = lm_head_logits(h, w);
  Tensor lse =
      Tensor::empty({dims.num_tokens}, DType::f32, Device::cpu(), MemCategory::activations);
  LossResult r;
  ref::cross_entropy_forward<float>(lse.data<float>(), &r.loss_sum, &r.num_valid,
                                    logits.data<float>(), targets.data<int32_t>(), dims.num_tokens,
                                    dims.vocab);
  if (saved) {
    saved->logits = logits;
    saved->lse = lse;
  }
  return r;
}

void full_ce_backward(float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                      const LossHeadSaved& saved, Tensor& d_h, Tensor& d_w) {
  const char* op = "full_ce_backward";
  const detail::LossHeadDims dims = detail::check_loss_head_inputs(h, w, targets, op);
  detail::check_loss_head_grads(dims, h, saved, d_h, d_w, op);
  BB_CHECK(saved.logits.defined(), op,
           ": saved.logits is undefined; full_ce_backward needs the "
           "logits saved by full_ce_forward (did the forward run with linear_ce?)");
  check_shape(saved.logits, {dims.num_tokens, dims.vocab}, op, "saved.logits");
  check_dtype(saved.logits, DType::f32, op, "saved.logits");
  const int64_t T = dims.num_tokens, V = dims.vocab, H = dims.hidden;

  Tensor d_logits = Tensor::empty({T, V}, DType::f32, Device::cpu(), MemCategory::logits);
  ref::cross_entropy_backward<float>(d_logits.data<float>(), saved.logits.data<float>(),
                                     targets.data<int32_t>(), saved.lse.data<float>(), scale, T, V);
  Tensor hf = cpu::as_f32(h), wf = cpu::as_f32(w);
  // d_h = d_logits @ w  [T, V] x [V, H]
  Tensor dhf = d_h.dtype() == DType::f32 ? d_h : cpu::empty_f32({T, H}, MemCategory::workspace);
  cpu::gemm<float>(false, false, T, H, V, 1.0f, d_logits.data<float>(), wf.data<float>(), 0.0f,
                   dhf.data<float>());
  cpu::store_f32(d_h, dhf);
  // d_w += d_logits^T @ h  [V, T] x [T, H]
  cpu::gemm<float>(true, false, V, H, T, 1.0f, d_logits.data<float>(), hf.data<float>(), 1.0f,
                   d_w.data<float>());
}

}  // namespace bb
