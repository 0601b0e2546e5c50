// ZeRO (optimizer state and gradient sharding): shards, stages 1 and 2 against stage 0 on
// CPU replicas, bf16, non-finite steps, checkpoints; on the GPU, stages 1 and 2 with one
// shard and over N GPUs.

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <tuple>
#include <utility>

#include <dptrain/error.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/train/trainer.hpp>
#include "kernels/cpu/cpu.hpp"
#include "parallel/reducer.hpp"
#include "runtime/allocator.hpp"

#include "catch.hpp"
#include "common.hpp"
#include "parallel_common.hpp"

using namespace dpt;
using namespace dpt::test;

// A replica whose step fails (its loss throws, as an out-of-memory error would) while the
// others hand their buckets over and wait for their sums (NCCL's collectives; stage 2's
// slots on CPU devices): it hands its own over all the same, the step throws instead of
// waiting forever, updates nothing, and the next step trains as if the failed one had not
// been. `devices(k)`: the replicas' devices for the k-th of two DataParallels trained side
// by side; `before`: the steps before the failing one (0: it is the first, where NCCL
// connects its peers).
namespace {
void check_failed_step(const std::function<std::vector<Device>(int)>& devices, Reduce reduce, int zero, int accum,
                       int before = 2) {
  INFO(reduce_name(reduce) << ", zero " << zero << ", " << accum << " micro-batches, " << before << " steps before");
  data::Synthetic d({.task = data::Task::regression, .in = 32, .out = 32, .seed = 2}, Device{DeviceType::cpu, 0});
  auto make = [&](int k) {
    auto m = nn::mlp("32-32x8-32");  // nine layers of 1056 floats: a layer a bucket (stage 2: two slots)
    m->to(devices(k).front(), 4);
    return std::make_unique<DataParallel>(
        m, devices(k),
        [](nn::Module& r) { return std::make_unique<optim::AdamW>(r, optim::AdamW::Options{.lr = 0.003f}); },
        DataParallelOptions{.reduce = reduce, .bucket_mb = 0.005, .grad_accum = accum, .zero = zero});
  };
  auto failing = make(0), straight = make(1);
  REQUIRE(failing->buckets() >= 8);
  std::atomic<bool> armed{false};  // the first replica to reach its loss then throws, alone
  const LossFn loss = [&](const Tensor& out, const Tensor& y) {
    if (armed.exchange(false)) throw OutOfMemory("out of memory (the test's)");
    return nn::MSELoss()(out, y);
  };
  for (int s = 0; s < before; ++s) {
    failing->train_step(d.batch(s * 12, 12), loss);
    straight->train_step(d.batch(s * 12, 12), nn::MSELoss());
  }
  armed = true;
  CHECK_THROWS_AS(failing->train_step(d.batch(before * 12, 12), loss), OutOfMemory);
  CHECK(failing->optimizer().steps_taken() == before);
  for (int s = before; s < before + 2; ++s) {
    failing->train_step(d.batch(s * 12, 12), loss);
    straight->train_step(d.batch(s * 12, 12), nn::MSELoss());
  }
  CHECK(failing->replicas_identical());
  CHECK(failing->replica(0).flat_params().to_host() == straight->replica(0).flat_params().to_host());
}
}  // namespace

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

