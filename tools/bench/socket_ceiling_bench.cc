// dede-bench-socket-ceiling: the most any block server that copies its
// data through a Unix stream socket can reach on this machine at queue
// depth 1, as a fraction of the device's own throughput (docs/BENCHMARKS.md,
// "NBD data path", target (b)).
//
// dedupd's NBD target compares fio over NBD at QD1 with the volume's
// direct O_DIRECT throughput at QD1. Whatever dedupd does, every request
// also crosses a Unix socket: the client copies a WRITE's payload into the
// kernel and dedupd copies it out (a READ's data the other way round), and
// the two processes wake each other. This tool measures that floor with
// the least possible server, so dedupd's figure can be read against what
// is attainable at all:
//
//  * direct      one process, pwrite/pread of R bytes at QD1 on FILE
//                (O_DIRECT), sequential over the region, like the volume
//                benchmark's direct side;
//  * serial      a client process and a server process on a socketpair. The
//                client sends a 28-byte request (and a WRITE's payload) and
//                waits for the 16-byte reply (and a READ's data); the server
//                receives with MSG_WAITALL into an aligned buffer, does the
//                same pwrite/pread and replies. No protocol parsing, no
//                threads, no hashing: one blocking loop;
//  * overlapped  READ: the server reads the request in `--pieces` pieces on
//                a second thread and sends each piece as soon as it is in,
//                so the device read of one piece overlaps the socket copy
//                of the previous one. WRITE: the server receives the
//                payload piece by piece and a second thread writes each
//                piece as soon as it is in, so the device write of one
//                piece overlaps the socket copy of the next; the reply
//                goes when every piece is written.
//
// Phases alternate within each repetition (direct first in odd
// repetitions, the servers first in even ones) and every ratio is taken
// inside one repetition; the median over repetitions is reported. The
// machines are shared and noisy: compare ratios, not MB/s across runs.
//
// Exit status: 0 success, 1 operational error, 2 usage error.
#include <fcntl.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/program_options.hpp>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tools/bench/bench_util.h"

namespace dede::bench {
namespace {

namespace po = boost::program_options;
using json = nlohmann::json;

constexpr uint32_t kOpWrite = 1, kOpRead = 2, kOpStop = 3;
constexpr size_t kRequestBytes = 28;  // like an NBD request header
constexpr size_t kReplyBytes = 16;    // like an NBD simple reply header

struct Options {
  std::string file;
  uint64_t region = 1ull << 30;
  size_t request = 1 << 20;
  double seconds = 2;
  int reps = 3;
  int pieces = 4;
  bool pin = false;  // client on CPU 0; server and direct side on CPU 1
  std::string json_path;
};

AlignedBuf Aligned(size_t n, uint8_t fill) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, n) != 0) {
    std::fprintf(stderr, "out of memory\n");
    std::exit(1);
  }
  std::memset(p, fill, n);
  return AlignedBuf(static_cast<uint8_t*>(p));
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "dede-bench-socket-ceiling: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

void SendAll(int fd, const void* p, size_t n, int flags = 0) {
  const auto* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    ssize_t w = ::send(fd, b, n, flags | MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) Die("send");
    b += w;
    n -= static_cast<size_t>(w);
  }
}

// False at end of stream before the first byte.
bool RecvAll(int fd, void* p, size_t n) {
  auto* b = static_cast<uint8_t*>(p);
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::recv(fd, b + got, n - got, MSG_WAITALL);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0 && got == 0) return false;
    if (r <= 0) Die("recv");
    got += static_cast<size_t>(r);
  }
  return true;
}

void DeviceIo(int fd, bool write, uint8_t* buf, size_t len, uint64_t off) {
  ssize_t n = write ? ::pwrite(fd, buf, len, static_cast<off_t>(off))
                    : ::pread(fd, buf, len, static_cast<off_t>(off));
  if (n != static_cast<ssize_t>(len)) Die(write ? "pwrite" : "pread");
}

struct Request {
  uint32_t op = 0;
  uint64_t offset = 0;
  uint32_t length = 0;
};

void EncodeRequest(const Request& r, uint8_t* out) {
  std::memset(out, 0, kRequestBytes);
  std::memcpy(out, &r.op, 4);
  std::memcpy(out + 8, &r.offset, 8);
  std::memcpy(out + 16, &r.length, 4);
}

Request DecodeRequest(const uint8_t* in) {
  Request r;
  std::memcpy(&r.op, in, 4);
  std::memcpy(&r.offset, in + 8, 8);
  std::memcpy(&r.length, in + 16, 4);
  return r;
}

