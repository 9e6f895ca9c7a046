#include "runtime/run_config.h"

#include "comm/comm.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <toml.hpp>

#include "core/error.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/gemm.h"
#include "backend/cuda/runtime.h"
#include "primitives/attention/attention_cudnn.h"
#endif

namespace bb {

namespace {

// Reads keys out of one TOML table, remembering which were used so the rest can be reported.
class TableReader {
 public:
  TableReader(const toml::value* table, std::string name, std::string source)
      : t_(table), name_(std::move(name)), source_(std::move(source)) {}

  const toml::value* get(const std::string& key) {
    used_.insert(key);
    if (!t_) return nullptr;
    const auto& tab = t_->as_table();
    auto it = tab.find(key);
    return it == tab.end() ? nullptr : &it->second;
  }
  std::string where(const std::string& key) const { return name_ + "." + key + " (in " + source_ + ")"; }
  bool has(const std::string& key) const { return t_ && t_->as_table().count(key) > 0; }

  void read(const std::string& key, std::string& out) {
    if (auto* v = get(key)) {
      BB_CHECK(v->is_string(), where(key), " must be a string");
      out = v->as_string().str;
    }
  }
  void read(const std::string& key, int64_t& out) {
    if (auto* v = get(key)) {
      BB_CHECK(v->is_integer(), where(key), " must be an integer");
      out = v->as_integer();
    }
  }
  void read(const std::string& key, uint64_t& out) {
    int64_t x = static_cast<int64_t>(out);
    read(key, x);
    BB_CHECK(x >= 0, where(key), " must be >= 0, got ", x);
    out = static_cast<uint64_t>(x);
  }
  // Every float key of a run config is a finite quantity: inf and nan are refused here.
  void read(const std::string& key, double& out) {
    if (auto* v = get(key)) {
      BB_CHECK(v->is_floating() || v->is_integer(), where(key), " must be a number");
      out = v->is_floating() ? v->as_floating() : static_cast<double>(v->as_integer());
      BB_CHECK(std::isfinite(out), where(key), " must be a finite number, got ", out);
    }
  }
  // An integer that must lie in [lo, hi]; outside is an error, never a clamp.
  void read(const std::string& key, int64_t& out, int64_t lo, int64_t hi) {
    read(key, out);
    BB_CHECK(out >= lo && out <= hi, where(key), " = ", out, " is outside [", lo, ", ", hi, "]");
  }
  void read(const std::string& key, bool& out) {
    if (auto* v = get(key)) {
      BB_CHECK(v->is_boolean(), where(key), " must be true or false");
      out = v->as_boolean();
    }
  }
  // An integer in [lo, hi], or the string "auto" (is_auto set, out unchanged).
  void read_or_auto(const std::string& key, int64_t& out, bool& is_auto, int64_t lo, int64_t hi) {
    if (auto* v = get(key)) {
      if (v->is_string()) {
        BB_CHECK(v->as_string().str == "auto", where(key), " must be an integer or \"auto\", got \"",
                 v->as_string().str, "\"");
        is_auto = true;
        return;
      }
      used_.erase(key);
      read(key, out, lo, hi);
    }
  }
  void read_choice(const std::string& key, std::string& out, const std::vector<std::string>& allowed) {
    read(key, out);
    for (const auto& a : allowed)
      if (a == out) return;
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
    BB_FAIL(where(key), " = '", out, "' is not one of: ", list);
  }
  void finish() const {
    if (!t_) return;
    for (const auto& [k, v] : t_->as_table())
      BB_CHECK(used_.count(k), "unknown key '", name_, ".", k, "' in ", source_,
               " (see docs/config.md for the valid keys)");
  }

