// attention.cpp — boundary checks for GQA attention over packed sequences (query and key blocks),
// then the blocked f32 CPU kernels or, for CUDA tensors, cuDNN's fused flash attention
// (attention_cudnn.h).
//
// Backward convention: dq, dk, dv are activation gradients, WRITTEN (=); there are no parameters.
// CPU: bf16 inputs are widened to f32 workspace copies; outputs are computed in f32 and stored
// back. The CPU path runs attention_cpu_fast.h (GEMM tiles, f32 sums); the loop reference in
// attention_ref.h is kept as the test oracle and is not called from here.
#include "primitives/attention/attention.h"

#include "core/trace.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "backend/cpu/util.h"
#include "primitives/attention/attention_cpu_fast.h"
#include "primitives/attention/attention_cudnn.h"
#include "primitives/attention/attention_ref.h"

namespace bb {

namespace {

struct AttnDims {
  int64_t Tq, Tkv, Hq, Hkv, D, B;
};

void check_attn_dtype(const Tensor& t, DType expected, const char* op, const char* arg) {
  check_defined(t, op, arg);
  BB_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, op, ": argument '", arg,
           "' has dtype ", dtype_name(t.dtype()), ", expected f32 or bf16");
  BB_CHECK(t.dtype() == expected, op, ": argument '", arg, "' has dtype ", dtype_name(t.dtype()),
           " but q has dtype ", dtype_name(expected), " (q, k, v must share one dtype)");
}

// Checks one offsets tensor: [B+1] i32 on the host, 0 first, non-decreasing, `total` last.
void check_offsets(const char* op, const char* arg, const Tensor& cu, int64_t total,
                   const char* what) {
  check_dtype(cu, DType::i32, op, arg);
  BB_CHECK(cu.dim() == 1 && cu.size(0) >= 2, op, ": ", arg, " must be [B+1] with B >= 1, got ",
           shape_str(cu.shape()));
  BB_CHECK(cu.device().is_cpu(), op, ": ", arg, " must be a host (CPU) tensor, got ", cu.str());
  const int64_t B = cu.size(0) - 1;
  const int32_t* c = cu.data<int32_t>();
  BB_CHECK(c[0] == 0, op, ": ", arg, "[0] must be 0, got ", c[0]);
  for (int64_t b = 1; b <= B; ++b)
    BB_CHECK(c[b] >= c[b - 1], op, ": ", arg, " must be non-decreasing, got ", arg, "[", b,
             "] = ", c[b], " < ", arg, "[", b - 1, "] = ", c[b - 1]);
  BB_CHECK(c[B] == total, op, ": ", arg, "[B] = ", c[B], " must equal the number of ", what,
           " = ", total);
}

// Checks q, k, v and the args as the forward and the backward both receive them.
AttnDims check_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                      const AttentionArgs& args) {
  check_attn_dtype(q, q.dtype(), op, "q");
  check_attn_dtype(k, q.dtype(), op, "k");
  check_attn_dtype(v, q.dtype(), op, "v");
  BB_CHECK(q.dim() == 3, op, ": argument 'q' must be [Tq, Hq, D], got ", shape_str(q.shape()));
  AttnDims d{};
  d.Tq = q.size(0);
  d.Hq = q.size(1);
  d.D = q.size(2);
  BB_CHECK(d.Tq > 0, op, ": empty batch (Tq = 0 query tokens); call attention with at least one token");
  BB_CHECK(d.Hq > 0 && d.D > 0, op, ": q must have at least one head and head dim > 0, got ",
           shape_str(q.shape()));
  BB_CHECK(k.dim() == 3, op, ": argument 'k' must be [Tkv, Hkv, D], got ", shape_str(k.shape()));
  check_shape(k, {-1, -1, d.D}, op, "k");
  d.Tkv = k.size(0);
  d.Hkv = k.size(1);
  BB_CHECK(d.Hkv > 0, op, ": k must have at least one head, got ", shape_str(k.shape()));
  check_shape(v, k.shape(), op, "v");
  BB_CHECK(d.Hq % d.Hkv == 0, op, ": number of query heads Hq = ", d.Hq,
           " is not a multiple of the number of kv heads Hkv = ", d.Hkv);
  BB_CHECK(std::isfinite(args.softmax_scale), op, ": softmax_scale must be finite, got ",
           args.softmax_scale);

  check_defined(args.cu_seqlens_q, op, "cu_seqlens_q");
  check_offsets(op, "cu_seqlens_q", args.cu_seqlens_q, d.Tq, "query tokens Tq");
  d.B = args.cu_seqlens_q.size(0) - 1;
  if (args.cu_seqlens_kv.defined()) {
    check_offsets(op, "cu_seqlens_kv", args.cu_seqlens_kv, d.Tkv, "key tokens Tkv");
    BB_CHECK(args.cu_seqlens_kv.size(0) == d.B + 1, op, ": cu_seqlens_kv has ",
             args.cu_seqlens_kv.size(0) - 1, " sequences, cu_seqlens_q ", d.B);
  } else {
    BB_CHECK(d.Tkv == d.Tq, op, ": without cu_seqlens_kv the keys are the queries' tokens, but k has ",
             d.Tkv, " tokens and q ", d.Tq, " (give cu_seqlens_kv)");
  }
  if (args.mask == AttentionMask::causal_bottom_right) {
    const int32_t* cq = args.cu_seqlens_q.data<int32_t>();
    const int32_t* ck = args.kv_offsets().data<int32_t>();
    for (int64_t b = 0; b < d.B; ++b)
      BB_CHECK(ck[b + 1] - ck[b] >= cq[b + 1] - cq[b], op, ": the causal_bottom_right mask needs at "
               "least as many keys as queries in every sequence; sequence ", b, " has ",
               cq[b + 1] - cq[b], " queries and ", ck[b + 1] - ck[b], " keys");
  }

  check_same_device(q, k, op);
  check_same_device(q, v, op);
  return d;
}

