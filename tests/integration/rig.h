// Test rig for integration tests: temporary directories, running the
// project's binaries as child processes, and a real tgtd iSCSI target on
// 127.0.0.1. A missing component (tgtd, tgtadm) fails the test loudly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dede::test {

// A fresh directory under $TMPDIR (or /tmp), removed recursively on
// destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct ProcessResult {
  int exit_code = -1;  // -1 if killed by a signal
  int signal = 0;
  std::string out;
  std::string err;
};

// Runs argv[0] (a path, or a name looked up in PATH) with no stdin, captures
// stdout and stderr, waits up to `timeout_s` seconds (then SIGKILL and
// exit_code -1).
ProcessResult RunProcess(const std::vector<std::string>& argv, int timeout_s = 120);
// The same with extra "NAME=value" entries in the child's environment
// (overriding this process's variables of the same name), e.g.
// {"SANLOCK_RUN_DIR=/tmp/..."}.
ProcessResult RunProcess(const std::vector<std::string>& argv,
                         const std::vector<std::string>& extra_env, int timeout_s = 120);

// Starts argv as a background child with stdin from /dev/null and stdout
// and stderr appended to `log_path`, with `extra_env` added to its
// environment; returns its pid (the caller waits for it). Like every child
// of the rig it gets SIGKILL when the thread that started it exits.
int StartProcess(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env,
                 const std::string& log_path);

// "argv... / exit N signal S / stdout / stderr" (each stream cut at 4000
// bytes) for test failure messages.
std::string DescribeRun(const std::vector<std::string>& argv, const ProcessResult& r);

// The whole content of a file (empty if it cannot be opened; what was
// read before an error if a read fails).
std::vector<uint8_t> ReadWholeFile(const std::string& path);
// The same as a string: logs, /proc files, exported images compared whole.
std::string ReadWholeFileText(const std::string& path);

// Path of a binary built by this project, e.g. BinaryPath("dede").
std::string BinaryPath(const std::string& name);

// Full path of an external program (qemu-img, nbdcopy, fio...); throws
// (failing the test loudly) when the machine lacks it.
std::string RequireProgram(const std::string& name);

// True when something accepts connections on the Unix socket `path` (a
// daemon is up).
bool CanConnectUnix(const std::string& path);

// Whether the child `*pid` (-1: none) still runs; reaps it and sets *pid to
// -1 once it has exited.
bool ChildRunning(int* pid);

// Creates a file of `size` bytes (sparse).
void CreateSparseFile(const std::string& path, uint64_t size);

// How many times `what` occurs in `text` (overlapping ones too), e.g. a
// line in a daemon's log.
inline uint64_t CountOf(const std::string& text, const std::string& what) {
  uint64_t n = 0;
  for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) n++;
  return n;
}

// A tgtd serving one LUN (lun 1) backed by a file, on 127.0.0.1:<free port>,
// with its own control socket. Started in the constructor; the destructor
// deletes the target and stops tgtd by pid ("tgtadm --op delete --mode
// system"; tgtd ignores SIGTERM, SIGKILL is the fallback). One per test
// suite is plenty: tgtd starts in well under a second. tgtd is also killed
// when the thread that created the rig exits (so a crashed test leaves no
// daemon behind): create rigs on a thread that outlives them.
class TgtdRig {
 public:
  // backing_file must exist with the LUN's size. chap_user/password empty =
  // no authentication.
  explicit TgtdRig(const std::string& backing_file, const std::string& chap_user = "",
                   const std::string& chap_password = "");
  ~TgtdRig();
  TgtdRig(const TgtdRig&) = delete;
  TgtdRig& operator=(const TgtdRig&) = delete;

  int port() const { return port_; }
  const std::string& iqn() const { return iqn_; }
  // iscsi://127.0.0.1:<port>/<iqn>/1 (with user%password@ when CHAP is on).
  std::string url() const;
  // tgtd's pid; a test may SIGKILL it to simulate a crashed target.
  int pid() const { return pid_; }

  // Runs `tgtadm -C <ctl> --lld iscsi ARGS...` against this tgtd, e.g. to
  // drop sessions or change LUN parameters from a test.
  ProcessResult Tgtadm(const std::vector<std::string>& args) const;

 private:
  void Shutdown();

  std::string backing_;
  std::string user_, password_;
  std::string iqn_;
  std::string control_;  // tgtd control path prefix (TGT_IPC_SOCKET; -C picks the suffix)
  std::string run_dir_;  // private directory holding the control socket and tgtd.log
  std::string tgtadm_;   // resolved path of tgtadm
  int port_ = 0;
  int pid_ = -1;
  int lld_id_ = 0;  // tgtd control port number (-C)
};

// A dedupd serving a volume on a Unix socket, as a child process whose
// stderr goes to a log file. The constructor waits until the socket
// accepts connections (throws with the log's tail if dedupd exits or does
// not come up in 30 s). The destructor SIGKILLs a dedupd still running.
// `env`: extra "NAME=value" entries for dedupd's environment (e.g. a
// simulated host's SANLOCK_RUN_DIR, see cluster_rig.h). `exec_prefix`: a
// command that execs dedupd in place (same pid), e.g. `nsenter
// --net=/var/run/netns/NAME --` for a host in its own network namespace.
class DedupdProcess {
 public:
  DedupdProcess(const std::string& volume, uint32_t host_id, const std::string& socket,
                const std::vector<std::string>& extra_args = {},
                const std::vector<std::string>& env = {},
                const std::vector<std::string>& exec_prefix = {});
  ~DedupdProcess();
  DedupdProcess(const DedupdProcess&) = delete;
  DedupdProcess& operator=(const DedupdProcess&) = delete;

  const std::string& socket() const { return socket_; }
  // Its control socket (`dede status --control`) and pass history
  // (`dede report --history`), unless the test gave its own.
  const std::string& control() const { return control_; }
  const std::string& history() const { return history_; }
  // nbd+unix:///NAME?socket=PATH
  std::string Uri(const std::string& export_name) const;
  int pid() const { return pid_; }
  bool Running();
  // SIGTERM, then waits up to `timeout_s`; returns the exit code (-1 if it
  // had to be killed or died of a signal).
  int Stop(int timeout_s = 60);
  void Kill();
  // How it ended, once Running() or Stop() has seen it exit (a waitpid
  // status); -1 while it runs or when the rig killed it.
  int wait_status() const { return wait_status_; }
  std::string Log() const;  // everything dedupd wrote to stderr
  // Polls the log until it holds `what`, for at most `limit_s` seconds;
  // whether it came. A test that needs the line REQUIREs the answer.
  bool WaitForLog(const std::string& what, double limit_s) const;

 private:
  std::string socket_;
  std::string control_;
  std::string history_;
  std::string log_;
  int pid_ = -1;
  int wait_status_ = -1;
};

}  // namespace dede::test
