// p2p's copy of the master's updated parameters to the other replicas, in chunks of a
// layer or more, first layers first, so that each replica's next forward waits for a
// layer's chunk just before the layer runs and the copy hides behind the first layers.
#pragma once
#include <cstdint>
#include <vector>

namespace dpt {

// A contiguous range of the flat parameter buffer that is copied in one piece.
struct CopyChunk {
  int64_t offset;
  int64_t count;
  bool operator==(const CopyChunk&) const = default;
};

// The flat buffer [0, total) cut at the ends of children's parameters (child_end[c], -1 for
// a child without any), each chunk at least min_floats but the last, which runs to
// `total`. chunk_of[c] is the chunk that child c's last parameter is in (-1 for none):
// once it is copied, so are the child's parameters, the chunks being copied in order.
std::vector<CopyChunk> make_copy_chunks(const std::vector<int64_t>& child_end, int64_t total, int64_t min_floats,
                                        std::vector<int>& chunk_of);

}  // namespace dpt
