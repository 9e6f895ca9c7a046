// linear_ce.cpp — the streaming loss head: on the CPU (BLAS for the chunk GEMMs, the online
// logsumexp and softmax gradient from cross_entropy_ref.h) and on CUDA (`matmul` on device
// tensors for the chunk GEMMs, the kernels of loss_cuda.cu for the rest).
//
// NOTES: one logits block of min(ct, T) x min(cv, V) f32 is allocated once per call and reused
// (prefix-packed with row stride nv) for every chunk pair; that keeps the logits peak at exactly
// one chunk without allocator churn. bf16 inputs are converted per chunk (workspace), never
// whole, so the f32 copies are [ct, H] and [cv, H] as well.
// CUDA: the forward keeps the same single f32 block (peak logits exactly ct * cv * 4 bytes) and
// reads its totals back once at the end. The backward with bf16 h/w needs the gradient block in
// bf16 for the bf16 GEMMs next to the f32 recomputed logits, so it walks token sub-chunks of
// ctb = max(1, 2 ct / 3) rows: 6 * ctb * cv <= 4 * ct * cv bytes, still within one chunk
// (ct >= 2). With f32 h/w the gradient overwrites the block in place.
// linear_ce_fused (training, scale known up front): one [ct, V] f32 block per token chunk holds
// the logits, then, in place, their gradient; three GEMMs per chunk (cuda::gemm with explicit
// leading dimensions on CUDA, because the bf16 gradient sits in the f32 rows with stride 2V).
// Parameter gradients accumulate (+=), activation gradients are written (=).
#include "primitives/loss/linear_ce.h"
#include "primitives/loss/loss_head.h"

#include "core/trace.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/gemm.h"
#include "backend/cpu/util.h"
#include "primitives/loss/cross_entropy_ref.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/gemm.h"
#include "backend/cuda/runtime.h"
#include "primitives/linear/linear.h"
#include "primitives/loss/loss_cuda.h"
#endif

