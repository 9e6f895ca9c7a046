// grouped_tma_sm90a.cu — the Hopper kernel of the grouped GEMM (grouped_mma.h, GroupedAlgo::mma
// with tile_m = 0): a persistent, warp-specialised kernel that moves tiles with the tensor
// memory accelerator (TMA, cp.async.bulk.tensor) and multiplies them with wgmma. Compiled for
// sm_90a only (CMakeLists.txt builds *_sm90a.cu as their own object library); grouped_mma.cu
// launches it only on compute capability 9.0.
//
// What it computes: C_g = alpha op(A_g) op(B_g) + beta C_g for every problem g, bf16 A and B,
// fp32 accumulators, C bf16 or f32, in the three expert shapes:
//   forward (TN): A [M][K], B [N][K]                 x W^T
//   dgrad   (NN): A [M][K], B [K][N]                 d_y W
//   wgrad   (TN^T: trans_a, !trans_b): A [K][M], B [K][N], K = the expert's rows (ragged)
//                                                    d_W += d_y^T x
//
// Why TMA needs a layout check: one tensor map per operand spans every problem's rows (the
// experts' permuted rows are one [rows][K] matrix, their weights one [E x N][K] or [E x K][N]
// matrix), and a box that runs past a problem's last row reads the rows after it. In the
// forward and dgrad those rows only feed output rows or columns the epilogue does not store;
// in the wgrad they would add other experts' rows to the sum, so the consumers zero them in
// shared memory before multiplying. Either way they must be memory the caller owns:
// grouped_tma_refusal accepts a call only when every such overrun lands on another problem's
// rows or past the map's end (where TMA reads nothing and fills zeros). A contiguous extent is
// the map's inner dimension, so its tail is zero-filled; for the dgrad the K rows of B are the
// outer dimension, so K must be a multiple of the 64-row K step.
//
// Layout per CTA (one per SM, 384 threads; 193 KiB of shared memory for f32 C from registers,
// 209 for bf16 C and for f32 C through the staging buffer):
//   warp 0, one thread: the producer. For each tile it finds the problem (binary search over the
//     problems' first tiles), publishes the tile's descriptor in a 4-entry shared-memory ring,
//     then for each K step waits for a free stage, arms the stage's "full" mbarrier with its
//     byte count and issues the TMA loads (A: one 64 x 128 box, or two 64 x 64 boxes when A is
//     stored [K][M]; B: one 64 x 256 box when B is [N][K], four 64 x 64 boxes when it is
//     [K][N]). It runs a stage count ahead, across tile boundaries, so the next tile's loads
//     overlap this tile's last products and its epilogue. Warpgroup 0 drops to 40 registers.
//   warpgroups 1, 2: the consumers. Warpgroup w multiplies rows [64 (w - 1), +64) of the
//     128 x 256 output tile with wgmma.mma_async m64n256k16 (both operands from shared
//     memory, 128 fp32 accumulators a thread, 232 registers), keeps one K step's products in
//     flight and frees a stage (one arrival per warp on its "empty" mbarrier) once the products
//     that read it are done. At the tile's end they hand it on: bf16 C as alpha acc into a
//     swizzled staging tile, then straight on to the next tile; f32 C stored by themselves
//     (beta 1: red.global.add, which waits for nothing), or, when it is added to with a short
//     K, as alpha acc into a [64][256] f32 staging half-tile, warpgroup 1 then warpgroup 2
//     (SmemPlan says when and why), or, when it is written (beta 0, the expert wgrad) and every
//     problem is whole 128-row tiles, into 32-column boxes that one thread of each warpgroup
//     hands to TMA stores (kStore: the consumers go on without waiting for the global writes).
//   warps 1-3 (bf16 C, staged f32 C): the epilogue. They write the staging tile out, one 512-byte
//     (bf16) or 1 KiB (f32) row a warp (coalesced), adding beta C when beta is not 0, while the
//     consumers multiply the next tile.
// Shared memory: 3 stages (bf16 C or staged f32 C, plus the 64 KiB staging tile) or 4 stages (f32 C
// from registers) of A 16 KiB + B 32 KiB, 128-byte swizzled as TMA writes it, which is wgmma's
// canonical layout: K-major for an operand stored with K contiguous (rows of 64 K elements, 8-row
// atoms 1024 bytes apart, +32 bytes per k16 step); M/N-major for one stored with M or N contiguous
// (rows of 64 M or N elements, one 8 KiB block per 64 of them: leading byte offset 8192 between the
// blocks, stride byte offset 1024 between 8-row K groups, +2048 bytes per k16 step), read with
// wgmma's transpose bit.
// Tiles: problem after problem, M-fastest within a problem (the CTAs working at the same time
// share B's rows in L2); CTA b takes tiles b, b + grid, ...
// Measured on an H200 (skills/experts.md): 565-654 TFLOP/s on the expert forward and dgrad at
// 512-2048 rows per expert (74-85% of the measured GEMM ceiling), ahead of cuBLASLt there.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/check.cuh"
#include "backend/cuda/grouped_mma.h"
#include "backend/cuda/grouped_mma_device.cuh"
#include "backend/cuda/runtime.h"
#include "core/error.h"
#include "core/tensor.h"

