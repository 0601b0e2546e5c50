// Checkpoint files (<dptrain/train/checkpoint.hpp>): bit-exact round trips, files from other
// safetensors writers, every malformed file refused with one line naming the file and
// the problem (every truncation and thousands of random mutations included), saves
// that fail half-way leaving the previous checkpoint loadable and no temporary file, and
// a CNN's weights and running statistics resumed bit-identically.
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>

#include <dptrain/error.hpp>
#include <dptrain/train/checkpoint.hpp>
#include <dptrain/train/trainer.hpp>
#include "catch.hpp"
#include "common.hpp"
#include "data/safetensors.hpp"

using namespace dpt;
namespace fs = std::filesystem;

namespace {

// Sets an environment variable for the scope of the object.
struct ScopedEnv {
  const char* name;
  ScopedEnv(const char* n, const std::string& value) : name(n) { ::setenv(name, value.c_str(), 1); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() { ::unsetenv(name); }
};

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A file: the 8-byte little-endian length of `header`, `header`, then `data` zero bytes.
std::vector<uint8_t> file_of(const std::string& header, size_t data = 0, uint64_t length = UINT64_MAX) {
  if (length == UINT64_MAX) length = header.size();
  std::vector<uint8_t> b;
  for (int i = 0; i < 8; ++i) b.push_back(static_cast<uint8_t>(length >> (8 * i)));
  b.insert(b.end(), header.begin(), header.end());
  b.resize(b.size() + data, 0);
  return b;
}

// The header length in a file's first 8 bytes (little-endian).
uint64_t header_length_of(const std::vector<uint8_t>& bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | bytes[static_cast<size_t>(i)];
  return n;
}

template <class T>
ckpt::HostTensor tensor(ckpt::DType dtype, std::vector<int64_t> shape, const std::vector<T>& values) {
  return ckpt::make_tensor(dtype, std::move(shape), values.data());
}

ckpt::Checkpoint sample() {
  ckpt::Checkpoint c;
  c.metadata = {{"step", "10"},
                {"model", "16-128x2-4"},
                {"empty", ""},
                {"quote\" back\\slash", "line\nbreak \x01 \xc3\xa9 \xe2\x9c\x93"}};
  const uint32_t nan_payload = 0x7fc00123;
  float nan;
  std::memcpy(&nan, &nan_payload, 4);
  c.tensors.emplace_back("layers.0.weight",
                         tensor(ckpt::DType::f32, {2, 4},
                                std::vector<float>{1.5f, -0.0f, INFINITY, -INFINITY, nan, 1e-45f, 3.4e38f, 0.1f}));
  c.tensors.emplace_back("bf16", tensor(ckpt::DType::bf16, {4}, std::vector<uint16_t>{0x3f80, 0xbf80, 0x7fc1, 1}));
  c.tensors.emplace_back("ints",
                         tensor(ckpt::DType::i32, {3, 2}, std::vector<int32_t>{INT32_MIN, -1, 0, INT32_MAX, 7, 9}));
  c.tensors.emplace_back("scalar", tensor(ckpt::DType::f32, {}, std::vector<float>{42.0f}));
  c.tensors.emplace_back("none", tensor(ckpt::DType::f32, {0, 3}, std::vector<float>{}));
  return c;
}

void check_equal(const ckpt::Checkpoint& a, const ckpt::Checkpoint& b) {
  CHECK(a.metadata == b.metadata);
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    INFO("tensor " << a.tensors[i].first);
    CHECK(a.tensors[i].first == b.tensors[i].first);
    CHECK(a.tensors[i].second.dtype == b.tensors[i].second.dtype);
    CHECK(a.tensors[i].second.shape == b.tensors[i].second.shape);
    CHECK(a.tensors[i].second.data == b.tensors[i].second.data);  // bit for bit
  }
}

// The message load() gives for a file of `bytes` ("" when it loads); parse() on the same
// bytes must say the same.
std::string error_of(const std::string& path, const std::vector<uint8_t>& bytes) {
  write_file(path, bytes);
  std::string from_file, from_memory;
  try {
    ckpt::load(path);
  } catch (const Error& e) {
    from_file = e.what();
  }
  try {
    ckpt::parse(bytes.data(), bytes.size(), path);
  } catch (const Error& e) {
    from_memory = e.what();
  }
  CHECK(from_file == from_memory);
  return from_file;
}

// load(path) is refused with one line "checkpoint 'PATH': ..." that contains `problem`.
void check_refused(const std::string& path, const std::string& problem) {
  std::string msg;
  try {
    ckpt::load(path);
  } catch (const Error& e) {
    msg = e.what();
  }
  test::check_one_line(msg, "checkpoint '" + path + "': ", problem);
}

// sample() saved as run.safetensors in a fresh folder.
struct SavedSample {
  test::TempDir dir;
  const std::string path = dir.file("run.safetensors");
  const ckpt::Checkpoint sample = ::sample();
  SavedSample() { ckpt::save(path, sample); }
};

// "1,1,...,1", n times: a shape of n dimensions.
std::string ones(int n) {
  std::string s = "1";
  for (int i = 1; i < n; ++i) s += ",1";
  return s;
}

const std::string kTensorW = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

}  // namespace

