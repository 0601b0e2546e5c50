// CUDA against the CPU oracle: every op forward and backward, both GEMMs at every
// transpose and odd sizes, the random and cast kernels, the cuDNN convolution, pooling
// and batch-norm kernels, a 50-step training run, the allocator's steady state and its
// out-of-memory message. Runs only where there is a GPU (main.cpp exits 77 otherwise,
// and ctest reports the test skipped).
#include <climits>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>

#include <dptrain/error.hpp>
#include "kernels/cpu/cpu.hpp"
#if DPT_WITH_CUDA
#include "kernels/cuda/cuda.hpp"
#endif
#if DPT_WITH_CUDNN
#include <cuda_runtime_api.h>

#include "kernels/cuda/dnn.hpp"
#endif
#include <dptrain/data/dataset.hpp>
#include <dptrain/data/shuffle.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/train/trainer.hpp>
#include "catch.hpp"
#include "chunked_copy.hpp"
#include "common.hpp"
#include "data/ahead_loader.hpp"
#include "parallel/reducer.hpp"
#include "runtime/allocator.hpp"

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
std::vector<Tensor> value_and_grads(const std::function<Tensor(std::vector<Tensor>&)>& op, std::vector<Tensor> inputs) {
  for (auto& t : inputs) t.set_requires_grad(true);
  Tensor y = op(inputs);
  Tensor target = Tensor::from_host(randn(y.numel(), 77), y.shape(), y.device());
  mse_loss(y, target).backward();
  std::vector<Tensor> out{y.detach()};
  for (auto& t : inputs) out.push_back(t.grad());
  return out;
}
}  // namespace

TEST_CASE("a cuBLAS GEMM recorded into a CUDA graph allocates nothing there: its context's workspace serves",
          "[gpu][gemm][graph]") {
#if DPT_WITH_CUDA
  // 1024 x 64 x 4096 in fp32, the forward GEMM of a replica of a 4096-64-4096 model: without
  // a workspace of the handle's own, cuBLAS allocated one on the stream in the recording,
  // and replicas recording at once from their threads corrupted the graph.
  Context ctx(gpu);  // a handle never used before: its first GEMM is recorded
  const auto h = static_cast<cublasHandle_t>(ctx.blas());
  const auto st = static_cast<cudaStream_t>(ctx.stream());
  const Tensor A = on(gpu, randn(1024 * 4096, 1), {1024, 4096}), B = on(gpu, randn(64 * 4096, 2), {64, 4096});
  Tensor C = Tensor::empty({1024, 64}, DType::f32, gpu);
  context(gpu).synchronize();
  cudaGraph_t g = nullptr;
  REQUIRE(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  cuda::gemm_cublas(h, Precision::fp32, false, true, 1024, 64, 4096, 1.0f, A.f32(), B.f32(), 0.0f, C.f32());
  REQUIRE(cudaStreamEndCapture(st, &g) == cudaSuccess);
  size_t count = 0;
  REQUIRE(cudaGraphGetNodes(g, nullptr, &count) == cudaSuccess);
  std::vector<cudaGraphNode_t> nodes(count);
  REQUIRE(cudaGraphGetNodes(g, nodes.data(), &count) == cudaSuccess);
  int kernels = 0, allocations = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    REQUIRE(cudaGraphNodeGetType(node, &type) == cudaSuccess);
    kernels += type == cudaGraphNodeTypeKernel;
    allocations += type == cudaGraphNodeTypeMemAlloc || type == cudaGraphNodeTypeMemFree;
  }
  cudaGraphDestroy(g);
  CHECK(kernels >= 1);
  CHECK(allocations == 0);
#endif
}

TEST_CASE("GEMMs (cuBLAS, native, small-batch) match the CPU at every transpose and odd sizes", "[gpu][gemm]") {
  struct Size {
    int64_t m, n, k;
  };
#if DPT_WITH_CUDA
  // Each library directly: gemm() hands small-batch shapes to gemm_small.cu's kernels.
  const cublasHandle_t h = static_cast<cublasHandle_t>(context(gpu).blas());
  const cudaStream_t st = static_cast<cudaStream_t>(context(gpu).stream());
  for (bool native : {false, true})
    for (Size s : {Size{1, 1, 1}, Size{17, 33, 65}, Size{64, 1000, 1000}})
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          INFO((native ? "native " : "cublas ") << s.m << "x" << s.n << "x" << s.k << " ta " << ta << " tb " << tb);
          const Shape sa = ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, sb = tb ? Shape{s.n, s.k} : Shape{s.k, s.n};
          const auto A = randn(numel(sa), 1), B = randn(numel(sb), 2), C = randn(s.m * s.n, 3);
          std::vector<float> want = C;
          cpu::gemm(ta, tb, s.m, s.n, s.k, 0.5f, A.data(), B.data(), 0.25f, want.data());
          Tensor dA = on(gpu, A, sa), dB = on(gpu, B, sb), dC = on(gpu, C, {s.m, s.n});
          if (native) cuda::gemm_native(ta, tb, s.m, s.n, s.k, 0.5f, dA.f32(), dB.f32(), 0.25f, dC.f32(), st);
          else cuda::gemm_cublas(h, Precision::fp32, ta, tb, s.m, s.n, s.k, 0.5f, dA.f32(), dB.f32(), 0.25f, dC.f32());
          CHECK(rel_error(dC.to_host(), want) < 1e-5);
        }
#endif
  // Through gemm(), which picks among them.
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

#if DPT_WITH_CUDA
TEST_CASE("cuBLASLt GEMMs with the bias and ReLU epilogue match the CPU", "[gpu][gemm]") {
  // Linear takes this path only for large GEMMs; here it is called directly at odd
  // sizes, every transpose, with and without bias, beta 0 (over NaN) and beta != 0.
  struct Size {
    int64_t m, n, k;
  };
  const cublasHandle_t h = static_cast<cublasHandle_t>(context(gpu).blas());
  const cudaStream_t st = static_cast<cudaStream_t>(context(gpu).stream());
  Tensor ws = Tensor::empty({static_cast<int64_t>(cuda::kLtWorkspaceBytes / sizeof(float))}, DType::f32, gpu);
  for (Size s : {Size{1, 1, 1}, Size{17, 33, 65}, Size{64, 1000, 1000}, Size{130, 67, 129}})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (Act act : {Act::none, Act::relu})
          for (bool bias : {false, true})
            for (float beta : {0.0f, 0.5f}) {
              INFO(s.m << "x" << s.n << "x" << s.k << " ta " << ta << " tb " << tb << " relu " << (act == Act::relu)
                       << " bias " << bias << " beta " << beta);
              const Shape sa = ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, sb = tb ? Shape{s.n, s.k} : Shape{s.k, s.n};
              const auto A = randn(numel(sa), 1), B = randn(numel(sb), 2), b = randn(s.n, 4);
              auto C = randn(s.m * s.n, 3);
              std::vector<float> want = C;
              cpu::gemm(ta, tb, s.m, s.n, s.k, 1.0f, A.data(), B.data(), beta, want.data());
              cpu::bias_act_forward(want.data(), bias ? b.data() : nullptr, act, s.m, s.n, nullptr, want.data());
              if (beta == 0.0f) C.assign(C.size(), NAN);  // beta == 0 must not read C
              Tensor dA = on(gpu, A, sa), dB = on(gpu, B, sb), db = on(gpu, b, {s.n}), dC = on(gpu, C, {s.m, s.n});
              REQUIRE(cuda::gemm_lt(h, st, Precision::fp32, ta, tb, s.m, s.n, s.k, 1.0f, dA.f32(), dB.f32(), beta,
                                    dC.f32(), bias ? db.f32() : nullptr, act, ws.data(), cuda::kLtWorkspaceBytes));
              const double err = rel_error(dC.to_host(), want);
              INFO("relative error " << err);
              CHECK(err < 1e-5);
            }
}
#endif

