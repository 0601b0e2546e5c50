// optim_checked.cu — the updates that check the gradients in the same launch: the fused
// checked update (the check, a grid-wide barrier, the update), the speculative one (the
// update at once, undone from a backup where the check finds a non-finite gradient) and
// the alternating one over twin buffers; each finds check_gradients' scale and the plain
// updates' parameters bit for bit (grad_check.cuh, optim_update.cuh).
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>

#include "../bf16.hpp"
#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"
#include "grad_check.cuh"
#include "optim_update.cuh"

namespace dpt::cuda {
namespace {

// The check and the update in one launch, for small buffers (at most kFusedMax elements,
// 16-byte aligned) whose check grid fits on the GPU at once (the launcher makes sure, and
// launches it cooperatively). The check runs as check_gradients_kernel runs it, with the
// same grid and each thread's terms in the same order; every block waits until the last
// one has written its part (a grid-wide barrier: the blocks spin on `released`, the spare
// word of the step counter, until it holds this step's epoch, count + 1), adds the parts
// as check_gradients' last block does (the same scale bit for bit; block 0 writes it and
// the record) and updates its elements with the update kernels' own expressions (the same
// parameters bit for bit). One kernel less a step than check_gradients + the update.
//
// Hold: that grid gives a thread at most kHeld float4s (kFusedMax elements over
// kReduceWork blocks), so a thread loads its gradients and their optimizer state together
// before the check and keeps them in registers; after the barrier only the arithmetic and
// the stores remain, where a second pass over the buffers waits for memory again (the
// seed model's update, traced in a graph: 11.8 -> 9.7 us of the step). Twice the
// registers, so half the blocks fit at once: larger buffers take the second pass.
constexpr int64_t kFusedMax = int64_t{1} << 22;
constexpr int kHeld = 4;
static_assert(kFusedMax <= kReduceWork * kThreads * 4 * kHeld,
              "a thread of the fused grid holds at most kHeld float4s");

// Where the speculative update keeps what it overwrites: buffer k (the parameters, then
// the optimizer's state in the update's order) at data + k * stride, stride a multiple of
// 4 so that each starts 16-byte aligned.
struct Backup {
  float* data;
  int64_t stride;
  __device__ float* at(int k) const { return data + k * stride; }
  __device__ void put4(int k, int64_t i, float4 v) const { reinterpret_cast<float4*>(at(k))[i] = v; }
};

// An update's parts for the fused kernel: load(i) the state of float4 i, store(...) its
// update from the gradient float4, one(i, ...) a scalar element (the last n % 4); loop(...)
// the whole buffer's, as the update kernel runs it. For the speculative update's backup:
// save and save1 a float4's state and a scalar element's into it; backed(i) a float4's
// state from it and put(...) that state back in place (the bf16 shadow made again from the
// parameters), restore1(i) a scalar element's.
struct SgdUpdate {
  float *p, *buf;
  SgdArgs a;
  ShadowStore shadow;
  using State = SgdState4;
  __device__ void set_values(const float* values, int64_t step) {
    a.lr = values[0];
    shadow.step = step;
  }
  __device__ State load(int64_t i) const { return sgd_load4(p, buf, a.momentum != 0.f, i); }
  __device__ void store(State s, float4 g, int64_t i, float scale) const {
    sgd_store4(s, g, i, p, buf, a, scale, shadow);
  }
  __device__ void one(int64_t i, const float* g, float scale) const { sgd_one(i, p, g, buf, a, scale, shadow); }
  __device__ void loop(const float* g, int64_t n, float scale) const { sgd_loop<true>(p, g, buf, n, a, scale, shadow); }
  __device__ void skipped(int64_t n) const { shadow_again<true>(p, n, shadow); }
  // The speculative update's backup (Backup: the parameters, then the momentum buffer).
  __device__ void save(const State& s, const Backup& b, int64_t i) const {
    b.put4(0, i, s.p);
    if (a.momentum != 0.f) b.put4(1, i, s.buf);
  }
  __device__ void save1(const Backup& b, int64_t i) const {
    b.at(0)[i] = p[i];
    if (a.momentum != 0.f) b.at(1)[i] = buf[i];
  }
  __device__ State backed(const Backup& b, int64_t i) const {
    return sgd_load4(b.at(0), b.at(1), a.momentum != 0.f, i);
  }
  __device__ void put(const State& s, int64_t i) const {
    reinterpret_cast<float4*>(p)[i] = s.p;
    if (a.momentum != 0.f) reinterpret_cast<float4*>(buf)[i] = s.buf;
    store_shadow4(shadow, i, s.p);
  }
  __device__ void restore1(const Backup& b, int64_t i) const {
    p[i] = b.at(0)[i];
    if (a.momentum != 0.f) buf[i] = b.at(1)[i];
    shadow.store(i, p[i]);
  }
  // The alternating update's: a scalar element updated from copy `from` into this one,
  // and one copied from `from` unchanged (the shadow made again).
  __device__ void one_from(const SgdUpdate& from, int64_t i, const float* g, float scale) const {
    const bool mom = a.momentum != 0.f;
    float pv = from.p[i];
    float bv = mom ? from.buf[i] : 0.f;
    sgd_update(pv, g[i], bv, a, scale);
    p[i] = pv;
    if (mom) buf[i] = bv;
    shadow.store(i, pv);
  }
  __device__ void copy1(const SgdUpdate& from, int64_t i) const {
    p[i] = from.p[i];
    if (a.momentum != 0.f) buf[i] = from.buf[i];
    shadow.store(i, p[i]);
  }
};
struct AdamUpdate {
  float *p, *m, *v;
  AdamArgs a;
  ShadowStore shadow;
  using State = AdamState4;
  __device__ void set_values(const float* values, int64_t step) {
    a.lr = values[0];
    a.bias_correction1 = values[1];
    a.bias_correction2 = values[2];
    shadow.step = step;
  }
  __device__ State load(int64_t i) const { return adamw_load4(p, m, v, i); }
  __device__ void store(State s, float4 g, int64_t i, float scale) const {
    adamw_store4(s, g, i, p, m, v, a, scale, shadow);
  }
  __device__ void one(int64_t i, const float* g, float scale) const { adamw_one(i, p, g, m, v, a, scale, shadow); }
  __device__ void loop(const float* g, int64_t n, float scale) const {
    adamw_loop<true>(p, g, m, v, n, a, scale, shadow);
  }
  __device__ void skipped(int64_t n) const { shadow_again<true>(p, n, shadow); }
  __device__ void save(const State& s, const Backup& b, int64_t i) const {
    b.put4(0, i, s.p);
    b.put4(1, i, s.m);
    b.put4(2, i, s.v);
  }
  __device__ void save1(const Backup& b, int64_t i) const {
    b.at(0)[i] = p[i];
    b.at(1)[i] = m[i];
    b.at(2)[i] = v[i];
  }
  __device__ State backed(const Backup& b, int64_t i) const { return adamw_load4(b.at(0), b.at(1), b.at(2), i); }
  __device__ void put(const State& s, int64_t i) const {
    reinterpret_cast<float4*>(p)[i] = s.p;
    reinterpret_cast<float4*>(m)[i] = s.m;
    reinterpret_cast<float4*>(v)[i] = s.v;
    store_shadow4(shadow, i, s.p);
  }
  __device__ void restore1(const Backup& b, int64_t i) const {
    p[i] = b.at(0)[i];
    m[i] = b.at(1)[i];
    v[i] = b.at(2)[i];
    shadow.store(i, p[i]);
  }
  __device__ void one_from(const AdamUpdate& from, int64_t i, const float* g, float scale) const {
    float pv = from.p[i], mv = from.m[i], vv = from.v[i];
    adamw_update(pv, g[i], mv, vv, a, scale, i);
    p[i] = pv;
    m[i] = mv;
    v[i] = vv;
    shadow.store(i, pv);
  }
  __device__ void copy1(const AdamUpdate& from, int64_t i) const {
    p[i] = from.p[i];
    m[i] = from.m[i];
    v[i] = from.v[i];
    shadow.store(i, p[i]);
  }
};

template <class Update, bool Hold>
static __global__ void checked_update_kernel(const float* g, int64_t n, float max_norm, float* part,
                                             long long* bad_part, unsigned* counter, float* scale, CheckRingArgs ring,
                                             StepCounterArgs step, Update update, float lr, float bc1, float bc2) {
  const float4* g4 = reinterpret_cast<const float4*>(g);
  const int64_t n4 = n / 4, tid = global_tid(), stride = grid_stride();
  float4 held_g[kHeld];
  typename Update::State held[kHeld];
  // Holding, the optimizer's state is loaded before the wait for the kernel before this one
  // (the one that makes the gradients), beside its end: only this update writes the
  // parameters and their state, and by the time this kernel starts, every kernel before
  // that one has finished (each waits for its own predecessor before it lets the next
  // start), the last update among them. (The seed model's update, traced in a graph:
  // 8.8 -> 8.0 us of the step.)
  if constexpr (Hold) {
#pragma unroll
    for (int k = 0; k < kHeld; ++k)
      if (tid + k * stride < n4) held[k] = update.load(tid + k * stride);
  }
  float values[3] = {lr, bc1, bc2};
  const int64_t t = read_step(step, values);  // before the wait, as the held state (above)
  update.set_values(values, t);
  const int64_t count = blockIdx.x == 0 && threadIdx.x == 0 ? ring_count(ring) : 0;  // write_check's
  DPT_WAIT_PREVIOUS_GRID();
  unsigned* released = step.blocks_done + 1;
  const auto epoch = static_cast<unsigned>(t + 1);
  float s = 0.f;
  long long bad = LLONG_MAX;
  if constexpr (Hold) {  // check_terms' terms, from the float4s held (increasing index), then the scalar tail
#pragma unroll
    for (int k = 0; k < kHeld; ++k)
      if (tid + k * stride < n4) held_g[k] = g4[tid + k * stride];
#pragma unroll
    for (int k = 0; k < kHeld; ++k)
      if (tid + k * stride < n4) check_take4(held_g[k], tid + k * stride, s, bad);
    for (int64_t i = 4 * n4 + tid; i < n; i += stride) check_take1(g[i], i, s, bad);
  } else {
    check_terms<true>(g, n, s, bad);
  }
  // The barrier: the last block to write its part releases the others at once; then every
  // block adds the parts itself (the same bits in each), so none waits for another's sum.
  if (check_block_part(s, bad, part, bad_part, counter)) atomicExch(released, epoch);
  if (threadIdx.x == 0)
    while (*reinterpret_cast<volatile unsigned*>(released) != epoch) {
    }
  __syncthreads();
  double total;
  long long first;
  check_total(part, bad_part, total, first);
  __shared__ float block_scale;
  if (threadIdx.x == 0) {
    block_scale = scale_from_norm_sq(static_cast<float>(total), max_norm);
    if (blockIdx.x == 0) write_check(static_cast<float>(total), first, max_norm, scale, ring, count);
  }
  __syncthreads();
  const float sc = block_scale;
  if (isfinite(sc)) {
    if constexpr (Hold) {
#pragma unroll
      for (int k = 0; k < kHeld; ++k)
        if (tid + k * stride < n4) update.store(held[k], held_g[k], tid + k * stride, sc);
      for (int64_t i = 4 * n4 + tid; i < n; i += stride) update.one(i, g, sc);
    } else {
      update.loop(g, n, sc);
    }
  } else {
    update.skipped(n);  // the whole update is skipped
  }
  count_step(step, t);
}

// The end of the updates that do not wait for the check (speculative, alternating): the
// last block to write its part of the check adds the parts (check_gradients' sum, bit for
// bit), writes the scale and the record and moves the step counter on (every block has
// read it, before its part). True in every thread of that block where the norm is not
// finite, so the step must be undone; false in every other block.
__device__ bool last_block_finds_skip(float s, long long bad, float* part, long long* bad_part, unsigned* counter,
                                      float* scale, const CheckRingArgs& ring, int64_t count,
                                      const StepCounterArgs& step, int64_t t) {
  if (!check_block_part(s, bad, part, bad_part, counter)) return false;  // every block's stores are visible to the last
  double total;
  long long first;
  check_total(part, bad_part, total, first);
  __shared__ bool skipped;
  if (threadIdx.x == 0) {
    write_check(static_cast<float>(total), first, 0.f, scale, ring, count);
    skipped = !isfinite(scale_from_norm_sq(static_cast<float>(total), 0.f));
    if (step.t && step.advance) *step.t = t + 1;
  }
  __syncthreads();
  return skipped;
}

// The undoing, by the one block: the state of each of the n4 float4s from load(i), put
// back by `to` (the shadow made again from the parameters). Four float4s in flight a
// thread: the stores of one round would otherwise keep the next round's loads waiting
// (the buffers might overlap, for all the compiler knows).
template <class Update, class Load>
__device__ void put_back4(const Update& to, int64_t n4, Load load) {
  constexpr int kRound = 4;
  for (int64_t i = threadIdx.x; i < n4; i += kRound * blockDim.x) {
    typename Update::State back[kRound];
#pragma unroll
    for (int k = 0; k < kRound; ++k)
      if (i + k * blockDim.x < n4) back[k] = load(i + k * blockDim.x);
#pragma unroll
    for (int k = 0; k < kRound; ++k)
      if (i + k * blockDim.x < n4) to.put(back[k], i + k * blockDim.x);
  }
}

// Without clipping the check's scale is 1 or NaN (skip the step), so the update need not
// wait for it: each block updates its elements as if the gradients were finite (scale 1:
// the update kernels' bits), having first copied what it overwrites into a backup, and
// the last block to write its part of the check adds the parts (check_gradients' sum, bit
// for bit), writes the scale and the record, moves the step counter on and, where the
// norm is not finite, puts the backup back, the bf16 shadow too: the step is skipped as
// the other kernels skip it. No grid-wide barrier (most of what the check added to the
// seed model's update: docs/performance-log.md) and no cooperative launch: any grid fits. The
// backup is the optimizer's own buffer, which no other kernel touches once made (launch.hpp
// says why it may be written before the wait for the kernel ahead). At most kFusedMax
// elements, whose grid gives a thread at most kHeld float4s to hold. A skipped step pays
// for the restoring by the one block (not measured: at a block's memory speed, of the
// order of a millisecond for 4M elements of AdamW, 48 MB read and written); skips are rare.
// `one` is 1, an argument so that the update's expressions compile as in the kernels
// that read their scale.
template <class Update>
static __global__ void speculative_update_kernel(const float* g, int64_t n, float* part, long long* bad_part,
                                                 unsigned* counter, float* scale, CheckRingArgs ring,
                                                 StepCounterArgs step, Update update, float lr, float bc1, float bc2,
                                                 Backup backup, float one) {
  const float4* g4 = reinterpret_cast<const float4*>(g);
  const int64_t n4 = n / 4, tid = global_tid(), stride = grid_stride();
  typename Update::State held[kHeld];
#pragma unroll
  for (int k = 0; k < kHeld; ++k)
    if (tid + k * stride < n4) {
      held[k] = update.load(tid + k * stride);
      update.save(held[k], backup, tid + k * stride);
    }
  for (int64_t i = 4 * n4 + tid; i < n; i += stride) update.save1(backup, i);
  float values[3] = {lr, bc1, bc2};
  const int64_t t = read_step(step, values);  // before the wait, as the held state (checked_update_kernel)
  update.set_values(values, t);
  const int64_t count = threadIdx.x == 0 ? ring_count(ring) : 0;  // the last block's thread 0 writes the record
  DPT_WAIT_PREVIOUS_GRID();
  float s = 0.f;
  long long bad = LLONG_MAX;
  float4 held_g[kHeld];
#pragma unroll
  for (int k = 0; k < kHeld; ++k)
    if (tid + k * stride < n4) held_g[k] = g4[tid + k * stride];
#pragma unroll
  for (int k = 0; k < kHeld; ++k)
    if (tid + k * stride < n4) {
      check_take4(held_g[k], tid + k * stride, s, bad);  // check_terms' order
      update.store(held[k], held_g[k], tid + k * stride, one);
    }
  for (int64_t i = 4 * n4 + tid; i < n; i += stride) {
    check_take1(g[i], i, s, bad);
    update.one(i, g, one);
  }
  if (!last_block_finds_skip(s, bad, part, bad_part, counter, scale, ring, count, step, t)) return;
  put_back4(update, n4, [&](int64_t i) { return update.backed(backup, i); });
  for (int64_t i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) update.restore1(backup, i);
}

// Without clipping, for buffers of any size: the update from the current copy of the
// parameters and optimizer state into a second copy (twin buffers), so that the gradients
// are read once, by the update, which adds the check's terms as it goes (check_terms'
// grid and order: check_gradients' sum bit for bit), where the two-launch form reads them
// twice (mlp: 168 MB, 47 us a step on the H200). The last block to write its part of the
// check writes the scale and the record and moves the step counter on; where the norm is
// not finite it copies the current copy into the other unchanged (the shadow made again
// from its parameters), so either way the other copy holds the state after the step and
// the caller swaps the two after every step. `first` and `second` are the two copies as
// the caller sees them when it queues the update, `first` current at a counter of
// `first_parity`'s parity: a CUDA graph's replays alternate by the counter on the device.
// A skipped step pays for the copy by the one block (not measured: one SM moving the whole
// state, for the mlp's 42M parameters 0.4 GB with SGD and 1 GB with AdamW, so several to
// tens of milliseconds); skips are rare. `one` is 1, an
// argument so that the update's expressions compile as in the kernels that read their
// scale.
template <class Update>
static __global__ void alternating_update_kernel(const float* g, int64_t n, float* part, long long* bad_part,
                                                 unsigned* counter, float* scale, CheckRingArgs ring,
                                                 StepCounterArgs step, Update first, Update second,
                                                 int64_t first_parity, float lr, float bc1, float bc2, float one) {
  DPT_WAIT_PREVIOUS_GRID();
  float values[3] = {lr, bc1, bc2};
  const int64_t t = read_step(step, values);
  const bool from_first = (t & 1) == first_parity;
  Update from = from_first ? first : second;
  Update to = from_first ? second : first;
  to.set_values(values, t);
  const float4* g4 = reinterpret_cast<const float4*>(g);
  const int64_t n4 = n / 4, stride = grid_stride();
  float s = 0.f;
  long long bad = LLONG_MAX;
  int64_t i = global_tid();
  for (; i + 3 * stride < n4; i += 4 * stride) {  // four float4s in flight a thread, as check_terms
    float4 gv[4];
    typename Update::State st[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      gv[k] = g4[i + k * stride];
      st[k] = from.load(i + k * stride);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      check_take4(gv[k], i + k * stride, s, bad);
      to.store(st[k], gv[k], i + k * stride, one);
    }
  }
  for (; i < n4; i += stride) {
    const float4 gv = g4[i];
    check_take4(gv, i, s, bad);
    to.store(from.load(i), gv, i, one);
  }
  for (int64_t j = 4 * n4 + global_tid(); j < n; j += stride) {
    check_take1(g[j], j, s, bad);
    to.one_from(from, j, g, one);
  }
  if (!last_block_finds_skip(s, bad, part, bad_part, counter, scale, ring, ring_count(ring), step, t)) return;
  put_back4(to, n4, [&](int64_t i) { return from.load(i); });
  for (int64_t j = 4 * n4 + threadIdx.x; j < n; j += blockDim.x) to.copy1(from, j);
}

}  // namespace

namespace {
// How many blocks of `kernel` (kThreads each) fit on the current device at once.
template <typename Kernel>
int64_t blocks_at_once(Kernel kernel) {
  int device = 0, sms = 0, per_sm = 0;
  DPT_CUDA_CHECK(cudaGetDevice(&device));
  DPT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  DPT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
  return static_cast<int64_t>(sms) * per_sm;
}

// The fused launch, when the buffers allow it (16-byte aligned, at most kFusedMax
// elements) and its grid fits on the device at once (every block waits for the last one;
// holding the buffers in registers where it fits so), else false: the caller checks and
// updates in two launches.
template <class Update>
bool launch_checked_update(bool aligned, const float* g, int64_t n, float max_norm, float* scale, float* work,
                           unsigned* counter, const CheckRingArgs& ring, const StepCounterArgs& step,
                           const Update& update, const float* values, float* backup, cudaStream_t stream) {
  if (!aligned || n == 0 || n > kFusedMax) return false;
  long long* bad_part = reinterpret_cast<long long*>(work + kReduceWork);
  if (backup && max_norm == 0.f) {
    launch_after_previous(speculative_update_kernel<Update>, reduce_blocks(n, 16), kThreads, stream, g, n, work,
                          bad_part, counter, scale, ring, step, update, values[0], values[1], values[2],
                          Backup{backup, (n + 3) / 4 * 4}, 1.f);
    return true;
  }
  if (!step.t) return false;  // the barrier's epoch is the step count
  // Per device, the blocks of each kernel that fit at once (0: not asked yet).
  static std::atomic<int64_t> fits_holding[64], fits_passing[64];
  int device = 0;
  DPT_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= 64) return false;
  const auto fits = [&](std::atomic<int64_t>& known, auto kernel) {
    int64_t most = known.load(std::memory_order_relaxed);
    if (most == 0) {
      most = blocks_at_once(kernel);
      known.store(most, std::memory_order_relaxed);
    }
    return most;
  };
  const unsigned blocks = reduce_blocks(n, 16);  // check_gradients' grid: the same sums
  const bool hold = blocks <= fits(fits_holding[device], checked_update_kernel<Update, true>);
  if (!hold && blocks > fits(fits_passing[device], checked_update_kernel<Update, false>)) return false;
  launch_after_previous_as(/*cooperative=*/true,
                           hold ? checked_update_kernel<Update, true> : checked_update_kernel<Update, false>, blocks,
                           kThreads, stream, g, n, max_norm, work, bad_part, counter, scale, ring, step, update,
                           values[0], values[1], values[2]);
  return true;
}
}  // namespace

