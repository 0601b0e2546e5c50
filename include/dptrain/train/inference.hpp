// A trained model from its checkpoint, replicated over devices, for what comes after
// training: the loss and accuracy on a data set (dptrain eval) and outputs for every row
// (dptrain predict), computed without gradients on every device at once, `batch` rows at
// a time, with batch norm in evaluation mode.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <dptrain/data/array.hpp>
#include <dptrain/data/dataset.hpp>
#include <dptrain/layers/model_spec.hpp>
#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/train/trainer.hpp>

namespace dpt {

struct InferenceConfig {
  std::string checkpoint;       // a dptrain checkpoint (the model, its activation and task)
  std::vector<Device> devices;  // empty: every GPU there is, else the CPU
  int64_t batch = 1024;         // rows a device computes at a time: memory, not results
  Precision precision = Precision::fp32;
  GemmImpl gemm = GemmImpl::cublas;
};

class Inference {
 public:
  // Throws UsageError for a bad config or a checkpoint that is not a dptrain model's.
  explicit Inference(InferenceConfig cfg);
  ~Inference();
  Inference(const Inference&) = delete;
  Inference& operator=(const Inference&) = delete;

  const nn::ModelSpec& spec() const { return spec_; }
  data::Task task() const { return task_; }
  const std::string& model_text() const { return model_; }
  const InferenceConfig& config() const { return cfg_; }
  // Throws UsageError (one line naming both) when `d` cannot feed this model.
  void check(const data::Dataset& d) const;
  // Loss and, for classification, accuracy over every row of `d` (which needs targets).
  EvalResult evaluate(const data::Dataset& d);
  // The model's outputs for every row of `d`, row-major [rows, outputs] (regression
  // values, or classification scores before the softmax).
  std::vector<float> predict(const data::Dataset& d);

 private:
  InferenceConfig cfg_;
  nn::ModelSpec spec_;
  std::string model_;
  data::Task task_ = data::Task::regression;
  std::unique_ptr<DataParallel> dp_;
};

// `array` written to `path` as a .npy file, atomically (a temporary file renamed over
// the target, as checkpoints are); errors are dpt::Error "cannot write 'PATH': ...".
void write_npy_file(const std::string& path, const data::Array& array);

}  // namespace dpt
