// state.cpp — replicated / zero1 / fsdp state and the AdamW step on owned elements (state.h).
#include "runtime/state.h"

#include <unistd.h>

#include <algorithm>
#include <tuple>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/trace.h"
#include "primitives/elementwise/elementwise.h"
#include "primitives/optim/moment_rounding.h"

namespace bb {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// How a unit is held: a group of one shards nothing, whatever the family.
enum class Mode { whole, zero1, fsdp };

}  // namespace

struct ModelState::Unit {
  size_t index = 0;
  ParamUnit* u = nullptr;
  comm::Group* g = nullptr;
  Mode mode = Mode::whole;
  int64_t N = 1, r = 0, S = 0, lo = 0, len = 0;
  Tensor master, exp_avg, exp_avg_sq;  // [numel] (whole) or [S] (sharded), optimizer: master f32
                                       // (a split master: its i16 remainder, the upper half being
                                       // the owned values), moments in the optimizer's moment dtype
  bool split = false;                  // the master is split ([backend] master_storage)
  Tensor value_buf, grad_buf;          // zero1: [N S] values (params) and gradients (grads)
  Tensor value_shard, grad_shard;      // fsdp: [S] values (params) and gradients (grads)
  Tensor full_value, full_grad;        // fsdp: gathered values, whole gradient in backward (comm)
  comm::WorkPtr gather_work, reduce_work;
  // [S] (comm): a reduce-scatter's result until drained, in the reduction's dtype; a whole
  // unit's bf16 all-reduce buffer [n] (an f32 all-reduce works in place)
  Tensor reduce_out;
  // skip_step (optimizer): master [master size] in its dtype, both moments [2 x master size] in
  // theirs, and a split master's upper half (the owned values [master size]), as they were
  // before the step.
  Tensor backup_master, backup_moments, backup_hi;
  uint64_t stream = 0;  // bf16 moments: the rounding stream of the unit (a hash of its name)
  // adamw_offload: the host copy of the owned gradient [master size] (grads, on the host), the
  // unit's target in the offload (-1: none, nothing owned), and whether a zero1 unit owes the
  // all-gather of its values after an offloaded update.
  Tensor host_grad;
  int target = -1;
  bool gather_values = false;
};

DType moment_dtype(OptimizerKind opt) {
  switch (opt) {
    case OptimizerKind::adamw: return DType::f32;
    case OptimizerKind::adamw_bf16_moments: return DType::bf16;
    case OptimizerKind::adamw_offload: return DType::f32;
  }
  BB_FAIL("moment_dtype: unknown optimizer kind ", static_cast<int>(opt));
}

bool offloads_optimizer(OptimizerKind opt) { return opt == OptimizerKind::adamw_offload; }

int64_t offload_host_bytes(StateKind kind, const std::vector<ParamUnit*>& units,
                           const std::vector<int64_t>& group_sizes) {
  BB_CHECK(units.size() == group_sizes.size(), "offload_host_bytes: one group size per unit");
  int64_t elems = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    const bool whole = group_sizes[i] == 1 || kind == StateKind::replicated;
    elems += whole ? units[i]->numel : ceil_div(units[i]->numel, group_sizes[i]);
  }
  return kOffloadHostBytesPerElement * elems;
}

int64_t optimizer_bytes_per_element(OptimizerKind opt, bool split_master) {
  if (offloads_optimizer(opt)) return 0;
  return (split_master ? 2 : 4) + 2 * static_cast<int64_t>(dtype_size(moment_dtype(opt)));
}

bool splits_master(const std::string& master_storage, DType param_dtype) {
  return master_storage == "split" && param_dtype == DType::bf16;
}

StateBytes state_bytes(StateKind kind, const std::vector<ParamUnit*>& units,
                       const std::vector<int64_t>& group_sizes, int64_t value_bytes, OptimizerKind opt,
                       bool split_master) {
  BB_CHECK(units.size() == group_sizes.size(), "state_bytes: one group size per unit");
  StateBytes b;
  for (size_t i = 0; i < units.size(); ++i) {
    const int64_t n = units[i]->numel, N = group_sizes[i], S = ceil_div(n, N);
    // A unit whose values stay f32 (Qwen3.5's A_log, dt_bias) keeps a separate f32 master.
    const int64_t o = optimizer_bytes_per_element(opt, split_master && value_bytes == 2 && !units[i]->f32_values);
    const int64_t vb = units[i]->f32_values ? 4 : value_bytes;  // Qwen3.5's A_log, dt_bias stay f32
    switch (kind) {
      case StateKind::replicated:
        b.params += vb * n;
        b.grads += 4 * n;
        b.optimizer += o * n;
        break;
      case StateKind::zero1:
        b.params += vb * N * S;
        b.grads += 4 * N * S;
        b.optimizer += o * S;
        break;
      case StateKind::fsdp:
        b.params += vb * S;
        b.grads += 4 * S;
        b.optimizer += o * S;
        break;
    }
  }
  return b;
}

ModelState::~ModelState() {
  // Gradient memory freed after this is reused in the compute stream's order: make that order
  // pass the sums still reading it on the copy stream (no host wait; never throws on the CPU).
  try {
    join_early_norms();
  } catch (...) {
  }
}

namespace {
// The group holding unit u, and the elements [lo, lo + len) rank r of its N owns (S = ceil(n / N)
// each; the last ranks may own fewer, or none).
comm::GroupPtr unit_group(const ParamUnit& u, const Mesh& mesh) {
  return u.kind == UnitKind::experts ? mesh.edp() : mesh.dense();
}
std::pair<int64_t, int64_t> owned_range(int64_t n, int64_t N, int64_t r) {
  const int64_t lo = std::min(n, r * ceil_div(n, N));
  return {lo, std::max<int64_t>(0, std::min(ceil_div(n, N), n - lo))};
}
}  // namespace

std::pair<int64_t, int64_t> ModelState::start_range(StateKind kind, const ParamUnit& u, const Mesh& mesh) {
  const comm::GroupPtr group = unit_group(u, mesh);
  if (group->size() == 1 || kind != StateKind::fsdp) return {0, u.numel};
  return owned_range(u.numel, group->size(), group->rank());
}

