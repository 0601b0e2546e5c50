// GPT-2's pre-tokenizer: text cut into the words that byte-pair encoding then works on
// one at a time, as GPT-2's encoder.py cuts it with the regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (its alternatives tried in order at each position, the first that matches taken),
// written as a scanner over UTF-8 code points (classes from bpe_unicode_table.hpp).
// Internal to dpt_data; tests reach it to check the cuts.
#pragma once
#include <string_view>
#include <vector>

namespace dpt::data {

// The words of `text`, in order, which together are the whole text: letters, numbers and
// other characters each in runs, with one space before them joined to the run; the
// contractions 's 't 're 've 'm 'll 'd (lower case); and runs of white space, of which a
// run of k >= 2 before a non-space gives k - 1 (the last joins the word after it, or stands
// alone when it is not a space ' '). Bytes that are not UTF-8 are each a character of the
// "other" class (as punctuation is), so any bytes have words and encode.
std::vector<std::string_view> gpt2_words(std::string_view text);

}  // namespace dpt::data
