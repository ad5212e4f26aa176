// NbdServer's host-wide memory budget (--nbd-memory): the class alone, and
// a real server on a Unix socket over an in-memory volume, driven by raw
// NBD clients that send READs and WRITEs and never read their replies,
// stall mid-payload (--nbd-stall-timeout) or hang up while they wait.
#include "agent/nbd_server.h"

#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/endian/conversion.hpp>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "agent/export_table.h"
#include "tests/forwarding_device.h"
#include "tests/socket_client.h"
#include "tests/temp_locks.h"
#include "volume/format.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;
using namespace std::chrono_literals;

namespace {

constexpr uint64_t kMiB = 1 << 20;

// ------------------------------------------------------------------ budget

TEST_CASE("nbd budget: reserves what fits, queues the rest in order, wakes the first in line",
          "[nbd]") {
  NbdMemoryBudget b(10);
  int a = 0, c = 0, d = 0;  // connections (only their addresses matter)
  int woke_a = 0, woke_c = 0, woke_d = 0;
  CHECK(b.TryReserve(&a, 6, [&] { woke_a++; }));
  CHECK_FALSE(b.TryReserve(&c, 6, [&] { woke_c++; }));  // 12 > 10
  // A small one does not pass the one waiting ahead of it (or a big
  // request would wait for ever behind a stream of small ones).
  CHECK_FALSE(b.TryReserve(&d, 1, [&] { woke_d++; }));
  CHECK(b.stats().waiting == 2);
  CHECK(b.stats().in_use == 6);

  b.Release(6);
  CHECK(woke_c == 1);  // first in line, and its 6 fit now
  CHECK(woke_d == 0);
  b.Release(0);
  CHECK(woke_c == 1);  // woken once, until it asks again
  CHECK(b.TryReserve(&c, 6, [&] { woke_c++; }));
  CHECK(woke_d == 1);  // the next in line fits too: asked at once
  CHECK(b.TryReserve(&d, 1, [&] { woke_d++; }));
  CHECK(b.stats().in_use == 7);
  CHECK(b.stats().peak == 7);
  CHECK(b.stats().waiting == 0);
  CHECK(b.stats().waits == 2);
  b.Release(7);
  CHECK(b.stats().in_use == 0);
}

TEST_CASE(
    "nbd budget: a request larger than the budget runs alone, and a withdrawn waiter frees its "
    "place",
    "[nbd]") {
  NbdMemoryBudget b(10);
  int a = 0, big = 0, small = 0;
  int woke_big = 0, woke_small = 0;
  CHECK(b.TryReserve(&a, 1, nullptr));
  CHECK_FALSE(b.TryReserve(&big, 32, [&] { woke_big++; }));
  CHECK_FALSE(b.TryReserve(&small, 1, [&] { woke_small++; }));
  b.Release(1);  // nothing reserved: the big one may run, alone
  CHECK(woke_big == 1);
  // It leaves instead (its connection closes): the next one is asked.
  b.Withdraw(&big);
  CHECK(woke_small == 1);
  CHECK(b.TryReserve(&small, 1, nullptr));
  CHECK_FALSE(b.TryReserve(&big, 32, [&] { woke_big++; }));
  b.Release(1);
  CHECK(woke_big == 2);
  CHECK(b.TryReserve(&big, 32, nullptr));
  CHECK(b.stats().peak == 32);
  {
    NbdMemoryCharge charge(&b, 32);  // given back when it goes
    NbdMemoryCharge moved = std::move(charge);
  }
  CHECK(b.stats().in_use == 0);
}

// ------------------------------------------------------------------ server

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/dede-nbd-server-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A minimal NBD client: the handshake, requests, simple replies.
class Client {
 public:
  explicit Client(const std::string& path) {
    fd_ = test::ConnectUnix(path, /*recv_timeout_s=*/20, /*send_timeout_s=*/20);
  }
  ~Client() { Close(); }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  // Ends a send blocked in another thread.
  void Shutdown() { ::shutdown(fd_, SHUT_RDWR); }
  int fd() const { return fd_; }

  bool Send(const void* data, size_t n) { return test::SendAll(fd_, data, n); }
  // Up to n bytes; 0 at end of file, -1 on an error or the timeout.
  ssize_t RecvSome(void* data, size_t n) { return ::recv(fd_, data, n, 0); }
  bool Recv(void* data, size_t n) { return test::RecvAll(fd_, data, n); }

