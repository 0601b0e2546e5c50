// step_bench: times dptrain's training step on one device for a reference workload of
// BENCHMARKS.md (seed, mlp, cnn, or any MLP or CNN spec), with a fixed random batch so
// only the step is timed (forward, loss, backward, SGD), as the PyTorch twin
// (torch_bench.py) does; or a GPT's step (gpt2, gpt2-medium, gpt:SPEC) on a fixed batch of
// random tokens with AdamW, as torch_gpt_bench.py times it (benchmarks/gpt_bench.hpp).
// Prints one line: workload, precision, gemm, ms/step (median of timed blocks),
// samples/s, peak memory, the loss before and after as a sanity check, and the mean of
// the blocks (a run's summary is a mean: loop_vs_step.sh compares with it); a GPT's line
// has its batch and sequence length, tokens/s and the model flops utilization (MFU) in
// place of samples/s. bf16 trains with bf16 storage (Module::set_compute_dtype), as
// dptrain --precision bf16 does (a GPT's default).
// --check makes the update the one dptrain's loop makes: it also checks the gradients
// (a non-finite step is skipped on the device) and records each check in a ring of host
// memory, with twin buffers where DataParallel takes them (a GPU, twins_by_default's
// sizes; then a graph is recorded for each parity, as the loop records it),
// so that the loop can be compared with the step it runs as well as with the plain step.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <dptrain/data/synthetic.hpp>
#include <dptrain/layers/conv.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/layers/model_spec.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>
#include "apps/cli.hpp"
#include "benchmarks/gpt_bench.hpp"

using namespace dpt;

