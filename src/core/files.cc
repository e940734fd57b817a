#include "src/core/files.h"

#include <cstdio>
#include <fstream>

#include "dsakit/error.h"

namespace dsakit::detail {

void write_file_atomic(const std::string& path, const std::string& text, const std::string& what) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    DSAKIT_CHECK_ARG(f.good(), what, " ", path, ": cannot write ", tmp);
    f << text;
    DSAKIT_CHECK_ARG(f.good(), what, " ", path, ": write to ", tmp, " failed");
  }
  DSAKIT_CHECK_ARG(std::rename(tmp.c_str(), path.c_str()) == 0, what, " ", path, ": cannot rename ",
                   tmp);
}

}  // namespace dsakit::detail
