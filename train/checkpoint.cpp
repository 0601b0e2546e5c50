// Safetensors checkpoints: the loader and the atomic writer. The format's header parser
// is data/safetensors.cpp, which data files share; what is checkpoint-specific lives here:
// the dtypes a checkpoint holds (F32, BF16, I32), its errors (dpt::Error "checkpoint
// 'FILE': <problem>"), each tensor's checksum, reading the file and writing one atomically.
#include <dptrain/train/checkpoint.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <thread>

#include <dptrain/data/array.hpp>
#include <dptrain/error.hpp>

#include "common/atomic_file.hpp"
#include "common/text.hpp"
#include "data/safetensors.hpp"

namespace dpt::ckpt {
namespace {

namespace sft = data::safetensors;
using data::element_count;
using data::shape_text;
using sft::kLenBytes;
using sft::kMaxDims;
using sft::kMaxHeader;
using sft::kMetadataKey;

constexpr std::string_view kChecksumPrefix = "checksum:";
constexpr const char* kFaultVar = "DPT_CKPT_FAIL_AFTER_BYTES";
constexpr const char* kInjected = " (injected by DPT_CKPT_FAIL_AFTER_BYTES)";
constexpr const char* kNotReplaced = "; any previous checkpoint there is unchanged";
// What a checkpoint may hold, in the order its error names them.
const std::vector<data::ArrayDType> kDTypes = {data::ArrayDType::f32, data::ArrayDType::bf16, data::ArrayDType::i32};

[[noreturn]] void fail(const std::string& file, const std::string& problem) {
  throw Error("checkpoint '" + file + "': " + problem);
}
// A Checkpoint that save() is handed and could not load back is the caller's mistake.
[[noreturn]] void refuse(const std::string& file, const std::string& problem) {
  throw UsageError("checkpoint '" + file + "': " + problem);
}

sft::Source source(const std::string& file) { return {"checkpoint", file, false}; }

data::ArrayDType array_dtype(DType t) {
  return t == DType::f32 ? data::ArrayDType::f32 : t == DType::bf16 ? data::ArrayDType::bf16 : data::ArrayDType::i32;
}

DType checkpoint_dtype(data::ArrayDType t) {
  return t == data::ArrayDType::f32 ? DType::f32 : t == data::ArrayDType::bf16 ? DType::bf16 : DType::i32;
}

bool holds(uint64_t bytes, int64_t count, DType t) { return sft::holds(bytes, count, array_dtype(t)); }

// The header (grammar, dtypes and layout), checked; errors name `file`.
sft::Header read_header(const uint8_t* header, uint64_t n, uint64_t file_size, const std::string& file) {
  return sft::read_header(header, n, file_size, kDTypes, source(file));
}

std::string errno_text(int err) { return std::strerror(err); }

struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void read_at(int fd, uint8_t* p, uint64_t n, uint64_t offset, const std::string& file) {
  while (n > 0) {
    const ssize_t k = ::pread(fd, p, std::min<uint64_t>(n, 1u << 30), static_cast<off_t>(offset));
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) fail(file, "cannot read: " + errno_text(errno));
    if (k == 0) fail(file, "file ended early (did it change while being read?)");
    p += k, n -= static_cast<uint64_t>(k), offset += static_cast<uint64_t>(k);
  }
}

// ---- Checksums ----------------------------------------------------------------------
// Each tensor's XXH64 is kept in the metadata, under "checksum:NAME", as "xxh64:" and 16
// hex digits: a flipped bit in the weights or the optimizer state is found on every load.

std::string checksum_text(uint64_t digest) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "xxh64:%016llx", static_cast<unsigned long long>(digest));
  return buf;
}
std::string checksum_text(const std::vector<uint8_t>& data) {
  return checksum_text(sft::xxh64(data.data(), data.size()));
}

bool is_checksum_key(const std::string& key) { return key.compare(0, kChecksumPrefix.size(), kChecksumPrefix) == 0; }

