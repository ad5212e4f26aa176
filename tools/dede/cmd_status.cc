// `dede status`: asks the local dedupd over its control socket
// (agent/control_server.h) and shows the reply. The reply's schema belongs
// to dedupd and grows over time: this renders what is there, skips what is
// missing or of an unexpected type, and --json passes the reply on as is.
#include <time.h>

#include <cstdint>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "agent/control_server.h"
#include "agent/dedup_policy.h"
#include "tools/dede/cli.h"

namespace po = boost::program_options;
using json = nlohmann::json;

namespace dede::cli {
namespace {

constexpr uint64_t kNsPerSecond = 1'000'000'000;

// ------------------------------------------------ tolerant field access

const json* Field(const json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() ? nullptr : &*it;
}

std::optional<std::string> Str(const json& j, const char* key) {
  const json* f = Field(j, key);
  if (f == nullptr || !f->is_string()) return std::nullopt;
  return f->get<std::string>();
}

std::optional<double> Num(const json& j, const char* key) {
  const json* f = Field(j, key);
  if (f == nullptr || !f->is_number()) return std::nullopt;
  return f->get<double>();
}

std::optional<uint64_t> Uint(const json& j, const char* key) {
  const json* f = Field(j, key);
  if (f == nullptr || !f->is_number()) return std::nullopt;
  if (f->is_number_unsigned()) return f->get<uint64_t>();
  if (f->is_number_integer()) {
    int64_t v = f->get<int64_t>();
    return v < 0 ? std::nullopt : std::optional<uint64_t>(static_cast<uint64_t>(v));
  }
  double v = f->get<double>();
  return v < 0 ? std::nullopt : std::optional<uint64_t>(static_cast<uint64_t>(v));
}

std::optional<bool> Bool(const json& j, const char* key) {
  const json* f = Field(j, key);
  if (f == nullptr || !f->is_boolean()) return std::nullopt;
  return f->get<bool>();
}

const json* Object(const json& j, const char* key) {
  const json* f = Field(j, key);
  return f != nullptr && f->is_object() ? f : nullptr;
}

const json* Array(const json& j, const char* key) {
  const json* f = Field(j, key);
  return f != nullptr && f->is_array() ? f : nullptr;
}

// ------------------------------------------------ formatting

std::string Join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (const std::string& p : parts) {
    if (p.empty()) continue;
    if (!out.empty()) out += sep;
    out += p;
  }
  return out;
}

std::string LocalDateTime(uint64_t ns) {
  const auto secs = static_cast<time_t>(ns / kNsPerSecond);
  struct tm tm {};
  if (localtime_r(&secs, &tm) == nullptr) return "?";
  char buf[64];
  if (std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm) == 0) return "?";
  return buf;
}

// "2026-11-20 01:00:03 (12 min ago)" / "(in 3 h 05 min)".
std::string WhenText(uint64_t ns) {
  const auto now = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                             std::chrono::system_clock::now().time_since_epoch())
                                             .count());
  std::string text = LocalDateTime(ns);
  if (ns <= now) {
    text += " (" + HumanDuration(static_cast<double>(now - ns) / kNsPerSecond) + " ago)";
  } else {
    text += " (in " + HumanDuration(static_cast<double>(ns - now) / kNsPerSecond) + ")";
  }
  return text;
}

void Line(const std::string& label, const std::string& text) {
  std::string pad = label.size() < 12 ? std::string(12 - label.size(), ' ') : " ";
  std::cout << label << pad << text << '\n';
}

std::string NumberText(const json& j, const char* key) {
  auto v = Uint(j, key);
  return v ? std::to_string(*v) : "-";
}

// ------------------------------------------------ sections

