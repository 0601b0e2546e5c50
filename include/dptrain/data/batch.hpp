// What a data source hands the trainer: a batch of inputs and targets on a device, and the
// kind of task the targets describe.
#pragma once
#include <string>

#include <dptrain/enum_names.hpp>
#include <dptrain/runtime/tensor.hpp>

namespace dpt::data {

// language_model: next-token prediction, each row a window of tokens (i32 inputs) whose
// targets are the tokens one position on (tokens.hpp).
enum class Task { regression, classification, language_model };
inline constexpr auto kTaskNames = enum_names<Task>("task", {{Task::regression, "regression"},
                                                             {Task::classification, "classification"},
                                                             {Task::language_model, "language-model"}});
const char* task_name(Task t);
Task parse_task(const std::string& name);  // UsageError when unknown

struct Batch {
  Tensor x;  // f32 [n, in], or [n, C, H, W] for images; i32 [n, T] tokens for a language model
  Tensor y;  // f32 [n, out] (regression), i32 [n] (classification) or i32 [n, T] (next tokens)
};

}  // namespace dpt::data
