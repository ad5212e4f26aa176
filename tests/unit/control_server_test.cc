// Tests for dedupd's control socket (agent/control_server.h): replies,
// error replies that leave the connection usable, concurrent clients,
// oversized lines and vanishing clients, the stale/live socket file rules of
// Listen, ControlRequest's errors and timeout, and Stop.
#include "agent/control_server.h"

#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio.hpp>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "tests/socket_client.h"

using namespace dede;
using json = nlohmann::json;
using namespace std::chrono_literals;

namespace {

// A scratch directory under /tmp (Unix socket paths must stay short).
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/dede-ctl-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// An io_context on its own thread plus a worker pool, the way dedupd runs
// the control server (its run_blocking is the NBD server's pool).
class Loop {
 public:
  Loop() : work_(boost::asio::make_work_guard(io_)), pool_(4) {
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

  // Runs `f` on the io thread and waits for it (Start and Stop of a server
  // whose io_context runs elsewhere go through its executor in dedupd too).
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

// A blocking test client on a raw socket.
class Client {
 public:
  explicit Client(const std::string& path) { fd_ = test::ConnectUnix(path); }
  ~Client() { Close(); }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  // False if the server closed on us while we were sending.
  bool Send(const std::string& s) { return test::SendAll(fd_, s.data(), s.size()); }
  void ShutdownWrite() { ::shutdown(fd_, SHUT_WR); }
  // The next line (without '\n'); nullopt at end of input, on an error or
  // after `timeout`.
  std::optional<std::string> ReadLine(std::chrono::milliseconds timeout = 5s) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      size_t nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char tmp[4096];
      ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
      if (n <= 0) {
        eof_ = true;
        return std::nullopt;
      }
      buf_.append(tmp, static_cast<size_t>(n));
    }
  }
  json Request(const json& request) {
    REQUIRE(Send(request.dump() + "\n"));
    auto line = ReadLine();
    REQUIRE(line);
    return json::parse(*line);
  }
  // True once the server has closed the connection (reads give end of
  // input or an error), discarding whatever lines come before.
  bool WaitClosed(std::chrono::milliseconds timeout = 5s) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      eof_ = false;
      buf_.clear();
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      ReadLine(std::max(left, 1ms));
      if (eof_) return true;
    }
    return false;
  }

 private:
  int fd_ = -1;
  std::string buf_;
  bool eof_ = false;
};

bool Eventually(const std::function<bool()>& cond, std::chrono::milliseconds timeout = 5s) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return cond();
}

// A server with an "echo" handler (replies {"echo": request}), a "status"
// handler and a "fail" handler (an error Status), listening on `path`.
struct EchoServer {
  EchoServer(Loop* loop, const std::string& path)
      : loop(loop), server(loop->io(), path, loop->run_blocking()) {
    server.Handle("echo", [this](const json& request) -> Result<json> {
      handler_thread = std::this_thread::get_id();
      return json{{"echo", request}};
    });
    server.Handle("status", [](const json&) -> Result<json> {
      return json{{"host_id", 1}, {"pid", ::getpid()}};
    });
    server.Handle("fail",
                  [](const json&) -> Result<json> { return Status::NotFound("no such thing"); });
    server.Handle("throw", [](const json& request) -> Result<json> {
      return json{{"n", request.at("missing").get<int>()}};  // throws
    });
    REQUIRE(server.Listen().ok());
    loop->RunOnIo([this] { server.Start(); });
  }
  ~EchoServer() {
    loop->RunOnIo([this] { server.Stop(); });
  }
  Loop* loop;
  ControlServer server;
  std::atomic<std::thread::id> handler_thread{};
};

}  // namespace

