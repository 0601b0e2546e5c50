// Safetensors checkpoints: the header reader, the loader and the atomic writer.
//
// The header reader is written for the safetensors schema rather than as a general JSON
// parser: it accepts only what a header can hold (objects, arrays, strings,
// non-negative integers, whitespace) and its nesting is fixed at three levels (header,
// tensor entry, shape), so no input can make it recurse deeply or build a large tree.
// Every size is checked against the file's size before anything is allocated for it.
#include <dptrain/train/checkpoint.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <set>

#include <dptrain/error.hpp>

#include "atomic_file.hpp"

namespace dpt::ckpt {
namespace {

constexpr uint64_t kLenBytes = 8;             // the little-endian header length
constexpr uint64_t kMaxHeader = 100'000'000;  // safetensors' own limit
constexpr size_t kMaxDims = 64;               // bounds what one shape may allocate
constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();
constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kFaultVar = "DPT_CKPT_FAIL_AFTER_BYTES";
constexpr const char* kInjected = " (injected by DPT_CKPT_FAIL_AFTER_BYTES)";
constexpr const char* kNotReplaced = "; any previous checkpoint there is unchanged";

[[noreturn]] void fail(const std::string& file, const std::string& problem) {
  throw Error("checkpoint '" + file + "': " + problem);
}

std::string errno_text(int err) { return std::strerror(err); }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Elements in `shape`, or -1 when a dimension is negative or the product of the non-zero
// dimensions does not fit in int64 (so dpt::numel over it could overflow, even when a
// zero dimension makes the true count 0).
int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  bool empty = false;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d == 0) {
      empty = true;
    } else {
      if (count > kMaxInt64 / d) return -1;
      count *= d;
    }
  }
  return empty ? 0 : count;
}

// Whether `bytes` is exactly the data of `count` elements of `t` (no overflow possible).
bool holds(uint64_t bytes, int64_t count, DType t) {
  return bytes % dtype_size(t) == 0 && bytes / dtype_size(t) == static_cast<uint64_t>(count);
}