TEST_CASE("a checkpoint round-trips bit for bit, in a deterministic file", "[checkpoint]") {
  const SavedSample saved;
  check_equal(ckpt::load(saved.path), saved.sample);
  const std::vector<uint8_t> bytes = read_file(saved.path);
  check_equal(ckpt::parse(bytes.data(), bytes.size(), "memory"), saved.sample);
  CHECK(saved.dir.entries() == std::vector<std::string>{"run.safetensors"});

  // 8-byte little-endian header length; the header is padded with spaces so that the
  // data starts 8-byte aligned.
  const uint64_t n = header_length_of(bytes);
  CHECK(n % 8 == 0);
  REQUIRE(bytes.size() > 8 + n);
  CHECK(bytes[8] == '{');
  size_t json_end = 8 + n;
  while (bytes[json_end - 1] == ' ') --json_end;
  CHECK(bytes[json_end - 1] == '}');
  CHECK(8 + n - json_end < 8);

  ckpt::save(saved.path, saved.sample);  // the same checkpoint gives the same bytes
  CHECK(read_file(saved.path) == bytes);

  ckpt::Checkpoint other = sample();
  other.metadata["step"] = "20";
  other.tensors.pop_back();
  ckpt::save(saved.path, other);  // replaces the old file
  check_equal(ckpt::load(saved.path), other);

  REQUIRE(saved.sample.find("ints") != nullptr);
  CHECK(saved.sample.find("ints")->shape == std::vector<int64_t>{3, 2});
  CHECK(saved.sample.find("missing") == nullptr);

  ckpt::save(saved.path, ckpt::Checkpoint{});  // nothing at all is a valid file too
  CHECK(ckpt::load(saved.path).tensors.empty());
}

TEST_CASE("files from other safetensors writers load", "[checkpoint]") {
  test::TempDir dir;
  const std::string path = dir.file("other.safetensors");
  // Keys in any order against the offsets, whitespace inside, padding of either kind
  // after the object, a scalar, empty tensors sharing an offset, and escapes.
  const std::string header =
      "{ \"b\" : {\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[4,8]},\n"
      "\t\"a\":{\"data_offsets\":[0,4],\"shape\":[],\"dtype\":\"F32\"},"
      "\"e0\":{\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[4,4]},"
      "\"e1\":{\"dtype\":\"F32\",\"shape\":[3,0],\"data_offsets\":[4,4]},"
      "\"__metadata__\":{\"k\\u00e9\\ud83d\\ude00\":\"\\\"\\\\\\/\\b\\f\\n\\r\\t\"}}  \n ";
  std::vector<uint8_t> bytes = file_of(header, 8);
  bytes[8 + header.size() + 4] = 5;
  CHECK(error_of(path, bytes).empty());
  const ckpt::Checkpoint c = ckpt::load(path);
  REQUIRE(c.tensors.size() == 4);
  CHECK(c.tensors[0].first == "b");  // header order
  CHECK(c.tensors[0].second.data == std::vector<uint8_t>{5, 0, 0, 0});
  CHECK(c.tensors[1].second.shape.empty());
  CHECK(c.tensors[2].second.dtype == ckpt::DType::bf16);
  CHECK(c.tensors[3].second.shape == std::vector<int64_t>{3, 0});
  CHECK(c.metadata == std::map<std::string, std::string>{{"k\xc3\xa9\xf0\x9f\x98\x80", "\"\\/\b\f\n\r\t"}});

  CHECK(error_of(path, file_of("{}")).empty());
  CHECK(error_of(path, file_of(R"({"__metadata__":{}})")).empty());
}

