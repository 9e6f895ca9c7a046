// gdn_gates.cpp — boundary checks, then the CPU reference (gdn_gates_ref.h) or the CUDA kernels
// (gdn_gates_cuda.h), by where a lives.
#include "primitives/gdn/gdn_gates.h"

#include "backend/cpu/util.h"
#include "core/trace.h"
#include "primitives/gdn/gdn_gates_cuda.h"
#include "primitives/gdn/gdn_gates_ref.h"

namespace bb {

namespace {

void check_ab(const Tensor& t, const char* op, const char* name) {
  check_defined(t, op, name);
  BB_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, op, ": argument '", name, "' has dtype ",
           dtype_name(t.dtype()), "; the gates take f32 or bf16 projections");
}

// Checks the common arguments; returns Hv.
int64_t check(const char* op, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias) {
  check_ab(a, op, "a");
  BB_CHECK(a.dim() == 2, op, ": a must be [T, Hv], got ", shape_str(a.shape()));
  const int64_t Hv = a.size(1);
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&a_log, "A_log"}, {&dt_bias, "dt_bias"}}) {
    check_defined(*t, op, name);
    check_dtype(*t, DType::f32, op, name);
    check_shape(*t, {Hv}, op, name);
    check_same_device(a, *t, op);
  }
#ifndef BB_WITH_CUDA
  BB_CHECK(a.device().is_cpu(), op, ": a is on ", a.device().str(), " but this build has no CUDA backend");
#endif
  return Hv;
}

Tensor f32_like(const Tensor& like, const Shape& s) {
  return Tensor::empty(s, DType::f32, like.device(), MemCategory::activations);
}

}  // namespace

GdnGates gdn_gates_forward(const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias) {
  BB_RANGE("gdn_gates_forward");
  const char* op = "gdn_gates_forward";
  const int64_t Hv = check(op, a, a_log, dt_bias);
  check_ab(b, op, "b");
  check_shape(b, a.shape(), op, "b");
  check_same_device(a, b, op);
  const int64_t T = a.size(0);
  GdnGates r{f32_like(a, {T, Hv}), f32_like(a, {T, Hv})};
  if (a.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    cuda::gdn_gates_forward(r.g.data<float>(), r.beta.data<float>(), a.raw(), a.dtype(), b.raw(), b.dtype(),
                            a_log.data<float>(), dt_bias.data<float>(), T, Hv);
#endif
    return r;
  }
  const Tensor af = cpu::as_f32(a), bf = cpu::as_f32(b);
  ref::gdn_gates_forward<float>(r.g.data<float>(), r.beta.data<float>(), af.data<float>(), bf.data<float>(),
                                a_log.data<float>(), dt_bias.data<float>(), T, Hv);
  return r;
}

std::pair<Tensor, Tensor> gdn_gates_backward(const Tensor& d_g, const Tensor& d_beta, const Tensor& a,
                                             const Tensor& g, const Tensor& beta, const Tensor& a_log,
                                             const Tensor& dt_bias, Tensor& d_a_log, Tensor& d_dt_bias) {
  BB_RANGE("gdn_gates_backward");
  const char* op = "gdn_gates_backward";
  const int64_t Hv = check(op, a, a_log, dt_bias);
  const int64_t T = a.size(0);
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&d_g, "d_g"}, {&d_beta, "d_beta"}, {&g, "g"},
                         {&beta, "beta"}}) {
    check_defined(*t, op, name);
    check_dtype(*t, DType::f32, op, name);
    check_shape(*t, {T, Hv}, op, name);
    check_same_device(a, *t, op);
  }
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&d_a_log, "d_A_log"}, {&d_dt_bias, "d_dt_bias"}}) {
    check_dtype(*t, DType::f32, op, name);
    check_shape(*t, {Hv}, op, name);
    check_same_device(a, *t, op);
  }
  Tensor d_a = f32_like(a, {T, Hv}), d_b = f32_like(a, {T, Hv});
  if (a.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    Tensor ws = Tensor::empty({cuda::gdn_gates_backward_workspace(T, Hv)}, DType::f32, a.device(),
                              MemCategory::workspace);
    cuda::gdn_gates_backward(d_a.data<float>(), d_b.data<float>(), d_a_log.data<float>(), d_dt_bias.data<float>(),
                             ws.data<float>(), d_g.data<float>(), d_beta.data<float>(), a.raw(), a.dtype(),
                             g.data<float>(), beta.data<float>(), a_log.data<float>(), dt_bias.data<float>(), T,
                             Hv);
#endif
    return {d_a, d_b};
  }
  const Tensor af = cpu::as_f32(a);
  ref::gdn_gates_backward<float>(d_a.data<float>(), d_b.data<float>(), d_a_log.data<float>(),
                                 d_dt_bias.data<float>(), d_g.data<float>(), d_beta.data<float>(), af.data<float>(),
                                 g.data<float>(), beta.data<float>(), a_log.data<float>(), dt_bias.data<float>(), T,
                                 Hv);
  return {d_a, d_b};
}

}  // namespace bb
