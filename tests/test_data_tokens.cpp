// Token data for language models (<dptrain/data/tokens.hpp>): llm.c shards of both
// versions and 1-D .npy files of tokens read as windows of T+1 tokens; a batch in file
// order is B*T+1 consecutive tokens and windows never cross files; every hostile file is
// refused with one line naming it (a bad token when its window is gathered, by position);
// patterns expand sorted; the origin tells files apart; a CPU replica's feeder and the
// ahead loader deliver the exact tokens, as int32 inputs and next-token targets; synthetic
// tokens are the ones the host made before a kernel made them.
// On the GPU: the ahead loader's and a direct gather's tokens on the device; synthetic
// tokens made on the device equal the CPU's.

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <dptrain/data/dataset.hpp>
#include <dptrain/data/npy.hpp>
#include <dptrain/data/shuffle.hpp>
#include <dptrain/data/synthetic.hpp>
#include <dptrain/data/tokens.hpp>
#include <dptrain/error.hpp>
#include <dptrain/runtime/context.hpp>

#include "catch.hpp"
#include "common.hpp"
#include "data/ahead_loader.hpp"
#include "data/feeder.hpp"
#include "data_common.hpp"
#include "kernels/cpu/cpu.hpp"

using namespace dpt;
using namespace dpt::data;
using test::usage_error;
using test_data::write_shard;

namespace {

// n tokens, token k = (k * 7919 + offset) % modulus: no two neighbours alike.
std::vector<uint32_t> tokens_of(size_t n, uint32_t modulus, uint32_t offset = 0) {
  std::vector<uint32_t> t(n);
  for (size_t k = 0; k < n; ++k) t[k] = static_cast<uint32_t>((k * 7919 + offset) % modulus);
  return t;
}

}  // namespace

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

namespace {

void write_bytes(const std::string& path, const void* bytes, size_t n) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
}

// Window `i` of `tokens` as int32 inputs and next-token targets.
std::pair<std::vector<int32_t>, std::vector<int32_t>> window(const std::vector<uint32_t>& tokens, size_t i, size_t T) {
  std::vector<int32_t> x, y;
  for (size_t k = 0; k < T; ++k) {
    x.push_back(static_cast<int32_t>(tokens[i * T + k]));
    y.push_back(static_cast<int32_t>(tokens[i * T + k + 1]));
  }
  return {x, y};
}

std::pair<std::vector<int32_t>, std::vector<int32_t>> gathered(const Dataset& d, std::vector<int64_t> rows) {
  const Batch b = d.empty_batch(static_cast<int64_t>(rows.size()), test::host);
  d.gather(rows, b);
  return {b.x.to_host_i32(), b.y.to_host_i32()};
}

void write_npy_file(const std::string& path, const Array& a) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  write_npy([&](const void* p, size_t n) { out.write(static_cast<const char*>(p), static_cast<std::streamsize>(n)); },
            a);
}

// A shard made by hand: header ints 0..2 as given, then `token_bytes` bytes of tokens.
void write_raw_shard(const std::string& path, int32_t magic, int32_t version, int32_t count, size_t token_bytes) {
  std::vector<uint8_t> bytes(kShardHeaderInts * 4 + token_bytes, 0);
  const int32_t head[3] = {magic, version, count};
  std::memcpy(bytes.data(), head, sizeof head);
  write_bytes(path, bytes.data(), bytes.size());
}

}  // namespace

