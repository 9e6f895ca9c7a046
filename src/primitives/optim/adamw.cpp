// adamw.cpp — boundary checks for AdamW and gradient norms, then plain CPU loops or the CUDA
// kernels (adamw_cuda.h) depending on where the tensors live.
#include "primitives/optim/adamw.h"

#include "core/trace.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/util.h"
#include "primitives/optim/adamw_cuda.h"
#include "primitives/optim/moment_rounding.h"
#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

namespace bb {

namespace {
[[maybe_unused]] void require_cuda_build(const char* op, const Tensor& t) {
#ifndef BB_WITH_CUDA
  BB_FAIL(op, ": not implemented on ", t.device().str(), " in this build (no CUDA backend)");
#endif
}

void check_cuda_float(const Tensor& t, const char* op, const char* arg) {
  BB_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, op, ": argument '", arg,
           "' has dtype ", dtype_name(t.dtype()), ", the CUDA path takes f32 or bf16");
}

#ifdef BB_WITH_CUDA
// Per-tensor sums of squares of CUDA tensors (all on one device), read back with ONE
// device-to-host copy at the end: a deliberate sync, counted by cuda::memcpy through
// cuda::note_host_sync(). Partials live in i64 tensors used as 8-byte doubles (there is no
// f64 dtype).
// Enqueues the sums on the current stream: out[i] = sum of squares of ts[i] (device doubles).
void enqueue_sums_of_squares(const std::vector<const Tensor*>& ts, double* out) {
  int64_t total = 0;
  for (const Tensor* t : ts) total += cuda::sum_squares_max_slots(t->numel());
  Tensor partial = Tensor::empty({total}, DType::i64, ts.front()->device(), MemCategory::workspace);
  auto* pp = reinterpret_cast<double*>(partial.data<int64_t>());
  for (size_t i = 0; i < ts.size(); ++i) {
    const int64_t slots = cuda::sum_squares_partial(pp, ts[i]->raw(), ts[i]->dtype(), ts[i]->numel());
    cuda::sum_squares_finish(out + i, pp, slots);
    pp += cuda::sum_squares_max_slots(ts[i]->numel());
  }
}

std::vector<double> device_sums_of_squares(const std::vector<const Tensor*>& ts) {
  const Device dev = ts.front()->device();
  const auto k = static_cast<int64_t>(ts.size());
  Tensor out = Tensor::empty({k}, DType::i64, dev, MemCategory::workspace);
  enqueue_sums_of_squares(ts, reinterpret_cast<double*>(out.data<int64_t>()));
  std::vector<double> sums(static_cast<size_t>(k));
  cuda::memcpy(sums.data(), Device::cpu(), out.raw(), dev, sums.size() * sizeof(double));
  return sums;
}
#endif
}  // namespace