  // Fixed newstyle, NBD_OPT_GO for `name`; true when the export is entered.
  bool Go(const std::string& name) {
    uint8_t greeting[18];
    if (!Recv(greeting, sizeof greeting)) return false;
    std::vector<uint8_t> v;
    test::PutBig32(&v, 3);  // FIXED_NEWSTYLE | NO_ZEROES
    test::PutBig64(&v, 0x49484156454F5054ull);
    test::PutBig32(&v, 7);  // GO
    test::PutBig32(&v, static_cast<uint32_t>(4 + name.size() + 2));
    test::PutBig32(&v, static_cast<uint32_t>(name.size()));
    v.insert(v.end(), name.begin(), name.end());
    test::PutBig16(&v, 0);
    if (!Send(v.data(), v.size())) return false;
    for (;;) {
      uint8_t h[20];
      if (!Recv(h, sizeof h)) return false;
      const uint32_t type = boost::endian::load_big_u32(h + 12);
      std::vector<uint8_t> data(boost::endian::load_big_u32(h + 16));
      if (!data.empty() && !Recv(data.data(), data.size())) return false;
      if (type == 1) return true;  // ACK
      if (type & 0x80000000u) return false;
    }
  }
  bool Request(uint16_t type, uint64_t cookie, uint64_t offset, uint32_t length,
               const uint8_t* payload = nullptr, uint16_t flags = 0) {
    std::vector<uint8_t> v;
    test::PutBig32(&v, 0x25609513);
    test::PutBig16(&v, flags);
    test::PutBig16(&v, type);
    test::PutBig64(&v, cookie);
    test::PutBig64(&v, offset);
    test::PutBig32(&v, length);
    if (!Send(v.data(), v.size())) return false;
    return payload == nullptr || Send(payload, length);
  }
  // A simple reply's error, or -1 if none came.
  int64_t Reply(uint64_t cookie) {
    uint8_t h[16];
    if (!Recv(h, sizeof h) || boost::endian::load_big_u32(h) != 0x67446698 ||
        boost::endian::load_big_u64(h + 8) != cookie) {
      return -1;
    }
    return boost::endian::load_big_u32(h + 4);
  }

 private:
  int fd_ = -1;
};

// An NbdServer over an in-memory volume with one 64 MiB file "vm", its
// io_context on a thread of its own, as in dedupd.
// Writes through it take `delay_ms` each once set (0: none), as a
// device busy with other work would.
class SlowWriteDevice : public test::ForwardingDevice {
 public:
  explicit SlowWriteDevice(BlockDevice* base) : ForwardingDevice(base, "slow") {}
  Status Write(uint64_t offset, const void* buf, size_t len) override {
    if (int ms = delay_ms.load(); ms > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return base()->Write(offset, buf, len);
  }
  std::atomic<int> delay_ms{0};
};

struct ServerRig {
  explicit ServerRig(uint64_t budget, double stall_timeout_s = 60) : mem(256 * kMiB), slow(&mem) {
    REQUIRE(FormatVolume(&mem, FormatOptions{}, false).ok());
    OpenOptions oo;
    oo.locks = test::TempLocks();
    auto v = Volume::Open(&slow, oo);
    REQUIRE(v.ok());
    vol = std::move(v.value());
    REQUIRE(vol->Create("vm", 64 * kMiB).ok());
    REQUIRE(vol->Sync().ok());
    table = std::make_unique<ExportTable>(vol.get(), nullptr, nullptr);
    NbdServerOptions so;
    so.unix_socket = dir.file("nbd.sock");
    so.worker_threads = 4;
    so.memory_budget = budget;
    so.stall_timeout_s = stall_timeout_s;
    server = std::make_unique<NbdServer>(io, table.get(), so);
    REQUIRE(server->Listen().ok());
    server->Start();
    thread = std::thread([this] { io.run(); });
  }
  ~ServerRig() {
    boost::asio::post(io, [this] { server->Shutdown([this] { work.reset(); }); });
    thread.join();
    server->JoinWorkers();
    server.reset();
    table.reset();
    (void)vol->Sync();
  }
  std::string socket() const { return dir.file("nbd.sock"); }
  // Polls the budget until `done` holds (false after 20 s).
  template <typename F>
  bool WaitFor(F done) {
    for (auto until = std::chrono::steady_clock::now() + 20s;
         std::chrono::steady_clock::now() < until; std::this_thread::sleep_for(5ms)) {
      if (done(server->stats().memory)) return true;
    }
    return false;
  }
  bool WaitForUse(uint64_t in_use, uint64_t waiting) {
    return WaitFor([&](const NbdMemoryBudget::Stats& m) {
      return m.in_use == in_use && m.waiting == waiting;
    });
  }
  // Polls until `n` connections are open (false after 20 s): a connection
  // that leaves the line is closed a moment later, on the server's thread.
  bool WaitForConnections(uint64_t n) {
    return WaitFor(
        [&](const NbdMemoryBudget::Stats&) { return server->stats().connections_open == n; });
  }