// Length of the valid UTF-8 character at p (n bytes available), or 0: overlong forms,
// surrogates and code points past U+10FFFF are invalid (RFC 3629).
size_t utf8_length(const uint8_t* p, size_t n) {
  const uint8_t c = p[0];
  if (c < 0x80) return 1;
  size_t len;
  uint32_t cp, min;
  if ((c & 0xE0) == 0xC0) {
    len = 2, cp = c & 0x1Fu, min = 0x80;
  } else if ((c & 0xF0) == 0xE0) {
    len = 3, cp = c & 0x0Fu, min = 0x800;
  } else if ((c & 0xF8) == 0xF0) {
    len = 4, cp = c & 0x07u, min = 0x10000;
  } else {
    return 0;
  }
  if (n < len) return 0;
  for (size_t i = 1; i < len; ++i) {
    if ((p[i] & 0xC0) != 0x80) return 0;
    cp = cp << 6 | (p[i] & 0x3Fu);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return len;
}

bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  for (size_t i = 0; i < s.size();) {
    const size_t len = utf8_length(p + i, s.size() - i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

void append_utf8(std::string& out, uint32_t cp) {
  auto byte = [&](uint32_t b) { out += static_cast<char>(static_cast<uint8_t>(b)); };
  if (cp < 0x80) {
    byte(cp);
  } else if (cp < 0x800) {
    byte(0xC0 | cp >> 6), byte(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    byte(0xE0 | cp >> 12), byte(0x80 | (cp >> 6 & 0x3F)), byte(0x80 | (cp & 0x3F));
  } else {
    byte(0xF0 | cp >> 18), byte(0x80 | (cp >> 12 & 0x3F)), byte(0x80 | (cp >> 6 & 0x3F)), byte(0x80 | (cp & 0x3F));
  }
}

// ---- Reading ------------------------------------------------------------------------

struct Entry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data that follows the header
};

struct Header {
  std::map<std::string, std::string> metadata;
  std::vector<Entry> entries;  // in header order
};

class HeaderReader {
 public:
  HeaderReader(const uint8_t* p, size_t n, const std::string& file) : p_(p), n_(n), file_(file) {}

  Header read() {
    // The spec asks for '{' as the very first byte (no leading whitespace).
    if (n_ == 0 || p_[0] != '{') fail(file_, "header is not a JSON object (it must start with '{')");
    Header h;
    bool has_metadata = false;
    std::set<std::string> names;
    object([&](const std::string& key) {
      if (key == kMetadataKey) {
        if (has_metadata) fail(file_, "duplicate __metadata__");
        has_metadata = true;
        metadata(h.metadata);
      } else {
        if (!names.insert(key).second) fail(file_, "duplicate tensor name " + printable(key));
        h.entries.push_back(tensor(key));
      }
    });
    skip_ws();  // writers pad the header with spaces
    if (pos_ != n_) syntax("unexpected bytes after the header object");
    return h;
  }

 private:
  [[noreturn]] void syntax(const std::string& what) const {
    fail(file_, "invalid header JSON at byte " + std::to_string(kLenBytes + pos_) + ": " + what);
  }

  void skip_ws() {
    while (pos_ < n_ && (p_[pos_] == ' ' || p_[pos_] == '\t' || p_[pos_] == '\n' || p_[pos_] == '\r')) ++pos_;
  }
  // Skips whitespace; then whether c comes next.
  bool next_is(char c) {
    skip_ws();
    return pos_ < n_ && p_[pos_] == c;
  }
  bool eat(char c) {
    if (!next_is(c)) return false;
    ++pos_;
    return true;
  }

  // Reads the object that comes next, calling field(key) with the position at its value;
  // field must read the value.
  template <class Field>
  void object(Field&& field) {
    if (!eat('{')) syntax("expected '{'");
    if (eat('}')) return;
    do {
      if (!next_is('"')) syntax("expected a string key");
      const std::string key = string();
      if (!eat(':')) syntax("expected ':'");
      field(key);
    } while (eat(','));
    if (!eat('}')) syntax("expected ',' or '}'");
  }

  // The string that starts at the current '"', unescaped, checked to be UTF-8.
  std::string string() {
    ++pos_;
    std::string s;
    for (;;) {
      if (pos_ >= n_) syntax("unterminated string");
      const uint8_t c = p_[pos_];
      if (c == '"') {
        ++pos_;
        return s;
      }
      if (c < 0x20) syntax("control character in a string");
      if (c == '\\') {
        escape(s);
        continue;
      }
      const size_t len = utf8_length(p_ + pos_, n_ - pos_);
      if (len == 0) syntax("invalid UTF-8 in a string");
      s.append(reinterpret_cast<const char*>(p_ + pos_), len);
      pos_ += len;
    }
  }

  void escape(std::string& s) {
    if (n_ - pos_ < 2) syntax("unterminated string");
    const uint8_t e = p_[pos_ + 1];
    pos_ += 2;
    switch (e) {
      case '"':
        s += '"';
        return;
      case '\\':
        s += '\\';
        return;
      case '/':
        s += '/';
        return;
      case 'b':
        s += '\b';
        return;
      case 'f':
        s += '\f';
        return;
      case 'n':
        s += '\n';
        return;
      case 'r':
        s += '\r';
        return;
      case 't':
        s += '\t';
        return;
      case 'u':
        break;
      default:
        pos_ -= 2;
        syntax("invalid escape in a string");
    }
    uint32_t cp = hex4();
    if (cp >= 0xDC00 && cp <= 0xDFFF) syntax("unpaired UTF-16 surrogate in a string");
    if (cp >= 0xD800 && cp <= 0xDBFF) {  // a high surrogate: its low half must follow
      if (n_ - pos_ < 2 || p_[pos_] != '\\' || p_[pos_ + 1] != 'u') syntax("unpaired UTF-16 surrogate in a string");
      pos_ += 2;
      const uint32_t low = hex4();
      if (low < 0xDC00 || low > 0xDFFF) syntax("unpaired UTF-16 surrogate in a string");
      cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
    }
    append_utf8(s, cp);
  }

  uint32_t hex4() {
    if (n_ - pos_ < 4) syntax("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i, ++pos_) {
      const uint8_t c = p_[pos_];
      uint32_t digit;
      if (c >= '0' && c <= '9') digit = static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') digit = static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') digit = static_cast<uint32_t>(c - 'A' + 10);
      else syntax("invalid \\u escape");
      v = v << 4 | digit;
    }
    return v;
  }

  // A non-negative integer that fits in 64 bits; `problem` is the error for any other
  // value (a negative, fractional or huge number, a string, ...).
  uint64_t integer(const std::string& problem) {
    skip_ws();
    auto digit = [&] { return pos_ < n_ && p_[pos_] >= '0' && p_[pos_] <= '9'; };
    if (!digit()) fail(file_, problem);
    if (p_[pos_] == '0' && pos_ + 1 < n_ && p_[pos_ + 1] >= '0' && p_[pos_ + 1] <= '9')
      syntax("number with a leading zero");
    uint64_t v = 0;
    for (; digit(); ++pos_) {
      const auto d = static_cast<uint64_t>(p_[pos_] - '0');
      if (v > (std::numeric_limits<uint64_t>::max() - d) / 10) fail(file_, problem);
      v = v * 10 + d;
    }
    if (pos_ < n_ && (p_[pos_] == '.' || p_[pos_] == 'e' || p_[pos_] == 'E')) fail(file_, problem);
    return v;
  }

  // A list of at most max_count non-negative integers.
  std::vector<uint64_t> integers(const std::string& problem, size_t max_count) {
    if (!eat('[')) fail(file_, problem);
    std::vector<uint64_t> v;
    if (eat(']')) return v;
    do {
      if (v.size() == max_count) fail(file_, problem);
      v.push_back(integer(problem));
    } while (eat(','));
    if (!eat(']')) syntax("expected ',' or ']'");
    return v;
  }

  void metadata(std::map<std::string, std::string>& m) {
    if (!next_is('{')) fail(file_, "__metadata__ is not an object of strings");
    object([&](const std::string& key) {
      if (!next_is('"')) fail(file_, "__metadata__ value of " + printable(key) + " is not a string");
      if (!m.emplace(key, string()).second) fail(file_, "duplicate __metadata__ key " + printable(key));
    });
  }

  Entry tensor(const std::string& name) {
    const std::string what = "tensor " + printable(name) + ": ";
    if (!next_is('{')) fail(file_, what + "not an object with dtype, shape and data_offsets");
    Entry e;
    e.name = name;
    bool has_dtype = false, has_shape = false, has_offsets = false;
    auto once = [&](bool& seen, const std::string& key) {
      if (seen) fail(file_, what + "duplicate field " + printable(key));
      seen = true;
    };
    object([&](const std::string& key) {
      if (key == "dtype") {
        once(has_dtype, key);
        if (!next_is('"')) fail(file_, what + "dtype is not a string");
        const std::string d = string();
        if (d == "F32") e.dtype = DType::f32;
        else if (d == "BF16") e.dtype = DType::bf16;
        else if (d == "I32") e.dtype = DType::i32;
        else fail(file_, what + "unsupported dtype " + printable(d) + " (dptrain reads F32, BF16 and I32)");
      } else if (key == "shape") {
        once(has_shape, key);
        const std::string problem =
            what + "shape is not a list of at most " + std::to_string(kMaxDims) + " non-negative integers";
        for (uint64_t d : integers(problem, kMaxDims)) {
          if (d > static_cast<uint64_t>(kMaxInt64)) fail(file_, problem);
          e.shape.push_back(static_cast<int64_t>(d));
        }
      } else if (key == "data_offsets") {
        once(has_offsets, key);
        const std::string problem = what + "data_offsets is not [begin, end] (two non-negative integers)";
        const std::vector<uint64_t> o = integers(problem, 2);
        if (o.size() != 2) fail(file_, problem);
        e.begin = o[0], e.end = o[1];
      } else {
        fail(file_, what + "unknown field " + printable(key));
      }
    });
    if (!has_dtype) fail(file_, what + "no dtype");
    if (!has_shape) fail(file_, what + "no shape");
    if (!has_offsets) fail(file_, what + "no data_offsets");
    return e;
  }

  const uint8_t* p_;
  size_t n_;
  const std::string& file_;
  size_t pos_ = 0;
};

// Each tensor's offsets lie within the data and span exactly its shape's bytes, and the
// tensors cover the data without overlaps or holes, as the spec requires (so a file
// cannot hide other content in it).
void check_layout(const std::vector<Entry>& entries, uint64_t data_size, const std::string& file) {
  for (const Entry& e : entries) {
    const std::string what = "tensor " + printable(e.name) + ": ";
    const std::string offsets = "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "]";
    if (e.begin > e.end) fail(file, what + offsets + " begin after they end");
    if (e.end > data_size)
      fail(file, what + offsets + " run past the end of the data (" + std::to_string(data_size) + " bytes)");
    const int64_t count = element_count(e.shape);
    if (count < 0) fail(file, what + "shape " + shape_text(e.shape) + " has too many elements");
    if (!holds(e.end - e.begin, count, e.dtype))
      fail(file, what + "shape " + shape_text(e.shape) + " of " + dtype_name(e.dtype) + " does not fit " + offsets +
                     " (" + std::to_string(e.end - e.begin) + " bytes)");
  }
  // The header's order need not follow the offsets (the spec does not ask it to).
  std::vector<const Entry*> by_offset;
  for (const Entry& e : entries) by_offset.push_back(&e);
  std::stable_sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t covered = 0;
  const Entry* prev = nullptr;
  for (const Entry* e : by_offset) {
    if (e->begin < covered) fail(file, "tensors " + printable(prev->name) + " and " + printable(e->name) + " overlap");
    if (e->begin > covered)
      fail(file, "data bytes " + std::to_string(covered) + " to " + std::to_string(e->begin) + " belong to no tensor");
    covered = e->end;
    prev = e;
  }
  if (covered != data_size)
    fail(file, "data bytes " + std::to_string(covered) + " to " + std::to_string(data_size) +
                   " (the end of the file) belong to no tensor");
}

void check_file_size(uint64_t size, const std::string& file) {
  if (size < kLenBytes)
    fail(file, "file is " + std::to_string(size) + " bytes, too short for the 8-byte header length");
}

// The header length in the file's first 8 bytes, checked against the limit and the size.
uint64_t header_length(const uint8_t* first8, uint64_t file_size, const std::string& file) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | first8[i];
  if (n > kMaxHeader)
    fail(file, "header length " + std::to_string(n) + " is over the limit of " + std::to_string(kMaxHeader) + " bytes");
  if (n > file_size - kLenBytes)
    fail(file, "header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(file_size) +
                   " bytes)");
  return n;
}

