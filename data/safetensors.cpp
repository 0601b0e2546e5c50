#include "safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>

#include <dptrain/error.hpp>

#include "common/text.hpp"

namespace dpt::data::safetensors {
namespace {

constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();

// "F32, BF16 and I32".
std::string name_list(const std::vector<ArrayDType>& types) {
  std::string s;
  for (size_t i = 0; i < types.size(); ++i) {
    if (i) s += i + 1 == types.size() ? " and " : ", ";
    s += dtype_name(types[i]);
  }
  return s;
}

class HeaderReader {
 public:
  HeaderReader(const uint8_t* p, size_t n, const std::vector<ArrayDType>& accepted, const Source& src)
      : p_(p), n_(n), accepted_(accepted), src_(src) {}

  Header read() {
    // The spec asks for '{' as the very first byte (no leading whitespace).
    if (n_ == 0 || p_[0] != '{') fail("header is not a JSON object (it must start with '{')");
    Header h;
    bool has_metadata = false;
    std::set<std::string> names;
    object([&](const std::string& key) {
      if (key == kMetadataKey) {
        if (has_metadata) fail("duplicate __metadata__");
        has_metadata = true;
        metadata(h.metadata);
      } else {
        if (!names.insert(key).second) fail("duplicate tensor name " + printable(key));
        h.entries.push_back(tensor(key));
      }
    });
    skip_ws();  // writers pad the header with spaces
    if (pos_ != n_) syntax("unexpected bytes after the header object");
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& problem) const { src_.fail(problem); }
  [[noreturn]] void syntax(const std::string& what) const {
    fail("invalid header JSON at byte " + std::to_string(kLenBytes + pos_) + ": " + what);
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
    if (!digit()) fail(problem);
    if (p_[pos_] == '0' && pos_ + 1 < n_ && p_[pos_ + 1] >= '0' && p_[pos_ + 1] <= '9')
      syntax("number with a leading zero");
    uint64_t v = 0;
    for (; digit(); ++pos_) {
      const auto d = static_cast<uint64_t>(p_[pos_] - '0');
      if (v > (std::numeric_limits<uint64_t>::max() - d) / 10) fail(problem);
      v = v * 10 + d;
    }
    if (pos_ < n_ && (p_[pos_] == '.' || p_[pos_] == 'e' || p_[pos_] == 'E')) fail(problem);
    return v;
  }

  // A list of at most max_count non-negative integers.
  std::vector<uint64_t> integers(const std::string& problem, size_t max_count) {
    if (!eat('[')) fail(problem);
    std::vector<uint64_t> v;
    if (eat(']')) return v;
    do {
      if (v.size() == max_count) fail(problem);
      v.push_back(integer(problem));
    } while (eat(','));
    if (!eat(']')) syntax("expected ',' or ']'");
    return v;
  }

  void metadata(std::map<std::string, std::string>& m) {
    if (!next_is('{')) fail("__metadata__ is not an object of strings");
    object([&](const std::string& key) {
      if (!next_is('"')) fail("__metadata__ value of " + printable(key) + " is not a string");
      if (!m.emplace(key, string()).second) fail("duplicate __metadata__ key " + printable(key));
    });
  }

  ArrayDType dtype(const std::string& what) {
    if (!next_is('"')) fail(what + "dtype is not a string");
    const std::string d = string();
    for (ArrayDType t : accepted_)
      if (d == dtype_name(t)) return t;
    fail(what + "unsupported dtype " + printable(d) + " (dptrain reads " + name_list(accepted_) + ")");
  }

  Entry tensor(const std::string& name) {
    const std::string what = "tensor " + printable(name) + ": ";
    if (!next_is('{')) fail(what + "not an object with dtype, shape and data_offsets");
    Entry e;
    e.name = name;
    bool has_dtype = false, has_shape = false, has_offsets = false;
    auto once = [&](bool& seen, const std::string& key) {
      if (seen) fail(what + "duplicate field " + printable(key));
      seen = true;
    };
    object([&](const std::string& key) {
      if (key == "dtype") {
        once(has_dtype, key);
        e.dtype = dtype(what);
      } else if (key == "shape") {
        once(has_shape, key);
        const std::string problem =
            what + "shape is not a list of at most " + std::to_string(kMaxDims) + " non-negative integers";
        for (uint64_t d : integers(problem, kMaxDims)) {
          if (d > static_cast<uint64_t>(kMaxInt64)) fail(problem);
          e.shape.push_back(static_cast<int64_t>(d));
        }
      } else if (key == "data_offsets") {
        once(has_offsets, key);
        const std::string problem = what + "data_offsets is not [begin, end] (two non-negative integers)";
        const std::vector<uint64_t> o = integers(problem, 2);
        if (o.size() != 2) fail(problem);
        e.begin = o[0], e.end = o[1];
      } else {
        fail(what + "unknown field " + printable(key));
      }
    });
    if (!has_dtype) fail(what + "no dtype");
    if (!has_shape) fail(what + "no shape");
    if (!has_offsets) fail(what + "no data_offsets");
    return e;
  }

