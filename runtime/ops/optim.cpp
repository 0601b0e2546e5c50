// The optimizer updates and the gradient checks around them: clip_coef, the checks
// (shard_check, finish_check, check_gradients), the plain, checked and alternating SGD
// and AdamW updates, and the shadow made again as the last update rounded it.
#include <cstring>
#include <span>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/ops.hpp>
#include "internal.hpp"
#include "kernels/cpu/cpu.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/cuda.hpp"
#endif

namespace dpt {

using namespace detail;

Tensor clip_coef(const Tensor& norm_sq, float max_norm) {
  need_f32(norm_sq, "clip_coef");
  Tensor out = Tensor::empty({1}, DType::f32, norm_sq.device());
  DPT_CUDA_OR_CPU(norm_sq.device(), cuda::clip_coef(norm_sq.f32(), max_norm, out.f32(), stream_of(norm_sq.device())),
                  cpu::clip_coef(norm_sq.f32(), max_norm, out.f32()));
  return out;
}

namespace {
CheckRingArgs ring_args(const CheckRing& ring, const Tensor& on, const char* op) {
  if (!ring.records) return {};
  DPT_CHECK(ring.slots > 0 && ring.count.defined() && ring.count.dtype() == DType::i32 && ring.count.numel() == 2,
            std::string(op) + ": a ring has slots and an int64 count");
  same_device(on, ring.count, op);
  return {ring.records, ring.slots, reinterpret_cast<int64_t*>(ring.count.i32())};
}
int64_t* int64_of(const Tensor& t, const char* op) {
  DPT_CHECK(t.defined() && t.dtype() == DType::i32 && t.numel() == 2, std::string(op) + ": an int64 is i32 [2]");
  return reinterpret_cast<int64_t*>(t.i32());
}
}  // namespace

void shard_check(const Tensor& grads, int64_t base, const Tensor& sum, const Tensor& first_bad) {
  need_f32(grads, "shard_check");
  need_f32(sum, "shard_check");
  DPT_CHECK(base >= 0 && sum.numel() == 1, "shard_check: a negative base or a sum of more than one element");
  same_device(grads, sum, "shard_check");
  same_device(grads, first_bad, "shard_check");
  const Device& d = grads.device();
  const float* g = grads.numel() > 0 ? grads.f32() : nullptr;
  const int64_t count = grads.numel();
  DPT_CUDA_OR_CPU(d,
                  cuda::shard_check(g, count, base, sum.f32(), int64_of(first_bad, "shard_check"),
                                    reduce_work(d, 3 * cuda::kReduceWork).f32(), context(d).counter(), stream_of(d)),
                  cpu::shard_check(g, count, base, sum.f32(), int64_of(first_bad, "shard_check")));
}

Tensor finish_check(const Tensor& sum, const Tensor& first_bad, float max_norm, const CheckRing& ring) {
  need_f32(sum, "finish_check");
  same_device(sum, first_bad, "finish_check");
  const Device& d = sum.device();
  const CheckRingArgs args = ring_args(ring, sum, "finish_check");
  Tensor out = Tensor::empty({1}, DType::f32, d);
  DPT_CUDA_OR_CPU(
      d, cuda::finish_check(sum.f32(), int64_of(first_bad, "finish_check"), max_norm, out.f32(), args, stream_of(d)),
      cpu::finish_check(sum.f32(), int64_of(first_bad, "finish_check"), max_norm, out.f32(),
                        ring.records ? &args : nullptr));
  return out;
}

Tensor check_gradients(const Tensor& grads, float max_norm, const CheckRing& ring) {
  need_f32(grads, "check_gradients");
  const Device& d = grads.device();
  const CheckRingArgs args = ring_args(ring, grads, "check_gradients");
  Tensor out = Tensor::empty({1}, DType::f32, d);
  DPT_CUDA_OR_CPU(
      d,
      cuda::check_gradients(grads.f32(), grads.numel(), max_norm, out.f32(),
                            reduce_work(d, 3 * cuda::kReduceWork).f32(), context(d).counter(), args, stream_of(d)),
      cpu::check_gradients(grads.f32(), grads.numel(), max_norm, out.f32(), ring.records ? &args : nullptr));
  return out;
}

namespace {
// The shadow's pointer (null when undefined), checked against the parameters.
uint16_t* shadow_of(const Tensor& shadow, const Tensor& p, const char* op) {
  if (!shadow.defined()) return nullptr;
  need_bf16(shadow, op);
  same_device(shadow, p, op);
  DPT_CHECK(shadow.numel() == p.numel(), std::string(op) + ": the bf16 shadow's size differs from the parameters'");
  return shadow.bf16();
}
}  // namespace

namespace {
StepCounterArgs counter_args(const StepCounter* step, const Tensor& p, const char* op) {
  if (!step) return {};
  DPT_CHECK(step->counter.dtype() == DType::i32 && step->counter.numel() == 4,
            std::string(op) + ": a step counter is an i32 [4]");
  same_device(step->counter, p, op);
  int32_t* c = step->counter.i32();
  return {reinterpret_cast<int64_t*>(c),
          reinterpret_cast<unsigned*>(c + 2),
          step->schedule,
          step->beta1,
          step->beta2,
          step->advance,
          step->rounding};
}
}  // namespace

namespace {
// An update's grad_scale: one f32 on the parameters' device, or none (undefined).
const float* scale_of(const Tensor& grad_scale, const Tensor& p, const char* op) {
  if (!grad_scale.defined()) return nullptr;
  if (grad_scale.numel() != 1 || grad_scale.dtype() != DType::f32 || grad_scale.device() != p.device())
    throw UsageError(std::string(op) + ": grad_scale must be one f32 on " + p.device().str() + ", got " +
                     dtype_name(grad_scale.dtype()) + shape_str(grad_scale.shape()) + " on " +
                     grad_scale.device().str());
  return grad_scale.f32();
}
}  // namespace

void sgd_step(const Tensor& p, const Tensor& g, const Tensor& buf, const SgdArgs& a, const Tensor& grad_scale,
              const Tensor& shadow, const StepCounter* step) {
  need_f32(p, "sgd_step");
  need_f32(g, "sgd_step");
  DPT_CHECK(p.numel() == g.numel() && (!buf.defined() || buf.numel() == p.numel()), "sgd_step: buffer sizes differ");
  DPT_CHECK(a.momentum == 0.0f || buf.defined() || p.numel() == 0, "sgd_step: momentum needs a momentum buffer");
  float* b = buf.defined() ? buf.f32() : nullptr;
  const float* sc = scale_of(grad_scale, p, "sgd_step");
  uint16_t* sh = shadow_of(shadow, p, "sgd_step");
  const StepCounterArgs st = counter_args(step, p, "sgd_step");
  DPT_CUDA_OR_CPU(p.device(), cuda::sgd_step(p.f32(), g.f32(), b, p.numel(), a, sc, sh, st, stream_of(p.device())),
                  cpu::sgd_step(p.f32(), g.f32(), b, p.numel(), a, sc, sh, step ? &st : nullptr));
}

void adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamArgs& a,
                const Tensor& grad_scale, const Tensor& shadow, const StepCounter* step) {
  need_f32(p, "adamw_step");
  need_f32(g, "adamw_step");
  DPT_CHECK(p.numel() == g.numel() && (p.numel() == 0 || (m.numel() == p.numel() && v.numel() == p.numel())),
            "adamw_step: buffer sizes differ");
  const float* sc = scale_of(grad_scale, p, "adamw_step");
  uint16_t* sh = shadow_of(shadow, p, "adamw_step");
  const StepCounterArgs st = counter_args(step, p, "adamw_step");
  float* mp = m.defined() ? m.f32() : nullptr;
  float* vp = v.defined() ? v.f32() : nullptr;
  DPT_CUDA_OR_CPU(p.device(),
                  cuda::adamw_step(p.f32(), g.f32(), mp, vp, p.numel(), a, sc, sh, st, stream_of(p.device())),
                  cpu::adamw_step(p.f32(), g.f32(), mp, vp, p.numel(), a, sc, sh, step ? &st : nullptr));
}

