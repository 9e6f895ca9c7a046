// The forward-only pass (runtime/logprobs.h) against an independent path: the trainer's own
// evaluation forward with materialised [T, V] logits and a log-softmax in double (on the same
// weights, loaded from the same Hugging Face directory); the routing against that forward's;
// the checkpoint and HF paths against each other; the memory it holds (no gradients, no
// optimizer state). Layouts: tests/mpi/test_policy (LogprobsLayouts...).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "common/testing.h"
#include "common/tiny_models.h"
#include "core/memory.h"
#include "models/hf_io.h"
#include "runtime/logprobs.h"
#include "runtime/run_config.h"
#include "runtime/trainer.h"

namespace bb {
namespace {

namespace fs = std::filesystem;

struct Fixture {
  std::string dir;
  RunConfig cfg;
  Corpus docs;
};

// A small MoE trained 2 steps (so the weights are not the initialisation), saved as a checkpoint
// and exported as an HF directory; documents of mixed lengths.
Fixture& fixture() {
  static Fixture f = [] {
    Fixture x;
    x.dir = (fs::temp_directory_path() / ("bb_test_logprobs_" + std::to_string(::getpid()))).string();
    fs::remove_all(x.dir);
    fs::create_directories(x.dir);
    std::ofstream(x.dir + "/config.json") << test::small_moe({.layers = 3, .heads = 4, .kv_heads = 2, .head_dim = 8}).to_hf_json().dump(2);
    const std::string toml = "[model]\nconfig = \"" + x.dir + "/config.json\"\n[train]\nsteps = 2\nmicro_batch_tokens = 128\n"
                             "[data]\ndemo_documents = 40\n[checkpoint]\ndir = \"" + x.dir + "/ck\"\nevery = 0\n";
    x.cfg = parse_run_config(toml, "test");
    {
      Trainer t(x.cfg, nullptr);
      t.train_step();
      t.train_step();
      t.save_checkpoint(x.dir + "/ck");
      HfExportOptions eo;
      eo.dtype = DType::f32;
      export_hf(t.model(), x.dir + "/hf", eo);
    }
    x.cfg.ckpt_dir.clear();
    uint64_t s = 9;
    for (int d = 0; d < 9; ++d) {
      std::vector<int32_t> tok;
      for (int i = 0; i < 3 + 11 * d; ++i) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        tok.push_back(static_cast<int32_t>((s >> 33) % 250));
      }
      x.docs.add(tok);
    }
    return x;
  }();
  return f;
}

TEST(Logprobs, MatchTheMaterialisedLogitsOfTheTrainersForward) {
  Fixture& f = fixture();
  for (double temperature : {1.0, 0.7}) {
    SCOPED_TRACE(temperature);
    LogprobsRunner r(f.cfg, "hf:" + f.dir + "/hf", nullptr);
    const std::vector<DocLogprobs> out = r.run(f.docs, temperature, true);
    // The independent path: a trainer initialised from the same directory, one evaluation
    // forward per document, logits [T, V] on the host, log-softmax in double.
    RunConfig tc = f.cfg;
    tc.model_init = "hf:" + f.dir + "/hf";
    Trainer t(tc, nullptr);
    const int64_t V = tc.model.vocab_size;
    double worst = 0;
    for (int64_t d = 0; d < f.docs.num_documents(); ++d) {
      const int64_t n = f.docs.length(d);
      std::vector<int32_t> tok(f.docs.tokens.begin() + f.docs.offsets[d], f.docs.tokens.begin() + f.docs.offsets[d + 1]);
      std::vector<int32_t> pos(static_cast<size_t>(n)), tgt(static_cast<size_t>(n), -1);
      for (int64_t j = 0; j < n; ++j) pos[j] = static_cast<int32_t>(j);
      MicroBatch mb;
      mb.tokens = Tensor::from_ints(tok, {n});
      mb.targets = Tensor::from_ints(tgt, {n});
      mb.positions = Tensor::from_ints(pos, {n});
      mb.cu_seqlens = Tensor::from_ints({0, static_cast<int32_t>(n)}, {2});
      const std::vector<float> logits = t.forward_logits(mb).to_floats();
      const DocLogprobs& o = out[static_cast<size_t>(d)];
      ASSERT_EQ(static_cast<int64_t>(o.logprobs.size()), n);
      EXPECT_EQ(o.logprobs[0], 0.0f);
      for (int64_t j = 1; j < n; ++j) {
        const float* row = logits.data() + (j - 1) * V;
        double mx = -1e300;
        for (int64_t v = 0; v < V; ++v) mx = std::max(mx, row[v] / temperature);
        double s = 0, sz = 0;
        for (int64_t v = 0; v < V; ++v) {
          const double z = row[v] / temperature, e = std::exp(z - mx);
          s += e, sz += e * z;
        }
        const double lse = mx + std::log(s);
        worst = std::max({worst, std::abs(o.logprobs[j] - (row[tok[j]] / temperature - lse)),
                          std::abs(o.entropy[j] - (lse - sz / s))});
      }
      // The routing: what this forward routed each token to.
      const std::vector<Tensor>& layers = t.schedule().last_routing();
      const int64_t L = static_cast<int64_t>(layers.size()), K = tc.model.top_k;
      ASSERT_EQ(static_cast<int64_t>(o.routing.size()), n * L * K);
      for (int64_t l = 0; l < L; ++l) {
        const std::vector<int32_t> ids = layers[static_cast<size_t>(l)].to_ints();
        for (int64_t j = 0; j < n; ++j)
          for (int64_t k = 0; k < K; ++k) EXPECT_EQ(o.routing[(j * L + l) * K + k], ids[j * K + k]) << "doc " << d;
      }
    }
    EXPECT_LT(worst, 2e-5);
  }
}

TEST(Logprobs, CheckpointAndHfWeightsGiveTheSameAndHoldNoTrainingState) {
  Fixture& f = fixture();
  Allocator& a = allocator_for(Device::cpu());
  const int64_t grads0 = a.stats().live_of(MemCategory::grads), opt0 = a.stats().live_of(MemCategory::optimizer);
  LogprobsRunner ck(f.cfg, f.dir + "/ck", nullptr);
  EXPECT_EQ(a.stats().live_of(MemCategory::grads), grads0);  // no gradient buffer
  EXPECT_EQ(a.stats().live_of(MemCategory::optimizer), opt0);  // no master, no moments
  const std::vector<DocLogprobs> x = ck.run(f.docs, 1.0, true);
  EXPECT_EQ(a.stats().peak_of(MemCategory::grads), grads0);
  EXPECT_EQ(a.stats().peak_of(MemCategory::optimizer), opt0);
  LogprobsRunner hf(f.cfg, "hf:" + f.dir + "/hf", nullptr);
  const std::vector<DocLogprobs> y = hf.run(f.docs, 1.0, true);
  for (size_t d = 0; d < x.size(); ++d) {
    EXPECT_EQ(x[d].logprobs, y[d].logprobs);  // f32 masters and an f32 export: the same values
    EXPECT_EQ(x[d].routing, y[d].routing);
  }
}

TEST(Logprobs, ErrorsAreClear) {
  Fixture& f = fixture();
  test::expect_error_contains([&] { LogprobsRunner r(f.cfg, f.dir + "/nowhere", nullptr); }, "no checkpoint at");
  RunConfig other = f.cfg;
  other.model.num_experts = 4;
  test::expect_error_contains([&] { LogprobsRunner r(other, f.dir + "/ck", nullptr); }, "was written for another model");
  LogprobsRunner r(f.cfg, f.dir + "/ck", nullptr);
  test::expect_error_contains([&] { r.run(f.docs, 0.0, false); }, "the temperature must be > 0");
  Corpus big;
  big.add(std::vector<int32_t>(300, 5));
  test::expect_error_contains([&] { r.run(big, 1.0, false); }, "more than a micro-batch holds");
}

}  // namespace
}  // namespace bb
