// elementwise.cpp — boundary checks for the pointwise ops, then plain CPU loops or the CUDA
// kernels (elementwise_cuda.h) depending on where the tensors live.
#include "primitives/elementwise/elementwise.h"

#include <cmath>

#include "backend/cpu/util.h"
#include "primitives/elementwise/elementwise_cuda.h"

namespace bb {

namespace {
// The CUDA kernels read f32 or bf16; f16 stays a CPU-only storage type.
void check_device_dtype(const char* op, const Tensor& t, const char* arg) {
  if (!t.device().is_cuda()) return;
#ifndef BB_WITH_CUDA
  BB_FAIL(op, ": not implemented on ", t.device().str(), " in this build (no CUDA backend)");
#endif
  BB_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, op, ": argument '", arg,
           "' has dtype ", dtype_name(t.dtype()), ", the CUDA path takes f32 or bf16");
}

void check_pair(const char* op, const Tensor& a, const Tensor& b) {
  check_float(a, op, "a");
  check_float(b, op, "b");
  BB_CHECK(a.numel() == b.numel(), op, ": sizes differ: ", a.str(), " vs ", b.str());
  check_same_device(a, b, op);
  check_device_dtype(op, a, "a");
  check_device_dtype(op, b, "b");
}
}  // namespace

void add_inplace(Tensor& a, const Tensor& b) { axpy_inplace(a, 1.0f, b); }

void axpy_inplace(Tensor& a, float s, const Tensor& b) {
  check_pair("axpy_inplace", a, b);
  check_dtype(a, DType::f32, "axpy_inplace", "a");
  if (a.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    cuda::axpy_inplace(a.data<float>(), s, b.raw(), b.dtype(), a.numel());
#endif
    return;
  }
  Tensor bf = cpu::as_f32(b);
  float* pa = a.data<float>();
  const float* pb = bf.data<float>();
  for (int64_t i = 0; i < a.numel(); ++i) pa[i] += s * pb[i];
}

Tensor add(const Tensor& a, const Tensor& b, MemCategory cat) {
  check_pair("add", a, b);
  if (a.device().is_cuda()) {
    Tensor out = Tensor::empty(a.shape(), DType::f32, a.device(), cat);
#ifdef BB_WITH_CUDA
    cuda::add(out.data<float>(), a.raw(), a.dtype(), b.raw(), b.dtype(), a.numel());
#endif
    return out;
  }
  Tensor out = cpu::as_f32(a).clone(cat);
  add_inplace(out, b);
  return out;
}

Tensor scale_rows(const Tensor& x, const Tensor& g, MemCategory cat) {
  check_float(x, "scale_rows", "x");
  BB_CHECK(x.dim() == 2, "scale_rows: x must be [T, H], got ", shape_str(x.shape()));
  BB_CHECK(g.numel() == x.size(0), "scale_rows: gate has ", g.numel(), " entries for ", x.size(0),
           " rows");
  check_float(g, "scale_rows", "g");
  check_same_device(x, g, "scale_rows");
  if (x.device().is_cuda()) {
    check_device_dtype("scale_rows", x, "x");
    check_device_dtype("scale_rows", g, "g");
    Tensor out = Tensor::empty(x.shape(), DType::f32, x.device(), cat);
#ifdef BB_WITH_CUDA
    cuda::scale_rows(out.data<float>(), x.raw(), x.dtype(), g.raw(), g.dtype(), x.size(0),
                     x.size(1));
#endif
    return out;
  }
  Tensor out = cpu::as_f32(x).clone(cat);
  Tensor gf = cpu::as_f32(g);
  float* o = out.data<float>();
  const float* gp = gf.data<float>();
  const int64_t H = x.size(1);
  for (int64_t t = 0; t < x.size(0); ++t)
    for (int64_t h = 0; h < H; ++h) o[t * H + h] *= gp[t];
  return out;
}

Tensor sigmoid(const Tensor& x, MemCategory cat) {
  check_float(x, "sigmoid", "x");
  if (x.device().is_cuda()) {
    check_device_dtype("sigmoid", x, "x");
    Tensor out = Tensor::empty(x.shape(), DType::f32, x.device(), cat);
#ifdef BB_WITH_CUDA
    cuda::sigmoid(out.data<float>(), x.raw(), x.dtype(), x.numel());
#endif
    return out;
  }
  Tensor out = cpu::as_f32(x).clone(cat);
  float* o = out.data<float>();
  for (int64_t i = 0; i < out.numel(); ++i) o[i] = 1.0f / (1.0f + std::exp(-o[i]));
  return out;
}

Tensor sigmoid_gate_backward(const Tensor& d_y, const Tensor& s, const Tensor& g, MemCategory cat) {
  const char* op = "sigmoid_gate_backward";
  check_float(d_y, op, "d_y");
  check_float(s, op, "s");
  check_float(g, op, "g");
  BB_CHECK(d_y.dim() == 2, op, ": d_y must be [T, H], got ", shape_str(d_y.shape()));
  BB_CHECK(s.shape() == d_y.shape(), op, ": s must match d_y ", shape_str(d_y.shape()), ", got ",
           shape_str(s.shape()));
  BB_CHECK(g.numel() == d_y.size(0), op, ": gate has ", g.numel(), " entries for ", d_y.size(0),
           " rows");
  check_same_device(d_y, s, op);
  check_same_device(d_y, g, op);
  const int64_t T = d_y.size(0), H = d_y.size(1);
  Tensor out = Tensor::empty({T, 1}, DType::f32, d_y.device(), cat);
  if (d_y.device().is_cuda()) {
    check_device_dtype(op, d_y, "d_y");
    check_device_dtype(op, s, "s");
    check_device_dtype(op, g, "g");
#ifdef BB_WITH_CUDA
    cuda::sigmoid_gate_backward(out.data<float>(), d_y.raw(), d_y.dtype(), s.raw(), s.dtype(),
                                g.raw(), g.dtype(), T, H);
#endif
    return out;
  }
  Tensor dy = cpu::as_f32(d_y), sf = cpu::as_f32(s), gf = cpu::as_f32(g);
  const float *a = dy.data<float>(), *b = sf.data<float>(), *gp = gf.data<float>();
  float* o = out.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    double dot = 0;
    for (int64_t h = 0; h < H; ++h) dot += static_cast<double>(a[t * H + h]) * b[t * H + h];
    o[t] = static_cast<float>(dot * gp[t] * (1.0 - gp[t]));
  }
  return out;
}

}  // namespace bb
