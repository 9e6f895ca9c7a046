// trainer.h — the training protocol: step loop, LR schedule, AdamW with fp32 master weights,
// gradient accumulation and clipping, metrics, checkpoints.
//
// One optimizer step = grad_accum micro-batches. Their valid-token counts are summed first so
// that every micro-batch's loss gradient is scaled by 1 / (valid tokens in the step): the loss
// is a per-token average over the whole step, whatever the packing.
//
// Across ranks (mpirun / srun): the mesh (comm/mesh.h) comes from [parallel]; each DP rank takes
// its grad_accum micro-batches of the step from one global stream (global batch = dp x grad_accum
// micro-batches, the same sequence for every layout), valid tokens and losses are summed over
// all ranks, and the state family (primitives/state/state.h) reduces gradients and shards
// parameters and optimizer state. Rank 0 logs (per-rank maxima of peak memory) and writes the
// metrics file; checkpoints are collective (runtime/checkpoint.h).
#pragma once

#include <atomic>
#include <cstdio>
#include <functional>
#include <map>
#include <thread>
#include <memory>
#include <string>
#include <vector>

#include "comm/mesh.h"
#include "core/memory.h"
#include "models/decoder.h"
#include "runtime/ckpt_root.h"
#include "runtime/state.h"
#include "runtime/data.h"
#include "runtime/logprobs.h"
#include "runtime/run_config.h"
#include "runtime/schedule.h"

namespace bb {

struct StepMetrics {
  int64_t step = 0;         // 1-based index of the step just taken
  double loss = 0;          // mean CE per valid token over the step (policy: the aggregated objective)
  double aux_loss = 0;      // mean over micro-batches of the aux loss (pooled over MoE layers, as HF)
  double z_loss = 0;
  double grad_norm = 0;     // before clipping
  double lr = 0;
  int64_t tokens = 0;       // tokens processed in the step
  int64_t valid_tokens = 0;
  double step_time_s = 0;
  double tokens_per_s = 0;
  double model_tflops = 0;  // model FLOPs / step time (DESIGN.md sec. 6), per GPU/process
  MemoryStats mem;          // peaks over this step: this rank's
  MemoryStats mem_max;      // the same, maximum over ranks per category
  int64_t host_syncs = 0;   // deliberate host-device synchronisations in the step (GPU)
  // Rows the experts of a rank received in the step (summed over MoE layers and micro-batches):
  // the maximum and the mean over ranks. max / mean is the token-count skew of expert
  // parallelism (1 on one rank).
  int64_t moe_rows_max = 0;
  double moe_rows_mean = 0;
  // With Trainer::set_record_routing(true): one hash of the routing (every MoE layer's top-k
  // expert ids) per micro-batch of the step, in global micro-batch order (dp rank, then
  // accumulation index), the same on every rank. Tests compare it across layouts.
  std::vector<int64_t> routing;
  // "" for a step that updated the weights; "nonfinite" (loss, gradient norm or update not
  // finite, train.on_nonfinite = "skip_step": nothing applied) or "no_targets" (every target of
  // the step masked). A skipped step still counts: the step index and the data move on.
  std::string skipped;
  bool loss_spike = false;  // loss above train.loss_spike_factor x the running mean (a warning)
  // primitives.loss = "policy": the step's means over valid tokens (every rank's).
  struct Policy {
    double clip_frac = 0, dual_clip_frac = 0;  // tokens whose clip / dual clip removed the gradient
    double approx_kl = 0;                      // mean of r - 1 - log r (KL(old || new), k3)
    double entropy = 0;                        // mean entropy, nats
    double ratio_mean = 0, ratio_max = 0;
    double ref_kl = 0;                         // mean KL estimator to the reference (0 without it)
    double sequences = 0;                      // sequences of the step (documents, by share)
  } policy;
  // A SIGTERM / SIGINT some rank received during or before the step (its number; the maximum
  // over ranks, so every rank agrees), 0: none. run() saves and stops after such a step.
  int stop_signal = 0;
};

// What Trainer::offload / onload did (this rank).
struct OffloadReport {
  double seconds = 0;
  int64_t host_bytes = 0;        // the state copied to (offload) or from (onload) host memory
  int64_t allocator_live = 0;    // bytes still allocated by the trainer's allocator on its device after the call
  int64_t device_used = -1;      // GPU: the card's memory in use after the call (every process; -1 on the CPU)
};

class Trainer {
 public:
  // Builds mesh, model, state and data loader; resumes if cfg.resume says so. The ranks are
  // those of `base` (default: every rank of the job, over parallel.comm); `log` is used on rank 0
  // only unless log.all_ranks.
  explicit Trainer(const RunConfig& cfg, FILE* log = stdout);
  // The same with data given in memory (benchmarks, tests) instead of cfg.data's source.
  Trainer(const RunConfig& cfg, FILE* log, Corpus corpus, comm::GroupPtr base = nullptr);
  ~Trainer();

