// Helpers that the op files (ops.cpp, ops_conv.cpp) share: argument checks and the
// autograd bookkeeping of a differentiable op. Not part of the API.
#pragma once
#include <memory>
#include <vector>

#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/tensor.hpp>

namespace dpt::detail {

// DPT_CHECKs that the tensors are on one device / that t is a defined f32 tensor.
void same_device(const Tensor& a, const Tensor& b, const char* op);
void need_f32(const Tensor& t, const char* op);
// Records `node` as the history of `out` when autograd is on for these inputs.
void record(Tensor& out, std::shared_ptr<Node> node, std::vector<Tensor> inputs);
// Adds a fresh gradient `g` for input i: in place into its accumulator when it has one.
void give(Grads& grads, size_t i, Tensor g);

}  // namespace dpt::detail