void refresh_shadow(const Tensor& p, const Tensor& shadow, const StepCounter& step) {
  need_f32(p, "refresh_shadow");
  DPT_CHECK(shadow.defined(), "refresh_shadow: no shadow");
  uint16_t* sh = shadow_of(shadow, p, "refresh_shadow");
  const StepCounterArgs st = counter_args(&step, p, "refresh_shadow");
  DPT_CUDA_OR_CPU(p.device(), cuda::refresh_shadow(p.f32(), sh, p.numel(), st, stream_of(p.device())),
                  cpu::refresh_shadow(p.f32(), sh, p.numel(), st));
}

int64_t checked_update_backup_size(const Tensor& p, int buffers, float max_norm) {
#if DPT_WITH_CUDA
  if (p.device().is_cuda()) return cuda::speculative_backup_floats(p.numel(), buffers, max_norm);
#endif
  (void)p, (void)buffers, (void)max_norm;
  return 0;
}

namespace {
// The speculative update's backup: null where there is none (the two-launch or barrier
// form runs).
[[maybe_unused]] float* backup_of(const Tensor& backup, const Tensor& p, int buffers, float max_norm, const char* op) {
  const int64_t need = checked_update_backup_size(p, buffers, max_norm);
  if (!backup.defined() || need == 0) return nullptr;
  need_f32(backup, op);
  DPT_CHECK(
      backup.numel() >= need && backup.device() == p.device() && reinterpret_cast<uintptr_t>(backup.f32()) % 16 == 0,
      std::string(op) + ": the backup holds " + std::to_string(backup.numel()) + " floats, the update needs " +
          std::to_string(need) + ", 16-byte aligned, on " + p.device().str());
  return backup.f32();
}
}  // namespace