namespace bb::cuda {
namespace {

using namespace grouped;

constexpr int kBM = 128, kBN = 256, kBK = 64;
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kABytes = kBM * kBK * 2;  // 16 KiB
constexpr int kBBytes = kBN * kBK * 2;  // 32 KiB
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kBlock = 64 * kBK * 2;  // one 64 x 64 box of an M/N-major operand (8 KiB)

// The device-side problem table: rows of the A map where problem g starts, rows of the B map
// (forward: its N rows; dgrad and wgrad: its K rows), its K and its C.
struct TmaProblem {
  void* C;
  int32_t M, N, K, a_row, b_row, tiles_m;
};

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of `parity` has completed. A wait longer than about 10 s of SM clock
// traps (a lost arrival would otherwise hang the GPU; the launch then fails with an error).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  long long t0 = 0;  // read once a wait is not over at the first try
  for (;;) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    if (done) return;
    if (t0 == 0) t0 = clock64();
    else if (clock64() - t0 > (1ll << 34)) __trap();
  }
}

// One 2D box global -> shared, completing on `bar` (complete_tx counts its bytes). c0 is the
// inner (contiguous) coordinate, c1 the row.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// One K step of an operand's tile (kExtent rows or columns of M or N, 64 of K) into `dst`: stored
// K-major (K contiguous), one kExtent x 64 box at (k0, row0 + o); stored M/N-major, kExtent / 64
// boxes of 64 x 64 at (o + 64 j, row0 + k0), 8 KiB apart.
template <bool kMN, int kExtent>
__device__ __forceinline__ void load_k_step(uint32_t dst, const CUtensorMap* map, uint32_t bar, int o, int row0, int k0) {
  if constexpr (kMN) {
#pragma unroll
    for (int j = 0; j < kExtent / 64; ++j) tma_load_2d(dst + j * kBlock, map, bar, o + 64 * j, row0 + k0);
  } else {
    tma_load_2d(dst, map, bar, k0, row0 + o);
  }
}

// Descriptor of a K-major (contiguous K) or M/N-major (contiguous M or N) operand tile.
__device__ __forceinline__ uint64_t operand_desc(uint32_t saddr, bool mn_major) {
  return mn_major ? sw128_desc(saddr, kBlock, 1024) : sw128_desc(saddr, 16, 1024);
}
// The descriptor's address step of one k16 slice: 32 bytes along a K-major row, 16 rows of 128
// bytes in an M/N-major block (in the descriptor's 16-byte units).
__host__ __device__ constexpr uint64_t k16_step(bool mn_major) { return mn_major ? 2048 / 16 : 32 / 16; }

// D (64 x 256, f32) += A (64 x 16) * B (16 x 256), both from shared memory; the transpose bits
// say M/N-major; scale_d = 0 overwrites D.
template <bool kTransA, bool kTransB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, %131, %132;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(scale_d), "n"(kTransA ? 1 : 0), "n"(kTransB ? 1 : 0));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Tile t's problem (binary search over the first tiles) and the origin of its output tile.
struct TmaTile {
  const TmaProblem* p;
  int m0, n0, k_steps;
};
__device__ __forceinline__ TmaTile tile_at(const TmaProblem* probs, const int32_t* starts, int num_probs, int t) {
  const int lo = problem_of_tile(starts, num_probs, t);
  const TmaProblem* p = probs + lo;
  const int tile = t - __ldg(starts + lo);
  return {p, (tile % p->tiles_m) * kBM, (tile / p->tiles_m) * kBN, (p->K + kBK - 1) / kBK};
}

// Shared-memory plan of a kernel instance. bf16 outputs go through a staging tile that three
// epilogue warps write out while the consumers multiply the next tile (3 stages then fit). f32
// outputs: with kHalves, through a half-tile staging buffer ([64][256] f32, 64 KiB) that the two
// consumer warpgroups fill in turn and the epilogue warps write out (3 stages); without, stored
// by the consumers themselves from registers (4 stages). launch() takes kHalves when C is added
// to (beta != 0) and the problems' mean K is below 1024, where the stores weigh most against
// the products. Measured on an H200 (bench_experts, the expert wgrad, both projections, ms from
// the staging rows / from registers): adding, 2.27 / 2.56 at 512 rows per expert (E 128, F
// 768), 2.61 / 3.42 at 256 (E 256, F 512), but 2.85 / 2.70 at 1024 and 4.27 / 4.02 at 2048; a
// plain write (beta 0, the first wgrad of a step) is faster from registers at every size (1.55
// / 1.85 ms at 512 rows): the second warpgroup waits for the first half's rows to leave shared
// memory, where register stores are absorbed by L2 at once.
template <class TC, bool kHalves>
struct SmemPlan {
  static constexpr bool kF32Halves = kHalves && sizeof(TC) == 4;
  static constexpr bool kStaged = sizeof(TC) == 2 || kF32Halves;
  static constexpr int kStages = kStaged ? 3 : 4;
  static constexpr int kRing = 4;  // tile descriptors the producer may publish ahead
  static constexpr int kStaging = kStages * kStageBytes;
  static constexpr int kStagingBytes = sizeof(TC) == 2 ? kBM * kBN * 2 : (kF32Halves ? 64 * kBN * 4 : 0);
  static constexpr int kRingAt = kStaging + kStagingBytes;
  static constexpr int kMetaAt = kRingAt + kRing * 32;
  static constexpr int kBarsAt = kMetaAt + 32;
  static constexpr int kBars = 2 * kStages + 2 * kRing + 4;
  static constexpr int kBytes = kBarsAt + kBars * 8 + 1024;  // + room to align the base to 1024
};

