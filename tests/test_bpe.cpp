// GPT-2's tokenizer (<dptrain/data/bpe.hpp>) on a hand-made one in tests/fixtures/bpe: GPT-2's
// 256 byte tokens (its ids 0..255), 31 merges (ids 256..286, in vocab.bpe's order) and
// <|endoftext|> (287). The pre-tokenizer's cuts, encodings worked out by hand (the rounds
// of merges as GPT-2's encoder.py makes them, also where a merge's pair ranks before the
// merge that makes its part), round trips of any bytes, text streamed a token at a time,
// and every hostile file refused in one line. The real GPT-2 files: tests/bpe_interop.py.
#include <climits>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <dptrain/data/bpe.hpp>
#include <dptrain/error.hpp>

#include "catch.hpp"
#include "common.hpp"
#include "data/bpe_words.hpp"

using namespace dpt;
using namespace dpt::data;
using test::usage_error;

namespace {

const std::string kFixture = std::string(DPT_TEST_FIXTURES) + "/bpe";

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// A tokenizer folder in `dir` with these two files.
std::string write_tokenizer(const test::TempDir& dir, const std::string& encoder, const std::string& merges) {
  std::ofstream(dir.file("encoder.json"), std::ios::binary) << encoder;
  std::ofstream(dir.file("vocab.bpe"), std::ios::binary) << merges;
  return dir.path.string();
}

std::vector<std::string> words(std::string_view text) {
  std::vector<std::string> out;
  for (std::string_view w : gpt2_words(text)) out.emplace_back(w);
  return out;
}

// GPT-2's encoder.py's bpe() as it is written, on strings: each round merges every
// occurrence of the pair that ranks first, left to right.
std::vector<std::string> reference_bpe(const std::string& word,
                                       const std::map<std::pair<std::string, std::string>, int>& rank) {
  std::vector<std::string> w;
  for (char c : word) w.emplace_back(1, c);
  while (w.size() > 1) {
    const std::pair<std::string, std::string>* best = nullptr;
    int best_rank = INT_MAX;
    std::vector<std::pair<std::string, std::string>> pairs;
    for (size_t i = 0; i + 1 < w.size(); ++i) pairs.emplace_back(w[i], w[i + 1]);
    for (const auto& p : pairs)
      if (const auto it = rank.find(p); it != rank.end() && it->second < best_rank) best = &p, best_rank = it->second;
    if (!best) break;
    std::vector<std::string> merged;
    for (size_t i = 0; i < w.size();) {
      if (i + 1 < w.size() && w[i] == best->first && w[i + 1] == best->second) {
        merged.push_back(w[i] + w[i + 1]);
        i += 2;
      } else {
        merged.push_back(w[i++]);
      }
    }
    w = merged;
  }
  return w;
}

// Ids of the fixture's byte tokens, as GPT-2 numbers them: the printable bytes from '!' (0).
int32_t b(char c) { return static_cast<uint8_t>(c) - '!'; }
constexpr int32_t kSpace = 220, kNewline = 198;  // 'Ġ' and 'Ċ'

}  // namespace

TEST_CASE("bpe: GPT-2's pre-tokenizer cuts as its regex does", "[bpe]") {
  using V = std::vector<std::string>;
  CHECK(words("Hello world") == V{"Hello", " world"});
  CHECK(words("") == V{});
  // Contractions, lower case only, even inside a word; a quote otherwise joins punctuation.
  CHECK(words("don't you're I'll 'sound") == V{"don", "'t", " you", "'re", " I", "'ll", " '", "sound"});
  CHECK(words("IT'S it's ''s") == V{"IT", "'", "S", " it", "'s", " ''", "s"});
  // One space joins the run after it; a run of k >= 2 white spaces before a non-space
  // gives k - 1 and its last joins the next word, or stands alone when it is not ' '.
  CHECK(words("a  b") == V{"a", " ", " b"});
  CHECK(words("a \n b") == V{"a", " \n", " b"});
  CHECK(words("a\n\nb") == V{"a", "\n", "\n", "b"});
  CHECK(words("\t\tx") == V{"\t", "\t", "x"});
  CHECK(words("x   ") == V{"x", "   "});  // at the end: the whole run
  CHECK(words("\n\n") == V{"\n\n"});
  CHECK(words(" ") == V{" "});
  // Letters, numbers and the rest in runs of their own class, from any script.
  CHECK(words("abc123!?x") == V{"abc", "123", "!?", "x"});
  CHECK(words("日本語 テスト ٣٤ x² \u00a0y") == V{"日本語", " テスト", " ٣٤", " x", "²", " ", "\u00a0", "y"});
  CHECK(words("a\u3000b") == V{"a", "\u3000", "b"});  // an ideographic space is white space, not ' '
  CHECK(words("e\u0301") == V{"e", "\u0301"});        // a combining mark is of the rest
  CHECK(words("a\x1c b") == V{"a", "\x1c", " b"});    // U+001C is no \s (str.isspace() says it is)
  // Bytes that are not UTF-8 are characters of the rest, one each.
  CHECK(words("a\xff\xfe b \x80") == V{"a", "\xff\xfe", " b", " \x80"});
  CHECK(words("\xc3") == V{"\xc3"});
}

