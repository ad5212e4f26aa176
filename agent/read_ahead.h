// ReadAhead: one export's sequential read-ahead window.
//
// At queue depth 1 a sequential reader (a VM copying or booting from its
// disk, `qemu-img convert`, fio QD1) leaves the device idle while each
// reply crosses the socket and the next request comes back: the device
// read and the socket copy run one after the other. After such a read has
// been answered, the worker that served it reads the next request's worth
// of the file into this window, so the device works while the reply is in
// flight; the next READ that the window covers is answered from memory.
//
// When it prefetches: the READ continued the previous READ exactly (offset
// == the previous one's end) and no other READ of the export was in flight
// when it finished. Deeper queues already keep the device busy, so they
// never pay for a read nobody asked for. One exception: when the only READ
// in flight is this stream's next one (on a loaded host the client's next
// request often arrives before the worker gets to After()), the window is
// the request after that one, so the stream gets ahead again instead of
// going unprefetched. The window is one request long, capped at
// `max_bytes`, and never crosses the end of the file.
//
// Coherence: the window holds file content, so every change of content
// must pass Invalidate() after its device I/O finished and before it is
// acknowledged (Export's WRITE, TRIM and WRITE_ZEROES do). A window being
// read when Invalidate() overlaps it is marked stale and dropped when its
// read ends; a window read that starts after the invalidation reads the
// new content. Dedup passes and merge requests change which physical block
// holds a file block, never its content, so they need not invalidate.
// A READ served from the window therefore never returns data older than a
// write that was acknowledged before the READ arrived.
//
// Memory: a window holds its bytes from the start of its read until a READ
// takes it or it is dropped; a reader that stops after a prefetch leaves it
// in place until its next READ or the export closes. All exports of a host
// share a ReadAheadBudget: a prefetch that does not fit is skipped.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>

#include "util/io_buffer.h"
#include "util/mutex.h"
#include "util/status.h"

namespace dede {

struct ReadAheadStats {
  uint64_t prefetches = 0;  // windows read
  uint64_t hits = 0;        // READs answered from a window
  uint64_t wasted = 0;      // windows dropped unused (invalidated, skipped, failed)
  uint64_t bytes_prefetched = 0;
  uint64_t no_budget = 0;   // prefetches skipped: the host's budget was spent
};

inline void AddReadAheadStats(ReadAheadStats* to, const ReadAheadStats& s) {
  to->prefetches += s.prefetches;
  to->hits += s.hits;
  to->wasted += s.wasted;
  to->bytes_prefetched += s.bytes_prefetched;
  to->no_budget += s.no_budget;
}

// Bytes all of a host's windows may hold at once. Thread-safe.
class ReadAheadBudget {
 public:
  explicit ReadAheadBudget(uint64_t cap_bytes) : cap_(cap_bytes) {}
  // Takes `n` bytes if they fit under the cap.
  bool TryTake(uint64_t n);
  void Give(uint64_t n) { used_.fetch_sub(n, std::memory_order_relaxed); }
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t cap() const { return cap_; }

 private:
  const uint64_t cap_;
  std::atomic<uint64_t> used_{0};
};

class ReadAhead {
 public:
  // Reads file content into a buffer: the export's File::Read.
  using ReadFn = std::function<Status(uint64_t offset, void* buf, size_t len)>;

  // `max_bytes` 0 disables read-ahead (Read() then always reads through).
  // `budget`: shared by the host's exports, outlives this; nullptr: none.
  ReadAhead(ReadFn read, uint64_t file_size, size_t max_bytes, ReadAheadBudget* budget = nullptr);
  ~ReadAhead();

  // A READ: fills `out` with [offset, offset + len) from the window when it
  // covers the range (waiting for a window still being read), else from
  // the file.
  Status Read(uint64_t offset, size_t len, IoBytes* out) EXCLUDES(mu_);

  // After the READ of [offset, offset + len) was answered: prefetches the
  // next window on the calling thread when the READ was sequential at
  // queue depth 1 (see above). Blocking: device I/O.
  void After(uint64_t offset, size_t len) EXCLUDES(mu_);

  // Content of [offset, offset + len) changed (or may have): drop what the
  // window holds of it.
  void Invalidate(uint64_t offset, uint64_t len) EXCLUDES(mu_);

  // No more prefetches; waits for one in progress. The export calls it
  // before closing its file: a prefetch may outlive its request's client.
  void Stop() EXCLUDES(mu_);

  ReadAheadStats stats() EXCLUDES(mu_);

 private:
  enum class State { kEmpty, kReading, kReady };

  bool Covers(uint64_t offset, size_t len) const REQUIRES(mu_) {
    return offset >= win_offset_ && offset + len <= win_offset_ + win_len_;
  }
  bool Overlaps(uint64_t offset, uint64_t len) const REQUIRES(mu_) {
    return offset < win_offset_ + win_len_ && win_offset_ < offset + len;
  }
  // The window is gone (taken, dropped, failed): its bytes go back.
  void ReturnBudget() REQUIRES(mu_) {
    if (budget_ != nullptr && charged_ > 0) budget_->Give(charged_);
    charged_ = 0;
  }

  const ReadFn read_;
  const uint64_t file_size_;
  const size_t max_bytes_;
  ReadAheadBudget* const budget_;

  Mutex mu_;
  std::condition_variable cv_;  // with mu_: a kReading window ended
  State state_ GUARDED_BY(mu_) = State::kEmpty;
  bool stale_ GUARDED_BY(mu_) = false;  // kReading: invalidated meanwhile
  bool stopped_ GUARDED_BY(mu_) = false;
  uint64_t win_offset_ GUARDED_BY(mu_) = 0;
  size_t win_len_ GUARDED_BY(mu_) = 0;
  IoBytes win_ GUARDED_BY(mu_);
  uint64_t charged_ GUARDED_BY(mu_) = 0;  // budget bytes the window holds
  // The end of the last READ to start, and READs between Read()'s start and
  // return: a READ starting at next_expected_ continues the stream.
  uint64_t next_expected_ GUARDED_BY(mu_) = 0;
  bool last_sequential_ GUARDED_BY(mu_) = false;
  uint64_t last_start_ GUARDED_BY(mu_) = 0;  // offset of the last READ to start
  int reads_in_flight_ GUARDED_BY(mu_) = 0;
  ReadAheadStats stats_ GUARDED_BY(mu_);
};

}  // namespace dede
