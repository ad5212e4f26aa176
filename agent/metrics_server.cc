#include "agent/metrics_server.h"

#include <array>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "util/log.h"
#include "util/mutex.h"

namespace dede {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Strand = asio::strand<asio::any_io_executor>;

namespace {

// More would only be a local process misbehaving; each costs a descriptor.
constexpr size_t kMaxConnections = 64;
// Time a client gets to send its request line and headers.
constexpr auto kRequestTimeout = std::chrono::seconds(10);
// Time from the complete request to the response taken by the client.
constexpr auto kResponseTimeout = std::chrono::seconds(30);
// After the response: how long and how much of what the client still sends
// (a body, the rest of oversized headers) is read and thrown away before
// closing. Closing with unread input makes TCP send a reset, and the client
// may then lose the response (the 431) before it reads it.
constexpr auto kLingerTime = std::chrono::seconds(2);
constexpr size_t kLingerBytes = size_t{1} << 20;

const char* Reason(int code) {
  switch (code) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
  }
  return "Error";
}

constexpr const char* kExpositionType = "text/plain; version=0.0.4; charset=utf-8";
constexpr const char* kPlainType = "text/plain; charset=utf-8";

constexpr const char* kIndexPage =
    "<!DOCTYPE html>\n<html><head><title>dedupd</title></head>\n"
    "<body><h1>dedupd</h1><p>Prometheus metrics: <a "
    "href=\"/metrics\">/metrics</a></p></body></html>\n";

// Offset just past the blank line that ends the headers, or npos. Bare
// LF line ends are accepted too (hand-typed requests).
size_t HeaderEnd(const std::string& s) {
  size_t crlf = s.find("\r\n\r\n");
  size_t lf = s.find("\n\n");
  size_t end = std::string::npos;
  if (crlf != std::string::npos) end = crlf + 4;
  if (lf != std::string::npos && lf + 2 < end) end = lf + 2;
  return end;
}

std::vector<std::string> SplitSpaces(const std::string& s) {
  std::vector<std::string> parts;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = s.find(' ', i);
    if (j == std::string::npos) j = s.size();
    if (j > i) parts.push_back(s.substr(i, j - i));
    i = j + 1;
  }
  return parts;
}

}  // namespace

struct MetricsServer::Shared {
  std::function<std::string()> render;
  std::function<void(std::function<void()>)> run_blocking;
  Mutex mu;
  std::map<uint64_t, std::weak_ptr<MetricsConnection>> conns GUARDED_BY(mu);
  uint64_t next_id GUARDED_BY(mu) = 0;
  bool stopped GUARDED_BY(mu) = false;
};

// One HTTP exchange. Everything is touched only on strand_; the render runs
// on a worker and posts the body back.
class MetricsConnection : public std::enable_shared_from_this<MetricsConnection> {
 public:
  MetricsConnection(std::shared_ptr<MetricsServer::Shared> shared, tcp::socket sock, uint64_t id)
      : shared_(std::move(shared)),
        sock_(std::move(sock)),
        strand_(asio::make_strand(sock_.get_executor())),
        timer_(strand_),
        id_(id) {}

  void Start() {
    asio::dispatch(strand_, [self = shared_from_this()] {
      self->ArmTimer(kRequestTimeout);
      self->ReadRequest();
    });
  }
  void Close() {
    asio::dispatch(strand_, [self = shared_from_this()] { self->CloseNow(); });
  }
  // Whether its request is in (being answered): one still waiting for it
  // may be closed to admit a new client at the connection limit.
  bool answering() const { return answering_.load(); }

 private:
  void ArmTimer(std::chrono::steady_clock::duration d) {
    timer_.expires_after(d);  // cancels the previous wait
    // A wait that had already expired when re-armed still runs, with no
    // error: the generation tells it it is stale.
    const uint64_t generation = ++timer_generation_;
    timer_.async_wait([self = shared_from_this(), generation](boost::system::error_code ec) {
      if (ec == asio::error::operation_aborted || self->closed_ ||
          generation != self->timer_generation_)
        return;
      self->CloseNow();
    });
  }