// A tile as the producer publishes it to the consumers (and the consumers to the epilogue).
struct alignas(16) TileInfo {
  void* C;
  int32_t M, N, K, m0, n0, k_steps;
};

// kTA: A stored [K][M] (the wgrad; its K, the expert's rows, is ragged per problem); kBMN: B
// stored [K][N] (dgrad, wgrad) rather than [N][K] (forward).
// Roles: warp 0, one thread: the producer (tile lookup, TMA loads); warps 1-3: the epilogue
// (bf16 outputs); warps 4-11: the two consumer warpgroups.
// mbarriers: full/empty per stage (TMA bytes / 8 consumer warps), tile_full/tile_empty per ring
// slot (the producer / 256 consumer threads), staged/drained for the staging tile (256
// consumer threads / 96 epilogue threads); f32 halves: staged/drained per half (the 128 threads
// of its warpgroup / 96 epilogue threads).
// kStore (f32 C, beta 0, the halves plan's shared memory): the consumers write alpha acc into
// 32-column boxes of the staging buffer and one thread per warpgroup stores them with TMA
// (map_c over every problem's C rows, c_base its first byte), not waiting for the global writes.
template <bool kTA, bool kBMN, class TC, bool kHalves, bool kStore = false>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_tma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                       const __grid_constant__ CUtensorMap map_c, const char* c_base,
                       const TmaProblem* __restrict__ probs, const int32_t* __restrict__ starts, int num_probs,
                       int tiles, int64_t ldc, float alpha, float beta) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using P = SmemPlan<TC, kHalves>;
  constexpr int S = P::kStages, R = P::kRing;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  unsigned char* const sbase = smem_raw + (base - smem_u32(smem_raw));  // generic pointer to `base`
  TileInfo* const ring = reinterpret_cast<TileInfo*>(sbase + P::kRingAt);
  TileInfo* const meta = reinterpret_cast<TileInfo*>(sbase + P::kMetaAt);
  const uint32_t bars = base + P::kBarsAt;
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (S + s); };
  auto tile_full = [&](int r) { return bars + 8 * (2 * S + r); };
  auto tile_empty = [&](int r) { return bars + 8 * (2 * S + R + r); };
  const uint32_t staged = bars + 8 * (2 * S + 2 * R), drained = staged + 8;
  const uint32_t staged1 = staged + 16, drained1 = staged + 24;  // f32 halves: the second half's
  auto a_stage = [&](int s) { return base + s * kStageBytes; };
  auto b_stage = [&](int s) { return base + s * kStageBytes + kABytes; };
  const uint32_t staging = base + P::kStaging;

  const int wg = threadIdx.x >> 7, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), 1);   // the producer's arrive.expect_tx; the bytes complete it
      mbar_init(empty(s), 8);  // one arrival per consumer warp
    }
    for (int r = 0; r < R; ++r) {
      mbar_init(tile_full(r), 1);
      mbar_init(tile_empty(r), 256);
    }
    mbar_init(staged, P::kF32Halves ? 128 : 256);
    mbar_init(drained, 96);
    mbar_init(staged1, 128);
    mbar_init(drained1, 96);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x == 0) {
      // The producer: publishes each tile, then loads its K steps.
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_a)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_b)) : "memory");
      uint32_t it = 0, i = 0;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++i) {
        const TmaTile at = tile_at(probs, starts, num_probs, t);
        const TmaProblem& p = *at.p;
        const int r = static_cast<int>(i % R);
        mbar_wait(tile_empty(r), ((i / R) & 1) ^ 1);
        ring[r] = TileInfo{p.C, p.M, p.N, p.K, at.m0, at.n0, at.k_steps};
        mbar_arrive(tile_full(r));  // release: the descriptor is visible to whoever sees the phase
        const int a_row = p.a_row, b_row = p.b_row;
        for (int k = 0; k < at.k_steps; ++k, ++it) {
          const int s = static_cast<int>(it % S);
          mbar_wait(empty(s), ((it / S) & 1) ^ 1);
          mbar_arrive_expect_tx(full(s), kStageBytes);
          load_k_step<kTA, kBM>(a_stage(s), &map_a, full(s), at.m0, a_row, k * kBK);
          load_k_step<kBMN, kBN>(b_stage(s), &map_b, full(s), at.n0, b_row, k * kBK);
        }
      }
    } else if (P::kF32Halves && !kStore && warp >= 1) {
      // The f32 epilogue: for each tile, half 0 (rows 0-63, warpgroup 1's) then half 1. Warp
      // w - 1 of 3 writes rows w - 1, w + 2, ... of the half, 2 x 16 bytes (4 columns each) a
      // lane, a whole 256-column row a warp (coalesced); beta 1 adds in L2 (red.global.add).
      const int ew = warp - 1;
      uint32_t i = 0;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++i) {
#pragma unroll 1
        for (int h = 0; h < 2; ++h) {
          mbar_wait(h == 0 ? staged : staged1, i & 1);
          const TileInfo at = *meta;
          float* C = reinterpret_cast<float*>(at.C);
          for (int r = ew; r < 64 && at.m0 + 64 * h + r < at.M; r += 3) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int c = lane + 32 * half;  // 16-byte chunk of the row: columns 4c .. 4c + 3
              const int col = at.n0 + 4 * c;
              if (col >= at.N) continue;
              float4 v;
              asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                           : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                           : "r"(staging + r * (kBN * 4) + ((c ^ (r & 7)) << 4)));
              float* out = C + static_cast<int64_t>(at.m0 + 64 * h + r) * ldc + col;
              if (beta == 1.0f) {
                asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(out), "f"(v.x), "f"(v.y), "f"(v.z),
                             "f"(v.w)
                             : "memory");
                continue;
              }
              if (beta != 0.0f) {
                const float4 o = *reinterpret_cast<const float4*>(out);
                v.x += beta * o.x;
                v.y += beta * o.y;
                v.z += beta * o.z;
                v.w += beta * o.w;
              }
              *reinterpret_cast<float4*>(out) = v;
            }
          }
          mbar_arrive(h == 0 ? drained : drained1);
        }
      }
    } else if (P::kStaged && !P::kF32Halves && warp >= 1) {  // (kStore: warps 1-3 idle)
      // The epilogue: warp w - 1 of 3 writes rows w - 1, w + 2, ... of each staged tile, 16 bytes
      // (8 columns) a lane, a whole 256-column row a warp (coalesced).
      const int ew = warp - 1;
      uint32_t i = 0;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++i) {
        mbar_wait(staged, i & 1);
        const TileInfo at = *meta;
        const int col = at.n0 + 8 * lane;
        TC* C = static_cast<TC*>(at.C);
        for (int r = ew; r < kBM && at.m0 + r < at.M; r += 3) {
          if (col >= at.N) continue;
          uint4 v;
          asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                       : "r"(staging + r * (kBN * 2) + ((lane ^ (r & 7)) << 4)));
          TC* out = C + static_cast<int64_t>(at.m0 + r) * ldc + col;
          if (beta != 0.0f) {
            const uint4 o = *reinterpret_cast<const uint4*>(out);
            uint32_t* pv = &v.x;
            const uint32_t* po = &o.x;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(pv + e));
              const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(po + e));
              const __nv_bfloat162 sum = __floats2bfloat162_rn(a.x + beta * b.x, a.y + beta * b.y);
              pv[e] = *reinterpret_cast<const uint32_t*>(&sum);
            }
          }
          *reinterpret_cast<uint4*>(out) = v;
        }
        mbar_arrive(drained);
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int cw = wg - 1;  // rows [64 cw, +64) of each tile
    const int ct = threadIdx.x - 128;  // 0..255 over the consumers
    const int q = warp & 3;
    uint32_t it = 0, i = 0;
    float acc[128];
