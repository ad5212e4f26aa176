#include "agent/nbd_server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/local/stream_protocol.hpp>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>

#include "agent/tcp_peer_access.h"
#include "util/log.h"

namespace dede {

namespace asio = boost::asio;
using Socket = asio::generic::stream_protocol::socket;
using Strand = asio::strand<asio::io_context::executor_type>;

// Largest WRITE payload fingerprinted on arrival (see Execute).
constexpr size_t kHashOnArrivalMax = 256 * 1024;

// Payload bytes still to come above which the connection reads them
// directly into the request buffer instead of through its read buffer.
constexpr size_t kDirectPayloadMin = 16 * 1024;

// Bytes queued for the client: a header (greeting, option reply, simple
// reply header) and, for a READ, its data in a separate aligned buffer
// with its reservation in the host-wide budget.
struct OutMessage {
  std::vector<uint8_t> head;
  IoBytes data;
  NbdMemoryCharge charge;
};

// Every READ and WRITE waits for room in the host-wide budget.
nbd::SessionOptions Admitting(nbd::SessionOptions opts) {
  opts.admit_requests = true;
  return opts;
}

using Steady = std::chrono::steady_clock;

Steady::duration Seconds(double s) {
  return std::chrono::duration_cast<Steady::duration>(std::chrono::duration<double>(s));
}

// How often a stalled connection looks again whether anyone waits for the
// room it holds (it is closed only then).
constexpr Steady::duration kStallRecheck = std::chrono::seconds(1);

// How often a connection waiting for the budget, its client having sent
// more than it read, looks whether the client hung up.
constexpr Steady::duration kLineHangupPoll = std::chrono::milliseconds(200);

// One client connection. Every member below is touched only on strand_
// (handlers are bound to it), except what the worker lambdas capture by
// value; that is the whole locking story of this class.
class NbdConnection : public std::enable_shared_from_this<NbdConnection> {
 public:
  NbdConnection(NbdServer* server, Socket sock, uint64_t id)
      : server_(server),
        sock_(std::move(sock)),
        strand_(asio::make_strand(server->io_)),
        session_(Admitting(server->opts_.session)),
        id_(id) {
    rbuf_.resize(256 * 1024);
  }

  void Start() {
    asio::dispatch(strand_, [self = shared_from_this()] {
      self->SendSessionOutput();
      self->ArmHandshakeTimer();
      self->Pump();
    });
  }

  // Shutdown: stop taking requests, finish what is in flight, close. A
  // client that takes none of its replies for drain_timeout_s loses them.
  void Drain() {
    asio::dispatch(strand_, [self = shared_from_this()] {
      if (self->finished_) return;
      self->stop_reading_ = true;
      self->draining_ = true;
      self->ArmDrainTimer();
      self->MaybeFinish();
    });
  }

