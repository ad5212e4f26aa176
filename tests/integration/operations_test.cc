// Operating dede with a real dedupd: opting a running VM's disk out of
// dedup through the control socket, `dede status`, `dede dedup --now`,
// `dede policy`, `dede report` and the Prometheus endpoint.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kmod/writemon/write_log.h"
#include "tests/index_entries.h"
#include "tests/integration/hold_fuse.h"
#include "tests/integration/rig.h"
#include "tests/random_bytes.h"
#include "volume/volume.h"

namespace dede {
namespace {

using json = nlohmann::json;
using namespace test;
constexpr uint64_t kMiB = 1 << 20;

ProcessResult RunOk(const std::vector<std::string>& argv, int timeout_s = 300) {
  ProcessResult r = RunProcess(argv, timeout_s);
  INFO(DescribeRun(argv, r));
  REQUIRE(r.exit_code == 0);
  return r;
}

std::string Dede(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {BinaryPath("dede")};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunOk(argv).out;
}

json Status(const DedupdProcess& d) {
  return json::parse(Dede({"status", "--control", d.control(), "--json"}));
}

const json* ExportOf(const json& status, const std::string& name) {
  for (const json& e : status["exports"]) {
    if (e["name"] == name) return &e;
  }
  return nullptr;
}

// Asks dedupd for a pass (`dede dedup --now`) and waits until it finished.
void PassNow(const std::string& vol, const DedupdProcess& d) {
  const uint64_t before = Status(d)["passes"]["completed"].get<uint64_t>();
  const std::string out = Dede({"dedup", vol, "--now", "--control", d.control()});
  REQUIRE(out.find("asked dedupd") != std::string::npos);
  const auto t0 = std::chrono::steady_clock::now();
  while (true) {
    json s = Status(d);
    if (s["passes"]["completed"].get<uint64_t>() > before && !s["pass"]["running"].get<bool>()) {
      return;
    }
    INFO(d.Log());
    REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(120));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void WriteRandomFile(const std::string& path, uint64_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> data(bytes);
  dede::test::FillRandom(rng, data.data(), data.size());
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(data.data()),
                                              std::streamsize(data.size()));
}

// Unique index entries naming `name`'s inode, read from the shards.
uint64_t UniqueEntriesOf(const std::string& vol, const std::string& name) {
  OpenOptions oo;
  oo.read_only = true;
  auto ov = OpenVolumeSpec(vol, oo);
  REQUIRE(ov.ok());
  Volume* v = ov->volume.get();
  auto info = v->Lookup(name);
  REQUIRE(info.ok());
  return test::UniqueEntriesOf(v, info->id.ino);
}

std::map<uint64_t, BlockRecord> LogRecords(const std::string& vol, const std::string& name) {
  OpenOptions oo;
  oo.read_only = true;
  auto ov = OpenVolumeSpec(vol, oo);
  REQUIRE(ov.ok());
  auto info = ov->volume->Lookup(name);
  REQUIRE(info.ok());
  auto log = OpenWriteLog(ov->volume.get(), info->id);
  if (!log.ok()) {
    REQUIRE(log.status().code() == Status::Code::kNotFound);
    return {};
  }
  auto st = ReplayWriteLog(log->get(), ov->volume->superblock().hash_algo,
                           ov->volume->superblock().uuid, info->id);
  REQUIRE(st.ok());
  return st->records;
}

std::vector<uint8_t> ReadBack(const TempDir& dir, const DedupdProcess& d, const std::string& name) {
  const std::string out = dir.file("readback-" + name + ".raw");
  RunOk({RequireProgram("qemu-img"), "convert", "-f", "raw", "-O", "raw", d.Uri(name), out});
  std::vector<uint8_t> data = ReadWholeFile(out);
  ::unlink(out.c_str());
  return data;
}

// One HTTP GET on 127.0.0.1:port; the whole response.
std::string HttpGet(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  REQUIRE(::write(fd, req.data(), req.size()) == ssize_t(req.size()));
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, size_t(n));
  ::close(fd);
  return out;
}

TEST_CASE("dedup=off on a live export: no records after the switch and no entries or shares after the next pass",
          "[ops]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  CreateSparseFile(vol, 512 * kMiB);
  Dede({"format", vol});
  for (const char* name : {"vm-a", "vm-b"}) Dede({"create", vol, name, "--size", "4M"});
  const std::string x = dir.file("x.bin"), z = dir.file("z.bin");
  WriteRandomFile(x, kMiB, 1);
  WriteRandomFile(z, kMiB, 2);
  DedupdProcess d(vol, 1, dir.file("nbd.sock"));
  const std::string qemu_io = RequireProgram("qemu-io");

  // vm-a holds X; vm-b holds Z; a pass indexes both (dedup is on).
  RunOk({qemu_io, "-f", "raw", "-c", "write -s " + x + " 0 1M", d.Uri("vm-a")});
  RunOk({qemu_io, "-f", "raw", "-c", "write -s " + z + " 0 1M", d.Uri("vm-b")});
  PassNow(vol, d);
  json s = Status(d);
  REQUIRE(s["passes"]["completed"].get<uint64_t>() >= 1);
  // Options of a pass cannot travel to dedupd's: refused, not dropped.
  for (const char* opt : {"--rescan", "--force"}) {
    ProcessResult r =
        RunProcess({BinaryPath("dede"), "dedup", vol, "--now", opt, "--control", d.control()});
    INFO(opt << ": " << r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("cannot be passed to dedupd") != std::string::npos);
  }

  // A VM on vm-b: writes Z again, then (after the switch) a copy of X at
  // 1 MiB and Z at 2 MiB, staying connected throughout.
  const std::string vm_log = dir.file("vm-b.qemu-io.log");
  int vm = StartProcess({qemu_io, "-f", "raw", "-c", "write -s " + z + " 0 1M", "-c", "flush",
                         "-c", "sleep 8000", "-c", "write -s " + x + " 1M 1M", "-c",
                         "write -s " + z + " 2M 1M", "-c", "flush", d.Uri("vm-b")},
                        {}, vm_log);
  // Wait until the first write was fingerprinted, then switch while the VM
  // is connected.
  const auto t0 = std::chrono::steady_clock::now();
  while (true) {
    s = Status(d);
    const json* e = ExportOf(s, "vm-b");
    if (e != nullptr && (*e)["hashed_blocks"].get<uint64_t>() >= 256) break;
    REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  Dede({"set", vol, "vm-b", "dedup=off", "--control", d.control()});
  s = Status(d);
  const json* e = ExportOf(s, "vm-b");
  REQUIRE(e != nullptr);
  CHECK((*e)["dedup"] == false);
  CHECK((*e)["clients"].get<int>() >= 1);
  // Still in the VM's sleep: the later writes come after the switch.
  CHECK((*e)["hashed_blocks"].get<uint64_t>() == 256);
  int status = 0;
  REQUIRE(::waitpid(vm, &status, 0) == vm);
  INFO(ReadWholeFile(vm_log).size());
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  s = Status(d);
  e = ExportOf(s, "vm-b");
  if (e != nullptr) CHECK((*e)["hashed_blocks"].get<uint64_t>() == 256);

  // The monitor logged nothing for vm-b after the switch: stop dedupd (it
  // flushes every buffer) and read the log.
  REQUIRE(d.Stop() == 0);
  {
    const auto recs = LogRecords(vol, "vm-b");
    for (const auto& [block, rec] : recs) {
      INFO("block " << block);
      CHECK(block < 256);
    }
    CHECK(UniqueEntriesOf(vol, "vm-b") == 256);  // from the first pass
  }

  // The next pass drops vm-b's index entries and shares nothing of it,
  // though vm-b now holds a copy of vm-a's X.
  DedupdProcess d2(vol, 1, dir.file("nbd2.sock"));
  PassNow(vol, d2);
  std::vector<uint8_t> a = ReadBack(dir, d2, "vm-a");
  std::vector<uint8_t> b = ReadBack(dir, d2, "vm-b");
  REQUIRE(d2.Stop() == 0);
  CHECK(UniqueEntriesOf(vol, "vm-b") == 0);
  json ls = json::parse(Dede({"ls", vol, "-l", "--json"}));
  int seen = 0;
  for (const json& f : ls) {
    INFO(f.dump());
    if (f["name"] == "vm-b" || f["name"] == "vm-a") {
      seen++;
      CHECK(f["shared_blocks"] == 0);
    }
    if (f["name"] == "vm-b") CHECK(f["dedup"] == false);
  }
  CHECK(seen == 2);
  // Data intact.
  const std::vector<uint8_t> xd = ReadWholeFile(x), zd = ReadWholeFile(z);
  REQUIRE(a.size() == 4 * kMiB);
  REQUIRE(b.size() == 4 * kMiB);
  CHECK(std::memcmp(a.data(), xd.data(), kMiB) == 0);
  CHECK(std::memcmp(b.data(), zd.data(), kMiB) == 0);
  CHECK(std::memcmp(b.data() + kMiB, xd.data(), kMiB) == 0);
  CHECK(std::memcmp(b.data() + 2 * kMiB, zd.data(), kMiB) == 0);
  RunOk({BinaryPath("dede"), "fsck", vol});

  // Switched back on with no dedupd serving it: what vm-b got while off
  // was never hashed, so the switch marks the whole file changed and the
  // next pass rehashes it: the copy of X and the second Z are shared.
  Dede({"set", vol, "vm-b", "dedup=on", "--control", dir.file("no-dedupd.ctl")});
  DedupdProcess d3(vol, 1, dir.file("nbd3.sock"));
  PassNow(vol, d3);
  std::vector<uint8_t> b_after = ReadBack(dir, d3, "vm-b");
  REQUIRE(d3.Stop() == 0);
  ls = json::parse(Dede({"ls", vol, "-l", "--json"}));
  for (const json& f : ls) {
    INFO(f.dump());
    if (f["name"] == "vm-b") {
      CHECK(f["dedup"] == true);
      CHECK(f["shared_blocks"].get<uint64_t>() >= 512);
    }
  }
  CHECK(b_after == b);
  RunOk({BinaryPath("dede"), "fsck", vol});
}

// Waits until `pred(status)` holds (30 s at most).
template <typename Pred>
json WaitStatus(const DedupdProcess& d, Pred pred, const char* what) {
  const auto t0 = std::chrono::steady_clock::now();
  while (true) {
    json s = Status(d);
    if (pred(s)) return s;
    INFO("waiting for " << what << "; status " << s.dump());
    REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

TEST_CASE("dede dedup --now --wait follows dedupd's pass and prints its figures", "[ops]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  CreateSparseFile(vol, 512 * kMiB);
  Dede({"format", vol});
  for (const char* name : {"vm-a", "vm-b"}) Dede({"create", vol, name, "--size", "4M"});
  const std::string x = dir.file("x.bin");
  WriteRandomFile(x, kMiB, 11);
  DedupdProcess d(vol, 1, dir.file("nbd.sock"));
  const std::string qemu_io = RequireProgram("qemu-io");
  // --wait is for a pass dedupd runs.
  {
    ProcessResult r = RunProcess({BinaryPath("dede"), "dedup", vol, "--wait"});
    INFO(r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("--wait is for --now") != std::string::npos);
  }
  // The same MiB in both files: one pass shares 256 blocks.
  RunOk({qemu_io, "-f", "raw", "-c", "write -s " + x + " 0 1M", d.Uri("vm-a")});
  RunOk({qemu_io, "-f", "raw", "-c", "write -s " + x + " 0 1M", d.Uri("vm-b")});
  const json first =
      json::parse(Dede({"dedup", vol, "--now", "--wait", "--json", "--control", d.control()}));
  INFO(first.dump() << "\n" << d.Log());
  CHECK(first["pass"] == 1);
  CHECK(first["host_id"] == 1);
  CHECK(first["requested_from"] == d.control());
  CHECK(first["stopped"] == false);
  CHECK(first["log_records"].get<uint64_t>() == 512);
  CHECK(first["shared_new"].get<uint64_t>() + first["shared_hits"].get<uint64_t>() == 256);
  // It returned once the pass had ended (no polling here), and dedupd's
  // own account of the pass agrees with the figures printed.
  json s = Status(d);
  CHECK(s["passes"]["completed"] == 1);
  CHECK(s["pass"]["running"] == false);
  CHECK(s["passes"]["blocks_shared"] == 256);
  // As text, a second pass (nothing new to share).
  const std::string text = Dede({"dedup", vol, "--now", "--wait", "--control", d.control()});
  CHECK(text.find("pass 2:") != std::string::npos);
  CHECK(text.find("new shared blocks   0") != std::string::npos);
  CHECK(Status(d)["passes"]["completed"] == 2);
}

TEST_CASE("a write log at its size limit saturates, the next pass rehashes the file and dedups it",
          "[ops]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  CreateSparseFile(vol, 512 * kMiB);
  Dede({"format", vol});
  Dede({"create", vol, "vm", "--size", "8M"});
  const std::string x = dir.file("x.bin");
  WriteRandomFile(x, kMiB, 7);
  // 1% of 8 MiB: ~82 KiB of log, where writing the whole file once logs
  // 2048 records of 28 bytes (56 KiB).
  DedupdProcess d(vol, 1, dir.file("nbd.sock"),
                  {"--write-log-limit", "1", "--write-log-min", "64K", "--log-flush-interval",
                   "0.1", "--metrics-port", "0"});
  const std::string qemu_io = RequireProgram("qemu-io");
  auto write_all = [&](const std::string& then) {
    std::vector<std::string> argv = {qemu_io, "-f", "raw"};
    for (int i = 0; i < 8; i++) {
      argv.push_back("-c");
      argv.push_back("write -s " + x + " " + std::to_string(i) + "M 1M");
    }
    if (!then.empty()) argv.insert(argv.end(), {"-c", then});
    argv.push_back(d.Uri("vm"));
    return argv;
  };
  RunOk(write_all(""));
  RunOk(write_all(""));
  json s = WaitStatus(d, [](const json& j) { return j["write_logs"]["saturations"] >= 1; },
                      "the log to saturate");
  CHECK(s["write_logs"]["capped_entries"].get<uint64_t>() > 0);
  const uint64_t hashed_before = s["monitor"]["hashed_blocks"].get<uint64_t>();
  const uint64_t unrecorded_before = s["monitor"]["unrecorded_blocks"].get<uint64_t>();
  // Writes after the saturation are neither hashed nor logged: the log
  // already marks the whole file changed. The monitor knows it from the
  // log as soon as the file opens again. The VM stays connected for a
  // while, so its export shows the full log.
  const std::string vm_log = dir.file("vm.qemu-io.log");
  const int vm = StartProcess(write_all("sleep 20000"), {}, vm_log);
  s = WaitStatus(
      d,
      [&](const json& j) {
        return j["monitor"]["unrecorded_blocks"].get<uint64_t>() >= unrecorded_before + 2048;
      },
      "the rewrite to go unrecorded");
  CHECK(s["monitor"]["hashed_blocks"] == hashed_before);
  CHECK(s["monitor"]["log_full_files"] == 1);
  const json* e = ExportOf(s, "vm");
  REQUIRE(e != nullptr);
  CHECK((*e)["write_log_saturated"] == true);
  CHECK((*e)["unrecorded_blocks"].get<uint64_t>() >= 2048);
  {
    const std::string table = Dede({"status", "--control", d.control()});
    INFO(table);
    CHECK(table.find("LOG FULL") != std::string::npos);
    CHECK(table.find(" yes") != std::string::npos);
    CHECK(table.find("not hashed (log full)") != std::string::npos);
  }
  ::kill(vm, SIGTERM);
  int vm_status = 0;
  REQUIRE(::waitpid(vm, &vm_status, 0) == vm);
  CHECK(s["write_logs"]["saturations"] == 1);
  CHECK(s["write_logs"]["failed"] == 0);
  CHECK(s["write_logs"]["limit_percent"] == 1);
  const std::string text = Dede({"status", "--control", d.control()});
  CHECK(text.find("1 reached the size limit") != std::string::npos);
  CHECK(text.find("LOG FULL") == std::string::npos);  // no export is open now
  {
    // The log stays within its limit plus the one saturation frame.
    OpenOptions oo;
    oo.read_only = true;
    auto ov = OpenVolumeSpec(vol, oo);
    REQUIRE(ov.ok());
    auto info = ov->volume->Lookup(WriteLogName(ov->volume->Lookup("vm")->id));
    REQUIRE(info.ok());
    CHECK(info->size <= 8 * kMiB / 100 + 4096);
    CHECK(info->size >= 4096);  // at least the saturation frame
  }
  json ls = json::parse(Dede({"ls", vol, "-l", "--json"}));
  REQUIRE(ls.size() == 1);
  if (!ls[0]["log_records"].is_null()) {  // null: the flusher held the log just then
    CHECK(ls[0]["log_saturated"] == true);
    CHECK(ls[0]["log_records"] == 0);
    CHECK(ls[0]["log_dropped_records"].get<uint64_t>() > 0);
  }
  // The pass finds the whole file changed, reads and hashes it, and shares
  // the eight copies of X: every block of the file ends up shared.
  PassNow(vol, d);
  s = Status(d);
  CHECK(s["passes"]["blocks_shared"].get<uint64_t>() >= 7 * 256);
  const std::vector<uint8_t> back = ReadBack(dir, d, "vm");
  // The log was consumed: new writes are logged again.
  const uint64_t records_before = s["write_logs"]["records"].get<uint64_t>();
  RunOk({qemu_io, "-f", "raw", "-c", "write -s " + x + " 0 64k", d.Uri("vm")});
  s = WaitStatus(
      d,
      [&](const json& j) { return j["write_logs"]["records"].get<uint64_t>() == records_before + 16; },
      "a logged batch after the pass");
  CHECK(s["write_logs"]["saturations"] == 1);
  CHECK(s["monitor"]["log_full_files"] == 0);
  const std::string metrics = HttpGet(s["metrics_port"].get<int>(), "/metrics");
  CHECK(metrics.find("dede_write_log_saturations_total{host=\"1\"} 1") != std::string::npos);
  REQUIRE(d.Stop() == 0);

  const std::vector<uint8_t> xd = ReadWholeFile(x);
  REQUIRE(back.size() == 8 * kMiB);
  for (int i = 0; i < 8; i++) {
    INFO("MiB " << i);
    CHECK(std::memcmp(back.data() + i * kMiB, xd.data(), kMiB) == 0);
  }
  ls = json::parse(Dede({"ls", vol, "-l", "--json"}));
  REQUIRE(ls.size() == 1);
  // All shared but the 16 blocks rewritten after the pass (copied on write).
  CHECK(ls[0]["shared_blocks"] == 2048 - 16);
  CHECK(ls[0]["log_saturated"] == false);
  CHECK(ls[0]["log_records"] == 16);
  RunOk({BinaryPath("dede"), "fsck", vol});
}

TEST_CASE("dedupd obeys the volume policy and reports its passes in status and report and metrics",
          "[ops]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  CreateSparseFile(vol, 512 * kMiB);
  Dede({"format", vol});
  Dede({"create", vol, "vm-a", "--size", "2M"});
  Dede({"create", vol, "vm-b", "--size", "2M"});
  // A window that is never open now: the hours 00:00-00:01 on a day that
  // is not today (local time).
  std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  static const char* kDays[] = {"sun", "mon", "tue", "wed", "thu", "fri", "sat"};
  const std::string other_day = kDays[(local.tm_wday + 3) % 7];
  Dede({"policy", vol, "set", "windows=" + other_day + " 00:00-00:01", "rate=20.5",
        "priority=idle"});
  json pol = json::parse(Dede({"policy", vol, "show", "--json"}));
  REQUIRE(pol["windows"].size() == 1);
  CHECK(pol["rate_bytes_per_s"] == 20'500'000);
  CHECK(pol["in_window_now"] == false);

  DedupdProcess d(vol, 1, dir.file("nbd.sock"), {"--dedup-interval", "1"});
  const std::string x = dir.file("x.bin");
  WriteRandomFile(x, kMiB, 3);
  const std::string qemu_io = RequireProgram("qemu-io");
  RunOk({qemu_io, "-f", "raw", "-c", "write -s " + x + " 0 1M", d.Uri("vm-a")});
  RunOk({qemu_io, "-f", "raw", "-c", "write -s " + x + " 0 1M", d.Uri("vm-b")});
  // Outside the window: no pass runs on its own (the interval is ignored
  // while the policy has windows), and a foreground pass is refused.
  std::this_thread::sleep_for(std::chrono::seconds(3));
  json s = Status(d);
  // The NBD counters: exactly the two clients' payloads, in both views.
  CHECK(s["nbd"]["bytes_written"] == 2 * kMiB);
  // A local file: no commands lost, no LU resets, no idle reconnects.
  CHECK(s["device"]["lost_commands"] == 0);
  CHECK(s["device"]["lu_resets"] == 0);
  CHECK(s["device"]["idle_reconnects"] == 0);
  CHECK(s["nbd"]["bytes_read"] == 0);
  CHECK(s["nbd"]["connections_total"] >= 2);  // and the rig's readiness probe
  {
    const std::string text = Dede({"status", "--control", d.control()});
    INFO(text);
    CHECK(text.find("nbd         0 connections open (") != std::string::npos);
    CHECK(text.find(", 2.0 MiB written, 0 B read") != std::string::npos);
    // The rate as the policy was given, here and in dedupd's log (which
    // said "20 MB/s", an integer division; status said "19.6 MiB/s").
    CHECK(text.find("rate 20.5 MB/s") != std::string::npos);
    CHECK(d.Log().find("rate 20.5 MB/s") != std::string::npos);
  }
  CHECK(s["policy"]["in_window"] == false);
  CHECK(s["policy"]["rate_bytes_per_s"] == 20'500'000);
  CHECK(s["passes"]["completed"] == 0);
  CHECK(s["pass"]["running"] == false);
  ProcessResult refused = RunProcess({BinaryPath("dede"), "dedup", vol});
  CHECK(refused.exit_code == 1);
  CHECK(refused.err.find("outside the volume's dedup windows") != std::string::npos);
  // --now: dedupd runs one at once, throttled but complete.
  PassNow(vol, d);
  s = Status(d);
  CHECK(s["passes"]["completed"] == 1);
  CHECK(s["passes"]["blocks_shared"].get<uint64_t>() == 256);
  CHECK(s["passes"]["io_bytes"].get<uint64_t>() >= 2 * kMiB);
  // The metadata flushes: flush points flush without the volume mutex; a
  // file's close (the exports', the pass's index files) checkpoints the
  // journal holding it, so the next opener reads the file's metadata home.
  {
    const json& f = s["volume_flushes"];
    INFO(f.dump());
    CHECK(f["unlocked"].get<uint64_t>() > 0);
    CHECK(f["checkpoints"].get<uint64_t>() >= 1);
    CHECK(f["held"].get<uint64_t>() >= f["checkpoints"].get<uint64_t>());  // a header each
    CHECK(f["held_s"].get<double>() > 0);
    CHECK(f["checkpoints"].get<uint64_t>() >= f["quiet_checkpoints"].get<uint64_t>());
    const std::string text = Dede({"status", "--control", d.control()});
    INFO(text);
    CHECK(text.find("flushes without the volume mutex, ") != std::string::npos);
  }
  // The figures are the volume's: dede stats agrees with the pass history.
  REQUIRE(d.Stop() == 0);
  json stats = json::parse(Dede({"stats", vol, "--json"}));
  json report = json::parse(Dede({"report", "--history", d.history(), "--json"}));
  REQUIRE(report["passes"].size() == 1);
  const json& row = report["passes"][0];
  CHECK(row["trigger"] == "now");
  CHECK(row["outcome"] == "completed");
  CHECK(row["blocks_shared_new"] == 256);
  CHECK(row["host_id"] == 1);
  CHECK(row["volume_saved_bytes"] == stats["saved_bytes"]);
  CHECK(row["volume_logical_bytes"] == stats["logical_bytes"]);
  CHECK(row["volume_saved_bytes"].get<uint64_t>() == kMiB);
  ProcessResult human = RunOk({BinaryPath("dede"), "report", "--history", d.history()});
  CHECK(human.out.find("now") != std::string::npos);

  // Metrics on loopback, in Prometheus text format.
  DedupdProcess d2(vol, 1, dir.file("nbd2.sock"));
  s = Status(d2);
  CHECK(s["passes"]["completed"] == 0);
  const std::string log = d2.Log();
  const size_t at = log.find("metrics on http://127.0.0.1:");
  REQUIRE(at != std::string::npos);
  const int port = std::stoi(log.substr(at + std::strlen("metrics on http://127.0.0.1:")));
  const std::string body = HttpGet(port, "/metrics");
  INFO(body);
  CHECK(body.find("HTTP/1.") == 0);
  CHECK(body.find("text/plain; version=0.0.4") != std::string::npos);
  CHECK(body.find("# TYPE dede_passes_total counter") != std::string::npos);
  CHECK(body.find("dede_dedup_rate_cap_bytes_per_second{host=\"1\"} 20500000") !=
        std::string::npos);
  CHECK(body.find("dede_in_window{host=\"1\"} 0") != std::string::npos);
  CHECK(body.find("# TYPE dede_nbd_connections_refused_total counter") != std::string::npos);
  CHECK(body.find("dede_nbd_connections{host=\"1\"} 0") != std::string::npos);
  CHECK(body.find("dede_nbd_written_bytes_total{host=\"1\"} 0") != std::string::npos);
  CHECK(body.find("# TYPE dede_nbd_read_bytes_total counter") != std::string::npos);
  CHECK(body.find("dede_nbd_connections_denied_total{host=\"1\"} 0") != std::string::npos);
  CHECK(body.find("# TYPE dede_volume_flushes_held_total counter") != std::string::npos);
  CHECK(body.find("# TYPE dede_volume_flush_held_seconds_total counter") != std::string::npos);
  CHECK(body.find("# TYPE dede_volume_checkpoints_total counter") != std::string::npos);
  REQUIRE(d2.Stop() == 0);
}

// The device loses a flush (dede-hold-fuse fails one fdatasync of the
// volume file with EIO, as the kernel reports a lost writeback once):
// every later flush point fails (the failure is kept), which status,
// metrics and the log say once, and every later pass fails, which makes
// dedupd back off, doubling, instead of retrying each second.
TEST_CASE("a volume whose device lost a flush is shown failing and its failing passes back off",
          "[ops]") {
  TempDir dir;
  const std::string backing = dir.file("backing.img");
  CreateSparseFile(backing, 256 * kMiB);
  Dede({"format", backing});
  Dede({"create", backing, "vm-a", "--size", "4M"});
  HoldFuse fuse(backing, dir.file("mnt"));
  fuse.WaitMounted();
  DedupdProcess d(fuse.lun(), 1, dir.file("nbd.sock"),
                  {"--dedup-interval", "1", "--metrics-port", "0"});
  const auto t0 = std::chrono::steady_clock::now();
  auto waited = [&](int limit_s) {
    INFO(d.Log());
    REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(limit_s));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  };
  while (Status(d)["passes"]["completed"].get<uint64_t>() < 1) waited(60);
  json s = Status(d);
  CHECK(s["flush_points"]["failing"] == false);
  CHECK(s["flush_points"]["failed"] == 0);

  fuse.FailFsyncs(1);
  while (!Status(d)["flush_points"]["failing"].get<bool>()) waited(60);
  // A VM's write is refused (EIO), not acknowledged and lost.
  const std::string x = dir.file("x.bin");
  WriteRandomFile(x, kMiB, 11);
  ProcessResult w = RunProcess(
      {RequireProgram("qemu-io"), "-f", "raw", "-c", "write -s " + x + " 0 1M", d.Uri("vm-a")});
  CHECK(w.exit_code != 0);

  // Passes fail from now on: the first at once (1 s after the last), then
  // after 2, 4, 8 s... Three failures took about 2 s without the backoff.
  std::optional<std::chrono::steady_clock::time_point> first_failure;
  uint64_t in_a_row = 0;
  while (in_a_row < 3) {
    waited(90);
    s = Status(d);
    in_a_row = s["passes"]["failed_in_a_row"].get<uint64_t>();
    if (in_a_row >= 1 && !first_failure) first_failure = std::chrono::steady_clock::now();
  }
  const double between =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - *first_failure).count();
  INFO(d.Log());
  CHECK(between >= 5.5);  // 2 + 4 s of backoff, less the polls' slack
  CHECK(s["passes"]["failed"] == in_a_row);
  CHECK(s["passes"]["completed"] == 1);
  CHECK(s["passes"]["failure_backoff_s"].get<double>() == 2.0 * double(1u << (in_a_row - 1)));
  CHECK(d.Log().find("failed (1 in a row): backing off, the next scheduled pass starts no "
                     "sooner than 2 s from now") != std::string::npos);
  CHECK(d.Log().find("failed (2 in a row): backing off, the next scheduled pass starts no "
                     "sooner than 4 s from now") != std::string::npos);

  // Flush points failed every second meanwhile; the log said so once.
  const uint64_t flush_failures = s["flush_points"]["failed"].get<uint64_t>();
  CHECK(flush_failures >= 6);
  CHECK(s["flush_points"]["failed_in_a_row"] == flush_failures);
  CHECK(s["flush_points"]["failing_since_ns"].get<uint64_t>() > 0);
  CHECK(s["flush_points"]["error"].get<std::string>().find("fdatasync: Input/output error") !=
        std::string::npos);
  const std::string log = d.Log();
  size_t lines = 0;
  for (size_t at = log.find("volume flush point: "); at != std::string::npos;
       at = log.find("volume flush point: ", at + 1)) {
    lines++;
  }
  CHECK(lines == 1);

  const std::string text = Dede({"status", "--control", d.control()});
  INFO(text);
  CHECK(text.find("flushes     FAILING since ") != std::string::npos);
  CHECK(text.find(" in a row: device flush failed") != std::string::npos);
  CHECK(text.find(" failed in a row: backing off, the next scheduled pass no sooner than ") !=
        std::string::npos);
  const std::string metrics = HttpGet(s["metrics_port"].get<int>(), "/metrics");
  CHECK(metrics.find("dede_flush_points_failing{host=\"1\"} 1") != std::string::npos);
  CHECK(metrics.find("dede_passes_total{host=\"1\",outcome=\"failed\"} " +
                     std::to_string(in_a_row)) != std::string::npos);
  // The last flush fails too: dedupd says so in its exit status.
  CHECK(d.Stop() == 1);
}

}  // namespace
}  // namespace dede
