// Data files and data sets (<dptrain/data/...>): .npy files round-trip for every dtype and
// format version; hostile .npy headers and safetensors data files are refused with one
// line naming the file and the problem (every truncation and thousands of random mutations
// included), FIFOs, devices and directories without blocking; rows gather to the file's
// values through every conversion; labels out of range and non-finite values are refused
// naming the element; the epochs' permutations are permutations that depend on (seed,
// epoch) alone; and the synthetic sources answer as a Dataset too.
// On the GPU: rows gathered into GPU batches as on the host.

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>
#include <utility>

#include <dptrain/data/array.hpp>
#include <dptrain/data/dataset.hpp>
#include <dptrain/data/npy.hpp>
#include <dptrain/data/shuffle.hpp>
#include <dptrain/data/synthetic.hpp>
#include <dptrain/error.hpp>
#include <dptrain/parallel/shard_plan.hpp>
#include "kernels/cpu/cpu.hpp"
#include "runtime/allocator.hpp"

#include "catch.hpp"
#include "common.hpp"
#include "common/fnv1a.hpp"

using namespace dpt;
using namespace dpt::data;
namespace fs = std::filesystem;
using test::gpu;

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

namespace {

const Device kCpu{DeviceType::cpu, 0};

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

template <class T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <class T>
Array array_of(const std::vector<T>& v, ArrayDType dtype, std::vector<int64_t> shape) {
  return {v.data(), dtype, std::move(shape)};
}

std::vector<uint8_t> npy_bytes(const Array& a, int major = 0) {
  std::vector<uint8_t> out;
  write_npy(
      [&](const void* p, size_t n) {
        out.insert(out.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
      },
      a, major);
  return out;
}

void write_npy_file(const std::string& path, const Array& a, int major = 0) { write_file(path, npy_bytes(a, major)); }

// A .npy file made by hand: the magic, version major.minor, the length, `dict` padded
// with spaces (and ended by '\n' when `newline`) so that the data starts at a multiple of
// `align`, then `data` zero bytes.
std::vector<uint8_t> npy_of(const std::string& dict, size_t data, int major = 1, size_t align = 64, bool newline = true,
                            int minor = 0) {
  const size_t len_bytes = major == 1 ? 2 : 4;
  const size_t prefix = 8 + len_bytes;
  std::string header = dict;
  const size_t used = prefix + header.size() + (newline ? 1 : 0);
  header.append((align - used % align) % align, ' ');
  if (newline) header += '\n';
  std::vector<uint8_t> b = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<uint8_t>(major), static_cast<uint8_t>(minor)};
  for (size_t i = 0; i < len_bytes; ++i) b.push_back(static_cast<uint8_t>(header.size() >> (8 * i)));
  b.insert(b.end(), header.begin(), header.end());
  b.resize(b.size() + data, 0);
  return b;
}

std::string dict_of(const std::string& descr, const std::string& shape, const std::string& order = "False") {
  return "{'descr': '" + descr + "', 'fortran_order': " + order + ", 'shape': " + shape + ", }";
}

// The message parse_npy_header gives for `bytes` ("" when it reads them); reading them from
// a file must say the same, and every message is one UsageError line naming the file.
std::string npy_error(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::string from_memory, from_file;
  try {
    parse_npy_header(bytes.data(), bytes.size(), path);
  } catch (const UsageError& e) {
    from_memory = e.what();
  }
  write_file(path, bytes);
  try {
    NpyFile f(path);
  } catch (const UsageError& e) {
    from_file = e.what();
  }
  CHECK(from_file == from_memory);
  if (!from_file.empty()) {
    CHECK(from_file.rfind("data file '" + path + "': ", 0) == 0);
    CHECK(from_file.find('\n') == std::string::npos);
  }
  return from_file;
}

using test::usage_error;

// A safetensors file made by hand: tensors (name, dtype, shape, bytes) back to back.
using Tensor_ = std::tuple<std::string, std::string, std::vector<int64_t>, std::vector<uint8_t>>;
std::vector<uint8_t> safetensors_of(const std::vector<Tensor_>& tensors) {
  std::string h = "{";
  std::vector<uint8_t> data;
  for (const auto& [name, dtype, shape, bytes] : tensors) {
    if (h.size() > 1) h += ",";
    h += "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":[";
    for (size_t i = 0; i < shape.size(); ++i) h += (i ? "," : "") + std::to_string(shape[i]);
    h += "],\"data_offsets\":[" + std::to_string(data.size()) + "," + std::to_string(data.size() + bytes.size()) + "]}";
    data.insert(data.end(), bytes.begin(), bytes.end());
  }
  h += "}";
  h.append((8 - h.size() % 8) % 8, ' ');
  std::vector<uint8_t> b;
  for (int i = 0; i < 8; ++i) b.push_back(static_cast<uint8_t>(static_cast<uint64_t>(h.size()) >> (8 * i)));
  b.insert(b.end(), h.begin(), h.end());
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

// Every row of `d`, gathered on the host.
std::vector<float> all_x(const Dataset& d) {
  std::vector<int64_t> rows(static_cast<size_t>(d.rows()));
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<float> x(rows.size() * static_cast<size_t>(numel(d.input_shape())));
  d.gather_host(rows, {x.data(), nullptr, nullptr});
  return x;
}

std::vector<int32_t> all_labels(const Dataset& d) {
  std::vector<int64_t> rows(static_cast<size_t>(d.rows()));
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<int32_t> y(rows.size());
  d.gather_host(rows, {nullptr, nullptr, y.data()});
  return y;
}

std::vector<float> all_y(const Dataset& d) {
  std::vector<int64_t> rows(static_cast<size_t>(d.rows()));
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<float> y(rows.size() * static_cast<size_t>(numel(d.target_shape())));
  d.gather_host(rows, {nullptr, y.data(), nullptr});
  return y;
}

float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

}  // namespace

// ---- .npy -------------------------------------------------------------------------

TEST_CASE("npy files round-trip for every dtype and format version", "[data][npy]") {
  test::TempDir dir;
  const std::string path = dir.file("a.npy");
  const std::vector<float> f32 = {1.5f, -0.0f, 3.25f, -1e-30f, 65504.0f, 7.0f};
  const std::vector<double> f64 = {1e-300, -2.5, 3.0, 1e300, 0.1, -7.0};
  const std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x0001, 0x7bff, 0x8000, 0x3555};
  const std::vector<uint8_t> u8 = {0, 1, 127, 128, 254, 255};
  const std::vector<int32_t> i32 = {std::numeric_limits<int32_t>::min(), -1, 0, 1, 2,
                                    std::numeric_limits<int32_t>::max()};
  const std::vector<int64_t> i64 = {std::numeric_limits<int64_t>::min(), -1, 0, 1, 1ll << 40,
                                    std::numeric_limits<int64_t>::max()};
  const std::vector<Array> arrays = {
      array_of(f32, ArrayDType::f32, {2, 3}), array_of(f64, ArrayDType::f64, {3, 2}),
      array_of(f16, ArrayDType::f16, {6}),    array_of(u8, ArrayDType::u8, {1, 2, 3}),
      array_of(i32, ArrayDType::i32, {6, 1}), array_of(i64, ArrayDType::i64, {1, 1, 2, 3}),
  };
  for (const Array& a : arrays)
    for (int major : {0, 1, 2, 3}) {
      INFO(array_dtype_name(a.dtype) << " " << shape_text(a.shape) << " version " << major);
      write_npy_file(path, a, major);
      const std::vector<uint8_t> bytes = read_file(path);
      const NpyFile f(path);
      CHECK(f.header().major == (major == 0 ? 1 : major));
      CHECK(f.header().minor == 0);
      CHECK(f.header().dtype == a.dtype);
      CHECK(f.header().shape == a.shape);
      CHECK(f.header().data_offset % 64 == 0);  // as numpy aligns it
      CHECK(bytes[f.header().data_offset - 1] == '\n');
      const size_t n = static_cast<size_t>(element_count(a.shape)) * array_dtype_size(a.dtype);
      CHECK(bytes.size() == f.header().data_offset + n);
      const Array back = f.array();
      CHECK(back.shape == a.shape);
      CHECK(std::memcmp(back.data, a.data, n) == 0);  // bit for bit
      CHECK(f.identity().size == bytes.size());
      CHECK(f.identity().header_hash == fnv1a(bytes.data(), f.header().data_offset));
    }
  // Scalars, empty arrays and long shapes.
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{}, {0}, {0, 5}, {1, 1, 1, 1, 1, 1, 1, 6}}) {
    INFO("shape " << shape_text(shape));
    write_npy_file(path, array_of(f32, ArrayDType::f32, shape));
    CHECK(NpyFile(path).header().shape == shape);
  }
  // The header is what numpy writes: keys sorted, a one-element tuple with its comma.
  const std::string h = npy_header(ArrayDType::u8, {7});
  CHECK(h.find("{'descr': '|u1', 'fortran_order': False, 'shape': (7,), }") == 10);
  CHECK(npy_header(ArrayDType::f32, {}).find("'shape': ()") != std::string::npos);
  CHECK(npy_header(ArrayDType::f32, {2, 3}).find("'shape': (2, 3), }") != std::string::npos);
  CHECK(npy_header(ArrayDType::f32, {2, 3}, 3).substr(0, 8) == std::string("\x93NUMPY\x03\x00", 8));
  CHECK_THROWS_AS(npy_header(ArrayDType::bf16, {2}), Error);  // numpy has no bfloat16
  CHECK_THROWS_AS(npy_header(ArrayDType::f32, {-1}), Error);
}

