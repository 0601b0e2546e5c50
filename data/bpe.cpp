// Byte-pair encoding with GPT-2's tables (the tables are read in bpe_load.cpp).
#include <dptrain/data/bpe.hpp>

#include <functional>
#include <queue>
#include <utility>

#include <dptrain/error.hpp>

#include "common/text.hpp"
#include "data/bpe_impl.hpp"
#include "data/bpe_words.hpp"

namespace dpt::data {

// GPT-2's encoder.py merges, in each round, every occurrence of the pair whose merge
// ranks first, left to right (an occurrence that overlaps one just merged is skipped),
// and then looks for the next pair: quadratic in the word's length. The same rounds run
// here off a heap of (rank, position) candidates, so that a long word (a line of 10^5
// letters) costs n log n: a round takes every candidate of the lowest rank, in position
// order, and merges each that still holds its pair. The pairs a merge makes cannot be of
// the round's rank (a merged token is longer than either part), so a round ends as
// encoder.py's does; they join the heap for the rounds after it.
std::vector<int32_t> Bpe::Impl::merge_word(std::string_view word) const {
  const auto n = static_cast<int32_t>(word.size());
  std::vector<int32_t> id(word.size()), next(word.size()), prev(word.size());
  for (int32_t i = 0; i < n; ++i) {
    id[static_cast<size_t>(i)] = byte_token[static_cast<uint8_t>(word[static_cast<size_t>(i)])];
    next[static_cast<size_t>(i)] = i + 1 < n ? i + 1 : -1;
    prev[static_cast<size_t>(i)] = i - 1;
  }
  // Symbols are a linked list over the byte positions; a merge keeps the left one.
  auto at = [](std::vector<int32_t>& v, int32_t i) -> int32_t& { return v[static_cast<size_t>(i)]; };
  using Candidate = std::pair<int32_t, int32_t>;  // (rank, left symbol's position)
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto offer = [&](int32_t left) {
    if (left < 0 || at(next, left) < 0) return;
    if (const Merge* m = merge_of(at(id, left), at(id, at(next, left)))) heap.emplace(m->rank, left);
  };
  for (int32_t i = 0; i + 1 < n; ++i) offer(i);
  std::vector<int32_t> round;
  while (!heap.empty()) {
    const int32_t rank = heap.top().first;
    round.clear();
    for (; !heap.empty() && heap.top().first == rank; heap.pop()) round.push_back(heap.top().second);
    for (const int32_t left : round) {
      const int32_t right = at(next, left);
      if (at(id, left) < 0 || right < 0) continue;  // merged into its left neighbour, or now last
      const Merge* m = merge_of(at(id, left), at(id, right));
      if (!m || m->rank != rank) continue;  // a candidate its neighbours' merges made stale
      at(id, left) = m->result;
      at(id, right) = -1;
      at(next, left) = at(next, right);
      if (at(next, left) >= 0) at(prev, at(next, left)) = left;
      offer(at(prev, left));
      offer(left);
    }
  }
  std::vector<int32_t> out;
  for (int32_t i = 0; i >= 0; i = at(next, i)) out.push_back(at(id, i));
  return out;
}

std::vector<int32_t> Bpe::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  for (const std::string_view word : gpt2_words(text)) {
    {
      const std::lock_guard<std::mutex> lock(impl_->cache_mutex);
      const auto hit = impl_->cache.find(std::string(word));
      if (hit != impl_->cache.end()) {
        ids.insert(ids.end(), hit->second.begin(), hit->second.end());
        continue;
      }
    }
    std::vector<int32_t> merged = impl_->merge_word(word);
    ids.insert(ids.end(), merged.begin(), merged.end());
    const std::lock_guard<std::mutex> lock(impl_->cache_mutex);
    if (impl_->cache.size() >= Impl::kCachedWords) impl_->cache.clear();
    impl_->cache.emplace(word, std::move(merged));
  }
  return ids;
}

const std::string& Bpe::token_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size())
    throw UsageError("tokenizer '" + impl_->dir + "': token id " + std::to_string(id) +
                     " is outside its vocabulary [0, " + std::to_string(vocab_size()) + ")");
  return impl_->token_bytes[static_cast<size_t>(id)];
}

std::string Bpe::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (const int32_t id : ids) out += token_bytes(id);
  return out;
}

int32_t Bpe::vocab_size() const { return static_cast<int32_t>(impl_->token_bytes.size()); }

const std::string& Bpe::dir() const { return impl_->dir; }

namespace {

// Whether p[0, n) (0 < n < 4) is the start of a UTF-8 character that more bytes could
// complete: completed with the smallest or the largest continuation bytes (one of the two
// lies in each lead byte's range for its second byte), it is valid.
bool completable(const uint8_t* p, size_t n) {
  const size_t want = (p[0] & 0xE0) == 0xC0 ? 2 : (p[0] & 0xF0) == 0xE0 ? 3 : (p[0] & 0xF8) == 0xF0 ? 4 : 0;
  if (n >= want) return false;
  for (const uint8_t fill : {uint8_t{0x80}, uint8_t{0xBF}}) {
    uint8_t c[4] = {fill, fill, fill, fill};
    for (size_t i = 0; i < n; ++i) c[i] = p[i];
    if (utf8_length(c, want) == want) return true;
  }
  return false;
}

}  // namespace

std::string BpeTextStream::push(int32_t id) {
  held_ += bpe_.token_bytes(id);
  return take(false);
}

std::string BpeTextStream::finish() { return take(true); }

std::string BpeTextStream::take(bool at_end) {
  const auto* p = reinterpret_cast<const uint8_t*>(held_.data());
  const size_t n = held_.size();
  std::string out;
  size_t i = 0;
  while (i < n) {
    if (const size_t len = utf8_length(p + i, n - i)) {
      out.append(held_, i, len);
      i += len;
      continue;
    }
    if (!at_end && completable(p + i, n - i)) break;  // the next ids may complete it
    // U+FFFD for the longest start of a character here (a lone byte at least).
    size_t piece = 1;
    while (piece < 3 && i + piece < n && completable(p + i, piece + 1)) ++piece;
    append_utf8(out, 0xFFFD);
    i += piece;
  }
  held_.erase(0, i);
  return out;
}

}  // namespace dpt::data