namespace bb {

namespace {

void check_config(const LossHeadConfig& cfg, const char* op) {
  BB_CHECK(cfg.chunk_tokens > 0, op, ": cfg.chunk_tokens must be > 0, got ", cfg.chunk_tokens);
  BB_CHECK(cfg.chunk_vocab > 0, op, ": cfg.chunk_vocab must be > 0, got ", cfg.chunk_vocab);
}

void check_fused_config(const LossHeadConfig& cfg, const char* op) {
  BB_CHECK(cfg.fused_chunk_tokens > 0, op, ": cfg.fused_chunk_tokens must be > 0, got ",
           cfg.fused_chunk_tokens);
}

// cfg.bf16_logits on a block of f32 logits: each value rounded to bf16 precision (what a GEMM
// writing bf16 gives), so every path sees the same logits.
void round_logits_cpu(float* x, int64_t n, const LossHeadConfig& cfg) {
  if (!cfg.bf16_logits) return;
  for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(x[i]);
}

#ifdef BB_WITH_CUDA

LossResult linear_ce_forward_cuda(const Tensor& h, const Tensor& w, const Tensor& targets,
                                  const LossHeadConfig& cfg, LossHeadSaved* saved,
                                  const detail::LossHeadDims& dims, const char* op) {
  const Device dev = h.device();
  const int64_t T = dims.num_tokens, V = dims.vocab;
  const int64_t ct = std::min(cfg.chunk_tokens, T), cv = std::min(cfg.chunk_vocab, V);
  Tensor tg = detail::targets_on(targets, dev);
  const int32_t* tgp = tg.data<int32_t>();
  Tensor lse = Tensor::empty({T}, DType::f32, dev, MemCategory::activations);
  Tensor run = Tensor::empty({3 * T}, DType::f32, dev, MemCategory::workspace);
  float* run_max = run.data<float>();
  float* run_sum = run_max + T;
  float* target_logit = run_max + 2 * T;
  // bf16 logits with bf16 operands: the GEMM writes bf16 (half the block); with f32 operands it
  // writes f32, rounded to bf16 precision after.
  const DType xdt = cfg.bf16_logits && h.dtype() == DType::bf16 && w.dtype() == DType::bf16
                        ? DType::bf16
                        : DType::f32;
  Tensor block = Tensor::empty({ct * cv}, xdt, dev, MemCategory::logits);

  for (int64_t t0 = 0; t0 < T; t0 += ct) {
    const int64_t nt = std::min(ct, T - t0);
    const Tensor hc = h.narrow(t0, nt);
    for (int64_t v0 = 0; v0 < V; v0 += cv) {
      const int64_t nv = std::min(cv, V - v0);
      Tensor x = block.narrow(0, nt * nv).view({nt, nv});
      if (xdt == DType::bf16) {
        cuda::gemm(false, true, nt, nv, dims.hidden, 1.0f, hc.raw(), h.dtype(), dims.hidden,
                   w.narrow(v0, nv).raw(), w.dtype(), dims.hidden, 0.0f, x.raw(), DType::bf16, nv,
                   dev.index);
      } else {
        matmul(hc, false, w.narrow(v0, nv), true, x);
        if (cfg.bf16_logits) cuda::round_to_bf16(x.data<float>(), nt * nv);
      }
      cuda::ce_online_update(run_max + t0, run_sum + t0, target_logit + t0, x.raw(), xdt, nv,
                             tgp + t0, nt, v0, nv, v0 == 0);
    }
  }
  const LossResult r = detail::finish_ce_cuda(lse.data<float>(), run_max, run_sum, target_logit,
                                              tg, T, V, op);
  if (saved) {
    saved->logits = Tensor();
    saved->lse = lse;
  }
  return r;
}

void linear_ce_backward_cuda(float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                             const LossHeadConfig& cfg, const LossHeadSaved& saved, Tensor& d_h,
                             Tensor& d_w, const detail::LossHeadDims& dims) {
  const Device dev = h.device();
  const int64_t T = dims.num_tokens, V = dims.vocab, H = dims.hidden;
  const int64_t ct = std::min(cfg.chunk_tokens, T), cv = std::min(cfg.chunk_vocab, V);
  const bool lowp = h.dtype() != DType::f32;  // bf16 GEMM operands: a bf16 gradient block
  const int64_t ctb = lowp ? std::max<int64_t>(1, 2 * ct / 3) : ct;
  Tensor tg = detail::targets_on(targets, dev);
  const int32_t* tgp = tg.data<int32_t>();
  const float* lse = saved.lse.data<float>();
  Tensor block = Tensor::empty({ctb * cv}, DType::f32, dev, MemCategory::logits);
  Tensor dblock = lowp ? Tensor::empty({ctb * cv}, h.dtype(), dev, MemCategory::logits) : block;
  // d_h rows are summed over vocab chunks in f32; non-f32 d_h gets a [ctb, H] f32 accumulator.
  const bool dh_direct = d_h.dtype() == DType::f32;
  Tensor dh_acc =
      dh_direct ? Tensor() : Tensor::empty({ctb, H}, DType::f32, dev, MemCategory::workspace);

  for (int64_t t0 = 0; t0 < T; t0 += ctb) {
    const int64_t nt = std::min(ctb, T - t0);
    const Tensor hc = h.narrow(t0, nt);
    Tensor dh = dh_direct ? d_h.narrow(t0, nt) : dh_acc.narrow(0, nt);
    for (int64_t v0 = 0; v0 < V; v0 += cv) {
      const int64_t nv = std::min(cv, V - v0);
      const Tensor wc = w.narrow(v0, nv);
      Tensor x = block.narrow(0, nt * nv).view({nt, nv});
      Tensor dx = dblock.narrow(0, nt * nv).view({nt, nv});
      matmul(hc, false, wc, true, x);
      if (cfg.bf16_logits) cuda::round_to_bf16(x.data<float>(), nt * nv);
      cuda::ce_softmax_grad(dx.raw(), dx.dtype(), nv, x.raw(), DType::f32, nv, tgp + t0, lse + t0,
                            scale, nt, v0, nv);
      // d_h[chunk] = sum over vocab chunks of d_block @ w[vchunk]; the first chunk overwrites.
      matmul(dx, false, wc, false, dh, 1.0f, v0 == 0 ? 0.0f : 1.0f);
      Tensor dw = d_w.narrow(v0, nv);
      matmul(dx, true, hc, false, dw, 1.0f, 1.0f);
    }
    if (!dh_direct)
      cuda::convert(d_h.narrow(t0, nt).raw(), d_h.dtype(), dh_acc.raw(), DType::f32, nt * H);
  }
}

LossResult linear_ce_fused_cuda(float scale, const Tensor& h, const Tensor& w,
                                const Tensor& targets, const LossHeadConfig& cfg, Tensor& d_h,
                                Tensor& d_w, bool overwrite_dw, const detail::LossHeadDims& dims,
                                const char* op) {
  const Device dev = h.device();
  const int idx = dev.index;
  const int64_t T = dims.num_tokens, V = dims.vocab, H = dims.hidden;
  const int64_t ct = std::min(cfg.fused_chunk_tokens, T);
  if (overwrite_dw && T == 0) d_w.zero_();  // no chunk writes it
  const DType dt = h.dtype();  // GEMM operand dtype of h, w and the gradient block
  // bf16 logits with bf16 operands: a bf16 block (the GEMM writes bf16, the gradient overwrites
  // it in place at the same width); with f32 operands an f32 block rounded to bf16 precision.
  const DType xdt = cfg.bf16_logits && dt == DType::bf16 ? DType::bf16 : DType::f32;
  const int64_t ldd = cuda::ce_fused_grad_ld(V, xdt, dt);
  Tensor tg = detail::targets_on(targets, dev);
  const int32_t* tgp = tg.data<int32_t>();
  Tensor stats = Tensor::empty({4 * T}, DType::f32, dev, MemCategory::workspace);
  float* run_max = stats.data<float>();
  float* run_sum = run_max + T;
  float* target_logit = run_max + 2 * T;
  float* lse = run_max + 3 * T;  // formed by ce_finalize; not kept
  Tensor block = Tensor::empty({ct * V}, xdt, dev, MemCategory::logits);
  // cuBLASLt writes bf16 or f32 C from bf16 operands (and f32 from f32); anything else goes
  // through a [ct, H] f32 workspace and a conversion.
  const bool dh_direct = d_h.dtype() == DType::f32 || d_h.dtype() == dt;
  Tensor dh_acc =
      dh_direct ? Tensor() : Tensor::empty({ct, H}, DType::f32, dev, MemCategory::workspace);

  for (int64_t t0 = 0; t0 < T; t0 += ct) {
    const int64_t nt = std::min(ct, T - t0);
    const void* hc = h.narrow(t0, nt).raw();
    // x [nt, V] (xdt) = h[tc] @ w^T
    cuda::gemm(false, true, nt, V, H, 1.0f, hc, dt, H, w.raw(), dt, H, 0.0f, block.raw(), xdt, V,
               idx);
    if (cfg.bf16_logits && xdt == DType::f32) cuda::round_to_bf16(block.data<float>(), nt * V);
    // x -> scale * (softmax - onehot) in place, dtype dt, row stride ldd
    cuda::ce_fused_rows(block.raw(), xdt, V, dt, tgp + t0, scale, nt, run_max + t0, run_sum + t0,
                        target_logit + t0);
    // d_h[tc] = d @ w   [nt, V] x [V, H]
    Tensor dh_dst = d_h.narrow(t0, nt);
    cuda::gemm(false, false, nt, H, V, 1.0f, block.raw(), dt, ldd, w.raw(), dt, H, 0.0f,
               dh_direct ? dh_dst.raw() : dh_acc.raw(), dh_direct ? d_h.dtype() : DType::f32, H,
               idx);
    if (!dh_direct)
      cuda::convert(dh_dst.raw(), d_h.dtype(), dh_acc.raw(), DType::f32, nt * H);
    // d_w += d^T @ h[tc]   [V, nt] x [nt, H]; the first chunk writes when overwrite_dw (no
    // memset of d_w before the step, no read of it here)
    const float beta = overwrite_dw && t0 == 0 ? 0.0f : 1.0f;
    cuda::gemm(true, false, V, H, nt, 1.0f, block.raw(), dt, ldd, hc, dt, H, beta, d_w.raw(),
               DType::f32, H, idx);
  }
  return detail::finish_ce_cuda(lse, run_max, run_sum, target_logit, tg, T, V, op,
                                "; d_h and d_w are invalid");
}
#endif

}  // namespace

int64_t linear_ce_logits_bytes(int64_t num_tokens, int64_t vocab, const LossHeadConfig& cfg) {
  check_config(cfg, "linear_ce_logits_bytes");
  return std::min(cfg.chunk_tokens, num_tokens) * std::min(cfg.chunk_vocab, vocab) * 4;
}

LossResult linear_ce_forward(const Tensor& h, const Tensor& w, const Tensor& targets,
                             const LossHeadConfig& cfg, LossHeadSaved* saved) {
  BB_RANGE("linear_ce_forward");
  const char* op = "linear_ce_forward";
  check_config(cfg, op);
  const detail::LossHeadDims dims = detail::check_loss_head_inputs(h, w, targets, op);
#ifdef BB_WITH_CUDA
  if (h.device().is_cuda()) return linear_ce_forward_cuda(h, w, targets, cfg, saved, dims, op);
#endif
  const int64_t T = dims.num_tokens, V = dims.vocab, H = dims.hidden;
  const int64_t ct = std::min(cfg.chunk_tokens, T), cv = std::min(cfg.chunk_vocab, V);

  Tensor lse = Tensor::empty({T}, DType::f32, Device::cpu(), MemCategory::activations);
  Tensor block = Tensor::empty({ct * cv}, DType::f32, Device::cpu(), MemCategory::logits);
  float* lse_p = lse.data<float>();
  float* x = block.data<float>();
  const int32_t* tg = targets.data<int32_t>();
  std::vector<double> run_max(ct), run_sum(ct), target_logit(ct);
  LossResult r;

  for (int64_t t0 = 0; t0 < T; t0 += ct) {
    const int64_t nt = std::min(ct, T - t0);
    Tensor hc = cpu::as_f32(h.narrow(t0, nt));
    std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<double>::infinity());
    std::fill(run_sum.begin(), run_sum.end(), 0.0);
    for (int64_t v0 = 0; v0 < V; v0 += cv) {
      const int64_t nv = std::min(cv, V - v0);
      Tensor wc = cpu::as_f32(w.narrow(v0, nv));
      cpu::gemm<float>(false, true, nt, nv, H, 1.0f, hc.data<float>(), wc.data<float>(), 0.0f, x);
      round_logits_cpu(x, nt * nv, cfg);
      ref::online_lse_update<float>(run_max.data(), run_sum.data(), target_logit.data(), x, nv,
                                    tg + t0, nt, v0, nv);
    }
    for (int64_t i = 0; i < nt; ++i) {
      const double l = run_max[i] + std::log(run_sum[i]);
      lse_p[t0 + i] = static_cast<float>(l);
      if (tg[t0 + i] >= 0) {
        r.loss_sum += l - target_logit[i];
        ++r.num_valid;
      }
    }
  }
  if (saved) {
    saved->logits = Tensor();
    saved->lse = lse;
  }
  return r;
}