TEST_CASE("npy headers numpy and older writers produce are read", "[data][npy]") {
  test::TempDir dir;
  const std::string path = dir.file("ok.npy");
  struct Case {
    std::string dict;
    size_t data;
    std::vector<int64_t> shape;
    int major = 1;
    size_t align = 64;
  };
  const std::vector<Case> cases = {
      {dict_of("<f4", "(2, 3)"), 24, {2, 3}},
      {dict_of("<f4", "(2, 3)"), 24, {2, 3}, 1, 16},  // numpy before 1.14 aligned to 16
      {dict_of("<f4", "(2, 3)"), 24, {2, 3}, 2},
      {dict_of("<f4", "(2, 3)"), 24, {2, 3}, 3},
      {"{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}", 24, {2, 3}},  // any order, no trailing comma
      {"{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2, 3)}", 24, {2, 3}},
      {"  {'descr':'<f4','fortran_order':False,'shape':(2,3,),}", 24, {2, 3}},
      {dict_of("<f8", "(2L, 3L)"), 48, {2, 3}},  // Python 2's numpy wrote longs
      {dict_of("<f2", "()"), 2, {}},
      {dict_of("|u1", "(0, 7)"), 0, {0, 7}},
      {dict_of("<i8", "(1,)"), 8, {1}},
      {"{'descr': '<i4',\t'fortran_order': False, 'shape': (5,), }", 20, {5}},
  };
  for (const Case& c : cases) {
    INFO("dict: " << c.dict);
    const std::vector<uint8_t> bytes = npy_of(c.dict, c.data, c.major, c.align);
    CHECK(npy_error(path, bytes).empty());
    CHECK(parse_npy_header(bytes.data(), bytes.size(), path).shape == c.shape);
  }
}

