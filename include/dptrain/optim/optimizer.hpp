// The optimizers' shared base: an update over a module's flat parameter buffer (one fused
// launch per step, whatever the number of parameters), its step counter on the device, the
// schedule it follows, ZeRO shards, per-bucket parts of a step and twin buffers. The kinds
// of update are sgd.hpp and adamw.hpp; their kernels are runtime/ops.hpp's updates.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <dptrain/enum_names.hpp>
#include <dptrain/layers/module.hpp>
#include <dptrain/optim/schedule.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/types.hpp>

namespace dpt {
inline constexpr auto kBf16RoundingNames = enum_names<Bf16Rounding>(
    "bf16 rounding", {{Bf16Rounding::nearest, "nearest"}, {Bf16Rounding::stochastic, "stochastic"}});
}  // namespace dpt

namespace dpt::optim {

class Optimizer {
 public:
  // The model must outlive the optimizer: each step also refreshes its bf16 shadow (bf16
  // compute), whenever that was switched on. The learning rate is `lr` at every step
  // until set_schedule gives a schedule. `kind`: what kind() returns (a string literal).
  Optimizer(nn::Module& model, float lr, const char* kind);
  virtual ~Optimizer() = default;
  // One update from the module's gradients; grad_scale (a device scalar, may be
  // undefined) multiplies them first, as gradient clipping asks. What changes from step
  // to step (the schedule's learning rate, AdamW's bias corrections) is computed on the
  // device from the optimizer's step counter, first thing in the step: nothing for the
  // caller to set before a step, and a CUDA graph of a step replays the schedule.
  virtual void step(const Tensor& grad_scale = {}) = 0;
  // step(check_gradients(gradients, max_norm, ring)) in one launch where the device allows
  // (ops' checked updates: one kernel less a step in a small model); returns the scale.
  virtual Tensor checked_step(float max_norm, const CheckRing& ring = {}) = 0;
  // A part of step(): the update of elements [offset, offset + count) of the flat buffers
  // alone (DataParallelOptions::update_per_bucket: a bucket as soon as its sum is done),
  // with the step's values from the counter; `last` moves the counter (and the host's
  // count) on, so it comes after the step's other parts in stream order. The parts of a
  // step update every element once: the parameters and state are step()'s bit for bit.
  // Not for a ZeRO shard.
  void step_part(int64_t offset, int64_t count, bool last);
  virtual std::string describe() const = 0;
  const nn::Module& model() const { return *model_; }  // the module it updates
  // The schedule the steps consult, by the optimizer's step count (0-based).
  // UsageError for a base_lr that is not a positive number, a warmup < 0 or a total < 1.
  void set_schedule(const Schedule& schedule);
  const Schedule& schedule() const { return schedule_; }
  float lr() const { return schedule_.at(t_); }  // the next step's (on the host)
  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t);  // and the device's counter (a resume)
  // The host's count, for steps that a CUDA graph's recording counted and the device did
  // not run, or that a replay ran and the host did not count (writing the device's counter
  // from the host would race with replays on another stream). With twin buffers each of
  // those steps also swaps the copies, so the count must be one of such steps, not a
  // correction of anything else.
  void set_host_steps(int64_t t);
  // Twin buffers: a second copy of the parameters and of the optimizer's state, so that
  // checked_step reads the gradients once, in the update (ops' alternating updates: the
  // check's own pass over them is gone), where the check reads them first in a pass of
  // its own. Each step writes the other copy and the two swap (Tensor::swap_memory): every
  // view of the parameters and of state() follows, and a CUDA graph's replays alternate by
  // the counter. The cost: one more copy of the parameters and the state. While they are
  // on, every update is checked_step without clipping (the others refuse), so that the
  // copies' order follows the step count. Not for a ZeRO shard (an empty one, or an empty
  // model, keeps none). Switch it before the steps, and before a CUDA graph records one:
  // off frees the second copy, and on frees the speculative update's backup, which work
  // already queued (or a recorded graph) may still use.
  void set_twin_buffers(bool on);
  bool twin_buffers() const { return !twins_.empty(); }
  int64_t twin_bytes() const;  // the second copies' memory
  // "sgd" or "adamw", and the optimizer's state as named flat buffers (what a
  // checkpoint saves and a resume restores): of the elements it updates, shard_begin() on.
  const char* kind() const { return kind_; }
  virtual std::vector<std::pair<std::string, Tensor>> state() const = 0;
  // The names of state()'s buffers, also when this shard is empty and state() has none.
  virtual std::vector<std::string> state_names() const = 0;
  // ZeRO: updates only elements [begin, end) of the flat buffers (this device's shard; may
  // be empty), with state for those alone, zeroed. By default it updates them all.
  // `grads` (stage 2): the shard's gradients, held apart from the module's.
  void restrict_to(int64_t begin, int64_t end, const Tensor& grads = {});
  int64_t shard_begin() const { return begin_; }
  int64_t shard_size() const { return params_.numel(); }
  // How each update rounds the module's bf16 shadow (bf16 compute; nothing to round in
  // f32): to nearest, ties to even (the default), or stochastically, llm.c's way, with
  // random bits of (seed, the step, the element's index in the flat buffer), so that the
  // copy is the masters on average (ShadowRounding). Every replica's optimizer gets the
  // same (an OptimizerFactory sets it); DataParallel refuses stochastic rounding where
  // only the master updates (p2p), whose copies of the parameters are cast to nearest.
  void set_bf16_rounding(Bf16Rounding mode, uint64_t seed);
  Bf16Rounding bf16_rounding() const { return rounding_.mode; }
  // The shadow made again from the parameters as the last update rounded it (ops'
  // refresh_shadow): of the whole flat buffer, after the parameters were written from
  // elsewhere (a resume: after set_steps_taken); or of the elements outside this ZeRO
  // shard, after the gather of the other partitions (stochastic rounding: DataParallel).
  void refresh_shadow();
  void refresh_shadow_outside_shard();

