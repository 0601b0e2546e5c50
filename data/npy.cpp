#include <dptrain/data/npy.hpp>

#include <cctype>
#include <cstring>
#include <limits>

#include <dptrain/error.hpp>

namespace dpt::data {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicBytes = 6;
// numpy has aligned the data to 64 bytes since 1.14 (for memory mapping and SIMD); the
// files of older versions are aligned to 16, which is also enough for every dtype here.
constexpr uint64_t kAlign = 64, kOldAlign = 16;

struct Descr {
  const char* text;
  ArrayDType dtype;
};
// What numpy writes for each dtype dptrain reads (numpy names uint8 '|u1': one byte has
// no byte order).
constexpr Descr kDescrs[] = {{"<f4", ArrayDType::f32}, {"<f8", ArrayDType::f64}, {"<f2", ArrayDType::f16},
                             {"|u1", ArrayDType::u8},  {"<u2", ArrayDType::u16}, {"<u4", ArrayDType::u32},
                             {"<i4", ArrayDType::i32}, {"<i8", ArrayDType::i64}};
constexpr const char* kDescrList = "'<f4', '<f8', '<f2', '|u1', '<u2', '<u4', '<i4' and '<i8'";

[[noreturn]] void fail(const std::string& name, const std::string& problem) {
  throw UsageError("data file '" + name + "': " + problem);
}

// A string from the file, quoted for a message: only printable ASCII gets this far, but it
// is cut short so that the message stays a line.
std::string quoted(const std::string& s) {
  constexpr size_t kMax = 40;
  return "'" + (s.size() > kMax ? s.substr(0, kMax) + "..." : s) + "'";
}

// The dict of a .npy header: '{' key ':' value (',' key ':' value)* ','? '}', where the
// keys are descr, fortran_order and shape, each once; then spaces and a final '\n'.
// Strings are quoted with ' or " and hold printable ASCII without backslashes (no dtype
// name needs more); integers are decimal, without leading zeros, with the 'L' suffix that
// Python 2's numpy wrote allowed.
class DictReader {
 public:
  DictReader(const uint8_t* p, size_t n, uint64_t offset, const std::string& name)
      : p_(p), n_(n), offset_(offset), name_(name) {}

  void read(NpyHeader& h) {
    if (n_ == 0 || p_[n_ - 1] != '\n') fail(name_, "the header does not end with a newline, as numpy ends it");
    n_ -= 1;  // the '\n' is the terminator, not part of the dict
    skip_ws();
    if (!eat('{')) fail(name_, "the header is not a dict (it must start with '{')");
    bool has_descr = false, has_order = false, has_shape = false;
    skip_ws();
    while (!eat('}')) {
      const std::string key = string("a string key or '}'");
      skip_ws();
      if (!eat(':')) syntax("expected ':'");
      skip_ws();
      auto once = [&](bool& seen) {
        if (seen) fail(name_, "the header has the key " + quoted(key) + " twice");
        seen = true;
      };
      if (key == "descr") {
        once(has_descr);
        h.dtype = descr();
      } else if (key == "fortran_order") {
        once(has_order);
        if (boolean())
          fail(name_, "fortran_order is True: dptrain reads C-order arrays (save np.ascontiguousarray(a))");
      } else if (key == "shape") {
        once(has_shape);
        h.shape = shape();
      } else {
        fail(name_, "the header has the key " + quoted(key) + " (a .npy header holds descr, fortran_order and shape)");
      }
      skip_ws();
      if (eat(',')) {
        skip_ws();
        continue;
      }
      if (!eat('}')) syntax("expected ',' or '}'");
      break;
    }
    skip_ws();
    if (pos_ != n_) syntax("unexpected bytes after the dict");
    if (!has_descr) fail(name_, "the header has no 'descr'");
    if (!has_order) fail(name_, "the header has no 'fortran_order'");
    if (!has_shape) fail(name_, "the header has no 'shape'");
  }

 private:
  [[noreturn]] void syntax(const std::string& what) const {
    fail(name_, "invalid header at byte " + std::to_string(offset_ + pos_) + ": " + what);
  }
  void skip_ws() {
    while (pos_ < n_ && (p_[pos_] == ' ' || p_[pos_] == '\t')) ++pos_;
  }
  bool next_is(char c) const { return pos_ < n_ && p_[pos_] == c; }
  bool eat(char c) {
    if (!next_is(c)) return false;
    ++pos_;
    return true;
  }
  bool eat_word(const char* w) {
    const size_t len = std::strlen(w);
    if (n_ - pos_ < len || std::memcmp(p_ + pos_, w, len) != 0) return false;
    const size_t after = pos_ + len;
    if (after < n_ && (std::isalnum(p_[after]) || p_[after] == '_')) return false;  // "Trueish" is a name
    pos_ = after;
    return true;
  }

