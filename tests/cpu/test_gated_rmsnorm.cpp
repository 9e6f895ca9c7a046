// Gated RMSNorm (primitives/norm/gated_rmsnorm.h): forward as plain RMSNorm times silu(gate),
// backward against finite differences in double, the float path and bad inputs.
#include <gtest/gtest.h>

#include <cmath>

#include "common/testing.h"
#include "primitives/norm/gated_rmsnorm.h"
#include "primitives/norm/gated_rmsnorm_ref.h"
#include "primitives/norm/rmsnorm_ref.h"

namespace bb {
namespace {

constexpr int64_t kRows = 6, kD = 8;
constexpr double kEps = 1e-6;

std::vector<double> fwd(const std::vector<double>& x, const std::vector<double>& z, const std::vector<double>& w) {
  std::vector<double> y(x.size());
  ref::gated_rmsnorm_forward<double>(y.data(), x.data(), z.data(), w.data(), kRows, kD, kEps);
  return y;
}

TEST(GatedRMSNorm, IsRMSNormTimesSiluOfTheGate) {
  const std::vector<double> x = test::cast<double>(test::randn(kRows * kD, 1)), z = test::cast<double>(test::randn(kRows * kD, 2));
  const std::vector<double> w = test::cast<double>(test::randu(kD, 3, 0.5f, 1.5f));
  std::vector<double> plain(x.size()), rstd(kRows);
  ref::rmsnorm_forward<double>(plain.data(), rstd.data(), x.data(), w.data(), kRows, kD, kEps);
  for (size_t i = 0; i < plain.size(); ++i) plain[i] *= z[i] / (1 + std::exp(-z[i]));
  EXPECT_LT(test::rel_error(fwd(x, z, w), plain), 1e-14);
}

TEST(GatedRMSNorm, BackwardMatchesFiniteDifferences) {
  const std::vector<double> x = test::cast<double>(test::randn(kRows * kD, 4)), z = test::cast<double>(test::randn(kRows * kD, 5));
  const std::vector<double> w = test::cast<double>(test::randu(kD, 6, 0.5f, 1.5f));
  const std::vector<double> gy = test::cast<double>(test::randn(kRows * kD, 7));
  std::vector<double> dx(x.size()), dz(x.size()), dw(kD, 0.0);
  ref::gated_rmsnorm_backward<double>(dx.data(), dz.data(), dw.data(), gy.data(), x.data(), z.data(), w.data(), kRows, kD, kEps);
  EXPECT_LT(test::rel_error(dx, test::finite_diff([&](const std::vector<double>& a) { return test::weighted_sum(fwd(a, z, w), gy); }, x)), 1e-8);
  EXPECT_LT(test::rel_error(dz, test::finite_diff([&](const std::vector<double>& a) { return test::weighted_sum(fwd(x, a, w), gy); }, z)), 1e-8);
  EXPECT_LT(test::rel_error(dw, test::finite_diff([&](const std::vector<double>& a) { return test::weighted_sum(fwd(x, z, a), gy); }, w)), 1e-8);
}

TEST(GatedRMSNorm, FloatPathOnHeadsMatchesTheDoubleReference) {
  // [T = 3, H = 2, D = 8]: rows are head vectors.
  const std::vector<float> xv = test::randn(kRows * kD, 8), zv = test::randn(kRows * kD, 9), wv = test::randu(kD, 10, 0.5f, 1.5f);
  const std::vector<float> gv = test::randn(kRows * kD, 11);
  Tensor x = Tensor::from_floats(xv, {3, 2, kD}), z = Tensor::from_floats(zv, {3, 2, kD}), w = Tensor::from_floats(wv, {kD});
  const std::vector<double> x64 = test::cast<double>(xv), z64 = test::cast<double>(zv), w64 = test::cast<double>(wv),
                            g64 = test::cast<double>(gv);
  EXPECT_LT(test::rel_error(gated_rmsnorm_forward(x, z, w, kEps).to_floats(), fwd(x64, z64, w64)), 1e-6);
  std::vector<double> dx(x64.size()), dz(x64.size()), dw(kD, 0.0);
  ref::gated_rmsnorm_backward<double>(dx.data(), dz.data(), dw.data(), g64.data(), x64.data(), z64.data(), w64.data(), kRows, kD, kEps);
  Tensor d_w = Tensor::zeros({kD}, DType::f32, Device::cpu(), MemCategory::other);
  auto [d_x, d_z] = gated_rmsnorm_backward(Tensor::from_floats(gv, {3, 2, kD}), x, z, w, kEps, d_w);
  EXPECT_LT(test::rel_error(d_x.to_floats(), dx), test::kGradTol);
  EXPECT_LT(test::rel_error(d_z.to_floats(), dz), test::kGradTol);
  EXPECT_LT(test::rel_error(d_w.to_floats(), dw), test::kGradTol);
}

TEST(GatedRMSNorm, BadInputsAreClearErrors) {
  const Tensor x = Tensor::zeros({4, 8}, DType::f32, Device::cpu(), MemCategory::other);
  test::expect_error_contains([&] { gated_rmsnorm_forward(x, x, Tensor::zeros({7}, DType::f32, Device::cpu(), MemCategory::other), kEps); },
                              "D = w's 7");
  test::expect_error_contains([&] { gated_rmsnorm_forward(x, Tensor::zeros({4, 4}, DType::f32, Device::cpu(), MemCategory::other),
                                                          Tensor::zeros({8}, DType::f32, Device::cpu(), MemCategory::other), kEps); },
                              "'z'");
}

}  // namespace
}  // namespace bb
