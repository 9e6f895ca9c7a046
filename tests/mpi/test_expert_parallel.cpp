// Multi-rank: expert parallelism in the trainer (parallel.ep, primitives.moe_dispatch) against
// the single-rank run on the same data, with parallel folding: on 4 ranks EP4 (dp 4 on the dense
// side, every rank's experts a quarter of them) and DP2 x EP2 (dp 4, ep 2: two EP groups of two
// ranks, each expert on one rank of each group); on 2 ranks EP2. For every dispatcher member
// (allgather, alltoall, chunked_alltoall:1..4): 5 steps over packed sequences of mixed lengths
// give the single-rank losses, aux losses and grad norms to 1e-6 relative, the same token
// counts and the same routing (a hash of every layer's top-k ids per micro-batch), and the
// expert units hold exactly their experts. chunked_alltoall:N with the `grouped` experts equals
// alltoall bit for bit. The state families shard expert units over the expert-data group;
// checkpoints move between EP degrees (EP_R -> EP1 and EP1 -> EP_R, and EP4 -> EP2 on 4 ranks);
// the HF loader reads only a rank's experts; bad layouts are clear errors.
// mpi-ranks: 2 4   (every test needs 2 or 4 ranks (ep divides the 8 experts and the ranks))
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <tuple>

#include "common/mpi_main.h"
#include "common/testing.h"
#include "common/trainer_equivalence.h"
#include "common/tiny_models.h"
#include "io/fs.h"
#include "models/hf_io.h"
#include "models/moe_block.h"
#include "runtime/checkpoint.h"
#include "runtime/run_config.h"
#include "runtime/trainer.h"

