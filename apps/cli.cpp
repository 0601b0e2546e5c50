#include "cli.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>

#include <dptrain/error.hpp>

#include "common/atomic_file.hpp"
#include "common/text.hpp"

namespace dpt::app {

void DeviceFlags::add_to(CLI::App& app, const std::string& list_help) {
  list_flag_ = app.add_option("--devices", list_, list_help)->type_name("LIST");
  gpus_flag_ = add_integer(app, "--gpus", gpus_, "The first N GPUs (cuda:0..cuda:N-1)");
  cpus_flag_ = add_integer(app, "--cpus", cpus_, "N virtual CPU devices (cpu:0..cpu:N-1)");
}

std::vector<Device> DeviceFlags::devices(const std::vector<std::string>& on_command_line) const {
  // Which one counts: the command line's, else the config file's; two from the same place
  // contradict each other.
  std::vector<const CLI::Option*> given, typed;
  for (const CLI::Option* f : {list_flag_, gpus_flag_, cpus_flag_}) {
    if (f->count() == 0) continue;
    given.push_back(f);
    if (std::find(on_command_line.begin(), on_command_line.end(), f->get_name()) != on_command_line.end())
      typed.push_back(f);
  }
  const auto& chosen = typed.empty() ? given : typed;
  if (chosen.size() > 1)
    throw UsageError(chosen[0]->get_name() + " excludes " + chosen[1]->get_name() +
                     (typed.empty() ? " (both in the config file)" : ""));
  if (chosen.empty()) return {};
  if (chosen[0] == list_flag_) return parse_devices(list_);
  const bool gpus = chosen[0] == gpus_flag_;
  const int n = gpus ? gpus_ : cpus_;
  const char* flag = gpus ? "--gpus" : "--cpus";
  if (n < 1 || n > kMaxDevices)
    throw UsageError(std::string(flag) + " must be in [1, " + std::to_string(kMaxDevices) + "], got " +
                     std::to_string(n));
  std::vector<Device> out;
  for (int i = 0; i < n; ++i) {
    out.push_back({gpus ? DeviceType::cuda : DeviceType::cpu, i});
    check_device(out.back());
  }
  return out;
}

namespace {

// A value inside a message's own quotes (or none): quote_value's escapes and cut, without
// its quotes.
std::string bare(const std::string& value) {
  const std::string q = quote_value(value);
  const size_t cut = q.find("' (cut: ");
  return cut == std::string::npos ? q.substr(1, q.size() - 2) : q.substr(1, cut - 1) + "..." + q.substr(cut + 1);
}

// Whether `text` is a whole decimal number: an optional sign, then digits (its range is
// the option's to check).
bool whole_decimal_text(const std::string& text) {
  const size_t from = !text.empty() && (text[0] == '+' || text[0] == '-') ? 1 : 0;
  return text.size() > from && std::all_of(text.begin() + static_cast<std::ptrdiff_t>(from), text.end(),
                                           [](char c) { return c >= '0' && c <= '9'; });
}

// Whether `text` is a decimal number, whole: CLI11 alone reads '' as 0, reads '0x10' and
// '0x1p4' as hexadecimal, and skips leading blanks. NaN and infinity pass: the library's
// range checks name them.
bool decimal_text(const std::string& text) {
  char* end = nullptr;
  (void)std::strtod(text.c_str(), &end);
  return !text.empty() && end == text.c_str() + text.size() && text.find_first_of("xX \t\n\r\f\v") == std::string::npos;
}

// A decimal integer whose magnitude is at most max_negative (when it has a minus sign) or
// max_positive, rewritten without leading zeros so that CLI11's conversion (strtoll with
// base 0) reads it as decimal.
CLI::Validator decimal(uint64_t max_negative, uint64_t max_positive, const std::string& range) {
  auto check = [=](std::string& text) -> std::string {
    if (!whole_decimal_text(text)) return quote_value(text) + " is not a whole decimal number";
    const bool negative = text[0] == '-';
    const size_t i = text[0] == '+' || negative ? 1 : 0;
    uint64_t magnitude = 0;
    const auto [end, ec] = std::from_chars(text.data() + i, text.data() + text.size(), magnitude);
    if (ec != std::errc() || end != text.data() + text.size() || magnitude > (negative ? max_negative : max_positive))
      return quote_value(text) + " is out of range (" + range + ")";
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

// The config file as TOML, read strictly: CLI11's own reader is a lenient INI/TOML mix
// that took `steps = "2"` and `steps = [2]` as 2, a bare `nesterov` line as true, merged
// `batch = 8` on two adjacent lines into one option given twice, and read an unquoted
// word as text. Here a file of flags is top-level `key = value` lines (and comments), each
// key once, where the value has the flag's type: a number for a numeric flag, true or
// false for a switch, a quoted string for the others. A key is the flag's name without
// its dashes, with '-' or '_' between words (a TOML user writes log_every). Anything else
// is an error naming the line.
class StrictToml : public CLI::ConfigTOML {
 public:
  explicit StrictToml(const CLI::App& app) : app_(app) {}

  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override {
    std::vector<CLI::ConfigItem> read;
    std::map<std::string, int> first_line;  // key -> the line that gave it
    std::string line;
    for (int number = 1; std::getline(input, line); ++number) {
      if (number == 1 && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);  // a UTF-8 byte order mark
      const std::string where = "--config line " + std::to_string(number) + ": ";
      Cursor at{line, 0};
      at.skip_blanks();
      if (at.done() || at.peek() == '#') continue;
      if (at.peek() == '[')
        throw CLI::ConfigError(where + "sections ([...]) are not read: every key stands at the top");
      std::string key = at.bare_key();
      if (key.empty()) throw CLI::ConfigError(where + "a line must start with a key (the flag's name without dashes)");
      at.skip_blanks();
      if (at.done() || at.peek() == '#')
        throw CLI::ConfigError(where + quote_value(key) + " has no value (" + bare(key) + " = ...)");
      if (at.peek() != '=') throw CLI::ConfigError(where + "expected '=' after '" + key + "'");
      ++at.pos;
      at.skip_blanks();
      const Value value = read_value(at, key, where);
      at.skip_blanks();
      if (!at.done() && at.peek() != '#')
        throw CLI::ConfigError(where + "unexpected text after the value of " + key + ": " +
                               quote_value(line.substr(at.pos)));

      std::replace(key.begin(), key.end(), '_', '-');
      if (const auto [it, fresh] = first_line.emplace(key, number); !fresh)
        throw CLI::ConfigError(where + quote_value(key) + " given twice (first on line " + std::to_string(it->second) +
                               ")");
      check_type(key, value, where);
      CLI::ConfigItem item;
      item.name = key;
      item.inputs = {value.text};
      read.push_back(std::move(item));
    }
    return read;
  }

 private:
  enum class Kind { string, number, boolean, word };  // word: unquoted text, which TOML has not
  struct Value {
    Kind kind;
    std::string text;
  };
  struct Cursor {
    const std::string& s;
    size_t pos;
    bool done() const { return pos >= s.size(); }
    char peek() const { return s[pos]; }
    void skip_blanks() {
      while (!done() && (peek() == ' ' || peek() == '\t' || peek() == '\r')) ++pos;
    }
    // TOML's bare key: letters, digits, '-' and '_'.
    std::string bare_key() {
      const size_t from = pos;
      while (!done() && (std::isalnum(static_cast<unsigned char>(peek())) || peek() == '-' || peek() == '_')) ++pos;
      return s.substr(from, pos - from);
    }
  };

  // TOML's \uXXXX and \UXXXXXXXX (the cursor after the u or U): the scalar value's UTF-8.
  static std::string unicode_escape(Cursor& at, int digits, const std::string& where) {
    const std::string hex = at.s.substr(at.pos, static_cast<size_t>(digits));
    uint32_t v = 0;
    const auto [end, ec] = std::from_chars(hex.data(), hex.data() + hex.size(), v, 16);
    if (hex.size() != static_cast<size_t>(digits) || ec != std::errc() || end != hex.data() + hex.size() ||
        (v >= 0xD800 && v <= 0xDFFF) || v > 0x10FFFF || v == 0)
      throw CLI::ConfigError(
          where + ": \\" + std::string(1, digits == 4 ? 'u' : 'U') + " needs " + std::to_string(digits) +
          " hex digits of a Unicode scalar value other than 0 (a value ends at a NUL), got '" + hex + "'");
    at.pos += static_cast<size_t>(digits);
    std::string out;
    append_utf8(out, v);
    return out;
  }

  static Value read_value(Cursor& at, const std::string& key, const std::string& where) {
    if (at.done() || at.peek() == '#')
      throw CLI::ConfigError(where + quote_value(key) + " has no value (" + bare(key) + " = ...)");
    const char open = at.peek();
    if (open == '[' || open == '{')
      throw CLI::ConfigError(where + key + ": arrays and tables are not read; give one value");
    if (open == '"' || open == '\'') {
      ++at.pos;
      std::string text;
      while (!at.done() && at.peek() != open) {
        char c = at.s[at.pos++];
        if (open == '"' && c == '\\') {  // a basic string's escapes; a literal ('...') string has none
          if (at.done()) break;
          const char e = at.s[at.pos++];
          if (e == 'u' || e == 'U') {  // a Unicode scalar value, in UTF-8
            text += unicode_escape(at, e == 'u' ? 4 : 8, where + key);
            continue;
          }
          static const std::map<char, char> kEscapes = {{'"', '"'},  {'\\', '\\'}, {'n', '\n'}, {'t', '\t'},
                                                        {'r', '\r'}, {'b', '\b'},  {'f', '\f'}};
          const auto it = kEscapes.find(e);
          if (it == kEscapes.end())
            throw CLI::ConfigError(where + key + ": the escape '\\" + std::string(1, e) +
                                   "' is not read (write a backslash as \\\\, or use a '...' string)");
          c = it->second;
        }
        text += c;
      }
      if (at.done()) throw CLI::ConfigError(where + key + ": the string has no closing " + std::string(1, open));
      ++at.pos;
      return {Kind::string, text};
    }
    const size_t from = at.pos;
    while (!at.done() && at.peek() != ' ' && at.peek() != '\t' && at.peek() != '\r' && at.peek() != '#') ++at.pos;
    const std::string token = at.s.substr(from, at.pos - from);
    if (token == "true" || token == "false") return {Kind::boolean, token};
    const char c = token[0];
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '+' || c == '-' || c == '.' || token == "inf" ||
          token == "nan"))
      return {Kind::word, token};  // what kind the flag wanted says what is wrong with it
    // TOML's underscores between digits (1_000), for the number's reader.
    std::string number;
    for (size_t i = 0; i < token.size(); ++i)
      if (!(token[i] == '_' && i > 0 && i + 1 < token.size() &&
            std::isdigit(static_cast<unsigned char>(token[i - 1])) &&
            std::isdigit(static_cast<unsigned char>(token[i + 1]))))
        number += token[i];
    return {Kind::number, number};
  }

  // The key must name a flag (other than --config, --help and --version), and the value
  // have its kind.
  void check_type(const std::string& key, const Value& value, const std::string& where) const {
    const CLI::Option* flag = app_.get_option_no_throw("--" + key);
    if (!flag) throw CLI::ConfigError(where + quote_value(key) + " names no flag");
    if (flag == app_.get_config_ptr() || flag == app_.get_help_ptr() || flag == app_.get_version_ptr())
      throw CLI::ConfigError(where + quote_value(key) + " cannot be given in a config file");
    const std::string type = flag->get_type_name();
    const Kind want = flag->get_expected_max() == 0        ? Kind::boolean
                      : (type == "INT" || type == "FLOAT") ? Kind::number
                                                           : Kind::string;
    if (value.kind == want) {
      // A number of the flag's kind, so that a fault names its line (CLI11's conversion would not).
      if (want == Kind::number && !(type == "INT" ? whole_decimal_text(value.text) : decimal_text(value.text)))
        throw CLI::ConfigError(where + bare(key) + " takes " + (type == "INT" ? "a whole number" : "a number") +
                               ", not " + bare(value.text));
      return;
    }
    if (value.kind == Kind::word && want == Kind::string)
      throw CLI::ConfigError(where + bare(key) + " = " + bare(value.text) + ": text must be quoted (" + bare(key) +
                             " = \"" + bare(value.text) + "\")");
    static const char* const kWhat[] = {"a quoted string", "a number (no quotes)", "true or false (no quotes)"};
    throw CLI::ConfigError(where + bare(key) + " takes " + kWhat[static_cast<int>(want)] + ", not " +
                           (value.kind == Kind::string ? "\"" + bare(value.text) + "\"" : bare(value.text)));
  }

  const CLI::App& app_;
};

CLI::Validator regular_file_at_most(uintmax_t max_bytes) {
  auto check = [max_bytes](std::string& path) -> std::string {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return quote_value(path) + ": " + std::strerror(errno);
    if (!S_ISREG(st.st_mode)) return quote_value(path) + " is " + file_kind(st.st_mode) + ", not a regular file";
    if (static_cast<uintmax_t>(st.st_size) > max_bytes)
      return quote_value(path) + " is " + std::to_string(st.st_size) + " bytes, more than the " +
             std::to_string(max_bytes) + " a config file may have";
    return "";
  };
  return CLI::Validator(check, "", "config file");
}

// A number written in decimal (decimal_text; CLI11 alone names a trailing fault, '1.0abc',
// in its own words). For a float, also one its float can hold: not too large (infinity) or
// too small (zero).
CLI::Validator decimal_number(bool as_float) {
  auto check = [as_float](std::string& text) -> std::string {
    if (!decimal_text(text)) return quote_value(text) + " is not a decimal number";
    errno = 0;
    const double v = std::strtod(text.c_str(), nullptr);
    if (!as_float || std::isnan(v) || std::isinf(v)) return "";
    const float f = static_cast<float>(v);
    if (std::isinf(f) || (errno == ERANGE && std::fabs(v) > 1.0))
      return quote_value(text) + " is out of range (a float holds at most 3.4e+38)";
    if ((f == 0.0f && v != 0.0) || (errno == ERANGE && std::fabs(v) < 1.0))
      return quote_value(text) + " is too small for a float (it would become 0; the smallest is 1.4e-45)";
    return "";
  };
  return CLI::Validator(check, "", as_float ? "float" : "number");
}

CLI::Validator boolean_value() {
  auto check = [](std::string& text) -> std::string {
    for (const char* ok : {"true", "false", "1", "0", "on", "off", "yes", "no"})
      if (text == ok) return "";
    return quote_value(text) + " is not true or false";
  };
  return CLI::Validator(check, "", "boolean");
}

CLI::Validator non_empty() {
  return CLI::Validator([](std::string& text) { return text.empty() ? std::string("an empty path") : std::string(); },
                        "", "path");
}

}  // namespace

CLI::Option* add_float(CLI::App& app, const std::string& name, float& into, const std::string& help) {
  return app.add_option(name, into, help)->type_name("FLOAT")->check(decimal_number(true));
}

CLI::Option* add_double(CLI::App& app, const std::string& name, double& into, const std::string& help) {
  return app.add_option(name, into, help)->type_name("FLOAT")->check(decimal_number(false));
}

CLI::Option* add_switch(CLI::App& app, const std::string& name, bool& into, const std::string& help) {
  return app.add_flag(name, into, help)->check(boolean_value());
}

CLI::Option* add_path(CLI::App& app, const std::string& name, std::string& into, const std::string& help) {
  return app.add_option(name, into, help)->type_name("FILE")->check(non_empty());
}

std::vector<std::string> command_line_flags(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    if (a.size() > 2 && a.compare(0, 2, "--") == 0) out.push_back(a.substr(0, a.find('=')));
  }
  return out;
}

