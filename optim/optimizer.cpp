#include <dptrain/optim/optimizer.hpp>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <dptrain/error.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>

#include "checks.hpp"

namespace dpt::optim {

void Optimizer::set_schedule(const Schedule& schedule) {
  need_lr(schedule.base_lr, "Schedule::base_lr");
  need(schedule.warmup >= 0, "Schedule::warmup", ">= 0", static_cast<double>(schedule.warmup));
  need(schedule.total >= 1, "Schedule::total", ">= 1", static_cast<double>(schedule.total));
  schedule_ = schedule;
}

Optimizer::Optimizer(nn::Module& model, float lr, const char* kind)
    : model_(&model), schedule_(Schedule::constant_lr(lr)), kind_(kind) {
  DPT_CHECK(model.materialized(), "an optimizer needs a module placed on a device (Module::to)");
  params_ = model.flat_params();
  grads_ = model.flat_grads();
  counter_ = Tensor::zeros({4}, DType::i32, params_.device());  // int64 0, and the update's block count 0
}

void Optimizer::restrict_to(int64_t begin, int64_t end, const Tensor& grads) {
  const int64_t total = model_->flat_params().numel();
  set_twin_buffers(false);
  DPT_CHECK(begin >= 0 && begin <= end && end <= total, "restrict_to: [" + std::to_string(begin) + ", " +
                                                            std::to_string(end) + ") is no range of " +
                                                            std::to_string(total) + " parameters");
  begin_ = begin;
  params_ = model_->flat_params().view(begin, {end - begin});
  DPT_CHECK(!grads.defined() || grads.numel() == end - begin, "restrict_to: the shard's gradients of another size");
  grads_ = grads.defined() ? grads : model_->flat_grads().view(begin, {end - begin});
  reset_state(end - begin);
}

Tensor Optimizer::shadow() const {
  const Tensor& s = model_->flat_shadow();
  if (!s.defined() || params_.numel() == s.numel()) return s;
  return s.view(begin_, {params_.numel()});
}

void Optimizer::set_twin_buffers(bool on) {
  if (!on || params_.numel() == 0) {  // an empty shard has nothing to alternate
    twins_.clear();
    return;
  }
  if (!twins_.empty()) return;
  DPT_CHECK(begin_ == 0 && params_.numel() == model_->flat_params().numel(),
            "Optimizer::set_twin_buffers: not for a ZeRO shard");
  // The second copies are written by the first step before anything reads them.
  std::vector<std::pair<Tensor, Tensor>> made{{params_, Tensor::empty(params_.shape(), DType::f32, params_.device())}};
  for (const auto& [name, buf] : state()) made.push_back({buf, Tensor::empty(buf.shape(), DType::f32, buf.device())});
  twins_ = std::move(made);
  backup_ = Tensor();  // the speculative update's, which no longer runs
}

int64_t Optimizer::twin_bytes() const {
  int64_t n = 0;
  for (const auto& [buf, second] : twins_) n += static_cast<int64_t>(second.nbytes());
  return n;
}

void Optimizer::refuse_with_twins(const char* what) const {
  if (twins_.empty()) return;
  throw UsageError(std::string("Optimizer::") + what +
                   ": not while the twin buffers are on (each step must swap them: checked_step without clipping); "
                   "call set_twin_buffers(false) first");
}

void Optimizer::begin_checked_step(float max_norm) {
  need(max_norm >= 0.0f && std::isfinite(max_norm), "checked_step: max_norm", "a finite number >= 0 (0: no clipping)",
       max_norm);
  if (max_norm != 0.0f) refuse_with_twins("checked_step with clipping");
  model_->settle_grads();
}

void Optimizer::swap_twins() {
  for (const auto& [buf, second] : twins_) buf.swap_memory(second);
}

void Optimizer::set_host_steps(int64_t t) {
  if (!twins_.empty() && (t - t_) % 2 != 0) swap_twins();
  t_ = t;
}

void Optimizer::set_steps_taken(int64_t t) {
  DPT_CHECK(t >= 0, "set_steps_taken: a negative count");
  if (!twins_.empty() && (t - t_) % 2 != 0) {  // the state moves to the copy that the count's parity reads
    for (const auto& [buf, second] : twins_) copy(second, buf);
    swap_twins();
  }
  t_ = t;
  const std::vector<int32_t> halves = {static_cast<int32_t>(static_cast<uint64_t>(t) & 0xffffffffu),
                                       static_cast<int32_t>(static_cast<uint64_t>(t) >> 32), 0, 0};  // little-endian
  copy(counter_, Tensor::from_host_i32(halves, {4}, params_.device()));  // in place: a graph may read it
}

const Tensor& Optimizer::backup(int buffers, float max_norm) {
  const int64_t n = checked_update_backup_size(params_, buffers, max_norm);
  // Zeroed by a memset, which starts after all earlier work of the stream: the update
  // writes its backup before the kernel ahead of it has finished, and a new block of the
  // allocator may have been that kernel's memory.
  if (n == 0) backup_ = Tensor();
  else if (backup_.numel() != n) backup_ = Tensor::zeros({n}, DType::f32, params_.device());
  return backup_;
}

StepCounter Optimizer::step_counter(float beta1, float beta2) const {
  ShadowRounding rounding = rounding_;
  rounding.first = begin_;  // the shard's element 0
  return {counter_, schedule_.args(), beta1, beta2, true, rounding};
}

void Optimizer::set_bf16_rounding(Bf16Rounding mode, uint64_t seed) {
  DPT_CHECK(mode == Bf16Rounding::nearest || mode == Bf16Rounding::stochastic, "set_bf16_rounding: no such rounding");
  rounding_ = {mode, seed, 0};
}

void Optimizer::refresh_shadow() { refresh_shadow_range(0, model_->flat_params().numel()); }

void Optimizer::refresh_shadow_outside_shard() {
  refresh_shadow_range(0, begin_);
  refresh_shadow_range(begin_ + params_.numel(), model_->flat_params().numel());
}

void Optimizer::refresh_shadow_range(int64_t begin, int64_t end) {
  const Tensor& shadow = model_->flat_shadow();
  if (!shadow.defined() || begin >= end) return;
  StepCounter step = step_counter(0.0f, 0.0f);
  step.rounding.first = begin;
  dpt::refresh_shadow(model_->flat_params().view(begin, {end - begin}), shadow.view(begin, {end - begin}), step);
}

void Optimizer::step_part(int64_t offset, int64_t count, bool last) {
  DPT_CHECK(begin_ == 0 && params_.numel() == model_->flat_params().numel(),
            "Optimizer::step_part: not for a ZeRO shard");
  const int64_t n = params_.numel();
  if (!(offset >= 0 && count >= 0 && offset <= n && count <= n - offset))  // no sum that can overflow
    throw UsageError("Optimizer::step_part: " + std::to_string(count) + " parameters from " + std::to_string(offset) +
                     " are outside the " + std::to_string(n));
  refuse_with_twins("step_part");
  StepCounter step = step_counter(0.0f, 0.0f);  // the optimizer's own betas: update_range's
  step.advance = last;
  step.rounding.first += offset;  // the part's element 0
  update_range(offset, count, step);
  if (last) ++t_;
}

Tensor Optimizer::part_of(const Tensor& t, int64_t offset, int64_t count) {
  return t.defined() ? t.view(offset, {count}) : Tensor();
}

}  // namespace dpt::optim
