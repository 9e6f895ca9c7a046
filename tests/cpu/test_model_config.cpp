// Model config: HF config.json parsing (qwen3_moe / qwen2_moe / Qwen3.5 text and nested), the
// shipped configs, parameter and FLOP counts against hand formulas and published model-card
// numbers, and every rejection.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "common/testing.h"
#include "models/config.h"

namespace bb {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// configs/models relative to this file, so the test runs from any working directory.
fs::path models_dir() {
  return fs::path(__FILE__).parent_path().parent_path().parent_path() / "configs" / "models";
}

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

// Qwen1.5-MoE-A2.7B's config.json as published (transformers 4.39 era: no head_dim, no
// mlp_only_layers, no qkv_bias key).
json qwen15_moe_a27b() {
  return json::parse(R"({
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192,
    "max_window_layers": 21, "model_type": "qwen2_moe", "num_attention_heads": 16,
    "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "transformers_version": "4.39.0.dev0", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936, "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": false,
    "output_router_logits": false, "router_aux_loss_coef": 0.001})");
}

json qwen3_30b() {
  return read_json(models_dir() / "qwen3-30b-a3b" / "config.json");
}

TEST(ModelConfig, ParsesQwen3_30B_A3B) {
  ModelConfig c = load_hf_config((models_dir() / "qwen3-30b-a3b").string());  // a directory
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_layers, 48);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 128);  // explicit: 2048 / 32 would be 64
  EXPECT_EQ(c.intermediate_size, 6144);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.top_k, 8);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  EXPECT_EQ(c.init_std, 0.02);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 40960);
  EXPECT_EQ(c.bos_token_id, 151643);
  EXPECT_EQ(c.eos_token_id, 151645);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.num_moe_layers(), 48);
}

TEST(ModelConfig, ParsesQwen3_30B_A3B_4LayerSlice) {
  ModelConfig full = load_hf_config((models_dir() / "qwen3-30b-a3b" / "config.json").string());
  ModelConfig slice = load_hf_config((models_dir() / "qwen3-30b-a3b-4layer").string());
  EXPECT_EQ(slice.num_layers, 4);
  ModelConfig expect = full;
  expect.num_layers = 4;
  EXPECT_EQ(slice, expect) << "the slice must differ from the full model only in depth";
  // Every layer is identical, so the counts differ by exactly 44 layers.
  const int64_t per_layer = (full.num_params() - slice.num_params()) / 44;
  EXPECT_EQ(full.num_params() - slice.num_params(), 44 * per_layer);
  EXPECT_EQ(slice.num_params(), 4 * per_layer + 2048 + 2 * 151936LL * 2048);
}

TEST(ModelConfig, ParsesDemoTiny) {
  ModelConfig c = load_hf_config((models_dir() / "demo-tiny").string());
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.vocab_size, 264);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_GE(c.num_layers, 2);
  EXPECT_LE(c.num_layers, 4);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.top_k, 2);
  EXPECT_EQ(c.moe_intermediate_size, 128);
  EXPECT_EQ(c.intermediate_size, 256);
  EXPECT_EQ(c.mlp_only_layers, (std::vector<int64_t>{0}));
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.router_aux_loss_coef, 0.01);
  // Byte tokenizer (runtime/tokenizer.h): no BOS, EOS right after the 256 byte values.
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_EQ(c.eos_token_id, 256);
  EXPECT_FALSE(c.is_moe_layer(0));
  for (int64_t l = 1; l < c.num_layers; ++l) EXPECT_TRUE(c.is_moe_layer(l)) << "layer " << l;
}

TEST(ModelConfig, Qwen3_30B_ParamCountsMatchHandFormulaAndModelCard) {
  ModelConfig c = parse_hf_config(qwen3_30b(), "qwen3-30b-a3b");
  const int64_t H = 2048, nh = 32, kv = 4, D = 128, L = 48, E = 128, K = 8, Fm = 768, V = 151936;
  const int64_t attn = H * nh * D + H * kv * D * 2 + nh * D * H;  // q, k, v, o
  const int64_t per_layer =
      attn + 2 * D /*q,k norm*/ + E * 3 * H * Fm + E * H /*router*/ + 2 * H /*two norms*/;
  const int64_t total = L * per_layer + H /*final norm*/ + 2 * V * H /*embedding + head*/;
  EXPECT_EQ(c.num_params(), total);
  EXPECT_EQ(c.num_params(), 30532122624LL);
  EXPECT_EQ(c.num_expert_params(), L * E * 3 * H * Fm);
  const int64_t active = L * (attn + K * 3 * H * Fm + E * H) + V * H;
  EXPECT_EQ(c.active_matmul_params_per_token(), active);
  EXPECT_EQ(c.num_active_params(), active + V * H);
  // Model card: 30.5B total, 3.3B activated.
  EXPECT_NEAR(static_cast<double>(c.num_params()) / 30.5e9, 1.0, 0.02);
  EXPECT_NEAR(static_cast<double>(c.num_active_params()) / 3.3e9, 1.0, 0.02);
}