namespace {

// `c` (a ZeRO stage on some replicas) trained in one go, against its first 8 steps saved
// and resumed on each (replicas, stage) of `resumes` (CPU devices numbered from
// `first_device`): c's own replicas and stage give the parameters bit for bit, the others
// within 1e-5. Then a stage-0 checkpoint saved on `plain_devices` resumes under c's stage.
void check_zero_resumes(const TrainConfig& c, std::initializer_list<std::pair<int, int>> resumes, int first_device,
                        const std::vector<Device>& plain_devices) {
  test::TempDir dir;
  Trainer whole(c);  // all the steps without a break
  whole.run();
  const auto want = whole.model().flat_params().to_host();
  TrainConfig first = c;
  first.steps = 8;
  first.save = dir.file("zero.safetensors");
  Trainer(first).run();
  for (auto [n, zero] : resumes) {
    INFO("resumed on " << n << " replicas, zero " << zero);
    TrainConfig rest = c;
    rest.devices = cpus(n, first_device);
    rest.parallel.zero = zero;
    rest.resume = first.save;
    Trainer t(rest);
    t.run();
    const auto got = t.model().flat_params().to_host();
    // The same devices and stage: bit for bit.
    if (static_cast<size_t>(n) == c.devices.size() && zero == c.parallel.zero) CHECK(got == want);
    else CHECK(test::rel_error(got, want) <= 1e-5);
  }
  // And a plain checkpoint resumes sharded.
  TrainConfig plain = first;
  plain.parallel.zero = 0;
  plain.devices = plain_devices;
  plain.save = dir.file("plain.safetensors");
  Trainer(plain).run();
  TrainConfig rest = c;
  rest.resume = plain.save;
  Trainer t(rest);
  t.run();
  CHECK(test::rel_error(t.model().flat_params().to_host(), want) <= 1e-5);
}

// small()'s `task` with `opt` on batches of 10 (uneven over 3 or 5 devices), each in
// `accum` micro-batches, clipped at `clip` (0: not).
TrainConfig sharding_case(data::Task task, const std::string& opt, std::vector<Device> devices, int accum, float clip) {
  TrainConfig c = small(task, opt, 10);
  c.devices = std::move(devices);
  c.parallel.grad_accum = accum;
  c.parallel.clip = clip;
  return c;
}

// A model of 3 parameters (2-1) with AdamW on 12 CPU replicas from `first_device`: more
// replicas than shards of parameters.
TrainConfig tiny_on_12(int64_t batch, int first_device) {
  TrainConfig c = small(data::Task::regression, "adamw", batch);
  c.model = "2-1";
  c.devices = cpus(12, first_device);
  return c;
}

// `c` (overflowing) under ZeRO stage `zero` skips the steps stage 0 skips (some), its
// replicas identical, and stops with stage 0's message: returned.
std::string check_skips_as_stage_0(TrainConfig c, int zero) {
  const TrainResult plain = Trainer(c).run();
  c.parallel.zero = zero;
  Trainer sharded(c);
  const TrainResult r = sharded.run();
  CHECK(plain.skipped > 0);
  CHECK(r.skipped == plain.skipped);
  CHECK(sharded.parallel().replicas_identical());
  const std::string want = stop_message(c, 0);
  CHECK(stop_message(c, zero) == want);
  return want;
}

}  // namespace

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
        TrainConfig c = sharding_case(task, opt, cpus(n, 40), accum, clip);
        Trainer plain(c);
        plain.run();
        c.parallel.zero = 1;
        Trainer sharded(c);
        step_replicas_identical(sharded, c.steps);
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
  run_stages(tiny_on_12(12, 60), 0, 1, [](Trainer& plain, Trainer& sharded) {
    const auto shards = sharded.parallel().zero_shards();
    CHECK(std::any_of(shards.begin(), shards.end(), [](const SampleRange& k) { return k.count == 0; }));
    CHECK(sharded.model().flat_params().to_host() == plain.model().flat_params().to_host());
    CHECK(sharded.parallel().replicas_identical());
  });
}

TEST_CASE("a ZeRO checkpoint is the flat state: it resumes on other replica counts and stages", "[parallel][zero]") {
  TrainConfig c = small(data::Task::regression, "adamw", 12);
  c.steps = 20;
  c.devices = cpus(4, 80);
  c.parallel.zero = 1;
  check_zero_resumes(c, {{4, 1}, {3, 1}, {2, 0}, {1, 0}, {3, 0}}, 90, cpus(2, 100));
}