  std::string string(const char* expected) {
    if (!next_is('\'') && !next_is('"')) syntax(std::string("expected ") + expected);
    const uint8_t quote = p_[pos_++];
    const size_t start = pos_;
    for (; pos_ < n_ && p_[pos_] != quote; ++pos_) {
      const uint8_t c = p_[pos_];
      if (c < 0x20 || c > 0x7e) syntax("a string holds a byte that is not printable ASCII");
      if (c == '\\') syntax("a string holds a backslash (no .npy header needs escapes)");
    }
    if (pos_ == n_) syntax("unterminated string");
    return std::string(reinterpret_cast<const char*>(p_ + start), pos_++ - start);
  }

  ArrayDType descr() {
    if (next_is('[')) fail(name_, "descr is a list: structured arrays are not supported");
    if (!next_is('\'') && !next_is('"')) fail(name_, "descr is not a string");
    const std::string d = string("a string");
    for (const Descr& k : kDescrs)
      if (d == k.text) return k.dtype;
    if (d.size() == 3 && (d[0] == '>' || d[0] == '!'))
      for (const Descr& k : kDescrs)
        if (k.text[0] == '<' && d.compare(1, 2, k.text + 1) == 0)
          fail(name_, "descr " + quoted(d) + " is big-endian: dptrain reads little-endian data (save a.astype('<" +
                          d.substr(1) + "'))");
    fail(name_, "unsupported dtype " + quoted(d) + " (dptrain reads " + kDescrList + ")");
  }

  bool boolean() {
    if (eat_word("True")) return true;
    if (eat_word("False")) return false;
    fail(name_, "fortran_order is not True or False");
  }

  // A tuple of at most kNpyMaxDims non-negative integers: (), (3,), (3, 4), (3, 4,).
  std::vector<int64_t> shape() {
    const std::string problem =
        "shape is not a tuple of at most " + std::to_string(kNpyMaxDims) + " non-negative integers";
    if (!eat('(')) fail(name_, problem);
    std::vector<int64_t> dims;
    skip_ws();
    bool comma = false;  // whether the last dimension was followed by a comma
    while (!eat(')')) {
      if (!dims.empty() && !comma) syntax("expected ',' or ')'");
      if (dims.size() == kNpyMaxDims) fail(name_, problem);
      dims.push_back(integer(problem));
      skip_ws();
      comma = eat(',');
      skip_ws();
    }
    if (dims.size() == 1 && !comma) fail(name_, problem + " ((3) is not a tuple in Python, (3,) is)");
    return dims;
  }

  int64_t integer(const std::string& problem) {
    auto digit = [&] { return pos_ < n_ && p_[pos_] >= '0' && p_[pos_] <= '9'; };
    if (!digit()) fail(name_, problem);
    if (p_[pos_] == '0' && pos_ + 1 < n_ && p_[pos_ + 1] >= '0' && p_[pos_ + 1] <= '9')
      syntax("number with a leading zero");
    int64_t v = 0;
    for (; digit(); ++pos_) {
      const auto d = static_cast<int64_t>(p_[pos_] - '0');
      if (v > (std::numeric_limits<int64_t>::max() - d) / 10) fail(name_, problem);
      v = v * 10 + d;
    }
    eat('L');
    if (pos_ < n_ && (std::isalnum(p_[pos_]) || p_[pos_] == '.' || p_[pos_] == '_')) fail(name_, problem);
    return v;
  }

  const uint8_t* p_;
  size_t n_;
  uint64_t offset_;  // of the dict in the file, for positions in messages
  const std::string& name_;
  size_t pos_ = 0;
};

}  // namespace

