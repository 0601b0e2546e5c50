// dpbench: one workload on 1, 2, 4, ... devices (and on all of them), in weak scaling
// (a fixed batch per device) and strong scaling (a fixed global batch), for each
// reduction path and precision asked. Each run times dpt::DataParallel training steps
// (MSE + SGD, lr 0.01, as in BENCHMARKS.md; a GPT: the next-token loss and AdamW on random
// tokens, as step_bench and torch_gpt_bench.py, with tokens/s and MFU) on a fixed random
// batch made beforehand on the replicas' devices, so only the step is timed. It prints a
// table and writes dpbench.csv, dpbench.json and speedup.svg. Exit status: 0 done, 1
// runtime error, 2 bad input, 3 out of memory.
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <CLI/CLI.hpp>

#include <dptrain/data/synthetic.hpp>
#include <dptrain/error.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/layers/model_spec.hpp>
#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/train/checkpoint.hpp>
#include "apps/cli.hpp"
#include "apps/plot.hpp"
#include "benchmarks/gpt_bench.hpp"
#include "common/atomic_file.hpp"
#include "common/text.hpp"

namespace {

using dpt::Device;
using dpt::Precision;
using dpt::Reduce;

constexpr int kExitError = 1, kExitUsage = 2, kExitOom = 3;
constexpr uint64_t kSeed = 1;      // initial weights and the fixed batch
constexpr float kLr = 0.01f;       // BENCHMARKS.md: SGD, lr 0.01, no momentum
constexpr float kAdamLr = 0.001f;  // --optimizer adamw: torch.optim.AdamW's default
// Timed steps are split into this many blocks, each bracketed by a synchronization; the
// median block is reported, so one slow block (a page fault, another process) does not
// move the figure, and steps inside a block queue up as they do in training.
constexpr size_t kBlocks = 7;
// The workload on CPU devices when no --model is given.
constexpr const char* kCpuModel = "16-128x2-4";
constexpr int64_t kCpuSteps = 20, kCpuWarmup = 2;

enum class Scaling { weak, strong };

constexpr auto kScalingNames =
    dpt::enum_names<Scaling>("scaling", {{Scaling::weak, "weak"}, {Scaling::strong, "strong"}});
const char* scaling_name(Scaling s) { return kScalingNames.name(s); }
Scaling parse_scaling(const std::string& name) { return kScalingNames.parse(name); }

// Keeps the first of equal values, in order.
template <class T>
std::vector<T> unique_in_order(const std::vector<T>& v) {
  std::vector<T> out;
  for (const T& x : v)
    if (std::find(out.begin(), out.end(), x) == out.end()) out.push_back(x);
  return out;
}

// A comma list flag's items, none empty. (CLI11's delimiter dropped empty items, so that
// `--precision ,` took the next flag as its value and `--precision ''` asked for nothing.)
std::vector<std::string> comma_items(const std::string& flag, const std::string& text) {
  std::vector<std::string> items = dpt::split(text, ',');
  for (const auto& item : items)
    if (item.empty()) throw dpt::UsageError(flag + " is a comma list without empty items, got '" + text + "'");
  return items;
}

struct Flags {
  std::string model = "mlp", out = "dpbench-out";
  dpt::app::DeviceFlags devices;
  std::vector<std::string> on_command_line;  // every flag: dpbench reads no config file
  int64_t batch = 0;                         // when not given: the workload's reference batch
  int64_t seq = 0;                           // a GPT's sequence length (0: its context)
  std::string attention_backward = "deterministic";
  double peak_tflops = dpt::bench::kDefaultPeakTflops;
  int64_t steps = 100, warmup = 10;
  double bucket_mb = 25.0, first_bucket_mb = 1.0;
  int comm_ctas = 0;
  bool update_per_bucket = false;
  bool no_overlap = false;
  bool cuda_graph = false;
  bool comm = false;
  std::string optimizer = "sgd";
  int zero = 0;
  std::string grad_comm = "fp32";
  std::string precision = "fp32", reduce = "auto", scaling = "weak,strong";  // comma lists
};

// What the flags ask for, checked.
struct Plan {
  dpt::nn::ModelSpec model;  // a CNN classifies images, an MLP regresses
  std::vector<Device> devices;
  std::vector<size_t> counts;  // device counts to run: 1, 2, 4, ... and all of them
  int64_t batch = 0;           // per device in weak scaling; times devices.size() in strong
  int64_t seq = 0;             // a GPT's tokens a sequence (a sample)
  dpt::nn::AttentionBackward attention_backward = dpt::nn::AttentionBackward::deterministic;  // a GPT's
  double peak_tflops = 0;  // a GPT's MFU: against this a device
  int64_t steps = 0, warmup = 0;
  double bucket_mb = 0, first_bucket_mb = 0;
  int comm_ctas = 0;                       // NCCL's thread blocks a collective (0: NCCL's choice)
  bool update_per_bucket = false;          // each bucket updated once reduced
  bool overlap = true;                     // buckets reduced during backward (else all after it)
  bool cuda_graph = false;                 // the step recorded once as a CUDA graph and replayed (one GPU)
  bool comm = false;                       // the gradient reduction alone, not steps
  bool cpu_default = false;                // CPU devices and no --model: the small CPU workload
  bool adamw = false;                      // else SGD
  int zero = 0;                            // ZeRO stage of the runs on several devices
  dpt::DType grad_comm = dpt::DType::f32;  // the type gradients travel in between devices
  std::vector<Precision> precisions;
  std::vector<Reduce> reduces;  // resolved paths: what `auto` means for these devices
  std::vector<Scaling> scalings;
  std::string out;
};

void add_flags(CLI::App& app, Flags& f) {
  app.add_option("--model", f.model,
                 "MLP spec (widths, e.g. 1024-4096x3-1024), CNN spec (cnn:...), GPT spec (gpt:...) or preset: seed, "
                 "mlp, cnn, gpt2, gpt2-medium")
      ->capture_default_str();
  f.devices.add_to(app,
                   "Devices, e.g. cuda:0,cuda:1 or cpu:0,cpu:1 (default: every GPU, else cpu); "
                   "runs use the first 1, 2, 4, ... of them");
  using dpt::app::add_integer;
  add_integer(app, "--batch", f.batch,
              "Batch per device in weak scaling; strong scaling splits batch x (most devices) "
              "(default: 64 for seed, 4096 for mlp, 16 sequences for a GPT, 256 otherwise)");
  add_integer(app, "--seq", f.seq, "A GPT's sequence length (default: its context)");
  app.add_option("--attention-backward", f.attention_backward,
                 "A GPT's: deterministic (the default) or fast (cuDNN adds dQ's parts as they finish)");
  dpt::app::add_double(app, "--peak-tflops", f.peak_tflops,
                       "A GPT's MFU against this many TFLOPS a device (an H100 or H200 SXM's dense bf16 peak)")
      ->capture_default_str();
  add_integer(app, "--steps", f.steps, "Timed steps per run (default 100; 20 on CPU devices without --model)")
      ->capture_default_str();
  add_integer(app, "--warmup", f.warmup, "Untimed steps before them (at least 1: the first step allocates)")
      ->capture_default_str();
  app.add_option(
         "--precision", f.precision,
         "Precisions, a comma list of fp32, tf32, bf16 (bf16: bf16 storage, fp32 master weights; tf32 is fp32 on CPUs; "
         "a GPT's default: bf16)")
      ->capture_default_str();
  app.add_option("--reduce", f.reduce, "Gradient reductions, a comma list of auto, nccl, p2p, host")
      ->capture_default_str();
  app.add_option("--scaling", f.scaling, "Scaling modes, a comma list of weak, strong")->capture_default_str();
  dpt::app::add_double(app, "--bucket-mb", f.bucket_mb, "Gradient bucket size in MiB")->capture_default_str();
  dpt::app::add_double(app, "--first-bucket-mb", f.first_bucket_mb, "The first bucket's size in MiB, when smaller")
      ->capture_default_str();
  add_integer(app, "--comm-ctas", f.comm_ctas, "NCCL: at most this many thread blocks a collective (0: NCCL's choice)")
      ->capture_default_str();
  app.add_flag("--update-per-bucket", f.update_per_bucket,
               "Update each bucket's parameters as soon as its reduction is done (runs on several devices)");
  app.add_flag("--no-overlap", f.no_overlap,
               "Reduce the gradients only after backward (runs on several devices), to measure what overlap gains");
  app.add_flag("--cuda-graph", f.cuda_graph,
               "Record the step as a CUDA graph after warm-up and time its replays "
               "(one GPU)");
  app.add_flag("--comm", f.comm,
               "Time the gradient reduction alone (no steps) on 2, 4, ... devices, each path asked (and bare NCCL "
               "on GPUs): ms, algorithm and bus bandwidth as nccl-tests define them; --steps reductions a run");
  app.add_option("--optimizer", f.optimizer,
                 "sgd (lr 0.01, no momentum) or adamw (lr 0.001; a GPT's: lr 6e-4, betas 0.9 0.95, weight decay 0.1, "
                 "its default)")
      ->capture_default_str();
  add_integer(app, "--zero", f.zero,
              "ZeRO stage: 0, 1 (the optimizer state sharded over the devices) or 2 (the gradients too)")
      ->capture_default_str();
  app.add_option("--grad-comm", f.grad_comm, "The type gradients travel in between devices: fp32 or bf16")
      ->capture_default_str();
  app.add_option("--out", f.out, "Folder for dpbench.csv, dpbench.json and speedup.svg (made if missing)")
      ->capture_default_str();
  app.set_version_flag("--version", std::string("dpbench ") + DPT_VERSION);
}

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// Checks every flag before any run, so bad input never costs a benchmark; throws
// dpt::UsageError with a one-line reason.
Plan make_plan(const Flags& f, const CLI::App& app) {
  Plan p;
  p.devices = f.devices.devices(f.on_command_line);
  if (p.devices.empty()) p.devices = dpt::default_devices();
  for (const Device& d : p.devices) dpt::check_device(d);
  for (size_t n = 1; n < p.devices.size(); n *= 2) p.counts.push_back(n);
  p.counts.push_back(p.devices.size());
  // The GPU workload (mlp, 110 steps) takes the CPU about ten minutes a run: CPU devices
  // default to dptrain's default job, which measures in seconds.
  p.cpu_default = p.devices.front().is_cpu() && app.count("--model") == 0;
  const std::string model = p.cpu_default ? kCpuModel : f.model;
  p.model = dpt::nn::parse_model_spec(model);
  if (p.model.is_cnn && p.model.outputs() < 2)
    throw dpt::UsageError("a CNN classifies: it needs at least 2 output classes, '" + model + "' has " +
                          std::to_string(p.model.outputs()));

  const int64_t reference_batch = model == "seed" ? 64 : model == "mlp" ? 4096 : p.model.is_gpt ? 16 : 256;
  p.batch = app.count("--batch") > 0 ? f.batch : reference_batch;
  if (!p.model.is_gpt && app.count("--seq") > 0) throw dpt::UsageError("--seq is a GPT's sequence length");
  if (p.model.is_gpt) p.seq = dpt::bench::gpt_seq(p.model.gpt, f.seq);
  p.attention_backward = dpt::bench::checked_attention_backward(f.attention_backward, p.model.is_gpt);
  p.peak_tflops = dpt::bench::checked_peak_tflops(f.peak_tflops, app.count("--peak-tflops") > 0, p.model.is_gpt);
  p.steps = p.cpu_default && app.count("--steps") == 0 ? kCpuSteps : f.steps;
  p.warmup = p.cpu_default && app.count("--warmup") == 0 ? kCpuWarmup : f.warmup;
  if (p.batch < 1) throw dpt::UsageError("--batch must be at least 1, got " + std::to_string(p.batch));
  if (p.steps < 1) throw dpt::UsageError("--steps must be at least 1, got " + std::to_string(p.steps));
  if (p.warmup < 1)
    throw dpt::UsageError("--warmup must be at least 1 (the first step allocates memory), got " +
                          std::to_string(p.warmup));
  // A run of more steps than this is a typo, not a benchmark (it would run for years).
  constexpr int64_t kMaxSteps = 1'000'000'000;
  if (p.steps > kMaxSteps || p.warmup > kMaxSteps)
    throw dpt::UsageError("--steps and --warmup must be at most " + std::to_string(kMaxSteps) + ", got " +
                          std::to_string(std::max(p.steps, p.warmup)));
  // Weak scaling trains batch x devices samples a step, strong scaling's global batch too.
  if (p.batch > std::numeric_limits<int64_t>::max() / static_cast<int64_t>(p.devices.size()))
    throw dpt::UsageError("--batch times the " + std::to_string(p.devices.size()) +
                          " devices is more samples than fit in 64 bits, got " + std::to_string(p.batch));
  // The fields of DataParallelOptions that dpbench's flags set, checked before any run.
  dpt::DataParallelOptions given;
  given.bucket_mb = f.bucket_mb;
  given.first_bucket_mb = f.first_bucket_mb;
  given.comm_ctas = f.comm_ctas;
  given.zero = f.zero;
  dpt::check_options(given, p.devices);  // their ranges, and what the devices refuse (as DataParallel would)
  if (f.cuda_graph && (p.devices.size() != 1 || !p.devices.front().is_cuda()))
    throw dpt::UsageError("--cuda-graph records one GPU's step: give one CUDA device (--gpus 1)");
  p.cuda_graph = f.cuda_graph;
  p.bucket_mb = f.bucket_mb;
  p.first_bucket_mb = f.first_bucket_mb;
  p.comm_ctas = f.comm_ctas;
  p.update_per_bucket = f.update_per_bucket;
  p.overlap = !f.no_overlap;
  if (f.comm && p.devices.size() < 2)
    throw dpt::UsageError("--comm times the reduction between devices: give at least 2 (--gpus 2, --cpus 2)");
  if (f.comm && f.cuda_graph) throw dpt::UsageError("--comm times the reduction alone, not a recorded step");
  if (f.comm && p.attention_backward != dpt::nn::AttentionBackward::deterministic)
    throw dpt::UsageError("--comm times the reduction alone: there is no attention backward to make fast");
  if (f.comm && f.no_overlap)
    throw dpt::UsageError("--comm times the reduction alone: there is no backward to overlap");
  p.comm = f.comm;
  if (f.optimizer != "sgd" && f.optimizer != "adamw")
    throw dpt::UsageError("--optimizer must be sgd or adamw, got '" + f.optimizer + "'");
  p.adamw = f.optimizer == "adamw" || (p.model.is_gpt && app.count("--optimizer") == 0);
  if (f.update_per_bucket && (f.zero > 0 || f.cuda_graph))
    throw dpt::UsageError("--update-per-bucket is for runs without --zero and --cuda-graph");
  if (f.comm && f.zero == 2)
    throw dpt::UsageError(
        "--comm times the reduction after backward; ZeRO stage 2 reduces during it: use --zero 0 or 1");
  p.zero = f.zero;
  dpt::find_field(dpt::data_parallel_schema(), "grad_comm")->set(given, f.grad_comm);  // fp32 or bf16
  p.grad_comm = given.grad_comm;

  for (const auto& s : comma_items("--precision", f.precision)) p.precisions.push_back(dpt::parse_precision(s));
  if (p.model.is_gpt && app.count("--precision") == 0) p.precisions = {Precision::bf16};  // as torch_gpt_bench.py
  for (const auto& s : comma_items("--scaling", f.scaling)) p.scalings.push_back(parse_scaling(s));
  // A path is resolved once, for all the devices, and then asked for by name at every
  // count, so a series keeps one path; each count is checked here so that a path that
  // cannot serve some subset (nccl over cuda:0,cuda:1,cuda:0) fails before any run.
  for (const auto& s : comma_items("--reduce", f.reduce)) {
    const Reduce r = dpt::resolve_reduce(dpt::parse_reduce(s), p.devices);
    for (size_t n : p.counts)
      if (n > 1) dpt::resolve_reduce(r, {p.devices.begin(), p.devices.begin() + static_cast<std::ptrdiff_t>(n)});
    p.reduces.push_back(r);
  }
  p.precisions = unique_in_order(p.precisions);
  p.reduces = unique_in_order(p.reduces);
  p.scalings = unique_in_order(p.scalings);

  p.out = f.out;
  std::error_code ec;
  std::filesystem::create_directories(p.out, ec);
  if (ec || !std::filesystem::is_directory(p.out) || ::access(p.out.c_str(), W_OK) != 0)
    throw dpt::UsageError("cannot write to the output folder '" + p.out + "'" + (ec ? ": " + ec.message() : ""));
  for (const char* name : {"dpbench.csv", "dpbench.json", "speedup.svg", "comm.csv"})  // before any run
    dpt::check_output_file(p.out + "/" + name, "--out");
  return p;
}

// One timed run: `n` devices, one global batch, one path, one precision.
struct Measurement {
  std::vector<Device> devices;
  int64_t global = 0;
  double step_ms = 0, samples_per_s = 0, compute_ms = 0, reduce_ms = 0, update_ms = 0, idle_ms = 0;
  double tokens_per_s = 0, mfu = 0;             // a GPT's
  std::vector<std::pair<Device, size_t>> peak;  // peak bytes allocated, per distinct device
  std::vector<dpt::ModelStateBytes> state;      // gradients and optimizer state, per replica
  float loss_first = 0, loss_last = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

// Samples [first, first + count) of the fixed batch on `device`. Sample i's values depend
// on i alone (Philox offset), so a strong-scaling batch is the same data whatever the
// number of devices. An MLP gets random inputs and targets; a CNN random images and
// labels (drawn on the host from the same generator); a GPT random tokens.
dpt::data::Batch make_shard(const Plan& p, int64_t first, int64_t count, const Device& device) {
  if (p.model.is_gpt) return dpt::bench::gpt_tokens(p.model.gpt, p.seq, first, count, device);
  dpt::data::Batch s;
  if (p.model.is_cnn) {
    const auto& in = p.model.cnn.input;
    const int64_t pixels = in[0] * in[1] * in[2];
    s.x = dpt::Tensor::empty({count, in[0], in[1], in[2]}, dpt::DType::f32, device);
    dpt::normal_(s.x, kSeed, 1, static_cast<uint64_t>(first * pixels));
    s.y = dpt::data::random_labels(count, p.model.outputs(), kSeed, 2, first, device);
    return s;
  }
  const int64_t in = p.model.widths.front(), out = p.model.outputs();
  s.x = dpt::Tensor::empty({count, in}, dpt::DType::f32, device);
  s.y = dpt::Tensor::empty({count, out}, dpt::DType::f32, device);
  dpt::normal_(s.x, kSeed, 1, static_cast<uint64_t>(first * in));
  dpt::normal_(s.y, kSeed, 2, static_cast<uint64_t>(first * out));
  return s;
}

// AdamW's options: --optimizer adamw's (lr 0.001), a GPT's those of torch_gpt_bench.py.
dpt::optim::AdamW::Options adam_options(const Plan& p) {
  return p.model.is_gpt ? dpt::bench::kGptAdamW : dpt::optim::AdamW::Options{.lr = kAdamLr};
}

dpt::LossFn loss_of(const dpt::nn::ModelSpec& model) {
  if (model.is_gpt)
    return [vocab = model.gpt.vocab](const dpt::Tensor& out, const dpt::Tensor& y) {
      return dpt::nn::lm_loss(out, y, vocab);
    };
  if (model.is_cnn) return [](const dpt::Tensor& out, const dpt::Tensor& y) { return dpt::cross_entropy(out, y); };
  return dpt::nn::MSELoss();
}

// reduce = automatic runs one device with no gradient reduction at all (the baseline).
Measurement measure(const Plan& p, size_t n, int64_t global, Reduce reduce, Precision precision) {
  Measurement m;
  m.global = global;
  m.devices.assign(p.devices.begin(), p.devices.begin() + static_cast<std::ptrdiff_t>(n));
  const auto places = unique_in_order(m.devices);
  // Freed blocks of the previous run go back to the system, so each run starts alike and
  // its peak counts only what it allocates.
  for (const Device& d : places) {
    dpt::empty_cache(d);
    dpt::reset_peak_memory(d);
  }
  auto model = dpt::nn::make_model(p.model, dpt::Act::relu);
  if (p.model.is_gpt) static_cast<dpt::nn::GPT&>(*model).set_attention_backward(p.attention_backward);
  model->to(m.devices.front(), kSeed);
  dpt::DataParallelOptions o;
  o.reduce = reduce;
  o.bucket_mb = p.bucket_mb;
  o.first_bucket_mb = p.first_bucket_mb;
  o.comm_ctas = p.comm_ctas;
  o.update_per_bucket = p.update_per_bucket && m.devices.size() > 1;
  o.overlap = p.overlap;
  o.precision = precision;
  o.zero = p.zero;  // on one device the same code with one shard
  o.grad_comm = p.grad_comm;
  if (p.cuda_graph) {  // recorded on the warm-up's second step, replayed after
    o.cuda_graph = true;
    o.reduce = Reduce::automatic;
  }
  dpt::DataParallel dp(
      model, m.devices,
      [&p](dpt::nn::Module& replica) -> std::unique_ptr<dpt::optim::Optimizer> {
        if (p.adamw) return std::make_unique<dpt::optim::AdamW>(replica, adam_options(p));
        return std::make_unique<dpt::optim::SGD>(replica, dpt::optim::SGD::Options{.lr = kLr});
      },
      o);

  // The fixed batch: each replica's shard made once on its device. Sample i's values
  // depend on i alone (Philox offset), so a strong-scaling batch is the same data
  // whatever the number of devices, and the losses of its runs agree. No shard is
  // empty: the global batch is at least batch x n.
  const dpt::ShardPlan& shares = dp.plan(global);
  std::vector<dpt::data::Batch> shards(n);
  for (size_t r = 0; r < n; ++r)
    shards[r] = make_shard(p, shares.replica_part(r).first, shares.replica_part(r).count, m.devices[r]);
  for (const Device& d : places) dpt::context(d).synchronize();  // made on the default streams
  const dpt::ShardSource source = [&shards](size_t r, int64_t, int64_t count) {
    DPT_CHECK(shards[r].x.size(0) == count, "dpbench: shard size differs from DataParallel::plan");
    return shards[r];
  };
  const dpt::LossFn loss = loss_of(p.model);

  // Every step trains samples [0, global): a graph's replay copies the next one's shards
  // in as training does (next_first 0).
  const auto train = [&] { return dp.train_step(0, global, source, loss, {}, true, 0); };
  m.loss_first = train().value();
  for (int64_t i = 1; i < p.warmup; ++i) train();
  dp.synchronize();

  std::vector<double> step, compute, red, update;
  dpt::StepLoss last;
  // Blocks as even as the steps allow.
  for (int64_t steps : dpt::split_evenly(p.steps, std::min(static_cast<size_t>(p.steps), kBlocks))) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < steps; ++i) last = train();
    dp.synchronize();
    const auto t1 = std::chrono::steady_clock::now();
    step.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count() / static_cast<double>(steps));
    // The phases of the block's last step, on the master: CUDA events on a GPU, read
    // after the block so that no step waits for them.
    const dpt::StepTimes t = dp.last_times();
    compute.push_back(t.compute);
    red.push_back(t.reduce);
    update.push_back(t.update);
  }
  m.loss_last = last.value();
  m.step_ms = median(step);
  m.compute_ms = median(compute);
  m.reduce_ms = median(red);
  m.update_ms = median(update);
  m.idle_ms = std::max(0.0, m.step_ms - m.compute_ms - m.reduce_ms - m.update_ms);
  m.samples_per_s = 1e3 * static_cast<double>(global) / m.step_ms;
  if (p.model.is_gpt) {
    m.tokens_per_s = m.samples_per_s * static_cast<double>(p.seq);
    const double flops = dpt::bench::gpt_flops_per_token(p.model.gpt, model->num_parameters(), p.seq);
    m.mfu = dpt::bench::mfu_percent(flops, m.tokens_per_s, p.peak_tflops, static_cast<int64_t>(n)) / 100.0;
  }
  for (const Device& d : places) m.peak.push_back({d, dpt::memory_stats(d).peak_allocated});
  m.state = dp.model_state_bytes();
  return m;
}

