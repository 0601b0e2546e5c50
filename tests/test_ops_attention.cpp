// The transformer's ops: causal self-attention and the fused classifier loss. On the CPU,
// against PyTorch's values (constants below), finite differences and their fp32 selves in
// bf16; on the GPU, each CUDA op, forward and backward, f32 and bf16, against its CPU twin,
// and twice for the same bits.

#include <cmath>
#include <cstdint>
#include <vector>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/ops.hpp>
#include "catch.hpp"
#include "common.hpp"
#include "kernels/attention.hpp"
#if DPT_WITH_CUDNN_FRONTEND
#include <algorithm>

#include <dptrain/runtime/context.hpp>
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/cuda.hpp"
#include "kernels/cuda/sdpa.hpp"
#endif

using namespace dpt;
using namespace dpt::test;

namespace {

// qkv [B*T, 3C] for `heads` heads of `hs` columns.
Shape qkv_shape(int64_t B, int64_t T, int64_t heads, int64_t hs) { return {B * T, 3 * heads * hs}; }

// Logits [rows, cols] from the random source, their padding columns [vocab, cols) NaN
// (masked: they must change nothing), and targets spread over [0, vocab).
std::vector<float> padded_logits(int64_t rows, int64_t cols, int64_t vocab, uint64_t seed) {
  auto v = randn(rows * cols, seed, 2.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = vocab; c < cols; ++c) v[static_cast<size_t>(r * cols + c)] = NAN;
  return v;
}
std::vector<int32_t> spread_targets(int64_t rows, int64_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) t[static_cast<size_t>(r)] = static_cast<int32_t>((r * 7919) % vocab);
  return t;
}

}  // namespace

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

namespace {

// scale * sin(a i + b), rounded to float: inputs that a PyTorch script makes alike
// (np.float32(scale * math.sin(a * i + b))).
std::vector<float> waves(int64_t n, double a, double b, double scale) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] = static_cast<float>(scale * std::sin(a * static_cast<double>(i) + b));
  return v;
}

}  // namespace

TEST_CASE("causal attention matches PyTorch's scaled_dot_product_attention", "[ops][attention]") {
  // B 2, T 3, 2 heads of 2: qkv = waves(72, 0.37, 0.1, 1.5), w = waves(24, 0.61, 0.3, 1):
  //   y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(6, 4)
  //   (q, k, v = qkv.split(4, 1), each .reshape(2, 3, 2, 2).transpose(1, 2)), in float64,
  //   and qkv's gradient from (y * w).sum().backward().
  const std::vector<float> want_y = {
      0.12225322f, -0.42663857f,  -0.91778684f, -1.284717f,   1.3594123f,   1.4284511f,  0.27752302f, -0.053835568f,
      0.2894461f,  0.039007952f,  0.16277256f,  0.52463327f,  -0.93387169f, -1.2951502f, -1.4811362f, -1.4666574f,
      0.23919331f, -0.093354604f, -0.4775625f,  -0.72477593f, 0.17399078f,  0.53996973f, 0.33192447f, 0.51625403f};
  const std::vector<float> want_dqkv = {0.f,
                                        0.f,
                                        0.f,
                                        0.f,
                                        0.10893287f,
                                        0.022087438f,
                                        -0.85848655f,
                                        -0.54161487f,
                                        -0.24592342f,
                                        0.48699527f,
                                        0.65902933f,
                                        0.44005626f,
                                        -0.0049390246f,
                                        -0.0032231951f,
                                        0.29212715f,
                                        -0.33434632f,
                                        -0.18761827f,
                                        -0.035750076f,
                                        0.88734688f,
                                        0.60283992f,
                                        0.16361946f,
                                        -0.31209404f,
                                        -0.36802189f,
                                        -0.45479983f,
                                        0.19803308f,
                                        0.00094649726f,
                                        -0.18290187f,
                                        -0.11151815f,
                                        0.078685402f,
                                        0.013662638f,
                                        -0.028860326f,
                                        -0.061225056f,
                                        -0.12393872f,
                                        -0.065733443f,
                                        0.094193539f,
                                        0.53703428f,
                                        0.f,
                                        0.f,
                                        0.f,
                                        0.f,
                                        -0.77366844f,
                                        -0.49796671f,
                                        0.82111167f,
                                        1.2550729f,
                                        0.67319835f,
                                        0.5154868f,
                                        0.32976718f,
                                        -0.051916761f,
                                        0.2418398f,
                                        -0.32074218f,
                                        -0.69396349f,
                                        -1.0289947f,
                                        0.7972472f,
                                        0.54667333f,
                                        0.19755192f,
                                        -0.093481186f,
                                        -0.30606374f,
                                        -0.4372032f,
                                        -0.44602651f,
                                        -0.28628217f,
                                        -0.13617662f,
                                        -0.091644376f,
                                        -0.7572665f,
                                        0.0646839f,
                                        -0.023578758f,
                                        -0.048706626f,
                                        -1.0186636f,
                                        -1.1615917f,
                                        -0.054061798f,
                                        0.42162884f,
                                        0.62269108f,
                                        0.66847799f};
  Tensor qkv = Tensor::from_host(waves(72, 0.37, 0.1, 1.5), qkv_shape(2, 3, 2, 2), host).set_requires_grad(true);
  Tensor y = causal_attention(qkv, 3, 2);
  REQUIRE(y.shape() == Shape{6, 4});
  CHECK(rel_error(y.to_host(), want_y) < 1e-6);
  run_backward(y, Tensor::from_host(waves(24, 0.61, 0.3, 1.0), {6, 4}, host));
  CHECK(rel_error(qkv.grad().to_host(), want_dqkv) < 1e-6);
}

