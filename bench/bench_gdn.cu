// bench_gdn — the chunked gated delta rule (primitives/gdn) on one GPU: forward, backward and
// forward + backward through the public API, at Qwen3.5 shapes by default.
//
//   bench_gdn [--seq LIST] [--hk 16] [--hv 32] [--k 128] [--v 128] [--dtype bf16|f32]
//             [--do-dtype same|f32] [--no-l2norm] [--vt auto|16|32|64] [--state-warps auto|4|8]
//             [--no-overlap] [--block-order auto|chunk|head] [--resident-prep]
//             [--fwd-split auto|0-100] [--host-ahead] [--kernels] [--iters 10] [--warmup 2]
//   The kernel-variant flags (--vt, --state-warps, --no-overlap, --block-order, --resident-prep,
//   --fwd-split) set cuda::GdnVariant (gated_delta_rule_cuda.h); every variant computes the same
//   bits.
//   LIST: comma-separated shapes, each N (one sequence of N tokens) or NxM (M packed sequences of
//   N tokens); default 32768,4096x8,131072,262144.
//
// Timing: CUDA events on the compute stream around each call, median of --iters calls after
// --warmup calls (the allocator's pool is warm then; the host-side chunk table and its upload
// are inside the timed region). --host-ahead first queues a 1 ms spin kernel before the start
// event, so the call's host work (chunk table, upload, launches) runs while the GPU is busy, as
// in a training step where the host is ahead of the GPU: the times are then the GPU's alone
// (the blocking-kernel method of NVBench). --kernels: after each shape's row, one more forward
// and one backward, each traced with CUPTI (bench/gpu_activity.h; libcupti.so.13 on the library
// path), list their kernels (launches, summed GPU ms; kernels on side streams overlap) and the
// GPU's busy time. The tracer stays on once started, so the rows after the first traced shape
// are timed with it on (a few percent slower): take times from a run without --kernels. The
// last five columns: the forward that keeps
// its chunk_prep outputs for the backward (GatedDeltaPrep), the backward that takes them (each
// timed call gets a fresh prep from an untimed forward), the pair, and the bytes per token of
// the kept prep and of the backward's remaining workspace.
// FLOPs: the matrix products of the chunked algorithm as the kernels execute them, per token and
// value head with chunk C = 64 (full C x C intra-chunk tiles; the triangular solve and
// elementwise work are not counted):
//   forward  2 (3 C K + 2 C V + 3 K V)                (K K^T, Q K^T, W, U, W S, Q S, P Delta, K^T
//   Delta) backward 2 (10 C K + 5 C V + 8 K V + 2 C^2)        (rebuild without o, reverse state
//   pass, dq/dk/dW,
//                                                       WY backward)
// Inputs are random (q, k, v ~ U(-1, 1), g ~ U(-0.3, -0.01), beta ~ U(0.1, 0.9)); the output's
// first rows are checked to be finite so that a broken build cannot report a time.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#ifdef BB_WITH_CUDA
#include <cuda_bf16.h>

#include "backend/cuda/check.cuh"
#include "backend/cuda/runtime.h"
#include "core/tensor.h"
#include "primitives/gdn/gated_delta_rule.h"
#include "primitives/gdn/gated_delta_rule_cuda.h"
#include "gpu_activity.h"
#endif

