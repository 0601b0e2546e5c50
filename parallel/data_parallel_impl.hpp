// DataParallel's state, private to parallel/. Its pieces live in files named for them:
//   data_parallel.cpp  the public class over Impl; building the replicas, their
//                      optimizers and the reduction; what it answers about its state
//   options.cpp        every check of DataParallelOptions
//   make_reducer.cpp   the choice of reduction and making it
//   step.cpp           the eager step (forward, backward, reduction, update), evaluation
//   graph_step.cpp     the step recorded as a CUDA graph and replayed
//   bucket_tuning.cpp  the buckets' layout and DataParallelOptions::tune_buckets
//   p2p_chunks.cpp     p2p's copies of the parameters, per layer or per bucket
// The members are declared in the order they must be destroyed in reverse: the worker
// threads first, then the recorded graphs, the reducer (its streams), the replicas.
#pragma once
#include <array>
#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include <dptrain/parallel/data_parallel.hpp>
#include "buckets.hpp"
#include "common/worker_pool.hpp"
#include "reducer.hpp"

namespace dpt {

// Every check of DataParallelOptions that the fields alone decide (their ranges and the
// combinations refused); UsageError names the field.
void check(const DataParallelOptions& options);
// Those that depend on the devices as well; returns the reduction the options choose for
// them (DataParallel::reduce()).
Reduce check_fit(const DataParallelOptions& options, const std::vector<Device>& devices);
// Whether these options over these devices reduce at all (one device and the automatic
// path, without ZeRO or ranks, does not).
bool reduces(const DataParallelOptions& options, const std::vector<Device>& devices);

// The reduction `path` (check_fit's) over `replicas` (one across ranks), in `buckets`;
// `partitions` for ZeRO, `slots` for its stage 2.
std::unique_ptr<Reducer> make_reducer(const DataParallelOptions& options, Reduce path,
                                      std::vector<ReplicaBuffers> replicas, const std::vector<Bucket>& buckets,
                                      const std::vector<SampleRange>& partitions, GradSlots slots = {});

// A batch shard from the program's source, holding the rows asked for (UsageError
// otherwise: a source that gives more or fewer would be weighted by the plan's share all
// the same).
data::Batch take_shard(const ShardSource& source, size_t r, int64_t first, int64_t count);
// The first replica's error (what its source threw, as it threw it, or its step's).
void rethrow_first(const std::vector<std::exception_ptr>& errors);

struct DataParallel::Impl {
  Impl(DataParallel& owner, std::shared_ptr<nn::Module> model, std::vector<Device> devices,
       const OptimizerFactory& make_optimizer, const DataParallelOptions& options);
  ~Impl();

  struct Replica {
    Device device;
    std::unique_ptr<Context> own_ctx;  // several replicas: a stream each
    Context* ctx = nullptr;
    std::shared_ptr<nn::Module> model;
    std::unique_ptr<optim::Optimizer> opt;  // null where the master updates alone
    std::vector<nn::Parameter*> params;     // its model's, made once
    // A parameter's byte offset in the flat buffer -> its index. Offsets, not addresses: the
    // buffer's memory alternates between two copies with twin buffers.
    std::unordered_map<uintptr_t, int> param_index;
    int param_of(const Tensor& leaf) const;  // -1: not one of the model's parameters
    std::vector<int> pending;                // per bucket: parameters still to come
    size_t next_bucket = 0;                  // buckets are handed over in order
    size_t acquired = 0;                     // stage 2: buckets whose slot this replica took in order
    std::vector<char> holds_slot;            // stage 2, per bucket: this replica holds its slot
    std::unique_ptr<Event> t_start, t_backward, t_reduced, t_updated;
    std::unique_ptr<Event> buffers_copied;                 // the master's buffers reached this replica
    std::string nvtx_forward, nvtx_backward, nvtx_update;  // "forward cuda:1", made once
    Tensor scale;                                          // the last step's gradient scale
    Tensor grad_partition;                                 // ZeRO stage 2: the sum of its partition's gradients
    // Per-bucket updates: the stream they run on, an event a bucket (its sum is queued), and
    // the last one's end, which the replica's next work waits for.
    std::unique_ptr<Context> update_ctx;
    std::vector<std::unique_ptr<Event>> bucket_summed;
    std::unique_ptr<Event> parts_updated;
    void wait_for_updates();  // its compute stream's later work comes after the update stream's
    // Elements [offset, offset + count) of the master's parameters into its own, and its
    // bf16 shadow (on the current stream).
    void copy_params_from(const nn::Module& master, int64_t offset, int64_t count);
    // p2p, chunked copies of the parameters (on update_ctx): an event a chunk, and how many
    // chunks its compute stream has waited for since they were queued; `computed` is its
    // step's end, which the copies wait for (its backward still reads the old parameters).
    std::vector<std::unique_ptr<Event>> chunk_copied;
    size_t chunks_waited = 0;
    std::unique_ptr<Event> computed;
    void wait_for_chunk(size_t j);  // and those before it
    void wait_for_copies() {
      if (!chunk_copied.empty()) wait_for_chunk(chunk_copied.size() - 1);
    }
  };

