// The iSCSI backend against a real tgtd on 127.0.0.1 (see rig.h).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/hold_fuse.h"
#include "tests/integration/rig.h"
#include "tests/random_bytes.h"
#include "volume/block_device.h"

using dede::BlockDevice;
using dede::DeviceOptions;
using dede::Status;
using dede::test::ChildRunning;
using dede::test::CreateSparseFile;
using dede::test::HoldFuse;
using dede::test::TempDir;
using dede::test::TgtdRig;

namespace {

constexpr uint64_t kMiB = 1024 * 1024;
// Not a multiple of 4 KiB, so the last-sector cases are real edge cases.
constexpr uint64_t kLunSize = 40 * kMiB + 7 * 512;

// One target per process: tgtd starts in a fraction of a second, but there
// is no reason to pay that per test case when the cases run together.
struct Target {
  explicit Target(const std::string& user = "", const std::string& password = "")
      : backing(dir.file("lun.img")) {
    CreateSparseFile(backing, kLunSize);
    rig = std::make_unique<TgtdRig>(backing, user, password);
  }
  TempDir dir;
  std::string backing;
  std::unique_ptr<TgtdRig> rig;
};

Target& Plain() {
  static Target t;
  return t;
}

Target& WithChap() {
  static Target t("dede-user", "s3cret-pass-1234");
  return t;
}

std::string Portal(const TgtdRig& rig) {
  return "127.0.0.1:" + std::to_string(rig.port());
}

std::string PlainUrl(const TgtdRig& rig, const std::string& iqn, int lun) {
  return "iscsi://" + Portal(rig) + "/" + iqn + "/" + std::to_string(lun);
}

std::unique_ptr<BlockDevice> MustOpen(const std::string& url, DeviceOptions opts = {}) {
  auto dev = dede::OpenBlockDevice(url, opts);
  INFO(dev.status().ToString());
  REQUIRE(dev.ok());
  return std::move(dev).value();
}

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<uint8_t> v(n);
  dede::test::FillRandom(gen, v.data(), v.size());
  return v;
}

