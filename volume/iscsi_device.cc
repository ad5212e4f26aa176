// iSCSI backend: one libiscsi session per device, driven from the calling
// thread under a mutex.
//
// libiscsi's *_sync helpers are not used on purpose. In libiscsi 1.19 their
// event loop has no deadline (a black-holed portal or a stuck target blocks
// forever), and when the loop bails out early the pending command keeps a
// pointer into the finished call's stack. Instead every command is queued
// with the *_task API and serviced here by Pump(), which enforces a
// deadline, and any failure tears the whole session down before the
// completion state goes out of scope. A lost session is rebuilt once per
// command (a fresh login, not libiscsi's auto-reconnect, which retries
// forever by default).
#include <iscsi/iscsi.h>
#include <iscsi/scsi-lowlevel.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "util/io_budget.h"
#include "util/log.h"
#include "util/mutex.h"
#include "volume/block_device.h"
#include "volume/scsi_identity.h"
#include "volume/scsi_retry.h"

namespace dede {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kDefaultIscsiPort = 3260;
// SAM flat-space addressing, which is what libiscsi encodes.
constexpr int kMaxLun = 16383;
// TCP connect + login + LUN check. A closed port fails at once; this bounds
// unreachable or black-holed portals.
constexpr auto kConnectTimeout = std::chrono::seconds(10);
// Per SCSI command, like the Linux sd driver's default
// (DeviceOptions::iscsi_command_timeout_ms).
constexpr auto kDefaultCommandTimeout = std::chrono::milliseconds(30000);
// A LOGICAL UNIT RESET that fences a lost command waits for the target's
// backing store to finish it: as long as two commands, plus some room.
constexpr auto kResetExtraTime = std::chrono::seconds(10);
constexpr auto kLogoutTimeout = std::chrono::seconds(2);
// Bigger transfers gain nothing over the network and hold the session lock
// longer against other threads.
constexpr uint32_t kMaxTransferBytes = 1u << 20;
// A fresh nexus reports a few unit attentions (power on, reset, parameters
// changed); more than this means the LUN is in a loop.
constexpr int kMaxUnitAttentions = 10;
constexpr int kMaxDeferredErrors = 4;

std::string Hex(uint32_t v, int width) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%0*x", width, v);
  return buf;
}

// ---------------------------------------------------------------------------
// URL parsing.

struct IscsiUrl {
  std::string host;  // without IPv6 brackets
  int port = kDefaultIscsiPort;
  std::string portal;  // "host:port" or "[v6]:port", as libiscsi wants it
  std::string iqn;
  int lun = 0;
  std::string user;
  std::string password;
  // The URL without credentials: what name() and every message show.
  std::string display;
};

constexpr char kUrlForm[] = "iscsi://[user%password@]host[:port]/target-iqn/lun";

// The URL as it may appear in messages: the password never does.
std::string RedactUrl(const std::string& url) {
  const std::string scheme = "iscsi://";
  if (url.rfind(scheme, 0) != 0) return url;
  size_t auth_end = url.find('/', scheme.size());
  size_t at = url.rfind('@', auth_end == std::string::npos ? url.size() : auth_end);
  if (at == std::string::npos || at < scheme.size()) return url;
  size_t pct = url.find('%', scheme.size());
  if (pct == std::string::npos || pct > at) return url;
  return url.substr(0, pct) + "%***" + url.substr(at);
}

bool ParseDecimal(const std::string& s, long max, long* out) {
  if (s.empty() || s.size() > 9) return false;
  long v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  if (v > max) return false;
  *out = v;
  return true;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Target names may be percent-encoded ("iqn.x%3Ay"), as libiscsi's own URL
// parser accepts.
bool PercentDecode(const std::string& in, std::string* out) {
  out->clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out->push_back(in[i]);
      continue;
    }
    int hi = i + 1 < in.size() ? HexDigit(in[i + 1]) : -1;
    int lo = i + 2 < in.size() ? HexDigit(in[i + 2]) : -1;
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  return true;
}

bool HasIscsiNamePrefix(const std::string& name) {
  std::string lower = name.substr(0, 4);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return lower == "iqn." || lower == "eui." || lower == "naa.";
}

Result<IscsiUrl> ParseIscsiUrl(const std::string& url) {
  auto bad = [&url](const std::string& why) {
    return Status::Invalid("invalid iSCSI URL '" + RedactUrl(url) + "': " + why + " (expected " +
                           kUrlForm + ")");
  };
  const std::string scheme = "iscsi://";
  if (url.rfind(scheme, 0) != 0) return bad("not an iscsi:// URL");
  std::string rest = url.substr(scheme.size());
  size_t slash = rest.find('/');
  std::string authority = rest.substr(0, slash);
  std::string path = slash == std::string::npos ? "" : rest.substr(slash + 1);

  IscsiUrl u;
  // Passwords may contain '@', host names never do: split at the last one.
  size_t at = authority.rfind('@');
  if (at != std::string::npos) {
    std::string cred = authority.substr(0, at);
    authority = authority.substr(at + 1);
    size_t pct = cred.find('%');
    if (pct == std::string::npos) {
      return bad("CHAP user '" + cred + "' is given without a password (use user%password@)");
    }
    u.user = cred.substr(0, pct);
    u.password = cred.substr(pct + 1);
    if (u.user.empty()) return bad("empty CHAP user name");
    if (u.password.empty()) return bad("empty CHAP password for user '" + u.user + "'");
  }

  std::string port_text;
  if (!authority.empty() && authority[0] == '[') {
    size_t close = authority.find(']');
    if (close == std::string::npos) return bad("unterminated '[' in IPv6 address");
    u.host = authority.substr(1, close - 1);
    std::string after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':') return bad("unexpected '" + after + "' after IPv6 address");
      port_text = after.substr(1);
      if (port_text.empty()) return bad("empty port after ':'");
    }
  } else {
    size_t colon = authority.find(':');
    u.host = authority.substr(0, colon);
    if (colon != std::string::npos) {
      port_text = authority.substr(colon + 1);
      if (port_text.empty()) return bad("empty port after ':'");
    }
  }
  if (u.host.empty()) return bad("missing host");
  if (!port_text.empty()) {
    long port = 0;
    if (!ParseDecimal(port_text, 65535, &port) || port == 0) {
      return bad("port '" + port_text + "' is not a number in 1-65535");
    }
    u.port = static_cast<int>(port);
  }

  if (slash == std::string::npos || path.empty()) return bad("missing target IQN and LUN");
  // IQNs never contain '/', so the first one ends the target name.
  size_t lun_slash = path.find('/');
  if (lun_slash == std::string::npos) {
    long ignored = 0;
    if (ParseDecimal(path, kMaxLun, &ignored)) return bad("missing target IQN before the LUN");
    return bad("missing LUN after the target IQN");
  }
  std::string raw_iqn = path.substr(0, lun_slash);
  std::string lun_text = path.substr(lun_slash + 1);
  if (raw_iqn.empty()) return bad("missing target IQN");
  if (!PercentDecode(raw_iqn, &u.iqn)) return bad("bad %-escape in target IQN '" + raw_iqn + "'");
  if (!HasIscsiNamePrefix(u.iqn)) {
    return bad("target name '" + u.iqn + "' is not an iSCSI name (iqn., eui. or naa.)");
  }
  if (lun_text.empty()) return bad("missing LUN after the target IQN");
  long lun = 0;
  if (!ParseDecimal(lun_text, kMaxLun, &lun)) {
    bool digits = !lun_text.empty() && std::all_of(lun_text.begin(), lun_text.end(),
                                                   [](char c) { return c >= '0' && c <= '9'; });
    if (digits)
      return bad("LUN " + lun_text + " is out of range (0-" + std::to_string(kMaxLun) + ")");
    return bad("LUN '" + lun_text + "' is not a number");
  }
  u.lun = static_cast<int>(lun);

  bool v6 = u.host.find(':') != std::string::npos;
  std::string host_part = v6 ? "[" + u.host + "]" : u.host;
  u.portal = host_part + ":" + std::to_string(u.port);
  u.display = "iscsi://" + u.portal + "/" + u.iqn + "/" + std::to_string(u.lun);
  return u;
}

