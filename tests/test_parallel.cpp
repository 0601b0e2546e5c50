// Data parallelism on virtual CPU devices: N replicas equal one device training on the
// whole batch (any N, uneven splits, every reduction path), replicas stay bitwise
// identical after every step, and no device is a dumping ground for memory.
#include <algorithm>
#include <cmath>
#include <thread>
#include <tuple>
#include <utility>

#include <dptrain/error.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/train/trainer.hpp>
#include "catch.hpp"
#include "chunked_copy.hpp"
#include "common.hpp"
#include "parallel/p2p_chunks.hpp"
#include "parallel/reducer.hpp"
#include "runtime/allocator.hpp"

using namespace dpt;

namespace {
std::vector<Device> cpus(int n, int first = 0) {
  std::vector<Device> d;
  for (int i = 0; i < n; ++i) d.push_back({DeviceType::cpu, first + i});
  return d;
}

TrainConfig small(data::Task task, const std::string& opt, int64_t batch) {
  TrainConfig c;
  c.model = "12-24x2-5";
  c.task = task;
  c.optimizer = opt;
  c.lr = opt == "sgd" ? 0.05f : 0.003f;
  c.momentum = 0.9f;
  c.batch = batch;
  c.steps = 20;
  c.log_every = 1000;
  c.parallel.bucket_mb = 0.001;  // about 1 KB: the parameters span several buckets
  return c;
}

// What a run of `c` under ZeRO stage `zero` says when it stops on a non-finite gradient.
std::string stop_message(TrainConfig c, int zero) {
  c.on_nonfinite = "stop";
  c.parallel.zero = zero;
  try {
    Trainer(c).run();
  } catch (const NonFiniteError& e) {
    return e.what();
  }
  return "no stop";
}
}  // namespace

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

TEST_CASE("buckets tile the flat buffer from its end, at most the size asked", "[parallel]") {
  auto b = make_buckets(2000, 4 * 600.0, 4 * 600.0);  // 600 floats, rounded down to 576
  REQUIRE(b.size() == 4);
  CHECK(b[0].offset == 2000 - 576);
  CHECK(b[0].count == 576);
  CHECK(b[3].offset == 0);
  CHECK(b[3].count == 2000 - 3 * 576);
  CHECK(make_buckets(128, 1e9, 1e9).size() == 1);
  CHECK(make_buckets(128, 1.0, 1.0).size() == 2);  // at least 64 floats a bucket
  // A smaller first bucket (the last layer's gradients, reduced first), rounded alike;
  // one larger than the others is the others' size.
  b = make_buckets(2000, 4 * 600.0, 4 * 130.0);
  REQUIRE(b.size() == 5);
  CHECK((b[0].offset == 2000 - 128 && b[0].count == 128));
  CHECK((b[1].offset == 2000 - 128 - 576 && b[1].count == 576));
  CHECK((b[4].offset == 0 && b[4].count == 2000 - 128 - 3 * 576));
  CHECK(make_buckets(2000, 4 * 600.0, 1e9)[0].count == 576);
}

TEST_CASE("p2p copies the parameters back in chunks of whole layers, in forward order", "[parallel]") {
  std::vector<int> chunk_of;
  // Children: an activation, a small layer, an activation, a large one, a small one, the
  // last (small) layer, an activation. The small first layer shares the large one's chunk;
  // the last chunk runs to the end (padding after the last parameter included).
  auto c = make_copy_chunks({-1, 100, -1, 300000, 300100, 300200, -1}, 300256, 1000, chunk_of);
  REQUIRE(c.size() == 2);
  CHECK(c[0] == CopyChunk{0, 300000});
  CHECK(c[1] == CopyChunk{300000, 256});
  CHECK(chunk_of == std::vector<int>{-1, 0, -1, 0, 1, 1, -1});
  // Every layer large enough: a chunk each.
  c = make_copy_chunks({1000, 2000, 3000}, 3000, 1000, chunk_of);
  CHECK(c == std::vector<CopyChunk>{{0, 1000}, {1000, 1000}, {2000, 1000}});
  CHECK(chunk_of == std::vector<int>{0, 1, 2});
  CHECK(make_copy_chunks({-1, -1}, 0, 1000, chunk_of).empty());  // no parameters: nothing to copy
  CHECK(chunk_of == std::vector<int>{-1, -1});
}