ref::RefMask ref_mask(AttentionMask m) {
  switch (m) {
    case AttentionMask::causal: return ref::RefMask::causal;
    case AttentionMask::causal_bottom_right: return ref::RefMask::causal_bottom_right;
    case AttentionMask::none: return ref::RefMask::none;
  }
  return ref::RefMask::causal;
}

// True when the call goes to the CUDA path; throws for a device this build cannot run.
bool use_cuda(const char* op, const Tensor& q) {
  if (q.device().is_cpu()) return false;
#ifdef BB_WITH_CUDA
  if (q.device().is_cuda()) return true;
#endif
  BB_FAIL(op, ": not implemented on ", q.device().str(), " in this build (no CUDA backend)");
}

// A new tensor of `dt` under activations, and the f32 buffer the reference writes into (the same
// tensor when dt is f32).
std::pair<Tensor, Tensor> output_pair(const Shape& shape, DType dt) {
  Tensor out = Tensor::empty(shape, dt, Device::cpu(), MemCategory::activations);
  Tensor out_f = dt == DType::f32 ? out : cpu::empty_f32(shape, MemCategory::workspace);
  return {out, out_f};
}

int64_t longest(const Tensor& cu) {
  const int32_t* c = cu.data<int32_t>();
  int64_t m = 0;
  for (int64_t b = 0; b + 1 < cu.size(0); ++b) m = std::max<int64_t>(m, c[b + 1] - c[b]);
  return m;
}

// Scratch for the blocked kernels, sized by the longest sequences (accounted under workspace).
Tensor attention_workspace(const AttentionArgs& args) {
  return cpu::empty_f32({std::max<int64_t>(1, cpu::attention_fast_workspace_floats(
                                                  longest(args.cu_seqlens_q), longest(args.kv_offsets())))},
                        MemCategory::workspace);
}

}  // namespace

const char* attention_mask_name(AttentionMask m) {
  switch (m) {
    case AttentionMask::causal: return "causal";
    case AttentionMask::causal_bottom_right: return "causal_bottom_right";
    case AttentionMask::none: return "none";
  }
  return "?";
}

Tensor attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                         const AttentionArgs& args, AttentionSaved* saved) {
  BB_RANGE("attention_forward");
  const char* op = "attention_forward";
  const AttnDims d = check_inputs(op, q, k, v, args);
  if (use_cuda(op, q)) {
#ifdef BB_WITH_CUDA
    return attention_forward_cudnn(q, k, v, args, saved);
#endif
  }
  Tensor qf = cpu::as_f32(q), kf = cpu::as_f32(k), vf = cpu::as_f32(v);
  auto [o, of] = output_pair(q.shape(), q.dtype());
  Tensor lse;
  if (saved) lse = Tensor::empty({d.Hq, d.Tq}, DType::f32, Device::cpu(), MemCategory::activations);
  Tensor ws = attention_workspace(args);
  cpu::attention_forward_fast(of.data<float>(), saved ? lse.data<float>() : nullptr,
                              qf.data<float>(), kf.data<float>(), vf.data<float>(),
                              args.cu_seqlens_q.data<int32_t>(), args.kv_offsets().data<int32_t>(),
                              d.B, d.Tq, d.Hq, d.Hkv, d.D, args.softmax_scale, ref_mask(args.mask),
                              ws.data<float>());
  cpu::store_f32(o, of);
  if (saved) saved->lse = lse;
  return o;
}

AttentionGrads attention_backward(const Tensor& d_o, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& o, const AttentionArgs& args,
                                  const AttentionSaved& saved) {
  BB_RANGE("attention_backward");
  const char* op = "attention_backward";
  const AttnDims d = check_inputs(op, q, k, v, args);
  check_attn_dtype(d_o, q.dtype(), op, "d_o");
  check_attn_dtype(o, q.dtype(), op, "o");
  check_shape(d_o, q.shape(), op, "d_o");
  check_shape(o, q.shape(), op, "o");
  check_shape(saved.lse, {d.Hq, d.Tq}, op, "saved.lse");
  check_dtype(saved.lse, DType::f32, op, "saved.lse");
  check_same_device(q, d_o, op);
  check_same_device(q, o, op);
  check_same_device(q, saved.lse, op);
  if (use_cuda(op, q)) {
#ifdef BB_WITH_CUDA
    return attention_backward_cudnn(d_o, q, k, v, o, args, saved);
#endif
  }

  Tensor qf = cpu::as_f32(q), kf = cpu::as_f32(k), vf = cpu::as_f32(v);
  Tensor dof = cpu::as_f32(d_o), off = cpu::as_f32(o);
  auto [dq, dqf] = output_pair(q.shape(), q.dtype());
  auto [dk, dkf] = output_pair(k.shape(), k.dtype());
  auto [dv, dvf] = output_pair(v.shape(), v.dtype());
  Tensor ws = attention_workspace(args);
  cpu::attention_backward_fast(
      dqf.data<float>(), dkf.data<float>(), dvf.data<float>(), dof.data<float>(), qf.data<float>(),
      kf.data<float>(), vf.data<float>(), off.data<float>(), saved.lse.data<float>(),
      args.cu_seqlens_q.data<int32_t>(), args.kv_offsets().data<int32_t>(), d.B, d.Tq, d.Tkv,
      d.Hq, d.Hkv, d.D, args.softmax_scale, ref_mask(args.mask), ws.data<float>());
  cpu::store_f32(dq, dqf);
  cpu::store_f32(dk, dkf);
  cpu::store_f32(dv, dvf);
  return {dq, dk, dv};
}

}  // namespace bb
