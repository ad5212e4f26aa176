// Tests for dedupd's Prometheus endpoint (agent/metrics_server.h): the
// HTTP answers (200 with the exposition content type, 404, 405, 431, 400,
// 500), loopback-only binding, and MetricsText's output checked line by
// line against the text exposition format.
#include "agent/metrics_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio.hpp>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

using namespace dede;
using namespace std::chrono_literals;

namespace {

class Loop {
 public:
  Loop() : work_(boost::asio::make_work_guard(io_)), pool_(2) {
    thread_ = std::thread([this] {
      io_thread_id_ = std::this_thread::get_id();
      io_.run();
    });
  }
  ~Loop() {
    work_.reset();
    io_.stop();
    thread_.join();
    pool_.join();
  }
  boost::asio::io_context& io() { return io_; }
  std::function<void(std::function<void()>)> run_blocking() {
    return [this](std::function<void()> f) { boost::asio::post(pool_, std::move(f)); };
  }
  std::thread::id io_thread_id() const { return io_thread_id_; }
  void RunOnIo(std::function<void()> f) {
    std::promise<void> done;
    boost::asio::post(io_, [&] {
      f();
      done.set_value();
    });
    done.get_future().wait();
  }

 private:
  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
  boost::asio::thread_pool pool_;
  std::thread thread_;
  std::atomic<std::thread::id> io_thread_id_{};
};

// Sends `request` to 127.0.0.1:port and reads until the server closes.
std::string Exchange(int port, const std::string& request, std::chrono::milliseconds timeout = 5s) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  size_t sent = 0;
  while (sent < request.size()) {
    ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may answer (431) before taking it all
    sent += static_cast<size_t>(n);
  }
  std::string response;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char buf[4096];
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    response.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return response;
}

struct Response {
  int code = 0;
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;
};

Response Parse(const std::string& raw) {
  Response r;
  size_t end = raw.find("\r\n\r\n");
  REQUIRE(end != std::string::npos);
  std::string head = raw.substr(0, end);
  r.body = raw.substr(end + 4);
  size_t eol = head.find("\r\n");
  std::string status_line = head.substr(0, eol);
  REQUIRE(status_line.rfind("HTTP/1.", 0) == 0);
  r.code = std::stoi(status_line.substr(9, 3));
  size_t pos = eol == std::string::npos ? head.size() : eol + 2;
  while (pos < head.size()) {
    size_t next = head.find("\r\n", pos);
    if (next == std::string::npos) next = head.size();
    std::string line = head.substr(pos, next - pos);
    size_t colon = line.find(':');
    REQUIRE(colon != std::string::npos);
    std::string name = line.substr(0, colon);
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    size_t v = colon + 1;
    while (v < line.size() && line[v] == ' ') v++;
    r.headers[name] = line.substr(v);
    pos = next + 2;
  }
  return r;
}

Response Get(int port, const std::string& target, const std::string& method = "GET") {
  return Parse(Exchange(
      port, method + " " + target + " HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: test\r\n\r\n"));
}

const std::string kBody = "# HELP up Whether it is up.\n# TYPE up gauge\nup 1\n";

// ------------------------------------------------ exposition format checker

bool NameChar(char c, bool first, bool colon_ok) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon_ok && c == ':') ||
         (!first && c >= '0' && c <= '9');
}

// Reads a name at `pos`; empty on failure.
std::string ReadName(const std::string& line, size_t* pos, bool colon_ok) {
  size_t start = *pos;
  while (*pos < line.size() && NameChar(line[*pos], *pos == start, colon_ok)) (*pos)++;
  return line.substr(start, *pos - start);
}

bool IsValue(const std::string& v) {
  if (v == "NaN" || v == "+Inf" || v == "-Inf") return true;
  if (v.empty()) return false;
  char* end = nullptr;
  std::strtod(v.c_str(), &end);
  return end == v.c_str() + v.size();
}

