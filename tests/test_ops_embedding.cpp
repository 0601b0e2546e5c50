// The transformer ops of runtime/ops/embedding.cpp and layernorm.cpp: embedding,
// layer_norm and add. On the CPU: values against PyTorch and the definition, gradients
// against finite differences, a tied wte's two gradients adding up, bf16 against f32; on
// the GPU: each op forward and backward, f32 and bf16, against its CPU twin, and twice
// for the same bits; add_layer_norm against add and layer_norm, bit for bit.

#include <cmath>
#include <cstdint>
#include <vector>

#include <dptrain/error.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/ops.hpp>

#if DPT_WITH_CUDA
#include "kernels/cuda/cuda.hpp"
#endif

#include "catch.hpp"
#include "common.hpp"

using namespace dpt;
using namespace dpt::test;

namespace {

Tensor tokens_on(const Device& d, const std::vector<int32_t>& v, int64_t batch, int64_t seq) {
  return Tensor::from_host_i32(v, {batch, seq}, d);
}

// Tokens of a batch of 3 sequences of 4, some repeated (so that wte's rows sum several
// positions), over a vocabulary of 7 (tokens 2 and 6 appear nowhere).
const std::vector<int32_t> kTokens{1, 3, 3, 0, 5, 1, 4, 3, 0, 0, 1, 5};
constexpr int64_t kBatch = 3, kSeq = 4, kVocab = 7, kC = 6, kPositions = 5;

// A residual step through add_layer_norm and through add and layer_norm: the stream's next
// value and its gradients (a, b, gamma, beta), the sum feeding a later add as in a block.
std::vector<Tensor> residual_step(const Device& d, DType type, int64_t rows, int64_t C, bool fused) {
  Tensor a = cast(on(d, randn(rows * C, 31), {rows, C}), type).set_requires_grad(true);
  Tensor b = cast(on(d, randn(rows * C, 32), {rows, C}), type).set_requires_grad(true);
  Tensor g = on(d, randn(C, 33), {C}).set_requires_grad(true), be = on(d, randn(C, 34), {C}).set_requires_grad(true);
  AddNorm s;
  if (fused) s = add_layer_norm(a, b, g, be);
  else s.sum = add(a, b), s.normed = layer_norm(s.sum, g, be);
  Tensor y = add(s.sum, s.normed);
  run_backward(y, cast(on(d, randn(rows * C, 35), {rows, C}), type));
  return {s.sum, s.normed, y, a.grad(), b.grad(), g.grad(), be.grad()};
}

void same_bits(const std::vector<Tensor>& x, const std::vector<Tensor>& y) {
  REQUIRE(x.size() == y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    INFO("result " << i);
    REQUIRE(x[i].dtype() == y[i].dtype());
    if (x[i].dtype() == DType::bf16) CHECK(bf16_bits(x[i]) == bf16_bits(y[i]));
    else CHECK(x[i].to_host() == y[i].to_host());
  }
}
}  // namespace

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

TEST_CASE("embedding adds each token's wte row and its position's wpe row", "[ops][transformer]") {
  const Tensor wte = randn_tensor({kVocab, kC}, 1, host), wpe = randn_tensor({kPositions, kC}, 2, host);
  const Tensor y = embedding(tokens_on(host, kTokens, kBatch, kSeq), wte, wpe);
  REQUIRE(y.shape() == Shape{kBatch * kSeq, kC});
  const auto e = wte.to_host(), p = wpe.to_host(), got = y.to_host();
  for (int64_t n = 0; n < kBatch * kSeq; ++n)
    for (int64_t c = 0; c < kC; ++c) CHECK(got[n * kC + c] == e[kTokens[n] * kC + c] + p[(n % kSeq) * kC + c]);
  // bf16 output: the same fp32 sum, rounded once.
  const Tensor y16 = embedding(tokens_on(host, kTokens, kBatch, kSeq), wte, wpe, DType::bf16);
  CHECK(bf16_bits(y16) == bf16_bits(cast(y, DType::bf16)));
}

