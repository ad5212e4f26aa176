#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <set>

#include "util/mutex.h"
#include "volume/lock_manager.h"

namespace dede {

std::string LockId::ToString() const {
  switch (kind) {
    case LockKind::kVolume: return "volume";
    case LockKind::kHostSlot: return "host slot " + std::to_string(id);
    case LockKind::kNamespace: return "namespace";
    case LockKind::kInode: return "inode " + std::to_string(id);
    case LockKind::kGroup: return "allocation group " + std::to_string(id);
    case LockKind::kRecovery: return "recovery of host slot " + std::to_string(id);
    case LockKind::kIndexShard: return "index shard " + std::to_string(id);
    case LockKind::kWanted:
      return "waiters for " +
             LockId{static_cast<LockKind>(id >> 40), id & ((1ull << 40) - 1)}.ToString();
    case LockKind::kWaiting:
      return "blocked waiters for " +
             LockId{static_cast<LockKind>(id >> 40), id & ((1ull << 40) - 1)}.ToString();
  }
  return "lock " + std::to_string(static_cast<int>(kind)) + ":" + std::to_string(id);
}

namespace {

class LocalLockManager : public LockManager {
 public:
  LocalLockManager(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~LocalLockManager() override { ::close(fd_); }  // closing drops every OFD lock

  Status Acquire(LockId id, LockMode mode, bool wait) override {
    struct flock fl = Range(id);
    fl.l_type = mode == LockMode::kExclusive ? F_WRLCK : F_RDLCK;
    {
      MutexLock l(&mu_);
      // (OFD locks of one description never conflict with each other: two
      // threads must not both take one id.)
      if (held_.count(id) || acquiring_.count(id)) {
        return Status::Invalid(id.ToString() + " is already held here");
      }
      if (!wait) {
        Status st = Set(id, &fl, F_OFD_SETLK);
        if (st.ok()) held_[id] = mode;
        return st;
      }
      acquiring_.insert(id);
    }
    // Blocking: not under mu_, which every other lock operation of this
    // process needs (a wait for one process's lock must not stall them all).
    Status st = Set(id, &fl, F_OFD_SETLKW);
    MutexLock l(&mu_);
    acquiring_.erase(id);
    if (st.ok()) held_[id] = mode;
    return st;
  }

  Status Release(LockId id) override {
    MutexLock l(&mu_);
    if (!held_.erase(id)) return Status::Invalid(id.ToString() + " is not held here");
    struct flock fl = Range(id);
    fl.l_type = F_UNLCK;
    if (::fcntl(fd_, F_OFD_SETLK, &fl) != 0) {
      return Status::FromErrno("unlocking " + id.ToString(), errno);
    }
    return Status::Ok();
  }

  std::vector<std::pair<LockId, LockMode>> Held() override {

    MutexLock l(&mu_);

    return std::vector<std::pair<LockId, LockMode>>(held_.begin(), held_.end());

  }

  Result<bool> IsHeldElsewhere(LockId id) override {
    MutexLock l(&mu_);
    struct flock fl = Range(id);
    fl.l_type = F_WRLCK;
    // F_OFD_GETLK ignores our own locks only when they are on this open file
    // description; that is exactly "elsewhere".
    if (::fcntl(fd_, F_OFD_GETLK, &fl) != 0) {
      return Status::FromErrno("querying " + id.ToString(), errno);
    }
    return fl.l_type != F_UNLCK;
  }

 private:
  Status Set(LockId id, struct flock* fl, int cmd) {
    while (::fcntl(fd_, cmd, fl) != 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EACCES) {
        return Status::Locked(id.ToString() + " is held by another process");
      }
      return Status::FromErrno("locking " + id.ToString() + " on " + path_, errno);
    }
    return Status::Ok();
  }

  static struct flock Range(LockId id) {
    struct flock fl {};
    fl.l_whence = SEEK_SET;
    fl.l_start = static_cast<off_t>((1ull << 62) + (uint64_t{static_cast<uint16_t>(id.kind)} << 48) +
                                    id.id);
    fl.l_len = 1;
    fl.l_pid = 0;
    return fl;
  }

  std::string path_;
  int fd_;
  Mutex mu_;
  std::map<LockId, LockMode> held_ GUARDED_BY(mu_);
  std::set<LockId> acquiring_ GUARDED_BY(mu_);  // waiting in F_OFD_SETLKW
};

}  // namespace

std::string LocalLockDir() {
  static constexpr const char* kDir = "/run/dede";
  ::mkdir(kDir, 0700);
  return kDir;
}

std::string LocalVolumeLockPath(const std::string& uuid_text) {
  return LocalLockDir() + "/" + uuid_text + ".lock";
}

std::string SanlockHostLockPath(const std::string& uuid_text) {
  static constexpr const char* kDefaultRunDir = "/run/sanlock";
  const char* env = std::getenv("SANLOCK_RUN_DIR");
  std::string run_dir = env != nullptr && *env != '\0' ? env : kDefaultRunDir;
  // One daemon, however its directory is spelled (/var/run is /run).
  if (char* real = ::realpath(run_dir.c_str(), nullptr)) {
    run_dir = real;
    std::free(real);
  }
  std::string key;
  if (char* real_default = ::realpath(kDefaultRunDir, nullptr)) {
    if (run_dir == real_default) run_dir = kDefaultRunDir;
    std::free(real_default);
  }
  if (run_dir != kDefaultRunDir) {
    key = "@";
    for (char c : run_dir) {
      if (c == '/') {
        key += "%2F";
      } else if (c == '%') {
        key += "%25";
      } else {
        key += c;
      }
    }
  }
  return LocalLockDir() + "/" + uuid_text + key + ".lock";
}

Result<std::unique_ptr<LockManager>> OpenLocalLockManager(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return Status::FromErrno("cannot open lock file " + path, errno);
  return std::unique_ptr<LockManager>(new LocalLockManager(path, fd));
}

}  // namespace dede
