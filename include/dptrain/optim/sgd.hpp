// SGD with momentum, dampening, Nesterov and weight decay, as torch.optim.SGD.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <dptrain/optim/optimizer.hpp>

namespace dpt::optim {

class SGD : public Optimizer {
 public:
  // lr, momentum, dampening, weight_decay, nesterov: the arguments the update kernel takes
  // (lr: of every step, until set_schedule gives a schedule). UsageError naming the field
  // unless lr > 0, momentum in [0, 1), dampening in [0, 1] and weight_decay >= 0 (finite).
  using Options = SgdArgs;
  SGD(nn::Module& model, const Options& o);
  void step(const Tensor& grad_scale = {}) override;
  Tensor checked_step(float max_norm, const CheckRing& ring = {}) override;
  std::string describe() const override;
  std::vector<std::pair<std::string, Tensor>> state() const override;
  std::vector<std::string> state_names() const override;
  const Tensor& momentum_buffer() const { return buf_; }

 private:
  void update_range(int64_t offset, int64_t count, const StepCounter& step) override;
  void reset_state(int64_t n) override;
  Options o_;
  Tensor buf_;
};

}  // namespace dpt::optim
