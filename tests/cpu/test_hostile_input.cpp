// test_hostile_input.cpp — crafted sizes and structures in the files bumblebee reads: each must
// end in a bb::Error that names the problem, never in a wrapped size, a tiny allocation, a
// hang or a crash. The fuzzers (fuzz/, docs/reliability.md) search for more of these; every
// case here is one they or a review found, kept as a regression test.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

#include "common/testing.h"
#include "core/checked.h"
#include "core/tensor.h"
#include "io/fs.h"
#include "io/json_limits.h"
#include "io/safetensors.h"
#include "models/config.h"

namespace bb {
namespace {

namespace stdfs = std::filesystem;
using nlohmann::json;

constexpr int64_t k2to62 = int64_t{1} << 62;

json demo_tiny() {
  return json::parse(R"({
    "model_type": "qwen3_moe", "vocab_size": 264, "hidden_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
    "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
    "mlp_only_layers": [0], "eos_token_id": 256})");
}

// "[[[ ... ]]]" nested `depth` levels.
std::string nested_arrays(int depth) {
  return std::string(depth, '[') + std::string(depth, ']');
}

class HostileInput : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (stdfs::temp_directory_path() / "bb_hostile_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    stdfs::remove_all(dir_, ec);
  }
  std::string write(const std::string& name, const std::string& bytes) {
    const std::string p = path_join(dir_, name);
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(out.good()) << p;
    return p;
  }
  // A safetensors file with `header` as its JSON text and `data` after it.
  std::string safetensors_file(const std::string& name, const std::string& header,
                               const std::string& data = "") {
    std::string len(8, '\0');
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
    return write(name, len + header + data);
  }
  std::string dir_;
};

// ---- shapes -----------------------------------------------------------------------------------

TEST(HostileShapes, ElementCountOverflowThrowsNamingTheShape) {
  // 2^32 * 2^32 wraps to 0 in int64 arithmetic: a "valid" empty tensor before the check.
  test::expect_error_contains(
      [] {
        (void)shape_numel({int64_t{1} << 32, int64_t{1} << 32});
      },
      "shape [4294967296, 4294967296] has more elements");
  test::expect_error_contains([] { (void)shape_numel({3, k2to62}); }, "has more elements");
  // A wrapped count would have allocated 0 bytes and handed out a tensor claiming 2^64 elements.
  test::expect_error_contains(
      [] {
        (void)Tensor::empty({k2to62, 4}, DType::f32, Device::cpu(), MemCategory::other);
      },
      "shape [4611686018427387904, 4] has more elements");
}

TEST(HostileShapes, ByteCountOverflowThrows) {
  // 2^62 elements fit int64; 2^62 * 4 bytes do not (it would wrap to 0 bytes).
  EXPECT_EQ(shape_numel({k2to62}), k2to62);
  test::expect_error_contains([] { (void)shape_nbytes({k2to62}, DType::f32); },
                              "shape [4611686018427387904] of dtype f32 needs more bytes");
  test::expect_error_contains(
      [] {
        (void)Tensor::empty({int64_t{1} << 61, 2}, DType::bf16, Device::cpu(), MemCategory::other);
      },
      "needs more bytes");
}

TEST(HostileShapes, ZeroDimensionMakesAnyShapeEmpty) {
  // Legal and empty however large the other dimensions: the check must not refuse it.
  EXPECT_EQ(shape_numel({k2to62, k2to62, 0}), 0);
  EXPECT_EQ(shape_nbytes({0, k2to62, k2to62}, DType::i64), 0u);
  Tensor t = Tensor::empty({k2to62, 0, k2to62}, DType::f32, Device::cpu(), MemCategory::other);
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.nbytes(), 0u);
  // view() of an overflowing target shape is refused, not wrapped into a match.
  Tensor u = Tensor::zeros({4}, DType::f32, Device::cpu(), MemCategory::other);
  test::expect_error_contains(
      [&] {
        (void)u.view({int64_t{1} << 32, int64_t{1} << 32, -1});
      },
      "has more elements");
}

TEST(HostileShapes, CheckedHelpers) {
  EXPECT_EQ(checked_mul(int64_t{1} << 31, int64_t{1} << 31, "x"), int64_t{1} << 62);
  test::expect_error_contains([] { (void)checked_mul(k2to62, 2, "param count"); },
                              "param count: 4611686018427387904 * 2 overflows");
  test::expect_error_contains(
      [] { (void)checked_add(std::numeric_limits<int64_t>::max(), 1, "total"); }, "total: ");
  test::expect_error_contains(
      [] {
        (void)checked_product({1 << 20, 1 << 20, 1 << 20, 1 << 5}, "p");
      },
      "overflows");
}

// ---- HF config.json ---------------------------------------------------------------------------

TEST(HostileConfig, HugeDimensionIsRejectedNamingTheKeyAndTheLimit) {
  for (const char* key :
       {"hidden_size", "intermediate_size", "moe_intermediate_size", "head_dim"}) {
    json j = demo_tiny();
    j[key] = int64_t{1} << 40;
    test::expect_error_contains(
        [&] { parse_hf_config(j, "cfg.json"); },
        std::string(key) + " = 1099511627776 exceeds bumblebee's limit of 1048576");
  }
  json j = demo_tiny();
  j["vocab_size"] = int64_t{1} << 30;
  test::expect_error_contains([&] { parse_hf_config(j, "cfg.json"); },
                              "vocab_size = 1073741824 exceeds");
  j = demo_tiny();
  j["num_experts"] = 100000;
  test::expect_error_contains([&] { parse_hf_config(j, "cfg.json"); },
                              "num_experts = 100000 exceeds");
  j = demo_tiny();
  j["num_attention_heads"] = 8192;
  j["num_key_value_heads"] = 8192;
  test::expect_error_contains([&] { parse_hf_config(j, "cfg.json"); },
                              "num_attention_heads = 8192 exceeds");
}

