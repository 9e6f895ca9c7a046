// Streams, events and buffer lifetime on a GPU (core/stream.h): record-stream semantics of the
// allocator, GEMMs on two streams at once, uploads that do not block the host.
#include <gtest/gtest.h>

#include <cmath>
#include <thread>

#include "backend/cpu/gemm.h"
#include "common/gpu.h"
#include "common/testing.h"
#include "core/stream.h"
#include "core/tensor.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/gemm.h"
#endif

namespace bb {
namespace {

#ifndef BB_WITH_CUDA
// Every test below drives the CUDA backend directly; a CPU-only build reports them as skipped.
TEST(Streams, NeedTheCudaBackend) { BB_REQUIRE_GPU(); }
#else

const Device kGpu = Device::cuda(0);

// A long reader on the comm stream keeps a buffer that the compute stream frees; a new
// allocation of the same size on the compute stream must not get its memory while the reader
// still runs, and the compute stream must not wait for the reader.
TEST(Streams, BufferUsedOnSideStreamIsNotReusedEarly) {
  BB_REQUIRE_GPU();
  constexpr int64_t kBytes = 1 << 20;
  std::vector<float> ones(kBytes / 4, 1.0f), twos(kBytes / 4, 2.0f);
  Tensor out;
  Event reader_done;
  {
    Tensor a = Tensor::from_floats(ones, {kBytes / 4}).to(kGpu, MemCategory::other);
    Event::record(kGpu, Stream::compute).wait(Stream::comm);  // a is written before it is read
    {
      StreamScope side(Stream::comm);
      out = Tensor::empty({kBytes / 4}, DType::f32, kGpu, MemCategory::other);
      cuda::spin_then_copy(out.raw(), a.raw(), kBytes, 300.0);
      reader_done = Event::record(kGpu, Stream::comm);
    }
    a.record_stream(Stream::comm);
  }  // a is freed here, on the compute stream's side, while the reader spins
  Tensor b = Tensor::from_floats(twos, {kBytes / 4}).to(kGpu, MemCategory::other);
  Tensor c = Tensor::empty({kBytes / 4}, DType::f32, kGpu, MemCategory::other);
  c.copy_from(b);  // a device write of the same size on the compute stream
  const Event compute_done = Event::record(kGpu, Stream::compute);
  compute_done.synchronize();
  EXPECT_FALSE(reader_done.done())
      << "the compute stream waited for the side-stream reader (a false dependency)";
  reader_done.synchronize();
  EXPECT_EQ(out.to_floats(), ones) << "the reader saw memory that was handed out again";
  EXPECT_EQ(c.to_floats(), twos);
}

TEST(Streams, EventsOrderSideStreamWork) {
  BB_REQUIRE_GPU();
  const std::vector<float> v = test::randn(4096, 3);
  Tensor src = Tensor::from_floats(v, {4096}).to(kGpu, MemCategory::other);
  Tensor mid = Tensor::empty({4096}, DType::f32, kGpu, MemCategory::other);
  Event::record(kGpu, Stream::compute).wait(Stream::copy);
  Event written;
  {
    StreamScope s(Stream::copy);
    cuda::spin_then_copy(mid.raw(), src.raw(), 4096 * 4, 100.0);
    written = Event::record(kGpu, Stream::copy);
  }
  src.record_stream(Stream::copy);
  mid.record_stream(Stream::copy);
  written.wait(Stream::compute);
  Tensor dst = Tensor::empty({4096}, DType::f32, kGpu, MemCategory::other);
  dst.copy_from(mid);  // compute, after the copy stream's write
  EXPECT_EQ(dst.to_floats(), v);
}

TEST(Streams, UploadsDoNotBlockTheHost) {
  BB_REQUIRE_GPU();
  std::vector<float> host = test::randn(8192, 5);
  const std::vector<float> expect = host;
  const int64_t syncs = cuda::host_sync_count();
  Tensor d = Tensor::from_floats(host, {8192}).to(kGpu, MemCategory::other);
  Tensor i = Tensor::from_ints(std::vector<int32_t>(100, 7), {100}).to(kGpu, MemCategory::other);
  EXPECT_EQ(cuda::host_sync_count(), syncs) << "a small upload synchronised the host";
  std::fill(host.begin(), host.end(), -1.0f);  // the source may change right after the call
  EXPECT_EQ(d.to_floats(), expect);
  EXPECT_EQ(i.to_ints(), std::vector<int32_t>(100, 7));
}

// Reference C = A B^T in f32 on the host.
std::vector<float> host_gemm(const std::vector<float>& a, const std::vector<float>& b, int64_t M,
                             int64_t N, int64_t K) {
  std::vector<float> c(static_cast<size_t>(M * N));
  cpu::gemm<float>(false, true, M, N, K, 1.0f, a.data(), b.data(), 0.0f, c.data());
  return c;
}

// Two threads issue GEMMs at the same time, one on the compute stream and one on the wgrad
// stream (each with its own workspace), and a third mixes both streams from one thread.
TEST(Streams, ConcurrentGemmsOnTwoStreamsAreCorrect) {
  BB_REQUIRE_GPU();
  struct Case {
    int64_t M, N, K;
    std::vector<float> a, b, ref;
  };
  std::vector<Case> cases;
  for (int i = 0; i < 6; ++i) {
    Case c{256 + 64 * i, 384 - 32 * i, 1024 + 96 * i, {}, {}, {}};  // large enough to use a workspace
    c.a = test::randn(static_cast<size_t>(c.M * c.K), 10 + i, 0.1f);
    c.b = test::randn(static_cast<size_t>(c.N * c.K), 20 + i, 0.1f);
    c.ref = host_gemm(c.a, c.b, c.M, c.N, c.K);
    cases.push_back(std::move(c));
  }
  auto run = [&](Stream s, int reps, std::vector<std::vector<float>>& results) {
    StreamScope scope(s);
    for (int r = 0; r < reps; ++r)
      for (const Case& c : cases) {
        Tensor a = Tensor::from_floats(c.a, {c.M, c.K}, DType::bf16).to(kGpu, MemCategory::other);
        Tensor b = Tensor::from_floats(c.b, {c.N, c.K}, DType::bf16).to(kGpu, MemCategory::other);
        Tensor out = Tensor::empty({c.M, c.N}, DType::f32, kGpu, MemCategory::other);
        cuda::gemm(false, true, c.M, c.N, c.K, 1.0f, a.raw(), DType::bf16, c.K, b.raw(),
                   DType::bf16, c.K, 0.0f, out.raw(), DType::f32, c.N, 0);
        if (r + 1 == reps) results.push_back(out.to_floats());
      }
  };
  std::vector<std::vector<float>> on_compute, on_wgrad;
  std::thread t1([&] { run(Stream::compute, 20, on_compute); });
  std::thread t2([&] { run(Stream::wgrad, 20, on_wgrad); });
  t1.join();
  t2.join();
  ASSERT_EQ(on_compute.size(), cases.size());
  ASSERT_EQ(on_wgrad.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_LT(test::rel_error(on_compute[i], cases[i].ref), test::kTolBf16) << "case " << i;
    EXPECT_LT(test::rel_error(on_wgrad[i], cases[i].ref), test::kTolBf16) << "case " << i;
    EXPECT_EQ(on_compute[i], on_wgrad[i]) << "the same GEMM on two streams differs, case " << i;
  }
  // One thread, alternating streams without waiting in between.
  std::vector<Tensor> outs;
  for (size_t i = 0; i < cases.size(); ++i) {
    StreamScope scope(i % 2 ? Stream::wgrad : Stream::compute);
    const Case& c = cases[i];
    Tensor a = Tensor::from_floats(c.a, {c.M, c.K}, DType::bf16).to(kGpu, MemCategory::other);
    Tensor b = Tensor::from_floats(c.b, {c.N, c.K}, DType::bf16).to(kGpu, MemCategory::other);
    Tensor out = Tensor::empty({c.M, c.N}, DType::f32, kGpu, MemCategory::other);
    cuda::gemm(false, true, c.M, c.N, c.K, 1.0f, a.raw(), DType::bf16, c.K, b.raw(), DType::bf16,
               c.K, 0.0f, out.raw(), DType::f32, c.N, 0);
    outs.push_back(out);
  }
  synchronize_device(kGpu);
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(outs[i].to_floats(), on_compute[i]);
}

#endif  // BB_WITH_CUDA

}  // namespace
}  // namespace bb
