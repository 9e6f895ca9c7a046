// Router replay (primitives.router_replay): the MoE layers route by the micro-batch's routing.
//
// Oracle: the run that chose the routing itself. Replaying the routing a pass recorded gives
// that pass bit for bit (loss, aux loss, every gradient, the logits of an evaluation forward),
// with and without full recompute; replaying another routing sends the tokens exactly there.
// The data side (records, packing, CP shards) is in test_data (Rollouts.*); layouts in
// tests/mpi/test_policy.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <vector>

#include "common/model.h"
#include "common/testing.h"
#include "common/tiny_models.h"
#include "runtime/data.h"
#include "runtime/run_config.h"
#include "runtime/trainer.h"

namespace bb {
namespace {

ModelConfig config() { return test::small_moe({.layers = 3, .experts = 8, .top_k = 2, .heads = 2, .kv_heads = 1}); }

// Two documents (one split at the end) of random tokens, packed like training data.
MicroBatch batch(int64_t T) {
  std::vector<Document> docs(2);
  uint64_t s = 3;
  for (int d = 0; d < 2; ++d)
    for (int i = 0; i < 25 + 9 * d; ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      docs[d].tokens.push_back(static_cast<int32_t>((s >> 33) % 250));
    }
  DataConfig dc;
  dc.tokens_per_micro_batch = T;
  dc.shuffle = false;
  DataLoader loader(dc, corpus_from_documents(docs, 264));
  return loader.next();
}

// The per-layer [T, K] selections of a pass as MicroBatch::routing [T, L * K].
Tensor as_batch_routing(const std::vector<Tensor>& layers) {
  const int64_t L = static_cast<int64_t>(layers.size()), T = layers[0].size(0), K = layers[0].size(1);
  std::vector<int32_t> out(static_cast<size_t>(T * L * K));
  for (int64_t l = 0; l < L; ++l) {
    const std::vector<int32_t> v = layers[l].to_ints();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) out[static_cast<size_t>((t * L + l) * K + k)] = v[t * K + k];
  }
  return Tensor::from_ints(out, {T, L * K});
}

struct Pass {
  ForwardStats st;
  std::vector<std::vector<float>> grads;
  std::vector<std::vector<int32_t>> routing;
  std::vector<Tensor> routing_tensors;
};

Pass train_pass(const ModelOptions& o, const MicroBatch& mb) {
  test::ModelRun run(config(), o, 5);
  run.model.zero_grad();
  Pass p;
  p.st = run.forward_backward(mb, 1.0f / static_cast<float>(mb.num_valid), 1.0);
  for (Param* q : run.model.params()) p.grads.push_back(q->grad.to_floats());
  for (const Tensor& t : run.last_routing()) {
    p.routing.push_back(t.to_ints());
    p.routing_tensors.push_back(t);
  }
  return p;
}

ModelOptions options(const char* recompute, bool replay) {
  ModelOptions o = test::model_options({{"recompute", recompute}});
  o.prims.router_replay = replay;
  return o;
}

TEST(RouterReplay, ReplayingTheRecordedRoutingIsBitIdentical) {
  for (const char* recompute : {"none", "full"}) {
    SCOPED_TRACE(recompute);
    MicroBatch mb = batch(48);
    const Pass own = train_pass(options(recompute, false), mb);
    ASSERT_EQ(own.routing.size(), 2u);  // layer 0 is dense
    MicroBatch replayed = mb;
    replayed.routing = as_batch_routing(own.routing_tensors);
    const Pass rep = train_pass(options(recompute, true), replayed);
    EXPECT_EQ(rep.st.loss_sum, own.st.loss_sum);
    EXPECT_EQ(rep.st.aux_loss, own.st.aux_loss);
    EXPECT_EQ(rep.routing, own.routing);
    ASSERT_EQ(rep.grads.size(), own.grads.size());
    for (size_t i = 0; i < own.grads.size(); ++i) EXPECT_EQ(rep.grads[i], own.grads[i]) << "param " << i;
  }
  // An evaluation forward: the logits too.
  MicroBatch mb = batch(40);
  test::ModelRun a(config(), options("none", false), 9), b(config(), options("none", true), 9);
  Tensor la, lb;
  const ForwardStats sa = a.forward(mb, &la);
  MicroBatch replayed = mb;
  replayed.routing = as_batch_routing(a.last_routing());
  const ForwardStats sb = b.forward(replayed, &lb);
  EXPECT_EQ(sa.loss_sum, sb.loss_sum);
  EXPECT_EQ(la.to_floats(), lb.to_floats());
  // An evaluation forward without routing (generation, the log-probs pass that records the
  // routing) routes itself under replay too; only a training forward needs the routing.
  Tensor lc;
  b.forward(mb, &lc);
  EXPECT_EQ(la.to_floats(), lc.to_floats());
  EXPECT_EQ(b.last_routing()[0].to_ints(), a.last_routing()[0].to_ints());
}

// Another routing than the model's own: the tokens go exactly where it says, and the result is
// not the model's own pass.
TEST(RouterReplay, TokensGoWhereTheRoutingSays) {
  MicroBatch mb = batch(48);
  const Pass own = train_pass(options("none", false), mb);
  const int64_t T = 48, K = 2, L = 2, E = 8;
  std::vector<int32_t> r(static_cast<size_t>(T * L * K));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t l = 0; l < L; ++l)
      for (int64_t k = 0; k < K; ++k) r[static_cast<size_t>((t * L + l) * K + k)] = static_cast<int32_t>((t + 3 * k + l) % E);
  MicroBatch replayed = mb;
  replayed.routing = Tensor::from_ints(r, {T, L * K});
  const Pass rep = train_pass(options("full", true), replayed);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        EXPECT_EQ(rep.routing[l][t * K + k], r[static_cast<size_t>((t * L + l) * K + k)]);
  EXPECT_NE(rep.st.loss_sum, own.st.loss_sum);
  EXPECT_NE(rep.routing, own.routing);
}

