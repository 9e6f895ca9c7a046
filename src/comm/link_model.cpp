// link_model.cpp — the bandwidth-latency model of collectives (link_model.h).
#include "comm/link_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "core/error.h"

namespace bb::comm {

void LinkModel::validate(const std::string& table) const {
  BB_CHECK(gpus_per_node >= 1 && gpus_per_node <= 1024, table, ".gpus_per_node = ", gpus_per_node,
           ": must be in [1, 1024]");
  for (auto [key, v] : {std::pair<const char*, double>{"intra_gbps", intra_gbps}, {"inter_gbps", inter_gbps}})
    BB_CHECK(std::isfinite(v) && v > 0 && v <= 1e5, table, ".", key, " = ", v,
             ": must be a bandwidth in GB/s in (0, 100000]");
  for (auto [key, v] :
       {std::pair<const char*, double>{"intra_latency_us", intra_latency_us}, {"inter_latency_us", inter_latency_us}})
    BB_CHECK(std::isfinite(v) && v >= 0 && v <= 1e6, table, ".", key, " = ", v,
             ": must be a latency in microseconds in [0, 1000000]");
}

std::string LinkModel::str() const {
  char buf[200];
  std::snprintf(buf, sizeof buf, "%lld GPUs/node, intra-node %.4g GB/s + %.4g us, inter-node %.4g GB/s + %.4g us",
                static_cast<long long>(gpus_per_node), intra_gbps, intra_latency_us, inter_gbps, inter_latency_us);
  return buf;
}

void LinkModel::ring(const std::vector<int>& world_ranks, double* bytes_per_s, double* latency_s) const {
  std::map<int64_t, int64_t> per_node;
  for (int r : world_ranks) ++per_node[node_of(r)];
  int64_t k = 0;
  for (const auto& [node, count] : per_node) k = std::max(k, count);
  if (per_node.size() <= 1) {
    *bytes_per_s = intra_gbps * 1e9;
    *latency_s = intra_latency_us * 1e-6;
  } else {
    *bytes_per_s = std::min(intra_gbps, static_cast<double>(k) * inter_gbps) * 1e9;
    *latency_s = inter_latency_us * 1e-6;
  }
}

double LinkModel::all_gather_s(const std::vector<int>& world_ranks, int64_t out_bytes) const {
  const double n = static_cast<double>(world_ranks.size());
  if (n <= 1 || out_bytes <= 0) return 0;
  double bw = 0, lat = 0;
  ring(world_ranks, &bw, &lat);
  return lat + (n - 1) / n * static_cast<double>(out_bytes) / bw;
}

double LinkModel::reduce_scatter_s(const std::vector<int>& world_ranks, int64_t in_bytes) const {
  return all_gather_s(world_ranks, in_bytes);  // the same ring traffic, reversed
}

double LinkModel::all_reduce_s(const std::vector<int>& world_ranks, int64_t bytes) const {
  const double n = static_cast<double>(world_ranks.size());
  if (n <= 1 || bytes <= 0) return 0;
  double bw = 0, lat = 0;
  ring(world_ranks, &bw, &lat);
  return lat + 2 * (n - 1) / n * static_cast<double>(bytes) / bw;
}

double LinkModel::broadcast_s(const std::vector<int>& world_ranks, int64_t bytes) const {
  if (world_ranks.size() <= 1 || bytes <= 0) return 0;
  double bw = 0, lat = 0;
  ring(world_ranks, &bw, &lat);
  return lat + static_cast<double>(bytes) / bw;
}

double LinkModel::all_to_all_s(const std::vector<int>& world_ranks, int me, const std::vector<int64_t>& send_bytes,
                               const std::vector<int64_t>& recv_bytes) const {
  const size_t n = world_ranks.size();
  BB_CHECK(me >= 0 && static_cast<size_t>(me) < n && send_bytes.size() == n && recv_bytes.size() == n,
           "LinkModel::all_to_all_s: ", n, " members, index ", me, ", ", send_bytes.size(), " send and ",
           recv_bytes.size(), " receive sizes");
  const int64_t my_node = node_of(world_ranks[static_cast<size_t>(me)]);
  int64_t send_in = 0, recv_in = 0, send_out = 0, recv_out = 0;
  bool spans = false;
  for (size_t p = 0; p < n; ++p) {
    const bool same = node_of(world_ranks[p]) == my_node;
    spans = spans || !same;
    if (static_cast<int>(p) == me) continue;
    (same ? send_in : send_out) += send_bytes[p];
    (same ? recv_in : recv_out) += recv_bytes[p];
  }
  if (send_in + recv_in + send_out + recv_out == 0) return 0;
  const double t_in = static_cast<double>(std::max(send_in, recv_in)) / (intra_gbps * 1e9);
  const double t_out = static_cast<double>(std::max(send_out, recv_out)) / (inter_gbps * 1e9);
  return (spans ? inter_latency_us : intra_latency_us) * 1e-6 + std::max(t_in, t_out);
}

double LinkModel::send_recv_s(int64_t my_world_rank, int64_t peer_world_rank, int64_t bytes) const {
  if (bytes <= 0) return 0;
  const bool same = node_of(my_world_rank) == node_of(peer_world_rank);
  return (same ? intra_latency_us : inter_latency_us) * 1e-6 +
         static_cast<double>(bytes) / ((same ? intra_gbps : inter_gbps) * 1e9);
}

}  // namespace bb::comm
