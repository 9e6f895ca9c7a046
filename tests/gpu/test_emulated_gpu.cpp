// Emulated communication on a GPU (comm/emulated.h): the wire kernel holds the operation's stream
// for the modelled time and writes what the CPU path writes; and the slowed-communication mode
// (emulate.wire_scale far above 1: every collective's data lands long after the compute around
// it) runs the trainer's overlapped paths (FSDP gathers with prefetch and reduce-scatters,
// chunked dispatch / combine with and without the recompute's rebuild-only forward, the Gated
// DeltaNet head exchange, cp_ring and cp_a2a), whose results must be bitwise those of the
// unslowed run: a consumer that does not wait for its collective, or a buffer reused before the
// wire is done with it, reads other bytes. A read that skips its wait is shown to see them.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>

#include "comm/emulated.h"
#include "common/gpu.h"
#include "common/run.h"
#include "common/testing.h"
#include "common/tiny_models.h"
#include "runtime/trainer.h"

#ifdef BB_WITH_CUDA
#include <cuda_runtime.h>

#include "backend/cuda/check.cuh"
#endif

namespace bb {
namespace {

#ifndef BB_WITH_CUDA
TEST(EmulatedGpu, NeedsTheCudaBackend) { BB_REQUIRE_GPU(); }
#else

const Device kGpu = Device::cuda(0);

comm::EmulateConfig job(int64_t ranks, int64_t rank = 0) {
  comm::EmulateConfig c;
  c.ranks = ranks;
  c.rank = rank;
  return c;
}

Tensor gpu(const std::vector<float>& v, const Shape& s, DType dt = DType::f32) {
  return Tensor::from_floats(v, s, dt).to(kGpu, MemCategory::other);
}

// Milliseconds the compute stream spends in `fn` when it waits for the work it returns.
double compute_ms(const std::function<comm::WorkPtr()>& fn) {
  cudaEvent_t a, b;
  BB_CHECK_CUDA(cudaEventCreate(&a));
  BB_CHECK_CUDA(cudaEventCreate(&b));
  cudaStream_t cs = cuda::stream_of(0, Stream::compute);
  BB_CHECK_CUDA(cudaEventRecord(a, cs));
  fn()->wait();
  BB_CHECK_CUDA(cudaEventRecord(b, cs));
  BB_CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  BB_CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

TEST(EmulatedGpu, TheWireHoldsTheStreamForTheModelledTime) {
  BB_REQUIRE_GPU();
  comm::EmulateConfig c = job(8, 3);
  c.link.intra_gbps = 20;  // a slow wire: milliseconds for a few MiB, far above launch noise
  comm::GroupPtr g = comm::make_emulated_world(c);
  const std::vector<int> all = {0, 1, 2, 3, 4, 5, 6, 7};
  const int64_t n = int64_t{1} << 18;  // 1 MiB of f32 per block
  Tensor in = gpu(test::randn(static_cast<size_t>(8 * n), 1), {8 * n});
  Tensor out = Tensor::empty({8 * n}, DType::f32, kGpu, MemCategory::other);
  Tensor blk = Tensor::empty({n}, DType::f32, kGpu, MemCategory::other);
  const std::vector<int64_t> rows(8, n / 2);
  struct Case {
    const char* op;
    double model_s;
    std::function<comm::WorkPtr()> fn;
  };
  const std::vector<Case> cases = {
      {"all_gather", c.link.all_gather_s(all, 8 * n * 4), [&] { return g->all_gather(blk, out); }},
      {"reduce_scatter", c.link.reduce_scatter_s(all, 8 * n * 4), [&] { return g->reduce_scatter(in, blk); }},
      {"all_reduce", c.link.all_reduce_s(all, 8 * n * 4), [&] { return g->all_reduce(in); }},
      // n / 2 rows of 2 floats (4 n bytes) to and from every member
      {"all_to_all_v",
       c.link.all_to_all_s(all, 3, std::vector<int64_t>(8, 4 * n), std::vector<int64_t>(8, 4 * n)),
       [&] { return g->all_to_all_v(in.view({4 * n, 2}), rows, out.view({4 * n, 2}), rows); }},
  };
  for (const Case& k : cases) {
    compute_ms(k.fn);  // warm-up
    const double ms = compute_ms(k.fn), want = k.model_s * 1e3;
    std::printf("%-14s modelled %.3f ms, measured %.3f ms\n", k.op, want, ms);
    EXPECT_GT(want, 0.3) << k.op;
    EXPECT_GE(ms, 0.98 * want) << k.op << ": the stream was released before the wire time";
    EXPECT_LE(ms, 1.1 * want + 0.05) << k.op << ": the stream was held past the wire time";
  }
  // wire_scale 0: an infinitely fast wire, only the local copies.
  c.wire_scale = 0;
  comm::GroupPtr fast = comm::make_emulated_world(c);
  compute_ms([&] { return fast->all_gather(blk, out); });
  EXPECT_LT(compute_ms([&] { return fast->all_gather(blk, out); }), 0.1);
}

TEST(EmulatedGpu, DeviceCollectivesWriteWhatTheHostOnesWrite) {
  BB_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    for (int rank : {0, 2}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " rank " + std::to_string(rank));
      comm::GroupPtr g = comm::make_emulated_world(job(4, rank));
      const std::vector<float> v = test::randn(24, 10 + rank);
      auto both = [&](const char* what, const std::function<Tensor(Device)>& op) {
        const std::vector<float> h = op(Device::cpu()).to_floats(), d = op(kGpu).to_floats();
        EXPECT_EQ(h, d) << what;
      };
      auto on = [&](Device dev, const std::vector<float>& x, const Shape& s) {
        Tensor t = Tensor::from_floats(x, s, dt);
        return dev.is_cpu() ? t : t.to(dev, MemCategory::other);
      };
      auto fresh = [&](Device dev, const Shape& s) {  // GPU memory is poisoned (NaN) when fresh
        Tensor t = Tensor::empty(s, dt, dev, MemCategory::other);
        if (dev.is_cpu()) t.fill_(-7.0);
        return t;
      };
      both("all_reduce sum", [&](Device dev) {
        Tensor t = on(dev, v, {24});
        g->all_reduce(t)->wait();
        return t;
      });
      both("reduce_scatter", [&](Device dev) {
        Tensor o = fresh(dev, {6});
        g->reduce_scatter(on(dev, v, {24}), o)->wait();
        return o;
      });
      both("all_gather", [&](Device dev) {
        Tensor o = fresh(dev, {24});
        g->all_gather(on(dev, std::vector<float>(v.begin(), v.begin() + 6), {6}), o)->wait();
        return o;
      });
      both("all_gather_v", [&](Device dev) {
        Tensor o = fresh(dev, {8, 3});
        const std::vector<int64_t> counts = {3, 1, 2, 2};
        const int64_t mine = counts[static_cast<size_t>(rank)];
        g->all_gather_v(on(dev, std::vector<float>(v.begin(), v.begin() + mine * 3), {mine, 3}), o, counts)->wait();
        return o;
      });
      both("all_to_all_v", [&](Device dev) {
        Tensor o = fresh(dev, {8, 3});
        // Rank 0's own rows agree (2), as rank 2's (3); the clones' rows fit some blocks, not others.
        const std::vector<int64_t> rc = rank == 0 ? std::vector<int64_t>{2, 1, 2, 3} : std::vector<int64_t>{1, 1, 3, 3};
        g->all_to_all_v(on(dev, v, {8, 3}), {2, 1, 3, 2}, o, rc)->wait();
        return o;
      });
    }
  }
}

// With the wire slowed, a read of the output on the compute stream that does not wait for the
// collective sees the buffer as it was; with the wait, the gathered values. This is what makes a
// missing wait fail the slowed runs below.
TEST(EmulatedGpu, AReadThatSkipsTheWaitSeesTheBufferBeforeTheWire) {
  BB_REQUIRE_GPU();
  comm::EmulateConfig c = job(4, 1);
  c.wire_scale = 5000;  // ~50 ms for a small all_gather
  comm::GroupPtr g = comm::make_emulated_world(c);
  Tensor in = gpu({1, 2, 3}, {3});
  Tensor out = gpu(std::vector<float>(12, -1.f), {12});
  comm::WorkPtr w = g->all_gather(in, out);
  EXPECT_EQ(out.to_floats(), std::vector<float>(12, -1.f)) << "the data landed before the wire time";
  w->wait();
  EXPECT_EQ(out.to_floats(), (std::vector<float>{1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3}));
}

// ---- the trainer's overlapped paths under slowed communication ----------------------------

// A Qwen3.5-shaped model at GPU test sizes (Gated DeltaNet key / value dims 128, gated attention
// of head dim 256): `attention` adds a full-attention layer after the linear ones.
std::string write_model(const std::string& dir, bool attention) {
  test::Qwen35Dims d;
  d.vocab = 300;  // the demo corpus' ids are below 264
  d.hidden = 64;
  d.layers = 2;
  d.heads = 4;
  d.kv_heads = 2;
  d.head_dim = 256;
  d.rotary = 0.25;
  d.moe_ffn = 32;
  d.shared_ffn = 32;
  d.experts = 8;
  d.top_k = 2;
  d.lin_key_heads = 2;
  d.lin_value_heads = 4;
  d.lin_key_dim = 128;
  d.lin_value_dim = 128;
  ModelConfig m = test::qwen35_config(d);
  m.layer_types = {LayerType::linear_attention, attention ? LayerType::full_attention : LayerType::linear_attention};
  const std::string path = dir + (attention ? "/attn.json" : "/gdn.json");
  std::ofstream(path) << m.to_hf_json().dump(2);
  return path;
}

struct Outcome {
  std::vector<double> loss, grad_norm;
  std::vector<std::vector<float>> state;  // every unit's owned master and moments after the run
  int64_t layer_waits = 0;                // the host's waits of backend.max_layers_ahead
};

Outcome train(const std::string& model, const std::vector<std::string>& layout, double wire_scale) {
  std::ostringstream toml;
  toml << "[model]\nconfig = \"" << model << "\"\n"
       << "[primitives]\nloss = \"linear_ce\"\nexperts = \"grouped\"\n"
       << "[parallel]\ndevice = \"cuda\"\ncomm = \"emulated\"\n"
       << "[emulate]\nranks = 4\nrank = 1\nwire_scale = " << wire_scale << "\n"
       << "[train]\nsteps = 2\nmicro_batch_tokens = 256\nlr = 3e-3\nwarmup_steps = 1\n"
       << "[data]\ndemo_documents = 50\n";
  Trainer t(parse_run_config(toml.str(), "test_emulated_gpu", layout), nullptr);
  Outcome o;
  for (int i = 0; i < 2; ++i) {
    const StepMetrics m = t.train_step();
    o.loss.push_back(m.loss);
    o.grad_norm.push_back(m.grad_norm);
  }
  for (size_t u = 0; u < t.model().units().size(); ++u) {
    const ModelState::Owned w = t.state().owned(u);
    if (w.len == 0) continue;
    o.state.push_back(t.state().master_f32(u, 0, w.len).to_floats());
    o.state.push_back(w.exp_avg.to_floats());
    o.state.push_back(w.exp_avg_sq.to_floats());
  }
  o.layer_waits = t.schedule().layer_waits();
  return o;
}

void expect_bitwise(const Outcome& a, const Outcome& b, const char* what) {
  EXPECT_EQ(a.loss, b.loss) << what;
  EXPECT_EQ(a.grad_norm, b.grad_norm) << what;
  ASSERT_EQ(a.state.size(), b.state.size()) << what;
  for (size_t i = 0; i < a.state.size(); ++i) EXPECT_EQ(a.state[i], b.state[i]) << what << ": state tensor " << i;
}

struct Layout {
  const char* name;
  bool attention;
  std::vector<std::string> overrides;
};

class SlowedCommunication : public ::testing::TestWithParam<Layout> {};

TEST_P(SlowedCommunication, IsBitwiseTheUnslowedRun) {
  BB_REQUIRE_GPU();
  const Layout& l = GetParam();
  const std::string dir = make_tmpdir();
  const std::string model = write_model(dir, l.attention);
  const Outcome a = train(model, l.overrides, 1), b = train(model, l.overrides, 1);
  // The comparison means something only if the run is deterministic.
  expect_bitwise(a, b, "two unslowed runs");
  for (double x : a.loss) EXPECT_TRUE(std::isfinite(x));
  const Outcome slow = train(model, l.overrides, 500);
  expect_bitwise(a, slow, "the slowed run against the unslowed one");
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, SlowedCommunication,
    ::testing::Values(
        // FSDP over 4 data ranks: every unit gathered before use (the next layer's prefetched),
        // gradients reduce-scattered as the backward goes; the allgather dispatcher.
        Layout{"fsdp_dp4", false, {"primitives.state=\"fsdp\"", "parallel.ep=4"}},
        // Chunked all-to-all over EP 4 (dispatch, experts and combine of neighbouring chunks
        // overlap), zero1's reduce-scatter and gathers after the step.
        Layout{"zero1_ep4_chunked2", false,
               {"primitives.state=\"zero1\"", "parallel.ep=4", "primitives.moe_dispatch=\"chunked_alltoall:2\""}},
        // Full recompute with the memory_efficient permute: the recompute's dispatch without a
        // combine (forward_for_backward), three chunks.
        Layout{"fsdp_ep4_chunked3_recompute",
               false,
               {"primitives.state=\"fsdp\"", "parallel.ep=4", "primitives.moe_dispatch=\"chunked_alltoall:3\"",
                "primitives.recompute=\"full\"", "primitives.permute=\"memory_efficient\""}},
        // Context parallelism 2: the Gated DeltaNet head exchange, EP folded over cp x dp.
        Layout{"cp2_gdn_ep4", false,
               {"parallel.cp=2", "parallel.ep=4", "primitives.attention=\"cp_ring\"",
                "primitives.moe_dispatch=\"chunked_alltoall:2\"", "primitives.state=\"fsdp\""}},
        // cp_ring and cp_a2a attention beside a Gated DeltaNet layer.
        Layout{"cp2_ring", true, {"parallel.cp=2", "primitives.attention=\"cp_ring\"", "parallel.ep=2"}},
        Layout{"cp2_a2a", true, {"parallel.cp=2", "primitives.attention=\"cp_a2a\"", "parallel.ep=2"}}),
    [](const ::testing::TestParamInfo<Layout>& i) { return std::string(i.param.name); });

// backend.max_layers_ahead = 1: with the wire slowed the host would run ahead of the GPU in the
// backward (no host sync there; the forward reads each MoE layer's router counts, so the host
// never gets a whole layer ahead of it, and this model has two layers): the limit makes it wait
// (it did), and the results are bitwise those without the limit.
TEST(EmulatedGpu, PacingTheHostChangesNothingButTheWaits) {
  BB_REQUIRE_GPU();
  const std::string dir = make_tmpdir();
  const std::string model = write_model(dir, false);
  const std::vector<std::string> layout = {"parallel.ep=4", "primitives.moe_dispatch=\"chunked_alltoall:2\"",
                                           "primitives.state=\"fsdp\"", "backend.max_layers_ahead=1"};
  std::vector<std::string> unpaced = layout;
  unpaced.back() = "backend.max_layers_ahead=0";
  const Outcome paced = train(model, layout, 500), free = train(model, unpaced, 500);
  EXPECT_GT(paced.layer_waits, 0) << "the host never had to wait for the GPU";
  EXPECT_EQ(free.layer_waits, 0);
  expect_bitwise(paced, free, "max_layers_ahead 2 against no limit");
}

// backend.expert_wgrad_stream: the experts' weight gradient on the wgrad stream, beside the
// dispatch-backward all-to-all and the layer's attention backward. Bitwise the run without it,
// with the wire at its modelled speed and slowed 500 x (the all-to-alls then end long after the
// wgrad started: a reduction or an optimizer that did not wait for the wgrad stream, or a
// buffer of the wgrad's reused too early, would change bits), over fsdp's per-layer
// reduce-scatter, zero1's reduction after the backward, and full recompute.
TEST(EmulatedGpu, ExpertWgradStreamIsBitIdentical) {
  BB_REQUIRE_GPU();
  const std::string dir = make_tmpdir();
  const std::string model = write_model(dir, true);
  const std::vector<std::vector<std::string>> layouts = {
      {"primitives.state=\"fsdp\"", "parallel.ep=4", "primitives.moe_dispatch=\"chunked_alltoall:2\""},
      {"primitives.state=\"zero1\"", "parallel.ep=4", "primitives.moe_dispatch=\"alltoall\"",
       "primitives.recompute=\"full\"", "primitives.permute=\"memory_efficient\""},
      {"primitives.state=\"fsdp\"", "parallel.ep=4", "primitives.moe_dispatch=\"allgather\""}};
  for (const auto& l : layouts) {
    std::vector<std::string> off = l, on = l;
    off.push_back("backend.expert_wgrad_stream=false");
    on.push_back("backend.expert_wgrad_stream=true");
    const Outcome a = train(model, off, 1), b = train(model, on, 1), slow = train(model, on, 500);
    for (double x : a.loss) EXPECT_TRUE(std::isfinite(x));
    expect_bitwise(a, b, (l[0] + " " + l[2] + ": the wgrad stream against the compute stream").c_str());
    expect_bitwise(a, slow, (l[0] + " " + l[2] + ": the wgrad stream with the wire slowed 500 x").c_str());
  }
}

// A collective that never completes (emulate.hang_at_op: its wire kernel holds the stream, as a
// collective whose peer died would) ends the job within parallel.timeout_s, with exit status 3
// and a message naming the operation and its group: the collective watchdog (comm/watchdog.h),
// whatever the host is blocked in meanwhile (a read of router counts or of the loss has no
// deadline of its own).
TEST(EmulatedGpuDeathTest, AHungCollectiveEndsTheJobNamingIt) {
  BB_REQUIRE_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child starts afresh (CUDA is not fork-safe)
  const std::string dir = make_tmpdir();
  const std::string model = write_model(dir, false);
  const std::vector<std::string> layout = {"parallel.ep=4", "primitives.moe_dispatch=\"chunked_alltoall:2\"",
                                           "primitives.state=\"fsdp\"", "emulate.hang_at_op=5",
                                           "parallel.timeout_s=3"};
  EXPECT_EXIT(
      {
        const auto t0 = std::chrono::steady_clock::now();
        train(model, layout, 1);
        std::fprintf(stderr, "the job went on for %.1f s\n",
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        std::exit(0);
      },
      ::testing::ExitedWithCode(3),
      "communication timeout: [a-z_]+ on group '[a-z]+' \\([0-9]+ ranks, [a-z]+ stream, emulated operation #5\\) did "
      "not complete within parallel.timeout_s = 3 s");
}

#endif

}  // namespace
}  // namespace bb
