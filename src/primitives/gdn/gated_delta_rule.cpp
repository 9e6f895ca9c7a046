// gated_delta_rule.cpp — boundary checks, then the CPU reference (gated_delta_rule_ref.h) or the
// chunked CUDA kernels (gated_delta_rule_cuda.cu) by the device of the inputs.
#include "primitives/gdn/gated_delta_rule.h"

#include <cmath>
#include <functional>

#include "core/trace.h"
#include "primitives/attention/cp_ops.h"
#include "primitives/gdn/gated_delta_rule_cuda.h"
#include "primitives/gdn/gated_delta_rule_ref.h"

namespace bb {

namespace {

ref::GdnShape check(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& g, const Tensor& beta, const Tensor& cu,
                    const GatedDeltaOptions& o) {
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&q, "q"},
                         {&k, "k"},
                         {&v, "v"},
                         {&g, "g"},
                         {&beta, "beta"}})
    check_defined(*t, op, name);
  const Device dev = q.device();
  for (auto [t, name] :
       {std::pair<const Tensor*, const char*>{&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}})
    BB_CHECK(t->device() == dev, op, ": argument '", name, "' is on ", t->device().str(),
             " but q is on ", dev.str());
  if (dev.is_cpu()) {
    for (auto [t, name] : {std::pair<const Tensor*, const char*>{&q, "q"}, {&k, "k"}, {&v, "v"}})
      check_dtype(*t, DType::f32, op, name);
  } else {
#ifdef BB_WITH_CUDA
    BB_CHECK(q.dtype() == DType::f32 || q.dtype() == DType::bf16, op,
             ": on CUDA q, k, v must be f32 or bf16, got q ", q.str());
    check_dtype(k, q.dtype(), op, "k");
    check_dtype(v, q.dtype(), op, "v");
#else
    BB_CHECK(false, op, ": q is on ", dev.str(), " but this build has no CUDA backend");
#endif
  }
  check_dtype(g, DType::f32, op, "g");
  check_dtype(beta, DType::f32, op, "beta");
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
  if (dev.is_cuda())
    BB_CHECK(s.K <= 128 && s.V <= 128 && s.K % 8 == 0 && s.V % 8 == 0, op,
             ": the CUDA kernels take head dims K, V <= 128 and multiples of 8, got K = ", s.K,
             ", V = ", s.V);
  BB_CHECK(cu.dim() == 1 && cu.numel() >= 2, op, ": cu_seqlens must be [n + 1] with n >= 1");
  const std::vector<int32_t> c = cu.to_ints();
  BB_CHECK(c.front() == 0 && c.back() == s.T, op,
           ": cu_seqlens must start at 0 and end at T = ", s.T, ", got ", c.front(), " .. ",
           c.back());
  for (size_t i = 1; i < c.size(); ++i)
    BB_CHECK(c[i] >= c[i - 1], op, ": cu_seqlens must not decrease (", c[i - 1], " then ", c[i],
             ")");
  BB_CHECK(o.eps > 0 && std::isfinite(o.eps) && o.scale >= 0 && std::isfinite(o.scale), op,
           ": eps must be > 0 and scale >= 0 (0 = 1/sqrt(K))");
  s.scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(s.K));
  s.l2norm = o.l2norm;
  s.eps = o.eps;
  return s;
}

#ifdef BB_WITH_CUDA
// The CUDA kernels' dims and their chunk table, uploaded on the current stream (staged, no host
// wait).
struct CudaPlan {
  cuda::GdnDims dims;
  Tensor table;
};
// table: the device chunk table of an earlier plan for the same cu_seqlens (not uploaded again).
CudaPlan cuda_plan(const ref::GdnShape& s, const Tensor& cu, Device dev, const Tensor* table_on_device = nullptr) {
  CudaPlan p;
  p.dims.T = s.T;
  p.dims.Hk = static_cast<int>(s.Hk);
  p.dims.Hv = static_cast<int>(s.Hv);
  p.dims.K = static_cast<int>(s.K);
  p.dims.V = static_cast<int>(s.V);
  p.dims.scale = static_cast<float>(s.scale);
  p.dims.eps = static_cast<float>(s.eps);
  p.dims.l2norm = s.l2norm;
  const std::vector<int32_t> table =
      cuda::gdn_chunk_table(cu.data<int32_t>(), cu.numel() - 1, p.dims);
  if (table_on_device != nullptr) {
    p.table = *table_on_device;
    return p;
  }
  p.table = Tensor::from_ints(table.empty() ? std::vector<int32_t>{0} : table,
                              {static_cast<int64_t>(std::max<size_t>(1, table.size()))})
                .to(dev, MemCategory::workspace);
  return p;
}
Tensor workspace(size_t bytes, Device dev) {
  return Tensor::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, DType::u8, dev,
                       MemCategory::workspace);
}

