// The eager step: every replica makes its shard of the batch, runs forward and backward
// and hands its gradient buckets to the reducer as backward makes them; then the update
// and the buffers' copy. Evaluation and inference run the forward alone.
#include <algorithm>
#include <barrier>
#include <exception>
#include <limits>
#include <new>
#include <optional>

#include <dptrain/error.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/ops.hpp>
#include "data_parallel_impl.hpp"
#include "kernels/hd.hpp"
#include "runtime/nvtx.hpp"

namespace dpt {

// The first replica's error: what the program's source threw, as it threw it (a data set's
// own exception is the program's to catch, in training, evaluation and inference alike), or
// its step's, as run_on_all reports it.
void rethrow_first(const std::vector<std::exception_ptr>& errors) {
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

const ShardPlan& DataParallel::Impl::plan(int64_t batch) {
  if (batch < 1 || plan_.batch() != batch)  // (a default plan's batch is 0: ShardPlan refuses 0 itself)
    plan_ = ShardPlan(batch, group_ ? group_->size() : 1, group_ ? group_->rank() : 0, replicas_.size(), grad_accum_);
  return plan_;
}

std::exception_ptr DataParallel::Impl::replica_error(size_t i, std::exception_ptr e) const {
  try {
    std::rethrow_exception(e);
  } catch (const OutOfMemory&) {
    return e;  // names its device already
  } catch (const UsageError&) {
    return e;
  } catch (const std::bad_alloc&) {  // a host buffer of the step (the CPU's own kernels, staging)
    return std::make_exception_ptr(OutOfMemory(
        "out of memory on the host while replica " + std::to_string(i) + " on " + replicas_[i].device.str() +
            " stepped (a host allocation failed); use a smaller batch ({}) or model",
        {{"TrainConfig", "batch"}}));
  } catch (const std::exception& x) {
    return std::make_exception_ptr(
        Error(std::string(x.what()) + " [replica " + std::to_string(i) + " on " + replicas_[i].device.str() + "]"));
  } catch (...) {
    return e;
  }
}

void DataParallel::Impl::run_on_all(const std::function<void(size_t)>& fn) {
  auto guarded = [&](size_t i) {
    ContextGuard g(*replicas_[i].ctx);
    try {
      fn(i);
    } catch (...) {
      std::rethrow_exception(replica_error(i, std::current_exception()));
    }
  };
  if (pool_) pool_->run(guarded);
  else guarded(0);
}

std::exception_ptr DataParallel::Impl::forward_backward(size_t r, const data::Batch& shard, double weight,
                                                        const LossFn& loss_fn, Tensor& loss_out, const LossFn& metric,
                                                        Tensor& metric_out, bool first_micro, bool last_micro) {
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
    rep.model->zero_grad();  // stage 2 sums every micro-batch into the partitions: the slots start afresh
  }
  // Only the last micro-batch communicates (every one under stage 2, which sums each into
  // the partitions); its backward hands each bucket over as soon as every parameter in it has
  // its gradient.
  const bool communicate = reducer_ && (last_micro || zero_ == 2);
  std::vector<bool> complete(buckets_.size(), false);
  if (communicate) {
    rep.pending.assign(buckets_.size(), 0);
    for (size_t k = 0; k < buckets_of_param_.size(); ++k)  // a tied weight is written once a use
      for (int b : buckets_of_param_[k]) rep.pending[static_cast<size_t>(b)] += rep.params[k]->uses;
    rep.next_bucket = 0;
    rep.acquired = 0;
    rep.holds_slot.assign(buckets_.size(), 0);
  }
  // Buckets go to the reducer in bucket order only, so that every replica (and rank)
  // issues its collectives in the same order whatever order backward finishes them in.
  auto hand_over = [&] {
    while (rep.next_bucket < buckets_.size() && complete[rep.next_bucket]) reducer_->bucket_ready(r, rep.next_bucket++);
  };
  // Stage 2: a bucket's slot is written (by backward, or zeroed where backward did not
  // reach) only once the bucket before it in that slot is handed over and reduced; a
  // bucket still incomplete then is complete with zeros where backward has not reached.
  // A bucket with a slot of its own (a tied weight's) waits for no other.
  auto settle_bucket = [&](size_t b) {
    for (int k : slots_.params_of_bucket[b]) {
      Tensor v = rep.params[static_cast<size_t>(k)]->value;
      if (!v.grad_stale()) continue;
      dpt::zero_(v.grad());
      v.set_grad_stale(false);
    }
    complete[b] = true;
  };
  auto acquire = [&](size_t c) {
    if (rep.holds_slot[c]) return;
    for (size_t j = rep.next_bucket; static_cast<int>(j) <= slots_.previous_in_slot[c]; ++j) settle_bucket(j);
    hand_over();
    reducer_->before_write(r, c);
    for (const Bucket& pad : slots_.dirty_padding[c]) dpt::zero_(rep.model->flat_grads().view(pad.offset, {pad.count}));
    rep.holds_slot[c] = 1;
  };
  auto acquire_up_to = [&](size_t b) {  // in bucket order, so that the slots' turns are backward's
    for (; rep.acquired <= b; ++rep.acquired) acquire(rep.acquired);
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
            "after its bucket was reduced (a model that uses it out of order); use {} 1",
            {{"DataParallelOptions", "zero"}});
      if (slots_.own_slot(b)) acquire(b);
      else acquire_up_to(b);
    };
  // An error of forward or backward (out of memory) ends this replica's step, but the others
  // wait for its buckets in their collectives: it hands them over all the same (what
  // backward did not reach as zeros), as a replica whose source failed does, and the step
  // is abandoned before its update. Not while a graph records: nothing waits there.
  std::exception_ptr failed;
  if (shard.x.defined()) try {
      Tensor loss;
      {
        NvtxRange range(rep.nvtx_forward.c_str());
        std::optional<nn::BeforeChildGuard> wait_per_layer;  // p2p: the parameters arrive layer by layer
        if (rep.chunks_waited < rep.chunk_copied.size())
          wait_per_layer.emplace(rep.model.get(), [&](size_t c) {
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
                  "a parameter received its gradient more often in one step than it is used (Parameter::uses): "
                  "data parallelism needs each parameter used as often as it says");
            if (rep.pending[b] == 0) complete[b] = true;
          }
          hand_over();
        };
      NvtxRange range(rep.nvtx_backward.c_str());
      run_backward(loss, static_cast<float>(weight), hook, before_write);
      loss_out = loss.detach();
    } catch (...) {
      if (recording_) throw;
      failed = replica_error(r, std::current_exception());
      step_failed_ = true;  // before the buckets below: none of them is updated
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
  return failed;
}

void DataParallel::Impl::update(size_t r) {
  Replica& rep = replicas_[r];
  if (per_bucket_ && !rep.opt) rep.wait_for_updates();  // p2p: the master's parameters, copied
  if (!rep.opt) return;
  if (reducer_ && partitions_.empty()) reducer_->wait(r);  // ZeRO waited before its check
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
  } else if (partitions_.empty()) {  // the check and the update in one launch where they fit
    rep.scale = rep.opt->checked_step(clip_, r == 0 ? ring_ : CheckRing());
  } else {
    rep.scale = finish_check(partial_[r], first_bad_[r], clip_, r == 0 ? ring_ : CheckRing());
    rep.opt->step(rep.scale);
  }
  if (r == 0 && timing_ && !recording_) rep.t_updated->record(*rep.ctx);
}

