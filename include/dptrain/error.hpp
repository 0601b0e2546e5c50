// Error types shared by every layer of dptrain. Errors are values with context: each
// carries a one-line message that names the call, the device and the cause, so the CLI
// can print it as it is and exit non-zero.
#pragma once
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

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

// An option field: the struct that holds it and the member's name ("TrainConfig", "batch").
// The library names fields; a program that reads them from its own flags or keys names
// them its way (dptrain's CLI: --batch).
struct FieldId {
  std::string owner, name;
  std::string str() const { return owner + "::" + name; }  // "TrainConfig::batch"
  bool operator==(const FieldId& o) const { return owner == o.owner && name == o.name; }
};

// The user asked for something invalid (flag value, model spec, device list): exit 2.
// A refusal of option fields carries them: its text holds "{}" for each field in turn,
// the first being the one at fault; what() writes them as Owner::name and message() as
// the program names them, so that a program never reads field names out of the text.
class UsageError : public Error {
 public:
  using Error::Error;
  UsageError(std::string text, std::vector<FieldId> fields);
  const FieldId* field() const { return fields_.empty() ? nullptr : &fields_.front(); }
  std::string message(const std::function<std::string(const FieldId&)>& name) const;

 private:
  std::string text_;
  std::vector<FieldId> fields_;
};

// A value a user gave, as an error message echoes it: in single quotes, bytes that are
// not printable UTF-8 (NUL, control characters, broken sequences) as \xNN escapes, and
// cut to about 200 characters with its length named, so that a message stays one
// readable line whatever the value (a 900 KB config value, a device list of 100 KB).
std::string quote_value(std::string_view value);

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