namespace {

struct Shape2 {
  int64_t len = 0, count = 1;
};

struct Args {
  std::vector<Shape2> shapes;
  int64_t hk = 16, hv = 32, k = 128, v = 128;
  std::string dtype = "bf16", do_dtype = "same", vt = "auto", state_warps = "auto",
              block_order = "auto";
  bool l2norm = true, overlap = true, host_ahead = false, kernels = false, resident_prep = false;
  int fwd_split = -1;
  int iters = 10, warmup = 2;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(
      stderr,
      "bench_gdn: %s\n"
      "usage: bench_gdn [--seq N|NxM[,...]] [--hk 16] [--hv 32] [--k 128] [--v 128]\n"
      "                 [--dtype bf16|f32] [--do-dtype same|f32] [--no-l2norm] [--vt auto|16|32|64]\n"
      "                 [--state-warps auto|4|8] [--no-overlap] [--block-order auto|chunk|head]\n"
      "                 [--resident-prep] [--fwd-split auto|0-100] [--host-ahead] [--kernels]\n"
      "                 [--iters 10] [--warmup 2]\n",
      why.c_str());
  std::exit(2);
}

int64_t positive(const std::string& flag, const std::string& v) {
  size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (...) {
    usage(flag + " needs a positive integer, got '" + v + "'");
  }
  if (used != v.size() || x <= 0) usage(flag + " needs a positive integer, got '" + v + "'");
  return x;
}

std::vector<Shape2> parse_seq(const std::string& s) {
  std::vector<Shape2> out;
  size_t p = 0;
  while (p <= s.size()) {
    size_t c = s.find(',', p);
    if (c == std::string::npos) c = s.size();
    const std::string item = s.substr(p, c - p);
    if (item.empty()) usage("--seq has an empty item in '" + s + "'");
    Shape2 sh;
    const size_t x = item.find('x');
    sh.len = positive("--seq", item.substr(0, x));
    if (x != std::string::npos) sh.count = positive("--seq", item.substr(x + 1));
    out.push_back(sh);
    p = c + 1;
  }
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--no-overlap") {
      a.overlap = false;
      continue;
    }
    if (k == "--no-l2norm") {
      a.l2norm = false;
      continue;
    }
    if (k == "--host-ahead") {
      a.host_ahead = true;
      continue;
    }
    if (k == "--kernels") {
      a.kernels = true;
      continue;
    }
    if (k == "--resident-prep") {
      a.resident_prep = true;
      continue;
    }
    if (k == "--help" || k == "-h") usage("help");
    static const char* kValued[] = {"--seq",      "--hk",    "--hv",         "--k",
                                    "--v",        "--iters", "--warmup",     "--dtype",
                                    "--do-dtype", "--vt",    "--state-warps", "--block-order",
                                    "--fwd-split"};
    if (std::find(std::begin(kValued), std::end(kValued), k) == std::end(kValued))
      usage("unknown option " + k);
    if (i + 1 >= argc) usage("option " + k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--seq")
      a.shapes = parse_seq(v);
    else if (k == "--hk")
      a.hk = positive(k, v);
    else if (k == "--hv")
      a.hv = positive(k, v);
    else if (k == "--k")
      a.k = positive(k, v);
    else if (k == "--v")
      a.v = positive(k, v);
    else if (k == "--iters")
      a.iters = static_cast<int>(positive(k, v));
    else if (k == "--warmup")
      a.warmup = v == "0" ? 0 : static_cast<int>(positive(k, v));
    else if (k == "--dtype") {
      if (v != "bf16" && v != "f32") usage("--dtype must be bf16 or f32, got '" + v + "'");
      a.dtype = v;
    } else if (k == "--do-dtype") {
      if (v != "same" && v != "f32") usage("--do-dtype must be same or f32, got '" + v + "'");
      a.do_dtype = v;
    } else if (k == "--vt") {
      if (v != "auto" && v != "16" && v != "32" && v != "64")
        usage("--vt must be auto, 16, 32 or 64, got '" + v + "'");
      a.vt = v;
    } else if (k == "--state-warps") {
      if (v != "auto" && v != "4" && v != "8")
        usage("--state-warps must be auto, 4 or 8, got '" + v + "'");
      a.state_warps = v;
    } else if (k == "--block-order") {
      if (v != "auto" && v != "chunk" && v != "head")
        usage("--block-order must be auto, chunk or head, got '" + v + "'");
      a.block_order = v;
    } else if (k == "--fwd-split") {
      if (v == "auto") {
        a.fwd_split = -1;
      } else {
        const int64_t p = v == "0" ? 0 : positive(k, v);
        if (p > 100) usage("--fwd-split must be auto or a percent 0-100, got '" + v + "'");
        a.fwd_split = static_cast<int>(p);
      }
    } else
      usage("unknown option " + k);
  }
  if (a.shapes.empty()) a.shapes = {{32768, 1}, {4096, 8}, {131072, 1}, {262144, 1}};
  if (a.hv % a.hk != 0) usage("--hv must be a multiple of --hk");
  return a;
}

