// Multi-rank: data parallelism with each state family (replicated / zero1 / fsdp) against the
// single-rank run on the same data, the closed-form memory of each family, and distributed
// checkpoints (same-layout resume bit-exact, resume on fewer ranks, export). Runs at any world
// size; the 4 -> 2 resharding test needs 4 ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "common/mpi_main.h"
#include "common/testing.h"
#include "io/fs.h"
#include "models/hf_io.h"
#include "runtime/checkpoint.h"
#include "runtime/run_config.h"
#include "runtime/trainer.h"

namespace bb {
namespace {

using test::world;

bool on_gpu() { return test::device().is_cuda(); }

ModelConfig small_model() {
  ModelConfig c = load_hf_config("configs/models/demo-tiny/config.json");
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = on_gpu() ? 128 : 16;  // cuDNN attention needs a supported head dim
  c.intermediate_size = 48;
  c.moe_intermediate_size = 24;
  c.num_experts = 4;
  c.top_k = 2;
  return c;
}

// CPU: fp32, so a multi-rank run differs from the single-rank one only by the order of fp32
// sums. GPU: bf16 weights (a 1-ulp bf16 difference of a weight is 4e-3 relative) and kernels
// with atomic accumulation, so the bf16 tolerances of DESIGN.md sec. 10.
double tol_loss() { return on_gpu() ? 2e-3 : 1e-6; }
double tol_param() { return on_gpu() ? 1e-2 : 1e-5; }
double tol_gnorm() { return on_gpu() ? 2e-2 : 1e-6; }

// A run config over a shared directory (rank 0 writes the model config).
struct TestRun {
  std::string dir;
  std::string toml;
};

TestRun make_run(const char* tag, const ModelConfig& m = small_model()) {
  TestRun r;
  r.dir = test::shared_tmpdir(tag);
  if (world()->rank() == 0) std::ofstream(r.dir + "/config.json") << m.to_hf_json().dump(2);
  world()->barrier();
  r.toml = "[model]\nconfig = \"" + r.dir + "/config.json\"\n" +
           "[train]\nsteps = 10\nmicro_batch_tokens = 80\nlr = 5e-3\nmin_lr = 5e-4\nwarmup_steps = 2\nseed = 11\n"
           "grad_clip = 0.5\n"
           "[data]\npath = \"demo\"\ndemo_documents = 60\n"
           // No checkpoint.dir: the tests save with save_checkpoint(DIR) and compare several
           // trainers alive at once, which one locked root would refuse.
           "[checkpoint]\nevery = 0\nsave_final = false\n";
  return r;
}

// With --device=cuda the runs are on the GPU (bf16 weights) over the test's backend.
RunConfig config(const TestRun& r, std::vector<std::string> ov) {
  if (on_gpu()) {
    ov.insert(ov.begin(), {"parallel.device=\"cuda\"",
                           std::string("parallel.comm=\"") + comm::backend_name(world()->backend()) + "\""});
  }
  return parse_run_config(r.toml, "test run", ov);
}

double rel(double a, double b) { return std::abs(a - b) / std::max(1e-30, std::abs(b)); }

// ||a - b|| / ||b|| over a whole unit.
double rel_norm(const Tensor& a, const Tensor& b) {
  std::vector<float> x = a.to_floats(), y = b.to_floats();
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (static_cast<double>(x[i]) - y[i]) * (static_cast<double>(x[i]) - y[i]);
    den += static_cast<double>(y[i]) * y[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

const char* kKinds[] = {"replicated", "zero1", "fsdp"};

// DP = R with grad_accum A equals DP = 1 with grad_accum R x A: losses and grad norms of the
// first 10 steps to 1e-6, final parameters to 1e-5, for every state family.
TEST(State, DataParallelEqualsTheSingleRankRun) {
  const int R = world()->size();
  TestRun run = make_run("dp");
  for (int64_t accum : {1, 2}) {
    Trainer ref(config(run, {"train.grad_accum=" + std::to_string(R * accum)}), nullptr, Corpus{}, comm::self_group());
    std::vector<StepMetrics> want;
    for (int s = 0; s < 10; ++s) want.push_back(ref.train_step());
    for (const char* kind : kKinds) {
      SCOPED_TRACE(std::string(kind) + " accum " + std::to_string(accum) + " ranks " + std::to_string(R));
      Trainer t(config(run, {"train.grad_accum=" + std::to_string(accum), std::string("primitives.state=\"") + kind + "\""}),
                nullptr, Corpus{}, world());
      ASSERT_EQ(t.mesh().layout().dp, R);
      for (int s = 0; s < 10; ++s) {
        const StepMetrics m = t.train_step();
        EXPECT_LE(rel(m.loss, want[static_cast<size_t>(s)].loss), tol_loss()) << "step " << s + 1;
        EXPECT_LE(rel(m.grad_norm, want[static_cast<size_t>(s)].grad_norm), tol_gnorm()) << "step " << s + 1;
        EXPECT_EQ(m.valid_tokens, want[static_cast<size_t>(s)].valid_tokens);
        EXPECT_EQ(m.tokens, want[static_cast<size_t>(s)].tokens);
      }
      std::vector<ParamUnit*> units = t.model().units();
      for (size_t i = 0; i < units.size(); ++i) {
        Tensor a = t.state().gather_master(i), b = ref.state().gather_master(i);
        EXPECT_LE(rel_norm(a, b), tol_param()) << units[i]->name;
      }
      // The parameter values every rank computes with are the masters (f32 on the CPU): check
      // the whole ones where the family keeps them whole.
      if (std::string(kind) != "fsdp")
        for (Param* p : t.model().params())
          EXPECT_LE(rel_norm(p->value, ref.model().find_param(p->name)->value), tol_param()) << p->name;
    }
  }
}

// Per-rank bytes of params, grads and optimizer equal the closed forms of state.h exactly: after
// construction (live) and as the step's peak.
TEST(State, MemoryEqualsTheClosedForms) {
  const int64_t R = world()->size();
  TestRun run = make_run("mem");
  Allocator& alloc = allocator_for(test::device());
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    const MemoryStats before = alloc.stats();
    ASSERT_EQ(before.live_of(MemCategory::params), 0) << "another model is alive";
    Trainer t(config(run, {std::string("primitives.state=\"") + kind + "\""}), nullptr, Corpus{}, world());
    // The closed forms, written out: n per unit, S = ceil(n / R), b-byte values.
    const int64_t b = static_cast<int64_t>(dtype_size(t.config().resolved_param_dtype()));
    int64_t params = 0, grads = 0, opt = 0;
    std::vector<int64_t> sizes;
    for (ParamUnit* u : t.model().units()) {
      const int64_t n = u->numel, S = (n + R - 1) / R;
      const std::string k = kind;
      params += b * (k == "replicated" ? n : k == "zero1" ? R * S : S);
      grads += 4 * (k == "replicated" ? n : k == "zero1" ? R * S : S);
      opt += 12 * (k == "replicated" ? n : S);
      sizes.push_back(R);
    }
    const StateBytes sb = state_bytes(t.config().prim.state.value, t.model().units(), sizes, b);
    EXPECT_EQ(sb.params, params);
    EXPECT_EQ(sb.grads, grads);
    EXPECT_EQ(sb.optimizer, opt);
    const MemoryStats live = alloc.stats();
    EXPECT_EQ(live.live_of(MemCategory::params), params);
    EXPECT_EQ(live.live_of(MemCategory::grads), grads);
    EXPECT_EQ(live.live_of(MemCategory::optimizer), opt);
    for (int s = 0; s < 2; ++s) {
      const StepMetrics m = t.train_step();
      EXPECT_EQ(m.mem.peak_of(MemCategory::params), params);
      EXPECT_EQ(m.mem.peak_of(MemCategory::grads), grads);
      EXPECT_EQ(m.mem.peak_of(MemCategory::optimizer), opt);
      if (std::string(kind) == "fsdp" && R > 1) {
        // Gathered units live in comm, bounded by two layers' units plus the largest end unit
        // (values, and the whole f32 gradients of units in backward).
        int64_t layer_max = 0, end_max = 0;
        for (ParamUnit* u : t.model().units()) {
          const int64_t full = (b + 4) * R * ((u->numel + R - 1) / R);  // value + f32 gradient
          if (u->layer >= 0) layer_max = std::max(layer_max, full);
          else end_max = std::max(end_max, full);
        }
        EXPECT_GT(m.mem.peak_of(MemCategory::comm), 0);
        EXPECT_LE(m.mem.peak_of(MemCategory::comm), 2 * 3 * layer_max + 2 * end_max);
      }
    }
  }
}

TEST(State, SameLayoutResumeIsBitExact) {
  TestRun run = make_run("resume");
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    const std::vector<std::string> ov = {std::string("primitives.state=\"") + kind + "\""};
    Trainer a(config(run, ov), nullptr, Corpus{}, world());
    for (int s = 0; s < 4; ++s) a.train_step();
    const std::string ck = a.save_checkpoint(run.dir + "/ck_" + kind);
    EXPECT_TRUE(path_exists(ck + "/shards/rank_00000.safetensors"));
    std::vector<StepMetrics> cont;
    for (int s = 0; s < 4; ++s) cont.push_back(a.train_step());
    std::vector<std::string> ov2 = ov;
    ov2.push_back("checkpoint.resume=\"" + run.dir + "/ck_" + kind + "\"");
    Trainer b(config(run, ov2), nullptr, Corpus{}, world());
    ASSERT_EQ(b.step(), 4);
    // Bit for bit on the CPU; on a GPU within the bf16 tolerance (atomic accumulations).
    for (int s = 0; s < 4; ++s) {
      const StepMetrics m = b.train_step();
      if (on_gpu()) {
        EXPECT_LE(rel(m.loss, cont[static_cast<size_t>(s)].loss), tol_loss()) << "step " << m.step;
      } else {
        EXPECT_EQ(m.loss, cont[static_cast<size_t>(s)].loss) << "step " << m.step;
        EXPECT_EQ(m.grad_norm, cont[static_cast<size_t>(s)].grad_norm) << "step " << m.step;
      }
    }
    for (size_t i = 0; i < a.model().units().size(); ++i) {
      if (on_gpu()) EXPECT_LE(rel_norm(b.state().gather_master(i), a.state().gather_master(i)), tol_param());
      else EXPECT_EQ(b.state().gather_master(i).to_floats(), a.state().gather_master(i).to_floats());
    }
  }
}

// Saved on 4 ranks (dp 4, grad_accum 1), resumed on 2 (dp 2, grad_accum 2: the same global
// batch) by each half of the job: the same losses as the 4-rank run going on.
TEST(State, ResumeOnFewerRanksReshards) {
  const int R = world()->size();
  if (R != 4) GTEST_SKIP() << "needs 4 ranks (runs in the np4 variant)";
  TestRun run = make_run("reshard");
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    const std::string ckdir = run.dir + "/ck4_" + kind;
    const std::string state = std::string("primitives.state=\"") + kind + "\"";
    Trainer a(config(run, {state}), nullptr, Corpus{}, world());
    for (int s = 0; s < 3; ++s) a.train_step();
    a.save_checkpoint(ckdir);
    std::vector<StepMetrics> cont;
    for (int s = 0; s < 3; ++s) cont.push_back(a.train_step());
    comm::GroupPtr half = world()->split(world()->rank() / 2, world()->rank(), "half");
    Trainer b(config(run, {state, "train.grad_accum=2", "checkpoint.resume=\"" + ckdir + "\""}), nullptr, Corpus{},
              half);
    ASSERT_EQ(b.mesh().layout().dp, 2);
    ASSERT_EQ(b.step(), 3);
    for (int s = 0; s < 3; ++s) {
      const StepMetrics m = b.train_step();
      EXPECT_LE(rel(m.loss, cont[static_cast<size_t>(s)].loss), tol_loss()) << "step " << m.step;
      EXPECT_LE(rel(m.grad_norm, cont[static_cast<size_t>(s)].grad_norm), tol_gnorm()) << "step " << m.step;
    }
  }
}

// `bumblebee export` consolidates the shards: the exported weights are the gathered masters.
TEST(State, ExportConsolidatesTheShards) {
  TestRun run = make_run("export");
  Trainer a(config(run, {"primitives.state=\"fsdp\""}), nullptr, Corpus{}, world());
  for (int s = 0; s < 2; ++s) a.train_step();
  const std::string ck = a.save_checkpoint(run.dir + "/ck");
  std::vector<Tensor> masters;
  for (size_t i = 0; i < a.model().units().size(); ++i) masters.push_back(a.state().gather_master(i));
  if (world()->rank() == 0) {
    HfExportOptions eo;
    eo.dtype = DType::f32;
    export_distributed_checkpoint(ck, run.dir + "/hf", eo);
    DecoderModel m(small_model(), ModelOptions{}, 99);
    load_hf_weights(m, run.dir + "/hf");
    std::vector<ParamUnit*> units = m.units();
    for (size_t i = 0; i < units.size(); ++i)
      EXPECT_EQ(units[i]->value.to_floats(), masters[i].to_floats()) << units[i]->name;
  }
  world()->barrier();
}

}  // namespace
}  // namespace bb