TEST(ModelConfig, DemoTinyParamCountsWithDenseLayer) {
  ModelConfig c = load_hf_config((models_dir() / "demo-tiny").string());
  ASSERT_EQ(c.num_layers, 4);
  // attention 2*128*128 + 2*128*64 = 49152; dense MLP 3*128*256 = 98304;
  // MoE active 2*3*128*128 + 8*128 = 99328; LM head 264*128 = 33792.
  EXPECT_EQ(c.active_matmul_params_per_token(), 4 * 49152 + 98304 + 3 * 99328 + 33792);
  EXPECT_EQ(c.num_expert_params(), 3 * 8 * 3 * 128 * 128);
  const int64_t norms = 4 * (2 * 128 + 2 * 32) + 128;
  const int64_t total =
      4 * 49152 + 98304 + 3 * (8 * 3 * 128 * 128 + 8 * 128) + 2 * 264 * 128 + norms;
  EXPECT_EQ(c.num_params(), total);
  // Tying removes one V*H from the total but not from the per-token matmuls.
  ModelConfig tied = c;
  tied.tie_word_embeddings = true;
  EXPECT_EQ(tied.num_params(), total - 264 * 128);
  EXPECT_EQ(tied.active_matmul_params_per_token(), c.active_matmul_params_per_token());
}

TEST(ModelConfig, Qwen2MoeDefaultsAndCounts) {
  ModelConfig c = parse_hf_config(qwen15_moe_a27b(), "qwen1.5-moe");
  EXPECT_EQ(c.model_type, "qwen2_moe");
  EXPECT_EQ(c.head_dim, 2048 / 16);  // absent: hidden / heads
  EXPECT_TRUE(c.qkv_bias);           // qwen2_moe default
  EXPECT_FALSE(c.qk_norm);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.shared_expert_intermediate_size, 5632);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  const int64_t H = 2048, nh = 16, kv = 16, D = 128, L = 24, E = 60, K = 4, Fm = 1408, S = 5632,
                V = 151936;
  const int64_t attn = 2 * H * nh * D + 2 * H * kv * D;
  const int64_t shared = 3 * H * S + H;  // + sigmoid gate hidden -> 1
  const int64_t per_layer =
      attn + (nh + 2 * kv) * D /*q,k,v bias*/ + E * 3 * H * Fm + E * H + shared + 2 * H;
  EXPECT_EQ(c.num_params(), L * per_layer + H + 2 * V * H);
  EXPECT_EQ(c.active_matmul_params_per_token(),
            L * (attn + K * 3 * H * Fm + E * H + shared) + V * H);
  // Model card: 14.3B total, 2.7B activated.
  EXPECT_NEAR(static_cast<double>(c.num_params()) / 14.3e9, 1.0, 0.02);
  EXPECT_NEAR(static_cast<double>(c.num_active_params()) / 2.7e9, 1.0, 0.02);
  json j = qwen15_moe_a27b();
  j["qkv_bias"] = false;
  EXPECT_FALSE(parse_hf_config(j, "x").qkv_bias);
}

TEST(ModelConfig, IsMoeLayerRule) {
  ModelConfig c = parse_hf_config(qwen3_30b(), "q");
  c.num_layers = 6;
  c.decoder_sparse_step = 2;  // (l + 1) % 2 == 0: layers 1, 3, 5
  c.mlp_only_layers = {3};
  std::vector<bool> got;
  for (int64_t l = 0; l < 6; ++l) got.push_back(c.is_moe_layer(l));
  EXPECT_EQ(got, (std::vector<bool>{false, true, false, false, false, true}));
  EXPECT_EQ(c.num_moe_layers(), 2);
  c.decoder_sparse_step = 3;  // layers 2, 5
  c.mlp_only_layers = {};
  EXPECT_TRUE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(5));
  EXPECT_EQ(c.num_moe_layers(), 2);
  c.num_experts = 0;  // no experts: all dense
  EXPECT_EQ(c.num_moe_layers(), 0);
  EXPECT_NO_THROW(c.validate());
  test::expect_error_contains([&] { c.is_moe_layer(6); }, "layer 6 out of range [0, 6)");
  // Dense layers count intermediate_size, MoE layers experts: one step changes the total by
  // exactly the difference of the two MLPs.
  ModelConfig a = parse_hf_config(qwen3_30b(), "q");
  ModelConfig b = a;
  b.mlp_only_layers = {0};
  EXPECT_EQ(a.num_params() - b.num_params(),
            128LL * 3 * 2048 * 768 + 128 * 2048 - 3LL * 2048 * 6144);
}