  // One optimizer step.
  StepMetrics train_step();
  // One optimizer step on the caller's documents instead of the data source's (the Python API's
  // train_batch; data.path = "none" needs no source at all): every document once, whole, packed
  // into dp x grad_accum micro-batches as DataLoader::pack_all says; checked as the data source
  // would be (rollout fields for the policy loss, routing for router replay). Collective: every
  // rank passes the same batch (each packs all micro-batches and takes its own).
  StepMetrics train_on(Corpus batch);
  // The two halves of train_on, for an RL loop that reads the loss and gradient norm before it
  // applies the update (Tinker-style forward_backward / optim_step): forward_backward_on runs the
  // forward and backward of one step on the documents (metrics: loss, grad_norm, tokens, the
  // policy metrics; lr is the one optim_step will use) and optim_step applies it (clipping,
  // the non-finite guard, the update) and returns the step's full metrics. Exactly one
  // optim_step follows each forward_backward_on (gradients do not accumulate across calls);
  // other steps are refused in between. The update is not fused into the backward here
  // ([backend] optimizer_in_backward waits), with the same result.
  StepMetrics forward_backward_on(Corpus batch);
  StepMetrics optim_step();
  bool step_pending() const { return pending_ != nullptr; }
  // The [T, V] f32 logits of one micro-batch (host), by an evaluation forward. One rank only.
  Tensor forward_logits(const MicroBatch& mb);
  // Per-token log-probs and entropies (and with `routing` the experts each token took) of the
  // documents under the current weights at `temperature`: forward only, every document whole,
  // packed into forwards of micro_batch_tokens over the data ranks (score_documents). Any
  // layout and state family (fsdp gathers as in training). Collective: every rank passes the
  // same documents and gets every result. The RL loop's old / ref log-probs without a checkpoint.
  std::vector<DocLogprobs> score(const Corpus& docs, double temperature, bool routing = false);
  // The whole run: cfg.steps steps with log lines, metrics file and checkpoints; it ends early,
  // after saving the step, when a SIGTERM / SIGINT arrived (stopped_by_signal()).
  // Returns the per-step metrics.
  std::vector<StepMetrics> run();
  // One row of log.metrics (a JSON object, no newline) for a step's metrics: what run() writes,
  // for callers that drive train_step themselves (bumblebee paired --metrics).
  std::string metrics_line(const StepMetrics& m) const;

  int64_t step() const { return step_; }
  double lr_at(int64_t step) const;  // learning rate of (1-based) step
  // The model, its values current: with primitives.optimizer = "adamw_offload" the host update of
  // the last step may still be running and a zero1 unit may owe the all-gather of its values
  // (done at the next use otherwise); this waits for both (a collective then: every rank calls it).
  DecoderModel& model() {
    check_onloaded("model()");
    if (state_) state_->settle_updates(true);
    return *model_;
  }
  Schedule& schedule() {
    check_onloaded("schedule()");
    return *schedule_;
  }
  DataLoader& data() { return *data_; }  // data.path = "none": no loader (has_data() false)
  bool has_data() const { return data_ != nullptr; }
  const Mesh& mesh() const { return *mesh_; }
  ModelState& state() {
    check_onloaded("state()");
    return *state_;
  }
  const RunConfig& config() const { return cfg_; }
  // The run's id: new for a fresh run, the checkpoint's for a resumed one (state.json run_id).
  const std::string& run_id() const { return run_id_; }
  int64_t skipped_nonfinite() const { return skipped_nonfinite_; }
  // Fill StepMetrics::routing (a host copy of every layer's routing per micro-batch).
  void set_record_routing(bool on) { record_routing_ = on; }
  int64_t skipped_no_targets() const { return skipped_no_targets_; }
  // What every log line of this rank starts with ("[rank 3] " with log.all_ranks, the emulated
  // tag of an emulated run).
  const std::string& log_prefix() const { return log_prefix_; }
  // Whether this process prints the run's log and writes its metrics (rank 0; an emulated rank).
  bool writer() const { return writer_; }
  // The signal that made run() stop early (after saving the step it ended on), 0 if none.
  int stopped_by_signal() const { return stopped_by_; }

