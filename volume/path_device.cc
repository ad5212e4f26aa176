// Path backend: a regular file or a block device, pread/pwrite, O_DIRECT
// when the file system accepts it (buffers that are not 4 KiB aligned are
// bounced through an aligned buffer).
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#include "util/io_budget.h"
#include "volume/block_device.h"

namespace dede {
namespace {

constexpr size_t kDirectAlign = 4096;
constexpr size_t kBounceMax = 1 << 20;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

class PathDevice : public BlockDevice {
 public:
  PathDevice(std::string path, int fd, uint64_t size, bool direct)
      : path_(std::move(path)), fd_(fd), size_(size), direct_(direct) {}
  ~PathDevice() override { ::close(fd_); }

  uint64_t size_bytes() const override { return size_; }
  std::string name() const override { return path_; }
  std::string local_lock_path() const override { return path_; }

  Status Read(uint64_t offset, void* buf, size_t len) override {
    RETURN_IF_ERROR(CheckRange(offset, len));
    ChargeIo(len);
    if (NeedsBounce(buf, offset, len)) return Bounced(offset, buf, len, false);
    return Transfer(offset, buf, len, false);
  }

  Status Write(uint64_t offset, const void* buf, size_t len) override {
    RETURN_IF_ERROR(CheckRange(offset, len));
    ChargeIo(len);
    if (NeedsBounce(buf, offset, len)) return Bounced(offset, const_cast<void*>(buf), len, true);
    return Transfer(offset, const_cast<void*>(buf), len, true);
  }

  Status Flush() override {
    return flush_failure_.Run([this] {
      if (::fdatasync(fd_) != 0) return Status::FromErrno(path_ + ": fdatasync", errno);
      return Status::Ok();
    });
  }

  Status Discard(uint64_t offset, uint64_t len) override {
    RETURN_IF_ERROR(CheckRange(offset, len));
    // Best effort: punch the range out of a regular file. Block devices and
    // file systems without hole support simply keep the bytes.
    (void)::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                      static_cast<off_t>(len));
    return Status::Ok();
  }

 private:
  bool NeedsBounce(const void* buf, uint64_t offset, size_t len) const {
    return direct_ && (reinterpret_cast<uintptr_t>(buf) % kDirectAlign != 0 ||
                       offset % kDirectAlign != 0 || len % kDirectAlign != 0);
  }

  Status Transfer(uint64_t offset, void* buf, size_t len, bool write) {
    auto* p = static_cast<uint8_t*>(buf);
    size_t done = 0;
    while (done < len) {
      ssize_t n = write ? ::pwrite(fd_, p + done, len - done, static_cast<off_t>(offset + done))
                        : ::pread(fd_, p + done, len - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return Status::FromErrno(path_ + ": " + (write ? "write" : "read") + " at offset " +
                                     std::to_string(offset + done),
                                 errno);
      }
      if (n == 0) {
        return Status::IoError(path_ + ": short " + std::string(write ? "write" : "read") +
                               " at offset " + std::to_string(offset + done));
      }
      done += static_cast<size_t>(n);
    }
    return Status::Ok();
  }

  // Unaligned requests on an O_DIRECT descriptor: go through an aligned
  // buffer, widening to 4 KiB boundaries (read-modify-write for writes).
  Status Bounced(uint64_t offset, void* buf, size_t len, bool write) {
    auto* p = static_cast<uint8_t*>(buf);
    // One bounce buffer per thread, sized to the largest request seen (up
    // to kBounceMax): allocating per call costs an mmap and page faults.
    thread_local std::unique_ptr<uint8_t, FreeDeleter> bounce;
    thread_local size_t bounce_size = 0;
    size_t want = std::min(kBounceMax, (static_cast<size_t>(offset % kDirectAlign) + len +
                                        kDirectAlign - 1) / kDirectAlign * kDirectAlign);
    if (bounce_size < want) {
      bounce.reset(static_cast<uint8_t*>(std::aligned_alloc(kDirectAlign, want)));
      bounce_size = bounce ? want : 0;
      if (!bounce) return Status::NoSpace("out of memory for bounce buffer");
    }
    while (len > 0) {
      uint64_t start = offset / kDirectAlign * kDirectAlign;
      size_t head = static_cast<size_t>(offset - start);
      size_t span = std::min(len, bounce_size - head);
      size_t wide = (head + span + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
      if (start + wide > size_) wide = static_cast<size_t>(size_ - start);
      if (!write || head != 0 || span % kDirectAlign != 0) {
        RETURN_IF_ERROR(Transfer(start, bounce.get(), wide, false));
      }
      if (write) {
        std::memcpy(bounce.get() + head, p, span);
        RETURN_IF_ERROR(Transfer(start, bounce.get(), wide, true));
      } else {
        std::memcpy(p, bounce.get() + head, span);
      }
      p += span;
      offset += span;
      len -= span;
    }
    return Status::Ok();
  }

  std::string path_;
  StickyFlushFailure flush_failure_;
  int fd_;
  uint64_t size_;
  bool direct_;
};

}  // namespace

Result<std::unique_ptr<BlockDevice>> OpenPathDevice(const std::string& path,
                                                    const DeviceOptions& opts) {
  int flags = (opts.read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC;
  int fd = ::open(path.c_str(), flags | (opts.direct ? O_DIRECT : 0));
  bool direct = opts.direct;
  if (fd < 0 && errno == EINVAL && opts.direct) {
    // tmpfs and some others refuse O_DIRECT: fall back to buffered I/O.
    fd = ::open(path.c_str(), flags);
    direct = false;
  }
  if (fd < 0 && (errno == EACCES || errno == EPERM || errno == EROFS) && !opts.read_only) {
    // Even a command that only reads opens the volume read-write: it takes
    // the volume's locks, which live on it (or beside it) and are written.
    const int e = errno;
    return Status::IoError("cannot open " + path + ": " + std::strerror(e) +
                           " (dede needs read-write access to a volume even to read it: its "
                           "locks are written; run as root, or as a user who may write it)");
  }
  if (fd < 0) return Status::FromErrno("cannot open " + path, errno);
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return Status::FromErrno("cannot stat " + path, e);
  }
  uint64_t size = 0;
  if (S_ISBLK(st.st_mode)) {
    if (::ioctl(fd, BLKGETSIZE64, &size) != 0) {
      int e = errno;
      ::close(fd);
      return Status::FromErrno("cannot get size of block device " + path, e);
    }
  } else if (S_ISREG(st.st_mode)) {
    size = static_cast<uint64_t>(st.st_size);
  } else {
    ::close(fd);
    return Status::Invalid(path + " is neither a regular file nor a block device");
  }
  size -= size % kSectorSize;
  return std::unique_ptr<BlockDevice>(new PathDevice(path, fd, size, direct));
}

}  // namespace dede