Header read_header(const uint8_t* header, uint64_t n, uint64_t file_size, const std::string& file) {
  Header h = HeaderReader(header, n, file).read();
  check_layout(h.entries, file_size - kLenBytes - n, file);
  return h;
}

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
  if (!c.metadata.empty()) {
    put_string(h, kMetadataKey);
    h += ":{";
    for (const auto& [key, value] : c.metadata) {
      if (!valid_utf8(key) || !valid_utf8(value))
        fail(file, "__metadata__ entry " + printable(key) + " is not valid UTF-8");
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
    if (name == kMetadataKey) fail(file, what + "the name is reserved for metadata");
    if (!valid_utf8(name)) fail(file, what + "the name is not valid UTF-8");
    if (!names.insert(name).second) fail(file, what + "duplicate name");
    if (t.shape.size() > kMaxDims) fail(file, what + "more than " + std::to_string(kMaxDims) + " dimensions");
    const int64_t count = element_count(t.shape);
    if (count < 0) fail(file, what + "invalid shape " + shape_text(t.shape));
    if (!holds(t.data.size(), count, t.dtype))
      fail(file, what + std::to_string(t.data.size()) + " bytes of data for shape " + shape_text(t.shape) + " of " +
                     dtype_name(t.dtype));
    separate();
    put_string(h, name);
    h += ":{\"dtype\":\"" + std::string(dtype_name(t.dtype)) + "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) h += (i ? "," : "") + std::to_string(t.shape[i]);
    h += "],\"data_offsets\":[" + std::to_string(offset) + ",";
    offset += t.data.size();
    h += std::to_string(offset) + "]}";
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');
  if (h.size() > kMaxHeader) fail(file, "header of " + std::to_string(h.size()) + " bytes is over the limit");
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

// A name from the file, quoted for an error message: control bytes escaped (the message
// stays one line) and long names cut short.
std::string printable(const std::string& s) {
  constexpr size_t kMax = 80;
  size_t len = s.size();
  if (len > kMax) {
    len = kMax;
    while (len > 0 && (static_cast<uint8_t>(s[len]) & 0xC0) == 0x80) --len;  // whole UTF-8 characters
  }
  std::string out = "'";
  for (size_t i = 0; i < len; ++i) {
    const auto c = static_cast<uint8_t>(s[i]);
    if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += s[i];
    }
  }
  return out + (len < s.size() ? "...'" : "'");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::i32:
      return "I32";
  }
  return "?";
}

