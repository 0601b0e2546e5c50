// NumPy .npy files: the strict header reader, a memory-mapped reader, and the writer.
//
// A .npy file is the magic "\x93NUMPY", a version (1.0, 2.0 or 3.0), the header length
// (2 bytes little-endian in 1.0, 4 bytes after), then the header: a Python dict literal
// {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), } padded with spaces and
// ended by '\n', so that the data starts aligned (to 64 bytes; old numpy aligned to 16).
// The data follows, exactly the shape's bytes.
//
// The header is treated as hostile: it is read by a parser of just that dict (the three
// keys once each, string, bool and tuple-of-integer values, no escapes, no nesting, at
// most 10000 bytes: numpy's own max_header_size), never evaluated, and checked against
// the file's size. Only what dptrain trains on is accepted: C order, little-endian
// float32, float64, float16, int32, int64, uint8, and uint16 and uint32 (tokens). Every
// problem is one dpt::UsageError line "data file 'PATH': <problem>".
//
// This header and data/npy.cpp use only the standard library, POSIX and
// <dptrain/error.hpp>, so the fuzzer (tests/fuzz_test.sh) can build them on their own.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <dptrain/data/array.hpp>

namespace dpt::data {

constexpr size_t kNpyMaxHeader = 10000;  // bytes of the dict, as numpy.load's max_header_size
constexpr size_t kNpyMaxDims = 64;       // numpy's own limit (NPY_MAXDIMS)

struct NpyHeader {
  int major = 1, minor = 0;  // format version
  ArrayDType dtype = ArrayDType::f32;
  std::vector<int64_t> shape;  // {} is a scalar
  uint64_t data_offset = 0;    // where the data starts: magic, version, length and dict
};

// Reads and checks the header of the .npy file held whole in `file` (`size` bytes): the
// data must be exactly the shape's bytes. Errors name `name_for_errors`.
NpyHeader parse_npy_header(const uint8_t* file, uint64_t size, const std::string& name_for_errors);

// A .npy file, memory-mapped (never read whole) and checked; its array points into the
// mapping, which lives as long as any copy of the NpyFile or of mapping().
class NpyFile {
 public:
  explicit NpyFile(const std::string& path);
  const std::string& path() const { return file_->path(); }
  const NpyHeader& header() const { return header_; }
  Array array() const;
  FileIdentity identity() const { return file_identity(*file_, header_.data_offset); }
  const std::shared_ptr<const MappedFile>& mapping() const { return file_; }

 private:
  std::shared_ptr<const MappedFile> file_;
  NpyHeader header_;
};

// The bytes before the data of a .npy file holding `shape` of `dtype`, as numpy writes
// them (keys sorted, padded to 64 bytes). major 0 picks the oldest version that can hold
// the header (1.0); 1, 2 or 3 asks for that one. Throws dpt::Error for a dtype numpy
// cannot name (bfloat16) or a shape with a negative dimension or too many elements.
std::string npy_header(ArrayDType dtype, const std::vector<int64_t>& shape, int major = 0);

// Writes `array` as a .npy file to `sink`, which takes bytes in order (a file, a buffer):
// the header, then the data. Atomic replacement is the caller's (train/atomic_file).
using ByteSink = std::function<void(const void* bytes, size_t n)>;
void write_npy(const ByteSink& sink, const Array& array, int major = 0);

}  // namespace dpt::data
