// bf16 storage on the CPU (the oracle): the bf16 linear, activations and losses against
// the fp32 ops within bf16 precision and against their definition (fp32 arithmetic on
// bf16 values, each stored value rounded once), loss gradients against finite
// differences, the bf16 shadow of the master weights after every kind of update, and a
// bf16 training run against the fp32 one.
#include <cmath>
#include <cstring>

#include <dptrain/error.hpp>
#include <dptrain/layers/conv.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/train/trainer.hpp>
#include "catch.hpp"
#include "common.hpp"

using namespace dpt;
using test::bf16_bits;
using test::randn;
using test::randn_tensor;
using test::rel_error;

namespace {
const Device host{DeviceType::cpu, 0};

// t rounded to bf16 and back: the values a bf16 tensor made from t holds, as f32.
Tensor rounded(const Tensor& t) { return cast(cast(t.detach(), DType::bf16), DType::f32); }

// Whether the module's shadow is bitwise its master parameters rounded to bf16.
bool shadow_current(const nn::Module& m) {
  return m.flat_shadow().defined() && bf16_bits(m.flat_shadow()) == bf16_bits(m.flat_params());
}
}  // namespace

TEST_CASE("bf16 linear equals the fp32 linear on bf16-rounded operands, rounded once", "[ops][bf16]") {
  for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh})
    for (bool bias : {true, false}) {
      INFO(nn::act_name(act) << (bias ? " with bias" : " without bias"));
      Tensor x = randn_tensor({37, 29}, 1, host), W = randn_tensor({23, 29}, 2, host, 0.3f);
      Tensor b = bias ? randn_tensor({23}, 3, host) : Tensor();
      Tensor y =
          linear_bf16(cast(x, DType::bf16), W, b, cast(W, DType::bf16), bias ? cast(b, DType::bf16) : Tensor(), act);
      REQUIRE(y.dtype() == DType::bf16);
      // The definition: fp32 arithmetic on the bf16 values, the result rounded once.
      Tensor want = linear(rounded(x), rounded(W), bias ? rounded(b) : Tensor(), act);
      CHECK(bf16_bits(y) == bf16_bits(want));
    }
}

TEST_CASE("bf16 linear matches the fp32 linear within bf16 precision, forward and backward", "[ops][bf16]") {
  for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh}) {
    INFO(nn::act_name(act));
    const auto xv = randn(37 * 29, 4), Wv = randn(23 * 29, 5, 0.3f), bv = randn(23, 6), tv = randn(37 * 23, 7);
    Tensor t = Tensor::from_host(tv, {37, 23}, host);
    // fp32
    Tensor x = Tensor::from_host(xv, {37, 29}, host).set_requires_grad(true);
    Tensor W = Tensor::from_host(Wv, {23, 29}, host).set_requires_grad(true);
    Tensor b = Tensor::from_host(bv, {23}, host).set_requires_grad(true);
    Tensor y = linear(x, W, b, act);
    mse_loss(y, t).backward();
    // bf16: fp32 masters W and b, their bf16 copies, an f32 input cast on the way in.
    Tensor x2 = Tensor::from_host(xv, {37, 29}, host).set_requires_grad(true);
    Tensor W2 = Tensor::from_host(Wv, {23, 29}, host).set_requires_grad(true);
    Tensor b2 = Tensor::from_host(bv, {23}, host).set_requires_grad(true);
    Tensor y2 =
        linear_bf16(cast(x2, DType::bf16), W2, b2, cast(W2.detach(), DType::bf16), cast(b2.detach(), DType::bf16), act);
    mse_loss(y2, t).backward();
    REQUIRE(x2.grad().dtype() == DType::f32);  // the cast's gradient comes back as f32
    REQUIRE(W2.grad().dtype() == DType::f32);  // the masters' gradients are fp32
    const double ey = rel_error(y2.to_host(), y.to_host());
    INFO("y " << ey);
    CHECK(ey < 1e-2);
    CHECK(ey > 1e-5);  // it really ran in bf16
    for (auto [got, want, what] : {std::tuple{&x2, &x, "dx"}, std::tuple{&W2, &W, "dW"}, std::tuple{&b2, &b, "db"}}) {
      const double e = rel_error(got->grad().to_host(), want->grad().to_host());
      INFO(what << " relative error " << e);
      CHECK(e < 2e-2);
    }
  }
}

TEST_CASE("bf16 activations match fp32 within bf16 precision and round once", "[ops][bf16]") {
  for (Act act : {Act::relu, Act::gelu, Act::tanh, Act::none}) {
    INFO(nn::act_name(act));
    const auto xv = randn(200, 8);
    Tensor x = Tensor::from_host(xv, {10, 20}, host).set_requires_grad(true);
    Tensor x2 = Tensor::from_host(xv, {10, 20}, host);
    Tensor x16 = cast(x2, DType::bf16).detach().set_requires_grad(true);
    Tensor y = activation(x, act), y16 = activation(x16, act);
    REQUIRE(y16.dtype() == DType::bf16);
    CHECK(bf16_bits(y16) == bf16_bits(activation(rounded(x2), act)));
    Tensor t = randn_tensor({10, 20}, 9, host);
    mse_loss(y, t).backward();
    mse_loss(y16, t).backward();
    REQUIRE(x16.grad().dtype() == DType::bf16);
    CHECK(rel_error(y16.to_host(), y.to_host()) < 1e-2);
    const double e = rel_error(x16.grad().to_host(), x.grad().to_host());
    INFO("gradient relative error " << e);
    CHECK(e < 2e-2);
  }
}

