#include "agent/pass_history.h"

#include <sqlite3.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <filesystem>
#include <limits>
#include <system_error>
#include <type_traits>
#include <utility>
#include <variant>

namespace dede {
namespace {

// dedupd holds the write lock only for one INSERT; a reader or writer that
// finds the file locked waits this long before giving up.
constexpr int kBusyTimeoutMs = 5000;

// Schema migrations: kMigrations[v] takes a database from user_version v
// to v + 1 and sets the new version itself, inside the caller's
// transaction. A new schema appends a step here (ALTER TABLE ... ADD
// COLUMN with a default, and a new entry in kFields); old steps never
// change, since databases in the field were built by them.
constexpr const char* kMigrations[] = {
    // 0 -> 1: the passes table.
    R"sql(
      CREATE TABLE passes (
        id INTEGER PRIMARY KEY,
        start_ns INTEGER NOT NULL,
        end_ns INTEGER NOT NULL,
        host_id INTEGER NOT NULL,
        volume_uuid TEXT NOT NULL,
        "trigger" TEXT NOT NULL,
        "window" TEXT NOT NULL,
        outcome TEXT NOT NULL,
        error TEXT NOT NULL,
        records INTEGER NOT NULL,
        entries_scanned INTEGER NOT NULL,
        shards_rewritten INTEGER NOT NULL,
        blocks_shared_new INTEGER NOT NULL,
        blocks_shared_again INTEGER NOT NULL,
        zero_blocks_freed INTEGER NOT NULL,
        bytes_reclaimed INTEGER NOT NULL,
        merge_requests_posted INTEGER NOT NULL,
        merge_requests_applied INTEGER NOT NULL,
        verification_failures INTEGER NOT NULL,
        errors INTEGER NOT NULL,
        cow_copies INTEGER NOT NULL,
        io_bytes INTEGER NOT NULL,
        volume_logical_bytes INTEGER NOT NULL,
        volume_physical_bytes INTEGER NOT NULL,
        volume_saved_bytes INTEGER NOT NULL
      );
      CREATE INDEX passes_by_start ON passes(start_ns);
      PRAGMA user_version = 1;
    )sql",
};
static_assert(std::size(kMigrations) == PassHistory::kSchemaVersion,
              "one migration step per schema version");

// The columns of `passes` besides id, each with the PassRow member it
// holds. Column names are PassRow's (and PassRowToJson's) field names, so
// the INSERT, the SELECT and the JSON all come from this one list.
using Member = std::variant<uint64_t PassRow::*, uint32_t PassRow::*, std::string PassRow::*>;
struct Field {
  const char* name;
  Member member;
};
const Field kFields[] = {
    {"start_ns", &PassRow::start_ns},
    {"end_ns", &PassRow::end_ns},
    {"host_id", &PassRow::host_id},
    {"volume_uuid", &PassRow::volume_uuid},
    {"trigger", &PassRow::trigger},
    {"window", &PassRow::window},
    {"outcome", &PassRow::outcome},
    {"error", &PassRow::error},
    {"records", &PassRow::records},
    {"entries_scanned", &PassRow::entries_scanned},
    {"shards_rewritten", &PassRow::shards_rewritten},
    {"blocks_shared_new", &PassRow::blocks_shared_new},
    {"blocks_shared_again", &PassRow::blocks_shared_again},
    {"zero_blocks_freed", &PassRow::zero_blocks_freed},
    {"bytes_reclaimed", &PassRow::bytes_reclaimed},
    {"merge_requests_posted", &PassRow::merge_requests_posted},
    {"merge_requests_applied", &PassRow::merge_requests_applied},
    {"verification_failures", &PassRow::verification_failures},
    {"errors", &PassRow::errors},
    {"cow_copies", &PassRow::cow_copies},
    {"io_bytes", &PassRow::io_bytes},
    {"volume_logical_bytes", &PassRow::volume_logical_bytes},
    {"volume_physical_bytes", &PassRow::volume_physical_bytes},
    {"volume_saved_bytes", &PassRow::volume_saved_bytes},
};

// "a", "b", ... quoted: "trigger" and "window" are SQL keywords.
std::string ColumnList() {
  std::string s;
  for (const Field& f : kFields) {
    if (!s.empty()) s += ", ";
    s += '"';
    s += f.name;
    s += '"';
  }
  return s;
}

std::string InsertSql() {
  std::string params;
  for (size_t i = 1; i <= std::size(kFields); i++) {
    if (i > 1) params += ", ";
    params += "?" + std::to_string(i);
  }
  return "INSERT INTO passes (" + ColumnList() + ") VALUES (" + params + ")";
}

// Newest first so that LIMIT keeps the newest; List reverses.
std::string SelectSql() {
  return "SELECT id, " + ColumnList() +
         " FROM passes WHERE start_ns >= ?1 ORDER BY start_ns DESC, id DESC LIMIT ?2";
}

Status SqliteStatus(const std::string& path, sqlite3* db, int rc, const std::string& what) {
  const std::string msg =
      path + ": " + what + ": " + (db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc));
  const int primary = rc & 0xff;
  if (primary == SQLITE_CORRUPT || primary == SQLITE_NOTADB) return Status::Corruption(msg);
  return Status::IoError(msg);
}

