// dptrain: trains an MLP or a CNN on synthetic data. A thin layer over dpt::Trainer: parse the
// flags (CLI11), report progress, write metrics, print a summary. Exit status: 0 done,
// 1 runtime error, 2 bad input, 3 out of memory, 4 non-finite loss or gradients,
// 130/143 stopped by SIGINT/SIGTERM (after saving when --save is given).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>

#include <CLI/CLI.hpp>

#include <dptrain/error.hpp>
#include <dptrain/layers/conv.hpp>
#include <dptrain/parallel/process_group.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/train/checkpoint.hpp>
#include <dptrain/train/inference.hpp>
#include <dptrain/train/trainer.hpp>

#include "cli.hpp"
#include "common/atomic_file.hpp"
#include "plot.hpp"

namespace {

bool g_progress_open = false;          // a live progress line is on the terminal, not yet ended
dpt::ProcessGroup* g_group = nullptr;  // set once a --ddp run has joined its process group

// The rank the launcher gave this process, known before MPI starts (0 when not under
// mpirun): errors every rank would report alike are printed by rank 0 alone.
int launcher_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"})
    if (const char* v = std::getenv(var)) return std::atoi(v);
  return 0;
}

// How many processes the launcher started (1 when not under mpirun or srun).
int launcher_size() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"})
    if (const char* v = std::getenv(var)) return std::max(1, std::atoi(v));
  return 1;
}

// Under a launcher, before training has its process group, an error that every rank finds
// alike (a bad flag, a missing file on a shared disk) is rank 0's to report. A rank other
// than 0 first waits: the launcher ends the whole job as soon as one rank exits non-zero
// (Open MPI's mpiexec does; rank 0 also ends it itself once MPI runs), which could take
// rank 0 down before its line was out (ddp_test.sh once saw a job end with no line at
// all). A rank still running after the wait met a fault of its own (a file missing on its
// machine alone) and reports it, naming itself. Returns that prefix ("" for rank 0). (A
// launcher that does not end the job when one rank fails lets every rank report.)
constexpr auto kRank0Grace = std::chrono::seconds(2);
std::string wait_for_rank0(int rank) {
  if (rank == 0) return "";
  std::this_thread::sleep_for(kRank0Grace);
  return "rank " + std::to_string(rank) + ": ";
}

constexpr int kExitError = 1, kExitUsage = 2, kExitOom = 3, kExitNonFinite = 4;

// SIGINT/SIGTERM (and SIGPIPE) ask the run to stop after the current step and to save.
// Every further one is noted and nothing more: GNU timeout signals the child and then its
// process group, a launcher may pass one on to each rank, a user may press Ctrl-C twice,
// and a second signal must not kill a run in the middle of its orderly stop (its
// checkpoint). SIGKILL is the way to end a run at once. During start-up, before the
// trainer can stop between steps, there is nothing to save: the signal ends the process
// there and then, with its line and status (g_starting).
volatile std::sig_atomic_t g_signal = 0;    // the first of them
volatile std::sig_atomic_t g_starting = 1;  // until the training loop takes over the signals
bool g_quiet_rank = false;                  // a --ddp rank other than 0, which prints no summary
const char* signal_name(int sig) { return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "SIGPIPE"; }
void on_signal(int sig) {
  if (g_signal == 0) g_signal = sig;
  if (!g_starting) return;
  // Async-signal-safe: write(2) and _exit(2) only (the lines are made before).
  static const char kInt[] = "stopped by SIGINT during start-up, before the first step\n";
  static const char kTerm[] = "stopped by SIGTERM during start-up, before the first step\n";
  if (!g_quiet_rank && sig != SIGPIPE) {
    const ssize_t written =
        sig == SIGINT ? ::write(STDOUT_FILENO, kInt, sizeof kInt - 1) : ::write(STDOUT_FILENO, kTerm, sizeof kTerm - 1);
    (void)written;
  }
  ::_exit(128 + sig);
}
// The status of a run stopped by a signal: 128 + its number (130 for SIGINT, 143 for
// SIGTERM, as shells expect). A --ddp rank that stops because another rank was signalled
// has none of its own: it ends as terminated.
int stopped_status() { return 128 + (g_signal != 0 ? static_cast<int>(g_signal) : SIGTERM); }
void install_signal_handlers() {
  g_quiet_rank = launcher_rank() != 0;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  // SA_RESTART: a write of the checkpoint that a later signal interrupts goes on.
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGPIPE}) sigaddset(&sa.sa_mask, sig);  // one handler at a time
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  // A reader that goes away (dptrain ... | head) is a request to stop too: the run ends
  // after the step, with its checkpoint, instead of dying in the middle of a line.
  sigaction(SIGPIPE, &sa, nullptr);
  // Data files are mapped into memory: one cut short while the run reads it (rewritten in
  // place, say) faults on the next read of a page past its new end. One line and exit 1,
  // not a bus error and a core dump (nothing may be saved: the data read may be partial).
  struct sigaction bus {};
  bus.sa_handler = [](int) {
    static const char kLine[] =
        "dptrain: error: a data file was cut short or rewritten while the run read it (it is mapped into "
        "memory); leave --data, --targets and --val-data as they are until the run ends\n";
    ssize_t written = g_progress_open ? ::write(STDOUT_FILENO, "\n", 1) : 0;
    written = ::write(STDERR_FILENO, kLine, sizeof kLine - 1);
    (void)written;
    ::_exit(kExitError);
  };
  sigemptyset(&bus.sa_mask);
  sigaction(SIGBUS, &bus, nullptr);
}

// A float in JSON: the shortest text that reads back as the same value; JSON has no NaN or
// infinity, so those are null.
std::string json_number(float v) { return std::isfinite(v) ? dpt::format_float(v) : "null"; }

std::string duration(double s) {
  char buf[32];
  // Past a million hours (a run of 2^63 steps) the count would overflow an int: say so.
  if (!(s < 3.6e9)) std::snprintf(buf, sizeof buf, "over 10^6 h");
  else if (s >= 3600) std::snprintf(buf, sizeof buf, "%dh%02dm", int(s / 3600), int(s / 60) % 60);
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%dm%02ds", int(s / 60), int(s) % 60);
  else std::snprintf(buf, sizeof buf, "%.1fs", s);
  return buf;
}

