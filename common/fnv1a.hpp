// FNV-1a, 64 bits (Fowler, Noll, Vo): the one hash the project uses, for what must be
// compared, not kept secret: a data file's header (recorded in checkpoints, so its values
// must never change), the ranks' configurations and parameters. Internal (not installed).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace dpt {

inline constexpr uint64_t kFnv1aOffset = 14695981039346656037ull;  // FNV-1a 64's offset basis
inline constexpr uint64_t kFnv1aPrime = 1099511628211ull;

// The hash of n bytes, or, given the hash of the bytes before them, of all of them.
inline uint64_t fnv1a(const void* bytes, size_t n, uint64_t hash = kFnv1aOffset) {
  const auto* p = static_cast<const uint8_t*>(bytes);
  for (size_t i = 0; i < n; ++i) hash = (hash ^ p[i]) * kFnv1aPrime;
  return hash;
}
inline uint64_t fnv1a(std::string_view s, uint64_t hash = kFnv1aOffset) { return fnv1a(s.data(), s.size(), hash); }

}  // namespace dpt
