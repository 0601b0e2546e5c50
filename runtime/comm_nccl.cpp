// The NCCL reduction path: one communicator per GPU made by ncclCommInitAll, and an
// in-place all-reduce of each gradient bucket on the GPU's communication stream as soon
// as backward has produced it, overlapping the rest of backward.
#include <nccl.h>

#include <set>

#include "../kernels/cuda/check.hpp"
#include "comm.hpp"

#define DPT_NCCL_CHECK(call)                                                              \
  do {                                                                                    \
    ncclResult_t dpt_res_ = (call);                                                       \
    if (dpt_res_ != ncclSuccess)                                                          \
      ::dpt::cuda::fail("NCCL", #call, ncclGetErrorString(dpt_res_), __FILE__, __LINE__); \
  } while (0)

namespace dpt {

bool built_with_nccl() { return true; }

namespace {

class NcclReducer : public Reducer {
 public:
  NcclReducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets)
      : r_(std::move(replicas)), buckets_(std::move(buckets)) {
    std::vector<int> devs;
    std::set<int> seen;
    for (auto& rep : r_) {
      const Device d = rep.ctx->device();
      if (!d.is_cuda()) throw UsageError("--reduce nccl needs CUDA devices, got " + d.str());
      if (!seen.insert(d.index).second)
        throw UsageError("--reduce nccl cannot put two replicas on " + d.str() +
                         " (NCCL refuses two ranks on one GPU); use --reduce p2p");
      devs.push_back(d.index);
    }
    comms_.resize(r_.size());
    DPT_NCCL_CHECK(ncclCommInitAll(comms_.data(), static_cast<int>(r_.size()), devs.data()));
    for (auto& rep : r_) {
      const Device d = rep.ctx->device();
      comm_.push_back(std::make_unique<Context>(d));
      done_.push_back(std::make_unique<Event>(d));
      ready_.emplace_back();
      for (size_t b = 0; b < buckets_.size(); ++b) ready_.back().push_back(std::make_unique<Event>(d));
    }
  }

  ~NcclReducer() override {
    for (ncclComm_t c : comms_)
      if (c) ncclCommDestroy(c);
  }

  const char* name() const override { return "nccl"; }
  bool every_replica_updates() const override { return true; }

  void bucket_ready(size_t r, size_t b) override {
    // The communication stream waits for the bucket's gradients, not the host.
    ready_[r][b]->record(*r_[r].ctx);
    ready_[r][b]->wait_in(*comm_[r]);
    float* p = r_[r].grads.f32() + buckets_[b].offset;
    DPT_CUDA_CHECK(cudaSetDevice(r_[r].ctx->device().index));
    DPT_NCCL_CHECK(ncclAllReduce(p, p, static_cast<size_t>(buckets_[b].count), ncclFloat, ncclSum, comms_[r],
                                 static_cast<cudaStream_t>(comm_[r]->stream())));
  }

  void reduce() override {}

  void wait(size_t r) override {
    done_[r]->record(*comm_[r]);
    done_[r]->wait_in(*r_[r].ctx);
  }

 private:
  std::vector<ReplicaBuffers> r_;
  std::vector<Bucket> buckets_;
  std::vector<ncclComm_t> comms_;
  std::vector<std::unique_ptr<Context>> comm_;
  std::vector<std::unique_ptr<Event>> done_;
  std::vector<std::vector<std::unique_ptr<Event>>> ready_;
};

}  // namespace

std::unique_ptr<Reducer> make_nccl_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets) {
  return std::make_unique<NcclReducer>(std::move(replicas), std::move(buckets));
}

}  // namespace dpt
