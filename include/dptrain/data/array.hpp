// Arrays that data sets are read from: their element types, a read-only view of one (in
// a file's mapping or in memory the program owns), the memory-mapped file itself, and the
// cheap identity of a file that a checkpoint keeps to recognise it on resume.
//
// This header and data/array.cpp use only the standard library, POSIX and
// <dptrain/error.hpp>, so the fuzzers (tests/fuzz_test.sh) can build the file parsers on
// their own.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dpt::data {

// Element types an array file may hold. Inputs are converted to float32 as rows are
// gathered (uint8 scaled to [0, 1]); integer targets are class labels, gathered as int32.
// uint16 and uint32 are what token files hold (tokens.hpp); an ArrayDataset reads them too.
enum class ArrayDType { f32, f64, f16, bf16, u8, i32, i64, u16, u32 };
const char* array_dtype_name(ArrayDType t);  // NumPy's names: "float32", "uint8", "bfloat16", ...
size_t array_dtype_size(ArrayDType t);
bool is_integer(ArrayDType t);

// A read-only, row-major (C-order), little-endian array: the bytes are not owned here.
// Elements need not be aligned (safetensors packs tensors of mixed types back to back).
struct Array {
  const void* data = nullptr;
  ArrayDType dtype = ArrayDType::f32;
  std::vector<int64_t> shape;
};

// "[60000, 784]".
std::string shape_text(const std::vector<int64_t>& shape);
// Elements in `shape`, or -1 when a dimension is negative or the product of the non-zero
// dimensions does not fit in int64 (so no count over it can overflow, even when a zero
// dimension makes the true count 0).
int64_t element_count(const std::vector<int64_t>& shape);

// A regular file mapped read-only into memory, unmapped when the object goes. It is never
// read whole: pages come in as rows are gathered. Anything but a regular file (a FIFO, a
// device, a directory) is refused before it is opened for reading, so nothing blocks.
// Errors are dpt::UsageError "data file 'PATH': <problem>". The file must not shrink while
// it is mapped (reading a page past its new end would raise SIGBUS).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return data_; }  // null for an empty file
  uint64_t size() const { return size_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// What a checkpoint remembers of a data file: its size and a hash of its header (every
// byte before the data; FNV-1a 64), cheap to compute however large the file. Two files match when
// both agree; the path is for messages only (a file may move between runs).
struct FileIdentity {
  std::string path;
  uint64_t size = 0;
  uint64_t header_hash = 0;
  bool matches(const FileIdentity& other) const { return size == other.size && header_hash == other.header_hash; }
};
// The identity of a mapped file whose first `header_bytes` bytes are its header.
FileIdentity file_identity(const MappedFile& file, uint64_t header_bytes);
// "a file of 4096 bytes with header hash 0123456789abcdef, a file of ...": what a data
// set's origin() says of its files (not the paths: files move).
std::string identities_text(const std::vector<FileIdentity>& files);

}  // namespace dpt::data
