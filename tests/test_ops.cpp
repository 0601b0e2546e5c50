// CPU ops: gradients from autograd against central finite differences, and the
// optimizer, cast, random, convolution, pooling and batch-norm kernels against their
// definitions or known answers.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>

#include <dptrain/error.hpp>
#include "catch.hpp"
#include "common.hpp"
#include "kernels/cpu/cpu.hpp"
#include "kernels/philox.hpp"
#include "runtime/allocator.hpp"

using namespace dpt;
using test::numeric_grad;
using test::randn_tensor;
using test::rel_error;

namespace {
const Device host{DeviceType::cpu, 0};

// Checks d loss / d t for every tensor in `wrt` against finite differences, where
// loss = mse(f(), target) is rebuilt from the (perturbed) tensors each time.
void check_gradients(const std::function<Tensor()>& f, std::vector<Tensor> wrt, double tol = 2e-3) {
  Tensor out0;
  {
    NoGradGuard g;
    out0 = f();
  }
  Tensor target = randn_tensor(out0.shape(), 99, host);
  for (auto& t : wrt) {
    t.set_requires_grad(true);
    t.set_grad(Tensor());
  }
  mse_loss(f(), target).backward();
  auto loss = [&] {
    NoGradGuard g;
    return mse_loss(f(), target).item();
  };
  for (size_t i = 0; i < wrt.size(); ++i) {
    INFO("input " << i << " shape " << shape_str(wrt[i].shape()));
    REQUIRE(wrt[i].grad().defined());
    const double err = rel_error(wrt[i].grad().to_host(), numeric_grad(wrt[i], loss));
    INFO("relative error " << err);
    CHECK(err < tol);
  }
}
}  // namespace

TEST_CASE("matmul gradients match finite differences for every transpose", "[ops][grad]") {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      INFO("ta " << ta << " tb " << tb);
      Tensor a = randn_tensor(ta ? Shape{5, 3} : Shape{3, 5}, 1, host);
      Tensor b = randn_tensor(tb ? Shape{4, 5} : Shape{5, 4}, 2, host);
      check_gradients([&] { return matmul(a, b, ta, tb); }, {a, b});
    }
}

TEST_CASE("linear gradients match finite differences for every activation", "[ops][grad]") {
  for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh}) {
    INFO("act " << static_cast<int>(act));
    Tensor x = randn_tensor({6, 5}, 3, host);
    Tensor W = randn_tensor({4, 5}, 4, host, 0.5f);
    Tensor b = randn_tensor({4}, 5, host, 0.5f);
    check_gradients([&] { return linear(x, W, b, act); }, {x, W, b});
  }
}

TEST_CASE("activation gradients match finite differences", "[ops][grad]") {
  for (Act act : {Act::relu, Act::gelu, Act::tanh}) {
    INFO("act " << static_cast<int>(act));
    auto v = test::randn(24, 6);
    for (float& e : v) e += e >= 0 ? 0.1f : -0.1f;  // keep relu's kink out of eps's reach
    Tensor x = Tensor::from_host(v, {4, 6}, host);
    check_gradients([&] { return activation(x, act); }, {x});
  }
}

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