TEST_CASE("causal attention gradients match finite differences", "[ops][attention][grad]") {
  struct Case {
    int64_t B, T, heads, hs;
  };
  // One head over T = 37 (not a multiple of 32), several heads, a sequence of one.
  for (Case c : {Case{1, 37, 1, 4}, Case{2, 5, 3, 3}, Case{3, 1, 2, 2}}) {
    INFO("B " << c.B << " T " << c.T << " heads " << c.heads << " hs " << c.hs);
    Tensor qkv = randn_tensor(qkv_shape(c.B, c.T, c.heads, c.hs), 21, host);
    check_gradients([&] { return causal_attention(qkv, c.T, c.heads); }, {qkv});
  }
}

TEST_CASE("causal attention sees only the past, and a sequence of one gives its v", "[ops][attention]") {
  const int64_t T = 6, heads = 2, hs = 3, C = heads * hs;
  auto v = randn(T * 3 * C, 22);
  const auto y = causal_attention(on(host, v, qkv_shape(1, T, heads, hs)), T, heads).to_host();
  for (int64_t c = 0; c < 3 * C; ++c) v[static_cast<size_t>((T - 1) * 3 * C + c)] += 1.0f;  // the last position
  const auto y2 = causal_attention(on(host, v, qkv_shape(1, T, heads, hs)), T, heads).to_host();
  CHECK(std::vector<float>(y.begin(), y.end() - C) == std::vector<float>(y2.begin(), y2.end() - C));
  const auto one = causal_attention(on(host, v, qkv_shape(T, 1, heads, hs)), 1, heads).to_host();
  for (int64_t r = 0; r < T; ++r)
    for (int64_t c = 0; c < C; ++c)
      CHECK(one[static_cast<size_t>(r * C + c)] == v[static_cast<size_t>(r * 3 * C + 2 * C + c)]);
}

TEST_CASE("bf16 causal attention is the fp32 one on its values, rounded once; gradients within bf16",
          "[ops][attention][bf16]") {
  const int64_t B = 2, T = 9, heads = 2, hs = 8;
  const auto v = randn(B * T * 3 * heads * hs, 23);
  Tensor q16 = on_bf16(host, v, qkv_shape(B, T, heads, hs)).set_requires_grad(true);
  Tensor q32 = on(host, bf16_values(v), qkv_shape(B, T, heads, hs)).set_requires_grad(true);
  Tensor y16 = causal_attention(q16, T, heads), y32 = causal_attention(q32, T, heads);
  REQUIRE(y16.dtype() == DType::bf16);
  CHECK(bf16_bits(y16) == bf16_bits(y32));
  const Tensor seed = randn_tensor(y32.shape(), 24, host);
  run_backward(y16, cast(seed, DType::bf16));
  run_backward(y32, rounded(seed));
  REQUIRE(q16.grad().dtype() == DType::bf16);
  // The bf16 backward reads the rounded y (D_t = dy_t . y_t) and rounds dqkv once.
  const double e = rel_error(q16.grad().to_host(), q32.grad().to_host());
  INFO("relative error " << e);
  CHECK(e < 1e-2);
}

