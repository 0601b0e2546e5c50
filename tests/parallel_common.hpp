// Helpers shared by the data-parallel tests (test_parallel*.cpp): the small models and
// configurations they train, on CPU replicas and on the GPU.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <dptrain/data/synthetic.hpp>
#include <dptrain/error.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/train/trainer.hpp>
#include "catch.hpp"
#include "common.hpp"
#include "train_common.hpp"

namespace dpt::test {

// Runs t's steps [0, steps), asserting after each that its replicas stay bitwise identical.
inline void step_replicas_identical(Trainer& t, int64_t steps) {
  for (int64_t s = 0; s < steps; ++s) {
    t.step(s);
    REQUIRE(t.parallel().replicas_identical());
  }
}

inline TrainConfig small(data::Task task, const std::string& opt, int64_t batch) {
  TrainConfig c = quiet_config("12-24x2-5", opt, batch);
  c.task = task;
  c.momentum = 0.9f;
  c.steps = 20;
  c.parallel.bucket_mb = 0.001;  // about 1 KB: the parameters span several buckets
  return c;
}

// small()'s regression with SGD at lr 1e30 on `devices`: gradients overflow, and those
// steps are skipped.
inline TrainConfig overflowing(std::vector<Device> devices) {
  TrainConfig c = small(data::Task::regression, "sgd", 12);
  c.lr = 1e30f;
  c.on_nonfinite = "skip-step";
  c.devices = std::move(devices);
  return c;
}

// Runs `c` under ZeRO stage `from`, then under stage `to`, and hands both to `check`.
inline void run_stages(TrainConfig c, int from, int to, const CompareTrainers& check) {
  c.parallel.zero = from;
  run_and_rerun(
      c, [to](TrainConfig& again) { again.parallel.zero = to; }, check);
}

// What a run of `c` under ZeRO stage `zero` says when it stops on a non-finite gradient.
inline std::string stop_message(TrainConfig c, int zero) {
  c.on_nonfinite = "stop";
  c.parallel.zero = zero;
  try {
    Trainer(c).run();
  } catch (const NonFiniteError& e) {
    return e.what();
  }
  return "no stop";
}

inline TrainConfig dp_config(data::Task task, const std::string& opt) {
  TrainConfig c = quiet_config("24-48x2-6", opt, 10);  // batch 10: uneven on 3 and 4 replicas
  c.task = task;
  c.steps = 20;
  c.parallel.bucket_mb = 0.002;  // several buckets
  return c;
}

// Trains `c` on `devices` step by step, asserting that the replicas stay bitwise
// identical, and returns the master's weights.
inline std::vector<float> train_dp(TrainConfig c, std::vector<Device> devices, Reduce path) {
  c.devices = std::move(devices);
  c.parallel.reduce = path;
  Trainer t(c);
  step_replicas_identical(t, c.steps);
  return t.model().flat_params().to_host();
}

// 24-48x2-6 on `replicas` logical replicas of the GPU (p2p), SGD with momentum, the
// gradients checked: the graph-input tests' model, eager or as a CUDA graph.
inline DataParallel graph_test_replicas(size_t replicas, bool graph) {
  auto m = nn::make_model(nn::parse_model_spec("24-48x2-6"), Act::relu);
  m->to(gpu, 5);
  DataParallelOptions o;
  o.reduce = replicas > 1 ? Reduce::p2p : Reduce::automatic;
  o.cuda_graph = graph;
  o.check_finite = true;
  o.twin_buffers = TwinBuffers::on;  // a model this small would keep one copy
  return DataParallel(
      m, std::vector<Device>(replicas, gpu),
      [](nn::Module& r) -> std::unique_ptr<optim::Optimizer> {
        return std::make_unique<optim::SGD>(r, optim::SGD::Options{.lr = 0.05f, .momentum = 0.9f});
      },
      o);
}

// `steps` steps of a bf16 or fp32 MLP on `devs` through `path`, each bucket updated once
// reduced or not, the buckets' size tuned over the first steps or not: replica 0's
// parameters (every replica checked identical).
struct PerBucketRun {
  bool per_bucket = false, graph = false, tune = false;
  int comm_ctas = 0;
  int steps = 6;
};
inline std::vector<float> train_per_bucket(const std::vector<Device>& devs, Reduce path, const std::string& opt,
                                           Precision precision, PerBucketRun run) {
  auto m = nn::mlp("24-48x2-6");
  m->to(devs[0], 4);
  DataParallelOptions o;
  o.reduce = path;
  o.bucket_mb = 0.002;  // several buckets, the first smaller
  o.first_bucket_mb = 0.001;
  o.precision = precision;
  o.update_per_bucket = run.per_bucket;
  o.cuda_graph = run.graph;
  o.comm_ctas = run.comm_ctas;
  o.tune_buckets = run.tune;
  DataParallel dp(
      m, devs,
      [&](nn::Module& r) -> std::unique_ptr<optim::Optimizer> {
        std::unique_ptr<optim::Optimizer> p;
        if (opt == "sgd")
          p = std::make_unique<optim::SGD>(r,
                                           optim::SGD::Options{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f});
        else p = std::make_unique<optim::AdamW>(r, optim::AdamW::Options{.lr = 0.003f});
        p->set_schedule({optim::Schedule::Kind::cosine, opt == "sgd" ? 0.05f : 0.003f, 2, 8});
        return p;
      },
      o);
  REQUIRE(dp.buckets() > 2);
  data::Synthetic d({.task = data::Task::regression, .in = 24, .out = 6, .seed = 3}, devs[0]);
  const data::Dataset& rows = d;
  for (int s = 0; s < run.steps; ++s)
    dp.train_step(
        s * 32, 32, [&](size_t r, int64_t first, int64_t n) { return rows.batch(first, n, dp.device(r)); },
        nn::MSELoss());
  CHECK_FALSE(dp.tuning_buckets());
  CHECK(dp.replicas_identical());
  CHECK(dp.optimizer().steps_taken() == run.steps);
  return dp.replica(0).flat_params().to_host();
}

}  // namespace dpt::test
