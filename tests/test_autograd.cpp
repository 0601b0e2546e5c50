// The autograd engine on the CPU: accumulation, no-grad, a tensor used twice (fp32 and
// bf16), leaf hooks, saved activations freed as backward passes.

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

TEST_CASE("gradients accumulate across backward calls and no-grad records nothing", "[autograd]") {
  Tensor W = randn_tensor({3, 4}, 8, host).set_requires_grad(true);
  Tensor x = randn_tensor({2, 4}, 9, host);
  Tensor t = randn_tensor({2, 3}, 10, host);
  mse_loss(linear(x, W, Tensor()), t).backward();
  const auto once = W.grad().to_host();
  mse_loss(linear(x, W, Tensor()), t).backward();
  auto twice = W.grad().to_host();
  for (auto& v : twice) v *= 0.5f;
  CHECK(rel_error(twice, once) < 1e-6);
  {
    NoGradGuard g;
    CHECK_FALSE(linear(x, W, Tensor()).requires_grad());
  }
  CHECK(linear(x, W, Tensor()).requires_grad());
}

TEST_CASE("a tensor used twice gets the sum of both gradients", "[autograd]") {
  // loss = mse(x @ W1 + (x @ W1) @ W2 ...) exercises a node whose output feeds two consumers.
  Tensor x = randn_tensor({3, 4}, 11, host);
  Tensor W = randn_tensor({4, 4}, 12, host, 0.5f);
  check_gradients(
      [&] {
        Tensor h = matmul(x, W);
        return matmul(h, h, false, true);  // h h^T: h feeds both operands
      },
      {x, W});
}

TEST_CASE("a node that hands its leaves over in turn calls the leaf hooks as it writes each", "[autograd]") {
  // As linear_chain's node does for its layers: the hooks fire leaf by leaf from inside its
  // backward (before writing, once written), in its order, and a put() gradient is in the
  // leaf when its hook sees it; a leaf it writes nothing for still gets its done hook after.
  struct InTurn : Node {
    const char* name() const override { return "in_turn"; }
    bool hands_over_in_turn() const override { return true; }
    void backward(Tensor& g, Grads& grads) override {
      for (size_t i : {2, 0}) {
        grads.before_write(i);
        grads.put(i, g.detach());
        grads.handed(i);
      }
    }
  };
  Tensor a = Tensor::zeros({1}, DType::f32, host).set_requires_grad(true);
  Tensor b = Tensor::zeros({1}, DType::f32, host).set_requires_grad(true);
  Tensor c = Tensor::zeros({1}, DType::f32, host).set_requires_grad(true);
  std::vector<std::string> log;
  auto node = std::make_shared<InTurn>();
  node->inputs = {a, b, c};
  Tensor out = Tensor::zeros({1}, DType::f32, host);
  out.set_grad_fn(node);
  auto name = [&](const Tensor& t) { return t.data() == a.data() ? "a" : t.data() == b.data() ? "b" : "c"; };
  run_backward(
      out, 3.0f,
      [&](const Tensor& t) {
        log.push_back(std::string("done ") + name(t) + " " +
                      (t.grad().defined() ? std::to_string(static_cast<int>(t.grad().item())) : "none"));
      },
      [&](const Tensor& t) { log.push_back(std::string("before ") + name(t)); });
  CHECK(log == std::vector<std::string>{"before c", "done c 3", "before a", "done a 3", "done b none"});
  CHECK(a.grad().item() == 3.0f);
  CHECK(!b.grad().defined());
  CHECK(c.grad().item() == 3.0f);
}

TEST_CASE("backward frees each node's saved activations as it passes and refuses a second pass", "[ops]") {
  Tensor x = randn_tensor({64, 256}, 1, host);
  Tensor t = randn_tensor({64, 256}, 2, host);
  Tensor W1 = randn_tensor({256, 256}, 3, host), W2 = randn_tensor({256, 256}, 4, host);
  for (Tensor* w : {&W1, &W2}) {
    w->set_requires_grad(true);
    w->set_grad(Tensor::zeros(w->shape(), DType::f32, host));  // accumulated in place, as parameters are
  }
  Tensor loss = mse_loss(linear(linear(x, W1, Tensor(), Act::relu), W2, Tensor()), t);
  const size_t before = allocator(host).stats().allocated;
  loss.backward();
  // The hidden activation and the loss's gradient (64 x 256 floats each) are gone; the
  // loss node's own saved tensors stay while `loss` lives.
  CHECK(allocator(host).stats().allocated + 2 * 64 * 256 * sizeof(float) <= before);
  CHECK_THROWS_AS(loss.backward(), Error);
  // Two losses sharing an activation: the second backward meets nodes the first freed
  // and refuses before running any (as PyTorch does without retain_graph).
  Tensor h = linear(x, W1, Tensor(), Act::relu);
  Tensor l1 = mse_loss(h, t), l2 = mse_loss(h, x);
  l1.backward();
  const std::vector<float> g1 = W1.grad().to_host();
  CHECK_THROWS_AS(l2.backward(), Error);
  CHECK(W1.grad().to_host() == g1);
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