TEST_CASE("control: a registered handler's reply comes back", "[control]") {
  TempDir dir;
  Loop loop;
  EchoServer s(&loop, dir / "ctl");

  Result<json> r = ControlRequest(dir / "ctl", json{{"cmd", "echo"}, {"x", 42}});
  REQUIRE(r.ok());
  CHECK(r.value()["echo"]["x"] == 42);
  CHECK(r.value()["echo"]["cmd"] == "echo");
  // Handlers run on the workers, never on the io thread.
  CHECK(s.handler_thread.load() != std::thread::id());
  CHECK(s.handler_thread.load() != loop.io_thread_id());

  Result<json> st = ControlRequest(dir / "ctl", json{{"cmd", "status"}});
  REQUIRE(st.ok());
  CHECK(st.value()["host_id"] == 1);
}

TEST_CASE("control: bad requests get an error reply and the connection stays usable", "[control]") {
  TempDir dir;
  Loop loop;
  EchoServer s(&loop, dir / "ctl");
  Client c(dir / "ctl");

  auto expect_error = [&](const std::string& line, const std::string& fragment) {
    REQUIRE(c.Send(line + "\n"));
    auto reply = c.ReadLine();
    REQUIRE(reply);
    json j = json::parse(*reply);
    REQUIRE(j.contains("error"));
    CHECK(j["error"].get<std::string>().find(fragment) != std::string::npos);
    // Still usable.
    CHECK(c.Request(json{{"cmd", "echo"}, {"after", line}})["echo"]["after"] == line);
  };
  expect_error("{\"cmd\":\"nope\"}", "unknown cmd 'nope'");
  expect_error("this is not json", "invalid JSON");
  expect_error("{\"cmd\":", "invalid JSON");
  expect_error("[1,2,3]", "not a JSON object");
  expect_error("{\"command\":\"status\"}", "cmd");
  expect_error("{\"cmd\":7}", "cmd");
  // Handler failures: an error Status and an exception.
  expect_error("{\"cmd\":\"fail\"}", "no such thing");
  expect_error("{\"cmd\":\"throw\"}", "internal error");

  // Blank lines and CRLF line ends are tolerated.
  REQUIRE(c.Send("\n   \n{\"cmd\":\"echo\",\"crlf\":true}\r\n"));
  auto line = c.ReadLine();
  REQUIRE(line);
  CHECK(json::parse(*line)["echo"]["crlf"] == true);
}

TEST_CASE("control: requests sent together are answered in order", "[control]") {
  TempDir dir;
  Loop loop;
  EchoServer s(&loop, dir / "ctl");
  Client c(dir / "ctl");
  std::string batch;
  for (int i = 0; i < 20; i++)
    batch += json{{"cmd", i % 5 == 4 ? "nope" : "echo"}, {"i", i}}.dump() + "\n";
  REQUIRE(c.Send(batch));
  for (int i = 0; i < 20; i++) {
    auto line = c.ReadLine();
    REQUIRE(line);
    json j = json::parse(*line);
    if (i % 5 == 4) {
      CHECK(j.contains("error"));
    } else {
      CHECK(j["echo"]["i"] == i);
    }
  }
}

TEST_CASE("control: a client that half-closes after its request still gets the reply",
          "[control]") {
  TempDir dir;
  Loop loop;
  EchoServer s(&loop, dir / "ctl");
  Client c(dir / "ctl");
  REQUIRE(c.Send("{\"cmd\":\"echo\",\"a\":1}\n{\"cmd\":\"echo\",\"a\":2}\n"));
  c.ShutdownWrite();
  auto first = c.ReadLine();
  auto second = c.ReadLine();
  REQUIRE(first);
  REQUIRE(second);
  CHECK(json::parse(*first)["echo"]["a"] == 1);
  CHECK(json::parse(*second)["echo"]["a"] == 2);
  CHECK(c.WaitClosed());
  CHECK(Eventually([&] { return s.server.connections() == 0; }));
}