struct Row {
  Scaling scaling;
  Reduce reduce;  // the series' path (its 1-device point runs without reduction)
  Precision precision;
  size_t n;
  int64_t global;
  const Measurement* m;
  double speedup, efficiency;
};

double mib(size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

std::string join(const std::vector<std::string>& parts, const char* sep) {
  std::string s;
  for (size_t i = 0; i < parts.size(); ++i) s += (i ? sep : "") + parts[i];
  return s;
}

void print_header(const Plan& p, int64_t parameters) {
  if (p.model.is_gpt) {
    std::printf("dpbench %s: GPT %s (%lld parameters), next-token cross-entropy + %s, fixed random tokens\n",
                DPT_VERSION, p.model.text.c_str(), static_cast<long long>(parameters),
                p.adamw ? "AdamW lr 0.0006, betas 0.9 0.95, weight decay 0.1" : "SGD lr 0.01");
    std::printf(
        "  sequences of %lld tokens; MFU: 6N + 6LCT flops a token (N without the position embedding) against %g "
        "TFLOPS a device\n",
        static_cast<long long>(p.seq), p.peak_tflops);
    if (p.attention_backward == dpt::nn::AttentionBackward::fast)
      std::printf("  the attention backward: fast (cuDNN adds dQ's parts as they finish; not bit for bit)\n");
  } else {
    std::printf("dpbench %s: %s %s (%lld parameters, ReLU), %s + %s lr %g, fixed random batch\n", DPT_VERSION,
                p.model.is_cnn ? "CNN" : "MLP", p.model.text.c_str(), static_cast<long long>(parameters),
                p.model.is_cnn ? "cross-entropy" : "MSE", p.adamw ? "AdamW" : "SGD",
                static_cast<double>(p.adamw ? kAdamLr : kLr));
  }
  if (p.zero > 0)
    std::printf("  ZeRO stage %d: the optimizer state%s sharded over the devices\n", p.zero,
                p.zero == 2 ? " and the gradients" : "");
  if (p.grad_comm == dpt::DType::bf16) std::printf("  gradients travel in bf16 between devices\n");
  std::printf("  buckets of %g MiB, the first %g MiB%s%s%s\n", p.bucket_mb, std::min(p.bucket_mb, p.first_bucket_mb),
              p.comm_ctas > 0 ? (", NCCL at most " + std::to_string(p.comm_ctas) + " thread blocks").c_str() : "",
              p.update_per_bucket ? ", each bucket updated once reduced" : "",
              p.overlap ? "" : ", reduced only after backward (no overlap)");
  for (const Device& d : unique_in_order(p.devices)) std::printf("  %s\n", dpt::describe_device(d).c_str());
  if (p.comm) {  // run_comm says the rest
    std::fflush(stdout);
    return;
  }
  if (p.cpu_default)
    std::printf("  CPU devices: the default workload is %s, batch %lld, %lld steps (GPUs: mlp; --model to choose)\n",
                kCpuModel, static_cast<long long>(p.batch), static_cast<long long>(p.steps));
  std::printf(
      "  weak: batch %lld per device; strong: global batch %lld; %lld timed steps (median of %zu blocks) "
      "after %lld warm-up\n",
      static_cast<long long>(p.batch), static_cast<long long>(p.batch * static_cast<int64_t>(p.devices.size())),
      static_cast<long long>(p.steps), std::min(static_cast<size_t>(p.steps), kBlocks),
      static_cast<long long>(p.warmup));
  if (p.cuda_graph) std::printf("  the step recorded once as a CUDA graph and replayed\n");
  std::printf(
      "  speed-up = samples/s against 1 device (which runs without reduction, or with ZeRO one shard); "
      "efficiency = speed-up / devices; times in ms on the master\n\n");
  // A GPT's rate is in tokens (batch: sequences), with its MFU at the end.
  std::printf("%-7s %-6s %-5s %3s %8s %10s %10s %8s %5s %9s %9s %9s %9s %11s %11s%s\n", "scaling", "reduce", "prec",
              "dev", "batch", "ms/step", p.model.is_gpt ? "tokens/s" : "samples/s", "speed-up", "eff", "compute",
              "reduce", "update", "idle", "master MiB", "others MiB", p.model.is_gpt ? "    MFU" : "");
  std::fflush(stdout);
}

void print_row(const Row& r, bool gpt) {
  const Measurement& m = *r.m;
  double others = 0;
  for (size_t i = 1; i < m.peak.size(); ++i) others = std::max(others, mib(m.peak[i].second));
  std::printf("%-7s %-6s %-5s %3zu %8lld %10.4f %10s %7.2fx %4.0f%% %9.4f %9.4f %9.4f %9.4f %11.2f %11s%s\n",
              scaling_name(r.scaling), dpt::reduce_name(r.reduce), dpt::precision_name(r.precision), r.n,
              static_cast<long long>(r.global), m.step_ms,
              dpt::format_si(gpt ? m.tokens_per_s : m.samples_per_s).c_str(), r.speedup, 100.0 * r.efficiency,
              m.compute_ms, m.reduce_ms, m.update_ms, m.idle_ms, mib(m.peak.front().second),
              m.peak.size() > 1 ? fmt("%.2f", others).c_str() : "-", gpt ? fmt("%6.1f%%", 100.0 * m.mfu).c_str() : "");
  std::fflush(stdout);
}

// A GPT's rows end with its tokens/s and MFU (a fraction of the peak a device).
std::string csv(const std::vector<Row>& rows, bool gpt) {
  std::string o =
      "scaling,reduce,precision,devices,device_list,global_batch,step_ms,samples_per_s,speedup,efficiency,"
      "compute_ms,reduce_ms,update_ms,idle_ms,peak_mib,grads_mib,state_mib,loss_first,loss_last" +
      std::string(gpt ? ",tokens_per_s,mfu" : "") + "\n";
  for (const Row& r : rows) {
    const Measurement& m = *r.m;
    std::vector<std::string> devs, peaks, grads, states;
    for (const Device& d : m.devices) devs.push_back(d.str());
    for (const auto& [d, b] : m.peak) peaks.push_back(d.str() + "=" + fmt("%.3f", mib(b)));
    for (const dpt::ModelStateBytes& b : m.state) {
      grads.push_back(b.device.str() + "=" + fmt("%.3f", mib(static_cast<size_t>(b.gradients))));
      states.push_back(b.device.str() + "=" + fmt("%.3f", mib(static_cast<size_t>(b.optimizer))));
    }
    o += std::string(scaling_name(r.scaling)) + "," + dpt::reduce_name(r.reduce) + "," +
         dpt::precision_name(r.precision) + "," + std::to_string(r.n) + "," + join(devs, ";") + "," +
         std::to_string(r.global);
    for (double v :
         {m.step_ms, m.samples_per_s, r.speedup, r.efficiency, m.compute_ms, m.reduce_ms, m.update_ms, m.idle_ms})
      o += "," + fmt("%.6g", v);
    o += "," + join(peaks, ";") + "," + join(grads, ";") + "," + join(states, ";") + "," + fmt("%.6g", m.loss_first) +
         "," + fmt("%.6g", m.loss_last);
    o += (gpt ? "," + fmt("%.6g", m.tokens_per_s) + "," + fmt("%.6g", m.mfu) : std::string()) + "\n";
  }
  return o;
}

std::string json(const Plan& p, int64_t parameters, const std::vector<Row>& rows) {
  std::vector<std::string> devs, names;
  for (const Device& d : p.devices) devs.push_back(dpt::json_quote(d.str()));
  for (const Device& d : unique_in_order(p.devices)) names.push_back(dpt::json_quote(dpt::describe_device(d)));
  std::string o =
      "{\n  \"dpbench\": " + dpt::json_quote(DPT_VERSION) + ",\n  \"model\": " + dpt::json_quote(p.model.text) +
      ",\n  \"parameters\": " + std::to_string(parameters) + ",\n  \"loss\": \"" +
      (p.model.is_gpt   ? "next_token_cross_entropy"
       : p.model.is_cnn ? "cross_entropy"
                        : "mse") +
      "\",\n  \"optimizer\": {\"name\": \"" + (p.adamw ? "adamw" : "sgd") +
      "\", \"lr\": " + fmt("%g", p.adamw ? adam_options(p).lr : kLr) + ", \"zero\": " + std::to_string(p.zero) +
      "},\n  \"grad_comm\": \"" + (p.grad_comm == dpt::DType::bf16 ? "bf16" : "fp32") + "\"" +
      ",\n  \"overlap\": " + (p.overlap ? "true" : "false") + ",\n  \"devices\": [" + join(devs, ", ") +
      "],\n  \"device_names\": [" + join(names, ", ") + "],\n  \"batch_per_device\": " + std::to_string(p.batch) +
      ",\n  \"strong_global_batch\": " + std::to_string(p.batch * static_cast<int64_t>(p.devices.size())) +
      ",\n  \"steps\": " + std::to_string(p.steps) + ",\n  \"warmup\": " + std::to_string(p.warmup) +
      ",\n  \"blocks\": " + std::to_string(std::min(static_cast<size_t>(p.steps), kBlocks)) +
      (p.model.is_gpt ? ",\n  \"seq\": " + std::to_string(p.seq) + ",\n  \"peak_tflops\": " + fmt("%g", p.peak_tflops)
                      : std::string()) +
      ",\n  \"runs\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const Measurement& m = *r.m;
    std::vector<std::string> list, peaks, grads, states;
    for (const Device& d : m.devices) list.push_back(dpt::json_quote(d.str()));
    for (const auto& [d, b] : m.peak) peaks.push_back(dpt::json_quote(d.str()) + ": " + std::to_string(b));
    for (const dpt::ModelStateBytes& b : m.state) {
      grads.push_back(std::to_string(b.gradients));
      states.push_back(std::to_string(b.optimizer));
    }
    o += std::string(i ? "," : "") + "\n    {\"scaling\": " + dpt::json_quote(scaling_name(r.scaling)) +
         ", \"reduce\": " + dpt::json_quote(dpt::reduce_name(r.reduce)) +
         ", \"precision\": " + dpt::json_quote(dpt::precision_name(r.precision)) +
         ", \"devices\": " + std::to_string(r.n) + ", \"device_list\": [" + join(list, ", ") +
         "], \"global_batch\": " + std::to_string(r.global) + ", \"step_ms\": " + fmt("%.6g", m.step_ms) +
         ", \"samples_per_s\": " + fmt("%.6g", m.samples_per_s) + ", \"speedup\": " + fmt("%.6g", r.speedup) +
         ", \"efficiency\": " + fmt("%.6g", r.efficiency) + ", \"compute_ms\": " + fmt("%.6g", m.compute_ms) +
         ", \"reduce_ms\": " + fmt("%.6g", m.reduce_ms) + ", \"update_ms\": " + fmt("%.6g", m.update_ms) +
         ", \"idle_ms\": " + fmt("%.6g", m.idle_ms) + ", \"peak_bytes\": {" + join(peaks, ", ") +
         "}, \"gradient_bytes\": [" + join(grads, ", ") + "], \"optimizer_state_bytes\": [" + join(states, ", ") +
         "], \"loss_first\": " + fmt("%.6g", m.loss_first) + ", \"loss_last\": " + fmt("%.6g", m.loss_last) +
         (p.model.is_gpt ? ", \"tokens_per_s\": " + fmt("%.6g", m.tokens_per_s) + ", \"mfu\": " + fmt("%.6g", m.mfu)
                         : std::string()) +
         "}";
  }
  return o + "\n  ]\n}\n";
}

