// dede-lun-fuse: a test stand-in for a host's kernel iSCSI initiator.
//
//   dede-lun-fuse iscsi://HOST:PORT/IQN/LUN MOUNTPOINT [-f] [--timeout SEC]
//
// Mounts a FUSE filesystem at MOUNTPOINT holding one regular file, `lun`,
// as large as the iSCSI LUN; every read, write and fsync of that file is a
// SCSI command to the target through libiscsi, so whoever uses the file
// (sanlock's lease I/O in the multi-host rig, tests/integration/
// cluster_rig.h) really crosses the network, as it would through
// /dev/sdX on a real host. Files are opened with FOPEN_DIRECT_IO: no page
// cache between the caller and the LUN, O_DIRECT opens and Linux AIO
// (sanlock uses both) work as on a block device.
//
// Failure model (what a cut network looks like): every request has a
// deadline of --timeout seconds (default 5) for the whole exchange,
// including reconnecting; past it the request fails with EIO and the
// session is dropped (the next request logs in again, again bounded), so a
// caller sees I/O errors rather than a bridge wedged forever. Requests are
// served one at a time (single-threaded FUSE loop, one iSCSI session under
// one mutex). SIGTERM/SIGINT unmount and exit (after the request in
// flight, at most --timeout later); SIGKILL always works, leaving a mount
// that `fusermount3 -u -z` removes.
//
// Only for tests: installed nowhere.
#define FUSE_USE_VERSION 35

#include <errno.h>
#include <fuse.h>
#include <iscsi/iscsi.h>
#include <iscsi/scsi-lowlevel.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "util/mutex.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kFileName = "lun";
constexpr const char* kFilePath = "/lun";

void Logf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void Logf(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "dede-lun-fuse: ");
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
}

// Completion of one asynchronous libiscsi call.
struct Completion {
  bool done = false;
  int status = SCSI_STATUS_ERROR;
  scsi_task* task = nullptr;  // for SCSI commands: ours to free
};

void OnComplete(iscsi_context*, int status, void* command_data, void* private_data) {
  auto* c = static_cast<Completion*>(private_data);
  c->done = true;
  c->status = status;
  c->task = static_cast<scsi_task*>(command_data);
}

// One iSCSI session to one LUN, re-established on demand. Every call is
// bounded by a deadline: the event loop is ours (poll + iscsi_service), so
// neither TCP retransmissions nor libiscsi's reconnect logic can hold a
// caller past it.
class Lun {
 public:
  Lun(std::string url, int timeout_s) : url_(std::move(url)), timeout_s_(timeout_s) {}
  ~Lun() {
    dede::MutexLock l(&mu_);
    Drop();
  }

  // Connects and reads the capacity; false (logged) on failure.
  bool Open() {
    dede::MutexLock l(&mu_);
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(timeout_s_);
    if (!Connect(deadline)) return false;
    Completion c;
    if (iscsi_readcapacity16_task(ctx_, lun_, OnComplete, &c) == nullptr || !Wait(&c, deadline) ||
        c.status != SCSI_STATUS_GOOD) {
      Logf("READ CAPACITY(16) failed: %s", ctx_ ? iscsi_get_error(ctx_) : "timed out");
      Free(&c);
      Drop();
      return false;
    }
    auto* rc16 = static_cast<scsi_readcapacity16*>(scsi_datain_unmarshall(c.task));
    if (rc16 == nullptr || rc16->block_length == 0) {
      Logf("cannot decode READ CAPACITY(16)");
      Free(&c);
      Drop();
      return false;
    }
    block_ = rc16->block_length;
    size_ = (rc16->returned_lba + 1) * block_;
    Free(&c);
    return true;
  }

  uint64_t size() const { return size_; }
  uint32_t block() const { return block_; }

  // Reads or writes whole blocks [lba, lba + len / block). 0 or -EIO.
  int Read(uint64_t lba, uint8_t* buf, uint32_t len) EXCLUDES(mu_) {
    return Io(false, lba, buf, len);
  }
  int Write(uint64_t lba, const uint8_t* buf, uint32_t len) EXCLUDES(mu_) {
    return Io(true, lba, const_cast<uint8_t*>(buf), len);
  }
  int Sync() EXCLUDES(mu_) {
    dede::MutexLock l(&mu_);
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(timeout_s_);
    while (Clock::now() < deadline) {
      if (!Connect(deadline)) break;
      Completion c;
      if (iscsi_synchronizecache10_task(ctx_, lun_, 0, 0, 0, 0, OnComplete, &c) != nullptr &&
          Wait(&c, deadline) && c.status == SCSI_STATUS_GOOD) {
        Free(&c);
        return 0;
      }
      Complain("SYNCHRONIZE CACHE", &c);
    }
    return -EIO;
  }

