// Memory-bound primitives on CUDA against their CPU path: embedding, RMSNorm / QK norm (plain
// and zero-centred), gated RMSNorm, Gated DeltaNet gates, RoPE, SwiGLU, elementwise ops, AdamW (f32 and bf16
// moments) and gradient norms. Each test draws fresh random inputs, runs the Tensor API on CPU
// tensors and on copies on cuda:0, and compares with the per-dtype tolerance (relative L2
// error). Shapes include ones that divide no tile or vector size (71x229, 1x1, 4097 rows) and
// views at odd offsets (the unvectorised paths).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/gpu.h"
#include "common/testing.h"
#include "core/tensor.h"
#include "primitives/activation/swiglu.h"
#include "primitives/elementwise/elementwise.h"
#include "primitives/embedding/embedding.h"
#include "primitives/gdn/gdn_gates.h"
#include "primitives/norm/gated_rmsnorm.h"
#include "primitives/norm/rmsnorm.h"
#include "primitives/optim/adamw.h"
#include "primitives/rope/rope.h"

namespace bb {
namespace {

using test::randn;

const Device kGpu = Device::cuda(0);

double tol(DType dt) { return dt == DType::bf16 ? test::kTolBf16 : test::kTolF32; }

Tensor host(const std::vector<float>& v, const Shape& s, DType dt = DType::f32,
            MemCategory cat = MemCategory::other) {
  return Tensor::from_floats(v, s, dt, cat);
}

// A device copy whose data starts `skew` elements after a 256-byte aligned allocation, so
// that the kernels must take their element-by-element paths.
Tensor on_gpu(const Tensor& h, int64_t skew = 0) {
  if (skew == 0) return h.to(kGpu);
  Tensor big = Tensor::empty({h.numel() + skew}, h.dtype(), kGpu, h.category());
  Tensor v = big.narrow(skew, h.numel());
  v.copy_from(h.view({h.numel()}));
  return v.view(h.shape());
}

std::vector<int32_t> rand_ids(int64_t n, uint64_t seed, int32_t lo, int32_t hi) {
  auto u = test::randu(static_cast<size_t>(n), seed, 0.0f, 1.0f);
  std::vector<int32_t> v(u.size());
  for (size_t i = 0; i < u.size(); ++i)
    v[i] = std::min(hi - 1, lo + static_cast<int32_t>(u[i] * static_cast<float>(hi - lo)));
  return v;
}

// ---- embedding ----------------------------------------------------------------------------

TEST(EmbeddingGpu, ForwardIsExactAndBackwardMatchesCpuBitwise) {
  BB_REQUIRE_GPU();
  struct Case { int64_t V, H, T; };
  for (DType dt : {DType::f32, DType::bf16}) {
    for (Case c : {Case{1000, 229, 4097}, Case{1, 1, 1}, Case{300, 2048, 65}, Case{50, 64, 777}}) {
      SCOPED_TRACE(testing::Message() << dtype_name(dt) << " V=" << c.V << " H=" << c.H
                                      << " T=" << c.T);
      // Ids from a small range: many tokens share an id (the accumulation case).
      auto idv = rand_ids(c.T, 11, 0, static_cast<int32_t>(std::min<int64_t>(c.V, 40)));
      idv.back() = static_cast<int32_t>(c.V - 1);
      Tensor ids = Tensor::from_ints(idv, {c.T});
      Tensor table = host(randn(c.V * c.H, 12), {c.V, c.H}, dt, MemCategory::params);
      Tensor y_cpu = embedding_forward(ids, table);
      Tensor y_gpu = embedding_forward(ids, on_gpu(table));
      EXPECT_EQ(y_gpu.device(), kGpu);
      EXPECT_EQ(y_gpu.dtype(), dt);
      EXPECT_EQ(y_gpu.to_floats(), y_cpu.to_floats());

      Tensor dy = host(randn(c.T * c.H, 13), {c.T, c.H}, dt);
      auto init = randn(c.V * c.H, 14);  // d_table accumulates: start from non-zeros
      Tensor dt_cpu = host(init, {c.V, c.H}, DType::f32, MemCategory::grads);
      Tensor dt_gpu = on_gpu(dt_cpu);
      embedding_backward(dy, ids, dt_cpu);
      embedding_backward(on_gpu(dy), ids, dt_gpu);
      // Same additions in the same order as the CPU loop: equal bit for bit.
      EXPECT_EQ(dt_gpu.to_floats(), dt_cpu.to_floats());
    }
  }
}

TEST(EmbeddingGpu, DeviceIdsUnalignedRowsAndBadIds) {
  BB_REQUIRE_GPU();
  const int64_t V = 97, H = 13, T = 300;
  auto idv = rand_ids(T, 21, 0, static_cast<int32_t>(V));
  Tensor ids = Tensor::from_ints(idv, {T});
  Tensor ids_dev = ids.to(kGpu);
  Tensor table = host(randn(V * H, 22), {V, H}, DType::bf16);
  Tensor y_cpu = embedding_forward(ids, table);
  EXPECT_EQ(embedding_forward(ids_dev, on_gpu(table, 1)).to_floats(), y_cpu.to_floats());
  Tensor dy = host(randn(T * H, 23), {T, H});
  Tensor d_cpu = host(randn(V * H, 24), {V, H});
  Tensor d_gpu = on_gpu(d_cpu, 3);
  embedding_backward(dy, ids, d_cpu);
  embedding_backward(on_gpu(dy, 1), ids_dev, d_gpu);
  EXPECT_EQ(d_gpu.to_floats(), d_cpu.to_floats());

  Tensor bad = Tensor::from_ints({0, 5, static_cast<int32_t>(V)}, {3});
  test::expect_error_contains([&] { embedding_forward(bad, on_gpu(table)); },
                              "outside the vocabulary");
  test::expect_error_contains([&] { embedding_forward(bad.to(kGpu), on_gpu(table)); },
                              "token id 97 at position 2");
  Tensor d3 = Tensor::zeros({V, H}, DType::f32, kGpu, MemCategory::grads);
  test::expect_error_contains(
      [&] { embedding_backward(host(randn(3 * H, 25), {3, H}).to(kGpu), bad, d3); },
      "outside the vocabulary");
}

// ---- RMSNorm / QK norm -----------------------------------------------------------------------

struct NormShape { int64_t rows, H; };
// 1x1, 17x7, 71x229: scalar paths with rows in registers (sub-warp groups for narrow rows);
// 5x333: scalar, too wide for registers; 4097x128: half-warp groups (qk norm); 33x2048: bf16
// rows in registers, f32 rows re-read; 3x4104: vectorised rows too wide for registers.
const NormShape kNormShapes[] = {{71, 229}, {1, 1}, {17, 7},    {5, 333},
                                 {4097, 128}, {33, 2048}, {9, 1024}, {3, 4104}};

TEST(RMSNormGpu, ForwardMatchesCpu) {
  BB_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    for (NormShape s : kNormShapes) {
      SCOPED_TRACE(testing::Message() << dtype_name(dt) << " " << s.rows << "x" << s.H);
      Tensor x = host(randn(s.rows * s.H, 31, 2.0f), {s.rows, s.H}, dt);
      Tensor w = host(test::randu(s.H, 32, 0.5f, 1.5f), {s.H}, dt, MemCategory::params);
      RMSNormSaved sc, sg;
      Tensor yc = rmsnorm_forward(x, w, 1e-6, &sc);
      Tensor yg = rmsnorm_forward(on_gpu(x), on_gpu(w), 1e-6, &sg);
      EXPECT_EQ(yg.dtype(), dt);
      EXPECT_EQ(sg.rstd.device(), kGpu);
      EXPECT_EQ(sg.rstd.category(), MemCategory::activations);
      EXPECT_LT(test::rel_error(yg.to_floats(), yc.to_floats()), tol(dt));
      EXPECT_LT(test::rel_error(sg.rstd.to_floats(), sc.rstd.to_floats()), test::kTolF32);
    }
  }
}

TEST(RMSNormGpu, BackwardMatchesCpuAndIsDeterministic) {
  BB_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    for (DType dyt : {DType::f32, DType::bf16}) {
      for (NormShape s : kNormShapes) {
        SCOPED_TRACE(testing::Message() << "x " << dtype_name(dt) << " dy " << dtype_name(dyt)
                                        << " " << s.rows << "x" << s.H);
        Tensor x = host(randn(s.rows * s.H, 41), {s.rows, s.H}, dt);
        Tensor w = host(test::randu(s.H, 42, 0.5f, 1.5f), {s.H}, dt);
        Tensor dy = host(randn(s.rows * s.H, 43), {s.rows, s.H}, dyt);
        auto dw0 = randn(s.H, 44);  // d_w accumulates onto this
        RMSNormSaved sc, sg;
        rmsnorm_forward(x, w, 1e-5, &sc);
        Tensor xg = on_gpu(x), wg = on_gpu(w), dyg = on_gpu(dy);
        rmsnorm_forward(xg, wg, 1e-5, &sg);
        Tensor dwc = host(dw0, {s.H}, DType::f32, MemCategory::grads);
        Tensor dwg = on_gpu(dwc), dwg2 = on_gpu(dwc);
        Tensor dxc = rmsnorm_backward(dy, x, w, sc, dwc);
        Tensor dxg = rmsnorm_backward(dyg, xg, wg, sg, dwg);
        rmsnorm_backward(dyg, xg, wg, sg, dwg2);
        EXPECT_EQ(dxg.dtype(), DType::f32);
        const double t = tol(dt == DType::bf16 || dyt == DType::bf16 ? DType::bf16 : DType::f32);
        if (s.H > 1) {
          EXPECT_LT(test::rel_error(dxg.to_floats(), dxc.to_floats()), t);
        } else {
          // H = 1: d_x = rstd dy w (1 - xhat^2) with xhat^2 = x^2 / (x^2 + eps) ~ 1, all
          // cancellation; both sides are only accurate relative to the terms' size.
          auto dys = dy.to_floats(), ws = w.to_floats(), rs = sc.rstd.to_floats();
          double scale = 0;
          for (int64_t i = 0; i < s.rows; ++i)
            scale = std::max(scale, std::fabs(static_cast<double>(dys[i]) * ws[0] * rs[i]));
          EXPECT_LT(test::max_abs_diff(dxg.to_floats(), dxc.to_floats()), t * scale);
        }
        EXPECT_LT(test::rel_error(dwg.to_floats(), dwc.to_floats()), t);
        EXPECT_EQ(dwg.to_floats(), dwg2.to_floats()) << "d_w must not depend on scheduling";
      }
    }
  }
}

