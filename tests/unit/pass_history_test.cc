// PassHistory: the SQLite pass history dedupd writes and `dede report`
// reads. Round trips of every field, since/limit filtering, reopening,
// schema versions, damaged files, and concurrent writers.
#include "agent/pass_history.h"

#include <sqlite3.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace dede {
namespace {

// A fresh directory, removed with everything in it at the end of the test.
class ScratchDir {
 public:
  ScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        std::string(tmp != nullptr && tmp[0] != '\0' ? tmp : "/tmp") + "/dede-pass-history-XXXXXX";
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A row with every field set, distinct per `n`.
PassRow SampleRow(uint64_t n) {
  PassRow r;
  r.start_ns = 1'790'000'000'000'000'000ull + n * 3'600'000'000'000ull;
  r.end_ns = r.start_ns + 12'345'678'901ull;
  r.host_id = static_cast<uint32_t>(3 + n);
  r.volume_uuid = "6f1c2a3e-0000-4000-8000-00000000000" + std::to_string(n % 10);
  r.trigger = n % 2 == 0 ? "window" : "interval";
  r.window = n % 2 == 0 ? "mon-fri 01:00-05:00" : "";
  r.outcome = n % 3 == 2 ? "failed" : "completed";
  r.error = n % 3 == 2 ? "volume: read at block 42: I/O error" : "";
  r.records = 1000 + n;
  r.entries_scanned = 2000 + n;
  r.shards_rewritten = 3 + n;
  r.blocks_shared_new = 400 + n;
  r.blocks_shared_again = 500 + n;
  r.zero_blocks_freed = 60 + n;
  r.merge_requests_posted = 7 + n;
  r.merge_requests_applied = 8 + n;
  r.bytes_reclaimed = 4096 * (r.blocks_shared_new + r.blocks_shared_again + r.zero_blocks_freed +
                              r.merge_requests_applied);
  r.verification_failures = 9 + n;
  r.errors = n % 3 == 2 ? 1 : 0;
  r.cow_copies = 11 + n;
  r.io_bytes = (uint64_t{1} << 30) + n;
  r.volume_logical_bytes = (uint64_t{4} << 30) + n;
  r.volume_physical_bytes = (uint64_t{3} << 30) - n;
  r.volume_saved_bytes = r.volume_logical_bytes - r.volume_physical_bytes;
  return r;
}

std::unique_ptr<PassHistory> OpenOk(const std::string& path, bool create) {
  auto h = PassHistory::Open(path, create);
  INFO(h.status().ToString());
  REQUIRE(h.ok());
  return std::move(h).value();
}

std::vector<PassRow> ListOk(PassHistory* h, uint64_t since_ns = 0, size_t limit = 0) {
  auto rows = h->List(since_ns, limit);
  INFO(rows.status().ToString());
  REQUIRE(rows.ok());
  return std::move(rows).value();
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

// Sets the file's PRAGMA user_version behind PassHistory's back.
void SetUserVersion(const std::string& path, int version) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  const std::string sql = "PRAGMA user_version = " + std::to_string(version);
  const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr);
  sqlite3_close(db);
  REQUIRE(rc == SQLITE_OK);
}

TEST_CASE("pass history records and lists every field", "[history]") {
  ScratchDir dir;
  const std::string path = dir.file("sub/dir/history.db");  // parents created
  auto h = OpenOk(path, /*create=*/true);
  CHECK(std::filesystem::exists(path));

  std::vector<PassRow> written;
  for (uint64_t n = 0; n < 5; n++) {
    PassRow row = SampleRow(n);
    row.id = 999;  // ignored: Record assigns ids
    auto id = h->Record(row);
    REQUIRE(id.ok());
    row.id = *id;
    written.push_back(row);
  }
  CHECK(written[0].id != written[1].id);

  // Counters beyond 63 bits come back exactly.
  PassRow huge = SampleRow(5);
  huge.bytes_reclaimed = std::numeric_limits<uint64_t>::max();
  huge.io_bytes = (uint64_t{1} << 63) + 5;
  huge.host_id = std::numeric_limits<uint32_t>::max();
  huge.error = std::string("quote ' and \" and a NUL \0 inside", 33);
  auto huge_id = h->Record(huge);
  REQUIRE(huge_id.ok());
  huge.id = *huge_id;
  written.push_back(huge);

  const std::vector<PassRow> listed = ListOk(h.get());
  REQUIRE(listed.size() == written.size());
  for (size_t i = 0; i < listed.size(); i++) {
    INFO("row " << i);
    CHECK(listed[i] == written[i]);
  }

  // The JSON form names every field as PassRow does.
  const nlohmann::json j = PassRowToJson(written[2]);
  CHECK(j.at("id") == written[2].id);
  CHECK(j.at("start_ns") == written[2].start_ns);
  CHECK(j.at("trigger") == "window");
  CHECK(j.at("window") == "mon-fri 01:00-05:00");
  CHECK(j.at("outcome") == "failed");
  CHECK(j.at("error") == written[2].error);
  CHECK(j.at("blocks_shared_again") == written[2].blocks_shared_again);
  CHECK(j.at("volume_saved_bytes") == written[2].volume_saved_bytes);
  CHECK(PassRowToJson(huge).at("bytes_reclaimed").get<uint64_t>() ==
        std::numeric_limits<uint64_t>::max());
  CHECK(j.size() == 25);

  // Pass times must stay in SQLite's signed range (ordering and --since
  // compare them as numbers).
  PassRow bad_time = SampleRow(0);
  bad_time.end_ns = uint64_t{1} << 63;
  CHECK(h->Record(bad_time).status().code() == Status::Code::kInvalid);
}

TEST_CASE("pass history filters by start time and keeps the newest under a limit", "[history]") {
  ScratchDir dir;
  auto h = OpenOk(dir.file("history.db"), true);
  CHECK(ListOk(h.get()).empty());
  // Recorded out of order: List sorts by start time.
  for (uint64_t n : {3, 0, 4, 1, 2}) REQUIRE(h->Record(SampleRow(n)).ok());

  auto starts = [](const std::vector<PassRow>& rows) {
    std::vector<uint64_t> s;
    for (const PassRow& r : rows) s.push_back(r.start_ns);
    return s;
  };
  const uint64_t t0 = SampleRow(0).start_ns, t2 = SampleRow(2).start_ns;
  const uint64_t t3 = SampleRow(3).start_ns, t4 = SampleRow(4).start_ns;
  const uint64_t t1 = SampleRow(1).start_ns;

  CHECK(starts(ListOk(h.get())) == std::vector<uint64_t>{t0, t1, t2, t3, t4});
  CHECK(starts(ListOk(h.get(), t2)) == std::vector<uint64_t>{t2, t3, t4});  // inclusive
  CHECK(starts(ListOk(h.get(), t2 + 1)) == std::vector<uint64_t>{t3, t4});
  CHECK(starts(ListOk(h.get(), 0, 2)) == std::vector<uint64_t>{t3, t4});  // newest two
  CHECK(starts(ListOk(h.get(), t1, 10)) == std::vector<uint64_t>{t1, t2, t3, t4});
  CHECK(starts(ListOk(h.get(), t1, 1)) == std::vector<uint64_t>{t4});
  CHECK(ListOk(h.get(), t4 + 1).empty());
  CHECK(ListOk(h.get(), std::numeric_limits<uint64_t>::max()).empty());
}

TEST_CASE("pass history survives reopening", "[history]") {
  ScratchDir dir;
  const std::string path = dir.file("history.db");
  {
    auto h = OpenOk(path, true);
    REQUIRE(h->Record(SampleRow(0)).ok());
    REQUIRE(h->Record(SampleRow(1)).ok());
  }
  // A reader (dede report) opens without create; a second writer with it.
  auto reader = OpenOk(path, false);
  auto writer = OpenOk(path, true);
  REQUIRE(writer->Record(SampleRow(2)).ok());
  const auto rows = ListOk(reader.get());
  REQUIRE(rows.size() == 3);
  PassRow expected = SampleRow(2);
  expected.id = rows[2].id;
  CHECK(rows[2] == expected);
  CHECK(rows[0].id < rows[1].id);
  CHECK(rows[1].id < rows[2].id);

  // WAL mode, so `dede report` reads while dedupd writes.
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  REQUIRE(sqlite3_prepare_v2(db, "PRAGMA journal_mode", -1, &stmt, nullptr) == SQLITE_OK);
  REQUIRE(sqlite3_step(stmt) == SQLITE_ROW);
  CHECK(std::string(reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0))) == "wal");
  sqlite3_finalize(stmt);
  sqlite3_close(db);
}

