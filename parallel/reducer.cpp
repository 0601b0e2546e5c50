#include "reducer.hpp"

#include <algorithm>

#include <dptrain/error.hpp>
#include <dptrain/parallel/process_group.hpp>
#include <dptrain/runtime/ops.hpp>
#include "../kernels/cpu/cpu.hpp"

namespace dpt {

std::vector<Bucket> make_buckets(int64_t total, double bucket_bytes) {
  DPT_CHECK(bucket_bytes > 0, "bucket size must be positive");
  const int64_t align = 64;  // 256-byte boundaries keep vector loads aligned
  const int64_t size = std::max<int64_t>(align, static_cast<int64_t>(bucket_bytes / sizeof(float)) / align * align);
  std::vector<Bucket> out;
  for (int64_t end = total; end > 0;) {
    const int64_t begin = std::max<int64_t>(0, end - size);
    out.push_back({begin, end - begin});
    end = begin;
  }
  return out;
}

namespace {

class MasterReducer : public Reducer {
 public:
  MasterReducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets, bool master_updates)
      : r_(std::move(replicas)),
        buckets_(std::move(buckets)),
        master_updates_(master_updates),
        comm_(r_[0].ctx->device()),
        done_(r_[0].ctx->device()),
        params_ready_(r_[0].ctx->device()) {
    for (size_t i = 0; i < r_.size(); ++i) {
      ready_.emplace_back();
      for (size_t b = 0; b < buckets_.size(); ++b) ready_[i].push_back(std::make_unique<Event>(r_[i].ctx->device()));
    }
    const Device master = r_[0].ctx->device();
    bool remote = false;
    for (auto& rep : r_) remote |= !(rep.ctx->device() == master);
    if (remote && master_updates_) {
      // One staging bucket on the master, reused for every replica and bucket: the
      // master's extra memory is one bucket, never N-1 copies of the gradients.
      int64_t largest = 0;
      for (auto& b : buckets_) largest = std::max(largest, b.count);
      ContextGuard g(comm_);
      staging_ = Tensor::empty({largest}, DType::f32, master);
    }
    DPT_CHECK(master_updates_ || master.is_cpu(), "the host reduction is for CPU devices");
  }

  const char* name() const override { return master_updates_ ? "p2p" : "host"; }
  bool every_replica_updates() const override { return !master_updates_; }

  void bucket_ready(size_t r, size_t b) override { ready_[r][b]->record(*r_[r].ctx); }

  void reduce() override {
    ContextGuard g(comm_);
    const Tensor& sum = r_[0].grads;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Bucket& k = buckets_[b];
      Tensor into = sum.view(k.offset, {k.count});
      ready_[0][b]->wait_in(comm_);
      for (size_t i = 1; i < r_.size(); ++i) {  // a fixed order: the sum is reproducible
        ready_[i][b]->wait_in(comm_);
        Tensor from = r_[i].grads.view(k.offset, {k.count});
        if (from.device() == into.device()) {
          axpy_(1.0f, from, into);
        } else if (!master_updates_) {
          cpu::axpy(k.count, 1.0f, from.f32(), into.f32());  // host: virtual CPU devices share memory
        } else {
          Tensor stage = staging_.view(0, {k.count});
          copy(stage, from);
          axpy_(1.0f, stage, into);
        }
      }
    }
    if (!master_updates_)  // host: every replica gets the sum (CPU work is done when queued)
      for (size_t i = 1; i < r_.size(); ++i) copy(r_[i].grads, sum);
    done_.record(comm_);
  }

  void wait(size_t r) override { done_.wait_in(*r_[r].ctx); }

  void broadcast_params() override {
    params_ready_.record(*r_[0].ctx);
    for (size_t i = 1; i < r_.size(); ++i) {
      ContextGuard g(*r_[i].ctx);
      params_ready_.wait_in(*r_[i].ctx);
      copy(r_[i].params, r_[0].params);
      if (r_[i].shadow.defined()) copy_cast(r_[i].shadow, r_[i].params);  // on the replica's own stream
    }
  }

 private:
  std::vector<ReplicaBuffers> r_;
  std::vector<Bucket> buckets_;
  bool master_updates_;
  Context comm_;  // the master's communication stream
  Event done_, params_ready_;
  std::vector<std::vector<std::unique_ptr<Event>>> ready_;  // [replica][bucket]
  Tensor staging_;
};

// CPU processes: each bucket is summed over every rank by MPI as soon as backward has
// produced it (CPU work is complete when queued, so the sum can start at once).
class MpiReducer : public Reducer {
 public:
  MpiReducer(ProcessGroup& g, ReplicaBuffers r, std::vector<Bucket> buckets)
      : g_(g), r_(std::move(r)), buckets_(std::move(buckets)) {
    DPT_CHECK(r_.ctx->device().is_cpu(), "the MPI reduction is for CPU tensors");
  }
  const char* name() const override { return "mpi"; }
  bool every_replica_updates() const override { return true; }
  void bucket_ready(size_t, size_t b) override { g_.start_sum(r_.grads.f32() + buckets_[b].offset, buckets_[b].count); }
  void reduce() override {}
  void wait(size_t) override { g_.wait_all(); }

 private:
  ProcessGroup& g_;
  ReplicaBuffers r_;
  std::vector<Bucket> buckets_;
};

}  // namespace

std::unique_ptr<Reducer> make_mpi_reducer(ProcessGroup& group, ReplicaBuffers replica, std::vector<Bucket> buckets) {
  return std::make_unique<MpiReducer>(group, std::move(replica), std::move(buckets));
}

std::unique_ptr<Reducer> make_master_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                             bool master_updates) {
  DPT_CHECK(!replicas.empty(), "a reducer needs at least one replica");
  return std::make_unique<MasterReducer>(std::move(replicas), std::move(buckets), master_updates);
}

#if !DPT_WITH_NCCL
bool built_with_nccl() { return false; }
std::unique_ptr<Reducer> make_nccl_reducer(std::vector<ReplicaBuffers>, std::vector<Bucket>) {
  throw UsageError("DataParallelOptions::reduce nccl needs a build with NCCL; this one has none (use p2p)");
}
std::unique_ptr<Reducer> make_nccl_rank_reducer(ProcessGroup&, ReplicaBuffers, std::vector<Bucket>) {
  throw UsageError("DataParallelOptions::group on GPUs needs a build with NCCL; this one has none");
}
#endif

}  // namespace dpt