namespace bb {
namespace {

using test::world;

constexpr int kSteps = 5;

ModelConfig small_model() { return test::small_moe(); }  // layer 0 dense, layers 1 and 2 MoE: 8 experts top-2

struct TestRun {
  std::string dir, toml;
};

TestRun make_run(const char* tag) {
  TestRun r;
  r.dir = test::shared_tmpdir(tag);
  if (world()->rank() == 0) std::ofstream(r.dir + "/config.json") << small_model().to_hf_json().dump(2);
  world()->barrier();
  // Packed micro-batches of 80 tokens from demo documents of mixed lengths; z-loss on so that
  // both router losses are exercised. lr 2e-3: AdamW turns fp32 rounding noise in near-zero
  // gradients into full-size updates, so the layouts' (legitimate) ulp differences grow with
  // the learning rate; at 5e-3 the 5th step's grad norm differed by up to 7e-7 (BLAS expert
  // GEMMs over the rows of 4 ranks round differently than over one rank's), at 2e-3 by < 1e-7
  // on every layout and member, the same as pure data parallelism.
  r.toml = "[model]\nconfig = \"" + r.dir + "/config.json\"\n" +
           "[train]\nsteps = 10\nmicro_batch_tokens = 80\nlr = 2e-3\nmin_lr = 2e-4\nwarmup_steps = 2\nseed = 11\n"
           "grad_clip = 0.5\nz_loss_coef = 1e-3\n"
           "[data]\npath = \"demo\"\ndemo_documents = 60\n"
           "[checkpoint]\nevery = 0\nsave_final = false\n";
  return r;
}

RunConfig config(const TestRun& r, const std::vector<std::string>& ov) { return parse_run_config(r.toml, "test run", ov); }

using test::Reference;
using test::rel;

// The single-rank reference: the whole global batch (R micro-batches per step) on one rank.
Reference reference(const TestRun& run, std::vector<std::string> ov, int steps = kSteps) {
  ov.push_back("train.grad_accum=" + std::to_string(world()->size()));
  return test::reference_run(config(run, ov), Corpus{}, steps);
}

void expect_matches(Trainer& t, Reference& ref, const std::vector<StepMetrics>& got) {
  test::expect_matches(t, ref, got, "ep");
}

std::vector<int64_t> ep_degrees() {
  std::vector<int64_t> out;
  for (int64_t ep = 2; ep <= world()->size(); ++ep)
    if (world()->size() % ep == 0 && small_model().num_experts % ep == 0) out.push_back(ep);
  return out;
}

std::string ov_ep(int64_t ep) { return "parallel.ep=" + std::to_string(ep); }
std::string ov_dispatch(const std::string& m) { return "primitives.moe_dispatch=\"" + m + "\""; }

std::vector<StepMetrics> train(Trainer& t, int steps = kSteps) { return test::train_steps(t, steps); }

TEST(ExpertParallel, EveryDispatcherEqualsTheSingleRankRun) {
  if (ep_degrees().empty()) GTEST_SKIP() << "needs 2 or 4 ranks (runs in the np2 and np4 variants)";
  TestRun run = make_run("ep_members");
  Reference ref = reference(run, {});
  for (int64_t ep : ep_degrees())
    for (const char* m : {"allgather", "alltoall", "chunked_alltoall:1", "chunked_alltoall:2", "chunked_alltoall:3",
                          "chunked_alltoall:4"}) {
      SCOPED_TRACE(std::string(m) + " ep " + std::to_string(ep));
      Trainer t(config(run, {ov_ep(ep), ov_dispatch(m)}), nullptr, Corpus{}, world());
      ASSERT_EQ(t.mesh().layout().dp, world()->size());
      ASSERT_EQ(t.mesh().layout().ep, ep);
      expect_matches(t, ref, train(t));
    }
}

// Expert units are held by the expert-data group (edp = R / ep ranks): zero1 and fsdp shard them
// there (DP2 x EP2: over 2 ranks) while the dense units shard over all R.
TEST(ExpertParallel, StateFamiliesShardExpertUnitsOverTheExpertDataGroup) {
  if (ep_degrees().empty()) GTEST_SKIP() << "needs 2 or 4 ranks";
  TestRun run = make_run("ep_state");
  Reference ref = reference(run, {});
  for (int64_t ep : ep_degrees())
    for (const char* kind : {"zero1", "fsdp"}) {
      SCOPED_TRACE(std::string(kind) + " ep " + std::to_string(ep));
      Trainer t(config(run, {ov_ep(ep), ov_dispatch("alltoall"), std::string("primitives.state=\"") + kind + "\""}),
                nullptr, Corpus{}, world());
      ASSERT_EQ(t.mesh().edp()->size(), world()->size() / ep);
      expect_matches(t, ref, train(t));
    }
}

// chunked_alltoall:N works under full recompute (the recompute forward dispatches again from the
// stashed routing) with the probability folded in before fc2.
TEST(ExpertParallel, ChunkedUnderFullRecomputeAndMemoryEfficientPermute) {
  if (ep_degrees().empty()) GTEST_SKIP() << "needs 2 or 4 ranks";
  TestRun run = make_run("ep_recompute");
  const std::vector<std::string> common = {"primitives.recompute=\"full\"", "primitives.permute=\"memory_efficient\""};
  Reference ref = reference(run, common);
  const int64_t ep = ep_degrees().back();
  std::vector<std::string> ov = common;
  ov.insert(ov.end(), {ov_ep(ep), ov_dispatch("chunked_alltoall:3")});
  Trainer t(config(run, ov), nullptr, Corpus{}, world());
  const std::vector<StepMetrics> got = train(t);
  expect_matches(t, ref, got);
  // The recompute forward rebuilt each MoE layer's state without fc2 or a combine (the layer
  // output is discarded; memory_efficient's backward does not read y_perm): per layer, as many
  // forward_for_backward calls as forwards, and every fc2 and combine belongs to a forward.
  int64_t moe_layers = 0;
  for (Layer& L : t.model().layers())
    for (auto& b : L.blocks)
      if (auto* moe = dynamic_cast<MoeBlock*>(b.get())) {
        const DispatchCounts& c = moe->dispatcher().counts();
        ++moe_layers;
        EXPECT_GT(c.forwards, 0);
        EXPECT_EQ(c.forwards_for_backward, c.forwards);
        EXPECT_EQ(c.expert_forwards, 3 * c.forwards) << "fc2 ran outside the training forward";
        EXPECT_EQ(c.combines, 3 * c.forwards) << "a combine ran outside the training forward";
        EXPECT_EQ(c.expert_rebuilds, 3 * c.forwards_for_backward);
        // The recompute reused the training forward's plan: one count exchange per micro-batch.
        EXPECT_EQ(c.plans, c.forwards) << "a recompute exchanged the counts again";
        EXPECT_EQ(c.plans_reused, c.forwards_for_backward);
      }
  EXPECT_GT(moe_layers, 0);
  // And the same EP run without recompute gives the same bits.
  Trainer n(config(run, {"primitives.permute=\"memory_efficient\"", ov_ep(ep), ov_dispatch("chunked_alltoall:3")}),
            nullptr, Corpus{}, world());
  const std::vector<StepMetrics> want = train(n);
  for (size_t s = 0; s < got.size(); ++s) {
    EXPECT_EQ(got[s].loss, want[s].loss) << "step " << s + 1;
    EXPECT_EQ(got[s].aux_loss, want[s].aux_loss) << "step " << s + 1;
    EXPECT_EQ(got[s].grad_norm, want[s].grad_norm) << "step " << s + 1;
  }
}

// The recompute reuses the training forward's dispatch plan with either permute and either
// member that exchanges counts (alltoall, allgather): one count exchange per MoE layer and
// micro-batch instead of two, and the run is the same as without recompute. The standard
// permute's recompute runs the whole forward (fc2 and the combine: its backward reads y_perm).
TEST(ExpertParallel, RecomputeReusesTheForwardsDispatchPlan) {
  if (ep_degrees().empty()) GTEST_SKIP() << "needs 2 or 4 ranks";
  TestRun run = make_run("ep_plans");
  const int64_t ep = ep_degrees().back();
  for (const char* dispatch : {"alltoall", "allgather"})
    for (const char* permute : {"standard", "memory_efficient"}) {
      SCOPED_TRACE(std::string(dispatch) + " " + permute);
      const std::string p = std::string("primitives.permute=\"") + permute + "\"";
      Trainer t(config(run, {"primitives.recompute=\"full\"", p, ov_ep(ep), ov_dispatch(dispatch), "train.grad_accum=2"}),
                nullptr, Corpus{}, world());
      const std::vector<StepMetrics> got = train(t);
      Trainer n(config(run, {p, ov_ep(ep), ov_dispatch(dispatch), "train.grad_accum=2"}), nullptr, Corpus{}, world());
      const std::vector<StepMetrics> want = train(n);
      for (size_t s = 0; s < got.size(); ++s) {
        EXPECT_EQ(got[s].loss, want[s].loss) << "step " << s + 1;
        EXPECT_EQ(got[s].grad_norm, want[s].grad_norm) << "step " << s + 1;
      }
      // Per MoE layer: the run without recompute made one plan per training forward (F); the
      // recompute run made as many, and reused them for every recompute forward.
      std::vector<const DispatchCounts*> with, without;
      for (Trainer* tr : {&t, &n})
        for (Layer& L : tr->model().layers())
          for (auto& b : L.blocks)
            if (auto* moe = dynamic_cast<MoeBlock*>(b.get()))
              (tr == &t ? with : without).push_back(&moe->dispatcher().counts());
      ASSERT_EQ(with.size(), without.size());
      ASSERT_FALSE(with.empty());
      for (size_t i = 0; i < with.size(); ++i) {
        const int64_t F = without[i]->forwards;
        EXPECT_GT(F, 0);
        EXPECT_EQ(without[i]->plans, F);
        EXPECT_EQ(with[i]->plans, F) << "a recompute exchanged the counts again";
        EXPECT_EQ(with[i]->plans_reused, with[i]->forwards + with[i]->forwards_for_backward - F);
        EXPECT_EQ(with[i]->plans_reused, F) << "every training forward is recomputed once";
      }
    }
}

// With the grouped experts (row-independent arithmetic) chunking changes no bit: every step's
// loss, aux loss and grad norm and the final masters equal alltoall's exactly.
TEST(ExpertParallel, ChunkedEqualsAllToAllBitForBitWithGroupedExperts) {
  if (ep_degrees().empty()) GTEST_SKIP() << "needs 2 or 4 ranks";
  TestRun run = make_run("ep_chunked");
  const int64_t ep = ep_degrees().back();
  const std::string grouped = "primitives.experts=\"grouped\"";
  Trainer a(config(run, {grouped, ov_ep(ep), ov_dispatch("alltoall")}), nullptr, Corpus{}, world());
  const std::vector<StepMetrics> want = train(a);
  for (int n = 1; n <= 4; ++n) {
    SCOPED_TRACE("chunks " + std::to_string(n));
    Trainer t(config(run, {grouped, ov_ep(ep), ov_dispatch("chunked_alltoall:" + std::to_string(n))}), nullptr,
              Corpus{}, world());
    const std::vector<StepMetrics> got = train(t);
    for (size_t s = 0; s < got.size(); ++s) {
      EXPECT_EQ(got[s].loss, want[s].loss) << "step " << s + 1;
      EXPECT_EQ(got[s].aux_loss, want[s].aux_loss) << "step " << s + 1;
      EXPECT_EQ(got[s].grad_norm, want[s].grad_norm) << "step " << s + 1;
      EXPECT_EQ(got[s].routing, want[s].routing) << "step " << s + 1;
    }
    for (size_t i = 0; i < t.model().units().size(); ++i)
      EXPECT_EQ(t.state().gather_master(i).to_floats(), a.state().gather_master(i).to_floats())
          << t.model().units()[i]->name;
  }
}

// Token-chunked MoE ([backend] moe_chunk_tokens) under expert parallelism: every rank makes the
// same dispatcher calls whatever its own token count (the packed micro-batches of 80-token
// budgets differ per rank), so 30 tokens per chunk (3 chunks) and 1 (80 chunks: every rank has
// chunks without tokens, which still join the all-to-alls with zero rows) run, under full
// recompute (each chunk rebuilt in the backward) and without, with either permute and with
// chunked_alltoall:2 inside the chunks. The first step's forward is alltoall's without chunks bit
// for bit (loss, aux loss, routing); the experts' weight gradient then adds its rows in another
// order (chunk by chunk, each chunk's rows from every source rank, instead of all of one source
// rank's rows first), so later steps agree to 1e-6 relative, the bound the dispatcher members
// meet against the single-rank run.
TEST(ExpertParallel, TokenChunkedMoeEqualsUnchunked) {
  if (ep_degrees().empty()) GTEST_SKIP() << "needs 2 or 4 ranks";
  TestRun run = make_run("ep_token_chunks");
  const int64_t ep = ep_degrees().back();
  const std::string grouped = "primitives.experts=\"grouped\"";
  for (const auto& [recompute, permute, dispatch] :
       {std::tuple{"full", "memory_efficient", "alltoall"}, std::tuple{"full", "standard", "chunked_alltoall:2"},
        std::tuple{"none", "memory_efficient", "chunked_alltoall:2"}}) {
    const std::vector<std::string> common = {grouped, ov_ep(ep), ov_dispatch(dispatch),
                                             std::string("primitives.recompute=\"") + recompute + "\"",
                                             std::string("primitives.permute=\"") + permute + "\""};
    Trainer a(config(run, common), nullptr, Corpus{}, world());
    const std::vector<StepMetrics> want = train(a, 3);
    for (const char* chunk : {"30", "1"}) {
      SCOPED_TRACE(std::string(recompute) + " " + permute + " " + dispatch + ", moe_chunk_tokens " + chunk);
      std::vector<std::string> ov = common;
      ov.push_back(std::string("backend.moe_chunk_tokens=") + chunk);
      Trainer t(config(run, ov), nullptr, Corpus{}, world());
      const std::vector<StepMetrics> got = train(t, 3);
      ASSERT_EQ(got.size(), want.size());
      EXPECT_EQ(got[0].loss, want[0].loss);
      EXPECT_EQ(got[0].aux_loss, want[0].aux_loss);
      EXPECT_EQ(got[0].routing, want[0].routing);
      for (size_t s = 0; s < got.size(); ++s) {
        EXPECT_LT(rel(got[s].loss, want[s].loss), 1e-6) << "step " << s + 1;
        EXPECT_LT(rel(got[s].aux_loss, want[s].aux_loss), 1e-6) << "step " << s + 1;
        EXPECT_LT(rel(got[s].grad_norm, want[s].grad_norm), 1e-6) << "step " << s + 1;
        if (world()->rank() == 0)
          std::printf("step %zu: loss %.3e, grad norm %.3e relative to unchunked\n", s + 1,
                      rel(got[s].loss, want[s].loss), rel(got[s].grad_norm, want[s].grad_norm));
      }
      const int64_t chunks = std::string(chunk) == "1" ? 80 : 3;
      for (Layer& L : t.model().layers())
        for (auto& b : L.blocks)
          if (auto* moe = dynamic_cast<MoeBlock*>(b.get())) {
            EXPECT_EQ(moe->config().token_chunks, chunks);
            // Every chunk is dispatched in every training forward, by every rank.
            EXPECT_EQ(moe->dispatcher().counts().forwards % chunks, 0);
          }
    }
  }
}

// A checkpoint written at EP_R resumes at EP1 (one rank, the same global batch) and one written
// at EP1 resumes at EP_R: the next steps are those of the run that went on. On 4 ranks also
// EP4 -> EP2 (each half of the job resumes the EP4 checkpoint as dp 2 x ep 2, grad_accum 2).
TEST(ExpertParallel, CheckpointsMoveBetweenExpertParallelDegrees) {
  if (ep_degrees().empty()) GTEST_SKIP() << "needs 2 or 4 ranks";
  const int R = world()->size();
  TestRun run = make_run("ep_ckpt");
  const std::string accum_R = "train.grad_accum=" + std::to_string(R);
  // EP_R -> EP1 (on 4 ranks: EP4, and DP2 x EP2 whose expert units two ranks write halves of).
  for (const int64_t ep : ep_degrees()) {
    Trainer a(config(run, {ov_ep(ep), ov_dispatch("alltoall")}), nullptr, Corpus{}, world());
    for (int s = 0; s < 3; ++s) a.train_step();
    const std::string ck = a.save_checkpoint(run.dir + "/ck_ep" + std::to_string(ep));
    std::vector<StepMetrics> cont;
    for (int s = 0; s < 2; ++s) cont.push_back(a.train_step());
    Trainer b(config(run, {accum_R, "checkpoint.resume=\"" + ck + "\""}), nullptr, Corpus{}, comm::self_group());
    ASSERT_EQ(b.step(), 3);
    for (int s = 0; s < 2; ++s) {
      const StepMetrics m = b.train_step();
      EXPECT_LE(rel(m.loss, cont[static_cast<size_t>(s)].loss), 1e-6) << "EP" << ep << " -> EP1 step " << m.step;
      EXPECT_LE(rel(m.grad_norm, cont[static_cast<size_t>(s)].grad_norm), 1e-6) << "EP" << ep << " -> EP1 step " << m.step;
    }
    // Export consolidates every expert: its weights are EP1's masters.
    if (world()->rank() == 0) {
      HfExportOptions eo;
      eo.dtype = DType::f32;
      export_distributed_checkpoint(ck, run.dir + "/hf_ep" + std::to_string(ep), eo);
      DecoderModel m(small_model(), ModelOptions{}, 99);
      load_hf_weights(m, run.dir + "/hf_ep" + std::to_string(ep));
      Trainer c(config(run, {accum_R, "checkpoint.resume=\"" + ck + "\""}), nullptr, Corpus{}, comm::self_group());
      for (size_t i = 0; i < m.units().size(); ++i)
        EXPECT_EQ(m.units()[i]->value.to_floats(), c.state().gather_master(i).to_floats()) << m.units()[i]->name;
    }
    world()->barrier();
  }
  // EP1 -> EP_R: rank 0 writes the single-rank checkpoint.
  for (const int64_t ep : ep_degrees()) {
    std::string ck;
    std::vector<StepMetrics> cont;
    Trainer a(config(run, {accum_R}), nullptr, Corpus{}, comm::self_group());
    for (int s = 0; s < 3; ++s) a.train_step();
    if (world()->rank() == 0) ck = a.save_checkpoint(run.dir + "/ck_1_" + std::to_string(ep));
    world()->broadcast_host(ck, 0);
    for (int s = 0; s < 2; ++s) cont.push_back(a.train_step());
    Trainer b(config(run, {ov_ep(ep), ov_dispatch("chunked_alltoall:2"), "checkpoint.resume=\"" + ck + "\""}), nullptr,
              Corpus{}, world());
    ASSERT_EQ(b.step(), 3);
    for (int s = 0; s < 2; ++s) {
      const StepMetrics m = b.train_step();
      EXPECT_LE(rel(m.loss, cont[static_cast<size_t>(s)].loss), 1e-6) << "EP1 -> EP" << ep << " step " << m.step;
      EXPECT_LE(rel(m.grad_norm, cont[static_cast<size_t>(s)].grad_norm), 1e-6) << "EP1 -> EP" << ep << " step " << m.step;
    }
  }
  // EP4 under fsdp (expert units whole: edp 1; dense units sharded over 4) -> two jobs of dp 2 x
  // ep 2 under zero1 (dense units sharded over 2), each reading the whole checkpoint.
  if (R == 4) {
    Trainer a(config(run, {ov_ep(4), ov_dispatch("alltoall"), "primitives.state=\"fsdp\""}), nullptr, Corpus{}, world());
    for (int s = 0; s < 3; ++s) a.train_step();
    const std::string ck = a.save_checkpoint(run.dir + "/ck_ep4_fsdp");
    std::vector<StepMetrics> cont;
    for (int s = 0; s < 2; ++s) cont.push_back(a.train_step());
    comm::GroupPtr half = world()->split(world()->rank() / 2, world()->rank(), "half");
    Trainer b(config(run, {ov_ep(2), "train.grad_accum=2", ov_dispatch("allgather"), "primitives.state=\"zero1\"",
                           "checkpoint.resume=\"" + ck + "\""}),
              nullptr, Corpus{}, half);
    ASSERT_EQ(b.mesh().layout().dp, 2);
    for (int s = 0; s < 2; ++s) {
      const StepMetrics m = b.train_step();
      EXPECT_LE(rel(m.loss, cont[static_cast<size_t>(s)].loss), 1e-6) << "EP4 -> EP2 step " << m.step;
      EXPECT_LE(rel(m.grad_norm, cont[static_cast<size_t>(s)].grad_norm), 1e-6) << "EP4 -> EP2 step " << m.step;
    }
  }
}

// model.init = "hf:DIR" at EP_R: every rank reads its experts (the other ranks' per-expert
// tensors are not an error) and trains as the single-rank run from the same weights.
TEST(ExpertParallel, HuggingFaceInitLoadsEachRanksExperts) {
  if (ep_degrees().empty()) GTEST_SKIP() << "needs 2 or 4 ranks";
  TestRun run = make_run("ep_hf");
  if (world()->rank() == 0) {
    DecoderModel src(small_model(), ModelOptions{}, 77);
    HfExportOptions eo;
    eo.dtype = DType::f32;
    export_hf(src, run.dir + "/hf", eo);
  }
  world()->barrier();
  const std::string init = "model.init=\"hf:" + run.dir + "/hf\"";
  Reference ref = reference(run, {init}, 3);
  const int64_t ep = ep_degrees().back();
  Trainer t(config(run, {init, ov_ep(ep), ov_dispatch("alltoall")}), nullptr, Corpus{}, world());
  expect_matches(t, ref, train(t, 3));
}

TEST(ExpertParallel, BadLayoutsAreClearErrors) {
  const int R = world()->size();
  TestRun run = make_run("ep_bad");
  comm::GroupPtr g = world();
  test::expect_error_contains([&] { Trainer(config(run, {"parallel.ep=3"}), nullptr, Corpus{}, g); },
                              "parallel.ep = 3 does not divide the model's 8 routed experts; choose ep among the "
                              "divisors of 8");
  if (R < 8)  // an ep the 8 experts allow, above the ranks
    test::expect_error_contains([&] { Trainer(config(run, {"parallel.ep=8"}), nullptr, Corpus{}, g); },
                                "parallel.ep = 8 is more than the " + std::to_string(R) +
                                    " rank(s) of a pipeline stage (dp x cp = " + std::to_string(R) + ")");
  test::expect_error_contains([&] { Trainer(config(run, {"primitives.moe_dispatch=\"chunked_alltoall\""}), nullptr, Corpus{}, g); },
                              "needs a count: write chunked_alltoall:N with N in [1, 64]");
  test::expect_error_contains([&] { Trainer(config(run, {"primitives.moe_dispatch=\"chunked_alltoall:0\""}), nullptr, Corpus{}, g); },
                              "the count must be chunked_alltoall:N");
  test::expect_error_contains([&] { Trainer(config(run, {"primitives.moe_dispatch=\"all2all\""}), nullptr, Corpus{}, g); },
                              "registered members: allgather, alltoall, chunked_alltoall:N");
}

}  // namespace
}  // namespace bb
