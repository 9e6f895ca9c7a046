// causal_conv1d_ref.h — CPU reference of the depthwise causal 1-d convolution of Gated DeltaNet
// layers (templated over the scalar type for finite-difference checks).
//
// Channel c of token t of a sequence starting at token s (packed batches: never across a
// sequence boundary; positions before s count as zero):
//   pre[t, c] = sum_{j=0}^{W-1} w[c, j] x[t - (W-1) + j, c]       (w[c, W-1] weighs x[t])
//   y[t, c]   = silu(pre) when `silu`, else pre
// This is PyTorch's Conv1d(C, C, W, groups=C, padding=W-1) cut to the sequence length.
// Backward (x's gradient written, w's accumulated):
//   dpre = dy * silu'(pre)     silu'(p) = s (1 + p (1 - s)), s = sigmoid(p)
//   dx[t - (W-1) + j, c] += w[c, j] dpre[t, c];   dw[c, j] += dpre[t, c] x[t - (W-1) + j, c]
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace bb::ref {

template <class T>
T conv1d_pre(const T* x, const T* w, int64_t t, int64_t start, int64_t c, int64_t C, int64_t W) {
  T acc = 0;
  for (int64_t j = 0; j < W; ++j) {
    const int64_t src = t - (W - 1) + j;
    if (src >= start) acc += w[c * W + j] * x[src * C + c];
  }
  return acc;
}

// y [T, C] written; x [T, C]; w [C, W]; cu [n + 1].
template <class T>
void causal_conv1d_forward(T* y, const T* x, const T* w, const int32_t* cu, int64_t nseq, int64_t C, int64_t W,
                           bool silu) {
  for (int64_t n = 0; n < nseq; ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t)
      for (int64_t c = 0; c < C; ++c) {
        const T p = conv1d_pre(x, w, t, cu[n], c, C, W);
        y[t * C + c] = silu ? p / (T(1) + std::exp(-p)) : p;
      }
}

// dx [T, C] written, dw [C, W] accumulated.
template <class T>
void causal_conv1d_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, const int32_t* cu, int64_t nseq,
                            int64_t C, int64_t W, bool silu) {
  for (int64_t i = 0; i < cu[nseq] * C; ++i) dx[i] = T(0);
  for (int64_t n = 0; n < nseq; ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t)
      for (int64_t c = 0; c < C; ++c) {
        T dp = dy[t * C + c];
        if (silu) {
          const T p = conv1d_pre(x, w, t, cu[n], c, C, W);
          const T s = T(1) / (T(1) + std::exp(-p));
          dp *= s * (T(1) + p * (T(1) - s));
        }
        for (int64_t j = 0; j < W; ++j) {
          const int64_t src = t - (W - 1) + j;
          if (src < cu[n]) continue;
          dx[src * C + c] += w[c * W + j] * dp;
          dw[c * W + j] += dp * x[src * C + c];
        }
      }
}

}  // namespace bb::ref
