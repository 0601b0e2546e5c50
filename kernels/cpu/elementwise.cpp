// Fill, axpy, norms, casts, argmax and the Philox random fills (floats and tokens) on the CPU.
#include "../bf16.hpp"
#include "../philox.hpp"
#include "cpu.hpp"

namespace dpt::cpu {

void fill(float* x, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i) x[i] = value;
}

void axpy(int64_t n, float alpha, const float* x, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void add_bf16(const uint16_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += bf16_float(x[i]);
}

void sum_squares(const float* x, int64_t n, float* out) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  *out = static_cast<float>(s);
}

void cast_f32_bf16(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_round(x[i]);  // to nearest even; NaN stays NaN
}

void cast_bf16_f32(const uint16_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_float(x[i]);
}

void argmax_rows(const float* x, int64_t rows, int64_t cols, int32_t* out) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* r = x + i * cols;
    int64_t best = 0;
    for (int64_t j = 1; j < cols; ++j)
      if (r[j] > r[best]) best = j;  // the first maximum wins ties
    out[i] = static_cast<int32_t>(best);
  }
}

void normal(float* out, int64_t n, uint64_t seed, uint64_t stream, uint64_t offset, float std) {
  for (int64_t i = 0; i < n; ++i) out[i] = std * philox::normal(seed, stream, offset + static_cast<uint64_t>(i));
}

void normal_rows(float* out, int64_t rows, int64_t width, uint64_t seed, uint64_t stream, const RowMap& map, float std,
                 bool add) {
  for (int64_t r = 0; r < rows; ++r) {
    const auto base = static_cast<uint64_t>(row_sample(map, r) * width);
    if (width % 4 == 0) {  // whole Philox blocks, as the CUDA kernel makes them
      float* o = out + r * width;
      for (int64_t q = 0; q < width / 4; ++q) {
        float v[4];
        philox::normal4(seed, stream, base / 4 + static_cast<uint64_t>(q), v);
        for (int j = 0; j < 4; ++j) o[4 * q + j] = add ? o[4 * q + j] + std * v[j] : std * v[j];
      }
      continue;
    }
    float* o = out + r * width;
    for (int64_t c = 0; c < width; ++c) {
      const float v = std * philox::normal(seed, stream, base + static_cast<uint64_t>(c));
      o[c] = add ? o[c] + v : v;
    }
  }
}

void uniform(float* out, int64_t n, uint64_t seed, uint64_t stream, uint64_t offset, float lo, float hi) {
  for (int64_t i = 0; i < n; ++i) out[i] = philox::uniform(seed, stream, offset + static_cast<uint64_t>(i), lo, hi);
}

void random_tokens(int32_t* x, int32_t* y, int64_t rows, int64_t seq, int64_t vocab, uint64_t seed, uint64_t stream,
                   const RowMap& map) {
  for (int64_t r = 0; r < rows; ++r) {
    const auto base = static_cast<uint64_t>(row_sample(map, r) * seq);
    for (int64_t t = 0; t <= seq; ++t) {  // seq + 1 tokens: the inputs and, one further, the targets
      const int32_t token = philox::uniform_token(seed, stream, base + static_cast<uint64_t>(t), vocab);
      if (t < seq) x[r * seq + t] = token;
      if (t > 0) y[r * seq + t - 1] = token;
    }
  }
}

}  // namespace dpt::cpu
