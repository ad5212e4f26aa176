// Tests for an export's sequential read-ahead (agent/read_ahead.h): when it
// prefetches and when it must not, that a READ waits for a window being
// read instead of reading twice, and that no READ ever sees content older
// than a write acknowledged before it (invalidation of ready and in-flight
// windows, and a randomized check with concurrent readers and a writer).
#include "agent/read_ahead.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

using namespace dede;

namespace {

constexpr size_t kK = 1024;

// A file in memory whose reads are counted and can be held at a gate:
// `hold_next` makes the next read copy its data, then block until
// Release() (a device read that has its data but has not returned yet).
class FakeFile {
 public:
  explicit FakeFile(size_t size) : bytes_(size) {
    for (size_t i = 0; i < size; i++) bytes_[i] = static_cast<uint8_t>(i * 7 + i / 4096);
  }
  ReadAhead::ReadFn Reader() {
    return [this](uint64_t off, void* buf, size_t len) {
      bool hold;
      {
        std::lock_guard<std::mutex> l(mu_);
        reads_++;
        if (fail_next_) {
          fail_next_ = false;
          return Status::IoError("injected read error");
        }
        std::memcpy(buf, bytes_.data() + off, len);
        hold = hold_next_;
        hold_next_ = false;
        if (hold) held_ = true;
      }
      if (hold) {
        std::unique_lock<std::mutex> l(mu_);
        cv_.notify_all();
        cv_.wait(l, [&] { return !held_; });
      }
      return Status::Ok();
    };
  }
  void HoldNext() {
    std::lock_guard<std::mutex> l(mu_);
    hold_next_ = true;
  }
  void WaitHeld() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return held_; });
  }
  void Release() {
    {
      std::lock_guard<std::mutex> l(mu_);
      held_ = false;
    }
    cv_.notify_all();
  }
  void FailNext() {
    std::lock_guard<std::mutex> l(mu_);
    fail_next_ = true;
  }
  void Write(uint64_t off, uint8_t value, size_t len) {
    std::lock_guard<std::mutex> l(mu_);
    std::memset(bytes_.data() + off, value, len);
  }
  std::vector<uint8_t> Content(uint64_t off, size_t len) {
    std::lock_guard<std::mutex> l(mu_);
    return {bytes_.begin() + off, bytes_.begin() + off + len};
  }
  int reads() {
    std::lock_guard<std::mutex> l(mu_);
    return reads_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t> bytes_;
  int reads_ = 0;
  bool hold_next_ = false, held_ = false, fail_next_ = false;
};

std::vector<uint8_t> Vec(const IoBytes& b) { return {b.begin(), b.end()}; }

// Runs `fn` on a thread and returns once that thread's first device read
// is held at the file's gate (it has its data but has not returned);
// Release() lets it finish. (Catch's assertions are not thread-safe: `fn`
// reports through flags.)
class HeldOnThread {
 public:
  HeldOnThread(FakeFile* f, std::function<void()> fn) : f_(f) {
    f_->HoldNext();
    thread_ = std::thread(std::move(fn));
    f_->WaitHeld();
  }
  ~HeldOnThread() { Release(); }
  void Release() {
    if (!thread_.joinable()) return;
    f_->Release();
    thread_.join();
  }

 private:
  FakeFile* f_;
  std::thread thread_;
};

// One READ the way the NBD worker does it: read, answer, then After().
IoBytes ReadAndAfter(ReadAhead* ra, uint64_t off, size_t len) {
  IoBytes out;
  REQUIRE(ra->Read(off, len, &out).ok());
  ra->After(off, len);
  return out;
}

}  // namespace

