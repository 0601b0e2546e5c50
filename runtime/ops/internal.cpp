// The helpers that the op families share (internal.hpp).
#include "internal.hpp"

#include <algorithm>
#include <string>

#include <dptrain/error.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/ops.hpp>
#include "kernels/cpu/cpu.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/cuda.hpp"
#endif

namespace dpt::detail {

#if DPT_WITH_CUDA
cudaStream_t stream_of(const Device& d) {
  cuda::set_device(d.index);
  return static_cast<cudaStream_t>(context(d).stream());
}
Tensor reduce_work(const Device& d, int64_t at_least) {
  return Tensor::empty({std::max<int64_t>(at_least, cuda::kReduceWork)}, DType::f32, d);
}
#endif

void need_bf16(const Tensor& t, const char* op) {
  DPT_REQUIRE(t.defined() && t.dtype() == DType::bf16, std::string(op) + ": expected a defined bf16 tensor");
}

void need_float(const Tensor& t, const char* op) {
  DPT_REQUIRE(t.defined() && (t.dtype() == DType::f32 || t.dtype() == DType::bf16),
              std::string(op) + ": expected a defined f32 or bf16 tensor");
}

bool is_bf16(const Tensor& t) { return t.defined() && t.dtype() == DType::bf16; }

void same_device(const Tensor& a, const Tensor& b, const char* op) {
  DPT_REQUIRE(a.device() == b.device(),
              std::string(op) + ": tensors on " + a.device().str() + " and " + b.device().str());
}

void need_f32(const Tensor& t, const char* op) {
  DPT_REQUIRE(t.defined() && t.dtype() == DType::f32, std::string(op) + ": expected a defined f32 tensor");
}

std::vector<Tensor> layer_inputs(const Tensor& x, const Tensor& w, const Tensor& b) {
  return b.defined() ? std::vector<Tensor>{x, w, b} : std::vector<Tensor>{x, w};
}

void record(Tensor& out, std::shared_ptr<Node> node, std::vector<Tensor> inputs) {
  // A non-leaf input is an edge to its producer, not its memory: the engine needs only its
  // grad_fn, and a node keeps what its backward reads itself. So an activation no node
  // saved (a projection's output that a residual add only sums) is freed after the forward.
  // A leaf stays itself: its gradient lives in its own state.
  for (Tensor& in : inputs)
    if (in.defined() && in.requires_grad() && !in.is_leaf()) in = in.edge();
  node->inputs = std::move(inputs);
  out.set_grad_fn(std::move(node));
}

void give(Grads& grads, size_t i, Tensor g) {
  if (Tensor acc = grads.accumulator(i); acc.defined()) {
    if (grads.take_beta(i) == 0.0f) copy_cast(acc, g);
    else axpy_(1.0f, g, acc);
  } else grads.put(i, std::move(g));
}

void give(Grads& grads, size_t i, Tensor g, const ColumnSums& sums) {
  if (grads.accumulator(i).defined()) give(grads, i, std::move(g));
  else grads.put(i, std::move(g), sums);
}

void finish_column_sums(const ColumnSums& sums, float beta, const Tensor& out) {
  const Tensor& part = sums.part;
  const int64_t chunks = part.size(0), cols = part.size(1);
  DPT_CHECK(out.dtype() == DType::f32 && out.numel() == cols && part.device() == out.device(),
            "column sums of " + std::to_string(cols) + " columns for a gradient " + shape_str(out.shape()));
  // On the CPU the chunks' rows are a matrix whose column sums are wanted.
  DPT_CUDA_OR_CPU(out.device(),
                  cuda::column_sums_finish({part.f32(), beta, out.f32()}, {}, chunks, cols, stream_of(out.device())),
                  cpu::bias_grad(part.f32(), chunks, cols, beta, out.f32()));
}

GradSlot grad_slot(Grads& grads, size_t i, const Shape& shape, const Device& d) {
  if (Tensor acc = grads.accumulator(i); acc.defined()) return {acc, grads.take_beta(i), false};
  return {Tensor::empty(shape, DType::f32, d), 0.0f, true};
}
GradSlot needed_slot(Grads& grads, size_t i, const Shape& shape, const Device& d) {
  return grads.needed(i) ? grad_slot(grads, i, shape, d) : GradSlot{};
}
void put_slot(Grads& grads, size_t i, GradSlot& slot) {
  if (slot.fresh) grads.put(i, std::move(slot.t));
}

}  // namespace dpt::detail
