// trace.cpp — the CPU-only build's profiler entry points: there is no device timeline to
// measure, so profiling reports that it is unavailable.
#ifndef BB_WITH_CUDA
#include "core/trace.h"

namespace bb::trace {
void profile_begin() {}
std::vector<RangeTotal> profile_report(FILE* out, double) {
  if (out) std::fprintf(out, "[profile] not available: this build has no CUDA backend\n");
  return {};
}
bool profiling() { return false; }
}  // namespace bb::trace
#endif
