// Gradient reduction across the replicas of one process, behind one interface:
//   nccl - in-place all-reduce of each bucket on a communication stream per device,
//          launched as soon as backward has produced the bucket; every replica then
//          steps its own optimizer on the same summed gradient.
//   p2p  - the classic DataParallel scheme: every replica's buckets are copied to the
//          master (peer copies, or staged by the driver where peers cannot reach each
//          other) through one reused staging bucket, summed there, the master steps,
//          and its parameters are copied back to the replicas.
//   host - for virtual CPU devices: the sum is made in the master's buffer and copied
//          to every replica, which steps its own optimizer.
// Replica gradients arrive already weighted by their share of the batch, so a plain
// sum is the full-batch gradient.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <dptrain/parallel/shard_plan.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/tensor.hpp>

namespace dpt {

struct ReplicaBuffers {
  Context* ctx;   // the replica's compute context
  Tensor params;  // its flat parameter buffer
  Tensor grads;   // its flat gradient buffer
  Tensor shadow;  // its bf16 copy of the parameters (bf16 compute; else undefined)
};

// A contiguous range of the flat gradient buffer that is reduced in one piece.
struct Bucket {
  int64_t offset;
  int64_t count;
  bool operator==(const Bucket&) const = default;
};

// ZeRO stage 2: replica r's gradients (ReplicaBuffers::grads) are `slots` slots of
// `slot_size` floats, bucket b in slot b % slots, and its shard of the sum is
// `shard_sums[r]` (its shard's elements; one a process across ranks). A bucket's sum goes
// into its owners' shards, or is added to what is there for the step's later
// micro-batches, and its slot is free for the next bucket once the sum is done.
struct GradSlots {
  std::vector<Tensor> shard_sums;
  int64_t slot_size = 0;
  size_t slots = 0;
  bool defined() const { return slots > 0; }
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
  // Across processes, from the driving thread after the step (DDP's broadcast_buffers):
  // rank 0's `buffers` (the running statistics of batch norm) reach every rank, queued
  // on the replica's compute context, after its forward wrote them. Only reducers that
  // talk to other processes can.
  virtual void broadcast_buffers(const Tensor& buffers);
  // Waits for ctx's queued work; reducers that talk to other processes bound the wait
  // by the communication timeout and end the job when it passes.
  virtual void synchronize(Context& ctx) { ctx.synchronize(); }
  // The contexts it queues work on besides the replicas' (its communication streams):
  // a CUDA graph of the step records them too.
  virtual std::vector<Context*> contexts() { return {}; }

  // ZeRO (a reducer made with shards): reduce() leaves replica r's gradients summed over
  // its own shard only, and each replica updates its shard. From the driving thread:
  // every replica's entry of `partial` (a scalar on its device: its shard's part of the
  // gradients' squared norm) becomes the sum over the replicas, added in replica order,
  // and its entry of `first_bad` (an int64, i32 [2]: its shard's first non-finite
  // gradient) the least over them, in place; and, after the updates, every replica gets
  // every shard's parameters and refreshes its bf16 shadow from them.
  virtual bool sharded() const { return false; }
  virtual void sum_partials(std::vector<Tensor>& partial, std::vector<Tensor>& first_bad);
  virtual void gather_params();

  // Between steps (every replica's work done): reduce in these buckets from now on
  // (DataParallelOptions::tune_buckets). Reducers whose memory is laid out by the buckets
  // (ZeRO stage 2's slots) refuse.
  virtual void set_buckets(std::vector<Bucket> buckets);

  // Per-bucket updates (DataParallelOptions::update_per_bucket): `done` is called as soon as
  // replica r's sum of bucket b is queued (buckets in order; from the thread that queued
  // it), with the context whose queue holds it. Reducers that cannot say so refuse.
  using BucketDone = std::function<void(size_t r, size_t b, Context& where)>;
  virtual bool tells_bucket_done() const { return false; }
  void on_bucket_done(BucketDone done) { bucket_done_ = std::move(done); }