TEST_CASE("a Sequential calls its guard's hook before each child; nested ones and other threads' do not",
          "[parallel]") {
  auto inner = std::make_shared<nn::Sequential>();
  inner->add(std::make_shared<nn::Activation>(Act::relu)).add(std::make_shared<nn::Activation>(Act::tanh));
  auto outer = std::make_shared<nn::Sequential>();
  outer->add(std::make_shared<nn::Activation>(Act::relu)).add(inner);
  const Tensor x = Tensor::from_host({-1.0f, 2.0f}, {1, 2}, Device{});
  std::vector<size_t> seen;
  {
    nn::BeforeChildGuard g(outer.get(), [&](size_t i) { seen.push_back(i); });
    outer->forward(x);
    {
      nn::BeforeChildGuard other(inner.get(), [&](size_t i) { seen.push_back(10 + i); });
      outer->forward(x);  // the inner one's hook alone, while its guard lives
    }
    outer->forward(x);                               // the outer one's again
    std::thread([&] { outer->forward(x); }).join();  // another thread's forward: none
  }
  outer->forward(x);  // none
  CHECK(seen == std::vector<size_t>{0, 1, 10, 11, 0, 1});
}

TEST_CASE("p2p's chunked copy of the parameters equals the whole copy with evaluation between steps", "[parallel]") {
  for (std::string opt : {"sgd", "adamw"})
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      INFO(opt << " " << precision_name(precision));
      CHECK(test::train_p2p_chunked(cpus(3), true, precision, opt) ==
            test::train_p2p_chunked(cpus(3), false, precision, opt));
    }
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
            for (int64_t s = 0; s < c.steps; ++s) {
              t.step(s);
              REQUIRE(t.parallel().replicas_identical());
            }
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
      for (int64_t s = 0; s < c.steps; ++s) {
        two.step(s);
        REQUIRE(two.parallel().replicas_identical());
      }
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
  TrainConfig c = small(data::Task::regression, "sgd", 12);
  c.lr = 1e30f;
  c.on_nonfinite = "skip-step";
  c.devices = cpus(2, 125);
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
      t.step(0, /*measure=*/true);  // as a run's first step, which is logged
      auto allocs = [&] {
        int64_t n = 0;
        for (const Device& dev : c.devices) n += allocator(dev).stats().system_allocs;
        return n;
      };
      const int64_t after_first = allocs();
      t.run();
      CHECK(allocs() == after_first);
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

// ---- ZeRO: the optimizer state sharded over the replicas --------------------------------

TEST_CASE("ZeRO shards tile the flat buffer, 16-byte aligned, the last ones short or empty", "[parallel][zero]") {
  for (int64_t total : {1, 3, 4, 5, 63, 64, 1001})
    for (size_t n : {1, 2, 3, 7, 40}) {
      INFO(total << " floats over " << n);
      const auto s = zero_shards(total, n);
      REQUIRE(s.size() == n);
      int64_t at = 0;
      for (const SampleRange& k : s) {
        CHECK(k.first == std::min(at, total));
        if (k.count > 0) CHECK(k.first % 4 == 0);
        CHECK(k.count <= s[0].count);
        at = k.first + k.count;
      }
      CHECK(at == total);
      CHECK(s[0].count ==
            std::min(total, ((total + static_cast<int64_t>(n) - 1) / static_cast<int64_t>(n) + 3) / 4 * 4));
    }
}

