// RMSNorm and per-head QK norm: finite differences, bf16 storage, bad input.
#include <gtest/gtest.h>

#include "common/testing.h"
#include "primitives/norm/rmsnorm.h"
#include "primitives/norm/rmsnorm_ref.h"

namespace bb {
namespace {

using test::randn;

TEST(RMSNorm, ForwardMatchesDoubleAndBackwardMatchesFD) {
  const int64_t T = 6, H = 11;
  const double eps = 1e-5;
  auto xv = randn(T * H, 1), wv = test::randu(H, 2, 0.5f, 1.5f), dyv = randn(T * H, 3);
  Tensor x = Tensor::from_floats(xv, {T, H}), w = Tensor::from_floats(wv, {H});
  RMSNormSaved saved;
  Tensor y = rmsnorm_forward(x, w, eps, &saved);
  EXPECT_EQ(saved.rstd.category(), MemCategory::activations);
  auto X = test::cast<double>(xv), W = test::cast<double>(wv);
  std::vector<double> yd(T * H), rd(T);
  ref::rmsnorm_forward<double>(yd.data(), rd.data(), X.data(), W.data(), T, H, eps);
  EXPECT_LT(test::rel_error(y.to_floats(), yd), 1e-6);

  Tensor dw = Tensor::zeros({H}, DType::f32, Device::cpu(), MemCategory::grads);
  Tensor dx = rmsnorm_backward(Tensor::from_floats(dyv, {T, H}), x, w, saved, dw);
  const auto wt = test::cast<double>(dyv);
  auto f = [&](const std::vector<double>& xx, const std::vector<double>& ww) {
    std::vector<double> yy(T * H), rr(T);
    ref::rmsnorm_forward<double>(yy.data(), rr.data(), xx.data(), ww.data(), T, H, eps);
    return test::weighted_sum(yy, wt);
  };
  auto gx = test::finite_diff([&](const std::vector<double>& v) { return f(v, W); }, X);
  auto gw = test::finite_diff([&](const std::vector<double>& v) { return f(X, v); }, W);
  EXPECT_LT(test::rel_error(dx.to_floats(), gx), test::kGradTol);
  EXPECT_LT(test::rel_error(dw.to_floats(), gw), test::kGradTol);
}

// The skip connection's gradient added by the backward itself (the blocks' one-pass form):
// the same bits as adding it afterwards, d_w unchanged; a wrong-shaped residual is refused.
TEST(RMSNorm, ResidualIsAddingItAfterwards) {
  const int64_t T = 7, H = 12;
  Tensor x = Tensor::from_floats(randn(T * H, 11), {T, H});
  Tensor w = Tensor::from_floats(test::randu(H, 12, 0.5f, 1.5f), {H});
  Tensor dy = Tensor::from_floats(randn(T * H, 13), {T, H});
  Tensor res = Tensor::from_floats(randn(T * H, 14, 2.0f), {T, H});
  RMSNormSaved saved;
  rmsnorm_forward(x, w, 1e-6, &saved);
  Tensor dw1 = Tensor::zeros({H}, DType::f32, Device::cpu(), MemCategory::grads);
  Tensor dw2 = Tensor::zeros({H}, DType::f32, Device::cpu(), MemCategory::grads);
  Tensor plain = rmsnorm_backward(dy, x, w, saved, dw1);
  auto expect = plain.to_floats();
  const auto r = res.to_floats();
  for (size_t i = 0; i < expect.size(); ++i) expect[i] += r[i];
  Tensor fused = rmsnorm_backward(dy, x, w, saved, dw2, false, &res);
  EXPECT_EQ(fused.to_floats(), expect);
  EXPECT_EQ(dw2.to_floats(), dw1.to_floats());
  Tensor bad = Tensor::from_floats(randn(T * (H - 1), 15), {T, H - 1});
  EXPECT_THROW(rmsnorm_backward(dy, x, w, saved, dw2, false, &bad), Error);
}

// Zero-centred (Qwen3.5): y = (1 + w) x / rms(x). Equal to the classic norm with weight 1 + w,
// forward and backward; d_w is the same sum (d(1 + w)/dw = 1); and a w of zeros is the plain
// normalisation. The classic path is checked against finite differences above, so this pins
// the zero-centred one to the same truth; flipping the offset's sign fails every check.
TEST(RMSNorm, ZeroCenteredEqualsClassicWithOnePlusW) {
  const int64_t T = 5, H = 9;
  const double eps = 1e-6;
  auto xv = randn(T * H, 11), wv = randn(H, 12, 0.3f), dyv = randn(T * H, 13);
  std::vector<float> w1(wv.size());
  for (size_t i = 0; i < wv.size(); ++i) w1[i] = 1.0f + wv[i];
  Tensor x = Tensor::from_floats(xv, {T, H}), w = Tensor::from_floats(wv, {H});
  Tensor wone = Tensor::from_floats(w1, {H}), dy = Tensor::from_floats(dyv, {T, H});
  RMSNormSaved sz, sc;
  Tensor yz = rmsnorm_forward(x, w, eps, &sz, MemCategory::activations, true);
  Tensor yc = rmsnorm_forward(x, wone, eps, &sc);
  EXPECT_EQ(yz.to_floats(), yc.to_floats());
  EXPECT_EQ(w.to_floats(), wv) << "the caller's weight must not change";
  Tensor dwz = Tensor::zeros({H}, DType::f32, Device::cpu(), MemCategory::grads);
  Tensor dwc = Tensor::zeros({H}, DType::f32, Device::cpu(), MemCategory::grads);
  Tensor dxz = rmsnorm_backward(dy, x, w, sz, dwz, true);
  Tensor dxc = rmsnorm_backward(dy, x, wone, sc, dwc);
  EXPECT_EQ(dxz.to_floats(), dxc.to_floats());
  EXPECT_EQ(dwz.to_floats(), dwc.to_floats());

  Tensor zeros = Tensor::zeros({H}, DType::f32, Device::cpu(), MemCategory::params);
  Tensor yn = rmsnorm_forward(x, zeros, eps, nullptr, MemCategory::activations, true);
  std::vector<double> yd(T * H), rd(T), ones(H, 1.0);
  auto X = test::cast<double>(xv);
  ref::rmsnorm_forward<double>(yd.data(), rd.data(), X.data(), ones.data(), T, H, eps);
  EXPECT_LT(test::rel_error(yn.to_floats(), yd), 1e-6);

  // Per head (q/k norm) the flag reaches the same path.
  const int64_t n = 3, D = 3;
  Tensor xh = Tensor::from_floats(xv, {T, n, D});
  Tensor wh = Tensor::from_floats({0.1f, -0.2f, 0.3f}, {D}), wh1 = Tensor::from_floats({1.1f, 0.8f, 1.3f}, {D});
  EXPECT_EQ(qk_norm_forward(xh, wh, eps, nullptr, MemCategory::activations, true).to_floats(),
            qk_norm_forward(xh, wh1, eps, nullptr).to_floats());
}

TEST(RMSNorm, Bf16StorageWithinTolerance) {
  const int64_t T = 9, H = 64;
  auto xv = randn(T * H, 5), wv = test::randu(H, 6, 0.5f, 1.5f);
  Tensor y32 = rmsnorm_forward(Tensor::from_floats(xv, {T, H}), Tensor::from_floats(wv, {H}), 1e-6, nullptr);
  Tensor y16 = rmsnorm_forward(Tensor::from_floats(xv, {T, H}, DType::bf16),
                               Tensor::from_floats(wv, {H}, DType::bf16), 1e-6, nullptr);
  EXPECT_EQ(y16.dtype(), DType::bf16);
  EXPECT_LT(test::rel_error(y16.to_floats(), y32.to_floats()), 1e-2);
}

// d_x asked for in bf16 (the consumer's dtype) is the f32 d_x rounded once, with or without the
// residual; d_w is the same.
TEST(RMSNorm, Bf16GradIsTheF32GradRounded) {
  const int64_t T = 7, H = 48;
  Tensor x = Tensor::from_floats(randn(T * H, 11), {T, H}, DType::bf16);
  Tensor w = Tensor::from_floats(test::randu(H, 12, 0.5f, 1.5f), {H}, DType::bf16);
  Tensor dy = Tensor::from_floats(randn(T * H, 13), {T, H});
  Tensor res = Tensor::from_floats(randn(T * H, 14), {T, H});
  RMSNormSaved saved;
  rmsnorm_forward(x, w, 1e-6, &saved);
  for (const Tensor* r : std::vector<const Tensor*>{nullptr, &res}) {
    Tensor dw1 = Tensor::zeros({H}, DType::f32, Device::cpu(), MemCategory::grads);
    Tensor dw2 = Tensor::zeros({H}, DType::f32, Device::cpu(), MemCategory::grads);
    Tensor f32 = rmsnorm_backward(dy, x, w, saved, dw1, false, r);
    Tensor b16 = rmsnorm_backward(dy, x, w, saved, dw2, false, r, DType::bf16);
    ASSERT_EQ(b16.dtype(), DType::bf16);
    EXPECT_EQ(b16.category(), MemCategory::activations);
    auto fv = f32.to_floats(), bv = b16.to_floats();
    for (size_t i = 0; i < fv.size(); ++i) EXPECT_EQ(bv[i], round_bf16(fv[i]));
    EXPECT_EQ(dw2.to_floats(), dw1.to_floats());
  }
  test::expect_error_contains(
      [&] {
        Tensor dw = Tensor::zeros({H}, DType::f32, Device::cpu(), MemCategory::grads);
        rmsnorm_backward(dy, x, w, saved, dw, false, nullptr, DType::i32);
      },
      "rmsnorm_backward: d_x can be f32 or bf16, not i32");
}

TEST(QKNorm, IsRMSNormPerHead) {
  const int64_t T = 3, n = 4, D = 8;
  auto xv = randn(T * n * D, 7), wv = test::randu(D, 8, 0.5f, 1.5f), dyv = randn(T * n * D, 9);
  Tensor x = Tensor::from_floats(xv, {T, n, D}), w = Tensor::from_floats(wv, {D});
  RMSNormSaved saved;
  Tensor y = qk_norm_forward(x, w, 1e-6, &saved);
  EXPECT_EQ(y.shape(), (Shape{T, n, D}));
  // Independent check: each head vector normalised on its own.
  auto yv = y.to_floats();
  for (int64_t r = 0; r < T * n; ++r) {
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += double(xv[r * D + d]) * xv[r * D + d];
    const double rs = 1.0 / std::sqrt(ss / D + 1e-6);
    for (int64_t d = 0; d < D; ++d) EXPECT_NEAR(yv[r * D + d], wv[d] * xv[r * D + d] * rs, 1e-5);
  }
  Tensor dw = Tensor::zeros({D}, DType::f32, Device::cpu(), MemCategory::grads);
  Tensor dx = qk_norm_backward(Tensor::from_floats(dyv, {T, n, D}), x, w, saved, dw);
  auto X = test::cast<double>(xv), W = test::cast<double>(wv), wt = test::cast<double>(dyv);
  auto f = [&](const std::vector<double>& xx, const std::vector<double>& ww) {
    std::vector<double> yy(T * n * D), rr(T * n);
    ref::rmsnorm_forward<double>(yy.data(), rr.data(), xx.data(), ww.data(), T * n, D, 1e-6);
    return test::weighted_sum(yy, wt);
  };
  EXPECT_LT(test::rel_error(dx.to_floats(), test::finite_diff([&](const std::vector<double>& v) { return f(v, W); }, X)), test::kGradTol);
  EXPECT_LT(test::rel_error(dw.to_floats(), test::finite_diff([&](const std::vector<double>& v) { return f(X, v); }, W)), test::kGradTol);
}

TEST(RMSNorm, BadInput) {
  Tensor x = Tensor::zeros({2, 4}, DType::f32, Device::cpu(), MemCategory::other);
  Tensor w = Tensor::zeros({5}, DType::f32, Device::cpu(), MemCategory::other);
  test::expect_error_contains([&] { rmsnorm_forward(x, w, 1e-6, nullptr); },
                              "argument 'w' has shape [5], expected [4]");
  Tensor w4 = Tensor::zeros({4}, DType::f32, Device::cpu(), MemCategory::other);
  test::expect_error_contains([&] { rmsnorm_forward(x, w4, 0.0, nullptr); }, "eps must be positive");
  Tensor xi = Tensor::zeros({2, 4}, DType::i64, Device::cpu(), MemCategory::other);
  test::expect_error_contains([&] { rmsnorm_forward(xi, w4, 1e-6, nullptr); }, "has dtype i64");
}

}  // namespace
}  // namespace bb

