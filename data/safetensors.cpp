#include "safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>

#include <dptrain/error.hpp>

#include "common/text.hpp"
#include "data/array_dtypes.hpp"
#include "data/json_reader.hpp"

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

class HeaderReader final : public JsonReader {
 public:
  HeaderReader(const uint8_t* p, size_t n, const std::vector<ArrayDType>& accepted, const Source& src)
      : JsonReader(p, n), accepted_(accepted), src_(src) {}

  Header read() {
    // The spec asks for '{' as the very first byte (no leading whitespace).
    if (!first_byte_is('{')) fail("header is not a JSON object (it must start with '{')");
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
    if (!at_end()) syntax("unexpected bytes after the header object");
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& problem) const override { src_.fail(problem); }
  [[noreturn]] void syntax(const std::string& what) const override {
    fail("invalid header JSON at byte " + std::to_string(kLenBytes + pos()) + ": " + what);
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

  const std::vector<ArrayDType>& accepted_;
  const Source& src_;
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

const char* dtype_name(ArrayDType t) { return array_dtype_info(t).safetensors; }

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
