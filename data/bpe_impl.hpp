// What a Bpe holds (include/dptrain/data/bpe.hpp): its tables, read by bpe_load.cpp, and
// the cache of words that bpe.cpp's encoder fills. Internal to dpt_data.
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <dptrain/data/bpe.hpp>

namespace dpt::data {

struct Bpe::Impl {
  std::string dir;                       // for messages
  std::vector<std::string> token_bytes;  // by id: the bytes each token stands for
  int32_t byte_token[256] = {};          // the id of each byte's own token

  // The merges, by the pair of ids they join (left << 32 | right); rank: the line's place
  // in vocab.bpe (lower merges first).
  struct Merge {
    int32_t rank, result;
  };
  std::unordered_map<uint64_t, Merge> merges;
  const Merge* merge_of(int32_t left, int32_t right) const {
    const auto it = merges.find(static_cast<uint64_t>(left) << 32 | static_cast<uint32_t>(right));
    return it == merges.end() ? nullptr : &it->second;
  }

  // The ids of one word (byte-pair merging of its bytes' tokens).
  std::vector<int32_t> merge_word(std::string_view word) const;

  // Words already encoded, at most kCachedWords of them (then it starts again), so that a
  // text of many distinct words holds no more than that.
  static constexpr size_t kCachedWords = size_t{1} << 16;
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  // Loading (bpe_load.cpp): encoder.json fills token_bytes and byte_token and gives each
  // token's id by its bytes, which vocab.bpe's merges are read with.
  std::unordered_map<std::string, int32_t> read_encoder(const std::string& path);
  void read_merges(const std::string& path, const std::unordered_map<std::string, int32_t>& id_of);
};

}  // namespace dpt::data
