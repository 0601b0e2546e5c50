// Optimizers: SGD and AdamW against torch's update rules, clipping, the gradient check,
// schedules from a device counter, twin buffers and the bf16 shadow on the CPU; on the GPU,
// the fused updates, the checked update, the alternating update in a graph and twin buffers
// against the CPU.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <dptrain/data/synthetic.hpp>
#include <dptrain/error.hpp>
#include <dptrain/layers/conv.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/train/trainer.hpp>
#include "kernels/cpu/cpu.hpp"
#include "runtime/allocator.hpp"
#include "train/nonfinite_watch.hpp"

#include "catch.hpp"
#include "common.hpp"
#include "train_common.hpp"

using namespace dpt;
using namespace dpt::test;

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

TEST_CASE("SGD matches torch.optim.SGD's update rule", "[optim]") {
  for (bool nesterov : {false, true}) {
    SgdArgs a{0.1f, 0.9f, 0.0f, 0.01f, nesterov};
    std::vector<float> p{1.0f, -2.0f}, g{0.5f, 0.25f}, buf{0.0f, 0.0f};
    std::vector<double> rp{1.0, -2.0}, rb{0.0, 0.0};
    for (int step = 0; step < 3; ++step) {
      cpu::sgd_step(p.data(), g.data(), buf.data(), 2, a, nullptr, nullptr);
      for (size_t i = 0; i < 2; ++i) {
        double d = g[i] + 0.01 * rp[i];
        rb[i] = step == 0 ? d : 0.9 * rb[i] + d;
        d = nesterov ? d + 0.9 * rb[i] : rb[i];
        rp[i] -= 0.1 * d;
      }
    }
    for (size_t i = 0; i < 2; ++i) CHECK(std::fabs(p[i] - rp[i]) < 1e-6);
  }
}

TEST_CASE("AdamW matches torch.optim.AdamW's update rule", "[optim]") {
  std::vector<float> p{1.0f, -2.0f}, g{0.5f, -0.25f}, m{0, 0}, v{0, 0};
  std::vector<double> rp{1.0, -2.0}, rm{0, 0}, rv{0, 0};
  for (int t = 1; t <= 3; ++t) {
    AdamArgs a{0.01f, 0.9f, 0.999f, 1e-8f, 0.1f, 1.0f - std::pow(0.9f, float(t)), 1.0f - std::pow(0.999f, float(t))};
    cpu::adamw_step(p.data(), g.data(), m.data(), v.data(), 2, a, nullptr, nullptr);
    for (size_t i = 0; i < 2; ++i) {
      rp[i] *= 1.0 - 0.01 * 0.1;
      rm[i] = 0.9 * rm[i] + 0.1 * g[i];
      rv[i] = 0.999 * rv[i] + 0.001 * g[i] * g[i];
      rp[i] -= 0.01 * (rm[i] / (1 - std::pow(0.9, t))) / (std::sqrt(rv[i] / (1 - std::pow(0.999, t))) + 1e-8);
    }
  }
  for (size_t i = 0; i < 2; ++i) CHECK(std::fabs(p[i] - rp[i]) < 1e-6);
}

TEST_CASE("gradient clipping scales the update to the norm asked", "[optim]") {
  std::vector<float> g{3.0f, 4.0f};  // norm 5
  float sq = 0, coef = 0;
  cpu::sum_squares(g.data(), 2, &sq);
  CHECK(sq == 25.0f);
  cpu::clip_coef(&sq, 1.0f, &coef);
  CHECK(std::fabs(coef - 0.2f) < 1e-6f);
  cpu::clip_coef(&sq, 10.0f, &coef);
  CHECK(coef == 1.0f);
}

TEST_CASE("the gradient check gives the scale and records it with the first bad gradient", "[optim]") {
  std::vector<float> g(1000, 1.0f);
  CheckRecord ring[3] = {};
  int64_t count = 0;
  const CheckRingArgs args{ring, 3, &count};
  float scale = 0, read = 0;
  cpu::check_gradients(g.data(), 1000, 10.0f, &scale, &args);  // norm sqrt(1000) > 10: clipped
  CHECK(std::fabs(scale - 10.0f / (std::sqrt(1000.0f) + 1e-6f)) < 1e-7f);
  std::memcpy(&read, &ring[0].scale_bits, 4);
  CHECK(read == scale);
  CHECK(ring[0].index == -1);
  CHECK(ring[0].tag == 1);
  cpu::check_gradients(g.data(), 1000, 0.0f, &scale, &args);  // no clipping: 1
  CHECK(scale == 1.0f);
  for (float& v : g) v = 1e30f;  // every value finite, their norm overflows
  cpu::check_gradients(g.data(), 1000, 0.0f, &scale, &args);
  CHECK(std::isnan(scale));
  CHECK(ring[2].index == INT32_MAX);
  g[777] = INFINITY;
  g[901] = NAN;
  cpu::check_gradients(g.data(), 1000, 1.0f, &scale, &args);  // the fourth record: the first slot again
  std::memcpy(&read, &ring[0].scale_bits, 4);
  CHECK(std::isnan(read));
  CHECK(ring[0].index == 777);
  CHECK(ring[0].tag == 4);
  CHECK(ring[1].tag == 2);
  CHECK(count == 4);
  cpu::check_gradients(g.data(), 1000, 1.0f, &scale, nullptr);  // no ring: nothing recorded
  CHECK(count == 4);
}

