// Training on the user's own data (TrainConfig::data, or data sets of the program's): N
// replicas equal one device on shuffled, uneven, multi-epoch data; a resumed run continues
// bit-identically mid-epoch and refuses other data; validation equals a computation by
// hand; predictions equal the model's forward pass; no allocation after the first step.
// On the GPU: file data through the GPU input pipeline, against the CPU and a direct gather.

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <dptrain/data/dataset.hpp>
#include <dptrain/data/shuffle.hpp>
#include <dptrain/error.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/train/inference.hpp>
#include <dptrain/train/trainer.hpp>

#include "catch.hpp"
#include "common.hpp"
#include "data/ahead_loader.hpp"
#include "runtime/allocator.hpp"
#include "train/input_pipeline.hpp"
#include "train_common.hpp"

using namespace dpt;
using namespace dpt::test;

namespace {

// The loader's batch of the 1100 samples from `first` on d is the set's rows that `order`
// gives them, gathered.
void check_loaded(data::AheadLoader& loader, const data::ArrayDataset& set, data::RowOrder& order, int64_t first,
                  const Device& d) {
  const data::Batch got = loader.get(first, 1100, context(d));
  std::vector<int64_t> rows;
  order.rows(first, 1100, rows);
  const data::Batch want = set.empty_batch(1100, d);
  set.gather(rows, want);
  CHECK(got.x.to_host() == want.x.to_host());
  CHECK(got.y.to_host() == want.y.to_host());
}

}  // namespace

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

namespace {

// 53 rows of 12 inputs (so that batch 10 over 3 replicas is uneven and epochs end
// inside a batch), with regression targets of 5 and labels of 5 classes.
struct Rows {
  std::vector<float> x = test::randn(53 * 12, 41);
  std::vector<float> y = test::randn(53 * 5, 42);
  std::vector<int32_t> labels;
  Rows() {
    for (int i = 0; i < 53; ++i) labels.push_back((i * 3 + 1) % 5);
  }
  std::shared_ptr<const data::ArrayDataset> set(data::Task task, int64_t first = 0, int64_t count = 53) const {
    const data::Array xa{x.data() + first * 12, data::ArrayDType::f32, {count, 12}};
    const data::Array ya = task == data::Task::regression
                               ? data::Array{y.data() + first * 5, data::ArrayDType::f32, {count, 5}}
                               : data::Array{labels.data() + first, data::ArrayDType::i32, {count}};
    return std::make_shared<data::ArrayDataset>(xa, ya);
  }
};

TrainConfig config(const std::string& opt) {
  TrainConfig c = quiet_config("12-24x2-5", opt, 10);
  c.epochs = 3;
  c.parallel.bucket_mb = 0.001;  // several buckets
  return c;
}

}  // namespace

TEST_CASE("file data on N CPU replicas trains as one device: shuffled, uneven shards, three epochs", "[train][data]") {
  const Rows rows;
  int next = 700;  // fresh devices
  for (auto task : {data::Task::regression, data::Task::classification})
    for (std::string opt : {"sgd", "adamw"}) {
      INFO(data::task_name(task) << " " << opt);
      TrainConfig one = config(opt);
      one.devices = cpus(1, next++);
      Trainer a(one, rows.set(task));
      CHECK(a.config().steps == 16);  // ceil(3 * 53 / 10)
      CHECK(a.config().task == task);
      const TrainResult ra = a.run();
      CHECK(ra.final_loss < ra.first_loss);
      for (int n : {2, 3}) {
        TrainConfig many = one;
        many.devices = cpus(n, next);
        next += n;
        Trainer b(many, rows.set(task));
        b.run();
        const double err = test::rel_error(b.model().flat_params().to_host(), a.model().flat_params().to_host());
        INFO(n << " replicas: relative error " << err);
        CHECK(err < 1e-5);
        CHECK(b.parallel().replicas_identical());
      }
      // Shuffling changes the order, and so the weights; the file's order is another run.
      TrainConfig ordered = one;
      ordered.shuffle = false;
      ordered.devices = cpus(1, next++);
      Trainer c(ordered, rows.set(task));
      c.run();
      CHECK(c.model().flat_params().to_host() != a.model().flat_params().to_host());
    }
}

