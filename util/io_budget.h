// Dedup I/O accounting. Work that must be throttled (a dedup pass) marks the
// threads it runs on with a ScopedIoBudget; the device backends charge every
// read and write such a thread issues to that budget (ChargeIo). Device I/O of
// unmarked threads, the VMs' data path, is never charged.
//
// Charging only records a debt: it never sleeps, because the thread may hold
// volume locks at that moment and a sleep there would stall the VMs' writes.
// The throttled work pays the debt (sleeps) at points where it holds no
// volume lock (IoThrottle::Settle in agent/).
#pragma once

#include <cstdint>

namespace dede {

class IoBudget {
 public:
  virtual ~IoBudget() = default;
  // Called on the I/O issuing thread after each device read or write; must
  // be cheap and thread-safe (helper threads of one pass share a budget).
  virtual void Charge(uint64_t bytes) = 0;
};

// The budget this thread's device I/O is charged to; nullptr for none.
IoBudget* CurrentIoBudget();

inline void ChargeIo(uint64_t bytes) {
  if (IoBudget* b = CurrentIoBudget()) b->Charge(bytes);
}

// Charges this thread's device I/O to `budget` (may be nullptr: none) until
// destroyed; scopes nest.
class ScopedIoBudget {
 public:
  explicit ScopedIoBudget(IoBudget* budget);
  ~ScopedIoBudget();
  ScopedIoBudget(const ScopedIoBudget&) = delete;
  ScopedIoBudget& operator=(const ScopedIoBudget&) = delete;

 private:
  IoBudget* prev_;
};

}  // namespace dede