TEST_CASE("ZeRO's gradient check in shards decides as the one-pass check", "[ops]") {
  // Each shard's part (its squares' sum, the flat index of its first non-finite value),
  // the parts summed and min'd as the host reduction does, and finish_check: the one-pass
  // check's norm within rounding (the sums add in another order), its first index and
  // its decision.
  const int64_t n = 1000;
  auto sharded = [&](const Tensor& g, float max_norm) {
    const int64_t cut[4] = {0, 300, 301, n};  // a shard of a single element
    float total = 0.0f;
    int64_t least = INT64_MAX;
    for (int k = 0; k < 3; ++k) {
      const Tensor sum = Tensor::zeros({1}, DType::f32, host), first = Tensor::zeros({2}, DType::i32, host);
      shard_check(g.view(cut[k], {cut[k + 1] - cut[k]}), cut[k], sum, first);
      total += sum.to_host()[0];
      int64_t v = 0;
      std::memcpy(&v, first.to_host_i32().data(), 8);
      least = std::min(least, v);
    }
    const Tensor first =
        Tensor::from_host_i32({static_cast<int32_t>(least & 0xffffffff), static_cast<int32_t>(least >> 32)}, {2}, host);
    return std::pair<float, int64_t>{
        finish_check(Tensor::from_host(std::vector<float>{total}, {1}, host), first, max_norm).to_host()[0], least};
  };
  Tensor g = randn_tensor({n}, 3, host);
  for (float clip : {0.0f, 0.5f}) {
    const float whole = dpt::check_gradients(g, clip).to_host()[0];
    const auto [scale, first] = sharded(g, clip);
    CHECK(std::fabs(scale - whole) <= 1e-6f * whole);
    CHECK(first == INT64_MAX);
  }
  auto bad = g.to_host();
  bad[613] = NAN;
  bad[800] = INFINITY;
  bad[300] = INFINITY;  // the single-element shard
  g = Tensor::from_host(bad, {n}, host);
  const auto [scale, first] = sharded(g, 0.0f);
  CHECK(std::isnan(scale));
  CHECK(std::isnan(dpt::check_gradients(g, 0.0f).to_host()[0]));
  CHECK(first == 300);
}

TEST_CASE("learning-rate schedules", "[optim]") {
  optim::Schedule c{optim::Schedule::Kind::constant, 0.1f, 0, 100};
  CHECK(c.at(0) == 0.1f);
  CHECK(c.at(99) == 0.1f);
  optim::Schedule w{optim::Schedule::Kind::warmup, 0.1f, 10, 100};
  CHECK(std::fabs(w.at(0) - 0.01f) < 1e-7f);
  CHECK(std::fabs(w.at(4) - 0.05f) < 1e-7f);
  CHECK(w.at(50) == 0.1f);
  optim::Schedule k{optim::Schedule::Kind::cosine, 0.1f, 10, 110};
  CHECK(std::fabs(k.at(10) - 0.1f) < 1e-7f);
  CHECK(std::fabs(k.at(60) - 0.05f) < 1e-6f);
  CHECK(k.at(110) < 1e-7f);
  CHECK_THROWS_AS(optim::parse_schedule("linear"), UsageError);
}

TEST_CASE("optimizers follow their schedule from a counter on the device, as the host computes it", "[optim]") {
  // Each step's lr and AdamW's bias corrections come from the step counter that the
  // update reads and moves on, on the device; the same steps taken with host values (the
  // update ops given lr and the corrections of step t) give the same parameters, bit for
  // bit. A resumed count (set_steps_taken) continues the schedule where it was.
  const Device dev{DeviceType::cpu, 9};
  const optim::Schedule sched{optim::Schedule::Kind::cosine, 0.05f, 3, 20};
  auto grads_of = [&](nn::Module& m, int t) {  // a gradient that changes with the step
    std::vector<float> g(static_cast<size_t>(m.flat_grads().numel()));
    for (size_t i = 0; i < g.size(); ++i) g[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(t));
    copy(m.flat_grads(), Tensor::from_host(g, m.flat_grads().shape(), dev));
  };
  for (std::string kind : {"sgd", "adamw"}) {
    INFO(kind);
    auto make = [&] {
      auto m = nn::mlp("6-10-3");
      m->to(dev, 4);
      return m;
    };
    auto a = make(), b = make(), c = make();
    auto opt = [&](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
      std::unique_ptr<optim::Optimizer> o;
      if (kind == "sgd") o = std::make_unique<optim::SGD>(m, optim::SGD::Options{.lr = 0.05f});
      else o = std::make_unique<optim::AdamW>(m, optim::AdamW::Options{.lr = 0.05f});
      o->set_schedule(sched);
      return o;
    };
    auto oa = opt(*a), oc = opt(*c);
    Tensor m1 = Tensor::zeros(b->flat_params().shape(), DType::f32, dev);
    Tensor v1 = Tensor::zeros(b->flat_params().shape(), DType::f32, dev);
    for (int t = 0; t < 20; ++t) {
      CHECK(oa->lr() == sched.at(t));
      grads_of(*a, t);
      oa->step();
      grads_of(*b, t);
      if (kind == "sgd") {
        sgd_step(b->flat_params(), b->flat_grads(), Tensor(), SgdArgs{.lr = sched.at(t)}, Tensor());
      } else {
        const float bc1 = 1.0f - std::pow(0.9f, static_cast<float>(t + 1));
        const float bc2 = 1.0f - std::pow(0.999f, static_cast<float>(t + 1));
        adamw_step(b->flat_params(), b->flat_grads(), m1, v1,
                   AdamArgs{sched.at(t), 0.9f, 0.999f, 1e-8f, 0.01f, bc1, bc2}, Tensor());
      }
    }
    CHECK(oa->steps_taken() == 20);
    CHECK(a->flat_params().to_host() == b->flat_params().to_host());
    if (kind == "sgd") {  // stateless: a fresh optimizer told the count continues the schedule
      for (int t = 0; t < 12; ++t) {
        grads_of(*c, t);
        oc->step();
      }
      auto resumed = opt(*c);
      resumed->set_steps_taken(12);
      for (int t = 12; t < 20; ++t) {
        grads_of(*c, t);
        resumed->step();
      }
      CHECK(c->flat_params().to_host() == a->flat_params().to_host());
    }
  }
}