std::vector<uint8_t> ReadFile(const std::string& path, uint64_t offset, size_t len) {
  std::vector<uint8_t> buf(len);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  size_t done = 0;
  while (done < len) {
    ssize_t n = ::pread(fd, buf.data() + done, len - done, static_cast<off_t>(offset + done));
    REQUIRE(n > 0);
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return buf;
}

// A port on 127.0.0.1 with nothing listening.
int ClosedPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

bool OneLine(const std::string& s) {
  return !s.empty() && s.find('\n') == std::string::npos;
}

// The I_T nexuses (sessions) tgtd has for target 1.
std::vector<std::string> NexusIds(const TgtdRig& rig) {
  auto show = rig.Tgtadm({"--op", "show", "--mode", "target"});
  REQUIRE(show.exit_code == 0);
  std::regex nexus(R"(I_T nexus: (\d+))");
  std::vector<std::string> out;
  for (std::sregex_iterator it(show.out.begin(), show.out.end(), nexus), end; it != end; ++it) {
    out.push_back((*it)[1].str());
  }
  return out;
}

int Nexuses(const TgtdRig& rig) {
  return static_cast<int>(NexusIds(rig).size());
}

// Closes every connection of target 1 from tgtd's side and waits until
// tgtd has ended those sessions (so their sockets are closed on our side),
// not for a guessed time. Returns how many it closed.
int DropAllConnections(const TgtdRig& rig) {
  int dropped = 0;
  for (const std::string& sid : NexusIds(rig)) {
    auto r =
        rig.Tgtadm({"--op", "delete", "--mode", "conn", "--tid", "1", "--sid", sid, "--cid", "0"});
    INFO(r.err);
    CHECK(r.exit_code == 0);
    ++dropped;
  }
  for (auto t0 = std::chrono::steady_clock::now(); Nexuses(rig) > 0;) {
    REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  return dropped;
}

}  // namespace

TEST_CASE("iSCSI device reports the LUN size and its name", "[iscsi]") {
  auto& t = Plain();
  auto dev = MustOpen(t.rig->url());
  CHECK(dev->size_bytes() == kLunSize);
  CHECK(dev->name() == t.rig->url());
  CHECK(dev->local_lock_path().empty());
}

TEST_CASE("iSCSI write, flush and read round trip", "[iscsi]") {
  auto& t = Plain();
  auto dev = MustOpen(t.rig->url());
  REQUIRE(dev->size_bytes() == kLunSize);

  // What the LUN must hold: its current content plus our writes.
  std::vector<uint8_t> model = ReadFile(t.backing, 0, kLunSize);
  struct Extent {
    uint64_t offset;
    size_t len;
  };
  const std::vector<Extent> writes = {
      {0, 4096},
      {512, 512},                             // overwrite inside the previous one
      {3 * 4096 + 512, 8192 - 512},           // sector- but not page-aligned
      {kMiB - 512, kMiB + 1024},              // > 1 MiB, crosses a chunk boundary
      {5 * kMiB, 3 * kMiB + 4096},            // several chunks
      {kLunSize - 2 * kMiB - 512, 2 * kMiB},  // ends one sector before the end
      {kLunSize - 512, 512},                  // the last sector
      {17 * kMiB + 4096, 64 * 1024},
  };
  uint64_t seed = 1;
  for (const auto& w : writes) {
    auto data = RandomBytes(w.len, seed++);
    INFO("write at " << w.offset << " length " << w.len);
    Status st = dev->Write(w.offset, data.data(), data.size());
    INFO(st.ToString());
    REQUIRE(st.ok());
    std::memcpy(model.data() + w.offset, data.data(), w.len);
  }

  // Each extent reads back as the model says (later writes win).
  for (const auto& w : writes) {
    std::vector<uint8_t> got(w.len);
    INFO("read at " << w.offset << " length " << w.len);
    Status st = dev->Read(w.offset, got.data(), got.size());
    INFO(st.ToString());
    REQUIRE(st.ok());
    REQUIRE(std::memcmp(got.data(), model.data() + w.offset, w.len) == 0);
  }

  Status flushed = dev->Flush();
  INFO(flushed.ToString());
  REQUIRE(flushed.ok());

  // The whole LUN, read in one call through a separate session, and the
  // backing file itself agree with the model.
  auto other = MustOpen(t.rig->url());
  std::vector<uint8_t> all(kLunSize);
  Status st = other->Read(0, all.data(), all.size());
  INFO(st.ToString());
  REQUIRE(st.ok());
  REQUIRE(all == model);
  REQUIRE(ReadFile(t.backing, 0, kLunSize) == model);
}

TEST_CASE("iSCSI device rejects misaligned and out-of-range I/O", "[iscsi]") {
  auto& t = Plain();
  auto dev = MustOpen(t.rig->url());
  std::vector<uint8_t> buf(8192);
  CHECK(dev->Read(1, buf.data(), 512).code() == Status::Code::kInvalid);
  CHECK(dev->Read(0, buf.data(), 100).code() == Status::Code::kInvalid);
  CHECK(dev->Read(kLunSize, buf.data(), 512).code() == Status::Code::kInvalid);
  CHECK(dev->Write(kLunSize - 512, buf.data(), 1024).code() == Status::Code::kInvalid);
  // The session is still fine afterwards.
  CHECK(dev->Read(kLunSize - 512, buf.data(), 512).ok());
}

TEST_CASE("read-only iSCSI device refuses writes", "[iscsi]") {
  auto& t = Plain();
  DeviceOptions opts;
  opts.read_only = true;
  auto dev = MustOpen(t.rig->url(), opts);
  auto before = ReadFile(t.backing, 0, 8192);

  std::vector<uint8_t> buf(8192);
  REQUIRE(dev->Read(0, buf.data(), buf.size()).ok());
  CHECK(buf == before);

  auto junk = RandomBytes(8192, 99);
  Status st = dev->Write(0, junk.data(), junk.size());
  CHECK(st.code() == Status::Code::kInvalid);
  CHECK_THAT(st.message(), Catch::Contains("read-only"));
  CHECK(dev->Discard(0, 8192).code() == Status::Code::kInvalid);
  CHECK(dev->Flush().ok());
  CHECK(ReadFile(t.backing, 0, 8192) == before);
}

TEST_CASE("iSCSI CHAP authentication", "[iscsi]") {
  auto& t = WithChap();
  const std::string portal = Portal(*t.rig);

  SECTION("the right password works") {
    auto dev = MustOpen(t.rig->url());
    CHECK(dev->name().find("s3cret") == std::string::npos);
    auto data = RandomBytes(4096, 7);
    REQUIRE(dev->Write(4096, data.data(), data.size()).ok());
    REQUIRE(dev->Flush().ok());
    std::vector<uint8_t> got(4096);
    REQUIRE(dev->Read(4096, got.data(), got.size()).ok());
    CHECK(got == data);
  }

  SECTION("a wrong password fails clearly") {
    std::string url = "iscsi://dede-user%wrong-password@" + portal + "/" + t.rig->iqn() + "/1";
    auto dev = dede::OpenBlockDevice(url);
    REQUIRE_FALSE(dev.ok());
    const std::string& msg = dev.status().message();
    INFO(msg);
    CHECK(dev.status().code() == Status::Code::kInvalid);
    CHECK(OneLine(msg));
    CHECK_THAT(msg, Catch::Contains("CHAP") && Catch::Contains("dede-user") &&
                        Catch::Contains(t.rig->iqn()) && Catch::Contains(portal));
    CHECK(msg.find("wrong-password") == std::string::npos);
  }

  SECTION("no credentials says CHAP is required") {
    auto dev = dede::OpenBlockDevice(PlainUrl(*t.rig, t.rig->iqn(), 1));
    REQUIRE_FALSE(dev.ok());
    INFO(dev.status().message());
    CHECK(dev.status().code() == Status::Code::kInvalid);
    CHECK_THAT(dev.status().message(), Catch::Contains("requires CHAP"));
  }
}

TEST_CASE("unreachable iSCSI portal fails fast and names the portal", "[iscsi]") {
  int port = ClosedPort();
  std::string portal = "127.0.0.1:" + std::to_string(port);
  auto start = std::chrono::steady_clock::now();
  auto dev = dede::OpenBlockDevice("iscsi://" + portal + "/iqn.2026-11.org.dede.test:none/1");
  auto elapsed = std::chrono::steady_clock::now() - start;
  REQUIRE_FALSE(dev.ok());
  const std::string& msg = dev.status().message();
  INFO(msg);
  CHECK(dev.status().code() == Status::Code::kUnavailable);
  CHECK(OneLine(msg));
  CHECK_THAT(msg, Catch::StartsWith("cannot connect to iSCSI portal " + portal + ": "));
  CHECK(elapsed < std::chrono::seconds(3));
}

TEST_CASE("wrong target IQN or LUN gives a clear error", "[iscsi]") {
  auto& t = Plain();
  const std::string portal = Portal(*t.rig);

  SECTION("unknown IQN") {
    std::string iqn = t.rig->iqn() + "-nope";
    auto dev = dede::OpenBlockDevice(PlainUrl(*t.rig, iqn, 1));
    REQUIRE_FALSE(dev.ok());
    INFO(dev.status().message());
    CHECK(dev.status().code() == Status::Code::kNotFound);
    CHECK_THAT(dev.status().message(),
               Catch::StartsWith("iSCSI target " + iqn + " not found on " + portal +
                                 " (or it does not admit initiator "));
  }
  SECTION("unknown LUN") {
    auto dev = dede::OpenBlockDevice(PlainUrl(*t.rig, t.rig->iqn(), 7));
    REQUIRE_FALSE(dev.ok());
    INFO(dev.status().message());
    CHECK(dev.status().code() == Status::Code::kNotFound);
    CHECK_THAT(dev.status().message(),
               Catch::StartsWith("LUN 7 not found on iSCSI target " + t.rig->iqn()));
  }
  SECTION("LUN 0 is tgtd's controller, not a disk") {
    auto dev = dede::OpenBlockDevice(PlainUrl(*t.rig, t.rig->iqn(), 0));
    REQUIRE_FALSE(dev.ok());
    INFO(dev.status().message());
    CHECK(dev.status().code() == Status::Code::kInvalid);
    CHECK_THAT(dev.status().message(), Catch::Contains("is not a disk"));
  }
}

TEST_CASE("malformed iSCSI URLs are invalid", "[iscsi]") {
  const std::vector<std::string> bad = {
      "iscsi://",
      "iscsi://127.0.0.1",
      "iscsi://127.0.0.1/",
      "iscsi://127.0.0.1/iqn.2026-11.org.dede:x",   // no LUN
      "iscsi://127.0.0.1/iqn.2026-11.org.dede:x/",  // empty LUN
      "iscsi://127.0.0.1/iqn.2026-11.org.dede:x/abc",
      "iscsi://127.0.0.1/iqn.2026-11.org.dede:x/1x",
      "iscsi://127.0.0.1/iqn.2026-11.org.dede:x/-1",
      "iscsi://127.0.0.1/iqn.2026-11.org.dede:x/99999",
      "iscsi://127.0.0.1/iqn.2026-11.org.dede:x/1/2",
      "iscsi://127.0.0.1//1",  // missing IQN
      "iscsi://127.0.0.1/1",   // missing IQN
      "iscsi://127.0.0.1/not-an-iqn/1",
      "iscsi:///iqn.2026-11.org.dede:x/1",  // missing host
      "iscsi://127.0.0.1:/iqn.2026-11.org.dede:x/1",
      "iscsi://127.0.0.1:abc/iqn.2026-11.org.dede:x/1",
      "iscsi://127.0.0.1:70000/iqn.2026-11.org.dede:x/1",
      "iscsi://[::1/iqn.2026-11.org.dede:x/1",
      "iscsi://user@127.0.0.1/iqn.2026-11.org.dede:x/1",  // user without password
      "iscsi://%topsecret@127.0.0.1/iqn.2026-11.org.dede:x/1",
      "iscsi://127.0.0.1/iqn.2026-11.org.dede%zz/1",
  };
  for (const auto& url : bad) {
    auto dev = dede::OpenIscsiDevice(url, {});
    INFO(url << " -> " << dev.status().ToString());
    REQUIRE_FALSE(dev.ok());
    CHECK(dev.status().code() == Status::Code::kInvalid);
    CHECK(OneLine(dev.status().message()));
    CHECK_THAT(dev.status().message(), Catch::StartsWith("invalid iSCSI URL"));
    CHECK(dev.status().message().find("topsecret") == std::string::npos);
  }
  auto no_lun = dede::OpenIscsiDevice("iscsi://h/iqn.2026-11.org.dede:x", {});
  CHECK_THAT(no_lun.status().message(), Catch::Contains("missing LUN"));
  auto no_iqn = dede::OpenIscsiDevice("iscsi://h//1", {});
  CHECK_THAT(no_iqn.status().message(), Catch::Contains("missing target IQN"));
  auto text_lun = dede::OpenIscsiDevice("iscsi://h/iqn.2026-11.org.dede:x/abc", {});
  CHECK_THAT(text_lun.status().message(), Catch::Contains("LUN 'abc' is not a number"));
}

TEST_CASE("OpenBlockDevice dispatches paths, iscsi:// and unknown schemes", "[iscsi]") {
  SECTION("a path opens the path backend") {
    TempDir dir;
    std::string path = dir.file("plain.img");
    CreateSparseFile(path, kMiB);
    auto dev = dede::OpenBlockDevice(path);
    INFO(dev.status().ToString());
    REQUIRE(dev.ok());
    CHECK(dev.value()->name() == path);
    CHECK(dev.value()->size_bytes() == kMiB);
  }
  SECTION("iscsi:// opens the iSCSI backend") {
    auto& t = Plain();
    auto dev = MustOpen(t.rig->url());
    CHECK_THAT(dev->name(), Catch::StartsWith("iscsi://"));
    CHECK(dev->size_bytes() == kLunSize);
  }
  SECTION("other schemes are invalid") {
    auto dev = dede::OpenBlockDevice("nbd://x");
    REQUIRE_FALSE(dev.ok());
    CHECK(dev.status().code() == Status::Code::kInvalid);
    CHECK_THAT(dev.status().message(), Catch::Contains("nbd://x"));
    auto empty = dede::OpenBlockDevice("iscsi://");
    CHECK(empty.status().code() == Status::Code::kInvalid);
  }
}

TEST_CASE("iSCSI device serves several threads at once", "[iscsi]") {
  auto& t = Plain();
  DeviceOptions opts;
  opts.iscsi_sessions = GENERATE(1u, 4u);
  INFO("sessions " << opts.iscsi_sessions);
  auto dev = MustOpen(t.rig->url(), opts);
  constexpr int kThreads = 8;
  constexpr size_t kChunk = 64 * 1024;
  constexpr int kRounds = 25;
  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      uint64_t base = 24 * kMiB + static_cast<uint64_t>(i) * kRounds * kChunk;
      for (int r = 0; r < kRounds; ++r) {
        auto data = RandomBytes(kChunk, 1000 + i * 100 + r);
        uint64_t at = base + static_cast<uint64_t>(r) * kChunk;
        std::vector<uint8_t> got(kChunk);
        if (!dev->Write(at, data.data(), kChunk).ok() || !dev->Read(at, got.data(), kChunk).ok() ||
            got != data) {
          ++failures[i];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int i = 0; i < kThreads; ++i) CHECK(failures[i] == 0);
  CHECK(dev->Flush().ok());
}

TEST_CASE("iSCSI sessions: a device logs in as many as asked and logs them all out", "[iscsi]") {
  auto& t = Plain();
  const int before = Nexuses(*t.rig);
  {
    DeviceOptions opts;
    opts.iscsi_sessions = 5;
    auto dev = MustOpen(t.rig->url(), opts);
    CHECK(Nexuses(*t.rig) == before + 5);
    CHECK(dev->size_bytes() == kLunSize);
    // What one session writes, every other reads: it is one LUN.
    std::vector<std::thread> threads;
    std::vector<int> bad(5, 0);
    auto data = RandomBytes(5 * 4096, 77);
    REQUIRE(dev->Write(20 * kMiB, data.data(), data.size()).ok());
    for (int i = 0; i < 5; i++) {
      threads.emplace_back([&, i] {
        for (int r = 0; r < 20; r++) {
          std::vector<uint8_t> got(data.size());
          if (!dev->Read(20 * kMiB, got.data(), got.size()).ok() || got != data) ++bad[i];
        }
      });
    }
    for (auto& th : threads) th.join();
    for (int i = 0; i < 5; i++) CHECK(bad[i] == 0);
    REQUIRE(dev->Flush().ok());
    CHECK(ReadFile(t.backing, 20 * kMiB, data.size()) == data);
  }
  CHECK(Nexuses(*t.rig) == before);
}

TEST_CASE("iSCSI sessions: a count out of range is refused before any login", "[iscsi]") {
  auto& t = Plain();
  const int before = Nexuses(*t.rig);
  for (uint32_t n : {0u, dede::kMaxIscsiSessions + 1}) {
    DeviceOptions opts;
    opts.iscsi_sessions = n;
    auto dev = dede::OpenBlockDevice(t.rig->url(), opts);
    REQUIRE_FALSE(dev.ok());
    CHECK(dev.status().code() == Status::Code::kInvalid);
    CHECK_THAT(dev.status().message(), Catch::Contains("sessions"));
  }
  CHECK(Nexuses(*t.rig) == before);
}

TEST_CASE("iSCSI device reconnects when the target drops the session", "[iscsi]") {
  auto& t = Plain();
  DeviceOptions opts;
  opts.iscsi_sessions = GENERATE(1u, 3u);
  INFO("sessions " << opts.iscsi_sessions);
  auto dev = MustOpen(t.rig->url(), opts);
  auto first = RandomBytes(8192, 4242);
  REQUIRE(dev->Write(30 * kMiB, first.data(), first.size()).ok());

  // Close our session(s) from tgtd's side.
  REQUIRE(DropAllConnections(*t.rig) >= static_cast<int>(opts.iscsi_sessions));

  // The next commands find the connection dead, log in again and succeed.
  // The WRITE never left: the closed connection is found before it is
  // queued, so nothing counts as lost and no other host pays an LU reset
  // (before, each session's first WRITE was counted lost and fenced).
  // After the login the device checks the unit is still the one it
  // opened: it is.
  auto second = RandomBytes(8192, 4343);
  Status st = dev->Write(30 * kMiB + 8192, second.data(), second.size());
  INFO(st.ToString());
  REQUIRE(st.ok());
  CHECK(dev->counters().lost_commands == 0);
  CHECK(dev->counters().lu_resets == 0);
  CHECK(dev->counters().idle_reconnects >= 1);
  std::vector<uint8_t> got(16384);
  REQUIRE(dev->Read(30 * kMiB, got.data(), got.size()).ok());
  CHECK(std::memcmp(got.data(), first.data(), 8192) == 0);
  CHECK(std::memcmp(got.data() + 8192, second.data(), 8192) == 0);
  REQUIRE(dev->Flush().ok());
}

TEST_CASE("iSCSI discard is a harmless hint", "[iscsi]") {
  SECTION("without thin provisioning the data stays") {
    auto& t = Plain();
    auto dev = MustOpen(t.rig->url());
    auto data = RandomBytes(65536, 555);
    REQUIRE(dev->Write(32 * kMiB, data.data(), data.size()).ok());
    REQUIRE(dev->Discard(32 * kMiB, data.size()).ok());
    std::vector<uint8_t> got(data.size());
    REQUIRE(dev->Read(32 * kMiB, got.data(), got.size()).ok());
    CHECK(got == data);
  }
  SECTION("with thin provisioning the range is unmapped") {
    Target thin;
    auto r = thin.rig->Tgtadm({"--op", "update", "--mode", "logicalunit", "--tid", "1", "--lun",
                               "1", "--params", "thin_provisioning=1"});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    auto dev = MustOpen(thin.rig->url());
    auto data = RandomBytes(1 * kMiB, 556);
    REQUIRE(dev->Write(2 * kMiB, data.data(), data.size()).ok());
    REQUIRE(dev->Flush().ok());
    Status st = dev->Discard(2 * kMiB, data.size());
    INFO(st.ToString());
    REQUIRE(st.ok());
    std::vector<uint8_t> got(data.size());
    REQUIRE(dev->Read(2 * kMiB, got.data(), got.size()).ok());
    CHECK(got == std::vector<uint8_t>(data.size(), 0));
  }
}

TEST_CASE("iSCSI device fails cleanly when the target dies", "[iscsi]") {
  Target t;
  auto dev = MustOpen(t.rig->url());
  auto data = RandomBytes(kMiB, 77);
  REQUIRE(dev->Write(0, data.data(), data.size()).ok());

  REQUIRE(::kill(t.rig->pid(), SIGKILL) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));

  // A 1 MiB write into the dead connection must neither hang nor kill the
  // process with SIGPIPE; reconnecting is tried once and refused.
  auto start = std::chrono::steady_clock::now();
  Status st = dev->Write(0, data.data(), data.size());
  INFO(st.ToString());
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == Status::Code::kUnavailable);
  CHECK(OneLine(st.message()));
  CHECK_THAT(st.message(), Catch::StartsWith(t.rig->url() + ": WRITE(16) at offset 0 failed") &&
                               Catch::Contains("cannot connect to iSCSI portal"));
  std::vector<uint8_t> got(4096);
  CHECK_FALSE(dev->Read(0, got.data(), got.size()).ok());
  CHECK_FALSE(dev->Flush().ok());
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(3));
}