  void ReadRequest() {
    sock_.async_read_some(asio::buffer(chunk_),
                          asio::bind_executor(strand_, [self = shared_from_this()](
                                                           boost::system::error_code ec, size_t n) {
                            if (self->closed_) return;
                            if (ec || n == 0) {
                              self->CloseNow();  // gone before the request was complete
                              return;
                            }
                            self->inbuf_.append(self->chunk_.data(), n);
                            self->Examine();
                          }));
  }

  void Examine() {
    size_t end = HeaderEnd(inbuf_);
    if (end == std::string::npos) {
      if (inbuf_.size() > kMetricsMaxHeader) {
        Respond(431, kPlainType, "request headers larger than 16 KiB\n", false);
      } else {
        ReadRequest();
      }
      return;
    }
    if (end > kMetricsMaxHeader) {
      Respond(431, kPlainType, "request headers larger than 16 KiB\n", false);
      return;
    }
    // The request is in; a slow render must not hit the request timeout.
    answering_ = true;
    ArmTimer(kResponseTimeout);
    std::string request_line = inbuf_.substr(0, inbuf_.find('\n'));
    if (!request_line.empty() && request_line.back() == '\r') request_line.pop_back();
    inbuf_.clear();
    std::vector<std::string> parts = SplitSpaces(request_line);
    if (parts.size() != 3 || parts[2].rfind("HTTP/", 0) != 0) {
      Respond(400, kPlainType, "bad request line\n", false);
      return;
    }
    const std::string& method = parts[0];
    std::string target = parts[1].substr(0, parts[1].find('?'));
    if (method != "GET" && method != "HEAD") {
      Respond(405, kPlainType, "only GET and HEAD\n", false, "Allow: GET, HEAD\r\n");
      return;
    }
    const bool head_only = method == "HEAD";
    if (target == "/metrics") {
      Render(head_only);
    } else if (target == "/") {
      Respond(200, "text/html; charset=utf-8", kIndexPage, head_only);
    } else {
      Respond(404, kPlainType, "not found; metrics are at /metrics\n", head_only);
    }
  }

  void Render(bool head_only) {
    shared_->run_blocking([self = shared_from_this(), head_only] {
      int code = 200;
      std::string body;
      try {
        body = self->shared_->render();
      } catch (const std::exception& e) {
        code = 500;
        body = std::string("rendering metrics failed: ") + e.what() + "\n";
        LOG(kWarning) << "metrics: rendering failed: " << e.what();
      }
      asio::post(self->strand_, [self, code, body = std::move(body), head_only]() mutable {
        if (self->closed_) return;
        self->Respond(code, code == 200 ? kExpositionType : kPlainType, std::move(body), head_only);
      });
    });
  }

  void Respond(int code, const char* content_type, std::string body, bool head_only,
               const std::string& extra_headers = "") {
    out_ = "HTTP/1.1 " + std::to_string(code) + " " + Reason(code) + "\r\n";
    out_ += std::string("Content-Type: ") + content_type + "\r\n";
    out_ += "Content-Length: " + std::to_string(body.size()) + "\r\n";
    out_ += extra_headers;
    out_ += "Connection: close\r\n\r\n";
    if (!head_only) out_ += body;
    ArmTimer(kResponseTimeout);
    asio::async_write(sock_, asio::buffer(out_),
                      asio::bind_executor(strand_, [self = shared_from_this()](
                                                       boost::system::error_code ec, size_t) {
                        if (self->closed_) return;
                        if (ec) {
                          self->CloseNow();
                          return;
                        }
                        self->Linger();
                      }));
  }

