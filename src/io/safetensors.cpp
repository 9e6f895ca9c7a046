// safetensors.cpp — header parsing/validation, tensor reads, atomic (sharded) writes.
#include "io/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <future>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <unordered_set>

#include "core/error.h"
#include "io/fs.h"
#include "io/json_limits.h"

namespace bb {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian data; a big-endian host would need byte swaps");

namespace {

using ojson = nlohmann::ordered_json;

struct DTypeName {
  DType dt;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::f32, "F32"}, {DType::bf16, "BF16"}, {DType::f16, "F16"},     {DType::i32, "I32"},
    {DType::i64, "I64"}, {DType::u8, "U8"},     {DType::boolean, "BOOL"}, {DType::i16, "I16"},
};

bool parse_dtype(const std::string& s, DType* out) {
  for (const auto& d : kDTypeNames) {
    if (s == d.name) {
      *out = d.dt;
      return true;
    }
  }
  return false;
}

// RAII file descriptor for reads.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

// Reads exactly `bytes` at `offset`; returns how many bytes were available (< bytes at EOF).
uint64_t pread_full(int fd, void* dst, uint64_t bytes, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < bytes) {
    const uint64_t chunk = std::min<uint64_t>(bytes - done, uint64_t{1} << 30);
    ssize_t n = ::pread(fd, p + done, chunk, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    BB_CHECK(n >= 0, "safetensors ", path, ": read failed: ", std::strerror(errno));
    if (n == 0) break;
    done += static_cast<uint64_t>(n);
  }
  return done;
}

// The JSON dump of a string (quoted, escaped); names that are not valid UTF-8 are rejected
// because the header must be valid JSON text.
std::string json_quote(const std::string& s, const char* what) {
  try {
    return nlohmann::json(s).dump();
  } catch (const nlohmann::json::exception&) {
    BB_FAIL("write_safetensors: ", what, " is not valid UTF-8");
  }
}

std::string u64_le(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

void check_tensor_list(const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const char* op) {
  std::unordered_set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    BB_CHECK(!name.empty(), op, ": tensor names must be non-empty");
    BB_CHECK(name != "__metadata__", op, ": '__metadata__' is reserved and cannot name a tensor");
    BB_CHECK(seen.insert(name).second, op, ": duplicate tensor name '", name, "'");
    BB_CHECK(t.defined(), op, ": tensor '", name, "' is undefined");
  }
}

}  // namespace

const char* safetensors_dtype_name(DType dt) {
  for (const auto& d : kDTypeNames)
    if (d.dt == dt) return d.name;
  BB_FAIL("safetensors: no safetensors name for dtype ", dtype_name(dt));
}

std::string safetensors_shard_name(int i, int n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05d-of-%05d.safetensors", i, n);
  return buf;
}

