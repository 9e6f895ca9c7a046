// router_cuda.h — host-side declarations of the CUDA router kernels (router.cpp dispatches here
// for device tensors). Raw pointers and sizes only; every launch runs on cuda::stream().
//
// Legend: T tokens, E experts, K top-k, G expert groups, B = router_num_blocks(T, cfg).
// The forward computes the same fp32 scores as ref::router_scores (softmax: exp and the sum in
// double, then rounded to f32), so the selection on the same fp32 logits is identical to the
// CPU's, ties going to the lower expert id. Loss partial sums are reduced on the device in a
// fixed order (deterministic); expert counts use int atomics (integer sums are exact).
#pragma once

#ifdef BB_WITH_CUDA

#include <cstdint>

#include "primitives/moe/router.h"

namespace bb::cuda {

// Byte layout of the small stats buffer the forward fills and the host reads in one copy.
struct RouterStatsLayout {
  static constexpr size_t kAuxOffset = 0;      // double aux_loss
  static constexpr size_t kZOffset = 8;        // double z_loss
  static constexpr size_t kCountsOffset = 16;  // int32 counts[E]
  static size_t bytes(int64_t E) { return kCountsOffset + 4 * static_cast<size_t>(E); }
};

// Grid size of the forward (depends on T and cfg only, so the reduction order is fixed).
int64_t router_num_blocks(int64_t T, const RouterConfig& cfg);
// Bytes of the per-block partial sums the forward needs: B * (E + 1) doubles.
size_t router_partials_bytes(int64_t T, const RouterConfig& cfg);

// logits [T, E] f32 (in); bias [E] f32 or null (selection only).
// scores [T, E] f32 (out, may be null when nothing is saved); topk_idx [T, K] i32 (out);
// topk_prob [T, K] f32 (out); partials (scratch, router_partials_bytes); stats
// (RouterStatsLayout::bytes(E), out: aux, z and the counts; zeroed here first).
// given [T, K] i32 or null: a selection to replay instead of the top-k search; then only scores
// and topk_prob are written (topk_idx and stats are not touched, no losses are computed).
void router_forward(const float* logits, const float* bias, float* scores, int32_t* topk_idx,
                    float* topk_prob, void* partials, void* stats, int64_t T,
                    const RouterConfig& cfg, const int32_t* given = nullptr);

// d_topk_prob [T, K] f32 or null (= zeros); logits, scores [T, E] f32; topk_idx [T, K] i32;
// counts [E] i32 scratch (recomputed here from topk_idx). d_logits [T, E] f32 (WRITTEN).
void router_backward(float* d_logits, const float* d_topk_prob, double d_aux, double d_z,
                     const float* logits, const float* scores, const int32_t* topk_idx,
                     int32_t* counts, int64_t T, const RouterConfig& cfg);

}  // namespace bb::cuda

#endif  // BB_WITH_CUDA
