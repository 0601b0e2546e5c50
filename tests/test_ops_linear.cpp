// Linear layers and activations: gradients against finite differences, the run-of-layers
// kernels' CPU twins, bf16 against fp32 on the CPU; on the GPU, linear, activations and
// losses forward and backward (fp32 and bf16), the fused activation backward and bias
// gradient, and a run of narrow layers in one kernel, each against the CPU.

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
#include "kernels/cpu/cpu.hpp"
#include "runtime/allocator.hpp"
#include "train/nonfinite_watch.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/cuda.hpp"
#endif

#include "catch.hpp"
#include "common.hpp"

using namespace dpt;
using namespace dpt::test;

namespace {
// A transformer MLP (rows x c -> 4c -> c, tanh-GELU) in bf16 on `d`, forward and backward
// of a squared error: as gelu_mlp_bf16 (fused) or as two linear_bf16 layers (recomputing:
// linear_bf16_pre, c_proj keeping act_of(z)). Gives y and the gradients of x and each
// parameter.
std::vector<Tensor> bf16_mlp_step(const Device& d, int64_t rows, int64_t c, bool fused, bool keep_h) {
  Tensor x = randn_tensor({rows, c}, 31, d).set_requires_grad(true);
  const TwoLayers m(d, c, 4 * c, 32);
  const Tensor x16 = cast(x, DType::bf16);
  Tensor y;
  if (fused) {
    y = gelu_mlp_bf16(x16, m.fc, m.proj, keep_h);
  } else if (keep_h) {
    y = linear_bf16(linear_bf16(x16, m.W1, m.b1, m.fc.W16, m.fc.b16, Act::gelu_tanh), m.W2, m.b2, m.proj.W16,
                    m.proj.b16);
  } else {
    const LinearOut h = linear_bf16_pre(x16, m.W1, m.b1, m.fc.W16, m.fc.b16, Act::gelu_tanh);
    y = linear_bf16_pre(h.y, m.W2, m.b2, m.proj.W16, m.proj.b16, Act::none, act_of(h.z, Act::gelu_tanh)).y;
  }
  mse_loss(y, randn_tensor({rows, c}, 36, d)).backward();
  return {y.detach(), x.grad(), m.W1.grad(), m.b1.grad(), m.W2.grad(), m.b2.grad()};
}

}  // namespace

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

TEST_CASE("linear gradients match finite differences for every activation", "[ops][grad]") {
  for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh, Act::gelu_tanh}) {
    INFO("act " << static_cast<int>(act));
    Tensor x = randn_tensor({6, 5}, 3, host);
    Tensor W = randn_tensor({4, 5}, 4, host, 0.5f);
    Tensor b = randn_tensor({4}, 5, host, 0.5f);
    check_gradients([&] { return linear(x, W, b, act); }, {x, W, b});
  }
}

TEST_CASE("activation gradients match finite differences", "[ops][grad]") {
  for (Act act : {Act::relu, Act::gelu, Act::tanh, Act::gelu_tanh}) {
    INFO("act " << static_cast<int>(act));
    auto v = test::randn(24, 6);
    for (float& e : v) e += e >= 0 ? 0.1f : -0.1f;  // keep relu's kink out of eps's reach
    Tensor x = Tensor::from_host(v, {4, 6}, host);
    check_gradients([&] { return activation(x, act); }, {x});
  }
}