 private:
  // (Re)starts the drain deadline: re-armed whenever replies go out, so a
  // slow reader is not cut off, only one that stopped reading; and it
  // fires only at a client with replies waiting for it. A request that
  // simply runs longer (a long WRITE_ZEROES, a copy-on-write waiting for
  // another host's group, a slow FLUSH) used to lose its reply: the
  // deadline ran from the last reply written.
  void ArmDrainTimer(double seconds = -1) {
    if (seconds < 0) seconds = server_->opts_.drain_timeout_s;
    drain_timer_.expires_after(std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::duration<double>(seconds)));
    drain_timer_.async_wait(
        asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec) {
          if (ec || self->finished_) return;
          if (self->wq_.empty()) {
            // Nothing for the client to take: the requests are still
            // running (Send re-arms the deadline when a reply comes). The
            // timer stays armed all the same: it is what keeps the io
            // context running while they run on the workers (without it,
            // io.run() returned and dedupd stopped mid-request).
            self->ArmDrainTimer(std::max(self->server_->opts_.drain_timeout_s, 0.1));
            return;
          }
          LOG(kWarning) << "nbd connection " << self->id_ << ": client took no replies for "
                        << self->server_->opts_.drain_timeout_s << " s of shutdown; closing it";
          self->client_gone_ = true;
          boost::system::error_code ignored;
          self->sock_.cancel(ignored);
          self->MaybeFinish();
        }));
  }

  // Until the client enters an export: a connection that sends nothing
  // for handshake_timeout_s is closed (it holds one of max_connections,
  // and a local user could hold them all). Time spent waiting on our
  // side (an open waiting for its file, a listing) does not count.
  void ArmHandshakeTimer() {
    const double s = server_->opts_.handshake_timeout_s;
    if (s <= 0) return;
    handshake_progress_ = handshake_bytes_;
    handshake_timer_.expires_after(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(s)));
    handshake_timer_.async_wait(
        asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec) {
          if (ec || self->finished_ || self->stop_reading_ || self->export_) return;
          if (self->waiting_backend_ || self->handshake_bytes_ != self->handshake_progress_) {
            self->ArmHandshakeTimer();
            return;
          }
          self->server_->c_handshake_timeouts_++;
          LOG(kWarning) << "nbd connection " << self->id_ << ": closing: no handshake traffic for "
                        << self->server_->opts_.handshake_timeout_s << " s";
          self->stop_reading_ = true;
          self->client_gone_ = true;
          boost::system::error_code ignored;
          self->sock_.cancel(ignored);
          self->MaybeFinish();
        }));
  }

  // Requests executing plus replies queued, and their bytes.
  bool Backpressured() const {
    return inflight_ + wq_.size() >= server_->opts_.max_inflight_requests ||
           inflight_bytes_ + wq_bytes_ >= server_->opts_.max_inflight_bytes;
  }

  void SendSessionOutput() {
    if (session_.has_output()) Send(session_.TakeOutput());
  }

  // Feeds buffered bytes to the session until it needs more input, has to
  // wait for the backend, or back-pressure stops it; then reads more.
  void Pump() {
    // A reply to the session (list, export) may leave it with something to
    // say without any new input (EXPORT_NAME failure closes): feed it once
    // even when nothing is buffered. The same after a payload was read
    // straight into the request. The flag stays set until a Feed happens
    // (back-pressure may postpone it to the next completion).
    while (!finished_ && !stop_reading_ && !waiting_backend_ && !budget_wait_ && !Backpressured() &&
           (rstart_ < rend_ || recheck_session_)) {
      recheck_session_ = false;
      size_t consumed = 0;
      nbd::Action a = session_.Feed(rbuf_.data() + rstart_, rend_ - rstart_, &consumed);
      rstart_ += consumed;
      SendSessionOutput();
      switch (a) {
        case nbd::Action::kNeedInput:
          break;
        case nbd::Action::kListExports:
          ListExports();
          break;
        case nbd::Action::kOpenExport:
          OpenExport();
          break;
        case nbd::Action::kAdmit:
          ReserveForRequest();  // or wait (budget_wait_), reading nothing
          break;
        case nbd::Action::kRequest:
          Execute(session_.TakeRequest());
          break;
        case nbd::Action::kDisconnect:
          stop_reading_ = true;
          break;
        case nbd::Action::kClose:
          server_->c_protocol_errors_++;
          LOG(kWarning) << "nbd connection " << id_ << ": closing: " << session_.close_reason();
          stop_reading_ = true;
          break;
      }
    }
    if (rstart_ == rend_) rstart_ = rend_ = 0;
    if (stop_reading_) {
      MaybeFinish();
      return;
    }
    ReadMore();
  }

  void ReadMore() {
    if (read_pending_ || stop_reading_ || waiting_backend_ || budget_wait_ || Backpressured() ||
        finished_) {
      return;
    }
    if (rstart_ > 0) {
      std::memmove(rbuf_.data(), rbuf_.data() + rstart_, rend_ - rstart_);
      rend_ -= rstart_;
      rstart_ = 0;
    }
    if (rend_ == rbuf_.size()) return;  // the session consumes all it is fed
    if (rstart_ == rend_) {
      // Big WRITE payloads go from the socket straight into the request's
      // aligned buffer: one copy less.
      size_t space = 0;
      uint8_t* direct = session_.PayloadSpace(&space);
      if (direct != nullptr && space >= kDirectPayloadMin) {
        read_pending_ = true;
        sock_.async_read_some(
            asio::buffer(direct, space),
            asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec,
                                                                     size_t n) {
              if (!self->ReadCompleted(ec, n)) return;
              self->session_.PayloadFilled(n);
              self->recheck_session_ = true;
              self->Pump();
            }));
        return;
      }
    }
    read_pending_ = true;
    sock_.async_read_some(
        asio::buffer(rbuf_.data() + rend_, rbuf_.size() - rend_),
        asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec, size_t n) {
          if (!self->ReadCompleted(ec, n)) return;
          self->rend_ += n;
          if (!self->export_) self->handshake_bytes_ += n;
          self->Pump();
        }));
  }

  // Bookkeeping of a finished socket read. False when the read ended the
  // input (end of file or error): the client is gone, unless we asked for
  // that by shutting down our receive side.
  bool ReadCompleted(const boost::system::error_code& ec, size_t n) {
    read_pending_ = false;
    if (!ec && n > 0) {
      last_progress_ = Steady::now();
      return true;
    }
    if (!stop_reading_) client_gone_ = true;
    stop_reading_ = true;
    MaybeFinish();
    return false;
  }

  // The session holds a READ or WRITE header: reserve the bytes it will
  // hold before its payload is read or it runs. If they do not fit, the
  // connection reads nothing until the budget wakes it (BudgetReady).
  void ReserveForRequest() {
    const uint64_t n = session_.admit_bytes();
    std::weak_ptr<NbdConnection> weak = weak_from_this();
    auto wake = [weak] {
      if (auto self = weak.lock()) asio::post(self->strand_, [self] { self->BudgetReady(); });
    };
    if (!server_->budget_.TryReserve(this, n, std::move(wake))) {
      if (!budget_wait_) {
        budget_wait_ = true;
        // Reading nothing meanwhile, it would see its client leave only
        // once admitted, holding its place in line until then.
        CheckHangupInLine();
      }
      return;
    }
    budget_wait_ = false;
    StartHolding();
    admitted_ = NbdMemoryCharge(&server_->budget_, n);
    ArmStallTimer();
    session_.Admit();
    recheck_session_ = true;  // a READ is yielded with no more input
  }

  // In line for the budget, the connection reads nothing: a client that
  // left was seen only when admitted (its request then ran for no one) and
  // kept its place, everyone behind it waiting, until then. Looks now and,
  // while it waits, when the socket has news (WatchForHangup) or, once the
  // client sent more than was read (a wait for readability would then
  // complete at once, again and again), every kLineHangupPoll. A client
  // that hung up leaves the line, unless it sent more than the waiting
  // request's payload (a DISC, more requests): that is handled in order
  // when its turn comes, as before, its end of file seen after it. What
  // is dropped was never acknowledged: a READ whose reply no one would
  // take, a WRITE whose client left without its reply (its payload
  // incomplete, or complete with nothing after it, not even a DISC).
  void CheckHangupInLine() {
    if (!budget_wait_ || finished_ || stop_reading_) return;
    const int fd = sock_.native_handle();
    pollfd p{fd, POLLIN | POLLRDHUP, 0};
    if (::poll(&p, 1, 0) < 0 || (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0) {
      // Still there.
      if ((p.revents & POLLIN) == 0) {
        WatchForHangup();
        return;
      }
      line_timer_.expires_after(kLineHangupPoll);
      line_timer_.async_wait(
          asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec) {
            if (!ec) self->CheckHangupInLine();
          }));
      return;
    }
    int queued = 0;
    if (::ioctl(fd, FIONREAD, &queued) != 0 || queued < 0) queued = 0;
    const uint64_t unread = (rend_ - rstart_) + static_cast<uint64_t>(queued);
    if (unread > session_.admit_payload()) return;
    LOG(kInfo) << "nbd connection " << id_ << ": the client left while its "
               << (session_.admit_payload() > 0 ? "WRITE" : "READ") << " of "
               << session_.admit_bytes() << " bytes waited for room in --nbd-memory; "
               << "leaving the line";
    client_gone_ = true;
    stop_reading_ = true;
    MaybeFinish();  // withdraws: its place goes to the next
  }

  // Bytes of the budget this connection holds for its client: READ replies
  // waiting to be written, and the reservation of the READ or WRITE the
  // session holds (a WRITE's payload arriving). Not those of requests
  // executing: a slow device is not the client's stall.
  uint64_t ClientHeld() const { return wq_charged_ + admitted_.bytes(); }

  // Before the connection starts holding bytes for its client: the
  // client's time to take them (or send the payload) runs from now, not
  // from its last traffic (a READ that ran long must not have its reply
  // given up the moment it is ready).
  void StartHolding() {
    if (ClientHeld() == 0) last_progress_ = Steady::now();
  }

  // Stall watch (stall_timeout_s): armed while the connection holds bytes
  // for its client, at most one wait pending; it fires when the timeout
  // would have passed since the last byte moved.
  void ArmStallTimer() {
    const double s = server_->opts_.stall_timeout_s;
    if (s <= 0 || stall_armed_ || finished_ || ClientHeld() == 0) return;
    WaitForStall(last_progress_ + Seconds(s));
  }

  void WaitForStall(Steady::time_point when) {
    stall_armed_ = true;
    stall_timer_.expires_at(when);
    stall_timer_.async_wait(
        asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec) {
          self->stall_armed_ = false;
          if (ec || self->finished_) return;
          self->CheckStall();
        }));
  }

  // A connection that holds bytes for its client and moved none for
  // stall_timeout_s is closed if someone else waits for room; while no
  // one does, it harms no one (its own limits bound it) and is looked at
  // again every second.
  void CheckStall() {
    if (client_gone_) return;
    const uint64_t held = ClientHeld();
    if (held == 0) return;  // armed again when it holds some
    const Steady::duration timeout = Seconds(server_->opts_.stall_timeout_s);
    const Steady::time_point now = Steady::now();
    if (now - last_progress_ < timeout) {
      WaitForStall(last_progress_ + timeout);
      return;
    }
    if (!server_->budget_.OthersWaiting(this)) {
      WaitForStall(now + std::min(timeout, kStallRecheck));
      return;
    }
    server_->c_stall_closes_++;
    LOG(kWarning) << "nbd connection " << id_ << " (" << PeerText()
                  << (export_ ? ", export '" + export_->name() + "'" : std::string())
                  << "): closing: it holds " << held << " bytes of --nbd-memory for its client ("
                  << wq_charged_ << " of READ replies not taken, " << admitted_.bytes()
                  << " for a WRITE payload not sent) and sent or received nothing for "
                  << std::chrono::duration<double>(now - last_progress_).count()
                  << " s while other connections wait for room (--nbd-stall-timeout); its "
                  << "unanswered requests were never acknowledged";
    stop_reading_ = true;
    client_gone_ = true;
    // A WRITE payload that will never complete gives its room back now,
    // not when this connection's requests still executing finish (its
    // unsent replies go when the cancelled send ends).
    admitted_.Reset();
    boost::system::error_code ignored;
    sock_.cancel(ignored);
    MaybeFinish();
  }

  // Who the client is, for the log: its process on the Unix socket, its
  // port on TCP.
  std::string PeerText() {
    const int fd = sock_.native_handle();
    sockaddr_storage peer{};
    socklen_t len = sizeof(peer);
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) == 0 &&
        peer.ss_family == AF_INET) {
      return "client 127.0.0.1:" +
             std::to_string(ntohs(reinterpret_cast<const sockaddr_in*>(&peer)->sin_port));
    }
    ucred cred{};
    len = sizeof(cred);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) {
      return "client unknown";
    }
    std::string comm;
    std::ifstream in("/proc/" + std::to_string(cred.pid) + "/comm");
    std::getline(in, comm);
    return "client pid " + std::to_string(cred.pid) + (comm.empty() ? "" : " (" + comm + ")") +
           ", uid " + std::to_string(cred.uid);
  }

  void BudgetReady() {
    if (!budget_wait_) return;
    if (stop_reading_ || finished_) {
      // Closing: its place in line goes to the next.
      server_->budget_.Withdraw(this);
      budget_wait_ = false;
      MaybeFinish();
      return;
    }
    // Straight away, not through Pump: per-connection back-pressure may
    // hold Pump back, and the first in line that does not ask holds up
    // every connection behind it.
    ReserveForRequest();
    if (!budget_wait_) Pump();
  }

  void ListExports() {
    waiting_backend_ = true;
    ExportTable* table = server_->table_;
    server_->RunBlocking([self = shared_from_this(), table] {
      auto names = table->List();
      asio::post(self->strand_, [self, names = std::move(names)]() mutable {
        self->waiting_backend_ = false;
        if (names.ok()) {
          self->session_.ReplyList(*names);
        } else {
          // An error, not an empty list: a client must not conclude the
          // volume has no disks.
          self->session_.ReplyListError("listing the volume's files failed: " +
                                        names.status().message());
          LOG(kWarning) << "listing exports: " << names.status().ToString();
        }
        self->SendSessionOutput();
        self->recheck_session_ = true;
        self->Pump();
      });
    });
  }

  void OpenExport() {
    waiting_backend_ = true;
    if (session_.info_only()) {
      DescribeExport();
      return;
    }
    WatchForHangup();
    TryOpen(std::make_shared<ExportTable::OpenWait>(server_->table_, session_.export_name(),
                                                    server_->opts_.open_wait_s));
  }

  // While an open is under way no read is issued (the client waits for
  // GO's reply), so a client that left then went unseen until the open
  // ended: its disk was opened, its lock taken, for no one (a VM started
  // elsewhere meanwhile found it "in use"), and another host's pass had
  // been asked to give the disk back for nothing. Watch the socket for
  // the hangup; bytes sent meanwhile (a pipelining client) end the watch.
  // The same watch serves a wait for the memory budget (CheckHangupInLine).
  void WatchForHangup() {
    if (watching_ || finished_ || stop_reading_) return;
    watching_ = true;
    sock_.async_wait(
        Socket::wait_read,
        asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec) {
          self->watching_ = false;
          if (ec || self->finished_ || self->stop_reading_) return;
          if (self->budget_wait_) {
            self->CheckHangupInLine();
            return;
          }
          if (!self->waiting_backend_) return;
          uint8_t b;
          const ssize_t n = ::recv(self->sock_.native_handle(), &b, 1, MSG_PEEK | MSG_DONTWAIT);
          if (n > 0) return;
          if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            self->WatchForHangup();
            return;
          }
          // End of file or a socket error: gone. A waiting open stops at
          // its next retry (AbandonOpenIfGone); one running finishes, and
          // MaybeFinish gives the export back.
          self->client_gone_ = true;
          self->stop_reading_ = true;
          self->MaybeFinish();
        }));
  }

  // What GO and INFO tell a client about an export.
  static nbd::ExportInfo InfoOf(const std::string& name, uint64_t size) {
    nbd::ExportInfo info;
    info.size = size;
    info.description = "dede volume file '" + name + "'";
    return info;
  }

  // NBD_OPT_INFO: the export's size without entering it. Opening the file
  // for it (as GO does) took its lock, waited up to --open-wait when
  // another host's VM held it, and closed it again with a volume sync:
  // `nbdinfo --list` paid that for every disk.
  void DescribeExport() {
    ExportTable* table = server_->table_;
    const std::string name = session_.export_name();
    server_->RunBlocking([self = shared_from_this(), table, name] {
      Result<uint64_t> size = table->Describe(name);
      asio::post(self->strand_, [self, size, name] {
        self->waiting_backend_ = false;
        if (size.ok()) {
          self->session_.ReplyExport(InfoOf(name, size.value()));
        } else {
          // Not available (ERR_SHUTDOWN would end the client's whole
          // session, a listing of every disk with it).
          LOG(kInfo) << "nbd connection " << self->id_ << ": " << size.status().message();
          self->session_.ReplyExportError(nbd::kRepErrUnknown, size.status().message());
        }
        self->SendSessionOutput();
        self->recheck_session_ = true;
        self->Pump();
      });
    });
  }

  // One attempt to enter the export, on the open pool: an open can wait
  // long for its file's lock (with sanlock, for a dead host's lease), and
  // must not do so on a worker, which every disk's I/O needs. A refusal
  // that may clear (the file held elsewhere for a moment) is tried again
  // after a timer on the strand, holding no thread meanwhile.
  void TryOpen(std::shared_ptr<ExportTable::OpenWait> wait) {
    ExportTable* table = server_->table_;
    const std::string name = session_.export_name();
    server_->RunOpen([self = shared_from_this(), table, wait, name] {
      Result<std::shared_ptr<Export>> e = wait->Step();
      if (wait->retry()) {
        asio::post(self->strand_, [self, wait] {
          if (self->AbandonOpenIfGone(wait)) return;
          self->open_timer_.expires_after(ExportTable::OpenWait::kRetryInterval);
          self->open_timer_.async_wait(
              asio::bind_executor(self->strand_, [self, wait](boost::system::error_code) {
                // The client may have left (or dedupd begun to stop)
                // during the pause: then the file is not opened for no one.
                if (self->AbandonOpenIfGone(wait)) return;
                self->TryOpen(wait);
              }));
        });
        return;
      }
      const nbd::ExportInfo info = e.ok() ? InfoOf(name, (*e)->size()) : nbd::ExportInfo{};
      asio::post(self->strand_, [self, e = std::move(e), info, table]() mutable {
        self->waiting_backend_ = false;
        if (!e.ok()) {
          // ERR_SHUTDOWN only when dedupd is stopping (it ends the
          // client's whole session); a file that is missing, held
          // elsewhere or failed to open (an I/O error, the message says)
          // is an export not available.
          const uint32_t rep =
              e.status().code() == Status::Code::kUnavailable && self->server_->stopping()
                  ? nbd::kRepErrShutdown
                  : nbd::kRepErrUnknown;
          LOG(kInfo) << "nbd connection " << self->id_ << ": " << e.status().message();
          self->session_.ReplyExportError(rep, e.status().message());
        } else {
          self->session_.ReplyExport(info);
          if (self->finished_) {
            // The client left while we opened: give it back (volume I/O,
            // so not on this thread).
            self->server_->RunBlocking([table, ex = *e] { table->Release(ex); });
          } else {
            self->export_ = *e;
          }
        }
        self->SendSessionOutput();
        self->recheck_session_ = true;
        self->Pump();
      });
    });
  }

  // On the strand, between attempts of a waiting open: true (and the wait
  // withdrawn) if no one is waiting for it any more (the client left, or
  // dedupd stops).
  bool AbandonOpenIfGone(const std::shared_ptr<ExportTable::OpenWait>& wait) {
    if (!stop_reading_) return false;
    LOG(kInfo) << "nbd connection " << id_ << ": "
               << (client_gone_ ? "the client left" : "stopping") << " while export '"
               << session_.export_name() << "' waited to open: not opening it";
    server_->RunOpen([self = shared_from_this(), wait] {
      wait->Abandon();
      asio::post(self->strand_, [self] {
        self->waiting_backend_ = false;
        self->MaybeFinish();
      });
    });
    return true;
  }

  void Execute(nbd::Request req) {
    if (!export_) return;  // the session only yields requests after GO
    inflight_++;
    // Only READ and WRITE hold data in memory (a payload, a reply). A TRIM
    // or WRITE_ZEROES of a gigabyte (qemu sends discards past the 32 MiB
    // block maximum) counted its length, stopped this connection reading
    // and put every request behind it.
    const uint64_t held_bytes =
        req.type == nbd::kCmdRead || req.type == nbd::kCmdWrite ? req.length : 0;
    inflight_bytes_ += held_bytes;
    server_->c_requests_++;
    // A WRITE's payload is hashed here, as it arrives: it is in this
    // CPU's cache now, and may not be by the time a worker has written it
    // (other requests' payloads pass through the cache meanwhile). The
    // monitor records the fingerprints after the device write, in order.
    // Only payloads up to kHashOnArrivalMax: this thread serves every
    // connection, and a bigger payload would hold them all up for longer
    // (a 32 MiB WRITE, ~1 ms) and its hash would sit on the client's
    // latency path (at QD1, 1 MiB costs ~5% of the request); a big
    // payload fills the cache itself, so it gains little here anyway.
    std::vector<Fingerprint> fps;
    if (req.type == nbd::kCmdWrite && req.payload.size() <= kHashOnArrivalMax &&
        export_->fingerprints_writes()) {
      fps = export_->FingerprintWrite(req.offset, req.payload.data(), req.payload.size());
    }
    // The request's reservation (none for FLUSH, TRIM, WRITE_ZEROES) goes
    // with it: a WRITE's until its payload is freed, a READ's until its
    // reply is written.
    const bool long_effect = (req.type == nbd::kCmdTrim || req.type == nbd::kCmdWriteZeroes) &&
                             req.length > NbdServer::kLongEffectBytes;
    auto job = [self = shared_from_this(), e = export_, req = std::move(req), held_bytes,
                fps = std::move(fps), charge = std::move(admitted_)]() mutable {
      IoBytes data;  // READ reply data, aligned so O_DIRECT needs no bounce
      bool replied = false;
      // Posts the reply to the connection's strand (once).
      auto reply = [&](const Status& st) {
        if (replied) return;
        replied = true;
        uint32_t err = st.ok() ? 0 : NbdErrorFor(st);
        if (!st.ok()) {
          LOG(kWarning) << "export '" << e->name() << "': command " << req.type << " at "
                        << req.offset << "+" << req.length << ": " << st.ToString();
          data = IoBytes();
        }
        OutMessage out{
            nbd::EncodeSimpleReplyHeader(req.cookie, err), std::move(data),
            req.type == nbd::kCmdRead && err == 0 ? std::move(charge) : NbdMemoryCharge()};
        asio::post(self->strand_, [self, out = std::move(out), len = req.length, type = req.type,
                                   held_bytes, err]() mutable {
          self->inflight_--;
          self->inflight_bytes_ -= held_bytes;
          if (err) self->server_->c_request_errors_++;
          if (type == nbd::kCmdRead && !err) self->server_->c_bytes_read_ += len;
          if (type == nbd::kCmdWrite && !err) self->server_->c_bytes_written_ += len;
          self->Send(std::move(out));
          self->Pump();
        });
      };
      Status st;
      bool fua = req.flags & nbd::kCmdFlagFua;
      switch (req.type) {
        case nbd::kCmdRead:
          st = e->Read(req.offset, req.length, &data);
          break;
        case nbd::kCmdWrite:
          // Answered as early as Export::Write allows; the write monitor
          // records it afterwards (still on this worker).
          st = e->Write(req.offset, req.payload.data(), req.payload.size(), fua, reply,
                        fps.empty() ? nullptr : &fps);
          break;
        case nbd::kCmdFlush:
          st = e->Flush();
          break;
        case nbd::kCmdTrim:
          st = e->Trim(req.offset, req.length, fua);
          break;
        case nbd::kCmdWriteZeroes:
          st = e->WriteZeroes(req.offset, req.length, fua, req.flags & nbd::kCmdFlagNoHole);
          break;
        default:
          st = Status::Invalid("unexpected command");
      }
      reply(st);
      // The payload buffer goes back to the pool here, on the worker.
      req.payload = IoBytes();
      charge.Reset();
      // While the reply crosses the socket, a sequential reader's next
      // request may be read ahead on this worker (read_ahead.h).
      if (req.type == nbd::kCmdRead && st.ok()) e->ReadAheadAfter(req.offset, req.length);
    };
    if (long_effect) {
      server_->RunLong(std::move(job));
    } else {
      server_->RunBlocking(std::move(job));
    }
  }

  void Send(std::vector<uint8_t> bytes) {
    if (bytes.empty()) return;
    Send(OutMessage{std::move(bytes), IoBytes()});
  }
  void Send(OutMessage m) {
    if (client_gone_) return;
    // The client's time to take replies runs from when one is waiting.
    if (draining_ && !finished_ && wq_.empty()) ArmDrainTimer();
    wq_bytes_ += m.head.size() + m.data.size();
    const uint64_t charged = m.charge.bytes();
    if (charged > 0) StartHolding();
    wq_charged_ += charged;
    wq_.push_back(std::move(m));
    ArmStallTimer();
    if (!writing_) WriteNext();
  }

  void WriteNext() {
    writing_ = true;
    // Gather every queued reply into one write.
    std::vector<asio::const_buffer> bufs;
    size_t n = std::min<size_t>(wq_.size(), 64);
    for (size_t i = 0; i < n; ++i) {
      bufs.push_back(asio::buffer(wq_[i].head));
      if (!wq_[i].data.empty()) bufs.push_back(asio::buffer(wq_[i].data));
    }
    // The completion condition runs between the socket writes a gathered
    // write is made of (on the strand, like the handler): while draining,
    // any progress restarts the deadline, so a client reading slowly is
    // not cut off in the middle of a big batch. 64 KiB per write, asio's
    // default (transfer_all).
    auto progress = [self = shared_from_this()](const boost::system::error_code& ec,
                                                size_t written) -> size_t {
      if (ec) return 0;
      if (written > 0) self->last_progress_ = Steady::now();
      if (self->draining_ && !self->finished_) self->ArmDrainTimer();
      return 65536;
    };
    asio::async_write(
        sock_, bufs, progress,
        asio::bind_executor(strand_, [self = shared_from_this(), n](boost::system::error_code ec, size_t) {
          self->writing_ = false;
          if (ec) {
            self->client_gone_ = true;
            self->stop_reading_ = true;
            self->wq_.clear();
            self->wq_bytes_ = 0;
            self->wq_charged_ = 0;
            self->MaybeFinish();
            return;
          }
          self->last_progress_ = Steady::now();
          if (self->draining_) self->ArmDrainTimer();  // the client is reading
          const bool was_backpressured = self->Backpressured();
          for (size_t i = 0; i < n; i++) {
            self->wq_bytes_ -= self->wq_[i].head.size() + self->wq_[i].data.size();
            self->wq_charged_ -= self->wq_[i].charge.bytes();
          }
          self->wq_.erase(self->wq_.begin(), self->wq_.begin() + n);
          if (!self->wq_.empty()) self->WriteNext();
          if (was_backpressured && !self->Backpressured()) {
            self->Pump();  // reads again (or finishes, when stopped)
          } else if (self->wq_.empty()) {
            self->MaybeFinish();
          }
        }));
  }

  // Closes once nothing is in flight and (unless the client is gone) every
  // reply has been written.
  void MaybeFinish() {
    if (finished_ || !stop_reading_) return;
    if (budget_wait_) {
      server_->budget_.Withdraw(this);
      budget_wait_ = false;
    }
    if (read_pending_) {
      // We stopped reading (DISC, protocol error, drain): end the pending
      // read with end-of-file; its handler comes back here.
      boost::system::error_code ec;
      sock_.shutdown(asio::socket_base::shutdown_receive, ec);
      return;
    }
    if (inflight_ > 0 || waiting_backend_) return;
    if (writing_ && !client_gone_) return;
    finished_ = true;
    admitted_.Reset();  // a WRITE payload that will not be completed
    boost::system::error_code ec;
    drain_timer_.cancel();
    handshake_timer_.cancel();
    stall_timer_.cancel();
    line_timer_.cancel();
    sock_.shutdown(asio::socket_base::shutdown_both, ec);
    sock_.close(ec);
    if (export_) {
      ExportTable* table = server_->table_;
      server_->RunBlocking([table, e = std::move(export_)] { table->Release(e); });
      export_.reset();
    }
    server_->Finished(this);
  }

  NbdServer* server_;
  Socket sock_;
  Strand strand_;
  nbd::NbdSession session_;
  const uint64_t id_;
  std::vector<uint8_t> rbuf_;
  size_t rstart_ = 0, rend_ = 0;
  bool read_pending_ = false;
  bool waiting_backend_ = false;
  bool watching_ = false;  // WatchForHangup's wait is pending
  bool recheck_session_ = false;
  bool budget_wait_ = false;  // in line for the host-wide memory budget
  // The budget's reservation for the READ or WRITE the session holds
  // (admitted, its payload arriving or it about to be yielded).
  NbdMemoryCharge admitted_;
  bool stop_reading_ = false;
  bool client_gone_ = false;
  bool writing_ = false;
  bool finished_ = false;
  bool draining_ = false;  // Drain() ran: the drain deadline is armed
  std::deque<OutMessage> wq_;
  size_t wq_bytes_ = 0;  // of wq_'s messages, heads and data
  uint64_t wq_charged_ = 0;  // of wq_'s messages, their reservations (READ data)
  // When a byte was last sent to or received from the client, or (when it
  // began to hold budget bytes for it) StartHolding ran.
  Steady::time_point last_progress_ = Steady::now();
  bool stall_armed_ = false;  // stall_timer_'s wait is pending
  asio::steady_timer stall_timer_{strand_};
  asio::steady_timer line_timer_{strand_};  // CheckHangupInLine's next look
  asio::steady_timer drain_timer_{strand_};
  asio::steady_timer open_timer_{strand_};  // a waiting open's next attempt
  asio::steady_timer handshake_timer_{strand_};
  uint64_t handshake_bytes_ = 0;     // read before an export was entered
  uint64_t handshake_progress_ = 0;  // handshake_bytes_ when the timer was armed
  std::shared_ptr<Export> export_;
  size_t inflight_ = 0;
  size_t inflight_bytes_ = 0;
};

