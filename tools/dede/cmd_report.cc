// `dede report`: this host's dedup pass history (the SQLite file dedupd
// writes when each pass ends) and the volume's savings over time.
#include <time.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "agent/pass_history.h"
#include "tools/dede/cli.h"
#include "util/clock.h"

namespace po = boost::program_options;
using json = nlohmann::json;

namespace dede::cli {
namespace {

constexpr uint64_t kNsPerSecond = 1'000'000'000;

// Local wall-clock time of `ns` through strftime `format`.
std::string LocalTime(uint64_t ns, const char* format) {
  const auto secs = static_cast<time_t>(ns / kNsPerSecond);
  struct tm tm {};
  if (localtime_r(&secs, &tm) == nullptr) return "?";
  char buf[64];
  if (std::strftime(buf, sizeof buf, format, &tm) == 0) return "?";
  return buf;
}

std::string LocalDay(uint64_t ns) {
  return LocalTime(ns, "%Y-%m-%d");
}
std::string LocalDateTime(uint64_t ns) {
  return LocalTime(ns, "%Y-%m-%d %H:%M:%S");
}

bool DigitsAt(const std::string& s, size_t pos, size_t count, int* value) {
  if (pos + count > s.size()) return false;
  int v = 0;
  for (size_t i = pos; i < pos + count; i++) {
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return false;
    v = v * 10 + (s[i] - '0');
  }
  *value = v;
  return true;
}

// "2026-11-20", "2026-11-20T13:00" or "2026-11-20T13:00:05" (a space may
// stand for the T), local time, as epoch ns.
std::optional<uint64_t> ParseLocalDate(const std::string& text) {
  const size_t n = text.size();
  if (n != 10 && n != 16 && n != 19) return std::nullopt;
  int year = 0, month = 0, day = 0, hour = 0, minute = 0, second = 0;
  if (!DigitsAt(text, 0, 4, &year) || text[4] != '-' || !DigitsAt(text, 5, 2, &month) ||
      text[7] != '-' || !DigitsAt(text, 8, 2, &day)) {
    return std::nullopt;
  }
  if (n >= 16 && ((text[10] != 'T' && text[10] != ' ') || !DigitsAt(text, 11, 2, &hour) ||
                  text[13] != ':' || !DigitsAt(text, 14, 2, &minute))) {
    return std::nullopt;
  }
  if (n == 19 && (text[16] != ':' || !DigitsAt(text, 17, 2, &second))) return std::nullopt;
  if (year < 1970 || month < 1 || month > 12 || day < 1 || day > 31 || hour > 23 || minute > 59 ||
      second > 59) {
    return std::nullopt;
  }
  struct tm tm {};
  tm.tm_year = year - 1900;
  tm.tm_mon = month - 1;
  tm.tm_mday = day;
  tm.tm_hour = hour;
  tm.tm_min = minute;
  tm.tm_sec = second;
  tm.tm_isdst = -1;  // whatever the local rules say for that day
  const time_t t = std::mktime(&tm);
  // mktime normalizes 2026-02-30 to March 2nd: such a date is a typo.
  if (t == static_cast<time_t>(-1) || tm.tm_mday != day || tm.tm_mon != month - 1) {
    return std::nullopt;
  }
  return t < 0 ? 0 : static_cast<uint64_t>(t) * kNsPerSecond;
}

// "90s", "30m", "12h", "7d", "2w" back from `now_ns`.
std::optional<uint64_t> ParseAgo(const std::string& text, uint64_t now_ns) {
  if (text.size() < 2) return std::nullopt;
  uint64_t unit_s = 0;
  switch (text.back()) {
    case 's':
      unit_s = 1;
      break;
    case 'm':
      unit_s = 60;
      break;
    case 'h':
      unit_s = 3600;
      break;
    case 'd':
      unit_s = 86400;
      break;
    case 'w':
      unit_s = 7 * 86400;
      break;
    default:
      return std::nullopt;
  }
  const std::optional<uint64_t> count = ParseUnsigned(text.substr(0, text.size() - 1));
  if (!count) return std::nullopt;
  // Further back than the epoch: everything.
  if (*count > now_ns / kNsPerSecond / unit_s) return 0;
  return now_ns - *count * unit_s * kNsPerSecond;
}

std::optional<uint64_t> ParseSince(const std::string& text, uint64_t now_ns) {
  if (auto t = ParseLocalDate(text)) return t;
  return ParseAgo(text, now_ns);
}

double Fraction(uint64_t part, uint64_t whole) {
  return whole == 0 ? 0.0 : static_cast<double>(part) / static_cast<double>(whole);
}

std::string Percent(double fraction) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %%", 100.0 * fraction);
  return buf;
}

// When the pass's volume figures were taken: right after it ended.
uint64_t MeasuredAt(const PassRow& r) {
  return r.end_ns != 0 ? r.end_ns : r.start_ns;
}

// A pass that could not measure the volume (one that failed early) records
// no volume figures at all; it says nothing about savings.
bool MeasuredVolume(const PassRow& r) {
  return r.volume_logical_bytes != 0 || r.volume_physical_bytes != 0 || r.volume_saved_bytes != 0;
}

double DurationSeconds(const PassRow& r) {
  return r.end_ns > r.start_ns ? static_cast<double>(r.end_ns - r.start_ns) / 1e9 : 0.0;
}

struct Totals {
  uint64_t passes = 0;
  std::map<std::string, uint64_t> by_outcome;
  double seconds = 0;
  uint64_t records = 0;
  uint64_t blocks_shared_new = 0, blocks_shared_again = 0, zero_blocks_freed = 0;
  uint64_t bytes_reclaimed = 0;
  uint64_t merge_requests_posted = 0, merge_requests_applied = 0;
  uint64_t verification_failures = 0;
  uint64_t errors = 0;
  uint64_t cow_copies = 0;
  uint64_t io_bytes = 0;
};

Totals Sum(const std::vector<PassRow>& passes) {
  Totals t;
  for (const PassRow& r : passes) {
    t.passes++;
    t.by_outcome[r.outcome]++;
    t.seconds += DurationSeconds(r);
    t.records += r.records;
    t.blocks_shared_new += r.blocks_shared_new;
    t.blocks_shared_again += r.blocks_shared_again;
    t.zero_blocks_freed += r.zero_blocks_freed;
    t.bytes_reclaimed += r.bytes_reclaimed;
    t.merge_requests_posted += r.merge_requests_posted;
    t.merge_requests_applied += r.merge_requests_applied;
    t.verification_failures += r.verification_failures;
    t.errors += r.errors;
    t.cow_copies += r.cow_copies;
    t.io_bytes += r.io_bytes;
  }
  return t;
}

json TotalsJson(const Totals& t) {
  json j;
  j["passes"] = t.passes;
  j["by_outcome"] = json::object();
  for (const auto& [outcome, n] : t.by_outcome) j["by_outcome"][outcome] = n;
  j["seconds"] = t.seconds;
  j["records"] = t.records;
  j["blocks_shared_new"] = t.blocks_shared_new;
  j["blocks_shared_again"] = t.blocks_shared_again;
  j["blocks_shared"] = t.blocks_shared_new + t.blocks_shared_again;
  j["zero_blocks_freed"] = t.zero_blocks_freed;
  j["bytes_reclaimed"] = t.bytes_reclaimed;
  j["merge_requests_posted"] = t.merge_requests_posted;
  j["merge_requests_applied"] = t.merge_requests_applied;
  j["verification_failures"] = t.verification_failures;
  j["errors"] = t.errors;
  j["cow_copies"] = t.cow_copies;
  j["io_bytes"] = t.io_bytes;
  return j;
}

// The volume as one pass left it.
struct SavingsPoint {
  std::string day;  // local day the pass ended
  uint64_t at_ns = 0;
  uint64_t logical = 0, physical = 0, saved = 0;
  double fraction() const { return Fraction(saved, logical); }
};

SavingsPoint PointOf(const PassRow& r) {
  return {LocalDay(MeasuredAt(r)), MeasuredAt(r), r.volume_logical_bytes, r.volume_physical_bytes,
          r.volume_saved_bytes};
}

struct Savings {
  std::optional<SavingsPoint> first, last;
  std::vector<SavingsPoint> per_day;  // last pass of each local day, oldest day first
};

Savings SavingsOverTime(const std::vector<PassRow>& passes) {
  Savings s;
  // Passes come oldest first: a later one of the same day replaces the
  // earlier, and days are keyed "YYYY-MM-DD" so they sort in time order.
  std::map<std::string, SavingsPoint> by_day;
  for (const PassRow& r : passes) {
    if (!MeasuredVolume(r)) continue;
    SavingsPoint p = PointOf(r);
    if (!s.first) s.first = p;
    s.last = p;
    by_day[p.day] = p;
  }
  for (auto& [day, point] : by_day) s.per_day.push_back(std::move(point));
  return s;
}

json PointJson(const SavingsPoint& p, bool with_time) {
  json j;
  j["day"] = p.day;
  if (with_time) j["at_ns"] = p.at_ns;
  j["volume_logical_bytes"] = p.logical;
  j["volume_physical_bytes"] = p.physical;
  j["volume_saved_bytes"] = p.saved;
  j["saved_fraction"] = p.fraction();
  return j;
}

// Left-aligned text columns, right-aligned figures; two spaces between.
void PrintTable(const std::vector<std::vector<std::string>>& rows,
                const std::vector<bool>& right_aligned) {
  std::vector<size_t> width(right_aligned.size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size() && c < width.size(); c++) {
      width[c] = std::max(width[c], row[c].size());
    }
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size() && c < width.size(); c++) {
      const std::string pad(width[c] - row[c].size(), ' ');
      line += right_aligned[c] ? pad + row[c] : row[c] + pad;
      line += "  ";
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::cout << line << '\n';
  }
}

