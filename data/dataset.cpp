#include <dptrain/data/dataset.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include <dptrain/data/npy.hpp>
#include <dptrain/error.hpp>
#include "common/text.hpp"
#include "kernels/bf16.hpp"
#include "safetensors.hpp"

namespace dpt::data {

static_assert(std::endian::native == std::endian::little, "array files are little-endian and read as they lie");

namespace {

// ---- Elements -----------------------------------------------------------------------

template <class T>
T load(const uint8_t* p) {  // unaligned: safetensors packs tensors back to back
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// IEEE half to float, exactly (every half is a float).
float half_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | man << 13);  // infinity, NaN
  return bits_float(sign | (exp + 112) << 23 | man << 13);
}

// x / 255 for every uint8 (one correctly rounded division each, made once).
const std::array<float, 256>& u8_scale() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[static_cast<size_t>(i)] = static_cast<float>(i) / 255.0f;
    return t;
  }();
  return table;
}

// The element at p as a double, for messages and label checks.
double element(const uint8_t* p, ArrayDType t) {
  switch (t) {
    case ArrayDType::f32:
      return load<float>(p);
    case ArrayDType::f64:
      return load<double>(p);
    case ArrayDType::f16:
      return half_float(load<uint16_t>(p));
    case ArrayDType::bf16:
      return bf16_float(load<uint16_t>(p));
    case ArrayDType::u8:
      return *p;
    case ArrayDType::i32:
      return load<int32_t>(p);
    case ArrayDType::i64:
      return static_cast<double>(load<int64_t>(p));
    case ArrayDType::u16:
      return load<uint16_t>(p);
    case ArrayDType::u32:
      return load<uint32_t>(p);
  }
  return 0;
}

int64_t label(const uint8_t* p, ArrayDType t) {
  if (t == ArrayDType::u8) return *p;
  if (t == ArrayDType::u16) return load<uint16_t>(p);
  if (t == ArrayDType::u32) return load<uint32_t>(p);
  if (t == ArrayDType::i32) return load<int32_t>(p);
  return load<int64_t>(p);
}

// Index of the first non-finite float of v[0, n), or -1. The first pass has no branch to
// mispredict and vectorizes; the second runs only for a row that has one.
int64_t first_nonfinite(const float* v, int64_t n) {
  uint32_t any = 0;
  for (int64_t i = 0; i < n; ++i) any |= (float_bits(v[i]) & 0x7f800000u) == 0x7f800000u;
  if (!any) return -1;
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(v[i])) return i;
  return -1;
}

// n integers of type T at p as floats at out, by value.
template <class T>
void integers_as_float(const uint8_t* p, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(load<T>(p + sizeof(T) * static_cast<size_t>(i)));
}

// The same for the wider integer types (int32, int64, uint16, uint32).
void integers_to_float(const uint8_t* p, ArrayDType t, int64_t n, float* out) {
  if (t == ArrayDType::i32) return integers_as_float<int32_t>(p, n, out);
  if (t == ArrayDType::i64) return integers_as_float<int64_t>(p, n, out);
  if (t == ArrayDType::u16) return integers_as_float<uint16_t>(p, n, out);
  integers_as_float<uint32_t>(p, n, out);
}

// n elements of `t` at p as floats at out (uint8 scaled to [0, 1] when `scale_u8`).
// Returns the index of the first that is not finite as a float when `check`, else -1
// (integers always are finite).
int64_t to_float(const uint8_t* p, ArrayDType t, int64_t n, float* out, bool scale_u8, bool check) {
  switch (t) {
    case ArrayDType::f32:
      std::memcpy(out, p, static_cast<size_t>(n) * 4);
      return check ? first_nonfinite(out, n) : -1;
    case ArrayDType::f64:
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(load<double>(p + 8 * i));
      return check ? first_nonfinite(out, n) : -1;
    case ArrayDType::f16:
      for (int64_t i = 0; i < n; ++i) out[i] = half_float(load<uint16_t>(p + 2 * i));
      return check ? first_nonfinite(out, n) : -1;
    case ArrayDType::bf16:
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_float(load<uint16_t>(p + 2 * i));
      return check ? first_nonfinite(out, n) : -1;
    case ArrayDType::u8:
      if (scale_u8) {
        const auto& s = u8_scale();
        for (int64_t i = 0; i < n; ++i) out[i] = s[p[i]];
      } else {
        for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
      }
      return -1;
    case ArrayDType::i32:
    case ArrayDType::i64:
    case ArrayDType::u16:
    case ArrayDType::u32:
      integers_to_float(p, t, n, out);
      return -1;
  }
  return -1;
}

