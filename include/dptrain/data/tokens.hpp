// Token data for language models: llm.c's token shards and 1-D .npy files of tokens, read
// as windows of T + 1 tokens.
//
// A shard (llm.c's dev/data format, as its data scripts write them) is a header of 256
// little-endian int32 (header[0] the magic, header[1] the version, header[2] the number of
// tokens), then the tokens: magic 20240520 with version 1 holds uint16 tokens (GPT-2's
// vocabulary), magic 20240801 with version 7 uint32 (larger vocabularies). A .npy file of
// tokens is a 1-D array of uint8, uint16, uint32, int32 or int64 (npy.hpp reads it). Files
// are memory-mapped, never read whole: pages come in as windows are gathered.
//
// Window i of a file of n tokens covers its tokens i*T .. i*T+T: the inputs are the first
// T, the targets the last T (each input's next token). So a file has (n - 1) / T windows,
// windows never cross files, and a batch of B windows in file order is B*T + 1 consecutive
// tokens, as llm.c's loader reads them. Rows number the windows of the files in their order.
//
// Hostile files are refused with one UsageError line naming the file: a bad magic or
// version, a count that disagrees with the file's size, a file shorter than one window, a
// .npy that is not a 1-D array of integers; and a token outside the model's vocabulary
// (check_model gives it) or beyond int32 as the window holding it is first gathered, by
// its position in the file (no pass over the whole file at load; a DataError).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <dptrain/data/array.hpp>
#include <dptrain/data/dataset.hpp>
#include <dptrain/data/npy.hpp>

namespace dpt::data {

// llm.c's shard header: 256 int32; the magic and version of each token width.
inline constexpr int64_t kShardHeaderInts = 256;
inline constexpr int32_t kShardMagicU16 = 20240520, kShardVersionU16 = 1;
inline constexpr int32_t kShardMagicU32 = 20240801, kShardVersionU32 = 7;

// The files that `patterns` name, pattern by pattern: each expanded by glob(3), its
// matches sorted (so train_000.bin comes before train_001.bin). A pattern that matches no
// file is a UsageError naming it; a path without wildcards names itself when it exists.
std::vector<std::string> expand_data_patterns(const std::vector<std::string>& patterns);

namespace detail {
struct TokenFile;   // one mapped file of tokens (tokens.cpp)
struct TokenFiles;  // the files, their windows, the vocabulary and which windows are checked
}  // namespace detail

// Writes `tokens` as an llm.c shard to `sink`: version 1 (uint16) when `uint32` is false
// (every token must then be below 65536), else version 7 (uint32). For tests and tools.
void write_token_shard(const ByteSink& sink, std::span<const uint32_t> tokens, bool uint32);

class TokenDataset : public Dataset {
 public:
  // The windows of `seq_len` (T) tokens of `paths`, in that order (a caller expands
  // patterns with expand_data_patterns). Each file is mapped and its header checked.
  TokenDataset(const std::vector<std::string>& paths, int64_t seq_len);

  int64_t rows() const override { return rows_; }
  Shape input_shape() const override { return {seq_len_}; }
  DType input_dtype() const override { return DType::i32; }
  bool has_targets() const override { return true; }
  Task task() const override { return Task::language_model; }
  Shape target_shape() const override { return {seq_len_}; }
  // "token file 'train_000.bin'", or "token files 'train_000.bin' ... 'train_009.bin' (10)".
  std::string inputs_name() const override { return name_; }
  std::string targets_name() const override { return name_; }
  // Windows as int32 tokens into x_i32 and labels (the next tokens), each window's T + 1
  // tokens checked against the vocabulary the first time it is gathered.
  void gather_host(std::span<const int64_t> rows, const HostRows& into) const override;
  // The inputs must be rows of {T} tokens for a language model; `outputs` is the model's
  // vocabulary, which the gathers check tokens against from now on (call it before
  // gathering, not while gathers run).
  void check_model(const Shape& input, Task task, int64_t outputs) const override;
  // Every window's tokens against the vocabulary (Dataset::check_every_row).
  void check_every_row() const override;
  bool concurrent_gathers() const override { return true; }
  // "windows of 64 tokens, (from window 100, )a file of 2048 bytes with header hash
  // 0123456789abcdef, ...": the hash covers each file's header and its first 4 KiB of
  // tokens (llm.c's headers differ only in their counts, which shards of one data set
  // often share).
  std::string origin() const override;

  // Windows [first, first + count) of this data set, sharing its files.
  TokenDataset slice(int64_t first, int64_t count) const;

  int64_t seq_len() const { return seq_len_; }
  // Tokens in all the files (every window included or not).
  int64_t tokens() const;
  const std::vector<FileIdentity>& files() const;
  // Where this data set's windows start among the files' (a slice's offset).
  int64_t first_row() const { return first_; }

 private:
  // The file holding window `window` (of all the files) and the window's first token in it.
  std::pair<const detail::TokenFile*, int64_t> locate(int64_t window) const;
  // Throws DataError naming the first token of window `window` (of `file`, from token
  // `at`) outside [0, vocabulary), unless that window was checked before.
  void check_window(const detail::TokenFile& file, int64_t window, int64_t at) const;

  std::shared_ptr<detail::TokenFiles> shared_;
  int64_t seq_len_ = 0, first_ = 0, rows_ = 0;
  std::string name_;
};

}  // namespace dpt::data