TEST_CASE("embedding refuses tokens outside the vocabulary on the CPU", "[ops][transformer]") {
  const Tensor wte = randn_tensor({kVocab, kC}, 1, host), wpe = randn_tensor({kPositions, kC}, 2, host);
  for (int32_t bad : {-1, static_cast<int32_t>(kVocab)}) {
    auto v = kTokens;
    v[5] = bad;
    CHECK_THROWS_AS(embedding(tokens_on(host, v, kBatch, kSeq), wte, wpe), Error);
  }
  // wpe shorter than the sequence, an f32 token tensor, a 1-D one: usage errors.
  CHECK_THROWS_AS(embedding(tokens_on(host, kTokens, kBatch, kSeq), wte, randn_tensor({3, kC}, 2, host)), Error);
  CHECK_THROWS_AS(embedding(randn_tensor({kBatch, kSeq}, 3, host), wte, wpe), Error);
  CHECK_THROWS_AS(embedding(Tensor::from_host_i32(kTokens, {12}, host), wte, wpe), Error);
}

TEST_CASE("embedding gradients match finite differences, wpe rows past the sequence get 0",
          "[ops][grad][transformer]") {
  // (requires_grad set here, so that check_gradients' copies share these tensors' gradients)
  Tensor wte = randn_tensor({kVocab, kC}, 4, host).set_requires_grad(true);
  Tensor wpe = randn_tensor({kPositions, kC}, 5, host).set_requires_grad(true);
  const Tensor tokens = tokens_on(host, kTokens, kBatch, kSeq);
  check_gradients([&] { return embedding(tokens, wte, wpe); }, {wte, wpe});
  const auto dwpe = wpe.grad().to_host(), dwte = wte.grad().to_host();
  for (int64_t c = 0; c < kC; ++c) {
    CHECK(dwpe[(kPositions - 1) * kC + c] == 0.0f);  // position 4 is past the sequence
    CHECK(dwte[2 * kC + c] == 0.0f);                 // token 2 appears nowhere
  }
}

TEST_CASE("a tied wte receives the embedding's and the output projection's gradients, added",
          "[ops][grad][transformer]") {
  // GPT's logits = embedding(tokens) wte^T: wte's gradient is the sum of both uses.
  Tensor wte = randn_tensor({kVocab, kC}, 6, host, 0.5f), wpe = randn_tensor({kPositions, kC}, 7, host, 0.5f);
  const Tensor tokens = tokens_on(host, kTokens, kBatch, kSeq);
  check_gradients([&] { return matmul(embedding(tokens, wte, wpe), wte, false, true); }, {wte, wpe});
}

TEST_CASE("layer_norm is PyTorch's F.layer_norm, forward and backward", "[ops][transformer]") {
  // Expected values: torch 2.15, float64, F.layer_norm(x, (5,), gamma, beta, 1e-5), then
  // y.backward(dy).
  const std::vector<float> xv{0.5f, -1.0f, 2.0f, 0.25f, -0.75f, 3.0f, 1.0f, -2.0f, 0.0f, 1.5f};
  const std::vector<float> gv{1.0f, 0.5f, -1.5f, 2.0f, 0.75f}, bv{0.1f, -0.2f, 0.3f, 0.0f, -0.5f};
  const std::vector<float> dyv{1.0f, -2.0f, 0.5f, 0.25f, 1.5f, -1.0f, 0.5f, 2.0f, -0.75f, 0.3f};
  const std::vector<double> want_y{0.381592712, -0.763185424, -2.23433441, 0.0938642374, -1.16878269,
                                   1.4844348,   -0.109710774, 2.73780911,  -0.842699445, -0.138843095};
  const std::vector<double> want_dx{0.818727319,  -1.28029423, -0.602160035, 0.312449998,   0.751276948,
                                    -0.709771057, 0.662448464, -0.364104151, -0.0810211907, 0.492447934};
  const std::vector<double> want_dgamma{-1.10284209, 2.34303092, -2.40563401, 0.327745322, -1.19310262};
  const std::vector<double> want_dbeta{0, -1.5, 2.5, -0.5, 1.8};
  Tensor x = Tensor::from_host(xv, {2, 5}, host).set_requires_grad(true);
  Tensor g = Tensor::from_host(gv, {5}, host).set_requires_grad(true);
  Tensor b = Tensor::from_host(bv, {5}, host).set_requires_grad(true);
  Tensor y = layer_norm(x, g, b);
  run_backward(y, Tensor::from_host(dyv, {2, 5}, host));
  const auto near = [](const std::vector<float>& got, const std::vector<double>& want) {
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("element " << i << ": " << got[i] << " against " << want[i]);
      CHECK(std::abs(got[i] - want[i]) <= 2e-6 * std::max(1.0, std::abs(want[i])));
    }
  };
  near(y.to_host(), want_y);
  near(x.grad().to_host(), want_dx);
  near(g.grad().to_host(), want_dgamma);
  near(b.grad().to_host(), want_dbeta);
}