void PrintPasses(const std::vector<PassRow>& passes) {
  std::vector<std::vector<std::string>> rows;
  rows.push_back({"START", "DURATION", "TRIGGER", "WINDOW", "OUTCOME", "RECORDS", "SHARED", "AGAIN",
                  "RECLAIMED", "MERGES", "UNVERIFIED"});
  for (const PassRow& r : passes) {
    rows.push_back(
        {LocalDateTime(r.start_ns), HumanDuration(DurationSeconds(r)),
         r.trigger.empty() ? "-" : r.trigger, r.window.empty() ? "-" : r.window,
         r.outcome.empty() ? "-" : r.outcome, std::to_string(r.records),
         std::to_string(r.blocks_shared_new), std::to_string(r.blocks_shared_again),
         HumanSize(r.bytes_reclaimed),
         std::to_string(r.merge_requests_posted) + "/" + std::to_string(r.merge_requests_applied),
         std::to_string(r.verification_failures)});
  }
  PrintTable(rows, {false, true, false, false, false, true, true, true, true, true, true});
  std::cout << "(SHARED: blocks shared for the first time; AGAIN: blocks joining a share;\n"
               " MERGES: merge requests posted/applied; UNVERIFIED: records and requests\n"
               " that failed verification)\n";
}

// "3 completed, 1 stopped, 1 failed": the known outcomes in that order,
// then any other (a newer dedupd's) by name.
std::string OutcomeList(const std::map<std::string, uint64_t>& by_outcome) {
  static const char* const kKnown[] = {"completed", "stopped", "failed"};
  std::string s;
  auto add = [&](const std::string& outcome, uint64_t n) {
    if (!s.empty()) s += ", ";
    s += std::to_string(n) + " " + (outcome.empty() ? "unknown" : outcome);
  };
  for (const char* known : kKnown) {
    auto it = by_outcome.find(known);
    if (it != by_outcome.end()) add(it->first, it->second);
  }
  for (const auto& [outcome, n] : by_outcome) {
    if (std::find(std::begin(kKnown), std::end(kKnown), outcome) == std::end(kKnown)) {
      add(outcome, n);
    }
  }
  return s;
}

