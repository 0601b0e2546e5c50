// Helpers shared by the data tests (test_data.cpp, test_data_files.cpp): files written and
// read whole, .npy and safetensors files made by hand, the message a .npy header gets,
// and every row of a data set gathered on the host.
#pragma once
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include <dptrain/data/array.hpp>
#include <dptrain/data/dataset.hpp>
#include <dptrain/data/npy.hpp>
#include <dptrain/data/tokens.hpp>
#include <dptrain/error.hpp>
#include "catch.hpp"
#include "common.hpp"

namespace dpt::test_data {

using namespace dpt::data;
using test::usage_error;

inline const Device kCpu{DeviceType::cpu, 0};

inline void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// `tokens` written as an llm.c shard at `path` (uint32 or uint16 tokens).
inline void write_shard(const std::string& path, const std::vector<uint32_t>& tokens, bool uint32) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  write_token_shard(
      [&](const void* p, size_t n) { out.write(static_cast<const char*>(p), static_cast<std::streamsize>(n)); }, tokens,
      uint32);
}

inline std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

template <class T>
inline std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <class T>
inline Array array_of(const std::vector<T>& v, ArrayDType dtype, std::vector<int64_t> shape) {
  return {v.data(), dtype, std::move(shape)};
}

inline std::vector<uint8_t> npy_bytes(const Array& a, int major = 0) {
  std::vector<uint8_t> out;
  write_npy(
      [&](const void* p, size_t n) {
        out.insert(out.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
      },
      a, major);
  return out;
}

inline void write_npy_file(const std::string& path, const Array& a, int major = 0) {
  write_file(path, npy_bytes(a, major));
}

// A .npy file made by hand: the magic, version major.minor, the length, `dict` padded
// with spaces (and ended by '\n' when `newline`) so that the data starts at a multiple of
// `align`, then `data` zero bytes.
inline std::vector<uint8_t> npy_of(const std::string& dict, size_t data, int major = 1, size_t align = 64,
                                   bool newline = true, int minor = 0) {
  const size_t len_bytes = major == 1 ? 2 : 4;
  const size_t prefix = 8 + len_bytes;
  std::string header = dict;
  const size_t used = prefix + header.size() + (newline ? 1 : 0);
  header.append((align - used % align) % align, ' ');
  if (newline) header += '\n';
  std::vector<uint8_t> b = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<uint8_t>(major), static_cast<uint8_t>(minor)};
  for (size_t i = 0; i < len_bytes; ++i) b.push_back(static_cast<uint8_t>(header.size() >> (8 * i)));
  b.insert(b.end(), header.begin(), header.end());
  b.resize(b.size() + data, 0);
  return b;
}

inline std::string dict_of(const std::string& descr, const std::string& shape, const std::string& order = "False") {
  return "{'descr': '" + descr + "', 'fortran_order': " + order + ", 'shape': " + shape + ", }";
}

// The message parse_npy_header gives for `bytes` ("" when it reads them); reading them from
// a file must say the same, and every message is one UsageError line naming the file.
inline std::string npy_error(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::string from_memory, from_file;
  try {
    parse_npy_header(bytes.data(), bytes.size(), path);
  } catch (const UsageError& e) {
    from_memory = e.what();
  }
  write_file(path, bytes);
  try {
    NpyFile f(path);
  } catch (const UsageError& e) {
    from_file = e.what();
  }
  CHECK(from_file == from_memory);
  if (!from_file.empty()) {
    CHECK(from_file.rfind("data file '" + path + "': ", 0) == 0);
    CHECK(from_file.find('\n') == std::string::npos);
  }
  return from_file;
}

// A safetensors file made by hand: tensors (name, dtype, shape, bytes) back to back.
using Tensor_ = std::tuple<std::string, std::string, std::vector<int64_t>, std::vector<uint8_t>>;
inline std::vector<uint8_t> safetensors_of(const std::vector<Tensor_>& tensors) {
  std::string h = "{";
  std::vector<uint8_t> data;
  for (const auto& [name, dtype, shape, bytes] : tensors) {
    if (h.size() > 1) h += ",";
    h += "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":[";
    for (size_t i = 0; i < shape.size(); ++i) h += (i ? "," : "") + std::to_string(shape[i]);
    h += "],\"data_offsets\":[" + std::to_string(data.size()) + "," + std::to_string(data.size() + bytes.size()) + "]}";
    data.insert(data.end(), bytes.begin(), bytes.end());
  }
  h += "}";
  h.append((8 - h.size() % 8) % 8, ' ');
  std::vector<uint8_t> b;
  for (int i = 0; i < 8; ++i) b.push_back(static_cast<uint8_t>(static_cast<uint64_t>(h.size()) >> (8 * i)));
  b.insert(b.end(), h.begin(), h.end());
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

// Every row of `d`, gathered on the host.
inline std::vector<float> all_x(const Dataset& d) {
  std::vector<int64_t> rows(static_cast<size_t>(d.rows()));
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<float> x(rows.size() * static_cast<size_t>(numel(d.input_shape())));
  d.gather_host(rows, {x.data(), nullptr, nullptr});
  return x;
}

inline std::vector<int32_t> all_labels(const Dataset& d) {
  std::vector<int64_t> rows(static_cast<size_t>(d.rows()));
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<int32_t> y(rows.size());
  d.gather_host(rows, {nullptr, nullptr, y.data()});
  return y;
}

inline std::vector<float> all_y(const Dataset& d) {
  std::vector<int64_t> rows(static_cast<size_t>(d.rows()));
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<float> y(rows.size() * static_cast<size_t>(numel(d.target_shape())));
  d.gather_host(rows, {nullptr, y.data(), nullptr});
  return y;
}

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

}  // namespace dpt::test_data
