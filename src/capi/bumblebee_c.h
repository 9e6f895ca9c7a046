/* bumblebee_c.h — the stable C interface of the trainer (libbumblebee_c.so), what the Python
 * module (python/bumblebee) and any other language call. Plain C types only; opaque handles.
 *
 * Errors: every function returning int returns 0 on success and -1 on error; a function
 * returning a pointer returns NULL on error. bb_last_error() then gives the message (the same
 * text the command line prints), valid until the next call on the same thread.
 *
 * Documents (bb_document) mirror the JSONL rollout records (skills/rl-data.md): tokens, and
 * optional per-token loss_mask, advantages, old / ref log-probs and routing; entry j of each
 * per-token array belongs to token j. The library copies what it needs during the call.
 */
#ifndef BUMBLEBEE_C_H
#define BUMBLEBEE_C_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BB_C_API_VERSION 2

typedef struct bb_trainer bb_trainer;

typedef struct {
  const int32_t* tokens; /* [length], required */
  int64_t length;
  const uint8_t* loss_mask;    /* [length] 0/1, or NULL (all 1) */
  const float* advantages;     /* [length], or NULL */
  const float* old_logprobs;   /* [length], or NULL (on-policy) */
  const float* ref_logprobs;   /* [length], or NULL */
  const int32_t* routing;      /* [length][routing_layers][routing_topk], or NULL */
  int64_t routing_layers, routing_topk;
} bb_document;

int bb_api_version(void);
const char* bb_last_error(void);

/* A trainer from a run config: `config` is a TOML file path, or TOML text when it contains a
 * newline; overrides are "table.key=value" strings as on the command line (--set). Under a
 * launcher (mpirun, srun) every process is one rank, as with `bumblebee train`. */
bb_trainer* bb_trainer_new(const char* config, const char* const* overrides, int64_t num_overrides);
void bb_trainer_free(bb_trainer* t);

int64_t bb_step(const bb_trainer* t);
int64_t bb_vocab_size(const bb_trainer* t);
int bb_rank(const bb_trainer* t);
int bb_world_size(const bb_trainer* t);

/* The names of the metrics a step writes, comma-separated, in order. */
const char* bb_metric_names(void);
int64_t bb_num_metrics(void);
/* One optimizer step on these documents (Trainer::train_on); writes bb_num_metrics() doubles. */
int bb_train_batch(bb_trainer* t, const bb_document* docs, int64_t num_docs, double* metrics);
/* The two halves of bb_train_batch (Trainer::forward_backward_on / optim_step): the forward and
 * backward on these documents, with the step's metrics so far (loss, grad_norm, ...); then the
 * update, with the full metrics. Exactly one optim_step follows each forward_backward. */
int bb_forward_backward(bb_trainer* t, const bb_document* docs, int64_t num_docs, double* metrics);
int bb_optim_step(bb_trainer* t, double* metrics);
/* A data-source step (the run config's data), as `bumblebee train` takes. */
int bb_train_step(bb_trainer* t, double* metrics);

/* Forward only, one rank: the logits of the documents' LAST tokens, [num_docs, vocab] f32. */
int bb_last_logits(bb_trainer* t, const bb_document* docs, int64_t num_docs, float* out);
/* Forward only: per token j of every document (concatenated), log p(token_j | tokens < j) and
 * the entropy of that distribution, at `temperature`; entry 0 of each document is 0. Documents
 * are scored whole, packed into forwards of train.micro_batch_tokens (Trainer::score). Under a
 * launcher it is collective (any layout): every rank passes the same documents, at least one per
 * data rank, and gets every result. */
int bb_token_logprobs(bb_trainer* t, const bb_document* docs, int64_t num_docs, float temperature, float* logprobs,
                      float* entropy);

/* Checkpoints (collective): save writes <dir>/step_NNNNNNNN and returns its path in `path`
 * (capacity `cap` bytes); load reads a step directory or a checkpoint root. */
int bb_save(bb_trainer* t, const char* dir, char* path, int64_t cap);
int bb_load(bb_trainer* t, const char* path);
/* Sharing the GPU with a rollout engine (Trainer::offload / onload): offload copies the state
 * (values, masters, moments) to host memory and frees every device buffer of the model and the
 * allocator's cache; onload rebuilds the model and restores the state bit for bit. Between them
 * only offload-free calls work (bb_step, bb_rank, ...). `report`, if not NULL, gets 4 doubles:
 * seconds, host bytes moved, bytes the allocator still holds live, and the card's memory in use
 * after the call (every process; -1 on the CPU). Per rank (not collective). */
int bb_offload(bb_trainer* t, double* report);
int bb_onload(bb_trainer* t, double* report);

/* A Hugging Face model directory of the current weights (one rank). */
int bb_export_hf(bb_trainer* t, const char* dir);

/* The weights under their Hugging Face names (one rank): count, name and shape, f32 copy. */
int64_t bb_num_weights(bb_trainer* t);
int bb_weight_info(bb_trainer* t, int64_t i, char* name, int64_t name_cap, int64_t* shape, int64_t* ndim);
int bb_weight_copy(bb_trainer* t, int64_t i, float* out);
/* The same weight as bf16 bit patterns (what an inference engine loads; f32-valued weights are
 * rounded to nearest even). */
int bb_weight_copy_bf16(bb_trainer* t, int64_t i, uint16_t* out);

#ifdef __cplusplus
}
#endif

#endif /* BUMBLEBEE_C_H */
