// dede-hold-fuse: a backing file for a test target that can hold one write.
//
//   dede-hold-fuse BACKING_FILE MOUNTPOINT [-f]
//
// Mounts a FUSE filesystem at MOUNTPOINT with two files:
//   lun  reads and writes go to BACKING_FILE (pread/pwrite; as large as it,
//        opened with FOPEN_DIRECT_IO so O_DIRECT opens work and nothing is
//        cached in between);
//   ctl  the test's handle: writing "hold OFFSET" arms a hold, and the next
//        write to `lun` covering byte OFFSET then waits, before it reaches
//        BACKING_FILE, until "release" is written; "fail-fsync N" makes
//        the next N fsyncs of `lun` fail with EIO (a writeback error the
//        kernel reports once); "hold-fsync" arms a hold of the next fsync
//        instead (it waits for "release", then fails if a fail-fsync is
//        armed: a write-back that ends in an error after a long time).
//        Reading it gives "state=idle|armed|held writes=N
//        fsync_failures=M" (N: writes to `lun` completed; M: fsyncs failed
//        so far).
//
// It is how the iSCSI tests make a target's backing store sit on one WRITE
// (the stuck command behind an initiator's timeout). Reads go on while a
// write is held (the FUSE loop is multi-threaded), but other writes to
// `lun` wait behind it: the kernel runs one direct write of a FUSE file at
// a time (the inode lock), unless the open asks for parallel ones, which
// libfuse 3.14 cannot. SIGTERM/SIGINT release any hold and unmount.
//
// Only for tests: installed nowhere.
#define FUSE_USE_VERSION 35

#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <sys/stat.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace {

constexpr const char* kLunPath = "/lun";
constexpr const char* kCtlPath = "/ctl";

enum class HoldState { kIdle, kArmed, kHeld };

struct Global {
  int fd = -1;
  uint64_t size = 0;
  std::mutex mu;
  std::condition_variable cv;
  HoldState state = HoldState::kIdle;  // guarded by mu
  uint64_t hold_offset = 0;            // guarded by mu
  bool hold_fsync = false;             // guarded by mu: the hold is for an fsync
  bool released = false;               // guarded by mu
  uint64_t writes = 0;                 // guarded by mu
  uint64_t fail_fsyncs = 0;            // guarded by mu: fsyncs still to fail
  uint64_t fsync_failures = 0;         // guarded by mu
};
Global g;

std::string CtlText() {
  std::lock_guard<std::mutex> l(g.mu);
  const char* s = g.state == HoldState::kIdle    ? "idle"
                  : g.state == HoldState::kArmed ? "armed"
                                                 : "held";
  return std::string("state=") + s + " writes=" + std::to_string(g.writes) +
         " fsync_failures=" + std::to_string(g.fsync_failures) + "\n";
}

void* OpInit(fuse_conn_info*, fuse_config* cfg) {
  cfg->direct_io = 1;
  cfg->attr_timeout = 0;
  cfg->entry_timeout = 0;
  return nullptr;
}

int OpGetattr(const char* path, struct stat* st, fuse_file_info*) {
  std::memset(st, 0, sizeof(*st));
  if (std::strcmp(path, "/") == 0) {
    st->st_mode = S_IFDIR | 0755;
    st->st_nlink = 2;
  } else if (std::strcmp(path, kLunPath) == 0) {
    st->st_mode = S_IFREG | 0600;
    st->st_nlink = 1;
    st->st_size = static_cast<off_t>(g.size);
  } else if (std::strcmp(path, kCtlPath) == 0) {
    st->st_mode = S_IFREG | 0600;
    st->st_nlink = 1;
    st->st_size = 4096;
  } else {
    return -ENOENT;
  }
  return 0;
}

int OpReaddir(const char* path, void* buf, fuse_fill_dir_t fill, off_t, fuse_file_info*,
              fuse_readdir_flags) {
  if (std::strcmp(path, "/") != 0) return -ENOENT;
  fill(buf, ".", nullptr, 0, static_cast<fuse_fill_dir_flags>(0));
  fill(buf, "..", nullptr, 0, static_cast<fuse_fill_dir_flags>(0));
  fill(buf, kLunPath + 1, nullptr, 0, static_cast<fuse_fill_dir_flags>(0));
  fill(buf, kCtlPath + 1, nullptr, 0, static_cast<fuse_fill_dir_flags>(0));
  return 0;
}

int OpOpen(const char* path, fuse_file_info* fi) {
  if (std::strcmp(path, kLunPath) != 0 && std::strcmp(path, kCtlPath) != 0) return -ENOENT;
  fi->direct_io = 1;
  return 0;
}

int OpTruncate(const char*, off_t, fuse_file_info*) {
  return 0;
}