 protected:
  // The bf16 copy of the parameters the update also writes, its shard's part (undefined in
  // f32 compute).
  Tensor shadow() const;
  // (Re)makes the state for `n` elements, zeroed (none when n is 0).
  virtual void reset_state(int64_t n) = 0;
  // The counter this step's update reads and moves on, on the device (ops' StepCounter:
  // the schedule's lr and AdamW's bias corrections come from it); the update's caller
  // moves the host's count (t_) on once the update is queued.
  StepCounter step_counter(float beta1, float beta2) const;
  // checked_step's backup for its speculative update (ops' checked updates), kept from
  // step to step (a CUDA graph's replays write the one it recorded); undefined where the
  // update takes none. `buffers`: the parameters' and the state's.
  const Tensor& backup(int buffers, float max_norm);
  // Elements [offset, offset + count) of a flat buffer (an undefined one stays undefined).
  static Tensor part_of(const Tensor& t, int64_t offset, int64_t count);
  // The update of one range of the buffers (step_part's, in the flat buffers' coordinates).
  virtual void update_range(int64_t offset, int64_t count, const StepCounter& step) = 0;
  // Twin buffers: the second copy of buffer k (0 the parameters, then state()'s in order),
  // a refusal of the updates that cannot run with them, and the swap after a step.
  const Tensor& twin(size_t k) const { return twins_.at(k).second; }
  void refuse_with_twins(const char* what) const;
  // checked_step's start: max_norm checked (UsageError), clipping refused with twin
  // buffers, the gradients settled.
  void begin_checked_step(float max_norm);
  void swap_twins();
  nn::Module* model_;
  Tensor params_, grads_;
  Schedule schedule_;
  int64_t t_ = 0;  // the host's count of the device's counter
  int64_t begin_ = 0;

 private:
  // Elements [begin, end) of the flat buffers' shadow (refresh_shadow).
  void refresh_shadow_range(int64_t begin, int64_t end);
  const char* kind_;
  ShadowRounding rounding_;  // first: 0 (step_counter gives the shard's or part's)
  Tensor counter_;
  Tensor backup_;
  std::vector<std::pair<Tensor, Tensor>> twins_;  // (a buffer, its second copy), made once
};

}  // namespace dpt::optim
