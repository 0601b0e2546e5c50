// Where a bf16 layer's bias gradient comes from, other than its own pass over dz: the ones
// column a LayerNorm writes after its values (the weight gradient's GEMM makes the bias's
// too) and the column sums the LayerNorm backward makes of the residual stream's gradient
// (a residual projection's bias gradient, ColumnSums); on the CPU against the layers' own
// passes, on the GPU against the CPU too.

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <dptrain/runtime/ops.hpp>

#include "catch.hpp"
#include "common.hpp"

using namespace dpt;
using namespace dpt::test;

namespace {
// A LayerNorm (bf16 out) feeding a bf16 layer with a bias, as a GPT block's c_attn
// (linear_bf16_pre, c -> 3c) or its MLP (gelu_mlp_bf16), with or without the ones column
// (ops.hpp), the layer keeping the LayerNorm's output or rebuilding it (layer_norm_of);
// forward and backward of a squared error, twice (the second pass adds to the gradients).
// Gives y and the gradients of the LayerNorm's input and of every parameter.
std::vector<Tensor> norm_then_bf16(const Device& d, int64_t rows, int64_t c, bool mlp, bool ones, bool rebuild) {
  Tensor h = randn_tensor({rows, c}, 41, d).set_requires_grad(true);
  Tensor gamma = randn_tensor({c}, 42, d, 0.5f).set_requires_grad(true);
  Tensor beta = randn_tensor({c}, 43, d).set_requires_grad(true);
  const TwoLayers m(d, c, mlp ? 4 * c : 3 * c, 44);
  Tensor y;
  for (uint64_t pass = 0; pass < 2; ++pass) {
    const Tensor h16 = cast(h, DType::bf16);
    const Tensor x = layer_norm(h16, gamma, beta, 1e-5f, ones);
    const SavedInput saved = rebuild ? layer_norm_of(h16, gamma, beta, 1e-5f, ones) : SavedInput{};
    y = mlp ? gelu_mlp_bf16(x, m.fc, m.proj, true, saved, ones)
            : linear_bf16_pre(x, m.W1, m.b1, m.fc.W16, m.fc.b16, Act::none, saved, ones).y;
    mse_loss(y, randn_tensor(y.shape(), 48 + pass, d)).backward();
  }
  std::vector<Tensor> r{y.detach(), h.grad(), gamma.grad(), beta.grad(), m.W1.grad(), m.b1.grad()};
  if (mlp) r.insert(r.end(), {m.W2.grad(), m.b2.grad()});
  return r;
}

// Who else reads a tensor of residual_projections' graph.
enum class Reader { none, h, p };

// Two residual adds as a GPT's blocks make them, in bf16: h = a + p(x), y = LayerNorm(h), with
// p a projection c -> c (linear_bf16) or an MLP (gelu_mlp_bf16); h2 = h + q(y), q a
// projection c -> c; a squared error of LayerNorm(h2), plus h or p read again (`reader`).
// Each LayerNorm's backward makes the column sums of its input's gradient, which is p's or
// q's output gradient, for their bias gradients (ColumnSums). `detour` puts a round trip
// through fp32 between p and its add (the same values and gradients; a cast takes no sums,
// so p's bias gradient takes its own pass). Gives every leaf's gradient.
std::vector<Tensor> residual_projections(const Device& d, int64_t rows, int64_t c, bool mlp, bool detour,
                                         Reader reader) {
  const auto leaf = [&](uint64_t seed) {
    return cast(randn_tensor({rows, c}, seed, d), DType::bf16).set_requires_grad(true);
  };
  Tensor a = leaf(51), x = leaf(52);
  const auto param = [&](uint64_t seed, float std) { return randn_tensor({c}, seed, d, std).set_requires_grad(true); };
  Tensor g1 = param(53, 0.5f), be1 = param(54, 1.0f), g2 = param(55, 0.5f), be2 = param(56, 1.0f);
  const TwoLayers pl(d, c, mlp ? 4 * c : c, 57), ql(d, c, c, 62);
  Tensor p = mlp ? gelu_mlp_bf16(x, pl.fc, pl.proj, true) : linear_bf16(x, pl.W1, pl.b1, pl.fc.W16, pl.fc.b16);
  const Tensor p_added = detour ? cast(cast(p, DType::f32), DType::bf16) : p;
  const AddNorm r1 = add_layer_norm(a, p_added, g1, be1);
  const Tensor q = linear_bf16(r1.normed, ql.W1, ql.b1, ql.fc.W16, ql.fc.b16);
  const AddNorm r2 = add_layer_norm(r1.sum, q, g2, be2);
  Tensor out = r2.normed;
  if (reader == Reader::h) out = add(out, r1.sum);
  if (reader == Reader::p) out = add(out, p);
  mse_loss(out, randn_tensor(out.shape(), 67, d)).backward();
  std::vector<Tensor> r{a.grad(),     x.grad(),  pl.W1.grad(), pl.b1.grad(), ql.W1.grad(),
                        ql.b1.grad(), g1.grad(), be1.grad(),   g2.grad(),    be2.grad()};
  if (mlp) r.insert(r.end(), {pl.W2.grad(), pl.b2.grad()});
  return r;
}

// The bias gradient of residual_projections' p: the projection's, or the MLP's c_proj's.
const Tensor& p_bias_grad(const std::vector<Tensor>& grads, bool mlp) { return grads[mlp ? 11 : 3]; }
}  // namespace

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

