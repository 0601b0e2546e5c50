// An options schema: each field of an option struct (TrainConfig, DataParallelOptions)
// declared once, with its type, default, range, help, whether every rank of a job must
// agree on it and whether a checkpoint records it. That one table drives the library's
// checks of each field's own range, a program's flags and config keys (dptrain's CLI reads
// the table, never a list of its own), the run settings a checkpoint records and the list
// the ranks of a job compare. Checks between fields (nesterov needs momentum) stay in the
// code that owns the struct, and run after the fields' own.
#pragma once
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <dptrain/error.hpp>

namespace dpt {

enum class OptionKind { integer, real, boolean, choice, text, path, devices };

// Where a number field's value must lie: lo <= v <= hi (either end open), NaN never, and
// the phrase an error says ("must be >= 1", "must be in [0, 1)").
struct OptionRange {
  double lo = -HUGE_VAL, hi = HUGE_VAL;
  bool lo_open = false, hi_open = false;
  std::string must;  // "must be >= 1"
  bool holds(double v) const { return (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi) && !std::isnan(v); }
};

template <class C>
struct OptionField {
  FieldId id;
  OptionKind kind = OptionKind::text;
  // A number's C++ type, which bounds what a reader accepts: "int", "int64", "uint64",
  // "float", "double" ("" for other kinds).
  std::string type;
  std::string help;
  std::vector<std::string> choices;  // a choice field's names (enum_names' table)
  bool ranks_agree = false;          // every rank of a job must hold the same value
  bool recorded = false;             // a checkpoint records it among its run settings, under id.name
  bool fixed = false;                // recorded, and a resumed run must have the value the checkpoint has
  // The value as text ("0.05", "true", "adamw"): the default shown in help, the run setting
  // a checkpoint records and what the ranks compare. A float's text reads back as the same float.
  std::function<std::string(const C&)> get;
  // Sets the field from a user's text, whose form the reader checked (a whole decimal
  // number, a float, true or false); throws UsageError naming the field for a word that
  // names no choice.
  std::function<void(C&, const std::string&)> set;
  // The field's own range; throws UsageError naming the field and the value. Empty: any value.
  std::function<void(const C&)> check;
  std::optional<OptionRange> range;  // a number's range, which check() enforces

  // In a table: OptionField{...}.agreed(), .recorded() (a checkpoint's run setting, which
  // every rank shares too).
  OptionField agreed() const {
    OptionField f = *this;
    f.ranks_agree = true;
    return f;
  }
  OptionField in_checkpoint() const {
    OptionField f = agreed();
    f.recorded = true;
    return f;
  }
  OptionField fixed_on_resume() const {
    OptionField f = in_checkpoint();
    f.fixed = true;
    return f;
  }
};

template <class C>
using OptionSchema = std::vector<OptionField<C>>;

// The fields of a member struct (TrainConfig::parallel) as fields of the struct that holds it.
template <class Outer, class Inner>
OptionSchema<Outer> nested(Inner Outer::*member, const OptionSchema<Inner>& inner) {
  OptionSchema<Outer> out;
  for (const OptionField<Inner>& f : inner) {
    OptionField<Outer> o{f.id,       f.kind,  f.type, f.help, f.choices, f.ranks_agree,
                         f.recorded, f.fixed, {},     {},     {},        f.range};
    if (f.get) o.get = [member, get = f.get](const Outer& c) { return get(c.*member); };
    if (f.set) o.set = [member, set = f.set](Outer& c, const std::string& t) { set(c.*member, t); };
    if (f.check) o.check = [member, check = f.check](const Outer& c) { check(c.*member); };
    out.push_back(std::move(o));
  }
  return out;
}

// Each field's own check, in the table's order.
template <class C>
void check_fields(const OptionSchema<C>& schema, const C& c) {
  for (const OptionField<C>& f : schema)
    if (f.check) f.check(c);
}

// The field of `schema` named `name` (null when none is).
template <class C>
const OptionField<C>* find_field(const OptionSchema<C>& schema, const std::string& name) {
  for (const OptionField<C>& f : schema)
    if (f.id.name == name) return &f;
  return nullptr;
}

namespace option_text {
// A number as a field's text: integers whole, a float's shortest text that reads back as it,
// a double's 9 significant digits (as checkpoints have always recorded them).
inline std::string of(int64_t v) { return std::to_string(v); }
inline std::string of(int v) { return std::to_string(v); }
inline std::string of(uint64_t v) { return std::to_string(v); }
inline std::string of(bool v) { return v ? "true" : "false"; }
inline std::string of(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}
inline std::string of(float v) { return of(static_cast<double>(v)); }
// How an error shows the value it refuses: ", got 0"; a float as its shortest text, a
// double as %g.
inline std::string got(int64_t v) { return ", got " + std::to_string(v); }
inline std::string got(int v) { return ", got " + std::to_string(v); }
inline std::string got(uint64_t v) { return ", got " + std::to_string(v); }
inline std::string got(float v) {
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ", got " + (ec == std::errc() ? std::string(buf, end) : std::string("?"));
}
inline std::string got(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, ", got %g", v);
  return buf;
}
// A number the reader checked (decimal integer, float), converted.
template <class T>
T parse(const std::string& text) {
  if constexpr (std::is_same_v<T, bool>) {
    return text == "true" || text == "1" || text == "on" || text == "yes";
  } else if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(std::strtod(text.c_str(), nullptr));
  } else {
    T v{};
    std::from_chars(text.data(), text.data() + text.size(), v);
    return v;
  }
}
}  // namespace option_text

