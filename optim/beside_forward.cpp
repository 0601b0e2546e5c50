#include <dptrain/optim/beside_forward.hpp>

#include <dptrain/error.hpp>

namespace dpt::optim {

namespace {
// Parts of at least this many floats (4 MiB of parameters): GPT-2 124M's embedding, each
// block and the final LayerNorm with the last block; small layers share a part, so that
// a small model's update is still one or a few launches.
constexpr int64_t kMinPartFloats = int64_t{1} << 20;
}  // namespace

UpdateBesideForward::UpdateBesideForward(Optimizer& opt, nn::Module& model)
    : opt_(&opt), model_(&model), ctx_(&context(model.device())) {
  DPT_CHECK(&opt.model() == &model, "UpdateBesideForward: the optimizer updates another module");
  DPT_CHECK(opt.shard_begin() == 0 && opt.shard_size() == model.flat_params().numel(),
            "UpdateBesideForward: not for a ZeRO shard");
  update_ctx_ = std::make_unique<Context>(model.device());
  backward_done_ = std::make_unique<Event>(model.device());
  chunks_ = nn::make_copy_chunks(model.child_ends(), model.flat_params().numel(), kMinPartFloats, chunk_of_child_);
  if (chunks_.empty() && model.flat_params().numel() > 0) {  // no children to cut at: one part
    chunks_.push_back({0, model.flat_params().numel()});
    chunk_of_child_.assign(chunk_of_child_.size(), -1);
  }
  for (size_t j = 0; j < chunks_.size(); ++j) part_done_.push_back(std::make_unique<Event>(model.device()));
  waited_ = chunks_.size();
}

UpdateBesideForward::~UpdateBesideForward() {
  try {
    settle();
    update_ctx_->synchronize();
  } catch (...) {  // a failed device: the context reports it on its next use
  }
}

void UpdateBesideForward::queue(const Tensor& grad_scale) {
  DPT_CHECK(waited_ == chunks_.size(), "UpdateBesideForward::queue: the last step's update is still pending");
  if (chunks_.empty()) {  // nothing to update: the step still counts
    opt_->step(grad_scale);
    return;
  }
  model_->settle_grads();  // as step(): what backward did not reach is zeroed first
  scale_ = grad_scale;     // held until the update is waited for: another stream reads it
  backward_done_->record(*ctx_);
  backward_done_->wait_in(*update_ctx_);
  {
    ContextGuard on(*update_ctx_);
    for (size_t j = 0; j < chunks_.size(); ++j) {
      opt_->step_part(chunks_[j].offset, chunks_[j].count, j + 1 == chunks_.size(), grad_scale);
      part_done_[j]->record(*update_ctx_);
    }
  }
  waited_ = 0;
}

void UpdateBesideForward::wait_for(size_t part) {
  for (; waited_ <= part && waited_ < chunks_.size(); ++waited_) part_done_[waited_]->wait_in(*ctx_);
}

Tensor UpdateBesideForward::forward(const Tensor& x) {
  Tensor out;
  {
    nn::BeforeChildGuard per_child(model_, [this](size_t c) {
      if (c < chunk_of_child_.size() && chunk_of_child_[c] >= 0) wait_for(static_cast<size_t>(chunk_of_child_[c]));
    });
    out = model_->forward(x);
  }
  settle();
  return out;
}

void UpdateBesideForward::settle() {
  if (!chunks_.empty()) wait_for(chunks_.size() - 1);
  scale_ = Tensor();
}

}  // namespace dpt::optim
