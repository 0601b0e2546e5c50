// Stochastic rounding of the optimizers' bf16 shadow (TrainConfig::bf16_rounding): each
// value rounds to one of its two bf16 neighbours, unbiased; the random bits are a function
// of (seed, step, flat index), so runs repeat, ZeRO shards and resumed runs round alike
// and replicas stay identical; on the GPU, every update gives the CPU twin's bits.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include <dptrain/optim/optim.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/train/trainer.hpp>
#include "kernels/bf16.hpp"
#include "kernels/cpu/cpu.hpp"
#include "kernels/shadow.hpp"

#include "catch.hpp"
#include "common.hpp"
#include "train_common.hpp"

using namespace dpt;
using namespace dpt::test;

namespace {
const ShadowRounding kStochastic{Bf16Rounding::stochastic, 1234, 0};
}  // namespace

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

namespace {
// A CPU update's step counter at `*count` (count[1]: the block count), rounding as `r`.
StepCounterArgs counter_at(int64_t* count, const ShadowRounding& r) {
  StepCounterArgs st;
  st.t = count;
  st.blocks_done = reinterpret_cast<unsigned*>(count + 1);
  st.beta1 = 0.9f;
  st.beta2 = 0.999f;
  st.rounding = r;
  return st;
}

// The shadow that an SGD update without gradients (the parameters stay) writes over n
// copies of x at step `step`: n draws of x's rounding.
std::vector<uint16_t> draws(float x, int64_t n, int64_t step) {
  std::vector<float> p(static_cast<size_t>(n), x), g(static_cast<size_t>(n), 0.0f);
  std::vector<uint16_t> shadow(static_cast<size_t>(n));
  int64_t counter[2] = {step, 0};
  const StepCounterArgs st = counter_at(counter, kStochastic);
  cpu::sgd_step(p.data(), g.data(), nullptr, n, SgdArgs{}, nullptr, shadow.data(), &st);
  CHECK(p == std::vector<float>(static_cast<size_t>(n), x));
  return shadow;
}
}  // namespace

TEST_CASE("stochastic rounding takes one of the two bf16 neighbours, up as often as the distance says",
          "[optim][bf16]") {
  // x's bits truncated are the neighbour toward zero; the next bf16 the one away from it,
  // drawn with probability (x's dropped 16 bits) / 2^16: 1 + 2^-10 is an eighth of the way
  // from 1 to 1 + 2^-7, 1 + 3 * 2^-9 three quarters; the largest float rounds up to Inf
  // all but once in 2^16; an exact bf16 never moves.
  const int64_t n = int64_t{1} << 16;
  const float largest = bits_float(0x7f7fffffu);
  for (float x : {1.0f + 0x1p-10f, 1.0f + 3 * 0x1p-9f, -(1.0f + 0x1p-10f), 0.0123f, 3.5e-20f, largest, 1.0f, -2.0f}) {
    const uint32_t b = float_bits(x);
    const auto toward_zero = static_cast<uint16_t>(b >> 16), away = static_cast<uint16_t>(toward_zero + 1);
    const double p = static_cast<double>(b & 0xffffu) / 65536.0;
    INFO("x " << x << ", rounds away from zero with probability " << p);
    int64_t up = 0, elsewhere = 0;
    double sum = 0.0;
    for (uint16_t h : draws(x, n, 7)) {
      elsewhere += h != toward_zero && h != away;
      up += h == away;
      sum += static_cast<double>(bf16_float(h));
    }
    CHECK(elsewhere == 0);
    const double frac = static_cast<double>(up) / static_cast<double>(n), sigma = std::sqrt(p * (1.0 - p) / n);
    CHECK(std::fabs(frac - p) <= 3.0 * sigma);
    if (p == 0.0) CHECK(up == 0);
    if (std::isfinite(bf16_float(away))) {  // unbiased: the mean of the draws is x, within 3 sigma
      const double gap = std::fabs(static_cast<double>(bf16_float(away)) - bf16_float(toward_zero));
      CHECK(std::fabs(sum / static_cast<double>(n) - static_cast<double>(x)) <= 3.0 * gap * sigma + 1e-12 * gap);
    }
  }
  // Inf and NaN round as to nearest.
  for (uint32_t r : {0u, 0x7fffu, 0xffffu, 0xdeadbeefu})
    for (float x : {INFINITY, -INFINITY, NAN}) CHECK(bf16_round_stochastic(x, r) == bf16_round(x));
}

