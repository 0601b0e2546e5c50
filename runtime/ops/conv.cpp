// The convolutional-network ops (ops.hpp, last section): conv2d, pool2d, batch_norm2d
// and flatten over NCHW tensors. The CPU runs the plain kernels of kernels/cpu/conv.cpp;
// a GPU runs their cuDNN twins (kernels/cuda/dnn.hpp) when the build has cuDNN.
#include <algorithm>
#include <string>

#include <dptrain/error.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/ops.hpp>
#include "internal.hpp"
#include "kernels/cpu/cpu.hpp"

#if DPT_WITH_CUDNN
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/dnn.hpp"
#endif

namespace dpt {

using namespace detail;

namespace {

#if DPT_WITH_CUDNN
// The cuDNN handle of the device's current context (bound to its stream), with the
// device made current.
cudnnHandle_t dnn_of(const Device& d) {
  cuda::set_device(d.index);
  return static_cast<cudnnHandle_t>(context(d).dnn());
}
// The workspace of the convolution passes of shape s: a temporary from the caching
// allocator (f32 elements, rounded up), so a step makes no cudaMalloc.
struct Workspace {
  Tensor t;
  size_t bytes;
};
Workspace workspace(const Device& d, const ConvShape& s) {
  const size_t bytes = cuda::conv2d_workspace_bytes(dnn_of(d), context(d).precision, s);
  const auto floats = static_cast<int64_t>(std::max<size_t>(1, (bytes + sizeof(float) - 1) / sizeof(float)));
  return {Tensor::empty({floats}, DType::f32, d), bytes};
}
#endif

// Where the gradients of a layer's weight (input 1) and bias (input 2, when b is
// defined) go: straight into their accumulators in the flat gradient buffer when both
// have one (the usual case, as linear's GEMM does; beta 0 over what zero_grad() left,
// else 1), else into fresh tensors that hand_over() gives to the engine.
struct ParamGrads {
  Tensor dw, db;
  float beta;
  bool in_place;
};

ParamGrads param_grads(const Grads& grads, const Tensor& w, const Tensor& b) {
  const Tensor acc_w = grads.accumulator(1), acc_b = b.defined() ? grads.accumulator(2) : Tensor();
  // One beta serves both: in place only when both are stale (overwrite) or both not (add).
  if (grads.needed(1) && acc_w.defined() &&
      (!b.defined() || (grads.needed(2) && acc_b.defined() && grads.stale(2) == grads.stale(1)))) {
    const float beta = grads.take_beta(1);
    if (b.defined()) grads.take_beta(2);
    return {acc_w, acc_b, beta, true};
  }
  return {Tensor::empty(w.shape(), DType::f32, w.device()),
          b.defined() ? Tensor::empty(b.shape(), DType::f32, b.device()) : Tensor(), 0.0f, false};
}

void hand_over(Grads& grads, const ParamGrads& g) {
  if (g.in_place) return;
  if (grads.needed(1)) give(grads, 1, g.dw);
  if (g.db.defined() && grads.needed(2)) give(grads, 2, g.db);
}

class Conv2dNode : public Node {
 public:
  Conv2dNode(Tensor x, Tensor w, Tensor b, const ConvShape& s)
      : x_(x.untracked()), w_(w.untracked()), b_(b.defined() ? b.untracked() : Tensor()), s_(s) {}
  const char* name() const override { return "conv2d"; }
  void backward(Tensor& dy, Grads& grads) override {
    const Device d = dy.device();
    if (grads.needed(0)) {
      Tensor dx = Tensor::empty(x_.shape(), DType::f32, d);
      DPT_DNN_OR_CPU(
          d,
          {
            Workspace ws = workspace(d, s_);
            cuda::conv2d_backward_data(dnn_of(d), context(d).precision, s_, dy.f32(), w_.f32(), dx.f32(), ws.t.data(),
                                       ws.bytes);
          },
          cpu::conv2d_backward_data(s_, dy.f32(), w_.f32(), dx.f32()));
      give(grads, 0, dx);
    }
    if (!grads.needed(1) && !(b_.defined() && grads.needed(2))) return;
    const ParamGrads g = param_grads(grads, w_, b_);
    float* db = g.db.defined() ? g.db.f32() : nullptr;
    DPT_DNN_OR_CPU(
        d,
        {
          Workspace ws = workspace(d, s_);
          cuda::conv2d_backward_filter(dnn_of(d), static_cast<cublasHandle_t>(context(d).blas()), context(d).precision,
                                       s_, x_.f32(), dy.f32(), g.beta, g.dw.f32(), db, ws.t.data(), ws.bytes);
        },
        cpu::conv2d_backward_filter(s_, x_.f32(), dy.f32(), g.beta, g.dw.f32(), db));
    hand_over(grads, g);
  }