TEST_CASE("gelu_tanh is PyTorch's F.gelu(x, approximate='tanh'), forward and backward", "[ops]") {
  // Expected values: torch 2.15, float64, F.gelu(x, approximate='tanh') and its gradient
  // (y.sum().backward(); x.grad).
  const std::vector<float> xv{-6.0f, -3.0f, -1.5f, -0.5f, -0.01f, 0.0f, 0.3f, 1.0f, 2.5f, 5.0f};
  const std::vector<double> want_y{-8.43964898e-11, -0.00363739208, -0.100428423, -0.15428599, -0.00496010644, 0,
                                   0.185370924,     0.841191991,    2.48491573,   4.99999977};
  const std::vector<double> want_dx{-7.70997601e-10, -0.0115841666, -0.127710793, 0.132630096, 0.492021422, 0.5,
                                    0.732295452,     1.08296408,    1.03795158,   1.00000155};
  Tensor x = Tensor::from_host(xv, {2, 5}, host).set_requires_grad(true);
  Tensor y = activation(x, Act::gelu_tanh);
  run_backward(y, Tensor::from_host(std::vector<float>(10, 1.0f), {2, 5}, host));
  const auto y_host = y.to_host(), dx_host = x.grad().to_host();
  for (size_t i = 0; i < xv.size(); ++i) {
    INFO("x = " << xv[i]);
    CHECK(std::abs(y_host[i] - want_y[i]) <= 1e-6 * std::max(1.0, std::abs(want_y[i])));
    CHECK(std::abs(dx_host[i] - want_dx[i]) <= 1e-6 * std::max(1.0, std::abs(want_dx[i])));
  }
  CHECK(nn::parse_act("gelu_tanh") == Act::gelu_tanh);
  CHECK(std::string(nn::act_name(Act::gelu_tanh)) == "gelu_tanh");
}

