// Shared plumbing of the `dede` command line: the command table entry,
// per-command argument parsing (Boost.Program_options behind a small
// wrapper that turns every parse failure into a usage error), size parsing
// and printing, error reporting with the tool's exit codes, and the
// progress meter used by import and export.
//
// Exit codes (docs: /work/shared/DESIGN.md): 0 success, 1 operational error
// with exactly one line on stderr, 2 usage error (a message, the command's
// usage line and a hint, on stderr).
#pragma once

#include <unistd.h>

#include <atomic>
#include <boost/program_options.hpp>
#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "util/fd_closer.h"
#include "util/status.h"
#include "util/units.h"
#include "volume/volume.h"

namespace dede::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

struct Command;
using CommandHandler = int (*)(const Command& cmd, const std::vector<std::string>& args);

// One row of the command table in main.cc.
struct Command {
  const char* name;
  const char* synopsis;  // arguments after "dede <name> ", for usage lines
  const char* summary;   // one line for `dede --help`
  CommandHandler run;
};

// Handlers (cmd_volume.cc, cmd_files.cc, cmd_transfer.cc, cmd_analyze.cc). Each gets the
// arguments after the command name and returns the exit code.
int RunFormat(const Command& cmd, const std::vector<std::string>& args);
int RunInfo(const Command& cmd, const std::vector<std::string>& args);
int RunStats(const Command& cmd, const std::vector<std::string>& args);
int RunFsck(const Command& cmd, const std::vector<std::string>& args);
int RunCreate(const Command& cmd, const std::vector<std::string>& args);
int RunLs(const Command& cmd, const std::vector<std::string>& args);
int RunRm(const Command& cmd, const std::vector<std::string>& args);
int RunSet(const Command& cmd, const std::vector<std::string>& args);
int RunImport(const Command& cmd, const std::vector<std::string>& args);
int RunExport(const Command& cmd, const std::vector<std::string>& args);
int RunAnalyze(const Command& cmd, const std::vector<std::string>& args);
int RunDedup(const Command& cmd, const std::vector<std::string>& args);
// cmd_policy.cc: the volume's dedup policy (agent/dedup_policy.h).
int RunPolicy(const Command& cmd, const std::vector<std::string>& args);
// cmd_report.cc: the local pass history (agent/pass_history.h).
int RunReport(const Command& cmd, const std::vector<std::string>& args);
// cmd_status.cc: asks the local dedupd over its control socket.
int RunStatus(const Command& cmd, const std::vector<std::string>& args);

// ---------------------------------------------------------------- errors

// Prints "dede: <command>: <message>" (newlines folded, so it stays one
// line) on stderr and returns kExitFailure.
int Fail(const Command& cmd, const std::string& message);
int Fail(const Command& cmd, const Status& st);

// Prints "dede: <command>: <message>", the command's usage line and a hint
// on stderr and returns kExitUsage.
int UsageError(const Command& cmd, const std::string& message);

// ---------------------------------------------------------------- parsing

// Per-command argument parser. Every command accepts --help/-h. Options are
// declared through options(); positional arguments, all required, through
// AddPositional() in order.
class ArgParser {
 public:
  explicit ArgParser(const Command& cmd);

  boost::program_options::options_description_easy_init options() { return options_.add_options(); }
  void AddPositional(const std::string& name, const std::string& help);
  // Extra text for --help, after the option list.
  void SetDetails(std::string details) { details_ = std::move(details); }

  // Returns nullopt when the command should run; otherwise the exit code to
  // return at once (help printed: kExitOk; usage error printed: kExitUsage).
  std::optional<int> Parse(const std::vector<std::string>& args);

  const std::string& positional(size_t i) const { return positional_values_.at(i); }
  bool flag(const std::string& name) const;
  std::optional<std::string> value(const std::string& name) const;

  void PrintHelp() const;

 private:
  const Command& cmd_;
  boost::program_options::options_description options_;
  std::vector<std::pair<std::string, std::string>> positional_names_;  // name, help
  std::vector<std::string> positional_values_;
  boost::program_options::variables_map vm_;
  std::string details_;
};


// "512 B", "4.0 KiB", "12.3 MiB", ...
std::string HumanSize(uint64_t bytes);
// "1 file", "3 files"
std::string Count(uint64_t n, const std::string& noun);
// "0.8 s", "12 s", "3 min 05 s"
std::string HumanDuration(double seconds);

// Prints `j` on stdout, indented. File names are arbitrary bytes: invalid
// UTF-8 is replaced (U+FFFD) rather than failing the whole listing.
void PrintJson(const nlohmann::json& j);

// ---------------------------------------------------------------- volumes

// Opens VOL (a path or iscsi:// URL) and its volume.
// Opens VOL. A volume formatted with --locks sanlock is opened through the
// sanlock backend with this host's id and lease path from the environment
// (DEDE_HOST_ID, DEDE_LEASE_PATH, DEDE_LEASE_IO_TIMEOUT).
// Names that begin with ".dede-" belong to dede's own files (policy,
// index shards, arenas, write logs, merge requests). A usage message if
// `name` is one, or no file can have it (ValidateFileName), for the
// commands that create or change files.
std::optional<std::string> ReservedName(const std::string& name);

// `pass_damaged_journals`: OpenOptions' (fsck only).
Result<OpenedVolume> OpenVolume(const std::string& spec, bool read_only,
                                bool pass_damaged_journals = false);
// DEDE_INITIATOR_NAME: the iSCSI initiator name for iscsi:// volumes (empty:
// the default, DeviceOptions::iscsi_initiator_name).
std::string IscsiInitiatorFromEnv();
// kInvalid if a variable is set to something that is not a number in range.
Result<SanlockOptions> SanlockOptionsFromEnv();

// ---------------------------------------------------------------- progress

// Progress meter for long copies: on a terminal stderr it redraws one line
// (percentage, MiB/s, ETA) with '\r' at most ten times a second; elsewhere
// it stays silent. Finish() clears the line so that what follows starts at
// column 0.
class Progress {
 public:
  Progress(std::string verb, uint64_t total_bytes);
  ~Progress() { Finish(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void Update(uint64_t done_bytes);
  void Finish();
  double elapsed_seconds() const;

 private:
  void Draw(uint64_t done_bytes);

  std::string verb_;
  uint64_t total_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

// Bytes per second as "80 MiB/s" (or "-" when no time passed).
std::string HumanRate(uint64_t bytes, double seconds);

// A heap buffer aligned for O_DIRECT devices.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t size);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint8_t* data() { return data_; }
  size_t size() const { return size_; }

 private:
  uint8_t* data_;
  size_t size_;
};

// While alive, SIGINT and SIGTERM set a flag instead of killing the process,
// so a long copy can stop between chunks and clean up after itself. The
// handlers reset themselves: a second signal kills as usual (a copy stuck
// in device I/O stays interruptible).
class InterruptGuard {
 public:
  InterruptGuard();
  ~InterruptGuard();
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;
  bool interrupted() const;
  // The same flag, for code that polls an atomic (DedupOptions::stop).
  const std::atomic<bool>* flag() const;
};

using dede::FdCloser;

// Size of an open regular file or block device.
Result<uint64_t> SizeOfFd(int fd, const std::string& path);

}  // namespace dede::cli