TEST_CASE("the run-of-layers kernels' CPU twins give linear() after linear()'s values and gradients", "[ops]") {
  // cpu::mlp_forward, mlp_backward and mlp_grad_sum (the twins of kernels/cuda/mlp.cu)
  // against autograd through linear(): batches that end inside a block of rows, GELU's
  // pre-activations, a last layer without bias; the parts added a layer at a time give
  // the bits of all at once, and beta 1 adds to what is there.
  for (auto [rows, act] : {std::pair<int64_t, Act>{19, Act::gelu}, {8, Act::relu}, {3, Act::tanh}}) {
    INFO("rows " << rows << ", act " << static_cast<int>(act));
    const std::vector<int> widths{5, 9, 6, 3};
    const int n = 3;
    Tensor x = randn_tensor({rows, widths[0]}, 60, host).set_requires_grad(true);
    std::vector<Tensor> W, b;
    MlpLayers run;
    run.count = n;
    std::vector<std::vector<float>> y(n), z(n);
    for (int l = 0; l < n; ++l) {
      W.push_back(randn_tensor({widths[l + 1], widths[l]}, 61 + l, host, 0.5f).set_requires_grad(true));
      b.push_back(l + 1 < n ? randn_tensor({widths[l + 1]}, 71 + l, host).set_requires_grad(true) : Tensor());
      y[l].resize(static_cast<size_t>(rows * widths[l + 1]));
      z[l].resize(y[l].size());
      run.layer[l] = {W[l].f32(),
                      b[l].defined() ? b[l].f32() : nullptr,
                      y[l].data(),
                      z[l].data(),
                      widths[l],
                      widths[l + 1],
                      l + 1 < n ? act : Act::none};
    }
    Tensor h = x;
    for (int l = 0; l < n; ++l) h = linear(h, W[l], b[l], run.layer[l].act);
    const Tensor dy = randn_tensor(h.shape(), 80, host);
    run_backward(h, dy);
    cpu::mlp_forward(rows, x.f32(), run);
    CHECK(rel_error(y[n - 1], h.to_host()) < 1e-6);
    std::vector<float> dx(static_cast<size_t>(x.numel())), work(static_cast<size_t>(mlp_backward_work(rows, run)));
    cpu::mlp_backward(rows, x.f32(), dy.f32(), dx.data(), run, work.data());
    CHECK(rel_error(dx, x.grad().to_host()) < 1e-5);
    std::vector<std::vector<float>> dW(n), db(n), dW2(n);
    MlpGrads all, each;
    for (int l = 0; l < n; ++l) {
      dW[l].assign(static_cast<size_t>(W[l].numel()), 0.f);
      dW2[l].assign(dW[l].size(), 7.f);  // beta 0: never read
      all.dW[l] = dW[l].data();
      each.dW[l] = dW2[l].data();
      if (b[l].defined()) {
        db[l].assign(static_cast<size_t>(b[l].numel()), 0.f);
        all.db[l] = db[l].data();
      }
    }
    cpu::mlp_grad_sum(rows, run, work.data(), all, 0, n);
    for (int l = n - 1; l >= 0; --l) cpu::mlp_grad_sum(rows, run, work.data(), each, l, l + 1);
    for (int l = 0; l < n; ++l) {
      INFO("layer " << l);
      CHECK(rel_error(dW[l], W[l].grad().to_host()) < 1e-5);
      if (b[l].defined()) CHECK(rel_error(db[l], b[l].grad().to_host()) < 1e-5);
      CHECK(dW2[l] == dW[l]);
      all.beta_W[l] = 1.f;
    }
    cpu::mlp_grad_sum(rows, run, work.data(), all, 0, n);  // adds the same again
    for (int l = 0; l < n; ++l) {
      std::vector<float> twice = W[l].grad().to_host();
      for (float& v : twice) v *= 2.f;
      CHECK(rel_error(dW[l], twice) < 1e-5);
    }
  }
}

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

TEST_CASE("bf16 casts round to nearest even and keep NaN", "[ops]") {
  const float in[] = {1.0f, 1.00390625f /* tie: rounds to even 1.0 */, 1.01171875f /* tie: up */, -2.5f, NAN, INFINITY};
  uint16_t h[6];
  float back[6];
  cpu::cast_f32_bf16(in, h, 6);
  cpu::cast_bf16_f32(h, back, 6);
  CHECK(back[0] == 1.0f);
  CHECK(back[1] == 1.0f);
  CHECK(back[2] == 1.015625f);
  CHECK(back[3] == -2.5f);
  CHECK(std::isnan(back[4]));
  CHECK(std::isinf(back[5]));
}

