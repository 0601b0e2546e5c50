// The NCCL reduction path: one communicator per GPU made by ncclCommInitAll, and an
// in-place all-reduce of each gradient bucket on the GPU's communication stream as soon
// as backward has produced it, overlapping the rest of backward.
#include <nccl.h>

#include <chrono>
#include <set>
#include <thread>

#include <dptrain/parallel/process_group.hpp>
#include "../kernels/cuda/check.hpp"
#include "reducer.hpp"

#define DPT_NCCL_CHECK(call)                                                                                         \
  do {                                                                                                               \
    ncclResult_t dpt_res_ = (call);                                                                                  \
    if (dpt_res_ != ncclSuccess) ::dpt::cuda::fail("NCCL", #call, ncclGetErrorString(dpt_res_), __FILE__, __LINE__); \
  } while (0)

namespace dpt {

bool built_with_nccl() { return true; }

namespace {

class NcclReducer : public Reducer {
 public:
  // One process, a communicator per GPU (blocking communicators).
  NcclReducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets)
      : r_(std::move(replicas)), buckets_(std::move(buckets)) {
    std::vector<int> devs;
    std::set<int> seen;
    for (auto& rep : r_) {
      const Device d = rep.ctx->device();
      if (!d.is_cuda()) throw UsageError("DataParallelOptions::reduce nccl needs CUDA devices, got " + d.str());
      if (!seen.insert(d.index).second)
        throw UsageError("DataParallelOptions::reduce nccl cannot put two replicas on " + d.str() +
                         " (NCCL refuses two ranks on one GPU); use p2p");
      devs.push_back(d.index);
    }
    comms_.resize(r_.size());
    DPT_NCCL_CHECK(ncclCommInitAll(comms_.data(), static_cast<int>(r_.size()), devs.data()));
    make_streams();
  }

  // One rank of a multi-process job: rank 0 makes the unique id, MPI carries it to the
  // others. The communicator is non-blocking, so every wait can be bounded and a dead
  // peer ends in ncclCommAbort instead of a hang.
  NcclReducer(ProcessGroup& g, ReplicaBuffers replica, std::vector<Bucket> buckets)
      : r_{std::move(replica)}, buckets_(std::move(buckets)), group_(&g) {
    const Device d = r_[0].ctx->device();
    DPT_CHECK(d.is_cuda(), "the NCCL reduction is for CUDA tensors");
    ncclUniqueId id{};
    if (g.rank() == 0) DPT_NCCL_CHECK(ncclGetUniqueId(&id));
    g.broadcast(&id, sizeof id, 0);
    cuda::set_device(d.index);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    comms_.resize(1);
    ncclResult_t res = ncclCommInitRankConfig(&comms_[0], g.size(), id, g.rank(), &config);
    if (res != ncclInProgress) DPT_NCCL_CHECK(res);
    settle(comms_[0], "NCCL initialization");
    make_streams();
  }

  void make_streams() {
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

  // Waits until a non-blocking communicator has finished its last call, within the
  // timeout; a failure or the timeout aborts the communicator and ends the job.
  void settle(ncclComm_t c, const char* what) {
    if (!group_) return;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(group_->timeout());
    while (true) {
      ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(c, &st);
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) {
        ncclCommAbort(c);
        group_->abort(std::string(what) + " failed: " + ncclGetErrorString(st));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ncclCommAbort(c);
        group_->abort(std::string(what) +
                      " did not complete within the communication timeout (ProcessGroup::set_timeout)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void synchronize(Context& ctx) override {
    if (!group_) {
      ctx.synchronize();
      return;
    }
    // Poll instead of cudaStreamSynchronize: an all-reduce waiting for a dead rank
    // would never return, and the job must end within the timeout instead.
    note_host_wait();
    cuda::set_device(ctx.device().index);
    auto stream = static_cast<cudaStream_t>(ctx.stream());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(group_->timeout());
    while (true) {
      cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) DPT_CUDA_CHECK(q);
      ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(comms_[0], &st);
      if (st != ncclSuccess && st != ncclInProgress) {
        ncclCommAbort(comms_[0]);
        comms_[0] = nullptr;
        group_->abort(std::string("NCCL failed: ") + ncclGetErrorString(st));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ncclCommAbort(comms_[0]);
        comms_[0] = nullptr;
        group_->abort(
            "a gradient all-reduce did not complete within the communication timeout (ProcessGroup::set_timeout): "
            "another rank died or stopped answering");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  const char* name() const override { return "nccl"; }
  bool every_replica_updates() const override { return true; }

  void bucket_ready(size_t r, size_t b) override {
    // The communication stream waits for the bucket's gradients, not the host.
    ready_[r][b]->record(*r_[r].ctx);
    ready_[r][b]->wait_in(*comm_[r]);
    float* p = r_[r].grads.f32() + buckets_[b].offset;
    cuda::set_device(r_[r].ctx->device().index);
    const ncclResult_t res = ncclAllReduce(p, p, static_cast<size_t>(buckets_[b].count), ncclFloat, ncclSum, comms_[r],
                                           static_cast<cudaStream_t>(comm_[r]->stream()));
    if (res != ncclInProgress) DPT_NCCL_CHECK(res);
    settle(comms_[r], "enqueueing an all-reduce");
  }

  void reduce() override {}

  std::vector<Context*> contexts() override {
    std::vector<Context*> out;
    for (auto& c : comm_) out.push_back(c.get());
    return out;
  }

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
  ProcessGroup* group_ = nullptr;  // set across processes
};

}  // namespace

std::unique_ptr<Reducer> make_nccl_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets) {
  return std::make_unique<NcclReducer>(std::move(replicas), std::move(buckets));
}

std::unique_ptr<Reducer> make_nccl_rank_reducer(ProcessGroup& group, ReplicaBuffers replica,
                                                std::vector<Bucket> buckets) {
  return std::make_unique<NcclReducer>(group, std::move(replica), std::move(buckets));
}

}  // namespace dpt
