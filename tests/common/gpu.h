// gpu.h — GPU test helpers: skip with the reason when no GPU (or no CUDA build), tolerances.
#pragma once

#include <gtest/gtest.h>

#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

#include <cstdlib>

namespace bb::test {

// Every GPU test binary poisons fresh device memory (NaN bytes) so an unwritten output fails.
#ifdef BB_WITH_CUDA
inline const bool kPoisonAllocations = (cuda::set_poison_allocations(true), true);
#endif

// Tolerances of GPU-vs-CPU-reference checks (DESIGN.md sec. 10): relative L2 error.
constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32 = 1e-4;

}  // namespace bb::test

#ifdef BB_WITH_CUDA
#define BB_REQUIRE_GPU()                                                                       \
  do {                                                                                         \
    if (::bb::cuda::device_count() == 0)                                                       \
      GTEST_SKIP() << "no usable CUDA device: " << ::bb::cuda::unavailable_reason();           \
  } while (0)
#else
#define BB_REQUIRE_GPU() GTEST_SKIP() << "this build has no CUDA backend (BUMBLEBEE_CUDA=OFF or no toolkit)"
#endif
