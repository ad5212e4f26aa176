// Mutex with clang thread-safety annotations (-Wthread-safety). libstdc++'s
// std::mutex is not annotated, so every lock in dede goes through these.
#pragma once

#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#if defined(__clang__)
#define DEDE_TSA(x) __attribute__((x))
#else
#define DEDE_TSA(x)
#endif

#define CAPABILITY(x) DEDE_TSA(capability(x))
#define SCOPED_CAPABILITY DEDE_TSA(scoped_lockable)
#define GUARDED_BY(x) DEDE_TSA(guarded_by(x))
#define PT_GUARDED_BY(x) DEDE_TSA(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) DEDE_TSA(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) DEDE_TSA(acquired_after(__VA_ARGS__))
#define REQUIRES(...) DEDE_TSA(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) DEDE_TSA(requires_shared_capability(__VA_ARGS__))
#define ACQUIRE(...) DEDE_TSA(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) DEDE_TSA(acquire_shared_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) DEDE_TSA(try_acquire_capability(__VA_ARGS__))
#define RELEASE(...) DEDE_TSA(release_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) DEDE_TSA(release_shared_capability(__VA_ARGS__))
#define EXCLUDES(...) DEDE_TSA(locks_excluded(__VA_ARGS__))
#define NO_THREAD_SAFETY_ANALYSIS DEDE_TSA(no_thread_safety_analysis)

namespace dede {

class CAPABILITY("mutex") Mutex {
 public:
  void Lock() ACQUIRE() { mu_.lock(); }
  // True with the mutex held; false (not held) if another thread holds it.
  bool TryLock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  std::mutex& native() { return mu_; }

 private:
  std::mutex mu_;
};

class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* mu_;
};

class CAPABILITY("shared_mutex") SharedMutex {
 public:
  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  void LockShared() ACQUIRE_SHARED() { mu_.lock_shared(); }
  void UnlockShared() RELEASE_SHARED() { mu_.unlock_shared(); }

 private:
  std::shared_mutex mu_;
};

class SCOPED_CAPABILITY WriterLock {
 public:
  explicit WriterLock(SharedMutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~WriterLock() RELEASE() { mu_->Unlock(); }

 private:
  SharedMutex* mu_;
};

class SCOPED_CAPABILITY ReaderLock {
 public:
  explicit ReaderLock(SharedMutex* mu) ACQUIRE_SHARED(mu) : mu_(mu) { mu_->LockShared(); }
  ~ReaderLock() RELEASE() { mu_->UnlockShared(); }

 private:
  SharedMutex* mu_;
};

}  // namespace dede
