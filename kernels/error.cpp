// The message handler of <dptrain/error.hpp>. It lives in the lowest library, so that every
// folder (the kernels' cleanup checks included) can report through it.
#include <dptrain/error.hpp>

#include <memory>
#include <mutex>

namespace dpt {
namespace {
std::mutex g_mu;       // guards g_handler
std::mutex g_call_mu;  // one call of the handler at a time: it need not be thread-safe
std::shared_ptr<const MessageHandler> g_handler;
thread_local bool t_in_handler = false;
}  // namespace

void set_message_handler(MessageHandler h) {
  auto p = h ? std::make_shared<const MessageHandler>(std::move(h)) : nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  g_handler = std::move(p);
}

void report(Severity severity, const std::string& message) {
  // A message from inside the handler (it called the library) is dropped: neither a
  // deadlock on the call lock nor a recursion without end. The handler called is kept
  // alive by `h`, so it may also set another.
  if (t_in_handler) return;
  std::shared_ptr<const MessageHandler> h;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    h = g_handler;
  }
  if (!h) return;
  std::lock_guard<std::mutex> call(g_call_mu);
  struct InHandler {
    InHandler() { t_in_handler = true; }
    ~InHandler() { t_in_handler = false; }
  } in_handler;
  (*h)(severity, message);
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
