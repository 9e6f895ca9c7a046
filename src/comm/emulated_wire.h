// emulated_wire.h — the device side of the emulated backend (emulated.h): one kernel per
// collective that moves its bytes and holds the stream for the modelled wire time. Host-only
// header; the kernel is in emulated_wire_cuda.cu (CUDA builds).
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/stream.h"

namespace bb::comm::emu {

// The traffic classes; the kernel is instantiated once per class so that a timeline (CUPTI
// records, bench/gpu_activity.h) names the class of every emulated collective.
enum class WireClass : uint8_t { ep = 0, cp = 1, param_gather = 2, grad_reduce = 3, other = 4 };

// One piece of an output: dst = src (copy), dst = 0 (zero), or dst = factor x src elementwise
// in `dtype` (scale; src may equal dst).
enum class SegOp : uint8_t { copy, zero, scale };
struct Segment {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t bytes = 0;
  SegOp op = SegOp::copy;
  DType dtype = DType::u8;  // scale: the element type
  double factor = 1;        // scale
};

// The same pieces on host memory, at once (CPU tensors).
void run_on_host(const std::vector<Segment>& segs);

#ifdef BB_WITH_CUDA
// On stream `s` of device `dev`: one kernel of `blocks` x 512 threads that starts a clock, waits
// until the copies would end with `seconds`, does them, and waits until `seconds` have passed
// (the copies are estimated at copy_gbps; the wait at the end absorbs the error). With
// seconds = 0 only the copies run (and nothing at all without segments).
void run_on_device(int dev, Stream s, WireClass c, const std::vector<Segment>& segs, double seconds, int blocks);
#endif

}  // namespace bb::comm::emu
