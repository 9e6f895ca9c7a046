// state.h — the `state` family (primitives.state): where parameters, gradients and optimizer state live across the
// ranks that hold a copy of a unit, and the AdamW step on what a rank owns (DESIGN.md sec. 5).
//
//   replicated  every rank holds the whole unit (values, f32 gradients, fp32 master + moments);
//               gradients are all-reduced unit by unit as each unit's backward finishes (the last
//               micro-batch of the step), on the communication stream, while backward goes on
//   zero1       values and gradients whole; gradients reduce-scattered the same way, AdamW on the
//               rank's shard of master and moments, values all-gathered after the step
//   fsdp        values, gradients and optimizer state all sharded. A unit is all-gathered before
//               its forward (the next layer's units prefetched while this one computes) and freed
//               after it; gathered again for backward (and the recompute under recompute=full);
//               its gradient reduce-scattered as soon as its backward is done
//
// A unit of n elements (alignment padding included) held by a group of N ranks is cut into N
// shards of S = ceil(n / N) elements; rank r owns elements [r S, min((r + 1) S, n)). Bytes per
// rank, b = bytes per parameter value (2 for bf16, 4 for f32), o = optimizer bytes per owned
// element (primitives.optimizer: adamw 12 = 4 master + 2 x 4 moments, adamw_bf16_moments
// 8 = 4 master + 2 x 2 moments; 2 less with a split master, [backend] master_storage = "split",
// the default for bf16 parameters: a 2-byte remainder, the master's upper half being the bf16
// value, adamw.h), summed over units:
//   replicated  params b n        grads 4 n        optimizer o n
//   zero1       params b N S      grads 4 N S      optimizer o S       (buffers padded to N S)
//   fsdp        params b S        grads 4 S        optimizer o S       + gathered units (comm)
// train.on_nonfinite = "skip_step" adds a backup of the same o bytes per owned element.
// fsdp keeps at most the units of two layers (the current and the prefetched one) plus the
// embedding or head unit in use gathered (category comm; both at the head when the embeddings
// are tied, whose whole gradient then stays allocated from the head to the embedding backward),
// and the whole gradient of the units in backward until their reduce-scatter is drained one
// layer later ([backend] fsdp_reduce = "step": every fsdp unit's whole gradient from its first
// backward of the step to the last micro-batch's reduce-scatter). [backend] grad_reduce_dtype =
// "bf16" adds a bf16 copy of what is being reduced (2 bytes an element, comm) and halves the
// reduce-scatter's output. A group of one rank shards
// nothing: every family is then the single-rank path with no copies.
//
// Dense, embedding and head units are held by the mesh's `dense` group (all ranks while PP = 1),
// expert units by the `edp` group. The gradient norm is the square root of one all-reduced sum
// over what each rank owns; clipping is folded into the update.
#pragma once

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "comm/mesh.h"
#include "models/decoder.h"
#include "primitives/optim/adamw.h"
#include "models/hooks.h"
#include "runtime/optimizer_offload.h"