  const uint8_t* p_;
  size_t n_;
  const std::vector<ArrayDType>& accepted_;
  const Source& src_;
  size_t pos_ = 0;
};

// Each tensor's offsets lie within the data and span exactly its shape's bytes, and the
// tensors cover the data without overlaps or holes, as the spec requires (so a file
// cannot hide other content in it).
void check_layout(const std::vector<Entry>& entries, uint64_t data_size, const Source& src) {
  for (const Entry& e : entries) {
    const std::string what = "tensor " + printable(e.name) + ": ";
    const std::string offsets = "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "]";
    if (e.begin > e.end) src.fail(what + offsets + " begin after they end");
    if (e.end > data_size)
      src.fail(what + offsets + " run past the end of the data (" + std::to_string(data_size) + " bytes)");
    const int64_t count = element_count(e.shape);
    if (count < 0) src.fail(what + "shape " + shape_text(e.shape) + " has too many elements");
    if (!holds(e.end - e.begin, count, e.dtype))
      src.fail(what + "shape " + shape_text(e.shape) + " of " + dtype_name(e.dtype) + " does not fit " + offsets +
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
    if (e->begin < covered) src.fail("tensors " + printable(prev->name) + " and " + printable(e->name) + " overlap");
    if (e->begin > covered)
      src.fail("data bytes " + std::to_string(covered) + " to " + std::to_string(e->begin) + " belong to no tensor");
    covered = e->end;
    prev = e;
  }
  if (covered != data_size)
    src.fail("data bytes " + std::to_string(covered) + " to " + std::to_string(data_size) +
             " (the end of the file) belong to no tensor");
}

}  // namespace

void Source::fail(const std::string& problem) const {
  const std::string line = what + " '" + file + "': " + problem;
  if (usage_error) throw UsageError(line);
  throw Error(line);
}

const char* dtype_name(ArrayDType t) {
  switch (t) {
    case ArrayDType::f32:
      return "F32";
    case ArrayDType::f64:
      return "F64";
    case ArrayDType::f16:
      return "F16";
    case ArrayDType::bf16:
      return "BF16";
    case ArrayDType::u8:
      return "U8";
    case ArrayDType::i32:
      return "I32";
    case ArrayDType::i64:
      return "I64";
    case ArrayDType::u16:
      return "U16";
    case ArrayDType::u32:
      return "U32";
  }
  return "?";
}

bool holds(uint64_t bytes, int64_t count, ArrayDType t) {
  const size_t size = array_dtype_size(t);
  return bytes % size == 0 && bytes / size == static_cast<uint64_t>(count);
}

namespace {
constexpr uint64_t kP1 = 11400714785074694791ull, kP2 = 14029467366897019727ull, kP3 = 1609587929392839161ull,
                   kP4 = 9650029242287828579ull, kP5 = 2870177450012600261ull;
uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
// Little-endian reads, as the format stores (and every host dptrain builds for is).
uint64_t read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
uint64_t read32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t round64(uint64_t acc, uint64_t input) { return rotl(acc + input * kP2, 31) * kP1; }
uint64_t merge64(uint64_t acc, uint64_t v) { return (acc ^ round64(0, v)) * kP1 + kP4; }
}  // namespace

void Xxh64::update(const uint8_t* p, size_t n) {
  static_assert(std::endian::native == std::endian::little, "xxh64 reads little-endian words");
  if (n == 0) return;  // (p may be null then)
  total_ += n;
  auto stripe = [this](const uint8_t* q) {  // four lanes, 32 bytes a stripe
    for (int lane = 0; lane < 4; ++lane) v_[lane] = round64(v_[lane], read64(q + 8 * lane));
  };
  if (pending_n_ > 0) {
    const size_t take = std::min(n, sizeof pending_ - pending_n_);
    std::memcpy(pending_ + pending_n_, p, take);
    pending_n_ += take, p += take, n -= take;
    if (pending_n_ < sizeof pending_) return;
    stripe(pending_);
    pending_n_ = 0;
  }
  for (; n >= 32; p += 32, n -= 32) stripe(p);
  if (n > 0) std::memcpy(pending_, p, n);
  pending_n_ = n;
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
    for (uint64_t v : v_) h = merge64(h, v);
  } else {
    h = kP5;
  }
  h += total_;
  const uint8_t *p = pending_, *const end = pending_ + pending_n_;
  for (; end - p >= 8; p += 8) h = rotl(h ^ round64(0, read64(p)), 27) * kP1 + kP4;
  if (end - p >= 4) {
    h = rotl(h ^ read32(p) * kP1, 23) * kP2 + kP3;
    p += 4;
  }
  for (; p < end; ++p) h = rotl(h ^ *p * kP5, 11) * kP1;
  h = (h ^ (h >> 33)) * kP2;
  h = (h ^ (h >> 29)) * kP3;
  return h ^ (h >> 32);
}

uint64_t xxh64(const uint8_t* p, size_t n) {
  Xxh64 h;
  h.update(p, n);
  return h.digest();
}

void check_file_size(uint64_t size, const Source& src) {
  if (size < kLenBytes) src.fail("file is " + std::to_string(size) + " bytes, too short for the 8-byte header length");
}

uint64_t header_length(const uint8_t* first8, uint64_t file_size, const Source& src) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | first8[i];
  if (n > kMaxHeader)
    src.fail("header length " + std::to_string(n) + " is over the limit of " + std::to_string(kMaxHeader) + " bytes");
  if (n > file_size - kLenBytes)
    src.fail("header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(file_size) +
             " bytes)");
  return n;
}

Header read_header(const uint8_t* header, uint64_t n, uint64_t file_size, const std::vector<ArrayDType>& accepted,
                   const Source& src) {
  Header h = HeaderReader(header, n, accepted, src).read();
  check_layout(h.entries, file_size - kLenBytes - n, src);
  return h;
}

}  // namespace dpt::data::safetensors