TEST_CASE("ZeRO stage 1 trains as stage 0, each replica holding only its shard of the optimizer state",
          "[parallel][zero]") {
  for (auto task : {data::Task::regression, data::Task::classification})
    for (std::string opt : {"sgd", "adamw"})
      for (auto [n, accum, clip] :
           {std::tuple<int, int, float>{2, 1, 0.0f}, {3, 1, 0.0f}, {5, 2, 0.0f}, {3, 1, 0.5f}}) {
        INFO(data::task_name(task) << " " << opt << " on " << n << " replicas, " << accum << " micro-batches, clip "
                                   << clip);
        TrainConfig c = small(task, opt, 10);  // uneven: 10 over 3 or 5
        c.devices = cpus(n, 40);
        c.parallel.grad_accum = accum;
        c.parallel.clip = clip;
        Trainer plain(c);
        plain.run();
        c.parallel.zero = 1;
        Trainer sharded(c);
        for (int64_t s = 0; s < c.steps; ++s) {
          sharded.step(s);
          REQUIRE(sharded.parallel().replicas_identical());
        }
        const auto want = plain.model().flat_params().to_host(), got = sharded.model().flat_params().to_host();
        if (clip == 0.0f) CHECK(got == want);            // the same sums, the same updates: bit for bit
        else CHECK(test::rel_error(got, want) <= 1e-6);  // the norm is summed by shards
        // Each replica's state is its shard: ceil(P / n) rounded to 4 floats, the last less.
        const int64_t total = sharded.model().flat_params().numel();
        const auto shards = sharded.parallel().zero_shards();
        REQUIRE(shards.size() == static_cast<size_t>(n));
        int64_t state = 0;
        for (size_t r = 0; r < shards.size(); ++r) {
          const optim::Optimizer* o = sharded.parallel().optimizers()[r];
          CHECK(o->shard_begin() == shards[r].first);
          CHECK(o->shard_size() == shards[r].count);
          for (const auto& [name, t] : o->state()) {
            CHECK(t.numel() == shards[r].count);
            state += t.numel();
          }
        }
        const int64_t per_element = (opt == "sgd" ? 1 : 2);  // momentum, or AdamW's two moments
        CHECK(state == per_element * total);
        const auto bytes = sharded.parallel().model_state_bytes();  // what the summary prints
        for (size_t r = 0; r < bytes.size(); ++r) {
          CHECK(bytes[r].optimizer == 4 * per_element * shards[r].count);
          CHECK(bytes[r].parameters == 4 * total);
          CHECK(bytes[r].gradients == 4 * total);  // stage 1 keeps the whole gradient buffer
        }
      }
}

TEST_CASE("ZeRO under bf16 compute: every replica's shadow follows the gathered parameters", "[parallel][zero][bf16]") {
  for (std::string opt : {"sgd", "adamw"}) {
    INFO(opt);
    TrainConfig c = small(data::Task::regression, opt, 10);
    c.parallel.precision = Precision::bf16;
    c.devices = cpus(3, 130);
    Trainer plain(c);
    plain.run();
    for (int zero : {1, 2}) {
      INFO("zero " << zero);
      c.parallel.zero = zero;
      Trainer sharded(c);
      for (int64_t s = 0; s < c.steps; ++s) {
        sharded.step(s);
        REQUIRE(sharded.parallel().replicas_identical());  // parameters and shadows
        for (size_t r = 0; r < sharded.parallel().size(); ++r) {
          const nn::Module& m = sharded.parallel().replica(r);
          REQUIRE(test::bf16_bits(m.flat_shadow()) == test::bf16_bits(m.flat_params()));
        }
      }
      CHECK(sharded.model().flat_params().to_host() == plain.model().flat_params().to_host());
    }
  }
}

TEST_CASE("ZeRO with more replicas than a small model's shards leaves some empty and still trains as stage 0",
          "[parallel][zero]") {
  TrainConfig c = small(data::Task::regression, "adamw", 12);
  c.model = "2-1";  // a handful of parameters
  c.devices = cpus(12, 60);
  Trainer plain(c);
  plain.run();
  c.parallel.zero = 1;
  Trainer sharded(c);
  sharded.run();
  const auto shards = sharded.parallel().zero_shards();
  CHECK(std::any_of(shards.begin(), shards.end(), [](const SampleRange& k) { return k.count == 0; }));
  CHECK(sharded.model().flat_params().to_host() == plain.model().flat_params().to_host());
  CHECK(sharded.parallel().replicas_identical());
}

TEST_CASE("a ZeRO checkpoint is the flat state: it resumes on other replica counts and stages", "[parallel][zero]") {
  test::TempDir dir;
  TrainConfig c = small(data::Task::regression, "adamw", 12);
  c.steps = 20;
  c.devices = cpus(4, 80);
  c.parallel.zero = 1;
  Trainer whole(c);  // 20 steps without a break
  whole.run();
  const auto want = whole.model().flat_params().to_host();
  TrainConfig first = c;
  first.steps = 8;
  first.save = (dir.path / "zero.safetensors").string();
  Trainer(first).run();
  for (auto [n, zero] : {std::pair<int, int>{4, 1}, {3, 1}, {2, 0}, {1, 0}, {3, 0}}) {
    INFO("resumed on " << n << " replicas, zero " << zero);
    TrainConfig rest = c;
    rest.devices = cpus(n, 90);
    rest.parallel.zero = zero;
    rest.resume = first.save;
    Trainer t(rest);
    t.run();
    const auto got = t.model().flat_params().to_host();
    if (n == 4 && zero == 1) CHECK(got == want);  // the same devices and stage: bit for bit
    else CHECK(test::rel_error(got, want) <= 1e-5);
  }
  // And a plain checkpoint resumes sharded.
  TrainConfig plain = first;
  plain.parallel.zero = 0;
  plain.devices = cpus(2, 100);
  plain.save = (dir.path / "plain.safetensors").string();
  Trainer(plain).run();
  TrainConfig rest = c;
  rest.resume = plain.save;
  Trainer t(rest);
  t.run();
  CHECK(test::rel_error(t.model().flat_params().to_host(), want) <= 1e-5);
}

