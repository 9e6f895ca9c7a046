// error.h — the one place where checks live.
//
// BB_CHECK(cond, msg...) throws bb::Error with file:line and a message built from the
// remaining arguments (anything with operator<<). These checks stay in release builds:
// they guard user-facing input (shapes, dtypes, configs, files), never hot inner loops.
#pragma once

#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace bb {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
// The repository-relative form of a __FILE__ path ("src/runtime/trainer.cpp"): messages name the
// source line without the build machine's directories. Cuts at the last top-level directory of
// the repository in the path; other paths are returned as given.
inline const char* source_path(const char* file) {
  const char* best = nullptr;
  for (const char* marker : {"/src/", "/tests/", "/bench/", "/fuzz/"}) {
    for (const char* p = file; (p = std::strstr(p, marker)) != nullptr; ++p)
      if (!best || p > best) best = p;
  }
  return best ? best + 1 : file;
}

inline void append(std::ostringstream&) {}
template <class T, class... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
template <class... Args>
[[noreturn]] void throw_error(const char* file, int line, const char* cond, const Args&... args) {
  std::ostringstream os;
  append(os, args...);
  std::string msg = os.str();
  std::ostringstream full;
  full << msg;
  if (msg.empty()) full << "check failed: " << cond;
  full << " [" << source_path(file) << ":" << line << "]";
  throw Error(full.str());
}
}  // namespace detail

// Formats a shape as [a, b, c] for error messages.
std::string shape_str(const std::vector<int64_t>& shape);

}  // namespace bb

#define BB_CHECK(cond, ...)                                                  \
  do {                                                                       \
    if (!(cond)) ::bb::detail::throw_error(__FILE__, __LINE__, #cond, ##__VA_ARGS__); \
  } while (0)

#define BB_FAIL(...) ::bb::detail::throw_error(__FILE__, __LINE__, "", ##__VA_ARGS__)