// A field of number type T (an integer, float or double member), in `range`.
template <class C, class T>
OptionField<C> number_field(FieldId id, T C::*member, OptionRange range, std::string help) {
  OptionField<C> f;
  f.kind = std::is_floating_point_v<T> ? OptionKind::real : OptionKind::integer;
  f.type = std::is_same_v<T, float>      ? "float"
           : std::is_same_v<T, double>   ? "double"
           : std::is_same_v<T, uint64_t> ? "uint64"
           : std::is_same_v<T, int>      ? "int"
                                         : "int64";
  f.id = id;
  f.help = std::move(help);
  f.get = [member](const C& c) { return option_text::of(c.*member); };
  f.set = [member](C& c, const std::string& t) { c.*member = option_text::parse<T>(t); };
  if (!range.must.empty()) f.range = range;
  if (!range.must.empty())
    f.check = [member, range, id](const C& c) {
      const T v = c.*member;
      // An integer beyond a double's 53 bits compares as its rounding: bounds are far from those.
      if (!range.holds(static_cast<double>(v))) throw UsageError("{} " + range.must + option_text::got(v), {id});
    };
  return f;
}

template <class C>
OptionField<C> switch_field(FieldId id, bool C::*member, std::string help) {
  OptionField<C> f;
  f.kind = OptionKind::boolean;
  f.id = id;
  f.help = std::move(help);
  f.get = [member](const C& c) { return option_text::of(c.*member); };
  f.set = [member](C& c, const std::string& t) { c.*member = option_text::parse<bool>(t); };
  return f;
}

// A field of an enum with a name table (<dptrain/enum_names.hpp>).
template <class C, class E, class Names>
OptionField<C> choice_field(FieldId id, E C::*member, const Names& names, std::string help) {
  OptionField<C> f;
  f.kind = OptionKind::choice;
  f.id = id;
  f.help = std::move(help);
  f.choices = names.names();
  f.get = [member, names](const C& c) { return std::string(names.name(c.*member)); };
  // "unknown --grad-comm 'fp16': expected fp32 or bf16", naming the field.
  f.set = [member, names, id](C& c, const std::string& t) {
    const auto v = names.find(t);
    if (!v) throw UsageError("unknown {} " + quote_value(t) + ": expected " + names.choices(), {id});
    c.*member = *v;
  };
  return f;
}

// A text field (a path, a model spec, a word the owner checks).
template <class C>
OptionField<C> text_field(FieldId id, std::string C::*member, OptionKind kind, std::string help) {
  OptionField<C> f;
  f.kind = kind;
  f.id = id;
  f.help = std::move(help);
  f.get = [member](const C& c) { return c.*member; };
  f.set = [member](C& c, const std::string& t) { c.*member = t; };
  return f;
}

}  // namespace dpt
