// Small file helpers shared by the library and the CLI.
#pragma once

#include <string>

namespace dsakit::detail {

// Writes `text` to `path` through `path`.tmp and a rename, so a reader never sees a half-written
// file (a killed benchmark leaves the previous complete JSON). Throws Error(kInvalidArgument)
// naming `what` and the path when it cannot write or rename.
void write_file_atomic(const std::string& path, const std::string& text, const std::string& what);

}  // namespace dsakit::detail
