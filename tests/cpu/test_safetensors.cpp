// safetensors reader/writer, sharded checkpoints and the atomic file write.
//
// Files are written under a fresh directory in the system temp dir and removed afterwards.
// The format itself is checked independently of our writer: a hand-assembled byte string must
// equal the writer's output, and hand-written headers (other key orders, whitespace) must read.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/testing.h"
#include "core/tensor.h"
#include "io/fs.h"
#include "io/safetensors.h"

namespace bb {
namespace {

namespace stdfs = std::filesystem;
using Named = std::vector<std::pair<std::string, Tensor>>;

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (stdfs::temp_directory_path() / "bb_safetensors_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    stdfs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return path_join(dir_, name); }

  // A file made of an explicit 8-byte length, header text and data bytes (no validation).
  std::string raw_file(const std::string& name, const std::string& header, const std::string& data,
                       int64_t length = -1) {
    uint64_t n = length < 0 ? header.size() : static_cast<uint64_t>(length);
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    write_plain(path(name), bytes + header + data);
    return path(name);
  }
  // Test fixtures need no durability; skipping atomic_write's fsyncs keeps the test fast.
  static void write_plain(const std::string& p, std::string_view bytes) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good()) << p;
  }

  std::string dir_;
};

std::string bytes_of(const Tensor& t) {
  return std::string(static_cast<const char*>(t.raw()), t.nbytes());
}

// One tensor of every dtype with distinctive contents, plus empty and scalar tensors.
Named all_dtypes() {
  Named v;
  v.emplace_back("w.f32", Tensor::from_floats(test::randn(12, 1), {3, 4}, DType::f32));
  v.emplace_back("w.bf16", Tensor::from_floats(test::randn(10, 2), {2, 5}, DType::bf16));
  v.emplace_back("w.f16", Tensor::from_floats(test::randn(6, 3), {6}, DType::f16));
  v.emplace_back("ids.i32", Tensor::from_ints({-7, 0, 2147483647, -2147483647 - 1, 5}, {5}));
  Tensor i64 = Tensor::empty({2, 2}, DType::i64, Device::cpu(), MemCategory::other);
  const int64_t i64v[4] = {int64_t{1} << 40, -3, (int64_t{1} << 62) + 17, 0};
  std::memcpy(i64.raw(), i64v, sizeof(i64v));
  v.emplace_back("pos.i64", i64);
  Tensor u8 = Tensor::empty({7}, DType::u8, Device::cpu(), MemCategory::other);
  for (int i = 0; i < 7; ++i) u8.data<uint8_t>()[i] = static_cast<uint8_t>(255 - 37 * i);
  v.emplace_back("bytes.u8", u8);
  Tensor b = Tensor::empty({3}, DType::boolean, Device::cpu(), MemCategory::other);
  b.data<uint8_t>()[0] = 1, b.data<uint8_t>()[1] = 0, b.data<uint8_t>()[2] = 1;
  v.emplace_back("mask.bool", b);
  v.emplace_back("empty.f32", Tensor::empty({0}, DType::f32, Device::cpu(), MemCategory::other));
  v.emplace_back("empty.bf16",
                 Tensor::empty({3, 0, 2}, DType::bf16, Device::cpu(), MemCategory::other));
  v.emplace_back("scalar", Tensor::from_floats({4.25f}, {}, DType::f32));
  return v;
}

TEST_F(Safetensors, RoundTripEveryDtypeWithEmptyTensorsAndMetadata) {
  const Named in = all_dtypes();
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "42"},
                                                   {"quote\"d", "uni\xc3\xa9"}};
  write_safetensors(path("a.safetensors"), in, meta);

  SafetensorsReader r(path("a.safetensors"));
  EXPECT_EQ(r.metadata(), meta);
  EXPECT_EQ(r.data_start() % 8, 0u);
  // Entries come back in data order, which is the order written; empty tensors included.
  ASSERT_EQ(r.entries().size(), in.size());
  uint64_t offset = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const SafetensorsEntry& e = r.entries()[i];
    EXPECT_EQ(e.name, in[i].first);
    EXPECT_EQ(e.dtype, in[i].second.dtype()) << e.name;
    EXPECT_EQ(e.shape, in[i].second.shape()) << e.name;
    EXPECT_EQ(e.begin, offset) << e.name;
    offset += in[i].second.nbytes();
    EXPECT_EQ(e.end, offset) << e.name;
  }
  EXPECT_EQ(file_size(path("a.safetensors")), r.data_start() + offset);
  for (const auto& [name, t] : in) {
    ASSERT_TRUE(r.has(name));
    Tensor got = r.read(name, MemCategory::params);
    EXPECT_EQ(got.dtype(), t.dtype()) << name;
    EXPECT_EQ(got.shape(), t.shape()) << name;
    EXPECT_EQ(got.category(), MemCategory::params) << name;
    EXPECT_TRUE(got.device().is_cpu());
    EXPECT_EQ(bytes_of(got), bytes_of(t)) << name;  // bit-exact, NaN payloads and all
  }
  EXPECT_FALSE(r.has("nope"));
  EXPECT_EQ(r.find("nope"), nullptr);
  test::expect_error_contains([&] { r.read("nope"); }, "no tensor named 'nope'");
}