TEST_CASE("bpe: the fixture's encodings, worked out by hand", "[bpe]") {
  const Bpe bpe = Bpe::load(kFixture);
  CHECK(bpe.vocab_size() == 288);
  // "Hello": l l (rank 10) first, then H e (16), He ll (17), Hell o (18).
  // " world": Ġ w (11), o r (12), Ġw or (13), l d (14), Ġwor ld (15).
  CHECK(bpe.encode("Hello world") == std::vector<int32_t>{274, 271});
  CHECK(bpe.encode("the") == std::vector<int32_t>{b('t'), 257});  // no merge of t and he
  CHECK(bpe.encode(" the") == std::vector<int32_t>{258});         // Ġ t (0), h e (1), Ġt he (2)
  // Every pair of a round, left to right: a a a -> aa a; a a a a -> aa aa -> aaaa.
  CHECK(bpe.encode("aaa") == std::vector<int32_t>{278, b('a')});
  CHECK(bpe.encode("aaaa") == std::vector<int32_t>{279});
  CHECK(bpe.encode("aaaaa") == std::vector<int32_t>{279, b('a')});
  // "bc b" ranks before "b c": after the round of b c, bcbc is bc bc (encoder.py), not the
  // bcb c that merging one pair at a time would give.
  CHECK(bpe.encode("bcbc") == std::vector<int32_t>{282, 282});
  CHECK(bpe.encode("bcb") == std::vector<int32_t>{281});
  // " 123": 1 2 (rank 20) before Ġ 1 (30), so Ġ stays alone: Ġ 12 3 -> Ġ 123.
  CHECK(bpe.encode(" 123") == std::vector<int32_t>{kSpace, 277});
  // Multi-byte characters: é is Ã © (bytes C3 A9); 🎉 is ð Ł İ ī (F0 9F 8E 89).
  CHECK(bpe.encode("café") == std::vector<int32_t>{b('c'), b('a'), b('f'), 280});
  CHECK(bpe.encode("🎉🎉") == std::vector<int32_t>{285, 285});
  CHECK(bpe.encode("it's IT'S") == std::vector<int32_t>{b('i'), b('t'), 264, kSpace, b('I'), b('T'), b('\''), b('S')});
  CHECK(bpe.encode("a  b") == std::vector<int32_t>{b('a'), kSpace, kSpace, b('b')});
  CHECK(bpe.encode("x   ") == std::vector<int32_t>{b('x'), 263, kSpace});  // ĠĠ (7) then Ġ
  CHECK(bpe.encode("\n\n") == std::vector<int32_t>{275});
  CHECK(bpe.encode("a\n\nb") == std::vector<int32_t>{b('a'), kNewline, kNewline, b('b')});
  // <|endoftext|> is a token of the vocabulary, but text never encodes to it.
  CHECK(bpe.decode({287}) == "<|endoftext|>");
  std::vector<int32_t> bytes_of_eot;
  for (char c : std::string("<|endoftext|>")) bytes_of_eot.push_back(b(c));  // no merge applies
  CHECK(bpe.encode("<|endoftext|>") == bytes_of_eot);
  CHECK(bpe.encode("").empty());
  // A word seen before comes from the cache, with the same ids.
  CHECK(bpe.encode("Hello Hello Hello") == std::vector<int32_t>{274, kSpace, 274, kSpace, 274});
}

TEST_CASE("bpe: the merges are encoder.py's rounds on random words", "[bpe]") {
  const Bpe bpe = Bpe::load(kFixture);
  // The fixture's merges of ASCII letters (the others never apply to these words).
  std::map<std::pair<std::string, std::string>, int> rank;
  std::istringstream lines(read_text(kFixture + "/vocab.bpe"));
  std::string line;
  std::getline(lines, line);  // #version
  for (int r = 0; std::getline(lines, line); ++r)
    rank[{line.substr(0, line.find(' ')), line.substr(line.find(' ') + 1)}] = r;
  std::mt19937 rng(51);
  const std::string alphabet = "abcHelo";
  for (int trial = 0; trial < 2000; ++trial) {
    std::string word(1 + rng() % 30, ' ');
    for (char& c : word) c = alphabet[rng() % alphabet.size()];
    std::vector<std::string> ours;
    for (int32_t id : bpe.encode(word)) ours.push_back(bpe.token_bytes(id));
    INFO(word);
    REQUIRE(ours == reference_bpe(word, rank));
  }
}