TEST_CASE("twin buffers: the alternating update gives checked_step's parameters, state and scales bit for bit",
          "[optim]") {
  // Twin buffers on against off, the same gradients: SGD with Nesterov momentum and
  // weight decay, SGD without momentum (no state), AdamW with a schedule; step 3's
  // gradients not finite (skipped by both). After each step the parameters live in the
  // other copy's memory and every parameter's view follows.
  const Device dev{DeviceType::cpu, 9};
  auto grads_of = [&](nn::Module& m, int t) {
    std::vector<float> g(static_cast<size_t>(m.flat_grads().numel()));
    for (size_t i = 0; i < g.size(); ++i) g[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(t));
    if (t == 3) g[g.size() / 2] = NAN;
    copy(m.flat_grads(), Tensor::from_host(g, m.flat_grads().shape(), dev));
  };
  for (std::string kind : {"sgd momentum", "sgd", "adamw"}) {
    INFO(kind);
    auto make = [&] {
      auto m = nn::mlp("6-10-3");
      m->to(dev, 4);
      return m;
    };
    auto opt = [&](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
      std::unique_ptr<optim::Optimizer> o;
      if (kind == "adamw") o = std::make_unique<optim::AdamW>(m, optim::AdamW::Options{.lr = 0.05f});
      else if (kind == "sgd") o = std::make_unique<optim::SGD>(m, optim::SGD::Options{.lr = 0.05f});
      else
        o = std::make_unique<optim::SGD>(
            m, optim::SGD::Options{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true});
      o->set_schedule({optim::Schedule::Kind::cosine, 0.05f, 2, 10});
      return o;
    };
    auto a = make(), b = make();
    auto twin = opt(*a), plain = opt(*b);
    twin->set_twin_buffers(true);
    CHECK(twin->twin_buffers());
    CHECK(twin->twin_bytes() == static_cast<int64_t>(a->flat_params().nbytes() * (kind == "sgd"     ? 1
                                                                                  : kind == "adamw" ? 3
                                                                                                    : 2)));
    auto state_of = [](const optim::Optimizer& o) {
      std::vector<float> all;
      for (const auto& [name, t] : o.state()) {
        const auto v = t.to_host();
        all.insert(all.end(), v.begin(), v.end());
      }
      return all;
    };
    for (int t = 0; t < 8; ++t) {
      INFO("step " << t);
      grads_of(*a, t);
      grads_of(*b, t);
      const void* before = a->flat_params().data();
      const float sa = twin->checked_step(0.0f).item(), sb = plain->checked_step(0.0f).item();
      CHECK(std::memcmp(&sa, &sb, sizeof sa) == 0);
      CHECK(std::isnan(sa) == (t == 3));
      CHECK(a->flat_params().data() != before);  // the other copy
      CHECK(a->parameters().front()->value.data() == a->flat_params().data());
      CHECK(a->flat_params().to_host() == b->flat_params().to_host());
      CHECK(state_of(*twin) == state_of(*plain));
    }
    CHECK(twin->steps_taken() == 8);
    // Only checked_step without clipping swaps the copies: the others refuse.
    CHECK_THROWS_AS(twin->step(), UsageError);
    CHECK_THROWS_AS(twin->checked_step(1.0f), UsageError);
    CHECK_THROWS_AS(twin->step_part(0, 4, true), UsageError);
    // A replay moves the device's count and not the host's: telling the host swaps the copies.
    const void* now = a->flat_params().data();
    twin->set_host_steps(9);
    CHECK(a->flat_params().data() != now);
    twin->set_host_steps(8);
    CHECK(a->flat_params().data() == now);
    // A resume to a count of the other parity keeps the values (in the copy that count reads).
    twin->set_steps_taken(11);
    plain->set_steps_taken(11);
    CHECK(a->flat_params().data() != now);
    CHECK(a->flat_params().to_host() == b->flat_params().to_host());
    CHECK(state_of(*twin) == state_of(*plain));
    grads_of(*a, 11);
    grads_of(*b, 11);
    twin->checked_step(0.0f);
    plain->checked_step(0.0f);
    CHECK(a->flat_params().to_host() == b->flat_params().to_host());
    twin->set_twin_buffers(false);
    CHECK(twin->twin_bytes() == 0);
    twin->step();  // in place again
  }
}