TEST_F(Safetensors, ReadAsConvertsBetweenFloatTypes) {
  const std::vector<float> v = test::randn(8, 11);
  write_safetensors(path("c.safetensors"),
                    {{"x", Tensor::from_floats(v, {2, 4}, DType::bf16)},
                     {"y", Tensor::from_floats(v, {8}, DType::f32)},
                     {"i", Tensor::from_ints({1, 2}, {2})}});
  SafetensorsReader r(path("c.safetensors"));
  Tensor x = r.read_as("x", DType::f32, MemCategory::params);
  EXPECT_EQ(x.dtype(), DType::f32);
  EXPECT_EQ(x.shape(), (Shape{2, 4}));
  EXPECT_EQ(x.category(), MemCategory::params);
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(x.to_floats()[i], round_bf16(v[i]));
  Tensor y = r.read_as("y", DType::bf16, MemCategory::other);
  EXPECT_EQ(y.dtype(), DType::bf16);
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(y.to_floats()[i], round_bf16(v[i]));
  Tensor h = r.read_as("y", DType::f16, MemCategory::other);
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(h.to_floats()[i], f16_to_f32(f32_to_f16(v[i])));
  EXPECT_EQ(r.read_as("i", DType::i32, MemCategory::other).to_ints(), (std::vector<int32_t>{1, 2}));
  test::expect_error_contains([&] { r.read_as("i", DType::f32, MemCategory::other); },
                              "tensor 'i': cannot convert i32 to f32");
}