#pragma unroll
    for (int j = 0; j < 128; ++j) acc[j] = 0.0f;  // (each tile's first product overwrites them)
    for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++i) {
      const int r = static_cast<int>(i % R);
      mbar_wait(tile_full(r), (i / R) & 1);
      const TileInfo at = ring[r];
      mbar_arrive(tile_empty(r));
      if (at.k_steps == 0) {  // K = 0: C = beta C
#pragma unroll
        for (int j = 0; j < 128; ++j) acc[j] = 0.0f;
      }
      for (int k = 0; k < at.k_steps; ++k, ++it) {
        const int s = static_cast<int>(it % S);
        mbar_wait(full(s), (it / S) & 1);
        if constexpr (kTA) {
          // The wgrad's last K step of a problem holds rows of the next problem (or TMA's zeros
          // past the map): zero rows [valid, 64) of every A and B block before multiplying.
          const int valid = at.K - k * kBK;
          if (valid < kBK) {
            constexpr int kBlocks = kBM / 64 + kBN / 64;
            const int chunks = (kBK - valid) * kBlocks * 8;  // 16-byte chunks of 128-byte rows
            for (int c = ct; c < chunks; c += 256) {
              const int line = c >> 3, blk = line % kBlocks, row = valid + line / kBlocks;
              const uint32_t at_blk = blk < kBM / 64 ? a_stage(s) + blk * kBlock : b_stage(s) + (blk - kBM / 64) * kBlock;
              asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(at_blk + row * 128 + (c & 7) * 16), "r"(0)
                           : "memory");
            }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes -> wgmma reads
            asm volatile("bar.sync 1, 256;\n" ::: "memory");                // both consumer warpgroups
          }
        }
        const uint64_t da = operand_desc(a_stage(s) + cw * (kTA ? kBlock : 64 * 128), kTA);
        const uint64_t db = operand_desc(b_stage(s), kBMN);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk)
          wgmma_m64n256k16<kTA, kBMN>(acc, da + k16_step(kTA) * kk, db + k16_step(kBMN) * kk, (k > 0 || kk > 0) ? 1 : 0);
        wgmma_commit();
        // Step k's products run while step k - 1's are waited for; then k - 1's stage is free.
        wgmma_wait<1>();
        if (k > 0 && lane == 0) mbar_arrive(empty(static_cast<int>((it - 1) % S)));
      }
      wgmma_wait<0>();
      if (at.k_steps > 0 && lane == 0) mbar_arrive(empty(static_cast<int>((it - 1) % S)));

      // Accumulators: warp q holds rows 16 q + lane / 4 (+ 8) of the warpgroup's 64; n8 block j
      // in acc[4 j .. 4 j + 3] as in mma.sync's m16n8 fragment.
      const int rt = cw * 64 + q * 16 + (lane >> 2);  // tile row of acc[.. 0, 1]; + 8 for [.. 2, 3]
      if constexpr (kStore) {
        // Warpgroup cw's 64 rows go out as 8 boxes of 64 rows x 32 columns (8 KiB, 128-byte rows,
        // 16-byte chunks XOR-swizzled by row & 7 as TMA's 128-byte swizzle reads them: the
        // fragment writes are conflict-free), two boxes at a time, through its half of the
        // staging buffer (two slots of two boxes). Before a pair's slot is written, the thread
        // that issued the stores waits until the stores that read the slot last (two pairs ago,
        // possibly of the previous tile) have read it; the global writes complete on their own.
        const uint32_t wbuf = staging + cw * 32768;
        const bool leader = (threadIdx.x & 127) == 0;
        const int crow = static_cast<int>((static_cast<const char*>(at.C) - c_base) / (ldc * 4)) + at.m0 + 64 * cw;
        const int rl = q * 16 + (lane >> 2);  // row within the warpgroup's 64
#pragma unroll
        for (int pr = 0; pr < 4; ++pr) {
          const uint32_t slot = wbuf + (pr & 1) * 16384;
          if (leader) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
          asm volatile("bar.sync %0, 128;\n" ::"r"(2 + cw) : "memory");
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            const int j = 8 * pr + jj;  // n8 block of the tile
            const uint32_t box = slot + (jj >> 2) * 8192;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = rl + 8 * h, chunk = (jj & 3) * 2 + ((lane & 3) >> 1);
              asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(box + row * 128 + ((chunk ^ (row & 7)) << 4) +
                                                                      (lane & 1) * 8),
                           "f"(alpha * acc[4 * j + 2 * h]), "f"(alpha * acc[4 * j + 2 * h + 1])
                           : "memory");
            }
          }
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes -> TMA reads
          asm volatile("bar.sync %0, 128;\n" ::"r"(2 + cw) : "memory");
          if (leader) {
#pragma unroll
            for (int b = 0; b < 2; ++b) {
              const int col = at.n0 + 32 * (2 * pr + b);
              if (col < at.N)
                asm volatile(
                    "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                        reinterpret_cast<uint64_t>(&map_c)),
                    "r"(slot + b * 8192), "r"(col), "r"(crow)
                    : "memory");
            }
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
          }
        }
      } else if constexpr (P::kF32Halves) {
        // alpha acc into the half-tile staging buffer ([64][256] f32, the 16-byte chunks of row
        // r XOR-swizzled by r & 7), warpgroup 1 first: it waits until the epilogue has written
        // out the previous tile's second half, warpgroup 2 until it has written this tile's first.
        if (cw == 0) mbar_wait(drained1, (i & 1) ^ 1);
        else mbar_wait(drained, i & 1);
        const int rl = q * 16 + (lane >> 2);  // row within the half
#pragma unroll
        for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = rl + 8 * h, chunk = 2 * j + ((lane & 3) >> 1);
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(staging + row * (kBN * 4) + ((chunk ^ (row & 7)) << 4) +
                                                                    (lane & 1) * 8),
                         "f"(alpha * acc[4 * j + 2 * h]), "f"(alpha * acc[4 * j + 2 * h + 1])
                         : "memory");
          }
        if (cw == 0 && ct == 0) *meta = at;
        mbar_arrive(cw == 0 ? staged : staged1);
      } else if constexpr (P::kStaged) {
        // alpha acc in bf16 into the staging tile ([128][256], the 16-byte chunks of row r
        // XOR-swizzled by r & 7: conflict-free writes of these fragments and reads of whole rows).
        mbar_wait(drained, (i & 1) ^ 1);  // the epilogue warps are done with the previous tile
#pragma unroll
        for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = rt + 8 * h;
            const __nv_bfloat162 v = __floats2bfloat162_rn(alpha * acc[4 * j + 2 * h], alpha * acc[4 * j + 2 * h + 1]);
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(staging + row * (kBN * 2) + ((j ^ (row & 7)) << 4) +
                                                           (lane & 3) * 4),
                         "r"(*reinterpret_cast<const uint32_t*>(&v))
                         : "memory");
          }
        if (ct == 0) *meta = at;
        mbar_arrive(staged);
      } else {
        // f32 C, stored by the consumers. beta = 1 (the wgrad's d_W +=) adds in L2 with
        // red.global.add: no load, so nothing here waits for memory and the next tile starts at
        // once. Each element gets one addition (one tile covers it), so repeated calls are
        // bitwise equal and the sum is the fp32 C + alpha acc of a load, add and store, except
        // that subnormal results flush to zero (the f32 reduction implies .ftz).
        TC* C = static_cast<TC*>(at.C);
#pragma unroll
        for (int j = 0; j < kBN / 8; ++j) {
          const int col = at.n0 + j * 8 + 2 * (lane & 3);
          if (col >= at.N) continue;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = at.m0 + rt + 8 * h;
            if (row >= at.M) continue;
            TC* out = C + static_cast<int64_t>(row) * ldc + col;
            if (beta == 1.0f) {
              asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(out), "f"(alpha * acc[4 * j + 2 * h]),
                           "f"(alpha * acc[4 * j + 2 * h + 1])
                           : "memory");
              continue;
            }
            epilogue2(out, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1], alpha, beta);
          }
        }
      }
    }
    if constexpr (kStore) {
      if ((threadIdx.x & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
  }
#else
  __trap();
#endif
}

// ---- host side ----------------------------------------------------------------------------------

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    BB_CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    BB_CHECK(q == cudaDriverEntryPointSuccess && f != nullptr,
             "cuda::gemm_grouped: the driver has no cuTensorMapEncodeTiled (needs CUDA 12 or newer)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A 2D tensor map of bf16 (f32 false) or f32 elements: `rows` rows of `cols` elements, `ld`
// elements apart, boxes of box_cols x box_rows, 128-byte swizzle, zero fill outside. The bf16
// maps feed the products (L2 promotion of 256 bytes); the f32 one takes the wgrad's TMA stores
// (32-column boxes: 128 bytes, the swizzle's width).
CUtensorMap make_map(const void* base, int64_t rows, int64_t cols, int64_t ld, int box_cols, int box_rows,
                     bool f32 = false) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * (f32 ? 4 : 2))};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode_fn()(&m, f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                                 const_cast<void*>(base), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B,
                                 f32 ? CU_TENSOR_MAP_L2_PROMOTION_NONE : CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  BB_CHECK(r == CUDA_SUCCESS, "cuda::gemm_grouped: cuTensorMapEncodeTiled failed (error ", static_cast<int>(r),
           ") for a ", rows, " x ", cols, f32 ? " f32" : " bf16", " map with leading dimension ", ld);
  return m;
}

