// fs.cpp — POSIX implementation of the atomic write and the small file helpers.
#include "io/fs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace bb {

namespace {

std::string errno_str(int err) { return std::string(std::strerror(err)); }

std::string parent_dir(const std::string& path) {
  std::filesystem::path p(path);
  std::string parent = p.parent_path().string();
  return parent.empty() ? std::string(".") : parent;
}

// Makes a completed rename durable; failure here is reported, not ignored, since the caller
// relies on the file being there after a crash.
void fsync_dir(const std::string& dir, const std::string& path) {
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  BB_CHECK(dfd >= 0, "atomic_write ", path, ": cannot open directory ", dir, " to fsync it: ",
           errno_str(errno));
  int rc = ::fsync(dfd);
  int err = errno;
  ::close(dfd);
  // Some file systems do not support fsync on directories; the rename has happened either way.
  BB_CHECK(rc == 0 || err == EINVAL || err == EROFS, "atomic_write ", path,
           ": fsync of directory ", dir, " failed: ", errno_str(err));
}

}  // namespace

void FileWriter::write_at(uint64_t offset, const void* data, size_t bytes) {
  BB_CHECK(offset + bytes <= written_, "writing ", path_, ": bytes [", offset, ", ", offset + bytes,
           ") were not written yet");
  const char* p = static_cast<const char*>(data);
  size_t left = bytes;
  while (left > 0) {
    ssize_t n = ::pwrite(fd_, p, left, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    BB_CHECK(n > 0, "writing ", path_, " at byte ", offset, " failed: ", n < 0 ? errno_str(errno) : std::string("no progress"));
    p += n;
    offset += static_cast<uint64_t>(n);
    left -= static_cast<size_t>(n);
  }
}

void FileWriter::write(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  size_t left = bytes;
  while (left > 0) {
    // Large writes are split so a single call never exceeds what write(2) accepts.
    const size_t chunk = left < (size_t{1} << 30) ? left : (size_t{1} << 30);
    ssize_t n = ::write(fd_, p, chunk);
    if (n < 0 && errno == EINTR) continue;
    BB_CHECK(n > 0, "writing ", path_, " failed after ", written_, " bytes: ",
             n < 0 ? errno_str(errno) : std::string("no progress"));
    p += n;
    left -= static_cast<size_t>(n);
    written_ += static_cast<uint64_t>(n);
  }
}

std::string atomic_temp_path(const std::string& path) {
  return path + ".tmp." + std::to_string(static_cast<long>(::getpid()));
}

void atomic_write(const std::string& path, const std::function<void(FileWriter&)>& fill) {
  BB_CHECK(!path.empty(), "atomic_write: empty path");
  const std::string tmp = atomic_temp_path(path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  BB_CHECK(fd >= 0, "atomic_write ", path, ": cannot create temporary file ", tmp, ": ",
           errno_str(errno));
  try {
    FileWriter w(fd, path);
    fill(w);
    BB_CHECK(::fsync(fd) == 0, "atomic_write ", path, ": fsync failed: ", errno_str(errno));
    const int rc = ::close(fd);
    fd = -1;
    BB_CHECK(rc == 0, "atomic_write ", path, ": close failed: ", errno_str(errno));
    BB_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "atomic_write ", path, ": rename from ",
             tmp, " failed: ", errno_str(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_dir(parent_dir(path), path);
}

void atomic_write(const std::string& path, std::string_view content) {
  atomic_write(path, [&](FileWriter& w) { w.write(content); });
}

void make_dirs(const std::string& path) {
  BB_CHECK(!path.empty(), "make_dirs: empty path");
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  BB_CHECK(!ec, "make_dirs ", path, ": ", ec.message());
  BB_CHECK(is_directory(path), "make_dirs ", path, ": exists and is not a directory");
}

std::string read_file(const std::string& path) {
  BB_CHECK(!is_directory(path), "read_file ", path, ": is a directory");
  std::ifstream in(path, std::ios::binary);
  BB_CHECK(in.good(), "read_file ", path, ": cannot open: ", errno_str(errno));
  std::ostringstream os;
  os << in.rdbuf();
  BB_CHECK(!in.bad(), "read_file ", path, ": read failed");
  return os.str();
}

bool path_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

uint64_t file_size(const std::string& path) {
  struct stat st;
  BB_CHECK(::stat(path.c_str(), &st) == 0, "file ", path, ": ", errno_str(errno));
  BB_CHECK(S_ISREG(st.st_mode), "file ", path, ": not a regular file");
  return static_cast<uint64_t>(st.st_size);
}

std::string path_join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

}  // namespace bb
