// Error types shared by every layer of dptrain. Errors are values with context: each
// carries a one-line message that names the call, the device and the cause, so the CLI
// can print it as it is and exit non-zero.
#pragma once
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dpt {

// An option field: the struct that holds it and the member's name ("TrainConfig", "batch").
// The library names fields; a program that reads them from its own flags or keys names
// them its way (dptrain's CLI: --batch).
struct FieldId {
  std::string owner, name;
  std::string str() const { return owner + "::" + name; }  // "TrainConfig::batch"
  bool operator==(const FieldId& o) const { return owner == o.owner && name == o.name; }
};

// A line the library says, which may name option fields: its text holds "{}" for each field
// in turn (in a refusal, the first is the one at fault). str() writes them as Owner::name;
// str(name) as the program names them, so that a program never reads field names out of
// the text. Errors and the notes and warnings the library reports are such lines.
class Message {
 public:
  Message(std::string text = {}, std::vector<FieldId> fields = {});
  Message(const char* text) : Message(std::string(text)) {}
  // An error's line: a dpt::Error's with its fields, any other's what() as it is.
  static Message of(const std::exception& e);
  const std::string& str() const { return str_; }
  std::string str(const std::function<std::string(const FieldId&)>& name) const;
  operator const std::string&() const { return str_; }  // for a handler that takes the text alone
  const std::vector<FieldId>& fields() const { return fields_; }
  Message& operator+=(const Message& more);
  friend Message operator+(Message a, const Message& b) { return a += b; }

 private:
  std::string text_;  // without the holes
  std::string str_;   // str() as Owner::name
  std::vector<FieldId> fields_;
  std::vector<std::pair<size_t, FieldId>> holes_;  // where in text_ each field goes
};

// Any failure inside dptrain (a CUDA/cuBLAS call, a bad shape, a bad file). An error that
// names option fields holds them apart, as a Message: what() writes them as Owner::name,
// message(name) as the program names them.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : Error(Message(what)) {}
  explicit Error(const char* what) : Error(Message(what)) {}
  Error(std::string text, std::vector<FieldId> fields) : Error(Message(std::move(text), std::move(fields))) {}
  explicit Error(const Message& line) : std::runtime_error(line.str()), line_(line) {}
  const FieldId* field() const { return line_.fields().empty() ? nullptr : &line_.fields().front(); }
  std::string message(const std::function<std::string(const FieldId&)>& name) const { return line_.str(name); }
  const Message& line() const { return line_; }

 private:
  Message line_;
};

// A device ran out of memory; the message names the device, the sizes and what to change.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// The user asked for something invalid (flag value, model spec, device list): exit 2.
// A refusal of option fields carries them (Error's fields).
class UsageError : public Error {
 public:
  using Error::Error;
};

// A row of a data set found bad as it is first gathered (a token outside the vocabulary, a
// non-finite input, a class label out of range): bad input, and DataParallel abandons the
// step that met it before its update, so the steps before it hold (a Trainer saves them).
class DataError : public UsageError {
 public:
  using UsageError::UsageError;
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
// the handler causes itself on its own thread (it called the library). A handler may take
// the Message (its fields apart) or its text (const std::string&, fields as Owner::name).
// dptrain's CLI prints them as "dptrain: warning: ...", the fields as its flags.
enum class Severity { note, warning, error };
using MessageHandler = std::function<void(Severity, const Message&)>;
void set_message_handler(MessageHandler handler);
void report(Severity severity, const Message& message);
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
