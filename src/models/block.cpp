// block.cpp — shared pieces of the blocks: the weight-gradient queue and the linear backward.
#include "models/block.h"

#include "primitives/elementwise/elementwise.h"
#include "primitives/linear/linear.h"

namespace bb {

void Block::backward_weight(BatchContext&, BlockSaved& saved) {
  for (auto& fn : saved.deferred_wgrad) fn();
  saved.deferred_wgrad.clear();
}

namespace block {

Tensor as_dtype(const Tensor& t, DType dt) {
  return t.dtype() == dt ? t : t.to_dtype(dt, MemCategory::activations);
}

Tensor flat(const Tensor& t) { return t.view({t.size(0), -1}); }

void weight_grad(BatchContext& ctx, BlockSaved& saved, std::function<void()> fn) {
  if (ctx.defer_wgrad) saved.deferred_wgrad.push_back(std::move(fn));
  else fn();
}

namespace {
// d_y in the weight's dtype, with w.grad += g^T x (and b.grad += sum g) run now or queued.
Tensor weight_grad_of(BatchContext& ctx, BlockSaved& saved, const Tensor& d_y, const Tensor& x,
                      Param* w, Param* b) {
  const Tensor g = as_dtype(d_y, w->value.dtype());
  weight_grad(ctx, saved, [g, x, w, b] {
    linear_backward_weight(g, x, w->grad, b ? &b->grad : nullptr);
  });
  return g;
}
}  // namespace

Tensor linear_backward(BatchContext& ctx, BlockSaved& saved, const Tensor& d_y, const Tensor& x,
                       Param* w, Param* b, DType out_dtype) {
  return linear_backward_data(weight_grad_of(ctx, saved, d_y, x, w, b), w->value, out_dtype);
}

void linear_backward_acc(BatchContext& ctx, BlockSaved& saved, const Tensor& d_y, const Tensor& x,
                         Param* w, Param* b, Tensor& d_x) {
  linear_backward_data_acc(weight_grad_of(ctx, saved, d_y, x, w, b), w->value, d_x);
}

Tensor norm_backward_with_skip(const Tensor& d_h, const Tensor& x, Param* ln,
                               const RMSNormSaved& rms, bool zero_centered, const Tensor& d_y) {
  if (d_y.dtype() == DType::f32)
    return rmsnorm_backward(d_h, x, ln->value, rms, ln->grad, zero_centered, &d_y);
  Tensor d_x = rmsnorm_backward(d_h, x, ln->value, rms, ln->grad, zero_centered);
  add_inplace(d_x, d_y);
  return d_x;
}

}  // namespace block

}  // namespace bb