TEST_CASE("causal attention refuses what it cannot take", "[ops][attention]") {
  CHECK_THROWS_AS(causal_attention(Tensor::zeros({4, 3 * 129}, DType::f32, host), 4, 1), Error);  // head size 129
  CHECK_NOTHROW(causal_attention(Tensor::zeros({4, 3 * 128}, DType::f32, host), 4, 1));
  CHECK_THROWS_AS(causal_attention(Tensor::zeros({5, 24}, DType::f32, host), 2, 2), Error);  // rows not B*T
  CHECK_THROWS_AS(causal_attention(Tensor::zeros({4, 25}, DType::f32, host), 2, 2), Error);  // not 3C
  CHECK_THROWS_AS(causal_attention(Tensor::zeros({4, 18}, DType::f32, host), 2, 4), Error);  // C not heads * hs
  CHECK_THROWS_AS(causal_attention(Tensor::zeros({4, 24}, DType::i32, host), 2, 2), Error);
}

TEST_CASE("the classifier loss matches PyTorch's cross_entropy on the sliced logits", "[ops][classifier]") {
  // logits [3, 6] = waves(18, 0.83, 0.2, 2), vocab 5, targets {4, 0, 2}:
  //   F.cross_entropy(logits[:, :5], targets) in float64, and logits' gradient (0 in column 5).
  const std::vector<float> want_grad = {0.029673484f, 0.11077633f,   0.13562013f,  0.047737313f, -0.32380725f, 0.f,
                                        -0.32977414f, 0.012369454f,  0.061056493f, 0.15157433f,  0.10477386f,  0.f,
                                        0.012992929f, 0.0067257275f, -0.32055244f, 0.058731304f, 0.24210248f,  0.f};
  Tensor logits = Tensor::from_host(waves(18, 0.83, 0.2, 2.0), {3, 6}, host).set_requires_grad(true);
  Tensor loss = classifier_loss(logits, Tensor::from_host_i32({4, 0, 2}, {3}, host), 5);
  CHECK(std::fabs(loss.item() - 3.78530315) < 1e-6);
  loss.backward();
  CHECK(rel_error(logits.grad().to_host(), want_grad) < 1e-6);
  CHECK(logits.to_host() == logits.grad().to_host());  // the gradient took the logits' memory
}

TEST_CASE("the classifier loss is cross_entropy over the vocabulary; padding changes nothing",
          "[ops][classifier][grad]") {
  const int64_t rows = 7, cols = 12, vocab = 9;
  const auto v = padded_logits(rows, cols, vocab, 31);
  const auto targets = spread_targets(rows, vocab);
  std::vector<float> sliced;
  for (int64_t r = 0; r < rows; ++r) sliced.insert(sliced.end(), v.begin() + r * cols, v.begin() + r * cols + vocab);
  Tensor plain = on(host, sliced, {rows, vocab}).set_requires_grad(true);
  Tensor want = cross_entropy(plain, Tensor::from_host_i32(targets, {rows}, host));
  want.backward();
  const auto want_grad = plain.grad().to_host();
  Tensor logits = on(host, v, {rows, cols}).set_requires_grad(true);
  const Tensor t = Tensor::from_host_i32(targets, {rows}, host);
  {
    NoGradGuard g;  // no gradient wanted: the logits stay as they are
    CHECK(std::fabs(classifier_loss(logits, t, vocab).item() - want.item()) < 1e-6);
    const auto after = logits.to_host();
    bool same = true;
    for (size_t i = 0; i < v.size(); ++i) same = same && (std::isnan(v[i]) ? std::isnan(after[i]) : after[i] == v[i]);
    CHECK(same);
  }
  Tensor loss = classifier_loss(logits, t, vocab);
  CHECK(std::fabs(loss.item() - want.item()) < 1e-6);
  loss.backward();
  const auto g = logits.grad().to_host();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float got = g[static_cast<size_t>(r * cols + c)];
      if (c >= vocab) CHECK(got == 0.0f);
      else CHECK(std::fabs(got - want_grad[static_cast<size_t>(r * vocab + c)]) < 1e-6);
    }
  // Against finite differences too (on a copy: the forward with a gradient overwrites).
  Tensor fresh = on(host, sliced, {rows, vocab});
  auto f = [&] {
    NoGradGuard ng;
    return classifier_loss(fresh, t, vocab).item();
  };
  CHECK(rel_error(want_grad, numeric_grad(fresh, f)) < 2e-3);
  // A target outside the vocabulary shows as NaN.
  CHECK(std::isnan(classifier_loss(on(host, v, {rows, cols}),
                                   Tensor::from_host_i32(std::vector<int32_t>(rows, 9), {rows}, host), vocab)
                       .item()));
}

