// cp_ops.h — the data movements of the context-parallel attention members (context_parallel.h):
// row gathers and scatters by a host row list, the log-sum-exp merge of partial attention results,
// and the head split / join of the all-to-all member. CPU loops and CUDA kernels (cp_ops_cuda.h).
//
// Legend: T rows of the destination / source, n rows of the list, H heads, D head dim, P peers.
// `rows` are host lists (int64, each in [0, T)); on a GPU they are uploaded once per call (a small
// copy on the current stream). Float tensors are f32 or bf16 unless stated.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace bb::cp {

// out [n, ...] (src's dtype) = src[rows[i]]; src [T, ...] of any dtype with 2- or 4-byte elements.
Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& rows, MemCategory cat);
// dst [T, W] f32: dst[rows[i]] += src[i]  (src [n, W]; rows distinct).
void scatter_add_rows(Tensor& dst, const Tensor& src, const std::vector<int64_t>& rows);
// out [H, n] f32 = lse[:, rows[i]]; lse [H, T] f32.
Tensor gather_cols(const Tensor& lse, const std::vector<int64_t>& rows, MemCategory cat);
// The online-softmax merge of a partial result for rows `rows` of the accumulators:
//   m = log(exp(lse_acc[h, r]) + exp(lse_p[h, i])),
//   o_acc[r, h] = exp(lse_acc[h, r] - m) o_acc[r, h] + exp(lse_p[h, i] - m) o_p[i, h],
//   lse_acc[h, r] = m,          r = rows[i]
// o_acc [T, H, D] f32, lse_acc [H, T] f32 (-inf: nothing seen yet), o_p [n, H, D], lse_p [H, n] f32
// (-inf rows add nothing).
void merge_partial(Tensor& o_acc, Tensor& lse_acc, const Tensor& o_p, const Tensor& lse_p,
                   const std::vector<int64_t>& rows);
// out [P T, hc, D] (src's dtype): block p = src[:, start[p] .. start[p] + hc, :]; src [T, H, D].
Tensor split_heads(const Tensor& src, const std::vector<int64_t>& start, int64_t hc, MemCategory cat);
// The inverse: src [P T, hc, D], block p (rows [p T, (p + 1) T)) goes to dst[:, start[p] .. + hc, :]
// of dst [T, H, D]: assigned (dst in src's dtype) or, with accumulate, added (dst f32; blocks whose
// head ranges overlap sum).
void join_heads(Tensor& dst, const Tensor& src, const std::vector<int64_t>& start, int64_t hc,
                bool accumulate);

}  // namespace bb::cp
