// Export (agent/export_table.h): when a WRITE may be answered before its
// device write, and what READ and FLUSH then owe the client. The device
// holds the next write at a gate, so the test sees the moment between the
// answer and the write.
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "agent/dedup_pass.h"
#include "agent/export_table.h"
#include "agent/log_flusher.h"
#include "kmod/writemon/write_log.h"
#include "kmod/writemon/write_monitor.h"
#include "tests/forwarding_device.h"
#include "tests/forwarding_locks.h"
#include "tests/temp_locks.h"
#include "util/fingerprint.h"
#include "volume/format.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;
using dede::test::TempLocks;
using namespace std::chrono_literals;

namespace {

constexpr uint64_t kB = kBlockSize;
constexpr uint64_t kFileBytes = 64 * kB;

// Holds one call: after Arm(), the next Pass() waits until Open().
class Gate {
 public:
  void Arm() {
    std::lock_guard<std::mutex> l(mu_);
    armed_ = true;
  }
  // Waits until a call is held at the gate.
  bool WaitHeld(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, limit, [&] { return held_; });
  }
  void Open() {
    {
      std::lock_guard<std::mutex> l(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  // Closed and unarmed again, for the next held call.
  void Reset() {
    std::lock_guard<std::mutex> l(mu_);
    armed_ = held_ = open_ = false;
  }
  // True if this call was the one held (it has been let go since).
  bool Pass() {
    std::unique_lock<std::mutex> l(mu_);
    if (!armed_) return false;
    armed_ = false;
    held_ = true;
    cv_.notify_all();
    cv_.wait(l, [&] { return open_; });
    return true;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false, held_ = false, open_ = false;
};

// Holds the next write after Arm() until Open(); that write then fails
// with EIO if FailHeld() was called.
class GateDevice : public test::ForwardingDevice {
 public:
  explicit GateDevice(BlockDevice* base) : ForwardingDevice(base, "gate") {}
  void Arm() { gate_.Arm(); }
  void FailHeld() { fail_ = true; }
  bool WaitHeld(std::chrono::milliseconds limit) { return gate_.WaitHeld(limit); }
  void Open() { gate_.Open(); }
  void Reset() {
    gate_.Reset();
    fail_ = false;
  }
  Status Write(uint64_t offset, const void* buf, size_t len) override {
    if (gate_.Pass() && fail_) return Status::IoError("injected write error");
    return base()->Write(offset, buf, len);
  }
  // Called before every device flush, when set.
  std::function<void()> on_flush;
  // Every device flush fails with EIO while set.
  std::atomic<bool> fail_flushes{false};
  Status Flush() override {
    if (on_flush) on_flush();
    if (fail_flushes) return Status::IoError("injected flush error");
    return base()->Flush();
  }

 private:
  Gate gate_;
  std::atomic<bool> fail_{false};
};

std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 r(seed);
  for (auto& b : v) b = static_cast<uint8_t>(r());
  return v;
}

// A volume on a gated device with one file "vm": its first half written
// (allocated, in place from then on), its second half a hole.
struct Rig {
  explicit Rig(WriteMonitor* monitor = nullptr) : mem(64 << 20), gate(&mem) {
    REQUIRE(FormatVolume(&mem, FormatOptions{}, false).ok());
    OpenOptions oo;
    oo.locks = TempLocks();
    auto v = Volume::Open(&gate, oo);
    REQUIRE(v.ok());
    vol = std::move(v.value());
    REQUIRE(vol->Create("vm", kFileBytes).ok());
    {
      auto f = vol->OpenFile("vm");
      REQUIRE(f.ok());
      const std::vector<uint8_t> old = Pattern(kFileBytes / 2, 1);
      REQUIRE((*f)->Write(0, old.data(), old.size()).ok());
    }
    REQUIRE(vol->Sync().ok());
    table = std::make_unique<ExportTable>(vol.get(), monitor, nullptr);
    auto e = table->Acquire("vm");
    REQUIRE(e.ok());
    ex = *e;
  }
  ~Rig() {
    gate.Open();  // never leave a writer stuck
    if (ex) table->Release(ex);
  }

  std::vector<uint8_t> Read(uint64_t offset, size_t len) {
    IoBytes out;
    REQUIRE(ex->Read(offset, len, &out).ok());
    return std::vector<uint8_t>(out.begin(), out.end());
  }

  MemDevice mem;
  GateDevice gate;
  std::unique_ptr<Volume> vol;
  std::unique_ptr<ExportTable> table;
  std::shared_ptr<Export> ex;
};

// Starts an Export::Write on its own thread; `answered` becomes ready when
// the client may be told, `done` when Write returns.
struct AsyncWrite {
  AsyncWrite(Export* ex, uint64_t offset, const std::vector<uint8_t>& data, bool fua) {
    auto answered_p = std::make_shared<std::promise<Status>>();
    answered = answered_p->get_future();
    done = std::async(std::launch::async, [=, &data] {
      return ex->Write(offset, data.data(), data.size(), fua,
                       [answered_p](const Status& st) { answered_p->set_value(st); });
    });
  }
  std::future<Status> answered;
  std::future<Status> done;
};

// Opens the gate when a test leaves early, before the futures of writes
// held there are destroyed (their destructors wait for them).
struct OpenOnExit {
  GateDevice* gate;
  ~OpenOnExit() { gate->Open(); }
};

// A write of `data` at 0 that is answered (OK) while its device write is
// held at the gate, set to fail with EIO: constructed once the answer has
// come; the write fails when the test opens the gate.
struct WriteFailingAfterAnswer {
  // The gate armed to hold and fail the next write, before it starts.
  struct Armed {
    explicit Armed(GateDevice* gate) {
      gate->Arm();
      gate->FailHeld();
    }
  };
  WriteFailingAfterAnswer(GateDevice* gate, Export* ex, const std::vector<uint8_t>& data)
      : armed(gate), w(ex, 0, data, false), guard{gate} {
    REQUIRE(gate->WaitHeld(10s));
    REQUIRE(w.answered.wait_for(10s) == std::future_status::ready);
    CHECK(w.answered.get().ok());
  }
  Armed armed;  // members are built in this order
  AsyncWrite w;
  OpenOnExit guard;
};

}  // namespace

TEST_CASE("export: an in-place write is answered before its device write, READ and FLUSH wait",
          "[export]") {
  Rig r;
  const std::vector<uint8_t> data = Pattern(16 * kB, 2);
  r.gate.Arm();
  AsyncWrite w(r.ex.get(), 4 * kB, data, /*fua=*/false);
  OpenOnExit guard_w{&r.gate};
  REQUIRE(r.gate.WaitHeld(10s));
  // The device write is still held, yet the client has its answer.
  REQUIRE(w.answered.wait_for(10s) == std::future_status::ready);
  CHECK(w.answered.get().ok());
  CHECK(r.ex->writes_answered_early() == 1);

  // A READ of those blocks and a FLUSH must not complete before the write.
  // (No assertions on these threads: Catch2's are for the test's own.)
  IoBytes read_out;
  auto read = std::async(std::launch::async, [&] { return r.ex->Read(0, 32 * kB, &read_out); });
  auto flush = std::async(std::launch::async, [&] { return r.ex->Flush(); });
  OpenOnExit guard_rf{&r.gate};
  // A READ elsewhere does not wait.
  const std::vector<uint8_t> old = Pattern(kFileBytes / 2, 1);
  CHECK(r.Read(24 * kB, 4 * kB) ==
        std::vector<uint8_t>(old.begin() + 24 * kB, old.begin() + 28 * kB));
  CHECK(read.wait_for(200ms) == std::future_status::timeout);
  CHECK(flush.wait_for(10ms) == std::future_status::timeout);

  r.gate.Open();
  REQUIRE(w.done.get().ok());
  std::vector<uint8_t> expect = old;
  std::copy(data.begin(), data.end(), expect.begin() + 4 * kB);
  REQUIRE(read.get().ok());
  CHECK(std::vector<uint8_t>(read_out.begin(), read_out.end()) == expect);
  CHECK(flush.get().ok());
}

TEST_CASE("export: a write that fails after its answer fails the next FLUSH and every later write",
          "[export]") {
  Rig r;
  const std::vector<uint8_t> data = Pattern(8 * kB, 3);
  WriteFailingAfterAnswer failing(&r.gate, r.ex.get(), data);
  r.gate.Open();
  Status st = failing.w.done.get();
  CHECK(st.code() == Status::Code::kIoError);
  Status flushed = r.ex->Flush();
  INFO(flushed.ToString());
  CHECK_FALSE(flushed.ok());
  // The volume stopped taking writes: the next one is refused, not lost.
  bool answered_ok = true;
  Status later = r.ex->Write(16 * kB, data.data(), data.size(), false,
                             [&](const Status& s) { answered_ok = s.ok(); });
  CHECK_FALSE(later.ok());
  CHECK_FALSE(answered_ok);
}

// The client was told the write landed; its blocks may hold the old
// content or part of the new. A READ must not hand either back as if it
// were the data: from the failure on, every READ of the export fails.
TEST_CASE("export: after a write fails past its answer, READs fail instead of returning old data",
          "[export]") {
  Rig r;  // the file's first half holds Pattern(.., 1)
  const std::vector<uint8_t> data = Pattern(8 * kB, 3);
  WriteFailingAfterAnswer failing(&r.gate, r.ex.get(), data);
  // A READ of the answered blocks waits for the write's outcome...
  auto read = std::async(std::launch::async, [&] {
    IoBytes out;
    return r.ex->Read(0, 8 * kB, &out);
  });
  CHECK(read.wait_for(200ms) == std::future_status::timeout);
  r.gate.Open();
  CHECK(failing.w.done.get().code() == Status::Code::kIoError);
  // ...and then fails, as does a READ elsewhere in the export.
  Status st = read.get();
  INFO(st.ToString());
  CHECK(st.code() == Status::Code::kIoError);
  IoBytes other;
  CHECK(r.ex->Read(32 * kB, 4 * kB, &other).code() == Status::Code::kIoError);
}

TEST_CASE("export: writes that may fail for want of space, or need FUA, are answered after the "
          "device write",
          "[export]") {
  Rig r;
  struct Case {
    const char* what;
    uint64_t offset;
    size_t len;
    bool fua;
  };
  const Case cases[] = {
      {"into a hole (allocates)", kFileBytes / 2, 8 * kB, false},
      {"a partial block", 2 * kB + 512, 1024, false},
      {"FUA", 0, 8 * kB, true},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    const std::vector<uint8_t> data = Pattern(c.len, 4);
    r.gate.Reset();  // the last case's guard opened it
    r.gate.Arm();
    AsyncWrite w(r.ex.get(), c.offset, data, c.fua);
    OpenOnExit guard_w{&r.gate};
    REQUIRE(r.gate.WaitHeld(10s));
    CHECK(w.answered.wait_for(200ms) == std::future_status::timeout);
    r.gate.Open();
    REQUIRE(w.done.get().ok());
    REQUIRE(w.answered.wait_for(10s) == std::future_status::ready);
    CHECK(w.answered.get().ok());
    CHECK(r.Read(c.offset, c.len) == data);
  }
  CHECK(r.ex->writes_answered_early() == 0);
}

TEST_CASE("export: a WRITE's payload is hashed ahead only while the monitor records its file",
          "[export]") {
  // dedupd hashes a WRITE's payload as it arrives when fingerprints_writes()
  // says so. A file whose write log is full is not recorded until a pass
  // takes the log, and neither is a file with dedup=off: hashing their
  // payloads would be CPU for nothing.
  WriteMonitor monitor{WriteMonitorOptions{}};
  Rig rig(&monitor);
  const FileId id = rig.ex->id();
  CHECK(rig.ex->fingerprints_writes());
  monitor.PauseForFullLog(id, monitor.LogEpoch(id));
  CHECK_FALSE(rig.ex->fingerprints_writes());
  // Written meanwhile: not recorded, counted as such.
  const std::vector<uint8_t> data = Pattern(4 * kB, 5);
  REQUIRE(rig.ex->Write(0, data.data(), data.size(), false).ok());
  CHECK(monitor.FileStats(id).unrecorded_blocks == 4);
  CHECK(monitor.FileStats(id).buffered_records == 0);
  monitor.LogTaken(id);  // a pass took the log
  CHECK(rig.ex->fingerprints_writes());
  const std::vector<Fingerprint> fps = rig.ex->FingerprintWrite(0, data.data(), data.size());
  REQUIRE(fps.size() == 4);
  REQUIRE(rig.ex->Write(0, data.data(), data.size(), false, nullptr, &fps).ok());
  CHECK(monitor.FileStats(id).buffered_records == 4);
  REQUIRE(rig.ex->SetDedup(false).ok());
  CHECK_FALSE(rig.ex->fingerprints_writes());
  REQUIRE(rig.ex->SetDedup(true).ok());
  CHECK(rig.ex->fingerprints_writes());
}

TEST_CASE("export: dedup=off stops the monitor before the switch is made durable", "[export]") {
  // SetDedup(false) made the switch durable (a volume sync) before it told
  // the monitor: the log flusher could take what was written meanwhile and
  // append it behind the opt-out marker, fingerprints in the log of an
  // opted-out file. At the sync the monitor must have stopped recording
  // the file and dropped what it buffered.
  WriteMonitor monitor{WriteMonitorOptions{}};
  Rig rig(&monitor);
  const FileId id = rig.ex->id();
  const std::vector<uint8_t> data = Pattern(4 * kB, 8);
  const std::vector<Fingerprint> fps = rig.ex->FingerprintWrite(0, data.data(), data.size());
  REQUIRE(rig.ex->Write(0, data.data(), data.size(), false, nullptr, &fps).ok());
  REQUIRE(monitor.FileStats(id).buffered_records == 4);
  int flushes = 0;
  bool recording_at_last_flush = true;
  uint64_t buffered_at_last_flush = ~uint64_t{0};
  rig.gate.on_flush = [&] {
    flushes++;
    recording_at_last_flush = rig.ex->fingerprints_writes();
    buffered_at_last_flush = monitor.FileStats(id).buffered_records;
  };
  REQUIRE(rig.ex->SetDedup(false).ok());
  rig.gate.on_flush = nullptr;
  REQUIRE(flushes > 0);
  CHECK_FALSE(recording_at_last_flush);
  CHECK(buffered_at_last_flush == 0);
  CHECK_FALSE(rig.ex->dedup());
  // Switched on again: recorded again, once the switch is durable.
  REQUIRE(rig.ex->SetDedup(true).ok());
  CHECK(rig.ex->fingerprints_writes());
  REQUIRE(rig.ex->Write(0, data.data(), data.size(), false, nullptr, &fps).ok());
  CHECK(monitor.FileStats(id).buffered_records == 4);
}

TEST_CASE("export: dedup=on whose flush fails still has the monitor recording the file",
          "[export]") {
  // The switch is taken in the volume before its flush; when the flush
  // failed, SetDedup returned before telling the monitor, and the flag
  // reached the disk at the next flush point: a dedup=on file whose writes
  // nobody recorded while its export stayed open.
  WriteMonitor monitor{WriteMonitorOptions{}};
  Rig rig(&monitor);
  const FileId id = rig.ex->id();
  REQUIRE(rig.ex->SetDedup(false).ok());
  REQUIRE_FALSE(monitor.FileStats(id).dedup);
  rig.gate.fail_flushes = true;
  CHECK_FALSE(rig.ex->SetDedup(true).ok());
  rig.gate.fail_flushes = false;
  CHECK(rig.ex->dedup());
  CHECK(monitor.FileStats(id).dedup);
  CHECK(rig.ex->fingerprints_writes());
}

TEST_CASE("export: without a write monitor nothing is hashed ahead", "[export]") {
  Rig rig;
  CHECK_FALSE(rig.ex->fingerprints_writes());
}

TEST_CASE("export: the control socket's hold keeps a file open while its VM leaves", "[export]") {
  // `dede set NAME dedup=off` on a running export enters it as a client:
  // a VM disconnecting meanwhile must not close the file under SetDedup
  // (it did, before: the handler held the Export but not a client's count).
  Rig rig;
  CHECK(rig.table->AcquireIfOpen("nope") == nullptr);
  std::shared_ptr<Export> held = rig.table->AcquireIfOpen("vm");
  REQUIRE(held == rig.ex);
  std::vector<ExportTable::ExportStatus> st = rig.table->StatusOfOpen();
  REQUIRE(st.size() == 1);
  CHECK(st[0].name == "vm");
  CHECK(st[0].clients == 2);
  // The VM leaves.
  rig.table->Release(rig.ex);
  rig.ex.reset();
  REQUIRE(held->file() != nullptr);
  REQUIRE(held->SetDedup(false).ok());
  CHECK_FALSE(held->dedup());
  st = rig.table->StatusOfOpen();
  REQUIRE(st.size() == 1);
  CHECK(st[0].clients == 1);
  CHECK_FALSE(st[0].dedup);
  // The hold was the last client: its release closes the file.
  rig.table->Release(held);
  CHECK(held->file() == nullptr);
  CHECK(rig.table->StatusOfOpen().empty());
  CHECK(rig.table->AcquireIfOpen("vm") == nullptr);
  auto info = rig.vol->Lookup("vm");
  REQUIRE(info.ok());
  CHECK_FALSE(info->dedup);
}

TEST_CASE("export: the merge timer's file access lends open exports and never reopens one",
          "[export]") {
  // dedupd's merge timer lists the open exports, then applies their merge
  // requests one by one: a VM that leaves in between used to have its
  // disk opened again (its lock taken) just for that.
  Rig rig;
  auto info = rig.vol->Lookup("vm");
  REQUIRE(info.ok());
  {
    ExportFileAccess access(rig.table.get(), ExportFileAccess::kOnlyOpen);
    auto h = access.Get(*info);
    REQUIRE(h.ok());
    CHECK(rig.table->StatusOfOpen().at(0).clients == 2);
  }
  rig.table->Release(rig.ex);  // the VM leaves: the file closes
  rig.ex.reset();
  REQUIRE(rig.table->StatusOfOpen().empty());
  {
    ExportFileAccess access(rig.table.get(), ExportFileAccess::kOnlyOpen);
    auto h = access.Get(*info);
    CHECK(h.status().code() == Status::Code::kNotFound);
    CHECK(rig.table->StatusOfOpen().empty());
  }
  {
    // A pass's access still opens it.
    ExportFileAccess access(rig.table.get());
    REQUIRE(access.Get(*info).ok());
    CHECK(rig.table->StatusOfOpen().size() == 1);
  }
  CHECK(rig.table->StatusOfOpen().empty());
}

namespace {

// A volume (host 1 of two lock managers, as two processes) with one file
// "vm", served by an ExportTable with a write monitor and its log flusher;
// `ex` is one client's hold on "vm".
struct LoggedExport {
  LoggedExport() : mem(64 << 20) {
    REQUIRE(FormatVolume(&mem, FormatOptions{}, false).ok());
    vol = OpenAs(1);
    REQUIRE(vol->Create("vm", kFileBytes).ok());
    flusher = std::make_unique<LogFlusher>(vol.get(), &monitor);
    table = std::make_unique<ExportTable>(vol.get(), &monitor, flusher.get());
    auto e = table->Acquire("vm");
    REQUIRE(e.ok());
    ex = *e;
  }
  // The volume as another process (host 2) opens it.
  std::unique_ptr<Volume> OpenAs(uint32_t host) {
    OpenOptions oo;
    oo.host_id = host;
    oo.locks = locks[host - 1];
    auto v = Volume::Open(&mem, oo);
    REQUIRE(v.ok());
    return std::move(v.value());
  }

  MemDevice mem;
  const std::vector<std::shared_ptr<LockManager>> locks = test::TempLockGroup(2);
  std::unique_ptr<Volume> vol;
  WriteMonitor monitor{WriteMonitorOptions{}};
  std::unique_ptr<LogFlusher> flusher;
  std::unique_ptr<ExportTable> table;
  std::shared_ptr<Export> ex;
};

}  // namespace

TEST_CASE("export: a close waits for a write log held elsewhere instead of dropping its batch",
          "[export]") {
  // `dede ls -l` or a pass may hold the file's log for a moment as its VM
  // shuts down. The close used to flush once, have the batch put back
  // (kLocked) and then drop it with the monitor's buffer: the log kept the
  // block's old fingerprint, with no sign that records were lost.
  LoggedExport t;
  Volume* vol = t.vol.get();
  std::shared_ptr<Export> ex = std::move(t.ex);
  const FileId id = ex->id();
  const std::vector<uint8_t> first = Pattern(kB, 21), second = Pattern(kB, 22);
  REQUIRE(ex->Write(0, first.data(), kB, false).ok());
  REQUIRE(t.flusher->FlushAll().ok());
  REQUIRE(ex->Write(0, second.data(), kB, false).ok());
  // Another process holds the log; it lets go after a moment.
  std::unique_ptr<Volume> other = t.OpenAs(2);
  auto held = OpenWriteLog(other.get(), id);
  REQUIRE(held.ok());
  std::unique_ptr<File> log = std::move(held.value());
  std::thread letgo([&] {
    std::this_thread::sleep_for(300ms);
    log.reset();
  });
  t.table->Release(ex);
  letgo.join();
  ex.reset();
  other.reset();
  auto opened = OpenWriteLog(vol, id);
  REQUIRE(opened.ok());
  auto state = ReplayWriteLog(opened.value().get(), HashAlgo::kXxh128, vol->superblock().uuid, id);
  REQUIRE(state.ok());
  REQUIRE(state->records.count(0) == 1);
  CHECK(state->records.at(0).fp == ComputeFingerprint(HashAlgo::kXxh128, second.data(), kB));
}

TEST_CASE("export: a close waiting for its write log holds up no other export's open", "[export]") {
  // Closing ran under the table's open mutex: a close waiting up to
  // kCloseLogWaitS for a log another process held (then syncing) made
  // every open of every other disk wait too, each on a worker of the pool
  // that serves all disks' I/O. A reopen of the closing disk waits for its
  // close, and then finds it on disk.
  LoggedExport t;
  REQUIRE(t.vol->Create("vm2", kFileBytes).ok());
  std::shared_ptr<Export> ex = std::move(t.ex);
  const FileId id = ex->id();
  const std::vector<uint8_t> data = Pattern(kB, 24);
  REQUIRE(ex->Write(0, data.data(), kB, false).ok());
  REQUIRE(t.flusher->FlushAll().ok());
  REQUIRE(ex->Write(kB, data.data(), kB, false).ok());
  std::unique_ptr<Volume> other = t.OpenAs(2);
  auto held = OpenWriteLog(other.get(), id);
  REQUIRE(held.ok());
  const uint64_t deferred_before = t.flusher->stats().deferred;
  std::thread closer([&] { t.table->Release(ex); });
  // The close is waiting for the log once its flush has been put back.
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (t.flusher->stats().deferred == deferred_before &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(5ms);
  }
  CHECK(t.flusher->stats().deferred > deferred_before);  // (REQUIRE would leave closer joinable)
  const auto t0 = std::chrono::steady_clock::now();
  auto e2 = t.table->Acquire("vm2");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE(e2.ok());
  CHECK(s < 1.0);
  // The same disk again: its open waits for the close.
  std::thread letgo([&] {
    std::this_thread::sleep_for(300ms);
    held.value().reset();
  });
  auto again = t.table->Acquire("vm");
  REQUIRE(again.ok());
  std::vector<uint8_t> back(kB);
  IoBytes out;
  REQUIRE((*again)->Read(kB, kB, &out).ok());
  CHECK(std::vector<uint8_t>(out.begin(), out.end()) == data);
  closer.join();
  letgo.join();
  t.table->Release(*again);
  t.table->Release(*e2);
  ex.reset();
}

TEST_CASE("export: a close does not wait for a write log this process holds", "[export]") {
  // A dedup pass in dedupd holds the logs it consumes until it ends, and
  // hands a borrowed disk back (closing it) meanwhile, on its own thread:
  // waiting for that log would only add kCloseLogWaitS under the table's
  // open mutex.
  LoggedExport t;
  std::shared_ptr<Export> e = std::move(t.ex);
  const FileId id = e->id();
  const std::vector<uint8_t> data = Pattern(kB, 23);
  REQUIRE(e->Write(0, data.data(), kB, false).ok());
  REQUIRE(t.flusher->FlushAll().ok());  // the log exists
  REQUIRE(e->Write(kB, data.data(), kB, false).ok());
  auto held = OpenWriteLog(t.vol.get(), id);  // "the pass", on this thread
  REQUIRE(held.ok());
  const auto t0 = std::chrono::steady_clock::now();
  t.table->Release(e);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s < 1.0);
  CHECK(t.monitor.FileStats(id).buffered_records == 0);  // parked, then gone with the file
  CHECK(t.flusher->parked_files() == 1);
  // The file and its log are removed (`dede rm`) before the next flush
  // interval: the parked changes go, and no log comes back for a file
  // that is gone (appending created it again).
  held.value().reset();
  REQUIRE(t.vol->Remove(WriteLogName(id)).ok());
  REQUIRE(t.vol->Remove("vm").ok());
  REQUIRE(t.flusher->FlushAll().ok());
  CHECK(t.flusher->parked_files() == 0);
  CHECK(t.vol->Lookup(WriteLogName(id)).status().code() == Status::Code::kNotFound);
}

// The case that matters: a pass of this dedupd holds the log, with a young
// record for block 0 it will write back at its end, and gives the disk
// back (its VM moved to another host) after the VM rewrote block 0. The
// close used to drop the rewrite's record with the monitor's buffer; the
// pass then wrote the old record back, and the log said block 0 still held
// the old content, with no mark of anything lost.
TEST_CASE(
    "export: a close while this process's pass holds the log leaves the rewritten blocks "
    "marked changed after the pass's write-back",
    "[export]") {
  LoggedExport t;
  Volume* vol = t.vol.get();
  const Uuid uuid = vol->superblock().uuid;
  std::shared_ptr<Export> e = std::move(t.ex);
  const FileId id = e->id();
  const std::vector<uint8_t> old_data = Pattern(kB, 31), new_data = Pattern(kB, 32);
  REQUIRE(e->Write(0, old_data.data(), kB, false).ok());
  REQUIRE(e->Write(2 * kB, old_data.data(), kB, false).ok());
  REQUIRE(t.flusher->FlushAll().ok());
  // "The pass" takes the log and reads it: the records of blocks 0 and 2
  // are young, so it keeps them to write back.
  auto held = OpenWriteLog(vol, id);
  REQUIRE(held.ok());
  std::unique_ptr<File> log = std::move(held.value());
  auto read = ReplayWriteLog(log.get(), HashAlgo::kXxh128, uuid, id);
  REQUIRE(read.ok());
  REQUIRE(read->records.size() == 2);
  MonitorBatch deferred;
  deferred.file = id;
  for (const auto& [block, rec] : read->records) deferred.records.push_back(rec);
  deferred.first_ns = deferred.records.front().time_ns;
  deferred.last_ns = deferred.records.back().time_ns;
  // The VM rewrites block 0 (and writes block 5), then leaves: the pass
  // hands the disk back.
  REQUIRE(e->Write(0, new_data.data(), kB, false).ok());
  REQUIRE(e->Write(5 * kB, new_data.data(), kB, false).ok());
  t.table->Release(e);
  e.reset();
  // The pass ends: the log is truncated, the young records written back.
  REQUIRE(log->Truncate(0).ok());
  REQUIRE(AppendToOpenWriteLog(vol, log.get(), deferred).ok());
  log.reset();
  // The next flush interval logs the parked changes.
  REQUIRE(t.flusher->FlushAll().ok());
  CHECK(t.flusher->parked_files() == 0);
  auto opened = OpenWriteLog(vol, id);
  REQUIRE(opened.ok());
  auto state = ReplayWriteLog(opened.value().get(), HashAlgo::kXxh128, uuid, id);
  REQUIRE(state.ok());
  // Block 0's old fingerprint no longer stands; block 2's does (unchanged);
  // blocks 0 and 5 are marked changed, for the next pass to rehash.
  CHECK(state->records.count(0) == 0);
  REQUIRE(state->records.count(2) == 1);
  CHECK(state->records.at(2).fp == ComputeFingerprint(HashAlgo::kXxh128, old_data.data(), kB));
  auto changed = [&](uint64_t block) {
    for (const InvalidRange& r : state->invalidated) {
      if (block >= r.first && block < r.first + r.count) return true;
    }
    return false;
  };
  CHECK(changed(0));
  CHECK(changed(5));
  CHECK_FALSE(changed(2));
}

namespace {

// Holds the next acquire of one file's lock (kInode of `ino`) until
// Open(): an open waiting for its lock, as with sanlock for a dead host's
// lease.
class LatchLocks : public test::ForwardingLocks {
 public:
  using ForwardingLocks::ForwardingLocks;
  void Arm(uint64_t ino) {
    ino_ = ino;
    gate_.Arm();
  }
  bool WaitHeld(std::chrono::milliseconds limit) { return gate_.WaitHeld(limit); }
  void Open() { gate_.Open(); }
  Status Acquire(LockId id, LockMode mode, bool wait) override {
    if (id.kind == LockKind::kInode && id.id == ino_) (void)gate_.Pass();
    return ForwardingLocks::Acquire(id, mode, wait);
  }

