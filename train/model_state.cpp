#include "model_state.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <vector>

#include <dptrain/error.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>

namespace dpt {

void fetch_tensor(const ckpt::Checkpoint& c, const std::string& path, const std::string& name, const Tensor& into,
                  std::set<std::string>& used) {
  fetch_tensor_part(c, path, name, into.shape(), 0, into, used);
}

namespace {
// Tensor `name` of `c`, an F32 of shape `whole` (UsageError otherwise).
const ckpt::HostTensor& checked_tensor(const ckpt::Checkpoint& c, const std::string& path, const std::string& name,
                                       const Shape& whole) {
  const ckpt::HostTensor* t = c.find(name);
  if (!t) throw UsageError("checkpoint '" + path + "' has no tensor '" + name + "'");
  if (t->dtype != ckpt::DType::f32)
    throw UsageError("checkpoint '" + path + "': tensor '" + name + "' is " + ckpt::safetensors_name(t->dtype) +
                     ", the model needs F32");
  if (t->shape != whole.vec())
    throw UsageError("checkpoint '" + path + "': tensor '" + name + "' has shape " + shape_str(t->shape) +
                     ", the model needs " + shape_str(whole));
  return *t;
}
}  // namespace

void check_shapes(const ckpt::Checkpoint& c, const std::string& path, nn::Module& model) {
  for (auto& [name, p] : model.named_parameters()) checked_tensor(c, path, name, p->shape);
  for (auto& [name, b] : model.named_buffers()) checked_tensor(c, path, name, b->shape);
}

void fetch_tensor_part(const ckpt::Checkpoint& c, const std::string& path, const std::string& name, const Shape& whole,
                       int64_t begin, const Tensor& into, std::set<std::string>& used) {
  const ckpt::HostTensor* t = &checked_tensor(c, path, name, whole);
  used.insert(name);
  DPT_CHECK(begin >= 0 && begin + into.numel() <= numel(whole), "fetch_tensor_part: the part is outside the tensor");
  std::vector<float> v(static_cast<size_t>(into.numel()));
  std::memcpy(v.data(), t->data.data() + static_cast<size_t>(begin) * sizeof(float), v.size() * sizeof(float));
  // Training on from a NaN would only spread it, and save it again.
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      throw UsageError("checkpoint '" + path + "': tensor '" + name + "' holds " + format_float(v[i]) + " at index " +
                       std::to_string(static_cast<int64_t>(i) + begin) +
                       "; weights and optimizer state must be finite");
  copy(into, Tensor::from_host(v, into.shape(), into.device()));
}

void load_replicas(const ckpt::Checkpoint& c, const std::string& path, DataParallel& dp, std::set<std::string>& used) {
  dp.synchronize();  // the replicas' own streams are done making them (copies, zeroed state)
  for (size_t r = 0; r < dp.size(); ++r) {
    for (auto& [name, p] : dp.replica(r).named_parameters()) fetch_tensor(c, path, name, p->value, used);
    for (auto& [name, b] : dp.replica(r).named_buffers()) fetch_tensor(c, path, name, b->value, used);
    dp.replica(r).refresh_shadow();       // bf16 compute: the copy follows the loaded masters
    context(dp.device(r)).synchronize();  // written on this thread's stream; the replica's may differ
  }
}

void check_all_used(const ckpt::Checkpoint& c, const std::string& path, const std::set<std::string>& used) {
  for (const auto& [name, t] : c.tensors)
    if (!used.count(name))
      throw UsageError("checkpoint '" + path + "' has a tensor " + ckpt::printable(name) +
                       " that this model and optimizer do not have");
}

namespace {
// The metadata keys of a dptrain checkpoint: those of the first format, which every file
// holds, and those added since, which a file without checksums (written before them) may
// lack. (data_epoch and data_index: for file data alone.)
constexpr const char* kFirstKeys[] = {"format",    "step", "optimizer_steps", "data_position", "model", "act", "task",
                                      "optimizer", "seed", "batch",           "samples"};
constexpr const char* kLaterKeys[] = {"rng",        "lr",   "momentum",   "nesterov",   "weight_decay", "beta1",
                                      "beta2",      "eps",  "schedule",   "warmup",     "clip",         "precision",
                                      "grad_accum", "data", "data_epoch", "data_index", "elapsed_s"};
// Keys added since checksums came (GPTs): a checksummed file may lack them; then they hold
// their defaults (no GPT was trained before them).
constexpr const char* kNewerKeys[] = {"seq", "lr_final"};

void check_metadata(const ckpt::Checkpoint& c, const std::string& path) {
  const auto format = c.metadata.find("format");
  if (format == c.metadata.end()) throw UsageError("checkpoint '" + path + "' has no 'format' in its metadata");
  if (format->second != "dptrain-1") throw UsageError("checkpoint '" + path + "' is not a dptrain checkpoint");
  for (const auto& [key, value] : c.metadata)
    if (!is_checkpoint_key(key))
      throw UsageError("checkpoint '" + path + "' has an unknown key " + ckpt::printable(key) +
                       " in its metadata (a dptrain checkpoint's keys are the ones it writes)");
  // The position in the epochs is written for file data alone.
  const auto data = c.metadata.find("data");
  const bool file_data = data != c.metadata.end() && data->second != "synthetic";
  auto need = [&](const char* key, bool needed) {
    if (needed && !c.metadata.count(key))
      throw UsageError("checkpoint '" + path + "' has no '" + key + "' in its metadata");
  };
  for (const char* key : kFirstKeys) need(key, true);
  for (const char* key : kLaterKeys) {
    const bool epochs = std::string(key) == "data_epoch" || std::string(key) == "data_index";
    need(key, c.checksummed && (!epochs || file_data));
  }
}
}  // namespace

bool is_newer_checkpoint_key(const std::string& key) {
  return std::any_of(std::begin(kNewerKeys), std::end(kNewerKeys), [&](const char* k) { return key == k; });
}

bool is_checkpoint_key(const std::string& key) {
  auto is = [&](const char* k) { return key == k; };
  return std::any_of(std::begin(kFirstKeys), std::end(kFirstKeys), is) ||
         std::any_of(std::begin(kLaterKeys), std::end(kLaterKeys), is) ||
         std::any_of(std::begin(kNewerKeys), std::end(kNewerKeys), is);
}

ckpt::Checkpoint load_input_file(const std::string& path) {
  try {
    return ckpt::load(path);
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
}

ckpt::Checkpoint load_checkpoint(const std::string& path, bool note) {
  ckpt::Checkpoint c = load_input_file(path);
  check_metadata(c, path);
  if (!c.checksummed && note)
    report(Severity::note, "checkpoint '" + path +
                               "' carries no checksums (it was written before dptrain kept them): its tensors cannot "
                               "be checked for corruption; the next save adds them");
  return c;
}

}  // namespace dpt
