// Gradient buckets and what travels between replicas: buckets tiling the flat buffer, p2p's
// chunked copy back, bf16 on the wire, each bucket updated once reduced, tuned bucket
// sizes; on the GPU, the same on logical replicas and N GPUs, communication streams and
// the peer sum.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <thread>
#include <tuple>
#include <utility>

#include <dptrain/data/dataset.hpp>
#include <dptrain/error.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/train/trainer.hpp>
#include "kernels/cpu/cpu.hpp"
#include "parallel/reducer.hpp"
#include "runtime/allocator.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/cuda.hpp"
#endif

#include "catch.hpp"
#include "chunked_copy.hpp"
#include "common.hpp"
#include "parallel_common.hpp"

using namespace dpt;
using namespace dpt::test;

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

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
  auto c = nn::make_copy_chunks({-1, 100, -1, 300000, 300100, 300200, -1}, 300256, 1000, chunk_of);
  REQUIRE(c.size() == 2);
  CHECK(c[0] == nn::CopyChunk{0, 300000});
  CHECK(c[1] == nn::CopyChunk{300000, 256});
  CHECK(chunk_of == std::vector<int>{-1, 0, -1, 0, 1, 1, -1});
  // Every layer large enough: a chunk each.
  c = nn::make_copy_chunks({1000, 2000, 3000}, 3000, 1000, chunk_of);
  CHECK(c == std::vector<nn::CopyChunk>{{0, 1000}, {1000, 1000}, {2000, 1000}});
  CHECK(chunk_of == std::vector<int>{0, 1, 2});
  CHECK(nn::make_copy_chunks({-1, -1}, 0, 1000, chunk_of).empty());  // no parameters: nothing to copy
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
      step_replicas_identical(bf16, c.steps);
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

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

TEST_CASE("bf16 on the wire between logical replicas (p2p): the master's gradient plus the other's rounded",
          "[gpu][parallel][grad_comm]") {
  const int64_t total = 100003;
  const std::vector<Bucket> buckets = make_buckets(total, 16 * 1024 * 4, 16 * 1024 * 4);
  REQUIRE(buckets.size() > 2);
  Context a(gpu), b(gpu);
  const auto g0 = randn(total, 90), g1 = randn(total, 91);
  std::vector<ReplicaBuffers> bufs{{&a, Tensor::zeros({total}, DType::f32, gpu), on(gpu, g0, {total}), Tensor()},
                                   {&b, Tensor::zeros({total}, DType::f32, gpu), on(gpu, g1, {total}), Tensor()}};
  auto reducer = make_p2p_reducer(bufs, buckets, DType::bf16);
  context(gpu).synchronize();  // the uploads, on the default stream, before a and b read them
  for (size_t i = 0; i < 2; ++i) {
    ContextGuard guard(*bufs[i].ctx);
    for (size_t k = 0; k < buckets.size(); ++k) reducer->bucket_ready(i, k);
  }
  reducer->reduce();
  reducer->wait(0);
  a.synchronize();
  std::vector<uint16_t> halves(g1.size());
  std::vector<float> rounded(g1.size()), want(g1.size());
  cpu::cast_f32_bf16(g1.data(), halves.data(), total);
  cpu::cast_bf16_f32(halves.data(), rounded.data(), total);
  for (size_t j = 0; j < want.size(); ++j) want[j] = g0[j] + rounded[j];
  CHECK(bufs[0].grads.to_host() == want);
  // And training: within bf16's tolerance of the fp32 wire, the replicas identical.
  TrainConfig c = dp_config(data::Task::regression, "adamw");
  c.devices = {gpu, gpu};
  c.parallel.reduce = Reduce::p2p;
  Trainer fp32(c);
  fp32.run();
  c.parallel.grad_comm = DType::bf16;
  Trainer bf16(c);
  bf16.run();
  CHECK(bf16.parallel().replicas_identical());
  const auto w = fp32.model().flat_params().to_host(), got = bf16.model().flat_params().to_host();
  CHECK(got != w);
  CHECK(rel_error(got, w) <= 1e-2);
}

TEST_CASE("each bucket updated once reduced equals the update after the last, eager and in a graph",
          "[gpu][parallel][per_bucket]") {
  for (std::string opt : {"sgd", "adamw"})
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      INFO(opt << ", " << precision_name(precision));
      // p2p between logical replicas of the GPU (the master updates on its reduction's stream).
      const std::vector<Device> two{gpu, gpu};
      const auto want = train_per_bucket(two, Reduce::p2p, opt, precision, {});
      CHECK(train_per_bucket(two, Reduce::p2p, opt, precision, {.per_bucket = true}) == want);
      CHECK(train_per_bucket(two, Reduce::p2p, opt, precision, {.per_bucket = true, .graph = true}) == want);
      // Buckets tuned over the first steps (0.002 and 1 MiB; 4 to 64 MiB give 1 MiB's one
      // bucket): the parameters of fixed ones.
      const auto longer = train_per_bucket(two, Reduce::p2p, opt, precision, {.steps = 12});
      CHECK(train_per_bucket(two, Reduce::p2p, opt, precision, {.per_bucket = true, .tune = true, .steps = 12}) ==
            longer);
      // NCCL with one rank (every bucket's sum is its own gradient), NCCL's thread blocks capped.
      if (!built_with_nccl()) continue;
      const auto one = train_per_bucket({gpu}, Reduce::nccl, opt, precision, {});
      CHECK(train_per_bucket({gpu}, Reduce::nccl, opt, precision, {.per_bucket = true}) == one);
      CHECK(train_per_bucket({gpu}, Reduce::nccl, opt, precision, {.comm_ctas = 2}) == one);
      CHECK(train_per_bucket({gpu}, Reduce::nccl, opt, precision, {.tune = true, .steps = 12}) ==
            train_per_bucket({gpu}, Reduce::nccl, opt, precision, {.steps = 12}));
    }
}

