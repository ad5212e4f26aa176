// Raw image transfer: import (raw file -> new volume file, thin) and export
// (volume file -> raw file).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "kmod/writemon/write_log.h"
#include "kmod/writemon/write_monitor.h"
#include "tools/dede/cli.h"
#include "util/bytes.h"
#include "volume/format.h"
#include "volume/volume.h"

namespace po = boost::program_options;

namespace dede::cli {
namespace {

constexpr const char* kVolHelp = "volume: a path (file or block device) or iscsi:// URL";
constexpr size_t kChunkBytes = 1 << 20;  // copy unit; a multiple of kBlockSize

uint64_t RoundUpToBlock(uint64_t n) {
  return (n + kBlockSize - 1) / kBlockSize * kBlockSize;
}

// Reads up to len bytes at offset; returns how many (short only at EOF).
Result<size_t> ReadFully(int fd, const std::string& path, uint64_t offset, uint8_t* buf,
                         size_t len) {
  size_t done = 0;
  while (done < len) {
    ssize_t n = ::pread(fd, buf + done, len - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(path + ": read at offset " + std::to_string(offset + done), errno);
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

Status WriteFully(int fd, const std::string& path, bool positional, uint64_t offset,
                  const uint8_t* buf, size_t len) {
  size_t done = 0;
  while (done < len) {
    ssize_t n = positional ? ::pwrite(fd, buf + done, len - done, static_cast<off_t>(offset + done))
                           : ::write(fd, buf + done, len - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(path + ": write at offset " + std::to_string(offset + done), errno);
    }
    if (n == 0)
      return Status::IoError(path + ": short write at offset " + std::to_string(offset + done));
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

// Calls write_run(offset_in_chunk, length) for each maximal run of blocks
// of buf[0, len) that are not all zeros; returns the zero bytes skipped.
template <typename WriteRun>
Result<uint64_t> ForEachDataRun(const uint8_t* buf, size_t len, WriteRun write_run) {
  uint64_t zero_bytes = 0;
  size_t run_start = 0;
  size_t run_len = 0;
  for (size_t off = 0; off < len; off += kBlockSize) {
    const size_t n = std::min<size_t>(kBlockSize, len - off);
    if (IsAllZero(buf + off, n)) {
      zero_bytes += n;
      if (run_len > 0) RETURN_IF_ERROR(write_run(run_start, run_len));
      run_len = 0;
      continue;
    }
    if (run_len == 0) run_start = off;
    run_len += n;
  }
  if (run_len > 0) RETURN_IF_ERROR(write_run(run_start, run_len));
  return zero_bytes;
}

std::string Quoted(const std::string& name) {
  return "'" + name + "'";
}

}  // namespace

// ---------------------------------------------------------------- import

namespace {

struct ImportResult {
  uint64_t copied = 0;      // source bytes processed
  uint64_t zero_bytes = 0;  // of which all-zero blocks left as holes
};

// Copies the source into the (fresh, all-hole) file. Stops early, with an
// error, when interrupted.
Status CopyIn(int src_fd, const std::string& src_path, uint64_t src_bytes, Volume* vol,
              File* file, Progress* progress, const InterruptGuard& interrupt,
              ImportResult* result) {
  // The import is a writer like a VM: its full blocks are fingerprinted
  // and logged, so the next dedup pass finds them (paper section 3.1).
  WriteMonitorOptions mo;
  mo.algo = vol->superblock().hash_algo;
  mo.memory_cap_bytes = size_t{256} << 20;
  WriteMonitor monitor(mo);
  const FileId fid = file->id();
  monitor.AddFile(fid, true);
  uint64_t since_flush = 0;
  auto flush_log = [&]() -> Status {
    since_flush = 0;
    return AppendToWriteLog(vol, monitor.Take(fid));
  };
  AlignedBuffer buf(kChunkBytes);
  for (uint64_t pos = 0; pos < src_bytes; pos += kChunkBytes) {
    if (interrupt.interrupted()) return Status::Unavailable("interrupted");
    const size_t want = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, src_bytes - pos));
    ASSIGN_OR_RETURN(size_t got, ReadFully(src_fd, src_path, pos, buf.data(), want));
    if (got < want) {
      return Status::IoError(src_path + ": file shrank while importing (end at offset " +
                             std::to_string(pos + got) + ")");
    }
    // Pad the last partial block with zeros, up to the file's end (which
    // --size may put inside that block).
    const size_t padded =
        static_cast<size_t>(std::min<uint64_t>(RoundUpToBlock(got), file->size() - pos));
    std::memset(buf.data() + got, 0, padded - got);
    ASSIGN_OR_RETURN(uint64_t zeros,
                     ForEachDataRun(buf.data(), padded, [&](size_t off, size_t len) {
                       Status w = file->Write(pos + off, buf.data() + off, len);
                       if (w.ok()) monitor.OnWrite(fid, pos + off, buf.data() + off, len);
                       return w;
                     }));
    result->zero_bytes += std::min<uint64_t>(zeros, got);
    result->copied += got;
    progress->Update(result->copied);
    since_flush += padded;
    if (since_flush >= (uint64_t{256} << 20)) RETURN_IF_ERROR(flush_log());
  }
  return flush_log();
}

}  // namespace

int RunImport(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.AddPositional("VOL", kVolHelp);
  parser.AddPositional("NAME", "new file to create in the volume");
  parser.AddPositional("RAWFILE", "raw disk image (regular file or block device) to copy in");
  parser.options()("size", po::value<std::string>()->value_name("SIZE"),
                   "size of the new file (at least RAWFILE's); default: RAWFILE's size rounded "
                   "up to 4 KiB");
  parser.SetDetails(
      "All-zero 4 KiB blocks are not written: they stay holes, so the file is thin.\n"
      "Every whole block written is fingerprinted into the file's write log, so the\n"
      "next `dede dedup` pass deduplicates the image.\n"
      "On failure or interruption the partially imported file is removed.");
  if (auto rc = parser.Parse(args)) return *rc;
  const std::string& spec = parser.positional(0);
  const std::string& name = parser.positional(1);
  const std::string& src_path = parser.positional(2);
  std::optional<uint64_t> wanted_size;
  if (auto v = parser.value("size")) {
    wanted_size = ParseSize(*v);
    if (!wanted_size) return UsageError(cmd, "invalid size '" + *v + "': " + kSizeSyntax);
  }
  if (auto why = ReservedName(name)) return UsageError(cmd, *why);

  // The source first: a missing image must not touch the volume at all.
  FdCloser src(::open(src_path.c_str(), O_RDONLY | O_CLOEXEC));
  if (src.get() < 0) return Fail(cmd, Status::FromErrno("cannot open " + src_path, errno));
  auto src_bytes = SizeOfFd(src.get(), src_path);
  if (!src_bytes.ok()) return Fail(cmd, src_bytes.status());
  uint64_t size = RoundUpToBlock(*src_bytes);
  if (wanted_size) {
    if (*wanted_size < *src_bytes) {
      return Fail(cmd, "--size " + HumanSize(*wanted_size) + " is smaller than " + src_path + " (" +
                           std::to_string(*src_bytes) + " bytes)");
    }
    size = *wanted_size;
  }
  (void)::posix_fadvise(src.get(), 0, 0, POSIX_FADV_SEQUENTIAL);

  auto opened = OpenVolume(spec, /*read_only=*/false);
  if (!opened.ok()) return Fail(cmd, opened.status());
  Volume* vol = opened->volume.get();
  InterruptGuard interrupt;  // from here on, a signal leads to cleanup
  auto id = vol->Create(name, size);
  if (!id.ok()) return Fail(cmd, id.status());

  Progress progress("importing " + Quoted(name), *src_bytes);
  ImportResult result;
  Status st;
  {
    auto file = vol->OpenFile(name);
    if (!file.ok()) {
      st = file.status();
    } else {
      st = CopyIn(src.get(), src_path, *src_bytes, vol, file->get(), &progress, interrupt, &result);
    }
  }  // the file (and its lock) is released before Remove below
  if (st.ok()) st = vol->Sync();
  progress.Finish();
  if (!st.ok()) {
    // Leave no half-imported file behind; if even that fails (a poisoned
    // volume), the first error is the one worth reporting.
    Status removed = vol->Remove(name);
    if (removed.ok()) (void)vol->Remove(WriteLogName(*id));
    if (removed.ok()) removed = vol->Sync();
    std::string msg = "importing " + src_path + " into " + Quoted(name) + ": " + st.message();
    msg += removed.ok() ? " (partial file removed)"
                        : " (partial file left: " + removed.message() + ")";
    return Fail(cmd, msg);
  }

  const double secs = progress.elapsed_seconds();
  std::cout << "imported " << HumanSize(result.copied) << " into " << Quoted(name) << " in "
            << HumanDuration(secs) << " (" << HumanRate(result.copied, secs) << "), "
            << HumanSize(result.zero_bytes) << " of zero blocks left as holes" << std::endl;
  return kExitOk;
}

// ---------------------------------------------------------------- export

namespace {

// `dede export vol.img vm vol.img` truncated the volume under itself, and
// naming the LUN's block device wrote file data over its superblock and
// leases. True if `dst_path` is the volume's own file or device, or starts
// with this volume's superblock (another path to the same LUN).
bool HoldsVolume(const std::string& spec, const std::string& dst_path, const struct stat& st_dst,
                 const Superblock& sb) {
  struct stat st_vol {};
  if (::stat(spec.c_str(), &st_vol) == 0) {
    if (S_ISREG(st_dst.st_mode) && S_ISREG(st_vol.st_mode) && st_vol.st_dev == st_dst.st_dev &&
        st_vol.st_ino == st_dst.st_ino) {
      return true;
    }
    if (S_ISBLK(st_dst.st_mode) && S_ISBLK(st_vol.st_mode) && st_vol.st_rdev == st_dst.st_rdev) {
      return true;
    }
  }
  FdCloser in(::open(dst_path.c_str(), O_RDONLY | O_CLOEXEC));
  if (in.get() < 0) return false;
  AlignedBuffer head(2 * kBlockSize);
  if (::pread(in.get(), head.data(), 2 * kBlockSize, 0) != static_cast<ssize_t>(2 * kBlockSize)) {
    return false;
  }
  for (uint64_t a : kSuperblockAddrs) {
    Result<Superblock> found = DecodeSuperblock(head.data() + a * kBlockSize, a);
    if (found.ok() && found->uuid == sb.uuid) return true;
  }
  return false;
}

}  // namespace

int RunExport(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  parser.AddPositional("VOL", kVolHelp);
  parser.AddPositional("NAME", "file to copy out of the volume");
  parser.AddPositional("RAWFILE", "raw image to write (created or overwritten)");
  parser.SetDetails(
      "Writes the file's whole logical size. A regular RAWFILE is rewritten from\n"
      "scratch and gets holes where the data is all zeros; a block device gets\n"
      "every byte.");
  if (auto rc = parser.Parse(args)) return *rc;
  const std::string& spec = parser.positional(0);
  const std::string& name = parser.positional(1);
  const std::string& dst_path = parser.positional(2);

  // Volume and file first: nothing is created or truncated if they fail.
  auto opened = OpenVolume(spec, /*read_only=*/true);
  if (!opened.ok()) return Fail(cmd, opened.status());
  auto file = opened->volume->OpenFile(name);
  if (!file.ok()) {
    if (file.status().code() == Status::Code::kLocked) {
      if (file.status().message().find("in use by another process or host") != std::string::npos) {
        return Fail(cmd, file.status());
      }
      return Fail(cmd, Quoted(name) + " is in use by another process or host (" +
                           file.status().message() + ")");
    }
    return Fail(cmd, file.status());
  }
  const uint64_t size = (*file)->size();

  FdCloser dst(::open(dst_path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
  if (dst.get() < 0) return Fail(cmd, Status::FromErrno("cannot open " + dst_path, errno));
  struct stat st_dst {};
  if (::fstat(dst.get(), &st_dst) != 0) {
    return Fail(cmd, Status::FromErrno("cannot stat " + dst_path, errno));
  }
  const bool regular = S_ISREG(st_dst.st_mode);
  const bool block_dev = S_ISBLK(st_dst.st_mode);
  // RAWFILE may be our own standard output (/dev/stdout, /proc/self/fd/1):
  // the summary then goes to stderr, or it would land in the image (a pipe
  // gets it appended; a file, reopened at offset 0, over its first bytes).
  struct stat st_out {};
  const bool to_stdout = ::fstat(STDOUT_FILENO, &st_out) == 0 && st_out.st_dev == st_dst.st_dev &&
                         st_out.st_ino == st_dst.st_ino;
  if ((regular || block_dev) && HoldsVolume(spec, dst_path, st_dst, opened->volume->superblock())) {
    return Fail(cmd, dst_path + " holds this volume (uuid " +
                         UuidToString(opened->volume->superblock().uuid) +
                         "): export to another file or device");
  }
  if (regular && ::ftruncate(dst.get(), 0) != 0) {
    return Fail(cmd, Status::FromErrno(dst_path + ": truncate", errno));
  }
  if (block_dev) {
    auto dev_size = SizeOfFd(dst.get(), dst_path);
    if (!dev_size.ok()) return Fail(cmd, dev_size.status());
    if (*dev_size < size) {
      return Fail(cmd, dst_path + " (" + HumanSize(*dev_size) + ") is smaller than " +
                           Quoted(name) + " (" + HumanSize(size) + ")");
    }
  }

  InterruptGuard interrupt;
  Progress progress("exporting " + Quoted(name), size);
  AlignedBuffer buf(kChunkBytes);
  uint64_t zero_bytes = 0;
  Status st;
  for (uint64_t pos = 0; pos < size && st.ok(); pos += kChunkBytes) {
    if (interrupt.interrupted()) {
      st = Status::Unavailable("interrupted");
      break;
    }
    const size_t len = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, size - pos));
    st = (*file)->Read(pos, buf.data(), len);
    if (!st.ok()) break;
    if (regular) {
      // The file was truncated to nothing: zero blocks can stay holes.
      auto zeros = ForEachDataRun(buf.data(), len, [&](size_t off, size_t n) {
        return WriteFully(dst.get(), dst_path, true, pos + off, buf.data() + off, n);
      });
      st = zeros.status();
      if (st.ok()) zero_bytes += *zeros;
    } else {
      // Block devices hold old data and pipes have no holes: write it all.
      st = WriteFully(dst.get(), dst_path, block_dev, pos, buf.data(), len);
    }
    progress.Update(pos + len);
  }
  if (st.ok() && regular && ::ftruncate(dst.get(), static_cast<off_t>(size)) != 0) {
    st = Status::FromErrno(dst_path + ": setting size", errno);
  }
  // Make the copy durable; character devices and pipes cannot sync.
  if (st.ok() && ::fdatasync(dst.get()) != 0 && errno != EINVAL && errno != EROFS) {
    st = Status::FromErrno(dst_path + ": fdatasync", errno);
  }
  if (st.ok()) st = dst.Close(dst_path);
  progress.Finish();
  if (!st.ok()) {
    return Fail(cmd, "exporting " + Quoted(name) + " to " + dst_path + ": " + st.message() +
                         (regular || block_dev ? " (" + dst_path + " is incomplete)" : ""));
  }

  const double secs = progress.elapsed_seconds();
  std::ostream& summary = to_stdout ? std::cerr : std::cout;
  summary << "exported " << HumanSize(size) << " from " << Quoted(name) << " to " << dst_path
          << " in " << HumanDuration(secs) << " (" << HumanRate(size, secs) << ")";
  if (regular) summary << ", " << HumanSize(zero_bytes) << " of zero blocks left as holes";
  summary << std::endl;
  return kExitOk;
}

}  // namespace dede::cli
