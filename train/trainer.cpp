#include <dptrain/train/trainer.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>

#include <dptrain/error.hpp>
#include <dptrain/layers/conv.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/train/checkpoint.hpp>

namespace dpt {

namespace {
// Errors name the field (TrainConfig::batch), as a program that embeds the library knows
// it; dptrain's CLI shows each field as its flag.
[[noreturn]] void bad(const std::string& field, const std::string& why) {
  throw UsageError("TrainConfig::" + field + " " + why);
}
std::string got(int64_t v) { return ", got " + std::to_string(v); }
std::string got(int v) { return got(int64_t{v}); }
std::string got(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, ", got %g", v);
  return buf;
}
}  // namespace

nn::ModelSpec validate(TrainConfig& cfg) {
  if (cfg.batch < 1) bad("batch", "must be >= 1" + got(cfg.batch));
  if (cfg.epochs < 0) bad("epochs", "must be >= 0" + got(cfg.epochs));
  if (cfg.samples < 0) bad("samples", "must be >= 0" + got(cfg.samples));
  if (cfg.epochs > 0) {
    if (cfg.samples < 1) bad("epochs", "needs TrainConfig::samples (the dataset size)");
    cfg.steps = (cfg.epochs * cfg.samples + cfg.batch - 1) / cfg.batch;
  }
  if (cfg.steps < 1) bad("steps", "must be >= 1" + got(cfg.steps));
  if (!(cfg.lr > 0.0f) || !std::isfinite(cfg.lr)) bad("lr", "must be a positive number" + got(cfg.lr));
  if (cfg.momentum < 0.0f || cfg.momentum >= 1.0f) bad("momentum", "must be in [0, 1)" + got(cfg.momentum));
  if (cfg.weight_decay < 0.0f) bad("weight_decay", "must be >= 0" + got(cfg.weight_decay));
  if (cfg.clip < 0.0f) bad("clip", "must be >= 0" + got(cfg.clip));
  if (cfg.log_every < 1) bad("log_every", "must be >= 1" + got(cfg.log_every));
  if (cfg.warmup < 0) bad("warmup", "must be >= 0" + got(cfg.warmup));
  if (cfg.optimizer != "sgd" && cfg.optimizer != "adamw")
    bad("optimizer", "'" + cfg.optimizer + "' is unknown: expected sgd or adamw");
  (void)optim::parse_schedule(cfg.schedule);
  nn::ModelSpec spec = nn::parse_model_spec(cfg.model);
  if (spec.is_cnn) cfg.task = data::Task::classification;  // a CNN classifies images
  if (cfg.task == data::Task::classification && spec.outputs() < 2)
    bad("task", "classification needs at least 2 output classes, the model has " + std::to_string(spec.outputs()));
  if (cfg.grad_accum < 1) bad("grad_accum", "must be >= 1" + got(cfg.grad_accum));
  if (cfg.on_nonfinite != "stop" && cfg.on_nonfinite != "skip-step")
    bad("on_nonfinite", "'" + cfg.on_nonfinite + "' is unknown: expected stop or skip-step");
  if (cfg.save_every < 0) bad("save_every", "must be >= 0" + got(cfg.save_every));
  if (cfg.save_every > 0 && cfg.save.empty()) bad("save_every", "needs TrainConfig::save (a checkpoint path)");
  if (!(cfg.comm_timeout > 0.0)) bad("comm_timeout", "must be positive" + got(cfg.comm_timeout));
  if (cfg.devices.empty()) cfg.devices = default_devices();
  if (cfg.ddp && !built_with_mpi()) bad("ddp", "needs a build with MPI (install libopenmpi-dev and rebuild)");
  for (const Device& d : cfg.devices) {
    check_device(d);
    if (d.type != cfg.devices.front().type) bad("devices", "cannot mix CPU and CUDA devices");
  }
  if (!cfg.ddp) (void)resolve_reduce(cfg.reduce, cfg.devices);
  if (!(cfg.bucket_mb > 0.0)) bad("bucket_mb", "must be positive" + got(cfg.bucket_mb));
  if (cfg.cuda_graph && (cfg.devices.size() != 1 || !cfg.devices.front().is_cuda() || cfg.ddp || cfg.grad_accum != 1 ||
                         cfg.optimizer != "sgd"))
    bad("cuda_graph",
        "records one replica on one GPU with TrainConfig::optimizer sgd (no TrainConfig::ddp or "
        "TrainConfig::grad_accum)");
  if (cfg.devices.front().is_cpu() && cfg.gemm == GemmImpl::native)
    bad("gemm", "native is a CUDA kernel; the CPU has one GEMM");
  if (cfg.gemm == GemmImpl::native && cfg.precision != Precision::fp32)
    bad("gemm", "native computes in fp32 only; use TrainConfig::gemm cublas for tf32 or bf16");
  return spec;
}

