// cross_entropy.cpp — Tensor-level cross-entropy and the full_ce loss head: CPU path, and the
// CUDA path for device tensors.
//
// Boundary checks live here; the CPU arithmetic is in cross_entropy_ref.h (plus BLAS for the two
// GEMMs of the head), the CUDA kernels in loss_cuda.cu (plus `matmul` on device tensors for the
// GEMMs). Parameter gradients accumulate (+=), activation gradients are written (=).
//
// CUDA notes: targets may be on the CPU (range-checked on the host, then copied to the device:
// that copy synchronises) or on the logits' device (range-checked by the forward's kernels and
// reported at its one host read; a backward with device targets does not re-check them, and a
// target >= V there simply gets no one-hot term). The loss-head GEMMs need h and w of one dtype
// (f32 or bf16); with bf16 the logits gradient is stored in bf16 for the bf16 GEMMs.
#include "primitives/loss/cross_entropy.h"
#include "primitives/loss/loss_head.h"

#include "core/trace.h"

#include "backend/cpu/gemm.h"
#include "backend/cpu/util.h"
#include "primitives/loss/cross_entropy_ref.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#include "primitives/linear/linear.h"
#include "primitives/loss/loss_cuda.h"
#endif

namespace bb {

namespace {

void check_on(const Tensor& t, Device dev, const char* op, const char* arg) {
  BB_CHECK(t.device() == dev, op, ": argument '", arg, "' is on ", t.device().str(),
           " but the computation runs on ", dev.str());
}

// targets: [T] i32 with every value < V (negative = masked). On the CPU the values are checked
// here; on the compute device (`dev`) they are checked by the CUDA forward.
void check_targets(const Tensor& targets, int64_t T, int64_t V, Device dev, const char* op) {
  check_dtype(targets, DType::i32, op, "targets");
  check_shape(targets, {T}, op, "targets");
  check_backend_device(targets, op, "targets");
  if (!targets.device().is_cpu()) {
    check_on(targets, dev, op, "targets");
    return;
  }
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
  check_backend_device(logits, op, "logits");
}

#ifdef BB_WITH_CUDA
// Cross-entropy forward of device logits x [T, V] (row stride V): lse [T] f32 written, totals
// read back once. Throws for targets >= V (device targets are only checked here).
LossResult ce_forward_cuda(const Tensor& x, const Tensor& targets_dev, float* lse, int64_t T,
                           int64_t V, const char* op) {
  const Device dev = x.device();
  BB_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::bf16, op,
           ": logits dtype ", dtype_name(x.dtype()), " is not supported on CUDA (f32 or bf16)");
  Tensor run = Tensor::empty({3 * T}, DType::f32, dev, MemCategory::workspace);
  float* run_max = run.data<float>();
  float* run_sum = run_max + T;
  float* target_logit = run_max + 2 * T;
  cuda::ce_online_update(run_max, run_sum, target_logit, x.raw(), x.dtype(), V,
                         targets_dev.data<int32_t>(), T, 0, V, true);
  return detail::finish_ce_cuda(lse, run_max, run_sum, target_logit, targets_dev, T, V, op);
}
#endif

}  // namespace

LossResult cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor* lse_out) {
  const char* op = "cross_entropy_forward";
  check_logits(logits, op);
  const int64_t T = logits.size(0), V = logits.size(1);
  const Device dev = logits.device();
  check_targets(targets, T, V, dev, op);
  float* lse = nullptr;
  if (lse_out) {
    if (!lse_out->defined()) *lse_out = Tensor::empty({T}, DType::f32, dev, MemCategory::activations);
    check_shape(*lse_out, {T}, op, "lse_out");
    check_dtype(*lse_out, DType::f32, op, "lse_out");
    check_backend_device(*lse_out, op, "lse_out");
    check_on(*lse_out, dev, op, "lse_out");
    lse = lse_out->data<float>();
  }
#ifdef BB_WITH_CUDA
  if (dev.is_cuda()) {
    Tensor lse_tmp;
    if (!lse) {
      lse_tmp = Tensor::empty({T}, DType::f32, dev, MemCategory::workspace);
      lse = lse_tmp.data<float>();
    }
    return ce_forward_cuda(logits, detail::targets_on(targets, dev), lse, T, V, op);
  }
#endif
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
  const Device dev = logits.device();
  check_targets(targets, T, V, dev, op);
  check_shape(lse, {T}, op, "lse");
  check_dtype(lse, DType::f32, op, "lse");
  check_backend_device(lse, op, "lse");
  check_on(lse, dev, op, "lse");
#ifdef BB_WITH_CUDA
  if (dev.is_cuda()) {
    Tensor d = Tensor::empty({T, V}, DType::f32, dev, MemCategory::logits);
    Tensor tg = detail::targets_on(targets, dev);
    cuda::ce_softmax_grad(d.raw(), DType::f32, V, logits.raw(), logits.dtype(), V,
                          tg.data<int32_t>(), lse.data<float>(), scale, T, 0, V);
    return d;
  }
#endif
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
  check_backend_device(h, op, "h");
  check_backend_device(w, op, "w");
  check_on(w, h.device(), op, "w");
  if (h.device().is_cuda()) {
    BB_CHECK(h.dtype() == w.dtype() && (h.dtype() == DType::f32 || h.dtype() == DType::bf16), op,
             ": on CUDA h and w must share one dtype, f32 or bf16 (the GEMM operands); got h ",
             dtype_name(h.dtype()), " and w ", dtype_name(w.dtype()));
  }
  check_targets(targets, d.num_tokens, d.vocab, h.device(), op);
  return d;
}