namespace bb {
namespace {
// A primitive's saved tensors are accounted under `activations` and released with the stash.
TEST(MemoryAccounting, SavedTensorsAreActivationsAndFreedAfterBackward) {
  Allocator& a = allocator_for(Device::cpu());
  const int64_t T = 50, H = 16;
  Tensor x = Tensor::from_floats(test::randn(T * H, 1), {T, H});
  Tensor w = Tensor::from_floats(test::randu(H, 2, 0.5f, 1.5f), {H});
  Tensor dw = Tensor::zeros({H}, DType::f32, Device::cpu(), MemCategory::grads);
  const int64_t base = a.stats().live_of(MemCategory::activations);
  {
    RMSNormSaved saved;
    Tensor y = rmsnorm_forward(x, w, 1e-6, &saved, MemCategory::other);
    EXPECT_EQ(a.stats().live_of(MemCategory::activations) - base, T * 4);  // rstd: T floats
    Tensor dx = rmsnorm_backward(Tensor::from_floats(test::randn(T * H, 3), {T, H}), x, w, saved, dw);
    dx = Tensor();
    saved = RMSNormSaved{};  // the caller drops the stash once backward has run
    EXPECT_EQ(a.stats().live_of(MemCategory::activations), base);
  }
}
}  // namespace
}  // namespace bb
