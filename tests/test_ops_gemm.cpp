// GEMMs: matmul's gradients against finite differences on the CPU; on the GPU, cuBLAS,
// cuBLASLt (bias and ReLU epilogues, bf16), the native and the small-batch kernels against
// the CPU at every transpose and odd sizes, TF32 and bf16 within their precision, and a
// GEMM recorded into a CUDA graph.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>

#include <dptrain/error.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/train/trainer.hpp>
#include "kernels/cpu/cpu.hpp"
#include "runtime/allocator.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/cuda.hpp"
#endif

#include "catch.hpp"
#include "common.hpp"

using namespace dpt;
using namespace dpt::test;

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

TEST_CASE("matmul gradients match finite differences for every transpose", "[ops][grad]") {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      INFO("ta " << ta << " tb " << tb);
      Tensor a = randn_tensor(ta ? Shape{5, 3} : Shape{3, 5}, 1, host);
      Tensor b = randn_tensor(tb ? Shape{4, 5} : Shape{5, 4}, 2, host);
      check_gradients([&] { return matmul(a, b, ta, tb); }, {a, b});
    }
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

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
  std::map<int, int> types = graph_node_types(g);
  cudaGraphDestroy(g);
  CHECK(types[cudaGraphNodeTypeKernel] >= 1);
  CHECK(types[cudaGraphNodeTypeMemAlloc] + types[cudaGraphNodeTypeMemFree] == 0);
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
namespace {

// One cuBLASLt GEMM the tests call directly: D = A B + beta C, then the bias and activation.
struct LtCase {
  int64_t m, n, k;
  bool ta, tb;
  Act act;
  bool bias;
  float beta;
  Shape a_shape() const { return ta ? Shape{k, m} : Shape{m, k}; }
  Shape b_shape() const { return tb ? Shape{n, k} : Shape{k, n}; }
  // The CPU's result from these operands, bias and C.
  std::vector<float> want(const std::vector<float>& A, const std::vector<float>& B, const std::vector<float>& b,
                          std::vector<float> C) const {
    cpu::gemm(ta, tb, m, n, k, 1.0f, A.data(), B.data(), beta, C.data());
    cpu::bias_act_forward(C.data(), bias ? b.data() : nullptr, act, m, n, nullptr, C.data());
    return C;
  }
};

// The GPU's cuBLAS handle and stream, and a cuBLASLt workspace.
struct LtWorkspace {
  cublasHandle_t handle = static_cast<cublasHandle_t>(context(gpu).blas());
  cudaStream_t stream = static_cast<cudaStream_t>(context(gpu).stream());
  Tensor bytes = Tensor::empty({static_cast<int64_t>(cuda::kLtWorkspaceBytes / sizeof(float))}, DType::f32, gpu);
};

// Calls f for every case at odd sizes, every transpose, with and without bias and ReLU,
// beta 0 (the tests put NaN in C) and beta != 0.
template <class F>
void for_each_lt_case(F&& f) {
  struct Size {
    int64_t m, n, k;
  };
  for (Size s : {Size{1, 1, 1}, Size{17, 33, 65}, Size{64, 1000, 1000}, Size{130, 67, 129}})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (Act act : {Act::none, Act::relu})
          for (bool bias : {false, true})
            for (float beta : {0.0f, 0.5f}) {
              INFO(s.m << "x" << s.n << "x" << s.k << " ta " << ta << " tb " << tb << " relu " << (act == Act::relu)
                       << " bias " << bias << " beta " << beta);
              f(LtCase{s.m, s.n, s.k, ta, tb, act, bias, beta});
            }
}

}  // namespace

