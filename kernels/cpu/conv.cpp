// Convolution, pooling and batch norm on the CPU, each written as its definition (direct
// loops, no im2col), sums in double, so the oracle is the accurate side of every
// comparison with cuDNN. The summation order is fixed and each sample's results depend
// on that sample alone, so they do not depend on how a batch is split.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu.hpp"

namespace dpt::cpu {

namespace {
// Offset of element (a, b, i, j) of a contiguous [A, B, I, J] tensor.
int64_t at4(int64_t a, int64_t b, int64_t i, int64_t j, int64_t B, int64_t I, int64_t J) {
  return ((a * B + b) * I + i) * J + j;
}

// The outputs o in [*lo, *hi) of one axis whose window tap at `shift` (tap * dilation -
// pad) reads inside the input: 0 <= o * stride + shift < in. The others read padding.
void inside(int64_t shift, int64_t stride, int64_t in, int64_t out, int64_t* lo, int64_t* hi) {
  auto ceil_div = [](int64_t a, int64_t b) { return a <= 0 ? 0 : (a + b - 1) / b; };
  *lo = std::min(out, ceil_div(-shift, stride));
  *hi = std::min(out, ceil_div(in - shift, stride));
}

// Tap (r, t) of the window: the output rows [p0, p1) and columns [q0, q1) whose tap reads
// inside the image, at input row p * stride + dh and column q * stride + dw.
struct Tap {
  int64_t r, t, p0, p1, q0, q1, dh, dw;
};

// Visits every tap (r, t) in order: the loop nest the three passes share.
template <typename Visit>
void for_each_tap(const ConvShape& s, Visit visit) {
  for (int64_t r = 0; r < s.r; ++r)
    for (int64_t t = 0; t < s.s; ++t) {
      Tap tap{r, t, 0, 0, 0, 0, r * s.dilation - s.pad, t * s.dilation - s.pad};
      inside(tap.dh, s.stride, s.h, s.p(), &tap.p0, &tap.p1);
      inside(tap.dw, s.stride, s.w, s.q(), &tap.q0, &tap.q1);
      visit(tap);
    }
}

// beta * old + fresh, where beta = 0 never reads old (it may be uninitialized memory).
float blend(float beta, float old, double fresh) {
  return static_cast<float>(beta == 0.0f ? fresh : beta * static_cast<double>(old) + fresh);
}
}  // namespace

// The three passes share one loop nest (for_each_tap): for every kernel tap (r, t), the
// output rows p and columns q whose tap reads inside the image, input position (ih, iw) =
// (p * stride - pad + r * dilation, q * stride - pad + t * dilation).

void conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* bias, float* y) {
  const int64_t P = s.p(), Q = s.q();
  std::vector<double> acc(static_cast<size_t>(P * Q));  // one output plane
  for (int64_t n = 0; n < s.n; ++n)
    for (int64_t k = 0; k < s.k; ++k) {
      std::fill(acc.begin(), acc.end(), bias ? bias[k] : 0.0);
      for (int64_t c = 0; c < s.c; ++c)
        for_each_tap(s, [&](const Tap& tap) {
          const double wv = w[at4(k, c, tap.r, tap.t, s.c, s.r, s.s)];
          for (int64_t p = tap.p0; p < tap.p1; ++p) {
            const float* row = x + at4(n, c, p * s.stride + tap.dh, 0, s.c, s.h, s.w);
            for (int64_t q = tap.q0; q < tap.q1; ++q)
              acc[static_cast<size_t>(p * Q + q)] += wv * row[q * s.stride + tap.dw];
          }
        });
      float* out = y + at4(n, k, 0, 0, s.k, P, Q);
      for (int64_t e = 0; e < P * Q; ++e) out[e] = static_cast<float>(acc[static_cast<size_t>(e)]);
    }
}

void conv2d_backward_data(const ConvShape& s, const float* dy, const float* w, float* dx) {
  // The transpose of the forward pass: each (output, tap) pair sends dy * w back to the
  // input position it read, summed over one input plane in double.
  const int64_t P = s.p(), Q = s.q();
  std::vector<double> acc(static_cast<size_t>(s.h * s.w));
  for (int64_t n = 0; n < s.n; ++n)
    for (int64_t c = 0; c < s.c; ++c) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t k = 0; k < s.k; ++k)
        for_each_tap(s, [&](const Tap& tap) {
          const double wv = w[at4(k, c, tap.r, tap.t, s.c, s.r, s.s)];
          for (int64_t p = tap.p0; p < tap.p1; ++p) {
            const float* g = dy + at4(n, k, p, 0, s.k, P, Q);
            double* row = acc.data() + (p * s.stride + tap.dh) * s.w;
            for (int64_t q = tap.q0; q < tap.q1; ++q) row[q * s.stride + tap.dw] += wv * g[q];
          }
        });
      float* out = dx + at4(n, c, 0, 0, s.c, s.h, s.w);
      for (int64_t e = 0; e < s.h * s.w; ++e) out[e] = static_cast<float>(acc[static_cast<size_t>(e)]);
    }
}

