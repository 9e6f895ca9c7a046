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

// One sequence of the batch as calls of its own (time segments when one call's workspace would
// exceed the limit), its carried states in the kernels' padded layout ([Hv][128][128]). The
// tensors are the sequence's rows (views); v may be a zero stand-in of another width (the
// transition: s.V = K).
struct SeqRun {
  Tensor q, k, v, g, beta;
  ref::GdnShape s;
  DType dt = DType::f32;
  size_t limit = 0;
};

// The sequence's time segments (one unless its call's workspace `ws` exceeds the limit), their
// plans, and a workspace for the largest (at least `also` of a plan's dims bytes too).
struct SeqCalls {
  std::vector<Segment> segs;
  std::vector<CudaPlan> plans;
  Tensor ws;
};
SeqCalls seq_calls(const SeqRun& r, const std::function<size_t(const cuda::GdnDims&)>& ws,
                   const std::function<size_t(const cuda::GdnDims&)>& also = nullptr) {
  const std::vector<int32_t> cu = {0, static_cast<int32_t>(r.s.T)};
  cuda::GdnDims d;
  d.T = r.s.T;
  d.Hk = static_cast<int>(r.s.Hk);
  d.Hv = static_cast<int>(r.s.Hv);
  d.K = static_cast<int>(r.s.K);
  d.V = static_cast<int>(r.s.V);
  (void)cuda::gdn_chunk_table(cu.data(), 1, d);
  const size_t one = ws(d);
  SeqCalls c;
  c.segs = one <= r.limit ? time_segments(cu, r.s.T) : fitting_segments(r.s, cu, one, r.limit, ws);
  c.plans = segment_plans(r.s, c.segs, r.q.device());
  size_t need = 0;
  for (const CudaPlan& sp : c.plans) need = std::max({need, ws(sp.dims), also ? also(sp.dims) : size_t{0}});
  c.ws = workspace(need, r.q.device());
  return c;
}

// The forward of one sequence from s0 (null: zero): outputs into *o (null: none), the end state
// into s_end (null: not wanted).
void seq_forward(const SeqRun& r, Tensor* o, const float* s0, float* s_end) {
  const Device dev = r.q.device();
  const SeqCalls calls = seq_calls(r, [&](const cuda::GdnDims& d) { return cuda::gdn_forward_workspace_bytes(d, r.dt); });
  const std::vector<Segment>& segs = calls.segs;
  const std::vector<CudaPlan>& plans = calls.plans;
  const Tensor& ws = calls.ws;
  const int64_t per = r.s.Hv * cuda::kGdnCarryFloatsPerHead;
  const Tensor pp = segs.size() > 1 ? Tensor::empty({2, per}, DType::f32, dev, MemCategory::workspace) : Tensor();
  for (size_t i = 0; i < segs.size(); ++i) {
    const Segment& seg = segs[i];
    const CudaPlan& sp = plans[i];
    const bool last = i + 1 == segs.size();
    cuda::GdnCarry c = carry_of(seg, sp);
    const int only = cuda::gdn_table_seq(sp.host, sp.dims, 0);
    if (i == 0 && s0 != nullptr) {
      c.seq_in = only;
      c.s_in = s0;
    } else if (i > 0) {
      c.s_in = pp.data<float>() + static_cast<int64_t>((i + 1) % 2) * per;
    }
    if (last && s_end != nullptr) {
      c.seq_out = only;
      c.s_out = s_end;
    } else if (!last) {
      c.s_out = pp.data<float>() + static_cast<int64_t>(i % 2) * per;
    }
    if (o != nullptr) {
      Tensor os = rows(*o, seg);
      cuda::gdn_forward(os.raw(), rows(r.q, seg).raw(), rows(r.k, seg).raw(), rows(r.v, seg).raw(),
                        rows(r.g, seg).data<float>(), rows(r.beta, seg).data<float>(), sp.table.data<int32_t>(),
                        sp.dims, r.dt, ws.raw(), false, &c);
    } else if (c.seq_out >= 0) {
      cuda::gdn_end_state(rows(r.q, seg).raw(), rows(r.k, seg).raw(), rows(r.v, seg).raw(),
                          rows(r.g, seg).data<float>(), rows(r.beta, seg).data<float>(), sp.table.data<int32_t>(),
                          sp.dims, r.dt, ws.raw(), c);
    }
  }
}

