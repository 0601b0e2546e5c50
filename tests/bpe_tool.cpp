// bpe_tool: dpt::data::Bpe for tests/bpe_interop.py, strings in and ids out in files.
//   bpe_tool encode DIR IN OUT
// IN holds strings, each a uint32 byte count then the bytes; OUT gets, for each, a uint32
// id count then the ids (int32), all little-endian. Each encoding is decoded again and
// must give the string back (else exit 1). Errors: one line on stderr, exit 2.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <dptrain/data/bpe.hpp>
#include <dptrain/error.hpp>

namespace {

uint32_t read_u32(const std::string& in, size_t& at) {
  if (in.size() - at < 4) throw dpt::UsageError("bpe_tool: input cut short");
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = v << 8 | static_cast<uint8_t>(in[at + static_cast<size_t>(i)]);
  at += 4;
  return v;
}

void write_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out += static_cast<char>(v >> (8 * i) & 0xFF);
}

int encode(const std::string& dir, const std::string& in_path, const std::string& out_path) {
  const dpt::data::Bpe bpe = dpt::data::Bpe::load(dir);
  std::ifstream in_file(in_path, std::ios::binary);
  const std::string in((std::istreambuf_iterator<char>(in_file)), std::istreambuf_iterator<char>());
  std::string out;
  for (size_t at = 0; at < in.size();) {
    const uint32_t n = read_u32(in, at);
    if (in.size() - at < n) throw dpt::UsageError("bpe_tool: input cut short");
    const std::string text = in.substr(at, n);
    at += n;
    const std::vector<int32_t> ids = bpe.encode(text);
    if (bpe.decode(ids) != text) {
      std::fprintf(stderr, "bpe_tool: decode(encode(s)) != s for s of %u bytes at offset %zu\n", n, at - n);
      return 1;
    }
    write_u32(out, static_cast<uint32_t>(ids.size()));
    for (int32_t id : ids) write_u32(out, static_cast<uint32_t>(id));
  }
  std::ofstream(out_path, std::ios::binary) << out;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 5 && std::string(argv[1]) == "encode") return encode(argv[2], argv[3], argv[4]);
    std::fprintf(stderr, "usage: bpe_tool encode DIR IN OUT\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bpe_tool: %s\n", e.what());
    return 2;
  }
}