// Independent check of the format: the bytes are assembled here by hand from the published
// description (u64 LE length, compact JSON padded with spaces to 8 bytes, raw LE data).
TEST_F(Safetensors, WrittenBytesMatchHandAssembledFile) {
  write_safetensors(path("tiny.safetensors"),
                    {{"a", Tensor::from_floats({1.0f, -2.0f}, {2}, DType::f32)},
                     {"b", Tensor::from_floats({1.0f}, {1}, DType::bf16)}},
                    {{"format", "pt"}});
  const std::string json =
      "{\"__metadata__\":{\"format\":\"pt\"},"
      "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[8,10]}}    ";  // 140 + 4 pad
  ASSERT_EQ(json.size(), 144u);
  std::string expected("\x90\0\0\0\0\0\0\0", 8);
  expected += json;
  expected += std::string("\x00\x00\x80\x3f\x00\x00\x00\xc0\x80\x3f", 10);  // 1.0f, -2.0f, bf16 1.0
  EXPECT_EQ(read_file(path("tiny.safetensors")), expected);

  // No tensors, no metadata: "{}" padded to 8 bytes.
  write_safetensors(path("none.safetensors"), {});
  EXPECT_EQ(read_file(path("none.safetensors")), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
  EXPECT_TRUE(SafetensorsReader(path("none.safetensors")).entries().empty());
}

TEST_F(Safetensors, ReadsHandWrittenHeaders) {
  // Header order differs from data order, extra whitespace, unpadded, empty tensor in between.
  const std::string header =
      "{ \"b\" : {\"dtype\":\"I32\", \"data_offsets\":[4,8], \"shape\":[1]},\n"
      "  \"e\": {\"shape\":[0,5],\"dtype\":\"F16\",\"data_offsets\":[4,4]},\n"
      "  \"__metadata__\": {\"k\": \"v\"},\n"
      "  \"a\": {\"dtype\":\"U8\",\"shape\":[2,2],\"data_offsets\":[0,4]} }";
  const std::string data("\x01\x02\x03\x04\x2a\x00\x00\x00", 8);
  SafetensorsReader r(raw_file("h.safetensors", header, data));
  ASSERT_EQ(r.entries().size(), 3u);
  EXPECT_EQ(r.entries()[0].name, "a");
  EXPECT_EQ(r.entries()[1].name, "e");  // begin 4, header order before "b"
  EXPECT_EQ(r.entries()[2].name, "b");
  EXPECT_EQ(r.metadata().at("k"), "v");
  EXPECT_EQ(r.read("a").to_ints(), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(r.read("b").to_ints(), (std::vector<int32_t>{42}));
  EXPECT_EQ(r.read("e").shape(), (Shape{0, 5}));
}

TEST_F(Safetensors, TruncatedFilesFailClearlyAtEveryCut) {
  write_safetensors(path("full.safetensors"),
                    {{"a", Tensor::from_floats(test::randn(5, 4), {5}, DType::f32)},
                     {"b", Tensor::from_floats(test::randn(3, 5), {3}, DType::bf16)}},
                    {{"m", "x"}});
  const std::string full = read_file(path("full.safetensors"));
  const uint64_t data_start = SafetensorsReader(path("full.safetensors")).data_start();
  ASSERT_LT(data_start, full.size());
  for (size_t cut = 0; cut < full.size(); ++cut) {
    write_plain(path("cut.safetensors"), std::string_view(full).substr(0, cut));
    std::string needle = cut < 8 ? "file is shorter than 8 bytes"
                         : cut < data_start ? "exceeds the file size"
                                            : "extends past the end of the file";
    SCOPED_TRACE("cut at " + std::to_string(cut));
    test::expect_error_contains([&] { SafetensorsReader r(path("cut.safetensors")); }, needle);
    test::expect_error_contains([&] { SafetensorsReader r(path("cut.safetensors")); },
                                path("cut.safetensors"));
  }
  // Cutting inside tensor 'b' names it; the complete file still opens.
  write_plain(path("cut.safetensors"), std::string_view(full).substr(0, full.size() - 1));
  test::expect_error_contains([&] { SafetensorsReader r(path("cut.safetensors")); }, "tensor 'b'");
  EXPECT_EQ(SafetensorsReader(path("full.safetensors")).entries().size(), 2u);
}

TEST_F(Safetensors, CorruptHeadersFailWithClearMessages) {
  const std::string d8(8, '\x11');
  struct Case {
    std::string header, data, needle;
  };
  const std::vector<Case> cases = {
      {"{\"a\": ", "", "header is not valid JSON"},
      {"[1, 2]", "", "header is not a JSON object"},
      {"{\"a\": 5}", "", "tensor 'a': entry is not an object"},
      {"{\"a\": {\"shape\":[2],\"data_offsets\":[0,8]}}", d8, "tensor 'a': missing 'dtype'"},
      {"{\"a\": {\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", d8, "tensor 'a': missing 'shape'"},
      {"{\"a\": {\"dtype\":\"F32\",\"shape\":[2]}}", d8, "tensor 'a': missing 'data_offsets'"},
      {"{\"a\": {\"dtype\":4,\"shape\":[2],\"data_offsets\":[0,8]}}", d8,
       "'dtype' is not a string"},
      {"{\"a\": {\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,8]}}", d8,
       "'shape' is not an array"},
      {"{\"a\": {\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", d8,
       "must hold non-negative integers"},
      {"{\"a\": {\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", d8,
       "must hold non-negative integers"},
      {"{\"a\": {\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", d8,
       "'data_offsets' is not an array of two integers"},
      {"{\"a\": {\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,-8]}}", d8,
       "must hold two non-negative integers"},
      {"{\"a\": {\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", d8, "end < begin"},
      {"{\"a\": {\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", d8,
       "span 4 bytes but F32[2] needs 8 bytes"},
      {"{\"a\": {\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", d8,
       "tensor 'a': data [0, 16) extends past the end of the file"},
      {"{\"a\": {\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", d8,
       "unsupported dtype F64 for tensor 'a'"},
      {"{\"q\": {\"dtype\":\"F8_E4M3\",\"shape\":[8],\"data_offsets\":[0,8]}}", d8,
       "unsupported dtype F8_E4M3 for tensor 'q'"},
      {"{\"a\": {\"dtype\":\"U8\",\"shape\":[4294967296,4294967296,4],\"data_offsets\":[0,8]}}",
       d8, "has too many elements"},
      {"{\"a\": {\"dtype\":\"U8\",\"shape\":[6],\"data_offsets\":[0,6]},"
       " \"b\": {\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,6]}}",
       d8, "tensor 'b' [4, 6) overlaps tensor 'a'"},
      {"{\"a\": {\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
       " \"b\": {\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[6,8]}}",
       d8, "hole in the data region: bytes [2, 6) before tensor 'b'"},
      {"{\"a\": {\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2,4]},"
       " \"b\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}",
       d8, "hole in the data region: bytes [0, 2) before tensor 'a'"},
      {"{\"a\": {\"dtype\":\"U8\",\"shape\":[6],\"data_offsets\":[0,6]}}", d8,
       "trailing bytes [6, 8) after the last tensor"},
      {"{\"a\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
       " \"a\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}",
       d8, "duplicate key 'a'"},
      {"{\"__metadata__\": {\"k\": 3}}", "", "__metadata__ value of 'k' is not a string"},
      {"{\"__metadata__\": [\"k\"]}", "", "__metadata__ is not an object"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i) + ": " + cases[i].header);
    const std::string p = raw_file("bad.safetensors", cases[i].header, cases[i].data);
    test::expect_error_contains([&] { SafetensorsReader r(p); }, cases[i].needle);
    test::expect_error_contains([&] { SafetensorsReader r(p); }, "safetensors " + p);
  }
  // A length field that claims a gigantic header is refused before any allocation.
  const std::string p = raw_file("huge.safetensors", "{}", "", 1ull << 40);
  test::expect_error_contains([&] { SafetensorsReader r(p); }, "is absurd");
  test::expect_error_contains([&] { SafetensorsReader r(path("missing.safetensors")); },
                              "cannot open");
}

TEST_F(Safetensors, WriterRejectsBadTensorListsAndWritesNothing) {
  Tensor t = Tensor::from_floats({1, 2}, {2});
  const std::string p = path("w.safetensors");
  test::expect_error_contains([&] { write_safetensors(p, {{"a", t}, {"a", t}}); },
                              "duplicate tensor name 'a'");
  test::expect_error_contains([&] { write_safetensors(p, {{"", t}}); }, "must be non-empty");
  test::expect_error_contains([&] { write_safetensors(p, {{"__metadata__", t}}); }, "reserved");
  test::expect_error_contains([&] { write_safetensors(p, {{"u", Tensor()}}); },
                              "tensor 'u' is undefined");
  test::expect_error_contains([&] { write_safetensors(p, {{"bad\xff", t}}); }, "not valid UTF-8");
  EXPECT_FALSE(path_exists(p));
  EXPECT_FALSE(path_exists(atomic_temp_path(p)));
}

TEST_F(Safetensors, ShardedRoundTripAndIndexContent) {
  // 40 + 24 + 64 + 8 + 100 + 0 + 12 bytes; limit 64 -> [a, b], [c], [d], [e] (oversized, alone),
  // [z, f] (the empty tensor rides along with the next one).
  Named in;
  in.emplace_back("a", Tensor::from_floats(test::randn(10, 21), {10}, DType::f32));
  in.emplace_back("b", Tensor::from_floats(test::randn(12, 22), {3, 4}, DType::bf16));
  in.emplace_back("c", Tensor::from_floats(test::randn(16, 23), {4, 4}, DType::f32));
  in.emplace_back("d", Tensor::from_ints({7, -7}, {2}));
  in.emplace_back("e", Tensor::from_floats(test::randn(25, 24), {5, 5}, DType::f32));
  in.emplace_back("z", Tensor::empty({0, 3}, DType::f16, Device::cpu(), MemCategory::other));
  in.emplace_back("f", Tensor::from_floats(test::randn(6, 25), {6}, DType::f16));
  const std::string ck = path("ckpt");
  write_sharded_safetensors(ck, in, 64, {{"format", "pt"}});

  const std::vector<std::vector<std::string>> expected_shards = {
      {"a", "b"}, {"c"}, {"d"}, {"e"}, {"z", "f"}};
  nlohmann::json index = nlohmann::json::parse(read_file(path_join(ck, kSafetensorsIndexFile)));
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), 40u + 24 + 64 + 8 + 100 + 0 + 12);
  nlohmann::json expected_map = nlohmann::json::object();
  for (size_t s = 0; s < expected_shards.size(); ++s) {
    const std::string file = "model-0000" + std::to_string(s + 1) + "-of-00005.safetensors";
    EXPECT_EQ(safetensors_shard_name(static_cast<int>(s + 1), 5), file);
    SafetensorsReader shard(path_join(ck, file));
    ASSERT_EQ(shard.entries().size(), expected_shards[s].size()) << file;
    for (size_t j = 0; j < expected_shards[s].size(); ++j) {
      EXPECT_EQ(shard.entries()[j].name, expected_shards[s][j]);
      expected_map[expected_shards[s][j]] = file;
    }
    EXPECT_EQ(shard.metadata().at("format"), "pt");
  }
  EXPECT_EQ(index["weight_map"], expected_map);
  EXPECT_FALSE(path_exists(path_join(ck, kSafetensorsSingleFile)));

  SafetensorsDir sd(ck);
  EXPECT_TRUE(sd.sharded());
  EXPECT_EQ(sd.files().size(), 5u);
  EXPECT_EQ(sd.names(), (std::vector<std::string>{"a", "b", "c", "d", "e", "z", "f"}));
  EXPECT_EQ(sd.metadata().at("format"), "pt");
  for (const auto& [name, t] : in) {
    ASSERT_TRUE(sd.has(name));
    EXPECT_EQ(sd.entry(name).shape, t.shape());
    EXPECT_EQ(bytes_of(sd.read(name, MemCategory::params)), bytes_of(t)) << name;
  }
  EXPECT_EQ(sd.read_as("b", DType::f32, MemCategory::params).to_floats(), in[1].second.to_floats());
  test::expect_error_contains([&] { sd.entry("nope"); }, "no tensor named 'nope'");

  // Re-saving into the same directory with everything in one shard leaves only the single file.
  write_sharded_safetensors(ck, in, 1 << 20);
  EXPECT_TRUE(path_exists(path_join(ck, kSafetensorsSingleFile)));
  EXPECT_FALSE(path_exists(path_join(ck, kSafetensorsIndexFile)));
  EXPECT_FALSE(path_exists(path_join(ck, "model-00001-of-00005.safetensors")));
  SafetensorsDir single(ck);
  EXPECT_FALSE(single.sharded());
  EXPECT_EQ(single.names().size(), in.size());
  EXPECT_EQ(bytes_of(single.read("e", MemCategory::other)), bytes_of(in[4].second));

  // And back to two shards: the single file is removed.
  write_sharded_safetensors(ck, in, 150);
  EXPECT_FALSE(path_exists(path_join(ck, kSafetensorsSingleFile)));
  EXPECT_EQ(SafetensorsDir(ck).files().size(), 2u);
  test::expect_error_contains([&] { write_sharded_safetensors(ck, in, 0); },
                              "max_shard_bytes must be > 0");
}