TEST_CASE("layer_norm and add gradients match finite differences", "[ops][grad][transformer]") {
  Tensor x = randn_tensor({7, 9}, 8, host), g = randn_tensor({9}, 9, host), b = randn_tensor({9}, 10, host);
  check_gradients([&] { return layer_norm(x, g, b); }, {x, g, b});
  Tensor a = randn_tensor({4, 6}, 11, host), c = randn_tensor({4, 6}, 12, host);
  check_gradients([&] { return add(a, c); }, {a, c});
  // The residual stream: h + f(h), the same tensor reaching add twice.
  const Tensor g6 = randn_tensor({6}, 14, host), b6 = randn_tensor({6}, 15, host);
  check_gradients([&] { return add(a, layer_norm(a, g6, b6)); }, {a});
  CHECK_THROWS_AS(add(a, randn_tensor({6, 4}, 13, host)), Error);
  CHECK_THROWS_AS(add(a, cast(c, DType::bf16)), Error);
}

TEST_CASE("add_layer_norm is add then layer_norm: the same bits and gradients", "[ops][transformer]") {
  for (DType type : {DType::f32, DType::bf16}) {
    INFO(dtype_name(type));
    same_bits(residual_step(host, type, 7, 24, true), residual_step(host, type, 7, 24, false));
  }
  Tensor a = randn_tensor({5, 8}, 40, host), b = randn_tensor({5, 8}, 41, host);
  const Tensor g = randn_tensor({8}, 42, host), be = randn_tensor({8}, 43, host);
  check_gradients(
      [&] {
        const AddNorm s = add_layer_norm(a, b, g, be);
        return add(s.sum, s.normed);
      },
      {a, b});
  CHECK_THROWS_AS(add_layer_norm(a, randn_tensor({8, 5}, 44, host), g, be), Error);
  CHECK_THROWS_AS(add_layer_norm(a, b, randn_tensor({5}, 45, host), be), Error);
}

