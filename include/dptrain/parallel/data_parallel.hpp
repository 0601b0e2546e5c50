// DataParallel: what torch.nn.DataParallel does, done right. A replica of the model on
// every device (made once, weights copied from the master = the first device), a
// persistent worker thread and a stream per replica. Each step splits the global batch
// into contiguous shards whose sizes differ by at most one, runs forward, loss and
// backward on every replica at once, reduces the gradients (each weighted by its shard's
// share of the batch, so the result is exactly the full-batch gradient) and updates.
// Buffers (batch norm's running statistics) are updated by each replica from its own
// shard, then the master's are copied to the others after every step.
// Outputs are never gathered: each replica computes its loss on its own shard and only
// scalars travel, when the caller reads them.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <dptrain/data/batch.hpp>
#include <dptrain/enum_names.hpp>
#include <dptrain/layers/module.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/options.hpp>
#include <dptrain/parallel/process_group.hpp>
#include <dptrain/parallel/shard_plan.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/ops.hpp>

namespace dpt {

// True when this build has NCCL (the nccl reduction and --ddp on GPUs).
bool built_with_nccl();

// Bare NCCL over `devices` (distinct GPUs, a communicator each from ncclCommInitAll), for
// dpbench --comm beside the reducers: ms for an all-reduce of `floats` fp32 values, a
// reduce-scatter of them and an all-gather into them (floats rounded down to a multiple
// of the device count), each the median of `iters` after one untimed. UsageError without
// NCCL or with other devices.
struct BareNcclTimes {
  double all_reduce_ms = 0, reduce_scatter_ms = 0, all_gather_ms = 0;
};
BareNcclTimes time_bare_nccl(const std::vector<Device>& devices, int64_t floats, int iters);

// The most thread blocks DataParallelOptions::comm_ctas may give NCCL (its MAXCHANNELS).
constexpr int kMaxCommCtas = 64;

enum class Reduce { automatic, nccl, p2p, host };
inline constexpr auto kReduceNames = enum_names<Reduce>(
    "reduction", {{Reduce::automatic, "auto"}, {Reduce::nccl, "nccl"}, {Reduce::p2p, "p2p"}, {Reduce::host, "host"}});
const char* reduce_name(Reduce r);
Reduce parse_reduce(const std::string& name);  // auto|nccl|p2p|host; UsageError otherwise
// What `automatic` means for these devices: host on CPUs, p2p when a GPU is listed more
// than once, else nccl (p2p when the build has no NCCL). Throws UsageError for a path
// that cannot serve them (nccl on CPUs or on a shared GPU, host on GPUs).
Reduce resolve_reduce(Reduce asked, const std::vector<Device>& devices);

// Whether the optimizers keep twin buffers (Optimizer::set_twin_buffers): automatic on
// GPUs for models of kTwinsFromParams up to kTwinsBelowParams parameters
// (twins_by_default), where the update then reads the gradients once instead of twice a step.
enum class TwinBuffers { automatic, on, off };
inline constexpr auto kTwinBufferNames = enum_names<TwinBuffers>(
    "twin-buffer setting", {{TwinBuffers::automatic, "auto"}, {TwinBuffers::on, "on"}, {TwinBuffers::off, "off"}});
// The types gradients may travel in (DataParallelOptions::grad_comm), as a user names them.
inline constexpr auto kGradCommNames =
    enum_names<DType>("gradient type", {{DType::f32, "fp32"}, {DType::bf16, "bf16"}});
// Where TwinBuffers::automatic turns twins on (GPUs; elements of the flat parameter buffer,
// from about 2.1M to below about 67M): below, one copy is faster; above, the pass the twins
// save is a sliver of the step (GPT-2 124M: none measured) and their copy costs memory
// that a larger batch wants (GPT-2: 1.4 GiB of 9.6 at batch 16).
constexpr int64_t kTwinsFromParams = int64_t{1} << 21;
constexpr int64_t kTwinsBelowParams = int64_t{1} << 26;
constexpr bool twins_by_default(int64_t params) { return params >= kTwinsFromParams && params < kTwinsBelowParams; }

struct DataParallelOptions {
  Reduce reduce = Reduce::automatic;
  double bucket_mb = 25.0;  // gradient bucket size (MiB), reduced as soon as it is ready
  // The first bucket's size (MiB) when smaller: the last layer's gradients, which backward
  // makes first, go out at once (PyTorch DDP's first bucket is 1 MiB too). Not under ZeRO
  // stage 2, whose two slots take the largest bucket's size each.
  double first_bucket_mb = 1.0;
  // NCCL: at most this many thread blocks (CTAs) a collective, so that the reduction beside
  // backward takes fewer SMs from its GEMMs; 0 leaves it to NCCL (and NCCL_MAX_CTAS).
  int comm_ctas = 0;
  // Each bucket's parameters are updated as soon as its reduction is done (on a stream of
  // their own, beside the later buckets' reductions and backward) instead of after the last
  // one. Only where no step-wide decision comes first: refused with clip and check_finite
  // (a norm over every bucket), and with ZeRO.
  bool update_per_bucket = false;
  // Tries bucket sizes of 1, 4, 16, bucket_mb and 64 MiB (those that give other buckets)
  // over the first steps, five steps each, and keeps the fastest (rank 0's choice); each
  // try's start and end wait for the device. The host and p2p sums (and NCCL's between two
  // GPUs) do not depend on the buckets; NCCL between more GPUs and MPI may add in another
  // order where the buckets change, so two tuned runs there can differ in the last bits.
  // Not with zero 2 or cuda_graph.
  bool tune_buckets = false;
  // The GEMMs' precision; bf16 also makes the model compute and store activations in bf16
  // from bf16 copies of its fp32 weights (Module::set_compute_dtype).
  Precision precision = Precision::fp32;
  GemmImpl gemm = GemmImpl::cublas;
  float clip = 0.0f;   // clip the global gradient norm (after reduction); 0 = off
  int grad_accum = 1;  // micro-batches per step (1 to kMaxGradAccum); only the last one communicates
  // Reduce buckets during backward, and (p2p) copy the parameters to the replicas layer by
  // layer beside their next forward; false: all after backward, and the copy whole after
  // the update (to measure the gain).
  bool overlap = true;
  // Computes the gradient norm every step: a non-finite one makes the optimizer skip the
  // update (on the device), and set_check_ring's ring tells the caller, later.
  bool check_finite = false;
  // With check_finite and no clip (no ZeRO, no update_per_bucket): a second copy of the
  // parameters and optimizer state that the update writes in turn, so that it checks the
  // gradients in its own pass over them (the mlp workload: 47 us a step of 1.7 ms on an
  // H200) for one more copy of the parameters and state in memory. automatic: on GPUs,
  // for models of kTwinsFromParams up to kTwinsBelowParams parameters (twins_by_default).
  TwinBuffers twin_buffers = TwinBuffers::automatic;
  // ZeRO stage: 0 off; 1 partitions the optimizer state over the replicas or ranks (each
  // updates its contiguous partition of the flat buffer, zero_partitions', from the summed
  // gradient of that partition, and then every replica gets every partition's parameters);
  // 2 also keeps only the partition of the summed gradients (a bucket is reduced into its
  // owners as backward makes it, out of one of two bucket-sized slots). NCCL, host and MPI
  // reductions; not p2p, and stage 2 not in a CUDA graph.
  int zero = 0;
  // The type gradients travel in between devices: f32, or bf16 (as DDP's bf16 compression
  // hook). With bf16 a replica's gradients are rounded to bf16 before they leave its
  // device: NCCL reduces bf16 buckets (all-reduce, or ZeRO's reduce) and each replica
  // widens the result to fp32; p2p and host add the other replicas' bf16 gradients into
  // the master's fp32 sum (host then hands every replica the sum rounded to bf16). One
  // device communicates nothing and is unchanged. Not with the MPI reduction (CPU ranks).
  DType grad_comm = DType::f32;
  // Records the whole step (every replica's forward and backward of every micro-batch on
  // its own stream, the reduction, the updates) as one CUDA graph and replays it: GPUs in
  // one process; recorded once for each parity of the step counter (the optimizers
  // compute what changes from step to step on the device; the second recording takes the
  // first's temporaries). Each replica's shard goes into fixed buffers that the replay
  // reads (train_step's next_first and next_step_inputs say how it gets there).
  bool cuda_graph = false;
  // Several processes (DDP): this process trains its rank's part of every batch on its
  // one device, and gradients are summed over every rank (NCCL on GPUs, MPI on CPUs).
  // An exception from a step is this rank's alone. A rank whose source throws in an eager
  // step still takes part in its collectives and applies no update, while the others
  // apply theirs; as a CUDA graph it does not replay, and the others wait in the step's
  // collectives until the group's timeout. A program that catches it must end the job
  // (ProcessGroup::abort), not step again: the ranks' parameters differ from then on.
  ProcessGroup* group = nullptr;
};

// DataParallelOptions' fields (parallel/options_schema.cpp): the checks of each field's own
// range, the help a program shows, which ones every rank of a job shares and which a
// checkpoint records. TrainConfig's schema holds them (TrainConfig::parallel).
const OptionSchema<DataParallelOptions>& data_parallel_schema();
// Every check of `options` for these devices that DataParallel's constructor makes
// (UsageError naming the field), for a program to call before it builds a model.
void check_options(const DataParallelOptions& options, const std::vector<Device>& devices);

using OptimizerFactory = std::function<std::unique_ptr<optim::Optimizer>(nn::Module&)>;
using LossFn = std::function<Tensor(const Tensor& output, const Tensor& target)>;
// Makes samples [first, first + count) on replica r's device; the tensors must stay valid
// for the work queued before its next call (with a CUDA graph and train_step's
// next_first, a step also asks for the next step's samples, which its own replay copies).
using ShardSource = std::function<data::Batch(size_t replica, int64_t first, int64_t count)>;

// The loss of one step: per-replica device scalars, weighted by shard share. Reading
// value() waits for the step; nothing else in a step does. When the step was asked for a
// metric (a per-shard mean such as accuracy), metric() is its weighted mean the same way.
class DataParallel;
struct StepLoss {
  std::vector<Tensor> losses;
  std::vector<Tensor> metrics;  // empty when no metric was asked for
  std::vector<double> weights;
  ProcessGroup* group = nullptr;  // when set, value() and metric() sum over every rank (collective)
  // The DataParallel that made it: value() waits for its replicas' streams first, and
  // throws UsageError once that DataParallel is gone (read a loss before destroying it).
  std::weak_ptr<DataParallel* const> owner;
  float value() const;
  float metric() const;  // NaN when no metric was asked for