void linear_ce_backward(float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                        const LossHeadConfig& cfg, const LossHeadSaved& saved, Tensor& d_h,
                        Tensor& d_w) {
  BB_RANGE("linear_ce_backward");
  const char* op = "linear_ce_backward";
  check_config(cfg, op);
  const detail::LossHeadDims dims = detail::check_loss_head_inputs(h, w, targets, op);
  detail::check_loss_head_grads(dims, h, saved, d_h, d_w, op);
#ifdef BB_WITH_CUDA
  if (h.device().is_cuda()) {
    linear_ce_backward_cuda(scale, h, w, targets, cfg, saved, d_h, d_w, dims);
    return;
  }
#endif
  const int64_t T = dims.num_tokens, V = dims.vocab, H = dims.hidden;
  const int64_t ct = std::min(cfg.chunk_tokens, T), cv = std::min(cfg.chunk_vocab, V);

  Tensor block = Tensor::empty({ct * cv}, DType::f32, Device::cpu(), MemCategory::logits);
  // d_h rows are summed over vocab chunks in f32; non-f32 d_h gets a [ct, H] f32 accumulator.
  const bool dh_direct = d_h.dtype() == DType::f32;
  Tensor dh_acc = dh_direct ? Tensor() : cpu::empty_f32({ct, H}, MemCategory::workspace);
  float* x = block.data<float>();
  const int32_t* tg = targets.data<int32_t>();
  const float* lse = saved.lse.data<float>();
  float* dw = d_w.data<float>();

  for (int64_t t0 = 0; t0 < T; t0 += ct) {
    const int64_t nt = std::min(ct, T - t0);
    Tensor hc = cpu::as_f32(h.narrow(t0, nt));
    float* dh = dh_direct ? d_h.data<float>() + t0 * H : dh_acc.data<float>();
    for (int64_t v0 = 0; v0 < V; v0 += cv) {
      const int64_t nv = std::min(cv, V - v0);
      Tensor wc = cpu::as_f32(w.narrow(v0, nv));
      cpu::gemm<float>(false, true, nt, nv, H, 1.0f, hc.data<float>(), wc.data<float>(), 0.0f, x);
      round_logits_cpu(x, nt * nv, cfg);
      ref::softmax_grad_chunk<float>(x, x, nv, tg + t0, lse + t0, scale, nt, v0, nv);
      // d_h[chunk] = sum over vocab chunks of d_block @ w[vchunk]; the first chunk overwrites.
      cpu::gemm<float>(false, false, nt, H, nv, 1.0f, x, wc.data<float>(), v0 == 0 ? 0.0f : 1.0f,
                       dh);
      cpu::gemm<float>(true, false, nv, H, nt, 1.0f, x, hc.data<float>(), 1.0f, dw + v0 * H);
    }
    if (!dh_direct) {
      Tensor dst = d_h.narrow(t0, nt);
      cpu::store_f32(dst, dh_acc.narrow(0, nt));
    }
  }
}