TEST(ModelConfig, ModelFlopsHandComputation) {
  ModelConfig c = load_hf_config((models_dir() / "demo-tiny").string());
  const double active = 626688;  // DemoTinyParamCountsWithDenseLayer
  ASSERT_EQ(c.active_matmul_params_per_token(), 626688);
  // Two packed sequences: 100 + 28 tokens. Attention: 4 layers * 2*2 * (100^2/2 + 28^2/2) *
  // 4 heads * 32 = 4 * 4 * 5392 * 128.
  const double forward = 2 * active * 128 + 4.0 * 4 * 5392 * 128;
  EXPECT_DOUBLE_EQ(model_flops(c, {100, 28}), 3 * forward);
  // Packing changes only the attention term: one 128-token sequence has more pairs.
  const double one_seq = 3 * (2 * active * 128 + 4.0 * 4 * (128.0 * 128 / 2) * 128);
  EXPECT_DOUBLE_EQ(model_flops(c, {128}), one_seq);
  EXPECT_EQ(model_flops(c, {}), 0.0);
  test::expect_error_contains([&] { model_flops(c, {5, -1}); }, "sequence length must be >= 0");
  // Qwen3-30B-A3B at 32K tokens: 6 * 3.04e9 * 32768 matmul + attention.
  ModelConfig q = parse_hf_config(qwen3_30b(), "q");
  const double s = 32768;
  const double want = 3 * (2.0 * 3041656832.0 * s + 48 * 4 * (s * s / 2) * 32 * 128);
  EXPECT_NEAR(model_flops(q, {32768}) / want, 1.0, 1e-12);
}

TEST(ModelConfig, RoundTripThroughHfJson) {
  std::vector<ModelConfig> cases = {
      parse_hf_config(qwen3_30b(), "q3"),
      load_hf_config((models_dir() / "demo-tiny").string()),
      parse_hf_config(qwen15_moe_a27b(), "q2"),
  };
  ModelConfig odd = cases[1];  // non-default values for every optional key
  odd.decoder_sparse_step = 2;
  odd.mlp_only_layers = {0, 2};
  odd.norm_topk_prob = false;
  odd.tie_word_embeddings = true;
  odd.bos_token_id = -1;
  odd.init_std = 0.006;
  odd.rms_norm_eps = 1e-5;
  cases.push_back(odd);
  for (const ModelConfig& c : cases) {
    json j = c.to_hf_json();
    EXPECT_EQ(j.at("torch_dtype"), "bfloat16");
    EXPECT_TRUE(j.at("architectures").is_array());
    ModelConfig back = parse_hf_config(j, "round trip");
    EXPECT_EQ(back, c) << j.dump(2);
  }
  EXPECT_EQ(cases[0].to_hf_json().at("architectures")[0], "Qwen3MoeForCausalLM");
  EXPECT_EQ(cases[2].to_hf_json().at("architectures")[0], "Qwen2MoeForCausalLM");
  EXPECT_EQ(odd.to_hf_json().at("bos_token_id"), nullptr);
  // Through a file and a directory too.
  fs::path dir = fs::temp_directory_path() / "bb_test_model_config";
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << cases[2].to_hf_json().dump(2);
  EXPECT_EQ(load_hf_config(dir.string()), cases[2]);
  fs::remove_all(dir);
}

TEST(ModelConfig, AcceptsTransformers5RopeParametersAndEosList) {
  json j = qwen3_30b();
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e6}};
  j["eos_token_id"] = {151645, 151643};
  j["dtype"] = "bfloat16";
  ModelConfig c = parse_hf_config(j, "v5");
  EXPECT_EQ(c.rope_theta, 5e6);
  EXPECT_EQ(c.eos_token_id, 151645);
  j["rope_theta"] = 1e6;
  test::expect_error_contains([&] { parse_hf_config(j, "v5.json"); },
                              "key 'rope_parameters.rope_theta' (5e+06) in v5.json disagrees");
  // Absent behaviour keys take the transformers defaults.
  json m = qwen3_30b();
  for (const char* k : {"norm_topk_prob", "rope_theta", "router_aux_loss_coef", "head_dim",
                        "max_position_embeddings", "mlp_only_layers", "decoder_sparse_step"})
    m.erase(k);
  ModelConfig d = parse_hf_config(m, "min");
  EXPECT_FALSE(d.norm_topk_prob);
  EXPECT_EQ(d.rope_theta, 10000.0);
  EXPECT_EQ(d.router_aux_loss_coef, 0.001);
  EXPECT_EQ(d.head_dim, 64);
  EXPECT_EQ(d.max_position_embeddings, 32768);
  EXPECT_EQ(d.decoder_sparse_step, 1);
}

// Each rejection: mutate a valid config, check the message names the key and the file.
struct BadCase {
  const char* what;
  std::function<void(json&)> mutate;
  const char* needle;
};

