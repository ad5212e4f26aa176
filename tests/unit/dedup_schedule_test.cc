// Dedup windows, stop-and-resume, selective sharing and opt-out, with an
// injected clock: the scheduler that dedupd drives (agent/pass_scheduler.h)
// decides when passes run, and real passes run on an in-memory volume.
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "agent/dedup_pass.h"
#include "agent/dedup_policy.h"
#include "agent/dedup_stats_json.h"
#include "agent/io_throttle.h"
#include "agent/pass_scheduler.h"
#include "index/shard_io.h"
#include "index/shard_map.h"
#include "kmod/writemon/write_log.h"
#include "kmod/writemon/write_monitor.h"
#include "tests/dedup_accounting.h"
#include "tests/index_entries.h"
#include "tests/temp_locks.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;

namespace {

constexpr uint64_t kB = kBlockSize;
constexpr uint64_t kMinute = 60'000'000'000ull;
constexpr uint64_t kHour = 60 * kMinute;

// Wall clock set by the test (the windows are wall-clock, host-local);
// monotonic time is real, so shard updates take measurable time (the pass
// splits shards whose last update took longer than its threshold).
class TestClock : public Clock {
 public:
  explicit TestClock(uint64_t wall_ns) : wall_(wall_ns) {}
  uint64_t NowNanos() override { return wall_; }
  uint64_t MonotonicNanos() override {
    return uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) + mono_offset_;
  }
  void Advance(uint64_t ns) {
    wall_ += ns;
    mono_offset_ += ns;
  }
  void Set(uint64_t wall_ns) {
    if (wall_ns > wall_) mono_offset_ += wall_ns - wall_;
    wall_ = wall_ns;
  }

 private:
  uint64_t wall_;
  uint64_t mono_offset_ = 0;
};

// Epoch ns of a local time (mktime: the windows are host-local).
uint64_t LocalTime(int year, int mon, int mday, int hour, int min) {
  std::tm tm{};
  tm.tm_year = year - 1900;
  tm.tm_mon = mon - 1;
  tm.tm_mday = mday;
  tm.tm_hour = hour;
  tm.tm_min = min;
  tm.tm_isdst = -1;
  const time_t t = std::mktime(&tm);
  REQUIRE(t != time_t(-1));
  return uint64_t(t) * 1'000'000'000ull;
}

DedupPolicy WindowPolicy(const std::string& windows) {
  DedupPolicy p;
  auto w = ParseWindowList(windows);
  REQUIRE(w.ok());
  p.windows = *w;
  return p;
}

class Scene {
 public:
  explicit Scene(TestClock* clock) : clock_(clock), dev_(160ull << 20) {
    REQUIRE(FormatVolume(&dev_, FormatOptions{}, false).ok());
    OpenOptions oo;
    oo.locks = dede::test::TempLocks();
    oo.clock = clock;
    auto v = Volume::Open(&dev_, oo);
    REQUIRE(v.ok());
    vol_ = std::move(v.value());
    WriteMonitorOptions mo;
    mo.algo = vol_->superblock().hash_algo;
    mo.clock = clock;
    monitor_ = std::make_unique<WriteMonitor>(mo);
  }

  File* Create(const std::string& name, uint64_t blocks) {
    auto id = vol_->Create(name, blocks * kB);
    REQUIRE(id.ok());
    auto f = vol_->OpenFile(name);
    REQUIRE(f.ok());
    monitor_->AddFile((*f)->id(), true);
    File* raw = f->get();
    files_[name] = std::move(*f);
    return raw;
  }
  File* file(const std::string& name) { return files_.at(name).get(); }

  // Writes blocks through the monitor (as dedupd's export does) at the
  // clock's time, and appends the records to the file's write log.
  void Write(const std::string& name, uint64_t first, const std::vector<uint8_t>& data) {
    File* f = file(name);
    REQUIRE(f->Write(first * kB, data.data(), data.size()).ok());
    monitor_->OnWrite(f->id(), first * kB, data.data(), data.size());
  }
  // `max_log_bytes`: the logs' size limit (write_log.h), 0: none.
  void FlushLogs(uint64_t max_log_bytes = 0) {
    for (auto& [name, f] : files_) {
      MonitorBatch b = monitor_->Take(f->id());
      if (!b.empty()) REQUIRE(AppendToWriteLog(vol_.get(), b, max_log_bytes).ok());
    }
    REQUIRE(vol_->Sync().ok());
  }

  // `wanted`: asked at each of the pass's looks for waiting openers
  // (FileAccess::GiveBackIfWanted); a file it says yes to is closed and
  // leaves the scene until Reopen.
  Result<DedupStats> Pass(DedupOptions o,
                          std::function<bool(const std::string&)> wanted = nullptr) {
    o.clock = clock_;
    HeldFiles access(&files_, std::move(wanted));
    return RunDedupPass(vol_.get(), &access, o);
  }
  void Reopen(const std::string& name) {
    auto f = vol_->OpenFile(name);
    REQUIRE(f.ok());
    files_[name] = std::move(*f);
  }
  bool Has(const std::string& name) const { return files_.count(name) > 0; }

  uint64_t PhysicalDataBlocks() { return test::PhysicalDataBlocks(vol_.get()); }
  uint64_t SharedBlocks(const std::string& name) {
    auto u = file(name)->Usage();
    REQUIRE(u.ok());
    return u->shared_blocks;
  }
  std::vector<uint8_t> ReadAll(const std::string& name, uint64_t blocks) {
    std::vector<uint8_t> out(blocks * kB);
    REQUIRE(file(name)->Read(0, out.data(), out.size()).ok());
    return out;
  }
  uint64_t UniqueEntriesOf(uint64_t ino) { return test::UniqueEntriesOf(vol_.get(), ino); }
  size_t LiveShards() {
    auto map = LoadShardMap(vol_.get());
    REQUIRE(map.ok());
    return map->live.size();
  }
  Volume* vol() { return vol_.get(); }

 private:
  class HeldFiles : public FileAccess {
   public:
    HeldFiles(std::map<std::string, std::unique_ptr<File>>* files,
              std::function<bool(const std::string&)> wanted)
        : files_(files), wanted_(std::move(wanted)) {}
    Result<Handle> Get(const FileInfo& info) override {
      for (auto& [name, f] : *files_) {
        if (f->id() == info.id) return Handle{f.get()};
      }
      return Status::NotFound("not a file of the scene");
    }
    bool GiveBackIfWanted(const FileInfo& info) override {
      for (auto it = files_->begin(); it != files_->end(); ++it) {
        if (!(it->second->id() == info.id)) continue;
        if (!wanted_ || !wanted_(it->first)) return false;
        files_->erase(it);
        return true;
      }
      return false;
    }

