#include "dsakit/error.h"

namespace dsakit {

const char* to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
      return "invalid argument";
    case ErrorKind::kLayoutMismatch:
      return "layout mismatch";
    case ErrorKind::kUnsupported:
      return "unsupported";
    case ErrorKind::kConfig:
      return "config";
    case ErrorKind::kFormat:
      return "format";
    case ErrorKind::kResource:
      return "resource";
    case ErrorKind::kBackend:
      return "backend";
    case ErrorKind::kInternal:
      return "internal";
  }
  return "?";
}

}  // namespace dsakit