ModelState::ModelState(StateKind kind, DecoderModel& model, const Mesh& mesh, const std::vector<Tensor>* masters,
                       OptimizerKind opt, uint64_t seed, bool split_master, OffloadOptions offload_options)
    : kind_(kind), opt_(opt), seed_(seed), model_(model), tied_(model.config().tie_word_embeddings) {
  const DType mdt = bb::moment_dtype(opt);
  // adamw_offload: the masters and moments live in host memory, always a whole f32 master (the
  // values are rounded from it as the run's master storage would round them).
  const bool offload = offloads_optimizer(opt);
  std::vector<ParamUnit*> units = model.units();
  if (offload) {
    // The host memory it takes, checked before any of it is allocated: master, moments and the
    // gradient's copy of every element of the masters.
    std::vector<int64_t> group_sizes;
    for (ParamUnit* pu : units) group_sizes.push_back(unit_group(*pu, mesh)->size());
    const int64_t need = offload_host_bytes(kind, units, group_sizes);
    const int64_t have = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE);
    BB_CHECK(have <= 0 || need <= have - have / 8, "primitives.optimizer = \"adamw_offload\" needs ",
             format_bytes(need), " of host memory on this rank (16 bytes per owned parameter: f32 master, two f32 "
             "moments, the gradient's copy), more than 7/8 of this machine's ", format_bytes(have),
             ". Shard the state over more ranks (primitives.state = \"zero1\" or \"fsdp\"), or use "
             "primitives.optimizer = \"adamw_bf16_moments\" on the device");
  }
  BB_CHECK(!masters || masters->size() == units.size(), "ModelState: ", masters ? masters->size() : 0,
           " master tensors for ", units.size(), " units");
  by_layer_.resize(model.layers().size());
  ParamStore& store = model.param_store();
  for (size_t i = 0; i < units.size(); ++i) {
    ParamUnit* pu = units[i];
    auto un = std::make_unique<Unit>();
    Unit& u = *un;
    u.index = i;
    u.u = pu;
    comm::GroupPtr group = unit_group(*pu, mesh);
    u.g = group.get();
    u.N = group->size();
    u.r = group->rank();
    u.S = ceil_div(pu->numel, u.N);
    std::tie(u.lo, u.len) = owned_range(pu->numel, u.N, u.r);
    u.mode = u.N == 1 || kind == StateKind::replicated ? Mode::whole
             : kind == StateKind::zero1                ? Mode::zero1
                                                       : Mode::fsdp;
    // A model built with defer_values has no buffers yet (a sharded start): each mode allocates
    // what this rank holds and initialises it (DecoderModel::init_unit_range, the values of a
    // whole start), so no rank ever holds a whole unit it does not keep.
    const bool deferred = !pu->value.defined();
    const Device dev = deferred ? store.device() : pu->value.device();
    const DType vdt = deferred ? store.value_dtype(*pu) : pu->value.dtype();
    u.split = !offload && split_master && vdt == DType::bf16;  // units whose values stay f32 keep an f32 master
    const Device odev = offload ? Device::cpu() : dev;  // where the optimizer state lives
    // The f32 source of the masters: the given masters, else the values. src_at(lo, len): its
    // elements [lo, lo + len) of the unit (the given masters start at start_range(): the shard
    // under fsdp, element 0 otherwise).
    const Tensor src = masters && (*masters)[i].defined() ? (*masters)[i] : Tensor();
    const bool shard = u.mode == Mode::fsdp;
    const int64_t src_lo = shard ? u.lo : 0;
    BB_CHECK(!src.defined() || src.numel() == (shard ? u.len : pu->numel), "ModelState: the given master of unit ",
             pu->name, " has ", src.defined() ? src.numel() : 0, " elements, expected ", shard ? u.len : pu->numel,
             " (its start range)");
    auto src_at = [&](int64_t lo, int64_t len) { return src.narrow(lo - src_lo, len); };
    // A deferred unit's values: from the given masters (rounded as a whole start's loader rounds
    // them), else the initialisation.
    auto fill_values = [&](int64_t lo, int64_t len, Tensor& dst) {
      if (!src.defined()) {
        model.init_unit_range(*pu, lo, len, dst);
      } else if (len > 0) {
        const Tensor m = src_at(lo, len);
        const Tensor v = m.dtype() == dst.dtype() ? m : m.to_dtype(dst.dtype(), MemCategory::other);
        dst.copy_from(v.device() == dst.device() ? v : v.to(dst.device()));
      }
    };
    // `vals`: the values of the owned elements [lo, lo + len).
    auto owned_f32 = [&](int64_t lo, int64_t len, const Tensor& vals) {
      Tensor m = Tensor::zeros({u.mode == Mode::whole ? pu->numel : u.S}, DType::f32, odev, MemCategory::optimizer);
      if (len > 0) {
        Tensor from = src.defined() ? src_at(lo, len) : vals.to_dtype(DType::f32, MemCategory::other);
        m.narrow(0, len).copy_from(from.device() == odev ? from : from.to(odev));
      }
      return m;
    };
    // A split master: a zero remainder is exact for values that are bf16 already; given
    // masters are split into the values (set_master) once the value buffers exist.
    auto owned_master = [&](int64_t lo, int64_t len, const Tensor& vals) {
      if (!u.split) return owned_f32(lo, len, vals);
      return Tensor::zeros({u.mode == Mode::whole ? pu->numel : u.S}, DType::i16, dev, MemCategory::optimizer);
    };
    switch (u.mode) {
      case Mode::whole:
        if (deferred) {
          Tensor value = Tensor::zeros({pu->numel}, vdt, dev, MemCategory::params);
          fill_values(0, pu->numel, value);
          store.rebind(*pu, value, Tensor::zeros({pu->numel}, DType::f32, dev, MemCategory::grads));
        }
        u.master = owned_master(0, pu->numel, pu->value);
        break;
      case Mode::zero1: {
        u.value_buf = Tensor::zeros({u.N * u.S}, vdt, dev, MemCategory::params);
        Tensor whole = u.value_buf.narrow(0, pu->numel);
        if (deferred) fill_values(0, pu->numel, whole);
        else whole.copy_from(pu->value);
        u.grad_buf = Tensor::zeros({u.N * u.S}, DType::f32, dev, MemCategory::grads);
        u.master = owned_master(u.lo, u.len, u.value_buf.narrow(u.lo, u.len));
        store.rebind(*pu, u.value_buf, u.grad_buf);
        break;
      }
      case Mode::fsdp: {
        u.value_shard = Tensor::zeros({u.S}, vdt, dev, MemCategory::params);
        Tensor mine = u.value_shard.narrow(0, u.len);
        if (deferred) fill_values(u.lo, u.len, mine);
        else if (u.len > 0) mine.copy_from(pu->value.narrow(u.lo, u.len));
        u.grad_shard = Tensor::zeros({u.S}, DType::f32, dev, MemCategory::grads);
        u.master = owned_master(u.lo, u.len, mine);
        store.rebind(*pu, Tensor(), Tensor());  // the whole buffers (if any) are freed here
        break;
      }
    }
    u.exp_avg = Tensor::zeros(u.master.shape(), mdt, odev, MemCategory::optimizer);
    u.exp_avg_sq = Tensor::zeros(u.master.shape(), mdt, odev, MemCategory::optimizer);
    if (offload) u.host_grad = Tensor::zeros(u.master.shape(), DType::f32, Device::cpu(), MemCategory::grads);
    u.stream = moment_stream_id(pu->name.data(), pu->name.size());
    if (u.split && src.defined() && u.len > 0)
      set_split_master(u, src_at(u.mode == Mode::whole ? 0 : u.lo, u.mode == Mode::whole ? pu->numel : u.len));
    if (pu->layer >= 0) by_layer_[static_cast<size_t>(pu->layer)].push_back(&u);
    else if (pu->kind == UnitKind::embedding) embed_ = &u;
    else head_ = &u;
    units_.push_back(std::move(un));
  }
  BB_CHECK(embed_ && head_, "ModelState: the model has no embedding or head unit");
  // Given masters split into the owned values: zero1 ranks hold every value, so they gather the
  // others' (a value rounded ties-away may differ from the one the caller loaded).
  if (split_master && masters && !offload) values_from_masters();
  if (offload) {
    build_offload(offload_options, split_master);
    // Given masters: the values are their rounding (a whole start loaded them rounded to nearest
    // even; the split storage's rule rounds ties away).
    if (masters && split_master) values_from_masters();
  }
}

