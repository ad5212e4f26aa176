// Tests for the write monitor (kmod/writemon/write_monitor.h): which blocks
// get fingerprinted, coalescing and invalidation, dedup=off, the memory cap
// and shedding, flush sizing, PutBack, and a randomized comparison with a
// plain model of "what the write log should say".
#include "kmod/writemon/write_monitor.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "kmod/writemon/write_log.h"
#include "tests/random_bytes.h"
#include "tests/sanitized.h"
#include "volume/format.h"

using namespace dede;

namespace {

constexpr uint64_t kB = kBlockSize;
constexpr uint64_t kMs = 1'000'000;
const FileId kF{7, 3};
const FileId kG{8, 1};

std::vector<uint8_t> Data(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n + 4);
  std::mt19937 r(seed);
  for (size_t i = 0; i < n; i += 4) {
    const uint32_t x = r();
    std::memcpy(v.data() + i, &x, 4);
  }
  v.resize(n);
  return v;
}

Fingerprint Fp(HashAlgo algo, const uint8_t* block) { return ComputeFingerprint(algo, block, kB); }

WriteMonitorOptions Opts(ManualClock* clock, HashAlgo algo = HashAlgo::kXxh128) {
  WriteMonitorOptions o;
  o.algo = algo;
  o.clock = clock;
  return o;
}

// Blocks of a batch's invalidated ranges, expanded (small ranges only).
std::set<uint64_t> InvalidBlocks(const MonitorBatch& b) {
  std::set<uint64_t> s;
  for (const InvalidRange& r : b.invalidated) {
    for (uint64_t i = 0; i < r.count; i++) s.insert(r.first + i);
  }
  return s;
}

std::map<uint64_t, Fingerprint> Records(const MonitorBatch& b) {
  std::map<uint64_t, Fingerprint> m;
  for (const BlockRecord& r : b.records) m[r.block] = r.fp;
  return m;
}

// The batch invariants of MonitorBatch.
void CheckBatchShape(const MonitorBatch& b) {
  for (size_t i = 1; i < b.records.size(); i++) REQUIRE(b.records[i - 1].block < b.records[i].block);
  for (size_t i = 0; i < b.invalidated.size(); i++) {
    REQUIRE(b.invalidated[i].count > 0);
    if (i > 0) {
      REQUIRE(b.invalidated[i - 1].first + b.invalidated[i - 1].count < b.invalidated[i].first);
    }
  }
  size_t ri = 0;
  for (const BlockRecord& r : b.records) {
    while (ri < b.invalidated.size() && b.invalidated[ri].first + b.invalidated[ri].count <= r.block) {
      ri++;
    }
    REQUIRE((ri == b.invalidated.size() || b.invalidated[ri].first > r.block));
  }
}

// Applies a batch the way ReplayWriteLog applies a frame.
void ApplyToLog(std::map<uint64_t, Fingerprint>* log, const MonitorBatch& b) {
  for (const InvalidRange& r : b.invalidated) {
    auto it = log->lower_bound(r.first);
    while (it != log->end() && it->first < r.first + r.count) it = log->erase(it);
  }
  for (const BlockRecord& r : b.records) (*log)[r.block] = r.fp;
}

}  // namespace

TEST_CASE("writemon: only whole aligned blocks are fingerprinted", "[writemon]") {
  for (HashAlgo algo : {HashAlgo::kXxh128, HashAlgo::kSha256}) {
    ManualClock clock;
    WriteMonitor m(Opts(&clock, algo));
    m.AddFile(kF, true);
    std::vector<uint8_t> d = Data(3 * kB, 1);
    m.OnWrite(kF, 2 * kB, d.data(), d.size());
    // Unaligned: whole blocks 11 and 12, partial 10 and 13.
    std::vector<uint8_t> u = Data(3 * kB, 2);
    m.OnWrite(kF, 10 * kB + 100, u.data(), u.size());
    // Inside one block; and across one boundary with no whole block.
    m.OnWrite(kF, 20 * kB + 5, u.data(), 10);
    m.OnWrite(kF, 30 * kB + 4000, u.data(), 200);
    // Ends exactly on a boundary, starts mid-block.
    m.OnWrite(kF, 40 * kB + 1, u.data(), 2 * kB - 1);

    MonitorFileStats fs = m.FileStats(kF);
    CHECK(fs.hashed_blocks == 3 + 2 + 1);
    MonitorBatch b = m.Take(kF);
    CheckBatchShape(b);
    auto recs = Records(b);
    REQUIRE(recs.size() == 6);
    for (uint64_t i = 0; i < 3; i++) CHECK(recs.at(2 + i) == Fp(algo, d.data() + i * kB));
    CHECK(recs.at(11) == Fp(algo, u.data() + kB - 100));
    CHECK(recs.at(12) == Fp(algo, u.data() + 2 * kB - 100));
    CHECK(recs.at(41) == Fp(algo, u.data() + kB - 1));
    CHECK(recs.at(2).size == HashAlgoSize(algo));
    CHECK(InvalidBlocks(b) == std::set<uint64_t>{10, 13, 20, 30, 31, 40});
    CHECK(b.first_ns == clock.NowNanos());
    CHECK(b.last_ns == clock.NowNanos());
    for (const BlockRecord& r : b.records) CHECK(r.time_ns == clock.NowNanos());
    // Taken: nothing left.
    CHECK(m.Take(kF).empty());
    CHECK(m.FileStats(kF).buffered_records == 0);
    CHECK(m.Stats().buffered_bytes == 0);
  }
}

TEST_CASE("writemon: fingerprints hashed ahead are the ones OnWrite would compute, and used",
          "[writemon]") {
  for (HashAlgo algo : {HashAlgo::kXxh128, HashAlgo::kSha256}) {
    ManualClock clock;
    WriteMonitor m(Opts(&clock, algo));
    m.AddFile(kF, true);
    // Unaligned: whole blocks 11 and 12, partial 10 and 13.
    std::vector<uint8_t> u = Data(3 * kB, 3);
    const std::vector<Fingerprint> ahead = m.FingerprintWrite(10 * kB + 100, u.data(), u.size());
    REQUIRE(ahead.size() == 2);
    CHECK(ahead[0] == Fp(algo, u.data() + kB - 100));
    CHECK(ahead[1] == Fp(algo, u.data() + 2 * kB - 100));
    CHECK(m.FingerprintWrite(20 * kB + 5, u.data(), 10).empty());  // no whole block
    CHECK(m.FingerprintWrite(0, u.data(), 0).empty());

    // Given to OnWrite, they are what it records (here deliberately not
    // the data's, to see that they are used and the data not hashed again).
    std::vector<std::vector<uint8_t>> other = {Data(kB, 7), Data(kB, 8)};
    const std::vector<Fingerprint> given = {Fp(algo, other[0].data()), Fp(algo, other[1].data())};
    m.OnWrite(kF, 10 * kB + 100, u.data(), u.size(), &given);
    // The wrong count for the write: ignored, the data is hashed.
    const std::vector<Fingerprint> wrong = {given[0]};
    m.OnWrite(kF, 30 * kB, u.data(), 2 * kB, &wrong);
    CHECK(m.FileStats(kF).hashed_blocks == 4);
    MonitorBatch b = m.Take(kF);
    auto recs = Records(b);
    REQUIRE(recs.size() == 4);
    CHECK(recs.at(11) == given[0]);
    CHECK(recs.at(12) == given[1]);
    CHECK(recs.at(30) == Fp(algo, u.data()));
    CHECK(recs.at(31) == Fp(algo, u.data() + kB));
    CHECK(InvalidBlocks(b) == std::set<uint64_t>{10, 13});
  }
}