// -------------------------------------------------------------------- budget

bool NbdMemoryBudget::TryReserve(const void* who, uint64_t bytes, std::function<void()> wake) {
  std::function<void()> next;
  {
    MutexLock l(&mu_);
    const bool first = !waiters_.empty() && waiters_.front().who == who;
    if ((waiters_.empty() || first) && Fits(bytes)) {
      used_ += bytes;
      peak_ = std::max(peak_, used_);
      if (first) {
        waiters_.pop_front();
        // One release may make room for several: the next in line asks too.
        next = WakeHead();
      }
    } else {
      auto it = std::find_if(waiters_.begin(), waiters_.end(),
                             [who](const Waiter& w) { return w.who == who; });
      if (it == waiters_.end()) {
        waits_++;
        waiters_.push_back(Waiter{who, bytes, std::move(wake), false});
      } else {
        it->bytes = bytes;
        it->wake = std::move(wake);
        it->woken = false;
      }
      return false;
    }
  }
  if (next) next();
  return true;
}

void NbdMemoryBudget::Release(uint64_t bytes) {
  std::function<void()> wake;
  {
    MutexLock l(&mu_);
    used_ -= std::min(used_, bytes);
    wake = WakeHead();
  }
  if (wake) wake();
}

void NbdMemoryBudget::Withdraw(const void* who) {
  std::function<void()> wake;
  {
    MutexLock l(&mu_);
    auto it = std::find_if(waiters_.begin(), waiters_.end(),
                           [who](const Waiter& w) { return w.who == who; });
    if (it == waiters_.end()) return;
    waiters_.erase(it);
    // The one behind may fit where the one withdrawn did not.
    wake = WakeHead();
  }
  if (wake) wake();
}