TEST_CASE("xxh64 gives xxHash's digests, whole or a piece at a time", "[checkpoint]") {
  namespace sft = data::safetensors;
  auto of = [](const std::string& s) { return sft::xxh64(reinterpret_cast<const uint8_t*>(s.data()), s.size()); };
  // The reference implementation's (xxhsum -H1; its README's example for the last).
  CHECK(of("") == 0xef46db3751d8e999ull);
  CHECK(of("a") == 0xd24ec4f1a98c6e5bull);
  CHECK(of("abc") == 0x44bc2cf5ad770999ull);
  CHECK(of("Nobody inspects the spammish repetition") == 0xfbcea83c8a378bf1ull);
  std::vector<uint8_t> bytes(1000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  for (size_t n : {0, 5, 31, 32, 33, 64, 100, 1000})
    for (size_t piece : {1, 3, 31, 32, 33, 500}) {
      sft::Xxh64 h;
      for (size_t at = 0; at < n; at += piece) h.update(bytes.data() + at, std::min(piece, n - at));
      CHECK(h.digest() == sft::xxh64(bytes.data(), n));
    }
}

namespace {
// `bytes` with byte `at` of tensor `name`'s data XORed with `mask`.
std::vector<uint8_t> flipped(const std::vector<uint8_t>& bytes, const ckpt::Checkpoint& c, const std::string& name,
                             size_t at, uint8_t mask) {
  const uint64_t n = header_length_of(bytes);
  size_t offset = 8 + n;
  for (const auto& [other, t] : c.tensors) {  // save() writes the tensors in order
    if (other == name) break;
    offset += t.data.size();
  }
  std::vector<uint8_t> out = bytes;
  out[offset + at] ^= mask;
  return out;
}
}  // namespace

TEST_CASE("every tensor's checksum is saved and checked on every load", "[checkpoint]") {
  const SavedSample saved;
  const ckpt::Checkpoint back = ckpt::load(saved.path);
  CHECK(back.checksummed);
  check_equal(back, saved.sample);  // the checksums are the file's, not the caller's metadata
  const std::vector<uint8_t> good = read_file(saved.path);
  const std::string text(good.begin(), good.end());
  CHECK(text.find("\"checksum:layers.0.weight\":\"xxh64:") != std::string::npos);

  // One bit of an exponent, anywhere in the data: refused, naming the file and the tensor
  // (load and parse alike).
  const std::string bad = saved.dir.file("bad.safetensors");
  CHECK(error_of(bad, flipped(good, saved.sample, "layers.0.weight", 3, 0x40))
            .rfind("checkpoint '" + bad + "': tensor 'layers.0.weight' does not match its checksum (", 0) == 0);
  CHECK(
      error_of(bad, flipped(good, saved.sample, "ints", 23, 0x01)).find("tensor 'ints' does not match its checksum") !=
      std::string::npos);

  // The checksums must be whole: one for each tensor, of the known form, of no other tensor.
  const uint64_t n = header_length_of(good);
  auto edited = [&](const std::string& from, const std::string& to) {  // the header edited, the data as it was
    std::string h = text.substr(8, n);
    const size_t at = h.find(from);
    REQUIRE(at != std::string::npos);
    h.replace(at, from.size(), to);
    std::vector<uint8_t> out = file_of(h);
    out.insert(out.end(), good.begin() + static_cast<std::ptrdiff_t>(8 + n), good.end());
    return out;
  };
  CHECK(error_of(bad, edited("\"checksum:ints\"", "\"checksum:other\""))
            .find("has a checksum of 'other', a tensor the file does not hold") != std::string::npos);
  CHECK(error_of(bad, edited("\"checksum:ints\":\"xxh64:", "\"checksum:ints\":\"crc32:"))
            .find("the checksum of tensor 'ints' is 'crc32:") != std::string::npos);
  CHECK(error_of(bad, edited("\"checksum:ints\"", "\"ints-sum\"")).find("tensor 'ints' has no checksum") !=
        std::string::npos);
  // A key of the checksums' form is not the caller's to give.
  ckpt::Checkpoint own = sample();
  own.metadata["checksum:ints"] = "xxh64:0000000000000000";
  CHECK_THROWS_AS(ckpt::save(bad, own), UsageError);

  // A file without checksums (written before dptrain kept them, or by another writer)
  // loads, and says so.
  const std::string plain = saved.dir.file("plain.safetensors");
  write_file(plain,
             file_of(R"({"__metadata__":{"step":"1"},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4));
  const ckpt::Checkpoint old = ckpt::load(plain);
  CHECK_FALSE(old.checksummed);
  CHECK(old.metadata == std::map<std::string, std::string>{{"step", "1"}});

  // A file large enough to be hashed beside its reads (over 32 MiB) is checked as well,
  // its last tensor (the last piece hashed) included.
  ckpt::Checkpoint large;
  const std::vector<float> values(size_t{5} << 20, 0.5f);  // 20 MiB a tensor
  large.tensors.emplace_back("a", tensor(ckpt::DType::f32, {int64_t(values.size())}, values));
  large.tensors.emplace_back("empty", tensor(ckpt::DType::f32, {0}, std::vector<float>{}));
  large.tensors.emplace_back("b", tensor(ckpt::DType::f32, {int64_t(values.size())}, values));
  const std::string big = saved.dir.file("big.safetensors");
  ckpt::save(big, large);
  CHECK(ckpt::load(big).checksummed);
  const std::vector<uint8_t> big_bytes = read_file(big);
  write_file(bad, flipped(big_bytes, large, "b", values.size() * 4 - 1, 0x80));
  check_refused(bad, "tensor 'b' does not match its checksum");
  write_file(bad, flipped(big_bytes, large, "a", 9 << 20, 0x01));  // in its second piece
  check_refused(bad, "tensor 'a' does not match its checksum");
}

TEST_CASE("malformed checkpoints are refused with the file and the problem named", "[checkpoint]") {
  test::TempDir dir;
  const std::string path = dir.file("bad.safetensors");

  SECTION("files that are not there or not files") {
    check_refused(dir.file("missing.safetensors"), "cannot open: No such file or directory");
    check_refused(dir.path.string(), "not a regular file");
    const std::string fifo = dir.file("fifo");
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    check_refused(fifo, "not a regular file");  // and does not wait for a writer
  }

  SECTION("headers whose length is wrong") {
    struct Case {
      std::vector<uint8_t> bytes;
      std::string problem;
    };
    const std::vector<Case> cases = {
        {{}, "file is 0 bytes, too short for the 8-byte header length"},
        {{2, 0, 0, 0, 0, 0, 0}, "file is 7 bytes, too short"},
        {file_of("{}", 0, 3), "header length 3 runs past the end of the file (10 bytes)"},
        {file_of("{}", 0, 100'000'001), "header length 100000001 is over the limit of 100000000 bytes"},
        {file_of("{}", 0, UINT64_MAX - 1), "is over the limit"},
    };
    for (const auto& c : cases) {
      INFO("expect: " << c.problem);
      write_file(path, c.bytes);
      check_refused(path, c.problem);
      CHECK(error_of(path, c.bytes).find(c.problem) != std::string::npos);
    }
  }

  SECTION("headers that are not safetensors JSON") {
    struct Case {
      std::string header;
      size_t data;
      std::string problem;
    };
    const std::string w = kTensorW;
    const std::string json = "invalid header JSON at byte ";
    const std::vector<Case> cases = {
        // not an object, or not JSON
        {"[]", 0, "header is not a JSON object (it must start with '{')"},
        {" {}", 0, "header is not a JSON object"},
        {"null", 0, "header is not a JSON object"},
        {"", 0, "header is not a JSON object"},
        {"{", 0, json + "9: expected a string key"},
        {"{\"w\":", 0, "tensor 'w': not an object"},
        {"{\"w\" {}}", 0, json + "13: expected ':'"},
        {"{'w':{}}", 0, "expected a string key"},
        {"{" + w + ",}", 8, "expected a string key"},
        {"{" + w + " " + w + "}", 8, "expected ',' or '}'"},
        {"{" + w + "} x", 8, "unexpected bytes after the header object"},
        {"{" + w + std::string("}\0", 2), 8, "unexpected bytes after the header object"},
        {"{" + w + "}}", 8, "unexpected bytes after the header object"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2 2]", 0, "expected ',' or ']'"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[02],\"data_offsets\":[0,8]}}", 8, "number with a leading zero"},
        // strings
        {"{\"abc", 0, "unterminated string"},
        {"{\"abc\\", 0, "unterminated string"},
        {"{\"a\x01\":1}", 0, "control character in a string"},
        {"{\"a\tb\":1}", 0, "control character in a string"},
        {"{\"\xff\":1}", 0, "invalid UTF-8 in a string"},
        {"{\"\xc0\xaf\":1}", 0, "invalid UTF-8"},          // overlong '/'
        {"{\"\xed\xa0\x80\":1}", 0, "invalid UTF-8"},      // a surrogate, UTF-8 encoded
        {"{\"\xf4\x90\x80\x80\":1}", 0, "invalid UTF-8"},  // past U+10FFFF
        {"{\"\xe2\x9c\":1}", 0, "invalid UTF-8"},          // cut short
        {"{\"\\q\":1}", 0, "invalid escape in a string"},
        {"{\"\\u12\":1}", 0, "invalid \\u escape"},
        {"{\"\\u12", 0, "truncated \\u escape"},
        {"{\"\\ud800\":1}", 0, "unpaired UTF-16 surrogate"},
        {"{\"\\ud800\\u0041\":1}", 0, "unpaired UTF-16 surrogate"},
        {"{\"\\udc00\":1}", 0, "unpaired UTF-16 surrogate"},
        // dtype
        {R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8,
         "tensor 'w': unsupported dtype 'F64' (dptrain reads F32, BF16 and I32)"},
        {R"({"w":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})", 8, "unsupported dtype 'f32'"},
        {R"({"w":{"dtype":32,"shape":[2],"data_offsets":[0,8]}})", 8, "tensor 'w': dtype is not a string"},
        // shape
        {R"({"w":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", 8,
         "tensor 'w': shape is not a list of at most 64 non-negative integers"},
        {R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "shape is not a list"},
        {R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8, "shape is not a list"},
        {R"({"w":{"dtype":"F32","shape":[2e0],"data_offsets":[0,8]}})", 8, "shape is not a list"},
        {R"({"w":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", 8, "shape is not a list"},
        {R"({"w":{"dtype":"F32","shape":[true],"data_offsets":[0,8]}})", 8, "shape is not a list"},
        {R"({"w":{"dtype":"F32","shape":[null],"data_offsets":[0,8]}})", 8, "shape is not a list"},
        {R"({"w":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,8]}})", 8, "shape is not a list"},
        {R"({"w":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,8]}})", 8, "shape is not a list"},
        {R"({"w":{"dtype":"F32","shape":[)" + ones(65) + R"(],"data_offsets":[0,4]}})", 4,
         "shape is not a list of at most 64"},
        {R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8,
         "tensor 'w': shape [4294967296, 4294967296] has too many elements"},
        {R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}})", 0, "has too many elements"},
        {R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8,
         "tensor 'w': shape [3] of F32 does not fit data_offsets [0, 8] (8 bytes)"},
        {R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})", 8, "shape [2] of BF16 does not fit"},
        {R"({"w":{"dtype":"I32","shape":[],"data_offsets":[0,8]}})", 8, "shape [] of I32 does not fit"},
        {R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[0,8]}})", 8, "shape [0] of F32 does not fit"},
        // data_offsets
        {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8,
         "tensor 'w': data_offsets [8, 0] begin after they end"},
        {R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8,
         "tensor 'w': data_offsets [0, 16] run past the end of the data (8 bytes)"},
        {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551608,18446744073709551615]}})", 8,
         "run past the end of the data"},
        {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8,
         "tensor 'w': data_offsets is not [begin, end] (two non-negative integers)"},
        {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", 8, "data_offsets is not [begin, end]"},
        {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-1,8]}})", 8, "data_offsets is not [begin, end]"},
        {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":"0,8"}})", 8, "data_offsets is not [begin, end]"},
        // the data is covered exactly: no overlap, no hole, nothing after the last tensor
        {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
         12, "tensors 'a' and 'b' overlap"},
        {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
         8, "tensors 'a' and 'b' overlap"},
        {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
         12, "data bytes 4 to 8 belong to no tensor"},
        {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12, "data bytes 0 to 4 belong to no tensor"},
        {"{" + w + "}", 12, "data bytes 8 to 12 (the end of the file) belong to no tensor"},
        {"{}", 1, "data bytes 0 to 1 (the end of the file) belong to no tensor"},
        // names, fields and metadata
        {"{" + w + "," + w + "}", 8, "duplicate tensor name 'w'"},
        {R"({"w":[0,8]})", 8, "tensor 'w': not an object with dtype, shape and data_offsets"},
        {R"({"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8,
         "tensor 'w': duplicate field 'dtype'"},
        {R"({"w":{"shape":[2],"data_offsets":[0,8]}})", 8, "tensor 'w': no dtype"},
        {R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", 8, "tensor 'w': no shape"},
        {R"({"w":{"dtype":"F32","shape":[2]}})", 8, "tensor 'w': no data_offsets"},
        {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"offsets":[0,8]}})", 8,
         "tensor 'w': unknown field 'offsets'"},
        {R"({"__metadata__":[]})", 0, "__metadata__ is not an object of strings"},
        {R"({"__metadata__":"step=1"})", 0, "__metadata__ is not an object of strings"},
        {R"({"__metadata__":{"step":1}})", 0, "__metadata__ value of 'step' is not a string"},
        {R"({"__metadata__":{"step":null}})", 0, "__metadata__ value of 'step' is not a string"},
        {R"({"__metadata__":{"step":{"v":"1"}}})", 0, "__metadata__ value of 'step' is not a string"},
        {R"({"__metadata__":{"k":"1","k":"2"}})", 0, "duplicate __metadata__ key 'k'"},
        {R"({"__metadata__":{},"__metadata__":{}})", 0, "duplicate __metadata__"},
        // names from the file are escaped in the message, which stays one line
        {R"({"a\nb":1})", 0, "tensor 'a\\x0ab': not an object"},
        {"{\"" + std::string(200, 'n') + "\":1}", 0, "tensor '" + std::string(80, 'n') + "...': not an object"},
    };
    for (const auto& c : cases) {
      INFO("header: " << c.header);
      INFO("expect: " << c.problem);
      const std::string msg = error_of(path, file_of(c.header, c.data));
      CHECK(msg.rfind("checkpoint '" + path + "': ", 0) == 0);
      CHECK(msg.find(c.problem) != std::string::npos);
      CHECK(msg.find('\n') == std::string::npos);
    }
  }
}

