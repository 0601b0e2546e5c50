#include "trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "../kernels/error.hpp"
#include "../layers/loss.hpp"
#include "../runtime/allocator.hpp"
#include "../runtime/ops.hpp"

namespace dpt {

void validate(TrainConfig& cfg) {
  if (cfg.batch < 1) throw UsageError("--batch must be at least 1, got " + std::to_string(cfg.batch));
  if (cfg.epochs < 0) throw UsageError("--epochs must be positive");
  if (cfg.epochs > 0) {
    if (cfg.samples < 1) throw UsageError("--epochs needs --samples N (the dataset size)");
    cfg.steps = (cfg.epochs * cfg.samples + cfg.batch - 1) / cfg.batch;
  }
  if (cfg.steps < 1) throw UsageError("--steps must be at least 1, got " + std::to_string(cfg.steps));
  if (cfg.samples < 0) throw UsageError("--samples must be positive");
  if (!(cfg.lr > 0.0f) || !std::isfinite(cfg.lr)) throw UsageError("--lr must be a positive number");
  if (cfg.momentum < 0.0f || cfg.momentum >= 1.0f) throw UsageError("--momentum must be in [0, 1)");
  if (cfg.weight_decay < 0.0f) throw UsageError("--weight-decay must be >= 0");
  if (cfg.clip < 0.0f) throw UsageError("--clip must be >= 0");
  if (cfg.log_every < 1) throw UsageError("--log-every must be at least 1");
  if (cfg.warmup < 0) throw UsageError("--warmup must be >= 0");
  if (cfg.optimizer != "sgd" && cfg.optimizer != "adamw")
    throw UsageError("unknown optimizer '" + cfg.optimizer + "': expected sgd or adamw");
  (void)optim::parse_schedule(cfg.schedule);
  const auto widths = nn::parse_mlp_spec(cfg.model);
  if (cfg.task == data::Task::classification && widths.back() < 2)
    throw UsageError("classification needs at least 2 output classes, the model has " +
                     std::to_string(widths.back()));
  if (cfg.grad_accum < 1) throw UsageError("--grad-accum must be at least 1");
  if (!(cfg.comm_timeout > 0.0)) throw UsageError("--comm-timeout must be positive");
  if (cfg.devices.empty()) cfg.devices = default_devices();
  if (cfg.ddp && !built_with_mpi()) throw UsageError("--ddp needs a build with MPI (install libopenmpi-dev and rebuild)");
  for (const Device& d : cfg.devices) {
    check_device(d);
    if (d.type != cfg.devices.front().type) throw UsageError("CPU and CUDA devices cannot be mixed");
  }
  if (!cfg.ddp) (void)resolve_reduce(cfg.reduce, cfg.devices);
  if (!(cfg.bucket_mb > 0.0)) throw UsageError("--bucket-mb must be positive");
  if (cfg.devices.front().is_cpu() && cfg.gemm == GemmImpl::native)
    throw UsageError("--gemm native is a CUDA kernel; the CPU has one GEMM");
  if (cfg.gemm == GemmImpl::native && cfg.precision != Precision::fp32)
    throw UsageError("--gemm native computes in fp32 only; use --gemm cublas for tf32 or bf16");
}

Trainer::Trainer(TrainConfig cfg) : cfg_(std::move(cfg)) {
  validate(cfg_);
  if (cfg_.ddp) {
    // One device per process: the local rank picks it from the node's device list.
    group_ = &ProcessGroup::world();
    group_->set_timeout(cfg_.comm_timeout);
    const Device mine = cfg_.devices[static_cast<size_t>(group_->local_rank()) % cfg_.devices.size()];
    cfg_.devices = {mine};
  }
  const Device master = cfg_.devices.front();
  model_ = nn::mlp(cfg_.model, cfg_.act);
  model_->to(master, cfg_.seed);
  const auto widths = nn::parse_mlp_spec(cfg_.model);
  data::SyntheticConfig dc;
  dc.task = cfg_.task;
  dc.in = widths.front();
  dc.out = widths.back();
  dc.seed = cfg_.seed;
  dc.samples = cfg_.samples;
  for (const Device& d : cfg_.devices) data_.push_back(std::make_unique<data::Synthetic>(dc, d));
  OptimizerFactory make_opt = [this](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
    if (cfg_.optimizer == "sgd")
      return std::make_unique<optim::SGD>(m, optim::SGD::Options{cfg_.lr, cfg_.momentum, 0.0f, cfg_.weight_decay,
                                                                  cfg_.nesterov});
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
  o.group = group_;
  dp_ = std::make_unique<DataParallel>(model_, cfg_.devices, make_opt, o);
  sched_ = {optim::parse_schedule(cfg_.schedule), cfg_.lr, cfg_.warmup, cfg_.steps};
}

StepLoss Trainer::step(int64_t s) {
  dp_->set_lr(sched_.at(s));
  const LossFn loss = cfg_.task == data::Task::regression ? LossFn(nn::MSELoss()) : LossFn(nn::CrossEntropyLoss());
  StepLoss l = dp_->train_step(s * cfg_.batch, cfg_.batch,
                               [this](size_t r, int64_t first, int64_t n) { return data_[r]->batch(first, n); }, loss);
  steps_done_ = s + 1;
  return l;
}

uint64_t Trainer::parameter_hash() {
  dp_->synchronize();
  const auto p = model_->flat_params().to_host();
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

TrainResult Trainer::run(const std::function<void(const StepLog&)>& on_log) {
  using clock = std::chrono::steady_clock;
  TrainResult r;
  const auto start = clock::now();
  auto last = start, after_first = start;
  const int64_t begin = steps_done_;
  int64_t last_step = begin;
  for (int64_t s = begin; s < cfg_.steps; ++s) {
    const StepLoss loss = step(s);
    const int64_t done = s + 1;
    const bool first = s == begin;
    if (first || done % cfg_.log_every == 0 || done == cfg_.steps) {
      dp_->synchronize();                 // bounded by --comm-timeout across ranks
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
  }
  dp_->synchronize();
  const auto end = clock::now();
  r.steps = cfg_.steps - begin;
  r.seconds = std::chrono::duration<double>(end - start).count();
  const double timed = std::chrono::duration<double>(end - after_first).count();
  if (r.steps > 1 && timed > 0) {
    r.samples_per_s = static_cast<double>((r.steps - 1) * cfg_.batch) / timed;
    r.step_ms = 1e3 * timed / static_cast<double>(r.steps - 1);
  }
  r.times = dp_->last_times();
  std::vector<Device> seen;
  for (const Device& d : cfg_.devices)
    if (std::find(seen.begin(), seen.end(), d) == seen.end()) {
      seen.push_back(d);
      r.memory.push_back({d, allocator(d).stats()});
    }
  return r;
}

}  // namespace dpt
