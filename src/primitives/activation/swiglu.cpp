// swiglu.cpp — boundary checks for SwiGLU, then the CPU reference in fp32 or the CUDA kernels
// (swiglu_cuda.h) depending on where gate_up lives.
#include "primitives/activation/swiglu.h"

#include "core/trace.h"

#include "backend/cpu/util.h"
#include "primitives/activation/swiglu_cuda.h"
#include "primitives/activation/swiglu_ref.h"

namespace bb {

namespace {
void check_gate_up(const Tensor& gate_up, const char* op) {
  check_float(gate_up, op, "gate_up");
  BB_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, op, ": argument 'gate_up' has shape ",
           shape_str(gate_up.shape()), ", expected [N, 2F] (an even number of columns)");
  if (gate_up.device().is_cuda()) {
#ifndef BB_WITH_CUDA
    BB_FAIL(op, ": not implemented on ", gate_up.device().str(),
            " in this build (no CUDA backend)");
#endif
    BB_CHECK(gate_up.dtype() == DType::f32 || gate_up.dtype() == DType::bf16, op,
             ": argument 'gate_up' has dtype ", dtype_name(gate_up.dtype()),
             ", the CUDA path takes f32 or bf16");
  }
}
}  // namespace

Tensor swiglu_forward(const Tensor& gate_up, MemCategory out_cat) {
  BB_RANGE("swiglu_forward");
  check_gate_up(gate_up, "swiglu_forward");
  const int64_t N = gate_up.size(0), F = gate_up.size(1) / 2;
  if (gate_up.device().is_cuda()) {
    Tensor h = Tensor::empty({N, F}, gate_up.dtype(), gate_up.device(), out_cat);
#ifdef BB_WITH_CUDA
    cuda::swiglu_forward(h.raw(), gate_up.raw(), gate_up.dtype(), N, F);
#endif
    return h;
  }
  Tensor gu = cpu::as_f32(gate_up);
  Tensor h32 =
      cpu::empty_f32({N, F}, gate_up.dtype() == DType::f32 ? out_cat : MemCategory::workspace);
  ref::swiglu_forward(h32.data<float>(), gu.data<float>(), N, F);
  if (gate_up.dtype() == DType::f32) return h32;
  Tensor h = Tensor::empty({N, F}, gate_up.dtype(), Device::cpu(), out_cat);
  cpu::store_f32(h, h32);
  return h;
}

Tensor swiglu_backward(const Tensor& d_h, const Tensor& gate_up) {
  BB_RANGE("swiglu_backward");
  check_gate_up(gate_up, "swiglu_backward");
  const int64_t N = gate_up.size(0), F = gate_up.size(1) / 2;
  check_float(d_h, "swiglu_backward", "d_h");
  check_shape(d_h, {N, F}, "swiglu_backward", "d_h");
  check_same_device(d_h, gate_up, "swiglu_backward");
  if (gate_up.device().is_cuda()) {
    BB_CHECK(d_h.dtype() == DType::f32 || d_h.dtype() == DType::bf16,
             "swiglu_backward: argument 'd_h' has dtype ", dtype_name(d_h.dtype()),
             ", the CUDA path takes f32 or bf16");
    Tensor d = Tensor::empty({N, 2 * F}, gate_up.dtype(), gate_up.device(),
                             MemCategory::activations);
#ifdef BB_WITH_CUDA
    cuda::swiglu_backward(d.raw(), d_h.raw(), d_h.dtype(), gate_up.raw(), gate_up.dtype(), N, F);
#endif
    return d;
  }
  Tensor gu = cpu::as_f32(gate_up);
  Tensor dh = cpu::as_f32(d_h);
  const bool f32 = gate_up.dtype() == DType::f32;
  Tensor d32 = cpu::empty_f32({N, 2 * F}, f32 ? MemCategory::activations : MemCategory::workspace);
  ref::swiglu_backward(d32.data<float>(), dh.data<float>(), gu.data<float>(), N, F);
  if (f32) return d32;
  Tensor d = Tensor::empty({N, 2 * F}, gate_up.dtype(), Device::cpu(), MemCategory::activations);
  cpu::store_f32(d, d32);
  return d;
}

}  // namespace bb
