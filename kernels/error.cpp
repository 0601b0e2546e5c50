// The message handler of <dptrain/error.hpp>. It lives in the lowest library, so that every
// folder (the kernels' cleanup checks included) can report through it.
#include <dptrain/error.hpp>

#include <cstdio>
#include <memory>
#include <mutex>

#include <dptrain/enum_names.hpp>

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

void report(Severity severity, const Message& message) {
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
  static constexpr auto kNames = enum_names<Severity>(
      "severity", {{Severity::note, "note"}, {Severity::warning, "warning"}, {Severity::error, "error"}});
  return kNames.name(severity);
}

Message::Message(std::string text, std::vector<FieldId> fields) : fields_(std::move(fields)) {
  // Each field takes the next "{}" (a field beyond the last one goes unnamed in the text).
  size_t at = 0;
  for (const FieldId& f : fields_) {
    const size_t hole = text.find("{}", at);
    if (hole == std::string::npos) break;
    text_.append(text, at, hole - at);
    holes_.push_back({text_.size(), f});
    at = hole + 2;
  }
  text_.append(text, at);
  str_ = str([](const FieldId& f) { return f.str(); });
}

Message Message::of(const std::exception& e) {
  if (const auto* err = dynamic_cast<const Error*>(&e)) return err->line();
  return Message(e.what());
}

std::string Message::str(const std::function<std::string(const FieldId&)>& name) const {
  std::string out;
  size_t at = 0;
  for (const auto& [pos, field] : holes_) {
    out.append(text_, at, pos - at);
    out += name(field);
    at = pos;
  }
  return out.append(text_, at);
}

Message& Message::operator+=(const Message& more) {
  // The holes stay where they are: a "{}" in the text of either side (a value) is text.
  for (const auto& [pos, field] : more.holes_) holes_.push_back({text_.size() + pos, field});
  text_ += more.text_;
  str_ += more.str_;
  fields_.insert(fields_.end(), more.fields_.begin(), more.fields_.end());
  return *this;
}

std::string quote_value(std::string_view value) {
  constexpr size_t kShown = 200;  // bytes of the value shown before it is cut
  std::string out = "'";
  size_t i = 0;
  while (i < value.size() && i < kShown) {
    const auto c = static_cast<unsigned char>(value[i]);
    // The length of a well-formed UTF-8 sequence starting here (0: none).
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (len > 1) {
      if (i + len > value.size()) len = 0;
      for (size_t k = 1; k < len; ++k)
        if ((static_cast<unsigned char>(value[i + k]) & 0xC0) != 0x80) len = 0;
      if (len == 2 && c < 0xC2) len = 0;  // an overlong form
    }
    if (len == 1 && c >= 0x20 && c != 0x7F) {
      out += value[i];
    } else if (c == '\n') {  // as one_line writes it
      out += "\\n";
    } else if (len > 1) {
      out.append(value.substr(i, len));
      i += len;
      continue;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
    ++i;
  }
  out += "'";
  if (i < value.size()) out += " (cut: " + std::to_string(value.size()) + " bytes in all)";
  return out;
}

}  // namespace dpt
