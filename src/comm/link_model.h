// link_model.h — the time one rank spends on the wire in a collective, from a bandwidth-latency
// model of the links between GPUs (DESIGN.md sec. 12). The emulated communication backend
// (comm/emulated.h) keeps a stream busy for exactly this long; the planner prices a job with it.
//
// The machine: nodes of `gpus_per_node` GPUs; world rank r sits on node r / gpus_per_node. Inside
// a node every pair of GPUs is linked at `intra_gbps` per GPU and direction (NVLink through
// NVSwitch); between nodes each GPU has its own NIC of `inter_gbps` (rail-optimised InfiniBand).
// Bandwidths are bus bandwidths in the sense of NCCL's tests (GB/s = 1e9 bytes/s): what one rank
// sustains in a large collective, protocol overheads included.
//
// Per collective of a group of n members (m nodes among them, k members on the busiest node),
// S bytes as the operation names them (comm.h), t = latency + bytes / bandwidth:
//   all_gather       (n-1)/n x S_out            ring
//   reduce_scatter   (n-1)/n x S_in             ring
//   all_reduce       2 (n-1)/n x S              ring (reduce-scatter + all-gather)
//   broadcast        S                          pipelined ring
//   ring bandwidth   intra_gbps on one node; across nodes k rings share the node's k NICs,
//                    so min(intra_gbps, k x inter_gbps) (one member per node: one NIC)
//   all_to_all_v     max over {same node, other nodes} of max(bytes sent, bytes received) to /
//                    from that class of peers over its bandwidth (the two classes move at once;
//                    a rank's own rows are a local copy and cost nothing on the wire)
//   send / recv      S over the link to the peer
//   latency          intra_latency_us inside a node, inter_latency_us when the group spans
//                    nodes: the fixed cost of one collective (NCCL's small-message time)
// A group of one rank costs nothing. These are estimates of a well-tuned NCCL; real collectives
// can be slower (congestion, stragglers, small messages, multi-node rings).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bb::comm {

struct LinkModel {
  int64_t gpus_per_node = 8;
  // Defaults: an 8-GPU NVLink H100/H200 node (NCCL all_gather / all_to_all bus bandwidth of about
  // 370 GB/s without NVLink multicast), nodes joined by 400 Gb/s InfiniBand per GPU (50 GB/s
  // line rate, about 45 achieved).
  double intra_gbps = 370, inter_gbps = 45;
  double intra_latency_us = 10, inter_latency_us = 20;

  // Errors naming the key (`table` prefixes it, e.g. "emulate") for values out of range.
  void validate(const std::string& table = "emulate") const;
  // "8 GPUs/node, NVLink 370 GB/s + 10 us, network 45 GB/s + 20 us"
  std::string str() const;

  int64_t node_of(int64_t world_rank) const { return world_rank / gpus_per_node; }

  // Seconds on the wire for one member of the group whose members are `world_ranks` (in group
  // order; for the all-to-all, this member is index `me`).
  double all_gather_s(const std::vector<int>& world_ranks, int64_t out_bytes) const;
  double reduce_scatter_s(const std::vector<int>& world_ranks, int64_t in_bytes) const;
  double all_reduce_s(const std::vector<int>& world_ranks, int64_t bytes) const;
  double broadcast_s(const std::vector<int>& world_ranks, int64_t bytes) const;
  // send_bytes[p] / recv_bytes[p]: bytes to / from member p (this member's own entry is free).
  double all_to_all_s(const std::vector<int>& world_ranks, int me, const std::vector<int64_t>& send_bytes,
                      const std::vector<int64_t>& recv_bytes) const;
  double send_recv_s(int64_t my_world_rank, int64_t peer_world_rank, int64_t bytes) const;

 private:
  // Bandwidth (bytes/s) and latency (s) of a ring over these members.
  void ring(const std::vector<int>& world_ranks, double* bytes_per_s, double* latency_s) const;
};

}  // namespace bb::comm
