#include "agent/read_ahead.h"

#include <algorithm>
#include <cstring>
#include <mutex>

namespace dede {

bool ReadAheadBudget::TryTake(uint64_t n) {
  uint64_t cur = used_.load(std::memory_order_relaxed);
  do {
    if (cur > cap_ || n > cap_ - cur) return false;
  } while (!used_.compare_exchange_weak(cur, cur + n, std::memory_order_relaxed));
  return true;
}

ReadAhead::ReadAhead(ReadFn read, uint64_t file_size, size_t max_bytes, ReadAheadBudget* budget)
    : read_(std::move(read)), file_size_(file_size), max_bytes_(max_bytes), budget_(budget) {}

ReadAhead::~ReadAhead() { Stop(); }

// The condition variable needs the native mutex, which the analysis cannot
// follow through std::unique_lock; every GUARDED_BY field below is touched
// with mu_ locked, checked by hand.
Status ReadAhead::Read(uint64_t offset, size_t len, IoBytes* out) NO_THREAD_SAFETY_ANALYSIS {
  IoBytes window;
  uint64_t window_offset = 0;
  IoBytes unused;  // a window the stream moved past: freed after unlocking
  {
    std::unique_lock<std::mutex> l(mu_.native());
    last_sequential_ = offset == next_expected_;
    last_start_ = offset;
    next_expected_ = offset + len;
    reads_in_flight_++;
    if (max_bytes_ > 0 && len > 0) {
      // A window being read for this READ: wait for it rather than read
      // the same blocks twice.
      cv_.wait(l, [&]() NO_THREAD_SAFETY_ANALYSIS {
        return state_ != State::kReading || !Overlaps(offset, len);
      });
      if (state_ == State::kReady) {
        if (Covers(offset, len)) {
          window = std::move(win_);
          window_offset = win_offset_;
          stats_.hits++;
        } else {
          unused = std::move(win_);
          stats_.wasted++;  // the stream moved on: one window only
        }
        win_ = IoBytes();
        state_ = State::kEmpty;
        ReturnBudget();
      }
    }
  }
  unused = IoBytes();
  Status st;
  if (!window.empty()) {
    if (window_offset == offset && window.size() == len) {
      *out = std::move(window);
    } else {
      out->resize(len);
      std::memcpy(out->data(), window.data() + (offset - window_offset), len);
    }
  } else {
    out->resize(len);
    st = read_(offset, out->data(), len);
  }
  MutexLock l(&mu_);
  reads_in_flight_--;
  return st;
}

void ReadAhead::After(uint64_t offset, size_t len) NO_THREAD_SAFETY_ANALYSIS {
  if (max_bytes_ == 0 || len == 0 || len > max_bytes_) return;
  const uint64_t end = offset + len;
  uint64_t start;
  size_t n;
  {
    MutexLock l(&mu_);
    if (stopped_ || state_ != State::kEmpty || !last_sequential_) return;
    if (reads_in_flight_ == 0 && next_expected_ == end) {
      // The reader waits for this reply: read its next request now.
      start = end;
      n = len;
    } else if (reads_in_flight_ == 1 && last_start_ == end && next_expected_ - end <= max_bytes_) {
      // Its next request arrived before this call (a loaded host answers
      // late) and is being read: read the one after it, or the stream
      // would go unprefetched until a reply beats the next request again.
      start = next_expected_;
      n = static_cast<size_t>(next_expected_ - end);
    } else {
      // Other READs in flight (a deeper queue keeps the device busy
      // itself), or the stream moved elsewhere.
      return;
    }
    if (start >= file_size_ || n == 0) return;
    n = static_cast<size_t>(std::min<uint64_t>(n, file_size_ - start));
    if (budget_ != nullptr && !budget_->TryTake(n)) {
      stats_.no_budget++;
      return;
    }
    charged_ = budget_ != nullptr ? n : 0;
    state_ = State::kReading;
    stale_ = false;
    win_offset_ = start;
    win_len_ = n;
  }
  IoBytes buf;
  buf.resize(n);
  Status st = read_(start, buf.data(), n);
  IoBytes drop;  // freed outside mu_
  {
    MutexLock l(&mu_);
    stats_.prefetches++;
    stats_.bytes_prefetched += n;
    if (st.ok() && !stale_) {
      win_ = std::move(buf);
      state_ = State::kReady;
    } else {
      // A failed read is not an error of any request: a READ of these
      // blocks reads them itself and reports what it finds.
      drop = std::move(buf);
      stats_.wasted++;
      state_ = State::kEmpty;
      ReturnBudget();
    }
  }
  cv_.notify_all();
}

void ReadAhead::Invalidate(uint64_t offset, uint64_t len) {
  if (max_bytes_ == 0) return;
  IoBytes drop;  // freed outside mu_
  MutexLock l(&mu_);
  if (state_ == State::kEmpty || !Overlaps(offset, std::max<uint64_t>(len, 1))) return;
  if (state_ == State::kReading) {
    stale_ = true;
  } else {
    drop = std::move(win_);
    win_ = IoBytes();
    state_ = State::kEmpty;
    stats_.wasted++;
    ReturnBudget();
  }
}

void ReadAhead::Stop() NO_THREAD_SAFETY_ANALYSIS {
  IoBytes drop;  // freed outside mu_
  std::unique_lock<std::mutex> l(mu_.native());
  stopped_ = true;
  cv_.wait(l, [&]() NO_THREAD_SAFETY_ANALYSIS { return state_ != State::kReading; });
  drop = std::move(win_);
  win_ = IoBytes();
  state_ = State::kEmpty;
  ReturnBudget();
}

ReadAheadStats ReadAhead::stats() {
  MutexLock l(&mu_);
  return stats_;
}

}  // namespace dede
