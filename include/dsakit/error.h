// dsakit error model: every public entry point validates its arguments and throws dsakit::Error
// with a message that names the argument, the expected and the actual value. Library code never
// calls exit() or abort().
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace dsakit {

enum class ErrorKind {
  kInvalidArgument,  // shape, dtype, stride, length, index, page table, flag
  kLayoutMismatch,   // a pool read or written as the wrong layout
  kUnsupported,      // a valid request no compiled kernel instance / backend implements
  kConfig,           // model config file or key
  kFormat,           // malformed file (safetensors, JSON)
  kResource,         // workspace or memory limit
  kBackend,          // error reported by the device runtime (CUDA, cuBLAS)
  kInternal,         // invariant broken inside dsakit: a bug
};

const char* to_string(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// Throws Error(kind, concat(args...)) when cond is false. Usage:
//   DSAKIT_CHECK(n >= 0, kInvalidArgument, "num_tokens: expected >= 0, got ", n);
#define DSAKIT_CHECK(cond, kind, ...)                                                          \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      throw ::dsakit::Error(::dsakit::ErrorKind::kind, ::dsakit::detail::concat(__VA_ARGS__)); \
    }                                                                                          \
  } while (0)

#define DSAKIT_CHECK_ARG(cond, ...) DSAKIT_CHECK(cond, kInvalidArgument, __VA_ARGS__)

#define DSAKIT_FAIL(kind, ...) \
  throw ::dsakit::Error(::dsakit::ErrorKind::kind, ::dsakit::detail::concat(__VA_ARGS__))

}  // namespace dsakit