TEST_CASE("llm.c shards of both versions are windows of T+1 tokens: inputs and next-token targets", "[data][tokens]") {
  test::TempDir dir;
  const std::vector<uint32_t> narrow = tokens_of(53, 50257), wide = tokens_of(53, 4000000, 70000);
  for (bool uint32 : {false, true}) {
    INFO((uint32 ? "version 7 (uint32)" : "version 1 (uint16)"));
    const std::vector<uint32_t>& tokens = uint32 ? wide : narrow;
    write_shard(dir.file("a.bin"), tokens, uint32);
    const TokenDataset d({dir.file("a.bin")}, 8);
    CHECK(d.rows() == 6);  // (53 - 1) / 8
    CHECK(d.tokens() == 53);
    CHECK(d.seq_len() == 8);
    CHECK(d.input_shape() == Shape{8});
    CHECK(d.input_dtype() == DType::i32);
    CHECK(d.has_targets());
    CHECK(d.task() == Task::language_model);
    CHECK(d.target_shape() == Shape{8});
    CHECK(d.concurrent_gathers());
    const Batch e = d.empty_batch(3, test::host);
    CHECK((e.x.dtype() == DType::i32 && e.x.shape() == Shape{3, 8}));
    CHECK((e.y.dtype() == DType::i32 && e.y.shape() == Shape{3, 8}));
    for (int64_t i = 0; i < d.rows(); ++i) {
      INFO("window " << i);
      const auto want = window(tokens, static_cast<size_t>(i), 8);
      const auto got = gathered(d, {i});
      CHECK(got.first == want.first);
      CHECK(got.second == want.second);
    }
    // Straight into host memory, inputs or targets alone.
    std::vector<int32_t> x(16, -1), y(16, -1);
    d.gather_host(std::vector<int64_t>{5, 0}, {nullptr, nullptr, nullptr, x.data()});
    d.gather_host(std::vector<int64_t>{5, 0}, {nullptr, nullptr, y.data(), nullptr});
    CHECK(std::vector<int32_t>(x.begin(), x.begin() + 8) == window(tokens, 5, 8).first);
    CHECK(std::vector<int32_t>(y.begin() + 8, y.end()) == window(tokens, 0, 8).second);
    CHECK_THROWS_AS(d.gather_host(std::vector<int64_t>{6}, {nullptr, nullptr, y.data(), nullptr}), Error);
    std::vector<float> f(8);
    CHECK_THROWS_AS(d.gather_host(std::vector<int64_t>{0}, {f.data(), nullptr, nullptr, nullptr}), Error);
  }
  CHECK_THROWS_AS(write_shard(dir.file("b.bin"), {1, 70000}, false), Error);  // not a uint16
}

TEST_CASE("a batch in file order is B*T+1 consecutive tokens; windows never cross files", "[data][tokens]") {
  test::TempDir dir;
  // Three shards of 53, 17 and 9 tokens: 6, 2 and 1 windows of 8.
  const std::vector<std::vector<uint32_t>> shards = {tokens_of(53, 50257), tokens_of(17, 50257, 11),
                                                     tokens_of(9, 50257, 23)};
  std::vector<std::string> paths;
  for (size_t s = 0; s < shards.size(); ++s) {
    paths.push_back(dir.file("train_" + std::to_string(s) + ".bin"));
    write_shard(paths.back(), shards[s], s == 1);
  }
  const TokenDataset d(paths, 8);
  CHECK(d.rows() == 9);
  CHECK(d.tokens() == 79);
  // Windows 0..4 of the first shard: 5 * 8 inputs, then the one target after them.
  const Batch b = d.batch(0, 5, test::host);
  const std::vector<int32_t> x = b.x.to_host_i32(), y = b.y.to_host_i32();
  for (size_t k = 0; k < 40; ++k) CHECK(x[k] == static_cast<int32_t>(shards[0][k]));
  for (size_t k = 0; k < 40; ++k) CHECK(y[k] == static_cast<int32_t>(shards[0][k + 1]));
  // Window 5 is the first shard's last (tokens 40..48; 49..52 are in no window), window 6
  // the second shard's first, window 8 the third's only.
  CHECK(gathered(d, {5}).first == window(shards[0], 5, 8).first);
  CHECK(gathered(d, {6}).first == window(shards[1], 0, 8).first);
  CHECK(gathered(d, {7}).second == window(shards[1], 1, 8).second);
  CHECK(gathered(d, {8}).second == window(shards[2], 0, 8).second);
  // Any list of rows, repeats included, in any order.
  const auto many = gathered(d, {8, 0, 6, 6});
  CHECK(std::vector<int32_t>(many.first.begin(), many.first.begin() + 8) == window(shards[2], 0, 8).first);
  CHECK(std::vector<int32_t>(many.first.begin() + 24, many.first.end()) == window(shards[1], 0, 8).first);
  // A slice: windows of the same files, from where it starts.
  const TokenDataset s = d.slice(5, 3);
  CHECK(s.rows() == 3);
  CHECK(s.first_row() == 5);
  CHECK(gathered(s, {1}).first == window(shards[1], 0, 8).first);
  CHECK(usage_error([&] { (void)d.slice(8, 2); }).find("windows [8, 10) are not a slice of its 9 windows") !=
        std::string::npos);
}