// Where each problem's rows start in one map over all of them, or why no such map is safe.
// extent[g]: rows problem g owns; box: rows one load covers (a problem's rows are read in whole
// boxes from its first row). Every box must end inside the problem's own rows, inside another
// problem's rows, or at/after the map's last row (zero fill).
struct RowMap {
  const char* base = nullptr;
  std::vector<int64_t> first;
  int64_t rows = 0;  // the map's row count
  std::string refusal;
};
RowMap row_map(const std::vector<const void*>& ptrs, const std::vector<int64_t>& extent, int64_t ld, int64_t box,
               const char* what) {
  RowMap r;
  const int64_t pitch = ld * 2;
  r.base = static_cast<const char*>(*std::min_element(ptrs.begin(), ptrs.end()));
  std::vector<std::pair<int64_t, int64_t>> spans;  // [first, first + extent) of every problem
  for (size_t g = 0; g < ptrs.size(); ++g) {
    const int64_t off = static_cast<const char*>(ptrs[g]) - r.base;
    if (off % pitch != 0) {
      r.refusal = std::string("the problems' ") + what + " are not rows of one matrix";
      return r;
    }
    r.first.push_back(off / pitch);
    spans.push_back({off / pitch, off / pitch + extent[g]});
    r.rows = std::max(r.rows, off / pitch + extent[g]);
  }
  if (r.rows == 0 || r.rows >= (int64_t{1} << 31)) {
    r.refusal = std::string("the problems' ") + what + (r.rows == 0 ? " have no rows" : " span too many rows for a tensor map");
    return r;
  }
  std::sort(spans.begin(), spans.end());
  // Merge the spans, then check that every overrun [end, end of its last box) is covered.
  std::vector<std::pair<int64_t, int64_t>> cover;
  for (const auto& s : spans) {
    if (!cover.empty() && s.first <= cover.back().second) cover.back().second = std::max(cover.back().second, s.second);
    else cover.push_back(s);
  }
  for (size_t g = 0; g < ptrs.size(); ++g) {
    const int64_t end = r.first[g] + extent[g];
    const int64_t read_end = std::min(r.first[g] + (extent[g] + box - 1) / box * box, r.rows);
    if (read_end <= end) continue;
    // The covering span that holds `end` must reach read_end.
    auto it = std::upper_bound(cover.begin(), cover.end(), std::make_pair(end, INT64_MAX));
    const bool ok = it != cover.begin() && std::prev(it)->first <= end && std::prev(it)->second >= read_end;
    if (!ok) {
      r.refusal = std::string("a tile of the problems' ") + what + " would read rows no problem owns";
      return r;
    }
  }
  return r;
}