   private:
    std::map<std::string, std::unique_ptr<File>>* files_;
    std::function<bool(const std::string&)> wanted_;
  };

  TestClock* clock_;
  MemDevice dev_;
  std::unique_ptr<Volume> vol_;
  std::unique_ptr<WriteMonitor> monitor_;
  std::map<std::string, std::unique_ptr<File>> files_;
};

std::vector<uint8_t> RandomBlocks(uint64_t blocks, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(blocks * kB);
  for (size_t i = 0; i < out.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(out.data() + i, &v, 8);
  }
  return out;
}

}  // namespace

TEST_CASE("a scheduled pass starts at its window's start and stops at its end then resumes in the next window",
          "[schedule]") {
  // Monday 2026-11-23, 00:00 local time, a week of windows "mon 01:00-02:00".
  TestClock clock(LocalTime(2026, 11, 23, 0, 0));
  Scene scene(&clock);
  PassScheduler sched(&clock, PassScheduler::Options{});
  sched.SetPolicy(WindowPolicy("mon 01:00-02:00"));

  // History before the test: an index split into several shards (every
  // update splits its shard), holding only unique seed blocks.
  constexpr uint64_t kSeed = 256;
  scene.Create("seed", kSeed);
  for (int round = 0; round < 8 && scene.LiveShards() < 8; round++) {
    scene.Write("seed", 0, RandomBlocks(kSeed, 1000 + round));
    scene.FlushLogs();
    DedupOptions o;
    o.rewrite_fraction = 0;
    o.split_threshold_ms = 0;
    o.split_min_entries = 1;
    auto st = scene.Pass(o);
    REQUIRE(st.ok());
  }
  REQUIRE(scene.LiveShards() >= 8);
  REQUIRE(scene.SharedBlocks("seed") == 0);

  // Three copies of one disk, written at 00:10.
  constexpr uint64_t kDisk = 2048;
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 7);
  clock.Set(LocalTime(2026, 11, 23, 0, 10));
  for (const char* name : {"vm-a", "vm-b", "vm-c"}) {
    scene.Create(name, kDisk);
    scene.Write(name, 0, disk);
  }
  scene.FlushLogs();
  const uint64_t physical_before = scene.PhysicalDataBlocks();
  REQUIRE(physical_before == kSeed + 3 * kDisk);

  // Before the window: nothing is due, every minute until 01:00.
  for (int m = 10; m < 60; m++) {
    clock.Set(LocalTime(2026, 11, 23, 0, m));
    CHECK_FALSE(sched.InWindow());
    CHECK_FALSE(sched.Due().has_value());
  }

  // 01:00: the window opens and the pass is due at once.
  clock.Set(LocalTime(2026, 11, 23, 1, 0));
  REQUIRE(sched.InWindow());
  std::optional<PassTrigger> due = sched.Due();
  REQUIRE(due.has_value());
  CHECK(*due == PassTrigger::kWindow);
  CHECK(sched.CurrentWindow() == "mon 01:00-02:00");
  sched.PassStarted(*due);

  // Each shard update takes 15 minutes of the window (the clock moves as
  // the pass reports progress; dedupd's timer asks ShouldStop every second).
  std::atomic<bool> stop{false};
  uint64_t shards_seen = 0, stop_checks_true = 0;
  DedupOptions o;
  o.stop = &stop;
  o.progress = [&](const std::string& line) {
    if (line.rfind("index shard ", 0) != 0) return;
    if (line.find("(parking)") == std::string::npos) {
      shards_seen++;
      clock.Advance(15 * kMinute);
    }
    if (sched.ShouldStop()) {
      stop_checks_true++;
      stop = true;
    }
  };
  Result<DedupStats> first = scene.Pass(o);
  REQUIRE(first.ok());
  sched.PassEnded();
  CHECK(first->stopped);
  CHECK(stop_checks_true > 0);
  // It merged shards while the window was open (01:00 .. 02:00: four
  // updates of 15 minutes) and parked the rest.
  CHECK(shards_seen == 4);
  CHECK(first->records_parked_at_stop > 0);
  CHECK(first->shared_new > 0);
  const uint64_t physical_after_first = scene.PhysicalDataBlocks();
  CHECK(physical_after_first < physical_before);
  CHECK(physical_after_first > kSeed + kDisk);  // not all shared yet
  // The logs were consumed: the parked records carry the work over.
  CHECK(first->logs_consumed >= 3);
  CHECK(first->records_parked_at_stop < first->log_records);

  // The rest of the week: nothing is due (hourly ticks), nothing changes.
  for (uint64_t t = LocalTime(2026, 11, 23, 2, 0); t < LocalTime(2026, 11, 30, 1, 0); t += kHour / 2) {
    clock.Set(t);
    CHECK_FALSE(sched.InWindow());
    CHECK_FALSE(sched.Due().has_value());
  }
  CHECK(scene.PhysicalDataBlocks() == physical_after_first);

  // Next Monday 01:00: the next window's pass resumes from the parked records.
  clock.Set(LocalTime(2026, 11, 30, 1, 0));
  due = sched.Due();
  REQUIRE(due.has_value());
  CHECK(*due == PassTrigger::kWindow);
  sched.PassStarted(*due);
  stop = false;
  o.progress = [&](const std::string& line) {
    if (line.rfind("index shard ", 0) == 0) clock.Advance(kMinute);
    if (sched.ShouldStop()) stop = true;
  };
  Result<DedupStats> second = scene.Pass(o);
  REQUIRE(second.ok());
  sched.PassEnded();
  CHECK_FALSE(second->stopped);
  CHECK(second->log_records == 0);  // nothing new was written
  CHECK(second->pending_records_applied > 0);
  // Exact dedup: one copy of the disk plus the seeds.
  CHECK(scene.PhysicalDataBlocks() == kSeed + kDisk);
  CHECK(scene.SharedBlocks("vm-b") == kDisk);
  CHECK(scene.SharedBlocks("vm-c") == kDisk);
  for (const char* name : {"vm-a", "vm-b", "vm-c"}) CHECK(scene.ReadAll(name, kDisk) == disk);
  // Within the window, the next pass waits for the window interval.
  CHECK_FALSE(sched.Due().has_value());
  clock.Advance(11 * kMinute);
  CHECK(sched.Due() == PassTrigger::kWindow);
}

