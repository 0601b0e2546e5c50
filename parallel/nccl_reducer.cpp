// The NCCL reduction path: one communicator per GPU made by ncclCommInitAll, and an
// in-place all-reduce of each gradient bucket on the GPU's communication stream as soon
// as backward has produced it, overlapping the rest of backward.
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/parallel/process_group.hpp>
#include <dptrain/runtime/ops.hpp>
#include "kernels/cuda/check.hpp"
#include "reducer.hpp"

#define DPT_NCCL_CHECK(call)                                                                                         \
  do {                                                                                                               \
    ncclResult_t dpt_res_ = (call);                                                                                  \
    if (dpt_res_ != ncclSuccess) ::dpt::cuda::fail("NCCL", #call, ncclGetErrorString(dpt_res_), __FILE__, __LINE__); \
  } while (0)

namespace dpt {

bool built_with_nccl() { return true; }

namespace {

// NCCL takes a GPU once in a communicator (two ranks on one fail its initialization as
// "invalid usage"): ranks that would share one are refused here, named with the GPU. The
// GPU is told by its machine and PCI location, not its index: a launcher may give each
// process a GPU of its own through CUDA_VISIBLE_DEVICES, every one of them cuda:0 there.
// A collective: every rank calls it, and every rank throws alike.
void refuse_shared_gpus(ProcessGroup& g, const Device& d) {
  const uint64_t mine = uint64_t{static_cast<uint32_t>(g.machine())} << 32 | pci_location(d);
  const std::vector<uint64_t> all = g.gather_all(mine);
  std::map<uint64_t, int> first;  // a GPU, the first rank on it
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    const auto [at, fresh] = first.emplace(all[static_cast<size_t>(r)], r);
    if (fresh) continue;
    char where[64];
    std::snprintf(where, sizeof where, "%04x:%02x:%02x", static_cast<unsigned>(at->first >> 16 & 0xffff),
                  static_cast<unsigned>(at->first >> 8 & 0xff), static_cast<unsigned>(at->first & 0xff));
    throw UsageError("ranks " + std::to_string(at->second) + " and " + std::to_string(r) +
                         " would train on one GPU (PCI " + where + " of rank " + std::to_string(at->first >> 32) +
                         "'s machine), and NCCL takes a GPU once: start a process a GPU (the local rank picks its "
                         "GPU from {}), or give each process a GPU of its own",
                     {{"TrainConfig", "devices"}});
  }
}

class NcclReducer : public Reducer, public ZeroReducer, public RankReducer {
 public:
  // One process, a communicator per GPU (blocking communicators).
  NcclReducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets, std::vector<SampleRange> partitions,
              DType wire, GradSlots slots, int max_ctas)
      : r_(std::move(replicas)),
        buckets_(std::move(buckets)),
        partitions_(std::move(partitions)),
        wire_(wire),
        slots_(std::move(slots)) {
    DPT_CHECK(partitions_.empty() || partitions_.size() == r_.size(), "ZeRO partitions: one a replica");
    std::vector<int> devs;
    std::set<int> seen;
    for (auto& rep : r_) {
      const Device d = rep.ctx->device();
      if (!d.is_cuda())
        throw UsageError("{} nccl needs CUDA devices, got " + d.str(), {{"DataParallelOptions", "reduce"}});
      if (!seen.insert(d.index).second)
        throw UsageError(
            "{} nccl cannot put two replicas on " + d.str() + " (NCCL refuses two ranks on one GPU); use p2p",
            {{"DataParallelOptions", "reduce"}});
      devs.push_back(d.index);
    }
    comms_.resize(r_.size());
    if (max_ctas == 0) {
      DPT_NCCL_CHECK(ncclCommInitAll(comms_.data(), static_cast<int>(r_.size()), devs.data()));
    } else {  // what ncclCommInitAll does, with a configuration
      ncclUniqueId id{};
      DPT_NCCL_CHECK(ncclGetUniqueId(&id));
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.maxCTAs = max_ctas;
      // A failure destroys the communicators made so far (the destructor will not run).
      auto fail = [&](ncclResult_t res) {
        for (ncclComm_t& c : comms_)
          if (c) ncclCommDestroy(std::exchange(c, nullptr));
        DPT_NCCL_CHECK(res);
      };
      DPT_NCCL_CHECK(ncclGroupStart());
      for (size_t i = 0; i < devs.size(); ++i) {
        cuda::set_device(devs[i]);
        const ncclResult_t res =
            ncclCommInitRankConfig(&comms_[i], static_cast<int>(devs.size()), id, static_cast<int>(i), &config);
        if (res != ncclSuccess) {
          (void)ncclGroupEnd();
          fail(res);
        }
      }
      if (const ncclResult_t res = ncclGroupEnd(); res != ncclSuccess) fail(res);
    }
    make_streams();
  }

  // One rank of a multi-process job: rank 0 makes the unique id, MPI carries it to the
  // others. The communicator is non-blocking, so every wait can be bounded and a dead
  // peer ends in ncclCommAbort instead of a hang.
  NcclReducer(ProcessGroup& g, ReplicaBuffers replica, std::vector<Bucket> buckets, std::vector<SampleRange> partitions,
              DType wire, GradSlots slots, int max_ctas)
      : r_{std::move(replica)},
        buckets_(std::move(buckets)),
        partitions_(std::move(partitions)),
        wire_(wire),
        slots_(std::move(slots)),
        group_(&g) {
    DPT_CHECK(partitions_.empty() || partitions_.size() == static_cast<size_t>(g.size()),
              "ZeRO partitions: one a rank");
    const Device d = r_[0].ctx->device();
    DPT_CHECK(d.is_cuda(), "the NCCL reduction is for CUDA tensors");
    refuse_shared_gpus(g, d);
    ncclUniqueId id{};
    if (g.rank() == 0) DPT_NCCL_CHECK(ncclGetUniqueId(&id));
    g.broadcast(&id, sizeof id, 0);
    cuda::set_device(d.index);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    if (max_ctas > 0) config.maxCTAs = max_ctas;
    comms_.resize(1);
    ncclResult_t res = ncclCommInitRankConfig(&comms_[0], g.size(), id, g.rank(), &config);
    if (res != ncclInProgress) DPT_NCCL_CHECK(res);
    settle(comms_[0], "NCCL initialization");
    make_streams();
  }

  void make_streams() {
    queued_.assign(r_.size(), 0);
    DPT_CHECK(!slots_.defined() || (!partitions_.empty() && slots_.partition_sums.size() == r_.size()),
              "ZeRO stage 2: partitions, and a partition sum a replica");
    for (auto& rep : r_) {
      const Device d = rep.ctx->device();
      DPT_CHECK(!slots_.defined() || rep.grads.numel() == slots_.layout.size, "ZeRO stage 2: slots as the gradients");
      // High priority: a bucket's collective gets SMs as soon as any frees up, not only
      // once backward's GEMMs (which fill every SM) have ended.
      comm_.push_back(std::make_unique<Context>(d, StreamPriority::high));
      done_.push_back(std::make_unique<Event>(d));
      slot_free_.emplace_back();
      for (size_t k = 0; k < slots_.layout.slots(); ++k) slot_free_.back().push_back(std::make_unique<Event>(d));
    }
    slot_used_.assign(r_.size(), std::vector<char>(slots_.layout.slots(), 0));
    make_bucket_state();
  }

  // An event a replica a bucket, and stage 2's count of each bucket's hand-overs.
  void make_bucket_state() {
    ready_.clear();
    for (auto& rep : r_) {
      ready_.emplace_back();
      for (size_t b = 0; b < buckets_.size(); ++b) ready_.back().push_back(std::make_unique<Event>(rep.ctx->device()));
    }
    arrivals_.assign(r_.size(), std::vector<int>(buckets_.size(), 0));
  }

  void set_buckets(std::vector<Bucket> buckets) override {
    if (slots_.defined())
      throw UsageError("the nccl reduction cannot change its buckets");  // the slots are the buckets'
    buckets_ = std::move(buckets);
    make_bucket_state();
  }

  ~NcclReducer() override {
    for (ncclComm_t c : comms_)
      if (c && finalized(c)) ncclCommDestroy(c);
  }

  // A rank's non-blocking communicator finishes its last calls before it is destroyed
  // (ncclCommFinalize, then waiting, within the timeout, for it to be done), so that no
  // thread of NCCL's is left to race the process's exit; one that fails or does not finish
  // in time is aborted instead, as is one destroyed by an error on its way out (its
  // collectives may wait for ranks that will not come). Blocking ones need nothing.
  bool finalized(ncclComm_t c) const {
    if (!group_) return true;
    if (std::uncaught_exceptions() > 0) {
      ncclCommAbort(c);
      return false;
    }
    ncclResult_t st = ncclCommFinalize(c);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(group_->timeout());
    while (st == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      if (ncclCommGetAsyncError(c, &st) != ncclSuccess) break;
    }
    if (st == ncclSuccess) return true;
    ncclCommAbort(c);
    return false;
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
  bool tells_bucket_done() const override { return partitions_.empty(); }
  ZeroReducer* zero() override { return partitions_.empty() ? nullptr : this; }
  RankReducer* across_ranks() override { return group_ ? this : nullptr; }

  void bucket_ready(size_t r, size_t b) override {
    if (slots_.defined()) {
      reduce_slot(r, b);
      return;
    }
    if (alone()) {
      reduced(r, b, *r_[r].ctx);
      return;
    }
    // The communication stream waits for the bucket's gradients, not the host.
    ready_[r][b]->record(*r_[r].ctx);
    ready_[r][b]->wait_in(*comm_[r]);
    const Bucket& k = buckets_[b];
    // bf16 on the wire: the bucket rounded into a buffer of the communication stream
    // (freed at the end, so the next bucket reuses it in stream order), reduced there and
    // widened back.
    ContextGuard on_comm(*comm_[r]);
    const Tensor grads = r_[r].grads.view(k.offset, {k.count});
    Tensor sent = grads;
    if (wire_ == DType::bf16) {
      sent = Tensor::empty({k.count}, DType::bf16, grads.device());
      copy_cast(sent, grads);
    }
    const ncclDataType_t type = wire_ == DType::bf16 ? ncclBfloat16 : ncclFloat;
    cuda::set_device(r_[r].ctx->device().index);
    const auto stream = static_cast<cudaStream_t>(comm_[r]->stream());
    if (partitions_.empty()) {
      const ncclResult_t res =
          ncclAllReduce(sent.data(), sent.data(), static_cast<size_t>(k.count), type, ncclSum, comms_[r], stream);
      if (res != ncclInProgress) DPT_NCCL_CHECK(res);
      queued_[r] += 1;
      settle(comms_[r], "enqueueing an all-reduce");
    } else {
      // ZeRO: each owner's piece of the bucket is summed into that owner alone (a
      // reduce-scatter of uneven pieces), in owner order on every replica and rank.
      for (size_t owner = 0; owner < partitions_.size(); ++owner) {
        const auto [begin, end] = piece(k, owner);
        if (begin >= end) continue;
        void* p = static_cast<char*>(sent.data()) + static_cast<size_t>(begin - k.offset) * dtype_size(wire_);
        const ncclResult_t res = ncclReduce(p, p, static_cast<size_t>(end - begin), type, ncclSum,
                                            static_cast<int>(owner), comms_[r], stream);
        if (res != ncclInProgress) DPT_NCCL_CHECK(res);
        queued_[r] += 1;
        settle(comms_[r], "enqueueing a reduce");
      }
    }
    if (wire_ == DType::bf16 && partitions_.empty()) {
      copy_cast(grads, sent);
    } else if (wire_ == DType::bf16) {  // ZeRO: only the owner's piece of the sum is read
      const auto [begin, end] = piece(k, own(r));
      if (begin < end)
        copy_cast(grads.view(begin - k.offset, {end - begin}), sent.view(begin - k.offset, {end - begin}));
    }
    if (partitions_.empty()) reduced(r, b, *comm_[r]);
  }

  // ZeRO stage 2: bucket b lies in its slot of r's gradients; each owner's piece is
  // reduced into that owner's partition sum (straight there by NCCL on the step's first
  // micro-batch in fp32; else into the slot and added), and the slot is free once done.
  void reduce_slot(size_t r, size_t b) {
    const Bucket& k = buckets_[b];
    const size_t s = slots_.layout.slot_of[b];
    const bool first_micro = ++arrivals_[r][b] == 1;
    const Tensor bucket = r_[r].grads.view(slots_.layout.bucket_begin(b), {k.count});
    const SampleRange& mine = partitions_[own(r)];
    const Tensor& sum = slots_.partition_sums[r];
    if (alone()) {  // one GPU: the whole bucket is this replica's, on its compute stream
      Tensor into = sum.view(k.offset - mine.first, {k.count});
      if (first_micro) copy(into, bucket);
      else axpy_(1.0f, bucket, into);
      return;
    }
    ready_[r][b]->record(*r_[r].ctx);
    ready_[r][b]->wait_in(*comm_[r]);
    ContextGuard on_comm(*comm_[r]);
    Tensor sent = bucket;
    if (wire_ == DType::bf16) {  // freed at the end, in the communication stream's order
      sent = Tensor::empty({k.count}, DType::bf16, bucket.device());
      copy_cast(sent, bucket);
    }
    const bool direct = first_micro && wire_ == DType::f32;
    const ncclDataType_t type = wire_ == DType::bf16 ? ncclBfloat16 : ncclFloat;
    cuda::set_device(r_[r].ctx->device().index);
    const auto stream = static_cast<cudaStream_t>(comm_[r]->stream());
    for (size_t owner = 0; owner < partitions_.size(); ++owner) {
      const auto [begin, end] = piece(k, owner);
      if (begin >= end) continue;
      void* from = static_cast<char*>(sent.data()) + static_cast<size_t>(begin - k.offset) * dtype_size(wire_);
      void* into = owner == own(r) && direct ? sum.f32() + (begin - mine.first) : from;
      const ncclResult_t res = ncclReduce(from, into, static_cast<size_t>(end - begin), type, ncclSum,
                                          static_cast<int>(owner), comms_[r], stream);
      if (res != ncclInProgress) DPT_NCCL_CHECK(res);
      queued_[r] += 1;
      settle(comms_[r], "enqueueing a reduce");
    }
    if (const auto [begin, end] = piece(k, own(r)); begin < end && !direct) {
      const Tensor reduced = sent.view(begin - k.offset, {end - begin});
      Tensor into = sum.view(begin - mine.first, {end - begin});
      if (wire_ == DType::f32) {
        axpy_(1.0f, reduced, into);
      } else if (first_micro) {
        copy_cast(into, reduced);
      } else {  // widened into the slot, whose gradients were sent already
        Tensor wide = bucket.view(begin - k.offset, {end - begin});
        copy_cast(wide, reduced);
        axpy_(1.0f, wide, into);
      }
    }
    slot_free_[r][s]->record(*comm_[r]);
    slot_used_[r][s] = 1;
  }

  void begin_step() override {
    for (auto& a : arrivals_) std::fill(a.begin(), a.end(), 0);
    for (auto& u : slot_used_) std::fill(u.begin(), u.end(), 0);
    queued_.assign(r_.size(), 0);
  }

  // Every replica queues the same collectives in the same order: equal counts are the same
  // ones, matched; unequal counts leave the longer lists' tails waiting for the others.
  bool abandon_if_unmatched() override {
    if (group_ || alone() || std::adjacent_find(queued_.begin(), queued_.end(), std::not_equal_to<>()) == queued_.end())
      return false;
    for (ncclComm_t& c : comms_)
      if (c) ncclCommAbort(std::exchange(c, nullptr));
    return true;
  }

  // Stage 2: r's compute stream writes a slot only after the reductions that read it.
  void before_write(size_t r, size_t b) override {
    const size_t s = slots_.layout.slot_of[b];
    if (slot_used_[r][s]) slot_free_[r][s]->wait_in(*r_[r].ctx);
  }

  // The replica's (or rank's) own partition, and owner's piece [begin, end) of bucket k.
  size_t own(size_t r) const { return group_ ? static_cast<size_t>(group_->rank()) : r; }
  std::pair<int64_t, int64_t> piece(const Bucket& k, size_t owner) const {
    const Piece p = piece_of(k, partitions_[owner]);
    return {p.begin, p.end};
  }

  // One GPU in all (ZeRO on one device): every collective is the identity, and is not
  // queued, so that --zero costs nothing there.
  bool alone() const { return r_.size() == 1 && (!group_ || group_->size() == 1); }

  // Collectives of every replica from this one thread, on their compute streams (after
  // what those queued): one NCCL group, as several communicators of one thread need.
  template <class F>
  void on_every_replica(const char* what, F&& call) {
    // The group ends on every way out, an exception's too: a thread left inside a group
    // would queue its later collectives into it.
    struct Group {
      bool open = true;
      ncclResult_t end() {
        open = false;
        return ncclGroupEnd();
      }
      ~Group() {
        if (open) (void)ncclGroupEnd();
      }
    };
    DPT_NCCL_CHECK(ncclGroupStart());
    Group group;
    for (size_t r = 0; r < r_.size(); ++r) {
      cuda::set_device(r_[r].ctx->device().index);
      const ncclResult_t res = call(r, static_cast<cudaStream_t>(r_[r].ctx->stream()));
      if (res != ncclSuccess && res != ncclInProgress) DPT_NCCL_CHECK(res);
    }
    const ncclResult_t res = group.end();
    if (res != ncclInProgress) DPT_NCCL_CHECK(res);
    for (ncclComm_t c : comms_) settle(c, what);
  }

  void sum_partials(std::vector<Tensor>& partial, std::vector<Tensor>& first_bad) override {
    DPT_CHECK(zero() && partial.size() == r_.size() && first_bad.size() == r_.size(),
              "sum_partials: one partial sum a replica, ZeRO");
    if (alone()) return;
    on_every_replica("enqueueing the norm's all-reduce", [&](size_t r, cudaStream_t stream) {
      float* p = partial[r].f32();
      ncclResult_t res = ncclAllReduce(p, p, 1, ncclFloat, ncclSum, comms_[r], stream);
      if (res != ncclSuccess && res != ncclInProgress) return res;
      auto* f = reinterpret_cast<int64_t*>(first_bad[r].i32());
      return ncclAllReduce(f, f, 1, ncclInt64, ncclMin, comms_[r], stream);
    });
  }

  void gather_params() override {
    DPT_CHECK(zero(), "gather_params: ZeRO");
    if (alone()) return;
    // Each partition's updated parameters from its owner to every replica and rank.
    on_every_replica("enqueueing the parameters' broadcast", [&](size_t r, cudaStream_t stream) {
      float* p = r_[r].params.f32();
      for (size_t owner = 0; owner < partitions_.size(); ++owner) {
        const SampleRange& k = partitions_[owner];
        if (k.count == 0) continue;
        const ncclResult_t res = ncclBroadcast(p + k.first, p + k.first, static_cast<size_t>(k.count), ncclFloat,
                                               static_cast<int>(owner), comms_[r], stream);
        if (res != ncclSuccess && res != ncclInProgress) return res;
      }
      return ncclSuccess;
    });
    for (size_t r = 0; r < r_.size(); ++r) refresh_shadow_of_others(r_[r], partitions_, own(r));
  }

  // On the compute stream, after the forward that wrote them: no host round trip, so the
  // step stays asynchronous and a CUDA graph records the broadcast with it.
  void broadcast_buffers(const Tensor& buffers) override {
    DPT_CHECK(group_ && r_.size() == 1, "broadcast_buffers: across ranks, one replica a rank");
    if (alone()) return;
    on_every_replica("enqueueing the buffers' broadcast", [&](size_t r, cudaStream_t stream) {
      return ncclBroadcast(buffers.f32(), buffers.f32(), static_cast<size_t>(buffers.numel()), ncclFloat, 0, comms_[r],
                           stream);
    });
  }

  void reduce() override {}

  std::vector<Context*> contexts() override {
    std::vector<Context*> out;
    for (auto& c : comm_) out.push_back(c.get());
    return out;
  }

  void wait(size_t r) override {
    if (alone()) return;
    done_[r]->record(*comm_[r]);
    done_[r]->wait_in(*r_[r].ctx);
  }

 private:
  std::vector<ReplicaBuffers> r_;
  std::vector<Bucket> buckets_;
  std::vector<SampleRange> partitions_;  // ZeRO: owner k's partition of the flat buffers
  DType wire_;                           // the type the buckets are reduced in
  std::vector<ncclComm_t> comms_;
  std::vector<std::unique_ptr<Context>> comm_;
  std::vector<std::unique_ptr<Event>> done_;
  std::vector<std::vector<std::unique_ptr<Event>>> ready_;
  GradSlots slots_;                                             // stage 2; else none
  std::vector<std::vector<int>> arrivals_;                      // stage 2, [replica][bucket]: hand-overs this step
  std::vector<std::vector<std::unique_ptr<Event>>> slot_free_;  // [replica][slot]: its last reduction done
  std::vector<std::vector<char>> slot_used_;                    // [replica][slot]: a bucket went through it this step
  ProcessGroup* group_ = nullptr;                               // set across processes
  std::vector<int64_t> queued_;  // [replica]: collectives queued from its thread this step
};

}  // namespace

BareNcclTimes time_bare_nccl(const std::vector<Device>& devices, int64_t floats, int iters) {
  const auto n = static_cast<int64_t>(devices.size());
  DPT_CHECK(iters >= 1 && floats >= n && n >= 1, "time_bare_nccl: devices, floats and iterations");
  std::vector<int> ids;
  std::set<int> seen;
  for (const Device& d : devices) {
    if (!d.is_cuda() || !seen.insert(d.index).second)
      throw UsageError("bare NCCL runs on distinct GPUs, got " + d.str() + " (twice, or not a GPU)");
    ids.push_back(d.index);
  }
  const int64_t per = floats / n, total = per * n;
  std::vector<ncclComm_t> comms(devices.size());
  DPT_NCCL_CHECK(ncclCommInitAll(comms.data(), static_cast<int>(n), ids.data()));
  struct Comms {  // destroyed on every way out
    std::vector<ncclComm_t>& c;
    ~Comms() {
      for (ncclComm_t x : c) ncclCommDestroy(x);
    }
  } guard{comms};
  std::vector<std::unique_ptr<Context>> ctx;
  std::vector<Tensor> buf;
  for (const Device& d : devices) {
    ctx.push_back(std::make_unique<Context>(d));
    ContextGuard g(*ctx.back());
    buf.push_back(Tensor::zeros({total}, DType::f32, d));
  }
  // One collective on every device, in one group (one thread drives every communicator).
  auto run = [&](auto&& call) {
    DPT_NCCL_CHECK(ncclGroupStart());
    for (size_t i = 0; i < devices.size(); ++i) {
      cuda::set_device(ids[i]);
      const ncclResult_t res = call(i, buf[i].f32(), static_cast<cudaStream_t>(ctx[i]->stream()));
      if (res != ncclSuccess) {
        (void)ncclGroupEnd();
        DPT_NCCL_CHECK(res);
      }
    }
    DPT_NCCL_CHECK(ncclGroupEnd());
    for (auto& c : ctx) c->synchronize();
  };
  auto median_ms = [&](auto&& call) { return median_ms_of(iters, [&] { run(call); }); };
  const auto count = static_cast<size_t>(total), part = static_cast<size_t>(per);
  BareNcclTimes t;
  t.all_reduce_ms = median_ms([&](size_t i, float* b, cudaStream_t st) {
    return ncclAllReduce(b, b, count, ncclFloat, ncclSum, comms[i], st);
  });
  t.reduce_scatter_ms = median_ms([&](size_t i, float* b, cudaStream_t st) {  // in place: rank i's part of b
    return ncclReduceScatter(b, b + i * part, part, ncclFloat, ncclSum, comms[i], st);
  });
  t.all_gather_ms = median_ms([&](size_t i, float* b, cudaStream_t st) {
    return ncclAllGather(b + i * part, b, part, ncclFloat, comms[i], st);
  });
  return t;
}

std::unique_ptr<Reducer> make_nccl_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                           std::vector<SampleRange> partitions, DType wire, GradSlots slots,
                                           int max_ctas) {
  return std::make_unique<NcclReducer>(std::move(replicas), std::move(buckets), std::move(partitions), wire,
                                       std::move(slots), max_ctas);
}

std::unique_ptr<Reducer> make_nccl_rank_reducer(ProcessGroup& group, ReplicaBuffers replica,
                                                std::vector<Bucket> buckets, std::vector<SampleRange> partitions,
                                                DType wire, GradSlots slots, int max_ctas) {
  return std::make_unique<NcclReducer>(group, std::move(replica), std::move(buckets), std::move(partitions), wire,
                                       std::move(slots), max_ctas);
}

}  // namespace dpt