std::atomic<int64_t> g_tma_calls{0};

std::atomic<int> g_f32_halves{-1};      // set_grouped_tma_f32_halves
std::atomic<bool> g_f32_store{true};    // set_grouped_tma_f32_store

// f32 C through the half-tile staging buffer when C is added to and K is short (SmemPlan says
// why). set_grouped_tma_f32_halves forces one path for every call (tests compare the two: the
// same bits either way).
bool f32_halves(float beta, int64_t mean_k) {
  const int forced = g_f32_halves.load();
  if (forced >= 0) return forced == 1;
  return beta != 0.0f && mean_k < 1024;
}

// Where f32 C goes out through TMA stores: one map over every problem's C rows (`base` its
// first byte), when the call writes (beta 0), every problem's M is whole 128-row tiles (a tile's
// rows past M would be another problem's) and the C matrices sit whole rows apart from the
// first. set_grouped_tma_f32_store(false) takes the register stores instead (tests compare).
struct StoreMap {
  bool ok = false;
  const char* base = nullptr;
  CUtensorMap map{};
};

template <bool kTA, bool kBMN, class TC, bool kHalves, bool kStore = false>
void launch_as(const CUtensorMap& ma, const CUtensorMap& mb, const CUtensorMap& mc, const char* c_base,
               const TmaProblem* probs, const int32_t* starts, int n, int tiles, int64_t ldc, float alpha, float beta) {
  auto* kernel = grouped_tma_kernel<kTA, kBMN, TC, kHalves, kStore>;
  constexpr int kSmem = SmemPlan<TC, kHalves>::kBytes;
  BB_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const int grid = std::min(tiles, sm_count());
  kernel<<<static_cast<unsigned>(grid), kThreads, kSmem, stream()>>>(ma, mb, mc, c_base, probs, starts, n, tiles, ldc,
                                                                     alpha, beta);
  BB_CHECK_LAUNCH();
}