namespace bb {

// The storage of the optimizer family: the moments' dtype (adamw and adamw_offload f32,
// adamw_bf16_moments bf16) and the optimizer bytes per owned element on the state's device, the
// master's 4 (2 when split: an i16 remainder beside the bf16 value) + 2 x the moment size: 12 or
// 8 (10 or 6 split); 0 for adamw_offload, whose f32 master and moments are in host memory with a
// host copy of the gradient (kOffloadHostBytesPerElement).
DType moment_dtype(OptimizerKind opt);
int64_t optimizer_bytes_per_element(OptimizerKind opt, bool split_master = false);
bool offloads_optimizer(OptimizerKind opt);
constexpr int64_t kOffloadHostBytesPerElement = 16;
// adamw_offload's host bytes on a rank: 16 per element of each master it holds (a whole unit, or
// a shard's S elements), with the unit held by a group of group_sizes[i] ranks.
int64_t offload_host_bytes(StateKind kind, const std::vector<ParamUnit*>& units,
                           const std::vector<int64_t>& group_sizes);
// Whether a run splits its masters: [backend] master_storage = "split" and bf16 parameters.
bool splits_master(const std::string& master_storage, DType param_dtype);

// Closed-form bytes per rank of one category under a state family (the formulas above; units
// whose values stay f32 count 4-byte values, and with split_master keep a 4-byte master).
struct StateBytes {
  int64_t params = 0, grads = 0, optimizer = 0;
};
StateBytes state_bytes(StateKind kind, const std::vector<ParamUnit*>& units,
                       const std::vector<int64_t>& group_sizes, int64_t value_bytes,
                       OptimizerKind opt = OptimizerKind::adamw, bool split_master = false);

class ModelState final : public LayerHooks {
 public:
  // Takes over the model's units as `kind` says (a model built with defer_values has no buffers:
  // each rank allocates and fills what it holds). `masters`, if given, are f32 values per unit,
  // (*masters)[i] holding the elements start_range() names for unit i (e.g. read from a
  // checkpoint at full precision, by ranges); otherwise the masters start as the values. `opt` sets the moments' dtype; `seed` (the run's) keys
  // the stochastic rounding of bf16 moments (with the unit's name, the step and the element).
  // `split_master`: the master of each unit with bf16 values is held split, its upper half being
  // the values and an i16 remainder the rest (adamw.h); units with f32 values keep an f32 master.
  // `offload`: primitives.optimizer = "adamw_offload" only (optimizer_offload.h).
  ModelState(StateKind kind, DecoderModel& model, const Mesh& mesh, const std::vector<Tensor>* masters = nullptr,
             OptimizerKind opt = OptimizerKind::adamw, uint64_t seed = 0, bool split_master = false,
             OffloadOptions offload = {});
  // The elements [first, first + second) of unit `u` whose values this rank needs at its start
  // under `kind`: its shard under fsdp, the whole unit otherwise (zero1 and replicated ranks hold
  // every value).
  static std::pair<int64_t, int64_t> start_range(StateKind kind, const ParamUnit& u, const Mesh& mesh);
  ~ModelState() override;

  StateKind kind() const { return kind_; }
  OptimizerKind optimizer() const { return opt_; }
  DType moment_dtype() const { return bb::moment_dtype(opt_); }

  // One optimizer step: begin_step(), then per micro-batch begin_micro_batch(last) + the
  // schedule's forward_backward, then end_backward(), grad_norm(), step().
  //
  // The update during the backward: given `early`, a unit that nothing reduces (one rank holds
  // it whole) is updated with these arguments as soon as its gradient is final (after its last
  // backward of the step), on the copy stream beside the backward of the layers below, instead
  // of in step(). Only for steps whose update needs no global quantity first: the caller passes
  // it when clipping is off (grad_scale 1). The same kernels on the same tensors: the new
  // masters, moments and values are bitwise those of the update in step(). step() then updates
  // the rest (units held by several ranks). `early->nonfinite` must outlive the step.
  struct EarlyUpdate {
    int64_t step = 0;
    double lr = 0, weight_decay = 0;
    AdamWConfig cfg;
    Tensor* nonfinite = nullptr;
  };
  void begin_step(const EarlyUpdate* early = nullptr);
  // Units updated during this step's backward so far (0 without an early update).
  size_t early_updates() const { return early_count_; }
  // Steps whose embedding update was split by rows (with an early update, an untied embedding
  // held whole by one rank): the rows no lookup of the step touched (zero gradient, so their
  // update does not wait for the backward) once the first layer's forward is enqueued, on the
  // copy stream beside the forward; the touched rows once the embedding's gradient is final.
  // Bitwise the update of the whole table; it takes the table's update out of the step's tail.
  size_t embedding_split_updates() const { return embed_split_steps_; }
  void begin_micro_batch(bool last);
  void end_backward();
  // How gradients are reduced ([backend] grad_reduce_dtype, fsdp_reduce). dtype f32: the f32
  // gradients themselves; bf16: each rank's f32 gradient rounded to bf16 (on the reduce stream),
  // summed in bf16 by the backend (NCCL adds in bf16 at every ring step; MPI on the CPU in f32,
  // rounded once) and widened back: half the bytes on the wire and in the reduction buffers.
  // fsdp_per_step: fsdp units keep their whole f32 gradient across the step's micro-batches and
  // reduce-scatter once, after the last (4 bytes an element of every fsdp unit more, category
  // comm, while the step lasts), instead of once per micro-batch. Set before the first step.
  void set_reduction(DType dtype, bool fsdp_per_step);
  // The global gradient norm (before clipping), the same on every rank.
  double grad_norm();
  // `nonfinite`, if given: i32 [num_units()] on the state's device; element i is set to 1 when
  // unit i's updated master or moments (the part this rank owns) hold an Inf or NaN, in the same
  // pass as the update (adamw_step).
  void step(int64_t step, double lr, double weight_decay, const AdamWConfig& cfg, Tensor* nonfinite = nullptr);
  size_t num_units() const;
  const std::string& unit_name(size_t unit) const;
  // A copy of the masters and moments this rank owns, so that a step can be undone
  // (train.on_nonfinite = "skip_step"): optimizer_bytes_per_element (12 or 8; a split master's
  // 10 or 6 and its bf16 upper half, 2 more) bytes per owned
  // element (category optimizer, kept for the run; the moments in their own dtype) and one
  // device copy of them per step. restore_backup() puts them back and refreshes
  // the parameter values (values_from_masters; zero1 re-gathers).
  void save_backup();
  void restore_backup();