TEST_CASE("writemon: rewrites coalesce, latest wins", "[writemon]") {
  ManualClock clock;
  WriteMonitor m(Opts(&clock));
  m.AddFile(kF, true);
  std::vector<uint8_t> a = Data(4 * kB, 1), b = Data(kB, 2), c = Data(kB, 3);
  m.OnWrite(kF, 0, a.data(), a.size());
  clock.Advance(5 * kMs);
  m.OnWrite(kF, kB, b.data(), kB);
  clock.Advance(5 * kMs);
  m.OnWrite(kF, kB, c.data(), kB);
  MonitorBatch batch = m.Take(kF);
  CheckBatchShape(batch);
  REQUIRE(batch.records.size() == 4);
  CHECK(batch.invalidated.empty());
  CHECK(batch.records[1].block == 1);
  CHECK(batch.records[1].fp == Fp(HashAlgo::kXxh128, c.data()));
  CHECK(batch.records[1].time_ns == clock.NowNanos());
  CHECK(batch.records[0].fp == Fp(HashAlgo::kXxh128, a.data()));
  CHECK(batch.first_ns == clock.NowNanos() - 10 * kMs);
  CHECK(batch.last_ns == clock.NowNanos());
}

TEST_CASE("writemon: a write's records keep its time, next to other writes and after coalescing",
          "[writemon]") {
  // Each record carries the time of its own write, whether the writes
  // come in order or not, and whether Take orders them or a coalesce did.
  ManualClock clock;
  const std::vector<uint8_t> a = Data(64 * kB, 1);
  const uint64_t t0 = clock.NowNanos();
  // Blocks 0-15 at t0, 16-31 at t0 + 3 ms (next to the first), then out
  // of order: 48-63 at t0 + 6 ms, 32-47 at t0 + 9 ms.
  auto write = [&](WriteMonitor& m) {
    clock = ManualClock(t0);
    m.AddFile(kF, true);
    for (uint64_t first : {0, 16, 48, 32}) {
      m.OnWrite(kF, first * kB, a.data() + first * kB, 16 * kB);
      clock.Advance(3 * kMs);
    }
  };
  auto check = [&](const MonitorBatch& b) {
    REQUIRE(b.records.size() == 64);
    for (const BlockRecord& r : b.records) {
      const uint64_t expect = t0 + (r.block < 16 ? 0 : r.block < 32 ? 3 : r.block < 48 ? 9 : 6) * kMs;
      INFO("block " << r.block);
      CHECK(r.time_ns == expect);
      CHECK(r.fp == Fp(HashAlgo::kXxh128, a.data() + r.block * kB));
    }
    CHECK(b.first_ns == t0);
    CHECK(b.last_ns == t0 + 9 * kMs);
  };
  WriteMonitor m(Opts(&clock));
  write(m);
  check(m.Take(kF));
  // The same through an in-place coalesce (DueFiles with a small flush size).
  WriteMonitorOptions o = Opts(&clock);
  o.flush_bytes = 1;
  WriteMonitor small(o);
  write(small);
  CHECK(small.DueFiles(false) == std::vector<FileId>{kF});
  check(small.Take(kF));
}

TEST_CASE("writemon: a partial write drops the record and invalidates", "[writemon]") {
  ManualClock clock;
  WriteMonitor m(Opts(&clock));
  m.AddFile(kF, true);
  std::vector<uint8_t> a = Data(3 * kB, 1);
  m.OnWrite(kF, 0, a.data(), a.size());
  m.OnWrite(kF, kB + 512, a.data(), 512);
  MonitorBatch b = m.Take(kF);
  CheckBatchShape(b);
  CHECK(Records(b).count(1) == 0);
  CHECK(Records(b).size() == 2);
  REQUIRE(b.invalidated.size() == 1);
  CHECK(b.invalidated[0].first == 1);
  CHECK(b.invalidated[0].count == 1);

  // A whole write after the partial one brings the record back and the
  // invalidation goes (the record cancels an older log record anyway).
  m.OnWrite(kF, kB + 512, a.data(), 512);
  m.OnWrite(kF, kB, a.data(), kB);
  b = m.Take(kF);
  CheckBatchShape(b);
  CHECK(b.invalidated.empty());
  CHECK(Records(b).at(1) == Fp(HashAlgo::kXxh128, a.data()));
}

TEST_CASE("writemon: TRIM and WRITE_ZEROES drop the records they touch", "[writemon]") {
  ManualClock clock;
  WriteMonitor m(Opts(&clock));
  m.AddFile(kF, true);
  std::vector<uint8_t> a = Data(10 * kB, 1);
  m.OnWrite(kF, 0, a.data(), a.size());
  clock.Advance(kMs);
  m.OnInvalidate(kF, 2 * kB + 1, 3 * kB);  // touches blocks 2..5
  m.OnInvalidate(kF, 8 * kB, kB);          // exactly block 8
  m.OnInvalidate(kF, 9 * kB, 0);           // nothing
  MonitorBatch b = m.Take(kF);
  CheckBatchShape(b);
  std::set<uint64_t> keys;
  for (const auto& [k, v] : Records(b)) keys.insert(k);
  CHECK(keys == std::set<uint64_t>{0, 1, 6, 7, 9});
  REQUIRE(b.invalidated.size() == 2);
  CHECK(b.invalidated[0].first == 2);
  CHECK(b.invalidated[0].count == 4);
  CHECK(b.invalidated[0].time_ns == clock.NowNanos());
  CHECK(b.invalidated[1].first == 8);
  CHECK(b.invalidated[1].count == 1);

  // Adjacent and overlapping invalidations merge into one range.
  m.OnInvalidate(kF, 0, kB);
  m.OnInvalidate(kF, kB, kB);
  m.OnInvalidate(kF, 5 * kB, 10 * kB);
  m.OnInvalidate(kF, kB, 6 * kB);
  b = m.Take(kF);
  REQUIRE(b.invalidated.size() == 1);
  CHECK(b.invalidated[0].first == 0);
  CHECK(b.invalidated[0].count == 15);
}

TEST_CASE("writemon: dedup=off files are not hashed, SetDedup off discards", "[writemon]") {
  ManualClock clock;
  WriteMonitor m(Opts(&clock));
  m.AddFile(kF, false);
  m.AddFile(kG, true);
  CHECK_FALSE(m.Recording(kF));
  CHECK(m.Recording(kG));
  std::vector<uint8_t> a = Data(4 * kB, 1);
  m.OnWrite(kF, 0, a.data(), a.size());
  m.OnInvalidate(kF, 0, kB);
  CHECK(m.FileStats(kF).hashed_blocks == 0);
  CHECK(m.FileStats(kF).dedup == false);
  CHECK(m.Take(kF).empty());

  m.OnWrite(kG, 0, a.data(), a.size());
  CHECK(m.FileStats(kG).buffered_records == 4);
  CHECK(m.Stats().buffered_bytes > 0);
  m.SetDedup(kG, false);
  CHECK_FALSE(m.Recording(kG));
  CHECK(m.FileStats(kG).buffered_records == 0);
  CHECK(m.Stats().buffered_bytes == 0);
  m.OnWrite(kG, 0, a.data(), a.size());
  CHECK(m.Take(kG).empty());
  CHECK(m.DueFiles(true).empty());

  m.SetDedup(kG, true);
  m.OnWrite(kG, kB, a.data(), kB);
  CHECK(Records(m.Take(kG)).size() == 1);

  // Files never added are ignored; removed files too.
  m.OnWrite(FileId{99, 1}, 0, a.data(), a.size());
  CHECK(m.Take(FileId{99, 1}).empty());
  m.OnWrite(kG, 0, a.data(), a.size());
  m.RemoveFile(kG);
  CHECK_FALSE(m.Recording(kG));
  CHECK(m.Stats().buffered_bytes == 0);
  CHECK(m.Stats().files == 1);
  m.OnWrite(kG, 0, a.data(), a.size());
  CHECK(m.Take(kG).empty());
}

