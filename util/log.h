// Leveled logging to stderr. One line per message, prefixed with the program
// name and the level ("dedupd: info: ..."); lines from several threads never
// interleave. When stderr is the systemd journal (a service's stdout/stderr:
// $JOURNAL_STREAM names stderr's device and inode), each line instead starts
// with its syslog priority, "<3>error: ...", which journald stores as the
// entry's PRIORITY (journalctl -p) and strips from the text; the program name
// is left out there because journald records it as SYSLOG_IDENTIFIER.
#pragma once

#include <cstdint>
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

// The text LogLine writes for one message, newline included. journal=false:
// "PROGRAM: LEVEL: MSG\n". journal=true: "<P>LEVEL: MSG\n" with P the
// syslog priority (3 error, 4 warning, 6 info, 7 debug, as sd-daemon(3)'s
// SD_ERR...); a message of several lines gets the prefix on each line, so
// journald gives every line the message's priority.
std::string FormatLogLine(LogLevel level, const std::string& program, const std::string& msg,
                          bool journal);

// True if journal_stream (the value of $JOURNAL_STREAM, "DEV:INODE" in
// decimal; may be null) names the file with device `dev` and inode `ino`
// (systemd.exec(5): compare with fstat() of the fd before trusting it).
bool JournalStreamMatches(const char* journal_stream, uint64_t dev, uint64_t ino);

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