void ModelState::build_offload(const OffloadOptions& o, bool split_master) {
  std::vector<OffloadTarget> targets;
  const int64_t layers = static_cast<int64_t>(by_layer_.size());
  for (auto& up : units_) {
    Unit& u = *up;
    const ParamUnit& pu = *u.u;
    const bool whole = u.mode == Mode::whole;
    const int64_t len = whole ? pu.numel : u.len, first = whole ? 0 : u.lo;
    if (len == 0) continue;
    OffloadTarget t;
    t.name = pu.name;
    t.master = u.master.data<float>();
    t.exp_avg = u.exp_avg.data<float>();
    t.exp_avg_sq = u.exp_avg_sq.data<float>();
    t.grad_host = u.host_grad.data<float>();
    switch (u.mode) {
      case Mode::whole:
        t.grad_dev = pu.grad.narrow(0, len);
        t.value_dev = pu.value.narrow(0, len);
        break;
      case Mode::zero1:
        t.grad_dev = u.grad_buf.narrow(first, len);
        t.value_dev = u.value_buf.narrow(first, len);
        break;
      case Mode::fsdp:
        t.grad_dev = u.grad_shard.narrow(0, len);
        t.value_dev = u.value_shard.narrow(0, len);
        break;
    }
    t.first = first;
    t.decay_end = pu.decay_numel;
    t.order = pu.layer >= 0 ? pu.layer : pu.kind == UnitKind::embedding ? -1 : layers;
    t.ties_away = split_master && t.value_dev.dtype() == DType::bf16;
    u.target = static_cast<int>(targets.size());
    targets.push_back(std::move(t));
  }
  const Device dev = model_.param_store().device();
  offload_ = std::make_unique<OptimizerOffload>(dev, std::move(targets), o.threads, o.bucket);
  offload_submitted_.assign(units_.size(), 0);
}

void ModelState::offload_submit(Unit& u) {
  if (!offload_ || u.target < 0 || offload_submitted_[u.index]) return;
  if (u.mode != Mode::fsdp) model_.param_store().materialize_grads(u.u);
  offload_->submit(static_cast<size_t>(u.target));
  offload_submitted_[u.index] = 1;
  if (u.mode == Mode::zero1) u.gather_values = true;
}

void ModelState::offload_ready(Unit& u) {
  if (!offload_) return;
  if (u.target >= 0) offload_->wait(static_cast<size_t>(u.target), {Stream::compute, Stream::gather});
  if (u.gather_values) {  // the other ranks' shards of a zero1 unit, as step() gathers them without offload
    u.gather_values = false;
    u.g->all_gather(u.value_buf.narrow(u.r * u.S, u.S), u.value_buf, Stream::gather)->wait();
  }
}

void ModelState::settle_updates(bool gathers) {
  if (!offload_) return;
  offload_->settle();
  if (gathers)
    for (auto& up : units_) offload_ready(*up);
}

std::optional<ModelState::OffloadNonfinite> ModelState::take_offload_nonfinite() {
  if (!offload_) return std::nullopt;
  const auto b = offload_->take_nonfinite();
  if (!b) return std::nullopt;
  for (auto& up : units_)
    if (up->target == static_cast<int>(b->target)) return OffloadNonfinite{up->index, b->step};
  return std::nullopt;
}

bool ModelState::sharded(const Unit& u) const { return u.mode == Mode::fsdp; }

// The values of the elements the unit's master holds ([master size]; a split master's upper half).
Tensor ModelState::owned_values(Unit& u) {
  switch (u.mode) {
    case Mode::whole: return u.u->value;
    case Mode::zero1: return u.value_buf.narrow(u.r * u.S, u.S);
    case Mode::fsdp: return u.value_shard;
  }
  BB_FAIL("owned_values: unknown mode");
}

// The f32 master of the owned elements [from, from + len): a view of an f32 master, or a split
// master's halves of those elements joined on the host.
Tensor ModelState::master_f32(Unit& u, int64_t from, int64_t len) {
  if (!u.split) return u.master.narrow(from, len);
  const Tensor hi = owned_values(u).narrow(from, len).to(Device::cpu(), MemCategory::other);
  const Tensor lo = u.master.narrow(from, len).to(Device::cpu(), MemCategory::other);
  Tensor full = Tensor::empty({len}, DType::f32, Device::cpu(), MemCategory::other);
  join_master(hi, lo, full);
  return full;
}

Tensor ModelState::master_f32(size_t i, int64_t from, int64_t len) {
  settle_updates();
  Unit& u = *units_[i];
  const int64_t owned_len = u.mode == Mode::whole ? u.u->numel : u.len;
  BB_CHECK(from >= 0 && len >= 0 && from + len <= owned_len, "ModelState::master_f32: elements [", from, ", ",
           from + len, ") are outside the ", owned_len, " unit ", u.u->name, " owns here");
  return master_f32(u, from, len);
}

std::pair<Tensor, Tensor> ModelState::master_halves(size_t i, int64_t from, int64_t len) {
  settle_updates();
  Unit& u = *units_[i];
  const int64_t owned_len = u.mode == Mode::whole ? u.u->numel : u.len;
  BB_CHECK(from >= 0 && len >= 0 && from + len <= owned_len, "ModelState::master_halves: elements [", from, ", ",
           from + len, ") are outside the ", owned_len, " unit ", u.u->name, " owns here");
  if (!u.split) return {};
  return {owned_values(u).narrow(from, len), u.master.narrow(from, len)};
}

// A split master's halves of the owned elements [0, m.numel()) from the f32 master m (any device).
void ModelState::set_split_master(Unit& u, const Tensor& m) {
  const int64_t len = m.numel();
  const Tensor host = m.device().is_cpu() ? m : m.to(Device::cpu(), MemCategory::other);
  Tensor hi = Tensor::empty({len}, DType::bf16, Device::cpu(), MemCategory::other);
  Tensor lo = Tensor::empty({len}, DType::i16, Device::cpu(), MemCategory::other);
  split_master(host, hi, lo);
  owned_values(u).narrow(0, len).copy_from(hi);
  u.master.narrow(0, len).copy_from(lo);
}

