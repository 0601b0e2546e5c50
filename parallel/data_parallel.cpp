// DataParallel: the public class over its Impl, the Impl's construction (the replicas,
// their optimizers, the reduction and what it takes), and what it answers about its state.
#include <dptrain/parallel/data_parallel.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include <dptrain/error.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/runtime/ops.hpp>
#include "data_parallel_impl.hpp"

namespace dpt {

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

// ---- The public class ---------------------------------------------------------------

DataParallel::DataParallel(std::shared_ptr<nn::Module> model, std::vector<Device> devices,
                           const OptimizerFactory& make_optimizer, DataParallelOptions options)
    : impl_(std::make_unique<Impl>(*this, std::move(model), std::move(devices), make_optimizer, options)) {}

DataParallel::~DataParallel() = default;

const ShardPlan& DataParallel::plan(int64_t batch) { return impl_->plan(batch); }

StepLoss DataParallel::train_step(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss,
                                  const LossFn& metric, bool timed, int64_t next_first) {
  return impl_->train_step(first, count, source, loss, metric, timed, next_first);
}

data::Batch DataParallel::next_step_inputs(size_t replica) const { return impl_->next_step_inputs(replica); }

StepLoss DataParallel::train_step(const data::Batch& batch, const LossFn& loss, const LossFn& metric) {
  return impl_->train_step(batch, loss, metric);
}

StepLoss DataParallel::evaluate(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss,
                                const LossFn& metric) {
  return impl_->evaluate(first, count, source, loss, metric);
}

void DataParallel::infer(int64_t first, int64_t count, const ShardSource& source, const OutputFn& take) {
  impl_->infer(first, count, source, take);
}

size_t DataParallel::size() const { return impl_->devices_.size(); }

namespace {
void check_replica_index(size_t i, size_t n, const char* call) {
  if (i >= n)
    throw UsageError(std::string("DataParallel::") + call + "(" + std::to_string(i) + "): there are " +
                     std::to_string(n) + " replicas");
}
}  // namespace

nn::Module& DataParallel::replica(size_t i) {
  check_replica_index(i, impl_->replicas_.size(), "replica");
  return *impl_->replicas_[i].model;
}

const Device& DataParallel::device(size_t i) const {
  check_replica_index(i, impl_->devices_.size(), "device");
  return impl_->devices_[i];
}

optim::Optimizer& DataParallel::optimizer() { return *impl_->replicas_[0].opt; }
std::vector<optim::Optimizer*> DataParallel::optimizers() { return impl_->optimizers(); }
std::vector<std::pair<std::string, Tensor>> DataParallel::optimizer_state() { return impl_->optimizer_state(); }
std::vector<ModelStateBytes> DataParallel::model_state_bytes() { return impl_->model_state_bytes(); }
const std::vector<SampleRange>& DataParallel::zero_partitions() const { return impl_->partitions_; }
Reduce DataParallel::reduce() const { return impl_->reduce_; }
size_t DataParallel::buckets() const { return impl_->buckets_.size(); }
double DataParallel::bucket_mb() const { return impl_->bucket_mb_; }
bool DataParallel::tuning_buckets() const { return impl_->tuning_ != nullptr; }
StepTimes DataParallel::last_times() { return impl_->last_times(); }
DataParallel::ReductionTimes DataParallel::time_reduction(int iters) { return impl_->time_reduction(iters); }
void DataParallel::set_check_ring(const CheckRing& ring) { impl_->set_check_ring(ring); }
bool DataParallel::replicas_identical() { return impl_->replicas_identical(); }
void DataParallel::synchronize() { impl_->synchronize(); }
bool DataParallel::idle() { return impl_->idle(); }

// ---- Construction ----------------------------------------------------------------------

DataParallel::Impl::Impl(DataParallel& owner, std::shared_ptr<nn::Module> model, std::vector<Device> devices,
                         const OptimizerFactory& make_optimizer, const DataParallelOptions& options)
    : self_(std::make_shared<DataParallel* const>(&owner)), devices_(std::move(devices)) {
  if (devices_.empty() || devices_.size() > kMaxDevices)
    throw UsageError("DataParallel: 1 to " + std::to_string(kMaxDevices) + " devices, got " +
                     std::to_string(devices_.size()));
  if (!make_optimizer) throw UsageError("DataParallel: an empty optimizer factory");
  check(options);
  if (model && model->in_data_parallel())
    throw UsageError("DataParallel: the model is trained by another DataParallel already (one at a time)");
  DPT_CHECK(model && model->materialized() && model->device() == devices_[0],
            "DataParallel: the model must be on the first device, " + devices_[0].str());
  for (const Device& d : devices_) check_device(d);
  reduce_ = check_fit(options, devices_);
  group_ = options.group;
  clip_ = options.clip;
  grad_accum_ = options.grad_accum;
  overlap_ = options.overlap;
  check_finite_ = options.check_finite;
  zero_ = options.zero;
  use_graph_ = options.cuda_graph;
  enable_peer_access(devices_);
  // bf16 precision is bf16 storage: the model (and so every replica) computes in bf16 from
  // bf16 shadows of its fp32 parameters.
  model->set_compute_dtype(options.precision == Precision::bf16 ? DType::bf16 : DType::f32);
  // The master's parameters and shadow were written on this thread's stream; the replicas'
  // streams (their own when there are several) read them from now on.
  context(devices_[0]).synchronize();
  make_replicas(model, options);
  if (group_) start_from_rank0(*model);
  if (reduces(options, devices_)) set_up_reduction(*model, options);
  make_optimizers(make_optimizer);
  check_rounding();
  use_twin_buffers(options);
  // Per-bucket updates where a reduction tells when each bucket's sum is queued (with no
  // reduction, one device, there is nothing to overlap: the update is the usual one).
  if (options.update_per_bucket && reducer_) set_up_per_bucket_updates();
  const size_t n = devices_.size();
  if (reduce_ == Reduce::p2p && n > 1 && !per_bucket_ && !use_graph_ && overlap_) plan_param_chunks(*model);
  if (options.tune_buckets && reducer_) set_up_tuning(options);
  if (n > 1) pool_ = std::make_unique<WorkerPool>(n);
  buffers_ready_ = std::make_unique<Event>(devices_[0]);
  replicas_[0].model->set_in_data_parallel(true);  // last: a constructor that threw claims nothing
}

DataParallel::Impl::~Impl() { replicas_[0].model->set_in_data_parallel(false); }

int DataParallel::Impl::Replica::param_of(const Tensor& leaf) const {
  const auto at = reinterpret_cast<uintptr_t>(leaf.data()) - reinterpret_cast<uintptr_t>(model->flat_params().data());
  const auto it = param_index.find(at);
  return it == param_index.end() ? -1 : it->second;
}

void DataParallel::Impl::make_replicas(const std::shared_ptr<nn::Module>& model, const DataParallelOptions& options) {
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
}

void DataParallel::Impl::start_from_rank0(nn::Module& model) {
  // Every rank starts from rank 0's parameters, in a buffer of one size on every rank
  // (a broadcast of another length would write past this rank's).
  const auto sizes = group_->gather_all(static_cast<uint64_t>(model.flat_params().numel()));
  for (size_t r = 1; r < sizes.size(); ++r)
    if (sizes[r] != sizes[0])
      throw UsageError("{}: the model differs between ranks: rank 0's parameters take " + std::to_string(sizes[0]) +
                           " floats, rank " + std::to_string(r) + "'s " + std::to_string(sizes[r]),
                       {{"DataParallelOptions", "group"}});
  auto host = model.flat_params().to_host();
  group_->broadcast(host.data(), host.size() * sizeof(float), 0);
  copy(model.flat_params(), Tensor::from_host(host, model.flat_params().shape(), devices_[0]));
  model.refresh_shadow();
}

void DataParallel::Impl::set_up_reduction(nn::Module& model, const DataParallelOptions& options) {
  int64_t total = 0;
  const auto offsets = model.layout(&total);
  std::vector<int64_t> sizes;
  for (const nn::Parameter* p : model.parameters()) sizes.push_back(numel(p->shape));
  first_bucket_mb_ = options.first_bucket_mb;
  assign_buckets(options.bucket_mb);
  // One partition a replica, or a rank (which has one replica).
  if (zero_ > 0)
    partitions_ = dpt::zero_partitions(total, group_ ? static_cast<size_t>(group_->size()) : devices_.size());
  if (zero_ == 2) {
    make_stage2_reducer(offsets, sizes, options);
    return;
  }
  std::vector<ReplicaBuffers> bufs;
  for (auto& r : replicas_)
    bufs.push_back({r.ctx, r.model->flat_params(), r.model->flat_grads(), r.model->flat_shadow()});
  reducer_ = make_reducer(options, reduce_, std::move(bufs), buckets_, partitions_);
}

void DataParallel::Impl::make_stage2_reducer(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                                             const DataParallelOptions& options) {
  // Each replica's gradients live in the slots, which the buckets take turns in, and the
  // sum of its partition in a buffer of its own.
  std::vector<int> uses;
  for (const nn::Parameter* p : replicas_[0].model->parameters()) uses.push_back(p->uses);  // tied: a slot of its own
  slots_ = layout_slots(buckets_, offsets, sizes, buckets_of_param_, uses);
  GradSlots slots;
  slots.layout = slots_;
  std::vector<ReplicaBuffers> bufs;
  for (size_t i = 0; i < replicas_.size(); ++i) {
    Replica& rep = replicas_[i];
    ContextGuard g(*rep.ctx);
    rep.model->bind_grads(Tensor::zeros({slots_.size}, DType::f32, rep.device), slots_.in_slots);
    rep.grad_partition = Tensor::zeros({partition_of(i).count}, DType::f32, rep.device);
    bufs.push_back({rep.ctx, rep.model->flat_params(), rep.model->flat_grads(), rep.model->flat_shadow()});
    slots.partition_sums.push_back(rep.grad_partition);
  }
  reducer_ = make_reducer(options, reduce_, std::move(bufs), buckets_, partitions_, std::move(slots));
}

void DataParallel::Impl::make_optimizers(const OptimizerFactory& make_optimizer) {
  const bool every = !reducer_ || reducer_->every_replica_updates();
  for (size_t i = 0; i < replicas_.size(); ++i) {
    if (i > 0 && !every) break;
    Replica& rep = replicas_[i];
    ContextGuard g(*rep.ctx);
    rep.opt = make_optimizer(*rep.model);
    if (!rep.opt) throw UsageError("DataParallel: the optimizer factory returned no optimizer");
    if (&rep.opt->model() != rep.model.get())
      throw UsageError("DataParallel: the optimizer factory's optimizer updates a module other than the one given");
    if (!partitions_.empty()) {
      const SampleRange& k = partition_of(i);
      rep.opt->restrict_to(k.first, k.first + k.count, rep.grad_partition);
      partial_.push_back(Tensor::zeros({1}, DType::f32, devices_[i]));
      first_bad_.push_back(Tensor::zeros({2}, DType::i32, devices_[i]));
    }
  }
}

void DataParallel::Impl::check_rounding() const {
  const Replica& master = replicas_[0];
  if (!reducer_ || reducer_->every_replica_updates() || !master.model->flat_shadow().defined() ||
      master.opt->bf16_rounding() != Bf16Rounding::stochastic)
    return;
  throw UsageError(
      "stochastic rounding of the bf16 weights (Optimizer::set_bf16_rounding) needs every replica to round its own "
      "copy; {} p2p copies the master's parameters to the others",
      {{"DataParallelOptions", "reduce"}});
}

void DataParallel::Impl::use_twin_buffers(const DataParallelOptions& options) {
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
                            twins_by_default(replicas_[0].model->flat_params().numel()));
  const char* no_twins = !check_finite_              ? "the gradients are not checked (check_finite)"
                         : clip_ > 0.0f              ? "clipping scales the update by the whole norm first"
                         : !partitions_.empty()      ? "ZeRO shards the state"
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
}