// The initiator name dede's sessions log in with. Targets admit initiators
// by name (ACLs), so it must be one the target knows: the configured one;
// else this host's open-iscsi name (/etc/iscsi/initiatorname.iscsi, the
// name the deployment guide puts in the ACL); else one made up from the
// host name. Sessions stay distinct by ISID (one per session, random per
// device), so every device and process of a host may share the name.
Result<std::string> InitiatorName(const std::string& configured) {
  auto valid = [](const std::string& n) {
    if (n.size() < 5 || n.size() > 223) return false;
    if (n.rfind("iqn.", 0) != 0 && n.rfind("eui.", 0) != 0 && n.rfind("naa.", 0) != 0) {
      return false;
    }
    for (unsigned char c : n) {
      if (!(std::isalnum(c) || c == '-' || c == '.' || c == ':')) return false;
    }
    return true;
  };
  if (!configured.empty()) {
    if (!valid(configured)) {
      return Status::Invalid("iSCSI initiator name '" + configured +
                             "' is not an iqn., eui. or naa. name");
    }
    return configured;
  }
  std::ifstream conf(kOpenIscsiInitiatorFile);
  for (std::string line; std::getline(conf, line);) {
    const std::string key = "InitiatorName=";
    if (line.rfind(key, 0) != 0) continue;
    std::string name = line.substr(key.size());
    while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
    if (valid(name)) return name;
  }
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  std::string clean;
  for (const char* p = host; *p != '\0'; ++p) {
    unsigned char c = static_cast<unsigned char>(*p);
    clean.push_back(std::isalnum(c) || c == '-' || c == '.' ? static_cast<char>(std::tolower(c))
                                                            : '-');
  }
  if (clean.empty()) clean = "host";
  return "iqn.2026-11.org.dede:" + clean;
}

// ---------------------------------------------------------------------------
// Helpers around libiscsi.

// libiscsi writes task payloads with writev(), which raises SIGPIPE when the
// target has closed the connection. A library must not change the process'
// signal dispositions, so the signal is blocked on this thread for the
// duration of a call and a SIGPIPE we caused is consumed before unblocking.
class ScopedSigpipeBlock {
 public:
  ScopedSigpipeBlock() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigemptyset(&pending);
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~ScopedSigpipeBlock() {
    if (!was_pending_) {
      sigset_t pending;
      sigemptyset(&pending);
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        timespec zero{};
        sigtimedwait(&pipe_, nullptr, &zero);
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  ScopedSigpipeBlock(const ScopedSigpipeBlock&) = delete;
  ScopedSigpipeBlock& operator=(const ScopedSigpipeBlock&) = delete;

 private:
  sigset_t pipe_;
  sigset_t old_;
  bool was_pending_ = false;
};

struct TaskDeleter {
  void operator()(scsi_task* t) const { scsi_free_scsi_task(t); }
};
using TaskPtr = std::unique_ptr<scsi_task, TaskDeleter>;

// Completion state of one queued command or login step. Lives on the stack
// of the call that waits for it; the session is destroyed before that call
// returns whenever the command might still be pending.
struct Pending {
  bool done = false;
  int status = SCSI_STATUS_GOOD;
  std::string error;  // libiscsi's text at completion time (it gets overwritten later)
  uint32_t tmf_response = 0xff;  // task management: the target's response code
};

void OnComplete(iscsi_context* ctx, int status, void* /*command_data*/, void* private_data) {
  auto* p = static_cast<Pending*>(private_data);
  p->done = true;
  p->status = status;
  if (status != SCSI_STATUS_GOOD) p->error = iscsi_get_error(ctx);
}

void OnTmfComplete(iscsi_context* ctx, int status, void* command_data, void* private_data) {
  auto* p = static_cast<Pending*>(private_data);
  if (status == SCSI_STATUS_GOOD && command_data != nullptr) {
    p->tmf_response = *static_cast<uint32_t*>(command_data);
  }
  OnComplete(ctx, status, command_data, private_data);
}

// "30 s", "1.5 s".
std::string SecondsText(std::chrono::milliseconds d) {
  char buf[32];
  const long long ms = d.count();
  if (ms % 1000 == 0) {
    std::snprintf(buf, sizeof(buf), "%lld s", ms / 1000);
  } else {
    std::snprintf(buf, sizeof(buf), "%.3g s", static_cast<double>(ms) / 1000);
  }
  return buf;
}

std::string DescribeTmfResponse(uint32_t r) {
  switch (r) {
    case ISCSI_TMR_FUNC_COMPLETE:
      return "function complete";
    case ISCSI_TMR_LUN_DOES_NOT_EXIST:
      return "LUN does not exist";
    case ISCSI_TMR_TMF_NOT_SUPPORTED:
      return "not supported";
    case ISCSI_TMR_FUNC_AUTH_FAILED:
      return "authorization failed";
    case ISCSI_TMR_FUNC_REJECTED:
      return "rejected";
    default:
      return "response " + std::to_string(r);
  }
}

using TaskFactory = std::function<scsi_task*(iscsi_context*, iscsi_command_cb, void*)>;

// Statuses that say "not now, send it again": the target did not run the
// command (BUSY, TASK SET FULL), or ended it unfinished on someone's task
// management (TASK ABORTED: another initiator's LU reset, e.g. a host
// fencing its own lost command).
bool IsTransientStatus(int status) {
  return status == SCSI_STATUS_BUSY || status == SCSI_STATUS_TASK_SET_FULL ||
         status == SCSI_STATUS_TASK_ABORTED;
}

// The same, with a CHECK CONDITION's sense data (scsi_retry.h): NOT READY
// on the way to ready, ABORTED COMMAND. A WRITE that failed so went to
// IoError, which poisons the volume: every disk of the host failed until
// a restart, for a condition the target clears by itself.
bool IsTransient(const scsi_task& t) {
  if (IsTransientStatus(t.status)) return true;
  return t.status == SCSI_STATUS_CHECK_CONDITION &&
         IsTransientCheckCondition(static_cast<uint8_t>(t.sense.key),
                                   static_cast<uint16_t>(t.sense.ascq));
}

// Shared by the sessions of one device (IscsiSessionPool): a command that
// changes the LUN and went unanswered with its session may still run in
// the target, and land after anything any session sends later. `lost`
// counts such commands; `ready` those whose session has since logged in
// again with its ISID (the target then ended the old session: nothing of
// it that was not yet a command can become one) or given up trying;
// `fenced` those a LOGICAL UNIT RESET the target confirmed has covered.
// While fenced < lost, no session sends anything but the reset, and the
// reset waits for ready to reach lost; `mu` lets one session send it while
// the others wait for it.
struct LostCommandFence {
  Mutex mu;                    // after a session's own mu_
  std::condition_variable cv;  // ready went up (with mu)
  std::atomic<uint64_t> lost{0};
  std::atomic<uint64_t> ready{0};
  std::atomic<uint64_t> fenced{0};
  std::atomic<uint64_t> resets{0};      // LOGICAL UNIT RESETs confirmed
  std::atomic<uint64_t> idle_drops{0};  // connections found closed between commands
  bool Pending() const { return fenced.load() < lost.load(); }
  // One for the device: a SYNCHRONIZE CACHE covers the LU, whichever
  // session sends it.
  StickyFlushFailure flush_failure;

  // The logical unit as the first session found it at its login
  // (scsi_identity.h); every later login of every session, and every unit
  // attention, is checked against it.
  std::optional<LuIdentity> identity GUARDED_BY(mu);
  // Once a check finds another unit, every command of every session fails
  // with this (`changed` is read on each command without `mu`).
  std::atomic<bool> changed{false};
  Status identity_lost GUARDED_BY(mu);
  Status IdentityLost() EXCLUDES(mu) {
    MutexLock l(&mu);
    return identity_lost;
  }
  void NoteIdentityLost(const Status& st) EXCLUDES(mu) {
    MutexLock l(&mu);
    if (identity_lost.ok()) identity_lost = st;
    changed.store(true);
  }
};

// True when the status came back from the target; the others are libiscsi's
// own verdicts on the transport (cancelled, timed out, protocol error).
bool IsScsiStatus(int status) {
  switch (status) {
    case SCSI_STATUS_GOOD:
    case SCSI_STATUS_CHECK_CONDITION:
    case SCSI_STATUS_CONDITION_MET:
    case SCSI_STATUS_BUSY:
    case SCSI_STATUS_RESERVATION_CONFLICT:
    case SCSI_STATUS_TASK_SET_FULL:
    case SCSI_STATUS_ACA_ACTIVE:
    case SCSI_STATUS_TASK_ABORTED:
      return true;
    default:
      return false;
  }
}

std::string DescribeScsiStatus(const scsi_task& task) {
  switch (task.status) {
    case SCSI_STATUS_CHECK_CONDITION: {
      const char* key = scsi_sense_key_str(task.sense.key);
      const char* ascq = scsi_sense_ascq_str(task.sense.ascq);
      return std::string("CHECK CONDITION, sense ") + (key ? key : "?") + " " +
             Hex(static_cast<uint32_t>(task.sense.ascq), 4) + " (" + (ascq ? ascq : "?") + ")";
    }
    case SCSI_STATUS_BUSY:
      return "target busy";
    case SCSI_STATUS_RESERVATION_CONFLICT:
      return "reservation conflict (another initiator holds a SCSI reservation on the LUN)";
    case SCSI_STATUS_TASK_SET_FULL:
      return "task set full";
    case SCSI_STATUS_ACA_ACTIVE:
      return "ACA active";
    case SCSI_STATUS_CONDITION_MET:
      return "condition met";
    default:
      return "SCSI status " + Hex(static_cast<uint32_t>(task.status), 2);
  }
}

bool SenseIs(const scsi_task& task, scsi_sense_key key, int ascq = -1) {
  return task.status == SCSI_STATUS_CHECK_CONDITION && task.sense.key == key &&
         (ascq < 0 || task.sense.ascq == ascq);
}

// The sense data of a command that ended in CHECK CONDITION, for callers
// that tolerate some conditions (an unsupported optional command).
struct CheckCondition {
  bool set = false;
  scsi_sense sense{};

  bool Is(scsi_sense_key key, int ascq = -1) const {
    return set && sense.key == key && (ascq < 0 || sense.ascq == ascq);
  }
};

// libiscsi's messages carry internal prefixes ("iscsi_service: socket error
// Connection refused(111) while connecting."); keep the part people can act on.
std::string CleanTransportError(std::string e) {
  // Said when the socket fails before login completes (peer closed it or
  // sent something that is not iSCSI); the detail went to libiscsi's log.
  if (e.find("Can not reconnect right now") != std::string::npos) {
    return "the connection failed during login (closed by the peer, or not an iSCSI portal)";
  }
  if (e.find("Can not resolv") != std::string::npos) return "cannot resolve the host name";
  const std::string marker = "socket error ";
  size_t pos = e.find(marker);
  if (pos != std::string::npos) {
    std::string tail = e.substr(pos + marker.size());
    size_t paren = tail.find('(');
    if (paren != std::string::npos && paren > 0) tail = tail.substr(0, paren);
    if (!tail.empty()) {
      tail[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(tail[0])));
      return tail;
    }
  }
  while (!e.empty() && (e.back() == '\n' || e.back() == '.' || e.back() == ' ')) e.pop_back();
  for (char& c : e) {
    if (c == '\n') c = ' ';
  }
  return e.empty() ? "unknown error" : e;
}

// Why libiscsi completed a command without a SCSI status.
std::string TransportFailure(const Pending& p) {
  switch (p.status) {
    // Cancelled means libiscsi dropped the session (the target closed the
    // connection); its error text at that point is left over from earlier.
    case SCSI_STATUS_CANCELLED:
      return "connection to the target lost";
    case SCSI_STATUS_TIMEOUT:
      return "command timed out";
    default:
      return CleanTransportError(p.error);
  }
}

// The iSCSI login status (RFC 7143 10.13.5) libiscsi puts into its error text
// as "...Status: Target not found(515)". -1 if there is none.
int LoginStatusFromError(const std::string& e) {
  size_t pos = e.find("Status: ");
  if (pos == std::string::npos) return -1;
  size_t open = e.rfind('(');
  size_t close = e.rfind(')');
  if (open == std::string::npos || close == std::string::npos || close <= open + 1 || open < pos) {
    return -1;
  }
  long v = 0;
  if (!ParseDecimal(e.substr(open + 1, close - open - 1), 0xffff, &v)) return -1;
  return static_cast<int>(v);
}

// ---------------------------------------------------------------------------

class IscsiDevice final : public BlockDevice {
 public:
  // `isid`: 24 random bits of the device; `qualifier`: the session's index.
  IscsiDevice(IscsiUrl url, bool read_only, std::chrono::milliseconds command_timeout,
              uint32_t isid, uint16_t qualifier, std::shared_ptr<LostCommandFence> fence,
              std::string initiator)
      : url_(std::move(url)),
        read_only_(read_only),
        initiator_(std::move(initiator)),
        isid_(isid & 0xffffffu),
        isid_qualifier_(qualifier),
        command_timeout_(command_timeout),
        fence_(std::move(fence)) {}

