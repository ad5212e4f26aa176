#include "agent/tcp_peer_access.h"

#include <grp.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "util/fd_closer.h"

namespace dede {

namespace {

// TCP_LISTEN in the kernel's state numbering (include/net/tcp_states.h),
// which inet_diag reports.
constexpr uint8_t kTcpListen = 10;

// The message that follows netlink header `h`.
template <typename T>
const T* PayloadOf(const nlmsghdr* h) {
  return reinterpret_cast<const T*>(reinterpret_cast<const char*>(h) + NLMSG_HDRLEN);
}

}  // namespace

Result<TcpSocketOwner> LookupTcpSocketOwner(const sockaddr_in& local, const sockaddr_in& remote) {
  const int fd = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd < 0) return Status::FromErrno("opening a sock_diag netlink socket", errno);
  FdCloser closer(fd);
  // The kernel answers at once; the timeout only guards against a reply
  // that never comes.
  timeval timeout{1, 0};
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout)) != 0) {
    return Status::FromErrno("setting a timeout on the sock_diag socket", errno);
  }

  // One exact lookup (no NLM_F_DUMP): the kernel finds the socket by its
  // four-tuple, as it would for a packet from `remote` to `local`.
  struct {
    nlmsghdr header;
    inet_diag_req_v2 request;
  } query{};
  query.header.nlmsg_len = sizeof(query);
  query.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  query.header.nlmsg_flags = NLM_F_REQUEST;
  query.header.nlmsg_seq = 1;
  query.request.sdiag_family = AF_INET;
  query.request.sdiag_protocol = IPPROTO_TCP;
  query.request.idiag_states = ~0u;
  query.request.id.idiag_sport = local.sin_port;  // both in network order
  query.request.id.idiag_dport = remote.sin_port;
  query.request.id.idiag_src[0] = local.sin_addr.s_addr;
  query.request.id.idiag_dst[0] = remote.sin_addr.s_addr;
  query.request.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  query.request.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(fd, &query, sizeof(query), 0, reinterpret_cast<sockaddr*>(&kernel), sizeof(kernel)) <
      0) {
    return Status::FromErrno("asking the kernel (sock_diag) who owns a TCP socket", errno);
  }

  alignas(nlmsghdr) char reply[8192];
  ssize_t n;
  do {
    n = ::recv(fd, reply, sizeof(reply), 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return Status::FromErrno("reading the kernel's sock_diag reply", errno);
  // Walks the messages by hand: NLMSG_OK mixes signed and unsigned.
  const size_t got = static_cast<size_t>(n);
  for (size_t at = 0; at + sizeof(nlmsghdr) <= got;) {
    const auto* h = reinterpret_cast<const nlmsghdr*>(reply + at);
    if (h->nlmsg_len < sizeof(nlmsghdr) || h->nlmsg_len > got - at) break;
    at += NLMSG_ALIGN(h->nlmsg_len);
    if (h->nlmsg_type == NLMSG_ERROR) {
      if (h->nlmsg_len < NLMSG_LENGTH(sizeof(nlmsgerr))) break;
      const int err = -PayloadOf<nlmsgerr>(h)->error;
      if (err == ENOENT) return Status::NotFound("no such TCP socket (the client has gone)");
      // (Without inet_diag/tcp_diag the kernel answers ENOENT as well:
      // CheckSockDiag tells the two apart once, at start.)
      return Status::FromErrno("the kernel's sock_diag lookup of a TCP socket", err);
    }
    if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY || h->nlmsg_seq != query.header.nlmsg_seq) continue;
    if (h->nlmsg_len < NLMSG_LENGTH(sizeof(inet_diag_msg))) break;
    const auto* m = PayloadOf<inet_diag_msg>(h);
    // With no connected socket of that four-tuple, the kernel's lookup
    // falls back to a *listening* socket on the local port (as for a SYN):
    // a client whose end the lookup cannot see (another network namespace
    // reaching 127.0.0.1 through route_localnet, a socket bound to a
    // device) would pass for the owner of whatever listens on its source
    // port (sshd on 22: root). Only the connection itself answers.
    if (m->idiag_state == kTcpListen || m->id.idiag_sport != local.sin_port ||
        m->id.idiag_dport != remote.sin_port) {
      return Status::NotFound("no connected TCP socket with that address (the client has gone)");
    }
    TcpSocketOwner owner;
    owner.uid = m->idiag_uid;
    // A socket a process holds has an inode; a closed one (orphaned, or a
    // TIME_WAIT remnant) reports inode 0.
    owner.held = m->idiag_inode != 0;
    return owner;
  }
  return Status::IoError("the kernel's sock_diag reply holds no socket description");
}

bool UserMayUseSocket(uid_t uid, uid_t owner_uid, gid_t owner_gid) {
  if (uid == 0 || uid == owner_uid) return true;
  // Bounded retries: a user database that keeps failing denies.
  long size = ::sysconf(_SC_GETPW_R_SIZE_MAX);
  std::vector<char> buf(size > 0 ? static_cast<size_t>(size) : 16384);
  passwd pw{};
  passwd* found = nullptr;
  int rc = ERANGE;
  for (int tries = 0; tries < 8 && rc == ERANGE; tries++) {
    rc = ::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found);
    if (rc == ERANGE) buf.resize(buf.size() * 2);
  }
  if (rc != 0 || found == nullptr) return false;
  if (pw.pw_gid == owner_gid) return true;
  std::vector<gid_t> groups(64);
  for (int tries = 0; tries < 8; tries++) {
    int count = static_cast<int>(groups.size());
    if (::getgrouplist(pw.pw_name, pw.pw_gid, groups.data(), &count) >= 0) {
      return std::find(groups.begin(), groups.begin() + count, owner_gid) != groups.begin() + count;
    }
    // Too small: `count` says how many there are. A failure that does not
    // ask for more room is not retried.
    if (count <= static_cast<int>(groups.size())) return false;
    groups.resize(static_cast<size_t>(count));
  }
  return false;
}

Status CheckSockDiag() {
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return Status::FromErrno("a socket for the sock_diag check", errno);
  FdCloser listener_closer(listener);
  sockaddr_in server{};
  server.sin_family = AF_INET;
  server.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(server);
  if (::bind(listener, reinterpret_cast<sockaddr*>(&server), sizeof(server)) != 0 ||
      ::listen(listener, 1) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&server), &len) != 0) {
    return Status::FromErrno("a loopback listener for the sock_diag check", errno);
  }
  const int client = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (client < 0) return Status::FromErrno("a socket for the sock_diag check", errno);
  FdCloser client_closer(client);
  sockaddr_in ours{};
  len = sizeof(ours);
  if (::connect(client, reinterpret_cast<sockaddr*>(&server), sizeof(server)) != 0 ||
      ::getsockname(client, reinterpret_cast<sockaddr*>(&ours), &len) != 0) {
    return Status::FromErrno("a loopback connection for the sock_diag check", errno);
  }
  Result<TcpSocketOwner> owner = LookupTcpSocketOwner(ours, server);
  if (!owner.ok() || !owner->held || owner->uid != ::geteuid()) {
    return Status::Unsupported(
        "the kernel does not say who owns a loopback TCP connection (NETLINK_SOCK_DIAG; "
        "are the inet_diag and tcp_diag modules available?)" +
        (owner.ok() ? std::string() : ": " + owner.status().message()));
  }
  return Status::Ok();
}

}  // namespace dede
