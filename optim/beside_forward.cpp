#include <dptrain/optim/beside_forward.hpp>

#include <algorithm>
#include <string>

#include <dptrain/error.hpp>

namespace dpt::optim {

UpdateBesideForward::UpdateBesideForward(Optimizer& opt, nn::Module& model, int64_t min_part_floats)
    : opt_(&opt), model_(&model), ctx_(&context(model.device())) {
  DPT_CHECK(&opt.model() == &model, "UpdateBesideForward: the optimizer updates another module");
  DPT_CHECK(opt.shard_begin() == 0 && opt.shard_size() == model.flat_params().numel(),
            "UpdateBesideForward: not for a ZeRO shard");
  DPT_CHECK(!opt.twin_buffers(), "UpdateBesideForward: not with twin buffers (their update is one checked launch)");
  DPT_CHECK(!model.in_data_parallel(), "UpdateBesideForward: not for a model a DataParallel trains");
  update_ctx_ = std::make_unique<Context>(model.device());
  backward_done_ = std::make_unique<Event>(model.device());
  const int64_t total = model.flat_params().numel();
  chunks_ = nn::make_copy_chunks(model.child_ends(), total, min_part_floats, chunk_of_child_);
  if (chunks_.size() >= 2 && chunks_.back().count < min_part_floats) {  // a small last child joins the part before
    chunks_[chunks_.size() - 2].count += chunks_.back().count;
    chunks_.pop_back();
    for (int& j : chunk_of_child_) j = std::min(j, static_cast<int>(chunks_.size()) - 1);
  }
  if (chunks_.empty() && total > 0) chunks_.push_back({0, total});  // no child to cut at: one part
  wait_all_first_ = std::all_of(chunk_of_child_.begin(), chunk_of_child_.end(), [](int j) { return j < 0; });
  for (size_t j = 0; j < chunks_.size(); ++j) part_done_.push_back(std::make_unique<Event>(model.device()));
  waited_ = chunks_.size();
}

UpdateBesideForward::~UpdateBesideForward() {
  try {  // the update ends before its stream goes (work queued after this is ordered by the wait)
    update_ctx_->synchronize();
  } catch (...) {  // a failed device: the steps' context reports it on its next use
  }
}

void UpdateBesideForward::check_context(const char* where) const {
  DPT_CHECK(&context(model_->device()) == ctx_,
            std::string("UpdateBesideForward::") + where + ": on another context than the steps'");
}

void UpdateBesideForward::queue(const Tensor& grad_scale) {
  check_context("queue");
  DPT_CHECK(waited_ == chunks_.size(), "UpdateBesideForward::queue: the last step's update is still pending");
  if (chunks_.empty()) {  // nothing to update: the step still counts
    opt_->step(grad_scale);
    return;
  }
  model_->settle_grads();  // as step(): what backward did not reach is zeroed first
  scale_ = grad_scale;     // held until the update is waited for: another stream reads it
  backward_done_->record(*ctx_);
  backward_done_->wait_in(*update_ctx_);
  waited_ = 0;  // before the parts: should one fail, those queued are still waited for
  {
    ContextGuard on(*update_ctx_);
    for (size_t j = 0; j < chunks_.size(); ++j) {
      opt_->step_part(chunks_[j].offset, chunks_[j].count, j + 1 == chunks_.size(), grad_scale);
      part_done_[j]->record(*update_ctx_);
    }
  }
}

void UpdateBesideForward::wait_for(size_t part) {
  for (; waited_ <= part && waited_ < chunks_.size(); ++waited_) part_done_[waited_]->wait_in(*ctx_);
}

Tensor UpdateBesideForward::forward(const Tensor& x) {
  check_context("forward");
  if (wait_all_first_) settle();
  Tensor out;
  try {
    nn::BeforeChildGuard per_child(model_, [this](size_t c) {
      if (c < chunk_of_child_.size() && chunk_of_child_[c] >= 0) wait_for(static_cast<size_t>(chunk_of_child_[c]));
    });
    out = model_->forward(x);
  } catch (...) {
    settle();
    throw;
  }
  settle();
  return out;
}

void UpdateBesideForward::settle() {
  check_context("settle");
  if (!chunks_.empty()) wait_for(chunks_.size() - 1);
  scale_ = Tensor();
}

}  // namespace dpt::optim