TEST_CASE("ZeRO skips a non-finite step on every replica alike", "[parallel][zero]") {
  TrainConfig c = small(data::Task::regression, "sgd", 12);
  c.lr = 1e30f;
  c.on_nonfinite = "skip-step";
  c.devices = cpus(3, 110);
  const TrainResult plain = Trainer(c).run();
  c.parallel.zero = 1;
  Trainer sharded(c);
  const TrainResult r = sharded.run();
  CHECK(plain.skipped > 0);
  CHECK(r.skipped == plain.skipped);
  CHECK(sharded.parallel().replicas_identical());
  // stop names the same step and parameter: the first bad gradient over the shards.
  const std::string want = stop_message(c, 0);
  CHECK(want.find("the gradient of parameter") != std::string::npos);
  CHECK(stop_message(c, 1) == want);
}

TEST_CASE("ZeRO refuses what it does not do yet, naming the setting", "[parallel][zero]") {
  TrainConfig c = small(data::Task::regression, "sgd", 12);
  c.devices = cpus(2, 120);
  c.parallel.zero = 3;
  CHECK_THROWS_AS(Trainer(c), UsageError);
  for (int zero : {1, 2}) {
    c.parallel.zero = zero;
    c.parallel.reduce = Reduce::p2p;
    CHECK_THROWS_AS(Trainer(c), UsageError);
  }
  c.parallel.reduce = Reduce::automatic;
  c.parallel.grad_comm = DType::bf16;  // stage 2 between CPU devices sums fp32
  std::string why;
  try {
    Trainer t(c);
  } catch (const UsageError& e) {
    why = e.what();
  }
  CHECK(why.find("zero 2 between CPU devices sums fp32") != std::string::npos);
}

TEST_CASE("ZeRO stage 2 buckets are whole parameters, from the end, without the padding", "[parallel][zero]") {
  // Parameters at 0 (100 floats), 100 (30), 132 (500), 632 (8), with padding after the second.
  const std::vector<int64_t> offsets{0, 100, 132, 632}, sizes{100, 30, 500, 8};
  const auto b = make_param_buckets(offsets, sizes, 200 * 4.0, 200 * 4.0);
  REQUIRE(b.size() == 3);
  CHECK((b[0].offset == 632 && b[0].count == 8));
  CHECK((b[1].offset == 132 && b[1].count == 500));  // over the size, alone
  CHECK((b[2].offset == 0 && b[2].count == 130));    // 100 and 30; the padding after them in none
  const auto one = make_param_buckets(offsets, sizes, 1e9, 1e9);
  REQUIRE(one.size() == 1);
  CHECK((one[0].offset == 0 && one[0].count == 640));
  // A first bucket of at most 4 floats: the last parameter alone (8, over it), then as before.
  const auto small_first = make_param_buckets(offsets, sizes, 1e9, 4 * 4.0);
  REQUIRE(small_first.size() == 2);
  CHECK((small_first[0].offset == 632 && small_first[0].count == 8));
  CHECK((small_first[1].offset == 0 && small_first[1].count == 632));
}