struct StmtFinalizer {
  void operator()(sqlite3_stmt* s) const { sqlite3_finalize(s); }
};
using Stmt = std::unique_ptr<sqlite3_stmt, StmtFinalizer>;

struct DbCloser {
  void operator()(sqlite3* db) const { sqlite3_close_v2(db); }
};
using Db = std::unique_ptr<sqlite3, DbCloser>;

Result<Stmt> Prepare(sqlite3* db, const std::string& path, const std::string& sql) {
  sqlite3_stmt* raw = nullptr;
  int rc = sqlite3_prepare_v2(db, sql.c_str(), static_cast<int>(sql.size() + 1), &raw, nullptr);
  Stmt stmt(raw);
  if (rc != SQLITE_OK) return SqliteStatus(path, db, rc, "preparing a statement");
  return stmt;
}

// For statements without parameters or results (migrations, BEGIN, COMMIT).
Status Exec(sqlite3* db, const std::string& path, const char* sql, const std::string& what) {
  int rc = sqlite3_exec(db, sql, nullptr, nullptr, nullptr);
  if (rc != SQLITE_OK) return SqliteStatus(path, db, rc, what);
  return Status::Ok();
}

Result<int> ReadUserVersion(sqlite3* db, const std::string& path) {
  ASSIGN_OR_RETURN(Stmt stmt, Prepare(db, path, "PRAGMA user_version"));
  int rc = sqlite3_step(stmt.get());
  if (rc != SQLITE_ROW) return SqliteStatus(path, db, rc, "reading the schema version");
  return sqlite3_column_int(stmt.get(), 0);
}

// A schema this dede cannot read: written by a newer one (or garbage).
Status RefuseNewerSchema(const std::string& path, int version) {
  if (version <= PassHistory::kSchemaVersion && version >= 0) return Status::Ok();
  return Status::Unsupported(path + ": pass history schema version " + std::to_string(version) +
                             " is newer than this dede knows (version " +
                             std::to_string(PassHistory::kSchemaVersion) +
                             "): written by a newer dede");
}

// sqlite3_open_v2 without CREATE says only "unable to open database
// file"; a missing history deserves its own code.
Status CheckExists(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return Status::Ok();
  if (errno == ENOENT) return Status::NotFound(path + ": no such file");
  return Status::FromErrno(path, errno);
}

// Brings the schema to kSchemaVersion, or refuses a newer one.
Status PrepareSchema(sqlite3* db, const std::string& path) {
  ASSIGN_OR_RETURN(int version, ReadUserVersion(db, path));
  RETURN_IF_ERROR(RefuseNewerSchema(path, version));
  if (sqlite3_db_readonly(db, "main") == 0) {
    // Persistent in the file; a no-op when it already is in WAL mode.
    // Lets `dede report` read while dedupd writes, without either waiting.
    RETURN_IF_ERROR(Exec(db, path, "PRAGMA journal_mode=WAL", "switching to WAL mode"));
  }
  if (version == PassHistory::kSchemaVersion) return Status::Ok();

  RETURN_IF_ERROR(Exec(db, path, "BEGIN IMMEDIATE", "starting the schema migration"));
  // Another process (dedupd, dede report) may have migrated the file
  // between the first read and the write lock.
  Result<int> locked_version = ReadUserVersion(db, path);
  Status st = locked_version.status();
  for (int v = st.ok() ? *locked_version : 0; st.ok() && v < PassHistory::kSchemaVersion; v++) {
    st = Exec(
        db, path, kMigrations[v],
        "migrating the schema from version " + std::to_string(v) + " to " + std::to_string(v + 1));
  }
  if (st.ok()) st = Exec(db, path, "COMMIT", "committing the schema migration");
  if (!st.ok()) {
    // Leaves the file as it was; the error that matters is `st`.
    sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
  }
  return st;
}

