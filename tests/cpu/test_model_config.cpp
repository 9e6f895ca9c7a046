// Model config: HF config.json parsing (qwen3_moe / qwen2_moe), the shipped configs, parameter
// and FLOP counts against hand formulas and published model-card numbers, and every rejection.
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

}  // namespace
}  // namespace bb
