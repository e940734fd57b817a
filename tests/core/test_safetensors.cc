// SafetensorsFile / SafetensorsWriter: exact round trips, the peers' golden files, and one
// malformed-file case per defect the reader must name.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dsakit/error.h"
#include "dsakit/safetensors.h"
#include "tests/common/test_util.h"

namespace dsakit {
namespace {

using testing::fresh_seed;
using testing::Rng;

// A file made of an explicit header text and `data_bytes` bytes of data (value i & 0xFF).
std::vector<uint8_t> raw_file(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> out(8 + header.size() + data_bytes);
  for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(uint64_t(header.size()) >> (8 * i));
  std::memcpy(out.data() + 8, header.data(), header.size());
  for (size_t i = 0; i < data_bytes; ++i) out[8 + header.size() + i] = uint8_t(i);
  return out;
}

SafetensorsFile parse_bytes(const std::vector<uint8_t>& bytes, const std::string& origin = "t.st") {
  return SafetensorsFile::parse(bytes.data(), bytes.size(), origin);
}

// Asserts that parsing `bytes` throws Error(kFormat) whose message names the file and contains
// every string of `needles`.
void expect_format_error(const std::vector<uint8_t>& bytes, std::vector<std::string> needles) {
  try {
    parse_bytes(bytes, "bad.safetensors");
    ADD_FAILURE() << "no error; expected one mentioning '" << needles.front() << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kFormat) << e.what();
    needles.push_back("bad.safetensors");
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message '" << e.what() << "' does not mention '" << n << "'";
  }
}

void expect_format_error(const std::string& header, size_t data_bytes,
                         std::vector<std::string> needles) {
  SCOPED_TRACE(header);
  expect_format_error(raw_file(header, data_bytes), std::move(needles));
}

bool same_bytes(const TensorView& a, const TensorView& b) {
  return a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.data, b.data, a.nbytes()) == 0);
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::path(::testing::TempDir()) / name).string();
}

// ---- round trips ----------------------------------------------------------------------------

TEST(Safetensors, RoundTripEveryDtypeIsExact) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  const DType dtypes[] = {DType::kBF16, DType::kF32, DType::kF64, DType::kI32, DType::kU8};
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (DType dtype : dtypes) {
    for (int rank = 1; rank <= kMaxDims; ++rank) {
      std::vector<int64_t> shape;
      for (int d = 0; d < rank; ++d) shape.push_back(rng.randint(1, 7));
      tensors.emplace_back(std::string(to_string(dtype)) + "_r" + std::to_string(rank),
                           testing::random_tensor(rng, dtype, shape));
    }
  }
  tensors.emplace_back("empty", Tensor::host(DType::kF32, {3, 0, 2}));

  SafetensorsWriter writer;
  for (const auto& [name, t] : tensors) writer.add(name, t);
  writer.set_metadata("seed", std::to_string(seed));
  writer.set_metadata("note", "ünïcode ok");
  const std::string path = temp_path("roundtrip.safetensors");
  writer.write(path);

  const SafetensorsFile file = SafetensorsFile::read(path);
  EXPECT_EQ(file.origin(), path);
  ASSERT_EQ(file.names().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(file.has(name));
    const Tensor& got = file.get(name);
    EXPECT_EQ(got.dtype(), t.dtype());
    EXPECT_EQ(got.device(), Device::kCpu);
    EXPECT_EQ(got.view().shape_str(), t.view().shape_str());
    EXPECT_TRUE(got.view().is_contiguous());
    EXPECT_TRUE(same_bytes(got, t));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(got.view().data) % 64, 0u);
  }
  EXPECT_EQ(file.metadata().at("seed"), std::to_string(seed));
  EXPECT_EQ(file.metadata().at("note"), "ünïcode ok");
  EXPECT_EQ(file.metadata().size(), 2u);
}