TEST(ModelConfig, RejectsBadConfigsWithMessages) {
  const std::vector<BadCase> cases = {
      {"missing key", [](json& j) { j.erase("hidden_size"); },
       "missing required key 'hidden_size' in cfg.json"},
      {"missing model_type", [](json& j) { j.erase("model_type"); },
       "missing required key 'model_type' in cfg.json"},
      {"wrong type int", [](json& j) { j["hidden_size"] = "2048"; },
       "key 'hidden_size' in cfg.json must be an integer, got string \"2048\""},
      {"float for int", [](json& j) { j["num_experts"] = 128.0; },
       "key 'num_experts' in cfg.json must be an integer, got number 128.0"},
      {"wrong type bool", [](json& j) { j["norm_topk_prob"] = 1; },
       "key 'norm_topk_prob' in cfg.json must be a boolean"},
      {"wrong type list",
       [](json& j) {
         j["mlp_only_layers"] = {0, "1"};
       },
       "key 'mlp_only_layers' in cfg.json must be a list of integers"},
      {"unknown key", [](json& j) { j["foo"] = 1; },
       "unknown key 'foo' in cfg.json: bumblebee does not know whether it changes the model"},
      {"qwen2 key in qwen3", [](json& j) { j["shared_expert_intermediate_size"] = 1024; },
       "unknown key 'shared_expert_intermediate_size' in cfg.json"},
      {"model_type", [](json& j) { j["model_type"] = "llama"; },
       "key 'model_type' in cfg.json is 'llama'"},
      {"hidden_act", [](json& j) { j["hidden_act"] = "gelu"; },
       "key 'hidden_act' in cfg.json is 'gelu'"},
      {"rope_scaling",
       [](json& j) {
         j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4}};
       },
       "key 'rope_scaling' in cfg.json has rope_type \"yarn\": only the default RoPE"},
      {"rope_parameters extra",
       [](json& j) {
         j["rope_parameters"] = {{"rope_theta", 1e6}, {"partial_rotary_factor", 0.5}};
       },
       "key 'rope_parameters' in cfg.json has entry 'partial_rotary_factor'"},
      {"sliding window", [](json& j) { j["use_sliding_window"] = true; },
       "key 'use_sliding_window' in cfg.json is true"},
      {"attention bias", [](json& j) { j["attention_bias"] = true; },
       "key 'attention_bias' in cfg.json is true"},
      {"dropout", [](json& j) { j["attention_dropout"] = 0.1; },
       "key 'attention_dropout' in cfg.json is 0.1"},
      {"layer_types",
       [](json& j) {
         j["layer_types"] = json::array();
         for (int i = 0; i < 48; ++i)
           j["layer_types"].push_back(i ? "full_attention" : "sliding_attention");
       },
       "key 'layer_types' in cfg.json contains \"sliding_attention\""},
      {"heads", [](json& j) { j["num_key_value_heads"] = 5; },
       "num_attention_heads (32) must be a multiple of num_key_value_heads (5)"},
      {"top_k", [](json& j) { j["num_experts_per_tok"] = 129; },
       "num_experts_per_tok (129) must be in [1, num_experts = 128]"},
      {"zero size", [](json& j) { j["hidden_size"] = 0; }, "hidden_size must be > 0, got 0"},
      {"mlp_only range", [](json& j) { j["mlp_only_layers"] = {48}; },
       "mlp_only_layers entry 48 is not a layer index in [0, 48)"},
      {"bos", [](json& j) { j["bos_token_id"] = 151936; }, "bos_token_id 151936 >= vocab_size"},
  };
  for (const BadCase& bc : cases) {
    SCOPED_TRACE(bc.what);
    json j = qwen3_30b();
    bc.mutate(j);
    test::expect_error_contains([&] { parse_hf_config(j, "cfg.json"); }, bc.needle);
  }
  // Validation errors from parse name the file too.
  json j = qwen3_30b();
  j["num_key_value_heads"] = 5;
  test::expect_error_contains([&] { parse_hf_config(j, "cfg.json"); },
                              "invalid model config cfg.json");
  // qwen2_moe needs its shared expert size.
  json q2 = qwen15_moe_a27b();
  q2.erase("shared_expert_intermediate_size");
  test::expect_error_contains([&] { parse_hf_config(q2, "q2.json"); },
                              "missing required key 'shared_expert_intermediate_size' in q2.json");
  test::expect_error_contains([&] { parse_hf_config(json::array(), "arr.json"); },
                              "model config arr.json must be a JSON object, got array");
}

