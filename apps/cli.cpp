#include "cli.hpp"

#include <cstdio>

#include <dptrain/error.hpp>

namespace dpt::app {

void DeviceFlags::add_to(CLI::App& app, const std::string& list_help) {
  list_flag_ = app.add_option("--devices", list_, list_help);
  gpus_flag_ = app.add_option("--gpus", gpus_, "The first N GPUs (cuda:0..cuda:N-1)");
  cpus_flag_ = app.add_option("--cpus", cpus_, "N virtual CPU devices (cpu:0..cpu:N-1)");
  list_flag_->excludes(gpus_flag_)->excludes(cpus_flag_);
  gpus_flag_->excludes(cpus_flag_);
}

std::vector<Device> DeviceFlags::devices() const {
  if (list_flag_->count() > 0) return parse_devices(list_);
  const bool gpus = gpus_flag_->count() > 0;
  if (!gpus && cpus_flag_->count() == 0) return {};
  const int n = gpus ? gpus_ : cpus_;
  const char* flag = gpus ? "--gpus" : "--cpus";
  if (n < 1) throw UsageError(std::string(flag) + " must be at least 1, got " + std::to_string(n));
  std::vector<Device> out;
  for (int i = 0; i < n; ++i) {
    out.push_back({gpus ? DeviceType::cuda : DeviceType::cpu, i});
    check_device(out.back());
  }
  return out;
}

int parse_command_line(CLI::App& app, int argc, char** argv, const char* program, bool quiet) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (!quiet) std::fprintf(stderr, "%s: error: %s (see --help)\n", program, e.what());
    return 2;
  }
  return -1;
}

}  // namespace dpt::app