  // The response is out: signal the end of it, then read and drop what the
  // client still sends until it closes (bounded), so that closing our side
  // does not reset the connection under an unread response.
  void Linger() {
    boost::system::error_code ec;
    sock_.shutdown(tcp::socket::shutdown_send, ec);
    if (ec) {
      CloseNow();
      return;
    }
    ArmTimer(kLingerTime);
    Drain();
  }

  void Drain() {
    sock_.async_read_some(asio::buffer(chunk_),
                          asio::bind_executor(strand_, [self = shared_from_this()](
                                                           boost::system::error_code ec, size_t n) {
                            if (self->closed_) return;
                            self->drained_ += n;
                            if (ec || n == 0 || self->drained_ > kLingerBytes) {
                              self->CloseNow();
                              return;
                            }
                            self->Drain();
                          }));
  }

  void CloseNow() {
    if (closed_) return;
    closed_ = true;
    timer_.cancel();
    boost::system::error_code ec;
    sock_.close(ec);
    MutexLock l(&shared_->mu);
    shared_->conns.erase(id_);
  }

  const std::shared_ptr<MetricsServer::Shared> shared_;
  std::atomic<bool> answering_{false};
  tcp::socket sock_;
  Strand strand_;
  asio::steady_timer timer_;
  const uint64_t id_;
  std::array<char, 4096> chunk_;
  std::string inbuf_;
  std::string out_;
  size_t drained_ = 0;
  uint64_t timer_generation_ = 0;
  bool closed_ = false;
};

// -------------------------------------------------------------------- server

MetricsServer::MetricsServer(asio::io_context& io, int port, std::function<std::string()> render,
                             std::function<void(std::function<void()>)> run_blocking)
    : io_(io), requested_port_(port), shared_(std::make_shared<Shared>()) {
  shared_->render = std::move(render);
  shared_->run_blocking = std::move(run_blocking);
}

MetricsServer::~MetricsServer() {
  Stop();
}

Status MetricsServer::Listen() {
  if (requested_port_ < 0 || requested_port_ > 65535) {
    return Status::Invalid("metrics port must be 0..65535, not " + std::to_string(requested_port_));
  }
  // Loopback only, see the header.
  tcp::endpoint ep(asio::ip::address_v4::loopback(), static_cast<uint16_t>(requested_port_));
  const std::string where = "127.0.0.1:" + std::to_string(requested_port_);
  auto acceptor = std::make_unique<tcp::acceptor>(io_);
  boost::system::error_code ec;
  acceptor->open(ep.protocol(), ec);
  if (!ec) acceptor->set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor->bind(ep, ec);
  if (ec == asio::error::address_in_use)
    return Status::Exists("metrics port " + where + " is in use");
  if (!ec) acceptor->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Status::IoError("listening on " + where + ": " + ec.message());
  tcp::endpoint bound = acceptor->local_endpoint(ec);
  if (ec) return Status::IoError("listening on " + where + ": " + ec.message());
  port_ = bound.port();
  acceptor_ = std::move(acceptor);
  return Status::Ok();
}

tcp::endpoint MetricsServer::endpoint() const {
  boost::system::error_code ec;
  if (!acceptor_) return {};
  tcp::endpoint ep = acceptor_->local_endpoint(ec);
  return ec ? tcp::endpoint() : ep;
}

void MetricsServer::Start() {
  if (acceptor_) Accept();
}