// ---- reader ----------------------------------------------------------------------------------

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  const std::string where = "safetensors " + path;
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  BB_CHECK(f.fd >= 0, where, ": cannot open: ", std::strerror(errno));
  BB_CHECK(!is_directory(path), where, ": is a directory, not a safetensors file");
  const uint64_t file_bytes = file_size(path);
  BB_CHECK(file_bytes >= 8, where, ": file is shorter than 8 bytes (", file_bytes,
           " bytes): truncated or not a safetensors file");

  unsigned char len_bytes[8];
  BB_CHECK(pread_full(f.fd, len_bytes, 8, 0, path) == 8, where, ": cannot read the header length");
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  BB_CHECK(header_len <= kSafetensorsMaxHeaderBytes, where, ": header length ", header_len,
           " is absurd (limit ", kSafetensorsMaxHeaderBytes,
           "): corrupt or not a safetensors file");
  BB_CHECK(header_len <= file_bytes - 8, where, ": header length ", header_len,
           " exceeds the file size (", file_bytes, " bytes; truncated file?)");
  data_start_ = 8 + header_len;
  data_bytes_ = file_bytes - data_start_;

  std::string text(header_len, '\0');
  BB_CHECK(pread_full(f.fd, text.data(), header_len, 8, path) == header_len, where,
           ": short read of the header (file changed while opening?)");

  // Duplicate keys are legal JSON for nlohmann (the last one wins) but would silently drop a
  // tensor, so every object's keys are tracked while parsing. A valid header nests 3 levels
  // (header, entry, shape); deeper than kMaxJsonDepth is refused while parsing, before the
  // tree (and the key sets) of a hostile header grow.
  std::vector<std::unordered_set<std::string>> open_objects;
  std::string duplicate;
  bool too_deep = false;
  ojson::parser_callback_t cb = [&](int depth, ojson::parse_event_t ev, ojson& parsed) {
    using E = ojson::parse_event_t;
    if ((ev == E::object_start || ev == E::array_start) && depth > kMaxJsonDepth) {
      too_deep = true;
      throw std::runtime_error("nesting too deep");
    }
    if (ev == E::object_start) {
      open_objects.emplace_back();
    } else if (ev == E::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (ev == E::key && !open_objects.empty() && parsed.is_string()) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!open_objects.back().insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  ojson header;
  try {
    header = ojson::parse(text, cb);
  } catch (const nlohmann::json::exception& e) {
    BB_FAIL(where, ": header is not valid JSON: ", e.what());
  } catch (const std::runtime_error&) {
    if (too_deep) BB_FAIL(where, ": header JSON is nested deeper than ", kMaxJsonDepth, " levels");
    throw;
  }
  BB_CHECK(header.is_object(), where, ": header is not a JSON object (got ", header.type_name(),
           ")");
  BB_CHECK(duplicate.empty(), where, ": duplicate key '", duplicate, "' in the header");

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const ojson& v = it.value();
    if (name == "__metadata__") {
      BB_CHECK(v.is_object(), where, ": __metadata__ is not an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        BB_CHECK(m.value().is_string(), where, ": __metadata__ value of '", m.key(),
                 "' is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string tw = where + ": tensor '" + name + "'";
    BB_CHECK(!name.empty(), where, ": a tensor has an empty name");
    BB_CHECK(v.is_object(), tw, ": entry is not an object");
    BB_CHECK(v.contains("dtype"), tw, ": missing 'dtype'");
    BB_CHECK(v.contains("shape"), tw, ": missing 'shape'");
    BB_CHECK(v.contains("data_offsets"), tw, ": missing 'data_offsets'");
    const ojson& jd = v["dtype"];
    const ojson& js = v["shape"];
    const ojson& jo = v["data_offsets"];
    BB_CHECK(jd.is_string(), tw, ": 'dtype' is not a string");
    BB_CHECK(js.is_array(), tw, ": 'shape' is not an array");
    BB_CHECK(jo.is_array() && jo.size() == 2, tw,
             ": 'data_offsets' is not an array of two integers");

    SafetensorsEntry e;
    e.name = name;
    const std::string dts = jd.get<std::string>();
    BB_CHECK(parse_dtype(dts, &e.dtype), where, ": unsupported dtype ", dts, " for tensor '", name,
             "' (supported: F32, BF16, F16, I32, I64, U8, BOOL)");
    // numel is accumulated with overflow checks: a hostile shape must not wrap into a
    // plausible byte count.
    uint64_t numel = 1;
    bool overflow = false, zero_dim = false;
    for (const ojson& d : js) {
      BB_CHECK(d.is_number_unsigned(), tw, ": shape ", js.dump(),
               " must hold non-negative integers");
      const uint64_t dim = d.get<uint64_t>();
      BB_CHECK(dim <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), tw,
               ": dimension ", dim, " is too large");
      e.shape.push_back(static_cast<int64_t>(dim));
      zero_dim = zero_dim || dim == 0;
      if (__builtin_mul_overflow(numel, dim, &numel)) overflow = true;
    }
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(e.dtype)), &nbytes))
      overflow = true;
    if (zero_dim) {  // a zero dim makes any other dims harmless
      overflow = false;
      nbytes = 0;
    }
    BB_CHECK(!overflow, tw, ": shape ", js.dump(), " has too many elements");
    for (const ojson& o : jo)
      BB_CHECK(o.is_number_unsigned(), tw, ": 'data_offsets' ", jo.dump(),
               " must hold two non-negative integers");
    e.begin = jo[0].get<uint64_t>();
    e.end = jo[1].get<uint64_t>();
    BB_CHECK(e.end >= e.begin, tw, ": data_offsets [", e.begin, ", ", e.end, "] end < begin");
    BB_CHECK(e.end - e.begin == nbytes, tw, ": data_offsets [", e.begin, ", ", e.end, "] span ",
             e.end - e.begin, " bytes but ", dts, shape_str(e.shape), " needs ", nbytes, " bytes");
    BB_CHECK(e.end <= data_bytes_, tw, ": data [", e.begin, ", ", e.end,
             ") extends past the end of the file (data region has ", data_bytes_,
             " bytes; truncated file?)");
    entries_.push_back(std::move(e));
  }

  // The data region must be tiled exactly: sorting by (begin, end) and walking once finds
  // overlaps, holes and trailing bytes. An empty tensor sorts before a non-empty one at the same
  // offset; the sort is stable, so empty tensors sharing an offset keep header order.
  std::stable_sort(entries_.begin(), entries_.end(),
                   [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  uint64_t pos = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry& e : entries_) {
    BB_CHECK(e.begin >= pos, where, ": tensor '", e.name, "' [", e.begin, ", ", e.end,
             ") overlaps tensor '", prev ? prev->name : "", "' which ends at ", pos);
    BB_CHECK(e.begin == pos, where, ": hole in the data region: bytes [", pos, ", ", e.begin,
             ") before tensor '", e.name, "' belong to no tensor");
    pos = e.end;
    prev = &e;
  }
  BB_CHECK(pos == data_bytes_, where, ": hole in the data region: trailing bytes [", pos, ", ",
           data_bytes_, ") after the last tensor belong to no tensor");
  for (size_t i = 0; i < entries_.size(); ++i) by_name_[entries_[i].name] = i;
}

