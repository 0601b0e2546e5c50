// AdamW (decoupled weight decay), as torch.optim.AdamW; the decay skips the parameters
// that say so (nn::Parameter::decay: a GPT's biases and LayerNorms, as nanoGPT's groups).
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <dptrain/optim/optimizer.hpp>

namespace dpt::optim {

class AdamW : public Optimizer {
 public:
  // lr, beta1, beta2, eps, weight_decay (lr: of every step, until set_schedule gives a
  // schedule). UsageError naming the field unless lr and eps are positive, the betas in
  // [0, 1) and weight_decay >= 0 (finite).
  using Options = AdamHyperparams;
  AdamW(nn::Module& model, const Options& o);
  void step(const Tensor& grad_scale = {}) override;
  Tensor checked_step(float max_norm, const CheckRing& ring = {}) override;
  std::string describe() const override;
  std::vector<std::pair<std::string, Tensor>> state() const override;
  std::vector<std::string> state_names() const override { return {"optimizer.exp_avg", "optimizer.exp_avg_sq"}; }
  const Tensor& exp_avg() const { return m_; }
  const Tensor& exp_avg_sq() const { return v_; }

 private:
  void update_range(int64_t offset, int64_t count, const StepCounter& step) override;
  AdamArgs update_args() const;  // the update kernel's arguments (lr and corrections come from the counter)
  void reset_state(int64_t n) override;
  Options o_;
  Tensor m_, v_;
  Tensor decay_chunks_;  // AdamArgs::decay_chunks of the whole buffer (undefined: decay everywhere)
};

}  // namespace dpt::optim