void chart(const Plan& p, const std::vector<Row>& rows, const std::string& path) {
  std::vector<dpt::plot::Series> series;
  dpt::plot::Series ideal{"ideal", {}, {}, true};
  for (size_t n : p.counts) {
    ideal.x.push_back(static_cast<double>(n));
    ideal.y.push_back(static_cast<double>(n));
  }
  series.push_back(ideal);
  for (const Row& r : rows) {
    const std::string name = std::string(scaling_name(r.scaling)) + ", " + dpt::reduce_name(r.reduce) + ", " +
                             dpt::precision_name(r.precision);
    if (series.back().name != name) series.push_back({name, {}, {}});
    series.back().x.push_back(static_cast<double>(r.n));
    series.back().y.push_back(r.speedup);
  }
  std::vector<std::string> devs;
  for (const Device& d : p.devices) devs.push_back(d.str());
  dpt::plot::write_line_chart(path, "dpbench: speed-up of " + p.model.text + " on " + join(devs, ","), "devices",
                              "speed-up (samples/s against 1 device)", series);
}

// --comm: the gradient buffer's reduction through each path asked (and, on distinct GPUs,
// bare NCCL's collectives of the same bytes), with nccl-tests' bandwidths: algbw = bytes /
// time; busbw = algbw x 2(n-1)/n for an all-reduce, x (n-1)/n for a reduce-scatter or an
// all-gather (what each link carries, comparable across device counts), x 1 for the p2p
// path's copy of the parameters to every replica.
int run_comm(const Plan& p, int64_t parameters) {
  std::printf("  the reduction alone: the fp32 gradient buffer of %.1f MiB, the median of %lld after one\n",
              static_cast<double>(parameters) * 4 / (1 << 20), static_cast<long long>(p.steps));
  std::printf("\n%-16s %-9s %4s %10s %10s %11s %11s\n", "op", "path", "dev", "MiB", "ms", "algbw GB/s", "busbw GB/s");
  std::string out = "op,path,devices,bytes,ms,algbw_gbs,busbw_gbs\n";
  auto row = [&](const char* op, const std::string& path, size_t n, double ms, double factor) {
    const double bytes = static_cast<double>(parameters) * 4, algbw = bytes / (ms * 1e-3) / 1e9;
    std::printf("%-16s %-9s %4zu %10.2f %10.4f %11.2f %11.2f\n", op, path.c_str(), n, bytes / (1 << 20), ms, algbw,
                algbw * factor);
    out += std::string(op) + "," + path + "," + std::to_string(n) + "," + fmt("%.0f", bytes) + "," + fmt("%.6g", ms) +
           "," + fmt("%.6g", algbw) + "," + fmt("%.6g", algbw * factor) + "\n";
  };
  const int iters = static_cast<int>(p.steps);
  for (size_t n : p.counts) {
    if (n < 2) continue;
    const std::vector<Device> devs(p.devices.begin(), p.devices.begin() + static_cast<std::ptrdiff_t>(n));
    const double nn = static_cast<double>(n), ring = (nn - 1) / nn;
    for (Reduce red : p.reduces) {
      auto model = dpt::nn::make_model(p.model, dpt::Act::relu);
      model->to(devs.front(), kSeed);
      dpt::DataParallelOptions o;
      o.reduce = red;
      o.bucket_mb = p.bucket_mb;
      o.first_bucket_mb = p.first_bucket_mb;
      o.comm_ctas = p.comm_ctas;
      o.zero = p.zero;
      o.grad_comm = p.grad_comm;
      dpt::DataParallel dp(
          model, devs,
          [](dpt::nn::Module& m) -> std::unique_ptr<dpt::optim::Optimizer> {
            return std::make_unique<dpt::optim::SGD>(m, dpt::optim::SGD::Options{.lr = kLr});
          },
          o);
      const auto t = dp.time_reduction(iters);
      const std::string path = dpt::reduce_name(red);
      if (p.zero > 0) {
        row("reduce (ZeRO)", path, n, t.reduce_ms, ring);
        row("gather (ZeRO)", path, n, t.after_ms, ring);
      } else {
        row("all-reduce", path, n, t.reduce_ms, 2 * ring);
        if (red == Reduce::p2p) row("params to all", path, n, t.after_ms, 1.0);
      }
    }
    std::set<int> distinct;
    for (const Device& d : devs)
      if (d.is_cuda()) distinct.insert(d.index);
    if (dpt::built_with_nccl() && distinct.size() == n) {
      const auto b = dpt::time_bare_nccl(devs, parameters, iters);
      row("all-reduce", "bare-nccl", n, b.all_reduce_ms, 2 * ring);
      row("reduce-scatter", "bare-nccl", n, b.reduce_scatter_ms, ring);
      row("all-gather", "bare-nccl", n, b.all_gather_ms, ring);
    }
  }
  const std::string path = p.out + "/comm.csv";
  dpt::write_file_atomic(path, out);
  std::printf("\nwrote %s\n", path.c_str());
  return 0;
}

