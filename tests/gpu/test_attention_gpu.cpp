// Causal GQA attention on the GPU (cuDNN fused flash attention) against the CPU path: o, lse,
// dq, dk, dv on packed batches of uneven lengths, GQA ratios 1 and 8, head dims 128 and 256;
// the graph cache; memory categories; and the errors for inputs cuDNN cannot take.
// Legend: T tokens, B sequences, Hq / Hkv query / kv heads, D head dim.
//
// Oracle: attention_forward / attention_backward on CPU f32 tensors holding the same
// bf16-rounded q, k, v, d_o (the CPU path agrees with the double reference to ~1e-6, see
// test_attention_fast). The GPU runs bf16 in, f32 accumulate, bf16 out.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/gpu.h"
#include "common/testing.h"
#include "core/tensor.h"
#include "primitives/attention/attention.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#include "primitives/attention/attention_cudnn.h"
#endif

namespace bb {
namespace {

struct Case {
  std::vector<int32_t> lens;
  int64_t Hq, Hkv, D;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string s = "Hq" + std::to_string(c.Hq) + "_Hkv" + std::to_string(c.Hkv) + "_D" +
                  std::to_string(c.D) + "_len";
  for (int32_t l : c.lens) s += "_" + std::to_string(l);
  return s;
}

std::vector<int32_t> cu_of(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu{0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

// Values rounded to bf16, so the CPU f32 oracle and the GPU see identical inputs.
std::vector<float> bf16_values(size_t n, uint64_t seed, uint64_t offset) {
  std::vector<float> v = test::randn(n, seed, 1.0f, offset);
  for (float& x : v) x = round_bf16(x);
  return v;
}

struct Problem {
  int64_t T, B, Hq, Hkv, D;
  float scale;
  Tensor cu;  // host i32
  std::vector<float> q, k, v, d_o;

  Problem(const Case& c, uint64_t seed) : Hq(c.Hq), Hkv(c.Hkv), D(c.D) {
    const std::vector<int32_t> cuv = cu_of(c.lens);
    T = cuv.back();
    B = static_cast<int64_t>(c.lens.size());
    scale = 1.0f / std::sqrt(static_cast<float>(D));
    cu = Tensor::from_ints(cuv, {B + 1});
    const size_t nq = static_cast<size_t>(T * Hq * D), nkv = static_cast<size_t>(T * Hkv * D);
    q = bf16_values(nq, seed, 0);
    k = bf16_values(nkv, seed, 1ull << 32);
    v = bf16_values(nkv, seed, 2ull << 32);
    d_o = bf16_values(nq, seed, 3ull << 32);
  }
  Tensor host(const std::vector<float>& x, int64_t H, DType dt) const {
    return Tensor::from_floats(x, {T, H, D}, dt);
  }
  Tensor gpu(const std::vector<float>& x, int64_t H) const {
    return host(x, H, DType::bf16).to(Device::cuda(0), MemCategory::other);
  }
};

struct Result {
  std::vector<float> o, lse, dq, dk, dv;
};

Result run_cpu(const Problem& p, const AttentionArgs& args) {
  Tensor q = p.host(p.q, p.Hq, DType::f32), k = p.host(p.k, p.Hkv, DType::f32);
  Tensor v = p.host(p.v, p.Hkv, DType::f32), d_o = p.host(p.d_o, p.Hq, DType::f32);
  AttentionSaved saved;
  Tensor o = attention_forward(q, k, v, args, &saved);
  AttentionGrads g = attention_backward(d_o, q, k, v, o, args, saved);
  return {o.to_floats(), saved.lse.to_floats(), g.dq.to_floats(), g.dk.to_floats(),
          g.dv.to_floats()};
}

Result run_gpu(const Problem& p, const AttentionArgs& args) {
  Tensor q = p.gpu(p.q, p.Hq), k = p.gpu(p.k, p.Hkv), v = p.gpu(p.v, p.Hkv);
  Tensor d_o = p.gpu(p.d_o, p.Hq);
  AttentionSaved saved;
  Tensor o = attention_forward(q, k, v, args, &saved);
  EXPECT_EQ(o.dtype(), DType::bf16);
  EXPECT_EQ(o.category(), MemCategory::activations);
  EXPECT_EQ(saved.lse.shape(), (Shape{p.Hq, p.T}));
  EXPECT_EQ(saved.lse.dtype(), DType::f32);
  EXPECT_EQ(saved.lse.category(), MemCategory::activations);
  AttentionGrads g = attention_backward(d_o, q, k, v, o, args, saved);
  for (const Tensor* t : {&g.dq, &g.dk, &g.dv}) {
    EXPECT_EQ(t->dtype(), DType::bf16);
    EXPECT_EQ(t->category(), MemCategory::activations);
    EXPECT_EQ(t->device(), Device::cuda(0));
  }
  return {o.to_floats(), saved.lse.to_floats(), g.dq.to_floats(), g.dk.to_floats(),
          g.dv.to_floats()};
}

Result run_cpu(const Problem& p) { return run_cpu(p, AttentionArgs::causal_self(p.cu, p.scale)); }
Result run_gpu(const Problem& p) { return run_gpu(p, AttentionArgs::causal_self(p.cu, p.scale)); }

bool all_finite(const std::vector<float>& x) {
  for (float v : x)
    if (!std::isfinite(v)) return false;
  return true;
}

void expect_close(const Result& gpu, const Result& cpu, const std::string& what) {
  const std::pair<const char*, std::pair<const std::vector<float>*, const std::vector<float>*>>
      fields[] = {{"o", {&gpu.o, &cpu.o}},    {"lse", {&gpu.lse, &cpu.lse}},
                  {"dq", {&gpu.dq, &cpu.dq}}, {"dk", {&gpu.dk, &cpu.dk}},
                  {"dv", {&gpu.dv, &cpu.dv}}};
  for (const auto& [name, pair] : fields) {
    EXPECT_TRUE(all_finite(*pair.first)) << what << ": " << name << " has NaN/Inf";
    const double err = test::rel_error(*pair.first, *pair.second);
    EXPECT_LT(err, test::kTolBf16) << what << ": " << name;
    std::printf("  %-40s %-4s rel err %.2e\n", what.c_str(), name, err);
  }
}

class AttentionCudnn : public testing::TestWithParam<Case> {};

// The GPU path against the CPU path: o, lse, dq, dk, dv within 1e-2 (relative L2).
TEST_P(AttentionCudnn, MatchesCpuReference) {
  BB_REQUIRE_GPU();
  const Problem p(GetParam(), 11);
  expect_close(run_gpu(p), run_cpu(p), case_name(testing::TestParamInfo<Case>(GetParam(), 0)));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionCudnn,
    testing::Values(
        // The packed batch of the brief, GQA ratio 1 and 8, D = 128 and 256.
        Case{{1, 17, 130, 64, 300}, 32, 32, 128}, Case{{1, 17, 130, 64, 300}, 32, 4, 128},
        Case{{1, 17, 130, 64, 300}, 32, 32, 256}, Case{{1, 17, 130, 64, 300}, 32, 4, 256},
        // Lengths that divide no tile size, and empty sequences at the start, middle and end.
        Case{{71, 229}, 32, 4, 128}, Case{{0, 5, 0, 300, 0}, 8, 2, 128},
        // One longer sequence (several tiles in both directions).
        Case{{1531}, 16, 2, 128}),
    case_name);

#ifdef BB_WITH_CUDA

// lse is the natural-log log-sum-exp: a one-token sequence has lse = scale * q.k exactly and
// o = v of that token.
TEST(AttentionCudnnSingle, LseIsNaturalLogAndFirstTokenCopiesV) {
  BB_REQUIRE_GPU();
  const Problem p(Case{{1, 3}, 4, 2, 128}, 5);
  AttentionSaved saved;
  Tensor o = attention_forward(p.gpu(p.q, p.Hq), p.gpu(p.k, p.Hkv), p.gpu(p.v, p.Hkv), AttentionArgs::causal_self(p.cu, p.scale), &saved);
  const std::vector<float> lse = saved.lse.to_floats(), of = o.to_floats();
  for (int64_t h = 0; h < p.Hq; ++h) {
    const int64_t kh = h / (p.Hq / p.Hkv);
    double dot = 0;
    for (int64_t e = 0; e < p.D; ++e) dot += p.q[h * p.D + e] * p.k[kh * p.D + e];
    EXPECT_NEAR(lse[h * p.T + 0], p.scale * dot, 1e-3 * (1 + std::fabs(p.scale * dot)));
    for (int64_t e = 0; e < p.D; ++e) {
      const float want = p.v[kh * p.D + e];
      EXPECT_NEAR(of[h * p.D + e], want, 1e-2 * std::fabs(want) + 1e-6);
    }
  }
}

// Batches in the same (batch, token) buckets reuse one graph; a new bucket builds one more.
TEST(AttentionCudnnSingle, GraphCacheReusedWithinBucket) {
  BB_REQUIRE_GPU();
  EXPECT_EQ(attention_cudnn_token_bucket(500), 512);
  EXPECT_EQ(attention_cudnn_token_bucket(513), 640);
  EXPECT_EQ(attention_cudnn_token_bucket(131072), 131072);
  EXPECT_EQ(attention_cudnn_token_bucket(100000), 114688);
  EXPECT_EQ(attention_cudnn_batch_bucket(5), 8);
  auto fwd = [](const Case& c) {
    const Problem p(c, 3);
    AttentionSaved saved;
    Tensor o = attention_forward(p.gpu(p.q, p.Hq), p.gpu(p.k, p.Hkv), p.gpu(p.v, p.Hkv), AttentionArgs::causal_self(p.cu, p.scale), &saved);
    Tensor qf = p.host(p.q, p.Hq, DType::f32), kf = p.host(p.k, p.Hkv, DType::f32);
    Tensor vf = p.host(p.v, p.Hkv, DType::f32);
    AttentionSaved ref_saved;
    Tensor ref = attention_forward(qf, kf, vf, AttentionArgs::causal_self(p.cu, p.scale), &ref_saved);
    EXPECT_LT(test::rel_error(o.to_floats(), ref.to_floats()), test::kTolBf16);
    EXPECT_LT(test::rel_error(saved.lse.to_floats(), ref_saved.lse.to_floats()), test::kTolBf16);
  };
  fwd(Case{{200, 250, 30}, 8, 2, 128});  // T = 480 -> bucket 512, B = 3 -> 4
  const int64_t built = attention_cudnn_graph_count();
  fwd(Case{{100, 400, 7}, 8, 2, 128});  // T = 507, same buckets
  fwd(Case{{500, 1, 1, 1}, 8, 2, 128});  // T = 503, B = 4
  EXPECT_EQ(attention_cudnn_graph_count(), built);
  fwd(Case{{100, 100, 100, 100, 100}, 8, 2, 128});  // B = 5 -> 8: a new graph
  EXPECT_EQ(attention_cudnn_graph_count(), built + 1);
}

// One sequence that fills its token bucket (1024 tokens) runs the dense graphs: no ragged
// offsets, stats written and read in lse's [Hq, T] layout. The same tokens packed as a batch of
// two (an empty second sequence) run the packed graphs. Both against the CPU path, for each mask
// (with Tq == Tkv bottom-right is top-left) and both head dims; the dense calls are counted.
TEST(AttentionCudnnSingle, OneWholeSequenceRunsDenseGraphs) {
  BB_REQUIRE_GPU();
  for (int64_t d : {128, 256}) {
    for (AttentionMask mask :
         {AttentionMask::causal, AttentionMask::causal_bottom_right, AttentionMask::none}) {
      const Problem whole(Case{{1024}, 8, 2, d}, 13);
      const Problem packed(Case{{1024, 0}, 8, 2, d}, 13);  // the same values: same T and seed
      ASSERT_EQ(whole.q, packed.q);
      const std::string what = std::string(attention_mask_name(mask)) + "_D" + std::to_string(d);
      const AttentionArgs whole_args{whole.cu, whole.cu, mask, whole.scale};
      const AttentionArgs packed_args{packed.cu, packed.cu, mask, packed.scale};
      const Result cpu = run_cpu(whole, whole_args);
      const int64_t calls = attention_cudnn_dense_calls();
      const Result dense = run_gpu(whole, whole_args);
      EXPECT_EQ(attention_cudnn_dense_calls(), calls + 2) << what;
      const Result ragged = run_gpu(packed, packed_args);
      EXPECT_EQ(attention_cudnn_dense_calls(), calls + 2) << what;
      expect_close(dense, cpu, "dense " + what);
      expect_close(ragged, cpu, "packed " + what);
      expect_close(dense, ragged, "dense vs packed " + what);
    }
  }
}

// Scratch goes under workspace and is released; only o and lse stay (activations).
TEST(AttentionCudnnSingle, ScratchIsWorkspaceAndReleased) {
  BB_REQUIRE_GPU();
  const Problem p(Case{{300, 212}, 8, 2, 128}, 9);
  Tensor q = p.gpu(p.q, p.Hq), k = p.gpu(p.k, p.Hkv), v = p.gpu(p.v, p.Hkv);
  Tensor d_o = p.gpu(p.d_o, p.Hq);
  Allocator& a = allocator_for(Device::cuda(0));
  const MemoryStats before = a.stats();
  a.reset_peak();
  {
    AttentionSaved saved;
    Tensor o = attention_forward(q, k, v, AttentionArgs::causal_self(p.cu, p.scale), &saved);
    const int64_t act = a.stats().live_of(MemCategory::activations) -
                        before.live_of(MemCategory::activations);
    EXPECT_EQ(act, p.T * p.Hq * p.D * 2 + p.Hq * p.T * 4);  // o + lse
    AttentionGrads g = attention_backward(d_o, q, k, v, o, AttentionArgs::causal_self(p.cu, p.scale), saved);
    cuda::synchronize();
    EXPECT_GT(a.stats().peak_of(MemCategory::workspace), before.live_of(MemCategory::workspace));
  }
  EXPECT_EQ(a.stats().live_of(MemCategory::workspace), before.live_of(MemCategory::workspace));
  EXPECT_EQ(a.stats().live_of(MemCategory::activations),
            before.live_of(MemCategory::activations));
}

TEST(AttentionCudnnSingle, UnsupportedInputsRaiseClearErrors) {
  BB_REQUIRE_GPU();
  const Problem p(Case{{5, 9}, 4, 2, 128}, 1);
  Tensor qf = p.host(p.q, p.Hq, DType::f32).to(Device::cuda(0));
  Tensor kf = p.host(p.k, p.Hkv, DType::f32).to(Device::cuda(0));
  Tensor vf = p.host(p.v, p.Hkv, DType::f32).to(Device::cuda(0));
  test::expect_error_contains(
      [&] { attention_forward(qf, kf, vf, AttentionArgs::causal_self(p.cu, p.scale), nullptr); },
      "attention_forward: the CUDA path (cuDNN fused attention) needs bf16 'q', got f32");
  // cu_seqlens must stay on the host (it is copied inside a kernel launch).
  Tensor q = p.gpu(p.q, p.Hq), k = p.gpu(p.k, p.Hkv), v = p.gpu(p.v, p.Hkv);
  Tensor cu_dev = p.cu.to(Device::cuda(0));
  test::expect_error_contains([&] { attention_forward(q, k, v, AttentionArgs::causal_self(cu_dev, p.scale), nullptr); },
                              "cu_seqlens_q must be a host (CPU) tensor");
  // Only the validated head dims run on the GPU (cuDNN accepts D = 8 but its gradients were
  // seen to be wrong there); the error names the head dim and the supported ones.
  for (int64_t d : {8, 12, 64}) {
    const Problem odd(Case{{5, 9}, 4, 2, d}, 1);
    test::expect_error_contains(
        [&] {
          attention_forward(odd.gpu(odd.q, 4), odd.gpu(odd.k, 2), odd.gpu(odd.v, 2), AttentionArgs::causal_self(odd.cu, odd.scale), nullptr);
        },
        "attention_forward: head_dim " + std::to_string(d) +
            " is not supported by the CUDA path (cuDNN fused attention is validated for head_dim "
            "128 and 256)");
  }
}

#endif  // BB_WITH_CUDA

// ---- query blocks against key blocks, every mask (the context-parallel calls) ------------------

struct BlockCase {
  std::vector<int32_t> lens_q, lens_kv;
  int64_t Hq, Hkv, D;
  AttentionMask mask;
};

std::string block_name(const testing::TestParamInfo<BlockCase>& info) {
  const BlockCase& c = info.param;
  std::string s = std::string(attention_mask_name(c.mask)) + "_Hq" + std::to_string(c.Hq) + "_Hkv" +
                  std::to_string(c.Hkv) + "_D" + std::to_string(c.D) + "_q";
  for (int32_t l : c.lens_q) s += "_" + std::to_string(l);
  s += "_kv";
  for (int32_t l : c.lens_kv) s += "_" + std::to_string(l);
  return s;
}

class AttentionCudnnBlocks : public testing::TestWithParam<BlockCase> {};

// The GPU path against the CPU path (itself checked against the naive oracle and finite
// differences in test_attention) for q and kv packed separately, with each mask.
TEST_P(AttentionCudnnBlocks, MatchesCpuReference) {
  BB_REQUIRE_GPU();
  const BlockCase& c = GetParam();
  const std::vector<int32_t> cq = cu_of(c.lens_q), ck = cu_of(c.lens_kv);
  const int64_t Tq = cq.back(), Tk = ck.back(), B = static_cast<int64_t>(c.lens_q.size());
  const AttentionArgs args{Tensor::from_ints(cq, {B + 1}), Tensor::from_ints(ck, {B + 1}), c.mask,
                           1.0f / std::sqrt(static_cast<float>(c.D))};
  const std::vector<float> q = bf16_values(Tq * c.Hq * c.D, 21, 0), k = bf16_values(Tk * c.Hkv * c.D, 21, 1ull << 32),
                           v = bf16_values(Tk * c.Hkv * c.D, 21, 2ull << 32), d_o = bf16_values(Tq * c.Hq * c.D, 21, 3ull << 32);
  auto make = [&](const std::vector<float>& x, int64_t T, int64_t H, bool gpu) {
    Tensor t = Tensor::from_floats(x, {T, H, c.D}, gpu ? DType::bf16 : DType::f32);
    return gpu ? t.to(Device::cuda(0), MemCategory::other) : t;
  };
  Result res[2];
  for (int gpu = 0; gpu < 2; ++gpu) {
    Tensor tq = make(q, Tq, c.Hq, gpu), tk = make(k, Tk, c.Hkv, gpu), tv = make(v, Tk, c.Hkv, gpu),
           tdo = make(d_o, Tq, c.Hq, gpu);
    AttentionSaved saved;
    Tensor o = attention_forward(tq, tk, tv, args, &saved);
    AttentionGrads g = attention_backward(tdo, tq, tk, tv, o, args, saved);
    res[gpu] = {o.to_floats(), saved.lse.to_floats(), g.dq.to_floats(), g.dk.to_floats(), g.dv.to_floats()};
  }
  expect_close(res[1], res[0], block_name(testing::TestParamInfo<BlockCase>(c, 0)));
}

INSTANTIATE_TEST_SUITE_P(
    Masks, AttentionCudnnBlocks,
    testing::Values(
        // An off-diagonal ring step: the whole key block before the queries, no mask.
        BlockCase{{64, 130, 17}, {64, 130, 17}, 16, 2, 128, AttentionMask::none},
        BlockCase{{1, 300, 71}, {250, 5, 300}, 16, 2, 128, AttentionMask::none},
        // The queries are the last positions of the keys (causal with a kv offset).
        BlockCase{{64, 30, 100}, {128, 30, 229}, 16, 2, 128, AttentionMask::causal_bottom_right},
        BlockCase{{17, 1}, {300, 77}, 8, 8, 256, AttentionMask::causal_bottom_right},
        // The diagonal block of a split sequence: causal, q and kv offsets given separately.
        BlockCase{{64, 130, 17}, {64, 130, 17}, 16, 2, 128, AttentionMask::causal}),
    block_name);

#ifdef BB_WITH_CUDA

// The graph cache keys on the mask and on the query and key buckets separately.
TEST(AttentionCudnnSingle, GraphCacheKeysOnMaskAndBothTokenCounts) {
  BB_REQUIRE_GPU();
  const Problem p(Case{{200, 250}, 8, 2, 128}, 3);
  Tensor q = p.gpu(p.q, p.Hq), k = p.gpu(p.k, p.Hkv), v = p.gpu(p.v, p.Hkv);
  AttentionArgs args = AttentionArgs::causal_self(p.cu, p.scale);
  attention_forward(q, k, v, args, nullptr);
  int64_t built = attention_cudnn_graph_count();
  attention_forward(q, k, v, args, nullptr);
  args.cu_seqlens_kv = p.cu;  // the same offsets given explicitly: the same graph
  attention_forward(q, k, v, args, nullptr);
  EXPECT_EQ(attention_cudnn_graph_count(), built);
  args.mask = AttentionMask::none;
  attention_forward(q, k, v, args, nullptr);
  EXPECT_EQ(attention_cudnn_graph_count(), built + 1);
  args.mask = AttentionMask::causal_bottom_right;
  attention_forward(q, k, v, args, nullptr);
  EXPECT_EQ(attention_cudnn_graph_count(), built + 2);
  // Fewer keys (another key bucket, the same query bucket): one more.
  const Problem shorter(Case{{100, 250}, 8, 2, 128}, 4);
  args.mask = AttentionMask::none;
  args.cu_seqlens_kv = shorter.cu;
  attention_forward(q, shorter.gpu(shorter.k, 2), shorter.gpu(shorter.v, 2), args, nullptr);
  EXPECT_EQ(attention_cudnn_graph_count(), built + 3);
  // Queries with no key are refused on the GPU (the CPU gives them o = 0, lse = -inf).
  args.cu_seqlens_kv = Tensor::from_ints({0, 0, 350}, {3});
  test::expect_error_contains([&] { attention_forward(q, shorter.gpu(shorter.k, 2), shorter.gpu(shorter.v, 2), args, nullptr); },
                              "sequence 0 has 200 queries and no key");
}

#endif  // BB_WITH_CUDA

}  // namespace
}  // namespace bb
