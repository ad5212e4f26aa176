// `dede policy`: show or change the volume's dedup policy (agent/dedup_policy.h),
// the off-peak windows, I/O cap, priority and stability delay every host's
// dedupd follows.
#include <time.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "agent/dedup_policy.h"
#include "tools/dede/cli.h"
#include "util/clock.h"

namespace po = boost::program_options;
using json = nlohmann::json;

namespace dede::cli {
namespace {

constexpr uint64_t kBytesPerMB = 1'000'000;  // decimal, as rates are quoted
constexpr uint64_t kNsPerSecond = 1'000'000'000;

struct DurationUnit {
  char suffix;
  uint64_t seconds;
};
constexpr DurationUnit kDurationUnits[] = {{'d', 86400}, {'h', 3600}, {'m', 60}, {'s', 1}};

// "off" or the largest unit that divides it: "1h", "90m", "45s".
std::string StableAfterText(uint64_t seconds) {
  if (seconds == 0) return "off";
  for (const DurationUnit& u : kDurationUnits) {
    if (seconds % u.seconds == 0) return std::to_string(seconds / u.seconds) + u.suffix;
  }
  return std::to_string(seconds) + "s";
}

std::string LocalDateTime(uint64_t ns) {
  const time_t secs = static_cast<time_t>(ns / kNsPerSecond);
  struct tm tm {};
  if (localtime_r(&secs, &tm) == nullptr) return "?";
  char buf[64];
  if (std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S %z", &tm) == 0) return "?";
  return buf;
}

// rate=: MB/s as a decimal number (MB = 10^6 bytes), 0 or "unlimited".
std::optional<uint64_t> ParseRate(const std::string& text) {
  if (text == "unlimited") return 0;
  if (text.empty()) return std::nullopt;
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c)) && c != '.') return std::nullopt;
  }
  char* end = nullptr;
  const double mb = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || !std::isfinite(mb) || mb < 0) return std::nullopt;
  const double bytes = std::round(mb * double(kBytesPerMB));
  // At most 2^63 bytes/s: far above any device, and exact in a double's range.
  if (bytes > 9.2e18 || (mb > 0 && bytes < 1)) return std::nullopt;
  return static_cast<uint64_t>(bytes);
}

// stable-after=: seconds, or a number with suffix s/m/h/d; 0 or "off".
std::optional<uint64_t> ParseStableAfter(const std::string& text) {
  if (text == "off") return 0;
  if (text.empty()) return std::nullopt;
  uint64_t unit = 1;
  std::string digits = text;
  for (const DurationUnit& u : kDurationUnits) {
    if (text.back() == u.suffix) {
      unit = u.seconds;
      digits = text.substr(0, text.size() - 1);
      break;
    }
  }
  std::optional<uint64_t> n = ParseUnsigned(digits);
  if (!n || *n > kMaxStableAfterS / unit) return std::nullopt;
  return *n * unit;
}

// One KEY=VALUE of `set`, applied to `p`; a usage message when bad.
std::optional<std::string> ApplyAssignment(const std::string& assignment, DedupPolicy* p) {
  const size_t eq = assignment.find('=');
  if (eq == std::string::npos) return "expected KEY=VALUE, not '" + assignment + "'";
  const std::string key = assignment.substr(0, eq);
  const std::string value = assignment.substr(eq + 1);
  if (key == "windows") {
    Result<std::vector<DedupWindow>> ws = ParseWindowList(value);
    if (!ws.ok()) {
      return "windows: " + ws.status().message() +
             "; accepted: 'always' or ';'-separated windows like "
             "'mon-fri 01:00-05:00;sat,sun 00:00-24:00'";
    }
    p->windows = std::move(ws).value();
  } else if (key == "rate") {
    std::optional<uint64_t> rate = ParseRate(value);
    if (!rate) {
      return "rate: '" + value +
             "' is not a rate (expected MB/s as a number, e.g. 50 or 12.5, "
             "or 0 or 'unlimited')";
    }
    p->rate_bytes_per_s = *rate;
  } else if (key == "priority") {
    std::optional<DedupPriority> prio = ParsePriority(value);
    if (!prio) return "priority: '" + value + "' is not a priority (expected idle, low or normal)";
    p->priority = *prio;
  } else if (key == "stable-after") {
    std::optional<uint64_t> s = ParseStableAfter(value);
    if (!s) {
      return "stable-after: '" + value +
             "' is not a duration (expected seconds, or a number "
             "with s, m, h or d, e.g. 90s or 1h, at most 365d; 0 or 'off')";
    }
    p->stable_after_s = *s;
  } else {
    return "unknown key '" + key + "' (known: windows, rate, priority, stable-after)";
  }
  return std::nullopt;
}