 private:
  int Io(bool write, uint64_t lba, uint8_t* buf, uint32_t len) EXCLUDES(mu_) {
    dede::MutexLock l(&mu_);
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(timeout_s_);
    // Retried (on a fresh session) until the deadline: READ and WRITE of
    // whole blocks are idempotent.
    while (Clock::now() < deadline) {
      if (!Connect(deadline)) break;
      Completion c;
      scsi_task* t = write ? iscsi_write16_task(ctx_, lun_, lba, buf, len, static_cast<int>(block_),
                                                0, 0, 0, 0, 0, OnComplete, &c)
                           : iscsi_read16_task(ctx_, lun_, lba, len, static_cast<int>(block_), 0, 0,
                                               0, 0, 0, OnComplete, &c);
      if (t != nullptr && Wait(&c, deadline) && c.status == SCSI_STATUS_GOOD) {
        if (!write) {
          if (c.task->datain.size < static_cast<int>(len)) {
            Logf("READ(16) lba %llu: short data (%d of %u bytes)",
                 static_cast<unsigned long long>(lba), c.task->datain.size, len);
            Free(&c);
            return -EIO;
          }
          std::memcpy(buf, c.task->datain.data, len);
        }
        Free(&c);
        return 0;
      }
      Complain(write ? "WRITE(16)" : "READ(16)", &c);
    }
    return -EIO;
  }

  // Logs a failed command and drops the session (unless the target merely
  // answered with a CHECK CONDITION, e.g. a unit attention after a new
  // login: then the retry goes out on the same session).
  void Complain(const char* what, Completion* c) REQUIRES(mu_) {
    const bool check = c->done && c->status == SCSI_STATUS_CHECK_CONDITION;
    Logf("%s failed (%s): %s", what, c->done ? (check ? "check condition" : "error") : "timed out",
         ctx_ ? iscsi_get_error(ctx_) : "");
    Free(c);
    if (check) {
      // Do not spin on a target that keeps refusing.
      ::usleep(100 * 1000);
    } else {
      Drop();
    }
  }

  void Free(Completion* c) {
    if (c->task != nullptr) scsi_free_scsi_task(c->task);
    c->task = nullptr;
  }

  // Runs the event loop until `c` completes (true) or the deadline passes
  // or the connection fails (false).
  bool Wait(Completion* c, Clock::time_point deadline) REQUIRES(mu_) {
    while (!c->done) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return false;
      pollfd p{};
      p.fd = iscsi_get_fd(ctx_);
      p.events = static_cast<short>(iscsi_which_events(ctx_));
      const int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 100)));
      if (n < 0 && errno != EINTR) return false;
      // revents 0 still lets libiscsi scan its own PDU timeouts.
      if (iscsi_service(ctx_, n > 0 ? p.revents : 0) < 0) return c->done;
    }
    return true;
  }

  bool Connect(Clock::time_point deadline) REQUIRES(mu_) {
    if (ctx_ != nullptr) return true;
    ctx_ = iscsi_create_context("iqn.2026-11.org.dede.test:lun-fuse");
    if (ctx_ == nullptr) {
      Logf("iscsi_create_context failed");
      return false;
    }
    iscsi_url* u = iscsi_parse_full_url(ctx_, url_.c_str());
    if (u == nullptr) {
      Logf("bad URL %s: %s", url_.c_str(), iscsi_get_error(ctx_));
      Drop();
      return false;
    }
    lun_ = u->lun;
    const std::string portal = u->portal;
    iscsi_set_targetname(ctx_, u->target);
    if (u->user[0] != '\0') iscsi_set_initiator_username_pwd(ctx_, u->user, u->passwd);
    iscsi_destroy_url(u);
    iscsi_set_session_type(ctx_, ISCSI_SESSION_NORMAL);
    iscsi_set_header_digest(ctx_, ISCSI_HEADER_DIGEST_NONE_CRC32C);
    // Reconnecting is ours (bounded by the request's deadline), and so is
    // the per-command timeout; libiscsi's is a second line.
    iscsi_set_noautoreconnect(ctx_, 1);
    iscsi_set_timeout(ctx_, timeout_s_);
    Completion c;
    if (iscsi_full_connect_async(ctx_, portal.c_str(), lun_, OnComplete, &c) != 0 ||
        !Wait(&c, deadline) || c.status != SCSI_STATUS_GOOD) {
      Logf("login to %s failed: %s", portal.c_str(), c.done ? iscsi_get_error(ctx_) : "timed out");
      Drop();
      return false;
    }
    return true;
  }

  void Drop() REQUIRES(mu_) {
    if (ctx_ == nullptr) return;
    // Outstanding tasks are cancelled (their callbacks run) and freed by
    // libiscsi with the context.
    iscsi_destroy_context(ctx_);
    ctx_ = nullptr;
  }

  const std::string url_;
  const int timeout_s_;
  dede::Mutex mu_;
  iscsi_context* ctx_ GUARDED_BY(mu_) = nullptr;
  int lun_ GUARDED_BY(mu_) = 0;
  // Set by Open() before the filesystem is mounted, read-only after.
  uint64_t size_ = 0;
  uint32_t block_ = 512;
};