TEST_CASE("requested passes run at any time and only windowed passes are stopped", "[schedule]") {
  TestClock clock(LocalTime(2026, 11, 24, 12, 0));  // Tuesday noon
  PassScheduler::Options so;
  so.interval_s = 0;
  PassScheduler sched(&clock, so);
  sched.SetPolicy(DedupPolicy{});
  // No windows, no interval: only on request.
  CHECK(sched.InWindow());
  CHECK_FALSE(sched.Due().has_value());
  sched.Request(PassTrigger::kNow);
  REQUIRE(sched.Due() == PassTrigger::kNow);
  sched.PassStarted(PassTrigger::kNow);
  CHECK_FALSE(sched.Due().has_value());  // one at a time
  CHECK_FALSE(sched.ShouldStop());
  sched.PassEnded();

  // Windows that do not include Tuesday noon: a requested pass still runs
  // and is not stopped; nothing else is due.
  sched.SetPolicy(WindowPolicy("daily 22:00-04:00"));
  CHECK_FALSE(sched.InWindow());
  CHECK_FALSE(sched.Due().has_value());
  sched.Request(PassTrigger::kSignal);
  REQUIRE(sched.Due() == PassTrigger::kSignal);
  sched.PassStarted(PassTrigger::kSignal);
  CHECK_FALSE(sched.ShouldStop());
  sched.PassEnded();

  // A window crossing midnight: due at 22:00, still open at 03:59 Wednesday,
  // a running window pass told to stop at 04:00.
  clock.Set(LocalTime(2026, 11, 24, 21, 59));
  CHECK_FALSE(sched.Due().has_value());
  clock.Set(LocalTime(2026, 11, 24, 22, 0));
  REQUIRE(sched.Due() == PassTrigger::kWindow);
  sched.PassStarted(PassTrigger::kWindow);
  clock.Set(LocalTime(2026, 11, 25, 3, 59));
  CHECK(sched.InWindow());
  CHECK_FALSE(sched.ShouldStop());
  clock.Set(LocalTime(2026, 11, 25, 4, 0));
  CHECK(sched.ShouldStop());
  sched.PassEnded();
  CHECK_FALSE(sched.Due().has_value());
  auto next = sched.NextChange();
  REQUIRE(next.has_value());
  CHECK(*next == LocalTime(2026, 11, 25, 22, 0));

  // No windows and an interval: a pass every interval after the last one.
  PassScheduler::Options every;
  every.interval_s = 60;
  PassScheduler periodic(&clock, every);
  periodic.SetPolicy(DedupPolicy{});
  CHECK_FALSE(periodic.Due().has_value());
  clock.Advance(59'000'000'000ull);
  CHECK_FALSE(periodic.Due().has_value());
  clock.Advance(1'000'000'000ull);
  REQUIRE(periodic.Due() == PassTrigger::kInterval);
  periodic.PassStarted(PassTrigger::kInterval);
  CHECK_FALSE(periodic.ShouldStop());
  periodic.PassEnded();
  CHECK_FALSE(periodic.Due().has_value());
}

TEST_CASE("without a policy read nothing runs: no scheduled pass, no window, no request",
          "[schedule]") {
  // dedupd could not read the volume's policy (both slots damaged, a newer
  // format): it must not run as if the volume had no windows and no cap.
  TestClock clock(LocalTime(2026, 11, 24, 12, 0));
  PassScheduler::Options every;
  every.interval_s = 60;
  PassScheduler sched(&clock, every);
  CHECK_FALSE(sched.has_policy());
  for (int i = 0; i < 10; i++) {
    clock.Advance(60'000'000'000ull);
    CHECK_FALSE(sched.InWindow());  // merge requests are applied only in a window
    CHECK(sched.CurrentWindow().empty());
    CHECK_FALSE(sched.NextChange().has_value());
    CHECK_FALSE(sched.Due().has_value());
  }
  // `dede dedup --now` and SIGUSR1 are refused, and not kept for later.
  CHECK_FALSE(sched.Request(PassTrigger::kNow));
  CHECK_FALSE(sched.Request(PassTrigger::kSignal));
  CHECK_FALSE(sched.Due().has_value());
  // Once read, the policy rules, and requests are taken.
  sched.SetPolicy(WindowPolicy("daily 12:00-13:00"));
  CHECK(sched.has_policy());
  CHECK(sched.InWindow());
  REQUIRE(sched.Due() == PassTrigger::kWindow);
  sched.PassStarted(PassTrigger::kWindow);
  sched.PassEnded();
  CHECK(sched.Request(PassTrigger::kNow));
  CHECK(sched.Due() == PassTrigger::kNow);
}

TEST_CASE("stable-after keeps young records in their logs until they are old enough", "[schedule]") {
  TestClock clock(LocalTime(2026, 11, 24, 9, 0));
  Scene scene(&clock);
  constexpr uint64_t kDisk = 64;
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 11);
  scene.Create("a", kDisk);
  scene.Create("b", kDisk);
  scene.Write("a", 0, disk);
  scene.Write("b", 0, disk);
  scene.FlushLogs();

  DedupOptions o;
  o.stable_after_ns = kHour;
  clock.Advance(10 * kMinute);
  auto young = scene.Pass(o);
  REQUIRE(young.ok());
  CHECK(young->young_records_deferred == 2 * kDisk);
  CHECK(young->shared_new == 0);
  CHECK(scene.SharedBlocks("b") == 0);

  // A rewrite of a's first half at 09:30 is younger still.
  clock.Advance(20 * kMinute);
  std::vector<uint8_t> half(disk.begin(), disk.begin() + long(kDisk / 2 * kB));
  scene.Write("a", 0, half);
  scene.FlushLogs();

  // 10:05: the records from 09:00 are an hour old, a's rewrite is not.
  clock.Set(LocalTime(2026, 11, 24, 10, 5));
  auto later = scene.Pass(o);
  REQUIRE(later.ok());
  CHECK(later->young_records_deferred == kDisk / 2);
  // b's blocks are shared with a's stable second half only.
  CHECK(scene.SharedBlocks("b") == kDisk / 2);

  // 10:45: everything is stable.
  clock.Set(LocalTime(2026, 11, 24, 10, 45));
  auto last = scene.Pass(o);
  REQUIRE(last.ok());
  CHECK(last->young_records_deferred == 0);
  CHECK(scene.SharedBlocks("b") == kDisk);
  CHECK(scene.ReadAll("a", kDisk) == disk);
  CHECK(scene.ReadAll("b", kDisk) == disk);
}

namespace {

// A write log whose writes fail for want of space (the volume filled up
// while the pass ran): handed to the pass through DedupOptions::borrow_log.
class NoSpaceLog : public File {
 public:
  explicit NoSpaceLog(std::unique_ptr<File> base) : base_(std::move(base)) {}
  FileId id() const override { return base_->id(); }
  Result<FileInfo> Info() override { return base_->Info(); }
  uint64_t size() override { return base_->size(); }
  Status Read(uint64_t offset, void* buf, size_t len) override {
    return base_->Read(offset, buf, len);
  }
  Status Write(uint64_t, const void*, size_t) override {
    return Status::NoSpace("injected: no space for the write log");
  }
  Result<std::unique_ptr<InPlaceWrite>> PrepareInPlaceWrite(uint64_t, size_t) override {
    return std::unique_ptr<InPlaceWrite>();
  }
  Status Trim(uint64_t offset, uint64_t len) override { return base_->Trim(offset, len); }
  Status Truncate(uint64_t size) override { return base_->Truncate(size); }
  Status SetDedup(bool on) override { return base_->SetDedup(on); }
  Status Flush() override { return base_->Flush(); }
  uint64_t cow_copies() override { return base_->cow_copies(); }
  Result<uint32_t> BlockRefCount(uint64_t index) override { return base_->BlockRefCount(index); }
  Result<uint32_t> TryBlockRefCount(uint64_t index) override {
    return base_->TryBlockRefCount(index);
  }
  Status TakeBlockGroup(uint64_t index) override { return base_->TakeBlockGroup(index); }
  Status Punch(uint64_t index) override { return base_->Punch(index); }
  Status TryPunch(uint64_t index) override { return base_->TryPunch(index); }
  Result<FileUsage> Usage() override { return base_->Usage(); }
  Result<bool> WantedElsewhere() override { return base_->WantedElsewhere(); }

 private:
  std::unique_ptr<File> base_;
};

size_t LoggedRecords(Volume* vol, FileId owner) {
  auto log = OpenWriteLog(vol, owner);
  REQUIRE(log.ok());
  auto st = ReplayWriteLog(log->get(), vol->superblock().hash_algo, vol->superblock().uuid, owner);
  REQUIRE(st.ok());
  CHECK(st->stats.corrupt_frames == 0);
  return st->records.size();
}

}  // namespace

TEST_CASE("young records survive a failed write-back into their log and reach the next pass",
          "[schedule]") {
  // At its end a pass put the records too young to use back into each log
  // it consumed: it emptied the log, then appended them. When the append
  // failed (ENOSPC, EIO) they were gone, and nothing marked the log as
  // having dropped records: those blocks were never deduplicated.
  TestClock clock(LocalTime(2026, 11, 24, 9, 0));
  Scene scene(&clock);
  constexpr uint64_t kDisk = 64;
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 17);
  scene.Create("a", kDisk);
  scene.Create("b", kDisk);
  scene.Write("a", 0, disk);
  scene.Write("b", 0, disk);
  scene.FlushLogs();
  const FileId a = scene.file("a")->id(), b = scene.file("b")->id();

  DedupOptions o;
  o.stable_after_ns = kHour;
  o.borrow_log = [&](FileId owner) -> std::unique_ptr<File> {
    auto log = OpenWriteLog(scene.vol(), owner);
    REQUIRE(log.ok());
    return std::make_unique<NoSpaceLog>(std::move(*log));
  };
  clock.Advance(10 * kMinute);
  auto failed = scene.Pass(o);
  REQUIRE_FALSE(failed.ok());
  CHECK(failed.status().code() == Status::Code::kNoSpace);
  REQUIRE(scene.vol()->Sync().ok());  // dedupd's next flush point
  CHECK(LoggedRecords(scene.vol(), a) == kDisk);
  CHECK(LoggedRecords(scene.vol(), b) == kDisk);

  // 10:05: the records are stable, and found.
  clock.Set(LocalTime(2026, 11, 24, 10, 5));
  o.borrow_log = nullptr;
  auto later = scene.Pass(o);
  REQUIRE(later.ok());
  CHECK(later->young_records_deferred == 0);
  CHECK(scene.SharedBlocks("b") == kDisk);
  CHECK(scene.ReadAll("a", kDisk) == disk);
  CHECK(scene.ReadAll("b", kDisk) == disk);
}

TEST_CASE("a log rewritten after a pass holds exactly the deferred records", "[schedule]") {
  // The failure-safe rewrite appends the deferred records, copies them over
  // the log's front and cuts the log after the copy: on success the log is
  // as small as before (the copy at the end is cut away).
  TestClock clock(LocalTime(2026, 11, 24, 9, 0));
  Scene scene(&clock);
  constexpr uint64_t kDisk = 64;
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 19);
  scene.Create("a", kDisk);
  scene.Write("a", 0, disk);
  scene.FlushLogs();
  clock.Advance(30 * kMinute);
  std::vector<uint8_t> quarter(disk.begin(), disk.begin() + long(kDisk / 4 * kB));
  scene.Write("a", 0, quarter);  // young at 10:05
  scene.FlushLogs();
  const FileId a = scene.file("a")->id();
  auto before = scene.vol()->OpenFile(WriteLogName(a));
  REQUIRE(before.ok());
  const uint64_t size_before = (*before)->size();
  before->reset();

  DedupOptions o;
  o.stable_after_ns = kHour;
  clock.Set(LocalTime(2026, 11, 24, 10, 5));
  auto pass = scene.Pass(o);
  REQUIRE(pass.ok());
  CHECK(pass->young_records_deferred == kDisk / 4);
  CHECK(LoggedRecords(scene.vol(), a) == kDisk / 4);
  auto after = scene.vol()->OpenFile(WriteLogName(a));
  REQUIRE(after.ok());
  CHECK((*after)->size() > 0);
  CHECK((*after)->size() < size_before);
}

