// fuzz_safetensors.cpp — the safetensors reader (io/safetensors.h) on arbitrary files.
//
// Input: the bytes of a file. One that starts with '{' is a sharded index
// (model.safetensors.index.json) over three real shards written at startup, opened with
// SafetensorsDir; anything else is a .safetensors file opened with SafetensorsReader (and,
// as DIR/model.safetensors, with SafetensorsDir). Our writer pads headers to 8 bytes, so a
// real file never starts with '{' (0x7b is not a multiple of 8).
//
// Invariants of an accepted file, checked on every tensor: the entries tile the data region
// in order, each entry's span is numel * dtype size, read() returns exactly that shape,
// dtype and byte count, read_as(f32) of a float tensor keeps the shape, and the SafetensorsDir
// view agrees with the reader.
#include <cstring>

#include "fuzz_common.h"
#include "io/safetensors.h"

namespace {

using namespace bb;

struct Dirs {
  std::string single_dir, single_file, sharded_dir, index_file;
};

const Dirs& dirs() {
  static const Dirs d = [] {
    Dirs x;
    const std::string& root = fuzz::scratch_dir();
    x.single_dir = path_join(root, "single");
    x.single_file = path_join(x.single_dir, kSafetensorsSingleFile);
    x.sharded_dir = path_join(root, "sharded");
    x.index_file = path_join(x.sharded_dir, kSafetensorsIndexFile);
    make_dirs(x.single_dir);
    // Two shards of small tensors (a shard limit of 40 bytes splits them), the same ones the
    // committed index seeds name.
    std::vector<std::pair<std::string, Tensor>> ts = {
        {"a", Tensor::from_floats({1, 2, 3, 4}, {2, 2})},
        {"b", Tensor::from_floats({5, 6}, {2}, DType::bf16)},
        {"c", Tensor::from_ints({7, 8, 9}, {3})},
        {"empty", Tensor::empty({0, 3}, DType::f16, Device::cpu(), MemCategory::other)},
        {"d", Tensor::from_floats(std::vector<float>(10, 0.5f), {10})}};
    write_sharded_safetensors(x.sharded_dir, ts, 40);
    return x;
  }();
  return d;
}

void check_tensor(const SafetensorsEntry& e, const Tensor& t, const char* via) {
  FUZZ_CHECK(t.shape() == e.shape && t.dtype() == e.dtype, "%s: tensor '%s' read back as %s", via,
             e.name.c_str(), t.str().c_str());
  FUZZ_CHECK(t.nbytes() == e.end - e.begin, "%s: tensor '%s' has %zu bytes, entry spans %llu", via,
             e.name.c_str(), t.nbytes(), static_cast<unsigned long long>(e.end - e.begin));
}

void read_all(const SafetensorsReader& r) {
  uint64_t pos = 0;
  for (const SafetensorsEntry& e : r.entries()) {
    FUZZ_CHECK(e.begin == pos && e.end >= e.begin, "tensor '%s' [%llu, %llu) does not follow %llu",
               e.name.c_str(), static_cast<unsigned long long>(e.begin),
               static_cast<unsigned long long>(e.end), static_cast<unsigned long long>(pos));
    pos = e.end;
    FUZZ_CHECK(r.find(e.name) == &e, "find('%s') does not return its entry", e.name.c_str());
    const Tensor t = r.read(e.name);
    check_tensor(e, t, "read");
    if (is_floating(e.dtype)) {
      const Tensor f = r.read_as(e.name, DType::f32, MemCategory::other);
      FUZZ_CHECK(f.shape() == e.shape && f.dtype() == DType::f32, "read_as(f32) of '%s' gave %s",
                 e.name.c_str(), f.str().c_str());
    }
  }
}

void read_dir(const std::string& dir) {
  SafetensorsDir d(dir);
  for (const std::string& name : d.names()) {
    FUZZ_CHECK(d.has(name), "SafetensorsDir lists '%s' but has() is false", name.c_str());
    const SafetensorsEntry& e = d.entry(name);
    check_tensor(e, d.read(name), "SafetensorsDir::read");
  }
  (void)d.metadata();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Dirs& d = dirs();
  const std::string_view bytes = fuzz::as_text(data, size);
  if (size > 0 && data[0] == '{') {
    fuzz::write_bytes(d.index_file, bytes);
    fuzz::accept_or_reject("SafetensorsDir(index)", [&] { read_dir(d.sharded_dir); });
    return 0;
  }
  fuzz::write_bytes(d.single_file, bytes);
  bool opened = false;
  fuzz::accept_or_reject("SafetensorsReader", [&] {
    SafetensorsReader r(d.single_file);
    opened = true;
    read_all(r);
  });
  // The directory view must accept exactly the files the reader accepts.
  const bool dir_ok =
      fuzz::accept_or_reject("SafetensorsDir(single)", [&] { read_dir(d.single_dir); });
  FUZZ_CHECK(dir_ok == opened, "SafetensorsReader %s the file but SafetensorsDir %s it",
             opened ? "accepted" : "rejected", dir_ok ? "accepted" : "rejected");
  return 0;
}