TEST_CASE("every truncation of a valid checkpoint is refused cleanly", "[checkpoint]") {
  test::TempDir dir;
  const std::string path = dir.file("whole.safetensors");
  ckpt::save(path, sample());
  const std::vector<uint8_t> whole = read_file(path);
  const std::string cut = dir.file("cut.safetensors");
  for (size_t len = 0; len < whole.size(); ++len) {
    INFO("first " << len << " of " << whole.size() << " bytes");
    // An exact-size copy, so that a read past the end is caught by the sanitizers.
    const std::vector<uint8_t> prefix(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(len));
    const std::string msg = error_of(cut, prefix);
    CHECK(msg.rfind("checkpoint '" + cut + "': ", 0) == 0);
  }
}

TEST_CASE("random mutations of a checkpoint either load or are refused", "[checkpoint]") {
  test::TempDir dir;
  const std::string path = dir.file("seed.safetensors");
  ckpt::save(path, sample());
  const std::vector<uint8_t> good = read_file(path);
  const uint64_t header = header_length_of(good);
  auto mutate = [&](std::vector<uint8_t>& bytes, std::mt19937_64& rng) {
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      // Mostly in the length and the header, where the parsing is.
      const size_t span = rng() % 8 < 7 ? 8 + header : bytes.size();
      const size_t at = rng() % span;
      if (rng() % 2) bytes[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
      else bytes[at] = static_cast<uint8_t>(rng());
    }
  };
  test::check_mutants<Error>(good, 6, 4000, "checkpoint 'mutant': ", mutate, [](const std::vector<uint8_t>& bytes) {
    const ckpt::Checkpoint c = ckpt::parse(bytes.data(), bytes.size(), "mutant");
    for (const auto& named : c.tensors) {  // what loads is consistent with its header
      int64_t n = 1;
      for (int64_t d : named.second.shape) n *= d;
      CHECK(named.second.data.size() == static_cast<size_t>(n) * ckpt::dtype_size(named.second.dtype));
    }
  });
}

