// Causal self-attention on the CPU, the plain definition in double: for each sequence b,
// head h and query t, the scores s_tj = q_t . k_j / sqrt(hs) over keys j <= t, their
// softmax p_tj and y_t = sum_j p_tj v_j. The backward recomputes p from the saved
// log-sum-exp, as the CUDA kernels do. Decoding (attention_decode) computes each of its
// query rows with the same function as the forward, its keys and values read from the
// cache: the same bits as the forward over the whole sequence.
#include <cmath>
#include <vector>

#include "../decode.hpp"
#include "bf16_io.hpp"
#include "cpu.hpp"

namespace dpt::cpu {

namespace {

// Where head h's row of q, k or v (part 0, 1, 2) of sequence b, position t starts in qkv
// (or its gradient), and where its row of y (or dy) starts.
struct HeadRows {
  const AttentionShape& s;
  int64_t b, h;
  int64_t qkv(int64_t part, int64_t t) const {
    return (b * s.T + t) * 3 * s.channels() + part * s.channels() + h * s.head_size;
  }
  int64_t out(int64_t t) const { return (b * s.T + t) * s.channels() + h * s.head_size; }
  int64_t lse(int64_t t) const { return (b * s.heads + h) * s.T + t; }
};

template <typename A, typename B>
double dot(const A* a, const B* b, int64_t n) {
  double d = 0.0;
  for (int64_t i = 0; i < n; ++i) d += static_cast<double>(as_float(a[i])) * as_float(b[i]);
  return d;
}

// One softmax row: query q against the keys k_j = k + j * stride (j < count) and the values
// v_j = v + j * stride; writes y = sum_j p_j v_j and returns the log-sum-exp of the scaled
// scores. p and acc: scratch of count and hs doubles.
template <typename Q, typename KV, typename Y>
double attend_row(const Q* q, const KV* k, const KV* v, int64_t stride, int64_t count, int64_t hs,
                  std::vector<double>& p, std::vector<double>& acc, Y* y) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  double mx = -INFINITY;
  for (int64_t j = 0; j < count; ++j) {
    p[j] = scale * dot(q, k + j * stride, hs);
    mx = std::fmax(mx, p[j]);
  }
  double sum = 0.0;
  for (int64_t j = 0; j < count; ++j) sum += p[j] = std::exp(p[j] - mx);
  for (double& a : acc) a = 0.0;
  for (int64_t j = 0; j < count; ++j)
    for (int64_t i = 0; i < hs; ++i) acc[i] += p[j] * as_float(v[j * stride + i]);
  for (int64_t i = 0; i < hs; ++i) store(&y[i], static_cast<float>(acc[i] / sum));
  return mx + std::log(sum);
}

}  // namespace

void attention_forward(const AttentionShape& s, const float* qkv, float* y, float* lse) {
  const int64_t hs = s.head_size, stride = 3 * s.channels();
  std::vector<double> p(static_cast<size_t>(s.T)), acc(static_cast<size_t>(hs));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads; ++h) {
      const HeadRows at{s, b, h};
      for (int64_t t = 0; t < s.T; ++t)
        lse[at.lse(t)] = static_cast<float>(attend_row(qkv + at.qkv(0, t), qkv + at.qkv(1, 0), qkv + at.qkv(2, 0),
                                                       stride, t + 1, hs, p, acc, y + at.out(t)));
    }
}