#if DPT_WITH_CUDA
TEST_CASE("the activation backward with a transposed copy matches the CPU", "[gpu][ops]") {
  struct Size {
    int64_t rows, cols;
  };
  for (Size sz : {Size{1, 1}, Size{33, 65}, Size{64, 31}, Size{100, 257}})
    for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh}) {
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
        Case{9, {7, 8, 8, 8, 8, 8, 8, 8, 3}, Act::relu, true}, Case{77, {8, 64, 40, 5, 3}, Act::tanh, true}}) {
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
        return std::pair<std::vector<float>, std::vector<int32_t>>{P.to_host(), step.counter.to_host_i32()};
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
    for (const float momentum : {0.9f, 0.0f, -1.0f})  // -1: AdamW
      for (float clip : {0.0f, 0.5f}) {
        const bool adam = momentum < 0.0f;
        const int buffers = adam ? 3 : momentum != 0.0f ? 2 : 1;
        INFO("n " << n << (adam ? " adamw" : " sgd momentum ") << (adam ? 0.0f : momentum) << " clip " << clip);
        enum Mode { two_launches, checked, with_backup, alternating };
        auto run = [&](Mode mode) {
          const auto p = randn(n, 50);
          auto bad = randn(n, 51);
          bad[static_cast<size_t>(n / 2)] = NAN;
          const Tensor P = on(gpu, p, {n}), M = Tensor::zeros({n}, DType::f32, gpu),
                       V = Tensor::zeros({n}, DType::f32, gpu);
          const Tensor P2 = Tensor::empty({n}, DType::f32, gpu), M2 = Tensor::empty({n}, DType::f32, gpu),
                       V2 = Tensor::empty({n}, DType::f32, gpu);
          const Tensor S = cast(P, DType::bf16);
          const Tensor G = on(gpu, randn(n, 52), {n}), B = on(gpu, bad, {n});
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

TEST_CASE("twin buffers by default on a GPU from 2M parameters, one copy below", "[gpu][graph]") {
  // The flat buffer (each parameter's start aligned) holds 2,101,312 and 2,052,160 elements.
  for (const auto& [spec, above] : {std::pair<std::string, bool>{"1024-2048-1", true}, {"1024-2000-1", false}}) {
    INFO(spec);
    TrainConfig c;
    c.model = spec;
    c.batch = 8;
    c.steps = 1;
    c.log_every = 1000;
    c.devices = {gpu};
    Trainer t(c);
    REQUIRE((t.model().flat_params().numel() >= kTwinsFromParams) == above);
    CHECK(t.optimizer().twin_buffers() == above);
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

TEST_CASE("a copy within the GPU (a kernel) moves every byte at any alignment and size", "[gpu][ops]") {
  // bf16 views at odd element offsets: 2-byte aligned pointers, odd lengths, the scalar path.
  const int64_t n = 4099;
  const Tensor src = Tensor::empty({n}, DType::bf16, gpu);
  copy_cast(src, on(gpu, randn(n, 31), {n}));
  auto as_floats = [&](const Tensor& t) {
    Tensor f = Tensor::empty({n}, DType::f32, gpu);
    copy_cast(f, t);
    return f.to_host();
  };
  const auto want = as_floats(src);
  for (int64_t from : {0, 1, 8, 9})
    for (int64_t to : {0, 3, 8})
      for (int64_t count : {1, 7, 8, 2048, 4090}) {
        INFO("from " << from << " to " << to << " count " << count);
        Tensor dst = Tensor::zeros({n}, DType::bf16, gpu);
        copy(dst.view(to, {count}), src.view(from, {count}));
        const auto got = as_floats(dst);
        int64_t wrong = 0;
        for (int64_t i = 0; i < n; ++i)
          wrong += got[static_cast<size_t>(i)] !=
                   (i >= to && i < to + count ? want[static_cast<size_t>(i - to + from)] : 0.0f);
        CHECK(wrong == 0);
      }
  // Several pieces in one launch (an unaligned bf16 one, an aligned f32 one), and a pair
  // that is not on one GPU (done by copy()).
  const auto f = randn(1000, 32);
  Tensor a = Tensor::zeros({n}, DType::bf16, gpu), b = Tensor::zeros({1000}, DType::f32, gpu);
  Tensor c = Tensor::zeros({1000}, DType::f32, host);
  copy_all({{a.view(3, {4001}), src.view(1, {4001})}, {b, on(gpu, f, {1000})}});
  copy_all({{c, b}});
  const auto got = as_floats(a);
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i)
    wrong += got[static_cast<size_t>(i)] != (i >= 3 && i < 4004 ? want[static_cast<size_t>(i - 2)] : 0.0f);
  CHECK(wrong == 0);
  CHECK(b.to_host() == f);
  CHECK(c.to_host() == f);
}

TEST_CASE("Philox gives the same values on the GPU as on the CPU", "[gpu][random]") {
  Tensor a = Tensor::empty({100001}, DType::f32, host), b = Tensor::empty({100001}, DType::f32, gpu);
  uniform_(a, 3, 4, 12345, -2.0f, 2.0f);
  uniform_(b, 3, 4, 12345, -2.0f, 2.0f);
  CHECK(b.to_host() == a.to_host());  // bit for bit
  normal_(a, 3, 4, 12345, 1.0f);
  normal_(b, 3, 4, 12345, 1.0f);
  CHECK(rel_error(b.to_host(), a.to_host()) < 1e-6);
  // Rows of a RowMap (groups, wrapping), whole Philox blocks a thread (width 12) or not
  // (width 7), filled and added to.
  for (int64_t width : {12, 7}) {
    INFO("width " << width);
    const RowMap map{5, 3, 10, 23};
    Tensor c = Tensor::zeros({31, width}, DType::f32, host), d = Tensor::zeros({31, width}, DType::f32, gpu);
    for (bool add : {false, true}) {
      normal_rows_(c, 3, 4, map, 0.5f, add);
      normal_rows_(d, 3, 4, map, 0.5f, add);
    }
    CHECK(rel_error(d.to_host(), c.to_host()) < 1e-6);
  }
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

TEST_CASE("file data through the GPU input pipeline trains as on the CPU, with no cudaMalloc after the first step",
          "[gpu][train][data]") {
  // 203 rows (epochs end inside batches), shuffled, three epochs; one GPU and two logical
  // replicas on it (each with its own loader thread, pinned buffers and copy stream).
  const auto xs = randn(203 * 32, 61), ys = randn(203 * 8, 62);
  std::vector<int32_t> labels(203);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int32_t>((i * 5 + 2) % 8);
  for (auto task : {data::Task::regression, data::Task::classification}) {
    INFO(data::task_name(task));
    const data::Array x{xs.data(), data::ArrayDType::f32, {203, 32}};
    const data::Array y = task == data::Task::regression ? data::Array{ys.data(), data::ArrayDType::f32, {203, 8}}
                                                         : data::Array{labels.data(), data::ArrayDType::i32, {203}};
    const auto rows = std::make_shared<data::ArrayDataset>(x, y);
    TrainConfig cfg;
    cfg.model = "32-64x2-8";
    cfg.optimizer = "adamw";
    cfg.lr = 0.003f;
    cfg.batch = 64;
    cfg.epochs = 3;
    cfg.log_every = 1000;
    cfg.devices = {host};
    Trainer a(cfg, rows);
    a.run();
    for (auto [n, accum] : {std::pair<size_t, int>{1, 1}, {2, 1}, {2, 3}}) {
      cfg.devices = std::vector<Device>(n, gpu);
      cfg.parallel.reduce = n > 1 ? Reduce::p2p : Reduce::automatic;
      cfg.parallel.grad_accum = accum;  // the loader then asks for each micro-batch in turn
      Trainer b(cfg, rows);
      b.step(0, /*measure=*/true);
      const int64_t after_first = allocator(gpu).stats().system_allocs;
      b.run();
      CHECK(allocator(gpu).stats().system_allocs == after_first);
      const double err = rel_error(b.model().flat_params().to_host(), a.model().flat_params().to_host());
      INFO(n << " replica(s), " << accum << " micro-batch(es): weights relative error " << err);
      CHECK(err < 1e-4);
    }
  }
}

TEST_CASE("the GPU input pipeline copies chunked shards as a direct gather makes them, ahead and after a jump",
          "[gpu][data][pipeline]") {
  // 1100 rows of 1026 floats: over 4 MiB, so two chunks, each gathered by four threads
  // and copied while the next is gathered; the ring runs ahead on the copy stream.
  const auto xs = randn(1200 * 1024, 63), ys = randn(1200 * 2, 64);
  const data::ArrayDataset set({xs.data(), data::ArrayDType::f32, {1200, 1024}},
                               {ys.data(), data::ArrayDType::f32, {1200, 2}});
  data::AheadLoader loader(
      set, gpu, 1100, 3, true,
      [](int64_t first) {
        return data::Samples{first + 1100, 1100};
      },
      4);
  data::RowOrder order(1200, 3, true);
  std::vector<int64_t> rows;
  for (int64_t first : {0, 1100, 2200, 3300, 9000, 10100}) {  // 9000: not foreseen
    INFO("samples from " << first);
    const data::Batch got = loader.get(first, 1100, context(gpu));
    order.rows(first, 1100, rows);
    const data::Batch want = set.empty_batch(1100, gpu);
    set.gather(rows, want);
    CHECK(got.x.to_host() == want.x.to_host());
    CHECK(got.y.to_host() == want.y.to_host());
  }
  const InputStats st = loader.stats();
  CHECK(st.loads >= 6);
  CHECK(st.timed_copies >= 1);
  CHECK(st.copy_ms > 0);
}

TEST_CASE("the GPU allocator makes no cudaMalloc after the first training step", "[gpu][allocator]") {
  for (GemmImpl impl : {GemmImpl::cublas, GemmImpl::native}) {
    TrainConfig cfg;
    cfg.model = "64-256x3-16";
    cfg.batch = 512;
    cfg.steps = 30;
    cfg.log_every = 7;
    cfg.parallel.gemm = impl;
    cfg.devices = {gpu};
    Trainer t(cfg);
    t.step(0, /*measure=*/true);  // as a run's first step, which is logged
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
    CHECK(msg.find("4.00 TiB") != std::string::npos);             // the bytes asked
    CHECK(msg.find("use a smaller batch") != std::string::npos);  // what to change, in the runtime's terms
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
  c.parallel.bucket_mb = 0.002;  // several buckets
  return c;
}

// Trains `c` on `devices` step by step, asserting that the replicas stay bitwise
// identical, and returns the master's weights.
std::vector<float> train_dp(TrainConfig c, std::vector<Device> devices, Reduce path) {
  c.devices = std::move(devices);
  c.parallel.reduce = path;
  Trainer t(c);
  for (int64_t s = 0; s < c.steps; ++s) {
    t.step(s);
    REQUIRE(t.parallel().replicas_identical());
  }
  return t.model().flat_params().to_host();
}
}  // namespace

TEST_CASE("a CUDA graph of logical replicas gives the eager step's parameters at every step", "[gpu][graph]") {
  for (float clip : {0.0f, 0.5f}) {
    TrainConfig c;
    c.model = "24-48x2-6";
    c.batch = 32;
    c.steps = 6;
    c.log_every = 1000;
    c.lr = 0.05f;
    c.parallel.clip = clip;
    c.devices = {gpu, gpu};
    Trainer eager(c), eager2(c);
    c.parallel.cuda_graph = true;
    Trainer graphed(c);
    for (int64_t s = 0; s < c.steps; ++s) {
      INFO("clip " << clip << ", step " << s + 1 << " (1 eager, 2 and 3 recorded, then replays)");
      eager.step(s);
      eager2.step(s);
      graphed.step(s);
      CHECK(eager2.model().flat_params().to_host() == eager.model().flat_params().to_host());
      CHECK(graphed.parallel().replicas_identical());
      const auto g = graphed.model().flat_grads().to_host(), e = eager.model().flat_grads().to_host();
      INFO("gradients: relative difference " << rel_error(g, e));
      CHECK(g == e);
      CHECK(graphed.model().flat_params().to_host() == eager.model().flat_params().to_host());
    }
  }
}

namespace {
// 24-48x2-6 on `replicas` logical replicas of the GPU (p2p), SGD with momentum, the
// gradients checked: the graph-input tests' model, eager or as a CUDA graph.
DataParallel graph_test_replicas(size_t replicas, bool graph) {
  auto m = nn::make_model(nn::parse_model_spec("24-48x2-6"), Act::relu);
  m->to(gpu, 5);
  DataParallelOptions o;
  o.reduce = replicas > 1 ? Reduce::p2p : Reduce::automatic;
  o.cuda_graph = graph;
  o.check_finite = true;
  o.twin_buffers = TwinBuffers::on;  // a model this small would keep one copy
  return DataParallel(
      m, std::vector<Device>(replicas, gpu),
      [](nn::Module& r) -> std::unique_ptr<optim::Optimizer> {
        return std::make_unique<optim::SGD>(r, optim::SGD::Options{.lr = 0.05f, .momentum = 0.9f});
      },
      o);
}
}  // namespace

TEST_CASE("a replay copies the next step's shards in beside its update, or before it where the step was not named",
          "[gpu][graph]") {
  // Steps that name the next one, that name none, and one that names a step that does not
  // come (its shards are then copied before the replay): every step's parameters are the
  // eager run's bit for bit, on one GPU and on two logical replicas (p2p).
  const std::vector<std::pair<int64_t, int64_t>> steps = {{0, 32},    {32, 64},   {64, -1}, {96, 128},
                                                          {128, 500}, {200, 232}, {232, -1}};
  for (size_t replicas : {size_t{1}, size_t{2}}) {
    auto run = [&](bool graph) {
      DataParallel dp = graph_test_replicas(replicas, graph);
      data::Synthetic d({.task = data::Task::regression, .in = 24, .out = 6, .seed = 3}, gpu);
      const data::Dataset& rows = d;
      std::vector<std::vector<float>> params;
      for (const auto& [first, next] : steps) {
        dp.train_step(
            first, 32, [&](size_t r, int64_t f, int64_t n) { return rows.batch(f, n, dp.device(r)); }, nn::MSELoss(),
            {}, true, next);
        dp.synchronize();  // the replica's stream, which a read on this thread's does not wait for
        params.push_back(dp.replica(0).flat_params().to_host());
      }
      return params;
    };
    const auto eager = run(false), graphed = run(true);
    for (size_t s = 0; s < steps.size(); ++s) {
      INFO(replicas << " replicas, step " << s + 1 << " (1 eager, 2 and 3 recorded, then replays)");
      CHECK(graphed[s] == eager[s]);
    }
  }
}

TEST_CASE("a source may make the next step's shard straight into the graph's inputs", "[gpu][graph]") {
  // The source makes step s + 1's shard in the buffers that DataParallel offers while it
  // is asked for step s's, on a stream of its own once the replica's stream has done what
  // it queued (as the trainer makes synthetic data), and returns them at step s + 1, the
  // replica's stream waiting for the making: every step's parameters are the eager run's
  // bit for bit, with twin buffers (two recordings, each reading its own inputs), on one
  // GPU and on two logical replicas.
  constexpr int64_t kSteps = 9, kBatch = 32;
  for (size_t replicas : {size_t{1}, size_t{2}}) {
    int64_t offers = 0;
    auto run = [&](bool graph) {
      DataParallel dp = graph_test_replicas(replicas, graph);
      CHECK(dp.optimizers().front()->twin_buffers());
      data::Synthetic d({.task = data::Task::regression, .in = 24, .out = 6, .seed = 3}, gpu);
      const data::Dataset& rows = d;
      std::vector<data::Batch> made(replicas);  // the shard made ahead, where it was offered
      std::vector<int64_t> made_for(replicas, -1);
      std::vector<std::unique_ptr<Context>> side;
      std::vector<std::unique_ptr<Event>> queued, done;
      for (size_t r = 0; r < replicas; ++r) {
        side.push_back(std::make_unique<Context>(gpu));
        queued.push_back(std::make_unique<Event>(gpu));
        done.push_back(std::make_unique<Event>(gpu));
      }
      std::vector<std::vector<float>> params;
      for (int64_t s = 0; s < kSteps; ++s) {
        CHECK(dp.next_step_inputs(0).x.defined() == false);  // only while the source is asked
        dp.train_step(
            s * kBatch, kBatch,
            [&](size_t r, int64_t f, int64_t n) {
              Context& step_stream = context(dp.device(r));
              data::Batch b = made_for[r] == f ? made[r] : rows.batch(f, n, dp.device(r));
              if (made_for[r] == f) done[r]->wait_in(step_stream);
              if (const data::Batch into = dp.next_step_inputs(r); into.x.defined()) {
                CHECK(into.x.size(0) == n);
                CHECK(into.x.data() != b.x.data());
                queued[r]->record(step_stream);
                ContextGuard g(*side[r]);
                queued[r]->wait_in(*side[r]);
                const data::Batch next = rows.batch(f + kBatch, n, dp.device(r));
                copy(into.x, next.x);
                copy(into.y, next.y);
                done[r]->record(*side[r]);
                made[r] = into;
                made_for[r] = f + kBatch;
                offers += graph ? 1 : 0;
              } else {
                made_for[r] = -1;
              }
              return b;
            },
            nn::MSELoss(), {}, true, -1);
        dp.synchronize();
        params.push_back(dp.replica(0).flat_params().to_host());
      }
      return params;
    };
    const auto eager = run(false);
    CHECK(offers == 0);  // eager steps offer nothing
    const auto graphed = run(true);
    CHECK(offers == static_cast<int64_t>(replicas) * (kSteps - 1));  // every step after the first (eager) one
    for (size_t s = 0; s < eager.size(); ++s) {
      INFO(replicas << " replicas, step " << s + 1 << " (1 eager, 2 and 3 recorded, then replays)");
      CHECK(graphed[s] == eager[s]);
    }
  }
}

TEST_CASE("synthetic blocks of one step are made straight into a CUDA graph's inputs, bit for bit the eager run",
          "[gpu][graph]") {
  // 4096 inputs and outputs: 32 KiB a sample, so a block (32 MiB) holds one step of 1024.
  for (size_t replicas : {size_t{1}, size_t{2}})
    for (Precision p : {Precision::fp32, Precision::bf16}) {
      INFO(replicas << " replicas, " << precision_name(p));
      TrainConfig c;
      c.model = "4096-64-4096";
      c.batch = 1024 * static_cast<int64_t>(replicas);
      c.steps = 8;
      c.log_every = 1000;
      c.devices = std::vector<Device>(replicas, gpu);
      c.lr = 0.05f;
      c.parallel.precision = p;
      c.parallel.twin_buffers = TwinBuffers::on;  // 0.5M parameters: one copy by default
      Trainer eager(c);
      eager.run();
      c.parallel.cuda_graph = true;
      Trainer graphed(c);
      graphed.run();
      CHECK(graphed.optimizer().twin_buffers());
      CHECK(graphed.model().flat_params().to_host() == eager.model().flat_params().to_host());
    }
}

TEST_CASE("ZeRO stage 1 on one GPU (NCCL, one shard) gives stage 0's parameters bit for bit", "[gpu][parallel][zero]") {
  if (!built_with_nccl()) return;
  for (std::string opt : {"sgd", "adamw"})
    for (float clip : {0.0f, 0.5f})
      for (Precision p : {Precision::fp32, Precision::bf16})
        for (bool graph : {false, true}) {
          INFO(opt << ", clip " << clip << ", " << precision_name(p) << (graph ? ", CUDA graph" : ""));
          TrainConfig c;
          c.model = "24-48x2-6";
          c.batch = 32;
          c.steps = 12;
          c.log_every = 1000;
          c.optimizer = opt;
          c.lr = opt == "sgd" ? 0.05f : 0.003f;
          c.parallel.clip = clip;
          c.parallel.precision = p;
          c.parallel.cuda_graph = graph;
          c.devices = {gpu};
          Trainer plain(c);
          plain.run();
          c.parallel.zero = 1;
          Trainer sharded(c);
          sharded.run();
          CHECK(sharded.parallel().reduce() == Reduce::nccl);
          CHECK(sharded.parallel().zero_shards().size() == 1);
          CHECK(sharded.model().flat_params().to_host() == plain.model().flat_params().to_host());
          const auto a = sharded.parallel().optimizer_state(), b = plain.parallel().optimizer_state();
          REQUIRE(a.size() == b.size());
          for (size_t i = 0; i < a.size(); ++i) CHECK(a[i].second.to_host() == b[i].second.to_host());
        }
}

TEST_CASE("ZeRO stage 2 on one GPU (NCCL, one shard, gradients in two slots) gives stage 1's parameters",
          "[gpu][parallel][zero]") {
  if (!built_with_nccl()) return;
  for (std::string model : {"24-48x2-6", "cnn:2x7x7-c4k3-p2-c6k3s2-f3"})
    for (std::string opt : {"sgd", "adamw"})
      for (float clip : {0.0f, 0.5f})
        for (Precision p : {Precision::fp32, Precision::bf16})
          for (int accum : {1, 2}) {
            INFO(model << " " << opt << ", clip " << clip << ", " << precision_name(p) << ", " << accum
                       << " micro-batches");
            TrainConfig c;
            c.model = model;
            c.task = model.rfind("cnn", 0) == 0 ? data::Task::classification : data::Task::regression;
            c.batch = 32;
            c.steps = 12;
            c.log_every = 1000;
            c.optimizer = opt;
            c.lr = opt == "sgd" ? 0.05f : 0.003f;
            c.parallel.clip = clip;
            c.parallel.precision = p;
            c.parallel.grad_accum = accum;
            // Several buckets, small parameters sharing them over padding.
            c.parallel.bucket_mb = c.task == data::Task::classification ? 0.001 : 0.004;
            c.devices = {gpu};
            c.parallel.zero = 1;
            Trainer one(c);
            one.run();
            c.parallel.zero = 2;
            Trainer two(c);
            two.run();
            CHECK(two.parallel().reduce() == Reduce::nccl);
            REQUIRE(two.parallel().buckets() >= 3);
            const auto want = one.model().flat_params().to_host(), got = two.model().flat_params().to_host();
            INFO("relative error " << rel_error(got, want));
            // One micro-batch: the shard is the gradient, copied; with two, stage 1 adds
            // the second in backward's GEMM and stage 2 after it (another rounding).
            if (accum == 1) CHECK(got == want);
            else CHECK(rel_error(got, want) <= 1e-6);
          }
}

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

TEST_CASE("bf16 on the wire between logical replicas (p2p): the master's gradient plus the other's rounded",
          "[gpu][parallel][grad_comm]") {
  const int64_t total = 100003;
  const std::vector<Bucket> buckets = make_buckets(total, 16 * 1024 * 4, 16 * 1024 * 4);
  REQUIRE(buckets.size() > 2);
  Context a(gpu), b(gpu);
  const auto g0 = randn(total, 90), g1 = randn(total, 91);
  std::vector<ReplicaBuffers> bufs{{&a, Tensor::zeros({total}, DType::f32, gpu), on(gpu, g0, {total}), Tensor()},
                                   {&b, Tensor::zeros({total}, DType::f32, gpu), on(gpu, g1, {total}), Tensor()}};
  auto reducer = make_p2p_reducer(bufs, buckets, DType::bf16);
  context(gpu).synchronize();  // the uploads, on the default stream, before a and b read them
  for (size_t i = 0; i < 2; ++i) {
    ContextGuard guard(*bufs[i].ctx);
    for (size_t k = 0; k < buckets.size(); ++k) reducer->bucket_ready(i, k);
  }
  reducer->reduce();
  reducer->wait(0);
  a.synchronize();
  std::vector<uint16_t> halves(g1.size());
  std::vector<float> rounded(g1.size()), want(g1.size());
  cpu::cast_f32_bf16(g1.data(), halves.data(), total);
  cpu::cast_bf16_f32(halves.data(), rounded.data(), total);
  for (size_t j = 0; j < want.size(); ++j) want[j] = g0[j] + rounded[j];
  CHECK(bufs[0].grads.to_host() == want);
  // And training: within bf16's tolerance of the fp32 wire, the replicas identical.
  TrainConfig c = dp_config(data::Task::regression, "adamw");
  c.devices = {gpu, gpu};
  c.parallel.reduce = Reduce::p2p;
  Trainer fp32(c);
  fp32.run();
  c.parallel.grad_comm = DType::bf16;
  Trainer bf16(c);
  bf16.run();
  CHECK(bf16.parallel().replicas_identical());
  const auto w = fp32.model().flat_params().to_host(), got = bf16.model().flat_params().to_host();
  CHECK(got != w);
  CHECK(rel_error(got, w) <= 1e-2);
}

TEST_CASE("data-parallel steps make no cudaMalloc after the first", "[gpu][parallel][allocator]") {
  TrainConfig c = dp_config(data::Task::regression, "sgd");
  c.devices = {gpu, gpu, gpu};
  c.parallel.reduce = Reduce::p2p;
  c.steps = 15;
  Trainer t(c);
  t.step(0, /*measure=*/true);  // as a run's first step, which is logged
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
  c.parallel.bucket_mb = 1.0;
  for (Reduce path : {Reduce::nccl, Reduce::p2p}) {
    if (path == Reduce::nccl && !built_with_nccl()) continue;
    for (const Device& d : devs) allocator(d).reset_peak();
    c.devices = devs;
    c.parallel.reduce = path;
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

TEST_CASE("ZeRO stages 1 and 2 over N GPUs (NCCL) train as stage 0", "[gpu][parallel][multigpu][zero]") {
  const int gpus = cuda_device_count();
  if (gpus < 2 || !built_with_nccl()) {
    WARN("one GPU here (or no NCCL): ZeRO over several GPUs needs 2 or more");
    return;
  }
  for (std::string opt : {"sgd", "adamw"})
    for (float clip : {0.0f, 0.5f})
      for (int accum : {1, 2}) {
        TrainConfig c = dp_config(data::Task::regression, opt);
        c.parallel.clip = clip;
        c.parallel.grad_accum = accum;
        c.batch = 30;
        for (int n = 2; n <= std::min(gpus, 8); ++n) {
          std::vector<Device> devs;
          for (int i = 0; i < n; ++i) devs.push_back({DeviceType::cuda, i});
          const auto want = train_dp(c, devs, Reduce::nccl);
          for (int zero : {1, 2}) {
            INFO(opt << ", clip " << clip << ", " << accum << " micro-batches, " << n << " GPUs, zero " << zero);
            TrainConfig z = c;
            z.parallel.zero = zero;
            CHECK(rel_error(train_dp(z, devs, Reduce::nccl), want) <= 1e-6);
          }
        }
      }
}

TEST_CASE("a host batch is split, staged through pinned memory and trained exactly", "[gpu][parallel]") {
  data::Synthetic d({.task = data::Task::regression, .in = 6, .out = 3, .seed = 2}, host);
  auto make = [&](std::vector<Device> devs) {
    auto m = nn::mlp("6-16-3");
    m->to(gpu, 4);
    return std::make_unique<DataParallel>(
        m, std::move(devs),
        [](nn::Module& r) { return std::make_unique<optim::SGD>(r, optim::SGD::Options{.lr = 0.1f}); },
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
  // Recorded once whatever the schedule: the learning rate, AdamW's bias corrections and
  // the clipping scale are computed in the graph, on the device.
  struct Case {
    const char* optimizer;
    const char* schedule;
    float clip;
    int accum = 1;        // micro-batches, views of the graph's input
    size_t replicas = 1;  // logical replicas on the GPU, each on its stream, reduced p2p
  };
  for (const Case k : {Case{"sgd", "constant", 0.0f}, Case{"sgd", "cosine", 0.0f}, Case{"adamw", "cosine", 0.5f},
                       Case{"adamw", "warmup", 0.0f}, Case{"adamw", "cosine", 0.5f, 3},
                       Case{"adamw", "cosine", 0.5f, 1, 2}, Case{"sgd", "cosine", 1.0f, 2, 3}}) {
    INFO(k.optimizer << ", schedule " << k.schedule << ", clip " << k.clip << ", micro-batches " << k.accum
                     << ", replicas " << k.replicas);
    TrainConfig c;
    c.model = "24-48x2-6";
    c.batch = 32;
    c.steps = 25;
    c.log_every = 1000;
    c.devices = std::vector<Device>(k.replicas, gpu);
    c.optimizer = k.optimizer;
    c.lr = std::string(k.optimizer) == "sgd" ? 0.05f : 0.003f;
    c.schedule = k.schedule;
    c.warmup = std::string(k.schedule) == "constant" ? 0 : 3;  // constant has no warm-up
    c.parallel.clip = k.clip;
    c.parallel.grad_accum = k.accum;
    Trainer eager(c);
    eager.run();
    c.parallel.cuda_graph = true;
    Trainer graphed(c);
    for (int64_t s = 0; s < 3; ++s) graphed.step(s);  // eager, then recorded for each parity
    const int64_t allocs = allocator(gpu).stats().system_allocs;
    const TrainResult r = graphed.run();
    CHECK(allocator(gpu).stats().system_allocs == allocs);  // two recordings, replayed
    INFO("final loss " << r.final_loss);
    CHECK(graphed.model().flat_params().to_host() == eager.model().flat_params().to_host());  // bit for bit
    CHECK(graphed.optimizer().steps_taken() == c.steps);
  }
}

TEST_CASE("a CUDA graph on file data trains exactly like the eager step", "[gpu][graph]") {
  // The shards come from the input pipeline's slots, another buffer every step: the
  // graph's copy reads the one each launch names (one and two logical replicas, uneven
  // shards, three epochs). With micro-batches the pipeline serves one at a time, each
  // copied in before the replay.
  const std::vector<float> x = randn(53 * 12, 41);
  std::vector<int32_t> labels;
  for (int i = 0; i < 53; ++i) labels.push_back((i * 3 + 1) % 5);
  const auto set = std::make_shared<data::ArrayDataset>(data::Array{x.data(), data::ArrayDType::f32, {53, 12}},
                                                        data::Array{labels.data(), data::ArrayDType::i32, {53}});
  for (auto [replicas, accum] : {std::pair<size_t, int>{1, 1}, {2, 1}, {1, 3}, {2, 2}}) {
    INFO("replicas " << replicas << ", grad_accum " << accum);
    TrainConfig c;
    c.parallel.grad_accum = accum;
    c.model = "12-24x2-5";
    c.optimizer = "adamw";
    c.lr = 0.003f;
    c.batch = 11;
    c.epochs = 3;
    c.log_every = 1000;
    c.devices = std::vector<Device>(replicas, gpu);
    Trainer eager(c, set);
    eager.run();
    c.parallel.cuda_graph = true;
    Trainer graphed(c, set);
    graphed.run();
    CHECK(graphed.model().flat_params().to_host() == eager.model().flat_params().to_host());  // bit for bit
  }
}

// ---- cuDNN: convolution, pooling and batch norm against the CPU twins -------------------

#if DPT_WITH_CUDNN
namespace {
cudnnHandle_t dnn_handle() { return static_cast<cudnnHandle_t>(context(gpu).dnn()); }
cublasHandle_t blas_handle() { return static_cast<cublasHandle_t>(context(gpu).blas()); }

Tensor dev(const std::vector<float>& v) { return Tensor::from_host(v, {static_cast<int64_t>(v.size())}, gpu); }

// Outputs start as NaN: an output written with beta = 0 must never be read.
std::vector<float> nans(int64_t n) { return std::vector<float>(static_cast<size_t>(n), NAN); }

// A workspace from the caching allocator, as the layers take one.
Tensor workspace(size_t bytes) {
  return Tensor::empty({static_cast<int64_t>(bytes / sizeof(float)) + 1}, DType::f32, gpu);
}

void check_close(const Tensor& got, const std::vector<float>& want, double tol, const char* what) {
  const double err = rel_error(got.to_host(), want);
  INFO(what << ": relative error " << err);
  CHECK(err < tol);
}
}  // namespace

TEST_CASE("cuDNN convolution matches the CPU forward and backward, at fp32 and tf32", "[gpu][conv]") {
  struct Case {
    const char* name;
    ConvShape s;
  };
  const Case cases[] = {
      {"3x3 pad 1, odd sizes", {.n = 2, .c = 3, .h = 9, .w = 11, .k = 5, .r = 3, .s = 3, .pad = 1}},
      {"3x3 stride 2 pad 1", {.n = 3, .c = 7, .h = 15, .w = 13, .k = 6, .r = 3, .s = 3, .stride = 2, .pad = 1}},
      {"3x3 dilation 2 pad 2", {.n = 2, .c = 5, .h = 17, .w = 12, .k = 4, .r = 3, .s = 3, .pad = 2, .dilation = 2}},
      {"1x1", {.n = 4, .c = 24, .h = 7, .w = 7, .k = 10, .r = 1, .s = 1}},
      {"5x3 pad 2, batch 1", {.n = 1, .c = 13, .h = 10, .w = 9, .k = 11, .r = 5, .s = 3, .pad = 2}},
      {"3x3 pad 1, 16 -> 32 channels", {.n = 4, .c = 16, .h = 20, .w = 20, .k = 32, .r = 3, .s = 3, .pad = 1}},
      // Few inputs per output (c*r*s <= 32): the weight gradient through im2col and cuBLAS.
      {"3x3 stride 2 pad 2 dilation 2, 2 channels",
       {.n = 3, .c = 2, .h = 13, .w = 10, .k = 7, .r = 3, .s = 3, .stride = 2, .pad = 2, .dilation = 2}},
      {"the cnn's first layer, 3 -> 64 channels",
       {.n = 8, .c = 3, .h = 32, .w = 32, .k = 64, .r = 3, .s = 3, .pad = 1}},
      // im2col's buffer holds 56 of these images: two chunks, summed in order.
      {"large images, in chunks", {.n = 64, .c = 1, .h = 128, .w = 128, .k = 4, .r = 3, .s = 3, .pad = 1}},
  };
  const cudnnHandle_t h = dnn_handle();
  for (const Case& c : cases) {
    const ConvShape& s = c.s;
    const int64_t nx = s.n * s.c * s.h * s.w, nw = s.k * s.c * s.r * s.s, ny = s.n * s.k * s.p() * s.q();
    const auto x = randn(nx, 21), w = randn(nw, 22, 0.3f), b = randn(s.k, 23), dy = randn(ny, 24);
    const auto dw0 = randn(nw, 25), db0 = randn(s.k, 26);  // gradients already in the flat buffer
    std::vector<float> y(ny), y_nobias(ny), dx(nx), dw(nw), db(s.k), dw_acc = dw0, db_acc = db0;
    cpu::conv2d_forward(s, x.data(), w.data(), b.data(), y.data());
    cpu::conv2d_forward(s, x.data(), w.data(), nullptr, y_nobias.data());
    cpu::conv2d_backward_data(s, dy.data(), w.data(), dx.data());
    cpu::conv2d_backward_filter(s, x.data(), dy.data(), 0.0f, dw.data(), db.data());
    cpu::conv2d_backward_filter(s, x.data(), dy.data(), 1.0f, dw_acc.data(), db_acc.data());
    // TF32 as the GEMM test allows it: tensor cores may truncate their inputs.
    for (auto [precision, tol] : {std::pair{Precision::fp32, 1e-5}, std::pair{Precision::tf32, 3e-3}}) {
      INFO(c.name << ", " << precision_name(precision));
      const size_t bytes = cuda::conv2d_workspace_bytes(h, precision, s);
      Tensor ws = workspace(bytes);  // exactly what was asked for is enough for every pass
      Tensor gx = dev(x), gw = dev(w), gb = dev(b), gdy = dev(dy);
      Tensor gy = dev(nans(ny)), gy_nobias = dev(nans(ny)), gdx = dev(nans(nx)), gdw = dev(nans(nw)),
             gdb = dev(nans(s.k)), gdw_nobias = dev(nans(nw)), gdw_acc = dev(dw0), gdb_acc = dev(db0);
      cuda::conv2d_forward(h, precision, s, gx.f32(), gw.f32(), gb.f32(), gy.f32(), ws.data(), bytes);
      cuda::conv2d_forward(h, precision, s, gx.f32(), gw.f32(), nullptr, gy_nobias.f32(), ws.data(), bytes);
      cuda::conv2d_backward_data(h, precision, s, gdy.f32(), gw.f32(), gdx.f32(), ws.data(), bytes);
      cuda::conv2d_backward_filter(h, blas_handle(), precision, s, gx.f32(), gdy.f32(), 0.0f, gdw.f32(), gdb.f32(),
                                   ws.data(), bytes);
      cuda::conv2d_backward_filter(h, blas_handle(), precision, s, gx.f32(), gdy.f32(), 0.0f, gdw_nobias.f32(), nullptr,
                                   ws.data(), bytes);
      cuda::conv2d_backward_filter(h, blas_handle(), precision, s, gx.f32(), gdy.f32(), 1.0f, gdw_acc.f32(),
                                   gdb_acc.f32(), ws.data(), bytes);
      check_close(gy, y, tol, "y");
      check_close(gy_nobias, y_nobias, tol, "y without bias");
      check_close(gdx, dx, tol, "dx");
      check_close(gdw, dw, tol, "dw");
      check_close(gdb, db, tol, "db");
      check_close(gdw_nobias, dw, tol, "dw without bias");
      check_close(gdw_acc, dw_acc, tol, "dw accumulated (beta 1)");
      check_close(gdb_acc, db_acc, tol, "db accumulated (beta 1)");
    }
  }
}

TEST_CASE("cuDNN convolution plans are made once: same workspace, no allocation, errors first",
          "[gpu][conv][allocator]") {
  const cudnnHandle_t h = dnn_handle();
  // The second shape's weight gradient runs through im2col and cuBLAS (c*r*s <= 32).
  for (const ConvShape& s : {ConvShape{.n = 8, .c = 32, .h = 16, .w = 16, .k = 64, .r = 3, .s = 3, .pad = 1},
                             ConvShape{.n = 8, .c = 3, .h = 16, .w = 16, .k = 16, .r = 3, .s = 3, .pad = 1}}) {
    const int64_t nx = s.n * s.c * s.h * s.w, nw = s.k * s.c * s.r * s.s, ny = s.n * s.k * s.p() * s.q();
    Tensor x = dev(randn(nx, 61)), w = dev(randn(nw, 62, 0.1f)), b = dev(randn(s.k, 63)), dy = dev(randn(ny, 64));
    Tensor y = Tensor::empty({ny}, DType::f32, gpu), dx = Tensor::empty({nx}, DType::f32, gpu);
    Tensor dw = Tensor::empty({nw}, DType::f32, gpu), db = Tensor::empty({s.k}, DType::f32, gpu);
    for (Precision p : {Precision::fp32, Precision::tf32}) {
      INFO(precision_name(p));
      const size_t bytes = cuda::conv2d_workspace_bytes(h, p, s);
      CHECK(bytes <= size_t(256) << 20);
      Tensor ws = workspace(bytes);
      auto step = [&](size_t ws_bytes) {
        cuda::conv2d_forward(h, p, s, x.f32(), w.f32(), b.f32(), y.f32(), ws.data(), ws_bytes);
        cuda::conv2d_backward_data(h, p, s, dy.f32(), w.f32(), dx.f32(), ws.data(), ws_bytes);
        cuda::conv2d_backward_filter(h, blas_handle(), p, s, x.f32(), dy.f32(), 0.0f, dw.f32(), db.f32(), ws.data(),
                                     ws_bytes);
      };
      step(bytes);
      context(gpu).synchronize();
      const int64_t allocs = allocator(gpu).stats().system_allocs;
      size_t free_before = 0, free_after = 0, total = 0;
      REQUIRE(cudaMemGetInfo(&free_before, &total) == cudaSuccess);
      CHECK(cuda::conv2d_workspace_bytes(h, p, s) == bytes);  // from the cache
      for (int i = 0; i < 3; ++i) step(bytes);
      context(gpu).synchronize();
      REQUIRE(cudaMemGetInfo(&free_after, &total) == cudaSuccess);
      CHECK(allocator(gpu).stats().system_allocs == allocs);
      CHECK(free_after == free_before);                // nor does cuDNN allocate behind the allocator's back
      if (bytes > 0) CHECK_THROWS_AS(step(0), Error);  // too small a workspace is refused
    }
  }
  const ConvShape too_big{.n = 1, .c = 1, .h = 2, .w = 2, .k = 1, .r = 3, .s = 3};
  CHECK_THROWS_AS(cuda::conv2d_workspace_bytes(h, Precision::fp32, too_big), Error);
}

TEST_CASE("cuDNN max and average pooling match the CPU, with padding and global average", "[gpu][conv]") {
  struct Case {
    const char* name;
    Pool kind;
    PoolShape s;
  };
  const Case cases[] = {
      {"max 2x2 stride 2, odd width", Pool::max, {.n = 2, .c = 3, .h = 8, .w = 9, .kh = 2, .kw = 2, .stride = 2}},
      {"max 3x3 stride 2 pad 1, overlapping",
       Pool::max,
       {.n = 2, .c = 5, .h = 11, .w = 10, .kh = 3, .kw = 3, .stride = 2, .pad = 1}},
      {"avg 3x3 stride 1 pad 1", Pool::avg, {.n = 2, .c = 4, .h = 7, .w = 9, .kh = 3, .kw = 3, .stride = 1, .pad = 1}},
      {"avg 2x2 stride 2, batch 1", Pool::avg, {.n = 1, .c = 6, .h = 8, .w = 7, .kh = 2, .kw = 2, .stride = 2}},
      {"global average", Pool::avg, {.n = 4, .c = 10, .h = 7, .w = 5, .kh = 7, .kw = 5}},
  };
  const cudnnHandle_t h = dnn_handle();
  for (const Case& c : cases) {
    INFO(c.name);
    const PoolShape& s = c.s;
    const int64_t nx = s.n * s.c * s.h * s.w, ny = s.n * s.c * s.p() * s.q();
    const auto x = randn(nx, 31), dy = randn(ny, 32);
    std::vector<float> y(ny), dx(nx);
    cpu::pool2d_forward(s, c.kind, x.data(), y.data());
    cpu::pool2d_backward(s, c.kind, x.data(), y.data(), dy.data(), dx.data());
    Tensor gx = dev(x), gdy = dev(dy), gy = dev(nans(ny)), gdx = dev(nans(nx));
    cuda::pool2d_forward(h, s, c.kind, gx.f32(), gy.f32());
    cuda::pool2d_backward(h, s, c.kind, gx.f32(), gy.f32(), gdy.f32(), gdx.f32());
    check_close(gy, y, 1e-5, "y");
    check_close(gdx, dx, 1e-5, "dx");
  }
}

TEST_CASE("cuDNN max pooling gives a tied window's gradient to one of its elements", "[gpu][conv]") {
  // Every 2x2 window holds four equal values. The CPU twin, like torch, picks the first;
  // cuDNN documents no choice, so a different one is reported, not failed.
  const PoolShape s{.n = 1, .c = 2, .h = 4, .w = 6, .kh = 2, .kw = 2, .stride = 2};
  const int64_t nx = s.n * s.c * s.h * s.w, ny = s.n * s.c * s.p() * s.q();
  std::vector<float> x(static_cast<size_t>(nx), 1.0f), dy(static_cast<size_t>(ny)), y(ny), dx(nx);
  for (size_t i = 0; i < dy.size(); ++i) dy[i] = static_cast<float>(i + 1);
  Tensor gx = dev(x), gdy = dev(dy), gy = dev(nans(ny)), gdx = dev(nans(nx));
  cuda::pool2d_forward(dnn_handle(), s, Pool::max, gx.f32(), gy.f32());
  cuda::pool2d_backward(dnn_handle(), s, Pool::max, gx.f32(), gy.f32(), gdy.f32(), gdx.f32());
  const auto got = gdx.to_host();
  // Each window's dy lands whole on exactly one of its elements: nothing lost, nothing copied.
  double sum = 0;
  int64_t nonzero = 0;
  for (float v : got) {
    sum += v;
    nonzero += v != 0.0f;
  }
  CHECK(sum == static_cast<double>(ny * (ny + 1) / 2));
  CHECK(nonzero == ny);
  cpu::pool2d_forward(s, Pool::max, x.data(), y.data());
  cpu::pool2d_backward(s, Pool::max, x.data(), y.data(), dy.data(), dx.data());
  if (got != dx) {
    std::string where;  // the window offset cuDNN chose, window by window (0 = first, 3 = last)
    for (int64_t i = 0; i < nx; ++i)
      if (got[i] != 0.0f) where += std::to_string((i / s.w % 2) * 2 + i % s.w % 2) + " ";
    WARN("cuDNN breaks max-pooling ties unlike the CPU twin (first maximum): it picks window offsets " << where);
  }
}

TEST_CASE("cuDNN batch norm matches the CPU: training, running statistics, eval, backward", "[gpu][conv]") {
  struct Case {
    int64_t n, c, hw;
    BatchNormArgs a;
  };
  const Case cases[] = {
      {4, 3, 25, {}},
      {1, 5, 49, {}},                                // batch 1
      {8, 13, 1, {.eps = 1e-2f, .momentum = 0.3f}},  // hw 1 (BatchNorm1d), a large eps
      {2, 16, 9, {.eps = 1e-3f, .momentum = 0.1f}},
  };
  const cudnnHandle_t h = dnn_handle();
  for (const Case& t : cases) {
    const int64_t n = t.n, c = t.c, hw = t.hw, nx = n * c * hw;
    const BatchNormArgs& a = t.a;
    INFO("n " << n << " c " << c << " hw " << hw << " eps " << a.eps << " momentum " << a.momentum);
    auto x = randn(nx, 41, 2.0f);
    for (auto& v : x) v += 0.5f;  // a mean away from zero
    const auto gamma = randn(c, 42), beta = randn(c, 43), dy = randn(nx, 44), rm0 = randn(c, 45);
    auto rv0 = randn(c, 46);
    for (auto& v : rv0) v = 0.5f + v * v;  // a variance
    const auto dg0 = randn(c, 47), db0 = randn(c, 48);
    std::vector<float> y(nx), mean(c), invstd(c), rm = rm0, rv = rv0, y_eval(nx), dx(nx), dg(c), db(c), dg_acc = dg0,
                                                  db_acc = db0;
    cpu::batchnorm_forward_train(n, c, hw, x.data(), gamma.data(), beta.data(), a, rm.data(), rv.data(), y.data(),
                                 mean.data(), invstd.data());
    cpu::batchnorm_forward_eval(n, c, hw, x.data(), gamma.data(), beta.data(), a, rm0.data(), rv0.data(),
                                y_eval.data());
    cpu::batchnorm_backward(n, c, hw, x.data(), dy.data(), gamma.data(), mean.data(), invstd.data(), dx.data(), 0.0f,
                            dg.data(), db.data());
    cpu::batchnorm_backward(n, c, hw, x.data(), dy.data(), gamma.data(), mean.data(), invstd.data(), dx.data(), 1.0f,
                            dg_acc.data(), db_acc.data());

    Tensor gx = dev(x), ggamma = dev(gamma), gbeta = dev(beta), grm = dev(rm0), grv = dev(rv0);
    Tensor gy = dev(nans(nx)), gmean = dev(nans(c)), ginvstd = dev(nans(c));
    cuda::batchnorm_forward_train(h, n, c, hw, gx.f32(), ggamma.f32(), gbeta.f32(), a, grm.f32(), grv.f32(), gy.f32(),
                                  gmean.f32(), ginvstd.f32());
    check_close(gy, y, 1e-5, "train y");
    check_close(gmean, mean, 1e-5, "saved mean");
    check_close(ginvstd, invstd, 1e-5, "saved inverse std");
    check_close(grm, rm, 1e-5, "running mean");
    check_close(grv, rv, 1e-5, "running variance");

    Tensor grm0 = dev(rm0), grv0 = dev(rv0), gy_eval = dev(nans(nx));
    cuda::batchnorm_forward_eval(h, n, c, hw, gx.f32(), ggamma.f32(), gbeta.f32(), a, grm0.f32(), grv0.f32(),
                                 gy_eval.f32());
    check_close(gy_eval, y_eval, 1e-5, "eval y");

    // Both sides differentiate at the CPU's saved statistics. cuDNN is not told eps here:
    // the non-default eps of some cases shows that it uses the saved inverse std as given.
    Tensor gdy = dev(dy), smean = dev(mean), sinvstd = dev(invstd);
    Tensor gdx = dev(nans(nx)), gdg = dev(nans(c)), gdb = dev(nans(c)), gdg_acc = dev(dg0), gdb_acc = dev(db0);
    cuda::batchnorm_backward(h, n, c, hw, gx.f32(), gdy.f32(), ggamma.f32(), smean.f32(), sinvstd.f32(), gdx.f32(),
                             0.0f, gdg.f32(), gdb.f32());
    check_close(gdx, dx, 1e-5, "dx");
    check_close(gdg, dg, 1e-5, "dgamma");
    check_close(gdb, db, 1e-5, "dbeta");
    cuda::batchnorm_backward(h, n, c, hw, gx.f32(), gdy.f32(), ggamma.f32(), smean.f32(), sinvstd.f32(), gdx.f32(),
                             1.0f, gdg_acc.f32(), gdb_acc.f32());
    check_close(gdx, dx, 1e-5, "dx (overwritten again)");
    check_close(gdg_acc, dg_acc, 1e-5, "dgamma accumulated (param_beta 1)");
    check_close(gdb_acc, db_acc, 1e-5, "dbeta accumulated (param_beta 1)");
  }
}

TEST_CASE("cuDNN's running variance is the batch's unbiased variance, as torch's", "[gpu][conv]") {
  // m = n * hw = 6 values per channel: the unbiased variance is the biased one times 1.2.
  const int64_t n = 2, c = 3, hw = 3, m = n * hw;
  const auto x = randn(n * c * hw, 51), gamma = randn(c, 52), beta = randn(c, 53);
  std::vector<double> mean(c), biased(c);
  for (int64_t i = 0; i < n * c * hw; ++i) mean[(i / hw) % c] += x[i] / double(m);
  for (int64_t i = 0; i < n * c * hw; ++i) biased[(i / hw) % c] += std::pow(x[i] - mean[(i / hw) % c], 2) / double(m);
  std::vector<float> want_mean(c), want_var(c), want_invstd(c);
  const BatchNormArgs a{.eps = 1e-5f, .momentum = 1.0f};  // the running statistics become the batch's
  for (int64_t j = 0; j < c; ++j) {
    want_mean[j] = float(mean[j]);
    want_var[j] = float(biased[j] * m / (m - 1));
    want_invstd[j] = float(1.0 / std::sqrt(biased[j] + a.eps));
  }
  Tensor gx = dev(x), ggamma = dev(gamma), gbeta = dev(beta), grm = dev(std::vector<float>(c, 0.0f)),
         grv = dev(std::vector<float>(c, 1.0f)), gy = dev(nans(n * c * hw)), gmean = dev(nans(c)),
         ginvstd = dev(nans(c));
  cuda::batchnorm_forward_train(dnn_handle(), n, c, hw, gx.f32(), ggamma.f32(), gbeta.f32(), a, grm.f32(), grv.f32(),
                                gy.f32(), gmean.f32(), ginvstd.f32());
  check_close(grm, want_mean, 1e-5, "running mean");
  check_close(grv, want_var, 1e-5, "running variance (unbiased)");
  check_close(ginvstd, want_invstd, 1e-5, "saved inverse std (biased variance)");
  CHECK_THROWS_AS(cuda::batchnorm_forward_train(dnn_handle(), n, c, hw, gx.f32(), ggamma.f32(), gbeta.f32(),
                                                BatchNormArgs{.eps = -1.0f}, grm.f32(), grv.f32(), gy.f32(),
                                                gmean.f32(), ginvstd.f32()),
                  Error);
}
#else
TEST_CASE("cuDNN kernels", "[gpu][conv]") { WARN("built without cuDNN: the convolution tests do not run"); }
#endif

// ---- Convolutional networks on the GPU --------------------------------------------------

#if DPT_WITH_CUDNN
namespace {
TrainConfig cnn_config(const std::string& spec) {
  TrainConfig c;
  c.model = spec;
  c.task = data::Task::classification;
  c.lr = 0.05f;
  c.batch = 10;  // uneven on 3 and 4 replicas
  c.steps = 30;
  c.log_every = 1000;
  return c;
}
}  // namespace

TEST_CASE("30 CNN training steps on CUDA match the same run on the CPU", "[gpu][conv][train]") {
  for (std::string spec : {"cnn:3x9x9-c6k3-p2-c8k3s2-a2-f5", "cnn:3x8x8-c6k3-bn-p2-c8k1-g-f4"}) {
    for (std::string opt : {"sgd", "adamw"}) {
      // Batch norm cancels the gradient of the convolution bias before it (its true value
      // is 0), leaving rounding noise that differs between CPU and GPU; AdamW divides by
      // its size and turns the noise into full steps, so only SGD is compared there.
      if (spec.find("bn") != std::string::npos && opt == "adamw") continue;
      INFO(spec << " " << opt);
      TrainConfig c = cnn_config(spec);
      c.optimizer = opt;
      c.lr = opt == "sgd" ? 0.05f : 0.003f;
      c.devices = {host};
      Trainer a(c);
      const TrainResult ra = a.run();
      c.devices = {gpu};
      Trainer b(c);
      const TrainResult rb = b.run();
      const double err = rel_error(b.model().flat_params().to_host(), a.model().flat_params().to_host());
      const bool has_buffers = a.model().flat_buffers().defined();  // batch norm's running statistics
      const double err_buf =
          has_buffers ? rel_error(b.model().flat_buffers().to_host(), a.model().flat_buffers().to_host()) : 0.0;
      INFO("weights relative error " << err << ", buffers " << err_buf << ", loss " << ra.final_loss << " vs "
                                     << rb.final_loss);
      CHECK(err < 1e-4);
      CHECK(err_buf < 1e-4);
      CHECK(std::fabs(ra.final_loss - rb.final_loss) <= 1e-3 * std::fabs(ra.final_loss));
    }
  }
}

TEST_CASE("a CNN on logical replicas of one GPU equals one-GPU training, with no cudaMalloc after the first step",
          "[gpu][conv][parallel][allocator]") {
  // Without batch norm N replicas are exactly one device; with it each replica normalizes
  // its own shard (as nn.DataParallel), so only the replicas' agreement is checked.
  const TrainConfig c = cnn_config("cnn:3x9x9-c6k3-p2-c8k3-g-f5");
  const auto want = train_dp(c, {gpu}, Reduce::automatic);
  for (int n : {2, 3}) {
    INFO(n << " replicas");
    const auto got = train_dp(c, std::vector<Device>(static_cast<size_t>(n), gpu), Reduce::p2p);
    const double err = rel_error(got, want);
    INFO("relative error " << err);
    CHECK(err < 1e-5);
  }
  TrainConfig bn = cnn_config("cnn:3x8x8-c6k3-bn-p2-f4");
  train_dp(bn, {gpu, gpu, gpu}, Reduce::p2p);  // asserts the replicas (buffers too) stay identical
  bn.devices = {gpu, gpu};
  bn.parallel.reduce = Reduce::p2p;
  Trainer t(bn);
  t.step(0, /*measure=*/true);  // as a run's first step, which is logged
  const int64_t after_first = allocator(gpu).stats().system_allocs;
  t.run();
  CHECK(allocator(gpu).stats().system_allocs == after_first);
}

TEST_CASE("a CNN step recorded as a CUDA graph trains exactly like the eager step", "[gpu][conv][graph]") {
  TrainConfig c = cnn_config("cnn:3x8x8-c6k3-bn-p2-c8k3-g-f4");
  c.batch = 16;
  c.devices = {gpu};
  // Each run's memory from an empty cache: the graph reuses within the recording what the
  // step frees, so it holds about one eager step's memory, not every temporary.
  allocator(gpu).empty_cache();
  allocator(gpu).reset_peak();
  const size_t eager_base = allocator(gpu).stats().reserved;  // what earlier tests still hold
  Trainer eager(c);
  eager.run();
  const size_t eager_peak = allocator(gpu).stats().peak_reserved - eager_base;
  c.parallel.cuda_graph = true;
  allocator(gpu).empty_cache();
  allocator(gpu).reset_peak();
  const size_t base = allocator(gpu).stats().reserved;  // eager's model and optimizer, still alive
  Trainer graphed(c);
  graphed.run();
  const size_t graph_peak = allocator(gpu).stats().peak_reserved - base;
  INFO("peak reserved: eager " << eager_peak << " B, graph " << graph_peak << " B");
  CHECK(graph_peak <= eager_peak + eager_peak / 4);
  CHECK(rel_error(graphed.model().flat_params().to_host(), eager.model().flat_params().to_host()) <= 1e-6);
  CHECK(rel_error(graphed.model().flat_buffers().to_host(), eager.model().flat_buffers().to_host()) <= 1e-6);
  // Batch norm on 2 logical replicas with 2 micro-batches: the running statistics are
  // copied from the master to the other replica inside the graph too.
  c.devices = {gpu, gpu};
  c.parallel.grad_accum = 2;
  c.parallel.cuda_graph = false;
  Trainer eager2(c);
  eager2.run();
  c.parallel.cuda_graph = true;
  Trainer graphed2(c);
  graphed2.run();
  CHECK(graphed2.model().flat_params().to_host() == eager2.model().flat_params().to_host());
  CHECK(graphed2.model().flat_buffers().to_host() == eager2.model().flat_buffers().to_host());
}
#endif

// ---- bf16 storage: the CUDA bf16 kernels against their CPU twins ------------------------

namespace {
// v rounded to bf16 and read back as floats: the values a bf16 tensor made from v holds.
[[maybe_unused]] std::vector<float> bf16_values(std::vector<float> v) {
  for (float& e : v) e = bf16_float(bf16_round(e));
  return v;
}

Tensor on_bf16(const Device& d, const std::vector<float>& v, const Shape& s) {
  return cast(Tensor::from_host(v, s, d), DType::bf16);
}

// For kernels that see the same bf16 inputs on both sides: every bf16 tensor f returns is
// within `ulps` bf16 ulps of the CPU's, every f32 one within `tol` relative error. (Results
// of GEMMs, whose fp32 sums differ in their last bits, are compared by relative error.)
void compare_bf16(const std::function<std::vector<Tensor>(const Device&)>& f, int64_t ulps, double tol = 1e-5) {
  auto a = f(host), b = f(gpu);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    REQUIRE(a[i].dtype() == b[i].dtype());
    if (a[i].dtype() == DType::bf16) {
      const int64_t u = test::max_ulps(test::bf16_bits(b[i]), test::bf16_bits(a[i]));
      INFO("result " << i << " (bf16) shape " << shape_str(a[i].shape()) << ": " << u << " ulps apart");
      CHECK(u <= ulps);
    } else {
      const double err = rel_error(b[i].to_host(), a[i].to_host());
      INFO("result " << i << " (f32) shape " << shape_str(a[i].shape()) << " relative error " << err);
      CHECK(err < tol);
    }
  }
}
}  // namespace

#if DPT_WITH_CUDA
TEST_CASE("bf16 cuBLASLt GEMMs (bf16 or f32 out, bias, ReLU) match the CPU at odd sizes and every transpose",
          "[gpu][gemm][bf16]") {
  struct Size {
    int64_t m, n, k;
  };
  const cublasHandle_t h = static_cast<cublasHandle_t>(context(gpu).blas());
  const cudaStream_t st = static_cast<cudaStream_t>(context(gpu).stream());
  Tensor ws = Tensor::empty({static_cast<int64_t>(cuda::kLtWorkspaceBytes / sizeof(float))}, DType::f32, gpu);
  for (Size s : {Size{1, 1, 1}, Size{17, 33, 65}, Size{64, 1000, 1000}, Size{130, 67, 129}})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (Act act : {Act::none, Act::relu})
          for (bool bias : {false, true})
            for (float beta : {0.0f, 0.5f})
              for (DType c_type : {DType::bf16, DType::f32}) {
                INFO(s.m << "x" << s.n << "x" << s.k << " ta " << ta << " tb " << tb << " relu " << (act == Act::relu)
                         << " bias " << bias << " beta " << beta << " C " << dtype_name(c_type));
                const Shape sa = ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, sb = tb ? Shape{s.n, s.k} : Shape{s.k, s.n};
                // Operands, bias (D's type) and C as the GPU sees them.
                const auto A = bf16_values(randn(numel(sa), 1)), B = bf16_values(randn(numel(sb), 2));
                auto b = randn(s.n, 4), C = randn(s.m * s.n, 3);
                if (c_type == DType::bf16) b = bf16_values(b), C = bf16_values(C);
                std::vector<float> want = C;
                cpu::gemm(ta, tb, s.m, s.n, s.k, 1.0f, A.data(), B.data(), beta, want.data());
                cpu::bias_act_forward(want.data(), bias ? b.data() : nullptr, act, s.m, s.n, nullptr, want.data());
                if (beta == 0.0f) C.assign(C.size(), NAN);  // beta == 0 must not read C
                Tensor dA = on_bf16(gpu, A, sa), dB = on_bf16(gpu, B, sb);
                Tensor db = cast(on(gpu, b, {s.n}), c_type), dC = cast(on(gpu, C, {s.m, s.n}), c_type);
                REQUIRE(cuda::gemm_lt(h, st, Precision::fp32, cuda::LtTypes{DType::bf16, c_type, c_type}, ta, tb, s.m,
                                      s.n, s.k, 1.0f, dA.data(), dB.data(), beta, dC.data(), bias ? db.data() : nullptr,
                                      act, ws.data(), cuda::kLtWorkspaceBytes));
                if (c_type == DType::bf16) {
                  // One rounding of an fp32 result that differs from the CPU's in its last bits.
                  const int64_t u = test::max_ulps(test::bf16_bits(dC), test::bf16_bits(on(host, want, {s.m, s.n})));
                  const double err = rel_error(dC.to_host(), want);
                  INFO(u << " ulps, relative error " << err);
                  CHECK(err < 4e-3);
                } else {
                  const double err = rel_error(dC.to_host(), want);
                  INFO("relative error " << err);
                  CHECK(err < 1e-5);
                }
              }
}

TEST_CASE("cuBLASLt with a bf16 D and an fp32 bias: supported and right, or refused cleanly", "[gpu][gemm][bf16]") {
  // The header documents the bias as D's type; linear_bf16 therefore hands a bf16 D the bf16
  // bias copy. This records what this cuBLASLt does with an fp32 bias, for the next design.
  const cublasHandle_t h = static_cast<cublasHandle_t>(context(gpu).blas());
  const cudaStream_t st = static_cast<cudaStream_t>(context(gpu).stream());
  Tensor ws = Tensor::empty({static_cast<int64_t>(cuda::kLtWorkspaceBytes / sizeof(float))}, DType::f32, gpu);
  const int64_t m = 256, n = 512, k = 128;
  const auto A = bf16_values(randn(m * k, 5)), B = bf16_values(randn(n * k, 6)), b = randn(n, 7);
  std::vector<float> want(static_cast<size_t>(m * n));
  cpu::gemm(false, true, m, n, k, 1.0f, A.data(), B.data(), 0.0f, want.data());
  cpu::bias_act_forward(want.data(), b.data(), Act::relu, m, n, nullptr, want.data());
  Tensor dA = on_bf16(gpu, A, {m, k}), dB = on_bf16(gpu, B, {n, k}), db = on(gpu, b, {n});
  Tensor dC = Tensor::empty({m, n}, DType::bf16, gpu);
  if (cuda::gemm_lt(h, st, Precision::fp32, cuda::LtTypes{DType::bf16, DType::bf16, DType::f32}, false, true, m, n, k,
                    1.0f, dA.data(), dB.data(), 0.0f, dC.data(), db.data(), Act::relu, ws.data(),
                    cuda::kLtWorkspaceBytes)) {
    const double err = rel_error(dC.to_host(), want);
    WARN("cuBLASLt accepts a bf16 D with an fp32 bias; relative error " << err);
    CHECK(err < 4e-3);
  } else {
    WARN("cuBLASLt has no kernel for a bf16 D with an fp32 bias");
  }
}
#endif

TEST_CASE("bf16 GEMMs through cuBLAS (f32 and bf16 out) match the CPU at odd sizes and every transpose",
          "[gpu][gemm][bf16]") {
  struct Size {
    int64_t m, n, k;
  };
  for (Size s : {Size{1, 1, 1}, Size{17, 33, 65}, Size{64, 1000, 1000}, Size{130, 67, 129}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        INFO(s.m << "x" << s.n << "x" << s.k << " ta " << ta << " tb " << tb);
        const Shape sa = ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, sb = tb ? Shape{s.n, s.k} : Shape{s.k, s.n};
        auto A = randn(numel(sa), 1), B = randn(numel(sb), 2), C = randn(s.m * s.n, 3);
        compare(
            [&](const Device& d) {
              Tensor a = on_bf16(d, A, sa), b = on_bf16(d, B, sb), c = on(d, C, {s.m, s.n});
              gemm(ta, tb, 0.5f, a, b, 0.25f, c);  // beta != 0 reads C
              Tensor c0 = Tensor::empty({s.m, s.n}, DType::f32, d);
              fill_(c0, NAN);  // beta == 0 must not read C
              gemm(ta, tb, 1.0f, a, b, 0.0f, c0);
              return std::vector<Tensor>{c, c0};
            },
            1e-5);
        compare(
            [&](const Device& d) {  // bf16 C: read, and rounded once
              Tensor c = on_bf16(d, C, {s.m, s.n});
              gemm(ta, tb, 0.5f, on_bf16(d, A, sa), on_bf16(d, B, sb), 0.25f, c);
              return std::vector<Tensor>{c};
            },
            4e-3);
      }
}

TEST_CASE("bf16 linear, activations and losses match the CPU bf16 ops, forward and backward", "[gpu][ops][bf16]") {
  // linear_bf16 below 2^30 multiply-adds: cuBLAS to fp32, then the bias/activation kernel.
  // At 2^30 and above (relu, none): cuBLASLt's epilogue writes y directly.
  struct Size {
    int64_t rows, in, out;
  };
  for (Size s : {Size{37, 53, 29}, Size{1024, 1024, 1024}})
    for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh}) {
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
  for (Act act : {Act::relu, Act::gelu, Act::tanh, Act::none}) {
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

TEST_CASE("30 bf16 training steps on CUDA follow the CPU bf16 run", "[gpu][train][bf16]") {
  for (auto task : {data::Task::regression, data::Task::classification})
    for (std::string opt : {"sgd", "adamw"}) {
      INFO(data::task_name(task) << " " << opt);
      TrainConfig cfg;
      cfg.model = "32-64x2-8";
      cfg.task = task;
      cfg.optimizer = opt;
      cfg.lr = opt == "sgd" ? 0.05f : 0.003f;
      cfg.batch = 128;
      cfg.steps = 30;
      cfg.log_every = 1000;
      cfg.parallel.precision = Precision::bf16;
      cfg.devices = {host};
      Trainer a(cfg);
      const TrainResult ra = a.run();
      cfg.devices = {gpu};
      Trainer b(cfg);
      REQUIRE(b.model().compute_dtype() == DType::bf16);
      const TrainResult rb = b.run();
      const double err = rel_error(b.model().flat_params().to_host(), a.model().flat_params().to_host());
      INFO("weights relative error " << err << ", loss " << ra.final_loss << " vs " << rb.final_loss);
      // The GPU's fp32 sums differ from the CPU's in their last bits, which now and then
      // rounds a bf16 value the other way: bf16 precision, not fp32's.
      CHECK(err < 1e-2);
      CHECK(std::fabs(ra.final_loss - rb.final_loss) <= 1e-2 * std::fabs(ra.final_loss));
      CHECK(test::bf16_bits(b.model().flat_shadow()) == test::bf16_bits(b.model().flat_params()));
    }
}

TEST_CASE("bf16 on logical replicas of one GPU (p2p), NCCL with one rank and a CUDA graph equal one GPU",
          "[gpu][parallel][graph][bf16]") {
  TrainConfig c = dp_config(data::Task::regression, "adamw");
  c.parallel.precision = Precision::bf16;
  const auto want = train_dp(c, {gpu}, Reduce::automatic);  // asserts replicas identical, shadows included
  for (int n : {2, 3}) {
    INFO(n << " logical replicas on cuda:0");
    const double err = rel_error(train_dp(c, std::vector<Device>(static_cast<size_t>(n), gpu), Reduce::p2p), want);
    INFO("relative error " << err);
    CHECK(err <= 1e-3);  // shard sizes pick other GEMM kernels: bf16 roundings may differ
  }
  if (built_with_nccl()) CHECK(rel_error(train_dp(c, {gpu}, Reduce::nccl), want) <= 1e-5);
  c.optimizer = "sgd";
  c.devices = {gpu};
  Trainer eager(c);
  eager.run();
  c.parallel.cuda_graph = true;
  Trainer graphed(c);
  for (int64_t s = 0; s < 3; ++s) graphed.step(s);  // eager, recorded, replayed
  const int64_t allocs = allocator(gpu).stats().system_allocs;
  graphed.run();
  CHECK(allocator(gpu).stats().system_allocs == allocs);
  CHECK(rel_error(graphed.model().flat_params().to_host(), eager.model().flat_params().to_host()) <= 1e-6);
  CHECK(test::bf16_bits(graphed.model().flat_shadow()) == test::bf16_bits(graphed.model().flat_params()));
}

TEST_CASE("the bf16 mlp step stores less than the fp32 one and allocates nothing after the first step",
          "[gpu][allocator][bf16]") {
  // The benchmark workload (BENCHMARKS.md mlp): PyTorch's bf16 autocast peaked at 673-787 MiB.
  auto peak_mib = [](DType dtype) {
    auto net = nn::mlp("mlp");
    net->set_compute_dtype(dtype);
    net->to(gpu, 1);
    optim::SGD opt(*net, {.lr = 0.01f});
    Tensor x = Tensor::empty({4096, 1024}, DType::f32, gpu), y = Tensor::empty({4096, 1024}, DType::f32, gpu);
    normal_(x, 1, 1, 0);
    normal_(y, 1, 2, 0);
    context(gpu).synchronize();
    allocator(gpu).reset_peak();
    const size_t held = allocator(gpu).stats().allocated;  // parameters, gradients, state, shadow, data
    int64_t allocs = 0;
    float first = 0, last = 0;
    for (int s = 0; s < 5; ++s) {
      net->zero_grad();
      Tensor loss = mse_loss(net->forward(x), y);
      loss.backward();
      opt.step();
      if (s == 0) {
        first = loss.item();
        allocs = allocator(gpu).stats().system_allocs;
      }
      last = loss.item();
    }
    CHECK(allocator(gpu).stats().system_allocs == allocs);
    CHECK(last < first);
    const size_t peak = allocator(gpu).stats().peak_allocated;
    return std::pair<double, double>{static_cast<double>(peak) / (1 << 20),
                                     static_cast<double>(peak - held) / (1 << 20)};
  };
  const auto [f32, f32_step] = peak_mib(DType::f32);
  const auto [bf16, bf16_step] = peak_mib(DType::bf16);
  WARN("mlp step peak: fp32 " << f32 << " MiB (the step's own " << f32_step << "), bf16 " << bf16 << " MiB ("
                              << bf16_step << ") (PyTorch bf16 autocast: 673 MiB)");
  // What the step itself allocates (activations and their gradients) halves; the bf16
  // shadow adds to what is held throughout.
  CHECK(bf16_step < 0.6 * f32_step);
  CHECK(bf16 <= 673.0);
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
    for (Act act : {Act::none, Act::relu, Act::gelu, Act::tanh})
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

#if DPT_WITH_CUDA
TEST_CASE("the small-batch GEMMs (skinny forward, short-k weight gradient) match the CPU", "[gpu][gemm]") {
  context(gpu).precision = Precision::fp32;  // (a Trainer earlier may have left another)
  const cudaStream_t st = static_cast<cudaStream_t>(context(gpu).stream());
  // An operand on the GPU (one element when empty: a pointer for k == 0), and an output
  // that beta == 0 must not read (NaNs there).
  auto operand = [&](const std::vector<float>& v) {
    return on(gpu, v.empty() ? std::vector<float>{0} : v, {std::max<int64_t>(1, static_cast<int64_t>(v.size()))});
  };
  auto output = [&](const std::vector<float>& v, float beta) {
    return on(gpu, beta == 0.0f ? std::vector<float>(v.size(), NAN) : v, {static_cast<int64_t>(v.size())});
  };
  struct Size {
    int64_t m, n, k;
  };
  // Skinny: one row to the most rows, one split to sixteen, k not a whole float4 (scalar
  // loads), k == 0 (C = act(beta C + bias)), the seed workload's shape.
  // The epilogue's 16-byte path (n % 4 == 0) with sixteen slices, one slice and none.
  // Past 64 rows: tiles of rows, whole and cut (the default job's 256 x 128 x 16 among them).
  for (Size s : {Size{64, 1000, 1000}, Size{1, 1, 1}, Size{17, 33, 1000}, Size{64, 129, 4099}, Size{5, 70, 0},
                 Size{33, 2050, 36}, Size{5, 72, 0}, Size{3, 8, 64}, Size{256, 128, 16}, Size{200, 4, 128},
                 Size{129, 70, 130}, Size{256, 33, 1000}, Size{65, 1, 0}})
    for (Act act : {Act::none, Act::relu, Act::gelu})
      for (float beta : {0.0f, 0.5f}) {
        INFO("skinny " << s.m << "x" << s.n << "x" << s.k << " act " << static_cast<int>(act) << " beta " << beta);
        const auto A = randn(s.m * s.k, 31), B = randn(s.n * s.k, 32, 0.05f), b = randn(s.n, 33),
                   C = randn(s.m * s.n, 34);
        std::vector<float> want = C, want_z(static_cast<size_t>(s.m * s.n));
        cpu::gemm(false, true, s.m, s.n, s.k, 1.5f, A.data(), B.data(), beta, want.data());
        cpu::bias_act_forward(want.data(), b.data(), act, s.m, s.n, want_z.data(), want.data());
        Tensor dA = operand(A);
        Tensor dB = operand(B);
        Tensor db = on(gpu, b, {s.n}), z = Tensor::empty({s.m * s.n}, DType::f32, gpu);
        Tensor dC = output(C, beta);
        // No workspace where k is not split: null then.
        Tensor work = Tensor::empty({cuda::gemm_skinny_work(s.m, s.n, s.k)}, DType::f32, gpu);
        float* w = work.numel() > 0 ? work.f32() : nullptr;
        cuda::gemm_skinny(s.m, s.n, s.k, 1.5f, dA.f32(), dB.f32(), beta, dC.f32(), db.f32(), act, z.f32(), w, st);
        CHECK(rel_error(dC.to_host(), want) < 1e-5);
        CHECK(rel_error(z.to_host(), want_z) < 1e-5);
        if (beta == 0.0f && act == Act::none) {  // the same bits on a second run
          Tensor again = Tensor::empty({s.m * s.n}, DType::f32, gpu);
          cuda::gemm_skinny(s.m, s.n, s.k, 1.5f, dA.f32(), dB.f32(), 0.0f, again.f32(), db.f32(), act, nullptr, w, st);
          CHECK(again.to_host() == dC.to_host());
        }
      }
  // Skinny A B (B n-contiguous: a tiny layer's input gradient, k up to 128): the default
  // job's two, edges in m, n and k, scalar loads, two chunks of k, k == 0.
  for (Size s : {Size{256, 128, 4}, Size{256, 128, 128}, Size{1, 1, 1}, Size{200, 70, 33}, Size{65, 6, 0},
                 Size{3, 1030, 64}, Size{256, 33, 64}, Size{17, 130, 5}, Size{64, 66, 100}})
    for (float beta : {0.0f, 0.5f}) {
      INFO("skinny nn " << s.m << "x" << s.n << "x" << s.k << " beta " << beta);
      const auto A = randn(s.m * s.k, 42), B = randn(s.k * s.n, 43), C = randn(s.m * s.n, 44);
      std::vector<float> want = C;
      cpu::gemm(false, false, s.m, s.n, s.k, 1.5f, A.data(), B.data(), beta, want.data());
      Tensor dA = operand(A);
      Tensor dB = operand(B);
      Tensor dC = output(C, beta);
      cuda::gemm_skinny_nn(s.m, s.n, s.k, 1.5f, dA.f32(), dB.f32(), beta, dC.f32(), st);
      CHECK(rel_error(dC.to_host(), want) < 1e-5);
      if (beta == 0.0f) {  // the same bits on a second run
        Tensor again = Tensor::empty({s.m * s.n}, DType::f32, gpu);
        cuda::gemm_skinny_nn(s.m, s.n, s.k, 1.5f, dA.f32(), dB.f32(), 0.0f, again.f32(), st);
        CHECK(again.to_host() == dC.to_host());
      }
      // A as dy times act'(saved), made as it is loaded: the CPU's act_backward, then its GEMM.
      for (Act act : {Act::relu, Act::gelu, Act::tanh}) {
        INFO("times act' " << static_cast<int>(act));
        const auto saved = randn(s.m * s.k, 45);
        std::vector<float> dz(A.size()), want_d = C;
        cpu::act_backward(A.data(), saved.data(), act, s.m * s.k, dz.data());
        cpu::gemm(false, false, s.m, s.n, s.k, 1.5f, dz.data(), B.data(), beta, want_d.data());
        Tensor dS = operand(saved);
        Tensor dC3 = output(C, beta);
        cuda::gemm_skinny_nn(s.m, s.n, s.k, 1.5f, dA.f32(), dB.f32(), beta, dC3.f32(), st, dS.f32(), act);
        CHECK(rel_error(dC3.to_host(), want_d) < 1e-5);
      }
    }
  // Short k: edges in m and n, float4 and scalar loads, k == 0, the seed's weight gradient.
  // And k past 64 (a batch of up to 256 of a tiny layer), split over a cluster (the
  // default job's three weight gradients; three chunks in two slices; a single tile whose
  // last slice ends past k; four tiles cut in m and n; a slice that starts past k, five
  // chunks in four slices of two; eight slices of one chunk).
  for (Size s : {Size{1000, 1000, 64}, Size{1, 1, 1}, Size{67, 130, 17}, Size{64, 64, 0}, Size{130, 67, 64},
                 Size{4, 1028, 3}, Size{128, 16, 256}, Size{4, 128, 256}, Size{130, 67, 200}, Size{128, 128, 256},
                 Size{70, 8, 129}, Size{3, 5, 250}, Size{66, 66, 65}, Size{8, 8, 300}, Size{9, 7, 512}})
    for (float beta : {0.0f, 1.0f}) {
      INFO("short k " << s.m << "x" << s.n << "x" << s.k << " beta " << beta);
      const auto A = randn(s.k * s.m, 35), B = randn(s.k * s.n, 36), C = randn(s.m * s.n, 37);
      std::vector<float> want = C;
      cpu::gemm(true, false, s.m, s.n, s.k, 0.5f, A.data(), B.data(), beta, want.data());
      Tensor dA = operand(A);
      Tensor dB = operand(B);
      Tensor dC = output(C, beta);
      cuda::gemm_short_k(s.m, s.n, s.k, 0.5f, dA.f32(), dB.f32(), beta, dC.f32(), st);
      CHECK(rel_error(dC.to_host(), want) < 1e-5);
      // With A's column sums beside (a bias gradient): the same C, and the sums.
      const auto sums0 = randn(s.m, 41);
      std::vector<float> want_sums(static_cast<size_t>(s.m));
      for (int64_t i = 0; i < s.m; ++i) {
        double sum = 0.0;
        for (int64_t r = 0; r < s.k; ++r) sum += A[static_cast<size_t>(r * s.m + i)];
        want_sums[static_cast<size_t>(i)] = static_cast<float>(0.5 * sum + beta * sums0[static_cast<size_t>(i)]);
      }
      Tensor dC2 = output(C, beta);
      Tensor sums = output(sums0, beta);  // beta 0: not read
      cuda::gemm_short_k(s.m, s.n, s.k, 0.5f, dA.f32(), dB.f32(), beta, dC2.f32(), st, sums.f32(), beta);
      CHECK(dC2.to_host() == dC.to_host());
      CHECK(rel_error(sums.to_host(), want_sums) < 1e-5);
      // A as dy times act'(saved), made as it is loaded, the column sums of that too.
      for (Act act : {Act::relu, Act::gelu, Act::tanh}) {
        INFO("times act' " << static_cast<int>(act));
        const auto saved = randn(s.k * s.m, 46);
        std::vector<float> dz(A.size()), want_d = C, want_dsums(static_cast<size_t>(s.m));
        cpu::act_backward(A.data(), saved.data(), act, s.k * s.m, dz.data());
        cpu::gemm(true, false, s.m, s.n, s.k, 0.5f, dz.data(), B.data(), beta, want_d.data());
        for (int64_t i = 0; i < s.m; ++i) {
          double sum = 0.0;
          for (int64_t r = 0; r < s.k; ++r) sum += dz[static_cast<size_t>(r * s.m + i)];
          want_dsums[static_cast<size_t>(i)] = static_cast<float>(0.5 * sum + beta * sums0[static_cast<size_t>(i)]);
        }
        Tensor dS = operand(saved);
        Tensor dC3 = output(C, beta);
        Tensor sums3 = output(sums0, beta);
        cuda::gemm_short_k(s.m, s.n, s.k, 0.5f, dA.f32(), dB.f32(), beta, dC3.f32(), st, sums3.f32(), beta, dS.f32(),
                           act);
        CHECK(rel_error(dC3.to_host(), want_d) < 1e-5);
        CHECK(rel_error(sums3.to_host(), want_dsums) < 1e-5);
      }
    }
  // linear() routes a batch of 64 to the skinny kernel in fp32 (the same bits as calling
  // it), and a Linear layer there still matches the CPU forward and backward.
  auto x = randn(64 * 300, 38), W = randn(200 * 300, 39, 0.05f), bias = randn(200, 40);
  {
    Tensor dx = on(gpu, x, {64, 300}), dW = on(gpu, W, {200, 300}), db = on(gpu, bias, {200});
    Tensor direct = Tensor::empty({64, 200}, DType::f32, gpu);
    Tensor work = Tensor::empty({cuda::gemm_skinny_work(64, 200, 300)}, DType::f32, gpu);
    cuda::gemm_skinny(64, 200, 300, 1.0f, dx.f32(), dW.f32(), 0.0f, direct.f32(), db.f32(), Act::relu, nullptr,
                      work.f32(), st);
    CHECK(linear(dx, dW, db, Act::relu).to_host() == direct.to_host());
  }
  // ReLU, and no activation, whose bias gradient the short-k kernel sums beside the weight gradient.
  for (Act act : {Act::relu, Act::none})
    compare([&](const Device& d) {
      return value_and_grads([&](std::vector<Tensor>& in) { return linear(in[0], in[1], in[2], act); },
                             {on(d, x, {64, 300}), on(d, W, {200, 300}), on(d, bias, {200})});
    });
  // The default job's last two layers at its batch of 256: the weight gradients split over
  // clusters, the output layer's input gradient in the skinny A B kernel.
  {
    const auto h = randn(256 * 128, 79), W2 = randn(128 * 128, 80, 0.1f), b2 = randn(128, 81),
               W3 = randn(4 * 128, 82, 0.1f), b3 = randn(4, 83);
    compare([&](const Device& d) {
      return value_and_grads(
          [&](std::vector<Tensor>& in) {
            return linear(linear(in[0], in[1], in[2], Act::relu), in[3], in[4], Act::none);
          },
          {on(d, h, {256, 128}), on(d, W2, {128, 128}), on(d, b2, {128}), on(d, W3, {4, 128}), on(d, b3, {4})});
    });
  }
  // The whole default job (16-128x2-4) at its batch, each activation: the hidden layers'
  // dz made as their gradients' kernels load dy (no pass of its own), the first layer
  // without an input gradient (its input is data).
  for (Act act : {Act::relu, Act::gelu, Act::tanh}) {
    INFO("default job, activation " << static_cast<int>(act));
    const auto x1 = randn(256 * 16, 84), W1 = randn(128 * 16, 85, 0.3f), b1 = randn(128, 86),
               W2 = randn(128 * 128, 80, 0.1f), b2 = randn(128, 81), W3 = randn(4 * 128, 82, 0.1f), b3 = randn(4, 83);
    compare([&](const Device& d) {
      std::vector<Tensor> p{on(d, W1, {128, 16}), on(d, b1, {128}),    on(d, W2, {128, 128}),
                            on(d, b2, {128}),     on(d, W3, {4, 128}), on(d, b3, {4})};
      for (auto& t : p) t.set_requires_grad(true);
      const Tensor h = linear(linear(on(d, x1, {256, 16}), p[0], p[1], act), p[2], p[3], act);
      const Tensor y = linear(h, p[4], p[5], Act::none);
      mse_loss(y, on(d, randn(256 * 4, 87), {256, 4})).backward();
      std::vector<Tensor> out{y.detach()};
      for (const Tensor& t : p) out.push_back(t.grad());
      return out;
    });
  }
  // Twice through backward without zeroing: the second pass adds into both gradients (beta 1).
  compare([&](const Device& d) {
    std::vector<Tensor> in{on(d, x, {64, 300}), on(d, W, {200, 300}), on(d, bias, {200})};
    for (auto& t : in) t.set_requires_grad(true);
    for (uint64_t pass = 0; pass < 2; ++pass)
      mse_loss(linear(in[0], in[1], in[2], Act::none), on(d, randn(64 * 200, 78 + pass), {64, 200})).backward();
    return std::vector<Tensor>{in[1].grad(), in[2].grad()};
  });
  // No input features: the weight gradient is empty, and the bias gradient must still come.
  auto no_inputs = [&](const Device& d) {
    Tensor xx = Tensor::empty({64, 0}, DType::f32, d), WW = Tensor::empty({200, 0}, DType::f32, d);
    Tensor bb = on(d, bias, {200});
    for (Tensor* t : {&xx, &WW, &bb}) t->set_requires_grad(true);
    Tensor y = linear(xx, WW, bb, Act::none);
    mse_loss(y, on(d, randn(64 * 200, 80), {64, 200})).backward();
    return std::vector<Tensor>{y.detach(), bb.grad()};
  };
  const auto want = no_inputs(host), got = no_inputs(gpu);
  CHECK(rel_error(got[0].to_host(), want[0].to_host()) < 1e-5);
  CHECK(rel_error(got[1].to_host(), want[1].to_host()) < 1e-5);
}
#endif

TEST_CASE("data sets gather rows into GPU batches as they gather them on the host", "[gpu][data]") {
  // An array data set (float16 inputs, labels) and a synthetic one on the CPU.
  std::vector<uint16_t> x(9 * 5);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint16_t>(0x3c00 + i);  // 1.0 and up
  const std::vector<int64_t> y = {4, 0, 3, 1, 2, 0, 1, 4, 3};
  const data::ArrayDataset a({x.data(), data::ArrayDType::f16, {9, 5}}, {y.data(), data::ArrayDType::i64, {9}});
  const data::Synthetic s({.task = data::Task::regression, .in = 5, .out = 2, .seed = 3, .samples = 30}, host);
  const std::vector<int64_t> rows = {8, 1, 2, 2, 7};
  for (const data::Dataset* d : {static_cast<const data::Dataset*>(&a), static_cast<const data::Dataset*>(&s)}) {
    INFO(d->inputs_name());
    data::Batch on_host = d->empty_batch(5, host), on_gpu = d->empty_batch(5, gpu);
    d->gather(rows, on_host);
    d->gather(rows, on_gpu);
    CHECK(on_gpu.x.device() == gpu);
    CHECK(on_gpu.x.to_host() == on_host.x.to_host());
    if (d->task() == data::Task::classification) CHECK(on_gpu.y.to_host_i32() == on_host.y.to_host_i32());
    else CHECK(on_gpu.y.to_host() == on_host.y.to_host());
    const data::Batch b = d->batch(6, 5, gpu), h = d->batch(6, 5, host);  // wraps around the array's 9 rows
    CHECK(b.x.device() == gpu);
    CHECK(b.x.to_host() == h.x.to_host());
  }
}

namespace {
// `steps` steps of a bf16 or fp32 MLP on `devs` through `path`, each bucket updated once
// reduced or not, the buckets' size tuned over the first steps or not: replica 0's
// parameters (every replica checked identical).
struct PerBucketRun {
  bool per_bucket = false, graph = false, tune = false;
  int comm_ctas = 0;
  int steps = 6;
};
std::vector<float> train_per_bucket(const std::vector<Device>& devs, Reduce path, const std::string& opt,
                                    Precision precision, PerBucketRun run) {
  auto m = nn::mlp("24-48x2-6");
  m->to(devs[0], 4);
  DataParallelOptions o;
  o.reduce = path;
  o.bucket_mb = 0.002;  // several buckets, the first smaller
  o.first_bucket_mb = 0.001;
  o.precision = precision;
  o.update_per_bucket = run.per_bucket;
  o.cuda_graph = run.graph;
  o.comm_ctas = run.comm_ctas;
  o.tune_buckets = run.tune;
  DataParallel dp(
      m, devs,
      [&](nn::Module& r) -> std::unique_ptr<optim::Optimizer> {
        std::unique_ptr<optim::Optimizer> p;
        if (opt == "sgd")
          p = std::make_unique<optim::SGD>(r,
                                           optim::SGD::Options{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f});
        else p = std::make_unique<optim::AdamW>(r, optim::AdamW::Options{.lr = 0.003f});
        p->set_schedule({optim::Schedule::Kind::cosine, opt == "sgd" ? 0.05f : 0.003f, 2, 8});
        return p;
      },
      o);
  REQUIRE(dp.buckets() > 2);
  data::Synthetic d({.task = data::Task::regression, .in = 24, .out = 6, .seed = 3}, devs[0]);
  const data::Dataset& rows = d;
  for (int s = 0; s < run.steps; ++s)
    dp.train_step(
        s * 32, 32, [&](size_t r, int64_t first, int64_t n) { return rows.batch(first, n, dp.device(r)); },
        nn::MSELoss());
  CHECK_FALSE(dp.tuning_buckets());
  CHECK(dp.replicas_identical());
  CHECK(dp.optimizer().steps_taken() == run.steps);
  return dp.replica(0).flat_params().to_host();
}
}  // namespace

TEST_CASE("each bucket updated once reduced equals the update after the last, eager and in a graph",
          "[gpu][parallel][per_bucket]") {
  for (std::string opt : {"sgd", "adamw"})
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      INFO(opt << ", " << precision_name(precision));
      // p2p between logical replicas of the GPU (the master updates on its reduction's stream).
      const std::vector<Device> two{gpu, gpu};
      const auto want = train_per_bucket(two, Reduce::p2p, opt, precision, {});
      CHECK(train_per_bucket(two, Reduce::p2p, opt, precision, {.per_bucket = true}) == want);
      CHECK(train_per_bucket(two, Reduce::p2p, opt, precision, {.per_bucket = true, .graph = true}) == want);
      // Buckets tuned over the first steps (0.002 and 1 MiB; 4 to 64 MiB give 1 MiB's one
      // bucket): the parameters of fixed ones.
      const auto longer = train_per_bucket(two, Reduce::p2p, opt, precision, {.steps = 12});
      CHECK(train_per_bucket(two, Reduce::p2p, opt, precision, {.per_bucket = true, .tune = true, .steps = 12}) ==
            longer);
      // NCCL with one rank (every bucket's sum is its own gradient), NCCL's thread blocks capped.
      if (!built_with_nccl()) continue;
      const auto one = train_per_bucket({gpu}, Reduce::nccl, opt, precision, {});
      CHECK(train_per_bucket({gpu}, Reduce::nccl, opt, precision, {.per_bucket = true}) == one);
      CHECK(train_per_bucket({gpu}, Reduce::nccl, opt, precision, {.comm_ctas = 2}) == one);
      CHECK(train_per_bucket({gpu}, Reduce::nccl, opt, precision, {.tune = true, .steps = 12}) ==
            train_per_bucket({gpu}, Reduce::nccl, opt, precision, {.steps = 12}));
    }
}

TEST_CASE("p2p's chunked copy of the parameters equals the whole copy on logical replicas of the GPU",
          "[gpu][parallel]") {
  // Three replicas on one GPU: each copies the master's parameters layer by layer on its
  // update stream while its next forward runs on its compute stream. A missing wait shows
  // as a replica that computed with old parameters: other losses, other parameters. Three
  // rounds, as a race need not show in every one.
  const std::vector<Device> three{gpu, gpu, gpu};
  for (int round = 0; round < 3; ++round)
    for (std::string opt : {"sgd", "adamw"})
      for (Precision precision : {Precision::fp32, Precision::bf16}) {
        INFO("round " << round << ", " << opt << ", " << precision_name(precision));
        CHECK(test::train_p2p_chunked(three, true, precision, opt) ==
              test::train_p2p_chunked(three, false, precision, opt));
      }
  if (cuda_device_count() < 2) return;
  // Two GPUs: the copies cross NVLink (or PCIe) while the second's forward runs.
  const std::vector<Device> two{gpu, {DeviceType::cuda, 1}};
  for (int round = 0; round < 3; ++round)
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      INFO("two GPUs, round " << round << ", " << precision_name(precision));
      CHECK(test::train_p2p_chunked(two, true, precision, "adamw") ==
            test::train_p2p_chunked(two, false, precision, "adamw"));
    }
}

#if DPT_WITH_CUDA
TEST_CASE("the peer sum's bf16 kernel adds as the CPU's does at any alignment", "[gpu][ops][bf16]") {
  const cudaStream_t st = static_cast<cudaStream_t>(context(gpu).stream());
  for (int64_t n : {1, 7, 64, 1000, 4099})
    for (int64_t offset : {0, 1, 3}) {  // a view one or three elements in: the unaligned kernel
      INFO(n << " elements at offset " << offset);
      const auto x32 = randn(n + offset, 21), y = randn(n + offset, 22);
      std::vector<uint16_t> x(x32.size());
      cpu::cast_f32_bf16(x32.data(), x.data(), static_cast<int64_t>(x.size()));
      std::vector<float> want = y;
      cpu::add_bf16(x.data() + offset, want.data() + offset, n);
      const Tensor dx = cast(Tensor::from_host(x32, {n + offset}, gpu), DType::bf16);
      const Tensor dy = Tensor::from_host(y, {n + offset}, gpu);
      cuda::add_bf16(dx.bf16() + offset, dy.f32() + offset, n, st);
      CHECK(dy.to_host() == want);  // one rounding of y + float(x): the same on both
    }
}
#endif

#if DPT_WITH_CUDA
TEST_CASE("communication streams have the highest priority; a peer sum needs a peer", "[gpu][parallel]") {
  Context normal(gpu), high(gpu, StreamPriority::high);
  int least = 0, greatest = 0;
  REQUIRE(cudaDeviceGetStreamPriorityRange(&least, &greatest) == cudaSuccess);
  CHECK(normal.priority() == least);
  CHECK(high.priority() == greatest);
  CHECK(high.priority() < normal.priority());  // the CUDA order: lower runs first
  std::vector<ReplicaBuffers> bufs;
  for (int i = 0; i < 2; ++i)
    bufs.push_back(
        {&context(gpu), Tensor::zeros({256}, DType::f32, gpu), Tensor::zeros({256}, DType::f32, gpu), Tensor()});
  auto p2p = make_p2p_reducer(bufs, make_buckets(256, 1024, 1024));
  for (Context* c : p2p->contexts()) CHECK(c->priority() == greatest);
  // One GPU reads its own memory: no peer, so add_peer_ refuses.
  const Tensor a = Tensor::zeros({4}, DType::f32, gpu), b = Tensor::zeros({4}, DType::f32, gpu);
  CHECK_THROWS_AS(add_peer_(a, b), Error);
  CHECK_FALSE(peer_readable(gpu, gpu));
  CHECK_FALSE(peer_readable(gpu, host));
}
#endif

TEST_CASE("a peer's bucket summed in place equals the staged copy and sum, f32 and bf16", "[gpu][multigpu]") {
  if (cuda_device_count() >= 2) enable_peer_access({gpu, {DeviceType::cuda, 1}});
  if (cuda_device_count() < 2 || !peer_readable(gpu, {DeviceType::cuda, 1})) {
    WARN("no second GPU that this one reads directly: the peer sum is not tested here");
    return;
  }
  const Device other{DeviceType::cuda, 1};
  const int64_t n = 1000003;  // a scalar tail after the float4s
  for (DType t : {DType::f32, DType::bf16}) {
    INFO(dtype_name(t));
    const auto y0 = test::randn(n, 5), x0 = test::randn(n, 6);
    Tensor x = cast(Tensor::from_host(x0, {n}, other), t);
    Tensor direct = Tensor::from_host(y0, {n}, gpu), staged = Tensor::from_host(y0, {n}, gpu);
    add_peer_(x, direct);
    Tensor here = Tensor::empty({n}, t, gpu);
    copy(here, x);
    axpy_(1.0f, here, staged);
    CHECK(direct.to_host() == staged.to_host());
    CHECK(direct.to_host() != y0);
  }
}

TEST_CASE(
    "N GPUs: p2p reading peers in place equals NCCL, updates per bucket and NCCL's capped blocks equal the "
    "usual",
    "[gpu][parallel][multigpu][per_bucket]") {
  const int gpus = cuda_device_count();
  if (gpus < 2) {
    WARN("one GPU here: the multi-GPU per-bucket tests need 2 or more");
    return;
  }
  for (int n = 2; n <= std::min(gpus, 8); ++n) {
    std::vector<Device> devs;
    for (int i = 0; i < n; ++i) devs.push_back({DeviceType::cuda, i});
    for (std::string opt : {"sgd", "adamw"}) {
      INFO(opt << " on " << n << " GPUs");
      const auto p2p = train_per_bucket(devs, Reduce::p2p, opt, Precision::fp32, {});
      CHECK(train_per_bucket(devs, Reduce::p2p, opt, Precision::fp32, {.per_bucket = true}) == p2p);
      if (!built_with_nccl()) continue;
      const auto nccl = train_per_bucket(devs, Reduce::nccl, opt, Precision::fp32, {});
      CHECK(train_per_bucket(devs, Reduce::nccl, opt, Precision::fp32, {.per_bucket = true}) == nccl);
      // Two GPUs add a + b both ways (the same bits); more may add in another order.
      if (n == 2) CHECK(p2p == nccl);
      else CHECK(rel_error(p2p, nccl) <= 1e-6);
      CHECK(rel_error(train_per_bucket(devs, Reduce::nccl, opt, Precision::fp32, {.comm_ctas = 4}), nccl) <= 1e-6);
    }
  }
}