// Reads one request in pieces on a helper thread; the caller sends each
// piece once it is in. One hand-off to the helper per request, one wake-up
// back per piece: the least a threaded overlap costs.
class PieceReader {
 public:
  PieceReader(int dev, uint8_t* buf, int pieces) : dev_(dev), buf_(buf), pieces_(pieces) {
    thread_ = std::thread([this] { Run(); });
  }
  ~PieceReader() {
    {
      std::lock_guard<std::mutex> l(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Start(uint64_t off, size_t len) {
    {
      std::lock_guard<std::mutex> l(mu_);
      off_ = off;
      len_ = len;
      done_ = 0;
      pending_ = true;
    }
    cv_.notify_all();
  }
  // Blocks until piece i (0-based) is in the buffer; returns its span.
  std::pair<size_t, size_t> Wait(int i) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return done_ > i; });
    return Span(i);
  }

 private:
  std::pair<size_t, size_t> Span(int i) const {
    const size_t piece = (len_ / pieces_ + 4095) / 4096 * 4096;
    const size_t begin = std::min(len_, piece * static_cast<size_t>(i));
    const size_t end = i + 1 == pieces_ ? len_ : std::min(len_, begin + piece);
    return {begin, end - begin};
  }
  void Run() {
    while (true) {
      uint64_t off;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return quit_ || pending_; });
        if (quit_) return;
        pending_ = false;
        off = off_;
      }
      for (int i = 0; i < pieces_; i++) {
        auto [begin, n] = Span(i);
        if (n > 0) DeviceIo(dev_, false, buf_ + begin, n, off + begin);
        {
          std::lock_guard<std::mutex> l(mu_);
          done_ = i + 1;
        }
        cv_.notify_all();
      }
    }
  }

  const int dev_;
  uint8_t* const buf_;
  const int pieces_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool quit_ = false;
  bool pending_ = false;
  uint64_t off_ = 0;
  size_t len_ = 0;
  int done_ = 0;
  std::thread thread_;
};

// Writes the pieces of one request on a helper thread as the caller hands
// them over; the caller receives the next piece meanwhile.
class PieceWriter {
 public:
  PieceWriter(int dev, uint8_t* buf) : dev_(dev), buf_(buf) {
    thread_ = std::thread([this] { Run(); });
  }
  ~PieceWriter() {
    {
      std::lock_guard<std::mutex> l(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // Bytes [begin, begin + n) of the buffer are in: write them at off + begin.
  void Post(uint64_t off, size_t begin, size_t n) {
    {
      std::lock_guard<std::mutex> l(mu_);
      queue_.push_back({off, begin, n});
      posted_++;
    }
    cv_.notify_all();
  }
  // Blocks until every posted piece is written.
  void Drain() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return written_ == posted_; });
  }

 private:
  struct Piece {
    uint64_t off;
    size_t begin, n;
  };
  void Run() {
    while (true) {
      Piece p;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return quit_ || !queue_.empty(); });
        if (queue_.empty()) return;
        p = queue_.front();
        queue_.erase(queue_.begin());
      }
      DeviceIo(dev_, true, buf_ + p.begin, p.n, p.off + p.begin);
      {
        std::lock_guard<std::mutex> l(mu_);
        written_++;
      }
      cv_.notify_all();
    }
  }

  const int dev_;
  uint8_t* const buf_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool quit_ = false;
  std::vector<Piece> queue_;
  uint64_t posted_ = 0, written_ = 0;
  std::thread thread_;
};

// The server process: one blocking loop over the socket until kOpStop.
[[noreturn]] void Serve(int sock, const std::string& file, size_t max_len, bool overlapped,
                        int pieces) {
  int dev = ::open(file.c_str(), O_RDWR | O_DIRECT);
  if (dev < 0) Die("open " + file);
  AlignedBuf buf = Aligned(max_len, 0);
  std::unique_ptr<PieceReader> reader;
  std::unique_ptr<PieceWriter> writer;
  if (overlapped) {
    reader = std::make_unique<PieceReader>(dev, buf.get(), pieces);
    writer = std::make_unique<PieceWriter>(dev, buf.get());
  }
  uint8_t head[kRequestBytes];
  uint8_t reply[kReplyBytes] = {};
  while (RecvAll(sock, head, kRequestBytes)) {
    Request r = DecodeRequest(head);
    if (r.op == kOpStop || r.length > max_len) break;
    if (r.op == kOpWrite && writer) {
      const size_t piece = (r.length / pieces + 4095) / 4096 * 4096;
      bool gone = false;
      for (size_t begin = 0; begin < r.length && !gone; begin += piece) {
        const size_t n = std::min(piece, r.length - begin);
        gone = !RecvAll(sock, buf.get() + begin, n);
        if (!gone) writer->Post(r.offset, begin, n);
      }
      writer->Drain();
      if (gone) break;
      SendAll(sock, reply, kReplyBytes);
    } else if (r.op == kOpWrite) {
      if (!RecvAll(sock, buf.get(), r.length)) break;
      DeviceIo(dev, true, buf.get(), r.length, r.offset);
      SendAll(sock, reply, kReplyBytes);
    } else if (reader) {
      reader->Start(r.offset, r.length);
      SendAll(sock, reply, kReplyBytes, MSG_MORE);
      for (int i = 0; i < pieces; i++) {
        auto [begin, n] = reader->Wait(i);
        if (n > 0) SendAll(sock, buf.get() + begin, n, i + 1 < pieces ? MSG_MORE : 0);
      }
    } else {
      DeviceIo(dev, false, buf.get(), r.length, r.offset);
      SendAll(sock, reply, kReplyBytes, MSG_MORE);
      SendAll(sock, buf.get(), r.length);
    }
  }
  reader.reset();
  writer.reset();
  ::close(dev);
  std::_Exit(0);
}