int run(const Plan& p) {
  // Counts the layers' shapes; the model is never placed on a device.
  const int64_t parameters = dpt::nn::make_model(p.model, dpt::Act::relu)->num_parameters();
  print_header(p, parameters);
  if (p.comm) return run_comm(p, parameters);
  // One measurement per distinct (devices, global batch, path, precision): the 1-device
  // baseline serves every path, and weak equals strong when there is one device.
  std::map<std::tuple<size_t, int64_t, Reduce, Precision>, Measurement> done;
  std::vector<Row> rows;
  for (Scaling s : p.scalings)
    for (Reduce red : p.reduces)
      for (Precision prec : p.precisions) {
        const Measurement* base = nullptr;
        for (size_t n : p.counts) {
          const int64_t global = p.batch * static_cast<int64_t>(s == Scaling::weak ? n : p.devices.size());
          const auto key = std::make_tuple(n, global, n == 1 ? Reduce::automatic : red, prec);
          auto it = done.find(key);
          if (it == done.end()) it = done.emplace(key, measure(p, n, global, std::get<2>(key), prec)).first;
          const Measurement& m = it->second;
          if (n == 1) base = &m;
          // Weak: throughput against one device's; strong (one global batch): t1 / tn,
          // the same ratio. Efficiency is then speed-up / n in both.
          const double speedup = m.samples_per_s / base->samples_per_s;
          const Row r{s, red, prec, n, global, &m, speedup, speedup / static_cast<double>(n)};
          print_row(r, p.model.is_gpt);
          rows.push_back(r);
        }
      }
  const std::string dir = p.out + "/";
  dpt::write_file_atomic(dir + "dpbench.csv", csv(rows, p.model.is_gpt));
  dpt::write_file_atomic(dir + "dpbench.json", json(p, parameters, rows));
  chart(p, rows, dir + "speedup.svg");
  std::printf("\nwrote %sdpbench.csv, %sdpbench.json, %sspeedup.svg\n", dir.c_str(), dir.c_str(), dir.c_str());
  return 0;
}

