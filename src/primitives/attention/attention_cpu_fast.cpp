// attention_cpu_fast.cpp — blocked f32 GQA attention on the CPU: GEMM tiles + f32 softmax.
//
// Backward convention: dq, dk, dv are activation gradients, WRITTEN (=). See the header for the
// tiling; the formulas are those of attention_ref.h.
#include "primitives/attention/attention_cpu_fast.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "backend/cpu/gemm.h"

namespace bb::cpu {

namespace {

// exp(x) in plain f32 arithmetic (Cephes expf: round to a power of two, degree-6 polynomial on
// the remainder; < 1 ulp against double exp on [-87, 88]). libm's expf is an opaque scalar call
// without -ffast-math, and the softmax exp is the only non-GEMM work left; this form
// vectorizes. Needs x in [-87, 88] so that 2^n is a normal float: see exp_shift_sum.
inline float exp_f32_in_range(float x) {
  // Adding then subtracting 1.5 * 2^23 rounds to the nearest integer without a libm call.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  // 2^n from the bits of n + 1.5 * 2^23 (n is integral here): no float -> int conversion, so a
  // NaN argument propagates without undefined behaviour.
  const int32_t ni = std::bit_cast<int32_t>(n + 12582912.0f) - 0x4B400000;
  return y * std::bit_cast<float>((ni + 127) << 23);
}

constexpr int kLanes = 8;  // independent partial sums: lets the loop vectorize and adds accuracy

// row[j] = exp(row[j] - shift) for j < n; returns the sum of the new values.
// Arguments are s - max or s - lse, so <= ~0; clamping at -87 turns an underflow into
// exp(-87) ~ 1.6e-38, which is nothing next to the row's largest term (~1). The clamp is its own
// pass because GCC (with the default -ftrapping-math) will not vectorize a loop that has both
// the clamp and the float -> int conversion.
inline float exp_shift_sum(float* row, int64_t n, float shift) {
  for (int64_t j = 0; j < n; ++j) {
    const float x = row[j] - shift;
    row[j] = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  }
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float e = exp_f32_in_range(row[j + l]);
      row[j + l] = e;
      acc[l] += e;
    }
  for (; j < n; ++j) {
    row[j] = exp_f32_in_range(row[j]);
    acc[0] += row[j];
  }
  double sum = 0;
  for (float a : acc) sum += a;
  return static_cast<float>(sum);
}

inline float row_max(const float* row, int64_t n) {
  float m[kLanes];
  std::fill(m, m + kLanes, -INFINITY);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) m[l] = row[j + l] > m[l] ? row[j + l] : m[l];
  for (; j < n; ++j) m[0] = row[j] > m[0] ? row[j] : m[0];
  return *std::max_element(m, m + kLanes);
}

// The library is built for baseline x86-64 (SSE2, 4 floats). The element-wise tile work (about
// a quarter of the time; the rest is GEMM) gets an AVX2 clone, picked at load time from the CPU
// features, which doubles its vector width where AVX2 exists.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BB_ATTN_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define BB_ATTN_SIMD_CLONES
#endif

// Row r of a tile sees the block-relative keys [0, n(r)), n(r) = min(n0 + step * r, nc): step 1
// for the causal masks (one more key per row), 0 for none.
inline int64_t row_keys(int64_t n0, int64_t step, int64_t r, int64_t nc) {
  return std::min(n0 + step * r, nc);
}

// Forward tile s [nb, nc]: row r holds the scaled scores of query r0 + r (keys 0..nc-1). Each row
// becomes its softmax over its visible keys (the rest zeroed); lse_blk[r] = its log-sum-exp
// unless lse_blk is null (-inf for a row that sees no key; its P row is all zero).
BB_ATTN_SIMD_CLONES void softmax_tile(float* s, int64_t nb, int64_t nc, int64_t n0, int64_t step,
                                      float* lse_blk) {
  for (int64_t r = 0; r < nb; ++r) {
    float* row = s + r * nc;
    const int64_t n = row_keys(n0, step, r, nc);
    if (n == 0) {
      std::fill(row, row + nc, 0.0f);
      if (lse_blk) lse_blk[r] = -INFINITY;
      continue;
    }
    const float m = row_max(row, n);  // subtracting the max keeps exp() in range
    const float l = exp_shift_sum(row, n, m);
    const float inv = 1.0f / l;
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
    std::fill(row + n, row + nc, 0.0f);
    if (lse_blk) lse_blk[r] = m + std::log(l);
  }
}

