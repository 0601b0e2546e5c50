// CPU GEMM: the oracle for both CUDA GEMMs. Each element of C is the sum over p = 0 ..
// k - 1, in that order from 0, of A(i, p) B(p, j), then alpha times it (plus beta C): the
// inner loop runs contiguous over a row of B and of the sums, so the compiler vectorizes
// it, and transposed operands are read through strides. The sums are kept for a tile of
// kTileRows x kTileCols of C at a time (in L1) while a panel of B (k x kTileCols, in L2)
// serves every row tile: a wide product (a language model's vocabulary, 50304 columns)
// then reads B from the cache, not from memory once a row. The order of each element's
// additions is the same whatever the tiles: the same bits.
#include <algorithm>
#include <vector>

#include "bf16_io.hpp"
#include "cpu.hpp"

namespace dpt::cpu {

namespace {
constexpr int64_t kTileRows = 8, kTileCols = 256;
}

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, const float* B, float beta,
          float* C) {
  // op(B) as a contiguous k x n matrix, so the hot loop always streams rows. The scratch
  // is the thread's, kept from call to call (up to 4 MiB): a small model's step allocates
  // nothing here.
  thread_local std::vector<float> bt, sums;
  if (tb) {
    bt.resize(static_cast<size_t>(k * n));
    for (int64_t j = 0; j < n; ++j)
      for (int64_t p = 0; p < k; ++p) bt[p * n + j] = B[j * k + p];
    B = bt.data();
  }
  sums.resize(static_cast<size_t>(kTileRows * kTileCols));
  for (int64_t j0 = 0; j0 < n; j0 += kTileCols) {
    const int64_t cols = std::min(kTileCols, n - j0);
    for (int64_t i0 = 0; i0 < m; i0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, m - i0);
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t p = 0; p < k; ++p) {
        const float* b = B + p * n + j0;
        for (int64_t r = 0; r < rows; ++r) {
          const float a = ta ? A[p * m + i0 + r] : A[(i0 + r) * k + p];
          float* s = sums.data() + r * kTileCols;
          for (int64_t j = 0; j < cols; ++j) s[j] += a * b[j];
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* s = sums.data() + r * kTileCols;
        float* c = C + (i0 + r) * n + j0;
        if (beta == 0.0f) {  // beta == 0 never reads C, which may hold garbage
          for (int64_t j = 0; j < cols; ++j) c[j] = alpha * s[j];
        } else {
          for (int64_t j = 0; j < cols; ++j) c[j] = alpha * s[j] + beta * c[j];
        }
      }
    }
  }
  // A large GEMM's scratch is not kept: the next small one would hold it for good.
  constexpr size_t kKeep = size_t{1} << 20;  // floats
  if (bt.capacity() > kKeep) std::vector<float>().swap(bt);
}

void gemm_bf16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* A, const uint16_t* B,
               float beta, float* C) {
  const auto a = widen(A, m * k), b = widen(B, k * n);
  gemm(ta, tb, m, n, k, alpha, a.data(), b.data(), beta, C);
}

void gemm_bf16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* A, const uint16_t* B,
               float beta, uint16_t* C) {
  std::vector<float> c = beta == 0.0f ? std::vector<float>(static_cast<size_t>(m * n)) : widen(C, m * n);
  gemm_bf16(ta, tb, m, n, k, alpha, A, B, beta, c.data());
  narrow(c, C);
}

void mlp_forward(int64_t rows, const float* x, const MlpLayers& layers) {
  const float* in = x;
  for (int l = 0; l < layers.count; ++l) {
    const MlpLayer& L = layers.layer[l];
    gemm(false, true, rows, L.out, L.in, 1.0f, in, L.W, 0.0f, L.y);
    bias_act_forward(L.y, L.b, L.act, rows, L.out, L.z, L.y);
    in = L.y;
  }
}

void mlp_backward(int64_t rows, const float* x, const float* dy, float* dx, const MlpLayers& layers, float* work) {
  const MlpLayer& last = layers.layer[layers.count - 1];
  // D: the current layer's output gradient times its activation's derivative.
  std::vector<float> D(static_cast<size_t>(rows * last.out));
  act_backward(dy, act_saves_input(last.act) ? last.z : last.y, last.act, rows * last.out, D.data());
  const int64_t part = mlp_part_floats(layers);
  for (int l = layers.count - 1; l >= 0; --l) {
    const MlpLayer& L = layers.layer[l];
    const float* X = l == 0 ? x : layers.layer[l - 1].y;
    int64_t at = 0;  // layer l's place in a block's part
    for (int k = 0; k < l; ++k) at += mlp_part_of(layers.layer[k]);
    for (int64_t r0 = 0, b = 0; r0 < rows; r0 += kMlpBlockRows, ++b) {
      const int64_t n = std::min<int64_t>(kMlpBlockRows, rows - r0);
      float* dW = work + b * part + at;
      float* db = dW + int64_t{L.out} * L.in;
      for (int j = 0; j < L.out; ++j) {
        for (int k = 0; k < L.in; ++k) {
          float acc = 0.f;
          for (int64_t r = r0; r < r0 + n; ++r) acc += D[static_cast<size_t>(r * L.out + j)] * X[r * L.in + k];
          dW[int64_t{j} * L.in + k] = acc;
        }
        float acc = 0.f;
        for (int64_t r = r0; r < r0 + n; ++r) acc += D[static_cast<size_t>(r * L.out + j)];
        db[j] = acc;
      }
    }
    if (l == 0 && !dx) break;
    std::vector<float> dH(static_cast<size_t>(rows * L.in));  // D W
    gemm(false, false, rows, L.in, L.out, 1.0f, D.data(), L.W, 0.0f, dH.data());
    if (l == 0) {
      std::copy(dH.begin(), dH.end(), dx);
      break;
    }
    const MlpLayer& before = layers.layer[l - 1];
    D.resize(dH.size());
    act_backward(dH.data(), act_saves_input(before.act) ? before.z : before.y, before.act, rows * L.in, D.data());
  }
}

void mlp_grad_sum(int64_t rows, const MlpLayers& layers, const float* work, const MlpGrads& out, int first, int last) {
  const int64_t blocks = mlp_blocks(rows), part = mlp_part_floats(layers);
  int64_t at = 0;
  for (int l = 0; l < last; ++l) {
    const MlpLayer& L = layers.layer[l];
    const int64_t weights = int64_t{L.out} * L.in;
    if (l >= first)
      for (int64_t i = 0; i < weights + L.out; ++i) {
        float* into = i < weights ? out.dW[l] : out.db[l];
        if (!into) continue;
        float s = 0.f;
        for (int64_t b = 0; b < blocks; ++b) s += work[b * part + at + i];
        const int64_t k = i < weights ? i : i - weights;
        const float beta = i < weights ? out.beta_W[l] : out.beta_b[l];
        into[k] = beta == 0.f ? s : beta * into[k] + s;
      }
    at += weights + L.out;
  }
}

}  // namespace dpt::cpu