int64_t speculative_backup_floats(int64_t n, int buffers, float max_norm) {
  return max_norm == 0.f && n > 0 && n <= kFusedMax ? buffers * ((n + 3) / 4 * 4) : 0;
}

void checked_sgd_step(float* p, const float* g, float* momentum_buf, int64_t n, const SgdArgs& a, uint16_t* shadow,
                      const StepCounterArgs& step, float max_norm, float* scale, float* work, unsigned* counter,
                      const CheckRingArgs& ring, float* backup, cudaStream_t stream) {
  const bool mom = a.momentum != 0.f;
  const bool vec = aligned16(p) && aligned16(g) && (!mom || aligned16(momentum_buf)) && aligned(shadow, 8);
  const float values[3] = {a.lr, 1.f, 1.f};
  const SgdUpdate u{p, momentum_buf, a, step_shadow(shadow, step, 0)};
  if (launch_checked_update(vec, g, n, max_norm, scale, work, counter, ring, step, u, values, backup, stream)) return;
  check_gradients(g, n, max_norm, scale, work, counter, ring, stream);
  sgd_step(p, g, momentum_buf, n, a, scale, shadow, step, stream);
}

void checked_adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& a, uint16_t* shadow,
                        const StepCounterArgs& step, float max_norm, float* scale, float* work, unsigned* counter,
                        const CheckRingArgs& ring, float* backup, cudaStream_t stream) {
  const bool vec = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) && aligned(shadow, 8);
  const float values[3] = {a.lr, a.bias_correction1, a.bias_correction2};
  const AdamUpdate u{p, m, v, a, step_shadow(shadow, step, 0)};
  if (launch_checked_update(vec, g, n, max_norm, scale, work, counter, ring, step, u, values, backup, stream)) return;
  check_gradients(g, n, max_norm, scale, work, counter, ring, stream);
  adamw_step(p, g, m, v, n, a, scale, shadow, step, stream);
}

