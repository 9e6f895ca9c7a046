// linear.cpp — boundary checks for matmul / linear, then the CPU reference (OpenBLAS, fp32) or
// the CUDA path (cuBLASLt through cuda::gemm, bias kernels in linear_cuda.cu).
// Accumulation convention: d_w and d_bias are ACCUMULATED (+=); d_x is WRITTEN (=).
#include "primitives/linear/linear.h"

#include "core/trace.h"

#include <algorithm>

#include "backend/cpu/gemm.h"
#include "backend/cpu/util.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/gemm.h"
#include "primitives/linear/linear_cuda.h"
#endif

namespace bb {

namespace {
#ifdef BB_WITH_CUDA
// Leading dimension of a contiguous 2-d tensor (at least 1, as BLAS wants).
int64_t ld(const Tensor& t) { return std::max<int64_t>(t.size(1), 1); }
#else
[[noreturn]] void no_cuda(const char* op, const Tensor& t) {
  BB_FAIL(op, ": not implemented on ", t.device().str(),
          " yet (this build has no CUDA backend: BUMBLEBEE_CUDA=OFF)");
}
#endif
}  // namespace

void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha,
            float beta) {
  check_float(a, "matmul", "a");
  check_float(b, "matmul", "b");
  check_dtype(c, DType::f32, "matmul", "c");
  BB_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2, "matmul: expects 2-d tensors, got a ",
           shape_str(a.shape()), ", b ", shape_str(b.shape()), ", c ", shape_str(c.shape()));
  const int64_t M = ta ? a.size(1) : a.size(0), K = ta ? a.size(0) : a.size(1);
  const int64_t Kb = tb ? b.size(1) : b.size(0), N = tb ? b.size(0) : b.size(1);
  BB_CHECK(K == Kb, "matmul: inner dimensions differ: op(a) is [", M, ", ", K, "], op(b) is [", Kb,
           ", ", N, "]");
  check_shape(c, {M, N}, "matmul", "c");
  check_same_device(a, b, "matmul");
  check_same_device(a, c, "matmul");
  if (a.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    cuda::gemm(ta, tb, M, N, K, alpha, a.raw(), a.dtype(), ld(a), b.raw(), b.dtype(), ld(b), beta,
               c.raw(), DType::f32, ld(c), a.device().index);
    return;
#else
    no_cuda("matmul", a);
#endif
  }
  Tensor af = cpu::as_f32(a), bf = cpu::as_f32(b);
  cpu::gemm<float>(ta, tb, M, N, K, alpha, af.data<float>(), bf.data<float>(), beta,
                   c.data<float>());
}

void matmul_batched(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) {
  check_float(a, "matmul_batched", "a");
  check_float(b, "matmul_batched", "b");
  check_dtype(c, DType::f32, "matmul_batched", "c");
  BB_CHECK(a.dim() == 3 && b.dim() == 3 && c.dim() == 3 && a.size(0) == b.size(0) && a.size(0) == c.size(0),
           "matmul_batched: expects 3-d tensors with one batch size, got a ", shape_str(a.shape()), ", b ",
           shape_str(b.shape()), ", c ", shape_str(c.shape()));
  const int64_t n = a.size(0), M = ta ? a.size(2) : a.size(1), K = ta ? a.size(1) : a.size(2);
  const int64_t Kb = tb ? b.size(2) : b.size(1), N = tb ? b.size(1) : b.size(2);
  BB_CHECK(K == Kb, "matmul_batched: inner dimensions differ: op(a) is [", M, ", ", K, "], op(b) is [", Kb, ", ", N,
           "]");
  check_shape(c, {n, M, N}, "matmul_batched", "c");
  check_same_device(a, b, "matmul_batched");
  check_same_device(a, c, "matmul_batched");
  if (n == 0) return;
  if (a.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    cuda::gemm_strided_batched(ta, tb, M, N, K, alpha, a.raw(), a.dtype(), std::max<int64_t>(a.size(2), 1),
                               a.size(1) * a.size(2), b.raw(), b.dtype(), std::max<int64_t>(b.size(2), 1),
                               b.size(1) * b.size(2), beta, c.raw(), DType::f32, std::max<int64_t>(N, 1), M * N, n,
                               a.device().index);
    return;
#else
    no_cuda("matmul_batched", a);
#endif
  }
  Tensor af = cpu::as_f32(a), bf = cpu::as_f32(b);
  for (int64_t i = 0; i < n; ++i)
    cpu::gemm<float>(ta, tb, M, N, K, alpha, af.data<float>() + i * a.size(1) * a.size(2),
                     bf.data<float>() + i * b.size(1) * b.size(2), beta, c.data<float>() + i * M * N);
}