 private:
  Tensor x_, w_, b_;
  ConvShape s_;
};

class Pool2dNode : public Node {
 public:
  Pool2dNode(Tensor x, Tensor y, const PoolShape& s, Pool kind)
      : x_(x.untracked()), y_(y.untracked()), s_(s), kind_(kind) {}
  const char* name() const override { return "pool2d"; }
  void backward(Tensor& dy, Grads& grads) override {
    const Device d = dy.device();
    Tensor dx = Tensor::empty(x_.shape(), DType::f32, d);
    DPT_DNN_OR_CPU(d, cuda::pool2d_backward(dnn_of(d), s_, kind_, x_.f32(), y_.f32(), dy.f32(), dx.f32()),
                   cpu::pool2d_backward(s_, kind_, x_.f32(), y_.f32(), dy.f32(), dx.f32()));
    give(grads, 0, dx);
  }

 private:
  Tensor x_, y_;
  PoolShape s_;
  Pool kind_;
};

// Inputs x, gamma, beta; the batch's mean and inverse standard deviation are saved by
// the forward pass.
class BatchNormNode : public Node {
 public:
  BatchNormNode(Tensor x, Tensor gamma, Tensor beta, Tensor save_mean, Tensor save_invstd)
      : x_(x.untracked()),
        gamma_(gamma.untracked()),
        beta_(beta.untracked()),
        mean_(std::move(save_mean)),
        invstd_(std::move(save_invstd)) {}
  const char* name() const override { return "batch_norm2d"; }
  void backward(Tensor& dy, Grads& grads) override {
    const Device d = dy.device();
    const int64_t n = x_.size(0), c = x_.size(1), hw = x_.size(2) * x_.size(3);
    // One kernel makes all three gradients, whichever are needed.
    Tensor dx = Tensor::empty(x_.shape(), DType::f32, d);
    const ParamGrads g = param_grads(grads, gamma_, beta_);
    DPT_DNN_OR_CPU(d,
                   cuda::batchnorm_backward(dnn_of(d), n, c, hw, x_.f32(), dy.f32(), gamma_.f32(), mean_.f32(),
                                            invstd_.f32(), dx.f32(), g.beta, g.dw.f32(), g.db.f32()),
                   cpu::batchnorm_backward(n, c, hw, x_.f32(), dy.f32(), gamma_.f32(), mean_.f32(), invstd_.f32(),
                                           dx.f32(), g.beta, g.dw.f32(), g.db.f32()));
    hand_over(grads, g);
    if (grads.needed(0)) give(grads, 0, dx);
  }

