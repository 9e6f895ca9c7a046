// optimizer_offload.cpp — the host pool, the updater thread and the copies of the optimizer
// offload (optimizer_offload.h).
#include "runtime/optimizer_offload.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

namespace bb {

namespace {
// The cores this process may run on.
std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Polls a device event without counting a host sync (the updater thread waits, not the thread
// that issues the device work).
void wait_event(const Event& e) {
  while (!e.done()) std::this_thread::sleep_for(std::chrono::microseconds(20));
}

constexpr size_t kSlots = 4;
}  // namespace

// ---- HostPool ------------------------------------------------------------------------------------

int HostPool::auto_ranges(int threads) {
  if (threads > 0) return threads;
  const int cores = static_cast<int>(allowed_cpus().size());
  return std::max(1, cores - 1);
}

HostPool::HostPool(int ranges) : ranges_(std::max(1, ranges)) {
  // Pinned from the last allowed core down, so that the first (where the process started, and
  // the thread that issues the device work usually runs) stays free.
  const std::vector<int> cpus = allowed_cpus();
  for (int k = 1; k < ranges_; ++k) {
    threads_.emplace_back([this, k] { loop(k); });
    if (static_cast<int>(cpus.size()) > k) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpus[cpus.size() - static_cast<size_t>(k)], &one);
      pthread_setaffinity_np(threads_.back().native_handle(), sizeof(one), &one);  // best effort
    }
  }
}

HostPool::~HostPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  go_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void HostPool::run(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t per = (n + ranges_ - 1) / ranges_;
  if (ranges_ > 1) {
    std::lock_guard<std::mutex> lk(mu_);
    n_ = n;
    fn_ = &fn;
    pending_ = ranges_ - 1;
    ++gen_;
  }
  go_.notify_all();
  fn(0, std::min(n, per));
  if (ranges_ > 1) {
    std::unique_lock<std::mutex> lk(mu_);
    done_.wait(lk, [&] { return pending_ == 0; });
    fn_ = nullptr;
  }
}

void HostPool::loop(int k) {
  uint64_t seen = 0;
  for (;;) {
    int64_t n = 0;
    const std::function<void(int64_t, int64_t)>* fn = nullptr;
    {
      std::unique_lock<std::mutex> lk(mu_);
      go_.wait(lk, [&] { return stop_ || gen_ != seen; });
      if (stop_) return;
      seen = gen_;
      n = n_;
      fn = fn_;
    }
    const int64_t per = (n + ranges_ - 1) / ranges_;
    const int64_t lo = std::min(n, k * per), hi = std::min(n, (k + 1) * per);
    if (lo < hi) (*fn)(lo, hi);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) done_.notify_all();
    }
  }
}

// ---- OptimizerOffload ----------------------------------------------------------------------------

OptimizerOffload::OptimizerOffload(Device dev, std::vector<OffloadTarget> targets, int threads, int64_t bucket)
    : dev_(dev), targets_(std::move(targets)), bucket_(bucket), pool_(HostPool::auto_ranges(threads)) {
  BB_CHECK(bucket_ > 0, "OptimizerOffload: the bucket must hold at least one element, got ", bucket_);
  jobs_.resize(targets_.size());
  for (const OffloadTarget& t : targets_) {
    const int64_t n = t.len();
    BB_CHECK(!t.value_dev.defined() || t.value_dev.numel() == n, "OptimizerOffload: unit ", t.name, " has ",
             t.value_dev.numel(), " values for ", n, " owned elements");
    BB_CHECK(!t.grad_dev.defined() || t.grad_dev.dtype() == DType::f32, "OptimizerOffload: unit ", t.name,
             ": the gradient must be f32");
    BB_CHECK(n == 0 || (t.value_dev.dtype() == DType::f32 || t.value_dev.dtype() == DType::bf16),
             "OptimizerOffload: unit ", t.name, ": values are f32 or bf16");
    host_bytes_ += 16 * n;
  }
  int64_t longest = 1;
  for (const OffloadTarget& t : targets_) longest = std::max(longest, t.len());
  const size_t slot_bytes = static_cast<size_t>(std::min(bucket_, longest)) * sizeof(float);
  slots_.resize(kSlots);
#ifdef BB_WITH_CUDA
  if (dev_.is_cuda()) {
    cuda::set_device(dev_.index);
    pinned_ = true;
    for (const OffloadTarget& t : targets_) {
      const size_t n = static_cast<size_t>(t.len());
      if (n == 0) continue;
      for (float* p : {t.master, t.exp_avg, t.exp_avg_sq, t.grad_host}) {
        if (cuda::host_register(p, n * sizeof(float))) registered_.push_back(p);
        else pinned_ = false;
      }
    }
    for (Slot& s : slots_) s.ptr = static_cast<uint8_t*>(cuda::pinned_alloc(slot_bytes));
  }
#endif
  if (!dev_.is_cuda()) {
    cpu_slots_.resize(kSlots * slot_bytes);
    for (size_t k = 0; k < kSlots; ++k) slots_[k].ptr = cpu_slots_.data() + k * slot_bytes;
  }
  host_bytes_ += static_cast<int64_t>(kSlots * slot_bytes);
  thread_ = std::thread([this] { worker(); });
}

