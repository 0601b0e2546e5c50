#include <dptrain/layers/module.hpp>

#include <functional>
#include <memory>
#include <utility>

#include <dptrain/error.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>
#include "kernels/cpu/cpu.hpp"

namespace dpt::nn {

namespace {
// Offsets of tensors of these shapes laid out back to back, each starting at a multiple
// of Module::kAlign floats, and the total size.
std::vector<int64_t> aligned_offsets(const std::vector<Shape>& shapes, int64_t* total) {
  std::vector<int64_t> offsets;
  int64_t at = 0;
  for (const Shape& s : shapes) {
    offsets.push_back(at);
    at += (numel(s) + Module::kAlign - 1) / Module::kAlign * Module::kAlign;
  }
  *total = at;
  return offsets;
}
}  // namespace

namespace {
// A module's own entries (item(entry)), then each child's (of_child(index, child)) in turn: the
// order that the flat buffers lay parameters and buffers out in.
template <class Item, class Entry, class ItemOf, class ItemsOfChild>
std::vector<Item> own_then_children(const std::vector<std::unique_ptr<Entry>>& own,
                                    const std::vector<std::shared_ptr<Module>>& children, ItemOf item,
                                    ItemsOfChild of_child) {
  std::vector<Item> out;
  for (const auto& e : own) out.push_back(item(*e));
  for (size_t k = 0; k < children.size(); ++k)
    for (Item& i : of_child(k, *children[k])) out.push_back(std::move(i));
  return out;
}
}  // namespace

std::vector<Parameter*> Module::parameters() {
  return own_then_children<Parameter*>(
      params_, children_, [](Parameter& p) { return &p; }, [](size_t, Module& c) { return c.parameters(); });
}

std::string Module::child_prefix(const std::string& prefix, size_t i) const {
  return child_names_[i].empty() ? prefix : prefix + child_names_[i] + ".";
}

std::vector<std::pair<std::string, Parameter*>> Module::named_parameters(const std::string& prefix) {
  return own_then_children<std::pair<std::string, Parameter*>>(
      params_, children_,
      [&](Parameter& p) {
        return std::pair{prefix + p.name, &p};
      },
      [&](size_t k, Module& c) { return c.named_parameters(child_prefix(prefix, k)); });
}

int64_t Module::num_parameters() {
  int64_t n = 0;
  for (Parameter* p : parameters()) n += numel(p->shape);
  return n;
}

std::vector<Buffer*> Module::buffers() {
  return own_then_children<Buffer*>(
      buffers_, children_, [](Buffer& b) { return &b; }, [](size_t, Module& c) { return c.buffers(); });
}

std::vector<std::pair<std::string, Buffer*>> Module::named_buffers(const std::string& prefix) {
  return own_then_children<std::pair<std::string, Buffer*>>(
      buffers_, children_,
      [&](Buffer& b) {
        return std::pair{prefix + b.name, &b};
      },
      [&](size_t k, Module& c) { return c.named_buffers(child_prefix(prefix, k)); });
}

void Module::train(bool on) {
  training_ = on;
  for (auto& c : children_) c->train(on);
}

Parameter& Module::register_parameter(std::string name, Shape shape, float init_bound, float init_value) {
  DPT_REQUIRE(!placed_, "register_parameter() after the module (or one it belongs to) was placed on a device");
  params_.push_back(
      std::make_unique<Parameter>(Parameter{std::move(name), std::move(shape), init_bound, init_value, {}, {}}));
  return *params_.back();
}

Buffer& Module::register_buffer(std::string name, Shape shape, float init) {
  DPT_REQUIRE(!placed_, "register_buffer() after the module (or one it belongs to) was placed on a device");
  buffers_.push_back(std::make_unique<Buffer>(Buffer{std::move(name), std::move(shape), init, {}}));
  return *buffers_.back();
}

void Module::register_module(std::shared_ptr<Module> child, std::string name) {
  DPT_REQUIRE(!placed_, "register_module() after the module (or one it belongs to) was placed on a device");
  if (!child) throw UsageError("register_module(): no module (a null pointer)");
  if (child->placed_ || child->materialized())
    throw UsageError("register_module(): the module is on a device already; add it before placing the model");
  // A module in two places would be bound, and trained, twice; one inside itself
  // (s->add(s), or an ancestor added below) would recurse without end.
  const std::function<bool(const Module&)> holds_this = [&](const Module& m) {
    if (&m == this) return true;
    for (const auto& c : m.children_)
      if (holds_this(*c)) return true;
    return false;
  };
  if (child->has_parent_ || holds_this(*child))
    throw UsageError("register_module(): the module belongs to a model already (here or elsewhere), or holds this one");
  child->has_parent_ = true;
  children_.push_back(std::move(child));
  child_names_.push_back(std::move(name));
}

std::vector<int64_t> Module::layout(int64_t* total) {
  std::vector<Shape> shapes;
  for (Parameter* p : parameters()) shapes.push_back(p->shape);
  return aligned_offsets(shapes, total);
}

std::vector<int64_t> Module::buffer_layout(int64_t* total) {
  std::vector<Shape> shapes;
  for (Buffer* b : buffers()) shapes.push_back(b->shape);
  return aligned_offsets(shapes, total);
}

void Module::bind(Tensor flat, Tensor buffers_flat) {
  int64_t total = 0, buffer_total = 0;
  const auto offsets = layout(&total);
  const auto buffer_offsets = buffer_layout(&buffer_total);
  DPT_CHECK(flat.numel() == total, "Module::bind: flat buffer of the wrong size");
  DPT_CHECK(buffer_total == 0 ? !buffers_flat.defined() : buffers_flat.numel() == buffer_total,
            "Module::bind: flat buffer of buffers of the wrong size");
  flat_params_ = std::move(flat);
  flat_grads_ = Tensor::zeros({total}, DType::f32, flat_params_.device());
  bound_params_ = parameters();
  mark_placed();
  const auto& params = bound_params_;
  for (size_t k = 0; k < params.size(); ++k) {
    Parameter& p = *params[k];
    p.value = flat_params_.view(offsets[k], p.shape);
    p.value.set_requires_grad(true);
    p.value.set_grad(flat_grads_.view(offsets[k], p.shape));
  }
  flat_buffers_ = std::move(buffers_flat);
  auto bufs = buffers();
  for (size_t k = 0; k < bufs.size(); ++k) bufs[k]->value = flat_buffers_.view(buffer_offsets[k], bufs[k]->shape);
  flat_shadow_ = Tensor();  // a new master: a new shadow of it
  bind_shadow();
}

void Module::bind_grads(Tensor storage, const std::vector<int64_t>& offsets) {
  auto params = parameters();
  DPT_CHECK(offsets.size() == params.size(), "Module::bind_grads: one offset a parameter");
  for (size_t k = 0; k < params.size(); ++k) {
    DPT_CHECK(offsets[k] >= 0 && offsets[k] + numel(params[k]->shape) <= storage.numel(),
              "Module::bind_grads: a gradient outside its storage");
    params[k]->value.set_grad(storage.view(offsets[k], params[k]->shape));
  }
  flat_grads_ = std::move(storage);
}

void Module::set_compute_dtype(DType t) {
  DPT_REQUIRE(t == DType::f32 || t == DType::bf16,
              std::string("a module computes in f32 or bf16, not ") + dtype_name(t));
  compute_dtype_ = t;
  for (auto& c : children_) c->set_compute_dtype(t);
  if (materialized()) bind_shadow();
}

void Module::bind_shadow() {
  const bool want = compute_dtype_ == DType::bf16;
  if (want == flat_shadow_.defined()) return;  // a shadow there is current already
  flat_shadow_ = want ? Tensor::empty(flat_params_.shape(), DType::bf16, flat_params_.device()) : Tensor();
  int64_t total = 0;
  const auto offsets = layout(&total);
  auto params = parameters();
  for (size_t k = 0; k < params.size(); ++k)
    params[k]->shadow = want ? flat_shadow_.view(offsets[k], params[k]->shape) : Tensor();
  refresh_shadow();
}

void Module::refresh_shadow() {
  if (flat_shadow_.defined()) copy_cast(flat_shadow_, flat_params_);
}

void Module::to(const Device& device, uint64_t seed) {
  // Once placed, an optimizer, a DataParallel or a CUDA graph may hold its buffers: binding
  // new ones under them would leave them training the old.
  if (materialized())
    throw UsageError("Module::to: the module is on " + this->device().str() +
                     " already; a module is placed once (replicate() copies it to another device)");
  int64_t total = 0;
  const auto offsets = layout(&total);
  auto params = parameters();
  // Parameter k is stream k of the Philox generator for `seed`, drawn on the device itself
  // (the CPU and CUDA generators agree bit for bit), so no host copy of the model is made.
  // Padding between parameters stays zero (its gradient is zero too, so it never moves).
  Tensor flat;
  try {
    flat = Tensor::zeros({total}, DType::f32, device);
  } catch (const OutOfMemory&) {
    throw OutOfMemory("out of memory on " + device.str() + " making the model's " + std::to_string(total) +
                      " parameters (" + format_bytes(static_cast<size_t>(total) * sizeof(float)) +
                      "): choose a smaller model");
  }
  for (size_t k = 0; k < params.size(); ++k) {
    const Parameter& p = *params[k];
    const Tensor v = flat.view(offsets[k], p.shape);
    if (p.init_std > 0.0f) normal_(v, seed, k, 0, p.init_std);
    else uniform_(v, seed, k, 0, p.init_value - p.init_bound, p.init_value + p.init_bound);
  }
  int64_t buffer_total = 0;
  const auto buffer_offsets = buffer_layout(&buffer_total);
  auto bufs = buffers();
  std::vector<float> host_buffers(static_cast<size_t>(buffer_total), 0.0f);
  for (size_t k = 0; k < bufs.size(); ++k)
    cpu::fill(host_buffers.data() + buffer_offsets[k], numel(bufs[k]->shape), bufs[k]->init);
  bind(flat, buffer_total > 0 ? Tensor::from_host(host_buffers, {buffer_total}, device) : Tensor());
}

std::shared_ptr<Module> Module::replicate(const Device& device) const {
  DPT_REQUIRE(materialized(), "replicate() of a module that is on no device");
  std::shared_ptr<Module> r = clone();
  r->set_compute_dtype(compute_dtype_);  // before bind: the replica makes its shadow from its copy
  Tensor flat = Tensor::empty(flat_params_.shape(), DType::f32, device);
  copy(flat, flat_params_);
  Tensor bufs;
  if (flat_buffers_.defined()) {
    bufs = Tensor::empty(flat_buffers_.shape(), DType::f32, device);
    copy(bufs, flat_buffers_);
  }
  r->bind(std::move(flat), std::move(bufs));
  r->train(training_);
  return r;
}

void Module::mark_placed() {
  placed_ = true;
  for (auto& c : children_) c->mark_placed();
}

std::vector<CopyChunk> make_copy_chunks(const std::vector<int64_t>& child_end, int64_t total, int64_t min_floats,
                                        std::vector<int>& chunk_of) {
  chunk_of.assign(child_end.size(), -1);
  size_t last = child_end.size();  // the last child with parameters
  for (size_t c = 0; c < child_end.size(); ++c)
    if (child_end[c] >= 0) last = c;
  std::vector<CopyChunk> out;
  int64_t begin = 0;
  for (size_t c = 0; c < child_end.size(); ++c) {
    if (child_end[c] < 0) continue;
    chunk_of[c] = static_cast<int>(out.size());
    const int64_t end = c == last ? total : child_end[c];
    if (c == last || end - begin >= min_floats) {
      out.push_back({begin, end - begin});
      begin = end;
    }
  }
  return out;
}

std::vector<int64_t> Module::child_ends() {
  int64_t total = 0;
  const auto offsets = layout(&total);
  const std::vector<Parameter*> params = parameters();
  std::vector<int64_t> ends;
  size_t k = 0;  // the parameters are in the children's order
  for (const auto& child : children_) {
    const size_t own = child->parameters().size();
    ends.push_back(own == 0 ? -1 : offsets[k + own - 1] + numel(params[k + own - 1]->shape));
    k += own;
  }
  if (k != params.size()) return std::vector<int64_t>(children_.size(), -1);  // parameters of its own too
  return ends;
}

namespace {
struct BeforeChild {
  const Module* owner = nullptr;
  std::function<void(size_t)> fn;
};
thread_local BeforeChild hooked;  // the innermost BeforeChildGuard of this thread
}  // namespace

BeforeChildGuard::BeforeChildGuard(const Module* owner, std::function<void(size_t)> fn)
    : outer_owner_(hooked.owner), outer_(std::move(hooked.fn)) {
  hooked = {owner, std::move(fn)};
}

BeforeChildGuard::~BeforeChildGuard() { hooked = {outer_owner_, std::move(outer_)}; }

void Module::before_child(size_t i) const {
  if (hooked.owner == this) hooked.fn(i);
}

void Module::zero_grad() {
  DPT_REQUIRE(materialized(), "zero_grad() before the module was placed on a device with to()");
  for (Parameter* p : bound_params_) p->value.set_grad_stale(true);
}

void Module::settle_grads() {
  if (!materialized()) return;
  const auto& params = bound_params_;
  size_t stale = 0;
  for (Parameter* p : params) stale += p->value.grad_stale() ? 1 : 0;
  if (stale == 0) return;
  if (stale == params.size()) {  // backward reached none (an empty shard): one pass
    zero_(flat_grads_);
  } else {
    for (Parameter* p : params)
      if (p->value.grad_stale()) zero_(p->value.grad());
  }
  for (Parameter* p : params) p->value.set_grad_stale(false);
}

}  // namespace dpt::nn