 private:
  const toml::value* t_;
  std::string name_, source_;
  std::set<std::string> used_;
};

// toml11 parses arrays and inline tables recursively: a crafted file nested deep enough would
// overflow the stack. No run config nests more than a few levels, so deeper input is refused
// before parsing. Strings and comments are skipped (their brackets do not nest).
constexpr int kMaxTomlDepth = 32;

void check_toml_nesting(const std::string& text, const std::string& source) {
  int depth = 0, max_depth = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '#') {
      while (i < text.size() && text[i] != '\n') ++i;
    } else if (c == '"' || c == '\'') {
      const bool multi = text.compare(i, 3, std::string(3, c)) == 0;
      const size_t close_len = multi ? 3 : 1;
      i += close_len;
      while (i < text.size()) {
        if (c == '"' && text[i] == '\\') {
          i += 2;
          continue;
        }
        if (text.compare(i, close_len, std::string(close_len, c)) == 0) break;
        if (!multi && text[i] == '\n') break;  // an unterminated string: the parser reports it
        ++i;
      }
      i += close_len - 1;
    } else if (c == '[' || c == '{') {
      max_depth = std::max(max_depth, ++depth);
      BB_CHECK(max_depth <= kMaxTomlDepth, "cannot parse ", source, " as TOML: arrays or inline tables nested deeper than ",
               kMaxTomlDepth, " levels");
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
}

// TOML is UTF-8; toml11 (3.7) reads out of bounds on the error path of a string holding invalid
// UTF-8, so such text is refused before it reaches the parser. Returns the offset of the first
// bad byte, or npos.
size_t invalid_utf8_at(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > s.size()) return i;
    uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
    for (size_t k = 1; k < len; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d >> 6) != 0x2) return i;
      cp = (cp << 6) | (d & 0x3F);
    }
    // Overlong forms, surrogates and code points past U+10FFFF are not UTF-8 either.
    const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[len] || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return i;
    i += len;
  }
  return std::string::npos;
}

void check_utf8(const std::string& text, const std::string& source) {
  const size_t at = invalid_utf8_at(text);
  BB_CHECK(at == std::string::npos, "cannot parse ", source, " as TOML: invalid UTF-8 at byte ", at,
           " (TOML files are UTF-8 text)");
}

toml::value parse_toml_text(const std::string& text, const std::string& source) {
  check_utf8(text, source);
  check_toml_nesting(text, source);
  std::istringstream in(text);
  try {
    return toml::parse(in, source);
  } catch (const std::exception& e) {
    BB_FAIL("cannot parse ", source, " as TOML: ", e.what());
  }
}

// "train.steps=100" -> root["train"]["steps"] = 100. A value that is not valid TOML is a string
// when it is a bare word; one with quotes or brackets that does not parse (an unbalanced quote
// left by the shell) is an error, not a string holding the quote.
void apply_override(toml::value& root, const std::string& ov) {
  const auto eq = ov.find('=');
  BB_CHECK(eq != std::string::npos && eq > 0, "bad override '", ov,
           "': expected table.key=value, e.g. train.steps=100");
  const std::string key = ov.substr(0, eq), text = ov.substr(eq + 1);
  const auto dot = key.find('.');
  BB_CHECK(dot != std::string::npos && dot > 0 && dot + 1 < key.size() &&
               key.find('.', dot + 1) == std::string::npos,
           "bad override key '", key, "': expected table.key, e.g. train.steps");
  const std::string table = key.substr(0, dot), name = key.substr(dot + 1);
  toml::value value;
  check_utf8(text, "--set " + key);
  check_toml_nesting(text, "--set " + key);
  try {
    std::istringstream in("v = " + text);
    value = toml::find(toml::parse(in, "--set"), "v");
  } catch (const std::exception&) {
    BB_CHECK(text.find_first_of("\"'[]{}") == std::string::npos, "--set ", key, "=", text,
             ": not a TOML value (an unbalanced quote or bracket?); write strings in quotes, e.g. --set '", key,
             "=\"value\"'");
    value = toml::value(text);  // bare word: a string
  }
  if (!root.is_table()) root = toml::table{};
  auto& tab = root.as_table();
  if (!tab.count(table)) tab[table] = toml::table{};
  BB_CHECK(tab[table].is_table(), "override '", ov, "': '", table, "' is not a table");
  tab[table].as_table()[name] = value;
}