TEST_CASE("saturated logs are rehashed over several passes when the rehash limit is reached",
          "[schedule]") {
  TestClock clock(LocalTime(2026, 11, 24, 9, 0));
  Scene scene(&clock);
  constexpr uint64_t kDisk = 64;
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 31);
  scene.Create("a", kDisk);
  scene.Create("b", kDisk);
  scene.Write("a", 0, disk);
  scene.Write("b", 0, disk);
  // Any batch is over a 1-byte limit: both logs saturate at once and
  // carry no record, only "every block changed".
  scene.FlushLogs(1);
  clock.Advance(kMinute);

  DedupOptions o;
  o.rehash_limit = 48;
  auto first = scene.Pass(o);
  REQUIRE(first.ok());
  CHECK(first->logs_saturated == 2);
  CHECK(first->log_records == 0);
  CHECK(first->blocks_rehashed == 48);
  // One file's rest and the whole other file wait for the next pass.
  CHECK(first->rehash_ranges_deferred == 2);

  auto second = scene.Pass(o);
  REQUIRE(second.ok());
  CHECK(second->logs_saturated == 0);
  CHECK(second->blocks_rehashed == 48);
  CHECK(second->rehash_ranges_deferred == 1);

  auto third = scene.Pass(o);
  REQUIRE(third.ok());
  CHECK(third->blocks_rehashed == 2 * kDisk - 96);
  CHECK(third->rehash_ranges_deferred == 0);
  CHECK(scene.SharedBlocks("a") == kDisk);
  CHECK(scene.SharedBlocks("b") == kDisk);

  auto fourth = scene.Pass(o);
  REQUIRE(fourth.ok());
  CHECK(fourth->blocks_rehashed == 0);
  CHECK(scene.ReadAll("a", kDisk) == disk);
  CHECK(scene.ReadAll("b", kDisk) == disk);
}