// Backward tile: p [nb, nc] holds the scaled scores, dp [nb, nc] holds dO V^T. Rebuilds
// P = exp(S - lse) in p and writes dS = P * (dP - D_r) into dp, both zero where a row sees no key.
BB_ATTN_SIMD_CLONES void softmax_grad_tile(float* p, float* dp, int64_t nb, int64_t nc, int64_t n0,
                                           int64_t step, const float* lse_blk, const float* d_blk) {
  for (int64_t r = 0; r < nb; ++r) {
    float* p_row = p + r * nc;
    float* dp_row = dp + r * nc;
    const int64_t n = row_keys(n0, step, r, nc);
    if (n > 0) exp_shift_sum(p_row, n, lse_blk[r]);
    const float di = d_blk[r];
    for (int64_t j = 0; j < n; ++j) dp_row[j] = p_row[j] * (dp_row[j] - di);
    std::fill(p_row + n, p_row + nc, 0.0f);
    std::fill(dp_row + n, dp_row + nc, 0.0f);
  }
}

// The key columns a query block [r0, r0 + nb) of a sequence with sq queries and skv keys needs,
// and the tile's (n0, step) of row_keys.
struct BlockKeys {
  int64_t nc, n0, step;
};
inline BlockKeys block_keys(ref::RefMask mask, int64_t r0, int64_t nb, int64_t sq, int64_t skv) {
  BlockKeys b;
  b.nc = ref::visible_keys(mask, r0 + nb - 1, sq, skv);  // the last row sees the most
  b.n0 = ref::visible_keys(mask, r0, sq, skv);
  b.step = mask == ref::RefMask::none ? 0 : 1;  // (bottom-right needs skv >= sq: n0 >= 1)
  return b;
}

int64_t max_seq_len(const int32_t* cu, int64_t num_seqs) {
  int64_t m = 0;
  for (int64_t b = 0; b < num_seqs; ++b) m = std::max<int64_t>(m, cu[b + 1] - cu[b]);
  return m;
}

}  // namespace

int64_t attention_fast_workspace_floats(int64_t max_q_len, int64_t max_kv_len, int64_t block_rows) {
  const int64_t rows = std::min(block_rows, max_q_len);
  return 2 * rows * max_kv_len + rows;
}

void attention_forward_fast(float* o, float* lse, const float* q, const float* k, const float* v,
                            const int32_t* cq, const int32_t* ck, int64_t num_seqs,
                            int64_t num_q_tokens, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                            ref::RefMask mask, float* workspace, int64_t block_rows) {
  const int64_t G = Hq / Hkv, ldq = Hq * D, ldk = Hkv * D, R = block_rows;
  float* s = workspace;  // [nb, nc] score tile, then P in place
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q0 = cq[b], sq = cq[b + 1] - q0, k0 = ck[b], skv = ck[b + 1] - k0;
    for (int64_t h = 0; h < Hq; ++h) {
      const float* k_seq = k + (k0 * Hkv + h / G) * D;
      const float* v_seq = v + (k0 * Hkv + h / G) * D;
      for (int64_t r0 = 0; r0 < sq; r0 += R) {
        const int64_t nb = std::min(R, sq - r0);
        const BlockKeys bk = block_keys(mask, r0, nb, sq, skv);
        float* o_blk = o + ((q0 + r0) * Hq + h) * D;
        float* lse_blk = lse ? lse + h * num_q_tokens + q0 + r0 : nullptr;
        if (bk.nc == 0) {  // no row of the block sees a key: o = 0, lse = -inf
          for (int64_t r = 0; r < nb; ++r) std::fill(o_blk + r * ldq, o_blk + r * ldq + D, 0.0f);
          if (lse_blk) std::fill(lse_blk, lse_blk + nb, -INFINITY);
          continue;
        }
        const float* q_blk = q + ((q0 + r0) * Hq + h) * D;
        gemm<float>(false, true, nb, bk.nc, D, scale, q_blk, ldq, k_seq, ldk, 0.0f, s, bk.nc);
        softmax_tile(s, nb, bk.nc, bk.n0, bk.step, lse_blk);
        gemm<float>(false, false, nb, D, bk.nc, 1.0f, s, bk.nc, v_seq, ldk, 0.0f, o_blk, ldq);
      }
    }
  }
}