TEST_CASE("a run on file data resumed mid-epoch continues bit-identically; other data is refused", "[train][data]") {
  const test::TempDir dir;
  const Rows rows;
  // The data as .npy files, as a user hands them over.
  write_npy_file(dir.file("x.npy"), {rows.x.data(), data::ArrayDType::f32, {53, 12}});
  write_npy_file(dir.file("y.npy"), {rows.labels.data(), data::ArrayDType::i32, {53}});
  write_npy_file(dir.file("x2.npy"), {rows.x.data(), data::ArrayDType::f32, {52, 12}});
  write_npy_file(dir.file("y2.npy"), {rows.labels.data(), data::ArrayDType::i32, {52}});
  for (const Device d : {Device{DeviceType::cpu, 0}, Device{DeviceType::cpu, 1}}) {
    TrainConfig c = config("adamw");
    c.data = dir.file("x.npy");
    c.targets = dir.file("y.npy");
    c.devices = d.index == 0 ? std::vector<Device>{d} : cpus(3, 720);
    Trainer full(c);
    full.run();
    TrainConfig first = c;
    first.epochs = 0;
    first.steps = 7;  // samples 0..69: the second epoch has begun
    first.save = dir.file("ck.safetensors");
    Trainer part(first);
    part.run();
    TrainConfig rest = c;
    rest.resume = first.save;
    Trainer resumed(rest);
    CHECK(resumed.steps_done() == 7);
    resumed.run();
    CHECK(resumed.parameter_hash() == full.parameter_hash());
  }
  TrainConfig other = config("adamw");
  other.steps = 16;
  other.epochs = 0;
  other.data = dir.file("x2.npy");
  other.targets = dir.file("y2.npy");
  other.resume = dir.file("ck.safetensors");
  other.devices = {{DeviceType::cpu, 0}};
  try {
    Trainer t(other);
    FAIL("a checkpoint of other data was taken");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()).find("was made on other data") != std::string::npos);
  }
}

TEST_CASE("validation loss and accuracy equal a computation by hand, on any number of replicas", "[train][data]") {
  const Rows rows;
  for (auto task : {data::Task::regression, data::Task::classification}) {
    INFO(data::task_name(task));
    TrainConfig c = config("sgd");
    c.devices = cpus(3, 730);
    Trainer t(c, rows.set(task, 0, 40), rows.set(task, 40, 13));
    t.run();
    const EvalResult got = evaluate(t.parallel(), *t.val_data(), 4);  // 4 rows at a time over 3 replicas
    CHECK(got.rows == 13);
    // By hand: the master's forward over the 13 rows at once, the loss on the host.
    NoGradGuard no_grad;
    t.model().train(false);
    const auto out = t.model().forward(Tensor::from_host(std::vector<float>(rows.x.begin() + 40 * 12, rows.x.end()),
                                                         {13, 12}, t.parallel().device(0)));
    t.model().train(true);
    const std::vector<float> o = out.to_host();
    double loss = 0, right = 0;
    for (int r = 0; r < 13; ++r) {
      if (task == data::Task::regression) {
        for (int k = 0; k < 5; ++k) {
          const double e = o[static_cast<size_t>(r * 5 + k)] - rows.y[static_cast<size_t>((40 + r) * 5 + k)];
          loss += e * e / 5.0;
        }
      } else {
        const int label = rows.labels[static_cast<size_t>(40 + r)];
        double m = -INFINITY, sum = 0;
        int best = 0;
        for (int k = 0; k < 5; ++k) m = std::max(m, static_cast<double>(o[static_cast<size_t>(r * 5 + k)]));
        for (int k = 0; k < 5; ++k) {
          sum += std::exp(o[static_cast<size_t>(r * 5 + k)] - m);
          if (o[static_cast<size_t>(r * 5 + k)] > o[static_cast<size_t>(r * 5 + best)]) best = k;
        }
        loss += std::log(sum) + m - o[static_cast<size_t>(r * 5 + label)];
        right += best == label;
      }
    }
    CHECK(std::fabs(got.loss - loss / 13) <= 1e-5 * std::fabs(loss / 13));
    if (task == data::Task::classification) CHECK(got.accuracy == right / 13);
    else CHECK(std::isnan(got.accuracy));
  }
}