// The fewest key-head groups (a divisor of Hk) whose per-call workspace fits `limit`; Hk when
// none does (one key head per call is the least a call can take).
int64_t head_groups(const CudaPlan& p, int64_t Hk, size_t limit, const std::function<size_t(const cuda::GdnDims&)>& ws) {
  for (int64_t groups = 1; groups <= Hk; ++groups) {
    if (Hk % groups != 0) continue;
    cuda::GdnDims d = p.dims;
    d.Hk = static_cast<int>(Hk / groups);
    d.Hv = static_cast<int>(p.dims.Hv / groups);
    if (ws(d) <= limit) return groups;
  }
  return Hk;
}

// Heads [first, first + count) of x [T, H, D] as a contiguous [T, count, D] copy (or x itself
// when that is all of it); g and beta ([T, Hv]) are viewed [T, Hv, 1].
Tensor heads_of(const Tensor& x, int64_t first, int64_t count) {
  const Tensor x3 = x.dim() == 2 ? x.view({x.size(0), x.size(1), 1}) : x;
  if (count == x3.size(1)) return x;
  const Tensor h = cp::split_heads(x3, {first}, count, MemCategory::workspace);
  return x.dim() == 2 ? h.view({x.size(0), count}) : h;
}
// Writes part [T, count, D] (or [T, count]) into heads [first, first + count) of dst.
void put_heads(Tensor& dst, const Tensor& part, int64_t first) {
  Tensor d3 = dst.dim() == 2 ? dst.view({dst.size(0), dst.size(1), 1}) : dst;
  const int64_t count = part.numel() / std::max<int64_t>(1, dst.size(0) * d3.size(2));
  cp::join_heads(d3, part.view({dst.size(0), count, d3.size(2)}), {first}, count, /*accumulate=*/false);
}
#endif

}  // namespace

Tensor gated_delta_rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, const Tensor& cu_seqlens,
                                const GatedDeltaOptions& opts, MemCategory out_cat,
                                GatedDeltaPrep* keep) {
  BB_RANGE("gated_delta_rule_forward");
  const ref::GdnShape s = check("gated_delta_rule_forward", q, k, v, g, beta, cu_seqlens, opts);
  Tensor o = Tensor::empty(v.shape(), v.dtype(), v.device(), out_cat);
  if (keep != nullptr) *keep = GatedDeltaPrep{};
#ifdef BB_WITH_CUDA
  if (q.device().is_cuda()) {
    if (s.T == 0) return o;
    const CudaPlan p = cuda_plan(s, cu_seqlens, q.device());
    // Kept: one call whose workspace is the prep the backward takes (only when it fits one call).
    const bool keeping = keep != nullptr && cuda::gdn_prep_bytes(p.dims, q.dtype()) <= opts.max_workspace_bytes;
    const int64_t groups = keeping ? 1 : head_groups(p, s.Hk, opts.max_workspace_bytes, [&](const cuda::GdnDims& d) {
      return cuda::gdn_forward_workspace_bytes(d, q.dtype());
    });
    const int64_t hk = s.Hk / groups, hv = s.Hv / groups;
    cuda::GdnDims d = p.dims;
    d.Hk = static_cast<int>(hk);
    d.Hv = static_cast<int>(hv);
    Tensor ws;
    if (keeping) {
      ws = Tensor::empty({static_cast<int64_t>(std::max<size_t>(cuda::gdn_prep_bytes(d, q.dtype()), 1))}, DType::u8,
                         q.device(), MemCategory::activations);
      *keep = GatedDeltaPrep{ws, p.table, cu_seqlens.to_ints(), q.shape(), v.shape(), q.dtype(), s.scale, s.eps,
                             s.l2norm};
    } else {
      ws = workspace(cuda::gdn_forward_workspace_bytes(d, q.dtype()), q.device());
    }
    for (int64_t gi = 0; gi < groups; ++gi) {
      const Tensor qg = heads_of(q, gi * hk, hk), kg = heads_of(k, gi * hk, hk), vg = heads_of(v, gi * hv, hv);
      const Tensor gg = heads_of(g, gi * hv, hv), bg = heads_of(beta, gi * hv, hv);
      Tensor og = groups == 1 ? o : Tensor::empty({s.T, hv, s.V}, v.dtype(), v.device(), MemCategory::workspace);
      cuda::gdn_forward(og.raw(), qg.raw(), kg.raw(), vg.raw(), gg.data<float>(), bg.data<float>(),
                        p.table.data<int32_t>(), d, q.dtype(), ws.raw(), keeping);
      if (groups > 1) put_heads(o, og, gi * hv);
    }
    return o;
  }
#endif
  ref::gated_delta_forward<float>(o.data<float>(), q.data<float>(), k.data<float>(),
                                  v.data<float>(), g.data<float>(), beta.data<float>(),
                                  cu_seqlens.data<int32_t>(), cu_seqlens.numel() - 1, s);
  return o;
}

