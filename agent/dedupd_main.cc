// dedupd: the per-host dede daemon. Serves every regular file of a volume as
// an NBD export, fingerprints what VMs write (write monitor), keeps the
// per-file write logs on the volume, runs dedup passes and applies merge
// requests in the volume policy's windows (throttled to its rate cap),
// answers `dede status` on a control socket, records its passes for
// `dede report` and serves Prometheus metrics on loopback.
#include <signal.h>
#include <sys/resource.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdio>
#include <deque>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

#include "agent/control_server.h"
#include "agent/dedup_pass.h"
#include "agent/dedup_policy.h"
#include "agent/dedup_stats_json.h"
#include "agent/export_table.h"
#include "agent/io_throttle.h"
#include "agent/lockspace_guard.h"
#include "agent/log_flusher.h"
#include "agent/metrics_server.h"
#include "agent/nbd_server.h"
#include "agent/pass_history.h"
#include "agent/pass_scheduler.h"
#include "agent/sd_notify.h"
#include "index/index_check.h"
#include "kmod/writemon/write_monitor.h"
#include "util/io_budget.h"
#include "util/log.h"
#include "util/repeated_failure.h"
#include "util/units.h"
#include "volume/format.h"
#include "volume/sanlock_lock_manager.h"
#include "volume/volume.h"

namespace po = boost::program_options;
namespace asio = boost::asio;

