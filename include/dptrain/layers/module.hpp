// Module: a layer or a stack of layers. Its parameters and their gradients live in one
// flat buffer per device (each parameter a view into it), so gradient reduction is one
// collective over one buffer and the optimizer is one fused launch. Buffers (batch
// norm's running statistics) live in a flat buffer of their own, outside all that.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <dptrain/runtime/tensor.hpp>

namespace dpt::nn {

struct Parameter {
  std::string name;
  Shape shape;
  float init_bound;  // initialized uniform in init_value +- init_bound
  float init_value;
  Tensor value;  // a view into the flat parameter buffer once materialized
  // In bf16 compute (Module::set_compute_dtype): the bf16 copy of `value` that the layers
  // compute with, a view into the module's flat bf16 shadow buffer; else undefined.
  Tensor shadow;
  // > 0: initialized normal(0, init_std) instead (GPT-2's weights).
  float init_std = 0.0f;
  // How many times one forward uses it: 2 for a weight tied to two places (GPT's token
  // embedding and output projection), whose gradient is complete after its second part.
  int uses = 1;
  // Whether AdamW's weight decay applies to it (a GPT's biases and LayerNorms: no, as
  // nanoGPT and llm.c group them).
  bool decay = true;
};

// State a module keeps and updates itself but does not train, as torch's buffers (batch
// norm's running statistics): not in the gradient buffer, never touched by the
// optimizer, saved in checkpoints and kept identical on every replica.
struct Buffer {
  std::string name;
  Shape shape;
  float init;    // every element's initial value
  Tensor value;  // a view into the flat buffer of buffers once materialized
};

class Module {
 public:
  virtual ~Module() = default;
  virtual Tensor forward(const Tensor& x) = 0;
  // One line, e.g. "Linear(1024, 4096, relu)".
  virtual std::string describe() const = 0;

  Tensor operator()(const Tensor& x) { return forward(x); }
  // The same structure with parameters not yet placed on any device.
  virtual std::shared_ptr<Module> clone() const = 0;

  // Every parameter of this module and its children, depth-first in registration order.
  std::vector<Parameter*> parameters();
  // The same with names as the equivalent torch.nn.Sequential gives them ("0.weight",
  // "2.bias", ...), so checkpoints load into PyTorch as they are.
  virtual std::vector<std::pair<std::string, Parameter*>> named_parameters(const std::string& prefix = "");
  // How many torch.nn modules this one stands for (a Linear with a fused activation is
  // Linear + the activation: 2).
  virtual int torch_modules() const { return 1; }
  int64_t num_parameters();
  // Every buffer, depth-first in registration order, and with torch's names
  // ("1.running_mean", ...).
  std::vector<Buffer*> buffers();
  virtual std::vector<std::pair<std::string, Buffer*>> named_buffers(const std::string& prefix = "");

  // Training mode (the default) or evaluation mode, for this module and its children, as
  // torch's train() / eval(): batch norm normalizes with the batch's statistics in
  // training and with its running statistics in evaluation.
  void train(bool on = true);
  void eval() { train(false); }
  bool training() const { return training_; }

  // Places every parameter on `device` as a view into one flat parameter buffer (and
  // its gradient into one flat gradient buffer), initialized from `seed` the same way
  // on any device: the values are made on the host by the Philox generator. Buffers
  // go into a flat buffer of their own with their initial values.
  void to(const Device& device, uint64_t seed);
  // A replica on `device`: the same structure and mode with its own flat buffers,
  // holding this module's current parameters and buffers (one device-to-device copy of
  // each flat buffer).
  std::shared_ptr<Module> replicate(const Device& device) const;
  bool materialized() const { return flat_params_.defined(); }
  const Tensor& flat_params() const { return flat_params_; }
  const Tensor& flat_grads() const { return flat_grads_; }
  // Makes `storage` hold the gradients instead, parameter k's at offsets[k] (ZeRO stage 2:
  // a few bucket-sized slots that the buckets take turns in); flat_grads() is then
  // `storage`, which is no longer laid out as the parameters are.
  void bind_grads(Tensor storage, const std::vector<int64_t>& offsets);
  // Every buffer, back to back (undefined when the module has none).
  const Tensor& flat_buffers() const { return flat_buffers_; }
  Device device() const { return flat_params_.device(); }
  // Offsets of every parameter in the flat buffer, and its total size.
  std::vector<int64_t> layout(int64_t* total);
  // Where each child's parameters end in the flat buffer (children in registration order,
  // -1 for a child without any), for make_copy_chunks; all -1 for a module with parameters
  // of its own besides its children's.
  std::vector<int64_t> child_ends();
  // The same for the buffers in theirs.
  std::vector<int64_t> buffer_layout(int64_t* total);
  // Starts a step's gradients: marks every parameter's gradient stale, so the first
  // write of the backward pass overwrites it (a GEMM with beta 0) and nothing has to
  // zero the flat buffer first (a pass over all of it). settle_grads() zeroes those
  // that backward did not reach; the optimizers and data parallelism call it.
  void zero_grad();
  void settle_grads();