std::string SavedText(const SavingsPoint& p) {
  return HumanSize(p.saved) + " of " + HumanSize(p.logical) + " (" + Percent(p.fraction()) + ")";
}

void PrintSummary(const std::vector<PassRow>& passes, const Totals& t, const Savings& s) {
  auto line = [](const std::string& label, const std::string& value) {
    std::cout << "  " << label << std::string(label.size() < 22 ? 22 - label.size() : 1, ' ')
              << value << '\n';
  };
  std::cout << "\ntotals\n";
  line("passes", std::to_string(t.passes) + " (" + OutcomeList(t.by_outcome) + ") in " +
                     HumanDuration(t.seconds));
  line("reclaimed", HumanSize(t.bytes_reclaimed));
  line("blocks shared", std::to_string(t.blocks_shared_new + t.blocks_shared_again) + " (" +
                            std::to_string(t.blocks_shared_new) + " new, " +
                            std::to_string(t.blocks_shared_again) + " again)");
  line("zero blocks freed", std::to_string(t.zero_blocks_freed));
  line("merge requests", std::to_string(t.merge_requests_posted) + " posted, " +
                             std::to_string(t.merge_requests_applied) + " applied");
  line("verification failures", std::to_string(t.verification_failures));
  line("errors", std::to_string(t.errors));

  std::vector<const PassRow*> failed;
  for (const PassRow& r : passes) {
    if (r.outcome == "failed") failed.push_back(&r);
  }
  if (!failed.empty()) {
    std::cout << "\nfailed passes\n";
    for (const PassRow* r : failed) {
      std::cout << "  " << LocalDateTime(r->start_ns) << "  "
                << (r->error.empty() ? "(no message)" : r->error) << '\n';
    }
  }

  std::cout << "\nsavings over time (the volume after the pass: saved of logical)\n";
  if (!s.first) {
    std::cout << "  no pass in this range measured the volume\n";
    return;
  }
  line("after the first pass", LocalDateTime(s.first->at_ns) + "  " + SavedText(*s.first));
  line("after the last pass", LocalDateTime(s.last->at_ns) + "  " + SavedText(*s.last));
  for (const SavingsPoint& p : s.per_day) line(p.day, SavedText(p));
}

}  // namespace

