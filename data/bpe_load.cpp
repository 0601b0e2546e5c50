// A GPT-2 tokenizer folder read strictly: encoder.json and vocab.bpe (bpe.hpp says what
// each holds and what is refused).
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <map>
#include <string_view>
#include <unordered_map>

#include <dptrain/data/array.hpp>
#include <dptrain/data/bpe.hpp>
#include <dptrain/error.hpp>

#include "common/text.hpp"
#include "data/bpe_impl.hpp"
#include "data/json_reader.hpp"

namespace dpt::data {
namespace {

// GPT-2's bytes_to_unicode: each byte stands for a printable character in the token
// strings, the printable Latin-1 bytes ('!' to '~', U+00A1 to U+00AC, U+00AE to U+00FF)
// for themselves and the others, in order, for U+0100 onwards (the space 0x20: U+0120 'Ġ').
struct ByteChars {
  static constexpr uint32_t kEnd = 0x100 + 68;  // past the last stand-in (68 bytes are not printable)
  uint32_t char_of[256] = {};
  int16_t byte_of[kEnd] = {};  // -1: no byte's character

  ByteChars() {
    for (int16_t& b : byte_of) b = -1;
    uint32_t shifted = 0x100;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      char_of[b] = printable ? b : shifted++;
      byte_of[char_of[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteChars& byte_chars() {
  static const ByteChars table;
  return table;
}

// The bytes a token string stands for; false when it holds a character that is no byte's.
bool to_bytes(const std::string& token, std::string& bytes) {
  bytes.clear();
  const auto* p = reinterpret_cast<const uint8_t*>(token.data());
  for (size_t i = 0; i < token.size();) {
    const size_t len = utf8_length(p + i, token.size() - i);
    if (len == 0 || len > 2) return false;  // every stand-in is below U+0800
    const uint32_t cp = len == 1 ? p[i] : (p[i] & 0x1Fu) << 6 | (p[i + 1] & 0x3Fu);
    if (cp >= ByteChars::kEnd || byte_chars().byte_of[cp] < 0) return false;
    bytes += static_cast<char>(static_cast<uint8_t>(byte_chars().byte_of[cp]));
    i += len;
  }
  return true;
}

[[noreturn]] void fail(const std::string& where, const std::string& problem) {
  throw UsageError("tokenizer '" + where + "': " + problem);
}

// DIR/NAME, refused unless it is a regular file (a FIFO is never opened).
std::string file_in(const std::string& dir, const char* name) {
  const std::string path = dir + "/" + name;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    fail(dir, std::string("no ") + name + " in it (" + std::strerror(errno) +
                  "); a GPT-2 tokenizer is a folder with encoder.json and vocab.bpe");
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
  return path;
}

// encoder.json: one object, each token's string to its id.
class EncoderReader final : public JsonReader {
 public:
  explicit EncoderReader(const MappedFile& file) : JsonReader(file.data(), file.size()), path_(file.path()) {}

  std::map<int64_t, std::string> read() {
    std::map<int64_t, std::string> token_of;
    std::map<std::string, int64_t> seen;
    if (!next_is('{')) fail("not a JSON object of token strings to ids");
    object([&](const std::string& key) {
      const std::string problem = "the id of token " + printable(key) + " is not an integer from 0 to 2147483646";
      const uint64_t id = integer(problem);
      if (id >= INT32_MAX) fail(problem);
      if (!seen.emplace(key, id).second) fail("token " + printable(key) + " is given twice");
      const auto [it, fresh] = token_of.emplace(static_cast<int64_t>(id), key);
      if (!fresh)
        fail("tokens " + printable(it->second) + " and " + printable(key) + " have the same id " + std::to_string(id));
    });
    skip_ws();
    if (!at_end()) syntax("unexpected bytes after the object");
    return token_of;
  }

 private:
  [[noreturn]] void fail(const std::string& problem) const override { data::fail(path_, problem); }
  [[noreturn]] void syntax(const std::string& what) const override {
    fail("invalid JSON at byte " + std::to_string(pos()) + ": " + what);
  }
  std::string path_;
};

}  // namespace

std::unordered_map<std::string, int32_t> Bpe::Impl::read_encoder(const std::string& path) {
  const MappedFile file(path);
  const std::map<int64_t, std::string> token_of = EncoderReader(file).read();
  if (token_of.empty()) fail(path, "no tokens");
  if (const int64_t last = token_of.rbegin()->first; last != static_cast<int64_t>(token_of.size()) - 1)
    fail(path, "the ids are not 0 to " + std::to_string(token_of.size() - 1) + " (one for each of its " +
                   std::to_string(token_of.size()) + " tokens): token " + printable(token_of.rbegin()->second) +
                   " has id " + std::to_string(last));
  std::unordered_map<std::string, int32_t> id_of;
  for (int32_t& t : byte_token) t = -1;
  std::string bytes;
  for (const auto& [id, token] : token_of) {
    if (token.empty() || !to_bytes(token, bytes))
      fail(path, "token " + printable(token) + " is not made of GPT-2's byte characters (bytes_to_unicode)");
    if (bytes.size() == 1) byte_token[static_cast<uint8_t>(bytes[0])] = static_cast<int32_t>(id);
    id_of.emplace(bytes, static_cast<int32_t>(id));
    token_bytes.push_back(bytes);
  }
  for (uint32_t b = 0; b < 256; ++b)
    if (byte_token[b] < 0) {
      std::string c;
      append_utf8(c, byte_chars().char_of[b]);
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", b);
      fail(path, std::string("no token for byte ") + hex + " ('" + c +
                     "'): byte-level BPE needs one for each of the 256 bytes");
    }
  return id_of;
}

void Bpe::Impl::read_merges(const std::string& path, const std::unordered_map<std::string, int32_t>& id_of) {
  const MappedFile file(path);
  const std::string_view text(reinterpret_cast<const char*>(file.data()), file.size());
  std::vector<std::string_view> lines;
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    lines.push_back(text.substr(at, end - at));
    at = end + 1;
  }
  for (std::string_view& line : lines)
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);  // a file written on Windows
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  const size_t first = !lines.empty() && lines[0].substr(0, 8) == "#version" ? 1 : 0;
  if (lines.size() - first >= INT32_MAX) fail(path, "more merges than ranks of 32 bits");
  merges.reserve(lines.size() - first);
  std::string bytes;
  for (size_t i = first; i < lines.size(); ++i) {
    const std::string where = "line " + std::to_string(i + 1) + ": ";
    const std::string_view line = lines[i];
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || space == 0 || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string_view::npos)
      fail(path, where + printable(std::string(line)) + " is not a merge (two tokens separated by a space)");
    const std::string a(line.substr(0, space)), b(line.substr(space + 1));
    auto id = [&](const std::string& token) {
      const auto it = to_bytes(token, bytes) ? id_of.find(bytes) : id_of.end();
      if (it == id_of.end()) fail(path, where + printable(token) + " is not a token of encoder.json");
      return it->second;
    };
    const int32_t a_id = id(a), b_id = id(b), ab_id = id(a + b);
    const uint64_t key = static_cast<uint64_t>(a_id) << 32 | static_cast<uint32_t>(b_id);
    const auto [it, fresh] = merges.emplace(key, Merge{static_cast<int32_t>(merges.size()), ab_id});
    if (!fresh)  // the first one's rank is its place among the merges
      fail(path, where + "the merge of " + printable(a) + " and " + printable(b) + " is on line " +
                     std::to_string(static_cast<size_t>(it->second.rank) + first + 1) + " already");
  }
}

Bpe Bpe::load(const std::string& dir) {
  struct stat st {};
  if (dir.empty()) fail(dir, "an empty path");
  if (::stat(dir.c_str(), &st) != 0) fail(dir, std::string("cannot open: ") + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) fail(dir, "not a folder (a GPT-2 tokenizer is a folder with encoder.json and vocab.bpe)");
  auto impl = std::make_shared<Impl>();
  impl->dir = dir;
  const auto id_of = impl->read_encoder(file_in(dir, "encoder.json"));
  impl->read_merges(file_in(dir, "vocab.bpe"), id_of);
  return Bpe(std::move(impl));
}

}  // namespace dpt::data