// A sample line "name{label="value",...} value": returns its name, or an
// explanation prefixed with "!".
std::string CheckSample(const std::string& line, std::map<std::string, std::string>* labels) {
  size_t pos = 0;
  std::string name = ReadName(line, &pos, true);
  if (name.empty()) return "!bad metric name";
  if (pos < line.size() && line[pos] == '{') {
    pos++;
    while (pos < line.size() && line[pos] != '}') {
      std::string label = ReadName(line, &pos, false);
      if (label.empty()) return "!bad label name";
      if (line.compare(pos, 2, "=\"") != 0) return "!no =\" after label " + label;
      pos += 2;
      std::string value;
      for (;;) {
        if (pos >= line.size()) return "!unterminated label value";
        char c = line[pos++];
        if (c == '"') break;
        if (c == '\\') {
          if (pos >= line.size()) return "!dangling backslash";
          char e = line[pos++];
          if (e == 'n') {
            value += '\n';
          } else if (e == '\\' || e == '"') {
            value += e;
          } else {
            return std::string("!bad escape \\") + e;
          }
        } else if (c == '\n') {
          return "!raw newline in label value";
        } else {
          value += c;
        }
      }
      (*labels)[label] = value;
      if (pos < line.size() && line[pos] == ',') pos++;
    }
    if (pos >= line.size()) return "!unterminated label set";
    pos++;  // '}'
  }
  if (pos >= line.size() || line[pos] != ' ') return "!no space before the value";
  std::string value = line.substr(pos + 1);
  if (!IsValue(value)) return "!bad value '" + value + "'";
  return name;
}

// Checks a whole exposition text; returns "" or what is wrong. Also checks
// that each family has one HELP and one TYPE, before its samples, and that
// its samples are contiguous.
std::string CheckExposition(const std::string& text) {
  if (!text.empty() && text.back() != '\n') return "no final newline";
  std::set<std::string> helped, typed, finished;
  std::string current;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) {
      bool help = line[2] == 'H';
      size_t p = 7;
      std::string name = ReadName(line, &p, true);
      if (name.empty()) return "bad name in: " + line;
      if (help) {
        if (!helped.insert(name).second) return "second HELP for " + name;
        if (p < line.size() && line[p] != ' ') return "bad HELP line: " + line;
      } else {
        if (!typed.insert(name).second) return "second TYPE for " + name;
        std::string type = p < line.size() ? line.substr(p + 1) : "";
        if (type != "counter" && type != "gauge" && type != "histogram" && type != "summary" &&
            type != "untyped") {
          return "bad TYPE line: " + line;
        }
      }
      if (name != current) {
        if (!current.empty()) finished.insert(current);
        current = name;
      }
      continue;
    }
    if (line.rfind("#", 0) == 0) continue;
    if (line.empty()) return "empty line";
    std::map<std::string, std::string> labels;
    std::string name = CheckSample(line, &labels);
    if (name[0] == '!') return name.substr(1) + " in: " + line;
    if (name != current) {
      if (finished.count(name)) return "samples of " + name + " are not contiguous";
      if (!current.empty()) finished.insert(current);
      current = name;
    }
    if (!typed.count(name)) return "sample of " + name + " before its TYPE";
  }
  return "";
}

}  // namespace