TEST_CASE("bpe: decode(encode(s)) is s for any bytes", "[bpe]") {
  const Bpe bpe = Bpe::load(kFixture);
  const std::vector<std::string> texts = {
      "Hello world, the café's 🎉!",
      "naïve résumé 日本語 Ελληνικά русский 👨‍👩‍👧 🇫🇷",
      "  \t\n\n  x\r\n\u00a0\u3000 ",
      "\n\n",
      "don't you're I'll we've I'm he'd 'S 'LL",
      "12345 6.02e23 ٣٤ ²",
      "!!!???...---",
      "\xff\xfe\x80 a\xc3 \xe2\x82",
      std::string("nul\0byte", 8)};
  for (const std::string& s : texts) {
    INFO(s);
    CHECK(bpe.decode(bpe.encode(s)) == s);
  }
  std::string every_byte;
  for (int c = 0; c < 256; ++c) every_byte += static_cast<char>(c);
  CHECK(bpe.decode(bpe.encode(every_byte)) == every_byte);
  // A long word is merged in n log n, not n^2: 200000 letters.
  const std::string long_word(200000, 'a');
  const std::vector<int32_t> ids = bpe.encode(long_word);
  CHECK(ids == std::vector<int32_t>(50000, 279));
  CHECK(bpe.decode(ids) == long_word);
}

TEST_CASE("bpe: text streamed a token at a time holds a character until it is whole", "[bpe]") {
  const Bpe bpe = Bpe::load(kFixture);
  // Byte tokens: F0 is 'ð' (172), 9F 'Ł' (253), 8E 'İ' (236), 89 'ī' (231); C3 'Ã' (127),
  // A9 '©' (102); the lone continuation byte 80 is 'Ģ' (222).
  CHECK(bpe.decode({172, 253, 236, 231}) == "🎉");
  BpeTextStream stream(bpe);
  CHECK(stream.push(274) == "Hello");
  CHECK(stream.push(172).empty());
  CHECK(stream.push(253).empty());
  CHECK(stream.push(236).empty());
  CHECK(stream.push(231) == "🎉");
  CHECK(stream.push(127).empty());
  CHECK(stream.push(102) == "é");
  // Bytes no character can be made of: U+FFFD for each maximal piece, as Python's
  // decode(errors="replace") gives; a character cut short at the end, U+FFFD too.
  CHECK(stream.push(283).empty());                // ðŁ: F0 9F, a start
  CHECK(stream.push(b('x')) == "\xef\xbf\xbdx");  // F0 9F x
  CHECK(stream.push(222) == "\xef\xbf\xbd");      // a continuation byte alone
  CHECK(stream.push(127).empty());
  CHECK(stream.finish() == "\xef\xbf\xbd");
  CHECK(stream.finish().empty());
  CHECK(usage_error([&] { stream.push(288); }) ==
        "tokenizer '" + kFixture + "': token id 288 is outside its vocabulary [0, 288)");
  CHECK(usage_error([&] {
          bpe.decode({1, -1});
        }) == "tokenizer '" + kFixture + "': token id -1 is outside its vocabulary [0, 288)");
}

