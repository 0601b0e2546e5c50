#include "common/text.hpp"

#include <cstdio>

namespace dpt {

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

std::string printable(const std::string& s) {
  constexpr size_t kMax = 80;
  size_t len = s.size();
  if (len > kMax) {
    len = kMax;
    while (len > 0 && (static_cast<uint8_t>(s[len]) & 0xC0) == 0x80) --len;  // whole UTF-8 characters
  }
  std::string out = "'";
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  for (size_t i = 0; i < len;) {
    const size_t seq = p[i] >= 0x80 ? utf8_length(p + i, len - i) : 1;  // 0: no UTF-8 sequence starts here
    if (seq == 0 || p[i] < 0x20 || p[i] == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", p[i]);
      out += buf;
      ++i;
    } else {
      out.append(s, i, seq);
      i += seq;
    }
  }
  return out + (len < s.size() ? "...'" : "'");
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

std::vector<std::string> split(const std::string& s, char separator) {
  std::vector<std::string> out;
  for (size_t at = 0;;) {
    const size_t end = s.find(separator, at);
    out.push_back(s.substr(at, end == std::string::npos ? std::string::npos : end - at));
    if (end == std::string::npos) return out;
    at = end + 1;
  }
}

}  // namespace dpt
