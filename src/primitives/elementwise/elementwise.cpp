#include "primitives/elementwise/elementwise.h"

#include <cmath>

#include "backend/cpu/util.h"

namespace bb {

namespace {
void check_pair(const char* op, const Tensor& a, const Tensor& b) {
  check_float(a, op, "a");
  check_float(b, op, "b");
  BB_CHECK(a.numel() == b.numel(), op, ": sizes differ: ", a.str(), " vs ", b.str());
  BB_CHECK(a.device().is_cpu() && b.device().is_cpu(), op, ": not implemented on ",
           a.device().str(), " yet");
}
}  // namespace

void add_inplace(Tensor& a, const Tensor& b) { axpy_inplace(a, 1.0f, b); }

void axpy_inplace(Tensor& a, float s, const Tensor& b) {
  check_pair("axpy_inplace", a, b);
  check_dtype(a, DType::f32, "axpy_inplace", "a");
  Tensor bf = cpu::as_f32(b);
  float* pa = a.data<float>();
  const float* pb = bf.data<float>();
  for (int64_t i = 0; i < a.numel(); ++i) pa[i] += s * pb[i];
}

Tensor add(const Tensor& a, const Tensor& b, MemCategory cat) {
  check_pair("add", a, b);
  Tensor out = cpu::as_f32(a).clone(cat);
  add_inplace(out, b);
  return out;
}

Tensor scale_rows(const Tensor& x, const Tensor& g, MemCategory cat) {
  check_float(x, "scale_rows", "x");
  BB_CHECK(x.dim() == 2, "scale_rows: x must be [T, H], got ", shape_str(x.shape()));
  BB_CHECK(g.numel() == x.size(0), "scale_rows: gate has ", g.numel(), " entries for ", x.size(0),
           " rows");
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
  Tensor out = cpu::as_f32(x).clone(cat);
  float* o = out.data<float>();
  for (int64_t i = 0; i < out.numel(); ++i) o[i] = 1.0f / (1.0f + std::exp(-o[i]));
  return out;
}

}  // namespace bb
