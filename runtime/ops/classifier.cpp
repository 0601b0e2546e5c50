// classifier_loss: the language model's softmax cross-entropy in one pass. The forward
// writes the gradient over the logits (no second [N, Vp] buffer); the backward hands that
// memory over as the logits' gradient.
#include <string>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/ops.hpp>
#include "internal.hpp"
#include "kernels/cpu/cpu.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/cuda.hpp"
#endif

namespace dpt {

using namespace detail;

namespace {

class ClassifierNode : public Node {
 public:
  // grad: the logits' memory, holding the gradient for a seed of 1.
  explicit ClassifierNode(Tensor grad) : grad_(grad.untracked()) {}
  const char* name() const override { return "classifier_loss"; }
  void backward(Tensor& dloss, Grads& grads) override { give(grads, 0, scaled(dloss.f32(), 1.0f)); }
  bool backward_scalar(float seed, Grads& grads) override {
    give(grads, 0, scaled(nullptr, seed));
    return true;
  }

 private:
  // The gradient, handed over once, scaled in place unless the factor is 1 (a replica's
  // share of the batch is not): a bf16 one is then rounded twice, there being no logits
  // left to compute it from again.
  Tensor scaled(const float* dloss, float scale) {
    DPT_CHECK(grad_.defined(), "classifier_loss: its gradient was handed over already");
    Tensor g = std::move(grad_);
    grad_ = Tensor();
    if (!dloss && scale == 1.0f) return g;
    const Device d = g.device();
    if (is_bf16(g)) {
      DPT_CUDA_OR_CPU(d, cuda::classifier_grad_scale_bf16(g.bf16(), g.numel(), dloss, scale, stream_of(d)),
                      cpu::classifier_grad_scale_bf16(g.bf16(), g.numel(), dloss, scale));
    } else {
      DPT_CUDA_OR_CPU(d, cuda::classifier_grad_scale(g.f32(), g.numel(), dloss, scale, stream_of(d)),
                      cpu::classifier_grad_scale(g.f32(), g.numel(), dloss, scale));
    }
    return g;
  }
  Tensor grad_;
};

}  // namespace

Tensor classifier_loss(const Tensor& logits, const Tensor& targets, int64_t vocab) {
  need_float(logits, "classifier_loss");
  DPT_REQUIRE(targets.defined() && targets.dtype() == DType::i32, "classifier_loss: targets must be i32");
  same_device(logits, targets, "classifier_loss");
  DPT_REQUIRE(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0) && logits.size(0) > 0 &&
                  vocab > 0 && vocab <= logits.size(1),
              "classifier_loss: logits " + shape_str(logits.shape()) + ", targets " + shape_str(targets.shape()) +
                  " and vocab " + std::to_string(vocab));
  const Device d = logits.device();
  const int64_t rows = logits.size(0), cols = logits.size(1);
  Tensor loss = Tensor::empty({1}, DType::f32, d);
  const bool grad = any_requires_grad({&logits});
  if (is_bf16(logits)) {
    DPT_CUDA_OR_CPU(d,
                    cuda::classifier_forward_bf16(logits.bf16(), targets.i32(), rows, cols, vocab, loss.f32(), grad,
                                                  reduce_work(d, rows).f32(), stream_of(d)),
                    cpu::classifier_forward_bf16(logits.bf16(), targets.i32(), rows, cols, vocab, loss.f32(), grad));
  } else {
    DPT_CUDA_OR_CPU(d,
                    cuda::classifier_forward(logits.f32(), targets.i32(), rows, cols, vocab, loss.f32(), grad,
                                             reduce_work(d, rows).f32(), stream_of(d)),
                    cpu::classifier_forward(logits.f32(), targets.i32(), rows, cols, vocab, loss.f32(), grad));
  }
  if (grad) record(loss, std::make_shared<ClassifierNode>(logits), {logits});
  return loss;
}

}  // namespace dpt
