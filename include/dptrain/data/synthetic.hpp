// Synthetic data: every sample is a pure function of (seed, sample index), made on any
// device with the counter-based Philox generator, so a run's data does not depend on
// how many devices share it. Inputs are standard normal; targets come from a fixed
// random teacher network x -> W2 tanh(W1 x): regression adds Gaussian noise to its
// output, classification takes its argmax as the label. Images ([n, C, H, W], for CNNs)
// are labelled by a teacher CNN built from the same ops, so it runs on any device:
// x -> W2 avgpool(tanh(conv3x3(x, W1))), the argmax of its output.
#pragma once
#include <cstdint>

#include <dptrain/data/batch.hpp>
#include <dptrain/runtime/tensor.hpp>

namespace dpt::data {

struct SyntheticConfig {
  Task task = Task::regression;
  int64_t in = 0;   // input width (images: C * H * W, filled in from `image`)
  int64_t out = 0;  // output width (number of classes for classification)
  Shape image{};    // [C, H, W] for image classification; empty for vectors
  uint64_t seed = 1;
  int64_t samples = 0;          // dataset size; 0 = an endless stream of new samples
  float noise = 0.05f;          // regression target noise (standard deviation)
  int64_t teacher_hidden = 64;  // the teacher's hidden width, or its channels for images
};

class Synthetic {
 public:
  // The teacher's weights are made on the host from the seed and copied to `device`.
  Synthetic(const SyntheticConfig& config, const Device& device);
  // Samples first .. first + count - 1 (wrapping around a finite dataset), on the device.
  Batch batch(int64_t first, int64_t count) const;
  const SyntheticConfig& config() const { return cfg_; }

 private:
  void fill_inputs(const Tensor& x, int64_t first) const;
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
