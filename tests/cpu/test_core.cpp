// Core: dtypes, tensors, memory accounting, rng, errors.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/testing.h"
#include "core/dtype.h"
#include "core/memory.h"
#include "core/rng.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace bb {
namespace {

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties go to even (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  // 1 + 3*2^-8 is halfway between 1.0078125 (odd mantissa) and 1.015625 (even): rounds up.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3.0f / 256)), 1.015625f);
  // Just above halfway rounds up.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 1.0f / 256 + 1.0f / 65536)), 1.0078125f);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  EXPECT_TRUE(std::isinf(bf16_to_f32(f32_to_bf16(INFINITY))));
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(-2.5f)), -2.5f);
}

TEST(DType, Bf16RoundTripAndErrorBound) {
  auto v = test::randn(10000, 7, 3.0f);
  for (float x : v) {
    float r = round_bf16(x);
    EXPECT_LE(std::fabs(r - x), std::fabs(x) * (1.0f / 256) + 1e-30f);
    EXPECT_EQ(round_bf16(r), r);  // representable values are fixed points
  }
}

TEST(DType, F16Conversion) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(f32_to_f16(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(1e6f))));
  EXPECT_EQ(f16_to_f32(f32_to_f16(5.9604644775390625e-08f)), 5.9604644775390625e-08f);  // min subnormal
  auto v = test::randn(1000, 3);
  for (float x : v) EXPECT_NEAR(f16_to_f32(f32_to_f16(x)), x, std::fabs(x) / 1024 + 1e-7);
}

TEST(DType, NamesRoundTrip) {
  for (DType d : {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8, DType::boolean})
    EXPECT_EQ(dtype_from_name(dtype_name(d)), d);
  test::expect_error_contains([] { dtype_from_name("f8"); }, "unknown dtype 'f8'");
}

TEST(Tensor, ShapesViewsNarrow) {
  Tensor t = Tensor::from_floats({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {4, 3});
  EXPECT_EQ(t.numel(), 12);
  EXPECT_EQ(t.nbytes(), 48u);
  Tensor rows = t.narrow(1, 2);
  EXPECT_EQ(rows.shape(), (Shape{2, 3}));
  EXPECT_EQ(rows.to_floats(), (std::vector<float>{3, 4, 5, 6, 7, 8}));
  rows.data<float>()[0] = 42;  // views share storage
  EXPECT_EQ(t.to_floats()[3], 42);
  Tensor v = t.view({2, -1});
  EXPECT_EQ(v.shape(), (Shape{2, 6}));
  test::expect_error_contains([&] { t.view({5, 3}); }, "has 15 elements");
  test::expect_error_contains([&] { t.narrow(3, 2); }, "out of range");
  test::expect_error_contains([&] { t.data<int32_t>(); }, "does not match tensor dtype f32");
}

TEST(Tensor, DtypeConversionAndClone) {
  auto vals = test::randn(33, 11);
  Tensor t = Tensor::from_floats(vals, {3, 11});
  Tensor b = t.to_dtype(DType::bf16);
  EXPECT_EQ(b.dtype(), DType::bf16);
  auto back = b.to_floats();
  for (size_t i = 0; i < vals.size(); ++i) EXPECT_EQ(back[i], round_bf16(vals[i]));
  // Inf, NaN, a value that rounds up to Inf, denormals: bf16 and f16 bits as the scalar
  // conversions give them (the host path converts without a widened copy).
  const std::vector<float> edge = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                                   std::numeric_limits<float>::quiet_NaN(), 3.4e38f, 70000.0f, 1e-40f, -0.0f, 1.0f};
  const Tensor e = Tensor::from_floats(edge, {static_cast<int64_t>(edge.size())});
  const Tensor eb = e.to_dtype(DType::bf16), eh = e.to_dtype(DType::f16);
  for (size_t i = 0; i < edge.size(); ++i) {
    EXPECT_EQ(eb.data<uint16_t>()[i], f32_to_bf16(edge[i])) << i;
    EXPECT_EQ(eh.data<uint16_t>()[i], f32_to_f16(edge[i])) << i;
  }
  Tensor c = t.clone(MemCategory::params);
  c.data<float>()[0] += 1;
  EXPECT_NE(c.to_floats()[0], t.to_floats()[0]);
  EXPECT_EQ(c.category(), MemCategory::params);
  Tensor z = Tensor::zeros({5}, DType::i32, Device::cpu(), MemCategory::other);
  z.fill_(7);
  EXPECT_EQ(z.to_ints(), (std::vector<int32_t>{7, 7, 7, 7, 7}));
}