double fwd_flops_per_token_head(double C, double K, double V) {
  return 2 * (3 * C * K + 2 * C * V + 3 * K * V);
}
double bwd_flops_per_token_head(double C, double K, double V) {
  return 2 * (10 * C * K + 5 * C * V + 8 * K * V + 2 * C * C);
}

#ifdef BB_WITH_CUDA
using namespace bb;

// Uniform values in [lo, hi) from a hash of the index.
__global__ void fill_uniform(void* p, bool bf16, int64_t n, uint32_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h =
        static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32) * 40503u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    h *= 3266489917u;
    h ^= h >> 16;
    const float x = lo + (hi - lo) * (static_cast<float>(h >> 8) * (1.0f / 16777216.0f));
    if (bf16)
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
    else
      static_cast<float*>(p)[i] = x;
  }
}

Tensor random_tensor(const bb::Shape& s, DType dt, uint32_t seed, float lo, float hi) {
  Tensor t = Tensor::empty(s, dt, Device::cuda(0), MemCategory::other);
  if (t.numel() == 0) return t;
  fill_uniform<<<1024, 256, 0, cuda::stream()>>>(t.raw(), dt == DType::bf16, t.numel(), seed, lo,
                                                 hi);
  BB_CHECK_LAUNCH();
  return t;
}

