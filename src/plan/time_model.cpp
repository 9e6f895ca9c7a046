// time_model.cpp — see time_model.h; the formulas are listed in skills/planner.md ("Time").
#include "plan/time_model.h"

#include "plan/estimate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/fs.h"
#include "models/config.h"
#include "primitives/recompute/recompute.h"
#include "runtime/state.h"

namespace bb::plan {

double Curve::at(double x) const {
  BB_CHECK(!pts.empty(), "time model: an empty calibration curve");
  if (x <= pts.front().first) return pts.front().second;
  if (x >= pts.back().first) return pts.back().second;
  size_t i = 1;
  while (pts[i].first < x) ++i;
  const auto& [x0, y0] = pts[i - 1];
  const auto& [x1, y1] = pts[i];
  const double f = (std::log(x) - std::log(x0)) / (std::log(x1) - std::log(x0));
  return y0 + f * (y1 - y0);
}

namespace {

void check_curve(const Curve& c, const std::string& where, const char* name) {
  BB_CHECK(!c.pts.empty(), where, ": calibration curve '", name, "' has no points");
  for (size_t i = 0; i < c.pts.size(); ++i) {
    BB_CHECK(c.pts[i].first > 0 && std::isfinite(c.pts[i].first), where, ": calibration curve '", name, "' point ", i,
             " has x = ", c.pts[i].first, " (must be > 0)");
    BB_CHECK(c.pts[i].second > 0 && std::isfinite(c.pts[i].second), where, ": calibration curve '", name, "' point ", i,
             " has the value ", c.pts[i].second, " (must be > 0)");
    BB_CHECK(i == 0 || c.pts[i].first > c.pts[i - 1].first, where, ": calibration curve '", name,
             "' must have x ascending (point ", i, ")");
  }
}

nlohmann::json curve_json(const Curve& c) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& [x, y] : c.pts) a.push_back({x, y});
  return a;
}

Curve curve_from(const nlohmann::json& j, const char* key, const std::string& where) {
  BB_CHECK(j.contains(key) && j[key].is_array(), where, ": calibration has no '", key, "' list of [x, y] points");
  Curve c;
  for (const auto& p : j[key]) {
    BB_CHECK(p.is_array() && p.size() == 2 && p[0].is_number() && p[1].is_number(), where, ": calibration '", key,
             "' has a point that is not [x, y]: ", p.dump());
    c.pts.push_back({p[0].get<double>(), p[1].get<double>()});
  }
  return c;
}

}  // namespace

void Calibration::validate(const std::string& where) const {
  check_curve(gemm_tflops, where, "gemm_tflops");
  check_curve(grouped_tflops, where, "grouped_tflops");
  check_curve(attn_fwd_tflops, where, "attn_fwd_tflops");
  check_curve(attn_bwd_tflops, where, "attn_bwd_tflops");
  for (const AttentionRates& r : attn_by_head_dim) {
    BB_CHECK(r.head_dim > 0 && r.heads > 0, where, ": attention_head_dims entries need head_dim and heads > 0, got ",
             r.head_dim, " and ", r.heads);
    const std::string n = "attention_head_dims[head_dim " + std::to_string(r.head_dim) + "]";
    check_curve(r.fwd_tflops, where, (n + ".fwd_tflops").c_str());
    check_curve(r.bwd_tflops, where, (n + ".bwd_tflops").c_str());
  }
  check_curve(gdn_fwd_ns, where, "gdn_fwd_ns");
  check_curve(gdn_bwd_ns, where, "gdn_bwd_ns");
  BB_CHECK(elementwise_gbps > 0 && std::isfinite(elementwise_gbps), where, ": elementwise_gbps must be > 0, got ",
           elementwise_gbps);
  BB_CHECK(copy_gbps > 0 && std::isfinite(copy_gbps), where, ": copy_gbps must be > 0, got ", copy_gbps);
  BB_CHECK(host_adamw_geps >= 0 && std::isfinite(host_adamw_geps) && pcie_gbps >= 0 && std::isfinite(pcie_gbps), where,
           ": host_adamw_geps and pcie_gbps must be >= 0 (0 = not measured), got ", host_adamw_geps, " and ", pcie_gbps);
}

