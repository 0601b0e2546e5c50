// Tensor: a typed, contiguous, row-major view into device memory from the caching
// allocator. Copies of a Tensor share storage (like torch.Tensor); `view` makes a
// tensor over part of another's storage (parameters are views into one flat buffer).
// A tensor that takes part in autograd also carries an AutogradMeta (autograd.hpp).
#pragma once
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <dptrain/runtime/device.hpp>
#include <dptrain/types.hpp>

namespace dpt {

// A tensor's extents, at most kMaxDims of them, held inline: every op, view and detach
// makes a tensor, and a shape of its own on the heap was a third of a small model's
// allocations in a step.
class Shape {
 public:
  static constexpr size_t kMaxDims = 8;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) : Shape(dims.begin(), dims.end()) {}
  template <class It>
  Shape(It first, It last) {
    for (; first != last; ++first) push_back(static_cast<int64_t>(*first));
  }
  explicit Shape(const std::vector<int64_t>& dims) : Shape(dims.begin(), dims.end()) {}
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  int64_t& operator[](size_t i) { return d_[i]; }
  int64_t operator[](size_t i) const { return d_[i]; }
  int64_t at(size_t i) const {  // throws dpt::Error past the end
    if (i >= n_) out_of_range(i);
    return d_[i];
  }
  int64_t front() const { return d_[0]; }
  int64_t back() const { return d_[n_ - 1]; }
  int64_t* begin() { return d_; }
  int64_t* end() { return d_ + n_; }
  const int64_t* begin() const { return d_; }
  const int64_t* end() const { return d_ + n_; }
  int64_t* data() { return d_; }
  const int64_t* data() const { return d_; }
  void push_back(int64_t d) {  // throws dpt::Error beyond kMaxDims, as insert does
    if (n_ == kMaxDims) too_many(d);
    d_[n_++] = d;
  }
  void insert(const int64_t* pos, int64_t d);
  std::vector<int64_t> vec() const { return {begin(), end()}; }
  friend bool operator==(const Shape& a, const Shape& b) {
    return a.n_ == b.n_ && std::equal(a.begin(), a.end(), b.begin());
  }

 private:
  [[noreturn]] void out_of_range(size_t i) const;
  [[noreturn]] void too_many(int64_t d) const;
  int64_t d_[kMaxDims] = {};
  size_t n_ = 0;
};
int64_t numel(const Shape& s);
std::string shape_str(std::span<const int64_t> s);  // "[2, 3]"

// Memory from a device's caching allocator, handed back when the last tensor using it
// goes away.
struct Storage {
  Storage(Device device, size_t bytes);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  Device device;
  size_t bytes;
  void* ptr;
};

struct AutogradMeta;
class Node;

class Tensor {
 public:
  Tensor() = default;

  // Uninitialized memory on `device`, allocated on the stream of its current context.
  static Tensor empty(const Shape& shape, DType dtype, const Device& device);
  static Tensor zeros(const Shape& shape, DType dtype, const Device& device);
  static Tensor full(const Shape& shape, float value, const Device& device);
  static Tensor from_host(const std::vector<float>& values, const Shape& shape, const Device& device);
  static Tensor from_host_i32(const std::vector<int32_t>& values, const Shape& shape, const Device& device);

  bool defined() const { return storage_ != nullptr; }
  // Whether another tensor (a copy or a view) holds this one's storage too.
  bool storage_shared() const { return storage_ && storage_.use_count() > 1; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const {  // d < 0 counts from the last dimension
    const int64_t i = d < 0 ? d + dim() : d;
    if (i < 0 || i >= dim()) no_dimension(d);
    return shape_[static_cast<size_t>(i)];
  }
  int64_t numel() const { return dpt::numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const;

  void* data() const;
  float* f32() const;
  uint16_t* bf16() const;
  int32_t* i32() const;

  // `shape` elements starting `offset` elements into this tensor, sharing its storage.
  Tensor view(int64_t offset, const Shape& shape) const;
  Tensor reshape(const Shape& shape) const { return view(0, shape); }
  // Rows [first, first + count) along the first axis, a view.
  Tensor rows(int64_t first, int64_t count) const;
  // The same data without autograd history.
  Tensor detach() const;
  // The same data with no autograd state at all, for a tensor that is only read (what a
  // node saves for its backward): a host allocation less than detach(), whose fresh state
  // its copies share. Its autograd calls see no gradient and none required; one that
  // writes (set_requires_grad, set_grad) gives it a state of its own, not shared with
  // copies made before.
  Tensor untracked() const;
  // Exchanges the memory of this tensor's storage and other's (each the whole of its
  // storage, the same bytes, on one device): every view of either follows, on the host.
  // What is queued already keeps the memory it was queued with. For buffers written in
  // turn (the optimizer's twin copies).
  void swap_memory(const Tensor& other) const;

  // Synchronous copies to the host (f32 or bf16 read as floats; i32 as ints).
  std::vector<float> to_host() const;
  std::vector<int32_t> to_host_i32() const;
  float item() const;

  // Autograd (autograd.hpp has the engine).
  bool requires_grad() const;
  Tensor& set_requires_grad(bool on);
  // The accumulated gradient of a leaf (undefined until backward reaches it, unless
  // set beforehand, as parameters do with views into the flat gradient buffer).
  const Tensor& grad() const;
  void set_grad(const Tensor& g);
  // A stale gradient is overwritten, not added to, by the next backward that reaches
  // this leaf (see AutogradMeta::grad_stale).
  bool grad_stale() const;
  void set_grad_stale(bool stale);
  const std::shared_ptr<Node>& grad_fn() const;
  void set_grad_fn(std::shared_ptr<Node> fn);
  bool is_leaf() const { return !grad_fn(); }
  // This tensor's place in the autograd graph without its memory: its autograd state (the
  // same object: no allocation) and shape, no storage. What a node keeps of a non-leaf input.
  Tensor edge() const {
    Tensor e;
    e.shape_ = shape_;
    e.dtype_ = dtype_;
    e.meta_ = meta_;
    return e;
  }
  // Backpropagates from this scalar with a seed gradient of 1.
  void backward() const;

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_;
  DType dtype_ = DType::f32;
  std::shared_ptr<AutogradMeta> meta_;

  AutogradMeta& meta();
  [[noreturn]] void no_dimension(int64_t d) const;
};

// Copies src into dst (same dtype and element count, any devices), queued on dst's
// context stream (or src's for a GPU-to-host copy, which then waits for it).
void copy(const Tensor& dst, const Tensor& src);
// copy() of each (dst, src) pair; pairs within one GPU go in one kernel launch (for a
// step's inputs, copied every step).
void copy_all(const std::vector<std::pair<Tensor, Tensor>>& dst_src);

}  // namespace dpt
