// experts.cpp — boundary checks for the expert MLPs, then the CPU reference in fp32 or the CUDA
// path: cuBLASLt GEMMs per expert (sequential) or one grouped GEMM per projection (grouped),
// SwiGLU through its Tensor API, the row_prob scaling in experts_cuda.cu.
// Accumulation convention: backward_data WRITES d_x, d_row_prob, d_gate_up (=);
// backward_weight ACCUMULATES into d_w_gate_up and d_w_down (+=).
#include "primitives/moe/experts.h"

#include "core/trace.h"

#include "backend/cpu/util.h"
#include "primitives/moe/experts_ref.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/gemm.h"
#include "primitives/activation/swiglu.h"
#include "primitives/moe/experts_cuda.h"
#endif

namespace bb {

namespace {

struct Dims {
  int64_t N = 0, H = 0, F = 0, E = 0;
};

// Every tensor of a call lives on the device of its rows argument (x_perm or d_y).
void check_dev(const Tensor& t, Device dev, const char* op, const char* arg) {
  check_defined(t, op, arg);
  BB_CHECK(t.device() == dev, op, ": argument '", arg, "' is on ", t.device().str(),
           " but the rows are on ", dev.str());
#ifndef BB_WITH_CUDA
  BB_CHECK(dev.is_cpu(), op, ": not implemented on ", dev.str(),
           " yet (this build has no CUDA backend; argument '", arg, "')");
#endif
}

void check_float_on(const Tensor& t, Device dev, const char* op, const char* arg) {
  check_float(t, op, arg);
  check_dev(t, dev, op, arg);
}

// Reads E, F, H from the weights and N from x-like [N, H]; checks shapes, devices and counts.
Dims check_all(const char* op, const Tensor& rows, const char* rows_arg,
               const std::vector<int64_t>& counts, const Tensor& w_gate_up, const Tensor& w_down,
               const Tensor& row_prob) {
  check_defined(rows, op, rows_arg);
  const Device dev = rows.device();
  check_float_on(w_gate_up, dev, op, "w_gate_up");
  BB_CHECK(w_gate_up.dim() == 3 && w_gate_up.size(0) >= 1 && w_gate_up.size(1) % 2 == 0, op,
           ": argument 'w_gate_up' has shape ", shape_str(w_gate_up.shape()),
           ", expected [E, 2F, H] with E >= 1");
  Dims d;
  d.E = w_gate_up.size(0);
  d.F = w_gate_up.size(1) / 2;
  d.H = w_gate_up.size(2);
  check_float_on(w_down, dev, op, "w_down");
  check_shape(w_down, {d.E, d.H, d.F}, op, "w_down");
  check_float_on(rows, dev, op, rows_arg);
  BB_CHECK(rows.dim() == 2, op, ": argument '", rows_arg, "' has shape ", shape_str(rows.shape()),
           ", expected [N, H = ", d.H, "]");
  check_shape(rows, {-1, d.H}, op, rows_arg);
  d.N = rows.size(0);
  BB_CHECK(static_cast<int64_t>(counts.size()) == d.E, op, ": tokens_per_expert has ",
           counts.size(), " entries, expected E = ", d.E, " (from w_gate_up)");
  int64_t sum = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    BB_CHECK(counts[e] >= 0, op, ": tokens_per_expert[", e, "] = ", counts[e], " is negative");
    sum += counts[e];
  }
  BB_CHECK(sum == d.N, op, ": tokens_per_expert sums to ", sum, " but ", rows_arg, " has N = ", d.N,
           " rows");
  if (row_prob.defined()) {
    check_dtype(row_prob, DType::f32, op, "row_prob");
    check_dev(row_prob, dev, op, "row_prob");
    check_shape(row_prob, {d.N}, op, "row_prob");
  }
  return d;
}

// An f32 buffer for a result that ends up in dtype `dt` under `cat`: the result itself when
// dt is f32, a workspace temporary otherwise.
Tensor f32_for(const Shape& shape, DType dt, MemCategory cat) {
  return cpu::empty_f32(shape, dt == DType::f32 ? cat : MemCategory::workspace);
}

Tensor finish(const Tensor& tmp, DType dt, MemCategory cat) {
  if (dt == DType::f32) return tmp;
  Tensor out = Tensor::empty(tmp.shape(), dt, Device::cpu(), cat);
  cpu::store_f32(out, tmp);
  return out;
}

const float* prob_ptr(const Tensor& row_prob) {
  return row_prob.defined() ? row_prob.data<float>() : nullptr;
}

#ifdef BB_WITH_CUDA
// ---- CUDA path -------------------------------------------------------------------------------
// Legend as in experts.h. The GEMMs run in one dtype (`cdt`): the forward in x_perm's, the
// backward data in saved.gate_up's; other inputs are converted onto workspace copies first
// (weights of another dtype are rounded to cdt). bf16 data: bf16 GEMM outputs with fp32
// accumulation; weight gradients accumulate in their own dtype (f32 normally) with fp32 math.

// t itself when it already has dtype dt, else a converted copy under workspace.
Tensor in_dtype(const Tensor& t, DType dt) {
  return t.dtype() == dt ? t : t.to_dtype(dt, MemCategory::workspace);
}

const char* ptr_at(const Tensor& t, int64_t elems) {
  return static_cast<const char*>(t.raw()) + elems * static_cast<int64_t>(dtype_size(t.dtype()));
}

// out[rows of e] = rows[rows of e] @ op(W[e]) for every expert with rows.
// rows [N, Kd], out [N, Out], W [E, Out, Kd] (trans_w) or [E, Kd, Out]; one dtype.
// sequential: one cuBLASLt GEMM per non-empty expert; grouped: one grouped GEMM for all.
void project(ExpertsImpl impl, const Tensor& rows, const std::vector<int64_t>& counts,
             const Tensor& W, bool trans_w, Tensor& out) {
  const int64_t Kd = rows.size(1), Out = out.size(1), ld_w = trans_w ? Kd : Out;
  const DType dt = rows.dtype();
  const int dev = rows.device().index;
  std::vector<cuda::GemmProblem> problems;
  int64_t off = 0;
  for (size_t e = 0; e < counts.size(); off += counts[e], ++e) {
    const int64_t c = counts[e];
    if (c == 0) continue;
    cuda::GemmProblem p;
    p.M = c;
    p.N = Out;
    p.K = Kd;
    p.A = ptr_at(rows, off * Kd);
    p.B = ptr_at(W, static_cast<int64_t>(e) * Out * Kd);
    p.C = const_cast<char*>(ptr_at(out, off * Out));
    if (impl == ExpertsImpl::sequential)
      cuda::gemm(false, trans_w, p.M, p.N, p.K, 1.0f, p.A, dt, Kd, p.B, dt, ld_w, 0.0f, p.C, dt,
                 Out, dev);
    else
      problems.push_back(p);
  }
  if (impl == ExpertsImpl::grouped)
    cuda::gemm_grouped(false, trans_w, problems, 1.0f, dt, Kd, ld_w, 0.0f, dt, Out, dev);
}

// dW[e] += A[rows of e]^T B[rows of e] for every expert with rows (accumulate), or
// dW[e] = A[rows of e]^T B[rows of e] for every expert, zero without rows (!accumulate).
// A [N, M], B [N, Nc] (one dtype), dW [E, M, Nc] (any float dtype).
void weight_grad(ExpertsImpl impl, const Tensor& A, const Tensor& B,
                 const std::vector<int64_t>& counts, Tensor& dW, bool accumulate) {
  const int64_t M = A.size(1), Nc = B.size(1);
  const DType ab = A.dtype(), gdt = dW.dtype();
  const int dev = A.device().index;
  const float beta = accumulate ? 1.0f : 0.0f;
  // The grouped path takes C = f32 or C = the input dtype; other gradients go through f32.
  const bool direct = impl == ExpertsImpl::sequential || gdt == DType::f32 || gdt == ab;
  Tensor g = direct ? dW : (accumulate ? dW.to_dtype(DType::f32, MemCategory::workspace)
                                       : Tensor::empty(dW.shape(), DType::f32, dW.device(), MemCategory::workspace));
  std::vector<cuda::GemmProblem> problems;
  int64_t off = 0;
  for (size_t e = 0; e < counts.size(); off += counts[e], ++e) {
    const int64_t c = counts[e];
    if (c == 0 && accumulate) continue;  // nothing to add (written: a K = 0 problem gives C = 0)
    cuda::GemmProblem p;
    p.M = M;
    p.N = Nc;
    p.K = c;
    p.A = ptr_at(A, off * M);
    p.B = ptr_at(B, off * Nc);
    p.C = const_cast<char*>(ptr_at(g, static_cast<int64_t>(e) * M * Nc));
    if (impl == ExpertsImpl::sequential)
      cuda::gemm(true, false, M, Nc, c, 1.0f, p.A, ab, M, p.B, ab, Nc, beta, p.C, g.dtype(), Nc,
                 dev);
    else
      problems.push_back(p);
  }
  if (impl == ExpertsImpl::grouped)
    cuda::gemm_grouped(true, false, problems, 1.0f, ab, M, Nc, beta, g.dtype(), Nc, dev);
  if (!direct) dW.copy_from(g.to_dtype(gdt, MemCategory::workspace));
}

// with_output = false: gate_up and act only (experts_forward_saved); returns undefined.
Tensor forward_cuda(ExpertsImpl impl, const Tensor& x, const std::vector<int64_t>& counts,
                    const Tensor& w_gate_up, const Tensor& w_down, const Tensor& row_prob,
                    ExpertsSaved* saved, const Dims& d, bool with_output = true) {
  const DType dt = x.dtype();
  const Device dev = x.device();
  const MemCategory saved_cat = saved ? MemCategory::activations : MemCategory::workspace;
  Tensor gate_up = Tensor::empty({d.N, 2 * d.F}, dt, dev, saved_cat);
  Tensor y = with_output ? Tensor::empty({d.N, d.H}, dt, dev, MemCategory::moe) : Tensor();
  Tensor act;
  if (d.N > 0) {
    project(impl, x, counts, in_dtype(w_gate_up, dt), true, gate_up);  // x W_gu[e]^T
    act = swiglu_forward(gate_up, saved_cat);
  } else {
    act = Tensor::empty({0, d.F}, dt, dev, saved_cat);
  }
  if (d.N > 0 && with_output) {
    Tensor a = act;
    if (row_prob.defined()) {
      a = Tensor::empty({d.N, d.F}, dt, dev, MemCategory::workspace);
      cuda::experts_scale_rows(a.raw(), act.raw(), dt, row_prob.data<float>(), d.N, d.F,
                               dev.index);
    }
    project(impl, a, counts, in_dtype(w_down, dt), true, y);  // a W_down[e]^T
  }
  if (saved) {
    saved->gate_up = gate_up;
    saved->act = act;
  }
  return y;
}

ExpertsDgrad backward_data_cuda(ExpertsImpl impl, const Tensor& d_y,
                                const std::vector<int64_t>& counts, const Tensor& w_gate_up,
                                const Tensor& w_down, const Tensor& row_prob,
                                const ExpertsSaved& saved, const Dims& d) {
  const DType cdt = saved.gate_up.dtype();
  const Device dev = d_y.device();
  ExpertsDgrad g;
  if (row_prob.defined())
    g.d_row_prob = Tensor::empty({d.N}, DType::f32, dev, MemCategory::activations);
  Tensor d_x = Tensor::empty({d.N, d.H}, cdt, dev, MemCategory::moe);
  Tensor d_gu;
  if (d.N > 0) {
    Tensor d_a = Tensor::empty({d.N, d.F}, cdt, dev, MemCategory::workspace);
    project(impl, in_dtype(d_y, cdt), counts, in_dtype(w_down, cdt), false, d_a);  // d_y W_down[e]
    if (row_prob.defined()) {
      Tensor act = in_dtype(saved.act, cdt);
      cuda::experts_prob_backward(g.d_row_prob.data<float>(), d_a.raw(), act.raw(), cdt,
                                  row_prob.data<float>(), d.N, d.F, dev.index);
    }
    d_gu = swiglu_backward(d_a, saved.gate_up);
    project(impl, d_gu, counts, in_dtype(w_gate_up, cdt), false, d_x);  // d_gate_up W_gu[e]
  } else {
    d_gu = Tensor::empty({0, 2 * d.F}, cdt, dev, MemCategory::activations);
  }
  const DType out_dt = d_y.dtype();
  g.d_x = out_dt == cdt ? d_x : d_x.to_dtype(out_dt, MemCategory::moe);
  g.d_gate_up = out_dt == cdt ? d_gu : d_gu.to_dtype(out_dt, MemCategory::activations);
  return g;
}

void backward_weight_cuda(ExpertsImpl impl, const Tensor& d_y, const Tensor& x_perm,
                          const std::vector<int64_t>& counts, const Tensor& row_prob,
                          const Tensor& act_saved, const Tensor& d_gate_up, Tensor& d_w_gate_up,
                          Tensor& d_w_down, const Dims& d, bool accumulate) {
  if (d.N == 0) {
    if (!accumulate) {
      d_w_gate_up.zero_();
      d_w_down.zero_();
    }
    return;
  }
  // One input dtype for the GEMMs: the common one, or f32 when they differ (exact widening).
  DType ab = d_y.dtype();
  for (const Tensor* t : {&x_perm, &act_saved, &d_gate_up})
    if (t->dtype() != ab) ab = DType::f32;
  Tensor act = in_dtype(act_saved, ab);
  Tensor a = act;
  if (row_prob.defined()) {
    a = Tensor::empty({d.N, d.F}, ab, d_y.device(), MemCategory::workspace);
    cuda::experts_scale_rows(a.raw(), act.raw(), ab, row_prob.data<float>(), d.N, d.F,
                             d_y.device().index);
  }
  weight_grad(impl, in_dtype(d_y, ab), a, counts, d_w_down, accumulate);  // d_y^T (p act)
  weight_grad(impl, in_dtype(d_gate_up, ab), in_dtype(x_perm, ab), counts, d_w_gate_up,
              accumulate);  // d_gate_up^T x
}
#endif  // BB_WITH_CUDA

}  // namespace

