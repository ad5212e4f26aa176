// What the benchmark tools record about the machine they ran on, and the
// sparse scratch file the volume benchmarks run on (shared by
// dede-bench-volume, dede-bench-index and dede_ratecap_bench).
#pragma once

#include <fcntl.h>
#include <sys/statfs.h>
#include <sys/sysinfo.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "util/status.h"

namespace dede::bench {

// The file system type statfs reports, by name where it is a common one.
inline std::string FsTypeName(int64_t magic) {
  switch (static_cast<uint64_t>(magic)) {
    case 0xEF53: return "ext2/3/4";
    case 0x58465342: return "xfs";
    case 0x01021994: return "tmpfs";
    case 0x9123683E: return "btrfs";
    case 0x794c7630: return "overlayfs";
    case 0x2fc12fc1: return "zfs";
    case 0x6969: return "nfs";
    default: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "0x%" PRIx64, static_cast<uint64_t>(magic));
      return buf;
    }
  }
}

// CPUs, memory, kernel, architecture and the load when the run started
// (the results are ratios inside one run; the load says how noisy it was).
inline nlohmann::json MachineJson() {
  nlohmann::json m;
  m["nproc"] = ::sysconf(_SC_NPROCESSORS_ONLN);
  struct sysinfo si {};
  if (::sysinfo(&si) == 0) m["memory_bytes"] = uint64_t{si.totalram} * si.mem_unit;
  struct utsname u {};
  if (::uname(&u) == 0) {
    m["kernel"] = u.release;
    m["arch"] = u.machine;
  }
  double load[3];
  if (::getloadavg(load, 3) == 3) m["loadavg_at_start"] = {load[0], load[1], load[2]};
  return m;
}

// The scratch file's path, for the signal handler (one scratch file per
// process at a time).
inline char g_scratch_path[4096];

extern "C" inline void RemoveScratchOnSignal(int sig) {
  if (g_scratch_path[0]) ::unlink(g_scratch_path);
  ::_exit(128 + sig);
}

// A sparse file of `bytes` made from `tmpl` (mkstemp: it ends in XXXXXX),
// removed when this object goes, and on SIGINT/SIGTERM (Ctrl-C).
class ScratchFile {
 public:
  static Result<std::unique_ptr<ScratchFile>> Create(const std::string& tmpl, uint64_t bytes) {
    std::vector<char> path(tmpl.begin(), tmpl.end());
    path.push_back('\0');
    const int fd = ::mkstemp(path.data());
    if (fd < 0) return Status::FromErrno("mkstemp " + tmpl, errno);
    std::unique_ptr<ScratchFile> f(new ScratchFile(path.data()));
    std::snprintf(g_scratch_path, sizeof g_scratch_path, "%s", path.data());
    std::signal(SIGINT, RemoveScratchOnSignal);
    std::signal(SIGTERM, RemoveScratchOnSignal);
    struct statfs sf {};
    if (::fstatfs(fd, &sf) == 0) f->fs_type_ = FsTypeName(sf.f_type);
    const bool sized = ::ftruncate(fd, off_t(bytes)) == 0;
    const int err = errno;
    ::close(fd);
    if (!sized) return Status::FromErrno("ftruncate " + f->path_, err);
    const int direct = ::open(path.data(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    f->o_direct_ = direct >= 0;
    if (direct >= 0) ::close(direct);
    return f;
  }
  ~ScratchFile() {
    ::unlink(path_.c_str());
    g_scratch_path[0] = '\0';
  }
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;

  const std::string& path() const { return path_; }
  const std::string& fs_type() const { return fs_type_; }
  bool o_direct() const { return o_direct_; }  // the file system takes O_DIRECT

 private:
  explicit ScratchFile(std::string path) : path_(std::move(path)) {}
  std::string path_;
  std::string fs_type_;
  bool o_direct_ = false;
};

}  // namespace dede::bench