TEST_CASE("hostile npy headers are refused with the file and the problem named", "[data][npy]") {
  test::TempDir dir;
  const std::string path = dir.file("bad.npy");
  SECTION("the magic, the version and the length") {
    std::vector<uint8_t> v2 = npy_of(dict_of("<f4", "(2,)"), 8, 2);
    std::vector<uint8_t> long_len = v2;
    long_len[8] = 0x11, long_len[9] = 0x27;  // 10001
    std::vector<uint8_t> past_end = npy_of(dict_of("<f4", "(2,)"), 8);
    past_end[8] = 0x00, past_end[9] = 0x01;
    const std::vector<std::pair<std::vector<uint8_t>, std::string>> cases = {
        {{}, "not a .npy file (it does not start with \\x93NUMPY)"},
        {{0x93, 'N', 'U', 'M', 'P'}, "not a .npy file"},
        {{'P', 'K', 3, 4, 0, 0, 0, 0, 0, 0, 0, 0}, "not a .npy file"},
        {npy_of(dict_of("<f4", "(2,)"), 8, 4), "unsupported .npy format version 4.0 (dptrain reads 1.0, 2.0 and 3.0)"},
        {npy_of(dict_of("<f4", "(2,)"), 8, 0), "unsupported .npy format version 0.0"},
        {npy_of(dict_of("<f4", "(2,)"), 8, 1, 64, true, 1), "unsupported .npy format version 1.1"},
        {{0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, 0}, "file is 9 bytes, too short for a version 1.0 header"},
        {{0x93, 'N', 'U', 'M', 'P', 'Y', 2, 0, 0, 0, 0}, "file is 11 bytes, too short for a version 2.0 header"},
        {long_len, "header length 10001 is over the limit of 10000 bytes"},
        {past_end, "header length 256 runs past the end of the file (136 bytes)"},
    };
    for (const auto& [bytes, problem] : cases) {
      INFO("expect: " << problem);
      const std::string msg = npy_error(path, bytes);
      INFO("message: " << msg);
      CHECK(msg.find(problem) != std::string::npos);
    }
  }
  SECTION("the dict") {
    struct Case {
      std::vector<uint8_t> bytes;
      std::string problem;
    };
    auto npy = [](const std::string& dict, size_t data) { return npy_of(dict, data); };
    // A dict padded so that the data starts 8 bytes past a multiple of 16.
    auto misaligned = [](const std::string& dict, int major) {
      const size_t used = (major == 1 ? 10 : 12) + dict.size() + 1;
      return npy_of(dict + std::string((24 - used % 16) % 16, ' '), 8, major, 1);
    };
    std::string dims65 = "(";
    for (int i = 0; i < 65; ++i) dims65 += "1, ";
    dims65 += ")";
    const std::vector<Case> cases = {
        // what dptrain does not read
        {npy(dict_of("<f4", "(2, 3)", "True"), 24), "fortran_order is True: dptrain reads C-order arrays"},
        {npy(dict_of(">f4", "(2, 3)"), 24),
         "descr '>f4' is big-endian: dptrain reads little-endian data (save "
         "a.astype('<f4'))"},
        {npy(dict_of(">i8", "(3,)"), 24), "descr '>i8' is big-endian"},
        {npy(dict_of("<c8", "(3,)"), 24),
         "unsupported dtype '<c8' (dptrain reads '<f4', '<f8', '<f2', '|u1', '<i4' and '<i8')"},
        {npy(dict_of("|b1", "(3,)"), 3), "unsupported dtype '|b1'"},
        {npy(dict_of("<u1", "(3,)"), 3), "unsupported dtype '<u1'"},
        {npy(dict_of("|i1", "(3,)"), 3), "unsupported dtype '|i1'"},
        {npy(dict_of("<U5", "(3,)"), 60), "unsupported dtype '<U5'"},
        {npy(dict_of("O", "(3,)"), 24), "unsupported dtype 'O'"},
        {npy("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (3,), }", 12),
         "descr is a list: structured arrays are not supported"},
        {npy("{'descr': 4, 'fortran_order': False, 'shape': (3,), }", 12), "descr is not a string"},
        // shapes against the data
        {npy(dict_of("<f4", "(2, 4)"), 24),
         "shape [2, 4] of float32 needs more data than the 24 bytes after the header (truncated?)"},
        {npy(dict_of("<f4", "(2, 2)"), 24), "shape [2, 2] of float32 needs 16 bytes of data, the file has 24"},
        {npy(dict_of("<f8", "(3,)"), 23), "needs more data than the 23 bytes"},
        {npy(dict_of("<f4", "()"), 0), "shape [] of float32 needs more data"},
        {npy(dict_of("<f4", "(0,)"), 4), "shape [0] of float32 needs 0 bytes of data, the file has 4"},
        {npy(dict_of("<f4", "(-1, 3)"), 24), "shape is not a tuple of at most 64 non-negative integers"},
        {npy(dict_of("<f4", "(4294967296, 4294967296)"), 24), "shape [4294967296, 4294967296] has too many elements"},
        {npy(dict_of("<f4", "(4294967296, 4294967296, 0)"), 0), "has too many elements"},
        {npy(dict_of("<f8", "(4611686018427387904,)"), 8), "needs more data than the 8 bytes"},  // bytes overflow
        {npy(dict_of("<f4", "(9223372036854775808,)"), 8), "shape is not a tuple"},
        {npy(dict_of("<f4", "(3)"), 12), "((3) is not a tuple in Python, (3,) is)"},
        {npy(dict_of("<f4", "3"), 12), "shape is not a tuple"},
        {npy(dict_of("<f4", "[3]"), 12), "shape is not a tuple"},
        {npy(dict_of("<f4", "(3.0,)"), 12), "shape is not a tuple"},
        {npy(dict_of("<f4", "(3e0,)"), 12), "shape is not a tuple"},
        {npy(dict_of("<f4", "(0x3,)"), 12), "shape is not a tuple"},
        {npy(dict_of("<f4", "(03,)"), 12), "number with a leading zero"},
        {npy(dict_of("<f4", "(3 4)"), 48), "expected ',' or ')'"},
        {npy(dict_of("<f4", "(,)"), 0), "shape is not a tuple"},
        {npy(dict_of("<f4", dims65), 4), "shape is not a tuple of at most 64"},
        // the dict itself
        {npy("[1, 2]", 0), "the header is not a dict (it must start with '{')"},
        {npy("", 0), "the header is not a dict"},
        {npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'extra': 1, }", 8),
         "the header has the key 'extra' (a .npy header holds descr, fortran_order and shape)"},
        {npy("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 8),
         "the header has the key 'descr' twice"},
        {npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'shape': (2,), }", 8),
         "the header has the key 'shape' twice"},
        {npy("{'descr': '<f4', 'fortran_order': False, }", 8), "the header has no 'shape'"},
        {npy("{'descr': '<f4', 'shape': (2,), }", 8), "the header has no 'fortran_order'"},
        {npy("{'fortran_order': False, 'shape': (2,), }", 8), "the header has no 'descr'"},
        {npy("{}", 0), "the header has no 'descr'"},
        {npy(dict_of("<f4", "(2,)", "0"), 8), "fortran_order is not True or False"},
        {npy(dict_of("<f4", "(2,)", "Falsey"), 8), "fortran_order is not True or False"},
        {npy(dict_of("<f4", "(2,)", "'False'"), 8), "fortran_order is not True or False"},
        {npy("{'descr': '<f4' 'fortran_order': False, 'shape': (2,), }", 8),
         "invalid header at byte 26: expected ',' or '}'"},
        {npy("{'descr' '<f4', 'fortran_order': False, 'shape': (2,), }", 8), "expected ':'"},
        {npy("{descr: '<f4', 'fortran_order': False, 'shape': (2,), }", 8), "expected a string key or '}'"},
        {npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), },", 8), "unexpected bytes after the dict"},
        {npy(std::string("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }") + '\0', 8),
         "unexpected bytes after the dict"},
        {npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), } }", 8), "unexpected bytes after the dict"},
        {npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), ", 8), "expected a string key or '}'"},
        {npy("{'descr': '<f\\x34', 'fortran_order': False, 'shape': (2,), }", 8), "a string holds a backslash"},
        {npy("{'descr': '<f\xc3\xa9"
             "4', 'fortran_order': False, 'shape': (2,), }",
             8),
         "a string holds a byte that is not printable ASCII"},
        {npy("{'descr': '<f4\n', 'fortran_order': False, 'shape': (2,), }", 8), "not printable ASCII"},
        {npy("{'descr: '<f4', 'fortran_order': False, 'shape': (2,), }", 8), "expected ':'"},
        {npy("{'descr", 8), "unterminated string"},
        // the layout numpy gives it
        {npy_of(dict_of("<f4", "(2,)"), 8, 1, 64, false), "the header does not end with a newline, as numpy ends it"},
        {misaligned(dict_of("<f4", "(2,)"), 1), "the data starts at byte 72, not a multiple of 64 (or 16) as numpy"},
        {misaligned(dict_of("<f4", "(2,)"), 2), "not a multiple of 64 (or 16)"},
    };
    for (const auto& c : cases) {
      INFO("header: " << std::string(c.bytes.begin(), c.bytes.end()));
      INFO("expect: " << c.problem);
      const std::string msg = npy_error(path, c.bytes);
      INFO("message: " << msg);
      CHECK(msg.find(c.problem) != std::string::npos);
    }
  }
}

TEST_CASE("every truncation of a npy file is refused, and mutations either read or are refused", "[data][npy]") {
  test::TempDir dir;
  const std::vector<float> v = {1, 2, 3, 4, 5, 6};
  for (int major : {1, 2}) {
    const std::vector<uint8_t> whole = npy_bytes(array_of(v, ArrayDType::f32, {2, 3}), major);
    for (size_t len = 0; len < whole.size(); ++len) {
      INFO("version " << major << ", first " << len << " of " << whole.size() << " bytes");
      const std::vector<uint8_t> prefix(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(len));
      CHECK(!npy_error(dir.file("cut.npy"), prefix).empty());
    }
  }
  const std::vector<uint8_t> good = npy_bytes(array_of(v, ArrayDType::f32, {2, 3}));
  const size_t header = parse_npy_header(good.data(), good.size(), "good").data_offset;
  auto mutate = [&](std::vector<uint8_t>& bytes, std::mt19937_64& rng) {
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      // In the header, where the parsing is; in its dict's text mostly.
      const size_t at = rng() % 4 == 0 ? rng() % header : 10 + rng() % (header - 10);
      if (rng() % 2) bytes[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
      else bytes[at] = static_cast<uint8_t>(" (),:'0123456789<>|fiuTFL{}"[rng() % 27]);
    }
  };
  test::check_mutants<UsageError>(
      good, 11, 6000, "data file 'mutant': ", mutate, [](const std::vector<uint8_t>& bytes) {
        const NpyHeader h = parse_npy_header(bytes.data(), bytes.size(), "mutant");
        CHECK(h.data_offset + static_cast<uint64_t>(element_count(h.shape)) * array_dtype_size(h.dtype) ==
              bytes.size());
      });
}

