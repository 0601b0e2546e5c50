// The JSON that dptrain's file formats hold (a safetensors header, a tokenizer's
// encoder.json), read strictly by a reader written for each format on this base: it
// gives the pieces (objects, strings unescaped and checked to be UTF-8, non-negative
// integers, lists of them, whitespace) and the format's reader composes them in the fixed
// nesting its schema allows, so no input can make it recurse deeply or build a large tree.
// A format's reader says how its errors read: syntax(what) for bytes that are not JSON,
// fail(problem) for JSON of the wrong shape; both throw.
//
// Header-only (the bodies are inline in the class) so that the fuzzers, which build the
// parsers' sources on their own, need no other file.
#pragma once
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/text.hpp"

namespace dpt::data {

class JsonReader {
 protected:
  JsonReader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  virtual ~JsonReader() = default;
  JsonReader(const JsonReader&) = delete;
  JsonReader& operator=(const JsonReader&) = delete;

  [[noreturn]] virtual void fail(const std::string& problem) const = 0;
  [[noreturn]] virtual void syntax(const std::string& what) const = 0;

  size_t pos() const { return pos_; }  // the next byte's offset
  bool at_end() const { return pos_ == n_; }
  bool first_byte_is(char c) const { return n_ > 0 && p_[0] == c; }  // with no whitespace before it

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

 private:
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
      uint32_t digit = 0;
      if (c >= '0' && c <= '9') digit = static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') digit = static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') digit = static_cast<uint32_t>(c - 'A' + 10);
      else syntax("invalid \\u escape");
      v = v << 4 | digit;
    }
    return v;
  }

  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

}  // namespace dpt::data