namespace {

// A workload on its device: the model, its fixed batch, its loss and its optimizer.
struct Workload {
  std::shared_ptr<nn::Module> net;
  Tensor x, y;
  std::function<Tensor(const Tensor&, const Tensor&)> loss;
  std::unique_ptr<optim::Optimizer> opt;
  bool is_gpt = false;
  nn::GptConfig gpt;
  int64_t seq = 0;  // a GPT's tokens a sequence
};

// An MLP regresses random targets (MSE); a CNN classifies random images (cross-entropy
// against labels drawn from the same generator); a GPT predicts random tokens' next
// tokens. bf16 is bf16 storage, as in training: activations and weight copies in bf16,
// fp32 master weights, gradients and optimizer state (the input is cast in the first layer).
Workload make_workload(const std::string& model, int64_t batch, int64_t seq, const Device& d, Precision precision,
                       nn::AttentionBackward attention_backward) {
  Workload w;
  const nn::ModelSpec spec = nn::parse_model_spec(model);
  w.net = nn::make_model(spec, Act::relu);
  if (spec.is_gpt) {
    static_cast<nn::GPT&>(*w.net).set_attention_backward(attention_backward);
    w.is_gpt = true;
    w.gpt = spec.gpt;
    w.seq = bench::gpt_seq(spec.gpt, seq);
    const data::Batch tokens = bench::gpt_tokens(spec.gpt, w.seq, 0, batch, d);
    w.x = tokens.x;
    w.y = tokens.y;
    w.loss = [vocab = spec.gpt.vocab](const Tensor& out, const Tensor& y) { return nn::lm_loss(out, y, vocab); };
  } else if (spec.is_cnn) {
    w.x = Tensor::empty({batch, spec.cnn.input[0], spec.cnn.input[1], spec.cnn.input[2]}, DType::f32, d);
    w.y = data::random_labels(batch, spec.outputs(), 1, 2, 0, d);
    w.loss = [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
  } else {
    w.x = Tensor::empty({batch, spec.widths.front()}, DType::f32, d);
    w.y = Tensor::empty({batch, spec.widths.back()}, DType::f32, d);
    normal_(w.y, 1, 2, 0);
    w.loss = nn::MSELoss();
  }
  if (!spec.is_gpt) normal_(w.x, 1, 1, 0);
  w.net->set_compute_dtype(precision == Precision::bf16 ? DType::bf16 : DType::f32);
  w.net->to(d, 1);
  if (spec.is_gpt) w.opt = std::make_unique<optim::AdamW>(*w.net, bench::kGptAdamW);
  else w.opt = std::make_unique<optim::SGD>(*w.net, optim::SGD::Options{.lr = 0.01f});
  return w;
}

// What was timed, as the workload's line of output says it.
struct Timing {
  double median_ms = 0, mean_ms = 0;
  float first_loss = 0, last_loss = 0;
};

struct LineFlags {
  std::string model, precision, gemm, attention_backward = "deterministic";
  nn::AttentionBackward attention = nn::AttentionBackward::deterministic;  // attention_backward, checked
  int64_t batch = 0;
  bool graph = false, check = false;
  double peak_tflops = bench::kDefaultPeakTflops;
};

void print_line(const LineFlags& f, Workload& w, const Timing& t, const Device& d) {
  const double peak_mib = static_cast<double>(memory_stats(d).peak_allocated) / (1 << 20);
  const char* graph = f.graph ? "-graph" : "";
  const char* checked = f.check ? "-checked" : "";
  const char* gemm = d.is_cpu() ? "cpu" : f.gemm.c_str();  // a CPU has one GEMM, neither cuBLAS nor native
  if (!w.is_gpt) {
    std::printf(
        "dptrain %s batch %lld %s %s%s%s: %.4f ms/step, %.4g samples/s, peak %.1f MiB, loss %.5g -> %.5g; mean %.4f "
        "ms/step\n",
        f.model.c_str(), static_cast<long long>(f.batch), f.precision.c_str(), gemm, graph, checked, t.median_ms,
        1e3 * static_cast<double>(f.batch) / t.median_ms, peak_mib, t.first_loss, t.last_loss, t.mean_ms);
    return;
  }
  // Only cuDNN's attention (bf16 on a GPU) has a fast backward: the label says where it runs.
  const bool fast = f.attention == nn::AttentionBackward::fast && d.is_cuda() && f.precision == "bf16";
  const char* attention = fast ? "-fast-attention" : "";
  const double tokens_per_s = 1e3 * static_cast<double>(f.batch * w.seq) / t.median_ms;
  const double flops = bench::gpt_flops_per_token(w.gpt, w.net->num_parameters(), w.seq);
  std::printf(
      "dptrain %s B %lld T %lld %s %s%s%s%s: %.4f ms/step, %.0f tokens/s, MFU %.1f%% of %g TFLOPS, peak %.1f MiB, "
      "loss %.5g -> %.5g; mean %.4f ms/step\n",
      f.model.c_str(), static_cast<long long>(f.batch), static_cast<long long>(w.seq), f.precision.c_str(), gemm, graph,
      checked, attention, t.median_ms, tokens_per_s, bench::mfu_percent(flops, tokens_per_s, f.peak_tflops),
      f.peak_tflops, peak_mib, t.first_loss, t.last_loss, t.mean_ms);
}

struct CountFlags {
  int64_t seq = 0, warmup = 20, blocks = 7, per_block = 20, graph_steps = 1;
};

void add_flags(CLI::App& app, LineFlags& line, CountFlags& n, std::string& device) {
  using app::add_integer;
  app.add_option("--model", line.model, "seed, mlp, cnn, an MLP spec, cnn:SPEC, gpt2, gpt2-medium or gpt:SPEC");
  add_integer(app, "--batch", line.batch, "Batch size (default 64; a GPT's: sequences, default 16)");
  add_integer(app, "--seq", n.seq, "A GPT's sequence length (default: its context)");
  app.add_option("--precision", line.precision, "fp32, tf32, bf16 (default: fp32; bf16 for a GPT)");
  app.add_option("--gemm", line.gemm, "cublas or native (a GPU's)");
  app.add_option("--devices", device, "The device (one)");
  add_integer(app, "--warmup", n.warmup, "Untimed steps (at least 1: the first step allocates)");
  add_integer(app, "--blocks", n.blocks, "Timed blocks (the median is reported)");
  add_integer(app, "--steps", n.per_block, "Steps per timed block");
  app::add_double(app, "--peak-tflops", line.peak_tflops,
                  "A GPT's MFU against this many TFLOPS (default 989: an H100 or H200 SXM's dense bf16 peak)");
  app.add_flag("--cuda-graph", line.graph, "Record the step as a CUDA graph after warm-up and time its replays");
  app.add_flag("--check", line.check,
               "Check the gradients in the update and record the check in host memory, as dptrain's loop does");
  app.add_option("--attention-backward", line.attention_backward,
                 "A GPT's: deterministic (the default) or fast (cuDNN adds dQ's parts as they finish)");
  add_integer(app, "--graph-steps", n.graph_steps,
              "With --cuda-graph: steps recorded in one graph (one replay runs them), 1 to 64");
}

// The flags against each other and their ranges, before any work: UsageError with one line.
Device checked_flags(const CLI::App& app, LineFlags& line, const CountFlags& n, const std::string& device) {
  const bool is_gpt = nn::is_gpt_spec(line.model);
  if (!is_gpt && app.count("--seq") > 0) throw UsageError("--seq is a GPT's sequence length");
  line.attention = bench::checked_attention_backward(line.attention_backward, is_gpt);
  if (is_gpt && app.count("--precision") == 0) line.precision = "bf16";  // as torch_gpt_bench.py
  if (is_gpt && app.count("--batch") == 0) line.batch = 16;
  line.peak_tflops = bench::checked_peak_tflops(line.peak_tflops, app.count("--peak-tflops") > 0, is_gpt);
  // A run of more than this is a typo, not a benchmark (it would run for years), as dpbench's.
  constexpr int64_t kMax = 1'000'000'000;
  for (const auto& [flag, v] :
       {std::pair{"--batch", line.batch}, {"--warmup", n.warmup}, {"--blocks", n.blocks}, {"--steps", n.per_block}})
    if (v < 1 || v > kMax)
      throw UsageError(std::string(flag) + " must be 1 to " + std::to_string(kMax) + ", got " + std::to_string(v));
  if (app.count("--graph-steps") > 0 && !line.graph) throw UsageError("--graph-steps needs --cuda-graph");
  if (n.graph_steps < 1 || n.graph_steps > 64)
    throw UsageError("--graph-steps must be 1 to 64, got " + std::to_string(n.graph_steps));
  const std::vector<Device> devices = parse_devices(device);
  if (devices.size() != 1)
    throw UsageError("step_bench times one device's step; --devices names " + std::to_string(devices.size()));
  const Device d = devices.front();
  if (d.is_cpu() && line.graph) throw UsageError("--cuda-graph records a GPU's step; --devices is a CPU");
  if (d.is_cpu() && parse_gemm(line.gemm) == GemmImpl::native)
    throw UsageError("--gemm native is a CUDA kernel; the CPU has one GEMM");
  return d;
}

int fail(int status, const std::string& what) {
  std::fflush(stdout);
  std::fprintf(stderr, "step_bench: error: %s\n", app::one_line(what).c_str());
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"step_bench: time one training step of dptrain"};
  LineFlags line{.model = "seed", .precision = "fp32", .gemm = "cublas", .batch = 64};
  CountFlags n;
  std::string device = "cuda:0";
  add_flags(app, line, n, device);
  if (const int status = app::parse_command_line(app, argc, argv, "step_bench"); status >= 0) return status;
  try {
    const Device d = checked_flags(app, line, n, device);
    const int64_t warmup = n.warmup, blocks = n.blocks, per_block = n.per_block, graph_steps = n.graph_steps;
    Context& ctx = context(d);
    ctx.precision = parse_precision(line.precision);
    ctx.gemm = parse_gemm(line.gemm);
    Workload w = make_workload(line.model, line.batch, n.seq, d, ctx.precision, line.attention);
    nn::Module& net = *w.net;
    optim::Optimizer& opt = *w.opt;
    const bool twins = line.check && d.is_cuda() && twins_by_default(net.flat_params().numel());
    opt.set_twin_buffers(twins);
    // The loop's ring: kSlots records in mapped host memory (train/nonfinite_watch.hpp's
    // kLag), read by no one here.
    constexpr int64_t kSlots = 8;
    PinnedBuffer records(sizeof(CheckRecord) * kSlots, d, /*mapped=*/true);
    const CheckRing ring{static_cast<CheckRecord*>(records.device_data()), kSlots, Tensor::zeros({2}, DType::i32, d)};
    auto step = [&] {
      net.zero_grad();
      Tensor loss = w.loss(net.forward(w.x), w.y);
      loss.backward();
      if (line.check) opt.checked_step(0.0f, ring);
      else opt.step();
      return loss;
    };
    Timing t;
    t.first_loss = step().item();
    for (int64_t i = 1; i < warmup; ++i) step();
    ctx.synchronize();
    // With a graph, the timed "step" is one replay of a recorded step; its loss tensor
    // is the one the graph writes. With twins a step's forward reads the copy its parity
    // names: a recording for each parity (of an odd number of steps), replayed in turn.
    std::vector<std::unique_ptr<Graph>> recorded;
    std::vector<Tensor> graph_loss;  // each recording's
    if (line.graph)
      for (int parity = 0; parity < (twins && graph_steps % 2 == 1 ? 2 : 1); ++parity) {
        recorded.push_back(std::make_unique<Graph>(ctx, recorded.empty() ? nullptr : recorded.front().get()));
        recorded.back()->begin();
        graph_loss.emplace_back();
        for (int64_t i = 0; i < graph_steps; ++i) graph_loss.back() = step();
        recorded.back()->end();
      }
    // A replay of a graph of several steps counts as that many steps.
    const int64_t per_call = recorded.empty() ? 1 : graph_steps;
    size_t replays = 0;
    auto timed_step = [&] {
      if (recorded.empty()) return step();
      const size_t k = replays++ % recorded.size();
      recorded[k]->launch();
      return graph_loss[k];
    };
    std::vector<double> ms;
    Tensor loss;
    for (int64_t b = 0; b < blocks; ++b) {
      const auto t0 = std::chrono::steady_clock::now();
      int64_t done = 0;
      for (; done < per_block; done += per_call) loss = timed_step();
      ctx.synchronize();
      const auto t1 = std::chrono::steady_clock::now();
      ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count() / static_cast<double>(done));
    }
    // The median block, robust to a slow one; and the mean, the statistic of a run's
    // summary (dptrain's ms/step is its time over its steps), for comparing with one.
    for (double v : ms) t.mean_ms += v / static_cast<double>(ms.size());
    std::sort(ms.begin(), ms.end());
    t.median_ms = ms[ms.size() / 2];
    t.last_loss = loss.item();
    print_line(line, w, t, d);
    return 0;
  } catch (const UsageError& e) {
    return fail(2, e.what());
  } catch (const OutOfMemory& e) {
    return fail(3, e.what());
  } catch (const std::bad_alloc&) {
    return fail(3, "out of memory on the host (a host allocation failed); use a smaller --batch or --model");
  } catch (const std::exception& e) {
    return fail(1, e.what());
  }
}
