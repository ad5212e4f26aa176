#include "util/log.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace dede {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::mutex g_mu;
std::string g_program = "dede";  // guarded by g_mu

const char* LevelName(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "?";
}

// syslog(3) priorities, as sd-daemon(3)'s SD_ERR, SD_WARNING, SD_INFO, SD_DEBUG.
const char* JournalPrefix(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug: return "<7>";
    case LogLevel::kInfo: return "<6>";
    case LogLevel::kWarning: return "<4>";
    case LogLevel::kError: return "<3>";
  }
  return "<6>";
}

// Parses a decimal number at *p and advances *p past it.
bool ParseDecimal(const char** p, uint64_t* out) {
  const char* s = *p;
  if (*s < '0' || *s > '9') return false;
  uint64_t v = 0;
  while (*s >= '0' && *s <= '9') {
    uint64_t d = static_cast<uint64_t>(*s - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
    s++;
  }
  *p = s;
  *out = v;
  return true;
}

// Decided once: whether stderr is (still) the stream systemd connected to
// the journal. A stderr redirected elsewhere by the service's command line
// keeps $JOURNAL_STREAM but no longer matches it.
bool StderrIsJournal() {
  static const bool journal = [] {
    const char* env = std::getenv("JOURNAL_STREAM");
    if (env == nullptr || *env == '\0') return false;
    struct stat st;
    if (::fstat(STDERR_FILENO, &st) != 0) return false;
    return JournalStreamMatches(env, static_cast<uint64_t>(st.st_dev),
                                static_cast<uint64_t>(st.st_ino));
  }();
  return journal;
}
}  // namespace

std::optional<LogLevel> ParseLogLevel(const std::string& s) {
  if (s == "debug") return LogLevel::kDebug;
  if (s == "info") return LogLevel::kInfo;
  if (s == "warning" || s == "warn") return LogLevel::kWarning;
  if (s == "error") return LogLevel::kError;
  return std::nullopt;
}

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }

void SetLogProgram(const std::string& name) {
  std::lock_guard<std::mutex> l(g_mu);
  g_program = name;
}

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(); }

std::string FormatLogLine(LogLevel level, const std::string& program, const std::string& msg,
                          bool journal) {
  std::string line;
  line.reserve(msg.size() + program.size() + 16);
  if (!journal) {
    line.append(program).append(": ").append(LevelName(level)).append(": ").append(msg);
    line.push_back('\n');
    return line;
  }
  const char* prefix = JournalPrefix(level);
  line.append(prefix).append(LevelName(level)).append(": ");
  for (size_t i = 0; i < msg.size(); i++) {
    line.push_back(msg[i]);
    if (msg[i] == '\n' && i + 1 < msg.size()) line.append(prefix);
  }
  line.push_back('\n');
  return line;
}

bool JournalStreamMatches(const char* journal_stream, uint64_t dev, uint64_t ino) {
  if (journal_stream == nullptr) return false;
  const char* p = journal_stream;
  uint64_t d = 0, i = 0;
  if (!ParseDecimal(&p, &d) || *p != ':') return false;
  p++;
  if (!ParseDecimal(&p, &i) || *p != '\0') return false;
  return d == dev && i == ino;
}

void LogLine(LogLevel level, const std::string& msg) {
  const bool journal = StderrIsJournal();
  std::lock_guard<std::mutex> l(g_mu);
  const std::string line = FormatLogLine(level, g_program, msg, journal);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace dede