TEST_CASE("ZeRO stage 2 trains as stage 1, each replica holding a gradient shard and two buckets", "[parallel][zero]") {
  for (auto task : {data::Task::regression, data::Task::classification})
    for (std::string opt : {"sgd", "adamw"})
      for (auto [n, accum, clip] : {std::tuple<int, int, float>{2, 1, 0.0f},
                                    {3, 1, 0.0f},
                                    {4, 1, 0.0f},
                                    {5, 2, 0.0f},
                                    {3, 1, 0.5f},
                                    {3, 3, 0.5f}}) {
        INFO(data::task_name(task) << " " << opt << " on " << n << " replicas, " << accum << " micro-batches, clip "
                                   << clip);
        TrainConfig c = small(task, opt, 10);  // uneven: 10 over 3 or 5
        c.devices = cpus(n, 140);
        c.parallel.grad_accum = accum;
        c.parallel.clip = clip;
        c.parallel.zero = 1;
        Trainer one(c);
        one.run();
        c.parallel.zero = 2;
        c.devices = cpus(n, 240);
        Trainer two(c);
        for (int64_t s = 0; s < c.steps; ++s) {
          two.step(s);
          REQUIRE(two.parallel().replicas_identical());
        }
        const auto want = one.model().flat_params().to_host(), got = two.model().flat_params().to_host();
        // The same sums in the same order without micro-batches (bit for bit); with them
        // stage 2 adds each micro-batch's sum to the shard, stage 1 each replica's first.
        INFO("relative error " << test::rel_error(got, want));
        if (accum == 1 && clip == 0.0f) CHECK(got == want);
        else CHECK(test::rel_error(got, want) <= 1e-6);
      }
}

TEST_CASE("ZeRO stage 2 keeps the padding inside a bucket zero when the slot's other buckets write over it",
          "[parallel][zero]") {
  // A CNN's small parameters share buckets, with the layout's padding between them, and the
  // buckets of one slot lie over each other's padding: the flat buffers, padding and
  // momentum included, stay stage 1's.
  for (auto [model, bucket_mb] :
       {std::pair<std::string, double>{"cnn:2x7x7-c4k3-p2-c6k3s2-f3", 0.001}, {"12-24x2-5", 0.004}}) {
    INFO(model << ", buckets of " << bucket_mb << " MB");
    TrainConfig c = small(data::Task::classification, "sgd", 10);
    c.model = model;
    c.parallel.bucket_mb = bucket_mb;
    c.devices = cpus(3, 250);
    c.parallel.zero = 1;
    Trainer one(c);
    one.run();
    c.parallel.zero = 2;
    c.devices = cpus(3, 260);
    Trainer two(c);
    two.run();
    REQUIRE(two.parallel().buckets() >= 2);
    CHECK(two.model().flat_params().to_host() == one.model().flat_params().to_host());
  }
}

TEST_CASE("ZeRO stage 2 keeps a shard of the gradients and the buckets in flight", "[parallel][zero]") {
  TrainConfig c = small(data::Task::regression, "adamw", 16);
  c.model = "32-32x8-32";        // nine layers of 1056 floats
  c.parallel.bucket_mb = 0.005;  // 1310 floats: a layer a bucket
  c.devices = cpus(4, 150);
  c.parallel.zero = 2;
  Trainer t(c);
  t.run();
  int64_t total = 0;
  const auto offsets = t.model().layout(&total);
  std::vector<int64_t> sizes;
  for (const nn::Parameter* p : t.model().parameters()) sizes.push_back(numel(p->shape));
  int64_t largest = 0;
  int64_t at = total;
  const auto buckets =
      make_param_buckets(offsets, sizes, c.parallel.bucket_mb * 1024 * 1024, c.parallel.bucket_mb * 1024 * 1024);
  CHECK(buckets.size() == 9);  // a layer a bucket
  for (const Bucket& b : buckets) {
    CHECK(b.offset + b.count <= at);  // from the end of the buffer, in order
    at = b.offset;
    largest = std::max(largest, b.count);
  }
  CHECK(at == 0);
  const auto shards = t.parallel().zero_shards();
  const auto bytes = t.parallel().model_state_bytes();
  for (size_t r = 0; r < bytes.size(); ++r) {
    INFO("replica " << r);
    CHECK(bytes[r].gradients == 4 * (shards[r].count + 2 * largest));  // a shard and two buckets
    CHECK(bytes[r].gradients < 4 * total * 3 / 4);
    CHECK(bytes[r].optimizer == 4 * 2 * shards[r].count);
  }
}