TEST_F(Safetensors, ShardedIndexErrors) {
  Named in = {{"a", Tensor::from_floats({1, 2}, {2})},
              {"b", Tensor::from_floats({3}, {1})},
              {"c", Tensor::from_floats({4}, {1})}};
  const std::string ck = path("ck");
  write_sharded_safetensors(ck, in, 8);  // two shards: [a], [b, c]
  const std::string index_path = path_join(ck, kSafetensorsIndexFile);
  const std::string good = read_file(index_path);
  auto with_map = [&](const nlohmann::json& wm) {
    nlohmann::json index = {{"metadata", {{"total_size", 16}}}, {"weight_map", wm}};
    atomic_write(index_path, index.dump());
  };
  const std::string s1 = "model-00001-of-00002.safetensors";
  const std::string s2 = "model-00002-of-00002.safetensors";

  with_map({{"a", s1}, {"b", "model-00009-of-00009.safetensors"}, {"c", s2}});
  test::expect_error_contains([&] { SafetensorsDir d(ck); },
                              "shard file model-00009-of-00009.safetensors (holding tensor 'b') "
                              "does not exist");
  with_map({{"a", s1}, {"b", s2}, {"c", s2}, {"ghost", s2}});
  test::expect_error_contains([&] { SafetensorsDir d(ck); },
                              "tensor 'ghost' is listed in shard " + s2 +
                                  " but absent from that file");
  with_map({{"a", s2}, {"b", s2}, {"c", s2}});
  test::expect_error_contains([&] { SafetensorsDir d(ck); },
                              "tensor 'a' is listed in shard " + s2 + " but absent from that file");
  with_map({{"a", s1}, {"b", s2}});
  test::expect_error_contains([&] { SafetensorsDir d(ck); },
                              "shard " + s2 + " holds tensor 'c' that the index does not map");
  with_map({{"a", s1}, {"b", 3}});
  test::expect_error_contains([&] { SafetensorsDir d(ck); },
                              "weight_map entry of tensor 'b' is not a file name string");
  with_map({{"a", "../a.safetensors"}, {"b", s2}, {"c", s2}});
  test::expect_error_contains([&] { SafetensorsDir d(ck); }, "not a plain file name");
  atomic_write(index_path, "{\"weight_map\": ");
  test::expect_error_contains([&] { SafetensorsDir d(ck); }, "not valid JSON");
  atomic_write(index_path, "{\"metadata\": {}}");
  test::expect_error_contains([&] { SafetensorsDir d(ck); }, "\"weight_map\" object");

  atomic_write(index_path, good);
  EXPECT_EQ(SafetensorsDir(ck).names(), (std::vector<std::string>{"a", "b", "c"}));
  write_safetensors(path_join(ck, kSafetensorsSingleFile), in);
  test::expect_error_contains([&] { SafetensorsDir d(ck); }, "ambiguous");
  make_dirs(path("empty"));
  test::expect_error_contains([&] { SafetensorsDir d(path("empty")); }, "neither");
}