void PrintDaemon(const json& r) {
  std::vector<std::string> parts;
  if (auto v = Uint(r, "pid")) parts.push_back("pid " + std::to_string(*v));
  if (auto v = Uint(r, "host_id")) parts.push_back("host " + std::to_string(*v));
  if (auto v = Str(r, "version")) parts.push_back("version " + *v);
  if (auto v = Num(r, "uptime_s"); v && *v >= 0) parts.push_back("up " + HumanDuration(*v));
  if (!parts.empty()) Line("dedupd", Join(parts, ", "));
  if (auto vol = Str(r, "volume")) {
    std::string text = *vol;
    if (auto uuid = Str(r, "volume_uuid")) text += " (uuid " + *uuid + ")";
    Line("volume", text);
  }
  // A failing flush point is the first thing an operator must see: every
  // write since the last good one may be lost, and (the device having lost
  // a flush) every later one fails until dedupd restarts.
  if (const json* fp = Object(r, "flush_points"); fp && Bool(*fp, "failing").value_or(false)) {
    std::string text = "FAILING";
    if (auto since = Uint(*fp, "failing_since_ns"); since && *since > 0) {
      text += " since " + WhenText(*since);
    }
    if (auto n = Uint(*fp, "failed_in_a_row")) text += ", " + std::to_string(*n) + " in a row";
    if (auto e = Str(*fp, "error"); e && !e->empty()) text += ": " + *e;
    Line("flushes", text);
  }
}

void PrintExports(const json& r) {
  const json* exports = Array(r, "exports");
  if (exports == nullptr) return;
  if (exports->empty()) {
    Line("exports", "none");
    return;
  }
  uint64_t clients = 0;
  for (const json& e : *exports) clients += Uint(e, "clients").value_or(0);
  Line("exports", Count(exports->size(), "export") + ", " + Count(clients, "client"));

  // A column only when some export has its field: without a write monitor
  // there are no record counts, and older dedupds lack newer fields.
  struct Column {
    const char* key;
    const char* title;
  };
  const Column kColumns[] = {{"clients", "CLIENTS"},           {"dedup", "DEDUP"},
                             {"hashed_blocks", "HASHED"},      {"log_records", "LOG RECORDS"},
                             {"buffered_records", "BUFFERED"}, {"dropped_records", "DROPPED"},
                             {"cow_copies", "COW COPIES"}, {"write_log_saturated", "LOG FULL"}};
  std::vector<const Column*> columns;
  for (const Column& c : kColumns) {
    for (const json& e : *exports) {
      // A full log is rare: its column shows only when some export has one.
      if (std::string(c.key) == "write_log_saturated" && !Bool(e, c.key).value_or(false)) {
        continue;
      }
      if (Field(e, c.key) != nullptr) {
        columns.push_back(&c);
        break;
      }
    }
  }
  // Cells, row 0 the titles; column 0 the name.
  std::vector<std::vector<std::string>> rows(1, {"NAME"});
  for (const Column* c : columns) rows[0].push_back(c->title);
  for (const json& e : *exports) {
    std::vector<std::string> row = {Str(e, "name").value_or("?")};
    for (const Column* c : columns) {
      if (std::string(c->key) == "dedup") {
        auto dedup = Bool(e, "dedup");
        row.push_back(dedup ? (*dedup ? "on" : "off") : "-");
      } else if (std::string(c->key) == "write_log_saturated") {
        auto full = Bool(e, "write_log_saturated");
        row.push_back(full ? (*full ? "yes" : "no") : "-");
      } else {
        row.push_back(NumberText(e, c->key));
      }
    }
    rows.push_back(std::move(row));
  }
  std::vector<size_t> width(columns.size() + 1, 0);
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size(); i++) width[i] = std::max(width[i], row[i].size());
  }
  for (const auto& row : rows) {
    std::string line = " ";
    for (size_t i = 0; i < row.size(); i++) {
      std::string pad(width[i] - row[i].size(), ' ');
      // Names and on/off left-aligned, numbers right-aligned.
      const bool left = i == 0 || std::string(columns[i - 1]->key) == "dedup" ||
                        std::string(columns[i - 1]->key) == "write_log_saturated";
      line += " " + (left ? row[i] + pad : pad + row[i]);
      if (i + 1 < row.size()) line += " ";
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::cout << line << '\n';
  }
}

void PrintLeases(const json& r) {
  const json* leases = Array(r, "leases");
  if (leases == nullptr) return;
  std::string backend;
  if (auto v = Str(r, "lock_backend")) backend = " (" + *v + ")";
  if (leases->empty()) {
    Line("leases", "none held" + backend);
    return;
  }
  Line("leases", std::to_string(leases->size()) + " held" + backend);
  for (const json& l : *leases) {
    std::string text = Str(l, "lock").value_or("?");
    if (auto mode = Str(l, "mode")) text += " (" + *mode + ")";
    std::cout << "  " << text << '\n';
  }
}

