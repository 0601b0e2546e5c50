// The losses and the accuracy: mse_loss, cross_entropy (both differentiable) and accuracy.
#include <string>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/ops.hpp>
#include "internal.hpp"
#include "kernels/cpu/cpu.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/cuda.hpp"
#endif

namespace dpt {

using namespace detail;

namespace {

class MseNode : public Node {
 public:
  // dy_unit: the gradient for a seed of 1, which the forward kernel wrote alongside the loss.
  MseNode(Tensor y, Tensor t, Tensor dy_unit) : y_(y.untracked()), t_(t.untracked()), dy_unit_(std::move(dy_unit)) {}
  const char* name() const override { return "mse_loss"; }
  void backward(Tensor& dloss, Grads& grads) override { give(grads, 0, gradient(dloss.f32(), 1.0f)); }
  // (The gradient has y's type: f32 or bf16.)
  bool backward_scalar(float seed, Grads& grads) override {
    // The precomputed gradient is handed over (the next node may overwrite it), once,
    // scaled in place for a seed other than 1 (a replica's share of the batch): one pass
    // over it instead of recomputing it from y and t.
    // A bf16 gradient is recomputed instead: scaling the rounded one would round twice,
    // and a replica's share of the batch would no longer give exactly one device's values.
    Tensor g = std::move(dy_unit_);
    dy_unit_ = Tensor();
    if (!g.defined() || (seed != 1.0f && g.dtype() == DType::bf16)) g = gradient(nullptr, seed);
    else if (seed != 1.0f) axpy_(seed - 1.0f, g, g);  // g += (seed - 1) g
    give(grads, 0, std::move(g));
    return true;
  }

 private:
  Tensor gradient(const float* dloss, float scale) const {
    const Device d = y_.device();
    Tensor dy = Tensor::empty(y_.shape(), y_.dtype(), d);
    if (is_bf16(y_)) {
      DPT_CUDA_OR_CPU(d,
                      cuda::mse_backward_bf16(y_.bf16(), t_.f32(), y_.numel(), dloss, scale, dy.bf16(), stream_of(d)),
                      cpu::mse_backward_bf16(y_.bf16(), t_.f32(), y_.numel(), dloss, scale, dy.bf16()));
      return dy;
    }
    DPT_CUDA_OR_CPU(d, cuda::mse_backward(y_.f32(), t_.f32(), y_.numel(), dloss, scale, dy.f32(), stream_of(d)),
                    cpu::mse_backward(y_.f32(), t_.f32(), y_.numel(), dloss, scale, dy.f32()));
    return dy;
  }
  Tensor y_, t_, dy_unit_;
};

class CrossEntropyNode : public Node {
 public:
  CrossEntropyNode(Tensor logits, Tensor labels) : logits_(logits.untracked()), labels_(labels.untracked()) {}
  const char* name() const override { return "cross_entropy"; }
  void backward(Tensor& dloss, Grads& grads) override {
    const Device d = logits_.device();
    const int64_t rows = logits_.size(0), cols = logits_.size(1);
    Tensor dl = Tensor::empty(logits_.shape(), logits_.dtype(), d);
    if (is_bf16(logits_)) {
      DPT_CUDA_OR_CPU(
          d,
          cuda::cross_entropy_backward_bf16(logits_.bf16(), labels_.i32(), rows, cols, dloss.f32(), dl.bf16(),
                                            stream_of(d)),
          cpu::cross_entropy_backward_bf16(logits_.bf16(), labels_.i32(), rows, cols, dloss.f32(), dl.bf16()));
      give(grads, 0, dl);
      return;
    }
    DPT_CUDA_OR_CPU(
        d, cuda::cross_entropy_backward(logits_.f32(), labels_.i32(), rows, cols, dloss.f32(), dl.f32(), stream_of(d)),
        cpu::cross_entropy_backward(logits_.f32(), labels_.i32(), rows, cols, dloss.f32(), dl.f32()));
    give(grads, 0, dl);
  }

