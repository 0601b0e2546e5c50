// CUDA against the CPU oracle: every op forward and backward, both GEMMs at every
// transpose and odd sizes, the random and cast kernels, a 50-step training run, the
// allocator's steady state and its out-of-memory message. Runs only where there is a GPU
// (main.cpp exits 77 otherwise, and ctest reports the test skipped).
#include <cmath>

#include "../kernels/error.hpp"
#include "../layers/loss.hpp"
#include "../optim/trainer.hpp"
#include "../runtime/allocator.hpp"
#include "../runtime/context.hpp"
#include "catch.hpp"
#include "common.hpp"

using namespace dpt;
using test::randn;
using test::rel_error;

namespace {
const Device host{DeviceType::cpu, 0};
const Device gpu{DeviceType::cuda, 0};

Tensor on(const Device& d, const std::vector<float>& v, const Shape& s) { return Tensor::from_host(v, s, d); }

// Runs f(device) on the CPU and on the GPU with the same inputs and compares every
// tensor it returns (outputs and gradients).
void compare(const std::function<std::vector<Tensor>(const Device&)>& f, double tol = 1e-5) {
  auto a = f(host), b = f(gpu);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const double err = rel_error(b[i].to_host(), a[i].to_host());
    INFO("result " << i << " shape " << shape_str(a[i].shape()) << " relative error " << err);
    CHECK(err < tol);
  }
}

// An op's value and the gradients of mse(op, target) for each input.
std::vector<Tensor> value_and_grads(const std::function<Tensor(std::vector<Tensor>&)>& op,
                                    std::vector<Tensor> inputs) {
  for (auto& t : inputs) t.set_requires_grad(true);
  Tensor y = op(inputs);
  Tensor target = Tensor::from_host(randn(y.numel(), 77), y.shape(), y.device());
  mse_loss(y, target).backward();
  std::vector<Tensor> out{y.detach()};
  for (auto& t : inputs) out.push_back(t.grad());
  return out;
}
}  // namespace

TEST_CASE("GEMMs (cuBLAS and native) match the CPU at every transpose and odd sizes", "[gpu][gemm]") {
  struct Size { int64_t m, n, k; };
  for (GemmImpl impl : {GemmImpl::cublas, GemmImpl::native})
    for (Size s : {Size{1, 1, 1}, Size{17, 33, 65}, Size{64, 1000, 1000}, Size{130, 67, 129}, Size{256, 256, 256}})
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          INFO("impl " << (impl == GemmImpl::native ? "native" : "cublas") << " " << s.m << "x" << s.n << "x" << s.k
                       << " ta " << ta << " tb " << tb);
          context(gpu).gemm = impl;
          const Shape sa = ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, sb = tb ? Shape{s.n, s.k} : Shape{s.k, s.n};
          auto A = randn(numel(sa), 1), B = randn(numel(sb), 2), C = randn(s.m * s.n, 3);
          compare([&](const Device& d) {
            Tensor c = on(d, C, {s.m, s.n});
            gemm(ta, tb, 0.5f, on(d, A, sa), on(d, B, sb), 0.25f, c);  // beta != 0 reads C
            Tensor c0 = Tensor::empty({s.m, s.n}, DType::f32, d);
            fill_(c0, NAN);  // beta == 0 must not read C
            gemm(ta, tb, 1.0f, on(d, A, sa), on(d, B, sb), 0.0f, c0);
            return std::vector<Tensor>{c, c0};
          });
        }
  context(gpu).gemm = GemmImpl::cublas;
}

TEST_CASE("TF32 and bf16 GEMMs are within their precision of fp32", "[gpu][gemm]") {
  auto A = randn(256 * 512, 4), B = randn(512 * 128, 5);
  Tensor ref = matmul(on(host, A, {256, 512}), on(host, B, {512, 128}));
  for (auto [p, tol] : {std::pair{Precision::tf32, 3e-3}, std::pair{Precision::bf16, 2e-2}}) {
    context(gpu).precision = p;
    Tensor c = matmul(on(gpu, A, {256, 512}), on(gpu, B, {512, 128}));
    const double err = rel_error(c.to_host(), ref.to_host());
    INFO("precision " << static_cast<int>(p) << " error " << err);
    CHECK(err < tol);
    CHECK(err > 1e-7);  // it really ran at lower precision
  }
  context(gpu).precision = Precision::fp32;
}

