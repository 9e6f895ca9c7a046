// cp_ops.cpp — checks, then CPU loops or the CUDA kernels (cp_ops_cuda.h).
#include "primitives/attention/cp_ops.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cpu/util.h"
#include "primitives/attention/cp_ops_cuda.h"

namespace bb::cp {
namespace {

int64_t row_elems(const Tensor& t) { return t.size(0) == 0 ? 0 : t.numel() / t.size(0); }

void check_rows(const std::vector<int64_t>& rows, int64_t T, const char* op) {
  for (int64_t r : rows) BB_CHECK(r >= 0 && r < T, op, ": row ", r, " outside [0, ", T, ")");
}

void check_cuda_build(const Tensor& t, const char* op) {
#ifndef BB_WITH_CUDA
  BB_CHECK(!t.device().is_cuda(), op, ": not implemented on ", t.device().str(), " in this build (no CUDA backend)");
#else
  (void)t;
  (void)op;
#endif
}

#ifdef BB_WITH_CUDA
Tensor device_i32(const std::vector<int64_t>& v, Device dev) {
  std::vector<int32_t> w(v.begin(), v.end());
  return Tensor::from_ints(w, {static_cast<int64_t>(w.size())}, MemCategory::workspace).to(dev, MemCategory::workspace);
}
#endif

float lse_add(float a, float b) {
  if (a == -std::numeric_limits<float>::infinity()) return b;
  if (b == -std::numeric_limits<float>::infinity()) return a;
  const float m = std::max(a, b);
  return m + std::log(std::exp(a - m) + std::exp(b - m));
}

}  // namespace

Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& rows, MemCategory cat) {
  check_defined(src, "cp::gather_rows", "src");
  check_cuda_build(src, "cp::gather_rows");
  check_rows(rows, src.size(0), "cp::gather_rows");
  Shape shape = src.shape();
  shape[0] = static_cast<int64_t>(rows.size());
  Tensor out = Tensor::empty(shape, src.dtype(), src.device(), cat);
  const int64_t W = row_elems(src);
  const size_t eb = dtype_size(src.dtype());
  if (rows.empty() || W == 0) return out;
  if (src.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    BB_CHECK(eb == 2 || eb == 4, "cp::gather_rows: element size ", eb, " on the GPU (2 or 4 bytes)");
    Tensor r = device_i32(rows, src.device());
    cuda::cp::gather_rows(out.raw(), src.raw(), r.data<int32_t>(), static_cast<int64_t>(rows.size()), W,
                          static_cast<int>(eb));
#endif
    return out;
  }
  const auto* s = static_cast<const char*>(src.raw());
  auto* o = static_cast<char*>(out.raw());
  const size_t rb = static_cast<size_t>(W) * eb;
  for (size_t i = 0; i < rows.size(); ++i) std::memcpy(o + i * rb, s + static_cast<size_t>(rows[i]) * rb, rb);
  return out;
}

void scatter_add_rows(Tensor& dst, const Tensor& src, const std::vector<int64_t>& rows) {
  check_dtype(dst, DType::f32, "cp::scatter_add_rows", "dst");
  check_float(src, "cp::scatter_add_rows", "src");
  check_same_device(dst, src, "cp::scatter_add_rows");
  check_cuda_build(dst, "cp::scatter_add_rows");
  BB_CHECK(src.size(0) == static_cast<int64_t>(rows.size()) && row_elems(src) == row_elems(dst),
           "cp::scatter_add_rows: src ", src.str(), " does not match ", rows.size(), " rows of dst ", dst.str());
  check_rows(rows, dst.size(0), "cp::scatter_add_rows");
  const int64_t W = row_elems(dst);
  if (rows.empty() || W == 0) return;
  if (dst.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    Tensor r = device_i32(rows, dst.device());
    cuda::cp::scatter_add_rows(dst.data<float>(), src.raw(), src.dtype(), r.data<int32_t>(),
                               static_cast<int64_t>(rows.size()), W);
#endif
    return;
  }
  Tensor s32 = cpu::as_f32(src);
  const float* s = s32.data<float>();
  float* d = dst.data<float>();
  for (size_t i = 0; i < rows.size(); ++i) {
    float* dr = d + rows[i] * W;
    const float* sr = s + static_cast<int64_t>(i) * W;
    for (int64_t j = 0; j < W; ++j) dr[j] += sr[j];
  }
}