TEST_CASE("a save that fails half-way leaves the previous checkpoint and no temporary file", "[checkpoint]") {
  const SavedSample saved;
  ckpt::Checkpoint after = sample();
  after.metadata["step"] = "20";
  after.tensors.emplace_back("big", tensor(ckpt::DType::f32, {1024}, std::vector<float>(1024, 2.0f)));
  uint64_t total = 0;  // the size of the new file
  {
    test::TempDir other;
    ckpt::save(other.file("x"), after);
    total = fs::file_size(other.file("x"));
  }

  SECTION("an injected full disk, at any point of the file") {
    for (uint64_t room : {uint64_t{0}, uint64_t{1}, uint64_t{7}, uint64_t{8}, uint64_t{100}, total / 2, total - 1}) {
      INFO("room for " << room << " bytes");
      std::string msg;
      {
        ScopedEnv fault("DPT_CKPT_FAIL_AFTER_BYTES", std::to_string(room));
        try {
          ckpt::save(saved.path, after);
        } catch (const Error& e) {
          msg = e.what();
        }
      }
      INFO("message: " << msg);
      CHECK(msg.rfind("checkpoint '" + saved.path + "': writing failed after " + std::to_string(room) + " of ", 0) ==
            0);
      CHECK(msg.find("No space left on device (injected by DPT_CKPT_FAIL_AFTER_BYTES)") != std::string::npos);
      CHECK(msg.find("any previous checkpoint there is unchanged") != std::string::npos);
      check_equal(ckpt::load(saved.path), saved.sample);
      CHECK(saved.dir.entries() == std::vector<std::string>{"run.safetensors"});
    }
    // With no previous file, nothing is left at all.
    {
      ScopedEnv fault("DPT_CKPT_FAIL_AFTER_BYTES", "100");
      CHECK_THROWS_AS(ckpt::save(saved.dir.file("fresh.safetensors"), after), Error);
    }
    CHECK(saved.dir.entries() == std::vector<std::string>{"run.safetensors"});
    // Room enough: the save goes through.
    {
      ScopedEnv fault("DPT_CKPT_FAIL_AFTER_BYTES", std::to_string(total));
      ckpt::save(saved.path, after);
    }
    check_equal(ckpt::load(saved.path), after);
  }

  SECTION("a bad fault setting is refused before anything is written") {
    ScopedEnv fault("DPT_CKPT_FAIL_AFTER_BYTES", "lots");
    CHECK_THROWS_AS(ckpt::save(saved.path, after), Error);
    check_equal(ckpt::load(saved.path), saved.sample);
    CHECK(saved.dir.entries() == std::vector<std::string>{"run.safetensors"});
  }

  SECTION("a real short write: the file-size limit cuts the file") {
    // RLIMIT_FSIZE makes write() stop at the limit and then fail with EFBIG, as a full
    // disk does with ENOSPC; it binds root too, and SIGXFSZ is ignored so the process
    // lives on to see the error.
    rlimit old{};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
    if (old.rlim_cur == RLIM_INFINITY || old.rlim_cur > 8192) {
      auto* const old_handler = ::signal(SIGXFSZ, SIG_IGN);
      rlimit small = old;
      small.rlim_cur = 2048;
      REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
      std::string msg;
      try {
        ckpt::save(saved.path, after);
      } catch (const Error& e) {
        msg = e.what();
      }
      ::setrlimit(RLIMIT_FSIZE, &old);
      ::signal(SIGXFSZ, old_handler);
      INFO("message: " << msg);
      CHECK(msg.rfind("checkpoint '" + saved.path + "': writing failed after 2048 of ", 0) == 0);
      CHECK(msg.find("File too large") != std::string::npos);
      check_equal(ckpt::load(saved.path), saved.sample);
      CHECK(saved.dir.entries() == std::vector<std::string>{"run.safetensors"});
    }
  }

  SECTION("a folder that does not exist") {
    const std::string nowhere = saved.dir.file("no/such/folder/run.safetensors");
    std::string msg;
    try {
      ckpt::save(nowhere, after);
    } catch (const Error& e) {
      msg = e.what();
    }
    CHECK(msg.rfind("checkpoint '" + nowhere + "': cannot create '" + nowhere + ".tmp", 0) == 0);
    CHECK(msg.find("No such file or directory") != std::string::npos);
  }

  SECTION("a folder, a FIFO or a device node in the way: never replaced") {
    const std::string folder = saved.dir.file("folder.safetensors");
    fs::create_directory(folder);
    std::string msg;
    try {
      ckpt::save(folder, after);
    } catch (const Error& e) {
      msg = e.what();
    }
    INFO("message: " << msg);
    CHECK(msg == "checkpoint '" + folder + "': is a folder; only a regular file is replaced");
    CHECK(fs::is_directory(folder));
    const std::string fifo = saved.dir.file("fifo.safetensors");
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    auto refusal = [&](const std::string& target) {
      try {
        ckpt::save(target, after);
      } catch (const Error& e) {
        return std::string(e.what());
      }
      return std::string("(saved)");
    };
    CHECK(refusal(fifo) == "checkpoint '" + fifo + "': is a FIFO; only a regular file is replaced");
    CHECK(fs::is_fifo(fifo));
    // A symlink to the FIFO is followed, and the FIFO still refused.
    const std::string link = saved.dir.file("link.safetensors");
    fs::create_symlink(fifo, link);
    CHECK(refusal(link) == "checkpoint '" + link + "': is a FIFO; only a regular file is replaced");
    CHECK(fs::is_symlink(link));
    CHECK(saved.dir.entries() ==
          std::vector<std::string>{"fifo.safetensors", "folder.safetensors", "link.safetensors", "run.safetensors"});
  }
}

