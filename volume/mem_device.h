// In-memory devices for unit tests: MemDevice is a plain RAM disk;
// FaultDevice wraps any device and models a crash (unflushed writes are
// dropped or torn), EIO and ENOSPC on a trigger.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <vector>

#include "util/mutex.h"
#include "volume/block_device.h"

namespace dede {

class MemDevice : public BlockDevice {
 public:
  explicit MemDevice(uint64_t size, std::string name = "mem");
  uint64_t size_bytes() const override { return size_; }
  Status Read(uint64_t offset, void* buf, size_t len) override;
  Status Write(uint64_t offset, const void* buf, size_t len) override;
  Status Flush() override { return Status::Ok(); }
  std::string name() const override { return name_; }
  std::vector<uint8_t>& bytes() NO_THREAD_SAFETY_ANALYSIS { return data_; }

 private:
  uint64_t size_;
  std::string name_;
  Mutex mu_;
  std::vector<uint8_t> data_ GUARDED_BY(mu_);
};

// Keeps writes since the last Flush() in a side buffer (reads see them).
// Crash() then keeps each pending sector write with probability
// `keep_probability` (so writes can be torn at sector granularity and
// reordered), discards the rest, and turns the device back on.
class FaultDevice : public BlockDevice {
 public:
  explicit FaultDevice(BlockDevice* base) : base_(base) {}
  uint64_t size_bytes() const override { return base_->size_bytes(); }
  Status Read(uint64_t offset, void* buf, size_t len) override;
  Status Write(uint64_t offset, const void* buf, size_t len) override;
  Status Flush() override;
  std::string name() const override { return "fault(" + base_->name() + ")"; }

  void Crash(std::mt19937_64& rng, double keep_probability);
  // After `n` more successful writes, every write fails with `error`
  // (EIO or ENOSPC) until ClearFault().
  void FailWritesAfter(uint64_t n, int error);
  void FailReadsAfter(uint64_t n, int error);
  void ClearFault();
  uint64_t writes() { MutexLock l(&mu_); return writes_; }
  uint64_t flushes() { MutexLock l(&mu_); return flushes_; }

 private:
  BlockDevice* base_;
  Mutex mu_;
  // sector index -> pending sector contents, in write order per sector.
  std::map<uint64_t, std::vector<uint8_t>> pending_ GUARDED_BY(mu_);
  uint64_t writes_ GUARDED_BY(mu_) = 0;
  uint64_t flushes_ GUARDED_BY(mu_) = 0;
  int64_t writes_left_ GUARDED_BY(mu_) = -1;
  int64_t reads_left_ GUARDED_BY(mu_) = -1;
  int write_error_ GUARDED_BY(mu_) = 0;
  int read_error_ GUARDED_BY(mu_) = 0;
};

}  // namespace dede
