// Small enums and argument structs that the CPU and CUDA kernels share.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace dpt {

// Element types of tensors. bf16 values are stored as uint16_t: the upper half of an IEEE
// float (kernels/bf16.hpp converts).
// The one element type of the library: tensors, checkpoints (as the safetensors names
// F32, BF16, I32: train/checkpoint.hpp) and the gradients' wire type are all of these.
// Data files hold more (float64, float16, uint8, int64 in .npy and safetensors), which no
// tensor holds: data::ArrayDType names those, and the input pipeline converts them.
enum class DType { f32, bf16, i32 };
// Each DType's name and the bytes of an element, in the enum's order: one table that the
// name, its parse and the size read.
struct DTypeInfo {
  DType type;
  const char* name;
  size_t size;
};
inline constexpr DTypeInfo kDTypes[] = {{DType::f32, "f32", 4}, {DType::bf16, "bf16", 2}, {DType::i32, "i32", 4}};
// "f32", "bf16", "i32", and back (nullopt for any other name).
constexpr const char* dtype_name(DType t) {
  for (const DTypeInfo& d : kDTypes)
    if (d.type == t) return d.name;
  return "?";
}
constexpr std::optional<DType> parse_dtype(std::string_view name) {
  for (const DTypeInfo& d : kDTypes)
    if (name == d.name) return d.type;
  return std::nullopt;
}
constexpr size_t dtype_size(DType t) {  // bytes an element
  for (const DTypeInfo& d : kDTypes)
    if (d.type == t) return d.size;
  return 4;
}

// gelu is the exact GELU, x Phi(x) (torch.nn.GELU()); gelu_tanh its tanh approximation
// (torch.nn.GELU(approximate='tanh'), GPT-2's).
enum class Act : int { none = 0, relu, gelu, tanh, gelu_tanh };
// Whether act's backward reads the pre-activation (which the forward then saves) rather
// than the output: the GELUs, whose derivative is no function of their output. (The CUDA
// kernels ask it too.)
// clang-format off
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr bool act_saves_input(Act act) { return act == Act::gelu || act == Act::gelu_tanh; }
// clang-format on

// How a GEMM rounds its inputs: strict fp32, TF32 tensor cores, or bf16 tensor cores
// (fp32 accumulation in every case).
enum class Precision : int { fp32 = 0, tf32, bf16 };

struct SgdArgs {
  float lr = 0.01f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};

// A learning-rate schedule as an update computes its rate from it, on the device: the rate at step s (0-based) is
// constant; or rises linearly from 0 over `warmup` steps, then stays (warmup); or after the warm-up decays as a cosine
// to 0 at `total`.
struct ScheduleArgs {
  int kind = 0;  // 0 constant, 1 warmup, 2 cosine
  float base_lr = 0.01f;
  int64_t warmup = 0;
  int64_t total = 1;
  float final_lr = 0.0f;  // where the cosine ends (0, as PyTorch's CosineAnnealingLR by default)
};

// AdamW's hyperparameters, as a user sets them (optim::AdamW::Options).
struct AdamHyperparams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

// An AdamW update's arguments: the hyperparameters, and bias_correction1/2 = 1 - beta^t for
// the step t (1-based). An update given a step counter (StepCounterArgs) takes lr and the
// corrections from it instead.
struct AdamArgs : AdamHyperparams {
  float bias_correction1 = 1.0f;
  float bias_correction2 = 1.0f;
  // Where weight decay applies (nanoGPT and llm.c decay matrices and embeddings, not
  // biases or LayerNorms): null, everywhere; else one int32 per 64 elements of the flat
  // parameter buffer (parameters start at multiples of 64), 0 where no decay applies, and
  // `first` the flat index of the update's element 0 (a ZeRO shard's or a bucket's start).
  const int32_t* decay_chunks = nullptr;
  int64_t first = 0;
};
// The weight decay of element i of an update of `a`.
inline float weight_decay_at(const AdamArgs& a, int64_t i) {
  return !a.decay_chunks || a.decay_chunks[(a.first + i) >> 6] ? a.weight_decay : 0.0f;
}