TEST_CASE("save refuses what load would refuse, and writes nothing", "[checkpoint]") {
  test::TempDir dir;
  const std::string path = dir.file("run.safetensors");
  auto refused = [&](const ckpt::Checkpoint& c, const std::string& problem) {
    std::string msg;
    try {
      ckpt::save(path, c);
    } catch (const UsageError& e) {  // the caller's Checkpoint
      msg = e.what();
    }
    INFO("message: " << msg);
    CHECK(msg.rfind("checkpoint '" + path + "': ", 0) == 0);
    CHECK(msg.find(problem) != std::string::npos);
    CHECK(dir.entries().empty());
  };
  const ckpt::HostTensor one = tensor(ckpt::DType::f32, {1}, std::vector<float>{1.0f});
  ckpt::Checkpoint c;
  c.tensors = {{"a", one}, {"a", one}};
  refused(c, "tensor 'a': duplicate name");
  c.tensors = {{"__metadata__", one}};
  refused(c, "the name is reserved for metadata");
  c.tensors = {{"\xff", one}};
  refused(c, "the name is not valid UTF-8");
  c.tensors = {{"a", ckpt::HostTensor{ckpt::DType::f32, {2}, {0, 0, 0, 0}}}};
  refused(c, "tensor 'a': 4 bytes of data for shape [2] of F32");
  c.tensors = {{"a", ckpt::HostTensor{ckpt::DType::f32, {-1}, {}}}};
  refused(c, "tensor 'a': invalid shape [-1]");
  c.tensors = {{"a", ckpt::HostTensor{ckpt::DType::f32, std::vector<int64_t>(65, 1), {0, 0, 0, 0}}}};
  refused(c, "more than 64 dimensions");
  c.tensors.clear();
  c.metadata = {{"k", "\xc3"}};
  refused(c, "__metadata__ value of 'k' is not valid UTF-8");
  c.metadata = {{"\xc3", "v"}};
  refused(c, "__metadata__ key '\\xc3' is not valid UTF-8");  // the message stays text
  // Names in messages: control bytes and bytes that are no UTF-8 escaped, UTF-8 kept, long
  // ones cut at a whole character.
  CHECK(ckpt::printable("a\nb \xc3\xa9 \xff\xc3 z") == "'a\\x0ab \xc3\xa9 \\xff\\xc3 z'");
  CHECK(ckpt::printable(std::string(79, 'x') + "\xc3\xa9") == "'" + std::string(79, 'x') + "...'");
  CHECK_THROWS_AS(ckpt::make_tensor(ckpt::DType::i32, {2, -1}, nullptr), Error);
}

