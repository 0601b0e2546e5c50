// Text that several folders write or read: UTF-8 (RFC 3629) decoded and encoded, strings
// quoted for one-line messages and for JSON. Internal to the project (not installed).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dpt {

// Length of the valid UTF-8 character at p (n > 0 bytes available), or 0: overlong forms,
// surrogates and code points past U+10FFFF are invalid (RFC 3629).
size_t utf8_length(const uint8_t* p, size_t n);
// Code point `cp` (a Unicode scalar value) appended to `out` in UTF-8.
void append_utf8(std::string& out, uint32_t cp);
bool valid_utf8(const std::string& s);

// A string from a file, quoted for an error message: control bytes and bytes that are not
// UTF-8 escaped as \xNN (the message stays one line of text) and long strings cut short.
std::string printable(const std::string& s);

// `s` as a JSON string literal, quotes and escapes included (for JSON this project writes).
std::string json_quote(const std::string& s);

// The pieces of `s` between the separators, empty ones included ("a,,b" -> a, "", b).
std::vector<std::string> split(const std::string& s, char separator);

}  // namespace dpt
