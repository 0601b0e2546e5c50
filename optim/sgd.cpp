#include <dptrain/optim/sgd.hpp>

#include <cstdio>
#include <string>

#include <dptrain/error.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>

#include "checks.hpp"

namespace dpt::optim {

SGD::SGD(nn::Module& model, const Options& o) : Optimizer(model, o.lr, "sgd"), o_(o) {
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

}  // namespace dpt::optim
