// The data-parallel step recorded as a CUDA graph (GPU only: dpt_gpu_tests): every step's
// parameters as the eager step's, shards copied in beside the update, sources writing
// straight into the graph's inputs, file data.

#include <climits>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>

#include <dptrain/data/dataset.hpp>
#include <dptrain/error.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/train/trainer.hpp>
#include "kernels/cpu/cpu.hpp"
#include "runtime/allocator.hpp"

#include "catch.hpp"
#include "common.hpp"
#include "parallel_common.hpp"

using namespace dpt;
using namespace dpt::test;

#ifdef DPT_GPU_TESTS  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

TEST_CASE("a CUDA graph of logical replicas gives the eager step's parameters at every step", "[gpu][graph]") {
  for (float clip : {0.0f, 0.5f}) {
    TrainConfig c;
    c.model = "24-48x2-6";
    c.batch = 32;
    c.steps = 6;
    c.log_every = 1000;
    c.lr = 0.05f;
    c.parallel.clip = clip;
    c.devices = {gpu, gpu};
    Trainer eager(c), eager2(c);
    c.parallel.cuda_graph = true;
    Trainer graphed(c);
    for (int64_t s = 0; s < c.steps; ++s) {
      INFO("clip " << clip << ", step " << s + 1 << " (1 eager, 2 and 3 recorded, then replays)");
      eager.step(s);
      eager2.step(s);
      graphed.step(s);
      CHECK(eager2.model().flat_params().to_host() == eager.model().flat_params().to_host());
      CHECK(graphed.parallel().replicas_identical());
      const auto g = graphed.model().flat_grads().to_host(), e = eager.model().flat_grads().to_host();
      INFO("gradients: relative difference " << rel_error(g, e));
      CHECK(g == e);
      CHECK(graphed.model().flat_params().to_host() == eager.model().flat_params().to_host());
    }
  }
}

TEST_CASE("a replay copies the next step's shards in beside its update, or before it where the step was not named",
          "[gpu][graph]") {
  // Steps that name the next one, that name none, and one that names a step that does not
  // come (its shards are then copied before the replay): every step's parameters are the
  // eager run's bit for bit, on one GPU and on two logical replicas (p2p).
  const std::vector<std::pair<int64_t, int64_t>> steps = {{0, 32},    {32, 64},   {64, -1}, {96, 128},
                                                          {128, 500}, {200, 232}, {232, -1}};
  for (size_t replicas : {size_t{1}, size_t{2}}) {
    auto run = [&](bool graph) {
      DataParallel dp = graph_test_replicas(replicas, graph);
      data::Synthetic d({.task = data::Task::regression, .in = 24, .out = 6, .seed = 3}, gpu);
      const data::Dataset& rows = d;
      std::vector<std::vector<float>> params;
      for (const auto& [first, next] : steps) {
        dp.train_step(
            first, 32, [&](size_t r, int64_t f, int64_t n) { return rows.batch(f, n, dp.device(r)); }, nn::MSELoss(),
            {}, true, next);
        dp.synchronize();  // the replica's stream, which a read on this thread's does not wait for
        params.push_back(dp.replica(0).flat_params().to_host());
      }
      return params;
    };
    const auto eager = run(false), graphed = run(true);
    for (size_t s = 0; s < steps.size(); ++s) {
      INFO(replicas << " replicas, step " << s + 1 << " (1 eager, 2 and 3 recorded, then replays)");
      CHECK(graphed[s] == eager[s]);
    }
  }
}