TEST_CASE("predictions are the model's forward pass, row for row, on any number of devices", "[train][data]") {
  const test::TempDir dir;
  const Rows rows;
  TrainConfig c = config("sgd");
  c.devices = cpus(1, 740);
  c.save = dir.file("model.safetensors");
  Trainer t(c, rows.set(data::Task::regression));
  t.run();
  NoGradGuard no_grad;
  const std::vector<float> want =
      t.model().forward(Tensor::from_host(rows.x, {53, 12}, t.parallel().device(0))).to_host();
  for (int n : {1, 3}) {
    INFO(n << " devices");
    Inference model({.checkpoint = c.save, .devices = cpus(n, 741), .batch = 7});
    CHECK(model.task() == data::Task::regression);
    const std::vector<float> got = model.predict(*rows.set(data::Task::regression));
    CHECK(test::rel_error(got, want) < 1e-6);
    const EvalResult e = model.evaluate(*rows.set(data::Task::regression));
    CHECK(e.rows == 53);
    CHECK(std::isfinite(e.loss));
  }
  // A data set that does not fit the model is one line naming both shapes.
  const std::vector<float> narrow(53 * 11, 0.5f);
  const data::ArrayDataset wrong({narrow.data(), data::ArrayDType::f32, {53, 11}}, {});
  Inference model({.checkpoint = c.save, .devices = cpus(1, 745)});
  CHECK_THROWS_AS(model.predict(wrong), UsageError);
}

TEST_CASE("steps on file data allocate nothing after the first", "[train][data][memory]") {
  const Rows rows;
  TrainConfig c = config("adamw");
  c.devices = cpus(3, 750);
  c.epochs = 5;
  Trainer t(c, rows.set(data::Task::classification, 0, 40), rows.set(data::Task::classification, 40, 13));
  check_no_allocs_after_first(t, c.devices, [&] { (void)t.validate_now(); });  // and the first validation
}

TEST_CASE("the input pipeline expects each replica's next micro-batch, and the next step's first", "[train][data]") {
  // Batch 10 over 3 replicas (4, 3, 3) in 2 micro-batches: replica 0 has [0, 2) [2, 4),
  // replica 2 has [7, 9) [9, 10).
  const ShardPlan plan(10, 1, 0, 3, 2);
  CHECK(next_shard(plan, 0, 30) == SampleRange{32, 2});
  CHECK(next_shard(plan, 0, 32) == SampleRange{40, 2});
  CHECK(next_shard(plan, 2, 57) == SampleRange{59, 1});
  CHECK(next_shard(plan, 2, 59) == SampleRange{67, 2});
  // Batch 3 over 2 replicas (2, 1) in 2 micro-batches: replica 1's second is empty.
  const ShardPlan thin(3, 1, 0, 2, 2);
  CHECK(next_shard(thin, 1, 2) == SampleRange{5, 1});
  CHECK_THROWS_AS(next_shard(plan, 0, 31), Error);
}