TEST_CASE("a portal that accepts but never answers times out", "[iscsi]") {
  // A listening socket nobody serves: TCP connects, the login gets no reply.
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(::listen(fd, 4) == 0);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  std::string portal = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));

  auto start = std::chrono::steady_clock::now();
  auto dev = dede::OpenBlockDevice("iscsi://" + portal + "/iqn.2026-11.org.dede.test:silent/1");
  auto elapsed = std::chrono::steady_clock::now() - start;
  ::close(fd);
  REQUIRE_FALSE(dev.ok());
  INFO(dev.status().message());
  CHECK(dev.status().code() == Status::Code::kUnavailable);
  CHECK_THAT(dev.status().message(), Catch::Contains(portal) && Catch::Contains("no answer"));
  // The connect deadline is 10 s.
  CHECK(elapsed >= std::chrono::seconds(9));
  CHECK(elapsed < std::chrono::seconds(15));
}

namespace {

// tgtd serving a LUN whose backing file is a HoldFuse's, and a device on
// it with `sessions` sessions and a 1 s command timeout. Torn down device
// first, then tgtd, then the FUSE file.
struct HeldTarget {
  explicit HeldTarget(uint32_t sessions)
      : backing(SparseFile(dir, "backing.img")), fuse(backing, dir.file("mnt")) {
    fuse.WaitMounted();
    rig = std::make_unique<TgtdRig>(fuse.lun());
    DeviceOptions opts;
    opts.iscsi_command_timeout_ms = 1000;
    opts.iscsi_sessions = sessions;
    dev = MustOpen(rig->url(), opts);
  }
  static std::string SparseFile(const TempDir& d, const std::string& name) {
    const std::string path = d.file(name);
    CreateSparseFile(path, kLunSize);
    return path;
  }
  TempDir dir;
  const std::string backing;
  HoldFuse fuse;
  std::unique_ptr<TgtdRig> rig;
  std::unique_ptr<BlockDevice> dev;
};

}  // namespace