TEST_CASE("the classifier's gradient is scaled by the seed, from a number or a tensor", "[ops][classifier]") {
  const int64_t rows = 5, cols = 8, vocab = 7;
  const auto v = padded_logits(rows, cols, vocab, 32);
  const Tensor t = Tensor::from_host_i32(spread_targets(rows, vocab), {rows}, host);
  auto grad = [&](DType type, const std::function<void(const Tensor&)>& backward) {
    Tensor l = cast(on(host, v, {rows, cols}), type).set_requires_grad(true);
    backward(classifier_loss(l, t, vocab));
    return l.grad().to_host();
  };
  for (DType type : {DType::f32, DType::bf16}) {
    const auto unit = grad(type, [](const Tensor& loss) { loss.backward(); });
    std::vector<float> quarter = unit, triple = unit;
    for (float& e : quarter) e *= 0.25f;  // exact, in bf16 too
    for (float& e : triple) e = type == DType::bf16 ? bf16_float(bf16_round(3.0f * e)) : 3.0f * e;
    CHECK(grad(type, [](const Tensor& loss) { run_backward(loss, 0.25f); }) == quarter);
    CHECK(grad(type, [](const Tensor& loss) { run_backward(loss, Tensor::full({1}, 3.0f, host)); }) == triple);
  }
}

TEST_CASE("the bf16 classifier is the fp32 one on its values: the loss exactly, the gradient rounded once",
          "[ops][classifier][bf16]") {
  const int64_t rows = 6, cols = 40, vocab = 37;
  const auto v = padded_logits(rows, cols, vocab, 33);
  const Tensor t = Tensor::from_host_i32(spread_targets(rows, vocab), {rows}, host);
  Tensor l16 = on_bf16(host, v, {rows, cols}).set_requires_grad(true);
  Tensor l32 = on(host, bf16_values(v), {rows, cols}).set_requires_grad(true);
  Tensor loss16 = classifier_loss(l16, t, vocab), loss32 = classifier_loss(l32, t, vocab);
  CHECK(loss16.item() == loss32.item());
  loss16.backward();
  loss32.backward();
  REQUIRE(l16.grad().dtype() == DType::bf16);
  CHECK(bf16_bits(l16.grad()) == bf16_bits(l32.grad()));
  CHECK(rel_error(l16.grad().to_host(), l32.grad().to_host()) < 1e-2);
  CHECK_THROWS_AS(classifier_loss(l32.detach(), t, cols + 1), Error);
  CHECK_THROWS_AS(classifier_loss(l32.detach(), Tensor::from_host_i32({0}, {1}, host), vocab), Error);
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

namespace {

// f's results on the GPU, twice: the same bits.
void check_twice(const std::function<std::vector<Tensor>(const Device&)>& f) {
  const auto a = f(gpu), b = f(gpu);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("result " << i);
    CHECK(a[i].to_host() == b[i].to_host());
  }
}

}  // namespace

