// The order in which epochs visit a data set's rows. Epoch e visits the rows in a
// permutation that is a pure function of (seed, e), so every rank, every device count and
// a resumed run see the same order; a global sample counter (step * batch + i) says which
// epoch and which place in its permutation a sample is, so a run resumed mid-epoch
// continues exactly where it stopped.
#pragma once
#include <cstdint>
#include <vector>

namespace dpt::data {

// A permutation of [0, rows): Fisher-Yates, the swap partner of position i drawn from
// 64 bits of the Philox stream of (seed, epoch) at counter i, scaled to [0, i] by a
// multiply-shift (whose bias, under rows / 2^64, no training run can see). `out` is
// resized (no allocation once it has the capacity).
void epoch_permutation(int64_t rows, uint64_t seed, int64_t epoch, std::vector<int64_t>& out);
std::vector<int64_t> epoch_permutation(int64_t rows, uint64_t seed, int64_t epoch);

// Where global sample `sample` falls in a data set of `rows` rows: its epoch and its
// place in that epoch's order (which is the row itself without shuffling).
struct SamplePosition {
  int64_t epoch = 0;
  int64_t index = 0;
  bool operator==(const SamplePosition&) const = default;
};
SamplePosition sample_position(int64_t sample, int64_t rows);
// The global sample at `p`: sample_position's inverse.
int64_t sample_at(const SamplePosition& p, int64_t rows);

// Maps global samples to rows for one reader (a replica's loader, an evaluator), keeping
// the permutation of the epoch it is in; not shared between threads (each makes its own:
// the order is the same for all).
class RowOrder {
 public:
  // `shuffle` false keeps file order: sample s reads row s % rows.
  RowOrder(int64_t rows, uint64_t seed, bool shuffle);
  int64_t rows() const { return rows_; }
  // The row that global sample `sample` reads.
  int64_t row(int64_t sample);
  // The rows of samples first .. first + count - 1 (across an epoch's end if they reach
  // it), into `out` (resized).
  void rows(int64_t first, int64_t count, std::vector<int64_t>& out);

 private:
  int64_t rows_;
  uint64_t seed_;
  bool shuffle_;
  int64_t epoch_ = -1;  // whose permutation perm_ holds
  std::vector<int64_t> perm_;
};

}  // namespace dpt::data