TEST_CASE("the run-of-layers kernels' CPU twins give linear() after linear()'s values and gradients", "[ops]") {
  // cpu::mlp_forward, mlp_backward and mlp_grad_sum (the twins of kernels/cuda/mlp.cu)
  // against autograd through linear(): batches that end inside a block of rows, GELU's
  // pre-activations, a last layer without bias; the parts added a layer at a time give
  // the bits of all at once, and beta 1 adds to what is there.
  for (auto [rows, act] :
       {std::pair<int64_t, Act>{19, Act::gelu}, {8, Act::relu}, {3, Act::tanh}, {5, Act::gelu_tanh}}) {
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

TEST_CASE("linear writes into a given output the bits it would allocate", "[ops]") {
  const Device cpu{DeviceType::cpu, 0};
  const Tensor x = test::randn_tensor({5, 7}, 1, cpu);
  const Tensor W = test::randn_tensor({4, 7}, 2, cpu);
  const Tensor b = test::randn_tensor({4}, 3, cpu);
  for (Act act : {Act::none, Act::relu, Act::tanh}) {
    const Tensor out = Tensor::empty({5, 4}, DType::f32, cpu);
    const Tensor y = linear(x, W, b, act, out);
    CHECK(y.data() == out.data());
    CHECK(out.to_host() == linear(x, W, b, act).to_host());
  }
  CHECK_THROWS_AS(linear(x, W, b, Act::none, Tensor::empty({4, 5}, DType::f32, cpu)), Error);
  Tensor w = test::randn_tensor({4, 7}, 2, cpu);
  w.set_requires_grad(true);
  CHECK_THROWS_AS(linear(x, w, b, Act::none, Tensor::empty({5, 4}, DType::f32, cpu)), Error);  // backward would save it
}

TEST_CASE("gelu_mlp_bf16 gives two bf16 Linear layers' values and gradients, bit for bit", "[ops][bf16]") {
  for (bool keep_h : {true, false}) {
    INFO((keep_h ? "keeping the GELU's output" : "rebuilding it from the pre-activation"));
    const auto fused = bf16_mlp_step(host, 37, 24, true, keep_h), layers = bf16_mlp_step(host, 37, 24, false, keep_h);
    for (size_t i = 0; i < fused.size(); ++i) {
      INFO("output " << i);
      CHECK(fused[i].to_host() == layers[i].to_host());
    }
  }
  const Tensor x = Tensor::zeros({4, 8}, DType::bf16, host), W = Tensor::zeros({32, 8}, DType::f32, host);
  const Bf16Layer no_bias{W, Tensor(), cast(W, DType::bf16), Tensor()};
  CHECK(test::usage_error([&] { gelu_mlp_bf16(x, no_bias, no_bias, true); }) ==
        "gelu_mlp_bf16: both layers need a bias");
}

TEST_CASE("bf16 linear equals the fp32 linear on bf16-rounded operands, rounded once", "[ops][bf16]") {
  for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh, Act::gelu_tanh})
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
  for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh, Act::gelu_tanh}) {
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
  for (Act act : {Act::relu, Act::gelu, Act::tanh, Act::gelu_tanh, Act::none}) {
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

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

#if DPT_WITH_CUDA
TEST_CASE("the activation backward with a transposed copy matches the CPU", "[gpu][ops]") {
  struct Size {
    int64_t rows, cols;
  };
  for (Size sz : {Size{1, 1}, Size{33, 65}, Size{64, 31}, Size{100, 257}})
    for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh, Act::gelu_tanh}) {
      INFO(sz.rows << "x" << sz.cols << " act " << static_cast<int>(act));
      const int64_t n = sz.rows * sz.cols;
      const auto dy = randn(n, 13), saved = randn(n, 14);
      const cudaStream_t st = static_cast<cudaStream_t>(context(gpu).stream());
      // dx: bit for bit the plain act_backward's on the GPU (the CPU's erfc may differ in
      // the last bit), and within float rounding of the CPU; dxt: exactly dx transposed.
      Tensor plain = on(gpu, dy, {n}), s = on(gpu, saved, {n});
      cuda::act_backward(plain.f32(), s.f32(), act, n, plain.f32(), st);
      // In place, as Linear does, with the bias gradient (beta 1 onto db0) from the same pass.
      Tensor g = on(gpu, dy, {n}), gt = Tensor::empty({n}, DType::f32, gpu);
      const auto db0 = randn(sz.cols, 15);
      Tensor db = on(gpu, db0, {sz.cols});
      Tensor work = Tensor::empty({cuda::act_backward_transposed_work(sz.rows, sz.cols)}, DType::f32, gpu);
      cuda::act_backward_transposed(g.f32(), s.f32(), act, sz.rows, sz.cols, g.f32(), gt.f32(), 1.0f, db.f32(),
                                    work.f32(), st);
      const auto dx = g.to_host(), dxt = gt.to_host();
      CHECK(dx == plain.to_host());
      std::vector<float> want(static_cast<size_t>(n)), want_t(static_cast<size_t>(n)), want_db = db0;
      cpu::act_backward_transposed(dy.data(), saved.data(), act, sz.rows, sz.cols, want.data(), want_t.data());
      CHECK(rel_error(dx, want) < 1e-5);
      cpu::bias_grad(want.data(), sz.rows, sz.cols, 1.0f, want_db.data());
      CHECK(rel_error(db.to_host(), want_db) < 1e-5);
      // Without dx (only the transposed copy is written) and without a bias gradient.
      Tensor g2 = on(gpu, dy, {n}), gt2 = Tensor::empty({n}, DType::f32, gpu);
      cuda::act_backward_transposed(g2.f32(), s.f32(), act, sz.rows, sz.cols, nullptr, gt2.f32(), 0.0f, nullptr,
                                    nullptr, st);
      CHECK(g2.to_host() == dy);
      CHECK(gt2.to_host() == dxt);
      bool transposed = true;
      for (int64_t r = 0; r < sz.rows; ++r)
        for (int64_t c = 0; c < sz.cols; ++c)
          transposed =
              transposed && dxt[static_cast<size_t>(c * sz.rows + r)] == dx[static_cast<size_t>(r * sz.cols + c)];
      CHECK(transposed);
    }
  // Linear's TF32 backward takes this path at 2^30 multiply-adds: within TF32 of the CPU.
  // Without ReLU: TF32's rounding would put hundreds of the million outputs on the other
  // side of its kink, each moving a row of dW by ~1e-3 (the mask is checked above).
  struct Tf32 {  // restores fp32 even when a check throws
    Tf32() { context(gpu).precision = Precision::tf32; }
    ~Tf32() { context(gpu).precision = Precision::fp32; }
  } tf32;
  auto x = randn(1024 * 1024, 15), W = randn(1024 * 1024, 16, 0.03f), b = randn(1024, 17);
  compare(
      [&](const Device& d) {
        return value_and_grads([&](std::vector<Tensor>& in) { return linear(in[0], in[1], in[2], Act::none); },
                               {on(d, x, {1024, 1024}), on(d, W, {1024, 1024}), on(d, b, {1024})});
      },
      3e-3);
}
#endif