const SafetensorsEntry* SafetensorsReader::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

const SafetensorsEntry& SafetensorsReader::entry_or_throw(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  BB_CHECK(e != nullptr, "safetensors ", path_, ": no tensor named '", name, "'");
  return *e;
}

Tensor SafetensorsReader::read(const std::string& name, MemCategory cat) const {
  const SafetensorsEntry& e = entry_or_throw(name);
  Tensor t = Tensor::empty(e.shape, e.dtype, Device::cpu(), cat);
  const uint64_t bytes = e.end - e.begin;
  if (bytes == 0) return t;
  Fd f(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  BB_CHECK(f.fd >= 0, "safetensors ", path_, ": cannot open: ", std::strerror(errno));
  const uint64_t got = pread_full(f.fd, t.raw(), bytes, data_start_ + e.begin, path_);
  BB_CHECK(got == bytes, "safetensors ", path_, ": tensor '", name, "': read ", got, " of ", bytes,
           " bytes (file truncated after it was opened?)");
  return t;
}

Tensor SafetensorsReader::read_as(const std::string& name, DType as, MemCategory cat) const {
  const SafetensorsEntry& e = entry_or_throw(name);
  if (e.dtype == as) return read(name, cat);
  BB_CHECK(is_floating(e.dtype) && is_floating(as), "safetensors ", path_, ": tensor '", name,
           "': cannot convert ", dtype_name(e.dtype), " to ", dtype_name(as),
           " (read_as converts between float types only)");
  return read(name, MemCategory::workspace).to_dtype(as, cat);
}

// ---- writer ----------------------------------------------------------------------------------

std::vector<TensorSpec> tensor_specs(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  check_tensor_list(tensors, "write_safetensors");
  std::vector<TensorSpec> out;
  out.reserve(tensors.size());
  for (const auto& [name, t] : tensors) out.push_back({name, t.shape(), t.dtype()});
  return out;
}

std::string safetensors_header_bytes(const std::vector<std::pair<std::string, Tensor>>& tensors,
                                     const std::map<std::string, std::string>& metadata) {
  return safetensors_header_bytes(tensor_specs(tensors), metadata);
}

std::string safetensors_header_bytes(const std::vector<TensorSpec>& tensors,
                                     const std::map<std::string, std::string>& metadata) {
  // Written by hand rather than through nlohmann so the key order is the reference writer's
  // (metadata first, tensors in data order, dtype/shape/data_offsets); readers do not care,
  // but byte-identical output makes files comparable.
  std::string json = "{";
  bool first = true;
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    bool mfirst = true;
    for (const auto& [k, v] : metadata) {
      if (!mfirst) json += ",";
      json += json_quote(k, "a metadata key") + ":" + json_quote(v, "a metadata value");
      mfirst = false;
    }
    json += "}";
    first = false;
  }
  uint64_t offset = 0;
  for (const TensorSpec& t : tensors) {
    if (!first) json += ",";
    first = false;
    json += json_quote(t.name, "a tensor name");
    json += ":{\"dtype\":\"";
    json += safetensors_dtype_name(t.dtype);
    json += "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i) json += ',';
      json += std::to_string(t.shape[i]);
    }
    const uint64_t end = offset + t.nbytes();
    json += "],\"data_offsets\":[";
    json += std::to_string(offset);
    json += ',';
    json += std::to_string(end);
    json += "]}";
    offset = end;
  }
  json += "}";
  // Padding with spaces (valid JSON whitespace) puts the data at an 8-byte boundary, so a
  // reader that maps the file can view every tensor in place.
  while (json.size() % 8 != 0) json += ' ';
  BB_CHECK(json.size() <= kSafetensorsMaxHeaderBytes, "write_safetensors: header of ",
           json.size(), " bytes exceeds the format limit of ", kSafetensorsMaxHeaderBytes);
  return u64_le(json.size()) + json;
}