void DataParallel::Impl::abandon_unmatched_collectives(const std::exception_ptr& why) {
  if (recording_ || !reducer_ || !reducer_->abandon_if_unmatched()) return;  // (a recording's collectives never ran)
  abandoned_ = true;
  try {
    std::rethrow_exception(why);
  } catch (const std::exception& e) {
    abandoned_why_ = e.what();
  } catch (...) {
    abandoned_why_ = "an exception that is no std::exception";
  }
}

void DataParallel::Impl::refuse_if_abandoned(const char* what) const {
  if (abandoned_)
    throw Error(std::string(what) + ": a step failed on some replicas while the others reduced (" + abandoned_why_ +
                "), and the reduction's collectives were cancelled so that none waits forever; this DataParallel "
                "trains no more: make a new one (from a checkpoint)");
}

StepLoss DataParallel::Impl::train_step(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss,
                                        const LossFn& metric, bool timed, int64_t next_first) {
  refuse_if_abandoned("DataParallel::train_step");
  DPT_REQUIRE(loss, "train_step: an empty LossFn");
  DPT_REQUIRE(first >= 0 && count <= std::numeric_limits<int64_t>::max() - first,
              "train_step: " + std::to_string(count) + " samples from sample " + std::to_string(first));
  timing_ = timed;
  check_rounding();  // the rounding may have been set after the replicas were made
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

StepLoss DataParallel::Impl::step_body(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss,
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
  replica_error_.assign(replicas_.size(), nullptr);
  step_failed_ = false;
  // The master's forward writes its buffers (batch norm's running statistics) before another
  // replica's or micro-batch's source may fail: they are kept as the step began, so that an
  // abandoned step leaves them as they were (a checkpoint after it holds the steps before).
  // A recorded step's sources are its fixed buffers, which cannot fail.
  const Tensor& master_buffers = replicas_[0].model->flat_buffers();
  const bool keep_buffers = master_buffers.defined() && (replicas_.size() > 1 || k_total > 1) && !recording_;
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
    DataParallel::Impl& dp;
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
    if (r == 0 && keep_buffers) {  // on the master's stream, after the last step wrote them
      if (!buffers_before_step_.defined())
        buffers_before_step_ = Tensor::empty(master_buffers.shape(), master_buffers.dtype(), master_buffers.device());
      copy(buffers_before_step_, master_buffers);
    }
    bool arrived = !updates_in_backward;
    try {
      for (int k = 0; k < k_total; ++k) {
        const SampleRange m = shares.micro(r, k);
        const size_t slot = r * per_replica + static_cast<size_t>(k);
        out.weights[slot] = shares.weight(r, k);
        data::Batch shard;  // none after an error: the rest of the step runs on empty shards
        if (m.count > 0 && !replica_error_[r]) try {
            shard = take_shard(source, r, first + m.first, m.count);
          } catch (...) {
            replica_error_[r] = std::current_exception();
            step_failed_ = true;
          }
        if (k + 1 == k_total && !arrived) {
          arrived = true;
          sources_taken->arrive_and_wait();
        }
        if (std::exception_ptr e = forward_backward(r, shard, out.weights[slot], loss, out.losses[slot], metric,
                                                    metric ? out.metrics[slot] : no_metric, k == 0, k + 1 == k_total))
          replica_error_[r] = e;
      }
      if (after_backward_) after_backward_(r);
    } catch (...) {
      step_failed_ = true;
      if (!arrived) sources_taken->arrive_and_drop();  // the others do not wait for this one
      throw;
    }
  };
  try {
    run_on_all(std::ref(replica_step));  // by reference: a std::function would copy a closure this large to the heap
  } catch (...) {
    abandon_unmatched_collectives(std::current_exception());
    throw;
  }
  join_on_error.done = true;
  if (reducer_) {
    NvtxRange range("reduce");
    reducer_->reduce();
  }
  if (const auto failed = std::find_if(replica_error_.begin(), replica_error_.end(), [](const auto& e) { return e; });
      failed != replica_error_.end()) {
    // A replica whose hand-over itself failed (a collective refused) left the others'
    // collectives unmatched: cancelled before anything waits for them.
    abandon_unmatched_collectives(*failed);
    if (keep_buffers) {
      ContextGuard g(*replicas_[0].ctx);
      copy(master_buffers, buffers_before_step_);
    }
    synchronize();  // the collectives are done, on every replica
    rethrow_first(replica_error_);
  }
  if (!partitions_.empty()) check_partitions();
  run_on_all([&](size_t r) { update(r); });
  if (ZeroReducer* zero = reducer_ ? reducer_->zero() : nullptr) gather_params(*zero);
  else if (reducer_ && !reducer_->every_replica_updates() && !per_bucket_) {
    if (param_chunks_.empty()) reducer_->broadcast_params();
    else copy_params_in_chunks();
  }
  broadcast_buffers();
  return out;
}

