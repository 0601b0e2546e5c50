#include "input_pipeline.hpp"

#include <algorithm>
#include <chrono>
#include <span>
#include <utility>

#include <dptrain/error.hpp>
#include <dptrain/runtime/tensor.hpp>

namespace dpt {

SampleRange next_shard(const ShardPlan& plan, size_t replica, int64_t first) {
  const int64_t batch = plan.batch(), step_first = first - first % batch, offset = first % batch;
  const int k_total = plan.micro_batches();
  int k = 0;
  while (k < k_total && plan.micro(replica, k).first != offset) ++k;
  DPT_CHECK(k < k_total, "next_shard: sample " + std::to_string(first) + " starts no micro-batch of replica " +
                             std::to_string(replica));
  int next = k + 1;
  while (next < k_total && plan.micro(replica, next).count == 0) ++next;
  if (next < k_total) return {step_first + plan.micro(replica, next).first, plan.micro(replica, next).count};
  return {step_first + batch + plan.micro(replica, 0).first, plan.micro(replica, 0).count};
}

ShardLoader::ShardLoader(const data::Dataset& data, const Device& device, int64_t max_rows, uint64_t seed, bool shuffle)
    : data_(data),
      device_(device),
      max_rows_(max_rows),
      x_row_(numel(data.input_shape())),
      y_row_(data.task() == data::Task::classification ? 1 : numel(data.target_shape())),
      labels_(data.task() == data::Task::classification),
      copy_ctx_(device),
      order_(data.rows(), seed, shuffle) {
  DPT_CHECK(max_rows >= 1 && data.has_targets(), "ShardLoader: rows with targets to load");
  constexpr int64_t kParallelBytes = 1 << 20;  // below it one thread is as fast
  const unsigned threads = std::min(4u, std::max(1u, std::thread::hardware_concurrency()));
  if (threads > 1 && data.concurrent_gathers() && max_rows * (x_row_ + y_row_) * 4 >= kParallelBytes)
    gatherers_ = std::make_unique<WorkerPool>(threads);
  for (Slot& s : slots_) {
    s.host_x = PinnedBuffer(static_cast<size_t>(max_rows * x_row_) * sizeof(float), device);
    s.host_y = PinnedBuffer(static_cast<size_t>(max_rows * y_row_) * 4, device);  // float or int32
    const data::Batch buffers = data.empty_batch(max_rows, device);
    s.x = buffers.x;
    s.y = buffers.y;
    s.copy_start = std::make_unique<Event>(device);
    s.copied = std::make_unique<Event>(device);
    s.consumed = std::make_unique<Event>(device);
  }
  // The buffers were made on this thread's stream; the copy stream and the replica's
  // stream use them from now on.
  context(device).synchronize();
  thread_ = std::thread([this] { loader_main(); });
}

ShardLoader::~ShardLoader() {
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

namespace {
// Rows [0, count) of a buffer of max_rows rows.
Tensor first_rows(const Tensor& t, int64_t count) {
  Shape s = t.shape();
  s[0] = count;
  return t.view(0, s);
}
}  // namespace

void ShardLoader::load(Slot& s, int64_t first, int64_t count) {
  s.copied->synchronize();  // the host buffers' last copy to the device is over
  const double copy_ms = s.timing ? s.copied->ms_since(*s.copy_start) : 0.0;
  s.timing = false;
  const auto started = std::chrono::steady_clock::now();
  order_.rows(first, count, rows_);
  auto* hx = static_cast<float*>(s.host_x.data());
  auto* hy = static_cast<float*>(s.host_y.data());    // regression rows, or:
  auto* hl = static_cast<int32_t*>(s.host_y.data());  // class labels
  // Rows [begin, end) of the shard into their places in the buffers.
  auto gather = [&](int64_t begin, int64_t end) {
    if (begin >= end) return;
    const std::span<const int64_t> part(rows_.data() + begin, static_cast<size_t>(end - begin));
    data_.gather_host(part,
                      {hx + begin * x_row_, labels_ ? nullptr : hy + begin * y_row_, labels_ ? hl + begin : nullptr});
  };
  if (gatherers_) {
    const auto parts = static_cast<int64_t>(gatherers_->size());
    gatherers_->run([&](size_t i) {
      const auto k = static_cast<int64_t>(i);
      gather(count * k / parts, count * (k + 1) / parts);
    });
  } else {
    gather(0, count);
  }
  const double gathered = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  // The device buffers are refilled once the compute stream is past the batch they held.
  if (s.consumed_recorded) s.consumed->wait_in(copy_ctx_);
  s.copy_start->record(copy_ctx_);
  copy_from_host_async(first_rows(s.x, count), s.host_x.data(), copy_ctx_);
  copy_from_host_async(first_rows(s.y, count), s.host_y.data(), copy_ctx_);
  s.copied->record(copy_ctx_);
  s.timing = true;
  {
    std::lock_guard<std::mutex> lk(stats_m_);
    stats_.loads += 1;
    stats_.bytes += static_cast<uint64_t>(count * (x_row_ + y_row_) * 4);
    stats_.gather_s += gathered;
    stats_.copy_ms += copy_ms;
    if (copy_ms > 0) stats_.timed_copies += 1;
  }
  s.first = first;
  s.count = count;
}

void ShardLoader::loader_main() {
  for (;;) {
    Slot* s = nullptr;
    int64_t first = 0, count = 0;
    {
      std::unique_lock<std::mutex> lk(m_);
      cv_.wait(lk, [&] { return stop_ || job_; });
      if (stop_) return;
      s = std::exchange(job_, nullptr);
      first = job_first_;
      count = job_count_;
    }
    try {
      load(*s, first, count);
    } catch (...) {  // handed to the step that asks for these rows, if one does
      s->first = first;
      s->count = count;
      s->error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(m_);
      s->loaded = true;
      busy_ = false;
    }
    cv_.notify_all();
  }
}

InputStats ShardLoader::stats() {
  std::lock_guard<std::mutex> lk(stats_m_);
  return stats_;
}

data::Batch ShardLoader::get(int64_t first, int64_t count, int64_t next_first, int64_t next_count, const Context& ctx) {
  DPT_CHECK(count >= 1 && count <= max_rows_,
            "ShardLoader::get: " + std::to_string(count) + " rows, at most " + std::to_string(max_rows_));
  DPT_CHECK(ctx.device() == device_, "ShardLoader::get: a context of another device");
  DPT_CHECK(next_count >= 0 && next_count <= max_rows_, "ShardLoader::get: the next call's rows do not fit");
  Slot* use = nullptr;
  {
    std::unique_lock<std::mutex> lk(m_);
    cv_.wait(lk, [&] { return !busy_; });  // the loader is idle: its slot is ready or failed
    for (Slot& s : slots_)
      if (s.loaded && s.first == first && s.count == count) use = &s;
  }
  if (!use) {  // not what was expected (the first call, a resumed run): loaded here and now
    use = &slots_[last_ == 0 ? 1 : 0];
    use->error = nullptr;
    use->loaded = false;
    load(*use, first, count);
    use->loaded = true;
  }
  if (use->error) {
    use->loaded = false;
    std::rethrow_exception(std::exchange(use->error, nullptr));
  }
  use->copied->wait_in(ctx);  // on the device: the step's stream waits for the copy
  const int index = use == &slots_[0] ? 0 : 1;
  if (last_ >= 0 && last_ != index) {
    // Everything queued on ctx so far, the step that read the last batch included, is
    // before this event: after it, that slot's device buffers may be refilled.
    slots_[last_].consumed->record(ctx);
    slots_[last_].consumed_recorded = true;
  }
  last_ = index;
  // The next call's rows, into the other slot, while this batch is computed on.
  Slot& next = slots_[1 - index];
  if (next_count > 0) {  // none after the run's last step
    std::lock_guard<std::mutex> lk(m_);
    next.loaded = false;
    next.error = nullptr;
    job_ = &next;
    job_first_ = next_first;
    job_count_ = next_count;
    busy_ = true;
  }
  cv_.notify_all();
  return {first_rows(use->x, count), first_rows(use->y, count)};
}

}  // namespace dpt
