// moment_rounding.h — how `adamw_bf16_moments` stores its fp32-computed moments in bf16:
// stochastic rounding with random bits from a counter-based generator (Philox4x32-10), so the
// result depends only on (seed, tensor, step, element) — not on the order of the work, the
// device, or how the tensor is cut into shards and buckets. Host and device share these inline
// functions, so the CPU reference and the CUDA kernel draw the same bits and round the same way.
//
// Stream: key = moment_rounding_key(seed, stream, step) (the state passes the run's seed and a
// hash of the unit's name as `stream`). Element e of the tensor takes 32-bit word (e mod 4) of
// the Philox block at counter floor(e / 4) — four elements per block — and uses its low 16 bits
// for exp_avg, its high 16 bits for exp_avg_sq.
//
// Rounding: with r uniform in [0, 2^16), bf16(x) = upper half of (bits(x) + r). The magnitude
// rounds up with probability (dropped 16 bits) / 2^16, so E[bf16(x)] = x exactly (the sign bit
// is never touched); a value that is bf16 already is unchanged; Inf stays Inf and NaN a quiet
// NaN; a finite value above the largest bf16 may round up to Inf (the non-finite flag sees it).
// skills/optimizer-adamw.md gives the error formulas that chose this over round-to-nearest.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/rng.h"

namespace bb {

BB_HD uint32_t moment_float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

// f32 -> bf16 bits, rounded stochastically with the 16 random bits `r` (bits above 16 ignored).
BB_HD uint16_t f32_to_bf16_stochastic(float x, uint32_t r) {
  const uint32_t u = moment_float_bits(x);
  if ((u & 0x7f800000u) == 0x7f800000u)  // Inf stays Inf; NaN stays a quiet NaN (sign kept)
    return static_cast<uint16_t>((u & 0x007fffffu) ? ((u >> 16) | 0x0040u) : (u >> 16));
  return static_cast<uint16_t>((u + (r & 0xffffu)) >> 16);
}

// True when bf16 bits `h` are Inf or NaN.
BB_HD bool bf16_bits_nonfinite(uint16_t h) { return (h & 0x7f80u) == 0x7f80u; }

// The 32 random bits of element e (low half: exp_avg, high half: exp_avg_sq).
BB_HD uint32_t moment_rounding_word(uint64_t key, uint64_t e) {
  return philox4x32_10(key, e >> 2).v[e & 3];
}

// splitmix64's finalizer: a bijective 64-bit mix.
BB_HD uint64_t moment_mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The Philox key of one tensor's roundings at one (1-based) step.
BB_HD uint64_t moment_rounding_key(uint64_t seed, uint64_t stream, int64_t step) {
  return moment_mix64(moment_mix64(moment_mix64(seed) ^ stream) ^ static_cast<uint64_t>(step));
}

// A stable 64-bit id of a name (FNV-1a), for `stream`.
inline uint64_t moment_stream_id(const char* name, size_t len) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < len; ++i) h = (h ^ static_cast<unsigned char>(name[i])) * 0x100000001b3ull;
  return h;
}

}  // namespace bb
