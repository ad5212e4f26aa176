// Who may use dedupd's NBD port on 127.0.0.1 (agent/tcp_peer_access.h):
// the kernel's answer for real loopback sockets, including one made by
// another user, and the user-database rule the Unix socket's mode implies.
#include "agent/tcp_peer_access.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <cstring>

namespace dede {
namespace {

constexpr uid_t kNobody = 65534;  // Debian's nobody:nogroup
constexpr gid_t kNoGroup = 65534;
constexpr uid_t kDaemon = 1;  // daemon:daemon, not in nogroup

struct Listener {
  int fd = -1;
  sockaddr_in addr{};
  Listener() {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    REQUIRE(::listen(fd, 4) == 0);
    socklen_t len = sizeof(addr);
    REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  }
  ~Listener() { ::close(fd); }
  // Accepts one connection; its peer's (the client's) address into *client.
  int Accept(sockaddr_in* client) {
    socklen_t len = sizeof(*client);
    int c = ::accept4(fd, reinterpret_cast<sockaddr*>(client), &len, SOCK_CLOEXEC);
    REQUIRE(c >= 0);
    return c;
  }
};

int Connect(const sockaddr_in& to) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof(to)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

TEST_CASE("tcp peer: the kernel names the user that made the client's socket", "[tcp_peer]") {
  Listener server;
  int client = Connect(server.addr);
  REQUIRE(client >= 0);
  sockaddr_in client_addr{};
  int served = server.Accept(&client_addr);

  Result<TcpSocketOwner> owner = LookupTcpSocketOwner(client_addr, server.addr);
  REQUIRE(owner.ok());
  CHECK(owner->uid == ::geteuid());
  CHECK(owner->held);

  // Asked the other way round, the lookup names dedupd's own end.
  Result<TcpSocketOwner> ours = LookupTcpSocketOwner(server.addr, client_addr);
  REQUIRE(ours.ok());
  CHECK(ours->held);

  // A client that closed its end proves nothing: the remnant is not held
  // (the kernel reports uid 0 for it), or already gone.
  ::close(client);
  Result<TcpSocketOwner> closed = LookupTcpSocketOwner(client_addr, server.addr);
  if (closed.ok()) {
    CHECK_FALSE(closed->held);
  } else {
    CHECK(closed.status().code() == Status::Code::kNotFound);
  }
  ::close(served);

  // No socket at all with that four-tuple.
  sockaddr_in nowhere = client_addr;
  nowhere.sin_port = htons(1);
  Result<TcpSocketOwner> none = LookupTcpSocketOwner(nowhere, server.addr);
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().code() == Status::Code::kNotFound);
}

TEST_CASE("tcp peer: a listener on the client's port never answers for the client", "[tcp_peer]") {
  // With no connection of that four-tuple, the kernel's lookup falls back
  // to whatever listens on the local port, as for a SYN. A client whose
  // end the lookup cannot see, using as its source port one a root
  // daemon listens on, would pass for root.
  Listener server;
  Listener root_daemon;  // this process's own: held, and our uid
  Result<TcpSocketOwner> owner = LookupTcpSocketOwner(root_daemon.addr, server.addr);
  REQUIRE_FALSE(owner.ok());
  CHECK(owner.status().code() == Status::Code::kNotFound);
}

TEST_CASE("tcp peer: the start-up check finds sock_diag working", "[tcp_peer]") {
  Status s = CheckSockDiag();
  INFO(s.ToString());
  CHECK(s.ok());
}

TEST_CASE("tcp peer: a socket made by another user is reported as that user's", "[tcp_peer]") {
  REQUIRE(::geteuid() == 0);  // the test switches a child to nobody
  Listener server;
  int ready[2], done[2];
  REQUIRE(::pipe2(ready, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(done, O_CLOEXEC) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // Drop to nobody, connect, say so ('y', or 'n' when anything failed:
    // the parent then stops), and hold the socket until the parent is done.
    ::close(ready[0]);
    ::close(done[1]);
    int fd = -1;
    if (::setgroups(0, nullptr) == 0 && ::setresgid(kNoGroup, kNoGroup, kNoGroup) == 0 &&
        ::setresuid(kNobody, kNobody, kNobody) == 0) {
      fd = Connect(server.addr);
    }
    char c = fd >= 0 ? 'y' : 'n';
    if (::write(ready[1], &c, 1) != 1) ::_exit(3);
    (void)::read(done[0], &c, 1);  // returns at the parent's write or exit
    ::_exit(fd >= 0 ? 0 : 1);
  }
  ::close(ready[1]);
  ::close(done[0]);
  // Whatever happens below, the child is told to go and is reaped.
  struct Reaper {
    pid_t pid;
    int done_fd;
    int status = -1;
    ~Reaper() {
      if (done_fd >= 0) ::close(done_fd);
      if (pid > 0) ::waitpid(pid, &status, 0);
    }
    void Finish() {
      ::close(done_fd);
      done_fd = -1;
      ::waitpid(pid, &status, 0);
      pid = -1;
    }
  } reaper{child, done[1]};
  char c = 0;
  const ssize_t got = ::read(ready[0], &c, 1);  // 0 if the child died first
  ::close(ready[0]);
  REQUIRE(got == 1);
  REQUIRE(c == 'y');
  sockaddr_in client_addr{};
  int served = server.Accept(&client_addr);
  Result<TcpSocketOwner> owner = LookupTcpSocketOwner(client_addr, server.addr);
  reaper.Finish();
  CHECK(WIFEXITED(reaper.status));
  CHECK(WEXITSTATUS(reaper.status) == 0);
  ::close(served);
  REQUIRE(owner.ok());
  CHECK(owner->uid == kNobody);
  CHECK(owner->held);
}

TEST_CASE("tcp peer: the users a 0660 Unix socket admits", "[tcp_peer]") {
  // Root, and the socket's owner, always.
  CHECK(UserMayUseSocket(0, 1234, 1234));
  CHECK(UserMayUseSocket(1234, 1234, 99));
  // A user whose primary group is the socket's group.
  CHECK(UserMayUseSocket(kNobody, 0, kNoGroup));
  // A user neither owner nor in the group.
  CHECK_FALSE(UserMayUseSocket(kDaemon, 0, kNoGroup));
  CHECK_FALSE(UserMayUseSocket(kNobody, 0, 0));
  // A uid the user database does not know is only its owner's.
  CHECK_FALSE(UserMayUseSocket(3999999, 0, kNoGroup));
  CHECK(UserMayUseSocket(3999999, 3999999, kNoGroup));
}

}  // namespace
}  // namespace dede
