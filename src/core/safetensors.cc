// Safetensors reader and writer (docs/config.md#safetensors-files); malformed files fail with
// Error(kFormat).
//
// File layout, all integers little-endian:
//   [0, 8)          u64 n: header length in bytes
//   [8, 8 + n)      JSON object: name -> {"dtype", "shape", "data_offsets": [begin, end)},
//                   optionally "__metadata__": {string: string}; may end with space padding
//   [8 + n, size)   data region; data_offsets are relative to its start
#include "dsakit/safetensors.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <utility>

#include "dsakit/error.h"

namespace dsakit {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // 100 MB, as the reference implementation
constexpr int kMaxJsonDepth = 64;                   // a valid header nests 3 levels deep

struct DTypeName {
  const char* name;
  DType dtype;
};
// Accepted on read. F8_E4M3 loads as its raw bytes (U8), the representation dsakit uses for
// FP8 e4m3fn everywhere; the writer always writes U8.
constexpr DTypeName kReadDTypes[] = {{"BF16", DType::kBF16}, {"F32", DType::kF32},
                                     {"F64", DType::kF64},   {"I32", DType::kI32},
                                     {"U8", DType::kU8},     {"F8_E4M3", DType::kU8}};

const char* safetensors_dtype_name(DType dtype) {
  for (const DTypeName& d : kReadDTypes)
    if (d.dtype == dtype) return d.name;
  return "?";
}

uint64_t load_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void store_u64_le(uint64_t v, uint8_t* p) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}

std::string json_type(const json& j) {
  return j.type_name();
}

// Parses the header text, rejecting duplicate keys in any object (nlohmann would silently keep
// the last one) and nesting deeper than kMaxJsonDepth.
json parse_header_json(const char* begin, const char* end, const std::string& origin) {
  std::vector<std::set<std::string>> open_objects;
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    DSAKIT_CHECK(depth <= kMaxJsonDepth, kFormat, origin, ": header JSON nests deeper than ",
                 kMaxJsonDepth, " levels");
    switch (event) {
      case json::parse_event_t::object_start:
        open_objects.emplace_back();
        break;
      case json::parse_event_t::object_end:
        open_objects.pop_back();
        break;
      case json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        DSAKIT_CHECK(open_objects.back().insert(key).second, kFormat, origin,
                     ": header JSON has the duplicate key \"", key, "\"");
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(begin, end, on_event);
  } catch (const json::exception& e) {
    DSAKIT_FAIL(kFormat, origin, ": header is not valid JSON (", e.what(), ")");
  }
}

// A JSON integer in [0, INT64_MAX], or an error naming `what`.
int64_t nonnegative_int(const json& j, const std::string& what, const std::string& origin) {
  DSAKIT_CHECK(j.is_number_integer(), kFormat, origin, ": ", what, ": expected an integer, got ",
               j.is_number() ? j.dump() : json_type(j));
  if (j.is_number_unsigned()) {
    const uint64_t v = j.get<uint64_t>();
    DSAKIT_CHECK(v <= uint64_t(std::numeric_limits<int64_t>::max()), kFormat, origin, ": ", what,
                 ": ", v, " overflows int64");
    return int64_t(v);
  }
  const int64_t v = j.get<int64_t>();
  DSAKIT_CHECK(v >= 0, kFormat, origin, ": ", what, ": expected >= 0, got ", v);
  return v;
}

const json& required_field(const json& entry, const char* key, const std::string& tensor,
                           const std::string& origin) {
  const auto it = entry.find(key);
  DSAKIT_CHECK(it != entry.end(), kFormat, origin, ": tensor '", tensor, "': missing \"", key,
               "\"");
  return *it;
}

std::string dims_str(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// One tensor entry of the header, validated against the data region but not yet copied.
struct TensorEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  int64_t begin;  // byte offsets into the data region
  int64_t end;
};