namespace {

// experts_forward and (with_output = false: no down projection, returns undefined)
// experts_forward_saved: one code path, so the saved tensors are the same bits.
Tensor forward_impl(const char* op, ExpertsImpl impl, const Tensor& x_perm,
                    const std::vector<int64_t>& tokens_per_expert, const Tensor& w_gate_up,
                    const Tensor& w_down, const Tensor& row_prob, ExpertsSaved* saved,
                    bool with_output) {
  const Dims d = check_all(op, x_perm, "x_perm", tokens_per_expert, w_gate_up, w_down, row_prob);
#ifdef BB_WITH_CUDA
  if (x_perm.device().is_cuda())
    return forward_cuda(impl, x_perm, tokens_per_expert, w_gate_up, w_down, row_prob, saved, d,
                        with_output);
#endif
  const DType dt = x_perm.dtype();
  const MemCategory saved_cat = saved ? MemCategory::activations : MemCategory::workspace;
  Tensor x = cpu::as_f32(x_perm), wgu = cpu::as_f32(w_gate_up);
  Tensor wd = with_output ? cpu::as_f32(w_down) : Tensor();
  Tensor gate_up = f32_for({d.N, 2 * d.F}, dt, saved_cat);
  Tensor act = f32_for({d.N, d.F}, dt, saved_cat);
  Tensor y = with_output ? f32_for({d.N, d.H}, dt, MemCategory::moe) : Tensor();
  auto fn = impl == ExpertsImpl::sequential ? ref::experts_forward_sequential<float>
                                            : ref::experts_forward_grouped<float>;
  fn(with_output ? y.data<float>() : nullptr, gate_up.data<float>(), act.data<float>(),
     x.data<float>(), tokens_per_expert.data(), d.E, wgu.data<float>(),
     with_output ? wd.data<float>() : nullptr, prob_ptr(row_prob), d.H, d.F);
  if (saved) {
    saved->gate_up = finish(gate_up, dt, saved_cat);
    saved->act = finish(act, dt, saved_cat);
  }
  return with_output ? finish(y, dt, MemCategory::moe) : Tensor();
}

}  // namespace

