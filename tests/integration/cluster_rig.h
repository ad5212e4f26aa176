// Multi-host test rig: several simulated hosts on one machine, each with
// its own sanlock daemon, sharing one LUN (a sparse file, also served by a
// tgtd on 127.0.0.1).
//
// Cutting a host off. A host's daemons normally reach the LUN through the
// file (sanlock) and tgtd on 127.0.0.1 (dedupd), which no network fault
// can take away. A host that a test must cut off gets its own network
// namespace (HostNetns below): its sanlock daemon, its dedupd and its
// commands run there, dedupd reaching tgtd over a veth pair and sanlock
// reaching the LUN through dede-lun-fuse (tests/tools/dede_lun_fuse.cc), a
// FUSE file whose reads and writes are iSCSI commands over the same veth.
// The cut is the veth going down: everything of that host loses the LUN
// at once and keeps running, as on a real host whose SAN link fails. The
// bridge is a faithful stand-in for the kernel initiator's /dev/sdX for
// what sanlock's fencing depends on: no page cache (FOPEN_DIRECT_IO;
// sanlock's O_DIRECT opens and AIO work, every renewal is a WRITE that the
// target acknowledged), and after a cut the I/O does not complete, so
// sanlock's io_timeout expires; the bridge then fails the request with
// EIO after a bounded time, as the initiator's error recovery would. A
// SIGSTOPped daemon (SanlockDaemon::Stop) is the other failure: a host
// whose daemon hangs while its data path works (cluster_rig_test.cc,
// multihost_test.cc "a host whose sanlock daemon hangs fences itself").
//
// sanlock facts the rig is built on (sanlock 3.8.5, measured on the
// project's machines; see also docs/LOCKING.md):
//  * A host is a daemon with its own SANLOCK_RUN_DIR (its socket
//    RUN_DIR/sanlock.sock). `sanlock client ...` and libsanlock find their
//    daemon through the same variable; libsanlock reads it once per process
//    (first connection), so one process talks to one host: give a
//    process the host's Env() when starting it.
//  * The daemon runs in the foreground (-D, so pid() is the daemon), without
//    watchdog (-w 0), mlockall (-l 0) or realtime priority (-h 0), with the
//    LD_PRELOAD shim tests/shim/sanlock_memlock_shim.c (EPERM from
//    setrlimit(MEMLOCK/RTPRIO) becomes success; /etc/sanlock/sanlock.conf
//    and /var/log/sanlock.log are redirected into the run dir).
//  * Timing, io_timeout T (seconds, >= 1; `add_lockspace -o T`, and
//    `direct init -o T` so the fresh delta leases carry T too — else a
//    join waits 2 x 10 s): add_lockspace takes 2T + 1 s; other hosts see a
//    new host LIVE ~2T later; a host that stops renewing (SIGKILL or
//    SIGSTOP of its daemon) is FAIL after 8T (+ up to 2T) and DEAD after
//    8T + 60 s: the 60 s watchdog fire timeout is compiled into 3.8.5
//    (sanlock.conf `watchdog_fire_timeout` came after 3.8.5), so with
//    T = 1 DEAD comes 68-71 s after the kill, never sooner.
//  * `sanlock client host_status` prints raw timestamps, not states: use
//    `sanlock client gets -h 1` (HostStates() below) for LIVE/FAIL/DEAD.
//  * Fencing with -w 0: once its renewals have failed for 8T the daemon
//    kills the processes holding resource leases in that lockspace: SIGTERM
//    every second while now < last renewal + 8T + kill grace (daemon -g,
//    default 40 s), then SIGKILL; with -g 0 SIGKILL at once (a client that
//    restricted SIGTERM, sanlock_restrict, gets SIGKILL instead). A daemon
//    SIGSTOPped for > 8T then SIGCONTed fences at once, but if its renewals
//    then succeed again the grace keeps moving: with -g 40 the holder only
//    ever gets SIGTERM (100 times, then the daemon gives up), so tests use
//    -g 0. `sanlock client rem_lockspace` SIGKILLs the holders at once.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/integration/rig.h"