struct Options {
  dpt::TrainConfig cfg;
  std::string task = "regression", act = "relu", precision = "fp32", gemm = "cublas", reduce = "auto";
  std::string grad_comm = "fp32";
  dpt::app::DeviceFlags devices;
  float lr = 0.0f;
  bool no_overlap = false, no_twin_buffers = false, auto_resume = false, shuffle = true, no_shuffle = false;
  bool overwrite = false;
  std::string metrics, plot, config;
  // Flags given (on the command line or in the config file) that resolve() checks against
  // each other: options of one optimizer are refused with the other.
  std::vector<std::string> given;
  std::vector<std::string> on_command_line;  // the flags argv itself gives
  bool was_given(const std::string& flag) const { return std::find(given.begin(), given.end(), flag) != given.end(); }
};

void add_flags(CLI::App& app, Options& o) {
  auto& c = o.cfg;
  app.add_option("--model", c.model,
                 "MLP spec (widths, e.g. 1024-4096x3-1024), CNN spec (cnn:3x32x32-c32k3-p2-c64k3-p2-f10, README) "
                 "or preset: seed, mlp, cnn-small, cnn")
      ->capture_default_str();
  app.add_option("--act", o.act, "Hidden activation: relu, gelu, tanh, or none (a linear model)")
      ->capture_default_str();
  app.add_option("--task", o.task, "Synthetic task: regression or classification (a CNN classifies images)")
      ->capture_default_str();
  using dpt::app::add_float, dpt::app::add_integer, dpt::app::add_path, dpt::app::add_switch;
  add_integer(app, "--batch", c.batch, "Global batch size")->capture_default_str();
  auto* steps = add_integer(app, "--steps", c.steps, "Total optimizer steps")->capture_default_str();
  add_integer(app, "--epochs", c.epochs, "Epochs over --samples (sets the number of steps instead of --steps)")
      ->excludes(steps);
  add_integer(app, "--samples", c.samples, "Synthetic dataset size (default: an endless stream of new samples)");
  add_path(app, "--data", c.data,
           "Train on this file: .safetensors (x, y, optional x_val, y_val) or .npy of inputs (with --targets)");
  add_path(app, "--targets", c.targets, "The .npy file of targets: float rows (regression) or integer class labels");
  add_path(app, "--val-data", c.val_data, "Validation inputs (.npy, with --val-targets, or .safetensors)");
  add_path(app, "--val-targets", c.val_targets, "Validation targets (.npy)");
  app.add_option("--val-fraction", c.val_fraction,
                 "Validate on the last F of the --data rows (never shuffled into training)");
  add_integer(app, "--eval-every", c.eval_every, "Validate every N steps (default: at the end of each epoch)");
  auto* shuffle =
      add_switch(app, "--shuffle", o.shuffle, "File data: a new order of the rows every epoch (the default)");
  add_switch(app, "--no-shuffle", o.no_shuffle, "File data: keep the file's order")->excludes(shuffle);
  add_float(app, "--lr", o.lr, "Learning rate (default: 0.05 for sgd, 0.001 for adamw)");
  app.add_option("--optimizer", c.optimizer, "sgd or adamw")->capture_default_str();
  add_float(app, "--momentum", c.momentum, "SGD momentum")->capture_default_str();
  add_switch(app, "--nesterov", c.nesterov, "Nesterov momentum (SGD)");
  add_float(app, "--weight-decay", c.weight_decay, "Weight decay (L2 for SGD, decoupled for AdamW)")
      ->capture_default_str();
  add_float(app, "--beta1", c.beta1, "AdamW beta1")->capture_default_str();
  add_float(app, "--beta2", c.beta2, "AdamW beta2")->capture_default_str();
  app.add_option("--schedule", c.schedule, "Learning-rate schedule: constant, warmup, cosine")->capture_default_str();
  add_integer(app, "--warmup", c.warmup, "Linear warm-up steps (warmup, cosine)")->capture_default_str();
  add_float(app, "--clip", c.clip, "Clip the global gradient norm to this value (0: off)")->capture_default_str();
  app.add_option("--precision", o.precision,
                 "Precision: fp32, tf32 (TF32 GEMMs), bf16 (bf16 storage, fp32 master weights)")
      ->capture_default_str();
  app.add_option("--gemm", o.gemm, "GEMM implementation: cublas or native (hand-written, fp32)")->capture_default_str();
  o.devices.add_to(app,
                   "Devices, e.g. cuda:0,cuda:1 or cpu:0,cpu:1 (default: every GPU, else cpu); "
                   "a GPU listed twice holds two replicas");
  app.add_option("--reduce", o.reduce, "Gradient reduction: auto, nccl, p2p (to the master), host (CPU devices)")
      ->capture_default_str();
  app.add_option("--bucket-mb", o.cfg.bucket_mb, "Gradient bucket size in MiB, reduced as soon as it is ready")
      ->capture_default_str();
  app.add_option("--first-bucket-mb", o.cfg.first_bucket_mb,
                 "The first bucket's size in MiB when smaller (the last layer's gradients go out at once)")
      ->capture_default_str();
  app.add_flag("--tune-buckets", o.cfg.tune_buckets,
               "Try bucket sizes of 1 to 64 MiB over the first steps (five each) and keep the fastest");
  add_integer(app, "--comm-ctas", o.cfg.comm_ctas,
              "NCCL: at most this many thread blocks a collective (fewer SMs taken from backward); 0: NCCL's choice")
      ->capture_default_str();
  app.add_option("--grad-comm", o.grad_comm,
                 "The type gradients travel in between devices: fp32, or bf16 (rounded before they leave a device; "
                 "not with --ddp on CPUs)")
      ->capture_default_str();
  add_integer(app, "--zero", o.cfg.zero,
              "ZeRO stage: 0 off, 1 the optimizer state sharded over the devices or ranks, 2 the gradients too "
              "(not with --cuda-graph)")
      ->capture_default_str();
  add_integer(app, "--grad-accum", o.cfg.grad_accum, "Micro-batches per step; gradients are reduced on the last only")
      ->capture_default_str();
  add_path(app, "--save", o.cfg.save,
           "Write a checkpoint (safetensors) here at the end, on SIGINT/SIGTERM and every --save-every steps");
  add_integer(app, "--save-every", o.cfg.save_every, "Also write the checkpoint every N steps");
  add_path(app, "--resume", o.cfg.resume, "Continue from this checkpoint (--steps stays the total)");
  add_switch(app, "--auto-resume", o.auto_resume,
             "Continue from the --save checkpoint when it exists, else start afresh (one command to retry)");
  app.add_option("--on-nonfinite", o.cfg.on_nonfinite,
                 "When a loss or gradient is not finite: stop (exit 4) or skip-step (the update is never applied)")
      ->capture_default_str();
  add_switch(app, "--cuda-graph", o.cfg.cuda_graph,
             "Record the whole step as CUDA graphs (one for odd steps, one for even) once and replay them (GPUs; "
             "--ddp too; in one process not NCCL over several GPUs: use --reduce p2p there)");
  add_switch(app, "--no-twin-buffers", o.no_twin_buffers,
             "Keep one copy of the parameters and optimizer state (on GPUs there are two by default where they serve: "
             "models of 2^21 (about 2.1M) parameters or more, without --clip or --zero; the update then checks the "
             "gradients in its own pass. This saves that memory for a second pass over the gradients a step)");
  add_switch(app, "--no-overlap", o.no_overlap,
             "Reduce gradients only after backward, and copy p2p parameters whole after the update (to measure what "
             "overlap gains)");
  add_switch(app, "--ddp", o.cfg.ddp, "One process per device under mpirun (MPI bootstrap, NCCL or MPI reduction)");
  app.add_option("--comm-timeout", o.cfg.comm_timeout,
                 "Seconds a --ddp rank waits for the others before the job is ended")
      ->capture_default_str();
  add_integer(app, "--seed", c.seed, "Seed of the data, the teacher and the initial weights")->capture_default_str();
  add_integer(app, "--log-every", c.log_every, "Read the loss back and log every N steps")->capture_default_str();
  add_path(app, "--metrics", o.metrics,
           "Write one JSON object per logged step to this file (JSONL; continued on --resume)");
  add_path(app, "--plot", o.plot, "Draw the loss curve and samples/s of the run into this SVG file");
  add_switch(app, "--overwrite", o.overwrite,
             "Replace --save, --metrics and --plot files that are not dptrain's (by default a run replaces only an "
             "empty file, a dptrain checkpoint, a metrics file or a plot of dptrain's)");
  dpt::app::add_config_flag(app);
  app.set_version_flag("--version", std::string("dptrain ") + DPT_VERSION);
}