TEST_CASE("linear, activations and losses match the CPU, forward and backward", "[gpu][ops]") {
  for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh, Act::gelu_tanh}) {
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
  // At 2^30 multiply-adds Linear takes cuBLASLt's fused bias + ReLU epilogue: the same
  // values as the CPU, and the same gradients without ReLU. (With it, among a million
  // outputs a few lie so near 0 that the two sides' roundings put them on either side of
  // the kink, and each such one moves a row of dW by ~1e-3 of its norm; the backward
  // through the mask is the same code as for small layers, tested above.)
  auto x = randn(1024 * 1024, 10), W = randn(1024 * 1024, 11, 0.03f), b = randn(1024, 12);
  compare([&](const Device& d) {
    return value_and_grads([&](std::vector<Tensor>& in) { return linear(in[0], in[1], in[2], Act::none); },
                           {on(d, x, {1024, 1024}), on(d, W, {1024, 1024}), on(d, b, {1024})});
  });
  compare([&](const Device& d) {
    return std::vector<Tensor>{linear(on(d, x, {1024, 1024}), on(d, W, {1024, 1024}), on(d, b, {1024}), Act::relu)};
  });
  auto logits = randn(300 * 11, 9, 3.0f);
  std::vector<int32_t> labels(300);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int32_t>((i * 7) % 11);
  compare([&](const Device& d) {
    Tensor l = on(d, logits, {300, 11}).set_requires_grad(true);
    Tensor loss = cross_entropy(l, Tensor::from_host_i32(labels, {300}, d));
    loss.backward();
    return std::vector<Tensor>{loss, l.grad()};
  });
  // Accuracy over more rows than a block holds, with ties (values rounded to a coarse grid),
  // NaNs and a row of NaNs, fp32 and bf16 logits: the same share as the CPU, exactly.
  {
    const int64_t rows = 5003, cols = 37;
    auto grid = randn(rows * cols, 18, 2.0f);
    for (auto& e : grid) e = std::round(e);
    grid[7] = NAN;
    for (int64_t c = 0; c < cols; ++c) grid[static_cast<size_t>(cols + c)] = NAN;
    std::vector<int32_t> truth(static_cast<size_t>(rows));
    const auto best = argmax_rows(on(host, grid, {rows, cols})).to_host_i32();
    for (size_t i = 0; i < truth.size(); ++i) truth[i] = i % 3 ? best[i] : static_cast<int32_t>(i % cols);
    for (DType t : {DType::f32, DType::bf16}) {
      auto acc = [&](const Device& d) {
        return accuracy(cast(on(d, grid, {rows, cols}), t), Tensor::from_host_i32(truth, {rows}, d)).item();
      };
      CHECK(acc(gpu) == acc(host));
      CHECK(acc(host) > 0.6f);
    }
  }
  // Reductions over more elements than one block covers.
  auto y = randn(1 << 20, 10), t = randn(1 << 20, 11);
  compare([&](const Device& d) {
    Tensor yy = on(d, y, {1024, 1024}).set_requires_grad(true);
    Tensor loss = mse_loss(yy, on(d, t, {1024, 1024}));
    loss.backward();
    return std::vector<Tensor>{loss, yy.grad(), sum_squares(yy.detach())};
  });
}