TEST_CASE("ZeRO skips a non-finite step on every replica alike", "[parallel][zero]") {
  // stop names the same step and parameter: the first bad gradient over the shards.
  CHECK(check_skips_as_stage_0(overflowing(cpus(3, 110)), 1).find("the gradient of parameter") != std::string::npos);
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

TEST_CASE("ZeRO stage 2's slots: the buckets take turns in two, a tied weight's bucket has its own",
          "[parallel][zero]") {
  // Parameters at 0 (100 floats), 100 (30), 132 (500), 632 (8); buckets [632, 8], [132, 500]
  // and [0, 130] (the first two parameters).
  const std::vector<int64_t> offsets{0, 100, 132, 632}, sizes{100, 30, 500, 8};
  const auto buckets = make_param_buckets(offsets, sizes, 200 * 4.0, 200 * 4.0);
  const auto of = buckets_of_params(buckets, offsets, sizes);
  const SlotLayout turns = layout_slots(buckets, offsets, sizes, of, {1, 1, 1, 1});
  CHECK(turns.size == 2 * 500);  // two slots of the largest bucket
  CHECK(turns.slot_of == std::vector<size_t>{0, 1, 0});
  CHECK(turns.previous_in_slot == std::vector<int>{-1, -1, 0});
  CHECK(turns.in_slots == std::vector<int64_t>{0, 100, 500, 0});
  CHECK(!turns.own_slot(2));
  // The first parameter is used twice: its bucket gets a third slot, of its own size, and
  // the others alternate as before.
  const SlotLayout tied = layout_slots(buckets, offsets, sizes, of, {2, 1, 1, 1});
  CHECK(tied.size == 2 * 500 + 130);
  CHECK(tied.slot_of == std::vector<size_t>{0, 1, 2});
  CHECK(tied.slot_begin == std::vector<int64_t>{0, 500, 1000});
  CHECK(tied.previous_in_slot == std::vector<int>{-1, -1, -1});
  CHECK(tied.in_slots == std::vector<int64_t>{1000, 1100, 500, 0});
  CHECK((tied.own_slot(2) && !tied.own_slot(0) && !tied.own_slot(1)));
  // The last parameter tied: its bucket comes first, and every bucket after it (held back
  // behind it in the hand-over) has a slot of its own too.
  const SlotLayout first = layout_slots(buckets, offsets, sizes, of, {1, 1, 1, 2});
  CHECK(first.size == 8 + 500 + 130);
  CHECK((first.turn_slots == 0 && first.own_slot(0) && first.own_slot(1) && first.own_slot(2)));
  // One bucket, tied: no turns.
  const auto one = make_param_buckets(offsets, sizes, 1e9, 1e9);
  const SlotLayout alone = layout_slots(one, offsets, sizes, buckets_of_params(one, offsets, sizes), {2, 1, 1, 1});
  CHECK((alone.size == 640 && alone.turn_slots == 0 && alone.own_slot(0)));
}

namespace {
// A weight used first and last in forward (as a tied output projection), registered after
// the layers between its uses (where the output layer owns it): its bucket comes first in
// bucket order, and backward writes it first and last.
class TiedLast : public nn::Module {
 public:
  TiedLast() {
    for (int i = 0; i < 3; ++i) {
      middle_.push_back(std::make_shared<nn::Linear>(8, 8, Act::tanh));
      register_module(middle_.back(), "m" + std::to_string(i));
    }
    register_module(shared_, "shared");
    for (nn::Parameter* p : shared_->parameters()) p->uses = 2;
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = shared_->forward(x);
    for (auto& m : middle_) h = m->forward(h);
    return shared_->forward(h);
  }
  std::shared_ptr<Module> clone() const override { return std::make_shared<TiedLast>(); }
  std::string describe() const override { return "TiedLast"; }

 private:
  std::vector<std::shared_ptr<nn::Linear>> middle_;
  std::shared_ptr<nn::Linear> shared_ = std::make_shared<nn::Linear>(8, 8, Act::tanh);
};
}  // namespace

TEST_CASE("ZeRO stage 2 trains a model whose tied weight is not in the last bucket as stage 1", "[parallel][zero]") {
  const Device host{DeviceType::cpu, 0};
  data::Synthetic d({.task = data::Task::regression, .in = 8, .out = 8, .seed = 3}, host);
  for (int accum : {1, 2}) {
    INFO(accum << " micro-batches");
    auto run = [&](int zero, int first_device) {
      auto m = std::make_shared<TiedLast>();
      m->to({DeviceType::cpu, first_device}, 4);
      DataParallelOptions o;
      o.reduce = Reduce::host;
      o.bucket_mb = 0.0001;  // a bucket a parameter
      o.zero = zero;
      o.grad_accum = accum;
      DataParallel dp(
          m, cpus(2, first_device),
          [](nn::Module& r) { return std::make_unique<optim::SGD>(r, optim::SGD::Options{.lr = 0.05f}); }, o);
      REQUIRE(dp.buckets() > 4);
      for (int s = 0; s < 3; ++s) dp.train_step(d.batch(s * 8, 8), nn::MSELoss());
      return dp.replica(0).flat_params().to_host();
    };
    const auto one = run(1, 320);
    std::vector<float> two;
    REQUIRE_NOTHROW(two = run(2, 330));
    if (accum == 1) CHECK(two == one);  // stage 2 adds each micro-batch's sum to the shard
    else CHECK(test::rel_error(two, one) <= 1e-6);
  }
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
        TrainConfig c = sharding_case(task, opt, cpus(n, 140), accum, clip);
        c.parallel.zero = 1;
        Trainer one(c);
        one.run();
        c.parallel.zero = 2;
        c.devices = cpus(n, 240);
        Trainer two(c);
        step_replicas_identical(two, c.steps);
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

TEST_CASE("a step that fails on one replica throws, and the next trains (host, ZeRO 0 to 2)", "[parallel][zero]") {
  for (int zero : {0, 1, 2})
    for (int accum : {1, 2}) check_failed_step([](int k) { return cpus(3, 160 + 10 * k); }, Reduce::host, zero, accum);
}

TEST_CASE("ZeRO stage 2: non-finite steps, empty shards and checkpoints as stage 0", "[parallel][zero]") {
  check_skips_as_stage_0(overflowing(cpus(3, 160)), 2);
  // 12 replicas on a model of 3 parameters: empty shards, and a batch smaller than the replicas.
  TrainConfig tiny = tiny_on_12(7, 170);
  const auto stage_0 = final_params(tiny);
  tiny.parallel.zero = 2;
  CHECK(test::rel_error(final_params(tiny), stage_0) <= 1e-6);
  // A stage-2 checkpoint resumes under stage 0 and 1 elsewhere, and a stage-0 one under stage 2.
  TrainConfig w = small(data::Task::regression, "adamw", 12);
  w.devices = cpus(4, 190);
  w.parallel.zero = 2;
  check_zero_resumes(w, {{4, 2}, {3, 2}, {2, 1}, {1, 0}}, 200, w.devices);
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

namespace {

// 12 steps of `model` on batches of 32 on the GPU, with `opt`, clipped at `clip` (0: not),
// computed at `precision`.
TrainConfig on_one_gpu(const std::string& model, const std::string& opt, float clip, Precision precision) {
  TrainConfig c = quiet_config(model, opt, 32);
  c.steps = 12;
  c.parallel.clip = clip;
  c.parallel.precision = precision;
  c.devices = {gpu};
  return c;
}

}  // namespace

TEST_CASE("ZeRO stage 1 on one GPU (NCCL, one shard) gives stage 0's parameters bit for bit", "[gpu][parallel][zero]") {
  if (!built_with_nccl()) return;
  for (std::string opt : {"sgd", "adamw"})
    for (float clip : {0.0f, 0.5f})
      for (Precision p : {Precision::fp32, Precision::bf16})
        for (bool graph : {false, true}) {
          INFO(opt << ", clip " << clip << ", " << precision_name(p) << (graph ? ", CUDA graph" : ""));
          TrainConfig c = on_one_gpu("24-48x2-6", opt, clip, p);
          c.parallel.cuda_graph = graph;
          run_stages(c, 0, 1, [](Trainer& plain, Trainer& sharded) {
            CHECK(sharded.parallel().reduce() == Reduce::nccl);
            CHECK(sharded.parallel().zero_shards().size() == 1);
            CHECK(sharded.model().flat_params().to_host() == plain.model().flat_params().to_host());
            const auto a = sharded.parallel().optimizer_state(), b = plain.parallel().optimizer_state();
            REQUIRE(a.size() == b.size());
            for (size_t i = 0; i < a.size(); ++i) CHECK(a[i].second.to_host() == b[i].second.to_host());
          });
        }
}

TEST_CASE("ZeRO stage 2 on one GPU (NCCL, one shard, gradients in two slots) gives stage 1's parameters",
          "[gpu][parallel][zero]") {
  if (!built_with_nccl()) return;
  for (std::string model : {"24-48x2-6", "cnn:2x7x7-c4k3-p2-c6k3s2-f3"})
    for (std::string opt : {"sgd", "adamw"})
      for (float clip : {0.0f, 0.5f})
        for (Precision p : {Precision::fp32, Precision::bf16})
          for (int accum : {1, 2}) {
            INFO(model << " " << opt << ", clip " << clip << ", " << precision_name(p) << ", " << accum
                       << " micro-batches");
            TrainConfig c = on_one_gpu(model, opt, clip, p);
            c.task = model.rfind("cnn", 0) == 0 ? data::Task::classification : data::Task::regression;
            c.parallel.grad_accum = accum;
            // Several buckets, small parameters sharing them over padding.
            c.parallel.bucket_mb = c.task == data::Task::classification ? 0.001 : 0.004;
            run_stages(c, 1, 2, [&](Trainer& one, Trainer& two) {
              CHECK(two.parallel().reduce() == Reduce::nccl);
              REQUIRE(two.parallel().buckets() >= 3);
              const auto want = one.model().flat_params().to_host(), got = two.model().flat_params().to_host();
              INFO("relative error " << rel_error(got, want));
              // One micro-batch: the shard is the gradient, copied; with two, stage 1 adds
              // the second in backward's GEMM and stage 2 after it (another rounding).
              if (accum == 1) CHECK(got == want);
              else CHECK(rel_error(got, want) <= 1e-6);
            });
          }
}

TEST_CASE("ZeRO stages 1 and 2 over N GPUs (NCCL) train as stage 0", "[gpu][parallel][multigpu][zero]") {
  const int gpus = cuda_device_count();
  if (gpus < 2 || !built_with_nccl()) {
    WARN("one GPU here (or no NCCL): ZeRO over several GPUs needs 2 or more");
    return;
  }
  for (std::string opt : {"sgd", "adamw"})
    for (float clip : {0.0f, 0.5f})
      for (int accum : {1, 2}) {
        TrainConfig c = dp_config(data::Task::regression, opt);
        c.parallel.clip = clip;
        c.parallel.grad_accum = accum;
        c.batch = 30;
        for (int n = 2; n <= std::min(gpus, 8); ++n) {
          std::vector<Device> devs;
          for (int i = 0; i < n; ++i) devs.push_back({DeviceType::cuda, i});
          const auto want = train_dp(c, devs, Reduce::nccl);
          for (int zero : {1, 2}) {
            INFO(opt << ", clip " << clip << ", " << accum << " micro-batches, " << n << " GPUs, zero " << zero);
            TrainConfig z = c;
            z.parallel.zero = zero;
            CHECK(rel_error(train_dp(z, devs, Reduce::nccl), want) <= 1e-6);
          }
        }
      }
}

TEST_CASE("a step that fails on one replica of a GPU's three throws, and the next trains (p2p; NCCL alone)",
          "[gpu][parallel]") {
  for (int accum : {1, 2}) {
    check_failed_step([](int) { return std::vector<Device>(3, gpu); }, Reduce::p2p, 0, accum);
    if (built_with_nccl())
      for (int zero : {0, 2})
        check_failed_step([](int) { return std::vector<Device>{gpu}; }, Reduce::nccl, zero, accum);
  }
}

TEST_CASE("a step that fails on one GPU of several throws, and the next trains (NCCL, ZeRO 0 to 2; p2p)",
          "[gpu][parallel][multigpu][failed_step]") {
  const int gpus = std::min(cuda_device_count(), 3);
  if (gpus < 2) {
    WARN("one GPU here: a failure on one of several GPUs needs 2 or more");
    return;
  }
  const auto devices = [gpus](int) {
    std::vector<Device> d;
    for (int i = 0; i < gpus; ++i) d.push_back({DeviceType::cuda, i});
    return d;
  };
  if (built_with_nccl()) {
    check_failed_step(devices, Reduce::nccl, 0, 1, /*before=*/0);  // before NCCL has connected its peers
    for (int zero : {0, 1, 2})
      for (int accum : {1, 2}) check_failed_step(devices, Reduce::nccl, zero, accum);
  }
  check_failed_step(devices, Reduce::p2p, 0, 2);
}

#endif  // DPT_GPU_TESTS