TEST_CASE("the bf16 shadow equals the masters rounded after every update", "[optim][bf16]") {
  auto m = nn::mlp("6-16x2-3", Act::gelu);
  m->set_compute_dtype(DType::bf16);
  CHECK_FALSE(m->flat_shadow().defined());  // nothing to shadow before to()
  m->to(host, 5);
  REQUIRE(m->compute_dtype() == DType::bf16);
  REQUIRE(shadow_current(*m));
  for (auto* p : m->parameters()) {  // views into the flat shadow, laid out as the masters
    REQUIRE(p->shadow.defined());
    CHECK(p->shadow.shape() == p->shape);
    CHECK(p->shadow.bf16() - m->flat_shadow().bf16() == p->value.f32() - m->flat_params().f32());
    CHECK(bf16_bits(p->shadow) == bf16_bits(p->value));
  }
  data::Synthetic d({.task = data::Task::regression, .in = 6, .out = 3, .seed = 3}, host);
  auto train = [&](optim::Optimizer& opt, int steps, const Tensor& scale = {}) {
    for (int s = 0; s < steps; ++s) {
      m->zero_grad();
      data::Batch b = d.batch(s * 8, 8);
      Tensor out = m->forward(b.x);
      REQUIRE(out.dtype() == DType::bf16);
      mse_loss(out, b.y).backward();
      opt.step(scale);
      REQUIRE(shadow_current(*m));
    }
  };
  SECTION("SGD with momentum, nesterov and weight decay") {
    optim::SGD opt(*m, {.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true});
    const auto before = m->flat_params().to_host();
    train(opt, 5);
    CHECK(m->flat_params().to_host() != before);
    // A skipped step (non-finite gradients) leaves both as they were.
    const auto kept = bf16_bits(m->flat_shadow());
    train(opt, 1, Tensor::full({1}, NAN, host));
    CHECK(bf16_bits(m->flat_shadow()) == kept);
  }
  SECTION("AdamW") {
    optim::AdamW opt(*m, {.lr = 0.01f});
    train(opt, 5);
  }
  SECTION("an optimizer made before bf16 was switched on still updates the shadow") {
    m->set_compute_dtype(DType::f32);
    CHECK_FALSE(m->flat_shadow().defined());
    CHECK(m->forward(d.batch(0, 4).x).dtype() == DType::f32);
    optim::SGD opt(*m, {.lr = 0.05f});
    m->set_compute_dtype(DType::bf16);
    REQUIRE(shadow_current(*m));
    train(opt, 3);
  }
  SECTION("replicas and refreshes") {
    optim::SGD opt(*m, {.lr = 0.05f});
    train(opt, 2);
    auto r = m->replicate({DeviceType::cpu, 1});
    CHECK(r->compute_dtype() == DType::bf16);
    CHECK(shadow_current(*r));
    CHECK(bf16_bits(r->flat_shadow()) == bf16_bits(m->flat_shadow()));
    // Masters written directly: the shadow is stale until refreshed.
    fill_(m->flat_params(), 0.3f);
    CHECK_FALSE(shadow_current(*m));
    m->refresh_shadow();
    CHECK(shadow_current(*m));
  }
  CHECK_THROWS_AS(m->set_compute_dtype(DType::i32), Error);
}

