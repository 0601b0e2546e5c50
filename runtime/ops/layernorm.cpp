// The residual stream's ops: layer_norm, add and the two fused (add_layer_norm), all differentiable.
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

// dy in t's type (a gradient may come back in another; it is cast once).
Tensor in_type_of(const Tensor& t, const Tensor& dy) { return dy.dtype() == t.dtype() ? dy : cast(dy, t.dtype()); }

// The chunks of rows the LayerNorm backward sums x's gradient's columns over (one on the CPU).
int64_t sum_chunks(int64_t rows, const Device& d) {
#if DPT_WITH_CUDA
  if (d.is_cuda()) return cuda::layer_norm_backward_chunks(rows);
#else
  (void)rows;
  (void)d;
#endif
  return 1;
}

// Inputs: x, gamma, beta. Saves x and the rows' statistics.
class LayerNormNode : public Node {
 public:
  LayerNormNode(Tensor x, Tensor gamma, Tensor mean, Tensor rstd)
      : x_(x.untracked()), gamma_(gamma.untracked()), mean_(std::move(mean)), rstd_(std::move(rstd)) {}
  const char* name() const override { return "layer_norm"; }
  bool overwrites_grad() const override { return false; }
  void backward(Tensor& dy_in, Grads& grads) override {
    const Device d = x_.device();
    const int64_t rows = x_.size(0), cols = x_.size(1);
    // An output with a ones column gets its values' gradient alone back (ops.hpp).
    DPT_CHECK(
        dy_in.dim() == 2 && dy_in.size(0) == rows && dy_in.size(1) == cols,
        "layer_norm: backward got a gradient " + shape_str(dy_in.shape()) + " for rows of " + std::to_string(cols));
    const Tensor dy = in_type_of(x_, dy_in);
    // Where x's gradient has a part already (the residual stream's, from the add that x also
    // feeds), dx is added into it in the kernel rather than written apart and added after.
    const Tensor gathered = grads.needed(0) ? grads.gathered(0) : Tensor();
    const bool dx_add = gathered.defined() && gathered.dtype() == x_.dtype() && gathered.shape() == x_.shape();
    Tensor dx = dx_add ? gathered : grads.needed(0) ? Tensor::empty(x_.shape(), x_.dtype(), d) : Tensor();
    GradSlot dgamma = needed_slot(grads, 1, gamma_.shape(), d), dbeta = needed_slot(grads, 2, gamma_.shape(), d);
    float *dg = dgamma.f32_or_null(), *db = dbeta.f32_or_null();
    // x's gradient's column sums, for the node that made x (a residual projection's bias
    // gradient), while the kernel has the rows at hand: where it is the last to add to it.
    ColumnSums sums;
    if (dx.defined() && grads.sums_wanted(0)) sums.part = Tensor::empty({sum_chunks(rows, d), cols}, DType::f32, d);
    float* dx_part = sums.defined() ? sums.part.f32() : nullptr;
    bool summed = dx_part != nullptr;  // the CPU twin always sums where asked; the CUDA kernels say
#if DPT_WITH_CUDA
    const auto work = [&] { return Tensor::empty({cuda::layer_norm_backward_work(rows, cols) + 1}, DType::f32, d); };
#endif
    if (is_bf16(x_)) {
      uint16_t* dxp = dx.defined() ? dx.bf16() : nullptr;
      DPT_CUDA_OR_CPU(d,
                      summed = cuda::layer_norm_backward_bf16(x_.bf16(), dy.bf16(), gamma_.f32(), mean_.f32(),
                                                              rstd_.f32(), rows, cols, dxp, dx_add, dgamma.beta, dg,
                                                              dbeta.beta, db, work().f32(), dx_part, stream_of(d)),
                      cpu::layer_norm_backward_bf16(x_.bf16(), dy.bf16(), gamma_.f32(), mean_.f32(), rstd_.f32(), rows,
                                                    cols, dxp, dx_add, dgamma.beta, dg, dbeta.beta, db, dx_part));
    } else {
      float* dxp = dx.defined() ? dx.f32() : nullptr;
      DPT_CUDA_OR_CPU(d,
                      summed = cuda::layer_norm_backward(x_.f32(), dy.f32(), gamma_.f32(), mean_.f32(), rstd_.f32(),
                                                         rows, cols, dxp, dx_add, dgamma.beta, dg, dbeta.beta, db,
                                                         work().f32(), dx_part, stream_of(d)),
                      cpu::layer_norm_backward(x_.f32(), dy.f32(), gamma_.f32(), mean_.f32(), rstd_.f32(), rows, cols,
                                               dxp, dx_add, dgamma.beta, dg, dbeta.beta, db, dx_part));
    }
    if (!summed) sums = ColumnSums();
    if (dx.defined() && !dx_add) give(grads, 0, dx, sums);
    if (dx_add) grads.gathered_sums(0, sums);
    put_slot(grads, 1, dgamma);
    put_slot(grads, 2, dbeta);
  }