TEST_F(Safetensors, AtomicWriteKeepsPreviousFileWhenCallbackThrows) {
  const std::string p = path("f.bin");
  atomic_write(p, "old content");
  test::expect_error_contains(
      [&] {
        atomic_write(p, [](FileWriter& w) {
          w.write("new partial data that never lands");
          BB_FAIL("simulated failure after ", w.written(), " bytes");
        });
      },
      "simulated failure after 33 bytes");
  EXPECT_EQ(read_file(p), "old content");
  EXPECT_FALSE(path_exists(atomic_temp_path(p)));
  EXPECT_EQ(atomic_temp_path(p), p + ".tmp." + std::to_string(::getpid()));

  // Non-bb exceptions are cleaned up the same way.
  EXPECT_THROW(atomic_write(p, [](FileWriter& w) {
                 w.write("x");
                 throw std::runtime_error("boom");
               }),
               std::runtime_error);
  EXPECT_EQ(read_file(p), "old content");
  EXPECT_FALSE(path_exists(atomic_temp_path(p)));

  atomic_write(p, "new");
  EXPECT_EQ(read_file(p), "new");
  size_t files = 0;
  for (const auto& e : stdfs::directory_iterator(dir_)) files += e.is_regular_file();
  EXPECT_EQ(files, 1u);  // no temporaries left behind
}