TEST_CASE("the fused optimizers write the shadow as a cast of their result", "[optim][bf16]") {
  const int64_t n = 1003;
  auto p = randn(n, 20), g = randn(n, 21), buf = randn(n, 22, 0.1f), v = randn(n, 23, 0.1f);
  for (auto& e : v) e *= e;
  std::vector<uint16_t> shadow(static_cast<size_t>(n), 0), want(static_cast<size_t>(n));
  auto p2 = p, buf2 = buf;
  cpu::sgd_step(p.data(), g.data(), buf.data(), n, SgdArgs{0.1f, 0.9f, 0.0f, 0.01f, true}, nullptr, shadow.data());
  cpu::sgd_step(p2.data(), g.data(), buf2.data(), n, SgdArgs{0.1f, 0.9f, 0.0f, 0.01f, true}, nullptr, nullptr);
  CHECK(p == p2);  // the shadow changes nothing else
  cpu::cast_f32_bf16(p.data(), want.data(), n);
  CHECK(shadow == want);
  auto m = buf;
  cpu::adamw_step(p.data(), g.data(), m.data(), v.data(), n, AdamArgs{0.01f, 0.9f, 0.999f, 1e-8f, 0.1f, 0.19f, 0.002f},
                  nullptr, shadow.data());
  cpu::cast_f32_bf16(p.data(), want.data(), n);
  CHECK(shadow == want);
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

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
  // The gradient check: the scale as clip_coef(sum_squares) gives it, and a record written
  // into mapped host memory with the first bad gradient, as the CPU finds it.
  compare([&](const Device& d) { return std::vector<Tensor>{check_gradients(on(d, g, {n}), 10.0f)}; });
  auto bad = randn(n, 17);
  bad[70001] = INFINITY;
  bad[99999] = NAN;
  bad[80000] = -INFINITY;
  auto huge = g;
  for (auto& e : huge) e *= 1e30f;  // finite values whose norm overflows
  PinnedBuffer slots(3 * sizeof(CheckRecord), gpu, /*mapped=*/true);
  std::memset(slots.data(), 0, slots.size());
  const CheckRing ring{static_cast<CheckRecord*>(slots.device_data()), 3, Tensor::zeros({2}, DType::i32, gpu)};
  const auto* rec = static_cast<const CheckRecord*>(slots.data());
  int64_t checks = 0;
  for (const auto* values : {&g, &bad, &huge, &bad, &g}) {
    for (float clip : {0.0f, 0.5f}) {
      INFO("check " << checks << " clip " << clip);
      const float c = check_gradients(on(host, *values, {n}), clip).to_host()[0];
      const float d = check_gradients(on(gpu, *values, {n}), clip, ring).to_host()[0];
      ++checks;
      const CheckRecord& r = rec[(checks - 1) % 3];
      CHECK(r.tag == checks);
      float recorded = 0;
      std::memcpy(&recorded, &r.scale_bits, 4);
      CHECK((std::isnan(c) ? std::isnan(d) && std::isnan(recorded) : std::fabs(c - d) <= 1e-6f * c && recorded == d));
      CHECK(r.index == (values == &bad ? 70001 : values == &huge ? INT32_MAX : -1));
    }
  }
  CHECK(ring.count.to_host_i32()[0] == checks);
  // ZeRO's halves: a shard's part (its sum, base + its first bad index) and the check from
  // the parts, as the CPU makes them.
  for (const auto* values : {&g, &bad}) {
    auto part = [&](const Device& d) {
      Tensor sum = Tensor::zeros({1}, DType::f32, d), first = Tensor::zeros({2}, DType::i32, d);
      shard_check(on(d, *values, {n}).view(60000, {30000}), 60000, sum, first);
      const auto f = first.to_host_i32();
      int64_t index = 0;
      std::memcpy(&index, f.data(), 8);
      return std::pair<float, int64_t>{sum.to_host()[0], index};
    };
    const auto c = part(host), d = part(gpu);
    CHECK((c.first == d.first || std::fabs(c.first - d.first) <= 1e-6f * c.first));  // equal when not finite
    CHECK(c.second == d.second);
    CHECK(c.second == (values == &bad ? 70001 : INT64_MAX));
  }
  const Tensor sum = Tensor::from_host(std::vector<float>{4.0f}, {1}, gpu);
  const Tensor first = Tensor::from_host_i32({-1, INT32_MAX}, {2}, gpu);  // INT64_MAX's halves
  CHECK(finish_check(sum, first, 1.0f, ring).to_host()[0] == 1.0f / (2.0f + 1e-6f));
  const CheckRecord& last = rec[checks % 3];
  CHECK(last.tag == checks + 1);
  CHECK(last.index == -1);
  // Casts and argmax are exact.
  auto x = randn(n, 16, 100.0f);
  x[5] = NAN;
  auto cpu_bits = cast(on(host, x, {n}), DType::bf16), gpu_bits = cast(on(gpu, x, {n}), DType::bf16);
  auto a = cast(cpu_bits, DType::f32).to_host(), b = cast(gpu_bits, DType::f32).to_host();
  CHECK(std::isnan(b[5]));
  a[5] = b[5] = 0;
  CHECK(a == b);
  auto scores = randn(513 * 37, 17);
  CHECK(argmax_rows(on(host, scores, {513, 37})).to_host_i32() ==
        argmax_rows(on(gpu, scores, {513, 37})).to_host_i32());
}

TEST_CASE("updates with a step counter follow the schedule as on the CPU and move it on once a step",
          "[gpu][ops][optim]") {
  // Many blocks (the last one moves the counter), one, and none (an empty ZeRO shard).
  const ScheduleArgs cosine{2, 0.05f, 2, 6};
  for (int64_t n : {int64_t{300001}, int64_t{5}, int64_t{0}}) {
    INFO("n " << n);
    const auto p = randn(n, 40), g = randn(n, 41);
    for (bool adam : {false, true}) {
      INFO((adam ? "adamw" : "sgd"));
      auto run = [&](const Device& d) {
        // Views of one more element, as a shard of a flat buffer (n = 0 allocates nothing).
        auto shard = [&](const std::vector<float>& v) {
          std::vector<float> padded(v);
          padded.push_back(7.0f);
          return on(d, padded, {n + 1}).view(0, {n});
        };
        const std::vector<float> zeros(static_cast<size_t>(n), 0.0f);
        Tensor P = shard(p), G = shard(g), M = shard(zeros), V = shard(zeros), scale = Tensor::full({1}, 1.0f, d);
        const StepCounter step{Tensor::zeros({4}, DType::i32, d), cosine, 0.9f, 0.999f};
        for (int s = 0; s < 5; ++s) {
          if (s == 3) fill_(scale, NAN);  // a skipped step still counts
          else fill_(scale, 1.0f);
          if (adam) adamw_step(P, G, M, V, AdamArgs{}, scale, Tensor(), &step);
          else sgd_step(P, G, M, SgdArgs{.lr = 1.0f, .momentum = 0.9f}, scale, Tensor(), &step);
        }
        return std::pair<std::vector<float>, std::vector<int32_t> >{P.to_host(), step.counter.to_host_i32()};
      };
      const auto c = run(host), d = run(gpu);
      CHECK(d.second == std::vector<int32_t>{5, 0, 0, 0});  // 5 steps, the block count back at 0
      CHECK(c.second == d.second);
      CHECK(rel_error(d.first, c.first) <= 1e-6);
    }
  }
}