NpyHeader parse_npy_header(const uint8_t* file, uint64_t size, const std::string& name) {
  if (size < kMagicBytes || std::memcmp(file, kMagic, kMagicBytes) != 0)
    fail(name, "not a .npy file (it does not start with \\x93NUMPY)");
  if (size < kMagicBytes + 2) fail(name, "a .npy file cut short: it ends before its format version");
  NpyHeader h;
  h.major = file[kMagicBytes];
  h.minor = file[kMagicBytes + 1];
  if (h.major < 1 || h.major > 3 || h.minor != 0)
    fail(name, "unsupported .npy format version " + std::to_string(h.major) + "." + std::to_string(h.minor) +
                   " (dptrain reads 1.0, 2.0 and 3.0)");
  const uint64_t len_bytes = h.major == 1 ? 2 : 4;
  const uint64_t prefix = kMagicBytes + 2 + len_bytes;
  if (size < prefix)
    fail(name, "file is " + std::to_string(size) + " bytes, too short for a version " + std::to_string(h.major) +
                   ".0 header");
  uint64_t n = 0;
  for (uint64_t i = len_bytes; i-- > 0;) n = n << 8 | file[kMagicBytes + 2 + i];
  if (n > kNpyMaxHeader)
    fail(name,
         "header length " + std::to_string(n) + " is over the limit of " + std::to_string(kNpyMaxHeader) + " bytes");
  if (n > size - prefix)
    fail(name,
         "header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(size) + " bytes)");
  h.data_offset = prefix + n;
  if (h.data_offset % kOldAlign != 0)
    fail(name, "the data starts at byte " + std::to_string(h.data_offset) + ", not a multiple of " +
                   std::to_string(kAlign) + " (or " + std::to_string(kOldAlign) + ") as numpy aligns it");
  // The dict in a buffer of its own: a read past its end is then a sanitizer finding for
  // the fuzzer, not a silent read of the data behind it.
  const std::vector<uint8_t> dict(file + prefix, file + prefix + n);
  DictReader(dict.data(), dict.size(), prefix, name).read(h);
  const int64_t count = element_count(h.shape);
  if (count < 0) fail(name, "shape " + shape_text(h.shape) + " has too many elements");
  const uint64_t have = size - h.data_offset, elem = array_dtype_size(h.dtype);
  if (have % elem != 0 || have / elem != static_cast<uint64_t>(count)) {
    const std::string of = "shape " + shape_text(h.shape) + " of " + array_dtype_name(h.dtype);
    // count * elem may not fit in 64 bits: compare element counts.
    if (have / elem < static_cast<uint64_t>(count))
      fail(name, of + " needs more data than the " + std::to_string(have) + " bytes after the header (truncated?)");
    fail(name, of + " needs " + std::to_string(static_cast<uint64_t>(count) * elem) + " bytes of data, the file has " +
                   std::to_string(have) + " after the header");
  }
  return h;
}

NpyFile::NpyFile(const std::string& path)
    : file_(std::make_shared<const MappedFile>(path)), header_(parse_npy_header(file_->data(), file_->size(), path)) {}

Array NpyFile::array() const { return {file_->data() + header_.data_offset, header_.dtype, header_.shape}; }

std::string npy_header(ArrayDType dtype, const std::vector<int64_t>& shape, int major) {
  const char* descr = nullptr;
  for (const Descr& k : kDescrs)
    if (k.dtype == dtype) descr = k.text;
  if (!descr) throw Error(std::string("npy_header: numpy has no dtype for ") + array_dtype_name(dtype));
  if (element_count(shape) < 0) throw Error("npy_header: invalid shape " + shape_text(shape));
  DPT_CHECK(major >= 0 && major <= 3, "npy_header: version must be 0 (automatic), 1, 2 or 3");
  std::string dict = "{'descr': '" + std::string(descr) + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) dict += (i ? ", " : "") + std::to_string(shape[i]);
  dict += shape.size() == 1 ? ",), }" : "), }";
  auto padded = [&](uint64_t len_bytes) {
    const uint64_t used = kMagicBytes + 2 + len_bytes + dict.size() + 1;  // + the '\n'
    return dict.size() + (kAlign - used % kAlign) % kAlign + 1;
  };
  if (major == 0) major = padded(2) <= 0xffff ? 1 : 2;
  const uint64_t len_bytes = major == 1 ? 2 : 4;
  const uint64_t n = padded(len_bytes);
  if (major == 1 && n > 0xffff) throw Error("npy_header: the header does not fit a version 1.0 file");
  std::string out(kMagic, kMagicBytes);
  out += static_cast<char>(major);
  out += '\0';
  for (uint64_t i = 0; i < len_bytes; ++i) out += static_cast<char>(static_cast<uint8_t>(n >> (8 * i)));
  out += dict;
  out.append(n - dict.size() - 1, ' ');
  out += '\n';
  return out;
}

void write_npy(const ByteSink& sink, const Array& array, int major) {
  const std::string header = npy_header(array.dtype, array.shape, major);
  sink(header.data(), header.size());
  const auto bytes = static_cast<size_t>(element_count(array.shape)) * array_dtype_size(array.dtype);
  if (bytes > 0) sink(array.data, bytes);
}

}  // namespace dpt::data