// The checksums in `metadata` (taken out of it), by tensor name, checked against the
// tensors the header lists: one each, or none at all (a file written before dptrain kept
// them, or by another writer).
std::map<std::string, std::string> take_checksums(std::map<std::string, std::string>& metadata,
                                                  const std::vector<sft::Entry>& entries, const std::string& file) {
  std::map<std::string, std::string> sums;
  for (auto it = metadata.begin(); it != metadata.end();) {
    if (!is_checksum_key(it->first)) {
      ++it;
      continue;
    }
    const std::string name = it->first.substr(kChecksumPrefix.size());
    if (std::none_of(entries.begin(), entries.end(), [&](const sft::Entry& e) { return e.name == name; }))
      fail(file, "__metadata__ has a checksum of " + printable(name) + ", a tensor the file does not hold");
    const std::string& v = it->second;
    if (v.size() != 22 || v.compare(0, 6, "xxh64:") != 0 ||
        v.find_first_not_of("0123456789abcdef", 6) != std::string::npos)
      fail(file,
           "the checksum of tensor " + printable(name) + " is " + printable(v) + ", not xxh64: and 16 hex digits");
    sums.emplace(name, v);
    it = metadata.erase(it);
  }
  if (!sums.empty())
    for (const sft::Entry& e : entries)
      if (!sums.count(e.name)) fail(file, "tensor " + printable(e.name) + " has no checksum in __metadata__");
  return sums;
}

void verify(const std::map<std::string, std::string>& sums, const std::string& name, uint64_t digest,
            const std::string& file) {
  if (sums.empty()) return;
  const std::string kept = sums.at(name), now = checksum_text(digest);
  if (kept != now)
    fail(file, "tensor " + printable(name) + " does not match its checksum (" + kept.substr(6) + " saved, " +
                   now.substr(6) + " read): the file is corrupted");
}

// Hashes the tensors of a large file on a thread of its own, a piece behind the reads: the
// load then takes about as long as its reads alone. (In one thread, hashing a 1 GiB file
// added 25% to its load; read and hashed a piece at a time, 8 MiB, beside it: a few %.)
class TrailingHasher {
 public:
  static constexpr uint64_t kPiece = 8 << 20;
  explicit TrailingHasher(size_t tensors) : digests_(tensors), worker_([this] { work(); }) {}
  TrailingHasher(const TrailingHasher&) = delete;
  TrailingHasher& operator=(const TrailingHasher&) = delete;
  ~TrailingHasher() {
    stop(/*drain=*/false);  // a read failed: what is queued no longer matters
  }
  // Bytes of tensor `index`, read (they stay where they are until digests() returns).
  void add(size_t index, const uint8_t* p, size_t n, bool last) {
    {
      std::lock_guard<std::mutex> lock(m_);
      jobs_.push_back({index, p, n, last});
    }
    cv_.notify_one();
  }
  // Each tensor's digest, once every piece added is hashed.
  const std::vector<uint64_t>& digests() {
    stop(/*drain=*/true);
    return digests_;
  }

