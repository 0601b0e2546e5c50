#include "buckets.hpp"

#include <algorithm>

#include <dptrain/error.hpp>

namespace dpt {

std::vector<Bucket> make_buckets(int64_t total, double bucket_bytes, double first_bytes) {
  DPT_CHECK(bucket_bytes > 0 && first_bytes > 0, "bucket sizes must be positive");
  const int64_t align = 64;  // 256-byte boundaries keep vector loads aligned
  auto floats = [&](double bytes) {
    return std::max<int64_t>(align, static_cast<int64_t>(bytes / sizeof(float)) / align * align);
  };
  const int64_t size = floats(bucket_bytes), first = std::min(size, floats(first_bytes));
  std::vector<Bucket> out;
  for (int64_t end = total; end > 0;) {
    const int64_t begin = std::max<int64_t>(0, end - (out.empty() ? first : size));
    out.push_back({begin, end - begin});
    end = begin;
  }
  return out;
}

std::vector<Bucket> make_param_buckets(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                                       double bucket_bytes, double first_bytes) {
  DPT_CHECK(bucket_bytes > 0 && first_bytes > 0 && offsets.size() == sizes.size(),
            "make_param_buckets: an offset and a size a parameter, positive bucket sizes");
  const auto size = static_cast<int64_t>(bucket_bytes / sizeof(float));
  const int64_t first = std::min(size, static_cast<int64_t>(first_bytes / sizeof(float)));
  std::vector<Bucket> out;
  if (offsets.empty()) return out;
  int64_t end = offsets.back() + sizes.back(), begin = offsets.back();  // the bucket being filled
  for (size_t k = offsets.size() - 1; k-- > 0;) {
    if (end - offsets[k] > (out.empty() ? first : size)) {  // parameter k would overfill it: it starts the next
      out.push_back({begin, end - begin});
      end = offsets[k] + sizes[k];
    }
    begin = offsets[k];
  }
  out.push_back({begin, end - begin});
  return out;
}

std::vector<std::vector<int>> buckets_of_params(const std::vector<Bucket>& buckets, const std::vector<int64_t>& offsets,
                                                const std::vector<int64_t>& sizes) {
  std::vector<std::vector<int>> out(offsets.size());
  for (size_t k = 0; k < offsets.size(); ++k) {
    const int64_t begin = offsets[k], end = begin + sizes[k];
    for (size_t b = 0; b < buckets.size(); ++b)
      if (begin < buckets[b].offset + buckets[b].count && buckets[b].offset < end)
        out[k].push_back(static_cast<int>(b));
  }
  return out;
}

namespace {
// Bucket c's padding between its parameters that the other buckets of its slot write
// gradients over, one range a gap.
std::vector<Bucket> dirty_padding_of(size_t c, const SlotLayout& l, const std::vector<int64_t>& sizes) {
  std::vector<Bucket> out;
  const std::vector<int>& mine = l.params_of_bucket[c];
  for (size_t j = 0; j + 1 < mine.size(); ++j) {
    const auto k = static_cast<size_t>(mine[j]), next = static_cast<size_t>(mine[j + 1]);
    const int64_t gap_begin = l.in_slots[k] + sizes[k], gap_end = l.in_slots[next];
    int64_t lo = gap_end, hi = gap_begin;  // the part of the gap others write, as one range
    for (size_t d = 0; d < l.slot_of.size(); ++d) {
      if (d == c || l.slot_of[d] != l.slot_of[c]) continue;
      for (int o : l.params_of_bucket[d]) {
        const int64_t b0 = l.in_slots[static_cast<size_t>(o)], b1 = b0 + sizes[static_cast<size_t>(o)];
        if (b0 >= gap_end || b1 <= gap_begin) continue;
        lo = std::min(lo, std::max(b0, gap_begin));
        hi = std::max(hi, std::min(b1, gap_end));
      }
    }
    if (lo < hi) out.push_back({lo, hi - lo});
  }
  return out;
}
}  // namespace

SlotLayout layout_slots(const std::vector<Bucket>& buckets, const std::vector<int64_t>& offsets,
                        const std::vector<int64_t>& sizes, const std::vector<std::vector<int>>& bucket_of_param,
                        const std::vector<int>& uses) {
  DPT_CHECK(offsets.size() == sizes.size() && offsets.size() == bucket_of_param.size() && offsets.size() == uses.size(),
            "layout_slots: an offset, a size, a bucket and a use count a parameter");
  SlotLayout l;
  l.params_of_bucket.assign(buckets.size(), {});
  std::vector<bool> tied(buckets.size(), false);
  for (size_t k = 0; k < offsets.size(); ++k) {
    const auto b = static_cast<size_t>(bucket_of_param[k].at(0));  // whole parameters: one bucket each
    l.params_of_bucket[b].push_back(static_cast<int>(k));
    if (uses[k] > 1) tied[b] = true;
  }
  // Buckets are handed over in bucket order, so a tied bucket (complete only at its last
  // write, which may come at backward's end) holds back every bucket after it: one of those
  // taking turns would need the one before it in its slot reduced, held back behind the
  // tied bucket, which would then be handed over incomplete. They get slots of their own too.
  for (size_t b = 1; b < buckets.size(); ++b) tied[b] = tied[b] || tied[b - 1];
  // The turns: the other buckets alternate between two slots of the largest one's size.
  int64_t turn_size = 0;
  size_t turns = 0;
  for (size_t b = 0; b < buckets.size(); ++b)
    if (!tied[b]) turn_size = std::max(turn_size, buckets[b].count), ++turns;
  const size_t turn_slots = l.turn_slots = std::min<size_t>(2, turns);
  for (size_t s = 0; s < turn_slots; ++s) l.slot_begin.push_back(static_cast<int64_t>(s) * turn_size);
  l.size = static_cast<int64_t>(turn_slots) * turn_size;
  l.slot_of.resize(buckets.size());
  l.previous_in_slot.assign(buckets.size(), -1);
  std::vector<int> last_in_turn(turn_slots, -1);
  size_t turn = 0;
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (tied[b]) {
      l.slot_of[b] = l.slot_begin.size();
      l.slot_begin.push_back(l.size);
      l.size += buckets[b].count;
      continue;
    }
    const size_t s = turn++ % turn_slots;
    l.slot_of[b] = s;
    l.previous_in_slot[b] = last_in_turn[s];
    last_in_turn[s] = static_cast<int>(b);
  }
  l.in_slots.resize(offsets.size());
  for (size_t k = 0; k < offsets.size(); ++k) {
    const auto b = static_cast<size_t>(bucket_of_param[k][0]);
    l.in_slots[k] = l.bucket_begin(b) + (offsets[k] - buckets[b].offset);
  }
  // A bucket is reduced whole, the padding between its parameters too: where another
  // bucket of the same slot writes gradients over that padding, it must be zero again
  // before this bucket is reduced.
  l.dirty_padding.assign(buckets.size(), {});
  for (size_t c = 0; c < buckets.size(); ++c) l.dirty_padding[c] = dirty_padding_of(c, l, sizes);
  return l;
}

}  // namespace dpt
