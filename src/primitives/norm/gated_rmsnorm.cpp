// gated_rmsnorm.cpp — boundary checks, then the CPU reference (gated_rmsnorm_ref.h) or the CUDA
// kernels (gated_rmsnorm_cuda.h), by where x lives.
#include "primitives/norm/gated_rmsnorm.h"

#include <cmath>

#include "backend/cpu/util.h"
#include "core/trace.h"
#include "primitives/norm/gated_rmsnorm_cuda.h"
#include "primitives/norm/gated_rmsnorm_ref.h"

namespace bb {

namespace {

int64_t check(const char* op, const Tensor& x, const Tensor& z, const Tensor& w, double eps) {
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&x, "x"}, {&z, "z"}, {&w, "w"}}) {
    check_defined(*t, op, name);
    BB_CHECK(t->dtype() == DType::f32 || t->dtype() == DType::bf16, op, ": argument '", name,
             "' has dtype ", dtype_name(t->dtype()), "; gated RMSNorm takes f32 or bf16");
  }
  check_same_device(x, z, op);
  check_same_device(x, w, op);
#ifndef BB_WITH_CUDA
  BB_CHECK(x.device().is_cpu(), op, ": x is on ", x.device().str(), " but this build has no CUDA backend");
#endif
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
  const int64_t rows = x.numel() / D;
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device(), out_cat);
  if (x.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    cuda::gated_rmsnorm_forward(y.raw(), x.raw(), x.dtype(), z.raw(), z.dtype(), w.raw(), w.dtype(), rows, D,
                                static_cast<float>(eps));
#endif
    return y;
  }
  Tensor xf = cpu::as_f32(x), zf = cpu::as_f32(z), wf = cpu::as_f32(w);
  Tensor yf = x.dtype() == DType::f32 ? y : cpu::empty_f32(x.shape(), MemCategory::workspace);
  ref::gated_rmsnorm_forward<float>(yf.data<float>(), xf.data<float>(), zf.data<float>(), wf.data<float>(), rows, D,
                                    eps);
  cpu::store_f32(y, yf);
  return y;
}

std::pair<Tensor, Tensor> gated_rmsnorm_backward(const Tensor& d_y, const Tensor& x, const Tensor& z, const Tensor& w,
                                                 double eps, Tensor& d_w) {
  BB_RANGE("gated_rmsnorm_backward");
  const char* op = "gated_rmsnorm_backward";
  const int64_t D = check(op, x, z, w, eps);
  const int64_t rows = x.numel() / D;
  BB_CHECK(d_y.dtype() == DType::f32 || d_y.dtype() == DType::bf16, op, ": argument 'd_y' has dtype ",
           dtype_name(d_y.dtype()), "; gated RMSNorm takes f32 or bf16");
  check_shape(d_y, x.shape(), op, "d_y");
  check_dtype(d_w, DType::f32, op, "d_w");
  check_shape(d_w, w.shape(), op, "d_w");
  check_same_device(x, d_y, op);
  check_same_device(x, d_w, op);
  Tensor dx = Tensor::empty(x.shape(), DType::f32, x.device(), MemCategory::activations);
  Tensor dz = Tensor::empty(x.shape(), DType::f32, x.device(), MemCategory::activations);
  if (x.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    Tensor ws = Tensor::empty({cuda::gated_rmsnorm_backward_workspace(rows, D)}, DType::f32, x.device(),
                              MemCategory::workspace);
    cuda::gated_rmsnorm_backward(dx.data<float>(), dz.data<float>(), d_w.data<float>(), ws.data<float>(), d_y.raw(),
                                 d_y.dtype(), x.raw(), x.dtype(), z.raw(), z.dtype(), w.raw(), w.dtype(), rows, D,
                                 static_cast<float>(eps));
#endif
    return {dx, dz};
  }
  Tensor xf = cpu::as_f32(x), zf = cpu::as_f32(z), wf = cpu::as_f32(w), dyf = cpu::as_f32(d_y);
  ref::gated_rmsnorm_backward<float>(dx.data<float>(), dz.data<float>(), d_w.data<float>(), dyf.data<float>(),
                                     xf.data<float>(), zf.data<float>(), wf.data<float>(), rows, D, eps);
  return {dx, dz};
}

}  // namespace bb