Lun* g_lun = nullptr;

Lun& L() {
  return *g_lun;
}

void* OpInit(fuse_conn_info*, fuse_config* cfg) {
  cfg->direct_io = 1;  // FOPEN_DIRECT_IO on every open: no page cache, O_DIRECT and AIO work
  cfg->kernel_cache = 0;
  cfg->attr_timeout = 1;
  cfg->entry_timeout = 1;
  return nullptr;
}

int OpGetattr(const char* path, struct stat* st, fuse_file_info*) {
  std::memset(st, 0, sizeof(*st));
  if (std::strcmp(path, "/") == 0) {
    st->st_mode = S_IFDIR | 0755;
    st->st_nlink = 2;
    return 0;
  }
  if (std::strcmp(path, kFilePath) == 0) {
    st->st_mode = S_IFREG | 0600;
    st->st_nlink = 1;
    st->st_size = static_cast<off_t>(L().size());
    st->st_blksize = static_cast<blksize_t>(L().block());
    st->st_blocks = static_cast<blkcnt_t>(L().size() / 512);
    return 0;
  }
  return -ENOENT;
}

int OpReaddir(const char* path, void* buf, fuse_fill_dir_t fill, off_t, fuse_file_info*,
              fuse_readdir_flags) {
  if (std::strcmp(path, "/") != 0) return -ENOENT;
  fill(buf, ".", nullptr, 0, static_cast<fuse_fill_dir_flags>(0));
  fill(buf, "..", nullptr, 0, static_cast<fuse_fill_dir_flags>(0));
  fill(buf, kFileName, nullptr, 0, static_cast<fuse_fill_dir_flags>(0));
  return 0;
}

int OpOpen(const char* path, fuse_file_info* fi) {
  if (std::strcmp(path, kFilePath) != 0) return -ENOENT;
  fi->direct_io = 1;
  fi->keep_cache = 0;
  return 0;
}

int OpTruncate(const char* path, off_t size, fuse_file_info*) {
  if (std::strcmp(path, kFilePath) != 0) return -ENOENT;
  // O_TRUNC or a resize of a block device is not a thing: only the same size.
  return static_cast<uint64_t>(size) == L().size() ? 0 : -EINVAL;
}

// Clamps [off, off + len) to the LUN; returns the length to transfer.
size_t Clamp(off_t off, size_t len) {
  if (off < 0 || static_cast<uint64_t>(off) >= L().size()) return 0;
  return static_cast<size_t>(std::min<uint64_t>(len, L().size() - static_cast<uint64_t>(off)));
}

int OpRead(const char*, char* buf, size_t len, off_t off, fuse_file_info*) {
  len = Clamp(off, len);
  if (len == 0) return 0;
  const uint64_t bs = L().block();
  const uint64_t first = static_cast<uint64_t>(off) / bs;
  const uint64_t end = (static_cast<uint64_t>(off) + len + bs - 1) / bs;
  if (static_cast<uint64_t>(off) % bs == 0 && len % bs == 0) {
    int r = L().Read(first, reinterpret_cast<uint8_t*>(buf), static_cast<uint32_t>(len));
    return r < 0 ? r : static_cast<int>(len);
  }
  // Unaligned: read the covering blocks.
  std::vector<uint8_t> tmp((end - first) * bs);
  int r = L().Read(first, tmp.data(), static_cast<uint32_t>(tmp.size()));
  if (r < 0) return r;
  std::memcpy(buf, tmp.data() + (static_cast<uint64_t>(off) - first * bs), len);
  return static_cast<int>(len);
}

