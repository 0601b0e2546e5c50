#include "nonfinite_watch.hpp"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <thread>
#include <utility>

#include <dptrain/error.hpp>
#include <dptrain/runtime/context.hpp>

namespace dpt {

NonFiniteWatch::NonFiniteWatch(DataParallel& dp)
    : dp_(dp),
      host_(sizeof(CheckRecord) * kLag, dp.device(0), /*mapped=*/true),
      count_(Tensor::zeros({2}, DType::i32, dp.device(0))),
      step_of_(kLag, -1) {
  std::memset(host_.data(), 0, host_.size());  // tag 0: not written
  dp_.set_check_ring({static_cast<CheckRecord*>(host_.device_data()), kLag, count_});
}

NonFiniteWatch::~NonFiniteWatch() {
  try {
    dp_.set_check_ring({});  // waits for the steps that write the ring
  } catch (const std::exception& e) {
    report(Severity::warning, "a step failed while the gradient checks were read: " + Message::of(e));
  }
}

void NonFiniteWatch::read_next() {
  const CheckRecord& r = static_cast<const CheckRecord*>(host_.data())[read_ % kLag];
  auto tag = [&] { return std::atomic_ref<const int64_t>(r.tag).load(std::memory_order_acquire); };
  if (tag() != read_ + 1) {
    // The device is kLag steps behind: wait for this record alone, not for every step
    // queued after it. A stream that fails throws from idle(); a wait longer than a second
    // (a rank that stopped answering, say) goes to synchronize(), which bounds it by the
    // communication timeout.
    note_host_wait();
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (tag() != read_ + 1 && !dp_.idle() && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::microseconds(5));
    if (tag() != read_ + 1) dp_.synchronize();
    if (tag() != read_ + 1)
      throw Error("the gradient check of step " + std::to_string(step_of_[read_ % kLag] + 1) +
                  " was not recorded (record " + std::to_string(read_ + 1) + ", the slot holds " +
                  std::to_string(tag()) + ")");
  }
  float scale = 0;
  std::memcpy(&scale, &r.scale_bits, 4);
  if (!std::isfinite(scale)) found_.push_back({step_of_[read_ % kLag], r.index});
  ++read_;
}

void NonFiniteWatch::after_step(int64_t step) {
  step_of_[queued_ % kLag] = step;
  ++queued_;
  // The next record overwrites record queued_ - kLag's slot: read it first.
  while (queued_ - read_ >= kLag) read_next();
}

void NonFiniteWatch::drain() {
  while (read_ < queued_) read_next();
}

std::vector<NonFiniteWatch::Finding> NonFiniteWatch::take() { return std::exchange(found_, {}); }

}  // namespace dpt