// Trains `c` for 6 steps, and again as 3 steps saved to `path` and 3 resumed from it, with
// SGD and AdamW on 1 and 2 CPU devices: the resumed run must end bit for bit where the
// uninterrupted one did. `check_saved` looks at the half-way checkpoint, `check_resumed`
// at the resumed trainer (before its run, and after it with the uninterrupted one).
void check_resume(TrainConfig c, const std::string& path,
                  const std::function<void(const ckpt::Checkpoint&, const std::string& optimizer)>& check_saved,
                  const std::function<void(Trainer& resumed, Trainer* full)>& check_resumed = nullptr) {
  for (int n : {1, 2})
    for (std::string opt : {"sgd", "adamw"}) {
      INFO(opt << " on " << n << " CPU device(s)");
      c.optimizer = opt;
      c.lr = opt == "sgd" ? 0.05f : 0.003f;
      c.steps = 6;
      c.log_every = 100;
      c.devices.clear();
      for (int i = 0; i < n; ++i) c.devices.push_back({DeviceType::cpu, i});
      Trainer full(c);
      full.run();
      TrainConfig first = c;
      first.steps = 3;
      first.save = path;
      Trainer(first).run();
      check_saved(ckpt::load(path), opt);
      TrainConfig rest = c;
      rest.resume = path;
      Trainer resumed(rest);
      if (check_resumed) check_resumed(resumed, nullptr);
      resumed.run();
      CHECK(resumed.parameter_hash() == full.parameter_hash());  // parameters and buffers
      if (check_resumed) check_resumed(resumed, &full);
    }
}