bool NbdMemoryBudget::OthersWaiting(const void* who) {
  MutexLock l(&mu_);
  return std::any_of(waiters_.begin(), waiters_.end(),
                     [who](const Waiter& w) { return w.who != who; });
}

std::function<void()> NbdMemoryBudget::WakeHead() {
  if (waiters_.empty()) return nullptr;
  Waiter& w = waiters_.front();
  if (w.woken || !Fits(w.bytes)) return nullptr;
  w.woken = true;
  return w.wake;
}

NbdMemoryBudget::Stats NbdMemoryBudget::stats() {
  MutexLock l(&mu_);
  return Stats{limit_, used_, peak_, waiters_.size(), waits_};
}

// -------------------------------------------------------------------- server

NbdServer::NbdServer(asio::io_context& io, ExportTable* table, const NbdServerOptions& opts)
    : io_(io),
      table_(table),
      opts_(opts),
      pool_(std::max<size_t>(1, opts.worker_threads)),
      long_pool_(LongThreads(opts.worker_threads)),
      unix_retry_(io),
      tcp_retry_(io),
      budget_(opts.memory_budget) {}

NbdServer::~NbdServer() {
  pool_.join();
  long_pool_.join();
  open_pool_.join();
  admission_pool_.join();
  if (!opts_.unix_socket.empty() && unix_acceptor_) ::unlink(opts_.unix_socket.c_str());
}

