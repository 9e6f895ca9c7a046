// causal_conv1d (primitives/conv): the reference against PyTorch's definition written out as a
// padded cross-correlation per sequence, its backward against finite differences in double, the
// float path, gradient accumulation and bad inputs.
#include <gtest/gtest.h>

#include <cmath>

#include "common/testing.h"
#include "primitives/conv/causal_conv1d.h"
#include "primitives/conv/causal_conv1d_ref.h"

namespace bb {
namespace {

// Conv1d(C, C, W, groups=C, padding=W-1)(x)[..., :L] on each sequence alone, then optional SiLU.
std::vector<double> torch_definition(const std::vector<double>& x, const std::vector<double>& w,
                                     const std::vector<int32_t>& cu, int64_t C, int64_t W, bool silu) {
  std::vector<double> y(x.size());
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    const int64_t L = cu[n + 1] - cu[n];
    for (int64_t c = 0; c < C; ++c) {
      std::vector<double> pad(static_cast<size_t>(L + W - 1), 0.0);  // W - 1 zeros in front
      for (int64_t t = 0; t < L; ++t) pad[static_cast<size_t>(t + W - 1)] = x[static_cast<size_t>((cu[n] + t) * C + c)];
      for (int64_t t = 0; t < L; ++t) {
        double acc = 0;
        for (int64_t j = 0; j < W; ++j) acc += w[static_cast<size_t>(c * W + j)] * pad[static_cast<size_t>(t + j)];
        y[static_cast<size_t>((cu[n] + t) * C + c)] = silu ? acc / (1 + std::exp(-acc)) : acc;
      }
    }
  }
  return y;
}

const std::vector<int32_t> kCu = {0, 1, 1, 6, 13};  // a sequence shorter than the kernel, an empty one

TEST(CausalConv1d, ForwardIsTorchsConv1dPerSequence) {
  const int64_t C = 5, W = 4, T = kCu.back();
  const std::vector<double> x = test::cast<double>(test::randn(static_cast<size_t>(T * C), 1));
  const std::vector<double> w = test::cast<double>(test::randn(static_cast<size_t>(C * W), 2, 0.5f));
  for (bool silu : {false, true}) {
    std::vector<double> y(x.size());
    ref::causal_conv1d_forward<double>(y.data(), x.data(), w.data(), kCu.data(), 4, C, W, silu);
    EXPECT_LT(test::rel_error(y, torch_definition(x, w, kCu, C, W, silu)), 1e-14) << "silu " << silu;
  }
}

TEST(CausalConv1d, BackwardMatchesFiniteDifferences) {
  const int64_t C = 3, T = kCu.back();
  for (int64_t W : {2, 4})
    for (bool silu : {false, true}) {
      const std::vector<double> x = test::cast<double>(test::randn(static_cast<size_t>(T * C), 3));
      const std::vector<double> w = test::cast<double>(test::randn(static_cast<size_t>(C * W), 4, 0.5f));
      const std::vector<double> gy = test::cast<double>(test::randn(x.size(), 5));
      std::vector<double> dx(x.size()), dw(w.size(), 0.0);
      ref::causal_conv1d_backward<double>(dx.data(), dw.data(), gy.data(), x.data(), w.data(), kCu.data(), 4, C, W, silu);
      auto fx = [&](const std::vector<double>& xx) { return test::weighted_sum(torch_definition(xx, w, kCu, C, W, silu), gy); };
      auto fw = [&](const std::vector<double>& ww) { return test::weighted_sum(torch_definition(x, ww, kCu, C, W, silu), gy); };
      EXPECT_LT(test::rel_error(dx, test::finite_diff(fx, x)), 1e-8) << "W " << W << " silu " << silu;
      EXPECT_LT(test::rel_error(dw, test::finite_diff(fw, w)), 1e-8) << "W " << W << " silu " << silu;
    }
}

TEST(CausalConv1d, FloatPathMatchesAndWeightGradientsAccumulate) {
  const int64_t C = 8, W = 4, T = kCu.back();
  const std::vector<float> xv = test::randn(static_cast<size_t>(T * C), 6), wv = test::randn(static_cast<size_t>(C * W), 7, 0.5f);
  const std::vector<float> gv = test::randn(xv.size(), 8);
  Tensor x = Tensor::from_floats(xv, {T, C}), w = Tensor::from_floats(wv, {C, W}), gy = Tensor::from_floats(gv, {T, C});
  Tensor cu = Tensor::from_ints(kCu, {5});
  Tensor y = causal_conv1d_forward(x, w, cu, true);
  const std::vector<double> x64 = test::cast<double>(xv), w64 = test::cast<double>(wv), g64 = test::cast<double>(gv);
  EXPECT_LT(test::rel_error(y.to_floats(), torch_definition(x64, w64, kCu, C, W, true)), 1e-6);
  std::vector<double> dx(x64.size()), dw(w64.size(), 0.0);
  ref::causal_conv1d_backward<double>(dx.data(), dw.data(), g64.data(), x64.data(), w64.data(), kCu.data(), 4, C, W, true);
  Tensor d_w = Tensor::zeros({C, W}, DType::f32, Device::cpu(), MemCategory::other);
  Tensor d_x = causal_conv1d_backward(gy, x, w, cu, true, d_w);
  EXPECT_LT(test::rel_error(d_x.to_floats(), dx), test::kGradTol);
  EXPECT_LT(test::rel_error(d_w.to_floats(), dw), test::kGradTol);
  causal_conv1d_backward(gy, x, w, cu, true, d_w);  // += : twice the gradient now
  std::vector<double> twice = dw;
  for (double& v : twice) v *= 2;
  EXPECT_LT(test::rel_error(d_w.to_floats(), twice), test::kGradTol);
}

TEST(CausalConv1d, BadInputsAreClearErrors) {
  const Tensor x = Tensor::zeros({4, 3}, DType::f32, Device::cpu(), MemCategory::other);
  const Tensor cu = Tensor::from_ints({0, 4}, {2});
  test::expect_error_contains([&] { causal_conv1d_forward(x, Tensor::zeros({3, 5}, DType::f32, Device::cpu(), MemCategory::other), cu, true); },
                              "kernel width 5");
  test::expect_error_contains([&] { causal_conv1d_forward(x, Tensor::zeros({2, 4}, DType::f32, Device::cpu(), MemCategory::other), cu, true); },
                              "channels");
  test::expect_error_contains([&] { causal_conv1d_forward(x, Tensor::zeros({3, 4}, DType::f32, Device::cpu(), MemCategory::other), Tensor::from_ints({0, 2}, {2}), true); },
                              "end at T = 4");
  test::expect_error_contains(
      [&] {
        causal_conv1d_forward(x, Tensor::zeros({3, 4}, DType::f32, Device::cpu(), MemCategory::other), cu, true,
                              MemCategory::activations, DType::i32);
      },
      "output dtype must be f32 or bf16");
}

// A bf16 output is the f32 result rounded once.
TEST(CausalConv1d, Bf16OutputIsTheF32ResultRounded) {
  const int64_t C = 8, W = 4, T = kCu.back();
  const Tensor x = Tensor::from_floats(test::randn(static_cast<size_t>(T * C), 16), {T, C});
  const Tensor w = Tensor::from_floats(test::randn(static_cast<size_t>(C * W), 17, 0.5f), {C, W});
  const Tensor cu = Tensor::from_ints(kCu, {5});
  std::vector<float> y = causal_conv1d_forward(x, w, cu, true).to_floats();
  for (float& v : y) v = round_bf16(v);
  const Tensor yb = causal_conv1d_forward(x, w, cu, true, MemCategory::activations, DType::bf16);
  EXPECT_EQ(yb.dtype(), DType::bf16);
  EXPECT_EQ(yb.to_floats(), y);
}

}  // namespace
}  // namespace bb
