// Who may use dedupd's NBD port on 127.0.0.1 (`--tcp-port`).
//
// NBD carries no authentication here, and a TCP socket has no
// SO_PEERCRED: unchecked, any local user (a web server's account, say)
// could read and write every VM disk through the port. The Unix socket
// admits only root, its owner and the members of its group (mode 0660).
// The port admits the same users, as far as TCP lets us tell: the kernel
// knows which user made the client's end of a loopback connection
// (NETLINK_SOCK_DIAG, what `ss -e` shows), and the user database says
// which groups that user has.
//
// Where that differs from the Unix socket's own check:
// * it is the user that *made* the client's socket, not the one that
//   connected it (a socket a root process made and handed over counts as
//   root's);
// * groups come from the user database, not from the client process (a
//   process that dropped its groups still passes; a user just added to
//   the group passes before logging in again);
// * the socket file's directory, ACLs and MAC rules play no part;
// * a process running as uid 0 passes, wherever it is (a container on
//   the host's network without a user namespace is root here).
// A client whose end the kernel cannot find in dedupd's network namespace
// (reaching 127.0.0.1 from elsewhere through route_localnet) is refused.
#pragma once

#include <netinet/in.h>
#include <sys/types.h>

#include "util/status.h"

namespace dede {

// The owner of one end of a TCP connection in this network namespace: the
// user that made the socket, and whether a process still has it open.
struct TcpSocketOwner {
  uid_t uid = 0;
  // False for a socket no process holds any more (closed, or a TIME_WAIT
  // remnant). The kernel reports uid 0 for the remnant, so such an owner
  // proves nothing: a client that sent its requests and closed must not
  // pass for root.
  bool held = false;
};

// Asks the kernel for the socket whose local address is `local` and whose
// peer is `remote` (both AF_INET, as getsockname/getpeername give them).
// For a connection dedupd accepted, pass the client's address as `local`
// and dedupd's as `remote`: that names the client's end. Only a connected
// socket answers (never a listener on the same port). kNotFound if there
// is none (the client has gone, or its end is not in this namespace; also
// what a kernel without inet_diag/tcp_diag says, see CheckSockDiag);
// kIoError if the kernel cannot be asked or the reply is malformed.
Result<TcpSocketOwner> LookupTcpSocketOwner(const sockaddr_in& local, const sockaddr_in& remote);

// Whether user `uid` could connect to a Unix socket of mode 0660 owned by
// `owner_uid`:`owner_gid`: uid 0, `owner_uid` itself, or a user whose
// primary or supplementary groups in the user database include
// `owner_gid`. A uid the database does not know is only admitted as 0 or
// `owner_uid`. Reads the user database (NSS): may block, so not on a
// thread that serves I/O.
bool UserMayUseSocket(uid_t uid, uid_t owner_uid, gid_t owner_gid);

// Whether LookupTcpSocketOwner works here: a loopback connection of this
// process's own must come back as this user's. kUnsupported, saying so,
// when the kernel cannot tell (inet_diag or tcp_diag missing): every TCP
// client would be refused.
Status CheckSockDiag();

}  // namespace dede
