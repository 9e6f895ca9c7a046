// trace.h — named ranges for profiler timelines (NVTX on CUDA builds; nothing otherwise), and a
// small built-in GPU-time profiler over the same ranges for machines without Nsight.
//
// BB_RANGE("attention_forward") opens a range that closes at the end of the enclosing scope,
// so an Nsight timeline reads like the model: layer -> primitive. NVTX v3 is header-only and
// costs a branch when no profiler is attached.
//
// Built-in profiler (CUDA builds): between trace::profile_begin() and trace::profile_report(),
// every BB_RANGE also records a pair of CUDA events on the compute stream; the report sums the
// GPU time between each range's events per name (inclusive of nested ranges) and prints a table.
// It measures the stream's timeline, so gaps where the GPU waits for the host count towards the
// enclosing ranges. Off by default: a range then costs one branch more.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace bb::trace {
// Starts collecting (drops what an earlier session collected).
void profile_begin();
// Stops collecting, waits for the device, prints "name | calls | total ms | % of `total_ms`"
// sorted by total time, to `out` (null: print nothing). total_ms <= 0: percentages of the
// largest range. Returns the totals per name: inclusive (of nested ranges) and exclusive (minus
// the ranges opened inside it on the same thread), in ms.
struct RangeTotal {
  std::string name;
  int64_t calls = 0;
  double inclusive_ms = 0, exclusive_ms = 0;
};
std::vector<RangeTotal> profile_report(FILE* out, double total_ms = 0);
bool profiling();
}  // namespace bb::trace

#ifdef BB_WITH_CUDA
#include <nvtx3/nvToolsExt.h>

namespace bb {
namespace trace {
// An id naming the profiling session and the record; -1 when not profiling.
int64_t range_begin(const char* name);
void range_end(int64_t id) noexcept;
}  // namespace trace

class TraceRange {
 public:
  explicit TraceRange(const char* name) : id_(trace::profiling() ? trace::range_begin(name) : -1) {
    nvtxRangePushA(name);
  }
  ~TraceRange() {
    nvtxRangePop();
    if (id_ >= 0) trace::range_end(id_);
  }
  TraceRange(const TraceRange&) = delete;
  TraceRange& operator=(const TraceRange&) = delete;

 private:
  int64_t id_;
};
}  // namespace bb

#define BB_RANGE_CAT2(a, b) a##b
#define BB_RANGE_CAT(a, b) BB_RANGE_CAT2(a, b)
#define BB_RANGE(name) ::bb::TraceRange BB_RANGE_CAT(bb_trace_range_, __LINE__)(name)
#else
#define BB_RANGE(name) \
  do {                 \
  } while (0)
#endif