TEST_CASE("writemon: a file's handle records like its id, and after RemoveFile finds the file anew",
          "[writemon]") {
  ManualClock clock;
  WriteMonitor m(Opts(&clock));
  const std::vector<uint8_t> a = Data(4 * kB, 1), b = Data(2 * kB, 2);
  WriteMonitor::FileHandle h = m.AddFile(kF, true);
  CHECK(h.id() == kF);
  CHECK(m.Recording(h));
  m.OnWrite(h, 0, a.data(), a.size());
  m.OnInvalidate(h, kB, kB);
  MonitorBatch first = m.Take(kF);
  CHECK(Records(first).size() == 3);
  CHECK(InvalidBlocks(first) == std::set<uint64_t>{1});

  // Adding the file again (dedup changes) keeps the same buffer.
  WriteMonitor::FileHandle again = m.AddFile(kF, false);
  CHECK_FALSE(m.Recording(h));
  m.OnWrite(h, 0, a.data(), a.size());
  CHECK(m.FileStats(kF).hashed_blocks == 4);  // the first write's only
  m.AddFile(kF, true);
  CHECK(m.Recording(again));

  // Removed: the handle records nothing and says so.
  m.RemoveFile(kF);
  CHECK_FALSE(m.Recording(h));
  m.OnWrite(h, 0, a.data(), a.size());
  CHECK(m.Take(kF).empty());
  CHECK(m.Stats().buffered_bytes == 0);

  // Added anew (a new buffer): the old handle's writes reach it, not the
  // removed buffer it still holds.
  m.AddFile(kF, true);
  CHECK(m.Recording(h));
  m.OnWrite(h, 8 * kB, b.data(), b.size());
  m.OnInvalidate(again, 8 * kB, kB);
  MonitorBatch second = m.Take(kF);
  CHECK(Records(second) == std::map<uint64_t, Fingerprint>{{9, Fp(HashAlgo::kXxh128, b.data() + kB)}});
  CHECK(InvalidBlocks(second) == std::set<uint64_t>{8});

  // A handle of a file never added is ignored.
  WriteMonitor::FileHandle none(FileId{99, 1});
  CHECK_FALSE(m.Recording(none));
  m.OnWrite(none, 0, a.data(), a.size());
  CHECK(m.Take(FileId{99, 1}).empty());
}

TEST_CASE("writemon: a file whose log is full is not hashed until a pass takes the log",
          "[writemon]") {
  ManualClock clock;
  WriteMonitor m(Opts(&clock));
  CHECK_FALSE(m.Recording(kF));  // not monitored
  m.AddFile(kF, true);
  m.AddFile(kG, true);
  CHECK(m.Recording(kF));
  std::vector<uint8_t> a = Data(8 * kB, 2);
  m.OnWrite(kF, 0, a.data(), 4 * kB);
  MonitorBatch first = m.Take(kF);
  REQUIRE(first.records.size() == 4);
  m.OnWrite(kF, 4 * kB, a.data(), 2 * kB);
  REQUIRE(m.FileStats(kF).buffered_records == 2);
  // The flusher found the log full when it appended `first`: the buffer
  // goes, and later writes are neither hashed nor buffered.
  m.PauseForFullLog(kF, first.log_epoch);
  CHECK(m.FileStats(kF).log_full);
  CHECK_FALSE(m.Recording(kF));  // dedupd does not hash its payloads ahead
  CHECK(m.Recording(kG));
  CHECK(m.FileStats(kF).buffered_records == 0);
  CHECK(m.Stats().buffered_bytes == 0);
  CHECK(m.Stats().log_full_files == 1);
  const uint64_t hashed = m.FileStats(kF).hashed_blocks;
  m.OnWrite(kF, kB / 2, a.data(), 3 * kB);  // two whole blocks, two partial
  m.OnInvalidate(kF, 0, kB);
  CHECK(m.FileStats(kF).hashed_blocks == hashed);
  CHECK(m.FileStats(kF).unrecorded_blocks == 2);
  CHECK(m.Stats().unrecorded_blocks == 2);
  CHECK(m.Take(kF).empty());
  CHECK(m.DueFiles(true).empty());
  // Another file is not affected.
  m.OnWrite(kG, 0, a.data(), kB);
  CHECK(Records(m.Take(kG)).size() == 1);

  // A pass takes the log: what is written from then on is recorded again.
  m.LogTaken(kF);
  CHECK_FALSE(m.FileStats(kF).log_full);
  CHECK(m.Recording(kF));
  CHECK(m.Stats().log_full_files == 0);
  m.OnWrite(kF, 2 * kB, a.data() + 2 * kB, 2 * kB);
  MonitorBatch after = m.Take(kF);
  CHECK(after.log_epoch == first.log_epoch + 1);
  const auto recs = Records(after);
  REQUIRE(recs.size() == 2);
  CHECK(recs.at(2) == Fp(HashAlgo::kXxh128, a.data() + 2 * kB));
  CHECK(recs.at(3) == Fp(HashAlgo::kXxh128, a.data() + 3 * kB));

  SECTION("a pause for a batch taken before the pass took the log is ignored") {
    // The flusher took `stale`, the pass took (and emptied) the log, then
    // the flusher's append found the log full: that says nothing about
    // the log the pass left.
    m.OnWrite(kF, 0, a.data(), kB);
    MonitorBatch stale = m.Take(kF);
    m.LogTaken(kF);
    m.PauseForFullLog(kF, stale.log_epoch);
    CHECK_FALSE(m.FileStats(kF).log_full);
    m.OnWrite(kF, 0, a.data(), kB);
    CHECK(Records(m.Take(kF)).size() == 1);
  }
  SECTION("a put-back batch is not kept while paused") {
    m.OnWrite(kF, 0, a.data(), kB);
    MonitorBatch b = m.Take(kF);
    m.PauseForFullLog(kF, b.log_epoch);
    m.PutBack(std::move(b));
    CHECK(m.Take(kF).empty());
  }
  SECTION("removing and adding the file again starts unpaused") {
    m.PauseForFullLog(kF, after.log_epoch);
    REQUIRE(m.FileStats(kF).log_full);
    m.RemoveFile(kF);
    m.AddFile(kF, true);
    m.OnWrite(kF, 0, a.data(), kB);
    CHECK(Records(m.Take(kF)).size() == 1);
  }
}

namespace {

// A clock that runs `hook` once, the next time the monitor reads it. The
// write path reads the clock after its full-log check and before it
// hashes and appends, so the hook lands a pause exactly in that window.
class HookClock : public Clock {
 public:
  uint64_t NowNanos() override {
    std::function<void()> h = std::move(hook);
    hook = nullptr;
    if (h) h();
    return now;
  }
  uint64_t MonotonicNanos() override { return now; }
  std::function<void()> hook;
  uint64_t now = 1'000'000'000;
};

}  // namespace

TEST_CASE("writemon: blocks hashed as their file is paused for a full log count as unrecorded",
          "[writemon]") {
  HookClock clock;
  WriteMonitorOptions o;
  o.clock = &clock;
  SECTION("under the memory cap") {}
  SECTION("at the memory cap") { o.memory_cap_bytes = 1; }
  WriteMonitor m(o);
  m.AddFile(kF, true);
  const std::vector<uint8_t> a = Data(4 * kB, 3);
  clock.hook = [&] { m.PauseForFullLog(kF, m.LogEpoch(kF)); };
  m.OnWrite(kF, 0, a.data(), a.size());
  REQUIRE(m.FileStats(kF).log_full);
  CHECK(m.FileStats(kF).hashed_blocks == 4);
  CHECK(m.FileStats(kF).unrecorded_blocks == 4);  // written, and no record of them anywhere
  CHECK(m.Stats().unrecorded_blocks == 4);
  CHECK(m.Take(kF).empty());
}

