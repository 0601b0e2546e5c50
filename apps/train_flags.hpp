// dptrain's training flags and config keys, made from the options schema (train_schema()):
// a flag per field, named by flag_name(), of the field's type, with its help; then the
// flags of the program's own (--metrics, --plot, --auto-resume, the device flags) and the
// checks between flags that the library cannot see.
#pragma once
#include <deque>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <dptrain/train/trainer.hpp>

#include "cli.hpp"

namespace dpt::app {

struct TrainFlags {
  TrainConfig cfg;
  DeviceFlags devices;
  bool auto_resume = false, no_shuffle = false, overwrite = false;
  std::string metrics, plot, config;
  // Flags given (on the command line or in the config file) that resolve() checks against
  // each other: options of one optimizer are refused with the other.
  std::vector<std::string> given;
  std::vector<std::string> on_command_line;  // the flags argv itself gives
  bool was_given(const std::string& flag) const;
  bool on_command_line_has(const std::string& flag) const;

  // Where a field's flag puts its value until resolve() gives it to the field.
  struct Slot {
    const OptionField<TrainConfig>* field = nullptr;
    CLI::Option* option = nullptr;
    std::string text;
    int64_t i64 = 0;
    int i32 = 0;
    uint64_t u64 = 0;
    float f32 = 0;
    double f64 = 0;
    bool on = false;
  };
  std::deque<Slot> slots;
};

void add_train_flags(CLI::App& app, TrainFlags& o);

// The fields' flags into the config, and the checks between flags; throws UsageError. The
// Trainer checks the rest.
void resolve(TrainFlags& o, int launcher_processes);

// Every field a library message may name (TrainConfig's, DataParallelOptions', and those
// spelled otherwise), which error_text and message_text name as flags.
const std::vector<FieldId>& known_fields();

// Whether two paths name one file (the same canonical path, or two names of one existing file).
bool same_file(const std::string& a, const std::string& b);

}  // namespace dpt::app