// The backward of one sequence: its gradients into `out` (the sequence's rows), from s0 (null:
// zero) and the end state's gradient ds_end (null: zero).
void seq_backward(const SeqRun& r, GatedDeltaGrads& out, const Tensor& d_o, const float* s0, const float* ds_end) {
  const Device dev = r.q.device();
  const DType do_dt = d_o.dtype();
  // The sweep of the segments' start states takes a forward's workspace, the rest a backward's.
  const SeqCalls calls =
      seq_calls(r, [&](const cuda::GdnDims& d) { return cuda::gdn_backward_workspace_bytes(d, r.dt, do_dt); },
                [&](const cuda::GdnDims& d) { return cuda::gdn_forward_workspace_bytes(d, r.dt); });
  const std::vector<Segment>& segs = calls.segs;
  const std::vector<CudaPlan>& plans = calls.plans;
  const Tensor& ws = calls.ws;
  const int64_t per = r.s.Hv * cuda::kGdnCarryFloatsPerHead;
  const auto nseg = static_cast<int64_t>(segs.size());
  const Tensor starts = nseg > 1 ? Tensor::empty({nseg, per}, DType::f32, dev, MemCategory::workspace) : Tensor();
  const Tensor grads = nseg > 1 ? Tensor::empty({2, per}, DType::f32, dev, MemCategory::workspace) : Tensor();
  auto start_of = [&](int64_t i) { return i == 0 ? s0 : starts.data<float>() + i * per; };
  for (int64_t i = 0; i + 1 < nseg; ++i) {  // the segments' start states
    const Segment& seg = segs[static_cast<size_t>(i)];
    const CudaPlan& sp = plans[static_cast<size_t>(i)];
    cuda::GdnCarry c = carry_of(seg, sp);
    if (i == 0 && s0 != nullptr) c.seq_in = cuda::gdn_table_seq(sp.host, sp.dims, 0);
    c.s_in = start_of(i);
    c.s_out = starts.data<float>() + (i + 1) * per;
    cuda::gdn_end_state(rows(r.q, seg).raw(), rows(r.k, seg).raw(), rows(r.v, seg).raw(), rows(r.g, seg).data<float>(),
                        rows(r.beta, seg).data<float>(), sp.table.data<int32_t>(), sp.dims, r.dt, ws.raw(), c);
  }
  for (int64_t i = nseg - 1; i >= 0; --i) {
    const Segment& seg = segs[static_cast<size_t>(i)];
    const CudaPlan& sp = plans[static_cast<size_t>(i)];
    const int only = cuda::gdn_table_seq(sp.host, sp.dims, 0);
    cuda::GdnCarry c = carry_of(seg, sp);
    if (i == 0 && s0 != nullptr) c.seq_in = only;
    c.s_in = start_of(i);
    if (i == nseg - 1) {
      if (ds_end != nullptr) {
        c.seq_out = only;
        c.ds_in = ds_end;
      }
    } else {
      c.ds_in = grads.data<float>() + ((i + 1) % 2) * per;
    }
    if (i > 0) c.ds_out = grads.data<float>() + (i % 2) * per;
    Tensor dq = rows(out.d_q, seg), dk = rows(out.d_k, seg), dv = rows(out.d_v, seg), dg = rows(out.d_g, seg),
           db = rows(out.d_beta, seg);
    cuda::gdn_backward(dq.data<float>(), dk.data<float>(), dv.data<float>(), dg.data<float>(), db.data<float>(),
                       rows(d_o, seg).raw(), do_dt, rows(r.q, seg).raw(), rows(r.k, seg).raw(), rows(r.v, seg).raw(),
                       rows(r.g, seg).data<float>(), rows(r.beta, seg).data<float>(), sp.table.data<int32_t>(), sp.dims,
                       r.dt, ws.raw(), nullptr, &c);
  }
}