namespace {
// The per-call scalars, computed once on the host for the CPU loops and the kernels alike.
struct Scalars {
  float step_size, inv_sqrt_bc2, decay, b1, b2, eps, gs;
  bool bf16_moments;
  bool split;  // an i16 master: the split master (adamw.h)
};

Scalars check_adamw(const char* op, const Tensor& master, const Tensor& grad, const Tensor& exp_avg,
                    const Tensor& exp_avg_sq, int64_t step, double lr, double weight_decay, const AdamWConfig& cfg,
                    const Tensor* model, const Tensor* nonfinite) {
  BB_CHECK(master.dtype() == DType::f32 || master.dtype() == DType::i16, op, ": argument 'master' has dtype ",
           dtype_name(master.dtype()), ", expected f32 (an fp32 master) or i16 (a split master's remainder)");
  const bool split = master.dtype() == DType::i16;
  BB_CHECK(!split || (model && model->dtype() == DType::bf16), op,
           ": a split master (i16 remainder) needs the bf16 model tensor that holds its upper half; got ",
           model ? dtype_name(model->dtype()) : "no model tensor");
  check_dtype(grad, DType::f32, op, "grad");
  BB_CHECK(exp_avg.dtype() == DType::f32 || exp_avg.dtype() == DType::bf16, op,
           ": argument 'exp_avg' has dtype ", dtype_name(exp_avg.dtype()),
           ", expected f32 (adamw) or bf16 (adamw_bf16_moments)");
  BB_CHECK(exp_avg_sq.dtype() == exp_avg.dtype(), op, ": exp_avg is ", dtype_name(exp_avg.dtype()),
           " but exp_avg_sq is ", dtype_name(exp_avg_sq.dtype()), "; both moments have one dtype");
  const bool bf16_moments = exp_avg.dtype() == DType::bf16;
  BB_CHECK(cfg.first_element >= 0, op, ": first_element must be >= 0, got ", cfg.first_element);
  const int64_t n = master.numel();
  BB_CHECK(grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n, op,
           ": sizes differ: master ", n, ", grad ", grad.numel(), ", exp_avg ", exp_avg.numel(),
           ", exp_avg_sq ", exp_avg_sq.numel());
  BB_CHECK(step >= 1, op, ": step is 1-based, got ", step);
  BB_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1 && cfg.beta2 >= 0 && cfg.beta2 < 1, op,
           ": betas must be in [0, 1), got ", cfg.beta1, ", ", cfg.beta2);
  for (const Tensor* t : {&grad, static_cast<const Tensor*>(&exp_avg),
                          static_cast<const Tensor*>(&exp_avg_sq)})
    check_same_device(master, *t, op);
  if (model) {
    check_float(*model, op, "model");
    BB_CHECK(model->numel() == n, op, ": model has ", model->numel(), " elements, master ", n);
    check_same_device(master, *model, op);
  }
  if (nonfinite) {
    check_dtype(*nonfinite, DType::i32, op, "nonfinite");
    BB_CHECK(nonfinite->numel() == 1, op, ": nonfinite must be one i32 flag, got ", nonfinite->numel(), " elements");
    check_same_device(master, *nonfinite, op);
  }
  const double bc1 = 1.0 - std::pow(cfg.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(cfg.beta2, static_cast<double>(step));
  const float step_size = static_cast<float>(lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float decay = static_cast<float>(1.0 - lr * weight_decay);
  const float b1 = static_cast<float>(cfg.beta1), b2 = static_cast<float>(cfg.beta2);
  const float eps = static_cast<float>(cfg.eps);
  const float gs = static_cast<float>(cfg.grad_scale);
  BB_CHECK(std::isfinite(gs) && gs >= 0, op, ": grad_scale must be finite and >= 0, got ", gs);
  if (master.device().is_cuda()) {
    require_cuda_build(op, master);
    if (model) check_cuda_float(*model, op, "model");
  }
  return {step_size, inv_sqrt_bc2, decay, b1, b2, eps, gs, bf16_moments, split};
}

#ifdef BB_WITH_CUDA
cuda::AdamWScalars cuda_scalars(const Scalars& sc, const AdamWConfig& cfg) {
  cuda::AdamWScalars s{sc.step_size, sc.inv_sqrt_bc2, sc.decay, sc.b1, sc.b2, sc.eps, sc.gs, cfg.yield_sms};
  s.split_master = sc.split;
  return s;
}
#endif

// The three host tensors of a split or join: f32 master, bf16 value, i16 remainder, one size.
int64_t check_split_tensors(const char* op, const Tensor& master, const Tensor& value, const Tensor& lo) {
  check_dtype(master, DType::f32, op, "master");
  check_dtype(value, DType::bf16, op, "value");
  check_dtype(lo, DType::i16, op, "lo");
  BB_CHECK(master.device().is_cpu() && value.device().is_cpu() && lo.device().is_cpu(), op, ": host tensors only");
  const int64_t n = master.numel();
  BB_CHECK(value.numel() == n && lo.numel() == n, op, ": sizes differ: master ", n, ", value ", value.numel(), ", lo ",
           lo.numel());
  return n;
}
}  // namespace

void split_master(const Tensor& master, Tensor& value, Tensor& lo) {
  const int64_t n = check_split_tensors("split_master", master, value, lo);
  const float* p = master.data<float>();
  uint16_t* hi = value.data<uint16_t>();
  int16_t* l = lo.data<int16_t>();
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, p + i, 4);
    hi[i] = split_master_hi(b);
    l[i] = split_master_lo(b, hi[i]);
  }
}