  // Optimizer state of unit i this rank owns: elements [lo, lo + len) of the unit.
  struct Owned {
    int64_t lo = 0, len = 0;
    // [len] views: the f32 master (undefined when the master is split: read it with master_f32,
    // load it with set_master), the moments in moment_dtype().
    Tensor master, exp_avg, exp_avg_sq;
  };
  Owned owned(size_t unit);
  // The f32 master of owned elements [from, from + len) of unit i (offsets within the owned
  // range): a view of an f32 master, or a split master joined on the host (those elements only).
  Tensor master_f32(size_t unit, int64_t from, int64_t len);
  // A split master's halves of the owned elements [from, from + len), as views where they live:
  // {bf16 upper half (the values), i16 remainder}; join_master (adamw.h) makes the f32 master of
  // them. Both undefined when the unit's master is not split (read master_f32 then).
  std::pair<Tensor, Tensor> master_halves(size_t unit, int64_t from, int64_t len);
  // Sets the f32 master of the elements unit i owns ([len], any device); then
  // values_from_masters() makes the parameter values follow (a split master sets its bf16 half,
  // the value, here).
  void set_master(size_t unit, const Tensor& master);
  // The elements a checkpoint takes from this rank: the owned ones, except under replicated
  // (everything owned everywhere), where rank r of N writes the r-th of N shards.
  std::pair<int64_t, int64_t> checkpoint_range(size_t unit) const;
  // After masters were overwritten (a checkpoint load): parameter values = masters in the
  // parameter dtype, on every rank that holds them.
  void values_from_masters();

  // What this rank keeps between steps, tensor by tensor, in an order fixed by the model and the
  // layout (Trainer::offload copies them out and back into a rebuilt state): per unit the values
  // it holds at rest (whole: the unit's; zero1: the [N S] buffer; fsdp: its shard), the master
  // (f32, or a split master's i16 remainder) and both moments; views of the live storage.
  // Gradients, gathered units, reduction buffers and the skip_step backup are not in it: the
  // next step rebuilds them. Call between steps (nothing in flight).
  std::vector<Tensor> resident();

  // primitives.optimizer = "adamw_offload": the host side (null otherwise). Masters and moments
  // (owned(), master_f32) are host tensors; the update of a step may still run on the host when
  // step() returns (beside the next forward, which waits unit by unit). Every method that reads
  // or writes masters, moments or values outside the hooks waits for it first (settle_updates).
  const OptimizerOffload* offload() const { return offload_.get(); }
  OptimizerOffload* offload() { return offload_.get(); }
  // Waits for the updates still running on the host, and (gathers) redoes the value all-gathers
  // that zero1 units owe after them (a collective over each such unit's group: every rank calls it).
  void settle_updates(bool gathers = false);
  // The first unit whose offloaded update made its master or moments non-finite, and that update's
  // step, among the updates finished so far (cleared by the call).
  struct OffloadNonfinite {
    size_t unit = 0;
    int64_t step = 0;
  };
  std::optional<OffloadNonfinite> take_offload_nonfinite();

  // Whole unit values (f32 on the host) for exports and tests: gathered where sharded.
  // Collective over the unit's group.
  Tensor gather_master(size_t unit);
  // The unit's reduced gradient of the last step (f32 on the host), whole: gathered where
  // sharded. Collective over the unit's group.
  Tensor gather_grad(size_t unit);

  // LayerHooks (fsdp gathers and frees; replicated and zero1 reduce after the last backward).
  void embedding_rows(const Tensor& ids) override;
  void before_end(ModelEnd e, Pass p) override;
  void after_end(ModelEnd e, Pass p) override;
  void before_forward(const Layer& l, Pass p) override;
  void after_forward(const Layer& l, Pass p) override;
  void before_backward(const Layer& l) override;
  void after_block_backward(const Layer& l, size_t b) override;
  void after_backward(const Layer& l) override;