TensorEntry parse_tensor_entry(const std::string& name, const json& entry, int64_t data_bytes,
                               const std::string& origin) {
  // An empty name could be read but never asked for or written back (SafetensorsWriter refuses
  // it, as it refuses "__metadata__"): reject it here so a file we accept is one we can re-write.
  DSAKIT_CHECK(!name.empty(), kFormat, origin, ": a tensor has an empty name");
  const std::string where = "tensor '" + name + "'";
  DSAKIT_CHECK(entry.is_object(), kFormat, origin, ": ", where, ": expected an object, got ",
               json_type(entry));
  TensorEntry t{name, DType::kU8, {}, 0, 0};

  const json& dtype = required_field(entry, "dtype", name, origin);
  DSAKIT_CHECK(dtype.is_string(), kFormat, origin, ": ", where, ": dtype: expected a string, got ",
               json_type(dtype));
  const std::string& dtype_name = dtype.get_ref<const std::string&>();
  const auto known = std::find_if(std::begin(kReadDTypes), std::end(kReadDTypes),
                                  [&](const DTypeName& d) { return dtype_name == d.name; });
  DSAKIT_CHECK(known != std::end(kReadDTypes), kFormat, origin, ": ", where,
               ": unsupported dtype \"", dtype_name, "\" (supported: BF16, F32, F64, I32, U8, ",
               "F8_E4M3 as U8)");
  t.dtype = known->dtype;

  const json& shape = required_field(entry, "shape", name, origin);
  DSAKIT_CHECK(shape.is_array(), kFormat, origin, ": ", where, ": shape: expected an array, got ",
               json_type(shape));
  DSAKIT_CHECK(shape.size() >= 1 && shape.size() <= size_t(kMaxDims), kFormat, origin, ": ", where,
               ": shape has rank ", shape.size(), "; dsakit tensors have rank 1..", kMaxDims);
  // The product of the non-zero extents times the element size must fit int64, so that strides
  // and byte counts of even an empty tensor are representable.
  const int64_t elem = int64_t(dtype_size(t.dtype));
  int64_t span = elem;
  bool empty = false;
  for (size_t d = 0; d < shape.size(); ++d) {
    const int64_t extent =
        nonnegative_int(shape[d], where + ": shape[" + std::to_string(d) + "]", origin);
    t.shape.push_back(extent);
    empty = empty || extent == 0;
    DSAKIT_CHECK(extent <= 1 || span <= std::numeric_limits<int64_t>::max() / extent, kFormat,
                 origin, ": ", where, ": shape ", shape.dump(), " overflows int64 bytes");
    span *= std::max<int64_t>(extent, 1);
  }
  const int64_t nbytes = empty ? 0 : span;

  const json& offsets = required_field(entry, "data_offsets", name, origin);
  DSAKIT_CHECK(offsets.is_array() && offsets.size() == 2, kFormat, origin, ": ", where,
               ": data_offsets: expected [begin, end], got ", offsets.dump());
  t.begin = nonnegative_int(offsets[0], where + ": data_offsets[0]", origin);
  t.end = nonnegative_int(offsets[1], where + ": data_offsets[1]", origin);
  DSAKIT_CHECK(t.end >= t.begin, kFormat, origin, ": ", where, ": data_offsets end ", t.end,
               " < begin ", t.begin);
  DSAKIT_CHECK(t.end <= data_bytes, kFormat, origin, ": ", where, ": data_offsets [", t.begin, ", ",
               t.end, ") lie outside the data region of ", data_bytes, " bytes");
  DSAKIT_CHECK(t.end - t.begin == nbytes, kFormat, origin, ": ", where, ": data_offsets span ",
               t.end - t.begin, " bytes but shape ", dims_str(t.shape), " of ", dtype_name,
               " needs ", nbytes);
  return t;
}

std::map<std::string, std::string> parse_metadata(const json& meta, const std::string& origin) {
  DSAKIT_CHECK(meta.is_object(), kFormat, origin, ": __metadata__: expected an object, got ",
               json_type(meta));
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : meta.items()) {
    DSAKIT_CHECK(value.is_string(), kFormat, origin, ": __metadata__[\"", key,
                 "\"]: expected a string, got ", json_type(value));
    out.emplace(key, value.get<std::string>());
  }
  return out;
}

// Tensors may leave gaps in the data region but must not share bytes.
void check_disjoint(std::vector<TensorEntry>& entries, const std::string& origin) {
  std::sort(entries.begin(), entries.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  const TensorEntry* prev = nullptr;
  for (const TensorEntry& t : entries) {
    if (t.begin == t.end) continue;  // empty tensors occupy no bytes
    DSAKIT_CHECK(prev == nullptr || t.begin >= prev->end, kFormat, origin, ": tensors '",
                 prev ? prev->name : "", "' [", prev ? prev->begin : 0, ", ", prev ? prev->end : 0,
                 ") and '", t.name, "' [", t.begin, ", ", t.end, ") overlap");
    prev = &t;
  }
}

}  // namespace

SafetensorsFile SafetensorsFile::parse(const uint8_t* data, size_t size,
                                       const std::string& origin) {
  DSAKIT_CHECK(data != nullptr || size == 0, kInvalidArgument, origin, ": null data pointer");
  DSAKIT_CHECK(size >= 8, kFormat, origin, ": file of ", size,
               " bytes is shorter than the 8-byte header length");
  const uint64_t header_bytes = load_u64_le(data);
  DSAKIT_CHECK(header_bytes <= kMaxHeaderBytes, kFormat, origin, ": header length ", header_bytes,
               " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  DSAKIT_CHECK(header_bytes <= size - 8, kFormat, origin, ": header length ", header_bytes,
               " is larger than the ", size - 8, " bytes after the length field");

  const char* header = reinterpret_cast<const char*>(data + 8);
  const json root = parse_header_json(header, header + header_bytes, origin);
  DSAKIT_CHECK(root.is_object(), kFormat, origin, ": header: expected a JSON object, got ",
               json_type(root));

  SafetensorsFile file;
  file.origin_ = origin;
  const uint8_t* region = data + 8 + header_bytes;
  const int64_t region_bytes = int64_t(size - 8 - header_bytes);
  std::vector<TensorEntry> entries;
  for (const auto& [name, value] : root.items()) {
    if (name == "__metadata__") {
      file.metadata_ = parse_metadata(value, origin);
    } else {
      entries.push_back(parse_tensor_entry(name, value, region_bytes, origin));
    }
  }
  check_disjoint(entries, origin);

  for (const TensorEntry& e : entries) {
    Tensor t = Tensor::host(e.dtype, e.shape);
    if (e.end > e.begin) std::memcpy(t.ptr<uint8_t>(), region + e.begin, size_t(e.end - e.begin));
    file.tensors_.emplace(e.name, std::move(t));
  }
  return file;
}

