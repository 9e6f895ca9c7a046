// Whole-model checks: gradients against finite differences, recompute equivalence and its
// memory effect, primitive swaps that must not change the math, the schedule (hooks, routing
// reuse, delayed weight gradients) and the parameter units.
#include <gtest/gtest.h>

#include <map>

#include "common/model.h"
#include "common/model_grad.h"
#include "common/testing.h"
#include "core/rng.h"
#include "models/attention_block.h"
#include "models/decoder.h"
#include "models/moe_block.h"
#include "primitives/optim/adamw.h"

namespace bb {
namespace {

ModelConfig tiny_config(bool qwen2 = false) {
  ModelConfig c;
  c.model_type = qwen2 ? "qwen2_moe" : "qwen3_moe";
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.intermediate_size = 24;
  c.moe_intermediate_size = 12;
  c.num_experts = 4;
  c.top_k = 2;
  c.norm_topk_prob = !qwen2;
  // qwen3: both layers MoE (exercises the aux loss pooled over layers); qwen2: a dense layer 0.
  if (qwen2) c.mlp_only_layers = {0};
  c.rope_theta = 10000;
  c.rms_norm_eps = 1e-6;
  c.router_aux_loss_coef = 0.01;
  c.init_std = 0.3;  // large enough that every path carries signal in a 2-layer model
  if (qwen2) {
    c.qk_norm = false;
    c.qkv_bias = true;
    c.shared_expert_intermediate_size = 10;
  }
  return c;
}

// Two packed sequences (lengths 7 and 5), a masked target, next-token targets.
MicroBatch tiny_batch(int64_t V, uint64_t seed) {
  const std::vector<int64_t> lens = {7, 5};
  std::vector<int32_t> tok, tgt, pos, cu = {0};
  uint64_t ctr = 0;
  for (int64_t L : lens) {
    std::vector<int32_t> doc;
    for (int64_t i = 0; i <= L; ++i) doc.push_back(static_cast<int32_t>(philox4x32_10(seed, ctr++).v[0] % V));
    for (int64_t i = 0; i < L; ++i) {
      tok.push_back(doc[i]);
      tgt.push_back(i == L - 1 ? -1 : doc[i + 1]);
      pos.push_back(static_cast<int32_t>(i));
    }
    cu.push_back(cu.back() + static_cast<int32_t>(L));
  }
  tgt[2] = -1;  // a loss-masked position
  MicroBatch mb;
  const int64_t T = static_cast<int64_t>(tok.size());
  mb.tokens = Tensor::from_ints(tok, {T});
  mb.targets = Tensor::from_ints(tgt, {T});
  mb.positions = Tensor::from_ints(pos, {T});
  mb.cu_seqlens = Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
  mb.num_valid = 0;
  for (int32_t t : tgt) mb.num_valid += t >= 0;
  return mb;
}

void check_model_gradients(bool qwen2, const std::string& loss) {
  ModelOptions o = test::model_options({{"loss", loss}});
  o.prims.loss_chunks = {5, 8, 5};
  o.aux_loss_coef = 0.3;
  o.z_loss_coef = 0.05;
  test::ModelRun run(tiny_config(qwen2), o, 7);
  EXPECT_GT(test::check_directional_gradients(run, tiny_batch(37, 3), o), 10);
}

TEST(ModelGrad, Qwen3MoeMatchesFiniteDifferences) { check_model_gradients(false, "linear_ce"); }
TEST(ModelGrad, Qwen2MoeSharedExpertMatchesFiniteDifferences) { check_model_gradients(true, "full_ce"); }

std::vector<std::vector<float>> grads_of(DecoderModel& m) {
  std::vector<std::vector<float>> g;
  for (Param* p : m.params()) g.push_back(p->grad.to_floats());
  return g;
}

struct RunResult {
  ForwardStats stats;
  std::vector<std::vector<float>> grads;
  int64_t act_peak = 0;
  int64_t moe_peak = 0;  // the moe category's peak over the step (dispatch / permute buffers)
  std::vector<std::vector<int32_t>> routing;
  std::vector<int64_t> replays;
  std::vector<DispatchCounts> dispatch;  // per MoE layer: what its dispatcher ran
};

RunResult run_once(const ModelOptions& o, bool qwen2 = false, bool delay_wgrad = false) {
  ModelConfig c = tiny_config(qwen2);
  c.num_layers = 4;
  test::ModelRun run(c, o, 11, delay_wgrad);
  MicroBatch mb = tiny_batch(37, 5);
  run.model.zero_grad();
  Allocator& a = allocator_for(Device::cpu());
  a.reset_peak();
  const int64_t base = a.stats().live_of(MemCategory::activations);
  const int64_t moe_base = a.stats().live_of(MemCategory::moe);
  RunResult r;
  r.stats = run.forward_backward(mb, 1.0f / static_cast<float>(mb.num_valid), 1.0);
  r.act_peak = a.stats().peak_of(MemCategory::activations) - base;
  r.moe_peak = a.stats().peak_of(MemCategory::moe) - moe_base;
  EXPECT_EQ(a.stats().live_of(MemCategory::moe), moe_base) << "moe buffers leaked past backward";
  EXPECT_EQ(a.stats().live_of(MemCategory::activations), base) << "activations leaked past backward";
  r.grads = grads_of(run.model);
  for (const Tensor& t : run.last_routing()) r.routing.push_back(t.to_ints());
  r.replays = run.schedule.last_replays();
  for (Layer& L : run.model.layers())
    for (auto& b : L.blocks)
      if (auto* moe = dynamic_cast<MoeBlock*>(b.get())) r.dispatch.push_back(moe->dispatcher().counts());
  return r;
}

void expect_same(const RunResult& a, const RunResult& b, double tol, const char* what) {
  EXPECT_NEAR(a.stats.loss_sum, b.stats.loss_sum, tol * std::fabs(a.stats.loss_sum)) << what;
  EXPECT_NEAR(a.stats.aux_loss, b.stats.aux_loss, tol * std::fabs(a.stats.aux_loss) + 1e-12) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    double na = 0;
    for (float x : a.grads[i]) na += double(x) * x;
    if (na == 0) {  // e.g. an all-zero gradient: B's must be zero too (no relative error)
      for (float x : b.grads[i]) ASSERT_EQ(x, 0.0f) << what << " param " << i << ": A is zero, B not";
      continue;
    }
    EXPECT_LT(test::rel_error(b.grads[i], a.grads[i]), tol) << what << " param " << i;
  }
}

TEST(Recompute, FullGivesIdenticalGradientsAndSmallerActivationPeak) {
  ModelOptions none = test::model_options(), full = test::model_options({{"recompute", "full"}});
  none.aux_loss_coef = full.aux_loss_coef = 0.01;
  RunResult a = run_once(none), b = run_once(full);
  // Same primitives in the same order: bit-identical.
  EXPECT_EQ(a.stats.loss_sum, b.stats.loss_sum);
  EXPECT_EQ(a.stats.aux_loss, b.stats.aux_loss);
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << "param " << i;
  EXPECT_LT(b.act_peak, a.act_peak) << "full recompute should lower the activations peak";
  std::printf("activations peak: recompute=none %lld B, recompute=full %lld B\n",
              static_cast<long long>(a.act_peak), static_cast<long long>(b.act_peak));
}

// Selective recompute: every part alone, the default set and all parts together give the same
// loss, aux loss and gradients as recompute = none, bit for bit, and a strictly lower
// activations peak (full <= selective <= none). qwen3: every layer MoE; qwen2: a dense layer 0
// (the `mlp` part), a shared expert, no QK norm, q/k/v biases.
TEST(SelectiveRecompute, EachPartIsBitIdenticalToNoneAndLowersThePeak) {
  for (bool qwen2 : {false, true}) {
    SCOPED_TRACE(qwen2 ? "qwen2 (a dense layer, a shared expert)" : "qwen3");
    ModelOptions none = test::model_options(), full = test::model_options({{"recompute", "full"}});
    none.aux_loss_coef = full.aux_loss_coef = 0.01;
    const RunResult a = run_once(none, qwen2), f = run_once(full, qwen2);
    std::vector<std::string> parts = {"norms", "attention", "core_attention", "moe_experts"};
    if (qwen2) {
      parts.push_back("mlp");
      parts.push_back("shared_expert");
    }
    std::vector<std::string> choices = parts;
    for (std::string& c : choices) c = "selective:" + c;
    choices.push_back("selective");  // the default set
    choices.push_back(qwen2
                          ? "selective:norms,attention,core_attention,moe_experts,mlp,shared_expert"
                          : "selective:norms,attention,core_attention,moe_experts");
    for (const std::string& choice : choices) {
      SCOPED_TRACE(choice);
      ModelOptions o = test::model_options({{"recompute", choice}});
      o.aux_loss_coef = 0.01;
      const RunResult b = run_once(o, qwen2);
      EXPECT_EQ(a.stats.loss_sum, b.stats.loss_sum);
      EXPECT_EQ(a.stats.aux_loss, b.stats.aux_loss);
      EXPECT_EQ(a.stats.z_loss, b.stats.z_loss);
      ASSERT_EQ(a.grads.size(), b.grads.size());
      for (size_t i = 0; i < a.grads.size(); ++i)
        EXPECT_EQ(a.grads[i], b.grads[i]) << "param " << i;
      EXPECT_EQ(a.routing, b.routing);
      EXPECT_EQ(b.replays, a.replays) << "selective recompute does not rerun the router";
      EXPECT_LT(b.act_peak, a.act_peak) << "dropping a part should lower the activations peak";
      EXPECT_LE(f.act_peak, b.act_peak) << "full recompute keeps the least";
      std::printf("%s activations peak: none %lld B, %s %lld B, full %lld B\n",
                  qwen2 ? "qwen2" : "qwen3", static_cast<long long>(a.act_peak), choice.c_str(),
                  static_cast<long long>(b.act_peak), static_cast<long long>(f.act_peak));
    }
  }
}

// The rebuilds also hold with the other experts / permute members and with delayed wgrad (whose
// queued GEMMs read the rebuilt tensors).
TEST(SelectiveRecompute, AgreesWithNoneUnderOtherPrimitivesAndDelayedWgrad) {
  for (const auto& [experts, permute] :
       {std::pair{"grouped", "memory_efficient"}, std::pair{"sequential", "standard"}}) {
    for (bool delay : {false, true}) {
      SCOPED_TRACE(std::string(experts) + " " + permute + (delay ? " delayed wgrad" : ""));
      ModelOptions none = test::model_options({{"experts", experts}, {"permute", permute}});
      ModelOptions sel = test::model_options(
          {{"experts", experts},
           {"permute", permute},
           {"recompute",
            "selective:norms,attention,core_attention,moe_experts,mlp,shared_expert"}});
      const RunResult a = run_once(none, true, delay), b = run_once(sel, true, delay);
      EXPECT_EQ(a.stats.loss_sum, b.stats.loss_sum);
      for (size_t i = 0; i < a.grads.size(); ++i)
        EXPECT_EQ(a.grads[i], b.grads[i]) << "param " << i;
      EXPECT_LT(b.act_peak, a.act_peak);
    }
  }
}

// Token-chunked MoE (ModelOptions::moe_token_chunks, [backend] moe_chunk_tokens): the routed path
// over 2, 5 or 16 sequential token chunks of the 12-token micro-batch (16: four chunks have no
// token) gives the loss, aux and z losses, routing and every gradient of the unchunked layer,
// bit for bit, under every recompute policy, both permutes, both dispatch members and with a
// shared expert (the CPU grouped experts add their weight gradient row by row in order, so the
// chunks' sum is the same sum). Under full recompute the moe buffers hold one chunk's rows: the
// moe peak of 4 chunks is at most 0.4 x the unchunked one (exactly ~1/4 plus the maps), and the
// backward rebuilds each chunk (forwards_for_backward = chunks with the memory_efficient permute).
TEST(MoeTokenChunks, BitIdenticalToUnchunkedAndBoundTheMoeBuffers) {
  for (bool qwen2 : {false, true})
    for (const char* recompute : {"none", "full", "selective:moe_experts,norms"})
      for (const char* permute : {"memory_efficient", "standard"})
        for (const char* dispatch : {"alltoall", "chunked_alltoall:3"}) {
          SCOPED_TRACE(std::string(qwen2 ? "qwen2 (shared expert) " : "qwen3 ") + recompute + " " + permute + " " +
                       dispatch);
          const std::vector<std::pair<std::string, std::string>> prims = {
              {"permute", permute}, {"moe_dispatch", dispatch}, {"experts", "grouped"}, {"recompute", recompute}};
          ModelOptions base = test::model_options(prims);
          base.aux_loss_coef = 0.01;
          base.z_loss_coef = 0.01;
          const RunResult a = run_once(base, qwen2);
          for (int64_t chunks : {2, 4, 5, 16}) {
            SCOPED_TRACE(std::to_string(chunks) + " token chunks");
            ModelOptions o = base;
            o.moe_token_chunks = chunks;
            const RunResult b = run_once(o, qwen2);
            EXPECT_EQ(a.stats.loss_sum, b.stats.loss_sum);
            EXPECT_EQ(a.stats.aux_loss, b.stats.aux_loss);
            EXPECT_EQ(a.stats.z_loss, b.stats.z_loss);
            EXPECT_EQ(a.stats.moe_rows_received, b.stats.moe_rows_received);
            EXPECT_EQ(a.routing, b.routing);
            ASSERT_EQ(a.grads.size(), b.grads.size());
            for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << "param " << i;
            if (std::string(recompute) == "full") {
              if (chunks == 4)
                EXPECT_LE(b.moe_peak, a.moe_peak * 4 / 10)
                    << "4 token chunks under full recompute should hold about a quarter of the moe rows";
              const bool mem_eff = std::string(permute) == "memory_efficient";
              const int64_t used = std::min<int64_t>(chunks, 12);  // chunks with tokens (one rank)
              for (const DispatchCounts& n : b.dispatch) {
                // Training forward: every chunk once; backward: each chunk rebuilt once.
                EXPECT_EQ(n.forwards, used * (mem_eff ? 1 : 2));
                EXPECT_EQ(n.forwards_for_backward, mem_eff ? used : 0);
              }
            }
            std::printf("%s %s %s %s, %lld chunks: moe peak %lld B (unchunked %lld B)\n", qwen2 ? "qwen2" : "qwen3",
                        recompute, permute, dispatch, static_cast<long long>(chunks),
                        static_cast<long long>(b.moe_peak), static_cast<long long>(a.moe_peak));
          }
        }
}

// The sequential experts' weight gradient is one GEMM per expert over its rows (OpenBLAS
// blocks the sum): chunked, every expert's gradient is a sum of per-chunk GEMMs. Everything
// else stays bit-identical; the expert gradients agree to float rounding (relative 1e-5).
TEST(MoeTokenChunks, SequentialExpertsAgreeToRounding) {
  ModelOptions base = test::model_options({{"experts", "sequential"}, {"recompute", "full"}});
  base.aux_loss_coef = 0.01;
  const RunResult a = run_once(base, true);
  ModelOptions o = base;
  o.moe_token_chunks = 3;
  const RunResult b = run_once(o, true);
  EXPECT_EQ(a.stats.loss_sum, b.stats.loss_sum);
  EXPECT_EQ(a.stats.aux_loss, b.stats.aux_loss);
  test::ModelRun probe(tiny_config(true), base, 11);
  size_t i = 0;
  for (Param* p : probe.model.params()) {
    const bool expert = p->hf == HfSplit::experts_gate_up || p->hf == HfSplit::experts_down;
    if (expert)
      EXPECT_LT(test::rel_error(b.grads[i], a.grads[i]), 1e-5) << p->name;
    else
      EXPECT_EQ(a.grads[i], b.grads[i]) << p->name;
    ++i;
  }
}

// The full-recompute forward keeps only what the MoE block's backward reads (its output is
// discarded, ctx.output_unused): with the memory_efficient permute the dispatcher rebuilds the
// experts' state without fc2 and posts no combine; with standard, backward reads the combined
// y_perm (d_prob), so fc2 and the combine run again. Gradients stay bit-identical to none.
// The counters would catch a recompute that runs fc2 (expert_forwards) or combines (combines).
TEST(Recompute, FullRecomputeSkipsFc2AndCombineWhereBackwardAllows) {
  for (bool qwen2 : {false, true})
    for (const char* permute : {"memory_efficient", "standard"})
      for (const char* dispatch : {"alltoall", "chunked_alltoall:3"})
        for (const char* experts : {"sequential", "grouped"}) {
          const bool mem_eff = std::string(permute) == "memory_efficient";
          const int64_t chunks = std::string(dispatch) == "alltoall" ? 1 : 3;
          const bool delay = qwen2 && chunks == 3;
          SCOPED_TRACE(std::string(qwen2 ? "qwen2 (shared expert) " : "qwen3 ") + permute + " " + dispatch +
                       " " + experts + (delay ? " delayed wgrad" : ""));
          const std::vector<std::pair<std::string, std::string>> prims = {
              {"permute", permute}, {"moe_dispatch", dispatch}, {"experts", experts}};
          ModelOptions none = test::model_options(prims), full = none;
          full.prims.set("recompute", "full", "test");
          none.aux_loss_coef = full.aux_loss_coef = 0.01;
          none.z_loss_coef = full.z_loss_coef = 0.01;
          const RunResult a = run_once(none, qwen2, delay), b = run_once(full, qwen2, delay);
          EXPECT_EQ(a.stats.loss_sum, b.stats.loss_sum);
          EXPECT_EQ(a.stats.aux_loss, b.stats.aux_loss);
          EXPECT_EQ(a.stats.z_loss, b.stats.z_loss);
          ASSERT_EQ(a.grads.size(), b.grads.size());
          for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << "param " << i;
          ASSERT_FALSE(a.dispatch.empty());
          ASSERT_EQ(a.dispatch.size(), b.dispatch.size());
          for (size_t l = 0; l < b.dispatch.size(); ++l) {
            SCOPED_TRACE("MoE layer " + std::to_string(l));
            const DispatchCounts& n = a.dispatch[l];
            const DispatchCounts& f = b.dispatch[l];
            // recompute = none: one forward, every chunk's experts and combine once.
            EXPECT_EQ(n.forwards, 1);
            EXPECT_EQ(n.forwards_for_backward, 0);
            EXPECT_EQ(n.expert_forwards, chunks);
            EXPECT_EQ(n.expert_rebuilds, 0);
            EXPECT_EQ(n.combines, chunks);
            // full: the training forward as above, then the recompute.
            EXPECT_EQ(f.forwards, mem_eff ? 1 : 2);
            EXPECT_EQ(f.forwards_for_backward, mem_eff ? 1 : 0);
            EXPECT_EQ(f.expert_forwards, (mem_eff ? 1 : 2) * chunks) << "fc2 ran in the recompute";
            EXPECT_EQ(f.expert_rebuilds, mem_eff ? chunks : 0);
            EXPECT_EQ(f.combines, (mem_eff ? 1 : 2) * chunks) << "the recompute combined";
          }
        }
}

TEST(Recompute, FullReusesTheStashedRouting) {
  ModelOptions none = test::model_options(), full = test::model_options({{"recompute", "full"}});
  for (bool qwen2 : {false, true}) {
    SCOPED_TRACE(qwen2 ? "qwen2 (a dense layer)" : "qwen3");
    RunResult a = run_once(none, qwen2), b = run_once(full, qwen2);
    ModelConfig c = tiny_config(qwen2);
    c.num_layers = 4;
    const size_t moe = static_cast<size_t>(c.num_moe_layers());
    // One routing entry per MoE layer (not two, the recompute's reversed), the same routing.
    ASSERT_EQ(a.routing.size(), moe);
    ASSERT_EQ(b.routing.size(), moe);
    EXPECT_EQ(a.routing, b.routing);
    // The recompute replayed each layer's stashed selection exactly once; no recompute, no replay.
    EXPECT_EQ(b.replays, std::vector<int64_t>(moe, 1));
    EXPECT_EQ(a.replays, std::vector<int64_t>(moe, 0));
  }
}

TEST(Recompute, ReplayIgnoresRouterChangesBeforeTheRecompute) {
  // A hook flips the router weights between the forward and each layer's recompute: a fresh
  // top-k would pick other experts, the replayed selection must not change.
  struct FlipRouters : LayerHooks {
    DecoderModel* m = nullptr;
    void before_forward(const Layer& L, Pass pass) override {
      if (pass != Pass::recompute || !L.moe) return;
      Param* r = m->find_param("model.layers." + std::to_string(L.index) + ".mlp.gate.weight");
      std::vector<float> w = r->value.to_floats();
      for (float& x : w) x = -x;
      r->value.copy_from(Tensor::from_floats(w, r->value.shape()));
    }
  };
  test::ModelRun run(tiny_config(), test::model_options({{"recompute", "full"}}), 11);
  FlipRouters flip;
  flip.m = &run.model;
  run.schedule.add_hooks(&flip);
  MicroBatch mb = tiny_batch(37, 5);
  auto routing = [&] {
    std::vector<std::vector<int32_t>> r;
    for (const Tensor& t : run.last_routing()) r.push_back(t.to_ints());
    return r;
  };
  run.forward(mb, nullptr);
  const auto before = routing();
  run.forward_backward(mb, 1.0f, 1.0);  // flips every router once, before its recompute
  EXPECT_EQ(routing(), before);
  run.forward(mb, nullptr);  // the flipped routers, routed afresh: another selection
  EXPECT_NE(routing(), before) << "the test would not notice a re-route";
}

TEST(Schedule, DelayedWeightGradientsAreBitIdentical) {
  for (bool qwen2 : {false, true}) {
    SCOPED_TRACE(qwen2 ? "qwen2" : "qwen3");
    ModelOptions o = test::model_options();
    o.aux_loss_coef = 0.01;
    RunResult a = run_once(o, qwen2, false), b = run_once(o, qwen2, true);
    EXPECT_EQ(a.stats.loss_sum, b.stats.loss_sum);
    for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << "param " << i;
  }
}

TEST(Schedule, HooksRunAroundEveryLayerInOrder) {
  struct Recorder : LayerHooks {
    std::string tag;
    std::vector<std::string>* log = nullptr;
    void add(const char* what, const Layer& L) { log->push_back(tag + what + std::to_string(L.index)); }
    void before_forward(const Layer& L, Pass p) override { add(p == Pass::recompute ? "Rf" : "f", L); }
    void after_forward(const Layer& L, Pass p) override { add(p == Pass::recompute ? "R/f" : "/f", L); }
    void before_backward(const Layer& L) override { add("b", L); }
    void after_block_backward(const Layer& L, size_t b) override {
      log->push_back(tag + "w" + std::to_string(L.index) + "." + std::to_string(b));
    }
    void after_backward(const Layer& L) override { add("/b", L); }
    void before_end(ModelEnd e, Pass) override { log->push_back(tag + "E" + end_name(e)); }
    void after_end(ModelEnd e, Pass) override { log->push_back(tag + "/E" + end_name(e)); }
    static const char* end_name(ModelEnd e) {
      return e == ModelEnd::embed ? "e" : e == ModelEnd::head ? "h" : "g";
    }
  };
  test::ModelRun run(tiny_config(), test::model_options({{"recompute", "full"}}), 3);
  std::vector<std::string> log;
  Recorder one, two;
  one.tag = "1";
  two.tag = "2";
  one.log = two.log = &log;
  run.schedule.add_hooks(&one);
  run.schedule.add_hooks(&two);
  run.forward_backward(tiny_batch(37, 2), 1.0f, 1.0);
  const std::vector<std::string> want = {
      "1Ee", "2Ee", "2/Ee", "1/Ee",                                    // embedding
      "1f0", "2f0", "2/f0", "1/f0", "1f1", "2f1", "2/f1", "1/f1",      // forward
      "1Eh", "2Eh", "2/Eh", "1/Eh",                                    // head (+ its backward)
      "1b1", "2b1", "1Rf1", "2Rf1", "2R/f1", "1R/f1",                  // layer 1 backward:
      "2w1.1", "1w1.1", "2w1.0", "1w1.0", "2/b1", "1/b1",              // each block's weights
      "1b0", "2b0", "1Rf0", "2Rf0", "2R/f0", "1R/f0",                  // layer 0 backward
      "2w0.1", "1w0.1", "2w0.0", "1w0.0", "2/b0", "1/b0",
      "1Eg", "2Eg", "2/Eg", "1/Eg"};                                   // embedding gradient
  EXPECT_EQ(log, want);
}

TEST(PrimitiveSwap, LinearCeEqualsFullCe) {
  ModelOptions a = test::model_options({{"loss", "full_ce"}});
  ModelOptions b = test::model_options({{"loss", "linear_ce"}});
  b.prims.loss_chunks = {5, 7, 5};
  expect_same(run_once(a), run_once(b), 1e-5, "full_ce vs linear_ce");
}

TEST(PrimitiveSwap, MemoryEfficientPermuteEqualsStandard) {
  ModelOptions a = test::model_options(), b = test::model_options({{"permute", "memory_efficient"}});
  expect_same(run_once(a), run_once(b), 1e-5, "permute");
  expect_same(run_once(a, true), run_once(b, true), 1e-5, "permute (qwen2)");
}

TEST(PrimitiveSwap, GroupedExpertsEqualSequential) {
  ModelOptions a = test::model_options(), b = test::model_options({{"experts", "grouped"}});
  expect_same(run_once(a), run_once(b), 1e-5, "experts");
}

TEST(Model, HfTensorsAreViewsWithHfNames) {
  DecoderModel m(tiny_config(true), ModelOptions{}, 1);  // qwen2 tiny: dense layer 0, shared expert
  std::map<std::string, Tensor> byname;
  for (const HfTensor& t : m.hf_tensors()) byname[t.name] = t.value();
  ASSERT_TRUE(byname.count("model.layers.1.mlp.experts.3.down_proj.weight"));
  ASSERT_TRUE(byname.count("model.layers.1.mlp.experts.0.gate_proj.weight"));
  ASSERT_TRUE(byname.count("model.layers.0.mlp.up_proj.weight"));
  ASSERT_TRUE(byname.count("lm_head.weight"));
  EXPECT_EQ(byname["model.layers.1.mlp.experts.0.gate_proj.weight"].shape(), (Shape{12, 16}));
  // Writing through a view changes the fused parameter.
  Tensor up = byname["model.layers.1.mlp.experts.2.up_proj.weight"];
  up.fill_(5.0);
  auto fused = m.find_param("model.layers.1.mlp.experts.gate_up_proj")->value.to_floats();
  EXPECT_EQ(fused[(2 * 24 + 12) * 16], 5.0f);  // expert 2, row F (first up row)
  EXPECT_NE(fused[(2 * 24 + 11) * 16], 5.0f);  // last gate row untouched
  int64_t n = 0;
  for (auto& [k, t] : byname) n += t.numel();
  EXPECT_EQ(n, m.num_params());
  EXPECT_EQ(m.num_params(), tiny_config(true).num_params());
  ASSERT_TRUE(byname.count("model.layers.1.mlp.shared_expert.up_proj.weight"));
}

TEST(Model, ExpertNamesTakeTheUnitsGlobalExpertOffset) {
  DecoderModel m(tiny_config(true), ModelOptions{}, 1);
  for (ParamUnit* u : m.units())
    if (u->kind == UnitKind::experts) u->first_expert = 8;  // as expert parallelism will place them
  std::map<std::string, HfTensor> byname;
  for (const HfTensor& t : m.hf_tensors()) byname[t.name] = t;
  EXPECT_FALSE(byname.count("model.layers.1.mlp.experts.0.gate_proj.weight"));
  ASSERT_TRUE(byname.count("model.layers.1.mlp.experts.8.gate_proj.weight"));
  ASSERT_TRUE(byname.count("model.layers.1.mlp.experts.11.down_proj.weight"));
  const HfTensor& t = byname.at("model.layers.1.mlp.experts.9.up_proj.weight");
  EXPECT_EQ(t.offset, (1 * 24 + 12) * 16);  // local expert 1, row F
}

TEST(Units, ParamsAreViewsIntoFlatUnitBuffers) {
  ModelConfig c = tiny_config(true);
  DecoderModel m(c, ModelOptions{}, 1);
  std::vector<ParamUnit*> units = m.units();
  std::vector<std::string> names;
  for (ParamUnit* u : units) names.push_back(u->name);
  EXPECT_EQ(names, (std::vector<std::string>{"embed", "layers.0.dense", "layers.1.dense",
                                             "layers.1.experts", "head"}));
  int64_t params = 0;
  for (ParamUnit* u : units) {
    SCOPED_TRACE(u->name);
    EXPECT_EQ(u->value.numel(), u->numel);
    EXPECT_EQ(u->grad.numel(), u->numel);
    EXPECT_EQ(u->grad.dtype(), DType::f32);
    EXPECT_EQ(u->numel % ParamStore::kAlign, 0);
    bool in_decay = true;
    int64_t end = 0;
    for (Param* p : u->params) {
      EXPECT_EQ(p->unit, u);
      EXPECT_EQ(p->offset % ParamStore::kAlign, 0) << p->name;
      EXPECT_GE(p->offset, end) << p->name << " overlaps the previous parameter";
      end = p->offset + p->numel();
      if (!p->decay) in_decay = false;
      EXPECT_EQ(p->decay, in_decay) << p->name << ": the weight-decayed parameters come first";
      EXPECT_EQ(p->offset < u->decay_numel, p->decay) << p->name;
      // The views point into the flat buffers.
      EXPECT_EQ(p->value.raw(), static_cast<char*>(u->value.raw()) + p->offset * 4) << p->name;
      EXPECT_EQ(p->grad.raw(), static_cast<char*>(u->grad.raw()) + p->offset * 4) << p->name;
      params += p->numel();
    }
    EXPECT_LE(end, u->numel);
  }
  EXPECT_EQ(params, c.num_params());
  // A write through a Param view lands in its unit's flat buffer, at its offset.
  Param* wq = m.find_param("model.layers.1.self_attn.q_proj.weight");
  wq->value.fill_(3.0);
  wq->grad.fill_(-2.0);
  const std::vector<float> flat = wq->unit->value.to_floats(), gflat = wq->unit->grad.to_floats();
  EXPECT_EQ(flat[wq->offset], 3.0f);
  EXPECT_EQ(flat[wq->offset + wq->numel() - 1], 3.0f);
  EXPECT_EQ(gflat[wq->offset + 7], -2.0f);
  // zero_grad clears the whole unit (one memset).
  m.zero_grad();
  for (float g : wq->unit->grad.to_floats()) ASSERT_EQ(g, 0.0f);
  // The experts of a MoE layer are their own unit and know how many they hold.
  ParamUnit* ex = m.find_param("model.layers.1.mlp.experts.down_proj")->unit;
  EXPECT_EQ(ex->kind, UnitKind::experts);
  EXPECT_EQ(ex->layer, 1);
  EXPECT_EQ(ex->num_experts, c.num_experts);
  EXPECT_EQ(ex->first_expert, 0);
  EXPECT_EQ(m.find_param("model.layers.1.mlp.gate.weight")->unit->kind, UnitKind::dense);
  EXPECT_EQ(m.find_param("model.norm.weight")->unit->kind, UnitKind::head);
}

TEST(Units, GradNormIsTheSumOfPerUnitSumsOfSquares) {
  test::ModelRun run(tiny_config(true), test::model_options(), 4);
  MicroBatch mb = tiny_batch(37, 8);
  run.forward_backward(mb, 1.0f / static_cast<float>(mb.num_valid), 1.0);
  std::vector<Tensor> per_param, per_unit;
  for (Param* p : run.model.params()) per_param.push_back(p->grad);
  double units_sq = 0;
  for (ParamUnit* u : run.model.units()) {
    per_unit.push_back(u->grad);
    units_sq += sum_of_squares(u->grad);
  }
  const double by_param = global_grad_norm(per_param), by_unit = global_grad_norm(per_unit);
  EXPECT_GT(by_param, 0);
  EXPECT_NEAR(by_unit, by_param, 1e-12 * by_param) << "the padding must hold no gradient";
  EXPECT_NEAR(std::sqrt(units_sq), by_param, 1e-12 * by_param);
}

// The attention block alone, with every option a later model needs (q/k/v biases, QK norm, the
// output gate from q_proj's second half, RoPE on part of each head): input and parameter
// gradients against central differences, weight gradients now or queued alike.
TEST(Blocks, AttentionWithOutputGateAndPartialRotaryMatchesFiniteDifferences) {
  AttentionBlockConfig ac;
  ac.hidden = 16;
  ac.num_heads = 4;
  ac.num_kv_heads = 2;
  ac.head_dim = 8;
  ac.qkv_bias = true;
  ac.qk_norm = true;
  ac.output_gate = true;
  ac.rope_theta = 100;
  ac.rotary_dim = 4;
  ParamStore store;
  ParamUnit& unit = store.add_unit("layers.0.dense", UnitKind::dense, 0);
  AttentionBlock blk(store, unit, "model.layers.0.", ac);
  store.allocate(Device::cpu(), DType::f32);
  EXPECT_EQ(store.find("model.layers.0.self_attn.q_proj.weight")->shape, (Shape{4 * 8 * 2, 16}));
  uint64_t seed = 0;
  for (Param* p : store.params()) {
    fill_normal(p->value, 5, seed++ << 32, p->name.find("norm") != std::string::npos ? 1.0f : 0.0f, 0.3f);
  }
  const MicroBatch mb = tiny_batch(37, 9);
  const int64_t T = mb.tokens.numel();
  const std::vector<float> x0 = test::randn(T * 16, 10), w = test::randn(T * 16, 11);
  BatchContext ctx;
  ctx.mb = &mb;
  auto loss = [&](const std::vector<float>& x) {
    const std::vector<float> y = blk.forward(Tensor::from_floats(x, {T, 16}), ctx, nullptr).to_floats();
    double L = 0;
    for (size_t i = 0; i < y.size(); ++i) L += double(y[i]) * w[i];
    return L;
  };
  auto grads = [&](bool defer) {
    store.zero_grad();
    ctx.defer_wgrad = defer;
    auto saved = blk.make_saved();
    blk.forward(Tensor::from_floats(x0, {T, 16}), ctx, saved.get());
    Tensor dx = blk.backward_data(Tensor::from_floats(w, {T, 16}), ctx, *saved);
    EXPECT_EQ(saved->deferred_wgrad.empty(), !defer);
    blk.backward_weight(ctx, *saved);
    EXPECT_TRUE(saved->deferred_wgrad.empty());
    std::vector<std::vector<float>> g{dx.to_floats()};
    for (Param* p : store.params()) g.push_back(p->grad.to_floats());
    ctx.defer_wgrad = false;
    return g;
  };
  const auto g_now = grads(false), g_later = grads(true);
  EXPECT_EQ(g_now, g_later);
  // The input: one central difference per element.
  const double h = 1e-3;
  std::vector<double> fd_x(x0.size());
  for (size_t i = 0; i < x0.size(); ++i) {
    std::vector<float> xp = x0, xm = x0;
    xp[i] += static_cast<float>(h);
    xm[i] -= static_cast<float>(h);
    fd_x[i] = (loss(xp) - loss(xm)) / (2 * h);
  }
  EXPECT_LT(test::rel_error(g_now[0], fd_x), 2e-2);
  // Each parameter along a random direction.
  size_t pi = 1;
  for (Param* p : store.params()) {
    const std::vector<float> v0 = p->value.to_floats(), u = test::randn(v0.size(), 100 + pi);
    double analytic = 0;
    for (size_t i = 0; i < v0.size(); ++i) analytic += double(g_now[pi][i]) * u[i];
    auto at = [&](double sgn) {
      std::vector<float> v = v0;
      for (size_t i = 0; i < v.size(); ++i) v[i] += static_cast<float>(sgn * h * u[i]);
      p->value.copy_from(Tensor::from_floats(v, p->shape));
      return loss(x0);
    };
    const double fd = (at(+1) - at(-1)) / (2 * h);
    p->value.copy_from(Tensor::from_floats(v0, p->shape));
    EXPECT_LT(std::fabs(fd - analytic) / std::max(std::fabs(fd), 1e-2), 2e-2)
        << p->name << ": finite difference " << fd << " vs analytic " << analytic;
    ++pi;
  }
}

TEST(Model, BadBatchIsAClearError) {
  test::ModelRun run(tiny_config(), ModelOptions{}, 1);
  MicroBatch mb = tiny_batch(37, 1);
  mb.tokens = Tensor::from_ints({}, {0});
  test::expect_error_contains([&] { run.forward(mb, nullptr); }, "empty micro-batch");
  MicroBatch mb2 = tiny_batch(37, 1);
  mb2.tokens = Tensor::from_ints(std::vector<int32_t>(12, 40), {12});
  test::expect_error_contains([&] { run.forward(mb2, nullptr); }, "outside the vocabulary");
}

}  // namespace
}  // namespace bb