namespace {
// True if something accepts connections on the Unix socket `path`.
bool UnixSocketLive(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  bool live = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return live;
}
}  // namespace

Status NbdServer::Listen() {
  boost::system::error_code ec;
  if (!opts_.unix_socket.empty()) {
    const std::string& path = opts_.unix_socket;
    if (path.size() >= sizeof(sockaddr_un::sun_path)) {
      return Status::Invalid("socket path too long (max " +
                             std::to_string(sizeof(sockaddr_un::sun_path) - 1) + " bytes): " + path);
    }
    struct stat st;
    if (::stat(path.c_str(), &st) == 0) {
      if (!S_ISSOCK(st.st_mode)) return Status::Invalid(path + " exists and is not a socket");
      if (UnixSocketLive(path)) return Status::Exists("another server is listening on " + path);
      ::unlink(path.c_str());  // stale socket of a dead dedupd
    }
    asio::generic::stream_protocol::endpoint ep{asio::local::stream_protocol::endpoint(path)};
    auto acc = std::make_unique<Acceptor>(io_);
    acc->open(ep.protocol(), ec);
    if (!ec) acc->bind(ep, ec);
    if (!ec) acc->listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return Status::IoError("listening on " + path + ": " + ec.message());
    ::chmod(path.c_str(), 0660);
    unix_acceptor_ = std::move(acc);
  }
  access_uid_ = ::geteuid();
  access_gid_ = ::getegid();
  if (struct stat st; unix_acceptor_ && ::stat(opts_.unix_socket.c_str(), &st) == 0) {
    // Its group may be the directory's (a setgid /run/dede).
    access_uid_ = st.st_uid;
    access_gid_ = st.st_gid;
  }
  if (opts_.tcp_port >= 0) {
    // Loopback only: NBD has no authentication here. Each client's user
    // is checked (AdmitIfPermitted), which needs the kernel's sock_diag.
    RETURN_IF_ERROR(CheckSockDiag());
    asio::ip::tcp::endpoint tep(asio::ip::address_v4::loopback(), static_cast<uint16_t>(opts_.tcp_port));
    asio::generic::stream_protocol::endpoint ep{tep};
    auto acc = std::make_unique<Acceptor>(io_);
    acc->open(ep.protocol(), ec);
    if (!ec) acc->set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acc->bind(ep, ec);
    if (!ec) acc->listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return Status::IoError("listening on 127.0.0.1:" + std::to_string(opts_.tcp_port) + ": " + ec.message());
    sockaddr_in sa{};
    socklen_t len = sizeof(sa);
    ::getsockname(acc->native_handle(), reinterpret_cast<sockaddr*>(&sa), &len);
    tcp_port_ = ntohs(sa.sin_port);
    tcp_acceptor_ = std::move(acc);
  }
  if (!unix_acceptor_ && !tcp_acceptor_) return Status::Invalid("no socket to listen on");
  return Status::Ok();
}