TEST_CASE("p2p's chunked copy of the parameters equals the whole copy on logical replicas of the GPU",
          "[gpu][parallel]") {
  // Three replicas on one GPU: each copies the master's parameters layer by layer on its
  // update stream while its next forward runs on its compute stream. A missing wait shows
  // as a replica that computed with old parameters: other losses, other parameters. Three
  // rounds, as a race need not show in every one.
  const std::vector<Device> three{gpu, gpu, gpu};
  for (int round = 0; round < 3; ++round)
    for (std::string opt : {"sgd", "adamw"})
      for (Precision precision : {Precision::fp32, Precision::bf16}) {
        INFO("round " << round << ", " << opt << ", " << precision_name(precision));
        CHECK(test::train_p2p_chunked(three, true, precision, opt) ==
              test::train_p2p_chunked(three, false, precision, opt));
      }
  if (cuda_device_count() < 2) return;
  // Two GPUs: the copies cross NVLink (or PCIe) while the second's forward runs.
  const std::vector<Device> two{gpu, {DeviceType::cuda, 1}};
  for (int round = 0; round < 3; ++round)
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      INFO("two GPUs, round " << round << ", " << precision_name(precision));
      CHECK(test::train_p2p_chunked(two, true, precision, "adamw") ==
            test::train_p2p_chunked(two, false, precision, "adamw"));
    }
}

#if DPT_WITH_CUDA
TEST_CASE("communication streams have the highest priority; a peer sum needs a peer", "[gpu][parallel]") {
  Context normal(gpu), high(gpu, StreamPriority::high);
  int least = 0, greatest = 0;
  REQUIRE(cudaDeviceGetStreamPriorityRange(&least, &greatest) == cudaSuccess);
  CHECK(normal.priority() == least);
  CHECK(high.priority() == greatest);
  CHECK(high.priority() < normal.priority());  // the CUDA order: lower runs first
  std::vector<ReplicaBuffers> bufs;
  for (int i = 0; i < 2; ++i)
    bufs.push_back(
        {&context(gpu), Tensor::zeros({256}, DType::f32, gpu), Tensor::zeros({256}, DType::f32, gpu), Tensor()});
  auto p2p = make_p2p_reducer(bufs, make_buckets(256, 1024, 1024));
  for (Context* c : p2p->contexts()) CHECK(c->priority() == greatest);
  // One GPU reads its own memory: no peer, so add_peer_ refuses.
  const Tensor a = Tensor::zeros({4}, DType::f32, gpu), b = Tensor::zeros({4}, DType::f32, gpu);
  CHECK_THROWS_AS(add_peer_(a, b), Error);
  CHECK_FALSE(peer_readable(gpu, gpu));
  CHECK_FALSE(peer_readable(gpu, host));
}
#endif

TEST_CASE("a peer's bucket summed in place equals the staged copy and sum, f32 and bf16", "[gpu][multigpu]") {
  if (cuda_device_count() >= 2) enable_peer_access({gpu, {DeviceType::cuda, 1}});
  if (cuda_device_count() < 2 || !peer_readable(gpu, {DeviceType::cuda, 1})) {
    WARN("no second GPU that this one reads directly: the peer sum is not tested here");
    return;
  }
  const Device other{DeviceType::cuda, 1};
  const int64_t n = 1000003;  // a scalar tail after the float4s
  for (DType t : {DType::f32, DType::bf16}) {
    INFO(dtype_name(t));
    const auto y0 = test::randn(n, 5), x0 = test::randn(n, 6);
    Tensor x = cast(Tensor::from_host(x0, {n}, other), t);
    Tensor direct = Tensor::from_host(y0, {n}, gpu), staged = Tensor::from_host(y0, {n}, gpu);
    add_peer_(x, direct);
    Tensor here = Tensor::empty({n}, t, gpu);
    copy(here, x);
    axpy_(1.0f, here, staged);
    CHECK(direct.to_host() == staged.to_host());
    CHECK(direct.to_host() != y0);
  }
}

TEST_CASE(
    "N GPUs: p2p reading peers in place equals NCCL, updates per bucket and NCCL's capped blocks equal the "
    "usual",
    "[gpu][parallel][multigpu][per_bucket]") {
  const int gpus = cuda_device_count();
  if (gpus < 2) {
    WARN("one GPU here: the multi-GPU per-bucket tests need 2 or more");
    return;
  }
  for (int n = 2; n <= std::min(gpus, 8); ++n) {
    std::vector<Device> devs;
    for (int i = 0; i < n; ++i) devs.push_back({DeviceType::cuda, i});
    for (std::string opt : {"sgd", "adamw"}) {
      INFO(opt << " on " << n << " GPUs");
      const auto p2p = train_per_bucket(devs, Reduce::p2p, opt, Precision::fp32, {});
      CHECK(train_per_bucket(devs, Reduce::p2p, opt, Precision::fp32, {.per_bucket = true}) == p2p);
      if (!built_with_nccl()) continue;
      const auto nccl = train_per_bucket(devs, Reduce::nccl, opt, Precision::fp32, {});
      CHECK(train_per_bucket(devs, Reduce::nccl, opt, Precision::fp32, {.per_bucket = true}) == nccl);
      // Two GPUs add a + b both ways (the same bits); more may add in another order.
      if (n == 2) CHECK(p2p == nccl);
      else CHECK(rel_error(p2p, nccl) <= 1e-6);
      CHECK(rel_error(train_per_bucket(devs, Reduce::nccl, opt, Precision::fp32, {.comm_ctas = 4}), nccl) <= 1e-6);
    }
  }
}

#endif  // DPT_GPU_TESTS