Tensor experts_forward(ExpertsImpl impl, const Tensor& x_perm,
                       const std::vector<int64_t>& tokens_per_expert, const Tensor& w_gate_up,
                       const Tensor& w_down, const Tensor& row_prob, ExpertsSaved* saved) {
  BB_RANGE("experts_forward");
  return forward_impl("experts_forward", impl, x_perm, tokens_per_expert, w_gate_up, w_down,
                      row_prob, saved, /*with_output=*/true);
}

void experts_forward_saved(ExpertsImpl impl, const Tensor& x_perm,
                           const std::vector<int64_t>& tokens_per_expert, const Tensor& w_gate_up,
                           const Tensor& w_down, const Tensor& row_prob, ExpertsSaved& saved) {
  BB_RANGE("experts_forward_saved");
  forward_impl("experts_forward_saved", impl, x_perm, tokens_per_expert, w_gate_up, w_down,
               row_prob, &saved, /*with_output=*/false);
}

ExpertsDgrad experts_backward_data(ExpertsImpl impl, const Tensor& d_y,
                                   const std::vector<int64_t>& tokens_per_expert,
                                   const Tensor& w_gate_up, const Tensor& w_down,
                                   const Tensor& row_prob, const ExpertsSaved& saved) {
  BB_RANGE("experts_backward_data");
  const char* op = "experts_backward_data";
  const Dims d = check_all(op, d_y, "d_y", tokens_per_expert, w_gate_up, w_down, row_prob);
  check_float_on(saved.gate_up, d_y.device(), op, "saved.gate_up");
  check_shape(saved.gate_up, {d.N, 2 * d.F}, op, "saved.gate_up");
  check_float_on(saved.act, d_y.device(), op, "saved.act");
  check_shape(saved.act, {d.N, d.F}, op, "saved.act");
#ifdef BB_WITH_CUDA
  if (d_y.device().is_cuda())
    return backward_data_cuda(impl, d_y, tokens_per_expert, w_gate_up, w_down, row_prob, saved, d);
#endif
  const DType dt = d_y.dtype();
  Tensor dy = cpu::as_f32(d_y), wgu = cpu::as_f32(w_gate_up), wd = cpu::as_f32(w_down);
  Tensor gu = cpu::as_f32(saved.gate_up), act = cpu::as_f32(saved.act);
  Tensor d_x = f32_for({d.N, d.H}, dt, MemCategory::moe);
  Tensor d_gu = f32_for({d.N, 2 * d.F}, dt, MemCategory::activations);
  ExpertsDgrad g;
  if (row_prob.defined())
    g.d_row_prob = Tensor::empty({d.N}, DType::f32, Device::cpu(), MemCategory::activations);
  auto fn = impl == ExpertsImpl::sequential ? ref::experts_backward_data_sequential<float>
                                            : ref::experts_backward_data_grouped<float>;
  fn(d_x.data<float>(), row_prob.defined() ? g.d_row_prob.data<float>() : nullptr,
     d_gu.data<float>(), dy.data<float>(), gu.data<float>(), act.data<float>(),
     tokens_per_expert.data(), d.E, wgu.data<float>(), wd.data<float>(), prob_ptr(row_prob), d.H,
     d.F);
  g.d_x = finish(d_x, dt, MemCategory::moe);
  g.d_gate_up = finish(d_gu, dt, MemCategory::activations);
  return g;
}