TEST_CASE("ZeRO stage 2: non-finite steps, empty shards and checkpoints as stage 0", "[parallel][zero]") {
  TrainConfig c = small(data::Task::regression, "sgd", 12);
  c.lr = 1e30f;
  c.on_nonfinite = "skip-step";
  c.devices = cpus(3, 160);
  const TrainResult plain = Trainer(c).run();
  c.parallel.zero = 2;
  Trainer sharded(c);
  CHECK(sharded.run().skipped == plain.skipped);
  CHECK(sharded.parallel().replicas_identical());
  CHECK(stop_message(c, 2) == stop_message(c, 0));
  // 12 replicas on a model of 3 parameters: empty shards, and a batch smaller than the replicas.
  TrainConfig tiny = small(data::Task::regression, "adamw", 7);
  tiny.model = "2-1";
  tiny.devices = cpus(12, 170);
  Trainer a(tiny);
  a.run();
  tiny.parallel.zero = 2;
  Trainer b(tiny);
  b.run();
  CHECK(test::rel_error(b.model().flat_params().to_host(), a.model().flat_params().to_host()) <= 1e-6);
  // A stage-2 checkpoint resumes under stage 0 and 1 elsewhere, and a stage-0 one under stage 2.
  test::TempDir dir;
  TrainConfig w = small(data::Task::regression, "adamw", 12);
  w.devices = cpus(4, 190);
  w.parallel.zero = 2;
  Trainer whole(w);
  whole.run();
  const auto want = whole.model().flat_params().to_host();
  TrainConfig first = w;
  first.steps = 8;
  first.save = (dir.path / "zero2.safetensors").string();
  Trainer(first).run();
  for (auto [n, zero] : {std::pair<int, int>{4, 2}, {3, 2}, {2, 1}, {1, 0}}) {
    INFO("resumed on " << n << " replicas, zero " << zero);
    TrainConfig rest = w;
    rest.devices = cpus(n, 200);
    rest.parallel.zero = zero;
    rest.resume = first.save;
    Trainer t(rest);
    t.run();
    const auto got = t.model().flat_params().to_host();
    if (n == 4) CHECK(got == want);
    else CHECK(test::rel_error(got, want) <= 1e-5);
  }
  TrainConfig plain0 = first;
  plain0.parallel.zero = 0;
  plain0.save = (dir.path / "plain.safetensors").string();
  Trainer(plain0).run();
  TrainConfig rest = w;
  rest.resume = plain0.save;
  Trainer t(rest);
  t.run();
  CHECK(test::rel_error(t.model().flat_params().to_host(), want) <= 1e-5);
}

TEST_CASE("bf16 on the wire: the sum is the master's gradient plus the others' rounded to bf16",
          "[parallel][grad_comm]") {
  const int64_t total = 1000;
  const std::vector<Bucket> buckets = make_buckets(total, 256 * 4, 256 * 4);  // several buckets
  REQUIRE(buckets.size() > 2);
  auto round = [](float v) {
    uint16_t h = 0;
    cpu::cast_f32_bf16(&v, &h, 1);
    float back = 0;
    cpu::cast_bf16_f32(&h, &back, 1);
    return back;
  };
  for (bool master_updates : {false, true}) {
    INFO((master_updates ? "p2p" : "host"));
    const auto devs = cpus(3, 60);
    std::vector<std::vector<float>> g;
    std::vector<ReplicaBuffers> bufs;
    for (size_t i = 0; i < devs.size(); ++i) {
      g.push_back(test::randn(total, 80 + static_cast<uint64_t>(i)));  // values with every mantissa bit used
      bufs.push_back({&context(devs[i]), Tensor::zeros({total}, DType::f32, devs[i]),
                      Tensor::from_host(g.back(), {total}, devs[i]), Tensor()});
    }
    auto reducer = master_updates ? make_p2p_reducer(bufs, buckets, DType::bf16)
                                  : make_host_reducer(bufs, buckets, {}, DType::bf16);
    for (size_t i = 0; i < devs.size(); ++i) {
      ContextGuard guard(context(devs[i]));
      for (size_t b = 0; b < buckets.size(); ++b) reducer->bucket_ready(i, b);
    }
    reducer->reduce();
    for (size_t i = 0; i < devs.size(); ++i) reducer->wait(i);
    // In replica order, in fp32: what the reducer promises, exactly.
    std::vector<float> want(static_cast<size_t>(total));
    for (size_t j = 0; j < want.size(); ++j) {
      float s = g[0][j];
      for (size_t i = 1; i < g.size(); ++i) s += round(g[i][j]);
      want[j] = master_updates ? s : round(s);  // host: every replica gets the sum as bf16 carries it
    }
    CHECK(bufs[0].grads.to_host() == want);
    if (!master_updates)
      for (size_t i = 1; i < devs.size(); ++i) CHECK(bufs[i].grads.to_host() == want);
    // The fp32 sum differs from it: the wire did round.
    std::vector<float> exact(want.size());
    for (size_t j = 0; j < exact.size(); ++j) exact[j] = g[0][j] + g[1][j] + g[2][j];
    CHECK(exact != want);
  }
}

