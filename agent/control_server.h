// ControlServer: dedupd's control channel, a Unix socket that `dede status`
// (and later commands) talk to.
//
// Protocol: newline-delimited JSON. A client sends one request object per
// line ({"cmd":"status"} ...), the server answers one object per line: the
// handler's reply, or {"error":"..."} for bad JSON / unknown cmd / handler
// failure. Many clients, many requests per connection; a connection's
// requests are answered one at a time, in order. A line longer than 64 KiB
// gets an {"error":...} and the connection is closed; a client that
// vanishes mid-line is dropped. A client that sends its requests and then
// shuts down its sending side still gets every reply (`socat` does that).
// At most `max_connections` are open at once. When one more comes, the
// connection idle longest is closed for it (evicted(), logged), if it has
// been idle for `idle_evict` (10 s by default): no handler running for it,
// no byte received from it and no reply finished to it since (a client
// that stopped reading its replies is idle too). Evictions are logged one
// line per burst, at most every 10 s. Else the newcomer is answered
// {"error":"too many control connections ..."} at once, unread, and
// closed, and counted (refused()); a warning is logged at most every
// 10 s. Each connection is a descriptor and a strand, and the socket is
// open to a whole group: without a cap, a looping script could take every
// descriptor dedupd has, and its VMs' disks with them; without eviction,
// `max_connections` clients that connect and send nothing (a hung
// monitoring probe, a forgotten `socat`) would lock every operator out of
// `dede status` until dedupd restarts. An idle connection is never closed
// while no one else needs its place (an interactive session may idle).
//
// Threads: sockets live on the io_context (one strand per connection);
// handlers may block (volume I/O), so they run through `run_blocking`, never
// on an io thread, and their reply is written back on the io_context.
#pragma once

#include <boost/asio.hpp>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "util/status.h"

namespace dede {

class ControlConnection;

inline constexpr const char* kDefaultControlPath = "/run/dede/dedupd.ctl";
// Longest request line the server reads (without its newline).
inline constexpr size_t kControlMaxLine = 64 * 1024;
// Control connections open at once, unless dedupd is told otherwise
// (--control-max-connections). `dede status` takes one for a moment.
inline constexpr size_t kDefaultControlMaxConnections = 64;
// How long a control connection must have been idle before a new client
// may take its place when max_connections are open.
inline constexpr std::chrono::milliseconds kControlIdleEvict{10'000};

class ControlServer {
 public:
  // A handler gets the whole request object (its "cmd" included). Its error
  // Status becomes {"error": message}; so does an exception it throws.
  using Handler = std::function<Result<nlohmann::json>(const nlohmann::json& request)>;

  // dedupd passes NbdServer::RunBlocking as `run_blocking`.
  // `max_connections` >= 1.
  ControlServer(boost::asio::io_context& io, std::string path,
                std::function<void(std::function<void()>)> run_blocking,
                size_t max_connections = kDefaultControlMaxConnections,
                std::chrono::milliseconds idle_evict = kControlIdleEvict);
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  // Registers the handler of `cmd`; call before Start (handlers are read
  // without a lock afterwards).
  void Handle(const std::string& cmd, Handler h);

  // Creates the socket's parent directory, binds and listens; the socket
  // gets mode 0660. A socket file nothing answers on (a dead dedupd's) is
  // removed first; one a live server answers on gives kExists "another
  // dedupd is using PATH", a non-socket file kExists too.
  Status Listen();
  const std::string& path() const { return path_; }
  // Starts accepting clients. Start and Stop touch the acceptor: call them
  // on the io_context's thread (a posted handler), or while it does not run.
  void Start();
  // Closes the acceptor and every connection (replies being computed are
  // dropped) and removes the socket file, if it is still the one Listen
  // created. Idempotent; the destructor calls it.
  void Stop();

  // After Stop: waits until every handler already started has returned
  // (none starts after Stop). Blocks: call it on a worker thread, never on
  // the io_context's (a handler's reply is posted there).
  void WaitForHandlers();

  // Connections currently open (tests, status).
  size_t connections() const;
  size_t max_connections() const { return max_connections_; }
  // Connections refused since Start because max_connections were open
  // and none had been idle for idle_evict.
  uint64_t refused() const;
  // Idle connections closed since Start to make room for a new client.
  uint64_t evicted() const;

 private:
  friend class ControlConnection;
  struct Shared;
  boost::asio::io_context& io_;
  const std::string path_;
  const size_t max_connections_;
  const std::chrono::milliseconds idle_evict_;
  // Refusals not logged yet, and when the last were (the io thread's:
  // only the accept handler touches them).
  uint64_t refused_unlogged_ = 0;
  std::optional<std::chrono::steady_clock::time_point> refusal_logged_;
  // Handlers, run_blocking and the connection registry: connections hold
  // it too, so a reply computed after Stop (or after this object is gone)
  // finds it still there.
  std::shared_ptr<Shared> shared_;
  std::unique_ptr<boost::asio::local::stream_protocol::acceptor> acceptor_;
  // The socket file Listen created (device, inode): Stop unlinks the path
  // only if it still names that file, not a successor's socket.
  bool bound_ = false;
  uint64_t bound_dev_ = 0, bound_ino_ = 0;

  void Accept();
  // Answers `sock` with an error line and closes it (max_connections open).
  void Refuse(boost::asio::local::stream_protocol::socket sock, size_t open);
};

// Client side, used by the dede CLI: connects to `path`, sends `request` as
// one line, reads one reply line, all within `timeout`. Returns the reply as
// is, an {"error":...} reply included. kNotFound "no dedupd at PATH (...)"
// when nothing listens there; kUnavailable when no reply came in time;
// kIoError when the connection broke or the reply is not JSON.
Result<nlohmann::json> ControlRequest(const std::string& path, const nlohmann::json& request,
                                      std::chrono::milliseconds timeout = std::chrono::seconds(30));

}  // namespace dede