TEST_CASE("a run of narrow Linear layers in one kernel matches the CPU layer by layer", "[gpu][ops]") {
  // linear_chain's fused forward (kernels/cuda/mlp.cu) and its backward through each
  // layer's, against the CPU's linear() after linear(): the default job's shape, widths
  // that are not multiples of 4, batches that end inside a block, every activation, a last
  // layer without bias, eight layers.
  struct Case {
    int64_t rows;
    std::vector<int64_t> widths;
    Act act;
    bool last_bias;
  };
  for (const Case& c :
       {Case{256, {16, 128, 128, 4}, Act::relu, true}, Case{1, {3, 5, 2}, Act::gelu, true},
        Case{13, {13, 37, 29, 5}, Act::tanh, false}, Case{200, {64, 256, 96}, Act::gelu, true},
        Case{9, {7, 8, 8, 8, 8, 8, 8, 8, 3}, Act::relu, true}, Case{77, {8, 64, 40, 5, 3}, Act::tanh, true},
        Case{31, {12, 48, 24, 6}, Act::gelu_tanh, true}}) {
    INFO("rows " << c.rows << ", " << c.widths.size() - 1 << " layers, act " << static_cast<int>(c.act));
    const size_t n = c.widths.size() - 1;
    std::vector<std::vector<float>> values{randn(c.rows * c.widths[0], 30, 1.0f)};
    for (size_t l = 0; l < n; ++l) {
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.widths[l]));
      values.push_back(randn(c.widths[l + 1] * c.widths[l], 31 + static_cast<int>(l), scale));
      values.push_back(randn(c.widths[l + 1], 41 + static_cast<int>(l), scale));
    }
    compare([&](const Device& d) {
      std::vector<Tensor> in{on(d, values[0], {c.rows, c.widths[0]})};
      for (size_t l = 0; l < n; ++l) {
        in.push_back(on(d, values[1 + 2 * l], {c.widths[l + 1], c.widths[l]}));
        if (l + 1 < n || c.last_bias) in.push_back(on(d, values[2 + 2 * l], {c.widths[l + 1]}));
      }
      return value_and_grads(
          [&](std::vector<Tensor>& t) {
            std::vector<LinearLayer> layers;
            for (size_t l = 0, i = 1; l < n; ++l) {
              const bool bias = l + 1 < n || c.last_bias;
              layers.push_back({t[i], bias ? t[i + 1] : Tensor(), l + 1 < n ? c.act : Act::none});
              i += bias ? 2 : 1;
            }
            if (d.is_cuda()) {
              Tensor y = linear_chain(t[0], layers);
              REQUIRE(y.defined());
              CHECK(std::string(y.grad_fn()->name()) == "linear_chain");
              return y;
            }
            CHECK(!linear_chain(t[0], layers).defined());  // the CPU runs a layer at a time
            Tensor h = t[0];
            for (const LinearLayer& L : layers) h = linear(h, L.W, L.b, L.act);
            return h;
          },
          in);
    });
  }
  // The forward kernel against its CPU twin, outputs and GELU's pre-activations.