TEST_CASE("the checked update (one launch where it fits) gives the check and the update bit for bit",
          "[gpu][ops][optim]") {
  // Sizes the fused kernel takes holding the buffers in registers (one block, 74 blocks),
  // and on an H200 with a second pass (513 blocks, too many to hold), one past a million
  // blocks' worth of threads that it may not take; a non-finite gradient at step 3
  // (skipped, recorded); clipping and none; SGD with Nesterov momentum and without (no
  // buffer read), with weight decay, AdamW, with a schedule; each with a bf16 shadow. Without clipping and with a
  // backup the update runs speculatively (up to 4M elements, the odd sizes' scalar tails
  // too) and puts the parameters, state and shadow back at the non-finite step. Without
  // clipping, the alternating update (twin buffers, any size) writes the other copy, the
  // copies swapped after each step.
  const ScheduleArgs cosine{2, 0.05f, 2, 6};
  for (int64_t n : {int64_t{5}, int64_t{300001}, (int64_t{1} << 21) + 3, int64_t{1} << 24}) {
    // The host's values once a size (16M normal draws take the host seconds; each run below
    // used to draw its own, most of this test's time).
    const auto p = randn(n, 50), g_values = randn(n, 52);
    auto bad = randn(n, 51);
    bad[static_cast<size_t>(n / 2)] = NAN;
    for (const float momentum : {0.9f, 0.0f, -1.0f})  // -1: AdamW
      for (float clip : {0.0f, 0.5f}) {
        const bool adam = momentum < 0.0f;
        const int buffers = adam ? 3 : momentum != 0.0f ? 2 : 1;
        INFO("n " << n << (adam ? " adamw" : " sgd momentum ") << (adam ? 0.0f : momentum) << " clip " << clip);
        enum Mode { two_launches, checked, with_backup, alternating };
        auto run = [&](Mode mode) {
          const Tensor P = on(gpu, p, {n}), M = Tensor::zeros({n}, DType::f32, gpu),
                       V = Tensor::zeros({n}, DType::f32, gpu);
          const Tensor P2 = Tensor::empty({n}, DType::f32, gpu), M2 = Tensor::empty({n}, DType::f32, gpu),
                       V2 = Tensor::empty({n}, DType::f32, gpu);
          const Tensor S = cast(P, DType::bf16);
          const Tensor G = on(gpu, g_values, {n}), B = on(gpu, bad, {n});
          const StepCounter step{Tensor::zeros({4}, DType::i32, gpu), cosine, 0.9f, 0.999f};
          const int64_t backup_size = checked_update_backup_size(P, buffers, clip);
          CHECK(backup_size == (clip == 0.0f && n <= (int64_t{1} << 22) ? buffers * ((n + 3) / 4 * 4) : 0));
          // Made by a memset, as the contract of the backup asks (its writes start early).
          const Tensor backup =
              mode == with_backup && backup_size > 0 ? Tensor::zeros({backup_size}, DType::f32, gpu) : Tensor();
          PinnedBuffer records(sizeof(CheckRecord) * 8, gpu, /*mapped=*/true);
          std::memset(records.data(), 0, records.size());
          const CheckRing ring{static_cast<CheckRecord*>(records.device_data()), 8,
                               Tensor::zeros({2}, DType::i32, gpu)};
          std::vector<float> scales;
          for (int s = 0; s < 5; ++s) {
            const Tensor& g = s == 3 ? B : G;
            Tensor scale;
            const SgdArgs sa{.lr = 1.0f,
                             .momentum = adam ? 0.0f : momentum,
                             .weight_decay = 0.01f,
                             .nesterov = !adam && momentum != 0.0f};
            if (mode == alternating) {
              const bool mom = !adam && momentum != 0.0f;
              scale =
                  adam ? alternating_adamw_step(P, g, M, V, P2, M2, V2, AdamArgs{}, ring, S, step, s)
                       : alternating_sgd_step(P, g, mom ? M : Tensor(), P2, mom ? M2 : Tensor(), sa, ring, S, step, s);
              P.swap_memory(P2);  // the state after the step is in the copies written
              if (adam || mom) M.swap_memory(M2);
              if (adam) V.swap_memory(V2);
            } else if (mode != two_launches) {
              scale = adam ? checked_adamw_step(P, g, M, V, AdamArgs{}, clip, ring, S, step, backup)
                           : checked_sgd_step(P, g, M, sa, clip, ring, S, step, backup);
            } else {
              scale = check_gradients(g, clip, ring);
              if (adam) adamw_step(P, g, M, V, AdamArgs{}, scale, S, &step);
              else sgd_step(P, g, M, sa, scale, S, &step);
            }
            scales.push_back(scale.item());
          }
          context(gpu).synchronize();
          std::vector<unsigned char> rec(records.size());
          std::memcpy(rec.data(), records.data(), rec.size());
          auto counter = step.counter.to_host_i32();
          counter.resize(3);  // the count and the block count (the fourth word is the barrier's)
          std::vector<float> state = M.to_host(), v = V.to_host(), shadow = cast(S, DType::f32).to_host();
          state.insert(state.end(), v.begin(), v.end());
          state.insert(state.end(), shadow.begin(), shadow.end());
          return std::tuple{P.to_host(), state, scales, rec, counter};
        };
        const auto [p2, m2, s2, r2, c2] = run(two_launches);
        for (Mode mode : {checked, with_backup, alternating}) {
          if (mode == alternating && clip != 0.0f) continue;
          INFO((mode == checked ? "checked" : mode == with_backup ? "checked with a backup" : "alternating"));
          const auto [p1, m1, s1, r1, c1] = run(mode);
          CHECK(std::memcmp(p1.data(), p2.data(), p1.size() * sizeof(float)) == 0);
          CHECK(std::memcmp(m1.data(), m2.data(), m1.size() * sizeof(float)) == 0);
          CHECK(std::memcmp(s1.data(), s2.data(), s1.size() * sizeof(float)) == 0);
          CHECK(std::isnan(s1[3]));
          CHECK(r1 == r2);
          CHECK(c1 == std::vector<int32_t>{5, 0, 0});
          CHECK(c1 == c2);
        }
      }
  }
}

