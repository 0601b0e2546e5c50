// What the p2p and host reductions share: every bucket of the other replicas is summed
// into the master's (replica 0's) gradients on the master's communication stream, in
// replica order (so the sum is reproducible), as soon as every replica has handed it over.
// How a replica's bucket reaches the master's sum, and who gets the sum then, is each
// reduction's own (p2p_reducer.cpp, host_reducer.cpp).
#pragma once
#include <memory>
#include <vector>

#include "reducer.hpp"

namespace dpt {

class MasterSumReducer : public Reducer {
 public:
  void set_buckets(std::vector<Bucket> buckets) override;
  void bucket_ready(size_t r, size_t b) override;
  void reduce() override;
  void wait(size_t r) override { done_.wait_in(*r_[r].ctx); }
  std::vector<Context*> contexts() override { return {&comm_}; }

 protected:
  // `wire` bf16: each other replica rounds its buckets into a bf16 copy of its gradients,
  // on its own device, as backward hands them over (one replica sends nothing: nothing is
  // rounded).
  MasterSumReducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets, DType wire);
  // Adds `from` (replica i's bucket, as sent) into `into` (the master's), on the comm stream.
  virtual void add_to_master(size_t i, const Tensor& from, const Tensor& into) = 0;
  // Bucket b's sum is queued in `sum` (a view of the master's gradients).
  virtual void summed(size_t b, const Tensor& sum) = 0;
  // The buffers that depend on the buckets' sizes, made anew when they change.
  virtual void make_bucket_buffers() {}
  int64_t largest_bucket() const;

  std::vector<ReplicaBuffers> r_;
  std::vector<Bucket> buckets_;
  DType wire_;    // the type the other replicas' gradients travel in
  Context comm_;  // the master's communication stream (high priority: beside backward)

 private:
  void make_bucket_events();
  Event done_;
  std::vector<std::vector<std::unique_ptr<Event>>> ready_;  // [replica][bucket]
  std::vector<Tensor> sent_;                                // bf16 wire: replica i's gradients as sent, [i - 1]
};

}  // namespace dpt
