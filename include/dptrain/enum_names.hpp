// One table of names for an enum, which gives both its name and its parse: each enum that
// a user writes as a word (a flag, a config key, a checkpoint's metadata) declares its
// names once, beside the enum, instead of a name switch and a parse loop kept in step by
// hand. The options schema (<dptrain/options.hpp>) reads the same table for a field's
// choices.
#pragma once
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <dptrain/error.hpp>

namespace dpt {

template <class E>
struct EnumName {
  E value;
  const char* name;
};

template <class E, size_t N>
struct EnumNames {
  const char* what;  // what a value is, for errors: "precision"
  EnumName<E> entries[N];

  // The value's name ("?" for a value outside the enum, which a cast can make).
  constexpr const char* name(E v) const {
    for (const EnumName<E>& e : entries)
      if (e.value == v) return e.name;
    return "?";
  }
  std::optional<E> find(std::string_view text) const {
    for (const EnumName<E>& e : entries)
      if (text == e.name) return e.value;
    return std::nullopt;
  }
  // "fp32, tf32 or bf16"
  std::string choices() const {
    std::string out;
    for (size_t i = 0; i < N; ++i) out += (i == 0 ? "" : i + 1 == N ? " or " : ", ") + std::string(entries[i].name);
    return out;
  }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const EnumName<E>& e : entries) out.emplace_back(e.name);
    return out;
  }
  // The value named `text`; UsageError "unknown precision 'x': expected fp32, tf32 or bf16".
  E parse(std::string_view text) const {
    if (const auto v = find(text)) return *v;
    throw UsageError("unknown " + std::string(what) + " " + quote_value(text) + ": expected " + choices());
  }
};

// enum_names<Precision>("precision", {{Precision::fp32, "fp32"}, ...}): a table whose size
// follows from its entries.
template <class E, size_t N>
constexpr EnumNames<E, N> enum_names(const char* what, const EnumName<E> (&entries)[N]) {
  EnumNames<E, N> t{what, {}};
  for (size_t i = 0; i < N; ++i) t.entries[i] = entries[i];
  return t;
}

}  // namespace dpt