TEST_CASE("1-D .npy files of integer tokens, beside shards", "[data][tokens]") {
  test::TempDir dir;
  const std::vector<uint32_t> tokens = tokens_of(41, 250);
  const std::vector<uint8_t> u8(tokens.begin(), tokens.end());
  const std::vector<uint16_t> u16(tokens.begin(), tokens.end());
  const std::vector<int32_t> i32(tokens.begin(), tokens.end());
  const std::vector<int64_t> i64(tokens.begin(), tokens.end());
  const std::vector<Array> arrays = {{u8.data(), ArrayDType::u8, {41}},
                                     {u16.data(), ArrayDType::u16, {41}},
                                     {tokens.data(), ArrayDType::u32, {41}},
                                     {i32.data(), ArrayDType::i32, {41}},
                                     {i64.data(), ArrayDType::i64, {41}}};
  write_shard(dir.file("b.bin"), tokens, false);
  for (const Array& a : arrays) {
    INFO(array_dtype_name(a.dtype));
    write_npy_file(dir.file("a.npy"), a);
    CHECK(NpyFile(dir.file("a.npy")).header().dtype == a.dtype);
    const TokenDataset d({dir.file("a.npy"), dir.file("b.bin")}, 5);
    CHECK(d.rows() == 16);
    for (size_t i : {0, 3, 7}) CHECK(gathered(d, {static_cast<int64_t>(i)}) == window(tokens, i, 5));
    CHECK(gathered(d, {8 + 7}) == window(tokens, 7, 5));
  }
}

TEST_CASE("hostile token files are refused with one line naming the file", "[data][tokens]") {
  test::TempDir dir;
  const std::string p = dir.file("bad.bin");
  auto error = [&](int64_t T = 4) { return usage_error([&] { TokenDataset({p}, T); }); };
  auto says = [&](const std::string& text, int64_t T = 4) {
    const std::string e = error(T);
    INFO(e);
    CHECK(e.find("data file '" + p + "': ") == 0);
    CHECK(e.find(text) != std::string::npos);
  };
  write_raw_shard(p, 20240521, 1, 10, 20);
  says(
      "its magic is 20240521: not an llm.c token shard (magic 20240520: uint16 tokens, 20240801: uint32) nor a "
      ".npy file");
  write_bytes(p, "ab", 2);
  says("2 bytes: not an llm.c token shard");
  write_bytes(p, "", 0);
  says("0 bytes: not an llm.c token shard");
  const int32_t magic_only[2] = {kShardMagicU16, kShardVersionU16};
  write_bytes(p, magic_only, sizeof magic_only);
  says("8 bytes, shorter than a token shard's 1024-byte header");
  write_raw_shard(p, kShardMagicU16, 7, 10, 20);
  says("version 7 with magic 20240520: llm.c's uint16 token shards are version 1");
  write_raw_shard(p, kShardMagicU32, 1, 10, 40);
  says("version 1 with magic 20240801: llm.c's uint32 token shards are version 7");
  write_raw_shard(p, kShardMagicU16, 1, 10, 19);
  says("its header counts 10 tokens (20 bytes of uint16), but 19 bytes follow its 1024-byte header");
  write_raw_shard(p, kShardMagicU32, 7, 10, 44);
  says("its header counts 10 tokens (40 bytes of uint32), but 44 bytes follow its 1024-byte header");
  write_raw_shard(p, kShardMagicU16, 1, -1, 0);
  CHECK(error() == "data file '" + p + "': its header counts -1 tokens");
  write_raw_shard(p, kShardMagicU16, 1, 4, 8);
  says("holds 4 tokens, fewer than a window of 5 (4 inputs and the token after them)");
  CHECK(error(3).empty());  // a window of 3 + 1 fits
  const std::vector<float> floats(10, 1.0f);
  write_npy_file(p, {floats.data(), ArrayDType::f32, {10}});
  says("holds float32 [10], not integer tokens (a .npy of tokens is uint8, uint16, uint32, int32 or int64)");
  const std::vector<int32_t> grid(10, 1);
  write_npy_file(p, {grid.data(), ArrayDType::i32, {2, 5}});
  says("is int32 [2, 5], not a 1-D array of tokens");
  write_npy_file(p, {grid.data(), ArrayDType::i32, {3}});
  says("holds 3 tokens, fewer than a window of 5");
  CHECK(usage_error([&] { TokenDataset({dir.file("none.bin")}, 4); }).find("cannot open") != std::string::npos);
  CHECK(usage_error([&] { TokenDataset({}, 4); }) == "TokenDataset: no token files");
  write_raw_shard(p, kShardMagicU16, 1, 10, 20);
  CHECK(usage_error([&] { TokenDataset({p}, 0); }).find("T must be >= 1") != std::string::npos);
}