int OpWrite(const char*, const char* buf, size_t len, off_t off, fuse_file_info*) {
  const size_t asked = len;
  len = Clamp(off, len);
  if (len == 0) return asked == 0 ? 0 : -ENOSPC;
  const uint64_t bs = L().block();
  const uint64_t first = static_cast<uint64_t>(off) / bs;
  const uint64_t end = (static_cast<uint64_t>(off) + len + bs - 1) / bs;
  if (static_cast<uint64_t>(off) % bs == 0 && len % bs == 0) {
    int r = L().Write(first, reinterpret_cast<const uint8_t*>(buf), static_cast<uint32_t>(len));
    return r < 0 ? r : static_cast<int>(len);
  }
  // Unaligned: read-modify-write of the covering blocks. Not atomic
  // against other writers of the same blocks (neither is a block device's
  // page cache); sanlock only does aligned I/O.
  std::vector<uint8_t> tmp((end - first) * bs);
  int r = L().Read(first, tmp.data(), static_cast<uint32_t>(tmp.size()));
  if (r < 0) return r;
  std::memcpy(tmp.data() + (static_cast<uint64_t>(off) - first * bs), buf, len);
  r = L().Write(first, tmp.data(), static_cast<uint32_t>(tmp.size()));
  return r < 0 ? r : static_cast<int>(len);
}

int OpFsync(const char*, int, fuse_file_info*) {
  return L().Sync();
}

int OpFlush(const char*, fuse_file_info*) {
  return 0;
}

int Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s iscsi://HOST:PORT/IQN/LUN MOUNTPOINT [-f] [--timeout SEC]\n"
               "Mounts MOUNTPOINT/lun, the LUN's bytes through libiscsi (tests only).\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string url, mountpoint;
  bool foreground = false;
  int timeout_s = 5;
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    if (a == "-f") {
      foreground = true;
    } else if (a == "--timeout" && i + 1 < argc) {
      timeout_s = std::atoi(argv[++i]);
      if (timeout_s < 1) return Usage(argv[0]);
    } else if (a == "-h" || a == "--help") {
      Usage(argv[0]);
      return 0;
    } else if (url.empty()) {
      url = a;
    } else if (mountpoint.empty()) {
      mountpoint = a;
    } else {
      return Usage(argv[0]);
    }
  }
  if (url.empty() || mountpoint.empty()) return Usage(argv[0]);

  Lun lun(url, timeout_s);
  if (!lun.Open()) {
    Logf("cannot open %s", url.c_str());
    return 1;
  }
  g_lun = &lun;
  Logf("%s: %llu bytes, %u-byte blocks", url.c_str(), static_cast<unsigned long long>(lun.size()),
       lun.block());

  fuse_operations ops{};
  ops.init = OpInit;
  ops.getattr = OpGetattr;
  ops.readdir = OpReaddir;
  ops.open = OpOpen;
  ops.truncate = OpTruncate;
  ops.read = OpRead;
  ops.write = OpWrite;
  ops.fsync = OpFsync;
  ops.flush = OpFlush;

  fuse_args args = FUSE_ARGS_INIT(0, nullptr);
  fuse_opt_add_arg(&args, argv[0]);
  fuse_opt_add_arg(&args, "-o");
  fuse_opt_add_arg(&args, "fsname=dede-lun-fuse");
  fuse* f = fuse_new(&args, &ops, sizeof(ops), nullptr);
  if (f == nullptr) {
    fuse_opt_free_args(&args);
    return 1;
  }
  int rc = 1;
  if (fuse_mount(f, mountpoint.c_str()) == 0) {
    fuse_session* se = fuse_get_session(f);
    if (fuse_set_signal_handlers(se) == 0) {
      if (fuse_daemonize(foreground ? 1 : 0) == 0) {
        Logf("mounted %s/%s", mountpoint.c_str(), kFileName);
        // Single-threaded: a signal interrupts the one read of /dev/fuse.
        // 0, or minus the signal that ended the loop (libfuse >= 3.12).
        const int r = fuse_loop(f);
        rc = (r == 0 || r == -SIGTERM || r == -SIGINT || r == -SIGHUP) ? 0 : 1;
      }
      fuse_remove_signal_handlers(se);
    }
    fuse_unmount(f);
  }
  fuse_destroy(f);
  fuse_opt_free_args(&args);
  Logf("unmounted %s, exiting", mountpoint.c_str());
  return rc;
}