uint64_t checksum64(const void* data, size_t bytes) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;  // odd: multiplying by it is a bijection
  auto step = [](uint64_t h, uint64_t w) {
    h = (h ^ w) * kMul;
    return h ^ (h >> 29);  // a xorshift is a bijection too
  };
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t lane[4] = {1, 2, 3, 4};
  size_t i = 0;
  for (; i + 32 <= bytes; i += 32)
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      lane[k] = step(lane[k], w);
    }
  uint64_t h = step(step(step(step(bytes, lane[0]), lane[1]), lane[2]), lane[3]);
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = step(h, w);
  }
  if (i < bytes) {
    uint64_t w = 0;
    std::memcpy(&w, p + i, bytes - i);
    h = step(h, w ^ (uint64_t{1} << 63));
  }
  return step(h, bytes);
}

std::string checksum_key(const std::string& tensor_name) { return kChecksumKeyPrefix + tensor_name; }

namespace {
std::string hex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}
}  // namespace

void write_safetensors_with_checksums(const std::string& path,
                                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                                      const std::map<std::string, std::string>& metadata) {
  std::map<std::string, std::string> meta = metadata;
  for (const auto& [name, t] : tensors) meta[checksum_key(name)] = hex16(0);  // same width as the real ones
  const std::string placeholder = safetensors_header_bytes(tensors, meta);
  atomic_write(path, [&](FileWriter& w) {
    w.write(placeholder);
    for (const auto& [name, t] : tensors) {
      if (t.nbytes() == 0) {
        meta[checksum_key(name)] = hex16(checksum64(nullptr, 0));
        continue;
      }
      Tensor host = t.device().is_cpu() ? t : t.to(Device::cpu(), MemCategory::workspace);
      meta[checksum_key(name)] = hex16(checksum64(host.raw(), host.nbytes()));
      w.write(host.raw(), host.nbytes());
    }
    const std::string header = safetensors_header_bytes(tensors, meta);
    BB_CHECK(header.size() == placeholder.size(), "write_safetensors ", path, ": the checksummed header changed size");
    w.write_at(0, header.data(), header.size());
  });
}

