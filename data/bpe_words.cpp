#include "data/bpe_words.hpp"

#include <algorithm>
#include <cstdint>

#include "common/text.hpp"
#include "data/bpe_unicode_table.hpp"

namespace dpt::data {
namespace {

using bpe_unicode::CharClass;

CharClass class_of(uint32_t cp) {
  if (cp < 0x80) {  // the common case, without the search
    if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return bpe_unicode::kLetter;
    if (cp >= '0' && cp <= '9') return bpe_unicode::kNumber;
    if (cp == ' ' || (cp >= '\t' && cp <= '\r')) return bpe_unicode::kSpace;
    return bpe_unicode::kOther;
  }
  const auto* end = std::end(bpe_unicode::kRanges);
  const auto* r = std::upper_bound(std::begin(bpe_unicode::kRanges), end, cp,
                                   [](uint32_t c, const bpe_unicode::Range& range) { return c < range.first; });
  if (r == std::begin(bpe_unicode::kRanges)) return bpe_unicode::kOther;
  --r;
  return cp <= r->last ? r->char_class : bpe_unicode::kOther;
}

// The text as code points: each character's class and where it ends.
class Scanner {
 public:
  explicit Scanner(std::string_view text) : p_(reinterpret_cast<const uint8_t*>(text.data())), n_(text.size()) {}

  size_t size() const { return n_; }
  uint8_t byte(size_t at) const { return p_[at]; }

  // The character at byte `at` (< size()) ends at end(at) and is of class cls(at); a byte
  // that begins no valid UTF-8 sequence is a character of its own, of the other class.
  size_t end(size_t at) const {
    const size_t len = utf8_length(p_ + at, n_ - at);
    return at + (len == 0 ? 1 : len);
  }
  CharClass cls(size_t at) const {
    const size_t len = utf8_length(p_ + at, n_ - at);
    if (len == 0) return bpe_unicode::kOther;
    uint32_t cp = len == 1 ? p_[at] : p_[at] & (0x7Fu >> len);
    for (size_t i = 1; i < len; ++i) cp = cp << 6 | (p_[at + i] & 0x3Fu);
    return class_of(cp);
  }
  // Where the run of characters of class `c` that starts at `at` ends.
  size_t run_end(size_t at, CharClass c) const {
    while (at < n_ && cls(at) == c) at = end(at);
    return at;
  }

 private:
  const uint8_t* p_;
  size_t n_;
};

// The length of the contraction ('s 't 're 've 'm 'll 'd) at `at`, or 0.
size_t contraction(const Scanner& s, size_t at) {
  if (s.byte(at) != '\'' || at + 1 >= s.size()) return 0;
  const uint8_t a = s.byte(at + 1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (at + 2 >= s.size()) return 0;
  const uint8_t b = s.byte(at + 2);
  return (a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l') ? 3 : 0;
}

// Where the word that starts at `at` ends.
size_t word_end(const Scanner& s, size_t at) {
  if (const size_t n = contraction(s, at)) return at + n;
  // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+": the optional space is ' ' alone.
  const size_t first = s.byte(at) == ' ' && at + 1 < s.size() ? at + 1 : at;
  const CharClass c = s.cls(first);
  if (c != bpe_unicode::kSpace) return s.run_end(first, c);
  // "\s+(?!\S)": the run of white space, less its last character when a non-space follows
  // (the lookahead fails at the run's end and the match backs off one), unless that leaves
  // nothing; then "\s+": the whole run, one character.
  const size_t end = s.run_end(at, bpe_unicode::kSpace);
  if (end == s.size()) return end;
  size_t last = at;
  for (size_t i = at; i < end; i = s.end(i)) last = i;
  return last > at ? last : end;
}

}  // namespace

std::vector<std::string_view> gpt2_words(std::string_view text) {
  const Scanner s(text);
  std::vector<std::string_view> words;
  for (size_t at = 0; at < text.size();) {
    const size_t end = word_end(s, at);
    words.push_back(text.substr(at, end - at));
    at = end;
  }
  return words;
}

}  // namespace dpt::data
