#include <dptrain/optim/adamw.hpp>

#include <cmath>
#include <string>

#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>

#include "checks.hpp"

namespace dpt::optim {

AdamW::AdamW(nn::Module& model, const Options& o) : Optimizer(model, o.lr, "adamw"), o_(o) {
  need_lr(o.lr, "AdamW::Options::lr");
  need_unit(o.beta1, "AdamW::Options::beta1");
  need_unit(o.beta2, "AdamW::Options::beta2");
  need(o.eps > 0.0f && std::isfinite(o.eps), "AdamW::Options::eps", "a positive number", o.eps);
  need_decay(o.weight_decay, "AdamW::Options::weight_decay");
  reset_state(params_.numel());
  // One flag a 64 floats of the flat buffer (parameters start at such multiples).
  int64_t total = 0;
  const std::vector<int64_t> offsets = model.layout(&total);
  const std::vector<nn::Parameter*> params = model.parameters();
  std::vector<int32_t> chunks(static_cast<size_t>((total + nn::Module::kAlign - 1) / nn::Module::kAlign), 1);
  bool any_off = false;
  for (size_t k = 0; k < params.size(); ++k) {
    if (params[k]->decay) continue;
    any_off = true;
    const int64_t end = offsets[k] + numel(params[k]->shape);
    for (int64_t c = offsets[k] / nn::Module::kAlign; c * nn::Module::kAlign < end; ++c)
      chunks[static_cast<size_t>(c)] = 0;
  }
  if (any_off && o.weight_decay != 0.0f)
    decay_chunks_ = Tensor::from_host_i32(chunks, {static_cast<int64_t>(chunks.size())}, model.flat_params().device());
}

void AdamW::reset_state(int64_t n) {
  m_ = n > 0 ? Tensor::zeros({n}, DType::f32, params_.device()) : Tensor();
  v_ = n > 0 ? Tensor::zeros({n}, DType::f32, params_.device()) : Tensor();
}

AdamArgs AdamW::update_args() const {
  AdamArgs a{o_, 1.0f, 1.0f};  // lr, corrections: the counter's
  if (decay_chunks_.defined()) {
    a.decay_chunks = decay_chunks_.i32();
    a.first = shard_begin();
  }
  return a;
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
  AdamArgs a = update_args();
  a.first += offset;
  adamw_step(part_of(params_, offset, count), part_of(grads_, offset, count), part_of(m_, offset, count),
             part_of(v_, offset, count), a, {}, part_of(shadow(), offset, count), &with_betas);
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

}  // namespace dpt::optim