// v as printf's %.9g writes it: "0.04", "-1e+300".
std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// "x[17, 3]": element k of row `row` of an array of `shape`.
std::string element_text(const std::string& name, const std::vector<int64_t>& shape, int64_t row, int64_t k) {
  std::vector<int64_t> index(shape.size() - 1);
  for (size_t d = shape.size() - 1; d >= 1; --d) {
    index[d - 1] = k % shape[d];
    k /= shape[d];
  }
  std::string s = name + "[" + std::to_string(row);
  for (int64_t i : index) s += ", " + std::to_string(i);
  return s + "]";
}

std::string value_text(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return number(v) + ", beyond float32's range";
}

}  // namespace

// ---- Dataset ------------------------------------------------------------------------

Batch Dataset::empty_batch(int64_t n, const Device& device) const {
  Shape xs = input_shape();
  xs.insert(xs.begin(), n);
  Batch b;
  b.x = Tensor::empty(xs, input_dtype(), device);
  if (has_targets()) {
    Shape ys = target_shape();
    ys.insert(ys.begin(), n);
    b.y = Tensor::empty(ys, target_dtype(), device);
  }
  return b;
}

void check_labels(const Dataset& d, std::span<const int64_t> rows, const int32_t* labels, int64_t classes) {
  for (size_t i = 0; i < rows.size(); ++i)
    if (labels[i] < 0 || (classes > 0 && labels[i] >= classes))
      throw DataError(d.targets_name() + "[" + std::to_string(rows[i]) + "] is " + std::to_string(labels[i]) +
                      (classes > 0 ? ", outside [0, " + std::to_string(classes) + "): the model has " +
                                         std::to_string(classes) + " classes"
                                   : std::string(": a class label is at least 0")));
}

void Dataset::gather(std::span<const int64_t> rows, const Batch& into, int64_t classes) const {
  const auto n = static_cast<int64_t>(rows.size());
  auto check = [&](const Tensor& t, Shape row, DType dtype, const char* what) {
    row.insert(row.begin(), n);
    DPT_CHECK(t.defined() && t.dtype() == dtype && t.shape() == row,
              std::string("Dataset::gather: ") + what + " is not " + dtype_name(dtype) + shape_str(row));
  };
  check(into.x, input_shape(), input_dtype(), "x");
  if (into.y.defined()) {
    DPT_CHECK(has_targets(), "Dataset::gather: the data set has no targets");
    check(into.y, target_shape(), target_dtype(), "y");
  }
  const bool int_targets = into.y.defined() && into.y.dtype() == DType::i32;
  // Class labels index the model's scores: checked here (a language model's data set checks
  // its tokens itself, as it gathers them).
  const bool labels = int_targets && task() == Task::classification;
  auto host_rows = [&](const Batch& b) {
    const bool int_x = b.x.dtype() == DType::i32;
    return HostRows{int_x ? nullptr : b.x.f32(), b.y.defined() && !int_targets ? b.y.f32() : nullptr,
                    int_targets ? b.y.i32() : nullptr, int_x ? b.x.i32() : nullptr};
  };
  if (into.x.device().is_cpu() && (!into.y.defined() || into.y.device().is_cpu())) {
    gather_host(rows, host_rows(into));
    if (labels) check_labels(*this, rows, into.y.i32(), classes);
    return;
  }
  // A GPU's tensors are filled from host memory (the caching allocator's, on the CPU).
  const Device host{};
  Batch staged;
  staged.x = Tensor::empty(into.x.shape(), into.x.dtype(), host);
  if (into.y.defined()) staged.y = Tensor::empty(into.y.shape(), into.y.dtype(), host);
  gather_host(rows, host_rows(staged));
  if (labels) check_labels(*this, rows, staged.y.i32(), classes);
  copy(into.x, staged.x);
  if (into.y.defined()) copy(into.y, staged.y);
}

Batch Dataset::batch(int64_t first, int64_t count, const Device& device) const {
  const int64_t n = rows();
  if (!(first >= 0 && count > 0 && (n > 0 || count <= std::numeric_limits<int64_t>::max() - first)))
    throw UsageError("Dataset::batch: " + std::to_string(count) + " rows from row " + std::to_string(first));
  Batch b = empty_batch(count, device);  // OutOfMemory naming the sizes, before a host list of the rows
  std::vector<int64_t> list(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) list[static_cast<size_t>(i)] = n > 0 ? (first % n + i) % n : first + i;
  gather(list, b);
  return b;
}