TEST_CASE("a token outside the vocabulary is refused as its window is gathered, by its place in the file",
          "[data][tokens]") {
  test::TempDir dir;
  std::vector<uint32_t> tokens = tokens_of(41, 500);
  tokens[22] = 500;  // in window 2 (tokens 16..24)
  tokens[33] = 3000000000u;
  write_shard(dir.file("a.bin"), tokens, true);
  const TokenDataset d({dir.file("a.bin")}, 8);  // loads: no pass over the tokens
  // Before the model's vocabulary is known only int32's bound holds: window 4 (32..40).
  CHECK(usage_error([&] { (void)gathered(d, {2}); }).empty());
  CHECK(usage_error([&] { (void)gathered(d, {4}); }) ==
        "data file '" + dir.file("a.bin") + "': token 33 is 3000000000, outside [0, 2147483648): tokens are int32");
  d.check_model({8}, Task::language_model, 500);
  // Window 2 was checked against int32 alone: checked again against the vocabulary.
  const std::string e = usage_error([&] { (void)gathered(d, {0, 1, 2}); });
  CHECK(e == "data file '" + dir.file("a.bin") + "': token 22 is 500, outside [0, 500): the model's vocabulary has " +
                 "500 tokens");
  CHECK(usage_error([&] { (void)gathered(d, {1, 3}); }).empty());
  CHECK_THROWS_AS((void)gathered(d, {2}), DataError);  // a row's fault: the step that meets it is abandoned
  // A target alone counts too: token 40 is the last target of window 4.
  std::vector<uint32_t> last = tokens_of(41, 500);
  last[40] = 501;
  write_shard(dir.file("b.bin"), last, false);
  const TokenDataset t({dir.file("b.bin")}, 8);
  t.check_model({8}, Task::language_model, 500);
  CHECK(usage_error([&] { (void)gathered(t, {4}); }).find("token 40 is 501") != std::string::npos);
  CHECK(usage_error([&] { (void)gathered(t, {3}); }).empty());
  // Negative tokens of a signed .npy.
  std::vector<int64_t> signed_tokens(17, 3);
  signed_tokens[9] = -1;
  write_npy_file(dir.file("c.npy"), {signed_tokens.data(), ArrayDType::i64, {17}});
  const TokenDataset n({dir.file("c.npy")}, 8);
  CHECK(usage_error([&] { (void)gathered(n, {1}); }).find("token 9 is -1, outside [0, 2147483648)") !=
        std::string::npos);
}

TEST_CASE("check_every_row finds a bad token of any window before a gather, a slice's own windows only",
          "[data][tokens]") {
  test::TempDir dir;
  std::vector<uint32_t> tokens = tokens_of(41, 500);
  tokens[38] = 500;  // window 4 (tokens 32..40) only
  write_shard(dir.file("a.bin"), tokens, false);
  const TokenDataset d({dir.file("a.bin")}, 8);
  d.check_model({8}, Task::language_model, 500);
  CHECK(usage_error([&] { d.check_every_row(); }) == "data file '" + dir.file("a.bin") +
                                                         "': token 38 is 500, outside [0, 500): the model's "
                                                         "vocabulary has 500 tokens");
  const TokenDataset head = d.slice(0, 4);  // windows 0..3 never reach token 38
  CHECK(usage_error([&] { head.check_every_row(); }).empty());
  CHECK(usage_error([&] { (void)gathered(head, {0, 1, 2, 3}); }).empty());
}