nlohmann::json Calibration::to_json() const {
  nlohmann::json j;
  j["format"] = "bumblebee-calibration-1";
  j["device"] = device;
  j["source"] = source;
  j["gemm_tflops"] = curve_json(gemm_tflops);
  j["grouped_tflops"] = curve_json(grouped_tflops);
  j["attn_fwd_tflops"] = curve_json(attn_fwd_tflops);
  j["attn_bwd_tflops"] = curve_json(attn_bwd_tflops);
  if (!attn_by_head_dim.empty()) {
    nlohmann::json a = nlohmann::json::array();
    for (const AttentionRates& r : attn_by_head_dim)
      a.push_back({{"head_dim", r.head_dim}, {"heads", r.heads}, {"fwd_tflops", curve_json(r.fwd_tflops)},
                   {"bwd_tflops", curve_json(r.bwd_tflops)}});
    j["attention_head_dims"] = a;
  }
  j["gdn_fwd_ns"] = curve_json(gdn_fwd_ns);
  j["gdn_bwd_ns"] = curve_json(gdn_bwd_ns);
  j["elementwise_gbps"] = elementwise_gbps;
  j["copy_gbps"] = copy_gbps;
  if (host_adamw_geps > 0) j["host_adamw_geps"] = host_adamw_geps;
  if (pcie_gbps > 0) j["pcie_gbps"] = pcie_gbps;
  j["shapes"] = {{"grouped_hidden", grouped_hidden}, {"grouped_ffn", grouped_ffn},   {"attn_heads", attn_heads},
                 {"attn_head_dim", attn_head_dim},   {"gdn_key_dim", gdn_key_dim},   {"gdn_value_dim", gdn_value_dim}};
  return j;
}

Calibration Calibration::from_json(const nlohmann::json& j, const std::string& where) {
  BB_CHECK(j.is_object(), where, ": a calibration is a JSON object");
  BB_CHECK(j.value("format", std::string()) == "bumblebee-calibration-1", where,
           ": not a bumblebee calibration (format must be \"bumblebee-calibration-1\"; write one with "
           "bumblebee plan --calibrate --out FILE)");
  Calibration c;
  c.device = j.value("device", std::string());
  c.source = j.value("source", std::string());
  c.gemm_tflops = curve_from(j, "gemm_tflops", where);
  c.grouped_tflops = curve_from(j, "grouped_tflops", where);
  c.attn_fwd_tflops = curve_from(j, "attn_fwd_tflops", where);
  c.attn_bwd_tflops = curve_from(j, "attn_bwd_tflops", where);
  if (j.contains("attention_head_dims")) {
    BB_CHECK(j["attention_head_dims"].is_array(), where, ": attention_head_dims must be an array");
    for (const auto& e : j["attention_head_dims"]) {
      BB_CHECK(e.is_object() && e.contains("head_dim") && e["head_dim"].is_number_integer() && e.contains("heads") &&
                   e["heads"].is_number_integer(),
               where, ": each attention_head_dims entry needs integers head_dim and heads");
      AttentionRates r;
      r.head_dim = e["head_dim"].get<int64_t>();
      r.heads = e["heads"].get<int64_t>();
      const std::string w = where + ", attention_head_dims[head_dim " + std::to_string(r.head_dim) + "]";
      r.fwd_tflops = curve_from(e, "fwd_tflops", w);
      r.bwd_tflops = curve_from(e, "bwd_tflops", w);
      c.attn_by_head_dim.push_back(r);
    }
  }
  c.gdn_fwd_ns = curve_from(j, "gdn_fwd_ns", where);
  c.gdn_bwd_ns = curve_from(j, "gdn_bwd_ns", where);
  BB_CHECK(j.contains("elementwise_gbps") && j["elementwise_gbps"].is_number() && j.contains("copy_gbps") &&
               j["copy_gbps"].is_number(),
           where, ": calibration needs numbers elementwise_gbps and copy_gbps");
  c.elementwise_gbps = j["elementwise_gbps"].get<double>();
  c.copy_gbps = j["copy_gbps"].get<double>();
  for (const char* k : {"host_adamw_geps", "pcie_gbps"})
    BB_CHECK(!j.contains(k) || j[k].is_number(), where, ": ", k, " must be a number");
  c.host_adamw_geps = j.value("host_adamw_geps", 0.0);
  c.pcie_gbps = j.value("pcie_gbps", 0.0);
  if (j.contains("shapes") && j["shapes"].is_object()) {
    const auto& s = j["shapes"];
    c.grouped_hidden = s.value("grouped_hidden", int64_t{0});
    c.grouped_ffn = s.value("grouped_ffn", int64_t{0});
    c.attn_heads = s.value("attn_heads", int64_t{0});
    c.attn_head_dim = s.value("attn_head_dim", int64_t{0});
    c.gdn_key_dim = s.value("gdn_key_dim", int64_t{0});
    c.gdn_value_dim = s.value("gdn_value_dim", int64_t{0});
  }
  c.validate(where);
  return c;
}