// What a path names, for comparing two paths: the file a symlink leads to, in its folder
// made absolute and canonical (the file itself need not exist yet).
std::string file_identity(const std::string& path) {
  std::error_code ec;
  const auto p = std::filesystem::weakly_canonical(std::filesystem::absolute(dpt::resolve_output_path(path)), ec);
  return ec ? path : p.string();
}

// Whether two paths name one file: the same canonical path, or two names of one existing
// file (hard links: --metrics appends in place, so a hard link to --data would overwrite
// the data that the run reads).
bool same_file(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  if (file_identity(a) == file_identity(b)) return true;
  std::error_code ec;
  return std::filesystem::equivalent(a, b, ec) && !ec;
}

// Two outputs in one file would leave only the last written; an output over an input
// destroys the input. Only --save may name the --resume checkpoint (it replaces it, as a
// continuing run should).
void check_distinct_files(const Options& o) {
  struct Named {
    const char* flag;
    const std::string& path;
    bool output;
  };
  const Named files[] = {{"--save", o.cfg.save, true},
                         {"--plot", o.plot, true},
                         {"--metrics", o.metrics, true},
                         {"--resume", o.cfg.resume, false},
                         {"--config", o.config, false},
                         {"--data", o.cfg.data, false},
                         {"--targets", o.cfg.targets, false},
                         {"--val-data", o.cfg.val_data, false},
                         {"--val-targets", o.cfg.val_targets, false}};
  for (size_t i = 0; i < std::size(files); ++i)
    for (size_t j = i + 1; j < std::size(files); ++j) {
      const Named &a = files[i], &b = files[j];
      if (a.path.empty() || b.path.empty() || (!a.output && !b.output)) continue;
      if (std::string(a.flag) == "--save" && std::string(b.flag) == "--resume") continue;
      if (same_file(a.path, b.path))
        throw dpt::UsageError(std::string(a.flag) + " and " + b.flag + " name the same file '" + b.path + "'");
    }
}

