// What a device's memory holds: the statistics of its caching allocator (every tensor's
// memory comes from one per device, runtime/allocator.hpp), and the formats dptrain
// prints sizes and rates in.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include <dptrain/runtime/device.hpp>

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

// "1.50 GiB", "12.0 MiB", "512 B".
std::string format_bytes(size_t bytes);
// 35200 -> "35.2k", 1.2e6 -> "1.20M": rates that span six orders of magnitude.
std::string format_si(double v);
// A float as a person writes it, the shortest text that reads back as the same float:
// 0.05f -> "0.05" (not "0.050000"), 1e30f -> "1e+30", NaN -> "nan".
std::string format_float(float v);

}  // namespace dpt