GatedDeltaGrads gated_delta_rule_backward(const Tensor& d_o, const Tensor& q, const Tensor& k,
                                          const Tensor& v, const Tensor& g, const Tensor& beta,
                                          const Tensor& cu_seqlens, const GatedDeltaOptions& opts,
                                          GatedDeltaPrep* prep) {
  BB_RANGE("gated_delta_rule_backward");
  const char* op = "gated_delta_rule_backward";
  const ref::GdnShape s = check(op, q, k, v, g, beta, cu_seqlens, opts);
  check_defined(d_o, op, "d_o");
  check_shape(d_o, v.shape(), op, "d_o");
  BB_CHECK(d_o.device() == q.device(), op, ": d_o is on ", d_o.device().str(),
           " but the inputs are on ", q.device().str());
  if (q.device().is_cpu())
    check_dtype(d_o, DType::f32, op, "d_o");
  else
    BB_CHECK(d_o.dtype() == DType::f32 || d_o.dtype() == v.dtype(), op,
             ": d_o must be f32 or v's dtype (", dtype_name(v.dtype()), "), got ", d_o.str());
  const Device dev = q.device();
  auto mk = [&](const Tensor& like) {
    return Tensor::empty(like.shape(), DType::f32, dev, MemCategory::activations);
  };
  // A kept prep is released on return, whichever path runs.
  GatedDeltaPrep kept;
  if (prep != nullptr && prep->defined()) {
    kept = std::move(*prep);
    *prep = GatedDeltaPrep{};
    BB_CHECK(dev.is_cuda() && kept.buffer.device() == dev && kept.q_shape == q.shape() &&
                 kept.v_shape == v.shape() && kept.dtype == q.dtype() && kept.cu == cu_seqlens.to_ints() &&
                 kept.scale == s.scale && kept.eps == s.eps && kept.l2norm == s.l2norm,
             op, ": the kept forward prep was made for other inputs (q ", shape_str(kept.q_shape), ", v ",
             shape_str(kept.v_shape), " ", dtype_name(kept.dtype), ", ", kept.cu.size() - 1,
             " sequences) than this call's (", q.str(), ", ", v.str(), ", ", cu_seqlens.numel() - 1,
             " sequences, or other options): pass the prep of the forward on these inputs, or none");
  }
  GatedDeltaGrads r{mk(q), mk(k), mk(v), mk(g), mk(beta)};
#ifdef BB_WITH_CUDA
  if (dev.is_cuda()) {
    if (s.T == 0) return r;
    const CudaPlan p = cuda_plan(s, cu_seqlens, dev, kept.defined() ? &kept.table : nullptr);
    // A kept prep serves one call; when the rest of the workspace does not fit one, it is dropped
    // and the head groups make their own.
    if (kept.defined() &&
        cuda::gdn_backward_workspace_bytes(p.dims, q.dtype(), d_o.dtype(), /*have_prep=*/true) > opts.max_workspace_bytes)
      kept = GatedDeltaPrep{};
    const int64_t groups = kept.defined() ? 1 : head_groups(p, s.Hk, opts.max_workspace_bytes, [&](const cuda::GdnDims& d) {
      return cuda::gdn_backward_workspace_bytes(d, q.dtype(), d_o.dtype());
    });
    const int64_t hk = s.Hk / groups, hv = s.Hv / groups;
    cuda::GdnDims d = p.dims;
    d.Hk = static_cast<int>(hk);
    d.Hv = static_cast<int>(hv);
    const Tensor ws = workspace(cuda::gdn_backward_workspace_bytes(d, q.dtype(), d_o.dtype(), kept.defined()), dev);
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t k0 = gi * hk, v0 = gi * hv;
      const Tensor qg = heads_of(q, k0, hk), kg = heads_of(k, k0, hk), vg = heads_of(v, v0, hv);
      const Tensor gg = heads_of(g, v0, hv), bg = heads_of(beta, v0, hv), dog = heads_of(d_o, v0, hv);
      GatedDeltaGrads part = r;
      if (groups > 1) {
        auto mk_part = [&](const Shape& shape) { return Tensor::empty(shape, DType::f32, dev, MemCategory::workspace); };
        part = {mk_part({s.T, hk, s.K}), mk_part({s.T, hk, s.K}), mk_part({s.T, hv, s.V}), mk_part({s.T, hv}),
                mk_part({s.T, hv})};
      }
      cuda::gdn_backward(part.d_q.data<float>(), part.d_k.data<float>(), part.d_v.data<float>(),
                         part.d_g.data<float>(), part.d_beta.data<float>(), dog.raw(), d_o.dtype(), qg.raw(),
                         kg.raw(), vg.raw(), gg.data<float>(), bg.data<float>(), p.table.data<int32_t>(), d,
                         q.dtype(), ws.raw(), kept.defined() ? kept.buffer.raw() : nullptr);
      if (groups > 1) {
        put_heads(r.d_q, part.d_q, k0);
        put_heads(r.d_k, part.d_k, k0);
        put_heads(r.d_v, part.d_v, v0);
        put_heads(r.d_g, part.d_g, v0);
        put_heads(r.d_beta, part.d_beta, v0);
      }
    }
    return r;
  }
#endif
  ref::gated_delta_backward<float>(
      r.d_q.data<float>(), r.d_k.data<float>(), r.d_v.data<float>(), r.d_g.data<float>(),
      r.d_beta.data<float>(), d_o.data<float>(), q.data<float>(), k.data<float>(), v.data<float>(),
      g.data<float>(), beta.data<float>(), cu_seqlens.data<int32_t>(), cu_seqlens.numel() - 1, s);
  return r;
}

}  // namespace bb
