// `dede report`, run as a real process against pass history databases
// built with PassHistory: every figure of the JSON form, the savings per
// local day (under two time zones), --since and --last, the human form,
// and the exit codes (1 with one stderr line, 2 for usage errors).
#include <catch2/catch.hpp>
#include <cstdint>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "agent/pass_history.h"
#include "tests/integration/rig.h"
#include "util/clock.h"

namespace dede {
namespace {

using json = nlohmann::json;
using test::BinaryPath;
using test::DescribeRun;
using test::ProcessResult;
using test::RunProcess;
using test::TempDir;

constexpr uint64_t kNs = 1'000'000'000;
constexpr uint64_t kGiB = uint64_t{1} << 30;

// Runs dede with TZ set (POSIX rules, so no zoneinfo files are needed):
// the report's local days and --since dates depend on it.
ProcessResult Dede(std::vector<std::string> args, const std::string& tz = "UTC0") {
  args.insert(args.begin(), BinaryPath("dede"));
  return RunProcess(args, {"TZ=" + tz}, 60);
}

size_t LineCount(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += c == '\n';
  if (!s.empty() && s.back() != '\n') n++;
  return n;
}

json ReportJson(const std::vector<std::string>& extra, const std::string& tz = "UTC0") {
  std::vector<std::string> args = {"report", "--json"};
  args.insert(args.end(), extra.begin(), extra.end());
  ProcessResult r = Dede(args, tz);
  INFO(DescribeRun(args, r));
  REQUIRE(r.exit_code == 0);
  json j;
  REQUIRE_NOTHROW(j = json::parse(r.out));
  return j;
}

uint64_t UtcNs(int year, int month, int day, int hour, int minute, int second = 0) {
  struct tm tm {};
  tm.tm_year = year - 1900;
  tm.tm_mon = month - 1;
  tm.tm_mday = day;
  tm.tm_hour = hour;
  tm.tm_min = minute;
  tm.tm_sec = second;
  return static_cast<uint64_t>(timegm(&tm)) * kNs;
}

PassRow Pass(uint64_t start_ns, uint64_t seconds, const std::string& trigger,
             const std::string& window, const std::string& outcome, uint64_t seed) {
  PassRow r;
  r.start_ns = start_ns;
  r.end_ns = start_ns + seconds * kNs;
  r.host_id = 2;
  r.volume_uuid = "0b7c9d2e-4f1a-4c3b-9e8d-7a6b5c4d3e2f";
  r.trigger = trigger;
  r.window = window;
  r.outcome = outcome;
  r.records = 10000 * seed;
  r.entries_scanned = 20000 * seed;
  r.shards_rewritten = seed;
  r.blocks_shared_new = 100 * seed;
  r.blocks_shared_again = 10 * seed;
  r.zero_blocks_freed = 5 * seed;
  r.merge_requests_posted = 3 * seed;
  r.merge_requests_applied = 2 * seed;
  r.bytes_reclaimed = 4096 * (r.blocks_shared_new + r.blocks_shared_again + r.zero_blocks_freed +
                              r.merge_requests_applied);
  r.verification_failures = seed % 2;
  r.cow_copies = 7 * seed;
  r.io_bytes = 1000000 * seed;
  return r;
}

void SetVolume(PassRow* r, uint64_t logical, uint64_t saved) {
  r->volume_logical_bytes = logical;
  r->volume_saved_bytes = saved;
  r->volume_physical_bytes = logical - saved;
}

// Four passes over two UTC days (2026-11-20 and 21); the third failed
// before it could measure the volume.
std::vector<PassRow> TwoDays() {
  std::vector<PassRow> rows;
  rows.push_back(
      Pass(UtcNs(2026, 11, 20, 1, 0), 600, "window", "mon-fri 01:00-05:00", "completed", 1));
  SetVolume(&rows.back(), 4 * kGiB, 1 * kGiB);
  // 16:00 UTC: still the 20th in UTC, already the 21st in Japan (UTC+9).
  rows.push_back(Pass(UtcNs(2026, 11, 20, 16, 0), 90, "now", "", "stopped", 2));
  SetVolume(&rows.back(), 4 * kGiB, 3 * kGiB / 2);
  rows.push_back(Pass(UtcNs(2026, 11, 21, 1, 0), 5, "window", "mon-fri 01:00-05:00", "failed", 3));
  rows.back().error = "volume: reading block 77: I/O error";
  rows.back().errors = 1;
  rows.push_back(Pass(UtcNs(2026, 11, 21, 2, 0), 1200, "signal", "", "completed", 4));
  SetVolume(&rows.back(), 5 * kGiB, 5 * kGiB / 2);
  return rows;
}

std::vector<PassRow> WriteHistory(const std::string& path, std::vector<PassRow> rows) {
  auto history = PassHistory::Open(path, /*create=*/true);
  INFO(history.status().ToString());
  REQUIRE(history.ok());
  for (PassRow& r : rows) {
    auto id = (*history)->Record(r);
    REQUIRE(id.ok());
    r.id = *id;
  }
  return rows;
}

void CheckSavingsDay(const json& s, const std::string& day, uint64_t logical, uint64_t saved) {
  INFO(s.dump());
  CHECK(s.at("day") == day);
  CHECK(s.at("volume_logical_bytes").get<uint64_t>() == logical);
  CHECK(s.at("volume_saved_bytes").get<uint64_t>() == saved);
  CHECK(s.at("saved_fraction").get<double>() ==
        Approx(static_cast<double>(saved) / static_cast<double>(logical)));
}

TEST_CASE("dede report --json shows every pass totals and savings per day", "[report]") {
  TempDir dir;
  const std::string path = dir.file("history.db");
  const std::vector<PassRow> rows = WriteHistory(path, TwoDays());

  const json j = ReportJson({"--history", path});
  CHECK(j.at("history") == path);
  const json& passes = j.at("passes");
  REQUIRE(passes.size() == rows.size());
  for (size_t i = 0; i < rows.size(); i++) {
    INFO("pass " << i);
    CHECK(passes[i] == PassRowToJson(rows[i]));
  }

  const json& t = j.at("totals");
  INFO(t.dump());
  CHECK(t.at("passes") == 4);
  CHECK(t.at("by_outcome") == json{{"completed", 2}, {"stopped", 1}, {"failed", 1}});
  uint64_t reclaimed = 0, shared_new = 0, shared_again = 0, records = 0, posted = 0, applied = 0;
  uint64_t zero = 0, verify = 0, errors = 0;
  for (const PassRow& r : rows) {
    reclaimed += r.bytes_reclaimed;
    shared_new += r.blocks_shared_new;
    shared_again += r.blocks_shared_again;
    records += r.records;
    posted += r.merge_requests_posted;
    applied += r.merge_requests_applied;
    zero += r.zero_blocks_freed;
    verify += r.verification_failures;
    errors += r.errors;
  }
  CHECK(t.at("bytes_reclaimed").get<uint64_t>() == reclaimed);
  CHECK(t.at("blocks_shared_new").get<uint64_t>() == shared_new);
  CHECK(t.at("blocks_shared_again").get<uint64_t>() == shared_again);
  CHECK(t.at("blocks_shared").get<uint64_t>() == shared_new + shared_again);
  CHECK(t.at("records").get<uint64_t>() == records);
  CHECK(t.at("merge_requests_posted").get<uint64_t>() == posted);
  CHECK(t.at("merge_requests_applied").get<uint64_t>() == applied);
  CHECK(t.at("zero_blocks_freed").get<uint64_t>() == zero);
  CHECK(t.at("verification_failures").get<uint64_t>() == verify);
  CHECK(t.at("errors").get<uint64_t>() == errors);
  CHECK(t.at("seconds").get<double>() == Approx(600 + 90 + 5 + 1200));

  // The last measured pass of each UTC day; the failed pass measured nothing.
  const json& savings = j.at("savings");
  REQUIRE(savings.size() == 2);
  CheckSavingsDay(savings[0], "2026-11-20", 4 * kGiB, 3 * kGiB / 2);
  CheckSavingsDay(savings[1], "2026-11-21", 5 * kGiB, 5 * kGiB / 2);
  CheckSavingsDay(j.at("savings_after_first_pass"), "2026-11-20", 4 * kGiB, 1 * kGiB);
  CheckSavingsDay(j.at("savings_after_last_pass"), "2026-11-21", 5 * kGiB, 5 * kGiB / 2);
  CHECK(j.at("savings_after_last_pass").at("at_ns").get<uint64_t>() == rows[3].end_ns);

  // Days are local: in Japan (UTC+9) the second pass ended on the 21st.
  const json jst = ReportJson({"--history", path}, "JST-9");
  REQUIRE(jst.at("savings").size() == 2);
  CheckSavingsDay(jst.at("savings")[0], "2026-11-20", 4 * kGiB, 1 * kGiB);
  CheckSavingsDay(jst.at("savings")[1], "2026-11-21", 5 * kGiB, 5 * kGiB / 2);
}

TEST_CASE("dede report --since and --last select passes", "[report]") {
  TempDir dir;
  const std::string path = dir.file("history.db");
  const std::vector<PassRow> rows = WriteHistory(path, TwoDays());
  auto ids = [](const json& j) {
    std::vector<int64_t> out;
    for (const json& p : j.at("passes")) out.push_back(p.at("id").get<int64_t>());
    return out;
  };

  // Local dates: midnight of the 21st in UTC, or 13:00 on the 20th.
  CHECK(ids(ReportJson({"--history", path, "--since", "2026-11-21"})) ==
        std::vector<int64_t>{rows[2].id, rows[3].id});
  CHECK(ids(ReportJson({"--history", path, "--since", "2026-11-20T13:00"})) ==
        std::vector<int64_t>{rows[1].id, rows[2].id, rows[3].id});
  // In UTC+9, 2026-11-21 starts at 15:00 UTC on the 20th.
  CHECK(ids(ReportJson({"--history", path, "--since", "2026-11-21"}, "JST-9")) ==
        std::vector<int64_t>{rows[1].id, rows[2].id, rows[3].id});
  CHECK(ids(ReportJson({"--history", path, "--last", "2"})) ==
        std::vector<int64_t>{rows[2].id, rows[3].id});
  const json last_one = ReportJson({"--history", path, "--since", "2026-11-20", "--last", "1"});
  CHECK(ids(last_one) == std::vector<int64_t>{rows[3].id});
  CHECK(last_one.at("totals").at("passes") == 1);
  REQUIRE(last_one.at("savings").size() == 1);
  CheckSavingsDay(last_one.at("savings")[0], "2026-11-21", 5 * kGiB, 5 * kGiB / 2);

  const json none = ReportJson({"--history", path, "--since", "2026-12-01"});
  CHECK(none.at("passes").empty());
  CHECK(none.at("savings").empty());
  CHECK(none.at("totals").at("passes") == 0);
  CHECK(none.at("savings_after_first_pass").is_null());

  // Durations count back from now.
  const std::string recent_path = dir.file("recent.db");
  const uint64_t now = Clock::Real()->NowNanos();
  std::vector<PassRow> recent = {
      Pass(now - 3 * 86400 * kNs, 60, "interval", "", "completed", 1),
      Pass(now - 2 * 3600 * kNs, 60, "interval", "", "completed", 2),
  };
  recent = WriteHistory(recent_path, recent);
  CHECK(ids(ReportJson({"--history", recent_path, "--since", "1d"})) ==
        std::vector<int64_t>{recent[1].id});
  CHECK(ids(ReportJson({"--history", recent_path, "--since", "12h"})) ==
        std::vector<int64_t>{recent[1].id});
  CHECK(ids(ReportJson({"--history", recent_path, "--since", "7d"})) ==
        std::vector<int64_t>{recent[0].id, recent[1].id});
  CHECK(ReportJson({"--history", recent_path, "--since", "1h"}).at("passes").empty());
}

TEST_CASE("dede report shows one volume of a history that holds several", "[report]") {
  // Two dedupd instances on one history file (dedupd@ instances left on
  // the default), or a volume formatted again: the savings over time
  // alternated between the volumes' figures.
  TempDir dir;
  const std::string path = dir.file("history.db");
  std::vector<PassRow> mixed = TwoDays();
  const std::string other = "11111111-2222-4333-8444-555555555555";
  mixed[0].volume_uuid = other;
  mixed[2].volume_uuid = other;
  SetVolume(&mixed[0], 100 * kGiB, 1 * kGiB);
  mixed = WriteHistory(path, mixed);
  auto ids = [](const json& j) {
    std::vector<int64_t> out;
    for (const json& p : j.at("passes")) out.push_back(p.at("id").get<int64_t>());
    return out;
  };
  // By default the volume of the most recent pass.
  const json latest = ReportJson({"--history", path});
  CHECK(latest.at("volume_uuid") == mixed[3].volume_uuid);
  CHECK(latest.at("other_volumes") == json::array({other}));
  CHECK(ids(latest) == std::vector<int64_t>{mixed[1].id, mixed[3].id});
  CHECK(latest.at("totals").at("passes") == 2);
  CHECK(latest.at("savings_after_first_pass").at("volume_logical_bytes") == 4 * kGiB);
  const json picked = ReportJson({"--history", path, "--volume", other});
  CHECK(ids(picked) == std::vector<int64_t>{mixed[0].id, mixed[2].id});
  CHECK(ReportJson({"--history", path, "--volume", other, "--last", "1"}).at("passes").size() == 1);
  const ProcessResult r = Dede({"report", "--history", path});
  REQUIRE(r.exit_code == 0);
  const std::string& text = r.out;
  CHECK(text.find("2 passes of volume " + mixed[3].volume_uuid) != std::string::npos);
  CHECK(text.find("--volume UUID") != std::string::npos);
}

TEST_CASE("dede report prints the passes totals and savings for people", "[report]") {
  TempDir dir;
  const std::string path = dir.file("history.db");
  WriteHistory(path, TwoDays());
  const std::vector<std::string> args = {"report", "--history", path};
  ProcessResult r = Dede(args);
  INFO(DescribeRun(args, r));
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.empty());
  for (const char* expected :
       {"4 passes", "2026-11-20 01:00:00", "10 min 00 s", "mon-fri 01:00-05:00",
        "2026-11-20 16:00:00", "stopped", "2026-11-21 01:00:00", "failed", "2026-11-21 02:00:00",
        "signal", "totals", "2 completed, 1 stopped, 1 failed",
        "volume: reading block 77: I/O error", "savings over time", "1.0 GiB of 4.0 GiB (25.0 %)",
        "1.5 GiB of 4.0 GiB (37.5 %)", "2.5 GiB of 5.0 GiB (50.0 %)"}) {
    INFO("expected: " << expected);
    CHECK(r.out.find(expected) != std::string::npos);
  }
  // A header, then one line per pass in start order.
  const size_t first = r.out.find("2026-11-20 01:00:00");
  const size_t second = r.out.find("2026-11-20 16:00:00");
  const size_t fourth = r.out.find("2026-11-21 02:00:00");
  CHECK(first < second);
  CHECK(second < fourth);
  CHECK(r.out.find("START") < first);