OptimizerOffload::~OptimizerOffload() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
#ifdef BB_WITH_CUDA
  if (dev_.is_cuda()) {
    // The copies still queued read the slots and host buffers: let them finish first.
    for (const Job& j : jobs_) wait_event(j.h2d);
    for (const Job& j : jobs_) wait_event(j.d2h);
    for (Slot& s : slots_) {
      wait_event(s.copied);
      cuda::pinned_free(s.ptr);
    }
    for (void* p : registered_) cuda::host_unregister(p);
  }
#endif
}

void OptimizerOffload::begin_step() {
  std::lock_guard<std::mutex> lk(mu_);
  args_open_ = false;
  for (Job& j : jobs_)
    if (j.state == State::submitted && !j.has_args) j.state = State::idle;
}

void OptimizerOffload::open(const OffloadArgs& args) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    args_open_ = true;
    args_ = args;
    for (Job& j : jobs_)
      if (j.state == State::submitted && !j.has_args) {
        j.has_args = true;
        j.args = args;
      }
  }
  work_cv_.notify_all();
}

void OptimizerOffload::submit(size_t i) {
  BB_CHECK(i < jobs_.size(), "OptimizerOffload::submit: no target ", i);
  const OffloadTarget& t = targets_[i];
  {
    // The host gradient is still being read by the target's previous update: wait for it.
    std::unique_lock<std::mutex> lk(mu_);
    Job& j = jobs_[i];
    if (j.state == State::submitted && !j.has_args) j.state = State::idle;  // superseded
    done_cv_.wait(lk, [&] { return j.state == State::idle || j.state == State::done; });
  }
  const int64_t n = t.len();
  Event d2h;
  if (n > 0) {
    if (dev_.is_cuda()) {
#ifdef BB_WITH_CUDA
      // Behind everything that writes the gradient: the backward, delayed weight gradients, the
      // reduction and its drain.
      for (Stream s : {Stream::compute, Stream::wgrad, Stream::reduce}) Event::record(dev_, s).wait(Stream::copy);
      StreamScope on(Stream::copy);
      cuda::copy_pinned_async(t.grad_host, t.grad_dev.raw(), static_cast<size_t>(n) * sizeof(float));
      d2h = Event::record(dev_, Stream::copy);
#endif
    } else {
      std::memcpy(t.grad_host, t.grad_dev.raw(), static_cast<size_t>(n) * sizeof(float));
    }
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    Job& j = jobs_[i];
    j.state = State::submitted;
    j.d2h = d2h;
    j.h2d = Event();
    j.has_args = args_open_;
    if (args_open_) j.args = args_;
    j.error.clear();
  }
  work_cv_.notify_all();
}

void OptimizerOffload::wait(size_t i, std::initializer_list<Stream> users) {
  Event h2d;
  std::string error;
  {
    std::unique_lock<std::mutex> lk(mu_);
    Job& j = jobs_[i];
    if (j.state == State::idle || (j.state == State::submitted && !j.has_args)) return;
    done_cv_.wait(lk, [&] { return j.state == State::done; });
    h2d = j.h2d;
    error = j.error;
    j.state = State::idle;  // consumed: the values are the new ones from here on
    j.has_args = false;
  }
  BB_CHECK(error.empty(), "the optimizer offload's update of unit '", targets_[i].name, "' failed: ", error);
  for (Stream s : users) h2d.wait(s);
}

void OptimizerOffload::settle() {
  for (size_t i = 0; i < jobs_.size(); ++i) wait(i, {Stream::compute});
}

std::optional<OptimizerOffload::Nonfinite> OptimizerOffload::take_nonfinite() {
  std::lock_guard<std::mutex> lk(mu_);
  if (bad_.empty()) return std::nullopt;
  Nonfinite b = bad_.front();
  bad_.clear();
  return b;
}

