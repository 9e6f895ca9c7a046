// mesh.cpp — layout checks and the process groups of a mesh (mesh.h).
#include "comm/mesh.h"

#include <utility>
#include <vector>

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
  const int64_t dpcp = layout.dp * layout.cp, edp = layout.edp();
  // Every rank's coordinates, and from them every group's color and key on every rank: each
  // rank computes the same lists, so a backend without peers (emulated) can split by them too.
  struct Coords {
    int64_t pp, local, dp, cp, ep, edp;
  };
  auto coords = [&](int64_t r) {
    const int64_t local = r % dpcp;
    return Coords{r / dpcp, local, local / layout.cp, local % layout.cp, local % layout.ep, local / layout.ep};
  };
  const Coords me = coords(world_->rank());
  pp_rank_ = me.pp;
  dp_rank_ = me.dp;
  cp_rank_ = me.cp;
  ep_rank_ = me.ep;
  edp_rank_ = me.edp;
  const int n = world_->size();
  auto split = [&](auto color_key, const char* name) {
    std::vector<int> colors(static_cast<size_t>(n)), keys(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      const auto [color, key] = color_key(coords(r));
      colors[static_cast<size_t>(r)] = static_cast<int>(color);
      keys[static_cast<size_t>(r)] = static_cast<int>(key);
    }
    return world_->split_known(colors, keys, name);
  };
  using P = std::pair<int64_t, int64_t>;
  dp_ = split([&](const Coords& c) { return P{c.pp * layout.cp + c.cp, c.dp}; }, "dp");
  cp_ = split([&](const Coords& c) { return P{c.pp * layout.dp + c.dp, c.cp}; }, "cp");
  dense_ = split([&](const Coords& c) { return P{c.pp, c.local}; }, "dense");
  ep_ = split([&](const Coords& c) { return P{c.pp * edp + c.edp, c.ep}; }, "ep");
  edp_ = split([&](const Coords& c) { return P{c.pp * layout.ep + c.ep, c.edp}; }, "edp");
}

}  // namespace bb
