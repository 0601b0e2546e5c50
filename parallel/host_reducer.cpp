// host: the reductions between virtual CPU devices, which share the host's memory (work
// on them is complete when queued). The plain one sums on the master and hands every
// replica the sum, or its partition of it (ZeRO); stage 2 sums each bucket into its
// owners' partitions as the last replica hands it over.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include <dptrain/error.hpp>
#include <dptrain/runtime/ops.hpp>
#include "master_sum.hpp"

namespace dpt {
namespace {

// ZeRO: every replica's partial sum and first bad index become the sum and the least
// over the replicas.
void host_sum_partials(std::vector<Tensor>& partial, std::vector<Tensor>& first_bad) {
  float total = 0.0f;
  int64_t first = INT64_MAX;
  for (size_t i = 0; i < partial.size(); ++i) {
    total += *partial[i].f32();
    first = std::min(first, *reinterpret_cast<const int64_t*>(first_bad[i].i32()));
  }
  for (size_t i = 0; i < partial.size(); ++i) {
    *partial[i].f32() = total;
    *reinterpret_cast<int64_t*>(first_bad[i].i32()) = first;
  }
}

// And every replica gets every partition's parameters from its owner.
void host_gather_params(const std::vector<ReplicaBuffers>& r, const std::vector<SampleRange>& partitions) {
  for (size_t k = 0; k < r.size(); ++k) {
    const SampleRange& s = partitions[k];
    for (size_t i = 0; i < r.size(); ++i)
      if (i != k && s.count > 0)
        std::memcpy(r[i].params.f32() + s.first, r[k].params.f32() + s.first,
                    sizeof(float) * static_cast<size_t>(s.count));
  }
  for (size_t i = 0; i < r.size(); ++i) refresh_shadow_of_others(r[i], partitions, i);
}

class HostReducer : public MasterSumReducer, public ZeroReducer {
 public:
  HostReducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets, std::vector<SampleRange> partitions,
              DType wire)
      : MasterSumReducer(std::move(replicas), std::move(buckets), wire), partitions_(std::move(partitions)) {
    DPT_CHECK(r_[0].ctx->device().is_cpu(), "the host reduction is for CPU devices");
    DPT_CHECK(partitions_.empty() || partitions_.size() == r_.size(), "ZeRO partitions: one a replica");
    make_bucket_buffers();
  }

  const char* name() const override { return "host"; }
  bool every_replica_updates() const override { return true; }
  bool tells_bucket_done() const override { return partitions_.empty(); }
  ZeroReducer* zero() override { return partitions_.empty() ? nullptr : this; }

  void sum_partials(std::vector<Tensor>& partial, std::vector<Tensor>& first_bad) override {
    DPT_CHECK(zero() && partial.size() == r_.size() && first_bad.size() == r_.size(),
              "sum_partials: one partial sum a replica, ZeRO");
    host_sum_partials(partial, first_bad);
  }

  void gather_params() override {
    DPT_CHECK(zero(), "gather_params: ZeRO");
    host_gather_params(r_, partitions_);
  }

 private:
  void make_bucket_buffers() override {
    if (wire_ != DType::bf16) return;
    rounded_ = Tensor();  // its memory serves the new one
    rounded_ = Tensor::empty({largest_bucket()}, DType::bf16, r_[0].ctx->device());
  }

  // Virtual CPU devices share the host's memory: no copy.
  void add_to_master(size_t, const Tensor& from, const Tensor& into) override { add_host_(from, into); }

  // Every replica takes the sum as it would come over a bf16 wire, and gets the sum, or
  // (ZeRO) its partition of it.
  void summed(size_t b, const Tensor& sum) override {
    const Bucket& k = buckets_[b];
    if (wire_ == DType::bf16) {
      const Tensor rounded = rounded_.view(0, {k.count});
      copy_cast(rounded, sum);
      copy_cast(sum, rounded);
    }
    for (size_t i = 1; i < r_.size(); ++i) {
      if (partitions_.empty()) {
        copy(r_[i].grads.view(k.offset, {k.count}), sum);
      } else if (const Piece p = piece_of(k, partitions_[i]); partitions_[i].count > 0 && p.begin < p.end) {
        std::memcpy(r_[i].grads.f32() + p.begin, r_[0].grads.f32() + p.begin,
                    sizeof(float) * static_cast<size_t>(p.end - p.begin));
      }
    }
    for (size_t i = 0; i < r_.size(); ++i) reduced(i, b, *r_[i].ctx);
  }