namespace dede {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
// At shutdown, how long parked write-log changes are tried again while
// their log is held elsewhere (LogFlusher::FlushParked).
constexpr double kParkedLogWaitAtExitS = 10;

// The status reply's read-ahead counters, per export and host-wide.
nlohmann::json ReadAheadJson(const ReadAheadStats& ra) {
  return {{"prefetches", ra.prefetches},
          {"hits", ra.hits},
          {"wasted", ra.wasted},
          {"bytes", ra.bytes_prefetched},
          {"no_budget", ra.no_budget}};
}

const char kUsage[] =
    "usage: dedupd --volume VOL --host-id N --socket PATH [options]\n"
    "\n"
    "Serves every file of the dede volume VOL (a path or iscsi:// URL) as an NBD\n"
    "export named after the file, on the Unix socket PATH (and, with --tcp-port,\n"
    "on 127.0.0.1). A VM's disk is nbd+unix:///NAME?socket=PATH. The first client\n"
    "of an export takes the file's lock; another dedupd or host asking for the same\n"
    "export is refused until every client here has disconnected.\n"
    "Fully written 4 KiB blocks are fingerprinted in memory and logged per file on\n"
    "the volume for later dedup passes. Dedup passes and merge requests run in the\n"
    "windows of the volume's policy (dede policy VOL show), at its rate cap and\n"
    "priority; `dede dedup --now` or SIGUSR1 runs a pass at once; SIGHUP re-reads\n"
    "the policy at once (options are not re-read). `dede status` asks this daemon\n"
    "over --control; `dede report` reads --history. SIGTERM or SIGINT drains\n"
    "requests, flushes logs and data, releases locks and exits 0.\n"
    "SEC options take 0.001 to 2592000 seconds (30 days), or 0 where their help\n"
    "says what 0 means (--lease-io-timeout: whole seconds, at most 300). Exit 2: a\n"
    "usage or configuration error (also a host id beyond the volume's max-hosts);\n"
    "exit 1: any other failure.\n";

struct Config {
  std::string volume;
  uint32_t host_id = 0;
  std::string socket;
  int tcp_port = -1;
  size_t threads = 8;
  uint32_t iscsi_sessions = 4;  // iscsi:// volumes: sessions to the LUN
  std::string initiator_name;   // iscsi:// volumes: empty = open-iscsi's, else made up
  double sync_interval = 1.0;
  double log_flush_interval = 30.0;
  uint64_t log_flush_bytes = 1 << 20;
  uint64_t monitor_memory = uint64_t{64} << 20;
  WriteLogLimit write_log_limit;
  bool write_monitor = true;
  uint64_t read_ahead = uint64_t{2} << 20;
  uint64_t read_ahead_memory = uint64_t{64} << 20;
  double dedup_interval = 0;  // 0: only on SIGUSR1
  double dedup_fraction = 0.05;
  std::string lease_path;   // sanlock volumes: the LUN as a path
  uint32_t lease_io_timeout = 0;  // sanlock io_timeout (s); 0: daemon default
  double fence_after = 0;   // sanlock volumes: exit when the lockspace cannot be confirmed for SEC
  double merge_interval = 10;  // apply merge requests for served files; 0: only at passes
  double open_wait = 30;       // a client's export open waits this long for a busy file
  double drain_timeout = 10;  // shutdown: how long a client may take to read its last replies
  double handshake_timeout = 30;  // a client idle in the NBD handshake is closed after this
  uint64_t max_connections = 1024;  // NBD connections open at once
  uint64_t nbd_memory = uint64_t{1} << 30;  // READ/WRITE data of all NBD connections
  double nbd_stall_timeout = 60;  // a stalled client holding --nbd-memory others need: closed
  bool max_connections_given = false;
  double split_after = 30;     // split a shard whose last update took longer (seconds)
  double window_interval = 600;  // inside a policy window: seconds between passes
  double policy_refresh = 30;    // re-read the volume's policy every SEC
  std::string control = kDefaultControlPath;
  bool control_given = false;
  size_t control_max_connections = kDefaultControlMaxConnections;
  // At the limit, a new control client takes the place of one idle this long.
  double control_idle_evict = double(kControlIdleEvict.count()) / 1000;
  std::string history = kDefaultHistoryPath;
  bool history_given = false;
  int metrics_port = 9187;       // -1: off
  bool metrics_given = false;
  LogLevel log_level = LogLevel::kInfo;
};

int UsageError(const std::string& msg) {
  std::fprintf(stderr, "dedupd: %s\n(try dedupd --help)\n", msg.c_str());
  return kExitUsage;
}

// A size option's value, or why not: a value that is no size at all is
// told apart from one out of range (both used to say "need a size of at
// least 4K"). `bounds` is how the error states the range ("at least 4K").
std::optional<std::string> ParseSizeOption(const char* option, const std::string& text,
                                           uint64_t min, uint64_t max, const char* bounds,
                                           uint64_t* out) {
  const std::optional<uint64_t> v = ParseSize(text);
  if (!v) {
    return std::string("--") + option + ": '" + text + "' is not a size (" + kSizeSyntax + ")";
  }
  if (*v < min || *v > max) return std::string("--") + option + ": " + bounds + ", not " + text;
  *out = *v;
  return std::nullopt;
}

// Every option in seconds takes 1 ms to 30 days (the usage error says so),
// and 0 where its help says what 0 means: timers take them in whole
// microseconds of an int64.
constexpr double kMinDurationS = 0.001;
constexpr double kMaxDurationS = 30 * 86400;

struct DurationOption {
  const char* name;
  double value;
  bool zero_allowed;
};

bool DurationInRange(double s, bool zero_allowed) {
  if (zero_allowed && s == 0) return true;
  return std::isfinite(s) && s >= kMinDurationS && s <= kMaxDurationS;
}

// A whole-number option given as text: true when it is decimal digits only
// (no sign) for a value from `lo` to `hi`, stored in *out.
template <typename T>
bool ParseWhole(const std::string& text, uint64_t lo, uint64_t hi, T* out) {
  const std::optional<uint64_t> v = ParseUnsigned(text);
  if (!v || *v < lo || *v > hi) return false;
  *out = static_cast<T>(*v);
  return true;
}

// Returns an exit code, or -1 to go on.
int ParseArgs(int argc, char** argv, Config* cfg) {
  std::string tcp_port, flush_bytes, memory, log_level, config_file, metrics_port, read_ahead,
      read_ahead_memory, write_log_min, nbd_memory;
  // Whole numbers are read as text (ParseWhole): Boost reads "-1" into an
  // unsigned option as 2^32 - 1.
  std::string host_id, lease_io_timeout, threads, iscsi_sessions, write_log_limit, max_connections,
      control_max_connections;
  bool no_write_monitor = false;
  po::options_description opts("options");
  // One option per line:
  // clang-format off
  opts.add_options()
      ("help,h", "show this help")
      ("version", "print the version")
      ("volume", po::value(&cfg->volume)->value_name("VOL"), "volume: path or iscsi://host[:port]/iqn/lun")
      ("host-id", po::value(&host_id)->value_name("N"), "this host's slot on the volume (1..max-hosts)")
      ("lease-path", po::value(&cfg->lease_path)->value_name("PATH"), "sanlock volumes: the LUN as a path for sanlock (block device; in tests the file backing the LUN); default VOL when VOL is a path")
      ("lease-io-timeout", po::value(&lease_io_timeout)->value_name("SEC"), "sanlock volumes: io_timeout of this host's lockspace membership when it joins (default: the daemon's, 10); once joined, the membership keeps the io_timeout of the process that joined first, and dedupd uses that one")
      ("fence-after", po::value(&cfg->fence_after)->value_name("SEC"), "sanlock volumes: stop (exit) when this host's lease was last seen renewed SEC seconds ago (default 8 x io_timeout + 30, before other hosts may call this one dead at 8 x io_timeout + 60; at least 4 x io_timeout + 4; 0: that default)")
      ("socket", po::value(&cfg->socket)->value_name("PATH"), "Unix socket to serve NBD on")
      ("tcp-port", po::value(&tcp_port)->value_name("PORT"), "also serve NBD on 127.0.0.1:PORT (0: any free port), to the local users the Unix socket admits (root, its owner, members of its group)")
      ("config", po::value(&config_file)->value_name("FILE"), "read options from FILE (lines: name = value)")
      ("threads", po::value(&threads)->value_name("N"), "worker threads for volume I/O (default 8)")
      ("initiator-name", po::value(&cfg->initiator_name)->value_name("IQN"), "iscsi:// volumes: the iSCSI initiator name to log in with, which the target's ACL must admit (default: InitiatorName= in /etc/iscsi/initiatorname.iscsi, else iqn.2026-11.org.dede:HOSTNAME)")
      ("iscsi-sessions", po::value(&iscsi_sessions)->value_name("N"), "iscsi:// volumes: sessions logged in to the LUN, each carrying one command at a time, so up to N volume commands are in flight (default 4)")
      ("sync-interval", po::value(&cfg->sync_interval)->value_name("SEC"), "volume flush point every SEC seconds (default 1)")
      ("log-flush-interval", po::value(&cfg->log_flush_interval)->value_name("SEC"), "append buffered records to write logs every SEC seconds (default 30)")
      ("log-flush-bytes", po::value(&flush_bytes)->value_name("SIZE"), "flush a file's records once they fill SIZE of log (default 1M)")
      ("monitor-memory", po::value(&memory)->value_name("SIZE"), "memory cap of the write monitor's buffers (default 64M)")
      ("write-log-limit", po::value(&write_log_limit)->value_name("PERCENT"), "a file's write log may grow to PERCENT of the file's size (at least --write-log-min) before it stops taking records and marks the whole file changed for the next dedup pass (default 3; 0: no limit)")
      ("write-log-min", po::value(&write_log_min)->value_name("SIZE"), "the least size limit of a write log (default 4M)")
      ("no-write-monitor", po::bool_switch(&no_write_monitor), "serve without fingerprinting writes (benchmarks)")
      ("read-ahead", po::value(&read_ahead)->value_name("SIZE"), "after a sequential READ of up to SIZE with no other READ in flight, read the next one ahead while the reply is sent (default 2M; 0: off)")
      ("read-ahead-memory", po::value(&read_ahead_memory)->value_name("SIZE"), "memory all read-ahead windows of this host may hold at once; a prefetch that does not fit is skipped (default 64M)")
      ("dedup-interval", po::value(&cfg->dedup_interval)->value_name("SEC"), "run a dedup pass every SEC seconds (default 0: only when sent SIGUSR1)")
      ("dedup-fraction", po::value(&cfg->dedup_fraction)->value_name("F"), "rewrite an index shard when its new records exceed F times its entries (default 0.05)")
      ("split-after", po::value(&cfg->split_after)->value_name("SEC"), "split an index shard whose last update took longer than SEC seconds at its next update, so more hosts can update the index at once (default 30)")
      ("open-wait", po::value(&cfg->open_wait)->value_name("SEC"), "a client opening a disk that another host's dedup pass holds for a moment waits up to SEC seconds for it (default 30; a disk a running VM holds elsewhere fails after that; 0: no wait)")
      ("drain-timeout", po::value(&cfg->drain_timeout)->value_name("SEC"), "on SIGTERM, a client that takes none of its replies for SEC seconds loses them and is disconnected, so that a stuck client cannot keep the other disks' locks (default 10; 0: at once, after 0.1 s)")
      ("handshake-timeout", po::value(&cfg->handshake_timeout)->value_name("SEC"), "an NBD client that has not entered an export and sends nothing for SEC seconds is disconnected, so idle connections cannot hold every --max-connections slot (default 30; 0: never)")
      ("max-connections", po::value(&max_connections)->value_name("N"), "NBD connections open at once; one more is closed as soon as it is accepted, and counted (default 1024, and at most what the open-files limit leaves after 64 for the volume and logs; TCP connections waiting for their user check count for TCP)")
      ("nbd-memory", po::value(&nbd_memory)->value_name("SIZE"), "memory the data of NBD READs and WRITEs (replies not yet sent, payloads, partly received ones too) may take across all connections; a request that does not fit waits, its connection reading nothing, until others finish, in arrival order; one larger than SIZE runs alone (default 1G; each connection is also held to 64M)")
      ("nbd-stall-timeout", po::value(&cfg->nbd_stall_timeout)->value_name("SEC"), "an NBD client holding part of --nbd-memory (READ replies it does not take, a WRITE payload it does not finish sending) that sends and receives nothing for SEC seconds is disconnected while other connections wait for room; what it had not been answered for was never acknowledged (default 60; 0: never)")
      ("merge-interval", po::value(&cfg->merge_interval)->value_name("SEC"), "apply merge requests other hosts posted for the files served here every SEC seconds (default 10; 0: only at dedup passes)")
      ("window-interval", po::value(&cfg->window_interval)->value_name("SEC"), "inside a policy window, start the next pass SEC seconds after the previous one ended (default 600; 0: passes back to back, each as soon as the one before ends); after a failed pass, scheduled passes wait at least 2 s, doubling with each failure in a row up to 300 s")
      ("policy-refresh", po::value(&cfg->policy_refresh)->value_name("SEC"), "re-read the volume's dedup policy every SEC seconds (default 30); a re-read that finds it locked is retried every second, up to 5 times")
      ("control", po::value(&cfg->control)->value_name("PATH"), "control socket for `dede status`, `dede set` on running exports and `dede dedup --now` (default /run/dede/dedupd.ctl; 'off': none)")
      ("control-max-connections", po::value(&control_max_connections)->value_name("N"), "control connections open at once (default 64); one more takes the place of the connection idle longest, if it has been idle for --control-idle-evict, else it is answered with a 'too many control connections' error and closed, and counted")
      ("control-idle-evict", po::value(&cfg->control_idle_evict)->value_name("SEC"), "with --control-max-connections open, a new client takes the place of the connection that has received, sent and run nothing for longest, once that is SEC seconds (default 10); idle connections are never closed while no one needs their place")
      ("history", po::value(&cfg->history)->value_name("PATH"), "SQLite database of this host's passes, for `dede report` (default /var/lib/dede/history.db; 'off': none)")
      ("metrics-port", po::value(&metrics_port)->value_name("PORT"), "serve Prometheus metrics on 127.0.0.1:PORT/metrics (default 9187; 0: any free port; 'off': none)")
      ("log-level", po::value(&log_level)->value_name("LEVEL"), "debug, info, warning or error (default info)");
  // clang-format on
  po::variables_map vm;
  try {
    // No positional arguments: without an (empty) description for them,
    // program_options dropped a stray word and dedupd started anyway.
    const po::positional_options_description no_positional;
    po::store(po::command_line_parser(argc, argv).options(opts).positional(no_positional).run(),
              vm);
    po::notify(vm);
  } catch (const po::too_many_positional_options_error&) {
    return UsageError("unexpected argument: dedupd takes options only (--volume VOL ...)");
  } catch (const std::exception& e) {
    return UsageError(e.what());
  }
  if (vm.count("config")) {
    try {
      po::store(po::parse_config_file<char>(config_file.c_str(), opts), vm);
      po::notify(vm);
    } catch (const std::exception& e) {
      return UsageError("configuration file " + config_file + ": " + e.what());
    }
  }
  if (vm.count("help")) {
    std::cout << kUsage << "\n" << opts;
    return kExitOk;
  }
  if (vm.count("version")) {
    std::cout << "dedupd " << DEDE_VERSION << "\n";
    return kExitOk;
  }
  if (cfg->volume.empty()) return UsageError("--volume is required");
  if (host_id.empty()) return UsageError("--host-id is required (1..max-hosts)");
  if (!ParseWhole(host_id, 1, kMaxHosts, &cfg->host_id)) {
    return UsageError("--host-id: a whole number from 1 to max-hosts (at most " +
                      std::to_string(kMaxHosts) + "), not '" + host_id + "'");
  }
  if (cfg->socket.empty() && tcp_port.empty()) return UsageError("--socket is required");
  if (!tcp_port.empty()) {
    auto p = ParseUnsigned(tcp_port);
    if (!p || *p > 65535) return UsageError("--tcp-port: not a port number: " + tcp_port);
    cfg->tcp_port = static_cast<int>(*p);
  }
  struct SizeOption {
    const char* name;
    const std::string& text;
    uint64_t min, max;
    const char* bounds;
    uint64_t* out;
  };
  constexpr uint64_t kNoMax = UINT64_MAX;
  const SizeOption size_options[] = {
      {"log-flush-bytes", flush_bytes, 4096, kNoMax, "at least 4K", &cfg->log_flush_bytes},
      {"monitor-memory", memory, 1 << 20, kNoMax, "at least 1M", &cfg->monitor_memory},
      {"write-log-min", write_log_min, 4096, kNoMax, "at least 4K",
       &cfg->write_log_limit.min_bytes},
      {"read-ahead", read_ahead, 0, uint64_t{64} << 20, "at most 64M (0: off)", &cfg->read_ahead},
      {"nbd-memory", nbd_memory, 1 << 20, kNoMax, "at least 1M", &cfg->nbd_memory},
      {"read-ahead-memory", read_ahead_memory, 0, kNoMax, "any size", &cfg->read_ahead_memory},
  };
  for (const SizeOption& o : size_options) {
    if (o.text.empty()) continue;
    if (auto err = ParseSizeOption(o.name, o.text, o.min, o.max, o.bounds, o.out)) {
      return UsageError(*err);
    }
  }
  if (!write_log_limit.empty() &&
      !ParseWhole(write_log_limit, 0, 100, &cfg->write_log_limit.percent)) {
    return UsageError("--write-log-limit: 0..100 (percent), not '" + write_log_limit + "'");
  }
  if (!log_level.empty()) {
    auto l = ParseLogLevel(log_level);
    if (!l) return UsageError("--log-level: one of debug, info, warning, error");
    cfg->log_level = *l;
  }
  if (!threads.empty() && !ParseWhole(threads, 1, 256, &cfg->threads)) {
    return UsageError("--threads: 1..256, not '" + threads + "'");
  }
  if (!iscsi_sessions.empty() &&
      !ParseWhole(iscsi_sessions, 1, kMaxIscsiSessions, &cfg->iscsi_sessions)) {
    return UsageError("--iscsi-sessions: 1.." + std::to_string(kMaxIscsiSessions) + ", not '" +
                      iscsi_sessions + "'");
  }
  // Every duration, before it reaches a timer (a huge or infinite one
  // wrapped to a negative period, a tiny one rounded to 0: either fired
  // the timer without pause).
  for (const auto& [name, value, zero] :
       std::initializer_list<DurationOption>{{"sync-interval", cfg->sync_interval, false},
                                             {"log-flush-interval", cfg->log_flush_interval, false},
                                             {"dedup-interval", cfg->dedup_interval, true},
                                             {"fence-after", cfg->fence_after, true},
                                             {"merge-interval", cfg->merge_interval, true},
                                             {"open-wait", cfg->open_wait, true},
                                             {"drain-timeout", cfg->drain_timeout, true},
                                             {"handshake-timeout", cfg->handshake_timeout, true},
                                             {"nbd-stall-timeout", cfg->nbd_stall_timeout, true},
                                             {"control-idle-evict", cfg->control_idle_evict, false},
                                             {"split-after", cfg->split_after, false},
                                             {"window-interval", cfg->window_interval, true},
                                             {"policy-refresh", cfg->policy_refresh, false}}) {
    if (!DurationInRange(value, zero)) {
      std::ostringstream msg;
      msg << "--" << name << ": need a number of seconds from 0.001 to 2592000 (30 days)"
          << (zero ? " or 0" : "") << ", not " << value;
      return UsageError(msg.str());
    }
  }
  if (!(cfg->dedup_fraction >= 0)) return UsageError("--dedup-fraction: must be >= 0");
  if (!lease_io_timeout.empty() &&
      !ParseWhole(lease_io_timeout, 0, kMaxLeaseIoTimeoutS, &cfg->lease_io_timeout)) {
    return UsageError("--lease-io-timeout: whole seconds, at most " +
                      std::to_string(kMaxLeaseIoTimeoutS) + " (0: the daemon's), not '" +
                      lease_io_timeout + "'");
  }
  if (!max_connections.empty() &&
      !ParseWhole(max_connections, 1, uint64_t{1} << 32, &cfg->max_connections)) {
    return UsageError("--max-connections: a whole number from 1, not '" + max_connections + "'");
  }
  if (!control_max_connections.empty() &&
      !ParseWhole(control_max_connections, 1, 65536, &cfg->control_max_connections)) {
    return UsageError("--control-max-connections: 1..65536, not '" + control_max_connections + "'");
  }
  cfg->control_given = vm.count("control") > 0;
  cfg->max_connections_given = vm.count("max-connections") > 0;
  cfg->history_given = vm.count("history") > 0;
  cfg->metrics_given = vm.count("metrics-port") > 0;
  if (cfg->control == "off") cfg->control.clear();
  if (cfg->history == "off") cfg->history.clear();
  // Checked here, before the volume open (with sanlock, many seconds),
  // and as the configuration errors they are (exit 2: not restarted).
  for (const auto& [name, path] : {std::pair<const char*, const std::string&>{"socket", cfg->socket},
                                   {"control", cfg->control}}) {
    if (path.size() >= sizeof(sockaddr_un::sun_path)) {
      return UsageError(std::string("--") + name + ": socket path too long (max " +
                        std::to_string(sizeof(sockaddr_un::sun_path) - 1) + " bytes): " + path);
    }
  }
  if (metrics_port == "off") {
    cfg->metrics_port = -1;
  } else if (!metrics_port.empty()) {
    auto p = ParseUnsigned(metrics_port);
    if (!p || *p > 65535) return UsageError("--metrics-port: not a port number: " + metrics_port);
    cfg->metrics_port = static_cast<int>(*p);
  }
  cfg->write_monitor = !no_write_monitor;
  return -1;
}

// Runs `work` on the worker pool every `interval`, never two at once.
class PeriodicJob {
 public:
  PeriodicJob(asio::io_context& io, NbdServer* server, double interval, std::function<void()> work)
      : timer_(io), server_(server), interval_(interval), work_(std::move(work)) {}
  void Start() { Arm(); }
  void Stop() {
    stopped_ = true;
    timer_.cancel();
  }

