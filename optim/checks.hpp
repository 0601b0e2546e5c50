// The optimizers' checks of their options (SGD, AdamW, the schedule, checked_step's
// max_norm): each throws a UsageError that names the field and the value, in one wording
// ("SGD::Options::lr must be a positive number, got 0"). NaN fails every rule.
#pragma once
#include <string>

namespace dpt::optim {

void need(bool ok, const std::string& field, const char* rule, double value);
void need_lr(float lr, const std::string& field);    // a positive number
void need_unit(float v, const std::string& field);   // in [0, 1)
void need_decay(float v, const std::string& field);  // a finite number >= 0

}  // namespace dpt::optim
