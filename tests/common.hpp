// Helpers shared by the tests: relative error, random tensors, finite differences, the
// CPU-against-GPU comparisons of the op tests (fp32 and bf16), a temporary folder.
#pragma once
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <dptrain/error.hpp>
#include <dptrain/layers/module.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/runtime/tensor.hpp>
#include "catch.hpp"
#include "kernels/bf16.hpp"
#include "kernels/cpu/cpu.hpp"

#if DPT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

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

// The column sums of a [rows, cols] tensor's values, added in double.
inline std::vector<float> column_sums(const Tensor& t) {
  const auto v = t.to_host();
  const int64_t rows = t.size(0), cols = t.size(1);
  std::vector<double> s(static_cast<size_t>(cols), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) s[static_cast<size_t>(c)] += v[static_cast<size_t>(r * cols + c)];
  return {s.begin(), s.end()};
}

inline std::vector<float> randn(int64_t n, uint64_t seed, float std = 1.0f) {
  std::vector<float> v(static_cast<size_t>(n));
  cpu::normal(v.data(), n, seed, 7, 0, std);
  return v;
}

inline Tensor randn_tensor(const Shape& s, uint64_t seed, const Device& d, float std = 1.0f) {
  return Tensor::from_host(randn(numel(s), seed, std), s, d);
}

// Two bf16 layers, c -> hidden -> c, each with its fp32 master weight and bias (the leaves,
// from seeds seed .. seed + 3) beside their bf16 copies.
struct TwoLayers {
  Tensor W1, b1, W2, b2;
  Bf16Layer fc, proj;
  TwoLayers(const Device& d, int64_t c, int64_t hidden, uint64_t seed)
      : W1(randn_tensor({hidden, c}, seed, d, 0.1f).set_requires_grad(true)),
        b1(randn_tensor({hidden}, seed + 1, d, 0.5f).set_requires_grad(true)),
        W2(randn_tensor({c, hidden}, seed + 2, d, 0.1f).set_requires_grad(true)),
        b2(randn_tensor({c}, seed + 3, d).set_requires_grad(true)),
        fc{W1, b1, cast(W1.detach(), DType::bf16), cast(b1.detach(), DType::bf16)},
        proj{W2, b2, cast(W2.detach(), DType::bf16), cast(b2.detach(), DType::bf16)} {}
};

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

// The devices the op tests compare: the CPU (the oracle) and the first GPU.
inline const Device host{DeviceType::cpu, 0};
inline const Device gpu{DeviceType::cuda, 0};

inline Tensor on(const Device& d, const std::vector<float>& v, const Shape& s) { return Tensor::from_host(v, s, d); }

// Runs f(device) on the CPU and on the GPU with the same inputs and compares every
// tensor it returns (outputs and gradients).
inline void compare(const std::function<std::vector<Tensor>(const Device&)>& f, double tol = 1e-5) {
  auto a = f(host), b = f(gpu);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const double err = rel_error(b[i].to_host(), a[i].to_host());
    INFO("result " << i << " shape " << shape_str(a[i].shape()) << " relative error " << err);
    CHECK(err < tol);
  }
}

// An op's value and the gradients of mse(op, target) for each input.
inline std::vector<Tensor> value_and_grads(const std::function<Tensor(std::vector<Tensor>&)>& op,
                                           std::vector<Tensor> inputs) {
  for (auto& t : inputs) t.set_requires_grad(true);
  Tensor y = op(inputs);
  Tensor target = Tensor::from_host(randn(y.numel(), 77), y.shape(), y.device());
  mse_loss(y, target).backward();
  std::vector<Tensor> out{y.detach()};
  for (auto& t : inputs) out.push_back(t.grad());
  return out;
}

// Checks d loss / d t for every tensor in `wrt` against finite differences, where
// loss = mse(f(), target) is rebuilt from the (perturbed) tensors each time.
inline void check_gradients(const std::function<Tensor()>& f, std::vector<Tensor> wrt, double tol = 2e-3) {
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

// t rounded to bf16 and back: the values a bf16 tensor made from t holds, as f32.
inline Tensor rounded(const Tensor& t) { return cast(cast(t.detach(), DType::bf16), DType::f32); }

// Whether the module's shadow is bitwise its master parameters rounded to bf16.
inline bool shadow_current(const nn::Module& m) {
  return m.flat_shadow().defined() && bf16_bits(m.flat_shadow()) == bf16_bits(m.flat_params());
}

// v rounded to bf16 and read back as floats: the values a bf16 tensor made from v holds.
inline std::vector<float> bf16_values(std::vector<float> v) {
  for (float& e : v) e = bf16_float(bf16_round(e));
  return v;
}

inline Tensor on_bf16(const Device& d, const std::vector<float>& v, const Shape& s) {
  return cast(Tensor::from_host(v, s, d), DType::bf16);
}

// For kernels that see the same bf16 inputs on both sides: every bf16 tensor f returns is
// within `ulps` bf16 ulps of the CPU's, every f32 one within `tol` relative error. (Results
// of GEMMs, whose fp32 sums differ in their last bits, are compared by relative error.)
inline void compare_bf16(const std::function<std::vector<Tensor>(const Device&)>& f, int64_t ulps, double tol = 1e-5) {
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

// Checks that `msg` is one line that starts with `prefix` and says `problem`.
inline void check_one_line(const std::string& msg, const std::string& prefix, const std::string& problem) {
  INFO("message: " << msg);
  CHECK(msg.rfind(prefix, 0) == 0);
  CHECK(msg.find(problem) != std::string::npos);
  CHECK(msg.find('\n') == std::string::npos);
}

// Feeds `trials` mutants of a good file to read(bytes), which checks whatever it reads:
// mutate(bytes, rng) edits a copy of `good`, and one mutant in 16 is then cut short. A
// mutant refused must throw an E whose message starts with `prefix`; some mutants must
// be read and some refused.
template <class E, class Mutate, class Read>
void check_mutants(const std::vector<uint8_t>& good, uint64_t seed, int trials, const std::string& prefix,
                   Mutate&& mutate, Read&& read) {
  std::mt19937_64 rng(seed);
  int read_ok = 0, refused = 0;
  for (int trial = 0; trial < trials; ++trial) {
    std::vector<uint8_t> bytes = good;
    mutate(bytes, rng);
    if (rng() % 16 == 0) bytes.resize(rng() % bytes.size());
    try {
      read(bytes);
      ++read_ok;
    } catch (const E& e) {
      ++refused;
      CHECK(std::string(e.what()).rfind(prefix, 0) == 0);
    }
  }
  INFO(read_ok << " read, " << refused << " refused");
  CHECK(read_ok > 0);
  CHECK(refused > 0);
}

#if DPT_WITH_CUDA
// A recorded graph's nodes of each type (cudaGraphNodeType -> count).
inline std::map<int, int> graph_node_types(cudaGraph_t g) {
  size_t count = 0;
  REQUIRE(cudaGraphGetNodes(g, nullptr, &count) == cudaSuccess);
  std::vector<cudaGraphNode_t> nodes(count);
  REQUIRE(cudaGraphGetNodes(g, nodes.data(), &count) == cudaSuccess);
  std::map<int, int> types;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    REQUIRE(cudaGraphNodeGetType(node, &type) == cudaSuccess);
    ++types[type];
  }
  return types;
}
#endif

}  // namespace dpt::test