TEST_CASE(
    "a stop during the gathering of logs leaves the rest of the rehash and the unread logs "
    "for the next pass",
    "[schedule]") {
  // stop (a window's end, Ctrl-C of `dede dedup`) was looked at only
  // between index shards: the gathering before them (every log read, a
  // saturated log's rehash of up to 4 GiB at the rate cap) ran to its end
  // after the window had closed.
  TestClock clock(LocalTime(2026, 11, 24, 9, 0));
  Scene scene(&clock);
  constexpr uint64_t kDisk = 256;  // four rehash reads of 64 blocks per file
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 41);
  scene.Create("a", kDisk);
  scene.Create("b", kDisk);
  scene.Write("a", 0, disk);
  scene.Write("b", 0, disk);
  scene.FlushLogs(1);  // saturated: every block is to be rehashed
  clock.Advance(kMinute);

  std::atomic<bool> stop{false};
  int settles = 0;
  DedupOptions o;
  o.stop = &stop;
  // Settled before the first log, after reading it, then after each rehash
  // read: the stop comes after the first read of 64 blocks.
  o.settle_io = [&](const std::function<void()>&) {
    if (++settles == 3) stop = true;
  };
  auto first = scene.Pass(o);
  REQUIRE(first.ok());
  CHECK(first->stopped);
  CHECK(first->blocks_rehashed == 64);
  CHECK(first->logs_consumed == 1);  // the other log was not read
  CHECK(first->rehash_ranges_deferred == 1);

  auto second = scene.Pass(DedupOptions{});
  REQUIRE(second.ok());
  CHECK_FALSE(second->stopped);
  CHECK(first->blocks_rehashed + second->blocks_rehashed == 2 * kDisk);
  CHECK(scene.SharedBlocks("a") == kDisk);
  CHECK(scene.SharedBlocks("b") == kDisk);
  CHECK(scene.ReadAll("a", kDisk) == disk);
  CHECK(scene.ReadAll("b", kDisk) == disk);
}

TEST_CASE("a pass holds at most max_records records and reads the other logs in another round",
          "[schedule]") {
  // Every record of every log was held in memory until one merge at the
  // end (max_records bounded only --rescan): a pass after days of writes
  // could take tens of gigabytes.
  TestClock clock(LocalTime(2026, 11, 24, 9, 0));
  Scene scene(&clock);
  constexpr uint64_t kDisk = 64;
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 51);
  for (const char* name : {"a", "b", "c", "d"}) {
    scene.Create(name, kDisk);
    scene.Write(name, 0, disk);
  }
  scene.FlushLogs();
  clock.Advance(kMinute);
  DedupOptions o;
  o.max_records = kDisk;  // one log per round
  auto st = scene.Pass(o);
  REQUIRE(st.ok());
  CHECK(st->rounds == 4);
  CHECK(st->logs_left_over == 0);
  CHECK(st->log_records == 4 * kDisk);
  CHECK_FALSE(st->stopped);
  CHECK(scene.PhysicalDataBlocks() == kDisk);
  for (const char* name : {"a", "b", "c", "d"}) {
    CHECK(scene.ReadAll(name, kDisk) == disk);
    CHECK(scene.SharedBlocks(name) == kDisk);
  }
  // Nothing is left for the next pass.
  auto again = scene.Pass(DedupOptions{});
  REQUIRE(again.ok());
  CHECK(again->log_records == 0);
  CHECK(again->rounds == 1);
}

TEST_CASE("a log of more than max_records blocks is read in bounded memory and its file rehashed",
          "[schedule]") {
  // max_records was checked only between logs: one log was replayed whole
  // into memory, and a log may describe every block of a big disk (its
  // limit is 3% of the disk: gigabytes of map for a terabyte). Such a log
  // now stands for "every block changed", like a saturated one.
  TestClock clock(LocalTime(2026, 11, 24, 9, 0));
  Scene scene(&clock);
  constexpr uint64_t kDisk = 64;
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 54);
  for (const char* name : {"a", "b"}) {
    scene.Create(name, kDisk);
    scene.Write(name, 0, disk);
  }
  scene.FlushLogs();
  clock.Advance(kMinute);
  DedupOptions o;
  o.max_records = kDisk / 2;  // each log describes twice that
  auto st = scene.Pass(o);
  REQUIRE(st.ok());
  CHECK(st->logs_over_budget == 2);
  CHECK(st->log_records == 0);  // none held
  CHECK(st->blocks_rehashed == 2 * kDisk);
  CHECK(scene.PhysicalDataBlocks() == kDisk);
  for (const char* name : {"a", "b"}) {
    CHECK(scene.ReadAll(name, kDisk) == disk);
    CHECK(scene.SharedBlocks(name) == kDisk);
  }
}

// A --rescan past max_records goes in rounds. They were merges within one
// pass, which had marked every rescanned block "touched" (superseding
// every older hint) for the whole pass: each round took the entries and
// parked records of the rounds before it for stale and dropped them, and
// no block ever shared with a block another round read. Every round is a
// pass of its own now, rescanning from where the previous one stopped.
TEST_CASE("a rescan in several rounds shares blocks read in different rounds", "[schedule]") {
  TestClock clock(LocalTime(2026, 11, 24, 9, 0));
  Scene scene(&clock);
  constexpr uint64_t kDisk = 64;
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 52);
  // No logs: only the rescan sees these blocks.
  scene.Create("a", kDisk);
  scene.Create("b", kDisk);
  REQUIRE(scene.file("a")->Write(0, disk.data(), disk.size()).ok());
  REQUIRE(scene.file("b")->Write(0, disk.data(), disk.size()).ok());
  REQUIRE(scene.vol()->Sync().ok());
  DedupOptions o;
  o.rescan = true;
  o.max_records = kDisk;  // one file per round
  auto st = scene.Pass(o);
  REQUIRE(st.ok());
  CHECK(st->rounds == 2);
  CHECK(st->files_rescanned == 2);
  CHECK(st->blocks_rehashed == 2 * kDisk);
  CHECK(st->shared_new == kDisk);
  CHECK(st->gc_unique_entries == 0);
  CHECK(scene.PhysicalDataBlocks() == kDisk);
  CHECK(scene.SharedBlocks("a") == kDisk);
  CHECK(scene.SharedBlocks("b") == kDisk);
  CHECK(scene.ReadAll("a", kDisk) == disk);
  CHECK(scene.ReadAll("b", kDisk) == disk);

  // A round can stop inside a file: the next one goes on from there.
  const std::vector<uint8_t> half = RandomBlocks(256, 53);
  scene.Create("c", 512);
  REQUIRE(scene.file("c")->Write(0, half.data(), half.size()).ok());
  REQUIRE(scene.file("c")->Write(256 * kB, half.data(), half.size()).ok());
  REQUIRE(scene.vol()->Sync().ok());
  o.max_records = 256;
  auto again = scene.Pass(o);
  REQUIRE(again.ok());
  CHECK(again->blocks_rehashed == 512 + 2 * kDisk);
  CHECK(again->files_rescanned == 3);
  CHECK(again->shared_new == 256);
  CHECK(scene.SharedBlocks("c") == 512);
  CHECK(scene.PhysicalDataBlocks() == kDisk + 256);
}