 private:
  Tensor logits_, labels_;
};

}  // namespace

Tensor mse_loss(const Tensor& y, const Tensor& target) {
  need_float(y, "mse_loss");
  need_f32(target, "mse_loss");
  same_device(y, target, "mse_loss");
  DPT_REQUIRE(y.shape() == target.shape(),
              "mse_loss: prediction " + shape_str(y.shape()) + " and target " + shape_str(target.shape()));
  DPT_REQUIRE(y.numel() > 0, "mse_loss of an empty tensor");
  const Device d = y.device();
  Tensor loss = Tensor::empty({1}, DType::f32, d);
  const bool grad = any_requires_grad({&y});
  Tensor dy = grad ? Tensor::empty(y.shape(), y.dtype(), d) : Tensor();
  if (is_bf16(y)) {
    uint16_t* dyp = grad ? dy.bf16() : nullptr;
    DPT_CUDA_OR_CPU(d,
                    cuda::mse_forward_bf16(y.bf16(), target.f32(), y.numel(), loss.f32(), dyp, reduce_work(d, 0).f32(),
                                           context(d).counter(), stream_of(d)),
                    cpu::mse_forward_bf16(y.bf16(), target.f32(), y.numel(), loss.f32(), dyp));
  } else {
    float* dyp = grad ? dy.f32() : nullptr;
    DPT_CUDA_OR_CPU(d,
                    cuda::mse_forward(y.f32(), target.f32(), y.numel(), loss.f32(), dyp, reduce_work(d, 0).f32(),
                                      context(d).counter(), stream_of(d)),
                    cpu::mse_forward(y.f32(), target.f32(), y.numel(), loss.f32(), dyp));
  }
  if (grad) record(loss, std::make_shared<MseNode>(y, target, dy), {y});
  return loss;
}

namespace {
// Logits [rows, classes] (f32 or bf16) and i32 labels [rows], on one device, neither empty.
void need_logits_labels(const Tensor& logits, const Tensor& labels, const char* op) {
  need_float(logits, op);
  DPT_REQUIRE(labels.defined() && labels.dtype() == DType::i32, std::string(op) + ": labels must be i32");
  same_device(logits, labels, op);
  DPT_REQUIRE(logits.dim() == 2 && labels.dim() == 1 && labels.size(0) == logits.size(0) && logits.size(0) > 0 &&
                  logits.size(1) > 0,
              std::string(op) + ": logits " + shape_str(logits.shape()) + " and labels " + shape_str(labels.shape()));
}
}  // namespace

Tensor accuracy(const Tensor& logits, const Tensor& labels) {
  need_logits_labels(logits, labels, "accuracy");
  const Device d = logits.device();
  const int64_t rows = logits.size(0), cols = logits.size(1);
  Tensor out = Tensor::empty({1}, DType::f32, d);
  if (is_bf16(logits)) {
    DPT_CUDA_OR_CPU(d,
                    cuda::accuracy_bf16(logits.bf16(), labels.i32(), rows, cols, out.f32(), reduce_work(d, rows).f32(),
                                        stream_of(d)),
                    cpu::accuracy_bf16(logits.bf16(), labels.i32(), rows, cols, out.f32()));
  } else {
    DPT_CUDA_OR_CPU(
        d, cuda::accuracy(logits.f32(), labels.i32(), rows, cols, out.f32(), reduce_work(d, rows).f32(), stream_of(d)),
        cpu::accuracy(logits.f32(), labels.i32(), rows, cols, out.f32()));
  }
  return out;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& labels) {
  need_logits_labels(logits, labels, "cross_entropy");
  const Device d = logits.device();
  const int64_t rows = logits.size(0), cols = logits.size(1);
  Tensor loss = Tensor::empty({1}, DType::f32, d);
  if (is_bf16(logits)) {
    DPT_CUDA_OR_CPU(d,
                    cuda::cross_entropy_forward_bf16(logits.bf16(), labels.i32(), rows, cols, loss.f32(),
                                                     reduce_work(d, rows).f32(), stream_of(d)),
                    cpu::cross_entropy_forward_bf16(logits.bf16(), labels.i32(), rows, cols, loss.f32()));
  } else {
    DPT_CUDA_OR_CPU(d,
                    cuda::cross_entropy_forward(logits.f32(), labels.i32(), rows, cols, loss.f32(),
                                                reduce_work(d, rows).f32(), stream_of(d)),
                    cpu::cross_entropy_forward(logits.f32(), labels.i32(), rows, cols, loss.f32()));
  }
  if (any_requires_grad({&logits})) record(loss, std::make_shared<CrossEntropyNode>(logits, labels), {logits});
  return loss;
}

}  // namespace dpt
