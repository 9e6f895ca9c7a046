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
  int64_t parent = -1;  // the range open on this thread when this one opened (-1: none)
};

// The innermost open range of this thread in the current session (index into g_recs).
thread_local int64_t t_open = -1;
thread_local int64_t t_open_session = -1;

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
  // Events for a whole training step up front: creating them inside the profiled step costs the
  // host microseconds each, enough to starve the GPU and inflate every range.
  constexpr size_t kPool = 16384;
  while (g_pool.size() < kPool) {
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) break;
    g_pool.push_back(e);
  }
  ++g_session;
  g_on = true;
}

int64_t range_begin(const char* name) {
  std::lock_guard<std::mutex> lock(g_mu);
  Rec r;
  r.name = name;
  r.a = take_event();
  if (t_open_session != g_session) {
    t_open_session = g_session;
    t_open = -1;
  }
  r.parent = t_open;
  cudaEventRecord(r.a, cuda::stream());
  g_recs.push_back(r);
  t_open = static_cast<int64_t>(g_recs.size() - 1);
  return (g_session << 32) | t_open;
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
  if (t_open_session == g_session && t_open == idx) t_open = g_recs[idx].parent;
}

std::vector<RangeTotal> profile_report(FILE* out, double total_ms) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_on = false;
  cudaDeviceSynchronize();
  std::vector<double> ms(g_recs.size(), -1.0), child(g_recs.size(), 0.0);
  for (size_t i = 0; i < g_recs.size(); ++i) {
    const Rec& r = g_recs[i];
    if (!r.b) continue;  // still open
    float m = 0;
    if (cudaEventElapsedTime(&m, r.a, r.b) != cudaSuccess) continue;
    ms[i] = m;
    if (r.parent >= 0) child[static_cast<size_t>(r.parent)] += m;
  }
  std::map<std::string, RangeTotal> sums;
  for (size_t i = 0; i < g_recs.size(); ++i) {
    if (ms[i] < 0) continue;
    RangeTotal& t = sums[g_recs[i].name];
    t.name = g_recs[i].name;
    ++t.calls;
    t.inclusive_ms += ms[i];
    t.exclusive_ms += std::max(0.0, ms[i] - child[i]);
  }
  recycle_locked();
  std::vector<RangeTotal> rows;
  for (auto& [name, t] : sums) rows.push_back(t);
  std::sort(rows.begin(), rows.end(), [](const RangeTotal& x, const RangeTotal& y) { return x.inclusive_ms > y.inclusive_ms; });
  if (!out) return rows;
  const double ref = total_ms > 0 ? total_ms : (rows.empty() ? 1.0 : rows.front().inclusive_ms);
  std::fprintf(out, "%-34s | %7s | %10s | %7s | %12s\n", "range (inclusive of nested ranges)", "calls",
               "GPU ms", "%", "exclusive ms");
  for (const RangeTotal& t : rows)
    std::fprintf(out, "%-34s | %7lld | %10.2f | %6.1f%% | %12.2f\n", t.name.c_str(), static_cast<long long>(t.calls),
                 t.inclusive_ms, 100.0 * t.inclusive_ms / ref, t.exclusive_ms);
  return rows;
}

}  // namespace bb::trace
