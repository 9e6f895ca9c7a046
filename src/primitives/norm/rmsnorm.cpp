// rmsnorm.cpp — boundary checks for RMSNorm / QK norm, then the CPU reference or the CUDA
// kernels (rmsnorm_cuda.h) depending on where x lives.
#include "primitives/norm/rmsnorm.h"

#include "core/trace.h"

#include "backend/cpu/util.h"
#include "primitives/norm/rmsnorm_cuda.h"
#include "primitives/norm/rmsnorm_ref.h"

namespace bb {

namespace {
// The CUDA kernels store f32 or bf16; f16 stays a CPU-only storage type.
void check_cuda_dtype(const Tensor& t, const char* op, const char* arg) {
  BB_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, op, ": argument '", arg,
           "' has dtype ", dtype_name(t.dtype()), ", the CUDA path takes f32 or bf16");
}

// The CPU path's weight as f32, plus 1 for the zero-centred norm (a fresh copy then, never the
// caller's buffer).
Tensor cpu_weight(const Tensor& w, bool zero_centered) {
  Tensor wf = cpu::as_f32(w);
  if (!zero_centered) return wf;
  Tensor out = cpu::empty_f32(w.shape(), MemCategory::workspace);
  const float* src = wf.data<float>();
  float* dst = out.data<float>();
  for (int64_t i = 0; i < w.numel(); ++i) dst[i] = 1.0f + src[i];
  return out;
}

[[maybe_unused]] void require_cuda_build(const char* op, const Tensor& t) {
#ifndef BB_WITH_CUDA
  BB_FAIL(op, ": not implemented on ", t.device().str(), " in this build (no CUDA backend)");
#endif
}
}  // namespace

Tensor rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, RMSNormSaved* saved,
                       MemCategory out_cat, bool zero_centered) {
  BB_RANGE("rmsnorm_forward");
  check_float(x, "rmsnorm_forward", "x");
  check_float(w, "rmsnorm_forward", "w");
  BB_CHECK(x.dim() == 2, "rmsnorm_forward: x must be [T, H], got ", shape_str(x.shape()));
  const int64_t rows = x.size(0), H = x.size(1);
  check_shape(w, {H}, "rmsnorm_forward", "w");
  BB_CHECK(H > 0, "rmsnorm_forward: hidden size must be positive");
  BB_CHECK(eps > 0, "rmsnorm_forward: eps must be positive, got ", eps);
  check_same_device(x, w, "rmsnorm_forward");
  if (x.device().is_cuda()) {
    require_cuda_build("rmsnorm_forward", x);
    check_cuda_dtype(x, "rmsnorm_forward", "x");
    check_cuda_dtype(w, "rmsnorm_forward", "w");
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device(), out_cat);
    Tensor rstd = Tensor::empty({rows}, DType::f32, x.device(), MemCategory::activations);
#ifdef BB_WITH_CUDA
    cuda::rmsnorm_forward(y.raw(), rstd.data<float>(), x.raw(), x.dtype(), w.raw(), w.dtype(),
                          zero_centered ? 1.0f : 0.0f, rows, H, static_cast<float>(eps));
#endif
    if (saved) saved->rstd = rstd;
    return y;
  }
  Tensor xf = cpu::as_f32(x), wf = cpu_weight(w, zero_centered);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device(), out_cat);
  Tensor yf = x.dtype() == DType::f32 ? y : cpu::empty_f32(x.shape(), MemCategory::workspace);
  Tensor rstd = Tensor::empty({rows}, DType::f32, x.device(), MemCategory::activations);
  ref::rmsnorm_forward<float>(yf.data<float>(), rstd.data<float>(), xf.data<float>(),
                              wf.data<float>(), rows, H, eps);
  cpu::store_f32(y, yf);
  if (saved) saved->rstd = rstd;
  return y;
}