TEST(RMSNormGpu, ResidualIsBitwiseAddingItAfterwards) {
  BB_REQUIRE_GPU();
  // The fused skip-connection add (one pass) against the backward then add_inplace, on the
  // vectorised path (aligned rows) and the scalar one (a view starting one row in, H odd).
  for (int64_t off : {0, 1})
    for (int64_t H : {256, 2048, 37})
      for (DType dt : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(testing::Message() << "offset " << off << " H " << H << " " << dtype_name(dt));
        const int64_t rows = 41;
        Tensor x = on_gpu(host(randn((rows + 1) * H, 61), {rows + 1, H}, dt)).narrow(off, rows);
        Tensor w = on_gpu(host(test::randu(H, 62, 0.5f, 1.5f), {H}, dt));
        Tensor dy = on_gpu(host(randn((rows + 1) * H, 63), {rows + 1, H})).narrow(off, rows);
        Tensor res = on_gpu(host(randn((rows + 1) * H, 64, 3.0f), {rows + 1, H})).narrow(off, rows);
        RMSNormSaved sg;
        rmsnorm_forward(x, w, 1e-6, &sg);
        Tensor dw1 = Tensor::zeros({H}, DType::f32, kGpu, MemCategory::grads);
        Tensor dw2 = Tensor::zeros({H}, DType::f32, kGpu, MemCategory::grads);
        Tensor plain = rmsnorm_backward(dy, x, w, sg, dw1);
        add_inplace(plain, res);
        Tensor fused = rmsnorm_backward(dy, x, w, sg, dw2, false, &res);
        EXPECT_EQ(fused.to_floats(), plain.to_floats());
        EXPECT_EQ(dw2.to_floats(), dw1.to_floats());
      }
  // A residual of the wrong shape or dtype is refused, naming it.
  Tensor x = on_gpu(host(randn(8 * 16, 65), {8, 16}));
  Tensor w = on_gpu(host(test::randu(16, 66, 0.5f, 1.5f), {16}));
  RMSNormSaved sg;
  rmsnorm_forward(x, w, 1e-6, &sg);
  Tensor dw = Tensor::zeros({16}, DType::f32, kGpu, MemCategory::grads);
  Tensor bad_shape = Tensor::zeros({8, 8}, DType::f32, kGpu, MemCategory::other);
  Tensor bad_dtype = Tensor::zeros({8, 16}, DType::bf16, kGpu, MemCategory::other);
  EXPECT_THROW(rmsnorm_backward(x, x, w, sg, dw, false, &bad_shape), Error);
  EXPECT_THROW(rmsnorm_backward(x, x, w, sg, dw, false, &bad_dtype), Error);
}

// A bf16 d_x (what the projections after a QK norm take) is bitwise the f32 d_x rounded to
// bf16, with and without the residual, on the vectorised and scalar paths, bf16 and f32 x, and
// the d_w it accumulates is the f32 path's.
TEST(RMSNormGpu, Bf16GradIsTheF32GradRounded) {
  BB_REQUIRE_GPU();
  for (int64_t off : {0, 1})
    for (int64_t H : {128, 2048, 37})
      for (DType dt : {DType::f32, DType::bf16})
        for (bool with_res : {false, true}) {
          SCOPED_TRACE(testing::Message() << "offset " << off << " H " << H << " "
                                          << dtype_name(dt) << (with_res ? " residual" : ""));
          const int64_t rows = 43;
          Tensor x = on_gpu(host(randn((rows + 1) * H, 71), {rows + 1, H}, dt)).narrow(off, rows);
          Tensor w = on_gpu(host(test::randu(H, 72, 0.5f, 1.5f), {H}, dt));
          Tensor dy = on_gpu(host(randn((rows + 1) * H, 73), {rows + 1, H})).narrow(off, rows);
          Tensor res = on_gpu(host(randn(rows * H, 74, 3.0f), {rows, H}));
          RMSNormSaved sg;
          rmsnorm_forward(x, w, 1e-6, &sg);
          Tensor dw1 = Tensor::zeros({H}, DType::f32, kGpu, MemCategory::grads);
          Tensor dw2 = Tensor::zeros({H}, DType::f32, kGpu, MemCategory::grads);
          const Tensor* r = with_res ? &res : nullptr;
          Tensor f32 = rmsnorm_backward(dy, x, w, sg, dw1, false, r);
          Tensor b16 = rmsnorm_backward(dy, x, w, sg, dw2, false, r, DType::bf16);
          ASSERT_EQ(b16.dtype(), DType::bf16);
          EXPECT_EQ(b16.category(), MemCategory::activations);
          EXPECT_EQ(b16.to_floats(), f32.to_dtype(DType::bf16).to_floats());
          EXPECT_EQ(dw2.to_floats(), dw1.to_floats());
        }
  // The per-head form takes it too; other dtypes are refused, naming the argument.
  Tensor q = on_gpu(host(randn(9 * 4 * 128, 75), {9, 4, 128}, DType::bf16));
  Tensor wq = on_gpu(host(test::randu(128, 76, 0.5f, 1.5f), {128}, DType::bf16));
  Tensor dq = on_gpu(host(randn(9 * 4 * 128, 77), {9, 4, 128}));
  RMSNormSaved sq;
  qk_norm_forward(q, wq, 1e-6, &sq);
  Tensor dw1 = Tensor::zeros({128}, DType::f32, kGpu, MemCategory::grads);
  Tensor dw2 = Tensor::zeros({128}, DType::f32, kGpu, MemCategory::grads);
  Tensor f32 = qk_norm_backward(dq, q, wq, sq, dw1);
  Tensor b16 = qk_norm_backward(dq, q, wq, sq, dw2, false, DType::bf16);
  EXPECT_EQ(b16.shape(), q.shape());
  EXPECT_EQ(b16.to_floats(), f32.to_dtype(DType::bf16).to_floats());
  test::expect_error_contains([&] { qk_norm_backward(dq, q, wq, sq, dw2, false, DType::i32); },
                              "rmsnorm_backward: d_x can be f32 or bf16");
}

TEST(RMSNormGpu, UnalignedViewsAndMixedWeightDtype) {
  BB_REQUIRE_GPU();
  const int64_t rows = 37, H = 256;
  Tensor x = host(randn(rows * H, 51), {rows, H}, DType::bf16);
  Tensor w = host(test::randu(H, 52, 0.5f, 1.5f), {H});  // f32 weight, bf16 activations
  Tensor dy = host(randn(rows * H, 53), {rows, H});
  RMSNormSaved sc, sg;
  Tensor yc = rmsnorm_forward(x, w, 1e-6, &sc);
  Tensor xg = on_gpu(x, 1);
  Tensor yg = rmsnorm_forward(xg, on_gpu(w, 1), 1e-6, &sg);
  EXPECT_LT(test::rel_error(yg.to_floats(), yc.to_floats()), test::kTolBf16);
  Tensor dwc = Tensor::zeros({H}, DType::f32, Device::cpu(), MemCategory::grads);
  Tensor dwg = dwc.to(kGpu);
  Tensor dxc = rmsnorm_backward(dy, x, w, sc, dwc);
  Tensor dxg = rmsnorm_backward(on_gpu(dy, 1), xg, on_gpu(w, 1), sg, dwg);
  EXPECT_LT(test::rel_error(dxg.to_floats(), dxc.to_floats()), test::kTolBf16);
  EXPECT_LT(test::rel_error(dwg.to_floats(), dwc.to_floats()), test::kTolBf16);
}