// Turns the string flags into the config; throws dpt::UsageError on bad values. The
// Trainer checks the rest of it.
void resolve(Options& o) {
  auto& c = o.cfg;
  // Without --ddp each of mpirun's processes would train the whole job alone and write the
  // same checkpoint, metrics and plot over the others' (a metrics file of two interleaved
  // runs, which a resume then refuses).
  if (const int n = launcher_size(); n > 1 && !c.ddp)
    throw dpt::UsageError("this is one of " + std::to_string(n) +
                          " processes that mpirun started, without --ddp: each would train alone and write the same "
                          "files; add --ddp (one process a device)");
  c.task = dpt::data::parse_task(o.task);
  if (o.was_given("--lr")) c.lr = o.lr;
  c.overlap = !o.no_overlap;
  if (o.no_twin_buffers) c.twin_buffers = dpt::TwinBuffers::off;
  // A switch set to false (shuffle = false in a config file) is off, not "given".
  c.shuffle = o.shuffle && !o.no_shuffle;
  if ((o.was_given("--shuffle") || o.no_shuffle) && c.data.empty())
    throw dpt::UsageError("--shuffle and --no-shuffle order the rows of --data; synthetic data has no order to change");
  // An option of the other optimizer would be silently ignored: refuse it instead.
  static const std::pair<const char*, const char*> kOptimizerOf[] = {
      {"--momentum", "sgd"}, {"--nesterov", "sgd"}, {"--beta1", "adamw"}, {"--beta2", "adamw"}};
  if (c.optimizer == "sgd" || c.optimizer == "adamw")  // else validate() names the unknown one
    for (const auto& [flag, owner] : kOptimizerOf)
      if (o.was_given(flag) && c.optimizer != owner && !(std::string(flag) == "--nesterov" && !c.nesterov))
        throw dpt::UsageError(std::string(flag) + " is an option of --optimizer " + owner +
                              ", and this run trains with " + c.optimizer);
  if (o.auto_resume) {
    if (!c.resume.empty()) throw dpt::UsageError("--resume excludes --auto-resume");
    if (c.save.empty()) throw dpt::UsageError("--auto-resume needs --save (the checkpoint to continue from)");
    struct stat st {};
    if (::stat(c.save.c_str(), &st) == 0) c.resume = c.save;  // else a fresh start
  }
  if (o.was_given("--task") && !c.data.empty())
    throw dpt::UsageError("--task: the task of --data follows from its targets (float rows or integer labels)");
  if (o.was_given("--task") && c.task == dpt::data::Task::regression && dpt::nn::is_cnn_spec(c.model))
    throw dpt::UsageError("--task regression: a CNN model ('" + c.model + "') trains image classification");
  c.act = dpt::nn::parse_act(o.act);
  c.precision = dpt::parse_precision(o.precision);
  c.gemm = dpt::parse_gemm(o.gemm);
  c.devices = o.devices.devices(o.on_command_line);
  c.reduce = dpt::parse_reduce(o.reduce);
  if (o.grad_comm != "fp32" && o.grad_comm != "bf16")
    throw dpt::UsageError("unknown --grad-comm '" + o.grad_comm + "': expected fp32 or bf16");
  c.grad_comm = o.grad_comm == "bf16" ? dpt::DType::bf16 : dpt::DType::f32;
  // Given, these mean a data set; 0 would silently mean "no data set" (the defaults).
  if (o.was_given("--epochs") && c.epochs < 1)
    throw dpt::UsageError("--epochs must be >= 1, got " + std::to_string(c.epochs));
  if (o.was_given("--samples") && c.samples < 1)
    throw dpt::UsageError("--samples must be >= 1 (leave it out for an endless stream), got " +
                          std::to_string(c.samples));
  if (c.ddp && o.was_given("--reduce"))
    throw dpt::UsageError(
        "--reduce chooses how one process's replicas reduce; --ddp ranks all-reduce with NCCL (GPUs) "
        "or MPI (CPUs)");
  dpt::check_output_file(o.plot, "--plot");
  dpt::check_output_file(o.metrics, "--metrics");
  check_distinct_files(o);
}

std::string json_line(const dpt::StepLog& s) {
  char rates[160];
  std::snprintf(rates, sizeof rates, ", \"samples_per_s\": %.6g, \"step_ms\": %.6g, \"elapsed_s\": %.6g}",
                s.samples_per_s, s.step_ms, s.elapsed_s);
  return "{\"step\": " + std::to_string(s.step) + ", \"loss\": " + json_number(s.loss) +
         (std::isnan(s.accuracy) ? "" : ", \"accuracy\": " + json_number(s.accuracy)) +
         ", \"lr\": " + json_number(s.lr) +
         (s.val.rows == 0 ? ""
                          : ", \"val_loss\": " + json_number(static_cast<float>(s.val.loss)) +
                                (std::isnan(s.val.accuracy)
                                     ? ""
                                     : ", \"val_accuracy\": " + json_number(static_cast<float>(s.val.accuracy)))) +
         rates;
}

// The step of a metrics line this program wrote ({"step": N, ...}), or -1.
constexpr std::string_view kRecordStart = "{\"step\": ";
int64_t step_of(const std::string& line) {
  if (line.compare(0, kRecordStart.size(), kRecordStart) != 0) return -1;
  int64_t step = -1;
  std::from_chars(line.data() + kRecordStart.size(), line.data() + line.size(), step);
  return step;
}

// A resumed run continues its metrics file, so the file reads as one run: the records
// of steps up to the checkpoint's are kept, and the file is to be cut at the first record
// of a later step (written by a run killed after its last checkpoint: the records after
// it are later still), or at a last line without its newline (a record cut by a kill or a
// full disk, which the next record would otherwise join). Returns the bytes to keep, or
// -1 when there is no file yet. The file is read once, a line at a time, before training
// (a refusal after the first step would end the run without its checkpoint); a line that
// is no record, or longer than any, means the file is not a metrics file of ours and is
// refused: appending to it would mix our records into someone else's file.
off_t metrics_to_keep(const std::string& path, int64_t step, bool fresh = false) {
  constexpr size_t kMaxLine = 64 * 1024;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  std::vector<char> buf(kMaxLine);
  std::string line;        // the line being read, up to kMaxLine bytes
  off_t at = 0, keep = 0;  // bytes read; bytes of the records kept
  int64_t number = 1;      // the line's
  bool cut = false;
  std::string wrong;  // why the file is not ours
  for (ssize_t n; !cut && wrong.empty() && (n = ::read(fd, buf.data(), buf.size())) > 0;)
    for (ssize_t i = 0; i < n && !cut && wrong.empty(); ++i, ++at) {
      if (buf[static_cast<size_t>(i)] != '\n') {
        line += buf[static_cast<size_t>(i)];
        if (line.size() > kMaxLine) wrong = "line " + std::to_string(number) + " is over 64 KiB";
        continue;
      }
      const int64_t s = step_of(line);
      if (s < 0) wrong = "line " + std::to_string(number) + " is no record ({\"step\": N, ...})";
      else if (s > step) cut = true;
      else keep = at + 1;
      line.clear();
      ++number;
    }
  ::close(fd);
  // A last line without its newline is dropped, but only a record cut short: the start of
  // one ({"step": 7, "lo), or of its key.
  if (!cut && wrong.empty() && !line.empty() && step_of(line) < 0 && kRecordStart.compare(0, line.size(), line) != 0)
    wrong = "line " + std::to_string(number) + " is no record ({\"step\": N, ...})";
  if (!wrong.empty())
    throw dpt::UsageError("--metrics '" + path + "': " + wrong + ": not a metrics file of dptrain's, which a " +
                          (fresh ? "fresh run would replace (name another file, or give --overwrite)"
                                 : "resumed run would continue (name another file)"));
  return keep;
}

