#include "allocator.hpp"

#include <unistd.h>
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include <dptrain/error.hpp>

#if DPT_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/check.hpp"
#endif

namespace dpt {

namespace {
constexpr size_t kSmall = 1 << 20;       // below this, 512-byte granularity
constexpr size_t kLargeRound = 2 << 20;  // above it, 2 MiB granularity

size_t total_memory(const Device& d) {
#if DPT_WITH_CUDA
  if (d.is_cuda()) {  // d's, whichever device is current (cudaMemGetInfo tells the current one's)
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d.index) == cudaSuccess) return prop.totalGlobalMem;
    cudaGetLastError();
    return 0;
  }
#endif
  (void)d;
  return static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}
}  // namespace

std::string format_bytes(size_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (bytes >= (size_t(1) << 40)) std::snprintf(buf, sizeof buf, "%.2f TiB", b / double(size_t(1) << 40));
  else if (bytes >= (size_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1 << 30));
  else if (bytes >= (size_t(1) << 20)) std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1 << 20));
  else if (bytes >= 1024) std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024);
  else std::snprintf(buf, sizeof buf, "%zu B", bytes);
  return buf;
}

std::string format_float(float v) {
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, end) : std::string("?");
}

std::string format_si(double v) {
  char buf[32];
  if (v >= 1e9) std::snprintf(buf, sizeof buf, "%.2fG", v / 1e9);
  else if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (v >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

size_t CachingAllocator::round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  const size_t g = bytes < kSmall ? 512 : kLargeRound;
  return (bytes + g - 1) / g * g;
}

CachingAllocator::~CachingAllocator() {
  // Blocks still handed out belong to tensors that outlive the allocator (static
  // objects at exit); only the cache is returned.
  std::lock_guard<std::mutex> lock(mu_);
  release_cached();
}

void* CachingAllocator::system_alloc(size_t bytes) {
#if DPT_WITH_CUDA
  if (device_.is_cuda()) {
    void* p = nullptr;
    cuda::set_device(device_.index);
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear it: the caller empties the cache and retries
      return nullptr;
    }
    DPT_CUDA_CHECK(e);
    return p;
  }
#endif
  // More than the machine has would succeed under memory overcommit and then be killed
  // when touched; refusing it gives the out-of-memory error with its sizes instead.
  if (bytes > total_memory(device_)) return nullptr;
  return std::aligned_alloc(256, bytes);
}

void CachingAllocator::system_free(void* ptr) {
#if DPT_WITH_CUDA
  if (device_.is_cuda()) {
    int prev = 0;
    DPT_CUDA_WARN(cudaGetDevice(&prev));
    DPT_CUDA_WARN(cudaSetDevice(device_.index));
    DPT_CUDA_WARN(cudaFree(ptr));
    DPT_CUDA_WARN(cudaSetDevice(prev));
    return;
  }
#endif
  std::free(ptr);
}

void* CachingAllocator::allocate(size_t bytes, void* stream) {
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  const bool recording = capturing_ && capture_free_.count(stream) > 0;
  auto hand_out = [&](void* p) {
    Block& b = blocks_.at(p);
    b.in_use = true;
    b.handed_out = recording ? capture_id_ : 0;
    if (recording) own_for_capture(p, b);
    stats_.allocated += b.size;
    stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
    return p;
  };
  // Only a block of exactly this size class: a request never takes the block that
  // another tensor of the same step needs, so the step after the first allocates nothing.
  if (recording)
    if (void* p = take(capture_free_[stream], size)) return hand_out(p);
  if (void* p = take(free_[stream], size)) return hand_out(p);
  void* p = system_alloc(size);
  if (!p && !capturing_) {  // emptying the cache synchronizes the device: not while recording
    release_cached();
    p = system_alloc(size);
  }
  if (!p) {
    throw OutOfMemory("out of memory on " + device_.str() + ": asked " + format_bytes(bytes) + ", allocated " +
                      format_bytes(stats_.allocated) + ", reserved " + format_bytes(stats_.reserved) + ", total " +
                      format_bytes(total_memory(device_)) + "; use a smaller batch, more devices, or bf16 compute");
  }
  blocks_[p] = Block{size, stream, false};
  stats_.system_allocs += 1;
  stats_.reserved += size;
  stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
  return hand_out(p);
}

void* CachingAllocator::take(FreeList& list, size_t size) {
  auto it = list.find(size);
  if (it == list.end() || it->second.head == it->second.blocks.size()) return nullptr;
  FreeClass& c = it->second;
  void* p = c.blocks[c.head++];
  // The taken ones go once they are half the list: each take costs O(1) on average, however
  // many blocks share the class (a deep model's biases: hundreds of 512-byte blocks).
  if (2 * c.head >= c.blocks.size()) {
    c.blocks.erase(c.blocks.begin(), c.blocks.begin() + static_cast<std::ptrdiff_t>(c.head));
    c.head = 0;
  }
  return p;
}