void experts_backward_weight(ExpertsImpl impl, const Tensor& d_y, const Tensor& x_perm,
                             const std::vector<int64_t>& tokens_per_expert, const Tensor& row_prob,
                             const ExpertsSaved& saved, const ExpertsDgrad& dgrad,
                             Tensor& d_w_gate_up, Tensor& d_w_down, bool accumulate) {
  BB_RANGE("experts_backward_weight");
  const char* op = "experts_backward_weight";
  const Dims d = check_all(op, d_y, "d_y", tokens_per_expert, d_w_gate_up, d_w_down, row_prob);
  check_float_on(x_perm, d_y.device(), op, "x_perm");
  check_shape(x_perm, {d.N, d.H}, op, "x_perm");
  check_float_on(saved.act, d_y.device(), op, "saved.act");
  check_shape(saved.act, {d.N, d.F}, op, "saved.act");
  check_float_on(dgrad.d_gate_up, d_y.device(), op, "dgrad.d_gate_up");
  check_shape(dgrad.d_gate_up, {d.N, 2 * d.F}, op, "dgrad.d_gate_up");
#ifdef BB_WITH_CUDA
  if (d_y.device().is_cuda()) {
    backward_weight_cuda(impl, d_y, x_perm, tokens_per_expert, row_prob, saved.act,
                         dgrad.d_gate_up, d_w_gate_up, d_w_down, d, accumulate);
    return;
  }
#endif
  if (!accumulate) {  // the reference adds into zeros
    d_w_gate_up.zero_();
    d_w_down.zero_();
  }
  Tensor dy = cpu::as_f32(d_y), x = cpu::as_f32(x_perm), act = cpu::as_f32(saved.act);
  Tensor dgu = cpu::as_f32(dgrad.d_gate_up);
  // f32 gradients are updated in place; 16-bit ones through an f32 copy stored back.
  Tensor dwgu = cpu::as_f32(d_w_gate_up), dwd = cpu::as_f32(d_w_down);
  auto fn = impl == ExpertsImpl::sequential ? ref::experts_backward_weight_sequential<float>
                                            : ref::experts_backward_weight_grouped<float>;
  fn(dwgu.data<float>(), dwd.data<float>(), dy.data<float>(), x.data<float>(), act.data<float>(),
     dgu.data<float>(), prob_ptr(row_prob), tokens_per_expert.data(), d.E, d.H, d.F);
  cpu::store_f32(d_w_gate_up, dwgu);
  cpu::store_f32(d_w_down, dwd);
}

}  // namespace bb
