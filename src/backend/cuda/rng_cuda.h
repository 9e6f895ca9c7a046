// rng_cuda.h — device-side Philox fills (host API).
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace bb::cuda {
// normal: p[i] = a + b * N(0,1); uniform: p[i] = a + (b - a) * U(0,1]; counter offset + i.
void fill_random(void* p, DType dt, int64_t n, uint64_t seed, uint64_t offset, float a, float b, bool normal);
}  // namespace bb::cuda
