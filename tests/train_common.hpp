// Helpers shared by the tests that train through the Trainer: CPU devices, the quiet
// configurations they start from, a run compared between the CPU and the GPU, and the
// check that steps after the first allocate nothing.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <dptrain/train/trainer.hpp>
#include "catch.hpp"
#include "common.hpp"
#include "runtime/allocator.hpp"

namespace dpt::test {

// CPU devices first, first + 1, ...: each number seeds its own device (own memory, own pool).
inline std::vector<Device> cpus(int n, int first = 0) {
  std::vector<Device> d;
  for (int i = 0; i < n; ++i) d.push_back({DeviceType::cpu, first + i});
  return d;
}

// `model` trained with `opt` at the rate the tests use (SGD 0.05, its default; AdamW 0.003)
// on batches of `batch`, the loss read back only at the end (log_every 1000).
inline TrainConfig quiet_config(const std::string& model, const std::string& opt, int64_t batch) {
  TrainConfig c;
  c.model = model;
  c.optimizer = opt;
  c.lr = opt == "sgd" ? 0.05f : 0.003f;
  c.batch = batch;
  c.log_every = 1000;
  return c;
}

// The parameters at the end of a run of `c`.
inline std::vector<float> final_params(const TrainConfig& c) {
  Trainer t(c);
  t.run();
  return t.model().flat_params().to_host();
}

// Runs `c`, then `c` changed by `change`, and hands both trainers to `check`.
using CompareTrainers = std::function<void(Trainer& first, Trainer& second)>;
inline void run_and_rerun(TrainConfig c, const std::function<void(TrainConfig&)>& change,
                          const CompareTrainers& check) {
  Trainer first(c);
  first.run();
  change(c);
  Trainer second(c);
  second.run();
  check(first, second);
}

// The same run of `c` on the CPU, then on the GPU; `check` compares the two.
using CompareRuns =
    std::function<void(Trainer& on_cpu, const TrainResult& cpu_result, Trainer& on_gpu, const TrainResult& gpu_result)>;
inline void run_on_cpu_and_gpu(TrainConfig c, const CompareRuns& check) {
  c.devices = {host};
  Trainer a(c);
  const TrainResult ra = a.run();
  c.devices = {gpu};
  Trainer b(c);
  const TrainResult rb = b.run();
  check(a, ra, b, rb);
}

// The relative error of the GPU run's parameters against the CPU run's.
inline double params_error(Trainer& on_cpu, Trainer& on_gpu) {
  return rel_error(on_gpu.model().flat_params().to_host(), on_cpu.model().flat_params().to_host());
}

// The system allocations (cudaMalloc or malloc) on `devices` so far.
inline int64_t system_allocs(const std::vector<Device>& devices) {
  int64_t n = 0;
  for (const Device& d : devices) n += allocator(d).stats().system_allocs;
  return n;
}

// Runs t's first step as a run's first step (which is logged) and `also_first` (the
// first validation, say), then the rest of the run, returned: the rest allocates nothing
// on `devices`.
inline TrainResult check_no_allocs_after_first(Trainer& t, const std::vector<Device>& devices,
                                               const std::function<void()>& also_first = {}) {
  t.step(0, /*measure=*/true);
  if (also_first) also_first();
  const int64_t after_first = system_allocs(devices);
  const TrainResult r = t.run();
  CHECK(system_allocs(devices) == after_first);
  return r;
}

}  // namespace dpt::test
