// Losses as modules-in-spirit: a callable from (prediction, target) to a scalar tensor.
#pragma once
#include <dptrain/runtime/ops.hpp>

namespace dpt::nn {

// Mean of (y - target)^2 over every element, like torch.nn.MSELoss().
struct MSELoss {
  Tensor operator()(const Tensor& y, const Tensor& target) const { return mse_loss(y, target); }
};

// Softmax cross-entropy over classes, mean over the batch, like torch.nn.CrossEntropyLoss();
// labels are i32 class indices.
struct CrossEntropyLoss {
  Tensor operator()(const Tensor& logits, const Tensor& labels) const { return cross_entropy(logits, labels); }
};

}  // namespace dpt::nn
