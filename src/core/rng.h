// rng.h — counter-based random numbers (Philox4x32-10).
//
// A (seed, offset) pair names a stream; element i of a fill uses counter (offset + i), so the
// numbers do not depend on the order in which elements are produced: a CPU loop and a GPU kernel
// that uses the same functions produce the same values. The round functions are host+device.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/tensor.h"

#if defined(__CUDACC__)
#define BB_HD __host__ __device__ __forceinline__
#else
#define BB_HD inline
#endif

namespace bb {

struct Philox4 {
  uint32_t v[4];
};

BB_HD Philox4 philox4x32_10(uint64_t seed, uint64_t counter) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return {{c0, c1, c2, c3}};
}

// Uniform in (0, 1]: never 0, so log() is safe.
BB_HD float uint_to_unit(uint32_t x) { return (static_cast<float>(x >> 8) + 1.0f) * (1.0f / 16777216.0f); }

BB_HD float philox_uniform(uint64_t seed, uint64_t counter) {
  return uint_to_unit(philox4x32_10(seed, counter).v[0]);
}

// Standard normal via Box-Muller on the first two words of the block.
BB_HD float philox_normal(uint64_t seed, uint64_t counter) {
  const Philox4 r = philox4x32_10(seed, counter);
  const float u1 = uint_to_unit(r.v[0]), u2 = uint_to_unit(r.v[1]);
  return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853071795864f * u2);
}

// Fills a float tensor (f32/bf16/f16, any device) with U(lo, hi) / N(mean, std) using counters
// offset .. offset + numel - 1.
void fill_uniform(Tensor& t, uint64_t seed, uint64_t offset, float lo = 0.0f, float hi = 1.0f);
void fill_normal(Tensor& t, uint64_t seed, uint64_t offset, float mean = 0.0f, float std = 1.0f);

}  // namespace bb