void join_master(const Tensor& value, const Tensor& lo, Tensor& master) {
  const int64_t n = check_split_tensors("join_master", master, value, lo);
  float* p = master.data<float>();
  const uint16_t* hi = value.data<uint16_t>();
  const int16_t* l = lo.data<int16_t>();
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = split_master_bits(hi[i], l[i]);
    std::memcpy(p + i, &b, 4);
  }
}

void adamw_step(Tensor& master, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                int64_t step, double lr, double weight_decay, const AdamWConfig& cfg,
                Tensor* model, Tensor* nonfinite) {
  BB_RANGE("adamw_step");
  const Scalars sc = check_adamw("adamw_step", master, grad, exp_avg, exp_avg_sq, step, lr, weight_decay, cfg,
                                 model, nonfinite);
  const auto [step_size, inv_sqrt_bc2, decay, b1, b2, eps, gs, bf16_moments, split] = sc;
  const int64_t n = master.numel();
  if (master.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    const cuda::AdamWScalars s = cuda_scalars(sc, cfg);
    if (bf16_moments)
      cuda::adamw_step_bf16_moments(master.raw(), grad.data<float>(), exp_avg.data<uint16_t>(),
                                    exp_avg_sq.data<uint16_t>(), model ? model->raw() : nullptr,
                                    model ? model->dtype() : DType::f32, n, s,
                                    moment_rounding_key(cfg.seed, cfg.stream, step), cfg.first_element,
                                    nonfinite ? nonfinite->data<int32_t>() : nullptr);
    else
      cuda::adamw_step(master.raw(), grad.data<float>(), exp_avg.data<float>(),
                       exp_avg_sq.data<float>(), model ? model->raw() : nullptr,
                       model ? model->dtype() : DType::f32, n, s,
                       nonfinite ? nonfinite->data<int32_t>() : nullptr);
#endif
    return;
  }
  if (split) {
    // The CPU reference of the split master: join, the fp32-master update, split.
    Tensor full = Tensor::empty({n}, DType::f32, Device::cpu(), MemCategory::other);
    join_master(*model, master, full);
    adamw_step(full, grad, exp_avg, exp_avg_sq, step, lr, weight_decay, cfg, nullptr, nonfinite);
    split_master(full, *model, master);
    return;
  }
  if (bf16_moments) {
    // The same loop in fp32 on moments loaded from bf16; the new m and v move the weights, then
    // are stored stochastically rounded. One Philox block serves four consecutive elements.
    float* p = master.data<float>();
    const float* g = grad.data<float>();
    uint16_t* m16 = exp_avg.data<uint16_t>();
    uint16_t* v16 = exp_avg_sq.data<uint16_t>();
    const uint64_t key = moment_rounding_key(cfg.seed, cfg.stream, step);
    const auto e0 = static_cast<uint64_t>(cfg.first_element);
    Philox4 block{};
    uint64_t block_at = ~uint64_t{0};
    bool bad = false;
    for (int64_t i = 0; i < n; ++i) {
      const float gi = gs * g[i];
      p[i] *= decay;
      const float mi = b1 * bf16_to_f32(m16[i]) + (1.0f - b1) * gi;
      const float vi = b2 * bf16_to_f32(v16[i]) + (1.0f - b2) * gi * gi;
      p[i] -= step_size * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
      const uint64_t e = e0 + static_cast<uint64_t>(i);
      if (e >> 2 != block_at) {
        block_at = e >> 2;
        block = philox4x32_10(key, block_at);
      }
      const uint32_t w = block.v[e & 3];
      m16[i] = f32_to_bf16_stochastic(mi, w);
      v16[i] = f32_to_bf16_stochastic(vi, w >> 16);
      bad |= !std::isfinite(p[i]) || bf16_bits_nonfinite(m16[i]) || bf16_bits_nonfinite(v16[i]);
    }
    if (nonfinite && bad) nonfinite->data<int32_t>()[0] = 1;
    if (model) cpu::store_f32(*model, master);
    return;
  }
  const bool bad = adamw_update_f32_host(master.data<float>(), grad.data<float>(), exp_avg.data<float>(),
                                         exp_avg_sq.data<float>(), n,
                                         AdamWScalars{step_size, inv_sqrt_bc2, decay, b1, b2, eps, gs});
  if (nonfinite && bad) nonfinite->data<int32_t>()[0] = 1;
  if (model) cpu::store_f32(*model, master);
}

