// Data sets: rows of inputs and targets that the trainer draws batches from. A Dataset
// says how many rows it has, the shape of a row, what its targets are, and gathers any
// list of rows (a slice of an epoch's permutation, shuffle.hpp) into host buffers (an input
// pipeline's pinned buffers) or into a Batch on a device. An ArrayDataset's gathers are
// const and touch no shared state, so every replica's loader thread may gather from one at
// once; a Synthetic makes its rows with its device's ops (one a device, as the Trainer
// keeps them).
//
// TokenDataset (tokens.hpp) reads token files for language models: i32 windows of tokens.
//
// ArrayDataset holds arrays: memory-mapped .npy or safetensors files (never read whole:
// pages come in as rows are gathered) or arrays the embedding program owns. Its rows are
// converted as they are gathered: float64, float16 and bfloat16 inputs to float32, uint8
// inputs scaled to [0, 1] (x / 255), int32 and int64 inputs by value; integer targets are
// class labels, gathered as int32.
//
// Non-finite values (NaN, infinity) in the inputs or the regression targets are refused as
// the rows are gathered: the gather throws DataError naming the element (x[17, 3] is
// nan), so a file with a NaN stops training with that line before the value reaches a
// model, without a pass over the whole file at load (check_every_row() makes that pass,
// for a program that wants to refuse such a file up front).
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <dptrain/data/array.hpp>
#include <dptrain/data/batch.hpp>
#include <dptrain/runtime/device.hpp>
#include <dptrain/runtime/tensor.hpp>

namespace dpt::data {

// Host memory a gather writes into, for n rows; a null pointer skips that part. The inputs
// go to x or to x_i32 as the data set's input_dtype() says.
struct HostRows {
  float* x = nullptr;         // f32 inputs: n * numel(input_shape()) floats
  float* y = nullptr;         // regression targets: n * numel(target_shape()) floats
  int32_t* labels = nullptr;  // integer targets: n class labels, or n * numel(target_shape()) next tokens
  int32_t* x_i32 = nullptr;   // i32 inputs (tokens): n * numel(input_shape()) int32
};

class Dataset {
 public:
  virtual ~Dataset() = default;

  // Rows in the data set; 0 for an endless stream (synthetic data without a size).
  virtual int64_t rows() const = 0;
  // The shape of one input row: {features}, or {C, H, W} for images; {T} tokens.
  virtual Shape input_shape() const = 0;
  // The inputs' element type on a device: f32, or i32 for tokens (gathered into
  // HostRows::x_i32).
  virtual DType input_dtype() const { return DType::f32; }
  // Whether there are targets (inputs alone can still be predicted on).
  virtual bool has_targets() const = 0;
  // Regression: rows of target_shape() floats; classification: one class label a row;
  // language model: target_shape() next tokens a row.
  virtual Task task() const = 0;
  // The shape of one target row: {outputs} for regression, {} for a class label, {T} for
  // next tokens.
  virtual Shape target_shape() const = 0;
  // The targets' element type: f32 for regression, else i32 (HostRows::labels).
  DType target_dtype() const { return task() == Task::regression ? DType::f32 : DType::i32; }
  // How messages name the inputs and the targets: "data file 'x.npy': x",
  // "data file 'run.safetensors': y_val", "host arrays: y".
  virtual std::string inputs_name() const = 0;
  virtual std::string targets_name() const = 0;

  // Rows `rows` (each in [0, rows()), in any order, repeats allowed) into host memory.
  virtual void gather_host(std::span<const int64_t> rows, const HostRows& into) const = 0;
  // The same into tensors on any device, shaped as empty_batch makes them; an undefined
  // into.y skips the targets. A CPU device is written straight from the source; a GPU
  // through host memory and a copy on the tensor's stream. Class labels are checked on the
  // host (check_labels) against `classes` when it is > 0: a data set of the program's is
  // not read whole up front, and a label outside the model's classes would index outside
  // its scores.
  virtual void gather(std::span<const int64_t> rows, const Batch& into, int64_t classes = 0) const;
  // Rows first .. first + count - 1 (wrapping around the end of a finite data set), as a
  // new Batch on `device`.
  virtual Batch batch(int64_t first, int64_t count, const Device& device) const;
  // Uninitialized tensors for n rows on `device`: x [n, input...] of input_dtype(), y
  // [n, target...] of target_dtype() (undefined without targets).
  Batch empty_batch(int64_t n, const Device& device) const;

  // Throws UsageError with one line when this data cannot feed a model that takes rows of
  // `input` and gives `outputs` values (regression) or scores over `outputs` classes
  // (classification): naming both shapes (an ArrayDataset also the first label outside
  // [0, outputs); a data set of the program's has its labels checked as they are gathered).
  // Without targets only the inputs are checked.
  virtual void check_model(const Shape& input, Task task, int64_t outputs) const;
  // Checks every row now, after check_model, where the gathers would check each row as it
  // is first gathered (a TokenDataset's windows against the vocabulary, an ArrayDataset's
  // values for non-finite ones), throwing DataError at the first fault: for rows read
  // whole later on, a validation set, whose fault would otherwise end a run at its first
  // evaluation. Nothing for data sets that check_model checks whole.
  virtual void check_every_row() const {}