// The NBD server's counters since dedupd started.
void PrintNbd(const json& r) {
  const json* n = Object(r, "nbd");
  if (n == nullptr) return;
  std::vector<std::string> parts;
  if (auto open = Uint(*n, "connections_open")) {
    std::string text = Count(*open, "connection") + " open";
    std::vector<std::string> since;
    if (auto v = Uint(*n, "connections_total")) since.push_back(std::to_string(*v) + " accepted");
    if (auto v = Uint(*n, "connections_refused"); v && *v > 0) {
      since.push_back(std::to_string(*v) + " refused at --max-connections");
    }
    if (auto v = Uint(*n, "connections_denied"); v && *v > 0) {
      since.push_back(std::to_string(*v) + " denied on TCP");
    }
    if (!since.empty()) text += " (" + Join(since, ", ") + ")";
    parts.push_back(text);
  }
  if (auto v = Uint(*n, "requests")) {
    std::string text = Count(*v, "request");
    if (auto e = Uint(*n, "request_errors"); e && *e > 0)
      text += " (" + std::to_string(*e) + " failed)";
    parts.push_back(text);
  }
  if (auto v = Uint(*n, "bytes_written")) parts.push_back(HumanSize(*v) + " written");
  if (auto v = Uint(*n, "bytes_read")) parts.push_back(HumanSize(*v) + " read");
  if (auto v = Uint(*n, "protocol_errors"); v && *v > 0) {
    parts.push_back(Count(*v, "connection") + " closed for malformed traffic");
  }
  if (auto v = Uint(*n, "handshake_timeouts"); v && *v > 0) {
    parts.push_back(Count(*v, "connection") + " closed idle in the handshake");
  }
  if (!parts.empty()) Line("nbd", Join(parts, ", "));

  // The host-wide budget of READ and WRITE data (--nbd-memory).
  std::vector<std::string> memory;
  if (auto used = Uint(*n, "memory_in_use")) {
    std::string text = HumanSize(*used);
    if (auto limit = Uint(*n, "memory_limit")) text += " of " + HumanSize(*limit);
    text += " in use";
    if (auto peak = Uint(*n, "memory_peak")) text += " (peak " + HumanSize(*peak) + ")";
    memory.push_back(text);
  }
  if (auto v = Uint(*n, "memory_waiting")) {
    std::string text = Count(*v, "connection") + " waiting for room";
    if (auto waits = Uint(*n, "memory_waits"); waits && *waits > 0) {
      text += " (" + Count(*waits, "request") + " waited so far)";
    }
    memory.push_back(text);
  }
  if (auto v = Uint(*n, "stall_closes"); v && *v > 0) {
    memory.push_back(Count(*v, "stalled connection") + " closed (--nbd-stall-timeout)");
  }
  if (!memory.empty()) Line("nbd memory", Join(memory, ", "));
}

// The control socket `dede status` itself came through.
void PrintControl(const json& r) {
  const json* c = Object(r, "control_connections");
  if (c == nullptr) return;
  std::vector<std::string> parts;
  if (auto open = Uint(*c, "open")) {
    // "1 of 64 connections open", "1 of 1 connection open".
    auto max = Uint(*c, "max");
    std::string text = std::to_string(*open);
    if (max) text += " of " + std::to_string(*max);
    parts.push_back(text + (max.value_or(*open) == 1 ? " connection" : " connections") + " open");
  }
  if (auto v = Uint(*c, "refused"); v && *v > 0) {
    parts.push_back(std::to_string(*v) + " refused at --control-max-connections");
  }
  if (auto v = Uint(*c, "evicted"); v && *v > 0) {
    parts.push_back(std::to_string(*v) + " idle closed to make room");
  }
  std::string text = Join(parts, ", ");
  if (auto path = Str(r, "control"); path && !path->empty()) {
    text = *path + (text.empty() ? "" : ": " + text);
  }
  if (!text.empty()) Line("control", text);
}