TEST_CASE("CUDA causal attention matches the CPU, forward and backward, f32 and bf16", "[gpu][ops][attention]") {
  struct Case {
    int64_t B, T, heads, hs;
  };
  // Head sizes 64 and 128, one head, T not a multiple of 32, a head size not one of 32.
  for (Case c : {Case{2, 37, 1, 64}, Case{1, 70, 2, 128}, Case{3, 5, 3, 20}, Case{2, 1, 2, 64}})
    for (DType type : {DType::f32, DType::bf16}) {
      INFO("B " << c.B << " T " << c.T << " heads " << c.heads << " hs " << c.hs << " bf16 " << (type == DType::bf16));
      const auto v = randn(c.B * c.T * 3 * c.heads * c.hs, 41);
      auto run = [&](const Device& d) {
        return value_and_grads([&](std::vector<Tensor>& in) { return causal_attention(in[0], c.T, c.heads); },
                               {cast(on(d, v, qkv_shape(c.B, c.T, c.heads, c.hs)), type)});
      };
      compare(run, type == DType::bf16 ? 1e-2 : 1e-4);
      check_twice(run);
    }
}

TEST_CASE("the CUDA classifier loss matches the CPU, f32 and bf16, and scales its gradient", "[gpu][ops][classifier]") {
  struct Case {
    int64_t rows, cols, vocab;
  };
  // GPT-2's vocabulary padded to 50304 and a small one of whole vectors (the row held in
  // shared memory, both types), and one that is not (the general kernel).
  for (Case c : {Case{8, 50304, 50257}, Case{5, 1024, 1000}, Case{67, 1030, 1000}})
    for (DType type : {DType::f32, DType::bf16})
      for (float seed : {1.0f, 0.5f}) {
        INFO(c.rows << " x " << c.cols << " vocab " << c.vocab << " bf16 " << (type == DType::bf16) << " seed "
                    << seed);
        const auto v = padded_logits(c.rows, c.cols, c.vocab, 42);
        const auto targets = spread_targets(c.rows, c.vocab);
        auto run = [&](const Device& d) {
          Tensor l = cast(on(d, v, {c.rows, c.cols}), type).set_requires_grad(true);
          Tensor loss = classifier_loss(l, Tensor::from_host_i32(targets, {c.rows}, d), c.vocab);
          run_backward(loss, seed);
          return std::vector<Tensor>{loss, l.grad()};
        };
        compare(run, type == DType::bf16 ? 1e-2 : 1e-5);
        check_twice(run);
      }
}

TEST_CASE("the CUDA classifier rounds each bf16 gradient to nearest even; a row with a NaN gives NaN",
          "[gpu][ops][classifier]") {
  // Logits of 0: exp(0) is 1 on the GPU too (by the bf16 kernel's ex2 form as well) and the
  // sum is the vocabulary's size exactly, so each gradient is a float the test computes as
  // the kernel does, rounded once; for each case here a truncation would give other bits. Row 1 holds a NaN (the
  // general path).
  for (auto [cols, vocab] : {std::pair<int64_t, int64_t>{1024, 1000}, {50304, 50257}})
    for (int64_t rows : {3, 7}) {
      INFO(rows << " x " << cols << " vocab " << vocab);
      std::vector<float> v(static_cast<size_t>(rows * cols), 0.f);
      v[static_cast<size_t>(cols + 17)] = NAN;
      const auto targets = spread_targets(rows, vocab);
      Tensor l = cast(on(gpu, v, {rows, cols}), DType::bf16).set_requires_grad(true);
      run_backward(classifier_loss(l, Tensor::from_host_i32(targets, {rows}, gpu), vocab), 1.0f);
      const std::vector<float> g = l.grad().to_host();
      const float inv_sum = 1.f / static_cast<float>(vocab), inv_rows = 1.f / static_cast<float>(rows);
      const float p = bf16_float(bf16_round(inv_sum * inv_rows));
      const float at_target = bf16_float(bf16_round((inv_sum - 1.f) * inv_rows));
      int64_t wrong = 0, not_nan = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const float got = g[static_cast<size_t>(r * cols + c)];
          if (r == 1 && c < vocab) not_nan += !std::isnan(got);
          else wrong += got != (c >= vocab ? 0.f : c == targets[static_cast<size_t>(r)] ? at_target : p);
        }
      CHECK(wrong == 0);
      CHECK(not_nan == 0);
    }
}

