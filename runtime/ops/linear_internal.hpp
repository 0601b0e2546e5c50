// What the linear layers' files share (linear.cpp: gemm, linear, linear_bf16; gelu_mlp.cpp:
// the fused bf16 MLP): the input a node keeps, the bf16 layer's checks and forward, and on
// a GPU the cuBLASLt call and the bias gradients' scratch.
#pragma once
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/runtime/tensor.hpp>

#if DPT_WITH_CUDA
#include <dptrain/runtime/context.hpp>
#include "kernels/cuda/cuda.hpp"
#endif

namespace dpt::detail {

// Only large GEMMs take cuBLASLt's epilogue: for a short one cuBLAS's own kernel plus
// the separate bias pass is faster (measured on the seed workload's forward: README,
// "Measurements behind the code"), while for the mlp workload's layers the fused epilogue
// saves a pass over each activation. The same bound picks the TF32 backward that writes
// a transposed gradient (LinearNode).
[[maybe_unused]] constexpr double kLtMinMultiplyAdds = 1 << 30;

// A linear node's input x: kept, or rebuilt from a SavedInput (ops.hpp) by the forward's
// own op when the weight gradient reads it, into a temporary that goes when its reader
// drops it.
class NodeInput {
 public:
  NodeInput(const Tensor& x, const SavedInput& s) : shape_(x.shape()), saved_(s) {
    if (s.kind == SavedInput::Kind::input) {
      x_ = x.untracked();
      return;
    }
    for (Tensor* t : {&saved_.from, &saved_.gamma, &saved_.beta})
      if (t->defined()) *t = t->untracked();
  }
  explicit NodeInput(const Tensor& x) : NodeInput(x, SavedInput{}) {}
  const Shape& shape() const { return shape_; }
  int64_t size(size_t i) const { return shape_[i]; }
  Tensor values() const {
    if (x_.defined()) return x_;
    if (saved_.kind == SavedInput::Kind::act_of) return activation(saved_.from, saved_.act);
    return layer_norm(saved_.from, saved_.gamma, saved_.beta, saved_.eps, saved_.ones_column);
  }

 private:
  Shape shape_;
  Tensor x_;
  SavedInput saved_;
};

// A SavedInput's rebuild must have x's shape, type and device, a LayerNorm's rows `in`
// values (the layer's input width, without a ones column).
void check_saved(const SavedInput& s, const Tensor& x, const char* op, int64_t in);
// x [rows, in], or with ones_column [rows, ones_column_width(in)] and no leaf (ops.hpp), for
// W [out, in].
void check_linear_bf16(const Tensor& x, const Tensor& W, const Tensor& b, const Tensor& W16, const Tensor& b16,
                       bool ones_column = false);
// A bf16 layer's parameter gradients from dz (its output's gradient through the activation,
// bf16 [rows, out]) and its input x: dW (+)= dz^T x[:, :in] into input w's gradient and db (+)=
// dz's column sums into input b's, each where wanted. With x's ones column, both come out of
// one GEMM, dz^T x = [dW | db | 0s], split after; else db comes from dz_sums where they came
// with dz (ColumnSums), or takes a pass of column sums.
// b = kNoInput: the layer has no bias.
constexpr size_t kNoInput = static_cast<size_t>(-1);
void bf16_param_grads(const Tensor& dz, const Tensor& x, int64_t in, Grads& grads, size_t w, size_t b,
                      const ColumnSums& dz_sums = {});
// linear_bf16's forward without autograd: y = act(x W16^T + b16) rounded once, and z (when
// defined) GELU's pre-activation.
void linear_bf16_values(const Tensor& x, const Tensor& W16, const Tensor& b16, Act act, const Tensor& y,
                        const Tensor& z);

#if DPT_WITH_CUDA
// A cuBLASLt GEMM on ctx's stream (gemm_lt) over `types`, its workspace from the caching
// allocator; false when cuBLASLt has no kernel for it (then nothing ran). aux: where a
// tanh-GELU epilogue writes the pre-activation, or null; act_grad: the GELU's gradient from
// the pre-activation in aux instead.
bool lt_gemm(Context& ctx, const Device& d, cuda::LtTypes types, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
             float alpha, const void* A, const void* B, float beta, void* C, const void* bias, Act act,
             void* aux = nullptr, bool act_grad = false, int64_t lda = 0);
// Scratch for the two-stage bias gradients (at least one float: a tensor is never empty here).
Tensor bias_work(const Device& d, int64_t floats);
#endif

}  // namespace dpt::detail
