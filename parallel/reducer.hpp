// Gradient reduction across the replicas of one process, or across ranks, behind one
// interface; each kind in a file of its own:
//   nccl - (nccl_reducer.cpp) in-place all-reduce of each bucket on a communication stream
//          per device, launched as soon as backward has produced the bucket; every
//          replica then steps its own optimizer on the same summed gradient.
//   p2p  - (p2p_reducer.cpp) the classic DataParallel scheme: every replica's buckets are
//          copied to the master (peer copies, or staged by the driver where peers cannot
//          reach each other) through one reused staging bucket, summed there, the master
//          steps, and its parameters are copied back to the replicas.
//   host - (host_reducer.cpp) for virtual CPU devices: the sum is made in the master's
//          buffer and copied to every replica, which steps its own optimizer; ZeRO stage
//          2 sums each bucket into its owners' partitions.
//   mpi  - (mpi_reducer.cpp) CPU processes, a bucket summed over every rank by MPI.
// Replica gradients arrive already weighted by their share of the batch, so a plain
// sum is the full-batch gradient.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <dptrain/parallel/shard_plan.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/tensor.hpp>
#include "buckets.hpp"

namespace dpt {

class ProcessGroup;

struct ReplicaBuffers {
  Context* ctx;   // the replica's compute context
  Tensor params;  // its flat parameter buffer
  Tensor grads;   // its flat gradient buffer
  Tensor shadow;  // its bf16 copy of the parameters (bf16 compute; else undefined)
};

// ZeRO stage 2: replica r's gradients (ReplicaBuffers::grads) are the slots of `layout`,
// bucket b at layout.bucket_begin(b), and the sum of its partition is
// `partition_sums[r]` (its partition's elements; one a process across ranks). A bucket's
// sum goes into its owners' partitions, or is added to what is there for the step's later
// micro-batches, and its slot is free for the next bucket once the sum is done.
struct GradSlots {
  std::vector<Tensor> partition_sums;
  SlotLayout layout;
  bool defined() const { return layout.slots() > 0; }
};

// Owner's piece [begin, end) of bucket k: where the bucket overlaps the owner's partition
// (begin >= end: none).
struct Piece {
  int64_t begin, end;
};
inline Piece piece_of(const Bucket& k, const SampleRange& partition) {
  return {std::max(k.offset, partition.first), std::min(k.offset + k.count, partition.first + partition.count)};
}

// ZeRO (a reducer made with partitions): reduce() leaves replica r's gradients summed over
// its own partition only, and each replica updates its partition.
class ZeroReducer {
 public:
  // From the driving thread: every replica's entry of `partial` (a scalar on its device:
  // its partition's part of the gradients' squared norm) becomes the sum over the
  // replicas, added in replica order, and its entry of `first_bad` (an int64, i32 [2]: its
  // partition's first non-finite gradient) the least over them, in place.
  virtual void sum_partials(std::vector<Tensor>& partial, std::vector<Tensor>& first_bad) = 0;
  // After the updates: every replica gets every partition's parameters and refreshes its
  // bf16 shadow from them.
  virtual void gather_params() = 0;

 protected:
  ~ZeroReducer() = default;
};

// A reduction across processes (DDP), one replica a rank.
class RankReducer {
 public:
  // From the driving thread after the step (DDP's broadcast_buffers): rank 0's `buffers`
  // (the running statistics of batch norm) reach every rank, queued on the replica's
  // compute context, after its forward wrote them.
  virtual void broadcast_buffers(const Tensor& buffers) = 0;

 protected:
  ~RankReducer() = default;
};

class Reducer {
 public:
  virtual ~Reducer() = default;
  virtual const char* name() const = 0;
  // True: every replica ends with the summed gradient and steps its own optimizer.
  // False: only the master (replica 0) does; broadcast_params() then copies its
  // parameters to the others.
  virtual bool every_replica_updates() const = 0;
  // From replica r's thread, in the same bucket order on every replica: bucket b of r's
  // gradients has been queued on r's compute context.
  virtual void bucket_ready(size_t r, size_t b) = 0;
  // From the driving thread once every replica's backward is queued.
  virtual void reduce() = 0;
  // From replica r's thread: r's later work waits for the reduced gradients.
  virtual void wait(size_t r) = 0;
  // From the driving thread after the master's update (when !every_replica_updates()):
  // every replica gets the master's parameters, and refreshes its bf16 shadow from them.
  virtual void broadcast_params() {}
  // Waits for ctx's queued work; reducers that talk to other processes bound the wait
  // by the communication timeout and end the job when it passes.
  virtual void synchronize(Context& ctx) { ctx.synchronize(); }
  // The contexts it queues work on besides the replicas' (its communication streams):
  // a CUDA graph of the step records them too.
  virtual std::vector<Context*> contexts() { return {}; }

  // What a reduction can do besides the sum; null where it cannot.
  virtual ZeroReducer* zero() { return nullptr; }          // made with partitions (ZeRO)
  virtual RankReducer* across_ranks() { return nullptr; }  // talks to other processes

  // Between steps (every replica's work done): reduce in these buckets from now on
  // (DataParallelOptions::tune_buckets, refused with ZeRO stage 2, whose memory is laid
  // out by the buckets).
  virtual void set_buckets(std::vector<Bucket> buckets) = 0;

