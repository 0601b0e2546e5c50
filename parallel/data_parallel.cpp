#include <dptrain/parallel/data_parallel.hpp>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <unordered_map>

#include <dptrain/error.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>
#include "common/worker_pool.hpp"
#include "kernels/hd.hpp"
#include "reducer.hpp"
#include "runtime/nvtx.hpp"

namespace dpt {

const char* reduce_name(Reduce r) {
  switch (r) {
    case Reduce::nccl:
      return "nccl";
    case Reduce::p2p:
      return "p2p";
    case Reduce::host:
      return "host";
    case Reduce::automatic:
      break;
  }
  return "auto";
}

Reduce parse_reduce(const std::string& name) {
  for (Reduce r : {Reduce::automatic, Reduce::nccl, Reduce::p2p, Reduce::host})
    if (name == reduce_name(r)) return r;
  throw UsageError("unknown reduction '" + name + "': expected auto, nccl, p2p or host");
}

Reduce resolve_reduce(Reduce asked, const std::vector<Device>& devices) {
  DPT_CHECK(!devices.empty(), "no devices");
  const bool cpu = devices.front().is_cpu();
  std::set<int> distinct;
  for (const Device& d : devices) distinct.insert(d.index);
  const bool shared = distinct.size() < devices.size();
  switch (asked) {
    case Reduce::automatic:
      if (cpu) return Reduce::host;
      return shared || !built_with_nccl() ? Reduce::p2p : Reduce::nccl;
    case Reduce::nccl:
      if (cpu) throw UsageError("DataParallelOptions::reduce nccl needs CUDA devices; use host on CPU devices");
      if (shared)
        throw UsageError(
            "DataParallelOptions::reduce nccl cannot put two replicas on one GPU (NCCL refuses two "
            "ranks on one device); use p2p");
      if (!built_with_nccl()) throw UsageError("DataParallelOptions::reduce nccl needs a build with NCCL; use p2p");
      return asked;
    case Reduce::host:
      if (!cpu) throw UsageError("DataParallelOptions::reduce host is for CPU devices; use nccl or p2p on GPUs");
      return asked;
    case Reduce::p2p:
      return asked;
  }
  return asked;
}

namespace {
// What the program's source threw, the first replica's, as it threw it (run_on_all adds
// the replica to what the library throws; a data set's own exception is the program's to
// catch, in training, evaluation and inference alike).
void rethrow_source_error(const std::vector<std::exception_ptr>& errors) {
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

// A shard from the program's source, holding the rows asked for (a source that gives more
// or fewer would be weighted by the plan's share all the same).
data::Batch take_shard(const ShardSource& source, size_t r, int64_t first, int64_t count) {
  if (!source) throw UsageError("DataParallel: an empty ShardSource");
  data::Batch b = source(r, first, count);
  const auto rows = [](const Tensor& t) { return t.defined() && t.dim() >= 1 ? t.size(0) : -1; };
  if (rows(b.x) != count || (b.y.defined() && rows(b.y) != count))
    throw UsageError("the ShardSource gave replica " + std::to_string(r) + " inputs " +
                     (b.x.defined() ? shape_str(b.x.shape()) : std::string("(none)")) + " and targets " +
                     (b.y.defined() ? shape_str(b.y.shape()) : std::string("(none)")) + " for " +
                     std::to_string(count) + " rows from sample " + std::to_string(first));
  return b;
}
}  // namespace

double StepLoss::weighted_sum(const std::vector<Tensor>& values, const char* what) const {
  if (values.size() != weights.size())
    throw UsageError(std::string("StepLoss: ") + std::to_string(values.size()) + " " + what + " and " +
                     std::to_string(weights.size()) + " weights");
  // The values were written on the replicas' streams; reading them from another thread's
  // stream must wait for those first.
  const bool never_owned = !owner.owner_before(std::weak_ptr<DataParallel* const>{}) &&
                           !std::weak_ptr<DataParallel* const>{}.owner_before(owner);
  if (!never_owned) {
    const auto dp = owner.lock();
    if (!dp) throw UsageError("StepLoss: the DataParallel that made it is gone (read a loss before destroying it)");
    (*dp)->synchronize();
  }
  double v = 0.0;
  for (size_t i = 0; i < values.size(); ++i)
    if (values[i].defined()) v += weights[i] * values[i].item();
  return v;
}

float StepLoss::value() const {
  const double v = weighted_sum(losses, "losses");
  return static_cast<float>(group ? group->sum(v) : v);
}

float StepLoss::metric() const {
  if (metrics.empty()) return NAN;
  const double v = weighted_sum(metrics, "metrics");
  return static_cast<float>(group ? group->sum(v) : v);
}

// ---- Replicas -------------------------------------------------------------------------

struct DataParallel::Replica {
  Device device;
  std::unique_ptr<Context> own_ctx;  // several replicas: a stream each
  Context* ctx = nullptr;
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::Optimizer> opt;  // null where the master updates alone
  std::vector<nn::Parameter*> params;     // its model's, made once
  // A parameter's byte offset in the flat buffer -> its index. Offsets, not addresses: the
  // buffer's memory alternates between two copies with twin buffers.
  std::unordered_map<uintptr_t, int> param_index;
  int param_of(const Tensor& leaf) const {  // -1: not one of the model's parameters
    const auto at = reinterpret_cast<uintptr_t>(leaf.data()) - reinterpret_cast<uintptr_t>(model->flat_params().data());
    const auto it = param_index.find(at);
    return it == param_index.end() ? -1 : it->second;
  }
  std::vector<int> pending;  // per bucket: parameters still to come
  size_t next_bucket = 0;    // buckets are handed over in order
  size_t acquired = 0;       // stage 2: buckets whose slot this replica holds
  std::unique_ptr<Event> t_start, t_backward, t_reduced, t_updated;
  std::unique_ptr<Event> buffers_copied;                 // the master's buffers reached this replica
  std::string nvtx_forward, nvtx_backward, nvtx_update;  // "forward cuda:1", made once
  Tensor scale;                                          // the last step's gradient scale
  Tensor grad_shard;                                     // ZeRO stage 2: the sum of its shard's gradients
  // Per-bucket updates: the stream they run on, an event a bucket (its sum is queued), and
  // the last one's end, which the replica's next work waits for.
  std::unique_ptr<Context> update_ctx;
  std::vector<std::unique_ptr<Event>> bucket_summed;
  std::unique_ptr<Event> parts_updated;
  void wait_for_updates();  // its compute stream's later work comes after the update stream's
  // Range k of the master's parameters into its own, and its bf16 shadow (on the current stream).
  void copy_params_from(const nn::Module& master, const Bucket& k);
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

DataParallel::DataParallel(std::shared_ptr<nn::Module> model, std::vector<Device> devices,
                           const OptimizerFactory& make_optimizer, DataParallelOptions options)
    : devices_(std::move(devices)) {
  if (devices_.empty() || devices_.size() > kMaxDevices)
    throw UsageError("DataParallel: 1 to " + std::to_string(kMaxDevices) + " devices, got " +
                     std::to_string(devices_.size()));
  if (!make_optimizer) throw UsageError("DataParallel: an empty optimizer factory");
  // An enum cast from any integer ran as its first value (fp32, cublas) in silence.
  const auto enum_in = [](auto v, int last, const char* field) {
    const int i = static_cast<int>(v);
    if (i < 0 || i > last)
      throw UsageError(std::string("DataParallelOptions::") + field + " holds no value of its enum (" +
                       std::to_string(i) + ")");
  };
  enum_in(options.precision, static_cast<int>(Precision::bf16), "precision");
  enum_in(options.gemm, static_cast<int>(GemmImpl::native), "gemm");
  enum_in(options.reduce, static_cast<int>(Reduce::host), "reduce");
  enum_in(options.twin_buffers, static_cast<int>(TwinBuffers::off), "twin_buffers");
  if (model && model->in_data_parallel())
    throw UsageError("DataParallel: the model is trained by another DataParallel already (one at a time)");
  DPT_CHECK(model && model->materialized() && model->device() == devices_[0],
            "DataParallel: the model must be on the first device, " + devices_[0].str());
  for (const Device& d : devices_) check_device(d);
  if (options.grad_accum < 1)
    throw UsageError("DataParallelOptions::grad_accum must be >= 1, got " + std::to_string(options.grad_accum));
  group_ = options.group;
  if (group_ && devices_.size() != 1)
    throw UsageError("DataParallelOptions::group: each process trains on one device, got " +
                     std::to_string(devices_.size()));
  if (group_ && options.reduce == Reduce::p2p)
    throw UsageError(
        "DataParallelOptions::group reduces with NCCL (GPUs) or MPI (CPUs); DataParallelOptions::reduce "
        "p2p is for one process");
  reduce_ = group_ ? (devices_[0].is_cuda() ? Reduce::nccl : Reduce::host) : resolve_reduce(options.reduce, devices_);
  if (!(options.clip >= 0.0f && std::isfinite(options.clip)))  // NaN or below 0 was clipping off, in silence
    throw UsageError("DataParallelOptions::clip must be a finite number >= 0 (0 = off), got " +
                     std::to_string(options.clip));
  clip_ = options.clip;
  grad_accum_ = options.grad_accum;
  overlap_ = options.overlap;
  check_finite_ = options.check_finite;
  if (options.grad_comm != DType::f32 && options.grad_comm != DType::bf16)
    throw UsageError(std::string("DataParallelOptions::grad_comm must be f32 or bf16, got ") +
                     dtype_name(options.grad_comm));
  if (options.zero < 0 || options.zero > 2)
    throw UsageError("DataParallelOptions::zero must be 0, 1 or 2, got " + std::to_string(options.zero));
  zero_ = options.zero;
  if (options.comm_ctas < 0 || options.comm_ctas > kMaxCommCtas)
    throw UsageError("DataParallelOptions::comm_ctas must be in [0, " + std::to_string(kMaxCommCtas) + "], got " +
                     std::to_string(options.comm_ctas));
  // More than a TiB a bucket is no bucket at all (and its float count would not fit).
  for (auto [name, mb] :
       {std::pair<const char*, double>{"bucket_mb", options.bucket_mb}, {"first_bucket_mb", options.first_bucket_mb}})
    if (!(mb > 0.0) || mb > 1048576.0)
      throw UsageError(std::string("DataParallelOptions::") + name + " must be in (0, 1048576] MiB, got " +
                       format_float(static_cast<float>(mb)));
  if (options.update_per_bucket && (clip_ > 0.0f || check_finite_ || zero_ > 0))
    throw UsageError(
        "DataParallelOptions::update_per_bucket updates a bucket before the next is reduced: not with clip or "
        "check_finite (which need the norm over every bucket first), nor with zero");
  use_graph_ = options.cuda_graph;
  // Across processes (one GPU each, as NCCL supports in graphs) every rank records its
  // step, collectives included, and the replays meet in them.
  if (use_graph_ && !devices_[0].is_cuda())
    throw UsageError("DataParallelOptions::cuda_graph records steps on GPUs, not on " + devices_[0].str());
  enable_peer_access(devices_);
  // bf16 precision is bf16 storage: the model (and so every replica) computes in bf16 from
  // bf16 shadows of its fp32 master parameters.
  model->set_compute_dtype(options.precision == Precision::bf16 ? DType::bf16 : DType::f32);
  // The master's parameters and shadow were written on this thread's stream; the replicas'
  // streams (their own when there are several) read them from now on.
  context(devices_[0]).synchronize();
  const size_t n = devices_.size();
  replicas_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    Replica& r = replicas_[i];
    r.device = devices_[i];
    if (n == 1) {
      r.ctx = &context(r.device);
    } else {
      r.own_ctx = std::make_unique<Context>(r.device);
      r.ctx = r.own_ctx.get();
    }
    r.ctx->precision = options.precision;
    r.ctx->gemm = options.gemm;
    {
      ContextGuard g(*r.ctx);
      r.model = i == 0 ? model : model->replicate(r.device);  // made once, copied from the master
    }
    r.params = r.model->parameters();
    for (size_t k = 0; k < r.params.size(); ++k)
      r.param_index[reinterpret_cast<uintptr_t>(r.params[k]->value.data()) -
                    reinterpret_cast<uintptr_t>(r.model->flat_params().data())] = static_cast<int>(k);
    for (auto* e : {&r.t_start, &r.t_backward, &r.t_reduced, &r.t_updated, &r.buffers_copied})
      *e = std::make_unique<Event>(r.device);
    r.nvtx_forward = "forward " + r.device.str();
    r.nvtx_backward = "backward " + r.device.str();
    r.nvtx_update = "update " + r.device.str();
  }

