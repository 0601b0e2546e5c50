// Causal self-attention in bf16 through cuDNN's fused scaled-dot-product attention (flash
// attention), with the cuDNN frontend's sdpa and sdpa_backward graphs: built once per
// shape and device and cached (building is slow, running is not). The layout is
// causal_attention's (ops.hpp): qkv [B*T, 3C] with q, k, v side by side and head h at
// columns h*hs of each; y [B*T, C]. The softmax statistics are cuDNN's own (fp32
// [B, heads, T]), which only its backward reads. Built only when the frontend's headers
// are found (DPT_WITH_CUDNN_FRONTEND); the handle must be bound to the stream already.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cudnn.h>

namespace dpt::cuda {

struct SdpaShape {
  int64_t batch = 0, heads = 0, seq = 0, head_size = 0;
  bool training = true;  // the forward writes the statistics for a backward
  // The backward adds dQ's parts in a fixed order (the same bits every run); false lets
  // cuDNN add them as its blocks finish (faster; the bits vary from run to run).
  bool deterministic = true;
};

// Whether cuDNN runs this shape on this GPU (the graph builds and is supported); the
// first call for a shape builds its graphs. False means: use our own kernel.
bool sdpa_supported(cudnnHandle_t h, const SdpaShape& s);
// The workspace the forward / the backward of this shape wants (its graph is built).
size_t sdpa_forward_workspace(cudnnHandle_t h, const SdpaShape& s);
size_t sdpa_backward_workspace(cudnnHandle_t h, const SdpaShape& s);
// stats: fp32 [B, heads, T] (not written when !s.training).
void sdpa_forward(cudnnHandle_t h, const SdpaShape& s, const uint16_t* qkv, uint16_t* y, float* stats, void* ws);
void sdpa_backward(cudnnHandle_t h, const SdpaShape& s, const uint16_t* qkv, const uint16_t* y, const uint16_t* dy,
                   const float* stats, uint16_t* dqkv, void* ws);

// The backwards launched so far in this process, each way (a graph's replays not counted):
// how a test sees which one a model's setting reached.
struct SdpaBackwardCalls {
  int64_t deterministic = 0, fast = 0;
};
SdpaBackwardCalls sdpa_backward_calls();

}  // namespace dpt::cuda
