// Data parallelism: shard plans, N CPU replicas against one device (fp32, bf16, CNNs, batch
// norm, host batches), memory balance, refused paths, allocation after the first step; on
// the GPU, logical replicas and N GPUs against one GPU, pinned host batches, balanced memory.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <thread>
#include <tuple>
#include <utility>

#include <dptrain/error.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/train/trainer.hpp>
#include "kernels/cpu/cpu.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/cuda.hpp"
#endif

#include "catch.hpp"
#include "common.hpp"
#include "parallel/reducer.hpp"
#include "parallel_common.hpp"
#include "runtime/allocator.hpp"

using namespace dpt;
using namespace dpt::test;

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

TEST_CASE("shards are contiguous and differ by at most one", "[parallel]") {
  CHECK(split_evenly(10, 3) == std::vector<int64_t>{4, 3, 3});
  CHECK(split_evenly(12, 4) == std::vector<int64_t>{3, 3, 3, 3});
  CHECK(split_evenly(2, 4) == std::vector<int64_t>{1, 1, 0, 0});
  CHECK(split_evenly(7, 1) == std::vector<int64_t>{7});
}

TEST_CASE("a shard plan splits the batch over ranks, then replicas, then micro-batches", "[parallel]") {
  // Batch 23 over 2 ranks (12, 11); rank 1's 11 samples over 3 replicas (4, 4, 3); each over 2 micro-batches.
  const ShardPlan p(23, 2, 1, 3, 2);
  CHECK(p.rank_part() == SampleRange{12, 11});
  CHECK(p.replica_part(0) == SampleRange{12, 4});
  CHECK(p.replica_part(2) == SampleRange{20, 3});
  CHECK(p.micro(2, 0) == SampleRange{20, 2});
  CHECK(p.micro(2, 1) == SampleRange{22, 1});
  CHECK(p.weight(2, 1) == 1.0 / 23.0);
  CHECK(p.idle_replicas() == 0);
  // Every sample of the batch lands in exactly one micro-batch of exactly one rank, and the weights add up to one.
  std::vector<int> seen(23, 0);
  double weights = 0.0;
  for (int rank = 0; rank < 2; ++rank) {
    const ShardPlan q(23, 2, rank, 3, 2);
    for (size_t r = 0; r < 3; ++r)
      for (int k = 0; k < 2; ++k) {
        for (int64_t i = 0; i < q.micro(r, k).count; ++i) seen[static_cast<size_t>(q.micro(r, k).first + i)] += 1;
        weights += q.weight(r, k);
      }
  }
  CHECK(std::count(seen.begin(), seen.end(), 1) == 23);
  CHECK(std::abs(weights - 1.0) <= 1e-12);
  // A batch smaller than the replicas leaves some without samples.
  CHECK(ShardPlan(3, 1, 0, 5, 1).idle_replicas() == 2);
  CHECK(ShardPlan(3, 1, 0, 5, 1).replica_part(4).count == 0);
  CHECK_THROWS_AS(ShardPlan(0, 1, 0, 2, 1), UsageError);
  // Micro-batches are split_evenly's sizes end to end, for every count up to the part's.
  for (int m = 1; m <= 11; ++m) {
    const ShardPlan q(23, 1, 0, 2, m);
    const SampleRange part = q.replica_part(1);
    int64_t first = part.first;
    const auto sizes = split_evenly(part.count, static_cast<size_t>(m));
    for (int k = 0; k < m; ++k) {
      CHECK(q.micro(1, k) == SampleRange{first, sizes[static_cast<size_t>(k)]});
      first += sizes[static_cast<size_t>(k)];
    }
  }
  // Micro-batches are computed, not stored (a hostile --grad-accum took 16 GB of host
  // memory before the first step); a step keeps a loss per micro-batch, so their number
  // is capped, the same on every machine.
  const ShardPlan most(1'000'000'000, 1, 0, 1, kMaxGradAccum);
  CHECK(most.micro(0, kMaxGradAccum - 1).count == 1'000'000'000 / kMaxGradAccum);
  CHECK_THROWS_AS(ShardPlan(1'000'000'000, 1, 0, 1, kMaxGradAccum + 1), UsageError);
}

TEST_CASE("N CPU replicas train exactly like one device on the whole batch", "[parallel]") {
  for (auto task : {data::Task::regression, data::Task::classification})
    for (std::string opt : {"sgd", "adamw"})
      for (int64_t batch : {12, 10}) {
        TrainConfig one = small(task, opt, batch);
        one.devices = cpus(1);
        Trainer ref(one);
        ref.run();
        const auto want = ref.model().flat_params().to_host();
        for (Reduce path : {Reduce::host, Reduce::p2p})
          for (int n = 1; n <= 5; ++n) {
            INFO(data::task_name(task) << " " << opt << " batch " << batch << " on " << n << " devices, reduce "
                                       << reduce_name(path));
            TrainConfig c = one;
            c.devices = cpus(n);
            c.parallel.reduce = path;
            Trainer t(c);
            REQUIRE(t.parallel().buckets() > 1);
            step_replicas_identical(t, c.steps);
            CHECK(test::rel_error(t.model().flat_params().to_host(), want) <= 1e-5);
          }
      }
}

TEST_CASE("twin buffers on N CPU replicas train bit for bit as one copy, overlapped or not, skipping alike",
          "[parallel]") {
  // The buckets' hooks find a parameter by its offset in the flat buffer, whose memory
  // alternates between the two copies.
  for (std::string opt : {"sgd", "adamw"})
    for (bool overlap : {true, false}) {
      INFO(opt << (overlap ? ", overlapped" : ", after backward"));
      TrainConfig c = small(data::Task::regression, opt, 12);
      c.devices = cpus(3, 120);
      c.parallel.overlap = overlap;
      c.parallel.twin_buffers = TwinBuffers::off;
      Trainer one(c);
      one.run();
      c.parallel.twin_buffers = TwinBuffers::on;
      Trainer two(c);
      step_replicas_identical(two, c.steps);
      CHECK(two.optimizer().twin_buffers());
      CHECK(two.optimizer().twin_bytes() == static_cast<int64_t>(two.model().flat_params().nbytes()) *
                                                (opt == "sgd" ? 2 : 3));  // the parameters and the state
      CHECK(two.parallel().model_state_bytes()[0].twins == two.optimizer().twin_bytes());
      CHECK(one.parallel().model_state_bytes()[0].twins == 0);
      CHECK(two.model().flat_params().to_host() == one.model().flat_params().to_host());
      // The default keeps one copy on CPUs, and clipping keeps one anywhere.
      c.parallel.twin_buffers = TwinBuffers::automatic;
      CHECK_FALSE(Trainer(c).optimizer().twin_buffers());
      c.parallel.twin_buffers = TwinBuffers::on;
      c.parallel.clip = 1.0f;
      CHECK_FALSE(Trainer(c).optimizer().twin_buffers());
    }
  // A non-finite step is skipped alike.
  TrainConfig c = overflowing(cpus(2, 125));
  c.parallel.twin_buffers = TwinBuffers::off;
  Trainer one(c);
  const TrainResult a = one.run();
  c.parallel.twin_buffers = TwinBuffers::on;
  Trainer two(c);
  const TrainResult b = two.run();
  CHECK(a.skipped > 0);
  CHECK(b.skipped == a.skipped);
  CHECK(two.model().flat_params().to_host() == one.model().flat_params().to_host());
}

TEST_CASE("a batch smaller than the device count uses fewer replicas and stays exact", "[parallel]") {
  TrainConfig one = small(data::Task::regression, "sgd", 3);
  one.devices = cpus(1);
  Trainer ref(one);
  ref.run();
  TrainConfig c = one;
  c.devices = cpus(5);
  Trainer t(c);
  t.run();
  CHECK(t.parallel().replicas_identical());
  CHECK(test::rel_error(t.model().flat_params().to_host(), ref.model().flat_params().to_host()) <= 1e-5);
}

TEST_CASE("the reported loss is the shard-weighted mean", "[parallel]") {
  TrainConfig one = small(data::Task::regression, "sgd", 10);
  one.devices = cpus(1);
  TrainConfig three = one;
  three.devices = cpus(3);
  Trainer a(one), b(three);
  const float la = a.step(0).value(), lb = b.step(0).value();
  CHECK(std::fabs(la - lb) <= 1e-6f * std::fabs(la));
}

TEST_CASE("a batch given from the host is split and copied to the replicas", "[parallel]") {
  const Device host{DeviceType::cpu, 0};
  auto make = [&](int n) {
    auto m = nn::mlp("6-8-3");
    m->to(host, 4);
    return std::make_unique<DataParallel>(
        m, cpus(n), [](nn::Module& r) { return std::make_unique<optim::SGD>(r, optim::SGD::Options{.lr = 0.1f}); });
  };
  data::Synthetic d({.task = data::Task::regression, .in = 6, .out = 3, .seed = 2}, host);
  auto single = make(1), multi = make(3);
  for (int s = 0; s < 5; ++s) {
    data::Batch b = d.batch(s * 7, 7);
    single->train_step(b, nn::MSELoss());
    multi->train_step(b, nn::MSELoss());
  }
  CHECK(multi->replicas_identical());
  CHECK(test::rel_error(multi->replica(0).flat_params().to_host(), single->replica(0).flat_params().to_host()) <= 1e-5);
}

TEST_CASE("memory: no device is a dumping ground", "[parallel][memory]") {
  // Fresh device numbers, so each allocator's peak belongs to this test alone.
  auto peaks = [](const TrainResult& r) {
    std::vector<double> p;
    for (auto& [d, m] : r.memory) p.push_back(static_cast<double>(m.peak_allocated));
    return p;
  };
  TrainConfig c = small(data::Task::regression, "sgd", 64);
  c.model = "64-256x2-16";
  c.momentum = 0.0f;  // no optimizer state: the master's extra on p2p is the staging bucket alone
  c.steps = 3;
  c.parallel.bucket_mb = 0.05;
  SECTION("host: every replica within 5% of the master") {
    c.devices = cpus(4, 100);
    c.parallel.reduce = Reduce::host;
    auto p = peaks(Trainer(c).run());
    for (size_t i = 1; i < p.size(); ++i) CHECK(std::fabs(p[0] - p[i]) <= 0.05 * p[i]);
  }
  SECTION("p2p: the master's extra is one reused staging bucket, not N-1 gradient copies") {
    c.devices = cpus(4, 200);
    c.parallel.reduce = Reduce::p2p;
    Trainer t(c);
    const double grads = static_cast<double>(t.model().flat_grads().nbytes());
    auto p = peaks(t.run());
    const double bucket = static_cast<double>(CachingAllocator::round_size(size_t(0.05 * 1024 * 1024)));
    for (size_t i = 1; i < p.size(); ++i) {
      INFO("master " << p[0] << " replica " << p[i] << " bucket " << bucket << " grads " << grads);
      CHECK(p[0] - p[i] <= bucket + 4096);
      CHECK(p[0] - p[i] < grads);
    }
  }
}

TEST_CASE("reduction paths that cannot serve the devices are refused", "[parallel]") {
  CHECK(resolve_reduce(Reduce::automatic, cpus(3)) == Reduce::host);
  CHECK_THROWS_AS(resolve_reduce(Reduce::nccl, cpus(2)), UsageError);
  if (cuda_device_count() > 0) {
    const Device g{DeviceType::cuda, 0};
    CHECK_THROWS_AS(resolve_reduce(Reduce::nccl, {g, g}), UsageError);
    CHECK_THROWS_AS(resolve_reduce(Reduce::host, {g}), UsageError);
    CHECK(resolve_reduce(Reduce::automatic, {g, g}) == Reduce::p2p);
  }
  CHECK_THROWS_AS(parse_reduce("allgather"), UsageError);
  TrainConfig c;
  c.devices = {{DeviceType::cpu, 0}, {DeviceType::cuda, 0}};
  CHECK_THROWS_AS(validate(c), UsageError);
}

TEST_CASE("reducing after backward (no overlap) and with gradient accumulation gives the same weights", "[parallel]") {
  TrainConfig one = small(data::Task::regression, "sgd", 12);
  one.devices = cpus(1);
  Trainer ref(one);
  ref.run();
  const auto want = ref.model().flat_params().to_host();
  for (bool overlap : {true, false})
    for (int accum : {1, 3}) {
      INFO("overlap " << overlap << " grad-accum " << accum);
      TrainConfig c = one;
      c.devices = cpus(3);
      c.parallel.overlap = overlap;
      c.parallel.grad_accum = accum;
      Trainer t(c);
      t.run();
      CHECK(t.parallel().replicas_identical());
      CHECK(test::rel_error(t.model().flat_params().to_host(), want) <= 1e-5);
    }
}

TEST_CASE("data-parallel steps allocate nothing after the first, replicas sharing a device or not",
          "[parallel][memory]") {
  int next = 400;  // fresh devices: each allocator's count belongs to this test alone
  for (Reduce path : {Reduce::host, Reduce::p2p})
    for (bool shared : {false, true}) {
      INFO(reduce_name(path) << (shared ? ", three replicas on one CPU device" : ", three CPU devices"));
      TrainConfig c = small(data::Task::regression, "sgd", 10);
      c.steps = 15;
      c.log_every = 7;
      const Device d{DeviceType::cpu, next};
      c.devices = shared ? std::vector<Device>{d, d, d} : cpus(3, next);
      next += 3;
      c.parallel.reduce = path;
      Trainer t(c);
      check_no_allocs_after_first(t, c.devices);
    }
}

TEST_CASE("a CNN on N CPU replicas trains exactly like one device on the whole batch", "[parallel][cnn]") {
  TrainConfig one = small(data::Task::classification, "sgd", 10);
  one.model = "cnn:2x7x7-c4k3-p2-c6k3s2-a2s1p1-f3";  // no batch norm: shards do not matter
  one.steps = 8;
  one.devices = cpus(1);
  Trainer ref(one);
  ref.run();
  const auto want = ref.model().flat_params().to_host();
  for (Reduce path : {Reduce::host, Reduce::p2p})
    for (int n : {2, 3}) {  // 5/5 and 4/3/3
      INFO(n << " devices, reduce " << reduce_name(path));
      TrainConfig c = one;
      c.devices = cpus(n);
      c.parallel.reduce = path;
      Trainer t(c);
      REQUIRE(t.parallel().buckets() > 1);
      t.run();
      CHECK(t.parallel().replicas_identical());
      CHECK(test::rel_error(t.model().flat_params().to_host(), want) <= 1e-5);
    }
}

TEST_CASE("batch norm: statistics per replica, the master's running statistics on every replica", "[parallel][cnn]") {
  TrainConfig c = small(data::Task::classification, "sgd", 10);
  c.model = "cnn:2x6x6-c4k3-bn-p2-f3";
  c.steps = 7;
  c.devices = cpus(3);
  Trainer t(c);
  const Tensor& master = t.model().flat_buffers();
  REQUIRE(master.defined());
  const auto initial = master.to_host();
  for (int64_t s = 0; s < 5; ++s) {
    t.step(s);
    REQUIRE(t.parallel().replicas_identical());  // parameters and buffers, bitwise
  }
  CHECK(master.to_host() != initial);
  // The replicas follow the master's mode, even when it changes after they were made:
  // in evaluation mode batch norm has no backward, on any replica.
  t.model().eval();
  CHECK_THROWS_AS(t.step(5), Error);
  t.model().train();
  t.step(5);
  CHECK(t.parallel().replicas_identical());
  // The running statistics are those of the master's own shard, as in nn.DataParallel
  // and DDP: after one step (4/3/3), those of one device's forward over samples 0..3.
  Trainer one_step(c);
  one_step.step(0);
  TrainConfig alone = c;
  alone.devices = cpus(1);
  Trainer ref(alone);
  data::Synthetic d({.task = data::Task::classification, .out = 3, .image = {2, 6, 6}, .seed = c.seed},
                    cpus(1).front());
  {
    NoGradGuard g;
    ref.model().forward(d.batch(0, 4).x);
  }
  CHECK(test::rel_error(one_step.model().flat_buffers().to_host(), ref.model().flat_buffers().to_host()) <= 1e-6);
}

TEST_CASE("N CPU replicas train a bf16 model like one device, every replica's shadow current", "[parallel][bf16]") {
  auto shadow_current = [](nn::Module& m) {
    return m.flat_shadow().defined() && test::bf16_bits(m.flat_shadow()) == test::bf16_bits(m.flat_params());
  };
  for (std::string opt : {"sgd", "adamw"}) {
    TrainConfig one = small(data::Task::regression, opt, 10);
    one.devices = cpus(1);
    Trainer f32(one);
    f32.run();
    one.parallel.precision = Precision::bf16;
    Trainer ref(one);
    ref.run();
    const auto want = ref.model().flat_params().to_host();
    REQUIRE(test::rel_error(f32.model().flat_params().to_host(), want) > 1e-6);  // bf16 is not fp32
    for (Reduce path : {Reduce::host, Reduce::p2p})
      for (int n : {2, 3, 4}) {
        INFO(opt << " on " << n << " devices, reduce " << reduce_name(path));
        TrainConfig c = one;
        c.devices = cpus(n);
        c.parallel.reduce = path;
        Trainer t(c);
        for (int64_t s = 0; s < c.steps; ++s) {
          t.step(s);
          // p2p: only the master steps; the others get its parameters and refresh their shadow.
          REQUIRE(t.parallel().replicas_identical());
          for (size_t r = 0; r < t.parallel().size(); ++r) REQUIRE(shadow_current(t.parallel().replica(r)));
        }
        const double e = test::rel_error(t.model().flat_params().to_host(), want);
        INFO("weights relative error " << e);
        CHECK(e <= 1e-4);
      }
  }
}

TEST_CASE("zero_grad() zeroes nothing: backward overwrites stale gradients, settle_grads() zeroes the rest",
          "[parallel][memory]") {
  const Device cpu0{DeviceType::cpu, 0};
  auto model = nn::mlp("6-5-3", Act::relu);
  model->to(cpu0, 1);
  auto reference = model->replicate(cpu0);  // its gradient buffer starts at zero
  Tensor x1 = test::randn_tensor({4, 6}, 1, cpu0), x2 = test::randn_tensor({4, 6}, 2, cpu0);
  Tensor t = test::randn_tensor({4, 3}, 3, cpu0);
  model->zero_grad();
  nn::MSELoss()(model->forward(x1), t).backward();
  const auto g1 = model->flat_grads().to_host();
  model->zero_grad();
  CHECK(model->flat_grads().to_host() == g1);  // no pass over the buffer
  nn::MSELoss()(model->forward(x2), t).backward();
  nn::MSELoss()(reference->forward(x2), t).backward();
  CHECK(model->flat_grads().to_host() == reference->flat_grads().to_host());  // overwritten, not added
  // Nothing reached (an empty shard): settling zeroes the whole buffer.
  model->zero_grad();
  model->settle_grads();
  for (float v : model->flat_grads().to_host()) CHECK(v == 0.0f);
  // A leaf that backward does not reach keeps its stale gradient until settled.
  Tensor used = test::randn_tensor({3, 6}, 4, cpu0), unused = test::randn_tensor({3, 6}, 5, cpu0);
  for (Tensor* w : {&used, &unused}) {
    w->set_requires_grad(true);
    w->set_grad(Tensor::full({3, 6}, 7.0f, cpu0));
    w->set_grad_stale(true);
  }
  nn::MSELoss()(linear(x1, used, Tensor()), t).backward();
  CHECK_FALSE(used.grad_stale());
  CHECK(unused.grad_stale());
  for (float v : used.grad().to_host()) CHECK(v != 7.0f);
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

TEST_CASE("logical replicas on one GPU (p2p) and NCCL with one rank equal one-GPU training", "[gpu][parallel]") {
  for (auto task : {data::Task::regression, data::Task::classification})
    for (std::string opt : {"sgd", "adamw"}) {
      INFO(data::task_name(task) << " " << opt);
      TrainConfig c = dp_config(task, opt);
      const auto want = train_dp(c, {gpu}, Reduce::automatic);
      for (int n : {2, 3, 4}) {
        INFO(n << " logical replicas on cuda:0");
        CHECK(rel_error(train_dp(c, std::vector<Device>(static_cast<size_t>(n), gpu), Reduce::p2p), want) <= 1e-5);
      }
      if (built_with_nccl()) {
        INFO("NCCL, one rank");
        CHECK(rel_error(train_dp(c, {gpu}, Reduce::nccl), want) <= 1e-5);
      }
    }
}

TEST_CASE("data-parallel steps make no cudaMalloc after the first", "[gpu][parallel][allocator]") {
  TrainConfig c = dp_config(data::Task::regression, "sgd");
  c.devices = {gpu, gpu, gpu};
  c.parallel.reduce = Reduce::p2p;
  c.steps = 15;
  Trainer t(c);
  check_no_allocs_after_first(t, {gpu});
}

TEST_CASE("N GPUs equal one GPU on both paths, with balanced memory", "[gpu][parallel][multigpu]") {
  const int gpus = cuda_device_count();
  if (gpus < 2) {
    WARN("one GPU here: the multi-GPU data-parallel tests need 2 or more");
    return;
  }
  for (std::string opt : {"sgd", "adamw"}) {
    TrainConfig c = dp_config(data::Task::regression, opt);
    const auto want = train_dp(c, {gpu}, Reduce::automatic);
    for (int n = 2; n <= std::min(gpus, 8); ++n) {
      std::vector<Device> devs;
      for (int i = 0; i < n; ++i) devs.push_back({DeviceType::cuda, i});
      for (Reduce path : {Reduce::p2p, Reduce::nccl}) {
        if (path == Reduce::nccl && !built_with_nccl()) continue;
        INFO(opt << " on " << n << " GPUs, reduce " << reduce_name(path));
        CHECK(rel_error(train_dp(c, devs, path), want) <= 1e-5);
      }
    }
  }
  // Memory: a model large enough that N-1 gradient copies would show.
  std::vector<Device> devs;
  for (int i = 0; i < gpus; ++i) devs.push_back({DeviceType::cuda, i});
  TrainConfig c = dp_config(data::Task::regression, "sgd");
  c.model = "256-1024x2-64";
  c.momentum = 0.0f;
  c.batch = 256 * gpus;
  c.steps = 3;
  c.parallel.bucket_mb = 1.0;
  for (Reduce path : {Reduce::nccl, Reduce::p2p}) {
    if (path == Reduce::nccl && !built_with_nccl()) continue;
    for (const Device& d : devs) allocator(d).reset_peak();
    c.devices = devs;
    c.parallel.reduce = path;
    TrainResult r = Trainer(c).run();
    const double master = static_cast<double>(r.memory[0].second.peak_allocated);
    for (size_t i = 1; i < r.memory.size(); ++i) {
      const double other = static_cast<double>(r.memory[i].second.peak_allocated);
      INFO(reduce_name(path) << ": master " << master << " B, " << r.memory[i].first.str() << " " << other << " B");
      if (path == Reduce::nccl) CHECK(std::fabs(master - other) <= 0.05 * other);
      else CHECK(master - other <= static_cast<double>(CachingAllocator::round_size(1 << 20)) + 4096);
    }
  }
}

TEST_CASE("a host batch is split, staged through pinned memory and trained exactly", "[gpu][parallel]") {
  data::Synthetic d({.task = data::Task::regression, .in = 6, .out = 3, .seed = 2}, host);
  auto make = [&](std::vector<Device> devs) {
    auto m = nn::mlp("6-16-3");
    m->to(gpu, 4);
    return std::make_unique<DataParallel>(
        m, std::move(devs),
        [](nn::Module& r) { return std::make_unique<optim::SGD>(r, optim::SGD::Options{.lr = 0.1f}); },
        DataParallelOptions{.reduce = Reduce::p2p});
  };
  auto single = make({gpu}), multi = make({gpu, gpu, gpu});
  for (int s = 0; s < 5; ++s) {
    data::Batch b = d.batch(s * 7, 7);  // on the host
    single->train_step(b, nn::MSELoss());
    multi->train_step(b, nn::MSELoss());
  }
  CHECK(multi->replicas_identical());
  CHECK(rel_error(multi->replica(0).flat_params().to_host(), single->replica(0).flat_params().to_host()) <= 1e-5);
}

TEST_CASE("bf16 on logical replicas of one GPU (p2p), NCCL with one rank and a CUDA graph equal one GPU",
          "[gpu][parallel][graph][bf16]") {
  TrainConfig c = dp_config(data::Task::regression, "adamw");
  c.parallel.precision = Precision::bf16;
  const auto want = train_dp(c, {gpu}, Reduce::automatic);  // asserts replicas identical, shadows included
  for (int n : {2, 3}) {
    INFO(n << " logical replicas on cuda:0");
    const double err = rel_error(train_dp(c, std::vector<Device>(static_cast<size_t>(n), gpu), Reduce::p2p), want);
    INFO("relative error " << err);
    CHECK(err <= 1e-3);  // shard sizes pick other GEMM kernels: bf16 roundings may differ
  }
  if (built_with_nccl()) CHECK(rel_error(train_dp(c, {gpu}, Reduce::nccl), want) <= 1e-5);
  c.optimizer = "sgd";
  c.devices = {gpu};
  Trainer eager(c);
  eager.run();
  c.parallel.cuda_graph = true;
  Trainer graphed(c);
  for (int64_t s = 0; s < 3; ++s) graphed.step(s);  // eager, recorded, replayed
  const int64_t allocs = allocator(gpu).stats().system_allocs;
  graphed.run();
  CHECK(allocator(gpu).stats().system_allocs == allocs);
  CHECK(rel_error(graphed.model().flat_params().to_host(), eager.model().flat_params().to_host()) <= 1e-6);
  CHECK(test::bf16_bits(graphed.model().flat_shadow()) == test::bf16_bits(graphed.model().flat_params()));
}

#endif  // DPT_GPU_TESTS
