// gated_delta_rule.cpp — boundary checks, then the CPU reference (gated_delta_rule_ref.h) or the
// chunked CUDA kernels (gated_delta_rule_cuda.cu) by the device of the inputs.
#include "primitives/gdn/gated_delta_rule.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "core/trace.h"
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
// wait); the host copy stays for gdn_table_seq.
struct CudaPlan {
  cuda::GdnDims dims;
  std::vector<int32_t> host;
  Tensor table;
};
// T tokens in sequences cu (host, starting at 0). table: the device chunk table of an earlier
// plan for the same cu_seqlens (not uploaded again).
CudaPlan cuda_plan(const ref::GdnShape& s, int64_t T, const std::vector<int32_t>& cu, Device dev,
                   const Tensor* table_on_device = nullptr) {
  CudaPlan p;
  p.dims.T = T;
  p.dims.Hk = static_cast<int>(s.Hk);
  p.dims.Hv = static_cast<int>(s.Hv);
  p.dims.K = static_cast<int>(s.K);
  p.dims.V = static_cast<int>(s.V);
  p.dims.scale = static_cast<float>(s.scale);
  p.dims.eps = static_cast<float>(s.eps);
  p.dims.l2norm = s.l2norm;
  p.host = cuda::gdn_chunk_table(cu.data(), static_cast<int64_t>(cu.size()) - 1, p.dims);
  if (table_on_device != nullptr) {
    p.table = *table_on_device;
    return p;
  }
  p.table = Tensor::from_ints(p.host.empty() ? std::vector<int32_t>{0} : p.host,
                              {static_cast<int64_t>(std::max<size_t>(1, p.host.size()))})
                .to(dev, MemCategory::workspace);
  return p;
}
Tensor workspace(size_t bytes, Device dev) {
  return Tensor::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, DType::u8, dev,
                       MemCategory::workspace);
}

// A call whose workspace would exceed the limit runs in time segments: token ranges [a, b) of
// the batch, each a call of its own, cut at whole chunks of the sequence they cut (so every chunk
// is the chunk one call would make). A sequence cut by a segment's end carries its state into
// the next segment (GdnCarry): the results are bitwise those of one call.
struct Segment {
  int64_t a = 0, b = 0;
  std::vector<int32_t> cu;  // the non-empty sequences within [a, b), relative to a
  bool cont_in = false;     // its first sequence began before a
  bool cont_out = false;    // its last sequence goes on past b
};

// Segments of at most `len` tokens (a multiple of the chunk, >= one chunk).
std::vector<Segment> time_segments(const std::vector<int32_t>& cu, int64_t len) {
  constexpr int64_t kChunk = 64;
  const int64_t T = cu.back(), n = static_cast<int64_t>(cu.size()) - 1;
  std::vector<Segment> segs;
  int64_t a = 0, j = 0;  // j: the first sequence that ends after a
  while (a < T) {
    while (j < n && cu[static_cast<size_t>(j + 1)] <= a) ++j;
    int64_t b = T;
    if (a + len < T) {
      const int64_t x = a + len;
      int64_t m = j;  // the sequence holding token x
      while (cu[static_cast<size_t>(m + 1)] <= x) ++m;
      const int64_t s0 = cu[static_cast<size_t>(m)];
      b = s0 + (x - s0) / kChunk * kChunk;  // > a: a is a sequence start or whole chunks into one
    }
    Segment seg;
    seg.a = a;
    seg.b = b;
    seg.cu.push_back(0);
    for (int64_t m = j; m < n && cu[static_cast<size_t>(m)] < b; ++m) {
      const int64_t s0 = cu[static_cast<size_t>(m)], s1 = cu[static_cast<size_t>(m + 1)];
      if (s1 <= s0) continue;  // empty
      if (s0 < a) seg.cont_in = true;
      if (s1 > b) seg.cont_out = true;
      seg.cu.push_back(static_cast<int32_t>(std::min(s1, b) - a));
    }
    segs.push_back(std::move(seg));
    a = b;
  }
  return segs;
}

