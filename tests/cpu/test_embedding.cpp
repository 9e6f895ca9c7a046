// Embedding lookup and its scatter-add backward.
#include <gtest/gtest.h>

#include "common/testing.h"
#include "primitives/embedding/embedding.h"

namespace bb {
namespace {

TEST(Embedding, ForwardGathersAndBackwardScatterAdds) {
  const int64_t V = 6, H = 5;
  auto tv = test::randn(V * H, 1);
  Tensor table = Tensor::from_floats(tv, {V, H}, DType::bf16);
  std::vector<int32_t> ids = {3, 0, 3, 5};
  Tensor y = embedding_forward(Tensor::from_ints(ids, {4}), table);
  auto yv = y.to_floats(), tr = table.to_floats();
  for (size_t t = 0; t < ids.size(); ++t)
    for (int64_t h = 0; h < H; ++h) EXPECT_EQ(yv[t * H + h], tr[ids[t] * H + h]);
  auto dyv = test::randn(4 * H, 2);
  Tensor dt = Tensor::zeros({V, H}, DType::f32, Device::cpu(), MemCategory::grads);
  embedding_backward(Tensor::from_floats(dyv, {4, H}), Tensor::from_ints(ids, {4}), dt);
  // FD on the (linear) map table -> sum w * y, in double.
  auto wt = test::cast<double>(dyv);
  auto g = test::finite_diff(
      [&](const std::vector<double>& tab) {
        std::vector<double> out(4 * H);
        for (size_t t = 0; t < ids.size(); ++t)
          for (int64_t h = 0; h < H; ++h) out[t * H + h] = tab[ids[t] * H + h];
        return test::weighted_sum(out, wt);
      },
      test::cast<double>(tv));
  EXPECT_LT(test::rel_error(dt.to_floats(), g), test::kGradTol);
  auto dv = dt.to_floats();
  for (int64_t h = 0; h < H; ++h) EXPECT_EQ(dv[1 * H + h], 0.0f);  // untouched row stays zero
}

TEST(Embedding, BadIdsAndEmptyBatch) {
  Tensor table = Tensor::zeros({4, 2}, DType::f32, Device::cpu(), MemCategory::params);
  test::expect_error_contains([&] { embedding_forward(Tensor::from_ints({1, 4}, {2}), table); },
                              "token id 4 at position 1 is outside the vocabulary [0, 4)");
  test::expect_error_contains([&] { embedding_forward(Tensor::from_ints({}, {0}), table); },
                              "empty batch");
  test::expect_error_contains([&] { embedding_forward(Tensor::from_floats({1}, {1}), table); },
                              "argument 'ids' has dtype f32, expected i32");
}

}  // namespace
}  // namespace bb
