#include "module.hpp"

#include "../kernels/cpu/cpu.hpp"
#include "../kernels/error.hpp"
#include "../runtime/ops.hpp"

namespace dpt::nn {

std::vector<Parameter*> Module::parameters() {
  std::vector<Parameter*> out;
  for (auto& p : params_) out.push_back(p.get());
  for (auto& c : children_)
    for (Parameter* p : c->parameters()) out.push_back(p);
  return out;
}

std::vector<std::pair<std::string, Parameter*>> Module::named_parameters(const std::string& prefix) {
  std::vector<std::pair<std::string, Parameter*>> out;
  for (auto& p : params_) out.push_back({prefix + p->name, p.get()});
  for (auto& c : children_)
    for (auto& np : c->named_parameters(prefix)) out.push_back(np);
  return out;
}

int64_t Module::num_parameters() {
  int64_t n = 0;
  for (Parameter* p : parameters()) n += numel(p->shape);
  return n;
}

Parameter& Module::register_parameter(std::string name, Shape shape, float init_bound) {
  params_.push_back(std::make_unique<Parameter>(Parameter{std::move(name), std::move(shape), init_bound, {}}));
  return *params_.back();
}

void Module::register_module(std::shared_ptr<Module> child) { children_.push_back(std::move(child)); }

std::vector<int64_t> Module::layout(int64_t* total) {
  std::vector<int64_t> offsets;
  int64_t at = 0;
  for (Parameter* p : parameters()) {
    offsets.push_back(at);
    at += (numel(p->shape) + kAlign - 1) / kAlign * kAlign;
  }
  *total = at;
  return offsets;
}

void Module::bind(Tensor flat) {
  int64_t total = 0;
  const auto offsets = layout(&total);
  DPT_CHECK(flat.numel() == total, "Module::bind: flat buffer of the wrong size");
  flat_params_ = std::move(flat);
  flat_grads_ = Tensor::zeros({total}, DType::f32, flat_params_.device());
  auto params = parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    Parameter& p = *params[k];
    p.value = flat_params_.view(offsets[k], p.shape);
    p.value.set_requires_grad(true);
    p.value.set_grad(flat_grads_.view(offsets[k], p.shape));
  }
}

void Module::to(const Device& device, uint64_t seed) {
  int64_t total = 0;
  const auto offsets = layout(&total);
  auto params = parameters();
  // Values on the host: parameter k is stream k of the Philox generator for `seed`.
  // Padding between parameters stays zero (its gradient is zero too, so it never moves).
  std::vector<float> host(static_cast<size_t>(total), 0.0f);
  for (size_t k = 0; k < params.size(); ++k)
    cpu::uniform(host.data() + offsets[k], numel(params[k]->shape), seed, k, 0,
                 -params[k]->init_bound, params[k]->init_bound);
  bind(Tensor::from_host(host, {total}, device));
}

std::shared_ptr<Module> Module::replicate(const Device& device) const {
  DPT_CHECK(materialized(), "replicate() of a module that is on no device");
  std::shared_ptr<Module> r = clone();
  Tensor flat = Tensor::empty(flat_params_.shape(), DType::f32, device);
  copy(flat, flat_params_);
  r->bind(std::move(flat));
  return r;
}

void Module::zero_grad() {
  DPT_CHECK(materialized(), "zero_grad() before the module was placed on a device with to()");
  zero_(flat_grads_);
}

}  // namespace dpt::nn