Tensor gather_cols(const Tensor& lse, const std::vector<int64_t>& rows, MemCategory cat) {
  check_dtype(lse, DType::f32, "cp::gather_cols", "lse");
  check_cuda_build(lse, "cp::gather_cols");
  BB_CHECK(lse.dim() == 2, "cp::gather_cols: lse must be [H, T], got ", lse.str());
  const int64_t H = lse.size(0), T = lse.size(1), n = static_cast<int64_t>(rows.size());
  check_rows(rows, T, "cp::gather_cols");
  Tensor out = Tensor::empty({H, n}, DType::f32, lse.device(), cat);
  if (n == 0 || H == 0) return out;
  if (lse.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    Tensor r = device_i32(rows, lse.device());
    cuda::cp::gather_cols(out.data<float>(), lse.data<float>(), r.data<int32_t>(), H, T, n);
#endif
    return out;
  }
  const float* l = lse.data<float>();
  float* o = out.data<float>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i) o[h * n + i] = l[h * T + rows[static_cast<size_t>(i)]];
  return out;
}

void merge_partial(Tensor& o_acc, Tensor& lse_acc, const Tensor& o_p, const Tensor& lse_p,
                   const std::vector<int64_t>& rows) {
  const char* op = "cp::merge_partial";
  check_dtype(o_acc, DType::f32, op, "o_acc");
  check_dtype(lse_acc, DType::f32, op, "lse_acc");
  check_dtype(lse_p, DType::f32, op, "lse_p");
  check_float(o_p, op, "o_p");
  check_same_device(o_acc, o_p, op);
  check_cuda_build(o_acc, op);
  BB_CHECK(o_acc.dim() == 3 && o_p.dim() == 3, op, ": o_acc and o_p must be [T, H, D]");
  const int64_t T = o_acc.size(0), H = o_acc.size(1), D = o_acc.size(2), n = static_cast<int64_t>(rows.size());
  check_shape(o_p, {n, H, D}, op, "o_p");
  check_shape(lse_acc, {H, T}, op, "lse_acc");
  check_shape(lse_p, {H, n}, op, "lse_p");
  check_rows(rows, T, op);
  if (n == 0) return;
  if (o_acc.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    Tensor r = device_i32(rows, o_acc.device());
    cuda::cp::merge_partial(o_acc.data<float>(), lse_acc.data<float>(), o_p.raw(), o_p.dtype(), lse_p.data<float>(),
                            r.data<int32_t>(), n, T, H, D);
#endif
    return;
  }
  Tensor p32 = cpu::as_f32(o_p);
  const float* p = p32.data<float>();
  const float* lp = lse_p.data<float>();
  float* a = o_acc.data<float>();
  float* la = lse_acc.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = rows[static_cast<size_t>(i)];
    for (int64_t h = 0; h < H; ++h) {
      const float l1 = la[h * T + r], l2 = lp[h * n + i];
      const float m = lse_add(l1, l2);
      if (m == -std::numeric_limits<float>::infinity()) continue;  // neither has seen a key
      const float w1 = std::exp(l1 - m), w2 = std::exp(l2 - m);
      float* ar = a + (r * H + h) * D;
      const float* pr = p + (i * H + h) * D;
      for (int64_t d = 0; d < D; ++d) ar[d] = w1 * ar[d] + w2 * pr[d];
      la[h * T + r] = m;
    }
  }
}