// A run replaces only what is its own: an empty file, a dptrain checkpoint (--save), a
// metrics file (a fresh run's --metrics; a resumed run continues one) or a plot of
// dptrain's (--plot). Anything else (notes.txt given as --metrics) is refused before the
// first step, unless --overwrite.
void check_outputs_are_ours(const Options& o) {
  if (o.overwrite) return;
  auto nonempty = [](const std::string& path) {
    struct stat st {};
    return !path.empty() && ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0;
  };
  const std::string& save = o.cfg.save;
  if (nonempty(save) && !same_file(save, o.cfg.resume)) {
    bool ours = false;
    try {
      const auto meta = dpt::ckpt::read_metadata(save);
      const auto format = meta.find("format");
      ours = format != meta.end() && format->second == "dptrain-1";
    } catch (const dpt::Error&) {  // not a safetensors file at all
    }
    if (!ours)
      throw dpt::UsageError("--save '" + save +
                            "' is not a dptrain checkpoint, which a run would replace (name another file, or give "
                            "--overwrite)");
  }
  if (nonempty(o.metrics) && o.cfg.resume.empty()) (void)metrics_to_keep(o.metrics, INT64_MAX, /*fresh=*/true);
  if (nonempty(o.plot)) {
    static const std::string kOurs = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg ";
    std::ifstream in(o.plot, std::ios::binary);
    std::string start(kOurs.size(), '\0');
    in.read(start.data(), static_cast<std::streamsize>(start.size()));
    if (start != kOurs)
      throw dpt::UsageError("--plot '" + o.plot +
                            "' is not a plot of dptrain's, which a run would replace (name another file, or give "
                            "--overwrite)");
  }
}

// Progress that redraws one line needs a terminal that a person watches. Under mpirun a
// rank's stdout is a pty of Open MPI's even when mpirun's own output goes to a file, so
// a launched rank prints plain lines.
bool interactive_terminal() {
  if (!isatty(STDOUT_FILENO)) return false;
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_ID"})
    if (std::getenv(var)) return false;
  const char* term = std::getenv("TERM");
  return !term || std::string(term) != "dumb";
}

std::string percent(float share) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100.0 * share);
  return buf;
}

