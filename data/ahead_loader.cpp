#include "data/ahead_loader.hpp"

#include <algorithm>
#include <chrono>
#include <span>
#include <utility>

#include <dptrain/error.hpp>
#include <dptrain/runtime/tensor.hpp>

namespace dpt::data {

namespace {
constexpr int64_t kChunkBytes = 4 << 20;        // copied while the next chunk is gathered
constexpr int64_t kPartBytes = 1 << 20;         // what one gathering thread is given at least
constexpr int64_t kAheadBytes = 8 << 20;        // small shards: enough slots to hold this much
constexpr int64_t kLargeShardBytes = 64 << 20;  // from here two slots, to spare device memory

// How many shards of `bytes` the ring holds: at least one in use, one loading and one
// ready (so one slow gather does not stall a step), more for small shards, whose loads
// are short and irregular beside the loader thread's wake-ups.
size_t ring_size(int64_t bytes) {
  if (bytes >= kLargeShardBytes) return 2;
  return static_cast<size_t>(std::clamp<int64_t>(1 + (kAheadBytes + bytes - 1) / bytes, 3, 8));
}

// Rows [begin, end) of a buffer of rows.
Tensor rows_of(const Tensor& t, int64_t begin, int64_t end) {
  Shape s = t.shape();
  const int64_t row = numel(s) / s[0];
  s[0] = end - begin;
  return t.view(begin * row, s);
}
}  // namespace

AheadLoader::AheadLoader(const Dataset& data, const Device& device, int64_t max_rows, uint64_t seed, bool shuffle,
                         NextShard next, unsigned gather_threads, int64_t classes)
    : data_(data),
      device_(device),
      max_rows_(max_rows),
      x_row_(numel(data.input_shape())),
      y_row_(data.task() == Task::classification ? 1 : numel(data.target_shape())),
      row_bytes_((x_row_ + y_row_) * 4),
      int_inputs_(data.input_dtype() == DType::i32),
      int_targets_(data.target_dtype() == DType::i32),
      labels_(data.task() == Task::classification),
      classes_(classes),
      next_(std::move(next)),
      copy_ctx_(device),
      order_(data.rows(), seed, shuffle) {
  DPT_CHECK(max_rows >= 1 && data.has_targets() && next_, "AheadLoader: rows with targets to load, and what follows");
  const int64_t shard_bytes = max_rows * row_bytes_;
  if (gather_threads > 1 && data.concurrent_gathers() && shard_bytes >= 2 * kPartBytes) {
    gatherers_ = std::make_unique<WorkerPool>(gather_threads);
    chunk_parts_ = std::vector<std::atomic<int>>(static_cast<size_t>((max_rows + chunk_rows() - 1) / chunk_rows()));
  }
  slots_.resize(ring_size(shard_bytes));
  for (Slot& s : slots_) {
    s.host_x = PinnedBuffer(static_cast<size_t>(max_rows * x_row_) * 4, device);  // float or int32
    s.host_y = PinnedBuffer(static_cast<size_t>(max_rows * y_row_) * 4, device);
    const Batch buffers = data.empty_batch(max_rows, device);
    s.x = buffers.x;
    s.y = buffers.y;
    s.copied = std::make_unique<Event>(device);
    for (int64_t a = 0; a < max_rows; a += chunk_rows()) {
      s.chunk_start.push_back(std::make_unique<Event>(device));
      s.chunk_end.push_back(std::make_unique<Event>(device));
    }
    s.consumed = std::make_unique<Event>(device);
  }
  // The buffers were made on this thread's stream; the copy stream and the replica's
  // stream use them from now on.
  context(device).synchronize();
  thread_ = std::thread([this] { loader_main(); });
}

AheadLoader::~AheadLoader() {
  {
    std::lock_guard<std::mutex> lk(m_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  try {
    copy_ctx_.synchronize();  // no copy may still write into buffers about to be freed
  } catch (const std::exception& e) {
    report(Severity::warning, std::string("the input pipeline's last copy failed: ") + e.what());
  }
}

int64_t AheadLoader::chunk_rows() const { return std::max<int64_t>(1, kChunkBytes / row_bytes_); }

void AheadLoader::load(Slot& s, int64_t first, int64_t count) {
  s.copied->synchronize();  // the host buffers' last copy to the device is over
  double copy_ms = 0;
  const size_t timed = std::exchange(s.timed, 0);
  for (size_t i = 0; i < timed; ++i) copy_ms += s.chunk_end[i]->ms_since(*s.chunk_start[i]);
  order_.rows(first, count, rows_);
  auto* hx = static_cast<float*>(s.host_x.data());     // float rows, or:
  auto* hxi = static_cast<int32_t*>(s.host_x.data());  // tokens
  auto* hy = static_cast<float*>(s.host_y.data());     // regression rows, or:
  auto* hl = static_cast<int32_t*>(s.host_y.data());   // class labels, next tokens
  // Rows [begin, end) of the shard into their places in the buffers.
  auto gather = [&](int64_t begin, int64_t end) {
    if (begin >= end) return;
    const std::span<const int64_t> part(rows_.data() + begin, static_cast<size_t>(end - begin));
    data_.gather_host(part,
                      {int_inputs_ ? nullptr : hx + begin * x_row_, int_targets_ ? nullptr : hy + begin * y_row_,
                       int_targets_ ? hl + begin * y_row_ : nullptr, int_inputs_ ? hxi + begin * x_row_ : nullptr});
    if (labels_) check_labels(data_, part, hl + begin, classes_);
  };
  const int64_t chunk = chunk_rows();
  const auto chunks = static_cast<size_t>((count + chunk - 1) / chunk);
  auto rows_in = [&](size_t c) {  // chunk c's rows of the shard
    const int64_t a = static_cast<int64_t>(c) * chunk;
    return std::pair<int64_t, int64_t>{a, std::min(count, a + chunk)};
  };
  // The device buffers are refilled once the compute stream is past the batch they held.
  if (s.consumed_recorded) s.consumed->wait_in(copy_ctx_);
  size_t queued = 0;
  auto queue_copy = [&](size_t c) {
    const auto [a, b] = rows_in(c);
    s.chunk_start[c]->record(copy_ctx_);
    copy_from_host_async(rows_of(s.x, a, b), hx + a * x_row_, copy_ctx_);
    copy_from_host_async(rows_of(s.y, a, b), hy + a * y_row_, copy_ctx_);
    s.chunk_end[c]->record(copy_ctx_);
    queued = c + 1;
  };
  const auto started = std::chrono::steady_clock::now();
  try {
    // A thread for every kPartBytes of the shard, up to the pool's size: waking more costs
    // more than they save.
    const size_t parts =
        gatherers_ ? std::min(gatherers_->size(), static_cast<size_t>(count * row_bytes_ / kPartBytes)) : 1;
    if (parts > 1) {
      // Every thread gathers its part of each chunk in turn, without waiting for the
      // others; this thread queues chunk c's copy as soon as every part of it is in.
      for (size_t c = 0; c < chunks; ++c) chunk_parts_[c].store(0, std::memory_order_relaxed);
      failed_.store(false, std::memory_order_relaxed);
      const std::function<void(size_t)> job = [&](size_t w) {
        size_t c = 0;
        auto done = [&](size_t k) {
          chunk_parts_[k].fetch_add(1, std::memory_order_release);
          chunk_parts_[k].notify_one();
        };
        auto done_with_rest = [&] {  // a failed or abandoned gather still counts, so nobody waits
          for (; c < chunks; ++c) done(c);
        };
        try {
          for (; c < chunks && !failed_.load(std::memory_order_relaxed); ++c) {
            const auto [a, b] = rows_in(c);
            const auto k = static_cast<int64_t>(w), n = static_cast<int64_t>(parts);
            gather(a + (b - a) * k / n, a + (b - a) * (k + 1) / n);
            done(c);
          }
        } catch (...) {
          failed_.store(true, std::memory_order_relaxed);
          done_with_rest();
          throw;
        }
        done_with_rest();
      };
      gatherers_->start(job, parts);
      for (size_t c = 0; c < chunks; ++c) {
        int in = 0;
        while ((in = chunk_parts_[c].load(std::memory_order_acquire)) < static_cast<int>(parts))
          chunk_parts_[c].wait(in, std::memory_order_acquire);
        if (failed_.load(std::memory_order_relaxed)) break;
        queue_copy(c);
      }
      gatherers_->wait();  // rethrows a gather's error
    } else {
      for (size_t c = 0; c < chunks; ++c) {
        const auto [a, b] = rows_in(c);
        gather(a, b);
        queue_copy(c);
      }
    }
  } catch (...) {
    if (queued > 0) s.copied->record(copy_ctx_);  // the next load waits for what was queued
    throw;
  }
  const double gathered = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  s.copied->record(copy_ctx_);
  s.timed = queued;
  std::lock_guard<std::mutex> lk(stats_m_);
  stats_.loads += 1;
  stats_.bytes += static_cast<uint64_t>(count * row_bytes_);
  stats_.gather_s += gathered;
  stats_.copy_ms += copy_ms;
  if (copy_ms > 0) stats_.timed_copies += 1;
}

void AheadLoader::loader_main() {
  count_host_waits(false);  // its waits are beside the steps, not in their way
  std::unique_lock<std::mutex> lk(m_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || (want_count_ > 0 && slots_[fill_].state == State::free); });
    if (stop_) return;
    Slot& s = slots_[fill_];
    const int64_t first = want_first_, count = want_count_;
    const uint64_t generation = generation_;
    s.state = State::loading;
    s.first = first;
    s.count = count;
    s.error = nullptr;
    lk.unlock();
    std::exception_ptr error;
    try {
      load(s, first, count);
    } catch (...) {  // handed to the call that asks for these rows, if one does
      error = std::current_exception();
    }
    lk.lock();
    if (generation != generation_) {  // started afresh meanwhile: this load is not wanted
      s.state = State::free;
    } else {
      Samples after{0, 0};
      try {
        after = next_(first);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
      s.error = error;
      s.state = State::ready;
      fill_ = (fill_ + 1) % slots_.size();
      want_first_ = after.first;
      want_count_ = after.count <= max_rows_ ? after.count : 0;  // more: served when asked
    }
    cv_.notify_all();
  }
}

Batch AheadLoader::inputs(int64_t first, int64_t count, const Batch&) { return get(first, count, context(device_)); }

InputStats AheadLoader::stats() {
  std::lock_guard<std::mutex> lk(stats_m_);
  return stats_;
}

Batch AheadLoader::get(int64_t first, int64_t count, const Context& ctx) {
  DPT_CHECK(count >= 1 && count <= max_rows_,
            "AheadLoader::get: " + std::to_string(count) + " rows, at most " + std::to_string(max_rows_));
  DPT_CHECK(ctx.device() == device_, "AheadLoader::get: a context of another device");
  std::unique_lock<std::mutex> lk(m_);
  if (out_ != SIZE_MAX) {
    // Everything queued on ctx so far, the work that read the last batch included, is
    // before this event: after it, that slot's device buffers may be refilled.
    Slot& last = slots_[out_];
    last.consumed->record(ctx);
    last.consumed_recorded = true;
    last.state = State::free;
    out_ = SIZE_MAX;
    cv_.notify_all();
  }
  Slot* use = &slots_[take_];
  const bool expected =
      (use->state == State::loading || use->state == State::ready) && use->first == first && use->count == count;
  if (!expected) {
    // Not what the loader foresaw: stale loads are dropped and it starts from here.
    ++generation_;
    want_count_ = 0;  // the loader takes nothing new meanwhile
    cv_.wait(lk, [&] {
      return std::none_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.state == State::loading; });
    });
    for (Slot& s : slots_) s.state = State::free;
    fill_ = take_ = 0;
    want_first_ = first;
    want_count_ = count;
    use = &slots_[0];
    cv_.notify_all();
  }
  cv_.wait(lk, [&] { return use->state == State::ready; });
  use->state = State::out;
  out_ = static_cast<size_t>(use - slots_.data());
  take_ = (take_ + 1) % slots_.size();
  if (use->error) std::rethrow_exception(std::exchange(use->error, nullptr));
  use->copied->wait_in(ctx);  // on the device: the step's stream waits for the copy
  return {rows_of(use->x, 0, count), rows_of(use->y, 0, count)};
}

}  // namespace dpt::data