void check_loss_head_grads(const LossHeadDims& dims, const Tensor& h, const LossHeadSaved& saved,
                           Tensor& d_h, const Tensor& d_w, const char* op) {
  BB_CHECK(saved.lse.defined(), op,
           ": saved.lse is undefined; pass the LossHeadSaved filled by "
           "the forward");
  check_shape(saved.lse, {dims.num_tokens}, op, "saved.lse");
  check_dtype(saved.lse, DType::f32, op, "saved.lse");
  check_backend_device(saved.lse, op, "saved.lse");
  check_on(saved.lse, h.device(), op, "saved.lse");
  check_head_grad_args(dims, h, d_h, d_w, op);
}

void check_head_grad_args(const LossHeadDims& dims, const Tensor& h, Tensor& d_h,
                          const Tensor& d_w, const char* op) {
  BB_CHECK(d_w.defined(), op, ": d_w is undefined; it accumulates (+=), pass a zeroed [V, H] f32");
  check_shape(d_w, {dims.vocab, dims.hidden}, op, "d_w");
  check_dtype(d_w, DType::f32, op, "d_w");
  check_backend_device(d_w, op, "d_w");
  check_on(d_w, h.device(), op, "d_w");
  if (!d_h.defined())
    d_h = Tensor::empty({dims.num_tokens, dims.hidden}, DType::f32, h.device(),
                        MemCategory::activations);
  check_shape(d_h, h.shape(), op, "d_h");
  check_float(d_h, op, "d_h");
  check_backend_device(d_h, op, "d_h");
  check_on(d_h, h.device(), op, "d_h");
}

#ifdef BB_WITH_CUDA
Tensor targets_on(const Tensor& targets, Device dev) {
  return targets.device() == dev ? targets : targets.to(dev, MemCategory::workspace);
}

LossResult finish_ce_cuda(float* lse, const float* run_max, const float* run_sum,
                          const float* target_logit, const Tensor& targets_dev, int64_t T,
                          int64_t V, const char* op, const char* consequence) {
  Tensor totals = Tensor::empty({static_cast<int64_t>(cuda::ce_totals_bytes())}, DType::u8,
                                targets_dev.device(), MemCategory::workspace);
  const cuda::CeTotals c = cuda::ce_finalize(lse, totals.raw(), run_max, run_sum, target_logit,
                                             targets_dev.data<int32_t>(), T, V);
  if (c.first_bad_row >= 0) {
    const int32_t v = targets_dev.narrow(c.first_bad_row, 1).to_ints()[0];
    BB_FAIL(op, ": targets[", c.first_bad_row, "] = ", v, " is out of range for vocab size ", V,
            " (valid: 0..", V - 1, ", or negative to mask the position)", consequence);
  }
  LossResult r;
  r.loss_sum = c.loss_sum;
  r.num_valid = c.num_valid;
  return r;
}
#endif

}  // namespace detail

Tensor lm_head_logits(const Tensor& h, const Tensor& w) {
  const char* op = "lm_head_logits";
  check_float(h, op, "h");
  check_float(w, op, "w");
  BB_CHECK(h.dim() == 2 && w.dim() == 2 && h.size(1) == w.size(1), op,
           ": expected h [T, H] and w [V, H], got h ", shape_str(h.shape()), " and w ",
           shape_str(w.shape()));
  check_backend_device(h, op, "h");
  check_backend_device(w, op, "w");
  check_on(w, h.device(), op, "w");
  const int64_t T = h.size(0), V = w.size(0), H = h.size(1);
#ifdef BB_WITH_CUDA
  if (h.device().is_cuda()) {
    Tensor logits = Tensor::empty({T, V}, DType::f32, h.device(), MemCategory::logits);
    matmul(h, false, w, true, logits);
    return logits;
  }
#endif
  Tensor hf = cpu::as_f32(h), wf = cpu::as_f32(w);
  Tensor logits = Tensor::empty({T, V}, DType::f32, Device::cpu(), MemCategory::logits);
  cpu::gemm<float>(false, true, T, V, H, 1.0f, hf.data<float>(), wf.data<float>(), 0.0f,
                   logits.data<float>());
  return logits;
}

