// embedding_ref.h — CPU reference for the token embedding lookup.
//   y[t, :] = table[ids[t], :]          d_table[ids[t], :] += d_y[t, :]
#pragma once

#include <cstdint>

namespace bb::ref {

template <class T>
void embedding_forward(T* y, const int32_t* ids, const T* table, int64_t tokens, int64_t H) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < H; ++h) y[t * H + h] = table[static_cast<int64_t>(ids[t]) * H + h];
}

template <class T>
void embedding_backward(T* d_table, const int32_t* ids, const T* d_y, int64_t tokens, int64_t H) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < H; ++h) d_table[static_cast<int64_t>(ids[t]) * H + h] += d_y[t * H + h];
}

}  // namespace bb::ref
