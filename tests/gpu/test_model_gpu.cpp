// The whole model on a GPU: the same tiny run on the GPU (bf16 weights, fp32 master) and on the
// CPU (f32) from the same seed gives matching loss curves.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <tuple>

#include "common/gpu.h"
#include "common/testing.h"
#include "primitives/optim/adamw.h"
#include "runtime/trainer.h"

namespace bb {
namespace {

std::string tiny_run(const std::string& dir) {
  ModelConfig c = load_hf_config("configs/models/demo-tiny/config.json");
  c.hidden_size = 128;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 128;  // cuDNN attention needs a supported head dim
  std::ofstream(dir + "/config.json") << c.to_hf_json().dump(2);
  std::ofstream(dir + "/run.toml") << "[model]\nconfig = \"" << dir << "/config.json\"\n"
                                   << "[primitives]\nloss = \"linear_ce\"\nexperts = \"grouped\"\n"
                                   << "[train]\nsteps = 20\nmicro_batch_tokens = 512\nlr = 3e-3\nwarmup_steps = 2\n"
                                   << "[data]\ndemo_documents = 50\n";
  return dir + "/run.toml";
}

// The worst relative difference between two trainers' gradients after a step (each within `tol`;
// a parameter whose gradient is zero in A must be zero in B). The step's gradients stay until
// the next step zeroes them.
double worst_gradient_diff(Trainer& a, Trainer& b, int step, double tol) {
  std::vector<Param*> pa = a.model().params(), pb = b.model().params();
  EXPECT_EQ(pa.size(), pb.size());
  double worst = 0;
  for (size_t j = 0; j < std::min(pa.size(), pb.size()); ++j) {
    const std::vector<float> ga = pa[j]->grad.to_floats(), gb = pb[j]->grad.to_floats();
    double na = 0;
    for (float g : ga) na += double(g) * g;
    if (na == 0) {
      for (float g : gb) EXPECT_EQ(g, 0.0f) << "step " << step << ": " << pa[j]->name;
      continue;
    }
    const double e = test::rel_error(gb, ga);
    worst = std::max(worst, e);
    EXPECT_LT(e, tol) << "step " << step << ": gradient of " << pa[j]->name;
  }
  return worst;
}

TEST(ModelGpu, LossCurveMatchesCpu) {
  BB_REQUIRE_GPU();
  char tmpl[] = "/tmp/bb_model_gpu_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string run = tiny_run(dir);
  Trainer cpu(load_run_config(run, {"parallel.device=\"cpu\""}), nullptr);
  Trainer gpu(load_run_config(run, {"parallel.device=\"cuda\""}), nullptr);
  double max_diff = 0;
  for (int i = 0; i < 20; ++i) {
    const StepMetrics a = cpu.train_step(), b = gpu.train_step();
    max_diff = std::max(max_diff, std::fabs(a.loss - b.loss));
    std::printf("step %2d  cpu %.5f  gpu %.5f\n", i + 1, a.loss, b.loss);
  }
  // bf16 activations and weights vs f32: the curves agree to a few hundredths of a nat.
  EXPECT_LT(max_diff, 0.05);
}

// Full recompute on the GPU: the same loss and the same gradients of every parameter (cuDNN's
// attention backward accumulates dq with atomics, so the comparison allows bf16-level noise),
// a lower activations peak, and no extra host synchronisation (the recompute replays the
// stashed routing instead of reading the router's counts again).
TEST(ModelGpu, RecomputeFullGivesTheSameGradientsOnGpu) {
  BB_REQUIRE_GPU();
  char tmpl[] = "/tmp/bb_model_gpu_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string run = tiny_run(dir);
  Trainer a(load_run_config(run, {"parallel.device=\"cuda\"", "train.steps=3"}), nullptr);
  Trainer b(load_run_config(run, {"parallel.device=\"cuda\"", "train.steps=3", "primitives.recompute=\"full\""}), nullptr);
  for (int i = 0; i < 3; ++i) {
    const StepMetrics x = a.train_step(), y = b.train_step();
    EXPECT_NEAR(x.loss, y.loss, 1e-6 * std::fabs(x.loss)) << "step " << i + 1;
    EXPECT_LT(y.mem.peak_of(MemCategory::activations), x.mem.peak_of(MemCategory::activations));
    EXPECT_EQ(y.host_syncs, x.host_syncs) << "step " << i + 1 << ": the recompute waited for the device";
    const double worst = worst_gradient_diff(a, b, i + 1, 5e-3);
    std::printf("step %d: loss %.6f vs %.6f, worst gradient rel. diff %.2e, host syncs %lld\n", i + 1,
                x.loss, y.loss, worst, static_cast<long long>(x.host_syncs));
  }
}

// Token-chunked MoE on the GPU ([backend] moe_chunk_tokens = 128: 4 chunks of the 512-token
// micro-batch) under full recompute, with either permute: the loss of the unchunked run (every
// token's rows are the same; printed whether bitwise), every gradient within bf16-level noise
// (the experts' weight gradient is summed chunk by chunk), a moe peak under half the unchunked
// one. Host syncs are printed: the training forward reads each chunk's counts once; the
// recompute and the backward's chunk rebuilds read none (the chunks' counts are stashed).
TEST(ModelGpu, TokenChunkedMoeMatchesUnchunked) {
  BB_REQUIRE_GPU();
  char tmpl[] = "/tmp/bb_model_gpu_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string run = tiny_run(dir);
  for (const char* permute : {"memory_efficient", "standard"}) {
    SCOPED_TRACE(permute);
    const std::vector<std::string> common = {"parallel.device=\"cuda\"", "train.steps=3", "primitives.recompute=\"full\"",
                                             std::string("primitives.permute=\"") + permute + "\""};
    std::vector<std::string> chunked = common;
    chunked.push_back("backend.moe_chunk_tokens=128");
    Trainer a(load_run_config(run, common), nullptr);
    Trainer b(load_run_config(run, chunked), nullptr);
    for (int i = 0; i < 3; ++i) {
      const StepMetrics x = a.train_step(), y = b.train_step();
      EXPECT_NEAR(x.loss, y.loss, 1e-6 * std::fabs(x.loss)) << "step " << i + 1;
      EXPECT_LT(y.mem.peak_of(MemCategory::moe), x.mem.peak_of(MemCategory::moe) / 2) << "step " << i + 1;
      const double worst = worst_gradient_diff(a, b, i + 1, 5e-3);
      std::printf("%s step %d: loss %.9f vs %.9f (%s), worst gradient rel. diff %.2e, moe peak %lld vs %lld B, "
                  "host syncs %lld vs %lld\n",
                  permute, i + 1, x.loss, y.loss, x.loss == y.loss ? "bitwise" : "not bitwise", worst,
                  static_cast<long long>(y.mem.peak_of(MemCategory::moe)),
                  static_cast<long long>(x.mem.peak_of(MemCategory::moe)), static_cast<long long>(y.host_syncs),
                  static_cast<long long>(x.host_syncs));
    }
  }
}

// On one rank each unit's sum of squares runs on the copy stream as soon as its layer's backward
// is done (ModelState::early_norm): the step's grad norm must be bitwise the norm of the
// gradients the step left, summed unit by unit with the same kernels, with the early sums on
// (clipping: grad_norm sums the rest itself) and with the update during the backward (clipping
// off: the sums fused with the updates).
TEST(ModelGpu, EarlyGradNormIsTheNormOfTheStepsGradients) {
  BB_REQUIRE_GPU();
  char tmpl[] = "/tmp/bb_model_gpu_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string run = tiny_run(dir);
  for (const char* clip : {"train.grad_clip=1.0", "train.grad_clip=0"}) {
    SCOPED_TRACE(clip);
    Trainer t(load_run_config(run, {"parallel.device=\"cuda\"", "train.steps=3", clip}), nullptr);
    for (int i = 0; i < 3; ++i) {
      const StepMetrics m = t.train_step();
      double s = 0;
      for (ParamUnit* u : t.model().units())
        if (u->grad.defined() && u->numel > 0) s += sum_of_squares(u->grad.narrow(0, u->numel));
      EXPECT_EQ(m.grad_norm, std::sqrt(s)) << "step " << i + 1;
      EXPECT_TRUE(std::isfinite(m.grad_norm) && m.grad_norm > 0);
    }
  }
}

// [backend] optimizer_in_backward on the GPU: the updates run on the copy stream beside the
// backward (short blocks, lower priority). Bitwise the same losses, gradient norms, masters,
// moments and values as the update after the backward, over steps, for both optimizers (with
// the default split master) and with the separate f32 master; and the units really were updated
// early.
TEST(ModelGpu, UpdateDuringTheBackwardIsBitwiseTheUpdateAfterIt) {
  BB_REQUIRE_GPU();
  char tmpl[] = "/tmp/bb_model_gpu_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string run = tiny_run(dir);
  for (const char* opt : {"primitives.optimizer=\"adamw\"", "primitives.optimizer=\"adamw_bf16_moments\"",
                          "backend.master_storage=\"f32\""}) {
    SCOPED_TRACE(opt);
    auto go = [&](const char* in_backward) {
      Trainer t(load_run_config(run, {"parallel.device=\"cuda\"", "train.steps=4", "train.grad_clip=0", opt,
                                      in_backward}),
                nullptr);
      std::vector<double> out;
      for (int i = 0; i < 4; ++i) {
        const StepMetrics m = t.train_step();
        out.push_back(m.loss);
        out.push_back(m.grad_norm);
        out.push_back(static_cast<double>(t.state().early_updates()));
      }
      std::vector<std::vector<float>> st;
      for (size_t i = 0; i < t.model().units().size(); ++i) {
        const ModelState::Owned o = t.state().owned(i);
        st.push_back(t.state().master_f32(i, 0, o.len).to_floats());
        st.push_back(o.exp_avg.to_floats());
        st.push_back(o.exp_avg_sq.to_floats());
      }
      for (Param* p : t.model().params()) st.push_back(p->value.to_floats());
      st.push_back({static_cast<float>(t.state().embedding_split_updates())});
      return std::make_tuple(out, st, t.model().units().size());
    };
    const auto [a, sa, units] = go("backend.optimizer_in_backward=true");
    // The embedding's untouched rows were updated beside the forward in every step.
    EXPECT_EQ(sa.back(), std::vector<float>{4.0f});
    const auto [b, sb, units_b] = go("backend.optimizer_in_backward=false");
    for (size_t i = 0; i < a.size(); i += 3) {
      EXPECT_EQ(a[i], b[i]) << "loss, step " << i / 3 + 1;
      EXPECT_EQ(a[i + 1], b[i + 1]) << "grad norm, step " << i / 3 + 1;
      EXPECT_EQ(a[i + 2], static_cast<double>(units)) << "units updated early, step " << i / 3 + 1;
      EXPECT_EQ(b[i + 2], 0.0);
    }
    EXPECT_LT(a[9], a[0]);
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i + 1 < sa.size(); ++i) EXPECT_EQ(sa[i], sb[i]) << "state tensor " << i;
  }
}

// primitives.optimizer = "adamw_offload" on the GPU, paired with adamw (the GPU kernels): the
// master and moments live in host memory (no optimizer bytes on the device), the host updates
// them (its loop, the CPU reference's) and the new bf16 values return before the next forward.
// With clipping (the update after the norm, beside the next forward) and without (during the
// backward). Step 1's loss is bitwise (the same start). The two update loops differ by rounding
// only (AdamWGpu.ThreeStepsMatchCpu pairs the device kernel with this loop, the CPU reference's,
// to f32 tolerance); through bf16 values a last-bit difference changes some gradients, and Adam
// moves an element whose gradient is near zero by up to lr whatever its size, so the masters
// drift apart at about lr x steps / |w| where gradients are small. Bounds: loss 1e-3 relative
// at every step, masters 1e-2 relative norm after 6 steps at lr 3e-3 (printed).
TEST(ModelGpu, OptimizerOffloadPairsWithTheDeviceUpdate) {
  BB_REQUIRE_GPU();
  char tmpl[] = "/tmp/bb_model_gpu_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string run = tiny_run(dir);
  for (const char* clip : {"train.grad_clip=1.0", "train.grad_clip=0"}) {
    SCOPED_TRACE(clip);
    auto go = [&](const char* opt) {
      Trainer t(load_run_config(run, {"parallel.device=\"cuda\"", "train.steps=6", clip, opt,
                                      "backend.offload_threads=4"}),
                nullptr);
      std::vector<double> loss;
      int64_t optimizer_bytes = 0;
      for (int i = 0; i < 6; ++i) {
        loss.push_back(t.train_step().loss);
        optimizer_bytes = std::max(optimizer_bytes, allocator_for(Device::cuda(0)).stats().live_of(MemCategory::optimizer));
      }
      std::vector<std::vector<float>> masters;
      for (size_t i = 0; i < t.model().units().size(); ++i) {
        const ModelState::Owned o = t.state().owned(i);
        masters.push_back(t.state().master_f32(i, 0, o.len).to_floats());
      }
      return std::make_tuple(loss, masters, optimizer_bytes);
    };
    const auto [la, ma, ba] = go("primitives.optimizer=\"adamw\"");
    const auto [lb, mb, bb_] = go("primitives.optimizer=\"adamw_offload\"");
    EXPECT_GT(ba, 0);
    EXPECT_EQ(bb_, 0) << "adamw_offload keeps no optimizer state on the device";
    EXPECT_EQ(la[0], lb[0]);
    double worst_loss = 0, worst_master = 0;
    for (size_t i = 0; i < la.size(); ++i) worst_loss = std::max(worst_loss, std::abs(la[i] - lb[i]) / std::abs(la[i]));
    ASSERT_EQ(ma.size(), mb.size());
    for (size_t u = 0; u < ma.size(); ++u) {
      double num = 0, den = 0;
      for (size_t k = 0; k < ma[u].size(); ++k) {
        num += (double(ma[u][k]) - mb[u][k]) * (double(ma[u][k]) - mb[u][k]);
        den += double(ma[u][k]) * ma[u][k];
      }
      worst_master = std::max(worst_master, std::sqrt(num / std::max(den, 1e-300)));
    }
    std::printf("[offload vs adamw, %s] worst loss rel diff %.3g, worst master rel norm %.3g\n", clip, worst_loss,
                worst_master);
    EXPECT_LE(worst_loss, 1e-3);
    EXPECT_LE(worst_master, 1e-2);
    EXPECT_LT(lb.back(), lb.front());
  }
}

}  // namespace
}  // namespace bb
