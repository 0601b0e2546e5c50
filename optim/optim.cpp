#include <dptrain/optim/optim.hpp>

#include <cmath>
#include <cstdio>
#include <numbers>

#include <dptrain/error.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>

namespace dpt::optim {

Optimizer::Optimizer(nn::Module& model, float lr) : model_(&model), lr_(lr) {
  DPT_CHECK(model.materialized(), "an optimizer needs a module placed on a device (Module::to)");
  params_ = model.flat_params();
  grads_ = model.flat_grads();
}

SGD::SGD(nn::Module& model, const Options& o) : Optimizer(model, o.lr), o_(o) {
  if (o.nesterov && (o.momentum <= 0.0f || o.dampening != 0.0f)) {
    char got[64];
    std::snprintf(got, sizeof got, "got momentum %g and dampening %g", static_cast<double>(o.momentum),
                  static_cast<double>(o.dampening));
    throw UsageError(std::string("SGD::Options::nesterov needs SGD::Options::momentum > 0 and dampening 0, ") + got);
  }
  if (o.momentum != 0.0f) buf_ = Tensor::zeros(params_.shape(), DType::f32, params_.device());
}

void SGD::step(const Tensor& grad_scale) {
  model_->settle_grads();
  SgdArgs a = o_;
  a.lr = lr_;
  sgd_step(params_, grads_, buf_, a, grad_scale, shadow());
  ++t_;
}

std::vector<std::pair<std::string, Tensor>> SGD::state() const {
  if (!buf_.defined()) return {};
  return {{"optimizer.momentum_buffer", buf_}};
}

std::string SGD::describe() const {
  return "SGD(lr=" + format_float(lr_) + ", momentum=" + format_float(o_.momentum) + (o_.nesterov ? ", nesterov" : "") +
         ", weight_decay=" + format_float(o_.weight_decay) + ")";
}

AdamW::AdamW(nn::Module& model, const Options& o) : Optimizer(model, o.lr), o_(o) {
  m_ = Tensor::zeros(params_.shape(), DType::f32, params_.device());
  v_ = Tensor::zeros(params_.shape(), DType::f32, params_.device());
}

void AdamW::step(const Tensor& grad_scale) {
  model_->settle_grads();
  ++t_;
  AdamArgs a{lr_,
             o_.beta1,
             o_.beta2,
             o_.eps,
             o_.weight_decay,
             1.0f - std::pow(o_.beta1, static_cast<float>(t_)),
             1.0f - std::pow(o_.beta2, static_cast<float>(t_))};
  adamw_step(params_, grads_, m_, v_, a, grad_scale, shadow());
}

std::vector<std::pair<std::string, Tensor>> AdamW::state() const {
  return {{"optimizer.exp_avg", m_}, {"optimizer.exp_avg_sq", v_}};
}

std::string AdamW::describe() const {
  return "AdamW(lr=" + format_float(lr_) + ", betas=(" + format_float(o_.beta1) + ", " + format_float(o_.beta2) +
         "), eps=" + format_float(o_.eps) + ", weight_decay=" + format_float(o_.weight_decay) + ")";
}

float Schedule::at(int64_t step) const {
  if (kind != Kind::constant && step < warmup)
    return base_lr * static_cast<float>(step + 1) / static_cast<float>(warmup);
  if (kind == Kind::cosine) {
    const double span = static_cast<double>(std::max<int64_t>(1, total - warmup));
    const double t = std::min(1.0, static_cast<double>(step - warmup) / span);
    return static_cast<float>(0.5 * base_lr * (1.0 + std::cos(std::numbers::pi * t)));
  }
  return base_lr;
}

Schedule::Kind parse_schedule(const std::string& name) {
  if (name == "constant") return Schedule::Kind::constant;
  if (name == "warmup") return Schedule::Kind::warmup;
  if (name == "cosine") return Schedule::Kind::cosine;
  throw UsageError("unknown schedule '" + name + "': expected constant, warmup or cosine");
}

Tensor clip_grad_norm(nn::Module& model, float max_norm, Tensor* norm_sq) {
  DPT_CHECK(max_norm > 0.0f, "clip_grad_norm needs max_norm > 0");
  model.settle_grads();  // gradients backward did not reach count as zeros
  Tensor sq = sum_squares(model.flat_grads());
  if (norm_sq) *norm_sq = sq;
  return clip_coef(sq, max_norm);
}

}  // namespace dpt::optim
