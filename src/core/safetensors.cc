// PLACEHOLDER: replaced by the real reader/writer.
#include "dsakit/safetensors.h"

#include "dsakit/error.h"

namespace dsakit {

SafetensorsFile SafetensorsFile::read(const std::string& path) {
  DSAKIT_FAIL(kUnsupported, "safetensors: not implemented yet (", path, ")");
}
SafetensorsFile SafetensorsFile::parse(const uint8_t*, size_t, const std::string& origin) {
  DSAKIT_FAIL(kUnsupported, "safetensors: not implemented yet (", origin, ")");
}
const Tensor& SafetensorsFile::get(const std::string& name) const { return tensors_.at(name); }
const Tensor& SafetensorsFile::get(const std::string& name, DType, std::initializer_list<int64_t>) const {
  return tensors_.at(name);
}
std::vector<std::string> SafetensorsFile::names() const { return {}; }
void SafetensorsWriter::add(const std::string&, const TensorView&) {}
void SafetensorsWriter::set_metadata(const std::string&, const std::string&) {}
void SafetensorsWriter::write(const std::string&) const {}
std::vector<uint8_t> SafetensorsWriter::serialize() const { return {}; }

}  // namespace dsakit
