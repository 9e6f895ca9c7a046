// Qwen3.5 hybrid model: the Gated DeltaNet block against finite differences (input and every
// parameter, weight gradients now or queued alike), its gates, and a tiny whole Qwen3.5 model
// (GDN + gated attention + MoE with shared expert, zero-centred norms): gradients against finite
// differences, recompute full == none and delayed wgrad bit-identical, packed sequences
// independent, parameter names / units / initialisation as transformers has them, and the f32
// unit of A_log / dt_bias under bf16 weights.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>

#include "common/model.h"
#include "common/model_grad.h"
#include "common/testing.h"
#include "common/tiny_models.h"
#include "core/rng.h"
#include "models/decoder.h"
#include "models/gdn_block.h"
#include "runtime/run_config.h"

namespace bb {
namespace {

// 2 layers: [linear_attention, full_attention]; 4 layers: 3 x linear then full (the Qwen3.5
// pattern). Dk != Dv so that a swapped key / value dim fails; partial RoPE on 4 of 8 dims.
ModelConfig tiny_qwen35(int64_t layers = 2) {
  ModelConfig c = test::qwen35_config({.layers = layers});
  c.init_std = 0.3;  // large enough that every path carries signal in a 2-layer model
  return c;
}

// Packed sequences of the given lengths, next-token targets (the last of each masked) and
// position ids restarting at each sequence.
MicroBatch batch_of(const std::vector<std::vector<int32_t>>& docs) {
  std::vector<int32_t> tok, tgt, pos, cu = {0};
  for (const auto& d : docs) {
    for (size_t i = 0; i < d.size(); ++i) {
      tok.push_back(d[i]);
      tgt.push_back(i + 1 < d.size() ? d[i + 1] : -1);
      pos.push_back(static_cast<int32_t>(i));
    }
    cu.push_back(cu.back() + static_cast<int32_t>(d.size()));
  }
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

std::vector<std::vector<int32_t>> random_docs(const std::vector<int64_t>& lens, int64_t V,
                                              uint64_t seed) {
  std::vector<std::vector<int32_t>> docs;
  uint64_t ctr = 0;
  for (int64_t L : lens) {
    std::vector<int32_t> d;
    for (int64_t i = 0; i < L; ++i)
      d.push_back(static_cast<int32_t>(philox4x32_10(seed, ctr++).v[0] % V));
    docs.push_back(d);
  }
  return docs;
}

// Two packed sequences (9 and 6 tokens: longer than the conv kernel, so the conv and the state
// both cross several tokens), one extra masked target.
MicroBatch tiny_batch(uint64_t seed) {
  MicroBatch mb = batch_of(random_docs({9, 6}, 37, seed));
  std::vector<int32_t> t = mb.targets.to_ints();
  t[2] = -1;
  mb.targets = Tensor::from_ints(t, {static_cast<int64_t>(t.size())});
  mb.num_valid -= 1;
  return mb;
}

// Values for the GDN block test: matrices N(0, 0.3), the zero-centred input norm around 0, the
// gated norm around 1, A_log = log(U(0.5, 4)) and dt_bias around 1 (decays neither 0 nor 1).
void fill_block_params(ParamStore& store) {
  uint64_t seed = 0;
  for (Param* p : store.params()) {
    const size_t n = static_cast<size_t>(p->numel());
    std::vector<float> v;
    if (p->name.find("A_log") != std::string::npos) {
      v = test::randu(n, 40 + seed, 0.5f, 4.0f);
      for (float& x : v) x = std::log(x);
    } else {
      const float mean = p->name.find("linear_attn.norm") != std::string::npos ||
                                 p->name.find("dt_bias") != std::string::npos
                             ? 1.0f
                             : 0.0f;
      v = test::randn(n, 40 + seed, 0.3f);
      for (float& x : v) x += mean;
    }
    p->value.copy_from(Tensor::from_floats(v, p->shape));
    ++seed;
  }
}

TEST(GdnBlock, MatchesFiniteDifferencesAndDefersWeightGradients) {
  GdnBlockConfig gc;
  gc.hidden = 16;
  gc.num_key_heads = 2;
  gc.num_value_heads = 4;
  gc.key_head_dim = 8;
  gc.value_head_dim = 6;
  gc.conv_kernel = 4;
  ParamStore store;
  ParamUnit& unit = store.add_unit("layers.0.dense", UnitKind::dense, 0);
  ParamUnit& f32 = store.add_unit("layers.0.dense_f32", UnitKind::dense, 0, true);
  GdnBlock blk(store, unit, f32, "model.layers.0.", gc);
  store.allocate(Device::cpu(), DType::f32);
  const int64_t C = 2 * 2 * 8 + 4 * 6;
  EXPECT_EQ(store.find("model.layers.0.linear_attn.in_proj_qkv.weight")->shape, (Shape{C, 16}));
  EXPECT_EQ(store.find("model.layers.0.linear_attn.conv1d.weight")->shape, (Shape{C, 1, 4}));
  EXPECT_EQ(store.find("model.layers.0.linear_attn.A_log")->unit, &f32);
  fill_block_params(store);
  const MicroBatch mb = tiny_batch(9);
  const int64_t T = mb.tokens.numel();
  const std::vector<float> x0 = test::randn(static_cast<size_t>(T * 16), 10),
                           w = test::randn(static_cast<size_t>(T * 16), 11);
  BatchContext ctx;
  ctx.mb = &mb;
  auto loss = [&](const std::vector<float>& x) {
    const std::vector<float> y =
        blk.forward(Tensor::from_floats(x, {T, 16}), ctx, nullptr).to_floats();
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
  EXPECT_EQ(g_now, g_later) << "queued weight gradients must equal immediate ones";
  const double h = 1e-3;
  std::vector<double> fd_x(x0.size());
  for (size_t i = 0; i < x0.size(); ++i) {
    std::vector<float> xp = x0, xm = x0;
    xp[i] += static_cast<float>(h);
    xm[i] -= static_cast<float>(h);
    fd_x[i] = (loss(xp) - loss(xm)) / (2 * h);
  }
  EXPECT_LT(test::rel_error(g_now[0], fd_x), 1e-2) << "d_x";
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
    if (std::getenv("BB_VERBOSE"))
      std::printf("%-48s fd %+.6e an %+.6e\n", p->name.c_str(), fd, analytic);
    EXPECT_GT(std::fabs(analytic), 1e-3) << p->name << ": no gradient reaches it";
    EXPECT_LT(std::fabs(fd - analytic) / std::max(std::fabs(fd), 1e-2), 1e-2)
        << p->name << ": finite difference " << fd << " vs analytic " << analytic;
    ++pi;
  }
}

TEST(GdnBlock, GatesFollowTheReferenceFormula) {
  // g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); softplus(x) = x above 20 (torch),
  // so a large logit stays finite.
  const Tensor a = Tensor::from_floats({0.5f, -2.0f, 100.0f, 3.0f}, {2, 2});
  const Tensor b = Tensor::from_floats({0.0f, 1.0f, -1.0f, 30.0f}, {2, 2});
  const Tensor a_log = Tensor::from_floats({std::log(2.0f), 0.0f}, {2});
  const Tensor dt = Tensor::from_floats({1.0f, -0.5f}, {2});
  GdnGates gt = gdn_gates_forward(a, b, a_log, dt);
  const std::vector<float> g = gt.g.to_floats(), beta = gt.beta.to_floats();
  EXPECT_NEAR(g[0], -2.0 * std::log1p(std::exp(1.5)), 1e-6);
  EXPECT_NEAR(g[1], -1.0 * std::log1p(std::exp(-2.5)), 1e-6);
  EXPECT_NEAR(g[2], -2.0 * 101.0, 1e-4);
  EXPECT_NEAR(beta[0], 0.5, 1e-7);
  EXPECT_NEAR(beta[3], 1.0, 1e-7);
  // Backward against central differences of sum(wg * g + wb * beta) in double.
  const std::vector<double> wg = {0.3, -1.1, 0.7, 2.0}, wb = {1.5, -0.4, 0.9, 0.2};
  Tensor d_alog = Tensor::zeros({2}, DType::f32, Device::cpu(), MemCategory::other);
  Tensor d_dt = Tensor::zeros({2}, DType::f32, Device::cpu(), MemCategory::other);
  auto [d_a, d_b] = gdn_gates_backward(Tensor::from_floats(test::cast<float>(wg), {2, 2}),
                                       Tensor::from_floats(test::cast<float>(wb), {2, 2}), a, gt.g,
                                       gt.beta, a_log, dt, d_alog, d_dt);
  auto objective = [&](const std::vector<double>& av, const std::vector<double>& bv,
                       const std::vector<double>& al, const std::vector<double>& d) {
    double s = 0;
    for (int i = 0; i < 4; ++i) {
      const double x = av[i] + d[i % 2];
      const double sp = x > 20 ? x : std::log1p(std::exp(x));
      s += wg[i] * (-std::exp(al[i % 2]) * sp) + wb[i] * (1 / (1 + std::exp(-bv[i])));
    }
    return s;
  };
  const std::vector<double> av = test::cast<double>(a.to_floats()),
                            bv = test::cast<double>(b.to_floats()),
                            al = test::cast<double>(a_log.to_floats()),
                            dv = test::cast<double>(dt.to_floats());
  const auto fa =
      test::finite_diff([&](const std::vector<double>& x) { return objective(x, bv, al, dv); }, av);
  const auto fb =
      test::finite_diff([&](const std::vector<double>& x) { return objective(av, x, al, dv); }, bv);
  const auto fl =
      test::finite_diff([&](const std::vector<double>& x) { return objective(av, bv, x, dv); }, al);
  const auto fd =
      test::finite_diff([&](const std::vector<double>& x) { return objective(av, bv, al, x); }, dv);
  EXPECT_LT(test::rel_error(d_a.to_floats(), fa), 1e-5);
  EXPECT_LT(test::rel_error(d_b.to_floats(), fb), 1e-5);
  EXPECT_LT(test::rel_error(d_alog.to_floats(), fl), 1e-5);
  EXPECT_LT(test::rel_error(d_dt.to_floats(), fd), 1e-5);
}

void check_model_gradients(const std::string& loss, uint64_t seed) {
  ModelOptions o = test::model_options({{"loss", loss}});
  o.prims.loss_chunks = {5, 8, 5};
  o.aux_loss_coef = 0.3;
  o.z_loss_coef = 0.05;
  // The gated output norm y = o / sqrt(mean(o^2) + eps) turns sharply where an output row is
  // near zero (q . k ~ 0 after a strong decay; with eps 1e-6 at |o| ~ 1e-3, which some of the
  // 60 rows reach): a central difference of step 1e-3 cannot follow that. eps 1e-2 keeps the
  // same math smooth at that scale (the block test checks eps 1e-6).
  ModelConfig c = tiny_qwen35();
  c.rms_norm_eps = 1e-2;
  test::ModelRun run(c, o, seed);
  const MicroBatch mb = tiny_batch(3);
  EXPECT_GT(test::check_directional_gradients(run, mb, o), 30);
  EXPECT_EQ(run.last_routing().size(), 2u);
}

TEST(Qwen35ModelGrad, LinearCeMatchesFiniteDifferences) {
  check_model_gradients("linear_ce", 9);
}
TEST(Qwen35ModelGrad, FullCeMatchesFiniteDifferences) {
  check_model_gradients("full_ce", 9);
}

struct RunResult {
  ForwardStats stats;
  std::vector<std::vector<float>> grads;
  int64_t act_peak = 0;
};

RunResult run_once(const ModelOptions& o, bool delay_wgrad = false, int64_t layers = 4) {
  test::ModelRun run(tiny_qwen35(layers), o, 11, delay_wgrad);
  MicroBatch mb = tiny_batch(5);
  run.model.zero_grad();
  Allocator& a = allocator_for(Device::cpu());
  a.reset_peak();
  const int64_t base = a.stats().live_of(MemCategory::activations);
  RunResult r;
  r.stats = run.forward_backward(mb, 1.0f / static_cast<float>(mb.num_valid), 1.0);
  r.act_peak = a.stats().peak_of(MemCategory::activations) - base;
  EXPECT_EQ(a.stats().live_of(MemCategory::activations), base)
      << "activations leaked past backward";
  for (Param* p : run.model.params()) r.grads.push_back(p->grad.to_floats());
  return r;
}

void expect_identical(const RunResult& a, const RunResult& b, const char* what) {
  EXPECT_EQ(a.stats.loss_sum, b.stats.loss_sum) << what;
  EXPECT_EQ(a.stats.aux_loss, b.stats.aux_loss) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_EQ(a.grads[i], b.grads[i]) << what << " param " << i;
}

TEST(Qwen35Recompute, FullGivesIdenticalLossesAndGradients) {
  ModelOptions none = test::model_options(), full = test::model_options({{"recompute", "full"}});
  none.aux_loss_coef = full.aux_loss_coef = 0.01;
  const RunResult a = run_once(none), b = run_once(full);
  expect_identical(a, b, "recompute full vs none");
  EXPECT_LT(b.act_peak, a.act_peak) << "full recompute should lower the activations peak";
  double gsq = 0;
  for (const auto& g : a.grads)
    for (float x : g) gsq += double(x) * x;
  EXPECT_GT(gsq, 0.0);
}

// Selective recompute on the hybrid model (8 layers: GDN, GDN, GDN, gated attention, twice; MoE
// with a shared expert everywhere): each part alone and the default set are bit-identical to
// none and lower the activations peak; full <= selective. Two attention layers, because the
// peak falls in the last layer's backward, where that layer's dropped parts are rebuilt.
TEST(Qwen35Recompute, SelectivePartsGiveIdenticalLossesAndGradientsAndALowerPeak) {
  constexpr int64_t kLayers = 8;
  ModelOptions none = test::model_options(), full = test::model_options({{"recompute", "full"}});
  none.aux_loss_coef = full.aux_loss_coef = 0.01;
  const RunResult a = run_once(none, false, kLayers), f = run_once(full, false, kLayers);
  for (const char* choice :
       {"selective:norms", "selective:attention", "selective:core_attention", "selective:gdn",
        "selective:shared_expert", "selective:moe_experts", "selective",
        "selective:gdn,norms,attention,core_attention,shared_expert,moe_experts"}) {
    SCOPED_TRACE(choice);
    ModelOptions o = test::model_options({{"recompute", choice}});
    o.aux_loss_coef = 0.01;
    const RunResult b = run_once(o, false, kLayers);
    expect_identical(a, b, choice);
    EXPECT_LT(b.act_peak, a.act_peak) << "dropping a part should lower the activations peak";
    EXPECT_LE(f.act_peak, b.act_peak) << "full recompute keeps the least";
    std::printf("qwen3.5 activations peak: none %lld B, %s %lld B, full %lld B\n",
                static_cast<long long>(a.act_peak), choice, static_cast<long long>(b.act_peak),
                static_cast<long long>(f.act_peak));
  }
  // With delayed wgrad the queued GEMMs read the rebuilt tensors.
  ModelOptions o =
      test::model_options({{"recompute", "selective:gdn,norms,attention,shared_expert"}});
  o.aux_loss_coef = 0.01;
  expect_identical(run_once(none, true, kLayers), run_once(o, true, kLayers),
                   "selective with delayed wgrad");
}

TEST(Qwen35Schedule, DelayedWeightGradientsAreBitIdentical) {
  ModelOptions o = test::model_options();
  o.aux_loss_coef = 0.01;
  expect_identical(run_once(o, false), run_once(o, true), "delayed wgrad");
}

TEST(Qwen35PrimitiveSwap, ExpertsPermuteAndLossChoicesAgree) {
  const RunResult base = run_once(test::model_options());
  for (const auto& [key, name] : std::vector<std::pair<std::string, std::string>>{
           {"experts", "grouped"}, {"permute", "memory_efficient"}, {"loss", "linear_ce"}}) {
    SCOPED_TRACE(key + " = " + name);
    const RunResult r = run_once(test::model_options({{key, name}}));
    EXPECT_NEAR(r.stats.loss_sum, base.stats.loss_sum, 1e-5 * std::fabs(base.stats.loss_sum));
    for (size_t i = 0; i < base.grads.size(); ++i) {
      double n = 0;
      for (float x : base.grads[i]) n += double(x) * x;
      if (n > 0) EXPECT_LT(test::rel_error(r.grads[i], base.grads[i]), 1e-4) << "param " << i;
    }
  }
}

// Packing must not let one sequence see another: the conv, the recurrent state and attention
// all restart at a sequence boundary. The logits of a packed batch equal each sequence's alone.
TEST(Qwen35Model, PackedSequencesAreIndependent) {
  test::ModelRun run(tiny_qwen35(4), test::model_options(), 21);
  const auto docs = random_docs({11, 3, 7}, 37, 77);
  Tensor packed;
  const ForwardStats all = run.forward(batch_of(docs), &packed);
  const std::vector<float> lp = packed.to_floats();
  const int64_t V = 37;
  size_t row = 0;
  double loss_sum = 0;
  for (const auto& d : docs) {
    Tensor alone;
    loss_sum += run.forward(batch_of({d}), &alone).loss_sum;
    const std::vector<float> la = alone.to_floats();
    ASSERT_EQ(la.size(), d.size() * V);
    const std::vector<float> part(lp.begin() + static_cast<long>(row * V),
                                  lp.begin() + static_cast<long>((row + d.size()) * V));
    EXPECT_LT(test::rel_error(part, la), 1e-5) << "sequence starting at token " << row;
    row += d.size();
  }
  EXPECT_NEAR(all.loss_sum, loss_sum, 1e-5 * std::fabs(loss_sum));
  // And it would notice a leak: a changed first sequence changes nothing in the second.
  auto docs2 = docs;
  docs2[0][10] = (docs2[0][10] + 1) % 37;
  Tensor packed2;
  run.forward(batch_of(docs2), &packed2);
  const std::vector<float> lp2 = packed2.to_floats();
  EXPECT_NE(std::vector<float>(lp2.begin() + 10 * V, lp2.begin() + 11 * V),
            std::vector<float>(lp.begin() + 10 * V, lp.begin() + 11 * V));
  EXPECT_EQ(std::vector<float>(lp2.begin() + 11 * V, lp2.end()),
            std::vector<float>(lp.begin() + 11 * V, lp.end()));
}

TEST(Qwen35Model, ParameterNamesUnitsAndInitialisationAreTransformers) {
  const ModelConfig c = tiny_qwen35();
  DecoderModel m(c, ModelOptions{}, 3);
  EXPECT_EQ(m.num_params(), c.num_params());
  std::map<std::string, Shape> hf;
  for (const HfTensor& t : m.hf_tensors()) hf[t.name] = t.shape;
  const std::string l0 = "model.layers.0.", l1 = "model.layers.1.";
  const int64_t C = 2 * 2 * 8 + 4 * 6;
  const std::map<std::string, Shape> want = {
      {"model.embed_tokens.weight", {37, 16}},
      {l0 + "input_layernorm.weight", {16}},
      {l0 + "linear_attn.in_proj_qkv.weight", {C, 16}},
      {l0 + "linear_attn.in_proj_z.weight", {24, 16}},
      {l0 + "linear_attn.in_proj_b.weight", {4, 16}},
      {l0 + "linear_attn.in_proj_a.weight", {4, 16}},
      {l0 + "linear_attn.conv1d.weight", {C, 1, 4}},
      {l0 + "linear_attn.norm.weight", {6}},
      {l0 + "linear_attn.out_proj.weight", {16, 24}},
      {l0 + "linear_attn.dt_bias", {4}},
      {l0 + "linear_attn.A_log", {4}},
      {l1 + "input_layernorm.weight", {16}},
      {l1 + "self_attn.q_proj.weight", {4 * 8 * 2, 16}},
      {l1 + "self_attn.k_proj.weight", {16, 16}},
      {l1 + "self_attn.v_proj.weight", {16, 16}},
      {l1 + "self_attn.o_proj.weight", {16, 32}},
      {l1 + "self_attn.q_norm.weight", {8}},
      {l1 + "self_attn.k_norm.weight", {8}},
      {"model.norm.weight", {16}},
      {"lm_head.weight", {37, 16}},
  };
  for (const std::string& l : {l0, l1}) {
    EXPECT_EQ(hf.at(l + "post_attention_layernorm.weight"), (Shape{16}));
    EXPECT_EQ(hf.at(l + "mlp.gate.weight"), (Shape{4, 16}));
    EXPECT_EQ(hf.at(l + "mlp.experts.gate_up_proj"),
              (Shape{4, 24, 16}));  // fused: the native layout
    EXPECT_EQ(hf.at(l + "mlp.experts.down_proj"), (Shape{4, 16, 12}));
    EXPECT_EQ(hf.at(l + "mlp.shared_expert.gate_proj.weight"), (Shape{10, 16}));
    EXPECT_EQ(hf.at(l + "mlp.shared_expert.up_proj.weight"), (Shape{10, 16}));
    EXPECT_EQ(hf.at(l + "mlp.shared_expert.down_proj.weight"), (Shape{16, 10}));
    EXPECT_EQ(hf.at(l + "mlp.shared_expert_gate.weight"), (Shape{1, 16}));
    EXPECT_FALSE(hf.count(l + "mlp.experts.0.gate_proj.weight"));
  }
  for (const auto& [name, shape] : want) EXPECT_EQ(hf.at(name), shape) << name;
  EXPECT_EQ(hf.size(), want.size() + 2 * 8);
  // Initialisation (transformers' _init_weights): zero-centred norms 0, the gated norm and
  // dt_bias 1, A_log = log(U(0.01, 16)), matrices N(0, init_std).
  auto values = [&](const std::string& n) { return m.find_param(n)->value.to_floats(); };
  for (const std::string& n :
       {l0 + "input_layernorm.weight", l1 + "post_attention_layernorm.weight",
        l1 + "self_attn.q_norm.weight", std::string("model.norm.weight")})
    for (float x : values(n)) ASSERT_EQ(x, 0.0f) << n;
  for (float x : values(l0 + "linear_attn.norm.weight")) ASSERT_EQ(x, 1.0f);
  for (float x : values(l0 + "linear_attn.dt_bias")) ASSERT_EQ(x, 1.0f);
  for (float x : values(l0 + "linear_attn.A_log")) {
    EXPECT_GE(x, std::log(0.01f) - 1e-6f);
    EXPECT_LE(x, std::log(16.0f) + 1e-6f);
  }
  const std::vector<float> conv = values(l0 + "linear_attn.conv1d.weight");
  double sq = 0;
  for (float x : conv) sq += double(x) * x;
  EXPECT_NEAR(std::sqrt(sq / conv.size()), 0.3, 0.06);
  // Units: the GDN layer has a third unit for the f32 vectors.
  std::vector<std::string> names;
  for (ParamUnit* u : m.units()) names.push_back(u->name);
  EXPECT_EQ(names, (std::vector<std::string>{"embed", "layers.0.dense", "layers.0.dense_f32",
                                             "layers.0.experts", "layers.1.dense",
                                             "layers.1.experts", "head"}));
}

// On bf16 weights (the GPU configuration) A_log and dt_bias stay f32, and the model runs with
// the conversions the f32-only primitives need.
TEST(Qwen35Model, Bf16WeightsKeepTheGdnVectorsInF32) {
  ModelOptions o = test::model_options();
  o.param_dtype = DType::bf16;
  test::ModelRun run(tiny_qwen35(4), o, 11);
  for (ParamUnit* u : run.model.units())
    EXPECT_EQ(u->value.dtype(),
              u->name.find("dense_f32") != std::string::npos ? DType::f32 : DType::bf16)
        << u->name;
  EXPECT_EQ(run.model.find_param("model.layers.0.linear_attn.A_log")->value.dtype(), DType::f32);
  EXPECT_EQ(run.model.find_param("model.layers.0.linear_attn.in_proj_qkv.weight")->value.dtype(),
            DType::bf16);
  MicroBatch mb = tiny_batch(5);
  const ForwardStats s = run.forward_backward(mb, 1.0f / static_cast<float>(mb.num_valid), 1.0);
  // Same initial values (rounded to bf16) in f32: the losses agree to bf16 precision.
  test::ModelRun ref(tiny_qwen35(4), test::model_options(), 11);
  for (Param* p : ref.model.params()) {
    std::vector<float> v = run.model.find_param(p->name)->value.to_floats();
    p->value.copy_from(Tensor::from_floats(v, p->shape));
  }
  const ForwardStats r = ref.forward(mb, nullptr);
  EXPECT_TRUE(std::isfinite(s.loss_sum));
  EXPECT_NEAR(s.loss_sum, r.loss_sum, 2e-2 * std::fabs(r.loss_sum));
  const std::vector<float> g =
      run.model.find_param("model.layers.0.linear_attn.A_log")->grad.to_floats();
  double gn = 0;
  for (float x : g) gn += double(x) * x;
  EXPECT_GT(gn, 0.0) << "A_log receives a gradient";
}

// The shipped one-GPU recipe names the 4-layer slice and the fast primitive choices.
TEST(Qwen35Recipe, GpuRecipeParses) {
  namespace fs = std::filesystem;
  const fs::path root = fs::path(__FILE__).parent_path().parent_path().parent_path();
  const std::string model =
      (root / "configs" / "models" / "qwen3.5-35b-a3b-4layer" / "config.json").string();
  const RunConfig rc =
      load_run_config((root / "configs" / "qwen3.5-35b-a3b-4layer-gpu.toml").string(),
                      {"model.config=\"" + model + "\""});
  EXPECT_EQ(rc.model, load_hf_config(model));
  EXPECT_EQ(rc.model.num_linear_attention_layers(), 3);
  EXPECT_EQ(rc.prim.recompute.name, "full");
  EXPECT_EQ(rc.prim.loss.name, "linear_ce");
}

}  // namespace
}  // namespace bb