TEST_CASE("writemon: the memory cap sheds records and marks the file", "[writemon]") {
  ManualClock clock;
  WriteMonitorOptions o = Opts(&clock);
  o.memory_cap_bytes = 64 << 10;
  WriteMonitor m(o);
  m.AddFile(kF, true);
  m.AddFile(kG, true);
  std::vector<uint8_t> a = Data(kB, 1), b = Data(kB, 2);

  // Fill the cap with distinct blocks of kF, one write each.
  uint64_t n = 0;
  while (m.FileStats(kF).dropped_records == 0) {
    m.OnWrite(kF, n * kB, a.data(), kB);
    n++;
    REQUIRE(n < 10000);
  }
  const uint64_t shed_at = clock.NowNanos();
  const MonitorFileStats fs = m.FileStats(kF);
  CHECK(fs.dropped_records == 1);
  CHECK(fs.dropped_since_ns == shed_at);
  CHECK(m.Stats().buffered_bytes <= o.memory_cap_bytes);
  CHECK(m.Stats().dropped_records == 1);
  const uint64_t kept = fs.buffered_records;
  CHECK(kept == n - 1);

  // Rewriting buffered blocks at the cap costs nothing: no more shedding,
  // and the latest content wins.
  clock.Advance(kMs);
  for (uint64_t i = 0; i < kept; i++) m.OnWrite(kF, i * kB, b.data(), kB);
  CHECK(m.FileStats(kF).dropped_records == 1);
  // New blocks are shed, for any file; the mark keeps the first time.
  m.OnWrite(kF, (n + 5) * kB, b.data(), kB);
  m.OnWrite(kG, 0, b.data(), kB);
  CHECK(m.FileStats(kF).dropped_records == 2);
  CHECK(m.FileStats(kF).dropped_since_ns == shed_at);
  CHECK(m.FileStats(kG).dropped_records == 1);
  CHECK(m.FileStats(kG).dropped_since_ns == clock.NowNanos());
  // An invalidation with no room is shed too, but still removes the
  // buffered record it covers.
  m.OnInvalidate(kF, 1000 * kB, kB);
  CHECK(m.FileStats(kF).dropped_records == 3);
  m.OnInvalidate(kF, 0, 100);
  CHECK(m.Stats().buffered_bytes <= o.memory_cap_bytes);

  MonitorBatch batch = m.Take(kF);
  CheckBatchShape(batch);
  CHECK(batch.dropped_records == 3);
  CHECK(batch.dropped_since_ns == shed_at);
  CHECK(Records(batch).count(0) == 0);
  CHECK(Records(batch).size() == kept - 1);
  for (const BlockRecord& r : batch.records) CHECK(r.fp == Fp(HashAlgo::kXxh128, b.data()));
  // The mark goes with the batch; the lifetime count stays.
  CHECK(m.FileStats(kF).dropped_since_ns == 0);
  CHECK(m.FileStats(kF).dropped_records == 3);
  CHECK(m.Take(kF).dropped_records == 0);
  // Memory came back: new records fit again.
  m.OnWrite(kG, 0, b.data(), kB);
  CHECK(m.FileStats(kG).buffered_records == 1);
  CHECK(m.FileStats(kG).dropped_records == 1);
  // A file with only shed records is still due when flushing everything.
  MonitorBatch g = m.Take(kG);
  CHECK(g.dropped_records == 1);
  m.MarkDropped(kG, 4);
  CHECK(m.DueFiles(true) == std::vector<FileId>{kG});
  g = m.Take(kG);
  CHECK(g.dropped_records == 4);
  CHECK(g.dropped_since_ns == clock.NowNanos());
  CHECK(!g.empty());
}

TEST_CASE("writemon: files are due when their records reach flush_bytes", "[writemon]") {
  ManualClock clock;
  WriteMonitorOptions o = Opts(&clock);
  const size_t per = WriteLogRecordBytes(o.algo);
  o.flush_bytes = 100 * per;
  WriteMonitor m(o);
  m.AddFile(kF, true);
  m.AddFile(kG, true);
  std::vector<uint8_t> a = Data(100 * kB, 1);
  m.OnWrite(kF, 0, a.data(), 99 * kB);
  CHECK(m.DueFiles(false).empty());
  // Rewrites of the same blocks coalesce: still not due.
  for (int i = 0; i < 50; i++) m.OnWrite(kF, 0, a.data(), 99 * kB);
  CHECK(m.DueFiles(false).empty());
  CHECK(m.FileStats(kF).buffered_records == 99);
  m.OnWrite(kF, 99 * kB, a.data(), kB);
  CHECK(m.DueFiles(false) == std::vector<FileId>{kF});
  m.OnWrite(kG, 0, a.data(), kB);
  CHECK(m.DueFiles(false) == std::vector<FileId>{kF});
  CHECK(m.DueFiles(true).size() == 2);
  MonitorBatch b = m.Take(kF);
  CHECK(b.records.size() == 100);
  CHECK(EncodedWriteLogBytes(b, o.algo) >= o.flush_bytes);
  CHECK(m.DueFiles(false).empty());
}

TEST_CASE("writemon: the flush-due hook fires once each time a file reaches flush_bytes",
          "[writemon]") {
  ManualClock clock;
  WriteMonitorOptions o = Opts(&clock);
  const size_t per = WriteLogRecordBytes(o.algo);
  o.flush_bytes = 100 * per;
  WriteMonitor m(o);
  std::atomic<int> calls{0};
  m.SetFlushDueHook([&] { calls++; });
  m.AddFile(kF, true);
  m.AddFile(kG, true);
  std::vector<uint8_t> a = Data(200 * kB, 1);

  // Sequential writing: the call that reaches 100 records fires, once.
  m.OnWrite(kF, 0, a.data(), 99 * kB);
  CHECK(calls == 0);
  m.OnWrite(kF, 99 * kB, a.data(), kB);
  CHECK(calls == 1);
  m.OnWrite(kF, 100 * kB, a.data(), 50 * kB);
  CHECK(calls == 1);
  // Another file crosses on its own.
  m.OnWrite(kG, 0, a.data(), 100 * kB);
  CHECK(calls == 2);
  // Taken: armed again, and fires at the next crossing only.
  CHECK(m.Take(kF).records.size() == 150);
  m.OnWrite(kF, 0, a.data(), 99 * kB);
  CHECK(calls == 2);
  m.OnWrite(kF, 99 * kB, a.data(), kB);
  CHECK(calls == 3);
  (void)m.Take(kF);
  (void)m.Take(kG);

  // Rewrites of one block: the bound counts ops, so it fires at 100 ops;
  // DueFiles coalesces them to one record, finds the file not due and
  // arms it again, and it fires at the next 100 ops.
  for (int i = 0; i < 100; i++) m.OnWrite(kF, 5 * kB, a.data() + i * kB, kB);
  CHECK(calls == 4);
  CHECK(m.DueFiles(false).empty());
  CHECK(m.FileStats(kF).buffered_records == 1);
  for (int i = 0; i < 98; i++) m.OnWrite(kF, 5 * kB, a.data() + i * kB, kB);
  CHECK(calls == 4);
  m.OnWrite(kF, 5 * kB, a.data(), kB);
  CHECK(calls == 5);
  (void)m.Take(kF);

  // A batch put back (its log was busy) does not fire the hook on the next
  // write: whoever put it back retries on its own schedule.
  m.OnWrite(kF, 0, a.data(), 100 * kB);
  CHECK(calls == 6);
  MonitorBatch b = m.Take(kF);
  m.PutBack(std::move(b));
  m.OnWrite(kF, 100 * kB, a.data(), 10 * kB);
  CHECK(calls == 6);
  CHECK(m.DueFiles(false) == std::vector<FileId>{kF});
  CHECK(m.Take(kF).records.size() == 110);
  m.OnWrite(kF, 0, a.data(), 100 * kB);
  CHECK(calls == 7);

  // Unhooked: no more calls.
  (void)m.Take(kF);
  m.SetFlushDueHook(nullptr);
  m.OnWrite(kF, 0, a.data(), 100 * kB);
  CHECK(calls == 7);
  CHECK(m.DueFiles(false) == std::vector<FileId>{kF});
}