TEST(RouterReplay, BadRoutingIsAClearError) {
  MicroBatch mb = batch(48);
  test::expect_error_contains([&] { train_pass(options("none", true), mb); },
                              "primitives.router_replay is on but the micro-batch has no routing");
  MicroBatch bad = mb;
  std::vector<int32_t> r(48 * 4, 1);
  for (int64_t t = 0; t < 48; ++t) r[static_cast<size_t>(t * 4 + 1)] = r[static_cast<size_t>(t * 4 + 3)] = 2;  // (1, 2)
  r[7 * 4 + 2] = 8;  // token 7, layer 1: expert 8 of 8
  bad.routing = Tensor::from_ints(r, {48, 4});
  test::expect_error_contains([&] { train_pass(options("none", true), bad); },
                              "MoE layer 1: the replayed routing sends token 7 to expert 8, outside [0, 8)");
  r[7 * 4 + 2] = 2;  // token 7, layer 1: (2, 2)
  bad.routing = Tensor::from_ints(r, {48, 4});
  test::expect_error_contains([&] { train_pass(options("none", true), bad); }, "to expert 2 twice");
  bad.routing = Tensor::from_ints(std::vector<int32_t>(48 * 2, 0), {48, 2});
  test::expect_error_contains([&] { train_pass(options("none", true), bad); }, "expected i32 [48, 4]");
}

// The trainer checks the data's routing against the model before the first step.
TEST(RouterReplay, TrainerChecksTheDataAgainstTheModel) {
  const std::string dir = ::testing::TempDir();
  const std::string cfg_path = dir + "/replay_model.json";
  {
    std::ofstream(cfg_path) << config().to_hf_json().dump(2);
  }
  const std::string toml = "[model]\nconfig = \"" + cfg_path + "\"\n[primitives]\nrouter_replay = true\n"
                           "[train]\nsteps = 1\nmicro_batch_tokens = 32\n[checkpoint]\nevery = 0\nsave_final = false\n";
  auto docs_with = [](int64_t layers, int64_t topk, int32_t id) {
    std::vector<Document> d(1);
    d[0].tokens = {1, 2, 3, 4, 5};
    d[0].routing.assign(static_cast<size_t>(5 * layers * topk), 0);
    for (size_t i = 0; i < d[0].routing.size(); ++i) d[0].routing[i] = static_cast<int32_t>(i % topk);
    d[0].routing.back() = id;
    d[0].routing_layers = layers;
    d[0].routing_topk = topk;
    return corpus_from_documents(d, 264);
  };
  const RunConfig rc = parse_run_config(toml, "test");
  test::expect_error_contains([&] { Trainer t(rc, nullptr, docs_with(3, 2, 1), comm::self_group()); },
                              "\"routing\" has 3 MoE layers x top-k 2 per token; the model routes 2 MoE layers x top-k 2");
  test::expect_error_contains([&] { Trainer t(rc, nullptr, docs_with(2, 2, 9), comm::self_group()); },
                              "document 0: \"routing\" names expert 9, but the model has 8 experts");
  std::vector<Document> plain(1);
  plain[0].tokens = {1, 2, 3};
  test::expect_error_contains([&] { Trainer t(rc, nullptr, corpus_from_documents(plain, 264), comm::self_group()); },
                              "has no \"routing\"");
  Trainer ok(rc, nullptr, docs_with(2, 2, 1), comm::self_group());
  EXPECT_TRUE(std::isfinite(ok.train_step().loss));
}

}  // namespace
}  // namespace bb