TEST_CASE("pass history without create refuses a missing file", "[history]") {
  ScratchDir dir;
  const std::string path = dir.file("missing.db");
  auto h = PassHistory::Open(path, /*create=*/false);
  CHECK(h.status().code() == Status::Code::kNotFound);
  CHECK(h.status().message().find(path) != std::string::npos);
  auto ro = PassHistory::OpenReadOnly(path);
  CHECK(ro.status().code() == Status::Code::kNotFound);
  CHECK_FALSE(std::filesystem::exists(path));
}

TEST_CASE("pass history refuses a newer schema version", "[history]") {
  ScratchDir dir;
  const std::string path = dir.file("history.db");
  {
    auto h = OpenOk(path, true);
    REQUIRE(h->Record(SampleRow(0)).ok());
  }
  SetUserVersion(path, PassHistory::kSchemaVersion + 1);
  for (bool create : {false, true}) {
    auto h = PassHistory::Open(path, create);
    INFO(h.status().ToString());
    CHECK(h.status().code() == Status::Code::kUnsupported);
    CHECK(h.status().message().find(path) != std::string::npos);
  }
  auto ro = PassHistory::OpenReadOnly(path);
  INFO(ro.status().ToString());
  CHECK(ro.status().code() == Status::Code::kUnsupported);
  CHECK(ro.status().message().find("newer") != std::string::npos);
}