Status BindField(sqlite3_stmt* stmt, int index, const PassRow& row, const Field& f) {
  int rc = std::visit(
      [&](auto member) -> int {
        const auto& value = row.*member;
        using T = std::decay_t<decltype(value)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return sqlite3_bind_text(stmt, index, value.data(), static_cast<int>(value.size()),
                                   SQLITE_TRANSIENT);
        } else {
          // SQLite integers are signed 64-bit: counters keep their bit
          // pattern and come back exactly through the reverse cast.
          return sqlite3_bind_int64(stmt, index, static_cast<sqlite3_int64>(value));
        }
      },
      f.member);
  if (rc != SQLITE_OK) {
    return Status::IoError(std::string("binding ") + f.name + ": " + sqlite3_errstr(rc));
  }
  return Status::Ok();
}

void ReadField(sqlite3_stmt* stmt, int column, PassRow* row, const Field& f) {
  std::visit(
      [&](auto member) {
        auto& value = row->*member;
        using T = std::decay_t<decltype(value)>;
        if constexpr (std::is_same_v<T, std::string>) {
          const auto* text = sqlite3_column_text(stmt, column);
          const int bytes = sqlite3_column_bytes(stmt, column);
          value.assign(text != nullptr ? reinterpret_cast<const char*>(text) : "",
                       text != nullptr ? static_cast<size_t>(bytes) : 0);
        } else {
          value = static_cast<T>(sqlite3_column_int64(stmt, column));
        }
      },
      f.member);
}

}  // namespace

Result<std::unique_ptr<PassHistory>> PassHistory::Open(const std::string& path, bool create) {
  if (path.empty()) return Status::Invalid("pass history: empty path");
  if (create) {
    const std::filesystem::path parent = std::filesystem::path(path).parent_path();
    std::error_code ec;
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    if (ec) {
      return Status::IoError(path + ": cannot create directory " + parent.string() + ": " +
                             ec.message());
    }
  } else {
    RETURN_IF_ERROR(CheckExists(path));
  }
  // SQLITE_OPEN_NOMUTEX: the connection is used under PassHistory's mutex.
  const int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX | (create ? SQLITE_OPEN_CREATE : 0);
  sqlite3* raw = nullptr;
  int rc = sqlite3_open_v2(path.c_str(), &raw, flags, nullptr);
  Db db(raw);
  if (rc != SQLITE_OK) return SqliteStatus(path, raw, rc, "cannot open");
  sqlite3_busy_timeout(db.get(), kBusyTimeoutMs);
  RETURN_IF_ERROR(PrepareSchema(db.get(), path));
  return std::unique_ptr<PassHistory>(new PassHistory(path, db.release()));
}

namespace {

// `path` as a file: URI (RFC 3986 percent-encoding of all but unreserved
// characters and '/'), for SQLite's URI query parameters.
std::string FileUri(const std::string& path) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string uri = "file:";
  for (unsigned char c : path) {
    if (std::isalnum(c) || c == '/' || c == '-' || c == '.' || c == '_' || c == '~') {
      uri.push_back(static_cast<char>(c));
    } else {
      uri.push_back('%');
      uri.push_back(kHex[c >> 4]);
      uri.push_back(kHex[c & 15]);
    }
  }
  return uri;
}

}  // namespace