TEST_CASE("bf16 embedding, layer_norm and add match f32 within bf16 precision", "[ops][bf16][transformer]") {
  const auto xv = randn(37 * 24, 20);
  const Tensor g = randn_tensor({24}, 21, host), b = randn_tensor({24}, 22, host);
  Tensor x32 = Tensor::from_host(xv, {37, 24}, host).set_requires_grad(true);
  Tensor x16 = cast(Tensor::from_host(xv, {37, 24}, host), DType::bf16).set_requires_grad(true);
  const Tensor t = randn_tensor({37, 24}, 23, host);
  Tensor y32 = add(layer_norm(x32, g, b), x32), y16 = add(layer_norm(x16, g, b), x16);
  REQUIRE(y16.dtype() == DType::bf16);
  mse_loss(y32, t).backward();
  mse_loss(y16, t).backward();
  REQUIRE(x16.grad().dtype() == DType::bf16);
  CHECK(rel_error(cast(y16, DType::f32).to_host(), y32.to_host()) < 1e-2);
  CHECK(rel_error(cast(x16.grad(), DType::f32).to_host(), x32.grad().to_host()) < 2e-2);
  // The embedding's parameter gradients stay fp32 whatever its output type.
  for (DType out : {DType::f32, DType::bf16}) {
    Tensor wte = randn_tensor({kVocab, kC}, 24, host).set_requires_grad(true);
    Tensor wpe = randn_tensor({kPositions, kC}, 25, host).set_requires_grad(true);
    Tensor y = embedding(tokens_on(host, kTokens, kBatch, kSeq), wte, wpe, out);
    mse_loss(y, randn_tensor(y.shape(), 26, host)).backward();
    REQUIRE(wte.grad().dtype() == DType::f32);
  }
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

namespace {
// The op's outputs and gradients on d, f32 or bf16 activations: the same inputs everywhere.
// LayerNorm's dx is added into the gradient the add gave h (the residual stream's way).
std::vector<Tensor> transformer_ops(const Device& d, DType type, int64_t C = 96) {
  const int64_t batch = 4, seq = 33, vocab = 50, rows = batch * seq;
  std::vector<int32_t> tokens(static_cast<size_t>(rows));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7 + i / 5) % 23);  // repeats
  Tensor wte = on(d, randn(vocab * C, 1), {vocab, C}).set_requires_grad(true);
  Tensor wpe = on(d, randn((seq + 3) * C, 2), {seq + 3, C}).set_requires_grad(true);
  Tensor g = on(d, randn(C, 3), {C}).set_requires_grad(true), b = on(d, randn(C, 4), {C}).set_requires_grad(true);
  Tensor h = embedding(tokens_on(d, tokens, batch, seq), wte, wpe, type);
  Tensor y = add(h, layer_norm(h, g, b));
  run_backward(y, cast(on(d, randn(rows * C, 5), {rows, C}), type));
  return {y, wte.grad(), wpe.grad(), g.grad(), b.grad()};
}
}  // namespace

TEST_CASE("embedding, layer_norm and add match the CPU, f32 and bf16, forward and backward", "[gpu][ops]") {
  // Widths for LayerNorm's kernels: rows in a lane's registers (96; GPT-2's 768 in bf16;
  // 1024 in bf16, four vectors a lane) and the general kernels (768 in f32: too wide; 100
  // in bf16: not whole 16-byte vectors).
  for (int64_t C : {96, 768, 1024, 100}) {
    INFO("C " << C);
    compare([C](const Device& d) { return transformer_ops(d, DType::f32, C); }, 1e-5);
    // bf16: a last-bit difference in LayerNorm's output can grow in the residual sum's
    // cancellations, so relative error over the whole tensors rather than ulps.
    compare([C](const Device& d) { return transformer_ops(d, DType::bf16, C); }, 1e-2);
  }
}

