// The elementwise ops: fills, random fills, copies and casts, axpy, the activations, and
// the reductions of one tensor to a scalar or a row to an index.
#include <cstring>

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

// ---- Plain ops -----------------------------------------------------------------------

void zero_(const Tensor& t) {
  if (t.numel() == 0) return;
  DPT_CUDA_OR_CPU(t.device(), DPT_CUDA_CHECK(cudaMemsetAsync(t.data(), 0, t.nbytes(), stream_of(t.device()))),
                  std::memset(t.data(), 0, t.nbytes()));
}

void fill_(const Tensor& t, float value) {
  need_f32(t, "fill_");
  DPT_CUDA_OR_CPU(t.device(), cuda::fill(t.f32(), t.numel(), value, stream_of(t.device())),
                  cpu::fill(t.f32(), t.numel(), value));
}

void add_peer_(const Tensor& x, const Tensor& y) {
  need_f32(y, "add_peer_");
  DPT_REQUIRE(x.dtype() == DType::f32 || x.dtype() == DType::bf16, "add_peer_: x must be f32 or bf16");
  DPT_REQUIRE(x.numel() == y.numel(), "add_peer_: " + shape_str(x.shape()) + " and " + shape_str(y.shape()));
  DPT_REQUIRE(peer_readable(y.device(), x.device()),
              "add_peer_: " + y.device().str() + " cannot read " + x.device().str() + "'s memory directly");
#if DPT_WITH_CUDA
  if (x.dtype() == DType::bf16) cuda::add_bf16(x.bf16(), y.f32(), x.numel(), stream_of(y.device()));
  else cuda::axpy(x.numel(), 1.0f, x.f32(), y.f32(), stream_of(y.device()));
#endif
}

void add_host_(const Tensor& x, const Tensor& y) {
  need_f32(y, "add_host_");
  DPT_REQUIRE(x.dtype() == DType::f32 || x.dtype() == DType::bf16, "add_host_: x must be f32 or bf16");
  DPT_REQUIRE(x.numel() == y.numel(), "add_host_: " + shape_str(x.shape()) + " and " + shape_str(y.shape()));
  DPT_REQUIRE(x.device().is_cpu() && y.device().is_cpu(),
              "add_host_: CPU devices, got " + x.device().str() + " and " + y.device().str());
  if (x.dtype() == DType::bf16) cpu::add_bf16(x.bf16(), y.f32(), x.numel());
  else cpu::axpy(x.numel(), 1.0f, x.f32(), y.f32());
}

void axpy_(float alpha, const Tensor& x, const Tensor& y) {
  if (is_bf16(x) || is_bf16(y)) {  // in fp32, y rounded once (autograd adds bf16 gradients so)
    need_float(x, "axpy_");
    need_float(y, "axpy_");
    DPT_REQUIRE(x.numel() == y.numel(), "axpy_: " + shape_str(x.shape()) + " and " + shape_str(y.shape()));
    if (alpha == 1.0f && is_bf16(x) && is_bf16(y)) {  // one pass: y = x + y in fp32, rounded once
      same_device(x, y, "axpy_");
      DPT_CUDA_OR_CPU(y.device(),
                      cuda::residual_add_bf16(x.bf16(), y.bf16(), x.numel(), y.bf16(), stream_of(y.device())),
                      cpu::residual_add_bf16(x.bf16(), y.bf16(), x.numel(), y.bf16()));
      return;
    }
    const Tensor xf = cast(x.untracked(), DType::f32);
    if (!is_bf16(y)) {
      axpy_(alpha, xf, y);
      return;
    }
    Tensor yf = cast(y.untracked(), DType::f32);
    axpy_(alpha, xf, yf);
    copy_cast(y, yf);
    return;
  }
  need_f32(x, "axpy_");
  need_f32(y, "axpy_");
  same_device(x, y, "axpy_");
  DPT_REQUIRE(x.numel() == y.numel(), "axpy_: " + shape_str(x.shape()) + " and " + shape_str(y.shape()));
  DPT_CUDA_OR_CPU(y.device(), cuda::axpy(x.numel(), alpha, x.f32(), y.f32(), stream_of(y.device())),
                  cpu::axpy(x.numel(), alpha, x.f32(), y.f32()));
}

void copy_cast(const Tensor& dst, const Tensor& t) {
  DPT_REQUIRE(dst.defined() && t.defined() && dst.numel() == t.numel(),
              "copy_cast: " + shape_str(t.shape()) + " into " + shape_str(dst.shape()));
  same_device(dst, t, "copy_cast");
  if (t.dtype() == dst.dtype()) {
    copy(dst, t);
  } else if (t.dtype() == DType::f32 && dst.dtype() == DType::bf16) {
    DPT_CUDA_OR_CPU(t.device(), cuda::cast_f32_bf16(t.f32(), dst.bf16(), t.numel(), stream_of(t.device())),
                    cpu::cast_f32_bf16(t.f32(), dst.bf16(), t.numel()));
  } else if (t.dtype() == DType::bf16 && dst.dtype() == DType::f32) {
    DPT_CUDA_OR_CPU(t.device(), cuda::cast_bf16_f32(t.bf16(), dst.f32(), t.numel(), stream_of(t.device())),
                    cpu::cast_bf16_f32(t.bf16(), dst.f32(), t.numel()));
  } else {
    throw Error(std::string("cast from ") + dtype_name(t.dtype()) + " to " + dtype_name(dst.dtype()) +
                " is not supported");
  }
}

