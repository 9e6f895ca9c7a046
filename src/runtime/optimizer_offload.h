// optimizer_offload.h — primitives.optimizer = "adamw_offload": the fp32 master and both f32
// moments of what a rank owns live in host memory (page-locked on a GPU), and the host updates
// them; the device keeps only the parameter values and the f32 gradients (skills/optimizer-offload.md).
//
// One target per unit: the owned elements [first, first + len) of the unit. Per step:
//   1. submit(i): the target's gradient is final on the device (its last backward, reduced where
//      a group reduces it). A device -> host copy of it into the target's host gradient goes on
//      Stream::copy behind the work issued so far (the backward goes on).
//   2. open(args): the step's update arguments. Without clipping they are known when the step
//      begins (the update then runs beside the backward); with clipping the scale needs the
//      global norm, so they come after it.
//   3. The updater thread takes the targets whose copy is done and whose arguments are known, in
//      forward order (the embedding, layer 0, ..., the head: the order the next forward needs
//      them), and updates each in buckets of `bucket` elements on the host pool: AdamW on the f32
//      master and moments (adamw_update_f32_host, the CPU reference's own loop, so the bits are
//      those of `adamw` on the CPU), the new values rounded as the device path rounds them into
//      a page-locked staging slot, and a host -> device copy of the slot into the values on
//      Stream::upload (4 slots in a ring: bucket k + 4 waits for bucket k's copy).
//   4. wait(i, streams): before the next use of the values (the state's hooks), the host waits
//      for the target's update and the using streams for its last copy.
// The next step's forward therefore starts as soon as the embedding and layer 0 are updated, and
// the host updates the later layers while the device runs the earlier ones.
//
// On the CPU (tests) the same threads and buckets run; the copies are memcpy.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/stream.h"
#include "core/tensor.h"
#include "primitives/optim/adamw.h"

namespace bb {

// A fixed set of host threads, each pinned to its own core when the host allows it, that run one
// range of a loop each. run() is called by one thread at a time.
class HostPool {
 public:
  // `ranges` >= 1: the caller runs range 0, ranges - 1 threads the others.
  explicit HostPool(int ranges);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;
  int ranges() const { return ranges_; }
  // fn(lo, hi) on `ranges()` contiguous ranges covering [0, n), in parallel; returns when all
  // are done. fn must not throw.
  void run(int64_t n, const std::function<void(int64_t, int64_t)>& fn);
  // The pool size `threads` = 0 means: every core this process may run on, less one (the
  // thread that issues the device work), and at least 1.
  static int auto_ranges(int threads);

 private:
  void loop(int k);
  int ranges_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable go_, done_;
  uint64_t gen_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  int64_t n_ = 0;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
};

struct OffloadTarget {
  std::string name;                    // the unit's, for messages
  float* master = nullptr;             // host [len]
  float* exp_avg = nullptr;            // host [len]
  float* exp_avg_sq = nullptr;         // host [len]
  float* grad_host = nullptr;          // host [len]: the step's gradient, copied from grad_dev
  Tensor grad_dev;                     // [len] f32: the owned gradient where the backward leaves it
  Tensor value_dev;                    // [len] f32 or bf16: the owned parameter values
  int64_t first = 0;                   // the unit element of owned element 0
  int64_t decay_end = 0;               // unit elements [0, decay_end) take weight decay
  int64_t order = 0;                   // forward order: smaller is needed first
  bool ties_away = false;              // bf16 values rounded ties-away (split master storage)
  int64_t len() const { return grad_dev.defined() ? grad_dev.numel() : 0; }
};

// The host side's shape: the pool's threads (0: every core this process may use but one) and the
// update's bucket in elements (16 Mi: 64 MiB of gradient; the 4 staging slots hold min(bucket,
// largest owned unit) elements of 4 bytes each).
struct OffloadOptions {
  int threads = 0;
  int64_t bucket = int64_t{1} << 24;
};

struct OffloadArgs {
  int64_t step = 0;
  double lr = 0, weight_decay = 0;
  AdamWConfig cfg;  // grad_scale carries clipping
};

class OptimizerOffload {
 public:
  // `threads`: host pool size (HostPool::auto_ranges); `bucket`: elements per bucket (> 0).
  // The host buffers of the targets must outlive this object; on a GPU they are page-locked
  // here (and unlocked in the destructor).
  OptimizerOffload(Device dev, std::vector<OffloadTarget> targets, int threads, int64_t bucket);
  ~OptimizerOffload();
  OptimizerOffload(const OptimizerOffload&) = delete;
  OptimizerOffload& operator=(const OptimizerOffload&) = delete;

  size_t size() const { return targets_.size(); }
  const OffloadTarget& target(size_t i) const { return targets_[i]; }
  int threads() const { return pool_.ranges(); }
  // Whether the host buffers are page-locked (GPU; false on the CPU or when locking failed: the
  // copies are then synchronous, still correct).
  bool pinned() const { return pinned_; }
  int64_t host_bytes() const { return host_bytes_; }

  // A new step: targets submitted but never opened (a step that applied no update) are dropped.
  void begin_step();
  // The step's update arguments: the submitted targets that have none take them, and so do the
  // targets submitted later in this step.
  void open(const OffloadArgs& args);
  // Target i's gradient is final on the device (the work issued so far writes it): its copy to
  // the host is enqueued (a previous update of the target still running is waited for first).
  void submit(size_t i);
  // Before the target's values are used: the host waits for its update (if one is pending with
  // arguments), and the given streams for its last host -> device copy. Rethrows an update's error.
  void wait(size_t i, std::initializer_list<Stream> users);
  // Every update that has arguments is done and the compute stream waits for their copies.
  void settle();
  // The first target (and its step) whose update made a master or moment non-finite, among the
  // updates done so far; cleared by the call.
  struct Nonfinite {
    size_t target = 0;
    int64_t step = 0;
  };
  std::optional<Nonfinite> take_nonfinite();
  // Host seconds spent updating (all buckets, summed over jobs) since the last call.
  double take_busy_seconds();

 private:
  enum class State : uint8_t { idle, submitted, running, done };
  struct Job {
    State state = State::idle;
    bool has_args = false;
    OffloadArgs args;
    Event d2h, h2d;
    bool nonfinite = false;
    std::string error;
  };
  struct Slot {
    uint8_t* ptr = nullptr;
    Event copied;
  };
  bool ready(const Job& j) const { return j.state == State::submitted && j.has_args; }
  void worker();
  void run(size_t i, const OffloadArgs& a, bool& nonfinite);

  Device dev_;
  std::vector<OffloadTarget> targets_;
  int64_t bucket_;
  HostPool pool_;
  bool pinned_ = false;
  int64_t host_bytes_ = 0;
  std::vector<void*> registered_;
  std::vector<Slot> slots_;
  size_t next_slot_ = 0;
  std::vector<uint8_t> cpu_slots_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<Job> jobs_;
  bool args_open_ = false;
  OffloadArgs args_;
  bool stop_ = false;
  std::vector<Nonfinite> bad_;
  double busy_s_ = 0;
  std::thread thread_;
};

}  // namespace bb
