// rope.cpp — boundary checks for RoPE, then the CPU reference or the CUDA kernel
// (rope_cuda.h) depending on where x lives.
#include "primitives/rope/rope.h"

#include "core/trace.h"

#include <vector>

#include "backend/cpu/util.h"
#include "primitives/rope/rope_cuda.h"
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
  return R;
}

// x on a CUDA device; positions on the host (copied up: the runtime's host-to-device copy
// synchronises, see cuda::memcpy) or already on x's device (no copy, no sync).
Tensor apply_cuda(const char* op, const Tensor& x, const Tensor& positions, const RopeConfig& cfg,
                  int64_t R, int sign, DType out_dtype, MemCategory cat) {
#ifdef BB_WITH_CUDA
  BB_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::bf16, op, ": argument 'x' has dtype ",
           dtype_name(x.dtype()), ", the CUDA path takes f32 or bf16");
  BB_CHECK(R / 2 <= cuda::kRopeMaxHalf, op, ": rotary_dim ", R, " is above the CUDA limit ",
           2 * cuda::kRopeMaxHalf);
  BB_CHECK(positions.device().is_cpu() || positions.device() == x.device(), op,
           ": positions on ", positions.device().str(), " but x on ", x.device().str());
  Tensor pos = positions.device().is_cpu() ? positions.to(x.device(), MemCategory::workspace)
                                           : positions;
  std::vector<float> inv_freq(static_cast<size_t>(R / 2));
  for (int64_t i = 0; i < R / 2; ++i) inv_freq[i] = ref::rope_inv_freq(i, R, cfg.theta);
  Tensor y = Tensor::empty(x.shape(), out_dtype, x.device(), cat);
  cuda::rope_apply(y.raw(), out_dtype, x.raw(), x.dtype(), pos.data<int32_t>(), x.size(0),
                   x.size(1), x.size(2), R, inv_freq.data(), sign);
  return y;
#else
  BB_FAIL(op, ": not implemented on ", x.device().str(), " in this build (no CUDA backend)");
#endif
}

Tensor apply(const char* op, const Tensor& x, const Tensor& positions, const RopeConfig& cfg,
             int sign, DType out_dtype, MemCategory cat) {
  const int64_t R = check_args(op, x, positions, cfg);
  if (x.device().is_cuda()) return apply_cuda(op, x, positions, cfg, R, sign, out_dtype, cat);
  BB_CHECK(positions.device().is_cpu(), op, ": positions on ", positions.device().str(),
           " but x on the CPU");
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
  BB_RANGE("rope_forward");
  return apply("rope_forward", x, positions, cfg, +1, x.dtype(), out_cat);
}

Tensor rope_backward(const Tensor& d_y, const Tensor& positions, const RopeConfig& cfg) {
  BB_RANGE("rope_backward");
  return apply("rope_backward", d_y, positions, cfg, -1, DType::f32, MemCategory::activations);
}

}  // namespace bb
