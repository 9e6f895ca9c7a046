// safetensors.h — our own reader and writer of the safetensors format, single-file and sharded.
//
// The format (huggingface/safetensors): an 8-byte little-endian u64 N, then N bytes of UTF-8
// JSON, then the raw little-endian tensor bytes. The JSON is an object
//   {"__metadata__": {str: str},                                   (optional)
//    "<name>": {"dtype": "BF16", "shape": [d0, ...], "data_offsets": [begin, end]}, ...}
// with offsets relative to the first byte after the header. Tensors are dense, row-major.
//
// The reader parses and validates the whole header when it opens a file, so a truncated or
// corrupt file fails at open with a message naming the file and the tensor, not later at read
// time: dtype supported, shape of non-negative integers, end - begin == numel * dtype size,
// data inside the file, and the tensors tiling the data region exactly (no overlap, no hole,
// no trailing bytes; the format requires a fully indexed byte buffer). Data is read with
// plain seek + read (no mmap), one tensor at a time, into CPU tensors of the category asked.
//
// The writer lays data out in the order given, writes compact JSON with "__metadata__" first
// and then the tensors in data order (as the reference Rust writer does), pads the header with
// spaces so the data starts 8-byte aligned, and writes through atomic_write (io/fs.h): either
// the complete new file is at the path or the previous one is, never a torn file.
//
// Sharded checkpoints follow the Hugging Face layout: DIR/model.safetensors.index.json
//   {"metadata": {"total_size": <sum of tensor bytes>}, "weight_map": {name: shard file}}
// plus DIR/model-00001-of-0000n.safetensors ..., or a single DIR/model.safetensors when
// everything fits in one shard.
//
// DType mapping: F32<->f32, BF16<->bf16, F16<->f16, I32<->i32, I64<->i64, U8<->u8,
// BOOL<->boolean. Other safetensors dtypes (F64, I8, I16, U16, U32, U64, F8_*) are rejected.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/memory.h"
#include "core/tensor.h"

namespace bb {

// The format's own ceiling on the header size (the reference implementation uses the same).
constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;
inline constexpr const char* kSafetensorsSingleFile = "model.safetensors";
inline constexpr const char* kSafetensorsIndexFile = "model.safetensors.index.json";

// "F32", "BF16", ... for a DType.
const char* safetensors_dtype_name(DType dt);
// "model-0000i-of-0000n.safetensors" for shard i (1-based) of n.
std::string safetensors_shard_name(int i, int n);

// One tensor of a file. begin/end are byte offsets relative to the start of the data region.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

class SafetensorsReader {
 public:
  // Opens `path`, parses and validates its header; throws bb::Error on any violation.
  explicit SafetensorsReader(const std::string& path);

  // In data order (ascending (begin, end); header order breaks ties between empty tensors).
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const SafetensorsEntry* find(const std::string& name) const;  // nullptr if absent
  bool has(const std::string& name) const { return find(name) != nullptr; }

  // The tensor `name` as a new CPU tensor with its stored dtype and shape, under `cat`.
  Tensor read(const std::string& name, MemCategory cat = MemCategory::other) const;
  // The tensor converted to `as` (float <-> float only: f32/bf16/f16), under `cat`. With
  // as == stored dtype this is read(). The unconverted copy is a `workspace` temporary.
  Tensor read_as(const std::string& name, DType as, MemCategory cat) const;

  // "__metadata__" (empty if the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  // Offset of the data region in the file (8 + header length).
  uint64_t data_start() const { return data_start_; }

 private:
  const SafetensorsEntry& entry_or_throw(const std::string& name) const;