void DataParallel::Impl::set_up_per_bucket_updates() {
  DPT_CHECK(reducer_->tells_bucket_done(), "update_per_bucket: a reduction that tells when a bucket is summed");
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

// ---- What it answers about its state --------------------------------------------------

std::vector<std::pair<std::string, Tensor>> DataParallel::Impl::optimizer_state() {
  optim::Optimizer& optimizer = *replicas_[0].opt;
  if (partitions_.empty()) return optimizer.state();
  synchronize();  // the partitions were written on the replicas' streams
  // ZeRO: the partitions into whole buffers, on the master (and across ranks, on every rank).
  const Tensor& flat = replicas_[0].model->flat_params();
  std::vector<std::pair<std::string, Tensor>> out;
  for (const std::string& name : optimizer.state_names())
    out.push_back({name, Tensor::zeros(flat.shape(), DType::f32, devices_[0])});
  for (auto& rep : replicas_) {
    const optim::Optimizer& o = *rep.opt;
    const auto parts = o.state();  // none for an empty partition
    for (size_t i = 0; i < parts.size(); ++i)
      copy(out[i].second.view(o.shard_begin(), {o.shard_size()}), parts[i].second);
  }
  if (group_) {
    std::vector<int64_t> firsts, counts;
    firsts_and_counts(partitions_, firsts, counts);
    for (auto& [name, t] : out) {
      std::vector<float> host = t.to_host();
      group_->all_gather(host.data(), firsts, counts);
      t = Tensor::from_host(host, flat.shape(), devices_[0]);
    }
  }
  return out;
}

const SampleRange& DataParallel::Impl::partition_of(size_t r) const {
  return partitions_.at(group_ ? static_cast<size_t>(group_->rank()) : r);  // a rank has one replica
}

std::vector<ModelStateBytes> DataParallel::Impl::model_state_bytes() {
  std::vector<ModelStateBytes> out;
  for (auto& rep : replicas_) {
    ModelStateBytes b{rep.device};
    const nn::Module& m = *rep.model;
    b.parameters =
        static_cast<int64_t>(m.flat_params().nbytes() + (m.flat_shadow().defined() ? m.flat_shadow().nbytes() : 0));
    b.gradients = static_cast<int64_t>(m.flat_grads().nbytes() +
                                       (rep.grad_partition.defined() ? rep.grad_partition.nbytes() : 0));
    if (rep.opt) {
      for (const auto& [name, t] : rep.opt->state()) b.optimizer += static_cast<int64_t>(t.nbytes());
      b.twins = rep.opt->twin_bytes();
    }
    out.push_back(b);
  }
  return out;
}

std::vector<optim::Optimizer*> DataParallel::Impl::optimizers() {
  std::vector<optim::Optimizer*> out;
  for (auto& r : replicas_)
    if (r.opt) out.push_back(r.opt.get());
  return out;
}

void DataParallel::Impl::synchronize() {
  auto wait = [&](Context& ctx) {  // through the reduction: bounded by the timeout where ranks are involved
    if (reducer_) reducer_->synchronize(ctx);
    else ctx.synchronize();
  };
  for (auto& r : replicas_) {
    wait(*r.ctx);
    if (r.update_ctx) wait(*r.update_ctx);  // per-bucket updates (joined by no later step after an error)
  }
}

bool DataParallel::Impl::idle() {
  for (auto& r : replicas_)
    if (!r.ctx->idle() || (r.update_ctx && !r.update_ctx->idle())) return false;
  return true;
}

DataParallel::ReductionTimes DataParallel::Impl::time_reduction(int iters) {
  if (!reducer_) throw UsageError("DataParallel::time_reduction: one device reduces nothing");
  refuse_if_abandoned("DataParallel::time_reduction");
  DPT_REQUIRE(iters >= 1, "DataParallel::time_reduction: at least one timed call, got " + std::to_string(iters));
  if (zero_ == 2) throw UsageError("DataParallel::time_reduction: ZeRO stage 2 reduces during backward only");
  if (per_bucket_)
    throw UsageError(
        "DataParallel::time_reduction times the reduction alone: not with {} (which updates as it reduces)",
        {{"DataParallelOptions", "update_per_bucket"}});
  auto reduce_once = [&] {
    run_on_all([&](size_t r) {
      for (size_t b = 0; b < buckets_.size(); ++b) reducer_->bucket_ready(r, b);
    });
    reducer_->reduce();
    run_on_all([&](size_t r) { reducer_->wait(r); });
    synchronize();
  };
  auto after_once = [&] {
    if (ZeroReducer* zero = reducer_->zero()) gather_params(*zero);
    else if (!reducer_->every_replica_updates()) reducer_->broadcast_params();
    else return;
    synchronize();
  };
  ReductionTimes t;
  t.reduce_ms = median_ms_of(iters, reduce_once);
  if (reducer_->zero() || !reducer_->every_replica_updates()) t.after_ms = median_ms_of(iters, after_once);
  return t;
}

StepTimes DataParallel::Impl::last_times() {
  synchronize();
  Replica& m = replicas_[0];
  return {m.t_backward->ms_since(*m.t_start), m.t_reduced->ms_since(*m.t_backward),
          m.t_updated->ms_since(*m.t_reduced)};
}

void DataParallel::Impl::set_check_ring(const CheckRing& ring) {
  synchronize();                       // no queued step writes the old ring any more
  context(devices_[0]).synchronize();  // the new ring's count was zeroed on this thread's stream
  ring_ = ring;
  drop_graphs();  // a recorded step writes the old one
}

bool DataParallel::Impl::replicas_identical() {
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
