// The safetensors format, read strictly: the one header parser that checkpoints
// (train/checkpoint.cpp) and data files (data/dataset.cpp) share. A file is an 8-byte
// little-endian header length N, N bytes of JSON ({"__metadata__": {string: string},
// "name": {"dtype", "shape", "data_offsets"}}), then the tensors' bytes, back to back.
//
// The header reader is written for the safetensors schema rather than as a general JSON
// parser: it accepts only what a header can hold (objects, arrays, strings,
// non-negative integers, whitespace) and its nesting is fixed at three levels (header,
// tensor entry, shape), so no input can make it recurse deeply or build a large tree
// (its JSON pieces are data/json_reader.hpp's, which tokenizer files share).
// Every size is checked against the file's size before anything is allocated for it.
//
// Uses only the standard library, <dptrain/error.hpp>, array.hpp's types and common/text,
// so the fuzzer builds it on its own.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <dptrain/data/array.hpp>

namespace dpt::data::safetensors {

constexpr uint64_t kLenBytes = 8;             // the little-endian header length
constexpr uint64_t kMaxHeader = 100'000'000;  // safetensors' own limit
constexpr size_t kMaxDims = 64;               // bounds what one shape may allocate
constexpr const char* kMetadataKey = "__metadata__";

// Whose file it is, for errors: every problem is one line "WHAT 'FILE': <problem>",
// thrown as dpt::UsageError (bad input: a data file) or dpt::Error (a checkpoint).
struct Source {
  std::string what;  // "checkpoint", "data file"
  std::string file;
  bool usage_error = false;
  [[noreturn]] void fail(const std::string& problem) const;
};

// The dtype's name in a safetensors header ("F32", "BF16", "U8", ...).
const char* dtype_name(ArrayDType t);

struct Entry {
  std::string name;
  ArrayDType dtype = ArrayDType::f32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data that follows the header
};

struct Header {
  std::map<std::string, std::string> metadata;
  std::vector<Entry> entries;  // in header order
};

// Refuses a file too short to hold the header length.
void check_file_size(uint64_t size, const Source& src);
// The header length in the file's first 8 bytes, checked against the limit and the size.
uint64_t header_length(const uint8_t* first8, uint64_t file_size, const Source& src);
// Parses the `n` header bytes of a file of `file_size` bytes and checks its layout: each
// tensor's offsets lie within the data and span exactly its shape's bytes, and the tensors
// cover the data without overlaps or holes. A dtype outside `accepted` is refused where
// it is read, naming the accepted ones.
Header read_header(const uint8_t* header, uint64_t n, uint64_t file_size, const std::vector<ArrayDType>& accepted,
                   const Source& src);

// Whether `bytes` is exactly the data of `count` elements of `t` (no overflow possible).
bool holds(uint64_t bytes, int64_t count, ArrayDType t);

// XXH64 (xxHash's 64-bit hash, seed 0): the checksum a checkpoint keeps of each tensor.
// It finds any flipped bit or byte, as a CRC would, at several GB/s in one thread; fed a
// piece at a time (update), as a file is read, it gives what xxh64() of the whole gives.
class Xxh64 {
 public:
  void update(const uint8_t* p, size_t n);
  uint64_t digest() const;

 private:
  uint64_t v_[4] = {11400714785074694791ull + 14029467366897019727ull, 14029467366897019727ull, 0,
                    0 - 11400714785074694791ull};
  uint64_t total_ = 0;
  uint8_t pending_[32] = {};  // the bytes of a stripe not yet whole
  size_t pending_n_ = 0;
};
uint64_t xxh64(const uint8_t* p, size_t n);

}  // namespace dpt::data::safetensors
