// checked.h — overflow-checked int64 arithmetic for sizes that come from input.
//
// Shapes, model dimensions and counts read from files (safetensors headers, config.json,
// checkpoints) are multiplied into element counts, byte sizes and parameter totals. Signed
// overflow there is undefined behaviour and, in practice, wraps into a small or negative size
// that passes later checks and under-allocates. These helpers throw bb::Error naming `what`
// instead; they cost a compare per operation and belong at the boundary, not in kernels.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "core/error.h"

namespace bb {

// a * b; throws "<what>: a * b overflows int64".
template <class... What>
int64_t checked_mul(int64_t a, int64_t b, const What&... what) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    BB_FAIL(what..., ": ", a, " * ", b, " overflows a 64-bit integer");
  return r;
}

// a + b; throws "<what>: a + b overflows int64".
template <class... What>
int64_t checked_add(int64_t a, int64_t b, const What&... what) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    BB_FAIL(what..., ": ", a, " + ", b, " overflows a 64-bit integer");
  return r;
}

// The product of `factors`, checked at every step.
template <class... What>
int64_t checked_product(std::initializer_list<int64_t> factors, const What&... what) {
  int64_t r = 1;
  for (int64_t f : factors) r = checked_mul(r, f, what...);
  return r;
}

}  // namespace bb
