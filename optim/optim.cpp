#include <dptrain/optim/optim.hpp>

#include <cmath>
#include <cstdio>

#include <dptrain/error.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>
#include "kernels/schedule.hpp"

namespace dpt::optim {

namespace {
// UsageError naming the field and the value unless `ok` (NaN fails every rule below).
void need(bool ok, const std::string& field, const char* rule, double value) {
  if (ok) return;
  char got[32];
  std::snprintf(got, sizeof got, "%g", value);
  throw UsageError(field + " must be " + rule + ", got " + got);
}
void need_lr(float lr, const std::string& field) {
  need(lr > 0.0f && std::isfinite(lr), field, "a positive number", lr);
}
void need_unit(float v, const std::string& field) { need(v >= 0.0f && v < 1.0f, field, "in [0, 1)", v); }
void need_decay(float v, const std::string& field) {
  need(v >= 0.0f && std::isfinite(v), field, "a finite number >= 0", v);
}
}  // namespace

void Optimizer::set_schedule(const Schedule& schedule) {
  need_lr(schedule.base_lr, "Schedule::base_lr");
  need(schedule.warmup >= 0, "Schedule::warmup", ">= 0", static_cast<double>(schedule.warmup));
  need(schedule.total >= 1, "Schedule::total", ">= 1", static_cast<double>(schedule.total));
  schedule_ = schedule;
}

Optimizer::Optimizer(nn::Module& model, float lr) : model_(&model), schedule_(Schedule::constant_lr(lr)) {
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
  return {counter_, schedule_.args(), beta1, beta2};
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
  update_range(offset, count, step);
  if (last) ++t_;
}

namespace {
Tensor part_of(const Tensor& t, int64_t offset, int64_t count) {
  return t.defined() ? t.view(offset, {count}) : Tensor();
}
}  // namespace

SGD::SGD(nn::Module& model, const Options& o) : Optimizer(model, o.lr), o_(o) {
  need_lr(o.lr, "SGD::Options::lr");
  need_unit(o.momentum, "SGD::Options::momentum");
  need(o.dampening >= 0.0f && o.dampening <= 1.0f, "SGD::Options::dampening", "in [0, 1]", o.dampening);
  need_decay(o.weight_decay, "SGD::Options::weight_decay");
  if (o.nesterov && (o.momentum <= 0.0f || o.dampening != 0.0f)) {
    char got[64];
    std::snprintf(got, sizeof got, "got momentum %g and dampening %g", static_cast<double>(o.momentum),
                  static_cast<double>(o.dampening));
    throw UsageError(std::string("SGD::Options::nesterov needs SGD::Options::momentum > 0 and dampening 0, ") + got);
  }
  reset_state(params_.numel());
}

void SGD::reset_state(int64_t n) {
  buf_ = o_.momentum != 0.0f && n > 0 ? Tensor::zeros({n}, DType::f32, params_.device()) : Tensor();
}

void SGD::step(const Tensor& grad_scale) {
  refuse_with_twins("step");
  model_->settle_grads();
  const StepCounter step = step_counter(0.0f, 0.0f);                 // SGD reads only the lr
  sgd_step(params_, grads_, buf_, o_, grad_scale, shadow(), &step);  // an empty shard counts its step too
  ++t_;                                                              // the host's count, once it is queued
}

Tensor SGD::checked_step(float max_norm, const CheckRing& ring) {
  begin_checked_step(max_norm);
  if (twin_buffers()) {
    const Tensor scale = alternating_sgd_step(params_, grads_, buf_, twin(0), buf_.defined() ? twin(1) : Tensor(), o_,
                                              ring, shadow(), step_counter(0.0f, 0.0f), t_);
    swap_twins();
    ++t_;
    return scale;
  }
  const Tensor scale = checked_sgd_step(params_, grads_, buf_, o_, max_norm, ring, shadow(), step_counter(0.0f, 0.0f),
                                        backup(o_.momentum != 0.0f ? 2 : 1, max_norm));
  ++t_;
  return scale;
}

void SGD::update_range(int64_t offset, int64_t count, const StepCounter& step) {
  sgd_step(part_of(params_, offset, count), part_of(grads_, offset, count), part_of(buf_, offset, count), o_, {},
           part_of(shadow(), offset, count), &step);
}

std::vector<std::pair<std::string, Tensor>> SGD::state() const {
  if (!buf_.defined()) return {};
  return {{"optimizer.momentum_buffer", buf_}};
}

std::vector<std::string> SGD::state_names() const {
  if (o_.momentum == 0.0f) return {};
  return {"optimizer.momentum_buffer"};
}

std::string SGD::describe() const {
  return "SGD(lr=" + format_float(schedule_.base_lr) + ", momentum=" + format_float(o_.momentum) +
         (o_.nesterov ? ", nesterov" : "") + ", weight_decay=" + format_float(o_.weight_decay) + ")";
}

AdamW::AdamW(nn::Module& model, const Options& o) : Optimizer(model, o.lr), o_(o) {
  need_lr(o.lr, "AdamW::Options::lr");
  need_unit(o.beta1, "AdamW::Options::beta1");
  need_unit(o.beta2, "AdamW::Options::beta2");
  need(o.eps > 0.0f && std::isfinite(o.eps), "AdamW::Options::eps", "a positive number", o.eps);
  need_decay(o.weight_decay, "AdamW::Options::weight_decay");
  reset_state(params_.numel());
}

void AdamW::reset_state(int64_t n) {
  m_ = n > 0 ? Tensor::zeros({n}, DType::f32, params_.device()) : Tensor();
  v_ = n > 0 ? Tensor::zeros({n}, DType::f32, params_.device()) : Tensor();
}

AdamArgs AdamW::update_args() const {
  return {o_.lr, o_.beta1, o_.beta2, o_.eps, o_.weight_decay, 1.0f, 1.0f};  // lr, corrections: the counter's
}

void AdamW::step(const Tensor& grad_scale) {
  refuse_with_twins("step");
  model_->settle_grads();
  const StepCounter step = step_counter(o_.beta1, o_.beta2);
  const AdamArgs a = update_args();
  adamw_step(params_, grads_, m_, v_, a, grad_scale, shadow(), &step);  // an empty shard counts its step too
  ++t_;                                                                 // the host's count, once it is queued
}

Tensor AdamW::checked_step(float max_norm, const CheckRing& ring) {
  begin_checked_step(max_norm);
  const AdamArgs a = update_args();
  if (twin_buffers()) {
    const Tensor scale = alternating_adamw_step(params_, grads_, m_, v_, twin(0), twin(1), twin(2), a, ring, shadow(),
                                                step_counter(o_.beta1, o_.beta2), t_);
    swap_twins();
    ++t_;
    return scale;
  }
  const Tensor scale = checked_adamw_step(params_, grads_, m_, v_, a, max_norm, ring, shadow(),
                                          step_counter(o_.beta1, o_.beta2), backup(3, max_norm));
  ++t_;
  return scale;
}

void AdamW::update_range(int64_t offset, int64_t count, const StepCounter& step) {
  StepCounter with_betas = step;
  with_betas.beta1 = o_.beta1;
  with_betas.beta2 = o_.beta2;
  adamw_step(part_of(params_, offset, count), part_of(grads_, offset, count), part_of(m_, offset, count),
             part_of(v_, offset, count), update_args(), {}, part_of(shadow(), offset, count), &with_betas);
}

std::vector<std::pair<std::string, Tensor>> AdamW::state() const {
  if (!m_.defined()) return {};
  return {{"optimizer.exp_avg", m_}, {"optimizer.exp_avg_sq", v_}};
}

std::string AdamW::describe() const {
  return "AdamW(lr=" + format_float(schedule_.base_lr) + ", betas=(" + format_float(o_.beta1) + ", " +
         format_float(o_.beta2) + "), eps=" + format_float(o_.eps) + ", weight_decay=" + format_float(o_.weight_decay) +
         ")";
}

ScheduleArgs Schedule::args() const {
  return {kind == Kind::constant ? 0 : kind == Kind::warmup ? 1 : 2, base_lr, warmup, total};
}

float Schedule::at(int64_t step) const { return schedule_lr(args(), step); }

Schedule::Kind parse_schedule(const std::string& name) { return kScheduleNames.parse(name); }

Tensor clip_grad_norm(nn::Module& model, float max_norm, Tensor* norm_sq) {
  DPT_CHECK(max_norm > 0.0f, "clip_grad_norm needs max_norm > 0");
  model.settle_grads();  // gradients backward did not reach count as zeros
  Tensor sq = sum_squares(model.flat_grads());
  if (norm_sq) *norm_sq = sq;
  return clip_coef(sq, max_norm);
}

}  // namespace dpt::optim