TEST(RMSNormGpu, QKNormPerHeadAndErrors) {
  BB_REQUIRE_GPU();
  const int64_t T = 37, n = 5, D = 128;
  Tensor x = host(randn(T * n * D, 61), {T, n, D}, DType::bf16);
  Tensor w = host(test::randu(D, 62, 0.5f, 1.5f), {D}, DType::bf16);
  Tensor dy = host(randn(T * n * D, 63), {T, n, D});
  RMSNormSaved sc, sg;
  Tensor yc = qk_norm_forward(x, w, 1e-6, &sc);
  Tensor xg = on_gpu(x), wg = on_gpu(w);
  Tensor yg = qk_norm_forward(xg, wg, 1e-6, &sg);
  EXPECT_EQ(yg.shape(), (Shape{T, n, D}));
  EXPECT_EQ(sg.rstd.shape(), (Shape{T * n}));
  EXPECT_LT(test::rel_error(yg.to_floats(), yc.to_floats()), test::kTolBf16);
  Tensor dwc = host(randn(D, 64), {D});
  Tensor dwg = on_gpu(dwc);
  Tensor dxc = qk_norm_backward(dy, x, w, sc, dwc);
  Tensor dxg = qk_norm_backward(on_gpu(dy), xg, wg, sg, dwg);
  EXPECT_LT(test::rel_error(dxg.to_floats(), dxc.to_floats()), test::kTolBf16);
  EXPECT_LT(test::rel_error(dwg.to_floats(), dwc.to_floats()), test::kTolBf16);

  test::expect_error_contains([&] { rmsnorm_forward(xg.view({T * n, D}), w, 1e-6, nullptr); },
                              "tensors on different devices");
  Tensor x16 = Tensor::from_floats(randn(4 * D, 65), {4, D}, DType::f16).to(kGpu);
  test::expect_error_contains([&] { rmsnorm_forward(x16, wg, 1e-6, nullptr); },
                              "the CUDA path takes f32 or bf16");
}

// Zero-centred norm on the GPU (the offset is applied where the kernels stage the weight):
// against the CPU path, forward and backward, bf16 and f32 weights, and per head.
TEST(RMSNormGpu, ZeroCenteredMatchesCpu) {
  BB_REQUIRE_GPU();
  for (DType wt : {DType::f32, DType::bf16}) {
    for (NormShape s : {NormShape{33, 2048}, NormShape{17, 7}, NormShape{4097, 256}}) {
      SCOPED_TRACE(testing::Message() << "w " << dtype_name(wt) << " " << s.rows << "x" << s.H);
      Tensor x = host(randn(s.rows * s.H, 71), {s.rows, s.H}, DType::bf16);
      Tensor w = host(randn(s.H, 72, 0.2f), {s.H}, wt);
      Tensor dy = host(randn(s.rows * s.H, 73), {s.rows, s.H});
      RMSNormSaved sc, sg;
      Tensor yc = rmsnorm_forward(x, w, 1e-6, &sc, MemCategory::activations, true);
      Tensor xg = on_gpu(x), wg = on_gpu(w);
      Tensor yg = rmsnorm_forward(xg, wg, 1e-6, &sg, MemCategory::activations, true);
      EXPECT_LT(test::rel_error(yg.to_floats(), yc.to_floats()), test::kTolBf16);
      Tensor plain = rmsnorm_forward(xg, wg, 1e-6, nullptr);
      EXPECT_GT(test::rel_error(plain.to_floats(), yc.to_floats()), 0.5) << "the flag must matter";
      Tensor dwc = Tensor::zeros({s.H}, DType::f32, Device::cpu(), MemCategory::grads);
      Tensor dwg = dwc.to(kGpu);
      Tensor dxc = rmsnorm_backward(dy, x, w, sc, dwc, true);
      Tensor dxg = rmsnorm_backward(on_gpu(dy), xg, wg, sg, dwg, true);
      EXPECT_LT(test::rel_error(dxg.to_floats(), dxc.to_floats()), test::kTolBf16);
      EXPECT_LT(test::rel_error(dwg.to_floats(), dwc.to_floats()), test::kTolBf16);
    }
  }
  const int64_t T = 9, n = 4, D = 256;
  Tensor x = host(randn(T * n * D, 74), {T, n, D}, DType::bf16);
  Tensor w = host(randn(D, 75, 0.2f), {D});
  Tensor yc = qk_norm_forward(x, w, 1e-6, nullptr, MemCategory::activations, true);
  Tensor yg = qk_norm_forward(on_gpu(x), on_gpu(w), 1e-6, nullptr, MemCategory::activations, true);
  EXPECT_LT(test::rel_error(yg.to_floats(), yc.to_floats()), test::kTolBf16);
}

// Gated RMSNorm (the GDN output norm): f32 and bf16 storage, head dims 128 (Qwen3.5), 7 (odd,
// less than a warp) and 300 (wider than the lanes keep in registers); d_w deterministic.
TEST(GatedRMSNormGpu, ForwardAndBackwardMatchCpu) {
  BB_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    for (NormShape s : {NormShape{4096 + 3, 128}, NormShape{37, 7}, NormShape{65, 300}}) {
      SCOPED_TRACE(testing::Message() << dtype_name(dt) << " " << s.rows << "x" << s.H);
      Tensor x = host(randn(s.rows * s.H, 81, 2.0f), {s.rows, s.H}, dt);
      Tensor z = host(randn(s.rows * s.H, 82, 2.0f), {s.rows, s.H}, dt);
      Tensor w = host(test::randu(s.H, 83, 0.5f, 1.5f), {s.H}, dt);
      Tensor dy = host(randn(s.rows * s.H, 84), {s.rows, s.H}, dt);
      Tensor xg = on_gpu(x), zg = on_gpu(z), wg = on_gpu(w), dyg = on_gpu(dy);
      Tensor yc = gated_rmsnorm_forward(x, z, w, 1e-6);
      Tensor yg = gated_rmsnorm_forward(xg, zg, wg, 1e-6);
      EXPECT_EQ(yg.dtype(), dt);
      EXPECT_LT(test::rel_error(yg.to_floats(), yc.to_floats()), tol(dt));
      Tensor dwc = host(randn(s.H, 85), {s.H});
      Tensor dwg = on_gpu(dwc), dwg2 = on_gpu(dwc);
      auto [dxc, dzc] = gated_rmsnorm_backward(dy, x, z, w, 1e-6, dwc);
      auto [dxg, dzg] = gated_rmsnorm_backward(dyg, xg, zg, wg, 1e-6, dwg);
      gated_rmsnorm_backward(dyg, xg, zg, wg, 1e-6, dwg2);
      EXPECT_EQ(dxg.dtype(), DType::f32);
      EXPECT_LT(test::rel_error(dxg.to_floats(), dxc.to_floats()), tol(dt));
      EXPECT_LT(test::rel_error(dzg.to_floats(), dzc.to_floats()), tol(dt));
      EXPECT_LT(test::rel_error(dwg.to_floats(), dwc.to_floats()), tol(dt));
      EXPECT_EQ(dwg.to_floats(), dwg2.to_floats()) << "d_w must not depend on scheduling";
    }
  }
  Tensor x = host(randn(8 * 16, 86), {8, 16});
  test::expect_error_contains([&] { gated_rmsnorm_forward(on_gpu(x), x, host(randn(16, 87), {16}), 1e-6); },
                              "tensors on different devices");
}

