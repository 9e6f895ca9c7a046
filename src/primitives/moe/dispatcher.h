// dispatcher.h — MoE dispatch / combine (family `moe_dispatch`): moves a layer's permuted token
// rows to the ranks that own their experts, runs the experts there, and moves the expert outputs
// back. The MoE block calls it between permute and unpermute; it never knows how many ranks
// there are, how rows travel or in how many chunks (DESIGN.md sec. 11).
//
// Legend: N permuted rows of this rank (grouped by global expert, permute.h), E global experts,
// P ranks of the expert-parallel (EP) group, E_l = E / P experts held by this rank (global ids
// [first_local_expert, + E_l)), M rows this rank's experts receive, H hidden, F expert ffn.
// Expert e lives on EP rank e / E_l.
//
//   forward   x_perm [N, H], row_prob [N] f32 or undefined, tokens_per_expert [E] (host)
//             -> y_perm [N, H] in x_perm's row order: ExpertCalls::forward applied to every
//             row by the rank that holds the row's expert
//   forward_for_backward  the inputs of forward -> nothing: the same dispatch (the rows move
//             exactly as in forward) and ExpertCalls::rebuild (fc1 + activation) per group of
//             rows, filling `state` as forward would, bit for bit; no down projection (fc2), no
//             combine. For a recompute pass whose y_perm nobody reads (the MoE block under
//             full recompute with the memory_efficient permute).
//   Plans: a member that moves rows over ranks first makes a plan (every rank's per-expert
//             counts, exchanged over the group). When `state.plan` is set on entry to forward or
//             forward_for_backward it must be a plan this dispatcher made for the same routing
//             (the MoE block hands a recompute the training forward's): it is reused, and no
//             counts are exchanged. A plan of another member or for other counts is an error.
//   backward  d_y_perm [N, H] -> d_x_perm [N, H] and d_row_prob [N] (when row_prob travelled);
//             ExpertCalls::backward_data per group of rows, then ExpertCalls::backward_weight
//             once over all M rows of the micro-batch (after the last dgrad; on the wgrad
//             stream with DispatcherConfig::wgrad_stream, dispatch::expert_wgrad)
//
// The experts see their M rows "grouped by local expert": expert j's rows are contiguous, in
// the order (source EP rank, then the source's own row order), with counts
// state.tokens_per_local_expert [E_l]. That layout is the same for every member, so the expert
// inputs, and hence the results of `allgather` and `alltoall`, are bit-identical.
// row_prob travels with its rows (the memory_efficient permute folds it in before fc2).
// Outputs have the input's dtype, category moe. No parameters; backward outputs are WRITTEN.
//
// Members (skills/dispatcher.md: bytes moved, overlap design, verification):
//   allgather           (baseline) all-gather every rank's rows and counts over the EP group,
//                       keep the local experts' rows; return the outputs with a reduce-scatter
//                       of a zero-filled [P x N_max, H] buffer (exact: one nonzero term per row)
//   alltoall            one small host all-to-all of the per-expert counts, then all-to-all-v
//                       of the rows, sorted by local expert on arrival; the reverse to combine
//   chunked_alltoall:N  every (destination rank, expert) run of rows split into N chunks; all
//                       chunks' dispatches are posted first, then chunk c's experts run while
//                       chunk c+1 is in flight and chunk c-1's combine travels (a GPU overlaps
//                       them on the comm stream); the saved tensors and the wgrad are those of
//                       alltoall (whole micro-batch, same layout)
// On one rank (group of size 1) allgather and alltoall move nothing and copy nothing: forward
// is the experts on x_perm itself.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "comm/comm.h"
#include "core/tensor.h"
#include "primitives/moe/experts.h"