// first_nonfinite reads f32 and bf16 in place and widens other dtypes: the first Inf or NaN
// (a NaN whose payload is all ones included), or -1.
TEST(Tensor, FirstNonfiniteFindsTheFirstInfOrNan) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    EXPECT_EQ(first_nonfinite(Tensor::from_floats({1, -2, 3e38f, 0}, {4}, dt)), dt == DType::f16 ? 2 : -1);
    EXPECT_EQ(first_nonfinite(Tensor::from_floats({1, nan, -inf}, {3}, dt)), 1);
    EXPECT_EQ(first_nonfinite(Tensor::from_floats({0, 0, 0, -inf}, {4}, dt)), 3);
    EXPECT_EQ(first_nonfinite(Tensor::zeros({0}, dt, Device::cpu(), MemCategory::other)), -1);
  }
  Tensor t = Tensor::from_floats({1, 2}, {2});
  t.data<float>()[1] = std::bit_cast<float>(0xffffffffu);  // NaN, every payload bit set
  EXPECT_EQ(first_nonfinite(t), 1);
  // Long tensors are scanned in ranges on several threads: still the smallest index, whichever
  // range finds its hit first.
  const int64_t n = 3 * (int64_t{1} << 22) + 5;
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor big = Tensor::zeros({n}, dt, Device::cpu(), MemCategory::other);
    auto set = [&](int64_t k, float v) {
      if (dt == DType::f32) big.data<float>()[k] = v;
      else big.data<uint16_t>()[k] = f32_to_bf16(v);
    };
    EXPECT_EQ(first_nonfinite(big), -1);
    set(n - 1, nan);
    EXPECT_EQ(first_nonfinite(big), n - 1);
    set(n / 2 + 7, inf);
    EXPECT_EQ(first_nonfinite(big), n / 2 + 7);
    set(3, -inf);
    EXPECT_EQ(first_nonfinite(big), 3);
  }
}

TEST(Memory, CategoriesLiveAndPeak) {
  Allocator& a = allocator_for(Device::cpu());
  const MemoryStats s0 = a.stats();
  a.reset_peak();
  {
    Tensor p = Tensor::empty({256}, DType::f32, Device::cpu(), MemCategory::params);
    Tensor g = Tensor::empty({128}, DType::bf16, Device::cpu(), MemCategory::grads);
    MemoryStats s = a.stats();
    EXPECT_EQ(s.live_of(MemCategory::params) - s0.live_of(MemCategory::params), 1024);
    EXPECT_EQ(s.live_of(MemCategory::grads) - s0.live_of(MemCategory::grads), 256);
    {
      Tensor x = Tensor::empty({1000}, DType::f32, Device::cpu(), MemCategory::activations);
    }
    s = a.stats();
    EXPECT_EQ(s.live_of(MemCategory::activations), s0.live_of(MemCategory::activations));
    EXPECT_EQ(s.peak_of(MemCategory::activations) - s0.live_of(MemCategory::activations), 4000);
  }
  MemoryStats s = a.stats();
  EXPECT_EQ(s.live_total, s0.live_total);
  a.reset_peak();
  EXPECT_EQ(a.stats().peak_of(MemCategory::activations), s.live_of(MemCategory::activations));
  EXPECT_EQ(category_from_name("moe"), MemCategory::moe);
  test::expect_error_contains([] { category_from_name("cache"); }, "unknown memory category 'cache'");
}

// Out of memory: the message names where the memory is, largest category first, and the peak.
TEST(Memory, OutOfMemoryNamesTheLargestCategories) {
  Tensor big = Tensor::empty({int64_t{1} << 22}, DType::f32, Device::cpu(), MemCategory::optimizer);  // 16 MiB
  Tensor small = Tensor::empty({1024}, DType::f32, Device::cpu(), MemCategory::activations);
  try {
    Tensor::empty({int64_t{1} << 48}, DType::f32, Device::cpu(), MemCategory::logits);  // 1 PiB
    FAIL() << "a 1 PiB allocation succeeded";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("out of host memory allocating"), std::string::npos) << m;
    EXPECT_NE(m.find("the allocation was for logits"), std::string::npos) << m;
    const size_t opt = m.find("optimizer "), act = m.find("activations ");
    ASSERT_NE(opt, std::string::npos) << m;
    EXPECT_TRUE(act == std::string::npos || opt < act) << "the largest category first: " << m;
    EXPECT_NE(m.find("peak since the step began"), std::string::npos) << m;
  }
}

TEST(Device, Parse) {
  EXPECT_EQ(Device::parse("cpu"), Device::cpu());
  EXPECT_EQ(Device::parse("cuda:3"), Device::cuda(3));
  test::expect_error_contains([] { Device::parse("tpu"); }, "bad device 'tpu'");
}