// The segments whose calls fit `limit` (ws(plan) bytes each); one chunk per segment is the least
// a call can take.
std::vector<Segment> fitting_segments(const ref::GdnShape& s, const std::vector<int32_t>& cu,
                                      size_t whole, size_t limit,
                                      const std::function<size_t(const cuda::GdnDims&)>& ws) {
  const double per_token = static_cast<double>(whole) / static_cast<double>(std::max<int64_t>(1, s.T));
  int64_t len = std::max<int64_t>(64, static_cast<int64_t>(static_cast<double>(limit) / per_token) / 64 * 64);
  for (;;) {
    std::vector<Segment> segs = time_segments(cu, len);
    bool fits = true;
    for (const Segment& g : segs) {
      cuda::GdnDims d;
      d.T = g.b - g.a;
      d.Hk = static_cast<int>(s.Hk);
      d.Hv = static_cast<int>(s.Hv);
      d.K = static_cast<int>(s.K);
      d.V = static_cast<int>(s.V);
      (void)cuda::gdn_chunk_table(g.cu.data(), static_cast<int64_t>(g.cu.size()) - 1, d);
      if (ws(d) > limit) {
        fits = false;
        break;
      }
    }
    if (fits || len == 64) return segs;
    len = std::max<int64_t>(64, (len - std::max<int64_t>(64, len / 8)) / 64 * 64);
  }
}