// The start-state gradient of one sequence from its outputs' gradient alone (into ds0): the
// backward's reverse state pass over its segments, last to first, carrying the gradient.
void seq_start_grad(const SeqRun& r, const Tensor& d_o, float* ds0) {
  const Device dev = r.q.device();
  const DType do_dt = d_o.dtype();
  const SeqCalls calls =
      seq_calls(r, [&](const cuda::GdnDims& d) { return cuda::gdn_backward_workspace_bytes(d, r.dt, do_dt); });
  const std::vector<Segment>& segs = calls.segs;
  const std::vector<CudaPlan>& plans = calls.plans;
  const Tensor& ws = calls.ws;
  const int64_t per = r.s.Hv * cuda::kGdnCarryFloatsPerHead;
  const auto nseg = static_cast<int64_t>(segs.size());
  const Tensor grads = nseg > 1 ? Tensor::empty({2, per}, DType::f32, dev, MemCategory::workspace) : Tensor();
  for (int64_t i = nseg - 1; i >= 0; --i) {
    const Segment& seg = segs[static_cast<size_t>(i)];
    const CudaPlan& sp = plans[static_cast<size_t>(i)];
    cuda::GdnCarry c = carry_of(seg, sp);
    if (i == 0) c.seq_in = cuda::gdn_table_seq(sp.host, sp.dims, 0);
    if (i < nseg - 1) c.ds_in = grads.data<float>() + ((i + 1) % 2) * per;
    c.ds_out = i == 0 ? ds0 : grads.data<float>() + (i % 2) * per;
    cuda::gdn_start_grad(rows(d_o, seg).raw(), do_dt, rows(r.q, seg).raw(), rows(r.k, seg).raw(), rows(r.v, seg).raw(),
                         rows(r.g, seg).data<float>(), rows(r.beta, seg).data<float>(), sp.table.data<int32_t>(),
                         sp.dims, r.dt, ws.raw(), c);
  }
}

// Sequence n's run: the rows [cu[n], cu[n + 1]) of the inputs.
SeqRun seq_run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
               const std::vector<int32_t>& cu, int64_t n, const ref::GdnShape& s, size_t limit) {
  const int64_t a = cu[static_cast<size_t>(n)], len = cu[static_cast<size_t>(n + 1)] - a;
  SeqRun r{q.narrow(a, len), k.narrow(a, len), v.narrow(a, len), g.narrow(a, len), beta.narrow(a, len), s,
           q.dtype(), limit};
  r.s.T = len;
  return r;
}
#endif

// Checks a states argument: f32 [n, Hv, K, cols] on the inputs' device.
void check_states(const Tensor& st, const char* op, const char* name, int64_t n, const ref::GdnShape& s, int64_t cols,
                  Device dev) {
  check_defined(st, op, name);
  check_dtype(st, DType::f32, op, name);
  check_shape(st, {n, s.Hv, s.K, cols}, op, name);
  BB_CHECK(st.device() == dev, op, ": ", name, " is on ", st.device().str(), " but the inputs are on ", dev.str());
}

}  // namespace

Tensor gated_delta_rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, const Tensor& cu_seqlens,
                                const GatedDeltaOptions& opts, MemCategory out_cat,
                                GatedDeltaPrep* keep, const Tensor* initial_state) {
  BB_RANGE("gated_delta_rule_forward");
  const char* op = "gated_delta_rule_forward";
  const ref::GdnShape s = check(op, q, k, v, g, beta, cu_seqlens, opts);
  const int64_t nseq = cu_seqlens.numel() - 1;
  if (initial_state != nullptr) check_states(*initial_state, op, "initial_state", nseq, s, s.V, q.device());
  Tensor o = Tensor::empty(v.shape(), v.dtype(), v.device(), out_cat);
  if (keep != nullptr) *keep = GatedDeltaPrep{};
#ifdef BB_WITH_CUDA
  if (q.device().is_cuda()) {
    if (s.T == 0) return o;
    const std::vector<int32_t> cu = cu_seqlens.to_ints();
    if (initial_state != nullptr) {  // one sequence a call, each from its own start state
      const Tensor pad = Tensor::empty({s.Hv * cuda::kGdnCarryFloatsPerHead}, DType::f32, q.device(),
                                       MemCategory::workspace);
      const int64_t KV = s.Hv * s.K * s.V;
      for (int64_t n = 0; n < nseq; ++n) {
        if (cu[static_cast<size_t>(n + 1)] == cu[static_cast<size_t>(n)]) continue;
        const SeqRun r = seq_run(q, k, v, g, beta, cu, n, s, opts.max_workspace_bytes);
        cuda::gdn_pad_state(pad.data<float>(), initial_state->data<float>() + n * KV, static_cast<int>(s.Hv),
                            static_cast<int>(s.K), static_cast<int>(s.V));
        Tensor on = o.narrow(cu[static_cast<size_t>(n)], r.s.T);
        seq_forward(r, &on, pad.data<float>(), nullptr);
      }
      return o;
    }
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
                                  cu_seqlens.data<int32_t>(), nseq, s,
                                  initial_state != nullptr ? initial_state->data<float>() : nullptr);
  return o;
}