TEST(ModelConfig, ValidateRejectsFamilyMismatch) {
  ModelConfig c = parse_hf_config(qwen3_30b(), "q");
  c.shared_expert_intermediate_size = 1024;
  test::expect_error_contains([&] { c.validate(); }, "qwen3_moe has no shared expert");
  test::expect_error_contains([&] { c.to_hf_json(); }, "qwen3_moe has no shared expert");
  c.shared_expert_intermediate_size = 0;
  c.qkv_bias = true;
  test::expect_error_contains([&] { c.validate(); }, "no q/k/v bias");
  ModelConfig d = parse_hf_config(qwen15_moe_a27b(), "q2");
  d.qk_norm = true;
  test::expect_error_contains([&] { d.validate(); }, "qwen2_moe has no q/k RMSNorm");
}

TEST(ModelConfig, LoadErrors) {
  test::expect_error_contains([] { load_hf_config("/nonexistent/dir"); },
                              "model config not found: /nonexistent/dir");
  fs::path dir = fs::temp_directory_path() / "bb_test_model_config_bad";
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << "{ \"model_type\": ";
  test::expect_error_contains([&] { load_hf_config(dir.string()); }, "cannot parse model config");
  std::ofstream(dir / "config.json") << R"({"model_type": "qwen3_moe", "foo": 1})";
  test::expect_error_contains([&] { load_hf_config(dir.string()); },
                              "unknown key 'foo' in " + (dir / "config.json").string());
  fs::remove_all(dir);
}


// ---------------------------------------------------------------------------------------------
// Qwen3.5 (qwen3_5_moe_text, and qwen3_5_moe with a nested text_config)

json qwen35_35b() { return read_json(models_dir() / "qwen3.5-35b-a3b" / "config.json"); }

// The text part of the shipped (released, nested) config as a standalone text config.
json qwen35_text() {
  json t = qwen35_35b().at("text_config");
  t["architectures"] = {"Qwen3_5MoeForCausalLM"};
  return t;
}

TEST(Qwen35Config, ParsesTheReleasedNestedConfig) {
  ModelConfig c = load_hf_config((models_dir() / "qwen3.5-35b-a3b").string());
  EXPECT_EQ(c.model_type, "qwen3_5_moe_text");
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_layers, 40);
  EXPECT_EQ(c.num_heads, 16);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.intermediate_size, 0);  // no dense MLP
  EXPECT_EQ(c.moe_intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.top_k, 8);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_TRUE(c.qk_norm && c.zero_centered_norm && c.attn_output_gate);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_EQ(c.linear_key_head_dim, 128);
  EXPECT_EQ(c.linear_value_head_dim, 128);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_EQ(c.eos_token_id, 248044);
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_EQ(c.num_moe_layers(), 40);
  EXPECT_EQ(c.num_linear_attention_layers(), 30);
  for (int64_t l = 0; l < 40; ++l)
    EXPECT_EQ(c.layer_type(l), l % 4 == 3 ? LayerType::full_attention : LayerType::linear_attention)
        << "layer " << l;
  // The text model alone parses to the same config.
  EXPECT_EQ(parse_hf_config(qwen35_text(), "text.json"), c);
}

TEST(Qwen35Config, FourLayerSliceIsThreeGdnAndOneFullAttentionLayer) {
  ModelConfig full = load_hf_config((models_dir() / "qwen3.5-35b-a3b").string());
  ModelConfig slice = load_hf_config((models_dir() / "qwen3.5-35b-a3b-4layer").string());
  ModelConfig expect = full;
  expect.num_layers = 4;
  expect.layer_types.resize(4);
  EXPECT_EQ(slice, expect) << "the slice must differ from the full model only in depth";
  EXPECT_EQ(slice.layer_types, (std::vector<LayerType>{LayerType::linear_attention, LayerType::linear_attention,
                                                       LayerType::linear_attention, LayerType::full_attention}));
  // 10 repeats of the 4-layer pattern: the counts differ by exactly 9 slices' layers.
  const int64_t ends = 2LL * 248320 * 2048 + 2048;
  EXPECT_EQ(full.num_params() - ends, 10 * (slice.num_params() - ends));
}

