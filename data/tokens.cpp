#include <dptrain/data/tokens.hpp>

#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>

#include <dptrain/error.hpp>

namespace dpt::data {

namespace {

constexpr uint64_t kShardHeaderBytes = kShardHeaderInts * 4;
// Bytes of tokens a file's identity hashes beside its header.
constexpr uint64_t kIdentityTokenBytes = 4096;
// Tokens are int32 on a device: without a vocabulary this is the bound they are checked
// against.
constexpr int64_t kTokenLimit = int64_t{std::numeric_limits<int32_t>::max()} + 1;

template <class T>
T load(const uint8_t* p) {  // unaligned: an old .npy aligns its data to 16 bytes only
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A file's fault, bad input; E = DataError for a row's, found as it is gathered.
template <class E = UsageError>
[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw E("data file '" + path + "': " + problem);
}

// f(T{}) for the C++ type T of a token file's element type.
template <class F>
decltype(auto) with_token_type(ArrayDType t, F&& f) {
  switch (t) {
    case ArrayDType::u8:
      return f(uint8_t{});
    case ArrayDType::u16:
      return f(uint16_t{});
    case ArrayDType::u32:
      return f(uint32_t{});
    case ArrayDType::i32:
      return f(int32_t{});
    default:
      return f(int64_t{});
  }
}

}  // namespace

namespace detail {

struct TokenFile {
  std::shared_ptr<const MappedFile> mapping;
  const uint8_t* tokens = nullptr;  // the first token
  ArrayDType dtype = ArrayDType::u16;
  int64_t count = 0;    // tokens
  int64_t windows = 0;  // (count - 1) / T