TEST(Safetensors, WriterIsDeterministicAndAligned) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  const Tensor a = testing::random_tensor(rng, DType::kBF16, {5, 3});
  const Tensor b = testing::random_tensor(rng, DType::kU8, {7});
  const Tensor c = testing::random_tensor(rng, DType::kI32, {2, 2, 2});

  SafetensorsWriter forward, backward;
  forward.add("a", a);
  forward.add("b", b);
  forward.add("c", c);
  forward.set_metadata("k1", "v1");
  forward.set_metadata("k2", "v2");
  backward.set_metadata("k2", "v2");
  backward.add("c", c);
  backward.add("b", b);
  backward.set_metadata("k1", "v1");
  backward.add("a", a);
  const std::vector<uint8_t> bytes = forward.serialize();
  EXPECT_EQ(bytes, backward.serialize());

  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | bytes[size_t(i)];
  EXPECT_EQ(header_bytes % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + header_bytes + a.nbytes() + b.nbytes() + c.nbytes());
  // Data in sorted-name order right after the header.
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + header_bytes, a.ptr<uint8_t>(), a.nbytes()), 0);
  const std::string header(bytes.begin() + 8, bytes.begin() + 8 + long(header_bytes));
  EXPECT_LT(header.find("\"a\""), header.find("\"b\""));
  EXPECT_LT(header.find("\"b\""), header.find("\"c\""));
  EXPECT_NE(header.find("\"BF16\""), std::string::npos);

  const SafetensorsFile file = parse_bytes(bytes);
  EXPECT_TRUE(same_bytes(file.get("c", DType::kI32, {2, -1, 2}), c));
}

TEST(Safetensors, WriterRejectsBadTensors) {
  Tensor t = Tensor::host(DType::kF32, {4});
  SafetensorsWriter writer;
  writer.add("x", t);
  const auto expect_arg_error = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_arg_error([&] { writer.add("x", t); }, "'x': added twice");
  expect_arg_error([&] { writer.add("__metadata__", t); }, "reserved");
  TensorView on_device = t.view();
  on_device.device = Device::kCuda;
  expect_arg_error([&] { writer.add("dev", on_device); }, "'dev': expected a cpu tensor");
  TensorView strided = Tensor::host(DType::kF32, {4, 4}).view();
  strided.stride[0] = 8;
  expect_arg_error([&] { writer.add("strided", strided); }, "'strided': expected a contiguous");
  SafetensorsWriter bad_utf8;
  bad_utf8.add("\xff\xfe", t);
  expect_arg_error([&] { bad_utf8.serialize(); }, "UTF-8");
  // The rejected adds left the writer as it was.
  EXPECT_EQ(parse_bytes(writer.serialize()).names(), std::vector<std::string>{"x"});
}

TEST(Safetensors, WriteToUnwritablePathFails) {
  SafetensorsWriter writer;
  try {
    writer.write("/nonexistent-dir/x.safetensors");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kFormat);
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/x.safetensors"), std::string::npos);
  }
}