TEST_CASE("bpe: a hostile tokenizer folder is refused in one line naming it", "[bpe]") {
  const std::string encoder = read_text(kFixture + "/encoder.json"), merges = read_text(kFixture + "/vocab.bpe");
  test::TempDir tmp;
  const std::string dir = tmp.path.string(), enc = dir + "/encoder.json", voc = dir + "/vocab.bpe";
  auto refusal = [&](const std::string& e, const std::string& m) {
    write_tokenizer(tmp, e, m);
    return usage_error([&] { Bpe::load(dir); });
  };
  // Folders and files.
  CHECK(usage_error([&] { Bpe::load(dir + "/none"); }) ==
        "tokenizer '" + dir + "/none': cannot open: No such file or directory");
  CHECK(usage_error([&] { Bpe::load(""); }) == "tokenizer '': an empty path");
  CHECK(usage_error([&] { Bpe::load(kFixture + "/vocab.bpe"); }) ==
        "tokenizer '" + kFixture +
            "/vocab.bpe': not a folder (a GPT-2 tokenizer is a folder with encoder.json and vocab.bpe)");
  CHECK(usage_error([&] { Bpe::load(dir); }) == "tokenizer '" + dir +
                                                    "': no encoder.json in it (No such file or directory); a GPT-2 "
                                                    "tokenizer is a folder with encoder.json and vocab.bpe");
  std::ofstream(enc) << encoder;
  CHECK(usage_error([&] { Bpe::load(dir); }).find("tokenizer '" + dir + "': no vocab.bpe in it") == 0);
  std::filesystem::remove(enc);
  std::filesystem::create_directory(enc);
  CHECK(usage_error([&] { Bpe::load(dir); }) == "tokenizer '" + enc + "': not a regular file");
  std::filesystem::remove(enc);
  // encoder.json: JSON, an object of token strings to ids 0..N-1.
  CHECK(refusal("[1, 2]", merges) == "tokenizer '" + enc + "': not a JSON object of token strings to ids");
  CHECK(refusal(encoder.substr(0, 100), merges) ==
        "tokenizer '" + enc + "': invalid JSON at byte 100: expected a string key");
  CHECK(refusal(encoder + "x", merges) == "tokenizer '" + enc + "': invalid JSON at byte " +
                                              std::to_string(encoder.size()) + ": unexpected bytes after the object");
  CHECK(refusal("{\"a\": \"1\"}", merges) ==
        "tokenizer '" + enc + "': the id of token 'a' is not an integer from 0 to 2147483646");
  CHECK(refusal("{\"a\": -1}", merges).find("the id of token 'a' is not an integer") != std::string::npos);
  CHECK(refusal("{\"a\": 1.5}", merges).find("the id of token 'a' is not an integer") != std::string::npos);
  CHECK(refusal("{\"a\": 2147483647}", merges).find("the id of token 'a' is not an integer") != std::string::npos);
  CHECK(refusal("{\"a\": 0, \"b\": 0}", merges) == "tokenizer '" + enc + "': tokens 'a' and 'b' have the same id 0");
  CHECK(refusal("{\"a\": 0, \"a\": 1}", merges) == "tokenizer '" + enc + "': token 'a' is given twice");
  CHECK(refusal("{}", merges) == "tokenizer '" + enc + "': no tokens");
  CHECK(refusal("{\"a\": 0, \"b\": 2}", merges) ==
        "tokenizer '" + enc + "': the ids are not 0 to 1 (one for each of its 2 tokens): token 'b' has id 2");
  CHECK(refusal("{\"a b\": 0}", merges) ==
        "tokenizer '" + enc + "': token 'a b' is not made of GPT-2's byte characters (bytes_to_unicode)");
  CHECK(refusal("{\"\": 0}", merges).find("token '' is not made of") != std::string::npos);
  // Without the token of byte 'a' (id 64), the ids after it move down one.
  std::string no_a = encoder;
  no_a.replace(no_a.find("\"a\": 64, "), 9, "");
  for (int id = 65; id < 288; ++id) {
    const std::string from = ": " + std::to_string(id), to = ": " + std::to_string(id - 1);
    const size_t at = no_a.find(from + ",") != std::string::npos ? no_a.find(from + ",") : no_a.find(from + "}");
    no_a.replace(at, from.size(), to);
  }
  CHECK(refusal(no_a, merges) ==
        "tokenizer '" + enc + "': no token for byte 0x61 ('a'): byte-level BPE needs one for each of the 256 bytes");
  // vocab.bpe: lines of two tokens separated by a space, whose merge is a token, each once.
  CHECK(refusal(encoder, merges + "Hello\n") ==
        "tokenizer '" + voc + "': line 33: 'Hello' is not a merge (two tokens separated by a space)");
  CHECK(refusal(encoder, merges + "a b c\n").find("line 33: 'a b c' is not a merge") != std::string::npos);
  CHECK(refusal(encoder, merges + " a\n").find("line 33: ' a' is not a merge") != std::string::npos);
  CHECK(refusal(encoder, "#version: 0.2\nH e\n\nl l\n").find("line 3: '' is not a merge") != std::string::npos);
  CHECK(refusal(encoder, merges + "x y\n") == "tokenizer '" + voc + "': line 33: 'xy' is not a token of encoder.json");
  CHECK(refusal(encoder, merges + "x \xc4\xa0\n") ==
        "tokenizer '" + voc + "': line 33: 'xĠ' is not a token of encoder.json");
  CHECK(refusal(encoder, merges + "a zz\n") == "tokenizer '" + voc + "': line 33: 'zz' is not a token of encoder.json");
  CHECK(refusal(encoder, merges + "l l\n") ==
        "tokenizer '" + voc + "': line 33: the merge of 'l' and 'l' is on line 12 already");
  // What may vary: no "#version" line, Windows line ends, no final newline, trailing blank lines.
  CHECK(refusal(encoder, "l l\r\nH e\r\nHe ll\r\nHell o") == "");
  CHECK(Bpe::load(dir).encode("Hello") == std::vector<int32_t>{274});
  CHECK(refusal(encoder, merges + "\n\n") == "");
}