const toml::value* table_of(const toml::value& root, const std::string& name, const std::string& src) {
  const auto& tab = root.as_table();
  auto it = tab.find(name);
  if (it == tab.end()) return nullptr;
  BB_CHECK(it->second.is_table(), "'", name, "' in ", src, " must be a table ([", name, "])");
  return &it->second;
}

RunConfig build(toml::value root, const std::string& src) {
  // parallel = "auto" (a string instead of the table): every layout degree from the planner.
  bool all_auto = false;
  if (root.is_table() && root.as_table().count("parallel") && root.as_table().at("parallel").is_string()) {
    const std::string v = root.as_table().at("parallel").as_string().str;
    BB_CHECK(v == "auto", "'parallel' in ", src, " must be a table ([parallel]) or \"auto\", got \"", v, "\"");
    all_auto = true;
    root.as_table().erase("parallel");
  }
  static const std::set<std::string> kTables = {"model", "primitives", "policy", "parallel", "emulate", "train",
                                                "data", "checkpoint", "log", "backend"};
  for (const auto& [k, v] : root.as_table())
    BB_CHECK(kTables.count(k), "unknown table '[", k, "]' in ", src,
             ": expected model, primitives, policy, parallel, emulate, train, data, checkpoint, log, backend");
  RunConfig c;

  TableReader m(table_of(root, "model", src), "model", src);
  m.read("config", c.model_config);
  m.read("init", c.model_init);
  const bool hf_init = c.model_init.rfind("hf:", 0) == 0 && c.model_init.size() > 3;
  BB_CHECK(c.model_init == "random" || hf_init,
           "model.init = '", c.model_init, "' in ", src,
           " is not one of: random, hf:DIR (a Hugging Face checkpoint directory)");
  m.read_choice("dtype", c.model_dtype, {"auto", "f32", "bf16"});
  m.finish();
  BB_CHECK(!c.model_config.empty(), "model.config is required in ", src,
           ": the path of a Hugging Face config.json, e.g. configs/models/demo-tiny/config.json");
  c.model = load_hf_config(c.model_config);

  TableReader p(table_of(root, "primitives", src), "primitives", src);
  PrimitiveSet& pc = c.prim;
  for (const std::string& family : PrimitiveSet::keys()) {
    std::string name = pc.name_of(family);
    p.read(family, name);
    pc.set(family, name, src);
  }
  constexpr int64_t kMaxChunk = (int64_t{1} << 31) - 1;
  p.read("loss_chunk_tokens", pc.loss_chunks.chunk_tokens, 1, kMaxChunk);
  p.read("loss_chunk_vocab", pc.loss_chunks.chunk_vocab, 1, kMaxChunk);
  // "auto" (the default) keeps linear_ce's 2048 rows and lets the policy head size its block by
  // the call's tokens (policy_chunk_rows); an integer sets both.
  bool chunk_auto = false;
  int64_t fused_rows = 0;
  p.read_or_auto("loss_fused_chunk_tokens", fused_rows, chunk_auto, 1, kMaxChunk);
  if (fused_rows > 0) pc.loss_chunks.fused_chunk_tokens = pc.loss_chunks.policy.chunk_tokens = fused_rows;
  // The policy head's block order (policy_config.h PolicyBlocks).
  const PolicyBlocks pb = pc.loss_chunks.policy.blocks;
  std::string blocks = pb == PolicyBlocks::rows ? "rows" : pb == PolicyBlocks::vocab ? "vocab" : "auto";
  p.read_choice("policy_blocks", blocks, {"auto", "rows", "vocab"});
  pc.loss_chunks.policy.blocks = blocks == "rows"    ? PolicyBlocks::rows
                                 : blocks == "vocab" ? PolicyBlocks::vocab
                                                     : PolicyBlocks::auto_;
  std::string logits = pc.loss_chunks.bf16_logits ? "bf16" : "f32";
  p.read("loss_logits", logits);
  BB_CHECK(logits == "f32" || logits == "bf16", "primitives.loss_logits must be \"f32\" or \"bf16\" in ", src,
           ", got \"", logits, "\"");
  pc.loss_chunks.bf16_logits = logits == "bf16";
  p.read("router_replay", pc.router_replay);
  p.finish();

  // [policy]: the objective of primitives.loss = "policy" (primitives/loss/policy.h); read and
  // checked whatever the loss, so one file can switch losses with that one key.
  TableReader po(table_of(root, "policy", src), "policy", src);
  PolicyLossConfig& pl = pc.loss_chunks.policy;
  po.read("temperature", pl.temperature);
  po.read("clip_low", pl.clip_low);
  po.read("clip_high", pl.clip_high);
  po.read("dual_clip", pl.dual_clip);
  std::string ratio = pl.ratio == PolicyRatio::token ? "token" : "sequence";
  po.read_choice("ratio", ratio, {"token", "sequence"});
  pl.ratio = ratio == "token" ? PolicyRatio::token : PolicyRatio::sequence;
  std::string agg = "token_mean";
  po.read_choice("aggregation", agg, {"token_mean", "seq_mean_token_sum", "seq_mean_token_mean"});
  pl.aggregation = agg == "token_mean"           ? PolicyAggregation::token_mean
                   : agg == "seq_mean_token_sum" ? PolicyAggregation::seq_mean_token_sum
                                                 : PolicyAggregation::seq_mean_token_mean;
  std::string kl = pl.kl == KlEstimator::k1 ? "k1" : "k3";
  po.read_choice("kl", kl, {"k1", "k3"});
  pl.kl = kl == "k1" ? KlEstimator::k1 : KlEstimator::k3;
  po.read("kl_coef", pl.kl_coef);
  po.read("entropy_coef", pl.entropy_coef);
  po.read("max_log_ratio", pl.max_log_ratio);
  po.finish();
  pc.validate(src);

  TableReader par(table_of(root, "parallel", src), "parallel", src);
  par.read("device", c.device);
  constexpr int64_t kMaxRanks = 1 << 20;
  par.read("tp", c.tp, 1, kMaxRanks);
  par.read("pp", c.pp, 1, kMaxRanks);
  std::string layout = all_auto ? "auto" : "manual";
  par.read_choice("layout", layout, {"manual", "auto"});
  par.read_or_auto("ep", c.ep, c.auto_ep, 1, kMaxRanks);
  par.read_or_auto("cp", c.cp, c.auto_cp, 1, kMaxRanks);
  par.read_or_auto("dp", c.dp, c.auto_dp, 0, kMaxRanks);
  // layout = "auto": the degrees the table does not fix come from the planner.
  if (layout == "auto") {
    c.auto_ep = c.auto_ep || !par.has("ep");
    c.auto_cp = c.auto_cp || !par.has("cp");
    c.auto_dp = c.auto_dp || !par.has("dp");
  }
  par.read_choice("comm", c.comm, {"auto", "mpi", "nccl", "emulated"});
  par.read("timeout_s", c.comm_timeout_s);
  par.finish();
  Device::parse(c.device == "auto" ? "cpu" : c.device);  // validates the spelling
  BB_CHECK(c.tp == 1, "parallel.tp = ", c.tp, " in ", src,
           ": tensor parallelism is not implemented (the recipe uses ep + cp + fsdp); set tp = 1");
  BB_CHECK(c.dp >= 0 && c.cp >= 1 && c.ep >= 1 && c.pp >= 1, "parallel.dp must be >= 0 (0 = ranks / (cp x pp)) and ",
           "parallel.cp, ep, pp >= 1 in ", src);
  BB_CHECK(std::isfinite(c.comm_timeout_s) && c.comm_timeout_s > 0 && c.comm_timeout_s <= 86400,
           "parallel.timeout_s = ", c.comm_timeout_s, " in ", src, ": must be in (0, 86400] seconds");

  // [emulate] configures parallel.comm = "emulated" (and is ignored otherwise, so that one file
  // can switch between a real and an emulated run with that one key).
  TableReader em(table_of(root, "emulate", src), "emulate", src);
  comm::EmulateConfig& e = c.emulate;
  em.read("ranks", e.ranks, 1, 65536);
  em.read("rank", e.rank, 0, 65535);
  em.read("gpus_per_node", e.link.gpus_per_node, 1, 1024);
  em.read("intra_gbps", e.link.intra_gbps);
  em.read("inter_gbps", e.link.inter_gbps);
  em.read("intra_latency_us", e.link.intra_latency_us);
  em.read("inter_latency_us", e.link.inter_latency_us);
  em.read("comm_blocks", e.comm_blocks, 1, 1024);
  em.read("wire_scale", e.wire_scale);
  em.read("device_memory_gib", e.device_memory_gib);
  em.read("hang_at_op", e.hang_at_op, 0, int64_t{1} << 40);
  em.finish();
  if (c.comm == "emulated") e.validate();

  TableReader t(table_of(root, "train", src), "train", src);
  // Bounds: step counts fit every counter and file name; a micro-batch's offsets are int32
  // (cu_seqlens), so it holds fewer than 2^31 tokens.
  constexpr int64_t kMaxSteps = 1'000'000'000'000;
  t.read("steps", c.steps, 0, kMaxSteps);
  t.read("micro_batch_tokens", c.micro_batch_tokens, 1, (int64_t{1} << 31) - 1);
  t.read("grad_accum", c.grad_accum, 1, 1'000'000);
  t.read("lr", c.lr);
  t.read("min_lr", c.min_lr);
  t.read("warmup_steps", c.warmup_steps, 0, kMaxSteps);
  t.read("weight_decay", c.weight_decay);
  t.read("beta1", c.beta1);
  t.read("beta2", c.beta2);
  t.read("adam_eps", c.adam_eps);
  t.read("grad_clip", c.grad_clip);
  t.read("aux_loss_coef", c.aux_loss_coef);
  t.read("z_loss_coef", c.z_loss_coef);
  t.read("seed", c.seed);
  t.read_choice("on_nonfinite", c.on_nonfinite, {"abort", "skip_step"});
  t.read("loss_spike_factor", c.loss_spike_factor);
  t.read_choice("memory_check", c.memory_check, {"refuse", "warn"});
  t.finish();
  BB_CHECK(c.loss_spike_factor == 0 || c.loss_spike_factor > 1, "train.loss_spike_factor must be 0 (off) or > 1, got ",
           c.loss_spike_factor);
  BB_CHECK(c.steps >= 0, "train.steps must be >= 0, got ", c.steps);
  BB_CHECK(c.micro_batch_tokens > 0, "train.micro_batch_tokens must be positive, got ", c.micro_batch_tokens);
  BB_CHECK(c.grad_accum >= 1, "train.grad_accum must be >= 1, got ", c.grad_accum);
  BB_CHECK(c.lr > 0 && c.min_lr >= 0 && c.min_lr <= c.lr, "train.lr must be > 0 and 0 <= train.min_lr <= train.lr, got lr=", c.lr, " min_lr=", c.min_lr);
  BB_CHECK(c.warmup_steps >= 0, "train.warmup_steps must be >= 0");
  BB_CHECK(c.beta1 >= 0 && c.beta1 < 1 && c.beta2 >= 0 && c.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)");
  BB_CHECK(c.adam_eps > 0, "train.adam_eps must be positive");
  BB_CHECK(c.weight_decay >= 0, "train.weight_decay must be >= 0");
  BB_CHECK(c.grad_clip >= 0, "train.grad_clip must be >= 0 (0 = off)");
  BB_CHECK(c.z_loss_coef >= 0, "train.z_loss_coef must be >= 0");

  TableReader d(table_of(root, "data", src), "data", src);
  d.read("path", c.data.path);
  d.read_choice("format", c.data.format, {"auto", "flat", "jsonl", "demo"});
  d.read("shuffle", c.data.shuffle);
  d.read("demo_documents", c.data.demo_documents, 1, 100'000'000);
  d.read("max_line_bytes", c.data.max_line_bytes, 1, int64_t{1} << 40);
  // auto: whole documents for the policy loss (a split rollout would be scored without its
  // prompt), split otherwise.
  std::string packing = "auto";
  d.read_choice("packing", packing, {"auto", "split", "whole"});
  c.data.packing = packing != "auto" ? packing : c.prim.name_of("loss") == "policy" ? "whole" : "split";
  int64_t eos = c.model.eos_token_id >= 0 ? c.model.eos_token_id : c.data.eos_id;
  d.read("eos_id", eos, 0, (int64_t{1} << 31) - 1);
  d.finish();
  c.data.eos_id = static_cast<int32_t>(eos);
  c.data.vocab_size = c.model.vocab_size;
  c.data.tokens_per_micro_batch = c.micro_batch_tokens;
  c.data.seed = c.seed;
  BB_CHECK(eos >= 0 && eos < c.model.vocab_size, "data.eos_id = ", eos, " is outside the model vocabulary [0, ", c.model.vocab_size, ")");

  TableReader ck(table_of(root, "checkpoint", src), "checkpoint", src);
  ck.read("dir", c.ckpt_dir);
  ck.read("every", c.ckpt_every, 0, kMaxSteps);
  ck.read("save_final", c.ckpt_save_final);
  ck.read("keep", c.ckpt_keep, 0, 1'000'000);
  ck.read("async", c.ckpt_async);
  ck.read("resume", c.resume);
  ck.finish();
  BB_CHECK(c.ckpt_every >= 0 && c.ckpt_keep >= 0, "checkpoint.every and checkpoint.keep must be >= 0");
  // "auto" without a checkpoint root has nothing to continue from: a fresh run (so that
  // `--set checkpoint.dir=""` turns checkpoints off for a config that resumes by default).
  if (c.resume == "auto" && c.ckpt_dir.empty()) c.resume.clear();
  if (c.comm == "emulated") {
    // An emulated rank's weights are not a real job's (its peers are copies of it): nothing it
    // trains is worth keeping, and one rank's shard could not be resumed by any job.
    BB_CHECK(c.ckpt_dir.empty(), "parallel.comm = \"emulated\" in ", src, " times and sizes one rank of a job; it does ",
             "not write checkpoints (checkpoint.dir = '", c.ckpt_dir, "'): set checkpoint.dir = \"\"");
    BB_CHECK(c.resume.empty(), "parallel.comm = \"emulated\" in ", src, " does not resume checkpoints (checkpoint.resume = '",
             c.resume, "'): set checkpoint.resume = \"\"");
  }

  TableReader l(table_of(root, "log", src), "log", src);
  l.read("every", c.log_every, 1, kMaxSteps);
  l.read("metrics", c.metrics_path);
  l.read("all_ranks", c.log_all_ranks);
  l.finish();
  BB_CHECK(c.log_every >= 1, "log.every must be >= 1");

  TableReader be(table_of(root, "backend", src), "backend", src);
  BackendConfig& b = c.backend;
  be.read("grouped_gemm_same_dtype", b.grouped_gemm_same_dtype);
  be.read("grouped_gemm_widening", b.grouped_gemm_widening);
  be.read("grouped_gemm_streams", b.grouped_gemm_streams);
  be.read("grouped_gemm_multi_stream_min_flops", b.grouped_gemm_multi_stream_min_flops);
  be.read("grouped_gemm_threaded_enqueue", b.grouped_gemm_threaded_enqueue);
  be.read("grouped_gemm_tma", b.grouped_gemm_tma);
  be.read("gemm_heuristics", b.gemm_heuristics);
  be.read("optimizer_in_backward", b.optimizer_in_backward);
  be.read("master_storage", b.master_storage);
  be.read("max_layers_ahead", b.max_layers_ahead, 0, 1000);
  be.read("expert_wgrad_stream", b.expert_wgrad_stream);
  be.read("grad_reduce_dtype", b.grad_reduce_dtype);
  be.read("fsdp_reduce", b.fsdp_reduce);
  be.read("pool_cross_stream_reuse", b.pool_cross_stream_reuse);
  be.read("moe_chunk_tokens", b.moe_chunk_tokens, 0, (int64_t{1} << 31) - 1);
  be.read("offload_threads", b.offload_threads, 0, 1024);
  be.read("cudnn_library", b.cudnn_library);
  be.finish();
  b.validate(src);
  return c;
}

}  // namespace