TEST_CASE("bf16 on the wire trains within 1e-2 of fp32 on N replicas, and one device is unchanged",
          "[parallel][grad_comm]") {
  for (std::string opt : {"sgd", "adamw"})
    for (auto [n, path, zero] : {std::tuple<int, Reduce, int>{3, Reduce::host, 0},
                                 {3, Reduce::p2p, 0},
                                 {4, Reduce::host, 1},
                                 {1, Reduce::automatic, 0},
                                 {1, Reduce::host, 0},
                                 {1, Reduce::host, 1}}) {
      INFO(opt << " on " << n << " replicas, reduce " << reduce_name(path) << ", zero " << zero);
      TrainConfig c = small(data::Task::regression, opt, 12);
      c.devices = cpus(n, 70);
      c.parallel.reduce = path;
      c.parallel.zero = zero;
      Trainer fp32(c);
      fp32.run();
      c.parallel.grad_comm = DType::bf16;
      Trainer bf16(c);
      for (int64_t s = 0; s < c.steps; ++s) {
        bf16.step(s);
        REQUIRE(bf16.parallel().replicas_identical());
      }
      const auto want = fp32.model().flat_params().to_host(), got = bf16.model().flat_params().to_host();
      if (n == 1) {
        CHECK(got == want);  // nothing travels
      } else {
        CHECK(got != want);
        CHECK(test::rel_error(got, want) <= 1e-2);
      }
    }
}

TEST_CASE("each bucket updated once its sum is done gives the update after the last one, bit for bit",
          "[parallel][per_bucket]") {
  const Device host{DeviceType::cpu, 0};
  data::Synthetic d({.task = data::Task::regression, .in = 12, .out = 5, .seed = 3}, host);
  for (std::string opt : {"sgd", "adamw"})
    for (auto [n, path] : {std::pair<int, Reduce>{1, Reduce::host}, {3, Reduce::host}, {3, Reduce::p2p}})
      for (int accum : {1, 2})
        for (DType wire : {DType::f32, DType::bf16}) {
          INFO(opt << " on " << n << " replicas, " << reduce_name(path) << ", " << accum << " micro-batches, "
                   << dtype_name(wire) << " on the wire");
          auto run = [&](bool per_bucket, int first_device) {
            auto m = nn::mlp("12-24x2-5");
            m->to({DeviceType::cpu, first_device}, 4);
            DataParallelOptions o;
            o.reduce = path;
            o.bucket_mb = 0.001;  // several buckets, the first smaller
            o.first_bucket_mb = 0.0005;
            o.grad_accum = accum;
            o.grad_comm = wire;
            o.update_per_bucket = per_bucket;
            DataParallel dp(
                m, cpus(n, first_device),
                [&](nn::Module& r) -> std::unique_ptr<optim::Optimizer> {
                  std::unique_ptr<optim::Optimizer> p;
                  if (opt == "sgd")
                    p = std::make_unique<optim::SGD>(
                        r, optim::SGD::Options{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true});
                  else p = std::make_unique<optim::AdamW>(r, optim::AdamW::Options{.lr = 0.003f});
                  p->set_schedule({optim::Schedule::Kind::cosine, opt == "sgd" ? 0.05f : 0.003f, 2, 8});
                  return p;
                },
                o);
            REQUIRE(dp.buckets() > 2);
            for (int s = 0; s < 6; ++s) dp.train_step(d.batch(s * 8, 8), nn::MSELoss());
            CHECK(dp.replicas_identical());
            CHECK(dp.optimizer().steps_taken() == 6);
            return dp.replica(0).flat_params().to_host();
          };
          CHECK(run(true, 300) == run(false, 310));
        }
}