  const std::string& path() const { return mapping->path(); }
  int64_t token(int64_t k) const {
    return with_token_type(dtype, [&](auto zero) {
      using T = decltype(zero);
      return static_cast<int64_t>(load<T>(tokens + sizeof(T) * static_cast<size_t>(k)));
    });
  }
};

struct TokenFiles {
  std::vector<TokenFile> files;
  std::vector<FileIdentity> identities;
  std::vector<int64_t> window_end;  // windows of files 0..i together
  // The model's vocabulary (0: none given yet, tokens are then checked against int32).
  std::atomic<int64_t> vocabulary{0};
  // A bit a window of all the files: its tokens were found inside the vocabulary. A window
  // is checked when first gathered, not at every epoch (shared by slices).
  std::unique_ptr<std::atomic<uint64_t>[]> checked;
  size_t checked_words = 0;
};

}  // namespace detail

namespace {

using File = detail::TokenFile;

// An llm.c shard: its header checked against its magic, version and the file's size.
void read_shard(File& f) {
  const std::string& path = f.path();
  const uint64_t size = f.mapping->size();
  const uint8_t* p = f.mapping->data();
  const int32_t magic = size >= 4 ? load<int32_t>(p) : 0;
  if (magic != kShardMagicU16 && magic != kShardMagicU32)
    fail(path, (size >= 4 ? "its magic is " + std::to_string(magic) : std::to_string(size) + " bytes") +
                   ": not an llm.c token shard (magic " + std::to_string(kShardMagicU16) + ": uint16 tokens, " +
                   std::to_string(kShardMagicU32) + ": uint32) nor a .npy file");
  if (size < kShardHeaderBytes)
    fail(path, std::to_string(size) + " bytes, shorter than a token shard's " + std::to_string(kShardHeaderBytes) +
                   "-byte header");
  const bool wide = magic == kShardMagicU32;
  const int32_t version = load<int32_t>(p + 4), want = wide ? kShardVersionU32 : kShardVersionU16;
  if (version != want)
    fail(path, "version " + std::to_string(version) + " with magic " + std::to_string(magic) + ": llm.c's " +
                   (wide ? "uint32" : "uint16") + " token shards are version " + std::to_string(want));
  f.dtype = wide ? ArrayDType::u32 : ArrayDType::u16;
  const int64_t count = load<int32_t>(p + 8);
  const uint64_t bytes = size - kShardHeaderBytes, width = array_dtype_size(f.dtype);
  if (count < 0) fail(path, "its header counts " + std::to_string(count) + " tokens");
  if (bytes != static_cast<uint64_t>(count) * width)
    fail(path, "its header counts " + std::to_string(count) + " tokens (" +
                   std::to_string(count * static_cast<int64_t>(width)) + " bytes of " + array_dtype_name(f.dtype) +
                   "), but " + std::to_string(bytes) + " bytes follow its " + std::to_string(kShardHeaderBytes) +
                   "-byte header");
  f.tokens = p + kShardHeaderBytes;
  f.count = count;
}

// A .npy file of tokens: a 1-D array of integers. Returns where its data starts.
uint64_t read_npy_tokens(File& f) {
  const NpyHeader h = parse_npy_header(f.mapping->data(), f.mapping->size(), f.path());
  const std::string is = std::string(array_dtype_name(h.dtype)) + " " + shape_text(h.shape);
  if (!is_integer(h.dtype))
    fail(f.path(), "holds " + is + ", not integer tokens (a .npy of tokens is uint8, uint16, uint32, int32 or int64)");
  if (h.shape.size() != 1) fail(f.path(), "is " + is + ", not a 1-D array of tokens");
  f.dtype = h.dtype;
  f.tokens = f.mapping->data() + h.data_offset;
  f.count = h.shape[0];
  return h.data_offset;
}

bool is_npy(const MappedFile& m) {
  static constexpr char kMagic[] = "\x93NUMPY";
  return m.size() >= 6 && std::memcmp(m.data(), kMagic, 6) == 0;
}

// "token file 'a.bin'", "token files 'a.bin' and 'b.bin'", "token files 'a.bin' ... 'j.bin' (10)".
std::string files_name(const std::vector<std::string>& paths) {
  if (paths.size() == 1) return "token file '" + paths[0] + "'";
  const std::string ends =
      "token files '" + paths.front() + "'" + (paths.size() == 2 ? " and '" : " ... '") + paths.back() + "'";
  return paths.size() == 2 ? ends : ends + " (" + std::to_string(paths.size()) + ")";
}

}  // namespace

std::vector<std::string> expand_data_patterns(const std::vector<std::string>& patterns) {
  std::vector<std::string> files;
  std::map<std::pair<dev_t, ino_t>, std::string> seen;  // each file once (a link or another spelling included)
  for (const std::string& pattern : patterns) {
    glob_t g{};
    // Sorted here, bytewise, not by glob's strcoll: the order must not depend on a locale.
    const int rc = ::glob(pattern.c_str(), GLOB_NOSORT, nullptr, &g);
    std::vector<std::string> matches;
    if (rc == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) matches.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    if (rc == GLOB_NOMATCH) throw UsageError("data files '" + pattern + "': no file matches");
    if (rc != 0)
      throw UsageError("data files '" + pattern + "': cannot list them (" +
                       (rc == GLOB_NOSPACE ? "out of memory" : "a directory could not be read") + ")");
    std::sort(matches.begin(), matches.end());
    for (const std::string& m : matches) {
      struct stat st {};
      if (::stat(m.c_str(), &st) != 0) continue;  // opening it names the fault
      const auto [at, fresh] = seen.try_emplace({st.st_dev, st.st_ino}, m);
      if (!fresh)
        throw UsageError("data files: " +
                         (m == at->second ? "'" + m + "' is" : "'" + at->second + "' and '" + m + "' are one file,") +
                         " named twice by the patterns; each file is read once");
    }
    files.insert(files.end(), matches.begin(), matches.end());
  }
  return files;
}

void write_token_shard(const ByteSink& sink, std::span<const uint32_t> tokens, bool uint32) {
  DPT_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
            "write_token_shard: more tokens than a shard's header can count");
  std::vector<int32_t> header(static_cast<size_t>(kShardHeaderInts), 0);
  header[0] = uint32 ? kShardMagicU32 : kShardMagicU16;
  header[1] = uint32 ? kShardVersionU32 : kShardVersionU16;
  header[2] = static_cast<int32_t>(tokens.size());
  sink(header.data(), header.size() * sizeof(int32_t));
  if (uint32) {
    if (!tokens.empty()) sink(tokens.data(), tokens.size() * sizeof(uint32_t));
    return;
  }
  std::vector<uint16_t> narrow(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    DPT_CHECK(tokens[i] <= 0xffffu,
              "write_token_shard: token " + std::to_string(tokens[i]) + " does not fit a uint16 shard (version 1)");
    narrow[i] = static_cast<uint16_t>(tokens[i]);
  }
  if (!narrow.empty()) sink(narrow.data(), narrow.size() * sizeof(uint16_t));
}

TokenDataset::TokenDataset(const std::vector<std::string>& paths, int64_t seq_len)
    : shared_(std::make_shared<detail::TokenFiles>()), seq_len_(seq_len) {
  if (paths.empty()) throw UsageError("TokenDataset: no token files");
  if (seq_len < 1) throw UsageError("TokenDataset: windows of " + std::to_string(seq_len) + " tokens (T must be >= 1)");
  name_ = files_name(paths);
  for (const std::string& path : paths) {
    detail::TokenFile f;
    f.mapping = std::make_shared<const MappedFile>(path);
    const uint64_t data_offset = is_npy(*f.mapping) ? read_npy_tokens(f) : (read_shard(f), kShardHeaderBytes);
    if (f.count < seq_len + 1)
      fail(path, "holds " + std::to_string(f.count) + " tokens, fewer than a window of " + std::to_string(seq_len + 1) +
                     " (" + std::to_string(seq_len) + " inputs and the token after them)");
    f.windows = (f.count - 1) / seq_len;
    rows_ += f.windows;
    shared_->window_end.push_back(rows_);
    shared_->identities.push_back(
        file_identity(*f.mapping, std::min(f.mapping->size(), data_offset + kIdentityTokenBytes)));
    shared_->files.push_back(std::move(f));
  }
  shared_->checked_words = static_cast<size_t>((rows_ + 63) / 64);
  shared_->checked.reset(new std::atomic<uint64_t>[shared_->checked_words]());
}

std::pair<const detail::TokenFile*, int64_t> TokenDataset::locate(int64_t window) const {
  const std::vector<int64_t>& end = shared_->window_end;
  const auto i = static_cast<size_t>(std::upper_bound(end.begin(), end.end(), window) - end.begin());
  const int64_t first_window = i == 0 ? 0 : end[i - 1];
  return {&shared_->files[i], (window - first_window) * seq_len_};
}

void TokenDataset::check_window(const detail::TokenFile& file, int64_t window, int64_t at) const {
  std::atomic<uint64_t>& word = shared_->checked[static_cast<size_t>(window / 64)];
  const uint64_t bit = uint64_t(1) << (window % 64);
  if (word.load(std::memory_order_relaxed) & bit) return;
  const int64_t vocabulary = shared_->vocabulary.load(std::memory_order_relaxed);
  const int64_t limit = vocabulary > 0 ? vocabulary : kTokenLimit;
  const int64_t bad = with_token_type(file.dtype, [&](auto zero) -> int64_t {
    using T = decltype(zero);
    const uint8_t* p = file.tokens + sizeof(T) * static_cast<size_t>(at);
    for (int64_t k = 0; k <= seq_len_; ++k) {
      const auto v = static_cast<int64_t>(load<T>(p + sizeof(T) * static_cast<size_t>(k)));
      if (v < 0 || v >= limit) return k;
    }
    return -1;
  });
  if (bad >= 0) {
    const int64_t v = file.token(at + bad);
    fail<DataError>(file.path(),
                    "token " + std::to_string(at + bad) + " is " + std::to_string(v) + ", outside " +
                        (vocabulary > 0 ? "[0, " + std::to_string(vocabulary) + "): the model's vocabulary has " +
                                              std::to_string(vocabulary) + " tokens"
                                        : "[0, " + std::to_string(kTokenLimit) + "): tokens are int32"));
  }
  word.fetch_or(bit, std::memory_order_relaxed);
}

void TokenDataset::gather_host(std::span<const int64_t> rows, const HostRows& into) const {
  if (!shared_) throw UsageError("a TokenDataset without its files (it was moved from)");
  DPT_CHECK(!into.x && !into.y, "TokenDataset::gather_host: tokens are gathered as int32 (x_i32, labels)");
  const auto T = static_cast<size_t>(seq_len_);
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t r = rows[i];
    if (r < 0 || r >= rows_)
      throw Error("TokenDataset::gather_host: row " + std::to_string(r) + " is outside [0, " + std::to_string(rows_) +
                  ")");
    const auto [file, at] = locate(first_ + r);
    check_window(*file, first_ + r, at);
    // The window's tokens at..at+T: the inputs are its first T, the targets its last T.
    with_token_type(file->dtype, [&](auto zero) {
      using E = decltype(zero);
      const uint8_t* p = file->tokens + sizeof(E) * static_cast<size_t>(at);
      if (into.x_i32)
        for (size_t k = 0; k < T; ++k) into.x_i32[i * T + k] = static_cast<int32_t>(load<E>(p + sizeof(E) * k));
      if (into.labels)
        for (size_t k = 0; k < T; ++k) into.labels[i * T + k] = static_cast<int32_t>(load<E>(p + sizeof(E) * (k + 1)));
    });
  }
}

