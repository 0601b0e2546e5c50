// gelu_mlp_bf16: a transformer block's MLP in bf16 as one op, so that its backward makes
// the GELU's derivative in the epilogue of the GEMM that makes c_proj's input gradient
// (cuBLASLt's DGELU) and never writes the GELU output's gradient.
#include <initializer_list>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/ops.hpp>
#include "internal.hpp"
#include "kernels/cpu/cpu.hpp"
#include "linear_internal.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/check.hpp"
#endif

namespace dpt {

using namespace detail;

namespace {

// dz = (dy W16) gelu_tanh'(z) in bf16: on a GPU the GELU's derivative in the GEMM's
// epilogue (DGELU) for large GEMMs, else the GEMM rounded to bf16 and a pass.
void gelu_backward_through(const Tensor& dy, const Tensor& W16, const Tensor& z, const Tensor& dz) {
  const Device d = dy.device();
#if DPT_WITH_CUDA
  const int64_t rows = dy.size(0), out = dy.size(1), hidden = W16.size(1);
  if (d.is_cuda() && rows > 0 &&
      static_cast<double>(rows) * static_cast<double>(out) * static_cast<double>(hidden) >= kLtMinMultiplyAdds &&
      lt_gemm(context(d), d, cuda::LtTypes{DType::bf16, DType::bf16, DType::bf16}, false, false, rows, hidden, out,
              1.0f, dy.bf16(), W16.bf16(), 0.0f, dz.bf16(), nullptr, Act::gelu_tanh, z.bf16(), true))
    return;
#endif
  gemm(false, false, 1.0f, dy, W16, 0.0f, dz);
  DPT_CUDA_OR_CPU(d, cuda::act_backward_bf16(dz.bf16(), z.bf16(), Act::gelu_tanh, dz.numel(), dz.bf16(), stream_of(d)),
                  cpu::act_backward_bf16(dz.bf16(), z.bf16(), Act::gelu_tanh, dz.numel(), dz.bf16()));
}

// gelu_mlp_bf16's node. Inputs: x, fc's W and b, proj's W and b. It keeps x (or its
// rebuild), both bf16 weight copies, the pre-activation z and, unless recomputing, the
// GELU's output h; it writes its parameters' gradients in backward's order (proj's, then
// fc's), so that a hook waiting before each write (ZeRO stage 2) sees them as two layers'.
class GeluMlpBf16Node : public Node {
 public:
  GeluMlpBf16Node(NodeInput x, Tensor fc16, Tensor proj16, Tensor z, Tensor h)
      : x_(std::move(x)), fc16_(fc16.untracked()), proj16_(proj16.untracked()), z_(z), h_(h) {}
  const char* name() const override { return "gelu_mlp_bf16"; }
  bool overwrites_grad() const override { return false; }  // dy is only read
  bool hands_over_in_turn() const override { return true; }
  bool takes_output_sums() const override { return inputs.size() > 4 && inputs[4].requires_grad(); }  // proj's db
  void backward(Tensor& dy_in, Grads& grads) override {
    const Device d = dy_in.device();
    const int64_t hidden = z_.size(1);
    const Tensor dy = is_bf16(dy_in) ? dy_in : cast(dy_in, DType::bf16);
    in_turn(grads, {3, 4}, [&] {
      bf16_param_grads(dy, h_.defined() ? h_ : activation(z_, Act::gelu_tanh), hidden, grads, 3, 4,
                       grads.output_sums());
    });
    Tensor dz = Tensor::empty(z_.shape(), DType::bf16, d);  // the GELU output's gradient is never written
    gelu_backward_through(dy, proj16_, z_, dz);
    in_turn(grads, {1, 2}, [&] { bf16_param_grads(dz, x_.values(), fc16_.size(1), grads, 1, 2); });
    if (grads.needed(0))
      in_turn(grads, {0}, [&] {
        Tensor dx = Tensor::empty({x_.size(0), fc16_.size(1)}, DType::bf16, d);  // without x's ones column
        gemm(false, false, 1.0f, dz, fc16_, 0.0f, dx);
        give(grads, 0, dx);
      });
  }

 private:
  template <class Write>
  static void in_turn(Grads& grads, std::initializer_list<size_t> ins, const Write& write) {
    for (size_t i : ins) grads.before_write(i);
    write();
    for (size_t i : ins) grads.handed(i);
  }
  NodeInput x_;
  Tensor fc16_, proj16_, z_, h_;
};

}  // namespace

Tensor gelu_mlp_bf16(const Tensor& x, const Bf16Layer& fc, const Bf16Layer& proj, bool keep_h,
                     const SavedInput& x_saved, bool ones_column) {
  check_linear_bf16(x, fc.W, fc.b, fc.W16, fc.b16, ones_column);
  DPT_REQUIRE(fc.b.defined() && proj.b.defined(), "gelu_mlp_bf16: both layers need a bias");
  const Device d = x.device();
  const int64_t rows = x.size(0), hidden = fc.W.size(0);
  const bool grad = any_requires_grad({&x, &fc.W, &fc.b, &proj.W, &proj.b});
  if (grad) check_saved(x_saved, x, "gelu_mlp_bf16", fc.W.size(1));
  // fc, as linear_bf16 (the GELU in the GEMM's epilogue where it fuses) or, recomputing, as
  // linear_bf16_pre (z, then the GELU of the rounded z, which backward rebuilds alike).
  Tensor z = Tensor::empty({rows, hidden}, DType::bf16, d), h;
  if (keep_h) {
    h = Tensor::empty({rows, hidden}, DType::bf16, d);
    linear_bf16_values(x, fc.W16, fc.b16, Act::gelu_tanh, h, z);
  } else {
    linear_bf16_values(x, fc.W16, fc.b16, Act::none, z, Tensor());
    h = activation(z, Act::gelu_tanh);
  }
  check_linear_bf16(h, proj.W, proj.b, proj.W16, proj.b16);
  Tensor y = Tensor::empty({rows, proj.W.size(0)}, DType::bf16, d);
  linear_bf16_values(h, proj.W16, proj.b16, Act::none, y, Tensor());
  if (grad)
    record(y, std::make_shared<GeluMlpBf16Node>(NodeInput(x, x_saved), fc.W16, proj.W16, z, keep_h ? h : Tensor()),
           {x, fc.W, fc.b, proj.W, proj.b});
  return y;
}

}  // namespace dpt
