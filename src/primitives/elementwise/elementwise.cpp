// elementwise.cpp — boundary checks for the pointwise ops, then plain CPU loops or the CUDA
// kernels (elementwise_cuda.h) depending on where the tensors live.
#include "primitives/elementwise/elementwise.h"

#include <cmath>
#include <cstring>

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

Tensor sigmoid_mul(const Tensor& x, const Tensor& z, MemCategory cat) {
  const char* op = "sigmoid_mul";
  check_float(x, op, "x");
  check_float(z, op, "z");
  BB_CHECK(x.shape() == z.shape(), op, ": x ", shape_str(x.shape()), " and z ",
           shape_str(z.shape()), " must have the same shape");
  check_same_device(x, z, op);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device(), cat);
  if (x.device().is_cuda()) {
    check_device_dtype(op, x, "x");
    check_device_dtype(op, z, "z");
#ifdef BB_WITH_CUDA
    cuda::sigmoid_mul(y.raw(), x.raw(), x.dtype(), z.raw(), z.dtype(), x.numel());
#endif
    return y;
  }
  Tensor xf = cpu::as_f32(x), zf = cpu::as_f32(z);
  Tensor yf = x.dtype() == DType::f32 ? y : cpu::empty_f32(x.shape(), MemCategory::workspace);
  const float *a = xf.data<float>(), *b = zf.data<float>();
  float* o = yf.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = a[i] / (1.0f + std::exp(-b[i]));
  if (x.dtype() != DType::f32) cpu::store_f32(y, yf);
  return y;
}

std::pair<Tensor, Tensor> sigmoid_mul_backward(const Tensor& d_y, const Tensor& x, const Tensor& z) {
  const char* op = "sigmoid_mul_backward";
  check_float(d_y, op, "d_y");
  check_float(x, op, "x");
  check_float(z, op, "z");
  BB_CHECK(d_y.shape() == x.shape() && x.shape() == z.shape(), op, ": d_y ", shape_str(d_y.shape()),
           ", x ", shape_str(x.shape()), " and z ", shape_str(z.shape()), " must have one shape");
  check_same_device(d_y, x, op);
  check_same_device(d_y, z, op);
  Tensor dx = Tensor::empty(x.shape(), DType::f32, x.device(), MemCategory::activations);
  Tensor dz = Tensor::empty(z.shape(), DType::f32, x.device(), MemCategory::activations);
  if (x.device().is_cuda()) {
    check_device_dtype(op, d_y, "d_y");
    check_device_dtype(op, x, "x");
    check_device_dtype(op, z, "z");
#ifdef BB_WITH_CUDA
    cuda::sigmoid_mul_backward(dx.data<float>(), dz.data<float>(), d_y.raw(), d_y.dtype(), x.raw(),
                               x.dtype(), z.raw(), z.dtype(), x.numel());
#endif
    return {dx, dz};
  }
  Tensor g = cpu::as_f32(d_y), xf = cpu::as_f32(x), zf = cpu::as_f32(z);
  const float *gp = g.data<float>(), *xp = xf.data<float>(), *zp = zf.data<float>();
  float *dxp = dx.data<float>(), *dzp = dz.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float s = 1.0f / (1.0f + std::exp(-zp[i]));
    dxp[i] = gp[i] * s;
    dzp[i] = gp[i] * xp[i] * s * (1.0f - s);
  }
  return {dx, dz};
}

std::pair<Tensor, Tensor> split_halves(const Tensor& x, MemCategory cat) {
  const char* op = "split_halves";
  check_float(x, op, "x");
  BB_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, op, ": x must be [R, 2C], got ",
           shape_str(x.shape()));
  const int64_t R = x.size(0), C = x.size(1) / 2;
  Tensor a = Tensor::empty({R, C}, x.dtype(), x.device(), cat);
  Tensor b = Tensor::empty({R, C}, x.dtype(), x.device(), cat);
  if (x.device().is_cuda()) {
    check_device_dtype(op, x, "x");
#ifdef BB_WITH_CUDA
    cuda::split_halves(a.raw(), b.raw(), x.raw(), x.dtype(), R, C);
#endif
    return {a, b};
  }
  const size_t es = dtype_size(x.dtype()), row = static_cast<size_t>(C) * es;
  const char* src = static_cast<const char*>(x.raw());
  char* pa = static_cast<char*>(a.raw());
  char* pb = static_cast<char*>(b.raw());
  for (int64_t r = 0; r < R; ++r) {  // a copy in any dtype
    std::memcpy(pa + r * row, src + 2 * r * row, row);
    std::memcpy(pb + r * row, src + (2 * r + 1) * row, row);
  }
  return {a, b};
}

Tensor join_halves(const Tensor& a, const Tensor& b, DType dt, MemCategory cat) {
  const char* op = "join_halves";
  check_float(a, op, "a");
  check_float(b, op, "b");
  BB_CHECK(a.dim() == 2 && a.shape() == b.shape(), op, ": a and b must be [R, C] of one shape, got ",
           shape_str(a.shape()), " and ", shape_str(b.shape()));
  check_same_device(a, b, op);
  BB_CHECK(is_floating(dt), op, ": output dtype ", dtype_name(dt), " is not a float type");
  const int64_t R = a.size(0), C = a.size(1);
  Tensor out = Tensor::empty({R, 2 * C}, dt, a.device(), cat);
  if (a.device().is_cuda()) {
    check_device_dtype(op, a, "a");
    check_device_dtype(op, b, "b");
    check_device_dtype(op, out, "out");
#ifdef BB_WITH_CUDA
    cuda::join_halves(out.raw(), dt, a.raw(), a.dtype(), b.raw(), b.dtype(), R, C);
#endif
    return out;
  }
  Tensor af = cpu::as_f32(a), bf = cpu::as_f32(b);
  Tensor of = dt == DType::f32 ? out : cpu::empty_f32({R, 2 * C}, MemCategory::workspace);
  const float *pa = af.data<float>(), *pb = bf.data<float>();
  float* po = of.data<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      po[r * 2 * C + c] = pa[r * C + c];
      po[r * 2 * C + C + c] = pb[r * C + c];
    }
  if (dt != DType::f32) cpu::store_f32(out, of);
  return out;
}

}  // namespace bb
