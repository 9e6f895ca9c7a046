// gated_delta_rule.cpp — boundary checks, then the CPU reference (gated_delta_rule_ref.h).
#include "primitives/gdn/gated_delta_rule.h"

#include <cmath>

#include "core/trace.h"
#include "primitives/gdn/gated_delta_rule_ref.h"

namespace bb {

namespace {

ref::GdnShape check(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                    const Tensor& beta, const Tensor& cu, const GatedDeltaOptions& o) {
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}}) {
    check_defined(*t, op, name);
    check_dtype(*t, DType::f32, op, name);
    BB_CHECK(t->device().is_cpu(), op, ": argument '", name, "' is on ", t->device().str(),
             "; the gated delta rule has only its CPU reference so far (the CUDA chunked kernels come next)");
  }
  check_dtype(cu, DType::i32, op, "cu_seqlens");
  BB_CHECK(cu.device().is_cpu(), op, ": cu_seqlens must be on the host");
  BB_CHECK(q.dim() == 3 && v.dim() == 3, op, ": q, k must be [T, Hk, K] and v [T, Hv, V], got q ",
           shape_str(q.shape()), ", v ", shape_str(v.shape()));
  ref::GdnShape s;
  s.T = q.size(0);
  s.Hk = q.size(1);
  s.K = q.size(2);
  s.Hv = v.size(1);
  s.V = v.size(2);
  check_shape(k, q.shape(), op, "k");
  check_shape(v, {s.T, s.Hv, s.V}, op, "v");
  check_shape(g, {s.T, s.Hv}, op, "g");
  check_shape(beta, {s.T, s.Hv}, op, "beta");
  BB_CHECK(s.Hk > 0 && s.K > 0 && s.V > 0 && s.Hv % s.Hk == 0, op, ": value heads (", s.Hv,
           ") must be a positive multiple of key heads (", s.Hk, ")");
  BB_CHECK(cu.dim() == 1 && cu.numel() >= 2, op, ": cu_seqlens must be [n + 1] with n >= 1");
  const std::vector<int32_t> c = cu.to_ints();
  BB_CHECK(c.front() == 0 && c.back() == s.T, op, ": cu_seqlens must start at 0 and end at T = ", s.T,
           ", got ", c.front(), " .. ", c.back());
  for (size_t i = 1; i < c.size(); ++i)
    BB_CHECK(c[i] >= c[i - 1], op, ": cu_seqlens must not decrease (", c[i - 1], " then ", c[i], ")");
  BB_CHECK(o.eps > 0 && std::isfinite(o.eps) && o.scale >= 0 && std::isfinite(o.scale), op,
           ": eps must be > 0 and scale >= 0 (0 = 1/sqrt(K))");
  s.scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(s.K));
  s.l2norm = o.l2norm;
  s.eps = o.eps;
  return s;
}

}  // namespace

Tensor gated_delta_rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, const Tensor& cu_seqlens, const GatedDeltaOptions& opts,
                                MemCategory out_cat) {
  BB_RANGE("gated_delta_rule_forward");
  const ref::GdnShape s = check("gated_delta_rule_forward", q, k, v, g, beta, cu_seqlens, opts);
  Tensor o = Tensor::empty(v.shape(), DType::f32, Device::cpu(), out_cat);
  ref::gated_delta_forward<float>(o.data<float>(), q.data<float>(), k.data<float>(), v.data<float>(),
                                  g.data<float>(), beta.data<float>(), cu_seqlens.data<int32_t>(),
                                  cu_seqlens.numel() - 1, s);
  return o;
}

GatedDeltaGrads gated_delta_rule_backward(const Tensor& d_o, const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                          const GatedDeltaOptions& opts) {
  BB_RANGE("gated_delta_rule_backward");
  const char* op = "gated_delta_rule_backward";
  const ref::GdnShape s = check(op, q, k, v, g, beta, cu_seqlens, opts);
  check_dtype(d_o, DType::f32, op, "d_o");
  check_shape(d_o, v.shape(), op, "d_o");
  BB_CHECK(d_o.device().is_cpu(), op, ": d_o must be on the CPU like the inputs");
  auto mk = [](const Tensor& like) { return Tensor::empty(like.shape(), DType::f32, Device::cpu(), MemCategory::activations); };
  GatedDeltaGrads r{mk(q), mk(k), mk(v), mk(g), mk(beta)};
  ref::gated_delta_backward<float>(r.d_q.data<float>(), r.d_k.data<float>(), r.d_v.data<float>(), r.d_g.data<float>(),
                                   r.d_beta.data<float>(), d_o.data<float>(), q.data<float>(), k.data<float>(),
                                   v.data<float>(), g.data<float>(), beta.data<float>(), cu_seqlens.data<int32_t>(),
                                   cu_seqlens.numel() - 1, s);
  return r;
}

}  // namespace bb