 private:
  void Arm() {
    if (stopped_) return;
    // ParseArgs keeps intervals within 1 ms..30 days; the clamp keeps the
    // cast defined whatever a caller passes.
    timer_.expires_after(std::chrono::microseconds(
        static_cast<int64_t>(std::clamp(interval_, kMinDurationS, 1e9) * 1e6)));
    timer_.async_wait([this](boost::system::error_code ec) {
      if (ec || stopped_) return;
      server_->RunBlocking([this] {
        work_();
        asio::post(timer_.get_executor(), [this] { Arm(); });
      });
    });
  }
  asio::steady_timer timer_;
  NbdServer* server_;
  double interval_;
  std::function<void()> work_;
  bool stopped_ = false;
};

// Every NBD connection is a descriptor. Raises the open-files limit to
// its hard limit (a host with many VMs needs more than the usual 1024),
// and keeps the connection cap 64 descriptors under it: the volume, its
// iSCSI sessions, the write logs, the control and metrics sockets and the
// history database must still open when the clients have taken the rest.
size_t MaxConnectionsWithin(uint64_t wanted, bool given) {
  constexpr uint64_t kReserved = 64;
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return static_cast<size_t>(wanted);
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  if (lim.rlim_cur == RLIM_INFINITY) return static_cast<size_t>(wanted);
  const uint64_t room = lim.rlim_cur > 2 * kReserved ? lim.rlim_cur - kReserved : lim.rlim_cur / 2;
  if (wanted > room) {
    if (given) {
      LOG(kWarning) << "at most " << room << " NBD connections, not the --max-connections "
                    << wanted << " asked for: the open-files limit is " << lim.rlim_cur;
    } else {
      LOG(kInfo) << "at most " << room << " NBD connections: the open-files limit is "
                 << lim.rlim_cur;
    }
    return static_cast<size_t>(room);
  }
  return static_cast<size_t>(wanted);
}

int Run(const Config& cfg) {
  OpenOptions oo;
  oo.host_id = cfg.host_id;
  // Used when the volume was formatted with --locks sanlock: the volume
  // slot and the lockspace host id are the same number.
  oo.sanlock.host_id = cfg.host_id;
  oo.sanlock.lease_path = cfg.lease_path;
  oo.sanlock.io_timeout_s = cfg.lease_io_timeout;
  oo.iscsi_sessions = cfg.iscsi_sessions;
  oo.iscsi_initiator_name = cfg.initiator_name;
  Result<OpenedVolume> ov = OpenVolumeSpec(cfg.volume, oo);
  if (!ov.ok()) {
    LOG(kError) << "cannot open volume " << cfg.volume << ": " << ov.status().ToString();
    // kInvalid: the configuration does not fit the volume or its target (a
    // host id beyond its max-hosts, a malformed iscsi:// URL, a login the
    // target refuses for CHAP or its ACL, a LUN that is not a disk, a lease
    // path that is not the volume). Starting again cannot help: exit 2,
    // which systemd does not restart (RestartPreventExitStatus=2).
    return ov.status().code() == Status::Code::kInvalid ? kExitUsage : kExitError;
  }
  Volume* vol = ov->volume.get();
  // Hosts sharing a LUN: fence ourselves when our lockspace membership
  // cannot be confirmed (lockspace_guard.h).
  std::unique_ptr<LockspaceGuard> guard;
  if (auto* sl = dynamic_cast<SanlockLockManager*>(vol->lock_manager())) {
    double io = sl->io_timeout_s();
    // Others may call us dead 8 io_timeouts + 60 s (sanlock's compiled-in
    // watchdog fire timeout) after our last renewal; sanlock itself kills
    // us at 8 io_timeouts. The guard is the backstop for a daemon that
    // cannot: it must fire before 8T + 60 s, with room for I/O in flight.
    double fence = cfg.fence_after > 0 ? cfg.fence_after : 8 * io + 30;
    // Timed from the last renewal seen. A healthy lease is renewed about
    // every 2 io_timeouts + 1 s (whole-second stamps), its write may take
    // an io_timeout, and the guard looks every second: its age reaches
    // about 3 io_timeouts + 3 s. CheckLockspace calls up to 4 alive.
    const double floor_s = 4 * io + 4;
    if (fence < floor_s) {
      LOG(kError) << "--fence-after " << fence << ": must be at least 4 io_timeouts + 4 s ("
                  << floor_s << " s with this host's io_timeout of " << io
                  << " s), or a healthy host whose renewal is late would fence itself";
      return kExitUsage;
    }
    // And well before others may call us dead (8 io_timeouts + 60 s), with
    // room for a write in flight to finish: later, two hosts could write
    // the same files where no watchdog resets this one.
    const double ceiling_s = 8 * io + 50;
    if (fence > ceiling_s) {
      LOG(kError) << "--fence-after " << fence << ": must be at most 8 io_timeouts + 50 s ("
                  << ceiling_s << " s with this host's io_timeout of " << io
                  << " s); other hosts may take this host's locks from 8 io_timeouts + 60 s";
      return kExitUsage;
    }
    guard = std::make_unique<LockspaceGuard>(
        sl, std::chrono::milliseconds(static_cast<int64_t>(fence * 1000)));
    LOG(kInfo) << "sanlock host " << sl->sanlock_host_id() << " generation " << sl->generation()
               << ", io_timeout " << io << " s, fencing " << fence
               << " s after the last lease renewal seen";
  }

  WriteMonitorOptions mo;
  mo.algo = vol->superblock().hash_algo;
  mo.memory_cap_bytes = cfg.monitor_memory;
  mo.flush_bytes = cfg.log_flush_bytes;
  WriteMonitor monitor(mo);
  LogFlusher flusher(vol, &monitor, cfg.write_log_limit);
  ExportTable table(vol, cfg.write_monitor ? &monitor : nullptr,
                    cfg.write_monitor ? &flusher : nullptr, cfg.read_ahead,
                    cfg.read_ahead_memory);

  asio::io_context io(1);
  NbdServerOptions so;
  so.unix_socket = cfg.socket;
  so.tcp_port = cfg.tcp_port;
  so.worker_threads = cfg.threads;
  so.open_wait_s = cfg.open_wait;
  so.drain_timeout_s = cfg.drain_timeout;
  so.handshake_timeout_s = cfg.handshake_timeout;
  so.max_connections = MaxConnectionsWithin(cfg.max_connections, cfg.max_connections_given);
  so.memory_budget = cfg.nbd_memory;
  so.stall_timeout_s = cfg.nbd_stall_timeout;
  NbdServer server(io, &table, so);

  // The flush points' outcome: once the device has lost a flush every
  // later one fails too (StickyFlushFailure), each second; logged when it
  // starts or changes, then every 10 minutes, and shown by status.
  RepeatedFailure flush_point_failure("volume flush point", Clock::Real());
  std::mutex flush_point_mu;  // flush_point_failure: the sync job and status
  PeriodicJob sync_job(io, &server, cfg.sync_interval, [&] {
    // Flush point: makes logs and metadata durable and hands cached locks
    // to other processes that asked for them.
    const Status st = vol->Sync();
    bool is_failure = false;
    std::string line;
    {
      std::lock_guard<std::mutex> l(flush_point_mu);
      line = flush_point_failure.Note(st, &is_failure);
    }
    if (!line.empty() && is_failure) LOG(kError) << line;
    if (!line.empty() && !is_failure) LOG(kInfo) << line;
    // A backstop: the monitor wakes the flusher itself when a file's buffer
    // reaches the flush size; this catches a batch put back meanwhile, and
    // closes the logs the flusher kept open since (LogFlusher).
    if (cfg.write_monitor) flusher.WakeAtFlushPoint();
  });
  PeriodicJob flush_job(io, &server, cfg.log_flush_interval, [&] {
    if (cfg.write_monitor) (void)flusher.FlushAll();
  });

  // ------------------------------------------------------------ policy
  // The volume's dedup policy (windows, rate cap, priority, stable-after),
  // re-read every --policy-refresh; every host obeys the same file.
  PassScheduler::Options so_sched;
  so_sched.interval_s = cfg.dedup_interval;
  so_sched.window_interval_s = cfg.window_interval;
  PassScheduler scheduler(Clock::Real(), so_sched);
  IoThrottle throttle(0);
  uint64_t policy_generation = ~0ull;
  // The refresh job and SIGHUP may both run it.
  std::mutex policy_mu;
  // Until the policy was read once, no dedup work runs (PassScheduler):
  // why, for `dede status`, the log and `dede dedup --now`.
  std::mutex policy_error_mu;
  std::string policy_error = "not read yet";
  auto unread_policy_error = [&]() -> std::string {
    if (scheduler.has_policy()) return "";
    std::lock_guard<std::mutex> l(policy_error_mu);
    return policy_error;
  };
  // A re-read that finds the policy file locked (`dede policy set`, or
  // another host reading it, for one read or write) tries again this soon,
  // a few times, rather than only at the next --policy-refresh: a SIGHUP
  // sent right after `dede policy set` must not be lost for 30 s.
  constexpr auto kPolicyLockedRetryIn = std::chrono::seconds(1);
  constexpr int kPolicyLockedRetries = 5;
  asio::steady_timer policy_retry(io);
  bool policy_retry_stopped = false;  // the io thread's: shutdown began
  int policy_locked_retries = 0;      // under policy_mu: retries since the last good read
  std::function<void(const std::string&)> refresh_policy;
  // From a worker: arms the retry on the io thread.
  auto retry_policy_soon = [&] {
    asio::post(io, [&] {
      if (policy_retry_stopped) return;
      policy_retry.expires_after(kPolicyLockedRetryIn);
      policy_retry.async_wait([&](boost::system::error_code ec) {
        if (ec || policy_retry_stopped) return;
        server.RunBlocking([&] { refresh_policy("retry"); });
      });
    });
  };
  // `why`: what asked for the read, for the log.
  refresh_policy = [&](const std::string& why) {
    std::lock_guard<std::mutex> one_at_a_time(policy_mu);
    // Windows are local time: a time-zone change on the host is taken up
    // here (every --policy-refresh, or at SIGHUP) instead of at a restart.
    const std::string zone_change = ReloadTimeZone(Clock::Real()->NowNanos());
    if (!zone_change.empty()) {
      LOG(kInfo) << "host time zone changed: " << zone_change
                 << "; dedup windows follow the new local time";
    }
    Result<DedupPolicy> p = ReadPolicy(vol);
    if (!p.ok()) {
      const bool locked = p.status().code() == Status::Code::kLocked;
      if (!scheduler.has_policy()) {
        // Fail closed: without its windows and rate cap, passes and merge
        // requests would run at any time, uncapped.
        {
          std::lock_guard<std::mutex> l(policy_error_mu);
          policy_error = p.status().ToString();
        }
        LOG(kError) << "cannot read the volume's dedup policy: " << p.status().ToString()
                    << "; no dedup passes or merge requests run until it can be read (trying "
                       "again every "
                    << cfg.policy_refresh << " s, or at SIGHUP; `dede policy VOL show`)";
      } else if (!locked) {
        LOG(kWarning) << "reading the dedup policy: " << p.status().ToString()
                      << " (keeping the previous one)";
      }
      if (!locked) {
        policy_locked_retries = 0;
      } else if (policy_locked_retries < kPolicyLockedRetries) {
        policy_locked_retries++;
        LOG(kInfo) << "re-reading the dedup policy (" << why
                   << ") deferred: " << p.status().ToString() << "; trying again in "
                   << kPolicyLockedRetryIn.count() << " s (retry " << policy_locked_retries
                   << " of " << kPolicyLockedRetries << ")";
        retry_policy_soon();
      } else {
        policy_locked_retries = 0;
        LOG(kWarning) << "re-reading the dedup policy (" << why
                      << ") deferred: " << p.status().ToString() << "; still locked after "
                      << kPolicyLockedRetries
                      << " retries: keeping the previous policy until the next re-read in "
                      << cfg.policy_refresh << " s (--policy-refresh) or SIGHUP";
      }
      return;
    }
    policy_locked_retries = 0;
    scheduler.SetPolicy(*p);
    throttle.SetRate(p->rate_bytes_per_s);
    if (p->generation != policy_generation) {
      policy_generation = p->generation;
      std::string windows;
      for (const DedupWindow& w : p->windows) windows += (windows.empty() ? "" : "; ") + FormatWindow(w);
      LOG(kInfo) << "dedup policy generation " << p->generation << ": windows "
                 << (windows.empty() ? "always" : windows) << ", rate "
                 << PolicyRateText(p->rate_bytes_per_s)
                 << ", priority " << PriorityName(p->priority) << ", stable after "
                 << p->stable_after_s << " s";
    }
  };
  refresh_policy("start");

  // ------------------------------------------------------------ history
  std::unique_ptr<PassHistory> history;
  if (!cfg.history.empty()) {
    Result<std::unique_ptr<PassHistory>> h = PassHistory::Open(cfg.history, true);
    if (h.ok()) {
      history = std::move(*h);
    } else if (cfg.history_given && h.status().code() == Status::Code::kInvalid) {
      // A path that cannot name a history: the configuration's to fix.
      LOG(kError) << "pass history: " << h.status().ToString();
      return kExitUsage;
    } else if (cfg.history_given) {
      // A damaged history, one a newer dede wrote (a downgrade), one busy
      // or unwritable for now: only `dede report` loses by it; the host's
      // VMs must not lose their disks (exit 2 is not restarted).
      LOG(kError) << "pass history: " << h.status().ToString()
                  << "; serving without one (for a damaged file: move it aside to start a new "
                     "history)";
    } else {
      LOG(kWarning) << "no pass history (" << h.status().ToString()
                    << "); give --history PATH to keep one";
    }
  }

  // ------------------------------------------------------------ passes
  // Dedup passes run on a worker, one at a time, when the scheduler says
  // (windows, interval) or an administrator asks. Shutdown cancels the one
  // running and waits for it (it holds exports) before closing files; a
  // window's end stops it (its work is parked, not lost).
  std::atomic<bool> cancel_pass{false};
  std::atomic<bool> stop_pass{false};
  // An opt-out changed: the next pass rewrites every shard so the file's
  // index entries go at once.
  std::atomic<bool> sweep_next_pass{false};
  std::mutex pass_mu;
  // Shards holding records parked because an allocation group was busy on
  // another host: the next pass rewrites them (DedupOptions). Used only by
  // passes, under pass_mu.
  std::set<uint64_t> busy_parked_shards;
  struct PassState {
    std::mutex mu;
    std::string window, progress;
    uint64_t started_ns = 0;
    uint64_t completed = 0, stopped = 0, failed = 0, last_end_ns = 0;
    uint64_t shared_total = 0, reclaimed_total = 0, io_bytes_total = 0;
    uint64_t merge_applied_total = 0;
    uint64_t cow_at_last_pass = 0;
    // Passes begun (a pass's number, `seq`, is this count at its start),
    // and the last 16 ended, for `dede dedup --now --wait`.
    uint64_t started = 0;
    struct Ended {
      uint64_t seq = 0;
      std::string trigger, outcome, error;
      nlohmann::json stats;  // DedupStatsToJson; null when the pass failed
    };
    std::deque<Ended> ended;
  } pass_state;
  const uint64_t started_wall_ns = Clock::Real()->NowNanos();
  // COW specializations of all exports since start (closed exports' counts
  // are folded in when they close).
  auto cow_total = [&] { return table.totals().cow_copies; };
  uint64_t passes = 0;
  auto run_pass = [&](PassTrigger trigger) {
    std::lock_guard<std::mutex> running(pass_mu);
    if (cancel_pass) {
      scheduler.PassEnded();
      return;
    }
    stop_pass = false;
    const DedupPolicy policy = scheduler.policy();
    const uint64_t start_ns = Clock::Real()->NowNanos();
    uint64_t seq = 0;
    {
      std::lock_guard<std::mutex> l(pass_state.mu);
      seq = ++pass_state.started;
      pass_state.window = scheduler.CurrentWindow();
      pass_state.progress = "starting";
      pass_state.started_ns = start_ns;
    }
    // What is buffered goes to the logs first, so the pass sees it.
    if (cfg.write_monitor) (void)flusher.FlushAll();
    DedupOptions po;
    po.rewrite_fraction = cfg.dedup_fraction;
    po.split_threshold_ms = static_cast<uint64_t>(cfg.split_after * 1000);
    po.cancel = &cancel_pass;
    // An administrator's pass runs to its end; a scheduled one stops when
    // its window closes.
    if (trigger == PassTrigger::kWindow || trigger == PassTrigger::kInterval) po.stop = &stop_pass;
    po.stable_after_ns = StableAfterNs(policy);
    po.io_budget = &throttle;
    po.settle_io = [&](const std::function<void()>& between) { throttle.Settle(between); };
    po.batch_ops = IoThrottle::BatchOpsFor(policy.rate_bytes_per_s, po.batch_ops);
    po.force = sweep_next_pass.exchange(false);
    po.busy_parked_shards = &busy_parked_shards;
    po.log_taken = [&monitor](FileId id) { monitor.LogTaken(id); };
    po.borrow_log = [&flusher](FileId id) { return flusher.LendLog(id); };
    po.progress = [&](const std::string& line) {
      std::lock_guard<std::mutex> l(pass_state.mu);
      pass_state.progress = line;
    };
    auto* sanlock_locks = dynamic_cast<SanlockLockManager*>(vol->lock_manager());
    const SanlockLockManager::Counters locks_before =
        sanlock_locks ? sanlock_locks->counters() : SanlockLockManager::Counters{};
    const uint64_t io_before = throttle.bytes();
    const Volume::WaitCounters waits_before = vol->wait_counters();
    Result<DedupStats> st = Status::Ok();
    {
      ScopedDedupPriority priority(policy.priority);
      auto access = std::make_unique<ExportFileAccess>(&table);
      st = RunDedupPass(vol, access.get(), po);
      access.reset();  // hands the exports back (closing those without clients)
    }
    if (!st.ok() && po.force) sweep_next_pass = true;  // not done: next time
    passes++;
    PassRow row;
    row.start_ns = start_ns;
    row.end_ns = Clock::Real()->NowNanos();
    row.host_id = vol->host_id();
    row.volume_uuid = UuidToString(vol->superblock().uuid);
    row.trigger = PassTriggerName(trigger);
    {
      std::lock_guard<std::mutex> l(pass_state.mu);
      row.window = pass_state.window;
    }
    row.io_bytes = throttle.bytes() - io_before;
    const uint64_t cow_now = cow_total();
    if (!st.ok()) {
      // kUnavailable is how a stopped or cancelled pass ends, but also an
      // iSCSI path, a lease or a lock-table partition that failed: those
      // are failures.
      const bool stopped = st.status().code() == Status::Code::kUnavailable &&
                           (stop_pass.load() || cancel_pass.load());
      row.outcome = stopped ? "stopped" : "failed";
      row.error = st.status().message();
      row.errors = stopped ? 0 : 1;
      if (stopped) {
        LOG(kInfo) << "dedup pass " << passes << ": " << st.status().ToString();
      } else {
        LOG(kError) << "dedup pass " << passes << ": " << st.status().ToString();
      }
    } else {
      row.outcome = st->stopped ? "stopped" : "completed";
      row.records = st->log_records + st->pending_records_applied;
      row.entries_scanned = st->entries_scanned;
      row.shards_rewritten = st->shards_rewritten;
      row.blocks_shared_new = st->shared_new;
      row.blocks_shared_again = st->shared_hits;
      row.zero_blocks_freed = st->zero_blocks_freed;
      row.merge_requests_posted = st->merge_requests_posted;
      row.merge_requests_applied = st->merge_requests_applied;
      row.verification_failures = st->stale_records + st->merge_requests_failed_verification;
      row.bytes_reclaimed = kBlockSize * st->blocks_released();
      LOG(kInfo) << "dedup pass " << passes << ": " << st->log_records << " records from "
                 << st->logs_consumed << " logs, " << st->shared_new << " new shared, "
                 << st->shared_hits << " shared again, " << st->merge_requests_posted
                 << " merge requests posted (" << st->merge_posts_busy << " posts busy), "
                 << st->merge_requests_applied << " applied, " << st->zero_blocks_freed
                 << " zero blocks freed, " << st->files_busy << " files busy (" << st->busy_targets
                 << " records of files busy skipped), " << st->files_given_back
                 << " given back to waiting clients, " << st->records_parked_busy
                 << " records parked (allocation group or request file busy elsewhere; "
                 << st->shards_revisited << " shards revisited), " << st->gc_checks_busy
                 << " garbage checks left for later (group busy), " << st->zero_blocks_busy
                 << " zero-block punches, " << st->arena_punches_busy << " arena punches and "
                 << st->split_clones_busy
                 << " split moves held back (drop list full or group busy), "
                 << st->splits_deferred_busy << " splits deferred (group busy), "
                 << st->shards_rewritten << " shards rewritten (" << st->shards_split << " split, "
                 << st->shard_waits << " waits) in " << double(st->total_ns) / 1e9 << " s; "
                 << st->young_records_deferred << " young records deferred, "
                 << st->log_dropped_records
                 << " records the logs say were shed or lost before logging, " << row.io_bytes
                 << " bytes of dedup I/O (" << row.trigger
                 << (row.window.empty() ? "" : " " + row.window) << ")"
                 << (st->stopped ? "; stopped at the window's end, " +
                                       std::to_string(st->records_parked_at_stop) +
                                       " records parked for the next window"
                                 : "");
    }
    if (st.ok() && !st->shard_spans().empty()) {
      // When this pass held shard locks (wall clock, ms since the epoch):
      // laid beside other hosts' lines, how many index updates ran at once.
      std::ostringstream spans;
      for (const DedupStats::ShardSpan& sp : st->shard_spans()) {
        spans << ' ' << sp.start_ns / 1000000 << '-' << sp.end_ns / 1000000;
      }
      LOG(kInfo) << "dedup pass " << passes << " shard updates: "
                 << double(st->shard_lock_ns) / 1e9 << " s under shard locks, spans ms:"
                 << spans.str()
                 << (st->shard_lock_spans > st->shard_spans().size() ? " ..." : "");
    }
    {
      std::lock_guard<std::mutex> l(pass_state.mu);
      row.cow_copies = cow_now - pass_state.cow_at_last_pass;
      pass_state.cow_at_last_pass = cow_now;
    }
    // The volume after the pass, for savings over time. It reads every
    // reference-count block and block map (about 0.1% of the volume): dedup
    // I/O, charged to the rate cap at the pass's priority like the pass's
    // own. Not when shutting down: the reads and their rate-cap wait would
    // hold up the drain (the row then has no volume figures, which `dede
    // report` reads as not measured).
    if (cancel_pass) {
      LOG(kInfo) << "volume figures after the pass: skipped (shutting down)";
    } else if (row.outcome == "stopped") {
      // Stopped at its window's end: reading 0.1% of the volume then would
      // be dedup I/O outside the window.
      LOG(kInfo) << "volume figures after the pass: skipped (its window has ended)";
    } else {
      Result<SpaceSummary> space = [&] {
        ScopedDedupPriority priority(policy.priority);
        ScopedIoBudget charged(&throttle);
        return SummarizeSpace(vol);
      }();
      throttle.Settle(nullptr);
      if (space.ok()) {
        row.volume_logical_bytes = space->logical_bytes();
        row.volume_physical_bytes = space->physical_bytes();
        row.volume_saved_bytes = space->saved_bytes();
      } else {
        LOG(kWarning) << "volume figures after the pass: " << space.status().ToString();
      }
    }
    if (history) {
      if (Result<int64_t> id = history->Record(row); !id.ok()) {
        LOG(kWarning) << "recording the pass: " << id.status().ToString();
      }
    }
    {
      std::lock_guard<std::mutex> l(pass_state.mu);
      if (row.outcome == "completed") pass_state.completed++;
      if (row.outcome == "stopped") pass_state.stopped++;
      if (row.outcome == "failed") pass_state.failed++;
      pass_state.last_end_ns = row.end_ns;
      pass_state.shared_total += row.blocks_shared_new + row.blocks_shared_again;
      pass_state.reclaimed_total += row.bytes_reclaimed;
      pass_state.io_bytes_total += row.io_bytes;
      pass_state.merge_applied_total += row.merge_requests_applied;
      pass_state.progress.clear();
      pass_state.ended.push_back({seq, row.trigger, row.outcome, row.error,
                                  st.ok() ? DedupStatsToJson(*st) : nlohmann::json()});
      if (pass_state.ended.size() > 16) pass_state.ended.pop_front();
    }
    const bool failed = row.outcome == "failed";
    const uint32_t failed_before = scheduler.failures_in_a_row();
    scheduler.PassEnded(failed ? PassScheduler::Outcome::kFailed
                               : PassScheduler::Outcome::kSucceeded);
    if (failed) {
      // A pass that fails at once, back to back (--window-interval 0),
      // would otherwise fill the log and keep the volume busy for nothing.
      LOG(kWarning) << "dedup pass " << passes << " failed (" << scheduler.failures_in_a_row()
                    << " in a row): backing off, the next scheduled pass starts no sooner than "
                    << scheduler.failure_backoff_s()
                    << " s from now (doubling with each failure, up to "
                    << so_sched.max_failure_backoff_s << " s; `dede dedup --now` runs one at once)";
    } else if (failed_before > 0) {
      LOG(kInfo) << "dedup pass " << passes << " succeeded after " << failed_before
                 << " failed in a row: backoff over, passes are scheduled as usual";
    }
    if (sanlock_locks) {
      // Other threads (NBD opens, the collector) count here too.
      const SanlockLockManager::Counters c = sanlock_locks->counters();
      const uint64_t n = c.acquires - locks_before.acquires;
      LOG(kInfo) << "dedup pass " << passes << " locks: " << n << " acquired, "
                 << (n ? double(c.acquire_ns - locks_before.acquire_ns) / 1e6 / double(n) : 0.0)
                 << " ms mean, " << c.lease_retries - locks_before.lease_retries
                 << " lease retries";
    }
    // Waits for locks other processes or hosts held, during the pass (all
    // threads of this process: VM writes and merge application count too).
    const Volume::WaitCounters waits_after = vol->wait_counters();
    LOG(kInfo) << "dedup pass " << passes << " waits: "
               << waits_after.waits - waits_before.waits
               << " for locks held by other processes or hosts, "
               << double(waits_after.wait_ns - waits_before.wait_ns) / 1e6 << " ms in all, "
               << waits_after.timeouts - waits_before.timeouts << " timed out";
    // Reference drops this host gave up without waiting for another host's
    // group (all threads since start; applied at later flush points). The
    // last line of every pass (tests wait for it).
    const Volume::DropCounters drops = vol->drop_counters();
    LOG(kInfo) << "reference drops: " << drops.deferred << " deferred, " << drops.applied
               << " applied, " << drops.pending << " pending, " << drops.adopted
               << " adopted from hosts that are gone; " << drops.yielded
               << " group takes left to hosts waiting for them";
  };
  // The scheduler's tick: starts a due pass on a worker; tells a running
  // one to stop when its window closed.
  auto start_due_pass = [&] {
    if (scheduler.running()) {
      if (scheduler.ShouldStop() && !stop_pass.exchange(true)) {
        LOG(kInfo) << "dedup window ended: stopping the running pass";
      }
      return;
    }
    std::optional<PassTrigger> due = scheduler.Due();
    if (!due || cancel_pass) return;
    scheduler.PassStarted(*due);
    server.RunBlocking([&run_pass, t = *due] { run_pass(t); });
  };
  PeriodicJob schedule_job(io, &server, 1.0, start_due_pass);
  PeriodicJob policy_job(io, &server, cfg.policy_refresh, [&] { refresh_policy("periodic"); });
  // SIGUSR1 and SIGHUP were ignored since main() started (the volume open
  // may take ~20 s): from here they are handled.
  asio::signal_set usr1(io, SIGUSR1);
  std::function<void(boost::system::error_code, int)> on_usr1 =
      [&](boost::system::error_code ec, int) {
        if (ec) return;
        if (!scheduler.Request(PassTrigger::kSignal)) {
          LOG(kWarning) << "SIGUSR1: no dedup pass: the volume's dedup policy could not be read ("
                        << unread_policy_error() << ")";
        }
        usr1.async_wait(on_usr1);
      };
  usr1.async_wait(on_usr1);
  // SIGHUP (`systemctl reload dedupd`): re-read the volume's policy now,
  // not at the next --policy-refresh. Command-line and config-file options
  // are not re-read.
  asio::signal_set hup(io, SIGHUP);
  std::function<void(boost::system::error_code, int)> on_hup = [&](boost::system::error_code ec,
                                                                   int) {
    if (ec) return;
    LOG(kInfo) << "SIGHUP: re-reading the dedup policy";
    server.RunBlocking([&] { refresh_policy("SIGHUP"); });
    hup.async_wait(on_hup);
  };
  hup.async_wait(on_hup);

  // Merge requests (DeDe 3.3.2) other hosts posted for the files served
  // here, applied every --merge-interval (a pass applies them too) inside
  // the policy's windows (applying one shares blocks). Only exports open
  // now: an idle file is not opened for it. It holds exports like a pass,
  // so it runs under pass_mu (try-lock: a running pass applies them
  // itself; shutdown waits there).
  auto apply_merges = [&] {
    if (!scheduler.InWindow()) return;
    std::unique_lock<std::mutex> running(pass_mu, std::try_to_lock);
    if (!running.owns_lock() || cancel_pass) return;
    std::vector<FileId> served;
    for (const auto& e : table.Snapshot()) served.push_back(e->id());
    if (served.empty()) return;
    ScopedIoBudget charged(&throttle);
    // Only what is open at the moment it is reached: a file whose VM left
    // meanwhile is not opened again (the table's snapshot above is older).
    auto access = std::make_unique<ExportFileAccess>(&table, ExportFileAccess::kOnlyOpen);
    Result<MergeApplyStats> st = ApplyMergeRequestsForHeldFiles(
        vol, access.get(), VerifyMode::kByteCompare, [&](const FileInfo& fi) {
          for (const FileId& id : served) {
            if (id == fi.id) return true;
          }
          return false;
        });
    access.reset();
    throttle.Settle();
    if (!st.ok()) {
      LOG(kError) << "applying merge requests: " << st.status().ToString();
    } else if (st->records > 0) {
      {
        std::lock_guard<std::mutex> l(pass_state.mu);
        pass_state.merge_applied_total += st->applied;
      }
      LOG(kInfo) << "merge requests: " << st->applied << " applied, " << st->failed_verification
                 << " failed verification, " << st->stale << " stale, " << st->busy
                 << " held back (allocation group busy elsewhere; kept for the next apply)";
    }
  };
  PeriodicJob merge_job(io, &server, cfg.merge_interval > 0 ? cfg.merge_interval : 1e9,
                        apply_merges);

  // ------------------------------------------------------------ status
  std::atomic<int> metrics_port{-1};  // set once the endpoint listens
  // Set below, before anything serves (the status reply reads its counts).
  std::unique_ptr<ControlServer> control;
  auto status_json = [&]() -> nlohmann::json {
    nlohmann::json j;
    j["host_id"] = vol->host_id();
    j["volume"] = cfg.volume;
    j["volume_uuid"] = UuidToString(vol->superblock().uuid);
    j["pid"] = static_cast<int64_t>(::getpid());
    j["version"] = DEDE_VERSION;
    j["uptime_s"] = double(Clock::Real()->NowNanos() - started_wall_ns) / 1e9;
    const DeviceCounters dc = ov->device->counters();
    j["device"] = {{"lost_commands", dc.lost_commands},
                   {"lu_resets", dc.lu_resets},
                   {"idle_reconnects", dc.idle_reconnects}};
    {
      RepeatedFailure::Snapshot f;
      {
        std::lock_guard<std::mutex> l(flush_point_mu);
        f = flush_point_failure.snapshot();
      }
      j["flush_points"] = {{"failing", f.failing},
                           {"error", f.error},
                           {"failing_since_ns", f.failing ? f.since_ns : 0},
                           {"failed_in_a_row", f.in_a_row},
                           {"failed", f.total}};
    }
    nlohmann::json exports = nlohmann::json::array();
    for (const ExportTable::ExportStatus& e : table.StatusOfOpen()) {
      nlohmann::json x;
      x["name"] = e.name;
      x["clients"] = e.clients;
      x["dedup"] = e.dedup;
      x["cow_copies"] = e.cow_copies;
      x["writes_answered_early"] = e.writes_answered_early;
      x["read_ahead"] = ReadAheadJson(e.read_ahead);
      if (cfg.write_monitor) {
        const MonitorFileStats fs = monitor.FileStats(e.id);
        x["buffered_records"] = fs.buffered_records;
        x["dropped_records"] = fs.dropped_records;
        x["hashed_blocks"] = fs.hashed_blocks;
        x["unrecorded_blocks"] = fs.unrecorded_blocks;
        x["write_log_saturated"] = fs.log_full;
      }
      exports.push_back(x);
    }
    j["exports"] = exports;
    nlohmann::json leases = nlohmann::json::array();
    for (const auto& [id, mode] : vol->lock_manager()->Held()) {
      leases.push_back({{"lock", id.ToString()},
                        {"mode", mode == LockMode::kExclusive ? "exclusive" : "shared"}});
    }
    j["leases"] = leases;
    j["lock_backend"] = dynamic_cast<SanlockLockManager*>(vol->lock_manager()) ? "sanlock" : "local";
    if (cfg.write_monitor) {
      const MonitorStats ms = monitor.Stats();
      j["monitor"] = {{"files", ms.files},
                      {"buffer_bytes", ms.buffered_bytes},
                      {"buffer_cap_bytes", ms.memory_cap_bytes},
                      {"records_buffered", ms.buffered_records},
                      {"records_dropped", ms.dropped_records},
                      {"hashed_blocks", ms.hashed_blocks},
                      {"log_full_files", ms.log_full_files},
                      {"unrecorded_blocks", ms.unrecorded_blocks}};
      const FlusherStats fl = flusher.stats();
      j["write_logs"] = {{"appends", fl.flushes},
                         {"bytes", fl.bytes},
                         {"records", fl.records},
                         {"deferred", fl.deferred},
                         {"failed", fl.failed},
                         {"no_space_skipped", fl.no_space_skipped},
                         {"saturations", fl.saturations},
                         {"capped_batches", fl.capped_batches},
                         {"capped_entries", fl.capped_entries},
                         {"parked_files", flusher.parked_files()},
                         {"limit_percent", flusher.limit().percent},
                         {"limit_min_bytes", flusher.limit().min_bytes}};
    } else {
      j["monitor"] = nullptr;
      j["write_logs"] = nullptr;
    }
    const DedupPolicy pol = scheduler.policy();
    nlohmann::json windows = nlohmann::json::array();
    for (const DedupWindow& w : pol.windows) windows.push_back(FormatWindow(w));
    const std::optional<uint64_t> next = scheduler.NextChange();
    j["policy"] = {{"windows", windows},
                   {"rate_bytes_per_s", pol.rate_bytes_per_s},
                   {"priority", PriorityName(pol.priority)},
                   {"stable_after_s", pol.stable_after_s},
                   {"generation", pol.generation},
                   {"read", scheduler.has_policy()},
                   {"error", unread_policy_error()},
                   {"time_zone", TimeZoneText(Clock::Real()->NowNanos())},
                   {"in_window", scheduler.InWindow()},
                   {"window", scheduler.CurrentWindow()},
                   {"next_change_ns", next ? *next : 0}};
    {
      std::lock_guard<std::mutex> l(pass_state.mu);
      const std::optional<PassTrigger> running = scheduler.running_trigger();
      nlohmann::json pass = {{"running", running.has_value()}};
      if (running) {
        pass["trigger"] = PassTriggerName(*running);
        pass["window"] = pass_state.window;
        pass["started_ns"] = pass_state.started_ns;
        pass["progress"] = pass_state.progress;
        pass["stopping"] = stop_pass.load();
      }
      j["pass"] = pass;
      j["passes"] = {{"completed", pass_state.completed},
                     {"stopped", pass_state.stopped},
                     {"failed", pass_state.failed},
                     {"last_end_ns", pass_state.last_end_ns},
                     {"blocks_shared", pass_state.shared_total},
                     {"bytes_reclaimed", pass_state.reclaimed_total},
                     {"merge_requests_applied", pass_state.merge_applied_total},
                     {"io_bytes", pass_state.io_bytes_total},
                     {"failed_in_a_row", scheduler.failures_in_a_row()},
                     {"failure_backoff_s", scheduler.failure_backoff_s()}};
    }
    const ExportTable::Totals totals = table.totals();
    j["cow_copies"] = totals.cow_copies;
    const NbdServerStats nbd_stats = server.stats();
    j["nbd"] = {{"connections_open", nbd_stats.connections_open},
                {"connections_total", nbd_stats.connections_total},
                {"connections_refused", nbd_stats.connections_refused},
                {"connections_denied", nbd_stats.connections_denied},
                {"protocol_errors", nbd_stats.protocol_errors},
                {"handshake_timeouts", nbd_stats.handshake_timeouts},
                {"requests", nbd_stats.requests},
                {"request_errors", nbd_stats.request_errors},
                {"bytes_read", nbd_stats.bytes_read},
                {"bytes_written", nbd_stats.bytes_written},
                {"memory_limit", nbd_stats.memory.limit},
                {"memory_in_use", nbd_stats.memory.in_use},
                {"memory_peak", nbd_stats.memory.peak},
                {"memory_waiting", nbd_stats.memory.waiting},
                {"memory_waits", nbd_stats.memory.waits},
                {"stall_closes", nbd_stats.stall_closes}};
    j["writes_answered_early"] = totals.writes_answered_early;
    j["read_ahead"] = ReadAheadJson(totals.read_ahead);
    j["read_ahead"]["memory_used"] = table.read_ahead_budget().used();
    j["read_ahead"]["memory_cap"] = table.read_ahead_budget().cap();
    const Volume::DropCounters drops = vol->drop_counters();
    j["drops"] = {{"deferred", drops.deferred},
                  {"applied", drops.applied},
                  {"pending", drops.pending},
                  {"adopted", drops.adopted},
                  {"groups_yielded", drops.yielded}};
    const Volume::ReservationCounters reservations = vol->reservation_counters();
    j["write_reservations"] = {{"in_flight", reservations.reserved_now},
                               {"materialized", reservations.materialized},
                               {"leaked", reservations.leaked}};
    const Volume::WaitCounters waits = vol->wait_counters();
    j["lock_waits"] = {{"waits", waits.waits},
                       {"wait_s", double(waits.wait_ns) / 1e9},
                       {"timeouts", waits.timeouts}};
    const Volume::FlushCounters flushes = vol->flush_counters();
    j["volume_flushes"] = {{"held", flushes.held},
                           {"held_s", double(flushes.held_ns) / 1e9},
                           {"unlocked", flushes.unlocked},
                           {"checkpoints", flushes.checkpoints},
                           {"quiet_checkpoints", flushes.quiet_checkpoints},
                           {"quiet_checkpoints_deferred", flushes.quiet_checkpoints_deferred}};
    j["throttle"] = {{"rate_bytes_per_s", throttle.rate()},
                     {"io_bytes", throttle.bytes()},
                     {"waited_s", double(throttle.waited_ns()) / 1e9}};
    j["history"] = history ? cfg.history : "";
    j["control"] = cfg.control;
    if (control) {
      j["control_connections"] = {{"open", control->connections()},
                                  {"max", control->max_connections()},
                                  {"refused", control->refused()},
                                  {"evicted", control->evicted()}};
    } else {
      j["control_connections"] = nullptr;
    }
    j["metrics_port"] = metrics_port.load();
    return j;
  };

  if (!cfg.control.empty()) {
    control = std::make_unique<ControlServer>(
        io, cfg.control, [&server](std::function<void()> f) { server.RunBlocking(std::move(f)); },
        cfg.control_max_connections,
        std::chrono::milliseconds(int64_t(cfg.control_idle_evict * 1000)));
    control->Handle("status", [&](const nlohmann::json&) -> Result<nlohmann::json> {
      return status_json();
    });
    // `dede dedup --now`: a pass at once, whatever the windows.
    control->Handle("dedup-now", [&](const nlohmann::json&) -> Result<nlohmann::json> {
      const bool was_running = scheduler.running();
      uint64_t started = 0;
      {
        // Read with the request made: the pass that serves it is the first
        // requested one numbered above `started` (a pass's number is taken
        // under this mutex as it begins, after the scheduler handed it out).
        std::lock_guard<std::mutex> l(pass_state.mu);
        started = pass_state.started;
        if (!scheduler.Request(PassTrigger::kNow)) {
          return Status::Unavailable(
              "the volume's dedup policy could not be read (" + unread_policy_error() +
              "): no dedup pass runs until it can; see `dede policy VOL show`");
        }
      }
      return nlohmann::json{
          {"requested", true}, {"pass_running", was_running}, {"passes_started", started}};
    });
    // `dede dedup --now --wait`: the first requested pass (now or SIGUSR1)
    // numbered above "after", once it has ended; until then "ended": false
    // with what the running pass is doing.
    control->Handle("pass-result", [&](const nlohmann::json& req) -> Result<nlohmann::json> {
      if (!req.contains("after") || !req["after"].is_number_integer() ||
          req["after"].get<int64_t>() < 0) {
        return Status::Invalid("pass-result needs \"after\" (the passes_started of dedup-now)");
      }
      const uint64_t after = req["after"].get<uint64_t>();
      std::lock_guard<std::mutex> l(pass_state.mu);
      for (const PassState::Ended& e : pass_state.ended) {
        if (e.seq <= after || (e.trigger != PassTriggerName(PassTrigger::kNow) &&
                               e.trigger != PassTriggerName(PassTrigger::kSignal))) {
          continue;
        }
        return nlohmann::json{{"ended", true},        {"pass", e.seq},      {"trigger", e.trigger},
                              {"outcome", e.outcome}, {"failure", e.error}, {"stats", e.stats}};
      }
      if (!pass_state.ended.empty() && pass_state.ended.front().seq > after + 1) {
        return Status::NotFound("the passes after " + std::to_string(after) +
                                " ended too long ago: their results are no longer kept");
      }
      const std::optional<PassTrigger> running = scheduler.running_trigger();
      nlohmann::json j = {{"ended", false}, {"running", running.has_value()}};
      if (running) j["progress"] = pass_state.progress;
      return j;
    });
    // `dede set VOL NAME dedup=on|off` on a running export: takes effect at
    // once (the monitor stops hashing; the volume refuses shares).
    control->Handle("set-dedup", [&](const nlohmann::json& req) -> Result<nlohmann::json> {
      if (!req.contains("name") || !req["name"].is_string() || !req.contains("dedup") ||
          !req["dedup"].is_boolean()) {
        return Status::Invalid("set-dedup needs \"name\" (string) and \"dedup\" (bool)");
      }
      const std::string name = req["name"].get<std::string>();
      const bool on = req["dedup"].get<bool>();
      if (req.contains("volume_uuid") &&
          req["volume_uuid"] != UuidToString(vol->superblock().uuid)) {
        return nlohmann::json{{"served", false}, {"reason", "another volume"}};
      }
      // Entered as a client: a VM leaving meanwhile must not close the
      // file under SetDedup (the last Release closes it, maybe this one).
      std::shared_ptr<Export> e = table.AcquireIfOpen(name);
      if (!e) return nlohmann::json{{"served", false}};
      Status set = e->SetDedup(on);
      table.Release(e);
      RETURN_IF_ERROR(set);
      if (!on) sweep_next_pass = true;
      LOG(kInfo) << "export '" << name << "': dedup=" << (on ? "on" : "off");
      return nlohmann::json{{"served", true}, {"dedup", on}};
    });
    if (Status st = control->Listen(); !st.ok()) {
      if (cfg.control_given) {
        LOG(kError) << "control socket: " << st.ToString();
        return st.code() == Status::Code::kInvalid ? kExitUsage : kExitError;
      }
      LOG(kWarning) << "no control socket (" << st.ToString()
                    << "); give --control PATH for `dede status`";
      control.reset();
    }
  }

  // ------------------------------------------------------------ metrics
  auto render_metrics = [&]() -> std::string {
    const nlohmann::json j = status_json();
    MetricsText m;
    const MetricsText::Labels host = {{"host", std::to_string(vol->host_id())}};
    m.Gauge("dede_up", "1 while dedupd serves the volume", 1, host);
    m.Gauge("dede_exports", "Open NBD exports", double(j["exports"].size()), host);
    m.Gauge("dede_flush_points_failing",
            "1 while the volume's flush points fail (every write since the last good one may be "
            "lost; once the device lost a flush, every later one fails until dedupd restarts)",
            j["flush_points"]["failing"].get<bool>() ? 1 : 0, host);
    m.Counter("dede_flush_points_failed_total", "Volume flush points that failed",
              j["flush_points"]["failed"].get<double>(), host);
    for (const auto& x : j["exports"]) {
      MetricsText::Labels l = host;
      l.emplace_back("export", x["name"].get<std::string>());
      m.Gauge("dede_export_clients", "Clients connected to an export", x["clients"].get<double>(), l);
      m.Gauge("dede_export_dedup", "1 if the export's file is deduplicated (dedup=on)",
              x["dedup"].get<bool>() ? 1 : 0, l);
      m.Counter("dede_export_cow_copies_total",
                "Copy-on-write specializations of the export's shared blocks",
                x["cow_copies"].get<double>(), l);
      m.Counter("dede_export_read_ahead_hits_total",
                "READs of the export answered from its read-ahead window",
                x["read_ahead"]["hits"].get<double>(), l);
      m.Counter("dede_export_read_ahead_wasted_total",
                "Read-ahead windows of the export dropped unused",
                x["read_ahead"]["wasted"].get<double>(), l);
      if (x.contains("dropped_records")) {
        m.Counter("dede_export_dropped_records_total", "Write-monitor records shed for the export",
                  x["dropped_records"].get<double>(), l);
      }
    }
    if (!j["monitor"].is_null()) {
      m.Gauge("dede_monitor_buffer_bytes", "Write-monitor buffer memory in use",
              j["monitor"]["buffer_bytes"].get<double>(), host);
      m.Gauge("dede_monitor_buffer_cap_bytes", "Write-monitor buffer memory cap",
              j["monitor"]["buffer_cap_bytes"].get<double>(), host);
      m.Counter("dede_monitor_hashed_blocks_total", "Blocks fingerprinted by the write monitor",
                j["monitor"]["hashed_blocks"].get<double>(), host);
      m.Counter("dede_monitor_dropped_records_total", "Write-monitor records shed at the cap",
                j["monitor"]["records_dropped"].get<double>(), host);
      m.Counter("dede_monitor_unrecorded_blocks_total",
                "Blocks written while their file's write log was full (not hashed; the next "
                "pass rehashes the file)",
                j["monitor"]["unrecorded_blocks"].get<double>(), host);
      m.Counter("dede_write_log_bytes_total", "Bytes appended to write logs",
                j["write_logs"]["bytes"].get<double>(), host);
      m.Counter("dede_write_log_failed_batches_total",
                "Write-monitor batches lost to failed log appends",
                j["write_logs"]["failed"].get<double>(), host);
      m.Counter("dede_write_log_no_space_skipped_batches_total",
                "Write-monitor batches dropped without an append because the volume was full at "
                "their file's last append",
                j["write_logs"]["no_space_skipped"].get<double>(), host);
      m.Counter("dede_write_log_saturations_total",
                "Write logs that reached their size limit (the file is rehashed by the next pass)",
                j["write_logs"]["saturations"].get<double>(), host);
      m.Counter("dede_write_log_capped_entries_total",
                "Write-monitor entries not logged because their log was at its limit",
                j["write_logs"]["capped_entries"].get<double>(), host);
    }
    m.Gauge("dede_nbd_connections", "NBD connections open", j["nbd"]["connections_open"].get<double>(),
            host);
    m.Counter("dede_nbd_connections_total", "NBD connections accepted",
              j["nbd"]["connections_total"].get<double>(), host);
    m.Counter("dede_nbd_connections_refused_total",
              "NBD connections closed at once: --max-connections were open",
              j["nbd"]["connections_refused"].get<double>(), host);
    m.Counter("dede_nbd_connections_denied_total",
              "NBD TCP connections closed: their user may not use the Unix socket",
              j["nbd"]["connections_denied"].get<double>(), host);
    m.Counter("dede_nbd_protocol_errors_total", "NBD connections closed for malformed traffic",
              j["nbd"]["protocol_errors"].get<double>(), host);
    m.Counter("dede_nbd_handshake_timeouts_total",
              "NBD connections closed for sending nothing in the handshake for --handshake-timeout",
              j["nbd"]["handshake_timeouts"].get<double>(), host);
    m.Counter("dede_nbd_requests_total", "NBD requests received",
              j["nbd"]["requests"].get<double>(), host);
    m.Counter("dede_nbd_request_errors_total", "NBD requests answered with an error",
              j["nbd"]["request_errors"].get<double>(), host);
    m.Counter("dede_nbd_read_bytes_total", "Bytes of NBD READs answered without error",
              j["nbd"]["bytes_read"].get<double>(), host);
    m.Counter("dede_nbd_written_bytes_total", "Bytes of NBD WRITEs answered without error",
              j["nbd"]["bytes_written"].get<double>(), host);
    m.Gauge("dede_nbd_memory_limit_bytes", "Memory NBD READ and WRITE data may take (--nbd-memory)",
            j["nbd"]["memory_limit"].get<double>(), host);
    m.Gauge("dede_nbd_memory_bytes", "Memory reserved for NBD READ and WRITE data now",
            j["nbd"]["memory_in_use"].get<double>(), host);
    m.Gauge("dede_nbd_memory_waiting_connections",
            "NBD connections waiting for room in --nbd-memory, reading nothing meanwhile",
            j["nbd"]["memory_waiting"].get<double>(), host);
    m.Counter("dede_nbd_memory_waits_total", "NBD requests that waited for room in --nbd-memory",
              j["nbd"]["memory_waits"].get<double>(), host);
    m.Counter("dede_nbd_stall_closes_total",
              "NBD connections closed for holding --nbd-memory others waited for while moving no "
              "byte for --nbd-stall-timeout",
              j["nbd"]["stall_closes"].get<double>(), host);
    if (!j["control_connections"].is_null()) {
      m.Counter("dede_control_connections_refused_total",
                "Control socket connections refused: --control-max-connections were open",
                j["control_connections"]["refused"].get<double>(), host);
      m.Counter("dede_control_connections_evicted_total",
                "Idle control socket connections closed to make room for a new client",
                j["control_connections"]["evicted"].get<double>(), host);
    }
    m.Gauge("dede_leases_held", "Locks and leases this dedupd holds", double(j["leases"].size()), host);
    m.Gauge("dede_in_window", "1 inside a dedup window (or when the policy has none)",
            j["policy"]["in_window"].get<bool>() ? 1 : 0, host);
    m.Gauge("dede_policy_read",
            "1 once the volume's dedup policy was read (until then no dedup work runs)",
            j["policy"]["read"].get<bool>() ? 1 : 0, host);
    m.Gauge("dede_pass_running", "1 while a dedup pass runs", j["pass"]["running"].get<bool>() ? 1 : 0,
            host);
    for (const char* outcome : {"completed", "stopped", "failed"}) {
      MetricsText::Labels l = host;
      l.emplace_back("outcome", outcome);
      m.Counter("dede_passes_total", "Dedup passes by outcome", j["passes"][outcome].get<double>(), l);
    }
    m.Counter("dede_blocks_shared_total", "Blocks shared by this host's passes",
              j["passes"]["blocks_shared"].get<double>(), host);
    m.Counter("dede_bytes_reclaimed_total", "Bytes reclaimed by this host's passes",
              j["passes"]["bytes_reclaimed"].get<double>(), host);
    m.Counter("dede_merge_requests_applied_total", "Merge requests applied for files served here",
              j["passes"]["merge_requests_applied"].get<double>(), host);
    m.Counter("dede_dedup_io_bytes_total", "Device I/O of dedup work (charged to the rate cap)",
              j["throttle"]["io_bytes"].get<double>(), host);
    m.Counter("dede_dedup_throttled_seconds_total", "Time dedup work waited for the rate cap",
              j["throttle"]["waited_s"].get<double>(), host);
    m.Gauge("dede_dedup_rate_cap_bytes_per_second", "The policy's dedup rate cap (0: none)",
            j["throttle"]["rate_bytes_per_s"].get<double>(), host);
    m.Counter("dede_read_ahead_hits_total", "READs answered from a read-ahead window on this host",
              j["read_ahead"]["hits"].get<double>(), host);
    m.Counter("dede_read_ahead_wasted_total", "Read-ahead windows dropped unused on this host",
              j["read_ahead"]["wasted"].get<double>(), host);
    m.Counter("dede_read_ahead_skipped_total",
              "Prefetches skipped because the host's read-ahead memory was held",
              j["read_ahead"]["no_budget"].get<double>(), host);
    m.Gauge("dede_read_ahead_memory_bytes", "Memory the host's read-ahead windows hold now",
            j["read_ahead"]["memory_used"].get<double>(), host);
    m.Counter("dede_cow_copies_total", "Copy-on-write specializations on this host",
              j["cow_copies"].get<double>(), host);
    m.Counter("dede_writes_answered_early_total",
              "In-place NBD writes answered before their device write on this host",
              j["writes_answered_early"].get<double>(), host);
    m.Gauge("dede_pending_reference_drops", "Reference drops waiting in this host's drop list",
            j["drops"]["pending"].get<double>(), host);
    m.Counter("dede_volume_flushes_held_total",
              "Metadata device flushes made holding the volume mutex (VM writes wait for them)",
              j["volume_flushes"]["held"].get<double>(), host);
    m.Counter("dede_volume_flush_held_seconds_total",
              "Time of the metadata device flushes made holding the volume mutex",
              j["volume_flushes"]["held_s"].get<double>(), host);
    m.Counter("dede_volume_flushes_unlocked_total",
              "Device flushes of flush points made without the volume mutex",
              j["volume_flushes"]["unlocked"].get<double>(), host);
    m.Counter("dede_volume_checkpoints_total", "Journal checkpoints of this host",
              j["volume_flushes"]["checkpoints"].get<double>(), host);
    return m.str();
  };
  std::unique_ptr<MetricsServer> metrics;
  if (cfg.metrics_port >= 0) {
    metrics = std::make_unique<MetricsServer>(io, cfg.metrics_port, render_metrics,
                                              [&server](std::function<void()> f) {
                                                server.RunBlocking(std::move(f));
                                              });
    if (Status st = metrics->Listen(); !st.ok()) {
      if (cfg.metrics_given) {
        LOG(kError) << "metrics: " << st.ToString();
        return kExitError;
      }
      LOG(kWarning) << "no metrics endpoint (" << st.ToString() << ")";
      metrics.reset();
    }
    if (metrics) metrics_port = metrics->port();
  }

  // The NBD socket last: once clients can connect, the control socket and
  // the metrics endpoint are up too.
  if (Status st = server.Listen(); !st.ok()) {
    LOG(kError) << st.ToString();
    // Not a socket: a configuration error (exit 2, not restarted); another
    // server on it may go away (exit 1).
    return st.code() == Status::Code::kInvalid ? kExitUsage : kExitError;
  }

  int exit_code = kExitOk;
  asio::signal_set signals(io, SIGTERM, SIGINT);
  signals.async_wait([&](boost::system::error_code ec, int sig) {
    if (ec) return;
    LOG(kInfo) << "signal " << sig << ": draining requests and shutting down";
    SdNotify("STOPPING=1");
    sync_job.Stop();
    flush_job.Stop();
    schedule_job.Stop();
    policy_job.Stop();
    policy_retry_stopped = true;
    policy_retry.cancel();
    merge_job.Stop();
    usr1.cancel();
    hup.cancel();
    if (control) control->Stop();
    if (metrics) metrics->Stop();
    cancel_pass = true;
    // A pass or merge apply sleeping off its rate-cap debt wakes within
    // ~50 ms, and later settles do not sleep: shutdown waits for pass_mu.
    throttle.Cancel();
    server.Shutdown([&] {
      server.RunBlocking([&] {
        // A control handler may be using an export (set-dedup enters it
        // as a client); CloseAll below closes exports whatever their
        // clients.
        if (control) control->WaitForHandlers();
        { std::lock_guard<std::mutex> wait_for_pass(pass_mu); }
        if (cfg.write_monitor) {
          flusher.Stop();
          if (Status st = flusher.FlushAll(); !st.ok()) {
            LOG(kError) << "flushing write logs: " << st.ToString();
            exit_code = kExitError;
          }
        }
        table.CloseAll();
        // A close whose log another host's pass held parked its changes
        // (LogFlusher::FlushFile): tried again for a while before the
        // process ends (a pass holds a log for the seconds it gathers it).
        if (cfg.write_monitor && flusher.parked_files() > 0) {
          if (Status st = flusher.FlushParked(kParkedLogWaitAtExitS); !st.ok()) {
            LOG(kWarning) << "write logs: parked changes: " << st.ToString();
          }
        }
        if (Status st = vol->Sync(); !st.ok()) {
          LOG(kError) << "final volume flush: " << st.ToString();
          exit_code = kExitError;
        }
        asio::post(io, [&] { io.stop(); });
      });
    });
  });

  if (cfg.write_monitor) flusher.Start();
  server.Start();
  sync_job.Start();
  flush_job.Start();
  schedule_job.Start();
  policy_job.Start();
  if (cfg.merge_interval > 0) merge_job.Start();
  if (control) control->Start();
  if (metrics) metrics->Start();
  {
    auto names = table.List();
    std::string where = cfg.socket.empty() ? "" : cfg.socket;
    if (server.tcp_port()) {
      where += (where.empty() ? "" : " and ") + std::string("127.0.0.1:") + std::to_string(server.tcp_port());
    }
    LOG(kInfo) << "host " << vol->host_id() << " serving " << (names.ok() ? names->size() : 0)
               << " exports of " << cfg.volume << " on " << where << " (write monitor "
               << (cfg.write_monitor ? HashAlgoName(mo.algo) : "off") << ")";
    if (control) LOG(kInfo) << "control socket " << cfg.control;
    if (metrics) LOG(kInfo) << "metrics on http://127.0.0.1:" << metrics->port() << "/metrics";
    if (history) LOG(kInfo) << "pass history " << cfg.history;
    // Under systemd (Type=notify): the sockets are up, clients may come.
    SdNotify("READY=1\nSTATUS=serving " + std::to_string(names.ok() ? names->size() : 0) +
             " exports of " + cfg.volume);
  }
  io.run();
  server.JoinWorkers();
  // The signal sets' removal restores the default actions (which kill):
  // ignore these two again while the exports and the volume close.
  usr1.clear();
  hup.clear();
  ::signal(SIGUSR1, SIG_IGN);
  ::signal(SIGHUP, SIG_IGN);
  LOG(kInfo) << "stopped";
  return exit_code;
}

}  // namespace
}  // namespace dede

int main(int argc, char** argv) {
  // First of all: until Run installs their handlers, after the volume is
  // open (~20 s with sanlock), SIGUSR1 (a pass now) and SIGHUP (re-read
  // the policy) would kill dedupd by their default action, with no drain,
  // flush or lock release.
  ::signal(SIGUSR1, SIG_IGN);
  ::signal(SIGHUP, SIG_IGN);
  dede::SetLogProgram("dedupd");
  ::signal(SIGPIPE, SIG_IGN);
  dede::Config cfg;
  int rc = dede::ParseArgs(argc, argv, &cfg);
  if (rc >= 0) return rc;
  dede::SetLogLevel(cfg.log_level);
  return dede::Run(cfg);
}