int train(Options& o) {
  install_signal_handlers();
  resolve(o);
  check_outputs_are_ours(o);
  dpt::Trainer trainer(o.cfg);
  g_group = trainer.group();
  const auto& c = trainer.config();  // with --ddp: this rank's device
  // Rank 0 alone prints and writes metrics; every rank trains and checks.
  const bool lead = !g_group || g_group->rank() == 0;
  // The metrics file is opened (and a fresh run's emptied) at the first record, so a run
  // that ends before its first step leaves an existing file as it was.
  std::ofstream metrics;
  bool metrics_failed = false;
  off_t metrics_keep = -1;
  try {
    if (lead && trainer.resumed() && !o.metrics.empty())
      metrics_keep = metrics_to_keep(o.metrics, trainer.steps_done());
  } catch (const dpt::UsageError&) {
    if (!o.overwrite) throw;
    metrics_keep = 0;  // not a metrics file: --overwrite starts it afresh
  }
  auto open_metrics = [&] {
    if (metrics_keep >= 0 && ::truncate(o.metrics.c_str(), metrics_keep) != 0)
      throw dpt::Error("cannot cut the metrics file '" + o.metrics + "' at step " +
                       std::to_string(trainer.steps_done()) + ": " + std::strerror(errno));
    metrics.open(o.metrics, trainer.resumed() ? std::ios::out | std::ios::app : std::ios::out | std::ios::trunc);
    if (!metrics) throw dpt::UsageError("cannot write the metrics file '" + o.metrics + "'");
  };
  const bool tty = lead && interactive_terminal();
  std::string where = dpt::describe_device(c.devices.front());
  if (g_group) {
    where = std::to_string(g_group->size()) + " processes (rank 0 on " + c.devices.front().str() + "), reduce " +
            (c.devices.front().is_cuda() ? "nccl" : "mpi") + " in " + std::to_string(trainer.parallel().buckets()) +
            " bucket(s)";
  } else if (c.devices.size() > 1 || trainer.parallel().buckets() > 0) {
    where = std::to_string(c.devices.size()) + " replica(s) on";
    for (const auto& d : c.devices) where += " " + d.str();
    where += std::string(", reduce ") + dpt::reduce_name(trainer.parallel().reduce());
    if (trainer.parallel().buckets() > 0) where += " in " + std::to_string(trainer.parallel().buckets()) + " bucket(s)";
  }
  if (trainer.parallel().tuning_buckets()) where += " (sizes to be tuned)";
  if (lead) {
    std::printf("dptrain %s: %s, %lld parameters on %s\n", DPT_VERSION, trainer.model().describe().c_str(),
                static_cast<long long>(trainer.model().num_parameters()), where.c_str());
    std::printf("  %s, batch %lld, %lld steps, %s, %s, gemm %s\n", dpt::data::task_name(c.task),
                static_cast<long long>(c.batch), static_cast<long long>(c.steps),
                trainer.optimizer().describe().c_str(), dpt::precision_name(c.precision),
                c.devices.front().is_cpu() ? "cpu" : o.gemm.c_str());
    if (c.grad_accum > 1) std::printf("  gradient accumulation: %d micro-batches per step\n", c.grad_accum);
    if (c.zero > 0)
      std::printf("  ZeRO stage %d: the optimizer state%s sharded over the devices\n", c.zero,
                  c.zero == 2 ? " and the gradients" : "");
    if (c.grad_comm == dpt::DType::bf16 && c.devices.size() > 1)
      std::printf("  gradients travel in bf16 between devices\n");
    if (const dpt::data::Dataset* d = trainer.train_data()) {
      std::printf("  data: %s, %lld rows, %s", d->inputs_name().c_str(), static_cast<long long>(d->rows()),
                  c.shuffle ? "shuffled every epoch" : "in file order");
      if (const dpt::data::Dataset* v = trainer.val_data())
        std::printf("; validation: %lld rows", static_cast<long long>(v->rows()));
      std::printf("\n");
    }
    if (const auto& r = trainer.resumed()) {
      std::string changed;
      for (const auto& ch : r->changed) changed += (changed.empty() ? "; changed: " : ", ") + ch;
      std::printf("  resumed from '%s' at step %lld%s\n", r->path.c_str(), static_cast<long long>(r->step),
                  changed.c_str());
    }
    std::fflush(stdout);
  }

  dpt::plot::Series loss_curve{"loss", {}, {}, false}, speed{"samples/s", {}, {}, false};
  dpt::plot::Series val_curve{"validation loss", {}, {}, false};
  auto on_log = [&](const dpt::StepLog& s) {
    if (!lead) return;
    loss_curve.x.push_back(static_cast<double>(s.step));
    loss_curve.y.push_back(s.loss);
    if (s.val.rows > 0) {
      val_curve.x.push_back(static_cast<double>(s.step));
      val_curve.y.push_back(s.val.loss);
    }
    if (s.step > 1) {  // the first step's speed includes warm-up
      speed.x.push_back(static_cast<double>(s.step));
      speed.y.push_back(s.samples_per_s);
    }
    if (!o.metrics.empty() && !metrics.is_open() && !metrics_failed) open_metrics();
    if (metrics.is_open()) {
      errno = 0;
      metrics << json_line(s) << '\n';
      metrics.flush();
      if (!metrics) {  // a full disk, say: the run and its checkpoint matter more than the log
        const std::string why = errno != 0 ? std::strerror(errno) : "a write error";
        metrics.close();
        metrics_failed = true;
        dpt::report(dpt::Severity::warning, "writing the metrics file '" + o.metrics + "' failed at step " +
                                                std::to_string(s.step) + " (" + why +
                                                "); training goes on without it, its last line may be cut");
      }
    }
    const std::string eta = duration(s.step_ms * 1e-3 * static_cast<double>(s.total - s.step));
    const std::string acc = std::isnan(s.accuracy) ? "" : percent(s.accuracy);
    std::string val;  // " val_loss 0.31 val_accuracy 91.2%" when this step was validated
    if (s.val.rows > 0) {
      char buf[64];
      std::snprintf(buf, sizeof buf, " val_loss %.6g", s.val.loss);
      val = buf;
      if (!std::isnan(s.val.accuracy)) val += " val_accuracy " + percent(static_cast<float>(s.val.accuracy));
    }
    if (tty) {
      std::printf("\r\x1b[Kstep %lld/%lld | loss %.6g%s%s%s%s | %s samples/s | ETA %s", static_cast<long long>(s.step),
                  static_cast<long long>(s.total), s.loss, acc.empty() ? "" : " | accuracy ", acc.c_str(),
                  val.empty() ? "" : " |", val.c_str(), dpt::format_si(s.samples_per_s).c_str(), eta.c_str());
      g_progress_open = s.step != s.total;
      if (!g_progress_open) std::printf("\n");
    } else {
      std::printf("step %lld/%lld loss %.6g%s%s%s lr %s samples/s %s step_ms %.3f ETA %s\n",
                  static_cast<long long>(s.step), static_cast<long long>(s.total), s.loss,
                  acc.empty() ? "" : " accuracy ", acc.c_str(), val.c_str(), dpt::format_float(s.lr).c_str(),
                  dpt::format_si(s.samples_per_s).c_str(), s.step_ms, eta.c_str());
    }
    std::fflush(stdout);
  };
  g_starting = 0;  // from here the loop stops between steps, and saves
  const dpt::TrainResult r = trainer.run(on_log, [] { return g_signal != 0; });
  const uint64_t hash = trainer.parameter_hash();  // with --ddp: compared across every rank
  if (!lead) return r.stopped ? stopped_status() : 0;
  if (g_progress_open) {  // a stopped run ends the progress line before its summary
    std::printf("\n");
    g_progress_open = false;
  }
  if (!o.plot.empty()) {
    std::vector<dpt::plot::Series> losses{loss_curve};
    if (!val_curve.x.empty()) losses.push_back(val_curve);
    dpt::plot::Chart lc{"dptrain " + c.model + ": loss", "step", "loss (log scale)", losses, {}};
    lc.options.log_y = true;
    dpt::plot::Chart sc{"throughput", "step", "samples/s", {speed}, {}};
    dpt::plot::write_line_charts(o.plot, {lc, sc});
  }
  const double ratio = r.first_loss != 0.0f ? 100.0 * r.final_loss / r.first_loss : 0.0;
  if (r.steps == 0 && !r.stopped)
    std::printf("done: nothing to train, the run was complete at step %lld of %lld\n",
                static_cast<long long>(trainer.steps_done()), static_cast<long long>(c.steps));
  else if (r.steps == 0)
    std::printf("stopped: before the first step, at step %lld of %lld\n", static_cast<long long>(trainer.steps_done()),
                static_cast<long long>(c.steps));
  else
    std::printf("%s: %lld steps in %s; loss %.6g -> %.6g (%.1f%% of the first); %s samples/s; %.4f ms/step\n",
                r.stopped ? "stopped" : "done", static_cast<long long>(r.steps), duration(r.seconds).c_str(),
                r.first_loss, r.final_loss, ratio, dpt::format_si(r.samples_per_s).c_str(), r.step_ms);
  if (!std::isnan(r.final_accuracy))
    std::printf("accuracy: %s of the last logged batch\n", percent(r.final_accuracy).c_str());
  if (r.val.rows > 0)
    std::printf("validation: loss %.6g%s over %lld rows\n", r.val.loss,
                std::isnan(r.val.accuracy) ? "" : (", accuracy " + percent(static_cast<float>(r.val.accuracy))).c_str(),
                static_cast<long long>(r.val.rows));
  if (r.input.loads > 0) {
    const double copy = r.input.timed_copies > 0 ? r.input.copy_ms / static_cast<double>(r.input.timed_copies) : 0.0;
    const double per_step = copy * c.grad_accum;  // a replica copies a shard a micro-batch
    std::printf(
        "input pipeline: %lld shards gathered at %.2f GB/s on the host (%.3f ms each), copied in %.3f ms each "
        "(%.0f%% of a step, beside it)\n",
        static_cast<long long>(r.input.loads), r.input.gather_gb_per_s(),
        1e3 * r.input.gather_s / static_cast<double>(r.input.loads), copy,
        r.step_ms > 0 ? 100.0 * per_step / r.step_ms : 0.0);
  }
  std::printf("step time (last logged step, master): compute %.3f ms, reduce %.3f ms, update %.3f ms\n",
              r.times.compute, r.times.reduce, r.times.update);
  for (const dpt::ModelStateBytes& b : r.model_state)
    std::printf("model state %s: parameters %s, gradients %s, optimizer state %s%s\n", b.device.str().c_str(),
                dpt::format_bytes(static_cast<size_t>(b.parameters)).c_str(),
                dpt::format_bytes(static_cast<size_t>(b.gradients)).c_str(),
                dpt::format_bytes(static_cast<size_t>(b.optimizer)).c_str(),
                b.twins > 0 ? (", twin copies " + dpt::format_bytes(static_cast<size_t>(b.twins))).c_str() : "");
  for (const auto& [dev, m] : r.memory)
    std::printf("memory %s: peak %s allocated, %s reserved, %lld system allocations\n", dev.str().c_str(),
                dpt::format_bytes(m.peak_allocated).c_str(), dpt::format_bytes(m.peak_reserved).c_str(),
                static_cast<long long>(m.system_allocs));
  std::printf("parameters: hash %016llx%s\n", static_cast<unsigned long long>(hash),
              g_group ? (", identical on all " + std::to_string(g_group->size()) + " ranks").c_str() : "");
  if (r.skipped > 0) std::printf("skipped %lld step(s) with non-finite gradients\n", static_cast<long long>(r.skipped));
  if (!c.save.empty())
    std::printf("checkpoint: %s (step %lld)\n", c.save.c_str(), static_cast<long long>(trainer.steps_done()));
  if (r.stopped) {
    std::printf("stopped by %s after step %lld\n", g_signal != 0 ? signal_name(g_signal) : "a signal to another rank",
                static_cast<long long>(trainer.steps_done()));
    return stopped_status();
  }
  return 0;
}