Trainer::Trainer(TrainConfig cfg) : cfg_(std::move(cfg)) {
  const nn::ModelSpec spec = validate(cfg_);
  if (cfg_.ddp) {
    // One device per process: the local rank picks it from the node's device list.
    group_ = &ProcessGroup::world();
    group_->set_timeout(cfg_.comm_timeout);
    const Device mine = cfg_.devices[static_cast<size_t>(group_->local_rank()) % cfg_.devices.size()];
    cfg_.devices = {mine};
  }
  const Device master = cfg_.devices.front();
  model_ = nn::make_model(spec, cfg_.act);
  data::SyntheticConfig dc;
  if (spec.is_cnn) {
    dc.image = spec.cnn.input;
    dc.teacher_hidden = 16;  // teacher channels: labelling stays cheap next to the student's step
  } else {
    dc.in = spec.widths.front();
  }
  dc.out = spec.outputs();
  model_->to(master, cfg_.seed);
  dc.task = cfg_.task;
  dc.seed = cfg_.seed;
  dc.samples = cfg_.samples;
  for (const Device& d : cfg_.devices) data_.push_back(std::make_unique<data::Synthetic>(dc, d));
  OptimizerFactory make_opt = [this](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
    if (cfg_.optimizer == "sgd")
      return std::make_unique<optim::SGD>(
          m, optim::SGD::Options{cfg_.lr, cfg_.momentum, 0.0f, cfg_.weight_decay, cfg_.nesterov});
    return std::make_unique<optim::AdamW>(
        m, optim::AdamW::Options{cfg_.lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay});
  };
  DataParallelOptions o;
  o.reduce = cfg_.reduce;
  o.bucket_mb = cfg_.bucket_mb;
  o.precision = cfg_.precision;
  o.gemm = cfg_.gemm;
  o.clip = cfg_.clip;
  o.grad_accum = cfg_.grad_accum;
  o.overlap = cfg_.overlap;
  o.check_finite = true;
  o.cuda_graph = cfg_.cuda_graph;
  o.group = group_;
  dp_ = std::make_unique<DataParallel>(model_, cfg_.devices, make_opt, o);
  sched_ = {optim::parse_schedule(cfg_.schedule), cfg_.lr, cfg_.warmup, cfg_.steps};
  if (!cfg_.resume.empty()) resume(cfg_.resume);
}

namespace {
std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

ckpt::HostTensor host_tensor(const Tensor& t) {
  const auto v = t.to_host();
  return ckpt::make_tensor(ckpt::DType::f32, t.shape(), v.data());
}
}  // namespace

void Trainer::save(const std::string& path) {
  dp_->synchronize();
  if (group_ && group_->rank() != 0) return;
  ckpt::Checkpoint c;
  c.metadata = {{"format", "dptrain-1"},
                {"step", std::to_string(steps_done_)},
                {"model", cfg_.model},
                {"act", nn::act_name(cfg_.act)},
                {"task", data::task_name(cfg_.task)},
                {"optimizer", optimizer().kind()},
                {"optimizer_steps", std::to_string(optimizer().steps_taken())},
                {"lr", fmt(cfg_.lr)},
                {"momentum", fmt(cfg_.momentum)},
                {"nesterov", cfg_.nesterov ? "true" : "false"},
                {"weight_decay", fmt(cfg_.weight_decay)},
                {"beta1", fmt(cfg_.beta1)},
                {"beta2", fmt(cfg_.beta2)},
                {"eps", fmt(cfg_.eps)},
                {"schedule", cfg_.schedule},
                {"warmup", std::to_string(cfg_.warmup)},
                {"seed", std::to_string(cfg_.seed)},
                {"batch", std::to_string(cfg_.batch)},
                {"samples", std::to_string(cfg_.samples)},
                // Data and randomness are counter-based: the next sample index is the
                // whole of their state.
                {"rng", "philox4x32-10, seed " + std::to_string(cfg_.seed)},
                {"data_position", std::to_string(steps_done_ * cfg_.batch)}};
  for (auto& [name, p] : model_->named_parameters()) c.tensors.push_back({name, host_tensor(p->value)});
  for (auto& [name, b] : model_->named_buffers()) c.tensors.push_back({name, host_tensor(b->value)});
  for (auto& [name, t] : optimizer().state()) c.tensors.push_back({name, host_tensor(t)});
  ckpt::save(path, c);
}

