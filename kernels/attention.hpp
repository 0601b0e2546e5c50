// The shape of causal self-attention (cpu/attention.cpp, cuda/attention.cu), as the model
// lays it out: qkv [batch * T, 3 C] holds q, k and v side by side (columns [0, C), [C, 2C),
// [2C, 3C)); head h takes columns h * head_size .. of each, and of y [batch * T, C]. Row
// b * T + t is position t of sequence b.
#pragma once
#include <cstdint>

#include "hd.hpp"

namespace dpt {

// The largest head the kernels take: a warp's lanes hold a row of q (or k, v, and their
// gradients) in registers, four values a lane.
constexpr int64_t kAttentionMaxHeadSize = 128;

struct AttentionShape {
  int64_t batch = 0, T = 0, heads = 0, head_size = 0;
  DPT_HD int64_t channels() const { return heads * head_size; }  // C
  DPT_HD int64_t rows() const { return batch * T; }              // N
  // One softmax row per (b, h, t): the size of the saved log-sum-exp [batch, heads, T].
  DPT_HD int64_t softmax_rows() const { return batch * heads * T; }
};

}  // namespace dpt
