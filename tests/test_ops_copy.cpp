// Casts, copies and argmax: bf16 rounding and argmax on the CPU; on the GPU, the copy
// kernel at any alignment and size, a recorded graph's small memsets as kernels, and the
// peer sum's bf16 kernel against the CPU.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include <dptrain/error.hpp>
#include <dptrain/runtime/context.hpp>
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

TEST_CASE("argmax takes the first maximum", "[ops]") {
  Tensor x = Tensor::from_host({1, 3, 3, 0, -1, -2, 5, 5, 5}, {3, 3}, host);
  CHECK(argmax_rows(x).to_host_i32() == std::vector<int32_t>{1, 0, 0});
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

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

#if DPT_WITH_CUDA
TEST_CASE("a recorded graph's small memsets become kernels that write the same bytes in the same order",
          "[gpu][ops][graph]") {
  // A large fill (stays a memset node), then a 4-byte zero and a 2-D memset (5 rows of 3
  // bytes, 64 apart) over it, then a copy kernel reading the buffer: the replaced nodes
  // must run after the fill and before the copy.
  constexpr size_t kBytes = 8192;
  const Tensor buf = Tensor::empty({static_cast<int64_t>(kBytes / 4)}, DType::f32, gpu);
  const Tensor out = Tensor::empty({static_cast<int64_t>(kBytes / 4)}, DType::f32, gpu);
  auto* b = static_cast<unsigned char*>(buf.data());
  Context ctx(gpu);
  const auto st = static_cast<cudaStream_t>(ctx.stream());
  context(gpu).synchronize();
  cudaGraph_t g = nullptr;
  REQUIRE(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(b, 0xab, kBytes, st) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(b + 256, 0, 4, st) == cudaSuccess);
  REQUIRE(cudaMemset2DAsync(b + 1001, 64, 0x5a, 3, 5, st) == cudaSuccess);
  cuda::CopyPieces pieces;
  pieces.piece[pieces.count++] = {out.data(), buf.data(), static_cast<int64_t>(kBytes)};
  cuda::copy_device(pieces, st);
  REQUIRE(cudaStreamEndCapture(st, &g) == cudaSuccess);
  CHECK(cuda::replace_small_memset_nodes(g) == 2);
  std::map<int, int> types = graph_node_types(g);
  CHECK(types[cudaGraphNodeTypeMemset] == 1);  // the large fill
  CHECK(types[cudaGraphNodeTypeKernel] == 3);
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, g, 0) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, st) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(st) == cudaSuccess);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(g);
  std::vector<unsigned char> want(kBytes, 0xab), got(kBytes);
  std::fill_n(want.begin() + 256, 4, 0);
  for (int row = 0; row < 5; ++row) std::fill_n(want.begin() + 1001 + 64 * row, 3, 0x5a);
  const std::vector<float> host = out.to_host();
  std::memcpy(got.data(), host.data(), kBytes);
  CHECK(got == want);
}

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

#endif  // DPT_GPU_TESTS
