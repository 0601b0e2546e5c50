// Global gradient-norm clipping, as torch.nn.utils.clip_grad_norm_, without a host wait.
#pragma once
#include <dptrain/layers/module.hpp>
#include <dptrain/runtime/tensor.hpp>

namespace dpt::optim {

// Global gradient-norm clipping: returns the device scalar min(1, max_norm / ||g||)
// that Optimizer::step applies (no host synchronization), and ||g||^2 in norm_sq.
Tensor clip_grad_norm(nn::Module& model, float max_norm, Tensor* norm_sq = nullptr);

}  // namespace dpt::optim