 private:
  Gate gate_;
  std::atomic<uint64_t> ino_{0};
};

// A volume in memory whose files' locks go through LatchLocks, with
// "slow" (whose next open the latch holds once armed) and `others`.
struct LatchedVolume {
  MemDevice mem{64 << 20};
  std::shared_ptr<LatchLocks> locks;
  std::unique_ptr<Volume> vol;
  uint64_t slow_ino = 0;
  explicit LatchedVolume(const std::vector<std::string>& others = {}) {
    REQUIRE(FormatVolume(&mem, FormatOptions{}, false).ok());
    locks = std::make_shared<LatchLocks>(TempLocks());
    OpenOptions oo;
    oo.locks = locks;
    auto opened = Volume::Open(&mem, oo);
    REQUIRE(opened.ok());
    vol = std::move(opened.value());
    REQUIRE(vol->Create("slow", kFileBytes).ok());
    for (const std::string& n : others) REQUIRE(vol->Create(n, kFileBytes).ok());
    auto slow = vol->Lookup("slow");
    REQUIRE(slow.ok());
    slow_ino = slow->id.ino;
  }
};

}  // namespace

TEST_CASE("export: an open waiting for its file's lock holds up no other export's open",
          "[export]") {
  // Opening ran under the table's open mutex, across the volume's open of
  // the file: with sanlock, an open that waits for a dead host's lease
  // (8 io_timeouts + 60 s) made every other disk's open wait as long. Two
  // clients of the disk being opened still get one export.
  LatchedVolume lv({"vm2"});
  auto& locks = lv.locks;
  ExportTable table(lv.vol.get(), nullptr, nullptr);
  locks->Arm(lv.slow_ino);
  Result<std::shared_ptr<Export>> first = Status::Unavailable("not run"),
                                  second = Status::Unavailable("not run");
  std::thread opener([&] { first = table.Acquire("slow"); });
  REQUIRE(locks->WaitHeld(5s));
  std::thread joiner([&] { second = table.Acquire("slow"); });
  // Whatever happens below, the held open ends in 3 s.
  std::thread letgo([&] {
    std::this_thread::sleep_for(3s);
    locks->Open();
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto other = table.Acquire("vm2");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE(other.ok());
  CHECK(s < 1.0);
  letgo.join();
  opener.join();
  joiner.join();
  REQUIRE(first.ok());
  REQUIRE(second.ok());
  CHECK(first->get() == second->get());
  CHECK(table.StatusOfOpen().size() == 2);
  table.Release(*first);
  CHECK(table.StatusOfOpen().size() == 2);  // the second client still has it
  table.Release(*second);
  table.Release(*other);
  CHECK(table.StatusOfOpen().empty());
}

TEST_CASE("export: clients of a disk whose open is under way hold no thread while they wait",
          "[export]") {
  // A client asking for a disk that this process was opening waited inside
  // the table for that open to end: with sanlock an open can wait minutes
  // for a dead host's lease, and four clients of that disk (a VM's
  // retries, a probe) held every thread of the NBD open pool, every other
  // disk's open queued behind them. A Step for a name being opened here
  // returns at once, to be tried again, whatever the wait allowed for
  // refusals (0 here), and enters the export once the open ends.
  LatchedVolume lv;
  auto& locks = lv.locks;
  ExportTable table(lv.vol.get(), nullptr, nullptr);
  locks->Arm(lv.slow_ino);
  Result<std::shared_ptr<Export>> first = Status::Unavailable("not run");
  std::thread opener([&] { first = table.Acquire("slow"); });
  REQUIRE(locks->WaitHeld(5s));
  std::thread letgo([&] {
    std::this_thread::sleep_for(3s);
    locks->Open();
  });
  ExportTable::OpenWait w(&table, "slow", 0);
  const auto t0 = std::chrono::steady_clock::now();
  Result<std::shared_ptr<Export>> e = w.Step();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s < 1.0);
  CHECK(w.retry());
  CHECK(e.status().code() == Status::Code::kLocked);
  for (int i = 0; i < 100 && w.retry(); i++) {
    std::this_thread::sleep_for(ExportTable::OpenWait::kRetryInterval);
    e = w.Step();
  }
  letgo.join();
  opener.join();
  REQUIRE(first.ok());
  REQUIRE(e.ok());
  CHECK(first->get() == e->get());
  CHECK(table.StatusOfOpen().size() == 1);
  table.Release(*first);
  table.Release(*e);
  CHECK(table.StatusOfOpen().empty());
}

// The NBD spec: ENOTSUP only for WRITE_ZEROES with FAST_ZERO (never
// advertised here; qemu reads it on a discard as "discards unsupported");
// EDQUOT and EFBIG reach clients as ENOSPC.
TEST_CASE("export: volume errors map to the NBD error numbers the spec allows", "[nbd]") {
  CHECK(dede::NbdErrorFor(dede::Status::Ok()) == 0);
  CHECK(dede::NbdErrorFor(dede::Status::NoSpace("full")) == 28);
  CHECK(dede::NbdErrorFor(dede::Status::FromErrno("pwrite", EDQUOT)) == 28);
  CHECK(dede::NbdErrorFor(dede::Status::FromErrno("pwrite", EFBIG)) == 28);
  CHECK(dede::NbdErrorFor(dede::Status::Invalid("beyond the end")) == 22);
  CHECK(dede::NbdErrorFor(dede::Status::Unsupported("inode flags 0x80")) == 5);
  CHECK(dede::NbdErrorFor(dede::Status::IoError("EIO")) == 5);
  CHECK(dede::NbdErrorFor(dede::Status::Corruption("bad crc")) == 5);
}