GatedDeltaGrads gated_delta_rule_backward(const Tensor& d_o, const Tensor& q, const Tensor& k,
                                          const Tensor& v, const Tensor& g, const Tensor& beta,
                                          const Tensor& cu_seqlens, const GatedDeltaOptions& opts,
                                          GatedDeltaPrep* prep, const Tensor* initial_state,
                                          const Tensor* d_final_state) {
  BB_RANGE("gated_delta_rule_backward");
  const char* op = "gated_delta_rule_backward";
  const ref::GdnShape s = check(op, q, k, v, g, beta, cu_seqlens, opts);
  const int64_t nseq = cu_seqlens.numel() - 1;
  if (initial_state != nullptr) check_states(*initial_state, op, "initial_state", nseq, s, s.V, q.device());
  if (d_final_state != nullptr) check_states(*d_final_state, op, "d_final_state", nseq, s, s.V, q.device());
  const bool carried = initial_state != nullptr || d_final_state != nullptr;
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
    if (carried) {  // one sequence a call, each with its own start state and end-state gradient
      const int64_t per = s.Hv * cuda::kGdnCarryFloatsPerHead, KV = s.Hv * s.K * s.V;
      const Tensor pad = Tensor::empty({2, per}, DType::f32, dev, MemCategory::workspace);
      float* s0 = pad.data<float>();
      float* dse = pad.data<float>() + per;
      for (int64_t n = 0; n < nseq; ++n) {
        const int64_t a = cu[static_cast<size_t>(n)], len = cu[static_cast<size_t>(n + 1)] - a;
        if (len == 0) continue;
        const SeqRun sr = seq_run(q, k, v, g, beta, cu, n, s, opts.max_workspace_bytes);
        if (initial_state != nullptr)
          cuda::gdn_pad_state(s0, initial_state->data<float>() + n * KV, static_cast<int>(s.Hv), static_cast<int>(s.K),
                              static_cast<int>(s.V));
        if (d_final_state != nullptr)
          cuda::gdn_pad_state(dse, d_final_state->data<float>() + n * KV, static_cast<int>(s.Hv),
                              static_cast<int>(s.K), static_cast<int>(s.V));
        GatedDeltaGrads part{r.d_q.narrow(a, len), r.d_k.narrow(a, len), r.d_v.narrow(a, len), r.d_g.narrow(a, len),
                             r.d_beta.narrow(a, len)};
        seq_backward(sr, part, d_o.narrow(a, len), initial_state != nullptr ? s0 : nullptr,
                     d_final_state != nullptr ? dse : nullptr);
      }
      return r;
    }
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
      g.data<float>(), beta.data<float>(), cu_seqlens.data<int32_t>(), nseq, s,
      initial_state != nullptr ? initial_state->data<float>() : nullptr,
      d_final_state != nullptr ? d_final_state->data<float>() : nullptr);
  return r;
}