Tensor split_heads(const Tensor& src, const std::vector<int64_t>& start, int64_t hc, MemCategory cat) {
  const char* op = "cp::split_heads";
  check_defined(src, op, "src");
  check_cuda_build(src, op);
  BB_CHECK(src.dim() == 3, op, ": src must be [T, H, D], got ", src.str());
  const int64_t T = src.size(0), H = src.size(1), D = src.size(2), P = static_cast<int64_t>(start.size());
  for (int64_t s : start) BB_CHECK(s >= 0 && s + hc <= H, op, ": heads [", s, ", ", s + hc, ") outside [0, ", H, ")");
  Tensor out = Tensor::empty({P * T, hc, D}, src.dtype(), src.device(), cat);
  const size_t eb = dtype_size(src.dtype());
  if (out.numel() == 0) return out;
  if (src.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    Tensor st = device_i32(start, src.device());
    cuda::cp::split_heads(out.raw(), src.raw(), static_cast<int>(eb), st.data<int32_t>(), P, T, H, hc, D);
#endif
    return out;
  }
  const auto* s = static_cast<const char*>(src.raw());
  auto* o = static_cast<char*>(out.raw());
  const size_t blk = static_cast<size_t>(hc * D) * eb;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(o + static_cast<size_t>(p * T + t) * blk,
                  s + (static_cast<size_t>(t * H + start[static_cast<size_t>(p)]) * D) * eb, blk);
  return out;
}

void join_heads(Tensor& dst, const Tensor& src, const std::vector<int64_t>& start, int64_t hc, bool accumulate) {
  const char* op = "cp::join_heads";
  check_defined(dst, op, "dst");
  check_defined(src, op, "src");
  check_same_device(dst, src, op);
  check_cuda_build(dst, op);
  BB_CHECK(dst.dim() == 3, op, ": dst must be [T, H, D], got ", dst.str());
  const int64_t T = dst.size(0), H = dst.size(1), D = dst.size(2), P = static_cast<int64_t>(start.size());
  check_shape(src, {P * T, hc, D}, op, "src");
  if (accumulate) {
    check_dtype(dst, DType::f32, op, "dst");
    check_float(src, op, "src");
  } else {
    BB_CHECK(dst.dtype() == src.dtype(), op, ": dst ", dst.str(), " and src ", src.str(), " differ in dtype");
  }
  for (int64_t s : start) BB_CHECK(s >= 0 && s + hc <= H, op, ": heads [", s, ", ", s + hc, ") outside [0, ", H, ")");
  if (src.numel() == 0) return;
  const size_t eb = dtype_size(src.dtype());
  if (dst.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    if (accumulate) {  // one peer at a time: overlapping head ranges never race
      for (int64_t p = 0; p < P; ++p)
        cuda::cp::join_heads_add(dst.data<float>(), static_cast<const char*>(src.raw()) + static_cast<size_t>(p * T * hc * D) * eb,
                                 src.dtype(), start[static_cast<size_t>(p)], T, H, hc, D);
    } else {
      Tensor st = device_i32(start, dst.device());
      cuda::cp::join_heads(dst.raw(), src.raw(), static_cast<int>(eb), st.data<int32_t>(), P, T, H, hc, D);
    }
#endif
    return;
  }
  if (!accumulate) {
    const auto* s = static_cast<const char*>(src.raw());
    auto* d = static_cast<char*>(dst.raw());
    const size_t blk = static_cast<size_t>(hc * D) * eb;
    for (int64_t p = 0; p < P; ++p)
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(d + (static_cast<size_t>(t * H + start[static_cast<size_t>(p)]) * D) * eb,
                    s + static_cast<size_t>(p * T + t) * blk, blk);
    return;
  }
  Tensor s32 = cpu::as_f32(src);
  const float* s = s32.data<float>();
  float* d = dst.data<float>();
  for (int64_t p = 0; p < P; ++p)
    for (int64_t t = 0; t < T; ++t) {
      float* dr = d + (t * H + start[static_cast<size_t>(p)]) * D;
      const float* sr = s + (p * T + t) * hc * D;
      for (int64_t j = 0; j < hc * D; ++j) dr[j] += sr[j];
    }
}

}  // namespace bb::cp