TEST_CASE("what is not a regular file is refused before it is read", "[data][npy]") {
  test::TempDir dir;
  const std::string fifo = dir.file("fifo.npy");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // A blocking open of a FIFO would wait for a writer for ever: these return at once.
  CHECK(usage_error([&] { NpyFile f(fifo); }) == "data file '" + fifo + "': not a regular file (a FIFO)");
  CHECK(usage_error([&] { ArrayDataset::from_npy(fifo); }).find("(a FIFO)") != std::string::npos);
  CHECK(usage_error([&] { ArrayDataset::from_safetensors(fifo); }).find("(a FIFO)") != std::string::npos);
  const std::string folder = dir.path.string();
  CHECK(usage_error([&] { NpyFile f(folder); }) == "data file '" + folder + "': not a regular file (a directory)");
  CHECK(usage_error([&] { NpyFile f("/dev/null"); }) == "data file '/dev/null': not a regular file (a device)");
  CHECK(usage_error([&] { NpyFile f(dir.file("missing.npy")); }) ==
        "data file '" + dir.file("missing.npy") + "': cannot open: No such file or directory");
  const std::string empty = dir.file("empty.npy");
  write_file(empty, {});
  CHECK(usage_error([&] { NpyFile f(empty); }).find("not a .npy file") != std::string::npos);
}

// ---- Data sets --------------------------------------------------------------------

TEST_CASE("rows gathered from npy files are the file's values", "[data]") {
  test::TempDir dir;
  const std::string xp = dir.file("x.npy"), yp = dir.file("y.npy");
  std::vector<float> x(6 * 4);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) * 0.5f - 3.0f;
  const std::vector<int64_t> y = {2, 0, 1, 1, 0, 2};
  write_npy_file(xp, array_of(x, ArrayDType::f32, {6, 4}));
  write_npy_file(yp, array_of(y, ArrayDType::i64, {6}));
  const ArrayDataset d = ArrayDataset::from_npy(xp, yp);
  CHECK(d.rows() == 6);
  CHECK(d.input_shape() == Shape{4});
  CHECK(d.has_targets());
  CHECK(d.task() == Task::classification);
  CHECK(d.target_shape() == Shape{});
  CHECK(d.inputs_name() == "data file '" + xp + "': x");
  CHECK(d.targets_name() == "data file '" + yp + "': y");
  REQUIRE(d.files().size() == 2);
  CHECK(d.files()[0].path == xp);
  CHECK(d.files()[0].size == fs::file_size(xp));
  CHECK(d.files()[1].size == fs::file_size(yp));

  const std::vector<int64_t> rows = {5, 0, 3, 3};  // any order, repeats allowed
  std::vector<float> gx(rows.size() * 4);
  std::vector<int32_t> gy(rows.size());
  d.gather_host(rows, {gx.data(), nullptr, gy.data()});
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto r = static_cast<size_t>(rows[i]);
    CHECK(std::vector<float>(gx.begin() + 4 * i, gx.begin() + 4 * i + 4) ==
          std::vector<float>(x.begin() + 4 * r, x.begin() + 4 * r + 4));
    CHECK(gy[i] == y[r]);
  }
  // Into a Batch on the CPU: straight from the mapping into the tensors.
  Batch b = d.empty_batch(4, kCpu);
  CHECK(b.x.shape() == Shape{4, 4});
  CHECK(b.y.dtype() == DType::i32);
  d.gather(rows, b);
  CHECK(b.x.to_host() == gx);
  CHECK(b.y.to_host_i32() == gy);
  // batch() takes consecutive rows and wraps around the end.
  const Batch w = d.batch(4, 4, kCpu);
  CHECK(w.y.to_host_i32() == std::vector<int32_t>{0, 2, 2, 0});
  CHECK(w.x.to_host()[8] == x[0]);
  CHECK_THROWS_AS(d.gather_host(std::vector<int64_t>{6}, {gx.data(), nullptr, nullptr}), Error);
  CHECK_THROWS_AS(d.gather_host(std::vector<int64_t>{-1}, {gx.data(), nullptr, nullptr}), Error);
  CHECK_THROWS_AS(d.gather_host(rows, {nullptr, gx.data(), nullptr}), Error);  // labels, not float targets

  // Inputs alone (to predict on).
  const ArrayDataset inputs = ArrayDataset::from_npy(xp);
  CHECK(!inputs.has_targets());
  CHECK(inputs.files().size() == 1);
  CHECK(!inputs.empty_batch(2, kCpu).y.defined());
  CHECK(all_x(inputs) == x);
}

TEST_CASE("rows are converted to float32 and labels to int32 as they are gathered", "[data]") {
  const std::vector<double> f64 = {0.1, -2.5, 1e-40, 3.0};
  const std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x0001, 0x7bff, 0x8000, 0x3555};  // 1, -2, 2^-24, 65504, -0
  const std::vector<uint16_t> bf16 = {0x3f80, 0xc040, 0x0001, 0x7f7f};
  const std::vector<uint8_t> u8 = {0, 1, 128, 255};
  const std::vector<int32_t> i32 = {-7, 0, 3, 100000};
  const std::vector<int64_t> i64 = {-7, 0, 3, 1ll << 40};
  auto x_of = [](const Array& x) { return all_x(ArrayDataset(x, Array{})); };
  CHECK(x_of(array_of(f64, ArrayDType::f64, {2, 2})) ==
        std::vector<float>{0.1f, -2.5f, static_cast<float>(1e-40), 3.0f});
  const std::vector<float> halves = x_of(array_of(f16, ArrayDType::f16, {3, 2}));
  CHECK(halves[0] == 1.0f);
  CHECK(halves[1] == -2.0f);
  CHECK(halves[2] == std::ldexp(1.0f, -24));  // the smallest subnormal half
  CHECK(halves[3] == 65504.0f);
  CHECK((halves[4] == 0.0f && std::signbit(halves[4])));
  CHECK(halves[5] == 0.333251953125f);
  CHECK(x_of(array_of(bf16, ArrayDType::bf16, {1, 4})) ==
        std::vector<float>{1.0f, -3.0f, bits_to_float(0x00010000), bits_to_float(0x7f7f0000)});
  CHECK(x_of(array_of(u8, ArrayDType::u8, {1, 4})) == std::vector<float>{0.0f, 1.0f / 255.0f, 128.0f / 255.0f, 1.0f});
  CHECK(x_of(array_of(i32, ArrayDType::i32, {4, 1})) == std::vector<float>{-7, 0, 3, 100000});
  CHECK(x_of(array_of(i64, ArrayDType::i64, {2, 2})) == std::vector<float>{-7, 0, 3, 1099511627776.0f});

  const std::vector<float> x(8, 1.0f);
  const Array xa = array_of(x, ArrayDType::f32, {4, 2});
  const std::vector<uint8_t> l8 = {3, 0, 255, 1};
  const std::vector<int32_t> l32 = {3, 0, 255, 1};
  const std::vector<int64_t> l64 = {3, 0, 255, std::numeric_limits<int32_t>::max()};
  CHECK(all_labels(ArrayDataset(xa, array_of(l8, ArrayDType::u8, {4}))) == std::vector<int32_t>{3, 0, 255, 1});
  CHECK(all_labels(ArrayDataset(xa, array_of(l32, ArrayDType::i32, {4}))) == std::vector<int32_t>{3, 0, 255, 1});
  CHECK(all_labels(ArrayDataset(xa, array_of(l64, ArrayDType::i64, {4}))) ==
        std::vector<int32_t>{3, 0, 255, std::numeric_limits<int32_t>::max()});

  // Regression targets: [N, outputs], or [N] as one output; float16 and float64 converted.
  const std::vector<double> t64 = {1.5, -2, 0.25, 8, 1e-3, 7, 3, 4};
  const ArrayDataset r(xa, array_of(t64, ArrayDType::f64, {4, 2}));
  CHECK(r.task() == Task::regression);
  CHECK(r.target_shape() == Shape{2});
  CHECK(all_y(r) == std::vector<float>{1.5f, -2, 0.25f, 8, 1e-3f, 7, 3, 4});
  const std::vector<uint16_t> t16 = {0x3c00, 0xc000, 0x0000, 0x3800};
  const ArrayDataset one(xa, array_of(t16, ArrayDType::f16, {4}));
  CHECK(one.target_shape() == Shape{1});
  CHECK(all_y(one) == std::vector<float>{1, -2, 0, 0.5f});
  const Batch b = one.batch(0, 4, kCpu);
  CHECK(b.y.shape() == Shape{4, 1});
  CHECK(b.y.dtype() == DType::f32);
}