void NbdServer::Start() {
  if (unix_acceptor_) Accept(unix_acceptor_.get());
  if (tcp_acceptor_) Accept(tcp_acceptor_.get());
}

void NbdServer::Accept(Acceptor* acceptor) {
  acceptor->async_accept([this, acceptor](boost::system::error_code ec, Socket sock) {
    if (ec == asio::error::operation_aborted) return;
    {
      MutexLock l(&mu_);
      if (shutting_down_) return;
    }
    if (!ec) {
      const bool tcp = acceptor == tcp_acceptor_.get();
      size_t open_now;
      bool checks_full;
      {
        MutexLock l(&mu_);
        open_now = conns_.size() + (tcp ? admitting_ : 0);
        checks_full = tcp && admitting_ >= kMaxAdmitting;
      }
      if (open_now >= opts_.max_connections || checks_full) {
        c_refused_++;
        if (WarningDue(&last_refusal_warning_)) {
          if (checks_full) {
            LOG(kWarning) << "refusing NBD connections on 127.0.0.1: " << kMaxAdmitting
                          << " are waiting for their user check; " << c_refused_.load()
                          << " refused so far";
          } else {
            LOG(kWarning) << "refusing NBD connections: " << open_now
                          << " are open, the most allowed (--max-connections); "
                          << c_refused_.load() << " refused so far";
          }
        }
        boost::system::error_code ignored;
        sock.close(ignored);
        Accept(acceptor);
        return;
      }
      if (tcp) {
        AdmitIfPermitted(std::move(sock));
      } else {
        Admit(std::move(sock));
      }
      Accept(acceptor);
      return;
    }
    const bool out_of_resources = ec == asio::error::no_descriptors ||
                                  ec == boost::system::errc::too_many_files_open_in_system ||
                                  ec == asio::error::no_buffer_space ||
                                  ec == asio::error::no_memory;
    if (WarningDue(&last_accept_error_warning_)) {
      LOG(kWarning) << "accepting an NBD connection: " << ec.message()
                    << (out_of_resources ? " (retrying every 100 ms)" : "");
    }
    if (out_of_resources) {
      AcceptLater(acceptor);
    } else {
      Accept(acceptor);
    }
  });
}

