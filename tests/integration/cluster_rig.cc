#include "tests/integration/cluster_rig.h"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/mount.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifndef DEDE_SANLOCK_SHIM
#error "DEDE_SANLOCK_SHIM (path of the sanlock LD_PRELOAD shim) must be defined by the build"
#endif
#ifndef DEDE_LUN_FUSE
#error "DEDE_LUN_FUSE (path of the dede-lun-fuse test tool) must be defined by the build"
#endif

namespace dede::test {
namespace {

using Clock = std::chrono::steady_clock;

void WriteFileText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path);
}

// Fields of /proc/PID/stat after the command name: state, ppid, ...
std::vector<std::string> StatFields(int pid) {
  std::string stat = ReadWholeFileText("/proc/" + std::to_string(pid) + "/stat");
  std::vector<std::string> fields;
  size_t close_paren = stat.rfind(')');
  if (close_paren == std::string::npos) return fields;
  std::istringstream in(stat.substr(close_paren + 1));
  std::string f;
  while (in >> f) fields.push_back(f);
  return fields;
}

// Children of `pid` (the daemon's helper), by scanning /proc: these
// kernels lack /proc/PID/task/TID/children.
std::vector<int> ChildrenOf(int pid) {
  std::vector<int> out;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return out;
  const std::string parent = std::to_string(pid);
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
    int candidate = std::atoi(e->d_name);
    std::vector<std::string> fields = StatFields(candidate);
    if (fields.size() > 1 && fields[1] == parent) out.push_back(candidate);
  }
  ::closedir(d);
  return out;
}

// False once the process is gone or a zombie.
bool ProcessExists(int pid) {
  std::vector<std::string> fields = StatFields(pid);
  return !fields.empty() && fields[0] != "Z";
}

std::string Tail(const std::string& s, size_t max) {
  return s.size() > max ? "..." + s.substr(s.size() - max) : s;
}

std::string Shim() {
  const std::string shim = DEDE_SANLOCK_SHIM;
  if (::access(shim.c_str(), R_OK) != 0) {
    throw std::runtime_error("sanlock LD_PRELOAD shim not found at " + shim +
                             " (built by tests/CMakeLists.txt as dede_sanlock_shim)");
  }
  return shim;
}

}  // namespace

// ----------------------------------------------------------------- daemon

SanlockDaemon::SanlockDaemon(const std::string& run_dir, const std::string& host_name,
                             const std::vector<std::string>& extra_args, const std::string& config,
                             const std::vector<std::string>& exec_prefix)
    : run_dir_(run_dir), host_name_(host_name), log_(run_dir + "/daemon.log") {
  const std::string sanlock = RequireProgram("sanlock");
  const std::string shim = Shim();
  sockaddr_un probe{};
  if (socket_path().size() >= sizeof(probe.sun_path)) {
    throw std::runtime_error("SanlockDaemon: run dir too long for a Unix socket: " + run_dir_);
  }
  std::error_code ec;
  std::filesystem::create_directories(run_dir_, ec);
  if (ec)
    throw std::runtime_error("SanlockDaemon: cannot create " + run_dir_ + ": " + ec.message());
  const std::string conf = run_dir_ + "/sanlock.conf";
  WriteFileText(conf, config);

  std::vector<std::string> argv = exec_prefix;
  argv.insert(argv.end(), {sanlock, "daemon", "-D", "-w", "0", "-l", "0", "-h", "0", "-U", "root",
                           "-G", "root", "-e", host_name_});
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  std::vector<std::string> env = {"SANLOCK_RUN_DIR=" + run_dir_, "LD_PRELOAD=" + shim,
                                  "DEDE_SANLOCK_CONF=" + conf,
                                  "DEDE_SANLOCK_LOG=" + run_dir_ + "/sanlock.log"};
  pid_ = StartProcess(argv, env, log_);
}

SanlockDaemon::~SanlockDaemon() {
  Kill();
}

