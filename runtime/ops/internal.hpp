// Helpers that the op families (runtime/ops/*.cpp, one file per family) share: argument
// checks, the device's stream and scratch, and the autograd bookkeeping of a
// differentiable op. Not part of the API.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/tensor.hpp>

#if DPT_WITH_CUDA
#include "kernels/cuda/cuda.hpp"
#endif

// Op dispatch by device: gpu_call on a CUDA device, cpu_call on the CPU. A build without
// the GPU library that the op calls (CUDA, or cuDNN for convolutions) does not compile the
// GPU call at all, and a CUDA device gets an error naming what is missing.
#define DPT_GPU_OR_CPU(dev, gpu_call, cpu_call) \
  do {                                          \
    if ((dev).is_cuda()) {                      \
      gpu_call;                                 \
    } else {                                    \
      cpu_call;                                 \
    }                                           \
  } while (0)
#define DPT_CPU_ONLY(dev, missing, cpu_call)                                                  \
  do {                                                                                        \
    if ((dev).is_cuda()) throw ::dpt::Error(std::string("this op on CUDA needs ") + missing); \
    cpu_call;                                                                                 \
  } while (0)

#if DPT_WITH_CUDA
#define DPT_CUDA_OR_CPU(dev, cuda_call, cpu_call) DPT_GPU_OR_CPU(dev, cuda_call, cpu_call)
#else
#define DPT_CUDA_OR_CPU(dev, cuda_call, cpu_call) DPT_CPU_ONLY(dev, "dptrain built with CUDA", cpu_call)
#endif
#if DPT_WITH_CUDNN
#define DPT_DNN_OR_CPU(dev, dnn_call, cpu_call) DPT_GPU_OR_CPU(dev, dnn_call, cpu_call)
#else
#define DPT_DNN_OR_CPU(dev, dnn_call, cpu_call) DPT_CPU_ONLY(dev, "dptrain built with cuDNN (convolutions)", cpu_call)
#endif

namespace dpt::detail {

#if DPT_WITH_CUDA
// The stream of the device's current context, with the device made current.
cudaStream_t stream_of(const Device& d);
// Scratch space for the deterministic two-stage reductions.
Tensor reduce_work(const Device& d, int64_t at_least);
#endif

// DPT_CHECKs that the tensors are on one device / that t is a defined f32 tensor.
void same_device(const Tensor& a, const Tensor& b, const char* op);
void need_f32(const Tensor& t, const char* op);
// DPT_REQUIREs a defined bf16 tensor / a defined f32 or bf16 one.
void need_bf16(const Tensor& t, const char* op);
void need_float(const Tensor& t, const char* op);
bool is_bf16(const Tensor& t);
// Records `node` as the history of `out` when autograd is on for these inputs.
void record(Tensor& out, std::shared_ptr<Node> node, std::vector<Tensor> inputs);
// A layer's inputs as a node's edges: x, the weight, and the bias where there is one.
std::vector<Tensor> layer_inputs(const Tensor& x, const Tensor& w, const Tensor& b);
// Adds a fresh gradient `g` for input i: in place into its accumulator when it has one.
void give(Grads& grads, size_t i, Tensor g);
// The same with g's column sums (Grads::put's; a leaf's accumulator takes g alone).
void give(Grads& grads, size_t i, Tensor g, const ColumnSums& sums);
// out = beta out + the sums' columns added over their chunks in order (beta 0 never reads
// out): a bias gradient from the column sums that came with its output's gradient.
void finish_column_sums(const ColumnSums& sums, float beta, const Tensor& out);

// Where a backward writes input i's gradient: its accumulator, with the beta take_beta
// gives (writing it is then due), or a new tensor (beta 0) that put_slot hands over.
struct GradSlot {
  Tensor t;
  float beta = 0.0f;
  bool fresh = false;
  float* f32_or_null() const { return t.defined() ? t.f32() : nullptr; }  // null: no gradient wanted
};
GradSlot grad_slot(Grads& grads, size_t i, const Shape& shape, const Device& d);
// grad_slot where input i needs a gradient, else an empty slot (put_slot then does nothing).
GradSlot needed_slot(Grads& grads, size_t i, const Shape& shape, const Device& d);
void put_slot(Grads& grads, size_t i, GradSlot& slot);

}  // namespace dpt::detail