void conv2d_backward_filter(const ConvShape& s, const float* x, const float* dy, float beta, float* dw, float* db) {
  const int64_t P = s.p(), Q = s.q();
  for (int64_t k = 0; k < s.k; ++k) {
    for (int64_t c = 0; c < s.c; ++c)
      for_each_tap(s, [&](const Tap& tap) {
        double acc = 0.0;
        for (int64_t n = 0; n < s.n; ++n)
          for (int64_t p = tap.p0; p < tap.p1; ++p) {
            const float* g = dy + at4(n, k, p, 0, s.k, P, Q);
            const float* row = x + at4(n, c, p * s.stride + tap.dh, 0, s.c, s.h, s.w);
            for (int64_t q = tap.q0; q < tap.q1; ++q) acc += static_cast<double>(g[q]) * row[q * s.stride + tap.dw];
          }
        float& g = dw[at4(k, c, tap.r, tap.t, s.c, s.r, s.s)];
        g = blend(beta, g, acc);
      });
    if (db) {
      double acc = 0.0;
      for (int64_t n = 0; n < s.n; ++n)
        for (int64_t e = 0; e < P * Q; ++e) acc += dy[at4(n, k, 0, 0, s.k, P, Q) + e];
      db[k] = blend(beta, db[k], acc);
    }
  }
}

void pool2d_forward(const PoolShape& s, Pool kind, const float* x, float* y) {
  const int64_t P = s.p(), Q = s.q();
  const double window = static_cast<double>(s.kh * s.kw);  // padding counts (count_include_pad)
  for (int64_t n = 0; n < s.n; ++n)
    for (int64_t c = 0; c < s.c; ++c)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Q; ++q) {
          float mx = -std::numeric_limits<float>::infinity();
          double sum = 0.0;
          for (int64_t i = p * s.stride - s.pad; i < p * s.stride - s.pad + s.kh; ++i)
            for (int64_t j = q * s.stride - s.pad; j < q * s.stride - s.pad + s.kw; ++j) {
              if (i < 0 || i >= s.h || j < 0 || j >= s.w) continue;  // -inf for max, 0 for avg
              const float v = x[at4(n, c, i, j, s.c, s.h, s.w)];
              if (v > mx) mx = v;
              sum += v;
            }
          y[at4(n, c, p, q, s.c, P, Q)] = kind == Pool::max ? mx : static_cast<float>(sum / window);
        }
}

void pool2d_backward(const PoolShape& s, Pool kind, const float* x, const float* y, const float* dy, float* dx) {
  // Each input position gathers from the windows that contain it: all of them with the
  // weight 1/window for avg; for max, those whose first maximum it is.
  const int64_t P = s.p(), Q = s.q();
  const double window = static_cast<double>(s.kh * s.kw);
  // The first window (in each axis) that holds input position i, and the one past the last.
  auto windows = [&](int64_t i, int64_t k, int64_t out, int64_t* first, int64_t* last) {
    const int64_t lo = i + s.pad - k + 1;  // window o covers [o*stride - pad, o*stride - pad + k)
    *first = lo <= 0 ? 0 : (lo + s.stride - 1) / s.stride;
    *last = std::min(out, (i + s.pad) / s.stride + 1);
  };
  // Whether input (i, j) is the first maximum of window (p, q) of plane `plane`.
  auto first_max = [&](const float* plane, int64_t p, int64_t q, float m, int64_t i, int64_t j) {
    for (int64_t a = p * s.stride - s.pad; a < p * s.stride - s.pad + s.kh; ++a)
      for (int64_t b = q * s.stride - s.pad; b < q * s.stride - s.pad + s.kw; ++b) {
        if (a < 0 || a >= s.h || b < 0 || b >= s.w) continue;
        if (plane[a * s.w + b] == m) return a == i && b == j;
      }
    return false;
  };
  for (int64_t n = 0; n < s.n; ++n)
    for (int64_t c = 0; c < s.c; ++c) {
      const float* xp = x + at4(n, c, 0, 0, s.c, s.h, s.w);
      const int64_t out_plane = at4(n, c, 0, 0, s.c, P, Q);
      for (int64_t i = 0; i < s.h; ++i)
        for (int64_t j = 0; j < s.w; ++j) {
          int64_t p0, p1, q0, q1;
          windows(i, s.kh, P, &p0, &p1);
          windows(j, s.kw, Q, &q0, &q1);
          double acc = 0.0;
          for (int64_t p = p0; p < p1; ++p)
            for (int64_t q = q0; q < q1; ++q) {
              const int64_t o = out_plane + p * Q + q;
              if (kind == Pool::avg) acc += dy[o] / window;
              else if (xp[i * s.w + j] == y[o] && first_max(xp, p, q, y[o], i, j)) acc += dy[o];
            }
          dx[at4(n, c, i, j, s.c, s.h, s.w)] = static_cast<float>(acc);
        }
    }
}