// How an update rounds the parameters into their bf16 copy (the shadow that bf16 compute
// reads): to nearest, ties to even; or stochastically, up with probability the distance
// to the lower bf16 neighbour over the gap between the two (kernels/bf16.hpp), so that
// the copy is the fp32 master on average. `seed` and `first` key the stochastic rounding's
// random bits: element i of an update draws them from (seed, the update's step, first + i),
// `first` the flat index of the update's element 0 (a ZeRO shard's or a bucket's start),
// so every replica, rank and partition, the CPU and the GPU round an element alike
// (kernels/shadow.hpp). It comes with a step counter (StepCounterArgs), whose step it reads.
enum class Bf16Rounding : int { nearest = 0, stochastic };
struct ShadowRounding {
  Bf16Rounding mode = Bf16Rounding::nearest;
  uint64_t seed = 0;
  int64_t first = 0;
};

// An optimizer's step counter on the device, which its update advances: the update reads
// *t (the steps taken before it), takes the rate of `schedule` at that step and AdamW's
// bias corrections 1 - beta^(t+1), and moves *t on by one, whether it applies the step or
// skips it (unless `advance` is false). `blocks_done` is the update kernel's count of its
// finished blocks, 0 between steps. So a recorded CUDA graph follows the schedule without
// the host.
struct StepCounterArgs {
  int64_t* t = nullptr;
  unsigned* blocks_done = nullptr;
  ScheduleArgs schedule;
  float beta1 = 0.0f, beta2 = 0.0f;
  bool advance = true;           // false: a part of the step's update (per bucket) that leaves *t as it is
  ShadowRounding rounding = {};  // how the update writes its bf16 shadow (stochastic: keyed by *t)
};

// One step's gradient check, written by the device into host memory for the host to read
// steps later without waiting (check_gradients): the scale's bits (NaN: the update was
// skipped), -1 when every gradient is finite, else the flat index of the first non-finite
// one (INT32_MAX when all are finite and only their norm overflowed), and `tag`: the
// check's number + 1, so that the host sees which check the slot holds. 16 bytes, written
// by the device in one store.
struct alignas(16) CheckRecord {
  int32_t scale_bits;
  int32_t index;
  int64_t tag;
};

// Where check_gradients writes: records[*count % slots], then *count + 1 (a device counter,
// so that a recorded CUDA graph writes each replay's record to the next slot).
struct CheckRingArgs {
  CheckRecord* records = nullptr;
  int64_t slots = 0;
  int64_t* count = nullptr;
};

// The samples that the rows of a tensor of synthetic data are: row i is sample
// first + (i / per_group) * group_stride + i % per_group, wrapped into [0, samples) when
// samples > 0. So one tensor holds a replica's part of several steps' batches (groups of
// per_group rows, group_stride samples apart) and is made in one pass.
struct RowMap {
  int64_t first = 0;
  int64_t per_group = 1;
  int64_t group_stride = 1;
  int64_t samples = 0;
};

// A 2-D convolution over NCHW tensors: x [n, c, h, w] * weight [k, c, r, s] (+ bias [k])
// -> y [n, k, p, q], as torch.nn.Conv2d. Stride, padding and dilation are the same along
// both axes.
struct ConvShape {
  int64_t n = 0, c = 0, h = 0, w = 0;  // input
  int64_t k = 0, r = 0, s = 0;         // output channels, kernel height, kernel width
  int64_t stride = 1, pad = 0, dilation = 1;
  int64_t p() const { return (h + 2 * pad - dilation * (r - 1) - 1) / stride + 1; }
  int64_t q() const { return (w + 2 * pad - dilation * (s - 1) - 1) / stride + 1; }
};

// Pooling over NCHW: x [n, c, h, w] -> y [n, c, p, q] with a kh x kw window, as
// torch.nn.MaxPool2d / AvgPool2d (padding counts as -inf for max and as zeros that are
// counted for average, torch's count_include_pad=True). Global average pooling is the
// window kh = h, kw = w.
enum class Pool : int { max = 0, avg };
struct PoolShape {
  int64_t n = 0, c = 0, h = 0, w = 0;
  int64_t kh = 0, kw = 0, stride = 1, pad = 0;
  int64_t p() const { return (h + 2 * pad - kh) / stride + 1; }
  int64_t q() const { return (w + 2 * pad - kw) / stride + 1; }
};

// Batch norm over NCHW, per channel, as torch.nn.BatchNorm2d: training normalizes with
// the batch's mean and (biased) variance and moves the running statistics by
// `momentum` toward the batch's mean and unbiased variance.
struct BatchNormArgs {
  float eps = 1e-5f;
  float momentum = 0.1f;
};

}  // namespace dpt