#if DPT_WITH_CUDA
namespace {
// Inputs of LayerNorm's backward, the same on every device: x and dy (values of their
// type), gamma, a gradient for dx to be added into, and the rows' statistics from the CPU's
// forward.
struct LayerNormBackwardInputs {
  DType type;
  int64_t rows, C;
  std::vector<float> x, dy, gamma, dx_before, mean, rstd;
};

LayerNormBackwardInputs layer_norm_backward_inputs(DType type, int64_t rows, int64_t C) {
  const auto values = [&](uint64_t seed) {
    const auto v = randn(rows * C, seed);
    return type == DType::bf16 ? bf16_values(v) : v;
  };
  LayerNormBackwardInputs in{type, rows, C, values(61), values(62), randn(C, 63), values(64), {}, {}};
  in.mean.resize(static_cast<size_t>(rows));
  in.rstd.resize(static_cast<size_t>(rows));
  std::vector<float> y(in.x.size());
  const auto beta = randn(C, 65);
  cpu::layer_norm_forward(in.x.data(), in.gamma.data(), beta.data(), rows, C, 1e-5f, y.data(), in.mean.data(),
                          in.rstd.data());
  return in;
}

// How the backward is asked for dx: written, added into a gradient already there (dx_add,
// the residual stream's way), or not at all (the parameters' gradients alone).
enum class DxMode { write, add, none };

// LayerNorm's backward kernel on d, called directly: dx (the gradient it was added into;
// zeros where not asked for), dgamma, dbeta and dx's column sums (asked for with dx; left
// undefined where the kernels did not make them).
std::vector<Tensor> layer_norm_backward_on(const Device& d, const LayerNormBackwardInputs& in, DxMode mode) {
  const Shape s{in.rows, in.C};
  const Tensor x = cast(on(d, in.x, s), in.type), dy = cast(on(d, in.dy, s), in.type), g = on(d, in.gamma, {in.C});
  const Tensor mean = on(d, in.mean, {in.rows}), rstd = on(d, in.rstd, {in.rows});
  const Tensor dx = mode == DxMode::add ? cast(on(d, in.dx_before, s), in.type) : Tensor::zeros(s, in.type, d);
  const Tensor dgamma = Tensor::empty({in.C}, DType::f32, d), dbeta = Tensor::empty({in.C}, DType::f32, d);
  const bool bf16 = in.type == DType::bf16, add = mode == DxMode::add, want_dx = mode != DxMode::none;
  uint16_t* dx16 = bf16 && want_dx ? dx.bf16() : nullptr;
  float* dx32 = !bf16 && want_dx ? dx.f32() : nullptr;
  Tensor sums = want_dx ? Tensor::empty({in.C}, DType::f32, d) : Tensor();
  if (d.is_cpu()) {
    float* dx_sums = want_dx ? sums.f32() : nullptr;
    if (bf16)
      cpu::layer_norm_backward_bf16(x.bf16(), dy.bf16(), g.f32(), mean.f32(), rstd.f32(), in.rows, in.C, dx16, add, 0.f,
                                    dgamma.f32(), 0.f, dbeta.f32(), dx_sums);
    else
      cpu::layer_norm_backward(x.f32(), dy.f32(), g.f32(), mean.f32(), rstd.f32(), in.rows, in.C, dx32, add, 0.f,
                               dgamma.f32(), 0.f, dbeta.f32(), dx_sums);
  } else {
    const Tensor work = Tensor::empty({cuda::layer_norm_backward_work(in.rows, in.C)}, DType::f32, d);
    const int64_t chunks = cuda::layer_norm_backward_chunks(in.rows);
    const Tensor part = Tensor::empty({chunks, in.C}, DType::f32, d);
    const auto st = static_cast<cudaStream_t>(context(d).stream());
    const bool made =
        bf16 ? cuda::layer_norm_backward_bf16(x.bf16(), dy.bf16(), g.f32(), mean.f32(), rstd.f32(), in.rows, in.C, dx16,
                                              add, 0.f, dgamma.f32(), 0.f, dbeta.f32(), work.f32(), part.f32(), st)
             : cuda::layer_norm_backward(x.f32(), dy.f32(), g.f32(), mean.f32(), rstd.f32(), in.rows, in.C, dx32, add,
                                         0.f, dgamma.f32(), 0.f, dbeta.f32(), work.f32(), part.f32(), st);
    if (made) cuda::column_sums_finish({part.f32(), 0.f, sums.f32()}, {}, chunks, in.C, st);
    else sums = Tensor();
  }
  return {dx, dgamma, dbeta, sums};
}
}  // namespace

