// mesh.cpp — layout checks and the process groups of a mesh (mesh.h).
#include "comm/mesh.h"

namespace bb {

void ParallelLayout::validate(int64_t world_size, int64_t num_experts) const {
  for (auto [name, v] : {std::pair<const char*, int64_t>{"dp", dp}, {"cp", cp}, {"ep", ep}, {"pp", pp}})
    BB_CHECK(v >= 1, "parallel.", name, " = ", v, ": must be >= 1");
  BB_CHECK(pp == 1, "parallel.pp = ", pp, ": pipeline parallelism is not implemented; set pp = 1 ",
           "(the default recipe uses fsdp + ep + cp instead)");
  BB_CHECK(world() == world_size, "parallel layout ", str(), ": dp x cp x pp = ", world(), " but ",
           world_size, " rank(s) were launched; make the product equal the number of processes ",
           "(or set parallel.dp = 0 to take dp = ranks / (cp x pp))");
  if (num_experts > 0)
    BB_CHECK(num_experts % ep == 0, "parallel.ep = ", ep, " does not divide the model's ", num_experts,
             " routed experts; choose ep among the divisors of ", num_experts);
  else
    BB_CHECK(ep == 1, "parallel.ep = ", ep, " but the model has no routed experts; set ep = 1");
  BB_CHECK(ep <= dp * cp, "parallel.ep = ", ep, " is more than the ", dp * cp, " rank(s) of a pipeline stage (dp x cp = ",
           dp * cp, "): an expert-parallel group is formed from those ranks; launch at least ", ep,
           " processes or lower parallel.ep to a divisor of ", dp * cp);
  BB_CHECK((dp * cp) % ep == 0, "parallel.ep = ", ep, " does not divide dp x cp = ", dp * cp,
           ": expert-parallel groups are formed from the data and context ranks of one stage; choose ep among the ",
           "divisors of ", dp * cp);
}

std::string ParallelLayout::str() const {
  return "dp=" + std::to_string(dp) + " cp=" + std::to_string(cp) + " ep=" + std::to_string(ep) +
         " pp=" + std::to_string(pp) + " (edp=" + std::to_string(ep > 0 ? dp * cp / ep : 0) + ")";
}

Mesh::Mesh(comm::GroupPtr base, const ParallelLayout& layout) : layout_(layout), world_(std::move(base)) {
  BB_CHECK(world_ && world_->size() == layout.world(), "mesh: layout ", layout.str(), " needs ",
           layout.world(), " ranks, the communicator has ", world_ ? world_->size() : 0);
  const int64_t r = world_->rank(), dpcp = layout.dp * layout.cp;
  pp_rank_ = r / dpcp;
  const int64_t local = r % dpcp;
  dp_rank_ = local / layout.cp;
  cp_rank_ = local % layout.cp;
  ep_rank_ = local % layout.ep;
  edp_rank_ = local / layout.ep;
  const int64_t edp = layout.edp();
  auto split = [&](int64_t color, int64_t key, const char* name) {
    return world_->split(static_cast<int>(color), static_cast<int>(key), name);
  };
  dp_ = split(pp_rank_ * layout.cp + cp_rank_, dp_rank_, "dp");
  cp_ = split(pp_rank_ * layout.dp + dp_rank_, cp_rank_, "cp");
  dense_ = split(pp_rank_, local, "dense");
  ep_ = split(pp_rank_ * edp + edp_rank_, ep_rank_, "ep");
  edp_ = split(pp_rank_ * layout.ep + ep_rank_, edp_rank_, "edp");
}

}  // namespace bb
