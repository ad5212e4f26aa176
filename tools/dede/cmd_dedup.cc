// `dede dedup VOL`: one deduplication pass of this host, in the foreground.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "agent/control_server.h"
#include "agent/dedup_pass.h"
#include "agent/dedup_policy.h"
#include "agent/dedup_stats_json.h"
#include "agent/io_throttle.h"
#include "agent/pass_scheduler.h"
#include "tools/dede/cli.h"
#include "util/clock.h"

namespace po = boost::program_options;
using json = nlohmann::json;

namespace dede::cli {

namespace {

std::optional<double> ParseNonNegative(const std::string& s) {
  try {
    size_t used = 0;
    double d = std::stod(s, &used);
    if (used != s.size() || !(d >= 0) || d > 1e12) return std::nullopt;
    return d;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The figures of a pass that ran to its end, as text.
void PrintPassSummary(const DedupStats& s) {
  std::cout << "dedup pass: " << s.logs_consumed << " logs, " << s.log_records << " records";
  if (s.rounds > 1) std::cout << " in " << s.rounds << " rounds (bounded memory)";
  if (s.logs_left_over > 0) std::cout << "; " << s.logs_left_over << " logs left for the next pass";
  if (s.files_busy) {
    std::cout << " (" << s.files_busy
              << " files held by another process or host were skipped: a dedupd serving "
                 "them dedups them itself, on --dedup-interval or SIGUSR1)";
  }
  std::cout << "\n  new shared blocks   " << s.shared_new << "\n  shared again        "
            << s.shared_hits << "\n  zero blocks freed   " << s.zero_blocks_freed
            << "\n  new unique entries  " << s.unique_added << "\n  stale (skipped)     "
            << s.stale_records + s.stale_entries << "\n  garbage collected   " << s.gc_arena_blocks
            << " arena blocks, " << s.gc_unique_entries << " entries (" << s.gc_checks_busy
            << " checks left for later: group busy"
            << (s.arena_punches_busy ? "; " + std::to_string(s.arena_punches_busy) +
                                           " punches held back: drop list full or group busy"
                                     : std::string())
            << ")"
            << "\n  merge requests      " << s.merge_requests_posted << " posted, "
            << s.merge_posts_busy << " posts busy; " << s.merge_requests_applied << " applied, "
            << s.merge_requests_failed_verification << " failed verification, "
            << s.merge_requests_stale << " stale, " << s.merge_requests_busy << " held back"
            << "\n  parked (busy)       " << s.records_parked_busy << " records ("
            << s.shards_revisited << " shard revisits)"
            << "\n  shards              " << s.shards_rewritten << " rewritten, "
            << s.shards_deferred << " deferred, " << s.shards_split << " split"
            << (s.splits_deferred_busy
                    ? " (" + std::to_string(s.splits_deferred_busy) + " put off: group busy)"
                    : std::string())
            << (s.split_clones_busy
                    ? " (" + std::to_string(s.split_clones_busy) + " entries dropped: group busy)"
                    : std::string())
            << "\n  time                " << HumanDuration(double(s.total_ns) / 1e9) << std::endl;
  if (s.log_dropped_records > 0) {
    // The logs said so and are consumed now: this is the only place left
    // that does.
    std::cout << "  note: " << s.log_dropped_records
              << " write-monitor records were shed or lost before reaching the logs; those "
                 "blocks' changes are missed until rewritten (dede dedup --rescan reads them)\n";
  }
}

// `--now --wait` handed to dedupd: follows the pass that serves the
// request (dedup-now's reply numbers it) until it ends, then prints its
// figures as a pass run here would.
int WaitForDedupdPass(const Command& cmd, const std::string& control, const json& status,
                      const json& requested, bool as_json, bool tty) {
  auto started = requested.find("passes_started");
  if (started == requested.end() || !started->is_number_unsigned()) {
    return Fail(cmd, "the dedupd at " + control +
                         " ran the pass but cannot report its figures (an older dedupd): "
                         "follow it with `dede status`");
  }
  const json ask = {{"cmd", "pass-result"}, {"after", started->get<uint64_t>()}};
  const bool progress_line = tty && !as_json;
  // The answer that ends the wait, or the error that does.
  Result<json> ended = [&]() -> Result<json> {
    for (;;) {
      Result<json> r = ControlRequest(control, ask, std::chrono::seconds(10));
      if (!r.ok()) return r.status().WithContext("waiting for dedupd's pass (did dedupd stop?)");
      if (r->contains("error"))
        return Status::IoError("dedupd: " + (*r)["error"].get<std::string>());
      if (r->value("ended", false)) return r;
      if (progress_line) {
        const std::string progress = r->value("progress", std::string());
        std::fprintf(stderr, "\r\033[Kdedup (dedupd): %s",
                     progress.empty() ? "waiting for the pass to start" : progress.c_str());
        std::fflush(stderr);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }();
  if (progress_line) std::fprintf(stderr, "\r\033[K");
  if (!ended.ok()) return Fail(cmd, ended.status());
  const json& result = ended.value();
  const std::string who = "dedupd (host " + status["host_id"].dump() + ", " + control + ") pass " +
                          result["pass"].dump();
  const std::string outcome = result.value("outcome", std::string());
  if (outcome == "failed") {
    return Fail(cmd, who + " failed: " + result.value("failure", std::string()));
  }
  const DedupStats s = DedupStatsFromJson(result["stats"]);
  if (as_json) {
    json j = result["stats"];
    j["requested_from"] = control;
    j["host_id"] = status["host_id"];
    j["pass"] = result["pass"];
    PrintJson(j);
  }
  if (outcome != "completed") {
    // Requested passes stop only when dedupd shuts down.
    return Fail(cmd, who + " stopped early (dedupd shutting down?): " +
                         std::to_string(s.records_parked_at_stop) +
                         " records were parked for the next pass, the work done is kept");
  }
  if (!as_json) {
    std::cout << who << ":\n";
    PrintPassSummary(s);
  }
  return kExitOk;
}

}  // namespace

int RunDedup(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.AddPositional("VOL", "volume: a path (file or block device) or iscsi:// URL");
  parser.options()("force", po::bool_switch(),
                   "rewrite every index shard now (collect all garbage, apply all "
                   "parked records), ignoring the batching fraction")(
      "fraction", po::value<std::string>()->value_name("F"),
      "rewrite a shard only when its new records exceed F times its entries (default 0.05)")(
      "split-after", po::value<std::string>()->value_name("SECONDS"),
      "a shard whose last update took longer than this is split at its next update (default 30)")(
      "verify", po::value<std::string>()->value_name("bytes|witness"),
      "how shares are verified: byte comparison (default), or a SHA-256 witness (sha256 volumes "
      "only)")("rescan", po::bool_switch(),
               "read and fingerprint every block of every file this process can lock (rebuilds a "
               "lost or damaged index; reads all data)")(
      "now", po::bool_switch(),
      "run even outside the volume policy's dedup windows; when this host's dedupd "
      "serves the volume, ask it to run a pass at once instead")(
      "control", po::value<std::string>()->value_name("PATH"),
      "the local dedupd's control socket for --now (default /run/dede/dedupd.ctl)")(
      "json", po::bool_switch(), "print the pass's figures as JSON");
  parser.options()("wait", po::bool_switch(),
                   "with --now, when dedupd runs the pass: wait for it to end and print its "
                   "figures (Ctrl-C stops the waiting, not the pass)");
  parser.SetDetails(
      "Takes the write logs of the files this process can lock (files served by a\n"
      "running dedupd are skipped and counted as busy), merges their fingerprints\n"
      "into the volume's index and shares duplicate blocks copy-on-write. Every\n"
      "share is verified by the volume under both files' locks. A duplicate of a\n"
      "block in a file held elsewhere becomes a merge request that the holder\n"
      "applies; requests posted for files this process can lock are applied first.\n"
      "The volume's policy (dede policy) applies: outside its windows the pass\n"
      "needs --now, and a pass started in a window stops at the window's end\n"
      "(what it had not merged waits for the next pass; exit status 0); it runs\n"
      "at the policy's rate cap, priority and stable-after.\n"
      "Ctrl-C (or SIGTERM) stops the pass at its next step, as a window's end\n"
      "does: what it did is kept, what it had not merged waits for the next\n"
      "pass, and the command fails saying so; a second Ctrl-C kills it.");
  if (auto rc = parser.Parse(args)) return *rc;
  // Only --now asks dedupd; without it a --control was silently ignored
  // and the pass ran here (or was refused outside the windows).
  if (parser.value("control") && !parser.flag("now")) {
    return UsageError(cmd, "--control is for --now (ask that dedupd to run a pass)");
  }
  // A pass run here is always waited for; --wait is for one dedupd runs.
  if (parser.flag("wait") && !parser.flag("now")) {
    return UsageError(cmd, "--wait is for --now (wait for the pass dedupd runs)");
  }
  DedupOptions opts;
  opts.force = parser.flag("force");
  opts.rescan = parser.flag("rescan");
  if (auto v = parser.value("fraction")) {
    std::optional<double> f = ParseNonNegative(*v);
    if (!f) return UsageError(cmd, "--fraction must be a number >= 0, not '" + *v + "'");
    opts.rewrite_fraction = *f;
  }
  if (auto v = parser.value("split-after")) {
    // 0 would split every shard the pass rewrites, at every pass.
    std::optional<double> f = ParseNonNegative(*v);
    if (!f || !(*f * 1000 >= 1) || *f > 1e9) {
      return UsageError(
          cmd, "--split-after must be a number of seconds, at least 0.001, not '" + *v + "'");
    }
    opts.split_threshold_ms = uint64_t(*f * 1000);
  }
  const std::string verify = parser.value("verify").value_or("bytes");
  if (verify == "bytes") {
    opts.verify = VerifyMode::kByteCompare;
  } else if (verify == "witness") {
    opts.verify = VerifyMode::kHashWitness;
  } else {
    return UsageError(cmd, "--verify must be 'bytes' or 'witness'");
  }
  const bool as_json = parser.flag("json");
  const bool tty = ::isatty(STDERR_FILENO) == 1;
  if (tty && !as_json) {
    opts.progress = [](const std::string& line) {
      std::fprintf(stderr, "\r\033[Kdedup: %s", line.c_str());
      std::fflush(stderr);
    };
  }

  const bool now = parser.flag("now");
  auto opened = OpenVolume(parser.positional(0), /*read_only=*/false);
  if (!opened.ok()) return Fail(cmd, opened.status());
  Volume* vol = opened->volume.get();
  if (now) {
    // The files a VM uses here are held by the local dedupd: it runs the
    // pass (it can reach them); this command only asks.
    const std::optional<std::string> control_given = parser.value("control");
    const std::string control = control_given.value_or(kDefaultControlPath);
    Result<json> status = ControlRequest(control, {{"cmd", "status"}}, std::chrono::seconds(10));
    const std::string uuid = UuidToString(vol->superblock().uuid);
    const bool served = status.ok() && status->value("volume_uuid", "") == uuid;
    // Not served there: the pass runs here, unless dedupd was named and is
    // not what was meant, or one is there but does not answer (the pass
    // here would then find the disks it serves busy).
    if (!served && control_given) {
      if (!status.ok()) return Fail(cmd, status.status().message());
      return Fail(cmd, "the dedupd at " + control + " serves another volume (" +
                           status->value("volume_uuid", std::string("?")) + "), not " + uuid);
    }
    if (!served && !status.ok() && status.status().code() != Status::Code::kNotFound) {
      return Fail(cmd, status.status().message() +
                           "; a pass here would find the disks it serves busy: try again, or "
                           "stop it to run the pass here");
    }
    if (served) {
      // dedupd runs its own pass with its own settings: an option given
      // here would be dropped without a word (a --rescan that never ran).
      for (const char* opt : {"rescan", "force", "fraction", "split-after", "verify"}) {
        const bool given = std::string(opt) == "rescan" || std::string(opt) == "force"
                               ? parser.flag(opt)
                               : parser.value(opt).has_value();
        if (given) {
          return UsageError(cmd, std::string("--") + opt + " cannot be passed to dedupd (host " +
                                     (*status)["host_id"].dump() + ", " + control +
                                     "), which runs this volume's pass with its own settings; "
                                     "stop dedupd on this host to run the pass here with it");
        }
      }
      Result<json> reply = ControlRequest(control, {{"cmd", "dedup-now"}});
      if (!reply.ok()) return Fail(cmd, reply.status());
      if (reply->contains("error")) return Fail(cmd, "dedupd: " + (*reply)["error"].get<std::string>());
      if (!parser.flag("wait")) {
        if (as_json) {
          PrintJson(json{{"requested_from", control}, {"host_id", (*status)["host_id"]}});
        } else {
          std::cout << "asked dedupd (host " << (*status)["host_id"] << ", " << control
                    << ") to run a dedup pass now; follow it with `dede status`, or wait for "
                       "it with --wait\n";
        }
        return kExitOk;
      }
      return WaitForDedupdPass(cmd, control, *status, *reply, as_json, tty);
    }
  }
  Result<DedupPolicy> policy = ReadPolicy(vol);
  if (!policy.ok()) return Fail(cmd, policy.status().WithContext("dedup policy"));
  const uint64_t wall = Clock::Real()->NowNanos();
  if (!now && !InWindow(*policy, wall)) {
    std::string windows;
    for (const DedupWindow& w : policy->windows) windows += (windows.empty() ? "" : "; ") + FormatWindow(w);
    return Fail(cmd, "outside the volume's dedup windows (" + windows +
                         "); run with --now to deduplicate anyway");
  }
  opts.stable_after_ns = StableAfterNs(*policy);
  IoThrottle throttle(policy->rate_bytes_per_s);
  opts.io_budget = &throttle;
  opts.settle_io = [&](const std::function<void()>& between) { throttle.Settle(between); };
  opts.batch_ops = IoThrottle::BatchOpsFor(policy->rate_bytes_per_s, opts.batch_ops);
  // A first SIGINT or SIGTERM stops the pass at its next shard the way a
  // window's end stops dedupd's (the records not merged yet are parked,
  // the work done is kept), so the files and shards it holds are closed
  // and unlocked here rather than left to a dead process's lock records.
  // A second one kills as usual.
  InterruptGuard interrupt;
  // A pass started inside a window stops at its end, as dedupd's does
  // (without --now the policy's windows bound the pass, not only its
  // start). A watcher turns either cause into the pass's stop flag.
  PassScheduler window(Clock::Real(), PassScheduler::Options{});
  window.SetPolicy(*policy);
  if (!now) window.PassStarted(PassTrigger::kWindow);
  std::atomic<bool> stop{false}, window_ended{false}, pass_done{false};
  opts.stop = &stop;
  std::thread watcher([&] {
    while (!pass_done.load()) {
      if (interrupt.interrupted()) {
        stop = true;
      } else if (!now && window.ShouldStop()) {
        window_ended = true;
        stop = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  auto access = std::make_unique<VolumeFileAccess>(vol);
  Result<DedupStats> st = Status::Ok();
  {
    ScopedDedupPriority priority(policy->priority);
    st = RunDedupPass(vol, access.get(), opts);
  }
  pass_done = true;
  watcher.join();
  access.reset();  // close (unlock) the files
  if (tty && !as_json) std::fprintf(stderr, "\r\033[K");
  if (!st.ok()) {
    if (interrupt.interrupted()) {
      return Fail(cmd, st.status().WithContext("interrupted; the work of the shards done is kept"));
    }
    return Fail(cmd, st.status());
  }
  const DedupStats& s = *st;
  if (s.stopped && window_ended && !interrupt.interrupted()) {
    // The policy's window closed: a normal end, like dedupd's.
    if (as_json) {
      PrintJson(DedupStatsToJson(s));
    } else {
      std::cout << "dedup pass stopped at the end of the dedup window; " << s.records_parked_at_stop
                << " records were parked for the next pass, the work done is kept\n";
    }
    return kExitOk;
  }
  if (s.stopped) {
    // Interrupted: what was done is durable; say so, and fail the command
    // (it did not finish the pass it was asked for).
    if (as_json) PrintJson(DedupStatsToJson(s));
    return Fail(cmd, "interrupted: the pass stopped early; " +
                         std::to_string(s.records_parked_at_stop) +
                         " records were parked for the next pass, the work done is kept");
  }
  if (as_json) {
    PrintJson(DedupStatsToJson(s));
    return kExitOk;
  }
  PrintPassSummary(s);
  return kExitOk;
}

}  // namespace dede::cli
