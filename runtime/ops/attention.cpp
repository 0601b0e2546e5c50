// causal_attention: differentiable causal multi-head self-attention over qkv (the model's
// c_attn output). The forward saves the softmax's log-sum-exp per row, and the backward
// recomputes the probabilities from it: no [T, T] matrix is ever held.
#include <string>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/ops.hpp>
#include "internal.hpp"
#include "kernels/attention.hpp"
#include "kernels/cpu/cpu.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/cuda.hpp"
#endif

namespace dpt {

using namespace detail;

namespace {

class AttentionNode : public Node {
 public:
  AttentionNode(const AttentionShape& s, Tensor qkv, Tensor y, Tensor lse)
      : s_(s), qkv_(qkv.untracked()), y_(y.untracked()), lse_(std::move(lse)) {}
  const char* name() const override { return "causal_attention"; }
  void backward(Tensor& dy_in, Grads& grads) override {
    const Device d = qkv_.device();
    const Tensor dy = dy_in.dtype() == y_.dtype() ? dy_in : cast(dy_in, y_.dtype());
    Tensor dqkv = Tensor::empty(qkv_.shape(), qkv_.dtype(), d);
    if (is_bf16(qkv_)) {
      DPT_CUDA_OR_CPU(d,
                      cuda::attention_backward_bf16(s_, qkv_.bf16(), y_.bf16(), dy.bf16(), lse_.f32(), dqkv.bf16(),
                                                    work(d).f32(), stream_of(d)),
                      cpu::attention_backward_bf16(s_, qkv_.bf16(), y_.bf16(), dy.bf16(), lse_.f32(), dqkv.bf16()));
    } else {
      DPT_CUDA_OR_CPU(d,
                      cuda::attention_backward(s_, qkv_.f32(), y_.f32(), dy.f32(), lse_.f32(), dqkv.f32(),
                                               work(d).f32(), stream_of(d)),
                      cpu::attention_backward(s_, qkv_.f32(), y_.f32(), dy.f32(), lse_.f32(), dqkv.f32()));
    }
    give(grads, 0, std::move(dqkv));
  }

 private:
  // The backward's D_t = dy_t . y_t, one a softmax row (the GPU's only).
  Tensor work(const Device& d) const { return Tensor::empty({s_.softmax_rows()}, DType::f32, d); }
  AttentionShape s_;
  Tensor qkv_, y_, lse_;
};

}  // namespace

Tensor causal_attention(const Tensor& qkv, int64_t T, int64_t heads) {
  need_float(qkv, "causal_attention");
  DPT_REQUIRE(qkv.dim() == 2 && T > 0 && heads > 0 && qkv.size(0) > 0 && qkv.size(0) % T == 0 && qkv.size(1) > 0 &&
                  qkv.size(1) % (3 * heads) == 0,
              "causal_attention: qkv " + shape_str(qkv.shape()) + " is not [B*T, 3C] with T " + std::to_string(T) +
                  " and C a multiple of " + std::to_string(heads) + " heads");
  const AttentionShape s{qkv.size(0) / T, T, heads, qkv.size(1) / (3 * heads)};
  DPT_REQUIRE(s.head_size <= kAttentionMaxHeadSize,
              "causal_attention: head size " + std::to_string(s.head_size) + " (C " + std::to_string(s.channels()) +
                  " / " + std::to_string(heads) + " heads) is above " + std::to_string(kAttentionMaxHeadSize) +
                  ", the largest the attention kernel takes: use more heads");
  const Device d = qkv.device();
  Tensor y = Tensor::empty({s.rows(), s.channels()}, qkv.dtype(), d);
  Tensor lse = Tensor::empty({s.batch, heads, T}, DType::f32, d);
  if (is_bf16(qkv)) {
    DPT_CUDA_OR_CPU(d, cuda::attention_forward_bf16(s, qkv.bf16(), y.bf16(), lse.f32(), stream_of(d)),
                    cpu::attention_forward_bf16(s, qkv.bf16(), y.bf16(), lse.f32()));
  } else {
    DPT_CUDA_OR_CPU(d, cuda::attention_forward(s, qkv.f32(), y.f32(), lse.f32(), stream_of(d)),
                    cpu::attention_forward(s, qkv.f32(), y.f32(), lse.f32()));
  }
  if (any_requires_grad({&qkv})) record(y, std::make_shared<AttentionNode>(s, qkv, y, lse), {qkv});
  return y;
}

}  // namespace dpt
