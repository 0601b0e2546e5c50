// Data sets (<dptrain/data/...>): rows gather to the files' values through every
// conversion; host arrays are used in place; labels out of range and non-finite values are
// refused naming the element; the validation split; the epochs' permutations are
// permutations that depend on (seed, epoch) alone; and the synthetic sources answer as a
// Dataset too. On the GPU: rows gathered into GPU batches as on the host. (The file
// formats themselves: test_data_files.cpp.)

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
namespace fs = std::filesystem;
using test::gpu;

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

using namespace dpt::test_data;

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
  const std::vector<uint16_t> u16 = {0, 1, 65535, 300};
  const std::vector<uint32_t> u32 = {0, 1, 4294967295u, 16777217u};
  CHECK(x_of(array_of(u16, ArrayDType::u16, {2, 2})) == std::vector<float>{0, 1, 65535, 300});
  CHECK(x_of(array_of(u32, ArrayDType::u32, {1, 4})) == std::vector<float>{0, 1, 4294967296.0f, 16777216.0f});

  const std::vector<float> x(8, 1.0f);
  const Array xa = array_of(x, ArrayDType::f32, {4, 2});
  const std::vector<uint8_t> l8 = {3, 0, 255, 1};
  const std::vector<int32_t> l32 = {3, 0, 255, 1};
  const std::vector<int64_t> l64 = {3, 0, 255, std::numeric_limits<int32_t>::max()};
  CHECK(all_labels(ArrayDataset(xa, array_of(l8, ArrayDType::u8, {4}))) == std::vector<int32_t>{3, 0, 255, 1});
  CHECK(all_labels(ArrayDataset(xa, array_of(l32, ArrayDType::i32, {4}))) == std::vector<int32_t>{3, 0, 255, 1});
  CHECK(all_labels(ArrayDataset(xa, array_of(l64, ArrayDType::i64, {4}))) ==
        std::vector<int32_t>{3, 0, 255, std::numeric_limits<int32_t>::max()});
  const std::vector<uint16_t> lu16 = {3, 0, 65535, 1};
  const std::vector<uint32_t> lu32 = {3, 0, 255, 2147483647u}, too_large = {3, 0, 2147483648u, 1};
  CHECK(all_labels(ArrayDataset(xa, array_of(lu16, ArrayDType::u16, {4}))) == std::vector<int32_t>{3, 0, 65535, 1});
  CHECK(all_labels(ArrayDataset(xa, array_of(lu32, ArrayDType::u32, {4}))) ==
        std::vector<int32_t>{3, 0, 255, std::numeric_limits<int32_t>::max()});
  CHECK(usage_error([&] { ArrayDataset(xa, array_of(too_large, ArrayDType::u32, {4})); }) ==
        "host arrays: y has the label 2147483648 in row 2: class labels are 0 to 2147483647");

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
       "host arrays: y has the label -1 in row 2: class labels are at least 0"},
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
  // check_every_row: the same, over every row, before any training. A row's fault is a
  // DataError (a step that meets one is abandoned before its update).
  CHECK(usage_error([&] { d.check_every_row(); }) == "host arrays: y[2, 1] is inf (non-finite targets are refused)");
  CHECK_THROWS_AS(d.check_every_row(), DataError);
  CHECK_THROWS_AS((void)d.batch(3, 2, kCpu), DataError);
  CHECK(usage_error([&] { d.slice(3, 2).check_every_row(); }) ==
        "host arrays: x[3, 1] is nan (non-finite inputs are refused)");
  CHECK(usage_error([&] { d.slice(4, 1).check_every_row(); }).empty());

  // Images name the element by its place; float64 past float32's range is refused too.
  std::vector<double> img(2 * 2 * 3 * 4, 0.0);
  img[1 * 24 + 1 * 12 + 2 * 4 + 3] = -1e300;
  const ArrayDataset im(array_of(img, ArrayDType::f64, {2, 2, 3, 4}), Array{});
  CHECK(usage_error([&] { im.check_every_row(); }) ==
        "host arrays: x[1, 1, 2, 3] is -1e+300, beyond float32's range (non-finite inputs are refused)");
  const std::vector<uint16_t> h = {0x3c00, 0x7e00};
  CHECK(usage_error([&] {
          ArrayDataset(array_of(h, ArrayDType::f16, {1, 2}), Array{}).check_every_row();
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
    CHECK(usage_error([&] { d.split(bad); }).rfind("a validation fraction must be in (0, 1), got ", 0) == 0);
  CHECK(usage_error([&] { d.split(0.04); }) ==
        "host arrays: x: a validation fraction of 0.04 of its 10 rows leaves no validation rows");
  CHECK(usage_error([&] { d.split(0.96); }) ==
        "host arrays: x: a validation fraction of 0.96 of its 10 rows leaves no training rows");
  CHECK(usage_error([&] { s.train.slice(5, 3); }) == "host arrays: x: rows [5, 8) are not a slice of its 7 rows");
  CHECK(!usage_error([&] { d.slice(-1, 2); }).empty());
  CHECK(!usage_error([&] { d.slice(0, 0); }).empty());
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
