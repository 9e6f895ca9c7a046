// dispatcher_rows.h — what the multi-rank dispatchers share (internal to primitives/moe): row
// runs copied between buffers, the chunk split of a run of rows, and the checks at the boundary.
// Every row movement of a dispatcher is a list of runs (dst row, src row, rows): one copy per
// run, device-agnostic (Tensor::copy_from on the current stream).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace bb::dispatch {

// Rows [src, src + n) of one buffer go to rows [dst, dst + n) of another.
struct RowRun {
  int64_t dst = 0, src = 0, n = 0;
};

// The same runs in the other direction (dst <-> src).
std::vector<RowRun> reversed(const std::vector<RowRun>& runs);

// A new [rows, ...] tensor shaped like `like` past its leading dimension, with its dtype, device
// and memory category (moe for rows in transit, activations for the experts' saved tensors).
// Zero-filled when `zero`.
Tensor rows_like(const Tensor& like, int64_t rows, bool zero = false);

// dst rows = src rows along `runs` (runs must not overlap in dst).
void copy_rows(const Tensor& dst, const Tensor& src, const std::vector<RowRun>& runs);

// A [rows, ...] tensor whose rows are src's along `runs`; `src` itself (no copy) when the runs
// are the identity over all of src's rows and `rows` equals them.
Tensor gather_rows(const Tensor& src, const std::vector<RowRun>& runs, int64_t rows);

// The first row of chunk k (of n) of a run of `count` rows: chunk k takes rows
// [chunk_begin(count, k, n), chunk_begin(count, k + 1, n)).
inline int64_t chunk_begin(int64_t count, int64_t k, int64_t n) { return count * k / n; }
inline int64_t chunk_len(int64_t count, int64_t k, int64_t n) {
  return chunk_begin(count, k + 1, n) - chunk_begin(count, k, n);
}

// Checks x_perm [N, H] against tokens_per_expert [E] (sum N) and row_prob [N] f32 (if defined);
// `who` names the member in the message.
void check_dispatch_inputs(const char* who, const Tensor& x_perm, const Tensor& row_prob,
                           const std::vector<int64_t>& tokens_per_expert, int64_t num_experts);

}  // namespace bb::dispatch