TEST_CASE("token data is checked against the model: rows of T tokens, a language model's task", "[data][tokens]") {
  test::TempDir dir;
  write_shard(dir.file("a.bin"), tokens_of(41, 500), false);
  const TokenDataset d({dir.file("a.bin")}, 8);
  const std::string name = "token file '" + dir.file("a.bin") + "'";
  CHECK(d.inputs_name() == name);
  CHECK(usage_error([&] { d.check_model({8}, Task::language_model, 500); }).empty());
  CHECK(usage_error([&] { d.check_model({16}, Task::language_model, 500); }) ==
        name + " has rows of [8], the model takes [16]");
  CHECK(usage_error([&] { d.check_model({8}, Task::classification, 500); }) ==
        name + " holds tokens (a language model's data), but the task is classification");
  CHECK(usage_error([&] { d.check_model({8}, Task::language_model, 0); }) == name + ": a vocabulary of 0 tokens");
  // Float targets against a language model.
  const std::vector<float> x(12, 0.5f), y(3, 1.0f);
  const ArrayDataset a({x.data(), ArrayDType::f32, {3, 4}}, {y.data(), ArrayDType::f32, {3}});
  CHECK(usage_error([&] { a.check_model({4}, Task::language_model, 10); }) ==
        "host arrays: y holds regression targets, but the task is language-model");
  // Synthetic tokens: sample s is tokens s*T .. s*T+T of one random stream (inputs, then next
  // tokens), in [0, vocabulary), the same whichever rows are made together.
  const Synthetic syn({.task = Task::language_model, .in = 5, .out = 7, .seed = 3}, test::host);
  CHECK(syn.input_dtype() == DType::i32);
  CHECK(syn.target_shape() == Shape{5});
  const Batch b = syn.batch(10, 3), one = syn.batch(11, 1);
  const std::vector<int32_t> bx = b.x.to_host_i32(), by = b.y.to_host_i32();
  for (size_t i = 0; i < bx.size(); ++i) {
    CHECK((bx[i] >= 0 && bx[i] < 7));
    if (i + 1 < bx.size()) CHECK(by[i] == bx[i + 1]);  // a window's targets are its next tokens
  }
  CHECK(one.x.to_host_i32() == std::vector<int32_t>(bx.begin() + 5, bx.begin() + 10));
  CHECK(std::set<int32_t>(bx.begin(), bx.end()).size() > 3);
  CHECK(parse_task("language-model") == Task::language_model);
  CHECK(std::string(task_name(Task::language_model)) == "language-model");
  // Several files name the first and the last.
  write_shard(dir.file("b.bin"), tokens_of(41, 500), false);
  write_shard(dir.file("c.bin"), tokens_of(41, 500), false);
  CHECK(TokenDataset({dir.file("a.bin"), dir.file("b.bin")}, 8).inputs_name() ==
        "token files '" + dir.file("a.bin") + "' and '" + dir.file("b.bin") + "'");
  CHECK(TokenDataset({dir.file("a.bin"), dir.file("b.bin"), dir.file("c.bin")}, 8).inputs_name() ==
        "token files '" + dir.file("a.bin") + "' ... '" + dir.file("c.bin") + "' (3)");
}

TEST_CASE("data file patterns expand sorted, pattern by pattern; one that matches nothing is refused",
          "[data][tokens]") {
  test::TempDir dir;
  for (const char* name : {"train_002.bin", "train_000.bin", "train_001.bin", "val_000.bin"})
    write_shard(dir.file(name), tokens_of(9, 100), false);
  const std::vector<std::string> files = expand_data_patterns({dir.file("train_*.bin"), dir.file("val_000.bin")});
  CHECK(files == std::vector<std::string>{dir.file("train_000.bin"), dir.file("train_001.bin"),
                                          dir.file("train_002.bin"), dir.file("val_000.bin")});
  CHECK(expand_data_patterns({dir.file("val_*.bin"), dir.file("train_00[1]*")}) ==
        std::vector<std::string>{dir.file("val_000.bin"), dir.file("train_001.bin")});
  CHECK(usage_error([&] {
          (void)expand_data_patterns({dir.file("train_*.bin"), dir.file("test_*.bin")});
        }) == "data files '" + dir.file("test_*.bin") + "': no file matches");
  CHECK(usage_error([&] { (void)expand_data_patterns({dir.file("missing.bin")}); }) ==
        "data files '" + dir.file("missing.bin") + "': no file matches");
}