// With --pin: the calling thread runs on `cpu` only.
void PinTo(const Options& o, int cpu) {
  if (!o.pin) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (::sched_setaffinity(0, sizeof(set), &set) != 0) Die("sched_setaffinity");
}

// Bytes per second of QD1 requests for `seconds`, sequential over the region.
double RunDirect(const Options& o, bool write) {
  PinTo(o, 1);
  int dev = ::open(o.file.c_str(), O_RDWR | O_DIRECT);
  if (dev < 0) Die("open " + o.file);
  AlignedBuf buf = Aligned(o.request, 0x5c);
  const uint64_t slots = o.region / o.request;
  uint64_t done = 0;
  const double t0 = ClockSeconds(CLOCK_MONOTONIC);
  double t = t0;
  while (t - t0 < o.seconds) {
    DeviceIo(dev, write, buf.get(), o.request, (done % slots) * o.request);
    done++;
    t = ClockSeconds(CLOCK_MONOTONIC);
  }
  ::close(dev);
  return static_cast<double>(done * o.request) / (t - t0);
}

double RunServer(const Options& o, bool write, bool overlapped) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) Die("socketpair");
  pid_t pid = ::fork();
  if (pid < 0) Die("fork");
  if (pid == 0) {
    PinTo(o, 1);  // before the server's threads start: they inherit it
    ::close(sv[0]);
    Serve(sv[1], o.file, o.request, overlapped, o.pieces);
  }
  ::close(sv[1]);
  PinTo(o, 0);
  const int sock = sv[0];
  // The client's buffer is ordinary heap memory, like fio's.
  std::vector<uint8_t> data(o.request, 0xa7);
  uint8_t head[kRequestBytes];
  uint8_t reply[kReplyBytes];
  const uint64_t slots = o.region / o.request;
  uint64_t done = 0;
  const double t0 = ClockSeconds(CLOCK_MONOTONIC);
  double t = t0;
  while (t - t0 < o.seconds) {
    Request r{write ? kOpWrite : kOpRead, (done % slots) * o.request,
              static_cast<uint32_t>(o.request)};
    EncodeRequest(r, head);
    if (write) {
      SendAll(sock, head, kRequestBytes, MSG_MORE);
      SendAll(sock, data.data(), data.size());
      if (!RecvAll(sock, reply, kReplyBytes)) Die("server gone");
    } else {
      SendAll(sock, head, kRequestBytes);
      if (!RecvAll(sock, reply, kReplyBytes) || !RecvAll(sock, data.data(), data.size())) {
        Die("server gone");
      }
    }
    done++;
    t = ClockSeconds(CLOCK_MONOTONIC);
  }
  EncodeRequest(Request{kOpStop, 0, 0}, head);
  SendAll(sock, head, kRequestBytes);
  ::close(sock);
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "dede-bench-socket-ceiling: the server process failed\n");
    std::exit(1);
  }
  return static_cast<double>(done * o.request) / (t - t0);
}

