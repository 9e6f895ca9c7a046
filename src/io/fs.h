// fs.h — small file-system helpers: atomic file writes, directory creation, whole-file reads.
//
// An atomic write never leaves a half-written file at the destination: the bytes go to
// "<path>.tmp.<pid>", which is fsync'ed and then renamed over <path> (rename is atomic within
// one file system), and the parent directory is fsync'ed so the rename itself survives a crash.
// If anything fails before the rename, the temporary is removed and <path> is untouched (the
// previous file, if any, stays readable). Checkpoints and index files go through this.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

namespace bb {

// The sink handed to an atomic_write callback. Every write is checked; a short write or an
// OS error throws bb::Error naming the final path.
class FileWriter {
 public:
  FileWriter(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  void write(const void* data, size_t bytes);
  void write(std::string_view s) { write(s.data(), s.size()); }
  // Overwrites bytes already written, at `offset` (a header patched once the data is known).
  void write_at(uint64_t offset, const void* data, size_t bytes);
  // Bytes written so far.
  uint64_t written() const { return written_; }
  // The destination path (not the temporary), for messages.
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
  uint64_t written_ = 0;
};

// Writes `path` atomically: `fill` writes the content through the FileWriter. If `fill`
// throws (or any write, fsync, close or rename fails) the temporary file is removed, the
// exception propagates, and whatever was at `path` before is left as it was.
void atomic_write(const std::string& path, const std::function<void(FileWriter&)>& fill);
void atomic_write(const std::string& path, std::string_view content);

// The temporary name atomic_write uses for `path` in this process: "<path>.tmp.<pid>".
std::string atomic_temp_path(const std::string& path);

// Creates `path` and its missing parents (like mkdir -p). Throws if it exists as a non-directory
// or cannot be created.
void make_dirs(const std::string& path);

// The whole file as bytes. Throws bb::Error naming the path if it cannot be opened or read.
std::string read_file(const std::string& path);

bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
// Size in bytes of a regular file; throws if it is missing or not a regular file.
uint64_t file_size(const std::string& path);
// Joins a directory and a name with exactly one '/'.
std::string path_join(const std::string& dir, const std::string& name);

}  // namespace bb