TEST_CASE("control: two clients are served at the same time", "[control]") {
  TempDir dir;
  std::mutex mu;
  std::condition_variable cv;
  int inside = 0;
  Loop loop;
  ControlServer server(loop.io(), dir / "ctl", loop.run_blocking());
  // Each request waits until both are inside the handler: this only
  // finishes if the server runs the two clients' handlers concurrently.
  server.Handle("meet", [&](const json&) -> Result<json> {
    std::unique_lock<std::mutex> l(mu);
    inside++;
    cv.notify_all();
    bool met = cv.wait_for(l, 5s, [&] { return inside >= 2; });
    return json{{"met", met}};
  });
  REQUIRE(server.Listen().ok());
  loop.RunOnIo([&] { server.Start(); });

  Result<json> a = Status::IoError("not run"), b = Status::IoError("not run");
  std::thread ta([&] { a = ControlRequest(dir / "ctl", json{{"cmd", "meet"}}); });
  std::thread tb([&] { b = ControlRequest(dir / "ctl", json{{"cmd", "meet"}}); });
  ta.join();
  tb.join();
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a.value()["met"] == true);
  CHECK(b.value()["met"] == true);
  loop.RunOnIo([&] { server.Stop(); });
}

TEST_CASE("control: an oversized line closes only that connection", "[control]") {
  TempDir dir;
  Loop loop;
  EchoServer s(&loop, dir / "ctl");
  Client good(dir / "ctl");
  CHECK(good.Request(json{{"cmd", "echo"}})["echo"]["cmd"] == "echo");

  SECTION("without a newline") {
    Client big(dir / "ctl");
    big.Send(std::string(kControlMaxLine + 4096, 'x'));  // may fail once the server closes
    auto reply = big.ReadLine();
    REQUIRE(reply);
    CHECK(json::parse(*reply)["error"].get<std::string>().find("longer than") != std::string::npos);
    CHECK(big.WaitClosed());
  }
  SECTION("with a newline in the same write") {
    Client big(dir / "ctl");
    std::string huge = "{\"cmd\":\"echo\",\"pad\":\"" + std::string(kControlMaxLine, 'y') + "\"}\n";
    big.Send(huge + "{\"cmd\":\"echo\"}\n");
    auto reply = big.ReadLine();
    REQUIRE(reply);
    CHECK(json::parse(*reply).contains("error"));
    CHECK(big.WaitClosed());
  }
  SECTION("a line of exactly the limit is accepted") {
    Client edge(dir / "ctl");
    std::string prefix = "{\"cmd\":\"echo\",\"pad\":\"";
    std::string line = prefix + std::string(kControlMaxLine - prefix.size() - 2, 'z') + "\"}";
    REQUIRE(line.size() == kControlMaxLine);
    REQUIRE(edge.Send(line + "\n"));
    auto reply = edge.ReadLine();
    REQUIRE(reply);
    CHECK(json::parse(*reply)["echo"]["cmd"] == "echo");
  }
  CHECK(good.Request(json{{"cmd", "echo"}, {"still", true}})["echo"]["still"] == true);
}

TEST_CASE("control: a client vanishing mid-line does not hurt the others", "[control]") {
  TempDir dir;
  Loop loop;
  EchoServer s(&loop, dir / "ctl");
  Client good(dir / "ctl");
  {
    Client gone(dir / "ctl");
    REQUIRE(gone.Send("{\"cmd\":\"ec"));
    CHECK(Eventually([&] { return s.server.connections() == 2; }));
  }
  // The half line is dropped with its connection.
  CHECK(Eventually([&] { return s.server.connections() == 1; }));
  CHECK(good.Request(json{{"cmd", "echo"}, {"ok", 1}})["echo"]["ok"] == 1);

  // A client that leaves while its handler runs: the reply goes nowhere.
  {
    Client gone(dir / "ctl");
    REQUIRE(gone.Send("{\"cmd\":\"echo\"}\n"));
  }
  CHECK(Eventually([&] { return s.server.connections() == 1; }));
  CHECK(good.Request(json{{"cmd", "echo"}, {"ok", 2}})["echo"]["ok"] == 2);
}

