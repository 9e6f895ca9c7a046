#include "primitives/rope/rope.h"

#include "backend/cpu/util.h"
#include "primitives/rope/rope_ref.h"

namespace bb {

namespace {
int64_t check_args(const char* op, const Tensor& x, const Tensor& positions, const RopeConfig& cfg) {
  check_float(x, op, "x");
  BB_CHECK(x.dim() == 3, op, ": x must be [T, heads, D], got ", shape_str(x.shape()));
  check_dtype(positions, DType::i32, op, "positions");
  check_shape(positions, {x.size(0)}, op, "positions");
  const int64_t D = x.size(2);
  const int64_t R = cfg.rotary_dim == 0 ? D : cfg.rotary_dim;
  BB_CHECK(R > 0 && R <= D && R % 2 == 0, op, ": rotary_dim ", cfg.rotary_dim,
           " must be even and in (0, head_dim=", D, "]");
  BB_CHECK(cfg.theta > 0, op, ": rope theta must be positive, got ", cfg.theta);
  BB_CHECK(x.device().is_cpu(), op, ": not implemented on ", x.device().str(), " yet");
  return R;
}

Tensor apply(const char* op, const Tensor& x, const Tensor& positions, const RopeConfig& cfg,
             int sign, DType out_dtype, MemCategory cat) {
  const int64_t R = check_args(op, x, positions, cfg);
  Tensor xf = cpu::as_f32(x);
  Tensor y = Tensor::empty(x.shape(), out_dtype, x.device(), cat);
  Tensor yf = out_dtype == DType::f32 ? y : cpu::empty_f32(x.shape(), MemCategory::workspace);
  ref::rope_apply<float>(yf.data<float>(), xf.data<float>(), positions.data<int32_t>(), x.size(0),
                         x.size(1), x.size(2), R, cfg.theta, sign);
  cpu::store_f32(y, yf);
  return y;
}
}  // namespace

Tensor rope_forward(const Tensor& x, const Tensor& positions, const RopeConfig& cfg,
                    MemCategory out_cat) {
  return apply("rope_forward", x, positions, cfg, +1, x.dtype(), out_cat);
}

Tensor rope_backward(const Tensor& d_y, const Tensor& positions, const RopeConfig& cfg) {
  return apply("rope_backward", d_y, positions, cfg, -1, DType::f32, MemCategory::activations);
}

}  // namespace bb