void Trainer::resume(const std::string& path) {
  ckpt::Checkpoint c;
  try {
    c = ckpt::load(path);
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());  // a missing or broken file to resume from is bad input
  }
  auto meta = [&](const std::string& key) {
    auto it = c.metadata.find(key);
    if (it == c.metadata.end()) throw UsageError("checkpoint '" + path + "' has no '" + key + "' in its metadata");
    return it->second;
  };
  auto must_match = [&](const std::string& key, const std::string& ours) {  // the key is the field's name
    if (meta(key) != ours)
      throw UsageError("checkpoint '" + path + "' was made with TrainConfig::" + key + " " + meta(key) +
                       ", this run has " + ours);
  };
  if (meta("format") != "dptrain-1") throw UsageError("checkpoint '" + path + "' is not a dptrain checkpoint");
  must_match("model", cfg_.model);
  must_match("act", nn::act_name(cfg_.act));
  must_match("task", data::task_name(cfg_.task));
  must_match("optimizer", optimizer().kind());
  must_match("seed", std::to_string(cfg_.seed));  // the data and teacher follow from it
  must_match("batch", std::to_string(cfg_.batch));
  must_match("samples", std::to_string(cfg_.samples));
  const int64_t step = std::stoll(meta("step"));
  if (step < 0 || step > cfg_.steps)
    throw UsageError("checkpoint '" + path + "' is at step " + std::to_string(step) + ", past TrainConfig::steps " +
                     std::to_string(cfg_.steps));
  auto fetch = [&](const std::string& name, const Tensor& into) {
    const ckpt::HostTensor* t = c.find(name);
    if (!t) throw UsageError("checkpoint '" + path + "' has no tensor '" + name + "'");
    if (t->dtype != ckpt::DType::f32 || t->shape != into.shape())
      throw UsageError("checkpoint '" + path + "': tensor '" + name + "' has shape " + shape_str(t->shape) +
                       ", the model needs " + shape_str(into.shape()));
    std::vector<float> v(static_cast<size_t>(into.numel()));
    std::memcpy(v.data(), t->data.data(), t->data.size());
    copy(into, Tensor::from_host(v, into.shape(), into.device()));
  };
  for (size_t r = 0; r < dp_->size(); ++r) {
    for (auto& [name, p] : dp_->replica(r).named_parameters()) fetch(name, p->value);
    for (auto& [name, b] : dp_->replica(r).named_buffers()) fetch(name, b->value);
    dp_->replica(r).refresh_shadow();       // bf16 compute: the copy follows the loaded masters
    context(dp_->device(r)).synchronize();  // written on this thread's stream; the replica's may differ
  }
  for (optim::Optimizer* o : dp_->optimizers()) {
    for (auto& [name, t] : o->state()) fetch(name, t);
    o->set_steps_taken(std::stoll(meta("optimizer_steps")));
  }
  dp_->synchronize();
  steps_done_ = step;
}

std::string Trainer::nonfinite_parameter() {
  for (auto& [name, p] : model_->named_parameters())
    for (float g : p->value.grad().to_host())
      if (!std::isfinite(g)) return name;
  return "";
}

StepLoss Trainer::step(int64_t s) {
  dp_->set_lr(sched_.at(s));
  const LossFn loss = cfg_.task == data::Task::regression ? LossFn(nn::MSELoss()) : LossFn(nn::CrossEntropyLoss());
  StepLoss l = dp_->train_step(
      s * cfg_.batch, cfg_.batch, [this](size_t r, int64_t first, int64_t n) { return data_[r]->batch(first, n); },
      loss);
  steps_done_ = s + 1;
  return l;
}