TEST_CASE("cuBLASLt GEMMs with the bias and ReLU epilogue match the CPU", "[gpu][gemm]") {
  // Linear takes this path only for large GEMMs; here it is called directly.
  const LtWorkspace ws;
  for_each_lt_case([&](const LtCase& s) {
    const Shape sa = s.a_shape(), sb = s.b_shape();
    const auto A = randn(numel(sa), 1), B = randn(numel(sb), 2), b = randn(s.n, 4);
    auto C = randn(s.m * s.n, 3);
    const std::vector<float> want = s.want(A, B, b, C);
    if (s.beta == 0.0f) C.assign(C.size(), NAN);  // beta == 0 must not read C
    Tensor dA = on(gpu, A, sa), dB = on(gpu, B, sb), db = on(gpu, b, {s.n}), dC = on(gpu, C, {s.m, s.n});
    REQUIRE(cuda::gemm_lt(ws.handle, ws.stream, Precision::fp32, s.ta, s.tb, s.m, s.n, s.k, 1.0f, dA.f32(), dB.f32(),
                          s.beta, dC.f32(), s.bias ? db.f32() : nullptr, s.act, ws.bytes.data(),
                          cuda::kLtWorkspaceBytes));
    const double err = rel_error(dC.to_host(), want);
    INFO("relative error " << err);
    CHECK(err < 1e-5);
  });
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

#if DPT_WITH_CUDA
TEST_CASE("bf16 cuBLASLt GEMMs (bf16 or f32 out, bias, ReLU) match the CPU at odd sizes and every transpose",
          "[gpu][gemm][bf16]") {
  const LtWorkspace ws;
  for_each_lt_case([&](const LtCase& s) {
    for (DType c_type : {DType::bf16, DType::f32}) {
      INFO("C " << dtype_name(c_type));
      const Shape sa = s.a_shape(), sb = s.b_shape();
      // Operands, bias (D's type) and C as the GPU sees them.
      const auto A = bf16_values(randn(numel(sa), 1)), B = bf16_values(randn(numel(sb), 2));
      auto b = randn(s.n, 4), C = randn(s.m * s.n, 3);
      if (c_type == DType::bf16) b = bf16_values(b), C = bf16_values(C);
      const std::vector<float> want = s.want(A, B, b, C);
      if (s.beta == 0.0f) C.assign(C.size(), NAN);  // beta == 0 must not read C
      Tensor dA = on_bf16(gpu, A, sa), dB = on_bf16(gpu, B, sb);
      Tensor db = cast(on(gpu, b, {s.n}), c_type), dC = cast(on(gpu, C, {s.m, s.n}), c_type);
      REQUIRE(cuda::gemm_lt(ws.handle, ws.stream, Precision::fp32, cuda::LtTypes{DType::bf16, c_type, c_type}, s.ta,
                            s.tb, s.m, s.n, s.k, 1.0f, dA.data(), dB.data(), s.beta, dC.data(),
                            s.bias ? db.data() : nullptr, s.act, ws.bytes.data(), cuda::kLtWorkspaceBytes));
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
  });
}

TEST_CASE("a tuned cuBLASLt plan writes the bits of the heuristic's choice", "[gpu][gemm][bf16]") {
  // GPT-2's MLP GEMMs at 2056 rows (a shape no other test makes a plan for): GELU_AUX_BIAS
  // forward, DGELU from its pre-activation, the weight gradient into fp32 with beta 0 (tuned)
  // and 1 (a plan of its own, never tuned). Plans are kept by stream: the untuned ones are
  // made on a stream of their own while tuning is off. The tuned plans are then run on other
  // data too, where a kernel that sums in another order would show.
  const int64_t rows = 2056, C = 768, H = 3072;
  const cublasHandle_t h = static_cast<cublasHandle_t>(context(gpu).blas());
  Tensor ws = Tensor::empty({static_cast<int64_t>(cuda::kLtWorkspaceBytes / sizeof(float))}, DType::f32, gpu);
  const Tensor W = on_bf16(gpu, bf16_values(randn(H * C, 61, 0.05f)), {H, C});
  const Tensor b = on_bf16(gpu, bf16_values(randn(H, 62)), {H});
  // Every output's bits: y, z, dz (bf16) and dW (fp32) as 32-bit words.
  auto run = [&](cudaStream_t st, uint64_t seed) {
    const Tensor x = on_bf16(gpu, bf16_values(randn(rows * C, seed)), {rows, C});
    const Tensor dy = on_bf16(gpu, bf16_values(randn(rows * C, seed + 1)), {rows, C});
    Tensor y = Tensor::empty({rows, H}, DType::bf16, gpu), z = Tensor::empty({rows, H}, DType::bf16, gpu);
    Tensor dz = Tensor::empty({rows, H}, DType::bf16, gpu), dW = Tensor::zeros({H, C}, DType::f32, gpu);
    const cuda::LtTypes b16{DType::bf16, DType::bf16, DType::bf16}, f32{DType::bf16, DType::f32, DType::bf16};
    REQUIRE(cuda::gemm_lt(h, st, Precision::fp32, b16, false, true, rows, H, C, 1.0f, x.data(), W.data(), 0.0f,
                          y.data(), b.data(), Act::gelu_tanh, ws.data(), cuda::kLtWorkspaceBytes, z.data()));
    // (W's memory read as C x H: a stand-in for c_proj's weight.)
    REQUIRE(cuda::gemm_lt(h, st, Precision::fp32, b16, false, false, rows, H, C, 1.0f, dy.data(), W.data(), 0.0f,
                          dz.data(), nullptr, Act::gelu_tanh, ws.data(), cuda::kLtWorkspaceBytes, z.data(), true));
    for (float beta : {0.0f, 1.0f})
      REQUIRE(cuda::gemm_lt(h, st, Precision::fp32, f32, true, false, H, C, rows, 1.0f, dz.data(), x.data(), beta,
                            dW.data(), nullptr, Act::none, ws.data(), cuda::kLtWorkspaceBytes));
    REQUIRE(cudaStreamSynchronize(st) == cudaSuccess);
    std::vector<uint32_t> dw_bits(static_cast<size_t>(H * C));
    const auto dw = dW.to_host();
    std::memcpy(dw_bits.data(), dw.data(), dw.size() * sizeof(float));
    auto bits = [](const Tensor& t) {
      const auto words = test::bf16_bits(t);
      return std::vector<uint32_t>(words.begin(), words.end());
    };
    return std::vector<std::vector<uint32_t> >{bits(y), bits(z), bits(dz), dw_bits};
  };
  struct Streams {  // and tuning back on, however the test ends
    cudaStream_t tuned = nullptr, plain = nullptr;
    ~Streams() {
      cuda::set_lt_tuning(true);
      if (tuned) cudaStreamDestroy(tuned);
      if (plain) cudaStreamDestroy(plain);
    }
  } s;
  REQUIRE(cudaStreamCreateWithFlags(&s.tuned, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&s.plain, cudaStreamNonBlocking) == cudaSuccess);
  cuda::set_lt_tuning(false);
  const auto want = run(s.plain, 60), want_other = run(s.plain, 70);
  cuda::set_lt_tuning(true);
  const int64_t tuned_before = cuda::lt_tuning_stats().plans;
  const auto got = run(s.tuned, 60);
  CHECK(cuda::lt_tuning_stats().plans > tuned_before);  // cuBLASLt offers more than one kernel somewhere here
  const auto got_other = run(s.tuned, 70);
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("output " << i << " (y, z, dz, dW)");
    CHECK(got[i] == want[i]);
    CHECK(got_other[i] == want_other[i]);
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
  // 1032 x 1024 x 1024: over 2^30 multiply-adds, where gemm takes cuBLASLt (a tuned plan).
  for (Size s : {Size{1, 1, 1}, Size{17, 33, 65}, Size{64, 1000, 1000}, Size{130, 67, 129}, Size{1032, 1024, 1024}})
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
  // alpha op(A) B + beta C on the CPU.
  auto cpu_gemm = [](bool ta, int64_t m, int64_t n, int64_t k, float alpha, const std::vector<float>& A,
                     const std::vector<float>& B, float beta, std::vector<float> C) {
    cpu::gemm(ta, false, m, n, k, alpha, A.data(), B.data(), beta, C.data());
    return C;
  };
  struct Size {
    int64_t m, n, k;
  };
  // The operands of alpha op(A) B + beta C (A of m x k or k x m, B of k x n: B n-contiguous),
  // random from seeds seed..seed + 2; the CPU's result; the GPU's operands and output.
  struct GemmRun {
    std::vector<float> A, B, C, want;
    Tensor dA, dB, dC;
  };
  auto gemm_run = [&](bool ta, Size s, float alpha, float beta, uint64_t seed) {
    GemmRun g{randn(s.m * s.k, seed), randn(s.k * s.n, seed + 1), randn(s.m * s.n, seed + 2), {}, {}, {}, {}};
    g.want = cpu_gemm(ta, s.m, s.n, s.k, alpha, g.A, g.B, beta, g.C);
    g.dA = operand(g.A);
    g.dB = operand(g.B);
    g.dC = output(g.C, beta);
    return g;
  };
  // Skinny: one row to the most rows, one split to sixteen, k not a whole float4 (scalar
  // loads), k == 0 (C = act(beta C + bias)), the seed workload's shape.
  // The epilogue's 16-byte path (n % 4 == 0) with sixteen slices, one slice and none.
  // Past 64 rows: tiles of rows, whole and cut (the default job's 256 x 128 x 16 among them).
  for (Size s : {Size{64, 1000, 1000}, Size{1, 1, 1}, Size{17, 33, 1000}, Size{64, 129, 4099}, Size{5, 70, 0},
                 Size{33, 2050, 36}, Size{5, 72, 0}, Size{3, 8, 64}, Size{256, 128, 16}, Size{200, 4, 128},
                 Size{129, 70, 130}, Size{256, 33, 1000}, Size{65, 1, 0}})
    for (Act act : {Act::none, Act::relu, Act::gelu, Act::gelu_tanh})
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
      const auto [A, B, C, want, dA, dB, dC] = gemm_run(false, s, 1.5f, beta, 42);
      cuda::gemm_skinny_nn(s.m, s.n, s.k, 1.5f, dA.f32(), dB.f32(), beta, dC.f32(), st);
      CHECK(rel_error(dC.to_host(), want) < 1e-5);
      if (beta == 0.0f) {  // the same bits on a second run
        Tensor again = Tensor::empty({s.m * s.n}, DType::f32, gpu);
        cuda::gemm_skinny_nn(s.m, s.n, s.k, 1.5f, dA.f32(), dB.f32(), 0.0f, again.f32(), st);
        CHECK(again.to_host() == dC.to_host());
      }
      // A as dy times act'(saved), made as it is loaded: the CPU's act_backward, then its GEMM.
      for (Act act : {Act::relu, Act::gelu, Act::tanh, Act::gelu_tanh}) {
        INFO("times act' " << static_cast<int>(act));
        const auto saved = randn(s.m * s.k, 45);
        std::vector<float> dz(A.size());
        cpu::act_backward(A.data(), saved.data(), act, s.m * s.k, dz.data());
        const std::vector<float> want_d = cpu_gemm(false, s.m, s.n, s.k, 1.5f, dz, B, beta, C);
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
      const auto [A, B, C, want, dA, dB, dC] = gemm_run(true, s, 0.5f, beta, 35);
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
      for (Act act : {Act::relu, Act::gelu, Act::tanh, Act::gelu_tanh}) {
        INFO("times act' " << static_cast<int>(act));
        const auto saved = randn(s.k * s.m, 46);
        std::vector<float> dz(A.size()), want_dsums(static_cast<size_t>(s.m));
        cpu::act_backward(A.data(), saved.data(), act, s.k * s.m, dz.data());
        const std::vector<float> want_d = cpu_gemm(true, s.m, s.n, s.k, 0.5f, dz, B, beta, C);
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
  for (Act act : {Act::relu, Act::gelu, Act::tanh, Act::gelu_tanh}) {
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

#endif  // DPT_GPU_TESTS