  // An empty range says so.
  const std::vector<std::string> empty_args = {"report", "--history", path, "--since",
                                               "2026-12-01"};
  ProcessResult empty = Dede(empty_args);
  INFO(DescribeRun(empty_args, empty));
  CHECK(empty.exit_code == 0);
  CHECK(empty.out.find("no dedup passes") != std::string::npos);
}

TEST_CASE("dede report fails on a missing or damaged history", "[report]") {
  TempDir dir;
  const std::string missing = dir.file("nothing-here.db");
  for (const bool as_json : {false, true}) {
    std::vector<std::string> args = {"report", "--history", missing};
    if (as_json) args.push_back("--json");
    ProcessResult r = Dede(args);
    INFO(DescribeRun(args, r));
    CHECK(r.signal == 0);
    CHECK(r.exit_code == 1);
    CHECK(r.out.empty());
    CHECK(LineCount(r.err) == 1);
    CHECK(r.err.find("no pass history at " + missing) != std::string::npos);
    CHECK(r.err.find("--history " + missing) != std::string::npos);
  }

  const std::string garbage = dir.file("garbage.db");
  {
    std::ofstream out(garbage, std::ios::binary);
    for (int i = 0; i < 8192; i++) out.put(static_cast<char>(i * 37 + 11));
  }
  const std::vector<std::string> args = {"report", "--history", garbage};
  ProcessResult r = Dede(args);
  INFO(DescribeRun(args, r));
  CHECK(r.signal == 0);
  CHECK(r.exit_code == 1);
  CHECK(LineCount(r.err) == 1);
  CHECK(r.err.find(garbage) != std::string::npos);
}

TEST_CASE("dede report rejects a bad --since or --last as usage errors", "[report]") {
  TempDir dir;
  const std::string path = dir.file("history.db");
  WriteHistory(path, TwoDays());
  const std::vector<std::vector<std::string>> bad = {
      {"--since", "yesterday"},  {"--since", "2026-13-01"},
      {"--since", "2026-02-30"}, {"--since", "2026-11-20T25:00"},
      {"--since", "20261120"},   {"--since", "7x"},
      {"--since", "d"},          {"--since", "-7d"},
      {"--since", ""},           {"--last", "0"},
      {"--last", "two"},         {"--bogus"},
      {"extra-argument"},
  };
  for (const auto& extra : bad) {
    std::vector<std::string> args = {"report", "--history", path};
    args.insert(args.end(), extra.begin(), extra.end());
    ProcessResult r = Dede(args);
    INFO(DescribeRun(args, r));
    CHECK(r.signal == 0);
    CHECK(r.exit_code == 2);
    CHECK(r.out.empty());
    CHECK(r.err.rfind("dede: report: ", 0) == 0);
    CHECK(r.err.find("usage: dede report") != std::string::npos);
  }
}

// dedupd's history is root's, in a directory only root may write; `dede
// report` is for any user who may read it. It used to open the database
// read-write and fail for such a user ("attempt to write a readonly
// database": reading a WAL database needs its shared-memory file), and
// could switch the journal mode or migrate the schema of a file it was
// only asked to read.
TEST_CASE("dede report reads a history its user may not write", "[report]") {
  TempDir dir;
  // Another user must reach the history and a dede (the build tree may sit
  // under a private home): the temporary directory opened up for reading,
  // a copy of dede in it.
  std::filesystem::permissions(dir.path(), std::filesystem::perms(0755));
  const std::string dede = dir.file("dede");
  std::filesystem::copy_file(BinaryPath("dede"), dede);
  std::filesystem::permissions(dede, std::filesystem::perms(0755));
  // A name SQLite must be given escaped in a URI (the immutable reading).
  const std::string path = dir.file("history %3F?#.db");
  const std::vector<PassRow> rows = TwoDays();

  auto as_nobody = [&] {
    const std::vector<std::string> args = {
        "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
        dede,      "report",        "--json",        "--history",
        path};
    ProcessResult r = RunProcess(args, {"TZ=UTC0"}, 60);
    INFO(DescribeRun(args, r));
    REQUIRE(r.exit_code == 0);
    json j;
    REQUIRE_NOTHROW(j = json::parse(r.out));
    return j.at("passes").size();
  };

  auto writer = PassHistory::Open(path, /*create=*/true);
  REQUIRE(writer.ok());
  for (size_t i = 0; i < 2; i++) REQUIRE((*writer)->Record(rows[i]).ok());
  {
    // While the writer has it open, its last passes only in the WAL.
    INFO("writer open");
    REQUIRE(std::filesystem::exists(path + "-wal"));
    REQUIRE(std::filesystem::exists(path + "-shm"));
    CHECK(as_nobody() == 2);
    REQUIRE((*writer)->Record(rows[2]).ok());
    CHECK(as_nobody() == 3);
  }
  REQUIRE((*writer)->Record(rows[3]).ok());
  writer = Status::Invalid("closed");  // the last connection checkpoints and removes the WAL
  {
    INFO("no writer");
    REQUIRE_FALSE(std::filesystem::exists(path + "-wal"));
    const auto size = std::filesystem::file_size(path);
    const auto mtime = std::filesystem::last_write_time(path);
    CHECK(as_nobody() == 4);
    CHECK(std::filesystem::file_size(path) == size);
    CHECK(std::filesystem::last_write_time(path) == mtime);
    CHECK_FALSE(std::filesystem::exists(path + "-wal"));
  }
}

}  // namespace
}  // namespace dede
