// CUDA runtime: device tensors, copies, conversions, pool allocator accounting.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "common/testing.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace bb {
namespace {

TEST(CudaRuntime, CopyRoundTripAndAccounting) {
  BB_REQUIRE_GPU();
  auto v = test::randn(1000, 1);
  Tensor h = Tensor::from_floats(v, {10, 100});
  Allocator& a = allocator_for(Device::cuda(0));
  const int64_t before = a.stats().live_of(MemCategory::activations);
  {
    Tensor d = h.to(Device::cuda(0), MemCategory::activations);
    EXPECT_EQ(d.device(), Device::cuda(0));
    EXPECT_EQ(a.stats().live_of(MemCategory::activations) - before, 4000);
    EXPECT_EQ(d.to_floats(), v);
    Tensor rows = d.narrow(3, 2);
    EXPECT_EQ(rows.to_floats(), std::vector<float>(v.begin() + 300, v.begin() + 500));
  }
  EXPECT_EQ(a.stats().live_of(MemCategory::activations), before);
  EXPECT_GT(a.stats().reserved_peak, 0);
}

TEST(CudaRuntime, ConversionsMatchHost) {
  BB_REQUIRE_GPU();
  auto v = test::randn(4097, 2, 10.0f);
  Tensor d = Tensor::from_floats(v, {4097}).to(Device::cuda(0));
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor c = d.to_dtype(dt);
    Tensor host_ref = Tensor::from_floats(v, {4097}).to_dtype(dt);
    EXPECT_EQ(c.to_floats(), host_ref.to_floats()) << dtype_name(dt);  // same rounding as the host
    EXPECT_EQ(c.to_dtype(DType::f32).to_floats(), host_ref.to_floats());
  }
  // The vectorised path (16-byte aligned ends, 8 elements a thread) and its scalar tail, the
  // scalar path (an unaligned view), and bf16 <-> f16, against the host conversion.
  for (int64_t off : {0, 1, 3, 8})
    for (int64_t n : {1, 7, 8, 9, 4000}) {
      for (DType from : {DType::f32, DType::bf16, DType::f16})
        for (DType to : {DType::f32, DType::bf16, DType::f16}) {
          Tensor src = d.to_dtype(from).narrow(off, n);
          Tensor host = Tensor::from_floats(v, {4097}).to_dtype(from).narrow(off, n).to_dtype(to);
          EXPECT_EQ(src.to_dtype(to).to_floats(), host.to_floats())
              << dtype_name(from) << " -> " << dtype_name(to) << " offset " << off << " n " << n;
        }
    }
  Tensor z = Tensor::zeros({33}, DType::f32, Device::cuda(0), MemCategory::other);
  EXPECT_EQ(z.to_floats(), std::vector<float>(33, 0.0f));
  z.fill_(2.5);
  EXPECT_EQ(z.to_floats(), std::vector<float>(33, 2.5f));
}

TEST(CudaRuntime, BadDeviceIsAClearError) {
  BB_REQUIRE_GPU();
  test::expect_error_contains([] { Tensor::empty({4}, DType::f32, Device::cuda(99), MemCategory::other); },
                              "cuda:99 requested");
}

}  // namespace
}  // namespace bb

namespace bb {
namespace {
TEST(CudaRuntime, PhiloxFillMatchesHost) {
  BB_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor h = Tensor::empty({1001}, dt, Device::cpu(), MemCategory::other);
    Tensor d = Tensor::empty({1001}, dt, Device::cuda(0), MemCategory::other);
    fill_normal(h, 42, 7, 0.5f, 2.0f);
    fill_normal(d, 42, 7, 0.5f, 2.0f);
    // sqrt/log/cos may differ in the last ulp between host libm and device: compare closely.
    EXPECT_LT(test::rel_error(d.to_floats(), h.to_floats()), 1e-6) << dtype_name(dt);
    fill_uniform(h, 3, 0, -1.0f, 1.0f);
    fill_uniform(d, 3, 0, -1.0f, 1.0f);
    EXPECT_EQ(d.to_floats(), h.to_floats()) << dtype_name(dt);
  }
}
}  // namespace
}  // namespace bb

#ifdef BB_WITH_CUDA
#include "backend/config.h"
#include "backend/cuda/gemm.h"
#include "runtime/run_config.h"

namespace bb {
namespace {
// [backend]'s defaults are the CUDA backend's own, and applying a config changes what the
// grouped GEMM and the heuristics use (host-side settings: no GPU needed).
TEST(BackendConfig, DefaultsEqualTheGemmDefaultsAndApplyChangesThem) {
  const cuda::GroupedDefaults g{};
  // Before any config is applied (a benchmark without a trainer) the backend runs with them.
  const cuda::GroupedDefaults start = cuda::grouped_defaults();
  EXPECT_EQ(start.same_dtype, g.same_dtype);
  EXPECT_EQ(start.widening, g.widening);
  EXPECT_EQ(start.num_streams, g.num_streams);
  EXPECT_EQ(start.multi_stream_min_flops, g.multi_stream_min_flops);
  EXPECT_EQ(start.threaded_enqueue, g.threaded_enqueue);
  EXPECT_EQ(start.tma, g.tma);
  EXPECT_FALSE(cuda::exact_heuristics());
  const BackendConfig b{};
  EXPECT_EQ(b.grouped_gemm_same_dtype, cuda::grouped_algo_name(g.same_dtype));
  EXPECT_EQ(b.grouped_gemm_widening, cuda::grouped_algo_name(g.widening));
  EXPECT_EQ(b.grouped_gemm_streams, g.num_streams);
  EXPECT_EQ(b.grouped_gemm_multi_stream_min_flops, g.multi_stream_min_flops);
  EXPECT_EQ(b.grouped_gemm_threaded_enqueue, g.threaded_enqueue);
  EXPECT_EQ(b.grouped_gemm_tma, g.tma);
  EXPECT_EQ(b.gemm_heuristics, "bucketed");
  BackendConfig c;
  c.grouped_gemm_same_dtype = "multi_stream";
  c.grouped_gemm_streams = 2;
  c.grouped_gemm_multi_stream_min_flops = 5e8;
  c.grouped_gemm_threaded_enqueue = false;
  c.grouped_gemm_tma = false;
  c.gemm_heuristics = "exact";
  apply_backend_config(c);
  const cuda::GroupedDefaults now = cuda::grouped_defaults();
  EXPECT_EQ(now.same_dtype, cuda::GroupedAlgo::multi_stream);
  EXPECT_EQ(now.num_streams, 2);
  EXPECT_EQ(now.multi_stream_min_flops, 5e8);
  EXPECT_FALSE(now.threaded_enqueue);
  EXPECT_FALSE(now.tma);
  EXPECT_TRUE(cuda::exact_heuristics());
  apply_backend_config(BackendConfig{});
  EXPECT_EQ(cuda::grouped_defaults().num_streams, g.num_streams);
  EXPECT_TRUE(cuda::grouped_defaults().tma);
  EXPECT_FALSE(cuda::exact_heuristics());
}
}  // namespace
}  // namespace bb
#endif