// `dptrain predict` and `dptrain eval`: a trained model (from its checkpoint) over a data
// set, on every device of one process.
struct AfterTraining {
  dpt::InferenceConfig cfg;
  dpt::app::DeviceFlags devices;
  std::string data, targets, out, probabilities, precision = "fp32";
  std::vector<std::string> on_command_line;
};

void add_after_training_flags(CLI::App& sub, AfterTraining& a, bool predict) {
  using dpt::app::add_integer, dpt::app::add_path;
  add_path(sub, "--resume", a.cfg.checkpoint, "The checkpoint of the trained model")->required();
  add_path(sub, "--data", a.data, "Inputs: .npy (with --targets for eval) or .safetensors (x, and y for eval)")
      ->required();
  if (predict) {
    add_path(sub, "--out", a.out,
             "Write the outputs here (.npy): float rows (regression) or int32 class indices (classification)")
        ->required();
    add_path(sub, "--probabilities", a.probabilities,
             "Classification: also write the softmax probabilities here (.npy, float32 [rows, classes])");
  } else {
    add_path(sub, "--targets", a.targets, "Targets (.npy) of a .npy --data");
  }
  add_integer(sub, "--batch", a.cfg.batch, "Rows a device computes at a time")->capture_default_str();
  sub.add_option("--precision", a.precision, "fp32, tf32 or bf16")->capture_default_str();
  a.devices.add_to(sub, "Devices, e.g. cuda:0,cuda:1 or cpu (default: every GPU, else cpu)");
}

// Class index and softmax probabilities of each row of scores (in double: an output file
// holds what the model says, rounded once).
void classify(const std::vector<float>& scores, int64_t rows, int64_t classes, std::vector<int32_t>& index,
              std::vector<float>& probabilities) {
  index.resize(static_cast<size_t>(rows));
  probabilities.resize(scores.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = scores.data() + r * classes;
    int64_t best = 0;
    for (int64_t c = 1; c < classes; ++c)
      if (row[c] > row[best]) best = c;
    double sum = 0;
    for (int64_t c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(row[c]) - row[best]);
    for (int64_t c = 0; c < classes; ++c)
      probabilities[static_cast<size_t>(r * classes + c)] =
          static_cast<float>(std::exp(static_cast<double>(row[c]) - row[best]) / sum);
    index[static_cast<size_t>(r)] = static_cast<int32_t>(best);
  }
}

int after_training(AfterTraining& a, bool predict) {
  if (const int n = launcher_size(); n > 1)
    throw dpt::UsageError(std::string(predict ? "predict" : "eval") +
                          " runs in one process (it uses every GPU there); under mpirun each of the " +
                          std::to_string(n) + " processes would do the whole job" +
                          (predict ? " and write the same --out" : "") + ": run it without mpirun");
  a.cfg.devices = a.devices.devices(a.on_command_line);
  a.cfg.precision = dpt::parse_precision(a.precision);
  for (const std::string* out : {&a.out, &a.probabilities}) {
    dpt::check_output_file(*out, out == &a.out ? "--out" : "--probabilities");
    if (same_file(*out, a.data) || same_file(*out, a.targets) || same_file(*out, a.cfg.checkpoint))
      throw dpt::UsageError((out == &a.out ? "--out" : "--probabilities") + std::string(" '") + *out +
                            "' is an input of this run");
  }
  if (same_file(a.probabilities, a.out))
    throw dpt::UsageError("--out and --probabilities name the same file '" + a.out + "'");
  dpt::Inference model(a.cfg);
  const auto data = std::make_shared<dpt::data::ArrayDataset>(
      dpt::open_data_file(a.data, a.targets, "data", "targets", /*need_targets=*/false).train);
  const auto classes = model.spec().outputs();
  const bool classify_rows = model.task() == dpt::data::Task::classification;
  if (!predict) {
    const dpt::EvalResult r = model.evaluate(*data);
    if (!std::isfinite(r.loss))  // the outputs overflowed (inputs of 1e38, say): no number to report
      throw dpt::NonFiniteError("eval: the loss over " + std::to_string(r.rows) + " rows of " + data->inputs_name() +
                                " is not finite (" + std::to_string(r.loss) + "): the model's outputs overflowed");
    std::printf("eval: %s on %s: loss %.6g%s over %lld rows\n", model.model_text().c_str(), data->inputs_name().c_str(),
                r.loss, std::isnan(r.accuracy) ? "" : (", accuracy " + percent(static_cast<float>(r.accuracy))).c_str(),
                static_cast<long long>(r.rows));
    return 0;
  }
  if (!a.probabilities.empty() && !classify_rows)
    throw dpt::UsageError("--probabilities: the model of '" + a.cfg.checkpoint + "' does regression");
  const std::vector<float> y = model.predict(*data);
  const int64_t rows = data->rows();
  // Outputs that overflowed are no prediction (argmax over NaN scores would say class 0):
  // refused before any file is written.
  if (const auto bad = std::find_if(y.begin(), y.end(), [](float v) { return !std::isfinite(v); }); bad != y.end())
    throw dpt::NonFiniteError("predict: the model's output for row " + std::to_string((bad - y.begin()) / classes) +
                              " of " + data->inputs_name() + " is not finite (" + std::to_string(*bad) +
                              "); nothing was written");
  if (classify_rows) {
    std::vector<int32_t> index;
    std::vector<float> probabilities;
    classify(y, rows, classes, index, probabilities);
    dpt::write_npy_file(a.out, {index.data(), dpt::data::ArrayDType::i32, {rows}});
    if (!a.probabilities.empty())
      dpt::write_npy_file(a.probabilities, {probabilities.data(), dpt::data::ArrayDType::f32, {rows, classes}});
  } else {
    dpt::write_npy_file(a.out, {y.data(), dpt::data::ArrayDType::f32, {rows, classes}});
  }
  std::printf("predict: %s on %lld rows of %s -> %s%s%s\n", model.model_text().c_str(), static_cast<long long>(rows),
              data->inputs_name().c_str(), a.out.c_str(), a.probabilities.empty() ? "" : ", ", a.probabilities.c_str());
  return 0;
}

