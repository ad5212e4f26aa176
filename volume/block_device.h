// BlockDevice: the byte-addressed device a volume lives on.
//
// Contract:
//  * Read/Write take offsets and lengths that are multiples of kSectorSize
//    (512); the volume itself only issues 4 KiB-aligned I/O.
//  * A Write is not durable until a later Flush() returns OK. A crash may
//    drop any unflushed write, or tear it at sector granularity.
//  * Every method is safe to call from several threads at once (the iSCSI
//    backend serialises internally; the path backend uses pread/pwrite).
//  * Errors come back as Status with the device name and offset in the
//    message; nothing throws.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "util/mutex.h"
#include "util/status.h"

namespace dede {

inline constexpr uint32_t kSectorSize = 512;

// What a device did besides I/O (diagnostics; zero where it does not apply).
struct DeviceCounters {
  uint64_t lost_commands = 0;      // modifying commands given up on that may still run
  uint64_t unfenced_commands = 0;  // of those, not yet known to have finished
  uint64_t lu_resets = 0;          // iSCSI: LOGICAL UNIT RESETs sent to fence them
  uint64_t idle_reconnects = 0;    // iSCSI: connections found closed between commands
};

class BlockDevice {
 public:
  virtual ~BlockDevice() = default;
  virtual uint64_t size_bytes() const = 0;
  virtual Status Read(uint64_t offset, void* buf, size_t len) = 0;
  virtual Status Write(uint64_t offset, const void* buf, size_t len) = 0;
  virtual Status Flush() = 0;
  // Hint that a range no longer holds data; may do nothing.
  virtual Status Discard(uint64_t offset, uint64_t len) {
    (void)offset;
    (void)len;
    return Status::Ok();
  }
  // Human-readable name for messages ("/dev/sdb", "iscsi://h/iqn/0").
  virtual std::string name() const = 0;
  // A local file the local lock backend may place OFD locks on to exclude
  // other processes of this machine using the same device. Empty means the
  // lock backend must pick a file keyed by the volume UUID.
  virtual std::string local_lock_path() const { return ""; }
  virtual DeviceCounters counters() const { return {}; }

 protected:
  Status CheckRange(uint64_t offset, size_t len) const;
};

// A device's flush failure, kept: once a flush fails, every later flush
// fails with it. The kernel reports a writeback error to one fsync of a
// file (and a target's file backing store to one SYNCHRONIZE CACHE), so
// a flush after a failed one may "succeed" with the lost writes never
// reported again (a lock-table flush that failed, say, and then a
// client's FLUSH). Every device's Flush goes through one of these.
class StickyFlushFailure {
 public:
  // Runs `flush` unless a failure is kept, and keeps its failure. One at a
  // time: two flushes at once could otherwise split one error between
  // them, one consuming it and the other reporting success.
  Status Run(const std::function<Status()>& flush) EXCLUDES(run_mu_, mu_) {
    MutexLock one_at_a_time(&run_mu_);
    RETURN_IF_ERROR(Kept());
    return Note(flush());
  }
  // The failure kept so far (OK if none).
  Status Kept() EXCLUDES(mu_) {
    MutexLock l(&mu_);
    return failed_;
  }
  // Returns `st`; the first failure is kept, with a word on what it means.
  Status Note(Status st) EXCLUDES(mu_) {
    if (st.ok()) return st;
    MutexLock l(&mu_);
    if (failed_.ok()) {
      failed_ = st.WithContext(
          "device flush failed (writes since the last good flush may be "
          "lost; every later flush fails too)");
    }
    return failed_;
  }

 private:
  Mutex run_mu_;  // before mu_
  Mutex mu_;
  Status failed_ GUARDED_BY(mu_);
};

struct DeviceOptions {
  bool read_only = false;
  // Path backend: use O_DIRECT when the file system supports it.
  bool direct = true;
  // iSCSI backend: sessions logged in to the LUN. A session carries one
  // command at a time, so this is how many threads' commands can be in
  // flight at once (a daemon serving VMs wants several; a short-lived
  // tool, one).
  uint32_t iscsi_sessions = 1;
  // iSCSI backend: how long one SCSI command may take before the session
  // is dropped and the command sent again on a new one (0: 30 s, like the
  // Linux sd driver). Tests shorten it.
  uint32_t iscsi_command_timeout_ms = 0;
  // iSCSI backend: the initiator name to log in with (the target's ACL
  // must admit it). Empty: this host's open-iscsi name from
  // kOpenIscsiInitiatorFile if there is one, else iqn.2026-11.org.dede:HOST.
  std::string iscsi_initiator_name;
};

inline constexpr char kOpenIscsiInitiatorFile[] = "/etc/iscsi/initiatorname.iscsi";

// Most sessions OpenIscsiDevice accepts.
inline constexpr uint32_t kMaxIscsiSessions = 64;

// Opens "iscsi://[user%password@]host[:port]/target-iqn/lun" with libiscsi,
// or any other string as a path (regular file or block device).
Result<std::unique_ptr<BlockDevice>> OpenBlockDevice(const std::string& spec,
                                                     const DeviceOptions& opts = {});

// Path backend; exposed for tests and tools that want the concrete type.
Result<std::unique_ptr<BlockDevice>> OpenPathDevice(const std::string& path,
                                                    const DeviceOptions& opts);
// iSCSI backend (volume/iscsi_device.cc).
Result<std::unique_ptr<BlockDevice>> OpenIscsiDevice(const std::string& url,
                                                     const DeviceOptions& opts);

}  // namespace dede