 private:
  double weighted_sum(const std::vector<Tensor>& values, const char* what) const;
};

// What one replica holds of the model's training state, in bytes: the fp32 parameters
// (and their bf16 copy under bf16 compute), the gradients, the optimizer's state, and the
// second copies of the parameters and state (twin buffers; 0 without).
struct ModelStateBytes {
  Device device;
  int64_t parameters = 0, gradients = 0, optimizer = 0, twins = 0;
};

// Wall time of one step's phases on the master, in ms (CUDA events on a GPU).
struct StepTimes {
  double compute = 0, reduce = 0, update = 0;
};

class DataParallel {
 public:
  // `model` must already be on devices[0]; the replicas are copies of it.
  DataParallel(std::shared_ptr<nn::Module> model, std::vector<Device> devices, const OptimizerFactory& make_optimizer,
               DataParallelOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // How a batch of `batch` samples is shared out over the ranks, replicas and micro-batches
  // (made once per batch size; train_step uses the same).
  const ShardPlan& plan(int64_t batch);

  // One step on samples [first, first + count), each replica making its own shard.
  // `metric` (may be empty) is computed from each shard's output and targets, without a
  // gradient; with a CUDA graph it is part of the recording, so pass it every step or never.
  // `timed`: the master records its phases for last_times() (four events; a loop that
  // reads them only now and then times only those steps).
  // `next_first`: the first sample of the step that will follow, from the same source and
  // batch size, where the caller knows it (-1: not known). A CUDA graph's replay then copies
  // that step's shards into its inputs once its backward is done, beside its update,
  // instead of before the next replay's first kernel; a step whose shards it did not copy
  // (or with micro-batches, which are copied as they come) copies them before its replay.
  // With a CUDA graph the returned losses hold until the next train_step: the replays of
  // the other recording use their memory.
  // A step whose source, forward or backward throws on some replica (a bad row, out of
  // memory) updates nothing and throws the first such replica's error, after every replica
  // took part in its reduction (none waits for another forever); the next step trains as if
  // it had not been. Should the reduction itself fail on a replica, a reduction between GPUs
  // (NCCL) is cancelled, and this DataParallel throws on every later step.
  StepLoss train_step(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss,
                      const LossFn& metric = {}, bool timed = true, int64_t next_first = -1);
  // With a CUDA graph, while train_step (with next_first -1 and one micro-batch, the graph
  // recorded or about to be) asks `source` for a step's shard of replica r: the fixed
  // buffers that the next step's replay reads that replica's shard from, else an empty
  // batch. A source may make the next step's shard straight into them, on any stream once
  // the work queued so far on the replica's stream is done, and return them (the same
  // tensors, or views of all of them) when that step asks, having made the step's stream
  // wait for the making: no copy moves that shard then.
  data::Batch next_step_inputs(size_t replica) const;
  // One step on a batch held anywhere (host or a device): shards are copied to their
  // replicas asynchronously.
  StepLoss train_step(const data::Batch& batch, const LossFn& loss, const LossFn& metric = {});

  // Forward only, without gradients and in evaluation mode (batch norm's running
  // statistics), on every replica at once: each makes its shard of samples [first, first +
  // count) (split as a step splits it) and computes `loss` and, when given, `metric` from
  // its output. Nothing is updated. With several processes every rank evaluates its part.
  StepLoss evaluate(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss,
                    const LossFn& metric = {});
  // The same, handing each replica's output to `take` on that replica's thread (samples
  // [first + part.first, ...) of the batch; for predictions).
  using OutputFn = std::function<void(size_t replica, SampleRange part, const Tensor& output)>;
  void infer(int64_t first, int64_t count, const ShardSource& source, const OutputFn& take);

  size_t size() const;
  nn::Module& replica(size_t i);
  const Device& device(size_t i) const;
  optim::Optimizer& optimizer();  // the master's
  // Every optimizer there is: one per replica, or the master's alone on the p2p path.
  std::vector<optim::Optimizer*> optimizers();
  // The optimizer's state as the whole flat buffers on the master, whatever the partitioning
  // (ZeRO gathers each replica's partition into them): what a checkpoint saves.
  std::vector<std::pair<std::string, Tensor>> optimizer_state();
  // Every replica's share of the training state (ZeRO: the optimizer's is its partition).
  std::vector<ModelStateBytes> model_state_bytes();
  // ZeRO's partitions of the flat buffers, one a replica or rank (empty without ZeRO).
  const std::vector<SampleRange>& zero_partitions() const;
  const std::vector<SampleRange>& zero_shards() const { return zero_partitions(); }  // the former name
  Reduce reduce() const;
  size_t buckets() const;       // how many pieces the gradient buffer is reduced in (0: no reduction)
  double bucket_mb() const;     // their size (the first's aside): as asked, or as tuned
  bool tuning_buckets() const;  // DataParallelOptions::tune_buckets has not chosen yet
  // The phases of the last timed step (waits for it).
  StepTimes last_times();
  // The gradient reduction alone, without forward or backward (for dpbench --comm): every
  // bucket handed over at once, as when backward ends, and waited for. `reduce_ms`: a
  // reduction; `after_ms`: what follows it on this path (ZeRO's gather of the parameters,
  // p2p's copy of them back; 0 otherwise); each the median of `iters` after one untimed.
  // The gradients are left summed (zeros stay zeros). Needs a reduction (several devices).
  struct ReductionTimes {
    double reduce_ms = 0, after_ms = 0;
  };
  ReductionTimes time_reduction(int iters);
  // Where the master records every step's gradient check (ops' check_gradients: the scale,
  // NaN when the gradients were not finite and the update was skipped, and the first
  // non-finite gradient's flat index), for the caller to read steps later without waiting;
  // an empty ring records nothing. With ZeRO the index is the first over every partition (on
  // every rank: give each rank a ring). A recorded CUDA graph is recorded again.
  void set_check_ring(const CheckRing& ring);
  // Whether every replica holds bitwise the master's parameters, bf16 shadow and buffers
  // (waits; for tests).
  bool replicas_identical();
  // Waits for every replica's queued work.
  void synchronize();
  // Whether every replica's queued work is done (without waiting).
  bool idle();

 private:
  // Its state and the steps' pieces (parallel/data_parallel_impl.hpp). Not movable: the
  // losses it hands out and its worker threads refer to this object.
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dpt
