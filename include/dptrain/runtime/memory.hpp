// What a device's memory holds: the statistics of its caching allocator (every tensor's
// memory comes from one per device, runtime/allocator.hpp), page-locked host memory for
// copies to a GPU, and the formats dptrain prints sizes and rates in.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/device.hpp>
#include <dptrain/runtime/tensor.hpp>

namespace dpt {

struct AllocatorStats {
  size_t allocated = 0;       // bytes in blocks handed out now
  size_t reserved = 0;        // bytes held from the system (handed out + cached)
  size_t peak_allocated = 0;  // high-water mark of `allocated` since the last reset
  size_t peak_reserved = 0;
  int64_t system_allocs = 0;  // cudaMalloc (or malloc) calls
  int64_t system_frees = 0;
};

AllocatorStats memory_stats(const Device& device);
// Starts the peaks of memory_stats() again from what is allocated now.
void reset_peak_memory(const Device& device);
// Returns the device's cached (free) blocks to the system.
void empty_cache(const Device& device);

// Page-locked host memory, which a copy to a GPU reads directly and asynchronously (for a
// CPU device, plain host memory). An input pipeline gathers rows into it.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  // `bytes` for copies to `device`; OutOfMemory naming the bytes when there are none.
  // `mapped`: the device's kernels may also read and write it in place (device_data()).
  PinnedBuffer(size_t bytes, const Device& device, bool mapped = false);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return ptr_; }
  void* device_data() const { return device_ptr_; }  // mapped: its address in kernels
  size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  void* device_ptr_ = nullptr;
  size_t bytes_ = 0;
  bool pinned_ = false;  // from cudaHostAlloc, else malloc
};

// Queues a copy of dst.nbytes() bytes of host memory at `src` into `dst` on ctx's stream;
// the host does not wait, so `src` (pinned) must stay as it is until the copy is done
// (an Event recorded on ctx after it says when). A CPU tensor is copied at once.
void copy_from_host_async(const Tensor& dst, const void* src, const Context& ctx);
// The other way: src.nbytes() bytes of `src` into host memory at `dst` (pinned, for the
// copy to be asynchronous), on ctx's stream; an Event recorded after it says when they
// are there. A CPU tensor is copied at once.
void copy_to_host_async(void* dst, const Tensor& src, const Context& ctx);

// "1.50 GiB", "12.0 MiB", "512 B".
std::string format_bytes(size_t bytes);
// 35200 -> "35.2k", 1.2e6 -> "1.20M": rates that span six orders of magnitude.
std::string format_si(double v);
// A float as a person writes it, the shortest text that reads back as the same float:
// 0.05f -> "0.05" (not "0.050000"), 1e30f -> "1e+30", NaN -> "nan".
std::string format_float(float v);

}  // namespace dpt
