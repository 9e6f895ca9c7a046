// causal_conv1d.cpp — boundary checks, then the CPU reference (causal_conv1d_ref.h).
#include "primitives/conv/causal_conv1d.h"

#include <algorithm>

#include "core/trace.h"
#include "primitives/conv/causal_conv1d_cuda.h"
#include "primitives/conv/causal_conv1d_ref.h"

namespace bb {

namespace {

void check(const char* op, const Tensor& x, const Tensor& w, const Tensor& cu) {
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&x, "x"}, {&w, "w"}}) {
    check_defined(*t, op, name);
    check_dtype(*t, DType::f32, op, name);
  }
  check_same_device(x, w, op);
#ifndef BB_WITH_CUDA
  BB_CHECK(x.device().is_cpu(), op, ": x is on ", x.device().str(), " but this build has no CUDA backend");
#endif
  BB_CHECK(x.dim() == 2 && w.dim() == 2, op, ": x must be [T, C] and w [C, W], got ", shape_str(x.shape()), " and ",
           shape_str(w.shape()));
  BB_CHECK(w.size(0) == x.size(1), op, ": w has ", w.size(0), " channels, x ", x.size(1));
  BB_CHECK(w.size(1) >= 1 && w.size(1) <= 4, op, ": kernel width ", w.size(1), " is not in [1, 4]");
  check_dtype(cu, DType::i32, op, "cu_seqlens");
  BB_CHECK(cu.device().is_cpu() && cu.dim() == 1 && cu.numel() >= 2, op, ": cu_seqlens must be [n + 1] on the host");
  const std::vector<int32_t> c = cu.to_ints();
  BB_CHECK(c.front() == 0 && c.back() == x.size(0), op, ": cu_seqlens must start at 0 and end at T = ", x.size(0));
  for (size_t i = 1; i < c.size(); ++i) BB_CHECK(c[i] >= c[i - 1], op, ": cu_seqlens must not decrease");
}

}  // namespace

Tensor causal_conv1d_forward(const Tensor& x, const Tensor& w, const Tensor& cu, bool silu, MemCategory out_cat,
                             DType out_dtype) {
  BB_RANGE("causal_conv1d_forward");
  check("causal_conv1d_forward", x, w, cu);
  BB_CHECK(out_dtype == DType::f32 || out_dtype == DType::bf16,
           "causal_conv1d_forward: the output dtype must be f32 or bf16, got ", dtype_name(out_dtype));
#ifdef BB_WITH_CUDA
  if (x.device().is_cuda()) {
    Tensor y = Tensor::empty(x.shape(), out_dtype, x.device(), out_cat);
    const Tensor cud = cu.to(x.device(), MemCategory::workspace);  // staged upload, no host wait
    cuda::causal_conv1d_forward(y.raw(), out_dtype == DType::bf16, x.data<float>(), w.data<float>(),
                                cud.data<int32_t>(), cu.numel() - 1, x.size(0), x.size(1), w.size(1), silu);
    return y;
  }
#endif
  Tensor y = Tensor::empty(x.shape(), DType::f32, x.device(), out_dtype == DType::f32 ? out_cat : MemCategory::workspace);
  ref::causal_conv1d_forward<float>(y.data<float>(), x.data<float>(), w.data<float>(), cu.data<int32_t>(),
                                    cu.numel() - 1, x.size(1), w.size(1), silu);
  return out_dtype == DType::f32 ? y : y.to_dtype(out_dtype, out_cat);
}

Tensor causal_conv1d_backward(const Tensor& d_y, const Tensor& x, const Tensor& w, const Tensor& cu, bool silu,
                              Tensor& d_w) {
  BB_RANGE("causal_conv1d_backward");
  const char* op = "causal_conv1d_backward";
  check(op, x, w, cu);
  check_dtype(d_y, DType::f32, op, "d_y");
  check_shape(d_y, x.shape(), op, "d_y");
  check_dtype(d_w, DType::f32, op, "d_w");
  check_shape(d_w, w.shape(), op, "d_w");
  check_same_device(x, d_y, op);
  check_same_device(x, d_w, op);
  Tensor d_x = Tensor::empty(x.shape(), DType::f32, x.device(), MemCategory::activations);
#ifdef BB_WITH_CUDA
  if (x.device().is_cuda()) {
    const Tensor cud = cu.to(x.device(), MemCategory::workspace);
    Tensor ws = Tensor::empty({std::max<int64_t>(1, cuda::causal_conv1d_backward_workspace(x.size(0), x.size(1), w.size(1)))},
                              DType::f32, x.device(), MemCategory::workspace);
    cuda::causal_conv1d_backward(d_x.data<float>(), d_w.data<float>(), ws.data<float>(), d_y.data<float>(),
                                 x.data<float>(), w.data<float>(), cud.data<int32_t>(), cu.numel() - 1, x.size(0),
                                 x.size(1), w.size(1), silu);
    return d_x;
  }
#endif
  ref::causal_conv1d_backward<float>(d_x.data<float>(), d_w.data<float>(), d_y.data<float>(), x.data<float>(),
                                     w.data<float>(), cu.data<int32_t>(), cu.numel() - 1, x.size(1), w.size(1), silu);
  return d_x;
}

}  // namespace bb