 private:
  struct Job {
    size_t index;
    const uint8_t* p;
    size_t n;
    bool last;
  };
  void stop(bool drain) {
    {
      std::lock_guard<std::mutex> lock(m_);
      closed_ = true;
      if (!drain) jobs_.clear();
    }
    cv_.notify_one();
    if (worker_.joinable()) worker_.join();
  }
  void work() {
    sft::Xxh64 h;
    for (;;) {
      std::unique_lock<std::mutex> lock(m_);
      cv_.wait(lock, [this] { return closed_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      const Job j = jobs_.front();
      jobs_.pop_front();
      lock.unlock();
      h.update(j.p, j.n);
      if (j.last) digests_[j.index] = h.digest(), h = sft::Xxh64();
    }
  }
  std::vector<uint64_t> digests_;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool closed_ = false;
  std::thread worker_;  // last: it starts once the members above are made
};

// ---- Writing ------------------------------------------------------------------------

void put_string(std::string& out, const std::string& s) { out += json_quote(s); }

// The JSON header for `c`, padded with spaces to a multiple of 8 bytes so that the data
// starts 8-byte aligned (as the reference writer does). Refuses what load() would refuse.
std::string make_header(const Checkpoint& c, const std::string& file) {
  std::string h = "{";
  // A comma before every member but an object's first (h then ends with its '{').
  auto separate = [&h] {
    if (h.back() != '{') h += ',';
  };
  std::map<std::string, std::string> metadata = c.metadata;
  for (const auto& [name, t] : c.tensors)  // (a name that is not UTF-8 is refused as the tensor's)
    if (valid_utf8(name)) metadata[std::string(kChecksumPrefix) + name] = checksum_text(t.data);
  if (!metadata.empty()) {
    put_string(h, kMetadataKey);
    h += ":{";
    for (const auto& [key, value] : metadata) {
      if (is_checksum_key(key) && c.metadata.count(key))
        refuse(file, "__metadata__ key " + printable(key) + " is reserved for the checksum of a tensor");
      if (!valid_utf8(key)) refuse(file, "__metadata__ key " + printable(key) + " is not valid UTF-8");
      if (!valid_utf8(value)) refuse(file, "__metadata__ value of " + printable(key) + " is not valid UTF-8");
      separate();
      put_string(h, key);
      h += ':';
      put_string(h, value);
    }
    h += '}';
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& [name, t] : c.tensors) {
    const std::string what = "tensor " + printable(name) + ": ";
    if (name == kMetadataKey) refuse(file, what + "the name is reserved for metadata");
    if (!valid_utf8(name)) refuse(file, what + "the name is not valid UTF-8");
    if (!names.insert(name).second) refuse(file, what + "duplicate name");
    if (t.shape.size() > kMaxDims) refuse(file, what + "more than " + std::to_string(kMaxDims) + " dimensions");
    const int64_t count = element_count(t.shape);
    if (count < 0) refuse(file, what + "invalid shape " + shape_text(t.shape));
    if (!holds(t.data.size(), count, t.dtype))
      refuse(file, what + std::to_string(t.data.size()) + " bytes of data for shape " + shape_text(t.shape) + " of " +
                       safetensors_name(t.dtype));
    separate();
    put_string(h, name);
    h += ":{\"dtype\":\"" + std::string(safetensors_name(t.dtype)) + "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) h += (i ? "," : "") + std::to_string(t.shape[i]);
    h += "],\"data_offsets\":[" + std::to_string(offset) + ",";
    offset += t.data.size();
    h += std::to_string(offset) + "]}";
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');
  if (h.size() > kMaxHeader) refuse(file, "header of " + std::to_string(h.size()) + " bytes is over the limit");
  return h;
}

// Makes `file` fail as a full disk would where DPT_CKPT_FAIL_AFTER_BYTES says (tests).
void inject_full_disk(AtomicFile& file, const std::string& path) {
  const char* v = std::getenv(kFaultVar);
  if (v == nullptr || *v == '\0') return;
  uint64_t n = 0;
  const char* end = v + std::strlen(v);
  const auto [ptr, ec] = std::from_chars(v, end, n);
  if (ec != std::errc() || ptr != end) fail(path, std::string(kFaultVar) + " is not a number of bytes: '" + v + "'");
  file.fail_after(n, kInjected);
}

}  // namespace

std::string printable(const std::string& s) { return ::dpt::printable(s); }

const char* safetensors_name(DType t) { return sft::dtype_name(array_dtype(t)); }

HostTensor make_tensor(DType dtype, std::vector<int64_t> shape, const void* bytes) {
  const int64_t count = element_count(shape);
  if (count < 0) throw UsageError("checkpoint tensor: invalid shape " + shape_text(shape));
  // At most what a vector may hold (PTRDIFF_MAX bytes): more would wrap or throw length_error.
  if (static_cast<uint64_t>(count) > static_cast<uint64_t>(PTRDIFF_MAX) / dtype_size(dtype))
    throw UsageError("checkpoint tensor: shape " + shape_text(shape) + " holds more bytes than an array can");
  const auto* p = static_cast<const uint8_t*>(bytes);
  const size_t n = static_cast<size_t>(count) * dtype_size(dtype);
  try {
    return {dtype, std::move(shape), n == 0 ? std::vector<uint8_t>() : std::vector<uint8_t>(p, p + n)};
  } catch (const std::bad_alloc&) {
    throw OutOfMemory("out of host memory: a checkpoint tensor of " + std::to_string(n) + " bytes");
  }
}

const HostTensor* Checkpoint::find(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
}

void save(const std::string& path, const Checkpoint& c) {
  const std::string header = make_header(c, path);
  uint64_t total = kLenBytes + header.size();
  for (const auto& named : c.tensors) total += named.second.data.size();
  uint8_t len[kLenBytes];
  for (size_t i = 0; i < kLenBytes; ++i) len[i] = static_cast<uint8_t>(header.size() >> (8 * i));

  AtomicFile file(path, "checkpoint '" + path + "'", kNotReplaced);
  file.expect(total);
  inject_full_disk(file, path);
  file.write(len, kLenBytes);
  file.write(header.data(), header.size());
  for (const auto& named : c.tensors) file.write(named.second.data.data(), named.second.data.size());
  file.commit();
}

Checkpoint parse(const uint8_t* data, size_t size, const std::string& name_for_errors) {
  sft::check_file_size(size, source(name_for_errors));
  const uint64_t n = sft::header_length(data, size, source(name_for_errors));
  // The header in a buffer of its own, as load() reads it: a read past its end is then a
  // sanitizer finding for the fuzzer, not a silent read of the tensor data behind it.
  const std::vector<uint8_t> header(data + kLenBytes, data + kLenBytes + n);
  sft::Header h = read_header(header.data(), n, size, name_for_errors);
  const uint8_t* base = data + kLenBytes + n;
  Checkpoint c;
  c.metadata = std::move(h.metadata);
  const auto sums = take_checksums(c.metadata, h.entries, name_for_errors);
  c.checksummed = !sums.empty();
  for (sft::Entry& e : h.entries) {
    HostTensor t{checkpoint_dtype(e.dtype), std::move(e.shape), std::vector<uint8_t>(base + e.begin, base + e.end)};
    verify(sums, e.name, sft::xxh64(t.data.data(), t.data.size()), name_for_errors);
    c.tensors.emplace_back(std::move(e.name), std::move(t));
  }
  return c;
}

namespace {
// The header of the checkpoint open as `fd`, read and checked; `size` set to the file's.
sft::Header open_header(const Fd& f, const std::string& path, uint64_t& size, uint64_t& n) {
  if (f.fd < 0) fail(path, "cannot open: " + errno_text(errno));
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) fail(path, "cannot stat: " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
  size = static_cast<uint64_t>(st.st_size);
  sft::check_file_size(size, source(path));
  uint8_t len[kLenBytes];
  read_at(f.fd, len, kLenBytes, 0, path);
  n = sft::header_length(len, size, source(path));
  std::vector<uint8_t> header(n);
  read_at(f.fd, header.data(), n, kLenBytes, path);
  return read_header(header.data(), n, size, path);
}
}  // namespace

std::map<std::string, std::string> read_metadata(const std::string& path) {
  const Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  uint64_t size = 0, n = 0;
  sft::Header h = open_header(f, path, size, n);
  (void)take_checksums(h.metadata, h.entries, path);
  return std::move(h.metadata);
}

Checkpoint load(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (fstat then refuses it).
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  uint64_t size = 0, n = 0;
  sft::Header h = open_header(f, path, size, n);
  // Tensors are read straight into their buffers: memory is the file's size, once.
  Checkpoint c;
  c.metadata = std::move(h.metadata);
  const auto sums = take_checksums(c.metadata, h.entries, path);  // before a byte of data is read
  c.checksummed = !sums.empty();
  // A small file is hashed as it is read; a large one beside its reads.
  const bool beside = c.checksummed && size - kLenBytes - n > 4 * TrailingHasher::kPiece;
  std::optional<TrailingHasher> hasher;
  if (beside) hasher.emplace(h.entries.size());
  for (size_t i = 0; i < h.entries.size(); ++i) {
    sft::Entry& e = h.entries[i];
    HostTensor t{checkpoint_dtype(e.dtype), std::move(e.shape), std::vector<uint8_t>(e.end - e.begin)};
    const uint64_t bytes = t.data.size();
    for (uint64_t at = 0; at < bytes || (at == 0 && beside); at += TrailingHasher::kPiece) {
      const uint64_t piece = std::min(bytes - at, TrailingHasher::kPiece);
      read_at(f.fd, t.data.data() + at, piece, kLenBytes + n + e.begin + at, path);
      if (beside) hasher->add(i, t.data.data() + at, piece, at + piece == bytes);
    }
    if (!beside) verify(sums, e.name, sft::xxh64(t.data.data(), bytes), path);
    c.tensors.emplace_back(std::move(e.name), std::move(t));  // the bytes stay where the hasher reads them
  }
  if (beside) {
    const std::vector<uint64_t>& digests = hasher->digests();
    for (size_t i = 0; i < c.tensors.size(); ++i) verify(sums, c.tensors[i].first, digests[i], path);
  }
  return c;
}

}  // namespace dpt::ckpt