Calibration Calibration::load(const std::string& path) {
  std::ifstream f(path);
  BB_CHECK(f.good(), "calibration: cannot read '", path, "' (write one with bumblebee plan --calibrate --out FILE)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    BB_FAIL("calibration: '", path, "' is not valid JSON: ", e.what());
  }
  return from_json(j, "calibration '" + path + "'");
}

void Calibration::save(const std::string& path) const {
  validate("calibration");
  atomic_write(path, to_json().dump(2) + "\n");
}

const Calibration& Calibration::builtin() {
  static const Calibration c = [] {
    Calibration k;
    // `bumblebee plan --calibrate` on an H100 80GB HBM3, 2026-12-06, with attention at head dims 128
    // and 256 (rounded to 4 digits).
    k.device = "NVIDIA H100 80GB HBM3";
    k.source = "bumblebee plan --calibrate, 2026-12-06 (bench/results/2026-12-06-h100-attention-head-dim.md)";
    k.gemm_tflops.pts = {{5.369e+08, 25.48}, {2.147e+09, 101}, {8.59e+09, 267.2}, {1.718e+10, 372.1}, {3.436e+10, 558.4}, {5.154e+10, 620.9}, {6.872e+10, 650.7}, {1.374e+11, 730.2}, {2.062e+11, 745.8}, {2.749e+11, 744}, {5.498e+11, 768.5}, {8.246e+11, 779.6}, {1.1e+12, 756.7}, {1.649e+12, 788}};
    k.grouped_tflops.pts = {{32, 36.1}, {128, 135.9}, {512, 371}, {2048, 588.5}, {8192, 581.2}};
    k.attn_fwd_tflops.pts = {{4096, 499.9}, {8192, 607.7}, {1.638e+04, 657.8}, {3.277e+04, 638}, {6.554e+04, 625.3}, {1.311e+05, 554.8}};
    k.attn_bwd_tflops.pts = {{4096, 422.8}, {8192, 518.6}, {1.638e+04, 526.1}, {3.277e+04, 541}, {6.554e+04, 525.8}, {1.311e+05, 538.2}};
    Calibration::AttentionRates d256;
    d256.head_dim = 256;
    d256.heads = 16;
    d256.fwd_tflops.pts = {{4096, 488.9}, {8192, 621.7}, {1.638e+04, 688}, {3.277e+04, 697.9}, {6.554e+04, 613}, {1.311e+05, 569.3}};
    d256.bwd_tflops.pts = {{4096, 334.1}, {8192, 401.6}, {1.638e+04, 373.3}, {3.277e+04, 380.5}, {6.554e+04, 382.6}, {1.311e+05, 379.6}};
    k.attn_by_head_dim.push_back(d256);
    k.gdn_fwd_ns.pts = {{4096, 2.64}, {1.638e+04, 2.336}, {6.554e+04, 1.851}, {1.311e+05, 1.848}};
    k.gdn_bwd_ns.pts = {{4096, 7.814}, {1.638e+04, 6.108}, {6.554e+04, 7.348}, {1.311e+05, 7.759}};
    k.elementwise_gbps = 3149;
    k.copy_gbps = 2996;
    // The optimizer offload's host pool (15 threads of a 16-core host) and page-locked copies:
    // plan --calibrate on an H100 machine, bench/results/2026-12-06-h100-optimizer-offload.md.
    k.host_adamw_geps = 5.24;
    k.pcie_gbps = 55.2;
    k.grouped_hidden = 2048;
    k.grouped_ffn = 768;
    k.attn_heads = 32;
    k.attn_head_dim = 128;
    k.gdn_key_dim = 128;
    k.gdn_value_dim = 128;
    k.validate("the built-in calibration");
    return k;
  }();
  return c;
}

std::pair<const Curve*, const Curve*> Calibration::attention_curves(int64_t d, bool* exact) const {
  for (const AttentionRates& r : attn_by_head_dim)
    if (r.head_dim == d) {
      if (exact) *exact = true;
      return {&r.fwd_tflops, &r.bwd_tflops};
    }
  if (exact) *exact = attn_head_dim == d;
  return {&attn_fwd_tflops, &attn_bwd_tflops};
}

double adamw_update_bytes(OptimizerKind opt, DType param_dtype, const std::string& master_storage) {
  const double moment = opt == OptimizerKind::adamw_bf16_moments ? 2 : 4;
  const double master = param_dtype == DType::f32 || splits_master(master_storage, param_dtype) ? 8 : 10;
  return 4 + 4 * moment + master;
}