Device RunConfig::resolved_device() const {
  // Under a launcher, "cuda" and "auto" mean the GPU of this process's local rank (several
  // processes share GPUs round-robin when there are more of them than GPUs).
  [[maybe_unused]] const int local = comm::world().local_rank;
  if (device == "auto") {
#ifdef BB_WITH_CUDA
    if (cuda::device_count() > 0) return Device::cuda(local % cuda::device_count());
#endif
    return Device::cpu();
  }
  Device d = Device::parse(device);
#ifdef BB_WITH_CUDA
  if (d.is_cuda() && device == "cuda" && cuda::device_count() > 0) d.index = local % cuda::device_count();
#endif
#ifndef BB_WITH_CUDA
  BB_CHECK(d.is_cpu(), "parallel.device = '", device,
           "' but this build has no CUDA backend (rebuild with -DBUMBLEBEE_CUDA=ON on a machine with the CUDA toolkit)");
#else
  if (d.is_cuda())
    BB_CHECK(d.index < cuda::device_count(), "parallel.device = '", device, "' but ", cuda::device_count(),
             " CUDA device(s) are visible (", cuda::unavailable_reason(), ")");
#endif
  return d;
}

DType RunConfig::resolved_param_dtype() const {
  if (model_dtype == "auto") return resolved_device().is_cuda() ? DType::bf16 : DType::f32;
  return dtype_from_name(model_dtype);
}