// The carry of segment `seg` under plan p: its first / last sequence where they continue.
cuda::GdnCarry carry_of(const Segment& seg, const CudaPlan& p) {
  cuda::GdnCarry c;
  if (seg.cont_in) c.seq_in = cuda::gdn_table_seq(p.host, p.dims, 0);
  if (seg.cont_out) c.seq_out = cuda::gdn_table_seq(p.host, p.dims, seg.cu[seg.cu.size() - 2]);
  return c;
}
Tensor rows(const Tensor& x, const Segment& seg) { return x.narrow(seg.a, seg.b - seg.a); }
// Each segment's plan (its chunk table built and uploaded once for the call's passes).
std::vector<CudaPlan> segment_plans(const ref::GdnShape& s, const std::vector<Segment>& segs, Device dev) {
  std::vector<CudaPlan> plans;
  plans.reserve(segs.size());
  for (const Segment& seg : segs) plans.push_back(cuda_plan(s, seg.b - seg.a, seg.cu, dev));
  return plans;
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
    const std::vector<int32_t> cu = cu_seqlens.to_ints();
    const CudaPlan p = cuda_plan(s, s.T, cu, q.device());
    const DType dt = q.dtype();
    const size_t one_call = cuda::gdn_forward_workspace_bytes(p.dims, dt);
    // Kept: one call whose workspace is the prep the backward takes (only when it fits one call).
    const bool keeping = keep != nullptr && cuda::gdn_prep_bytes(p.dims, dt) <= opts.max_workspace_bytes;
    if (keeping || one_call <= opts.max_workspace_bytes) {
      Tensor ws;
      if (keeping) {
        ws = Tensor::empty({static_cast<int64_t>(std::max<size_t>(cuda::gdn_prep_bytes(p.dims, dt), 1))}, DType::u8,
                           q.device(), MemCategory::activations);
        *keep = GatedDeltaPrep{ws, p.table, cu, q.shape(), v.shape(), dt, s.scale, s.eps, s.l2norm};
      } else {
        ws = workspace(one_call, q.device());
      }
      cuda::gdn_forward(o.raw(), q.raw(), k.raw(), v.raw(), g.data<float>(), beta.data<float>(),
                        p.table.data<int32_t>(), p.dims, dt, ws.raw(), keeping);
      return o;
    }
    auto fwd_ws = [&](const cuda::GdnDims& d) { return cuda::gdn_forward_workspace_bytes(d, dt); };
    const std::vector<Segment> segs = fitting_segments(s, cu, one_call, opts.max_workspace_bytes, fwd_ws);
    const std::vector<CudaPlan> plans = segment_plans(s, segs, q.device());
    size_t need = 0;
    for (const CudaPlan& sp : plans) need = std::max(need, fwd_ws(sp.dims));
    const Tensor ws = workspace(need, q.device());
    const Tensor states = Tensor::empty({2, s.Hv * cuda::kGdnCarryFloatsPerHead}, DType::f32, q.device(),
                                        MemCategory::workspace);
    for (size_t i = 0; i < segs.size(); ++i) {
      const Segment& seg = segs[i];
      const CudaPlan& sp = plans[i];
      cuda::GdnCarry c = carry_of(seg, sp);
      c.s_in = states.data<float>() + static_cast<int64_t>((i + 1) % 2) * states.size(1);
      c.s_out = states.data<float>() + static_cast<int64_t>(i % 2) * states.size(1);
      Tensor os = rows(o, seg);
      cuda::gdn_forward(os.raw(), rows(q, seg).raw(), rows(k, seg).raw(), rows(v, seg).raw(),
                        rows(g, seg).data<float>(), rows(beta, seg).data<float>(), sp.table.data<int32_t>(),
                        sp.dims, dt, ws.raw(), false, &c);
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
    const std::vector<int32_t> cu = cu_seqlens.to_ints();
    const CudaPlan p = cuda_plan(s, s.T, cu, dev, kept.defined() ? &kept.table : nullptr);
    const DType dt = q.dtype(), do_dt = d_o.dtype();
    // A kept prep serves one call; when the rest of the workspace does not fit one, it is dropped
    // and the time segments make their own.
    if (kept.defined() &&
        cuda::gdn_backward_workspace_bytes(p.dims, dt, do_dt, /*have_prep=*/true) > opts.max_workspace_bytes)
      kept = GatedDeltaPrep{};
    const size_t one_call = cuda::gdn_backward_workspace_bytes(p.dims, dt, do_dt, kept.defined());
    if (kept.defined() || one_call <= opts.max_workspace_bytes) {
      const Tensor ws = workspace(one_call, dev);
      cuda::gdn_backward(r.d_q.data<float>(), r.d_k.data<float>(), r.d_v.data<float>(), r.d_g.data<float>(),
                         r.d_beta.data<float>(), d_o.raw(), do_dt, q.raw(), k.raw(), v.raw(), g.data<float>(),
                         beta.data<float>(), p.table.data<int32_t>(), p.dims, dt, ws.raw(),
                         kept.defined() ? kept.buffer.raw() : nullptr);
      return r;
    }
    // Segments, last to first: each needs the state its first sequence starts from (a sweep of
    // end states first, one per segment boundary) and the gradient of its last sequence's end
    // state (from the segment after it).
    auto bwd_ws = [&](const cuda::GdnDims& d) { return cuda::gdn_backward_workspace_bytes(d, dt, do_dt); };
    const std::vector<Segment> segs = fitting_segments(s, cu, one_call, opts.max_workspace_bytes, bwd_ws);
    const int64_t per = s.Hv * cuda::kGdnCarryFloatsPerHead;
    const auto nseg = static_cast<int64_t>(segs.size());
    const Tensor starts = Tensor::empty({nseg, per}, DType::f32, dev, MemCategory::workspace);
    const Tensor grads = Tensor::empty({2, per}, DType::f32, dev, MemCategory::workspace);
    float* st = starts.data<float>();
    float* gs = grads.data<float>();
    const std::vector<CudaPlan> plans = segment_plans(s, segs, dev);
    size_t need = 0;  // the sweep takes a forward's workspace, the rest a backward's
    for (const CudaPlan& sp : plans)
      need = std::max({need, bwd_ws(sp.dims), cuda::gdn_forward_workspace_bytes(sp.dims, dt)});
    const Tensor ws = workspace(need, dev);
    for (int64_t i = 0; i + 1 < nseg; ++i) {
      const Segment& seg = segs[static_cast<size_t>(i)];
      if (!seg.cont_out) continue;
      const CudaPlan& sp = plans[static_cast<size_t>(i)];
      cuda::GdnCarry c = carry_of(seg, sp);
      c.s_in = st + i * per;
      c.s_out = st + (i + 1) * per;
      cuda::gdn_end_state(rows(q, seg).raw(), rows(k, seg).raw(), rows(v, seg).raw(), rows(g, seg).data<float>(),
                          rows(beta, seg).data<float>(), sp.table.data<int32_t>(), sp.dims, dt, ws.raw(), c);
    }
    for (int64_t i = nseg - 1; i >= 0; --i) {
      const Segment& seg = segs[static_cast<size_t>(i)];
      const CudaPlan& sp = plans[static_cast<size_t>(i)];
      cuda::GdnCarry c = carry_of(seg, sp);
      c.s_in = st + i * per;
      c.ds_in = gs + ((i + 1) % 2) * per;
      c.ds_out = gs + (i % 2) * per;
      Tensor dq = rows(r.d_q, seg), dk = rows(r.d_k, seg), dv = rows(r.d_v, seg), dg = rows(r.d_g, seg),
             db = rows(r.d_beta, seg);
      cuda::gdn_backward(dq.data<float>(), dk.data<float>(), dv.data<float>(), dg.data<float>(), db.data<float>(),
                         rows(d_o, seg).raw(), do_dt, rows(q, seg).raw(), rows(k, seg).raw(), rows(v, seg).raw(),
                         rows(g, seg).data<float>(), rows(beta, seg).data<float>(), sp.table.data<int32_t>(), sp.dims,
                         dt, ws.raw(), nullptr, &c);
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