std::vector<ModelState::Unit*> ModelState::layer_units(int64_t layer) {
  if (layer < 0 || layer >= static_cast<int64_t>(by_layer_.size())) return {};
  return by_layer_[static_cast<size_t>(layer)];
}

void ModelState::begin_step(const EarlyUpdate* early) {
  join_early_norms();  // nothing writes a gradient (or reads a value) that the copy stream may still use
  std::fill(norm_early_.begin(), norm_early_.end(), 0);
  // adamw_offload: the update runs on the host; an early update only opens it now (below).
  early_on_ = early != nullptr && !offload_;
  if (early) {
    BB_CHECK(early->cfg.grad_scale == 1.0, "ModelState::begin_step: an update during the backward cannot scale the "
             "gradients (clipping needs the global norm first); got grad_scale ", early->cfg.grad_scale);
    early_ = *early;
  }
  updated_.assign(units_.size(), 0);
  early_count_ = 0;
  embed_rows_done_ = false;
  embed_rows_pending_ = false;
  embed_rows_known_ = embed_rows_apply();
  if (embed_rows_known_) embed_rows_.assign(static_cast<size_t>(embed_->u->params[0]->shape[0]), 0);
  if (offload_) {
    offload_->begin_step();
    std::fill(offload_submitted_.begin(), offload_submitted_.end(), 0);
    // The gradients' copies to the host (copy stream) are read before they are zeroed.
    const Device dev = model_.param_store().device();
    if (dev.is_cuda()) Event::record(dev, Stream::copy).wait(Stream::compute);
    if (early)
      offload_->open({early->step, early->lr, early->weight_decay, early->cfg});
  }
  model_.zero_grad();  // whole and zero1 units (fsdp units have no whole gradient now)
  for (auto& u : units_)
    if (u->mode == Mode::fsdp) u->grad_shard.zero_();
}

void ModelState::begin_micro_batch(bool last) { last_micro_ = last; }

// ---- fsdp: gather, free, reduce-scatter --------------------------------------------------------

void ModelState::gather(Unit& u, bool wait) {
  if (!sharded(u)) return;
  if (!u.full_value.defined()) {
    offload_ready(u);  // the shard's new values first
    u.full_value = Tensor::empty({u.N * u.S}, u.value_shard.dtype(), u.value_shard.device(), MemCategory::comm);
    u.gather_work = u.g->all_gather(u.value_shard, u.full_value, Stream::gather);
  }
  if (wait) ensure(u);
}

void ModelState::ensure(Unit& u) {
  offload_ready(u);
  if (!sharded(u)) return;
  if (!u.full_value.defined()) gather(u, false);
  if (u.gather_work) {
    u.gather_work->wait();
    u.gather_work.reset();
  }
  model_.param_store().rebind(*u.u, u.full_value, u.full_grad);
}

void ModelState::release(Unit& u) {
  if (!sharded(u) || !u.full_value.defined()) return;
  if (u.gather_work) {  // prefetched and not used (e.g. the pass ended)
    u.gather_work->wait();
    u.gather_work.reset();
  }
  u.full_value = Tensor();
  model_.param_store().rebind(*u.u, Tensor(), u.full_grad);
}

void ModelState::grads_begin(Unit& u) {
  if (!sharded(u) || u.full_grad.defined()) return;
  u.full_grad = Tensor::zeros({u.N * u.S}, DType::f32, u.grad_shard.device(), MemCategory::comm);
  model_.param_store().rebind(*u.u, u.full_value, u.full_grad);
}

void ModelState::set_reduction(DType dtype, bool fsdp_per_step) {
  BB_CHECK(dtype == DType::f32 || dtype == DType::bf16, "ModelState::set_reduction: gradients are reduced in f32 or "
           "bf16, not ", dtype_name(dtype));
  BB_CHECK(pending_.empty(), "ModelState::set_reduction: reductions are in flight");
  reduce_dtype_ = dtype;
  fsdp_per_step_ = fsdp_per_step;
}

// A reduction reads gradients that weight-gradient GEMMs on the wgrad stream may still write
// (the experts' delayed wgrad, primitives/moe/dispatcher.h): the reduce stream waits for them
// (nothing to wait for on the CPU, where every stream's work is done when issued). In bf16 the
// rounded copy is made on the reduce stream, behind the work queued so far.
Tensor ModelState::reduce_input(const Tensor& grad) {
  const Device dev = grad.device();
  if (dev.is_cuda()) Event::record(dev, Stream::wgrad).wait(Stream::reduce);
  if (reduce_dtype_ == DType::f32) return grad;
  if (dev.is_cuda()) Event::record(dev, current_stream()).wait(Stream::reduce);
  StreamScope on(Stream::reduce);
  Tensor b = grad.to_dtype(reduce_dtype_, MemCategory::comm);
  grad.record_stream(Stream::reduce);
  return b;
}

void ModelState::grads_end(Unit& u) {
  if (!sharded(u) || !u.full_grad.defined()) return;
  // fsdp_reduce = "step": the whole gradient stays bound and the next micro-batch adds to it.
  if (fsdp_per_step_ && !last_micro_) return;
  const Tensor in = reduce_input(u.full_grad);
  u.reduce_out = Tensor::empty({u.S}, in.dtype(), u.grad_shard.device(), MemCategory::comm);
  u.reduce_work = u.g->reduce_scatter(in, u.reduce_out, comm::ReduceOp::sum, Stream::reduce);
  u.full_grad = Tensor();  // the Work holds it until the reduction is done
  model_.param_store().rebind(*u.u, u.full_value, Tensor());
  pending_.push_back(&u);
}

void ModelState::reduce_grads(Unit& u) {
  if (u.N == 1) return;
  if (u.mode == Mode::whole) {
    const Tensor in = reduce_input(u.u->grad);
    if (in.dtype() != u.u->grad.dtype()) u.reduce_out = in;  // drained back into the f32 gradient
    u.reduce_work = u.g->all_reduce(in, comm::ReduceOp::sum, Stream::reduce);
  } else {  // zero1: this rank's shard of the summed gradient
    const Tensor in = reduce_input(u.grad_buf);
    u.reduce_out = Tensor::empty({u.S}, in.dtype(), u.grad_buf.device(), MemCategory::comm);
    u.reduce_work = u.g->reduce_scatter(in, u.reduce_out, comm::ReduceOp::sum, Stream::reduce);
  }
  pending_.push_back(&u);
}

