#include "backend/cpu/util.h"

#include <cstring>

namespace bb::cpu {

Tensor as_f32(const Tensor& t) {
  check_float(t, "as_f32", "t");
  BB_CHECK(t.device().is_cpu(), "as_f32: expected a CPU tensor, got ", t.str());
  if (t.dtype() == DType::f32) return t;
  return t.to_dtype(DType::f32, MemCategory::workspace);
}

void store_f32(Tensor& dst, const Tensor& src) {
  check_dtype(src, DType::f32, "store_f32", "src");
  BB_CHECK(dst.numel() == src.numel(), "store_f32: ", src.str(), " into ", dst.str());
  if (dst.raw() == src.raw()) return;
  const float* s = src.data<float>();
  const int64_t n = src.numel();
  switch (dst.dtype()) {
    case DType::f32: if (n) std::memcpy(dst.raw(), s, static_cast<size_t>(n) * 4); break;
    case DType::bf16: { uint16_t* d = dst.data<uint16_t>(); for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]); break; }
    case DType::f16: { uint16_t* d = dst.data<uint16_t>(); for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(s[i]); break; }
    default: BB_FAIL("store_f32: destination ", dst.str(), " is not a float tensor");
  }
}

Tensor empty_f32(const Shape& shape, MemCategory cat) {
  return Tensor::empty(shape, DType::f32, Device::cpu(), cat);
}

}  // namespace bb::cpu
