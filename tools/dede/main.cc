// dede: the command line for dede volumes. main() looks the command up in
// the table below and hands it the remaining arguments; each handler parses
// its own options (see cli.h) and returns the exit code.
#include <exception>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "tools/dede/cli.h"
#include "volume/format.h"

namespace dede::cli {
namespace {

constexpr Command kCommands[] = {
    {"format",
     "VOL [--max-hosts N] [--hash xxh128|sha256] [--locks local|sanlock] [--lease-path PATH] "
     "[--force]",
     "Write a new, empty dede volume on VOL.", RunFormat},
    {"info", "VOL [--json]", "Show the volume's superblock: identity, version, layout, space.",
     RunInfo},
    {"create", "VOL NAME --size SIZE", "Create an empty (thin) file of SIZE bytes.", RunCreate},
    {"import", "VOL NAME RAWFILE [--size SIZE]",
     "Create NAME and copy a raw disk image into it, leaving zero blocks as holes.", RunImport},
    {"export", "VOL NAME RAWFILE", "Copy a file out of the volume into a raw image.", RunExport},
    {"ls", "VOL [-l] [-a] [--max-log-records N] [--json]",
     "List the volume's files (-l: sizes, allocation, sharing).", RunLs},
    {"rm", "VOL NAME [--force]", "Remove a file and free its blocks.", RunRm},
    {"set", "VOL NAME dedup=on|off [--control PATH]", "Change a file's properties.", RunSet},
    {"stats", "VOL [--json]", "Show space figures: logical, physical, savings, free, overhead.",
     RunStats},
    {"dedup",
     "VOL [--now [--wait] [--control PATH]] [--force] [--rescan] [--fraction F] [--split-after SECONDS] "
     "[--verify bytes|witness] [--json]",
     "Run one deduplication pass of this host now, in the foreground.", RunDedup},
    {"fsck", "VOL [--repair] [--json]", "Check the volume's consistency (and repair it).", RunFsck},
    {"analyze", "RAWFILE... [--json]",
     "Estimate dedup savings of raw images at 4K..1M blocks (no volume needed).", RunAnalyze},
    {"policy", "VOL show [--json] | VOL set KEY=VALUE...",
     "Show or change the volume's dedup policy: windows, rate cap, priority, stability.",
     RunPolicy},
    {"report", "[--history PATH] [--volume UUID] [--since DATE|DURATION] [--last N] [--json]",
     "Show this host's dedup pass history and savings over time.", RunReport},
    {"status", "[--control PATH] [--json]",
     "Ask the local dedupd how it is doing: exports, leases, write monitor, the running pass.",
     RunStatus},
};

const Command* FindCommand(const std::string& name) {
  for (const Command& c : kCommands) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

void PrintToolHelp(std::ostream& out) {
  out << "usage: dede COMMAND [ARGS...]\n"
         "       dede help COMMAND | dede --help | dede --version\n\n"
         "Manage dede deduplicating shared-disk volumes. VOL is a path (file or\n"
         "block device) or iscsi://host[:port]/target-iqn/lun.\n\n"
         "Commands:\n";
  for (const Command& c : kCommands) {
    std::string name = c.name;
    out << "  " << name << std::string(name.size() < 8 ? 8 - name.size() : 1, ' ') << c.summary
        << '\n';
  }
  out << "\nRun 'dede COMMAND --help' for a command's arguments and options.\n"
         "Exit status: 0 success, 1 operational error, 2 usage error.\n";
}

int ToolUsageError(const std::string& message) {
  std::cerr << "dede: " << message << '\n'
            << "usage: dede COMMAND [ARGS...]\n"
            << "Try 'dede --help' for the list of commands." << std::endl;
  return kExitUsage;
}

int Main(const std::vector<std::string>& args) {
  if (args.empty()) return ToolUsageError("missing command");
  const std::string& first = args[0];
  if (first == "--help" || first == "-h") {
    PrintToolHelp(std::cout);
    return kExitOk;
  }
  if (first == "--version") {
    std::cout << "dede " << DEDE_VERSION << " (volume format " << kFormatMajor << "."
              << kFormatMinor << ")\n";
    return kExitOk;
  }
  if (first == "help") {
    if (args.size() == 1) {
      PrintToolHelp(std::cout);
      return kExitOk;
    }
    if (args.size() > 2) return ToolUsageError("help takes one command name");
    const Command* cmd = FindCommand(args[1]);
    if (cmd == nullptr) return ToolUsageError("unknown command '" + args[1] + "'");
    return cmd->run(*cmd, {"--help"});
  }
  if (!first.empty() && first[0] == '-') return ToolUsageError("unknown option '" + first + "'");
  const Command* cmd = FindCommand(first);
  if (cmd == nullptr) return ToolUsageError("unknown command '" + first + "'");
  return cmd->run(*cmd, std::vector<std::string>(args.begin() + 1, args.end()));
}

}  // namespace
}  // namespace dede::cli

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  // Handlers report errors as Status values; anything thrown past them (out
  // of memory, a library bug) still ends in one line and exit 1, not abort.
  try {
    return dede::cli::Main(args);
  } catch (const std::bad_alloc&) {
    std::cerr << "dede: out of memory" << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "dede: internal error: " << e.what() << std::endl;
  }
  return dede::cli::kExitFailure;
}