bool verify_checksum(const std::map<std::string, std::string>& metadata, const std::string& file,
                     const std::string& name, const Tensor& t) {
  auto it = metadata.find(checksum_key(name));
  if (it == metadata.end()) return false;
  BB_CHECK(t.device().is_cpu(), "verify_checksum: ", name, " must be a host tensor");
  const std::string got = hex16(checksum64(t.raw(), t.nbytes()));
  BB_CHECK(got == it->second, file, ": tensor '", name, "' fails its checksum (stored ", it->second.substr(0, 32),
           ", computed ", got, "): the file is corrupt (a changed byte, a torn or partial write). Resume from an "
           "earlier checkpoint");
  return true;
}

namespace {

// Tensors [first, first + specs.size()) of a producer into one file: the header from the specs,
// then each tensor as the producer makes it (checked against its spec), one at a time.
void write_streamed(const std::string& path, const std::vector<TensorSpec>& specs, size_t first,
                    const TensorProducer& produce, const std::map<std::string, std::string>& metadata) {
  const std::string header = safetensors_header_bytes(specs, metadata);
  atomic_write(path, [&](FileWriter& w) {
    w.write(header);
    // Tensor i is written by a thread of its own while this one produces tensor i + 1 (the
    // producer's reads, slicing and conversion overlap the file system's copy): host memory
    // holds two tensors. The producer stays on this thread (it may use the GPU).
    std::future<void> writing;  // its task holds the tensor being written
    auto wait = [&] {
      if (writing.valid()) writing.get();
    };
    try {
      for (size_t i = 0; i < specs.size(); ++i) {
        if (specs[i].nbytes() == 0) continue;
        Tensor t = produce(first + i);
        if (!t.defined() || t.dtype() != specs[i].dtype || t.shape() != specs[i].shape) {
          std::string dims;
          for (int64_t d : specs[i].shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
          BB_FAIL("write_safetensors ", path, ": tensor '", specs[i].name, "' was announced as ",
                  dtype_name(specs[i].dtype), "[", dims, "] and came as ", t.defined() ? t.str() : std::string("undefined"));
        }
        if (!t.device().is_cpu()) t = t.to(Device::cpu(), MemCategory::workspace);
        wait();
        writing = std::async(std::launch::async, [&w, t] { w.write(t.raw(), t.nbytes()); });
      }
      wait();
    } catch (...) {
      // The file is abandoned (atomic_write removes it); a write still running finishes first.
      if (writing.valid()) writing.wait();
      throw;
    }
  });
}

}  // namespace

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  write_streamed(path, tensor_specs(tensors), 0, [&](size_t i) { return tensors[i].second; }, metadata);
}

void write_sharded_safetensors(const std::string& dir,
                               const std::vector<std::pair<std::string, Tensor>>& tensors,
                               uint64_t max_shard_bytes,
                               const std::map<std::string, std::string>& metadata) {
  check_tensor_list(tensors, "write_sharded_safetensors");
  write_sharded_safetensors(dir, tensor_specs(tensors), [&](size_t i) { return tensors[i].second; }, max_shard_bytes,
                            metadata);
}