TEST_CASE("token data's origin: the window length, each file's size and a hash of its header and first tokens",
          "[data][tokens]") {
  test::TempDir dir;
  // Two shards of one data set: the same count, so the same header.
  write_shard(dir.file("a.bin"), tokens_of(41, 500), false);
  write_shard(dir.file("b.bin"), tokens_of(41, 500, 1), false);
  const TokenDataset ab({dir.file("a.bin"), dir.file("b.bin")}, 8), ba({dir.file("b.bin"), dir.file("a.bin")}, 8);
  CHECK(ab.origin().find("windows of 8 tokens, a file of 1106 bytes with header hash ") == 0);
  CHECK(ab.origin() != ba.origin());
  CHECK(!ab.files()[0].matches(ab.files()[1]));
  CHECK(ab.origin() == TokenDataset({dir.file("a.bin"), dir.file("b.bin")}, 8).origin());
  CHECK(ab.origin() != TokenDataset({dir.file("a.bin"), dir.file("b.bin")}, 4).origin());
  CHECK(ab.slice(2, 3).origin().find("windows of 8 tokens, from window 2, a file of") == 0);
  CHECK(ab.origin().find(dir.file("a.bin")) == std::string::npos);  // files move: not their paths
}

TEST_CASE("a CPU replica's feeder and the ahead loader deliver the exact tokens, in the epoch's order",
          "[data][tokens][pipeline]") {
  test::TempDir dir;
  const std::vector<uint32_t> a = tokens_of(101, 50257), b = tokens_of(60, 50257, 5);
  write_shard(dir.file("a.bin"), a, false);
  write_shard(dir.file("b.bin"), b, true);
  const TokenDataset d({dir.file("a.bin"), dir.file("b.bin")}, 6);  // 16 + 9 windows
  REQUIRE(d.rows() == 25);
  d.check_model({6}, Task::language_model, 50257);
  // The windows as a direct gather gives them: global samples first .. first + count - 1.
  auto expected = [&](bool shuffle, int64_t first, int64_t count) {
    RowOrder order(d.rows(), 5, shuffle);
    std::vector<int64_t> rows;
    order.rows(first, count, rows);
    std::vector<int32_t> x, y;
    for (int64_t r : rows) {
      const size_t i = static_cast<size_t>(r);
      const auto w = i < 16 ? window(a, i, 6) : window(b, i - 16, 6);
      x.insert(x.end(), w.first.begin(), w.first.end());
      y.insert(y.end(), w.second.begin(), w.second.end());
    }
    return std::pair{x, y};
  };
  const auto next = [](int64_t first) { return Samples{first + 7, 7}; };
  for (bool shuffle : {true, false}) {
    INFO((shuffle ? "shuffled" : "file order"));
    // Two CPU replicas, batch 7 split 4 / 3: each gathers its part on its own thread.
    const Device cpu0{DeviceType::cpu, 780}, cpu1{DeviceType::cpu, 781};
    const std::vector<ReplicaShare> shares = {{cpu0, 7, {0, 4}, 4, 70, {}}, {cpu1, 7, {4, 3}, 3, 70, {}}};
    const auto feeders = make_feeders(&d, {}, shares, {.seed = 5, .shuffle = shuffle});
    for (int64_t step : {0, 1, 2, 3, 9}) {
      INFO("step " << step);
      const Batch p0 = feeders[0]->inputs(step * 7, 4, Batch()), p1 = feeders[1]->inputs(step * 7 + 4, 3, Batch());
      CHECK(p0.x.dtype() == DType::i32);
      CHECK(p0.x.shape() == Shape{4, 6});
      CHECK(std::pair{p0.x.to_host_i32(), p0.y.to_host_i32()} == expected(shuffle, step * 7, 4));
      CHECK(std::pair{p1.x.to_host_i32(), p1.y.to_host_i32()} == expected(shuffle, step * 7 + 4, 3));
    }
    // The ahead loader, on a CPU device: its slots, thread and events take the GPU's path.
    AheadLoader loader(d, cpu0, 7, 5, shuffle, next, 2);
    for (int64_t first : {0, 7, 14, 21, 28, 70, 77}) {
      INFO("samples from " << first);
      const Batch got = loader.get(first, 7, context(cpu0));
      CHECK(std::pair{got.x.to_host_i32(), got.y.to_host_i32()} == expected(shuffle, first, 7));
    }
    const InputStats st = loader.stats();
    CHECK(st.bytes == static_cast<uint64_t>(st.loads * 7 * (6 + 6) * 4));
  }
  // A bad token reaches the call that asks for its window, not the prefetch that met it.
  std::vector<uint32_t> bad = a;
  bad[6 * 3 + 2] = 50257;  // window 3
  write_shard(dir.file("bad.bin"), bad, false);
  const TokenDataset hostile({dir.file("bad.bin")}, 6);
  hostile.check_model({6}, Task::language_model, 50257);
  const Device cpu{DeviceType::cpu, 782};
  AheadLoader loader(
      hostile, cpu, 2, 5, false,
      [](int64_t first) {
        return Samples{first + 2, 2};
      },
      1);
  CHECK_NOTHROW(loader.get(0, 2, context(cpu)));  // loads windows 2 and 3 behind the scenes
  CHECK(usage_error([&] { (void)loader.get(2, 2, context(cpu)); }).find("token 20 is 50257") != std::string::npos);
  CHECK_NOTHROW(loader.get(4, 2, context(cpu)));
}

