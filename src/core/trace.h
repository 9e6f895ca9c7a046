// trace.h — named ranges for profiler timelines (NVTX on CUDA builds; nothing otherwise).
//
// BB_RANGE("attention_forward") opens a range that closes at the end of the enclosing scope,
// so an Nsight timeline reads like the model: layer -> primitive. NVTX v3 is header-only and
// costs a branch when no profiler is attached.
#pragma once

#ifdef BB_WITH_CUDA
#include <nvtx3/nvToolsExt.h>

namespace bb {
class TraceRange {
 public:
  explicit TraceRange(const char* name) { nvtxRangePushA(name); }
  ~TraceRange() { nvtxRangePop(); }
  TraceRange(const TraceRange&) = delete;
  TraceRange& operator=(const TraceRange&) = delete;
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
