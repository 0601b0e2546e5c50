#include "train_flags.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>

#include <dptrain/layers/conv.hpp>

#include "common/atomic_file.hpp"

namespace dpt::app {

bool TrainFlags::was_given(const std::string& flag) const {
  return std::find(given.begin(), given.end(), flag) != given.end();
}

bool TrainFlags::on_command_line_has(const std::string& flag) const {
  return std::find(on_command_line.begin(), on_command_line.end(), flag) != on_command_line.end();
}

namespace {
// The text of the value a flag read, which the field's set() takes: a float's shortest
// text and a double's 17 digits read back as the same number.
std::string slot_text(const TrainFlags::Slot& s) {
  const OptionField<TrainConfig>& f = *s.field;
  if (const char* sets = flag_sets(f.id)) return s.on ? sets : "";
  if (f.kind == OptionKind::boolean) return s.on ? "true" : "false";
  if (f.type == "int64") return std::to_string(s.i64);
  if (f.type == "int") return std::to_string(s.i32);
  if (f.type == "uint64") return std::to_string(s.u64);
  char buf[40];
  if (f.type == "float") {
    const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, s.f32);
    return std::string(buf, ec == std::errc() ? end : buf);
  }
  if (f.type == "double") {
    std::snprintf(buf, sizeof buf, "%.17g", s.f64);
    return buf;
  }
  return s.text;
}

// A field's flag, bound to its slot (which starts at the default, shown by --help).
CLI::Option* add_field_flag(CLI::App& app, TrainFlags::Slot& s, const TrainConfig& defaults) {
  const OptionField<TrainConfig>& f = *s.field;
  const std::string flag = flag_name(f.id), start = f.get(defaults);
  if (flag_sets(f.id) || f.kind == OptionKind::boolean) {
    s.on = !flag_sets(f.id) && start == "true";
    return add_switch(app, flag, s.on, f.help);
  }
  if (f.type == "int64") return add_integer(app, flag, s.i64 = option_text::parse<int64_t>(start), f.help);
  if (f.type == "int") return add_integer(app, flag, s.i32 = option_text::parse<int>(start), f.help);
  if (f.type == "uint64") return add_integer(app, flag, s.u64 = option_text::parse<uint64_t>(start), f.help);
  if (f.type == "float") return add_float(app, flag, s.f32 = option_text::parse<float>(start), f.help);
  if (f.type == "double") return add_double(app, flag, s.f64 = option_text::parse<double>(start), f.help);
  s.text = start;
  if (f.kind == OptionKind::path) return add_path(app, flag, s.text, f.help);
  return app.add_option(flag, s.text, f.help);
}
}  // namespace

void add_train_flags(CLI::App& app, TrainFlags& o) {
  const TrainConfig defaults;
  for (const OptionField<TrainConfig>& f : train_schema()) {
    if (f.kind == OptionKind::devices) {  // --devices, --gpus or --cpus
      o.devices.add_to(app, f.help);
      continue;
    }
    TrainFlags::Slot& s = o.slots.emplace_back();
    s.field = &f;
    s.option = add_field_flag(app, s, defaults);
    // A default that says something is shown; a path's, the rate's and a count's "none" is not.
    const bool shown = f.kind != OptionKind::path && !flag_sets(f.id) && f.kind != OptionKind::boolean &&
                       f.id.name != "lr" && f.id.name != "samples" && f.id.name != "epochs" &&
                       f.id.name != "eval_every" && f.id.name != "save_every" && f.id.name != "val_fraction";
    if (shown) s.option->capture_default_str();
    if (f.id.name == "resume")
      add_switch(app, "--auto-resume", o.auto_resume,
                 "Continue from the --save checkpoint when it exists, else start afresh (one command to retry)");
  }
  add_switch(app, "--no-shuffle", o.no_shuffle, "File data: keep the file's order");
  add_path(app, "--metrics", o.metrics,
           "Write one JSON object per logged step to this file (JSONL; continued on --resume)");
  add_path(app, "--plot", o.plot, "Draw the loss curve and samples/s of the run into this SVG file");
  add_switch(app, "--overwrite", o.overwrite,
             "Replace --save, --metrics and --plot files that are not dptrain's (by default a run replaces only an "
             "empty file, a dptrain checkpoint, a metrics file or a plot of dptrain's)");
  add_config_flag(app);
}

const std::vector<FieldId>& known_fields() {
  static const std::vector<FieldId> known = [] {
    std::vector<FieldId> out = {{"DataParallelOptions", "group"}, {"InferenceConfig", "checkpoint"}};
    for (const OptionField<TrainConfig>& f : train_schema()) out.push_back(f.id);
    for (const OptionField<DataParallelOptions>& f : data_parallel_schema()) out.push_back(f.id);
    return out;
  }();
  return known;
}

namespace {
// What a path names, for comparing two paths: the file a symlink leads to, in its folder
// made absolute and canonical (the file itself need not exist yet).
std::string file_identity(const std::string& path) {
  std::error_code ec;
  const auto p = std::filesystem::weakly_canonical(std::filesystem::absolute(resolve_output_path(path)), ec);
  return ec ? path : p.string();
}

// Two outputs in one file would leave only the last written; an output over an input
// destroys the input. Only --save may name the --resume checkpoint (it replaces it, as a
// continuing run should).
void check_distinct_files(const TrainFlags& o) {
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
        throw UsageError(std::string(a.flag) + " and " + b.flag + " name the same file " + quote_value(b.path));
    }
}