size_t dtype_size(DType t) { return t == DType::bf16 ? 2 : 4; }

HostTensor make_tensor(DType dtype, std::vector<int64_t> shape, const void* bytes) {
  const int64_t count = element_count(shape);
  if (count < 0) throw Error("checkpoint tensor: invalid shape " + shape_text(shape));
  const auto* p = static_cast<const uint8_t*>(bytes);
  return {dtype, std::move(shape), std::vector<uint8_t>(p, p + static_cast<size_t>(count) * dtype_size(dtype))};
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

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    const auto c = static_cast<uint8_t>(ch);
    if (c == '"' || c == '\\') {
      out += '\\', out += ch;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

Checkpoint parse(const uint8_t* data, size_t size, const std::string& name_for_errors) {
  check_file_size(size, name_for_errors);
  const uint64_t n = header_length(data, size, name_for_errors);
  // The header in a buffer of its own, as load() reads it: a read past its end is then a
  // sanitizer finding for the fuzzer, not a silent read of the tensor data behind it.
  const std::vector<uint8_t> header(data + kLenBytes, data + kLenBytes + n);
  Header h = read_header(header.data(), n, size, name_for_errors);
  const uint8_t* base = data + kLenBytes + n;
  Checkpoint c;
  c.metadata = std::move(h.metadata);
  for (Entry& e : h.entries)
    c.tensors.emplace_back(std::move(e.name),
                           HostTensor{e.dtype, std::move(e.shape), std::vector<uint8_t>(base + e.begin, base + e.end)});
  return c;
}

Checkpoint load(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (fstat then refuses it).
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (f.fd < 0) fail(path, "cannot open: " + errno_text(errno));
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) fail(path, "cannot stat: " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
  const auto size = static_cast<uint64_t>(st.st_size);
  check_file_size(size, path);
  uint8_t len[kLenBytes];
  read_at(f.fd, len, kLenBytes, 0, path);
  const uint64_t n = header_length(len, size, path);
  std::vector<uint8_t> header(n);
  read_at(f.fd, header.data(), n, kLenBytes, path);
  Header h = read_header(header.data(), n, size, path);
  // Tensors are read straight into their buffers: memory is the file's size, once.
  Checkpoint c;
  c.metadata = std::move(h.metadata);
  for (Entry& e : h.entries) {
    HostTensor t{e.dtype, std::move(e.shape), std::vector<uint8_t>(e.end - e.begin)};
    read_at(f.fd, t.data.data(), t.data.size(), kLenBytes + n + e.begin, path);
    c.tensors.emplace_back(std::move(e.name), std::move(t));
  }
  return c;
}

}  // namespace dpt::ckpt
