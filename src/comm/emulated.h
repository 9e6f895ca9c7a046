// emulated.h — one process plays one rank of an N-rank job (parallel.comm = "emulated",
// DESIGN.md sec. 12): the instrument that times and sizes a rank of a multi-GPU job on one GPU.
//
// Every group of the job is an EmulatedGroup of its real size, with the world ranks its members
// would have. A collective is issued on the stream the real one would use, after the caller's
// queued work (as nccl does); on that stream one kernel moves the bytes this rank would move
// (device copies of the right sizes into the right buffers) and keeps the stream busy for the
// time the link model (link_model.h) gives the wire, so compute, memory and overlap are real and
// only the wire is modelled. The caller's wait() orders its stream after that kernel.
//
// What lands in the buffers: the values a real collective would give if every peer were a copy
// of this rank standing at the peer's place ("clones"). Peer q's data is this rank's, and what q
// sends to member x is what this rank sends to member x + (me - q):
//   all_reduce        sum: n x t, max / min: t
//   reduce_scatter    sum: n x (this rank's block of in), max / min: that block
//   all_gather(_v)    every member's block is a copy of in
//   all_to_all_v      out's block from q = this rank's rows for member (2 me - q) mod n
//   broadcast         t unchanged (the root's value is this rank's)
//   send / recv       recv gets what this rank last sent to the mirrored peer (2 me - peer)
//   host operations   sum: n x v, max / min: v, broadcast: unchanged, all_to_all_host as
//                     all_to_all_v
// Where the clone's rows do not fit the receiver's counts (a pattern that is not the same from
// every rank), the first rows that fit are copied and the rest of the block is zero: every byte
// of every output is written, so a run is a deterministic function of its inputs. The values are
// meaningful for a symmetric job (balanced routing, identical data); losses and gradients of an
// emulated run are not those of the real job, and the trainer says so.
//
// Timing: the kernel reads the GPU clock when it starts, waits (nanosleep) until the copies
// would end with the wire time, copies, and waits until start + wire time. The data thus lands
// at the end of the wire window, as from a real peer; when every wire time is stretched
// (wire_scale > 1, tests), a consumer that forgot to wait reads a buffer not yet written. It
// runs comm_blocks thread blocks of 512 threads (NCCL's channels hold SMs the same way). On CPU
// tensors the same values are copied synchronously and no time is modelled (the totals below
// still count it).
#pragma once

#include <cstdint>
#include <string>

#include "comm/comm.h"
#include "comm/link_model.h"

namespace bb::comm {

struct EmulateConfig {
  int64_t ranks = 8;  // N: the job's ranks
  int64_t rank = 0;   // which of them this process plays
  LinkModel link;
  int64_t comm_blocks = 16;  // thread blocks an emulated collective occupies while on the wire
  // Every modelled wire time x this: 1 the link model, 0 an infinitely fast wire (the step with
  // only compute and the local copies), > 1 slowed (tests: overlapped paths with communication
  // far slower than compute must give bit-identical results).
  double wire_scale = 1;
  // The device's usable memory in GiB (e.g. 79.6 for an 80 GB H100); 0: the card's own. The
  // stream-ordered allocator's pool is capped so that an allocation fails where it would there.
  double device_memory_gib = 0;
  // Tests of fault handling: this process's collective number hang_at_op (1 = the first issued
  // on a GPU stream, counted over every group) never leaves the wire (its kernel holds the
  // stream for a day), as a collective whose peer died would; the collective watchdog must end
  // the job within parallel.timeout_s naming it (comm/watchdog.h). 0: none.
  int64_t hang_at_op = 0;

  // Errors naming the key (emulate.<key>) and the valid range.
  void validate() const;
  // One line for logs and tables: "EMULATED rank 0 of 8 (8 GPUs/node, intra-node ...)".
  std::string str() const;
  // The prefix of every log line of an emulated run: "[EMULATED 0/8, 370+45 GB/s] ".
  std::string tag() const;
};

// The world of cfg.ranks ranks, this process being rank cfg.rank. split() cannot see the other
// ranks' colors: groups come from split_known (the mesh computes every rank's color and key).
GroupPtr make_emulated_world(const EmulateConfig& cfg);

// Emulated wire time (seconds, wire_scale applied) of every collective issued so far in this
// process, per traffic class (EmulatedTotals::kClasses), and their count: what a table can set
// beside the measured step. Reset by reset_emulated_totals().
struct EmulatedTotals {
  static constexpr int kClasses = 5;
  double seconds[kClasses] = {};
  int64_t ops[kClasses] = {};
  int64_t bytes[kClasses] = {};  // sent + received by this rank (bytes on its wire)
  static const char* class_name(int c);  // "ep", "cp", "param_gather", "grad_reduce", "other"
};
EmulatedTotals emulated_totals();
void reset_emulated_totals();

}  // namespace bb::comm
