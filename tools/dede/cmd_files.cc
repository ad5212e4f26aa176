// File commands: create, ls, rm, set.
#include <sys/stat.h>

#include <algorithm>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "agent/control_server.h"
#include "kmod/writemon/write_log.h"
#include "merge/merge_request.h"
#include "tools/dede/cli.h"
#include "util/clock.h"
#include "util/units.h"
#include "volume/format.h"
#include "volume/volume.h"

namespace po = boost::program_options;
using json = nlohmann::json;

namespace dede::cli {
namespace {

constexpr const char* kVolHelp = "volume: a path (file or block device) or iscsi:// URL";

// A file someone else holds open cannot be opened here (the open *is* the
// lock); say so plainly instead of echoing the lock backend's wording only.
Status InUse(const std::string& name, const Status& st) {
  if (st.message().find("in use by another process or host") != std::string::npos) return st;
  return Status::Locked("'" + name + "' is in use by another process or host (" + st.message() +
                        ")");
}

}  // namespace

// ---------------------------------------------------------------- create

int RunCreate(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.AddPositional("VOL", kVolHelp);
  parser.AddPositional("NAME", "file name (1..255 bytes, no '/')");
  parser.options()("size", po::value<std::string>()->value_name("SIZE"),
                   "logical size: bytes or with a K, M, G, T or P suffix (binary), e.g. 20G");
  parser.SetDetails("The new file is thin: it takes no data blocks until written.");
  if (auto rc = parser.Parse(args)) return *rc;
  auto size_text = parser.value("size");
  if (!size_text) return UsageError(cmd, "missing --size");
  auto size = ParseSize(*size_text);
  if (!size) return UsageError(cmd, "invalid size '" + *size_text + "': " + kSizeSyntax);
  if (auto why = ReservedName(parser.positional(1))) return UsageError(cmd, *why);

  auto opened = OpenVolume(parser.positional(0), /*read_only=*/false);
  if (!opened.ok()) return Fail(cmd, opened.status());
  auto id = opened->volume->Create(parser.positional(1), *size);
  if (!id.ok()) return Fail(cmd, id.status());
  Status st = opened->volume->Sync();
  if (!st.ok()) return Fail(cmd, st);
  return kExitOk;
}

// ---------------------------------------------------------------- ls

namespace {

struct Listing {
  FileInfo info;
  bool in_use = false;
  bool have_usage = false;
  FileUsage usage;
  // The file's write log (regular files, -l): records a dedup pass has
  // not consumed yet.
  enum class LogState { kNone, kRead, kBusy } log = LogState::kNone;
  uint64_t log_records = 0;  // distinct blocks with a fingerprint
  bool log_saturated = false;  // at its size limit: the whole file counts as changed
  bool log_over_limit = false;  // more than --max-log-records: not counted further
  WriteLogScanStats log_stats;
};

// `ls -l` reads each write log within this many records and ranges at once
// (about 100 MiB): a one-off command should not need gigabytes for the log
// of a big disk.
constexpr uint64_t kLsMaxLogRecords = uint64_t{1} << 20;

// Replays the write log of `info` (if any) into `l`, holding at most
// `max_entries` of its records and ranges in memory (the log of a big disk
// can describe hundreds of millions of blocks).
Status ReadPendingLog(Volume* vol, const FileInfo& info, size_t max_entries, Listing* l) {
  auto log = OpenWriteLog(vol, info.id);
  if (!log.ok()) {
    if (log.status().code() == Status::Code::kNotFound) return Status::Ok();
    if (log.status().code() == Status::Code::kLocked) {
      l->log = Listing::LogState::kBusy;  // being appended to or consumed right now
      return Status::Ok();
    }
    return log.status();
  }
  const Superblock& sb = vol->superblock();
  ASSIGN_OR_RETURN(WriteLogState state,
                   ReplayWriteLog(log->get(), sb.hash_algo, sb.uuid, info.id, max_entries));
  l->log = Listing::LogState::kRead;
  l->log_records = state.records.size();
  l->log_saturated = state.saturated;
  l->log_over_limit = state.over_budget;
  l->log_stats = state.stats;
  return Status::Ok();
}

void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  // Right-align every column but the last (the name, which may hold spaces).
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t c = 0; c < row.size(); c++) width[c] = std::max(width[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string out;
    for (size_t c = 0; c < row.size(); c++) {
      if (c + 1 == row.size()) {
        out += row[c];
      } else {
        out += std::string(width[c] - row[c].size(), ' ') + row[c] + "  ";
      }
    }
    std::cout << out << '\n';
  }
}

}  // namespace