TEST_CASE("linear, activations and losses match the CPU, forward and backward", "[gpu][ops]") {
  for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh}) {
    INFO("act " << static_cast<int>(act));
    auto x = randn(37 * 53, 6), W = randn(29 * 53, 7, 0.3f), b = randn(29, 8);
    compare([&](const Device& d) {
      return value_and_grads([&](std::vector<Tensor>& in) { return linear(in[0], in[1], in[2], act); },
                             {on(d, x, {37, 53}), on(d, W, {29, 53}), on(d, b, {29})});
    });
    compare([&](const Device& d) {
      return value_and_grads([&](std::vector<Tensor>& in) { return activation(in[0], act); }, {on(d, x, {37, 53})});
    });
  }
  auto logits = randn(300 * 11, 9, 3.0f);
  std::vector<int32_t> labels(300);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int32_t>((i * 7) % 11);
  compare([&](const Device& d) {
    Tensor l = on(d, logits, {300, 11}).set_requires_grad(true);
    Tensor loss = cross_entropy(l, Tensor::from_host_i32(labels, {300}, d));
    loss.backward();
    return std::vector<Tensor>{loss, l.grad()};
  });
  // Reductions over more elements than one block covers.
  auto y = randn(1 << 20, 10), t = randn(1 << 20, 11);
  compare([&](const Device& d) {
    Tensor yy = on(d, y, {1024, 1024}).set_requires_grad(true);
    Tensor loss = mse_loss(yy, on(d, t, {1024, 1024}));
    loss.backward();
    return std::vector<Tensor>{loss, yy.grad(), sum_squares(yy.detach())};
  });
}

TEST_CASE("optimizers, clipping, casts and argmax match the CPU", "[gpu][ops]") {
  const int64_t n = 100003;  // not a multiple of 4: exercises the vector loops' tails
  auto p = randn(n, 12), g = randn(n, 13), m = randn(n, 14, 0.1f);
  auto v = randn(n, 15, 0.1f);
  for (auto& e : v) e = e * e;
  compare([&](const Device& d) {
    Tensor P = on(d, p, {n}), G = on(d, g, {n}), M = on(d, m, {n});
    Tensor scale = clip_coef(sum_squares(G), 10.0f);
    sgd_step(P, G, M, SgdArgs{0.1f, 0.9f, 0.0f, 0.01f, true}, scale);
    return std::vector<Tensor>{P, M, scale};
  });
  compare([&](const Device& d) {
    Tensor P = on(d, p, {n}), G = on(d, g, {n}), M = on(d, m, {n}), V = on(d, v, {n});
    adamw_step(P, G, M, V, AdamArgs{0.01f, 0.9f, 0.999f, 1e-8f, 0.1f, 0.19f, 0.002f}, Tensor());
    return std::vector<Tensor>{P, M, V};
  });
  // Casts and argmax are exact.
  auto x = randn(n, 16, 100.0f);
  x[5] = NAN;
  auto cpu_bits = cast(on(host, x, {n}), DType::bf16), gpu_bits = cast(on(gpu, x, {n}), DType::bf16);
  auto a = cast(cpu_bits, DType::f32).to_host(), b = cast(gpu_bits, DType::f32).to_host();
  CHECK(std::isnan(b[5]));
  a[5] = b[5] = 0;
  CHECK(a == b);
  auto scores = randn(513 * 37, 17);
  CHECK(argmax_rows(on(host, scores, {513, 37})).to_host_i32() == argmax_rows(on(gpu, scores, {513, 37})).to_host_i32());
}

TEST_CASE("Philox gives the same values on the GPU as on the CPU", "[gpu][random]") {
  Tensor a = Tensor::empty({100001}, DType::f32, host), b = Tensor::empty({100001}, DType::f32, gpu);
  uniform_(a, 3, 4, 12345, -2.0f, 2.0f);
  uniform_(b, 3, 4, 12345, -2.0f, 2.0f);
  CHECK(b.to_host() == a.to_host());  // bit for bit
  normal_(a, 3, 4, 12345, 1.0f);
  normal_(b, 3, 4, 12345, 1.0f);
  CHECK(rel_error(b.to_host(), a.to_host()) < 1e-6);
}

TEST_CASE("50 training steps on CUDA match the same run on the CPU", "[gpu][train]") {
  for (auto task : {data::Task::regression, data::Task::classification})
    for (std::string opt : {"sgd", "adamw"}) {
      INFO(data::task_name(task) << " " << opt);
      TrainConfig cfg;
      cfg.model = "32-64x2-8";
      cfg.task = task;
      cfg.optimizer = opt;
      cfg.lr = opt == "sgd" ? 0.05f : 0.003f;
      cfg.batch = 128;
      cfg.steps = 50;
      cfg.log_every = 1000;
      cfg.devices = {host};
      Trainer a(cfg);
      const TrainResult ra = a.run();
      cfg.devices = {gpu};
      Trainer b(cfg);
      const TrainResult rb = b.run();
      const double err = rel_error(b.model().flat_params().to_host(), a.model().flat_params().to_host());
      INFO("weights relative error " << err << ", loss " << ra.final_loss << " vs " << rb.final_loss);
      CHECK(err < 1e-4);
      CHECK(std::fabs(ra.final_loss - rb.final_loss) <= 1e-3 * std::fabs(ra.final_loss));
    }
}