#if DPT_WITH_CUDNN_FRONTEND
TEST_CASE("cuDNN's fused attention matches dptrain's own bf16 kernel, forward and backward", "[gpu][ops][attention]") {
  struct Case {
    int64_t B, T, heads, hs;
  };
  // T not a multiple of 64, one head, head sizes 64 and 128, GPT-2's heads.
  for (Case c : {Case{2, 37, 1, 64}, Case{1, 100, 2, 128}, Case{2, 64, 12, 64}}) {
    INFO("B " << c.B << " T " << c.T << " heads " << c.heads << " hs " << c.hs);
    const AttentionShape s{c.B, c.T, c.heads, c.hs};
    const cuda::SdpaShape ss{c.B, c.heads, c.T, c.hs, true};
    cuda::set_device(gpu.index);
    auto h = static_cast<cudnnHandle_t>(context(gpu).dnn());
    REQUIRE(cuda::sdpa_supported(h, ss));
    const Tensor qkv =
        cast(on(gpu, randn(s.rows() * 3 * s.channels(), 43), qkv_shape(c.B, c.T, c.heads, c.hs)), DType::bf16);
    const Tensor dy = cast(on(gpu, randn(s.rows() * s.channels(), 44), {s.rows(), s.channels()}), DType::bf16);
    auto empty_like = [&](const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), gpu); };
    Tensor y_ours = empty_like(dy), y_cudnn = empty_like(dy), dqkv_ours = empty_like(qkv), dqkv_cudnn = empty_like(qkv);
    Tensor lse = Tensor::empty({s.softmax_rows()}, DType::f32, gpu),
           stats = Tensor::empty({s.softmax_rows()}, DType::f32, gpu);
    Tensor work = Tensor::empty({s.softmax_rows()}, DType::f32, gpu);
    const cudaStream_t st = static_cast<cudaStream_t>(context(gpu).stream());
    cuda::attention_forward_bf16(s, qkv.bf16(), y_ours.bf16(), lse.f32(), st);
    cuda::attention_backward_bf16(s, qkv.bf16(), y_ours.bf16(), dy.bf16(), lse.f32(), dqkv_ours.bf16(), work.f32(), st);
    const size_t ws_bytes = std::max(cuda::sdpa_forward_workspace(h, ss), cuda::sdpa_backward_workspace(h, ss));
    Tensor ws = Tensor::empty({static_cast<int64_t>(ws_bytes / 4 + 1)}, DType::f32, gpu);
    cuda::sdpa_forward(h, ss, qkv.bf16(), y_cudnn.bf16(), stats.f32(), ws.data());
    cuda::sdpa_backward(h, ss, qkv.bf16(), y_cudnn.bf16(), dy.bf16(), stats.f32(), dqkv_cudnn.bf16(), ws.data());
    // bf16 outputs: within a few of their ulps of each other (2^-8 relative), measured
    // against the largest value.
    CHECK(rel_error(y_cudnn.to_host(), y_ours.to_host()) < 1e-2);
    CHECK(rel_error(dqkv_cudnn.to_host(), dqkv_ours.to_host()) < 2e-2);
    // The deterministic backward gives its bits again; the fast one (dQ's parts added as
    // they finish) is as close to ours.
    Tensor again = empty_like(qkv), fast = empty_like(qkv);
    cuda::sdpa_backward(h, ss, qkv.bf16(), y_cudnn.bf16(), dy.bf16(), stats.f32(), again.bf16(), ws.data());
    CHECK(again.to_host() == dqkv_cudnn.to_host());
    cuda::SdpaShape fast_shape = ss;
    fast_shape.deterministic = false;
    REQUIRE(cuda::sdpa_supported(h, fast_shape));
    Tensor fast_ws =
        Tensor::empty({static_cast<int64_t>(cuda::sdpa_backward_workspace(h, fast_shape) / 4 + 1)}, DType::f32, gpu);
    cuda::sdpa_backward(h, fast_shape, qkv.bf16(), y_cudnn.bf16(), dy.bf16(), stats.f32(), fast.bf16(), fast_ws.data());
    CHECK(rel_error(fast.to_host(), dqkv_ours.to_host()) < 2e-2);
  }
}
#endif

#endif  // DPT_GPU_TESTS
