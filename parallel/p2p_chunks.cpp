// p2p's copies of the master's updated parameters to the other replicas: in chunks of a
// layer or more beside the next forward (nn::make_copy_chunks), or bucket by bucket beside the
// reduction (per-bucket updates).
#include <dptrain/error.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/runtime/ops.hpp>
#include "data_parallel_impl.hpp"

namespace dpt {

void DataParallel::Impl::Replica::wait_for_updates() {
  parts_updated->record(*update_ctx);
  parts_updated->wait_in(*ctx);
}

void DataParallel::Impl::Replica::copy_params_from(const nn::Module& master, int64_t offset, int64_t count) {
  const Tensor mine = model->flat_params().view(offset, {count});
  copy(mine, master.flat_params().view(offset, {count}));
  if (const Tensor& shadow = model->flat_shadow(); shadow.defined()) copy_cast(shadow.view(offset, {count}), mine);
}

void DataParallel::Impl::Replica::wait_for_chunk(size_t j) {
  if (j < chunks_waited) return;
  chunk_copied[j]->wait_in(*ctx);
  chunks_waited = j + 1;
}

namespace {
constexpr int64_t kMinCopyChunkFloats = int64_t{1} << 18;  // 1 MiB: small layers share a copy
}

void DataParallel::Impl::plan_param_chunks(nn::Module& model) {
  if (!dynamic_cast<nn::Sequential*>(&model)) return;  // no layers to wait for one by one
  param_chunks_ =
      nn::make_copy_chunks(model.child_ends(), model.flat_params().numel(), kMinCopyChunkFloats, chunk_of_child_);
  params_updated_ = std::make_unique<Event>(devices_[0]);
  for (size_t i = 1; i < replicas_.size(); ++i) {
    Replica& rep = replicas_[i];
    rep.update_ctx = std::make_unique<Context>(rep.device);
    rep.computed = std::make_unique<Event>(rep.device);
    for (size_t j = 0; j < param_chunks_.size(); ++j) rep.chunk_copied.push_back(std::make_unique<Event>(rep.device));
    rep.chunks_waited = param_chunks_.size();
  }
}

void DataParallel::Impl::copy_params_in_chunks() {
  const nn::Module& master = *replicas_[0].model;
  params_updated_->record(*replicas_[0].ctx);
  for (size_t i = 1; i < replicas_.size(); ++i) {
    Replica& to = replicas_[i];
    to.computed->record(*to.ctx);
    ContextGuard g(*to.update_ctx);
    params_updated_->wait_in(*to.update_ctx);
    to.computed->wait_in(*to.update_ctx);
    for (size_t j = 0; j < param_chunks_.size(); ++j) {
      to.copy_params_from(master, param_chunks_[j].offset, param_chunks_[j].count);
      to.chunk_copied[j]->record(*to.update_ctx);
    }
    to.chunks_waited = 0;
  }
}

void DataParallel::Impl::update_bucket(size_t r, size_t b, Context& where) {
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
    to.copy_params_from(*rep.model, k.offset, k.count);
  }
}

}  // namespace dpt
