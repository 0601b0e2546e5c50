// The training loop on one device: synthetic data, model, loss, optimizer, schedule and
// clipping wired together. dptrain's CLI is a thin layer over it, and tests use it to
// compare whole runs across devices.
#pragma once
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <dptrain/data/dataset.hpp>
#include <dptrain/data/input_stats.hpp>
#include <dptrain/data/shuffle.hpp>
#include <dptrain/data/synthetic.hpp>
#include <dptrain/error.hpp>
#include <dptrain/layers/gpt.hpp>
#include <dptrain/layers/model_spec.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/memory.hpp>

namespace dpt {

// A training run's settings. Each field is declared once more, with its range, help and
// whether ranks share it and checkpoints record it, in train_schema() (train/options.cpp),
// which the checks, dptrain's flags and config keys, checkpoints and the ranks' agreement read.
struct TrainConfig {
  std::string model = "16-128x2-4";  // MLP, CNN or GPT spec (model_spec.hpp) or preset (seed, mlp, cnn-small, gpt2)
  Act act = Act::relu;
  data::Task task = data::Task::regression;  // a CNN always classifies (validate() sets it)
  int64_t batch = 256;                       // global batch
  int64_t steps = 500;                       // total optimizer steps (derived from epochs when epochs > 0)
  int64_t epochs = 0;
  int64_t samples = 0;  // synthetic dataset size; 0 = endless stream of samples
  // Language models: tokens a sequence (T; 0: the model's context), and the tokens a step
  // (0: batch * seq); with batch_tokens, `batch` is each device's micro-batch of sequences
  // (llm.c's -b) and the accumulation follows: batch_tokens / (batch * seq * devices).
  int64_t seq = 0;
  int64_t batch_tokens = 0;
  // A GPT's activation recomputation (nn::Recompute, llm.c's -r): memory for a little time,
  // the same results; not a checkpoint's setting (a resumed run may change it).
  nn::Recompute recompute = nn::Recompute::none;
  // A GPT's attention backward (nn::AttentionBackward): deterministic, or fast (cuDNN's
  // order of adding dQ, run to run); not a checkpoint's setting.
  nn::AttentionBackward attention_backward = nn::AttentionBackward::deterministic;
  // Data from files instead of synthetic data: for a GPT, `data` and `val_data` are token
  // files (llm.c shards or 1-D .npy, data/tokens.hpp), patterns separated by commas
  // ('train_*.bin'); else `data` is a .safetensors file (tensors x
  // and y, and optionally x_val and y_val) or a .npy file of inputs, with `targets` a .npy
  // file of targets (float rows: regression; integer labels: classification, which the
  // task follows). Validation rows come from x_val/y_val, from `val_data` (and
  // `val_targets`), or are the last `val_fraction` of the rows, never shuffled in.
  std::string data, targets, val_data, val_targets;
  double val_fraction = 0.0;
  int64_t eval_every = 0;         // steps between validations; 0: at each epoch's end, when there is validation data
  bool shuffle = true;            // file data: each epoch visits the rows in a permutation of (seed, epoch)
  std::string optimizer = "sgd";  // sgd | adamw
  // The learning rate; none: the optimizer's own default (validate() fills it in).
  std::optional<float> lr;
  float momentum = 0.9f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  std::string schedule = "constant";
  int64_t warmup = 0;
  float lr_final = 0.0f;        // cosine: the rate it ends at, as a fraction of lr (llm.c's -q)
  std::vector<Device> devices;  // empty: every GPU there is, else the CPU
  // How the replicas step together: precision, GEMM, clipping, reduction and buckets,
  // micro-batches, ZeRO, CUDA graphs (check_finite and group are the Trainer's: it checks
  // every step's gradients, and sets the group of a ddp run).
  DataParallelOptions parallel;
  // How each update rounds the bf16 copy of the weights that bf16 compute reads
  // (parallel.precision bf16; refused otherwise): to nearest, or stochastically with random
  // bits of (seed, step, element) (Optimizer::set_bf16_rounding); not a checkpoint's
  // setting (a resumed run may change it).
  Bf16Rounding bf16_rounding = Bf16Rounding::nearest;
  // A step whose gradients are not finite is never applied; then "stop" ends the run
  // (NonFiniteError) and "skip-step" goes on. The check is read behind the steps, without
  // waiting for them: a bad step stops the run at most 8 steps later (at once at a log
  // point or a save; no checkpoint is written after it).
  std::string on_nonfinite = "stop";
  std::string save;             // checkpoint path ("" = none), written at the end
  int64_t save_every = 0;       // and every N steps
  std::string resume;           // checkpoint to continue from
  std::string init_from;        // a GPT's starting weights: a Hugging Face GPT-2 model.safetensors (hf.hpp)
  bool ddp = false;             // one process per device under mpirun (devices: the node's list)
  double comm_timeout = 300.0;  // seconds a rank may wait for the others
  uint64_t seed = 1;
  int64_t log_every = 10;  // read the loss back every N steps (and at the last step)
};

// TrainConfig's fields, DataParallelOptions' among them (data_parallel_schema()), in the
// order a user meets them (dptrain --help).
const OptionSchema<TrainConfig>& train_schema();

// A step's loss or gradients were not finite and the run was asked to stop.
class NonFiniteError : public Error {
 public:
  using Error::Error;
};

// Checks the configuration (and fills in the default devices, the steps of --epochs and
// the task of a CNN) and returns its model spec, parsed; throws UsageError with a one-line
// reason naming the field (TrainConfig::batch). The Trainer calls it once, itself.
nn::ModelSpec validate(TrainConfig& cfg);

// The learning rate an optimizer trains with when none is given: SGD 0.05, AdamW 1e-3
// (PyTorch's default for AdamW).
float default_lr(const std::string& optimizer);

// Loss, and accuracy for classification (else NaN), over every row of a data set.
struct EvalResult {
  double loss = NAN;
  double accuracy = NAN;
  double perplexity = NAN;  // a language model's: exp(loss)
  int64_t rows = 0;
};

// The rows of data file `path`: a .safetensors file (x, y when there, and x_val, y_val as
// the split's val), or a .npy file of inputs with `targets` a .npy file of targets ("" for
// none, unless `need_targets`). Throws UsageError naming TrainConfig::`field` or
// TrainConfig::`targets_field` for any other file.
data::DataSplit open_data_file(const std::string& path, const std::string& targets, const char* field,
                               const char* targets_field, bool need_targets);

// `d`'s loss (and accuracy) computed without gradients on every replica of `dp` (and
// every rank) at once, `batch` rows at a time; the model is left in training mode.
// `classes` > 0: the model's classes, which the gathered labels are checked against.
EvalResult evaluate(DataParallel& dp, const data::Dataset& d, int64_t batch, int64_t classes = 0);

struct StepLog {
  int64_t step;  // 1-based, the number of steps done
  int64_t total;
  float loss;      // loss of this step's batch
  float accuracy;  // classification: the share of this step's batch classified right; else NaN
  float lr;
  double samples_per_s;  // since the previous log line
  double step_ms;        // mean wall time per step since the previous log line
  double elapsed_s;      // since the run began, the runs it resumed from included
  EvalResult val;        // the validation set's, when this step was evaluated (else val.rows == 0)
};

// What the GPU input pipeline did (file data on GPUs; all zero otherwise), summed over
// the replicas.
using InputStats = data::InputStats;

struct TrainResult {
  float first_loss = NAN;      // NaN when the run took no step (it was complete, or stopped at once)
  float final_loss = NAN;      // of the last step done (also when the run was stopped)
  float final_accuracy = NAN;  // classification: of the last logged step's batch
  int64_t steps = 0;
  double seconds = 0.0;
  // Over the steps after the first (with a CUDA graph, after the two that record its graphs
  // too, where the run went past them); a run of one: that step.
  double samples_per_s = 0.0;
  double step_ms = 0.0;                                   // the mean over the same steps
  std::vector<std::pair<Device, AllocatorStats>> memory;  // every device used
  std::vector<ModelStateBytes> model_state;               // every replica's
  StepTimes times;                                        // the last step's phases on the master
  int64_t skipped = 0;                                    // steps skipped for non-finite gradients
  EvalResult val;                                         // the last validation (rows 0: none)
  InputStats input;                                       // the input pipeline's work
  bool stopped = false;                                   // ended early because stop() asked so
  // Periodic saves (TrainConfig::save_every) that failed: the run went on, warned once and
  // tried again at the next period. Only a failed final save ends the run (dpt::Error).
  int64_t failed_saves = 0;
};

// Where a resumed run came from, and which settings it changed (the schedule, the learning
// rate and the optimizer's hyper-parameters may change on resume; the model, data and
// batch may not).
struct ResumeInfo {
  std::string path;
  int64_t step = 0;
  std::vector<std::string> changed;  // "lr 0.05 -> 0.01", "schedule constant -> cosine"
};

namespace data {
class Feeder;  // internal (data/feeder.hpp)
}
class NonFiniteWatch;  // internal (train/nonfinite_watch.hpp)

class Trainer {
 public:
  // `train` and `val` (may be null) are data sets the program made (e.g. ArrayDatasets
  // over its own arrays); without them the Trainer reads cfg.data, or makes synthetic data.
  explicit Trainer(TrainConfig cfg, std::shared_ptr<const data::Dataset> train = {},
                   std::shared_ptr<const data::Dataset> val = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  // Trains up to cfg.steps steps, calling on_log at every logged step. `stop` (may be
  // empty) is asked before every step; when it says yes (on any rank of a DDP run) the
  // run ends after the current step, with a checkpoint when cfg.save is set. A bad row of
  // the training data met mid-run (DataError) ends it too: in one process, with cfg.save
  // set, after saving the steps before it (the error then says so); a --ddp rank that meets
  // one has stepped apart from the others and saves nothing.
  TrainResult run(const std::function<void(const StepLog&)>& on_log = {}, const std::function<bool()>& stop = {});
  // Writes a checkpoint of the weights, the buffers (running statistics), the optimizer
  // state and the position in the run (safetensors; atomically). In a DDP run only rank
  // 0 writes.
  void save(const std::string& path);
  // Continues from a checkpoint: weights, buffers and optimizer state on every replica,
  // and the step count. Throws UsageError when it does not fit this configuration.
  void resume(const std::string& path);
  // One step on samples [step * batch, (step + 1) * batch); reading the loss waits for it.
  // The steps run in order: step_index is steps_done() and below config().steps
  // (UsageError otherwise).
  // `measure`: a classification step also measures its batch's accuracy (StepLoss::metric).
  StepLoss step(int64_t step_index, bool measure = false);

  const TrainConfig& config() const { return cfg_; }
  nn::Module& model() { return *model_; }  // the master replica
  DataParallel& parallel() { return *dp_; }
  optim::Optimizer& optimizer() { return dp_->optimizer(); }
  int64_t steps_done() const { return steps_done_; }
  // The file or program data trained on and validated against (null: synthetic data, none).
  const data::Dataset* train_data() const { return train_data_.get(); }
  const data::Dataset* val_data() const { return val_data_.get(); }
  // The validation set's loss and accuracy now (with DDP, every rank must call it).
  EvalResult validate_now();
  // Set when the run continues from a checkpoint.
  const std::optional<ResumeInfo>& resumed() const { return resumed_; }
  // The process group of a DDP run, else null.
  ProcessGroup* group() const { return group_; }
  // FNV-1a hash of the master's parameters and buffers; in a DDP run every rank's hash is compared
  // and a disagreement throws.
  uint64_t parameter_hash();

 private:
  uint64_t local_parameter_hash();  // this rank's, not compared
  TrainConfig cfg_;
  std::shared_ptr<nn::Module> model_;
  std::shared_ptr<const data::Dataset> train_data_, val_data_;
  // The input pipeline: each replica's inputs for the steps (synthetic, gathered or loaded ahead).
  std::vector<std::unique_ptr<data::Feeder>> feeders_;
  // Every feeder makes a step's inputs straight into a CUDA graph's (no step names the next).
  bool fill_next_inputs_ = false;
  int64_t eval_every_ = 0;
  std::string data_identity() const;
  // save(), in its two parts: what every rank takes part in (the optimizer state gathered
  // under ZeRO), and the writing, rank 0's alone, whose failure a periodic save survives.
  std::vector<std::pair<std::string, Tensor>> gather_state();
  struct PeriodicSaves;  // run()'s (trainer.cpp)
  struct CpuPace;        // run()'s warning of a slow CPU run (trainer.cpp)
  // run()'s parts: the findings of non-finite gradients (stop, or count and warn), `now`
  // the steps done; the save after a bad row of data, and the error that says what it
  // saved; and the result's times, input pipeline, memory and model state.
  void take_nonfinite(int64_t now, TrainResult& r);
  DataError after_data_fault(const DataError& e, PeriodicSaves& periodic, TrainResult& r);
  void add_resource_use(TrainResult& r) const;
  void write_checkpoint(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& optimizer_state);
  // The settings a checkpoint records (its metadata, beside the step and data position)
  // and every rank of a job must share.
  std::vector<std::pair<std::string, std::string>> run_settings() const;
  std::vector<std::pair<FieldId, std::string>> shared_settings() const;  // in the order a difference is named
  std::string setting_text(const OptionField<TrainConfig>& field) const;
  std::unique_ptr<DataParallel> dp_;
  optim::Schedule sched_;
  int64_t steps_done_ = 0;
  // The run's time: the seconds of the runs before this one (from the checkpoint resumed),
  // and when the current run() began (StepLog::elapsed_s and the checkpoint's elapsed_s).
  double elapsed_before_ = 0;
  std::optional<std::chrono::steady_clock::time_point> run_started_;
  double elapsed_seconds() const;
  int64_t classes_ = 0;  // a classification model's classes, which gathered labels are checked against (else 0)
  std::optional<ResumeInfo> resumed_;
  ProcessGroup* group_ = nullptr;
  // Steps' gradient checks, read behind the steps (run() reports the bad ones).
  std::unique_ptr<NonFiniteWatch> watch_;
  // The parameter holding element `index` of the flat gradient ("" if none does).
  std::string parameter_at(int64_t index);
};

}  // namespace dpt