TEST_CASE("host arrays are used in place, and shapes that do not fit are refused", "[data]") {
  std::vector<float> x = {1, 2, 3, 4, 5, 6};
  const std::vector<float> y = {10, 20, 30};
  const ArrayDataset d(array_of(x, ArrayDType::f32, {3, 2}), array_of(y, ArrayDType::f32, {3, 1}));
  CHECK(d.inputs_name() == "host arrays: x");
  CHECK(d.files().empty());
  x[2] = 42;  // not copied: the data set reads the program's memory
  CHECK(all_x(d)[2] == 42);

  std::vector<float> img(2 * 3 * 4 * 5, 0.5f);
  const ArrayDataset images(array_of(img, ArrayDType::f32, {2, 3, 4, 5}), Array{});
  CHECK(images.input_shape() == Shape{3, 4, 5});
  CHECK(images.batch(0, 2, kCpu).x.shape() == Shape{2, 3, 4, 5});

  const std::vector<int32_t> labels = {0, 1, -1};
  const std::vector<int64_t> big = {0, 1, 1ll << 31};
  const std::vector<int32_t> two_d = {0, 1, 0, 1, 0, 1};
  const Array xa = array_of(x, ArrayDType::f32, {3, 2});
  struct Case {
    Array x, y;
    std::string problem;
  };
  const std::vector<Case> cases = {
      {array_of(x, ArrayDType::f32, {6}), {}, "host arrays: x is float32 [6], not [N, features] or [N, C, H, W]"},
      {array_of(x, ArrayDType::f32, {1, 2, 3}), {}, "x is float32 [1, 2, 3], not [N, features]"},
      {array_of(x, ArrayDType::f32, {0, 6}), {}, "host arrays: x has no rows"},
      {array_of(x, ArrayDType::f32, {6, 0}), {}, "x is float32 [6, 0]: its rows are empty"},
      {array_of(x, ArrayDType::f32, {-3, -2}), {}, "x has an invalid shape [-3, -2]"},
      {Array{nullptr, ArrayDType::f32, {3, 2}}, {}, "host arrays: x has no data"},
      {xa, array_of(y, ArrayDType::f32, {2}), "host arrays: y has 2 rows, x has 3"},
      {xa, array_of(y, ArrayDType::f32, {3, 1, 1}), "y is float32 [3, 1, 1], not [N, outputs] or [N]"},
      {xa, array_of(two_d, ArrayDType::i32, {3, 2}),
       "y is int32 [3, 2]: integer targets are class labels, one a row ([N]); float targets [N, outputs] are "
       "regression"},
      {xa, array_of(labels, ArrayDType::i32, {3}),
       "host arrays: y has the label -1 in row 2: class labels are 0 to "
       "2147483647"},
      {xa, array_of(big, ArrayDType::i64, {3}), "y has the label 2147483648 in row 2"},
      {xa, array_of(y, ArrayDType::f32, {3, 0}), "y is float32 [3, 0]: its rows are empty"},
  };
  for (const Case& c : cases) {
    INFO("expect: " << c.problem);
    const std::string msg = usage_error([&] { ArrayDataset(c.x, c.y); });
    INFO("message: " << msg);
    CHECK(msg.find(c.problem) != std::string::npos);
  }
}

TEST_CASE("a data set is checked against the model: both shapes, or the first label out of range", "[data]") {
  test::TempDir dir;
  const std::string xp = dir.file("x.npy"), yp = dir.file("y.npy"), rp = dir.file("r.npy");
  const std::vector<float> x(10 * 8, 0.25f);
  const std::vector<int64_t> y = {0, 1, 2, 1, 0, 7, 2, 9, 1, 0};
  const std::vector<float> r(10 * 2, 1.0f);
  write_npy_file(xp, array_of(x, ArrayDType::f32, {10, 8}));
  write_npy_file(yp, array_of(y, ArrayDType::i64, {10}));
  write_npy_file(rp, array_of(r, ArrayDType::f32, {10, 2}));
  const ArrayDataset c = ArrayDataset::from_npy(xp, yp);
  CHECK(usage_error([&] { c.check_model({8}, Task::classification, 10); }).empty());
  CHECK(usage_error([&] { c.check_model({8}, Task::classification, 3); }) ==
        "data file '" + yp + "': y[5] is 7, outside [0, 3): the model has 3 classes");
  CHECK(usage_error([&] { c.check_model({8}, Task::classification, 8); }) ==
        "data file '" + yp + "': y[7] is 9, outside [0, 8): the model has 8 classes");
  // A slice checks its own rows, and names them as the file numbers them.
  CHECK(usage_error([&] { c.slice(0, 5).check_model({8}, Task::classification, 3); }).empty());
  CHECK(usage_error([&] { c.slice(6, 4).check_model({8}, Task::classification, 3); }) ==
        "data file '" + yp + "': y[7] is 9, outside [0, 3): the model has 3 classes");
  CHECK(usage_error([&] {
          c.check_model({3, 2, 2}, Task::classification, 10);
        }) == "data file '" + xp + "': x has rows of [8], the model takes [3, 2, 2]");
  CHECK(usage_error([&] { c.check_model({8}, Task::regression, 10); }) ==
        "data file '" + yp + "': y holds class labels (integers), but the task is regression");
  const ArrayDataset g = ArrayDataset::from_npy(xp, rp);
  CHECK(usage_error([&] { g.check_model({8}, Task::regression, 2); }).empty());
  CHECK(usage_error([&] { g.check_model({8}, Task::regression, 3); }) ==
        "data file '" + rp + "': y has rows of [2], the model gives [3]");
  CHECK(usage_error([&] { g.check_model({8}, Task::classification, 2); }).find("y holds float targets") !=
        std::string::npos);
  // Inputs alone: only their shape is checked.
  CHECK(usage_error([&] { ArrayDataset::from_npy(xp).check_model({8}, Task::classification, 3); }).empty());
  // x and y disagree on the rows.
  const std::string short_y = dir.file("short.npy");
  write_npy_file(short_y, array_of(y, ArrayDType::i64, {9}));
  CHECK(usage_error([&] { ArrayDataset::from_npy(xp, short_y); }) ==
        "data file '" + short_y + "': y has 9 rows, data file '" + xp + "': x has 10");
}