namespace {
// The synthetic tokens as data/synthetic.cpp made them on the host before a kernel made
// them, kept as the reference: sample s is the uniform floats s*T .. s*T+T in [0,
// vocabulary) of the input stream (1 << 20), truncated and kept below the vocabulary.
std::pair<std::vector<int32_t>, std::vector<int32_t>> host_tokens(const SyntheticConfig& c, const RowMap& map,
                                                                  int64_t count) {
  const int64_t T = c.in;
  std::vector<int32_t> x(static_cast<size_t>(count * T)), y(x.size());
  std::vector<float> u(static_cast<size_t>(T + 1));
  for (int64_t i = 0; i < count; ++i) {
    int64_t s = map.first + (i / map.per_group) * map.group_stride + i % map.per_group;
    if (c.samples > 0) s %= c.samples;
    cpu::uniform(u.data(), T + 1, c.seed, uint64_t{1} << 20, static_cast<uint64_t>(s * T), 0.0f,
                 static_cast<float>(c.out));
    for (int64_t t = 0; t <= T; ++t) {
      const auto token =
          static_cast<int32_t>(std::min<int64_t>(static_cast<int64_t>(u[static_cast<size_t>(t)]), c.out - 1));
      if (t < T) x[static_cast<size_t>(i * T + t)] = token;
      if (t > 0) y[static_cast<size_t>(i * T + t - 1)] = token;
    }
  }
  return {x, y};
}

}  // namespace