template <bool kTA, bool kBMN, class TC>
void launch(const CUtensorMap& ma, const CUtensorMap& mb, const StoreMap& sm, const TmaProblem* probs,
            const int32_t* starts, int n, int tiles, int64_t ldc, float alpha, float beta, int64_t mean_k) {
  if constexpr (sizeof(TC) == 4 && kTA) {
    // The expert wgrad's plain write: TMA stores of the staged boxes.
    if (sm.ok) {
      launch_as<kTA, kBMN, TC, true, true>(ma, mb, sm.map, sm.base, probs, starts, n, tiles, ldc, alpha, beta);
      return;
    }
  }
  if constexpr (sizeof(TC) == 4) {
    if (f32_halves(beta, mean_k)) {
      launch_as<kTA, kBMN, TC, true>(ma, mb, sm.map, nullptr, probs, starts, n, tiles, ldc, alpha, beta);
      return;
    }
  }
  launch_as<kTA, kBMN, TC, false>(ma, mb, sm.map, nullptr, probs, starts, n, tiles, ldc, alpha, beta);
}

StoreMap store_map(const std::vector<GemmProblem>& live, DType cdt, int64_t ldc, float beta) {
  StoreMap sm;
  if (!g_f32_store.load() || cdt != DType::f32 || beta != 0.0f || ldc % 4 != 0) return sm;
  const char* base = nullptr;
  for (const GemmProblem& p : live) {
    if (p.M % kBM != 0 || p.N != live.front().N) return sm;
    const char* c = static_cast<const char*>(p.C);
    if (base == nullptr || c < base) base = c;
  }
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return sm;
  int64_t rows = 0;
  for (const GemmProblem& p : live) {
    const int64_t off = static_cast<const char*>(p.C) - base;
    if (off % (ldc * 4) != 0) return sm;
    rows = std::max(rows, off / (ldc * 4) + p.M);
  }
  if (rows >= (int64_t{1} << 31)) return sm;
  sm.ok = true;
  sm.base = base;
  sm.map = make_map(base, rows, live.front().N, ldc, 32, 64, /*f32=*/true);
  return sm;
}

// The two maps' rows, or why the call does not suit them. ps: the problems with M, N > 0.
struct Plan {
  RowMap a, b;
  std::string refusal;
};
Plan plan(bool ta, bool tb, const std::vector<GemmProblem>& ps, int64_t lda, int64_t ldb) {
  Plan pl;
  const GemmProblem& p0 = ps.front();
  std::vector<const void*> ap, bp;
  std::vector<int64_t> ax, bx;
  for (const GemmProblem& p : ps) {
    // One map's inner dimension serves every problem: the extents it covers must agree.
    if (ta && (p.M != p0.M || p.N != p0.N)) {
      pl.refusal = "the problems differ in M or N (A stored [K][M])";
      return pl;
    }
    if (!ta && p.K != p0.K) {
      pl.refusal = "the problems differ in K";
      return pl;
    }
    if (!ta && !tb && p.N != p0.N) {
      pl.refusal = "the problems differ in N (B stored [K][N])";
      return pl;
    }
    ap.push_back(p.A);
    ax.push_back(ta ? p.K : p.M);
    bp.push_back(p.B);
    bx.push_back(tb ? p.N : p.K);
  }
  if (!ta && p0.K <= 0) {
    pl.refusal = "K is 0";
    return pl;
  }
  if (!ta && !tb && p0.K % kBK != 0) {
    pl.refusal = "K is not a multiple of 64 (B stored [K][N])";
    return pl;
  }
  pl.a = row_map(ap, ax, lda, ta ? kBK : kBM, "A matrices");
  if (!pl.a.refusal.empty()) {
    pl.refusal = pl.a.refusal;
    return pl;
  }
  pl.b = row_map(bp, bx, ldb, tb ? kBN : kBK, "B matrices");
  pl.refusal = pl.b.refusal;
  return pl;
}

std::vector<GemmProblem> with_work(const std::vector<GemmProblem>& ps) {
  std::vector<GemmProblem> live;
  for (const GemmProblem& p : ps)
    if (p.M > 0 && p.N > 0) live.push_back(p);
  return live;
}

// The whole check of grouped_tma_refusal; the plan (for `live`, the problems with work) when the
// kernel takes the call.
Plan check(bool ta, bool tb, const std::vector<GemmProblem>& live, DType ab, int64_t lda, int64_t ldb, DType cdt,
           int device) {
  Plan pl;
  if (ta && tb) pl.refusal = "A is stored [K][M] and B [N][K]";
  else if (ab != DType::bf16) pl.refusal = "the inputs are not bf16";
  else if (cdt != DType::bf16 && cdt != DType::f32) pl.refusal = "C is neither bf16 nor f32";
  else if (compute_capability(device) != 90) pl.refusal = "the device is not compute capability 9.0";
  else if (live.empty()) pl.refusal = "no problem has work";
  else pl = plan(ta, tb, live, lda, ldb);
  return pl;
}

}  // namespace

