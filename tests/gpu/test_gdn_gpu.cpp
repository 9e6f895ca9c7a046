// Gated DeltaNet primitives on CUDA against their CPU references: the depthwise causal conv1d
// (+ SiLU) over packed sequences. Widths 1-4, sequences of 1, 2 and 3 tokens (shorter than the
// filter) beside long ones, channel counts that fill no warp, several dw chunks; dw must be
// bitwise reproducible and accumulate onto what d_w held.
#include <gtest/gtest.h>

#include <vector>

#include "common/gpu.h"
#include "common/testing.h"
#include "core/tensor.h"
#include "primitives/conv/causal_conv1d.h"

namespace bb {
namespace {

const Device kGpu = Device::cuda(0);

Tensor cu_of(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu = {0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
}

TEST(CausalConv1dGpu, ForwardAndBackwardMatchCpu) {
  BB_REQUIRE_GPU();
  struct Case {
    std::vector<int32_t> lens;
    int64_t C;
  };
  const std::vector<Case> cases = {{{1, 0, 2, 3, 40}, 7}, {{700, 1, 300}, 96}, {{5000}, 33}, {{1}, 1}};
  for (const Case& k : cases) {
    int64_t T = 0;
    for (int32_t l : k.lens) T += l;
    for (int64_t W = 1; W <= 4; ++W) {
      for (bool silu : {false, true}) {
        SCOPED_TRACE(testing::Message() << "T=" << T << " C=" << k.C << " W=" << W << " silu " << silu);
        const Tensor cu = cu_of(k.lens);
        const Tensor x = Tensor::from_floats(test::randn(static_cast<size_t>(T * k.C), 7 + W), {T, k.C});
        const Tensor w = Tensor::from_floats(test::randn(static_cast<size_t>(k.C * W), 9 + W, 0.5f), {k.C, W});
        const Tensor dy = Tensor::from_floats(test::randn(static_cast<size_t>(T * k.C), 11 + W), {T, k.C});
        const Tensor y = causal_conv1d_forward(x, w, cu, silu);
        const Tensor yg = causal_conv1d_forward(x.to(kGpu), w.to(kGpu), cu, silu);
        EXPECT_LT(test::rel_error(yg.to_floats(), y.to_floats()), test::kTolF32);

        const std::vector<float> dw0 = test::randn(static_cast<size_t>(k.C * W), 13);
        Tensor dw = Tensor::from_floats(dw0, {k.C, W});
        Tensor dwg = dw.to(kGpu), dwg2 = dw.to(kGpu);
        const Tensor dx = causal_conv1d_backward(dy, x, w, cu, silu, dw);
        const Tensor dxg = causal_conv1d_backward(dy.to(kGpu), x.to(kGpu), w.to(kGpu), cu, silu, dwg);
        (void)causal_conv1d_backward(dy.to(kGpu), x.to(kGpu), w.to(kGpu), cu, silu, dwg2);
        EXPECT_LT(test::rel_error(dxg.to_floats(), dx.to_floats()), test::kTolF32);
        EXPECT_LT(test::rel_error(dwg.to_floats(), dw.to_floats()), test::kTolF32);
        EXPECT_EQ(dwg.to_floats(), dwg2.to_floats()) << "dw must be bitwise reproducible";
      }
    }
  }
}

TEST(CausalConv1dGpu, MixedDevicesAreAnError) {
  BB_REQUIRE_GPU();
  const Tensor x = Tensor::from_floats(test::randn(12, 1), {4, 3});
  const Tensor w = Tensor::from_floats(test::randn(6, 2), {3, 2});
  test::expect_error_contains([&] { causal_conv1d_forward(x.to(kGpu), w, cu_of({4}), true); }, "causal_conv1d_forward");
}

}  // namespace
}  // namespace bb