 private:
  Tensor x_, gamma_, beta_, mean_, invstd_;
};

// Evaluation mode normalizes with the running statistics, a per-channel affine map
// whose backward neither the kernels nor cuDNN provide: reaching it is an error, not a
// silently missing gradient.
class BatchNormEvalNode : public Node {
 public:
  const char* name() const override { return "batch_norm2d (eval)"; }
  void backward(Tensor&, Grads&) override {
    throw Error(
        "batch_norm2d: no backward in evaluation mode (running statistics); call train() on the model, "
        "or run it under NoGradGuard");
  }
};

class FlattenNode : public Node {
 public:
  explicit FlattenNode(Shape shape) : shape_(std::move(shape)) {}
  const char* name() const override { return "flatten"; }
  void backward(Tensor& dy, Grads& grads) override { give(grads, 0, dy.reshape(shape_)); }

 private:
  Shape shape_;
};

void need_nchw(const Tensor& x, const char* op) {
  need_f32(x, op);
  DPT_REQUIRE(x.dim() == 4, std::string(op) + ": expected an NCHW input [n, c, h, w], got " + shape_str(x.shape()));
}

// A per-channel vector [c] on x's device.
void need_channels(const Tensor& v, const Tensor& x, const char* op, const char* what) {
  need_f32(v, op);
  same_device(v, x, op);
  DPT_REQUIRE(v.dim() == 1 && v.size(0) == x.size(1), std::string(op) + ": " + what + " " + shape_str(v.shape()) +
                                                          " does not fit input " + shape_str(x.shape()));
}

}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b, int64_t stride, int64_t pad, int64_t dilation) {
  need_nchw(x, "conv2d");
  need_f32(w, "conv2d");
  same_device(x, w, "conv2d");
  DPT_REQUIRE(w.dim() == 4 && w.size(1) == x.size(1),
              "conv2d: input " + shape_str(x.shape()) + " does not fit weight " + shape_str(w.shape()));
  if (b.defined()) {
    need_f32(b, "conv2d");
    same_device(b, x, "conv2d");
    DPT_REQUIRE(b.dim() == 1 && b.size(0) == w.size(0),
                "conv2d: bias " + shape_str(b.shape()) + " does not fit weight " + shape_str(w.shape()));
  }
  DPT_REQUIRE(stride >= 1 && pad >= 0 && dilation >= 1, "conv2d: stride " + std::to_string(stride) + ", padding " +
                                                            std::to_string(pad) + ", dilation " +
                                                            std::to_string(dilation));
  const ConvShape s{x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3), stride, pad, dilation};
  // The padded image must hold the dilated kernel (p() >= 1 alone is not enough: C++'s
  // division rounds a negative remainder toward zero).
  const int64_t extent_h = dilation * (s.r - 1) + 1, extent_w = dilation * (s.s - 1) + 1;
  DPT_REQUIRE(s.h + 2 * pad >= extent_h && s.w + 2 * pad >= extent_w,
              "conv2d: weight " + shape_str(w.shape()) + " (dilation " + std::to_string(dilation) +
                  ") does not fit input " + shape_str(x.shape()) + " with padding " + std::to_string(pad));
  const Device d = x.device();
  Tensor y = Tensor::empty({s.n, s.k, s.p(), s.q()}, DType::f32, d);
  const float* bias = b.defined() ? b.f32() : nullptr;
  DPT_DNN_OR_CPU(
      d,
      {
        Workspace ws = workspace(d, s);
        cuda::conv2d_forward(dnn_of(d), context(d).precision, s, x.f32(), w.f32(), bias, y.f32(), ws.t.data(),
                             ws.bytes);
      },
      cpu::conv2d_forward(s, x.f32(), w.f32(), bias, y.f32()));
  if (any_requires_grad({&x, &w, &b})) record(y, std::make_shared<Conv2dNode>(x, w, b, s), layer_inputs(x, w, b));
  return y;
}

