#include "agent/control_server.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio/local/stream_protocol.hpp>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>

#include "util/fd_closer.h"
#include "util/log.h"
#include "util/mutex.h"

namespace dede {

namespace asio = boost::asio;
using json = nlohmann::json;
using UnixSocket = asio::local::stream_protocol::socket;
using Strand = asio::strand<asio::any_io_executor>;

struct ControlServer::Shared {
  std::map<std::string, Handler> handlers;  // filled before Start, read-only after
  std::function<void(std::function<void()>)> run_blocking;
  Mutex mu;
  std::map<uint64_t, std::weak_ptr<ControlConnection>> conns GUARDED_BY(mu);
  uint64_t next_id GUARDED_BY(mu) = 0;
  uint64_t refused GUARDED_BY(mu) = 0;
  uint64_t evicted GUARDED_BY(mu) = 0;
  // Evictions not logged yet, and when the last were: one line per burst.
  uint64_t evicted_unlogged GUARDED_BY(mu) = 0;
  std::optional<std::chrono::steady_clock::time_point> eviction_logged GUARDED_BY(mu);
  bool stopped GUARDED_BY(mu) = false;
  // Handlers posted to run_blocking and not yet returned: dedupd's
  // shutdown waits for them (WaitForHandlers) before it closes the
  // exports a handler may be using.
  size_t running GUARDED_BY(mu) = 0;
  std::condition_variable idle;  // running reached 0 (with mu)
};

namespace {

int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One reply line. Strings from the volume (file names) are arbitrary
// bytes: invalid UTF-8 is replaced rather than failing the reply.
std::string ReplyLine(const json& reply) {
  return reply.dump(-1, ' ', false, json::error_handler_t::replace) + '\n';
}

std::string ErrorLine(const std::string& message) {
  return ReplyLine(json{{"error", message}});
}

bool IsBlank(const std::string& s) {
  for (char c : s) {
    if (!std::isspace(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

sockaddr_un UnixAddress(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  return a;
}

// True if a server accepts (or queues) connections on the socket `path`.
bool UnixSocketLive(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  sockaddr_un a = UnixAddress(path);
  bool live = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 || errno == EAGAIN;
  ::close(fd);
  return live;
}

}  // namespace

// One client. Everything below is touched only on strand_; the handler runs
// on a worker with a copy of the request and posts its reply line back.
//
// Requests are handled one at a time: while a handler runs or a reply is
// being written, the connection reads nothing more (a client that pipelines
// requests without reading replies stalls itself, not dedupd).
class ControlConnection : public std::enable_shared_from_this<ControlConnection> {
 public:
  ControlConnection(std::shared_ptr<ControlServer::Shared> shared, UnixSocket sock, uint64_t id)
      : shared_(std::move(shared)),
        sock_(std::move(sock)),
        strand_(asio::make_strand(sock_.get_executor())),
        id_(id) {}

  void Start() {
    asio::dispatch(strand_, [self = shared_from_this()] { self->Pump(); });
  }
  // Stop: close at once, whatever is in flight.
  void Close() {
    asio::dispatch(strand_, [self = shared_from_this()] { self->CloseNow(); });
  }

  // When the connection last received a request's bytes, finished a
  // reply or had a handler return; nullopt while a handler runs. Read from
  // the accept handler (any thread).
  std::optional<int64_t> LastActivityNs() const {
    if (handling_.load()) return std::nullopt;
    return last_activity_ns_.load();
  }
  // Closes it to make room for a new client: the accept handler chose it,
  // idle since `seen_activity_ns`, and took it out of the registry. If it
  // has woken up since (a request already on its way), it is kept and
  // registered again, one over the limit for a moment.
  void Evict(int64_t seen_activity_ns) {
    asio::dispatch(strand_, [self = shared_from_this(), seen_activity_ns] {
      if (self->closed_) return;
      std::shared_ptr<ControlServer::Shared> shared = self->shared_;
      // (A reply write blocked on a client that reads nothing is idle:
      // its last activity is the reply before.)
      if (self->busy_ || self->handling_ || self->last_activity_ns_ != seen_activity_ns) {
        MutexLock l(&shared->mu);
        if (!shared->stopped) {
          shared->conns[self->id_] = self;
          shared->evicted--;
          return;
        }
        // Stop has run and closed what it found registered: close it too.
      }
      uint64_t burst = 0, total = 0;
      {
        MutexLock l(&shared->mu);
        shared->evicted_unlogged++;
        const auto now = std::chrono::steady_clock::now();
        if (!shared->eviction_logged ||
            now - *shared->eviction_logged >= std::chrono::seconds(10)) {
          burst = shared->evicted_unlogged;
          total = shared->evicted;
          shared->evicted_unlogged = 0;
          shared->eviction_logged = now;
        }
      }
      if (burst > 0) {
        // One line per burst: a client opening connections in a loop and
        // leaving them idle must not flood the log.
        LOG(kWarning) << "control socket: closed " << burst << " idle connection(s) (the last, "
                      << self->id_ << ", idle for "
                      << (SteadyNowNs() - seen_activity_ns) / 1'000'000'000
                      << " s) to make room for new clients at --control-max-connections; " << total
                      << " since start";
      }
      self->CloseNow();
    });
  }

 private:
  // Handles the complete lines buffered, then reads more; closes once the
  // client is done (end of input) and every reply is out.
  void Pump() {
    while (!closed_ && !closing_ && !busy_ && !writing_) {
      size_t nl = inbuf_.find('\n');
      if (nl == std::string::npos) {
        if (inbuf_.size() > kControlMaxLine) {
          RejectLongLine();
          break;
        }
        if (eof_) {
          // Whatever partial line is left came from a client that went
          // away mid-line: dropped.
          closing_ = true;
          break;
        }
        ReadMore();
        return;
      }
      if (nl > kControlMaxLine) {
        RejectLongLine();
        break;
      }
      std::string line = inbuf_.substr(0, nl);
      inbuf_.erase(0, nl + 1);
      Dispatch(std::move(line));
    }
    MaybeFinish();
  }

  void ReadMore() {
    if (reading_ || closed_ || eof_) return;
    reading_ = true;
    sock_.async_read_some(
        asio::buffer(chunk_),
        asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec,
                                                                 size_t n) {
          self->reading_ = false;
          if (self->closed_) return;
          if (ec || n == 0) {
            self->eof_ = true;  // end of input or a broken connection: either way no more requests
          } else {
            self->inbuf_.append(self->chunk_.data(), n);
            self->last_activity_ns_ = SteadyNowNs();
          }
          self->Pump();
        }));
  }

  void RejectLongLine() {
    LOG(kWarning) << "control connection " << id_ << ": request line longer than "
                  << kControlMaxLine << " bytes; closing";
    inbuf_.clear();
    closing_ = true;
    Send(ErrorLine("request line longer than " + std::to_string(kControlMaxLine) + " bytes"));
  }

  void Dispatch(std::string line) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (IsBlank(line)) return;  // an interactive client's stray Enter
    json request;
    try {
      request = json::parse(line);
    } catch (const json::parse_error& e) {
      Send(ErrorLine("bad request: invalid JSON at byte " + std::to_string(e.byte)));
      return;
    }
    if (!request.is_object()) {
      Send(ErrorLine("bad request: not a JSON object"));
      return;
    }
    auto cmd = request.find("cmd");
    if (cmd == request.end() || !cmd->is_string()) {
      Send(ErrorLine("bad request: no \"cmd\" string"));
      return;
    }
    auto handler = shared_->handlers.find(cmd->get<std::string>());
    if (handler == shared_->handlers.end()) {
      Send(ErrorLine("unknown cmd '" + cmd->get<std::string>() + "'"));
      return;
    }
    bool stopped;
    {
      MutexLock l(&shared_->mu);
      stopped = shared_->stopped;
      if (!stopped) shared_->running++;
    }
    if (stopped) {
      // Stop ran (dedupd is shutting down): no handler starts now.
      closing_ = true;
      Send(ErrorLine("dedupd is stopping"));
      return;
    }
    busy_ = true;
    handling_ = true;
    shared_->run_blocking(
        [self = shared_from_this(), handler = &handler->second, request = std::move(request)] {
          std::string reply;
          try {
            Result<json> r = (*handler)(request);
            if (r.ok()) {
              reply = ReplyLine(r.value());
            } else {
              const Status& st = r.status();
              reply = ErrorLine(st.message().empty() ? std::string(st.CodeName()) : st.message());
            }
          } catch (const std::exception& e) {
            // A handler bug (a json type_error, say) must not take a worker
            // thread, and with it dedupd, down.
            reply = ErrorLine(std::string("internal error: ") + e.what());
          }
          {
            MutexLock l(&self->shared_->mu);
            if (--self->shared_->running == 0) self->shared_->idle.notify_all();
          }
          asio::post(self->strand_, [self, reply = std::move(reply)]() mutable {
            self->busy_ = false;
            self->last_activity_ns_ = SteadyNowNs();
            self->handling_ = false;
            self->Send(std::move(reply));
            self->Pump();
          });
        });
  }

  void Send(std::string line) {
    if (closed_) return;
    wq_.push_back(std::move(line));
    if (!writing_) WriteNext();
  }

  void WriteNext() {
    writing_ = true;
    asio::async_write(sock_, asio::buffer(wq_.front()),
                      asio::bind_executor(strand_, [self = shared_from_this()](
                                                       boost::system::error_code ec, size_t) {
                        self->writing_ = false;
                        if (self->closed_) return;
                        if (ec) {
                          self->CloseNow();  // the client is gone
                          return;
                        }
                        self->last_activity_ns_ = SteadyNowNs();
                        self->wq_.pop_front();
                        if (!self->wq_.empty()) {
                          self->WriteNext();
                        } else {
                          self->Pump();
                        }
                      }));
  }

  void MaybeFinish() {
    if (closing_ && !busy_ && !writing_ && wq_.empty()) CloseNow();
  }

  void CloseNow() {
    if (closed_) return;
    closed_ = true;
    boost::system::error_code ec;
    sock_.shutdown(asio::socket_base::shutdown_both, ec);
    sock_.close(ec);
    wq_.clear();
    MutexLock l(&shared_->mu);
    shared_->conns.erase(id_);
  }

  const std::shared_ptr<ControlServer::Shared> shared_;
  UnixSocket sock_;
  Strand strand_;
  const uint64_t id_;
  std::array<char, 16 * 1024> chunk_;
  std::string inbuf_;  // received, not yet handled
  std::deque<std::string> wq_;
  bool reading_ = false;
  bool eof_ = false;   // the client sends nothing more
  bool busy_ = false;  // a handler is running
  bool writing_ = false;
  bool closing_ = false;  // close once the replies are out
  bool closed_ = false;
  // Written on strand_, read by the accept handler (LastActivityNs): when
  // bytes last came, a reply was last written out or a handler last
  // returned, and whether one runs.
  std::atomic<int64_t> last_activity_ns_{SteadyNowNs()};
  std::atomic<bool> handling_{false};
};

// -------------------------------------------------------------------- server

ControlServer::ControlServer(asio::io_context& io, std::string path,
                             std::function<void(std::function<void()>)> run_blocking,
                             size_t max_connections, std::chrono::milliseconds idle_evict)
    : io_(io),
      path_(std::move(path)),
      max_connections_(std::max<size_t>(max_connections, 1)),
      idle_evict_(idle_evict),
      shared_(std::make_shared<Shared>()) {
  shared_->run_blocking = std::move(run_blocking);
}

ControlServer::~ControlServer() {
  Stop();
}

void ControlServer::Handle(const std::string& cmd, Handler h) {
  shared_->handlers[cmd] = std::move(h);
}

Status ControlServer::Listen() {
  if (path_.empty()) return Status::Invalid("no control socket path");
  if (path_.size() >= sizeof(sockaddr_un::sun_path)) {
    return Status::Invalid("control socket path too long (max " +
                           std::to_string(sizeof(sockaddr_un::sun_path) - 1) + " bytes): " + path_);
  }
  struct stat st {};
  if (::lstat(path_.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) return Status::Invalid(path_ + " exists and is not a socket");
    if (UnixSocketLive(path_)) return Status::Exists("another dedupd is using " + path_);
    // The socket of a dedupd that died without cleaning up.
    if (::unlink(path_.c_str()) != 0 && errno != ENOENT) {
      return Status::FromErrno("removing the stale socket " + path_, errno);
    }
  }
  std::filesystem::path parent = std::filesystem::path(path_).parent_path();
  if (!parent.empty()) {
    std::error_code fec;
    std::filesystem::create_directories(parent, fec);
    if (fec) return Status::IoError("creating " + parent.string() + ": " + fec.message());
  }

  boost::system::error_code ec;
  auto acceptor = std::make_unique<asio::local::stream_protocol::acceptor>(io_);
  asio::local::stream_protocol::endpoint ep(path_);
  acceptor->open(ep.protocol(), ec);
  if (!ec) acceptor->bind(ep, ec);
  if (ec == asio::error::address_in_use) {
    // Another dedupd bound it between our check and our bind.
    return Status::Exists("another dedupd is using " + path_);
  }
  if (!ec) acceptor->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Status::IoError("listening on " + path_ + ": " + ec.message());
  // Group access: operators in dedupd's group may run `dede status`.
  if (::chmod(path_.c_str(), 0660) != 0 || ::lstat(path_.c_str(), &st) != 0) {
    Status err = Status::FromErrno("setting the mode of " + path_, errno);
    ::unlink(path_.c_str());
    return err;
  }
  bound_ = true;
  bound_dev_ = st.st_dev;
  bound_ino_ = st.st_ino;
  acceptor_ = std::move(acceptor);
  return Status::Ok();
}

void ControlServer::Start() {
  if (acceptor_) Accept();
}

void ControlServer::Accept() {
  acceptor_->async_accept([this, shared = shared_](boost::system::error_code ec, UnixSocket sock) {
    if (ec == asio::error::operation_aborted) return;
    std::shared_ptr<ControlConnection> conn;
    std::shared_ptr<ControlConnection> evict;  // idle longest, closed for the newcomer
    int64_t evict_idle_ns = 0;
    int64_t evict_seen = 0;  // its last activity when chosen
    size_t full = 0;  // connections open, when that is the limit
    {
      MutexLock l(&shared->mu);
      // Stopped (maybe destroyed): `this` must not be touched.
      if (shared->stopped) return;
      if (!ec && shared->conns.size() >= max_connections_) {
        const int64_t now = SteadyNowNs();
        const int64_t min_idle =
            std::chrono::duration_cast<std::chrono::nanoseconds>(idle_evict_).count();
        uint64_t evict_id = 0;
        for (auto& [id, weak] : shared->conns) {
          std::shared_ptr<ControlConnection> c = weak.lock();
          if (!c) continue;
          const std::optional<int64_t> last = c->LastActivityNs();
          if (!last) continue;  // a handler runs for it
          const int64_t idle = now - *last;
          if (idle >= min_idle && idle > evict_idle_ns) {
            evict = std::move(c);
            evict_id = id;
            evict_idle_ns = idle;
            evict_seen = *last;
          }
        }
        if (evict) {
          // Its place is the newcomer's: counted out now, so that the
          // next accept does not pick it again before its close runs.
          shared->evicted++;
          shared->conns.erase(evict_id);
        } else {
          full = shared->conns.size();
          shared->refused++;
        }
      }
      if (!ec && full == 0) {
        uint64_t id = ++shared->next_id;
        conn = std::make_shared<ControlConnection>(shared, std::move(sock), id);
        shared->conns[id] = conn;
      }
    }
    if (evict) evict->Evict(evict_seen);
    if (conn) {
      conn->Start();
    } else if (full > 0) {
      Refuse(std::move(sock), full);
    } else {
      LOG(kWarning) << "control socket " << path_ << ": accept: " << ec.message();
    }
    Accept();
  });
}

void ControlServer::Refuse(UnixSocket sock, size_t open) {
  // Written without waiting, and the request left unread: a refused
  // client must cost no more than this (the line fits in an empty socket
  // buffer; ControlRequest reads it even when its own send failed).
  boost::system::error_code ec;
  sock.non_blocking(true, ec);
  const std::string line = ErrorLine(
      "too many control connections: dedupd serves at most " + std::to_string(max_connections_) +
      " at once (--control-max-connections); try again when one has closed");
  if (!ec) sock.write_some(asio::buffer(line), ec);
  sock.shutdown(asio::socket_base::shutdown_both, ec);
  sock.close(ec);
  // One line per burst, not per refusal: a client retrying in a loop must
  // not flood the log.
  refused_unlogged_++;
  const auto now = std::chrono::steady_clock::now();
  if (!refusal_logged_ || now - *refusal_logged_ >= std::chrono::seconds(10)) {
    LOG(kWarning) << "control socket " << path_ << ": refused " << refused_unlogged_
                  << " connection(s): " << open << " open, the most allowed"
                  << " (--control-max-connections); " << refused() << " refused since start";
    refused_unlogged_ = 0;
    refusal_logged_ = now;
  }
}

void ControlServer::Stop() {
  std::vector<std::shared_ptr<ControlConnection>> conns;
  {
    MutexLock l(&shared_->mu);
    shared_->stopped = true;
    for (auto& [id, weak] : shared_->conns) {
      if (auto c = weak.lock()) conns.push_back(std::move(c));
    }
  }
  if (acceptor_) {
    boost::system::error_code ec;
    acceptor_->close(ec);
  }
  for (auto& c : conns) c->Close();
  if (bound_) {
    bound_ = false;
    struct stat st {};
    if (::lstat(path_.c_str(), &st) == 0 && st.st_dev == bound_dev_ && st.st_ino == bound_ino_) {
      ::unlink(path_.c_str());
    }
  }
}

void ControlServer::WaitForHandlers() NO_THREAD_SAFETY_ANALYSIS {
  std::unique_lock<std::mutex> l(shared_->mu.native());
  shared_->idle.wait(l, [this]() NO_THREAD_SAFETY_ANALYSIS { return shared_->running == 0; });
}

size_t ControlServer::connections() const {
  MutexLock l(&shared_->mu);
  return shared_->conns.size();
}

uint64_t ControlServer::refused() const {
  MutexLock l(&shared_->mu);
  return shared_->refused;
}

uint64_t ControlServer::evicted() const {
  MutexLock l(&shared_->mu);
  return shared_->evicted;
}

// -------------------------------------------------------------------- client

namespace {

std::string TimeoutText(std::chrono::milliseconds t) {
  if (t.count() % 1000 == 0) return std::to_string(t.count() / 1000) + " s";
  return std::to_string(t.count()) + " ms";
}

// Waits until `fd` is ready for `events` or the deadline passes (false).
bool WaitFor(int fd, short events, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count() + 1, 60'000)));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return true;  // let the next call report the error
  }
}

// Replies are small; this only stops a confused peer from filling memory.
constexpr size_t kMaxReply = size_t{64} << 20;

}  // namespace

Result<json> ControlRequest(const std::string& path, const json& request,
                            std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (path.size() >= sizeof(sockaddr_un::sun_path)) {
    return Status::Invalid("control socket path too long (max " +
                           std::to_string(sizeof(sockaddr_un::sun_path) - 1) + " bytes): " + path);
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Status::FromErrno("creating a socket", errno);
  FdCloser guard(fd);

  sockaddr_un addr = UnixAddress(path);
  while (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN) {
      // The listen backlog is full: dedupd is there but behind; retry.
      if (std::chrono::steady_clock::now() >= deadline) {
        return Status::Unavailable("dedupd at " + path + " did not accept within " +
                                   TimeoutText(timeout));
      }
      ::usleep(10'000);
      continue;
    }
    if (err == ENOENT || err == ECONNREFUSED || err == ENOTDIR || err == ENOTSOCK) {
      return Status::NotFound("no dedupd at " + path + " (" + std::strerror(err) + ")");
    }
    return Status::IoError("cannot connect to dedupd at " + path + " (" + std::strerror(err) + ")");
  }

  const std::string out = request.dump(-1, ' ', false, json::error_handler_t::replace) + '\n';
  size_t sent = 0;
  // A server that refuses the connection (too many open) answers and
  // closes without reading: its answer, not the broken pipe, says why.
  Status send_failed;
  while (sent < out.size()) {
    ssize_t n = ::send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) {
      if (!WaitFor(fd, POLLOUT, deadline)) {
        return Status::Unavailable("dedupd at " + path + " did not take the request within " +
                                   TimeoutText(timeout));
      }
      continue;
    }
    const int err = errno;
    send_failed = Status::FromErrno("sending to dedupd at " + path, err);
    if (err == EPIPE || err == ECONNRESET) break;
    return send_failed;
  }

  std::string in;
  char buf[16 * 1024];
  size_t scanned = 0;
  for (;;) {
    size_t nl = in.find('\n', scanned);
    if (nl != std::string::npos) {
      in.resize(nl);
      break;
    }
    scanned = in.size();
    if (in.size() > kMaxReply)
      return Status::IoError("reply from dedupd at " + path + " is too long");
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n > 0) {
      in.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) {
      if (!send_failed.ok()) return send_failed;
      return Status::IoError("dedupd at " + path + " closed the connection without answering");
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN) {
      if (!WaitFor(fd, POLLIN, deadline)) {
        return Status::Unavailable("dedupd at " + path + " did not answer within " +
                                   TimeoutText(timeout));
      }
      continue;
    }
    if (!send_failed.ok()) return send_failed;
    return Status::FromErrno("reading from dedupd at " + path, errno);
  }
  json reply = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (reply.is_discarded())
    return Status::IoError("dedupd at " + path + " sent a reply that is not JSON");
  return reply;
}

}  // namespace dede