GatedDeltaSummary gated_delta_rule_summary(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                           const Tensor& beta, const Tensor& cu_seqlens,
                                           const GatedDeltaOptions& opts, MemCategory cat) {
  BB_RANGE("gated_delta_rule_summary");
  const ref::GdnShape s = check("gated_delta_rule_summary", q, k, v, g, beta, cu_seqlens, opts);
  const int64_t nseq = cu_seqlens.numel() - 1;
  const Device dev = q.device();
  GatedDeltaSummary out{Tensor::empty({nseq, s.Hv, s.K, s.K}, DType::f32, dev, cat),
                        Tensor::zeros({nseq, s.Hv, s.K, s.V}, DType::f32, dev, cat)};
#ifdef BB_WITH_CUDA
  if (dev.is_cuda()) {
    const std::vector<int32_t> cu = cu_seqlens.to_ints();
    const int64_t per = s.Hv * cuda::kGdnCarryFloatsPerHead;
    const Tensor pad = Tensor::empty({2, per}, DType::f32, dev, MemCategory::workspace);
    float* eye = pad.data<float>();
    float* end = pad.data<float>() + per;
    const int Hv = static_cast<int>(s.Hv), K = static_cast<int>(s.K), V = static_cast<int>(s.V);
    for (int64_t n = 0; n < nseq; ++n) {
      float* P = out.transition.data<float>() + n * s.Hv * s.K * s.K;
      cuda::gdn_pad_state(eye, nullptr, Hv, K, K, /*identity=*/true);
      const int64_t len = cu[static_cast<size_t>(n + 1)] - cu[static_cast<size_t>(n)];
      if (len == 0) {  // the identity; the end state stays zero
        cuda::gdn_unpad_state(P, eye, Hv, K, K);
        continue;
      }
      SeqRun r = seq_run(q, k, v, g, beta, cu, n, s, opts.max_workspace_bytes);
      seq_forward(r, nullptr, nullptr, end);
      cuda::gdn_unpad_state(out.end_state.data<float>() + n * s.Hv * s.K * s.V, end, Hv, K, V);
      // The transition is the end state of a run from the identity with zero values (K columns).
      r.v = Tensor::zeros({len, s.Hv, s.K}, q.dtype(), dev, MemCategory::workspace);
      r.s.V = s.K;
      seq_forward(r, nullptr, eye, end);
      cuda::gdn_unpad_state(P, end, Hv, K, K);
    }
    return out;
  }
#endif
  ref::gated_delta_transition<float>(out.transition.data<float>(), k.data<float>(), g.data<float>(),
                                     beta.data<float>(), cu_seqlens.data<int32_t>(), nseq, s);
  ref::gated_delta_forward<float>(nullptr, q.data<float>(), k.data<float>(), v.data<float>(), g.data<float>(),
                                  beta.data<float>(), cu_seqlens.data<int32_t>(), nseq, s, nullptr,
                                  out.end_state.data<float>());
  return out;
}

Tensor gated_delta_rule_start_grad(const Tensor& d_o, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                   const GatedDeltaOptions& opts, MemCategory cat) {
  BB_RANGE("gated_delta_rule_start_grad");
  const char* op = "gated_delta_rule_start_grad";
  const ref::GdnShape s = check(op, q, k, v, g, beta, cu_seqlens, opts);
  check_defined(d_o, op, "d_o");
  check_shape(d_o, v.shape(), op, "d_o");
  const Device dev = q.device();
  BB_CHECK(d_o.device() == dev, op, ": d_o is on ", d_o.device().str(), " but the inputs are on ", dev.str());
  const int64_t nseq = cu_seqlens.numel() - 1;
  Tensor out = Tensor::zeros({nseq, s.Hv, s.K, s.V}, DType::f32, dev, cat);
#ifdef BB_WITH_CUDA
  if (dev.is_cuda()) {
    BB_CHECK(d_o.dtype() == DType::f32 || d_o.dtype() == v.dtype(), op, ": d_o must be f32 or v's dtype (",
             dtype_name(v.dtype()), "), got ", d_o.str());
    const std::vector<int32_t> cu = cu_seqlens.to_ints();
    const Tensor pad = Tensor::empty({s.Hv * cuda::kGdnCarryFloatsPerHead}, DType::f32, dev, MemCategory::workspace);
    for (int64_t n = 0; n < nseq; ++n) {
      const int64_t a = cu[static_cast<size_t>(n)], len = cu[static_cast<size_t>(n + 1)] - a;
      if (len == 0) continue;
      const SeqRun r = seq_run(q, k, v, g, beta, cu, n, s, opts.max_workspace_bytes);
      seq_start_grad(r, d_o.narrow(a, len), pad.data<float>());
      cuda::gdn_unpad_state(out.data<float>() + n * s.Hv * s.K * s.V, pad.data<float>(), static_cast<int>(s.Hv),
                            static_cast<int>(s.K), static_cast<int>(s.V));
    }
    return out;
  }
#endif
  check_dtype(d_o, DType::f32, op, "d_o");
  ref::gated_delta_start_grad<float>(out.data<float>(), d_o.data<float>(), q.data<float>(), k.data<float>(),
                                     g.data<float>(), beta.data<float>(), cu_seqlens.data<int32_t>(), nseq, s);
  return out;
}

}  // namespace bb
