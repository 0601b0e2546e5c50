// Shared by the CPU and GPU tests of p2p's chunked copy of the parameters to the replicas
// (DataParallel copies them layer by layer, and a replica's next forward waits for each
// layer's chunk only): a run with it (overlap) and one with the whole copy after the step
// (no overlap) must give the same parameters and evaluation losses, bit for bit.
#pragma once
#include <string>
#include <vector>

#include <dptrain/data/synthetic.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/parallel/data_parallel.hpp>
#include "catch.hpp"

namespace dpt::test {

// Six steps of an MLP whose four layers are a 1 MiB chunk each (the smallest copied alone)
// on `devs` through p2p, evaluated after every other step: replica 0's parameters and then
// the evaluation losses (every replica checked identical at the end).
inline std::vector<float> train_p2p_chunked(const std::vector<Device>& devs, bool overlap, Precision precision,
                                            const std::string& opt) {
  auto m = nn::mlp("512-512x3-64");
  m->to(devs[0], 5);
  DataParallelOptions o;
  o.reduce = Reduce::p2p;
  o.overlap = overlap;
  o.precision = precision;
  DataParallel dp(
      m, devs,
      [&](nn::Module& r) -> std::unique_ptr<optim::Optimizer> {
        if (opt == "sgd") return std::make_unique<optim::SGD>(r, optim::SGD::Options{.lr = 0.02f, .momentum = 0.9f});
        return std::make_unique<optim::AdamW>(r, optim::AdamW::Options{.lr = 0.001f});
      },
      o);
  data::Synthetic d({.task = data::Task::regression, .in = 512, .out = 64, .seed = 3}, devs[0]);
  const data::Dataset& rows = d;
  const ShardSource source = [&](size_t r, int64_t first, int64_t n) { return rows.batch(first, n, dp.device(r)); };
  std::vector<float> losses;
  for (int s = 0; s < 6; ++s) {
    dp.train_step(s * 48, 48, source, nn::MSELoss());
    // Queued at once after the step (the next step's forward after the others): the
    // evaluation's forward too reads parameters that are still being copied.
    if (s % 2 == 1) losses.push_back(dp.evaluate(1000, 48, source, nn::MSELoss()).value());
  }
  CHECK(dp.replicas_identical());
  std::vector<float> out = dp.replica(0).flat_params().to_host();
  out.insert(out.end(), losses.begin(), losses.end());
  return out;
}

}  // namespace dpt::test