TEST_CASE("the GPU allocator makes no cudaMalloc after the first training step", "[gpu][allocator]") {
  for (GemmImpl impl : {GemmImpl::cublas, GemmImpl::native}) {
    TrainConfig cfg;
    cfg.model = "64-256x3-16";
    cfg.batch = 512;
    cfg.steps = 30;
    cfg.log_every = 7;
    cfg.gemm = impl;
    cfg.devices = {gpu};
    Trainer t(cfg);
    t.step(0);
    const int64_t after_first = allocator(gpu).stats().system_allocs;
    t.run();
    CHECK(allocator(gpu).stats().system_allocs == after_first);
  }
}

TEST_CASE("out of memory names the device and the sizes and says what to change", "[gpu][allocator][faults]") {
  try {
    Tensor::empty({int64_t(1) << 40}, DType::f32, gpu);  // 4 TiB
    FAIL("no out-of-memory error");
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("cuda:0") != std::string::npos);
    CHECK(msg.find("4.00 TiB") != std::string::npos);  // the bytes asked
    CHECK(msg.find("--batch") != std::string::npos);
  }
  Tensor ok = Tensor::zeros({1024}, DType::f32, gpu);  // the device still works
  CHECK(ok.to_host()[1023] == 0.0f);
}

TEST_CASE("a failing CUDA call names the call and the device", "[gpu][errors][faults]") {
  Tensor a = Tensor::empty({4}, DType::f32, gpu), b = Tensor::empty({8}, DType::f32, gpu);
  CHECK_THROWS_AS(copy(a, b), Error);  // shape mismatch caught before CUDA
  try {
    check_device({DeviceType::cuda, 99});
    FAIL("cuda:99 accepted");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()).find("cuda:99") != std::string::npos);
  }
}

// ---- Data parallelism on the GPU ------------------------------------------------------

namespace {
TrainConfig dp_config(data::Task task, const std::string& opt) {
  TrainConfig c;
  c.model = "24-48x2-6";
  c.task = task;
  c.optimizer = opt;
  c.lr = opt == "sgd" ? 0.05f : 0.003f;
  c.batch = 10;  // uneven on 3 and 4 replicas
  c.steps = 20;
  c.log_every = 1000;
  c.bucket_mb = 0.002;  // several buckets
  return c;
}

// Trains `c` on `devices` step by step, asserting that the replicas stay bitwise
// identical, and returns the master's weights.
std::vector<float> train_dp(TrainConfig c, std::vector<Device> devices, Reduce path) {
  c.devices = std::move(devices);
  c.reduce = path;
  Trainer t(c);
  for (int64_t s = 0; s < c.steps; ++s) {
    t.step(s);
    REQUIRE(t.parallel().replicas_identical());
  }
  return t.model().flat_params().to_host();
}
}  // namespace

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
  c.reduce = Reduce::p2p;
  c.steps = 15;
  Trainer t(c);
  t.step(0);
  const int64_t after_first = allocator(gpu).stats().system_allocs;
  t.run();
  CHECK(allocator(gpu).stats().system_allocs == after_first);
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
  c.bucket_mb = 1.0;
  for (Reduce path : {Reduce::nccl, Reduce::p2p}) {
    if (path == Reduce::nccl && !built_with_nccl()) continue;
    for (const Device& d : devs) allocator(d).reset_peak();
    c.devices = devs;
    c.reduce = path;
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
        m, std::move(devs), [](nn::Module& r) { return std::make_unique<optim::SGD>(r, optim::SGD::Options{.lr = 0.1f}); },
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

TEST_CASE("a step recorded as a CUDA graph trains exactly like the eager step", "[gpu][graph]") {
  for (std::string schedule : {"constant", "cosine"}) {
    INFO("schedule " << schedule);
    TrainConfig c;
    c.model = "24-48x2-6";
    c.batch = 32;
    c.steps = 25;
    c.log_every = 1000;
    c.devices = {gpu};
    c.schedule = schedule;
    c.warmup = 3;
    Trainer eager(c);
    eager.run();
    c.cuda_graph = true;
    Trainer graphed(c);
    for (int64_t s = 0; s < 3; ++s) graphed.step(s);  // eager, recorded, replayed
    const int64_t allocs = allocator(gpu).stats().system_allocs;
    const TrainResult r = graphed.run();
    // A constant lr replays one recording: nothing more is allocated. (Each new lr is
    // recorded anew.)
    if (schedule == "constant") CHECK(allocator(gpu).stats().system_allocs == allocs);
    const double err = rel_error(graphed.model().flat_params().to_host(), eager.model().flat_params().to_host());
    INFO("weights relative error " << err << ", final loss " << r.final_loss);
    CHECK(err <= 1e-6);
    CHECK(graphed.optimizer().steps_taken() == c.steps);
  }
}
