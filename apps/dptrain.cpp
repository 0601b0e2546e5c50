// dptrain: trains an MLP or a CNN on synthetic data or the arrays of a file. A thin layer over dpt::Trainer: parse the
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
#include <dptrain/train/hf.hpp>
#include <dptrain/train/inference.hpp>
#include <dptrain/train/trainer.hpp>

#include "cli.hpp"
#include "common/atomic_file.hpp"
#include "generate_command.hpp"
#include "plot.hpp"
#include "train_flags.hpp"

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
                                     : ", \"val_accuracy\": " + json_number(static_cast<float>(s.val.accuracy))) +
                                (std::isnan(s.val.perplexity)
                                     ? ""
                                     : ", \"val_perplexity\": " + json_number(static_cast<float>(s.val.perplexity)))) +
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
void check_outputs_are_ours(const dpt::app::TrainFlags& o) {
  if (o.overwrite) return;
  auto nonempty = [](const std::string& path) {
    struct stat st {};
    return !path.empty() && ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0;
  };
  const std::string& save = o.cfg.save;
  if (nonempty(save) && !dpt::app::same_file(save, o.cfg.resume)) {
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

// The lines that open a run: the model, where it trains, the settings that shape a step,
// the data and where a resumed run came from.
void print_header(dpt::Trainer& trainer) {
  const auto& c = trainer.config();
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
  std::printf("dptrain %s: %s, %lld parameters on %s\n", DPT_VERSION, trainer.model().describe().c_str(),
              static_cast<long long>(trainer.model().num_parameters()), where.c_str());
  std::printf("  %s, batch %lld, %lld steps, %s, %s, gemm %s\n", dpt::data::task_name(c.task),
              static_cast<long long>(c.batch), static_cast<long long>(c.steps), trainer.optimizer().describe().c_str(),
              dpt::precision_name(c.parallel.precision),
              c.devices.front().is_cpu() ? "cpu" : dpt::gemm_name(c.parallel.gemm));
  if (c.parallel.grad_accum > 1)
    std::printf("  gradient accumulation: %d micro-batches per step\n", c.parallel.grad_accum);
  if (c.parallel.zero > 0)
    std::printf("  ZeRO stage %d: the optimizer state%s sharded over the devices\n", c.parallel.zero,
                c.parallel.zero == 2 ? " and the gradients" : "");
  if (c.parallel.grad_comm == dpt::DType::bf16 && c.devices.size() > 1)
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

// The task of file data follows from its targets: a --task that agrees is fine, one that
// contradicts them is refused.
void check_task_agrees(const dpt::app::TrainFlags& o, const dpt::Trainer& trainer) {
  if (o.was_given("--task") && !o.cfg.data.empty() && trainer.config().task != o.cfg.task)
    throw dpt::UsageError(
        std::string("--task: the task of --data follows from its targets: ") +
        (trainer.config().task == dpt::data::Task::language_model
             ? "tokens train a language model (a GPT), not --task " + std::string(dpt::data::task_name(o.cfg.task))
         : trainer.config().task == dpt::data::Task::classification
             ? "integer class labels (classification), not --task regression"
             : "float rows (regression), not --task classification; class labels are integers (an integer .npy, "
               "int32 or int64)"));
}

// --metrics: a JSON line a logged step. The file is opened (and a fresh run's emptied, a
// resumed run's cut after its last kept step) at the first record, so a run that ends
// before its first step leaves an existing file as it was. A failed write ends the log
// with a warning, not the run.
class MetricsFile {
 public:
  MetricsFile(const dpt::app::TrainFlags& o, const dpt::Trainer& trainer, bool lead)
      : path_(o.metrics), trainer_(trainer) {
    try {
      if (lead && trainer.resumed() && !path_.empty()) keep_ = metrics_to_keep(path_, trainer.steps_done());
    } catch (const dpt::UsageError&) {
      if (!o.overwrite) throw;
      keep_ = 0;  // not a metrics file: --overwrite starts it afresh
    }
  }

  void write(const dpt::StepLog& s) {
    if (!path_.empty() && !out_.is_open() && !failed_) open();
    if (!out_.is_open()) return;
    errno = 0;
    out_ << json_line(s) << '\n';
    out_.flush();
    if (!out_) {  // a full disk, say: the run and its checkpoint matter more than the log
      const std::string why = errno != 0 ? std::strerror(errno) : "a write error";
      out_.close();
      failed_ = true;
      dpt::report(dpt::Severity::warning, "writing the metrics file '" + path_ + "' failed at step " +
                                              std::to_string(s.step) + " (" + why +
                                              "); training goes on without it, its last line may be cut");
    }
  }

 private:
  void open() {
    if (keep_ >= 0 && ::truncate(path_.c_str(), keep_) != 0)
      throw dpt::Error("cannot cut the metrics file '" + path_ + "' at step " + std::to_string(trainer_.steps_done()) +
                       ": " + std::strerror(errno));
    out_.open(path_, trainer_.resumed() ? std::ios::out | std::ios::app : std::ios::out | std::ios::trunc);
    if (!out_) throw dpt::UsageError("cannot write the metrics file '" + path_ + "'");
  }

  std::string path_;
  const dpt::Trainer& trainer_;
  std::ofstream out_;
  bool failed_ = false;
  off_t keep_ = -1;  // a resumed run's bytes to keep (-1: none to cut)
};

// --plot: the loss (and validation loss) and the speed by logged step.
struct Curves {
  dpt::plot::Series loss{"loss", {}, {}, false}, speed{"samples/s", {}, {}, false};
  dpt::plot::Series val{"validation loss", {}, {}, false};

  void add(const dpt::StepLog& s) {
    loss.x.push_back(static_cast<double>(s.step));
    loss.y.push_back(s.loss);
    if (s.val.rows > 0) {
      val.x.push_back(static_cast<double>(s.step));
      val.y.push_back(s.val.loss);
    }
    if (s.step > 1) {  // the first step's speed includes warm-up
      speed.x.push_back(static_cast<double>(s.step));
      speed.y.push_back(s.samples_per_s);
    }
  }

  void write(const std::string& path, const std::string& model) const {
    std::vector<dpt::plot::Series> losses{loss};
    if (!val.x.empty()) losses.push_back(val);
    dpt::plot::Chart lc{"dptrain " + model + ": loss", "step", "loss (log scale)", losses, {}};
    lc.options.log_y = true;
    dpt::plot::Chart sc{"throughput", "step", "samples/s", {speed}, {}};
    dpt::plot::write_line_charts(path, {lc, sc});
  }
};

// A logged step's line: rewritten in place on a terminal, one line a step otherwise.
void print_progress(const dpt::StepLog& s, bool tty) {
  const std::string eta = duration(s.step_ms * 1e-3 * static_cast<double>(s.total - s.step));
  const std::string acc = std::isnan(s.accuracy) ? "" : percent(s.accuracy);
  std::string val;  // " val_loss 0.31 val_accuracy 91.2%" when this step was validated
  if (s.val.rows > 0) {
    char buf[64];
    std::snprintf(buf, sizeof buf, " val_loss %.6g", s.val.loss);
    val = buf;
    if (!std::isnan(s.val.accuracy)) val += " val_accuracy " + percent(static_cast<float>(s.val.accuracy));
    if (!std::isnan(s.val.perplexity)) {
      std::snprintf(buf, sizeof buf, " val_perplexity %.6g", s.val.perplexity);
      val += buf;
    }
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
}

// The run's outcome: steps, loss, speed, validation, the input pipeline's times, memory.
void print_summary(const dpt::Trainer& trainer, const dpt::TrainResult& r, uint64_t hash) {
  const auto& c = trainer.config();
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
    std::printf("validation: loss %.6g%s%s over %lld rows\n", r.val.loss,
                std::isnan(r.val.accuracy) ? "" : (", accuracy " + percent(static_cast<float>(r.val.accuracy))).c_str(),
                std::isnan(r.val.perplexity) ? "" : (", perplexity " + std::to_string(r.val.perplexity)).c_str(),
                static_cast<long long>(r.val.rows));
  if (r.input.loads > 0) {
    const double copy = r.input.timed_copies > 0 ? r.input.copy_ms / static_cast<double>(r.input.timed_copies) : 0.0;
    const double per_step = copy * c.parallel.grad_accum;  // a replica copies a shard a micro-batch
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
}

int train(dpt::app::TrainFlags& o) {
  install_signal_handlers();
  dpt::app::resolve(o, launcher_size());
  check_outputs_are_ours(o);
  dpt::Trainer trainer(o.cfg);
  check_task_agrees(o, trainer);
  g_group = trainer.group();
  // Rank 0 alone prints and writes metrics; every rank trains and checks.
  const bool lead = !g_group || g_group->rank() == 0;
  MetricsFile metrics(o, trainer, lead);
  const bool tty = lead && interactive_terminal();
  if (lead) print_header(trainer);
  Curves curves;
  auto on_log = [&](const dpt::StepLog& s) {
    if (!lead) return;
    curves.add(s);
    metrics.write(s);
    print_progress(s, tty);
  };
  g_starting = 0;  // from here the loop stops between steps, and saves
  const dpt::TrainResult r = trainer.run(on_log, [] { return g_signal != 0; });
  const uint64_t hash = trainer.parameter_hash();  // with --ddp: compared across every rank
  if (!lead) return r.stopped ? stopped_status() : 0;
  if (g_progress_open) {  // a stopped run ends the progress line before its summary
    std::printf("\n");
    g_progress_open = false;
  }
  if (!o.plot.empty()) curves.write(o.plot, trainer.config().model);  // with --ddp: this rank's device
  print_summary(trainer, r, hash);
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
  bool overwrite = false;  // predict: replace an existing --out or --probabilities that is no array
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
    dpt::app::add_switch(sub, "--overwrite", a.overwrite,
                         "Replace an existing --out or --probabilities that is not a .npy array (refused without it)");
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

// predict writes .npy arrays, and replaces only what is its own: an empty file or an array
// (an earlier prediction). A checkpoint or notes named as --out were replaced silently.
void check_prediction_file(const std::string& path, const std::string& flag, bool overwrite) {
  if (path.empty()) return;
  if (!path.ends_with(".npy"))
    throw dpt::UsageError(flag + " '" + path + "': predict writes a .npy array, and the name must say so (.npy)");
  std::error_code ec;
  if (overwrite || !std::filesystem::exists(path, ec)) return;  // (check_output_file refused what is no file)
  std::ifstream in(path, std::ios::binary);
  std::string start(6, '\0');
  in.read(start.data(), 6);
  if (in.gcount() == 0 && in.eof()) return;              // empty
  if (in.gcount() == 6 && start == "\x93NUMPY") return;  // an array
  throw dpt::UsageError(flag + " '" + path +
                        "' is not a .npy array (or cannot be read), which predict would replace (name another file, "
                        "or give --overwrite)");
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
    const std::string flag = out == &a.out ? "--out" : "--probabilities";
    dpt::check_output_file(*out, flag);
    if (dpt::app::same_file(*out, a.data) || dpt::app::same_file(*out, a.targets) ||
        dpt::app::same_file(*out, a.cfg.checkpoint))
      throw dpt::UsageError(flag + " '" + *out + "' is an input of this run");
    if (predict) check_prediction_file(*out, flag, a.overwrite);
  }
  if (dpt::app::same_file(a.probabilities, a.out))
    throw dpt::UsageError("--out and --probabilities name the same file '" + a.out + "'");
  dpt::Inference model(a.cfg);
  if (model.spec().is_gpt)
    throw dpt::UsageError(std::string(predict ? "predict" : "eval") + " runs MLPs and CNNs over arrays; '" +
                          a.cfg.checkpoint + "' holds a GPT (" + model.model_text() +
                          "), whose validation loss is training's --val-data and whose text is dptrain generate's");
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
               dpt::app::one_line(what).c_str());
  // The whole job ends now: a peer may wait for this rank in a collective, and rank 0
  // waiting for the others in MPI_Finalize would let them report the same error too.
  if (mpi && mpi->size() > 1) mpi->end_job(status);
  return status;
}

// An error's line: the fields it names as their flags.
std::string message(const std::exception& e) { return dpt::app::error_text(e, dpt::app::known_fields()); }

// Runs `job`, turning its errors into their exit status and one line on stderr.
int with_exit_status(const std::function<int()>& job) {
  try {
    return job();
  } catch (const dpt::UsageError& e) {
    return fail(kExitUsage, message(e).c_str());
  } catch (const dpt::OutOfMemory& e) {
    return fail(kExitOom, message(e).c_str());
  } catch (const dpt::NonFiniteError& e) {
    return fail(kExitNonFinite, message(e).c_str(), /*alike=*/true);  // every rank checks the same reduced gradients
  } catch (const std::bad_alloc&) {                                   // a host allocation the allocator does not make
    return fail(kExitOom,
                "out of memory on the host (a host allocation failed); use a smaller batch (--batch) or model");
  } catch (const std::length_error&) {  // a host array longer than the address space allows
    return fail(kExitOom,
                "out of memory on the host (an array longer than memory allows was asked); use a smaller batch "
                "(--batch) or model");
  } catch (const std::exception& e) {
    return fail(kExitError, message(e).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  // The library's notes and warnings, and the error that ends a --ddp job, as lines of our own.
  dpt::set_message_handler([](dpt::Severity severity, const dpt::Message& message) {
    std::fprintf(stderr, "%sdptrain: %s: %s\n", g_progress_open ? "\n" : "", dpt::severity_name(severity),
                 dpt::app::one_line(dpt::app::message_text(message, dpt::app::known_fields())).c_str());
    std::fflush(stderr);
    g_progress_open = false;
  });
  CLI::App app{
      "dptrain: data-parallel training of MLPs, CNNs and GPTs on synthetic data or your own arrays (.npy, "
      ".safetensors) and token files, on GPUs or the CPU"};
  dpt::app::TrainFlags o;
  dpt::app::add_train_flags(app, o);
  app.set_version_flag("--version", std::string("dptrain ") + DPT_VERSION);
  AfterTraining predict_args, eval_args;
  CLI::App* predict = app.add_subcommand("predict", "Write a trained model's outputs for every row of a data set");
  CLI::App* eval = app.add_subcommand("eval", "Print a trained model's loss and accuracy on a data set");
  add_after_training_flags(*predict, predict_args, true);
  add_after_training_flags(*eval, eval_args, false);
  std::string export_from, export_to;
  CLI::App* hf_export = app.add_subcommand(
      "export", "Write a trained GPT as a Hugging Face GPT-2 folder (model.safetensors, config.json)");
  hf_export->add_option("--resume", export_from, "The GPT's checkpoint")->required();
  hf_export->add_option("--hf", export_to, "The folder to write (made when missing)")->required();
  dpt::app::GenerateFlags gen;
  CLI::App* generate = dpt::app::add_generate_command(app, gen);
  app.require_subcommand(0, 1);
  // A fault in the command line is rank 0's to report, unless this rank's alone.
  if (const int status =
          dpt::app::parse_command_line(app, argc, argv, "dptrain", [] { return wait_for_rank0(launcher_rank()); });
      status >= 0)
    return status;
  if (*predict || *eval || *hf_export || *generate) {
    const char* sub = *predict ? "predict" : *eval ? "eval" : *generate ? "generate" : "export";
    // The training flags mean nothing here: given before the subcommand, they are an error.
    for (const CLI::Option* opt : app.get_options())
      if (opt->count() > 0 && opt->get_name() != "--help")
        return fail(kExitUsage, (opt->get_name() + " is a training flag; " + sub +
                                 " takes --resume and its own flags (see dptrain " + sub + " --help)")
                                    .c_str());
    if (*generate) return with_exit_status([&] { return dpt::app::generate_continuation(gen); });
    if (*hf_export)
      return with_exit_status([&] {
        dpt::hf::export_gpt2_checkpoint(export_from, export_to);
        std::printf("wrote %s/model.safetensors and %s/config.json\n", export_to.c_str(), export_to.c_str());
        return 0;
      });
    AfterTraining& a = *predict ? predict_args : eval_args;
    a.on_command_line = dpt::app::command_line_flags(argc, argv);
    return with_exit_status([&] { return after_training(a, static_cast<bool>(*predict)); });
  }
  for (const CLI::Option* opt : app.get_options())
    if (opt->count() > 0) o.given.push_back(opt->get_name());
  o.on_command_line = dpt::app::command_line_flags(argc, argv);
  if (app.count("--config") > 0) o.config = app["--config"]->as<std::string>();
  return with_exit_status([&] { return train(o); });
}