  // ZeRO stage 2 (gradients in bucket slots, the sums in shards of their own). From the
  // driving thread before a step's first backward:
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

// p2p (master_updates = true) and host (false) reduction through the master. `shards`
// (host only; one per replica, zero_shards'): ZeRO, each replica gets only its shard of
// the sum. `wire` (DataParallelOptions::grad_comm): bf16, the other replicas' buckets are
// rounded to bf16 on their devices (into a bf16 copy of their gradients) and added into
// the master's fp32 sum; host then gives every replica, the master too, the sum rounded
// to bf16.
std::unique_ptr<Reducer> make_master_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                             bool master_updates, std::vector<SampleRange> shards = {},
                                             DType wire = DType::f32);

// NCCL all-reduce, one communicator per device (ncclCommInitAll); the devices must be
// distinct GPUs. Throws UsageError when this build has no NCCL. `shards` (one per
// replica, or per rank): ZeRO, each bucket's pieces are reduced into their owners alone
// (ncclReduce, in owner order), and the parameters are broadcast back from them; with
// `slots` (stage 2), from the bucket's slot into the owners' shard sums.
// `wire` bf16: each bucket is rounded into a bf16 buffer of the communication stream,
// reduced in bf16, and widened back into the fp32 gradients. `max_ctas` > 0: NCCL's
// collectives take at most that many thread blocks (ncclConfig_t::maxCTAs).
std::unique_ptr<Reducer> make_nccl_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                           std::vector<SampleRange> shards = {}, DType wire = DType::f32,
                                           GradSlots slots = {}, int max_ctas = 0);

class ProcessGroup;
// Across processes (DDP), one replica per process: NCCL between GPUs (the unique id
// travels over MPI; non-blocking communicators, so a dead peer ends in an abort rather
// than a hang) or MPI_Iallreduce between CPU processes.
std::unique_ptr<Reducer> make_nccl_rank_reducer(ProcessGroup& group, ReplicaBuffers replica,
                                                std::vector<Bucket> buckets, std::vector<SampleRange> shards = {},
                                                DType wire = DType::f32, GradSlots slots = {}, int max_ctas = 0);
// `shards` (one per rank, zero_shards'): ZeRO, each rank gets only its shard of the sum;
// `slots`: stage 2.
std::unique_ptr<Reducer> make_mpi_reducer(ProcessGroup& group, ReplicaBuffers replica, std::vector<Bucket> buckets,
                                          std::vector<SampleRange> shards = {}, GradSlots slots = {});

// Stage 2 between CPU devices: the last replica to hand a bucket over sums it, in replica
// order as the host reduction does, into every owner's shard.
std::unique_ptr<Reducer> make_host_stage2_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                                  std::vector<SampleRange> shards, GradSlots slots);

// ZeRO stage 2: buckets of whole parameters (a gradient lies in one slot), from the end of
// the buffer, each at most bucket_bytes (the first at most first_bytes, if less) unless one
// parameter alone is larger; a bucket runs from its first parameter's start to its last
// one's end. The padding between buckets is in none: its gradient, zero, is never reduced
// (the shards' sums start at zero).
std::vector<Bucket> make_param_buckets(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                                       double bucket_bytes, double first_bytes);

// Splits a flat buffer of `total` floats into buckets of at most bucket_bytes (rounded
// to 64 floats), in the order backward produces them: from the end of the buffer, where
// the last layer's parameters lie. The first is at most first_bytes (if less), so that
// communication starts as soon as the last layer's gradients are made, as PyTorch DDP's
// 1 MiB first bucket. A large parameter spans several buckets, so the p2p staging bucket
// is exactly the configured size.
std::vector<Bucket> make_buckets(int64_t total, double bucket_bytes, double first_bytes);

// p2p's copy of the updated parameters to the other replicas, in forward order: the flat
// buffer [0, total) cut at the ends of children's parameters (child_end[c], -1 for a child
// without any), each chunk at least min_floats but the last, which runs to `total`.
// chunk_of[c] is the chunk that child c's last parameter is in (-1 for none): once it is
// copied, so are the child's parameters, the chunks being copied in order.
std::vector<Bucket> make_copy_chunks(const std::vector<int64_t>& child_end, int64_t total, int64_t min_floats,
                                     std::vector<int>& chunk_of);

// ZeRO, after the parameters' gather: the bf16 shadow of every shard but `own` from the
// gathered masters. The optimizer refreshed its own shard's in its update (one cast of
// the whole buffer instead would cost a pass over it a step on one device).
void refresh_shadow_of_others(const ReplicaBuffers& r, const std::vector<SampleRange>& shards, size_t own);

// For dpbench --comm: ms of f() (which waits for its work), the median of `iters` timed
// calls after one untimed (the first use of communicators and buffers).
double median_ms_of(int iters, const std::function<void()>& f);

}  // namespace dpt