TEST_CASE(
    "layer_norm's backward kernels match the CPU's over 40001 rows, dx written, added or not asked for, dx's "
    "column sums",
    "[gpu][ops]") {
  // 40001 rows: more than 1024 chunks of the smallest size (32 rows), so the chunks grow (40
  // rows), the last one short. Widths: the fused kernel at three vectors a lane (GPT-2's
  // 768 in bf16) and four (1024 in bf16, 512 in f32); the general kernels (768 in f32).
  struct Width {
    DType type;
    int64_t C;
  };
  for (const Width w :
       {Width{DType::bf16, 768}, Width{DType::bf16, 1024}, Width{DType::f32, 768}, Width{DType::f32, 512}}) {
    const auto in = layer_norm_backward_inputs(w.type, 40001, w.C);
    for (DxMode mode : {DxMode::write, DxMode::add, DxMode::none}) {
      INFO(dtype_name(w.type) << ", C " << w.C << ", dx mode " << static_cast<int>(mode));
      const auto want = layer_norm_backward_on(host, in, mode), got = layer_norm_backward_on(gpu, in, mode);
      // dx: a last-bit difference of the row's sums may round a bf16 element the other way.
      const double dx_error = rel_error(got[0].to_host(), want[0].to_host());
      CHECK(dx_error < (w.type == DType::bf16 ? 1e-2 : 1e-5));
      // The column sums of 40001 terms: the CPU's, added in one fp32 line, are off by about
      // 5e-6 of their size.
      const double dgamma_error = rel_error(got[1].to_host(), want[1].to_host());
      const double dbeta_error = rel_error(got[2].to_host(), want[2].to_host());
      CHECK(dgamma_error < 1e-4);
      CHECK(dbeta_error < 1e-4);
      // dx's column sums: the fused kernel's (every width but f32's 768) are those of the dx
      // it wrote, as the CPU's are of its own.
      const bool fused = !(w.type == DType::f32 && w.C == 768) && mode != DxMode::none;
      REQUIRE(got[3].defined() == fused);
      if (fused) {
        CHECK(rel_error(got[3].to_host(), column_sums(got[0])) < 1e-5);
        CHECK(rel_error(want[3].to_host(), column_sums(want[0])) < 1e-5);
      }
      const auto again = layer_norm_backward_on(gpu, in, mode);
      for (size_t i = 0; i < got.size(); ++i) {
        INFO("the same bits twice, result " << i);
        if (got[i].defined()) CHECK(again[i].to_host() == got[i].to_host());
      }
    }
  }
}
#endif

TEST_CASE("embedding, layer_norm and add give the same bits twice on the GPU", "[gpu][ops]") {
  for (DType type : {DType::f32, DType::bf16}) {
    const auto a = transformer_ops(gpu, type, 768), b = transformer_ops(gpu, type, 768);
    for (size_t i = 0; i < a.size(); ++i) {
      INFO("result " << i);
      CHECK(a[i].to_host() == b[i].to_host());
    }
  }
}

TEST_CASE("add_layer_norm gives add and layer_norm's bits on the GPU and the CPU's values", "[gpu][ops]") {
  // Rows: an odd count (a row group or chunk of the kernels short at the end); widths as
  // above.
  for (int64_t C : {96, 768, 1024, 100})
    for (DType type : {DType::f32, DType::bf16}) {
      INFO("C " << C << ", " << dtype_name(type));
      same_bits(residual_step(gpu, type, 133, C, true), residual_step(gpu, type, 133, C, false));
      compare([&](const Device& d) { return residual_step(d, type, 133, C, true); }, type == DType::bf16 ? 1e-2 : 1e-5);
    }
  // A term that starts one element into its memory (not 16-byte aligned): the sum and its
  // LayerNorm still have layer_norm's bits, the ones a recomputation from the sum rebuilds.
  for (DType type : {DType::f32, DType::bf16}) {
    INFO("misaligned, " << dtype_name(type));
    const int64_t rows = 33, C = 768;
    const Tensor whole = cast(on(gpu, randn(rows * C + 1, 36), {rows * C + 1}), type);
    const Tensor a = whole.view(1, {rows, C}), b = cast(on(gpu, randn(rows * C, 37), {rows, C}), type);
    const Tensor g = on(gpu, randn(C, 38), {C}), be = on(gpu, randn(C, 39), {C});
    const AddNorm s = add_layer_norm(a, b, g, be);
    const Tensor sum = add(a, b);
    same_bits({s.sum, s.normed}, {sum, layer_norm(sum, g, be)});
  }
}

#endif  // DPT_GPU_TESTS