void Dataset::check_model(const Shape& input, Task task, int64_t outputs) const {
  if (input_shape() != input)
    throw UsageError(inputs_name() + " has rows of " + shape_str(input_shape()) + ", the model takes " +
                     shape_str(input));
  if (!has_targets()) return;
  if (this->task() != task && (task == Task::language_model || this->task() == Task::language_model))
    throw UsageError(targets_name() + " holds " +
                     (this->task() == Task::language_model ? std::string("tokens (a language model's data)")
                                                           : std::string(task_name(this->task())) + " targets") +
                     ", but the task is " + task_name(task));
  if (this->task() != task) {
    if (task == Task::regression)
      throw UsageError(targets_name() + " holds class labels (integers), but the task is regression");
    throw UsageError(targets_name() + " holds float targets, but the task is classification (class labels are " +
                     "integers, one a row)");
  }
  if (task == Task::regression && target_shape() != Shape{outputs})
    throw UsageError(targets_name() + " has rows of " + shape_str(target_shape()) + ", the model gives " +
                     shape_str(Shape{outputs}));
}

// ---- ArrayDataset -------------------------------------------------------------------

ArrayDataset::ArrayDataset(const Array& x, const Array& y) { init(x, y); }

void ArrayDataset::init(const Array& x, const Array& y) {
  auto bad_x = [&](const std::string& problem) { throw UsageError(inputs_name() + " " + problem); };
  auto bad_y = [&](const std::string& problem) { throw UsageError(targets_name() + " " + problem); };
  const std::string x_is = "is " + std::string(array_dtype_name(x.dtype)) + " " + shape_text(x.shape);
  if (x.data == nullptr && element_count(x.shape) != 0) bad_x("has no data");
  if (element_count(x.shape) < 0) bad_x("has an invalid shape " + shape_text(x.shape));
  if (x.shape.size() != 2 && x.shape.size() != 4) bad_x(x_is + ", not [N, features] or [N, C, H, W]");
  if (x.shape[0] == 0) bad_x("has no rows");
  x_width_ = element_count({x.shape.begin() + 1, x.shape.end()});
  if (x_width_ == 0) bad_x(x_is + ": its rows are empty");
  x_ = x;
  rows_ = x.shape[0];
  finite_.reset(new std::atomic<uint64_t>[static_cast<size_t>((rows_ + 31) / 32)]());
  if (y.data == nullptr && y.shape.empty()) return;  // inputs alone
  const std::string y_is = "is " + std::string(array_dtype_name(y.dtype)) + " " + shape_text(y.shape);
  if (y.data == nullptr && element_count(y.shape) != 0) bad_y("has no data");
  if (element_count(y.shape) < 0) bad_y("has an invalid shape " + shape_text(y.shape));
  labels_ = is_integer(y.dtype);
  if (labels_ && y.shape.size() != 1)
    bad_y(y_is + ": integer targets are class labels, one a row ([N]); float targets [N, outputs] are regression");
  if (!labels_ && y.shape.size() != 1 && y.shape.size() != 2) bad_y(y_is + ", not [N, outputs] or [N]");
  if (y.shape[0] != rows_) {
    const std::string x_rows = x_source_ == y_source_ ? x_name_ : inputs_name();
    bad_y("has " + std::to_string(y.shape[0]) + " rows, " + x_rows + " has " + std::to_string(rows_));
  }
  y_width_ = y.shape.size() == 2 ? y.shape[1] : 1;
  if (y_width_ == 0) bad_y(y_is + ": its rows are empty");
  y_ = y;
  if (labels_) {
    // The loss indexes with the labels: a negative one, or one past int32, is refused
    // here; one past the model's classes by check_model.
    const auto* p = static_cast<const uint8_t*>(y.data);
    const size_t size = array_dtype_size(y.dtype);
    for (int64_t r = 0; r < rows_; ++r) {
      const int64_t v = label(p + static_cast<size_t>(r) * size, y.dtype);
      if (v < 0 || v > std::numeric_limits<int32_t>::max())
        bad_y("has the label " + std::to_string(v) + " in row " + std::to_string(r) + ": class labels are " +
              (v < 0 ? "at least 0" : "0 to " + std::to_string(std::numeric_limits<int32_t>::max())));
    }
  }
}

ArrayDataset ArrayDataset::from_npy(const std::string& x_path, const std::string& y_path) {
  ArrayDataset d;
  const NpyFile x(x_path);
  d.x_source_ = "data file '" + x_path + "'";
  d.mappings_.push_back(x.mapping());
  d.files_.push_back(x.identity());
  if (y_path.empty()) {
    d.init(x.array(), Array{});
    return d;
  }
  const NpyFile y(y_path);
  d.y_source_ = "data file '" + y_path + "'";
  d.mappings_.push_back(y.mapping());
  d.files_.push_back(y.identity());
  d.init(x.array(), y.array());
  return d;
}