void PrintMonitor(const json& r) {
  const json* field = Field(r, "monitor");
  if (field != nullptr && field->is_null()) {
    Line("monitor", "off");
    return;
  }
  const json* m = Object(r, "monitor");
  if (m == nullptr) return;
  std::vector<std::string> parts;
  if (auto bytes = Uint(*m, "buffer_bytes")) {
    std::string text = HumanSize(*bytes);
    if (auto cap = Uint(*m, "buffer_cap_bytes")) text += " of " + HumanSize(*cap);
    parts.push_back(text + " buffered");
  }
  if (auto v = Uint(*m, "records_buffered")) parts.push_back(Count(*v, "record") + " buffered");
  if (auto v = Uint(*m, "records_dropped")) parts.push_back(std::to_string(*v) + " dropped");
  if (auto v = Uint(*m, "hashed_blocks")) parts.push_back(Count(*v, "block") + " hashed");
  if (auto v = Uint(*m, "unrecorded_blocks"); v && *v > 0) {
    // Written while the file's log was full: the next pass rehashes them.
    parts.push_back(Count(*v, "block") + " not hashed (log full)");
  }
  if (auto v = Uint(*m, "files")) parts.push_back(Count(*v, "file"));
  if (!parts.empty()) Line("monitor", Join(parts, ", "));

  const json* w = Object(r, "write_logs");
  if (w == nullptr) return;
  std::vector<std::string> logs;
  if (auto v = Uint(*w, "bytes")) logs.push_back(HumanSize(*v) + " appended");
  if (auto v = Uint(*w, "failed"); v && *v > 0) logs.push_back(std::to_string(*v) + (*v == 1 ? " batch" : " batches") + " lost");
  if (auto v = Uint(*w, "no_space_skipped"); v && *v > 0) {
    logs.push_back(std::to_string(*v) + (*v == 1 ? " batch" : " batches") +
                   " dropped untried (volume full)");
  }
  if (auto v = Uint(*w, "saturations"); v && *v > 0) {
    std::string text = std::to_string(*v) + " reached the size limit";
    if (auto e = Uint(*w, "capped_entries")) text += " (" + std::to_string(*e) + (*e == 1 ? " entry" : " entries") + " not logged)";
    logs.push_back(text);
  }
  if (auto pct = Uint(*w, "limit_percent")) {
    logs.push_back(*pct == 0 ? std::string("no size limit")
                             : "limit " + std::to_string(*pct) + "% of the file");
  }
  if (!logs.empty()) Line("write logs", Join(logs, ", "));
}

void PrintPolicy(const json& r) {
  const json* p = Object(r, "policy");
  if (p == nullptr) return;
  if (auto read = Bool(*p, "read"); read && !*read) {
    Line("policy", "UNREADABLE (" + Str(*p, "error").value_or("?") +
                       "): no dedup passes or merge requests until dedupd can read it");
    return;
  }
  // Window texts contain commas ("sat,sun 00:00-24:00") and are listed the
  // way `dede policy` takes them, ';'-separated: on a line of their own.
  std::string label = "policy";
  if (const json* windows = Array(*p, "windows")) {
    std::vector<std::string> names;
    for (const json& w : *windows) {
      if (w.is_string()) names.push_back(w.get<std::string>());
    }
    std::string text = names.empty() ? "windows: always" : "windows: " + Join(names, "; ");
    // In dedupd's local time, which may not be this command's.
    if (auto zone = Str(*p, "time_zone"); zone && !names.empty()) text += ", host time " + *zone;
    Line(label, text);
    label.clear();
  }
  std::vector<std::string> parts;
  if (auto rate = Uint(*p, "rate_bytes_per_s")) {
    parts.push_back("rate " + PolicyRateText(*rate));
  }
  if (auto v = Str(*p, "priority")) parts.push_back("priority " + *v);
  if (auto v = Uint(*p, "stable_after_s")) {
    parts.push_back(*v == 0 ? "no stability wait"
                            : "stable after " + HumanDuration(static_cast<double>(*v)));
  }
  if (!parts.empty()) {
    Line(label, Join(parts, ", "));
    label.clear();
  }
  if (auto in_window = Bool(*p, "in_window")) {
    std::string text = *in_window ? "dedup may run now" : "outside the windows: dedup waits";
    if (auto window = Str(*p, "window"); window && !window->empty() && *in_window) {
      text += " (" + *window + ")";
    }
    if (auto next = Uint(*p, "next_change_ns"); next && *next > 0) {
      text += " until " + WhenText(*next);
    }
    Line(label, text);
  }
}