 private:
  Tensor x_, gamma_, mean_, rstd_;
};

// dy goes to both inputs as one tensor: the engine copies it for a node that would write
// into it and adds into it out of place while both hold it (Node::overwrites_grad), so the
// residual stream's gradient is not copied for a projection that only reads it.
// dy's column sums, where they came with it, go along to both inputs' nodes (the same
// gradient's), so the add asks for them where either input's node takes them.
class AddNode : public Node {
 public:
  AddNode(DType type, bool takes_sums) : type_(type), takes_sums_(takes_sums) {}
  const char* name() const override { return "add"; }
  bool overwrites_grad() const override { return false; }
  bool takes_output_sums() const override { return takes_sums_; }
  void backward(Tensor& dy_in, Grads& grads) override {
    Tensor dy = dy_in.dtype() == type_ ? dy_in : cast(dy_in, type_);
    const ColumnSums& sums = grads.output_sums();
    if (grads.needed(1)) give(grads, 1, dy, sums);
    if (grads.needed(0)) give(grads, 0, dy, sums);
  }

 private:
  DType type_;
  bool takes_sums_;
};

}  // namespace

namespace {

// An op's names for its messages, all literals: a valid call builds no string (a step's ops
// must not allocate beyond their outputs and nodes).
struct LayerNormNames {
  const char *op, *gamma, *beta;
};
constexpr LayerNormNames kLayerNorm{"layer_norm", "layer_norm (gamma)", "layer_norm (beta)"};
constexpr LayerNormNames kAddLayerNorm{"add_layer_norm", "add_layer_norm (gamma)", "add_layer_norm (beta)"};

void check_layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                      const LayerNormNames& names) {
  const char* op = names.op;
  need_float(x, op);
  need_f32(gamma, names.gamma);
  need_f32(beta, names.beta);
  same_device(x, gamma, op);
  same_device(x, beta, op);
  DPT_REQUIRE(x.dim() == 2 && x.size(1) > 0 && gamma.shape() == Shape{x.size(1)} && beta.shape() == gamma.shape(),
              std::string(op) + ": input " + shape_str(x.shape()) + " does not fit gamma " + shape_str(gamma.shape()) +
                  " and beta " + shape_str(beta.shape()));
  DPT_REQUIRE(eps > 0.0f, std::string(op) + ": eps must be positive");
}

// The normed output's shape: x's, or with the ones column's width (bf16 only).
Shape normed_shape(const Tensor& x, bool ones_column, const char* op) {
  if (!ones_column) return x.shape();
  DPT_REQUIRE(is_bf16(x), std::string(op) + ": a ones column is for bf16 outputs");
  return {x.size(0), ones_column_width(x.size(1))};
}

void check_add(const Tensor& a, const Tensor& b, const char* op) {
  need_float(a, op);
  need_float(b, op);
  same_device(a, b, op);
  DPT_REQUIRE(a.dtype() == b.dtype() && a.shape() == b.shape(),
              std::string(op) + ": " + shape_str(a.shape()) + " " + dtype_name(a.dtype()) + " and " +
                  shape_str(b.shape()) + " " + dtype_name(b.dtype()) + " differ");
}

// The nodes the two ops record: sum's add of a and b, normed's layer_norm of sum.
void record_add(Tensor& sum, const Tensor& a, const Tensor& b) {
  if (!any_requires_grad({&a, &b})) return;
  const auto takes = [](const Tensor& t) {
    return t.requires_grad() && t.grad_fn() && t.grad_fn()->takes_output_sums();
  };
  record(sum, std::make_shared<AddNode>(a.dtype(), takes(a) || takes(b)), {a, b});
}
void record_layer_norm(Tensor& y, const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor mean, Tensor rstd) {
  if (any_requires_grad({&x, &gamma, &beta}))
    record(y, std::make_shared<LayerNormNode>(x, gamma, std::move(mean), std::move(rstd)), {x, gamma, beta});
}

}  // namespace

int64_t ones_column_width(int64_t cols) { return (cols + 1 + 7) / 8 * 8; }