// Spins one thread for about `ns` nanoseconds of GPU time (--host-ahead).
__global__ void spin_kernel(int64_t ns) {
  int64_t t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

// setup runs before each call, outside the timed region.
template <class Setup, class Fn>
double time_ms(const Args& a, Setup&& setup, Fn&& fn) {
  cudaEvent_t e0, e1;
  BB_CHECK_CUDA(cudaEventCreate(&e0));
  BB_CHECK_CUDA(cudaEventCreate(&e1));
  for (int i = 0; i < a.warmup; ++i) {
    setup();
    fn();
  }
  std::vector<double> ms;
  for (int i = 0; i < a.iters; ++i) {
    setup();
    if (a.host_ahead) {
      spin_kernel<<<1, 1, 0, cuda::stream()>>>(1000000);
      BB_CHECK_LAUNCH();
    }
    BB_CHECK_CUDA(cudaEventRecord(e0, cuda::stream()));
    fn();
    BB_CHECK_CUDA(cudaEventRecord(e1, cuda::stream()));
    BB_CHECK_CUDA(cudaEventSynchronize(e1));
    float t = 0;
    BB_CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}
template <class Fn>
double time_ms(const Args& a, Fn&& fn) {
  return time_ms(a, [] {}, fn);
}

// --kernels: one call traced; its kernels, most GPU time first.
template <class Fn>
void print_kernels(bench::GpuActivity& act, const char* what, const char* shape, Fn&& fn) {
  BB_CHECK_CUDA(cudaDeviceSynchronize());
  act.begin();
  fn();
  BB_CHECK_CUDA(cudaDeviceSynchronize());
  const bench::GpuActivity::Result r = act.end();
  if (!act.error.empty()) {
    std::printf("  (%s %s: no kernel trace: %s)\n", what, shape, act.error.c_str());
    return;
  }
  std::printf("  %s %s: GPU busy %.3f ms of a %.3f ms window; kernels (launches, ms):", what,
              shape, r.busy_ms, r.window_ms);
  for (const auto& k : r.kernels) std::printf(" %s %lld %.3f;", k.name.c_str(), static_cast<long long>(k.launches), k.ms);
  std::printf("\n");
}

int run(const Args& a) {
  cuda::GdnVariant var;
  if (a.vt != "auto") var.vt = std::stoi(a.vt);
  if (a.state_warps != "auto") var.state_warps = std::stoi(a.state_warps);
  var.overlap = a.overlap;
  var.chunk_fastest = a.block_order == "chunk";
  var.prep_reload = !a.resident_prep;
  var.fwd_split = a.fwd_split;
  cuda::set_gdn_variant(var);
  cudaDeviceProp prop{};
  BB_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const DType dt = a.dtype == "bf16" ? DType::bf16 : DType::f32;
  const DType do_dt = a.do_dtype == "same" ? dt : DType::f32;
  std::printf(
      "device: %s (%d SMs); Hk %lld, Hv %lld, K %lld, V %lld, %s q/k/v, d_o %s, l2norm %s, vt %s; "
      "backward state passes %s; median of %d after %d warm-up%s\n\n",
      prop.name, prop.multiProcessorCount, static_cast<long long>(a.hk),
      static_cast<long long>(a.hv), static_cast<long long>(a.k), static_cast<long long>(a.v),
      a.dtype.c_str(), dtype_name(do_dt), a.l2norm ? "on" : "off", a.vt.c_str(),
      a.overlap ? "overlapped" : "in sequence", a.iters, a.warmup,
      a.host_ahead ? "; host ahead (GPU time alone)" : "; host work inside the timed region");
  std::printf(
      "| shape | tokens | fwd ms | bwd ms | fwd+bwd ms | fwd TFLOP/s | bwd TFLOP/s | fwd+bwd "
      "TFLOP/s | fwd ws B/token | bwd ws B/token | fwd keeping prep ms | bwd from kept prep ms | "
      "fwd+bwd, kept prep ms | kept prep B/token | bwd ws with prep B/token |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape2& sh : a.shapes) {
    const int64_t T = sh.len * sh.count;
    std::vector<int32_t> cu = {0};
    for (int64_t i = 0; i < sh.count; ++i) cu.push_back(static_cast<int32_t>(cu.back() + sh.len));
    const Tensor cut = Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
    const Tensor q = random_tensor({T, a.hk, a.k}, dt, 1, -1.f, 1.f);
    const Tensor k = random_tensor({T, a.hk, a.k}, dt, 2, -1.f, 1.f);
    const Tensor v = random_tensor({T, a.hv, a.v}, dt, 3, -1.f, 1.f);
    const Tensor g = random_tensor({T, a.hv}, DType::f32, 4, -0.3f, -0.01f);
    const Tensor b = random_tensor({T, a.hv}, DType::f32, 5, 0.1f, 0.9f);
    const Tensor d_o = random_tensor({T, a.hv, a.v}, do_dt, 6, -1.f, 1.f);
    GatedDeltaOptions opts;
    opts.l2norm = a.l2norm;

    const double t_fwd =
        time_ms(a, [&] { (void)gated_delta_rule_forward(q, k, v, g, b, cut, opts); });
    const double t_bwd =
        time_ms(a, [&] { (void)gated_delta_rule_backward(d_o, q, k, v, g, b, cut, opts); });
    const double t_both = time_ms(a, [&] {
      (void)gated_delta_rule_forward(q, k, v, g, b, cut, opts);
      (void)gated_delta_rule_backward(d_o, q, k, v, g, b, cut, opts);
    });
    // The forward keeping its chunk_prep outputs, and the backward that takes them (and skips
    // qk_norm and chunk_prep). A prep serves one backward, so each timed backward gets a fresh
    // one from an untimed forward. Calls over the workspace limit keep nothing ("-").
    GatedDeltaPrep prep;
    const double t_fwd_keep = time_ms(a, [&] {
      (void)gated_delta_rule_forward(q, k, v, g, b, cut, opts, MemCategory::activations, &prep);
    });
    const bool kept = prep.defined();
    double t_bwd_kept = 0, t_both_kept = 0;
    if (kept) {
      t_bwd_kept = time_ms(
          a,
          [&] {
            (void)gated_delta_rule_forward(q, k, v, g, b, cut, opts, MemCategory::activations,
                                           &prep);
          },
          [&] { (void)gated_delta_rule_backward(d_o, q, k, v, g, b, cut, opts, &prep); });
      t_both_kept = time_ms(a, [&] {
        (void)gated_delta_rule_forward(q, k, v, g, b, cut, opts, MemCategory::activations, &prep);
        (void)gated_delta_rule_backward(d_o, q, k, v, g, b, cut, opts, &prep);
      });
    }
    prep = GatedDeltaPrep{};
    {  // a build that produces garbage must not report a time
      const Tensor o = gated_delta_rule_forward(q, k, v, g, b, cut, opts);
      const std::vector<float> head = o.narrow(0, std::min<int64_t>(T, 256)).to_floats();
      const GatedDeltaGrads gr = gated_delta_rule_backward(d_o, q, k, v, g, b, cut, opts);
      const std::vector<float> dqh = gr.d_q.narrow(0, std::min<int64_t>(T, 256)).to_floats();
      const std::vector<float> dgh = gr.d_g.narrow(0, std::min<int64_t>(T, 256)).to_floats();
      for (const std::vector<float>* vals : {&head, &dqh, &dgh})
        for (float x : *vals)
          BB_CHECK(std::isfinite(x), "bench_gdn: non-finite output; the kernels are broken");
    }
    cuda::GdnDims dims;
    dims.T = T;
    dims.Hk = static_cast<int>(a.hk);
    dims.Hv = static_cast<int>(a.hv);
    dims.K = static_cast<int>(a.k);
    dims.V = static_cast<int>(a.v);
    (void)cuda::gdn_chunk_table(cu.data(), sh.count, dims);
    const double ws_f = static_cast<double>(cuda::gdn_forward_workspace_bytes(dims, dt)) / T;
    const double ws_b =
        static_cast<double>(cuda::gdn_backward_workspace_bytes(dims, dt, do_dt)) / T;
    const double ws_p = static_cast<double>(cuda::gdn_prep_bytes(dims, dt)) / T;
    const double ws_bp =
        static_cast<double>(cuda::gdn_backward_workspace_bytes(dims, dt, do_dt, true)) / T;
    const double heads_tokens = static_cast<double>(T) * a.hv;
    const double ff = fwd_flops_per_token_head(64, a.k, a.v) * heads_tokens;
    const double fb = bwd_flops_per_token_head(64, a.k, a.v) * heads_tokens;
    char shape[64];
    if (sh.count == 1)
      std::snprintf(shape, sizeof(shape), "1 x %lld", static_cast<long long>(sh.len));
    else
      std::snprintf(shape, sizeof(shape), "%lld x %lld", static_cast<long long>(sh.count),
                    static_cast<long long>(sh.len));
    char kept_cols[160];
    if (kept)
      std::snprintf(kept_cols, sizeof(kept_cols), "%.3f | %.3f | %.3f | %.0f | %.0f", t_fwd_keep,
                    t_bwd_kept, t_both_kept, ws_p, ws_bp);
    else
      std::snprintf(kept_cols, sizeof(kept_cols), "%.3f | - | - | %.0f (over the limit) | -",
                    t_fwd_keep, ws_p);
    std::printf("| %s | %lld | %.3f | %.3f | %.3f | %.1f | %.1f | %.1f | %.0f | %.0f | %s |\n",
                shape, static_cast<long long>(T), t_fwd, t_bwd, t_both,
                ff / (t_fwd * 1e-3) / 1e12, fb / (t_bwd * 1e-3) / 1e12,
                (ff + fb) / (t_both * 1e-3) / 1e12, ws_f, ws_b, kept_cols);
    if (a.kernels) {
      static bench::GpuActivity act;
      static bool primed = false;
      if (!primed) {  // the first traced stretch pays the tracer's setup
        print_kernels(act, "(tracer warm-up)", shape,
                      [&] { (void)gated_delta_rule_forward(q, k, v, g, b, cut, opts); });
        primed = true;
      }
      print_kernels(act, "forward", shape,
                    [&] { (void)gated_delta_rule_forward(q, k, v, g, b, cut, opts); });
      print_kernels(act, "backward", shape,
                    [&] { (void)gated_delta_rule_backward(d_o, q, k, v, g, b, cut, opts); });
    }
    std::fflush(stdout);
  }
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
#ifdef BB_WITH_CUDA
  if (bb::cuda::device_count() == 0) {
    std::printf("bench_gdn: no usable CUDA device (%s); nothing to measure.\n",
                bb::cuda::unavailable_reason());
    return 0;
  }
  try {
    return run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gdn: %s\n", e.what());
    return 1;
  }
#else
  (void)a;
  std::printf(
      "bench_gdn: this build has no CUDA backend (BUMBLEBEE_CUDA=OFF); nothing to measure.\n");
  return 0;
#endif
}
