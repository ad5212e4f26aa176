// NbdServer: serves the ExportTable's files over NBD on a Unix socket and,
// by option, TCP on 127.0.0.1 only. Network I/O runs on an Asio
// io_context; each request's volume I/O runs on a worker pool, so one
// client can have many requests in flight and a slow client or a slow
// device never stalls the others. Each connection is a small state machine
// around an nbd::NbdSession (agent/nbd_protocol.h), which does all parsing.
//
// Per connection, at most max_inflight_requests requests (and
// max_inflight_bytes of payload and reply data) are executing or waiting
// to be written; past that, the connection stops reading from its socket
// until replies go out (back-pressure). Host-wide, READ replies and WRITE
// payloads (partly received ones included) share memory_budget bytes: a
// READ or WRITE that does not fit waits, its connection not reading, until
// others' bytes are freed (NbdMemoryBudget). A connection that holds some
// of the budget for its client (replies it does not read, a WRITE payload
// it does not send) and moves no byte for stall_timeout_s while another
// connection waits for room is closed; one whose client hangs up while it
// waits leaves the line.
#pragma once

#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "agent/export_table.h"
#include "agent/nbd_protocol.h"
#include "util/mutex.h"
#include "util/status.h"

namespace dede {

// The bytes of request data (READ replies, WRITE payloads) all NBD
// connections may hold at once. Without it each connection was bounded
// alone (max_inflight_bytes, plus a WRITE payload being received), so
// max_connections clients could pin ~100 GiB of dedupd's memory.
//
// Reserve-then-admit: a request's whole length is reserved before any of
// it is allocated, so an admitted request never needs more to finish
// (counting a WRITE payload as its bytes arrive deadlocked: connections
// stopped mid-payload, each waiting for the others). One that does not
// fit waits in FIFO order (a big request is not passed over for ever by
// small ones); one bigger than the whole budget runs when nothing else is
// reserved. Thread-safe; the wake callbacks run outside the lock.
class NbdMemoryBudget {
 public:
  explicit NbdMemoryBudget(uint64_t limit) : limit_(limit) {}

  // Reserves `bytes` for `who`, if no one is waiting ahead of it and they
  // fit. Else `who` waits in line (once, however often it asks) and
  // `wake` runs once, on the releasing thread, when it is first in line
  // and its bytes fit: it must then ask again, or Withdraw.
  bool TryReserve(const void* who, uint64_t bytes, std::function<void()> wake) EXCLUDES(mu_);
  void Release(uint64_t bytes) EXCLUDES(mu_);
  // `who` no longer waits (its connection closes).
  void Withdraw(const void* who) EXCLUDES(mu_);
  // Someone other than `who` waits for room.
  bool OthersWaiting(const void* who) EXCLUDES(mu_);

  struct Stats {
    uint64_t limit = 0;
    uint64_t in_use = 0;
    uint64_t peak = 0;     // the most ever reserved at once
    uint64_t waiting = 0;  // connections waiting for room
    uint64_t waits = 0;    // requests that had to wait, ever
  };
  Stats stats() EXCLUDES(mu_);

 private:
  struct Waiter {
    const void* who;
    uint64_t bytes;
    std::function<void()> wake;
    bool woken;
  };
  bool Fits(uint64_t bytes) const REQUIRES(mu_) {
    return used_ == 0 || (used_ <= limit_ && bytes <= limit_ - used_);
  }
  // The first waiter's wake, if its bytes fit now and it was not yet woken.
  std::function<void()> WakeHead() REQUIRES(mu_);

