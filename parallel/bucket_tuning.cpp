// The gradient buckets' layout, and DataParallelOptions::tune_buckets: each candidate size
// tried over a few steps, the fastest kept.
#include <algorithm>
#include <chrono>
#include <cstdio>

#include <dptrain/error.hpp>
#include <dptrain/runtime/memory.hpp>
#include "data_parallel_impl.hpp"

namespace dpt {

std::vector<Bucket> DataParallel::Impl::buckets_of_size(double bucket_mb) const {
  int64_t total = 0;
  const auto offsets = replicas_[0].model->layout(&total);
  std::vector<int64_t> sizes;
  for (const nn::Parameter* p : replicas_[0].params) sizes.push_back(numel(p->shape));
  // Under ZeRO stage 2 the first bucket is the others' size: its two gradient slots each
  // take the largest bucket's size, so a smaller first one would double them for a model
  // that fits one bucket.
  const double bytes = bucket_mb * 1024.0 * 1024.0;
  const double first = zero_ == 2 ? bytes : first_bucket_mb_ * 1024.0 * 1024.0;
  return zero_ == 2 ? make_param_buckets(offsets, sizes, bytes, first) : make_buckets(total, bytes, first);
}

void DataParallel::Impl::assign_buckets(double bucket_mb) {
  buckets_ = buckets_of_size(bucket_mb);
  bucket_mb_ = bucket_mb;
  int64_t total = 0;
  const auto offsets = replicas_[0].model->layout(&total);
  std::vector<int64_t> sizes;
  for (const nn::Parameter* p : replicas_[0].params) sizes.push_back(numel(p->shape));
  buckets_of_param_ = buckets_of_params(buckets_, offsets, sizes);
  for (Replica& rep : replicas_) {
    if (!per_bucket_ || !rep.opt) continue;
    rep.bucket_summed.clear();
    for (size_t b = 0; b < buckets_.size(); ++b) rep.bucket_summed.push_back(std::make_unique<Event>(rep.device));
  }
}

// Tuning (DataParallelOptions::tune_buckets): each size in turn, one step to settle (its
// events and staging made) and kTunedSteps timed between two waits for the device (the
// mean over the ranks); then the fastest, as rank 0 sees it, on every rank.
namespace {
constexpr int64_t kTunedSteps = 4;
}

void DataParallel::Impl::set_up_tuning(const DataParallelOptions& options) {
  tuning_ = std::make_unique<BucketTuning>();
  std::vector<double> sizes{1.0, 4.0, 16.0, options.bucket_mb, 64.0};
  std::sort(sizes.begin(), sizes.end());
  std::vector<std::vector<Bucket>> layouts;  // a size that gives a smaller one's buckets is not tried again
  for (double mb : sizes)
    if (std::vector<Bucket> b = buckets_of_size(mb); std::find(layouts.begin(), layouts.end(), b) == layouts.end()) {
      layouts.push_back(std::move(b));
      tuning_->sizes_mb.push_back(mb);
    }
}

void DataParallel::Impl::before_tuned_step() {
  BucketTuning& t = *tuning_;
  const int64_t in = t.steps % (kTunedSteps + 1);
  if (in == 0) {  // a size's first step: the reducer takes its buckets between steps
    synchronize();
    assign_buckets(t.sizes_mb[t.at]);
    reducer_->set_buckets(buckets_);
  } else if (in == 1) {
    synchronize();
    t.start = std::chrono::steady_clock::now();
  }
}

void DataParallel::Impl::after_tuned_step() {
  BucketTuning& t = *tuning_;
  if (++t.steps % (kTunedSteps + 1) != 0) return;
  synchronize();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t.start).count();
  t.ms.push_back(1e3 * (group_ ? group_->sum(s) / group_->size() : s) / kTunedSteps);
  if (++t.at < t.sizes_mb.size()) return;
  // Rank 0 chooses and tells the others: every rank must reduce in the same buckets.
  auto best = static_cast<uint64_t>(std::min_element(t.ms.begin(), t.ms.end()) - t.ms.begin());
  if (group_) group_->broadcast(&best, sizeof best, 0);
  assign_buckets(t.sizes_mb[best]);
  reducer_->set_buckets(buckets_);
  std::string tried;
  for (size_t i = 0; i < t.ms.size(); ++i) {
    char one[64];
    std::snprintf(one, sizeof one, "%s%g MiB %.3f", i ? ", " : "", t.sizes_mb[i], t.ms[i]);
    tried += one;
  }
  if (!group_ || group_->rank() == 0)
    report(Severity::note, "gradient buckets tuned: " + format_float(static_cast<float>(t.sizes_mb[best])) +
                               " MiB (ms a step: " + tried + ")");
  tuning_.reset();
}

}  // namespace dpt