TEST(HostileConfig, HugeLayerCountFailsFastInsteadOfLooping) {
  // Before the bound, validate() walked every layer index: 2^62 of them.
  json j = demo_tiny();
  j["num_hidden_layers"] = k2to62;
  test::expect_error_contains(
      [&] { parse_hf_config(j, "cfg.json"); },
      "num_hidden_layers = 4611686018427387904 exceeds bumblebee's limit of 1024");
}

TEST(HostileConfig, IntegersPastInt64AreRefusedNotWrapped) {
  // nlohmann keeps 2^64 - 1 as an unsigned integer; read as int64 it was -1.
  json j = demo_tiny();
  j["vocab_size"] = std::numeric_limits<uint64_t>::max();
  test::expect_error_contains([&] { parse_hf_config(j, "cfg.json"); },
                              "key 'vocab_size' in cfg.json is 18446744073709551615: out of range");
  j = demo_tiny();
  j["mlp_only_layers"] = json::array({std::numeric_limits<uint64_t>::max()});
  test::expect_error_contains([&] { parse_hf_config(j, "cfg.json"); }, "out of range");
}

TEST(HostileConfig, ParameterCountOverflowIsAnErrorNotGarbage) {
  // Every dimension within its bound, the product of all of them past int64: 1024 layers x
  // 4096 experts x 3 x 2^20 x 2^20 = 3 x 2^62.
  ModelConfig c = parse_hf_config(demo_tiny(), "cfg.json");
  c.num_layers = 1024;
  c.mlp_only_layers.clear();
  c.num_experts = 4096;
  c.hidden_size = 1 << 20;
  c.moe_intermediate_size = 1 << 20;
  c.validate();
  test::expect_error_contains([&] { (void)c.num_params(); }, "model config: num_params: ");
  test::expect_error_contains([&] { (void)c.num_expert_params(); }, "overflows a 64-bit integer");
  c.top_k = 4096;
  test::expect_error_contains([&] { (void)model_flops(c, {128}); },
                              "active_matmul_params_per_token");
}

TEST(HostileConfig, ValuesThatWouldNotRoundTripAreRejected) {
  // A negative token id was accepted and written back as null (= none): a different config.
  json j = demo_tiny();
  j["bos_token_id"] = -5;
  test::expect_error_contains([&] { parse_hf_config(j, "cfg.json"); },
                              "key 'bos_token_id' in cfg.json is -5: token ids are >= 0");
  j = demo_tiny();
  j["eos_token_id"] = json::array({-2, 3});
  test::expect_error_contains([&] { parse_hf_config(j, "cfg.json"); }, "token ids are >= 0");
  // A repeated dense-layer index changes nothing in the model and makes validation quadratic.
  j = demo_tiny();
  j["mlp_only_layers"] = json::array({0, 2, 0});
  test::expect_error_contains([&] { parse_hf_config(j, "cfg.json"); },
                              "mlp_only_layers lists layer 0 twice");
  // Infinity passes "> 0" and is written back as null (= the default).
  ModelConfig c = parse_hf_config(demo_tiny(), "cfg.json");
  c.rope_theta = std::numeric_limits<double>::infinity();
  test::expect_error_contains([&] { c.validate(); }, "rope_theta must be a finite number");
}

TEST_F(HostileInput, DeeplyNestedConfigFileIsRejectedWithAMessage) {
  const std::string p =
      write("config.json", R"({"model_type": "qwen3_moe", "x": )" + nested_arrays(100000) + "}");
  test::expect_error_contains([&] { load_hf_config(p); }, "nested deeper than 64 levels");
}

// ---- safetensors ------------------------------------------------------------------------------

TEST_F(HostileInput, DeeplyNestedSafetensorsHeaderIsRejected) {
  const std::string p = safetensors_file("deep.safetensors",
                                         R"({"__metadata__": {"a": )" + nested_arrays(5000) + "}}");
  test::expect_error_contains([&] { SafetensorsReader r(p); },
                              "header JSON is nested deeper than 64 levels");
}

TEST_F(HostileInput, DeeplyNestedSafetensorsIndexIsRejected) {
  make_dirs(path_join(dir_, "ckpt"));
  write("ckpt/model.safetensors.index.json",
        R"({"weight_map": {}, "metadata": )" + nested_arrays(5000) + "}");
  test::expect_error_contains([&] { SafetensorsDir d(path_join(dir_, "ckpt")); },
                              "nested deeper than 64 levels");
}

TEST_F(HostileInput, SafetensorsHugeShapeWithAZeroDimReadsAsEmpty) {
  // [2^62, 2^62, 0] spans 0 bytes: a legal empty tensor. Reading it used to multiply the dims
  // in int64 (undefined behaviour, caught by UBSan); an overflowing shape without a zero is
  // refused at open.
  const std::string p = safetensors_file(
      "zero.safetensors",
      R"({"e": {"dtype": "F32", "shape": [4611686018427387904, 4611686018427387904, 0], "data_offsets": [0, 0]}})");
  SafetensorsReader r(p);
  Tensor t = r.read("e");
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.shape(), (Shape{k2to62, k2to62, 0}));
  const std::string q = safetensors_file(
      "big.safetensors",
      R"({"e": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}})");
  test::expect_error_contains([&] { SafetensorsReader r2(q); }, "has too many elements");
  // The direct construction of such a tensor (what read() does) is refused too.
  test::expect_error_contains(
      [] {
        (void)Tensor::empty({k2to62, 4}, DType::f32, Device::cpu(), MemCategory::other);
      },
      "has more elements");
}

}  // namespace
}  // namespace bb
