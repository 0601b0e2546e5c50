// Error types shared by every layer of dptrain. Errors are values with context: each
// carries a one-line message that names the call, the device and the cause, so the CLI
// can print it as it is and exit non-zero.
#pragma once
#include <functional>
#include <stdexcept>
#include <string>

namespace dpt {

// Any failure inside dptrain (a CUDA/cuBLAS call, a bad shape, a bad file).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A device ran out of memory; the message names the device, the sizes and what to change.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// The user asked for something invalid (flag value, model spec, device list): exit 2.
class UsageError : public Error {
 public:
  using Error::Error;
};

// What the library has to say that is not an error it throws: notes (a batch smaller than
// the replicas), warnings (a skipped step, a failure while cleaning up) and the error that
// ends a multi-process job (ProcessGroup::abort). The library never prints: it hands each
// one-line message to the handler the program installed, from whichever thread it is on
// (one call at a time); with none installed, messages are dropped, and so are messages
// the handler causes itself on its own thread (it called the library). dptrain's CLI prints them as
// "dptrain: warning: ...".
enum class Severity { note, warning, error };
using MessageHandler = std::function<void(Severity, const std::string&)>;
void set_message_handler(MessageHandler handler);
void report(Severity severity, const std::string& message);
const char* severity_name(Severity severity);  // "note", "warning", "error"

// Throws dpt::Error with file:line when cond is false: for the library's own invariants.
#define DPT_CHECK(cond, msg)                                                                                \
  do {                                                                                                      \
    if (!(cond)) throw ::dpt::Error(std::string(msg) + " (" __FILE__ ":" + std::to_string(__LINE__) + ")"); \
  } while (0)

// Throws dpt::UsageError(msg) when cond is false: for what a caller passed to a public
// function (a tensor of another shape, dtype or device), which is the caller's to fix.
#define DPT_REQUIRE(cond, msg)                              \
  do {                                                      \
    if (!(cond)) throw ::dpt::UsageError(std::string(msg)); \
  } while (0)

}  // namespace dpt