#if DPT_WITH_CUDA
  {
    const int64_t rows = 19;
    const std::vector<int> widths{10, 33, 7};
    const auto x = randn(rows * widths[0], 50);
    std::vector<std::vector<float>> W, b;
    std::vector<Tensor> keep;
    MlpLayers host_run, gpu_run;
    std::vector<std::vector<float>> y(2), z(2);
    for (int l = 0; l < 2; ++l) {
      W.push_back(randn(widths[l + 1] * widths[l], 51 + l, 0.3f));
      b.push_back(randn(widths[l + 1], 53 + l));
      y[l].resize(static_cast<size_t>(rows * widths[l + 1]));
      z[l].resize(y[l].size());
      host_run.layer[l] = {W[l].data(), b[l].data(), y[l].data(), z[l].data(), widths[l], widths[l + 1], Act::gelu};
      for (const auto* v : {&W[l], &b[l], &y[l], &z[l]})
        keep.push_back(Tensor::from_host(*v, {static_cast<int64_t>(v->size())}, gpu));
      const size_t k = keep.size() - 4;
      gpu_run.layer[l] = {keep[k].f32(), keep[k + 1].f32(), keep[k + 2].f32(), keep[k + 3].f32(),
                          widths[l],     widths[l + 1],     Act::gelu};
    }
    host_run.count = gpu_run.count = 2;
    const Tensor xg = Tensor::from_host(x, {rows, widths[0]}, gpu);
    REQUIRE(cuda::mlp_fits(gpu_run, gpu.index));
    cpu::mlp_forward(rows, x.data(), host_run);
    cuda::mlp_forward(rows, xg.f32(), gpu_run, static_cast<cudaStream_t>(context(gpu).stream()));
    for (int l = 0; l < 2; ++l) {
      INFO("layer " << l);
      CHECK(rel_error(keep[static_cast<size_t>(4 * l + 2)].to_host(), y[static_cast<size_t>(l)]) < 1e-5);
      CHECK(rel_error(keep[static_cast<size_t>(4 * l + 3)].to_host(), z[static_cast<size_t>(l)]) < 1e-5);
    }
  }
#endif
  // Where it does not fit, the caller is told (an undefined tensor): more rows than the
  // skinny GEMM takes, a width past 256, more than eight layers, a parameter used twice.
  auto chain = [](int64_t rows, std::vector<int64_t> widths) {
    std::vector<LinearLayer> layers;
    for (size_t l = 0; l + 1 < widths.size(); ++l)
      layers.push_back({Tensor::zeros({widths[l + 1], widths[l]}, DType::f32, gpu), Tensor(), Act::relu});
    return linear_chain(Tensor::zeros({rows, widths[0]}, DType::f32, gpu), layers);
  };
  CHECK(chain(256, {16, 128, 4}).defined());
  CHECK(!chain(257, {16, 128, 4}).defined());
  CHECK(!chain(8, {16, 257, 4}).defined());
  CHECK(!chain(8, std::vector<int64_t>(10, 8)).defined());
  // A parameter used by two layers of the run (one launch would write both sums into it).
  const Tensor shared = Tensor::zeros({16, 16}, DType::f32, gpu);
  CHECK(!linear_chain(Tensor::zeros({8, 16}, DType::f32, gpu), {{shared, Tensor(), Act::relu}, {shared, Tensor()}})
             .defined());
}

TEST_CASE("gelu_mlp_bf16 matches the CPU: the GELU's backward in the GEMM epilogue (DGELU), forward and backward",
          "[gpu][ops][bf16]") {
  // 2048 x 512 -> 2048 -> 512: every GEMM over 2^30 multiply-adds, so cuBLASLt's epilogues
  // (GELU_AUX_BIAS forward, DGELU backward) apply; and a small one (the plain paths).
  for (int64_t rows : {2048, 40})
    for (bool keep_h : {true, false}) {
      const int64_t c = rows == 2048 ? 512 : 24;
      INFO(rows << " x " << c << (keep_h ? ", keeping h" : ", rebuilding h"));
      compare([&](const Device& d) { return bf16_mlp_step(d, rows, c, true, keep_h); }, 5e-3);
      // And the fused op against two layers on the GPU: within bf16 rounding of dz.
      const auto fused = bf16_mlp_step(gpu, rows, c, true, keep_h), layers = bf16_mlp_step(gpu, rows, c, false, keep_h);
      for (size_t i = 0; i < fused.size(); ++i) {
        INFO("output " << i);
        CHECK(rel_error(fused[i].to_host(), layers[i].to_host()) < 5e-3);
      }
    }
}