Tensor layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, bool ones_column) {
  check_layer_norm(x, gamma, beta, eps, kLayerNorm);
  const Device d = x.device();
  const int64_t rows = x.size(0), cols = x.size(1);
  Tensor y = Tensor::empty(normed_shape(x, ones_column, kLayerNorm.op), x.dtype(), d);
  Tensor mean = Tensor::empty({rows}, DType::f32, d), rstd = Tensor::empty({rows}, DType::f32, d);
  if (is_bf16(x)) {
    DPT_CUDA_OR_CPU(d,
                    cuda::layer_norm_forward_bf16(x.bf16(), gamma.f32(), beta.f32(), rows, cols, eps, y.bf16(),
                                                  y.size(1), mean.f32(), rstd.f32(), stream_of(d)),
                    cpu::layer_norm_forward_bf16(x.bf16(), gamma.f32(), beta.f32(), rows, cols, eps, y.bf16(),
                                                 y.size(1), mean.f32(), rstd.f32()));
  } else {
    DPT_CUDA_OR_CPU(
        d,
        cuda::layer_norm_forward(x.f32(), gamma.f32(), beta.f32(), rows, cols, eps, y.f32(), mean.f32(), rstd.f32(),
                                 stream_of(d)),
        cpu::layer_norm_forward(x.f32(), gamma.f32(), beta.f32(), rows, cols, eps, y.f32(), mean.f32(), rstd.f32()));
  }
  record_layer_norm(y, x, gamma, beta, std::move(mean), std::move(rstd));
  return y;
}

Tensor add(const Tensor& a, const Tensor& b) {
  check_add(a, b, "add");
  const Device d = a.device();
  Tensor y = Tensor::empty(a.shape(), a.dtype(), d);
  if (is_bf16(a)) {
    DPT_CUDA_OR_CPU(d, cuda::residual_add_bf16(a.bf16(), b.bf16(), a.numel(), y.bf16(), stream_of(d)),
                    cpu::residual_add_bf16(a.bf16(), b.bf16(), a.numel(), y.bf16()));
  } else {
    DPT_CUDA_OR_CPU(d, cuda::residual_add(a.f32(), b.f32(), a.numel(), y.f32(), stream_of(d)),
                    cpu::residual_add(a.f32(), b.f32(), a.numel(), y.f32()));
  }
  record_add(y, a, b);
  return y;
}

AddNorm add_layer_norm(const Tensor& a, const Tensor& b, const Tensor& gamma, const Tensor& beta, float eps,
                       bool ones_column) {
  check_add(a, b, "add_layer_norm");
  check_layer_norm(a, gamma, beta, eps, kAddLayerNorm);
  const Device d = a.device();
  const int64_t rows = a.size(0), cols = a.size(1);
  Tensor h = Tensor::empty(a.shape(), a.dtype(), d);
  Tensor y = Tensor::empty(normed_shape(a, ones_column, kAddLayerNorm.op), a.dtype(), d);
  Tensor mean = Tensor::empty({rows}, DType::f32, d), rstd = Tensor::empty({rows}, DType::f32, d);
  // The CPU twin is the two ops' twins one after the other.
  if (is_bf16(a)) {
    DPT_CUDA_OR_CPU(
        d,
        cuda::add_layer_norm_forward_bf16(a.bf16(), b.bf16(), gamma.f32(), beta.f32(), rows, cols, eps, h.bf16(),
                                          y.bf16(), y.size(1), mean.f32(), rstd.f32(), stream_of(d)),
        (cpu::residual_add_bf16(a.bf16(), b.bf16(), a.numel(), h.bf16()),
         cpu::layer_norm_forward_bf16(h.bf16(), gamma.f32(), beta.f32(), rows, cols, eps, y.bf16(), y.size(1),
                                      mean.f32(), rstd.f32())));
  } else {
    DPT_CUDA_OR_CPU(
        d,
        cuda::add_layer_norm_forward(a.f32(), b.f32(), gamma.f32(), beta.f32(), rows, cols, eps, h.f32(), y.f32(),
                                     mean.f32(), rstd.f32(), stream_of(d)),
        (cpu::residual_add(a.f32(), b.f32(), a.numel(), h.f32()),
         cpu::layer_norm_forward(h.f32(), gamma.f32(), beta.f32(), rows, cols, eps, y.f32(), mean.f32(), rstd.f32())));
  }
  record_add(h, a, b);
  record_layer_norm(y, h, gamma, beta, std::move(mean), std::move(rstd));
  return {h, y};
}

}  // namespace dpt