TEST_CASE("non-finite inputs and targets are refused as they are gathered, naming the element", "[data]") {
  std::vector<float> x(5 * 3, 1.0f);
  x[3 * 3 + 1] = std::nanf("");
  std::vector<float> y(5 * 2, 0.5f);
  y[2 * 2 + 1] = INFINITY;
  const ArrayDataset d(array_of(x, ArrayDType::f32, {5, 3}), array_of(y, ArrayDType::f32, {5, 2}));
  std::vector<float> gx(3 * 3), gy(3 * 2);
  // The rows without one gather as usual.
  CHECK(usage_error([&] { d.gather_host(std::vector<int64_t>{0, 1, 4}, {gx.data(), gy.data(), nullptr}); }).empty());
  CHECK(usage_error([&] {
          d.gather_host(std::vector<int64_t>{0, 3}, {gx.data(), nullptr, nullptr});
        }) == "host arrays: x[3, 1] is nan (non-finite inputs are refused)");
  CHECK(usage_error([&] {
          d.gather_host(std::vector<int64_t>{2}, {nullptr, gy.data(), nullptr});
        }) == "host arrays: y[2, 1] is inf (non-finite targets are refused)");
  // Rows are read in order, each one's inputs before its targets.
  CHECK(usage_error([&] { d.batch(0, 5, kCpu); }) == "host arrays: y[2, 1] is inf (non-finite targets are refused)");
  CHECK(usage_error([&] { d.batch(3, 2, kCpu); }) == "host arrays: x[3, 1] is nan (non-finite inputs are refused)");
  // check_finite: the same, over every row, before any training.
  CHECK(usage_error([&] { d.check_finite(); }) == "host arrays: y[2, 1] is inf (non-finite targets are refused)");
  CHECK(usage_error([&] { d.slice(3, 2).check_finite(); }) ==
        "host arrays: x[3, 1] is nan (non-finite inputs are refused)");
  CHECK(usage_error([&] { d.slice(4, 1).check_finite(); }).empty());

  // Images name the element by its place; float64 past float32's range is refused too.
  std::vector<double> img(2 * 2 * 3 * 4, 0.0);
  img[1 * 24 + 1 * 12 + 2 * 4 + 3] = -1e300;
  const ArrayDataset im(array_of(img, ArrayDType::f64, {2, 2, 3, 4}), Array{});
  CHECK(usage_error([&] { im.check_finite(); }) ==
        "host arrays: x[1, 1, 2, 3] is -1e+300, beyond float32's range (non-finite inputs are refused)");
  const std::vector<uint16_t> h = {0x3c00, 0x7e00};
  CHECK(usage_error([&] {
          ArrayDataset(array_of(h, ArrayDType::f16, {1, 2}), Array{}).check_finite();
        }) == "host arrays: x[0, 1] is nan (non-finite inputs are refused)");
}

TEST_CASE("the validation split is the last rows, a slice of the same arrays", "[data]") {
  std::vector<float> x(10 * 2);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  std::vector<int32_t> y(10);
  std::iota(y.begin(), y.end(), 0);
  const ArrayDataset d(array_of(x, ArrayDType::f32, {10, 2}), array_of(y, ArrayDType::i32, {10}));
  const DataSplit s = d.split(0.3);  // 3 rows, though 0.3 * 10 is 3.0000000000000004
  REQUIRE(s.val.has_value());
  CHECK(s.train.rows() == 7);
  CHECK(s.val->rows() == 3);
  CHECK(s.train.first_row() == 0);
  CHECK(s.val->first_row() == 7);
  CHECK(all_labels(s.train) == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6});
  CHECK(all_labels(*s.val) == std::vector<int32_t>{7, 8, 9});
  CHECK(all_x(*s.val) == std::vector<float>(x.begin() + 14, x.end()));
  CHECK(d.split(0.25).val->rows() == 3);  // 2.5 rounds up
  CHECK(d.split(0.05).val->rows() == 1);
  CHECK(s.train.slice(2, 3).first_row() == 2);
  CHECK(all_labels(s.val->slice(1, 2)) == std::vector<int32_t>{8, 9});
  for (double bad : {0.0, 1.0, -0.5, 1.5, std::nan("")})
    CHECK(usage_error([&] { d.split(bad); }).rfind("val_fraction must be in (0, 1), got ", 0) == 0);
  CHECK(usage_error([&] { d.split(0.04); }) ==
        "host arrays: x: val_fraction 0.04 of 10 rows leaves no validation rows");
  CHECK(usage_error([&] { d.split(0.96); }) == "host arrays: x: val_fraction 0.96 of 10 rows leaves no training rows");
  CHECK(usage_error([&] { s.train.slice(5, 3); }) == "host arrays: x: rows [5, 8) are not a slice of its 7 rows");
  CHECK(!usage_error([&] { d.slice(-1, 2); }).empty());
  CHECK(!usage_error([&] { d.slice(0, 0); }).empty());
}