// A unit that nothing reduces (one rank) has its final gradient after its last backward of the
// step. Its sum of squares then runs on the copy stream, beside the backward of the layers
// below, instead of in grad_norm() after the whole backward (a pass over every gradient: 3-4 ms
// at 8K tokens of the 4-layer Qwen3 slices on an H200). The same kernels on the same tensor:
// grad_norm() returns bitwise the same value (its own sums use the same kernel).
bool ModelState::early_norm_applies(const Unit& u) const {
  if (!last_micro_ || u.N != 1 || u.mode != Mode::whole || u.u->numel == 0) return false;
  const Tensor& g = u.u->grad;
  return g.defined() && g.device().is_cuda();
}

bool ModelState::early_norm(Unit& u, bool with_update) {
  if (!early_norm_applies(u)) return false;
  const Tensor& g = u.u->grad;
  ensure_norm_slots(g.device());
  // After everything that wrote the gradient (the compute stream, and delayed wgrads).
  copy_after_grads(g.device());
  {
    StreamScope scope(Stream::copy);
    if (with_update)  // one pass: the update adds the squares of the gradient it reads
      update_unit(u, early_.step, early_.lr, early_.weight_decay, early_.cfg, early_.nonfinite, true, &norm_slots_);
    else
      sum_of_squares_to(g.narrow(0, u.u->numel), norm_slots_, static_cast<int64_t>(u.index));
  }
  norm_early_[u.index] = 1;
  return true;
}

// One f64 sum per unit: scratch kept across steps, not optimizer state (category workspace, so
// the optimizer category stays at its closed form).
void ModelState::ensure_norm_slots(const Device& dev) {
  if (norm_slots_.defined()) return;
  norm_slots_ = Tensor::zeros({static_cast<int64_t>(units_.size())}, DType::i64, dev, MemCategory::workspace);
  norm_early_.assign(units_.size(), 0);
}

// The copy stream waits for everything issued so far that may write a gradient (the compute
// stream, delayed wgrads); the compute stream joins it again in join_early_norms().
void ModelState::copy_after_grads(const Device& dev) {
  Event::record(dev, Stream::compute).wait(Stream::copy);
  Event::record(dev, Stream::wgrad).wait(Stream::copy);
  copy_dev_ = dev;
  norm_pending_ = true;
}

// The compute stream waits for the copy stream's sums and updates (before it reads a sum or a
// value, or writes a gradient again).
void ModelState::join_early_norms() {
  if (!norm_pending_) return;
  Event::record(copy_dev_, Stream::copy).wait(Stream::compute);
  norm_pending_ = false;
}

// The unit's gradient is final for this step (its last backward of the last micro-batch is
// issued, and nothing reduces it further): its early sum of squares and, with an early update,
// its AdamW step. On a GPU both go on the copy stream behind the backward issued so far; the
// update's short blocks leave SMs to the backward kernels between them. A unit's values are not
// read again in this step's backward once its own backward is issued (the layers below read
// their own; a tied head is final only after the embedding backward).
//
// When both run on a GPU they are one pass over the gradient (adamw_step_sum_squares: the same
// bits as the sum, then the update), which saves a read of every gradient (4 bytes a parameter
// of the ~32 the update moves).
void ModelState::unit_final(Unit& u) {
  if (offload_) {
    // The host updates it: its gradient goes to the host on the copy stream. No early sum of
    // squares there: a kernel on that low-priority stream waits for SMs behind the backward, and
    // the copies queued after it with it (measured: the host then started only as the backward
    // ended). grad_norm() sums every gradient on the compute stream instead.
    if (last_micro_ && u.N == 1 && u.mode == Mode::whole) offload_submit(u);
    return;
  }
  const bool update = early_on_ && last_micro_ && u.N == 1 && u.mode == Mode::whole && !updated_[u.index];
  if (update && &u == embed_ && embed_rows_done_) {  // the untouched rows went after the lookup
    early_norm(u, false);                               // the whole gradient's sum, as without the split
    update_embed_rows(embed_row_list(true));
    embed_rows_done_ = false;
    updated_[u.index] = 1;
    ++early_count_;
    ++embed_split_steps_;
    return;
  }
  if (update) model_.param_store().materialize_grads(u.u);
  if (early_norm(u, update)) {
    if (update) {
      updated_[u.index] = 1;
      ++early_count_;
    }
    return;
  }
  if (!update) return;
  const Tensor& g = u.u->grad;
  if (g.defined() && g.device().is_cuda()) {
    copy_after_grads(g.device());  // no early sum went first
    StreamScope scope(Stream::copy);
    update_unit(u, early_.step, early_.lr, early_.weight_decay, early_.cfg, early_.nonfinite, true);
  } else {
    update_unit(u, early_.step, early_.lr, early_.weight_decay, early_.cfg, early_.nonfinite, false);
  }
  updated_[u.index] = 1;
  ++early_count_;
}

void ModelState::drain() {
  for (Unit* u : pending_) {
    u->reduce_work->wait();
    u->reduce_work.reset();
    if (u->mode == Mode::fsdp) {
      Tensor g = u->grad_shard;
      add_inplace(g, u->reduce_out);  // widens a bf16 reduction
    } else if (u->mode == Mode::zero1) {
      const Tensor& r = u->reduce_out;
      u->grad_buf.narrow(u->r * u->S, u->S).copy_from(r.dtype() == DType::f32 ? r : r.to_dtype(DType::f32));
    } else if (u->reduce_out.defined()) {  // a whole unit's bf16 all-reduce
      u->u->grad.copy_from(u->reduce_out.to_dtype(DType::f32));
    }
    u->reduce_out = Tensor();
    if (last_micro_) offload_submit(*u);  // reduced: final
  }
  pending_.clear();
}

// ---- the embedding's update split by rows ------------------------------------------------------

// The split needs the update during the backward, an untied embedding (a tied one gets the
// head's dense gradient) that one rank holds whole, laid out as the table alone [V, H] from
// element 0, with an eagerly zeroed gradient (the untouched rows' zeros are read).
bool ModelState::embed_rows_apply() const {
  if (!early_on_ || tied_ || !embed_ || embed_->N != 1 || embed_->mode != Mode::whole) return false;
  const ParamUnit& pu = *embed_->u;
  if (pu.params.size() != 1 || !pu.grad.defined() || !pu.value.defined()) return false;
  const Param& p = *pu.params[0];
  return p.offset == 0 && p.shape.size() == 2 && p.shape[1] > 0 && !p.lazy_zero_grad &&
         p.shape[0] * p.shape[1] <= pu.numel && p.shape[0] <= INT32_MAX;
}

void ModelState::embedding_rows(const Tensor& ids) {
  if (!embed_rows_known_) return;
  if (!ids.defined() || !ids.device().is_cpu() || ids.dtype() != DType::i32) {
    embed_rows_known_ = false;  // rows unknown without a device read: no split this step
    return;
  }
  const int32_t* id = ids.data<int32_t>();
  const auto V = static_cast<int64_t>(embed_rows_.size());
  for (int64_t t = 0; t < ids.numel(); ++t)
    if (id[t] >= 0 && id[t] < V) embed_rows_[static_cast<size_t>(id[t])] = 1;  // a bad id fails in the lookup
}