  std::vector<SampleRange> partitions_;  // ZeRO: replica r's partition of the flat buffers
  Tensor rounded_;                       // bf16 wire: a bucket's sum rounded to bf16
};

class HostStage2Reducer : public Reducer, public ZeroReducer {
 public:
  HostStage2Reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                    std::vector<SampleRange> partitions, GradSlots slots)
      : r_(std::move(replicas)),
        buckets_(std::move(buckets)),
        partitions_(std::move(partitions)),
        partition_sums_(std::move(slots.partition_sums)),
        layout_(std::move(slots.layout)),
        arrivals_(buckets_.size(), 0),
        handed_(r_.size(), std::vector<int64_t>(layout_.slots(), 0)),
        reduced_(layout_.slots(), 0) {
    DPT_CHECK(partitions_.size() == r_.size() && partition_sums_.size() == r_.size() && layout_.slots() > 0,
              "ZeRO stage 2: a partition and its gradients a replica, and slots");
    for (const ReplicaBuffers& b : r_)
      DPT_CHECK(b.ctx->device().is_cpu() && b.grads.numel() == layout_.size,
                "ZeRO stage 2's host reduction: CPU devices, and slots as their gradients");
  }
  const char* name() const override { return "host"; }
  bool every_replica_updates() const override { return true; }
  ZeroReducer* zero() override { return this; }
  void set_buckets(std::vector<Bucket>) override {
    throw UsageError("the host reduction cannot change its buckets");  // its slots are laid out by them
  }

  void begin_step() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::fill(arrivals_.begin(), arrivals_.end(), 0);
  }
  void before_write(size_t r, size_t b) override {
    const size_t s = layout_.slot_of[b];
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return reduced_[s] >= handed_[r][s]; });
  }
  void bucket_ready(size_t r, size_t b) override {
    const size_t s = layout_.slot_of[b];
    std::lock_guard<std::mutex> lock(mu_);  // one sum at a time: CPU devices share the host
    handed_[r][s] += 1;
    const int64_t n = static_cast<int64_t>(r_.size());
    if (++arrivals_[b] % n != 0) return;
    const bool first_micro = arrivals_[b] == n;  // later micro-batches add to the step's sum
    const Bucket& k = buckets_[b];
    for (size_t owner = 0; owner < partitions_.size(); ++owner) {
      const SampleRange& o = partitions_[owner];
      const Piece p = piece_of(k, o);
      if (p.begin >= p.end) continue;
      const Tensor into = partition_sums_[owner].view(p.begin - o.first, {p.end - p.begin});
      for (size_t i = 0; i < r_.size(); ++i) {  // replica order: the sum is the host reduction's
        const Tensor from = r_[i].grads.view(layout_.bucket_begin(b) + (p.begin - k.offset), {p.end - p.begin});
        if (i == 0 && first_micro) std::memcpy(into.f32(), from.f32(), from.nbytes());
        else add_host_(from, into);
      }
    }
    reduced_[s] += 1;
    done_.notify_all();
  }
  void reduce() override {}
  void wait(size_t) override {}  // every bucket was summed when the last replica handed it over
  void sum_partials(std::vector<Tensor>& partial, std::vector<Tensor>& first_bad) override {
    host_sum_partials(partial, first_bad);
  }
  void gather_params() override { host_gather_params(r_, partitions_); }

 private:
  std::vector<ReplicaBuffers> r_;
  std::vector<Bucket> buckets_;
  std::vector<SampleRange> partitions_;
  std::vector<Tensor> partition_sums_;
  SlotLayout layout_;
  std::mutex mu_;
  std::condition_variable done_;
  std::vector<int64_t> arrivals_;             // per bucket: hand-overs this step, over the replicas
  std::vector<std::vector<int64_t>> handed_;  // [replica][slot]: buckets handed over through it
  std::vector<int64_t> reduced_;              // per slot: buckets summed out of it
};

}  // namespace

std::unique_ptr<Reducer> make_host_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                           std::vector<SampleRange> partitions, DType wire) {
  DPT_CHECK(!replicas.empty(), "a reducer needs at least one replica");
  return std::make_unique<HostReducer>(std::move(replicas), std::move(buckets), std::move(partitions), wire);
}

std::unique_ptr<Reducer> make_host_stage2_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                                  std::vector<SampleRange> partitions, GradSlots slots) {
  return std::make_unique<HostStage2Reducer>(std::move(replicas), std::move(buckets), std::move(partitions),
                                             std::move(slots));
}

}  // namespace dpt
