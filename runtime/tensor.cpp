#include <dptrain/runtime/tensor.hpp>

#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>
#include "allocator.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/cuda.hpp"
#endif

namespace dpt {

void Shape::out_of_range(size_t i) const {
  throw Error("dimension " + std::to_string(i) + " is past the end of shape " + shape_str(*this));
}

void Shape::too_many(int64_t d) const {
  throw Error("a tensor has at most " + std::to_string(kMaxDims) + " dimensions: " + shape_str(*this) + " and " +
              std::to_string(d) + " is one too many");
}

void Shape::insert(const int64_t* pos, int64_t d) {
  if (n_ == kMaxDims) too_many(d);
  DPT_REQUIRE(pos >= d_ && pos <= d_ + n_, "Shape::insert: a position outside the shape");
  const auto i = static_cast<size_t>(pos - d_);
  std::copy_backward(d_ + i, d_ + n_, d_ + n_ + 1);
  d_[i] = d;
  ++n_;
}

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    if (d < 0) throw UsageError("shape " + shape_str(s) + " has a negative size");
    if (__builtin_mul_overflow(n, d, &n))
      throw Error("shape " + shape_str(s) + " has more elements than fit in 64 bits");
  }
  return n;
}

std::string shape_str(std::span<const int64_t> s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Storage::Storage(Device d, size_t b) : device(d), bytes(b), ptr(allocator(d).allocate(b, context(d).pool())) {}

Storage::~Storage() { allocator(device).free(ptr); }

Tensor Tensor::empty(const Shape& shape, DType dtype, const Device& device) {
  for (int64_t d : shape)
    if (d < 0) throw UsageError("shape " + shape_str(shape) + " has a negative size");
  // A shape whose bytes do not fit in 63 bits is more memory than any device has, not a
  // size to wrap around to a small one (and then write past).
  int64_t bytes = static_cast<int64_t>(dtype_size(dtype));
  for (int64_t d : shape)
    if (__builtin_mul_overflow(bytes, d, &bytes))
      throw OutOfMemory("out of memory on " + device.str() + ": asked for a tensor of shape " + shape_str(shape) +
                        ", more than 8 EiB; use a smaller batch or model");
  Tensor t;
  t.storage_ = std::make_shared<Storage>(device, static_cast<size_t>(bytes));
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.meta_ = std::make_shared<AutogradMeta>();  // shared by every copy of this tensor
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, const Device& device) {
  Tensor t = empty(shape, dtype, device);
  zero_(t);
  return t;
}

Tensor Tensor::full(const Shape& shape, float value, const Device& device) {
  Tensor t = empty(shape, DType::f32, device);
  fill_(t, value);
  return t;
}

namespace {
#if DPT_WITH_CUDA
// Pinned (page-locked) staging for host-to-device copies, one per thread and device:
// the caller's bytes are copied into it and the transfer to the device is queued
// asynchronously, so the caller's memory is free at once and the host never waits for
// the transfer (only, at the next upload, for the previous one from the same buffer).
struct PinnedStage {
  void* ptr = nullptr;
  size_t capacity = 0;
  cudaEvent_t done = nullptr;
  ~PinnedStage() {
    // At process exit the CUDA runtime may already be gone; there is nothing to report.
    if (done) cudaEventDestroy(done);
    if (ptr) cudaFreeHost(ptr);
  }
};
thread_local std::map<int, PinnedStage> t_pinned;
#endif

// Copies `bytes` from host memory into a tensor; on a GPU through pinned staging,
// asynchronously on the tensor's context stream.
void upload(const Tensor& t, const void* src, size_t bytes) {
  if (bytes == 0) return;  // an empty tensor: src may be null (memcpy's is undefined then)
  if (t.device().is_cpu()) {
    std::memcpy(t.data(), src, bytes);
    return;
  }
#if DPT_WITH_CUDA
  auto& ctx = context(t.device());
  cuda::set_device(t.device().index);
  auto s = static_cast<cudaStream_t>(ctx.stream());
  PinnedStage& st = t_pinned[t.device().index];
  if (!st.done) DPT_CUDA_CHECK(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming));
  note_host_wait();
  DPT_CUDA_CHECK(cudaEventSynchronize(st.done));  // the last transfer out of this buffer is over
  if (st.capacity < bytes) {
    if (st.ptr) DPT_CUDA_CHECK(cudaFreeHost(st.ptr));
    st.ptr = nullptr;
    DPT_CUDA_CHECK(cudaHostAlloc(&st.ptr, bytes, cudaHostAllocDefault));
    st.capacity = bytes;
  }
  std::memcpy(st.ptr, src, bytes);
  DPT_CUDA_CHECK(cudaMemcpyAsync(t.data(), st.ptr, bytes, cudaMemcpyHostToDevice, s));
  DPT_CUDA_CHECK(cudaEventRecord(st.done, s));
#endif
}

void download(const Tensor& t, void* dst, size_t bytes) {
  note_host_wait();
  if (t.device().is_cpu()) {
    std::memcpy(dst, t.data(), bytes);
    return;
  }
#if DPT_WITH_CUDA
  auto& ctx = context(t.device());
  cuda::set_device(t.device().index);
  auto s = static_cast<cudaStream_t>(ctx.stream());
  DPT_CUDA_CHECK(cudaMemcpyAsync(dst, t.data(), bytes, cudaMemcpyDeviceToHost, s));
  DPT_CUDA_CHECK(cudaStreamSynchronize(s));
#endif
}
}  // namespace