TEST_CASE("iSCSI: a WRITE lost with its session is sent again only once the target has finished it",
          "[iscsi]") {
  // The target's backing store sits on a WRITE of B (held in the FUSE
  // file under tgtd) past the device's command timeout, so the device
  // drops the session and must send B again; the caller then writes C to
  // the same blocks. Sent again at once (as before), B could land, then C,
  // while the first B still waited in the target, and when it was let go
  // it overwrote C: an acknowledged write lost. The device now first has
  // the target confirm, with a LOGICAL UNIT RESET, that every command it
  // had started for the LU has finished. Here that means B is answered
  // only after the held B was let go, and C is what stays. (The FUSE file
  // runs one write at a time, see dede_hold_fuse.cc, so before the fix
  // the second B waited behind the held one too and the write failed
  // after its second timeout instead; a target writing in parallel would
  // have let it through.)
  HeldTarget t(1);
  BlockDevice* dev = t.dev.get();
  HoldFuse& fuse = t.fuse;

  constexpr uint64_t kAt = 8 * kMiB;
  const auto a = RandomBytes(4096, 71), b = RandomBytes(4096, 72), c = RandomBytes(4096, 73);
  REQUIRE(dev->Write(kAt, a.data(), a.size()).ok());
  fuse.Hold(kAt);
  using Clock = std::chrono::steady_clock;
  Status sb, sc;
  Clock::time_point b_done;
  std::thread writer([&] {
    sb = dev->Write(kAt, b.data(), b.size());
    b_done = Clock::now();
    if (sb.ok()) sc = dev->Write(kAt, c.data(), c.size());
  });
  const bool held = fuse.WaitHeld();
  // Two and a half command timeouts: long enough for the old behaviour to
  // send B and C again, well inside the reset's wait (2 x 1 s + 10 s).
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  const auto released = Clock::now();
  fuse.Release();
  writer.join();
  INFO("fuse: " << fuse.Log());
  REQUIRE(held);
  INFO("write B: " << sb.ToString() << "; write C: " << sc.ToString());
  REQUIRE(sb.ok());
  REQUIRE(sc.ok());
  // B was not answered before the lost B had finished in the target.
  CHECK(b_done >= released);
  REQUIRE(dev->Flush().ok());
  // Every write the target had has landed (C's answer came after them).
  std::vector<uint8_t> got(4096);
  REQUIRE(dev->Read(kAt, got.data(), got.size()).ok());
  CHECK(got == c);
  CHECK(ReadFile(t.backing, kAt, 4096) == c);
}