TEST_CASE("safetensors data files: x and y, and x_val and y_val, checked as strictly as checkpoints", "[data]") {
  test::TempDir dir;
  const std::string path = dir.file("data.safetensors");
  const std::vector<uint8_t> x = {0, 51, 102, 153, 204, 255};  // 3 bytes a row: y starts unaligned
  const std::vector<int64_t> y = {1, 0};
  const std::vector<double> xv = {0.5, -1, 2};
  const std::vector<int32_t> yv = {2};
  write_file(path, safetensors_of({{"x", "U8", {2, 3}, x},
                                   {"y", "I64", {2}, bytes_of(y)},
                                   {"x_val", "F64", {1, 3}, bytes_of(xv)},
                                   {"y_val", "I32", {1}, bytes_of(yv)}}));
  const DataSplit s = ArrayDataset::from_safetensors(path);
  CHECK(s.train.rows() == 2);
  CHECK(all_x(s.train) == std::vector<float>{0, 0.2f, 0.4f, 0.6f, 0.8f, 1});
  CHECK(all_labels(s.train) == std::vector<int32_t>{1, 0});
  REQUIRE(s.val.has_value());
  CHECK(all_x(*s.val) == std::vector<float>{0.5f, -1, 2});
  CHECK(all_labels(*s.val) == std::vector<int32_t>{2});
  CHECK(s.val->targets_name() == "data file '" + path + "': y_val");
  REQUIRE(s.train.files().size() == 1);
  CHECK(s.train.files()[0].size == fs::file_size(path));
  CHECK(s.val->files()[0].matches(s.train.files()[0]));
  CHECK(usage_error([&] { s.val->check_model({3}, Task::classification, 2); }) ==
        "data file '" + path + "': y_val[0] is 2, outside [0, 2): the model has 2 classes");

  // Inputs alone; regression targets of any float type.
  const std::vector<uint16_t> bf = {0x3f80, 0x4000};
  const std::vector<uint16_t> hf = {0x3c00, 0x4000, 0x4200, 0x4400};
  write_file(path, safetensors_of({{"x", "BF16", {2, 1}, bytes_of(bf)}}));
  CHECK(!ArrayDataset::from_safetensors(path).train.has_targets());
  write_file(path, safetensors_of({{"y", "F16", {2, 2}, bytes_of(hf)}, {"x", "BF16", {2, 1}, bytes_of(bf)}}));
  const DataSplit r = ArrayDataset::from_safetensors(path);
  CHECK(!r.val.has_value());
  CHECK(all_y(r.train) == std::vector<float>{1, 2, 3, 4});
  CHECK(all_x(r.train) == std::vector<float>{1, 2});

  const std::vector<float> f = {1, 2, 3, 4};
  struct Case {
    std::vector<Tensor_> tensors;
    std::string problem;
  };
  const std::vector<Case> cases = {
      {{{"y", "F32", {4}, bytes_of(f)}}, "no tensor 'x' (a data file holds x, y and optionally x_val, y_val)"},
      {{{"x", "F32", {2, 2}, bytes_of(f)}, {"z", "F32", {0}, {}}},
       "tensor 'z' is not one of a data file's: x, y and optionally x_val, y_val"},
      {{{"x", "F32", {2, 2}, bytes_of(f)},
        {"y", "I32", {2}, bytes_of(std::vector<int32_t>{0, 1})},
        {"x_val", "F32", {1, 2}, bytes_of(std::vector<float>{1, 2})}},
       "tensor 'x_val' without 'y_val'"},
      {{{"x", "F32", {2, 2}, bytes_of(f)},
        {"x_val", "F32", {1, 2}, bytes_of(std::vector<float>{1, 2})},
        {"y_val", "I32", {1}, bytes_of(std::vector<int32_t>{0})}},
       "tensor 'y_val' without 'y'"},
      {{{"x", "F32", {2, 2}, bytes_of(f)},
        {"y", "I32", {2}, bytes_of(std::vector<int32_t>{0, 1})},
        {"x_val", "F32", {1, 3}, bytes_of(std::vector<float>{1, 2, 3})},
        {"y_val", "I32", {1}, bytes_of(std::vector<int32_t>{0})}},
       "rows of x_val are [3], rows of x [2]"},
      {{{"x", "F32", {2, 2}, bytes_of(f)},
        {"y", "I32", {2}, bytes_of(std::vector<int32_t>{0, 1})},
        {"x_val", "F32", {1, 2}, bytes_of(std::vector<float>{1, 2})},
        {"y_val", "F32", {1}, bytes_of(std::vector<float>{0})}},
       "y_val (float32 [1]) does not hold the targets y does (int32 [2])"},
      {{{"x", "BOOL", {4}, {1, 0, 1, 0}}},
       "tensor 'x': unsupported dtype 'BOOL' (dptrain reads F32, F64, F16, BF16, U8, I32 and I64)"},
      {{{"x", "F32", {2, 3}, bytes_of(f)}}, "tensor 'x': shape [2, 3] of F32 does not fit data_offsets [0, 16]"},
      {{{"x", "F32", {4}, bytes_of(f)}}, "x is float32 [4], not [N, features] or [N, C, H, W]"},
      {{{"x", "F32", {2, 2}, bytes_of(f)}, {"y", "I32", {2}, bytes_of(std::vector<int32_t>{0, -4})}},
       "y has the label -4 in row 1"},
  };
  for (const Case& c : cases) {
    INFO("expect: " << c.problem);
    write_file(path, safetensors_of(c.tensors));
    const std::string msg = usage_error([&] { ArrayDataset::from_safetensors(path); });
    INFO("message: " << msg);
    CHECK(msg.rfind("data file '" + path + "': ", 0) == 0);
    CHECK(msg.find(c.problem) != std::string::npos);
  }
  // The header parser is the checkpoints' (test_checkpoint tries it at length); as a data
  // file its errors are bad input, UsageError.
  const std::vector<uint8_t> good = safetensors_of({{"x", "F32", {2, 2}, bytes_of(f)}});
  std::vector<uint8_t> bad = good;
  bad[0] = 0xff, bad[1] = 0xff;
  write_file(path, bad);
  CHECK(usage_error([&] { ArrayDataset::from_safetensors(path); }).find("runs past the end of the file") !=
        std::string::npos);
  for (size_t len = 0; len < good.size(); ++len) {
    write_file(path, std::vector<uint8_t>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(len)));
    CHECK(usage_error([&] { ArrayDataset::from_safetensors(path); }).rfind("data file '" + path + "': ", 0) == 0);
  }
  write_file(path, good);
  CHECK(usage_error([&] { ArrayDataset::from_safetensors(path); }).empty());
}

TEST_CASE("a file's identity is its size and the hash of its header", "[data]") {
  test::TempDir dir;
  const std::string a = dir.file("a.npy"), b = dir.file("b.npy");
  std::vector<float> v(12, 1.0f);
  write_npy_file(a, array_of(v, ArrayDType::f32, {3, 4}));
  v[5] = 2.0f;
  write_npy_file(b, array_of(v, ArrayDType::f32, {3, 4}));
  const FileIdentity ia = NpyFile(a).identity(), ib = NpyFile(b).identity();
  CHECK(ia.path == a);
  CHECK(ia.matches(ib));  // the same header and size: cheap, so the values are not read
  write_npy_file(b, array_of(v, ArrayDType::f32, {4, 3}));
  CHECK(!ia.matches(NpyFile(b).identity()));
  write_npy_file(b, array_of(v, ArrayDType::f32, {2, 4}));
  CHECK(!ia.matches(NpyFile(b).identity()));
  CHECK(fnv1a("", 0) == kFnv1aOffset);
  CHECK(fnv1a("a", 1) == 0xaf63dc4c8601ec8cull);  // the published FNV-1a 64 test vector
}

// ---- Epoch order ------------------------------------------------------------------

TEST_CASE("an epoch's order is a permutation that depends on (seed, epoch) alone", "[data][shuffle]") {
  for (int64_t rows : {1, 2, 7, 1000}) {
    INFO(rows << " rows");
    const std::vector<int64_t> p = epoch_permutation(rows, 5, 3);
    std::vector<int64_t> sorted = p;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> iota(static_cast<size_t>(rows));
    std::iota(iota.begin(), iota.end(), 0);
    CHECK(sorted == iota);
    CHECK(epoch_permutation(rows, 5, 3) == p);
    std::vector<int64_t> reused(3 * static_cast<size_t>(rows), -1);  // any earlier contents
    epoch_permutation(rows, 5, 3, reused);
    CHECK(reused == p);
  }
  const std::vector<int64_t> base = epoch_permutation(1000, 5, 3);
  CHECK(epoch_permutation(1000, 5, 4) != base);
  CHECK(epoch_permutation(1000, 6, 3) != base);
  std::vector<int64_t> identity(1000);
  std::iota(identity.begin(), identity.end(), 0);
  CHECK(base != identity);
  // Every place equally likely: where row 0 lands over 4000 epochs of 4 rows.
  int counts[4] = {0, 0, 0, 0};
  for (int64_t e = 0; e < 4000; ++e) {
    const std::vector<int64_t> p = epoch_permutation(4, 1, e);
    ++counts[std::find(p.begin(), p.end(), 0) - p.begin()];
  }
  for (int c : counts) CHECK(std::abs(c - 1000) < 120);  // about 4 standard deviations
  CHECK_THROWS_AS(epoch_permutation(0, 1, 0), Error);
}