  std::string path_;
  uint64_t data_start_ = 0;
  uint64_t data_bytes_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::unordered_map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` (CPU or any device; device tensors are copied to the host one at a time)
// to `path` atomically (temp name + fsync + rename). Names must be unique, non-empty, valid
// UTF-8 and not "__metadata__"; tensors must be defined. Data is laid out in the given order.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Content checksums (training checkpoints): a 64-bit checksum of a tensor's bytes, and the
// metadata key that holds it in a file ("checksum:" + tensor name, 16 hex digits).
// checksum64 changes whenever any one 8-byte word of the data changes (every step of it is a
// bijection of the running state), and with probability ~1 - 2^-64 for other corruptions;
// about memory speed (four independent lanes).
uint64_t checksum64(const void* data, size_t bytes);
std::string checksum_key(const std::string& tensor_name);
constexpr const char* kChecksumKeyPrefix = "checksum:";
// write_safetensors that also stores every tensor's checksum64 in the metadata (computed as the
// bytes pass through the host, the header patched in place once they are known; no second
// read of a GPU tensor).
void write_safetensors_with_checksums(const std::string& path,
                                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                                      const std::map<std::string, std::string>& metadata = {});
// The tensor's stored checksum in `metadata`, if any, checked against `t`'s bytes: an error
// naming the file and the tensor when they differ. Returns whether a checksum was there.
bool verify_checksum(const std::map<std::string, std::string>& metadata, const std::string& file,
                     const std::string& name, const Tensor& t);

// The exact header bytes (8-byte length + padded JSON) write_safetensors would emit.
std::string safetensors_header_bytes(const std::vector<std::pair<std::string, Tensor>>& tensors,
                                     const std::map<std::string, std::string>& metadata = {});

// What a streamed write announces in the header before the tensor exists.
struct TensorSpec {
  std::string name;
  Shape shape;
  DType dtype;
  uint64_t nbytes() const { return static_cast<uint64_t>(shape_nbytes(shape, dtype)); }
};
std::string safetensors_header_bytes(const std::vector<TensorSpec>& tensors,
                                     const std::map<std::string, std::string>& metadata = {});
// Tensor i of a streamed write, made when the file gets to it (then released): host memory
// holds one tensor at a time, not the list.
using TensorProducer = std::function<Tensor(size_t)>;

// Hugging Face sharded layout in `dir` (created if missing). Tensors are packed greedily in the
// given order: a new shard starts when adding the next tensor would push the current shard's
// data past max_shard_bytes (a tensor larger than the limit gets a shard of its own). With one
// shard the result is DIR/model.safetensors and no index. Every shard carries `metadata`; the
// index carries {"total_size": n}. Each file is written atomically, shards before the index;
// the files of the other layout and stale "model-*-of-*.safetensors" shards are removed after.
void write_sharded_safetensors(const std::string& dir,
                               const std::vector<std::pair<std::string, Tensor>>& tensors,
                               uint64_t max_shard_bytes,
                               const std::map<std::string, std::string>& metadata = {});
// The same from specs and a producer (the same bytes as the tensor list would give): tensor i
// is asked for once, in order, and must match specs[i]'s dtype and shape.
void write_sharded_safetensors(const std::string& dir, const std::vector<TensorSpec>& specs,
                               const TensorProducer& produce, uint64_t max_shard_bytes,
                               const std::map<std::string, std::string>& metadata = {});

// DIR/model.safetensors or DIR/model.safetensors.index.json (+ its shards) as one name space.
// Opening validates the index (a JSON object with a "weight_map" object of name -> plain file
// name), every shard it names (which must exist and pass the reader's checks), and that every
// listed tensor is in the shard the index names and every shard tensor is listed. Having both
// files in one directory is an error (ambiguous).
class SafetensorsDir {
 public:
  explicit SafetensorsDir(const std::string& dir);

  // Shard by shard (in file-name order), each in data order.
  std::vector<std::string> names() const { return names_; }
  bool has(const std::string& name) const { return where_.count(name) != 0; }
  const SafetensorsEntry& entry(const std::string& name) const;
  Tensor read(const std::string& name, MemCategory cat = MemCategory::other) const;
  Tensor read_as(const std::string& name, DType as, MemCategory cat) const;
  // The "__metadata__" of the single file, or of the first shard.
  const std::map<std::string, std::string>& metadata() const;
  // The files opened (one for the single layout).
  std::vector<std::string> files() const;
  bool sharded() const { return sharded_; }

 private:
  const SafetensorsReader& reader_of(const std::string& name) const;

  std::string dir_;
  bool sharded_ = false;
  std::vector<SafetensorsReader> readers_;
  std::unordered_map<std::string, size_t> where_;  // name -> index into readers_
  std::vector<std::string> names_;
};

}  // namespace bb