TEST_CASE("iSCSI: while a lost WRITE is fenced, the device's other sessions send nothing",
          "[iscsi]") {
  // Two sessions. One loses a WRITE (held in the target's backing store
  // past the command timeout); a READ through the other session after
  // that must wait until the target has confirmed the lost WRITE finished:
  // a command the device sends may follow the lost one's effect, whichever
  // session carries it. (READs do go on in this FUSE file while a write
  // is held, so without the shared fence the READ came back at once.)
  HeldTarget t(2);
  BlockDevice* dev = t.dev.get();
  HoldFuse& fuse = t.fuse;

  constexpr uint64_t kAt = 8 * kMiB;
  const auto a = RandomBytes(4096, 81), b = RandomBytes(4096, 82);
  REQUIRE(dev->Write(kAt + kMiB, a.data(), a.size()).ok());
  fuse.Hold(kAt);
  using Clock = std::chrono::steady_clock;
  Status sb;
  std::thread writer([&] { sb = dev->Write(kAt, b.data(), b.size()); });
  const bool held = fuse.WaitHeld();
  const auto held_at = Clock::now();
  Clock::time_point released;
  std::thread releaser([&] {
    std::this_thread::sleep_until(held_at + std::chrono::milliseconds(4000));
    released = Clock::now();
    fuse.Release();
  });
  // Past the lost WRITE's timeout (1 s): once the device counts it lost,
  // its reset is under way (the reset waits up to 2 x 1 s + 10 s).
  while (dev->counters().lost_commands == 0 && Clock::now() < held_at + std::chrono::seconds(3)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const bool lost_before_read = dev->counters().lost_commands > 0;
  std::vector<uint8_t> got(4096);
  Status sr = dev->Read(kAt + kMiB, got.data(), got.size());
  const auto read_done = Clock::now();
  releaser.join();
  writer.join();
  INFO("fuse: " << fuse.Log());
  REQUIRE(held);
  REQUIRE(lost_before_read);  // the READ went out after the WRITE was lost
  INFO("write: " << sb.ToString() << "; read: " << sr.ToString());
  REQUIRE(sb.ok());
  REQUIRE(sr.ok());
  CHECK(got == a);
  CHECK(read_done >= released);
  REQUIRE(dev->Read(kAt, got.data(), got.size()).ok());
  CHECK(got == b);
}

// A SYNCHRONIZE CACHE that reached the target and got no answer within the
// command timeout: the target's backing store may report its write-back
// error to it, and to nothing after. It was sent again on a new session,
// whose flush the store then answered GOOD: Flush() said the writes were
// durable when they were lost.
TEST_CASE("iSCSI: a flush lost with its session fails instead of being sent again", "[iscsi]") {
  HeldTarget t(1);
  BlockDevice* dev = t.dev.get();
  HoldFuse& fuse = t.fuse;
  const auto data = RandomBytes(4096, 91);
  REQUIRE(dev->Write(0, data.data(), data.size()).ok());
  REQUIRE(dev->Flush().ok());
  REQUIRE(dev->Write(4096, data.data(), data.size()).ok());
  fuse.FailFsyncs(1);
  fuse.HoldFsync();
  Status flushed;
  std::thread flusher([&] { flushed = dev->Flush(); });
  const bool held = fuse.WaitHeld();
  // Past the flush's timeout (twice the 1 s command timeout), within the
  // next: the old code logged in again and sent a second flush, which
  // waited behind the first in the backing store and then succeeded.
  std::this_thread::sleep_for(std::chrono::milliseconds(2600));
  fuse.Release();  // the first fsync fails (EIO); a second would succeed
  flusher.join();
  INFO("fuse: " << fuse.Log() << "\nflush: " << flushed.ToString());
  REQUIRE(held);
  CHECK_FALSE(flushed.ok());
  CHECK(flushed.message().find("not sent again") != std::string::npos);
  // And it stays failed: the device cannot know what the lost one found.
  CHECK_FALSE(dev->Flush().ok());
  // Reads go on.
  std::vector<uint8_t> got(4096);
  REQUIRE(dev->Read(0, got.data(), got.size()).ok());
  CHECK(got == data);
}

// A writeback error is reported to one fsync of a file (and by a target's
// file backing store to one SYNCHRONIZE CACHE). A device whose flush
// failed once used to report the next flush fine, with the lost writes
// never reported again; such a first failure can reach a caller that does
// not stop the volume (a lock-table update), and the next flush is then a
// client's FLUSH. Now every later flush of the device fails too.
TEST_CASE("a failed device flush keeps failing, on a local file and over iSCSI", "[iscsi]") {
  const auto data = RandomBytes(4096, 81);
  SECTION("a local file") {
    TempDir dir;
    const std::string backing = dir.file("backing.img");
    CreateSparseFile(backing, kLunSize);
    HoldFuse fuse(backing, dir.file("mnt"));
    fuse.WaitMounted();
    auto dev = MustOpen(fuse.lun(), DeviceOptions{});
    REQUIRE(dev->Write(0, data.data(), data.size()).ok());
    REQUIRE(dev->Flush().ok());
    fuse.FailFsyncs(1);
    REQUIRE(dev->Write(4096, data.data(), data.size()).ok());
    Status first = dev->Flush();
    INFO(first.ToString());
    CHECK_FALSE(first.ok());
    CHECK(fuse.State().find("fsync_failures=1") != std::string::npos);
    Status second = dev->Flush();  // the file would say OK now
    INFO(second.ToString());
    CHECK_FALSE(second.ok());
    CHECK(fuse.State().find("fsync_failures=1") != std::string::npos);
    auto fresh = MustOpen(fuse.lun(), DeviceOptions{});
    CHECK(fresh->Flush().ok());  // the file is fine again: the failure is the device's memory
  }
  SECTION("over iSCSI, whichever session sends the next flush") {
    HeldTarget t(2);
    REQUIRE(t.dev->Write(0, data.data(), data.size()).ok());
    REQUIRE(t.dev->Flush().ok());
    t.fuse.FailFsyncs(1);
    REQUIRE(t.dev->Write(4096, data.data(), data.size()).ok());
    Status first = t.dev->Flush();
    INFO(first.ToString() << "\n" << t.fuse.State());
    CHECK_FALSE(first.ok());
    CHECK(t.fuse.State().find("fsync_failures=1") != std::string::npos);
    for (int i = 0; i < 4; i++) {  // both sessions of the pool
      Status later = t.dev->Flush();
      INFO(later.ToString());
      CHECK_FALSE(later.ok());
    }
  }
}

// Targets admit initiators by name (DEPLOY.md section 1 binds the target
// to the hosts' names). dede made up a new name per process
// (iqn...:HOST.initiator-PID), so no ACL could name it and every login to
// such a target was refused. The name is now configurable
// (DeviceOptions::iscsi_initiator_name, dedupd --initiator-name,
// DEDE_INITIATOR_NAME) and defaults to open-iscsi's.
TEST_CASE("iSCSI: a target bound to an initiator name admits the configured name only", "[iscsi]") {
  TempDir dir;
  const std::string backing = dir.file("acl.img");
  CreateSparseFile(backing, kLunSize);
  TgtdRig rig(backing);
  const std::string allowed = "iqn.2025-01.org.example:host7";
  REQUIRE(rig.Tgtadm({"--op", "unbind", "--mode", "target", "--tid", "1", "-I", "ALL"}).exit_code ==
          0);
  REQUIRE(rig.Tgtadm({"--op", "bind", "--mode", "target", "--tid", "1", "-Q", allowed}).exit_code ==
          0);
  DeviceOptions opts;
  opts.iscsi_initiator_name = allowed;
  opts.iscsi_sessions = 2;
  {
    auto dev = MustOpen(rig.url(), opts);
    const auto data = RandomBytes(4096, 91);
    REQUIRE(dev->Write(8192, data.data(), data.size()).ok());
    REQUIRE(dev->Flush().ok());
    CHECK(ReadFile(backing, 8192, 4096) == data);
  }
  opts.iscsi_initiator_name = "iqn.2025-01.org.example:someone-else";
  auto refused = dede::OpenBlockDevice(rig.url(), opts);
  INFO(refused.status().ToString());
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().message().find("someone-else") != std::string::npos);
  opts.iscsi_initiator_name = "host7";  // not an iSCSI name
  CHECK(dede::OpenBlockDevice(rig.url(), opts).status().code() == Status::Code::kInvalid);
  // The command line takes it from DEDE_INITIATOR_NAME.
  dede::test::ProcessResult info = dede::test::RunProcess(
      {dede::test::BinaryPath("dede"), "info", rig.url()}, {"DEDE_INITIATOR_NAME=" + allowed});
  INFO(info.err);
  CHECK(info.exit_code == 1);  // reached the LUN: it holds no volume
  CHECK(info.err.find("rejected") == std::string::npos);
  info = dede::test::RunProcess({dede::test::BinaryPath("dede"), "info", rig.url()},
                                {"DEDE_INITIATOR_NAME=iqn.2025-01.org.example:someone-else"});
  CHECK(info.exit_code == 1);
  CHECK(info.err.find("someone-else") != std::string::npos);
}