AdamWScalars adamw_scalars(int64_t step, double lr, double weight_decay, const AdamWConfig& cfg) {
  BB_CHECK(step >= 1, "adamw_scalars: step is 1-based, got ", step);
  const double bc1 = 1.0 - std::pow(cfg.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(cfg.beta2, static_cast<double>(step));
  return {static_cast<float>(lr / bc1),        static_cast<float>(1.0 / std::sqrt(bc2)),
          static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(cfg.beta1),
          static_cast<float>(cfg.beta2),       static_cast<float>(cfg.eps),
          static_cast<float>(cfg.grad_scale)};
}

// Compiled without FP contraction and math errno (CMakeLists.txt): the compiler vectorises the
// loop (sqrt and division are correctly rounded in every width), and the bits are those of the
// scalar loop whatever width runs.
bool adamw_update_f32_host(float* __restrict p, const float* __restrict g, float* __restrict m,
                           float* __restrict v, int64_t n, const AdamWScalars& s) {
  const float step_size = s.step_size, inv_sqrt_bc2 = s.inv_sqrt_bc2, decay = s.decay, b1 = s.b1, b2 = s.b2,
              eps = s.eps, gs = s.gs;
  int bad = 0;  // x - x is 0 for a finite x and NaN for Inf or NaN: an or-reduction the compiler vectorises
  for (int64_t i = 0; i < n; ++i) {
    const float gi = gs * g[i];  // gs == 1 leaves g exact
    const float mi = b1 * m[i] + (1.0f - b1) * gi;
    const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    const float pi = p[i] * decay - step_size * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    bad |= static_cast<int>(pi - pi != 0.0f) | static_cast<int>(mi - mi != 0.0f) | static_cast<int>(vi - vi != 0.0f);
  }
  return bad != 0;
}

void host_values_from_master(const float* p, void* dst, DType dst_dtype, int64_t n, bool ties_away) {
  if (dst_dtype == DType::f32) {
    std::memcpy(dst, p, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  BB_CHECK(dst_dtype == DType::bf16, "host_values_from_master: values are f32 or bf16, not ", dtype_name(dst_dtype));
  auto* out = static_cast<uint16_t*>(dst);
  if (ties_away) {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t b;
      std::memcpy(&b, p + i, 4);
      out[i] = split_master_hi(b);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(p[i]);
  }
}

void adamw_step_sum_squares(Tensor& master, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                            int64_t step, double lr, double weight_decay, int64_t decay_numel,
                            const AdamWConfig& cfg, Tensor* model, Tensor* nonfinite, Tensor& slots,
                            int64_t slot) {
  const char* op = "adamw_step_sum_squares";
  const int64_t n = master.numel();
  // The update's own checks (sizes, dtypes, devices, betas) and scalars, whichever path runs.
  [[maybe_unused]] const Scalars sc =
      check_adamw(op, master, grad, exp_avg, exp_avg_sq, step, lr, weight_decay, cfg, model, nonfinite);
  BB_CHECK(decay_numel >= 0 && decay_numel <= n, op, ": decay_numel ", decay_numel, " is outside [0, ", n, "]");
  check_dtype(slots, DType::i64, op, "slots");
  BB_CHECK(slot >= 0 && slot < slots.numel(), op, ": slot ", slot, " is outside the ", slots.numel(), " slots");
  check_same_device(master, slots, op);
#ifdef BB_WITH_CUDA
  if (master.device().is_cuda()) {
    BB_RANGE("adamw_step");
    cuda::AdamWScalars s = cuda_scalars(sc, cfg);
    s.decay_end = decay_numel;
    Tensor partial = Tensor::empty({cuda::sum_squares_max_slots(n)}, DType::i64, master.device(),
                                   MemCategory::workspace);
    auto* pp = reinterpret_cast<double*>(partial.data<int64_t>());
    const int64_t k = cuda::adamw_step_sum_squares(
        master.raw(), grad.data<float>(), exp_avg.raw(), exp_avg_sq.raw(), sc.bf16_moments,
        model ? model->raw() : nullptr, model ? model->dtype() : DType::f32, n, s,
        moment_rounding_key(cfg.seed, cfg.stream, step), cfg.first_element,
        nonfinite ? nonfinite->data<int32_t>() : nullptr, pp);
    if (k >= 0) {
      cuda::sum_squares_finish(reinterpret_cast<double*>(slots.data<int64_t>()) + slot, pp, k);
      return;
    }
  }
#endif
  // Two passes (the CPU; unaligned tensors): the sum, then the update of each decay bucket.
  sum_of_squares_to(grad, slots, slot);
  const int64_t cuts[3] = {0, decay_numel, n};
  for (int b = 0; b < 2; ++b) {
    const int64_t len = cuts[b + 1] - cuts[b];
    if (len == 0) continue;
    Tensor p = master.narrow(cuts[b], len), m = exp_avg.narrow(cuts[b], len),
           v = exp_avg_sq.narrow(cuts[b], len), mv;
    if (model) mv = model->narrow(cuts[b], len);
    AdamWConfig c = cfg;
    c.first_element = cfg.first_element + cuts[b];
    adamw_step(p, grad.narrow(cuts[b], len), m, v, step, lr, b == 0 ? weight_decay : 0.0, c,
               model ? &mv : nullptr, nonfinite);
  }
}

namespace {
// The row list of a row-wise call: row_len > 0, every row in [0, ceil(n / row_len)), strictly
// increasing. `rows_of` and `why` finish the messages for the caller ("the unit's ", an update's
// reason for no repeats).
void check_row_list(const char* op, const std::vector<int32_t>& rows, int64_t n, int64_t row_len,
                    const char* rows_of, const char* why) {
  BB_CHECK(row_len > 0, op, ": row_len must be > 0, got ", row_len);
  const int64_t num_rows = (n + row_len - 1) / row_len;
  for (size_t i = 0; i < rows.size(); ++i) {
    BB_CHECK(rows[i] >= 0 && rows[i] < num_rows, op, ": row ", rows[i], " (entry ", i, ") is outside ", rows_of,
             num_rows, " rows of ", row_len, " elements");
    BB_CHECK(i == 0 || rows[i] > rows[i - 1], op, ": rows must be strictly increasing", why, "; entry ", i, " is ",
             rows[i], " after ", rows[i - 1]);
  }
}
}  // namespace

void adamw_step_rows(Tensor& master, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, int64_t step,
                     double lr, double weight_decay, int64_t decay_numel, const AdamWConfig& cfg, Tensor* model,
                     Tensor* nonfinite, const std::vector<int32_t>& rows, int64_t row_len) {
  const char* op = "adamw_step_rows";
  const int64_t n = master.numel();
  [[maybe_unused]] const Scalars sc =
      check_adamw(op, master, grad, exp_avg, exp_avg_sq, step, lr, weight_decay, cfg, model, nonfinite);
  BB_CHECK(decay_numel >= 0 && decay_numel <= n, op, ": decay_numel ", decay_numel, " is outside [0, ", n, "]");
  check_row_list(op, rows, n, row_len, "the unit's ", " (an element updated twice would take two steps)");
  if (rows.empty()) return;
  if (master.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    BB_RANGE("adamw_step");
    cuda::AdamWScalars s = cuda_scalars(sc, cfg);
    s.decay_end = decay_numel;
    const auto k = static_cast<int64_t>(rows.size());
    Tensor list = Tensor::empty({k}, DType::i32, master.device(), MemCategory::workspace);
    cuda::memcpy(list.raw(), master.device(), rows.data(), Device::cpu(), rows.size() * sizeof(int32_t));
    cuda::adamw_step_rows(master.raw(), grad.data<float>(), exp_avg.raw(), exp_avg_sq.raw(), sc.bf16_moments,
                          model ? model->raw() : nullptr, model ? model->dtype() : DType::f32, n,
                          list.data<int32_t>(), k, row_len, s, moment_rounding_key(cfg.seed, cfg.stream, step),
                          cfg.first_element, nonfinite ? nonfinite->data<int32_t>() : nullptr);
#endif
    return;
  }
  // The CPU: adamw_step over each run of consecutive rows, cut at decay_numel.
  for (size_t i = 0; i < rows.size();) {
    size_t j = i + 1;
    while (j < rows.size() && rows[j] == rows[j - 1] + 1) ++j;
    const int64_t a = rows[i] * row_len, b = std::min(n, (static_cast<int64_t>(rows[j - 1]) + 1) * row_len);
    const int64_t cuts[3] = {a, std::clamp(decay_numel, a, b), b};
    for (int k = 0; k < 2; ++k) {
      const int64_t len = cuts[k + 1] - cuts[k];
      if (len == 0) continue;
      Tensor p = master.narrow(cuts[k], len), m = exp_avg.narrow(cuts[k], len), v = exp_avg_sq.narrow(cuts[k], len),
             mv;
      if (model) mv = model->narrow(cuts[k], len);
      AdamWConfig c = cfg;
      c.first_element = cfg.first_element + cuts[k];
      adamw_step(p, grad.narrow(cuts[k], len), m, v, step, lr, cuts[k] < decay_numel ? weight_decay : 0.0, c,
                 model ? &mv : nullptr, nonfinite);
    }
    i = j;
  }
}

void mark_nonfinite(const std::vector<Tensor>& ts, Tensor& flags) {
  const char* op = "mark_nonfinite";
  check_dtype(flags, DType::i32, op, "flags");
  BB_CHECK(flags.numel() == static_cast<int64_t>(ts.size()), op, ": ", ts.size(), " tensors but ", flags.numel(),
           " flags");
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    if (t.numel() == 0) continue;
    check_float(t, op, "ts[i]");
    check_same_device(flags, t, op);
    if (t.device().is_cuda()) {
      require_cuda_build(op, t);
      check_cuda_float(t, op, "ts[i]");
#ifdef BB_WITH_CUDA
      cuda::mark_nonfinite(flags.data<int32_t>() + i, t.raw(), t.dtype(), t.numel());
#endif
      continue;
    }
    const std::vector<float> v = t.dtype() == DType::f32 ? std::vector<float>() : t.to_floats();
    const float* p = t.dtype() == DType::f32 ? t.data<float>() : v.data();
    for (int64_t j = 0; j < t.numel(); ++j)
      if (!std::isfinite(p[j])) {
        flags.data<int32_t>()[i] = 1;
        break;
      }
  }
}

double sum_of_squares(const Tensor& g) {
  check_float(g, "sum_of_squares", "g");
  if (g.device().is_cuda()) {
    require_cuda_build("sum_of_squares", g);
    check_cuda_float(g, "sum_of_squares", "g");
#ifdef BB_WITH_CUDA
    return device_sums_of_squares({&g}).front();
#endif
  }
  std::vector<float> v;
  const float* p;
  Tensor gf;
  if (g.dtype() == DType::f32 && g.device().is_cpu()) {
    p = g.data<float>();
  } else {
    v = g.to_floats();
    p = v.data();
  }
  double s = 0;
  for (int64_t i = 0; i < g.numel(); ++i) s += static_cast<double>(p[i]) * p[i];
  return s;
}

void sum_of_squares_to(const Tensor& g, Tensor& slots, int64_t i) {
  check_float(g, "sum_of_squares_to", "g");
  check_dtype(slots, DType::i64, "sum_of_squares_to", "slots");
  BB_CHECK(i >= 0 && i < slots.numel(), "sum_of_squares_to: slot ", i, " is outside the ", slots.numel(),
           " slots");
  check_same_device(g, slots, "sum_of_squares_to");
  if (g.device().is_cuda()) {
    require_cuda_build("sum_of_squares_to", g);
    check_cuda_float(g, "sum_of_squares_to", "g");
#ifdef BB_WITH_CUDA
    enqueue_sums_of_squares({&g}, reinterpret_cast<double*>(slots.data<int64_t>()) + i);
    return;
#endif
  }
  const double s = sum_of_squares(g);
  std::memcpy(slots.data<int64_t>() + i, &s, sizeof(double));
}

void sum_of_squares_rows_to(const Tensor& g, Tensor& slots, int64_t i, const std::vector<int32_t>& rows,
                            int64_t row_len) {
  const char* op = "sum_of_squares_rows_to";
  const int64_t n = g.numel();
  check_row_list(op, rows, n, row_len, "the ", "");
  if (!g.device().is_cuda() || g.dtype() != DType::f32) {
    sum_of_squares_to(g, slots, i);
    return;
  }
  check_dtype(slots, DType::i64, op, "slots");
  BB_CHECK(i >= 0 && i < slots.numel(), op, ": slot ", i, " is outside the ", slots.numel(), " slots");
  check_same_device(g, slots, op);
#ifdef BB_WITH_CUDA
  const std::vector<int32_t> list =
      cuda::sum_squares_slices_of_rows(g.raw(), n, rows.data(), static_cast<int64_t>(rows.size()), row_len);
  const auto k = static_cast<int64_t>(list.size());
  Tensor dev_list = Tensor::empty({std::max<int64_t>(k, 1)}, DType::i32, g.device(), MemCategory::workspace);
  if (k > 0) cuda::memcpy(dev_list.raw(), g.device(), list.data(), Device::cpu(), list.size() * sizeof(int32_t));
  Tensor partial = Tensor::empty({cuda::sum_squares_max_slots(n)}, DType::i64, g.device(), MemCategory::workspace);
  auto* pp = reinterpret_cast<double*>(partial.data<int64_t>());
  const int64_t slices = cuda::sum_squares_partial_listed(pp, g.data<float>(), n, dev_list.data<int32_t>(), k);
  cuda::sum_squares_finish(reinterpret_cast<double*>(slots.data<int64_t>()) + i, pp, slices);
#endif
}

double global_grad_norm(const std::vector<Tensor>& grads) {
  BB_RANGE("global_grad_norm");
  double s = 0;
  std::vector<const Tensor*> on_device;
  for (const Tensor& g : grads) {
    check_float(g, "global_grad_norm", "grads[i]");
    if (g.device().is_cpu()) {
      s += sum_of_squares(g);
      continue;
    }
    require_cuda_build("global_grad_norm", g);
    check_cuda_float(g, "global_grad_norm", "grads[i]");
    if (!on_device.empty()) check_same_device(*on_device.front(), g, "global_grad_norm");
    on_device.push_back(&g);
  }
#ifdef BB_WITH_CUDA
  if (!on_device.empty())
    for (double d : device_sums_of_squares(on_device)) s += d;
#endif
  return std::sqrt(s);
}

void scale_inplace(Tensor& g, float s) {
  check_dtype(g, DType::f32, "scale_inplace", "g");
  if (g.device().is_cuda()) {
    require_cuda_build("scale_inplace", g);
#ifdef BB_WITH_CUDA
    cuda::scale_inplace(g.data<float>(), s, g.numel());
#endif
    return;
  }
  float* p = g.data<float>();
  for (int64_t i = 0; i < g.numel(); ++i) p[i] *= s;
}

}  // namespace bb
