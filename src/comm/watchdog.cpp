// watchdog.cpp — the collective watchdog (watchdog.h).
#include "comm/watchdog.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/comm.h"
#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

namespace bb::comm {

namespace {

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

struct Watched {
  std::function<bool()> done;
  std::string what;
  double issued = 0;
};

struct Check {
  std::function<std::string()> check;
  std::function<void()> abort;
};

struct State {
  // run_mu is held by the watchdog while it calls checks and abort hooks, and by
  // remove_health_check, so that a check's owner is never destroyed under the call. Order:
  // run_mu, then mu.
  std::mutex run_mu;
  std::mutex mu;
  std::vector<Watched> watched;
  std::map<int64_t, Check> checks;
  int64_t next_id = 1;
  std::function<void(const std::string&)> action;  // tests; empty: end the process
  std::thread thread;
  std::atomic<bool> stop{false};
  bool started = false;
};

State& state() {
  static State* s = new State;  // lives for the process; its thread is joined at exit
  return *s;
}

// Ends the job from the watchdog thread: the abort hooks first (they free kernels stuck in a
// collective), then the message, then _exit (a launcher ends the other ranks when one exits
// with an error; exit() from this thread would run the static destructors under the main
// thread's feet).
void fire(const std::string& msg) {
  State& s = state();
  std::function<void(const std::string&)> action;
  std::vector<std::function<void()>> aborts;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    action = s.action;
    for (auto& [id, c] : s.checks)
      if (c.abort) aborts.push_back(c.abort);
  }
  for (auto& a : aborts) a();
  if (action) {
    action(msg);
    return;
  }
  std::fprintf(stderr, "bumblebee: [rank %d] %s\n", world().rank, msg.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  ::_exit(3);
}

// One pass: drops completed collectives, fires on the oldest overdue one or a failed check.
void pass() {
  State& s = state();
  std::lock_guard<std::mutex> running(s.run_mu);
  std::vector<Watched> watched;
  std::vector<Check> checks;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    watched.swap(s.watched);
    for (auto& [id, c] : s.checks) checks.push_back(c);
  }
  std::string msg;
  for (const Check& c : checks) {
    std::string e;
    try {
      e = c.check();
    } catch (const std::exception& x) {
      e = x.what();
    }
    if (!e.empty() && msg.empty()) msg = e + ". Aborting the job.";
  }
  const double now = now_s(), limit = timeout();
  std::vector<Watched> pending;
  size_t overdue = watched.size();
  for (size_t i = 0; i < watched.size(); ++i) {
    bool done = false;
    try {
      done = watched[i].done();
    } catch (const std::exception& x) {
      if (msg.empty()) msg = "error while waiting for " + watched[i].what + ": " + x.what() + ". Aborting the job.";
      done = true;
    }
    if (done) continue;
    if (overdue == watched.size() && now - watched[i].issued > limit) overdue = pending.size();
    pending.push_back(std::move(watched[i]));
  }
  if (msg.empty() && overdue < pending.size()) {
    char buf[160];
    std::snprintf(buf, sizeof buf, " did not complete within parallel.timeout_s = %.4g s (issued %.4g s ago)", limit,
                  now - pending[overdue].issued);
    msg = "communication timeout: " + pending[overdue].what + buf +
          "; a peer rank is dead or hung, or the GPU is stuck. Aborting the job.";
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(overdue));  // fire once (tests go on)
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    // Collectives watched during the pass came after these: keep the issue order.
    pending.insert(pending.end(), std::make_move_iterator(s.watched.begin()), std::make_move_iterator(s.watched.end()));
    s.watched.swap(pending);
  }
  if (!msg.empty()) fire(msg);
}

void loop() {
  State& s = state();
  while (!s.stop.load(std::memory_order_relaxed)) {
    pass();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void stop_at_exit() {
  State& s = state();
  s.stop.store(true);
  if (s.thread.joinable()) s.thread.join();
}

void ensure_started() {  // under s.mu
  State& s = state();
  if (s.started) return;
  s.started = true;
  s.thread = std::thread(loop);
  std::atexit(stop_at_exit);  // before the CUDA runtime's own teardown (registered earlier)
}

}  // namespace

void watch(std::function<bool()> done, std::string what) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  ensure_started();
  s.watched.push_back({std::move(done), std::move(what), now_s()});
}

void watch(const Event& e, int cuda_device, std::string what) {
  watch(
      [e, cuda_device] {
#ifdef BB_WITH_CUDA
        cuda::set_device(cuda_device);  // cached per thread: a driver call only when it changes
#else
        (void)cuda_device;
#endif
        return e.done();
      },
      std::move(what));
}

int64_t add_health_check(std::function<std::string()> check, std::function<void()> abort) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  ensure_started();
  const int64_t id = s.next_id++;
  s.checks[id] = {std::move(check), std::move(abort)};
  return id;
}

void remove_health_check(int64_t id) {
  State& s = state();
  std::lock_guard<std::mutex> running(s.run_mu);  // not while the watchdog calls it
  std::lock_guard<std::mutex> lock(s.mu);
  s.checks.erase(id);
}

int64_t watched_count() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return static_cast<int64_t>(s.watched.size());
}

void set_watchdog_action_for_tests(std::function<void(const std::string&)> action) {
  State& s = state();
  std::lock_guard<std::mutex> running(s.run_mu);  // not while the watchdog calls the old one
  std::lock_guard<std::mutex> lock(s.mu);
  s.action = std::move(action);
}

}  // namespace bb::comm
