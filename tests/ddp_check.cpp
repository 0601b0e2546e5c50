// Run under mpirun: DDP training over the ranks must give the weights of one process
// training on the whole batch (<= 1e-5), with several buckets, uneven rank shards and
// gradient accumulation, with bucket sizes tuned over the first steps, for MLPs and a CNN,
// and every rank must end with bitwise the same parameters (and, with batch norm, the same
// running statistics). `--cuda-graph 1` (GPU ranks): the ranks record their steps, the
// collectives and the running statistics' broadcast with them, and the same holds.
// Exit status 0 when every check passes on every rank, 1 otherwise.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include <dptrain/data/dataset.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/parallel/process_group.hpp>
#include <dptrain/train/trainer.hpp>
#include "common.hpp"

using namespace dpt;

int main(int argc, char** argv) {
  int64_t batch = 10;
  int accum = 1, zero = 0, tune = 0, graph = 0;
  std::string device = "cpu";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--batch")) batch = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--grad-accum")) accum = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--device")) device = argv[i + 1];
    else if (!std::strcmp(argv[i], "--zero")) zero = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--tune-buckets")) tune = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--cuda-graph")) graph = std::atoi(argv[i + 1]);
  }
  try {
    ProcessGroup& g = ProcessGroup::world();
    g.set_timeout(120);
    int failures = 0;
    // "cuda": every GPU here, the local rank picks one; one process uses the first.
    const std::vector<Device> devs = device == "cuda" ? default_devices() : std::vector<Device>{parse_device(device)};
    // `compare`: DDP must give one process's weights; otherwise (batch norm: statistics
    // per rank) the ranks must agree with each other, buffers included.
    // File data (host arrays, the same on every rank): 37 rows of 12 inputs, shuffled, over
    // three epochs; regression targets of 5 or labels of 5 classes.
    std::vector<float> xs(37 * 12), ys(37 * 5);
    std::vector<int32_t> labels(37);
    for (size_t i = 0; i < xs.size(); ++i) xs[i] = std::sin(0.37f * static_cast<float>(i));
    for (size_t i = 0; i < ys.size(); ++i) ys[i] = std::cos(0.11f * static_cast<float>(i));
    for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int32_t>((i * 7) % 5);
    auto arrays = [&](data::Task task) {
      const data::Array x{xs.data(), data::ArrayDType::f32, {37, 12}};
      const data::Array y = task == data::Task::regression ? data::Array{ys.data(), data::ArrayDType::f32, {37, 5}}
                                                           : data::Array{labels.data(), data::ArrayDType::i32, {37}};
      return std::make_shared<data::ArrayDataset>(x, y);
    };
    auto check = [&](const std::string& model, data::Task task, const std::string& opt, bool compare,
                     bool file_data = false) {
      TrainConfig c;
      c.model = model;
      c.task = task;
      c.optimizer = opt;
      c.lr = opt == "sgd" ? 0.05f : 0.003f;
      c.batch = batch;
      c.steps = 20;
      c.log_every = 5;
      c.parallel.bucket_mb = 0.001;  // about 1 KB: several buckets
      c.devices = {devs.front()};
      TrainConfig d = c;
      d.devices = devs;
      d.ddp = true;
      d.parallel.grad_accum = accum;
      d.parallel.zero = zero;
      d.parallel.tune_buckets = tune != 0;  // the ranks time each size together and choose alike
      d.parallel.cuda_graph = graph != 0;   // against one process's eager steps
      std::shared_ptr<const data::Dataset> rows;
      if (file_data) {
        rows = arrays(task);
        c.epochs = d.epochs = 3;
        c.steps = d.steps = 0;
      }
      Trainer ddp(d, rows);
      if (ddp.parallel().buckets() < 2) ++failures;
      const TrainResult r = ddp.run();
      if (ddp.parallel().tuning_buckets()) ++failures;  // 0.001 and 1 MiB, five steps each, in the first ten
      const uint64_t hash = ddp.parameter_hash();       // throws if the ranks disagree
      if (g.rank() == 0 && !compare)
        std::printf("%s %s, %d ranks: hash %016llx on every rank: ok\n", model.c_str(), opt.c_str(), g.size(),
                    static_cast<unsigned long long>(hash));
      if (g.rank() == 0 && compare) {
        Trainer one(c, rows);  // one process, the whole batch, no accumulation
        const TrainResult r1 = one.run();
        const double err = test::rel_error(ddp.model().flat_params().to_host(), one.model().flat_params().to_host());
        const bool ok = err <= 1e-5 && std::fabs(r.final_loss - r1.final_loss) <= 1e-5 * std::fabs(r1.final_loss);
        std::printf(
            "%s %s %s%s, %d ranks, batch %lld, grad-accum %d, zero %d%s%s: weights rel. error %.3g, loss %.6g vs "
            "%.6g, hash %016llx: %s\n",
            model.c_str(), data::task_name(task), opt.c_str(), file_data ? " on file data" : "", g.size(),
            static_cast<long long>(batch), accum, zero, graph ? ", CUDA graph" : "",
            tune ? (", buckets tuned (" + std::to_string(ddp.parallel().bucket_mb()) + " MiB)").c_str() : "", err,
            r.final_loss, r1.final_loss, static_cast<unsigned long long>(hash), ok ? "ok" : "FAILED");
        if (!ok) ++failures;
      }
    };
    for (auto task : {data::Task::regression, data::Task::classification})
      for (std::string opt : {"sgd", "adamw"}) check("12-24x2-5", task, opt, true);
    check("cnn:2x7x7-c4k3-p2-c6k3s2-f3", data::Task::classification, "sgd", true);
    check("cnn:2x6x6-c4k3-bn-p2-f3", data::Task::classification, "sgd", false);
    for (auto task : {data::Task::regression, data::Task::classification}) check("12-24x2-5", task, "sgd", true, true);
    if (zero > 0) {
      // A ZeRO checkpoint of the ranks is the flat state: the ranks resume it bit for bit,
      // and one process without ZeRO resumes it too.
      // Named by rank 0's process id, which every rank learns through the group: runs of
      // this check at the same time (ctest beside a CI clone) must not share the file.
      const auto lead = static_cast<long long>(g.sum(g.rank() == 0 ? static_cast<double>(getpid()) : 0.0));
      const std::string path = (std::filesystem::temp_directory_path() / ("dpt_ddp_zero_" + std::to_string(lead) + "_" +
                                                                          std::to_string(g.size()) + ".safetensors"))
                                   .string();
      TrainConfig c;
      c.model = "12-24x2-5";
      c.optimizer = "adamw";
      c.lr = 0.003f;
      c.batch = batch;
      c.steps = 20;
      c.log_every = 1000;
      c.parallel.bucket_mb = 0.001;
      c.devices = devs;
      c.ddp = true;
      c.parallel.zero = zero;
      c.parallel.cuda_graph = graph != 0;  // stage 1 (stage 2 is not recorded)
      Trainer whole(c);
      whole.run();
      const auto want = whole.model().flat_params().to_host();
      TrainConfig first = c;
      first.steps = 8;
      first.save = path;
      Trainer(first).run();
      g.barrier();  // rank 0 has written it
      TrainConfig rest = c;
      rest.resume = path;
      Trainer resumed(rest);
      resumed.run();
      const bool same = resumed.model().flat_params().to_host() == want;
      if (!same) ++failures;
      if (g.rank() == 0) {
        TrainConfig alone = rest;
        alone.ddp = false;
        alone.parallel.zero = 0;
        alone.devices = {devs.front()};
        Trainer one(alone);
        one.run();
        const double err = test::rel_error(one.model().flat_params().to_host(), want);
        std::printf("zero %d checkpoint of %d ranks: resumed by the ranks %s, by one process: rel. error %.3g: %s\n",
                    zero, g.size(), same ? "bit for bit" : "DIFFERENTLY", err, err <= 1e-5 ? "ok" : "FAILED");
        if (err > 1e-5) ++failures;
      }
      g.barrier();
      if (g.rank() == 0) std::remove(path.c_str());
      // Non-finite gradients (a learning rate that overflows): every rank skips the same
      // steps as one process, or stops with its words.
      TrainConfig wild = c;
      wild.lr = 1e30f;
      wild.on_nonfinite = "skip-step";
      Trainer ranks(wild);
      const TrainResult skipped = ranks.run();
      ranks.parameter_hash();  // throws if the ranks disagree
      auto stopped = [](TrainConfig t) -> std::string {
        t.on_nonfinite = "stop";
        try {
          Trainer(t).run();
        } catch (const NonFiniteError& e) {
          return e.what();
        }
        return "no stop";
      };
      const std::string stop = stopped(wild);
      if (g.rank() == 0) {
        TrainConfig alone = wild;
        alone.ddp = false;
        alone.parallel.zero = 0;
        alone.devices = {devs.front()};
        const TrainResult one = Trainer(alone).run();
        const std::string stop_one = stopped(alone);
        const bool ok = skipped.skipped == one.skipped && skipped.skipped > 0 && stop == stop_one;
        std::printf("zero %d, non-finite steps: %lld skipped on the ranks, %lld in one process; stop: '%s': %s\n", zero,
                    static_cast<long long>(skipped.skipped), static_cast<long long>(one.skipped), stop.c_str(),
                    ok ? "ok" : "FAILED");
        if (!ok) ++failures;
      }
    }
    if (g.local_size() == g.size()) {
      // Every rank on this machine: its name among the ranks (ProcessGroup::machine, which
      // tells GPUs of one machine from another's) is its lowest rank, 0, on every rank.
      const std::vector<uint64_t> machines = g.gather_all(static_cast<uint64_t>(g.machine()));
      const bool ok = std::all_of(machines.begin(), machines.end(), [](uint64_t m) { return m == 0; });
      std::printf("the machine of every rank: %s\n", ok ? "ok" : "FAILED");
      if (!ok) ++failures;
    }
    if (g.size() > 1) {
      // A program whose ranks build models of other sizes: DataParallel refuses it on every
      // rank before its first broadcast (which would write past the smaller buffer). One
      // rank has no other to differ from (the GPU CLI test runs one rank a GPU).
      auto net = nn::mlp(g.rank() == 0 ? "4-8-2" : "4-64-2", Act::relu);
      const Device mine = devs[static_cast<size_t>(g.local_rank()) % devs.size()];
      net->to(mine, 1);
      DataParallelOptions o;
      o.group = &g;
      std::string refused = "not refused";
      try {
        DataParallel dp(
            net, {mine},
            [](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
              return std::make_unique<optim::SGD>(m, optim::SGD::Options{.lr = 0.01f});
            },
            o);
      } catch (const UsageError& e) {
        refused = e.what();
      }
      const bool ok = refused.find("the model differs between ranks: rank 0's parameters take") != std::string::npos;
      if (!ok) ++failures;
      if (g.rank() == 0)
        std::printf("models of other sizes on the ranks: '%s': %s\n", refused.c_str(), ok ? "ok" : "FAILED");
    }
    double total = g.sum(failures);
    if (g.rank() == 0) std::printf("%s\n", total == 0 ? "all checks passed" : "some checks FAILED");
    return total == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_check: error: %s\n", e.what());
    return 1;
  }
}
