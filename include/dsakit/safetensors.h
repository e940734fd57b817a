// Reading and writing safetensors files: an 8-byte little-endian header length, a JSON header
// (name -> {dtype, shape, data_offsets}, plus "__metadata__" of strings), then raw little-endian
// data. Supported dtypes: BF16, F32, F64, I32, U8 (FP8 e4m3 bytes travel as U8).
// The reader rejects malformed files with Error(kFormat) naming the file and the defect; it
// never reads outside the buffer.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dsakit/tensor.h"

namespace dsakit {

class SafetensorsFile {
 public:
  static SafetensorsFile read(const std::string& path);
  static SafetensorsFile parse(const uint8_t* data, size_t size, const std::string& origin);

  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws Error(kFormat) naming the file and tensor when missing.
  const Tensor& get(const std::string& name) const;
  // Also checks dtype and shape (-1 matches any extent), naming the tensor.
  const Tensor& get(const std::string& name, DType dtype,
                    std::initializer_list<int64_t> shape) const;
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& origin() const { return origin_; }

 private:
  std::string origin_;
  std::map<std::string, Tensor> tensors_;  // host tensors
  std::map<std::string, std::string> metadata_;
};

class SafetensorsWriter {
 public:
  // Copies the host tensor's bytes. Throws on a duplicate name or a non-host tensor.
  void add(const std::string& name, const TensorView& host_tensor);
  void set_metadata(const std::string& key, const std::string& value);
  void write(const std::string& path) const;  // throws Error(kFormat) on I/O failure
  std::vector<uint8_t> serialize() const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace dsakit