LossResult full_ce_forward(const Tensor& h, const Tensor& w, const Tensor& targets,
                           LossHeadSaved* saved) {
  BB_RANGE("full_ce_forward");
  const char* op = "full_ce_forward";
  const detail::LossHeadDims dims = detail::check_loss_head_inputs(h, w, targets, op);
  Tensor logits = lm_head_logits(h, w);
  Tensor lse = Tensor::empty({dims.num_tokens}, DType::f32, h.device(), MemCategory::activations);
  LossResult r;
#ifdef BB_WITH_CUDA
  if (h.device().is_cuda()) {
    r = ce_forward_cuda(logits, detail::targets_on(targets, h.device()), lse.data<float>(),
                        dims.num_tokens, dims.vocab, op);
  } else
#endif
  {
    ref::cross_entropy_forward<float>(lse.data<float>(), &r.loss_sum, &r.num_valid,
                                      logits.data<float>(), targets.data<int32_t>(),
                                      dims.num_tokens, dims.vocab);
  }
  if (saved) {
    saved->logits = logits;
    saved->lse = lse;
  }
  return r;
}

void full_ce_backward(float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                      const LossHeadSaved& saved, Tensor& d_h, Tensor& d_w) {
  BB_RANGE("full_ce_backward");
  const char* op = "full_ce_backward";
  const detail::LossHeadDims dims = detail::check_loss_head_inputs(h, w, targets, op);
  detail::check_loss_head_grads(dims, h, saved, d_h, d_w, op);
  BB_CHECK(saved.logits.defined(), op,
           ": saved.logits is undefined; full_ce_backward needs the "
           "logits saved by full_ce_forward (did the forward run with linear_ce?)");
  check_shape(saved.logits, {dims.num_tokens, dims.vocab}, op, "saved.logits");
  check_dtype(saved.logits, DType::f32, op, "saved.logits");
  check_on(saved.logits, h.device(), op, "saved.logits");
  const int64_t T = dims.num_tokens, V = dims.vocab, H = dims.hidden;

#ifdef BB_WITH_CUDA
  if (h.device().is_cuda()) {
    const Device dev = h.device();
    // d_logits in the GEMM operand dtype (bf16 for bf16 h/w): peak logits T*V*(4 + 2 or 4).
    Tensor d_logits = Tensor::empty({T, V}, h.dtype(), dev, MemCategory::logits);
    Tensor tg = detail::targets_on(targets, dev);
    cuda::ce_softmax_grad(d_logits.raw(), d_logits.dtype(), V, saved.logits.raw(), DType::f32, V,
                          tg.data<int32_t>(), saved.lse.data<float>(), scale, T, 0, V);
    // d_h = d_logits @ w  [T, V] x [V, H]
    if (d_h.dtype() == DType::f32) {
      matmul(d_logits, false, w, false, d_h);
    } else {
      Tensor dhf = Tensor::empty({T, H}, DType::f32, dev, MemCategory::workspace);
      matmul(d_logits, false, w, false, dhf);
      cuda::convert(d_h.raw(), d_h.dtype(), dhf.raw(), DType::f32, T * H);
    }
    // d_w += d_logits^T @ h  [V, T] x [T, H]
    matmul(d_logits, true, h, false, d_w, 1.0f, 1.0f);
    return;
  }
#endif
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

namespace bb {

namespace {
class FullCeHead final : public LossHead {
 public:
  LossResult train(float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                   Tensor& d_h, Tensor& d_w, bool overwrite_dw) const override {
    if (overwrite_dw) d_w.zero_();  // full_ce's backward adds
    LossHeadSaved saved;
    const LossResult r = full_ce_forward(h, w, targets, &saved);
    full_ce_backward(scale, h, w, targets, saved, d_h, d_w);
    return r;
  }
  LossResult evaluate(const Tensor& h, const Tensor& w, const Tensor& targets) const override {
    return full_ce_forward(h, w, targets, nullptr);
  }
};
}  // namespace

std::unique_ptr<LossHead> make_full_ce_head(const LossHeadConfig&) {
  return std::make_unique<FullCeHead>();
}

}  // namespace bb
