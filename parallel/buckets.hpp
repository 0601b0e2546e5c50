// How the flat gradient buffer is cut into buckets (each reduced in one piece, as soon as
// backward has made it), and ZeRO stage 2's layout of the buckets in gradient slots.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dpt {

// A contiguous range of the flat gradient buffer that is reduced in one piece.
struct Bucket {
  int64_t offset;
  int64_t count;
  bool operator==(const Bucket&) const = default;
};

// Splits a flat buffer of `total` floats into buckets of at most bucket_bytes (rounded
// to 64 floats), in the order backward produces them: from the end of the buffer, where
// the last layer's parameters lie. The first is at most first_bytes (if less), so that
// communication starts as soon as the last layer's gradients are made, as PyTorch DDP's
// 1 MiB first bucket. A large parameter spans several buckets, so the p2p staging bucket
// is exactly the configured size.
std::vector<Bucket> make_buckets(int64_t total, double bucket_bytes, double first_bytes);

// ZeRO stage 2: buckets of whole parameters (a gradient lies in one slot), from the end of
// the buffer, each at most bucket_bytes (the first at most first_bytes, if less) unless one
// parameter alone is larger; a bucket runs from its first parameter's start to its last
// one's end. The padding between buckets is in none: its gradient, zero, is never reduced
// (the partitions' sums start at zero).
std::vector<Bucket> make_param_buckets(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                                       double bucket_bytes, double first_bytes);

// For each parameter (offsets[k], sizes[k] in the flat buffer), the buckets it overlaps.
std::vector<std::vector<int>> buckets_of_params(const std::vector<Bucket>& buckets, const std::vector<int64_t>& offsets,
                                                const std::vector<int64_t>& sizes);

// ZeRO stage 2: a replica's gradients live in slots, which the buckets take turns in,
// instead of the whole buffer: two slots of the largest such bucket's size (bucket after
// bucket in backward's order, alternately), and a slot of its own for each bucket with a
// parameter used more than once (a tied weight, as GPT's token embedding, is written
// first by the last layer and last by the first: its gradient lives through backward), and
// for each bucket after it (handed over only after it).
struct SlotLayout {
  int64_t size = 0;                                // the gradients' floats: every slot
  std::vector<int64_t> slot_begin;                 // slot -> its offset in the gradients
  size_t turn_slots = 0;                           // the slots taken in turns; each after is one bucket's
  std::vector<size_t> slot_of;                     // bucket -> its slot
  std::vector<int> previous_in_slot;               // bucket -> the bucket before it in its slot (-1: none)
  std::vector<std::vector<int>> params_of_bucket;  // bucket -> its parameters
  std::vector<int64_t> in_slots;                   // parameter -> its gradient's offset in the slots
  // The padding in each bucket that another bucket of its slot writes gradients over (in
  // the slots' coordinates): zeroed when the bucket takes the slot, or the partitions'
  // padding would sum stale gradients.
  std::vector<std::vector<Bucket>> dirty_padding;

  size_t slots() const { return slot_begin.size(); }
  int64_t bucket_begin(size_t b) const { return slot_begin[slot_of[b]]; }  // bucket b's offset in the gradients
  bool own_slot(size_t b) const { return slot_of[b] >= turn_slots; }
};
// `buckets` of whole parameters (make_param_buckets), `bucket_of_param` one a parameter,
// `uses` how often each parameter is used in a forward (Parameter::uses).
SlotLayout layout_slots(const std::vector<Bucket>& buckets, const std::vector<int64_t>& offsets,
                        const std::vector<int64_t>& sizes, const std::vector<std::vector<int>>& bucket_of_param,
                        const std::vector<int>& uses);

}  // namespace dpt
