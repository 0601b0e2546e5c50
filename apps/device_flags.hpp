// The device flags that dptrain and dpbench share: --devices LIST, --gpus N or --cpus N
// (at most one of them), turned into the devices they name, each checked.
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

}  // namespace dpt::app