void SanlockDaemon::WaitReady(int timeout_s) {
  const auto deadline = Clock::now() + std::chrono::seconds(timeout_s);
  for (;;) {
    if (!Running()) {
      throw std::runtime_error("sanlock daemon " + host_name_ + " exited during start-up; log:\n" +
                               LogTail());
    }
    if (CanConnectUnix(socket_path())) return;
    if (Clock::now() > deadline) {
      std::string tail = LogTail();
      Kill();
      throw std::runtime_error("sanlock daemon " + host_name_ + " did not listen on " +
                               socket_path() + " within " + std::to_string(timeout_s) +
                               " s; log:\n" + tail);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::vector<std::string> SanlockDaemon::Env() const {
  return {"SANLOCK_RUN_DIR=" + run_dir_};
}

bool SanlockDaemon::Running() { return ChildRunning(&pid_); }

void SanlockDaemon::Kill() {
  if (pid_ <= 0) return;
  // The helper is the daemon's child (it runs kill/killpath requests); it
  // exits by itself once the daemon is gone, but do not leave that to
  // chance. Its pid cannot be reused before the daemon reaps it.
  std::vector<int> helpers = ChildrenOf(pid_);
  for (int h : helpers) ::kill(h, SIGKILL);
  ::kill(pid_, SIGKILL);
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
  // Orphaned helpers are reaped by init; wait for that (briefly).
  const auto deadline = Clock::now() + std::chrono::seconds(2);
  for (int h : helpers) {
    while (ProcessExists(h) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
}

void SanlockDaemon::Stop() {
  if (pid_ > 0) ::kill(pid_, SIGSTOP);
}

void SanlockDaemon::Continue() {
  if (pid_ > 0) ::kill(pid_, SIGCONT);
}

ProcessResult SanlockDaemon::Sanlock(const std::vector<std::string>& args, int timeout_s) const {
  std::vector<std::string> argv = {RequireProgram("sanlock")};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcess(argv, Env(), timeout_s);
}

std::string SanlockDaemon::Log() const {
  return ReadWholeFileText(log_);
}

std::string SanlockDaemon::LogTail(size_t max) const {
  return Tail(Log(), max);
}

std::map<uint64_t, std::string> HostStates(const SanlockDaemon& host,
                                           const std::string& lockspace) {
  const std::vector<std::string> args = {"client", "gets", "-h", "1"};
  ProcessResult r = host.Sanlock(args, 30);
  if (r.exit_code != 0) {
    throw std::runtime_error("sanlock client gets -h 1 (" + host.host_name() + ") failed: exit " +
                             std::to_string(r.exit_code) + " " + r.out + r.err);
  }
  // s NAME:ID:PATH:OFFSET
  // h ID gen G timestamp T STATE
  std::map<uint64_t, std::string> states;
  std::istringstream in(r.out);
  std::string line;
  bool ours = false;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string kind;
    words >> kind;
    if (kind == "s") {
      std::string spec;
      words >> spec;
      ours = spec.compare(0, lockspace.size() + 1, lockspace + ":") == 0;
    } else if (kind == "h" && ours) {
      uint64_t id = 0;
      std::string gen_word, gen, ts_word, ts, state;
      words >> id >> gen_word >> gen >> ts_word >> ts >> state;
      if (!state.empty()) states[id] = state;
    }
  }
  return states;
}

// ------------------------------------------------------------- host netns

namespace {

// Whether `dir` is a mount point (of anything), from /proc/self/mountinfo.
bool IsMountPoint(const std::string& dir) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string id, parent, dev, root, point;
    f >> id >> parent >> dev >> root >> point;
    if (point == dir) return true;
  }
  return false;
}

// Namespaces "dede-<pid>-<n>" of test processes that are gone (killed
// before their destructors ran): deleted, with their veth pairs. A live
// pid's are left alone, whoever it is.
void RemoveStaleNamespaces() {
  DIR* d = ::opendir("/var/run/netns");
  if (d == nullptr) return;
  std::vector<std::string> stale;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind("dede-", 0) != 0) continue;
    const int pid = std::atoi(name.c_str() + 5);
    if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) stale.push_back(name);
  }
  ::closedir(d);
  for (const auto& name : stale) RunProcess({RequireProgram("ip"), "netns", "del", name}, 30);
}

}  // namespace