TEST_CASE("synthetic tokens are the ones the host made: the same data and data positions", "[data][tokens]") {
  // Pinned tokens: seed 3 with a vocabulary of 7 (windows of 6), and samples 5 and 6 of seed
  // 1 with GPT-2's vocabulary (T 1024), the first 12 of each.
  const Synthetic small({.task = Task::language_model, .in = 6, .out = 7, .seed = 3}, test::host);
  const Batch a = small.batch(0, 3);
  const std::vector<int32_t> stream{4, 1, 5, 4, 5, 3, 0, 4, 2, 2, 1, 2, 5, 3, 3, 6, 2, 3, 5};
  CHECK(a.x.to_host_i32() == std::vector<int32_t>(stream.begin(), stream.end() - 1));
  CHECK(a.y.to_host_i32() == std::vector<int32_t>(stream.begin() + 1, stream.end()));
  const SyntheticConfig gpt2{.task = Task::language_model, .in = 1024, .out = 50257, .seed = 1};
  const Batch g = Synthetic(gpt2, test::host).batch(5, 2);
  const std::vector<int32_t> gx = g.x.to_host_i32();
  CHECK(std::vector<int32_t>(gx.begin(), gx.begin() + 12) ==
        std::vector<int32_t>{24579, 2552, 17810, 12984, 45601, 17680, 26234, 20276, 8102, 27521, 40340, 4452});
  CHECK(g.y.to_host_i32() == host_tokens(gpt2, {5, 2, 2, 0}, 2).second);
  // A replica's rows of several steps (groups of 2 every 5 rows) of a finite set wrap around
  // as they did, made straight into the buffers given.
  const SyntheticConfig finite{.task = Task::language_model, .in = 9, .out = 300, .seed = 7, .samples = 11};
  const Synthetic f(finite, test::host);
  const RowMap map{3, 2, 5, 11};
  const Batch into{Tensor::empty({8, 9}, DType::i32, test::host), Tensor::empty({8, 9}, DType::i32, test::host)};
  const Batch got = f.rows(map, 8, into);
  CHECK((got.x.data() == into.x.data() && got.y.data() == into.y.data()));
  const auto want = host_tokens(finite, map, 8);
  CHECK(got.x.to_host_i32() == want.first);
  CHECK(got.y.to_host_i32() == want.second);
  CHECK(f.rows(map, 8).x.to_host_i32() == want.first);
  // Buffers that do not hold the rows are refused.
  CHECK_THROWS_AS(f.rows(map, 7, into), Error);
  CHECK_THROWS_AS(f.rows(map, 8, {Tensor::empty({8, 9}, DType::f32, test::host), into.y}), Error);
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

TEST_CASE("tokens reach the GPU as a direct gather and the ahead loader make them on the host", "[gpu][data][tokens]") {
  test::TempDir dir;
  const std::vector<uint32_t> a = tokens_of(101, 50257), b = tokens_of(60, 50257, 5);
  write_shard(dir.file("a.bin"), a, false);
  write_shard(dir.file("b.bin"), b, true);
  const TokenDataset d({dir.file("a.bin"), dir.file("b.bin")}, 6);
  d.check_model({6}, Task::language_model, 50257);
  const std::vector<int64_t> rows = {24, 0, 16, 15, 3};
  Batch on_host = d.empty_batch(5, test::host), on_gpu = d.empty_batch(5, test::gpu);
  d.gather(rows, on_host);
  d.gather(rows, on_gpu);
  CHECK(on_gpu.x.device() == test::gpu);
  CHECK(on_gpu.x.to_host_i32() == on_host.x.to_host_i32());
  CHECK(on_gpu.y.to_host_i32() == on_host.y.to_host_i32());
  AheadLoader loader(
      d, test::gpu, 7, 5, true,
      [](int64_t first) {
        return Samples{first + 7, 7};
      },
      2);
  RowOrder order(d.rows(), 5, true);
  std::vector<int64_t> picked;
  for (int64_t first : {0, 7, 14, 21, 70}) {
    const Batch got = loader.get(first, 7, context(test::gpu));
    order.rows(first, 7, picked);
    const Batch want = d.empty_batch(7, test::host);
    d.gather(picked, want);
    CHECK(got.x.to_host_i32() == want.x.to_host_i32());
    CHECK(got.y.to_host_i32() == want.y.to_host_i32());
  }
}

TEST_CASE("synthetic tokens made on the GPU are the CPU's", "[gpu][data][tokens]") {
  for (const SyntheticConfig& c :
       {SyntheticConfig{.task = Task::language_model, .in = 1024, .out = 50257, .seed = 1},
        SyntheticConfig{.task = Task::language_model, .in = 5, .out = 7, .seed = 3, .samples = 11}}) {
    INFO("T " << c.in << ", vocabulary " << c.out);
    const Synthetic on_cpu(c, test::host), on_gpu(c, test::gpu);
    const RowMap map{3, 2, 5, 0};
    const Batch want = on_cpu.rows(map, 9), b = on_gpu.batch(2, 6);
    const Batch into{Tensor::empty({9, c.in}, DType::i32, test::gpu), Tensor::empty({9, c.in}, DType::i32, test::gpu)};
    const Batch got = on_gpu.rows(map, 9, into);
    CHECK(got.x.data() == into.x.data());
    CHECK(got.x.device() == test::gpu);
    CHECK(got.x.to_host_i32() == want.x.to_host_i32());
    CHECK(got.y.to_host_i32() == want.y.to_host_i32());
    CHECK(b.x.to_host_i32() == on_cpu.batch(2, 6).x.to_host_i32());
    CHECK(b.y.to_host_i32() == on_cpu.batch(2, 6).y.to_host_i32());
  }
}

#endif  // DPT_GPU_TESTS