  // Per-bucket updates (DataParallelOptions::update_per_bucket): `done` is called as soon as
  // replica r's sum of bucket b is queued (buckets in order; from the thread that queued
  // it), with the context whose queue holds it; only where tells_bucket_done().
  using BucketDone = std::function<void(size_t r, size_t b, Context& where)>;
  virtual bool tells_bucket_done() const { return false; }
  void on_bucket_done(BucketDone done) { bucket_done_ = std::move(done); }

  // From the driving thread after a step failed on some replicas (out of memory in one
  // replica's backward): a collective that some replicas queued and the others never will
  // waits forever, and so does every later wait on its stream (a synchronize, a
  // communicator's destroy). Where the replicas queued different collectives, cancels
  // them all (ncclCommAbort) and returns true; the reduction is then unusable. One
  // process's collectives only: ranks end the job instead (ProcessGroup::abort).
  virtual bool abandon_if_unmatched() { return false; }

  // ZeRO stage 2 (gradients in bucket slots, the sums in partitions of their own). From
  // the driving thread before a step's first backward:
  virtual void begin_step() {}
  // From replica r's thread before backward writes bucket b's gradients into its slot:
  // returns once every bucket r handed over through that slot has been reduced.
  virtual void before_write(size_t /*r*/, size_t /*b*/) {}

 protected:
  void reduced(size_t r, size_t b, Context& where) const {
    if (bucket_done_) bucket_done_(r, b, where);
  }

 private:
  BucketDone bucket_done_;
};

// p2p: the other replicas' buckets summed on the master, which alone updates. `wire`
// (DataParallelOptions::grad_comm) bf16: the other replicas' buckets are rounded to bf16
// on their devices (into a bf16 copy of their gradients) and added into the master's fp32
// sum.
std::unique_ptr<Reducer> make_p2p_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                          DType wire = DType::f32);

// host (CPU devices): the sum made on the master and handed to every replica, which
// updates. `partitions` (one per replica, zero_partitions'): ZeRO, each replica gets only
// its partition of the sum. `wire` bf16: as p2p, and every replica, the master too, gets
// the sum rounded to bf16.
std::unique_ptr<Reducer> make_host_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                           std::vector<SampleRange> partitions = {}, DType wire = DType::f32);

// NCCL all-reduce, one communicator per device (ncclCommInitAll); the devices must be
// distinct GPUs. Throws UsageError when this build has no NCCL. `partitions` (one per
// replica, or per rank): ZeRO, each bucket's pieces are reduced into their owners alone
// (ncclReduce, in owner order), and the parameters are broadcast back from them; with
// `slots` (stage 2), from the bucket's slot into the owners' partition sums.
// `wire` bf16: each bucket is rounded into a bf16 buffer of the communication stream,
// reduced in bf16, and widened back into the fp32 gradients. `max_ctas` > 0: NCCL's
// collectives take at most that many thread blocks (ncclConfig_t::maxCTAs).
std::unique_ptr<Reducer> make_nccl_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                           std::vector<SampleRange> partitions = {}, DType wire = DType::f32,
                                           GradSlots slots = {}, int max_ctas = 0);

// Across processes (DDP), one replica per process: NCCL between GPUs (the unique id
// travels over MPI; non-blocking communicators, so a dead peer ends in an abort rather
// than a hang) or MPI_Iallreduce between CPU processes.
std::unique_ptr<Reducer> make_nccl_rank_reducer(ProcessGroup& group, ReplicaBuffers replica,
                                                std::vector<Bucket> buckets, std::vector<SampleRange> partitions = {},
                                                DType wire = DType::f32, GradSlots slots = {}, int max_ctas = 0);
// `partitions` (one per rank, zero_partitions'): ZeRO, each rank gets only its partition
// of the sum; `slots`: stage 2.
std::unique_ptr<Reducer> make_mpi_reducer(ProcessGroup& group, ReplicaBuffers replica, std::vector<Bucket> buckets,
                                          std::vector<SampleRange> partitions = {}, GradSlots slots = {});

// Stage 2 between CPU devices: the last replica to hand a bucket over sums it, in replica
// order as the host reduction does, into every owner's partition.
std::unique_ptr<Reducer> make_host_stage2_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                                  std::vector<SampleRange> partitions, GradSlots slots);

// ZeRO, after the parameters' gather: the bf16 shadow of every partition but `own` from
// the gathered fp32 parameters. The optimizer refreshed its own partition's in its update
// (one cast of the whole buffer instead would cost a pass over it a step on one device).
void refresh_shadow_of_others(const ReplicaBuffers& r, const std::vector<SampleRange>& partitions, size_t own);

// The partitions' firsts and counts, as ProcessGroup::all_gather takes them.
void firsts_and_counts(const std::vector<SampleRange>& partitions, std::vector<int64_t>& firsts,
                       std::vector<int64_t>& counts);

// For dpbench --comm: ms of f() (which waits for its work), the median of `iters` timed
// calls after one untimed (the first use of communicators and buffers).
double median_ms_of(int iters, const std::function<void()>& f);

}  // namespace dpt