void NbdServer::Admit(Socket sock) {
  {
    MutexLock l(&mu_);
    if (shutting_down_) return;  // the socket closes with `sock`
  }
  // The error_code form: the throwing one would end dedupd if the socket
  // failed (getsockname) between the accept and here.
  boost::system::error_code ec;
  const auto local = sock.local_endpoint(ec);
  if (!ec && local.protocol().family() == AF_INET) {
    int one = 1;
    ::setsockopt(sock.native_handle(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  uint64_t id = ++c_total_;
  auto c = std::make_shared<NbdConnection>(this, std::move(sock), id);
  {
    MutexLock l(&mu_);
    conns_.insert(c);
  }
  LOG(kDebug) << "nbd connection " << id << " accepted";
  c->Start();
}

void NbdServer::AdmitIfPermitted(Socket sock) {
  {
    MutexLock l(&mu_);
    admitting_++;
  }
  asio::post(admission_pool_, [this, sock = std::move(sock)]() mutable {
    Status why_not = CheckTcpClient(sock);
    asio::post(io_, [this, why_not = std::move(why_not), sock = std::move(sock)]() mutable {
      {
        MutexLock l(&mu_);
        admitting_--;
      }
      if (why_not.ok()) {
        Admit(std::move(sock));
        return;
      }
      c_denied_++;
      if (WarningDue(&last_denial_warning_)) {
        LOG(kWarning) << "refusing an NBD connection on 127.0.0.1:" << tcp_port_ << ": "
                      << why_not.message() << "; the port admits the users the Unix socket does "
                      << "(root, uid " << access_uid_ << ", members of gid " << access_gid_ << "); "
                      << c_denied_.load() << " refused so far";
      }
    });
  });
}

Status NbdServer::CheckTcpClient(Socket& sock) const {
  sockaddr_in ours{}, theirs{};
  socklen_t ours_len = sizeof(ours), theirs_len = sizeof(theirs);
  const int fd = sock.native_handle();
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ours), &ours_len) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&theirs), &theirs_len) != 0) {
    return Status::FromErrno("the connection's addresses", errno);
  }
  const std::string from = "from port " + std::to_string(ntohs(theirs.sin_port));
  Result<TcpSocketOwner> owner = LookupTcpSocketOwner(theirs, ours);
  if (!owner.ok())
    return Status::Invalid(from + ": cannot tell its user: " + owner.status().message());
  if (!owner->held) return Status::Invalid(from + ": its socket is already closed");
  if (!UserMayUseSocket(owner->uid, access_uid_, access_gid_)) {
    return Status::Invalid(from + ": uid " + std::to_string(owner->uid) +
                           " may not use the Unix socket");
  }
  return Status::Ok();
}