void write_sharded_safetensors(const std::string& dir, const std::vector<TensorSpec>& specs,
                               const TensorProducer& produce, uint64_t max_shard_bytes,
                               const std::map<std::string, std::string>& metadata) {
  BB_CHECK(max_shard_bytes > 0, "write_sharded_safetensors ", dir, ": max_shard_bytes must be > 0");
  {
    std::unordered_set<std::string> seen;
    for (const TensorSpec& t : specs) {
      BB_CHECK(!t.name.empty() && t.name != "__metadata__", "write_sharded_safetensors ", dir, ": bad tensor name '",
               t.name, "'");
      BB_CHECK(seen.insert(t.name).second, "write_sharded_safetensors ", dir, ": duplicate tensor name '", t.name, "'");
    }
  }
  // Shards as runs of consecutive tensors: [starts[i], starts[i + 1]).
  std::vector<size_t> starts = {0};
  uint64_t shard_bytes = 0, total = 0;
  for (size_t k = 0; k < specs.size(); ++k) {
    const uint64_t b = specs[k].nbytes();
    if (k > starts.back() && shard_bytes + b > max_shard_bytes) {
      starts.push_back(k);
      shard_bytes = 0;
    }
    shard_bytes += b;
    total += b;
  }
  starts.push_back(specs.size());
  auto shard_specs = [&](size_t i) {
    return std::vector<TensorSpec>(specs.begin() + static_cast<std::ptrdiff_t>(starts[i]),
                                   specs.begin() + static_cast<std::ptrdiff_t>(starts[i + 1]));
  };

  make_dirs(dir);
  const int n = static_cast<int>(starts.size()) - 1;
  std::set<std::string> keep;
  if (n == 1) {
    write_streamed(path_join(dir, kSafetensorsSingleFile), shard_specs(0), 0, produce, metadata);
    keep.insert(kSafetensorsSingleFile);
  } else {
    nlohmann::json weight_map = nlohmann::json::object();
    for (int i = 0; i < n; ++i) {
      const std::string file = safetensors_shard_name(i + 1, n);
      keep.insert(file);
      for (size_t k = starts[static_cast<size_t>(i)]; k < starts[static_cast<size_t>(i) + 1]; ++k)
        weight_map[specs[k].name] = file;
    }
    // Every shard goes to a pending name first and all are renamed once the last is complete: a
    // producer that fails in a later shard (a non-finite weight) leaves no file of this write,
    // and no earlier directory's shards of the same names replaced by half of a new set.
    std::vector<std::string> pending;
    auto pending_name = [&](int i) { return path_join(dir, "." + safetensors_shard_name(i + 1, n) + ".pending"); };
    try {
      for (int i = 0; i < n; ++i) {
        pending.push_back(pending_name(i));
        write_streamed(pending.back(), shard_specs(static_cast<size_t>(i)), starts[static_cast<size_t>(i)], produce,
                       metadata);
      }
    } catch (...) {
      for (const std::string& f : pending) ::unlink(f.c_str());
      throw;
    }
    for (int i = 0; i < n; ++i) {
      const std::string to = path_join(dir, safetensors_shard_name(i + 1, n));
      BB_CHECK(::rename(pending[static_cast<size_t>(i)].c_str(), to.c_str()) == 0, "write_sharded_safetensors ",
               dir, ": cannot rename ", pending[static_cast<size_t>(i)], " to ", to, ": ", std::strerror(errno));
    }
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    // The index goes last, so it never names a shard that is not completely on disk.
    atomic_write(path_join(dir, kSafetensorsIndexFile), index.dump(2) + "\n");
    keep.insert(kSafetensorsIndexFile);
  }

  // Leftovers of an earlier save in the other layout (or with another shard count) would make
  // the directory ambiguous for SafetensorsDir; only names this writer produces are touched.
  static const std::regex shard_re(R"(model-\d{5,}-of-\d{5,}\.safetensors)");
  std::error_code ec;
  for (const auto& de : std::filesystem::directory_iterator(dir, ec)) {
    const std::string fname = de.path().filename().string();
    const bool ours = fname == kSafetensorsSingleFile || fname == kSafetensorsIndexFile ||
                      std::regex_match(fname, shard_re);
    if (ours && !keep.count(fname)) {
      std::error_code rm;
      std::filesystem::remove(de.path(), rm);
      BB_CHECK(!rm, "write_sharded_safetensors ", dir, ": cannot remove stale ", fname, ": ",
               rm.message());
    }
  }
  BB_CHECK(!ec, "write_sharded_safetensors ", dir, ": cannot list the directory: ", ec.message());
}