SafetensorsFile SafetensorsFile::read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DSAKIT_CHECK(in.good(), kFormat, path, ": cannot open safetensors file");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
  DSAKIT_CHECK(!in.bad(), kFormat, path, ": read error");
  return parse(bytes.data(), bytes.size(), path);
}

const Tensor& SafetensorsFile::get(const std::string& name) const {
  const auto it = tensors_.find(name);
  DSAKIT_CHECK(it != tensors_.end(), kFormat, origin_, ": no tensor named '", name, "'");
  return it->second;
}

const Tensor& SafetensorsFile::get(const std::string& name, DType dtype,
                                   std::initializer_list<int64_t> shape) const {
  const Tensor& t = get(name);
  bool shape_ok = t.view().ndim == int(shape.size());
  int d = 0;
  for (int64_t e : shape) {
    if (shape_ok && e >= 0 && t.size(d) != e) shape_ok = false;
    ++d;
  }
  DSAKIT_CHECK(t.dtype() == dtype && shape_ok, kFormat, origin_, ": tensor '", name, "': expected ",
               to_string(dtype), " ", dims_str(std::vector<int64_t>(shape)), " (-1 = any), got ",
               to_string(t.dtype()), " ", t.view().shape_str());
  return t;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, tensor] : tensors_) out.push_back(name);
  return out;
}

void SafetensorsWriter::add(const std::string& name, const TensorView& host_tensor) {
  DSAKIT_CHECK_ARG(!name.empty() && name != "__metadata__", "safetensors tensor name: '", name,
                   "' is reserved or empty");
  DSAKIT_CHECK_ARG(std::none_of(entries_.begin(), entries_.end(),
                                [&](const Entry& e) { return e.name == name; }),
                   "safetensors tensor '", name, "': added twice");
  DSAKIT_CHECK_ARG(host_tensor.device == Device::kCpu, "safetensors tensor '", name,
                   "': expected a cpu tensor, got a ", to_string(host_tensor.device), " tensor");
  DSAKIT_CHECK_ARG(host_tensor.ndim >= 1 && host_tensor.is_contiguous(), "safetensors tensor '",
                   name, "': expected a contiguous tensor of rank >= 1, got shape ",
                   host_tensor.shape_str());
  DSAKIT_CHECK_ARG(host_tensor.data != nullptr || host_tensor.numel() == 0, "safetensors tensor '",
                   name, "': null data pointer");
  Entry e{
      name, host_tensor.dtype,
      std::vector<int64_t>(host_tensor.shape.begin(), host_tensor.shape.begin() + host_tensor.ndim),
      std::vector<uint8_t>(host_tensor.nbytes())};
  if (!e.bytes.empty()) std::memcpy(e.bytes.data(), host_tensor.data, e.bytes.size());
  entries_.push_back(std::move(e));
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

std::vector<uint8_t> SafetensorsWriter::serialize() const {
  std::vector<const Entry*> sorted;
  for (const Entry& e : entries_) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(),
            [](const Entry* a, const Entry* b) { return a->name < b->name; });

  // nlohmann's object keeps keys sorted, so the header text is deterministic.
  json header = json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  int64_t offset = 0;
  for (const Entry* e : sorted) {
    const int64_t end = offset + int64_t(e->bytes.size());
    header[e->name] = {{"dtype", safetensors_dtype_name(e->dtype)},
                       {"shape", e->shape},
                       {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    DSAKIT_FAIL(kInvalidArgument, "safetensors header: a name or metadata string is not valid ",
                "UTF-8 (", e.what(), ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // data region starts 8-byte aligned

  std::vector<uint8_t> out(8 + text.size() + size_t(offset));
  store_u64_le(text.size(), out.data());
  std::memcpy(out.data() + 8, text.data(), text.size());
  uint8_t* dst = out.data() + 8 + text.size();
  for (const Entry* e : sorted) {
    if (!e->bytes.empty()) std::memcpy(dst, e->bytes.data(), e->bytes.size());
    dst += e->bytes.size();
  }
  return out;
}

void SafetensorsWriter::write(const std::string& path) const {
  const std::vector<uint8_t> bytes = serialize();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  DSAKIT_CHECK(out.good(), kFormat, path, ": cannot open for writing");
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  out.close();
  DSAKIT_CHECK(out.good(), kFormat, path, ": write of ", bytes.size(), " bytes failed");
}

}  // namespace dsakit