  // Sharing the GPU with a rollout engine (skills/gpu-sharing.md): offload() copies what this rank
  // keeps between steps (ModelState::resident: values, masters, moments) to host memory (pinned
  // on a GPU: 12-18 bytes a held parameter, kept for the trainer's life so that later offloads
  // reuse it), destroys the model, its schedule and the state family (every device buffer they
  // own: gradients, activations' pools, workspaces they allocated) and gives the allocator's
  // cached pool back to the driver. onload() rebuilds them and copies the state back: the same
  // bytes, so training continues bit for bit. Between the two, every call that needs the model
  // refuses with a message naming onload(). Neither is allowed while a forward_backward waits.
  // Not collective (each rank moves its own state); the communicators stay.
  OffloadReport offload();
  OffloadReport onload();
  bool offloaded() const { return offloaded_; }

  // Writes <dir>/step_NNNNNNNN atomically (temp dir + rename) and points <dir>/latest at it
  // once every rank wrote its shard. Collective. A save run() started beside training
  // (checkpoint.async) is committed first.
  std::string save_checkpoint(const std::string& dir);
  // Loads a checkpoint directory (a step_* dir, or a checkpoint root with `latest`). Everything
  // is validated and staged before any state changes: on error nothing is modified. Any
  // layout reads any other's checkpoint (resharded from the unit table). Collective.
  void load_checkpoint(const std::string& path);

 private:
  // A checkpoint save in its three phases (save_checkpoint runs them in a row; run() with
  // checkpoint.async writes the shard on a thread while the next steps train and commits it at
  // the first step end where every rank's writer is done).
  struct SaveJob {
    std::string root, name, final_dir, tmp_dir;
    std::vector<std::pair<std::string, Tensor>> tensors;  // the shard (host copies when async)
    // Async snapshots of split masters: tensors[index] is made by the writer, join_master of the
    // host copies of the two halves (the step does not wait for the join).
    struct Join {
      size_t index = 0;
      Tensor hi, lo;
    };
    std::vector<Join> joins;
    int64_t snapshot_bytes = 0, snapshot_new_bytes = 0;  // async: copied; of that, into new buffers
    std::map<std::string, std::string> meta;
    std::string state;  // rank 0: state.json as of the snapshot's step
    double t0 = 0;
    bool background = false;
    std::thread writer;
    std::atomic<bool> done{false};
    std::string err;  // the writer's
  };
  std::unique_ptr<SaveJob> begin_save(const std::string& root, bool to_host);
  void write_shard(SaveJob& job);
  std::string commit_save(SaveJob& job);
  void start_save(const std::string& root);  // snapshot now, write beside training
  void poll_save();                          // collective: commit when every writer is done
  void finish_save();                        // wait for the writer, commit (collective)
  std::unique_ptr<SaveJob> save_job_;
  void build_model(bool emulated);
  void build_state(const std::vector<Tensor>* masters);
  void check_onloaded(const char* what) const;
  void log_line(const StepMetrics& m);
  void check_loss_spike(StepMetrics& m);
  std::string resolve_auto_resume(const std::string& root);
  void check_foreign_checkpoints();
  void world_broadcast_run_id();