int64_t linear_ce_fused_logits_bytes(int64_t num_tokens, int64_t vocab, const LossHeadConfig& cfg,
                                     DType operands, bool on_cuda) {
  check_fused_config(cfg, "linear_ce_fused_logits_bytes");
  const int64_t b = cfg.bf16_logits && on_cuda && operands == DType::bf16 ? 2 : 4;
  return std::min(cfg.fused_chunk_tokens, num_tokens) * vocab * b;
}

LossResult linear_ce_fused(float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                           const LossHeadConfig& cfg, Tensor& d_h, Tensor& d_w, bool overwrite_dw) {
  BB_RANGE("linear_ce_fused");
  const char* op = "linear_ce_fused";
  check_fused_config(cfg, op);
  const detail::LossHeadDims dims = detail::check_loss_head_inputs(h, w, targets, op);
  detail::check_head_grad_args(dims, h, d_h, d_w, op);
#ifdef BB_WITH_CUDA
  if (h.device().is_cuda())
    return linear_ce_fused_cuda(scale, h, w, targets, cfg, d_h, d_w, overwrite_dw, dims, op);
#endif
  if (overwrite_dw) d_w.zero_();  // then every chunk adds (the CUDA path's first chunk writes)
  const int64_t T = dims.num_tokens, V = dims.vocab, H = dims.hidden;
  const int64_t ct = std::min(cfg.fused_chunk_tokens, T);

  // Every token chunk multiplies by all of w: convert a bf16 w once, not per chunk.
  Tensor wf = cpu::as_f32(w);
  Tensor block = Tensor::empty({ct * V}, DType::f32, Device::cpu(), MemCategory::logits);
  const bool dh_direct = d_h.dtype() == DType::f32;
  Tensor dh_acc = dh_direct ? Tensor() : cpu::empty_f32({ct, H}, MemCategory::workspace);
  std::vector<float> lse(static_cast<size_t>(ct));
  float* x = block.data<float>();
  const int32_t* tg = targets.data<int32_t>();
  float* dw = d_w.data<float>();
  LossResult r;

  for (int64_t t0 = 0; t0 < T; t0 += ct) {
    const int64_t nt = std::min(ct, T - t0);
    Tensor hc = cpu::as_f32(h.narrow(t0, nt));
    cpu::gemm<float>(false, true, nt, V, H, 1.0f, hc.data<float>(), wf.data<float>(), 0.0f, x);
    round_logits_cpu(x, nt * V, cfg);
    // Whole rows: the same two-sweep reference as full_ce, then the gradient in place.
    double loss = 0;
    int64_t valid = 0;
    ref::cross_entropy_forward<float>(lse.data(), &loss, &valid, x, tg + t0, nt, V);
    r.loss_sum += loss;
    r.num_valid += valid;
    ref::softmax_grad_chunk<float>(x, x, V, tg + t0, lse.data(), scale, nt, 0, V);
    float* dh = dh_direct ? d_h.data<float>() + t0 * H : dh_acc.data<float>();
    cpu::gemm<float>(false, false, nt, H, V, 1.0f, x, wf.data<float>(), 0.0f, dh);
    cpu::gemm<float>(true, false, V, H, nt, 1.0f, x, hc.data<float>(), 1.0f, dw);
    if (!dh_direct) {
      Tensor dst = d_h.narrow(t0, nt);
      cpu::store_f32(dst, dh_acc.narrow(0, nt));
    }
  }
  return r;
}

}  // namespace bb

namespace bb {

namespace {
class LinearCeHead final : public LossHead {
 public:
  explicit LinearCeHead(const LossHeadConfig& cfg) : cfg_(cfg) {}
  LossResult train(float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                   Tensor& d_h, Tensor& d_w, bool overwrite_dw) const override {
    return linear_ce_fused(scale, h, w, targets, cfg_, d_h, d_w, overwrite_dw);
  }
  LossResult evaluate(const Tensor& h, const Tensor& w, const Tensor& targets) const override {
    return linear_ce_forward(h, w, targets, cfg_, nullptr);
  }

 private:
  LossHeadConfig cfg_;
};
}  // namespace

std::unique_ptr<LossHead> make_linear_ce_head(const LossHeadConfig& cfg) {
  return std::make_unique<LinearCeHead>(cfg);
}

}  // namespace bb