TEST_CASE("an alternating update recorded in a graph reads the copy that the counter's parity names",
          "[gpu][graph][optim]") {
  // One recording, replayed five times with new gradients, the host swapping the copies
  // after each replay as the optimizer does, against the check and the update in place:
  // each replay reads the copy that the one before wrote; step 3's gradients are not
  // finite (skipped: the other copy gets the current one).
  const int64_t n = 300001;
  const ScheduleArgs cosine{2, 0.05f, 2, 6};
  const SgdArgs sa{.lr = 1.0f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true};
  std::vector<Tensor> grads;
  for (int s = 0; s < 5; ++s) {
    auto g = randn(n, 81 + s);
    if (s == 3) g[static_cast<size_t>(n / 3)] = NAN;
    grads.push_back(on(gpu, g, {n}));
  }
  for (bool adam : {false, true}) {
    INFO((adam ? "adamw" : "sgd"));
    const auto p = randn(n, 80);
    const Tensor P = on(gpu, p, {n}), M = Tensor::zeros({n}, DType::f32, gpu), V = Tensor::zeros({n}, DType::f32, gpu);
    const Tensor S = cast(P, DType::bf16);
    const StepCounter step{Tensor::zeros({4}, DType::i32, gpu), cosine, 0.9f, 0.999f};
    for (const Tensor& g : grads) {
      const Tensor scale = check_gradients(g, 0.0f);
      if (adam) adamw_step(P, g, M, V, AdamArgs{}, scale, S, &step);
      else sgd_step(P, g, M, sa, scale, S, &step);
    }
    const Tensor Q = on(gpu, p, {n}), Qm = Tensor::zeros({n}, DType::f32, gpu),
                 Qv = Tensor::zeros({n}, DType::f32, gpu);
    const Tensor Q2 = Tensor::empty({n}, DType::f32, gpu), Qm2 = Tensor::empty({n}, DType::f32, gpu),
                 Qv2 = Tensor::empty({n}, DType::f32, gpu);
    const Tensor QS = cast(Q, DType::bf16), G = Tensor::empty({n}, DType::f32, gpu);
    const StepCounter qstep{Tensor::zeros({4}, DType::i32, gpu), cosine, 0.9f, 0.999f};
    Graph graph(context(gpu));
    graph.begin();
    if (adam) alternating_adamw_step(Q, G, Qm, Qv, Q2, Qm2, Qv2, AdamArgs{}, {}, QS, qstep, 0);
    else alternating_sgd_step(Q, G, Qm, Q2, Qm2, sa, {}, QS, qstep, 0);
    graph.end();
    for (const Tensor& g : grads) {
      copy(G, g);
      graph.launch();
      Q.swap_memory(Q2);
      Qm.swap_memory(Qm2);
      if (adam) Qv.swap_memory(Qv2);
    }
    CHECK(Q.to_host() == P.to_host());
    CHECK(Qm.to_host() == M.to_host());
    if (adam) CHECK(Qv.to_host() == V.to_host());
    CHECK(test::bf16_bits(QS) == test::bf16_bits(S));
    CHECK(qstep.counter.to_host_i32()[0] == 5);
  }
}

TEST_CASE("twin buffers by default on a GPU from 2M parameters up to 67M, one copy outside", "[gpu][graph]") {
  // The flat buffer (each parameter's start aligned to 64) holds 2,101,312, 2,052,160,
  // 67,076,160 and 67,141,696 elements.
  for (const auto& [spec, inside] : {std::pair<std::string, bool>{"1024-2048-1", true},
                                     {"1024-2000-1", false},
                                     {"4096-16368-1", true},
                                     {"4096-16384-1", false}}) {
    INFO(spec);
    TrainConfig c = quiet_config(spec, "sgd", 8);
    c.steps = 1;
    c.devices = {gpu};
    Trainer t(c);
    REQUIRE(twins_by_default(t.model().flat_params().numel()) == inside);
    CHECK(t.optimizer().twin_buffers() == inside);
    c.parallel.twin_buffers = TwinBuffers::off;
    CHECK_FALSE(Trainer(c).optimizer().twin_buffers());
  }
}