DataSplit ArrayDataset::from_safetensors(const std::string& path) {
  namespace sft = safetensors;
  auto file = std::make_shared<const MappedFile>(path);
  const sft::Source src{"data file", path, true};
  sft::check_file_size(file->size(), src);
  const uint64_t n = sft::header_length(file->data(), file->size(), src);
  const std::vector<ArrayDType> all = {ArrayDType::f32, ArrayDType::f64, ArrayDType::f16, ArrayDType::bf16,
                                       ArrayDType::u8,  ArrayDType::i32, ArrayDType::i64};
  const sft::Header h = sft::read_header(file->data() + sft::kLenBytes, n, file->size(), all, src);
  const uint8_t* base = file->data() + sft::kLenBytes + n;
  const Array* x = nullptr;
  const Array* y = nullptr;
  const Array* x_val = nullptr;
  const Array* y_val = nullptr;
  std::vector<Array> arrays(h.entries.size());
  for (size_t i = 0; i < h.entries.size(); ++i) {
    const sft::Entry& e = h.entries[i];
    arrays[i] = {base + e.begin, e.dtype, e.shape};
    const Array** slot = e.name == "x"       ? &x
                         : e.name == "y"     ? &y
                         : e.name == "x_val" ? &x_val
                         : e.name == "y_val" ? &y_val
                                             : nullptr;
    if (!slot)
      src.fail("tensor " + printable(e.name) + " is not one of a data file's: x, y and optionally x_val, y_val");
    *slot = &arrays[i];
  }
  if (!x) src.fail("no tensor 'x' (a data file holds x, y and optionally x_val, y_val)");
  if ((x_val != nullptr) != (y_val != nullptr))
    src.fail(x_val ? "tensor 'x_val' without 'y_val'" : "tensor 'y_val' without 'x_val'");
  if (y_val && !y) src.fail("tensor 'y_val' without 'y'");
  auto make = [&](const Array* xs, const Array* ys, const char* x_name, const char* y_name) {
    ArrayDataset d;
    d.x_source_ = d.y_source_ = "data file '" + path + "'";
    d.x_name_ = x_name, d.y_name_ = y_name;
    d.mappings_ = {file};
    d.files_ = {file_identity(*file, sft::kLenBytes + n)};
    d.init(*xs, ys ? *ys : Array{});
    return d;
  };
  DataSplit split{make(x, y, "x", "y"), std::nullopt};
  if (x_val) {
    split.val = make(x_val, y_val, "x_val", "y_val");
    const ArrayDataset& t = split.train;
    const ArrayDataset& v = *split.val;
    if (v.input_shape() != t.input_shape())
      src.fail("rows of x_val are " + shape_str(v.input_shape()) + ", rows of x " + shape_str(t.input_shape()));
    if (v.task() != t.task() || v.target_shape() != t.target_shape())
      src.fail("y_val (" + std::string(array_dtype_name(y_val->dtype)) + " " + shape_text(y_val->shape) +
               ") does not hold the targets y does (" + array_dtype_name(y->dtype) + " " + shape_text(y->shape) + ")");
  }
  return split;
}

namespace {
[[noreturn]] void no_arrays() { throw UsageError("an ArrayDataset without its arrays (it was moved from)"); }
}  // namespace

Shape ArrayDataset::input_shape() const {
  if (x_.shape.empty()) no_arrays();
  return {x_.shape.begin() + 1, x_.shape.end()};
}

Shape ArrayDataset::target_shape() const {
  if (!has_targets() || labels_) return {};
  return {y_width_};
}

