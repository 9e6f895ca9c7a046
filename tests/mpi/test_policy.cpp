// Multi-rank: the policy loss (primitives.loss = "policy") on rollout data, every layout against
// the single-rank run on the same data, packed whole (data.packing = "whole", the policy loss's
// default: 4 steps x dp micro-batches of up to 160 tokens, balanced by cost). The normalisation is global (valid tokens, or the
// step's sequences counted by each document's share, MicroBatch::seq_weight), so data, context
// and expert parallelism must give the single-rank losses, grad norms, policy metrics and final
// weights. Rollouts: documents of mixed lengths (several split across micro-batches and, with
// cp, across ranks), prompt tokens masked, per-token advantages, old and ref log-probs.
// np1: the single-rank run against itself under grad_accum 2 vs two half-batches is not a
// layout, so np1 checks the trainer-level errors only.
#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "common/mpi_main.h"
#include "common/testing.h"
#include "common/tiny_models.h"
#include "common/trainer_equivalence.h"
#include "runtime/logprobs.h"
#include "runtime/run_config.h"

namespace bb {
namespace {

using test::world;

constexpr int kSteps = 4;

// Rollout-like documents: a prompt (masked), then a response with advantages and log-probs;
// with `routing`, each token's experts for the model's 2 MoE layers (top-2 of 8, distinct).
Corpus rollouts(bool routing = false) {
  const std::vector<int64_t> lens = {9, 70, 5, 33, 140, 12, 60, 3, 25, 90, 17, 44};
  std::vector<Document> docs;
  uint64_t state = 7;
  auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return state >> 33;
  };
  for (int rep = 0; rep < 2; ++rep)
    for (int64_t len : lens) {
      Document d;
      const int64_t prompt = std::max<int64_t>(1, len / 3);
      const float adv = static_cast<float>(static_cast<int64_t>(next() % 200) - 100) / 50.0f;
      for (int64_t i = 0; i < len; ++i) {
        d.tokens.push_back(static_cast<int32_t>(next() % 250));
        d.loss_mask.push_back(i >= prompt ? 1 : 0);
        d.advantages.push_back(adv + static_cast<float>(next() % 100) / 500.0f);
        // Near the model's log-probs at init (~ -log 264 = -5.58): ratios on both sides of the clip.
        d.old_logprobs.push_back(-5.58f + static_cast<float>(static_cast<int64_t>(next() % 100) - 50) / 200.0f);
        d.ref_logprobs.push_back(-5.58f + static_cast<float>(static_cast<int64_t>(next() % 100) - 50) / 300.0f);
        if (routing)
          for (int l = 0; l < 2; ++l) {
            const auto e0 = static_cast<int32_t>(next() % 8);
            d.routing.push_back(e0);
            d.routing.push_back(static_cast<int32_t>((e0 + 1 + next() % 7) % 8));
          }
      }
      if (routing) d.routing_layers = d.routing_topk = 2;
      docs.push_back(std::move(d));
    }
  return corpus_from_documents(docs, 264, "test rollouts");
}

struct TestRun {
  std::string dir, toml;
};

TestRun make_run(const char* tag) {
  TestRun r;
  r.dir = test::shared_tmpdir(tag);
  if (world()->rank() == 0)
    std::ofstream(r.dir + "/config.json")
        << test::small_moe({.heads = 4, .kv_heads = 2, .head_dim = 8}).to_hf_json().dump(2);
  world()->barrier();
  // train.adam_eps = 1e-4: AdamW's first steps move every element by about lr whatever the size of
  // its gradient, so an element whose gradient cancels to rounding noise gets a full-size update
  // of random sign. The policy gradient has many (advantages of both signs, k3's gradient
  // vanishing where ref ~ logp): with eps 1e-8 the layouts drifted apart by up to 1e-4 within 4
  // steps though step 1 matched to 1e-8. A larger eps makes those elements' updates follow
  // their tiny gradients.
  r.toml = "[model]\nconfig = \"" + r.dir + "/config.json\"\n" +
           "[primitives]\nloss = \"policy\"\n"
           "[policy]\nclip_low = 0.2\nclip_high = 0.28\ndual_clip = 3.0\nkl_coef = 0.01\nentropy_coef = 0.001\n"
           "[train]\nsteps = 10\nmicro_batch_tokens = 160\nlr = 2e-3\nmin_lr = 2e-4\nwarmup_steps = 2\nseed = 11\n"
           "grad_clip = 0.5\nadam_eps = 1e-4\n"
           "[data]\nshuffle = false\n"
           "[checkpoint]\nevery = 0\nsave_final = false\n";
  return r;
}

struct Layout {
  int64_t cp, ep;
  std::vector<std::string> extra;
};

void check_layouts(const char* tag, const std::vector<Layout>& layouts, const std::vector<std::string>& common,
                   bool routing = false) {
  TestRun run = make_run(tag);
  const Corpus corpus = rollouts(routing);
  std::map<int64_t, test::Reference> refs;
  for (const Layout& l : layouts) {
    std::string name = "cp" + std::to_string(l.cp) + " ep" + std::to_string(l.ep);
    for (const std::string& e : l.extra) name += " " + e;
    SCOPED_TRACE(name);
    const int64_t dp = world()->size() / l.cp;
    if (!refs.count(dp)) {
      std::vector<std::string> ov = common;
      ov.push_back("train.grad_accum=" + std::to_string(dp));
      refs[dp] = test::reference_run(parse_run_config(run.toml, "test run", ov), corpus, kSteps);
    }
    std::vector<std::string> ov = common;
    ov.push_back("parallel.cp=" + std::to_string(l.cp));
    ov.push_back("parallel.ep=" + std::to_string(l.ep));
    if (l.cp > 1) ov.push_back("primitives.attention=\"cp_ring\"");
    ov.insert(ov.end(), l.extra.begin(), l.extra.end());
    Trainer t(parse_run_config(run.toml, "test run", ov), nullptr, corpus, world());
    const std::vector<StepMetrics> got = test::train_steps(t, kSteps);
    test::expect_matches(t, refs[dp], got, "policy", 1e-6, 1e-4);
    // The policy metrics are global too.
    for (size_t s = 0; s < got.size(); ++s) {
      const StepMetrics::Policy &a = got[s].policy, &b = refs[dp].steps[s].policy;
      EXPECT_NEAR(a.clip_frac, b.clip_frac, 1e-12) << "step " << s + 1;
      EXPECT_NEAR(a.entropy, b.entropy, 1e-6 * b.entropy) << "step " << s + 1;
      EXPECT_NEAR(a.ratio_max, b.ratio_max, 1e-6 * b.ratio_max) << "step " << s + 1;
      // A mean of differences of f32 log-probs near -5.6 (~3e-7 rounding each): an absolute floor.
      EXPECT_NEAR(a.ref_kl, b.ref_kl, 1e-7 + 1e-6 * std::abs(b.ref_kl)) << "step " << s + 1;
      EXPECT_NEAR(a.sequences, b.sequences, 1e-6 * b.sequences) << "step " << s + 1;
    }
  }
  // The run moved away from the rollout policy: some ratio was clipped by the last step.
  double clipped = 0;
  for (const auto& [dp, ref] : refs)
    for (const StepMetrics& m : ref.steps) clipped += m.policy.clip_frac;
  EXPECT_GT(clipped, 0) << "the objective's clip was never exercised";
}

std::vector<Layout> layouts_for(int64_t R) {
  if (R == 4) return {{1, 1, {}}, {2, 1, {}}, {4, 1, {}}, {2, 2, {}}, {1, 4, {"primitives.state=\"fsdp\""}}};
  if (R == 2) return {{1, 1, {}}, {2, 1, {}}, {1, 2, {}}};
  if (R == 3) return {{1, 1, {}}};  // 8 experts: no ep 3
  return {};
}

TEST(PolicyLoss, TokenMeanLayoutsEqualTheSingleRankRun) {
  const int64_t R = world()->size();
  if (R == 1) GTEST_SKIP() << "a layout needs 2 or more ranks";
  check_layouts("policy_token", layouts_for(R), {});
}

TEST(PolicyLoss, SequenceMeanLayoutsEqualTheSingleRankRun) {
  const int64_t R = world()->size();
  if (R == 1) GTEST_SKIP() << "a layout needs 2 or more ranks";
  check_layouts("policy_seq", layouts_for(R), {"policy.aggregation=\"seq_mean_token_mean\"", "policy.kl=\"k1\""});
}

// Router replay (R3): the rollouts' routing is replayed in every layout (EP moves the rows by
// the given experts; CP shards carry each token's routing; full recompute replays it again).
TEST(PolicyLoss, RouterReplayLayoutsEqualTheSingleRankRun) {
  const int64_t R = world()->size();
  if (R == 1) GTEST_SKIP() << "a layout needs 2 or more ranks";
  std::vector<Layout> layouts = layouts_for(R);
  if (R == 2) layouts.push_back({2, 2, {"primitives.moe_dispatch=\"chunked_alltoall:2\"", "primitives.recompute=\"full\""}});
  if (R == 4) layouts.push_back({2, 4, {"primitives.moe_dispatch=\"alltoall\"", "primitives.recompute=\"full\""}});
  check_layouts("policy_replay", layouts, {"primitives.router_replay=true"}, /*routing=*/true);
  // The data's routing is not the model's own: without replay the same run routes otherwise.
  TestRun run = make_run("policy_replay_off");
  const Corpus corpus = rollouts(true);
  auto first_loss = [&](bool replay) {
    test::Reference r = test::reference_run(
        parse_run_config(run.toml, "test run", {"primitives.router_replay=" + std::string(replay ? "true" : "false")}),
        corpus, 1);
    return r.steps[0];
  };
  const StepMetrics on = first_loss(true), off = first_loss(false);
  EXPECT_NE(on.loss, off.loss);
  EXPECT_NE(on.routing, off.routing);
}

// Split packing (documents cut at micro-batch boundaries): each piece's seq_weight is its
// document's 1 / n, so the sequence count stays the documents' over the step.
TEST(PolicyLoss, SplitPackingLayoutsEqualTheSingleRankRun) {
  const int64_t R = world()->size();
  if (R == 1) GTEST_SKIP() << "a layout needs 2 or more ranks";
  check_layouts("policy_split", layouts_for(R),
                {"data.packing=\"split\"", "train.micro_batch_tokens=96", "policy.aggregation=\"seq_mean_token_mean\""});
}

// GSPO (sequence ratio): whole sequences per micro-batch (data.packing = "whole", the policy
// loss's default) on one rank each (cp 1).
TEST(PolicyLoss, SequenceRatioLayoutsEqualTheSingleRankRun) {
  const int64_t R = world()->size();
  if (R == 1) GTEST_SKIP() << "a layout needs 2 or more ranks";
  std::vector<Layout> layouts;
  for (const Layout& l : layouts_for(R))
    if (l.cp == 1) layouts.push_back(l);
  check_layouts("policy_gspo", layouts,
                {"policy.ratio=\"sequence\"", "policy.aggregation=\"seq_mean_token_mean\"", "policy.clip_low=0.05",
                 "policy.clip_high=0.05", "policy.dual_clip=0"});
}

// The Python API's two calls on the C++ side: forward_backward_on + optim_step equals train_on
// (metrics and the weights after), on every rank count; the update waits for optim_step.
TEST(PolicyLoss, ForwardBackwardThenOptimStepEqualsOneStep) {
  TestRun run = make_run("policy_split_step");
  const Corpus all = rollouts();
  Corpus batch;
  for (int64_t d = 0; d < 8; ++d) batch.add(all.document(d));
  const RunConfig cfg = parse_run_config(run.toml, "test run", {"train.grad_clip=0", "data.path=\"none\"", "train.micro_batch_tokens=512"});
  Trainer a(cfg, nullptr, Corpus{}, world()), b(cfg, nullptr, Corpus{}, world());
  const StepMetrics ma = a.train_on(batch);
  const StepMetrics fb = b.forward_backward_on(batch);
  EXPECT_TRUE(b.step_pending());
  EXPECT_EQ(b.step(), 0);
  EXPECT_EQ(fb.loss, ma.loss);
  EXPECT_EQ(fb.grad_norm, ma.grad_norm);
  test::expect_error_contains([&] { b.train_on(batch); }, "call optim_step first");
  test::expect_error_contains([&] { b.save_checkpoint(run.dir + "/never"); }, "call optim_step first");
  test::expect_error_contains([&] { b.load_checkpoint(run.dir + "/never"); }, "call optim_step first");
  const StepMetrics mb = b.optim_step();
  EXPECT_EQ(mb.loss, ma.loss);
  EXPECT_EQ(mb.grad_norm, ma.grad_norm);
  EXPECT_EQ(mb.policy.clip_frac, ma.policy.clip_frac);
  EXPECT_EQ(b.step(), 1);
  // The next steps agree too: the weights after the split step are the fused step's.
  EXPECT_EQ(b.train_on(batch).loss, a.train_on(batch).loss);
  test::expect_error_contains([&] { b.optim_step(); }, "no forward_backward to apply");
}

// A trainer's own scoring (Trainer::score, the Python API's logprobs) under every layout and
// state family equals the forward-only runner alone on one rank with the same weights (the
// trainer's checkpoint): fsdp gathers its units for the forward as in training.
TEST(Logprobs, TrainerScoresInEveryLayoutAsTheRunnerAlone) {
  TestRun run = make_run("trainer_score");
  const std::string ck = run.dir + "/ck";
  const Corpus all = rollouts();
  Corpus docs;
  for (int64_t d = 0; d < 8; ++d) docs.add(all.document(d).tokens);
  const int64_t R = world()->size();
  std::vector<std::vector<std::string>> layouts = {{"primitives.state=\"replicated\""},
                                                   {"primitives.state=\"fsdp\""},
                                                   {"primitives.state=\"zero1\""}};
  if (R % 2 == 0) layouts.push_back({"primitives.state=\"fsdp\"", "parallel.ep=2"});
  if (R % 2 == 0) layouts.push_back({"parallel.cp=2", "primitives.attention=\"cp_ring\""});
  for (const auto& set : layouts) {
    std::string name;
    for (const std::string& x : set) name += x + " ";
    SCOPED_TRACE(name);
    Trainer t(parse_run_config(run.toml, "test run", set), nullptr, rollouts(), world());
    t.train_step();
    const std::string saved = t.save_checkpoint(ck + "_" + std::to_string(&set - layouts.data()));
    const std::vector<DocLogprobs> got = t.score(docs, 0.8, true);
    LogprobsRunner alone(parse_run_config(run.toml, "test run", {}), saved, nullptr, comm::self_group());
    const std::vector<DocLogprobs> want = alone.run(docs, 0.8, true);
    ASSERT_EQ(got.size(), want.size());
    for (size_t d = 0; d < got.size(); ++d) {
      for (size_t j = 0; j < got[d].logprobs.size(); ++j) {
        ASSERT_NEAR(got[d].logprobs[j], want[d].logprobs[j], 1e-5) << "doc " << d << " token " << j;
        ASSERT_NEAR(got[d].entropy[j], want[d].entropy[j], 1e-5) << "doc " << d << " token " << j;
      }
      EXPECT_EQ(got[d].routing, want[d].routing) << "doc " << d;
    }
    // The scoring changed nothing the next step reads: it is the step a twin takes.
    Trainer twin(parse_run_config(run.toml, "test run", set), nullptr, rollouts(), world());
    twin.train_step();
    EXPECT_EQ(t.train_step().loss, twin.train_step().loss);
  }
}

// The forward-only pass (runtime/logprobs.h) in every layout equals one rank alone; and R2: the
// routing it records, replayed in a policy step on the same weights, is the step's own routing
// (the replayed step equals the unreplayed one).
TEST(Logprobs, LayoutsEqualOneRankAndTheRecordedRoutingReplays) {
  TestRun run = make_run("logprobs_layouts");
  const RunConfig base = parse_run_config(run.toml, "test run", {});
  const std::string ck = run.dir + "/ck";
  {
    RunConfig c = base;
    c.ckpt_dir = ck;
    Trainer t(c, nullptr, rollouts(), world());
    t.train_step();
    t.save_checkpoint(ck);
  }
  const Corpus all = rollouts();
  Corpus docs;
  for (int64_t d = 0; d < 12; ++d) docs.add(all.document(d).tokens);
  LogprobsRunner alone(base, ck, nullptr, comm::self_group());
  const std::vector<DocLogprobs> want = alone.run(docs, 0.9, true);
  const int64_t R = world()->size();
  std::vector<std::vector<std::string>> layouts = {{}};
  if (R % 2 == 0) layouts.push_back({"parallel.cp=2", "primitives.attention=\"cp_ring\""});
  if (R % 2 == 0) layouts.push_back({"parallel.ep=2"});
  if (R == 4) layouts.push_back({"parallel.cp=2", "parallel.ep=2", "primitives.attention=\"cp_ring\""});
  for (const auto& set : layouts) {
    std::string name;
    for (const std::string& s : set) name += s + " ";
    SCOPED_TRACE(name);
    LogprobsRunner r(parse_run_config(run.toml, "test run", set), ck, nullptr, world());
    const std::vector<DocLogprobs> got = r.run(docs, 0.9, true);
    for (size_t d = 0; d < got.size(); ++d) {
      for (size_t j = 0; j < got[d].logprobs.size(); ++j) {
        ASSERT_NEAR(got[d].logprobs[j], want[d].logprobs[j], 1e-5) << "doc " << d << " token " << j;
        ASSERT_NEAR(got[d].entropy[j], want[d].entropy[j], 1e-5) << "doc " << d << " token " << j;
      }
      EXPECT_EQ(got[d].routing, want[d].routing) << "doc " << d;
    }
  }
  // R2: records with the recorded routing, on-policy (no old_logprobs), one step from the
  // checkpoint with and without replay.
  std::vector<Document> recs;
  for (int64_t d = 0; d < docs.num_documents(); ++d) {
    Document x;
    x.tokens = docs.document(d).tokens;
    x.advantages.assign(x.tokens.size(), d % 2 ? 1.0f : -0.5f);
    x.ref_logprobs.assign(x.tokens.size(), -5.5f);
    x.routing = want[static_cast<size_t>(d)].routing;
    x.routing_layers = 2;
    x.routing_topk = 2;
    recs.push_back(std::move(x));
  }
  const Corpus rl = corpus_from_documents(recs, 264);
  auto step = [&](bool replay) {
    RunConfig c = parse_run_config(run.toml, "test run", {"primitives.router_replay=" + std::string(replay ? "true" : "false"),
                                                          "data.path=\"none\"", "train.micro_batch_tokens=1024"});
    c.resume = ck;
    Trainer t(c, nullptr, Corpus{}, world());
    return t.train_on(rl);
  };
  const StepMetrics with = step(true), without = step(false);
  EXPECT_NEAR(with.loss, without.loss, 1e-6 * std::abs(without.loss) + 1e-9);
  EXPECT_NEAR(with.grad_norm, without.grad_norm, 1e-6 * without.grad_norm);
}

TEST(PolicyLoss, TrainerRefusesWhatCannotRun) {
  TestRun run = make_run("policy_bad");
  // No advantages in the data.
  Corpus plain;
  plain.add({1, 2, 3, 4, 5});
  test::expect_error_contains(
      [&] { Trainer t(parse_run_config(run.toml, "test run", {}), nullptr, plain, world()); },
      "has no \"advantages\"");
  // A KL term without reference log-probs.
  std::vector<Document> docs(1);
  docs[0].tokens = {1, 2, 3, 4};
  docs[0].advantages = {1, 1, 1, 1};
  test::expect_error_contains(
      [&] {
        Trainer t(parse_run_config(run.toml, "test run", {}), nullptr, corpus_from_documents(docs, 264), world());
      },
      "policy.kl_coef = 0.01 needs \"ref_logprobs\"");
  test::expect_error_contains([&] { parse_run_config(run.toml, "test run", {"policy.dual_clip=0.5"}); },
                              "policy.dual_clip must be 0 (off) or > 1");
  test::expect_error_contains([&] { parse_run_config(run.toml, "test run", {"policy.ratio=\"seq\""}); },
                              "= 'seq' is not one of: token, sequence");
}

}  // namespace
}  // namespace bb