TEST_CASE("metrics: GET /metrics returns the rendered body with the exposition content type",
          "[metrics]") {
  std::atomic<std::thread::id> render_thread{};
  std::atomic<int> renders{0};
  Loop loop;
  MetricsServer server(
      loop.io(), 0,
      [&] {
        render_thread = std::this_thread::get_id();
        renders++;
        return kBody;
      },
      loop.run_blocking());
  REQUIRE(server.Listen().ok());
  loop.RunOnIo([&] { server.Start(); });
  REQUIRE(server.port() > 0);

  Response r = Get(server.port(), "/metrics");
  CHECK(r.code == 200);
  CHECK(r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8");
  CHECK(r.headers["content-length"] == std::to_string(kBody.size()));
  CHECK(r.headers["connection"] == "close");
  CHECK(r.body == kBody);
  // The render runs on a worker, not on the io thread.
  CHECK(render_thread.load() != std::thread::id());
  CHECK(render_thread.load() != loop.io_thread_id());

  // A query string does not matter; HEAD gets the headers only.
  CHECK(Get(server.port(), "/metrics?name[]=up").body == kBody);
  Response head = Get(server.port(), "/metrics", "HEAD");
  CHECK(head.code == 200);
  CHECK(head.headers["content-length"] == std::to_string(kBody.size()));
  CHECK(head.body.empty());

  Response index = Get(server.port(), "/");
  CHECK(index.code == 200);
  CHECK(index.body.find("/metrics") != std::string::npos);

  // A hand-typed request with bare LF line ends.
  CHECK(Parse(Exchange(server.port(), "GET /metrics HTTP/1.0\n\n")).body == kBody);
  CHECK(renders.load() == 4);
  loop.RunOnIo([&] { server.Stop(); });
}

TEST_CASE("metrics: unknown paths are 404 and other methods 405", "[metrics]") {
  Loop loop;
  MetricsServer server(
      loop.io(), 0, [] { return kBody; }, loop.run_blocking());
  REQUIRE(server.Listen().ok());
  loop.RunOnIo([&] { server.Start(); });

  CHECK(Get(server.port(), "/nope").code == 404);
  CHECK(Get(server.port(), "/metrics/").code == 404);
  Response post = Get(server.port(), "/metrics", "POST");
  CHECK(post.code == 405);
  CHECK(post.headers["allow"] == "GET, HEAD");
  Response del =
      Parse(Exchange(server.port(), "DELETE / HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"));
  CHECK(del.code == 405);
  CHECK(Parse(Exchange(server.port(), "NONSENSE\r\n\r\n")).code == 400);
  loop.RunOnIo([&] { server.Stop(); });
}

TEST_CASE("metrics: request headers over 16 KiB get 431", "[metrics]") {
  Loop loop;
  MetricsServer server(
      loop.io(), 0, [] { return kBody; }, loop.run_blocking());
  REQUIRE(server.Listen().ok());
  loop.RunOnIo([&] { server.Start(); });

  SECTION("complete but too large") {
    std::string request = "GET /metrics HTTP/1.1\r\nX-Big: " + std::string(20000, 'a') + "\r\n\r\n";
    CHECK(Parse(Exchange(server.port(), request)).code == 431);
  }
  SECTION("never ending") {
    std::string request = "GET /metrics HTTP/1.1\r\nX-Big: " + std::string(200000, 'a');
    CHECK(Parse(Exchange(server.port(), request)).code == 431);
  }
  SECTION("just under the limit is fine") {
    std::string head = "GET /metrics HTTP/1.1\r\nX-Big: ";
    std::string request = head + std::string(kMetricsMaxHeader - head.size() - 4, 'a') + "\r\n\r\n";
    REQUIRE(request.size() == kMetricsMaxHeader);
    CHECK(Parse(Exchange(server.port(), request)).code == 200);
  }
  // The server is still fine.
  CHECK(Get(server.port(), "/metrics").code == 200);
  loop.RunOnIo([&] { server.Stop(); });
}

TEST_CASE("metrics: the server listens on 127.0.0.1 only", "[metrics]") {
  Loop loop;
  MetricsServer server(
      loop.io(), 0, [] { return kBody; }, loop.run_blocking());
  REQUIRE(server.Listen().ok());
  boost::asio::ip::tcp::endpoint ep = server.endpoint();
  CHECK(ep.address() == boost::asio::ip::address_v4::loopback());
  CHECK(ep.address().to_string() == "127.0.0.1");
  CHECK(static_cast<int>(ep.port()) == server.port());

  // The port is taken now: a second server on it is kExists.
  MetricsServer second(
      loop.io(), server.port(), [] { return kBody; }, loop.run_blocking());
  Status st = second.Listen();
  CHECK(st.code() == Status::Code::kExists);
  CHECK(st.message().find("127.0.0.1:" + std::to_string(server.port())) != std::string::npos);

  MetricsServer bad(
      loop.io(), 70000, [] { return kBody; }, loop.run_blocking());
  CHECK(bad.Listen().code() == Status::Code::kInvalid);
}

TEST_CASE("metrics: a render that throws gives 500 and the server goes on", "[metrics]") {
  std::atomic<bool> fail{true};
  Loop loop;
  MetricsServer server(
      loop.io(), 0,
      [&]() -> std::string {
        if (fail) throw std::runtime_error("volume went away");
        return kBody;
      },
      loop.run_blocking());
  REQUIRE(server.Listen().ok());
  loop.RunOnIo([&] { server.Start(); });
  Response r = Get(server.port(), "/metrics");
  CHECK(r.code == 500);
  CHECK(r.body.find("volume went away") != std::string::npos);
  fail = false;
  CHECK(Get(server.port(), "/metrics").code == 200);
  loop.RunOnIo([&] { server.Stop(); });
}

TEST_CASE("metrics: Stop closes the listener and idle connections", "[metrics]") {
  Loop loop;
  MetricsServer server(
      loop.io(), 0, [] { return kBody; }, loop.run_blocking());
  REQUIRE(server.Listen().ok());
  loop.RunOnIo([&] { server.Start(); });
  const int port = server.port();

  // A client that connects and says nothing holds a connection.
  int idle = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(idle, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (server.connections() == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  CHECK(server.connections() == 1);

  loop.RunOnIo([&] { server.Stop(); });
  char c;
  pollfd p{idle, POLLIN, 0};
  REQUIRE(::poll(&p, 1, 5000) == 1);
  CHECK(::recv(idle, &c, 1, 0) <= 0);  // closed
  ::close(idle);

  int again = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  CHECK(::connect(again, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0);
  ::close(again);
}

// At the connection limit a newcomer was refused: any local user could
// keep 64 idle connections open (renewing them every 10 s) and every
// scrape failed. The oldest connection that has not sent its request now
// makes room.
TEST_CASE("metrics: idle connections at the limit do not lock out a scrape", "[metrics]") {
  Loop loop;
  MetricsServer server(
      loop.io(), 0, [] { return kBody; }, loop.run_blocking());
  REQUIRE(server.Listen().ok());
  loop.RunOnIo([&] { server.Start(); });
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(server.port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::vector<int> idle;
  for (int i = 0; i < 70; i++) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
    idle.push_back(fd);
  }
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (server.connections() < 64 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  CHECK(server.connections() == 64);
  Response r = Get(server.port(), "/metrics");
  CHECK(r.code == 200);
  CHECK(r.body == kBody);
  for (int fd : idle) ::close(fd);
  loop.RunOnIo([&] { server.Stop(); });
}

TEST_CASE("metrics: MetricsText groups families and emits HELP and TYPE once", "[metrics]") {
  MetricsText m;
  m.Gauge("dede_export_clients", "Clients connected to the export.", 1, {{"export", "vm1"}});
  m.Counter("dede_passes_total", "Dedup passes by outcome.", 3, {{"outcome", "completed"}});
  m.Gauge("dede_export_clients", "Clients connected to the export.", 2, {{"export", "vm2"}});
  m.Counter("dede_passes_total", "Dedup passes by outcome.", 1, {{"outcome", "stopped"}});
  m.Gauge("dede_up", "Whether dedupd runs.", 1);
  const std::string text = m.str();
  CHECK(CheckExposition(text) == "");
  CHECK(text ==
        "# HELP dede_export_clients Clients connected to the export.\n"
        "# TYPE dede_export_clients gauge\n"
        "dede_export_clients{export=\"vm1\"} 1\n"
        "dede_export_clients{export=\"vm2\"} 2\n"
        "# HELP dede_passes_total Dedup passes by outcome.\n"
        "# TYPE dede_passes_total counter\n"
        "dede_passes_total{outcome=\"completed\"} 3\n"
        "dede_passes_total{outcome=\"stopped\"} 1\n"
        "# HELP dede_up Whether dedupd runs.\n"
        "# TYPE dede_up gauge\n"
        "dede_up 1\n");
}

TEST_CASE("metrics: MetricsText escapes labels and help and keeps names valid", "[metrics]") {
  MetricsText m;
  m.Gauge("dede_file_bytes", "Bytes of a file.\nSecond line with a \\ backslash.", 4096,
          {{"file", "a \"quoted\" \\ name\nwith a newline"}, {"kind", "vm"}});
  m.Gauge("dede.bad-name", "Name with bad characters.", 0.5, {{"bad-label", "x"}, {"0digit", "y"}});
  m.Gauge("dede_special", "Special values.", std::numeric_limits<double>::quiet_NaN(),
          {{"v", "nan"}});
  m.Gauge("dede_special", "Special values.", std::numeric_limits<double>::infinity(),
          {{"v", "inf"}});
  m.Gauge("dede_special", "Special values.", -std::numeric_limits<double>::infinity(),
          {{"v", "-inf"}});
  m.Counter("dede_big_total", "Large and fractional values.", 18446744073709551615.0);
  m.Counter("dede_big_total", "Large and fractional values.", 1e-9, {{"x", "small"}});
  m.Counter("dede_big_total", "Large and fractional values.", 123456789012.0, {{"x", "exact"}});
  m.Gauge("", "No name at all.", 1);
  const std::string text = m.str();
  INFO(text);
  CHECK(CheckExposition(text) == "");
  CHECK(
      text.find("# HELP dede_file_bytes Bytes of a file.\\nSecond line with a \\\\ backslash.\n") !=
      std::string::npos);
  CHECK(text.find("dede_file_bytes{file=\"a \\\"quoted\\\" \\\\ name\\nwith a "
                  "newline\",kind=\"vm\"} 4096\n") != std::string::npos);
  CHECK(text.find("dede_bad_name{bad_label=\"x\",_digit=\"y\"} 0.5\n") != std::string::npos);
  CHECK(text.find("dede_special{v=\"nan\"} NaN\n") != std::string::npos);
  CHECK(text.find("dede_special{v=\"inf\"} +Inf\n") != std::string::npos);
  CHECK(text.find("dede_special{v=\"-inf\"} -Inf\n") != std::string::npos);
  CHECK(text.find("dede_big_total{x=\"exact\"} 123456789012\n") != std::string::npos);
  CHECK(text.find("dede_big_total{x=\"small\"} 1e-09\n") != std::string::npos);

  // The escaped label value parses back to the original.
  std::map<std::string, std::string> labels;
  size_t start = text.find("dede_file_bytes{");
  std::string line = text.substr(start, text.find('\n', start) - start);
  REQUIRE(CheckSample(line, &labels) == "dede_file_bytes");
  CHECK(labels["file"] == "a \"quoted\" \\ name\nwith a newline");

  // A file name is any bytes; a label value must be UTF-8 (Prometheus
  // refuses the whole scrape otherwise): invalid bytes become U+FFFD,
  // valid multi-byte characters stay.
  MetricsText u;
  u.Gauge("dede_x", "h", 1, {{"export", "caf\xe9"}});
  u.Gauge("dede_x", "h", 2, {{"export", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x92\xbe"}});
  u.Gauge("dede_x", "h", 3, {{"export", "\xc0\xaf \xed\xa0\x80 \xf4\x90\x80\x80 \xe2\x82"}});
  const std::string ut = u.str();
  CHECK(CheckExposition(ut) == "");
  CHECK(ut.find("dede_x{export=\"caf\xef\xbf\xbd\"} 1\n") != std::string::npos);
  CHECK(ut.find("dede_x{export=\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x92\xbe\"} 2\n") !=
        std::string::npos);
  // An overlong '/', a surrogate, past U+10FFFF, a cut sequence.
  CHECK(
      ut.find("dede_x{export=\"\xef\xbf\xbd\xef\xbf\xbd \xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd "
              "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd \xef\xbf\xbd\xef\xbf\xbd\"} 3\n") !=
      std::string::npos);

  // The checker itself rejects what it should.
  CHECK(CheckExposition("a 1\n") != "");                             // no TYPE
  CHECK(CheckExposition("# TYPE a gauge\na{x=\"1} 1\n") != "");      // unterminated
  CHECK(CheckExposition("# TYPE a gauge\na{x=\"\\t\"} 1\n") != "");  // bad escape
  CHECK(CheckExposition("# TYPE a gauge\n# TYPE b gauge\na 1\nb 1\na 2\n") !=
        "");                                                // not contiguous
  CHECK(CheckExposition("# TYPE a gauge\na one\n") != "");  // bad value
}