TEST_CASE("bf16 losses: fp32 loss, bf16 gradients, against finite differences", "[ops][bf16][grad]") {
  // Values k / 64 and steps of 1 / 64 are exact in bf16, so the perturbed inputs are the
  // ones the loss sees. MSE is quadratic: central differences are exact up to fp32 loss
  // rounding; cross-entropy's are O(eps^2).
  auto grid = [](int64_t n, uint64_t seed, float scale) {
    auto v = randn(n, seed, scale);
    for (float& e : v) e = std::round(e * 64.0f) / 64.0f;
    return v;
  };
  auto fd = [](Tensor& y16, const std::function<float()>& loss, float eps) {
    std::vector<float> g(static_cast<size_t>(y16.numel()));
    for (int64_t i = 0; i < y16.numel(); ++i) {
      uint16_t* p = y16.bf16() + i;
      const uint16_t keep = *p;
      *p = bf16_round(bf16_float(keep) + eps);
      const double up = loss();
      *p = bf16_round(bf16_float(keep) - eps);
      const double down = loss();
      *p = keep;
      g[static_cast<size_t>(i)] = static_cast<float>((up - down) / (2.0 * eps));
    }
    return g;
  };
  SECTION("mse") {
    Tensor y16 = cast(Tensor::from_host(grid(24, 10, 1.0f), {4, 6}, host), DType::bf16).set_requires_grad(true);
    Tensor t = randn_tensor({4, 6}, 11, host);
    Tensor loss = mse_loss(y16, t);
    CHECK(loss.item() == mse_loss(cast(y16.detach(), DType::f32), t).item());
    loss.backward();
    REQUIRE(y16.grad().dtype() == DType::bf16);
    auto f = [&] {
      NoGradGuard g;
      return mse_loss(y16, t).item();
    };
    const double e = rel_error(y16.grad().to_host(), fd(y16, f, 1.0f / 64));
    INFO("relative error " << e);
    CHECK(e < 1e-2);
    // The gradient is 2 (y - t) / n rounded once.
    std::vector<float> want(24);
    const auto yv = y16.to_host(), tv = t.to_host();
    for (size_t i = 0; i < 24; ++i) want[i] = bf16_float(bf16_round(2.0f / 24.0f * (yv[i] - tv[i])));
    CHECK(y16.grad().to_host() == want);
  }
  SECTION("cross-entropy") {
    Tensor l16 = cast(Tensor::from_host(grid(35, 12, 2.0f), {5, 7}, host), DType::bf16).set_requires_grad(true);
    Tensor labels = Tensor::from_host_i32({0, 6, 3, 3, 1}, {5}, host);
    Tensor loss = cross_entropy(l16, labels);
    CHECK(loss.item() == cross_entropy(cast(l16.detach(), DType::f32), labels).item());
    loss.backward();
    REQUIRE(l16.grad().dtype() == DType::bf16);
    auto f = [&] {
      NoGradGuard g;
      return cross_entropy(l16, labels).item();
    };
    const double e = rel_error(l16.grad().to_host(), fd(l16, f, 1.0f / 64));
    INFO("relative error " << e);
    CHECK(e < 1e-2);
  }
}

TEST_CASE("bf16 gradients meeting at one tensor are added in fp32 and rounded once", "[ops][bf16][autograd]") {
  Tensor x = cast(randn_tensor({3, 5}, 13, host), DType::bf16).set_requires_grad(true);
  Tensor t = randn_tensor({3, 5}, 14, host);
  // Each path's gradient alone, then both into one leaf (the second backward accumulates).
  auto grad_of = [&](Act act) {
    Tensor x1 = x.detach().set_requires_grad(true);
    mse_loss(activation(x1, act), t).backward();
    return x1.grad().to_host();
  };
  const auto ga = grad_of(Act::tanh), gb = grad_of(Act::relu);
  mse_loss(activation(x, Act::tanh), t).backward();
  mse_loss(activation(x, Act::relu), t).backward();
  std::vector<float> want(ga.size());
  for (size_t i = 0; i < ga.size(); ++i) want[i] = bf16_float(bf16_round(ga[i] + gb[i]));
  CHECK(x.grad().dtype() == DType::bf16);
  CHECK(x.grad().to_host() == want);
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

TEST_CASE("30 bf16 training steps follow the fp32 loss curve", "[train][bf16]") {
  for (std::string model : {"16-64x2-4", "cnn:2x6x6-c4k3-p2-f8-f3"}) {
    INFO(model);
    TrainConfig c;
    c.model = model;
    c.batch = 32;
    c.steps = 30;
    c.lr = 0.05f;
    c.log_every = 1000;
    c.devices = {host};
    Trainer f32(c);
    c.parallel.precision = Precision::bf16;
    Trainer bf(c);
    REQUIRE(bf.model().compute_dtype() == DType::bf16);
    REQUIRE(f32.model().compute_dtype() == DType::f32);
    float first = 0, last32 = 0, last16 = 0;
    for (int64_t s = 0; s < c.steps; ++s) {
      const float a = f32.step(s).value(), b = bf.step(s).value();
      INFO("step " << s << ": fp32 " << a << ", bf16 " << b);
      CHECK(std::fabs(a - b) <= 0.03f * std::fabs(a));
      if (s == 0) first = a;
      last32 = a;
      last16 = b;
    }
    CHECK(last16 < 0.9f * first);  // it learns
    INFO("final losses " << last32 << " " << last16);
    const double e = rel_error(bf.model().flat_params().to_host(), f32.model().flat_params().to_host());
    INFO("weights relative error " << e);
    CHECK(e > 1e-6);  // bf16 really computed differently
    CHECK(e < 2e-2);
  }
}