// Gated DeltaNet gates: f32 and bf16 projections, 32 heads (Qwen3.5) over 1000 tokens (the
// backward's per-block token ranges do not divide it), 3 heads over 5 tokens, values past the
// softplus threshold; the per-head sums deterministic.
TEST(GdnGatesGpu, ForwardAndBackwardMatchCpu) {
  BB_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    for (auto [T, Hv] : {std::pair<int64_t, int64_t>{1000, 32}, {5, 3}}) {
      SCOPED_TRACE(testing::Message() << dtype_name(dt) << " T " << T << " Hv " << Hv);
      std::vector<float> av = randn(T * Hv, 91, 3.0f);
      av[0] = 25.0f;  // softplus threshold branch
      Tensor a = host(av, {T, Hv}, dt), b = host(randn(T * Hv, 92, 3.0f), {T, Hv}, dt);
      Tensor a_log = host(randn(Hv, 93, 0.5f), {Hv}), dtb = host(randn(Hv, 94, 0.5f), {Hv});
      GdnGates c = gdn_gates_forward(a, b, a_log, dtb);
      GdnGates gpu = gdn_gates_forward(on_gpu(a), on_gpu(b), on_gpu(a_log), on_gpu(dtb));
      EXPECT_LT(test::rel_error(gpu.g.to_floats(), c.g.to_floats()), test::kTolF32);
      EXPECT_LT(test::rel_error(gpu.beta.to_floats(), c.beta.to_floats()), test::kTolF32);
      Tensor dg = host(randn(T * Hv, 95), {T, Hv}), dbeta = host(randn(T * Hv, 96), {T, Hv});
      Tensor dal_c = host(randn(Hv, 97), {Hv}), ddt_c = host(randn(Hv, 98), {Hv});
      Tensor dal_g = on_gpu(dal_c), ddt_g = on_gpu(ddt_c), dal_g2 = on_gpu(dal_c), ddt_g2 = on_gpu(ddt_c);
      auto [da_c, db_c] = gdn_gates_backward(dg, dbeta, a, c.g, c.beta, a_log, dtb, dal_c, ddt_c);
      auto [da_g, db_g] = gdn_gates_backward(on_gpu(dg), on_gpu(dbeta), on_gpu(a), gpu.g, gpu.beta, on_gpu(a_log),
                                             on_gpu(dtb), dal_g, ddt_g);
      gdn_gates_backward(on_gpu(dg), on_gpu(dbeta), on_gpu(a), gpu.g, gpu.beta, on_gpu(a_log), on_gpu(dtb), dal_g2,
                         ddt_g2);
      EXPECT_LT(test::rel_error(da_g.to_floats(), da_c.to_floats()), test::kTolF32);
      EXPECT_LT(test::rel_error(db_g.to_floats(), db_c.to_floats()), test::kTolF32);
      EXPECT_LT(test::rel_error(dal_g.to_floats(), dal_c.to_floats()), test::kTolF32);
      EXPECT_LT(test::rel_error(ddt_g.to_floats(), ddt_c.to_floats()), test::kTolF32);
      EXPECT_EQ(dal_g.to_floats(), dal_g2.to_floats());
      EXPECT_EQ(ddt_g.to_floats(), ddt_g2.to_floats());
    }
  }
}

// ---- RoPE ---------------------------------------------------------------------------------

TEST(RopeGpu, FullAndPartialRotaryLongPositions) {
  BB_REQUIRE_GPU();
  struct Case { int64_t T, n, D, R; };
  // Full, partial (vectorised), odd half-width and partial with a short tail (scalar), 1x1x2.
  const Case cases[] = {{71, 3, 128, 0}, {50, 4, 128, 64}, {9, 3, 22, 0}, {17, 2, 10, 6},
                        {1, 1, 2, 0}, {4097, 2, 64, 0}};
  for (DType dt : {DType::f32, DType::bf16}) {
    for (Case c : cases) {
      SCOPED_TRACE(testing::Message() << dtype_name(dt) << " T=" << c.T << " n=" << c.n
                                      << " D=" << c.D << " R=" << c.R);
      const RopeConfig cfg{1000000.0, c.R};
      // Positions far past 8192 (long-context angles), plus 0 and a run 0..T-1.
      auto pv = rand_ids(c.T, 71, 0, 200000);
      for (int64_t t = 0; t < std::min<int64_t>(c.T, 16); ++t) pv[t] = static_cast<int32_t>(t);
      Tensor pos = Tensor::from_ints(pv, {c.T});
      Tensor x = host(randn(c.T * c.n * c.D, 72), {c.T, c.n, c.D}, dt);
      Tensor yc = rope_forward(x, pos, cfg);
      Tensor yg = rope_forward(on_gpu(x), pos, cfg);
      EXPECT_EQ(yg.dtype(), dt);
      EXPECT_LT(test::rel_error(yg.to_floats(), yc.to_floats()), tol(dt));
      Tensor dy = host(randn(c.T * c.n * c.D, 73), {c.T, c.n, c.D}, dt);
      Tensor dc = rope_backward(dy, pos, cfg);
      Tensor dg = rope_backward(on_gpu(dy), pos.to(kGpu), cfg);  // device positions
      EXPECT_EQ(dg.dtype(), DType::f32);
      EXPECT_LT(test::rel_error(dg.to_floats(), dc.to_floats()), tol(dt));
    }
  }
}

TEST(RopeGpu, AnglesMatchCpuClosely) {
  BB_REQUIRE_GPU();
  // f32 with one head: the error is the cos/sin error alone (same fp32 angle on both sides).
  const int64_t T = 512, D = 128;
  auto pv = rand_ids(T, 81, 8192, 1 << 20);
  Tensor pos = Tensor::from_ints(pv, {T});
  Tensor x = host(randn(T * D, 82), {T, 1, D});
  const RopeConfig cfg{10000.0, 0};
  auto yc = rope_forward(x, pos, cfg).to_floats();
  auto yg = rope_forward(on_gpu(x, 1), pos, cfg).to_floats();
  EXPECT_LT(test::max_abs_diff(yg, yc), 1e-5);
  test::expect_error_contains(
      [&] { rope_forward(on_gpu(x), pos.to(kGpu), RopeConfig{10000.0, 130}); },
      "must be even and in (0, head_dim=128]");
}

// ---- SwiGLU -------------------------------------------------------------------------------

TEST(SwiGLUGpu, ForwardAndBackwardMatchCpu) {
  BB_REQUIRE_GPU();
  struct Case { int64_t N, F; };
  const Case cases[] = {{71, 229}, {1, 1}, {4097, 64}, {33, 768}};
  for (DType dt : {DType::f32, DType::bf16}) {
    for (DType dht : {DType::f32, DType::bf16}) {
      for (Case c : cases) {
        SCOPED_TRACE(testing::Message() << dtype_name(dt) << " d_h " << dtype_name(dht)
                                        << " N=" << c.N << " F=" << c.F);
        Tensor gu = host(randn(c.N * 2 * c.F, 91, 3.0f), {c.N, 2 * c.F}, dt);
        Tensor dh = host(randn(c.N * c.F, 92), {c.N, c.F}, dht);
        Tensor hc = swiglu_forward(gu);
        Tensor gug = on_gpu(gu);
        Tensor hg = swiglu_forward(gug);
        EXPECT_EQ(hg.dtype(), dt);
        EXPECT_LT(test::rel_error(hg.to_floats(), hc.to_floats()), tol(dt));
        Tensor dc = swiglu_backward(dh, gu);
        Tensor dg = swiglu_backward(on_gpu(dh), gug);
        EXPECT_EQ(dg.dtype(), dt);
        EXPECT_LT(test::rel_error(dg.to_floats(), dc.to_floats()), tol(dt));
      }
    }
  }
  // Odd offsets take the element-by-element path.
  Tensor gu = host(randn(6 * 64, 93), {6, 64});
  Tensor dh = host(randn(6 * 32, 94), {6, 32});
  EXPECT_LT(test::rel_error(swiglu_backward(on_gpu(dh, 1), on_gpu(gu, 1)).to_floats(),
                            swiglu_backward(dh, gu).to_floats()),
            test::kTolF32);
}

// ---- elementwise --------------------------------------------------------------------------