TEST_CASE("stochastic rounding's bits are a function of the seed, the step and the flat index", "[optim][bf16]") {
  const int64_t n = 1003, k = 3;  // a shard from an index that is no multiple of 4
  const std::vector<float> p0 = randn(n, 1, 0.1f), g = randn(n, 2);
  // One AdamW update from p0 at counter `t`, rounded as `r`, of elements [from, n).
  auto update = [&](ShadowRounding r, int64_t t, int64_t from, const float* scale) {
    std::vector<float> p(p0.begin() + from, p0.end()), m(p.size(), 0.0f), v(p.size(), 0.0f);
    std::vector<uint16_t> shadow(p.size());
    int64_t counter[2] = {t, 0};
    StepCounterArgs st = counter_at(counter, r);
    st.rounding.first = from;
    cpu::adamw_step(p.data(), g.data() + from, m.data(), v.data(), n - from, AdamArgs{}, scale, shadow.data(), &st);
    CHECK(counter[0] == t + 1);
    return std::tuple{p, shadow, counter[0]};
  };
  const auto [p1, s1, t1] = update(kStochastic, 4, 0, nullptr);
  const auto [p2, s2, t2] = update(kStochastic, 4, 0, nullptr);
  CHECK(s1 == s2);  // the same bits on a second run
  const auto [pn, sn, tn] = update({}, 4, 0, nullptr);
  CHECK(pn == p1);  // the rounding changes the copy alone
  CHECK(sn != s1);
  std::vector<uint16_t> nearest(static_cast<size_t>(n));
  cpu::cast_f32_bf16(p1.data(), nearest.data(), n);
  CHECK(sn == nearest);
  ShadowRounding other_seed = kStochastic;
  other_seed.seed = 99;
  CHECK(std::get<1>(update(other_seed, 4, 0, nullptr)) != s1);
  CHECK(std::get<1>(update(kStochastic, 5, 0, nullptr)) != s1);
  // A ZeRO shard of elements [k, n) rounds them as the whole buffer's update does.
  const auto [pk, sk, tk] = update(kStochastic, 4, k, nullptr);
  CHECK(std::vector<float>(p1.begin() + k, p1.end()) == pk);
  CHECK(std::vector<uint16_t>(s1.begin() + k, s1.end()) == sk);

  // refresh_shadow makes the last update's shadow again (a resume, ZeRO's gather); before
  // any step it is the cast.
  std::vector<uint16_t> again(static_cast<size_t>(n));
  int64_t counter[2] = {t1, 0};
  const StepCounterArgs st = counter_at(counter, kStochastic);
  cpu::refresh_shadow(p1.data(), again.data(), n, st);
  CHECK(again == s1);
  CHECK(counter[0] == t1);
  counter[0] = 0;
  cpu::refresh_shadow(p1.data(), again.data(), n, st);
  CHECK(again == nearest);

  // A skipped step leaves the parameters and writes their shadow with its own bits, which
  // refresh_shadow then gives; to nearest it leaves the shadow as it was.
  const float bad = NAN;
  const auto [ps, ss, ts] = update(kStochastic, 6, 0, &bad);
  CHECK(ps == p0);
  counter[0] = ts;
  cpu::refresh_shadow(p0.data(), again.data(), n, st);
  CHECK(ss == again);
  cpu::cast_f32_bf16(p0.data(), nearest.data(), n);
  CHECK(ss != nearest);
  CHECK(std::get<1>(update({}, 6, 0, &bad)) == std::vector<uint16_t>(static_cast<size_t>(n), 0));
}

namespace {
// A short bf16 run of a small MLP on two CPU devices, rounded stochastically.
TrainConfig rounding_config() {
  TrainConfig c = quiet_config("16-64x2-4", "adamw", 32);
  c.devices = cpus(2);
  c.steps = 8;
  c.weight_decay = 0.1f;
  c.parallel.precision = Precision::bf16;
  c.bf16_rounding = Bf16Rounding::stochastic;
  return c;
}

// The parameters and the bits of their bf16 copy at the end of a run of `c`, whose
// replicas stay identical.
std::pair<std::vector<float>, std::vector<uint16_t>> run_with_shadow(const TrainConfig& c) {
  Trainer t(c);
  t.run();
  CHECK(t.parallel().replicas_identical());
  return {t.model().flat_params().to_host(), bf16_bits(t.model().flat_shadow())};
}
}  // namespace