TEST_CASE("a CNN with batch norm resumes bit-identically, running statistics included", "[checkpoint][cnn]") {
  test::TempDir dir;
  TrainConfig c;
  c.model = "cnn:2x6x6-c4k3-bn-p2-f3";
  c.batch = 10;
  check_resume(c, dir.file("cnn.safetensors"), [](const ckpt::Checkpoint& saved, const std::string&) {
    // The file holds the buffers under torch.nn.BatchNorm2d's names.
    for (const char* name : {"1.weight", "1.bias", "1.running_mean", "1.running_var"}) {
      INFO(name);
      REQUIRE(saved.find(name) != nullptr);
      CHECK(saved.find(name)->shape == std::vector<int64_t>{4});
    }
    CHECK(saved.find("0.weight")->shape == std::vector<int64_t>{4, 2, 3, 3});
  });
}

TEST_CASE("a bf16 run resumes bit-identically from its fp32 master weights", "[checkpoint][bf16]") {
  test::TempDir dir;
  TrainConfig c;
  c.model = "10-24x2-3";
  c.parallel.precision = Precision::bf16;
  c.batch = 12;
  check_resume(
      c, dir.file("bf16.safetensors"),
      [](const ckpt::Checkpoint& saved, const std::string& opt) {
        // The file holds the fp32 masters (and fp32 optimizer state) only: no bf16 copies.
        for (const auto& [name, t] : saved.tensors) {
          INFO(name);
          CHECK(t.dtype == ckpt::DType::f32);
        }
        CHECK(saved.tensors.size() == (opt == "sgd" ? 7u : 8u));  // 6 parameters + the optimizer's state
      },
      [](Trainer& resumed, Trainer* full) {
        // The shadow follows the loaded masters before the first step, and ends as the full run's.
        if (!full)
          CHECK(test::bf16_bits(resumed.model().flat_shadow()) == test::bf16_bits(resumed.model().flat_params()));
        else CHECK(test::bf16_bits(resumed.model().flat_shadow()) == test::bf16_bits(full->model().flat_shadow()));
      });
}

TEST_CASE("twin buffers resume bit-identically, the state moved to the copy an odd count reads", "[checkpoint]") {
  // Saved after 3 steps: the resumed optimizer is told an odd count, so its state goes to
  // the other copy before the first step (Optimizer::set_steps_taken). fp32 and bf16 (the
  // shadow made from the loaded masters).
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    INFO((precision == Precision::bf16 ? "bf16" : "fp32"));
    test::TempDir dir;
    TrainConfig c;
    c.model = "10-24x2-3";
    c.parallel.precision = precision;
    c.batch = 12;
    c.parallel.twin_buffers = TwinBuffers::on;
    const auto saved = [](const ckpt::Checkpoint&, const std::string&) {};
    check_resume(c, dir.file("twins.safetensors"), saved, [](Trainer& resumed, Trainer* full) {
      CHECK(resumed.optimizer().twin_buffers());
      if (full) CHECK(resumed.model().flat_params().to_host() == full->model().flat_params().to_host());
    });
  }
}
