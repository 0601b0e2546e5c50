// The layers: Linear (with an optional fused activation), activations, Sequential and
// an MLP built from a spec string.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <dptrain/enum_names.hpp>
#include <dptrain/layers/module.hpp>
#include <dptrain/types.hpp>

namespace dpt::nn {

inline constexpr auto kActNames = enum_names<Act>("activation", {{Act::relu, "relu"},
                                                                 {Act::gelu, "gelu"},
                                                                 {Act::tanh, "tanh"},
                                                                 {Act::gelu_tanh, "gelu_tanh"},
                                                                 {Act::none, "none"}});
const char* act_name(Act act);
Act parse_act(const std::string& name);  // relu|gelu|tanh|gelu_tanh|none; UsageError otherwise

// y = act(x W^T + b), W [out, in], b [out]; initialized like torch.nn.Linear:
// uniform in +-1/sqrt(in). In bf16 compute (Module::set_compute_dtype) it multiplies the
// bf16 input (an f32 one is cast) with its parameters' bf16 shadows and returns bf16
// (linear_bf16); the gradients go to the fp32 masters.
class Linear : public Module {
 public:
  Linear(int64_t in, int64_t out, Act act = Act::none, bool bias = true);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Module> clone() const override;
  std::string describe() const override;
  int torch_modules() const override { return act_ == Act::none ? 1 : 2; }
  const Tensor& weight() const { return W_.value; }
  const Tensor& bias() const { return b_ ? b_->value : none_; }
  Act act() const { return act_; }
  bool computes_bf16() const { return W_.shadow.defined(); }
  // The bf16 copies of weight and bias (undefined unless computes_bf16(); the bias's also
  // without a bias).
  const Tensor& weight_bf16() const { return W_.shadow; }
  const Tensor& bias_bf16() const { return b_ ? b_->shadow : none_; }
  // GPT-2's initialization instead of torch's: weight normal(0, std), bias 0 (before the
  // module is placed).
  Linear& init_normal(float std);

 private:
  int64_t in_, out_;
  Act act_;
  Parameter& W_;
  Parameter* b_ = nullptr;
  Tensor none_;
};

class Activation : public Module {
 public:
  explicit Activation(Act act) : act_(act) {}
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Module> clone() const override { return std::make_shared<Activation>(act_); }
  std::string describe() const override;

 private:
  Act act_;
};

class Sequential : public Module {
 public:
  Sequential() = default;
  Sequential& add(std::shared_ptr<Module> m);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Module> clone() const override;
  std::vector<std::pair<std::string, Parameter*>> named_parameters(const std::string& prefix = "") override;
  std::vector<std::pair<std::string, Buffer*>> named_buffers(const std::string& prefix = "") override;
  int torch_modules() const override;
  std::string describe() const override;
  size_t size() const { return children().size(); }
  Module& child(size_t i) const { return *children().at(i); }
};

// Layer widths of an MLP spec: "1024-4096x3-1024" is 1024, 4096, 4096, 4096, 1024
// (x3 repeats a width). Presets: "seed" = 1000-1000, "mlp" = 1024-4096x3-1024.
// Throws UsageError naming the problem.
std::vector<int64_t> parse_mlp_spec(const std::string& spec);

// Linear layers between consecutive widths, `act` fused into every one but the last.
std::shared_ptr<Sequential> mlp(const std::string& spec, Act act = Act::relu);
std::shared_ptr<Sequential> mlp(const std::vector<int64_t>& widths, Act act = Act::relu);

}  // namespace dpt::nn
