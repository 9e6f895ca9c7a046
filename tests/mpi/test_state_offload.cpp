// Multi-rank: primitives.optimizer = "adamw_offload" (the master and moments in host memory,
// updated by the host pool beside the backward and the next forward) against "adamw" on the same
// ranks, bit for bit: losses and gradient norms of every step (so each forward used the updated
// values), then the gathered masters, each rank's moments and the values, in every state family
// (each rank offloads its own shard; zero1 gathers the values after the host update), with
// clipping (the update after the norm), without it (the update opened at the step's start and
// run during the backward), with grad_accum 2, and with bf16 values rounded as the split master
// storage rounds them. And a checkpoint of either resumes with the other.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "common/mpi_main.h"
#include "common/testing.h"
#include "common/tiny_models.h"
#include "runtime/run_config.h"
#include "runtime/trainer.h"

namespace bb {
namespace {

using test::world;

bool on_gpu() { return test::device().is_cuda(); }

struct TestRun {
  std::string dir;
  std::string toml;
};

TestRun make_run(const char* tag) {
  TestRun r;
  r.dir = test::shared_tmpdir(tag);
  const ModelConfig m = test::small_moe({.layers = 2, .experts = 4, .head_dim = on_gpu() ? 128 : 16});
  if (world()->rank() == 0) std::ofstream(r.dir + "/config.json") << m.to_hf_json().dump(2);
  world()->barrier();
  r.toml = "[model]\nconfig = \"" + r.dir + "/config.json\"\n" +
           "[train]\nsteps = 10\nmicro_batch_tokens = 80\nlr = 5e-3\nmin_lr = 5e-4\nwarmup_steps = 2\nseed = 11\n"
           "grad_clip = 0.5\nweight_decay = 0.1\n"
           "[data]\npath = \"demo\"\ndemo_documents = 60\n"
           "[checkpoint]\nevery = 0\nsave_final = false\n";
  return r;
}

RunConfig config(const TestRun& r, std::vector<std::string> ov) {
  if (on_gpu())
    ov.insert(ov.begin(), {"parallel.device=\"cuda\"",
                           std::string("parallel.comm=\"") + comm::backend_name(world()->backend()) + "\""});
  // Two host threads per rank: the ranks share the CI machine's cores.
  ov.push_back("backend.offload_threads=2");
  return parse_run_config(r.toml, "test run", ov);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.numel() != b.numel() || a.dtype() != b.dtype()) return false;
  const Tensor x = a.device().is_cpu() ? a : a.to(Device::cpu());
  const Tensor y = b.device().is_cpu() ? b : b.to(Device::cpu());
  return std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

void expect_same_state(Trainer& got, Trainer& want) {
  const std::vector<ParamUnit*> units = want.model().units();
  for (size_t i = 0; i < units.size(); ++i) {
    EXPECT_TRUE(same_bits(got.state().gather_master(i), want.state().gather_master(i))) << units[i]->name << " master";
    const ModelState::Owned a = got.state().owned(i), b = want.state().owned(i);
    ASSERT_EQ(a.len, b.len) << units[i]->name;
    if (a.len == 0) continue;
    EXPECT_TRUE(same_bits(a.exp_avg, b.exp_avg)) << units[i]->name << " exp_avg";
    EXPECT_TRUE(same_bits(a.exp_avg_sq, b.exp_avg_sq)) << units[i]->name << " exp_avg_sq";
  }
  if (got.config().prim.state.name != "fsdp")
    for (Param* p : got.model().params())
      EXPECT_TRUE(same_bits(p->value, want.model().find_param(p->name)->value)) << p->name << " values";
}

const char* kKinds[] = {"replicated", "zero1", "fsdp"};
const std::string kOffload = "primitives.optimizer=\"adamw_offload\"";

TEST(StateOffload, EqualsAdamWBitForBitInEveryFamily) {
  if (on_gpu()) GTEST_SKIP() << "bit for bit on the CPU; the GPU's kernels round differently (paired on the GPU)";
  TestRun run = make_run("offload");
  const std::vector<std::vector<std::string>> variants = {
      {},                                                              // clipping: the update after the norm
      {"train.grad_clip=0", "backend.optimizer_in_backward=true"},    // the update during the backward
      {"train.grad_accum=2"},
      {"model.dtype=\"bf16\"", "backend.master_storage=\"split\""},  // bf16 values rounded ties-away
      {"model.dtype=\"bf16\"", "backend.master_storage=\"f32\""},    // ... to nearest even
  };
  for (const std::vector<std::string>& v : variants) {
    for (const char* kind : kKinds) {
      std::vector<std::string> ov = v;
      ov.push_back(std::string("primitives.state=\"") + kind + "\"");
      std::string label = kind;
      for (const std::string& o : v) label += " " + o;
      SCOPED_TRACE(label + " ranks " + std::to_string(world()->size()));
      Trainer want(config(run, ov), nullptr, Corpus{}, world());
      ov.push_back(kOffload);
      Trainer got(config(run, ov), nullptr, Corpus{}, world());
      ASSERT_NE(got.state().offload(), nullptr);
      for (int s = 0; s < 6; ++s) {
        const StepMetrics a = got.train_step(), b = want.train_step();
        EXPECT_EQ(a.loss, b.loss) << "step " << s + 1;
        EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << s + 1;
      }
      expect_same_state(got, want);
    }
  }
}

// adamw and adamw_offload hold the same state: 3 steps of one, a checkpoint, 3 steps of the
// other equal 6 steps of adamw.
TEST(StateOffload, ACheckpointResumesAcrossAdamWAndItsOffload) {
  if (on_gpu()) GTEST_SKIP() << "bit for bit on the CPU";
  TestRun run = make_run("offload_resume");
  const std::string zero1 = "primitives.state=\"zero1\"";
  Trainer straight(config(run, {zero1}), nullptr, Corpus{}, world());
  std::vector<StepMetrics> want;
  for (int s = 0; s < 6; ++s) want.push_back(straight.train_step());
  for (const bool offload_first : {true, false}) {
    SCOPED_TRACE(offload_first ? "offload, then adamw" : "adamw, then offload");
    const std::string ck = run.dir + (offload_first ? "/ck_a" : "/ck_b");
    std::vector<std::string> first = {zero1}, second = {zero1, "checkpoint.resume=\"" + ck + "\""};
    (offload_first ? first : second).push_back(kOffload);
    {
      Trainer a(config(run, first), nullptr, Corpus{}, world());
      for (int s = 0; s < 3; ++s) EXPECT_EQ(a.train_step().loss, want[static_cast<size_t>(s)].loss);
      a.save_checkpoint(ck);
    }
    Trainer b(config(run, second), nullptr, Corpus{}, world());
    ASSERT_EQ(b.step(), 3);
    for (int s = 3; s < 6; ++s) {
      const StepMetrics m = b.train_step();
      EXPECT_EQ(m.loss, want[static_cast<size_t>(s)].loss) << "step " << s + 1;
      EXPECT_EQ(m.grad_norm, want[static_cast<size_t>(s)].grad_norm) << "step " << s + 1;
    }
    expect_same_state(b, straight);
  }
}

}  // namespace
}  // namespace bb