std::string one_line(const std::string& message) {
  std::string out;
  for (const char c : message) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u != 0x7F) {
      out += c;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, c == '\n' ? "\\n" : "\\x%02x", u);
      out += buf;
    }
  }
  return out;
}

namespace {
struct Spelling {
  const char* owner;
  const char* name;
  const char* flag;
  const char* sets;  // the field's value when the flag is given (null: the flag's own value)
};
// The fields whose flag is not their name: switches that turn a default off, and the
// process group a flag asks for.
constexpr Spelling kSpelledOtherwise[] = {
    {"DataParallelOptions", "overlap", "--no-overlap", "false"},
    {"DataParallelOptions", "twin_buffers", "--no-twin-buffers", "off"},
    {"DataParallelOptions", "group", "--ddp", nullptr},
    {"InferenceConfig", "checkpoint", "--resume", nullptr},
};
const Spelling* spelling(const FieldId& field) {
  for (const Spelling& s : kSpelledOtherwise)
    if (field.owner == s.owner && field.name == s.name) return &s;
  return nullptr;
}
}  // namespace

std::string flag_name(const FieldId& field) {
  if (const Spelling* s = spelling(field)) return s->flag;
  std::string flag = "--" + field.name;
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

const char* flag_sets(const FieldId& field) {
  const Spelling* s = spelling(field);
  return s ? s->sets : nullptr;
}

std::string message_text(const Message& message, const std::vector<FieldId>& known) {
  return message.str([&](const FieldId& f) {
    return std::find(known.begin(), known.end(), f) != known.end() ? flag_name(f) : f.str();
  });
}

std::string error_text(const std::exception& e, const std::vector<FieldId>& known) {
  if (const auto* u = dynamic_cast<const UsageError*>(&e); u && u->field()) return u->message(flag_name);
  return message_text(Message::of(e), known);
}

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
  app.config_formatter(std::make_shared<StrictToml>(app));
  app.set_config("--config", "", "Read flags from a TOML file (keys as the flags, e.g. log-every = 50)")
      ->type_name("FILE")
      ->check(regular_file_at_most(kMaxConfigBytes))
      ->trigger_on_parse();                                 // checked before CLI11 opens the file
  app.allow_config_extras(CLI::config_extras_mode::error);  // a misspelt key is an error, not ignored
}

