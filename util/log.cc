#include "util/log.h"

#include <atomic>
#include <cstdio>
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

void LogLine(LogLevel level, const std::string& msg) {
  std::lock_guard<std::mutex> l(g_mu);
  std::fprintf(stderr, "%s: %s: %s\n", g_program.c_str(), LevelName(level), msg.c_str());
  std::fflush(stderr);
}

}  // namespace dede