  ~IscsiDevice() override {
    ScopedSigpipeBlock no_sigpipe;
    MutexLock lock(&mu_);
    Logout();
  }

  IscsiDevice(const IscsiDevice&) = delete;
  IscsiDevice& operator=(const IscsiDevice&) = delete;

  // Logs in, checks the LUN is a disk (and, unless opened read-only, not
  // write-protected), learns its geometry and its identity: the device's
  // first session keeps it for all (LostCommandFence::identity), a later
  // session must find the same unit.
  Status Open() {
    ScopedSigpipeBlock no_sigpipe;
    MutexLock lock(&mu_);
    RETURN_IF_ERROR(Connect());
    RETURN_IF_ERROR(CheckIsDisk());
    ASSIGN_OR_RETURN(const Geometry geometry, ReadGeometry());
    UseGeometry(geometry);
    ReadBlockLimits();
    if (!read_only_) RETURN_IF_ERROR(CheckWritable());
    ASSIGN_OR_RETURN(LuIdentity found, ReadIdentity(geometry));
    {
      MutexLock l(&fence_->mu);
      if (!fence_->identity.has_value()) {
        fence_->identity = found;
      } else if (std::string change = DescribeIdentityChange(*fence_->identity, found);
                 !change.empty()) {
        return Status::IoError(
            name() + ": the device's sessions reached different logical units (" + change + ")");
      }
    }
    identity_known_ = true;
    return Status::Ok();
  }

  uint64_t size_bytes() const override { return size_; }
  std::string name() const override { return url_.display; }
  // Other processes reach the LUN over the network, not through a local
  // file: the lock backend keys its lock file by volume UUID instead.
  std::string local_lock_path() const override { return ""; }

  Status Read(uint64_t offset, void* buf, size_t len) override {
    RETURN_IF_ERROR(CheckIo(offset, len));
    ChargeIo(len);
    ScopedSigpipeBlock no_sigpipe;
    MutexLock lock(&mu_);
    auto* p = static_cast<uint8_t*>(buf);
    for (size_t done = 0; done < len;) {
      uint32_t n = static_cast<uint32_t>(std::min<size_t>(len - done, max_transfer_));
      uint64_t at = offset + done;
      scsi_iovec iov{p + done, n};
      const std::string what = "READ(16) at offset " + std::to_string(at);
      auto task = Execute(what, [&](iscsi_context* ctx, iscsi_command_cb cb, void* priv) {
        return iscsi_read16_iov_task(ctx, url_.lun, at / block_size_, n,
                                     static_cast<int>(block_size_), 0, 0, 0, 0, 0, cb, priv, &iov,
                                     1);
      });
      if (!task.ok()) return task.status();
      const scsi_task& t = *task.value();
      if (t.residual_status == SCSI_RESIDUAL_UNDERFLOW && t.residual > 0) {
        return Status::IoError(name() + ": short " + what + ": " + std::to_string(t.residual) +
                               " of " + std::to_string(n) + " bytes missing");
      }
      done += n;
    }
    return Status::Ok();
  }

  Status Write(uint64_t offset, const void* buf, size_t len) override {
    RETURN_IF_ERROR(CheckIo(offset, len));
    if (read_only_) {
      return Status::Invalid(name() + ": opened read-only; refusing write at offset " +
                             std::to_string(offset));
    }
    ChargeIo(len);
    ScopedSigpipeBlock no_sigpipe;
    MutexLock lock(&mu_);
    // libiscsi only reads from an out-iovec; its type is just not const.
    auto* p = static_cast<uint8_t*>(const_cast<void*>(buf));
    for (size_t done = 0; done < len;) {
      uint32_t n = static_cast<uint32_t>(std::min<size_t>(len - done, max_transfer_));
      uint64_t at = offset + done;
      scsi_iovec iov{p + done, n};
      const std::string what = "WRITE(16) at offset " + std::to_string(at);
      auto task = Execute(
          what,
          [&](iscsi_context* ctx, iscsi_command_cb cb, void* priv) {
            return iscsi_write16_iov_task(ctx, url_.lun, at / block_size_, nullptr, n,
                                          static_cast<int>(block_size_), 0, 0, 0, 0, 0, cb, priv,
                                          &iov, 1);
          },
          nullptr, Effect::kModifies);
      if (!task.ok()) return task.status();
      // A target that took less than it was sent did not write it all.
      const scsi_task& t = *task.value();
      if (t.residual_status == SCSI_RESIDUAL_UNDERFLOW && t.residual > 0) {
        return Status::IoError(name() + ": short " + what + ": " + std::to_string(t.residual) +
                               " of " + std::to_string(n) + " bytes not written");
      }
      done += n;
    }
    return Status::Ok();
  }

