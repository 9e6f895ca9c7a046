// attention_cudnn.h — the CUDA path of GQA attention (`sdpa`): cuDNN 9's fused flash attention
// over packed (THD, ragged) sequences, queries and keys packed separately, with the masks of
// attention.h (causal top-left, causal bottom-right, none), forward and backward.
//
// attention_forward / attention_backward (attention.h) validate their arguments and call these
// for CUDA tensors; the formulas, layouts and the meaning of every tensor are in attention.h.
// Legend: T tokens, B sequences, Hq / Hkv query / kv heads, D head dim.
//   q              [Tq, Hq, D]   bf16, cuda          in
//   k, v           [Tkv, Hkv, D] bf16, cuda          in
//   args           offsets, mask, scale (already validated by attention.cpp); every sequence
//                  with queries must have keys
//   o              [Tq, Hq, D]   bf16, activations   out
//   saved->lse     [Hq, Tq]      f32, activations    out  natural log: lse_i = log sum_j exp(s_ij),
//                                                        exactly the CPU reference's convention
//   d_o            [T, Hq, D]   bf16                in
//   dq / dk / dv   shapes of q / k / v, bf16, activations, WRITTEN (=) (no parameters here);
//                  dq is accumulated in f32 inside cuDNN and rounded once; dk / dv of a kv head
//                  are the sum over its Hq/Hkv query heads.
// Scratch (offsets, cuDNN's workspace, f32 dq accumulator, per-query-head dk/dv for GQA) is
// allocated per call under MemCategory::workspace and released on return.
//
// Everything runs on cuda::stream(). The offsets go host -> device inside a kernel's launch
// parameters (no host synchronisation, no pinned staging). Graphs and execution plans are built
// once per (direction, device, batch bucket, query and key token buckets, Hq, Hkv, D, dtype,
// mask) and cached for the life of the process; the plan is the first engine cuDNN's heuristics
// (mode A) can finalize.
// One sequence that fills its token bucket exactly (Tq == Tkv) runs dense graphs (no ragged
// offsets, stats in [Hq, T], no transposes) when cuDNN accepts them, the packed ones otherwise
// (one line on stderr per refused shape).
// A configuration cuDNN cannot run packed throws bb::Error naming the shape.
// f32 (or f16) inputs are rejected: cuDNN's fused attention has no f32 I/O.
#pragma once

#ifdef BB_WITH_CUDA

#include <cstdint>
#include <string>

#include "core/tensor.h"
#include "primitives/attention/attention.h"

namespace bb {

Tensor attention_forward_cudnn(const Tensor& q, const Tensor& k, const Tensor& v,
                               const AttentionArgs& args, AttentionSaved* saved);

AttentionGrads attention_backward_cudnn(const Tensor& d_o, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const Tensor& o,
                                        const AttentionArgs& args, const AttentionSaved& saved);

// The cuDNN library file to load ([backend] cudnn_library; "" = libcudnn.so.9 from the library
// path). Must be chosen before the first attention call; changing it afterwards is an error.
void set_cudnn_library(const std::string& file);
// cuDNN's run-time version (e.g. 91900); throws when cuDNN cannot be loaded.
int64_t cudnn_runtime_version();
// Number of graphs (forward and backward) built so far in this process (tests check the cache).
int64_t attention_cudnn_graph_count();
// Number of forward and backward calls that ran a dense graph (tests check which graph ran).
int64_t attention_cudnn_dense_calls();
// The token count the graph of a batch of T tokens is built for (T rounded up to 1/8 of its
// power-of-two octave, at least 64), and the batch bucket (B rounded up to a power of two).
int64_t attention_cudnn_token_bucket(int64_t num_tokens);
int64_t attention_cudnn_batch_bucket(int64_t num_seqs);

}  // namespace bb

#endif  // BB_WITH_CUDA
