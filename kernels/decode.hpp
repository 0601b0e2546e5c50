// The shape of attention with a key-value cache (decoding: cpu/attention.cpp,
// cuda/decode.cu). n new positions of each of `batch` sequences arrive as qkv [batch * n,
// 3 C] (the layout of attention.hpp: row b * n + i is position start + i of sequence b);
// the cache holds keys and values [batch, heads, capacity, head_size], so that a head's
// positions lie one after the other. Positions [0, start) are in the cache already; the
// new ones go to [start, start + n), and query i attends to positions 0 .. start + i.
#pragma once
#include <cstdint>

#include "hd.hpp"

namespace dpt {

struct DecodeShape {
  int64_t batch = 0, n = 0, heads = 0, head_size = 0, capacity = 0, start = 0;
  DPT_HD int64_t channels() const { return heads * head_size; }  // C
  DPT_HD int64_t rows() const { return batch * n; }              // qkv's and y's rows
  // Where position t of sequence b, head h starts in the cache.
  DPT_HD int64_t cache_at(int64_t b, int64_t h, int64_t t) const {
    return ((b * heads + h) * capacity + t) * head_size;
  }
};

}  // namespace dpt