// Rounds of a pass are summed by DedupStats::Add; a counter it missed
// would vanish from every report of a pass past max_records.
TEST_CASE("DedupStats::Add sums every counter and keeps the shard-lock totals", "[schedule]") {
  DedupStats a, b;
  uint64_t v = 1;
  for (const DedupCounter& c : DedupCounters()) {
    a.*c.field = v;
    b.*c.field = 1000 * v;
    v++;
  }
  std::set<std::string> names;
  for (const DedupCounter& c : DedupCounters()) CHECK(names.insert(c.name).second);
  a.AddShardSpan(10, 15);
  b.AddShardSpan(20, 27);
  b.shard_lock_ns += 100;  // spans past kMaxShardSpans count in the totals only
  b.shard_lock_spans += 3;
  a.gather_ns = 1;
  b.gather_ns = 2;
  b.stopped = true;
  b.logs_left_over = 4;
  a.logs_left_over = 9;
  a.Add(b);
  v = 1;
  for (const DedupCounter& c : DedupCounters()) {
    INFO(c.name);
    CHECK(a.*c.field == 1001 * v);
    v++;
  }
  CHECK(a.shard_lock_ns == 5 + 7 + 100);
  CHECK(a.shard_lock_spans == 1 + 1 + 3);
  REQUIRE(a.shard_spans().size() == 2);
  CHECK(a.shard_spans()[1].start_ns == 20);
  CHECK(a.gather_ns == 3);
  CHECK(a.stopped);
  CHECK(a.logs_left_over == 4);
}

TEST_CASE("DedupStats through JSON: every counter and the times come back", "[schedule]") {
  DedupStats a;
  uint64_t v = 7;
  for (const DedupCounter& c : DedupCounters()) a.*c.field = v++ * 1000003;
  a.rounds = 3;
  a.logs_left_over = 2;
  a.stopped = true;
  a.AddShardSpan(1000, 1500000000);
  a.gather_ns = 250000000;
  a.merge_ns = 750000000;
  a.total_ns = 2000000000;
  const nlohmann::json j = nlohmann::json::parse(DedupStatsToJson(a).dump());
  const DedupStats b = DedupStatsFromJson(j);
  for (const DedupCounter& c : DedupCounters()) {
    INFO(c.name);
    CHECK(b.*c.field == a.*c.field);
  }
  CHECK(b.rounds == 3);
  CHECK(b.logs_left_over == 2);
  CHECK(b.stopped);
  CHECK(b.shard_lock_ns == a.shard_lock_ns);
  CHECK(b.gather_ns == a.gather_ns);
  CHECK(b.merge_ns == a.merge_ns);
  CHECK(b.total_ns == a.total_ns);
  // An older dedupd's reply without some fields, or with the wrong types:
  // zeros, not a throw.
  const DedupStats c =
      DedupStatsFromJson(nlohmann::json{{"shared_new", 5}, {"shared_hits", "x"}, {"seconds", -1}});
  CHECK(c.shared_new == 5);
  CHECK(c.shared_hits == 0);
  CHECK(c.total_ns == 0);
  CHECK(DedupStatsFromJson(nlohmann::json::array()).shared_new == 0);
}

TEST_CASE("a file opted out after the pass listed the files is treated as opted out",
          "[schedule]") {
  // The pass took each file's dedup flag from its listing at the start:
  // `dede set NAME dedup=off` just after it had the file's zero blocks
  // punched, its changed blocks rehashed and index entries made for it.
  TestClock clock(LocalTime(2026, 11, 24, 9, 0));
  Scene scene(&clock);
  constexpr uint64_t kDisk = 16;
  std::vector<uint8_t> data = RandomBlocks(kDisk, 61);
  std::fill(data.begin(), data.begin() + 8 * kB, 0);  // 8 zero blocks
  File* b = scene.Create("b", kDisk);
  scene.Create("a", kDisk);
  scene.Write("a", 0, RandomBlocks(kDisk, 62));
  scene.Write("b", 0, data);
  scene.FlushLogs();
  clock.Advance(kMinute);
  bool switched = false;
  DedupOptions o;
  o.settle_io = [&](const std::function<void()>&) {
    if (!switched) {  // after the listing, before any file is opened
      switched = true;
      REQUIRE(b->SetDedup(false).ok());
    }
  };
  auto st = scene.Pass(o);
  REQUIRE(st.ok());
  REQUIRE(switched);
  CHECK(st->files_dedup_off == 1);
  CHECK(st->zero_blocks_freed == 0);
  CHECK(scene.UniqueEntriesOf(b->id().ino) == 0);
  auto info = b->Info();
  REQUIRE(info.ok());
  CHECK(info->mapped_blocks == kDisk);  // no zero block punched
  CHECK(scene.ReadAll("b", kDisk) == data);
}

TEST_CASE("a dedup=off file is never shared and its index entries go at the next forced pass",
          "[schedule]") {
  TestClock clock(LocalTime(2026, 11, 24, 9, 0));
  Scene scene(&clock);
  constexpr uint64_t kDisk = 64;
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 21);
  File* a = scene.Create("a", kDisk);
  File* b = scene.Create("b", kDisk);
  scene.Write("a", 0, disk);
  scene.FlushLogs();
  auto first = scene.Pass(DedupOptions{});
  REQUIRE(first.ok());
  REQUIRE(scene.UniqueEntriesOf(a->id().ino) == kDisk);

  // a opts out; b then gets a copy of a's content.
  REQUIRE(a->SetDedup(false).ok());
  // The volume itself refuses to share a's blocks, whoever asks.
  REQUIRE(b->Write(0, disk.data(), kB).ok());
  CHECK(scene.vol()->CompareAndShare(a, 0, b, 0, VerifyMode::kByteCompare).code() ==
        Status::Code::kMismatch);
  CHECK(scene.vol()->CompareAndShare(b, 0, a, 0, VerifyMode::kByteCompare).code() ==
        Status::Code::kMismatch);
  CHECK(scene.vol()->CloneBlock(a, 1, b, 1).code() == Status::Code::kMismatch);
  scene.Write("b", 0, disk);
  scene.FlushLogs();
  DedupOptions o;
  o.force = true;  // dedupd forces the pass after an opt-out
  auto second = scene.Pass(o);
  REQUIRE(second.ok());
  CHECK(scene.UniqueEntriesOf(a->id().ino) == 0);
  CHECK(scene.SharedBlocks("a") == 0);
  CHECK(scene.SharedBlocks("b") == 0);
  CHECK(scene.ReadAll("a", kDisk) == disk);
  CHECK(scene.ReadAll("b", kDisk) == disk);
  // Back on: sharing resumes with the next records.
  REQUIRE(a->SetDedup(true).ok());
  scene.Write("a", 0, disk);
  scene.FlushLogs();
  auto third = scene.Pass(DedupOptions{});
  REQUIRE(third.ok());
  CHECK(scene.SharedBlocks("a") == kDisk);
}