TEST_CASE("control: Listen refuses a live server's socket and replaces a stale one", "[control]") {
  TempDir dir;
  Loop loop;
  const std::string path = dir / "run/dede/dedupd.ctl";  // parent directories created

  SECTION("live") {
    EchoServer first(&loop, path);
    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    CHECK(S_ISSOCK(st.st_mode));
    CHECK((st.st_mode & 0777) == 0660);

    ControlServer second(loop.io(), path, loop.run_blocking());
    Status s = second.Listen();
    CHECK(s.code() == Status::Code::kExists);
    CHECK(s.message() == "another dedupd is using " + path);
    // The first one is untouched, and the failed one's Stop (destructor)
    // does not remove its socket.
    second.Stop();
    CHECK(ControlRequest(path, json{{"cmd", "status"}}).ok());
  }
  SECTION("stale") {
    // A socket file nobody listens on: what a killed dedupd leaves.
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
    ::close(fd);
    Result<json> nobody = ControlRequest(path, json{{"cmd", "status"}});
    CHECK(nobody.status().code() == Status::Code::kNotFound);

    EchoServer s(&loop, path);
    Result<json> r = ControlRequest(path, json{{"cmd", "status"}});
    REQUIRE(r.ok());
    CHECK(r.value()["host_id"] == 1);
  }
  SECTION("not a socket") {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    {
      std::FILE* f = std::fopen(path.c_str(), "w");
      REQUIRE(f);
      std::fclose(f);
    }
    ControlServer server(loop.io(), path, loop.run_blocking());
    Status s = server.Listen();
    CHECK(s.code() == Status::Code::kInvalid);  // a configuration error (dedupd exits 2)
    server.Stop();
    CHECK(std::filesystem::exists(path));  // not ours: left alone
  }
}

TEST_CASE("control: ControlRequest to nothing is kNotFound", "[control]") {
  TempDir dir;
  Result<json> r = ControlRequest(dir / "nothing.ctl", json{{"cmd", "status"}});
  REQUIRE(!r.ok());
  CHECK(r.status().code() == Status::Code::kNotFound);
  CHECK(r.status().message().rfind("no dedupd at " + (dir / "nothing.ctl") + " (", 0) == 0);
}

TEST_CASE("control: ControlRequest gives up after its timeout", "[control]") {
  TempDir dir;
  // Declared before the loop: a handler may still read it until the
  // loop's destructor has joined the workers.
  std::atomic<bool> release{false};
  Loop loop;
  ControlServer server(loop.io(), dir / "ctl", loop.run_blocking());
  server.Handle("slow", [&](const json&) -> Result<json> {
    Eventually([&] { return release.load(); });
    return json{{"late", true}};
  });
  REQUIRE(server.Listen().ok());
  loop.RunOnIo([&] { server.Start(); });
  auto start = std::chrono::steady_clock::now();
  Result<json> r = ControlRequest(dir / "ctl", json{{"cmd", "slow"}}, 200ms);
  auto took = std::chrono::steady_clock::now() - start;
  REQUIRE(!r.ok());
  CHECK(r.status().code() == Status::Code::kUnavailable);
  CHECK(r.status().message().find("did not answer within 200 ms") != std::string::npos);
  CHECK(took < 3s);
  release = true;
  loop.RunOnIo([&] { server.Stop(); });
}

