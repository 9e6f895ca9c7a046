// memory.h — device-tagged allocation with per-category accounting.
//
// Every allocation names a category (DESIGN.md sec. 5). Each device has one Allocator, which
// keeps live and peak bytes per category and in total; `reset_peak()` starts a new window
// (for example one training step). The estimator predicts these same numbers.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace bb {

enum class MemCategory : uint8_t {
  params,
  grads,
  optimizer,
  activations,
  logits,
  moe,
  comm,
  workspace,
  other,
};
constexpr int kNumMemCategories = 9;

const char* category_name(MemCategory c);
// Parses a category name; throws bb::Error naming the valid ones.
MemCategory category_from_name(const std::string& name);

struct Device {
  enum class Kind : uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  static Device cpu() { return {Kind::cpu, 0}; }
  static Device cuda(int i = 0) { return {Kind::cuda, i}; }
  bool is_cpu() const { return kind == Kind::cpu; }
  bool is_cuda() const { return kind == Kind::cuda; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;
  // Parses "cpu", "cuda", "cuda:N".
  static Device parse(const std::string& s);
};

// A snapshot of the accounting of one device.
struct MemoryStats {
  std::array<int64_t, kNumMemCategories> live{};
  std::array<int64_t, kNumMemCategories> peak{};
  int64_t live_total = 0;
  int64_t peak_total = 0;
  // What the underlying allocator itself holds at most (for CUDA: the pool's reserved high-water
  // mark since the process started; the pool never gives memory back, so that is what it holds
  // now). reset_peak() does not reset it.
  int64_t reserved_peak = 0;

  int64_t live_of(MemCategory c) const { return live[static_cast<int>(c)]; }
  int64_t peak_of(MemCategory c) const { return peak[static_cast<int>(c)]; }
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  // Returns memory for `bytes` (may be 0, then a valid unique pointer or nullptr), ordered on
  // stream `stream` (an index of core/stream.h's Stream; the CPU ignores it).
  void* allocate(size_t bytes, MemCategory cat, int stream);
  // Gives memory back. `stream` is the stream it was allocated on; `used_streams` a bit mask of
  // every stream that used it (core/stream.h stream_bit): the memory is not handed out again
  // before each of them has passed the work it has queued so far.
  void deallocate(void* p, size_t bytes, MemCategory cat, int stream, uint32_t used_streams);

  MemoryStats stats() const;
  // Starts a new peak window: peaks are set to current live values (reserved_peak stays: see
  // MemoryStats).
  void reset_peak();

 protected:
  virtual void* raw_allocate(size_t bytes, int stream) = 0;
  virtual void raw_deallocate(void* p, size_t bytes, int stream, uint32_t used_streams) = 0;
  virtual int64_t reserved_peak() const { return 0; }

 private:
  mutable std::mutex mu_;
  MemoryStats stats_;
};

// The process-wide allocator of a device (created on first use).
Allocator& allocator_for(Device d);

// Human-readable byte count: "1.50 GiB".
std::string format_bytes(int64_t bytes);

}  // namespace bb