TEST_CASE("a bf16 run rounded stochastically differs from nearest, resumes bit for bit and shards alike",
          "[optim][bf16][train]") {
  TempDir dir;
  const TrainConfig c = rounding_config();
  const auto straight = run_with_shadow(c);
  TrainConfig nearest = c;
  nearest.bf16_rounding = Bf16Rounding::nearest;
  const auto to_nearest = run_with_shadow(nearest);
  CHECK(to_nearest.first != straight.first);
  std::vector<uint16_t> cast_bits(straight.first.size());
  cpu::cast_f32_bf16(straight.first.data(), cast_bits.data(), static_cast<int64_t>(cast_bits.size()));
  CHECK(straight.second != cast_bits);  // the copy is no cast of the masters

  SECTION("resumed from a checkpoint: the run straight through, the copy too") {
    TrainConfig first = c;
    first.steps = 3;
    first.save = dir.file("run.safetensors");
    run_with_shadow(first);
    TrainConfig rest = c;
    rest.resume = first.save;
    CHECK(run_with_shadow(rest) == straight);
  }
  SECTION("ZeRO 1 and 2: each partition rounds its elements as the whole buffer's update") {
    for (int zero : {1, 2}) {
      INFO("zero " << zero);
      TrainConfig z = c;
      z.parallel.zero = zero;
      CHECK(run_with_shadow(z) == straight);
    }
  }
  SECTION("refused without a bf16 copy, and where only the master updates") {
    TrainConfig f = c;
    f.parallel.precision = Precision::fp32;
    check_one_line(usage_error([&] { Trainer t(f); }), "TrainConfig::bf16_rounding stochastic",
                   "which only DataParallelOptions::precision bf16 keeps");
    TrainConfig p2p = c;
    p2p.parallel.reduce = Reduce::p2p;
    check_one_line(usage_error([&] { Trainer t(p2p); }), "TrainConfig::bf16_rounding stochastic",
                   "DataParallelOptions::reduce p2p copies the master's to the others");
  }
}

#endif  // !DPT_GPU_TESTS

#ifdef DPT_GPU_TESTS  // ---- the CUDA cases (dpt_gpu_tests) ----

namespace {
// The CPU twin's rounding of p (kernels/shadow.hpp) at `step`, from flat index `first`.
std::vector<uint16_t> rounded_on_cpu(const std::vector<float>& p, int64_t first, int64_t step) {
  ShadowRounding r = kStochastic;
  r.first = first;
  std::vector<uint16_t> out(p.size());
  const ShadowStore s = shadow_store(out.data(), r, step);
  for (size_t i = 0; i < p.size(); ++i) s.store(static_cast<int64_t>(i), p[i]);
  return out;
}

// Elements whose parameters are equal in a and b and whose shadows are not.
int64_t rounded_apart(const std::vector<float>& pa, const std::vector<uint16_t>& sa, const std::vector<float>& pb,
                      const std::vector<uint16_t>& sb) {
  int64_t apart = 0;
  for (size_t i = 0; i < pa.size(); ++i) apart += pa[i] == pb[i] && sa[i] != sb[i];
  return apart;
}
}  // namespace

