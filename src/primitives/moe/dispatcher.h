// dispatcher.h — MoE dispatch / combine (family `moe_dispatch`): moves a layer's permuted token
// rows to the ranks that own their experts, and the expert outputs back. The MoE block calls it
// between permute and the experts and between the experts and unpermute; it never knows how
// many ranks there are or how rows travel (DESIGN.md sec. 11).
//
// Legend: N permuted rows of this rank (grouped by global expert, permute.h), E global experts,
// E_l experts held by this rank, M rows this rank's experts receive, H hidden.
//   dispatch           x_perm [N, H], row_prob [N] f32 or undefined, tokens_per_expert [E] (host)
//                      -> rows [M, H] grouped by local expert (+ their row_prob [M]);
//                         state.tokens_per_local_expert [E_l]
//   combine            y_local [M, H] -> y_perm [N, H], in x_perm's row order
//   combine_backward   d_y_perm [N, H] -> d_y_local [M, H]   (the movement of dispatch)
//   dispatch_backward  d_rows [M, H], d_row_prob [M] or undefined
//                      -> d_x_perm [N, H], d_row_prob [N]   (the movement of combine)
// Outputs have the input's dtype, category moe. No parameters; backward outputs are WRITTEN.
// `state` is filled by dispatch and read by the other three calls of the same micro-batch.
// row_prob travels with its rows (the memory_efficient permute folds it in before fc2).
// Members: `allgather` (the baseline). On one rank every expert is local and nothing moves:
// dispatch and combine return their input (the single-rank dispatcher below). The multi-rank
// members (all-gather / reduce-scatter, all-to-all, chunked all-to-all) implement this same
// interface over the expert-parallel group the mesh gives them.
#pragma once

#include <memory>
#include <vector>

#include "core/tensor.h"

namespace bb {

struct DispatchState {
  std::vector<int64_t> tokens_per_local_expert;  // [E_l] host: the experts' row counts
};

// Rows and their routing probabilities (row_prob undefined when none travel).
struct DispatchRows {
  Tensor rows;
  Tensor row_prob;
};

class Dispatcher {
 public:
  virtual ~Dispatcher() = default;
  virtual const char* name() const = 0;
  // Experts of the E global ones that this rank holds, and the global id of the first.
  virtual int64_t num_local_experts(int64_t num_experts) const = 0;
  virtual int64_t first_local_expert(int64_t num_experts) const = 0;
  virtual DispatchRows dispatch(const Tensor& x_perm, const Tensor& row_prob,
                                const std::vector<int64_t>& tokens_per_expert,
                                DispatchState& state) = 0;
  virtual Tensor combine(const Tensor& y_local, const DispatchState& state) = 0;
  virtual Tensor combine_backward(const Tensor& d_y_perm, const DispatchState& state) = 0;
  virtual DispatchRows dispatch_backward(const Tensor& d_rows, const Tensor& d_row_prob,
                                         const DispatchState& state) = 0;
};

// Builds a family member for a model of `num_experts` experts.
using DispatcherFactory = std::unique_ptr<Dispatcher> (*)(int64_t num_experts);

// `allgather` on one rank: all experts local, nothing moves (the rows are returned as is).
std::unique_ptr<Dispatcher> make_single_rank_dispatcher(int64_t num_experts);

}  // namespace bb