namespace bb {

// What the MoE block runs on the rows the dispatcher brings. Every call is for rows grouped by
// local expert with `counts` [E_l]; the dispatcher calls forward (or, in forward_for_backward,
// rebuild) and backward_data once per chunk of rows (once in all for the unchunked members) and
// backward_weight once per micro-batch.
struct ExpertCalls {
  // y [M_c, H] from rows [M_c, H] (+ row_prob [M_c] or undefined); fills `saved` (never null).
  std::function<Tensor(const Tensor& rows, const Tensor& row_prob,
                       const std::vector<int64_t>& counts, ExpertsSaved* saved)>
      forward;
  // What forward saves, without its output: fills `saved` (gate_up, act) exactly as forward
  // does for the same rows, skipping the down projection (fc2). Called by
  // Dispatcher::forward_for_backward in place of forward.
  std::function<void(const Tensor& rows, const Tensor& row_prob, const std::vector<int64_t>& counts,
                     ExpertsSaved* saved)>
      rebuild;
  // The data gradient of forward: d_x [M_c, H], d_row_prob [M_c], d_gate_up [M_c, 2F] from
  // d_y [M_c, H] and what forward saved for these rows.
  std::function<ExpertsDgrad(const Tensor& d_y, const Tensor& row_prob,
                             const std::vector<int64_t>& counts, const ExpertsSaved& saved)>
      backward_data;
  // The weight gradient over all M rows of the micro-batch (the layout of the state): d_y
  // [M, H], rows [M, H], row_prob [M] or undefined, saved (gate_up, act), d_gate_up [M, 2F].
  std::function<void(const Tensor& d_y, const Tensor& rows, const Tensor& row_prob,
                     const std::vector<int64_t>& counts, const ExpertsSaved& saved,
                     const Tensor& d_gate_up)>
      backward_weight;
};

// How a member moved the rows of one micro-batch (member-specific), kept for its backward.
struct DispatchPlan {
  virtual ~DispatchPlan() = default;
};

// Filled by forward, read by backward of the same micro-batch (one per MoE layer).
struct DispatchState {
  std::vector<int64_t> tokens_per_local_expert;  // [E_l] host: the experts' row counts
  Tensor rows, row_prob;                         // [M, H], [M] f32 or undefined: expert inputs
  ExpertsSaved experts;                          // gate_up [M, 2F], act [M, F]
  std::shared_ptr<const DispatchPlan> plan;
  // M: the rows this rank's experts received.
  int64_t num_rows() const {
    int64_t m = 0;
    for (int64_t c : tokens_per_local_expert) m += c;
    return m;
  }
};

// Rows and their routing probabilities (row_prob undefined when none travel).
struct DispatchRows {
  Tensor rows;
  Tensor row_prob;
};

// What a dispatcher has done since it was built (host counters, for tests and benchmarks).
struct DispatchCounts {
  int64_t forwards = 0;              // forward calls
  int64_t forwards_for_backward = 0; // forward_for_backward calls
  int64_t expert_forwards = 0;       // ExpertCalls::forward calls (fc1 + fc2)
  int64_t expert_rebuilds = 0;       // ExpertCalls::rebuild calls (fc1 only)
  int64_t combines = 0;              // combines posted: one per chunk of a forward (one rank:
                                     // the experts' output handed back as y_perm)
  int64_t plans = 0;                 // plans made (each one exchange of the per-expert counts)
  int64_t plans_reused = 0;          // forwards that reused the plan given in DispatchState
};

class Dispatcher {
 public:
  virtual ~Dispatcher() = default;
  virtual const char* name() const = 0;
  // Experts of the E global ones that this rank holds, and the global id of the first.
  virtual int64_t num_local_experts(int64_t num_experts) const = 0;
  virtual int64_t first_local_expert(int64_t num_experts) const = 0;
  // Collective over the EP group: every rank of it calls forward (and later backward) for the
  // same layer of the same micro-batch, in the same order.
  virtual Tensor forward(const Tensor& x_perm, const Tensor& row_prob,
                         const std::vector<int64_t>& tokens_per_expert, const ExpertCalls& experts,
                         DispatchState& state) = 0;
  // The dispatch half of forward for a pass that only rebuilds the saved state: `state` ends
  // as forward leaves it (same rows, row_prob, saved tensors, counts and plan, so backward is
  // unchanged), the experts run ExpertCalls::rebuild instead of forward, and no combine is
  // posted. Collective like forward (the dispatch still moves the rows); every rank of the
  // group must make the same choice between the two for a layer.
  virtual void forward_for_backward(const Tensor& x_perm, const Tensor& row_prob,
                                    const std::vector<int64_t>& tokens_per_expert,
                                    const ExpertCalls& experts, DispatchState& state) = 0;
  virtual DispatchRows backward(const Tensor& d_y_perm, const ExpertCalls& experts,
                                DispatchState& state) = 0;
  const DispatchCounts& counts() const { return counts_; }

 protected:
  DispatchCounts counts_;
};

// What a member is built with. A group of one rank (or none) is the single-rank case.
struct DispatcherConfig {
  int64_t num_experts = 0;
  comm::GroupPtr group;    // the expert-parallel group (Mesh::ep()); null: this rank alone
  int64_t num_chunks = 1;  // chunked_alltoall:N
  // The experts' weight gradient runs on the wgrad stream ([backend] expert_wgrad_stream):
  // issued where it is today (after the last chunk's dgrad and its dispatch-backward), it then
  // overlaps that all-to-all and the compute stream's next work instead of holding the compute
  // stream. The same kernels on the same data: the gradients are bit-identical.
  bool wgrad_stream = false;
  // Errors naming the problem and the fix: E not divisible by P, chunks out of range.
  void validate(const char* member) const;
  int64_t group_size() const { return group ? group->size() : 1; }
};

namespace dispatch {
// Runs experts.backward_weight on the current stream, or with `side` on the wgrad stream: that
// stream first waits for the work queued so far on the current one (the inputs), and every
// tensor the call reads is marked as used there, so that its memory is not handed out again
// before the call is done. Who reads the gradients joins the wgrad stream: the reduction's
// stream before it reduces (runtime/state.cpp), the compute stream at the end of the
// micro-batch (runtime/schedule.cpp).
void expert_wgrad(bool side, const ExpertCalls& experts, const Tensor& d_y, const Tensor& rows, const Tensor& row_prob,
                  const std::vector<int64_t>& counts, const ExpertsSaved& saved, const Tensor& d_gate_up);
}  // namespace dispatch

// Builds a family member.
using DispatcherFactory = std::unique_ptr<Dispatcher> (*)(const DispatcherConfig&);

// The members (registry.cpp lists them). allgather / alltoall over a group of one rank are the
// single-rank dispatcher (nothing moves); chunked_alltoall chunks even on one rank.
std::unique_ptr<Dispatcher> make_allgather_dispatcher(const DispatcherConfig& cfg);
std::unique_ptr<Dispatcher> make_alltoall_dispatcher(const DispatcherConfig& cfg);
std::unique_ptr<Dispatcher> make_chunked_alltoall_dispatcher(const DispatcherConfig& cfg);
// Every expert local, nothing moves (the rows are handed to the experts as they are).
std::unique_ptr<Dispatcher> make_single_rank_dispatcher(const DispatcherConfig& cfg);

// The largest chunk count chunked_alltoall accepts.
constexpr int64_t kMaxDispatchChunks = 64;

}  // namespace bb