namespace dede::test {

// One simulated host: `sanlock daemon -D -w 0 -l 0 -h 0 -U root -G root -e
// <host_name> [extra_args]` with its own run directory. The constructor
// starts it and returns at once; WaitReady() waits for its socket (so
// several daemons start in parallel). The destructor SIGKILLs the daemon
// and its helper process and reaps it. Create it on a thread that outlives
// it (see TgtdRig).
class SanlockDaemon {
 public:
  // run_dir is created if missing; its path plus "/sanlock.sock" must fit
  // a Unix socket address (< 108 bytes). `config`: content of this
  // daemon's private sanlock.conf (empty: defaults). `exec_prefix`: a
  // command that execs the daemon in place (same pid), e.g.
  // HostNetns::Enter().
  SanlockDaemon(const std::string& run_dir, const std::string& host_name,
                const std::vector<std::string>& extra_args = {}, const std::string& config = "",
                const std::vector<std::string>& exec_prefix = {});
  ~SanlockDaemon();
  SanlockDaemon(const SanlockDaemon&) = delete;
  SanlockDaemon& operator=(const SanlockDaemon&) = delete;

  // Waits until the daemon accepts connections on its socket; throws
  // std::runtime_error with the log's tail if it exits or is not up in time.
  void WaitReady(int timeout_s = 10);

  int pid() const { return pid_; }
  const std::string& run_dir() const { return run_dir_; }
  const std::string& host_name() const { return host_name_; }
  std::string socket_path() const { return run_dir_ + "/sanlock.sock"; }
  // What a client process of this host needs in its environment:
  // {"SANLOCK_RUN_DIR=<run_dir>"}.
  std::vector<std::string> Env() const;

  bool Running();
  void Kill();      // SIGKILL daemon and helper, reap (a simulated host crash)
  void Stop();      // SIGSTOP (a hung host: no renewals)
  void Continue();  // SIGCONT

  // Runs `sanlock ARGS...` with Env(), e.g. Sanlock({"client", "status"}).
  ProcessResult Sanlock(const std::vector<std::string>& args, int timeout_s = 60) const;
  // Everything the daemon logged (stderr, debug level).
  std::string Log() const;
  std::string LogTail(size_t max = 3000) const;

 private:
  std::string run_dir_;
  std::string host_name_;
  std::string log_;
  int pid_ = -1;
};

// Host states from `sanlock client gets -h 1` of one host: host id ->
// "LIVE", "FAIL", "DEAD", "UNKNOWN", "FREE" (only lockspace `lockspace`).
// Empty when the daemon has no data yet ("hosts not ready") or has not
// joined; throws when the command fails.
std::map<uint64_t, std::string> HostStates(const SanlockDaemon& host, const std::string& lockspace);

// One simulated host's own network, so that a test can cut it off from the
// LUN for real (issue 5: "a host cut off from the LUN stops serving writes
// before its leases can be taken over"):
//  * a network namespace `dede-<pid>-<n>` and a veth pair, root side
//    10.b.c.d+1/30, namespace side 10.b.c.d+2/30 (derived from the test
//    process's pid, so concurrent test runs do not collide), `lo` up in
//    the namespace too;
//  * the rig's tgtd also listening on the root-side address (a second
//    portal), so url() reaches the LUN from inside the namespace only
//    through the veth;
//  * a dede-lun-fuse bridge (tests/tools/dede_lun_fuse.cc) started inside
//    the namespace and mounted at `mount_dir`: lun_path() is a file whose
//    every read and write is an iSCSI command over that veth. It stands in
//    for the kernel initiator's /dev/sdX a real host's sanlock would use
//    (this machine has none): O_DIRECT and AIO work, no page cache, I/O
//    errors after a bounded time when the network is gone.
// Processes enter the namespace through Enter() (`nsenter --net=...`, which
// leaves the mount namespace alone: the bridge's FUSE mount stays visible
// to everyone; `ip netns exec` would unshare it). Unix sockets are files,
// so clients in the root namespace still reach the host's daemons.
// CutOff() takes the root-side veth down: every TCP connection of the host
// (its sanlock's lease I/O through the bridge, its dedupd's iSCSI session)
// loses the LUN at once, while the host's processes keep running.
// The destructor kills the bridge, unmounts (lazily if need be), removes
// the portal and deletes the namespace (and with it the veth pair). Kill
// the host's other processes in the namespace first.
// Needs root, /dev/fuse, ip (iproute2), nsenter (util-linux) and the
// built bridge: any of them missing throws (the test fails loudly).
class HostNetns {
 public:
  HostNetns(TgtdRig& tgtd, const std::string& mount_dir);
  ~HostNetns();
  HostNetns(const HostNetns&) = delete;
  HostNetns& operator=(const HostNetns&) = delete;