  TempDir dir;
  MemDevice mem;
  SlowWriteDevice slow;
  std::unique_ptr<Volume> vol;
  std::unique_ptr<ExportTable> table;
  boost::asio::io_context io{1};
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work{io.get_executor()};
  std::unique_ptr<NbdServer> server;
  std::thread thread;
};

}  // namespace

TEST_CASE("nbd server: clients that never read their READ replies hold no more than --nbd-memory",
          "[nbd]") {
  // Each connection alone stops at 64 MiB of replies waiting; four such
  // clients held 256 MiB here (and 1024 of them, with partly received
  // WRITE payloads, ~97 GiB). With an 8 MiB budget they hold 8 MiB between
  // them, the others waiting; once they go, a client waiting behind them
  // is served.
  ServerRig rig(8 * kMiB);
  std::vector<std::unique_ptr<Client>> pinners;
  for (int i = 0; i < 4; i++) {
    pinners.push_back(std::make_unique<Client>(rig.socket()));
    REQUIRE(pinners.back()->Go("vm"));
    for (uint64_t r = 0; r < 8; r++) REQUIRE(pinners.back()->Request(0, r, r * 4 * kMiB, 4 * kMiB));
  }
  CHECK(rig.WaitFor([](const NbdMemoryBudget::Stats& m) {
    return (m.in_use == 8 * kMiB && m.waiting >= 1) || m.in_use > 8 * kMiB;
  }));
  std::this_thread::sleep_for(300ms);  // whatever else would be taken
  NbdMemoryBudget::Stats m = rig.server->stats().memory;
  INFO("in use " << m.in_use << ", peak " << m.peak << ", waiting " << m.waiting);
  CHECK(m.limit == 8 * kMiB);
  CHECK(m.waiting >= 1);
  CHECK(m.peak <= 8 * kMiB);
  CHECK(m.in_use <= 8 * kMiB);

  Client patient(rig.socket());
  REQUIRE(patient.Go("vm"));
  REQUIRE(patient.Request(0, 77, 0, 4096));
  pinners.clear();  // their connections go, and their bytes with them
  CHECK(patient.Reply(77) == 0);
  std::vector<uint8_t> data(4096);
  CHECK(patient.Recv(data.data(), data.size()));
  CHECK(rig.WaitFor([](const NbdMemoryBudget::Stats& s) { return s.in_use == 0; }));
  CHECK(rig.server->stats().memory.peak <= 8 * kMiB);
}

TEST_CASE(
    "nbd server: WRITE floods stay within --nbd-memory, partly received payloads included, "
    "and a well-behaved client gets its I/O done",
    "[nbd]") {
  ServerRig rig(8 * kMiB);
  std::vector<uint8_t> payload(4 * kMiB, 0x5a);
  std::vector<std::unique_ptr<Client>> writers;
  std::vector<std::thread> threads;
  std::atomic<int> sent{0};
  for (int i = 0; i < 4; i++) {
    writers.push_back(std::make_unique<Client>(rig.socket()));
    REQUIRE(writers.back()->Go("vm"));
  }
  for (int i = 0; i < 4; i++) {
    threads.emplace_back([&, c = writers[i].get(), i] {
      for (uint64_t r = 0; r < 12; r++) {
        if (!c->Request(1, r, (i * 12 + r) % 15 * 4 * kMiB, 4 * kMiB, payload.data())) return;
        sent++;
      }
    });
  }
  Client good(rig.socket());
  REQUIRE(good.Go("vm"));
  std::vector<uint8_t> mine(kMiB);
  for (size_t i = 0; i < mine.size(); i++) mine[i] = static_cast<uint8_t>(i * 13 + 1);
  for (uint64_t round = 0; round < 8; round++) {
    REQUIRE(good.Request(1, 2 * round, 64 * kMiB - kMiB, kMiB, mine.data()));
    REQUIRE(good.Reply(2 * round) == 0);
    REQUIRE(good.Request(0, 2 * round + 1, 64 * kMiB - kMiB, kMiB));
    REQUIRE(good.Reply(2 * round + 1) == 0);
    std::vector<uint8_t> back(kMiB);
    REQUIRE(good.Recv(back.data(), back.size()));
    REQUIRE(back == mine);
  }
  for (auto& t : threads) t.join();
  CHECK(sent == 48);  // every WRITE was taken (their replies are not read)
  NbdMemoryBudget::Stats m = rig.server->stats().memory;
  INFO("peak " << m.peak << ", waits " << m.waits);
  CHECK(m.peak <= 8 * kMiB);
  CHECK(m.waits > 0);
  writers.clear();
  CHECK(rig.WaitFor([](const NbdMemoryBudget::Stats& s) { return s.in_use == 0; }));
}

namespace {

constexpr uint16_t kRead = 0, kWrite = 1, kDisc = 2;

// CPU time this process (server and clients) used so far.
double CpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// Reads what the server sends until it closes (or 20 s pass); the bytes.
size_t DrainUntilClosed(Client* c) {
  std::vector<uint8_t> buf(64 * 1024);
  size_t total = 0;
  for (;;) {
    const ssize_t n = c->RecvSome(buf.data(), buf.size());
    if (n <= 0) return total;  // EOF (or the 20 s timeout)
    total += static_cast<size_t>(n);
  }
}

// Has `c` (not yet past the handshake) ask for n 2 MiB READs whose
// replies it does not read: they hold n * 2 MiB of the budget until it
// reads them or goes.
void PinBudget(ServerRig* rig, Client* c, uint64_t n) {
  REQUIRE(c->Go("vm"));
  for (uint64_t r = 0; r < n; r++) REQUIRE(c->Request(kRead, r, r * 2 * kMiB, 2 * kMiB));
  REQUIRE(rig->WaitForUse(n * 2 * kMiB, 0));
}

}  // namespace

TEST_CASE(
    "nbd server: a client holding --nbd-memory that moves no byte for the stall timeout is "
    "closed once another waits for room, which then proceeds",
    "[nbd]") {
  // Before, a client that stopped reading its replies kept what it held
  // for ever, and with the budget full every other connection waited for
  // ever behind it. The budget is 8 MiB, all of it READ replies the stuck
  // client does not take.
  ServerRig rig(8 * kMiB, 0.5);
  Client stuck(rig.socket());
  PinBudget(&rig, &stuck, 4);
  // While no one waits for the room, the stall harms no one: left alone.
  std::this_thread::sleep_for(1500ms);
  CHECK(rig.server->stats().stall_closes == 0);
  CHECK(rig.server->stats().connections_open == 1);

  Client patient(rig.socket());
  REQUIRE(patient.Go("vm"));
  REQUIRE(patient.Request(kRead, 77, 0, 4096));
  CHECK(patient.Reply(77) == 0);
  std::vector<uint8_t> data(4096);
  CHECK(patient.Recv(data.data(), data.size()));
  CHECK(rig.server->stats().stall_closes == 1);
  // The stuck client was disconnected, its replies given up (it got at
  // most what fit in the socket's buffer).
  CHECK(DrainUntilClosed(&stuck) < 4 * (16 + 2 * kMiB));
  CHECK(rig.WaitFor([](const NbdMemoryBudget::Stats& m) { return m.in_use == 0; }));
}

TEST_CASE(
    "nbd server: a WRITE whose payload stops coming is closed after the stall timeout when "
    "others wait, and never runs",
    "[nbd]") {
  ServerRig rig(8 * kMiB, 0.5);
  Client stuck(rig.socket());
  REQUIRE(stuck.Go("vm"));
  // An 8 MiB WRITE reserves the whole budget; 1 MiB of its payload comes.
  REQUIRE(stuck.Request(kWrite, 1, 0, 8 * kMiB));
  std::vector<uint8_t> part(kMiB, 0xab);
  REQUIRE(stuck.Send(part.data(), part.size()));
  REQUIRE(rig.WaitForUse(8 * kMiB, 0));

  Client patient(rig.socket());
  REQUIRE(patient.Go("vm"));
  REQUIRE(patient.Request(kRead, 2, 0, 4096));
  CHECK(patient.Reply(2) == 0);
  std::vector<uint8_t> data(4096, 1);
  CHECK(patient.Recv(data.data(), data.size()));
  CHECK(data == std::vector<uint8_t>(4096, 0));  // the partial WRITE never ran
  CHECK(rig.server->stats().stall_closes == 1);
  CHECK(DrainUntilClosed(&stuck) == 0);
}

TEST_CASE("nbd server: a slow reader is not taken for a stalled one, others waiting or not",
          "[nbd]") {
  // It takes its 8 MiB of replies 64 KiB at a time, 40 ms apart (over
  // 5 s, the stall timeout 2 s: a loaded machine's scheduling hiccup is
  // far shorter), while a READ needing the whole budget waits behind it
  // all along.
  ServerRig rig(8 * kMiB, 2.0);
  Client slow(rig.socket());
  PinBudget(&rig, &slow, 4);
  Client patient(rig.socket());
  REQUIRE(patient.Go("vm"));
  REQUIRE(patient.Request(kRead, 9, 0, 8 * kMiB));
  REQUIRE(rig.WaitForUse(8 * kMiB, 1));
  std::vector<uint8_t> buf(64 * 1024);
  size_t left = 4 * (16 + 2 * kMiB);
  while (left > 0) {
    const size_t n = std::min(left, buf.size());
    REQUIRE(slow.Recv(buf.data(), n));
    left -= n;
    std::this_thread::sleep_for(40ms);
  }
  CHECK(patient.Reply(9) == 0);
  std::vector<uint8_t> data(8 * kMiB);
  CHECK(patient.Recv(data.data(), data.size()));
  CHECK(rig.server->stats().stall_closes == 0);
}

TEST_CASE(
    "nbd server: a client that hangs up while its request waits for room leaves the line, and "
    "the next in line is served",
    "[nbd]") {
  // No stall closes here: only the hangup frees the line. Before, the
  // waiting connection read nothing, so it saw its client leave only once
  // admitted, and everyone behind it waited until then (here: for ever).
  ServerRig rig(8 * kMiB, 0);
  Client pinner(rig.socket());
  PinBudget(&rig, &pinner, 3);

  Client leaver(rig.socket());
  REQUIRE(leaver.Go("vm"));
  std::vector<uint8_t> part(16 * 1024, 0xcd);
  REQUIRE(leaver.Request(kWrite, 1, 0, 4 * kMiB));  // 6 + 4 > 8: waits
  REQUIRE(leaver.Send(part.data(), part.size()));
  REQUIRE(rig.WaitForUse(6 * kMiB, 1));
  // More of its payload while it waits: it is still there, and watching
  // for its hangup does not spin.
  const double cpu0 = CpuSeconds();
  REQUIRE(leaver.Send(part.data(), part.size()));
  std::this_thread::sleep_for(500ms);
  const double cpu = CpuSeconds() - cpu0;
  INFO("CPU used in 0.5 s while the WRITE waited: " << cpu << " s");
  CHECK(cpu < 0.25);
  CHECK(rig.server->stats().memory.waiting == 1);

  Client next(rig.socket());
  REQUIRE(next.Go("vm"));
  REQUIRE(next.Request(kRead, 2, 32 * kMiB, kMiB));  // fits, but in line behind the WRITE
  REQUIRE(rig.WaitForUse(6 * kMiB, 2));
  leaver.Close();
  CHECK(next.Reply(2) == 0);
  std::vector<uint8_t> data(kMiB);
  CHECK(next.Recv(data.data(), data.size()));
  NbdMemoryBudget::Stats m = rig.server->stats().memory;
  CHECK(m.waiting == 0);
  CHECK(m.waits == 2);
  CHECK(rig.server->stats().stall_closes == 0);
  // The WRITE that never completed did not run.
  REQUIRE(next.Request(kRead, 3, 0, 4096));
  CHECK(next.Reply(3) == 0);
  std::vector<uint8_t> head(4096, 1);
  CHECK(next.Recv(head.data(), head.size()));
  CHECK(head == std::vector<uint8_t>(4096, 0));
}

TEST_CASE("nbd server: a READ waiting for room whose client hangs up leaves the line too",
          "[nbd]") {
  ServerRig rig(8 * kMiB, 0);
  Client pinner(rig.socket());
  PinBudget(&rig, &pinner, 4);
  Client leaver(rig.socket());
  REQUIRE(leaver.Go("vm"));
  REQUIRE(leaver.Request(kRead, 1, 0, 4 * kMiB));
  REQUIRE(rig.WaitForUse(8 * kMiB, 1));
  leaver.Close();
  CHECK(rig.WaitForUse(8 * kMiB, 0));
  CHECK(rig.WaitForConnections(1));
}

TEST_CASE(
    "nbd server: a client that sent a whole WRITE and a DISC, then hung up, still has its WRITE "
    "done when its turn comes",
    "[nbd]") {
  // Leaving the line when the client leaves drops only what was never
  // going to be acknowledged anyway; a DISC asks for what came before it
  // to be handled, so that client stays in line.
  ServerRig rig(8 * kMiB, 0);
  auto pinner = std::make_unique<Client>(rig.socket());
  PinBudget(&rig, pinner.get(), 4);
  Client writer(rig.socket());
  REQUIRE(writer.Go("vm"));
  std::vector<uint8_t> payload(64 * 1024, 0xc3);
  REQUIRE(writer.Request(kWrite, 1, 16 * kMiB, 64 * 1024, payload.data()));
  REQUIRE(writer.Request(kDisc, 2, 0, 0));
  REQUIRE(rig.WaitForUse(8 * kMiB, 1));
  writer.Close();
  std::this_thread::sleep_for(300ms);
  CHECK(rig.server->stats().memory.waiting == 1);
  pinner.reset();  // its replies given up, the budget frees
  Client check(rig.socket());
  REQUIRE(check.Go("vm"));
  std::vector<uint8_t> back;
  for (int tries = 0; tries < 400 && back != payload; tries++) {  // the WRITE runs after a moment
    REQUIRE(check.Request(kRead, 3, 16 * kMiB, 64 * 1024));
    REQUIRE(check.Reply(3) == 0);
    back.assign(64 * 1024, 0);
    REQUIRE(check.Recv(back.data(), back.size()));
    if (back != payload) std::this_thread::sleep_for(50ms);
  }
  CHECK(back == payload);
}

// qemu and the kernel send TRIMs and WRITE_ZEROES of gigabytes; a client
// pipelining such requests took every worker (each one's device work for
// seconds) and other VMs' READs queued behind them. Longer than a WRITE
// may be, they run on a pool of their own (a quarter of the workers: one
// here), one after another, and the workers stay free.
TEST_CASE("nbd server: long WRITE_ZEROES requests of one client leave the workers to the others",
          "[nbd]") {
  constexpr uint16_t kWriteZeroes = 6, kFlagNoHole = 1 << 1;
  ServerRig rig(64 * kMiB);
  Client zeroer(rig.socket());
  REQUIRE(zeroer.Go("vm"));
  Client reader(rig.socket());
  REQUIRE(reader.Go("vm"));
  // Data at 60 MiB to read back, outside the zeroed range.
  std::vector<uint8_t> payload(4096, 0x5a);
  REQUIRE(reader.Request(kWrite, 1, 60 * kMiB, 4096, payload.data()));
  REQUIRE(reader.Reply(1) == 0);

  // Four zeroings of 40 MiB with NO_HOLE (written, not punched), each
  // about 60 device writes at 20 ms (over a second): as many as the
  // workers, which before took them all (one zeroing, the others waiting
  // for its range).
  rig.slow.delay_ms = 20;
  constexpr int kZeroings = 4;
  for (int i = 0; i < kZeroings; i++) {
    REQUIRE(zeroer.Request(kWriteZeroes, 100 + i, 0, 40 * kMiB, nullptr, kFlagNoHole));
  }
  std::this_thread::sleep_for(100ms);  // the server has read them all
  REQUIRE(reader.Request(kRead, 2, 60 * kMiB, 4096));
  REQUIRE(reader.Reply(2) == 0);
  std::vector<uint8_t> back(4096);
  REQUIRE(reader.Recv(back.data(), back.size()));
  CHECK(back == payload);
  // The READ was answered while the first zeroing still ran: no reply
  // waits for the zeroing client (before, the READ waited for a worker
  // until the first zeroing ended, and its reply was there).
  int waiting = 0;
  REQUIRE(::ioctl(zeroer.fd(), FIONREAD, &waiting) == 0);
  CHECK(waiting == 0);
  rig.slow.delay_ms = 0;
  for (int i = 0; i < kZeroings; i++) CHECK(zeroer.Reply(100 + i) == 0);
  REQUIRE(reader.Request(kRead, 3, 39 * kMiB, 4096));
  REQUIRE(reader.Reply(3) == 0);
  REQUIRE(reader.Recv(back.data(), back.size()));
  CHECK(back == std::vector<uint8_t>(4096, 0));
}
