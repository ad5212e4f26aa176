// Leveled logging to stderr (journald picks stderr up under systemd). One
// line per message, prefixed with the level and the program name; lines
// from several threads never interleave.
#pragma once

#include <optional>
#include <sstream>
#include <string>

namespace dede {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

std::optional<LogLevel> ParseLogLevel(const std::string& s);
void SetLogLevel(LogLevel level);
void SetLogProgram(const std::string& name);
bool LogEnabled(LogLevel level);
void LogLine(LogLevel level, const std::string& msg);

// LOG(kInfo) << "serving " << n << " exports";
class LogStream {
 public:
  explicit LogStream(LogLevel level) : level_(level) {}
  ~LogStream() { LogLine(level_, s_.str()); }
  template <typename T>
  LogStream& operator<<(const T& v) {
    s_ << v;
    return *this;
  }

 private:
  LogLevel level_;
  std::ostringstream s_;
};

}  // namespace dede

// A for statement, not an if, so LOG inside an unbraced if/else is safe;
// the arguments are not evaluated when the level is off.
#define LOG(level)                                                                  \
  for (bool dede_log_once_ = ::dede::LogEnabled(::dede::LogLevel::level); dede_log_once_; \
       dede_log_once_ = false)                                                      \
  ::dede::LogStream(::dede::LogLevel::level)