void ArrayDataset::gather_host(std::span<const int64_t> rows, const HostRows& into) const {
  if (!finite_) no_arrays();
  DPT_CHECK(!into.y || (has_targets() && !labels_), "ArrayDataset::gather_host: no regression targets to gather");
  DPT_CHECK(!into.labels || (has_targets() && labels_), "ArrayDataset::gather_host: no class labels to gather");
  DPT_CHECK(!into.x_i32, "ArrayDataset::gather_host: its inputs are gathered as floats");
  const auto* xp = static_cast<const uint8_t*>(x_.data);
  const auto* yp = static_cast<const uint8_t*>(y_.data);
  const size_t x_row = static_cast<size_t>(x_width_) * array_dtype_size(x_.dtype);
  const size_t y_row = static_cast<size_t>(y_width_) * array_dtype_size(y_.dtype);
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t r = rows[i];
    if (r < 0 || r >= rows_)
      throw Error("ArrayDataset::gather_host: row " + std::to_string(r) + " is outside [0, " + std::to_string(rows_) +
                  ")");
    const auto at = static_cast<size_t>(first_ + r);
    // Bits 2 at and 2 at + 1 of the finite map: this row's inputs, its targets were checked.
    std::atomic<uint64_t>& word = finite_[at / 32];
    const uint64_t x_bit = uint64_t(1) << (2 * (at % 32)), y_bit = x_bit << 1;
    const uint64_t known = word.load(std::memory_order_relaxed);
    if (into.x) {
      const uint8_t* src = xp + at * x_row;
      const bool check = !(known & x_bit);
      const int64_t bad = to_float(src, x_.dtype, x_width_, into.x + i * static_cast<size_t>(x_width_), true, check);
      if (bad >= 0)
        throw DataError(x_source_ + ": " + element_text(x_name_, x_.shape, first_ + r, bad) + " is " +
                        value_text(element(src + static_cast<size_t>(bad) * array_dtype_size(x_.dtype), x_.dtype)) +
                        " (non-finite inputs are refused)");
      if (check) word.fetch_or(x_bit, std::memory_order_relaxed);
    }
    if (into.y) {
      const uint8_t* src = yp + at * y_row;
      const bool check = !(known & y_bit);
      const int64_t bad = to_float(src, y_.dtype, y_width_, into.y + i * static_cast<size_t>(y_width_), false, check);
      if (bad >= 0) {
        const std::vector<int64_t> shape = {y_.shape[0], y_width_};
        throw DataError(y_source_ + ": " + element_text(y_name_, shape, first_ + r, bad) + " is " +
                        value_text(element(src + static_cast<size_t>(bad) * array_dtype_size(y_.dtype), y_.dtype)) +
                        " (non-finite targets are refused)");
      }
      if (check) word.fetch_or(y_bit, std::memory_order_relaxed);
    }
    if (into.labels) into.labels[i] = static_cast<int32_t>(label(yp + at * y_row, y_.dtype));
  }
}

void ArrayDataset::check_model(const Shape& input, Task task, int64_t outputs) const {
  Dataset::check_model(input, task, outputs);
  if (!has_targets() || task != Task::classification) return;
  const auto* p = static_cast<const uint8_t*>(y_.data);
  const size_t size = array_dtype_size(y_.dtype);
  for (int64_t r = first_; r < first_ + rows_; ++r) {
    const int64_t v = label(p + static_cast<size_t>(r) * size, y_.dtype);
    if (v >= outputs)
      throw UsageError(y_source_ + ": " + y_name_ + "[" + std::to_string(r) + "] is " + std::to_string(v) +
                       ", outside [0, " + std::to_string(outputs) + "): the model has " + std::to_string(outputs) +
                       " classes");
  }
}

std::string ArrayDataset::origin() const {
  std::string id = first_ > 0 ? "from row " + std::to_string(first_) + ", " : "";
  if (files_.empty()) return id + Dataset::origin();
  return id + identities_text(files_);
}

ArrayDataset ArrayDataset::slice(int64_t first, int64_t count) const {
  if (first < 0 || count < 1 || first > rows_ - count)
    throw UsageError(inputs_name() + ": rows [" + std::to_string(first) + ", " + std::to_string(first + count) +
                     ") are not a slice of its " + std::to_string(rows_) + " rows");
  ArrayDataset d = *this;
  d.first_ = first_ + first;
  d.rows_ = count;
  return d;
}

DataSplit ArrayDataset::split(double val_fraction) const {
  if (!(val_fraction > 0.0 && val_fraction < 1.0))
    throw UsageError("a validation fraction must be in (0, 1), got " + number(val_fraction));
  // Rounded half up, so that 0.3 of 10 rows is 3 even though 0.3 * 10 is 3.0000000000000004.
  const auto val = static_cast<int64_t>(std::floor(val_fraction * static_cast<double>(rows_) + 0.5));
  if (val < 1 || val >= rows_)
    throw UsageError(inputs_name() + ": a validation fraction of " + number(val_fraction) + " of its " +
                     std::to_string(rows_) + " rows leaves " + (val < 1 ? "no validation rows" : "no training rows"));
  return {slice(0, rows_ - val), slice(rows_ - val, val)};
}

void ArrayDataset::check_every_row() const {
  std::vector<float> row(static_cast<size_t>(std::max(x_width_, y_width_)));
  for (int64_t r = 0; r < rows_; ++r) {
    const int64_t list[] = {r};
    gather_host(list, {row.data(), nullptr, nullptr});
    if (has_targets() && !labels_) gather_host(list, {nullptr, row.data(), nullptr});
  }
}

}  // namespace dpt::data
