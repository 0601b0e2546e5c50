// An optimizer's update beside the next step's forward. The update is queued on a stream
// of its own, in parts of one or more of the model's children (make_copy_chunks: the flat
// buffer's order, which is the order its forward reads them in: a Sequential's layers, a
// GPT's embedding, blocks and final LayerNorm), and the next forward waits for each part
// just before the child that reads it (BeforeChildGuard). The update is bound by memory
// and the forward's GEMMs by arithmetic, so the two can share the GPU instead of taking
// turns (GPT-2 124M's AdamW takes 1.3 ms of a 30 ms step on an H100; its embedding, a
// third of the parameters, is read first, so its part runs before the forward starts).
// A model whose forward calls no before_child (one without children, or with parameters
// of its own besides theirs) gets one part, waited for before its forward. The
// parameters and the state are step()'s bit for bit (the same kernel over the same
// elements, in parts: Optimizer::step_part).
//
// The contract: from queue() until the next forward() has returned, nothing else reads the
// parameters, the optimizer's state or the gradients, or writes the gradients, unless
// settle() came first (an evaluation, a checkpoint, a host read). Eager steps only: a CUDA
// graph's recording of a step takes the plain update (the parts' events would cross
// replays). On the CPU the parts run in turn, as step() would.
#pragma once
#include <cstddef>
#include <memory>
#include <vector>

#include <dptrain/layers/module.hpp>
#include <dptrain/optim/optimizer.hpp>
#include <dptrain/runtime/context.hpp>

namespace dpt::optim {

class UpdateBesideForward {
 public:
  // `opt` updates `model` (its whole flat buffer: not a ZeRO shard, no twin buffers, not
  // in a DataParallel), both on the current context's device; that context is the one the
  // steps run on. Parts hold at least min_part_floats parameters (the last may join the
  // one before it): GPT-2 124M's embedding, and each block (the final LayerNorm joins
  // the last); tests ask for a part a child (1).
  static constexpr int64_t kMinPartFloats = int64_t{1} << 20;
  UpdateBesideForward(Optimizer& opt, nn::Module& model, int64_t min_part_floats = kMinPartFloats);
  ~UpdateBesideForward();
  UpdateBesideForward(const UpdateBesideForward&) = delete;
  UpdateBesideForward& operator=(const UpdateBesideForward&) = delete;

  // Queues this step's update after the work queued so far on the step's context (the
  // backward): the gradients times grad_scale (a device scalar, may be undefined), as
  // Optimizer::step.
  void queue(const Tensor& grad_scale = {});
  // The model's forward of x, each child after its part of the update; the step's context
  // then waits for the whole update (before backward writes the gradients it reads).
  Tensor forward(const Tensor& x);
  // The step's context waits for the whole update.
  void settle();
  size_t parts() const { return chunks_.size(); }

 private:
  void wait_for(size_t part);
  void check_context(const char* where) const;
  Optimizer* opt_;
  nn::Module* model_;
  Context* ctx_;                          // the steps'
  std::unique_ptr<Context> update_ctx_;   // the update's stream
  std::unique_ptr<Event> backward_done_;  // the update's start
  std::vector<nn::CopyChunk> chunks_;     // the parts, in the flat buffer's order
  std::vector<int> chunk_of_child_;       // make_copy_chunks's (-1: no wait before the child)
  bool wait_all_first_ = false;           // no child is waited for: the forward waits first
  std::vector<std::unique_ptr<Event>> part_done_;
  size_t waited_ = 0;  // the parts the step's context waits for already
  Tensor scale_;       // the pending update's grad_scale: its memory is not reused before the wait
};

}  // namespace dpt::optim