void PrintPolicy(const DedupPolicy& p, bool as_json) {
  const uint64_t now = Clock::Real()->NowNanos();
  if (as_json) {
    json j;
    j["windows"] = json::array();
    for (const DedupWindow& w : p.windows) j["windows"].push_back(FormatWindow(w));
    j["rate_bytes_per_s"] = p.rate_bytes_per_s;
    j["priority"] = PriorityName(p.priority);
    j["stable_after_s"] = p.stable_after_s;
    j["generation"] = p.generation;
    j["updated_ns"] = p.updated_ns;
    j["updated_by_host"] = p.updated_by_host;
    j["in_window_now"] = InWindow(p, now);
    j["time_zone"] = TimeZoneText(now);
    PrintJson(j);
    return;
  }
  const char* const kIndent = "                ";
  std::cout << "windows:        ";
  if (p.windows.empty()) {
    std::cout << "always (no windows)\n";
  } else {
    for (size_t i = 0; i < p.windows.size(); i++) {
      std::cout << (i == 0 ? "" : kIndent) << FormatWindow(p.windows[i]) << '\n';
    }
  }
  std::cout << "rate cap:       " << PolicyRateText(p.rate_bytes_per_s) << '\n'
            << "priority:       " << PriorityName(p.priority) << '\n'
            << "stable after:   " << StableAfterText(p.stable_after_s) << '\n'
            << "generation:     " << p.generation << '\n';
  if (p.generation == 0) {
    std::cout << "updated:        never (the default policy)\n";
  } else {
    std::cout << "updated:        " << LocalDateTime(p.updated_ns) << " by host "
              << p.updated_by_host << '\n';
  }
  const bool in = InWindow(p, now);
  std::cout << "in window now:  " << (in ? "yes" : "no");
  const std::string current = CurrentWindowText(p, now);
  if (!current.empty()) std::cout << " (" << current << ")";
  // This machine's zone: each host evaluates the windows in its own.
  if (!p.windows.empty()) std::cout << ", here (" << TimeZoneText(now) << ")";
  std::cout << '\n';
  if (std::optional<uint64_t> next = NextWindowChange(p, now)) {
    std::cout << "next change:    " << LocalDateTime(*next) << " (window "
              << (in ? "closes" : "opens") << ")\n";
  }
}

// ReadPolicy, waiting a little while a writer holds the file.
Result<DedupPolicy> ReadPolicyPatiently(Volume* vol) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (true) {
    Result<DedupPolicy> p = ReadPolicy(vol);
    if (p.ok() || p.status().code() != Status::Code::kLocked ||
        std::chrono::steady_clock::now() >= deadline) {
      return p;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace

int RunPolicy(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.AddPositional("VOL", "volume: a path (file or block device) or iscsi:// URL");
  parser.AddPositional("ACTION", "show, or set followed by KEY=VALUE...");
  // `set` takes any number of assignments: one positional slot each.
  size_t assignments = 0;
  for (size_t i = 0, positional = 0; i < args.size(); i++) {
    if (!args[i].empty() && args[i][0] == '-') continue;
    if (++positional > 2) assignments++;
  }
  for (size_t i = 0; i < assignments; i++) {
    parser.AddPositional("KEY=VALUE", "a policy setting (set only)");
  }
  parser.options()("json", po::bool_switch(), "print the policy as JSON");
  parser.SetDetails(
      "The policy is stored on the volume (.dede-policy) and followed by every\n"
      "host's dedupd. Keys for set (several at once; keys not given keep their\n"
      "value):\n"
      "  windows=W[;W...]   when dedup may run, in each host's local time, e.g.\n"
      "                     'mon-fri 01:00-05:00;sat,sun 00:00-24:00' or\n"
      "                     'daily 22:00-04:00' (crosses midnight); 'always'\n"
      "                     for no limit\n"
      "  rate=MB/s          cap on dedup I/O (MB = 1,000,000 bytes), e.g. 50 or\n"
      "                     12.5; 0 or 'unlimited'\n"
      "  priority=P         idle, low or normal\n"
      "  stable-after=T     share a block only after it stayed unchanged this\n"
      "                     long: seconds or with s, m, h, d (e.g. 1h); 0 or 'off'\n"
      "set prints the new policy as show does.");
  if (auto rc = parser.Parse(args)) return *rc;
  const std::string& action = parser.positional(1);
  const bool as_json = parser.flag("json");

  if (action == "show") {
    if (assignments > 0) {
      return UsageError(cmd, "show takes no KEY=VALUE (did you mean set?)");
    }
    auto opened = OpenVolume(parser.positional(0), /*read_only=*/true);
    if (!opened.ok()) return Fail(cmd, opened.status());
    Result<DedupPolicy> p = ReadPolicyPatiently(opened->volume.get());
    if (!p.ok()) return Fail(cmd, p.status());
    PrintPolicy(*p, as_json);
    return kExitOk;
  }
  if (action != "set") return UsageError(cmd, "unknown action '" + action + "' (show or set)");
  if (assignments == 0) return UsageError(cmd, "set needs at least one KEY=VALUE");

  std::vector<std::string> changes;
  for (size_t i = 0; i < assignments; i++) changes.push_back(parser.positional(2 + i));
  // Check every assignment before touching the volume: a typo fails with
  // nothing written.
  {
    DedupPolicy scratch;
    for (const std::string& c : changes) {
      if (std::optional<std::string> bad = ApplyAssignment(c, &scratch)) {
        return UsageError(cmd, *bad);
      }
    }
  }
  auto opened = OpenVolume(parser.positional(0), /*read_only=*/false);
  if (!opened.ok()) return Fail(cmd, opened.status());
  Result<DedupPolicy> written = UpdatePolicy(opened->volume.get(), [&](DedupPolicy* p) {
    for (const std::string& c : changes) {
      if (std::optional<std::string> bad = ApplyAssignment(c, p)) return Status::Invalid(*bad);
    }
    return Status::Ok();
  });
  if (!written.ok()) return Fail(cmd, written.status());
  PrintPolicy(*written, as_json);
  return kExitOk;
}

}  // namespace dede::cli
