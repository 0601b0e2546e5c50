// The token and position embedding: embedding (differentiable in wte and wpe), and
// embedding_at, its positions from an offset on, for decoding (no gradient).
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

// Inputs: wte, wpe (the fp32 masters). Their gradients are written in place where they
// have one (the flat buffer), so wte's, tied to the output projection, adds to that one.
class EmbeddingNode : public Node {
 public:
  EmbeddingNode(Tensor tokens, Tensor wte, Tensor wpe, DType out)
      : tokens_(tokens.untracked()), wte_(wte.untracked()), wpe_(wpe.untracked()), out_(out) {}
  const char* name() const override { return "embedding"; }
  void backward(Tensor& dy_in, Grads& grads) override {
    const Device d = dy_in.device();
    const int64_t rows = tokens_.numel(), seq = tokens_.size(1), vocab = wte_.size(0), positions = wpe_.size(0);
    const int64_t C = wte_.size(1);
    Tensor dy = dy_in.dtype() == out_ ? dy_in : cast(dy_in, out_);
    GradSlot dwte = needed_slot(grads, 0, wte_.shape(), d), dwpe = needed_slot(grads, 1, wpe_.shape(), d);
    float *wte_grad = dwte.f32_or_null(), *wpe_grad = dwpe.f32_or_null();
#if DPT_WITH_CUDA
    const auto work_floats = [&] {
      return static_cast<int64_t>((cuda::embedding_backward_work_bytes(rows, vocab) + sizeof(float) - 1) /
                                  sizeof(float));
    };
#endif
    if (is_bf16(dy)) {
      DPT_CUDA_OR_CPU(d,
                      cuda::embedding_backward_bf16(
                          tokens_.i32(), rows, seq, dy.bf16(), vocab, positions, C, dwte.beta, wte_grad, dwpe.beta,
                          wpe_grad, Tensor::empty({work_floats() + 1}, DType::f32, d).data(), stream_of(d)),
                      cpu::embedding_backward_bf16(tokens_.i32(), rows, seq, dy.bf16(), vocab, positions, C, dwte.beta,
                                                   wte_grad, dwpe.beta, wpe_grad));
    } else {
      DPT_CUDA_OR_CPU(d,
                      cuda::embedding_backward(tokens_.i32(), rows, seq, dy.f32(), vocab, positions, C, dwte.beta,
                                               wte_grad, dwpe.beta, wpe_grad,
                                               Tensor::empty({work_floats() + 1}, DType::f32, d).data(), stream_of(d)),
                      cpu::embedding_backward(tokens_.i32(), rows, seq, dy.f32(), vocab, positions, C, dwte.beta,
                                              wte_grad, dwpe.beta, wpe_grad));
    }
    put_slot(grads, 0, dwte);
    put_slot(grads, 1, dwpe);
  }

 private:
  Tensor tokens_, wte_, wpe_;
  DType out_;  // y's type, which dy is given in
};

}  // namespace

Tensor embedding(const Tensor& tokens, const Tensor& wte, const Tensor& wpe, DType out) {
  DPT_REQUIRE(tokens.defined() && tokens.dtype() == DType::i32 && tokens.dim() == 2,
              "embedding: tokens must be an i32 [batch, seq] tensor");
  need_f32(wte, "embedding (wte)");
  need_f32(wpe, "embedding (wpe)");
  same_device(tokens, wte, "embedding");
  same_device(tokens, wpe, "embedding");
  DPT_REQUIRE(out == DType::f32 || out == DType::bf16, "embedding: the output type must be f32 or bf16");
  const int64_t batch = tokens.size(0), seq = tokens.size(1);
  DPT_REQUIRE(wte.dim() == 2 && wpe.dim() == 2 && wpe.size(1) == wte.size(1) && wpe.size(0) >= seq && seq > 0 &&
                  wte.size(0) > 0,
              "embedding: tokens " + shape_str(tokens.shape()) + " do not fit wte " + shape_str(wte.shape()) +
                  " and wpe " + shape_str(wpe.shape()) + " (wpe needs a row per position)");
  const Device d = tokens.device();
  const int64_t rows = batch * seq, vocab = wte.size(0), C = wte.size(1);
  Tensor y = Tensor::empty({rows, C}, out, d);
  if (out == DType::bf16) {
    DPT_CUDA_OR_CPU(
        d,
        cuda::embedding_forward_bf16(tokens.i32(), rows, seq, wte.f32(), vocab, wpe.f32(), C, y.bf16(), stream_of(d)),
        cpu::embedding_forward_bf16(tokens.i32(), rows, seq, wte.f32(), vocab, wpe.f32(), C, y.bf16()));
  } else {
    DPT_CUDA_OR_CPU(
        d, cuda::embedding_forward(tokens.i32(), rows, seq, wte.f32(), vocab, wpe.f32(), C, y.f32(), stream_of(d)),
        cpu::embedding_forward(tokens.i32(), rows, seq, wte.f32(), vocab, wpe.f32(), C, y.f32()));
  }
  if (any_requires_grad({&wte, &wpe})) {
    record(y, std::make_shared<EmbeddingNode>(tokens, wte, wpe, out), {wte, wpe});
  }
  return y;
}

// wpe's rows from first_position on are the positions of the new tokens: the same kernels
// over a view.
Tensor embedding_at(const Tensor& tokens, const Tensor& wte, const Tensor& wpe, int64_t first_position, DType out) {
  DPT_REQUIRE(!any_requires_grad({&wte, &wpe}),
              "embedding_at: decoding keeps no gradient; run it under NoGradGuard (training uses embedding)");
  need_f32(wpe, "embedding_at (wpe)");
  DPT_REQUIRE(wpe.dim() == 2 && tokens.defined() && tokens.dim() == 2 && first_position >= 0 &&
                  first_position + tokens.size(1) <= wpe.size(0),
              "embedding_at: positions from " + std::to_string(first_position) + " for tokens " +
                  (tokens.defined() ? shape_str(tokens.shape()) : std::string("none")) + " do not fit wpe " +
                  shape_str(wpe.shape()));
  return embedding(tokens, wte, wpe.rows(first_position, wpe.size(0) - first_position), out);
}

}  // namespace dpt