 private:
  struct Unit;
  void reduce_grads(Unit& u);        // replicated / zero1: start the unit's gradient reduction
  void gather(Unit& u, bool wait);   // fsdp
  void ensure(Unit& u);
  void release(Unit& u);
  void grads_begin(Unit& u);
  void grads_end(Unit& u);
  void drain();
  Tensor reduce_input(const Tensor& grad);  // what a reduction of `grad` sends (set_reduction)
  bool early_norm_applies(const Unit& u) const;
  // The unit's sum of squares beside the backward (grad_norm reads it), fused with its update
  // when with_update; false when it does not apply (nothing enqueued).
  bool early_norm(Unit& u, bool with_update);
  void join_early_norms();
  void ensure_norm_slots(const Device& dev);
  void copy_after_grads(const Device& dev);
  void unit_final(Unit& u);    // the unit's gradient is final: early norm, then early update
  // norm_slots: also the unit's gradient sum of squares into (*norm_slots)[u.index], in the
  // same pass (whole units). rows: only these rows of the embedding table (adamw_step_rows).
  void update_unit(Unit& u, int64_t step, double lr, double weight_decay, const AdamWConfig& cfg,
                   Tensor* nonfinite, bool yield_sms, Tensor* norm_slots = nullptr,
                   const std::vector<int32_t>* rows = nullptr);
  bool embed_rows_apply() const;
  // The embedding's update for the listed rows (update_unit with the early update's
  // arguments); on the copy stream when the state is on a GPU, behind a wait for the work
  // enqueued on the compute streams so far (gate), or behind the copy stream's last wait.
  void update_embed_rows(const std::vector<int32_t>& rows, bool gate = true);
  void update_untouched_embed_rows();  // the embedding rows no lookup touched, if pending
  const std::vector<int32_t>& embed_row_list(bool touched);  // into embed_list_
  std::vector<Unit*> layer_units(int64_t layer);
  bool sharded(const Unit& u) const;
  Tensor owned_values(Unit& u);              // the values of the master's elements
  Tensor master_f32(Unit& u, int64_t from, int64_t len);  // owned elements [from, from + len)
  void set_split_master(Unit& u, const Tensor& master);
  void build_offload(const OffloadOptions& o, bool ties_away);
  void offload_submit(Unit& u);  // the unit's owned gradient is final: its host update may start
  void offload_ready(Unit& u);   // before the unit's values are used: its update is in them

  StateKind kind_;
  OptimizerKind opt_;
  uint64_t seed_;
  DecoderModel& model_;
  bool tied_ = false;
  bool last_micro_ = true;
  DType reduce_dtype_ = DType::f32;
  bool fsdp_per_step_ = false;
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<std::vector<Unit*>> by_layer_;
  Unit* embed_ = nullptr;
  Unit* head_ = nullptr;
  std::vector<Unit*> pending_;  // reductions started and not yet drained
  // Units whose gradient's sum of squares was enqueued on the copy stream as soon as it was
  // final (single-rank units, last micro-batch), into norm_slots_ (f64 bits, one per unit).
  Tensor norm_slots_;
  std::vector<char> norm_early_;
  bool norm_pending_ = false;  // the copy stream has sums or updates the compute stream must join
  Device copy_dev_ = Device::cpu();
  // The update during the backward (begin_step(early)): its arguments, and which units it did.
  bool early_on_ = false;
  EarlyUpdate early_;
  std::vector<char> updated_;
  // Units of the layer in backward whose gradient became final before the layer's end (a
  // block's own units, e.g. the experts; after_block_backward) and that were reduced then.
  std::vector<char> final_early_;
  size_t early_count_ = 0;
  // The split embedding update: rows the step's lookups touched (host, one byte a row), whether
  // every micro-batch's ids were seen (host ids), whether the untouched rows are done.
  std::vector<uint8_t> embed_rows_;
  std::vector<int32_t> embed_list_;  // embed_row_list's buffer, reused
  bool embed_rows_known_ = false;
  bool embed_rows_done_ = false;
  std::vector<char> offload_submitted_;  // this step's submits, per unit
  bool embed_rows_pending_ = false;  // the untouched rows' update waits for a layer's forward
  size_t embed_split_steps_ = 0;
  // Last: destroyed first, while the host buffers and values its targets point at still exist.
  std::unique_ptr<OptimizerOffload> offload_;
};

}  // namespace bb