int OpRead(const char* path, char* buf, size_t len, off_t off, fuse_file_info*) {
  if (std::strcmp(path, kCtlPath) == 0) {
    const std::string text = CtlText();
    if (off >= static_cast<off_t>(text.size())) return 0;
    const size_t n = std::min(len, text.size() - static_cast<size_t>(off));
    std::memcpy(buf, text.data() + off, n);
    return static_cast<int>(n);
  }
  ssize_t n = ::pread(g.fd, buf, len, off);
  return n < 0 ? -errno : static_cast<int>(n);
}

int OpWrite(const char* path, const char* buf, size_t len, off_t off, fuse_file_info*) {
  if (std::strcmp(path, kCtlPath) == 0) {
    const std::string cmd(buf, len);
    std::lock_guard<std::mutex> l(g.mu);
    if (cmd.rfind("hold ", 0) == 0) {
      if (g.state == HoldState::kHeld) return -EBUSY;  // release the held one first
      g.hold_offset = std::strtoull(cmd.c_str() + 5, nullptr, 10);
      g.hold_fsync = false;
      g.state = HoldState::kArmed;
      g.released = false;
    } else if (cmd.rfind("hold-fsync", 0) == 0) {
      if (g.state == HoldState::kHeld) return -EBUSY;
      g.hold_fsync = true;
      g.state = HoldState::kArmed;
      g.released = false;
    } else if (cmd.rfind("release", 0) == 0) {
      g.released = true;
      g.cv.notify_all();
    } else if (cmd.rfind("fail-fsync ", 0) == 0) {
      g.fail_fsyncs = std::strtoull(cmd.c_str() + 11, nullptr, 10);
    } else {
      return -EINVAL;
    }
    return static_cast<int>(len);
  }
  {
    std::unique_lock<std::mutex> l(g.mu);
    const uint64_t from = static_cast<uint64_t>(off);
    if (g.state == HoldState::kArmed && !g.hold_fsync && g.hold_offset >= from &&
        g.hold_offset < from + len) {
      g.state = HoldState::kHeld;
      std::fprintf(stderr, "dede-hold-fuse: holding a write of %zu bytes at %lld\n", len,
                   static_cast<long long>(off));
      g.cv.wait(l, [] { return g.released; });
      g.state = HoldState::kIdle;
      std::fprintf(stderr, "dede-hold-fuse: released the write at %lld\n",
                   static_cast<long long>(off));
    }
  }
  ssize_t n = ::pwrite(g.fd, buf, len, off);
  if (n < 0) return -errno;
  std::lock_guard<std::mutex> l(g.mu);
  g.writes++;
  return static_cast<int>(n);
}

int OpFsync(const char*, int, fuse_file_info*) {
  {
    std::unique_lock<std::mutex> l(g.mu);
    if (g.state == HoldState::kArmed && g.hold_fsync) {
      g.state = HoldState::kHeld;
      std::fprintf(stderr, "dede-hold-fuse: holding an fsync\n");
      g.cv.wait(l, [] { return g.released; });
      g.state = HoldState::kIdle;
      g.hold_fsync = false;
      std::fprintf(stderr, "dede-hold-fuse: released the fsync\n");
    }
    if (g.fail_fsyncs > 0) {
      g.fail_fsyncs--;
      g.fsync_failures++;
      return -EIO;
    }
  }
  return ::fdatasync(g.fd) == 0 ? 0 : -errno;
}
int OpFlush(const char*, fuse_file_info*) {
  return 0;
}

void OpDestroy(void*) {
  std::lock_guard<std::mutex> l(g.mu);
  g.released = true;
  g.cv.notify_all();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s BACKING_FILE MOUNTPOINT [-f]\n", argv[0]);
    return 2;
  }
  g.fd = ::open(argv[1], O_RDWR | O_CLOEXEC);
  if (g.fd < 0) {
    std::fprintf(stderr, "dede-hold-fuse: open %s: %s\n", argv[1], std::strerror(errno));
    return 1;
  }
  struct stat st {};
  if (::fstat(g.fd, &st) != 0) {
    std::fprintf(stderr, "dede-hold-fuse: stat %s: %s\n", argv[1], std::strerror(errno));
    return 1;
  }
  g.size = static_cast<uint64_t>(st.st_size);

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
  ops.destroy = OpDestroy;
  // fuse_main(prog, MOUNTPOINT, [-f]): multi-threaded (no -s), so a held
  // write blocks one worker and the others go on.
  std::string prog = argv[0];
  std::string mnt = argv[2];
  char* fargv[4] = {prog.data(), mnt.data(), nullptr, nullptr};
  int fargc = 2;
  std::string fg = "-f";
  if (argc > 3 && std::strcmp(argv[3], "-f") == 0) fargv[fargc++] = fg.data();
  return fuse_main(fargc, fargv, &ops, nullptr);
}