TEST_CASE("a source may make the next step's shard straight into the graph's inputs", "[gpu][graph]") {
  // The source makes step s + 1's shard in the buffers that DataParallel offers while it
  // is asked for step s's, on a stream of its own once the replica's stream has done what
  // it queued (as the trainer makes synthetic data), and returns them at step s + 1, the
  // replica's stream waiting for the making: every step's parameters are the eager run's
  // bit for bit, with twin buffers (two recordings, each reading its own inputs), on one
  // GPU and on two logical replicas.
  constexpr int64_t kSteps = 9, kBatch = 32;
  for (size_t replicas : {size_t{1}, size_t{2}}) {
    int64_t offers = 0;
    auto run = [&](bool graph) {
      DataParallel dp = graph_test_replicas(replicas, graph);
      CHECK(dp.optimizers().front()->twin_buffers());
      data::Synthetic d({.task = data::Task::regression, .in = 24, .out = 6, .seed = 3}, gpu);
      const data::Dataset& rows = d;
      std::vector<data::Batch> made(replicas);  // the shard made ahead, where it was offered
      std::vector<int64_t> made_for(replicas, -1);
      std::vector<std::unique_ptr<Context>> side;
      std::vector<std::unique_ptr<Event>> queued, done;
      for (size_t r = 0; r < replicas; ++r) {
        side.push_back(std::make_unique<Context>(gpu));
        queued.push_back(std::make_unique<Event>(gpu));
        done.push_back(std::make_unique<Event>(gpu));
      }
      std::vector<std::vector<float>> params;
      for (int64_t s = 0; s < kSteps; ++s) {
        CHECK(dp.next_step_inputs(0).x.defined() == false);  // only while the source is asked
        dp.train_step(
            s * kBatch, kBatch,
            [&](size_t r, int64_t f, int64_t n) {
              Context& step_stream = context(dp.device(r));
              data::Batch b = made_for[r] == f ? made[r] : rows.batch(f, n, dp.device(r));
              if (made_for[r] == f) done[r]->wait_in(step_stream);
              if (const data::Batch into = dp.next_step_inputs(r); into.x.defined()) {
                CHECK(into.x.size(0) == n);
                CHECK(into.x.data() != b.x.data());
                queued[r]->record(step_stream);
                ContextGuard g(*side[r]);
                queued[r]->wait_in(*side[r]);
                const data::Batch next = rows.batch(f + kBatch, n, dp.device(r));
                copy(into.x, next.x);
                copy(into.y, next.y);
                done[r]->record(*side[r]);
                made[r] = into;
                made_for[r] = f + kBatch;
                offers += graph ? 1 : 0;
              } else {
                made_for[r] = -1;
              }
              return b;
            },
            nn::MSELoss(), {}, true, -1);
        dp.synchronize();
        params.push_back(dp.replica(0).flat_params().to_host());
      }
      return params;
    };
    const auto eager = run(false);
    CHECK(offers == 0);  // eager steps offer nothing
    const auto graphed = run(true);
    CHECK(offers == static_cast<int64_t>(replicas) * (kSteps - 1));  // every step after the first (eager) one
    for (size_t s = 0; s < eager.size(); ++s) {
      INFO(replicas << " replicas, step " << s + 1 << " (1 eager, 2 and 3 recorded, then replays)");
      CHECK(graphed[s] == eager[s]);
    }
  }
}

TEST_CASE("synthetic blocks of one step are made straight into a CUDA graph's inputs, bit for bit the eager run",
          "[gpu][graph]") {
  // 4096 inputs and outputs: 32 KiB a sample, so a block (32 MiB) holds one step of 1024.
  for (size_t replicas : {size_t{1}, size_t{2}})
    for (Precision p : {Precision::fp32, Precision::bf16}) {
      INFO(replicas << " replicas, " << precision_name(p));
      TrainConfig c;
      c.model = "4096-64-4096";
      c.batch = 1024 * static_cast<int64_t>(replicas);
      c.steps = 8;
      c.log_every = 1000;
      c.devices = std::vector<Device>(replicas, gpu);
      c.lr = 0.05f;
      c.parallel.precision = p;
      c.parallel.twin_buffers = TwinBuffers::on;  // 0.5M parameters: one copy by default
      Trainer eager(c);
      eager.run();
      c.parallel.cuda_graph = true;
      Trainer graphed(c);
      graphed.run();
      CHECK(graphed.optimizer().twin_buffers());
      CHECK(graphed.model().flat_params().to_host() == eager.model().flat_params().to_host());
    }
}