  RunConfig cfg_;
  FILE* log_;
  std::string log_prefix_;
  bool writer_ = true;
  int stopped_by_ = 0;
  std::unique_ptr<Mesh> mesh_;
  std::unique_ptr<DecoderModel> model_;
  std::unique_ptr<Schedule> schedule_;
  std::unique_ptr<ModelState> state_;
  // The memory the estimator predicted for this rank (GPU runs; plan/estimate.h), for the
  // message of an out-of-memory error. Empty when not predicted.
  std::string predicted_memory_;
  // GPU runs, before anything is allocated: refuses (on every rank) a run predicted not to fit.
  void check_memory_fits(comm::Group& base, int rank);
  // One step; `split`: stop after the gradient (and its norm), keeping the rest for optim_step.
  StepMetrics step_impl(bool split);
  // What a split step keeps between forward_backward and optim_step.
  struct PendingStep {
    StepMetrics m;
    double elapsed = 0, flops = 0;  // seconds the step took up to the gradient norm
    int64_t syncs0 = 0, my_rows = 0;
    bool early_update = false, finished = false;
    Tensor flags;
  };
  StepMetrics finish_step(PendingStep& p);
  StepMetrics guarded(const std::function<StepMetrics()>& fn);
  std::vector<MicroBatch> pack_batch(Corpus batch);
  StepMetrics step_on(Corpus batch, bool split);  // train_on / forward_backward_on
  std::unique_ptr<PendingStep> pending_;
  // Rollout fields for the policy loss, routing for router replay: the data source's or a batch's.
  void check_batch_data(const Corpus& c) const;
  std::vector<MicroBatch>* given_ = nullptr;  // train_on's micro-batches for the next step
  std::string auto_why_;  // parallel = "auto": the planner's choice in words (startup log)
  std::unique_ptr<DataLoader> data_;
  int64_t step_ = 0;
  Device device_;
  std::unique_ptr<CheckpointRoot> root_;  // rank 0, when checkpoint.dir is set: checked and locked
  std::string run_id_;
  int64_t skipped_nonfinite_ = 0, skipped_no_targets_ = 0;
  bool record_routing_ = false;
  bool policy_ = false;  // primitives.loss = "policy"
  double loss_mean_ = 0;
  int64_t loss_mean_n_ = 0;
  Tensor nonfinite_flags_;           // per unit, set by the update of the current step
  int32_t* pinned_flags_ = nullptr;  // GPU: their host copy, read after the end-of-step sync
  // offload(): the resident state's host copy (pinned on a GPU), kept after onload for reuse.
  bool offloaded_ = false;
  struct HostStash;
  std::unique_ptr<HostStash> stash_;
  // The async save's host copies, kept from one save to the next (page-locked on a GPU), so
  // that a snapshot after the first costs only the copies at the link's rate.
  struct SnapshotBuffers;
  std::unique_ptr<SnapshotBuffers> snapshot_;
  // run() with periodic async saves: the buffers are allocated and page-locked before the
  // first step, so that no save pays for them (page-locking holds the driver: beside training
  // it would stall the steps instead).
  void prepare_snapshot_buffers();
  // The host tensors an async snapshot of this rank takes, in its order (shape, dtype).
  std::vector<std::pair<std::vector<int64_t>, DType>> snapshot_layout();
  int64_t pinned_flags_n_ = 0;
};

// The communicator a run uses by default: the self group in a single process, else every rank
// of the job over parallel.comm (auto: nccl for one GPU per process, mpi for CPU runs and for
// processes sharing a GPU); "emulated": the emulated world of [emulate] (one process).
comm::GroupPtr default_world(const RunConfig& cfg);
// The layout of cfg on `world_size` ranks (parallel.dp = 0 resolved), validated.
ParallelLayout resolve_layout(const RunConfig& cfg, int64_t world_size);

// Resolves a checkpoint path: a step directory is returned as is; a root with a `latest` file
// resolves to the step it names. Returns "" when `root` has no checkpoint yet.
std::string resolve_checkpoint(const std::string& path);

// Moves a micro-batch's targets and positions to `d` (host -> device from pinned staging, no
// host sync); token ids and cu_seqlens stay on the host (the embedding checks the ids there and
// uploads them itself; attention plans and packing metadata are host-side).
MicroBatch to_device(MicroBatch mb, Device d);

// The cost of a sequence of `len` tokens for whole packing's balance: the model's FLOPs.
std::function<double(int64_t)> flops_cost(const ModelConfig& m);
// A loader over a caller's documents (an API batch, the log-probs pass): whole packing in the
// given order, at the run's micro-batch budget, balanced by flops_cost.
DataLoader whole_loader(const RunConfig& cfg, Corpus docs);

// The model options of a run config (primitives, loss coefficients, device and dtype; values
// deferred: the state family, or the forward-only runner, allocates what each rank holds).
ModelOptions model_options(const RunConfig& c);
// The MoE layers' token chunks for [backend] moe_chunk_tokens on a rank of a context-parallel
// group of `cp` ranks: ceil(ceil(micro_batch_tokens / cp) / moe_chunk_tokens), the same on every
// rank (expert parallelism needs every rank to make the same dispatcher calls); 1 when off.
// Throws naming the keys when that is more chunks than a layer accepts.
int64_t moe_token_chunks(const RunConfig& c, int64_t cp);

// "12.3K", "4.56M" style for log lines.
std::string human_count(double v);

}  // namespace bb