TEST_CASE("writemon: PutBack merges under newer writes", "[writemon]") {
  ManualClock clock;
  WriteMonitor m(Opts(&clock));
  m.AddFile(kF, true);
  std::vector<uint8_t> a = Data(6 * kB, 1), b = Data(kB, 2);
  m.OnWrite(kF, 0, a.data(), 4 * kB);
  m.OnInvalidate(kF, 10 * kB, 3 * kB);
  m.MarkDropped(kF, 2);
  const uint64_t t0 = clock.NowNanos();
  MonitorBatch old = m.Take(kF);
  REQUIRE(old.records.size() == 4);

  clock.Advance(kMs);
  m.OnWrite(kF, kB, b.data(), kB);       // newer record wins over old block 1
  m.OnInvalidate(kF, 2 * kB, kB);        // newer invalidation kills old block 2
  m.OnWrite(kF, 11 * kB, b.data(), kB);  // newer record splits the old range
  m.PutBack(std::move(old));
  MonitorBatch merged = m.Take(kF);
  CheckBatchShape(merged);
  auto recs = Records(merged);
  CHECK(recs.size() == 4);
  CHECK(recs.at(0) == Fp(HashAlgo::kXxh128, a.data()));
  CHECK(recs.at(1) == Fp(HashAlgo::kXxh128, b.data()));
  CHECK(recs.at(3) == Fp(HashAlgo::kXxh128, a.data() + 3 * kB));
  CHECK(recs.at(11) == Fp(HashAlgo::kXxh128, b.data()));
  CHECK(InvalidBlocks(merged) == std::set<uint64_t>{2, 10, 12});
  CHECK(merged.dropped_records == 2);
  CHECK(merged.dropped_since_ns == t0);
  CHECK(merged.first_ns == t0);
  CHECK(merged.last_ns == clock.NowNanos());

  // A batch that does not fit under the cap is counted as dropped.
  WriteMonitorOptions o = Opts(&clock);
  o.memory_cap_bytes = 8 << 10;
  WriteMonitor small(o);
  small.AddFile(kF, true);
  MonitorBatch big;
  big.file = kF;
  big.first_ns = t0;
  big.last_ns = t0;
  for (uint64_t i = 0; i < 1000; i++) {
    big.records.push_back(BlockRecord{i, t0, Fp(HashAlgo::kXxh128, a.data())});
  }
  small.PutBack(std::move(big));
  CHECK(small.FileStats(kF).buffered_records == 0);
  CHECK(small.FileStats(kF).dropped_records == 1000);
  CHECK(small.FileStats(kF).dropped_since_ns == t0);
}

TEST_CASE("writemon: a huge TRIM takes O(1) memory", "[writemon]") {
  ManualClock clock;
  WriteMonitorOptions o = Opts(&clock);
  o.memory_cap_bytes = 1 << 20;
  WriteMonitor m(o);
  m.AddFile(kF, true);
  std::vector<uint8_t> a = Data(8 * kB, 1);
  m.OnWrite(kF, 50 * kB, a.data(), a.size());
  const uint64_t disk = uint64_t{100} << 30;
  for (int i = 0; i < 1000; i++) m.OnInvalidate(kF, 0, disk);
  // The last block a u64 offset can name, too.
  m.OnInvalidate(kF, ~uint64_t{0} - 10, 100);
  CHECK(m.Stats().buffered_bytes < 256 << 10);
  CHECK(m.DueFiles(false).empty());
  MonitorBatch b = m.Take(kF);
  CheckBatchShape(b);
  CHECK(b.records.empty());
  REQUIRE(b.invalidated.size() == 2);
  CHECK(b.invalidated[0].first == 0);
  CHECK(b.invalidated[0].count == disk / kB);
  CHECK(b.invalidated[1].first == (~uint64_t{0}) / kB);
  CHECK(b.invalidated[1].count == 1);
}

namespace {

// Random writes (aligned, unaligned, short, long), TRIMs, flush checks,
// failed appends (Take + PutBack) and takes, on a 64-block file, against
// two models: `pend_*`, what the buffer should hold since the last Take,
// and `truth`, what a complete log says (the fingerprint of each block
// whose last change was a whole-block write). With a memory cap, a call
// that shed anything taints the blocks it touched: the log may then be
// stale or incomplete there, and only there. A call that shed nothing
// leaves its blocks' latest state in the buffer ("fresh"): once that
// buffer reaches the log, those blocks are exact again.
void RunRandomized(uint32_t seed, size_t memory_cap) {
  CAPTURE(seed, memory_cap);
  std::mt19937_64 rng(seed);
  ManualClock clock;
  WriteMonitorOptions o = Opts(&clock);
  o.flush_bytes = 4096;  // small: DueFiles coalesces often
  if (memory_cap != 0) o.memory_cap_bytes = memory_cap;  // 0: the default, never reached
  WriteMonitor m(o);
  m.AddFile(kF, true);
  const uint64_t blocks = 64;
  std::vector<uint8_t> disk(blocks * kB, 0);
  std::map<uint64_t, Fingerprint> truth, log;
  std::map<uint64_t, Fingerprint> pend_rec;
  std::set<uint64_t> pend_inv, tainted, fresh;
  uint64_t max_bytes = 0, compared = 0;
  auto dropped = [&] { return m.FileStats(kF).dropped_records; };
  auto taint = [&](uint64_t before, uint64_t first, uint64_t last) {
    const bool shed = dropped() != before;
    for (uint64_t b = first; b <= last; b++) {
      if (shed) {
        tainted.insert(b);
        fresh.erase(b);
      } else {
        fresh.insert(b);
      }
    }
  };
  auto check_log = [&] {
    for (uint64_t b = 0; b < blocks; b++) {
      if (tainted.count(b)) continue;
      compared++;
      CAPTURE(b);
      REQUIRE(log.count(b) == truth.count(b));
      if (truth.count(b)) REQUIRE(log.at(b) == truth.at(b));
    }
  };
  for (int step = 0; step < 4000; step++) {
    clock.Advance(rng() % 3 * kMs);
    const int what = static_cast<int>(rng() % 100);
    const uint64_t off = rng() % 3 == 0 ? rng() % blocks * kB : rng() % (blocks * kB);
    const uint64_t maxlen = blocks * kB - off;
    const uint64_t span = rng() % 4 == 0 ? 20 * kB : 2 * kB;
    const uint64_t len = std::min<uint64_t>(maxlen, 1 + rng() % span);
    const uint64_t before = dropped();
    if (what < 60) {
      std::vector<uint8_t> d = Data(len, static_cast<uint32_t>(rng()));
      std::memcpy(disk.data() + off, d.data(), len);
      m.OnWrite(kF, off, d.data(), len);
      for (uint64_t b = off / kB; b <= (off + len - 1) / kB; b++) {
        const bool whole = b * kB >= off && (b + 1) * kB <= off + len;
        if (whole) {
          Fingerprint fp = Fp(HashAlgo::kXxh128, disk.data() + b * kB);
          truth[b] = fp;
          pend_rec[b] = fp;
          pend_inv.erase(b);
        } else {
          truth.erase(b);
          pend_rec.erase(b);
          pend_inv.insert(b);
        }
      }
      taint(before, off / kB, (off + len - 1) / kB);
    } else if (what < 75) {
      m.OnInvalidate(kF, off, len);
      for (uint64_t b = off / kB; b <= (off + len - 1) / kB; b++) {
        truth.erase(b);
        pend_rec.erase(b);
        pend_inv.insert(b);
      }
      taint(before, off / kB, (off + len - 1) / kB);
    } else if (what < 85) {
      (void)m.DueFiles(rng() % 2 == 0);
    } else if (what < 93) {
      // A failed append: the batch comes back under what follows.
      MonitorBatch b = m.Take(kF);
      std::set<uint64_t> in_batch = InvalidBlocks(b);
      for (const BlockRecord& r : b.records) in_batch.insert(r.block);
      std::set<uint64_t> taken_fresh;
      taken_fresh.swap(fresh);
      const uint64_t rewrite = rng() % blocks;  // same content: a rewrite
      m.OnWrite(kF, rewrite * kB, disk.data() + rewrite * kB, kB);
      truth[rewrite] = Fp(HashAlgo::kXxh128, disk.data() + rewrite * kB);
      pend_rec[rewrite] = truth[rewrite];
      pend_inv.erase(rewrite);
      taint(before, rewrite, rewrite);
      const uint64_t mid = dropped();
      m.PutBack(std::move(b));
      if (dropped() != mid) {
        tainted.insert(in_batch.begin(), in_batch.end());
        for (uint64_t x : taken_fresh) REQUIRE(in_batch.count(x) == 1);
        for (uint64_t x : in_batch) taken_fresh.erase(x);
      }
      fresh.insert(taken_fresh.begin(), taken_fresh.end());
    } else if (what < 96) {
      MonitorBatch b = m.Take(kF);
      CheckBatchShape(b);
      if (memory_cap == 0) {
        REQUIRE(Records(b) == pend_rec);
        REQUIRE(InvalidBlocks(b) == pend_inv);
        REQUIRE(b.dropped_records == 0);
      }
      ApplyToLog(&log, b);
      for (uint64_t x : fresh) tainted.erase(x);
      fresh.clear();
      check_log();
      pend_rec.clear();
      pend_inv.clear();
    }
    max_bytes = std::max(max_bytes, m.Stats().buffered_bytes);
  }
  MonitorBatch b = m.Take(kF);
  ApplyToLog(&log, b);
  for (uint64_t x : fresh) tainted.erase(x);
  check_log();
  REQUIRE(m.Stats().buffered_bytes == 0);
  if (memory_cap == 0) {
    REQUIRE(tainted.empty());
    REQUIRE(log == truth);
  } else {
    REQUIRE(m.FileStats(kF).dropped_records > 0);
    REQUIRE(compared > 20 * blocks);  // the taint did not cover everything at once
    // Only a record splitting a range while a buffer coalesces can pass
    // the cap, by one node each.
    REQUIRE(max_bytes <= memory_cap + memory_cap / 8);
  }
}

}  // namespace

