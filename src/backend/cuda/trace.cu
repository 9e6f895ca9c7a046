// trace.cu — the built-in range profiler of core/trace.h: CUDA events recorded on the
// compute stream at each BB_RANGE's open and close while profiling; summed per name at report
// time. Events are pooled and reused across sessions.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "backend/cuda/check.cuh"
#include "core/error.h"
#include "core/trace.h"

namespace bb::trace {
namespace {

struct Rec {
  const char* name;
  cudaEvent_t a = nullptr, b = nullptr;
};

std::atomic<bool> g_on{false};
int64_t g_session = 0;            // bumped by profile_begin; the high bits of a range id
std::mutex g_mu;
std::vector<Rec> g_recs;         // this session's ranges, in open order
std::vector<cudaEvent_t> g_pool;  // events of earlier sessions, for reuse

cudaEvent_t take_event() {
  if (!g_pool.empty()) {
    cudaEvent_t e = g_pool.back();
    g_pool.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  if (cudaEventCreate(&e) != cudaSuccess) BB_FAIL("profiler: cudaEventCreate failed");
  return e;
}

void recycle_locked() {
  for (Rec& r : g_recs) {
    if (r.a) g_pool.push_back(r.a);
    if (r.b) g_pool.push_back(r.b);
  }
  g_recs.clear();
}

}  // namespace

bool profiling() { return g_on.load(std::memory_order_relaxed); }

void profile_begin() {
  std::lock_guard<std::mutex> lock(g_mu);
  recycle_locked();
  ++g_session;
  g_on = true;
}

int64_t range_begin(const char* name) {
  std::lock_guard<std::mutex> lock(g_mu);
  Rec r;
  r.name = name;
  r.a = take_event();
  cudaEventRecord(r.a, cuda::stream());
  g_recs.push_back(r);
  return (g_session << 32) | static_cast<int64_t>(g_recs.size() - 1);
}

void range_end(int64_t id) noexcept {
  std::lock_guard<std::mutex> lock(g_mu);
  const int64_t idx = id & 0xffffffff;
  // A range opened in an earlier session (or before this one) is not recorded.
  if (id < 0 || (id >> 32) != g_session || idx >= static_cast<int64_t>(g_recs.size())) return;
  cudaEvent_t e = nullptr;
  if (!g_pool.empty()) {
    e = g_pool.back();
    g_pool.pop_back();
  } else if (cudaEventCreate(&e) != cudaSuccess) {
    return;  // a destructor must not throw: the range is simply not timed
  }
  g_recs[idx].b = e;
  cudaEventRecord(e, cuda::stream());
}

void profile_report(FILE* out, double total_ms) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_on = false;
  cudaDeviceSynchronize();
  struct Sum {
    int64_t calls = 0;
    double ms = 0;
  };
  std::map<std::string, Sum> sums;
  for (const Rec& r : g_recs) {
    if (!r.b) continue;  // still open
    float ms = 0;
    if (cudaEventElapsedTime(&ms, r.a, r.b) != cudaSuccess) continue;
    Sum& s = sums[r.name];
    ++s.calls;
    s.ms += ms;
  }
  recycle_locked();
  std::vector<std::pair<std::string, Sum>> rows(sums.begin(), sums.end());
  std::sort(rows.begin(), rows.end(), [](const auto& x, const auto& y) { return x.second.ms > y.second.ms; });
  if (!out) return;
  const double ref = total_ms > 0 ? total_ms : (rows.empty() ? 1.0 : rows.front().second.ms);
  std::fprintf(out, "%-34s | %7s | %10s | %7s\n", "range (inclusive of nested ranges)", "calls",
               "GPU ms", "%");
  for (const auto& [name, s] : rows)
    std::fprintf(out, "%-34s | %7lld | %10.2f | %6.1f%%\n", name.c_str(),
                 static_cast<long long>(s.calls), s.ms, 100.0 * s.ms / ref);
}

}  // namespace bb::trace