// A real mid-write failure: the file-size limit makes write(2) fail with EFBIG partway through
// the checkpoint, as a full disk would.
TEST_F(Safetensors, AtomicWriteSurvivesFailingWritesMidFile) {
  const std::string p = path("ck.safetensors");
  const Named old_tensors = {{"w", Tensor::from_floats(test::randn(4, 31), {4})}};
  write_safetensors(p, old_tensors);
  const std::string old_bytes = read_file(p);

  rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = saved;
  small.rlim_cur = 300;  // the header fits, the data does not
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const Named big = {{"w", Tensor::from_floats(test::randn(256, 32), {256})}};
  std::string message;
  try {
    write_safetensors(p, big);
  } catch (const Error& e) {
    message = e.what();
  }
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  std::signal(SIGXFSZ, old_handler);

  EXPECT_NE(message.find("writing " + p + " failed after"), std::string::npos) << message;
  EXPECT_EQ(read_file(p), old_bytes);
  EXPECT_FALSE(path_exists(atomic_temp_path(p)));
  EXPECT_EQ(bytes_of(SafetensorsReader(p).read("w")), bytes_of(old_tensors[0].second));

  // A destination directory that does not exist fails before anything is created.
  test::expect_error_contains([&] { write_safetensors(path("no/such/dir/x.safetensors"), big); },
                              "cannot create temporary file");
}

TEST_F(Safetensors, FsHelpers) {
  make_dirs(path("a/b/c"));
  EXPECT_TRUE(is_directory(path("a/b/c")));
  make_dirs(path("a/b/c"));  // idempotent
  atomic_write(path("a/file"), std::string("x\0y", 3));
  EXPECT_EQ(read_file(path("a/file")), std::string("x\0y", 3));
  EXPECT_EQ(file_size(path("a/file")), 3u);
  test::expect_error_contains([&] { make_dirs(path("a/file")); }, "make_dirs " + path("a/file"));
  test::expect_error_contains([&] { read_file(path("a/missing")); }, "cannot open");
  test::expect_error_contains([&] { read_file(path("a")); }, "is a directory");
  test::expect_error_contains([&] { file_size(path("a")); }, "not a regular file");
  EXPECT_EQ(path_join("d", "f"), "d/f");
  EXPECT_EQ(path_join("d/", "f"), "d/f");
}

}  // namespace
}  // namespace bb