TEST_CASE("stochastic rounding: every CUDA update writes the CPU twin's shadow bit for bit", "[gpu][optim][bf16]") {
  // The plain update, the checked one with clipping (one launch with a barrier where it
  // fits), without clipping with a backup (speculative) and the alternating one, SGD with
  // momentum and AdamW under a cosine schedule, three steps and then a fourth whose
  // gradient holds a NaN (skipped: the shadow written again with that step's bits); from
  // flat index 0 (a Philox block a float4) and 3 (a ZeRO shard's start, element by
  // element); sizes with scalar tails, one large enough for a grid-stride loop. Each
  // shadow is the CPU twin's rounding of the GPU's own parameters, bit for bit; the
  // parameters are the CPU's within float rounding (the schedule's cos and AdamW's powf
  // may differ in a last bit), and where they are equal, so are the shadows.
  const ScheduleArgs cosine{2, 0.05f, 1, 6};
  enum Mode { plain, checked, with_backup, alternating };
  for (int64_t n : {int64_t{5}, int64_t{100003}, (int64_t{1} << 21) + 3})
    for (int64_t first : {int64_t{0}, int64_t{3}})
      for (bool adam : {false, true}) {
        // The parameters and shadow after three steps, the shadow after the skipped fourth
        // and the shadow made again from the parameters (a resume, ZeRO's gather).
        using Result =
            std::tuple<std::vector<float>, std::vector<uint16_t>, std::vector<uint16_t>, std::vector<uint16_t>>;
        auto run = [&](const Device& d, Mode mode) -> Result {
          auto bad = randn(n, 21);
          bad[static_cast<size_t>(n / 2)] = NAN;
          const Tensor P = on(d, randn(n, 20, 0.1f), {n}), M = Tensor::zeros({n}, DType::f32, d),
                       V = Tensor::zeros({n}, DType::f32, d), G = on(d, randn(n, 22), {n}), B = on(d, bad, {n});
          const Tensor P2 = Tensor::empty({n}, DType::f32, d), M2 = Tensor::empty({n}, DType::f32, d),
                       V2 = Tensor::empty({n}, DType::f32, d);
          const Tensor S = cast(P, DType::bf16);
          StepCounter step{Tensor::zeros({4}, DType::i32, d), cosine, 0.9f, 0.999f};
          step.rounding = kStochastic;
          step.rounding.first = first;
          const int64_t backup_size = checked_update_backup_size(P, adam ? 3 : 2, 0.0f);
          const Tensor backup =
              mode == with_backup && backup_size > 0 ? Tensor::zeros({backup_size}, DType::f32, d) : Tensor();
          const SgdArgs sa{.lr = 1.0f, .momentum = 0.9f, .weight_decay = 0.01f};
          std::vector<float> params;
          std::vector<uint16_t> updated;
          for (int s = 0; s < 4; ++s) {
            const Tensor& g = s == 3 ? B : G;
            if (mode == alternating) {
              if (adam) alternating_adamw_step(P, g, M, V, P2, M2, V2, AdamArgs{}, {}, S, step, s);
              else alternating_sgd_step(P, g, M, P2, M2, sa, {}, S, step, s);
              P.swap_memory(P2);
              M.swap_memory(M2);
              if (adam) V.swap_memory(V2);
            } else if (mode != plain) {
              const float clip = mode == checked ? 0.5f : 0.0f;
              if (adam) checked_adamw_step(P, g, M, V, AdamArgs{}, clip, {}, S, step, backup);
              else checked_sgd_step(P, g, M, sa, clip, {}, S, step, backup);
            } else {
              const Tensor scale = check_gradients(g, 0.0f);
              if (adam) adamw_step(P, g, M, V, AdamArgs{}, scale, S, &step);
              else sgd_step(P, g, M, sa, scale, S, &step);
            }
            // The speculative update reads the parameters, state and counter before it
            // waits for the kernel ahead (launch.hpp), which in a step is the backward's or
            // the reduction's, never an update: wait here as a step's backward would.
            context(d).synchronize();
            if (s == 2) {
              params = P.to_host();
              updated = bf16_bits(S);
            }
          }
          CHECK(P.to_host() == params);  // the fourth step skipped
          const Tensor again = Tensor::zeros({n}, DType::bf16, d);
          refresh_shadow(P, again, step);
          return {params, updated, bf16_bits(S), bf16_bits(again)};
        };
        INFO("n " << n << ", first " << first << (adam ? ", adamw" : ", sgd"));
        for (Mode mode : {plain, checked, with_backup, alternating}) {
          INFO("mode " << mode);
          const auto [p_cpu, s_cpu, skip_cpu, again_cpu] = run(host, mode == alternating ? plain : mode);
          const auto [p_gpu, s_gpu, skip_gpu, again_gpu] = run(gpu, mode);
          CHECK(rel_error(p_gpu, p_cpu) <= 1e-6);
          CHECK(s_gpu == rounded_on_cpu(p_gpu, first, 2));
          CHECK(skip_gpu == rounded_on_cpu(p_gpu, first, 3));
          CHECK(again_gpu == skip_gpu);
          CHECK(rounded_apart(p_gpu, s_gpu, p_cpu, s_cpu) == 0);
          CHECK(rounded_apart(p_gpu, skip_gpu, p_cpu, skip_cpu) == 0);
          CHECK(again_cpu == skip_cpu);
        }
      }
}

#endif  // DPT_GPU_TESTS