void MetricsServer::Accept() {
  acceptor_->async_accept([this, shared = shared_](boost::system::error_code ec, tcp::socket sock) {
    if (ec == asio::error::operation_aborted) return;
    std::shared_ptr<MetricsConnection> conn, evicted;
    {
      MutexLock l(&shared->mu);
      // Stopped (maybe destroyed): `this` must not be touched.
      if (shared->stopped) return;
      if (!ec && shared->conns.size() >= kMaxConnections) {
        // Full: the oldest connection that has not sent its request makes
        // room. Refusing the newcomer let any local user keep the limit
        // filled with idle connections, and every scrape failed.
        for (auto it = shared->conns.begin(); it != shared->conns.end(); ++it) {
          std::shared_ptr<MetricsConnection> c = it->second.lock();
          if (c && c->answering()) continue;
          evicted = std::move(c);
          shared->conns.erase(it);
          break;
        }
      }
      if (!ec && shared->conns.size() < kMaxConnections) {
        uint64_t id = ++shared->next_id;
        conn = std::make_shared<MetricsConnection>(shared, std::move(sock), id);
        shared->conns[id] = conn;
      }
    }
    if (evicted) evicted->Close();
    if (conn) {
      conn->Start();
    } else if (ec) {
      LOG(kWarning) << "metrics: accept: " << ec.message();
    }
    // (over the limit: `sock` closes as it goes out of scope)
    Accept();
  });
}

void MetricsServer::Stop() {
  std::vector<std::shared_ptr<MetricsConnection>> conns;
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
}

size_t MetricsServer::connections() const {
  MutexLock l(&shared_->mu);
  return shared_->conns.size();
}

// -------------------------------------------------------------------- text

namespace {

// Metric names: [a-zA-Z_:][a-zA-Z0-9_:]*; label names the same without ':'.
std::string SanitizeName(const std::string& name, bool colon_ok) {
  if (name.empty()) return "_";
  std::string out = name;
  for (size_t i = 0; i < out.size(); i++) {
    const char c = out[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                    (colon_ok && c == ':') || (i > 0 && c >= '0' && c <= '9');
    if (!ok) out[i] = '_';
  }
  return out;
}

std::string EscapeHelp(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// Length of the valid UTF-8 sequence at s[i], 0 if there is none (a stray
// or missing continuation byte, an overlong form, a surrogate, past U+10FFFF).
size_t Utf8SequenceAt(const std::string& s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp;
  if ((c & 0xE0) == 0xC0) {
    n = 2;
    cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3;
    cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; k++) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3F);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

std::string EscapeLabelValue(const std::string& raw) {
  // File names are arbitrary bytes; a label value must be UTF-8, or
  // Prometheus refuses the whole scrape: invalid bytes become U+FFFD.
  std::string s;
  for (size_t i = 0; i < raw.size();) {
    const size_t n = Utf8SequenceAt(raw, i);
    if (n == 0) {
      s += "\xEF\xBF\xBD";
      i++;
    } else {
      s.append(raw, i, n);
      i += n;
    }
  }
  std::string out;
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// Integers as integers (counters of bytes read exactly), others in the
// shortest form that reads back as the same double.
std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
  }
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

}  // namespace

void MetricsText::Gauge(const std::string& name, const std::string& help, double value,
                        const Labels& labels) {
  Add("gauge", name, help, value, labels);
}

void MetricsText::Counter(const std::string& name, const std::string& help, double value,
                          const Labels& labels) {
  Add("counter", name, help, value, labels);
}

void MetricsText::Add(const char* type, const std::string& name, const std::string& help,
                      double value, const Labels& labels) {
  std::string family = SanitizeName(name, true);
  auto [it, inserted] = family_index_.emplace(family, families_.size());
  if (inserted) families_.push_back(Family{family, help, type, {}});
  std::string& s = families_[it->second].samples;
  s += family;
  if (!labels.empty()) {
    s += '{';
    for (size_t i = 0; i < labels.size(); i++) {
      if (i > 0) s += ',';
      s += SanitizeName(labels[i].first, false);
      s += "=\"";
      s += EscapeLabelValue(labels[i].second);
      s += '"';
    }
    s += '}';
  }
  s += ' ';
  s += FormatValue(value);
  s += '\n';
}

std::string MetricsText::str() const {
  std::string out;
  for (const Family& f : families_) {
    out += "# HELP " + f.name + " " + EscapeHelp(f.help) + "\n";
    out += "# TYPE " + f.name + " " + f.type + "\n";
    out += f.samples;
  }
  return out;
}

}  // namespace dede