void NbdServer::AcceptLater(Acceptor* acceptor) {
  // The acceptor's own timer, made with the server: nothing is allocated
  // here, where the process is short of descriptors or memory.
  asio::steady_timer& timer = acceptor == unix_acceptor_.get() ? unix_retry_ : tcp_retry_;
  timer.expires_after(std::chrono::milliseconds(100));
  timer.async_wait([this, acceptor](boost::system::error_code ec) {
    if (ec == asio::error::operation_aborted) return;
    {
      MutexLock l(&mu_);
      if (shutting_down_) return;
    }
    Accept(acceptor);
  });
}

bool NbdServer::WarningDue(std::chrono::steady_clock::time_point* last) {
  MutexLock l(&mu_);
  const auto now = std::chrono::steady_clock::now();
  if (*last != std::chrono::steady_clock::time_point{} &&
      now - *last < std::chrono::seconds(10)) {
    return false;
  }
  *last = now;
  return true;
}

void NbdServer::Finished(NbdConnection* c) {
  std::function<void()> done;
  {
    MutexLock l(&mu_);
    for (auto it = conns_.begin(); it != conns_.end(); ++it) {
      if (it->get() == c) {
        // Keep the object alive until this handler returns.
        asio::post(io_, [keep = *it] {});
        conns_.erase(it);
        break;
      }
    }
    if (shutting_down_ && conns_.empty() && on_shutdown_) done = std::move(on_shutdown_);
  }
  if (done) asio::post(io_, std::move(done));
}

void NbdServer::Shutdown(std::function<void()> done) {
  std::set<std::shared_ptr<NbdConnection>> conns;
  {
    MutexLock l(&mu_);
    shutting_down_ = true;
    conns = conns_;
    if (conns_.empty()) {
      asio::post(io_, std::move(done));
    } else {
      on_shutdown_ = std::move(done);
    }
  }
  boost::system::error_code ec;
  if (unix_acceptor_) unix_acceptor_->close(ec);
  if (tcp_acceptor_) tcp_acceptor_->close(ec);
  unix_retry_.cancel();
  tcp_retry_.cancel();
  for (auto& c : conns) c->Drain();
}

NbdServerStats NbdServer::stats() {
  NbdServerStats s;
  s.connections_total = c_total_;
  {
    MutexLock l(&mu_);
    s.connections_open = conns_.size();
  }
  s.requests = c_requests_;
  s.request_errors = c_request_errors_;
  s.protocol_errors = c_protocol_errors_;
  s.handshake_timeouts = c_handshake_timeouts_;
  s.connections_refused = c_refused_;
  s.connections_denied = c_denied_;
  s.bytes_read = c_bytes_read_;
  s.bytes_written = c_bytes_written_;
  s.stall_closes = c_stall_closes_;
  s.memory = budget_.stats();
  return s;
}

}  // namespace dede