int RunReport(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.options()("history", po::value<std::string>()->value_name("PATH"),
                   (std::string("the pass history database (default ") + kDefaultHistoryPath +
                    ", where dedupd keeps it)")
                       .c_str())(
      "since", po::value<std::string>()->value_name("DATE|DURATION"),
      "only passes started since a local date or time (2026-11-20, 2026-11-20T13:00) or for "
      "a duration back from now (90s, 30m, 12h, 7d, 2w)")(
      "last", po::value<std::string>()->value_name("N"), "only the N most recent of those passes")(
      "volume", po::value<std::string>()->value_name("UUID"),
      "only the passes of this volume (default: the volume of the most recent pass)")(
      "json", po::bool_switch(), "print the passes, totals and savings as JSON");
  parser.SetDetails(
      "Reads the local pass history that dedupd writes when each dedup pass ends\n"
      "(dedupd --history PATH) and prints one line per pass, oldest first, then\n"
      "totals and the volume's savings over time: saved bytes and the saved\n"
      "fraction of logical data after the first and the last pass shown, and after\n"
      "the last pass of each local day. Passes that did not measure the volume\n"
      "(one that failed early) are left out of the savings. Times are local.\n"
      "A history that holds passes of several volumes (dedupd instances sharing\n"
      "one file, a volume formatted again) is shown for one volume at a time.");
  if (auto rc = parser.Parse(args)) return *rc;

  const std::string path = parser.value("history").value_or(kDefaultHistoryPath);
  if (path.empty()) return UsageError(cmd, "--history must not be empty");
  uint64_t since_ns = 0;
  if (auto v = parser.value("since")) {
    std::optional<uint64_t> since = ParseSince(*v, Clock::Real()->NowNanos());
    if (!since) {
      return UsageError(cmd,
                        "--since must be a date (2026-11-20, 2026-11-20T13:00) or a "
                        "duration (12h, 7d), not '" +
                            *v + "'");
    }
    since_ns = *since;
  }
  size_t last = 0;
  if (auto v = parser.value("last")) {
    std::optional<uint64_t> n = ParseUnsigned(*v);
    if (!n || *n == 0 || *n > std::numeric_limits<uint32_t>::max()) {
      return UsageError(cmd, "--last must be a number of passes (1 or more), not '" + *v + "'");
    }
    last = static_cast<size_t>(*n);
  }

  Result<std::unique_ptr<PassHistory>> history = PassHistory::OpenReadOnly(path);
  if (!history.ok()) {
    if (history.status().code() == Status::Code::kNotFound) {
      return Fail(
          cmd, "no pass history at " + path + " (is dedupd running with --history " + path + "?)");
    }
    return Fail(cmd, history.status());
  }
  Result<std::vector<PassRow>> passes = (*history)->List(since_ns, 0);
  if (!passes.ok()) return Fail(cmd, passes.status());
  // One volume at a time: its savings over time mixed with another's
  // alternated between their figures.
  std::string volume = parser.value("volume").value_or("");
  if (volume.empty() && !passes->empty()) volume = passes->back().volume_uuid;
  std::set<std::string> other_volumes;
  std::vector<PassRow> kept;
  for (PassRow& r : *passes) {
    if (r.volume_uuid == volume) {
      kept.push_back(std::move(r));
    } else {
      other_volumes.insert(r.volume_uuid);
    }
  }
  if (last > 0 && kept.size() > last)
    kept.erase(kept.begin(), kept.end() - static_cast<ptrdiff_t>(last));
  *passes = std::move(kept);
  const Totals totals = Sum(*passes);
  const Savings savings = SavingsOverTime(*passes);

  if (parser.flag("json")) {
    json j;
    j["history"] = path;
    j["volume_uuid"] = volume;
    j["other_volumes"] = json::array();
    for (const std::string& v : other_volumes) j["other_volumes"].push_back(v);
    j["passes"] = json::array();
    for (const PassRow& r : *passes) j["passes"].push_back(PassRowToJson(r));
    j["totals"] = TotalsJson(totals);
    j["savings"] = json::array();
    for (const SavingsPoint& p : savings.per_day) j["savings"].push_back(PointJson(p, false));
    j["savings_after_first_pass"] = savings.first ? PointJson(*savings.first, true) : json();
    j["savings_after_last_pass"] = savings.last ? PointJson(*savings.last, true) : json();
    PrintJson(j);
    return kExitOk;
  }

  if (passes->empty()) {
    std::cout << "no dedup passes in " << path
              << (since_ns != 0 ? " since " + LocalDateTime(since_ns) : std::string()) << '\n';
    return kExitOk;
  }
  std::cout << path << ": " << passes->size() << (passes->size() == 1 ? " pass" : " passes")
            << (since_ns != 0 ? " since " + LocalDateTime(since_ns) : std::string())
            << (other_volumes.empty() ? "" : " of volume " + volume) << '\n';
  if (!other_volumes.empty()) {
    std::string others;
    for (const std::string& v : other_volumes) others += (others.empty() ? "" : ", ") + v;
    std::cout << "(it also holds passes of " << others << ": --volume UUID shows them)\n";
  }
  std::cout << '\n';
  PrintPasses(*passes);
  PrintSummary(*passes, totals, savings);
  return kExitOk;
}

}  // namespace dede::cli
