// Whole-volume commands: format, info, stats, fsck.
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "index/index_check.h"
#include "tools/dede/cli.h"
#include "volume/block_device.h"
#include "volume/format.h"
#include "volume/fsck.h"
#include "volume/volume.h"

namespace po = boost::program_options;
using json = nlohmann::json;

namespace dede::cli {
namespace {

constexpr const char* kVolHelp = "volume: a path (file or block device) or iscsi:// URL";

std::string Iso8601(uint64_t ns) {
  time_t secs = static_cast<time_t>(ns / 1000000000);
  struct tm tm {};
  if (gmtime_r(&secs, &tm) == nullptr) return "?";
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string Entries(uint64_t n) { return std::to_string(n) + (n == 1 ? " entry" : " entries"); }

std::string Percent(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %%", v);
  return buf;
}

// What one superblock copy holds, read straight from the device: the
// volume's public interface does not carry the on-disk format version or
// which copy it was loaded from.
struct SuperblockCopy {
  uint64_t addr = 0;
  Status status;
  uint32_t magic = 0;
  uint16_t major = 0;
  uint16_t minor = 0;
};

std::vector<SuperblockCopy> ReadSuperblockCopies(BlockDevice* dev) {
  std::vector<SuperblockCopy> copies;
  AlignedBuffer blk(kBlockSize);
  for (uint64_t addr : kSuperblockAddrs) {
    SuperblockCopy c;
    c.addr = addr;
    c.status = dev->Read(addr * kBlockSize, blk.data(), kBlockSize);
    if (c.status.ok()) {
      Result<Superblock> sb = DecodeSuperblock(blk.data(), addr);
      c.status = sb.status();
      BlockHeader h = PeekHeader(blk.data());
      c.magic = h.magic;
      c.major = h.major;
      c.minor = h.minor;
    }
    copies.push_back(std::move(c));
  }
  return copies;
}

struct Region {
  const char* name;
  uint64_t start;
  uint64_t blocks;
  std::string note;
};

std::vector<Region> LayoutRegions(const Superblock& sb) {
  std::vector<Region> regions;
  regions.push_back({"superblocks", 0, 2, "primary at block 0, backup at block 1"});
  regions.push_back({"reserved", 2, sb.lease_start - 2, ""});
  regions.push_back({"lease area", sb.lease_start, sb.lease_blocks,
                     "lockspace + " + std::to_string(sb.lease_slots) + " resource leases"});
  regions.push_back(
      {"journals", sb.journal_start, uint64_t{sb.max_hosts} * sb.journal_blocks,
       std::to_string(sb.max_hosts) + " x " + std::to_string(sb.journal_blocks) + " blocks"});
  regions.push_back(
      {"inode table", sb.inode_start, sb.inode_count, std::to_string(sb.inode_count) + " inodes"});
  regions.push_back({"groups", sb.group_start, sb.total_blocks - sb.group_start,
                     std::to_string(sb.group_count) + " groups, " +
                         std::to_string(sb.group_refblocks) + " refcount blocks per full group, " +
                         std::to_string(sb.DataBlocks()) + " data blocks"});
  return regions;
}

}  // namespace

// ---------------------------------------------------------------- format

int RunFormat(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.AddPositional("VOL", kVolHelp);
  parser.options()("max-hosts", po::value<std::string>()->value_name("N"),
                   "hosts that may use the volume at once (1..250, default 8)")(
      "hash", po::value<std::string>()->value_name("ALGO"),
      "block fingerprint: xxh128 (default) or sha256")(
      "force", po::bool_switch(),
      "overwrite a device that already holds a dede volume (still refused while a process "
      "of this host or, with sanlock, another host uses it)")(
      "locks", po::value<std::string>()->value_name("BACKEND"),
      "local (default: processes of one machine) or sanlock (hosts sharing a LUN)")(
      "lease-path", po::value<std::string>()->value_name("PATH"),
      "with --locks sanlock: the LUN as a path for sanlock (block device or backing file; "
      "default: VOL when VOL is a path; also DEDE_LEASE_PATH)");
  parser.SetDetails(
      "Nothing is written when the device is too small or already holds a dede\n"
      "volume (unless --force).\n\n"
      "--locks sanlock writes a sanlock lockspace and the lease table into the\n"
      "volume's lease area. Every host then runs a sanlock daemon and opens the\n"
      "volume with its host id (dedupd --host-id N, or DEDE_HOST_ID=N for dede)\n"
      "and the LUN's path (--lease-path, or DEDE_LEASE_PATH).");
  if (auto rc = parser.Parse(args)) return *rc;
  const std::string& spec = parser.positional(0);

  FormatOptions opts;
  if (auto v = parser.value("max-hosts")) {
    auto n = ParseUnsigned(*v);
    if (!n || *n < 1 || *n > kMaxHosts) {
      return UsageError(cmd, "--max-hosts must be a number from 1 to " + std::to_string(kMaxHosts) +
                                 ", not '" + *v + "'");
    }
    opts.max_hosts = static_cast<uint32_t>(*n);
  }
  if (auto v = parser.value("hash")) {
    auto algo = ParseHashAlgo(*v);
    if (!algo) return UsageError(cmd, "--hash must be xxh128 or sha256, not '" + *v + "'");
    opts.hash_algo = *algo;
  }

  if (auto v = parser.value("locks")) {
    if (*v == "sanlock") {
      opts.sanlock = true;
    } else if (*v != "local") {
      return UsageError(cmd, "--locks must be local or sanlock, not '" + *v + "'");
    }
  }
  if (auto v = parser.value("lease-path")) {
    if (!opts.sanlock) return UsageError(cmd, "--lease-path needs --locks sanlock");
    opts.lease_path = *v;
  } else if (const char* env = std::getenv("DEDE_LEASE_PATH"); env && opts.sanlock) {
    opts.lease_path = env;
  }
  Result<SanlockOptions> env_sanlock = SanlockOptionsFromEnv();
  if (!env_sanlock.ok()) return UsageError(cmd, env_sanlock.status().message());
  opts.lease_io_timeout_s = env_sanlock->io_timeout_s;

  DeviceOptions dopts;
  dopts.iscsi_initiator_name = IscsiInitiatorFromEnv();
  auto dev = OpenBlockDevice(spec, dopts);
  if (!dev.ok()) return Fail(cmd, dev.status());
  if (!parser.flag("force")) {
    // FormatVolume refuses a readable dede superblock; also refuse one this
    // dede cannot read (newer version, both copies damaged): it is still
    // somebody's volume, and only --force may overwrite it.
    const auto copies = ReadSuperblockCopies(dev->get());
    bool readable = false;
    const SuperblockCopy* unreadable = nullptr;
    for (const auto& copy : copies) {
      readable = readable || copy.status.ok();
      if (copy.magic == kMagicSuperblock && !copy.status.ok() && unreadable == nullptr) {
        unreadable = &copy;
      }
    }
    if (!readable && unreadable != nullptr) {
      return Fail(cmd, spec + " holds a dede volume this dede cannot open (" +
                           unreadable->status.message() + "); use --force to overwrite it");
    }
  }
  Status st = FormatVolume(dev->get(), opts, parser.flag("force"));
  if (st.code() == Status::Code::kExists && st.message().find("--force") == std::string::npos) {
    return Fail(cmd, st.message() + " (use --force to overwrite it)");
  }
  if (!st.ok()) return Fail(cmd, st);
  st = (*dev)->Flush();
  if (!st.ok()) return Fail(cmd, st);

  // Read back what was written, for the summary.
  AlignedBuffer blk(kBlockSize);
  st = (*dev)->Read(0, blk.data(), kBlockSize);
  if (!st.ok()) return Fail(cmd, st);
  auto sb = DecodeSuperblock(blk.data(), 0);
  if (!sb.ok()) return Fail(cmd, sb.status().WithContext("reading back the new superblock"));
  std::cout << "formatted " << spec << ": " << HumanSize(sb->total_blocks * kBlockSize) << ", "
            << HumanSize(sb->DataBlocks() * kBlockSize) << " for data, up to " << sb->max_hosts
            << " hosts, " << HashAlgoName(sb->hash_algo) << " fingerprints, uuid "
            << UuidToString(sb->uuid) << (sb->UsesSanlock() ? ", sanlock leases" : "") << '\n';
  return kExitOk;
}

// ---------------------------------------------------------------- info

int RunInfo(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.AddPositional("VOL", kVolHelp);
  parser.options()("json", po::bool_switch(), "print a JSON object");
  if (auto rc = parser.Parse(args)) return *rc;
  const std::string& spec = parser.positional(0);

  auto opened = OpenVolume(spec, /*read_only=*/true);
  if (!opened.ok()) return Fail(cmd, opened.status());
  Volume* vol = opened->volume.get();
  const Superblock& sb = vol->superblock();
  auto stats = vol->Stats();
  if (!stats.ok()) return Fail(cmd, stats.status());
  auto copies = ReadSuperblockCopies(opened->device.get());
  // The version of the copy the volume was loaded from: the first good one.
  std::string version = "?";
  for (const auto& c : copies) {
    if (c.status.ok()) {
      version = std::to_string(c.major) + "." + std::to_string(c.minor);
      break;
    }
  }
  const auto regions = LayoutRegions(sb);

  if (parser.flag("json")) {
    json j;
    j["volume"] = spec;
    j["uuid"] = UuidToString(sb.uuid);
    j["format_version"] = version;
    j["device_bytes"] = opened->device->size_bytes();
    j["size_bytes"] = sb.total_blocks * kBlockSize;
    j["total_blocks"] = sb.total_blocks;
    j["block_size"] = sb.block_size;
    j["hash"] = HashAlgoName(sb.hash_algo);
    j["max_hosts"] = sb.max_hosts;
    j["lease_slots"] = sb.lease_slots;
    j["journal_blocks_per_host"] = sb.journal_blocks;
    j["created_ns"] = sb.created_ns;
    j["created"] = Iso8601(sb.created_ns);
    j["compat_features"] = sb.compat_features;
    j["incompat_features"] = sb.incompat_features;
    j["inode_count"] = sb.inode_count;
    j["files"] = stats->files;
    j["group_count"] = sb.group_count;
    j["group_refblocks"] = sb.group_refblocks;
    j["data_blocks"] = sb.DataBlocks();
    j["data_bytes"] = sb.DataBlocks() * kBlockSize;
    j["free_blocks"] = stats->free_blocks;
    j["free_bytes"] = stats->free_blocks * kBlockSize;
    json layout = json::array();
    for (const auto& r : regions) {
      layout.push_back({{"region", r.name}, {"start_block", r.start}, {"blocks", r.blocks}});
    }
    j["layout"] = layout;
    json sbs = json::array();
    for (const auto& c : copies) {
      sbs.push_back({{"block", c.addr},
                     {"ok", c.status.ok()},
                     {"error", c.status.ok() ? "" : c.status.message()}});
    }
    j["superblocks"] = sbs;
    PrintJson(j);
    return kExitOk;
  }

  std::string sb_state;
  for (const auto& c : copies) {
    if (!sb_state.empty()) sb_state += ", ";
    sb_state += "block " + std::to_string(c.addr) + (c.status.ok() ? " ok" : " DAMAGED");
  }
  auto line = [](const std::string& label, const std::string& value) {
    std::cout << label << std::string(15 - label.size(), ' ') << value << '\n';
  };
  line("volume", spec);
  line("uuid", UuidToString(sb.uuid));
  line("version", version);
  line("size", HumanSize(sb.total_blocks * kBlockSize) + " (" + std::to_string(sb.total_blocks) +
                   " blocks of " + std::to_string(sb.block_size) + " bytes)");
  line("hash", HashAlgoName(sb.hash_algo));
  line("max hosts", std::to_string(sb.max_hosts));
  line("created", Iso8601(sb.created_ns));
  line("superblocks", sb_state);
  line("inodes", std::to_string(sb.inode_count) + " (" + Count(stats->files, "file") + ")");
  line("groups", std::to_string(sb.group_count));
  line("data", HumanSize(sb.DataBlocks() * kBlockSize));
  line("free", HumanSize(stats->free_blocks * kBlockSize));
  std::cout << "layout:\n";
  for (const auto& r : regions) {
    std::string range = std::to_string(r.start) + "-" + std::to_string(r.start + r.blocks - 1);
    char text[80];
    std::snprintf(text, sizeof text, "  %-12s blocks %-16s", r.name, range.c_str());
    std::string row = text + r.note;
    while (!row.empty() && row.back() == ' ') row.pop_back();
    std::cout << row << '\n';
  }
  return kExitOk;
}

// ---------------------------------------------------------------- stats

int RunStats(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.AddPositional("VOL", kVolHelp);
  parser.options()("json", po::bool_switch(), "print a JSON object");
  parser.SetDetails(
      "logical:  data blocks mapped by the VM files (what the files hold)\n"
      "physical: distinct data blocks those files use on the device (a shared\n"
      "          block counts once; dede's own files are not counted here)\n"
      "savings:  logical - physical, as a % of logical\n"
      "index:    fingerprint index entries (unique: one block known; shared: a\n"
      "          block several places share) and the index files' size\n"
      "arena:    references the index holds to shared blocks (no data of its own)\n"
      "overhead: what deduplication costs in space: index files, the arenas'\n"
      "          block maps and the write logs, as a % of logical\n"
      "metadata: fixed regions (superblocks, leases, journals, inodes, refcounts)\n"
      "          plus every file's block map");
  if (auto rc = parser.Parse(args)) return *rc;

  auto opened = OpenVolume(parser.positional(0), /*read_only=*/true);
  if (!opened.ok()) return Fail(cmd, opened.status());
  Volume* vol = opened->volume.get();
  auto space = SummarizeSpace(vol);
  if (!space.ok()) return Fail(cmd, space.status());
  const VolumeStats& s = space->stats;
  const IndexSummary& ix = space->index;
  const uint64_t regular_files = space->regular_files, logical_blocks = space->logical_blocks;
  const uint64_t internal_files = space->internal_files, log_files = space->log_files;
  const uint64_t log_blocks = space->log_blocks, physical_blocks = space->physical_blocks;
  const uint64_t logical = logical_blocks * kBlockSize;
  const uint64_t physical = physical_blocks * kBlockSize;
  const uint64_t saved = logical > physical ? logical - physical : 0;
  const double savings_pct =
      logical == 0 ? 0.0 : 100.0 * static_cast<double>(saved) / static_cast<double>(logical);
  const uint64_t metadata_blocks = s.fixed_metadata_blocks + s.pointer_blocks;
  const uint64_t log_bytes = log_blocks * kBlockSize;
  const uint64_t arena_map_bytes = ix.arena_pointer_blocks * kBlockSize;
  const uint64_t overhead = ix.index_bytes() + arena_map_bytes + log_bytes;
  const double overhead_pct =
      logical == 0 ? 0.0 : 100.0 * static_cast<double>(overhead) / static_cast<double>(logical);

  if (parser.flag("json")) {
    json j;
    j["logical_bytes"] = logical;
    j["logical_blocks"] = logical_blocks;
    j["physical_bytes"] = physical;  // == physical_data_bytes
    j["physical_blocks"] = physical_blocks;
    j["physical_data_bytes"] = physical;
    j["physical_data_blocks"] = physical_blocks;
    j["saved_bytes"] = saved;
    j["savings_percent"] = savings_pct;
    j["shared_blocks"] = s.shared_blocks;
    j["used_blocks"] = s.used_blocks;
    j["pending_drops"] = s.pending_drops;
    j["free_bytes"] = s.free_blocks * kBlockSize;
    j["free_blocks"] = s.free_blocks;
    j["data_capacity_bytes"] = s.data_blocks * kBlockSize;
    j["total_bytes"] = s.total_blocks * kBlockSize;
    j["files"] = regular_files;
    j["internal_files"] = internal_files;
    j["inodes_total"] = s.inodes_total;
    j["metadata_bytes"] = metadata_blocks * kBlockSize;
    j["fixed_metadata_bytes"] = s.fixed_metadata_blocks * kBlockSize;
    j["pointer_blocks"] = s.pointer_blocks;
    j["pointer_bytes"] = s.pointer_blocks * kBlockSize;
    j["index_shards"] = ix.shards;
    j["index_empty_ranges"] = ix.empty_ranges;
    j["index_busy_shards"] = ix.busy_shards;
    j["index_unreadable_shards"] = ix.unreadable_shards;
    j["index_entries"] = ix.entries;
    j["index_unique_entries"] = ix.unique_entries;
    j["index_shared_entries"] = ix.shared_entries;
    j["index_shard_files"] = ix.shard_files;
    j["index_pending_files"] = ix.pending_files;
    j["index_pending_records"] = ix.pending_records;
    j["index_stale_files"] = ix.stale_files;
    j["index_blocks"] = ix.index_blocks();
    j["index_bytes"] = ix.index_bytes();
    j["arena_files"] = ix.arena_files;
    j["arena_blocks"] = ix.arena_blocks;
    j["arena_only_blocks"] = ix.arena_only_blocks;
    j["arena_pointer_blocks"] = ix.arena_pointer_blocks;
    j["arena_pointer_bytes"] = arena_map_bytes;
    j["arena_busy_files"] = ix.busy_arenas;
    j["write_log_files"] = log_files;
    j["write_log_bytes"] = log_bytes;
    j["metadata_overhead_bytes"] = overhead;
    j["metadata_overhead_percent"] = overhead_pct;
    PrintJson(j);
    return kExitOk;
  }

  auto line = [](const std::string& label, const std::string& value) {
    std::cout << label << std::string(11 - label.size(), ' ') << value << '\n';
  };
  line("logical", HumanSize(logical));
  line("physical",
       HumanSize(physical) + " (" + std::to_string(s.shared_blocks) + " blocks shared)");
  line("savings", Percent(savings_pct) + " (" + HumanSize(saved) + ")");
  if (s.pending_drops > 0) {
    line("pending", Count(s.pending_drops, "deferred reference drop") +
                        " (counted in physical until their hosts apply them)");
  }
  line("free",
       HumanSize(s.free_blocks * kBlockSize) + " of " + HumanSize(s.data_blocks * kBlockSize));
  line("files", std::to_string(regular_files) + " (+ " + std::to_string(internal_files) +
                    " internal) of " + std::to_string(s.inodes_total) + " inodes");
  std::string shards = Count(ix.shards, "shard");
  if (ix.busy_shards) shards += ", " + std::to_string(ix.busy_shards) + " busy (not counted)";
  if (ix.unreadable_shards) shards += ", " + std::to_string(ix.unreadable_shards) + " unreadable";
  line("index", Entries(ix.entries) + " (" +
                    std::to_string(ix.unique_entries) + " unique, " +
                    std::to_string(ix.shared_entries) + " shared) in " + shards + ", " +
                    HumanSize(ix.index_bytes()) + "; " +
                    Count(ix.pending_records, "pending record") +
                    (ix.stale_files ? "; " + Count(ix.stale_files, "stale file") : ""));
  line("arena", Count(ix.arena_blocks, "shared block reference") + " in " +
                    Count(ix.arena_files, "arena") +
                    (ix.arena_only_blocks
                         ? " (" + std::to_string(ix.arena_only_blocks) + " no file uses any more)"
                         : ""));
  line("overhead", HumanSize(overhead) + " (" + Percent(overhead_pct) + " of logical: index " +
                       HumanSize(ix.index_bytes()) + ", arena maps " + HumanSize(arena_map_bytes) +
                       ", write logs " + HumanSize(log_bytes) + ")");
  line("metadata", HumanSize(metadata_blocks * kBlockSize) + " (fixed " +
                       HumanSize(s.fixed_metadata_blocks * kBlockSize) + ", block maps " +
                       HumanSize(s.pointer_blocks * kBlockSize) + ")");
  return kExitOk;
}

// ---------------------------------------------------------------- fsck

int RunFsck(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.AddPositional("VOL", kVolHelp);
  parser.options()("repair", po::bool_switch(), "fix what is safe to fix")(
      "json", po::bool_switch(), "print a JSON object");
  parser.SetDetails(
      "Checks the volume's metadata, then the dedup index (every shard version,\n"
      "pending file and write log; see dede stats). Index damage never touches\n"
      "file data: --repair removes damaged or stale index files (their entries\n"
      "are only hints); 'dede dedup --rescan' then rebuilds the index from the\n"
      "files. Write logs are never changed by fsck: a dedup pass skips their\n"
      "bad frames and consumes the rest.\n"
      "On a terminal, progress through the long steps (the block maps, the\n"
      "reference counts) goes to stderr.\n"
      "Exit status 0 when the volume is clean or every problem was repaired,\n"
      "1 when problems remain. Without --repair the volume is opened read-only.");
  if (auto rc = parser.Parse(args)) return *rc;
  const std::string& spec = parser.positional(0);
  const bool repair = parser.flag("repair");

  // A free slot whose journal headers are both damaged would fail every
  // open; fsck passes over it, reports it, and --repair resets it.
  auto opened = OpenVolume(spec, /*read_only=*/!repair, /*pass_damaged_journals=*/true);
  if (!opened.ok()) return Fail(cmd, opened.status());
  // One progress line per step, replaced when the next step starts.
  std::unique_ptr<Progress> shown;
  std::string shown_step;
  auto progress = [&](const FsckProgress& p) {
    if (!shown || shown_step != p.step) {
      shown.reset();  // clears the previous step's line
      shown_step = p.step;
      shown = std::make_unique<Progress>("checking " + shown_step, p.total);
    }
    shown->Update(p.done);
  };
  auto report = CheckVolume(opened->volume.get(), repair, progress);
  shown.reset();
  if (!report.ok()) return Fail(cmd, report.status());
  if (repair) {
    Status st = opened->volume->Sync();
    if (!st.ok()) return Fail(cmd, st.WithContext("saving repairs"));
  }
  // The index: a failure to check it (say, on a badly damaged volume) is
  // one more problem, not the end of the report.
  IndexCheckReport ix;
  auto ix_report = CheckIndex(opened->volume.get(), repair);
  if (ix_report.ok()) {
    ix = std::move(*ix_report);
  } else {
    IndexProblem p;
    p.where = "index";
    p.what = "could not be checked: " + ix_report.status().message();
    ix.problems.push_back(std::move(p));
  }
  if (repair) {
    Status st = opened->volume->Sync();
    if (!st.ok()) return Fail(cmd, st.WithContext("saving repairs"));
  }

  uint64_t repaired = 0, found = report->problems.size() + ix.problems.size();
  uint64_t log_remaining = 0;
  for (const auto& p : report->problems) repaired += p.repaired ? 1 : 0;
  for (const auto& p : ix.problems) {
    repaired += p.repaired ? 1 : 0;
    if (!p.repaired && p.kind == IndexProblem::Kind::kWriteLog) log_remaining++;
  }
  const uint64_t remaining = found - repaired;

  if (parser.flag("json")) {
    json j;
    j["volume"] = spec;
    j["clean"] = remaining == 0;
    j["problems_found"] = found;
    j["repaired"] = repaired;
    j["remaining"] = remaining;
    j["files"] = report->files;
    j["mapped_blocks"] = report->mapped_blocks;
    j["metadata_blocks"] = report->metadata_blocks;
    json problems = json::array();
    for (const auto& p : report->problems) {
      problems.push_back(
          {{"part", "volume"}, {"where", p.where}, {"what", p.what}, {"repaired", p.repaired}});
    }
    for (const auto& p : ix.problems) {
      problems.push_back({{"part", "index"},
                          {"file", p.file},
                          {"where", p.where},
                          {"what", p.what},
                          {"repaired", p.repaired}});
    }
    j["problems"] = problems;
    j["index"] = {{"shards_checked", ix.shards_checked},
                  {"entry_blocks_checked", ix.entry_blocks_checked},
                  {"entries_checked", ix.entries_checked},
                  {"pending_files_checked", ix.pending_files_checked},
                  {"write_logs_checked", ix.logs_checked},
                  {"write_log_frames_checked", ix.log_frames_checked},
                  {"busy_files", ix.busy},
                  {"newer_format_files", ix.newer}};
    PrintJson(j);
  } else {
    for (const auto& p : report->problems) {
      std::cout << p.where << ": " << p.what << (p.repaired ? " [repaired]" : "") << '\n';
    }
    for (const auto& p : ix.problems) {
      std::cout << p.where << ": " << p.what << (p.repaired ? " [repaired]" : "") << '\n';
    }
    for (const auto& name : ix.busy) std::cout << name << ": in use, not checked\n";
    for (const auto& name : ix.newer) {
      std::cout << name << ": newer format version than this dede supports, left alone\n";
    }
    std::cout << spec << ": " << Count(report->files, "file") << ", "
              << Count(report->mapped_blocks, "mapped block") << ", "
              << Count(report->metadata_blocks, "metadata block") << ", "
              << Count(ix.shards_checked, "index shard") << " ("
              << Entries(ix.entries_checked) << "), "
              << Count(ix.logs_checked, "write log") << " checked: ";
    if (found == 0) {
      std::cout << "clean\n";
    } else {
      std::cout << Count(found, "problem") << ", " << repaired << " repaired\n";
    }
  }
  std::cout.flush();
  if (remaining > 0) {
    std::string hint;
    if (remaining > log_remaining) {
      hint = repair ? "" : "run with --repair to fix what is safe to fix";
    }
    if (log_remaining > 0) {
      hint += std::string(hint.empty() ? "" : "; ") +
              "'dede dedup' consumes the damaged write logs";
    }
    return Fail(cmd, Count(remaining, "problem") + " remain" + (remaining == 1 ? "s" : "") +
                         (hint.empty() ? "" : " (" + hint + ")"));
  }
  return kExitOk;
}

}  // namespace dede::cli