void PrintPass(const json& r) {
  if (const json* pass = Object(r, "pass")) {
    if (Bool(*pass, "running").value_or(false)) {
      std::string text = "running";
      std::vector<std::string> why;
      if (auto trigger = Str(*pass, "trigger")) why.push_back(*trigger);
      if (auto window = Str(*pass, "window"); window && !window->empty()) why.push_back(*window);
      if (!why.empty()) text += " (" + Join(why, " ") + ")";
      if (auto started = Uint(*pass, "started_ns"); started && *started > 0) {
        text += " since " + WhenText(*started);
      }
      std::vector<std::string> details;
      if (auto progress = Str(*pass, "progress")) details.push_back(*progress);
      if (auto records = Uint(*pass, "records")) details.push_back(Count(*records, "record"));
      if (!details.empty()) text += ": " + Join(details, ", ");
      if (Bool(*pass, "stopping").value_or(false)) text += "; stopping";
      Line("pass", text);
    } else {
      Line("pass", "none running");
    }
  }
  if (const json* passes = Object(r, "passes")) {
    std::vector<std::string> parts;
    if (auto v = Uint(*passes, "completed")) parts.push_back(std::to_string(*v) + " completed");
    if (auto v = Uint(*passes, "stopped")) parts.push_back(std::to_string(*v) + " stopped");
    if (auto v = Uint(*passes, "failed")) parts.push_back(std::to_string(*v) + " failed");
    std::string text = Join(parts, ", ");
    if (auto last = Uint(*passes, "last_end_ns"); last && *last > 0) {
      text += (text.empty() ? "" : "; ") + std::string("last ended ") + WhenText(*last);
    }
    if (!text.empty()) Line("passes", text);
    if (auto n = Uint(*passes, "failed_in_a_row"); n && *n > 0) {
      std::string backoff = std::to_string(*n) + " failed in a row: backing off";
      auto wait = Num(*passes, "failure_backoff_s");
      auto last = Uint(*passes, "last_end_ns");
      if (wait && last && *last > 0) {
        backoff += ", the next scheduled pass no sooner than " +
                   WhenText(*last + static_cast<uint64_t>(*wait * kNsPerSecond));
      }
      Line("", backoff + " (`dede dedup --now` runs one at once)");
    }
    // What the passes achieved since dedupd started.
    std::vector<std::string> totals;
    if (auto v = Uint(*passes, "blocks_shared")) totals.push_back(Count(*v, "block") + " shared");
    if (auto v = Uint(*passes, "bytes_reclaimed")) totals.push_back(HumanSize(*v) + " reclaimed");
    if (auto v = Uint(*passes, "merge_requests_applied")) {
      totals.push_back(Count(*v, "merge request") + " applied");
    }
    if (auto v = Uint(*passes, "io_bytes")) totals.push_back(HumanSize(*v) + " of I/O");
    if (!totals.empty()) Line(text.empty() ? "passes" : "", Join(totals, ", "));
  }
}

