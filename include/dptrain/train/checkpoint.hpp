// Checkpoint files in the safetensors format: an 8-byte little-endian header length N,
// N bytes of JSON ({"__metadata__": {string: string}, "name": {"dtype", "shape",
// "data_offsets"}}), then the tensors' bytes, back to back. Saving is atomic (the old
// file survives any failure); loading treats the file as hostile: every malformed file
// gives one dpt::Error line "checkpoint 'FILE': <problem>", never a crash, and nothing
// is allocated beyond what the file's own size justifies.
//
// The format's header parser is the one data files use (data/safetensors.cpp). This file,
// checkpoint.cpp and that parser use only the standard library, POSIX and
// <dptrain/error.hpp>, so the fuzzer (tests/fuzz_test.sh) can build them on their own.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <dptrain/types.hpp>

namespace dpt::ckpt {

// The element types dptrain stores: the library's own (types.hpp), named in the file as
// safetensors names them.
using ::dpt::DType;
using ::dpt::dtype_size;
const char* safetensors_name(DType t);  // "F32", "BF16", "I32"

// A tensor on the host: its bytes as they lie in the file (row-major, little-endian;
// bf16 as the upper 16 bits of the float).
struct HostTensor {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;  // {} is a scalar
  std::vector<uint8_t> data;   // numel(shape) * dtype_size(dtype) bytes
};

// Copies numel(shape) elements of `dtype` from `bytes`; throws dpt::Error on a negative
// dimension.
HostTensor make_tensor(DType dtype, std::vector<int64_t> shape, const void* bytes);

struct Checkpoint {
  std::map<std::string, std::string> metadata;              // safetensors allows string values only
  std::vector<std::pair<std::string, HostTensor>> tensors;  // in file order
  const HostTensor* find(const std::string& name) const;    // nullptr when absent
  // Set by load(): every tensor matched the checksum save() kept of it. False for a file
  // that carries none (written before dptrain kept them, or by another writer).
  bool checksummed = false;
};

// Writes `c` to `path` atomically: a temporary file beside it, written, fsynced, renamed
// over `path`, then the folder fsynced. Each tensor's checksum (XXH64) goes into the
// metadata as "checksum:NAME" (a key of that form in `c.metadata` is refused). On any failure the temporary file is
// removed, whatever was at `path` is left as it was, and dpt::Error names the file and the cause (e.g. "No space left
// on device"). Tensors are written in the given order.
//
// For tests of that promise: when the environment variable DPT_CKPT_FAIL_AFTER_BYTES=N
// is set, writing fails with ENOSPC once N bytes of the temporary file are written.
void save(const std::string& path, const Checkpoint& c);

// Reads a checkpoint written by save() or by any safetensors writer whose tensors are
// F32, BF16 or I32. Throws dpt::Error "checkpoint 'PATH': <problem>", also when a tensor
// does not match its checksum (naming the tensor). The checksums are checked and taken out
// of the metadata (see Checkpoint::checksummed).
Checkpoint load(const std::string& path);

// The metadata of checkpoint `path` alone: its header read and checked, not its data
// (what a file is, cheaply, however large). Throws as load() does.
std::map<std::string, std::string> read_metadata(const std::string& path);

// A string from a file, quoted for a one-line error message: 'text', control bytes
// escaped, long strings cut short.
std::string printable(const std::string& s);

// The loader's core on a whole file in memory; errors name `name_for_errors`.
Checkpoint parse(const uint8_t* data, size_t size, const std::string& name_for_errors);

}  // namespace dpt::ckpt
