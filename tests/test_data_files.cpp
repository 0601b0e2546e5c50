// Data files (<dptrain/data/npy.hpp>, safetensors data files): .npy files round-trip for
// every dtype and format version; hostile .npy headers and safetensors data files are
// refused with one line naming the file and the problem (every truncation and thousands of
// random mutations included), FIFOs, devices and directories without blocking; a file's
// identity is its size and the hash of its header. (CPU only: dpt_tests.)

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
#include "data_common.hpp"

using namespace dpt;
using namespace dpt::data;
using namespace dpt::test_data;
namespace fs = std::filesystem;

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
  const std::vector<uint16_t> u16 = {0, 1, 255, 256, 50256, 65535};
  const std::vector<uint32_t> u32 = {0, 1, 65536, 50257, 1u << 31, 4294967295u};
  const std::vector<Array> arrays = {
      array_of(f32, ArrayDType::f32, {2, 3}), array_of(f64, ArrayDType::f64, {3, 2}),
      array_of(f16, ArrayDType::f16, {6}),    array_of(u8, ArrayDType::u8, {1, 2, 3}),
      array_of(i32, ArrayDType::i32, {6, 1}), array_of(i64, ArrayDType::i64, {1, 1, 2, 3}),
      array_of(u16, ArrayDType::u16, {6}),    array_of(u32, ArrayDType::u32, {3, 2}),
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
         "unsupported dtype '<c8' (dptrain reads '<f4', '<f8', '<f2', '|u1', '<u2', '<u4', '<i4' and '<i8')"},
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

// ---- safetensors data files ------------------------------------------------------

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
