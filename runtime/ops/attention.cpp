// causal_attention: differentiable causal multi-head self-attention over qkv (the model's
// c_attn output). The forward saves the softmax's log-sum-exp per row, and the backward
// recomputes the probabilities from it: no [T, T] matrix is ever held. In bf16 on a GPU it
// runs cuDNN's fused attention (flash attention, kernels/cuda/sdpa.hpp) where the build has
// the cuDNN frontend and cuDNN takes the shape; our own kernel otherwise.
#include <algorithm>
#include <string>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/ops.hpp>
#include "internal.hpp"
#include "kernels/attention.hpp"
#include "kernels/cpu/cpu.hpp"
#include "kernels/decode.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/cuda.hpp"
#endif
#if DPT_WITH_CUDNN_FRONTEND
#include <dptrain/runtime/context.hpp>
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/sdpa.hpp"
#endif

namespace dpt {

using namespace detail;

namespace {

#if DPT_WITH_CUDNN_FRONTEND
// cuDNN's shape of an attention, and the handle of the device's current context (bound to
// its stream) with the device made current.
cuda::SdpaShape sdpa_shape(const AttentionShape& s, bool training, bool deterministic) {
  return {s.batch, s.heads, s.T, s.head_size, training, deterministic};
}
cudnnHandle_t dnn_of(const Device& d) {
  cuda::set_device(d.index);
  return static_cast<cudnnHandle_t>(context(d).dnn());
}
// A workspace from the caching allocator (f32 elements, rounded up): no cudaMalloc a step.
Tensor workspace(const Device& d, size_t bytes) {
  return Tensor::empty({static_cast<int64_t>(std::max<size_t>(1, (bytes + 3) / 4))}, DType::f32, d);
}
// Whether cuDNN computes this attention: bf16 on a GPU, a shape cuDNN runs.
bool use_cudnn(const Tensor& qkv, const AttentionShape& s, bool training, bool deterministic) {
  return is_bf16(qkv) && !qkv.device().is_cpu() &&
         cuda::sdpa_supported(dnn_of(qkv.device()), sdpa_shape(s, training, deterministic));
}
#else
bool use_cudnn(const Tensor&, const AttentionShape&, bool, bool) { return false; }
#endif

class AttentionNode : public Node {
 public:
  AttentionNode(const AttentionShape& s, Tensor qkv, Tensor y, Tensor lse, bool cudnn, bool deterministic)
      : s_(s),
        qkv_(qkv.untracked()),
        y_(y.untracked()),
        lse_(std::move(lse)),
        cudnn_(cudnn),
        deterministic_(deterministic) {}
  const char* name() const override { return "causal_attention"; }
  void backward(Tensor& dy_in, Grads& grads) override {
    const Device d = qkv_.device();
    const Tensor dy = dy_in.dtype() == y_.dtype() ? dy_in : cast(dy_in, y_.dtype());
    Tensor dqkv = Tensor::empty(qkv_.shape(), qkv_.dtype(), d);
#if DPT_WITH_CUDNN_FRONTEND
    if (cudnn_) {  // the statistics are cuDNN's own
      const cuda::SdpaShape s = sdpa_shape(s_, true, deterministic_);
      const Tensor ws = workspace(d, cuda::sdpa_backward_workspace(dnn_of(d), s));
      cuda::sdpa_backward(dnn_of(d), s, qkv_.bf16(), y_.bf16(), dy.bf16(), lse_.f32(), dqkv.bf16(), ws.data());
      give(grads, 0, std::move(dqkv));
      return;
    }
#endif
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
  bool cudnn_, deterministic_;
};

}  // namespace

Tensor causal_attention(const Tensor& qkv, int64_t T, int64_t heads, bool deterministic) {
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
  const bool training = any_requires_grad({&qkv});
  bool cudnn = use_cudnn(qkv, s, training, deterministic);
  if (!cudnn && !deterministic && use_cudnn(qkv, s, training, true)) {
    cudnn = true;  // cuDNN runs this shape's deterministic backward alone: that, not our slower kernel
    deterministic = true;
  }
  if (cudnn) {
#if DPT_WITH_CUDNN_FRONTEND
    const cuda::SdpaShape ss = sdpa_shape(s, training, deterministic);
    const Tensor ws = workspace(d, cuda::sdpa_forward_workspace(dnn_of(d), ss));
    cuda::sdpa_forward(dnn_of(d), ss, qkv.bf16(), y.bf16(), training ? lse.f32() : nullptr, ws.data());
#endif
  } else if (is_bf16(qkv)) {
    DPT_CUDA_OR_CPU(d, cuda::attention_forward_bf16(s, qkv.bf16(), y.bf16(), lse.f32(), stream_of(d)),
                    cpu::attention_forward_bf16(s, qkv.bf16(), y.bf16(), lse.f32()));
  } else {
    DPT_CUDA_OR_CPU(d, cuda::attention_forward(s, qkv.f32(), y.f32(), lse.f32(), stream_of(d)),
                    cpu::attention_forward(s, qkv.f32(), y.f32(), lse.f32()));
  }
  if (training) record(y, std::make_shared<AttentionNode>(s, qkv, y, lse, cudnn, deterministic), {qkv});
  return y;
}

Tensor attention_decode(const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache, int64_t start) {
  need_float(qkv, "attention_decode");
  DPT_REQUIRE(
      !any_requires_grad({&qkv}),
      "attention_decode: decoding keeps no gradient; run it under NoGradGuard (training uses causal_attention)");
  DPT_REQUIRE(k_cache.defined() && v_cache.defined() && k_cache.dim() == 4 && k_cache.shape() == v_cache.shape() &&
                  k_cache.dtype() == qkv.dtype() && v_cache.dtype() == qkv.dtype(),
              "attention_decode: the key and value caches must be alike, [batch, heads, capacity, head size] of qkv's "
              "type");
  same_device(qkv, k_cache, "attention_decode");
  same_device(qkv, v_cache, "attention_decode");
  DecodeShape s{k_cache.size(0), 0, k_cache.size(1), k_cache.size(3), k_cache.size(2), start};
  DPT_REQUIRE(
      qkv.dim() == 2 && qkv.size(1) == 3 * s.channels() && s.batch > 0 && qkv.size(0) > 0 && qkv.size(0) % s.batch == 0,
      "attention_decode: qkv " + shape_str(qkv.shape()) + " is not [batch * n, 3C] for the caches " +
          shape_str(k_cache.shape()));
  s.n = qkv.size(0) / s.batch;
  DPT_REQUIRE(start >= 0 && start + s.n <= s.capacity, "attention_decode: positions " + std::to_string(start) + " .. " +
                                                           std::to_string(start + s.n - 1) +
                                                           " do not fit the caches' " + std::to_string(s.capacity));
  DPT_REQUIRE(s.head_size <= kAttentionMaxHeadSize, "attention_decode: head size " + std::to_string(s.head_size) +
                                                        " is above " + std::to_string(kAttentionMaxHeadSize));
  const Device d = qkv.device();
  Tensor y = Tensor::empty({s.rows(), s.channels()}, qkv.dtype(), d);
  if (is_bf16(qkv)) {
    DPT_CUDA_OR_CPU(d,
                    cuda::attention_decode_bf16(s, qkv.bf16(), k_cache.bf16(), v_cache.bf16(), y.bf16(), stream_of(d)),
                    cpu::attention_decode_bf16(s, qkv.bf16(), k_cache.bf16(), v_cache.bf16(), y.bf16()));
  } else {
    DPT_CUDA_OR_CPU(d, cuda::attention_decode(s, qkv.f32(), k_cache.f32(), v_cache.f32(), y.f32(), stream_of(d)),
                    cpu::attention_decode(s, qkv.f32(), k_cache.f32(), v_cache.f32(), y.f32()));
  }
  return y;
}

}  // namespace dpt
