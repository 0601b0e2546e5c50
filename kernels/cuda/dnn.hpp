// The cuDNN twins of the CPU convolution, pooling and batch-norm kernels (cpu.hpp,
// conv.cpp), fp32 NCHW. Descriptors and the convolution algorithms are made once per
// shape and cached; the caller hands in the workspace (from the caching allocator), so a
// step makes no cudaMalloc. The handle must already be bound to its stream. Built only
// when cuDNN is found (DPT_WITH_CUDNN).
#pragma once
#include <cstddef>

#include <cublas_v2.h>
#include <cudnn.h>

#include <dptrain/types.hpp>

namespace dpt::cuda {

// The workspace the three convolution passes of this shape need (the largest of them,
// cuDNN's and our own kernels').
// `precision` picks strict fp32 or tensor-core math (tf32; bf16 runs as tf32 here).
size_t conv2d_workspace_bytes(cudnnHandle_t h, Precision precision, const ConvShape& s);
void conv2d_forward(cudnnHandle_t h, Precision precision, const ConvShape& s, const float* x, const float* w,
                    const float* bias, float* y, void* ws, size_t ws_bytes);
void conv2d_backward_data(cudnnHandle_t h, Precision precision, const ConvShape& s, const float* dy, const float* w,
                          float* dx, void* ws, size_t ws_bytes);
// The weight gradient through cuDNN, or for convolutions with few inputs per output
// through im2col and cuBLAS (`blas`, bound to the same stream); the bias gradient (db may
// be null) by our own deterministic reduction (conv.cu).
void conv2d_backward_filter(cudnnHandle_t h, cublasHandle_t blas, Precision precision, const ConvShape& s,
                            const float* x, const float* dy, float beta, float* dw, float* db, void* ws,
                            size_t ws_bytes);
void pool2d_forward(cudnnHandle_t h, const PoolShape& s, Pool kind, const float* x, float* y);
void pool2d_backward(cudnnHandle_t h, const PoolShape& s, Pool kind, const float* x, const float* y, const float* dy,
                     float* dx);
void batchnorm_forward_train(cudnnHandle_t h, int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma,
                             const float* beta, const BatchNormArgs& a, float* running_mean, float* running_var,
                             float* y, float* save_mean, float* save_invstd);
void batchnorm_forward_eval(cudnnHandle_t h, int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma,
                            const float* beta, const BatchNormArgs& a, const float* running_mean,
                            const float* running_var, float* y);
void batchnorm_backward(cudnnHandle_t h, int64_t n, int64_t c, int64_t hw, const float* x, const float* dy,
                        const float* gamma, const float* save_mean, const float* save_invstd, float* dx,
                        float param_beta, float* dgamma, float* dbeta);

}  // namespace dpt::cuda
