// What a data source hands the trainer: a batch of inputs and targets on a device, and the
// kind of task the targets describe.
#pragma once
#include <string>

#include <dptrain/enum_names.hpp>
#include <dptrain/runtime/tensor.hpp>

namespace dpt::data {

enum class Task { regression, classification };
inline constexpr auto kTaskNames =
    enum_names<Task>("task", {{Task::regression, "regression"}, {Task::classification, "classification"}});
const char* task_name(Task t);
Task parse_task(const std::string& name);  // UsageError when unknown

struct Batch {
  Tensor x;  // f32 [n, in], or [n, C, H, W] for images
  Tensor y;  // f32 [n, out] (regression) or i32 [n] (classification)
};

}  // namespace dpt::data