double chunk_pipeline_s(double a, double b, double c, int64_t C) {
  BB_CHECK(C >= 1, "chunk_pipeline_s: chunks must be >= 1, got ", C);
  const double n = static_cast<double>(C);
  const double flow = (a + b + c) / n + (n - 1) / n * std::max({a, b, c});
  // The send and the return share the link: it carries all of both.
  const double link = a + c;
  return std::max(flow, link);
}

namespace {

// One pass of one layer (or the head), by category, seconds.
struct Pass {
  double dense = 0, expert = 0, attn = 0, gdn = 0, head = 0, elem = 0;
  double flops = 0;
  double total() const { return dense + expert + attn + gdn + head + elem; }
  Pass& operator+=(const Pass& o) {
    dense += o.dense, expert += o.expert, attn += o.attn, gdn += o.gdn, head += o.head, elem += o.elem;
    flops += o.flops;
    return *this;
  }
};

struct Pricer {
  const Calibration& cal;
  // One dense GEMM call of `flops`.
  double gemm(double flops) const { return flops / (cal.gemm_tflops.at(flops) * 1e12); }
  double bytes(double b) const { return b / (cal.elementwise_gbps * 1e9); }
};

// The layer's three passes: forward, the recompute's forward (full recompute), backward.
struct LayerTime {
  Pass fwd, rec, bwd;
  double expert_fwd = 0, expert_rec = 0, expert_bwd = 0;  // the expert GEMMs of each (for the EP pipeline)
  double attn_fwd = 0, attn_bwd = 0;                       // the attention core (for the CP ring)
  bool moe = false, gdn = false;
};

}  // namespace

