// dtype.h — element types and the bf16/f16 <-> f32 conversions.
//
// bf16 is the upper half of an IEEE f32; conversion from f32 rounds to nearest, ties to even,
// and keeps NaN a (quiet) NaN. f16 is IEEE half; conversion rounds to nearest even too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace bb {

// i16: a 16-bit signed integer (the low half of a split fp32 master, optim/adamw.h).
enum class DType : uint8_t { f32, bf16, f16, i32, i64, u8, boolean, i16 };

size_t dtype_size(DType dt);
const char* dtype_name(DType dt);
// Parses "f32", "float32", "bf16", "bfloat16", ... Throws bb::Error for unknown names.
DType dtype_from_name(const std::string& name);
inline bool is_floating(DType dt) { return dt == DType::f32 || dt == DType::bf16 || dt == DType::f16; }

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN, sign kept
  }
  // Round to nearest even: add 0x7fff plus the lowest kept bit.
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

// Rounds an f32 to the nearest bf16-representable f32.
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace bb