TEST_CASE("bf16 linear, activations and losses match the CPU bf16 ops, forward and backward", "[gpu][ops][bf16]") {
  // linear_bf16 below 2^30 multiply-adds: cuBLAS to fp32, then the bias/activation kernel.
  // At 2^30 and above (relu, none, and gelu_tanh with the pre-activation as its aux
  // output): cuBLASLt's epilogue writes y directly.
  struct Size {
    int64_t rows, in, out;
  };
  for (Size s : {Size{37, 53, 29}, Size{1024, 1024, 1024}})
    for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh, Act::gelu_tanh}) {
      if (s.rows == 1024 && (act == Act::gelu || act == Act::tanh)) continue;  // the same path as the small size
      INFO(s.rows << "x" << s.in << " -> " << s.out << " " << nn::act_name(act));
      const auto x = randn(s.rows * s.in, 6), W = randn(s.out * s.in, 7, 0.3f), b = randn(s.out, 8);
      const auto t = randn(s.rows * s.out, 9);
      compare(
          [&](const Device& d) {
            Tensor xx = on(d, x, {s.rows, s.in}).set_requires_grad(true);
            Tensor WW = on(d, W, {s.out, s.in}).set_requires_grad(true), bb = on(d, b, {s.out}).set_requires_grad(true);
            Tensor y = linear_bf16(cast(xx, DType::bf16), WW, bb, cast(WW.detach(), DType::bf16),
                                   cast(bb.detach(), DType::bf16), act);
            Tensor loss = mse_loss(y, on(d, t, {s.rows, s.out}));
            loss.backward();
            return std::vector<Tensor>{y.detach(), loss, xx.grad(), WW.grad(), bb.grad()};
          },
          5e-3);
    }
  {  // Two backwards into the same gradients at 2^30 (the epilogue's sizes): the second adds.
    const auto x = randn(1024 * 1024, 16), W = randn(1024 * 1024, 17, 0.3f), b = randn(1024, 18);
    const auto t = randn(1024 * 1024, 19);
    compare(
        [&](const Device& d) {
          Tensor xx = on(d, x, {1024, 1024}).set_requires_grad(true);
          Tensor WW = on(d, W, {1024, 1024}).set_requires_grad(true), bb = on(d, b, {1024}).set_requires_grad(true);
          for (float scale : {1.0f, 0.5f}) {
            Tensor y = linear_bf16(cast(xx, DType::bf16), WW, bb, cast(WW.detach(), DType::bf16),
                                   cast(bb.detach(), DType::bf16), Act::gelu_tanh);
            run_backward(mse_loss(y, on(d, t, {1024, 1024})), scale);
          }
          return std::vector<Tensor>{xx.grad(), WW.grad(), bb.grad()};
        },
        5e-3);
  }
  for (Act act : {Act::relu, Act::gelu, Act::tanh, Act::gelu_tanh, Act::none}) {
    INFO(nn::act_name(act));
    const auto x = randn(1001 * 7, 10);  // not a multiple of 8: the vector loops' tails
    compare_bf16([&](const Device& d) { return std::vector<Tensor>{activation(on_bf16(d, x, {1001, 7}), act)}; }, 1);
    const auto dy = randn(1001 * 7, 14);
    // The backward from the same dy; tanh's and relu's derivative come from each side's
    // own output, which a last-bit difference of tanhf may round the other way.
    compare(
        [&](const Device& d) {
          Tensor xx = on_bf16(d, x, {1001, 7}).set_requires_grad(true);
          run_backward(activation(xx, act), on_bf16(d, dy, {1001, 7}));
          return std::vector<Tensor>{xx.grad()};
        },
        1e-2);
  }
  auto logits = randn(300 * 11, 11, 3.0f);
  std::vector<int32_t> labels(300);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int32_t>((i * 7) % 11);
  compare_bf16(
      [&](const Device& d) {
        Tensor l = on_bf16(d, logits, {300, 11}).set_requires_grad(true);
        Tensor loss = cross_entropy(l, Tensor::from_host_i32(labels, {300}, d));
        loss.backward();
        return std::vector<Tensor>{loss, l.grad()};
      },
      2);
  // The fused MSE over more elements than one block covers, and an odd size (scalar tail).
  for (int64_t n : {int64_t(1) << 20, int64_t(100003)}) {
    INFO("mse over " << n);
    auto y = randn(n, 12), t = randn(n, 13);
    compare_bf16(
        [&](const Device& d) {
          Tensor yy = on_bf16(d, y, {n}).set_requires_grad(true);
          Tensor loss = mse_loss(yy, on(d, t, {n}));
          loss.backward();
          return std::vector<Tensor>{loss, yy.grad()};
        },
        0);
    compare_bf16(
        [&](const Device& d) {  // the separate backward kernel (a seed other than 1)
          Tensor yy = on_bf16(d, y, {n}).set_requires_grad(true);
          run_backward(mse_loss(yy, on(d, t, {n})), 0.25f);
          return std::vector<Tensor>{yy.grad()};
        },
        0);
  }
}

