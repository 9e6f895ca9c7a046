// gated_rmsnorm.cpp — boundary checks, then the CPU reference (gated_rmsnorm_ref.h).
#include "primitives/norm/gated_rmsnorm.h"

#include <cmath>

#include "core/trace.h"
#include "primitives/norm/gated_rmsnorm_ref.h"

namespace bb {

namespace {

int64_t check(const char* op, const Tensor& x, const Tensor& z, const Tensor& w, double eps) {
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&x, "x"}, {&z, "z"}, {&w, "w"}}) {
    check_defined(*t, op, name);
    check_dtype(*t, DType::f32, op, name);
    BB_CHECK(t->device().is_cpu(), op, ": argument '", name, "' is on ", t->device().str(),
             "; gated RMSNorm has only its CPU reference so far");
  }
  BB_CHECK(w.dim() == 1 && w.numel() > 0 && x.dim() >= 2 && x.shape().back() == w.numel(), op,
           ": x must be [..., D] with D = w's ", w.numel(), " elements, got x ", shape_str(x.shape()));
  check_shape(z, x.shape(), op, "z");
  BB_CHECK(eps > 0 && std::isfinite(eps), op, ": eps must be positive");
  return w.numel();
}

}  // namespace

Tensor gated_rmsnorm_forward(const Tensor& x, const Tensor& z, const Tensor& w, double eps, MemCategory out_cat) {
  BB_RANGE("gated_rmsnorm_forward");
  const int64_t D = check("gated_rmsnorm_forward", x, z, w, eps);
  Tensor y = Tensor::empty(x.shape(), DType::f32, Device::cpu(), out_cat);
  ref::gated_rmsnorm_forward<float>(y.data<float>(), x.data<float>(), z.data<float>(), w.data<float>(), x.numel() / D, D,
                                    eps);
  return y;
}

std::pair<Tensor, Tensor> gated_rmsnorm_backward(const Tensor& d_y, const Tensor& x, const Tensor& z, const Tensor& w,
                                                 double eps, Tensor& d_w) {
  BB_RANGE("gated_rmsnorm_backward");
  const char* op = "gated_rmsnorm_backward";
  const int64_t D = check(op, x, z, w, eps);
  check_dtype(d_y, DType::f32, op, "d_y");
  check_shape(d_y, x.shape(), op, "d_y");
  check_dtype(d_w, DType::f32, op, "d_w");
  check_shape(d_w, w.shape(), op, "d_w");
  BB_CHECK(d_y.device().is_cpu() && d_w.device().is_cpu(), op, ": d_y and d_w must be on the CPU");
  Tensor dx = Tensor::empty(x.shape(), DType::f32, Device::cpu(), MemCategory::activations);
  Tensor dz = Tensor::empty(x.shape(), DType::f32, Device::cpu(), MemCategory::activations);
  ref::gated_rmsnorm_backward<float>(dx.data<float>(), dz.data<float>(), d_w.data<float>(), d_y.data<float>(),
                                     x.data<float>(), z.data<float>(), w.data<float>(), x.numel() / D, D, eps);
  return {dx, dz};
}

}  // namespace bb
