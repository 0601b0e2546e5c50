#include "master_sum.hpp"

#include <algorithm>

#include <dptrain/runtime/ops.hpp>

namespace dpt {

MasterSumReducer::MasterSumReducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets, DType wire)
    : r_(std::move(replicas)),
      buckets_(std::move(buckets)),
      wire_(r_.size() > 1 ? wire : DType::f32),
      comm_(r_[0].ctx->device(), StreamPriority::high),
      done_(r_[0].ctx->device()) {
  make_bucket_events();
  if (wire_ == DType::bf16)
    for (size_t i = 1; i < r_.size(); ++i) {
      ContextGuard g(*r_[i].ctx);
      sent_.push_back(Tensor::empty(r_[i].grads.shape(), DType::bf16, r_[i].ctx->device()));
    }
}

// An event a replica a bucket.
void MasterSumReducer::make_bucket_events() {
  ready_.clear();
  for (size_t i = 0; i < r_.size(); ++i) {
    ready_.emplace_back();
    for (size_t b = 0; b < buckets_.size(); ++b) ready_[i].push_back(std::make_unique<Event>(r_[i].ctx->device()));
  }
}

int64_t MasterSumReducer::largest_bucket() const {
  int64_t largest = 0;
  for (const Bucket& b : buckets_) largest = std::max(largest, b.count);
  return largest;
}

void MasterSumReducer::set_buckets(std::vector<Bucket> buckets) {
  buckets_ = std::move(buckets);
  make_bucket_events();
  make_bucket_buffers();
}

void MasterSumReducer::bucket_ready(size_t r, size_t b) {
  if (r > 0 && wire_ == DType::bf16)  // on r's stream, r's context current
    copy_cast(sent_[r - 1].view(buckets_[b].offset, {buckets_[b].count}),
              r_[r].grads.view(buckets_[b].offset, {buckets_[b].count}));
  ready_[r][b]->record(*r_[r].ctx);
}

void MasterSumReducer::reduce() {
  ContextGuard g(comm_);
  const Tensor& sum = r_[0].grads;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& k = buckets_[b];
    Tensor into = sum.view(k.offset, {k.count});
    ready_[0][b]->wait_in(comm_);
    for (size_t i = 1; i < r_.size(); ++i) {  // a fixed order: the sum is reproducible
      ready_[i][b]->wait_in(comm_);
      const Tensor from = (wire_ == DType::bf16 ? sent_[i - 1] : r_[i].grads).view(k.offset, {k.count});
      if (from.device() == into.device()) axpy_(1.0f, from, into);
      else add_to_master(i, from, into);
    }
    summed(b, into);
  }
  done_.record(comm_);
}

}  // namespace dpt