TEST(Qwen35Config, ParamCountsMatchHandFormulaAndModelCard) {
  ModelConfig c = parse_hf_config(qwen35_35b(), "qwen3.5");
  const int64_t H = 2048, Hq = 16, Hkv = 2, D = 256, E = 256, K = 8, F = 512, S = 512, V = 248320;
  const int64_t Hk = 16, Hv = 32, Dk = 128, Dv = 128, W = 4, C = 2 * Hk * Dk + Hv * Dv;
  const int64_t attn_mm = H * Hq * D * 2 /*q + gate*/ + 2 * H * Hkv * D + Hq * D * H;
  const int64_t gdn_mm = H * C + H * Hv * Dv + 2 * H * Hv + Hv * Dv * H;
  const int64_t moe = E * 3 * H * F + E * H + 3 * H * S + H;
  const int64_t attn_layer = attn_mm + 2 * D /*q, k norm*/ + moe + 2 * H;
  const int64_t gdn_layer = gdn_mm + C * W + 2 * Hv + Dv + moe + 2 * H;
  EXPECT_EQ(c.num_params(), 10 * attn_layer + 30 * gdn_layer + H + 2 * V * H);
  EXPECT_EQ(c.num_params(), 34660610688LL);
  EXPECT_EQ(c.num_expert_params(), 40 * E * 3 * H * F);
  const int64_t moe_active = K * 3 * H * F + E * H + 3 * H * S + H;
  const int64_t active = 10 * attn_mm + 30 * gdn_mm + 40 * moe_active + V * H;
  EXPECT_EQ(c.active_matmul_params_per_token(), active);
  EXPECT_EQ(c.active_matmul_params_per_token(), 2945269760LL);
  EXPECT_EQ(c.num_active_params(), active + V * H);
  // Model card: 35B in total, 3B activated (the MTP head and the vision tower not counted here).
  std::printf("Qwen3.5-35B-A3B: %.3fB params, %.3fB active matmul, %.3fB with the embedding\n",
              c.num_params() / 1e9, c.active_matmul_params_per_token() / 1e9, c.num_active_params() / 1e9);
  EXPECT_NEAR(static_cast<double>(c.num_params()) / 35e9, 1.0, 0.02);
  EXPECT_NEAR(static_cast<double>(c.active_matmul_params_per_token()) / 3e9, 1.0, 0.02);
}

TEST(Qwen35Config, ModelFlopsCountAttentionOnlyInFullLayersAndTheRecurrence) {
  ModelConfig c = parse_hf_config(qwen35_35b(), "qwen3.5");
  const double active = static_cast<double>(c.active_matmul_params_per_token());
  // 100 + 28 packed tokens: 10 full-attention layers with the causal term, 30 GDN layers with
  // 6 * Dk * Dv FLOPs per token and value head.
  const double pairs = 100.0 * 100 / 2 + 28.0 * 28 / 2;
  const double forward = 2 * active * 128 + 10 * 2 * 2 * pairs * 16 * 256 + 30 * 6.0 * 128 * 128 * 32 * 128;
  EXPECT_DOUBLE_EQ(model_flops(c, {100, 28}), 3 * forward);
  // At 32K the recurrence is linear in the sequence, attention quadratic (only 10 layers).
  const double s = 32768;
  const double want = 3 * (2 * active * s + 10 * 4 * (s * s / 2) * 16 * 256 + 30 * 6.0 * 128 * 128 * 32 * s);
  EXPECT_NEAR(model_flops(c, {32768}) / want, 1.0, 1e-12);
}

TEST(Qwen35Config, RoundTripThroughTextOnlyHfJson) {
  ModelConfig c = parse_hf_config(qwen35_35b(), "q35");
  json j = c.to_hf_json();
  EXPECT_EQ(j.at("architectures")[0], "Qwen3_5MoeForCausalLM");
  EXPECT_EQ(j.at("model_type"), "qwen3_5_moe_text");
  EXPECT_FALSE(j.contains("text_config"));
  EXPECT_EQ(j.at("rope_parameters").at("partial_rotary_factor"), 0.25);
  EXPECT_EQ(j.at("layer_types").size(), 40u);
  EXPECT_EQ(parse_hf_config(j, "round trip"), c) << j.dump(2);
  // Non-default values in every optional field.
  ModelConfig odd = c;
  odd.num_layers = 5;
  odd.layer_types = {LayerType::full_attention, LayerType::linear_attention, LayerType::full_attention,
                     LayerType::linear_attention, LayerType::linear_attention};
  odd.partial_rotary_factor = 0.5;
  odd.rope_theta = 12345;
  odd.tie_word_embeddings = true;
  odd.bos_token_id = 7;
  odd.eos_token_id = -1;
  odd.linear_conv_kernel_dim = 3;
  odd.linear_num_key_heads = 8;
  odd.init_std = 0.006;
  odd.rms_norm_eps = 1e-5;
  odd.max_position_embeddings = 4096;
  EXPECT_EQ(parse_hf_config(odd.to_hf_json(), "odd"), odd) << odd.to_hf_json().dump(2);
  // Through a file.
  fs::path dir = fs::temp_directory_path() / "bb_test_model_config_q35";
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << odd.to_hf_json().dump(2);
  EXPECT_EQ(load_hf_config(dir.string()), odd);
  fs::remove_all(dir);
}