void TokenDataset::check_model(const Shape& input, Task task, int64_t outputs) const {
  Dataset::check_model(input, task, outputs);
  if (outputs < 1) throw UsageError(name_ + ": a vocabulary of " + std::to_string(outputs) + " tokens");
  // Windows checked against another vocabulary are checked again.
  if (shared_->vocabulary.exchange(outputs) != outputs)
    for (size_t w = 0; w < shared_->checked_words; ++w) shared_->checked[w].store(0, std::memory_order_relaxed);
}

void TokenDataset::check_every_row() const {
  if (!shared_) throw UsageError("a TokenDataset without its files (it was moved from)");
  for (int64_t r = first_; r < first_ + rows_; ++r) {
    const auto [file, at] = locate(r);
    check_window(*file, r, at);
  }
}

std::string TokenDataset::origin() const {
  const std::string from = first_ > 0 ? "from window " + std::to_string(first_) + ", " : "";
  return "windows of " + std::to_string(seq_len_) + " tokens, " + from + identities_text(shared_->identities);
}

TokenDataset TokenDataset::slice(int64_t first, int64_t count) const {
  if (first < 0 || count < 1 || first > rows_ - count)
    throw UsageError(name_ + ": windows [" + std::to_string(first) + ", " + std::to_string(first + count) +
                     ") are not a slice of its " + std::to_string(rows_) + " windows");
  TokenDataset d = *this;
  d.first_ = first_ + first;
  d.rows_ = count;
  return d;
}

int64_t TokenDataset::tokens() const {
  int64_t n = 0;
  for (const detail::TokenFile& f : shared_->files) n += f.count;
  return n;
}

const std::vector<FileIdentity>& TokenDataset::files() const { return shared_->identities; }

}  // namespace dpt::data