TEST(Safetensors, GetChecksNameDtypeAndShape) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  SafetensorsWriter writer;
  writer.add("q", testing::random_tensor(rng, DType::kBF16, {3, 4, 5}));
  const SafetensorsFile file = parse_bytes(writer.serialize(), "q.safetensors");
  EXPECT_EQ(file.get("q", DType::kBF16, {3, -1, 5}).size(1), 4);
  EXPECT_FALSE(file.has("k"));
  const auto expect_get_error = [&](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kFormat);
      EXPECT_NE(std::string(e.what()).find("q.safetensors"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_get_error([&] { file.get("k"); }, "no tensor named 'k'");
  expect_get_error([&] { file.get("q", DType::kF32, {3, 4, 5}); }, "got bf16 [3, 4, 5]");
  expect_get_error([&] { file.get("q", DType::kBF16, {3, 4, 6}); }, "'q': expected bf16 [3, 4, 6]");
  expect_get_error([&] { file.get("q", DType::kBF16, {3, 20}); }, "got bf16 [3, 4, 5]");
}

TEST(Safetensors, Fp8E4m3LoadsAsU8AndGapsAreAllowed) {
  // Two tensors with a 3-byte hole between them and trailing bytes after the last one.
  const auto bytes = raw_file(R"({"f8":{"dtype":"F8_E4M3","shape":[2,3],"data_offsets":[0,6]},)"
                              R"("i":{"dtype":"I32","shape":[1],"data_offsets":[9,13]}}   )",
                              20);
  const SafetensorsFile file = parse_bytes(bytes);
  const Tensor& f8 = file.get("f8", DType::kU8, {2, 3});
  for (int i = 0; i < 6; ++i) EXPECT_EQ(f8.ptr<uint8_t>()[i], i);
  int32_t expect;
  const uint8_t le[4] = {9, 10, 11, 12};
  std::memcpy(&expect, le, 4);
  EXPECT_EQ(file.get("i", DType::kI32, {1}).ptr<int32_t>()[0], expect);
  EXPECT_TRUE(file.metadata().empty());
}

TEST(Safetensors, EmptyHeaderObjectHasNoTensors) {
  const SafetensorsFile file = parse_bytes(raw_file("{}      ", 0));
  EXPECT_TRUE(file.names().empty());
}

// ---- golden files of the peers --------------------------------------------------------------

TEST(Safetensors, ReadsEveryPeerFile) {
  const std::filesystem::path dir = testing::peers_dir();
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir;
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    SCOPED_TRACE(entry.path().string());
    ++files;
    const SafetensorsFile file = SafetensorsFile::read(entry.path().string());
    EXPECT_FALSE(file.names().empty());
    EXPECT_FALSE(file.metadata().empty());
    // Re-serializing gives a file that parses to the same bytes.
    SafetensorsWriter writer;
    for (const std::string& name : file.names()) writer.add(name, file.get(name));
    for (const auto& [k, v] : file.metadata()) writer.set_metadata(k, v);
    const std::vector<uint8_t> bytes = writer.serialize();
    const SafetensorsFile again = parse_bytes(bytes);
    EXPECT_EQ(again.metadata(), file.metadata());
    for (const std::string& name : file.names())
      EXPECT_TRUE(same_bytes(again.get(name), file.get(name))) << name;
  }
  EXPECT_EQ(files, 6);
}

TEST(Safetensors, PeerFilesHaveTheDocumentedTensors) {
  const std::string dir = testing::peers_dir() + "/";
  const SafetensorsFile fp8 = SafetensorsFile::read(dir + "fp8_656_pow2.safetensors");
  fp8.get("input", DType::kBF16, {512, 576});
  fp8.get("packed", DType::kU8, {512, 656});
  fp8.get("dequantized", DType::kBF16, {512, 576});
  const Tensor& tile_kind = fp8.get("tile_kind", DType::kU8, {512, 4});
  for (int64_t i = 0; i < tile_kind.numel(); ++i) EXPECT_LE(tile_kind.ptr<uint8_t>()[i], 7);

  const SafetensorsFile prefill = SafetensorsFile::read(dir + "sparse_prefill.safetensors");
  prefill.get("q", DType::kBF16, {32, 64, 576});
  prefill.get("kv", DType::kBF16, {700, 1, 576});
  prefill.get("indices", DType::kI32, {32, 1, 256});
  const SafetensorsFile out = SafetensorsFile::read(dir + "sparse_prefill_out.safetensors");
  out.get("out", DType::kBF16, {32, 64, 512});
  out.get("lse", DType::kF32, {32, 64});
  const SafetensorsFile tl = SafetensorsFile::read(dir + "sparse_prefill_topk_length.safetensors");
  const Tensor& topk_length = tl.get("topk_length", DType::kI32, {32});
  EXPECT_EQ(topk_length.ptr<int32_t>()[0], 256);
  EXPECT_EQ(topk_length.ptr<int32_t>()[1], 0);
  EXPECT_EQ(topk_length.ptr<int32_t>()[2], 1);

  const SafetensorsFile logits = SafetensorsFile::read(dir + "indexer_logits.safetensors");
  logits.get("q_fp8", DType::kU8, {256, 64, 128});
  logits.get("k_scale", DType::kF32, {256});
  const Tensor& ks = logits.get("ks", DType::kI32, {256});
  const Tensor& ke = logits.get("ke", DType::kI32, {256});
  for (int i = 0; i < 256; ++i) {
    EXPECT_EQ(ks.ptr<int32_t>()[i], 0);
    EXPECT_EQ(ke.ptr<int32_t>()[i], i + 1);
  }

  const SafetensorsFile decode = SafetensorsFile::read(dir + "sparse_decode_fp8.safetensors");
  decode.get("q", DType::kBF16, {4, 1, 64, 576});
  decode.get("kcache", DType::kU8, {68, 64, 656});
  decode.get("block_table", DType::kI32, {4, 16});
  const Tensor& seqlens = decode.get("cache_seqlens", DType::kI32, {4});
  for (int r = 0; r < 4; ++r) EXPECT_EQ(seqlens.ptr<int32_t>()[r], 1000);
}