TEST(ElementwiseGpu, AddAxpyScaleRowsSigmoidMatchCpu) {
  BB_REQUIRE_GPU();
  struct Case { int64_t T, H; };
  for (Case c : {Case{71, 229}, Case{1, 1}, Case{4097, 16}}) {
    for (DType adt : {DType::f32, DType::bf16}) {
      for (DType bdt : {DType::f32, DType::bf16}) {
        for (int64_t skew : {0, 1}) {
          SCOPED_TRACE(testing::Message() << c.T << "x" << c.H << " a " << dtype_name(adt)
                                          << " b " << dtype_name(bdt) << " skew " << skew);
          const double t = tol(adt == DType::bf16 || bdt == DType::bf16 ? DType::bf16 : DType::f32);
          Tensor a = host(randn(c.T * c.H, 101), {c.T, c.H}, adt);
          Tensor b = host(randn(c.T * c.H, 102), {c.T, c.H}, bdt);
          Tensor ag = on_gpu(a, skew), bg = on_gpu(b, skew);
          Tensor sc = add(a, b, MemCategory::activations);
          Tensor sg = add(ag, bg, MemCategory::activations);
          EXPECT_EQ(sg.dtype(), DType::f32);
          EXPECT_EQ(sg.device(), kGpu);
          EXPECT_LT(test::rel_error(sg.to_floats(), sc.to_floats()), t);

          Tensor a32 = host(randn(c.T * c.H, 103), {c.T, c.H});
          Tensor a32g = on_gpu(a32, skew);
          axpy_inplace(a32, -0.75f, b);
          axpy_inplace(a32g, -0.75f, bg);
          add_inplace(a32, b);
          add_inplace(a32g, bg);
          EXPECT_LT(test::rel_error(a32g.to_floats(), a32.to_floats()), t);

          Tensor g = host(randn(c.T, 104), {c.T}, bdt);
          EXPECT_LT(test::rel_error(scale_rows(ag, on_gpu(g), MemCategory::activations).to_floats(),
                                    scale_rows(a, g, MemCategory::activations).to_floats()),
                    t);
          EXPECT_LT(test::rel_error(sigmoid(ag, MemCategory::activations).to_floats(),
                                    sigmoid(a, MemCategory::activations).to_floats()),
                    t);
          // The shared-expert gate backward (row dot product times g (1 - g)); g in (0, 1).
          Tensor gs = sigmoid(g, MemCategory::activations);
          Tensor dz = sigmoid_gate_backward(ag, bg, on_gpu(gs), MemCategory::activations);
          EXPECT_EQ(dz.shape(), (Shape{c.T, 1}));
          EXPECT_LT(test::rel_error(dz.to_floats(),
                                    sigmoid_gate_backward(a, b, gs, MemCategory::activations)
                                        .to_floats()),
                    t);
        }
      }
    }
  }
  Tensor a = Tensor::zeros({4}, DType::f32, kGpu, MemCategory::other);
  test::expect_error_contains([&] { add_inplace(a, host({1, 2, 3, 4}, {4})); },
                              "tensors on different devices");
}

// ---- AdamW and gradient norms -------------------------------------------------------------

// The attention output gate and the halves of a [R, 2C] tensor: GPU against CPU, both dtypes,
// a width that does not divide the vector size and skewed (unaligned) views.
TEST(ElementwiseGpu, SigmoidMulAndHalvesMatchCpu) {
  BB_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t C : {int64_t{128}, int64_t{229}})
      for (int64_t skew : {0, 3}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " C " + std::to_string(C) + " skew " + std::to_string(skew));
        const int64_t R = 71;
        Tensor x = host(randn(R * C, 1), {R, C}, dt), z = host(randn(R * C, 2, 2.0f), {R, C}, dt);
        Tensor g = host(randn(R * C, 3), {R, C}, dt);
        const Tensor y_cpu = sigmoid_mul(x, z, MemCategory::other);
        const Tensor y_gpu = sigmoid_mul(on_gpu(x, skew), on_gpu(z, skew), MemCategory::other);
        EXPECT_EQ(y_gpu.dtype(), dt);
        EXPECT_LT(test::rel_error(y_gpu.to_floats(), y_cpu.to_floats()), tol(dt));
        auto [dx_c, dz_c] = sigmoid_mul_backward(g, x, z);
        auto [dx_g, dz_g] = sigmoid_mul_backward(on_gpu(g, skew), on_gpu(x, skew), on_gpu(z, skew));
        EXPECT_LT(test::rel_error(dx_g.to_floats(), dx_c.to_floats()), test::kTolF32);
        EXPECT_LT(test::rel_error(dz_g.to_floats(), dz_c.to_floats()), test::kTolF32);
        // Halves: exact copies.
        Tensor w = host(randn(R * 2 * C, 4), {R, 2 * C}, dt);
        auto [a_c, b_c] = split_halves(w, MemCategory::other);
        auto [a_g, b_g] = split_halves(on_gpu(w, skew), MemCategory::other);
        EXPECT_EQ(a_g.to_floats(), a_c.to_floats());
        EXPECT_EQ(b_g.to_floats(), b_c.to_floats());
        EXPECT_EQ(join_halves(a_g, b_g, dt, MemCategory::other).to_floats(), w.to_floats());
        EXPECT_EQ(join_halves(on_gpu(a_c, skew), b_g, DType::f32, MemCategory::other).to_floats(),
                  w.to_floats());
      }
}

TEST(AdamWGpu, ThreeStepsMatchCpu) {
  BB_REQUIRE_GPU();
  for (int64_t n : {4097, 1, 229 * 71}) {
    for (int model_kind : {0, 1, 2}) {  // none, f32, bf16 model weights
      for (int64_t skew : {0, 1}) {
        SCOPED_TRACE(testing::Message() << "n=" << n << " model " << model_kind << " skew "
                                        << skew);
        Tensor p = host(randn(n, 111), {n}, DType::f32, MemCategory::optimizer);
        Tensor m = host(randn(n, 112, 0.1f), {n}, DType::f32, MemCategory::optimizer);
        Tensor v = host(test::randu(n, 113, 0.0f, 0.01f), {n}, DType::f32, MemCategory::optimizer);
        Tensor pg = on_gpu(p, skew), mg = on_gpu(m, skew), vg = on_gpu(v, skew);
        const DType mdt = model_kind == 2 ? DType::bf16 : DType::f32;
        Tensor model = Tensor::zeros({n}, mdt, Device::cpu(), MemCategory::params);
        Tensor model_g = on_gpu(model, skew);
        Tensor* mc = model_kind ? &model : nullptr;
        Tensor* mgp = model_kind ? &model_g : nullptr;
        AdamWConfig cfg{0.9, 0.95, 1e-8};
        for (int64_t step = 1; step <= 3; ++step) {
          cfg.grad_scale = step == 2 ? 0.37 : 1.0;  // a clipped step
          Tensor g = host(randn(n, 120 + static_cast<uint64_t>(step)), {n}, DType::f32,
                          MemCategory::grads);
          adamw_step(p, g, m, v, step, 1e-2, 0.1, cfg, mc);
          adamw_step(pg, on_gpu(g, skew), mg, vg, step, 1e-2, 0.1, cfg, mgp);
        }
        EXPECT_LT(test::rel_error(pg.to_floats(), p.to_floats()), test::kTolF32);
        EXPECT_LT(test::rel_error(mg.to_floats(), m.to_floats()), test::kTolF32);
        EXPECT_LT(test::rel_error(vg.to_floats(), v.to_floats()), test::kTolF32);
        if (model_kind) {
          EXPECT_EQ(model_g.dtype(), mdt);
          EXPECT_LT(test::rel_error(model_g.to_floats(), model.to_floats()), tol(mdt));
        }
      }
    }
  }
}

// AdamWConfig::yield_sms (the update beside the backward) only changes the launch: many short
// blocks instead of a resident grid-stride grid. The same bits for both optimizers, with a size
// past one grid-stride pass (several accesses per thread) and the unaligned (scalar) path.
TEST(AdamWGpu, ShortBlocksGiveTheSameBits) {
  BB_REQUIRE_GPU();
  const int64_t n = 5'000'003;
  for (DType md : {DType::f32, DType::bf16}) {
    for (int64_t skew : {0, 1}) {
      SCOPED_TRACE(testing::Message() << "moments " << dtype_name(md) << " skew " << skew);
      auto run = [&](bool yield) {
        Tensor p = on_gpu(host(randn(n, 211), {n}, DType::f32, MemCategory::optimizer), skew);
        Tensor m = on_gpu(host(randn(n, 212, 0.1f), {n}, md, MemCategory::optimizer), skew);
        Tensor v = on_gpu(host(test::randu(n, 213, 0.0f, 0.01f), {n}, md, MemCategory::optimizer), skew);
        Tensor model = on_gpu(Tensor::zeros({n}, DType::bf16, Device::cpu(), MemCategory::params), skew);
        Tensor flag = Tensor::zeros({1}, DType::i32, kGpu, MemCategory::workspace);
        AdamWConfig cfg{0.9, 0.95, 1e-8};
        cfg.seed = 3;
        cfg.stream = 9;
        cfg.yield_sms = yield;
        for (int64_t step = 1; step <= 2; ++step) {
          Tensor g = on_gpu(host(randn(n, 220 + static_cast<uint64_t>(step)), {n}, DType::f32, MemCategory::grads), skew);
          adamw_step(p, g, m, v, step, 1e-2, 0.1, cfg, &model, &flag);
        }
        return std::vector<std::vector<float>>{p.to_floats(), m.to_floats(), v.to_floats(), model.to_floats(),
                                               {static_cast<float>(flag.to_ints()[0])}};
      };
      const auto a = run(false), b = run(true);
      for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "tensor " << i;
      EXPECT_EQ(a[4][0], 0.0f);
    }
  }
}

