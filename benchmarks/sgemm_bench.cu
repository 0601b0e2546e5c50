// sgemm_bench — the hand-written SGEMM (gemm_native) against cuBLAS in strict fp32.
//
// First checks gemm_native against gemm_cublas(fp32) for all four transpose cases, at the
// benchmark size and at odd sizes that exercise every edge path (alpha/beta included, and
// beta == 0 over a C full of NaN), printing ||native - cublas|| / ||cublas||. Then times
// both at size^3, NN and TN, with CUDA events: warm-up, then the median of kRuns runs.
// Exits 1 when a check fails, 77 when there is no GPU (so ctest can mark it skipped).
//
//   sgemm_bench [--size N]     (default 4096)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/check.hpp"
#include "kernels/cuda/cuda.hpp"
#include "kernels/philox.hpp"

namespace {

constexpr int kWarmup = 3;
constexpr int kRuns = 21;
constexpr double kTol = 1e-4;

// Uniform in [-1, 1): the library's own fill lives in elementwise.cu, which this program
// does not link, so it draws from the same Philox stream itself.
__global__ void fill_uniform_kernel(float* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = dpt::philox::uniform(seed, 0, static_cast<uint64_t>(i), -1.0f, 1.0f);
}

void fill_uniform(float* x, int64_t n, uint64_t seed) {
  fill_uniform_kernel<<<1024, 256>>>(x, n, seed);
  DPT_CUDA_CHECK_LAUNCH();
}

// ||a - b|| / ||b|| over n device floats, in double on the host. NaN anywhere gives NaN,
// which fails the `< kTol` test.
double rel_error(const float* a, const float* b, int64_t n) {
  std::vector<float> ha(static_cast<size_t>(n)), hb(static_cast<size_t>(n));
  DPT_CUDA_CHECK(cudaMemcpy(ha.data(), a, n * sizeof(float), cudaMemcpyDeviceToHost));
  DPT_CUDA_CHECK(cudaMemcpy(hb.data(), b, n * sizeof(float), cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(ha[i]) - hb[i];
    num += d * d;
    den += static_cast<double>(hb[i]) * hb[i];
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

// Device buffers of `elems` floats each: the operands, a starting C, and one C per impl.
struct Buffers {
  float *A = nullptr, *B = nullptr, *C0 = nullptr, *C1 = nullptr, *C2 = nullptr;
  explicit Buffers(int64_t elems) {
    for (float** p : {&A, &B, &C0, &C1, &C2}) {
      DPT_CUDA_CHECK(cudaMalloc(p, elems * sizeof(float)));
    }
  }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  ~Buffers() {
    for (float* p : {A, B, C0, C1, C2}) DPT_CUDA_WARN(cudaFree(p));
  }
};

// Runs native (into C1) and cuBLAS (into C2) on the same inputs, both starting from C0
// (or from NaN when beta == 0); true when they agree.
bool check_case(cublasHandle_t h, cudaStream_t s, const float* A, const float* B, const float* C0, float* C1, float* C2,
                bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, float beta, const char* note = "") {
  const int64_t cn = m * n;
  if (beta == 0.f) {
    // All-ones bytes are a NaN: a kernel that reads C when beta == 0 shows it.
    DPT_CUDA_CHECK(cudaMemsetAsync(C1, 0xFF, cn * sizeof(float), s));
    DPT_CUDA_CHECK(cudaMemsetAsync(C2, 0xFF, cn * sizeof(float), s));
  } else {
    DPT_CUDA_CHECK(cudaMemcpyAsync(C1, C0, cn * sizeof(float), cudaMemcpyDeviceToDevice, s));
    DPT_CUDA_CHECK(cudaMemcpyAsync(C2, C0, cn * sizeof(float), cudaMemcpyDeviceToDevice, s));
  }
  dpt::cuda::gemm_native(ta, tb, m, n, k, alpha, A, B, beta, C1, s);
  dpt::cuda::gemm_cublas(h, dpt::Precision::fp32, ta, tb, m, n, k, alpha, A, B, beta, C2);
  DPT_CUDA_CHECK(cudaStreamSynchronize(s));
  const double err = rel_error(C1, C2, cn);
  const bool ok = err < kTol;
  std::printf("check %c%c %lldx%lldx%lld alpha=%g beta=%g%s  rel_err %.3e  %s\n", ta ? 'T' : 'N', tb ? 'T' : 'N',
              static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k), alpha, beta, note, err,
              ok ? "ok" : "FAIL");
  return ok;
}

template <typename F>
double median_ms(cudaStream_t s, F&& run) {
  cudaEvent_t e0, e1;
  DPT_CUDA_CHECK(cudaEventCreate(&e0));
  DPT_CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < kWarmup; ++i) run();
  std::vector<double> ms;
  for (int i = 0; i < kRuns; ++i) {
    DPT_CUDA_CHECK(cudaEventRecord(e0, s));
    run();
    DPT_CUDA_CHECK(cudaEventRecord(e1, s));
    DPT_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    DPT_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  DPT_CUDA_WARN(cudaEventDestroy(e0));
  DPT_CUDA_WARN(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int run(int64_t size) {
  cudaStream_t s;
  DPT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cublasHandle_t h;
  DPT_CUBLAS_CHECK(cublasCreate(&h));
  DPT_CUBLAS_CHECK(cublasSetStream(h, s));

  const int64_t elems = std::max<int64_t>(size * size, 1000 * 1000) + 1;  // +1: misaligned case
  Buffers buf(elems);
  fill_uniform(buf.A, elems, 1);
  fill_uniform(buf.B, elems, 2);
  fill_uniform(buf.C0, elems, 3);
  DPT_CUDA_CHECK(cudaDeviceSynchronize());

  bool ok = true;
  const int64_t odd[][3] = {{1, 1, 1},     {17, 33, 65}, {1000, 64, 1000}, {129, 127, 9},
                            {64, 1000, 7}, {3, 260, 4},  {256, 256, 256}};
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 2, tb = t & 1;
    ok &= check_case(h, s, buf.A, buf.B, buf.C0, buf.C1, buf.C2, ta, tb, size, size, size, 1.f, 0.f);
    for (const auto& d : odd) {
      ok &= check_case(h, s, buf.A, buf.B, buf.C0, buf.C1, buf.C2, ta, tb, d[0], d[1], d[2], 1.f, 0.f);
      ok &= check_case(h, s, buf.A, buf.B, buf.C0, buf.C1, buf.C2, ta, tb, d[0], d[1], d[2], 0.5f, -1.5f);
    }
    // Operands one float off 16-byte alignment take the scalar-load path.
    ok &= check_case(h, s, buf.A + 1, buf.B + 1, buf.C0, buf.C1 + 1, buf.C2 + 1, ta, tb, 300, 200, 100, 1.f, 0.5f,
                     " misaligned");
  }

  const double flop = 2.0 * static_cast<double>(size) * size * size;
  const std::string dims = std::to_string(size) + "x" + std::to_string(size) + "x" + std::to_string(size);
  double native_nn = 0, cublas_nn = 0;
  for (int t : {0, 2}) {  // NN, TN
    const bool ta = t & 2, tb = t & 1;
    const char* tag = ta ? "-tn" : "";  // plain names are NN
    const double ms_native =
        median_ms(s, [&] { dpt::cuda::gemm_native(ta, tb, size, size, size, 1.f, buf.A, buf.B, 0.f, buf.C1, s); });
    const double ms_cublas = median_ms(s, [&] {
      dpt::cuda::gemm_cublas(h, dpt::Precision::fp32, ta, tb, size, size, size, 1.f, buf.A, buf.B, 0.f, buf.C2);
    });
    std::printf("sgemm native%s %s %.3f ms %.2f TFLOP/s\n", tag, dims.c_str(), ms_native, flop / ms_native * 1e-9);
    std::printf("sgemm cublas%s %s %.3f ms %.2f TFLOP/s\n", tag, dims.c_str(), ms_cublas, flop / ms_cublas * 1e-9);
    if (t == 0) {
      native_nn = ms_native;
      cublas_nn = ms_cublas;
    }
  }
  std::printf("native/cublas = %.3f\n", cublas_nn / native_nn);

  DPT_CUBLAS_CHECK(cublasDestroy(h));
  DPT_CUDA_CHECK(cudaStreamDestroy(s));
  if (!ok) std::printf("FAILED: native and cuBLAS disagree (see the checks above)\n");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t size = 4096;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--size") == 0 && i + 1 < argc) {
      size = std::atoll(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--size N]\n", argv[0]);
      return 2;
    }
  }
  if (size < 1) {
    std::fprintf(stderr, "sgemm_bench: --size must be >= 1\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("sgemm_bench: no CUDA device, skipping\n");
    return 77;
  }
  try {
    return run(size);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sgemm_bench: %s\n", e.what());
    return 1;
  }
}