// SBC: a write-protected unit answers every WRITE with DATA PROTECT. It
// used to open fine and fail the volume's first write (a lock or journal
// update, after the volume had been opened); now the open says so.
TEST_CASE("iSCSI: a write-protected LUN is refused at open unless opened read-only", "[iscsi]") {
  Target t;
  auto r = t.rig->Tgtadm({"--op", "update", "--mode", "logicalunit", "--tid", "1", "--lun", "1",
                          "--params", "readonly=1"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);

  auto dev = dede::OpenBlockDevice(t.rig->url(), DeviceOptions{});
  REQUIRE_FALSE(dev.ok());
  INFO(dev.status().ToString());
  CHECK(dev.status().code() == Status::Code::kInvalid);
  CHECK_THAT(dev.status().message(), Catch::Contains("write-protected"));
  CHECK(OneLine(dev.status().message()));

  DeviceOptions ro;
  ro.read_only = true;
  auto rdev = MustOpen(t.rig->url(), ro);
  std::vector<uint8_t> buf(4096);
  CHECK(rdev->Read(0, buf.data(), buf.size()).ok());

  // Writable again: opens.
  r = t.rig->Tgtadm({"--op", "update", "--mode", "logicalunit", "--tid", "1", "--lun", "1",
                     "--params", "readonly=0"});
  REQUIRE(r.exit_code == 0);
  auto again = dede::OpenBlockDevice(t.rig->url(), DeviceOptions{});
  INFO(again.status().ToString());
  CHECK(again.ok());
}

// A target reconfigured while a session was away (the LUN number now
// names a recreated, smaller unit; or another disk, with its own serial)
// used to get the volume's next WRITEs after the relogin, and answer its
// READs with another disk's blocks. Now every login but the first checks
// the unit against the one the device opened, and a changed unit gets
// nothing more, from any session.
TEST_CASE("iSCSI: a LUN that is another unit after a relogin gets nothing more", "[iscsi]") {
  const std::string change = GENERATE(std::string("serial"), std::string("shrunk"));
  DeviceOptions opts;
  opts.iscsi_sessions = GENERATE(1u, 3u);
  INFO(change << ", sessions " << opts.iscsi_sessions);
  Target t;
  auto dev = MustOpen(t.rig->url(), opts);
  const auto first = RandomBytes(8192, 515);
  REQUIRE(dev->Write(8 * kMiB, first.data(), first.size()).ok());
  REQUIRE(dev->Flush().ok());

  std::string now_backing = t.backing;
  if (change == "serial") {
    auto r = t.rig->Tgtadm({"--op", "update", "--mode", "logicalunit", "--tid", "1", "--lun", "1",
                            "--params", "scsi_sn=another-disk-7"});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
  } else {
    // The LU recreated on a smaller store (sessions stay logged in to the
    // target: tgtd lets an idle LU go).
    now_backing = t.dir.file("smaller.img");
    CreateSparseFile(now_backing, kLunSize - 4 * kMiB);
    auto del =
        t.rig->Tgtadm({"--op", "delete", "--mode", "logicalunit", "--tid", "1", "--lun", "1"});
    INFO(del.err);
    REQUIRE(del.exit_code == 0);
    auto add = t.rig->Tgtadm(
        {"--op", "new", "--mode", "logicalunit", "--tid", "1", "--lun", "1", "-b", now_backing});
    INFO(add.err);
    REQUIRE(add.exit_code == 0);
  }
  const auto before = ReadFile(now_backing, 0, 16384);
  REQUIRE(DropAllConnections(*t.rig) >= static_cast<int>(opts.iscsi_sessions));

  const auto second = RandomBytes(16384, 516);
  Status st = dev->Write(0, second.data(), second.size());
  INFO(st.ToString());
  REQUIRE_FALSE(st.ok());
  CHECK_THAT(st.message(), Catch::Contains("no longer the logical unit"));
  CHECK_THAT(st.message(), Catch::Contains(change == "serial" ? "serial number" : "shrank"));
  CHECK(ReadFile(now_backing, 0, 16384) == before);

  // Every later command, of every session, fails the same way.
  std::vector<uint8_t> got(8192);
  for (int i = 0; i < 4; i++) {
    Status rd = dev->Read(8 * kMiB, got.data(), got.size());
    CHECK_THAT(rd.message(), Catch::Contains("no longer the logical unit"));
  }
  CHECK_FALSE(dev->Flush().ok());
  CHECK_FALSE(dev->Write(0, second.data(), 4096).ok());
  CHECK(ReadFile(now_backing, 0, 16384) == before);
}