int Main(int argc, char** argv) {
  Options o;
  uint64_t region_mib = o.region >> 20;
  size_t request_kib = o.request >> 10;
  po::options_description desc(
      "Usage: dede-bench-socket-ceiling --file PATH [options]\n\n"
      "The most a block server copying through a Unix socket can reach at QD1,\n"
      "against O_DIRECT I/O on the same file (docs/BENCHMARKS.md). FILE must\n"
      "exist and be at least --region-mib long; it is overwritten.\n\nOptions");
  desc.add_options()("help,h", "show this help")(
      "file", po::value(&o.file)->required(), "preallocated file on the disk to measure")(
      "region-mib", po::value(&region_mib)->default_value(region_mib),
      "MiB of FILE the requests walk through")(
      "request-kib", po::value(&request_kib)->default_value(request_kib), "request size")(
      "seconds", po::value(&o.seconds)->default_value(o.seconds), "time per phase")(
      "reps", po::value(&o.reps)->default_value(o.reps), "repetitions")(
      "pieces", po::value(&o.pieces)->default_value(o.pieces),
      "pieces of the overlapped servers")(
      "pin", po::bool_switch(&o.pin),
      "client on CPU 0, the server and the direct side on CPU 1 (as run-nbd-bench pins fio "
      "and dedupd)")("json", po::value(&o.json_path),
                                               "also write the results here");
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, desc), vm);
    if (vm.count("help")) {
      std::cout << desc << "\n";
      return 0;
    }
    po::notify(vm);
  } catch (const std::exception& e) {
    std::cerr << "dede-bench-socket-ceiling: " << e.what() << "\n" << desc << "\n";
    return 2;
  }
  o.region = region_mib << 20;
  o.request = request_kib << 10;
  if (o.request == 0 || o.request % 4096 != 0 || o.region < o.request || o.reps < 1 ||
      o.pieces < 1 || o.seconds <= 0) {
    std::cerr << "dede-bench-socket-ceiling: --request-kib must be a positive multiple of 4, "
                 "--region-mib at least one request, --reps and --pieces at least 1\n";
    return 2;
  }
  struct stat st;
  if (::stat(o.file.c_str(), &st) != 0) Die("stat " + o.file);
  if (static_cast<uint64_t>(st.st_size) < o.region) {
    std::cerr << "dede-bench-socket-ceiling: " << o.file << " is shorter than --region-mib\n";
    return 2;
  }

  std::vector<double> w_ratio, ow_ratio, r_ratio, o_ratio;
  json reps = json::array();
  for (int rep = 1; rep <= o.reps; rep++) {
    double dw, sw, ow, dr, sr, orr;
    if (rep % 2) {
      dw = RunDirect(o, true);
      sw = RunServer(o, true, false);
      ow = RunServer(o, true, true);
      dr = RunDirect(o, false);
      sr = RunServer(o, false, false);
      orr = RunServer(o, false, true);
    } else {
      ow = RunServer(o, true, true);
      sw = RunServer(o, true, false);
      dw = RunDirect(o, true);
      orr = RunServer(o, false, true);
      sr = RunServer(o, false, false);
      dr = RunDirect(o, false);
    }
    w_ratio.push_back(sw / dw);
    ow_ratio.push_back(ow / dw);
    r_ratio.push_back(sr / dr);
    o_ratio.push_back(orr / dr);
    std::printf(
        "rep %d: write direct %.1f MB/s, serial server %.1f MB/s (%.1f%%), overlapped server "
        "%.1f MB/s (%.1f%%); read direct %.1f MB/s, serial server %.1f MB/s (%.1f%%), overlapped "
        "server %.1f MB/s (%.1f%%)\n",
        rep, dw / 1e6, sw / 1e6, 100 * sw / dw, ow / 1e6, 100 * ow / dw, dr / 1e6, sr / 1e6,
        100 * sr / dr, orr / 1e6, 100 * orr / dr);
    std::fflush(stdout);
    reps.push_back({{"write_direct_Bps", dw},
                    {"write_serial_Bps", sw},
                    {"write_overlapped_Bps", ow},
                    {"read_direct_Bps", dr},
                    {"read_serial_Bps", sr},
                    {"read_overlapped_Bps", orr}});
  }
  std::printf(
      "ceiling at QD1, %zu KiB requests (median of %d reps): write %.1f%% of direct (serial "
      "server), %.1f%% (overlapped, %d pieces); read %.1f%% (serial), %.1f%% (overlapped)\n",
      o.request >> 10, o.reps, 100 * Median(w_ratio), 100 * Median(ow_ratio), o.pieces,
      100 * Median(r_ratio), 100 * Median(o_ratio));
  if (!o.json_path.empty()) {
    json j = {{"request_bytes", o.request},
              {"pieces", o.pieces},
              {"reps", reps},
              {"write_serial_ratio", Median(w_ratio)},
              {"write_overlapped_ratio", Median(ow_ratio)},
              {"read_serial_ratio", Median(r_ratio)},
              {"read_overlapped_ratio", Median(o_ratio)}};
    std::ofstream f(o.json_path);
    f << j.dump(2) << "\n";
    if (!f.good()) Die("writing " + o.json_path);
  }
  return 0;
}

}  // namespace
}  // namespace dede::bench

int main(int argc, char** argv) { return dede::bench::Main(argc, argv); }
