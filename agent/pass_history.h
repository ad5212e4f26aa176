// PassHistory: a host's dedup passes, kept in a local SQLite database so
// that `dede report` can show what dedup did and how the volume's savings
// moved over days and weeks. dedupd records one row when a pass ends;
// `dede report` reads the same file while dedupd keeps writing (WAL mode,
// so a reader never blocks the writer).
//
// The history is per host and local on purpose: it describes this host's
// passes, and nothing on the shared volume depends on it (losing it loses
// only the report).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "util/mutex.h"
#include "util/status.h"

struct sqlite3;  // <sqlite3.h> stays out of the header

namespace dede {

// Where dedupd keeps its pass history and `dede report` looks for it.
inline constexpr const char* kDefaultHistoryPath = "/var/lib/dede/history.db";

// One dedup pass of one host, as recorded by dedupd when the pass ends.
struct PassRow {
  int64_t id = 0;                     // assigned by Record
  uint64_t start_ns = 0, end_ns = 0;  // wall clock, epoch ns
  uint32_t host_id = 0;
  std::string volume_uuid;  // text form
  // "window", "interval", "signal", "now" (dede dedup --now), "manual"
  std::string trigger;
  // The window it ran in, e.g. "mon-fri 01:00-05:00"; "" outside windows.
  std::string window;
  // "completed", "stopped" (window ended or shutdown; resumes later), "failed"
  std::string outcome;
  std::string error;  // message when failed
  uint64_t records = 0, entries_scanned = 0, shards_rewritten = 0;
  uint64_t blocks_shared_new = 0, blocks_shared_again = 0, zero_blocks_freed = 0;
  // 4 KiB x DedupStats::blocks_released() (not a sum of the columns here:
  // blocks_shared_new also counts entries whose indexed block another
  // host's apply releases, counted in that host's merge_requests_applied).
  uint64_t bytes_reclaimed = 0;
  uint64_t merge_requests_posted = 0, merge_requests_applied = 0;
  uint64_t verification_failures = 0;  // stale records + merge requests that failed verification
  uint64_t errors = 0;
  uint64_t cow_copies = 0;  // copy-on-write specializations on this host since the previous pass
  uint64_t io_bytes = 0;    // dedup I/O charged to the rate limiter
  // The volume right after the pass (dede stats figures), for savings over time.
  uint64_t volume_logical_bytes = 0, volume_physical_bytes = 0, volume_saved_bytes = 0;

  bool operator==(const PassRow&) const = default;
};

// Local SQLite database of a host's passes. Thread-safe (one connection
// behind a mutex); several processes may use one file at once.
//
// Every error is a Status naming the file: kCorruption when SQLite finds
// the file damaged or not a database, kIoError for anything else SQLite
// reports (including a database still locked after the busy timeout).
class PassHistory {
 public:
  // The schema version this code writes (PRAGMA user_version).
  static constexpr int kSchemaVersion = 1;

  // Opens the history at `path`. With `create`, a missing file (and its
  // parent directory) is created; without, a missing file is kNotFound.
  // The schema carries a version number (PRAGMA user_version): a newer one
  // is kUnsupported, an older one is migrated in place. WAL mode, and a
  // busy timeout of a few seconds (dede report reads while dedupd writes).
  static Result<std::unique_ptr<PassHistory>> Open(const std::string& path, bool create);
  // Opens an existing history for List only, as a reader that may not
  // write the file or its directory (`dede report` run by any user): no
  // WAL switch, no migration (a schema older than this code's is
  // kUnsupported: dedupd migrates it when it next opens it). While a
  // writer has it open, the writer's WAL files are read (they must be
  // readable); with no WAL file, the database file alone is read.
  static Result<std::unique_ptr<PassHistory>> OpenReadOnly(const std::string& path);
  ~PassHistory();
  PassHistory(const PassHistory&) = delete;
  PassHistory& operator=(const PassHistory&) = delete;

  // Appends `row` (its id is ignored) and returns the id it was given.
  // start_ns and end_ns must fit in 63 bits (SQLite integers are signed;
  // the counters are stored as their 64-bit pattern and read back exactly).
  Result<int64_t> Record(const PassRow& row) EXCLUDES(mu_);

  // Passes with start_ns >= since_ns, oldest first; at most `limit` newest
  // of them when limit > 0.
  Result<std::vector<PassRow>> List(uint64_t since_ns = 0, size_t limit = 0) EXCLUDES(mu_);

  const std::string& path() const { return path_; }

 private:
  PassHistory(std::string path, sqlite3* db) : path_(std::move(path)), db_(db) {}

  const std::string path_;
  Mutex mu_;
  sqlite3* const db_ GUARDED_BY(mu_);
};

// The row as a JSON object, field names as in PassRow.
nlohmann::json PassRowToJson(const PassRow& r);

}  // namespace dede