TEST_CASE("a step recorded as a CUDA graph trains exactly like the eager step", "[gpu][graph]") {
  // Recorded once whatever the schedule: the learning rate, AdamW's bias corrections and
  // the clipping scale are computed in the graph, on the device.
  struct Case {
    const char* optimizer;
    const char* schedule;
    float clip;
    int accum = 1;        // micro-batches, views of the graph's input
    size_t replicas = 1;  // logical replicas on the GPU, each on its stream, reduced p2p
  };
  for (const Case k : {Case{"sgd", "constant", 0.0f}, Case{"sgd", "cosine", 0.0f}, Case{"adamw", "cosine", 0.5f},
                       Case{"adamw", "warmup", 0.0f}, Case{"adamw", "cosine", 0.5f, 3},
                       Case{"adamw", "cosine", 0.5f, 1, 2}, Case{"sgd", "cosine", 1.0f, 2, 3}}) {
    INFO(k.optimizer << ", schedule " << k.schedule << ", clip " << k.clip << ", micro-batches " << k.accum
                     << ", replicas " << k.replicas);
    TrainConfig c;
    c.model = "24-48x2-6";
    c.batch = 32;
    c.steps = 25;
    c.log_every = 1000;
    c.devices = std::vector<Device>(k.replicas, gpu);
    c.optimizer = k.optimizer;
    c.lr = std::string(k.optimizer) == "sgd" ? 0.05f : 0.003f;
    c.schedule = k.schedule;
    c.warmup = std::string(k.schedule) == "constant" ? 0 : 3;  // constant has no warm-up
    c.parallel.clip = k.clip;
    c.parallel.grad_accum = k.accum;
    Trainer eager(c);
    eager.run();
    c.parallel.cuda_graph = true;
    Trainer graphed(c);
    for (int64_t s = 0; s < 3; ++s) graphed.step(s);  // eager, then recorded for each parity
    const int64_t allocs = allocator(gpu).stats().system_allocs;
    const TrainResult r = graphed.run();
    CHECK(allocator(gpu).stats().system_allocs == allocs);  // two recordings, replayed
    INFO("final loss " << r.final_loss);
    CHECK(graphed.model().flat_params().to_host() == eager.model().flat_params().to_host());  // bit for bit
    CHECK(graphed.optimizer().steps_taken() == c.steps);
  }
}

TEST_CASE("a CUDA graph on file data trains exactly like the eager step", "[gpu][graph]") {
  // The shards come from the input pipeline's slots, another buffer every step: the
  // graph's copy reads the one each launch names (one and two logical replicas, uneven
  // shards, three epochs). With micro-batches the pipeline serves one at a time, each
  // copied in before the replay.
  const std::vector<float> x = randn(53 * 12, 41);
  std::vector<int32_t> labels;
  for (int i = 0; i < 53; ++i) labels.push_back((i * 3 + 1) % 5);
  const auto set = std::make_shared<data::ArrayDataset>(data::Array{x.data(), data::ArrayDType::f32, {53, 12}},
                                                        data::Array{labels.data(), data::ArrayDType::i32, {53}});
  for (auto [replicas, accum] : {std::pair<size_t, int>{1, 1}, {2, 1}, {1, 3}, {2, 2}}) {
    INFO("replicas " << replicas << ", grad_accum " << accum);
    TrainConfig c = quiet_config("12-24x2-5", "adamw", 11);
    c.parallel.grad_accum = accum;
    c.epochs = 3;
    c.devices = std::vector<Device>(replicas, gpu);
    Trainer eager(c, set);
    eager.run();
    c.parallel.cuda_graph = true;
    Trainer graphed(c, set);
    graphed.run();
    CHECK(graphed.model().flat_params().to_host() == eager.model().flat_params().to_host());  // bit for bit
  }
}

#endif  // DPT_GPU_TESTS