TEST(Rng, PhiloxKnownAnswer) {
  // Random123 known-answer vector for philox4x32-10 with counter = 0 and key = 0.
  Philox4 r = philox4x32_10(0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
}

TEST(Rng, CounterBasedAndDistribution) {
  Tensor a = Tensor::empty({1000}, DType::f32, Device::cpu(), MemCategory::other);
  Tensor b = Tensor::empty({600}, DType::f32, Device::cpu(), MemCategory::other);
  fill_normal(a, 42, 0);
  fill_normal(b, 42, 400);  // offset 400 -> the same numbers as a[400:]
  auto va = a.to_floats(), vb = b.to_floats();
  for (int i = 0; i < 600; ++i) EXPECT_EQ(va[400 + i], vb[i]);
  // Moments of a million draws, each within 5 standard errors of the normal's (mean 0 +-
  // 5/sqrt(N), variance 1 +- 5 sqrt(2/N), skewness 0 +- 5 sqrt(6/N), kurtosis 3 +- 5 sqrt(24/N)):
  // a variance off by 1 % or a skewed transform fails; 1,000 draws with +-0.1 could not tell.
  {
    const int64_t N = 1'000'000;
    Tensor big = Tensor::empty({N}, DType::f32, Device::cpu(), MemCategory::other);
    fill_normal(big, 42, 0);
    const auto v = big.to_floats();
    double m1 = 0, m2 = 0, m3 = 0, m4 = 0;
    for (float x : v) m1 += x;
    m1 /= N;
    for (float x : v) {
      const double d = x - m1;
      m2 += d * d, m3 += d * d * d, m4 += d * d * d * d;
    }
    m2 /= N, m3 /= N, m4 /= N;
    const double se = 1.0 / std::sqrt(static_cast<double>(N));
    EXPECT_NEAR(m1, 0.0, 5 * se);
    EXPECT_NEAR(m2, 1.0, 5 * std::sqrt(2.0) * se);
    EXPECT_NEAR(m3 / std::pow(m2, 1.5), 0.0, 5 * std::sqrt(6.0) * se);
    EXPECT_NEAR(m4 / (m2 * m2), 3.0, 5 * std::sqrt(24.0) * se);
    // Uniform on (-2, 3]: mean 0.5 and variance 25/12, within 5 standard errors.
    fill_uniform(big, 7, 0, -2.0f, 3.0f);
    const auto u = big.to_floats();
    double um = 0, uv = 0;
    for (float x : u) um += x;
    um /= N;
    for (float x : u) uv += (x - um) * (x - um);
    uv /= N;
    EXPECT_NEAR(um, 0.5, 5 * std::sqrt(25.0 / 12.0) * se);
    // sd of a sample variance: sqrt((mu4 - sigma^4) / N), mu4 = 5^4 / 80 for a width of 5.
    EXPECT_NEAR(uv, 25.0 / 12.0, 5 * std::sqrt(625.0 / 80.0 - (25.0 / 12.0) * (25.0 / 12.0)) * se);
  }
  fill_normal(b, 43, 400);
  EXPECT_NE(b.to_floats()[0], va[400]);  // another seed, another stream
  fill_uniform(a, 1, 0, -2.0f, 3.0f);
  for (float x : a.to_floats()) EXPECT_TRUE(x > -2.0f && x <= 3.0f);
}

TEST(Streams, ScopesNestAndRestoreTheCurrentStream) {
  EXPECT_EQ(current_stream(), Stream::compute);
  {
    StreamScope a(Stream::comm);
    EXPECT_EQ(current_stream(), Stream::comm);
    {
      StreamScope b(Stream::wgrad);
      EXPECT_EQ(current_stream(), Stream::wgrad);
    }
    EXPECT_EQ(current_stream(), Stream::comm);
  }
  EXPECT_EQ(current_stream(), Stream::compute);
  EXPECT_STREQ(stream_name(Stream::copy), "copy");
}

TEST(Streams, CpuEventsAreCompleteAndRecordStreamKeepsAccounting) {
  const Event e = Event::record(Device::cpu(), Stream::comm);
  EXPECT_TRUE(e.done());
  e.wait(Stream::compute);
  e.synchronize();
  EXPECT_TRUE(Event().done());
  Allocator& a = allocator_for(Device::cpu());
  const int64_t before = a.stats().live_of(MemCategory::comm);
  {
    Tensor t = Tensor::zeros({16}, DType::f32, Device::cpu(), MemCategory::comm);
    t.record_stream(Stream::comm);
    EXPECT_EQ(a.stats().live_of(MemCategory::comm) - before, 64);
  }
  EXPECT_EQ(a.stats().live_of(MemCategory::comm), before);
  synchronize_device(Device::cpu());
}

TEST(Error, MessageHasLocationAndText) {
  try {
    BB_CHECK(1 == 2, "op: expected ", 3, " got ", 4);
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("op: expected 3 got 4"), std::string::npos);
    EXPECT_NE(m.find("test_core.cpp:"), std::string::npos);
  }
}

}  // namespace
}  // namespace bb