TEST_CASE("read-ahead: a sequential QD1 reader's next READ is answered from the window",
          "[read_ahead]") {
  FakeFile f(1 << 20);
  ReadAhead ra(f.Reader(), 1 << 20, 256 * kK);
  CHECK(Vec(ReadAndAfter(&ra, 0, 64 * kK)) == f.Content(0, 64 * kK));
  CHECK(f.reads() == 2);  // the READ and the prefetch of [64K, 128K)
  CHECK(ra.stats().prefetches == 1);
  for (uint64_t off = 64 * kK; off < 512 * kK; off += 64 * kK) {
    CHECK(Vec(ReadAndAfter(&ra, off, 64 * kK)) == f.Content(off, 64 * kK));
  }
  // Every READ after the first came from a window; each hit prefetched the
  // next one, so the device saw one read per request all the same.
  ReadAheadStats s = ra.stats();
  CHECK(s.hits == 7);
  CHECK(s.prefetches == 8);
  CHECK(s.wasted == 0);
  CHECK(f.reads() == 9);
  CHECK(s.bytes_prefetched == 8 * 64 * kK);
}

TEST_CASE("read-ahead: random, too long, past the end, or disabled: no prefetch", "[read_ahead]") {
  FakeFile f(1 << 20);
  SECTION("a READ that does not continue the previous one") {
    ReadAhead ra(f.Reader(), 1 << 20, 256 * kK);
    ReadAndAfter(&ra, 128 * kK, 4 * kK);  // the stream starts at 0: not sequential
    ReadAndAfter(&ra, 512 * kK, 4 * kK);
    ReadAndAfter(&ra, 8 * kK, 4 * kK);
    CHECK(ra.stats().prefetches == 0);
    CHECK(f.reads() == 3);
  }
  SECTION("a READ longer than the cap") {
    ReadAhead ra(f.Reader(), 1 << 20, 64 * kK);
    ReadAndAfter(&ra, 0, 128 * kK);
    CHECK(ra.stats().prefetches == 0);
  }
  SECTION("the window is cut at the end of the file, and nothing is read past it") {
    ReadAhead ra(f.Reader(), 1 << 20, 256 * kK);
    ReadAndAfter(&ra, 0, 960 * kK);  // over the cap: no prefetch
    ra.After(0, 0);
    CHECK(ra.stats().prefetches == 0);
    ReadAhead rb(f.Reader(), 1 << 20, 512 * kK);
    ReadAndAfter(&rb, 0, 300 * kK);
    ReadAndAfter(&rb, 300 * kK, 300 * kK);
    ReadAndAfter(&rb, 600 * kK, 300 * kK);  // prefetches [900K, 1M): cut to 124K
    IoBytes tail;
    REQUIRE(rb.Read(900 * kK, 124 * kK, &tail).ok());
    CHECK(Vec(tail) == f.Content(900 * kK, 124 * kK));
    rb.After(900 * kK, 124 * kK);  // at the end: nothing to prefetch
    CHECK(rb.stats().hits == 3);
    CHECK(rb.stats().prefetches == 3);
    CHECK(rb.stats().bytes_prefetched == 2 * 300 * kK + 124 * kK);
    CHECK(rb.stats().wasted == 0);
  }
  SECTION("max_bytes 0") {
    ReadAhead ra(f.Reader(), 1 << 20, 0);
    for (uint64_t off = 0; off < 256 * kK; off += 64 * kK) ReadAndAfter(&ra, off, 64 * kK);
    CHECK(ra.stats().prefetches == 0);
    CHECK(f.reads() == 4);
  }
}

TEST_CASE("read-ahead: no prefetch while other READs are in flight (deeper queues)",
          "[read_ahead]") {
  FakeFile f(1 << 20);
  ReadAhead ra(f.Reader(), 1 << 20, 256 * kK);
  IoBytes a;
  REQUIRE(ra.Read(0, 64 * kK, &a).ok());
  // Two more READs started before the first one's After(): a queue.
  IoBytes b;
  REQUIRE(ra.Read(64 * kK, 64 * kK, &b).ok());  // (returned, but not yet answered)
  std::atomic<bool> third_ok{false};
  HeldOnThread third(&f, [&] {
    IoBytes c;
    third_ok = ra.Read(128 * kK, 64 * kK, &c).ok() && Vec(c) == f.Content(128 * kK, 64 * kK);
  });
  ra.After(0, 64 * kK);  // the stream moved on twice: nothing
  CHECK(ra.stats().prefetches == 0);
  third.Release();
  CHECK(third_ok.load());
  CHECK(f.reads() == 3);
}