  // ---- Construction (data_parallel.cpp) ----
  void make_replicas(const std::shared_ptr<nn::Module>& model, const DataParallelOptions& options);
  void start_from_rank0(nn::Module& model);  // every rank takes rank 0's parameters
  void set_up_reduction(nn::Module& model, const DataParallelOptions& options);
  void make_stage2_reducer(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                           const DataParallelOptions& options);
  void make_optimizers(const OptimizerFactory& make_optimizer);
  // Stochastic rounding of the bf16 shadow (Optimizer::set_bf16_rounding) needs every
  // replica to update its own: UsageError where only the master does (p2p).
  void check_rounding() const;
  void use_twin_buffers(const DataParallelOptions& options);
  void set_up_per_bucket_updates();
  void set_up_tuning(const DataParallelOptions& options);

  // ---- What the public class answers (data_parallel.cpp) ----
  const ShardPlan& plan(int64_t batch);
  std::vector<optim::Optimizer*> optimizers();
  std::vector<std::pair<std::string, Tensor>> optimizer_state();
  std::vector<ModelStateBytes> model_state_bytes();
  StepTimes last_times();
  ReductionTimes time_reduction(int iters);
  void set_check_ring(const CheckRing& ring);
  bool replicas_identical();
  void synchronize();
  bool idle();
  const SampleRange& partition_of(size_t replica) const;

  // ---- The eager step (step.cpp) ----
  StepLoss train_step(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss, const LossFn& metric,
                      bool timed, int64_t next_first);
  StepLoss train_step(const data::Batch& batch, const LossFn& loss, const LossFn& metric);
  StepLoss evaluate(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss, const LossFn& metric);
  void infer(int64_t first, int64_t count, const ShardSource& source, const OutputFn& take);
  void run_on_all(const std::function<void(size_t)>& fn);
  // What replica i's error is reported as: the library's errors name their replica and
  // device, a failed host allocation is an out-of-memory error.
  std::exception_ptr replica_error(size_t i, std::exception_ptr e) const;
  // The step after the plan and the checks: the eager step, and what a graph records.
  StepLoss step_body(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss, const LossFn& metric);
  // Returns the error of its forward or backward (out of memory), once it has handed every
  // bucket over all the same (null when none).
  std::exception_ptr forward_backward(size_t r, const data::Batch& shard, double weight, const LossFn& loss,
                                      Tensor& loss_out, const LossFn& metric, Tensor& metric_out, bool first_micro,
                                      bool last_micro);
  // ZeRO: the partitions' sums waited for, and (clip, check_finite) their norm's parts summed.
  void check_partitions();
  // ZeRO: every partition's updated parameters to every replica and their bf16 shadow, as
  // the owners' updates rounded it.
  void gather_params(ZeroReducer& zero);
  void update(size_t r);
  // Copies the master's buffers (batch norm's running statistics, which each replica
  // updated from its own shard) to every replica, or rank 0's to every rank, as
  // nn.DataParallel and DDP do, so the replicas stay identical.
  void broadcast_buffers();

  // ---- Buckets (bucket_tuning.cpp) ----
  // The buckets of this size (and the first's, first_bucket_mb_), each parameter's, and
  // the per-bucket updates' events.
  void assign_buckets(double bucket_mb);
  std::vector<Bucket> buckets_of_size(double bucket_mb) const;  // the layout alone
  void before_tuned_step();
  void after_tuned_step();

  // ---- p2p's copies of the parameters (p2p_chunks.cpp) ----
  void plan_param_chunks(nn::Module& model);
  void copy_params_in_chunks();
  // Per-bucket updates: replica r's update of bucket b, once its sum is queued on `where`.
  void update_bucket(size_t r, size_t b, Context& where);

  // ---- The CUDA-graph step (graph_step.cpp) ----
  StepLoss graph_step(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss, const LossFn& metric,
                      int64_t next_first);
  struct GraphInputs;
  // Asks the source for every replica's shard (and the next step's) into the fixed buffers.
  void take_graph_inputs(GraphInputs& in, int64_t first, int64_t count, const ShardSource& source, int64_t next_first);
  // Replica r's part of it; false when the source threw (kept in source_error).
  bool take_replica_inputs(GraphInputs& in, size_t r, int64_t first, const ShardPlan& shares, const ShardSource& source,
                           int64_t next_first, std::exception_ptr& source_error);
  // The graph's copy of replica r's next shard into the other recording's buffers.
  std::vector<std::pair<Tensor, Tensor>> graph_copies(const GraphInputs& in, size_t r) const;
  void record_graph(const GraphInputs& in, int64_t first, int64_t count, const ShardSource& fixed, const LossFn& loss,
                    const LossFn& metric);
  void replay_graph(const GraphInputs& in);
  int graph_parity() const;  // the recording that the next step replays
  void drop_graphs();        // recorded anew, after an eager step
  data::Batch next_step_inputs(size_t replica) const;

