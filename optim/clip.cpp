#include <dptrain/optim/clip.hpp>

#include <dptrain/error.hpp>
#include <dptrain/runtime/ops.hpp>

namespace dpt::optim {

Tensor clip_grad_norm(nn::Module& model, float max_norm, Tensor* norm_sq) {
  DPT_CHECK(max_norm > 0.0f, "clip_grad_norm needs max_norm > 0");
  model.settle_grads();  // gradients backward did not reach count as zeros
  Tensor sq = sum_squares(model.flat_grads());
  if (norm_sq) *norm_sq = sq;
  return clip_coef(sq, max_norm);
}

}  // namespace dpt::optim