  // The element type the layers compute and store activations in: f32 (the default) or
  // bf16. In bf16 the fp32 flat parameter buffer stays the master (the optimizer updates
  // it, gradients stay fp32, checkpoints save it) and a flat bf16 shadow of it, laid out
  // alike, is what Linear layers multiply with; their activations are bf16. Set it on the
  // module placed with to(), before or after; it applies to the children and to replicas.
  // DataParallel (so the Trainer and dptrain) sets it from its precision option: bf16
  // precision means bf16 compute, any other f32.
  void set_compute_dtype(DType t);
  DType compute_dtype() const { return compute_dtype_; }
  // The bf16 shadow of flat_params() (undefined in f32 compute). The optimizer refreshes it
  // in its update; whoever writes the master parameters otherwise (a checkpoint load, a
  // parameter broadcast) calls refresh_shadow() afterwards.
  const Tensor& flat_shadow() const { return flat_shadow_; }
  void refresh_shadow();

  // Parameters start at multiples of this many floats (256 bytes) for vector loads.
  static constexpr int64_t kAlign = 64;

  // Whether a DataParallel trains this module as its master now: one at a time (two would
  // each update the master's parameters from their own replicas, which then drift apart).
  // DataParallel sets it for its lifetime.
  bool in_data_parallel() const { return in_data_parallel_; }
  void set_in_data_parallel(bool on) { in_data_parallel_ = on; }

 protected:
  Parameter& register_parameter(std::string name, Shape shape, float init_bound, float init_value = 0.0f);
  Buffer& register_buffer(std::string name, Shape shape, float init);
  // `name`, when given, prefixes the child's parameter and buffer names ("h.0." + "ln_1.weight").
  void register_module(std::shared_ptr<Module> child, std::string name = {});
  // Makes `flat` (laid out by layout()) the parameter buffer, with a zeroed gradient
  // buffer, and `buffers` (laid out by buffer_layout(); undefined when there are none)
  // the buffer of buffers.
  void bind(Tensor flat, Tensor buffers);

  const std::vector<std::shared_ptr<Module>>& children() const { return children_; }
  // A forward calls it just before its child i runs: the hook of a BeforeChildGuard made
  // for this module on this thread, if any (a nested module is not the one hooked).
  void before_child(size_t i) const;

 private:
  bool in_data_parallel_ = false;
  bool has_parent_ = false;  // registered as another module's child (a module has one place)
  std::vector<std::unique_ptr<Parameter>> params_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  std::vector<std::shared_ptr<Module>> children_;
  std::vector<std::string> child_names_;  // a child's name, or empty
  std::string child_prefix(const std::string& prefix, size_t i) const;
  Tensor flat_params_, flat_grads_, flat_buffers_, flat_shadow_;
  std::vector<Parameter*> bound_params_;  // parameters(), as bind() laid them out: a step's own list
  // Set by bind() on the module and its children: their parameters are laid out, so none
  // may be added (zero_grad() and the update would not see it).
  bool placed_ = false;
  void mark_placed();
  bool training_ = true;
  DType compute_dtype_ = DType::f32;
  // Makes (bf16) or drops (f32) the shadow buffer and the parameters' views into it.
  void bind_shadow();
};

// A contiguous range of the flat parameter buffer, copied or updated in one piece.
struct CopyChunk {
  int64_t offset;
  int64_t count;
  bool operator==(const CopyChunk&) const = default;
};

// The flat buffer [0, total) cut at the ends of children's parameters (child_end[c], -1 for
// a child without any: Module::child_ends), each chunk at least min_floats but the last,
// which runs to `total`. chunk_of[c] is the chunk that child c's last parameter is in (-1
// for none): once it is written, so are the child's parameters, the chunks being written
// in order. p2p's copies of the master's parameters.
std::vector<CopyChunk> make_copy_chunks(const std::vector<int64_t>& child_end, int64_t total, int64_t min_floats,
                                        std::vector<int>& chunk_of);

// While it lives, `owner`'s forward on this thread calls before_child(i) just before its
// child i runs (Sequential: for a run of Linear children computed as one, for each of them
// before the run). Whoever writes the parameters on another stream waits there for that
// child's, which then arrive layer by layer (p2p replicas' copies), instead of for all of
// them before the first layer.
class BeforeChildGuard {
 public:
  BeforeChildGuard(const Module* owner, std::function<void(size_t)> before_child);
  ~BeforeChildGuard();
  BeforeChildGuard(const BeforeChildGuard&) = delete;
  BeforeChildGuard& operator=(const BeforeChildGuard&) = delete;

 private:
  const Module* outer_owner_;
  std::function<void(size_t)> outer_;
};

}  // namespace dpt::nn
