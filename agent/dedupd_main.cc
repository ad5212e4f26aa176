// dedupd: the per-host dede daemon. Serves every regular file of a volume as
// an NBD export, fingerprints what VMs write (write monitor) and keeps the
// per-file write logs on the volume. Later issues add dedup passes, merge
// requests and scheduling.
#include <signal.h>

#include <boost/asio.hpp>
#include <boost/program_options.hpp>
#include <cstdio>
#include <iostream>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>

#include "agent/dedup_pass.h"
#include "agent/lockspace_guard.h"
#include "agent/export_table.h"
#include "agent/log_flusher.h"
#include "agent/nbd_server.h"
#include "kmod/writemon/write_monitor.h"
#include "util/log.h"
#include "util/units.h"
#include "volume/sanlock_lock_manager.h"
#include "volume/volume.h"

namespace po = boost::program_options;
namespace asio = boost::asio;

namespace dede {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;

const char kUsage[] =
    "usage: dedupd --volume VOL --host-id N --socket PATH [options]\n"
    "\n"
    "Serves every file of the dede volume VOL (a path or iscsi:// URL) as an NBD\n"
    "export named after the file, on the Unix socket PATH (and, with --tcp-port,\n"
    "on 127.0.0.1). A VM's disk is nbd+unix:///NAME?socket=PATH. The first client\n"
    "of an export takes the file's lock; another dedupd or host asking for the same\n"
    "export is refused until every client here has disconnected.\n"
    "Fully written 4 KiB blocks are fingerprinted in memory and logged per file on\n"
    "the volume for later dedup passes. SIGTERM or SIGINT drains requests, flushes\n"
    "logs and data, releases locks and exits 0.\n";

struct Config {
  std::string volume;
  uint32_t host_id = 0;
  std::string socket;
  int tcp_port = -1;
  size_t threads = 8;
  double sync_interval = 1.0;
  double log_flush_interval = 30.0;
  uint64_t log_flush_bytes = 1 << 20;
  uint64_t monitor_memory = uint64_t{64} << 20;
  bool write_monitor = true;
  double dedup_interval = 0;  // 0: only on SIGUSR1
  double dedup_fraction = 0.05;
  std::string lease_path;   // sanlock volumes: the LUN as a path
  uint32_t lease_io_timeout = 0;  // sanlock io_timeout (s); 0: daemon default
  double fence_after = 0;   // sanlock volumes: exit when the lockspace cannot be confirmed for SEC
  double merge_interval = 10;  // apply merge requests for served files; 0: only at passes
  double open_wait = 30;       // a client's export open waits this long for a busy file
  double split_after = 30;     // split a shard whose last update took longer (seconds)
  LogLevel log_level = LogLevel::kInfo;
};

int UsageError(const std::string& msg) {
  std::fprintf(stderr, "dedupd: %s\n(try dedupd --help)\n", msg.c_str());
  return kExitUsage;
}

// Returns an exit code, or -1 to go on.
int ParseArgs(int argc, char** argv, Config* cfg) {
  std::string tcp_port, flush_bytes, memory, log_level, config_file;
  po::options_description opts("options");
  opts.add_options()
      ("help,h", "show this help")
      ("version", "print the version")
      ("volume", po::value(&cfg->volume)->value_name("VOL"), "volume: path or iscsi://host[:port]/iqn/lun")
      ("host-id", po::value(&cfg->host_id)->value_name("N"), "this host's slot on the volume (1..max-hosts)")
      ("lease-path", po::value(&cfg->lease_path)->value_name("PATH"), "sanlock volumes: the LUN as a path for sanlock (block device; in tests the file backing the LUN); default VOL when VOL is a path")
      ("lease-io-timeout", po::value(&cfg->lease_io_timeout)->value_name("SEC"), "sanlock volumes: io_timeout of this host's lockspace membership (default: the daemon's, 10)")
      ("fence-after", po::value(&cfg->fence_after)->value_name("SEC"), "sanlock volumes: stop (exit) when the lockspace could not be confirmed live for SEC seconds (default 8 x io_timeout + 30, before other hosts may call this one dead at 8 x io_timeout + 60)")
      ("socket", po::value(&cfg->socket)->value_name("PATH"), "Unix socket to serve NBD on")
      ("tcp-port", po::value(&tcp_port)->value_name("PORT"), "also serve NBD on 127.0.0.1:PORT (0: any free port)")
      ("config", po::value(&config_file)->value_name("FILE"), "read options from FILE (lines: name = value)")
      ("threads", po::value(&cfg->threads)->value_name("N"), "worker threads for volume I/O (default 8)")
      ("sync-interval", po::value(&cfg->sync_interval)->value_name("SEC"), "volume flush point every SEC seconds (default 1)")
      ("log-flush-interval", po::value(&cfg->log_flush_interval)->value_name("SEC"), "append buffered records to write logs every SEC seconds (default 30)")
      ("log-flush-bytes", po::value(&flush_bytes)->value_name("SIZE"), "flush a file's records once they fill SIZE of log (default 1M)")
      ("monitor-memory", po::value(&memory)->value_name("SIZE"), "memory cap of the write monitor's buffers (default 64M)")
      ("no-write-monitor", "serve without fingerprinting writes (benchmarks)")
      ("dedup-interval", po::value(&cfg->dedup_interval)->value_name("SEC"), "run a dedup pass every SEC seconds (default 0: only when sent SIGUSR1)")
      ("dedup-fraction", po::value(&cfg->dedup_fraction)->value_name("F"), "rewrite an index shard when its new records exceed F times its entries (default 0.05)")
      ("split-after", po::value(&cfg->split_after)->value_name("SEC"), "split an index shard whose last update took longer than SEC seconds at its next update, so more hosts can update the index at once (default 30)")
      ("open-wait", po::value(&cfg->open_wait)->value_name("SEC"), "a client opening a disk that another host's dedup pass holds for a moment waits up to SEC seconds for it (default 30; a disk a running VM holds elsewhere fails after that)")
      ("merge-interval", po::value(&cfg->merge_interval)->value_name("SEC"), "apply merge requests other hosts posted for the files served here every SEC seconds (default 10; 0: only at dedup passes)")
      ("log-level", po::value(&log_level)->value_name("LEVEL"), "debug, info, warning or error (default info)");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(opts).run(), vm);
    po::notify(vm);
    if (vm.count("config")) {
      po::store(po::parse_config_file<char>(config_file.c_str(), opts), vm);
      po::notify(vm);
    }
  } catch (const std::exception& e) {
    return UsageError(e.what());
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
  if (cfg->host_id == 0) return UsageError("--host-id is required (1..max-hosts)");
  if (cfg->socket.empty() && tcp_port.empty()) return UsageError("--socket is required");
  if (!tcp_port.empty()) {
    auto p = ParseUnsigned(tcp_port);
    if (!p || *p > 65535) return UsageError("--tcp-port: not a port number: " + tcp_port);
    cfg->tcp_port = static_cast<int>(*p);
  }
  if (!flush_bytes.empty()) {
    auto v = ParseSize(flush_bytes);
    if (!v || *v < 4096) return UsageError("--log-flush-bytes: need a size of at least 4K");
    cfg->log_flush_bytes = *v;
  }
  if (!memory.empty()) {
    auto v = ParseSize(memory);
    if (!v || *v < (1 << 20)) return UsageError("--monitor-memory: need a size of at least 1M");
    cfg->monitor_memory = *v;
  }
  if (!log_level.empty()) {
    auto l = ParseLogLevel(log_level);
    if (!l) return UsageError("--log-level: one of debug, info, warning, error");
    cfg->log_level = *l;
  }
  if (cfg->threads < 1 || cfg->threads > 256) return UsageError("--threads: 1..256");
  if (!(cfg->sync_interval > 0) || !(cfg->log_flush_interval > 0)) {
    return UsageError("intervals must be positive");
  }
  if (cfg->dedup_interval < 0) return UsageError("--dedup-interval: must be >= 0");
  if (!(cfg->dedup_fraction >= 0)) return UsageError("--dedup-fraction: must be >= 0");
  if (cfg->fence_after < 0) return UsageError("--fence-after: must be >= 0");
  if (!(cfg->merge_interval >= 0)) return UsageError("--merge-interval: must be >= 0");
  if (!(cfg->open_wait >= 0)) return UsageError("--open-wait: must be >= 0");
  if (!(cfg->split_after > 0)) return UsageError("--split-after: must be > 0");
  cfg->write_monitor = vm.count("no-write-monitor") == 0;
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
    timer_.expires_after(std::chrono::microseconds(static_cast<int64_t>(interval_ * 1e6)));
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

int Run(const Config& cfg) {
  OpenOptions oo;
  oo.host_id = cfg.host_id;
  // Used when the volume was formatted with --locks sanlock: the volume
  // slot and the lockspace host id are the same number.
  oo.sanlock.host_id = cfg.host_id;
  oo.sanlock.lease_path = cfg.lease_path;
  oo.sanlock.io_timeout_s = cfg.lease_io_timeout;
  Result<OpenedVolume> ov = OpenVolumeSpec(cfg.volume, oo);
  if (!ov.ok()) {
    LOG(kError) << "cannot open volume " << cfg.volume << ": " << ov.status().ToString();
    return kExitError;
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
    guard = std::make_unique<LockspaceGuard>(
        sl, std::chrono::milliseconds(static_cast<int64_t>(fence * 1000)));
    LOG(kInfo) << "sanlock host " << sl->sanlock_host_id() << " generation " << sl->generation()
               << ", fencing after " << fence << " s without a live lockspace";
  }

  WriteMonitorOptions mo;
  mo.algo = vol->superblock().hash_algo;
  mo.memory_cap_bytes = cfg.monitor_memory;
  mo.flush_bytes = cfg.log_flush_bytes;
  WriteMonitor monitor(mo);
  LogFlusher flusher(vol, &monitor);
  ExportTable table(vol, cfg.write_monitor ? &monitor : nullptr,
                    cfg.write_monitor ? &flusher : nullptr);

  asio::io_context io(1);
  NbdServerOptions so;
  so.unix_socket = cfg.socket;
  so.tcp_port = cfg.tcp_port;
  so.worker_threads = cfg.threads;
  so.open_wait_s = cfg.open_wait;
  NbdServer server(io, &table, so);
  if (Status st = server.Listen(); !st.ok()) {
    LOG(kError) << st.ToString();
    return kExitError;
  }

  PeriodicJob sync_job(io, &server, cfg.sync_interval, [&] {
    // Flush point: makes logs and metadata durable and hands cached locks
    // to other processes that asked for them.
    if (Status st = vol->Sync(); !st.ok()) LOG(kError) << "volume flush: " << st.ToString();
    if (cfg.write_monitor) (void)flusher.Tick();
  });
  PeriodicJob flush_job(io, &server, cfg.log_flush_interval, [&] {
    if (cfg.write_monitor) (void)flusher.FlushAll();
  });

  // Dedup passes run on a worker, one at a time; shutdown cancels the one
  // running and waits for it (it holds exports) before closing files.
  std::atomic<bool> cancel_pass{false};
  std::mutex pass_mu;
  uint64_t passes = 0;
  auto run_pass = [&] {
    std::unique_lock<std::mutex> running(pass_mu, std::try_to_lock);
    if (!running.owns_lock() || cancel_pass) return;
    // What is buffered goes to the logs first, so the pass sees it.
    if (cfg.write_monitor) (void)flusher.FlushAll();
    DedupOptions po;
    po.rewrite_fraction = cfg.dedup_fraction;
    po.split_threshold_ms = static_cast<uint64_t>(cfg.split_after * 1000);
    po.cancel = &cancel_pass;
    auto* sanlock_locks = dynamic_cast<SanlockLockManager*>(vol->lock_manager());
    const SanlockLockManager::Counters locks_before =
        sanlock_locks ? sanlock_locks->counters() : SanlockLockManager::Counters{};
    auto access = std::make_unique<ExportFileAccess>(&table);
    Result<DedupStats> st = RunDedupPass(vol, access.get(), po);
    access.reset();  // hands the exports back (closing those without clients)
    passes++;
    if (!st.ok()) {
      if (st.status().code() == Status::Code::kUnavailable) {
        LOG(kInfo) << "dedup pass " << passes << ": " << st.status().ToString();
      } else {
        LOG(kError) << "dedup pass " << passes << ": " << st.status().ToString();
      }
      return;
    }
    LOG(kInfo) << "dedup pass " << passes << ": " << st->log_records << " records from "
               << st->logs_consumed << " logs, " << st->shared_new << " new shared, "
               << st->shared_hits << " shared again, " << st->merge_requests_posted
               << " merge requests posted (" << st->merge_posts_busy << " posts busy), "
               << st->merge_requests_applied << " applied, "
               << st->zero_blocks_freed
               << " zero blocks freed, " << st->files_busy << " files busy, "
               << st->shards_rewritten << " shards rewritten (" << st->shards_split
               << " split, " << st->shard_waits << " waits) in "
               << double(st->total_ns) / 1e9 << " s";
    if (sanlock_locks) {
      // Other threads (NBD opens, the collector) count here too.
      const SanlockLockManager::Counters c = sanlock_locks->counters();
      const uint64_t n = c.acquires - locks_before.acquires;
      LOG(kInfo) << "dedup pass " << passes << " locks: " << n << " acquired, "
                 << (n ? double(c.acquire_ns - locks_before.acquire_ns) / 1e6 / double(n) : 0.0)
                 << " ms mean, " << c.lease_retries - locks_before.lease_retries
                 << " lease retries";
    }
    // Reference drops this host gave up without waiting for another host's
    // group (all threads since start; applied at later flush points).
    const Volume::DropCounters drops = vol->drop_counters();
    LOG(kInfo) << "reference drops: " << drops.deferred << " deferred, " << drops.applied
               << " applied, " << drops.pending << " pending";
  };
  PeriodicJob dedup_job(io, &server, cfg.dedup_interval > 0 ? cfg.dedup_interval : 1e9, run_pass);
  asio::signal_set usr1(io, SIGUSR1);
  std::function<void(boost::system::error_code, int)> on_usr1 =
      [&](boost::system::error_code ec, int) {
        if (ec) return;
        server.RunBlocking(run_pass);
        usr1.async_wait(on_usr1);
      };
  usr1.async_wait(on_usr1);

  // Merge requests (DeDe 3.3.2) other hosts posted for the files served
  // here, applied every --merge-interval (a pass applies them too). Only
  // exports open now: an idle file is not opened for it. It holds exports
  // like a pass, so it runs under pass_mu (try-lock: a running pass
  // applies them itself; shutdown waits there).
  auto apply_merges = [&] {
    std::unique_lock<std::mutex> running(pass_mu, std::try_to_lock);
    if (!running.owns_lock() || cancel_pass) return;
    std::vector<FileId> served;
    for (const auto& e : table.Snapshot()) served.push_back(e->id());
    if (served.empty()) return;
    auto access = std::make_unique<ExportFileAccess>(&table);
    Result<MergeApplyStats> st = ApplyMergeRequestsForHeldFiles(
        vol, access.get(), VerifyMode::kByteCompare, [&](const FileInfo& fi) {
          for (const FileId& id : served) {
            if (id == fi.id) return true;
          }
          return false;
        });
    access.reset();
    if (!st.ok()) {
      LOG(kError) << "applying merge requests: " << st.status().ToString();
    } else if (st->records > 0) {
      LOG(kInfo) << "merge requests: " << st->applied << " applied, " << st->failed_verification
                 << " failed verification, " << st->stale << " stale";
    }
  };
  PeriodicJob merge_job(io, &server, cfg.merge_interval > 0 ? cfg.merge_interval : 1e9,
                        apply_merges);

  int exit_code = kExitOk;
  asio::signal_set signals(io, SIGTERM, SIGINT);
  signals.async_wait([&](boost::system::error_code ec, int sig) {
    if (ec) return;
    LOG(kInfo) << "signal " << sig << ": draining requests and shutting down";
    sync_job.Stop();
    flush_job.Stop();
    dedup_job.Stop();
    merge_job.Stop();
    usr1.cancel();
    cancel_pass = true;
    server.Shutdown([&] {
      server.RunBlocking([&] {
        { std::lock_guard<std::mutex> wait_for_pass(pass_mu); }
        if (cfg.write_monitor) {
          if (Status st = flusher.FlushAll(); !st.ok()) {
            LOG(kError) << "flushing write logs: " << st.ToString();
            exit_code = kExitError;
          }
        }
        table.CloseAll();
        if (Status st = vol->Sync(); !st.ok()) {
          LOG(kError) << "final volume flush: " << st.ToString();
          exit_code = kExitError;
        }
        asio::post(io, [&] { io.stop(); });
      });
    });
  });

  server.Start();
  sync_job.Start();
  flush_job.Start();
  if (cfg.dedup_interval > 0) dedup_job.Start();
  if (cfg.merge_interval > 0) merge_job.Start();
  {
    auto names = table.List();
    std::string where = cfg.socket.empty() ? "" : cfg.socket;
    if (server.tcp_port()) {
      where += (where.empty() ? "" : " and ") + std::string("127.0.0.1:") + std::to_string(server.tcp_port());
    }
    LOG(kInfo) << "host " << vol->host_id() << " serving " << (names.ok() ? names->size() : 0)
               << " exports of " << cfg.volume << " on " << where << " (write monitor "
               << (cfg.write_monitor ? HashAlgoName(mo.algo) : "off") << ")";
  }
  io.run();
  server.JoinWorkers();
  LOG(kInfo) << "stopped";
  return exit_code;
}

}  // namespace
}  // namespace dede

int main(int argc, char** argv) {
  dede::SetLogProgram("dedupd");
  ::signal(SIGPIPE, SIG_IGN);
  dede::Config cfg;
  int rc = dede::ParseArgs(argc, argv, &cfg);
  if (rc >= 0) return rc;
  dede::SetLogLevel(cfg.log_level);
  return dede::Run(cfg);
}