TEST_CASE("read-ahead: when the next READ arrived first, the window is the one after it",
          "[read_ahead]") {
  FakeFile f(1 << 20);
  ReadAhead ra(f.Reader(), 1 << 20, 256 * kK);
  IoBytes a;
  REQUIRE(ra.Read(0, 64 * kK, &a).ok());
  // The client's next READ started before the first one's After() (a
  // loaded host): it reads for itself, held in its device read.
  std::atomic<bool> second_ok{false};
  HeldOnThread second(&f, [&] {
    IoBytes b;
    second_ok = ra.Read(64 * kK, 64 * kK, &b).ok() && Vec(b) == f.Content(64 * kK, 64 * kK);
  });
  ra.After(0, 64 * kK);  // prefetches [128K, 192K), past the READ in flight
  CHECK(ra.stats().prefetches == 1);
  second.Release();
  CHECK(second_ok.load());
  ra.After(64 * kK, 64 * kK);  // a window is there already: nothing more
  CHECK(ra.stats().prefetches == 1);
  // The stream is ahead again: the third READ comes from the window and
  // prefetches the fourth.
  CHECK(Vec(ReadAndAfter(&ra, 128 * kK, 64 * kK)) == f.Content(128 * kK, 64 * kK));
  CHECK(Vec(ReadAndAfter(&ra, 192 * kK, 64 * kK)) == f.Content(192 * kK, 64 * kK));
  const ReadAheadStats s = ra.stats();
  CHECK(s.hits == 2);
  CHECK(s.prefetches == 3);
  CHECK(s.wasted == 0);
  CHECK(f.reads() == 5);  // two READs, three prefetches: nothing read twice

  SECTION("not when the READ in flight went elsewhere") {
    ReadAhead rb(f.Reader(), 1 << 20, 256 * kK);
    IoBytes x, y;
    REQUIRE(rb.Read(0, 64 * kK, &x).ok());
    REQUIRE(rb.Read(512 * kK, 64 * kK, &y).ok());  // in flight (not yet answered)
    rb.After(0, 64 * kK);
    CHECK(rb.stats().prefetches == 0);
  }
}