// The rows of the embedding unit the step's lookups touched (touched) or did not (the rest,
// with the alignment padding as a last, shorter row), increasing. Written into one buffer kept
// across steps (its user copies it before the next call): a fresh list of V entries a step cost
// page faults and regrowth, about 4x the listing itself.
const std::vector<int32_t>& ModelState::embed_row_list(bool touched) {
  const ParamUnit& pu = *embed_->u;
  const int64_t H = pu.params[0]->shape[1], rows = ceil_div(pu.numel, H);
  const auto V = static_cast<int64_t>(embed_rows_.size());
  std::vector<int32_t>& list = embed_list_;
  list.clear();
  list.reserve(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const bool hit = r < V && embed_rows_[static_cast<size_t>(r)] != 0;
    if (hit == touched) list.push_back(static_cast<int32_t>(r));
  }
  return list;
}

void ModelState::update_embed_rows(const std::vector<int32_t>& rows, bool gate) {
  Unit& u = *embed_;
  if (!u.u->grad.device().is_cuda()) {
    update_unit(u, early_.step, early_.lr, early_.weight_decay, early_.cfg, early_.nonfinite, false, nullptr, &rows);
    return;
  }
  if (gate) copy_after_grads(u.u->grad.device());  // after the zeroing and the lookup (or the backward)
  StreamScope scope(Stream::copy);
  update_unit(u, early_.step, early_.lr, early_.weight_decay, early_.cfg, early_.nonfinite, true, nullptr, &rows);
}

// ---- hooks ---------------------------------------------------------------------------------------

void ModelState::before_end(ModelEnd e, Pass p) {
  switch (e) {
    case ModelEnd::embed:
      ensure(*embed_);
      for (Unit* u : layer_units(0)) gather(*u, false);  // prefetch layer 0
      break;
    case ModelEnd::head:
      update_untouched_embed_rows();  // a model without layers
      ensure(*head_);
      if (tied_) ensure(*embed_);
      if (p == Pass::train) {
        grads_begin(*head_);
        if (tied_) grads_begin(*embed_);
        // Prefetch the last layer for its backward.
        for (Unit* u : layer_units(static_cast<int64_t>(by_layer_.size()) - 1)) gather(*u, false);
      }
      break;
    case ModelEnd::embed_backward:
      grads_begin(*embed_);  // no values needed: the lookup's gradient is a scatter-add
      break;
  }
}

void ModelState::after_end(ModelEnd e, Pass p) {
  switch (e) {
    case ModelEnd::embed:
      release(*embed_);
      // The rows no lookup of the step touches have a zero gradient: their update needs nothing
      // from the backward. It runs beside the forward instead of in the step's tail: the copy
      // stream waits for the lookup now, and the update is enqueued behind that wait once the
      // first layer's forward is (update_untouched_embed_rows). Listing the rows takes the host
      // ~0.5 ms (V = 152K) to ~1 ms (V = 248K), which the GPU waited for, idle, when the list was
      // made right here.
      embed_rows_pending_ = p == Pass::train && last_micro_ && embed_rows_known_ && !embed_rows_done_;
      if (embed_rows_pending_ && embed_->u->grad.device().is_cuda()) copy_after_grads(embed_->u->grad.device());
      break;
    case ModelEnd::head:
      if (p == Pass::train) {
        grads_end(*head_);
        if (last_micro_ && head_->mode != Mode::fsdp) {
          reduce_grads(*head_);
          if (!tied_) unit_final(*head_);  // a tied head's gradient gets the embedding's too
        }
      }
      release(*head_);
      if (tied_) release(*embed_);  // its gradient stays bound for the embedding backward
      break;
    case ModelEnd::embed_backward:
      grads_end(*embed_);
      if (last_micro_ && embed_->mode != Mode::fsdp) {
        reduce_grads(*embed_);
        if (early_on_ || offload_) unit_final(*embed_);  // the last unit: only its update gains from going early
      }
      release(*embed_);
      drain();  // fsdp: every unit's gradient of this micro-batch is in its shard now
      break;
  }
}

void ModelState::before_forward(const Layer& l, Pass p) {
  for (Unit* u : layer_units(l.index)) ensure(*u);
  if (p == Pass::recompute) return;  // gathered for the backward already
  const int64_t next = l.index + 1;
  if (next < static_cast<int64_t>(by_layer_.size())) {
    for (Unit* u : layer_units(next)) gather(*u, false);
  } else {
    gather(*head_, false);
  }
}

void ModelState::after_forward(const Layer& l, Pass p) {
  if (p == Pass::recompute) return;  // the backward follows
  for (Unit* u : layer_units(l.index)) release(*u);
  update_untouched_embed_rows();
}

void ModelState::update_untouched_embed_rows() {
  if (!embed_rows_pending_) return;
  embed_rows_pending_ = false;
  update_embed_rows(embed_row_list(false), /*gate=*/false);  // the copy stream waits already
  if (embed_->u->grad.device().is_cuda()) norm_pending_ = true;  // the step's end joins it
  embed_rows_done_ = true;
}

void ModelState::before_backward(const Layer& l) {
  for (Unit* u : layer_units(l.index)) {
    ensure(*u);
    grads_begin(*u);
  }
  for (Unit* u : layer_units(l.index - 1)) gather(*u, false);  // prefetch the layer below
}

// A unit that only block b (and blocks after it) writes is final once b's weight gradients are
// issued: its reduce and early update start then, beside the backward of the blocks before b
// (the experts beside the attention block's backward) instead of after the whole layer. FSDP
// units keep the per-layer order (their shards are reduced as the layer ends).
void ModelState::after_block_backward(const Layer& l, size_t b) {
  if (!last_micro_ || b == 0 || b >= l.blocks.size()) return;
  auto writes = [&](size_t j, const ParamUnit* pu) {
    const auto& us = l.blocks[j]->units;
    return std::find(us.begin(), us.end(), pu) != us.end();
  };
  for (Unit* u : layer_units(l.index)) {
    if (u->mode == Mode::fsdp || !writes(b, u->u)) continue;
    bool earlier = false;  // a block whose backward is still to come writes it too
    for (size_t j = 0; j < b && !earlier; ++j) earlier = writes(j, u->u);
    if (earlier) continue;
    if (final_early_.size() < units_.size()) final_early_.assign(units_.size(), 0);
    model_.param_store().materialize_grads(u->u);
    reduce_grads(*u);
    unit_final(*u);
    final_early_[u->index] = 1;
  }
}