// Flags that exclude each other: both on the command line, or both in the config file,
// are refused; one on the command line wins over the other in the file (as every flag
// does), which is then not read.
void drop_overridden(TrainFlags& o) {
  static const std::pair<const char*, const char*> kExclusive[] = {
      {"--steps", "--epochs"}, {"--shuffle", "--no-shuffle"}, {"--resume", "--auto-resume"}};
  for (const auto& [a, b] : kExclusive) {
    if (!o.was_given(a) || !o.was_given(b)) continue;
    const bool a_here = o.on_command_line_has(a);
    if (a_here == o.on_command_line_has(b))
      throw UsageError(std::string(a) + " excludes " + b + (a_here ? "" : " (both in the config file)"));
    const std::string dropped = a_here ? b : a;
    std::erase(o.given, dropped);
    if (dropped == "--no-shuffle") o.no_shuffle = false;
    if (dropped == "--auto-resume") o.auto_resume = false;
    for (TrainFlags::Slot& s : o.slots)
      if (s.option->get_name() == dropped) s.option->clear();
  }
}

// The given flags' values into their fields.
void set_fields(TrainFlags& o) {
  for (const TrainFlags::Slot& s : o.slots) {
    if (s.option->count() == 0) continue;
    const std::string text = slot_text(s);
    if (flag_sets(s.field->id) && text.empty()) continue;  // no-overlap = false: the default stands
    s.field->set(o.cfg, text);
  }
}
}  // namespace

bool same_file(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  if (file_identity(a) == file_identity(b)) return true;
  std::error_code ec;
  return std::filesystem::equivalent(a, b, ec) && !ec;
}

void resolve(TrainFlags& o, int launcher_processes) {
  auto& c = o.cfg;
  drop_overridden(o);
  set_fields(o);
  // Without --ddp each of mpirun's processes would train the whole job alone and write the
  // same checkpoint, metrics and plot over the others' (a metrics file of two interleaved
  // runs, which a resume then refuses).
  if (launcher_processes > 1 && !c.ddp)
    throw UsageError("this is one of " + std::to_string(launcher_processes) +
                     " processes that mpirun started, without --ddp: each would train alone and write the same "
                     "files; add --ddp (one process a device)");
  // A switch set to false (shuffle = false in a config file) is off, not "given".
  if (o.no_shuffle) c.shuffle = false;
  if ((o.was_given("--shuffle") || o.no_shuffle) && c.data.empty())
    throw UsageError("--shuffle and --no-shuffle order the rows of --data; synthetic data has no order to change");
  // An option of the other optimizer would be silently ignored: refuse it instead.
  static const std::pair<const char*, const char*> kOptimizerOf[] = {
      {"--momentum", "sgd"}, {"--nesterov", "sgd"}, {"--beta1", "adamw"}, {"--beta2", "adamw"}, {"--eps", "adamw"}};
  if (c.optimizer == "sgd" || c.optimizer == "adamw")  // else validate() names the unknown one
    for (const auto& [flag, owner] : kOptimizerOf)
      if (o.was_given(flag) && c.optimizer != owner && !(std::string(flag) == "--nesterov" && !c.nesterov))
        throw UsageError(std::string(flag) + " is an option of --optimizer " + owner + ", and this run trains with " +
                         c.optimizer);
  if (o.auto_resume) {
    if (!c.resume.empty()) throw UsageError("--resume excludes --auto-resume");
    if (c.save.empty()) throw UsageError("--auto-resume needs --save (the checkpoint to continue from)");
    struct stat st {};
    if (::stat(c.save.c_str(), &st) == 0) c.resume = c.save;  // else a fresh start
  }
  // Given as 0 (its default) it passes the library's check of the value, and a run would not
  // decay to 0 as the flag says (a config file's 0 under another --schedule is overridden).
  if (o.on_command_line_has("--lr-final") && c.schedule != "cosine")
    throw UsageError("--lr-final is where the cosine schedule ends; add --schedule cosine");
  if (o.was_given("--task") && c.task == data::Task::regression && nn::is_cnn_spec(c.model))
    throw UsageError("--task regression: a CNN model (" + quote_value(c.model) + ") trains image classification");
  c.devices = o.devices.devices(o.on_command_line);
  // Given, these mean a data set; 0 would silently mean "no data set" (the defaults).
  if (o.was_given("--epochs") && c.epochs < 1)
    throw UsageError("--epochs must be >= 1, got " + std::to_string(c.epochs));
  if (o.was_given("--samples") && c.samples < 1)
    throw UsageError("--samples must be >= 1 (leave it out for an endless stream), got " + std::to_string(c.samples));
  if (c.ddp && o.was_given("--reduce"))
    throw UsageError(
        "--reduce chooses how one process's replicas reduce; --ddp ranks all-reduce with NCCL (GPUs) or MPI (CPUs)");
  check_output_file(o.plot, "--plot");
  check_output_file(o.metrics, "--metrics");
  check_distinct_files(o);
}

}  // namespace dpt::app