// ---- malformed files: one defect each -------------------------------------------------------

TEST(SafetensorsMalformed, FileShorterThanEightBytes) {
  for (size_t n : {0, 1, 7}) {
    const std::vector<uint8_t> bytes(n, 0);
    expect_format_error(bytes, {"shorter than the 8-byte header length"});
  }
}

TEST(SafetensorsMalformed, HeaderLengthBeyondFileOrLimit) {
  std::vector<uint8_t> bytes = raw_file("{}", 0);
  bytes[0] = 3;  // claims 3 header bytes, 2 present
  expect_format_error(bytes, {"header length 3 is larger than the 2 bytes"});
  for (int i = 0; i < 8; ++i) bytes[size_t(i)] = 0xFF;
  expect_format_error(bytes, {"exceeds the limit"});
  std::vector<uint8_t> huge = raw_file("{}", 0);
  huge[0] = 1;
  huge[3] = 0x07;  // 0x07000001 bytes > 100 MB
  expect_format_error(huge, {"exceeds the limit"});
}

TEST(SafetensorsMalformed, HeaderNotJsonOrNotObject) {
  expect_format_error("", 0, {"not valid JSON"});
  expect_format_error("{\"a\":", 0, {"not valid JSON"});
  expect_format_error("\xff\xfe", 0, {"not valid JSON"});
  expect_format_error("[1, 2]", 0, {"expected a JSON object, got array"});
  expect_format_error("\"x\"", 0, {"expected a JSON object, got string"});
  expect_format_error(std::string(100, '[') + std::string(100, ']'), 0, {"nests deeper"});
}

TEST(SafetensorsMalformed, MissingFields) {
  expect_format_error(R"({"t":{"shape":[1],"data_offsets":[0,4]}})", 4, {"'t'", "\"dtype\""});
  expect_format_error(R"({"t":{"dtype":"F32","data_offsets":[0,4]}})", 4, {"'t'", "\"shape\""});
  expect_format_error(R"({"t":{"dtype":"F32","shape":[1]}})", 4, {"'t'", "\"data_offsets\""});
  expect_format_error(R"({"t":[1,2]})", 4, {"'t'", "expected an object, got array"});
}

TEST(SafetensorsMalformed, IllTypedFields) {
  expect_format_error(R"({"t":{"dtype":5,"shape":[1],"data_offsets":[0,4]}})", 4,
                      {"'t'", "dtype: expected a string, got number"});
  expect_format_error(R"({"t":{"dtype":"F32","shape":"1","data_offsets":[0,4]}})", 4,
                      {"'t'", "shape: expected an array, got string"});
  expect_format_error(R"({"t":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}})", 4,
                      {"'t'", "shape[0]: expected an integer"});
  expect_format_error(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4,
                      {"'t'", "data_offsets: expected [begin, end]"});
  expect_format_error(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":{"a":1}}})", 4,
                      {"'t'", "data_offsets: expected [begin, end]"});
  expect_format_error(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,"4"]}})", 4,
                      {"'t'", "data_offsets[1]: expected an integer, got string"});
}