  DeviceCounters counters() const override {
    DeviceCounters c;
    c.lost_commands = fence_->lost.load();
    c.unfenced_commands = c.lost_commands - std::min(c.lost_commands, fence_->fenced.load());
    c.lu_resets = fence_->resets.load();
    c.idle_reconnects = fence_->idle_drops.load();
    return c;
  }

  Status Flush() override {
    // Nothing of ours can be in the target's cache.
    if (read_only_) return Status::Ok();
    return fence_->flush_failure.Run([this] { return SynchronizeCache(); });
  }

  Status SynchronizeCache() {
    ScopedSigpipeBlock no_sigpipe;
    MutexLock lock(&mu_);
    // LBA 0 with 0 blocks means the whole LU.
    CheckCondition sense;
    auto task = Execute(
        "SYNCHRONIZE CACHE(10)",
        [&](iscsi_context* ctx, iscsi_command_cb cb, void* priv) {
          return iscsi_synchronizecache10_task(ctx, url_.lun, 0, 0, 0, 0, cb, priv);
        },
        &sense, Effect::kFlush);
    if (task.ok()) return Status::Ok();
    if (!sense.Is(SCSI_SENSE_ILLEGAL_REQUEST, SCSI_SENSE_ASCQ_INVALID_OPERATION_CODE)) {
      return task.status();
    }
    auto task16 = Execute(
        "SYNCHRONIZE CACHE(16)",
        [&](iscsi_context* ctx, iscsi_command_cb cb, void* priv) {
          return iscsi_synchronizecache16_task(ctx, url_.lun, 0, 0, 0, 0, cb, priv);
        },
        nullptr, Effect::kFlush);
    return task16.status();
  }

  Status Discard(uint64_t offset, uint64_t len) override {
    RETURN_IF_ERROR(CheckIo(offset, static_cast<size_t>(len)));
    if (read_only_) {
      return Status::Invalid(name() + ": opened read-only; refusing discard at offset " +
                             std::to_string(offset));
    }
    ScopedSigpipeBlock no_sigpipe;
    MutexLock lock(&mu_);
    uint64_t lba = offset / block_size_;
    uint64_t blocks = len / block_size_;
    while (blocks > 0 && unmap_supported_) {
      uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(blocks, max_unmap_blocks_));
      unmap_list range{lba, n};
      CheckCondition sense;
      auto task = Execute(
          "UNMAP at offset " + std::to_string(lba * block_size_),
          [&](iscsi_context* ctx, iscsi_command_cb cb, void* priv) {
            return iscsi_unmap_task(ctx, url_.lun, 0, 0, &range, 1, cb, priv);
          },
          &sense, Effect::kModifies);
      if (!task.ok()) {
        // Discard is only a hint: a target that turns out not to unmap keeps
        // the bytes, which is allowed.
        if (sense.Is(SCSI_SENSE_ILLEGAL_REQUEST)) {
          unmap_supported_ = false;
          return Status::Ok();
        }
        return task.status();
      }
      lba += n;
      blocks -= n;
    }
    return Status::Ok();
  }

 private:
  Status CheckIo(uint64_t offset, size_t len) const {
    RETURN_IF_ERROR(CheckRange(offset, len));
    if (offset % block_size_ != 0 || len % block_size_ != 0) {
      return Status::Invalid(name() + ": I/O at offset " + std::to_string(offset) + " length " +
                             std::to_string(len) + " is not aligned to the LUN's " +
                             std::to_string(block_size_) + "-byte logical blocks");
    }
    return Status::Ok();
  }

  std::string TargetOnPortal() const { return "iSCSI target " + url_.iqn + " on " + url_.portal; }

