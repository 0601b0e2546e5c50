#include "nonfinite_watch.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace dpt {

NonFiniteWatch::NonFiniteWatch(const Device& master) : host_(sizeof(int32_t) * 2 * kLag, master), slots_(kLag) {
  for (Slot& s : slots_) s.done = std::make_unique<Event>(master);
}

void NonFiniteWatch::read(Slot& s, std::vector<Finding>& out) {
  if (s.step < 0) return;
  if (!s.done->ready()) s.done->synchronize();  // the device is kLag steps behind
  const int32_t* rec = static_cast<const int32_t*>(host_.data()) + 2 * (&s - slots_.data());
  float scale = 0;
  std::memcpy(&scale, rec, 4);
  if (!std::isfinite(scale)) out.push_back({s.step, rec[1]});
  s.step = -1;
}

std::vector<NonFiniteWatch::Finding> NonFiniteWatch::after_step(DataParallel& dp, int64_t step) {
  std::vector<Finding> out;
  const auto k = static_cast<size_t>(step % kLag);
  Slot& s = slots_[k];
  read(s, out);  // step - kLag's, before its slot is written again
  dp.record_nonfinite(static_cast<int32_t*>(host_.data()) + 2 * k, *s.done);
  s.step = step;
  return out;
}

std::vector<NonFiniteWatch::Finding> NonFiniteWatch::drain() {
  // In step order: the slots hold consecutive steps, the oldest first after the newest.
  std::vector<Slot*> held;
  for (Slot& s : slots_)
    if (s.step >= 0) held.push_back(&s);
  std::sort(held.begin(), held.end(), [](const Slot* a, const Slot* b) { return a->step < b->step; });
  std::vector<Finding> out;
  for (Slot* s : held) read(*s, out);
  return out;
}

}  // namespace dpt
