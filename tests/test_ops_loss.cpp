// Losses and accuracy on the CPU: cross-entropy and mse against their definitions and finite
// differences, fp32 and bf16. Their CUDA twins are compared with these in
// test_ops_linear.cpp ("linear, activations and losses match the CPU").

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>

#include <dptrain/error.hpp>
#include <dptrain/layers/conv.hpp>
#include "catch.hpp"
#include "common.hpp"
#include "kernels/cpu/cpu.hpp"
#include "runtime/allocator.hpp"

using namespace dpt;
using namespace dpt::test;

TEST_CASE("cross-entropy gradient matches finite differences", "[ops][grad]") {
  Tensor logits = randn_tensor({5, 7}, 7, host, 2.0f);
  Tensor labels = Tensor::from_host_i32({0, 6, 3, 3, 1}, {5}, host);
  logits.set_requires_grad(true);
  cross_entropy(logits, labels).backward();
  auto loss = [&] {
    NoGradGuard g;
    return cross_entropy(logits, labels).item();
  };
  CHECK(rel_error(logits.grad().to_host(), numeric_grad(logits, loss)) < 2e-3);
}

TEST_CASE("cross-entropy is stable for large logits and matches its definition", "[ops]") {
  Tensor logits = Tensor::from_host({1000.0f, 0.0f, -1000.0f, 3.0f, 3.0f, 3.0f}, {2, 3}, host);
  Tensor labels = Tensor::from_host_i32({0, 2}, {2}, host);
  const float l = cross_entropy(logits, labels).item();
  CHECK(std::fabs(l - 0.5 * std::log(3.0)) < 1e-6);
}

TEST_CASE("accuracy counts rows whose first largest logit is the label; NaN never wins", "[ops]") {
  Tensor logits = Tensor::from_host({1, 3, 2,             // row 0: 1 is largest
                                     5, 5, 0,             // row 1: a tie, the first (0) wins
                                     NAN, 0, -1,          // row 2: NaN skipped, 1 is largest
                                     NAN, NAN, NAN,       // row 3: no largest logit: wrong
                                     -INFINITY, -7, -7},  // row 4: the first -7 (1) wins
                                    {5, 3}, host);
  auto acc = [&](std::vector<int32_t> labels) {
    return accuracy(logits, Tensor::from_host_i32(labels, {5}, host)).item();
  };
  CHECK(acc({1, 0, 1, 0, 1}) == 0.8f);
  CHECK(acc({1, 1, 1, 0, 2}) == 0.4f);
  CHECK(acc({0, 2, 0, 1, 0}) == 0.0f);
  CHECK(accuracy(cast(logits, DType::bf16), Tensor::from_host_i32({1, 0, 1, 0, 1}, {5}, host)).item() == 0.8f);
  CHECK_THROWS_AS(accuracy(logits, Tensor::from_host_i32({1, 0}, {2}, host)), Error);
}

TEST_CASE("mse loss and its gradient match the definition", "[ops]") {
  Tensor y = Tensor::from_host({1, 2, 3, 4}, {2, 2}, host).set_requires_grad(true);
  Tensor t = Tensor::from_host({0, 2, 5, 4}, {2, 2}, host);
  Tensor l = mse_loss(y, t);
  CHECK(l.item() == 1.25f);  // (1 + 0 + 4 + 0) / 4, exact in binary
  l.backward();
  CHECK(y.grad().to_host() == std::vector<float>{0.5f, 0.0f, -1.0f, 0.0f});
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
  // The loss of bf16 values is the loss of them as f32; their bf16 gradient is within 1e-2
  // of central differences.
  auto check_bf16_loss = [&](Tensor& y16, const std::function<Tensor(const Tensor&)>& loss_of) {
    Tensor loss = loss_of(y16);
    CHECK(loss.item() == loss_of(cast(y16.detach(), DType::f32)).item());
    loss.backward();
    REQUIRE(y16.grad().dtype() == DType::bf16);
    auto f = [&] {
      NoGradGuard g;
      return loss_of(y16).item();
    };
    const double e = rel_error(y16.grad().to_host(), fd(y16, f, 1.0f / 64));
    INFO("relative error " << e);
    CHECK(e < 1e-2);
  };
  SECTION("mse") {
    Tensor y16 = cast(Tensor::from_host(grid(24, 10, 1.0f), {4, 6}, host), DType::bf16).set_requires_grad(true);
    Tensor t = randn_tensor({4, 6}, 11, host);
    check_bf16_loss(y16, [&](const Tensor& y) { return mse_loss(y, t); });
    // The gradient is 2 (y - t) / n rounded once.
    std::vector<float> want(24);
    const auto yv = y16.to_host(), tv = t.to_host();
    for (size_t i = 0; i < 24; ++i) want[i] = bf16_float(bf16_round(2.0f / 24.0f * (yv[i] - tv[i])));
    CHECK(y16.grad().to_host() == want);
  }
  SECTION("cross-entropy") {
    Tensor l16 = cast(Tensor::from_host(grid(35, 12, 2.0f), {5, 7}, host), DType::bf16).set_requires_grad(true);
    Tensor labels = Tensor::from_host_i32({0, 6, 3, 3, 1}, {5}, host);
    check_bf16_loss(l16, [&](const Tensor& logits) { return cross_entropy(logits, labels); });
  }
}
