// mpi: CPU processes; each bucket is summed over every rank by MPI as soon as backward has
// produced it (CPU work is complete when queued, so the sum can start at once).
#include <algorithm>
#include <cstring>

#include <dptrain/error.hpp>
#include <dptrain/parallel/process_group.hpp>
#include <dptrain/runtime/ops.hpp>
#include "reducer.hpp"

namespace dpt {
namespace {

class MpiReducer : public Reducer, public ZeroReducer, public RankReducer {
 public:
  MpiReducer(ProcessGroup& g, ReplicaBuffers r, std::vector<Bucket> buckets, std::vector<SampleRange> partitions,
             GradSlots slots)
      : g_(g),
        r_(std::move(r)),
        buckets_(std::move(buckets)),
        partitions_(std::move(partitions)),
        slots_(std::move(slots)),
        arrivals_(buckets_.size(), 0),
        slot_ticket_(slots_.layout.slots(), 0),
        finishes_(slots_.layout.slots()) {
    DPT_CHECK(r_.ctx->device().is_cpu(), "the MPI reduction is for CPU tensors");
    DPT_CHECK(partitions_.empty() || partitions_.size() == static_cast<size_t>(g_.size()),
              "ZeRO partitions: one a rank");
    DPT_CHECK(!slots_.defined() ||
                  (!partitions_.empty() && slots_.partition_sums.size() == 1 && r_.grads.numel() == slots_.layout.size),
              "ZeRO stage 2 over MPI: partitions, one partition sum a rank, and slots as its gradients");
  }
  const char* name() const override { return "mpi"; }
  void set_buckets(std::vector<Bucket> buckets) override {
    if (slots_.defined())
      throw UsageError("the mpi reduction cannot change its buckets");  // the slots are the buckets'
    buckets_ = std::move(buckets);
    arrivals_.assign(buckets_.size(), 0);
  }
  bool every_replica_updates() const override { return true; }
  ZeroReducer* zero() override { return partitions_.empty() ? nullptr : this; }
  RankReducer* across_ranks() override { return this; }
  void begin_step() override { std::fill(arrivals_.begin(), arrivals_.end(), 0); }
  void bucket_ready(size_t, size_t b) override {
    const Bucket& k = buckets_[b];
    if (partitions_.empty()) {
      g_.start_sum(r_.grads.f32() + k.offset, k.count);
      return;
    }
    // ZeRO: each rank's piece of the bucket is summed into that rank alone, in the same
    // order on every rank; stage 2 from the bucket's slot, and the owner then moves its
    // piece into its partition's sum (finish_slot).
    const size_t s = slots_.defined() ? slots_.layout.slot_of[b] : 0;
    const Tensor bucket =
        slots_.defined() ? r_.grads.view(slots_.layout.bucket_begin(b), {k.count}) : r_.grads.view(k.offset, {k.count});
    const bool first_micro = slots_.defined() && ++arrivals_[b] == 1;
    const auto me = static_cast<size_t>(g_.rank());
    for (size_t owner = 0; owner < partitions_.size(); ++owner) {
      const SampleRange& o = partitions_[owner];
      const Piece p = piece_of(k, o);
      if (p.begin >= p.end) continue;
      const Tensor mine = bucket.view(p.begin - k.offset, {p.end - p.begin});
      const uint64_t ticket = g_.start_reduce(mine.f32(), mine.numel(), static_cast<int>(owner));
      if (!slots_.defined()) continue;
      slot_ticket_[s] = ticket;
      if (owner == me)
        finishes_[s].push_back({mine, slots_.partition_sums[0].view(p.begin - o.first, {mine.numel()}), first_micro});
    }
  }
  // Stage 2, from the driving thread before backward writes bucket b's slot: the sums of
  // the slot's buckets are done (MPI has read the slot) and in the partition's sum.
  void before_write(size_t, size_t b) override { finish_slot(slots_.layout.slot_of[b]); }
  void reduce() override {}
  void wait(size_t) override {
    g_.wait_all();
    for (size_t s = 0; s < slots_.layout.slots(); ++s) finish_slot(s);
  }
  void sum_partials(std::vector<Tensor>& partial, std::vector<Tensor>& first_bad) override {
    DPT_CHECK(zero() && partial.size() == 1 && first_bad.size() == 1, "sum_partials: one partial sum a rank, ZeRO");
    *partial[0].f32() = static_cast<float>(g_.sum(static_cast<double>(*partial[0].f32())));
    auto* first = reinterpret_cast<int64_t*>(first_bad[0].i32());
    for (uint64_t v : g_.gather_all(static_cast<uint64_t>(*first))) *first = std::min(*first, static_cast<int64_t>(v));
  }
  void broadcast_buffers(const Tensor& buffers) override { g_.broadcast(buffers.f32(), buffers.nbytes(), 0); }
  void gather_params() override {
    DPT_CHECK(zero(), "gather_params: ZeRO");
    std::vector<int64_t> firsts, counts;
    firsts_and_counts(partitions_, firsts, counts);
    g_.all_gather(r_.params.f32(), firsts, counts);
    refresh_shadow_of_others(r_, partitions_, static_cast<size_t>(g_.rank()));
  }

 private:
  struct Finish {  // stage 2: the owner's reduced piece of a slot, and where it goes
    Tensor from, into;
    bool copy;  // the step's first micro-batch: the sum starts here
  };
  void finish_slot(size_t s) {
    if (slot_ticket_[s] == 0) return;
    g_.wait_through(slot_ticket_[s]);
    slot_ticket_[s] = 0;
    for (const Finish& f : finishes_[s]) {
      if (f.copy) std::memcpy(f.into.f32(), f.from.f32(), f.from.nbytes());
      else axpy_(1.0f, f.from, f.into);
    }
    finishes_[s].clear();
  }

  ProcessGroup& g_;
  ReplicaBuffers r_;
  std::vector<Bucket> buckets_;
  std::vector<SampleRange> partitions_;
  GradSlots slots_;                            // stage 2; else none
  std::vector<int64_t> arrivals_;              // stage 2, per bucket: hand-overs this step
  std::vector<uint64_t> slot_ticket_;          // per slot: its last bucket's last collective (0: none)
  std::vector<std::vector<Finish>> finishes_;  // per slot
};

}  // namespace

std::unique_ptr<Reducer> make_mpi_reducer(ProcessGroup& group, ReplicaBuffers replica, std::vector<Bucket> buckets,
                                          std::vector<SampleRange> partitions, GradSlots slots) {
  return std::make_unique<MpiReducer>(group, std::move(replica), std::move(buckets), std::move(partitions),
                                      std::move(slots));
}

}  // namespace dpt