  const uint64_t limit_;
  Mutex mu_;
  uint64_t used_ GUARDED_BY(mu_) = 0;
  uint64_t peak_ GUARDED_BY(mu_) = 0;
  uint64_t waits_ GUARDED_BY(mu_) = 0;
  std::deque<Waiter> waiters_ GUARDED_BY(mu_);
};

// Bytes reserved in an NbdMemoryBudget, given back when this is destroyed
// or reset: it travels with the memory it stands for (a request's payload,
// its READ reply until written), so no path that frees the memory can
// forget the reservation.
class NbdMemoryCharge {
 public:
  NbdMemoryCharge() = default;
  NbdMemoryCharge(NbdMemoryBudget* budget, uint64_t bytes) : budget_(budget), bytes_(bytes) {}
  NbdMemoryCharge(NbdMemoryCharge&& o) noexcept
      : budget_(std::exchange(o.budget_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  NbdMemoryCharge& operator=(NbdMemoryCharge&& o) noexcept {
    if (this != &o) {
      Reset();
      budget_ = std::exchange(o.budget_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  NbdMemoryCharge(const NbdMemoryCharge&) = delete;
  NbdMemoryCharge& operator=(const NbdMemoryCharge&) = delete;
  ~NbdMemoryCharge() { Reset(); }
  void Reset() {
    if (budget_ != nullptr && bytes_ > 0) budget_->Release(bytes_);
    budget_ = nullptr;
    bytes_ = 0;
  }
  uint64_t bytes() const { return bytes_; }

 private:
  NbdMemoryBudget* budget_ = nullptr;
  uint64_t bytes_ = 0;
};

struct NbdServerOptions {
  std::string unix_socket;  // "" = no Unix socket
  int tcp_port = -1;        // -1 = no TCP; 0 = pick a free port (tests)
  size_t worker_threads = 8;
  // How long an export open waits for a file held elsewhere (see
  // ExportTable::Acquire).
  double open_wait_s = 30;
  // Requests executing or answered but not yet written to the client,
  // and their bytes (READ data included): past either, the connection
  // stops reading requests, so a client that never reads its replies
  // holds at most this much of dedupd's memory.
  size_t max_inflight_requests = 64;
  size_t max_inflight_bytes = size_t{64} << 20;
  // All connections together: READ and WRITE data (NbdMemoryBudget).
  // 1 GiB: sixteen connections at their own limit above, far more than
  // qemu guests keep in flight in practice (a few MiB each), and a fixed
  // figure rather than a share of RAM, which says little about what a
  // cgroup or the VMs beside dedupd leave it.
  uint64_t memory_budget = uint64_t{1} << 30;
  // A connection holding budget bytes for its client (READ replies it
  // does not take, a WRITE whose payload it does not finish sending) that
  // sends and receives nothing for this long is closed while another
  // connection waits for room: a client that hung without closing (10-16
  // of them fill the default budget) must not stall every other disk for
  // ever. Closing loses nothing acknowledged: the payload's WRITE never
  // ran, the replies were never delivered. Bytes held by requests still
  // executing (a slow device) do not count, nor does a stall that keeps
  // no one waiting. 0: never.
  double stall_timeout_s = 60;
  // Shutdown: how long a connection may go without taking any of its
  // replies before they are given up and it is closed (a client that
  // stopped reading must not keep the daemon, and every other disk's
  // lock, up; a slow reader is not cut off).
  double drain_timeout_s = 10;
  // Connections open at once; one more is closed as soon as it is
  // accepted (and counted), so that a client leaking connections cannot
  // take every file descriptor of the daemon (the volume's, the logs').
  size_t max_connections = 1024;
  // A connection still in the handshake (no export entered) that sends
  // nothing for this long is closed: it holds one of max_connections.
  // Waits on our side (an open waiting for its file, a listing) do not
  // count. 0: no limit.
  double handshake_timeout_s = 30;
  nbd::SessionOptions session;
};

struct NbdServerStats {
  uint64_t connections_total = 0;
  uint64_t connections_open = 0;
  uint64_t requests = 0;
  uint64_t request_errors = 0;   // replies with a non-zero error
  uint64_t protocol_errors = 0;  // connections closed for bad traffic
  uint64_t handshake_timeouts = 0;   // closed idle in the handshake
  uint64_t connections_refused = 0;  // past max_connections
  uint64_t connections_denied = 0;   // TCP clients the Unix socket would not admit
  uint64_t bytes_read = 0;           // payload of READs answered without error
  uint64_t bytes_written = 0;        // payload of WRITEs answered without error
  uint64_t stall_closes = 0;         // closed holding budget bytes, stalled (stall_timeout_s)
  NbdMemoryBudget::Stats memory;     // the host-wide budget of request data
};

class NbdConnection;

class NbdServer {
 public:
  NbdServer(boost::asio::io_context& io, ExportTable* table, const NbdServerOptions& opts);
  ~NbdServer();

  // Binds the sockets; kExists if another server is listening on the Unix
  // socket, kIoError for other bind errors.
  Status Listen();
  uint16_t tcp_port() const { return tcp_port_; }
  void Start();
  // Stops accepting; every connection finishes the requests it has read,
  // sends their replies and closes; then `done` runs on the io_context.
  void Shutdown(std::function<void()> done);
  NbdServerStats stats();
  // Shutdown has begun.
  bool stopping() {
    MutexLock l(&mu_);
    return shutting_down_;
  }

  // Runs blocking work (volume I/O) on the worker pool.
  template <typename F>
  void RunBlocking(F&& f) {
    boost::asio::post(pool_, std::forward<F>(f));
  }
  // Runs a TRIM or WRITE_ZEROES longer than the largest READ or WRITE
  // (kLongEffectBytes) on the long-request pool (LongThreads() threads),
  // never on a worker: qemu and the kernel send discards and zeroings of
  // gigabytes, each a worker's work for seconds, and a client pipelining
  // 64 of them took every worker while other VMs' requests queued behind.
  template <typename F>
  void RunLong(F&& f) {
    boost::asio::post(long_pool_, std::forward<F>(f));
  }
  // More than one WRITE's worth of effect: the advertised maximum payload,
  // 32 MiB (a shorter request costs what a WRITE may).
  static constexpr uint64_t kLongEffectBytes = nbd::SessionOptions{}.max_payload;
  // A quarter of the workers, at least one.
  static size_t LongThreads(size_t worker_threads) {
    return std::max<size_t>(1, worker_threads / 4);
  }
  // Runs an export open (which may wait long for its file's lock) on the
  // open pool, never on a worker.
  template <typename F>
  void RunOpen(F&& f) {
    boost::asio::post(open_pool_, std::forward<F>(f));
  }
  // Waits for the worker pool (and the opens and TCP client checks) to
  // finish everything posted.
  void JoinWorkers() {
    pool_.join();
    long_pool_.join();
    open_pool_.join();
    admission_pool_.join();
  }
  // Threads that open exports: as many opens may wait for their files'
  // locks at once before later ones queue (other disks' I/O goes on).
  static constexpr size_t kOpenThreads = 4;

 private:
  friend class NbdConnection;
  using Acceptor = boost::asio::basic_socket_acceptor<boost::asio::generic::stream_protocol>;
  using Socket = boost::asio::generic::stream_protocol::socket;
  void Accept(Acceptor* acceptor);
  // After an accept failed for want of descriptors or memory: the
  // connection stays in the listen backlog, so accepting again at once
  // would fail again at once, for ever, at full speed.
  void AcceptLater(Acceptor* acceptor);
  // Starts serving an accepted connection (io thread).
  void Admit(Socket sock) EXCLUDES(mu_);
  // A TCP connection is served only if the user that made the client's
  // socket could use the Unix socket too (tcp_peer_access.h). Checked on
  // admission_pool_ (the user database may block: never on the volume
  // I/O workers), then admitted or closed on the io thread.
  void AdmitIfPermitted(Socket sock) EXCLUDES(mu_);
  // Why the client of `sock` may not use the port; OK if it may.
  Status CheckTcpClient(Socket& sock) const;
  // At most one warning per 10 s of each kind (refused connections,
  // failed accepts): true if one is due now, and then `*last` = now.
  bool WarningDue(std::chrono::steady_clock::time_point* last) EXCLUDES(mu_);
  void Finished(NbdConnection* c) EXCLUDES(mu_);

  boost::asio::io_context& io_;
  ExportTable* const table_;
  const NbdServerOptions opts_;
  boost::asio::thread_pool pool_;
  boost::asio::thread_pool long_pool_;
  boost::asio::thread_pool open_pool_{kOpenThreads};
  // One thread for the TCP client checks, so that a slow user database
  // (sssd, LDAP) or a flood of local connects holds up no VM's I/O.
  boost::asio::thread_pool admission_pool_{1};
  std::unique_ptr<Acceptor> unix_acceptor_;
  std::unique_ptr<Acceptor> tcp_acceptor_;
  // Each acceptor's pause after an accept failed for want of resources
  // (AcceptLater); io thread only.
  boost::asio::steady_timer unix_retry_;
  boost::asio::steady_timer tcp_retry_;
  uint16_t tcp_port_ = 0;
  // Declared before the connections, whose charges it outlives.
  NbdMemoryBudget budget_;
  // Who the Unix socket admits besides root (its file's owner and group,
  // or dedupd's effective user and group when there is none): the TCP
  // port admits the same users. Written by Listen, before Start; read-only
  // after.
  uid_t access_uid_ = 0;
  gid_t access_gid_ = 0;

  Mutex mu_;
  std::set<std::shared_ptr<NbdConnection>> conns_ GUARDED_BY(mu_);
  bool shutting_down_ GUARDED_BY(mu_) = false;
  std::chrono::steady_clock::time_point last_refusal_warning_ GUARDED_BY(mu_){};
  std::chrono::steady_clock::time_point last_accept_error_warning_ GUARDED_BY(mu_){};
  std::chrono::steady_clock::time_point last_denial_warning_ GUARDED_BY(mu_){};
  // TCP connections accepted and not yet admitted or closed (their check
  // runs on admission_pool_): they count towards max_connections for TCP
  // (not for the Unix socket, which local users cannot fill this way), and
  // past kMaxAdmitting more are closed at once.
  size_t admitting_ GUARDED_BY(mu_) = 0;
  static constexpr size_t kMaxAdmitting = 64;
  std::function<void()> on_shutdown_ GUARDED_BY(mu_);

 public:
  // Counters (relaxed atomics, read by stats()).
  std::atomic<uint64_t> c_total_{0}, c_requests_{0}, c_request_errors_{0}, c_protocol_errors_{0},
      c_handshake_timeouts_{0}, c_bytes_read_{0}, c_bytes_written_{0}, c_refused_{0}, c_denied_{0},
      c_stall_closes_{0};
};

}  // namespace dede