void PrintRest(const json& r) {
  if (const json* drops = Object(r, "drops")) {
    std::vector<std::string> parts;
    if (auto v = Uint(*drops, "deferred")) parts.push_back(std::to_string(*v) + " deferred");
    if (auto v = Uint(*drops, "applied")) parts.push_back(std::to_string(*v) + " applied");
    if (auto v = Uint(*drops, "pending")) parts.push_back(std::to_string(*v) + " pending");
    if (auto v = Uint(*drops, "adopted"); v && *v > 0) {
      parts.push_back(std::to_string(*v) + " adopted");
    }
    if (auto v = Uint(*drops, "groups_yielded"); v && *v > 0) {
      parts.push_back(std::to_string(*v) + " group takes left to waiting hosts");
    }
    if (!parts.empty()) Line("drops", Join(parts, ", "));
  }
  if (const json* res = Object(r, "write_reservations")) {
    // Shown only when a wait had to count in-flight writes' blocks early
    // (a crash right after can leave such blocks leaked: fsck --repair)
    // or a failed write left blocks leaked.
    std::vector<std::string> parts;
    if (auto v = Uint(*res, "materialized"); v && *v > 0) {
      parts.push_back(std::to_string(*v) + " in-flight blocks counted early for a lock wait");
    }
    // Failed writes' blocks that neither their group nor the full drop
    // list could take back: allocated until fsck --repair frees them.
    if (auto v = Uint(*res, "leaked"); v && *v > 0) {
      parts.push_back(std::to_string(*v) + " blocks of failed writes leaked (fsck --repair)");
    }
    if (!parts.empty()) Line("writes", Join(parts, "; "));
  }
  if (auto v = Uint(r, "cow_copies")) {
    Line("cow", std::to_string(*v) + (*v == 1 ? " copy" : " copies") + " of shared blocks");
  }
  // The device flushes VM writes waited for (held) and those they did not.
  if (const json* f = Object(r, "volume_flushes")) {
    auto held = Uint(*f, "held"), unlocked = Uint(*f, "unlocked");
    auto held_s = Num(*f, "held_s");
    auto checkpoints = Uint(*f, "checkpoints"), quiet = Uint(*f, "quiet_checkpoints"),
         deferred = Uint(*f, "quiet_checkpoints_deferred");
    if (held && unlocked && held_s && checkpoints && quiet && deferred) {
      Line("metadata", std::to_string(*unlocked) + " flushes without the volume mutex, " +
                           std::to_string(*held) + " holding it (" + HumanDuration(*held_s) +
                           " in all); " + Count(*checkpoints, "checkpoint") + " (" +
                           std::to_string(*quiet) + " at quiet flush points, " +
                           std::to_string(*deferred) + " put off)");
    }
  }
  if (const json* ra = Object(r, "read_ahead")) {
    auto hits = Uint(*ra, "hits"), wasted = Uint(*ra, "wasted"), bytes = Uint(*ra, "bytes");
    if (hits && wasted && bytes) {
      std::string text = std::to_string(*hits) + " READs answered from windows, " +
                         HumanSize(*bytes) + " read ahead, " + std::to_string(*wasted) +
                         " windows unused";
      auto skipped = Uint(*ra, "no_budget"), used = Uint(*ra, "memory_used"),
           cap = Uint(*ra, "memory_cap");
      if (used && cap) text += "; " + HumanSize(*used) + " of " + HumanSize(*cap) + " held";
      if (skipped && *skipped > 0) text += ", " + std::to_string(*skipped) + " skipped for memory";
      Line("read-ahead", text);
    }
  }
  if (const json* t = Object(r, "throttle")) {
    std::vector<std::string> parts;
    if (auto rate = Uint(*t, "rate_bytes_per_s")) {
      parts.push_back(*rate == 0 ? "no rate cap" : "cap " + PolicyRateText(*rate));
    }
    if (auto v = Uint(*t, "io_bytes")) parts.push_back(HumanSize(*v) + " of dedup I/O");
    if (auto v = Num(*t, "waited_s"); v && *v >= 0) parts.push_back("waited " + HumanDuration(*v));
    if (!parts.empty()) Line("throttle", Join(parts, ", "));
  }
  if (auto v = Str(r, "history")) Line("history", v->empty() ? "off" : *v);
  if (auto port = Uint(r, "metrics_port"); port && *port > 0) {
    Line("metrics", "http://127.0.0.1:" + std::to_string(*port) + "/metrics");
  }
}

}  // namespace

int RunStatus(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.options()(
      "control", po::value<std::string>()->value_name("PATH"),
      (std::string("dedupd's control socket (default ") + kDefaultControlPath + ")").c_str())(
      "json", po::bool_switch(), "print dedupd's reply as JSON");
  parser.SetDetails(
      "Talks to the dedupd of this host over its control socket; the volume is\n"
      "not opened. Fails when no dedupd listens there.");
  if (auto rc = parser.Parse(args)) return *rc;
  const std::string path = parser.value("control").value_or(kDefaultControlPath);
  if (path.empty()) return UsageError(cmd, "--control must not be empty");

  Result<json> reply = ControlRequest(path, json{{"cmd", "status"}});
  if (!reply.ok() && reply.status().code() == Status::Code::kNotFound) {
    return Fail(cmd, reply.status().message() +
                         ": is dedupd running (systemctl status dedupd)? For an instance "
                         "(dedupd@NAME), --control the socket its configuration names");
  }
  if (!reply.ok()) return Fail(cmd, reply.status());
  const json& r = reply.value();
  if (auto error = Str(r, "error")) return Fail(cmd, "dedupd: " + *error);
  if (!r.is_object())
    return Fail(cmd, "dedupd at " + path + " sent a reply that is not a JSON object");

  if (parser.flag("json")) {
    PrintJson(r);
    return kExitOk;
  }
  PrintDaemon(r);
  PrintExports(r);
  PrintNbd(r);
  PrintControl(r);
  PrintLeases(r);
  PrintMonitor(r);
  PrintPolicy(r);
  PrintPass(r);
  PrintRest(r);
  return kExitOk;
}

}  // namespace dede::cli