TEST_CASE("rows of a RowMap get the values of their samples in a contiguous fill", "[random]") {
  const Device cpu{DeviceType::cpu, 0};
  for (int64_t width : {8, 5}) {  // whole Philox blocks a row, or not
    INFO("width " << width);
    // 3 groups of 4 rows, 10 samples apart, wrapping at 23: samples 6..9, 16..19, 3..6.
    const RowMap map{6, 4, 10, 23};
    Tensor rows = Tensor::empty({12, width}, DType::f32, cpu), all = Tensor::empty({23, width}, DType::f32, cpu);
    normal_rows_(rows, 9, 2, map, 0.5f);
    normal_(all, 9, 2, 0, 0.5f);
    const auto r = rows.to_host(), a = all.to_host();
    for (int64_t i = 0; i < 12; ++i) {
      const int64_t sample = (6 + (i / 4) * 10 + i % 4) % 23;
      for (int64_t c = 0; c < width; ++c)
        CHECK(r[static_cast<size_t>(i * width + c)] == a[static_cast<size_t>(sample * width + c)]);
    }
    Tensor noisy = Tensor::zeros({12, width}, DType::f32, cpu);
    fill_(noisy, 1.0f);
    normal_rows_(noisy, 9, 2, map, 0.5f, /*add=*/true);
    const auto n = noisy.to_host();
    for (size_t i = 0; i < n.size(); ++i) CHECK(n[i] == 1.0f + r[i]);
  }
}

TEST_CASE("Philox: known answer, counter-based, and plausible statistics", "[random]") {
  // Known-answer test from the Random123 distribution (philox4x32_10, zero key and counter).
  auto r = philox::philox4x32(0, 0, 0);
  CHECK(r.x == 0x6627e8d5u);
  CHECK(r.y == 0xe169c58du);
  CHECK(r.z == 0xbc57ac4cu);
  CHECK(r.w == 0x9b00dbd8u);
  // A slice of a stream equals the same slice made from its offset.
  std::vector<float> whole(1000), part(100);
  cpu::normal(whole.data(), 1000, 42, 3, 0, 1.0f);
  cpu::normal(part.data(), 100, 42, 3, 517, 1.0f);
  CHECK(std::memcmp(part.data(), whole.data() + 517, 100 * sizeof(float)) == 0);
  std::vector<float> big(200000);
  cpu::normal(big.data(), 200000, 5, 0, 0, 1.0f);
  double mean = 0, var = 0;
  for (float v : big) mean += v;
  mean /= static_cast<double>(big.size());
  for (float v : big) var += (v - mean) * (v - mean);
  var /= static_cast<double>(big.size());
  CHECK(std::fabs(mean) < 0.01);
  CHECK(std::fabs(var - 1.0) < 0.02);
}

