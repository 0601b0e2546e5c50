#include <dptrain/data/shuffle.hpp>

#include <string>
#include <utility>

#include <dptrain/error.hpp>
#include "kernels/philox.hpp"

namespace dpt::data {
namespace {

// Philox streams of a seed for the epochs' permutations: stream kShuffle + epoch, far
// from the parameters' streams (their indices) and the synthetic data's (from 2^20).
constexpr uint64_t kShuffle = uint64_t{1} << 40;

// The high 64 bits of a * b.
uint64_t mulhi64(uint64_t a, uint64_t b) {
  const uint64_t a0 = a & 0xffffffffu, a1 = a >> 32, b0 = b & 0xffffffffu, b1 = b >> 32;
  const uint64_t p0 = a0 * b0, p1 = a0 * b1, p2 = a1 * b0, p3 = a1 * b1;
  const uint64_t mid = (p0 >> 32) + (p1 & 0xffffffffu) + (p2 & 0xffffffffu);
  return p3 + (p1 >> 32) + (p2 >> 32) + (mid >> 32);
}

void check_rows(int64_t rows, const char* what) {
  if (rows < 1) throw Error(std::string(what) + ": a data set of " + std::to_string(rows) + " rows");
}

}  // namespace

void epoch_permutation(int64_t rows, uint64_t seed, int64_t epoch, std::vector<int64_t>& out) {
  check_rows(rows, "epoch_permutation");
  DPT_CHECK(epoch >= 0, "epoch_permutation: negative epoch");
  try {
    out.resize(static_cast<size_t>(rows));
  } catch (const std::exception&) {  // std::length_error or std::bad_alloc
    throw OutOfMemory("out of host memory: epoch_permutation of " + std::to_string(rows) +
                      " rows (8 bytes a row); use a smaller data set");
  }
  for (int64_t i = 0; i < rows; ++i) out[static_cast<size_t>(i)] = i;
  const uint64_t stream = kShuffle + static_cast<uint64_t>(epoch);
  philox::U4 r{};
  uint64_t block = UINT64_MAX;
  for (int64_t i = rows - 1; i > 0; --i) {
    // Counter block i / 2 holds two 64-bit draws: lanes 0-1 for even i, 2-3 for odd.
    const auto u = static_cast<uint64_t>(i);
    if (u >> 1 != block) r = philox::philox4x32(seed, stream, block = u >> 1);
    const uint64_t bits = (u & 1) ? (uint64_t{r.z} << 32 | r.w) : (uint64_t{r.x} << 32 | r.y);
    const auto j = static_cast<int64_t>(mulhi64(bits, u + 1));
    std::swap(out[static_cast<size_t>(i)], out[static_cast<size_t>(j)]);
  }
}

std::vector<int64_t> epoch_permutation(int64_t rows, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> p;
  epoch_permutation(rows, seed, epoch, p);
  return p;
}

SamplePosition sample_position(int64_t sample, int64_t rows) {
  check_rows(rows, "sample_position");
  DPT_CHECK(sample >= 0, "sample_position: negative sample");
  return {sample / rows, sample % rows};
}

int64_t sample_at(const SamplePosition& p, int64_t rows) {
  check_rows(rows, "sample_at");
  DPT_CHECK(p.epoch >= 0 && p.index >= 0 && p.index < rows, "sample_at: position outside the data set");
  return p.epoch * rows + p.index;
}

RowOrder::RowOrder(int64_t rows, uint64_t seed, bool shuffle) : rows_(rows), seed_(seed), shuffle_(shuffle) {
  check_rows(rows, "RowOrder");
}

int64_t RowOrder::row(int64_t sample) {
  const SamplePosition p = sample_position(sample, rows_);
  if (!shuffle_) return p.index;
  if (p.epoch != epoch_) {
    epoch_permutation(rows_, seed_, p.epoch, perm_);
    epoch_ = p.epoch;
  }
  return perm_[static_cast<size_t>(p.index)];
}

void RowOrder::rows(int64_t first, int64_t count, std::vector<int64_t>& out) {
  DPT_CHECK(first >= 0 && count >= 0, "RowOrder::rows: bad range");
  out.resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out[static_cast<size_t>(i)] = row(first + i);
}

}  // namespace dpt::data
