// Small enums and argument structs that the CPU and CUDA kernels share.
#pragma once
#include <cstdint>

namespace dpt {

enum class Act : int { none = 0, relu, gelu, tanh };

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

// bias_correction1/2 = 1 - beta^t, computed on the host for the step t (1-based).
struct AdamArgs {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  float bias_correction1 = 1.0f;
  float bias_correction2 = 1.0f;
};

}  // namespace dpt
