// What dptrain and dpbench share on the command line: the device flags (--devices LIST,
// --gpus N or --cpus N, at most one of them), integers read as decimal and range-checked,
// a bounded --config file, and parsing that ends in one error line.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <dptrain/error.hpp>
#include <dptrain/runtime/device.hpp>

namespace dpt::app {

class DeviceFlags {
 public:
  // `list_help` says what the devices are used for.
  void add_to(CLI::App& app, const std::string& list_help);
  // The devices the flags name (UsageError for one that does not exist or a count < 1);
  // empty when none was given. At most one of the three may be given on the command line
  // (`on_command_line`, from command_line_flags()); one given there wins over another
  // from the config file.
  std::vector<Device> devices(const std::vector<std::string>& on_command_line) const;

 private:
  std::string list_;
  int gpus_ = 0, cpus_ = 0;
  CLI::Option *list_flag_ = nullptr, *gpus_flag_ = nullptr, *cpus_flag_ = nullptr;
};

// An integer option, on the command line and in a config file alike, read as decimal
// ("010" is 10: CLI11 alone reads it as octal 8, and "0x10" as 16) and refused when it
// does not fit the type (CLI11 alone saturates or wraps: "-1" became 2^64 - 1 for an
// unsigned seed). The value's own range (a batch >= 1) is the library's to check.
CLI::Option* add_integer(CLI::App& app, const std::string& name, int64_t& into, const std::string& help);
CLI::Option* add_integer(CLI::App& app, const std::string& name, int& into, const std::string& help);
CLI::Option* add_integer(CLI::App& app, const std::string& name, uint64_t& into, const std::string& help);

// A float option: a decimal number ('' is no 0, '0x10' no 16, '1.5abc' is refused in one
// line) that a float can represent: 1e-50 (which would become 0, turning --clip off) and
// 1e39 (infinity) are refused naming the value given. NaN and infinity written as such
// pass: the library's range checks name them. add_double: the same for a double.
CLI::Option* add_float(CLI::App& app, const std::string& name, float& into, const std::string& help);
CLI::Option* add_double(CLI::App& app, const std::string& name, double& into, const std::string& help);

// A flag that takes no value, or true/false, 1/0, on/off, yes/no (CLI11 alone reads
// --nesterov=2, or nesterov = 99 in a config file, as true).
CLI::Option* add_switch(CLI::App& app, const std::string& name, bool& into, const std::string& help);

// A file path option: an empty path (--resume '') is refused, never read as "none".
CLI::Option* add_path(CLI::App& app, const std::string& name, std::string& into, const std::string& help);

// The long options (--name) that argv itself gives, as opposed to a config file.
std::vector<std::string> command_line_flags(int argc, char** argv);

// `message` on one line: control characters (a newline inside a value the user gave)
// written as escapes, so that an error is always exactly one line.
std::string one_line(const std::string& message);

// Token ids separated by commas ("15496,11,616"); UsageError naming the first that is not a
// whole number in [0, 2^31).
std::vector<int32_t> parse_token_list(const std::string& text);

// The flag a program gives an option field as: its name with dashes (TrainConfig::grad_accum
// is --grad-accum), but for the few that dptrain spells otherwise (DataParallelOptions::
// overlap is --no-overlap, which sets it false).
std::string flag_name(const FieldId& field);
// What the flag sets the field to when given alone, for a flag spelled otherwise ("false"
// for --no-overlap); null for a flag that takes the field's own value.
const char* flag_sets(const FieldId& field);

// A library error as a user of the program reads it: the fields a UsageError names
// (UsageError::field and the others) as flags; the fields any other error names as flags
// where they are `known` (the program's own), else as Owner::name. Never from the text:
// from the fields the error holds.
std::string error_text(const std::exception& e, const std::vector<FieldId>& known);
// A library note or warning, its fields named as error_text names those of an error that
// is not a UsageError.
std::string message_text(const Message& message, const std::vector<FieldId>& known);

// The largest config file read: a file of flags is a few hundred bytes, and a bound keeps
// `--config /dev/zero` from reading without end.
constexpr uintmax_t kMaxConfigBytes = 1 << 20;

// --config FILE: flags from a TOML file, its keys the flags' names without the dashes,
// with '-' or '_' between words (log-every or log_every); a misspelt key is an error. The
// file must be a regular file of at most kMaxConfigBytes, checked when the flag is read,
// before anything opens it (a FIFO would block that open).
void add_config_flag(CLI::App& app);

// Parses the command line. --help and --version print and give their exit status (0); a
// bad command line gives one line on stderr, "PROGRAM: error: ... (see --help)", and
// status 2. `before_error`, where given, runs first and returns a prefix for the message
// (dptrain under a launcher: a rank other than 0 waits for rank 0, then names itself).
// Returns -1 when the program should go on.
int parse_command_line(CLI::App& app, int argc, char** argv, const char* program,
                       const std::function<std::string()>& before_error = {});

}  // namespace dpt::app