void ModelState::after_backward(const Layer& l) {
  drain();  // the layer above's reduce-scatters: at most one layer's whole gradients in flight
  for (Unit* u : layer_units(l.index)) {
    if (u->index < final_early_.size() && final_early_[u->index]) {  // after_block_backward did it
      final_early_[u->index] = 0;
      continue;
    }
    // A lazily zeroed gradient the layer's backward did not write (no rows reached its experts)
    // is zeroed before it is reduced.
    model_.param_store().materialize_grads(u->u);
    if (u->mode == Mode::fsdp) {
      grads_end(*u);
      release(*u);
    } else if (last_micro_) {
      reduce_grads(*u);
      unit_final(*u);
    }
  }
}

void ModelState::end_backward() { drain(); }

// ---- the optimizer step ------------------------------------------------------------------------

std::pair<int64_t, int64_t> ModelState::checkpoint_range(size_t i) const {
  const Unit& u = *units_[i];
  return {u.lo, u.len};
}

std::vector<Tensor> ModelState::resident() {
  settle_updates(true);
  std::vector<Tensor> out;
  auto add = [&out](const Tensor& t) {
    if (t.defined() && t.numel() > 0) out.push_back(t);
  };
  for (const std::unique_ptr<Unit>& up : units_) {
    Unit& u = *up;
    switch (u.mode) {
      case Mode::whole: add(u.u->value); break;
      case Mode::zero1: add(u.value_buf); break;
      case Mode::fsdp: add(u.value_shard); break;
    }
    add(u.master);
    add(u.exp_avg);
    add(u.exp_avg_sq);
  }
  return out;
}

ModelState::Owned ModelState::owned(size_t i) {
  settle_updates();
  Unit& u = *units_[i];
  Owned o;
  if (u.mode == Mode::whole) {
    o.lo = 0;
    o.len = u.u->numel;
  } else {
    o.lo = u.lo;
    o.len = u.len;
  }
  if (o.len > 0) {
    if (!u.split) o.master = u.master.narrow(0, o.len);
    o.exp_avg = u.exp_avg.narrow(0, o.len);
    o.exp_avg_sq = u.exp_avg_sq.narrow(0, o.len);
  }
  return o;
}

void ModelState::set_master(size_t i, const Tensor& master) {
  settle_updates();
  Unit& u = *units_[i];
  const int64_t len = u.mode == Mode::whole ? u.u->numel : u.len;
  BB_CHECK(master.dtype() == DType::f32 && master.numel() == len, "ModelState::set_master: unit ", u.u->name, " owns ",
           len, " elements; got ", master.str());
  if (len == 0) return;
  if (u.split) set_split_master(u, master);
  else u.master.narrow(0, len).copy_from(master);
}

double ModelState::grad_norm() {
  BB_RANGE("grad_norm");
  model_.param_store().materialize_grads();
  // Each rank sums the squares of the elements it writes to checkpoints (for whole units: its
  // 1/N of them), so one all-reduce over the world counts every element once.
  // A GPU unit's sum goes into its f64 slot on the compute stream (sum_of_squares_to: the bits
  // sum_of_squares returns), beside the sums enqueued early on the copy stream; one host read
  // then takes them all (before: one host sync per unit). Summed in unit order, as before.
  comm::Group* world = nullptr;
  std::vector<double> sums(units_.size(), 0.0);
  std::vector<char> in_slot(units_.size(), 0);
  bool any_slot = false;
  if (norm_pending_) {  // the sums enqueued beside the backward
    join_early_norms();
    for (size_t i = 0; i < units_.size() && i < norm_early_.size(); ++i) in_slot[i] = norm_early_[i];
    any_slot = true;
  }
  for (auto& up : units_) {
    Unit& u = *up;
    if (u.len == 0 || in_slot[u.index]) continue;
    Tensor g = u.mode == Mode::fsdp ? u.grad_shard.narrow(0, u.len) : u.u->grad.narrow(u.lo, u.len);
    if (g.device().is_cuda()) {
      ensure_norm_slots(g.device());
      sum_of_squares_to(g, norm_slots_, static_cast<int64_t>(u.index));
      in_slot[u.index] = 1;
      any_slot = true;
    } else {
      sums[u.index] = sum_of_squares(g);
    }
  }
  if (any_slot) {
    const Tensor host = norm_slots_.to(Device::cpu());  // the one host read of the step's sums
    for (size_t i = 0; i < units_.size(); ++i)
      if (in_slot[i]) std::memcpy(&sums[i], host.data<int64_t>() + i, sizeof(double));
    std::fill(norm_early_.begin(), norm_early_.end(), 0);
  }
  double local = 0;
  for (auto& up : units_)
    if (up->len > 0) local += sums[up->index];
  for (auto& up : units_)
    if (!world || up->g->size() > world->size()) world = up->g;
  // The dense group spans every rank while PP = 1 (expert groups are a part of it).
  const double total = world ? world->sum(local) : local;
  return std::sqrt(total);
}

void ModelState::save_backup() {
  BB_RANGE("state_backup");
  settle_updates();
  for (auto& up : units_) {
    Unit& u = *up;
    const int64_t n = u.master.numel();
    if (n == 0) continue;
    if (!u.backup_master.defined()) {
      u.backup_master = Tensor::empty({n}, u.master.dtype(), u.master.device(), MemCategory::optimizer);
      u.backup_moments = Tensor::empty({2 * n}, u.exp_avg.dtype(), u.master.device(), MemCategory::optimizer);
      if (u.split) u.backup_hi = Tensor::empty({n}, DType::bf16, u.master.device(), MemCategory::optimizer);
    }
    u.backup_master.copy_from(u.master);
    if (u.split) u.backup_hi.copy_from(owned_values(u));
    u.backup_moments.narrow(0, n).copy_from(u.exp_avg);
    u.backup_moments.narrow(n, n).copy_from(u.exp_avg_sq);
  }
}

void ModelState::restore_backup() {
  BB_RANGE("state_restore");
  settle_updates();
  for (auto& up : units_) {
    Unit& u = *up;
    const int64_t n = u.master.numel();
    if (n == 0) continue;
    BB_CHECK(u.backup_master.defined(), "ModelState::restore_backup: no backup was taken");
    u.master.copy_from(u.backup_master);
    if (u.split) owned_values(u).copy_from(u.backup_hi);
    u.exp_avg.copy_from(u.backup_moments.narrow(0, n));
    u.exp_avg_sq.copy_from(u.backup_moments.narrow(n, n));
  }
  values_from_masters();
}

size_t ModelState::num_units() const { return units_.size(); }

const std::string& ModelState::unit_name(size_t i) const { return units_[i]->u->name; }