void attention_backward_fast(float* dq, float* dk, float* dv, const float* d_o, const float* q,
                             const float* k, const float* v, const float* o, const float* lse,
                             const int32_t* cq, const int32_t* ck, int64_t num_seqs,
                             int64_t num_q_tokens, int64_t num_kv_tokens, int64_t Hq, int64_t Hkv,
                             int64_t D, float scale, ref::RefMask mask, float* workspace,
                             int64_t block_rows) {
  const int64_t G = Hq / Hkv, ldq = Hq * D, ldk = Hkv * D, R = block_rows;
  const int64_t max_kv = max_seq_len(ck, num_seqs);
  const int64_t rows = std::min(R, max_seq_len(cq, num_seqs));
  float* p = workspace;               // [nb, nc]: S, then P
  float* dp = p + rows * max_kv;      // [nb, nc]: dP, then dS
  float* d_row = dp + rows * max_kv;  // [nb]: D_i = dO_i . o_i
  // dk, dv are sums over query heads and blocks, built with beta = 1 GEMMs.
  if (num_kv_tokens > 0) {
    std::memset(dk, 0, static_cast<size_t>(num_kv_tokens * ldk) * sizeof(float));
    std::memset(dv, 0, static_cast<size_t>(num_kv_tokens * ldk) * sizeof(float));
  }
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q0 = cq[b], sq = cq[b + 1] - q0, k0 = ck[b], skv = ck[b + 1] - k0;
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t kv_off = (k0 * Hkv + h / G) * D;
      const float* k_seq = k + kv_off;
      const float* v_seq = v + kv_off;
      for (int64_t r0 = 0; r0 < sq; r0 += R) {
        const int64_t nb = std::min(R, sq - r0);
        const BlockKeys bk = block_keys(mask, r0, nb, sq, skv);
        const int64_t q_off = ((q0 + r0) * Hq + h) * D;
        if (bk.nc == 0) {  // the block sees no key: no gradient flows through it
          for (int64_t r = 0; r < nb; ++r)
            std::fill(dq + q_off + r * ldq, dq + q_off + r * ldq + D, 0.0f);
          continue;
        }
        const int64_t nc = bk.nc;
        const float* q_blk = q + q_off;
        const float* do_blk = d_o + q_off;
        for (int64_t r = 0; r < nb; ++r) {
          const float* x = do_blk + r * ldq;
          const float* y = o + q_off + r * ldq;
          double acc = 0;
          for (int64_t d = 0; d < D; ++d) acc += static_cast<double>(x[d]) * y[d];
          d_row[r] = static_cast<float>(acc);
        }
        gemm<float>(false, true, nb, nc, D, scale, q_blk, ldq, k_seq, ldk, 0.0f, p, nc);
        gemm<float>(false, true, nb, nc, D, 1.0f, do_blk, ldq, v_seq, ldk, 0.0f, dp, nc);
        softmax_grad_tile(p, dp, nb, nc, bk.n0, bk.step, lse + h * num_q_tokens + q0 + r0, d_row);
        gemm<float>(false, false, nb, D, nc, scale, dp, nc, k_seq, ldk, 0.0f, dq + q_off, ldq);
        gemm<float>(true, false, nc, D, nb, scale, dp, nc, q_blk, ldq, 1.0f, dk + kv_off, ldk);
        gemm<float>(true, false, nc, D, nb, 1.0f, p, nc, do_blk, ldq, 1.0f, dv + kv_off, ldk);
      }
    }
  }
}

}  // namespace bb::cpu
