// What dptrain and dpbench share on the command line: the device flags (--devices LIST,
// --gpus N or --cpus N, at most one of them), and parsing that ends in one error line.
#pragma once
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <dptrain/runtime/device.hpp>

namespace dpt::app {

class DeviceFlags {
 public:
  // `list_help` says what the devices are used for.
  void add_to(CLI::App& app, const std::string& list_help);
  // The devices the flags name (UsageError for one that does not exist or a count < 1);
  // empty when none was given.
  std::vector<Device> devices() const;

 private:
  std::string list_;
  int gpus_ = 0, cpus_ = 0;
  CLI::Option *list_flag_ = nullptr, *gpus_flag_ = nullptr, *cpus_flag_ = nullptr;
};

// Parses the command line. --help and --version print and give their exit status (0); a
// bad command line gives one line on stderr, "PROGRAM: error: ... (see --help)" (none
// when `quiet`), and status 2. Returns -1 when the program should go on.
int parse_command_line(CLI::App& app, int argc, char** argv, const char* program, bool quiet = false);

}  // namespace dpt::app
