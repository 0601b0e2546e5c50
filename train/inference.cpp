#include <dptrain/train/inference.hpp>

#include <cstring>
#include <set>

#include <dptrain/error.hpp>
#include <dptrain/layers/conv.hpp>
#include <dptrain/optim/optim.hpp>

#include <dptrain/data/npy.hpp>

#include "common/atomic_file.hpp"
#include "model_state.hpp"

namespace dpt {

Inference::Inference(InferenceConfig cfg) : cfg_(std::move(cfg)) {
  if (cfg_.batch < 1)
    throw UsageError("{} must be >= 1, got " + std::to_string(cfg_.batch), {{"InferenceConfig", "batch"}});
  if (cfg_.checkpoint.empty())
    throw UsageError("{}: a checkpoint to read the model from", {{"InferenceConfig", "checkpoint"}});
  const ckpt::Checkpoint c = load_checkpoint(cfg_.checkpoint);
  auto meta = [&](const std::string& key) {
    const auto it = c.metadata.find(key);
    if (it == c.metadata.end())
      throw UsageError("checkpoint '" + cfg_.checkpoint + "' has no '" + key + "' in its metadata");
    return it->second;
  };
  // The metadata is the file's text: a bad value is the file's fault, named as such.
  auto parsed = [&](const std::string& key, auto parse) {
    try {
      return parse(meta(key));
    } catch (const UsageError& e) {
      throw UsageError("checkpoint '" + cfg_.checkpoint + "': its metadata's " + key + ": " + e.what());
    }
  };
  model_ = meta("model");
  spec_ = parsed("model", nn::parse_model_spec);
  task_ = parsed("task", data::parse_task);
  const Act act = parsed("act", nn::parse_act);
  if (cfg_.devices.empty()) cfg_.devices = default_devices();
  for (const Device& d : cfg_.devices) {
    check_device(d);
    if (d.type != cfg_.devices.front().type)
      throw UsageError("{} cannot mix CPU and CUDA devices", {{"InferenceConfig", "devices"}});
  }
  auto model = nn::make_model(spec_, act);
  check_shapes(c, cfg_.checkpoint, *model);  // before placing it: the metadata may name a huge model
  model->to(cfg_.devices.front(), 0);        // the checkpoint's weights replace these
  DataParallelOptions o;
  o.precision = cfg_.precision;
  o.gemm = cfg_.gemm;
  o.reduce = resolve_reduce(Reduce::automatic, cfg_.devices);
  // Nothing is trained: the replicator wants an optimizer all the same (plain SGD keeps
  // no state).
  dp_ = std::make_unique<DataParallel>(
      model, cfg_.devices, [](nn::Module& m) { return std::make_unique<optim::SGD>(m, optim::SGD::Options{}); }, o);
  std::set<std::string> used;
  load_replicas(c, cfg_.checkpoint, *dp_, used);
  dp_->synchronize();
}

Inference::~Inference() = default;

void Inference::check(const data::Dataset& d) const {
  if (d.rows() < 1)  // an endless stream (0) has no end to predict to
    throw UsageError(d.inputs_name() + " has " + std::to_string(d.rows()) + " rows: a data set needs at least one");
  d.check_model(spec_.input_shape(), task_, spec_.outputs());
}

EvalResult Inference::evaluate(const data::Dataset& d) {
  check(d);
  if (!d.has_targets()) throw UsageError(d.inputs_name() + ": no targets to evaluate against");
  return dpt::evaluate(*dp_, d, cfg_.batch, task_ == data::Task::classification ? spec_.outputs() : 0);
}

std::vector<float> Inference::predict(const data::Dataset& d) {
  check(d);
  const int64_t outputs = spec_.outputs();
  std::vector<float> out(static_cast<size_t>(d.rows() * outputs));
  std::vector<std::vector<int64_t>> rows(dp_->size());
  const ShardSource source = [&](size_t r, int64_t first, int64_t n) {
    rows[r].resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) rows[r][static_cast<size_t>(i)] = first + i;
    data::Batch b = d.empty_batch(n, dp_->device(r));
    b.y = Tensor();  // inputs alone
    d.gather(rows[r], b);
    return b;
  };
  for (int64_t first = 0; first < d.rows(); first += cfg_.batch) {
    const int64_t n = std::min(cfg_.batch, d.rows() - first);
    dp_->infer(first, n, source, [&](size_t, SampleRange part, const Tensor& y) {
      const std::vector<float> host = cast(y, DType::f32).to_host();  // each replica its own rows
      std::memcpy(out.data() + (first + part.first) * outputs, host.data(), host.size() * sizeof(float));
    });
  }
  return out;
}

void write_npy_file(const std::string& path, const data::Array& array) {
  AtomicFile f(path, "cannot write '" + path + "'", "");
  data::write_npy([&](const void* bytes, size_t n) { f.write(bytes, n); }, array);
  f.commit();
}

}  // namespace dpt