Tensor rmsnorm_backward(const Tensor& d_y, const Tensor& x, const Tensor& w,
                        const RMSNormSaved& saved, Tensor& d_w, bool zero_centered,
                        const Tensor* residual, DType out_dtype) {
  BB_RANGE("rmsnorm_backward");
  check_float(d_y, "rmsnorm_backward", "d_y");
  BB_CHECK(out_dtype == DType::f32 || out_dtype == DType::bf16,
           "rmsnorm_backward: d_x can be f32 or bf16, not ", dtype_name(out_dtype));
  BB_CHECK(x.dim() == 2, "rmsnorm_backward: x must be [T, H], got ", shape_str(x.shape()));
  const int64_t rows = x.size(0), H = x.size(1);
  check_shape(d_y, x.shape(), "rmsnorm_backward", "d_y");
  check_shape(saved.rstd, {rows}, "rmsnorm_backward", "saved.rstd");
  check_shape(d_w, {H}, "rmsnorm_backward", "d_w");
  check_dtype(d_w, DType::f32, "rmsnorm_backward", "d_w");
  check_float(x, "rmsnorm_backward", "x");
  check_float(w, "rmsnorm_backward", "w");
  check_shape(w, {H}, "rmsnorm_backward", "w");
  check_dtype(saved.rstd, DType::f32, "rmsnorm_backward", "saved.rstd");
  for (const Tensor* t : {&d_y, &w, &saved.rstd, static_cast<const Tensor*>(&d_w)})
    check_same_device(x, *t, "rmsnorm_backward");
  if (residual) {
    check_shape(*residual, x.shape(), "rmsnorm_backward", "residual");
    check_dtype(*residual, DType::f32, "rmsnorm_backward", "residual");
    check_same_device(x, *residual, "rmsnorm_backward");
  }
  if (x.device().is_cuda()) {
    require_cuda_build("rmsnorm_backward", x);
    check_cuda_dtype(x, "rmsnorm_backward", "x");
    check_cuda_dtype(w, "rmsnorm_backward", "w");
    check_cuda_dtype(d_y, "rmsnorm_backward", "d_y");
    Tensor dx = Tensor::empty(x.shape(), out_dtype, x.device(), MemCategory::activations);
#ifdef BB_WITH_CUDA
    Tensor ws = Tensor::empty({cuda::rmsnorm_backward_workspace(rows, H)}, DType::f32, x.device(),
                              MemCategory::workspace);
    cuda::rmsnorm_backward(dx.raw(), out_dtype, d_w.data<float>(), ws.data<float>(), d_y.raw(),
                           d_y.dtype(), x.raw(), x.dtype(), w.raw(), w.dtype(),
                           zero_centered ? 1.0f : 0.0f, saved.rstd.data<float>(), rows, H,
                           residual ? residual->data<float>() : nullptr);
#endif
    return dx;
  }
  Tensor xf = cpu::as_f32(x), wf = cpu_weight(w, zero_centered), dyf = cpu::as_f32(d_y);
  Tensor dx = Tensor::empty(x.shape(), DType::f32, x.device(),
                            out_dtype == DType::f32 ? MemCategory::activations
                                                    : MemCategory::workspace);
  ref::rmsnorm_backward<float>(dx.data<float>(), d_w.data<float>(), dyf.data<float>(),
                               xf.data<float>(), wf.data<float>(), saved.rstd.data<float>(), rows, H);
  if (residual) {
    float* o = dx.data<float>();
    const float* r = residual->data<float>();
    for (int64_t i = 0; i < rows * H; ++i) o[i] += r[i];
  }
  if (out_dtype == DType::f32) return dx;
  Tensor out = Tensor::empty(x.shape(), out_dtype, x.device(), MemCategory::activations);
  cpu::store_f32(out, dx);
  return out;
}

Tensor qk_norm_forward(const Tensor& x, const Tensor& w, double eps, RMSNormSaved* saved,
                       MemCategory out_cat, bool zero_centered) {
  BB_CHECK(x.dim() == 3, "qk_norm_forward: x must be [T, heads, D], got ", shape_str(x.shape()));
  const Shape s = x.shape();
  return rmsnorm_forward(x.view({s[0] * s[1], s[2]}), w, eps, saved, out_cat, zero_centered).view(s);
}

Tensor qk_norm_backward(const Tensor& d_y, const Tensor& x, const Tensor& w,
                        const RMSNormSaved& saved, Tensor& d_w, bool zero_centered,
                        DType out_dtype) {
  BB_CHECK(x.dim() == 3, "qk_norm_backward: x must be [T, heads, D], got ", shape_str(x.shape()));
  const Shape s = x.shape();
  check_shape(d_y, s, "qk_norm_backward", "d_y");
  return rmsnorm_backward(d_y.view({s[0] * s[1], s[2]}), x.view({s[0] * s[1], s[2]}), w, saved, d_w,
                          zero_centered, nullptr, out_dtype)
      .view(s);
}

}  // namespace bb