// With D_t = dy_t . y_t and ds_tj = p_tj (dy_t . v_j - D_t): dq_t = sum_j ds_tj k_j / sqrt(hs),
// dk_j = sum_t ds_tj q_t / sqrt(hs), dv_j = sum_t p_tj dy_t (j <= t).
void attention_backward(const AttentionShape& s, const float* qkv, const float* y, const float* dy, const float* lse,
                        float* dqkv) {
  const int64_t hs = s.head_size, row = 3 * s.channels();
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  std::vector<double> g(static_cast<size_t>(s.T * row));  // one sequence's dqkv, in double
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads; ++h) {
      const HeadRows at{s, b, h};
      const int64_t base = at.qkv(0, 0);  // g holds this head's columns at the same offsets
      for (double& e : g) e = 0.0;
      for (int64_t t = 0; t < s.T; ++t) {
        const float* dyt = dy + at.out(t);
        const double D = dot(dyt, y + at.out(t), hs);
        for (int64_t j = 0; j <= t; ++j) {
          const double p = std::exp(scale * dot(qkv + at.qkv(0, t), qkv + at.qkv(1, j), hs) - lse[at.lse(t)]);
          const double ds = p * (dot(dyt, qkv + at.qkv(2, j), hs) - D) * scale;
          for (int64_t i = 0; i < hs; ++i) {
            g[at.qkv(0, t) - base + i] += ds * qkv[at.qkv(1, j) + i];
            g[at.qkv(1, j) - base + i] += ds * qkv[at.qkv(0, t) + i];
            g[at.qkv(2, j) - base + i] += p * dyt[i];
          }
        }
      }
      for (int64_t t = 0; t < s.T; ++t)
        for (int64_t part = 0; part < 3; ++part)
          for (int64_t i = 0; i < hs; ++i)
            dqkv[at.qkv(part, t) + i] = static_cast<float>(g[at.qkv(part, t) - base + i]);
    }
}

void attention_forward_bf16(const AttentionShape& s, const uint16_t* qkv, uint16_t* y, float* lse) {
  const auto x = widen(qkv, s.rows() * 3 * s.channels());
  std::vector<float> out(static_cast<size_t>(s.rows() * s.channels()));
  attention_forward(s, x.data(), out.data(), lse);
  narrow(out, y);
}

void attention_backward_bf16(const AttentionShape& s, const uint16_t* qkv, const uint16_t* y, const uint16_t* dy,
                             const float* lse, uint16_t* dqkv) {
  const int64_t n = s.rows() * s.channels();
  const auto x = widen(qkv, 3 * n), yv = widen(y, n), dyv = widen(dy, n);
  std::vector<float> g(static_cast<size_t>(3 * n));
  attention_backward(s, x.data(), yv.data(), dyv.data(), lse, g.data());
  narrow(g, dqkv);
}

// ---- Decoding with a key-value cache ---------------------------------------------------

namespace {

// The new rows' keys and values into the cache, then each new query over positions 0 ..
// start + i (attend_row, as the forward).
template <typename T>
void decode(const DecodeShape& s, const T* qkv, T* k_cache, T* v_cache, T* y) {
  const int64_t hs = s.head_size, C = s.channels();
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.n; ++i)
      for (int64_t h = 0; h < s.heads; ++h) {
        const T* row = qkv + (b * s.n + i) * 3 * C + h * hs;
        const int64_t at = s.cache_at(b, h, s.start + i);
        for (int64_t c = 0; c < hs; ++c) {
          k_cache[at + c] = row[C + c];
          v_cache[at + c] = row[2 * C + c];
        }
      }
  std::vector<double> p(static_cast<size_t>(s.start + s.n)), acc(static_cast<size_t>(hs));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t i = 0; i < s.n; ++i) {
        const int64_t r = b * s.n + i, first = s.cache_at(b, h, 0);
        attend_row(qkv + r * 3 * C + h * hs, k_cache + first, v_cache + first, hs, s.start + i + 1, hs, p, acc,
                   y + r * C + h * hs);
      }
}

}  // namespace

void attention_decode(const DecodeShape& s, const float* qkv, float* k_cache, float* v_cache, float* y) {
  decode(s, qkv, k_cache, v_cache, y);
}
void attention_decode_bf16(const DecodeShape& s, const uint16_t* qkv, uint16_t* k_cache, uint16_t* v_cache,
                           uint16_t* y) {
  decode(s, qkv, k_cache, v_cache, y);
}

}  // namespace dpt::cpu