#if DPT_WITH_CUDA
TEST_CASE("the fused activation backward and bias gradient match the CPU, fp32 and bf16", "[gpu][ops][bf16]") {
  // Shapes: one chunk (no second stage), several chunks, a partial last chunk, columns
  // that are not whole vectors (the scalar kernel), a single element, a tall matrix.
  struct Size {
    int64_t rows, cols;
  };
  const cudaStream_t st = static_cast<cudaStream_t>(context(gpu).stream());
  for (Size sz : {Size{64, 1000}, Size{1, 1}, Size{3, 5}, Size{1000, 264}, Size{700, 37}, Size{4097, 8}})
    for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh, Act::gelu_tanh})
      for (float beta : {0.0f, 1.0f}) {
        INFO(sz.rows << "x" << sz.cols << " act " << static_cast<int>(act) << " beta " << beta);
        const int64_t n = sz.rows * sz.cols;
        const auto dy = randn(n, 21), saved = randn(n, 22), db0 = randn(sz.cols, 23);
        Tensor work =
            Tensor::empty({std::max<int64_t>(1, cuda::act_bias_backward_work(sz.rows, sz.cols))}, DType::f32, gpu);
        {  // fp32, in place
          std::vector<float> want = dy, want_db = db0;
          cpu::act_bias_backward(want.data(), saved.data(), act, sz.rows, sz.cols, want.data(), beta, want_db.data());
          Tensor g = on(gpu, dy, {n}), s = on(gpu, saved, {n});
          Tensor db = on(gpu, beta == 0.0f ? std::vector<float>(db0.size(), NAN) : db0, {sz.cols});  // beta 0: not read
          cuda::act_bias_backward(g.f32(), s.f32(), act, sz.rows, sz.cols, g.f32(), beta, db.f32(), work.f32(), st);
          CHECK(rel_error(g.to_host(), want) < 1e-5);
          CHECK(rel_error(db.to_host(), want_db) < 1e-5);
        }
        {  // bf16, in place: the same bf16 inputs on both sides
          Tensor hg = on_bf16(host, dy, {n}), hs = on_bf16(host, saved, {n});
          std::vector<float> want_db = db0;
          cpu::act_bias_backward_bf16(hg.bf16(), hs.bf16(), act, sz.rows, sz.cols, hg.bf16(), beta, want_db.data());
          Tensor g = on_bf16(gpu, dy, {n}), s = on_bf16(gpu, saved, {n});
          Tensor db = on(gpu, beta == 0.0f ? std::vector<float>(db0.size(), NAN) : db0, {sz.cols});
          cuda::act_bias_backward_bf16(g.bf16(), s.bf16(), act, sz.rows, sz.cols, g.bf16(), beta, db.f32(), work.f32(),
                                       st);
          CHECK(test::max_ulps(test::bf16_bits(g), test::bf16_bits(hg)) <= 1);
          CHECK(rel_error(db.to_host(), want_db) < 1e-5);
        }
      }
}
#endif

#endif  // DPT_GPU_TESTS