TEST_CASE("a global sample counter maps to an epoch and a row, the same for any split", "[data][shuffle]") {
  CHECK(sample_position(0, 10) == SamplePosition{0, 0});
  CHECK(sample_position(23, 10) == SamplePosition{2, 3});
  CHECK(sample_position(29, 10) == SamplePosition{2, 9});
  CHECK(sample_at({2, 3}, 10) == 23);
  for (int64_t s = 0; s < 100; ++s) CHECK(sample_at(sample_position(s, 7), 7) == s);

  RowOrder order(10, 9, true);
  std::vector<int64_t> rows;
  order.rows(7, 6, rows);  // across the end of epoch 0
  const std::vector<int64_t> e0 = epoch_permutation(10, 9, 0), e1 = epoch_permutation(10, 9, 1);
  CHECK(rows == std::vector<int64_t>{e0[7], e0[8], e0[9], e1[0], e1[1], e1[2]});
  CHECK(order.row(3) == e0[3]);  // back to an earlier epoch: made again
  CHECK(order.row(25) == epoch_permutation(10, 9, 2)[5]);

  RowOrder plain(10, 9, false);
  plain.rows(8, 5, rows);
  CHECK(rows == std::vector<int64_t>{8, 9, 0, 1, 2});

  // The rows of a global batch, split over any number of readers (ranks, replicas), each
  // with its own RowOrder, are the rows one reader gets for the whole batch: a resumed
  // run, or one with other devices, reads the same rows at the same step.
  const int64_t batch = 13, rows_in_file = 31;
  RowOrder whole(rows_in_file, 4, true);
  for (size_t readers : {1, 2, 3, 5}) {
    INFO(readers << " readers");
    std::vector<RowOrder> each(readers, RowOrder(rows_in_file, 4, true));
    for (int64_t step : {0, 2, 7}) {
      std::vector<int64_t> expect, got, part;
      whole.rows(step * batch, batch, expect);
      int64_t first = step * batch;
      const std::vector<int64_t> sizes = split_evenly(batch, readers);
      for (size_t r = 0; r < readers; ++r) {
        each[r].rows(first, sizes[r], part);
        got.insert(got.end(), part.begin(), part.end());
        first += sizes[r];
      }
      CHECK(got == expect);
    }
  }
}

// ---- Synthetic data as a Dataset --------------------------------------------------

TEST_CASE("synthetic data answers as a Dataset", "[data]") {
  const Synthetic reg({.task = Task::regression, .in = 6, .out = 3, .seed = 9, .samples = 20}, kCpu);
  const Dataset& d = reg;
  CHECK(d.rows() == 20);
  CHECK(d.input_shape() == Shape{6});
  CHECK(d.target_shape() == Shape{3});
  CHECK(d.task() == Task::regression);
  CHECK(usage_error([&] { d.check_model({6}, Task::regression, 3); }).empty());
  CHECK(usage_error([&] { d.check_model({7}, Task::regression, 3); }) ==
        "synthetic data: x has rows of [6], the model takes [7]");

  const std::vector<int64_t> rows = {3, 4, 5, 10, 19, 0};
  std::vector<float> x(rows.size() * 6), y(rows.size() * 3);
  d.gather_host(rows, {x.data(), y.data(), nullptr});
  const std::vector<float> run = reg.batch(3, 3).x.to_host(), ten = reg.batch(10, 1).x.to_host(),
                           wrap = reg.batch(19, 2).x.to_host();
  CHECK(std::vector<float>(x.begin(), x.begin() + 18) == run);
  CHECK(std::vector<float>(x.begin() + 18, x.begin() + 24) == ten);
  CHECK(std::vector<float>(x.begin() + 24, x.end()) == wrap);
  const std::vector<float> ry = reg.batch(3, 3).y.to_host();
  CHECK(std::vector<float>(y.begin(), y.begin() + 9) == ry);
  const Batch via = d.batch(3, 3, kCpu);
  CHECK(via.x.to_host() == run);
  Batch into = d.empty_batch(static_cast<int64_t>(rows.size()), kCpu);
  d.gather(rows, into);
  CHECK(into.x.to_host() == x);
  CHECK(into.y.to_host() == y);
  CHECK_THROWS_AS(d.gather_host(std::vector<int64_t>{20}, {x.data(), nullptr, nullptr}), Error);

  const Synthetic img({.task = Task::classification, .out = 4, .image = {2, 4, 4}, .seed = 3}, kCpu);
  CHECK(img.rows() == 0);  // an endless stream
  CHECK(img.input_shape() == Shape{2, 4, 4});
  CHECK(img.target_shape() == Shape{});
  std::vector<int32_t> labels(3);
  std::vector<float> px(3 * 32);
  img.gather_host(std::vector<int64_t>{100, 7, 8}, {px.data(), nullptr, labels.data()});
  CHECK(labels[0] == img.batch(100, 1).y.to_host_i32()[0]);
  CHECK(std::vector<int32_t>(labels.begin() + 1, labels.end()) == img.batch(7, 2).y.to_host_i32());
  const Batch ib = img.empty_batch(3, kCpu);
  CHECK(ib.x.shape() == Shape{3, 2, 4, 4});
  CHECK(ib.y.dtype() == DType::i32);
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

using namespace dpt::test;  // the comparisons against the CPU: host, gpu, on, compare...

TEST_CASE("data sets gather rows into GPU batches as they gather them on the host", "[gpu][data]") {
  // An array data set (float16 inputs, labels) and a synthetic one on the CPU.
  std::vector<uint16_t> x(9 * 5);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint16_t>(0x3c00 + i);  // 1.0 and up
  const std::vector<int64_t> y = {4, 0, 3, 1, 2, 0, 1, 4, 3};
  const data::ArrayDataset a({x.data(), data::ArrayDType::f16, {9, 5}}, {y.data(), data::ArrayDType::i64, {9}});
  const data::Synthetic s({.task = data::Task::regression, .in = 5, .out = 2, .seed = 3, .samples = 30}, host);
  const std::vector<int64_t> rows = {8, 1, 2, 2, 7};
  for (const data::Dataset* d : {static_cast<const data::Dataset*>(&a), static_cast<const data::Dataset*>(&s)}) {
    INFO(d->inputs_name());
    data::Batch on_host = d->empty_batch(5, host), on_gpu = d->empty_batch(5, gpu);
    d->gather(rows, on_host);
    d->gather(rows, on_gpu);
    CHECK(on_gpu.x.device() == gpu);
    CHECK(on_gpu.x.to_host() == on_host.x.to_host());
    if (d->task() == data::Task::classification) CHECK(on_gpu.y.to_host_i32() == on_host.y.to_host_i32());
    else CHECK(on_gpu.y.to_host() == on_host.y.to_host());
    const data::Batch b = d->batch(6, 5, gpu), h = d->batch(6, 5, host);  // wraps around the array's 9 rows
    CHECK(b.x.device() == gpu);
    CHECK(b.x.to_host() == h.x.to_host());
  }
}

#endif  // DPT_GPU_TESTS