TEST_CASE("a ones column: LayerNorm writes it, bf16 layers read past it and make the bias gradient in dW's GEMM",
          "[ops][bf16]") {
  CHECK(ones_column_width(768) == 776);
  CHECK(ones_column_width(29) == 32);
  CHECK(ones_column_width(8) == 16);
  CHECK(ones_column_width(7) == 8);
  // The LayerNorm's values, then 1, then 0s: alone and after the residual add.
  const Tensor a = cast(randn_tensor({37, 29}, 1, host), DType::bf16),
               b = cast(randn_tensor({37, 29}, 2, host), DType::bf16);
  const Tensor g = randn_tensor({29}, 3, host), be = randn_tensor({29}, 4, host);
  const Tensor plain = layer_norm(a, g, be), padded = layer_norm(a, g, be, 1e-5f, true);
  const AddNorm sum_plain = add_layer_norm(a, b, g, be), sum_padded = add_layer_norm(a, b, g, be, 1e-5f, true);
  REQUIRE(padded.shape() == Shape{37, 32});
  REQUIRE(sum_padded.normed.shape() == Shape{37, 32});
  CHECK(bf16_bits(sum_padded.sum) == bf16_bits(sum_plain.sum));
  for (const auto& [got, want] : {std::pair{padded, plain}, std::pair{sum_padded.normed, sum_plain.normed}}) {
    const auto gv = got.to_host(), wv = want.to_host();
    for (int64_t r = 0; r < 37; ++r) {
      INFO("row " << r);
      CHECK(std::equal(wv.begin() + r * 29, wv.begin() + r * 29 + 29, gv.begin() + r * 32));
      CHECK(std::vector<float>(gv.begin() + r * 32 + 29, gv.begin() + r * 32 + 32) == std::vector<float>{1, 0, 0});
    }
  }
  CHECK(test::usage_error([&] {
          layer_norm(randn_tensor({4, 29}, 5, host), g, be, 1e-5f, true);
        }) == "layer_norm: a ones column is for bf16 outputs");
  // c_attn and the MLP after it: the same values, the same gradients but for the bias's
  // order of summation, whether the layer keeps its input or rebuilds it.
  for (bool mlp : {false, true})
    for (bool rebuild : {false, true}) {
      INFO((mlp ? "gelu_mlp_bf16" : "linear_bf16_pre") << (rebuild ? ", rebuilding its input" : ""));
      const auto with = norm_then_bf16(host, 37, 24, mlp, true, rebuild);
      const auto without = norm_then_bf16(host, 37, 24, mlp, false, rebuild);
      CHECK(bf16_bits(with[0]) == bf16_bits(without[0]));
      for (size_t i = 1; i < with.size(); ++i) {
        INFO("gradient " << i);
        CHECK(rel_error(with[i].to_host(), without[i].to_host()) < 1e-5);
      }
      if (rebuild) {
        const auto kept = norm_then_bf16(host, 37, 24, mlp, true, false);
        for (size_t i = 0; i < with.size(); ++i) CHECK(with[i].to_host() == kept[i].to_host());
      }
    }
  // A ones column is said, not guessed from a width: refused where x has none, where x is a
  // leaf (its gradient would have none), and where a saved rebuild has other values.
  const TwoLayers m(host, 29, 87, 50);
  const Tensor x29 = cast(randn_tensor({4, 29}, 6, host), DType::bf16);
  CHECK(test::usage_error([&] { linear_bf16_pre(x29, m.W1, m.b1, m.fc.W16, m.fc.b16, Act::none, {}, true); }) ==
        "linear_bf16: input [4, 29] with a ones column does not fit weight [87, 29] (bf16 copy [87, 29])");
  CHECK(test::usage_error([&] {
          linear_bf16_pre(layer_norm(x29, g, be, 1e-5f, true), m.W1, m.b1, m.fc.W16, m.fc.b16, Act::none);
        }).rfind("linear_bf16: input [4, 32] does not fit weight", 0) == 0);
  Tensor leaf = cast(randn_tensor({4, 32}, 7, host), DType::bf16).set_requires_grad(true);
  CHECK(test::usage_error([&] {
          linear_bf16_pre(leaf, m.W1, m.b1, m.fc.W16, m.fc.b16, Act::none, {}, true);
        }).rfind("linear_bf16: an input with a ones column is a LayerNorm's output, not a leaf", 0) == 0);
  const Tensor x30 = cast(randn_tensor({4, 30}, 8, host), DType::bf16);
  const Tensor g30 = randn_tensor({30}, 9, host), b30 = randn_tensor({30}, 10, host);
  const Tensor padded29 = layer_norm(x29, g, be, 1e-5f, true);
  CHECK(test::usage_error([&] {
          linear_bf16_pre(padded29, m.W1.detach().set_requires_grad(true), m.b1, m.fc.W16, m.fc.b16, Act::none,
                          layer_norm_of(x30, g30, b30, 1e-5f, true), true);
        }).find("does not rebuild x [4, 32] bf16 of 29 values") != std::string::npos);
}

