#include "checks.hpp"

#include <cmath>
#include <cstdio>

#include <dptrain/error.hpp>

namespace dpt::optim {

void need(bool ok, const std::string& field, const char* rule, double value) {
  if (ok) return;
  char got[32];
  std::snprintf(got, sizeof got, "%g", value);
  throw UsageError(field + " must be " + rule + ", got " + got);
}
void need_lr(float lr, const std::string& field) {
  need(lr > 0.0f && std::isfinite(lr), field, "a positive number", lr);
}
void need_unit(float v, const std::string& field) { need(v >= 0.0f && v < 1.0f, field, "in [0, 1)", v); }
void need_decay(float v, const std::string& field) {
  need(v >= 0.0f && std::isfinite(v), field, "a finite number >= 0", v);
}

}  // namespace dpt::optim
