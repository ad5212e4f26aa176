#include "tests/integration/rig.h"

#include <algorithm>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
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
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace dede::test {
namespace {

using Clock = std::chrono::steady_clock;

std::string ErrnoText(const std::string& what, int err) {
  return what + ": " + std::strerror(err);
}

std::string TmpRoot() {
  const char* t = std::getenv("TMPDIR");
  return (t != nullptr && *t != '\0') ? std::string(t) : std::string("/tmp");
}

std::string MakeTempDir(const std::string& root, const std::string& prefix) {
  std::string templ = root + "/" + prefix + "XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    throw std::runtime_error(ErrnoText("mkdtemp " + templ, errno));
  }
  return std::string(buf.data());
}

// PATH lookup plus the sbin directories, which a non-login root shell may
// not have on PATH but where Debian installs tgtd and tgtadm.
std::string FindExecutable(const std::string& name) {
  std::vector<std::string> dirs;
  if (const char* path = std::getenv("PATH")) {
    std::stringstream ss(path);
    std::string dir;
    while (std::getline(ss, dir, ':')) {
      if (!dir.empty()) dirs.push_back(dir);
    }
  }
  for (const char* d : {"/usr/sbin", "/sbin", "/usr/local/sbin"}) dirs.push_back(d);
  for (const auto& dir : dirs) {
    std::string candidate = dir + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// The environment of this process with `extra` ("NAME=value") overriding.
std::vector<std::string> EnvWith(const std::vector<std::string>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string entry(*e);
    std::string key = entry.substr(0, entry.find('='));
    bool overridden = false;
    for (const auto& x : extra) {
      if (x.substr(0, x.find('=')) == key) overridden = true;
    }
    if (!overridden) env.push_back(entry);
  }
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

std::vector<char*> CStrings(std::vector<std::string>& v) {
  std::vector<char*> out;
  out.reserve(v.size() + 1);
  for (auto& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Forks and execs argv with stdin from /dev/null and stdout/stderr on the
// given descriptors. The child dies with the test process (PDEATHSIG), so a
// crashing test cannot leave daemons behind. PDEATHSIG follows the forking
// thread, not the process: rig.h tells users to keep that thread alive.
pid_t Spawn(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env,
            int out_fd, int err_fd) {
  if (argv.empty()) throw std::runtime_error("Spawn: empty argv");
  // Everything the child needs is built before fork: only async-signal-safe
  // calls happen between fork and exec.
  std::vector<std::string> args = argv;
  std::vector<std::string> env = EnvWith(extra_env);
  std::vector<char*> c_args = CStrings(args);
  std::vector<char*> c_env = CStrings(env);
  std::string exec_failed = "cannot execute " + argv[0] + "\n";
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0) throw std::runtime_error(ErrnoText("open /dev/null", errno));
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    int e = errno;
    ::close(devnull);
    throw std::runtime_error(ErrnoText("fork", e));
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(devnull, 0);
    ::dup2(out_fd, 1);
    ::dup2(err_fd, 2);
    ::execvpe(c_args[0], c_args.data(), c_env.data());
    ssize_t ignored = ::write(2, exec_failed.data(), exec_failed.size());
    (void)ignored;
    ::_exit(127);
  }
  ::close(devnull);
  return pid;
}

ProcessResult RunProcessEnv(const std::vector<std::string>& argv,
                            const std::vector<std::string>& extra_env, int timeout_s) {
  int out_pipe[2];
  int err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) throw std::runtime_error(ErrnoText("pipe2", errno));
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
    int e = errno;
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    throw std::runtime_error(ErrnoText("pipe2", e));
  }
  pid_t pid;
  try {
    pid = Spawn(argv, extra_env, out_pipe[1], err_pipe[1]);
  } catch (...) {
    for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) ::close(fd);
    throw;
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);

  ProcessResult result;
  const auto deadline = Clock::now() + std::chrono::seconds(timeout_s);
  bool killed = false;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open_fds = 2;
  while (open_fds > 0) {
    auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0 && !killed) {
      ::kill(pid, SIGKILL);
      killed = true;
    }
    // After the kill, a grandchild may still hold the pipes: give it a
    // moment, then stop reading.
    int wait_ms = killed ? 1000 : static_cast<int>(std::min<long long>(left, 1000));
    int n = ::poll(fds, 2, wait_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (n == 0) {
      if (killed) break;
      continue;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buf[4096];
      ssize_t r = ::read(fds[i].fd, buf, sizeof(buf));
      if (r > 0) {
        sinks[i]->append(buf, static_cast<size_t>(r));
      } else if (r == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (auto& f : fds) {
    if (f.fd >= 0) ::close(f.fd);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && !killed) {
    result.exit_code = WEXITSTATUS(status);
  } else {
    result.exit_code = -1;
    result.signal = WIFSIGNALED(status) ? WTERMSIG(status) : SIGKILL;
  }
  return result;
}

// A TCP port on 127.0.0.1 that nobody listened on a moment ago. The kernel
// does not hand the same ephemeral port out again right away, so the race
// with other processes is small.
int FreeLoopbackPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error(ErrnoText("socket", errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    int e = errno;
    ::close(fd);
    throw std::runtime_error(ErrnoText("bind 127.0.0.1:0", e));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

bool CanConnect(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

std::string ReadTail(const std::string& path, size_t max = 2000) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  if (s.size() > max) s = "..." + s.substr(s.size() - max);
  return s;
}

std::string RandomHex(int digits) {
  std::random_device rd;
  std::mt19937_64 gen((static_cast<uint64_t>(rd()) << 32) ^ rd());
  static const char kHex[] = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < digits; ++i) s.push_back(kHex[gen() % 16]);
  return s;
}

std::string Describe(const ProcessResult& r) {
  std::string s = r.exit_code >= 0 ? "exit code " + std::to_string(r.exit_code)
                                   : "killed by signal " + std::to_string(r.signal);
  std::string detail = r.err.empty() ? r.out : r.err;
  while (!detail.empty() && (detail.back() == '\n' || detail.back() == ' ')) detail.pop_back();
  if (!detail.empty()) s += ": " + detail;
  return s;
}

}  // namespace

// --------------------------------------------------------------------------

TempDir::TempDir() : path_(MakeTempDir(TmpRoot(), "dede-test-")) {}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

ProcessResult RunProcess(const std::vector<std::string>& argv, int timeout_s) {
  return RunProcessEnv(argv, {}, timeout_s);
}

ProcessResult RunProcess(const std::vector<std::string>& argv,
                         const std::vector<std::string>& extra_env, int timeout_s) {
  return RunProcessEnv(argv, extra_env, timeout_s);
}

int StartProcess(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env,
                 const std::string& log_path) {
  int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error(ErrnoText("cannot create " + log_path, errno));
  pid_t pid;
  try {
    pid = Spawn(argv, extra_env, fd, fd);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return pid;
}

std::string DescribeRun(const std::vector<std::string>& argv, const ProcessResult& r) {
  std::string s;
  for (const auto& a : argv) s += a + " ";
  s += "\n  exit " + std::to_string(r.exit_code) + " signal " + std::to_string(r.signal) +
       "\n  stdout: " + r.out.substr(0, 4000) + "\n  stderr: " + r.err.substr(0, 4000);
  return s;
}

namespace {
// Into a std::vector<uint8_t> or a std::string alike.
template <class Bytes>
Bytes ReadAll(const std::string& path) {
  // Sized reads, not a byte-at-a-time stream iterator: the tests read
  // exported images of up to hundreds of MiB, and the test code is built
  // without optimisation (tests/CMakeLists.txt), where the iterator spent
  // most of a 70 s test under ASan.
  Bytes data;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return data;
  constexpr size_t kChunk = 1 << 20;
  struct stat st {};
  // Room for the read that finds the end too: no copy of the whole image.
  if (::fstat(fd, &st) == 0 && st.st_size > 0) {
    data.reserve(static_cast<size_t>(st.st_size) + kChunk);
  }
  for (;;) {
    const size_t have = data.size();
    data.resize(have + kChunk);
    const ssize_t n = ::read(fd, data.data() + have, kChunk);
    if (n < 0 && errno == EINTR) {
      data.resize(have);
      continue;
    }
    if (n <= 0) {  // end of file, or an error: what was read so far
      data.resize(have);
      break;
    }
    data.resize(have + static_cast<size_t>(n));
  }
  ::close(fd);
  return data;
}
}  // namespace

std::vector<uint8_t> ReadWholeFile(const std::string& path) {
  return ReadAll<std::vector<uint8_t>>(path);
}

std::string ReadWholeFileText(const std::string& path) {
  return ReadAll<std::string>(path);
}

std::string BinaryPath(const std::string& name) {
  const std::string root = DEDE_BINARY_DIR;
  if (name == "dede") return root + "/tools/dede/dede";
  if (name == "dede-vmgen") return root + "/tools/vmgen/dede-vmgen";
  if (name == "dedupd") return root + "/agent/dedupd";
  return root + "/" + name;
}

void CreateSparseFile(const std::string& path, uint64_t size) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error(ErrnoText("cannot create " + path, errno));
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int e = errno;
    ::close(fd);
    throw std::runtime_error(ErrnoText("cannot size " + path, e));
  }
  ::close(fd);
}

// --------------------------------------------------------------------------

TgtdRig::TgtdRig(const std::string& backing_file, const std::string& chap_user,
                 const std::string& chap_password)
    : backing_(backing_file), user_(chap_user), password_(chap_password) {
  struct stat st {};
  if (::stat(backing_.c_str(), &st) != 0) {
    throw std::runtime_error(ErrnoText("TgtdRig: backing file " + backing_, errno));
  }
  if (user_.empty() != password_.empty()) {
    throw std::runtime_error("TgtdRig: CHAP needs both a user and a password");
  }
  const std::string tgtd = FindExecutable("tgtd");
  tgtadm_ = FindExecutable("tgtadm");
  if (tgtd.empty() || tgtadm_.empty()) {
    throw std::runtime_error(
        "TgtdRig: tgtd/tgtadm not found in PATH or /usr/sbin (install the Debian package 'tgt')");
  }

  // tgtd's control socket goes in a private directory (TGT_IPC_SOCKET) so
  // rigs never collide with each other or with a system tgtd in
  // /var/run/tgtd. Unix socket paths are short: stay under /tmp if $TMPDIR
  // is deep.
  std::string root = TmpRoot();
  if (root.size() > 60) root = "/tmp";
  run_dir_ = MakeTempDir(root, "dede-tgtd-");
  control_ = run_dir_ + "/socket";
  // Only needs to be unique per control path, which is already private;
  // varying it still helps when reading logs of parallel runs.
  static std::atomic<int> counter{0};
  lld_id_ = 1000 + static_cast<int>((::getpid() * 7 + counter.fetch_add(1)) % 30000);
  iqn_ = "iqn.2026-11.org.dede.test:" + RandomHex(12);

  try {
    port_ = FreeLoopbackPort();
    const std::string log_path = run_dir_ + "/tgtd.log";
    int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log_fd < 0)
      throw std::runtime_error(ErrnoText("TgtdRig: cannot create " + log_path, errno));
    // Never the default 0.0.0.0 portal: tests must not be reachable from
    // the network.
    std::vector<std::string> argv = {tgtd,      "-f",
                                     "-C",      std::to_string(lld_id_),
                                     "--iscsi", "portal=127.0.0.1:" + std::to_string(port_)};
    try {
      pid_ = Spawn(argv, {"TGT_IPC_SOCKET=" + control_}, log_fd, log_fd);
    } catch (...) {
      ::close(log_fd);
      throw;
    }
    ::close(log_fd);

    auto fail = [&](const std::string& what) {
      throw std::runtime_error("TgtdRig: " + what + "; tgtd log: " + ReadTail(log_path));
    };

    // Ready once the management socket answers.
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    ProcessResult last;
    for (;;) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        fail("tgtd exited during startup (status " + std::to_string(status) + ")");
      }
      last = Tgtadm({"--op", "show", "--mode", "target"});
      if (last.exit_code == 0) break;
      if (Clock::now() > deadline)
        fail("tgtd did not answer tgtadm within 10 s (" + Describe(last) + ")");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }

    auto must = [&](const std::vector<std::string>& args) {
      ProcessResult r = Tgtadm(args);
      if (r.exit_code != 0) {
        std::string cmd = "tgtadm";
        for (const auto& a : args) cmd += " " + a;
        fail(cmd + " failed: " + Describe(r));
      }
    };
    must({"--op", "new", "--mode", "target", "--tid", "1", "-T", iqn_});
    must({"--op", "new", "--mode", "logicalunit", "--tid", "1", "--lun", "1", "-b", backing_});
    must({"--op", "bind", "--mode", "target", "--tid", "1", "-I", "ALL"});
    if (!user_.empty()) {
      must({"--op", "new", "--mode", "account", "--user", user_, "--password", password_});
      must({"--op", "bind", "--mode", "account", "--tid", "1", "--user", user_});
    }

    // tgtd keeps running when it cannot bind the portal (port taken in the
    // meantime); catch that here rather than as a puzzling login failure.
    const auto portal_deadline = Clock::now() + std::chrono::seconds(5);
    while (!CanConnect(port_)) {
      if (Clock::now() > portal_deadline) {
        fail("tgtd does not accept connections on 127.0.0.1:" + std::to_string(port_));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (...) {
    Shutdown();
    throw;
  }
}

TgtdRig::~TgtdRig() {
  Shutdown();
}

ProcessResult TgtdRig::Tgtadm(const std::vector<std::string>& args) const {
  std::vector<std::string> argv = {tgtadm_, "-C", std::to_string(lld_id_), "--lld", "iscsi"};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcessEnv(argv, {"TGT_IPC_SOCKET=" + control_}, 30);
}

std::string TgtdRig::url() const {
  std::string cred = user_.empty() ? "" : user_ + "%" + password_ + "@";
  return "iscsi://" + cred + "127.0.0.1:" + std::to_string(port_) + "/" + iqn_ + "/1";
}

void TgtdRig::Shutdown() {
  if (pid_ > 0) {
    // tgtd ignores SIGTERM; it exits on "delete system", which it only
    // accepts once no target is left. SIGKILL is the fallback.
    (void)Tgtadm({"--op", "delete", "--force", "--mode", "target", "--tid", "1"});
    (void)Tgtadm({"--op", "delete", "--mode", "system"});
    bool exited = false;
    const auto deadline = Clock::now() + std::chrono::seconds(3);
    while (Clock::now() < deadline) {
      int status = 0;
      pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_ || (r < 0 && errno == ECHILD)) {
        exited = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!exited) {
      ::kill(pid_, SIGTERM);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      ::kill(pid_, SIGKILL);
      int status = 0;
      while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
    }
    pid_ = -1;
  }
  if (!run_dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(run_dir_, ec);
    run_dir_.clear();
  }
}

std::string RequireProgram(const std::string& name) {
  std::string path = FindExecutable(name);
  if (path.empty()) {
    throw std::runtime_error(name + " is not installed (scripts/install-deps installs it)");
  }
  return path;
}

// ------------------------------------------------------------------ dedupd

bool CanConnectUnix(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

DedupdProcess::DedupdProcess(const std::string& volume, uint32_t host_id, const std::string& socket,
                             const std::vector<std::string>& extra_args,
                             const std::vector<std::string>& env,
                             const std::vector<std::string>& exec_prefix)
    : socket_(socket), control_(socket + ".ctl"), history_(socket + ".history.db"),
      log_(socket + ".log") {
  std::vector<std::string> argv = exec_prefix;
  argv.insert(argv.end(), {BinaryPath("dedupd"), "--volume", volume, "--host-id",
                           std::to_string(host_id), "--socket", socket});
  // Each test dedupd gets its own control socket, pass history and metrics
  // port (any free one) next to its NBD socket, unless the test names them:
  // tests never touch the host's /run/dede or /var/lib/dede.
  auto given = [&](const char* flag) {
    return std::find(extra_args.begin(), extra_args.end(), flag) != extra_args.end();
  };
  if (!given("--control")) argv.insert(argv.end(), {"--control", control_});
  if (!given("--history")) argv.insert(argv.end(), {"--history", history_});
  if (!given("--metrics-port")) argv.insert(argv.end(), {"--metrics-port", "0"});
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error(ErrnoText("cannot create " + log_, errno));
  try {
    pid_ = Spawn(argv, env, fd, fd);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while (true) {
    if (!Running()) {
      throw std::runtime_error("dedupd exited during start-up:\n" + ReadTail(log_));
    }
    if (CanConnectUnix(socket_)) {
      // A connection attempt opens a session dedupd logs and drops: fine.
      return;
    }
    if (Clock::now() > deadline) {
      Kill();
      throw std::runtime_error("dedupd did not listen on " + socket_ + " within 30 s:\n" +
                               ReadTail(log_));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

DedupdProcess::~DedupdProcess() { Kill(); }

std::string DedupdProcess::Uri(const std::string& export_name) const {
  return "nbd+unix:///" + export_name + "?socket=" + socket_;
}

bool ChildRunning(int* pid) {
  if (*pid <= 0) return false;
  int status = 0;
  pid_t r = ::waitpid(*pid, &status, WNOHANG);
  if (r == *pid || (r < 0 && errno == ECHILD)) {
    *pid = -1;
    return false;
  }
  return true;
}

bool DedupdProcess::Running() {
  if (pid_ <= 0) return false;
  int status = 0;
  pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    wait_status_ = status;
    pid_ = -1;
    return false;
  }
  if (r < 0 && errno == ECHILD) {
    pid_ = -1;
    return false;
  }
  return true;
}

int DedupdProcess::Stop(int timeout_s) {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGTERM);
  const auto deadline = Clock::now() + std::chrono::seconds(timeout_s);
  while (Clock::now() < deadline) {
    int status = 0;
    pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      wait_status_ = status;
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  Kill();
  return -1;
}

void DedupdProcess::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
}

std::string DedupdProcess::Log() const {
  std::ifstream in(log_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool DedupdProcess::WaitForLog(const std::string& what, double limit_s) const {
  const auto t0 = std::chrono::steady_clock::now();
  while (Log().find(what) == std::string::npos) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >= limit_s) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

}  // namespace dede::test