TEST_CASE("twin buffers train bit for bit as one copy, eager and as a CUDA graph, bf16 and fp32",
          "[gpu][graph][bf16]") {
  for (Precision p : {Precision::bf16, Precision::fp32})
    for (std::string opt : {"sgd", "adamw"})
      for (bool graph : {false, true}) {
        INFO(precision_name(p) << ", " << opt << (graph ? ", graph" : ", eager"));
        TrainConfig c;
        c.model = "24-48x2-6";
        c.batch = 32;
        c.steps = 25;
        c.log_every = 1000;
        c.devices = {gpu};
        c.optimizer = opt;
        c.lr = opt == "sgd" ? 0.05f : 0.003f;
        c.momentum = 0.9f;
        c.schedule = "cosine";
        c.parallel.precision = p;
        c.parallel.cuda_graph = graph;
        c.parallel.twin_buffers = TwinBuffers::off;
        Trainer one(c);
        one.run();
        CHECK_FALSE(one.optimizer().twin_buffers());
        c.parallel.twin_buffers = TwinBuffers::on;
        Trainer two(c);
        for (int64_t s = 0; s < 3; ++s) two.step(s);  // as a graph: eager, recorded for each parity
        two.run();
        CHECK(two.optimizer().twin_buffers());
        CHECK(two.model().flat_params().to_host() == one.model().flat_params().to_host());
        if (p == Precision::bf16)
          CHECK(test::bf16_bits(two.model().flat_shadow()) == test::bf16_bits(one.model().flat_shadow()));
      }
}

TEST_CASE("a graph's recorded copy reads the sources that each launch names", "[gpu][graph]") {
  // x and y as a step's inputs: copied into fixed buffers by the graph, then read by the
  // rest of it (here a copy out). A launch already queued keeps the sources it was given.
  const int64_t n = 1001;
  std::vector<Tensor> xs, ys;
  for (int k = 0; k < 3; ++k) {
    xs.push_back(on(gpu, randn(n, 60 + k), {n}));
    ys.push_back(on(gpu, randn(7, 70 + k), {7}));
  }
  const Tensor x = Tensor::empty({n}, DType::f32, gpu), y = Tensor::empty({7}, DType::f32, gpu);
  const Tensor out = Tensor::empty({n + 7}, DType::f32, gpu);
  Graph g(context(gpu));
  CHECK_THROWS_AS(g.copy_in({{x, xs[0]}}), Error);  // not recording
  g.begin();
  const size_t c = g.copy_in({{x, xs[0]}, {y, ys[0]}});
  copy_all({{out.view(0, {n}), x}, {out.view(n, {7}), y}});
  g.end();
  std::vector<Tensor> seen;
  for (int k : {1, 0, 2, 2}) {
    g.set_copy_sources(c, {{x, xs[static_cast<size_t>(k)]}, {y, ys[static_cast<size_t>(k)]}});
    g.launch();
    seen.push_back(Tensor::empty({n + 7}, DType::f32, gpu));
    copy(seen.back(), out);  // queued after the launch, before the next one
  }
  int at = 0;
  for (int k : {1, 0, 2, 2}) {
    const auto got = seen[static_cast<size_t>(at++)].to_host();
    auto want = xs[static_cast<size_t>(k)].to_host();
    const auto wy = ys[static_cast<size_t>(k)].to_host();
    want.insert(want.end(), wy.begin(), wy.end());
    CHECK(got == want);
  }
  // The destinations and sizes stay as recorded.
  CHECK_THROWS_AS(g.set_copy_sources(c, {{y, ys[0]}, {x, xs[0]}}), Error);
  CHECK_THROWS_AS(g.set_copy_sources(c, {{x, xs[0]}}), Error);
  CHECK_THROWS_AS(g.set_copy_sources(c + 1, {{x, xs[0]}, {y, ys[0]}}), Error);
}

TEST_CASE("the fused optimizers write the bf16 shadow on the GPU as on the CPU", "[gpu][ops][bf16]") {
  const int64_t n = 100003;  // not a multiple of 4: the vector loops' tails
  auto p = randn(n, 12), g = randn(n, 13), m = randn(n, 14, 0.1f);
  auto v = randn(n, 15, 0.1f);
  for (auto& e : v) e = e * e;
  compare_bf16(
      [&](const Device& d) {
        Tensor P = on(d, p, {n}), G = on(d, g, {n}), M = on(d, m, {n});
        Tensor S = Tensor::zeros({n}, DType::bf16, d);
        sgd_step(P, G, M, SgdArgs{0.1f, 0.9f, 0.0f, 0.01f, true}, Tensor(), S);
        CHECK(test::bf16_bits(S) == test::bf16_bits(P));  // exactly the cast of the result
        return std::vector<Tensor>{P, M, S};
      },
      1);
  compare_bf16(
      [&](const Device& d) {
        Tensor P = on(d, p, {n}), G = on(d, g, {n}), M = on(d, m, {n}), V = on(d, v, {n});
        Tensor S = Tensor::zeros({n}, DType::bf16, d);
        adamw_step(P, G, M, V, AdamArgs{0.01f, 0.9f, 0.999f, 1e-8f, 0.1f, 0.19f, 0.002f}, Tensor(), S);
        CHECK(test::bf16_bits(S) == test::bf16_bits(P));
        return std::vector<Tensor>{P, M, V, S};
      },
      1);
}

#endif  // DPT_GPU_TESTS