  // Whether gather_host may run on several threads at once (an ArrayDataset's may; a
  // data set of the program's, by default, is gathered by one thread at a time).
  virtual bool concurrent_gathers() const { return false; }
  // Where the rows come from, as far as a resumed run must find the same (a checkpoint
  // records it): "the program's arrays" for rows the program holds; an ArrayDataset over
  // files also says where its rows start in them and each file's size and header hash.
  virtual std::string origin() const { return "the program's arrays"; }
};

// DataError naming the row ("NAME[row] is 7, outside [0, 3): the model has 3 classes")
// when a gathered label is below 0, or not below `classes` where that is > 0. `labels`
// holds rows.size() labels gathered from d's rows `rows`.
void check_labels(const Dataset& d, std::span<const int64_t> rows, const int32_t* labels, int64_t classes);

struct DataSplit;

class ArrayDataset : public Dataset {
 public:
  // Arrays the program owns, not copied: they must outlive this data set and every slice
  // of it, and not change (each row is checked for non-finite values once, when first
  // gathered). x is [N, features] or [N, C, H, W]; y is [N, outputs] (or [N]: one output) of a
  // float type for regression, [N] of an integer type for class labels, or an Array with
  // no data and no shape for no targets. Throws UsageError ("host arrays: ...") for shapes
  // that do not fit, and for a negative label (naming its row).
  ArrayDataset(const Array& x, const Array& y);
  // x from one .npy file and y from another (or none: "").
  static ArrayDataset from_npy(const std::string& x_path, const std::string& y_path = {});
  // A safetensors file holding x and y, and optionally x_val and y_val (both or neither):
  // the validation rows, when there, are the split's val. y may be left out (inputs to
  // predict on; then neither y_val). No other tensor may be in the file.
  static DataSplit from_safetensors(const std::string& path);

  int64_t rows() const override { return rows_; }
  Shape input_shape() const override;
  bool has_targets() const override { return y_.data != nullptr; }
  Task task() const override { return labels_ ? Task::classification : Task::regression; }
  Shape target_shape() const override;
  std::string inputs_name() const override { return x_source_ + ": " + x_name_; }
  std::string targets_name() const override { return y_source_ + ": " + y_name_; }
  void gather_host(std::span<const int64_t> rows, const HostRows& into) const override;
  void check_model(const Shape& input, Task task, int64_t outputs) const override;
  bool concurrent_gathers() const override { return true; }
  // ("from row 100, " where a slice starts) "a file of 4096 bytes with header hash
  // 0123456789abcdef, a file of ..." (not the paths: files move), or the program's arrays.
  std::string origin() const override;

  // Rows [first, first + count) of this data set, sharing its arrays (and mappings).
  ArrayDataset slice(int64_t first, int64_t count) const;
  // The last round(val_fraction * rows()) rows as validation, the rows before them for
  // training: two slices, so the validation rows never enter a training permutation.
  // Throws UsageError unless 0 < val_fraction < 1 leaves rows on both sides.
  DataSplit split(double val_fraction) const;
  // Throws DataError naming the first non-finite input or regression target: one pass
  // over the data (a gather refuses them anyway, when it meets them).
  void check_every_row() const override;
  [[deprecated("check_every_row()")]] void check_finite() const { check_every_row(); }

  // The files the arrays are read from (none for host arrays), for checkpoints.
  const std::vector<FileIdentity>& files() const { return files_; }
  // Where this data set's rows start in its arrays (a slice's offset).
  int64_t first_row() const { return first_; }

 private:
  ArrayDataset() = default;
  // Checks the arrays and takes them (the sources and names are set before, for errors).
  void init(const Array& x, const Array& y);

  std::vector<std::shared_ptr<const MappedFile>> mappings_;  // what x_ and y_ point into
  Array x_, y_;                                              // the whole arrays
  bool labels_ = false;
  int64_t first_ = 0, rows_ = 0;
  int64_t x_width_ = 0, y_width_ = 0;  // elements a row
  std::string x_source_ = "host arrays", y_source_ = "host arrays", x_name_ = "x", y_name_ = "y";
  std::vector<FileIdentity> files_;
  // Two bits a row of the whole arrays: its inputs, its regression targets were found
  // finite. A row is checked when first gathered, not at every epoch (shared by slices).
  std::shared_ptr<std::atomic<uint64_t>[]> finite_;
};

// A data set's training rows and, when it has them, its validation rows.
struct DataSplit {
  ArrayDataset train;
  std::optional<ArrayDataset> val;
};

}  // namespace dpt::data