void batchnorm_forward_train(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma, const float* beta,
                             const BatchNormArgs& a, float* running_mean, float* running_var, float* y,
                             float* save_mean, float* save_invstd) {
  const double m = static_cast<double>(n * hw);
  for (int64_t ch = 0; ch < c; ++ch) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < hw; ++e) sum += x[(i * c + ch) * hw + e];
    const double mean = sum / m;
    double sq = 0.0;  // two passes: no cancellation in the variance
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < hw; ++e) {
        const double d = x[(i * c + ch) * hw + e] - mean;
        sq += d * d;
      }
    const double var = sq / m;  // biased: what normalizes
    const double invstd = 1.0 / std::sqrt(var + a.eps);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < hw; ++e) {
        const int64_t o = (i * c + ch) * hw + e;
        y[o] = static_cast<float>((x[o] - mean) * invstd * gamma[ch] + beta[ch]);
      }
    // The running variance moves toward the unbiased variance, as torch's does.
    const double unbiased = m > 1.0 ? sq / (m - 1.0) : var;
    running_mean[ch] = static_cast<float>((1.0 - a.momentum) * running_mean[ch] + a.momentum * mean);
    running_var[ch] = static_cast<float>((1.0 - a.momentum) * running_var[ch] + a.momentum * unbiased);
    save_mean[ch] = static_cast<float>(mean);
    save_invstd[ch] = static_cast<float>(invstd);
  }
}

void batchnorm_forward_eval(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma, const float* beta,
                            const BatchNormArgs& a, const float* running_mean, const float* running_var, float* y) {
  for (int64_t ch = 0; ch < c; ++ch) {
    const double invstd = 1.0 / std::sqrt(static_cast<double>(running_var[ch]) + a.eps);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < hw; ++e) {
        const int64_t o = (i * c + ch) * hw + e;
        y[o] = static_cast<float>((x[o] - running_mean[ch]) * invstd * gamma[ch] + beta[ch]);
      }
  }
}

void batchnorm_backward(int64_t n, int64_t c, int64_t hw, const float* x, const float* dy, const float* gamma,
                        const float* save_mean, const float* save_invstd, float* dx, float param_beta, float* dgamma,
                        float* dbeta) {
  // With xhat = (x - mean) * invstd over m values: dbeta = sum dy, dgamma = sum dy xhat,
  // dx = gamma * invstd * (dy - dbeta / m - xhat * dgamma / m).
  const double m = static_cast<double>(n * hw);
  for (int64_t ch = 0; ch < c; ++ch) {
    const double mean = save_mean[ch], invstd = save_invstd[ch];
    double sum_dy = 0.0, sum_dy_xhat = 0.0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < hw; ++e) {
        const int64_t o = (i * c + ch) * hw + e;
        sum_dy += dy[o];
        sum_dy_xhat += dy[o] * (x[o] - mean) * invstd;
      }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < hw; ++e) {
        const int64_t o = (i * c + ch) * hw + e;
        const double xhat = (x[o] - mean) * invstd;
        dx[o] = static_cast<float>(gamma[ch] * invstd * (dy[o] - sum_dy / m - xhat * sum_dy_xhat / m));
      }
    dgamma[ch] = blend(param_beta, dgamma[ch], sum_dy_xhat);
    dbeta[ch] = blend(param_beta, dbeta[ch], sum_dy);
  }
}

}  // namespace dpt::cpu