Result<std::unique_ptr<PassHistory>> PassHistory::OpenReadOnly(const std::string& path) {
  if (path.empty()) return Status::Invalid("pass history: empty path");
  RETURN_IF_ERROR(CheckExists(path));
  auto open = [&](const std::string& name, int extra_flags) -> Result<Db> {
    sqlite3* raw = nullptr;
    int rc = sqlite3_open_v2(name.c_str(), &raw,
                             SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX | extra_flags, nullptr);
    Db db(raw);
    if (rc != SQLITE_OK) return SqliteStatus(path, raw, rc, "cannot open");
    sqlite3_busy_timeout(db.get(), kBusyTimeoutMs);
    return db;
  };
  ASSIGN_OR_RETURN(Db db, open(path, 0));
  Result<int> version = ReadUserVersion(db.get(), path);
  if (!version.ok()) {
    // A WAL database read by a user who may not create its shared-memory
    // file fails here unless a writer has the WAL files in place. With no
    // -wal file there is no writer's work outside the database file, which
    // can then be read as it is (immutable: no locks, no WAL).
    struct stat wal {};
    if (::stat((path + "-wal").c_str(), &wal) != 0 && errno == ENOENT) {
      Result<Db> immutable = open(FileUri(path) + "?immutable=1", SQLITE_OPEN_URI);
      if (immutable.ok()) {
        Result<int> v = ReadUserVersion(immutable.value().get(), path);
        if (v.ok()) {
          db = std::move(immutable).value();
          version = v;
        }
      }
    }
    if (!version.ok()) return version.status();
  }
  RETURN_IF_ERROR(RefuseNewerSchema(path, *version));
  if (*version < kSchemaVersion) {
    return Status::Unsupported(path + ": pass history schema version " + std::to_string(*version) +
                               " is older than this dede's (" + std::to_string(kSchemaVersion) +
                               "); dedupd updates it when it next opens it");
  }
  return std::unique_ptr<PassHistory>(new PassHistory(path, db.release()));
}

PassHistory::~PassHistory() {
  sqlite3_close_v2(db_);
}

Result<int64_t> PassHistory::Record(const PassRow& row) {
  constexpr auto kMaxTime = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  if (row.start_ns > kMaxTime || row.end_ns > kMaxTime) {
    return Status::Invalid(path_ + ": pass times must fit in 63 bits");
  }
  static const std::string kInsert = InsertSql();
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Stmt stmt, Prepare(db_, path_, kInsert));
  for (size_t i = 0; i < std::size(kFields); i++) {
    RETURN_IF_ERROR(
        BindField(stmt.get(), static_cast<int>(i + 1), row, kFields[i]).WithContext(path_));
  }
  int rc = sqlite3_step(stmt.get());
  if (rc != SQLITE_DONE) return SqliteStatus(path_, db_, rc, "recording a pass");
  // Ours: the connection is used by one thread at a time.
  return static_cast<int64_t>(sqlite3_last_insert_rowid(db_));
}

Result<std::vector<PassRow>> PassHistory::List(uint64_t since_ns, size_t limit) {
  static const std::string kSelect = SelectSql();
  const auto since =
      static_cast<sqlite3_int64>(std::min<uint64_t>(since_ns, std::numeric_limits<int64_t>::max()));
  // SQLite: a negative LIMIT means no limit.
  const sqlite3_int64 max_rows =
      limit == 0 || limit > static_cast<size_t>(std::numeric_limits<int64_t>::max())
          ? -1
          : static_cast<sqlite3_int64>(limit);
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Stmt stmt, Prepare(db_, path_, kSelect));
  int rc = sqlite3_bind_int64(stmt.get(), 1, since);
  if (rc == SQLITE_OK) rc = sqlite3_bind_int64(stmt.get(), 2, max_rows);
  if (rc != SQLITE_OK) return SqliteStatus(path_, db_, rc, "listing passes");
  std::vector<PassRow> rows;
  while ((rc = sqlite3_step(stmt.get())) == SQLITE_ROW) {
    PassRow row;
    row.id = sqlite3_column_int64(stmt.get(), 0);
    for (size_t i = 0; i < std::size(kFields); i++) {
      ReadField(stmt.get(), static_cast<int>(i + 1), &row, kFields[i]);
    }
    rows.push_back(std::move(row));
  }
  if (rc != SQLITE_DONE) return SqliteStatus(path_, db_, rc, "listing passes");
  std::reverse(rows.begin(), rows.end());
  return rows;
}

nlohmann::json PassRowToJson(const PassRow& r) {
  nlohmann::json j;
  j["id"] = r.id;
  for (const Field& f : kFields) {
    std::visit([&](auto member) { j[f.name] = r.*member; }, f.member);
  }
  return j;
}

}  // namespace dede
