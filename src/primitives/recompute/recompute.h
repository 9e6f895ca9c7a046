// recompute.h — the named parts of selective recompute (primitives.recompute =
// "selective[:part,part,...]", skills/recompute.md). A part names the internal activations of
// one kind of block that the training forward does not keep; that block's backward rebuilds
// them from what it does keep, by calling the same primitives on the same inputs (so the
// rebuilt tensors, and every gradient, are bit-identical to recompute = none).
//
//   norms           every block's input-norm output h (kept: the block input x and the rstd)
//   attention       the QK-norm + RoPE outputs q_rot, k_rot and the gated o_proj input
//                   (kept: the q/k/v projections, the attention output o and lse, the gate)
//   core_attention  the attention output o and its lse (kept: q_rot, k_rot, v unless
//                   `attention` drops them too); backward reruns the attention forward
//   gdn             the Gated DeltaNet's conv outputs silu(conv(q|k|v)) (kept: the conv inputs)
//   mlp             the dense MLP's gate_up and swiglu outputs (kept: h, or x under `norms`)
//   shared_expert   the shared expert's gate_up and swiglu outputs (kept: as mlp)
//   moe_experts     the routed experts' fc1 output and activation (kept: the expert input rows)
//
// Blocks read the set from BatchContext::recompute_drop (set by the schedule for the training
// forward only); a block whose kind has no listed part keeps everything.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bb {

enum class RecomputePart : uint32_t {
  norms,
  attention,
  core_attention,
  gdn,
  mlp,
  shared_expert,
  moe_experts,
  count_
};

// The part names in enum order (the spelling of the config and of errors).
inline const std::vector<std::string>& recompute_part_names() {
  static const std::vector<std::string> names = {"norms", "attention",     "core_attention", "gdn",
                                                 "mlp",   "shared_expert", "moe_experts"};
  return names;
}

// `selective` without a list: the parts whose rebuild is elementwise or a depthwise conv (no
// GEMM, no attention), i.e. the cheapest recompute per byte saved (skills/recompute.md).
inline const std::vector<std::string>& recompute_default_parts() {
  static const std::vector<std::string> names = {"norms", "attention", "gdn"};
  return names;
}

// A set of parts (a bit per RecomputePart).
struct RecomputeParts {
  uint32_t bits = 0;
  bool has(RecomputePart p) const { return (bits >> static_cast<uint32_t>(p)) & 1u; }
  void add(RecomputePart p) { bits |= 1u << static_cast<uint32_t>(p); }
  bool empty() const { return bits == 0; }
};

}  // namespace bb
