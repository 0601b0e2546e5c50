// Refusals of TrainConfig's fields, shared by the checks in train/ (internal).
#pragma once
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <dptrain/error.hpp>

namespace dpt {

// A field of TrainConfig by its name; "parallel.zero" is DataParallelOptions::zero.
inline FieldId field(const std::string& name) {
  if (name.rfind("parallel.", 0) == 0) return {"DataParallelOptions", name.substr(9)};
  return {"TrainConfig", name};
}

// Errors name the field (TrainConfig::batch) as a program that embeds the library knows
// it, and carry it (UsageError::field), so that dptrain's CLI shows each field as its flag.
// `why` names the other fields it mentions with "{}", in the order of `others`.
[[noreturn]] inline void bad(const std::string& name, const std::string& why,
                             std::initializer_list<const char*> others = {}) {
  std::vector<FieldId> fields{field(name)};
  for (const char* o : others) fields.push_back(field(o));
  throw UsageError("{} " + why, std::move(fields));
}

// check_output_file for TrainConfig::save, its refusal naming the field.
void check_save_path(const std::string& path);

}  // namespace dpt
