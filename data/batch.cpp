#include <dptrain/data/batch.hpp>

#include <dptrain/error.hpp>

namespace dpt::data {

const char* task_name(Task t) { return t == Task::regression ? "regression" : "classification"; }

Task parse_task(const std::string& name) {
  if (name == "regression") return Task::regression;
  if (name == "classification") return Task::classification;
  throw UsageError("unknown task '" + name + "': expected regression or classification");
}

}  // namespace dpt::data
