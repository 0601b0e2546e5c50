// Helpers shared by the tests: relative error, random tensors, finite differences, a
// temporary folder.
#pragma once
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/runtime/tensor.hpp>
#include "catch.hpp"
#include "kernels/bf16.hpp"
#include "kernels/cpu/cpu.hpp"

namespace dpt::test {

// ||a - b|| / ||b||; NaN anywhere gives infinity, so NaN never passes.
inline double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

inline std::vector<float> randn(int64_t n, uint64_t seed, float std = 1.0f) {
  std::vector<float> v(static_cast<size_t>(n));
  cpu::normal(v.data(), n, seed, 7, 0, std);
  return v;
}

inline Tensor randn_tensor(const Shape& s, uint64_t seed, const Device& d, float std = 1.0f) {
  return Tensor::from_host(randn(numel(s), seed, std), s, d);
}

// Central differences of the scalar f() with respect to every element of the CPU
// tensor t (perturbed in place and restored).
inline std::vector<float> numeric_grad(const Tensor& t, const std::function<float()>& f, float eps = 1e-2f) {
  std::vector<float> g(static_cast<size_t>(t.numel()));
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float keep = p[i];
    p[i] = keep + eps;
    const double up = f();
    p[i] = keep - eps;
    const double down = f();
    p[i] = keep;
    g[static_cast<size_t>(i)] = static_cast<float>((up - down) / (2.0 * eps));
  }
  return g;
}

// The bits of a bf16 (or f32, rounded) tensor on any device: read as floats, which bf16
// values are exactly, and rounded back.
inline std::vector<uint16_t> bf16_bits(const Tensor& t) {
  const auto v = t.to_host();
  std::vector<uint16_t> b(v.size());
  cpu::cast_f32_bf16(v.data(), b.data(), static_cast<int64_t>(v.size()));
  return b;
}

// The largest distance between a and b in bf16 units in the last place (counted along the
// ordered bf16 values, so +0 and -0 are one apart); any NaN gives a huge number.
inline int64_t max_ulps(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  if (a.size() != b.size()) return INT64_MAX;
  auto ordered = [](uint16_t h) {
    return (h & 0x8000u) ? -static_cast<int64_t>(h & 0x7fffu) - 1 : static_cast<int64_t>(h);
  };
  int64_t worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(bf16_float(a[i])) || std::isnan(bf16_float(b[i]))) return INT64_MAX;
    worst = std::max<int64_t>(worst, std::llabs(ordered(a[i]) - ordered(b[i])));
  }
  return worst;
}

// A fresh folder, removed with everything in it at the end of the test.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static std::atomic<int> serial{0};
    path = std::filesystem::temp_directory_path() /
           ("dpt_test_" + std::to_string(::getpid()) + "_" + std::to_string(serial++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
  // The names in the folder, sorted: a leftover temporary file shows up here.
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
};

// The one-line UsageError that f() throws ("" when it throws none; another exception
// passes through, failing the test case).
template <class F>
std::string usage_error(F&& f) {
  try {
    f();
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    CHECK(msg.find('\n') == std::string::npos);
    return msg;
  }
  return "";
}

}  // namespace dpt::test