TEST(Qwen35Config, LayerTypesDerivedFromTheIntervalAndDefaults) {
  json t = qwen35_text();
  t.erase("layer_types");  // derived: (i + 1) % 4 != 0 -> linear_attention
  EXPECT_EQ(parse_hf_config(t, "t"), parse_hf_config(qwen35_text(), "t"));
  t["full_attention_interval"] = 2;
  t["num_hidden_layers"] = 4;
  EXPECT_EQ(parse_hf_config(t, "t").layer_types,
            (std::vector<LayerType>{LayerType::linear_attention, LayerType::full_attention,
                                    LayerType::linear_attention, LayerType::full_attention}));
  t.erase("full_attention_interval");  // default 4
  EXPECT_EQ(parse_hf_config(t, "t").num_linear_attention_layers(), 3);
  // Behaviour defaults of Qwen3_5MoeTextConfig: head_dim 256, partial rotary 0.25, theta 1e4.
  json m = qwen35_text();
  for (const char* k : {"head_dim", "rope_parameters", "full_attention_interval", "attn_output_gate",
                        "mlp_only_layers", "eos_token_id", "max_position_embeddings"})
    m.erase(k);
  ModelConfig d = parse_hf_config(m, "min");
  EXPECT_EQ(d.head_dim, 256);
  EXPECT_EQ(d.partial_rotary_factor, 0.25);
  EXPECT_EQ(d.rope_theta, 10000.0);
  EXPECT_EQ(d.eos_token_id, -1);
  EXPECT_EQ(d.max_position_embeddings, 32768);
  // A top-level partial_rotary_factor / rope_theta (older spelling) is read too.
  json o = qwen35_text();
  o.erase("rope_parameters");
  o["partial_rotary_factor"] = 0.5;
  o["rope_theta"] = 1e6;
  ModelConfig e = parse_hf_config(o, "old");
  EXPECT_EQ(e.partial_rotary_factor, 0.5);
  EXPECT_EQ(e.rope_theta, 1e6);
  EXPECT_TRUE(e.load_notes.empty());
  // transformers 5.17 writes both spellings for a non-default factor: the top level keeps the
  // class default 0.25, rope_parameters the value its rotary embedding reads. That one is taken,
  // with a note; equal values need none.
  json both = qwen35_text();
  both["partial_rotary_factor"] = 0.25;
  both["rope_parameters"]["partial_rotary_factor"] = 0.5;
  ModelConfig f = parse_hf_config(both, "both");
  EXPECT_EQ(f.partial_rotary_factor, 0.5);
  ASSERT_EQ(f.load_notes.size(), 1u);
  EXPECT_NE(f.load_notes[0].find("partial_rotary_factor 0.5 from rope_parameters (the value transformers uses); the "
                                 "top-level partial_rotary_factor 0.25 is ignored"), std::string::npos) << f.load_notes[0];
  both["partial_rotary_factor"] = 0.5;
  EXPECT_TRUE(parse_hf_config(both, "same").load_notes.empty());
  // The outer tie_word_embeddings is the one transformers ties by.
  json n = qwen35_35b();
  n["tie_word_embeddings"] = true;
  EXPECT_TRUE(parse_hf_config(n, "n").tie_word_embeddings);
}