Tensor linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, MemCategory out_cat) {
  BB_RANGE("linear_forward");
  check_float(x, "linear_forward", "x");
  check_float(w, "linear_forward", "w");
  BB_CHECK(x.dim() == 2 && w.dim() == 2, "linear_forward: x must be [T, in] and w [out, in], got x ",
           shape_str(x.shape()), ", w ", shape_str(w.shape()));
  BB_CHECK(x.size(1) == w.size(1), "linear_forward: x has ", x.size(1),
           " input features but w ", shape_str(w.shape()), " expects ", w.size(1));
  check_same_device(x, w, "linear_forward");
  const int64_t T = x.size(0), out = w.size(0);
  if (x.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    const int dev = x.device().index;
    Tensor y = Tensor::empty({T, out}, x.dtype(), x.device(), out_cat);
    float beta = 0.0f;
    if (bias.defined()) {
      check_float(bias, "linear_forward", "bias");
      check_shape(bias, {out}, "linear_forward", "bias");
      check_same_device(x, bias, "linear_forward");
      cuda::linear_bias_broadcast(y.raw(), y.dtype(), bias.raw(), bias.dtype(), T, out, dev);
      beta = 1.0f;  // y = x w^T + bias, rounded once
    }
    cuda::gemm(false, true, T, out, x.size(1), 1.0f, x.raw(), x.dtype(), ld(x), w.raw(), w.dtype(),
               ld(w), beta, y.raw(), y.dtype(), ld(y), dev);
    return y;
#else
    no_cuda("linear_forward", x);
#endif
  }
  Tensor yf = cpu::empty_f32({T, out}, x.dtype() == DType::f32 ? out_cat : MemCategory::workspace);
  matmul(x, false, w, true, yf);
  if (bias.defined()) {
    check_shape(bias, {out}, "linear_forward", "bias");
    check_same_device(x, bias, "linear_forward");
    Tensor bf = cpu::as_f32(bias);
    float* y = yf.data<float>();
    const float* bp = bf.data<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < out; ++o) y[t * out + o] += bp[o];
  }
  if (x.dtype() == DType::f32) return yf;
  Tensor y = Tensor::empty({T, out}, x.dtype(), x.device(), out_cat);
  cpu::store_f32(y, yf);
  return y;
}

Tensor linear_backward_data(const Tensor& d_y, const Tensor& w, DType out_dtype) {
  BB_RANGE("linear_backward_data");
  BB_CHECK(d_y.dim() == 2 && w.dim() == 2 && d_y.size(1) == w.size(0),
           "linear_backward_data: d_y ", shape_str(d_y.shape()), " does not match w ",
           shape_str(w.shape()));
  BB_CHECK(out_dtype == DType::f32 || out_dtype == DType::bf16,
           "linear_backward_data: d_x can be f32 or bf16, not ", dtype_name(out_dtype));
  check_same_device(d_y, w, "linear_backward_data");
  const Shape shape{d_y.size(0), w.size(1)};
  if (out_dtype == DType::bf16 && d_y.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    check_float(d_y, "linear_backward_data", "d_y");
    check_float(w, "linear_backward_data", "w");
    Tensor dx = Tensor::empty(shape, DType::bf16, d_y.device(), MemCategory::activations);
    cuda::gemm(false, false, shape[0], shape[1], d_y.size(1), 1.0f, d_y.raw(), d_y.dtype(),
               ld(d_y), w.raw(), w.dtype(), ld(w), 0.0f, dx.raw(), DType::bf16, ld(dx),
               d_y.device().index);
    return dx;
#else
    no_cuda("linear_backward_data", d_y);
#endif
  }
  const bool f32_out = out_dtype == DType::f32;
  Tensor dx = d_y.device().is_cpu()
                  ? cpu::empty_f32(shape, f32_out ? MemCategory::activations : MemCategory::workspace)
                  : Tensor::empty(shape, DType::f32, d_y.device(), MemCategory::activations);
  matmul(d_y, false, w, false, dx);  // dispatches on the device
  if (f32_out) return dx;
  Tensor out = Tensor::empty(shape, out_dtype, d_y.device(), MemCategory::activations);
  cpu::store_f32(out, dx);
  return out;
}

void linear_backward_data_acc(const Tensor& d_y, const Tensor& w, Tensor& d_x) {
  BB_RANGE("linear_backward_data");
  BB_CHECK(d_y.dim() == 2 && w.dim() == 2 && d_y.size(1) == w.size(0),
           "linear_backward_data_acc: d_y ", shape_str(d_y.shape()), " does not match w ",
           shape_str(w.shape()));
  check_same_device(d_y, w, "linear_backward_data_acc");
  check_same_device(d_y, d_x, "linear_backward_data_acc");
  check_shape(d_x, {d_y.size(0), w.size(1)}, "linear_backward_data_acc", "d_x");
  check_dtype(d_x, DType::f32, "linear_backward_data_acc", "d_x");
  matmul(d_y, false, w, false, d_x, 1.0f, 1.0f);  // dispatches on the device
}

void linear_backward_weight(const Tensor& d_y, const Tensor& x, Tensor& d_w, Tensor* d_bias) {
  BB_RANGE("linear_backward_weight");
  BB_CHECK(d_y.dim() == 2 && x.dim() == 2 && d_y.size(0) == x.size(0),
           "linear_backward_weight: d_y ", shape_str(d_y.shape()), " and x ", shape_str(x.shape()),
           " must have the same number of rows");
  check_shape(d_w, {d_y.size(1), x.size(1)}, "linear_backward_weight", "d_w");
  if (d_bias) {  // checked before d_w changes, so that a bad call leaves the gradients alone
    check_shape(*d_bias, {d_y.size(1)}, "linear_backward_weight", "d_bias");
    check_dtype(*d_bias, DType::f32, "linear_backward_weight", "d_bias");
    check_same_device(d_y, *d_bias, "linear_backward_weight");
  }
  matmul(d_y, true, x, false, d_w, 1.0f, 1.0f);  // dispatches on the device
  if (!d_bias) return;
  const int64_t T = d_y.size(0), out = d_y.size(1);
  if (d_y.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    check_float(d_y, "linear_backward_weight", "d_y");
    cuda::linear_bias_grad(d_bias->data<float>(), d_y.raw(), d_y.dtype(), T, out,
                           d_y.device().index);
    return;
#else
    no_cuda("linear_backward_weight", d_y);
#endif
  }
  Tensor dyf = cpu::as_f32(d_y);
  const float* g = dyf.data<float>();
  float* db = d_bias->data<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o) db[o] += g[t * out + o];
}

}  // namespace bb