TEST_CASE("updates per bucket: refused where a step-wide decision comes first; an abandoned step updates nothing",
          "[parallel][per_bucket]") {
  const Device host{DeviceType::cpu, 0};
  auto make = [&](DataParallelOptions o, int n) {
    auto m = nn::mlp("6-8-3");
    m->to(host, 4);
    o.update_per_bucket = true;
    o.bucket_mb = 0.0001;
    return std::make_unique<DataParallel>(
        m, cpus(n), [](nn::Module& r) { return std::make_unique<optim::SGD>(r, optim::SGD::Options{.lr = 0.1f}); }, o);
  };
  auto refusal = [&](DataParallelOptions o) {
    try {
      make(o, 2);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string why =
      "DataParallelOptions::update_per_bucket updates a bucket before the next is reduced: not with clip or "
      "check_finite (which need the norm over every bucket first), nor with zero";
  CHECK(refusal({.clip = 1.0f}) == why);
  CHECK(refusal({.check_finite = true}) == why);
  CHECK(refusal({.zero = 1}) == why);
  CHECK(refusal({.first_bucket_mb = INFINITY}) ==
        "DataParallelOptions::first_bucket_mb must be in (0, 1048576] MiB, got inf");
  // Timing the reduction alone would update as it reduces.
  std::string timed = "timed";
  try {
    make({.reduce = Reduce::host}, 2)->time_reduction(1);
  } catch (const UsageError& e) {
    timed = e.what();
  }
  CHECK(timed.rfind("DataParallel::time_reduction times the reduction alone", 0) == 0);
  // A replica's data fails in the third step: no bucket of it is updated anywhere.
  auto dp = make({.reduce = Reduce::host}, 3);
  data::Synthetic d({.task = data::Task::regression, .in = 6, .out = 3, .seed = 2}, host);
  const data::Dataset& rows = d;
  auto source = [&](int step) {
    return [&, step](size_t r, int64_t first, int64_t count) {
      if (step == 2 && r == 1) throw UsageError("row 7 is not a number");
      return rows.batch(first, count, dp->device(r));
    };
  };
  for (int s = 0; s < 2; ++s) dp->train_step(s * 9, 9, source(s), nn::MSELoss());
  const auto before = dp->replica(0).flat_params().to_host();
  CHECK_THROWS_AS(dp->train_step(18, 9, source(2), nn::MSELoss()), UsageError);
  CHECK(dp->replica(0).flat_params().to_host() == before);
  CHECK(dp->replicas_identical());
  CHECK(dp->optimizer().steps_taken() == 2);
  dp->train_step(18, 9, source(3), nn::MSELoss());
  CHECK(dp->replica(0).flat_params().to_host() != before);
}

TEST_CASE("tuned buckets: each size tried, the fastest kept, the parameters those of fixed buckets",
          "[parallel][per_bucket]") {
  for (auto [path, per_bucket] : {std::pair<Reduce, bool>{Reduce::host, false}, {Reduce::p2p, true}}) {
    INFO(reduce_name(path) << (per_bucket ? ", updates per bucket" : ""));
    TrainConfig c = small(data::Task::regression, "sgd", 12);
    c.model = "64-512x2-16";  // 304 K parameters: 1.16 MiB of gradients
    c.steps = 30;
    c.parallel.bucket_mb = 25;
    c.parallel.first_bucket_mb = 64;  // the first bucket as the others'

    c.devices = cpus(3, 400);
    c.parallel.reduce = path;
    Trainer fixed(c);
    fixed.run();
    c.devices = cpus(3, 410);
    c.parallel.tune_buckets = true;
    Trainer tuned(c);
    REQUIRE(tuned.parallel().tuning_buckets());
    tuned.run();
    // 1 MiB (two buckets) and 4 MiB (one; 16, 25 and 64 MiB give the same one): 10 steps.
    CHECK_FALSE(tuned.parallel().tuning_buckets());
    const double mb = tuned.parallel().bucket_mb();
    CHECK((mb == 1.0 || mb == 4.0));
    CHECK(tuned.parallel().buckets() == (mb == 1.0 ? 2u : 1u));
    CHECK(tuned.model().flat_params().to_host() == fixed.model().flat_params().to_host());
    CHECK(tuned.parallel().replicas_identical());
  }
  TrainConfig c = small(data::Task::regression, "sgd", 12);
  c.parallel.tune_buckets = true;
  c.parallel.zero = 2;
  c.devices = cpus(2, 420);
  try {
    Trainer t(c);
    FAIL("accepted");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()).find("DataParallelOptions::tune_buckets changes the buckets between eager steps") == 0);
  }
}