  bool per_bucket_ = false;
  // A replica's source or step failed: the per-bucket updates are skipped, as the update
  // of an abandoned step is (a source's failure is known before any replica hands a bucket over).
  std::atomic<bool> step_failed_{false};
  // Per replica, what ended the step there: its source's error, or its forward's or
  // backward's (after which it still took part in the step's collectives); kept to spare
  // an allocation a step.
  std::vector<std::exception_ptr> replica_error_;
  // The reduction's collectives were cancelled after a step failed on some replicas
  // (Reducer::abandon_if_unmatched), for this reason: no step runs after it.
  bool abandoned_ = false;
  std::string abandoned_why_;
  void abandon_unmatched_collectives(const std::exception_ptr& why);
  void refuse_if_abandoned(const char* what) const;
  Tensor buffers_before_step_;  // the master's buffers as an eager step began (restored if its sources fail)
  std::shared_ptr<DataParallel* const> self_;  // for StepLoss::owner
  double bucket_mb_ = 0, first_bucket_mb_ = 0;
  struct BucketTuning {
    std::vector<double> sizes_mb;  // to try, in order
    std::vector<double> ms;        // each one's time a step, so far
    size_t at = 0;                 // the one being tried
    int64_t steps = 0;             // steps since tuning began
    std::chrono::steady_clock::time_point start;
  };
  std::unique_ptr<BucketTuning> tuning_;
  // p2p: the other replicas copy the master's updated parameters chunk by chunk (a layer or
  // more a chunk, first layers first) on their update streams, and their next forward
  // waits for each layer's chunk just before the layer runs (make_copy_chunks), so the
  // copy hides behind the first layers' forward. Eager steps of a Sequential model only
  // (param_chunks_ empty otherwise: the reducer copies them whole).
  std::vector<nn::CopyChunk> param_chunks_;
  std::vector<int> chunk_of_child_;        // the chunk a child's last parameter is in, -1 for none
  std::unique_ptr<Event> params_updated_;  // the master's update is queued

  std::vector<Device> devices_;
  Reduce reduce_;
  std::vector<Replica> replicas_;
  std::vector<Bucket> buckets_;
  std::vector<std::vector<int>> buckets_of_param_;  // parameter index -> the buckets it overlaps
  std::unique_ptr<Reducer> reducer_;
  std::unique_ptr<Event> buffers_ready_;  // the master's buffers are written for this step
  float clip_ = 0.0f;
  int grad_accum_ = 1;
  bool overlap_ = true;
  bool check_finite_ = false;
  std::vector<SampleRange> partitions_;  // ZeRO: replica r's partition of the flat buffers
  int zero_ = 0;                         // the ZeRO stage
  SlotLayout slots_;                     // stage 2: the buckets' gradient slots
  std::vector<Tensor> partial_;          // ZeRO: replica r's part of the squared gradient norm
  std::vector<Tensor> first_bad_;        // and of the first non-finite gradient's index (int64)
  CheckRing ring_;                       // where the master records its gradient checks
  // CUDA-graph mode: two recordings of the step, one for each parity of the optimizers'
  // step counter (with twin buffers each reads and writes the copies of its parity; the
  // second takes the first's temporaries, as they never run at once), each reading the
  // replicas' shards from fixed buffers of its own. So the next step's shards can go into
  // the other recording's buffers while one replays: copied there by a copy recorded in
  // the graph whose sources each replay moves (after backward, beside the update), or
  // made there by the source itself (next_step_inputs).
  struct Recording {
    std::unique_ptr<Graph> graph;
    std::vector<data::Batch> in;  // replica r's fixed shard
    std::vector<size_t> copy;     // replica r's copy into the other recording's `in` (empty: none recorded)
    StepLoss out;                 // the recorded step's losses, written by every replay
  };
  std::array<Recording, 2> rec_;
  bool use_graph_ = false;
  bool graph_warm_ = false;
  bool recording_ = false;  // timing events (and waits on events from before) stay out of a graph
  std::vector<std::unique_ptr<Context>> graph_copy_ctx_;  // replica r's stream for the copy, beside the update
  SampleRange graph_next_;     // the step whose shards the last replay copied in (count 0: none)
  int graph_next_parity_ = 0;  // into which recording's buffers
  const std::vector<data::Batch>* offered_ = nullptr;       // next_step_inputs' buffers, while the source is asked
  std::function<void(size_t)> after_backward_;              // recording: replica r's backward is queued
  std::vector<std::unique_ptr<Event>> graph_inputs_ready_;  // replica r's shard is there
  std::unique_ptr<Event> graph_done_;                       // the last replay has read the inputs
  bool timing_ = true;                                      // this step records the master's phases
  ProcessGroup* group_ = nullptr;
  ShardPlan plan_;  // of the last batch size
  bool warned_small_batch_ = false;
  std::unique_ptr<WorkerPool> pool_;  // a thread per replica when there are several
};

}  // namespace dpt
