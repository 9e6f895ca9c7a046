// emulated_wire_cuda.cu — the emulated collective's kernel (emulated_wire.h): clock, wait,
// copies, wait. One launch per collective (more only past kMaxSegments pieces).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "backend/cuda/check.cuh"
#include "comm/emulated_wire.h"

namespace bb::comm::emu {
namespace {

constexpr int kThreads = 512;
constexpr int kMaxSegments = 48;  // 48 x 32 bytes of pieces: well inside a launch's parameters
// What the copies are assumed to move per second (bytes read + written) when the wait before
// them is sized; the wait after them makes the total right either way.
constexpr double kCopyBytesPerS = 1.0e12;

struct DevSegment {
  const void* src;
  void* dst;
  int64_t bytes;
  uint8_t op, dtype;
  float factor;
};

struct WireArgs {
  DevSegment seg[kMaxSegments];
  int num;
  long long pre_ns, total_ns;
};

__device__ __forceinline__ unsigned long long clock_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void wait_until(unsigned long long t) {
  while (clock_ns() < t) __nanosleep(500);
}

__device__ void copy_bytes(const DevSegment& s, int64_t tid, int64_t stride) {
  const char* src = static_cast<const char*>(s.src);
  char* dst = static_cast<char*>(s.dst);
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16 == 0) {
    // 16-byte words, four in flight per thread.
    const int64_t words = s.bytes / 16;
    const uint4* a = reinterpret_cast<const uint4*>(src);
    uint4* b = reinterpret_cast<uint4*>(dst);
    int64_t i = tid;
    for (; i + 3 * stride < words; i += 4 * stride) {
      const uint4 w0 = a[i], w1 = a[i + stride], w2 = a[i + 2 * stride], w3 = a[i + 3 * stride];
      b[i] = w0;
      b[i + stride] = w1;
      b[i + 2 * stride] = w2;
      b[i + 3 * stride] = w3;
    }
    for (; i < words; i += stride) b[i] = a[i];
    done = words * 16;
  }
  for (int64_t i = done + tid; i < s.bytes; i += stride) dst[i] = src[i];
}

__device__ void zero_bytes(const DevSegment& s, int64_t tid, int64_t stride) {
  char* dst = static_cast<char*>(s.dst);
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    const int64_t words = s.bytes / 16;
    uint4* b = reinterpret_cast<uint4*>(dst);
    for (int64_t i = tid; i < words; i += stride) b[i] = make_uint4(0, 0, 0, 0);
    done = words * 16;
  }
  for (int64_t i = done + tid; i < s.bytes; i += stride) dst[i] = 0;
}

template <typename T>
__device__ void scale_elems(const DevSegment& s, int64_t tid, int64_t stride) {
  const T* src = static_cast<const T*>(s.src);
  T* dst = static_cast<T*>(s.dst);
  const int64_t n = s.bytes / static_cast<int64_t>(sizeof(T));
  for (int64_t i = tid; i < n; i += stride) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      dst[i] = __float2bfloat16(__bfloat162float(src[i]) * s.factor);
    } else if constexpr (std::is_same_v<T, __half>) {
      dst[i] = __float2half(__half2float(src[i]) * s.factor);
    } else if constexpr (std::is_same_v<T, float>) {
      dst[i] = src[i] * s.factor;
    } else {
      dst[i] = static_cast<T>(src[i] * static_cast<T>(s.factor));
    }
  }
}

// Class is a template argument only so that every class has its own kernel name.
template <int kClass>
__global__ void __launch_bounds__(kThreads) emulated_wire_kernel(const WireArgs a) {
  __shared__ unsigned long long t0;
  if (threadIdx.x == 0) {
    t0 = clock_ns();
    if (a.pre_ns > 0) wait_until(t0 + static_cast<unsigned long long>(a.pre_ns));
  }
  __syncthreads();
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int k = 0; k < a.num; ++k) {
    const DevSegment& s = a.seg[k];
    switch (s.op) {
      case static_cast<uint8_t>(SegOp::copy): copy_bytes(s, tid, stride); break;
      case static_cast<uint8_t>(SegOp::zero): zero_bytes(s, tid, stride); break;
      default:
        switch (static_cast<DType>(s.dtype)) {
          case DType::f32: scale_elems<float>(s, tid, stride); break;
          case DType::bf16: scale_elems<__nv_bfloat16>(s, tid, stride); break;
          case DType::f16: scale_elems<__half>(s, tid, stride); break;
          case DType::i32: scale_elems<int32_t>(s, tid, stride); break;
          case DType::i64: scale_elems<int64_t>(s, tid, stride); break;
          default: break;  // refused on the host
        }
    }
  }
  if (a.total_ns > 0) {
    __syncthreads();
    if (threadIdx.x == 0) wait_until(t0 + static_cast<unsigned long long>(a.total_ns));
  }
}

void launch(WireClass c, const WireArgs& a, int blocks, cudaStream_t cs) {
  switch (c) {
    case WireClass::ep: emulated_wire_kernel<0><<<blocks, kThreads, 0, cs>>>(a); break;
    case WireClass::cp: emulated_wire_kernel<1><<<blocks, kThreads, 0, cs>>>(a); break;
    case WireClass::param_gather: emulated_wire_kernel<2><<<blocks, kThreads, 0, cs>>>(a); break;
    case WireClass::grad_reduce: emulated_wire_kernel<3><<<blocks, kThreads, 0, cs>>>(a); break;
    case WireClass::other: emulated_wire_kernel<4><<<blocks, kThreads, 0, cs>>>(a); break;
  }
  BB_CHECK_LAUNCH();
}

}  // namespace

void run_on_device(int dev, Stream s, WireClass c, const std::vector<Segment>& segs, double seconds, int blocks) {
  if (segs.empty() && seconds <= 0) return;
  cudaStream_t cs = cuda::stream_of(dev, s);
  int64_t moved = 0;  // bytes read + written
  for (const Segment& g : segs) {
    BB_CHECK(g.op != SegOp::scale || g.dtype == DType::f32 || g.dtype == DType::bf16 || g.dtype == DType::f16 ||
                 g.dtype == DType::i32 || g.dtype == DType::i64,
             "emulated collective: cannot reduce elements of dtype ", dtype_name(g.dtype));
    moved += (g.op == SegOp::zero ? 1 : 2) * g.bytes;
  }
  const long long total_ns = static_cast<long long>(seconds * 1e9);
  const long long copy_ns = static_cast<long long>(static_cast<double>(moved) / kCopyBytesPerS * 1e9);
  // Pieces past one launch's worth go first, untimed; the last launch holds the wire time.
  size_t at = 0;
  do {
    WireArgs a{};
    const size_t n = std::min(segs.size() - at, static_cast<size_t>(kMaxSegments));
    for (size_t i = 0; i < n; ++i) {
      const Segment& g = segs[at + i];
      a.seg[i] = {g.src, g.dst, g.bytes, static_cast<uint8_t>(g.op), static_cast<uint8_t>(g.dtype),
                  static_cast<float>(g.factor)};
    }
    a.num = static_cast<int>(n);
    at += n;
    const bool last = at >= segs.size();
    a.total_ns = last ? total_ns : 0;
    a.pre_ns = last ? std::max(0LL, total_ns - copy_ns) : 0;
    launch(c, a, std::max(1, blocks), cs);
  } while (at < segs.size());
}

}  // namespace bb::comm::emu