TEST_CASE("read-ahead: a READ of a window being read waits for it instead of reading again",
          "[read_ahead]") {
  FakeFile f(1 << 20);
  ReadAhead ra(f.Reader(), 1 << 20, 256 * kK);
  ReadAndAfter(&ra, 0, 64 * kK);  // prefetches [64K, 128K)
  ReadAndAfter(&ra, 64 * kK, 64 * kK);
  REQUIRE(ra.stats().hits == 1);
  // The next prefetch is held in its device read.
  HeldOnThread prefetch(&f, [&] {
    IoBytes b;
    (void)ra.Read(128 * kK, 64 * kK, &b);  // a hit: no device read
    ra.After(128 * kK, 64 * kK);           // held in its device read
  });
  std::atomic<bool> done{false}, reader_ok{false};
  std::thread reader([&] {
    IoBytes b;
    reader_ok = ra.Read(192 * kK, 64 * kK, &b).ok() && Vec(b) == f.Content(192 * kK, 64 * kK);
    done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_FALSE(done.load());  // waiting for the window
  const int reads_before = f.reads();
  prefetch.Release();
  reader.join();
  CHECK(reader_ok.load());
  CHECK(f.reads() == reads_before);  // answered from the window: no second read
  CHECK(ra.stats().hits == 3);
}

TEST_CASE("read-ahead: a write drops the window, ready or still being read", "[read_ahead]") {
  FakeFile f(1 << 20);
  ReadAhead ra(f.Reader(), 1 << 20, 256 * kK);
  SECTION("ready window, write inside it") {
    ReadAndAfter(&ra, 0, 64 * kK);  // window [64K, 128K) ready
    f.Write(70 * kK, 0xee, 100);
    ra.Invalidate(70 * kK, 100);
    IoBytes b;
    REQUIRE(ra.Read(64 * kK, 64 * kK, &b).ok());
    CHECK(Vec(b) == f.Content(64 * kK, 64 * kK));
    CHECK(b[6 * kK] == 0xee);
    CHECK(ra.stats().hits == 0);
    CHECK(ra.stats().wasted == 1);
  }
  SECTION("ready window, write elsewhere: kept") {
    ReadAndAfter(&ra, 0, 64 * kK);
    f.Write(0, 0xee, 4 * kK);
    ra.Invalidate(0, 4 * kK);
    f.Write(128 * kK, 0xee, 4 * kK);
    ra.Invalidate(128 * kK, 4 * kK);
    ReadAndAfter(&ra, 64 * kK, 64 * kK);
    CHECK(ra.stats().hits == 1);
  }
  SECTION("window still being read: the old data it already has is not used") {
    IoBytes a;
    REQUIRE(ra.Read(0, 64 * kK, &a).ok());
    // The prefetch copies the old content, then is held before it returns.
    HeldOnThread prefetch(&f, [&] { ra.After(0, 64 * kK); });
    f.Write(64 * kK, 0x5a, 64 * kK);  // the write's device I/O ...
    ra.Invalidate(64 * kK, 64 * kK);  // ... then its invalidation, before its answer
    prefetch.Release();
    IoBytes b;
    REQUIRE(ra.Read(64 * kK, 64 * kK, &b).ok());
    CHECK(Vec(b) == std::vector<uint8_t>(64 * kK, 0x5a));
    CHECK(ra.stats().hits == 0);
    CHECK(ra.stats().wasted == 1);
  }
}

TEST_CASE("read-ahead: a failed prefetch is no error, the READ reads for itself", "[read_ahead]") {
  FakeFile f(1 << 20);
  ReadAhead ra(f.Reader(), 1 << 20, 256 * kK);
  IoBytes a;
  REQUIRE(ra.Read(0, 64 * kK, &a).ok());
  f.FailNext();
  ra.After(0, 64 * kK);
  CHECK(ra.stats().wasted == 1);
  IoBytes b;
  REQUIRE(ra.Read(64 * kK, 64 * kK, &b).ok());
  CHECK(Vec(b) == f.Content(64 * kK, 64 * kK));
  CHECK(ra.stats().hits == 0);
}

TEST_CASE("read-ahead: Stop waits for a prefetch in progress and ends read-ahead",
          "[read_ahead]") {
  FakeFile f(1 << 20);
  ReadAhead ra(f.Reader(), 1 << 20, 256 * kK);
  IoBytes a;
  REQUIRE(ra.Read(0, 64 * kK, &a).ok());
  HeldOnThread prefetch(&f, [&] { ra.After(0, 64 * kK); });
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    ra.Stop();
    stopped = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_FALSE(stopped.load());
  prefetch.Release();
  stopper.join();
  CHECK(stopped.load());
  const int reads = f.reads();
  IoBytes b;
  REQUIRE(ra.Read(64 * kK, 64 * kK, &b).ok());
  ra.After(64 * kK, 64 * kK);
  CHECK(f.reads() == reads + 1);  // read through, nothing prefetched
  CHECK(ra.stats().prefetches == 1);
}

// Each 4 KiB block carries its generation in its first 8 bytes. A writer
// bumps random ranges (device write, then Invalidate, then "acknowledged");
// sequential QD1 readers check that every block they get is at least as new
// as what was acknowledged when their READ began.
TEST_CASE("read-ahead: concurrent writes never make a READ return older content",
          "[read_ahead]") {
  constexpr size_t kBlocks = 256;
  constexpr size_t kB4 = 4 * kK;
  std::mutex mu;
  uint64_t gen = 0;                          // with mu
  std::vector<uint64_t> device(kBlocks, 0);  // generation per block, with mu
  std::vector<std::atomic<uint64_t>> acked(kBlocks);
  for (auto& a : acked) a = 0;
  std::atomic<uint64_t> read_errors{0};
  std::unique_ptr<ReadAhead> ra;
  // A write as dedupd makes one: the device first (each block's generation
  // only grows, as writes to a block are serialised by the range lock),
  // then Invalidate, then the answer (acked).
  auto write_blocks = [&](size_t first, size_t n) {
    const size_t last = std::min(kBlocks, first + n);
    uint64_t g;
    {
      std::lock_guard<std::mutex> l(mu);
      g = ++gen;
      for (size_t b = first; b < last; b++) device[b] = g;
    }
    ra->Invalidate(first * kB4, (last - first) * kB4);
    for (size_t b = first; b < last; b++) {
      uint64_t cur = acked[b];
      while (cur < g && !acked[b].compare_exchange_weak(cur, g)) {
      }
    }
  };
  // Whether this thread is inside After(), i.e. the device read is a
  // prefetch.
  static thread_local bool prefetching = false;
  std::atomic<uint64_t> prefetch_reads{0};
  auto reader_fn = [&](uint64_t off, void* buf, size_t len) {
    if (off % kB4 != 0 || len % kB4 != 0) {
      read_errors++;
      return Status::Invalid("unaligned");
    }
    auto* p = static_cast<uint8_t*>(buf);
    for (size_t i = 0; i < len / kB4; i++) {
      uint64_t g;
      {
        std::lock_guard<std::mutex> l(mu);
        g = device[off / kB4 + i];
      }
      std::memcpy(p + i * kB4, &g, 8);
      if (i % 4 == 3) std::this_thread::yield();  // let writes land between blocks
    }
    // Every third prefetch has a write land in its window after its device
    // read and before it is published: the race the window's staleness
    // check exists for, made to happen whatever the scheduling (left to the
    // writer thread alone, a starved machine once ran 2000 passes without
    // a write landing in a window).
    if (prefetching && ++prefetch_reads % 3 == 0) write_blocks(off / kB4 + len / kB4 / 2, 1);
    return Status::Ok();
  };
  ra = std::make_unique<ReadAhead>(reader_fn, kBlocks * kB4, 64 * kK);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> violations{0};
  // Where the readers' windows are (the block after their last READ): a
  // quarter of the writer thread's writes go there, so windows are also
  // dropped by writes that land after a prefetch was published. The writer
  // makes at most one write per READ: left free, on a starved core it ran
  // so many between two READs that no window lived to answer one.
  std::atomic<size_t> window_block{0};
  std::atomic<uint64_t> reads_done{0};
  std::thread writer([&] {
    std::mt19937 r(11);
    uint64_t writes = 0;
    while (!stop) {
      if (writes >= reads_done) {
        std::this_thread::yield();
        continue;
      }
      const size_t first = r() % 4 == 0 ? window_block.load() % kBlocks : r() % kBlocks;
      write_blocks(first, 1 + r() % 8);
      writes++;
    }
  });
  // Two readers: the first alone for its first 20 passes (a lone
  // sequential reader is what the window serves: on a starved core two
  // readers were nearly always both in flight, and in each other's
  // streams, so no window ever answered a READ), then both, usually one in
  // flight at a time, sometimes both (then no prefetch); all READs must see
  // acknowledged data. At least 40 passes each, and on until the window
  // has answered READs and prefetches have been read, for at most 60 s.
  auto covered = [&] { return ra->stats().hits > 0 && prefetch_reads >= 3; };
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::atomic<int> first_reader_passes{0};
  auto reader = [&](uint32_t seed) {
    std::mt19937 r(seed);
    if (seed != 1) {
      while (first_reader_passes < 20 && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::yield();
      }
    }
    for (int pass = 0; pass < 40 || (!covered() && std::chrono::steady_clock::now() < give_up);
         pass++) {
      if (seed == 1) first_reader_passes = pass;
      const size_t req = (1 + r() % 4) * kB4 * 4;
      for (uint64_t off = 0; off + req <= kBlocks * kB4; off += req) {
        std::vector<uint64_t> floor(req / kB4);
        for (size_t i = 0; i < floor.size(); i++) floor[i] = acked[off / kB4 + i];
        IoBytes out;
        if (!ra->Read(off, req, &out).ok()) {
          read_errors++;
          continue;
        }
        for (size_t i = 0; i < floor.size(); i++) {
          uint64_t g;
          std::memcpy(&g, out.data() + i * kB4, 8);
          if (g < floor[i]) violations++;
        }
        reads_done++;
        window_block = (off + req) / kB4;
        prefetching = true;
        ra->After(off, req);
        prefetching = false;
      }
    }
  };
  std::thread r1(reader, 1);
  std::thread r2(reader, 2);
  r1.join();
  r2.join();
  stop = true;
  writer.join();
  CHECK(violations == 0);
  CHECK(read_errors == 0);
  // The check ran with read-ahead really in use, and with windows that
  // writes made stale.
  CHECK(ra->stats().hits > 0);
  CHECK(prefetch_reads >= 3);
  CHECK(ra->stats().wasted > 0);
}

// All exports of a host share one budget: a window holds its bytes from
// its read until a READ takes it or it is dropped, and a prefetch that does
// not fit is skipped (and counted), never waited for.
TEST_CASE("read-ahead: windows of all exports stay within the host's budget", "[read_ahead]") {
  FakeFile f(1 << 20), g(1 << 20);
  ReadAheadBudget budget(64 * kK);  // one window
  ReadAhead a(f.Reader(), 1 << 20, 256 * kK, &budget);
  ReadAhead b(g.Reader(), 1 << 20, 256 * kK, &budget);
  ReadAndAfter(&a, 0, 64 * kK);
  CHECK(budget.used() == 64 * kK);
  ReadAndAfter(&b, 0, 64 * kK);  // no room: b reads through next time
  CHECK(b.stats().no_budget == 1);
  CHECK(b.stats().prefetches == 0);
  CHECK(budget.used() == 64 * kK);
  // b's next READ reads the file itself and is still right.
  CHECK(Vec(ReadAndAfter(&b, 64 * kK, 64 * kK)) == g.Content(64 * kK, 64 * kK));
  CHECK(b.stats().hits == 0);
  CHECK(b.stats().no_budget == 2);
  // a's READ takes its window and its After reads the next one: the bytes
  // went back and were taken again.
  CHECK(Vec(ReadAndAfter(&a, 64 * kK, 64 * kK)) == f.Content(64 * kK, 64 * kK));
  CHECK(a.stats().hits == 1);
  CHECK(budget.used() == 64 * kK);
  SECTION("an invalidated window gives its bytes back") {
    a.Invalidate(128 * kK, 4 * kK);
    CHECK(budget.used() == 0);
    ReadAndAfter(&b, 128 * kK, 64 * kK);
    CHECK(b.stats().prefetches == 1);
    CHECK(budget.used() == 64 * kK);
  }
  SECTION("a failed prefetch gives its bytes back") {
    IoBytes out;
    REQUIRE(a.Read(128 * kK, 64 * kK, &out).ok());  // takes the window: 0 used
    CHECK(budget.used() == 0);
    f.FailNext();
    a.After(128 * kK, 64 * kK);
    CHECK(a.stats().wasted == 1);
    CHECK(budget.used() == 0);
  }
  SECTION("a stream that moves on drops its window and its bytes") {
    IoBytes out;
    REQUIRE(a.Read(512 * kK, 64 * kK, &out).ok());
    CHECK(a.stats().wasted == 1);
    CHECK(budget.used() == 0);
  }
  SECTION("Stop gives the bytes back") {
    a.Stop();
    CHECK(budget.used() == 0);
  }
}