void DataParallel::Impl::gather_params(ZeroReducer& zero) {
  zero.gather_params();  // the other partitions' shadow cast to nearest
  // Stochastic rounding: each replica's optimizer makes that shadow again with the bits of
  // the step just taken (its counter's), which the owners' updates rounded with; one more
  // pass over the shadow.
  for (Replica& rep : replicas_)
    if (rep.opt && rep.opt->bf16_rounding() == Bf16Rounding::stochastic) {
      ContextGuard g(*rep.ctx);
      rep.opt->refresh_shadow_outside_shard();
    }
}

void DataParallel::Impl::check_partitions() {
  // ZeRO: each replica holds the summed gradient of its partition alone (waited for here,
  // before its check, rather than in update); the global norm is the sum of the
  // partitions' parts, the first non-finite gradient the least of theirs.
  const bool check = clip_ > 0.0f || check_finite_;
  run_on_all([&](size_t r) {
    reducer_->wait(r);
    if (!check) return;
    const SampleRange& k = partition_of(r);
    const Tensor grads =
        zero_ == 2 ? replicas_[r].grad_partition : replicas_[r].model->flat_grads().view(k.first, {k.count});
    shard_check(grads, k.first, partial_[r], first_bad_[r]);
  });
  if (check) reducer_->zero()->sum_partials(partial_, first_bad_);
}

void DataParallel::Impl::infer(int64_t first, int64_t count, const ShardSource& source, const OutputFn& take) {
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
  rethrow_first(source_errors);
}

StepLoss DataParallel::Impl::evaluate(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss,
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

void DataParallel::Impl::broadcast_buffers() {
  const Tensor& master = replicas_[0].model->flat_buffers();
  if (!master.defined()) return;
  if (group_) {  // as DDP's broadcast_buffers: every rank takes rank 0's
    ContextGuard g(*replicas_[0].ctx);
    reducer_->across_ranks()->broadcast_buffers(master);
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

StepLoss DataParallel::Impl::train_step(const data::Batch& batch, const LossFn& loss, const LossFn& metric) {
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
      loss, metric, /*timed=*/true, /*next_first=*/-1);
}

}  // namespace dpt