namespace {
// Edits from a to b (insertions, deletions, substitutions and swaps of neighbours).
size_t distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1])});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// The flag of `app` nearest to `flag`, when one is near enough to be a slip ("" if none).
std::string nearest_flag(const CLI::App& app, const std::string& flag) {
  std::string best;
  size_t best_d = std::max<size_t>(2, flag.size() / 3) + 1;
  for (const CLI::Option* o : app.get_options())
    for (const std::string& name : o->get_lnames())
      if (const size_t d = distance(flag, "--" + name); d < best_d) best_d = d, best = "--" + name;
  return best;
}

// What CLI11 would say in its own words ("The following arguments were not expected: 5
// --stpes", "--steps: At Most 1 required but received 2"), said in ours: an unknown flag
// with the nearest one, a flag given twice. "" when the command line has neither.
std::string check_flags(const CLI::App& app, int argc, char** argv) {
  const CLI::App* in = &app;  // the subcommand the flags belong to, once one is named
  std::vector<std::string> seen;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      const auto named = app.get_subcommands([&](const CLI::App* sub) { return sub->get_name() == arg; });
      if (in == &app && !named.empty()) in = named.front(), seen.clear();
      continue;
    }
    const std::string flag = arg.substr(0, arg.find('='));
    const CLI::Option* o = in->get_option_no_throw(flag);
    if (!o) {
      const std::string near = nearest_flag(*in, flag);
      return "unknown flag " + quote_value(flag) + (near.empty() ? "" : ": did you mean " + near + "?");
    }
    if (std::find(seen.begin(), seen.end(), flag) != seen.end())
      return flag + " is given twice on the command line; give it once";
    // CLI11 reads a switch's "--nesterov=" as the switch given (on), a number's as missing.
    if (arg.size() == flag.size() + 1) return flag + "= has no value after the '='";
    seen.push_back(flag);
    if (o->get_expected_max() > 0 && arg.find('=') == std::string::npos) ++i;  // its value, whatever it looks like
  }
  return "";
}
}  // namespace

int parse_command_line(CLI::App& app, int argc, char** argv, const char* program,
                       const std::function<std::string()>& before_error) {
  if (const std::string wrong = check_flags(app, argc, argv); !wrong.empty()) {
    const std::string who = before_error ? before_error() : "";
    std::fprintf(stderr, "%s: error: %s%s (see --help)\n", program, who.c_str(), one_line(wrong).c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    const std::string who = before_error ? before_error() : "";
    std::fprintf(stderr, "%s: error: %s%s (see --help)\n", program, who.c_str(), one_line(e.what()).c_str());
    return 2;
  }
  return -1;
}

std::vector<int32_t> parse_token_list(const std::string& text) {
  std::vector<int32_t> out;
  for (const std::string& item : split(text, ',')) {
    int32_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size() || v < 0)
      throw UsageError("--prompt-tokens: " + quote_value(item) + " is not a token id (a whole number from 0 to " +
                       std::to_string(INT32_MAX) + "); give ids separated by commas, e.g. 15496,11,616");
    out.push_back(v);
  }
  return out;
}

}  // namespace dpt::app