uint64_t Trainer::parameter_hash() {
  dp_->synchronize();
  auto p = model_->flat_params().to_host();
  if (const Tensor& b = model_->flat_buffers(); b.defined()) {  // the running statistics too
    const auto bv = b.to_host();
    p.insert(p.end(), bv.begin(), bv.end());
  }
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the bytes
  const auto* bytes = reinterpret_cast<const unsigned char*>(p.data());
  for (size_t i = 0; i < p.size() * sizeof(float); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  if (group_) {
    const auto all = group_->gather_all(h);
    for (size_t r = 0; r < all.size(); ++r)
      if (all[r] != h)
        throw Error("the parameters differ between ranks: rank " + std::to_string(group_->rank()) + " and rank " +
                    std::to_string(r) + " hash differently");
  }
  return h;
}

TrainResult Trainer::run(const std::function<void(const StepLog&)>& on_log, const std::function<bool()>& stop) {
  using clock = std::chrono::steady_clock;
  TrainResult r;
  const auto start = clock::now();
  auto last = start, after_first = start;
  const int64_t begin = steps_done_;
  int64_t last_step = begin;
  for (int64_t s = begin; s < cfg_.steps; ++s) {
    if (stop) {
      // Every rank must stop at the same step: the decision is shared.
      const bool asked = stop();
      if (group_ ? group_->sum(asked ? 1.0 : 0.0) > 0 : asked) {
        r.stopped = true;
        break;
      }
    }
    const StepLoss loss = step(s);
    const int64_t done = s + 1;
    if (const float scale = dp_->last_scale(); !std::isfinite(scale)) {
      const std::string where = nonfinite_parameter();
      const std::string what = "step " + std::to_string(done) + ": the gradient of " +
                               (where.empty() ? std::string("the loss") : "parameter " + where) +
                               " is not finite (the loss is " + fmt(loss.value()) + "); the update was not applied";
      if (cfg_.on_nonfinite == "stop")
        throw NonFiniteError(what + "; run stopped" + (cfg_.save.empty() ? "" : ", the last checkpoint is intact"));
      if (!group_ || group_->rank() == 0) report(Severity::warning, what);
      ++r.skipped;
    }
    const bool first = s == begin;
    if (first || done % cfg_.log_every == 0 || done == cfg_.steps) {
      dp_->synchronize();                // bounded by --comm-timeout across ranks
      const float value = loss.value();  // the only host synchronization of a step
      const auto now = clock::now();
      if (first) {
        r.first_loss = value;
        after_first = now;
      }
      const double dt = std::chrono::duration<double>(now - last).count();
      const int64_t n = done - last_step;
      if (on_log)
        on_log({done, cfg_.steps, value, sched_.at(s), dt > 0 ? static_cast<double>(n * cfg_.batch) / dt : 0.0,
                1e3 * dt / static_cast<double>(n), std::chrono::duration<double>(now - start).count()});
      r.final_loss = value;
      last = now;
      last_step = done;
    }
    if (cfg_.save_every > 0 && done % cfg_.save_every == 0 && done != cfg_.steps) save(cfg_.save);
  }
  if (!cfg_.save.empty()) save(cfg_.save);
  dp_->synchronize();
  const auto end = clock::now();
  r.steps = steps_done_ - begin;
  r.seconds = std::chrono::duration<double>(end - start).count();
  const double timed = std::chrono::duration<double>(end - after_first).count();
  if (r.steps > 1 && timed > 0) {
    r.samples_per_s = static_cast<double>((r.steps - 1) * cfg_.batch) / timed;
    r.step_ms = 1e3 * timed / static_cast<double>(r.steps - 1);
  }
  if (r.steps > 0) r.times = dp_->last_times();
  std::vector<Device> seen;
  for (const Device& d : cfg_.devices)
    if (std::find(seen.begin(), seen.end(), d) == seen.end()) {
      seen.push_back(d);
      r.memory.push_back({d, memory_stats(d)});
    }
  return r;
}

}  // namespace dpt
