#include "volume/mem_device.h"

#include <cstring>

#include "util/io_budget.h"

namespace dede {

MemDevice::MemDevice(uint64_t size, std::string name)
    : size_(size - size % kSectorSize), name_(std::move(name)), data_(size_, 0) {}

Status MemDevice::Read(uint64_t offset, void* buf, size_t len) {
  RETURN_IF_ERROR(CheckRange(offset, len));
  ChargeIo(len);
  MutexLock l(&mu_);
  std::memcpy(buf, data_.data() + offset, len);
  return Status::Ok();
}

Status MemDevice::Write(uint64_t offset, const void* buf, size_t len) {
  RETURN_IF_ERROR(CheckRange(offset, len));
  ChargeIo(len);
  MutexLock l(&mu_);
  std::memcpy(data_.data() + offset, buf, len);
  return Status::Ok();
}

Status FaultDevice::Read(uint64_t offset, void* buf, size_t len) {
  RETURN_IF_ERROR(CheckRange(offset, len));
  MutexLock l(&mu_);
  if (reads_left_ == 0) return Status::FromErrno(name() + ": injected read fault", read_error_);
  if (reads_left_ > 0) reads_left_--;
  RETURN_IF_ERROR(base_->Read(offset, buf, len));
  auto* p = static_cast<uint8_t*>(buf);
  auto it = pending_.lower_bound(offset / kSectorSize);
  for (; it != pending_.end() && it->first * kSectorSize < offset + len; ++it) {
    std::memcpy(p + (it->first * kSectorSize - offset), it->second.data(), kSectorSize);
  }
  return Status::Ok();
}

Status FaultDevice::Write(uint64_t offset, const void* buf, size_t len) {
  RETURN_IF_ERROR(CheckRange(offset, len));
  MutexLock l(&mu_);
  if (writes_left_ == 0) return Status::FromErrno(name() + ": injected write fault", write_error_);
  if (writes_left_ > 0) writes_left_--;
  writes_++;
  auto* p = static_cast<const uint8_t*>(buf);
  for (size_t o = 0; o < len; o += kSectorSize) {
    pending_[(offset + o) / kSectorSize].assign(p + o, p + o + kSectorSize);
  }
  return Status::Ok();
}

Status FaultDevice::Flush() {
  MutexLock l(&mu_);
  if (writes_left_ == 0) return Status::FromErrno(name() + ": injected flush fault", write_error_);
  for (auto& [sector, bytes] : pending_) {
    RETURN_IF_ERROR(base_->Write(sector * kSectorSize, bytes.data(), kSectorSize));
  }
  pending_.clear();
  flushes_++;
  return base_->Flush();
}

void FaultDevice::Crash(std::mt19937_64& rng, double keep_probability) {
  MutexLock l(&mu_);
  std::bernoulli_distribution keep(keep_probability);
  for (auto& [sector, bytes] : pending_) {
    if (keep(rng)) (void)base_->Write(sector * kSectorSize, bytes.data(), kSectorSize);
  }
  pending_.clear();
  writes_left_ = reads_left_ = -1;
}

void FaultDevice::FailWritesAfter(uint64_t n, int error) {
  MutexLock l(&mu_);
  writes_left_ = static_cast<int64_t>(n);
  write_error_ = error;
}

void FaultDevice::FailReadsAfter(uint64_t n, int error) {
  MutexLock l(&mu_);
  reads_left_ = static_cast<int64_t>(n);
  read_error_ = error;
}

void FaultDevice::ClearFault() {
  MutexLock l(&mu_);
  writes_left_ = reads_left_ = -1;
}

}  // namespace dede
