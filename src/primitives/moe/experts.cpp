// experts.cpp — boundary checks for the expert MLPs, then the CPU reference in fp32.
#include "primitives/moe/experts.h"

#include "backend/cpu/util.h"
#include "primitives/moe/experts_ref.h"

namespace bb {

namespace {

struct Dims {
  int64_t N = 0, H = 0, F = 0, E = 0;
};

void check_cpu(const Tensor& t, const char* op, const char* arg) {
  BB_CHECK(t.device().is_cpu(), op, ": not implemented on ", t.device().str(), " yet (argument '",
           arg, "')");
}

void check_float_cpu(const Tensor& t, const char* op, const char* arg) {
  check_float(t, op, arg);
  check_cpu(t, op, arg);
}

// Reads E, F, H from the weights and N from x-like [N, H]; checks shapes and counts.
Dims check_all(const char* op, const Tensor& rows, const char* rows_arg,
               const std::vector<int64_t>& counts, const Tensor& w_gate_up, const Tensor& w_down,
               const Tensor& row_prob) {
  check_float_cpu(w_gate_up, op, "w_gate_up");
  BB_CHECK(w_gate_up.dim() == 3 && w_gate_up.size(0) >= 1 && w_gate_up.size(1) % 2 == 0, op,
           ": argument 'w_gate_up' has shape ", shape_str(w_gate_up.shape()),
           ", expected [E, 2F, H] with E >= 1");
  Dims d;
  d.E = w_gate_up.size(0);
  d.F = w_gate_up.size(1) / 2;
  d.H = w_gate_up.size(2);
  check_float_cpu(w_down, op, "w_down");
  check_shape(w_down, {d.E, d.H, d.F}, op, "w_down");
  check_float_cpu(rows, op, rows_arg);
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
    check_cpu(row_prob, op, "row_prob");
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

}  // namespace

Tensor experts_forward(ExpertsImpl impl, const Tensor& x_perm,
                       const std::vector<int64_t>& tokens_per_expert, const Tensor& w_gate_up,
                       const Tensor& w_down, const Tensor& row_prob, ExpertsSaved* saved) {
  const char* op = "experts_forward";
  const Dims d = check_all(op, x_perm, "x_perm", tokens_per_expert, w_gate_up, w_down, row_prob);
  const DType dt = x_perm.dtype();
  const MemCategory saved_cat = saved ? MemCategory::activations : MemCategory::workspace;
  Tensor x = cpu::as_f32(x_perm), wgu = cpu::as_f32(w_gate_up), wd = cpu::as_f32(w_down);
  Tensor gate_up = f32_for({d.N, 2 * d.F}, dt, saved_cat);
  Tensor act = f32_for({d.N, d.F}, dt, saved_cat);
  Tensor y = f32_for({d.N, d.H}, dt, MemCategory::moe);
  auto fn = impl == ExpertsImpl::sequential ? ref::experts_forward_sequential<float>
                                            : ref::experts_forward_grouped<float>;
  fn(y.data<float>(), gate_up.data<float>(), act.data<float>(), x.data<float>(),
     tokens_per_expert.data(), d.E, wgu.data<float>(), wd.data<float>(), prob_ptr(row_prob), d.H,
     d.F);
  if (saved) {
    saved->gate_up = finish(gate_up, dt, saved_cat);
    saved->act = finish(act, dt, saved_cat);
  }
  return finish(y, dt, MemCategory::moe);
}

ExpertsDgrad experts_backward_data(ExpertsImpl impl, const Tensor& d_y,
                                   const std::vector<int64_t>& tokens_per_expert,
                                   const Tensor& w_gate_up, const Tensor& w_down,
                                   const Tensor& row_prob, const ExpertsSaved& saved) {
  const char* op = "experts_backward_data";
  const Dims d = check_all(op, d_y, "d_y", tokens_per_expert, w_gate_up, w_down, row_prob);
  check_float_cpu(saved.gate_up, op, "saved.gate_up");
  check_shape(saved.gate_up, {d.N, 2 * d.F}, op, "saved.gate_up");
  check_float_cpu(saved.act, op, "saved.act");
  check_shape(saved.act, {d.N, d.F}, op, "saved.act");
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
                             Tensor& d_w_gate_up, Tensor& d_w_down) {
  const char* op = "experts_backward_weight";
  const Dims d = check_all(op, d_y, "d_y", tokens_per_expert, d_w_gate_up, d_w_down, row_prob);
  check_float_cpu(x_perm, op, "x_perm");
  check_shape(x_perm, {d.N, d.H}, op, "x_perm");
  check_float_cpu(saved.act, op, "saved.act");
  check_shape(saved.act, {d.N, d.F}, op, "saved.act");
  check_float_cpu(dgrad.d_gate_up, op, "dgrad.d_gate_up");
  check_shape(dgrad.d_gate_up, {d.N, 2 * d.F}, op, "dgrad.d_gate_up");
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