TEST_CASE("control: Stop closes connections and unlinks the socket file", "[control]") {
  TempDir dir;
  std::atomic<bool> release{false};
  std::atomic<bool> entered{false};
  Loop loop;
  const std::string path = dir / "ctl";
  ControlServer server(loop.io(), path, loop.run_blocking());
  server.Handle("echo", [](const json& request) -> Result<json> { return request; });
  server.Handle("block", [&](const json&) -> Result<json> {
    entered = true;
    Eventually([&] { return release.load(); });
    return json{{"late", true}};
  });
  REQUIRE(server.Listen().ok());
  loop.RunOnIo([&] { server.Start(); });

  Client idle(path);
  CHECK(idle.Request(json{{"cmd", "echo"}})["cmd"] == "echo");
  Client waiting(path);
  REQUIRE(waiting.Send("{\"cmd\":\"block\"}\n"));
  REQUIRE(Eventually([&] { return entered.load(); }));

  loop.RunOnIo([&] { server.Stop(); });
  CHECK(!std::filesystem::exists(path));
  CHECK(idle.WaitClosed());
  // The reply computed after Stop is dropped, not written to a closed socket.
  release = true;
  CHECK(waiting.WaitClosed());
  CHECK(Eventually([&] { return server.connections() == 0; }));
  CHECK(ControlRequest(path, json{{"cmd", "echo"}}).status().code() == Status::Code::kNotFound);
  server.Stop();  // idempotent
}

TEST_CASE("control: a server destroyed while a handler runs leaves nothing dangling", "[control]") {
  TempDir dir;
  std::atomic<bool> release{false};
  std::atomic<bool> entered{false};
  Loop loop;
  auto server = std::make_unique<ControlServer>(loop.io(), dir / "ctl", loop.run_blocking());
  server->Handle("block", [&](const json&) -> Result<json> {
    entered = true;
    Eventually([&] { return release.load(); });
    return json{{"late", true}};
  });
  REQUIRE(server->Listen().ok());
  loop.RunOnIo([&] { server->Start(); });
  Client c(dir / "ctl");
  REQUIRE(c.Send("{\"cmd\":\"block\"}\n"));
  REQUIRE(Eventually([&] { return entered.load(); }));
  loop.RunOnIo([&] { server.reset(); });
  release = true;
  CHECK(c.WaitClosed());
  // Let the late reply's post run before the loop goes away.
  std::this_thread::sleep_for(50ms);
  loop.RunOnIo([] {});
}

// dedupd's shutdown closes every export once the NBD clients are gone; a
// control handler still running (set-dedup enters an export as a client)
// would find its file closed under it. The shutdown waits for them first.
TEST_CASE("control: WaitForHandlers returns once the handlers started before Stop have",
          "[control]") {
  TempDir dir;
  std::atomic<bool> release{false};
  std::atomic<bool> entered{false};
  std::atomic<bool> returned{false};
  Loop loop;
  ControlServer server(loop.io(), dir / "ctl", loop.run_blocking());
  server.Handle("block", [&](const json&) -> Result<json> {
    entered = true;
    Eventually([&] { return release.load(); }, 30s);
    returned = true;
    return json{{"late", true}};
  });
  REQUIRE(server.Listen().ok());
  loop.RunOnIo([&] { server.Start(); });
  Client c(dir / "ctl");
  REQUIRE(c.Send("{\"cmd\":\"block\"}\n"));
  REQUIRE(Eventually([&] { return entered.load(); }));
  loop.RunOnIo([&] { server.Stop(); });

  auto waited = std::async(std::launch::async, [&] {
    server.WaitForHandlers();
    return returned.load();
  });
  CHECK(waited.wait_for(300ms) == std::future_status::timeout);
  release = true;
  REQUIRE(waited.wait_for(10s) == std::future_status::ready);
  CHECK(waited.get());  // not before the handler had returned
  // With nothing running it returns at once.
  auto again = std::async(std::launch::async, [&] { server.WaitForHandlers(); });
  CHECK(again.wait_for(2s) == std::future_status::ready);
}

