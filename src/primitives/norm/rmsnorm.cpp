#include "primitives/norm/rmsnorm.h"

#include "backend/cpu/util.h"
#include "primitives/norm/rmsnorm_ref.h"

namespace bb {

namespace {
void check_cpu(const Tensor& t, const char* op) {
  BB_CHECK(t.device().is_cpu(), op, ": not implemented on ", t.device().str(), " yet");
}
}  // namespace

Tensor rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, RMSNormSaved* saved,
                       MemCategory out_cat) {
  check_float(x, "rmsnorm_forward", "x");
  check_float(w, "rmsnorm_forward", "w");
  BB_CHECK(x.dim() == 2, "rmsnorm_forward: x must be [T, H], got ", shape_str(x.shape()));
  const int64_t rows = x.size(0), H = x.size(1);
  check_shape(w, {H}, "rmsnorm_forward", "w");
  BB_CHECK(H > 0, "rmsnorm_forward: hidden size must be positive");
  BB_CHECK(eps > 0, "rmsnorm_forward: eps must be positive, got ", eps);
  check_same_device(x, w, "rmsnorm_forward");
  check_cpu(x, "rmsnorm_forward");
  Tensor xf = cpu::as_f32(x), wf = cpu::as_f32(w);
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
                        const RMSNormSaved& saved, Tensor& d_w) {
  check_float(d_y, "rmsnorm_backward", "d_y");
  BB_CHECK(x.dim() == 2, "rmsnorm_backward: x must be [T, H], got ", shape_str(x.shape()));
  const int64_t rows = x.size(0), H = x.size(1);
  check_shape(d_y, x.shape(), "rmsnorm_backward", "d_y");
  check_shape(saved.rstd, {rows}, "rmsnorm_backward", "saved.rstd");
  check_shape(d_w, {H}, "rmsnorm_backward", "d_w");
  check_dtype(d_w, DType::f32, "rmsnorm_backward", "d_w");
  check_cpu(x, "rmsnorm_backward");
  Tensor xf = cpu::as_f32(x), wf = cpu::as_f32(w), dyf = cpu::as_f32(d_y);
  Tensor dx = Tensor::empty(x.shape(), DType::f32, x.device(), MemCategory::activations);
  ref::rmsnorm_backward<float>(dx.data<float>(), d_w.data<float>(), dyf.data<float>(),
                               xf.data<float>(), wf.data<float>(), saved.rstd.data<float>(), rows, H);
  return dx;
}

Tensor qk_norm_forward(const Tensor& x, const Tensor& w, double eps, RMSNormSaved* saved,
                       MemCategory out_cat) {
  BB_CHECK(x.dim() == 3, "qk_norm_forward: x must be [T, heads, D], got ", shape_str(x.shape()));
  const Shape s = x.shape();
  return rmsnorm_forward(x.view({s[0] * s[1], s[2]}), w, eps, saved, out_cat).view(s);
}

Tensor qk_norm_backward(const Tensor& d_y, const Tensor& x, const Tensor& w,
                        const RMSNormSaved& saved, Tensor& d_w) {
  BB_CHECK(x.dim() == 3, "qk_norm_backward: x must be [T, heads, D], got ", shape_str(x.shape()));
  const Shape s = x.shape();
  check_shape(d_y, s, "qk_norm_backward", "d_y");
  return rmsnorm_backward(d_y.view({s[0] * s[1], s[2]}), x.view({s[0] * s[1], s[2]}), w, saved, d_w)
      .view(s);
}

}  // namespace bb