TEST_CASE("argmax takes the first maximum", "[ops]") {
  Tensor x = Tensor::from_host({1, 3, 3, 0, -1, -2, 5, 5, 5}, {3, 3}, host);
  CHECK(argmax_rows(x).to_host_i32() == std::vector<int32_t>{1, 0, 0});
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

// ---- Convolutional networks ---------------------------------------------------------

namespace {
// Values 0.1 apart in a scrambled order: no two elements of a pooling window are within
// reach of the finite differences' eps, so the max is never ambiguous.
Tensor spaced_tensor(const Shape& s, uint64_t seed) {
  const int64_t n = numel(s);
  auto order = test::randn(n, seed);
  std::vector<int64_t> rank(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rank[static_cast<size_t>(i)] = i;
  std::sort(rank.begin(), rank.end(), [&](int64_t a, int64_t b) { return order[size_t(a)] < order[size_t(b)]; });
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(rank[size_t(i)])] = 0.1f * static_cast<float>(i - n / 2);
  return Tensor::from_host(v, s, host);
}
}  // namespace

TEST_CASE("conv2d gradients match finite differences for strides, padding, dilation and odd shapes",
          "[ops][grad][conv]") {
  struct Case {
    Shape x, w;
    int64_t stride, pad, dilation;
    bool bias;
  };
  const std::vector<Case> cases = {
      {{2, 3, 5, 6}, {4, 3, 3, 3}, 1, 1, 1, true},   // "same" padding
      {{2, 2, 7, 5}, {3, 2, 3, 3}, 2, 1, 1, true},   // stride 2, odd sizes
      {{1, 2, 7, 7}, {2, 2, 3, 3}, 1, 2, 2, true},   // dilation, batch 1
      {{2, 4, 3, 5}, {5, 4, 1, 1}, 1, 0, 1, true},   // 1x1
      {{2, 2, 6, 5}, {3, 2, 2, 3}, 2, 0, 1, false},  // a non-square kernel, no bias
      {{3, 1, 4, 4}, {2, 1, 4, 4}, 1, 0, 1, true},   // the kernel covers the whole image
  };
  for (const Case& c : cases) {
    INFO("x " << shape_str(c.x) << " w " << shape_str(c.w) << " stride " << c.stride << " pad " << c.pad << " dilation "
              << c.dilation);
    Tensor x = randn_tensor(c.x, 21, host);
    Tensor w = randn_tensor(c.w, 22, host, 0.5f);
    Tensor b = c.bias ? randn_tensor({c.w[0]}, 23, host, 0.5f) : Tensor();
    std::vector<Tensor> wrt{x, w};
    if (c.bias) wrt.push_back(b);
    check_gradients([&] { return conv2d(x, w, b, c.stride, c.pad, c.dilation); }, wrt);
  }
}

TEST_CASE("conv2d gives known answers for padding, stride and dilation", "[ops][conv]") {
  // x = 1..9 in a 3x3 image, w = [[1, 0], [0, -1]]: y = x[i][j] - x[i+d][j+d].
  Tensor x = Tensor::from_host({1, 2, 3, 4, 5, 6, 7, 8, 9}, {1, 1, 3, 3}, host);
  Tensor w = Tensor::from_host({1, 0, 0, -1}, {1, 1, 2, 2}, host);
  CHECK(conv2d(x, w, Tensor()).to_host() == std::vector<float>{-4, -4, -4, -4});
  // Padding 1, stride 2: windows at (-1,-1), (-1,1), (1,-1), (1,1); padding reads zeros.
  CHECK(conv2d(x, w, Tensor(), 2, 1).to_host() == std::vector<float>{-1, -3, -7, -4});
  CHECK(conv2d(x, w, Tensor(), 1, 0, 2).to_host() == std::vector<float>{1 - 9});
  // Two input channels summed, two output channels with their biases.
  Tensor x2 = Tensor::from_host({1, 2, 3, 4, 10, 20, 30, 40}, {1, 2, 2, 2}, host);
  Tensor w2 = Tensor::from_host({1, 1, 2, 0}, {2, 2, 1, 1}, host);
  Tensor b2 = Tensor::from_host({0.5f, -1}, {2}, host);
  CHECK(conv2d(x2, w2, b2).to_host() == std::vector<float>{11.5f, 22.5f, 33.5f, 44.5f, 1, 3, 5, 7});
}

TEST_CASE("a 1x1 convolution over a 1x1 image is a linear layer", "[ops][conv]") {
  Tensor x = randn_tensor({5, 6, 1, 1}, 24, host);
  Tensor w = randn_tensor({4, 6, 1, 1}, 25, host);
  Tensor b = randn_tensor({4}, 26, host);
  CHECK(rel_error(conv2d(x, w, b).to_host(), linear(x.reshape({5, 6}), w.reshape({4, 6}), b).to_host()) < 1e-6);
}

TEST_CASE("pooling gradients match finite differences", "[ops][grad][conv]") {
  struct Case {
    Shape x;
    Pool kind;
    int64_t kh, kw, stride, pad;
  };
  const std::vector<Case> cases = {
      {{2, 3, 6, 6}, Pool::max, 2, 2, 2, 0}, {{2, 2, 7, 5}, Pool::max, 3, 3, 2, 1},
      {{1, 2, 5, 5}, Pool::max, 3, 3, 1, 1}, {{2, 3, 6, 6}, Pool::avg, 2, 2, 2, 0},
      {{2, 2, 7, 5}, Pool::avg, 3, 3, 2, 1}, {{1, 2, 5, 7}, Pool::avg, 5, 7, 1, 0},
  };
  for (const Case& c : cases) {
    INFO((c.kind == Pool::max ? "max" : "avg")
         << " x " << shape_str(c.x) << " window " << c.kh << "x" << c.kw << " stride " << c.stride << " pad " << c.pad);
    Tensor x = spaced_tensor(c.x, 27);
    check_gradients([&] { return pool2d(x, c.kind, c.kh, c.kw, c.stride, c.pad); }, {x});
  }
}

TEST_CASE("pooling gives known answers: padding, count_include_pad, the first maximum", "[ops][conv]") {
  Tensor x = Tensor::from_host({1, 2, 3, 4, 5, 6, 7, 8, 9}, {1, 1, 3, 3}, host);
  CHECK(pool2d(x, Pool::max, 2, 2, 1).to_host() == std::vector<float>{5, 6, 8, 9});
  CHECK(pool2d(x, Pool::max, 2, 2, 2, 1).to_host() == std::vector<float>{1, 3, 7, 9});
  // The padded zeros count: the corner window (-1..0)^2 holds only x[0][0] = 1, over 4;
  // the next, 2 + 3 over 4.
  CHECK(pool2d(x, Pool::avg, 2, 2, 2, 1).to_host() == std::vector<float>{0.25f, 1.25f, 2.75f, 7});
  CHECK(pool2d(x, Pool::avg, 3, 3, 1).to_host() == std::vector<float>{5});
  // A tie: the gradient goes to the first maximum of the window only.
  Tensor t = Tensor::from_host({2, 7, 7, 1}, {1, 1, 2, 2}, host).set_requires_grad(true);
  pool2d(t, Pool::max, 2, 2, 2).backward();
  CHECK(t.grad().to_host() == std::vector<float>{0, 1, 0, 0});
}

TEST_CASE("batch norm gradients match finite differences", "[ops][grad][conv]") {
  for (const Shape& s : {Shape{3, 4, 5, 5}, Shape{1, 3, 4, 3}, Shape{5, 2, 1, 1}}) {
    INFO("x " << shape_str(s));
    const int64_t c = s[1];
    Tensor x = randn_tensor(s, 28, host, 2.0f);
    Tensor gamma = randn_tensor({c}, 29, host);
    Tensor beta = randn_tensor({c}, 30, host);
    Tensor mean = Tensor::zeros({c}, DType::f32, host), var = Tensor::full({c}, 1.0f, host);
    check_gradients([&] { return batch_norm2d(x, gamma, beta, mean, var, true); }, {x, gamma, beta});
  }
}

TEST_CASE("batch norm: batch statistics in training, running statistics in evaluation", "[ops][conv]") {
  const Shape s{2, 3, 2, 3};
  Tensor x = randn_tensor(s, 31, host, 3.0f);
  Tensor gamma = Tensor::from_host({1.0f, 2.0f, -0.5f}, {3}, host);
  Tensor beta = Tensor::from_host({0.0f, 1.0f, 0.25f}, {3}, host);
  Tensor rmean = Tensor::from_host({0.5f, 0.0f, -1.0f}, {3}, host),
         rvar = Tensor::from_host({1.0f, 2.0f, 0.5f}, {3}, host);
  const auto xs = x.to_host(), g = gamma.to_host(), b = beta.to_host(), m0 = rmean.to_host(), v0 = rvar.to_host();
  const BatchNormArgs a{1e-5f, 0.1f};
  const auto y = batch_norm2d(x, gamma, beta, rmean, rvar, true, a).to_host();
  const auto m1 = rmean.to_host(), v1 = rvar.to_host();
  const auto ye = batch_norm2d(x, gamma, beta, rmean, rvar, false, a).to_host();
  CHECK(rmean.to_host() == m1);  // evaluation leaves the running statistics alone
  for (int64_t c = 0; c < 3; ++c) {
    INFO("channel " << c);
    std::vector<size_t> idx;
    for (int64_t n = 0; n < 2; ++n)
      for (int64_t e = 0; e < 6; ++e) idx.push_back(static_cast<size_t>((n * 3 + c) * 6 + e));
    double mean = 0, sq = 0;
    for (size_t i : idx) mean += xs[i];
    mean /= 12;
    for (size_t i : idx) sq += (xs[i] - mean) * (xs[i] - mean);
    const size_t k = static_cast<size_t>(c);
    // Normalized with the biased variance; the running variance moves toward the unbiased one.
    for (size_t i : idx) CHECK(std::fabs(y[i] - ((xs[i] - mean) / std::sqrt(sq / 12 + 1e-5) * g[k] + b[k])) < 1e-5);
    CHECK(std::fabs(m1[k] - (0.9 * m0[k] + 0.1 * mean)) < 1e-6);
    CHECK(std::fabs(v1[k] - (0.9 * v0[k] + 0.1 * sq / 11)) < 1e-6);
    for (size_t i : idx) CHECK(std::fabs(ye[i] - ((xs[i] - m1[k]) / std::sqrt(v1[k] + 1e-5) * g[k] + b[k])) < 1e-5);
  }
  // Evaluation has no backward: asking for one is an error, not a missing gradient.
  gamma.set_requires_grad(true);
  CHECK_THROWS_AS(
      mse_loss(batch_norm2d(x, gamma, beta, rmean, rvar, false), Tensor::zeros(s, DType::f32, host)).backward(), Error);
  Tensor one = randn_tensor({1, 3, 1, 1}, 32, host);
  CHECK_THROWS_AS(batch_norm2d(one, gamma, beta, rmean, rvar, true), Error);  // one value per channel
}

TEST_CASE("flatten keeps the data and passes the gradient back in the input's shape", "[ops][conv]") {
  Tensor x = randn_tensor({2, 3, 2, 2}, 33, host);
  CHECK(flatten(x).shape() == Shape{2, 12});
  CHECK(flatten(x).to_host() == x.to_host());
  Tensor w = randn_tensor({3, 3, 1, 1}, 34, host);
  check_gradients([&] { return flatten(conv2d(x, w, Tensor())); }, {x, w});
}

TEST_CASE("convolution ops refuse shapes that do not fit", "[ops][conv]") {
  Tensor x = randn_tensor({1, 3, 4, 4}, 35, host);
  CHECK_THROWS_AS(conv2d(x, randn_tensor({2, 2, 3, 3}, 1, host), Tensor()), Error);                    // channels
  CHECK_THROWS_AS(conv2d(x, randn_tensor({2, 3, 5, 5}, 1, host), Tensor()), Error);                    // kernel > image
  CHECK_THROWS_AS(conv2d(x, randn_tensor({2, 3, 3, 3}, 1, host), randn_tensor({3}, 1, host)), Error);  // bias
  CHECK_THROWS_AS(conv2d(x.reshape({3, 16}), randn_tensor({2, 3, 1, 1}, 1, host), Tensor()), Error);   // not NCHW
  CHECK_THROWS_AS(pool2d(x, Pool::max, 5, 5, 1), Error);
  CHECK_THROWS_AS(pool2d(x, Pool::max, 2, 2, 2, 2), Error);  // padding over half the window
  CHECK_THROWS_AS(pool2d(x, Pool::avg, 2, 2, 0), Error);
  // A kernel one row too large for the image, at stride 2: (2 - 3) / 2 rounds to 0 in
  // C++, so the output size alone would look like 1x1 (cuDNN and torch refuse it too).
  Tensor small = randn_tensor({1, 1, 2, 2}, 3, host);
  CHECK_THROWS_AS(conv2d(small, randn_tensor({1, 1, 3, 3}, 1, host), Tensor(), 2), Error);
  CHECK_THROWS_AS(pool2d(small, Pool::max, 3, 3, 2), Error);
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
