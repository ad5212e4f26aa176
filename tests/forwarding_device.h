// Test devices that wrap another device: ForwardingDevice passes every
// command through, and the tests' wrappers override only what they
// intercept (a cut, a gate, a delay, a count).
#pragma once

#include <atomic>
#include <string>

#include "volume/block_device.h"

namespace dede::test {

// Passes size, reads, writes and flushes to `base`. Discard is not
// passed on (BlockDevice's default: a no-op), as none of the wrappers
// built on this ever did. name() is "TAG(base's name)".
class ForwardingDevice : public BlockDevice {
 public:
  ForwardingDevice(BlockDevice* base, std::string tag) : base_(base), tag_(std::move(tag)) {}
  uint64_t size_bytes() const override { return base_->size_bytes(); }
  Status Read(uint64_t offset, void* buf, size_t len) override {
    return base_->Read(offset, buf, len);
  }
  Status Write(uint64_t offset, const void* buf, size_t len) override {
    return base_->Write(offset, buf, len);
  }
  Status Flush() override { return base_->Flush(); }
  std::string name() const override { return tag_ + "(" + base_->name() + ")"; }

 protected:
  BlockDevice* base() const { return base_; }

 private:
  BlockDevice* const base_;
  const std::string tag_;
};

// What a process writes through: Cut() makes every later write and flush
// vanish (reported as done), so a dying volume's destructors run as they
// would on a healthy device without changing the disk. Reads still reach
// the device.
class CutDevice : public ForwardingDevice {
 public:
  explicit CutDevice(BlockDevice* base) : ForwardingDevice(base, "cut") {}
  void Cut() { cut_ = true; }
  Status Write(uint64_t offset, const void* buf, size_t len) override {
    return cut_ ? CheckRange(offset, len) : base()->Write(offset, buf, len);
  }
  Status Flush() override { return cut_ ? Status::Ok() : base()->Flush(); }

 private:
  std::atomic<bool> cut_{false};  // writer threads may be mid-write when it dies
};

}  // namespace dede::test