Tensor checked_sgd_step(const Tensor& p, const Tensor& g, const Tensor& buf, const SgdArgs& a, float max_norm,
                        const CheckRing& ring, const Tensor& shadow, const StepCounter& step,
                        [[maybe_unused]] const Tensor& backup) {
  need_f32(p, "checked_sgd_step");
  need_f32(g, "checked_sgd_step");
  DPT_CHECK(p.numel() == g.numel() && (!buf.defined() || buf.numel() == p.numel()),
            "checked_sgd_step: buffer sizes differ");
  DPT_CHECK(a.momentum == 0.0f || buf.defined() || p.numel() == 0,
            "checked_sgd_step: momentum needs a momentum buffer");
  const Device& d = p.device();
  const CheckRingArgs r = ring_args(ring, g, "checked_sgd_step");
  const StepCounterArgs st = counter_args(&step, p, "checked_sgd_step");
  float* b = buf.defined() ? buf.f32() : nullptr;
  uint16_t* sh = shadow_of(shadow, p, "checked_sgd_step");
  Tensor scale = Tensor::empty({1}, DType::f32, d);
  DPT_CUDA_OR_CPU(d,
                  cuda::checked_sgd_step(p.f32(), g.f32(), b, p.numel(), a, sh, st, max_norm, scale.f32(),
                                         reduce_work(d, 3 * cuda::kReduceWork).f32(), context(d).counter(), r,
                                         backup_of(backup, p, a.momentum != 0.0f ? 2 : 1, max_norm, "checked_sgd_step"),
                                         stream_of(d)),
                  [&] {  // the CPU has no launches to save
                    cpu::check_gradients(g.f32(), g.numel(), max_norm, scale.f32(), ring.records ? &r : nullptr);
                    cpu::sgd_step(p.f32(), g.f32(), b, p.numel(), a, scale.f32(), sh, &st);
                  }());
  return scale;
}

Tensor checked_adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamArgs& a,
                          float max_norm, const CheckRing& ring, const Tensor& shadow, const StepCounter& step,
                          [[maybe_unused]] const Tensor& backup) {
  need_f32(p, "checked_adamw_step");
  need_f32(g, "checked_adamw_step");
  DPT_CHECK(p.numel() == g.numel() && (p.numel() == 0 || (m.numel() == p.numel() && v.numel() == p.numel())),
            "checked_adamw_step: buffer sizes differ");
  const Device& d = p.device();
  const CheckRingArgs r = ring_args(ring, g, "checked_adamw_step");
  const StepCounterArgs st = counter_args(&step, p, "checked_adamw_step");
  float* mp = m.defined() ? m.f32() : nullptr;
  float* vp = v.defined() ? v.f32() : nullptr;
  uint16_t* sh = shadow_of(shadow, p, "checked_adamw_step");
  Tensor scale = Tensor::empty({1}, DType::f32, d);
  DPT_CUDA_OR_CPU(d,
                  cuda::checked_adamw_step(p.f32(), g.f32(), mp, vp, p.numel(), a, sh, st, max_norm, scale.f32(),
                                           reduce_work(d, 3 * cuda::kReduceWork).f32(), context(d).counter(), r,
                                           backup_of(backup, p, 3, max_norm, "checked_adamw_step"), stream_of(d)),
                  [&] {  // the CPU has no launches to save
                    cpu::check_gradients(g.f32(), g.numel(), max_norm, scale.f32(), ring.records ? &r : nullptr);
                    cpu::adamw_step(p.f32(), g.f32(), mp, vp, p.numel(), a, scale.f32(), sh, &st);
                  }());
  return scale;
}