int RunLs(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.AddPositional("VOL", kVolHelp);
  parser.options()("long,l", po::bool_switch(),
                   "per file: kind, size, allocated, saved, blocks (unique, shared), "
                   "dedup, pending write-log records")(
      "all,a", po::bool_switch(), "also list dede's internal files (write logs...)")(
      "max-log-records", po::value<std::string>()->value_name("N"),
      "-l: hold at most N of a write log's records in memory, about 100 bytes each "
      "(default 1048576); a log describing more shows '>N'")("json", po::bool_switch(),
                                                             "print a JSON array");
  parser.SetDetails(
      "allocated: mapped blocks x 4 KiB. saved: what sharing saves, each shared\n"
      "block's 4 KiB split among its references (the dedup index's arena holds\n"
      "one reference to each block it shares, so this is an upper bound; dede\n"
      "stats gives the volume's exact savings).\n"
      "BLOCKS, UNIQUE, SHARED are counts of 4 KiB blocks: BLOCKS = UNIQUE +\n"
      "SHARED are the blocks holding data; UNIQUE ones only this file uses\n"
      "(removing the file frees them); SHARED ones are also used elsewhere\n"
      "(another file, another place in this file, or the dedup index).\n"
      "A file open elsewhere cannot be walked: it shows its inode figures and\n"
      "'in use'.\n"
      "logged: blocks whose fingerprint waits in the file's write log for the\n"
      "next dedup pass (a running dedupd also buffers some in memory); '!' after\n"
      "it: records were dropped under load, the next pass verifies everything.\n"
      "'all!': the log reached its size limit (dedupd --write-log-limit); the\n"
      "next pass reads and hashes the whole file. '>N': the log describes more\n"
      "than --max-log-records blocks (JSON: log_records null, log_records_over N).");
  if (auto rc = parser.Parse(args)) return *rc;
  const bool long_form = parser.flag("long");
  uint64_t max_log_records = kLsMaxLogRecords;
  if (auto v = parser.value("max-log-records")) {
    std::optional<uint64_t> n = ParseUnsigned(*v);
    if (!n || *n == 0 || *n > (uint64_t{1} << 40)) {
      return UsageError(
          cmd, "--max-log-records must be a whole number from 1 to 2^40, not '" + *v + "'");
    }
    max_log_records = *n;
  }

  auto opened = OpenVolume(parser.positional(0), /*read_only=*/true);
  if (!opened.ok()) return Fail(cmd, opened.status());
  Volume* vol = opened->volume.get();
  auto files = vol->List();
  if (!files.ok()) return Fail(cmd, files.status());
  std::sort(files->begin(), files->end(),
            [](const FileInfo& a, const FileInfo& b) { return a.name < b.name; });

  std::vector<Listing> listing;
  for (const FileInfo& info : *files) {
    if (info.kind != FileKind::kRegular && !parser.flag("all")) continue;
    Listing l;
    l.info = info;
    if (long_form && info.kind == FileKind::kRegular) {
      Status st = ReadPendingLog(vol, info, static_cast<size_t>(max_log_records), &l);
      if (!st.ok()) return Fail(cmd, st.WithContext("write log of '" + info.name + "'"));
    }
    if (long_form) {
      auto file = vol->OpenFile(info.name);
      if (file.ok()) {
        auto usage = (*file)->Usage();
        if (!usage.ok()) return Fail(cmd, usage.status().WithContext("'" + info.name + "'"));
        l.usage = *usage;
        l.have_usage = true;
      } else if (file.status().code() == Status::Code::kLocked) {
        l.in_use = true;
      } else if (file.status().code() != Status::Code::kNotFound) {
        // kNotFound: removed since List(); show what List() saw.
        return Fail(cmd, file.status());
      }
    }
    listing.push_back(std::move(l));
  }

  if (parser.flag("json")) {
    json out = json::array();
    for (const Listing& l : listing) {
      json j;
      j["name"] = l.info.name;
      j["kind"] = FileKindName(l.info.kind);
      j["size"] = l.info.size;
      j["dedup"] = l.info.dedup;
      j["ino"] = l.info.id.ino;
      j["generation"] = l.info.id.generation;
      j["ctime_ns"] = l.info.ctime_ns;
      j["mtime_ns"] = l.info.mtime_ns;
      if (l.info.owner_ino != 0) j["owner_ino"] = l.info.owner_ino;
      const uint64_t mapped = l.have_usage ? l.usage.mapped_blocks : l.info.mapped_blocks;
      j["mapped_blocks"] = mapped;
      j["allocated_bytes"] = mapped * kBlockSize;
      if (long_form) {
        j["in_use"] = l.in_use;
        if (l.have_usage) {
          j["shared_blocks"] = l.usage.shared_blocks;
          j["unique_blocks"] = l.usage.unique_blocks;
          j["saved_bytes"] = l.usage.saved_bytes;
          j["metadata_blocks"] = l.usage.metadata_blocks;
        } else {
          j["shared_blocks"] = nullptr;
          j["unique_blocks"] = nullptr;
          j["saved_bytes"] = nullptr;
          j["metadata_blocks"] = nullptr;
        }
        // Every key in every row (null when not known), so a script can
        // index them without checking which kind of row it has.
        j["log_records"] = nullptr;
        j["log_records_over"] = nullptr;
        j["log_dropped_records"] = nullptr;
        j["log_corrupt_frames"] = nullptr;
        j["log_saturated"] = nullptr;
        if (l.log == Listing::LogState::kRead && l.log_over_limit) {
          j["log_records_over"] = max_log_records;
        } else if (l.log == Listing::LogState::kRead) {
          j["log_records"] = l.log_records;
          j["log_dropped_records"] = l.log_stats.dropped_records;
          j["log_corrupt_frames"] = l.log_stats.corrupt_frames;
          j["log_saturated"] = l.log_saturated;
        } else if (l.log == Listing::LogState::kNone) {
          // No log: nothing recorded, dropped or damaged.
          j["log_records"] = 0;
          j["log_dropped_records"] = 0;
          j["log_corrupt_frames"] = 0;
          j["log_saturated"] = false;
        }
      }
      out.push_back(std::move(j));
    }
    PrintJson(out);
    return kExitOk;
  }

  if (!long_form) {
    for (const Listing& l : listing) std::cout << l.info.name << '\n';
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows;
  rows.push_back({"KIND", "SIZE", "ALLOCATED", "SAVED", "BLOCKS", "UNIQUE", "SHARED", "DEDUP",
                  "LOGGED", "NAME"});
  for (const Listing& l : listing) {
    const uint64_t mapped = l.have_usage ? l.usage.mapped_blocks : l.info.mapped_blocks;
    std::vector<std::string> row = {FileKindName(l.info.kind), HumanSize(l.info.size),
                                    HumanSize(mapped * kBlockSize)};
    if (l.have_usage) {
      row.push_back(HumanSize(l.usage.saved_bytes));
      row.push_back(std::to_string(mapped));
      row.push_back(std::to_string(l.usage.unique_blocks));
      row.push_back(std::to_string(l.usage.shared_blocks));
    } else {
      row.insert(row.end(), {"-", std::to_string(mapped), "-", "-"});
    }
    row.push_back(l.info.dedup ? "on" : "off");
    switch (l.log) {
      case Listing::LogState::kNone: row.push_back(l.info.kind == FileKind::kRegular ? "0" : "-"); break;
      case Listing::LogState::kBusy: row.push_back("busy"); break;
      case Listing::LogState::kRead:
        row.push_back(l.log_saturated    ? std::string("all!")
                      : l.log_over_limit ? ">" + std::to_string(max_log_records)
                                         : std::to_string(l.log_records) +
                                               (l.log_stats.dropped_records ? "!" : ""));
        break;
    }
    row.push_back(l.info.name + (l.in_use ? "  (in use)" : ""));
    rows.push_back(std::move(row));
  }
  PrintTable(rows);
  return kExitOk;
}

// ---------------------------------------------------------------- rm

int RunRm(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.AddPositional("VOL", kVolHelp);
  parser.AddPositional("NAME", "file to remove");
  parser.options()("force", po::bool_switch(),
                   "also remove one of dede's own files (the policy, an index shard, an arena, "
                   "a write log, a merge request)");
  parser.SetDetails(
      "A file that is open (in use) anywhere cannot be removed. dede's own files\n"
      "(names beginning with .dede-) are removed by dede itself; --force removes\n"
      "one anyway (for instance a damaged .dede-policy, which then reads as the\n"
      "default policy).");
  if (auto rc = parser.Parse(args)) return *rc;
  const std::string& name = parser.positional(1);

  auto opened = OpenVolume(parser.positional(0), /*read_only=*/false);
  if (!opened.ok()) return Fail(cmd, opened.status());
  auto info = opened->volume->Lookup(name);
  if (info.ok() && info->kind != FileKind::kRegular && !parser.flag("force")) {
    return Fail(cmd, "'" + name + "' is one of dede's own files (" + FileKindName(info->kind) +
                         "); dede removes it itself (--force removes it anyway)");
  }
  Status st = opened->volume->Remove(name);
  if (st.code() == Status::Code::kLocked) return Fail(cmd, InUse(name, st));
  if (!st.ok()) return Fail(cmd, st);
  if (info.ok() && info->kind == FileKind::kRegular) {
    // Its write log goes with it; a log left behind (say, locked by a pass
    // right now) is an orphan the next pass removes: its name carries the
    // file's generation, which no live file has.
    Status log_st = opened->volume->Remove(WriteLogName(info->id));
    if (!log_st.ok() && log_st.code() != Status::Code::kNotFound) {
      std::cerr << "dede rm: warning: write log of '" << name << "' left behind: "
                << log_st.message() << "\n";
    }
    // So do the merge requests posted for it (one left behind is removed
    // by the next dedup pass: its target inode holds no file).
    const std::string mr_name = MergeRequestFileName(info->id.ino);
    auto mr_info = opened->volume->Lookup(mr_name);
    Status mr_st = mr_info.ok() && mr_info->kind == FileKind::kMergeRequest &&
                           mr_info->owner_ino == info->id.ino
                       ? opened->volume->Remove(mr_name)
                       : Status::Ok();
    if (!mr_st.ok() && mr_st.code() != Status::Code::kNotFound) {
      std::cerr << "dede rm: warning: merge requests of '" << name << "' left behind: "
                << mr_st.message() << "\n";
    }
  }
  st = opened->volume->Sync();
  if (!st.ok()) return Fail(cmd, st);
  return kExitOk;
}

// ---------------------------------------------------------------- set

int RunSet(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.AddPositional("VOL", kVolHelp);
  parser.AddPositional("NAME", "file to change");
  parser.AddPositional("PROP=VALUE", "dedup=on or dedup=off");
  parser.options()("control", po::value<std::string>()->value_name("PATH"),
                   "the local dedupd's control socket (default /run/dede/dedupd.ctl)");
  parser.SetDetails(
      "dedup=off: the file's blocks are neither fingerprinted nor shared from now\n"
      "on; its index entries go at the next dedup pass. dedup=on: new writes are\n"
      "fingerprinted again, and the blocks written meanwhile at the next passes.\n"
      "A file a VM uses through this host's dedupd is changed through dedupd's\n"
      "control socket, at once; a file in use on another host must be changed\n"
      "there.");
  if (auto rc = parser.Parse(args)) return *rc;
  const std::string& name = parser.positional(1);
  const std::string& assignment = parser.positional(2);
  // dede's own files (the policy, write logs, shards) are not VM disks:
  // setting dedup on one only gave it a write log of its own.
  if (auto why = ReservedName(name)) return UsageError(cmd, *why);

  const size_t eq = assignment.find('=');
  if (eq == std::string::npos) {
    return UsageError(cmd, "expected PROP=VALUE, not '" + assignment + "'");
  }
  const std::string prop = assignment.substr(0, eq);
  const std::string value = assignment.substr(eq + 1);
  if (prop != "dedup") return UsageError(cmd, "unknown property '" + prop + "' (known: dedup)");
  if (value != "on" && value != "off") {
    return UsageError(cmd, "dedup must be on or off, not '" + value + "'");
  }

  const bool on = value == "on";
  // A running VM's disk: the local dedupd holds it and changes it live.
  const std::string control = parser.value("control").value_or(kDefaultControlPath);
  // Why the local dedupd did not take the change, if it was asked: said
  // with a refusal below, which it may explain (a dedupd that holds the
  // file but timed out is "in use by another process").
  std::string dedupd_said;
  {
    auto ro = OpenVolume(parser.positional(0), /*read_only=*/true);
    if (!ro.ok()) return Fail(cmd, ro.status());
    const std::string uuid = UuidToString(ro->volume->superblock().uuid);
    struct stat sb;
    if (::stat(control.c_str(), &sb) == 0) {
      Result<nlohmann::json> reply = ControlRequest(
          control, {{"cmd", "set-dedup"}, {"name", name}, {"dedup", on}, {"volume_uuid", uuid}});
      if (reply.ok() && reply->value("served", false)) return kExitOk;
      if (reply.ok() && reply->contains("error")) {
        return Fail(cmd, "dedupd at " + control + ": " + (*reply)["error"].get<std::string>());
      }
      dedupd_said =
          reply.ok() ? "the dedupd at " + control + " does not serve it"
                     : "the dedupd at " + control + " did not answer: " + reply.status().message();
    }
  }
  auto opened = OpenVolume(parser.positional(0), /*read_only=*/false);
  if (!opened.ok()) return Fail(cmd, opened.status());
  auto file = opened->volume->OpenFile(name);
  if (!file.ok() && file.status().code() == Status::Code::kLocked) {
    const Status in_use = InUse(name, file.status());
    return Fail(
        cmd, dedupd_said.empty() ? in_use : Status::Locked(in_use.message() + "; " + dedupd_said));
  }
  if (!file.ok()) return Fail(cmd, file.status());
  Result<FileInfo> before = (*file)->Info();
  if (!before.ok()) return Fail(cmd, before.status());
  if (!on || !before->dedup) {
    // The marker says every block changed. Off: the next dedup pass drops
    // the file's index entries. On: what was written while off was never
    // hashed, and any record older than the switch may be stale; the next
    // pass rehashes the file (as dedupd does when it switches a live disk
    // on). Written before the switch, so that a run that fails in between
    // leaves the flag as it was, and running it again writes the marker.
    Status st = AppendOptOutMarker(opened->volume.get(), (*file)->id(), (*file)->size(),
                                   Clock::Real()->NowNanos());
    if (!st.ok()) return Fail(cmd, st.WithContext("write log of '" + name + "'"));
  }
  Status st = (*file)->SetDedup(on);
  if (!st.ok()) return Fail(cmd, st);
  st = (*file)->Flush();
  if (!st.ok()) return Fail(cmd, st);
  return kExitOk;
}

}  // namespace dede::cli
