// ckpt_root.h — a checkpoint root directory owned by one run at a time (skills/checkpoints-distributed.md).
//
// A root (checkpoint.dir) holds step_NNNNNNNN directories, `latest` (the name of the newest
// committed step) and `.lock`. The trainer opens it on rank 0 before the model is built:
//   - the path must be a directory or creatable, and writable (checked by creating a file);
//   - `.lock` is held with flock(2) for the life of the run and names the holder (pid, host,
//     start time); a second run on the same root fails at once with that line. The kernel drops
//     the lock when the holder dies, so a killed run never leaves the root locked. (flock is
//     advisory and per host on some network file systems: two hosts can still collide there.)
//   - temporaries of interrupted saves (.step_N.tmp.PID/ directories, *.tmp.PID files) are
//     removed, with one log line saying how many and how large.
// Every checkpoint carries the run's id (state.json "run_id"); a run prunes only its own.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace bb {

// One step directory of a root.
struct CheckpointEntry {
  std::string name;     // step_NNNNNNNN
  int64_t step = -1;    // from state.json; -1 when unreadable
  std::string run_id;   // "" when state.json has none or cannot be read
  bool complete = false;  // state.json parses and every shard file it lists exists
  std::string problem;  // why it is not complete
};

// Step directories of `root` (names step_ + digits only), ascending by name.
std::vector<CheckpointEntry> list_checkpoints(const std::string& root);

// Removes temporaries of interrupted saves under `root`; returns {count, bytes}.
std::pair<int64_t, int64_t> remove_stale_temporaries(const std::string& root);

// A new run id: 16 hex digits from the clock, the pid and the host name.
std::string new_run_id();

class CheckpointRoot {
 public:
  // Checks and locks `root` (see above); `log` (may be null) gets the cleanup line.
  CheckpointRoot(const std::string& root, FILE* log, const std::string& log_prefix);
  ~CheckpointRoot();
  CheckpointRoot(const CheckpointRoot&) = delete;
  CheckpointRoot& operator=(const CheckpointRoot&) = delete;

  const std::string& path() const { return root_; }

 private:
  std::string root_;
  int lock_fd_ = -1;
};

}  // namespace bb