// One line on stderr, after ending a live progress line if one is open. In a --ddp
// job the line names the rank and the whole job is ended at once (MPI_Abort), so the
// other ranks do not wait for a peer that is gone.
int fail(int status, const char* what, bool alike = false) {
  // An error of one rank's ends the job at once, naming the rank; one that every rank meets
  // alike once they run (`alike`) is rank 0's to report, as before they run.
  if (g_group && g_group->size() > 1 && !alike) g_group->abort(what, status);
  // Before that, MPI may run already (the trainer starts it before it can fail).
  dpt::ProcessGroup* mpi = g_group ? g_group : dpt::ProcessGroup::world_if_made();
  const std::string who = wait_for_rank0(mpi ? mpi->rank() : launcher_rank());
  std::fprintf(stderr, "%sdptrain: error: %s%s\n", g_progress_open ? "\n" : "", who.c_str(),
               dpt::app::one_line(dpt::app::in_flags(what)).c_str());
  // The whole job ends now: a peer may wait for this rank in a collective, and rank 0
  // waiting for the others in MPI_Finalize would let them report the same error too.
  if (mpi && mpi->size() > 1) mpi->end_job(status);
  return status;
}

// Runs `job`, turning its errors into their exit status and one line on stderr.
int with_exit_status(const std::function<int()>& job) {
  try {
    return job();
  } catch (const dpt::UsageError& e) {
    return fail(kExitUsage, e.what());
  } catch (const dpt::OutOfMemory& e) {
    return fail(kExitOom, e.what());
  } catch (const dpt::NonFiniteError& e) {
    return fail(kExitNonFinite, e.what(), /*alike=*/true);  // every rank checks the same reduced gradients
  } catch (const std::bad_alloc&) {                         // a host allocation the allocator does not make
    return fail(kExitOom,
                "out of memory on the host (a host allocation failed); use a smaller batch (--batch) or model");
  } catch (const std::length_error&) {  // a host array longer than the address space allows
    return fail(kExitOom,
                "out of memory on the host (an array longer than memory allows was asked); use a smaller batch "
                "(--batch) or model");
  } catch (const std::exception& e) {
    return fail(kExitError, e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  // The library's notes and warnings, and the error that ends a --ddp job, as lines of our own.
  dpt::set_message_handler([](dpt::Severity severity, const std::string& message) {
    std::fprintf(stderr, "%sdptrain: %s: %s\n", g_progress_open ? "\n" : "", dpt::severity_name(severity),
                 dpt::app::one_line(dpt::app::in_flags(message)).c_str());
    std::fflush(stderr);
    g_progress_open = false;
  });
  CLI::App app{"dptrain: data-parallel training of MLPs and CNNs on synthetic data, on GPUs or the CPU"};
  Options o;
  add_flags(app, o);
  AfterTraining predict_args, eval_args;
  CLI::App* predict = app.add_subcommand("predict", "Write a trained model's outputs for every row of a data set");
  CLI::App* eval = app.add_subcommand("eval", "Print a trained model's loss and accuracy on a data set");
  add_after_training_flags(*predict, predict_args, true);
  add_after_training_flags(*eval, eval_args, false);
  app.require_subcommand(0, 1);
  // A fault in the command line is rank 0's to report, unless this rank's alone.
  if (const int status =
          dpt::app::parse_command_line(app, argc, argv, "dptrain", [] { return wait_for_rank0(launcher_rank()); });
      status >= 0)
    return status;
  if (*predict || *eval) {
    AfterTraining& a = *predict ? predict_args : eval_args;
    a.on_command_line = dpt::app::command_line_flags(argc, argv);
    // The training flags mean nothing here: given before the subcommand, they are an error.
    for (const CLI::Option* opt : app.get_options())
      if (opt->count() > 0 && opt->get_name() != "--help")
        return fail(kExitUsage, (opt->get_name() + " is a training flag; " + (*predict ? "predict" : "eval") +
                                 " takes --resume, --data and its own flags (see dptrain " +
                                 (*predict ? "predict" : "eval") + " --help)")
                                    .c_str());
    return with_exit_status([&] { return after_training(a, static_cast<bool>(*predict)); });
  }
  for (const CLI::Option* opt : app.get_options())
    if (opt->count() > 0) o.given.push_back(opt->get_name());
  o.on_command_line = dpt::app::command_line_flags(argc, argv);
  if (app.count("--config") > 0) o.config = app["--config"]->as<std::string>();
  return with_exit_status([&] { return train(o); });
}