TEST_CASE("writemon: randomized against a model of the log", "[writemon]") {
  for (uint32_t seed : {1u, 2u, 3u, 4u, 5u, 6u}) RunRandomized(seed, 0);
}

TEST_CASE("writemon: randomized with shedding at the memory cap", "[writemon]") {
  for (uint32_t seed : {1u, 2u, 3u, 4u, 5u, 6u}) RunRandomized(seed, 3000);
}

TEST_CASE("writemon: threads on different files", "[writemon]") {
  WriteMonitorOptions o;
  o.flush_bytes = 16 << 10;
  WriteMonitor m(o);
  constexpr int kThreads = 4;
  constexpr uint64_t kBlocks = 256;
  std::vector<std::map<uint64_t, Fingerprint>> truth(kThreads), log(kThreads);
  for (int t = 0; t < kThreads; t++) m.AddFile(FileId{uint64_t(t + 1), 1}, true);
  std::atomic<bool> done{false};
  Mutex log_mu;

  std::thread flusher([&] {
    while (!done.load()) {
      for (FileId id : m.DueFiles(false)) {
        MonitorBatch b = m.Take(id);
        MutexLock l(&log_mu);
        ApplyToLog(&log[id.ino - 1], b);
      }
      // Churn the map while writers run.
      m.AddFile(FileId{100, 1}, true);
      m.RemoveFile(FileId{100, 1});
      (void)m.Stats();
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  std::vector<std::thread> writers;
  for (int t = 0; t < kThreads; t++) {
    writers.emplace_back([&, t] {
      const FileId id{uint64_t(t + 1), 1};
      std::mt19937_64 rng(t);
      std::vector<uint8_t> buf(16 * kB);
      for (int i = 0; i < 3000; i++) {
        const uint64_t b = rng() % (kBlocks - 16);
        const uint64_t n = 1 + rng() % 16;
        dede::test::FillRandom(rng, buf.data(), n * kB);
        if (rng() % 10 == 0) {
          m.OnInvalidate(id, b * kB, n * kB);
          for (uint64_t k = 0; k < n; k++) truth[t].erase(b + k);
        } else {
          m.OnWrite(id, b * kB, buf.data(), n * kB);
          for (uint64_t k = 0; k < n; k++) {
            truth[t][b + k] = Fp(HashAlgo::kXxh128, buf.data() + k * kB);
          }
        }
      }
    });
  }
  for (auto& w : writers) w.join();
  done.store(true);
  flusher.join();
  for (int t = 0; t < kThreads; t++) {
    MonitorBatch b = m.Take(FileId{uint64_t(t + 1), 1});
    ApplyToLog(&log[t], b);
    CHECK(log[t] == truth[t]);
    CHECK(m.FileStats(FileId{uint64_t(t + 1), 1}).dropped_records == 0);
  }
  CHECK(m.Stats().buffered_bytes == 0);
  CHECK(m.Stats().hashed_blocks > 0);
}

TEST_CASE("writemon: threads on one file, disjoint blocks", "[writemon]") {
  // Several requests in flight to one export: the caller serialises writes
  // per block, not per file.
  WriteMonitorOptions o;
  o.flush_bytes = 8 << 10;
  WriteMonitor m(o);
  m.AddFile(kF, true);
  constexpr int kThreads = 4;
  constexpr uint64_t kSpan = 128;  // blocks per thread
  std::vector<std::map<uint64_t, Fingerprint>> truth(kThreads);
  std::map<uint64_t, Fingerprint> log;
  std::atomic<bool> done{false};
  std::thread flusher([&] {
    while (!done.load()) {
      if (!m.DueFiles(false).empty()) ApplyToLog(&log, m.Take(kF));
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  });
  std::vector<std::thread> writers;
  for (int t = 0; t < kThreads; t++) {
    writers.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      std::vector<uint8_t> buf(8 * kB);
      const uint64_t base = t * kSpan;
      for (int i = 0; i < 3000; i++) {
        const uint64_t n = 1 + rng() % 8;
        const uint64_t b = base + rng() % (kSpan - n);
        dede::test::FillRandom(rng, buf.data(), n * kB);
        if (rng() % 8 == 0) {
          m.OnInvalidate(kF, b * kB + 1, n * kB - 2);  // touches the same n blocks
          for (uint64_t k = 0; k < n; k++) truth[t].erase(b + k);
        } else {
          m.OnWrite(kF, b * kB, buf.data(), n * kB);
          for (uint64_t k = 0; k < n; k++) truth[t][b + k] = Fp(HashAlgo::kXxh128, buf.data() + k * kB);
        }
      }
    });
  }
  for (auto& w : writers) w.join();
  done.store(true);
  flusher.join();
  ApplyToLog(&log, m.Take(kF));
  std::map<uint64_t, Fingerprint> all;
  for (const auto& t : truth) all.insert(t.begin(), t.end());
  CHECK(log == all);
  CHECK(m.FileStats(kF).dropped_records == 0);
  CHECK(m.Stats().buffered_bytes == 0);
}

TEST_CASE("writemon: random whole-block rewrites coalesce by sort, latest wins", "[writemon]") {
  // Only records and nothing coalesced before: the monitor coalesces by
  // sorting (in DueFiles, in place past the op threshold, and in Take).
  // Whatever path runs, the batches must say what the model says.
  ManualClock clock;
  WriteMonitorOptions o = Opts(&clock);
  o.flush_bytes = 64 * WriteLogRecordBytes(o.algo);  // due at 64 distinct blocks
  WriteMonitor m(o);
  m.AddFile(kF, true);
  std::mt19937_64 rng(7);
  std::vector<uint8_t> d = Data(4 * kB, 3);
  std::map<uint64_t, std::pair<Fingerprint, uint64_t>> model, log;
  auto apply = [&](const MonitorBatch& b) {
    CHECK(b.invalidated.empty());
    for (size_t i = 0; i < b.records.size(); i++) {
      if (i > 0) CHECK(b.records[i - 1].block < b.records[i].block);
      const BlockRecord& r = b.records[i];
      log[r.block] = {r.fp, r.time_ns};
    }
  };
  for (int i = 0; i < 20000; i++) {
    clock.Advance(kMs);
    const uint64_t block = rng() % (i % 3 == 0 ? 8 : 200);  // hot and cold blocks
    const uint32_t v = static_cast<uint32_t>(rng());
    std::memcpy(d.data(), &v, sizeof v);
    m.OnWrite(kF, block * kB, d.data(), kB);
    model[block] = {Fp(o.algo, d.data()), clock.NowNanos()};
    if (i % 97 == 0) {
      for (FileId id : m.DueFiles(false)) apply(m.Take(id));
    }
    if (i % 1009 == 0) {
      // Buffered records never exceed the distinct blocks by more than the
      // ops since the last sort.
      CHECK(m.FileStats(kF).buffered_records <= 20000);
    }
  }
  for (FileId id : m.DueFiles(true)) apply(m.Take(id));
  CHECK(m.FileStats(kF).buffered_records == 0);
  CHECK(log.size() == model.size());
  for (const auto& [block, v] : model) {
    auto it = log.find(block);
    REQUIRE(it != log.end());
    CHECK(it->second.first == v.first);
    CHECK(it->second.second == v.second);
  }
}

TEST_CASE("writemon: hot rewrites stay coalesced without a flusher", "[writemon]") {
  ManualClock clock;
  WriteMonitorOptions o = Opts(&clock);
  o.flush_bytes = 1 << 20;
  WriteMonitor m(o);
  m.AddFile(kF, true);
  std::mt19937_64 rng(9);
  std::vector<uint8_t> d = Data(kB, 5);
  for (int i = 0; i < 300000; i++) m.OnWrite(kF, (rng() % 100) * kB, d.data(), kB);
  // In-place coalescing keeps the buffer near the 100 distinct blocks, far
  // below 300000 ops.
  CHECK(m.FileStats(kF).buffered_bytes < (size_t{16} << 20));
  CHECK(m.DueFiles(false).empty());
  MonitorBatch b = m.Take(kF);
  CHECK(b.records.size() == 100);
  CHECK(m.Stats().dropped_records == 0);
}

// A flusher hands each appended batch's records vector back to the next
// Take, so steady writing does not fault in fresh pages for every batch.
// The reused vector's old content must never leak into the new batch, in
// any of Take's three paths (sequential, records only, mixed).
TEST_CASE("writemon: Take fills the records vector it is given and nothing else", "[writemon]") {
  ManualClock clock;
  WriteMonitor m(Opts(&clock));
  m.AddFile(kF, true);
  const std::vector<uint8_t> a = Data(8 * kB, 11), b = Data(2 * kB, 12);
  std::vector<BlockRecord> spare(1000, BlockRecord{999, 1, Fp(HashAlgo::kXxh128, b.data())});
  const BlockRecord* storage = spare.data();
  const size_t capacity = spare.capacity();
  for (int path = 0; path < 3; path++) {
    INFO("path " << path);
    m.OnWrite(kF, 0, a.data(), a.size());                   // blocks 0..7, increasing
    if (path >= 1) m.OnWrite(kF, 2 * kB, b.data(), kB);     // a rewrite: records only
    if (path == 2) m.OnInvalidate(kF, 5 * kB, kB);          // an invalidation: mixed
    MonitorBatch batch = m.Take(kF, std::move(spare));
    CheckBatchShape(batch);
    CHECK(batch.records.data() == storage);  // the given memory, reused
    CHECK(batch.records.capacity() == capacity);
    std::map<uint64_t, Fingerprint> want;
    for (uint64_t i = 0; i < 8; i++) want[i] = Fp(HashAlgo::kXxh128, a.data() + i * kB);
    if (path >= 1) want[2] = Fp(HashAlgo::kXxh128, b.data());
    if (path == 2) want.erase(5);
    CHECK(Records(batch) == want);
    CHECK(InvalidBlocks(batch) == (path == 2 ? std::set<uint64_t>{5} : std::set<uint64_t>{}));
    spare = std::move(batch.records);
  }
}

// A coalesce (the sort of a records-only buffer, or the fold into the tree
// when invalidations are mixed in) runs with the file's lock released, so
// writes to other blocks keep appending. Writes that arrive meanwhile are
// newer than every detached op: after the coalesce they must still win,
// and nothing may be lost, double counted or left charged. Each thread
// rewrites a small span of its own (callers serialise writes per block),
// so rewrites of detached blocks are frequent.
TEST_CASE("writemon: writes during an unlocked coalesce stay newer", "[writemon]") {
  for (const bool mixed : {false, true}) {
    for (const bool flusher_running : {false, true}) {
      INFO("mixed " << mixed << ", flusher " << flusher_running);
      WriteMonitorOptions o;
      o.flush_bytes = 64 << 10;  // coalesce past ~4k ops: sorts take a while
      WriteMonitor m(o);
      m.AddFile(kF, true);
      constexpr int kThreads = 6;
      constexpr uint64_t kSpan = 64;
      std::vector<std::map<uint64_t, Fingerprint>> truth(kThreads);
      std::map<uint64_t, Fingerprint> log;
      std::atomic<bool> done{false};
      std::atomic<uint64_t> max_records{0};
      std::thread flusher([&] {
        while (!done.load()) {
          if (flusher_running) {
            for (FileId id : m.DueFiles(false)) ApplyToLog(&log, m.Take(id));
          }
          // Counted while coalesces run: detached records included.
          const uint64_t r = m.FileStats(kF).buffered_records;
          if (r > max_records.load()) max_records.store(r);
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      });
      std::vector<std::thread> writers;
      for (int t = 0; t < kThreads; t++) {
        writers.emplace_back([&, t] {
          std::mt19937_64 rng(500 + t + 10 * mixed);
          std::vector<uint8_t> buf(4 * kB);
          const uint64_t base = t * kSpan;
          // Under ASan each write is ~6x slower, and the races as likely.
          const int writes = dede::test::kSanitized ? 12000 : 40000;
          for (int i = 0; i < writes; i++) {
            const uint64_t n = 1 + rng() % 4;
            const uint64_t b = base + rng() % (kSpan - n);
            dede::test::FillRandom(rng, buf.data(), n * kB);
            if (mixed && rng() % 16 == 0) {
              m.OnInvalidate(kF, b * kB, n * kB);
              for (uint64_t k = 0; k < n; k++) truth[t].erase(b + k);
            } else {
              m.OnWrite(kF, b * kB, buf.data(), n * kB);
              for (uint64_t k = 0; k < n; k++) {
                truth[t][b + k] = Fp(HashAlgo::kXxh128, buf.data() + k * kB);
              }
            }
          }
        });
      }
      for (auto& w : writers) w.join();
      done.store(true);
      flusher.join();
      std::map<uint64_t, Fingerprint> all;
      for (const auto& t : truth) all.insert(t.begin(), t.end());
      // Without a flusher, in-place coalescing alone keeps the buffer near
      // the distinct blocks (kThreads * kSpan) plus the ops since the last
      // sort, far below the 240k writes.
      if (!flusher_running) CHECK(m.FileStats(kF).buffered_records < 40000);
      CHECK(max_records.load() < 200000);
      ApplyToLog(&log, m.Take(kF));
      CHECK(log == all);
      CHECK(m.FileStats(kF).buffered_records == 0);
      CHECK(m.FileStats(kF).dropped_records == 0);
      CHECK(m.Stats().buffered_bytes == 0);
    }
  }
}

// One sequential writer whose requests workers finish out of order never
// rewrites a block, so coalescing its ops gains nothing and the monitor
// backs off (coalesces later, sizes by the bound). When the same file turns
// to hot rewrites, the first coalesce that pays must end the backoff: the
// buffer shrinks back to a few hundred ops instead of growing to a quarter
// of the cap between coalesces. The log must be right throughout.
TEST_CASE("writemon: backing off from a shuffled sequential writer, then hot rewrites", "[writemon]") {
  ManualClock clock;
  WriteMonitorOptions o = Opts(&clock);
  o.flush_bytes = 4 << 10;         // ~110 records: coalesce_ops_ is its minimum, 256
  o.memory_cap_bytes = 8 << 20;    // a quarter: ~50k ops
  WriteMonitor m(o);
  m.AddFile(kF, true);
  std::mt19937_64 rng(21);
  std::vector<uint8_t> buf(16 * kB);
  std::map<uint64_t, Fingerprint> truth, log;
  auto write = [&](uint64_t block, uint64_t n) {
    dede::test::FillRandom(rng, buf.data(), n * kB);
    clock.Advance(kMs);
    m.OnWrite(kF, block * kB, buf.data(), n * kB);
    for (uint64_t k = 0; k < n; k++) truth[block + k] = Fp(o.algo, buf.data() + k * kB);
  };
  auto flush = [&](bool all) {
    for (FileId id : m.DueFiles(all)) {
      const MonitorBatch b = m.Take(id);
      CheckBatchShape(b);
      ApplyToLog(&log, b);
    }
  };
  // Phase 1: 16-block requests in shuffled runs of 16, flushed now and then.
  uint64_t next = 0;
  for (int run = 0; run < 400; run++) {
    uint64_t order[16];
    for (int i = 0; i < 16; i++) order[i] = next + 16 * i;
    next += 256;
    std::shuffle(order, order + 16, rng);
    for (uint64_t b : order) write(b, 16);
    if (run % 8 == 7) flush(false);
  }
  flush(true);
  CHECK(log == truth);
  // Phase 2: hot rewrites of 100 blocks, no flusher. The first coalesce
  // comes late (backed off: ~16k ops); once it has paid, the buffer stays
  // at the normal threshold (~260 ops), never near 16k again.
  uint64_t most_later = 0;
  const int hot_writes = dede::test::kSanitized ? 120000 : 300000;  // ASan: ~6x slower
  for (int i = 0; i < hot_writes; i++) {
    write(rng() % 100, 1);
    if (i >= hot_writes / 3 && i % 97 == 0) {
      most_later = std::max<uint64_t>(most_later, m.FileStats(kF).buffered_records);
    }
  }
  CHECK(m.FileStats(kF).dropped_records == 0);
  CHECK(most_later < 1000);
  flush(true);
  CHECK(log == truth);
  CHECK(m.Stats().buffered_bytes == 0);
}

TEST_CASE("writemon: records coalesce the same whether their blocks are dense or sparse",
          "[writemon]") {
  // Take orders a file's records by block with a table when their blocks
  // are dense (at most a few slots per op) and by a sort when they are
  // sparse; both must keep the latest write of every block, in block order.
  // The same shuffled writes with rewrites (3000 ops over 4096 slots) are
  // laid out with a stride of 1 and 2 blocks (dense: a table of at most 4
  // slots per op) and of 3 and 2^20 blocks (sparse: sorted).
  for (uint64_t stride : {uint64_t{1}, uint64_t{2}, uint64_t{3}, uint64_t{1} << 20}) {
    CAPTURE(stride);
    ManualClock clock;
    WriteMonitor m(Opts(&clock));
    m.AddFile(kF, true);
    std::mt19937_64 rng(stride);
    std::vector<uint8_t> d = Data(kB, 9);
    std::map<uint64_t, std::pair<Fingerprint, uint64_t>> model;
    for (int i = 0; i < 3000; i++) {
      clock.Advance(kMs);
      // Mostly distinct slots out of order, some rewritten.
      const uint64_t slot = i % 4 == 0 ? rng() % 64 : (i ^ 0x155) % 4096;
      const uint64_t block = 100 + slot * stride;
      const uint32_t v = static_cast<uint32_t>(rng());
      std::memcpy(d.data(), &v, sizeof v);
      m.OnWrite(kF, block * kB, d.data(), kB);
      model[block] = {Fp(HashAlgo::kXxh128, d.data()), clock.NowNanos()};
    }
    const MonitorBatch b = m.Take(kF);
    CheckBatchShape(b);
    REQUIRE(b.records.size() == model.size());
    size_t i = 0;
    for (const auto& [block, v] : model) {
      CAPTURE(block);
      REQUIRE(b.records[i].block == block);
      CHECK(b.records[i].fp == v.first);
      CHECK(b.records[i].time_ns == v.second);
      i++;
    }
    CHECK(m.FileStats(kF).buffered_records == 0);
  }
}

TEST_CASE("writemon: a backed-off shuffled writer is signalled once DueFiles takes it as it is",
          "[writemon]") {
  // A shuffled sequential writer never rewrites: coalescing it does not
  // pay, so the file backs off. From then on the hook waits until the
  // bound is big enough that DueFiles takes the file without coalescing it
  // (an eighth over flush_bytes), rather than firing at flush_bytes and
  // having DueFiles sort it once for nothing before Take sorts it again.
  ManualClock clock;
  WriteMonitorOptions o = Opts(&clock);
  const size_t per = WriteLogRecordBytes(o.algo);
  o.flush_bytes = 112 * per;  // an eighth over it: 128 records
  WriteMonitor m(o);
  std::atomic<int> calls{0};
  m.SetFlushDueHook([&] { calls++; });
  m.AddFile(kF, true);
  std::vector<uint8_t> d = Data(kB, 4);
  uint64_t next = 0;
  // Writes blocks next.. in runs of 8 reversed (never increasing).
  auto shuffled = [&](uint64_t n) {
    for (uint64_t k = 0; k < n; k += 8, next += 8) {
      for (uint64_t j = 8; j-- > 0;) m.OnWrite(kF, (next + j) * kB, d.data(), kB);
    }
  };
  // Not backed off yet: signalled at flush_bytes (112 records); the first
  // coalesce (DueFiles) finds nothing to fold and backs the file off.
  shuffled(104);
  CHECK(calls == 0);
  shuffled(8);
  CHECK(calls == 1);
  CHECK(m.DueFiles(false) == std::vector<FileId>{kF});
  MonitorBatch b = m.Take(kF);
  CheckBatchShape(b);
  CHECK(b.records.size() == 112);
  // Backed off: 112 records do not signal it, 128 do, and DueFiles takes
  // it as it is. (A DueFiles of its own, at the flush timer, would still
  // find it due from flush_bytes on, after coalescing it.)
  shuffled(112);
  CHECK(calls == 1);
  shuffled(8);
  CHECK(calls == 1);
  shuffled(8);
  CHECK(calls == 2);
  CHECK(m.DueFiles(false) == std::vector<FileId>{kF});
  b = m.Take(kF);
  CheckBatchShape(b);
  CHECK(b.records.size() == 128);
  // Plain sequential writing is exact whatever the backoff: at flush_bytes.
  for (uint64_t k = 0; k < 112; k++, next++) m.OnWrite(kF, next * kB, d.data(), kB);
  CHECK(calls == 3);
}