  // Services the session until `p` completes or the deadline passes. A
  // non-OK result means the session is unusable; the caller must
  // Disconnect() before `p` goes out of scope.
  Status Pump(Pending* p, Clock::time_point deadline, std::chrono::milliseconds limit)
      REQUIRES(mu_) {
    while (!p->done) {
      auto now = Clock::now();
      if (now >= deadline) {
        return Status::IoError("no answer within " + SecondsText(limit));
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
      pollfd pfd{};
      pfd.fd = iscsi_get_fd(ctx_);
      pfd.events = static_cast<short>(iscsi_which_events(ctx_));
      if (pfd.fd < 0) return Status::IoError("connection closed");
      // Wake at least once a second so libiscsi can run its timers.
      int n = ::poll(&pfd, 1, static_cast<int>(std::min<long long>(left + 1, 1000)));
      if (n < 0) {
        if (errno == EINTR) continue;
        return Status::FromErrno("poll", errno);
      }
      if (iscsi_service(ctx_, n > 0 ? pfd.revents : 0) < 0) {
        // The completion may have fired with the real reason before libiscsi
        // gave up on the socket; that reason is the better one.
        if (p->done) break;
        return Status::IoError(CleanTransportError(iscsi_get_error(ctx_)));
      }
    }
    return Status::Ok();
  }

  // Between commands nothing services the session, so a connection the
  // target closed while it sat idle (its idle or NOP timeout, a restart)
  // is only found when the next command is queued on it; such a command is
  // never sent, but would be counted as lost and cost every host an LU
  // reset. Before a command that modifies the medium, look: a closed or
  // failed socket is dropped here (the caller logs in afresh, nothing
  // lost), and what the target sent meanwhile (a NOP-In) is answered.
  void DropIfClosed() REQUIRES(mu_) {
    if (ctx_ == nullptr) return;
    pollfd pfd{};
    pfd.fd = iscsi_get_fd(ctx_);
    pfd.events = POLLIN | POLLRDHUP;
    if (pfd.fd < 0) {
      Disconnect();
      return;
    }
    int n;
    do {
      n = ::poll(&pfd, 1, 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) return;  // quiet: looks alive
    if ((pfd.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) != 0 ||
        iscsi_service(ctx_, pfd.revents) < 0) {
      fence_->idle_drops.fetch_add(1);
      LOG(kInfo) << name() << ": the target closed the idle connection; logging in again";
      Disconnect();
    }
  }

  enum class Close { kAbort, kAfterLogout };
  void Disconnect(Close how = Close::kAbort) REQUIRES(mu_) {
    if (ctx_ == nullptr) return;
    // A reset, not a FIN: what the kernel has not sent yet of a command
    // whose session we give up on (the rest of a WRITE's data) must never
    // reach the target later, after the command was sent again and the
    // blocks written anew. (Connect already set it on every socket; set
    // again here so this close does not depend on that. After a logout
    // there is nothing left to send.)
    const int fd = iscsi_get_fd(ctx_);
    if (fd >= 0 && how == Close::kAbort) {
      linger abort_close{1, 0};
      (void)::setsockopt(fd, SOL_SOCKET, SO_LINGER, &abort_close, sizeof(abort_close));
    }
    // Cancels whatever is still queued; completions fire into live state.
    iscsi_destroy_context(ctx_);
    ctx_ = nullptr;
  }

  void Logout() REQUIRES(mu_) {
    if (ctx_ == nullptr) return;
    if (iscsi_is_logged_in(ctx_)) {
      Pending p;
      if (iscsi_logout_async(ctx_, OnComplete, &p) == 0) {
        if (Pump(&p, Clock::now() + kLogoutTimeout, kLogoutTimeout).ok()) {
          Disconnect(Close::kAfterLogout);
          return;
        }
      }
    }
    Disconnect();
  }

  // Queues one command and waits for it. On a transport failure the session
  // is already torn down when this returns; otherwise the task holds the
  // target's SCSI status.
  // `queued` (when given) tells whether the command was handed to the
  // session at all.
  Result<TaskPtr> Submit(const TaskFactory& make, Clock::time_point deadline,
                         std::chrono::milliseconds limit, bool* queued = nullptr) REQUIRES(mu_) {
    Pending p;
    TaskPtr task(make(ctx_, OnComplete, &p));
    if (queued != nullptr) *queued = task != nullptr;
    Status st;
    if (!task) {
      st = Status::IoError("cannot queue command: " + CleanTransportError(iscsi_get_error(ctx_)));
    } else {
      st = Pump(&p, deadline, limit);
      if (st.ok() && !IsScsiStatus(p.status)) st = Status::IoError(TransportFailure(p));
    }
    if (!st.ok()) {
      // Destroying the context cancels the command while `p` and `task` are
      // still alive; only then may they go.
      Disconnect();
      return st;
    }
    return task;
  }

  // Runs a command with the retries a SCSI initiator owes its caller: unit
  // attentions and busy targets are retried, a lost session is rebuilt once.
  // On CHECK CONDITION the sense data lands in `sense_out` (when given) so
  // callers can pick the conditions they tolerate.
  //
  // A command that `kModifies` the medium and whose session is lost before
  // it answers (a timeout, a dropped connection) may still be running in
  // the target, and may land after anything we send later, the same
  // command again included: a stale write over newer data. So it is sent
  // again, and any later command of this device is sent, only once the
  // target has confirmed that every command it had received for the LU
  // has finished (FenceLostCommands).
  // kFlush: SYNCHRONIZE CACHE. It changes no data, so a lost one needs no
  // fence, but once it reached the target it is not sent again: the
  // target's backing store reports a write-back error to one flush, and a
  // second flush after a first lost with its session "succeeds" with those
  // writes never made durable.
  enum class Effect { kReadOnly, kModifies, kFlush };
  Result<TaskPtr> Execute(const std::string& what, const TaskFactory& make,
                          CheckCondition* sense_out = nullptr, Effect effect = Effect::kReadOnly)
      REQUIRES(mu_) {
    std::string lost;  // why the first session died, if it did
    bool looked_idle = false;
    int unit_attentions = 0;
    int deferred_errors = 0;
    int busy = 0;                       // transient answers so far
    Clock::time_point transient_since;  // the first of them
    for (;;) {
      if (fence_->changed.load()) return fence_->IdentityLost();
      if (ctx_ == nullptr) {
        Status st = Connect();
        MarkLossesReady();
        if (!st.ok()) {
          std::string prefix = name() + ": " + what + " failed";
          if (!lost.empty()) prefix += " (" + lost + "; reconnecting failed)";
          return st.WithContext(prefix);
        }
      }
      // Again while losses come in meanwhile (each waits for its session).
      while (fence_->Pending()) {
        Status st = FenceLostCommands();
        if (!st.ok()) return st.WithContext(name() + ": " + what + " not sent");
      }
      // A flush too: one queued on a connection the target had closed
      // while idle would be taken for a flush lost with its session.
      if ((effect == Effect::kModifies || effect == Effect::kFlush) && !looked_idle) {
        looked_idle = true;  // once: a fresh login is not looked at again
        DropIfClosed();
        if (ctx_ == nullptr) continue;  // log in again first
      }
      // After a login (but the first) or a unit attention: is it still
      // the same logical unit? (Not for the check's own commands.)
      if (identity_unchecked_ && !checking_identity_) {
        Status st = RecheckIdentity();
        if (!st.ok()) return st.WithContext(name() + ": " + what + " not sent");
        continue;
      }
      bool queued = false;
      // A flush gets twice the time (as Linux's sd gives it): writing back
      // a large cache takes longer than any one command, and a flush that
      // times out fails for good (kFlush).
      const std::chrono::milliseconds timeout =
          effect == Effect::kFlush ? 2 * command_timeout_ : command_timeout_;
      auto task = Submit(make, Clock::now() + timeout, timeout, &queued);
      if (!task.ok()) {
        // Only a command that reached the socket can still be in the
        // target (Disconnect, inside Submit, has already reset it).
        if (effect == Effect::kModifies && queued) {
          fence_->lost.fetch_add(1);
          unready_losses_++;
        }
        if (effect == Effect::kFlush && queued) {
          return Status::IoError(name() + ": " + what + " failed: " + task.status().message() +
                                 " (a flush that reached the target and got no answer is not "
                                 "sent again: a second one may report success for writes the "
                                 "first failed to make durable)");
        }
        if (!lost.empty()) {
          if (unready_losses_ > 0) {
            // Log in once more all the same, so the target ends the
            // session that lost it before anyone fences.
            (void)Connect();
            MarkLossesReady();
          }
          return Status::IoError(name() + ": " + what + " failed: " + task.status().message() +
                                 " (again after reconnecting; first: " + lost + ")");
        }
        lost = task.status().message();
        continue;
      }
      const scsi_task& t = *task.value();
      if (t.status == SCSI_STATUS_GOOD || t.status == SCSI_STATUS_CONDITION_MET) return task;
      const RecoveredError recovered =
          t.status == SCSI_STATUS_CHECK_CONDITION
              ? ClassifyRecoveredError(static_cast<uint8_t>(t.sense.key),
                                       static_cast<uint8_t>(t.sense.error_type))
              : RecoveredError::kNo;
      if (recovered == RecoveredError::kCompleted) {
        if (!recovered_logged_) {
          recovered_logged_ = true;
          LOG(kInfo) << name() << ": " << what
                     << " completed with a recovered error (the target corrected it): "
                     << DescribeScsiStatus(t) << " (reported once per session)";
        }
        return task;
      }
      if (recovered == RecoveredError::kEarlierRecovered &&
          ++deferred_errors <= kMaxDeferredErrors) {
        continue;
      }
      if (t.status == SCSI_STATUS_CHECK_CONDITION && recovered == RecoveredError::kNo &&
          IsDeferredError(static_cast<uint8_t>(t.sense.error_type))) {
        // An earlier command answered GOOD has failed (a write the
        // target's cache could not write): no later flush may say the
        // writes are durable. This command was not processed: send it
        // again (a few times: each deferred error is reported once).
        const Status deferred = Status::IoError(
            name() +
            ": the target reported a deferred error (a command it had answered as done "
            "failed afterwards): " +
            DescribeScsiStatus(t));
        LOG(kError) << deferred.ToString();
        (void)fence_->flush_failure.Note(deferred);
        if (++deferred_errors <= kMaxDeferredErrors) continue;
        return deferred;
      }
      if (SenseIs(t, SCSI_SENSE_UNIT_ATTENTION) && ++unit_attentions <= kMaxUnitAttentions) {
        // Most say "reset" or "power on", but some say the unit changed
        // (capacity, inquiry data, LUN inventory): look before going on.
        if (identity_known_ && !checking_identity_) identity_unchecked_ = true;
        continue;
      }
      // TASK ABORTED: another initiator's task management (such as the LU
      // reset of a host fencing its own lost command) ended this one
      // before it finished; sending it again is what the initiator is for.
      if (IsTransient(t)) {
        if (busy == 0) transient_since = Clock::now();
        if (Clock::now() - transient_since < kTransientRetryBudget) {
          std::this_thread::sleep_for(TransientRetryDelay(++busy));
          continue;
        }
      }
      if (sense_out != nullptr && t.status == SCSI_STATUS_CHECK_CONDITION) {
        sense_out->set = true;
        sense_out->sense = t.sense;
      }
      return Status::IoError(name() + ": " + what + " failed: " + DescribeScsiStatus(t));
    }
  }

  // Makes sure no lost command (LostCommandFence) can still land: a
  // LOGICAL UNIT RESET, sent by one session of the device while the others
  // wait. A target answers it only once every command it had started for
  // the LU, from any session, has finished (SAM: those are aborted or
  // completed before FUNCTION COMPLETE; tgtd waits for the ones its
  // backing store is running), and it drops the ones not started.
  // Together with the TCP reset that closed the lost command's connection
  // (Disconnect: no more of its data is sent) and the login with the same
  // ISID (the target ends that session if it still held it open), nothing
  // of the lost command can come after this. Other initiators see a unit
  // attention (29h, reset) and send their next command again, as Execute
  // does. If the target does not confirm, the command is not sent, and
  // every later command of the device tries the reset again first and
  // fails the same way: the volume above stops. Not covered: a target that
  // holds a command past the reset's wait and runs it later, or this
  // process exiting with a reset still owed (sanlock then frees its
  // leases); sanlock's leases rest on the same bound on I/O time.
  Status FenceLostCommands() REQUIRES(mu_) EXCLUDES(fence_->mu) {
    MutexLock one_at_a_time(&fence_->mu);
    bool all_ready;
    {
      // The sessions that lost commands log in again first (bounded: one
      // login each; past that the reset goes out all the same).
      std::unique_lock<std::mutex> wait(fence_->mu.native(), std::adopt_lock);
      all_ready = fence_->cv.wait_for(wait, kConnectTimeout + std::chrono::seconds(5), [this] {
        return fence_->ready.load() >= fence_->lost.load();
      });
      wait.release();  // still held, by one_at_a_time
    }
    // What the wait saw (`ready` moves only under mu, which we hold): a
    // loss counted since, whose session has not logged in again, is left
    // for the next reset.
    const uint64_t target = all_ready ? fence_->ready.load() : fence_->lost.load();
    if (!all_ready) {
      LOG(kWarning) << name() << ": a session that lost a command has not logged in again; "
                    << "resetting the LU all the same";
    }
    if (fence_->fenced.load() >= target) return Status::Ok();  // another session did it
    if (ctx_ == nullptr) RETURN_IF_ERROR(Connect());
    const auto limit = 2 * command_timeout_ + kResetExtraTime;
    Pending p;
    Status st;
    if (iscsi_task_mgmt_lun_reset_async(ctx_, static_cast<uint32_t>(url_.lun), OnTmfComplete, &p) !=
        0) {
      st = Status::IoError("cannot queue it: " + CleanTransportError(iscsi_get_error(ctx_)));
    } else {
      st = Pump(&p, Clock::now() + limit, limit);
      if (st.ok() && p.status != SCSI_STATUS_GOOD) {
        st = Status::IoError(CleanTransportError(p.error));
      } else if (st.ok() && p.tmf_response != ISCSI_TMR_FUNC_COMPLETE) {
        st = Status::IoError("the target answered " + DescribeTmfResponse(p.tmf_response));
      }
    }
    if (!st.ok()) {
      Disconnect();
      return Status::IoError(
          "a command that changes the LUN got no answer before its session was lost, and the "
          "target did not confirm it has finished (LOGICAL UNIT RESET: " +
          st.message() + "); nothing more is sent, since it could still land after newer data");
    }
    fence_->resets.fetch_add(1);
    uint64_t was = fence_->fenced.load();
    while (was < target && !fence_->fenced.compare_exchange_weak(was, target)) {
    }
    LOG(kWarning) << name() << ": fenced " << (target - was)
                  << " command(s) lost with their session (LOGICAL UNIT RESET confirmed by the "
                     "target) before sending anything more";
    return Status::Ok();
  }

  // This session's lost commands: it has logged in again (or given up).
  void MarkLossesReady() REQUIRES(mu_) EXCLUDES(fence_->mu) {
    if (unready_losses_ == 0) return;
    {
      MutexLock l(&fence_->mu);
      fence_->ready.fetch_add(unready_losses_);
    }
    unready_losses_ = 0;
    fence_->cv.notify_all();
  }

  // TCP connect, login, and a TEST UNIT READY that proves the LUN exists.
  Status Connect() REQUIRES(mu_) {
    Disconnect();
    ctx_ = iscsi_create_context(initiator_.c_str());
    if (ctx_ == nullptr) return Status::IoError("cannot create an iSCSI context (out of memory?)");
    // Failures must reach us as errors; Execute() decides about reconnecting.
    iscsi_set_noautoreconnect(ctx_, 1);
    // The same ISID at every login of this device: a target that still
    // holds our previous session open (it did not see the connection go)
    // ends it on this login (session reinstatement, RFC 7143 6.3.5) and
    // drops the commands of it that it had not started.
    iscsi_set_isid_random(ctx_, isid_, isid_qualifier_);
    if (iscsi_set_targetname(ctx_, url_.iqn.c_str()) != 0 ||
        iscsi_set_session_type(ctx_, ISCSI_SESSION_NORMAL) != 0 ||
        (!url_.user.empty() &&
         iscsi_set_initiator_username_pwd(ctx_, url_.user.c_str(), url_.password.c_str()) != 0)) {
      std::string e = CleanTransportError(iscsi_get_error(ctx_));
      Disconnect();
      return Status::Invalid("cannot set up iSCSI session to " + TargetOnPortal() + ": " + e);
    }
    const auto deadline = Clock::now() + kConnectTimeout;
    const auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(kConnectTimeout);

    {
      Pending p;
      Status st;
      if (iscsi_connect_async(ctx_, url_.portal.c_str(), OnComplete, &p) != 0) {
        st = Status::Unavailable(CleanTransportError(iscsi_get_error(ctx_)));
      } else {
        st = Pump(&p, deadline, limit);
        if (st.ok() && p.status != SCSI_STATUS_GOOD) {
          st = Status::Unavailable(CleanTransportError(p.error));
        }
      }
      if (!st.ok()) {
        Disconnect();
        return Status::Unavailable("cannot connect to iSCSI portal " + url_.portal + ": " +
                                   st.message());
      }
    }
    // Closed with a reset however the process ends, not only in
    // Disconnect: a process that is killed (fenced by sanlock, by the
    // LockspaceGuard, or crashing) has its sockets closed by the kernel,
    // which would otherwise go on sending what was queued (the rest of a
    // WRITE's data) for as long as TCP retries, after other hosts may have
    // called this host dead and taken its blocks.
    if (const int fd = iscsi_get_fd(ctx_); fd >= 0) {
      linger abort_close{1, 0};
      (void)::setsockopt(fd, SOL_SOCKET, SO_LINGER, &abort_close, sizeof(abort_close));
    }

    {
      Pending p;
      Status st;
      if (iscsi_login_async(ctx_, OnComplete, &p) != 0) {
        st = Status::IoError(CleanTransportError(iscsi_get_error(ctx_)));
      } else {
        st = Pump(&p, deadline, limit);
      }
      if (!st.ok()) {
        Disconnect();
        return Status::Unavailable("login to " + TargetOnPortal() + " failed: " + st.message());
      }
      if (p.status != SCSI_STATUS_GOOD) {
        std::string error = p.error;
        Disconnect();
        return LoginError(error);
      }
    }

    // A new nexus starts with unit attentions (power on, reset); consume
    // them here so the first real command does not trip over them.
    int busy = 0;
    const Clock::time_point first_try = Clock::now();
    for (int attempt = 0;; ++attempt) {
      auto task =
          Submit([this](iscsi_context* ctx, iscsi_command_cb cb,
                        void* priv) { return iscsi_testunitready_task(ctx, url_.lun, cb, priv); },
                 deadline, limit);
      if (!task.ok()) {
        return Status::Unavailable("iSCSI session to " + TargetOnPortal() +
                                   " failed right after login: " + task.status().message());
      }
      const scsi_task& t = *task.value();
      if (t.status == SCSI_STATUS_GOOD) {
        // A login but the first: the target may have been reconfigured
        // while we were away.
        if (identity_known_) identity_unchecked_ = true;
        return Status::Ok();
      }
      if (SenseIs(t, SCSI_SENSE_UNIT_ATTENTION) && attempt < kMaxUnitAttentions) continue;
      if (IsTransient(t) && Clock::now() - first_try < kTransientRetryBudget) {
        std::this_thread::sleep_for(TransientRetryDelay(++busy));
        continue;
      }
      std::string detail = DescribeScsiStatus(t);
      Disconnect();
      if (SenseIs(t, SCSI_SENSE_ILLEGAL_REQUEST, SCSI_SENSE_ASCQ_LOGICAL_UNIT_NOT_SUPPORTED)) {
        return Status::NotFound("LUN " + std::to_string(url_.lun) + " not found on " +
                                TargetOnPortal());
      }
      return Status::Unavailable("LUN " + std::to_string(url_.lun) + " of " + TargetOnPortal() +
                                 " is not ready: " + detail);
    }
  }

  Status LoginError(const std::string& error) const {
    const std::string who = TargetOnPortal();
    int status = LoginStatusFromError(error);
    switch (status) {
      case 0x0201:
        if (url_.user.empty()) {
          return Status::Invalid("login to " + who +
                                 " rejected: the target requires CHAP authentication (give "
                                 "iscsi://user%password@host/...)");
        }
        return Status::Invalid("login to " + who + " rejected: CHAP authentication as '" +
                               url_.user + "' failed (wrong user or password?)");
      case 0x0202:
        return Status::Invalid("login to " + who + " rejected: initiator " + initiator_ +
                               " is not authorized for this target");
      case 0x0203:
      case 0x0204:
        // tgtd says this also to an initiator its ACL does not admit.
        return Status::NotFound("iSCSI target " + url_.iqn + " not found on " + url_.portal +
                                " (or it does not admit initiator " + initiator_ + ")");
      default:
        break;
    }
    if (status >= 0x0100 && status < 0x0200) {
      return Status::Unavailable("login to " + who +
                                 " failed: the target moved (redirects are not followed)");
    }
    return Status::Unavailable("login to " + who + " failed: " + CleanTransportError(error));
  }

  Status CheckIsDisk() REQUIRES(mu_) {
    auto task = Execute("INQUIRY", [this](iscsi_context* ctx, iscsi_command_cb cb, void* priv) {
      return iscsi_inquiry_task(ctx, url_.lun, 0, 0, 255, cb, priv);
    });
    if (!task.ok()) return task.status();
    auto* inq = static_cast<scsi_inquiry_standard*>(scsi_datain_unmarshall(task.value().get()));
    if (inq == nullptr) return Status::IoError(name() + ": malformed INQUIRY data");
    if (inq->qualifier == SCSI_INQUIRY_PERIPHERAL_QUALIFIER_NOT_SUPPORTED) {
      return Status::NotFound("LUN " + std::to_string(url_.lun) + " not found on " +
                              TargetOnPortal());
    }
    if (inq->device_type != SCSI_INQUIRY_PERIPHERAL_DEVICE_TYPE_DIRECT_ACCESS) {
      const char* type = scsi_devtype_to_str(inq->device_type);
      return Status::Invalid("LUN " + std::to_string(url_.lun) + " of " + TargetOnPortal() +
                             " is not a disk (peripheral device type " +
                             Hex(static_cast<uint32_t>(inq->device_type), 2) + ", " +
                             (type ? type : "unknown") + ")");
    }
    return Status::Ok();
  }

  struct Geometry {
    uint64_t blocks = 0;
    uint32_t block_size = 0;
    bool thin = false;  // LBPME: logical block provisioning management
  };

  void UseGeometry(const Geometry& g) REQUIRES(mu_) {
    block_size_ = g.block_size;
    size_ = g.blocks * g.block_size;
    max_transfer_ = kMaxTransferBytes;
    // Without logical block provisioning UNMAP is not even understood.
    unmap_supported_ = g.thin;
  }

  Result<Geometry> ReadGeometry() REQUIRES(mu_) {
    uint64_t blocks = 0;
    uint32_t block_size = 0;
    bool thin = false;
    CheckCondition sense;
    auto task = Execute(
        "READ CAPACITY(16)",
        [this](iscsi_context* ctx, iscsi_command_cb cb, void* priv) {
          return iscsi_readcapacity16_task(ctx, url_.lun, cb, priv);
        },
        &sense);
    if (task.ok()) {
      auto* rc = static_cast<scsi_readcapacity16*>(scsi_datain_unmarshall(task.value().get()));
      if (rc == nullptr) return Status::IoError(name() + ": malformed READ CAPACITY(16) data");
      blocks = rc->returned_lba + 1;
      block_size = rc->block_length;
      thin = rc->lbpme != 0;
    } else if (sense.Is(SCSI_SENSE_ILLEGAL_REQUEST)) {
      // Old targets only know the 10-byte form.
      auto task10 =
          Execute("READ CAPACITY(10)", [this](iscsi_context* ctx, iscsi_command_cb cb, void* priv) {
            return iscsi_readcapacity10_task(ctx, url_.lun, 0, 0, cb, priv);
          });
      if (!task10.ok()) return task10.status();
      auto* rc = static_cast<scsi_readcapacity10*>(scsi_datain_unmarshall(task10.value().get()));
      if (rc == nullptr) return Status::IoError(name() + ": malformed READ CAPACITY(10) data");
      blocks = static_cast<uint64_t>(rc->lba) + 1;
      block_size = rc->block_size;
    } else {
      return task.status();
    }
    // The volume issues 4 KiB I/O; larger logical blocks would need
    // read-modify-write, odd sizes are not disks we can use.
    if (block_size < kSectorSize || block_size > 4096 || (block_size & (block_size - 1)) != 0) {
      return Status::Unsupported(name() + ": logical block size " + std::to_string(block_size) +
                                 " is not supported (need 512, 1024, 2048 or 4096)");
    }
    return Geometry{blocks, block_size, thin};
  }

  // A VPD page, or nullopt when the target does not have it (ILLEGAL
  // REQUEST): pages 80h and 83h are optional in older SPC versions.
  Result<std::optional<std::vector<uint8_t>>> ReadVpdPage(uint8_t page, const char* what)
      REQUIRES(mu_) {
    CheckCondition sense;
    auto task = Execute(
        what,
        [this, page](iscsi_context* ctx, iscsi_command_cb cb, void* priv) {
          return iscsi_inquiry_task(ctx, url_.lun, 1, page, 255, cb, priv);
        },
        &sense);
    if (!task.ok()) {
      if (sense.Is(SCSI_SENSE_ILLEGAL_REQUEST)) return std::optional<std::vector<uint8_t>>();
      return task.status();
    }
    const scsi_data& in = task.value()->datain;
    if (in.data == nullptr || in.size <= 0) return std::optional<std::vector<uint8_t>>();
    return std::optional<std::vector<uint8_t>>(std::vector<uint8_t>(in.data, in.data + in.size));
  }

  // The unit's identity: `g` (just read by the caller) and its VPD pages.
  Result<LuIdentity> ReadIdentity(const Geometry& g) REQUIRES(mu_) {
    LuIdentity id;
    id.block_size = g.block_size;
    id.blocks = g.blocks;
    ASSIGN_OR_RETURN(auto serial, ReadVpdPage(0x80, "INQUIRY (unit serial number)"));
    if (serial.has_value()) {
      auto parsed = ParseUnitSerialNumberPage(serial->data(), serial->size());
      if (!parsed.ok()) return parsed.status().WithContext(name());
      id.serial = std::move(parsed).value();
    }
    ASSIGN_OR_RETURN(auto ident, ReadVpdPage(0x83, "INQUIRY (device identification)"));
    if (ident.has_value()) {
      auto parsed = ParseLogicalUnitDesignators(ident->data(), ident->size());
      if (!parsed.ok()) return parsed.status().WithContext(name());
      id.designators = std::move(parsed).value();
    }
    return id;
  }

  // Checks the logical unit against the one of the first login. A unit
  // found changed fails this command and every later one of every
  // session: nothing of the volume may go to another disk, and no READ
  // may return another disk's blocks as the volume's.
  Status RecheckIdentity() REQUIRES(mu_) EXCLUDES(fence_->mu) {
    checking_identity_ = true;
    identity_unchecked_ = false;
    Result<Geometry> geometry = ReadGeometry();
    Result<LuIdentity> now =
        geometry.ok() ? ReadIdentity(geometry.value()) : Result<LuIdentity>(geometry.status());
    checking_identity_ = false;
    if (!now.ok()) {
      identity_unchecked_ = true;  // not known either way: look again next time
      return now.status().WithContext("checking the logical unit's identity");
    }
    LuIdentity was;
    {
      MutexLock l(&fence_->mu);
      was = *fence_->identity;
    }
    const std::string change = DescribeIdentityChange(was, now.value());
    if (change.empty()) return Status::Ok();
    const Status lost = Status::IoError(
        name() + " is no longer the logical unit it was when the device opened: " + change +
        "; nothing more is sent to it (was the target reconfigured? check its LUN mapping, then "
        "restart)");
    LOG(kError) << lost.ToString();
    fence_->NoteIdentityLost(lost);
    Disconnect();
    return lost;
  }

  // SBC: a write-protected medium answers every WRITE with DATA PROTECT;
  // found here, at open, it is one clear error rather than a volume that
  // opens and then fails its first write. A target without MODE SENSE
  // (ILLEGAL REQUEST) is taken as writable.
  Status CheckWritable() REQUIRES(mu_) {
    CheckCondition sense;
    auto task = Execute(
        "MODE SENSE(6)",
        [this](iscsi_context* ctx, iscsi_command_cb cb, void* priv) {
          return iscsi_modesense6_task(ctx, url_.lun, 1, SCSI_MODESENSE_PC_CURRENT,
                                       SCSI_MODEPAGE_RETURN_ALL_PAGES, 0, 255, cb, priv);
        },
        &sense);
    if (!task.ok()) {
      if (sense.Is(SCSI_SENSE_ILLEGAL_REQUEST)) return Status::Ok();
      return task.status();
    }
    const scsi_data& in = task.value()->datain;
    auto wp = ParseModeSense6WriteProtect(in.data, in.data ? static_cast<size_t>(in.size) : 0);
    if (!wp.ok()) return wp.status().WithContext(name());
    if (wp.value()) {
      return Status::Invalid("LUN " + std::to_string(url_.lun) + " of " + TargetOnPortal() +
                             " is write-protected (read-only); dede needs to write the volume");
    }
    return Status::Ok();
  }

  // Optional: only tightens the transfer and unmap limits when the target
  // states them.
  void ReadBlockLimits() REQUIRES(mu_) {
    auto task = Execute(
        "INQUIRY (block limits)",
        [this](iscsi_context* ctx, iscsi_command_cb cb, void* priv) {
          return iscsi_inquiry_task(ctx, url_.lun, 1, SCSI_INQUIRY_PAGECODE_BLOCK_LIMITS, 255, cb,
                                    priv);
        },
        nullptr);
    if (!task.ok()) return;
    auto* bl = static_cast<scsi_inquiry_block_limits*>(scsi_datain_unmarshall(task.value().get()));
    if (bl == nullptr) return;
    if (bl->max_xfer_len != 0) {
      uint64_t cap = static_cast<uint64_t>(bl->max_xfer_len) * block_size_;
      if (cap >= block_size_ && cap < max_transfer_) max_transfer_ = static_cast<uint32_t>(cap);
    }
    if (bl->max_unmap != 0 && bl->max_unmap != 0xffffffffu) max_unmap_blocks_ = bl->max_unmap;
  }

  const IscsiUrl url_;
  const bool read_only_;
  const std::string initiator_;
  const uint32_t isid_;  // 24 bits, kept across logins
  const uint16_t isid_qualifier_;  // the session's index within its device
  const std::chrono::milliseconds command_timeout_;
  const std::shared_ptr<LostCommandFence> fence_;
  // Commands this session lost and counted in fence_->lost, not yet in
  // fence_->ready.
  uint64_t unready_losses_ GUARDED_BY(mu_) = 0;
  // Set once by Open() before the device is handed out; read-only after.
  uint64_t size_ = 0;
  uint32_t block_size_ = kSectorSize;
  uint32_t max_transfer_ = kMaxTransferBytes;

  Mutex mu_;
  iscsi_context* ctx_ GUARDED_BY(mu_) = nullptr;
  // Open() has read the unit's identity; from then on a login or a unit
  // attention sets identity_unchecked_ and the next command checks first
  // (checking_identity_: the check's own commands).
  bool identity_known_ GUARDED_BY(mu_) = false;
  bool identity_unchecked_ GUARDED_BY(mu_) = false;
  bool checking_identity_ GUARDED_BY(mu_) = false;
  bool recovered_logged_ GUARDED_BY(mu_) = false;
  bool unmap_supported_ GUARDED_BY(mu_) = false;
  uint32_t max_unmap_blocks_ GUARDED_BY(mu_) = 1u << 16;
};

// Several sessions to one LUN. Each IscsiDevice runs one command at a
// time under its mutex; the pool hands every call a session no other
// thread is using, so up to N threads' commands are in flight at once
// (the target runs them in parallel) and, in dedupd, a write-log append
// no longer waits behind the VMs' data writes, nor they behind it.
//
// Flush() sends SYNCHRONIZE CACHE on one session: the cache it empties is
// the logical unit's (SBC), whichever session wrote into it, and every
// write the caller saw complete before calling Flush() is in it.
class IscsiSessionPool final : public BlockDevice {
 public:
  explicit IscsiSessionPool(std::vector<std::unique_ptr<IscsiDevice>> sessions)
      : sessions_(std::move(sessions)) {
    for (size_t i = sessions_.size(); i-- > 0;) free_.push_back(i);
  }

  uint64_t size_bytes() const override { return sessions_[0]->size_bytes(); }
  std::string name() const override { return sessions_[0]->name(); }
  std::string local_lock_path() const override { return ""; }
  Status Read(uint64_t offset, void* buf, size_t len) override {
    Lease l(this);
    return l.session->Read(offset, buf, len);
  }
  Status Write(uint64_t offset, const void* buf, size_t len) override {
    Lease l(this);
    return l.session->Write(offset, buf, len);
  }
  Status Flush() override {
    Lease l(this);
    return l.session->Flush();
  }
  // The sessions share one fence, which keeps the counts.
  DeviceCounters counters() const override { return sessions_[0]->counters(); }
  Status Discard(uint64_t offset, uint64_t len) override {
    Lease l(this);
    return l.session->Discard(offset, len);
  }

 private:
  // One session for one call. The most recently returned session goes out
  // first, so a lone caller keeps using one warm session.
  struct Lease {
    explicit Lease(IscsiSessionPool* p) : pool(p) {
      std::unique_lock<std::mutex> l(pool->mu_.native());
      pool->cv_.wait(l, [this]() NO_THREAD_SAFETY_ANALYSIS { return !pool->free_.empty(); });
      index = pool->free_.back();
      pool->free_.pop_back();
      session = pool->sessions_[index].get();
    }
    ~Lease() {
      {
        MutexLock l(&pool->mu_);
        pool->free_.push_back(index);
      }
      pool->cv_.notify_one();
    }
    IscsiSessionPool* pool;
    size_t index = 0;
    IscsiDevice* session = nullptr;
  };

  const std::vector<std::unique_ptr<IscsiDevice>> sessions_;
  Mutex mu_;  // a leaf: held only to take or return a session index
  std::condition_variable cv_;
  std::vector<size_t> free_ GUARDED_BY(mu_);
};

}  // namespace

Result<std::unique_ptr<BlockDevice>> OpenIscsiDevice(const std::string& url,
                                                     const DeviceOptions& opts) {
  if (opts.iscsi_sessions < 1 || opts.iscsi_sessions > kMaxIscsiSessions) {
    return Status::Invalid("iSCSI sessions must be 1.." + std::to_string(kMaxIscsiSessions) +
                           ", not " + std::to_string(opts.iscsi_sessions));
  }
  ASSIGN_OR_RETURN(IscsiUrl parsed, ParseIscsiUrl(url));
  ASSIGN_OR_RETURN(const std::string initiator, InitiatorName(opts.iscsi_initiator_name));
  std::vector<std::unique_ptr<IscsiDevice>> sessions;
  auto fence = std::make_shared<LostCommandFence>();
  // Consecutive ISIDs: distinct within the device, each kept across its
  // session's logins (two sessions with one ISID would end each other's).
  // Every process of a host (and, in containers, hosts with one name) may
  // log in with one initiator name, so the ISIDs must differ between
  // devices, not only within one (a login with a live session's name and
  // ISID ends that session). Each device draws 24 random bits (the ISID's
  // B and C fields); its sessions are told apart by the qualifier (D).
  // A process id is no help: in pid namespaces they repeat.
  const uint32_t isid_base = std::random_device{}() & 0xffffffu;
  for (uint32_t i = 0; i < opts.iscsi_sessions; i++) {
    const auto timeout = opts.iscsi_command_timeout_ms > 0
                             ? std::chrono::milliseconds(opts.iscsi_command_timeout_ms)
                             : kDefaultCommandTimeout;
    auto dev = std::make_unique<IscsiDevice>(parsed, opts.read_only, timeout, isid_base,
                                             static_cast<uint16_t>(i), fence, initiator);
    RETURN_IF_ERROR(dev->Open());
    // Open compared the unit's identity with the first session's, which
    // takes a grown capacity for the same unit: one grown between two
    // logins is caught here.
    if (!sessions.empty() && dev->size_bytes() != sessions[0]->size_bytes()) {
      return Status::IoError(dev->name() + ": sessions disagree about the LUN's size (" +
                             std::to_string(sessions[0]->size_bytes()) + " vs " +
                             std::to_string(dev->size_bytes()) + " bytes)");
    }
    sessions.push_back(std::move(dev));
  }
  if (sessions.size() == 1) return std::unique_ptr<BlockDevice>(std::move(sessions[0]));
  return std::unique_ptr<BlockDevice>(std::make_unique<IscsiSessionPool>(std::move(sessions)));
}

}  // namespace dede