// AdamW state on the GPU for the bitwise update tests: masters N(0, 1), first moments N(0, 0.1)
// and second moments U(0, 0.01) in `md` (random streams seed, seed + 1, seed + 2), a zero model
// copy, a non-finite flag and `slots` norm slots; `skew` elements off 16-byte alignment. The
// config: betas 0.9 / 0.95, eps 1e-8, the given rounding seed and stream, short blocks or not.
struct GpuAdamW {
  Tensor p, m, v, model, flag, slots;
  AdamWConfig cfg;
};
GpuAdamW gpu_adamw_state(int64_t n, DType md, DType model_dt, int64_t skew, uint64_t seed, int64_t slots,
                         uint64_t cfg_seed, uint64_t cfg_stream, bool yield) {
  AdamWConfig cfg{0.9, 0.95, 1e-8};
  cfg.seed = cfg_seed;
  cfg.stream = cfg_stream;
  cfg.yield_sms = yield;
  return {on_gpu(host(randn(n, seed), {n}, DType::f32, MemCategory::optimizer), skew),
          on_gpu(host(randn(n, seed + 1, 0.1f), {n}, md, MemCategory::optimizer), skew),
          on_gpu(host(test::randu(n, seed + 2, 0.0f, 0.01f), {n}, md, MemCategory::optimizer), skew),
          on_gpu(Tensor::zeros({n}, model_dt, Device::cpu(), MemCategory::params), skew),
          Tensor::zeros({1}, DType::i32, kGpu, MemCategory::workspace),
          Tensor::zeros({slots}, DType::i64, kGpu, MemCategory::other), cfg};
}

