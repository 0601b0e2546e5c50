// A caching allocator per device. Freed blocks go back to a per-stream pool and are
// handed out again for requests of the same size class, so a training step after the
// first one makes no cudaMalloc/cudaFree (which would synchronize the device and break
// CUDA-graph capture). The same logic serves virtual CPU devices, with aligned malloc.
// Internal: what others see of it is <dptrain/runtime/memory.hpp>.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <dptrain/runtime/memory.hpp>

namespace dpt {

class CachingAllocator {
 public:
  explicit CachingAllocator(Device device) : device_(device) {}
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least `bytes` for use in `pool` (the CUDA stream, or a CPU context:
  // see Context::pool). On failure it empties its cache and retries once, then throws
  // OutOfMemory.
  void* allocate(size_t bytes, void* pool);
  void free(void* ptr);
  // Returns every cached (free) block to the system.
  void empty_cache();
  // While a CUDA graph is recorded on `stream`, every block the recording allocates or
  // frees on it becomes the graph's (each replay writes them again). A block the recording
  // itself handed out and then freed is handed out again only to the recording (later
  // kernels of one stream run after earlier ones in the graph too, and no data flows into
  // such a block from before the recording), so the graph holds about one eager step's
  // memory, not every temporary of the step. A block that was live before the recording
  // and freed during it is the graph's but never reused (recorded kernels may read it).
  // A graph's blocks stay out of every pool, even when a tensor frees them, until every
  // graph that owns them is released. end_capture() names the recording's blocks and its
  // temporaries (those it handed out and then freed, by stream); release() gives the
  // blocks up once its graph is gone. A recording whose graph never runs beside an earlier
  // one (two graphs replayed in turn on one stream) may take that one's temporaries as
  // its own (`reuse`): the two graphs then hold one set of temporaries, not two.
  using Temporaries = std::map<void*, std::map<size_t, std::vector<void*>>>;  // stream -> size -> blocks
  struct Capture {
    std::vector<void*> blocks;  // each once
    Temporaries temporaries;
  };
  void begin_capture(void* stream, Temporaries reuse = {});
  // Another stream (pool) of the same recording: a graph over several replicas' streams.
  // Blocks freed on one stream are handed out again only on that stream.
  void add_capture_stream(void* stream);
  Capture end_capture();
  void release(const std::vector<void*>& blocks);
  AllocatorStats stats() const;
  bool recording() const;  // whether a CUDA graph is being recorded on this device
  void reset_peak();
  Device device() const { return device_; }

  // Size classes: small requests round up to 512 B, large ones to 2 MiB, so the
  // same tensors in every step land in the same bins.
  static size_t round_size(size_t bytes);

 private:
  struct Block {
    size_t size;
    void* stream;
    bool in_use;
    int owners = 0;          // graphs that hold it (recorded, not yet released)
    int64_t graph = 0;       // the last recording that took it (begin_capture's number)
    int64_t handed_out = 0;  // the recording that last handed it out, 0 for none
  };
  void own_for_capture(void* ptr, Block& b);  // caller holds mu_
  void open_capture_stream(void* stream);     // caller holds mu_
  void* system_alloc(size_t bytes);
  void system_free(void* ptr);
  void release_cached();  // caller holds mu_

  Device device_;
  mutable std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;  // every block held
  // Free blocks of one stream by size class, each class oldest first (handed out in the
  // order they were freed). The lists keep their capacity, so a step's frees allocate
  // nothing on the host.
  struct FreeClass {
    std::vector<void*> blocks;  // the free ones are blocks[head...], oldest first
    size_t head = 0;
  };
  using FreeList = std::map<size_t, FreeClass>;
  static void* take(FreeList& list, size_t size);  // nullptr when none is free
  static void put(FreeList& list, size_t size, void* p) { list[size].blocks.push_back(p); }
  std::map<void*, FreeList> free_;  // by stream
  AllocatorStats stats_;
  bool capturing_ = false;
  int64_t capture_id_ = 0;
  std::vector<void*> captured_;  // the recording's blocks, each once
  // The recording's streams, and what each freed during the recording: for it alone.
  std::map<void*, FreeList> capture_free_;
  Temporaries reuse_;  // an earlier recording's temporaries, offered to this one's streams
};

// The allocator of a device, made on first use and kept for the life of the program.
CachingAllocator& allocator(const Device& device);

}  // namespace dpt