namespace {
// What both alternating updates check and pass: the gradients, f32 and of p's size; the
// buffers, each of `now` and `next` the same size, f32, on p's device, not the same memory;
// the ring, step counter and shadow as the kernels take them; and the scale to return.
struct AlternatingCall {
  CheckRingArgs ring;
  StepCounterArgs step;
  uint16_t* shadow;
  Tensor scale;
};
using TwinPair = std::pair<const Tensor*, const Tensor*>;
AlternatingCall alternating_call(const Tensor& g, std::span<const TwinPair> now_next, const Tensor& p,
                                 const CheckRing& ring, const Tensor& shadow, const StepCounter& step, const char* op) {
  need_f32(g, op);
  DPT_CHECK(g.numel() == p.numel() && p.numel() > 0, std::string(op) + ": gradients of another size, or none");
  for (const auto& [now, next] : now_next) {
    need_f32(*now, op);
    need_f32(*next, op);
    same_device(*now, p, op);
    same_device(*next, p, op);
    DPT_CHECK(now->numel() == p.numel() && next->numel() == p.numel(),
              std::string(op) + ": the two copies' sizes differ from the parameters'");
    DPT_CHECK(now->data() != next->data(), std::string(op) + ": a buffer and its next copy are the same memory");
  }
  return {ring_args(ring, g, op), counter_args(&step, p, op), shadow_of(shadow, p, op),
          Tensor::empty({1}, DType::f32, p.device())};
}

// The CPU's form: the check, the current copy copied into the next, the update there in
// place (the GPU's bits: the same expressions; a skipped step leaves the copy as it is).
bool cpu_reads_first(const StepCounterArgs& st, int64_t t) { return (*st.t & 1) == (t & 1); }
}  // namespace

Tensor alternating_sgd_step(const Tensor& p, const Tensor& g, const Tensor& momentum_buf, const Tensor& next_p,
                            const Tensor& next_buf, const SgdArgs& a, const CheckRing& ring, const Tensor& shadow,
                            const StepCounter& step, int64_t t) {
  const char* op = "alternating_sgd_step";
  const bool mom = a.momentum != 0.0f;
  DPT_CHECK(mom == momentum_buf.defined() && mom == next_buf.defined(),
            std::string(op) + ": momentum needs both copies of the momentum buffer, and only momentum has them");
  const TwinPair twins[] = {{&p, &next_p}, {&momentum_buf, &next_buf}};  // no vector: a step allocates nothing
  const auto [r, st, sh, scale] = alternating_call(g, std::span(twins, mom ? 2 : 1), p, ring, shadow, step, op);
  const Device& d = p.device();
  float* const params[2] = {p.f32(), next_p.f32()};
  float* const bufs[2] = {mom ? momentum_buf.f32() : nullptr, mom ? next_buf.f32() : nullptr};
  const auto on_cpu = [&] {
    const int c = cpu_reads_first(st, t) ? 0 : 1;
    std::memcpy(params[1 - c], params[c], p.nbytes());
    if (mom) std::memcpy(bufs[1 - c], bufs[c], p.nbytes());
    cpu::check_gradients(g.f32(), g.numel(), 0.0f, scale.f32(), ring.records ? &r : nullptr);
    cpu::sgd_step(params[1 - c], g.f32(), bufs[1 - c], p.numel(), a, scale.f32(), sh, &st);
  };
  DPT_CUDA_OR_CPU(
      d,
      cuda::alternating_sgd_step(g.f32(), g.numel(), params, bufs, a, sh, st, t & 1, scale.f32(),
                                 reduce_work(d, 3 * cuda::kReduceWork).f32(), context(d).counter(), r, stream_of(d)),
      on_cpu());
  return scale;
}

Tensor alternating_adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const Tensor& next_p,
                              const Tensor& next_m, const Tensor& next_v, const AdamArgs& a, const CheckRing& ring,
                              const Tensor& shadow, const StepCounter& step, int64_t t) {
  const TwinPair twins[] = {{&p, &next_p}, {&m, &next_m}, {&v, &next_v}};
  const auto [r, st, sh, scale] = alternating_call(g, twins, p, ring, shadow, step, "alternating_adamw_step");
  const Device& d = p.device();
  float* const params[2] = {p.f32(), next_p.f32()};
  float* const ms[2] = {m.f32(), next_m.f32()};
  float* const vs[2] = {v.f32(), next_v.f32()};
  const auto on_cpu = [&] {
    const int c = cpu_reads_first(st, t) ? 0 : 1;
    for (float* const* b : {params, ms, vs}) std::memcpy(b[1 - c], b[c], p.nbytes());
    cpu::check_gradients(g.f32(), g.numel(), 0.0f, scale.f32(), ring.records ? &r : nullptr);
    cpu::adamw_step(params[1 - c], g.f32(), ms[1 - c], vs[1 - c], p.numel(), a, scale.f32(), sh, &st);
  };
  DPT_CUDA_OR_CPU(
      d,
      cuda::alternating_adamw_step(g.f32(), g.numel(), params, ms, vs, a, sh, st, t & 1, scale.f32(),
                                   reduce_work(d, 3 * cuda::kReduceWork).f32(), context(d).counter(), r, stream_of(d)),
      on_cpu());
  return scale;
}

}  // namespace dpt
