#include "cli.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>

#include <dptrain/error.hpp>

#include "../train/atomic_file.hpp"

namespace dpt::app {

void DeviceFlags::add_to(CLI::App& app, const std::string& list_help) {
  list_flag_ = app.add_option("--devices", list_, list_help)->type_name("LIST");
  gpus_flag_ = add_integer(app, "--gpus", gpus_, "The first N GPUs (cuda:0..cuda:N-1)");
  cpus_flag_ = add_integer(app, "--cpus", cpus_, "N virtual CPU devices (cpu:0..cpu:N-1)");
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

namespace {

// A decimal integer whose magnitude is at most max_negative (when it has a minus sign) or
// max_positive, rewritten without leading zeros so that CLI11's conversion (strtoll with
// base 0) reads it as decimal.
CLI::Validator decimal(uint64_t max_negative, uint64_t max_positive, const std::string& range) {
  auto check = [=](std::string& text) -> std::string {
    size_t i = 0;
    bool negative = false;
    if (i < text.size() && (text[i] == '+' || text[i] == '-')) negative = text[i++] == '-';
    if (i == text.size() || !std::all_of(text.begin() + static_cast<std::ptrdiff_t>(i), text.end(),
                                         [](char c) { return c >= '0' && c <= '9'; }))
      return "'" + text + "' is not a whole decimal number";
    uint64_t magnitude = 0;
    const auto [end, ec] = std::from_chars(text.data() + i, text.data() + text.size(), magnitude);
    if (ec != std::errc() || end != text.data() + text.size() || magnitude > (negative ? max_negative : max_positive))
      return "'" + text + "' is out of range (" + range + ")";
    text = (negative && magnitude > 0 ? "-" : "") + std::to_string(magnitude);
    return "";
  };
  return CLI::Validator(check, "", "decimal");
}

template <class T>
CLI::Option* add_checked(CLI::App& app, const std::string& name, T& into, const std::string& help) {
  using limits = std::numeric_limits<T>;
  const uint64_t max_negative = limits::is_signed ? uint64_t(limits::max()) + 1 : 0;
  const std::string range = std::to_string(limits::min()) + " to " + std::to_string(limits::max());
  return app.add_option(name, into, help)
      ->type_name("INT")
      ->transform(decimal(max_negative, static_cast<uint64_t>(limits::max()), range));
}

// CLI11's TOML reader, with '_' in a key read as '-' (a TOML user writes log_every).
class TomlWithUnderscores : public CLI::ConfigTOML {
 public:
  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override {
    auto read = CLI::ConfigTOML::from_config(input);
    for (auto& item : read) std::replace(item.name.begin(), item.name.end(), '_', '-');
    return read;
  }
};

CLI::Validator regular_file_at_most(uintmax_t max_bytes) {
  auto check = [max_bytes](std::string& path) -> std::string {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return "'" + path + "': " + std::strerror(errno);
    if (!S_ISREG(st.st_mode)) return "'" + path + "' is " + file_kind(st.st_mode) + ", not a regular file";
    if (static_cast<uintmax_t>(st.st_size) > max_bytes)
      return "'" + path + "' is " + std::to_string(st.st_size) + " bytes, more than the " + std::to_string(max_bytes) +
             " a config file may have";
    return "";
  };
  return CLI::Validator(check, "", "config file");
}

}  // namespace

CLI::Option* add_integer(CLI::App& app, const std::string& name, int64_t& into, const std::string& help) {
  return add_checked(app, name, into, help);
}
CLI::Option* add_integer(CLI::App& app, const std::string& name, int& into, const std::string& help) {
  return add_checked(app, name, into, help);
}
CLI::Option* add_integer(CLI::App& app, const std::string& name, uint64_t& into, const std::string& help) {
  return add_checked(app, name, into, help);
}

void add_config_flag(CLI::App& app) {
  app.config_formatter(std::make_shared<TomlWithUnderscores>());
  app.set_config("--config", "", "Read flags from a TOML file (keys as the flags, e.g. log-every = 50)")
      ->type_name("FILE")
      ->check(regular_file_at_most(kMaxConfigBytes))
      ->trigger_on_parse();                                 // checked before CLI11 opens the file
  app.allow_config_extras(CLI::config_extras_mode::error);  // a misspelt key is an error, not ignored
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