  if (group_) {
    // Every rank starts from rank 0's parameters, in a buffer of one size on every rank
    // (a broadcast of another length would write past this rank's).
    const auto sizes = group_->gather_all(static_cast<uint64_t>(model->flat_params().numel()));
    for (size_t r = 1; r < sizes.size(); ++r)
      if (sizes[r] != sizes[0])
        throw UsageError("DataParallelOptions::group: the model differs between ranks: rank 0's parameters take " +
                         std::to_string(sizes[0]) + " floats, rank " + std::to_string(r) + "'s " +
                         std::to_string(sizes[r]));
    auto host = model->flat_params().to_host();
    group_->broadcast(host.data(), host.size() * sizeof(float), 0);
    copy(model->flat_params(), Tensor::from_host(host, model->flat_params().shape(), devices_[0]));
    model->refresh_shadow();
  }
  const bool explicit_path = options.reduce != Reduce::automatic;
  if (n > 1 || explicit_path || group_ || options.zero > 0) {  // ZeRO on one device: the same code, one shard
    int64_t total = 0;
    const auto offsets = model->layout(&total);
    auto params = model->parameters();
    std::vector<int64_t> sizes;
    for (const nn::Parameter* p : params) sizes.push_back(numel(p->shape));
    first_bucket_mb_ = options.first_bucket_mb;
    assign_buckets(options.bucket_mb);
    std::vector<ReplicaBuffers> bufs;
    for (auto& r : replicas_)
      bufs.push_back({r.ctx, r.model->flat_params(), r.model->flat_grads(), r.model->flat_shadow()});
    if (options.zero > 0) {
      if (reduce_ == Reduce::p2p)
        throw UsageError(
            "DataParallelOptions::zero shards the optimizer state over replicas that each update; the p2p "
            "reduction updates on the master alone (use nccl on GPUs, host on CPU devices)");
      if (zero_ == 2 && use_graph_)
        throw UsageError(
            "DataParallelOptions::zero 2 is not recorded in a CUDA graph yet (its buckets take turns in two "
            "slots); use DataParallelOptions::zero 1 with the graph");
      if (zero_ == 2 && reduce_ == Reduce::host && !group_ && options.grad_comm != DType::f32)
        throw UsageError(
            "DataParallelOptions::zero 2 between CPU devices sums fp32 (no DataParallelOptions::grad_comm bf16); "
            "use DataParallelOptions::zero 1 for bf16 on the wire");
      // One shard a replica, or a rank (which has one replica).
      shards_ = dpt::zero_shards(total, group_ ? static_cast<size_t>(group_->size()) : n);
    }
    const DType wire = options.grad_comm;
    if (group_ && reduce_ != Reduce::nccl && wire != DType::f32)
      throw UsageError(
          "DataParallelOptions::grad_comm bf16 is for NCCL, p2p and host reductions; the MPI reduction of CPU ranks "
          "sums fp32");
    comm_ctas_ = options.comm_ctas;
    if (zero_ == 2) make_stage2_reducer(offsets, sizes, wire);
    else if (group_)
      reducer_ = reduce_ == Reduce::nccl
                     ? make_nccl_rank_reducer(*group_, bufs[0], buckets_, shards_, wire, {}, comm_ctas_)
                     : make_mpi_reducer(*group_, bufs[0], buckets_, shards_);
    else if (reduce_ == Reduce::nccl)
      reducer_ = make_nccl_reducer(std::move(bufs), buckets_, shards_, wire, {}, comm_ctas_);
    else reducer_ = make_master_reducer(std::move(bufs), buckets_, reduce_ == Reduce::p2p, shards_, wire);
  }
  // NCCL's own guidance: several GPUs of one process inside one CUDA graph may deadlock
  // (cudaGraphLaunch can block on the collectives); one GPU a process is what it supports.
  if (use_graph_ && reduce_ == Reduce::nccl && n > 1)
    throw UsageError(
        "DataParallelOptions::cuda_graph does not record NCCL over several GPUs of one process (NCCL may "
        "deadlock there); use DataParallelOptions::reduce p2p, or no graph");
  const bool every = !reducer_ || reducer_->every_replica_updates();
  for (size_t i = 0; i < n; ++i)
    if (i == 0 || every) {
      ContextGuard g(*replicas_[i].ctx);
      replicas_[i].opt = make_optimizer(*replicas_[i].model);
      if (!replicas_[i].opt) throw UsageError("DataParallel: the optimizer factory returned no optimizer");
      if (&replicas_[i].opt->model() != replicas_[i].model.get())
        throw UsageError("DataParallel: the optimizer factory's optimizer updates a module other than the one given");
      if (!shards_.empty()) {
        const SampleRange& k = shard_of(i);
        replicas_[i].opt->restrict_to(k.first, k.first + k.count, replicas_[i].grad_shard);
        partial_.push_back(Tensor::zeros({1}, DType::f32, devices_[i]));
        first_bad_.push_back(Tensor::zeros({2}, DType::i32, devices_[i]));
      }
    }
  // Twin buffers where every update is the checked one without clipping, each replica's
  // optimizer over its whole buffer. (A CUDA graph records a step of each parity of the
  // step counter: each reads the copies that are current at its steps.)
  // Automatic: on GPUs from 2^21 (about 2.1M) parameters (the flat buffer's size). Below, the update's fixed cost
  // outweighs its saved pass (H200, 2026-12-05, ms a step with twins and with one copy: seed, 1M parameters at batch
  // 64, 0.0308 against 0.0298 eager and as a graph; the default job 0.0483 against 0.0476, graph 0.0471 against 0.0458;
  // 1024-1024x2-1024, 3.1M at batch 256, 0.212 against 0.217, graph 0.195 against 0.200; mlp bf16 graph 1.709
  // against 1.734).
  const bool twins_asked = options.twin_buffers == TwinBuffers::on ||
                           (options.twin_buffers == TwinBuffers::automatic && devices_[0].is_cuda() &&
                            replicas_[0].model->flat_params().numel() >= kTwinsFromParams);
  const char* no_twins = !check_finite_              ? "the gradients are not checked (check_finite)"
                         : clip_ > 0.0f              ? "clipping scales the update by the whole norm first"
                         : !shards_.empty()          ? "ZeRO shards the state"
                         : options.update_per_bucket ? "buckets are updated one by one"
                                                     : nullptr;
  if (twins_asked && !no_twins)
    for (Replica& rep : replicas_)
      if (rep.opt) {
        ContextGuard g(*rep.ctx);
        rep.opt->set_twin_buffers(true);
      }
  if (options.twin_buffers == TwinBuffers::on && no_twins)
    report(Severity::note, std::string("twin buffers not used: ") + no_twins);
  // Per-bucket updates where a reduction tells when each bucket's sum is queued (with no
  // reduction, one device, there is nothing to overlap: the update is the usual one).
  if (options.update_per_bucket && reducer_) {
    if (!reducer_->tells_bucket_done())
      throw UsageError(std::string("DataParallelOptions::update_per_bucket is for the nccl, p2p and host reductions, "
                                   "not ") +
                       reducer_->name());
    per_bucket_ = true;
    // p2p: the others take each bucket's parameters from the master as soon as it has
    // updated them, on a stream of their own, beside its later reductions and updates.
    for (Replica& rep : replicas_) {
      rep.update_ctx = std::make_unique<Context>(rep.device);
      rep.parts_updated = std::make_unique<Event>(rep.device);
      if (!rep.opt) continue;
      for (size_t b = 0; b < buckets_.size(); ++b) rep.bucket_summed.push_back(std::make_unique<Event>(rep.device));
    }
    reducer_->on_bucket_done([this](size_t r, size_t b, Context& where) { update_bucket(r, b, where); });
  }
  if (reduce_ == Reduce::p2p && n > 1 && !per_bucket_ && !use_graph_ && overlap_) plan_param_chunks(*model);
  if (options.tune_buckets && reducer_) {
    if (zero_ == 2 || use_graph_)
      throw UsageError(
          "DataParallelOptions::tune_buckets changes the buckets between eager steps: not with zero 2 (whose "
          "gradient slots are laid out by them) nor cuda_graph (which records one layout)");
    tuning_ = std::make_unique<BucketTuning>();
    std::vector<double> sizes{1.0, 4.0, 16.0, options.bucket_mb, 64.0};
    std::sort(sizes.begin(), sizes.end());
    std::vector<std::vector<Bucket>> layouts;  // a size that gives a smaller one's buckets is not tried again
    for (double mb : sizes)
      if (std::vector<Bucket> b = buckets_of_size(mb); std::find(layouts.begin(), layouts.end(), b) == layouts.end()) {
        layouts.push_back(std::move(b));
        tuning_->sizes_mb.push_back(mb);
      }
  }
  if (n > 1) pool_ = std::make_unique<WorkerPool>(n);
  buffers_ready_ = std::make_unique<Event>(devices_[0]);
  replicas_[0].model->set_in_data_parallel(true);  // last: a constructor that threw claims nothing
}

std::vector<Bucket> DataParallel::buckets_of_size(double bucket_mb) const {
  int64_t total = 0;
  const auto offsets = replicas_[0].model->layout(&total);
  std::vector<int64_t> sizes;
  for (const nn::Parameter* p : replicas_[0].params) sizes.push_back(numel(p->shape));
  // Under ZeRO stage 2 the first bucket is the others' size: its two gradient slots each
  // take the largest bucket's size, so a smaller first one would double them for a model
  // that fits one bucket.
  const double bytes = bucket_mb * 1024.0 * 1024.0;
  const double first = zero_ == 2 ? bytes : first_bucket_mb_ * 1024.0 * 1024.0;
  return zero_ == 2 ? make_param_buckets(offsets, sizes, bytes, first) : make_buckets(total, bytes, first);
}

void DataParallel::assign_buckets(double bucket_mb) {
  buckets_ = buckets_of_size(bucket_mb);
  bucket_mb_ = bucket_mb;
  int64_t total = 0;
  const auto offsets = replicas_[0].model->layout(&total);
  std::vector<int64_t> sizes;
  for (const nn::Parameter* p : replicas_[0].params) sizes.push_back(numel(p->shape));
  buckets_of_param_.assign(offsets.size(), {});
  for (size_t k = 0; k < offsets.size(); ++k) {
    const int64_t begin = offsets[k], end = begin + sizes[k];
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (begin < buckets_[b].offset + buckets_[b].count && buckets_[b].offset < end)
        buckets_of_param_[k].push_back(static_cast<int>(b));
  }
  for (Replica& rep : replicas_) {
    if (!per_bucket_ || !rep.opt) continue;
    rep.bucket_summed.clear();
    for (size_t b = 0; b < buckets_.size(); ++b) rep.bucket_summed.push_back(std::make_unique<Event>(rep.device));
  }
}

// Tuning (DataParallelOptions::tune_buckets): each size in turn, one step to settle (its
// events and staging made) and kTunedSteps timed between two waits for the device (the
// mean over the ranks); then the fastest, as rank 0 sees it, on every rank.
namespace {
constexpr int64_t kTunedSteps = 4;
}

void DataParallel::before_tuned_step() {
  BucketTuning& t = *tuning_;
  const int64_t in = t.steps % (kTunedSteps + 1);
  if (in == 0) {  // a size's first step: the reducer takes its buckets between steps
    synchronize();
    assign_buckets(t.sizes_mb[t.at]);
    reducer_->set_buckets(buckets_);
  } else if (in == 1) {
    synchronize();
    t.start = std::chrono::steady_clock::now();
  }
}

void DataParallel::after_tuned_step() {
  BucketTuning& t = *tuning_;
  if (++t.steps % (kTunedSteps + 1) != 0) return;
  synchronize();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t.start).count();
  t.ms.push_back(1e3 * (group_ ? group_->sum(s) / group_->size() : s) / kTunedSteps);
  if (++t.at < t.sizes_mb.size()) return;
  // Rank 0 chooses and tells the others: every rank must reduce in the same buckets.
  auto best = static_cast<uint64_t>(std::min_element(t.ms.begin(), t.ms.end()) - t.ms.begin());
  if (group_) group_->broadcast(&best, sizeof best, 0);
  assign_buckets(t.sizes_mb[best]);
  reducer_->set_buckets(buckets_);
  std::string tried;
  for (size_t i = 0; i < t.ms.size(); ++i) {
    char one[64];
    std::snprintf(one, sizeof one, "%s%g MiB %.3f", i ? ", " : "", t.sizes_mb[i], t.ms[i]);
    tried += one;
  }
  if (!group_ || group_->rank() == 0)
    report(Severity::note, "gradient buckets tuned: " + format_float(static_cast<float>(t.sizes_mb[best])) +
                               " MiB (ms a step: " + tried + ")");
  tuning_.reset();
}

void DataParallel::Replica::wait_for_updates() {
  parts_updated->record(*update_ctx);
  parts_updated->wait_in(*ctx);
}

void DataParallel::Replica::copy_params_from(const nn::Module& master, const Bucket& k) {
  const Tensor mine = model->flat_params().view(k.offset, {k.count});
  copy(mine, master.flat_params().view(k.offset, {k.count}));
  if (const Tensor& shadow = model->flat_shadow(); shadow.defined()) copy_cast(shadow.view(k.offset, {k.count}), mine);
}

void DataParallel::Replica::wait_for_chunk(size_t j) {
  if (j < chunks_waited) return;
  chunk_copied[j]->wait_in(*ctx);
  chunks_waited = j + 1;
}

namespace {
constexpr int64_t kMinCopyChunkFloats = int64_t{1} << 18;  // 1 MiB: small layers share a copy
}

void DataParallel::plan_param_chunks(nn::Module& model) {
  auto* seq = dynamic_cast<nn::Sequential*>(&model);
  if (!seq) return;  // no layers to wait for one by one
  int64_t total = 0;
  const auto offsets = model.layout(&total);
  const std::vector<nn::Parameter*>& params = replicas_[0].params;
  std::vector<int64_t> child_end;
  size_t k = 0;  // the parameters are in the children's order
  for (size_t c = 0; c < seq->size(); ++c) {
    const size_t own = seq->child(c).parameters().size();
    child_end.push_back(own == 0 ? -1 : offsets[k + own - 1] + numel(params[k + own - 1]->shape));
    k += own;
  }
  param_chunks_ = make_copy_chunks(child_end, total, kMinCopyChunkFloats, chunk_of_child_);
  params_updated_ = std::make_unique<Event>(devices_[0]);
  for (size_t i = 1; i < replicas_.size(); ++i) {
    Replica& rep = replicas_[i];
    rep.update_ctx = std::make_unique<Context>(rep.device);
    rep.computed = std::make_unique<Event>(rep.device);
    for (size_t j = 0; j < param_chunks_.size(); ++j) rep.chunk_copied.push_back(std::make_unique<Event>(rep.device));
    rep.chunks_waited = param_chunks_.size();
  }
}

void DataParallel::copy_params_in_chunks() {
  const nn::Module& master = *replicas_[0].model;
  params_updated_->record(*replicas_[0].ctx);
  for (size_t i = 1; i < replicas_.size(); ++i) {
    Replica& to = replicas_[i];
    to.computed->record(*to.ctx);
    ContextGuard g(*to.update_ctx);
    params_updated_->wait_in(*to.update_ctx);
    to.computed->wait_in(*to.update_ctx);
    for (size_t j = 0; j < param_chunks_.size(); ++j) {
      to.copy_params_from(master, param_chunks_[j]);
      to.chunk_copied[j]->record(*to.update_ctx);
    }
    to.chunks_waited = 0;
  }
}

void DataParallel::update_bucket(size_t r, size_t b, Context& where) {
  Replica& rep = replicas_[r];
  if (!rep.opt || step_failed_.load()) return;  // an abandoned step updates nothing
  rep.bucket_summed[b]->record(where);
  rep.bucket_summed[b]->wait_in(*rep.update_ctx);
  ContextGuard g(*rep.update_ctx);
  // The last bucket moves the optimizer's step counter on: it comes after the others in
  // the update stream's order.
  const Bucket& k = buckets_[b];
  rep.opt->step_part(k.offset, k.count, b + 1 == buckets_.size());
  if (reducer_->every_replica_updates()) return;
  rep.parts_updated->record(*rep.update_ctx);  // the master's bucket b is updated
  for (size_t i = 1; i < replicas_.size(); ++i) {
    Replica& to = replicas_[i];
    rep.parts_updated->wait_in(*to.update_ctx);
    ContextGuard on(*to.update_ctx);
    to.copy_params_from(*rep.model, k);
  }
}

DataParallel::~DataParallel() { replicas_[0].model->set_in_data_parallel(false); }

void DataParallel::make_stage2_reducer(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                                       DType wire) {
  // Each replica's gradients live in two slots of the largest bucket's size, which the
  // buckets take turns in (bucket b in slot b % 2), and its summed shard in a buffer of its
  // own: a shard plus two buckets instead of the whole buffer.
  GradSlots slots;
  for (const Bucket& b : buckets_) slots.slot_size = std::max(slots.slot_size, b.count);
  slots.slots = slots_ = std::min<size_t>(2, buckets_.size());
  params_of_bucket_.assign(buckets_.size(), {});
  std::vector<int64_t> in_slots(offsets.size());
  for (size_t k = 0; k < offsets.size(); ++k) {
    const auto b = static_cast<size_t>(buckets_of_param_[k].at(0));  // whole parameters: one bucket each
    params_of_bucket_[b].push_back(static_cast<int>(k));
    in_slots[k] = static_cast<int64_t>(b % slots_) * slots.slot_size + (offsets[k] - buckets_[b].offset);
  }
  // A bucket is reduced whole, the padding between its parameters too: where another
  // bucket of the same slot writes gradients over that padding, it must be zero again
  // before this bucket is reduced, or the shards' padding would sum stale gradients.
  dirty_padding_.assign(buckets_.size(), {});
  for (size_t c = 0; c < buckets_.size(); ++c) {
    const std::vector<int>& mine = params_of_bucket_[c];
    for (size_t j = 0; j + 1 < mine.size(); ++j) {
      const auto k = static_cast<size_t>(mine[j]), next = static_cast<size_t>(mine[j + 1]);
      const int64_t gap_begin = in_slots[k] + sizes[k], gap_end = in_slots[next];
      int64_t lo = gap_end, hi = gap_begin;  // the part of the gap others write, as one range
      for (size_t d = c % slots_; d < buckets_.size(); d += slots_) {
        if (d == c) continue;
        for (int o : params_of_bucket_[d]) {
          const int64_t b0 = in_slots[static_cast<size_t>(o)], b1 = b0 + sizes[static_cast<size_t>(o)];
          if (b0 >= gap_end || b1 <= gap_begin) continue;
          lo = std::min(lo, std::max(b0, gap_begin));
          hi = std::max(hi, std::min(b1, gap_end));
        }
      }
      if (lo < hi) dirty_padding_[c].push_back({lo, hi - lo});
    }
  }
  std::vector<ReplicaBuffers> bufs;
  for (size_t i = 0; i < replicas_.size(); ++i) {
    Replica& rep = replicas_[i];
    ContextGuard g(*rep.ctx);
    rep.model->bind_grads(Tensor::zeros({slots.slot_size * static_cast<int64_t>(slots_)}, DType::f32, rep.device),
                          in_slots);
    rep.grad_shard = Tensor::zeros({shard_of(i).count}, DType::f32, rep.device);
    bufs.push_back({rep.ctx, rep.model->flat_params(), rep.model->flat_grads(), rep.model->flat_shadow()});
    slots.shard_sums.push_back(rep.grad_shard);
  }
  if (group_)
    reducer_ = reduce_ == Reduce::nccl
                   ? make_nccl_rank_reducer(*group_, bufs[0], buckets_, shards_, wire, std::move(slots), comm_ctas_)
                   : make_mpi_reducer(*group_, bufs[0], buckets_, shards_, std::move(slots));
  else if (reduce_ == Reduce::nccl)
    reducer_ = make_nccl_reducer(std::move(bufs), buckets_, shards_, wire, std::move(slots), comm_ctas_);
  else reducer_ = make_host_stage2_reducer(std::move(bufs), buckets_, shards_, std::move(slots));
}

const ShardPlan& DataParallel::plan(int64_t batch) {
  if (batch < 1 || plan_.batch() != batch)  // (a default plan's batch is 0: ShardPlan refuses 0 itself)
    plan_ = ShardPlan(batch, group_ ? group_->size() : 1, group_ ? group_->rank() : 0, replicas_.size(), grad_accum_);
  return plan_;
}

void DataParallel::run_on_all(const std::function<void(size_t)>& fn) {
  auto guarded = [&](size_t i) {
    ContextGuard g(*replicas_[i].ctx);
    try {
      fn(i);
    } catch (const OutOfMemory&) {
      throw;  // names its device already
    } catch (const UsageError&) {
      throw;
    } catch (const std::bad_alloc&) {  // a host buffer of the step (the CPU's own kernels, staging)
      throw OutOfMemory("out of memory on the host while replica " + std::to_string(i) + " on " +
                        replicas_[i].device.str() +
                        " stepped (a host allocation failed); use a smaller batch (TrainConfig::batch) or model");
    } catch (const std::exception& e) {
      throw Error(std::string(e.what()) + " [replica " + std::to_string(i) + " on " + replicas_[i].device.str() + "]");
    }
  };
  if (pool_) pool_->run(guarded);
  else guarded(0);
}

void DataParallel::forward_backward(size_t r, const data::Batch& shard, double weight, const LossFn& loss_fn,
                                    Tensor& loss_out, const LossFn& metric, Tensor& metric_out, bool first_micro,
                                    bool last_micro) {
  Replica& rep = replicas_[r];
  if (first_micro) {
    if (r == 0 && timing_ && !recording_) rep.t_start->record(*rep.ctx);
    rep.model->zero_grad();  // micro-batches after the first accumulate into the buffer
    // The master's forward writes its buffers: not before the last step's copies of
    // them to the replicas are done.
    // (In a graph the replays are ordered already, and an event from before it cannot be waited for.)
    if (r == 0 && rep.model->flat_buffers().defined() && !recording_)
      for (size_t i = 1; i < replicas_.size(); ++i) replicas_[i].buffers_copied->wait_in(*rep.ctx);
  } else if (zero_ == 2) {
    rep.model->zero_grad();  // stage 2 sums every micro-batch into the shards: the slots start afresh
  }
  // Only the last micro-batch communicates (every one under stage 2, which sums each into
  // the shards); its backward hands each bucket over as soon as every parameter in it has
  // its gradient.
  const bool communicate = reducer_ && (last_micro || zero_ == 2);
  std::vector<bool> complete(buckets_.size(), false);
  if (communicate) {
    rep.pending.assign(buckets_.size(), 0);
    for (const auto& bs : buckets_of_param_)
      for (int b : bs) rep.pending[static_cast<size_t>(b)] += 1;
    rep.next_bucket = 0;
    rep.acquired = 0;
  }
  // Buckets go to the reducer in bucket order only, so that every replica (and rank)
  // issues its collectives in the same order whatever order backward finishes them in.
  auto hand_over = [&] {
    while (rep.next_bucket < buckets_.size() && complete[rep.next_bucket]) reducer_->bucket_ready(r, rep.next_bucket++);
  };
  // Stage 2: a bucket's slot is written (by backward, or zeroed where backward did not
  // reach) only once the bucket before it in that slot is handed over and reduced; a
  // bucket still incomplete then is complete with zeros where backward has not reached.
  auto settle_bucket = [&](size_t b) {
    for (int k : params_of_bucket_[b]) {
      Tensor v = rep.params[static_cast<size_t>(k)]->value;
      if (!v.grad_stale()) continue;
      dpt::zero_(v.grad());
      v.set_grad_stale(false);
    }
    complete[b] = true;
  };
  auto acquire_up_to = [&](size_t b) {
    for (; rep.acquired <= b; ++rep.acquired) {
      const size_t c = rep.acquired;
      for (size_t j = rep.next_bucket; j + slots_ <= c; ++j) settle_bucket(j);
      hand_over();
      reducer_->before_write(r, c);
      for (const Bucket& pad : dirty_padding_[c]) dpt::zero_(rep.model->flat_grads().view(pad.offset, {pad.count}));
    }
  };
  LeafHook before_write;
  if (communicate && zero_ == 2)
    before_write = [&](const Tensor& leaf) {
      const int k = rep.param_of(leaf);
      if (k < 0) return;
      const auto b = static_cast<size_t>(buckets_of_param_[static_cast<size_t>(k)][0]);
      if (b < rep.next_bucket)
        throw Error(
            "ZeRO stage 2 needs backward to make the gradients bucket after bucket: a parameter's gradient came "
            "after its bucket was reduced (a model that uses it out of order); use DataParallelOptions::zero 1");
      acquire_up_to(b);
    };
  if (shard.x.defined()) {
    Tensor loss;
    {
      NvtxRange range(rep.nvtx_forward.c_str());
      std::optional<nn::BeforeChildGuard> wait_per_layer;  // p2p: the parameters arrive layer by layer
      if (rep.chunks_waited < rep.chunk_copied.size())
        wait_per_layer.emplace(static_cast<const nn::Sequential*>(rep.model.get()), [&](size_t c) {
          if (chunk_of_child_[c] >= 0) rep.wait_for_chunk(static_cast<size_t>(chunk_of_child_[c]));
        });
      const Tensor out = rep.model->forward(shard.x);
      wait_per_layer.reset();
      rep.wait_for_copies();  // every chunk before backward, which hands its gradients on
      loss = loss_fn(out, shard.y);
      if (metric) metric_out = metric(out.detach(), shard.y);  // before backward may reuse the output
    }
    // The gradient of weight * loss: summed over replicas, ranks and micro-batches, the
    // full batch's gradient.
    LeafHook hook;
    if (communicate && overlap_)
      hook = [&](const Tensor& leaf) {
        const int k = rep.param_of(leaf);
        if (k < 0) return;
        for (int bi : buckets_of_param_[static_cast<size_t>(k)]) {
          const size_t b = static_cast<size_t>(bi);
          if (--rep.pending[b] < 0)
            throw Error(
                "a parameter received its gradient twice in one step (used twice in forward): "
                "data parallelism needs each parameter used once");
          if (rep.pending[b] == 0) complete[b] = true;
        }
        hand_over();
      };
    NvtxRange range(rep.nvtx_backward.c_str());
    run_backward(loss, static_cast<float>(weight), hook, before_write);
    loss_out = loss.detach();
  }
  rep.wait_for_copies();            // an empty shard: before its buckets are handed over
  if (communicate && zero_ == 2) {  // the buckets backward did not finish, in their turn
    if (!buckets_.empty()) acquire_up_to(buckets_.size() - 1);
    for (size_t j = rep.next_bucket; j < buckets_.size(); ++j) settle_bucket(j);
    hand_over();
  } else {
    rep.model->settle_grads();  // zeroes what backward did not reach, before anything reads it
    if (communicate) {          // buckets no gradient reached (an empty shard, unused parameters)
      std::fill(complete.begin(), complete.end(), true);
      hand_over();
    }
  }
  if (r == 0 && last_micro && timing_ && !recording_) rep.t_backward->record(*rep.ctx);
}

void DataParallel::update(size_t r) {
  Replica& rep = replicas_[r];
  if (per_bucket_ && !rep.opt) rep.wait_for_updates();  // p2p: the master's parameters, copied
  if (!rep.opt) return;
  if (reducer_ && shards_.empty()) reducer_->wait(r);  // ZeRO waited before its check
  if (r == 0 && timing_ && !recording_) rep.t_reduced->record(*rep.ctx);
  NvtxRange range(rep.nvtx_update.c_str());
  // Every replica scales (clips) the same reduced gradient, so all make the same update;
  // a non-finite norm gives a NaN scale, on which the optimizer skips the step.
  if (per_bucket_) {  // updated bucket by bucket already: the next step waits for the parts
    rep.scale = Tensor();
    rep.wait_for_updates();
  } else if (!(clip_ > 0.0f || check_finite_)) {
    rep.scale = Tensor();
    rep.opt->step(rep.scale);
  } else if (shards_.empty()) {  // the check and the update in one launch where they fit
    rep.scale = rep.opt->checked_step(clip_, r == 0 ? ring_ : CheckRing());
  } else {
    rep.scale = finish_check(partial_[r], first_bad_[r], clip_, r == 0 ? ring_ : CheckRing());
    rep.opt->step(rep.scale);
  }
  if (r == 0 && timing_ && !recording_) rep.t_updated->record(*rep.ctx);
}

int DataParallel::graph_parity() const {
  // The optimizers' step counter: with twin buffers the copies current at a step are
  // those of its parity, and a recording bakes in their addresses.
  const optim::Optimizer* o = replicas_[0].opt.get();
  return o ? static_cast<int>(o->steps_taken() & 1) : 0;
}

void DataParallel::drop_graphs() {
  for (Recording& g : rec_) {
    g.graph.reset();
    g.copy.clear();
    g.out = StepLoss();
  }
  graph_warm_ = false;
}

data::Batch DataParallel::next_step_inputs(size_t replica) const {
  return offered_ && replica < offered_->size() ? (*offered_)[replica] : data::Batch();
}

StepLoss DataParallel::graph_step(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss,
                                  const LossFn& metric, int64_t next_first) {
  const ShardPlan& shares = plan(count);
  const size_t n = replicas_.size();
  Replica& master = replicas_[0];
  if (graph_copy_ctx_.size() != n) {
    for (Recording& g : rec_) g.in.assign(n, data::Batch());
    for (size_t r = 0; r < n; ++r) {
      graph_inputs_ready_.push_back(std::make_unique<Event>(devices_[r]));
      graph_copy_ctx_.push_back(std::make_unique<Context>(devices_[r]));
    }
    graph_done_ = std::make_unique<Event>(devices_[0]);
  }
  const int q = graph_parity();
  Recording& cur = rec_[q];
  Recording& other = rec_[1 - q];  // the next step's
  // Each replica's shard goes into the fixed buffers that its step reads. With one
  // micro-batch a replay copies the next step's shard in (next_first) on a stream of the
  // replica's own once its backward is queued, beside its update (a node whose sources
  // each replay moves), or the source made it there (next_step_inputs); a shard that is
  // in neither way (the first, or an unforeseen step) is copied before the replay. With
  // micro-batches the source is asked for each in turn, as in an eager step (a file's
  // loader serves one micro-batch at a time and reuses its buffer at the next request),
  // so each is copied in at once, before the replay.
  const bool in_micro_batches = shares.micro_batches() > 1;
  // (The buffers keep what the last replay copied in when the graph is recorded anew.)
  const bool copied_in = !in_micro_batches && graph_next_ == SampleRange{first, count} && graph_next_parity_ == q;
  const bool ask_next = !in_micro_batches && graph_warm_ && next_first >= 0;  // a replay follows
  graph_next_ = {};
  std::vector<data::Batch> next(n);  // the next step's shards, for the graph's copy
  std::vector<char> has_rows(n, 0), resized(n, 0), next_fits(n, 1);
  auto same_memory = [](const Tensor& a, const Tensor& b) {
    return a.data() == b.data() && a.shape() == b.shape() && a.dtype() == b.dtype();
  };
  // Where the next step is not named, the source may make its shards in the buffers its
  // replay reads (where it is named, the replay's copy writes them).
  offered_ = !in_micro_batches && graph_warm_ && next_first < 0 ? &other.in : nullptr;
  std::vector<std::exception_ptr> source_errors(n);
  try {
    run_on_all([&](size_t r) {
      Replica& rep = replicas_[r];
      const SampleRange part = shares.replica_part(r);
      if (part.count == 0) return;
      has_rows[r] = 1;
      // Nothing of this replica's stream may run beside a replay: the graph's kernels share
      // the context's cuBLAS workspace and reduction counter with what the source queues.
      // (Replica 0's stream is the replays' own. Before the first replay the event is
      // unrecorded, and waiting for it waits for nothing.)
      if (r > 0) graph_done_->wait_in(*rep.ctx);
      data::Batch& in = cur.in[r];
      auto shape_of = [&](const data::Batch& b) {  // the fixed buffers hold the replica's part
        Shape x = b.x.shape(), y = b.y.shape();
        x[0] = y[0] = part.count;
        return std::pair{x, y};
      };
      auto fit = [&](const data::Batch& b) {  // both recordings' buffers
        const auto [x, y] = shape_of(b);
        if (in.x.defined() && in.x.shape() == x && in.y.shape() == y) return;
        for (Recording& g : rec_)
          g.in[r] = {Tensor::empty(x, b.x.dtype(), rep.device), Tensor::empty(y, b.y.dtype(), rep.device)};
        resized[r] = 1;
      };
      auto take = [&](int64_t f, int64_t rows, data::Batch& b) {  // false: the source threw (kept)
        try {
          b = take_shard(source, r, f, rows);
          return true;
        } catch (...) {
          source_errors[r] = std::current_exception();
          return false;
        }
      };
      if (!in_micro_batches) {
        if (!copied_in) {
          data::Batch b;
          if (!take(first + part.first, part.count, b)) return;
          fit(b);
          if (!same_memory(in.x, b.x) || !same_memory(in.y, b.y)) copy_all({{in.x, b.x}, {in.y, b.y}});
        }
        if (ask_next) {
          // A bad row of the next step's is that step's error: its own request meets it again.
          try {
            next[r] = take_shard(source, r, next_first + part.first, part.count);
            next_fits[r] = shape_of(next[r]) == std::pair{in.x.shape(), in.y.shape()};
          } catch (const std::exception&) {
            next[r] = data::Batch();
            next_fits[r] = 0;
          }
        }
      } else {
        for (int k = 0; k < shares.micro_batches(); ++k) {
          const SampleRange m = shares.micro(r, k);
          if (m.count == 0) continue;
          data::Batch b;
          if (!take(first + m.first, m.count, b)) return;
          fit(b);
          const int64_t at = m.first - part.first;
          copy_all({{in.x.rows(at, m.count), b.x}, {in.y.rows(at, m.count), b.y}});
        }
      }
      if (r > 0) graph_inputs_ready_[r]->record(*rep.ctx);  // after what the source queued there
    });
    rethrow_source_error(source_errors);
  } catch (...) {
    offered_ = nullptr;
    // Buffers made anew for this step are not the recorded graphs' any more: a replay after
    // the program caught the error would read freed memory.
    if (std::find(resized.begin(), resized.end(), 1) != resized.end()) drop_graphs();
    throw;
  }
  offered_ = nullptr;
  if (std::find(resized.begin(), resized.end(), 1) != resized.end()) drop_graphs();
  // The graph's copy of replica r into the other recording's buffers: from the next step's
  // shard; left out of the replay when no step is named or its shard does not fit. (As
  // recorded, before its first launch names its sources: onto themselves.)
  const bool next_known =
      ask_next && graph_warm_ && std::find(next_fits.begin(), next_fits.end(), 0) == next_fits.end();
  const auto copies = [&](size_t r) -> std::vector<std::pair<Tensor, Tensor>> {
    const data::Batch& from = next_known ? next[r] : other.in[r];
    return {{other.in[r].x, from.x}, {other.in[r].y, from.y}};
  };
  // The step reads its micro-batches as views of the fixed buffers.
  const ShardSource fixed = [&](size_t r, int64_t f, int64_t count_r) {
    const int64_t at = f - first - shares.replica_part(r).first;
    return data::Batch{cur.in[r].x.rows(at, count_r), cur.in[r].y.rows(at, count_r)};
  };
  if (!graph_warm_) {  // an eager step first: cuBLAS and the allocator set up outside the graph
    graph_warm_ = true;
    return step_body(first, count, fixed, loss, metric);
  }
  const std::vector<optim::Optimizer*> opts = optimizers();
  if (!cur.graph) {
    // Recorded once for each parity: the schedule's learning rate (and AdamW's bias
    // corrections) are computed in the graph, from each optimizer's counter on the device.
    // The host's counts must not move while recording.
    std::vector<int64_t> taken;
    for (optim::Optimizer* o : opts) taken.push_back(o->steps_taken());
    cur.graph = std::make_unique<Graph>(*master.ctx, other.graph.get());
    recording_ = true;
    std::mutex copy_m;  // the replicas' threads record their copies in turn (the hook below)
    try {
      Graph& graph = *cur.graph;
      graph.begin();
      for (size_t r = 1; r < n; ++r) graph.join(*replicas_[r].ctx);
      if (reducer_)
        for (Context* c : reducer_->contexts()) graph.join(*c);
      for (Replica& rep : replicas_)
        if (rep.update_ctx) graph.join(*rep.update_ctx);
      cur.copy.clear();
      if (!in_micro_batches) {
        cur.copy.assign(n, 0);
        for (size_t r = 0; r < n; ++r)
          if (has_rows[r]) graph.join(*graph_copy_ctx_[r]);
        // Backward has read the inputs for the last time: the copy goes beside the rest
        // (the update, the reduction). Replicas reach here in any order, the graph numbers
        // its copies in call order: each replica's index is kept.
        after_backward_ = [&](size_t r) {
          if (!has_rows[r]) return;
          Context& side = *graph_copy_ctx_[r];
          std::lock_guard<std::mutex> lk(copy_m);
          graph.fork(*replicas_[r].ctx, side);
          ContextGuard g(side);
          cur.copy[r] = graph.copy_in(copies(r));
        };
      }
      cur.out = step_body(first, count, fixed, loss, metric);
      after_backward_ = nullptr;
      graph.end();
    } catch (...) {
      after_backward_ = nullptr;
      recording_ = false;
      cur.graph.reset();
      cur.copy.clear();
      for (size_t i = 0; i < opts.size(); ++i) opts[i]->set_host_steps(taken[i]);  // nothing was recorded
      throw;
    }
    recording_ = false;
    for (size_t i = 0; i < opts.size(); ++i) opts[i]->set_host_steps(taken[i]);
  }
  {
    ContextGuard g(*master.ctx);
    if (!cur.copy.empty())
      for (size_t r = 0; r < n; ++r) {
        if (!has_rows[r]) continue;
        if (next_known) cur.graph->set_copy_sources(cur.copy[r], copies(r));
        else cur.graph->skip_copy(cur.copy[r]);
      }
    for (size_t r = 1; r < n; ++r)
      if (has_rows[r]) graph_inputs_ready_[r]->wait_in(*master.ctx);
    // The whole replay counts as compute: the phases inside a graph are not timed apart.
    if (timing_) master.t_start->record(*master.ctx);
    cur.graph->launch();
    if (n > 1) graph_done_->record(*master.ctx);  // what the other replicas' next inputs wait for
    if (timing_)
      for (auto* e : {master.t_backward.get(), master.t_reduced.get(), master.t_updated.get()}) e->record(*master.ctx);
  }
  if (next_known && !cur.copy.empty()) {
    graph_next_ = {next_first, count};
    graph_next_parity_ = 1 - q;
  }
  for (optim::Optimizer* o : opts) o->set_host_steps(o->steps_taken() + 1);  // the replay moved the device's
  return cur.out;
}

StepLoss DataParallel::train_step(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss,
                                  const LossFn& metric, bool timed, int64_t next_first) {
  DPT_REQUIRE(loss, "train_step: an empty LossFn");
  DPT_REQUIRE(first >= 0 && count <= std::numeric_limits<int64_t>::max() - first,
              "train_step: " + std::to_string(count) + " samples from sample " + std::to_string(first));
  timing_ = timed;
  // The replicas follow the master's train()/eval() mode, set before or after they were made.
  const bool training = replicas_[0].model->training();
  for (Replica& rep : replicas_)
    if (rep.model->training() != training) rep.model->train(training);
  // With several processes, this one trains its rank's contiguous part of the batch; its
  // replicas split that, and each trains its shard as K micro-batches.
  const ShardPlan& shares = plan(count);  // refuses an empty batch
  if (shares.idle_replicas() > 0 && !warned_small_batch_) {
    if (!group_ || group_->rank() == 0)
      report(Severity::note, "batch " + std::to_string(count) + " is smaller than the " +
                                 std::to_string(count + shares.idle_replicas()) + " replicas; only " +
                                 std::to_string(count) + " of them get samples");
    warned_small_batch_ = true;
  }
  if (use_graph_) return graph_step(first, count, source, loss, metric, next_first);
  if (!tuning_) return step_body(first, count, source, loss, metric);
  before_tuned_step();
  StepLoss out = step_body(first, count, source, loss, metric);
  after_tuned_step();
  return out;
}

StepLoss DataParallel::step_body(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss,
                                 const LossFn& metric) {
  const ShardPlan& shares = plan(count);
  const int k_total = shares.micro_batches();
  const size_t per_replica = static_cast<size_t>(k_total);
  StepLoss out;
  out.group = group_;
  out.owner = self_;
  out.losses.resize(replicas_.size() * per_replica);
  out.weights.resize(replicas_.size() * per_replica);
  if (metric) out.metrics.resize(replicas_.size() * per_replica);
  Tensor no_metric;  // written by no one: metric is empty
  // A replica whose source fails (a bad row of a data file) still takes part in the
  // step's collectives, with an empty shard, so that no other replica waits for it in an
  // all-reduce; the step is then abandoned before the update and the error rethrown.
  if (reducer_) reducer_->begin_step();
  source_error_.assign(replicas_.size(), nullptr);
  step_failed_ = false;
  // Per-bucket updates queued from the replicas' threads as they hand buckets over (nccl):
  // every replica has its shards before any hands a bucket over, so that all know whether
  // the step will be abandoned (and then update nothing).
  const bool updates_in_backward = per_bucket_ && reduce_ == Reduce::nccl && replicas_.size() > 1;
  std::optional<std::barrier<>> sources_taken;  // a barrier allocates: only where it is used
  if (updates_in_backward) sources_taken.emplace(static_cast<std::ptrdiff_t>(replicas_.size()));
  // An error inside backward (out of memory) after some buckets' updates were queued leaves
  // the step partly applied: the compute streams wait for those updates before anything
  // else, and synchronize() waits for them too.
  struct JoinUpdates {
    DataParallel& dp;
    bool done = false;
    ~JoinUpdates() {
      if (done || !dp.per_bucket_) return;
      try {
        for (Replica& rep : dp.replicas_) rep.wait_for_updates();
      } catch (...) {  // the step's own error is the one to report
      }
    }
  } join_on_error{*this};
  auto replica_step = [&](size_t r) {
    // The last step's gradient scale is not needed any more: freed now, its block serves
    // this step's backward, and steps after the first allocate nothing.
    replicas_[r].scale = Tensor();
    bool arrived = !updates_in_backward;
    try {
      for (int k = 0; k < k_total; ++k) {
        const SampleRange m = shares.micro(r, k);
        const size_t slot = r * per_replica + static_cast<size_t>(k);
        out.weights[slot] = shares.weight(r, k);
        data::Batch shard;
        if (m.count > 0 && !source_error_[r]) try {
            shard = take_shard(source, r, first + m.first, m.count);
          } catch (...) {
            source_error_[r] = std::current_exception();
            step_failed_ = true;
          }
        if (k + 1 == k_total && !arrived) {
          arrived = true;
          sources_taken->arrive_and_wait();
        }
        forward_backward(r, shard, out.weights[slot], loss, out.losses[slot], metric,
                         metric ? out.metrics[slot] : no_metric, k == 0, k + 1 == k_total);
      }
      if (after_backward_) after_backward_(r);
    } catch (...) {
      step_failed_ = true;
      if (!arrived) sources_taken->arrive_and_drop();  // the others do not wait for this one
      throw;
    }
  };
  run_on_all(std::ref(replica_step));  // by reference: a std::function would copy a closure this large to the heap
  join_on_error.done = true;
  if (reducer_) {
    NvtxRange range("reduce");
    reducer_->reduce();
  }
  if (std::any_of(source_error_.begin(), source_error_.end(), [](const auto& e) { return e != nullptr; })) {
    synchronize();  // the collectives are done, on every replica
    rethrow_source_error(source_error_);
  }
  if (!shards_.empty()) {
    // ZeRO: each replica holds the summed gradient of its shard alone (waited for here,
    // before its check, rather than in update); the global norm is the sum of the shards'
    // parts, the first non-finite gradient the least of theirs.
    const bool check = clip_ > 0.0f || check_finite_;
    run_on_all([&](size_t r) {
      reducer_->wait(r);
      if (!check) return;
      const SampleRange& k = shard_of(r);
      const Tensor grads =
          zero_ == 2 ? replicas_[r].grad_shard : replicas_[r].model->flat_grads().view(k.first, {k.count});
      shard_check(grads, k.first, partial_[r], first_bad_[r]);
    });
    if (check) reducer_->sum_partials(partial_, first_bad_);
  }
  run_on_all([&](size_t r) { update(r); });
  if (reducer_ && reducer_->sharded()) reducer_->gather_params();
  else if (reducer_ && !reducer_->every_replica_updates() && !per_bucket_) {
    if (param_chunks_.empty()) reducer_->broadcast_params();
    else copy_params_in_chunks();
  }
  broadcast_buffers();
  return out;
}

void DataParallel::infer(int64_t first, int64_t count, const ShardSource& source, const OutputFn& take) {
  DPT_REQUIRE(take, "infer: an empty OutputFn");
  // Its own split: the step's plan is for the training batch size and its micro-batches.
  const ShardPlan shares(count, group_ ? group_->size() : 1, group_ ? group_->rank() : 0, replicas_.size(), 1);
  std::vector<std::exception_ptr> source_errors(replicas_.size());
  run_on_all([&](size_t r) {
    Replica& rep = replicas_[r];
    const SampleRange part = shares.replica_part(r);
    if (part.count == 0) return;
    const bool was_training = rep.model->training();
    rep.model->train(false);
    try {
      NoGradGuard no_grad;
      rep.wait_for_copies();
      data::Batch shard;
      try {
        shard = take_shard(source, r, first + part.first, part.count);
      } catch (...) {
        source_errors[r] = std::current_exception();
      }
      if (shard.x.defined()) take(r, part, rep.model->forward(shard.x));
    } catch (...) {
      rep.model->train(was_training);
      throw;
    }
    rep.model->train(was_training);
  });
  rethrow_source_error(source_errors);
}

StepLoss DataParallel::evaluate(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss,
                                const LossFn& metric) {
  DPT_REQUIRE(loss, "evaluate: an empty LossFn");
  StepLoss out;
  out.group = group_;
  out.owner = self_;
  out.losses.resize(replicas_.size());
  out.weights.assign(replicas_.size(), 0.0);
  if (metric) out.metrics.resize(replicas_.size());
  // The targets travel with the inputs: the source is asked once, and the targets kept.
  std::vector<Tensor> targets(replicas_.size());
  const ShardSource keep_targets = [&](size_t r, int64_t f, int64_t n) {
    data::Batch b = take_shard(source, r, f, n);
    targets[r] = b.y;
    return b;
  };
  infer(first, count, keep_targets, [&](size_t r, SampleRange part, const Tensor& output) {
    out.weights[r] = static_cast<double>(part.count) / static_cast<double>(count);
    out.losses[r] = loss(output, targets[r]);
    if (metric) out.metrics[r] = metric(output, targets[r]);
  });
  return out;
}

void DataParallel::broadcast_buffers() {
  const Tensor& master = replicas_[0].model->flat_buffers();
  if (!master.defined()) return;
  if (group_) {  // as DDP's broadcast_buffers: every rank takes rank 0's
    ContextGuard g(*replicas_[0].ctx);
    reducer_->broadcast_buffers(master);
    return;
  }
  buffers_ready_->record(*replicas_[0].ctx);
  for (size_t i = 1; i < replicas_.size(); ++i) {
    Replica& rep = replicas_[i];
    ContextGuard g(*rep.ctx);
    buffers_ready_->wait_in(*rep.ctx);  // after the master's forward has written them
    copy(rep.model->flat_buffers(), master);
    rep.buffers_copied->record(*rep.ctx);
  }
}

StepLoss DataParallel::train_step(const data::Batch& batch, const LossFn& loss, const LossFn& metric) {
  DPT_REQUIRE(batch.x.defined() && batch.y.defined() && batch.x.dim() >= 1 && batch.y.dim() >= 1 &&
                  batch.x.size(0) == batch.y.size(0),
              "train_step: inputs and targets must have the same number of rows");
  // A shard is a view of the batch where it already lies on the replica's device,
  // else a copy (queued on the replica's stream).
  auto rows = [](const Tensor& t, int64_t first, int64_t n, const Device& d) {
    Tensor v = t.rows(first, n);
    if (t.device() == d) return v;
    Tensor c = Tensor::empty(v.shape(), t.dtype(), d);
    copy(c, v);
    return c;
  };
  graph_next_ = {};  // another source: what a replay copied in for samples from 0 is not this batch
  return train_step(
      0, batch.x.size(0),
      [&](size_t r, int64_t first, int64_t n) {
        return data::Batch{rows(batch.x, first, n, replicas_[r].device), rows(batch.y, first, n, replicas_[r].device)};
      },
      loss, metric);
}

size_t DataParallel::buckets() const { return buckets_.size(); }
double DataParallel::bucket_mb() const { return bucket_mb_; }
bool DataParallel::tuning_buckets() const { return tuning_ != nullptr; }

namespace {
void check_replica_index(size_t i, size_t n, const char* call) {
  if (i >= n)
    throw UsageError(std::string("DataParallel::") + call + "(" + std::to_string(i) + "): there are " +
                     std::to_string(n) + " replicas");
}
}  // namespace

nn::Module& DataParallel::replica(size_t i) {
  check_replica_index(i, replicas_.size(), "replica");
  return *replicas_[i].model;
}
const Device& DataParallel::device(size_t i) const {
  check_replica_index(i, devices_.size(), "device");
  return devices_[i];
}
optim::Optimizer& DataParallel::optimizer() { return *replicas_[0].opt; }

std::vector<std::pair<std::string, Tensor>> DataParallel::optimizer_state() {
  if (shards_.empty()) return optimizer().state();
  synchronize();  // the shards were written on the replicas' streams
  // ZeRO: the shards into whole buffers, on the master (and across ranks, on every rank).
  const Tensor& flat = replicas_[0].model->flat_params();
  std::vector<std::pair<std::string, Tensor>> out;
  for (const std::string& name : optimizer().state_names())
    out.push_back({name, Tensor::zeros(flat.shape(), DType::f32, devices_[0])});
  for (auto& rep : replicas_) {
    const optim::Optimizer& o = *rep.opt;
    const auto parts = o.state();  // none for an empty shard
    for (size_t i = 0; i < parts.size(); ++i)
      copy(out[i].second.view(o.shard_begin(), {o.shard_size()}), parts[i].second);
  }
  if (group_) {
    std::vector<int64_t> firsts, counts;
    for (const SampleRange& k : shards_) {
      firsts.push_back(k.first);
      counts.push_back(k.count);
    }
    for (auto& [name, t] : out) {
      std::vector<float> host = t.to_host();
      group_->all_gather(host.data(), firsts, counts);
      t = Tensor::from_host(host, flat.shape(), devices_[0]);
    }
  }
  return out;
}

const SampleRange& DataParallel::shard_of(size_t r) const {
  return shards_.at(group_ ? static_cast<size_t>(group_->rank()) : r);  // a rank has one replica
}

std::vector<ModelStateBytes> DataParallel::model_state_bytes() {
  std::vector<ModelStateBytes> out;
  for (auto& rep : replicas_) {
    ModelStateBytes b{rep.device};
    const nn::Module& m = *rep.model;
    b.parameters =
        static_cast<int64_t>(m.flat_params().nbytes() + (m.flat_shadow().defined() ? m.flat_shadow().nbytes() : 0));
    b.gradients =
        static_cast<int64_t>(m.flat_grads().nbytes() + (rep.grad_shard.defined() ? rep.grad_shard.nbytes() : 0));
    if (rep.opt) {
      for (const auto& [name, t] : rep.opt->state()) b.optimizer += static_cast<int64_t>(t.nbytes());
      b.twins = rep.opt->twin_bytes();
    }
    out.push_back(b);
  }
  return out;
}

std::vector<optim::Optimizer*> DataParallel::optimizers() {
  std::vector<optim::Optimizer*> out;
  for (auto& r : replicas_)
    if (r.opt) out.push_back(r.opt.get());
  return out;
}

void DataParallel::synchronize() {
  for (auto& r : replicas_) {
    if (reducer_) reducer_->synchronize(*r.ctx);  // bounded by the timeout where ranks are involved
    else r.ctx->synchronize();
    if (r.update_ctx) r.update_ctx->synchronize();  // per-bucket updates (joined by no later step after an error)
  }
}

bool DataParallel::idle() {
  for (auto& r : replicas_)
    if (!r.ctx->idle() || (r.update_ctx && !r.update_ctx->idle())) return false;
  return true;
}

DataParallel::ReductionTimes DataParallel::time_reduction(int iters) {
  if (!reducer_) throw UsageError("DataParallel::time_reduction: one device reduces nothing");
  DPT_REQUIRE(iters >= 1, "DataParallel::time_reduction: at least one timed call, got " + std::to_string(iters));
  if (zero_ == 2) throw UsageError("DataParallel::time_reduction: ZeRO stage 2 reduces during backward only");
  if (per_bucket_)
    throw UsageError(
        "DataParallel::time_reduction times the reduction alone: not with DataParallelOptions::update_per_bucket "
        "(which updates as it reduces)");
  auto reduce_once = [&] {
    run_on_all([&](size_t r) {
      for (size_t b = 0; b < buckets_.size(); ++b) reducer_->bucket_ready(r, b);
    });
    reducer_->reduce();
    run_on_all([&](size_t r) { reducer_->wait(r); });
    synchronize();
  };
  auto after_once = [&] {
    if (reducer_->sharded()) reducer_->gather_params();
    else if (!reducer_->every_replica_updates()) reducer_->broadcast_params();
    else return;
    synchronize();
  };
  ReductionTimes t;
  t.reduce_ms = median_ms_of(iters, reduce_once);
  if (reducer_->sharded() || !reducer_->every_replica_updates()) t.after_ms = median_ms_of(iters, after_once);
  return t;
}

StepTimes DataParallel::last_times() {
  synchronize();
  Replica& m = replicas_[0];
  return {m.t_backward->ms_since(*m.t_start), m.t_reduced->ms_since(*m.t_backward),
          m.t_updated->ms_since(*m.t_reduced)};
}

void DataParallel::set_check_ring(const CheckRing& ring) {
  synchronize();                       // no queued step writes the old ring any more
  context(devices_[0]).synchronize();  // the new ring's count was zeroed on this thread's stream
  ring_ = ring;
  drop_graphs();  // a recorded step writes the old one
}

bool DataParallel::replicas_identical() {
  synchronize();
  auto same = [](const Tensor& a, const Tensor& b) {
    if (!a.defined()) return !b.defined();
    const auto x = a.to_host(), y = b.to_host();
    return std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  const nn::Module& master = *replicas_[0].model;
  for (size_t i = 1; i < replicas_.size(); ++i) {
    const nn::Module& other = *replicas_[i].model;
    if (!same(master.flat_params(), other.flat_params()) || !same(master.flat_buffers(), other.flat_buffers()) ||
        !same(master.flat_shadow(), other.flat_shadow()))
      return false;
  }
  return true;
}

}  // namespace dpt
