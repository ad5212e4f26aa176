// MetricsServer: dedupd's Prometheus endpoint, a minimal HTTP server on
// 127.0.0.1 only (never 0.0.0.0: the numbers say what runs on the host, and
// a scraper on another machine goes through whatever the operator
// forwards).
//
//   GET /metrics  200, text format 0.0.4 (Content-Type: text/plain;
//                 version=0.0.4; charset=utf-8), body from `render`
//   GET /         200, a short page pointing to /metrics
//   other paths   404        HEAD is answered like GET, without the body
//   other methods 405        request line + headers over 16 KiB: 431
//
// One request per connection (Connection: close); a request body is never
// read. A client that has not sent its headers within 10 s is dropped.
//
// MetricsText builds the exposition text.
#pragma once

#include <boost/asio.hpp>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "util/status.h"

namespace dede {

class MetricsConnection;

// Longest request line plus headers the server reads.
inline constexpr size_t kMetricsMaxHeader = 16 * 1024;

class MetricsServer {
 public:
  // `render` produces the /metrics body; it may block (volume reads), so it
  // runs through `run_blocking` (dedupd: NbdServer::RunBlocking), like the
  // control handlers. An exception it throws becomes a 500.
  MetricsServer(boost::asio::io_context& io, int port /*0: any free*/,
                std::function<std::string()> render,
                std::function<void(std::function<void()>)> run_blocking);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Binds 127.0.0.1:port. kExists when the port is taken, kInvalid for a
  // port outside 0..65535, kIoError otherwise.
  Status Listen();
  // The bound port (after Listen; the one picked when constructed with 0).
  int port() const { return port_; }
  // The bound address and port (after Listen).
  boost::asio::ip::tcp::endpoint endpoint() const;
  // Start and Stop touch the acceptor: call them on the io_context's thread
  // (a posted handler), or while it does not run.
  void Start();
  // Closes the listening socket and every connection. Idempotent; the
  // destructor calls it.
  void Stop();

  size_t connections() const;

 private:
  friend class MetricsConnection;
  struct Shared;
  boost::asio::io_context& io_;
  const int requested_port_;
  int port_ = -1;
  // What connections need (render, run_blocking, the registry): they hold
  // it too, so a render finishing after Stop finds it still there.
  std::shared_ptr<Shared> shared_;
  std::unique_ptr<boost::asio::ip::tcp::acceptor> acceptor_;

  void Accept();
};

// Prometheus text exposition (format 0.0.4) builder. Samples are grouped by
// family in the order families are first seen, because the format wants a
// family's samples together whatever order the caller adds them in; each
// family gets "# HELP" and "# TYPE" once. Names with characters the format
// does not allow get them replaced by '_'; label values are escaped (\\,
// \", \n). A name used again with another type keeps its first type.
class MetricsText {
 public:
  using Labels = std::vector<std::pair<std::string, std::string>>;

  void Gauge(const std::string& name, const std::string& help, double value,
             const Labels& labels = {});
  void Counter(const std::string& name, const std::string& help, double value,
               const Labels& labels = {});
  std::string str() const;

 private:
  struct Family {
    std::string name;
    std::string help;
    const char* type;
    std::string samples;  // complete lines
  };
  void Add(const char* type, const std::string& name, const std::string& help, double value,
           const Labels& labels);

  std::vector<Family> families_;
  std::map<std::string, size_t> family_index_;  // sanitized name -> families_ index
};

}  // namespace dede
