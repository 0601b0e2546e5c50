// p2p: every replica's buckets summed on the master, which alone updates; its parameters
// are then copied to the others (broadcast_params, or DataParallel's per-layer chunks).
#include <dptrain/error.hpp>
#include <dptrain/runtime/ops.hpp>
#include "master_sum.hpp"

namespace dpt {
namespace {

class P2pReducer : public MasterSumReducer {
 public:
  P2pReducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets, DType wire)
      : MasterSumReducer(std::move(replicas), std::move(buckets), wire), params_ready_(r_[0].ctx->device()) {
    // The master's sum kernel reads a peer's buckets in place where it reads that GPU's
    // memory directly over NVLink; the others' go through one staging bucket on the
    // master, reused for every replica and bucket (one bucket of extra memory, never N-1
    // copies).
    const Device master = r_[0].ctx->device();
    for (auto& rep : r_) {
      const Device d = rep.ctx->device();
      const bool remote = !(d == master);
      read_direct_.push_back(remote && peer_over_nvlink(master, d));
      staged_ |= remote && !read_direct_.back();
    }
    make_bucket_buffers();
  }

  const char* name() const override { return "p2p"; }
  bool every_replica_updates() const override { return false; }
  bool tells_bucket_done() const override { return true; }

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
  void make_bucket_buffers() override {
    if (!staged_) return;
    ContextGuard g(comm_);
    staging_ = Tensor();  // its memory serves the new one
    staging_ = Tensor::empty({largest_bucket()}, wire_, r_[0].ctx->device());
  }

  void add_to_master(size_t i, const Tensor& from, const Tensor& into) override {
    if (read_direct_[i]) {
      add_peer_(from, into);
      return;
    }
    Tensor stage = staging_.view(0, {from.numel()});
    copy(stage, from);
    axpy_(1.0f, stage, into);
  }

  void summed(size_t b, const Tensor&) override { reduced(0, b, comm_); }

  Event params_ready_;
  std::vector<char> read_direct_;  // per replica: the master's kernels read its buckets in place
  bool staged_ = false;            // some replica's buckets go through the staging bucket
  Tensor staging_;                 // a bucket on the master, in the wire's type (when one is not read in place)
};

}  // namespace

std::unique_ptr<Reducer> make_p2p_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                          DType wire) {
  DPT_CHECK(!replicas.empty(), "a reducer needs at least one replica");
  return std::make_unique<P2pReducer>(std::move(replicas), std::move(buckets), wire);
}

}  // namespace dpt