HostNetns::HostNetns(TgtdRig& tgtd, const std::string& mount_dir)
    : tgtd_(tgtd), mount_dir_(mount_dir) {
  RequireProgram("ip");
  RequireProgram("nsenter");
  const std::string bridge = DEDE_LUN_FUSE;
  if (::access(bridge.c_str(), X_OK) != 0) {
    throw std::runtime_error("HostNetns: " + bridge +
                             " not found (built by tests/CMakeLists.txt as dede-lun-fuse)");
  }
  if (::access("/dev/fuse", R_OK | W_OK) != 0) {
    throw std::runtime_error(std::string("HostNetns: /dev/fuse: ") + std::strerror(errno) +
                             " (FUSE is needed for the host's LUN bridge)");
  }
  // Names and a /30 unique per test process (and per rig in it): veth
  // names must fit IFNAMSIZ (15 characters).
  static std::atomic<unsigned> counter{0};
  const unsigned n = counter.fetch_add(1);
  const unsigned pid = static_cast<unsigned>(::getpid());
  const std::string tag = std::to_string(pid) + "x" + std::to_string(n % 100);
  name_ = "dede-" + std::to_string(pid) + "-" + std::to_string(n);
  veth_root_ = "dr" + tag;
  veth_ns_ = "dn" + tag;
  const unsigned idx = (pid * 8 + n) % (1u << 20);
  const std::string net = "10." + std::to_string(128 + ((idx >> 14) & 63)) + "." +
                          std::to_string((idx >> 6) & 255) + ".";
  root_ip_ = net + std::to_string((idx & 63) * 4 + 1);
  ns_ip_ = net + std::to_string((idx & 63) * 4 + 2);
  bridge_log_ = mount_dir_ + ".log";
  RemoveStaleNamespaces();

  try {
    Ip({"netns", "add", name_});
    ns_created_ = true;
    Ip({"link", "add", veth_root_, "type", "veth", "peer", "name", veth_ns_, "netns", name_});
    Ip({"addr", "add", root_ip_ + "/30", "dev", veth_root_});
    Ip({"link", "set", veth_root_, "up"});
    Ip({"-n", name_, "addr", "add", ns_ip_ + "/30", "dev", veth_ns_});
    Ip({"-n", name_, "link", "set", veth_ns_, "up"});
    Ip({"-n", name_, "link", "set", "lo", "up"});

    const std::string portal = root_ip_ + ":" + std::to_string(tgtd_.port());
    ProcessResult r = tgtd_.Tgtadm({"--op", "new", "--mode", "portal", "--param", "portal=" + portal});
    if (r.exit_code != 0) {
      throw std::runtime_error("HostNetns: tgtadm new portal " + portal + ": " +
                               DescribeRun({"tgtadm"}, r));
    }
    portal_added_ = true;

    std::error_code ec;
    std::filesystem::create_directories(mount_dir_, ec);
    if (ec) throw std::runtime_error("HostNetns: cannot create " + mount_dir_ + ": " + ec.message());
    std::vector<std::string> argv = Enter();
    // --timeout 3: a request (and a login) gives up with EIO after 3 s; a
    // live target answers in milliseconds, and sanlock (io_timeout 1 s in
    // the tests) has given up on it long before.
    argv.insert(argv.end(), {bridge, url(), mount_dir_, "-f", "--timeout", "3"});
    bridge_pid_ = StartProcess(argv, {}, bridge_log_);
    // Mounted once the file shows up with a size (the veth comes up
    // asynchronously: the bridge's first login may need a moment).
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    for (;;) {
      struct stat st {};
      if (::stat(lun_path().c_str(), &st) == 0 && st.st_size > 0) break;
      if (!ChildRunning(&bridge_pid_)) {
        throw std::runtime_error("HostNetns: dede-lun-fuse exited during start-up; log:\n" +
                                 BridgeLog());
      }
      if (Clock::now() > deadline) {
        throw std::runtime_error("HostNetns: " + lun_path() + " did not appear within 20 s; log:\n" +
                                 BridgeLog());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (...) {
    Teardown();
    throw;
  }
}

HostNetns::~HostNetns() { Teardown(); }

void HostNetns::Ip(const std::vector<std::string>& args) const {
  std::vector<std::string> argv = {RequireProgram("ip")};
  argv.insert(argv.end(), args.begin(), args.end());
  ProcessResult r = RunProcess(argv, 30);
  if (r.exit_code != 0) throw std::runtime_error("HostNetns: " + DescribeRun(argv, r));
}

std::string HostNetns::url() const {
  return "iscsi://" + root_ip_ + ":" + std::to_string(tgtd_.port()) + "/" + tgtd_.iqn() + "/1";
}

std::vector<std::string> HostNetns::Enter() const {
  return {RequireProgram("nsenter"), "--net=/var/run/netns/" + name_, "--"};
}

void HostNetns::CutOff() {
  Ip({"link", "set", veth_root_, "down"});
  cut_ = true;
}

void HostNetns::Reconnect() {
  Ip({"link", "set", veth_root_, "up"});
  cut_ = false;
}

std::string HostNetns::BridgeLog() const {
  return Tail(ReadWholeFileText(bridge_log_), 3000);
}

void HostNetns::Teardown() {
  // The bridge: SIGTERM unmounts cleanly, but it may be inside a request
  // to a cut-off target (up to its 3 s timeout); do not wait for that.
  if (bridge_pid_ > 0) {
    ::kill(bridge_pid_, SIGTERM);
    const auto deadline = Clock::now() + std::chrono::seconds(1);
    while (ChildRunning(&bridge_pid_) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (bridge_pid_ > 0) {
      ::kill(bridge_pid_, SIGKILL);
      int status = 0;
      while (::waitpid(bridge_pid_, &status, 0) < 0 && errno == EINTR) {
      }
      bridge_pid_ = -1;
    }
  }
  // A killed bridge leaves its mount behind ("transport endpoint is not
  // connected"): detach it (what `fusermount3 -u -z` does; we are root).
  if (!mount_dir_.empty() && IsMountPoint(mount_dir_)) {
    if (::umount2(mount_dir_.c_str(), MNT_DETACH) != 0) {
      std::fprintf(stderr, "HostNetns: umount2 %s: %s\n", mount_dir_.c_str(), std::strerror(errno));
    }
  }
  if (portal_added_) {
    (void)tgtd_.Tgtadm({"--op", "delete", "--mode", "portal", "--param",
                       "portal=" + root_ip_ + ":" + std::to_string(tgtd_.port())});
    portal_added_ = false;
  }
  if (ns_created_) {
    // Deleting the namespace deletes its veth end, and with it the pair.
    ProcessResult r = RunProcess({RequireProgram("ip"), "netns", "del", name_}, 30);
    if (r.exit_code != 0) std::fprintf(stderr, "HostNetns: ip netns del %s failed\n", name_.c_str());
    RunProcess({RequireProgram("ip"), "link", "del", veth_root_}, 30);  // usually gone already
    ns_created_ = false;
  }
}

// ------------------------------------------------------------------ cluster

ClusterRig::ClusterRig(int hosts, uint64_t lun_size, const std::vector<std::string>& daemon_args,
                       const std::string& daemon_config, const std::vector<int>& netns_hosts) {
  if (hosts < 1) throw std::invalid_argument("ClusterRig: needs at least one host");
  RequireProgram("sanlock");
  lun_ = dir_.file("lun");
  CreateSparseFile(lun_, lun_size);
  tgtd_ = std::make_unique<TgtdRig>(lun_);

  // Run dirs hold the daemons' Unix sockets: keep their paths short.
  std::string root = dir_.path();
  if (root.size() > 70) {
    char templ[] = "/tmp/dede-slk-XXXXXX";
    if (::mkdtemp(templ) == nullptr) {
      throw std::runtime_error(std::string("mkdtemp /tmp/dede-slk-: ") + std::strerror(errno));
    }
    sock_root_ = templ;
    root = sock_root_;
  }
  try {
    for (int i : netns_hosts) {
      if (i < 1 || i > hosts) throw std::out_of_range("ClusterRig: no host " + std::to_string(i));
      netns_[i] = std::make_unique<HostNetns>(*tgtd_, dir_.file("lun-bridge" + std::to_string(i)));
    }
    // Start every daemon, then wait for all: they come up in parallel.
    for (int i = 1; i <= hosts; ++i) {
      hosts_.push_back(std::make_unique<SanlockDaemon>(root + "/h" + std::to_string(i),
                                                       "host" + std::to_string(i), daemon_args,
                                                       daemon_config, Enter(i)));
    }
    for (auto& h : hosts_) h->WaitReady();
  } catch (...) {
    hosts_.clear();
    netns_.clear();
    if (!sock_root_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(sock_root_, ec);
    }
    throw;
  }
}

ClusterRig::~ClusterRig() {
  hosts_.clear();  // daemons first: they hold the LUN (or a bridge's file) open
  netns_.clear();  // bridges, mounts, portals, namespaces
  tgtd_.reset();
  if (!sock_root_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(sock_root_, ec);
  }
}

SanlockDaemon& ClusterRig::host(int i) {
  if (i < 1 || i > size()) {
    throw std::out_of_range("ClusterRig::host(" + std::to_string(i) + "): hosts are 1.." +
                            std::to_string(size()));
  }
  return *hosts_[static_cast<size_t>(i - 1)];
}

HostNetns* ClusterRig::netns(int i) const {
  auto it = netns_.find(i);
  return it == netns_.end() ? nullptr : it->second.get();
}

std::string ClusterRig::url(int i) const {
  HostNetns* n = netns(i);
  return n ? n->url() : url();
}

std::string ClusterRig::lease_path(int i) const {
  HostNetns* n = netns(i);
  return n ? n->lun_path() : lun_;
}

std::vector<std::string> ClusterRig::Enter(int i) const {
  HostNetns* n = netns(i);
  return n ? n->Enter() : std::vector<std::string>{};
}

ProcessResult ClusterRig::RunAsHost(int i, const std::vector<std::string>& argv, int timeout_s) {
  std::vector<std::string> full = Enter(i);
  full.insert(full.end(), argv.begin(), argv.end());
  return RunProcess(full, host(i).Env(), timeout_s);
}

ProcessResult ClusterRig::SanlockClient(int i, const std::vector<std::string>& args,
                                        int timeout_s) {
  std::vector<std::string> full = {"client"};
  full.insert(full.end(), args.begin(), args.end());
  return host(i).Sanlock(full, timeout_s);
}

std::string ClusterRig::LockspaceSpec(const std::string& name, uint64_t host_id,
                                      uint64_t offset) const {
  return name + ":" + std::to_string(host_id) + ":" + lun_ + ":" + std::to_string(offset);
}

std::string ClusterRig::ResourceSpec(const std::string& lockspace, const std::string& resource,
                                     uint64_t offset, bool shared) const {
  return lockspace + ":" + resource + ":" + lun_ + ":" + std::to_string(offset) +
         (shared ? ":SH" : "");
}

}  // namespace dede::test