double OptimizerOffload::take_busy_seconds() {
  std::lock_guard<std::mutex> lk(mu_);
  const double s = busy_s_;
  busy_s_ = 0;
  return s;
}

void OptimizerOffload::worker() {
#ifdef BB_WITH_CUDA
  if (dev_.is_cuda()) cuda::set_device(dev_.index);
#endif
  for (;;) {
    size_t pick = jobs_.size();
    OffloadArgs args;
    {
      std::unique_lock<std::mutex> lk(mu_);
      auto any_ready = [&] {
        for (const Job& j : jobs_)
          if (ready(j)) return true;
        return false;
      };
      work_cv_.wait(lk, [&] { return stop_ || any_ready(); });
      // The ready target the next forward needs first.
      for (size_t i = 0; i < jobs_.size(); ++i)
        if (ready(jobs_[i]) && (pick == jobs_.size() || targets_[i].order < targets_[pick].order)) pick = i;
      if (pick == jobs_.size()) return;  // stopping, nothing ready
      jobs_[pick].state = State::running;
      args = jobs_[pick].args;
    }
    bool nonfinite = false;
    std::string error;
    wait_event(jobs_[pick].d2h);  // the gradient's copy (not counted as update time)
    const double t0 = seconds_now();
    try {
      run(pick, args, nonfinite);
    } catch (const std::exception& e) {
      error = e.what();
    }
    const double t1 = seconds_now();
    {
      std::lock_guard<std::mutex> lk(mu_);
      Job& j = jobs_[pick];
      j.state = State::done;
      j.error = error;
      busy_s_ += t1 - t0;
      if (nonfinite) bad_.push_back({pick, args.step});
    }
    done_cv_.notify_all();
  }
}

void OptimizerOffload::run(size_t i, const OffloadArgs& a, bool& nonfinite) {
  const OffloadTarget& t = targets_[i];
  Job& j = jobs_[i];  // d2h is not written while the job runs (submit waits for it)
  const int64_t n = t.len();
  const AdamWScalars with_decay = adamw_scalars(a.step, a.lr, a.weight_decay, a.cfg);
  const AdamWScalars no_decay = adamw_scalars(a.step, a.lr, 0.0, a.cfg);
  const DType vdt = n > 0 ? t.value_dev.dtype() : DType::f32;
  const size_t vb = dtype_size(vdt);
  // Owned elements before `cut` take weight decay.
  const int64_t cut = std::clamp<int64_t>(t.decay_end - t.first, 0, n);
  std::atomic<int> bad{0};
  Event last;
  for (int64_t a0 = 0; a0 < n; a0 += bucket_) {
    const int64_t len = std::min(bucket_, n - a0);
    Slot& slot = slots_[next_slot_++ % kSlots];
    wait_event(slot.copied);  // the slot's previous copy has read it
    uint8_t* staging = slot.ptr;
    pool_.run(len, [&](int64_t lo, int64_t hi) {
      const int64_t b0 = a0 + lo, b1 = a0 + hi;
      const int64_t mid = std::clamp(cut, b0, b1);
      bool b = false;
      if (mid > b0)
        b |= adamw_update_f32_host(t.master + b0, t.grad_host + b0, t.exp_avg + b0, t.exp_avg_sq + b0, mid - b0,
                                   with_decay);
      if (b1 > mid)
        b |= adamw_update_f32_host(t.master + mid, t.grad_host + mid, t.exp_avg + mid, t.exp_avg_sq + mid, b1 - mid,
                                   no_decay);
      host_values_from_master(t.master + b0, staging + static_cast<size_t>(lo) * vb, vdt, hi - lo, t.ties_away);
      if (b) bad.store(1, std::memory_order_relaxed);
    });
    uint8_t* dst = static_cast<uint8_t*>(t.value_dev.raw()) + static_cast<size_t>(a0) * vb;
    if (dev_.is_cuda()) {
#ifdef BB_WITH_CUDA
      StreamScope on(Stream::upload);
      cuda::copy_pinned_async(dst, staging, static_cast<size_t>(len) * vb);
      slot.copied = Event::record(dev_, Stream::upload);
      last = slot.copied;
#endif
    } else {
      std::memcpy(dst, staging, static_cast<size_t>(len) * vb);
    }
  }
  j.h2d = last;
  nonfinite = bad.load() != 0;
}

}  // namespace bb