Tensor pool2d(const Tensor& x, Pool kind, int64_t kh, int64_t kw, int64_t stride, int64_t pad) {
  need_nchw(x, "pool2d");
  // Padding up to half the window, as torch allows: every window then holds an input.
  DPT_REQUIRE(kh >= 1 && kw >= 1 && stride >= 1 && pad >= 0 && 2 * pad <= std::min(kh, kw),
              "pool2d: window " + std::to_string(kh) + "x" + std::to_string(kw) + ", stride " + std::to_string(stride) +
                  ", padding " + std::to_string(pad) + " (at most half the window)");
  const PoolShape s{x.size(0), x.size(1), x.size(2), x.size(3), kh, kw, stride, pad};
  DPT_REQUIRE(s.h + 2 * pad >= kh && s.w + 2 * pad >= kw,
              "pool2d: window " + std::to_string(kh) + "x" + std::to_string(kw) + " does not fit input " +
                  shape_str(x.shape()) + " with padding " + std::to_string(pad));
  const Device d = x.device();
  Tensor y = Tensor::empty({s.n, s.c, s.p(), s.q()}, DType::f32, d);
  DPT_DNN_OR_CPU(d, cuda::pool2d_forward(dnn_of(d), s, kind, x.f32(), y.f32()),
                 cpu::pool2d_forward(s, kind, x.f32(), y.f32()));
  if (any_requires_grad({&x})) record(y, std::make_shared<Pool2dNode>(x, y, s, kind), {x});
  return y;
}

Tensor batch_norm2d(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& running_mean,
                    const Tensor& running_var, bool training, const BatchNormArgs& a) {
  need_nchw(x, "batch_norm2d");
  need_channels(gamma, x, "batch_norm2d", "weight");
  need_channels(beta, x, "batch_norm2d", "bias");
  need_channels(running_mean, x, "batch_norm2d", "running_mean");
  need_channels(running_var, x, "batch_norm2d", "running_var");
  const int64_t n = x.size(0), c = x.size(1), hw = x.size(2) * x.size(3);
  const Device d = x.device();
  Tensor y = Tensor::empty(x.shape(), DType::f32, d);
  const bool grad = any_requires_grad({&x, &gamma, &beta});
  if (!training) {
    DPT_DNN_OR_CPU(d,
                   cuda::batchnorm_forward_eval(dnn_of(d), n, c, hw, x.f32(), gamma.f32(), beta.f32(), a,
                                                running_mean.f32(), running_var.f32(), y.f32()),
                   cpu::batchnorm_forward_eval(n, c, hw, x.f32(), gamma.f32(), beta.f32(), a, running_mean.f32(),
                                               running_var.f32(), y.f32()));
    if (grad) record(y, std::make_shared<BatchNormEvalNode>(), {x, gamma, beta});
    return y;
  }
  // As torch: a batch variance needs two values at least (the running one is unbiased).
  if (n * hw < 2)
    throw Error("batch_norm2d: training needs more than one value per channel, got input " + shape_str(x.shape()));
  Tensor mean = Tensor::empty({c}, DType::f32, d), invstd = Tensor::empty({c}, DType::f32, d);
  DPT_DNN_OR_CPU(
      d,
      cuda::batchnorm_forward_train(dnn_of(d), n, c, hw, x.f32(), gamma.f32(), beta.f32(), a, running_mean.f32(),
                                    running_var.f32(), y.f32(), mean.f32(), invstd.f32()),
      cpu::batchnorm_forward_train(n, c, hw, x.f32(), gamma.f32(), beta.f32(), a, running_mean.f32(), running_var.f32(),
                                   y.f32(), mean.f32(), invstd.f32()));
  if (grad) record(y, std::make_shared<BatchNormNode>(x, gamma, beta, mean, invstd), {x, gamma, beta});
  return y;
}

Tensor flatten(const Tensor& x) {
  DPT_REQUIRE(x.defined() && x.dim() >= 1, "flatten: expected a tensor [n, ...]");
  Tensor y = x.reshape({x.size(0), x.size(0) ? x.numel() / x.size(0) : 0});
  if (any_requires_grad({&x})) record(y, std::make_shared<FlattenNode>(x.shape()), {x});
  return y;
}

}  // namespace dpt