TimeEstimate estimate_time(const RunConfig& cfg, const MemoryEstimate& mem, const Calibration& cal) {
  const ModelConfig& mc = cfg.model;
  const ParallelLayout& L = mem.layout;
  BB_CHECK(L.pp == 1, "time model: pipeline parallelism is not modelled (pp = ", L.pp, ")");
  TimeEstimate te;
  const Pricer pr{cal};
  const double T = static_cast<double>(mem.tokens_local);
  const double seq = static_cast<double>(cfg.micro_batch_tokens);
  const double A = static_cast<double>(cfg.grad_accum);
  const double H = static_cast<double>(mc.hidden_size);
  const double a = mem.device.is_cuda() ? (cfg.model_dtype == "f32" ? 4.0 : 2.0) : 4.0;
  const double Hq = static_cast<double>(mc.num_heads), D = static_cast<double>(mc.head_dim);
  const double Q = Hq * D, Kd = static_cast<double>(mc.num_kv_heads) * D;
  const double qrows = Q * (mc.attn_output_gate ? 2 : 1);
  const double g = mc.attn_output_gate ? 1 : 0, n = mc.qk_norm ? 1 : 0;
  const double E = static_cast<double>(mc.num_experts), El = mc.num_experts > 0 ? E / static_cast<double>(L.ep) : 0;
  const double Kt = static_cast<double>(mc.top_k), F = static_cast<double>(mc.moe_intermediate_size);
  const double Ssh = static_cast<double>(mc.shared_expert_intermediate_size), I = static_cast<double>(mc.intermediate_size);
  const double N = T * Kt, M = N;  // routed rows sent and (balanced) received
  const double Hk = static_cast<double>(mc.linear_num_key_heads), Hv = static_cast<double>(mc.linear_num_value_heads);
  const double CK = Hk * static_cast<double>(mc.linear_key_head_dim), Z = Hv * static_cast<double>(mc.linear_value_head_dim);
  const double Cc = 2 * CK + Z;
  const double V = static_cast<double>(mc.vocab_size);
  const RecomputePolicy policy = cfg.prim.recompute.value;
  const bool full = policy == RecomputePolicy::full;
  const double cp = static_cast<double>(L.cp);

  // A GEMM call: its time and FLOPs into a pass's category.
  auto gemm = [&](Pass& p, double flops, double Pass::*cat) {
    p.*cat += pr.gemm(flops);
    p.flops += flops;
  };
  // Forward GEMM of `flops` in the forward (and recompute), dgrad + wgrad of as many in the backward.
  auto linear = [&](LayerTime& lt, double flops, double Pass::*cat) {
    gemm(lt.fwd, flops, cat);
    gemm(lt.rec, flops, cat);
    gemm(lt.bwd, flops, cat);
    gemm(lt.bwd, flops, cat);
  };
  // Elementwise bytes of the forward; the backward reads the saved input and the incoming gradient
  // and writes the gradient: twice the forward's bytes.
  auto elem = [&](LayerTime& lt, double fwd_bytes) {
    lt.fwd.elem += pr.bytes(fwd_bytes);
    lt.rec.elem += pr.bytes(fwd_bytes);
    lt.bwd.elem += pr.bytes(2 * fwd_bytes);
  };

  std::vector<LayerTime> layers(static_cast<size_t>(mc.num_layers));
  for (int64_t l = 0; l < mc.num_layers; ++l) {
    LayerTime& lt = layers[static_cast<size_t>(l)];
    lt.gdn = mc.layer_type(l) == LayerType::linear_attention;
    lt.moe = mc.is_moe_layer(l);
    // Two RMSNorms and two residual adds; the backward's f32 residual-stream gradient (read and
    // written by each block).
    elem(lt, 4 * a * T * H + 6 * a * T * H);
    lt.bwd.elem += pr.bytes(16 * T * H);
    if (lt.gdn) {
      linear(lt, 2 * T * H * Cc, &Pass::dense);       // in_proj_qkv
      linear(lt, 2 * T * H * Z, &Pass::dense);        // in_proj_z
      linear(lt, 2 * T * H * 2 * Hv, &Pass::dense);   // in_proj_b, in_proj_a
      linear(lt, 2 * T * Z * H, &Pass::dense);        // out_proj
      // The conv (read + write the channels), the q / k L2 norms, the gates, the gated norm.
      elem(lt, 2 * a * T * Cc + 4 * a * T * CK + 16 * T * Hv + 3 * a * T * Z);
      // The rule: every token of the sequence on the heads this rank holds (gdn_cp heads: the
      // whole sequence on Hv / cp heads; states: its T tokens on all heads): T Hv token-heads.
      const double x = T * cp;
      const double f = T * Hv * cal.gdn_fwd_ns.at(x) * 1e-9, b = T * Hv * cal.gdn_bwd_ns.at(x) * 1e-9;
      const double fl = 6.0 * static_cast<double>(mc.linear_key_head_dim) * static_cast<double>(mc.linear_value_head_dim) * Hv * T;
      lt.fwd.gdn += f, lt.rec.gdn += f, lt.bwd.gdn += b;
      lt.fwd.flops += fl, lt.rec.flops += fl, lt.bwd.flops += 2 * fl;
    } else {
      linear(lt, 2 * T * H * qrows, &Pass::dense);  // q (and its gate)
      linear(lt, 2 * T * H * Kd, &Pass::dense);     // k
      linear(lt, 2 * T * H * Kd, &Pass::dense);     // v
      linear(lt, 2 * T * Q * H, &Pass::dense);      // o
      // qk-norm and RoPE on q and k, the output gate.
      elem(lt, 2 * a * T * (Q + Kd) * (1 + n) + 3 * a * T * Q * g);
      // The causal core: this rank's share of the sequence's query-key pairs (cp ranks split them
      // evenly), at the rate of its T tokens.
      const double fl = 4.0 * (seq * seq / 2) * Hq * D / cp;
      const auto [afwd, abwd] = cal.attention_curves(D);
      lt.attn_fwd = fl / (afwd->at(T) * 1e12);
      lt.attn_bwd = 2.5 * fl / (abwd->at(T) * 1e12);
      lt.fwd.attn += lt.attn_fwd, lt.rec.attn += lt.attn_fwd, lt.bwd.attn += lt.attn_bwd;
      lt.fwd.flops += fl, lt.rec.flops += fl, lt.bwd.flops += 2 * fl;
    }
    if (lt.moe) {
      linear(lt, 2 * T * H * E, &Pass::dense);  // router
      // Expert GEMMs: fc1 (2F) and fc2, 6 M H F forward; the recompute skips fc2 (its output is
      // not read); dgrad + wgrad twice the forward. Rate by rows per expert.
      const double rate = cal.grouped_tflops.at(El > 0 ? M / El : M) * 1e12;
      const double f1 = 4 * M * H * F, f2 = 2 * M * H * F;
      lt.expert_fwd = (f1 + f2) / rate;
      lt.expert_rec = full ? f1 / rate : 0;
      lt.expert_bwd = 2 * (f1 + f2) / rate;
      lt.fwd.expert += lt.expert_fwd, lt.rec.expert += lt.expert_rec, lt.bwd.expert += lt.expert_bwd;
      lt.fwd.flops += f1 + f2, lt.rec.flops += f1, lt.bwd.flops += 2 * (f1 + f2);
      // Router softmax / top-k over f32 logits, the permute (N rows gathered), the swiglu, the
      // unpermute and combine (the recompute skips it).
      elem(lt, 8 * T * E + 2 * a * N * H + 3 * a * M * F);
      lt.fwd.elem += pr.bytes(a * N * H + a * T * H);
      lt.bwd.elem += pr.bytes(2 * (a * N * H + a * T * H));
      if (Ssh > 0) {
        linear(lt, 2 * T * H * 2 * Ssh, &Pass::dense);
        linear(lt, 2 * T * Ssh * H, &Pass::dense);
        linear(lt, 2 * T * H, &Pass::dense);  // the shared expert's gate
        elem(lt, 3 * a * T * Ssh + 3 * a * T * H);
      }
    } else {
      linear(lt, 2 * T * H * 2 * I, &Pass::dense);
      linear(lt, 2 * T * I * H, &Pass::dense);
      elem(lt, 3 * a * T * I);
    }
    if (!full) lt.rec = Pass{}, lt.expert_rec = 0;
    // Selective recompute reruns parts of the forward; priced as none (a small share).
  }

  // The loss head: the final norm, logits, their gradient and both GEMM gradients (6 T V H), in
  // blocks of `rows` tokens; the logits block is written, read and overwritten by its gradient.
  Pass head;
  {
    const std::string& loss = cfg.prim.name_of("loss");
    const double rows = loss == "full_ce" ? T : std::min(T, cfg.prim.loss_chunks.fused_chunk_tokens > 0
                                                                 ? static_cast<double>(cfg.prim.loss_chunks.fused_chunk_tokens)
                                                                 : 2048.0);
    const double blocks = std::ceil(T / std::max(1.0, rows));
    const double per_call = 2 * rows * V * H;
    head.head += 3 * blocks * pr.gemm(per_call);
    head.flops += 6 * T * V * H;
    const double lb = cfg.prim.loss_chunks.bf16_logits ? 2 : 4;
    head.head += pr.bytes(3 * T * V * lb);
    head.elem += pr.bytes(3 * 2 * a * T * H);  // the final norm forward and backward
  }
  // The embedding: rows gathered forward, scattered into its f32 gradient backward.
  const double embed = pr.bytes(2 * a * T * H + 8 * T * H);

  // Per micro-batch, the compute stream.
  Pass all;
  for (const LayerTime& lt : layers) {
    all += lt.fwd;
    all += lt.rec;
    all += lt.bwd;
  }
  all += head;
  all.elem += embed;

  // Communication the schedule does not hide (skills/planner.md "Overlaps").
  const CommEstimate& ce = mem.comm;
  te.wire_s = ce.total_s();
  const size_t nl = layers.size();
  auto lg = [&](size_t i) { return i < ce.layer_gather_s.size() ? ce.layer_gather_s[i] : 0.0; };
  auto lr = [&](size_t i) { return i < ce.layer_reduce_s.size() ? ce.layer_reduce_s[i] : 0.0; };
  const StateKind kind = cfg.prim.state.value;
  double gather_mb = 0, reduce_last = 0, ep_mb = 0, cp_mb = 0;
  if (kind == StateKind::fsdp) {
    // Forward: the ends' units first (exposed), layer l's gather prefetched during layer l - 1's
    // forward. Backward: layer l's gather (before its recompute) during layer l + 1's recompute
    // and backward; the top layer's during the head.
    gather_mb += lg(nl);
    for (size_t l = 0; l < nl; ++l) gather_mb += std::max(0.0, lg(l) - (l > 0 ? layers[l - 1].fwd.total() : 0.0));
    for (size_t l = 0; l < nl; ++l) {
      const double cover = l + 1 < nl ? layers[l + 1].rec.total() + layers[l + 1].bwd.total() : head.total();
      gather_mb += std::max(0.0, lg(l) - cover);
    }
  }
  // Reductions: layer l's during layer l - 1's recompute and backward; layer 0's and the ends'
  // after the embedding's backward (exposed). fsdp per micro-batch (fsdp_reduce = "micro_batch"),
  // else once, in the last micro-batch.
  for (size_t l = 1; l < nl; ++l) reduce_last += std::max(0.0, lr(l) - (layers[l - 1].rec.total() + layers[l - 1].bwd.total()));
  reduce_last += (nl > 0 ? lr(0) : 0.0) + lr(nl);
  const bool reduce_each = kind == StateKind::fsdp && cfg.backend.fsdp_reduce != "step";
  // EP: each MoE layer's dispatch and combine around its experts, chunked or not.
  const std::string& disp = cfg.prim.moe_dispatch.name;
  const int64_t C = disp.rfind("chunked_alltoall", 0) == 0 ? std::max<int64_t>(1, cfg.prim.moe_dispatch.count) : 1;
  if (ce.ep_one_s > 0) {
    const double w = ce.ep_one_s;
    for (const LayerTime& lt : layers) {
      if (!lt.moe) continue;
      ep_mb += chunk_pipeline_s(w, lt.expert_fwd, w, C) - lt.expert_fwd;
      if (full) ep_mb += chunk_pipeline_s(w, lt.expert_rec, 0, C) - lt.expert_rec;
      ep_mb += chunk_pipeline_s(w, lt.expert_bwd, w, C) - lt.expert_bwd;
    }
  }
  // CP: the ring's cp - 1 shifts, each beside one of the cp blocks of the attention core; the
  // Gated DeltaNet exchanges (not overlapped).
  if (L.cp > 1) {
    for (const LayerTime& lt : layers) {
      if (lt.gdn) {
        cp_mb += (full ? 3 : 2) * ce.gdn_pass_s;
      } else {
        const double hide_f = lt.attn_fwd / cp, hide_b = lt.attn_bwd / cp;
        cp_mb += (full ? 2 : 1) * (cp - 1) * std::max(0.0, ce.cp_shift_s - hide_f);
        cp_mb += (cp - 1) * std::max(0.0, ce.cp_shift_bwd_s - hide_b);
      }
    }
  }

  te.dense_gemm = A * all.dense;
  te.expert_gemm = A * all.expert;
  te.attention = A * all.attn;
  te.gdn = A * all.gdn;
  te.head = A * all.head;
  te.elementwise = A * all.elem;
  te.flops_counted = A * all.flops;
  te.exposed_gather = A * gather_mb;
  te.exposed_reduce = reduce_each ? A * reduce_last : reduce_last;
  te.exposed_ep = A * ep_mb;
  te.exposed_cp = A * cp_mb;
  if (kind == StateKind::zero1)  // the updated shards gathered after the update
    for (size_t i = 0; i <= nl; ++i) te.exposed_gather += lg(i);

  // The optimizer: the update's bytes (adamw_update_bytes), the gradient norm reading the
  // gradients once more (grad_clip > 0), and the next step zeroing them.
  {
    const double owned = static_cast<double>(mem.persistent[MemCategory::grads]) / 4.0;
    const double per = adamw_update_bytes(cfg.prim.optimizer.value, a == 2 ? DType::bf16 : DType::f32,
                                          cfg.backend.master_storage) +
                       (cfg.grad_clip > 0 ? 4 : 0) + 4;
    const double update = owned * per / (cal.copy_gbps * 1e9);
    // In the backward (optimizer_in_backward, no clipping, units held whole): each layer's update
    // runs on the copy stream once its backward is done; the step waits for what is left after the
    // embedding's backward (the lowest layer's and the embedding's, and any backlog).
    const bool early = cfg.backend.optimizer_in_backward && cfg.grad_clip == 0 &&
                       (kind == StateKind::replicated || mem.world == 1);
    if (offloads_optimizer(cfg.prim.optimizer.value)) {
      // The host updates (runtime/optimizer_offload.h). The device keeps the norm's read and the
      // zeroing; the gradients' copies to the host run beside the backward (not priced: a PCIe
      // link carries 4 bytes an element in far less than a backward at these sizes). Units go
      // in forward order, embedding, layers, head, each updated on the host (E / rate) and its
      // bf16 values copied back (2 E / link); the next forward takes layer k once the host is
      // through it and the device through layer k - 1. Exposed: the largest lead of the host
      // over the device along that order. With the update during the backward (no clipping) the
      // host starts as the backward ends instead: the layers it has done by then are lost to the
      // forward's lead, which this takes as none (an upper bound).
      const double E = static_cast<double>(mem.host_optimizer) / static_cast<double>(kOffloadHostBytesPerElement);
      const double geps = cal.host_adamw_geps > 0 ? cal.host_adamw_geps : 1.0;
      const double link = cal.pcie_gbps > 0 ? cal.pcie_gbps : 25.0;
      auto unit_s = [&](double elems) { return elems / (geps * 1e9) + 2 * elems / (link * 1e9); };
      const double ends = 2.0 * V * H;
      const double per_layer = std::max(0.0, E - ends) / std::max<double>(1.0, static_cast<double>(nl));
      double host = unit_s(ends / 2), dev = embed, lead = host;  // the embedding
      for (size_t i = 0; i < nl; ++i) {
        host += unit_s(per_layer);
        lead = std::max(lead, host - dev);
        dev += layers[i].fwd.total();
      }
      host += unit_s(ends / 2);  // the head
      lead = std::max(lead, host - dev);
      te.optimizer = owned * ((cfg.grad_clip > 0 ? 4 : 0) + 4) / (cal.copy_gbps * 1e9) + std::max(0.0, lead);
    } else if (!early) {
      te.optimizer = update;
    } else {
      const double per_elem = update / std::max(1.0, owned);
      // Elements per layer: the model's units laid out by the estimator are not kept; split the
      // layers' share evenly and give the ends (embedding, head) theirs.
      const double ends = 2.0 * V * H;  // embedding + head (tied: counted once more, a small excess)
      const double per_layer = std::max(0.0, owned - ends) / std::max<double>(1.0, static_cast<double>(nl));
      double t = head.total();  // time since the last micro-batch's backward began: the head first
      double stream_end = t + (ends / 2) * per_elem;  // the head's update after the head's backward
      for (size_t i = nl; i-- > 0;) {
        t += layers[i].rec.total() + layers[i].bwd.total();
        stream_end = std::max(stream_end, t) + per_layer * per_elem;
      }
      t += embed;
      stream_end = std::max(stream_end, t) + (ends / 2) * per_elem;
      te.optimizer = std::max(0.0, stream_end - t);
    }
  }

  te.step_s = te.dense_gemm + te.expert_gemm + te.attention + te.gdn + te.head + te.elementwise + te.optimizer +
              te.exposed_gather + te.exposed_reduce + te.exposed_ep + te.exposed_cp;
  te.tokens = static_cast<int64_t>(A * T);
  te.model_flops = model_flops(mc, {cfg.micro_batch_tokens}) * A / cp;

  te.assumptions.push_back("one sequence of micro_batch_tokens per micro-batch (attention's quadratic term)");
  if (mc.num_experts > 0) te.assumptions.push_back("balanced routing: every expert gets T x top_k / experts rows on each rank");
  if (policy == RecomputePolicy::selective) te.assumptions.push_back("selective recompute priced as none (the rerun parts are not counted)");
  if (ce.ep_one_s > 0 && C > 1)
    te.assumptions.push_back("chunked all-to-all: the expert GEMMs run at full speed beside the wire (a collective "
                             "that shares the SMs slows them; measured in bench/results/2026-12-05-h200-emulated.md)");
  if (te.wire_s > 0) te.assumptions.push_back("wire times from the [emulate] link model: " + cfg.emulate.link.str());
  bool attn_exact = true;
  (void)cal.attention_curves(mc.head_dim, &attn_exact);
  if (cal.attn_head_dim > 0 && mc.num_layers > mc.num_linear_attention_layers() && !attn_exact)
    te.assumptions.push_back("attention priced at the calibrated head dim " + std::to_string(cal.attn_head_dim) +
                             "; this model's is " + std::to_string(mc.head_dim) +
                             " (no curve for it in the calibration; on an H100 cuDNN's backward ran head dim 256 at "
                             "0.70-0.79 of the rate of 128: skills/planner.md)");
  return te;
}