void CachingAllocator::own_for_capture(void* ptr, Block& b) {
  if (b.graph == capture_id_) return;
  b.graph = capture_id_;
  b.owners += 1;
  captured_.push_back(ptr);
}

void CachingAllocator::free(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(ptr);
  if (it == blocks_.end() || !it->second.in_use) {
    char text[96];
    std::snprintf(text, sizeof text, "freeing a pointer %p not handed out on ", ptr);
    report(Severity::warning, text + device_.str());
    return;
  }
  Block& b = it->second;
  b.in_use = false;
  stats_.allocated -= b.size;
  if (capturing_) {
    if (auto mine = capture_free_.find(b.stream); mine != capture_free_.end()) {
      own_for_capture(ptr, b);  // recorded kernels may use it
      if (b.handed_out == capture_id_) put(mine->second, b.size, ptr);
      return;
    }
  }
  if (b.owners > 0) return;  // a recorded graph's: replays still write it
  put(free_[b.stream], b.size, ptr);
}

void CachingAllocator::begin_capture(void* stream, Temporaries reuse) {
  std::lock_guard<std::mutex> lock(mu_);
  DPT_CHECK(!capturing_, "a CUDA graph is already being recorded on " + device_.str());
  capturing_ = true;
  capture_id_ += 1;
  captured_.clear();
  capture_free_.clear();
  reuse_ = std::move(reuse);
  open_capture_stream(stream);
}

void CachingAllocator::add_capture_stream(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  DPT_CHECK(capturing_, "add_capture_stream outside a recording on " + device_.str());
  open_capture_stream(stream);
}

void CachingAllocator::open_capture_stream(void* stream) {
  if (capture_free_.count(stream)) return;  // open already: its offered blocks are there
  auto& mine = capture_free_[stream];
  // The earlier recording's temporaries on this stream that its graph still holds, free:
  // handed out here they become this recording's too (own_for_capture).
  if (auto it = reuse_.find(stream); it != reuse_.end())
    for (const auto& [size, ps] : it->second)
      for (void* p : ps)
        if (auto b = blocks_.find(p); b != blocks_.end() && !b->second.in_use && b->second.owners > 0)
          put(mine, size, p);
}

CachingAllocator::Capture CachingAllocator::end_capture() {
  std::lock_guard<std::mutex> lock(mu_);
  capturing_ = false;
  Capture c{std::move(captured_), {}};
  // The graph's now, out of every pool until release(); offered only to a recording that
  // names them (those of an earlier recording that this one did not take stay that one's).
  for (auto& [stream, pool] : capture_free_)
    for (const auto& [size, free] : pool)
      for (size_t i = free.head; i < free.blocks.size(); ++i)
        if (void* p = free.blocks[i]; blocks_.at(p).graph == capture_id_) c.temporaries[stream][size].push_back(p);
  capture_free_.clear();
  reuse_.clear();
  return c;
}

void CachingAllocator::release(const std::vector<void*>& blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  for (void* p : blocks) {
    auto it = blocks_.find(p);
    if (it == blocks_.end()) continue;
    Block& b = it->second;
    b.owners -= 1;
    if (b.owners == 0 && !b.in_use) put(free_[b.stream], b.size, p);
  }
}

void CachingAllocator::release_cached() {
#if DPT_WITH_CUDA
  // A cached block may still be read by work queued before it was freed.
  if (device_.is_cuda() && !free_.empty()) {
    DPT_CUDA_WARN(cudaSetDevice(device_.index));
    DPT_CUDA_WARN(cudaDeviceSynchronize());
  }
#endif
  for (auto& [stream, pool] : free_) {
    for (auto& [size, c] : pool) {
      for (size_t i = c.head; i < c.blocks.size(); ++i) {
        void* p = c.blocks[i];
        blocks_.erase(p);
        system_free(p);
        stats_.reserved -= size;
        stats_.system_frees += 1;
      }
    }
  }
  free_.clear();
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cached();
}

bool CachingAllocator::recording() const {
  std::lock_guard<std::mutex> lock(mu_);
  return capturing_;
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_allocated = stats_.allocated;
  stats_.peak_reserved = stats_.reserved;
}

CachingAllocator& allocator(const Device& device) {
  // One per device, never destroyed (tensors in static objects may outlive main), so the
  // thread may keep the last one it asked for: every tensor made and freed asks.
  thread_local CachingAllocator* last = nullptr;
  if (last && last->device() == device) return *last;
  static std::mutex mu;
  static auto* table = new std::map<std::pair<int, int>, std::unique_ptr<CachingAllocator>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = (*table)[{static_cast<int>(device.type), device.index}];
  if (!slot) slot = std::make_unique<CachingAllocator>(device);
  last = slot.get();
  return *slot;
}

AllocatorStats memory_stats(const Device& device) { return allocator(device).stats(); }
void reset_peak_memory(const Device& device) { allocator(device).reset_peak(); }
void empty_cache(const Device& device) { allocator(device).empty_cache(); }

}  // namespace dpt