// Any number of clients could hold a connection open at once: a script
// looping on the socket could take every descriptor dedupd has. Beyond the
// limit, a connection gets an error line at once and is closed, and is
// counted; once one closes, clients are served again.
TEST_CASE("control: connections beyond the limit are refused with an error, and counted",
          "[control]") {
  TempDir dir;
  Loop loop;
  ControlServer server(loop.io(), dir / "ctl", loop.run_blocking(), /*max_connections=*/2);
  server.Handle("echo", [](const json& request) -> Result<json> {
    return json{{"echo", request}};
  });
  REQUIRE(server.Listen().ok());
  loop.RunOnIo([&] { server.Start(); });
  CHECK(server.max_connections() == 2);

  // Two idle clients take both places.
  Client a(dir / "ctl");
  Client b(dir / "ctl");
  REQUIRE(Eventually([&] { return server.connections() == 2; }));
  // A third one is answered with an error, without being read, and closed.
  Client c(dir / "ctl");
  std::optional<std::string> refusal = c.ReadLine();
  REQUIRE(refusal);
  const json refused = json::parse(*refusal);
  INFO(refused.dump());
  REQUIRE(refused.contains("error"));
  CHECK(refused["error"].get<std::string>().find("too many control connections") !=
        std::string::npos);
  CHECK(refused["error"].get<std::string>().find("at most 2") != std::string::npos);
  CHECK(c.WaitClosed());
  // ControlRequest, as `dede status` uses it, passes the error on.
  Result<json> r = ControlRequest(dir / "ctl", json{{"cmd", "echo"}});
  REQUIRE(r.ok());
  CHECK(r.value().contains("error"));
  CHECK(server.refused() == 2);
  CHECK(server.connections() == 2);
  // The two served clients still are.
  CHECK(a.Request(json{{"cmd", "echo"}, {"x", 1}})["echo"]["x"] == 1);
  // One leaves: a new client is served.
  b.Close();
  REQUIRE(Eventually([&] { return server.connections() == 1; }));
  r = ControlRequest(dir / "ctl", json{{"cmd", "echo"}, {"x", 2}});
  REQUIRE(r.ok());
  CHECK(r.value()["echo"]["x"] == 2);
  CHECK(server.refused() == 2);
  loop.RunOnIo([&] { server.Stop(); });
}

// With the limit reached by clients that connect and send nothing (a hung
// probe, a forgotten socat), every operator was locked out of `dede status`
// until dedupd restarted. A newcomer now takes the place of the connection
// idle longest, once that one has been idle for idle_evict; connections
// used more recently than that keep theirs, and the newcomer is refused.
TEST_CASE("control: at the limit, a new client takes the place of the connection idle longest",
          "[control]") {
  TempDir dir;
  Loop loop;
  const auto idle_evict = 2s;
  ControlServer server(loop.io(), dir / "ctl", loop.run_blocking(), /*max_connections=*/2,
                       idle_evict);
  server.Handle("echo", [](const json& request) -> Result<json> {
    return json{{"echo", request}};
  });
  REQUIRE(server.Listen().ok());
  loop.RunOnIo([&] { server.Start(); });

  Client silent(dir / "ctl");  // connects and never sends a byte
  Client used(dir / "ctl");
  REQUIRE(Eventually([&] { return server.connections() == 2; }));
  // Neither has been idle for 2 s: a newcomer is refused.
  Result<json> r = ControlRequest(dir / "ctl", json{{"cmd", "echo"}, {"x", 1}});
  REQUIRE(r.ok());
  CHECK(r.value().contains("error"));
  CHECK(server.refused() == 1);
  CHECK(server.evicted() == 0);

  std::this_thread::sleep_for(idle_evict / 2);
  CHECK(used.Request(json{{"cmd", "echo"}, {"x", 2}})["echo"]["x"] == 2);
  std::this_thread::sleep_for(idle_evict / 2 + 300ms);
  // `silent` has been idle for 2.3 s, `used` for 1.3 s: `silent` goes.
  r = ControlRequest(dir / "ctl", json{{"cmd", "echo"}, {"x", 3}});
  REQUIRE(r.ok());
  INFO(r.value().dump());
  CHECK(r.value()["echo"]["x"] == 3);
  CHECK(server.evicted() == 1);
  CHECK(server.refused() == 1);
  CHECK(silent.WaitClosed());
  CHECK(used.Request(json{{"cmd", "echo"}, {"x", 4}})["echo"]["x"] == 4);
  loop.RunOnIo([&] { server.Stop(); });
}
