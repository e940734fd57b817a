// libFuzzer target: SafetensorsFile::parse on arbitrary bytes. Malformed input must end in
// dsakit::Error; anything else (another exception, a sanitizer report, an abort) is a finding.
// An accepted file must survive a write/parse round trip unchanged.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "dsakit/error.h"
#include "dsakit/safetensors.h"

namespace {

bool same_tensor(const dsakit::Tensor& a, const dsakit::Tensor& b) {
  return a.dtype() == b.dtype() && a.view().shape_str() == b.view().shape_str() &&
         a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.view().data, b.view().data, a.nbytes()) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dsakit::SafetensorsFile file;
  try {
    file = dsakit::SafetensorsFile::parse(data, size, "fuzz.safetensors");
  } catch (const dsakit::Error&) {
    return 0;
  }
  dsakit::SafetensorsWriter writer;
  for (const std::string& name : file.names()) writer.add(name, file.get(name));
  for (const auto& [key, value] : file.metadata()) writer.set_metadata(key, value);
  const std::vector<uint8_t> bytes = writer.serialize();
  const dsakit::SafetensorsFile again =
      dsakit::SafetensorsFile::parse(bytes.data(), bytes.size(), "fuzz-roundtrip");
  if (again.names() != file.names() || again.metadata() != file.metadata()) std::abort();
  for (const std::string& name : file.names())
    if (!same_tensor(again.get(name), file.get(name))) std::abort();
  return 0;
}