// The fields a library message may name: DataParallelOptions', as dpbench's flags.
const std::vector<dpt::FieldId>& parallel_fields() {
  static const std::vector<dpt::FieldId> fields = [] {
    std::vector<dpt::FieldId> out;
    for (const auto& f : dpt::data_parallel_schema()) out.push_back(f.id);
    return out;
  }();
  return fields;
}

int fail(int status, const char* what) {
  std::fflush(stdout);
  std::fprintf(stderr, "dpbench: error: %s\n", dpt::app::one_line(what).c_str());
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  dpt::set_message_handler([](dpt::Severity severity, const dpt::Message& message) {
    std::fprintf(stderr, "dpbench: %s: %s\n", dpt::severity_name(severity),
                 dpt::app::one_line(dpt::app::message_text(message, parallel_fields())).c_str());
  });
  CLI::App app{
      "dpbench: one workload on 1, 2, 4, ... devices, weak and strong scaling, every reduction path "
      "and precision asked; a table, CSV, JSON and an SVG chart of the speed-up"};
  Flags f;
  add_flags(app, f);
  if (const int status = dpt::app::parse_command_line(app, argc, argv, "dpbench"); status >= 0) return status;
  f.on_command_line = dpt::app::command_line_flags(argc, argv);
  try {
    return run(make_plan(f, app));
  } catch (const dpt::UsageError& e) {
    return fail(kExitUsage, dpt::app::error_text(e, parallel_fields()).c_str());
  } catch (const dpt::OutOfMemory& e) {
    return fail(kExitOom, dpt::app::error_text(e, parallel_fields()).c_str());
  } catch (const std::bad_alloc&) {
    return fail(kExitOom, "out of memory on the host (a host allocation failed); use a smaller --batch or --model");
  } catch (const std::exception& e) {
    return fail(kExitError, dpt::app::error_text(e, parallel_fields()).c_str());
  }
}
