// cudnn_backend.h — private helper of attention_cudnn.cu: cuDNN loaded at run time, and small
// RAII wrappers over the backend (graph) API descriptors.
//
// Why dlopen: libbumblebee.a is linked into every executable of a CUDA build; resolving cuDNN at
// run time means no executable needs -lcudnn, a machine without cuDNN still runs everything but
// this op, and the error says which library was missing. Only the dozen backend-API entry
// points below are used (no cudnn-frontend). [backend] cudnn_library (set_library) names a
// specific file; it must be chosen before the first attention call loads cuDNN.
//
// Include from .cu files only (needs the CUDA toolkit's cudnn_graph.h for types and enums).
#pragma once

#include <cudnn_graph.h>
#include <dlfcn.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"

namespace bb::cudnn {

// Entry points resolved from libcudnn.so.9 (the cuDNN 9 dispatch library).
struct Api {
  decltype(&::cudnnGetVersion) GetVersion = nullptr;
  decltype(&::cudnnGetErrorString) GetErrorString = nullptr;
  decltype(&::cudnnGetLastErrorString) GetLastErrorString = nullptr;
  decltype(&::cudnnCreate) Create = nullptr;
  decltype(&::cudnnDestroy) Destroy = nullptr;
  decltype(&::cudnnSetStream) SetStream = nullptr;
  decltype(&::cudnnBackendCreateDescriptor) BackendCreateDescriptor = nullptr;
  decltype(&::cudnnBackendDestroyDescriptor) BackendDestroyDescriptor = nullptr;
  decltype(&::cudnnBackendFinalize) BackendFinalize = nullptr;
  decltype(&::cudnnBackendSetAttribute) BackendSetAttribute = nullptr;
  decltype(&::cudnnBackendGetAttribute) BackendGetAttribute = nullptr;
  decltype(&::cudnnBackendExecute) BackendExecute = nullptr;
};

namespace detail {
template <class F>
void resolve(void* lib, const char* name, F& fn, std::string& missing) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
}

// The file [backend] cudnn_library asked for ("" = the default names), and whether cuDNN was
// loaded already (then the choice is fixed).
struct LibraryChoice {
  std::mutex mu;
  std::string file;
  bool loaded = false;
};
inline LibraryChoice& library_choice() {
  static LibraryChoice c;
  return c;
}

inline Api load_api(std::string& error) {
  Api api;
  std::string forced;
  {
    LibraryChoice& c = library_choice();
    std::lock_guard<std::mutex> lock(c.mu);
    forced = c.file;
    c.loaded = true;
  }
  // A file asked for by name is the only one tried: falling back to another cuDNN would run
  // something other than what the startup line and state.json say.
  std::vector<std::string> names;
  if (!forced.empty()) {
    names.push_back(forced);
  } else {
    names.push_back("libcudnn.so.9");
    names.push_back("libcudnn.so");
  }
  void* lib = nullptr;
  std::string tried;
  for (const std::string& n : names) {
    lib = dlopen(n.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (lib) break;
    const char* why = dlerror();
    tried += "\n  " + n + ": " + (why ? why : "not found");
  }
  if (!lib) {
    error = forced.empty()
                ? "cuDNN 9 could not be loaded (the CUDA attention path needs it; put libcudnn.so.9 "
                  "on LD_LIBRARY_PATH or set backend.cudnn_library):" + tried
                : "backend.cudnn_library = '" + forced + "' could not be loaded (give an existing "
                  "libcudnn.so.9 path, or \"\" for the default search):" + tried;
    return api;
  }
  std::string missing;
  resolve(lib, "cudnnGetVersion", api.GetVersion, missing);
  resolve(lib, "cudnnGetErrorString", api.GetErrorString, missing);
  resolve(lib, "cudnnGetLastErrorString", api.GetLastErrorString, missing);
  resolve(lib, "cudnnCreate", api.Create, missing);
  resolve(lib, "cudnnDestroy", api.Destroy, missing);
  resolve(lib, "cudnnSetStream", api.SetStream, missing);
  resolve(lib, "cudnnBackendCreateDescriptor", api.BackendCreateDescriptor, missing);
  resolve(lib, "cudnnBackendDestroyDescriptor", api.BackendDestroyDescriptor, missing);
  resolve(lib, "cudnnBackendFinalize", api.BackendFinalize, missing);
  resolve(lib, "cudnnBackendSetAttribute", api.BackendSetAttribute, missing);
  resolve(lib, "cudnnBackendGetAttribute", api.BackendGetAttribute, missing);
  resolve(lib, "cudnnBackendExecute", api.BackendExecute, missing);
  if (!missing.empty()) error = "the loaded cuDNN library lacks: " + missing + " (cuDNN 9 needed)";
  return api;
}
}  // namespace detail

// Chooses the file to load ("" = libcudnn.so.9 from the library path). An error once cuDNN was
// loaded from another choice (the library cannot be swapped inside a process).
inline void set_library(const std::string& file) {
  detail::LibraryChoice& c = detail::library_choice();
  std::lock_guard<std::mutex> lock(c.mu);
  BB_CHECK(!c.loaded || c.file == file, "backend.cudnn_library = '", file,
           "': cuDNN was already loaded in this process from '",
           c.file.empty() ? "libcudnn.so.9" : c.file, "'; it cannot change inside one process");
  c.file = file;
}

// The process-wide table; throws bb::Error (with the reason) when cuDNN cannot be loaded.
inline const Api& api() {
  static std::string error;
  static const Api table = detail::load_api(error);
  BB_CHECK(error.empty(), error);
  return table;
}

// "<status name>: <cuDNN's last error message>" for error messages.
inline std::string status_text(cudnnStatus_t st) {
  const Api& a = api();
  std::string s = a.GetErrorString(st);
  char last[1024] = {0};
  a.GetLastErrorString(last, sizeof(last));
  if (last[0]) s += std::string(" (") + last + ")";
  return s;
}

// Throws bb::Error "<message>: <cuDNN status> (<cuDNN's last error>)" unless expr succeeds.
#define BB_CHECK_CUDNN(expr, ...)                                                    \
  do {                                                                               \
    cudnnStatus_t bb_st_ = (expr);                                                   \
    BB_CHECK(bb_st_ == CUDNN_STATUS_SUCCESS, __VA_ARGS__, ": ",                      \
             ::bb::cudnn::status_text(bb_st_));                                      \
  } while (0)

// One backend descriptor; destroyed with its owner. Attribute setters throw with the attribute
// number on failure (the number is in cudnn_graph.h).
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) : type_(type) {
    BB_CHECK_CUDNN(api().BackendCreateDescriptor(type, &d_), "cudnnBackendCreateDescriptor(type ",
                   static_cast<int>(type), ")");
  }
  ~Desc() {
    if (d_) api().BackendDestroyDescriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;

  cudnnBackendDescriptor_t get() const { return d_; }

  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
           const void* values) {
    BB_CHECK_CUDNN(api().BackendSetAttribute(d_, name, type, count, values),
                   "cudnnBackendSetAttribute(descriptor type ", static_cast<int>(type_),
                   ", attribute ", static_cast<int>(name), ")");
  }
  void set_i64(cudnnBackendAttributeName_t name, int64_t v) { set(name, CUDNN_TYPE_INT64, 1, &v); }
  void set_i64s(cudnnBackendAttributeName_t name, const std::vector<int64_t>& v) {
    set(name, CUDNN_TYPE_INT64, static_cast<int64_t>(v.size()), v.data());
  }
  void set_bool(cudnnBackendAttributeName_t name, bool v) { set(name, CUDNN_TYPE_BOOLEAN, 1, &v); }
  void set_float(cudnnBackendAttributeName_t name, float v) { set(name, CUDNN_TYPE_FLOAT, 1, &v); }
  void set_dtype(cudnnBackendAttributeName_t name, cudnnDataType_t v) {
    set(name, CUDNN_TYPE_DATA_TYPE, 1, &v);
  }
  void set_desc(cudnnBackendAttributeName_t name, const Desc& v) {
    cudnnBackendDescriptor_t p = v.get();
    set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &p);
  }
  void set_handle(cudnnBackendAttributeName_t name, cudnnHandle_t h) {
    set(name, CUDNN_TYPE_HANDLE, 1, &h);
  }
  cudnnStatus_t try_finalize() { return api().BackendFinalize(d_); }
  void finalize(const char* what) {
    BB_CHECK_CUDNN(try_finalize(), "cudnnBackendFinalize(", what, ")");
  }

 private:
  cudnnBackendDescriptorType_t type_;
  cudnnBackendDescriptor_t d_ = nullptr;
};

using DescPtr = std::shared_ptr<Desc>;

}  // namespace bb::cudnn