TEST_CASE("the input pipeline hands out the rows a direct gather gives, expected or not, and its errors",
          "[train][data][pipeline]") {
  // On a CPU device the copies are plain memcpy, but the slots, the loader thread and the
  // events take the GPU's path.
  const Rows rows;
  const Device d{DeviceType::cpu, 760};
  const auto ten_on = [](int64_t first) { return data::Samples{first + 10, 8}; };
  for (auto task : {data::Task::regression, data::Task::classification}) {
    INFO(data::task_name(task));
    const auto set = rows.set(task);
    data::AheadLoader loader(*set, d, 8, 5, true, ten_on, 2);
    data::RowOrder order(53, 5, true);
    std::vector<int64_t> picked;
    // Calls the loader
    // foreseen (the next at first + 10, of 8), then a jump (as after a resume), then smaller counts.
    const std::vector<std::pair<int64_t, int64_t>> calls = {{3, 8},  {13, 8},  {23, 8},  {33, 8},  {43, 8},
                                                            {53, 8}, {200, 8}, {210, 8}, {220, 5}, {230, 5}};
    for (const auto& [first, count] : calls) {
      const data::Batch got = loader.get(first, count, context(d));
      order.rows(first, count, picked);
      const data::Batch want = set->empty_batch(count, d);
      set->gather(picked, want);
      CHECK(got.x.to_host() == want.x.to_host());
      if (task == data::Task::regression) CHECK(got.y.to_host() == want.y.to_host());
      else CHECK(got.y.to_host_i32() == want.y.to_host_i32());
    }
  }
  // The loader counts what it gathered.
  {
    const auto set = rows.set(data::Task::regression);
    data::AheadLoader counted(*set, d, 8, 5, true, ten_on, 1);
    for (int64_t first : {0, 10, 20}) (void)counted.get(first, 8, context(d));
    const InputStats st = counted.stats();
    CHECK(st.loads >= 3);
    CHECK(st.bytes == static_cast<uint64_t>(st.loads * 8 * (12 + 5) * 4));
  }
  // The loader runs ahead by its ring: it fills every slot but the one handed out, and no
  // more until the next call frees that one.
  {
    const auto set = rows.set(data::Task::regression);
    data::AheadLoader ahead(*set, d, 8, 5, true, ten_on, 1);
    REQUIRE(ahead.slots() >= 3);  // small shards: a deep ring
    (void)ahead.get(0, 8, context(d));
    const auto loads = [&] { return static_cast<size_t>(ahead.stats().loads); };
    for (int i = 0; i < 1000 && loads() < ahead.slots(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK(loads() == ahead.slots());
    (void)ahead.get(10, 8, context(d));
    for (int i = 0; i < 1000 && loads() < ahead.slots() + 1; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    CHECK(loads() == ahead.slots() + 1);
  }
  // A shard of over 4 MiB is gathered in chunks (each copied while the next is gathered),
  // each chunk by several threads, each into its own rows.
  const auto big_x = test::randn(1200 * 1024, 43), big_y = test::randn(1200 * 2, 44);
  const data::ArrayDataset big({big_x.data(), data::ArrayDType::f32, {1200, 1024}},
                               {big_y.data(), data::ArrayDType::f32, {1200, 2}});
  const auto eleven_hundred_on = [](int64_t first) { return data::Samples{first + 1100, 1100}; };
  data::AheadLoader wide(big, d, 1100, 9, true, eleven_hundred_on, 4);
  data::RowOrder big_order(1200, 9, true);
  for (int64_t first : {0, 1100, 2200, 3300}) {
    check_loaded(wide, big, big_order, first, d);
  }
  // A bad row in a chunk gathered by several threads fails that call alone. File order:
  // samples 1100..2199 are rows 1100..1199, 0..999 (row 960 is in their second chunk),
  // samples 2200..3299 are rows 1000..1199, 0..899.
  {
    std::vector<float> nan_x = big_x;
    nan_x[960 * 1024 + 7] = NAN;
    const data::ArrayDataset bad_big({nan_x.data(), data::ArrayDType::f32, {1200, 1024}},
                                     {big_y.data(), data::ArrayDType::f32, {1200, 2}});
    data::AheadLoader chunked(bad_big, d, 1100, 9, false, eleven_hundred_on, 4);
    try {
      (void)chunked.get(1100, 1100, context(d));
      FAIL("the NaN row was handed out");
    } catch (const UsageError& e) {
      CHECK(std::string(e.what()).find("x[960, 7] is nan") != std::string::npos);
    }
    CHECK_NOTHROW(chunked.get(2200, 1100, context(d)));
  }
  // A bad row is reported by the call that asks for it, not by the prefetch that met it.
  std::vector<float> x = rows.x;
  x[17 * 12 + 4] = NAN;  // row 17
  const data::ArrayDataset bad({x.data(), data::ArrayDType::f32, {53, 12}},
                               {rows.y.data(), data::ArrayDType::f32, {53, 5}});
  const auto ten_of_ten = [](int64_t first) { return data::Samples{first + 10, 10}; };
  data::AheadLoader loader(bad, d, 10, 5, false, ten_of_ten, 1);  // file order: row 17 is in samples 10..19
  CHECK_NOTHROW(loader.get(0, 10, context(d)));                   // loads 10..19 behind the scenes
  CHECK_THROWS_AS(loader.get(10, 10, context(d)), UsageError);
  CHECK_NOTHROW(loader.get(20, 10, context(d)));
}

TEST_CASE("a bad row in one replica's shard abandons the step on every replica alike", "[train][data]") {
  // Replica 2's shard of the fourth step holds a NaN: its source fails, the other
  // replicas still finish the step's reduction, nobody updates, and the error is the row's.
  Rows rows;
  std::vector<float> x = rows.x;
  TrainConfig c = config("sgd");
  c.shuffle = false;  // file order: step s reads rows 10s .. 10s + 9; replica 2 the last three
  c.devices = cpus(3, 780);
  x[static_cast<size_t>(38 * 12 + 5)] = NAN;  // row 38: step 3, replica 2
  const auto bad = std::make_shared<data::ArrayDataset>(data::Array{x.data(), data::ArrayDType::f32, {53, 12}},
                                                        data::Array{rows.y.data(), data::ArrayDType::f32, {53, 5}});
  Trainer t(c, bad);
  for (int64_t s = 0; s < 3; ++s) t.step(s);
  const std::vector<float> before = t.model().flat_params().to_host();
  try {
    t.step(3);
    FAIL("the NaN row was trained on");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()).find("x[38, 5] is nan") != std::string::npos);
  }
  CHECK(t.parallel().replicas_identical());
  CHECK(t.model().flat_params().to_host() == before);
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

TEST_CASE("file data through the GPU input pipeline trains as on the CPU, with no cudaMalloc after the first step",
          "[gpu][train][data]") {
  // 203 rows (epochs end inside batches), shuffled, three epochs; one GPU and two logical
  // replicas on it (each with its own loader thread, pinned buffers and copy stream).
  const auto xs = randn(203 * 32, 61), ys = randn(203 * 8, 62);
  std::vector<int32_t> labels(203);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int32_t>((i * 5 + 2) % 8);
  for (auto task : {data::Task::regression, data::Task::classification}) {
    INFO(data::task_name(task));
    const data::Array x{xs.data(), data::ArrayDType::f32, {203, 32}};
    const data::Array y = task == data::Task::regression ? data::Array{ys.data(), data::ArrayDType::f32, {203, 8}}
                                                         : data::Array{labels.data(), data::ArrayDType::i32, {203}};
    const auto rows = std::make_shared<data::ArrayDataset>(x, y);
    TrainConfig cfg = quiet_config("32-64x2-8", "adamw", 64);
    cfg.epochs = 3;
    cfg.devices = {host};
    Trainer a(cfg, rows);
    a.run();
    for (auto [n, accum] : {std::pair<size_t, int>{1, 1}, {2, 1}, {2, 3}}) {
      cfg.devices = std::vector<Device>(n, gpu);
      cfg.parallel.reduce = n > 1 ? Reduce::p2p : Reduce::automatic;
      cfg.parallel.grad_accum = accum;  // the loader then asks for each micro-batch in turn
      Trainer b(cfg, rows);
      b.step(0, /*measure=*/true);
      const int64_t after_first = allocator(gpu).stats().system_allocs;
      b.run();
      CHECK(allocator(gpu).stats().system_allocs == after_first);
      const double err = rel_error(b.model().flat_params().to_host(), a.model().flat_params().to_host());
      INFO(n << " replica(s), " << accum << " micro-batch(es): weights relative error " << err);
      CHECK(err < 1e-4);
    }
  }
}

TEST_CASE("the GPU input pipeline copies chunked shards as a direct gather makes them, ahead and after a jump",
          "[gpu][data][pipeline]") {
  // 1100 rows of 1026 floats: over 4 MiB, so two chunks, each gathered by four threads
  // and copied while the next is gathered; the ring runs ahead on the copy stream.
  const auto xs = randn(1200 * 1024, 63), ys = randn(1200 * 2, 64);
  const data::ArrayDataset set({xs.data(), data::ArrayDType::f32, {1200, 1024}},
                               {ys.data(), data::ArrayDType::f32, {1200, 2}});
  data::AheadLoader loader(
      set, gpu, 1100, 3, true,
      [](int64_t first) {
        return data::Samples{first + 1100, 1100};
      },
      4);
  data::RowOrder order(1200, 3, true);
  for (int64_t first : {0, 1100, 2200, 3300, 9000, 10100}) {  // 9000: not foreseen
    INFO("samples from " << first);
    check_loaded(loader, set, order, first, gpu);
  }
  const InputStats st = loader.stats();
  CHECK(st.loads >= 6);
  CHECK(st.timed_copies >= 1);
  CHECK(st.copy_ms > 0);
}

#endif  // DPT_GPU_TESTS
