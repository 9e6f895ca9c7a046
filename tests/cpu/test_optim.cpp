// AdamW against a double-precision transcription of torch.optim.AdamW; grad norm and clipping.
#include <gtest/gtest.h>

#include "common/testing.h"
#include "primitives/optim/adamw.h"

namespace bb {
namespace {

TEST(AdamW, MatchesDoubleReferenceOverSteps) {
  const int64_t n = 37;
  auto p0 = test::randn(n, 1);
  Tensor master = Tensor::from_floats(p0, {n}, DType::f32, MemCategory::optimizer);
  Tensor m = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
  Tensor v = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
  Tensor model = Tensor::zeros({n}, DType::bf16, Device::cpu(), MemCategory::params);
  std::vector<double> P = test::cast<double>(p0), M(n, 0), Vv(n, 0);
  AdamWConfig cfg{0.9, 0.95, 1e-8};
  const double wd = 0.1;
  for (int step = 1; step <= 5; ++step) {
    const double lr = 1e-2 / step;
    auto g = test::randn(n, 100 + step);
    adamw_step(master, Tensor::from_floats(g, {n}), m, v, step, lr, wd, cfg, &model);
    const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.95, step);
    for (int64_t i = 0; i < n; ++i) {
      P[i] *= 1 - lr * wd;
      M[i] = 0.9 * M[i] + 0.1 * g[i];
      Vv[i] = 0.95 * Vv[i] + 0.05 * double(g[i]) * g[i];
      P[i] -= lr / bc1 * M[i] / (std::sqrt(Vv[i]) / std::sqrt(bc2) + 1e-8);
    }
  }
  EXPECT_LT(test::rel_error(master.to_floats(), P), 1e-6);
  auto mv = model.to_floats(), pv = master.to_floats();
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(mv[i], round_bf16(pv[i]));  // written in the same pass
}

TEST(AdamW, FirstStepIsSignedLr) {
  // With zero moments, step 1 moves each weight by lr * g/|g| (up to eps), whatever |g|.
  Tensor p = Tensor::from_floats({1, 1, 1}, {3}, DType::f32, MemCategory::optimizer);
  Tensor m = Tensor::zeros({3}, DType::f32, Device::cpu(), MemCategory::optimizer);
  Tensor v = Tensor::zeros({3}, DType::f32, Device::cpu(), MemCategory::optimizer);
  adamw_step(p, Tensor::from_floats({1e-3f, -5.0f, 100.0f}, {3}), m, v, 1, 0.1, 0.0, {}, nullptr);
  auto r = p.to_floats();
  EXPECT_NEAR(r[0], 0.9, 1e-5);
  EXPECT_NEAR(r[1], 1.1, 1e-5);
  EXPECT_NEAR(r[2], 0.9, 1e-5);
}

TEST(AdamW, GradScaleEqualsPrescaledGradient) {
  // Clipping folded into the update: grad_scale s on g gives bit-for-bit the step on s * g, and
  // leaves g untouched.
  const int64_t n = 33;
  const auto g0 = test::randn(n, 7);
  const float s = 0.37f;
  std::vector<float> scaled(g0);
  for (float& x : scaled) x *= s;
  Tensor p1 = Tensor::from_floats(test::randn(n, 8), {n}), p2 = p1.clone(MemCategory::optimizer);
  Tensor m1 = Tensor::from_floats(test::randn(n, 9, 0.1f), {n}), m2 = m1.clone(MemCategory::optimizer);
  Tensor v1 = Tensor::from_floats(test::randu(n, 10, 0.0f, 0.01f), {n}), v2 = v1.clone(MemCategory::optimizer);
  Tensor g = Tensor::from_floats(g0, {n});
  AdamWConfig scaled_cfg;
  scaled_cfg.grad_scale = s;
  adamw_step(p1, g, m1, v1, 3, 1e-2, 0.1, scaled_cfg, nullptr);
  adamw_step(p2, Tensor::from_floats(scaled, {n}), m2, v2, 3, 1e-2, 0.1, {}, nullptr);
  EXPECT_EQ(p1.to_floats(), p2.to_floats());
  EXPECT_EQ(m1.to_floats(), m2.to_floats());
  EXPECT_EQ(v1.to_floats(), v2.to_floats());
  EXPECT_EQ(g.to_floats(), g0);
  scaled_cfg.grad_scale = -1;
  test::expect_error_contains([&] { adamw_step(p1, g, m1, v1, 4, 1e-2, 0.1, scaled_cfg, nullptr); },
                              "grad_scale must be finite and >= 0");
}

TEST(GradNorm, GlobalNormAndScale) {
  auto a = test::randn(10, 1), b = test::randn(7, 2);
  double ref = 0;
  for (float x : a) ref += double(x) * x;
  for (float x : b) ref += double(x) * x;
  std::vector<Tensor> gs = {Tensor::from_floats(a, {10}), Tensor::from_floats(b, {7}, DType::bf16)};
  // bf16 rounding of b changes the norm slightly; compare against that rounding.
  double ref16 = 0;
  for (float x : a) ref16 += double(x) * x;
  for (float x : b) ref16 += double(round_bf16(x)) * round_bf16(x);
  EXPECT_NEAR(global_grad_norm(gs), std::sqrt(ref16), 1e-9 * std::sqrt(ref));
  scale_inplace(gs[0], 0.5f);
  EXPECT_NEAR(sum_of_squares(gs[0]), 0.25 * sum_of_squares(Tensor::from_floats(a, {10})), 1e-9);
}

TEST(AdamW, BadInput) {
  Tensor p = Tensor::zeros({3}, DType::f32, Device::cpu(), MemCategory::optimizer);
  Tensor g = Tensor::zeros({4}, DType::f32, Device::cpu(), MemCategory::grads);
  test::expect_error_contains([&] { adamw_step(p, g, p, p, 1, 0.1, 0, {}, nullptr); }, "sizes differ");
  test::expect_error_contains([&] { adamw_step(p, p, p, p, 0, 0.1, 0, {}, nullptr); }, "step is 1-based");
}

// The non-finite flag of the AdamW pass: set when an update overflows f32, left alone otherwise
// (and never cleared); mark_nonfinite flags exactly the tensors holding Inf or NaN.
TEST(AdamW, NonFiniteFlagIsSetByTheUpdateOnly) {
  const int64_t n = 33;
  for (double lr : {1e-2, 1e39}) {
    Tensor master = Tensor::from_floats(test::randn(n, 3), {n}, DType::f32, MemCategory::optimizer);
    Tensor m = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
    Tensor v = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
    Tensor flag = Tensor::zeros({1}, DType::i32, Device::cpu(), MemCategory::workspace);
    adamw_step(master, Tensor::from_floats(test::randn(n, 4), {n}), m, v, 1, lr, 0.0, AdamWConfig{}, nullptr, &flag);
    EXPECT_EQ(flag.to_ints()[0], lr > 1e38 ? 1 : 0) << "lr " << lr;
    bool any = false;
    for (float x : master.to_floats()) any |= !std::isfinite(x);
    EXPECT_EQ(any, lr > 1e38);
  }
  std::vector<Tensor> ts = {Tensor::from_floats({1, 2, 3}, {3}), Tensor::from_floats({1, NAN}, {2}, DType::bf16),
                            Tensor::from_floats({INFINITY}, {1}), Tensor::from_floats({0, 0}, {2}, DType::bf16)};
  Tensor flags = Tensor::zeros({4}, DType::i32, Device::cpu(), MemCategory::workspace);
  mark_nonfinite(ts, flags);
  EXPECT_EQ(flags.to_ints(), (std::vector<int32_t>{0, 1, 1, 0}));
  Tensor wrong = Tensor::zeros({3}, DType::i32, Device::cpu(), MemCategory::workspace);
  test::expect_error_contains([&] { mark_nonfinite(ts, wrong); }, "4 tensors but 3 flags");
}

}  // namespace
}  // namespace bb