TEST_CASE("a throttled pass charges its device I/O and waits for the cap", "[schedule]") {
  TestClock clock(LocalTime(2026, 11, 24, 9, 0));
  Scene scene(&clock);
  constexpr uint64_t kDisk = 512;
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 31);
  scene.Create("a", kDisk);
  scene.Create("b", kDisk);
  scene.Write("a", 0, disk);
  scene.Write("b", 0, disk);
  scene.FlushLogs();
  // The throttle sleeps by moving a manual clock: the time "slept" over
  // the pass is what the cap demands for the bytes it charged.
  ManualClock pace(1);
  uint64_t slept = 0;
  constexpr uint64_t kRate = 4'000'000;  // 4 MB/s
  IoThrottle throttle(kRate, &pace, [&](uint64_t ns) {
    slept += ns;
    pace.Advance(ns);
  });
  DedupOptions o;
  o.io_budget = &throttle;
  o.settle_io = [&](const std::function<void()>& between) { throttle.Settle(between); };
  o.batch_ops = IoThrottle::BatchOpsFor(kRate, o.batch_ops);
  auto st = scene.Pass(o);
  REQUIRE(st.ok());
  CHECK(st->shared_new == kDisk);
  // Every share reads two blocks: at least that much was charged.
  CHECK(throttle.bytes() >= 2 * kDisk * kB);
  const double want = double(throttle.bytes()) / double(kRate) * 1e9;
  // The burst allowance (50 ms) is the only slack.
  CHECK(double(slept) >= want - 0.06e9);
  CHECK(double(slept) <= want + 0.01e9);
  // I/O outside the pass's threads is not charged.
  const uint64_t before = throttle.bytes();
  REQUIRE(scene.file("a")->Write(0, disk.data(), kB).ok());
  CHECK(throttle.bytes() == before);
}

TEST_CASE("a pass gives a borrowed file back to a waiting opener and skips what it planned on it",
          "[schedule]") {
  // Three files with the same content; the pass is throttled, so it looks
  // for waiting openers while it pays for its I/O (the throttle's sleeps
  // move the clock). At its Nth look at b, b's opener is waiting: b goes
  // back mid-pass, and what the pass had planned on b is skipped.
  constexpr uint64_t kDisk = 512;
  constexpr uint64_t kRate = 1'000'000;  // 1 MB/s
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 41);
  struct Run {
    uint64_t looks_at_b = 0;
    Result<DedupStats> st = Status::Ok();
    std::set<uint64_t> busy_parked_shards;
  };
  auto run = [&](TestClock* clock, Scene* scene, uint64_t give_back_at) {
    for (const char* name : {"a", "b", "c"}) {
      scene->Create(name, kDisk);
      scene->Write(name, 0, disk);
    }
    scene->FlushLogs();
    IoThrottle throttle(kRate, clock, [clock](uint64_t ns) { clock->Advance(ns); });
    DedupOptions o;
    o.io_budget = &throttle;
    o.settle_io = [&](const std::function<void()>& between) { throttle.Settle(between); };
    o.batch_ops = IoThrottle::BatchOpsFor(kRate, o.batch_ops);
    Run r;
    o.busy_parked_shards = &r.busy_parked_shards;
    r.st = scene->Pass(o, [&](const std::string& name) {
      return name == "b" && ++r.looks_at_b == give_back_at;
    });
    return r;
  };
  // How often a pass looks at b when nobody waits.
  TestClock clock0(LocalTime(2026, 11, 24, 9, 0));
  Scene quiet(&clock0);
  const Run q = run(&clock0, &quiet, 0);
  REQUIRE(q.st.ok());
  CHECK(q.st->files_given_back == 0);
  CHECK(quiet.PhysicalDataBlocks() == kDisk);
  INFO("looks at b in a pass: " << q.looks_at_b);
  REQUIRE(q.looks_at_b >= 4);  // one a second of throttled I/O, at least

  // b's opener comes early (gathering), half way through and near the end.
  for (const uint64_t at : {uint64_t{2}, q.looks_at_b / 2, q.looks_at_b - 1}) {
    INFO("b's opener waits from the pass's look " << at << " at b");
    TestClock clock(LocalTime(2026, 11, 24, 9, 0));
    Scene scene(&clock);
    const Run r = run(&clock, &scene, at);
    REQUIRE(r.st.ok());
    CHECK(r.st->files_given_back == 1);
    CHECK_FALSE(scene.Has("b"));
    CHECK(r.looks_at_b == at);  // never looked at again
    // What was parked for b is no busy group's: not counted so, and no
    // reason to rewrite a shard at the next pass whatever the fraction.
    CHECK(r.st->records_parked_busy == 0);
    CHECK(r.busy_parked_shards.empty());
    // a and c are shared all the same; b where the pass got to before it
    // went back, or through merge requests for what its entries named.
    scene.Reopen("b");
    CHECK(scene.SharedBlocks("a") == kDisk);
    CHECK(scene.SharedBlocks("c") == kDisk);
    const uint64_t b_shared = scene.SharedBlocks("b");
    for (const char* name : {"a", "b", "c"}) {
      INFO(name);
      CHECK(scene.ReadAll(name, kDisk) == disk);
    }
    std::printf("give-back at look %llu of %llu: %llu of b's %llu blocks shared, %llu merge "
                "requests posted, %llu records parked, %llu busy\n",
                (unsigned long long)at, (unsigned long long)q.looks_at_b,
                (unsigned long long)b_shared, (unsigned long long)kDisk,
                (unsigned long long)r.st->merge_requests_posted,
                (unsigned long long)r.st->records_parked_busy,
                (unsigned long long)r.st->busy_targets);
    // The next pass, with b held again, applies the merge requests and the
    // parked records (or b's log, if b went back before it was read):
    // nothing the give-back left undone is lost.
    auto again = scene.Pass(DedupOptions{});
    REQUIRE(again.ok());
    CHECK(scene.SharedBlocks("b") == kDisk);
    CHECK(scene.PhysicalDataBlocks() == kDisk);
    for (const char* name : {"a", "b", "c"}) {
      INFO(name);
      CHECK(scene.ReadAll(name, kDisk) == disk);
    }
  }
}

