// mesh.h — the parallel layout and its process groups, with parallel folding (DESIGN.md sec. 4).
//
// world = PP x DP x CP ranks. Attention-side layers see PP x DP x CP; MoE layers see PP x EDP x EP
// over the same ranks, so EP may span CP and DP ranks (EP need not divide DP, only DP x CP).
// Rank order, innermost first: cp, dp, pp, i.e. rank = (pp_i * DP + dp_i) * CP + cp_i. Within a
// pipeline stage the local index l = dp_i * CP + cp_i is split as ep_i = l % EP, edp_i = l / EP:
// EP groups are runs of consecutive ranks. Groups (each built once, at construction):
//   dp     same (pp, cp): the ranks that read different micro-batches
//   cp     same (pp, dp): the ranks that share one sequence
//   dense  same pp: every rank holding a copy of the dense units (all ranks while PP = 1)
//   ep     same (pp, edp): the ranks that split one layer's experts
//   edp    same (pp, ep): the ranks holding a copy of the same experts
#pragma once

#include <cstdint>
#include <string>

#include "comm/comm.h"

namespace bb {

struct ParallelLayout {
  int64_t dp = 1, cp = 1, ep = 1, pp = 1;
  int64_t world() const { return dp * cp * pp; }
  int64_t edp() const { return dp * cp / ep; }
  // Errors (naming the keys and what to change) for a layout that cannot run on `world_size`
  // ranks with a model of `num_experts` routed experts (0: dense). Nothing is allocated before.
  void validate(int64_t world_size, int64_t num_experts) const;
  std::string str() const;  // "dp=2 cp=1 ep=2 pp=1 (edp=1)"
};

class Mesh {
 public:
  // Splits `base` (whose size must equal layout.world()) into the layout's groups.
  Mesh(comm::GroupPtr base, const ParallelLayout& layout);

  const ParallelLayout& layout() const { return layout_; }
  const comm::GroupPtr& world() const { return world_; }
  const comm::GroupPtr& dp() const { return dp_; }
  const comm::GroupPtr& cp() const { return cp_; }
  const comm::GroupPtr& dense() const { return dense_; }
  const comm::GroupPtr& ep() const { return ep_; }
  const comm::GroupPtr& edp() const { return edp_; }
  int64_t rank() const { return world_->rank(); }
  int64_t dp_rank() const { return dp_rank_; }
  int64_t cp_rank() const { return cp_rank_; }
  int64_t pp_rank() const { return pp_rank_; }
  int64_t ep_rank() const { return ep_rank_; }
  int64_t edp_rank() const { return edp_rank_; }

 private:
  ParallelLayout layout_;
  comm::GroupPtr world_, dp_, cp_, dense_, ep_, edp_;
  int64_t dp_rank_ = 0, cp_rank_ = 0, pp_rank_ = 0, ep_rank_ = 0, edp_rank_ = 0;
};

}  // namespace bb