std::string TimeEstimate::table() const {
  std::ostringstream o;
  char buf[256];
  auto row = [&](const char* name, double s) {
    std::snprintf(buf, sizeof buf, "| %s | %.2f | %.1f %% |\n", name, s * 1e3, step_s > 0 ? 100 * s / step_s : 0.0);
    o << buf;
  };
  o << "| PREDICTED step time | ms | % |\n|---|---:|---:|\n";
  row("dense GEMMs", dense_gemm);
  row("expert GEMMs", expert_gemm);
  row("attention", attention);
  row("Gated DeltaNet", gdn);
  row("loss head", head);
  row("elementwise", elementwise);
  row("optimizer (exposed)", optimizer);
  row("parameter gathers (exposed)", exposed_gather);
  row("gradient reductions (exposed)", exposed_reduce);
  row("EP all-to-alls (exposed)", exposed_ep);
  row("CP exchanges (exposed)", exposed_cp);
  std::snprintf(buf, sizeof buf, "| **step** | **%.2f** | %lld tokens, %.0f tokens/s/GPU, %.1f model TFLOP/s/GPU |\n",
                step_s * 1e3, static_cast<long long>(tokens), tokens_per_s(), tflops());
  o << buf;
  return o.str();
}

nlohmann::json TimeEstimate::json() const {
  nlohmann::json j;
  j["step_s"] = step_s;
  j["tokens"] = tokens;
  j["tokens_per_s_per_gpu"] = tokens_per_s();
  j["model_tflops_per_gpu"] = tflops();
  j["seconds"] = {{"dense_gemm", dense_gemm},         {"expert_gemm", expert_gemm},   {"attention", attention},
                  {"gdn", gdn},                       {"head", head},                 {"elementwise", elementwise},
                  {"optimizer", optimizer},           {"exposed_gather", exposed_gather},
                  {"exposed_reduce", exposed_reduce}, {"exposed_ep", exposed_ep},     {"exposed_cp", exposed_cp}};
  j["wire_s"] = wire_s;
  j["assumptions"] = assumptions;
  return j;
}

}  // namespace bb::plan