// ---- directory -------------------------------------------------------------------------------

SafetensorsDir::SafetensorsDir(const std::string& dir) : dir_(dir) {
  BB_CHECK(is_directory(dir), "safetensors dir ", dir, ": not a directory");
  const std::string single = path_join(dir, kSafetensorsSingleFile);
  const std::string index_path = path_join(dir, kSafetensorsIndexFile);
  const bool has_single = path_exists(single);
  const bool has_index = path_exists(index_path);
  BB_CHECK(!(has_single && has_index), "safetensors dir ", dir, ": holds both ",
           kSafetensorsSingleFile, " and ", kSafetensorsIndexFile,
           " (ambiguous: remove the stale one)");
  BB_CHECK(has_single || has_index, "safetensors dir ", dir, ": neither ", kSafetensorsSingleFile,
           " nor ", kSafetensorsIndexFile, " found");

  if (has_single) {
    readers_.emplace_back(single);
    for (const SafetensorsEntry& e : readers_[0].entries()) {
      where_[e.name] = 0;
      names_.push_back(e.name);
    }
    return;
  }

  sharded_ = true;
  const std::string iw = "safetensors index " + index_path;
  const nlohmann::json index = parse_json_bounded(read_file(index_path), iw);
  BB_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
           iw, ": expected an object with a \"weight_map\" object");
  // weight_map is a std::map here, so shards and names come out sorted by file name.
  std::map<std::string, std::vector<std::string>> by_file;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    BB_CHECK(it.value().is_string(), iw, ": weight_map entry of tensor '", it.key(),
             "' is not a file name string");
    const std::string file = it.value().get<std::string>();
    // A weight_map could otherwise point anywhere on the file system.
    BB_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..",
             iw, ": tensor '", it.key(), "' maps to '", file, "', which is not a plain file name");
    by_file[file].push_back(it.key());
  }
  // Missing shards are reported before any shard is parsed: that is the likelier mistake
  // (an incomplete download or copy) and the message should say so.
  for (const auto& [file, listed] : by_file)
    BB_CHECK(path_exists(path_join(dir, file)), iw, ": shard file ", file, " (holding tensor '",
             listed[0], "') does not exist");
  for (const auto& [file, listed] : by_file) {
    readers_.emplace_back(path_join(dir, file));
    const SafetensorsReader& r = readers_.back();
    const size_t ri = readers_.size() - 1;
    for (const std::string& name : listed)
      BB_CHECK(r.has(name), iw, ": tensor '", name, "' is listed in shard ", file,
               " but absent from that file");
    std::unordered_set<std::string> listed_set(listed.begin(), listed.end());
    for (const SafetensorsEntry& e : r.entries()) {
      BB_CHECK(listed_set.count(e.name), iw, ": shard ", file, " holds tensor '", e.name,
               "' that the index does not map to it");
      where_[e.name] = ri;
      names_.push_back(e.name);
    }
  }
}

const SafetensorsReader& SafetensorsDir::reader_of(const std::string& name) const {
  auto it = where_.find(name);
  BB_CHECK(it != where_.end(), "safetensors dir ", dir_, ": no tensor named '", name, "'");
  return readers_[it->second];
}

const SafetensorsEntry& SafetensorsDir::entry(const std::string& name) const {
  return *reader_of(name).find(name);
}

Tensor SafetensorsDir::read(const std::string& name, MemCategory cat) const {
  return reader_of(name).read(name, cat);
}

Tensor SafetensorsDir::read_as(const std::string& name, DType as, MemCategory cat) const {
  return reader_of(name).read_as(name, as, cat);
}

const std::map<std::string, std::string>& SafetensorsDir::metadata() const {
  static const std::map<std::string, std::string> kEmpty;
  return readers_.empty() ? kEmpty : readers_[0].metadata();
}

std::vector<std::string> SafetensorsDir::files() const {
  std::vector<std::string> out;
  for (const auto& r : readers_) out.push_back(r.path());
  return out;
}

}  // namespace bb
