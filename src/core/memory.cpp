#include "core/memory.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <unistd.h>
#include <vector>

#include "core/error.h"

#ifdef BB_WITH_CUDA
namespace bb {
Allocator& cuda_allocator(int device_index);  // backend/cuda/runtime.cu
}
#endif

namespace bb {

namespace {
constexpr const char* kCategoryNames[kNumMemCategories] = {
    "params", "grads", "optimizer", "activations", "logits", "moe", "comm", "workspace", "other"};

class CpuAllocator final : public Allocator {
 public:
  Device device() const override { return Device::cpu(); }

 protected:
  void* raw_allocate(size_t bytes, int) override {
    if (bytes == 0) return nullptr;
    // More than the machine has cannot succeed (and a sanitizer's allocator aborts on it).
    static const int64_t kPhysical = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE);
    BB_CHECK(kPhysical <= 0 || static_cast<int64_t>(bytes) <= kPhysical, "out of host memory allocating ",
             format_bytes(static_cast<int64_t>(bytes)), ": more than this machine's ", format_bytes(kPhysical));
    // 64-byte alignment keeps vector loads and OpenBLAS happy.
    size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    BB_CHECK(p != nullptr, "out of host memory allocating ", format_bytes(bytes));
    return p;
  }
  void raw_deallocate(void* p, size_t, int, uint32_t) override { std::free(p); }
};
}  // namespace

const char* category_name(MemCategory c) { return kCategoryNames[static_cast<int>(c)]; }

MemCategory category_from_name(const std::string& name) {
  for (int i = 0; i < kNumMemCategories; ++i)
    if (name == kCategoryNames[i]) return static_cast<MemCategory>(i);
  BB_FAIL("unknown memory category '", name,
          "': expected params, grads, optimizer, activations, logits, moe, comm, workspace or other");
}

std::string Device::str() const {
  if (kind == Kind::cpu) return "cpu";
  return "cuda:" + std::to_string(index);
}

Device Device::parse(const std::string& s) {
  if (s == "cpu") return cpu();
  if (s == "cuda" || s == "gpu") return cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    const std::string idx = s.substr(5);
    BB_CHECK(!idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos,
             "bad device '", s, "': expected cpu, cuda or cuda:N");
    return cuda(std::stoi(idx));
  }
  BB_FAIL("bad device '", s, "': expected cpu, cuda or cuda:N");
}

void* Allocator::allocate(size_t bytes, MemCategory cat, int stream) {
  void* p = nullptr;
  try {
    p = raw_allocate(bytes, stream);
  } catch (const Error& e) {
    // Out of memory: the message says where the memory is (the log may have no line yet).
    const MemoryStats s = stats();
    std::vector<int> order;
    for (int c = 0; c < kNumMemCategories; ++c)
      if (s.live[static_cast<size_t>(c)] > 0) order.push_back(c);
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return s.live[static_cast<size_t>(a)] > s.live[static_cast<size_t>(b)]; });
    std::string largest;
    for (size_t i = 0; i < order.size() && i < 4; ++i)
      largest += std::string(i ? ", " : "") + kCategoryNames[order[i]] + " " + format_bytes(s.live[static_cast<size_t>(order[i])]);
    throw Error(std::string(e.what()) + "; the allocation was for " + kCategoryNames[static_cast<int>(cat)] +
                "; live now " + format_bytes(s.live_total) + (largest.empty() ? "" : " (" + largest + ")") +
                ", peak since the step began " + format_bytes(s.peak_total) + ", held by the allocator " +
                format_bytes(s.reserved_peak));
  }
  std::lock_guard<std::mutex> lock(mu_);
  const int c = static_cast<int>(cat);
  stats_.live[c] += static_cast<int64_t>(bytes);
  stats_.live_total += static_cast<int64_t>(bytes);
  if (stats_.live[c] > stats_.peak[c]) stats_.peak[c] = stats_.live[c];
  if (stats_.live_total > stats_.peak_total) stats_.peak_total = stats_.live_total;
  return p;
}

void Allocator::deallocate(void* p, size_t bytes, MemCategory cat, int stream,
                           uint32_t used_streams) {
  raw_deallocate(p, bytes, stream, used_streams);
  std::lock_guard<std::mutex> lock(mu_);
  const int c = static_cast<int>(cat);
  stats_.live[c] -= static_cast<int64_t>(bytes);
  stats_.live_total -= static_cast<int64_t>(bytes);
}

MemoryStats Allocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  MemoryStats s = stats_;
  s.reserved_peak = reserved_peak();
  if (s.reserved_peak == 0) s.reserved_peak = s.peak_total;  // CPU: what we hold is what we asked
  return s;
}

void Allocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak = stats_.live;
  stats_.peak_total = stats_.live_total;
}

Allocator& allocator_for(Device d) {
  if (d.is_cpu()) {
    static CpuAllocator cpu;
    return cpu;
  }
#ifdef BB_WITH_CUDA
  return cuda_allocator(d.index);
#else
  BB_FAIL("device ", d.str(), " requested but this build has no CUDA backend (configure with -DBUMBLEBEE_CUDA=ON on a machine with the CUDA toolkit)");
#endif
}

std::string format_bytes(int64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (bytes < 0) {
    std::string pos = format_bytes(-bytes);
    pos.insert(pos.begin(), '-');
    return pos;
  }
  if (b >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024) std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1024.0 * 1024));
  else if (b >= 1024.0) std::snprintf(buf, sizeof buf, "%.2f KiB", b / 1024.0);
  else std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  return buf;
}

}  // namespace bb
