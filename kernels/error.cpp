// The message handler of <dptrain/error.hpp>. It lives in the lowest library, so that every
// folder (the kernels' cleanup checks included) can report through it.
#include <dptrain/error.hpp>

#include <mutex>

namespace dpt {
namespace {
std::mutex g_mu;
MessageHandler& handler() {
  static MessageHandler h;
  return h;
}
}  // namespace

void set_message_handler(MessageHandler h) {
  std::lock_guard<std::mutex> lock(g_mu);
  handler() = std::move(h);
}

void report(Severity severity, const std::string& message) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (handler()) handler()(severity, message);
}

const char* severity_name(Severity severity) {
  switch (severity) {
    case Severity::note:
      return "note";
    case Severity::warning:
      return "warning";
    case Severity::error:
      break;
  }
  return "error";
}

}  // namespace dpt