TEST_CASE("a residual projection's bias gradient comes with the LayerNorm backward's column sums", "[ops][bf16]") {
  // The CPU's sums are in row order both ways: the same bits as the projection's own pass,
  // where the sums came with the gradient (nothing else read p or h) and where they were
  // dropped (p read again: its gradient is a sum of two) or include another reader's part (h).
  for (bool mlp : {false, true})
    for (Reader reader : {Reader::none, Reader::h, Reader::p}) {
      INFO((mlp ? "gelu_mlp_bf16" : "linear_bf16") << ", reader " << static_cast<int>(reader));
      const auto with = residual_projections(host, 37, 24, mlp, false, reader);
      const auto without = residual_projections(host, 37, 24, mlp, true, reader);
      for (size_t i = 0; i < with.size(); ++i) {
        INFO("gradient " << i);
        CHECK(with[i].to_host() == without[i].to_host());
      }
      // a's gradient is h's, which p's is where nothing else reads p.
      if (reader != Reader::p) CHECK(rel_error(p_bias_grad(with, mlp).to_host(), column_sums(with[0])) < 1e-6);
    }
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

TEST_CASE("a ones column's bias gradients match the CPU: LayerNorm, then c_attn or the MLP", "[gpu][ops][bf16]") {
  // The LayerNorm's ones column, alone and after the residual add: the fused kernels (512
  // columns) and the general ones (29).
  for (int64_t c : {512, 29}) {
    INFO(c << " columns");
    compare(
        [&](const Device& d) {
          const Tensor a = cast(randn_tensor({300, c}, 1, d), DType::bf16),
                       b = cast(randn_tensor({300, c}, 2, d), DType::bf16);
          const Tensor g = randn_tensor({c}, 3, d), be = randn_tensor({c}, 4, d);
          const AddNorm r = add_layer_norm(a, b, g, be, 1e-5f, true);
          return std::vector<Tensor>{layer_norm(a, g, be, 1e-5f, true), r.sum, r.normed};
        },
        1e-2);
  }
  // 2048 x 512 -> 1536 or 2048: the forward GEMMs reach cuBLASLt reading past the ones
  // column (lda); and a small one of 29 columns (cuBLAS's GEMM after a packed copy, the
  // general LayerNorm, the split a float at a time). Two passes: the split adds to dW and db.
  for (int64_t rows : {2048, 40})
    for (bool mlp : {false, true})
      for (bool rebuild : {false, true}) {
        const int64_t c = rows == 2048 ? 512 : 29;
        INFO(rows << " x " << c << (mlp ? ", gelu_mlp_bf16" : ", linear_bf16_pre") << (rebuild ? ", rebuilt" : ""));
        compare([&](const Device& d) { return norm_then_bf16(d, rows, c, mlp, true, rebuild); }, 5e-3);
        const auto with = norm_then_bf16(gpu, rows, c, mlp, true, rebuild);
        const auto without = norm_then_bf16(gpu, rows, c, mlp, false, rebuild);
        for (size_t i = 0; i < with.size(); ++i) {  // (cuBLASLt may take another kernel for another lda)
          INFO("output " << i);
          CHECK(rel_error(with[i].to_host(), without[i].to_host()) < 5e-3);
        }
      }
}

TEST_CASE("a residual projection's bias gradient from the LayerNorm backward's sums matches the CPU and its own pass",
          "[gpu][ops][bf16]") {
  // 2048 x 512: the fused LayerNorm backward makes the sums in 64 chunks of 32 rows.
  for (bool mlp : {false, true})
    for (Reader reader : {Reader::none, Reader::h, Reader::p}) {
      INFO((mlp ? "gelu_mlp_bf16" : "linear_bf16") << ", reader " << static_cast<int>(reader));
      compare([&](const Device& d) { return residual_projections(d, 2048, 512, mlp, false, reader); }, 5e-3);
      const auto with = residual_projections(gpu, 2048, 512, mlp, false, reader);
      const auto without = residual_projections(gpu, 2048, 512, mlp, true, reader);
      for (size_t i = 0; i < with.size(); ++i) {  // the bias gradients' sums in another order
        INFO("gradient " << i);
        CHECK(rel_error(with[i].to_host(), without[i].to_host()) < 1e-5);
      }
      if (reader != Reader::p) CHECK(rel_error(p_bias_grad(with, mlp).to_host(), column_sums(with[0])) < 1e-5);
    }
}

#endif  // DPT_GPU_TESTS
