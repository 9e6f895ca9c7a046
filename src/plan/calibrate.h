// calibrate.h — `bumblebee plan --calibrate`: the time model's rates (plan/time_model.h)
// measured on this machine's device by running the primitives the model runs.
//
// What it times (median of several calls, the device drained around each):
//   dense GEMM      linear_forward of bf16 [M, K] x [N, K]^T at M = 1K..32K tokens and the
//                   layer shapes of the supported models; x = 2 M N K FLOPs
//   grouped GEMM    experts_forward + experts_backward_data + experts_backward_weight of 128
//                   experts, H 2048, F 768, uniform rows per expert 32..8192; 18 N H F FLOPs
//   attention       attention_forward, then forward + backward, causal, one sequence of
//                   4K..128K tokens, 32 query / 4 key-value heads of dim 128
//   Gated DeltaNet  gated_delta_rule_forward, then forward + backward, 16 key / 32 value heads
//                   of dim 128, 4K..128K tokens (CUDA only: the CPU rule is a reference)
//   elementwise     rmsnorm and swiglu forward + backward, counted as the time model counts them
//   copy            a 1 GiB device copy (2 bytes moved per byte copied)
// `quick` uses small shapes (a smoke test of the command on any device; its rates are not a
// GPU's). Progress goes to `log` (stderr in the CLI).
#pragma once

#include <functional>
#include <string>

#include "core/memory.h"
#include "plan/time_model.h"

namespace bb::plan {

Calibration calibrate(Device dev, bool quick, const std::function<void(const std::string&)>& log = {});

}  // namespace bb::plan
