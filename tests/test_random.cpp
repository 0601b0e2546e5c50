// Random numbers: Philox's known answer and statistics, row maps; the GPU's Philox against
// the CPU's.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>

#include <dptrain/error.hpp>
#include "kernels/cpu/cpu.hpp"
#include "kernels/philox.hpp"
#include "runtime/allocator.hpp"

#include "catch.hpp"
#include "common.hpp"

using namespace dpt;
using namespace dpt::test;

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

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

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

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

#endif  // DPT_GPU_TESTS
