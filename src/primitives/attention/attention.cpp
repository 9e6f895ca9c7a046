// attention.cpp — boundary checks for causal GQA attention, then the blocked f32 CPU kernels or,
// for CUDA tensors, cuDNN's fused flash attention (attention_cudnn.h).
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

namespace bb {

namespace {

struct AttnDims {
  int64_t T, Hq, Hkv, D, B;
};

void check_attn_dtype(const Tensor& t, DType expected, const char* op, const char* arg) {
  check_defined(t, op, arg);
  BB_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, op, ": argument '", arg,
           "' has dtype ", dtype_name(t.dtype()), ", expected f32 or bf16");
  BB_CHECK(t.dtype() == expected, op, ": argument '", arg, "' has dtype ", dtype_name(t.dtype()),
           " but q has dtype ", dtype_name(expected), " (q, k, v must share one dtype)");
}

// Checks q, k, v and cu_seqlens as the forward and the backward both receive them.
AttnDims check_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& cu_seqlens, float softmax_scale) {
  check_attn_dtype(q, q.dtype(), op, "q");
  check_attn_dtype(k, q.dtype(), op, "k");
  check_attn_dtype(v, q.dtype(), op, "v");
  BB_CHECK(q.dim() == 3, op, ": argument 'q' must be [T, Hq, D], got ", shape_str(q.shape()));
  AttnDims d{};
  d.T = q.size(0);
  d.Hq = q.size(1);
  d.D = q.size(2);
  BB_CHECK(d.T > 0, op, ": empty batch (T = 0 tokens); call attention with at least one token");
  BB_CHECK(d.Hq > 0 && d.D > 0, op, ": q must have at least one head and head dim > 0, got ",
           shape_str(q.shape()));
  check_shape(k, {d.T, -1, d.D}, op, "k");
  d.Hkv = k.size(1);
  BB_CHECK(d.Hkv > 0, op, ": k must have at least one head, got ", shape_str(k.shape()));
  check_shape(v, k.shape(), op, "v");
  BB_CHECK(d.Hq % d.Hkv == 0, op, ": number of query heads Hq = ", d.Hq,
           " is not a multiple of the number of kv heads Hkv = ", d.Hkv);
  BB_CHECK(std::isfinite(softmax_scale), op, ": softmax_scale must be finite, got ", softmax_scale);

  check_dtype(cu_seqlens, DType::i32, op, "cu_seqlens");
  BB_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 2, op,
           ": cu_seqlens must be [B+1] with B >= 1, got ", shape_str(cu_seqlens.shape()));
  BB_CHECK(cu_seqlens.device().is_cpu(), op, ": cu_seqlens must be a host (CPU) tensor, got ",
           cu_seqlens.str());
  d.B = cu_seqlens.size(0) - 1;
  const int32_t* cu = cu_seqlens.data<int32_t>();
  BB_CHECK(cu[0] == 0, op, ": cu_seqlens[0] must be 0, got ", cu[0]);
  for (int64_t b = 1; b <= d.B; ++b)
    BB_CHECK(cu[b] >= cu[b - 1], op, ": cu_seqlens must be non-decreasing, got cu_seqlens[", b,
             "] = ", cu[b], " < cu_seqlens[", b - 1, "] = ", cu[b - 1]);
  BB_CHECK(cu[d.B] == d.T, op, ": cu_seqlens[B] = ", cu[d.B],
           " must equal the number of tokens T = ", d.T);

  check_same_device(q, k, op);
  check_same_device(q, v, op);
  return d;
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

// Scratch for the blocked kernels, sized by the longest sequence (accounted under workspace).
Tensor attention_workspace(const Tensor& cu_seqlens, int64_t num_seqs) {
  const int32_t* cu = cu_seqlens.data<int32_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < num_seqs; ++b) max_len = std::max<int64_t>(max_len, cu[b + 1] - cu[b]);
  return cpu::empty_f32({cpu::attention_fast_workspace_floats(max_len)}, MemCategory::workspace);
}

}  // namespace

Tensor attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& cu_seqlens, float softmax_scale, AttentionSaved* saved) {
  BB_RANGE("attention_forward");
  const char* op = "attention_forward";
  const AttnDims d = check_inputs(op, q, k, v, cu_seqlens, softmax_scale);
  if (use_cuda(op, q)) {
#ifdef BB_WITH_CUDA
    return attention_forward_cudnn(q, k, v, cu_seqlens, softmax_scale, saved);
#endif
  }
  Tensor qf = cpu::as_f32(q), kf = cpu::as_f32(k), vf = cpu::as_f32(v);
  auto [o, of] = output_pair(q.shape(), q.dtype());
  Tensor lse;
  if (saved) lse = Tensor::empty({d.Hq, d.T}, DType::f32, Device::cpu(), MemCategory::activations);
  Tensor ws = attention_workspace(cu_seqlens, d.B);
  cpu::attention_forward_fast(of.data<float>(), saved ? lse.data<float>() : nullptr,
                              qf.data<float>(), kf.data<float>(), vf.data<float>(),
                              cu_seqlens.data<int32_t>(), d.B, d.T, d.Hq, d.Hkv, d.D, softmax_scale,
                              ws.data<float>());
  cpu::store_f32(o, of);
  if (saved) saved->lse = lse;
  return o;
}

AttentionGrads attention_backward(const Tensor& d_o, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& o, const Tensor& cu_seqlens,
                                  float softmax_scale, const AttentionSaved& saved) {
  BB_RANGE("attention_backward");
  const char* op = "attention_backward";
  const AttnDims d = check_inputs(op, q, k, v, cu_seqlens, softmax_scale);
  check_attn_dtype(d_o, q.dtype(), op, "d_o");
  check_attn_dtype(o, q.dtype(), op, "o");
  check_shape(d_o, q.shape(), op, "d_o");
  check_shape(o, q.shape(), op, "o");
  check_shape(saved.lse, {d.Hq, d.T}, op, "saved.lse");
  check_dtype(saved.lse, DType::f32, op, "saved.lse");
  check_same_device(q, d_o, op);
  check_same_device(q, o, op);
  check_same_device(q, saved.lse, op);
  if (use_cuda(op, q)) {
#ifdef BB_WITH_CUDA
    return attention_backward_cudnn(d_o, q, k, v, o, cu_seqlens, softmax_scale, saved);
#endif
  }

  Tensor qf = cpu::as_f32(q), kf = cpu::as_f32(k), vf = cpu::as_f32(v);
  Tensor dof = cpu::as_f32(d_o), off = cpu::as_f32(o);
  auto [dq, dqf] = output_pair(q.shape(), q.dtype());
  auto [dk, dkf] = output_pair(k.shape(), k.dtype());
  auto [dv, dvf] = output_pair(v.shape(), v.dtype());
  Tensor ws = attention_workspace(cu_seqlens, d.B);
  cpu::attention_backward_fast(
      dqf.data<float>(), dkf.data<float>(), dvf.data<float>(), dof.data<float>(), qf.data<float>(),
      kf.data<float>(), vf.data<float>(), off.data<float>(), saved.lse.data<float>(),
      cu_seqlens.data<int32_t>(), d.B, d.T, d.Hq, d.Hkv, d.D, softmax_scale, ws.data<float>());
  cpu::store_f32(dq, dqf);
  cpu::store_f32(dk, dkf);
  cpu::store_f32(dv, dvf);
  return {dq, dk, dv};
}

}  // namespace bb