Tensor sum_squares(const Tensor& x) {
  need_f32(x, "sum_squares");
  Tensor out = Tensor::empty({1}, DType::f32, x.device());
  DPT_CUDA_OR_CPU(
      x.device(),
      cuda::sum_squares(x.f32(), x.numel(), out.f32(), reduce_work(x.device(), 0).f32(), stream_of(x.device())),
      cpu::sum_squares(x.f32(), x.numel(), out.f32()));
  return out;
}

Tensor argmax_rows(const Tensor& x) {
  need_f32(x, "argmax_rows");
  DPT_REQUIRE(x.dim() == 2 && x.size(1) > 0, "argmax_rows: expected a matrix, got " + shape_str(x.shape()));
  Tensor out = Tensor::empty({x.size(0)}, DType::i32, x.device());
  DPT_CUDA_OR_CPU(x.device(), cuda::argmax_rows(x.f32(), x.size(0), x.size(1), out.i32(), stream_of(x.device())),
                  cpu::argmax_rows(x.f32(), x.size(0), x.size(1), out.i32()));
  return out;
}

void normal_(const Tensor& t, uint64_t seed, uint64_t stream, uint64_t offset, float std) {
  need_f32(t, "normal_");
  DPT_CUDA_OR_CPU(t.device(), cuda::normal(t.f32(), t.numel(), seed, stream, offset, std, stream_of(t.device())),
                  cpu::normal(t.f32(), t.numel(), seed, stream, offset, std));
}

void normal_rows_(const Tensor& t, uint64_t seed, uint64_t stream, const RowMap& rows, float std, bool add) {
  need_f32(t, "normal_rows_");
  DPT_CHECK(t.dim() >= 1 && rows.per_group > 0, "normal_rows_: rows of a tensor, groups of at least one row");
  if (t.numel() == 0) return;
  const int64_t n = t.size(0), width = t.numel() / n;
  DPT_CUDA_OR_CPU(t.device(), cuda::normal_rows(t.f32(), n, width, seed, stream, rows, std, add, stream_of(t.device())),
                  cpu::normal_rows(t.f32(), n, width, seed, stream, rows, std, add));
}

void uniform_(const Tensor& t, uint64_t seed, uint64_t stream, uint64_t offset, float lo, float hi) {
  need_f32(t, "uniform_");
  DPT_CUDA_OR_CPU(t.device(), cuda::uniform(t.f32(), t.numel(), seed, stream, offset, lo, hi, stream_of(t.device())),
                  cpu::uniform(t.f32(), t.numel(), seed, stream, offset, lo, hi));
}

namespace {

class ActivationNode : public Node {
 public:
  ActivationNode(Tensor saved, Act act) : saved_(saved.untracked()), act_(act) {}
  const char* name() const override { return "activation"; }
  void backward(Tensor& dy, Grads& grads) override {
    const Device d = dy.device();
    if (is_bf16(saved_)) {  // the gradient has the input's type
      Tensor g = is_bf16(dy) ? dy : cast(dy, DType::bf16);
      DPT_CUDA_OR_CPU(d, cuda::act_backward_bf16(g.bf16(), saved_.bf16(), act_, g.numel(), g.bf16(), stream_of(d)),
                      cpu::act_backward_bf16(g.bf16(), saved_.bf16(), act_, g.numel(), g.bf16()));
      give(grads, 0, g);
      return;
    }
    DPT_CUDA_OR_CPU(d, cuda::act_backward(dy.f32(), saved_.f32(), act_, dy.numel(), dy.f32(), stream_of(d)),
                    cpu::act_backward(dy.f32(), saved_.f32(), act_, dy.numel(), dy.f32()));
    give(grads, 0, dy);
  }

 private:
  Tensor saved_;
  Act act_;
};

class CastNode : public Node {
 public:
  explicit CastNode(DType from) : from_(from) {}
  const char* name() const override { return "cast"; }
  void backward(Tensor& dy, Grads& grads) override { give(grads, 0, cast(dy, from_)); }

 private:
  DType from_;
};

}  // namespace

Tensor cast(const Tensor& t, DType to) {
  DPT_REQUIRE(t.defined(), "cast of an undefined tensor");
  if (t.dtype() == to) return t;
  Tensor out = Tensor::empty(t.shape(), to, t.device());
  copy_cast(out, t);
  if (any_requires_grad({&t})) record(out, std::make_shared<CastNode>(t.dtype()), {t});
  return out;
}

Tensor activation(const Tensor& x, Act act) {
  if (is_bf16(x)) {
    const Device d = x.device();
    Tensor y = Tensor::empty(x.shape(), DType::bf16, d);
    const bool grad = any_requires_grad({&x});
    DPT_CUDA_OR_CPU(d, cuda::act_forward_bf16(x.bf16(), act, x.numel(), y.bf16(), stream_of(d)),
                    cpu::act_forward_bf16(x.bf16(), act, x.numel(), y.bf16()));
    if (grad) record(y, std::make_shared<ActivationNode>(act_saves_input(act) ? x.untracked() : y, act), {x});
    return y;
  }
  need_f32(x, "activation");
  const Device d = x.device();
  Tensor y = Tensor::empty(x.shape(), DType::f32, d);
  const bool grad = any_requires_grad({&x});
  Tensor z = (grad && act_saves_input(act)) ? x.untracked() : Tensor();
  DPT_CUDA_OR_CPU(d, cuda::bias_act_forward(x.f32(), nullptr, act, 1, x.numel(), nullptr, y.f32(), stream_of(d)),
                  cpu::bias_act_forward(x.f32(), nullptr, act, 1, x.numel(), nullptr, y.f32()));
  if (grad) record(y, std::make_shared<ActivationNode>(act_saves_input(act) ? z : y, act), {x});
  return y;
}

}  // namespace dpt