void ModelState::update_unit(Unit& u, int64_t step, double lr, double weight_decay, const AdamWConfig& cfg,
                             Tensor* nonfinite, bool yield_sms, Tensor* norm_slots,
                             const std::vector<int32_t>* rows) {
  const ParamUnit& pu = *u.u;
  if (norm_slots || rows) {  // a whole unit in one call: with its sum of squares, or some rows
    BB_CHECK(u.mode == Mode::whole, "ModelState: a fused update and norm, or an update of rows, needs a whole unit");
    const int64_t n = pu.numel;
    AdamWConfig c = cfg;
    c.seed = seed_;
    c.stream = u.stream;
    c.yield_sms = yield_sms;
    c.first_element = 0;
    Tensor master = u.master.narrow(0, n), m1 = u.exp_avg.narrow(0, n), m2 = u.exp_avg_sq.narrow(0, n);
    Tensor v = pu.value.narrow(0, n);
    Tensor flag = nonfinite ? nonfinite->narrow(static_cast<int64_t>(u.index), 1) : Tensor();
    if (rows) {  // rows of the embedding table (its row length: the hidden size)
      adamw_step_rows(master, pu.grad.narrow(0, n), m1, m2, step, lr, weight_decay,
                      std::clamp<int64_t>(pu.decay_numel, 0, n), c, &v, nonfinite ? &flag : nullptr, *rows,
                      pu.params[0]->shape[1]);
      return;
    }
    adamw_step_sum_squares(master, pu.grad.narrow(0, n), m1, m2, step, lr, weight_decay,
                           std::clamp<int64_t>(pu.decay_numel, 0, n), c, &v, nonfinite ? &flag : nullptr,
                           *norm_slots, static_cast<int64_t>(u.index));
    return;
  }
  // Owned range [a, b) of the unit; master index = element - a.
  const int64_t a = u.mode == Mode::whole ? 0 : u.lo, b = u.mode == Mode::whole ? pu.numel : u.lo + u.len;
  Tensor grad = u.mode == Mode::fsdp ? u.grad_shard : pu.grad;
  Tensor value = u.mode == Mode::fsdp ? u.value_shard : pu.value;
  const int64_t goff = u.mode == Mode::fsdp ? a : 0;  // grad/value index = element - goff
  // Two buckets: the weight-decayed elements [0, decay_numel), then the rest. bf16 moments
  // round with the unit's stream at the bucket's unit element index: the same bits for an
  // element whatever shard or bucket holds it.
  const int64_t cuts[3] = {a, std::clamp(pu.decay_numel, a, b), b};
  AdamWConfig bucket_cfg = cfg;
  bucket_cfg.seed = seed_;
  bucket_cfg.stream = u.stream;
  bucket_cfg.yield_sms = yield_sms;
  for (int k = 0; k < 2; ++k) {
    const int64_t n = cuts[k + 1] - cuts[k];
    if (n <= 0) continue;
    Tensor master = u.master.narrow(cuts[k] - a, n), m1 = u.exp_avg.narrow(cuts[k] - a, n),
           m2 = u.exp_avg_sq.narrow(cuts[k] - a, n), v = value.narrow(cuts[k] - goff, n);
    Tensor flag = nonfinite ? nonfinite->narrow(static_cast<int64_t>(u.index), 1) : Tensor();
    bucket_cfg.first_element = cuts[k];
    adamw_step(master, grad.narrow(cuts[k] - goff, n), m1, m2, step, lr, k == 0 ? weight_decay : 0.0, bucket_cfg,
               &v, nonfinite ? &flag : nullptr);
  }
}

void ModelState::step(int64_t step, double lr, double weight_decay, const AdamWConfig& cfg, Tensor* nonfinite) {
  BB_RANGE("optimizer_step");
  model_.param_store().materialize_grads();
  if (offload_) {
    // Units no hook submitted (none in a full backward; kept for callers that skip the hooks),
    // then the arguments: the host updates in forward order from here, beside the next forward.
    for (auto& up : units_) offload_submit(*up);
    offload_->open({step, lr, weight_decay, cfg});
    return;
  }
  std::vector<comm::WorkPtr> gathers;
  for (auto& up : units_) {
    Unit& u = *up;
    if (u.index < updated_.size() && updated_[u.index]) continue;  // done during the backward
    update_unit(u, step, lr, weight_decay, cfg, nonfinite, false);
    if (u.mode == Mode::zero1)
      gathers.push_back(u.g->all_gather(u.value_buf.narrow(u.r * u.S, u.S), u.value_buf, Stream::gather));
  }
  for (auto& w : gathers) w->wait();
  std::fill(updated_.begin(), updated_.end(), 0);
  early_on_ = false;
}

void ModelState::values_from_masters() {
  settle_updates();
  std::vector<comm::WorkPtr> gathers;
  for (auto& up : units_) {
    Unit& u = *up;
    u.gather_values = false;  // gathered below
    const int64_t len = u.mode == Mode::whole ? u.u->numel : u.len;
    if (len > 0 && !u.split) {  // a split master's upper half is the values already
      Tensor dst = u.mode == Mode::whole ? u.u->value.narrow(0, len)
                   : u.mode == Mode::zero1 ? u.value_buf.narrow(u.lo, len)
                                           : u.value_shard.narrow(0, len);
      if (u.target >= 0) {  // offload: rounded as the host update rounds them
        Tensor v = Tensor::empty({len}, dst.dtype(), Device::cpu(), MemCategory::other);
        host_values_from_master(u.master.data<float>(), v.raw(), v.dtype(), len,
                                offload_->target(static_cast<size_t>(u.target)).ties_away);
        dst.copy_from(v);
      } else {
        dst.copy_from(u.master.narrow(0, len).to_dtype(dst.dtype(), MemCategory::other));
      }
    }
    if (u.mode == Mode::zero1)
      gathers.push_back(u.g->all_gather(u.value_buf.narrow(u.r * u.S, u.S), u.value_buf, Stream::gather));
  }
  for (auto& w : gathers) w->wait();
}

Tensor ModelState::gather_master(size_t i) {
  settle_updates();
  Unit& u = *units_[i];
  if (u.mode == Mode::whole)
    return u.split ? master_f32(u, 0, u.u->numel) : u.master.to(Device::cpu(), MemCategory::other);
  Tensor all = Tensor::empty({u.N * u.S}, DType::f32, u.master.device(), MemCategory::other);
  const Tensor mine = master_f32(u, 0, u.S);  // a split master's on the host: the collective takes device memory
  u.g->all_gather(mine.device() == all.device() ? mine : mine.to(all.device(), MemCategory::other), all)->wait();
  return all.narrow(0, u.u->numel).to(Device::cpu(), MemCategory::other);
}

Tensor ModelState::gather_grad(size_t i) {
  Unit& u = *units_[i];
  model_.param_store().materialize_grads(u.u);
  if (u.mode == Mode::whole) return u.u->grad.to(Device::cpu(), MemCategory::other);
  Tensor shard = u.mode == Mode::fsdp ? u.grad_shard : u.grad_buf.narrow(u.r * u.S, u.S);
  Tensor all = Tensor::empty({u.N * u.S}, DType::f32, shard.device(), MemCategory::other);
  u.g->all_gather(shard, all)->wait();
  return all.narrow(0, u.u->numel).to(Device::cpu(), MemCategory::other);
}

}  // namespace bb