  const std::string& name() const { return name_; }
  const std::string& root_ip() const { return root_ip_; }
  const std::string& ns_ip() const { return ns_ip_; }
  // iscsi://<root_ip>:<port>/<iqn>/1: the LUN as seen from the namespace.
  std::string url() const;
  // The bridge's file: the LUN as a path, for sanlock (--lease-path).
  std::string lun_path() const { return mount_dir_ + "/lun"; }
  // {"nsenter", "--net=/var/run/netns/<name>", "--"}: prefix of a command
  // that runs in the namespace (exec in place: same pid).
  std::vector<std::string> Enter() const;
  // Takes the root-side veth down (the cut) or up again.
  void CutOff();
  void Reconnect();
  bool cut() const { return cut_; }
  int bridge_pid() const { return bridge_pid_; }
  std::string BridgeLog() const;

 private:
  void Teardown();
  void Ip(const std::vector<std::string>& args) const;  // throws on failure

  TgtdRig& tgtd_;
  std::string mount_dir_;
  std::string name_, veth_root_, veth_ns_, root_ip_, ns_ip_;
  std::string bridge_log_;
  bool ns_created_ = false, portal_added_ = false, cut_ = false;
  int bridge_pid_ = -1;
};

// A TempDir, a sparse LUN file of `lun_size` bytes in it, a TgtdRig serving
// that file, and `hosts` SanlockDaemons named host1..hostN (started in
// parallel; the constructor returns when all accept connections). Nothing
// is initialised on the LUN: tests run `sanlock direct init` themselves
// (LockspaceSpec/ResourceSpec help with the arguments).
// The hosts listed in `netns_hosts` get a HostNetns each: their sanlock
// daemon runs in it and uses the bridge's file as the LUN (lease_path(i)),
// their processes reach the LUN at url(i).
class ClusterRig {
 public:
  explicit ClusterRig(int hosts, uint64_t lun_size = 64ull << 20,
                      const std::vector<std::string>& daemon_args = {},
                      const std::string& daemon_config = "",
                      const std::vector<int>& netns_hosts = {});
  ~ClusterRig();
  ClusterRig(const ClusterRig&) = delete;
  ClusterRig& operator=(const ClusterRig&) = delete;

  const std::string& lun_path() const { return lun_; }
  std::string url() const { return tgtd_->url(); }  // iscsi://127.0.0.1:port/iqn/1
  TgtdRig& tgtd() { return *tgtd_; }
  const TempDir& dir() const { return dir_; }
  int size() const { return static_cast<int>(hosts_.size()); }
  // 1-based, like sanlock host ids: host(1) is "host1".
  SanlockDaemon& host(int i);
  // Host i's own network namespace, or null if it shares the machine's.
  HostNetns* netns(int i) const;
  // How host i reaches the LUN: over iSCSI (url) and as a path for sanlock
  // (lease_path); for a host without its own namespace, url() and
  // lun_path().
  std::string url(int i) const;
  std::string lease_path(int i) const;
  // Prefix of a command run "on host i" (HostNetns::Enter(), or nothing).
  std::vector<std::string> Enter(int i) const;

  // Runs argv "as host i": with host(i).Env() added to its environment.
  ProcessResult RunAsHost(int i, const std::vector<std::string>& argv, int timeout_s = 120);
  // `sanlock client ARGS...` against host i's daemon.
  ProcessResult SanlockClient(int i, const std::vector<std::string>& args, int timeout_s = 60);

  // "NAME:HOST_ID:LUN:OFFSET" and "LOCKSPACE:RESOURCE:LUN:OFFSET[:SH]" for
  // sanlock's -s / -r arguments.
  std::string LockspaceSpec(const std::string& name, uint64_t host_id, uint64_t offset) const;
  std::string ResourceSpec(const std::string& lockspace, const std::string& resource,
                           uint64_t offset, bool shared = false) const;

 private:
  TempDir dir_;
  std::string lun_;
  std::string sock_root_;  // private short dir for run dirs when dir_ is too deep
  std::unique_ptr<TgtdRig> tgtd_;
  std::map<int, std::unique_ptr<HostNetns>> netns_;  // after tgtd_: destroyed before it
  std::vector<std::unique_ptr<SanlockDaemon>> hosts_;
};

}  // namespace dede::test
