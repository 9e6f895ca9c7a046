// grouped_mma_device.cuh — device pieces shared by the grouped GEMM tile kernels
// (grouped_mma.cu, grouped_wgmma_sm90a.cu, grouped_tma_sm90a.cu): cp.async moves, the
// tile -> problem lookup, the wgmma shared-memory descriptor, and the paired epilogue loads and
// stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/grouped_mma.h"

namespace bb::cuda::grouped {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; !valid zero-fills them and reads nothing (src must still be a
// mapped address: callers pass the matrix's first element).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The pipeline's prologue: K steps 0 .. S - 2 in flight, one commit group each (empty groups
// past the last step keep the wait_group counts of the main loop right).
template <int S, int BK, class Load>
__device__ __forceinline__ void pipeline_prologue(int steps, const Load& load_stage) {
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < steps) load_stage(s, static_cast<int64_t>(s) * BK);
    cp_async_commit();
  }
}

// wgmma shared-memory matrix descriptor for a 128-byte swizzled tile: start address, leading and
// stride byte offsets (all >> 4). K-major tiles (8-row atoms of 128-byte rows): lbo 16 (unused),
// sbo 1024; M/N-major ones: lbo = the distance between 64-element blocks, sbo 1024.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// The problem that tile t belongs to: the last one whose first tile is <= t (binary search over
// the problems' first tiles).
__device__ __forceinline__ int problem_of_tile(const int32_t* starts, int num_probs, int t) {
  int lo = 0, hi = num_probs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(starts + mid) <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// This CTA's problem and the origin of its BM x BN output tile (tiles M-fastest within a problem).
struct TileAt {
  const MmaProblem* p;
  int64_t m0, n0;
};
template <int BM, int BN>
__device__ __forceinline__ TileAt find_tile(const MmaProblem* probs, const int32_t* starts, int num_probs) {
  const int bid = static_cast<int>(blockIdx.x);
  const int lo = problem_of_tile(starts, num_probs, bid);
  const MmaProblem* p = probs + lo;
  const int tile = bid - __ldg(starts + lo);
  return {p, static_cast<int64_t>(tile % p->tiles_m) * BM, static_cast<int64_t>(tile / p->tiles_m) * BN};
}

// Two adjacent C elements (8- or 4-byte aligned), as floats.
__device__ __forceinline__ void store2(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
__device__ __forceinline__ void store2(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void store2(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}
__device__ __forceinline__ float2 load2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 load2(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ float2 load2(const __half* p) {
  return __half22float2(*reinterpret_cast<const __half2*>(p));
}

// out[0..1] = alpha (v0, v1) + beta out[0..1] (out not read when beta is 0).
template <class TC>
__device__ __forceinline__ void epilogue2(TC* out, float v0, float v1, float alpha, float beta) {
  v0 *= alpha;
  v1 *= alpha;
  if (beta != 0.0f) {
    const float2 o = load2(out);
    v0 += beta * o.x;
    v1 += beta * o.y;
  }
  store2(out, v0, v1);
}

}  // namespace bb::cuda::grouped
