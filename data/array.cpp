#include <dptrain/data/array.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include <dptrain/error.hpp>

#include "common/fnv1a.hpp"
#include "data/array_dtypes.hpp"

namespace dpt::data {

namespace {
constexpr ArrayDTypeInfo kArrayDTypes[] = {
    {ArrayDType::f32, "float32", "F32", 4}, {ArrayDType::f64, "float64", "F64", 8},
    {ArrayDType::f16, "float16", "F16", 2}, {ArrayDType::bf16, "bfloat16", "BF16", 2},
    {ArrayDType::u8, "uint8", "U8", 1},     {ArrayDType::i32, "int32", "I32", 4},
    {ArrayDType::i64, "int64", "I64", 8},   {ArrayDType::u16, "uint16", "U16", 2},
    {ArrayDType::u32, "uint32", "U32", 4}};
constexpr ArrayDTypeInfo kUnknownDType = {ArrayDType::f32, "?", "?", 1};
}  // namespace

const ArrayDTypeInfo& array_dtype_info(ArrayDType t) {
  for (const ArrayDTypeInfo& d : kArrayDTypes)
    if (d.type == t) return d;
  return kUnknownDType;
}

const char* array_dtype_name(ArrayDType t) { return array_dtype_info(t).numpy; }

size_t array_dtype_size(ArrayDType t) { return array_dtype_info(t).size; }

bool is_integer(ArrayDType t) {
  return t == ArrayDType::u8 || t == ArrayDType::u16 || t == ArrayDType::u32 || t == ArrayDType::i32 ||
         t == ArrayDType::i64;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t element_count(const std::vector<int64_t>& shape) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t count = 1;
  bool empty = false;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d == 0) {
      empty = true;
    } else {
      if (count > kMax / d) return -1;
      count *= d;
    }
  }
  return empty ? 0 : count;
}

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw UsageError("data file '" + path + "': " + problem);
}

std::string kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

MappedFile::MappedFile(const std::string& path) : path_(path) {
  // stat before open: opening a FIFO or a device for reading may block or act on it.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) fail(path, "cannot open: " + std::string(std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file (" + kind_of(st.st_mode) + ")");
  // O_NONBLOCK as well, should the path have become something else in between; fstat
  // then tells.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(path, "cannot open: " + std::string(std::strerror(errno)));
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a regular file");
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);  // the mapping keeps the file
    if (p == MAP_FAILED) fail(path, "cannot map: " + std::string(std::strerror(err)));
    data_ = static_cast<const uint8_t*>(p);
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

FileIdentity file_identity(const MappedFile& file, uint64_t header_bytes) {
  DPT_CHECK(header_bytes <= file.size(), "file_identity: header past the end of the file");
  return {file.path(), file.size(), fnv1a(file.data(), static_cast<size_t>(header_bytes))};
}

std::string identities_text(const std::vector<FileIdentity>& files) {
  std::string text;
  for (const FileIdentity& f : files) {
    char hash[24];
    std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(f.header_hash));
    text += std::string(&f == files.data() ? "" : ", ") + "a file of " + std::to_string(f.size) +
            " bytes with header hash " + hash;
  }
  return text;
}

}  // namespace dpt::data