PinnedBuffer::PinnedBuffer(size_t bytes, const Device& device, [[maybe_unused]] bool mapped) : bytes_(bytes) {
  if (bytes == 0) return;
#if DPT_WITH_CUDA
  if (device.is_cuda()) {
    cuda::set_device(device.index);
    if (cudaHostAlloc(&ptr_, bytes, mapped ? cudaHostAllocMapped : cudaHostAllocDefault) == cudaSuccess) {
      pinned_ = true;
      if (mapped) DPT_CUDA_CHECK(cudaHostGetDevicePointer(&device_ptr_, ptr_, 0));
      return;
    }
    (void)cudaGetLastError();  // reported below; the next call must not see it
    ptr_ = nullptr;
  }
#endif
  if (!device.is_cuda()) device_ptr_ = ptr_ = std::malloc(bytes);
  if (!ptr_)
    throw OutOfMemory("out of " + std::string(device.is_cuda() ? "page-locked " : "") + "host memory: asked " +
                      format_bytes(bytes) + " for the input pipeline of " + device.str() + "; use a smaller batch");
}

PinnedBuffer::~PinnedBuffer() {
  if (!ptr_) return;
#if DPT_WITH_CUDA
  if (pinned_) {
    cudaFreeHost(ptr_);  // nothing to report from a destructor (and at exit the runtime may be gone)
    return;
  }
#endif
  std::free(ptr_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)),
      device_ptr_(std::exchange(other.device_ptr_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      pinned_(std::exchange(other.pinned_, false)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    PinnedBuffer gone(std::move(*this));
    ptr_ = std::exchange(other.ptr_, nullptr);
    device_ptr_ = std::exchange(other.device_ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    pinned_ = std::exchange(other.pinned_, false);
  }
  return *this;
}

void copy_from_host_async(const Tensor& dst, const void* src, const Context& ctx) {
  DPT_REQUIRE(dst.device() == ctx.device(), "copy_from_host_async: the tensor is not on the context's device");
  if (dst.device().is_cpu()) {
    std::memcpy(dst.data(), src, dst.nbytes());
    return;
  }
#if DPT_WITH_CUDA
  cuda::set_device(dst.device().index);
  DPT_CUDA_CHECK(
      cudaMemcpyAsync(dst.data(), src, dst.nbytes(), cudaMemcpyHostToDevice, static_cast<cudaStream_t>(ctx.stream())));
#endif
}

void copy_to_host_async(void* dst, const Tensor& src, const Context& ctx) {
  DPT_REQUIRE(src.device() == ctx.device(), "copy_to_host_async: the tensor is not on the context's device");
  if (src.device().is_cpu()) {
    std::memcpy(dst, src.data(), src.nbytes());
    return;
  }
#if DPT_WITH_CUDA
  cuda::set_device(src.device().index);
  DPT_CUDA_CHECK(
      cudaMemcpyAsync(dst, src.data(), src.nbytes(), cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(ctx.stream())));
#endif
}

namespace {
// A tensor of `values` (of element type `dtype`) on `device`; `op` names the caller.
template <class T>
Tensor tensor_of(const std::vector<T>& values, DType dtype, const Shape& shape, const Device& device, const char* op) {
  DPT_REQUIRE(static_cast<int64_t>(values.size()) == dpt::numel(shape),
              std::string(op) + ": " + std::to_string(values.size()) + " values for shape " + shape_str(shape));
  Tensor t = Tensor::empty(shape, dtype, device);
  upload(t, values.data(), t.nbytes());
  return t;
}
}  // namespace

Tensor Tensor::from_host(const std::vector<float>& values, const Shape& shape, const Device& device) {
  return tensor_of(values, DType::f32, shape, device, "from_host");
}

Tensor Tensor::from_host_i32(const std::vector<int32_t>& values, const Shape& shape, const Device& device) {
  return tensor_of(values, DType::i32, shape, device, "from_host_i32");
}

Device Tensor::device() const {
  DPT_REQUIRE(defined(), "device() of an undefined tensor");
  return storage_->device;
}

void* Tensor::data() const {
  DPT_REQUIRE(defined(), "data() of an undefined tensor");
  return static_cast<char*>(storage_->ptr) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

float* Tensor::f32() const {
  DPT_REQUIRE(dtype_ == DType::f32, std::string("expected an f32 tensor, got ") + dtype_name(dtype_));
  return static_cast<float*>(data());
}
uint16_t* Tensor::bf16() const {
  DPT_REQUIRE(dtype_ == DType::bf16, std::string("expected a bf16 tensor, got ") + dtype_name(dtype_));
  return static_cast<uint16_t*>(data());
}
int32_t* Tensor::i32() const {
  DPT_REQUIRE(dtype_ == DType::i32, std::string("expected an i32 tensor, got ") + dtype_name(dtype_));
  return static_cast<int32_t*>(data());
}

Tensor Tensor::rows(int64_t first, int64_t count) const {
  DPT_REQUIRE(defined() && dim() >= 1, "rows of a tensor without a first axis");
  if (!(first >= 0 && count >= 0 && first <= size(0) && count <= size(0) - first))  // no sum that can overflow
    throw UsageError(std::to_string(count) + " rows from row " + std::to_string(first) + " are outside " +
                     shape_str(shape_));
  Shape s = shape_;
  s[0] = count;
  return view(size(0) ? first * (numel() / size(0)) : 0, s);
}

void Tensor::swap_memory(const Tensor& other) const {
  DPT_CHECK(defined() && other.defined(), "swap_memory of an undefined tensor");
  DPT_CHECK(offset_ == 0 && other.offset_ == 0 && nbytes() == storage_->bytes &&
                other.nbytes() == other.storage_->bytes && storage_->bytes == other.storage_->bytes &&
                storage_->device == other.storage_->device,
            "swap_memory: two whole storages of the same size on one device, got " + shape_str(shape_) + " and " +
                shape_str(other.shape_));
  std::swap(storage_->ptr, other.storage_->ptr);
}

Tensor Tensor::view(int64_t offset, const Shape& shape) const {
  DPT_REQUIRE(defined(), "view of an undefined tensor");
  const int64_t n = dpt::numel(shape);
  if (!(offset >= 0 && offset <= numel() && n <= numel() - offset))  // no sum that can overflow
    throw UsageError("view " + shape_str(shape) + " at " + std::to_string(offset) + " outside " + shape_str(shape_));
  Tensor t;
  t.storage_ = storage_;
  t.offset_ = offset_ + offset;
  t.shape_ = shape;
  t.dtype_ = dtype_;
  t.meta_ = std::make_shared<AutogradMeta>();  // a view starts with no autograd history
  return t;
}

Tensor Tensor::detach() const { return view(0, shape_); }

void Tensor::no_dimension(int64_t d) const {
  throw Error("dimension " + std::to_string(d) + " of a tensor of shape " + shape_str(shape_));
}

Tensor Tensor::untracked() const {
  Tensor t = *this;
  t.meta_.reset();
  return t;
}

std::vector<float> Tensor::to_host() const {
  if (dtype_ == DType::bf16) return cast(untracked(), DType::f32).to_host();
  DPT_REQUIRE(dtype_ == DType::f32, "to_host() needs an f32 or bf16 tensor");
  std::vector<float> out(static_cast<size_t>(numel()));
  download(*this, out.data(), nbytes());
  return out;
}

std::vector<int32_t> Tensor::to_host_i32() const {
  DPT_REQUIRE(dtype_ == DType::i32, "to_host_i32() needs an i32 tensor");
  std::vector<int32_t> out(static_cast<size_t>(numel()));
  download(*this, out.data(), nbytes());
  return out;
}

float Tensor::item() const {
  DPT_REQUIRE(numel() == 1, "item() of a tensor with " + std::to_string(numel()) + " elements");
  return to_host()[0];
}

AutogradMeta& Tensor::meta() {
  if (!meta_) meta_ = std::make_shared<AutogradMeta>();
  return *meta_;
}

bool Tensor::requires_grad() const { return meta_ && meta_->requires_grad; }

Tensor& Tensor::set_requires_grad(bool on) {
  DPT_REQUIRE(!on || dtype_ != DType::i32, "an integer tensor cannot require a gradient");
  meta().requires_grad = on;
  return *this;
}

const Tensor& Tensor::grad() const {
  static const Tensor none;
  return meta_ ? meta_->grad : none;
}

void Tensor::set_grad(const Tensor& g) {
  DPT_REQUIRE(!g.defined() || g.shape() == shape_,
              "set_grad: shape " + shape_str(g.shape()) + " for a tensor of shape " + shape_str(shape_));
  meta().grad = g;
}

bool Tensor::grad_stale() const { return meta_ && meta_->grad_stale; }

void Tensor::set_grad_stale(bool stale) { meta().grad_stale = stale; }

const std::shared_ptr<Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<Node> none;
  return meta_ ? meta_->grad_fn : none;
}

void Tensor::set_grad_fn(std::shared_ptr<Node> fn) {
  meta().grad_fn = std::move(fn);
  meta().requires_grad = true;
}

void Tensor::backward() const {
  DPT_REQUIRE(numel() == 1, "backward() without a gradient needs a scalar, got shape " + shape_str(shape_));
  run_backward(*this, 1.0f);
}

namespace {
void check_copy(const Tensor& dst, const Tensor& src) {
  DPT_REQUIRE(dst.dtype() == src.dtype() && dst.numel() == src.numel(),
              "copy: " + std::string(dtype_name(src.dtype())) + shape_str(src.shape()) + " into " +
                  dtype_name(dst.dtype()) + shape_str(dst.shape()));
}
}  // namespace

void copy(const Tensor& dst, const Tensor& src) {
  check_copy(dst, src);
  const size_t bytes = src.nbytes();
  if (bytes == 0) return;
  const Device d = dst.device(), s = src.device();
  if (d.is_cpu() && s.is_cpu()) {
    std::memmove(dst.data(), src.data(), bytes);
    return;
  }
#if DPT_WITH_CUDA
  if (d.is_cuda() && s.is_cuda()) {
    auto stream = static_cast<cudaStream_t>(context(d).stream());
    cuda::set_device(d.index);
    if (d.index == s.index) {  // a kernel: cheaper to launch than a device-to-device memcpy
      cuda::CopyPieces one;
      one.piece[0] = {dst.data(), src.data(), static_cast<int64_t>(bytes)};
      one.count = 1;
      cuda::copy_device(one, stream);
    } else DPT_CUDA_CHECK(cudaMemcpyPeerAsync(dst.data(), d.index, src.data(), s.index, bytes, stream));
    return;
  }
  if (d.is_cuda()) {
    upload(dst, src.data(), bytes);
    return;
  }
  download(src, dst.data(), bytes);
#endif
}

void copy_all(const std::vector<std::pair<Tensor, Tensor>>& dst_src) {
#if DPT_WITH_CUDA
  const auto on_one_gpu = [&] {
    if (dst_src.empty() || dst_src.size() > static_cast<size_t>(cuda::kMaxCopyPieces)) return false;
    const Device d = dst_src[0].first.device();
    for (const auto& [dst, src] : dst_src)
      if (!d.is_cuda() || !(dst.device() == d) || !(src.device() == d)) return false;
    return true;
  };
  if (on_one_gpu()) {
    cuda::CopyPieces pieces;
    for (const auto& [dst, src] : dst_src) {
      check_copy(dst, src);
      pieces.piece[pieces.count++] = {dst.data(), src.data(), static_cast<int64_t>(src.nbytes())};
    }
    const Device d = dst_src[0].first.device();
    cuda::set_device(d.index);
    cuda::copy_device(pieces, static_cast<cudaStream_t>(context(d).stream()));
    return;
  }
#endif
  for (const auto& [dst, src] : dst_src) copy(dst, src);
}

}  // namespace dpt