void apply_backend_config(const BackendConfig& c) {
  c.validate("");
#ifdef BB_WITH_CUDA
  cuda::GroupedDefaults d;
  d.same_dtype = c.grouped_gemm_same_dtype == "multi_stream" ? cuda::GroupedAlgo::multi_stream
                 : c.grouped_gemm_same_dtype == "mma"        ? cuda::GroupedAlgo::mma
                                                             : cuda::GroupedAlgo::cublas;
  d.widening = c.grouped_gemm_widening == "wmma"  ? cuda::GroupedAlgo::wmma
               : c.grouped_gemm_widening == "mma" ? cuda::GroupedAlgo::mma
                                                  : cuda::GroupedAlgo::multi_stream;
  d.num_streams = static_cast<int>(c.grouped_gemm_streams);
  d.multi_stream_min_flops = c.grouped_gemm_multi_stream_min_flops;
  d.threaded_enqueue = c.grouped_gemm_threaded_enqueue;
  d.tma = c.grouped_gemm_tma;
  cuda::set_grouped_defaults(d);
  cuda::set_exact_heuristics(c.gemm_heuristics == "exact");
  set_cudnn_library(c.cudnn_library);
  cuda::set_pool_cross_stream_reuse(c.pool_cross_stream_reuse);
#endif
}

RunConfig parse_run_config(const std::string& text, const std::string& source,
                           const std::vector<std::string>& overrides) {
  toml::value root = parse_toml_text(text, source);
  if (!root.is_table()) root = toml::table{};
  for (const auto& ov : overrides) apply_override(root, ov);
  // Errors name where a value came from: the file, or the file as changed on the command line.
  std::string src = source;
  if (!overrides.empty()) {
    src += " with overrides";
    for (const auto& ov : overrides) src += " '" + ov + "'";
  }
  return build(root, src);
}

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  BB_CHECK(in.good(), "cannot open run config '", path, "' (try configs/demo.toml)");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_run_config(ss.str(), path, overrides);
}

}  // namespace bb
