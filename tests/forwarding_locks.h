// A lock manager that passes every call to another one; tests derive from
// it and override only what they intercept (a failure, a hook, a probe),
// like ForwardingDevice for devices.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "volume/lock_manager.h"

namespace dede::test {

class ForwardingLocks : public LockManager {
 public:
  explicit ForwardingLocks(std::shared_ptr<LockManager> base) : base_(std::move(base)) {}
  Status Acquire(LockId id, LockMode mode, bool wait) override {
    return base_->Acquire(id, mode, wait);
  }
  Status Release(LockId id) override { return base_->Release(id); }
  Result<bool> IsHeldElsewhere(LockId id) override { return base_->IsHeldElsewhere(id); }
  std::vector<std::pair<LockId, LockMode>> Held() override { return base_->Held(); }
  Status ReleaseUnclean(LockId id) override { return base_->ReleaseUnclean(id); }
  void Abandon() override { base_->Abandon(); }
  bool ReportsDeadHolders() const override { return base_->ReportsDeadHolders(); }
  uint64_t dead_holders_replaced() const override { return base_->dead_holders_replaced(); }
  Result<uint32_t> RepairLockTablePartition(uint32_t p) override {
    return base_->RepairLockTablePartition(p);
  }

 protected:
  LockManager* base() const { return base_.get(); }

 private:
  std::shared_ptr<LockManager> base_;
};

}  // namespace dede::test