TEST(Qwen35Config, RejectsBadConfigsWithMessagesNamingTheKey) {
  const std::vector<BadCase> text_cases = {
      {"unknown key", [](json& j) { j["foo"] = 1; },
       "unknown key 'foo' in text_config of cfg.json: bumblebee does not know"},
      {"missing linear key", [](json& j) { j.erase("linear_num_value_heads"); },
       "missing required key 'linear_num_value_heads' in text_config of cfg.json"},
      {"missing shared expert", [](json& j) { j.erase("shared_expert_intermediate_size"); },
       "missing required key 'shared_expert_intermediate_size' in text_config of cfg.json"},
      {"mrope type",
       [](json& j) { j["rope_parameters"]["rope_type"] = "mrope"; },
       "key 'rope_parameters' in text_config of cfg.json has rope_type \"mrope\": only the default RoPE"},
      {"rope scaling entry",
       [](json& j) { j["rope_parameters"]["factor"] = 4; },
       "key 'rope_parameters' in text_config of cfg.json has entry 'factor'"},
      {"mrope_section type",
       [](json& j) { j["rope_parameters"]["mrope_section"] = {11, "11"}; },
       "key 'rope_parameters.mrope_section' in text_config of cfg.json must be a list of non-negative integers"},
      {"rotary dim odd", [](json& j) { j["rope_parameters"]["partial_rotary_factor"] = 0.006; },
       "partial_rotary_factor 0.006 x head_dim 256 gives a rotary dim of 1: it must be even"},
      {"output gate off", [](json& j) { j["attn_output_gate"] = false; },
       "key 'attn_output_gate' in text_config of cfg.json is false"},
      {"norm_topk_prob off", [](json& j) { j["norm_topk_prob"] = false; },
       "key 'norm_topk_prob' in text_config of cfg.json is false"},
      {"dense layer", [](json& j) { j["mlp_only_layers"] = {0}; },
       "key 'mlp_only_layers' in text_config of cfg.json is [0]: every Qwen3.5 layer is MoE"},
      {"sparse step", [](json& j) { j["decoder_sparse_step"] = 2; },
       "key 'decoder_sparse_step' in text_config of cfg.json is 2"},
      {"layer type", [](json& j) { j["layer_types"][3] = "sliding_attention"; },
       "key 'layer_types' in text_config of cfg.json contains \"sliding_attention\""},
      {"layer types vs interval", [](json& j) { j["full_attention_interval"] = 2; },
       "keys 'layer_types' and 'full_attention_interval' (2) in text_config of cfg.json describe different"},
      {"interval", [](json& j) { j.erase("layer_types"); j["full_attention_interval"] = 0; },
       "key 'full_attention_interval' in text_config of cfg.json must be >= 1"},
      {"value heads", [](json& j) { j["linear_num_value_heads"] = 24; j["linear_num_key_heads"] = 16; },
       "linear_num_value_heads (24) must be a multiple of linear_num_key_heads (16)"},
      {"conv kernel", [](json& j) { j["linear_conv_kernel_dim"] = 5; },
       "linear_conv_kernel_dim = 5: the causal_conv1d primitive implements kernel widths 1..4"},
      {"linear zero", [](json& j) { j["linear_key_head_dim"] = 0; },
       "linear_key_head_dim must be > 0 (30 linear_attention layers), got 0"},
      {"hidden_act", [](json& j) { j["hidden_act"] = "gelu"; },
       "key 'hidden_act' in text_config of cfg.json is 'gelu'"},
      {"attention bias", [](json& j) { j["attention_bias"] = true; },
       "key 'attention_bias' in text_config of cfg.json is true"},
      {"qwen3 key", [](json& j) { j["qkv_bias"] = false; }, "unknown key 'qkv_bias' in text_config of cfg.json"},
      {"text model_type", [](json& j) { j["model_type"] = "qwen3_next"; },
       "key 'model_type' in text_config of cfg.json is \"qwen3_next\""},
  };
  for (const BadCase& bc : text_cases) {
    SCOPED_TRACE(bc.what);
    json j = qwen35_35b();
    bc.mutate(j.at("text_config"));
    test::expect_error_contains([&] { parse_hf_config(j, "cfg.json"); }, bc.needle);
  }
  // The same checks on a text-only config name the file alone.
  json t = qwen35_text();
  t["foo"] = 1;
  test::expect_error_contains([&] { parse_hf_config(t, "text.json"); }, "unknown key 'foo' in text.json:");
  // The outer config.
  const std::vector<BadCase> outer_cases = {
      {"unknown outer key", [](json& j) { j["quantization_config"] = json::object(); },
       "unknown key 'quantization_config' in cfg.json"},
      {"missing text_config", [](json& j) { j.erase("text_config"); },
       "missing required key 'text_config' in cfg.json"},
      {"text_config type", [](json& j) { j["text_config"] = 3; },
       "key 'text_config' in cfg.json must be an object"},
      {"tie disagrees",
       [](json& j) {
         j["tie_word_embeddings"] = true;
         j["text_config"]["tie_word_embeddings"] = false;
       },
       "key 'tie_word_embeddings' in cfg.json (true) disagrees with the one in text_config of cfg.json"},
  };
  for (const BadCase& bc : outer_cases) {
    SCOPED_TRACE(bc.what);
    json j = qwen35_35b();
    bc.mutate(j);
    test::expect_error_contains([&] { parse_hf_config(j, "cfg.json"); }, bc.needle);
  }
}

TEST(Qwen35Config, ValidateChecksTheFamily) {
  ModelConfig c = parse_hf_config(qwen35_35b(), "q");
  ModelConfig d = c;
  d.zero_centered_norm = false;
  test::expect_error_contains([&] { d.validate(); }, "qwen3_5_moe_text RMSNorms are zero-centred");
  d = c;
  d.shared_expert_intermediate_size = 0;
  test::expect_error_contains([&] { d.validate(); }, "qwen3_5_moe_text has a shared expert");
  d = c;
  d.intermediate_size = 6144;
  test::expect_error_contains([&] { d.validate(); }, "has no dense MLP: intermediate_size must be 0");
  d = c;
  d.layer_types.pop_back();
  test::expect_error_contains([&] { d.validate(); }, "layer_types has 39 entries");
  // The Qwen3.5 features are refused in the other families.
  ModelConfig q3 = parse_hf_config(qwen3_30b(), "q3");
  q3.partial_rotary_factor = 0.5;
  test::expect_error_contains([&] { q3.validate(); }, "qwen3_moe has none of the Qwen3.5 features");
  q3.partial_rotary_factor = 1.0;
  q3.layer_types.assign(48, LayerType::full_attention);
  EXPECT_NO_THROW(q3.validate());
  q3.layer_types[5] = LayerType::linear_attention;
  test::expect_error_contains([&] { q3.validate(); }, "qwen3_moe has only full_attention layers");
}

}  // namespace
}  // namespace bb