std::string grouped_tma_refusal(bool ta, bool tb, const std::vector<GemmProblem>& ps, DType ab, int64_t lda,
                                int64_t ldb, DType cdt, int device) {
  return check(ta, tb, with_work(ps), ab, lda, ldb, cdt, device).refusal;
}

bool grouped_tma(bool ta, bool tb, const std::vector<GemmProblem>& ps, float alpha, DType ab, int64_t lda,
                 int64_t ldb, float beta, DType cdt, int64_t ldc, int device) {
  const std::vector<GemmProblem> live = with_work(ps);
  const Plan pl = check(ta, tb, live, ab, lda, ldb, cdt, device);
  if (!pl.refusal.empty()) return false;
  const GemmProblem& p0 = live.front();
  // A: [rows][K] in 64 x 128 boxes, or [rows][M] in 64 x 64 boxes (wgrad). B: [rows][K] in
  // 64 x 256 boxes (forward), or [rows][N] in 64 x 64 boxes.
  const CUtensorMap ma = ta ? make_map(pl.a.base, pl.a.rows, p0.M, lda, 64, kBK)
                            : make_map(pl.a.base, pl.a.rows, p0.K, lda, kBK, kBM);
  const CUtensorMap mb = tb ? make_map(pl.b.base, pl.b.rows, p0.K, ldb, kBK, kBN)
                            : make_map(pl.b.base, pl.b.rows, p0.N, ldb, 64, kBK);
  std::vector<TmaProblem> tp;
  std::vector<int32_t> starts;
  int64_t tiles = 0;
  for (size_t g = 0; g < live.size(); ++g) {
    const GemmProblem& p = live[g];
    const int64_t tm = ceil_div(p.M, kBM), tn = ceil_div(p.N, kBN);
    BB_CHECK(p.M < (int64_t{1} << 31) && p.N < (int64_t{1} << 31) && p.K < (int64_t{1} << 31),
             "cuda::gemm_grouped: a problem too large for the TMA kernel (", p.M, " x ", p.N, " x ", p.K, ")");
    starts.push_back(static_cast<int32_t>(tiles));
    tp.push_back({p.C, static_cast<int32_t>(p.M), static_cast<int32_t>(p.N), static_cast<int32_t>(p.K),
                  static_cast<int32_t>(pl.a.first[g]), static_cast<int32_t>(pl.b.first[g]), static_cast<int32_t>(tm)});
    tiles += tm * tn;
    BB_CHECK(tiles < (int64_t{1} << 31), "cuda::gemm_grouped: too many tiles (", tiles, ") for the TMA kernel");
  }
  const size_t pb = tp.size() * sizeof(TmaProblem), sb = starts.size() * sizeof(int32_t);
  std::vector<unsigned char> host(pb + sb);
  std::copy_n(reinterpret_cast<const unsigned char*>(tp.data()), pb, host.data());
  std::copy_n(reinterpret_cast<const unsigned char*>(starts.data()), sb, host.data() + pb);
  Tensor meta = Tensor::empty({static_cast<int64_t>(host.size())}, DType::u8, Device::cuda(device), MemCategory::workspace);
  cuda::memcpy(meta.raw(), Device::cuda(device), host.data(), Device::cpu(), host.size());
  const auto* dprobs = static_cast<const TmaProblem*>(meta.raw());
  const auto* dstarts = reinterpret_cast<const int32_t*>(static_cast<const unsigned char*>(meta.raw()) + pb);
  const int n = static_cast<int>(tp.size()), nt = static_cast<int>(tiles);
  const bool f32 = cdt == DType::f32;
  int64_t sum_k = 0;
  for (const GemmProblem& p : live) sum_k += p.K;
  const int64_t mk = sum_k / static_cast<int64_t>(live.size());
  const StoreMap sm = ta ? store_map(live, cdt, ldc, beta) : StoreMap{};
  if (ta) {
    if (f32) launch<true, true, float>(ma, mb, sm, dprobs, dstarts, n, nt, ldc, alpha, beta, mk);
    else launch<true, true, __nv_bfloat16>(ma, mb, sm, dprobs, dstarts, n, nt, ldc, alpha, beta, mk);
  } else if (tb) {
    if (f32) launch<false, false, float>(ma, mb, sm, dprobs, dstarts, n, nt, ldc, alpha, beta, mk);
    else launch<false, false, __nv_bfloat16>(ma, mb, sm, dprobs, dstarts, n, nt, ldc, alpha, beta, mk);
  } else {
    if (f32) launch<false, true, float>(ma, mb, sm, dprobs, dstarts, n, nt, ldc, alpha, beta, mk);
    else launch<false, true, __nv_bfloat16>(ma, mb, sm, dprobs, dstarts, n, nt, ldc, alpha, beta, mk);
  }
  g_tma_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

int64_t grouped_tma_calls() { return g_tma_calls.load(std::memory_order_relaxed); }

void set_grouped_tma_f32_store(bool on) { g_f32_store.store(on); }

void set_grouped_tma_f32_halves(int mode) {
  BB_CHECK(mode >= -1 && mode <= 1, "set_grouped_tma_f32_halves: -1, 0 or 1, got ", mode);
  g_f32_halves.store(mode);
}

}  // namespace bb::cuda
