#include <dptrain/data/batch.hpp>

#include <dptrain/error.hpp>

namespace dpt::data {

const char* task_name(Task t) { return kTaskNames.name(t); }
Task parse_task(const std::string& name) { return kTaskNames.parse(name); }

}  // namespace dpt::data
