// Synthetic data: every sample is a pure function of (seed, sample index), made on any
// device with the counter-based Philox generator, so a run's data does not depend on
// how many devices share it. Inputs are standard normal; targets come from a fixed
// random teacher network x -> W2 tanh(W1 x): regression adds Gaussian noise to its
// output, classification takes its argmax as the label. Images ([n, C, H, W], for CNNs)
// are labelled by a teacher CNN built from the same ops, so it runs on any device:
// x -> W2 avgpool(tanh(conv3x3(x, W1))), the argmax of its output.
//
// For a language model (Task::language_model) the data are random tokens: sample s is
// tokens s*T .. s*T+T of a stream of tokens uniform in [0, out), its inputs the first T and
// its targets the last T (each input's next token), as a window of token files is; in = T.
// Nothing in them can be learnt beyond the uniform distribution: they are for measuring.
//
// Synthetic is a Dataset (dataset.hpp): rows() is its size (0 for an endless stream), and
// gathering any list of rows makes each contiguous run of them on its own device.
#pragma once
#include <cstdint>
#include <span>
#include <string>

#include <dptrain/data/batch.hpp>
#include <dptrain/data/dataset.hpp>
#include <dptrain/runtime/tensor.hpp>

namespace dpt::data {

struct SyntheticConfig {
  Task task = Task::regression;
  int64_t in = 0;   // input width (images: C * H * W, filled in from `image`; tokens: T)
  int64_t out = 0;  // output width (number of classes for classification, the vocabulary for tokens)
  Shape image{};    // [C, H, W] for image classification; empty for vectors
  uint64_t seed = 1;
  int64_t samples = 0;          // dataset size; 0 = an endless stream of new samples
  float noise = 0.05f;          // regression target noise (standard deviation)
  int64_t teacher_hidden = 64;  // the teacher's hidden width, or its channels for images
};

class Synthetic : public Dataset {
 public:
  // The teacher's weights are made on the host from the seed and copied to `device`.
  Synthetic(const SyntheticConfig& config, const Device& device);
  // Samples first .. first + count - 1 (wrapping around a finite dataset), on the device.
  Batch batch(int64_t first, int64_t count) const;
  // The `count` samples of a RowMap (its `samples` is this set's), made in one pass of
  // each op: a replica's part of several steps' batches at once. `into`, when given (a
  // batch of `count` rows as empty_batch makes), is where they are made (the same bits):
  // a CUDA graph's inputs, so that no copy moves them there.
  Batch rows(const RowMap& map, int64_t count, const Batch& into = {}) const;
  const SyntheticConfig& config() const { return cfg_; }

  // The Dataset interface. Rows are made on this object's device and copied where they
  // are asked for.
  int64_t rows() const override { return cfg_.samples; }
  Shape input_shape() const override;
  DType input_dtype() const override { return cfg_.task == Task::language_model ? DType::i32 : DType::f32; }
  bool has_targets() const override { return true; }
  Task task() const override { return cfg_.task; }
  Shape target_shape() const override;
  std::string inputs_name() const override { return "synthetic data: x"; }
  std::string targets_name() const override { return "synthetic data: y"; }
  void gather_host(std::span<const int64_t> rows, const HostRows& into) const override;
  void gather(std::span<const int64_t> rows, const Batch& into, int64_t classes = 0) const override;
  Batch batch(int64_t first, int64_t count, const Device& device) const override;

 private:
  // Calls f(at, first, count) for each run of consecutive samples in `rows`: rows[at ..
  // at + count) are samples first .. first + count - 1.
  template <class F>
  void for_runs(std::span<const int64_t> rows, F&& f) const;
  // Language models: the tokens of `count` samples of `map` (x) and their next tokens (y),
  // made on this object's device (a kernel on a GPU, the same tokens as the CPU's), into
  // `into` when given.
  Batch token_rows(const RowMap& map, int64_t count, const Batch& into) const;
  SyntheticConfig cfg_;
  Device device_;
  Tensor w1_, w2_;
};

// Labels in [0, classes) for samples first .. first + count - 1, uniform from the Philox
// stream (seed, stream): each a function of its sample index alone. The benchmarks'
// fixed classification batches.
Tensor random_labels(int64_t count, int64_t classes, uint64_t seed, uint64_t stream, int64_t first,
                     const Device& device);

}  // namespace dpt::data