TEST(SafetensorsMalformed, UnsupportedDtypesNameTensorAndDtype) {
  for (const char* dtype : {"F16", "I64", "F8_E5M2", "BOOL", "bf16"}) {
    expect_format_error(
        std::string(R"({"w":{"dtype":")") + dtype + R"(","shape":[2],"data_offsets":[0,4]}})", 4,
        {"'w'", std::string("unsupported dtype \"") + dtype + "\""});
  }
}

TEST(SafetensorsMalformed, BadRanksAndShapes) {
  expect_format_error(R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})", 4,
                      {"'s'", "rank 0"});
  expect_format_error(R"({"s":{"dtype":"U8","shape":[1,1,1,1,1],"data_offsets":[0,1]}})", 1,
                      {"'s'", "rank 5"});
  expect_format_error(R"({"s":{"dtype":"F32","shape":[-2],"data_offsets":[0,4]}})", 4,
                      {"'s'", "shape[0]: expected >= 0, got -2"});
  expect_format_error(
      R"({"s":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,4]}})", 4,
      {"'s'", "overflows int64"});
  expect_format_error(
      R"({"s":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4,
      {"'s'", "overflows int64 bytes"});
  // numel fits but numel * sizeof(f64) does not.
  expect_format_error(R"({"s":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,8]}})",
                      8, {"'s'", "overflows int64 bytes"});
  // An empty tensor whose other extents still overflow.
  expect_format_error(
      R"({"s":{"dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})", 0,
      {"'s'", "overflows int64 bytes"});
}

TEST(SafetensorsMalformed, BadDataOffsets) {
  expect_format_error(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 8,
                      {"'t'", "outside the data region of 8 bytes"});
  expect_format_error(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8,
                      {"'t'", "end 4 < begin 8"});
  expect_format_error(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", 8,
                      {"'t'", "data_offsets[0]: expected >= 0"});
  expect_format_error(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 16,
                      {"'t'", "span 8 bytes", "needs 12"});
  expect_format_error(R"({"t":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})", 16,
                      {"'t'", "span 8 bytes", "needs 4"});
}

TEST(SafetensorsMalformed, OverlappingTensors) {
  expect_format_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                      12, {"'a'", "'b'", "overlap"});
  expect_format_error(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                      R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                      4, {"overlap"});
}

// An empty tensor name is refused on read because the writer refuses it: every accepted file
// must survive a write/parse round trip (fuzz_safetensors' seed corpus holds this input).
TEST(SafetensorsMalformed, EmptyTensorName) {
  expect_format_error(R"({"":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 16,
                      {"a tensor has an empty name"});
}

TEST(SafetensorsMalformed, DuplicateNames) {
  expect_format_error(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                      R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                      2, {"duplicate key \"a\""});
  expect_format_error(R"({"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1,
                      {"duplicate key \"dtype\""});
}

TEST(SafetensorsMalformed, MetadataNotStringToString) {
  expect_format_error(R"({"__metadata__":["a"]})", 0, {"__metadata__: expected an object"});
  expect_format_error(R"({"__metadata__":{"seed":1}})", 0,
                      {"__metadata__[\"seed\"]: expected a string, got number"});
  expect_format_error(R"({"__metadata__":{"a":{"b":"c"}}})", 0,
                      {"__metadata__[\"a\"]: expected a string, got object"});
}

TEST(SafetensorsMalformed, MissingFileNamesThePath) {
  try {
    SafetensorsFile::read("/nonexistent/file.safetensors");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kFormat);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/file.safetensors"), std::string::npos);
  }
}

// Every strict prefix of a valid file is rejected with kFormat and never read out of bounds
// (the ASan build checks the latter).
TEST(SafetensorsMalformed, EveryTruncationIsRejected) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  SafetensorsWriter writer;
  writer.add("a", testing::random_tensor(rng, DType::kF32, {3, 2}));
  writer.add("b", testing::random_tensor(rng, DType::kU8, {5}));
  writer.set_metadata("m", "v");
  const std::vector<uint8_t> bytes = writer.serialize();
  for (size_t n = 0; n < bytes.size(); ++n) {
    // A heap copy of exactly n bytes so ASan catches any read past the end.
    std::vector<uint8_t> prefix(bytes.begin(), bytes.begin() + long(n));
    try {
      SafetensorsFile::parse(prefix.data(), prefix.size(), "cut");
      ADD_FAILURE() << "prefix of " << n << " bytes accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kFormat) << e.what();
    }
  }
}

}  // namespace
}  // namespace dsakit