namespace {
template <class Update>
void launch_alternating(const float* g, int64_t n, float* scale, float* work, unsigned* counter,
                        const CheckRingArgs& ring, const StepCounterArgs& step, const Update& first,
                        const Update& second, int64_t first_parity, const float* values, cudaStream_t stream) {
  launch_after_previous(alternating_update_kernel<Update>, reduce_blocks(n, 16), kThreads, stream, g, n, work,
                        reinterpret_cast<long long*>(work + kReduceWork), counter, scale, ring, step, first, second,
                        first_parity, values[0], values[1], values[2], 1.f);
}
}  // namespace

void alternating_sgd_step(const float* g, int64_t n, float* const p[2], float* const momentum_buf[2], const SgdArgs& a,
                          uint16_t* shadow, const StepCounterArgs& step, int64_t first_parity, float* scale,
                          float* work, unsigned* counter, const CheckRingArgs& ring, cudaStream_t stream) {
  const bool mom = a.momentum != 0.f;
  DPT_CHECK(n > 0 && step.t != nullptr && g != nullptr && p[0] != nullptr && p[1] != nullptr &&
                (!mom || (momentum_buf[0] != nullptr && momentum_buf[1] != nullptr)),
            "alternating_sgd_step: null pointer or no step counter");
  DPT_CHECK(aligned16(g) && aligned16(p[0]) && aligned16(p[1]) &&
                (!mom || (aligned16(momentum_buf[0]) && aligned16(momentum_buf[1]))) && aligned(shadow, 8),
            "alternating_sgd_step: buffers not 16-byte aligned");
  const float values[3] = {a.lr, 1.f, 1.f};
  const ShadowStore sh = step_shadow(shadow, step, 0);
  launch_alternating(g, n, scale, work, counter, ring, step, SgdUpdate{p[0], momentum_buf[0], a, sh},
                     SgdUpdate{p[1], momentum_buf[1], a, sh}, first_parity, values, stream);
}

void alternating_adamw_step(const float* g, int64_t n, float* const p[2], float* const m[2], float* const v[2],
                            const AdamArgs& a, uint16_t* shadow, const StepCounterArgs& step, int64_t first_parity,
                            float* scale, float* work, unsigned* counter, const CheckRingArgs& ring,
                            cudaStream_t stream) {
  for (int c = 0; c < 2; ++c)
    DPT_CHECK(
        p[c] != nullptr && m[c] != nullptr && v[c] != nullptr && aligned16(p[c]) && aligned16(m[c]) && aligned16(v[c]),
        "alternating_adamw_step: null or unaligned buffers");
  DPT_CHECK(n > 0 && step.t != nullptr && g != nullptr && aligned16(g) && aligned(shadow, 8),
            "alternating_adamw_step: no gradients, step counter or aligned shadow");
  const float values[3] = {a.lr, a.bias_correction1, a.bias_correction2};
  const ShadowStore sh = step_shadow(shadow, step, 0);
  launch_alternating(g, n, scale, work, counter, ring, step, AdamUpdate{p[0], m[0], v[0], a, sh},
                     AdamUpdate{p[1], m[1], v[1], a, sh}, first_parity, values, stream);
}

}  // namespace dpt::cuda