// The update and the gradient's sum of squares in one pass (adamw_step_sum_squares): bitwise the
// two separate calls (sum_of_squares_to, then adamw_step over the decayed elements and over the
// rest), for both moment dtypes, bf16 and f32 models, short blocks or not, sizes with a scalar
// tail and decay cuts inside a vector; skew 1 takes the two-pass fallback (same bits again).
TEST(AdamWGpu, FusedSumOfSquaresIsBitwiseTheTwoPasses) {
  BB_REQUIRE_GPU();
  struct Case {
    int64_t n, decay;
  };
  for (Case c : {Case{1, 1}, Case{4097, 4093}, Case{1'000'003, 999'001}, Case{3 * 4096, 0}, Case{8191, 8191}}) {
    for (DType md : {DType::f32, DType::bf16}) {
      for (DType model_dt : {DType::bf16, DType::f32}) {
        for (int64_t skew : {0, 1}) {
          for (bool yield : {false, true}) {
            const int64_t n = c.n;
            SCOPED_TRACE(testing::Message() << "n " << n << " decay " << c.decay << " moments " << dtype_name(md)
                                            << " model " << dtype_name(model_dt) << " skew " << skew << " yield "
                                            << yield);
            auto run = [&](bool fused) {
              auto [p, m, v, model, flag, slots, cfg] = gpu_adamw_state(n, md, model_dt, skew, 311, 3, 5, 11, yield);
              for (int64_t step = 1; step <= 2; ++step) {
                Tensor g = on_gpu(host(randn(n, 320 + static_cast<uint64_t>(step)), {n}, DType::f32,
                                       MemCategory::grads), skew);
                if (fused) {
                  adamw_step_sum_squares(p, g, m, v, step, 1e-2, 0.1, c.decay, cfg, &model, &flag, slots, step);
                } else {
                  sum_of_squares_to(g, slots, step);
                  const int64_t cuts[3] = {0, c.decay, n};
                  for (int b = 0; b < 2; ++b) {
                    const int64_t len = cuts[b + 1] - cuts[b];
                    if (len == 0) continue;
                    Tensor pb = p.narrow(cuts[b], len), mb = m.narrow(cuts[b], len), vb = v.narrow(cuts[b], len),
                           modb = model.narrow(cuts[b], len);
                    AdamWConfig cb = cfg;
                    cb.first_element = cuts[b];
                    adamw_step(pb, g.narrow(cuts[b], len), mb, vb, step, 1e-2, b == 0 ? 0.1 : 0.0, cb, &modb, &flag);
                  }
                }
              }
              const Tensor h = slots.to(Device::cpu());
              std::vector<float> sums(4);  // the two sums' doubles as four floats of bits
              std::memcpy(sums.data(), h.data<int64_t>() + 1, 2 * sizeof(double));
              return std::vector<std::vector<float>>{p.to_floats(), m.to_floats(), v.to_floats(),
                                                     model.to_floats(), sums,
                                                     {static_cast<float>(flag.to_ints()[0])}};
            };
            const auto a = run(false), b = run(true);
            for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "tensor " << i;
            EXPECT_EQ(a[5][0], 0.0f);
            double s2 = 0;
            std::memcpy(&s2, a[4].data() + 2, sizeof(double));
            EXPECT_GT(s2, n > 1000 ? 0.5 * static_cast<double>(n) : 0.0);  // ~n for N(0, 1) values
          }
        }
      }
    }
  }
}

// The update of chosen rows (adamw_step_rows): the rows a lookup did not touch, then the ones it
// did, are bitwise the fused whole-unit update, for both moment dtypes and model dtypes, rows of
// a multiple of 4 elements (vector path) or not, aligned or not (skew), the padding as a
// shorter last row; NaN gradients in the rows of the other call are never read.
TEST(AdamWGpu, StepRowsIsBitwiseTheWholeUpdate) {
  BB_REQUIRE_GPU();
  struct Case {
    int64_t rows, row_len, pad, decay;
  };
  for (Case c : {Case{300, 64, 40, 300 * 64 - 10}, Case{97, 30, 0, 1000}, Case{5, 2048, 128, 5 * 2048}}) {
    for (DType md : {DType::f32, DType::bf16}) {
      for (DType model_dt : {DType::bf16, DType::f32}) {
        for (int64_t skew : {0, 1}) {
          const int64_t n = c.rows * c.row_len + c.pad, R = (n + c.row_len - 1) / c.row_len;
          SCOPED_TRACE(testing::Message() << "rows " << c.rows << " x " << c.row_len << " + " << c.pad << " moments "
                                          << dtype_name(md) << " model " << dtype_name(model_dt) << " skew " << skew);
          std::vector<int32_t> touched, untouched;
          for (int64_t r = 0; r < R; ++r) (r % 3 == 1 && r < c.rows ? touched : untouched).push_back(static_cast<int32_t>(r));
          auto run = [&](bool split) {
            auto [p, m, v, model, flag, slots, cfg] = gpu_adamw_state(n, md, model_dt, skew, 411, 1, 6, 12, true);
            std::vector<float> g = randn(n, 420);
            for (int64_t e = 0; e < n; ++e)
              if (e / c.row_len < c.rows && (e / c.row_len) % 3 != 1) g[static_cast<size_t>(e)] = 0.0f;  // untouched
            Tensor gg = on_gpu(host(g, {n}, DType::f32, MemCategory::grads), skew);
            if (!split) {
              adamw_step_sum_squares(p, gg, m, v, 2, 1e-2, 0.1, c.decay, cfg, &model, &flag, slots, 0);
            } else {
              std::vector<float> g_nan = g;  // the touched rows are unknown while the untouched go
              for (int32_t r : touched)
                for (int64_t e = r * c.row_len; e < std::min(n, (r + 1) * c.row_len); ++e) g_nan[e] = NAN;
              Tensor gn = on_gpu(host(g_nan, {n}, DType::f32, MemCategory::grads), skew);
              adamw_step_rows(p, gn, m, v, 2, 1e-2, 0.1, c.decay, cfg, &model, &flag, untouched, c.row_len);
              adamw_step_rows(p, gg, m, v, 2, 1e-2, 0.1, c.decay, cfg, &model, &flag, touched, c.row_len);
            }
            return std::vector<std::vector<float>>{p.to_floats(), m.to_floats(), v.to_floats(), model.to_floats(),
                                                   {static_cast<float>(flag.to_ints()[0])}};
          };
          const auto a = run(false), b = run(true);
          for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "tensor " << i;
          EXPECT_EQ(b[4][0], 0.0f);
        }
      }
    }
  }
}

// The split master ([backend] master_storage = "split") on the GPU: from the same fp32 masters (every 7th on a
// bf16 tie) the split update keeps the master bitwise the f32-master kernels' (joined from the
// bf16 value and the i16 remainder), its value is the master's ties-away rounding, and moments,
// flags and norm slots are those of the f32 master: the whole update, the fused update + sum of
// squares, and the row-wise update in two calls; both moment dtypes, short blocks or not, the
// vector and the unaligned (scalar) paths, a scalar tail.
TEST(AdamWGpu, SplitMasterKeepsTheFp32MasterBitForBit) {
  BB_REQUIRE_GPU();
  const int64_t row_len = 64, n = 1601 * row_len + 37, cut = 1000 * row_len + 3;
  std::vector<float> p0 = randn(n, 611);
  for (int64_t i = 0; i < n; i += 7) {
    uint32_t b;
    std::memcpy(&b, &p0[static_cast<size_t>(i)], 4);
    b = (b & 0xFFFF0000u) | 0x8000u;
    std::memcpy(&p0[static_cast<size_t>(i)], &b, 4);
  }
  const Tensor master_h = host(p0, {n}, DType::f32, MemCategory::optimizer);
  Tensor value_h = Tensor::empty({n}, DType::bf16, Device::cpu(), MemCategory::params);
  Tensor lo_h = Tensor::empty({n}, DType::i16, Device::cpu(), MemCategory::optimizer);
  split_master(master_h, value_h, lo_h);
  std::vector<int32_t> rows_a, rows_b;
  for (int32_t r = 0; r <= static_cast<int32_t>(n / row_len); ++r) (r % 3 == 1 ? rows_a : rows_b).push_back(r);
  for (DType md : {DType::f32, DType::bf16}) {
    for (int64_t skew : {0, 1}) {
      for (bool yield : {false, true}) {
        SCOPED_TRACE(testing::Message() << "moments " << dtype_name(md) << " skew " << skew << " short blocks " << yield);
        Tensor lo = on_gpu(lo_h, skew), value = on_gpu(value_h, skew), master = on_gpu(master_h, skew);
        Tensor model = on_gpu(host(p0, {n}, DType::bf16, MemCategory::params), skew);
        Tensor m1 = on_gpu(host(randn(n, 612, 0.1f), {n}, md, MemCategory::optimizer), skew), m2 = m1.clone();
        Tensor v1 = on_gpu(host(test::randu(n, 613, 0.0f, 0.01f), {n}, md, MemCategory::optimizer), skew), v2 = v1.clone();
        Tensor f1 = Tensor::zeros({1}, DType::i32, kGpu, MemCategory::workspace), f2 = f1.clone();
        Tensor s1 = Tensor::zeros({2}, DType::i64, kGpu, MemCategory::other), s2 = s1.clone();
        AdamWConfig cfg{0.9, 0.95, 1e-8};
        cfg.seed = 4;
        cfg.stream = 8;
        cfg.yield_sms = yield;
        for (int64_t step = 1; step <= 3; ++step) {
          cfg.grad_scale = step == 2 ? 0.6 : 1.0;
          Tensor g = on_gpu(host(randn(n, 620 + static_cast<uint64_t>(step)), {n}, DType::f32, MemCategory::grads), skew);
          if (step == 1) {
            adamw_step(lo, g, m1, v1, step, 1e-2, 0.1, cfg, &value, &f1);
            adamw_step(master, g, m2, v2, step, 1e-2, 0.1, cfg, &model, &f2);
          } else if (step == 2) {
            adamw_step_sum_squares(lo, g, m1, v1, step, 1e-2, 0.1, cut, cfg, &value, &f1, s1, 1);
            adamw_step_sum_squares(master, g, m2, v2, step, 1e-2, 0.1, cut, cfg, &model, &f2, s2, 1);
          } else {
            for (const auto* rows : {&rows_a, &rows_b}) {
              adamw_step_rows(lo, g, m1, v1, step, 1e-2, 0.1, cut, cfg, &value, &f1, *rows, row_len);
              adamw_step_rows(master, g, m2, v2, step, 1e-2, 0.1, cut, cfg, &model, &f2, *rows, row_len);
            }
          }
          const Tensor vh = value.to(Device::cpu()), lh = lo.to(Device::cpu()), mh = master.to(Device::cpu()),
                       rh = model.to(Device::cpu());
          Tensor joined = Tensor::empty({n}, DType::f32, Device::cpu(), MemCategory::other);
          join_master(vh, lh, joined);
          for (int64_t i = 0; i < n; ++i) {
            uint32_t b, j;
            std::memcpy(&b, mh.data<float>() + i, 4);
            std::memcpy(&j, joined.data<float>() + i, 4);
            ASSERT_EQ(j, b) << "step " << step << " element " << i;
            ASSERT_EQ(vh.data<uint16_t>()[i], split_master_hi(b)) << "step " << step << " element " << i;
            if ((b & 0xFFFFu) != 0x8000u)  // off a tie, ties-away and ties-to-even agree
              ASSERT_EQ(vh.data<uint16_t>()[i], rh.data<uint16_t>()[i]) << "step " << step << " element " << i;
          }
          EXPECT_EQ(m1.to_floats(), m2.to_floats()) << "step " << step;
          EXPECT_EQ(v1.to_floats(), v2.to_floats()) << "step " << step;
          EXPECT_EQ(f1.to_ints(), f2.to_ints());
          EXPECT_EQ(s1.to_ints(), s2.to_ints());
        }
        EXPECT_NE(lo.to(Device::cpu()).to_ints(), lo_h.to_ints());  // it did update
      }
    }
  }
}

// bf16 moments (adamw_bf16_moments): three steps, one clipped, from the same state on the GPU
// and on the CPU. Both draw the same random words (moment_rounding.h), so the stored moments are
// equal bit for bit except where the kernel's fp32 value (FMA-contracted) and the CPU's straddle
// a rounding threshold, ~2^-16 of the stores: at most 0.1% (+1) may differ, and only by one bf16
// ulp (within the bf16 tolerance). A kernel drawing other bits would differ in ~1/3 of them.
// first_element 3 takes the kernel's per-element words inside the vector path; skew 1 the
// unaligned scalar path; the nonfinite flag must agree, including an overflowing lr.
TEST(AdamWGpu, Bf16MomentsThreeStepsMatchCpu) {
  BB_REQUIRE_GPU();
  for (int64_t n : {4097, 1, 229 * 71}) {
    for (int model_kind : {0, 1, 2}) {  // none, f32, bf16 model weights
      for (int64_t skew : {0, 1}) {
        for (int64_t first : {0, 3}) {
          SCOPED_TRACE(testing::Message() << "n=" << n << " model " << model_kind << " skew " << skew
                                          << " first_element " << first);
          Tensor p = host(randn(n, 161), {n}, DType::f32, MemCategory::optimizer);
          Tensor m = host(randn(n, 162, 0.1f), {n}, DType::bf16, MemCategory::optimizer);
          Tensor v = host(test::randu(n, 163, 0.0f, 0.01f), {n}, DType::bf16, MemCategory::optimizer);
          Tensor pg = on_gpu(p, skew), mg = on_gpu(m, skew), vg = on_gpu(v, skew);
          const DType mdt = model_kind == 2 ? DType::bf16 : DType::f32;
          Tensor model = Tensor::zeros({n}, mdt, Device::cpu(), MemCategory::params);
          Tensor model_g = on_gpu(model, skew);
          Tensor* mc = model_kind ? &model : nullptr;
          Tensor* mgp = model_kind ? &model_g : nullptr;
          AdamWConfig cfg{0.9, 0.95, 1e-8};
          cfg.seed = 77;
          cfg.stream = 5;
          cfg.first_element = first;
          Tensor fc = Tensor::zeros({1}, DType::i32, Device::cpu(), MemCategory::workspace);
          Tensor fg = Tensor::zeros({1}, DType::i32, kGpu, MemCategory::workspace);
          for (int64_t step = 1; step <= 3; ++step) {
            cfg.grad_scale = step == 2 ? 0.37 : 1.0;
            Tensor g = host(randn(n, 170 + static_cast<uint64_t>(step)), {n}, DType::f32, MemCategory::grads);
            adamw_step(p, g, m, v, step, 1e-2, 0.1, cfg, mc, &fc);
            adamw_step(pg, on_gpu(g, skew), mg, vg, step, 1e-2, 0.1, cfg, mgp, &fg);
          }
          EXPECT_EQ(mg.dtype(), DType::bf16);
          EXPECT_LT(test::rel_error(pg.to_floats(), p.to_floats()), test::kTolF32);
          for (const auto& [gpu, cpu] : {std::pair<const Tensor*, const Tensor*>{&mg, &m}, {&vg, &v}}) {
            const std::vector<float> a = gpu->to_floats(), b = cpu->to_floats();
            EXPECT_LT(test::rel_error(a, b), test::kTolBf16);
            int64_t differ = 0;
            for (int64_t i = 0; i < n; ++i) differ += a[i] != b[i];
            EXPECT_LE(differ, 1 + n / 1000) << differ << " of " << n << " stored moments differ";
          }
          EXPECT_EQ(fc.to_ints()[0], 0);
          EXPECT_EQ(fg.to_ints(), fc.to_ints());
          if (model_kind) {
            EXPECT_LT(test::rel_error(model_g.to_floats(), model.to_floats()), tol(mdt));
          }
          // An update that overflows sets both flags.
          adamw_step(p, host(randn(n, 180), {n}), m, v, 4, 1e39, 0.0, cfg, nullptr, &fc);
          adamw_step(pg, on_gpu(host(randn(n, 180), {n}), skew), mg, vg, 4, 1e39, 0.0, cfg, nullptr, &fg);
          EXPECT_EQ(fc.to_ints()[0], 1);
          EXPECT_EQ(fg.to_ints(), fc.to_ints());
        }
      }
    }
  }
}

TEST(AdamWGpu, GradNormSumOfSquaresAndScale) {
  BB_REQUIRE_GPU();
  std::vector<Tensor> cpu_grads = {
      host(randn(71 * 229, 131), {71, 229}), host(randn(1, 132), {1}),
      host(randn(4097, 133), {4097}, DType::bf16), host(randn(300001, 134, 0.01f), {300001})};
  std::vector<Tensor> gpu_grads;
  for (const Tensor& g : cpu_grads) gpu_grads.push_back(on_gpu(g));
  gpu_grads[1] = on_gpu(cpu_grads[1], 1);  // an unaligned view
  const double nc = global_grad_norm(cpu_grads);
  const double ng = global_grad_norm(gpu_grads);
  EXPECT_NEAR(ng, nc, 1e-9 * nc);
  EXPECT_EQ(global_grad_norm(gpu_grads), ng) << "the norm must be bitwise reproducible";
  EXPECT_NEAR(sum_of_squares(gpu_grads[2]), sum_of_squares(cpu_grads[2]),
              1e-9 * sum_of_squares(cpu_grads[2]));
  {  // into a device slot on the current stream: bitwise what sum_of_squares returns
    Tensor slots = Tensor::zeros({4}, DType::i64, gpu_grads[3].device(), MemCategory::other);
    for (int64_t i : {0, 3}) sum_of_squares_to(gpu_grads[static_cast<size_t>(i)], slots, i);
    const Tensor h = slots.to(Device::cpu());
    double s0 = 0, s3 = 0;
    std::memcpy(&s0, h.data<int64_t>(), sizeof(double));
    std::memcpy(&s3, h.data<int64_t>() + 3, sizeof(double));
    EXPECT_EQ(s0, sum_of_squares(gpu_grads[0]));
    EXPECT_EQ(s3, sum_of_squares(gpu_grads[3]));
  }
  // Mixed host and device tensors are summed together.
  std::vector<Tensor> mixed = {cpu_grads[0], gpu_grads[1], gpu_grads[2], cpu_grads[3]};
  EXPECT_NEAR(global_grad_norm(mixed), nc, 1e-9 * nc);

  Tensor s = host(randn(4099, 135), {4099});
  Tensor sg = on_gpu(s, 1);
  scale_inplace(s, 0.37f);
  scale_inplace(sg, 0.37f);
  EXPECT_EQ(sg.to_floats(), s.to_floats());
}

// An embedding-like gradient, zero outside some rows: the sum over the listed rows' slices only is
// bitwise the full sum, for wide rows (several rows a slice or slices a row), narrow odd rows,
// the vectorised and the scalar (unaligned view) partition, a short last row and the scalar tail,
// and no rows at all (+0.0).
TEST(AdamWGpu, SumOfSquaresOverTouchedRowsIsTheFullSum) {
  BB_REQUIRE_GPU();
  struct C { int64_t rows, row_len, pad; };
  for (C c : {C{600, 2048, 0}, C{3000, 37, 5}, C{257, 4096, 3}, C{40, 1, 2}})
    for (int64_t off : {0, 1})
      for (int64_t every : {7, 1000000}) {
        SCOPED_TRACE(testing::Message() << c.rows << " rows of " << c.row_len << " + " << c.pad
                                        << ", offset " << off << ", every " << every);
        const int64_t n = c.rows * c.row_len + c.pad, num_rows = (n + c.row_len - 1) / c.row_len;
        std::vector<float> v = randn(n + 1, 141);
        std::vector<int32_t> touched;
        for (int64_t r = 0; r < num_rows; ++r) {
          const bool hit = r % every == 3 || (every < num_rows && r == num_rows - 1);
          if (hit) touched.push_back(static_cast<int32_t>(r));
          if (!hit)
            for (int64_t e = r * c.row_len; e < std::min(n, (r + 1) * c.row_len); ++e) v[off + e] = 0.0f;
        }
        if (off == 1) v[0] = 5.0f;  // outside the view
        Tensor g = on_gpu(host(v, {n + 1})).narrow(off, n);
        Tensor slots = Tensor::zeros({2}, DType::i64, g.device(), MemCategory::other);
        sum_of_squares_to(g, slots, 0);
        sum_of_squares_rows_to(g, slots, 1, touched, c.row_len);
        const Tensor h = slots.to(Device::cpu());
        double full = 0, listed = 0;
        std::memcpy(&full, h.data<int64_t>(), sizeof(double));
        std::memcpy(&listed, h.data<int64_t>() + 1, sizeof(double));
        EXPECT_EQ(listed, full);
        if (touched.empty()) EXPECT_EQ(listed, 0.0);
        else EXPECT_GT(listed, 0.0);
      }
  Tensor g = on_gpu(host(randn(64, 142), {64}));
  Tensor slots = Tensor::zeros({1}, DType::i64, g.device(), MemCategory::other);
  test::expect_error_contains([&] { sum_of_squares_rows_to(g, slots, 0, {3, 2}, 8); }, "strictly increasing");
  test::expect_error_contains([&] { sum_of_squares_rows_to(g, slots, 0, {8}, 8); }, "outside the 8 rows");
}

// The non-finite flags: set by the AdamW pass itself when an update overflows (and only then), and
// by mark_nonfinite for Inf/NaN anywhere in f32 or bf16 tensors, aligned or not; the same answers
// as the CPU path.
TEST(AdamWGpu, NonFiniteFlagsMatchCpu) {
  BB_REQUIRE_GPU();
  for (int64_t n : {1, 4097, 229 * 71}) {
    for (int64_t skew : {0, 1}) {
      for (double lr : {1e-2, 1e39}) {
        SCOPED_TRACE(testing::Message() << "n=" << n << " skew " << skew << " lr " << lr);
        Tensor p = host(randn(n, 141), {n}, DType::f32, MemCategory::optimizer);
        Tensor m = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
        Tensor v = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
        Tensor g = host(randn(n, 142), {n}, DType::f32, MemCategory::grads);
        Tensor pg = on_gpu(p, skew), mg = on_gpu(m, skew), vg = on_gpu(v, skew);
        Tensor fc = Tensor::zeros({1}, DType::i32, Device::cpu(), MemCategory::workspace);
        Tensor fg = Tensor::zeros({1}, DType::i32, kGpu, MemCategory::workspace);
        AdamWConfig cfg{0.9, 0.95, 1e-8};
        adamw_step(p, g, m, v, 1, lr, 0.0, cfg, nullptr, &fc);
        adamw_step(pg, on_gpu(g, skew), mg, vg, 1, lr, 0.0, cfg, nullptr, &fg);
        EXPECT_EQ(fc.to_ints()[0], lr > 1e38 ? 1 : 0);
        EXPECT_EQ(fg.to_ints(), fc.to_ints());
      }
    }
  }
  for (DType dt : {DType::f32, DType::bf16}) {
    for (int64_t skew : {0, 3}) {
      std::vector<Tensor> cpu, gpu;
      for (int64_t n : {1, 8, 4097, 300001}) cpu.push_back(host(randn(n, 150 + n), {n}, dt));
      cpu[1].narrow(7, 1).fill_(NAN);
      cpu[3].narrow(299999, 1).fill_(-INFINITY);
      for (const Tensor& t : cpu) gpu.push_back(on_gpu(t, skew));
      Tensor fc = Tensor::zeros({4}, DType::i32, Device::cpu(), MemCategory::workspace);
      Tensor fg = Tensor::zeros({4}, DType::i32, kGpu, MemCategory::workspace);
      mark_nonfinite(cpu, fc);
      mark_nonfinite(gpu, fg);
      EXPECT_EQ(fc.to_ints(), (std::vector<int32_t>{0, 1, 0, 1}));
      EXPECT_EQ(fg.to_ints(), fc.to_ints()) << dtype_name(dt) << " skew " << skew;
    }
  }
}

}  // namespace
}  // namespace bb