TEST_CASE("pass history migrates an empty database of version 0", "[history]") {
  ScratchDir dir;
  const std::string path = dir.file("history.db");
  WriteFile(path, "");  // an empty file is an SQLite database of version 0
  // A reader only says so: the schema is dedupd's to migrate.
  auto ro = PassHistory::OpenReadOnly(path);
  INFO(ro.status().ToString());
  CHECK(ro.status().code() == Status::Code::kUnsupported);
  CHECK(ro.status().message().find("older") != std::string::npos);
  CHECK(std::filesystem::file_size(path) == 0);

  auto h = OpenOk(path, false);
  REQUIRE(h->Record(SampleRow(1)).ok());
  CHECK(ListOk(h.get()).size() == 1);
}

TEST_CASE("pass history opened read-only lists and never writes", "[history]") {
  ScratchDir dir;
  const std::string path = dir.file("history.db");
  auto writer = OpenOk(path, true);
  REQUIRE(writer->Record(SampleRow(0)).ok());
  auto ro = PassHistory::OpenReadOnly(path);
  INFO(ro.status().ToString());
  REQUIRE(ro.ok());
  CHECK(ListOk(ro.value().get()).size() == 1);
  REQUIRE(writer->Record(SampleRow(1)).ok());
  CHECK(ListOk(ro.value().get()).size() == 2);  // the writer's WAL, read
  CHECK((*ro)->Record(SampleRow(2)).status().code() != Status::Code::kOk);
  CHECK(ListOk(writer.get()).size() == 2);

  // With no writer (no WAL file). (As root the shared-memory file can be
  // made, so the immutable reading that other users get is shown by
  // report_cli_test.)
  const std::string odd = dir.file("h%3F?#x.db");
  {
    auto w = OpenOk(odd, true);
    REQUIRE(w->Record(SampleRow(3)).ok());
  }
  REQUIRE_FALSE(std::filesystem::exists(odd + "-wal"));
  auto ro2 = PassHistory::OpenReadOnly(odd);
  INFO(ro2.status().ToString());
  REQUIRE(ro2.ok());
  CHECK(ListOk(ro2.value().get()).size() == 1);
}

TEST_CASE("pass history reports a garbage file as corruption", "[history]") {
  ScratchDir dir;
  const std::string path = dir.file("history.db");
  std::string garbage(8192, '\0');
  for (size_t i = 0; i < garbage.size(); i++) garbage[i] = static_cast<char>(i * 131 + 7);
  WriteFile(path, garbage);
  for (bool create : {false, true}) {
    auto h = PassHistory::Open(path, create);
    INFO(h.status().ToString());
    CHECK(h.status().code() == Status::Code::kCorruption);
    CHECK(h.status().message().find(path) != std::string::npos);
  }
  // A short text file is no database either.
  WriteFile(path, "not a database\n");
  CHECK(PassHistory::Open(path, false).status().code() == Status::Code::kCorruption);
  CHECK(PassHistory::OpenReadOnly(path).status().code() == Status::Code::kCorruption);
}

TEST_CASE("pass history takes records from 4 threads at once", "[history]") {
  ScratchDir dir;
  auto h = OpenOk(dir.file("history.db"), true);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 50;
  std::vector<std::vector<int64_t>> ids(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; t++) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; i++) {
        PassRow row = SampleRow(static_cast<uint64_t>(t * kPerThread + i));
        row.host_id = static_cast<uint32_t>(t);
        auto id = h->Record(row);
        ids[t].push_back(id.ok() ? *id : -1);
      }
    });
  }
  for (auto& th : threads) th.join();

  std::set<int64_t> distinct;
  for (const auto& per_thread : ids) {
    for (int64_t id : per_thread) {
      CHECK(id > 0);
      distinct.insert(id);
    }
  }
  CHECK(distinct.size() == size_t{kThreads * kPerThread});
  const auto rows = ListOk(h.get());
  REQUIRE(rows.size() == size_t{kThreads * kPerThread});
  std::vector<int> per_host(kThreads, 0);
  for (const PassRow& r : rows) {
    REQUIRE(r.host_id < kThreads);
    per_host[r.host_id]++;
    CHECK(distinct.count(r.id) == 1);
  }
  for (int t = 0; t < kThreads; t++) CHECK(per_host[t] == kPerThread);
}

}  // namespace
}  // namespace dede
