// ckpt_root.cpp — checkpoint root checks, the run lock, stale temporaries (ckpt_root.h).
#include "runtime/ckpt_root.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <filesystem>
#include <sys/file.h>
#include <unistd.h>

#include "core/error.h"
#include "io/fs.h"
#include "runtime/checkpoint.h"

namespace bb {

namespace fs = std::filesystem;

namespace {

bool is_step_name(const std::string& n) {
  if (n.rfind("step_", 0) != 0 || n.size() == 5) return false;
  for (size_t i = 5; i < n.size(); ++i)
    if (n[i] < '0' || n[i] > '9') return false;
  return true;
}

// "NAME.tmp.DIGITS": the temporaries of atomic_write and of checkpoint saves.
bool is_temporary(const std::string& n) {
  const auto at = n.rfind(".tmp.");
  if (at == std::string::npos || at + 5 == n.size()) return false;
  for (size_t i = at + 5; i < n.size(); ++i)
    if (n[i] < '0' || n[i] > '9') return false;
  return true;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown-host";
  return buf;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

std::vector<CheckpointEntry> list_checkpoints(const std::string& root) {
  std::vector<CheckpointEntry> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (!is_step_name(name) || !e.is_directory()) continue;
    CheckpointEntry c;
    c.name = name;
    const std::string dir = path_join(root, name);
    try {
      const nlohmann::json st = read_checkpoint_state(dir);
      c.step = st["step"].get<int64_t>();
      c.run_id = st.value("run_id", std::string());
      c.complete = true;
      for (const auto& f : st["shards"])
        if (!path_exists(path_join(dir, f.get<std::string>()))) {
          c.complete = false;
          c.problem = "shard " + f.get<std::string>() + " is missing";
          break;
        }
    } catch (const std::exception& ex) {
      c.problem = ex.what();
    }
    out.push_back(std::move(c));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.name < b.name; });
  return out;
}

std::pair<int64_t, int64_t> remove_stale_temporaries(const std::string& root) {
  int64_t count = 0, bytes = 0;
  std::error_code ec;
  std::vector<fs::path> doomed;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (is_temporary(e.path().filename().string())) doomed.push_back(e.path());
  for (const fs::path& p : doomed) {
    if (fs::is_directory(p, ec)) {
      for (const auto& f : fs::recursive_directory_iterator(p, ec))
        if (f.is_regular_file(ec)) bytes += static_cast<int64_t>(f.file_size(ec));
    } else {
      bytes += static_cast<int64_t>(fs::file_size(p, ec));
    }
    fs::remove_all(p, ec);
    BB_CHECK(!ec, "checkpoint.dir ", root, ": cannot remove the stale temporary ", p.string(), " (", ec.message(), ")");
    ++count;
  }
  return {count, bytes};
}

std::string new_run_id() {
  const auto t = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  uint64_t h = 1469598103934665603ull;  // FNV-1a over clock, pid and host
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(t);
  mix(static_cast<uint64_t>(::getpid()));
  for (char c : host_name()) mix(static_cast<unsigned char>(c));
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

CheckpointRoot::CheckpointRoot(const std::string& root, FILE* log, const std::string& log_prefix) : root_(root) {
  BB_CHECK(!root.empty(), "checkpoint.dir is empty");
  BB_CHECK(!path_exists(root) || is_directory(root), "checkpoint.dir = '", root,
           "' exists and is not a directory; point checkpoint.dir at a directory (it is created if missing)");
  try {
    make_dirs(root);
  } catch (const std::exception& e) {
    BB_FAIL("checkpoint.dir = '", root, "' cannot be created (", e.what(), "); pick a writable location");
  }
  const std::string probe = path_join(root, ".write_test." + std::to_string(::getpid()));
  const int pfd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  BB_CHECK(pfd >= 0, "checkpoint.dir = '", root, "' is not writable (", std::strerror(errno),
           "); checkpoints would fail after training. Pick a writable location");
  ::close(pfd);
  ::unlink(probe.c_str());

  // The lock file stays in place after the run (never unlinked: a waiter could otherwise lock a
  // deleted inode while a third run locks a new file); only flock decides who holds the root.
  const std::string lock = path_join(root, ".lock");
  lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  BB_CHECK(lock_fd_ >= 0, "checkpoint.dir = '", root, "': cannot open the lock file ", lock, " (", std::strerror(errno),
           ")");
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder;
    try {
      holder = read_file(lock);
    } catch (const std::exception&) {
    }
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    ::close(lock_fd_);
    lock_fd_ = -1;
    BB_CHECK(err == EWOULDBLOCK, "checkpoint.dir = '", root, "' cannot be locked (", std::strerror(err), ")");
    BB_FAIL("checkpoint.dir = '", root, "' is in use by another run (", holder.empty() ? "holder unknown" : holder,
            "; lock file ", lock, "). Wait for it to finish, stop it, or give this run another checkpoint.dir");
  }
  const std::string me = "pid " + std::to_string(::getpid()) + " on host " + host_name() + " since " + utc_now();
  if (::ftruncate(lock_fd_, 0) == 0) {
    const ssize_t w = ::pwrite(lock_fd_, me.data(), me.size(), 0);
    (void)w;  // the holder line is informative; the flock is what excludes
  }
  const auto [count, bytes] = remove_stale_temporaries(root);
  if (count > 0 && log) {
    std::fprintf(log, "%s[startup] removed %lld temporary file(s)/dir(s) of interrupted saves (%.1f MiB) from %s\n",
                 log_prefix.c_str(), static_cast<long long>(count), static_cast<double>(bytes) / (1024.0 * 1024.0),
                 root.c_str());
    std::fflush(log);
  }
}

CheckpointRoot::~CheckpointRoot() {
  if (lock_fd_ >= 0) {
    // The holder line goes with the lock; if the truncate fails, the next holder overwrites it.
    [[maybe_unused]] const int rc = ::ftruncate(lock_fd_, 0);
    ::flock(lock_fd_, LOCK_UN);
    ::close(lock_fd_);
  }
}

}  // namespace bb
