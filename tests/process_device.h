// ProcessDevice: one process's view of a shared device, for crash tests.
// DieAfter(n): after n more writes the process is dead as far as the disk
// is concerned: later writes land in a private overlay (its own reads see
// them, so it runs on consistently without noticing) and its flushes do
// nothing. Nothing of the overlay ever reaches the device.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "volume/block_device.h"

namespace dede::test {

class ProcessDevice : public BlockDevice {
 public:
  explicit ProcessDevice(BlockDevice* base) : base_(base) {}
  void DieAfter(uint64_t n) {
    std::lock_guard<std::mutex> l(mu_);
    left_ = int64_t(n);
  }
  void DieNow() { DieAfter(0); }
  bool dead() {
    std::lock_guard<std::mutex> l(mu_);
    return left_ == 0;
  }
  uint64_t writes() {
    std::lock_guard<std::mutex> l(mu_);
    return writes_;
  }
  uint64_t size_bytes() const override { return base_->size_bytes(); }
  Status Read(uint64_t offset, void* buf, size_t len) override {
    RETURN_IF_ERROR(base_->Read(offset, buf, len));
    std::lock_guard<std::mutex> l(mu_);
    auto* p = static_cast<uint8_t*>(buf);
    for (auto it = overlay_.lower_bound(offset / kSectorSize);
         it != overlay_.end() && it->first * kSectorSize < offset + len; ++it) {
      std::memcpy(p + (it->first * kSectorSize - offset), it->second.data(), kSectorSize);
    }
    return Status::Ok();
  }
  Status Write(uint64_t offset, const void* buf, size_t len) override {
    RETURN_IF_ERROR(CheckRange(offset, len));
    std::unique_lock<std::mutex> l(mu_);
    if (left_ != 0) {
      if (left_ > 0) left_--;
      writes_++;
      l.unlock();
      return base_->Write(offset, buf, len);
    }
    const auto* p = static_cast<const uint8_t*>(buf);
    for (size_t o = 0; o < len; o += kSectorSize) {
      overlay_[(offset + o) / kSectorSize].assign(p + o, p + o + kSectorSize);
    }
    return Status::Ok();
  }
  Status Flush() override {
    if (dead()) return Status::Ok();
    return base_->Flush();
  }
  std::string name() const override { return "process(" + base_->name() + ")"; }

 private:
  BlockDevice* base_;
  std::mutex mu_;
  int64_t left_ = -1;
  uint64_t writes_ = 0;
  std::map<uint64_t, std::vector<uint8_t>> overlay_;
};

}  // namespace dede::test