// A stop (Ctrl-C, a window's end) was seen between files only: a rescan of
// a big disk went on reading it to its end, minutes for terabytes.
TEST_CASE("a rescan sees a stop between runs of blocks, not only between files", "[schedule]") {
  TestClock clock(LocalTime(2026, 11, 24, 9, 0));
  Scene scene(&clock);
  constexpr uint64_t kDisk = 2048;  // eight runs of 256 blocks
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 55);
  scene.Create("big", kDisk);
  REQUIRE(scene.file("big")->Write(0, disk.data(), disk.size()).ok());
  REQUIRE(scene.vol()->Sync().ok());
  std::atomic<bool> stop{false};
  DedupOptions o;
  o.rescan = true;
  o.stop = &stop;
  int settles = 0;
  o.settle_io = [&](const std::function<void()>& between) {
    if (between) between();
    if (++settles == 2) stop = true;  // after the second run of the rescan
  };
  auto st = scene.Pass(o);
  REQUIRE(st.ok());
  CHECK(st->stopped);
  CHECK(st->files_rescanned == 0);
  CHECK(st->blocks_rehashed < kDisk);
  CHECK(st->blocks_rehashed >= 256);
  CHECK(scene.ReadAll("big", kDisk) == disk);
}

// With --window-interval 0, a pass that failed at once was started again
// at the next one-second tick, for as long as the window lasted: a hot
// failure loop. Failed passes back off, doubling, capped; a pass that does
// not fail ends the backoff; a requested pass is never held back.
TEST_CASE("failed passes back off, doubling up to a cap, until one succeeds", "[schedule]") {
  TestClock clock(LocalTime(2026, 11, 24, 12, 0));  // Tuesday noon
  PassScheduler::Options so;
  so.window_interval_s = 0;
  so.failure_backoff_s = 2;
  so.max_failure_backoff_s = 16;
  PassScheduler sched(&clock, so);
  sched.SetPolicy(WindowPolicy("daily 00:00-24:00"));
  constexpr uint64_t kSec = 1'000'000'000ull;
  REQUIRE(sched.Due() == PassTrigger::kWindow);
  // Fails: due again only after 2, 4, 8, 16, 16 s.
  for (double backoff : {2.0, 4.0, 8.0, 16.0, 16.0}) {
    sched.PassStarted(PassTrigger::kWindow);
    sched.PassEnded(PassScheduler::Outcome::kFailed);
    CHECK(sched.failure_backoff_s() == backoff);
    INFO("backoff " << backoff << " s after " << sched.failures_in_a_row() << " failures");
    for (int tick = 1; tick < backoff; tick++) {
      clock.Advance(kSec);
      CHECK_FALSE(sched.Due().has_value());
    }
    clock.Advance(kSec);
    REQUIRE(sched.Due() == PassTrigger::kWindow);
  }
  CHECK(sched.failures_in_a_row() == 5);
  // An administrator's pass is not held back by the backoff.
  sched.PassStarted(PassTrigger::kWindow);
  sched.PassEnded(PassScheduler::Outcome::kFailed);
  CHECK_FALSE(sched.Due().has_value());
  REQUIRE(sched.Request(PassTrigger::kNow));
  REQUIRE(sched.Due() == PassTrigger::kNow);
  sched.PassStarted(PassTrigger::kNow);
  // It succeeds: back to back again, at the next tick.
  sched.PassEnded(PassScheduler::Outcome::kSucceeded);
  CHECK(sched.failures_in_a_row() == 0);
  CHECK(sched.failure_backoff_s() == 0);
  CHECK(sched.Due() == PassTrigger::kWindow);

  // Without windows, the backoff stretches --dedup-interval only when it
  // is the longer wait.
  PassScheduler::Options every;
  every.interval_s = 5;
  every.failure_backoff_s = 2;
  every.max_failure_backoff_s = 300;
  PassScheduler periodic(&clock, every);
  periodic.SetPolicy(DedupPolicy{});
  clock.Advance(5 * kSec);
  REQUIRE(periodic.Due() == PassTrigger::kInterval);
  periodic.PassStarted(PassTrigger::kInterval);
  periodic.PassEnded(PassScheduler::Outcome::kFailed);  // 2 s: the interval rules
  clock.Advance(4 * kSec);
  CHECK_FALSE(periodic.Due().has_value());
  clock.Advance(kSec);
  REQUIRE(periodic.Due() == PassTrigger::kInterval);
  for (int i = 0; i < 2; i++) {  // 4 s, then 8 s
    periodic.PassStarted(PassTrigger::kInterval);
    periodic.PassEnded(PassScheduler::Outcome::kFailed);
  }
  CHECK(periodic.failure_backoff_s() == 8);
  clock.Advance(7 * kSec);
  CHECK_FALSE(periodic.Due().has_value());
  clock.Advance(kSec);
  CHECK(periodic.Due() == PassTrigger::kInterval);
}

// A shard an earlier pass asked to see again (an arena punch held back
// leaves neither records nor a pending file for it) is rewritten by the
// next pass even with nothing new for it; one nobody asked for is not.
TEST_CASE("a pass rewrites a shard named in busy_parked_shards with nothing new for it",
          "[schedule]") {
  constexpr uint64_t kDisk = 64;
  const std::vector<uint8_t> disk = RandomBlocks(kDisk, 43);
  TestClock clock(LocalTime(2026, 11, 24, 9, 0));
  Scene scene(&clock);
  for (const char* name : {"a", "b"}) {
    scene.Create(name, kDisk);
    scene.Write(name, 0, disk);
  }
  scene.FlushLogs();
  std::set<uint64_t> asked;
  DedupOptions o;
  o.busy_parked_shards = &asked;
  auto first = scene.Pass(o);
  REQUIRE(first.ok());
  REQUIRE(first->shards_rewritten >= 1);
  REQUIRE(scene.LiveShards() == 1);
  CHECK(asked.empty());
  // Nothing new: the shard is left alone.
  auto quiet = scene.Pass(o);
  REQUIRE(quiet.ok());
  CHECK(quiet->shards_rewritten == 0);
  // Asked back (the one shard's range starts at 0): rewritten, and the
  // request is settled.
  asked.insert(0);
  auto asked_back = scene.Pass(o);
  REQUIRE(asked_back.ok());
  CHECK(asked_back->shards_rewritten == 1);
  CHECK(asked.empty());
  CHECK(scene.SharedBlocks("a") == kDisk);
  CHECK(scene.ReadAll("b", kDisk) == disk);
}
