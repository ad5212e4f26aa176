// dedupd's data path driven by real NBD clients: qemu-img, qemu-io, nbdcopy
// and fio talk to a dedupd process over its Unix socket; what they wrote is
// read back byte-exact, and each file's write log must hold exactly the
// fingerprints of the blocks last written whole (checked against XXH3-128
// computed here, independently of dede's code, over the data read back
// through NBD). A raw NBD client in this file sends malformed traffic.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <boost/endian/conversion.hpp>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "agent/dedup_policy.h"
#include "kmod/writemon/write_log.h"
#include "tests/integration/rig.h"
#include "tests/random_bytes.h"
#include "tests/socket_client.h"
#include "volume/fsck.h"
#include "volume/volume.h"

namespace dede {
namespace {

using test::BinaryPath;
using test::CountOf;
using test::CreateSparseFile;
using test::DescribeRun;
using test::ReadWholeFile;
using test::DedupdProcess;
using test::ProcessResult;
using test::RequireProgram;
using test::RunProcess;
using test::TempDir;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kBlk = 4096;

std::string Describe(const std::vector<std::string>& argv, const ProcessResult& r) {
  return DescribeRun(argv, r);
}

ProcessResult RunOk(const std::vector<std::string>& argv, int timeout_s = 300) {
  ProcessResult r = RunProcess(argv, timeout_s);
  INFO(Describe(argv, r));
  REQUIRE(r.exit_code == 0);
  return r;
}

void Dede(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {BinaryPath("dede")};
  argv.insert(argv.end(), args.begin(), args.end());
  RunOk(argv);
}

std::vector<uint8_t> ReadFile(const std::string& path) { return ReadWholeFile(path); }

void WriteFile(const std::string& path, const std::vector<uint8_t>& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  REQUIRE(out.good());
}

// A raw image with random data, runs of zeros, repeated blocks and holes.
std::vector<uint8_t> MakeImage(uint64_t size, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> img(size, 0);
  for (uint64_t off = 0; off < size;) {
    uint64_t run = (1 + rng() % 64) * kBlk;
    run = std::min(run, size - off);
    switch (rng() % 4) {
      case 0:  // zeros
        break;
      case 1: {  // one repeated block
        std::vector<uint8_t> blk(kBlk);
        for (auto& b : blk) b = static_cast<uint8_t>(rng());
        for (uint64_t i = 0; i < run; i++) img[off + i] = blk[i % kBlk];
        break;
      }
      default:
        dede::test::FillRandom(rng, &img[off], run);
    }
    off += run;
  }
  return img;
}

// A formatted volume file with regular files of the given sizes.
struct TestVolume {
  TempDir dir;
  std::string vol = dir.file("vol.img");
  std::string sock = dir.file("nbd.sock");
  explicit TestVolume(const std::vector<std::pair<std::string, uint64_t>>& files,
                      uint64_t vol_size = 512 * kMiB, const std::string& hash = "") {
    CreateSparseFile(vol, vol_size);
    std::vector<std::string> fmt = {"format", vol};
    if (!hash.empty()) fmt.insert(fmt.end(), {"--hash", hash});
    Dede(fmt);
    for (const auto& [name, size] : files) Dede({"create", vol, name, "--size", std::to_string(size)});
  }
};

// Reads an export through NBD (qemu-img) into memory.
std::vector<uint8_t> ReadExport(const TempDir& dir, const DedupdProcess& d, const std::string& name) {
  std::string out = dir.file("readback-" + name + ".raw");
  RunOk({RequireProgram("qemu-img"), "convert", "-f", "raw", "-O", "raw", d.Uri(name), out});
  std::vector<uint8_t> data = ReadFile(out);
  ::unlink(out.c_str());
  return data;
}

void RequireFsckClean(const std::string& vol) {
  std::vector<std::string> argv = {BinaryPath("dede"), "fsck", vol};
  ProcessResult r = RunProcess(argv);
  INFO(Describe(argv, r));
  REQUIRE(r.exit_code == 0);
}

// Fingerprint as dede stores it, computed here with libxxhash directly.
Fingerprint IndependentXxh128(const uint8_t* blk) {
  XXH128_hash_t h = XXH3_128bits(blk, kBlk);
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);
  Fingerprint fp;
  fp.size = 16;
  std::memcpy(fp.bytes.data(), c.digest, 16);
  return fp;
}

// The write log of `name` replayed: block -> record.
struct LogView {
  FileId owner;  // the file the log belongs to
  bool exists = false;
  std::map<uint64_t, BlockRecord> records;
  WriteLogScanStats stats;
};
LogView ReadLog(const std::string& vol_path, const std::string& name) {
  OpenOptions oo;
  oo.read_only = true;
  auto ov = OpenVolumeSpec(vol_path, oo);
  REQUIRE(ov.ok());
  auto info = ov->volume->Lookup(name);
  REQUIRE(info.ok());
  LogView v;
  v.owner = info->id;
  auto log = OpenWriteLog(ov->volume.get(), info->id);
  if (!log.ok()) {
    REQUIRE(log.status().code() == Status::Code::kNotFound);
    return v;
  }
  v.exists = true;
  auto st = ReplayWriteLog(log->get(), ov->volume->superblock().hash_algo, ov->volume->superblock().uuid,
                           info->id);
  REQUIRE(st.ok());
  v.records = st->records;
  v.stats = st->stats;
  return v;
}

// Requires the log to hold exactly `expect_full` blocks, each with the
// fingerprint of `content`'s block.
void RequireLogMatches(const LogView& log, const std::vector<bool>& full,
                       const std::vector<uint8_t>& content) {
  REQUIRE(log.stats.corrupt_frames == 0);
  REQUIRE(log.stats.dropped_records == 0);
  uint64_t expected = 0;
  for (uint64_t b = 0; b < full.size(); b++) {
    auto it = log.records.find(b);
    if (!full[b]) {
      INFO("block " << b << " was not last written whole, yet the log has a record for it");
      REQUIRE(it == log.records.end());
      continue;
    }
    expected++;
    INFO("block " << b << " was last written whole");
    REQUIRE(it != log.records.end());
    REQUIRE(it->second.fp == IndependentXxh128(&content[b * kBlk]));
  }
  REQUIRE(log.records.size() == expected);
  REQUIRE(expected > 0);  // the workload must have written whole blocks
}

// ------------------------------------------------------------ raw client

// A minimal NBD client for sending exactly the bytes a test wants.
class RawClient {
 public:
  explicit RawClient(const std::string& socket_path) {
    fd_ = test::ConnectUnix(socket_path, /*recv_timeout_s=*/10);
  }
  ~RawClient() { Close(); }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  // The server may already have closed: tests read next.
  void Send(const std::vector<uint8_t>& b) { (void)test::SendAll(fd_, b.data(), b.size()); }
  // Reads exactly n bytes; false on EOF/error/timeout.
  bool Recv(void* buf, size_t n) { return test::RecvAll(fd_, buf, n); }
  // True when the server closed the connection (EOF within the timeout).
  bool ServerClosed() {
    uint8_t b[4096];
    while (true) {
      ssize_t r = ::recv(fd_, b, sizeof(b), 0);
      if (r == 0) return true;
      if (r < 0) return errno == ECONNRESET;
    }
  }

  // Greeting + client flags (default FIXED_NEWSTYLE | NO_ZEROES); returns
  // false if the greeting is wrong.
  bool Hello(uint32_t client_flags = 3) {
    uint8_t g[18];
    if (!Recv(g, sizeof(g))) return false;
    if (boost::endian::load_big_u64(g) != 0x4e42444d41474943ull) return false;
    if (boost::endian::load_big_u64(g + 8) != 0x49484156454F5054ull) return false;
    std::vector<uint8_t> f;
    test::PutBig32(&f, client_flags);
    Send(f);
    return true;
  }
  void SendOption(uint32_t opt, const std::vector<uint8_t>& data) {
    std::vector<uint8_t> v;
    test::PutBig64(&v, 0x49484156454F5054ull);
    test::PutBig32(&v, opt);
    test::PutBig32(&v, static_cast<uint32_t>(data.size()));
    v.insert(v.end(), data.begin(), data.end());
    Send(v);
  }
  struct OptReply {
    uint32_t option = 0, type = 0;
    std::vector<uint8_t> data;
  };
  bool RecvOptReply(OptReply* r) {
    uint8_t h[20];
    if (!Recv(h, sizeof(h))) return false;
    if (boost::endian::load_big_u64(h) != 0x0003e889045565a9ull) return false;
    r->option = boost::endian::load_big_u32(h + 8);
    r->type = boost::endian::load_big_u32(h + 12);
    uint32_t len = boost::endian::load_big_u32(h + 16);
    r->data.resize(len);
    return len == 0 || Recv(r->data.data(), len);
  }
  // NBD_OPT_GO; returns the export size, or -1 with the error text.
  int64_t Go(const std::string& name, std::string* error = nullptr) {
    return GoOrInfo(7, name, error);
  }
  // NBD_OPT_INFO, the same way (the session stays in negotiation).
  int64_t Info(const std::string& name, std::string* error = nullptr) {
    return GoOrInfo(6, name, error);
  }
  int64_t GoOrInfo(uint32_t option, const std::string& name, std::string* error) {
    std::vector<uint8_t> d;
    test::PutBig32(&d, static_cast<uint32_t>(name.size()));
    d.insert(d.end(), name.begin(), name.end());
    test::PutBig16(&d, 0);
    SendOption(option, d);
    int64_t size = -1;
    while (true) {
      OptReply r;
      if (!RecvOptReply(&r)) return -1;
      if (r.type == 1) return size;                 // ACK
      if (r.type & 0x80000000u) {
        if (error) *error = std::string(r.data.begin(), r.data.end());
        return -1;
      }
      if (r.type == 3 && r.data.size() >= 12 && boost::endian::load_big_u16(r.data.data()) == 0) {
        size = static_cast<int64_t>(boost::endian::load_big_u64(r.data.data() + 2));
      }
    }
  }
  void SendRequest(uint16_t type, uint64_t cookie, uint64_t offset, uint32_t length,
                   uint16_t flags = 0, uint32_t magic = 0x25609513) {
    std::vector<uint8_t> v;
    test::PutBig32(&v, magic);
    test::PutBig16(&v, flags);
    test::PutBig16(&v, type);
    test::PutBig64(&v, cookie);
    test::PutBig64(&v, offset);
    test::PutBig32(&v, length);
    Send(v);
  }
  // Simple reply: returns false on EOF; sets error and cookie.
  bool RecvReply(uint32_t* error, uint64_t* cookie) {
    uint8_t h[16];
    if (!Recv(h, 16)) return false;
    if (boost::endian::load_big_u32(h) != 0x67446698) return false;
    *error = boost::endian::load_big_u32(h + 4);
    *cookie = boost::endian::load_big_u64(h + 8);
    return true;
  }

 private:
  int fd_ = -1;
};

// -------------------------------------------------------------------- tests

TEST_CASE("qemu-img converts a raw image into an export and back out byte-exact", "[nbd]") {
  TestVolume tv({{"disk", 64 * kMiB}});
  std::vector<uint8_t> img = MakeImage(64 * kMiB, 7);
  std::string in = tv.dir.file("in.raw");
  WriteFile(in, img);
  DedupdProcess d(tv.vol, 1, tv.sock);
  std::string qemu_img = RequireProgram("qemu-img");
  RunOk({qemu_img, "convert", "-n", "-f", "raw", "-O", "raw", in, d.Uri("disk")});
  ProcessResult info = RunOk({qemu_img, "info", "--output=json", d.Uri("disk")});
  REQUIRE(info.out.find("\"virtual-size\": 67108864") != std::string::npos);
  REQUIRE(ReadExport(tv.dir, d, "disk") == img);
  RunOk({qemu_img, "compare", "-f", "raw", "-F", "raw", in, d.Uri("disk")});
  REQUIRE(d.Stop() == 0);
  RequireFsckClean(tv.vol);
  // What was acknowledged is on the volume, read without dedupd.
  std::string out = tv.dir.file("out.raw");
  Dede({"export", tv.vol, "disk", out});
  REQUIRE(ReadFile(out) == img);
  // Every block of the image was written whole by qemu-img except the
  // all-zero ones qemu-img skips (it writes zeros as holes or not at all).
  LogView log = ReadLog(tv.vol, "disk");
  REQUIRE(log.exists);
  for (const auto& [b, rec] : log.records) {
    REQUIRE(rec.fp == IndependentXxh128(&img[b * kBlk]));
  }
  uint64_t nonzero = 0;
  for (uint64_t b = 0; b < img.size() / kBlk; b++) {
    bool zero = true;
    for (uint64_t i = 0; i < kBlk && zero; i++) zero = img[b * kBlk + i] == 0;
    if (!zero) {
      nonzero++;
      INFO("non-zero block " << b);
      REQUIRE(log.records.count(b) == 1);
    }
  }
  REQUIRE(nonzero > 1000);
}

// A seeded qemu-io script of aligned and unaligned writes, write-zeroes and
// discards, mirrored in a model; reads with pattern checks inline.
struct QemuIoScript {
  std::vector<std::string> cmds;
  std::vector<uint8_t> model;
  std::vector<bool> full;  // block last changed by a whole-block write

  QemuIoScript(uint64_t size, uint32_t seed, int ops) : model(size, 0), full(size / kBlk, false) {
    std::mt19937 rng(seed);
    const uint64_t blocks = size / kBlk;
    for (int i = 0; i < ops; i++) {
      int kind = static_cast<int>(rng() % 10);
      uint64_t off, len;
      if (kind < 4) {  // aligned write
        off = (rng() % blocks) * kBlk;
        len = std::min<uint64_t>((1 + rng() % 16) * kBlk, size - off);
      } else {
        off = rng() % size;
        len = std::min<uint64_t>(1 + rng() % 20000, size - off);
      }
      uint8_t pat = static_cast<uint8_t>(1 + rng() % 250);
      char buf[128];
      if (kind < 7) {
        std::snprintf(buf, sizeof(buf), "write -P 0x%02x %llu %llu", pat,
                      static_cast<unsigned long long>(off), static_cast<unsigned long long>(len));
        Apply(off, len, pat, /*hashed=*/true);
      } else if (kind == 7) {
        std::snprintf(buf, sizeof(buf), "write -z %llu %llu", static_cast<unsigned long long>(off),
                      static_cast<unsigned long long>(len));
        Apply(off, len, 0, false);
      } else if (kind == 8) {
        std::snprintf(buf, sizeof(buf), "write -z -u %llu %llu",
                      static_cast<unsigned long long>(off), static_cast<unsigned long long>(len));
        Apply(off, len, 0, false);
      } else {
        std::snprintf(buf, sizeof(buf), "discard %llu %llu", static_cast<unsigned long long>(off),
                      static_cast<unsigned long long>(len));
        Apply(off, len, 0, false);
      }
      cmds.push_back(buf);
      if (i % 10 == 9) {  // read back a range and check it against the model
        uint64_t roff = (rng() % blocks) * kBlk;
        // The range holds one pattern only if the model says so; pick a
        // single block and use its first byte when uniform.
        bool uniform = true;
        for (uint64_t j = 1; j < kBlk && uniform; j++) uniform = model[roff + j] == model[roff];
        if (uniform) {
          std::snprintf(buf, sizeof(buf), "read -P 0x%02x %llu 4096", model[roff],
                        static_cast<unsigned long long>(roff));
          cmds.push_back(buf);
        }
      }
    }
  }

  void Apply(uint64_t off, uint64_t len, uint8_t pat, bool hashed) {
    std::fill(model.begin() + static_cast<long>(off), model.begin() + static_cast<long>(off + len), pat);
    for (uint64_t b = off / kBlk; b <= (off + len - 1) / kBlk; b++) {
      bool whole = b * kBlk >= off && (b + 1) * kBlk <= off + len;
      full[b] = hashed && whole;
    }
  }

  std::vector<std::string> Argv(const std::string& uri) const {
    std::vector<std::string> argv = {RequireProgram("qemu-io"), "-f", "raw", "-d", "unmap"};
    for (const auto& c : cmds) {
      argv.push_back("-c");
      argv.push_back(c);
    }
    argv.push_back(uri);
    return argv;
  }
};

TEST_CASE("qemu-io aligned and unaligned writes and write-zeroes and discards with an exact write log",
          "[nbd]") {
  const uint64_t size = 4 * kMiB;
  TestVolume tv({{"vm1", size}, {"vm2", size}, {"optout", size}});
  Dede({"set", tv.vol, "optout", "dedup=off"});
  DedupdProcess d(tv.vol, 1, tv.sock);

  QemuIoScript s1(size, 11, 400), s2(size, 12, 400), s3(size, 13, 200);
  // Two VMs written at the same time, plus an opted-out one.
  ProcessResult r1, r2, r3;
  std::thread t1([&] { r1 = RunProcess(s1.Argv(d.Uri("vm1")), 300); });
  std::thread t2([&] { r2 = RunProcess(s2.Argv(d.Uri("vm2")), 300); });
  r3 = RunProcess(s3.Argv(d.Uri("optout")), 300);
  t1.join();
  t2.join();
  for (const ProcessResult* r : {&r1, &r2, &r3}) {
    INFO(Describe({"qemu-io"}, *r));
    REQUIRE(r->exit_code == 0);
    REQUIRE(r->out.find("fail") == std::string::npos);
    REQUIRE(r->out.find("error") == std::string::npos);
  }
  std::vector<uint8_t> c1 = ReadExport(tv.dir, d, "vm1");
  std::vector<uint8_t> c2 = ReadExport(tv.dir, d, "vm2");
  std::vector<uint8_t> c3 = ReadExport(tv.dir, d, "optout");
  REQUIRE(c1 == s1.model);
  REQUIRE(c2 == s2.model);
  REQUIRE(c3 == s3.model);
  REQUIRE(d.Stop() == 0);
  RequireFsckClean(tv.vol);

  LogView log1 = ReadLog(tv.vol, "vm1");
  RequireLogMatches(log1, s1.full, c1);
  RequireLogMatches(ReadLog(tv.vol, "vm2"), s2.full, c2);
  LogView opt = ReadLog(tv.vol, "optout");
  REQUIRE(opt.records.empty());
  REQUIRE(opt.stats.records == 0);

  // dede ls -l shows the pending records per file; the logs themselves are
  // internal files, listed with --all only.
  std::vector<std::string> argv = {BinaryPath("dede"), "ls", "-l", "--json", tv.vol};
  ProcessResult ls = RunOk(argv);
  auto j = nlohmann::json::parse(ls.out);
  REQUIRE(j.size() == 3);
  int seen = 0;
  for (const auto& f : j) {
    INFO(f.dump());
    REQUIRE(f["kind"] == "file");
    if (f["name"] == "vm1") REQUIRE(f["log_records"] == log1.records.size());
    if (f["name"] == "optout") REQUIRE(f["log_records"] == 0);
    seen += f["name"] == "vm1" || f["name"] == "optout";
  }
  CHECK(seen == 2);
  ProcessResult table = RunOk({BinaryPath("dede"), "ls", "-l", tv.vol});
  REQUIRE(table.out.find("LOGGED") != std::string::npos);
  REQUIRE(table.out.find(" " + std::to_string(log1.records.size()) + " ") != std::string::npos);
  // A log describing more than --max-log-records blocks is not counted in
  // full (bounded memory for the log of a big disk): '>N', JSON null.
  REQUIRE(log1.records.size() > 2);
  ProcessResult bounded =
      RunOk({BinaryPath("dede"), "ls", "-l", "--json", "--max-log-records", "2", tv.vol});
  int bounded_seen = 0;
  for (const auto& f : nlohmann::json::parse(bounded.out)) {
    INFO(f.dump());
    // Every row has every key (null when not known), whatever its log.
    for (const char* key : {"log_records", "log_records_over", "log_dropped_records",
                            "log_corrupt_frames", "log_saturated", "shared_blocks", "in_use"}) {
      CHECK(f.contains(key));
    }
    if (f["name"] == "vm1") {
      CHECK(f["log_records"].is_null());
      CHECK(f["log_records_over"] == 2);
      bounded_seen++;
    }
    if (f["name"] == "optout") CHECK(f["log_records"] == 0);
  }
  CHECK(bounded_seen == 1);
  table = RunOk({BinaryPath("dede"), "ls", "-l", "--max-log-records", "2", tv.vol});
  CHECK(table.out.find(" >2 ") != std::string::npos);
  for (const char* bad : {"0", "-1", "x", "99999999999999999999"}) {
    ProcessResult r =
        RunProcess({BinaryPath("dede"), "ls", "-l", "--max-log-records", bad, tv.vol});
    INFO(bad << ": " << r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("--max-log-records") != std::string::npos);
  }
  ProcessResult all = RunOk({BinaryPath("dede"), "ls", "--all", tv.vol});
  REQUIRE(all.out.find(WriteLogName(log1.owner)) != std::string::npos);
  // rm takes the file's log with it.
  RunOk({BinaryPath("dede"), "rm", tv.vol, "vm1"});
  all = RunOk({BinaryPath("dede"), "ls", "--all", tv.vol});
  REQUIRE(all.out.find("vm1") == std::string::npos);
  REQUIRE(all.out.find(".dede-wlog-") != std::string::npos);  // vm2's is still there
}

// The port dedupd picked for --tcp-port 0: its log says "... on PATH and
// 127.0.0.1:PORT". The socket listens a moment before that line is written.
int TcpPortOf(const DedupdProcess& d) {
  std::string log;
  size_t at = std::string::npos;
  for (int i = 0; i < 500 && at == std::string::npos; i++) {
    log = d.Log();
    at = log.find("127.0.0.1:");
    if (at == std::string::npos) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  INFO(log);
  REQUIRE(at != std::string::npos);
  int port = std::stoi(log.substr(at + 10));
  REQUIRE(port > 0);
  return port;
}

// dedupd's NBD counters (`dede status --json`, "nbd").
nlohmann::json NbdCountersOf(const DedupdProcess& d) {
  ProcessResult status = RunOk({BinaryPath("dede"), "status", "--control", d.control(), "--json"});
  return nlohmann::json::parse(status.out)["nbd"];
}

// argv run as another user, with only that user's primary group.
std::vector<std::string> AsUser(uint32_t uid, uint32_t gid, std::vector<std::string> argv) {
  std::vector<std::string> full = {RequireProgram("setpriv"), "--reuid=" + std::to_string(uid),
                                   "--regid=" + std::to_string(gid), "--clear-groups"};
  full.insert(full.end(), argv.begin(), argv.end());
  return full;
}

TEST_CASE("TCP on 127.0.0.1 by option", "[nbd]") {
  TestVolume tv({{"vm", 1 * kMiB}});
  DedupdProcess d(tv.vol, 1, tv.sock, {"--tcp-port", "0"});
  const std::string uri = "nbd://127.0.0.1:" + std::to_string(TcpPortOf(d)) + "/vm";
  const std::string qemu_io = RequireProgram("qemu-io");
  RunOk({qemu_io, "-f", "raw", "-c", "write -P 0x42 0 65536", "-c", "read -P 0x42 0 65536", uri});
  REQUIRE(d.Stop() == 0);
}

// NBD has no authentication here: the port admits only the local users
// the Unix socket (0660, dedupd's user and group) admits, asking the
// kernel who made the client's socket (sock_diag).
TEST_CASE("TCP on 127.0.0.1 admits only the users the Unix socket admits", "[nbd]") {
  REQUIRE(::geteuid() == 0);  // clients run as other users
  constexpr uint32_t kNobody = 65534, kNoGroup = 65534, kDaemon = 1;
  TestVolume tv({{"vm", 1 * kMiB}});
  const std::string qemu_io = RequireProgram("qemu-io");
  {
    // dedupd as root:root. Root gets in; nobody does not, and is told
    // nothing but a closed connection (the log says why).
    DedupdProcess d(tv.vol, 1, tv.sock, {"--tcp-port", "0"});
    const std::string uri = "nbd://127.0.0.1:" + std::to_string(TcpPortOf(d)) + "/vm";
    RunOk({qemu_io, "-f", "raw", "-c", "write -P 0x42 0 65536", uri});
    ProcessResult denied =
        RunProcess(AsUser(kNobody, kNoGroup, {qemu_io, "-f", "raw", "-c", "read 0 4096", uri}));
    INFO(DescribeRun({"qemu-io as nobody"}, denied));
    CHECK(denied.exit_code != 0);
    const nlohmann::json nbd = NbdCountersOf(d);
    INFO(nbd.dump());
    CHECK(nbd["connections_denied"] == 1);
    CHECK(nbd["bytes_read"] == 0);
    INFO(d.Log());
    CHECK(d.Log().find("uid 65534 may not use the Unix socket") != std::string::npos);
    REQUIRE(d.Stop() == 0);
  }
  {
    // dedupd with group nogroup, as its Unix socket is then: nobody (whose
    // group that is) gets in and reads what root wrote; daemon does not.
    const std::string sock = tv.dir.file("nogroup.sock");
    DedupdProcess d(
        tv.vol, 1, sock, {"--tcp-port", "0"}, {},
        {RequireProgram("setpriv"), "--regid=" + std::to_string(kNoGroup), "--clear-groups", "--"});
    struct stat st {};
    REQUIRE(::stat(sock.c_str(), &st) == 0);
    REQUIRE(st.st_gid == kNoGroup);
    const std::string uri = "nbd://127.0.0.1:" + std::to_string(TcpPortOf(d)) + "/vm";
    RunOk(AsUser(kNobody, kNoGroup, {qemu_io, "-f", "raw", "-c", "read -P 0x42 0 65536", uri}));
    ProcessResult denied =
        RunProcess(AsUser(kDaemon, kDaemon, {qemu_io, "-f", "raw", "-c", "read 0 4096", uri}));
    CHECK(denied.exit_code != 0);
    const nlohmann::json nbd = NbdCountersOf(d);
    INFO(nbd.dump());
    CHECK(nbd["connections_denied"] == 1);
    CHECK(nbd["bytes_read"] == 65536);
    REQUIRE(d.Stop() == 0);
  }
}

// dedupd reads a QD1 sequential reader's next request ahead (read_ahead.h).
// One qemu-io process (one connection, one request at a time) walks the
// file in 64 KiB READs, each checking the content the model expects, while
// WRITEs, WRITE_ZEROES and TRIMs land on the chunk being read or the one
// the window holds: a window that survived a change would fail a check.
TEST_CASE("read-ahead answers a sequential reader and never hides a write, zero or trim",
          "[nbd]") {
  constexpr uint64_t kChunk = 64 * 1024;
  constexpr uint64_t kChunks = 64;
  // The worker prefetches after it has answered a READ, and not if the next
  // READ has already come (then there is no point). On a loaded machine
  // (ctest -j2) the client often wins that race; a pause after each READ
  // lets the prefetch start first, so the counts below mean something.
  constexpr int kPauseMs = 10;
  TestVolume tv({{"vm", kChunks * kChunk}});
  DedupdProcess d(tv.vol, 1, tv.sock);
  std::vector<int> model(kChunks, 0x11);
  std::vector<std::string> cmds = {"write -P 0x11 0 " + std::to_string(kChunks * kChunk)};
  std::mt19937 rng(5);
  int changes = 0;
  for (int pass = 0; pass < 3; pass++) {
    for (uint64_t pos = 0; pos < kChunks; pos++) {
      if (rng() % 100 < 35) {
        const uint64_t c = std::min(kChunks - 1, pos + rng() % 2);
        const std::string at = std::to_string(c * kChunk) + " " + std::to_string(kChunk);
        switch (rng() % 3) {
          case 0: {
            const int p = 1 + static_cast<int>(rng() % 254);
            cmds.push_back("write -P " + std::to_string(p) + " " + at);
            model[c] = p;
            break;
          }
          case 1:
            cmds.push_back("write -z " + at);
            model[c] = 0;
            break;
          default:
            cmds.push_back("discard " + at);
            model[c] = 0;
            break;
        }
        changes++;
      }
      cmds.push_back("read -P " + std::to_string(model[pos]) + " " +
                     std::to_string(pos * kChunk) + " " + std::to_string(kChunk));
      cmds.push_back("sleep " + std::to_string(kPauseMs));
    }
  }
  // Then 1 MiB READs of unchanging content: the windows are used.
  cmds.push_back("write -P 0x77 0 " + std::to_string(kChunks * kChunk));
  for (uint64_t off = 0; off < kChunks * kChunk; off += 1 << 20) {
    cmds.push_back("read -P 0x77 " + std::to_string(off) + " 1M");
    cmds.push_back("sleep " + std::to_string(kPauseMs));
  }
  std::vector<std::string> argv = {RequireProgram("qemu-io"), "-f", "raw", "-d", "unmap"};
  for (const auto& c : cmds) {
    argv.push_back("-c");
    argv.push_back(c);
  }
  argv.push_back(d.Uri("vm"));
  ProcessResult r = RunOk(argv);
  REQUIRE(r.out.find("Pattern verification failed") == std::string::npos);
  REQUIRE(changes > 40);
  ProcessResult st = RunOk({BinaryPath("dede"), "status", "--control", d.control(), "--json"});
  const nlohmann::json ra = nlohmann::json::parse(st.out)["read_ahead"];
  INFO(ra.dump());
  CHECK(ra["hits"].get<uint64_t>() >= 100);   // most READs without a change before them
  CHECK(ra["wasted"].get<uint64_t>() >= 10);  // changes that hit a window
  // qemu-io has gone, so the export closed and its window's memory is back.
  CHECK(ra["memory_cap"].get<uint64_t>() == 64 * kMiB);
  CHECK(ra["memory_used"].get<uint64_t>() == 0);
  CHECK(ra["no_budget"].get<uint64_t>() == 0);
  REQUIRE(d.Stop() == 0);
  RequireFsckClean(tv.vol);
}

// --read-ahead-memory bounds what all windows of the host hold: with less
// than one window's worth, every prefetch is skipped (and counted), and
// the READs read for themselves.
TEST_CASE("read-ahead skips prefetches that do not fit the host's read-ahead memory", "[nbd]") {
  constexpr uint64_t kSize = 16 * kMiB;
  TestVolume tv({{"vm", kSize}});
  DedupdProcess d(tv.vol, 1, tv.sock, {"--read-ahead-memory", "512K"});
  std::vector<std::string> argv = {RequireProgram("qemu-io"), "-f", "raw",
                                   "-c", "write -P 0x3c 0 " + std::to_string(kSize)};
  for (uint64_t off = 0; off < kSize; off += kMiB) {
    argv.push_back("-c");
    argv.push_back("read -P 0x3c " + std::to_string(off) + " 1M");
    // Lets the worker reach its prefetch before the next READ comes (see
    // the test above): only then does the budget decide.
    argv.push_back("-c");
    argv.push_back("sleep 20");
  }
  argv.push_back(d.Uri("vm"));
  ProcessResult r = RunOk(argv);
  REQUIRE(r.out.find("Pattern verification failed") == std::string::npos);
  ProcessResult st = RunOk({BinaryPath("dede"), "status", "--control", d.control(), "--json"});
  const nlohmann::json ra = nlohmann::json::parse(st.out)["read_ahead"];
  INFO(ra.dump());
  CHECK(ra["memory_cap"].get<uint64_t>() == 512 * 1024);
  CHECK(ra["prefetches"].get<uint64_t>() == 0);
  CHECK(ra["hits"].get<uint64_t>() == 0);
  // Every 1 MiB READ but the last wants a window; on a loaded machine the
  // next READ may still come first now and then (it then needs none).
  CHECK(ra["no_budget"].get<uint64_t>() >= 8);
  CHECK(ra["memory_used"].get<uint64_t>() == 0);
  REQUIRE(d.Stop() == 0);
}

TEST_CASE("under memory pressure the monitor sheds records and the log says so", "[nbd]") {
  const uint64_t size = 64 * kMiB;
  TestVolume tv({{"vm", size}});
  // 1 MiB of buffer holds far fewer than 16384 records, and the flusher
  // only runs once a minute.
  DedupdProcess d(tv.vol, 1, tv.sock,
                  {"--monitor-memory", "1M", "--log-flush-interval", "60", "--log-flush-bytes", "64M"});
  std::vector<uint8_t> img = MakeImage(size, 5);
  for (uint64_t i = 0; i < size; i += kBlk) img[i] = 1;  // no all-zero blocks
  std::string in = tv.dir.file("in.raw");
  WriteFile(in, img);
  RunOk({RequireProgram("qemu-img"), "convert", "-n", "-f", "raw", "-O", "raw", in, d.Uri("vm")});
  REQUIRE(ReadExport(tv.dir, d, "vm") == img);
  REQUIRE(d.Stop() == 0);
  LogView log = ReadLog(tv.vol, "vm");
  REQUIRE(log.stats.dropped_records > 0);
  REQUIRE(log.stats.dropped_since_ns > 0);
  REQUIRE(log.records.size() + log.stats.dropped_records >= size / kBlk);
  REQUIRE(log.records.size() < size / kBlk);
  // What was logged is still right.
  for (const auto& [b, rec] : log.records) REQUIRE(rec.fp == IndependentXxh128(&img[b * kBlk]));
  ProcessResult table = RunOk({BinaryPath("dede"), "ls", "-l", tv.vol});
  REQUIRE(table.out.find("!") != std::string::npos);
  // The pass that consumes the log says how many were lost (the logs no
  // longer will).
  ProcessResult pass = RunOk({BinaryPath("dede"), "dedup", tv.vol, "--now"});
  CHECK(pass.out.find("note: " + std::to_string(log.stats.dropped_records) +
                      " write-monitor records were shed") != std::string::npos);
}

TEST_CASE("qemu-io over SHA-256 volumes logs SHA-256 fingerprints", "[nbd]") {
  const uint64_t size = 1 * kMiB;
  TestVolume tv({{"vm", size}}, 256 * kMiB, "sha256");
  DedupdProcess d(tv.vol, 1, tv.sock);
  QemuIoScript s(size, 21, 100);
  RunOk(s.Argv(d.Uri("vm")));
  std::vector<uint8_t> c = ReadExport(tv.dir, d, "vm");
  REQUIRE(c == s.model);
  REQUIRE(d.Stop() == 0);
  LogView log = ReadLog(tv.vol, "vm");
  uint64_t expected = 0;
  for (uint64_t b = 0; b < s.full.size(); b++) {
    if (!s.full[b]) continue;
    expected++;
    REQUIRE(log.records.count(b) == 1);
    Fingerprint fp = ComputeFingerprint(HashAlgo::kSha256, &c[b * kBlk], kBlk);
    REQUIRE(log.records[b].fp == fp);
  }
  REQUIRE(log.records.size() == expected);
}

TEST_CASE("nbdcopy copies in and out over several connections", "[nbd]") {
  TestVolume tv({{"disk", 32 * kMiB}});
  std::vector<uint8_t> img = MakeImage(32 * kMiB, 99);
  std::string in = tv.dir.file("in.raw");
  WriteFile(in, img);
  DedupdProcess d(tv.vol, 1, tv.sock);
  std::string nbdcopy = RequireProgram("nbdcopy");
  // nbdcopy opens several connections when the server allows multi-conn.
  RunOk({nbdcopy, "--connections=4", "--requests=16", in, d.Uri("disk")});
  std::string out = tv.dir.file("out.raw");
  RunOk({nbdcopy, "--connections=4", d.Uri("disk"), out});
  REQUIRE(ReadFile(out) == img);
  REQUIRE(d.Stop() == 0);
  RequireFsckClean(tv.vol);
}

TEST_CASE("fio --ioengine=nbd with verification, and the log covers every block", "[nbd]") {
  const uint64_t size = 32 * kMiB;
  TestVolume tv({{"rand4k", size}, {"seq64k", size}});
  DedupdProcess d(tv.vol, 1, tv.sock);
  std::string fio = RequireProgram("fio");
  auto run_fio = [&](const std::string& name, const std::string& rw, const std::string& bs,
                     int seed) {
    std::vector<std::string> argv = {fio, "--name=" + name, "--ioengine=nbd",
                                     "--uri=" + d.Uri(name), "--rw=" + rw, "--bs=" + bs,
                                     "--size=" + std::to_string(size), "--iodepth=16",
                                     "--verify=crc32c", "--do_verify=1", "--verify_fatal=1",
                                     "--randseed=" + std::to_string(seed), "--output-format=terse",
                                     "--verify_state_save=0", "--directory=" + tv.dir.path()};
    RunOk(argv, 600);
  };
  auto answered_early = [&] {
    ProcessResult st = RunOk({BinaryPath("dede"), "status", "--control", d.control(), "--json"});
    return nlohmann::json::parse(st.out)["writes_answered_early"].get<uint64_t>();
  };
  // Into holes: every write allocates, so none is answered before its
  // device write.
  run_fio("rand4k", "randwrite", "4k", 42);
  run_fio("seq64k", "write", "64k", 42);
  CHECK(answered_early() == 0);
  // Again, in place, with other data: answered before the device write,
  // and fio's verification reads must see every one of them.
  run_fio("rand4k", "randwrite", "4k", 43);
  run_fio("seq64k", "write", "64k", 43);
  CHECK(answered_early() >= 2 * size / (64 * 1024));
  std::vector<uint8_t> c1 = ReadExport(tv.dir, d, "rand4k");
  std::vector<uint8_t> c2 = ReadExport(tv.dir, d, "seq64k");
  REQUIRE(d.Stop() == 0);
  RequireFsckClean(tv.vol);
  // fio wrote every block whole (random writes cover the file once).
  std::vector<bool> all(size / kBlk, true);
  RequireLogMatches(ReadLog(tv.vol, "rand4k"), all, c1);
  RequireLogMatches(ReadLog(tv.vol, "seq64k"), all, c2);
}

TEST_CASE("two dedupd processes never serve the same file at once", "[nbd]") {
  TestVolume tv({{"vm", 4 * kMiB}, {"other", 4 * kMiB}});
  std::string sock2 = tv.dir.file("nbd2.sock");
  DedupdProcess a(tv.vol, 1, tv.sock);
  // b gives up on a busy disk after 0.5 s (not the default 30).
  DedupdProcess b(tv.vol, 2, sock2, {"--open-wait", "0.5"});
  std::string qemu_io = RequireProgram("qemu-io");

  {
    RawClient holder(tv.sock);  // the VM runs on a
    REQUIRE(holder.Hello());
    REQUIRE(holder.Go("vm") == int64_t(4 * kMiB));

    // b refuses it, with a message that says why.
    RawClient c(sock2);
    REQUIRE(c.Hello());
    std::string err;
    REQUIRE(c.Go("vm", &err) == -1);
    REQUIRE(err.find("in use") != std::string::npos);
    std::vector<std::string> argv = {qemu_io, "-f", "raw", "-c", "write -P 0x11 0 4096", b.Uri("vm")};
    ProcessResult r = RunProcess(argv);
    INFO(Describe(argv, r));
    REQUIRE(r.exit_code != 0);
    REQUIRE((r.err + r.out).find("in use") != std::string::npos);

    // Other files are served by b meanwhile.
    RunOk({qemu_io, "-f", "raw", "-c", "write -P 0x22 0 8192", b.Uri("other")});
    // a's second client shares the export.
    RunOk({qemu_io, "-f", "raw", "-c", "write -P 0x33 0 4096", a.Uri("vm")});
    // a refuses "other" while b has a client... b's client has left, so a may take it.
  }
  // The holder disconnected: a releases the lock and b can serve the file.
  bool served = false;
  for (int i = 0; i < 100 && !served; i++) {
    std::vector<std::string> argv = {qemu_io, "-f", "raw", "-c", "read -P 0x33 0 4096", b.Uri("vm")};
    served = RunProcess(argv).exit_code == 0;
    if (!served) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  REQUIRE(served);
  REQUIRE(a.Stop() == 0);
  REQUIRE(b.Stop() == 0);
  RequireFsckClean(tv.vol);
}

TEST_CASE("NBD_OPT_INFO answers without entering the export, even one held elsewhere", "[nbd]") {
  // INFO used to open the file like GO (its lock, and a close with a
  // volume sync after), so for a disk whose VM ran on another dedupd it
  // waited the whole --open-wait and then failed: `nbdinfo --list` paid
  // that for every such disk.
  TestVolume tv({{"vm", 4 * kMiB}, {"other", 8 * kMiB}});
  const std::string sock2 = tv.dir.file("nbd2.sock");
  DedupdProcess a(tv.vol, 1, tv.sock);
  DedupdProcess b(tv.vol, 2, sock2);  // --open-wait: the default 30 s
  RawClient holder(tv.sock);          // the VM runs on a
  REQUIRE(holder.Hello());
  REQUIRE(holder.Go("vm") == int64_t(4 * kMiB));

  RawClient c(sock2);
  REQUIRE(c.Hello());
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(c.Info("vm") == int64_t(4 * kMiB));
  CHECK(c.Info("other") == int64_t(8 * kMiB));
  std::string err;
  CHECK(c.Info("nope", &err) == -1);
  CHECK(err.find("no export named 'nope'") != std::string::npos);
  // The session is still in negotiation: GO of a free disk works.
  CHECK(c.Go("other") == int64_t(8 * kMiB));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s < 5);
  const std::vector<std::string> argv = {RequireProgram("nbdinfo"), "--list", "--json",
                                         "nbd+unix:///?socket=" + sock2};
  ProcessResult r = RunProcess(argv, 60);
  INFO(Describe(argv, r));
  REQUIRE(r.exit_code == 0);
  nlohmann::json j = nlohmann::json::parse(r.out);
  std::map<std::string, uint64_t> sizes;
  for (const auto& e : j["exports"]) sizes[e["export-name"]] = e["export-size"];
  CHECK(sizes == std::map<std::string, uint64_t>{{"other", 8 * kMiB}, {"vm", 4 * kMiB}});
  const std::string log = b.Log();
  INFO(log);
  CHECK(log.find("export 'vm'") == std::string::npos);  // never opened, nor waited for
  CHECK(a.Log().find("export 'vm' closed") == std::string::npos);
}

TEST_CASE("a client waits --open-wait for a file that another dedupd holds for a moment", "[nbd]") {
  TestVolume tv({{"vm", 4 * kMiB}});
  std::string sock2 = tv.dir.file("nbd2.sock");
  DedupdProcess a(tv.vol, 1, tv.sock);
  DedupdProcess b(tv.vol, 2, sock2, {"--open-wait", "30"});
  std::string qemu_io = RequireProgram("qemu-io");
  auto holder = std::make_unique<RawClient>(tv.sock);  // like another host's pass
  REQUIRE(holder->Hello());
  REQUIRE(holder->Go("vm") == int64_t(4 * kMiB));
  ProcessResult r;
  std::thread client([&] {
    r = RunProcess({qemu_io, "-f", "raw", "-c", "write -P 0x44 0 4096", "-c", "read -P 0x44 0 4096",
                    b.Uri("vm")});
  });
  // b's open is refused and waits (it says so); then a lets go, and the
  // waiting open gets the file.
  const bool was_waiting = b.WaitForLog("export 'vm' is held elsewhere: waiting up to 30 s", 60);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // a retry or two meanwhile
  holder.reset();
  client.join();
  INFO("qemu-io: " << r.out << r.err << "\nb's log:\n" << b.Log());
  CHECK(was_waiting);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("failed") == std::string::npos);
  CHECK(b.Log().find("export 'vm': opened after") != std::string::npos);
  REQUIRE(a.Stop() == 0);
  REQUIRE(b.Stop() == 0);
  RequireFsckClean(tv.vol);
}

TEST_CASE("a client that leaves while its open waits is not given the disk afterwards", "[nbd]") {
  // No read is issued while an open is under way (the client waits for
  // GO's reply), so a client that left then went unseen until the open
  // ended: its disk was opened, its lock taken, for no one, and a VM
  // started elsewhere meanwhile found it in use. dedupd watches the socket
  // for the hangup and stops the waiting open at its next retry.
  TestVolume tv({{"vm", 4 * kMiB}});
  const std::string sock2 = tv.dir.file("nbd2.sock");
  DedupdProcess a(tv.vol, 1, tv.sock);
  DedupdProcess b(tv.vol, 2, sock2, {"--open-wait", "60"});
  auto holder = std::make_unique<RawClient>(tv.sock);
  REQUIRE(holder->Hello());
  REQUIRE(holder->Go("vm") == int64_t(4 * kMiB));
  auto waiter = std::make_unique<RawClient>(sock2);
  REQUIRE(waiter->Hello());
  std::vector<uint8_t> d;
  const std::string name = "vm";
  test::PutBig32(&d, static_cast<uint32_t>(name.size()));
  d.insert(d.end(), name.begin(), name.end());
  test::PutBig16(&d, 0);
  waiter->SendOption(7, d);  // NBD_OPT_GO
  REQUIRE(b.WaitForLog("export 'vm' is held elsewhere: waiting up to 60 s", 30));
  waiter.reset();  // the client leaves (qemu gave up, Ctrl-C)
  const bool abandoned = b.WaitForLog("the client left while export 'vm' waited to open", 10);
  holder.reset();  // a lets go of the disk
  REQUIRE(a.WaitForLog("export 'vm' closed", 30));
  // A retry of b's open (every 200 ms) would take it now.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const std::string log = b.Log();
  INFO("b's log:\n" << log);
  CHECK(abandoned);
  CHECK(log.find("export 'vm': opened after") == std::string::npos);
  CHECK(log.find("export 'vm' opened") == std::string::npos);
  // The disk is free for whoever asks next.
  RawClient next(sock2);
  REQUIRE(next.Hello());
  CHECK(next.Go("vm") == int64_t(4 * kMiB));
  REQUIRE(b.Stop() == 0);
  REQUIRE(a.Stop() == 0);
}

TEST_CASE("clients waiting to open a disk held elsewhere hold up no other disk's I/O", "[nbd]") {
  // Each waiting open used to sleep on an NBD worker for up to --open-wait;
  // with as many waiting as there are workers (2 here), every other
  // export's requests, opens included, waited behind them. A waiting open
  // now retries on a timer and holds no worker.
  TestVolume tv({{"busy", 4 * kMiB}, {"vm", 4 * kMiB}});
  const std::string sock2 = tv.dir.file("nbd2.sock");
  DedupdProcess a(tv.vol, 1, tv.sock);
  DedupdProcess b(tv.vol, 2, sock2, {"--threads", "2", "--open-wait", "6"});
  RawClient holder(tv.sock);  // "busy" runs on a
  REQUIRE(holder.Hello());
  REQUIRE(holder.Go("busy") == int64_t(4 * kMiB));
  std::vector<std::unique_ptr<RawClient>> waiting;
  for (int i = 0; i < 3; i++) {
    waiting.push_back(std::make_unique<RawClient>(sock2));
    REQUIRE(waiting.back()->Hello());
    std::vector<uint8_t> d;
    const std::string name = "busy";
    test::PutBig32(&d, static_cast<uint32_t>(name.size()));
    d.insert(d.end(), name.begin(), name.end());
    test::PutBig16(&d, 0);
    waiting.back()->SendOption(7, d);  // NBD_OPT_GO; the reply comes after the wait
  }
  // All three are waiting (each logs its wait once) before the other disk
  // is opened.
  const std::string wait_line = "export 'busy' is held elsewhere: waiting up to 6 s";
  auto waits_logged = [&] {
    const std::string log = b.Log();
    int n = 0;
    for (size_t at = log.find(wait_line); at != std::string::npos;
         at = log.find(wait_line, at + 1)) {
      n++;
    }
    return n;
  };
  const auto logged_by = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (waits_logged() < 3 && std::chrono::steady_clock::now() < logged_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  INFO(b.Log());
  REQUIRE(waits_logged() == 3);
  const auto t0 = std::chrono::steady_clock::now();
  RawClient c(sock2);
  REQUIRE(c.Hello());
  REQUIRE(c.Go("vm") == int64_t(4 * kMiB));
  c.SendRequest(0, 1, 0, 4096);
  uint32_t err = 1;
  uint64_t cookie = 0;
  REQUIRE(c.RecvReply(&err, &cookie));
  CHECK(err == 0);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO("open and READ of another disk took " << took << " s");
  CHECK(took < 3.0);
  // The waiting clients are refused once --open-wait has passed.
  for (auto& w : waiting) {
    RawClient::OptReply r;
    REQUIRE(w->RecvOptReply(&r));
    CHECK((r.type & 0x80000000u) != 0);
    CHECK(std::string(r.data.begin(), r.data.end()).find("in use") != std::string::npos);
  }
  REQUIRE(b.Stop() == 0);
  REQUIRE(a.Stop() == 0);
}

TEST_CASE("a dedup pass gives a borrowed disk back to a client waiting to open it", "[nbd]") {
  // dedupd a's pass opens "vm" (its VM is off) to use the blocks its write
  // log names; meanwhile the VM starts on b. b announces its wait, and a
  // hands the disk over at its pass's next step instead of when the pass
  // ends (in CI a pass held VM disks for over b's 30 s --open-wait).
  TestVolume tv({{"vm", 4 * kMiB}, {"big", 8 * kMiB}});
  // Capped dedup I/O (1 MB/s): a's pass runs for many seconds.
  Dede({"policy", tv.vol, "set", "rate=1"});
  const std::string sock2 = tv.dir.file("nbd2.sock");
  DedupdProcess b(tv.vol, 2, sock2, {"--open-wait", "120"});
  const std::string qemu_io = RequireProgram("qemu-io");
  // Written on b; when its clients leave, b closes both disks and flushes
  // their write logs: every block of each disk is one repeated block.
  RunOk({qemu_io, "-f", "raw", "-c", "write -P 0x66 0 4M", b.Uri("vm")});
  RunOk({qemu_io, "-f", "raw", "-c", "write -P 0x55 0 8M", b.Uri("big")});
  auto wait_for = [](DedupdProcess& d, const std::string& what, double limit_s) {
    const bool came = d.WaitForLog(what, limit_s);
    INFO("waiting for '" << what << "' in:\n" << d.Log());
    REQUIRE(came);
  };
  wait_for(b, "export 'vm' closed", 30);
  wait_for(b, "export 'big' closed", 30);

  DedupdProcess a(tv.vol, 1, tv.sock);
  REQUIRE(::kill(a.pid(), SIGUSR1) == 0);
  wait_for(a, "export 'vm' opened", 60);  // borrowed by a's pass
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> argv = {qemu_io, "-f", "raw", "-c", "read -P 0x66 0 4M", "-c",
                                   "write -P 0x67 0 64k", b.Uri("vm")};
  ProcessResult r = RunProcess(argv, 180);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const bool pass_ended_first = a.Log().find("dedup pass 1: ") != std::string::npos;
  wait_for(a, "reference drops: ", 300);  // a's pass is over
  INFO(Describe(argv, r) << "\nopened after " << waited << " s\na's log:\n"
                         << a.Log() << "\nb's log:\n" << b.Log());
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("failed") == std::string::npos);
  // b had the disk while a's pass went on, because a gave it back.
  CHECK_FALSE(pass_ended_first);
  CHECK(a.Log().find("gave 'vm' back to a client waiting to open it") != std::string::npos);
  CHECK(std::regex_search(a.Log(), std::regex(R"(dedup pass 1: .* 1 given back to waiting clients)")));
  CHECK(b.Log().find("export 'vm': opened after") != std::string::npos);
  CHECK(a.Log().find("ERROR") == std::string::npos);
  std::smatch took;
  const std::string a_log = a.Log();
  REQUIRE(std::regex_search(a_log, took, std::regex(R"(dedup pass 1: .* in ([0-9.e+-]+) s;)")));
  std::printf("borrowed disk given back: the waiting client opened it after %.1f s, into a pass "
              "of %s s\n",
              waited, took[1].str().c_str());
  // Every byte is what its writer last wrote.
  RunOk({qemu_io, "-f", "raw", "-c", "read -P 0x67 0 64k", "-c", "read -P 0x66 64k 4032k",
         b.Uri("vm")});
  RunOk({qemu_io, "-f", "raw", "-c", "read -P 0x55 0 8M", a.Uri("big")});
  REQUIRE(a.Stop() == 0);
  REQUIRE(b.Stop() == 0);
  RequireFsckClean(tv.vol);
}

TEST_CASE("malformed NBD traffic gets an error or a closed connection, never a crash", "[nbd]") {
  TestVolume tv({{"vm", 4 * kMiB}});
  DedupdProcess d(tv.vol, 1, tv.sock);
  std::string qemu_io = RequireProgram("qemu-io");
  // A well-behaved client keeps working in parallel the whole time.
  RawClient idle(tv.sock);  // connected, never says anything

  {  // bad option magic
    RawClient c(tv.sock);
    REQUIRE(c.Hello());
    std::vector<uint8_t> junk(16, 0x41);
    c.Send(junk);
    REQUIRE(c.ServerClosed());
  }
  {  // unknown client flags
    RawClient c(tv.sock);
    uint8_t g[18];
    REQUIRE(c.Recv(g, sizeof(g)));
    std::vector<uint8_t> f;
    test::PutBig32(&f, 0xffffffff);
    c.Send(f);
    REQUIRE(c.ServerClosed());
  }
  {  // NBD_OPT_EXPORT_NAME of an unknown export: no error reply exists, it closes
    RawClient c(tv.sock);
    REQUIRE(c.Hello());
    c.SendOption(1, {'n', 'o', 'p', 'e'});
    REQUIRE(c.ServerClosed());
  }
  {  // a client without fixed newstyle (flags 0): EXPORT_NAME, 124 zeroes, then a READ
    RawClient c(tv.sock);
    REQUIRE(c.Hello(0));
    c.SendOption(1, {'v', 'm'});
    uint8_t info[8 + 2 + 124];
    REQUIRE(c.Recv(info, sizeof(info)));
    CHECK(boost::endian::load_big_u64(info) == 4 * kMiB);
    CHECK(std::all_of(info + 10, info + sizeof(info), [](uint8_t b) { return b == 0; }));
    c.SendRequest(0 /*READ*/, 9, 0, 4096);
    uint32_t error = 1;
    uint64_t cookie = 0;
    REQUIRE(c.RecvReply(&error, &cookie));
    CHECK(error == 0);
    CHECK(cookie == 9);
    std::vector<uint8_t> block(4096);
    REQUIRE(c.Recv(block.data(), block.size()));
  }
  {  // ... which may send no other option: it could not read the reply
    RawClient c(tv.sock);
    REQUIRE(c.Hello(0));
    c.SendOption(3 /*LIST*/, {});
    REQUIRE(c.ServerClosed());
  }
  {  // an unknown option with 100 KiB of data (over the 64 KiB limit): ERR_UNSUP, then GO
    RawClient c(tv.sock);
    REQUIRE(c.Hello());
    c.SendOption(4242, std::vector<uint8_t>(100 * 1024, 0x5a));
    RawClient::OptReply r;
    REQUIRE(c.RecvOptReply(&r));
    CHECK(r.option == 4242);
    CHECK(r.type == 0x80000001u);  // NBD_REP_ERR_UNSUP
    REQUIRE(c.Go("vm") == int64_t(4 * kMiB));
  }
  {  // unknown export, then a good one on the same connection
    RawClient c(tv.sock);
    REQUIRE(c.Hello());
    std::string err;
    REQUIRE(c.Go("nope", &err) == -1);
    REQUIRE(err.find("nope") != std::string::npos);
    REQUIRE(c.Go("vm") == int64_t(4 * kMiB));
  }
  {  // requests: unknown command, out of range, oversized; then bad magic
    RawClient c(tv.sock);
    REQUIRE(c.Hello());
    REQUIRE(c.Go("vm") > 0);
    uint32_t err;
    uint64_t cookie;
    c.SendRequest(/*type=*/42, 1, 0, 4096);
    REQUIRE(c.RecvReply(&err, &cookie));
    REQUIRE(cookie == 1);
    REQUIRE(err == 22);  // EINVAL
    c.SendRequest(0 /*READ*/, 2, 4 * kMiB, 4096);
    REQUIRE(c.RecvReply(&err, &cookie));
    REQUIRE((cookie == 2 && err != 0));
    c.SendRequest(0, 3, UINT64_MAX - 100, 4096);  // offset + length overflows
    REQUIRE(c.RecvReply(&err, &cookie));
    REQUIRE((cookie == 3 && err != 0));
    c.SendRequest(0, 4, 0, 0xfffffff0u);  // oversized read
    REQUIRE(c.RecvReply(&err, &cookie));
    REQUIRE((cookie == 4 && err != 0));
    c.SendRequest(4 /*TRIM*/, 5, 4 * kMiB - 4096, 8192);
    REQUIRE(c.RecvReply(&err, &cookie));
    REQUIRE((cookie == 5 && err != 0));
    // Still in sync: a good read works.
    c.SendRequest(0, 6, 0, 4096);
    REQUIRE(c.RecvReply(&err, &cookie));
    REQUIRE((cookie == 6 && err == 0));
    std::vector<uint8_t> data(4096);
    REQUIRE(c.Recv(data.data(), data.size()));
    c.SendRequest(0, 7, 0, 4096, 0, 0xdeadbeef);  // bad request magic
    REQUIRE(c.ServerClosed());
  }
  {  // oversized write: the payload can't be skipped, the connection goes
    RawClient c(tv.sock);
    REQUIRE(c.Hello());
    REQUIRE(c.Go("vm") > 0);
    c.SendRequest(1 /*WRITE*/, 8, 0, 0x7fffffff);
    REQUIRE(c.ServerClosed());
  }
  {  // a client vanishing in the middle of a write payload
    RawClient c(tv.sock);
    REQUIRE(c.Hello());
    REQUIRE(c.Go("vm") > 0);
    c.SendRequest(1, 9, 0, 1 << 20);
    c.Send(std::vector<uint8_t>(300000, 0x77));
    c.Close();
  }
  {  // many requests in flight, then the client leaves without reading replies
    RawClient c(tv.sock);
    REQUIRE(c.Hello());
    REQUIRE(c.Go("vm") > 0);
    for (uint64_t i = 0; i < 200; i++) c.SendRequest(0, 100 + i, (i % 64) * 65536, 65536);
    c.Close();
  }
  // Other clients were never disturbed.
  RunOk({qemu_io, "-f", "raw", "-c", "write -P 0x5c 8192 8192", "-c", "read -P 0x5c 8192 8192",
         d.Uri("vm")});
  REQUIRE(d.Running());
  idle.Close();
  REQUIRE(d.Stop() == 0);
  RequireFsckClean(tv.vol);
  // The half-sent write never reached the disk.
  std::string out = tv.dir.file("out.raw");
  Dede({"export", tv.vol, "vm", out});
  std::vector<uint8_t> c = ReadFile(out);
  REQUIRE(c[0] != 0x77);
  REQUIRE(c[8192] == 0x5c);
}

TEST_CASE("SIGTERM with a client connected drains, flushes, releases and exits 0", "[nbd]") {
  TestVolume tv({{"vm", 8 * kMiB}});
  auto d = std::make_unique<DedupdProcess>(tv.vol, 1, tv.sock);
  RawClient c(tv.sock);
  REQUIRE(c.Hello());
  REQUIRE(c.Go("vm") > 0);
  // Acknowledged writes (no FLUSH from the client) must survive the stop.
  std::vector<uint8_t> payload(65536);
  for (size_t i = 0; i < payload.size(); i++) payload[i] = static_cast<uint8_t>(i * 7 + 1);
  for (uint64_t i = 0; i < 16; i++) {
    c.SendRequest(1, i, i * 65536, 65536);
    c.Send(payload);
  }
  for (int i = 0; i < 16; i++) {
    uint32_t err;
    uint64_t cookie;
    REQUIRE(c.RecvReply(&err, &cookie));
    REQUIRE(err == 0);
  }
  REQUIRE(d->Stop(30) == 0);
  REQUIRE(c.ServerClosed());
  RequireFsckClean(tv.vol);
  std::string out = tv.dir.file("out.raw");
  Dede({"export", tv.vol, "vm", out});
  std::vector<uint8_t> data = ReadFile(out);
  for (uint64_t i = 0; i < 16; i++) {
    REQUIRE(std::equal(payload.begin(), payload.end(), data.begin() + static_cast<long>(i * 65536)));
  }
  LogView log = ReadLog(tv.vol, "vm");
  REQUIRE(log.records.size() == 16 * 16);
  // The lock was released: another dedupd serves the file now.
  DedupdProcess d2(tv.vol, 2, tv.dir.file("second.sock"));
  RawClient c2(d2.socket());
  REQUIRE(c2.Hello());
  REQUIRE(c2.Go("vm") > 0);
}


// Resident memory of a process, in bytes (0 if unreadable).
uint64_t RssBytes(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

TEST_CASE("a client that never reads its replies holds bounded memory and cannot stall shutdown",
          "[nbd]") {
  // Replies waiting to be written count toward the connection's
  // back-pressure (--max-inflight bytes: 64 MiB by default): it stops
  // reading requests instead of queueing every READ's data. Before, a
  // client sending 32 MiB READs and never reading grew dedupd by 32 MiB a
  // request. On SIGTERM, replies not taken within --drain-timeout are given
  // up, so the stop completes (the other disks' locks are released).
  TestVolume tv({{"vm", 64 * kMiB}, {"other", 8 * kMiB}});
  auto d = std::make_unique<DedupdProcess>(tv.vol, 1, tv.sock,
                                           std::vector<std::string>{"--drain-timeout", "2"});
  RawClient warm(tv.sock);
  REQUIRE(warm.Hello());
  REQUIRE(warm.Go("other") > 0);
  RawClient c(tv.sock);
  REQUIRE(c.Hello());
  REQUIRE(c.Go("vm") > 0);
  const uint64_t before = RssBytes(d->pid());
  REQUIRE(before > 0);
  const int kReads = 24;  // 768 MiB of replies if all were queued
  for (int i = 0; i < kReads; i++) c.SendRequest(0, i, 0, 32 * kMiB);
  // Let dedupd take what it will.
  std::this_thread::sleep_for(std::chrono::seconds(3));
  const uint64_t after = RssBytes(d->pid());
  INFO("dedupd RSS before " << before / kMiB << " MiB, after " << after / kMiB << " MiB");
  CHECK(after < before + 200 * kMiB);
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(d->Stop(30) == 0);
  const double stop_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO("stopped in " << stop_s << " s");
  CHECK(stop_s < 15);
  // Another dedupd can serve the disk the stuck client had.
  DedupdProcess d2(tv.vol, 2, tv.dir.file("second.sock"));
  RawClient c2(d2.socket());
  REQUIRE(c2.Hello());
  REQUIRE(c2.Go("vm") > 0);
}

TEST_CASE("dedupd's --nbd-memory bounds what all clients not reading their replies hold together",
          "[nbd]") {
  // Per connection alone, four clients sending 4 MiB READs and never
  // reading held 64 MiB each. With --nbd-memory 8M they hold 8 MiB between
  // them, dedupd says so in `dede status --json`, and once they leave a
  // client queued behind them is served.
  TestVolume tv({{"vm", 64 * kMiB}});
  DedupdProcess d(tv.vol, 1, tv.sock, {"--nbd-memory", "8M"});
  const uint64_t before = RssBytes(d.pid());
  std::vector<std::unique_ptr<RawClient>> stuck;
  for (int i = 0; i < 4; i++) {
    stuck.push_back(std::make_unique<RawClient>(tv.sock));
    REQUIRE(stuck.back()->Hello());
    REQUIRE(stuck.back()->Go("vm") > 0);
    for (uint64_t r = 0; r < 16; r++) stuck.back()->SendRequest(0, r, r * 4 * kMiB, 4 * kMiB);
  }
  std::this_thread::sleep_for(std::chrono::seconds(2));
  nlohmann::json n = NbdCountersOf(d);
  INFO(n.dump());
  CHECK(n["memory_limit"] == 8 * kMiB);
  CHECK(n["memory_peak"].get<uint64_t>() <= 8 * kMiB);
  CHECK(n["memory_in_use"].get<uint64_t>() <= 8 * kMiB);
  CHECK(n["memory_waiting"].get<uint64_t>() >= 1);
  const uint64_t after = RssBytes(d.pid());
  INFO("dedupd RSS before " << before / kMiB << " MiB, after " << after / kMiB << " MiB");
  CHECK(after < before + 64 * kMiB);

  RawClient late(tv.sock);
  REQUIRE(late.Hello());
  REQUIRE(late.Go("vm") > 0);
  late.SendRequest(0, 99, 0, 4096);
  stuck.clear();
  uint32_t err = 1;
  uint64_t cookie = 0;
  REQUIRE(late.RecvReply(&err, &cookie));
  CHECK(err == 0);
  CHECK(cookie == 99);
  late.Close();
  REQUIRE(d.Stop() == 0);
}

TEST_CASE(
    "dedupd closes a stalled client holding --nbd-memory others wait for, after "
    "--nbd-stall-timeout",
    "[nbd]") {
  // A client that stops reading its replies kept its share of the budget
  // for ever; with the budget full, every other disk's READs and WRITEs
  // waited for ever. Here it holds all of 8M; a later client's READ waits
  // for room, and after --nbd-stall-timeout (1 s) the stuck client is
  // closed, logged and counted, and the READ is served. `dede status`
  // shows the budget and the close in words.
  TestVolume tv({{"vm", 64 * kMiB}});
  DedupdProcess d(tv.vol, 1, tv.sock, {"--nbd-memory", "8M", "--nbd-stall-timeout", "1"});
  RawClient stuck(tv.sock);
  REQUIRE(stuck.Hello());
  REQUIRE(stuck.Go("vm") > 0);
  for (uint64_t r = 0; r < 4; r++) stuck.SendRequest(0, r, r * 2 * kMiB, 2 * kMiB);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (NbdCountersOf(d)["memory_in_use"].get<uint64_t>() < 8 * kMiB) {
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  RawClient late(tv.sock);
  REQUIRE(late.Hello());
  REQUIRE(late.Go("vm") > 0);
  late.SendRequest(0, 99, 0, 4096);
  uint32_t err = 1;
  uint64_t cookie = 0;
  REQUIRE(late.RecvReply(&err, &cookie));  // within the client's 10 s
  CHECK(err == 0);
  CHECK(cookie == 99);
  const nlohmann::json n = NbdCountersOf(d);
  INFO(n.dump() << "\ndedupd log:\n" << d.Log());
  CHECK(n["stall_closes"] == 1);
  CHECK(CountOf(d.Log(), "bytes of --nbd-memory for its client") == 1);
  CHECK(CountOf(d.Log(), "while other connections wait for room (--nbd-stall-timeout)") == 1);
  CHECK(stuck.ServerClosed());
  const ProcessResult text = RunOk({BinaryPath("dede"), "status", "--control", d.control()});
  INFO(text.out);
  CHECK(text.out.find("of 8.0 MiB in use (peak 8.0 MiB)") != std::string::npos);
  CHECK(text.out.find("waiting for room (") != std::string::npos);
  CHECK(text.out.find("1 stalled connection closed (--nbd-stall-timeout)") != std::string::npos);
  late.Close();
  REQUIRE(d.Stop() == 0);
}

TEST_CASE("a huge WRITE_ZEROES or TRIM does not hold up the requests behind it", "[nbd]") {
  // A connection stops reading requests while 64 MiB of payloads and
  // replies are in memory. TRIM and WRITE_ZEROES carry none, but their
  // lengths were counted: one of 96 MiB (qemu sends discards and zeroes
  // far past the 32 MiB block maximum) kept the READ behind it unread
  // until it had finished.
  TestVolume tv({{"vm", 192 * kMiB}});
  DedupdProcess d(tv.vol, 1, tv.sock);
  RawClient c(tv.sock);
  REQUIRE(c.Hello());
  REQUIRE(c.Go("vm") > 0);
  // NO_HOLE: 96 MiB of zeros written, a long command (a plain one only
  // punches, too quick to tell the two orders apart reliably).
  c.SendRequest(6 /*WRITE_ZEROES*/, 1, 0, 96 * kMiB, 2 /*NO_HOLE*/);
  c.SendRequest(0 /*READ*/, 2, 160 * kMiB, 4096);
  uint32_t err = 0;
  uint64_t cookie = 0;
  REQUIRE(c.RecvReply(&err, &cookie));
  CHECK(err == 0);
  CHECK(cookie == 2);  // the READ first: it was not held back
  std::vector<uint8_t> data(4096);
  if (cookie == 2) {
    REQUIRE(c.Recv(data.data(), data.size()));
    REQUIRE(c.RecvReply(&err, &cookie));
    CHECK(cookie == 1);
  } else {
    REQUIRE(c.RecvReply(&err, &cookie));
    REQUIRE(c.Recv(data.data(), data.size()));
  }
  CHECK(err == 0);
  c.Close();
  REQUIRE(d.Stop() == 0);
  RequireFsckClean(tv.vol);
}

TEST_CASE("on SIGTERM a request running longer than --drain-timeout still gets its reply",
          "[nbd]") {
  // The drain deadline ran from the last reply written, not from a reply
  // waiting for the client: a request executing longer than
  // --drain-timeout (a long WRITE_ZEROES, a copy-on-write waiting for
  // another host's group, a slow FLUSH) lost its reply at shutdown and the
  // client saw the connection close.
  TestVolume tv({{"vm", 512 * kMiB}});
  DedupdProcess d(tv.vol, 1, tv.sock, {"--drain-timeout", "0.05"});
  RawClient c(tv.sock);
  REQUIRE(c.Hello());
  REQUIRE(c.Go("vm") > 0);
  // 480 MiB of zeros written: far longer than 50 ms.
  c.SendRequest(6 /*WRITE_ZEROES*/, 1, 0, 480 * kMiB, 2 /*NO_HOLE*/);
  c.SendRequest(3 /*FLUSH*/, 2, 0, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // both read
  REQUIRE(::kill(d.pid(), SIGTERM) == 0);
  std::set<uint64_t> answered;
  for (int i = 0; i < 2; i++) {
    uint32_t err = 1;
    uint64_t cookie = 0;
    INFO("reply " << i << "; answered before it:" << (answered.count(1) ? " the zeroes" : "")
                  << (answered.count(2) ? " the flush" : ""));
    REQUIRE(c.RecvReply(&err, &cookie));
    CHECK(err == 0);
    answered.insert(cookie);
  }
  CHECK(answered == std::set<uint64_t>{1, 2});
  CHECK(c.ServerClosed());
  REQUIRE(d.Stop() == 0);
  // The orderly stop ran (it used to end with the io context idle while
  // the request ran, skipping the exports' close and the final flush).
  CHECK(d.Log().find("export 'vm' closed") < d.Log().find("stopped"));
  RequireFsckClean(tv.vol);
}

double ProcessCpuSeconds(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  // Fields after the command name, which ends at the last ')'.
  std::istringstream rest(text.substr(text.rfind(')') + 2));
  std::string field;
  uint64_t utime = 0, stime = 0;
  for (int i = 3; rest >> field; i++) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) {
      stime = std::stoull(field);
      break;
    }
  }
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

size_t OpenDescriptors(int pid) {
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    (void)e;
    n++;
  }
  return n;
}

// A new client is greeted within `seconds` (a place among
// --max-connections is free again once the server has seen one go).
static bool GreetedWithin(const std::string& sock, double seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  while (true) {
    RawClient c(sock);
    if (c.Hello()) return true;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

TEST_CASE("connections past --max-connections are closed at once, and the others go on",
          "[nbd]") {
  TestVolume tv({{"vm", 8 * kMiB}});
  DedupdProcess d(tv.vol, 1, tv.sock, {"--max-connections", "2"});
  RawClient a(tv.sock), b(tv.sock);
  REQUIRE(a.Hello());
  REQUIRE(b.Hello());
  RawClient refused(tv.sock);
  CHECK(refused.ServerClosed());
  REQUIRE(b.Go("vm") > 0);
  a.Close();
  // A place is free again once the server has seen `a` go.
  CHECK(GreetedWithin(tv.sock, 5.0));
  INFO(d.Log());
  CHECK(d.Log().find("refusing NBD connections: 2 are open") != std::string::npos);
  const nlohmann::json nbd = NbdCountersOf(d);
  INFO(nbd.dump());
  CHECK(nbd["connections_refused"].get<uint64_t>() >= 1);
  CHECK(nbd["connections_open"].get<uint64_t>() >= 1);  // b, at least
  CHECK(nbd["connections_total"].get<uint64_t>() >= 3);
}

TEST_CASE("a client idle in the handshake is closed after --handshake-timeout and frees its place",
          "[nbd]") {
  // A connection that never finished its handshake kept its place among
  // --max-connections for ever: a local user could take them all.
  TestVolume tv({{"vm", 8 * kMiB}});
  DedupdProcess d(tv.vol, 1, tv.sock, {"--max-connections", "2", "--handshake-timeout", "3"});
  RawClient idle(tv.sock), talking(tv.sock);
  REQUIRE(idle.Hello());
  REQUIRE(talking.Hello());
  // `talking` sends an option every 0.5 s for 4 s: never idle long.
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 8; i++) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    talking.SendOption(3 /*NBD_OPT_LIST*/, {});
    RawClient::OptReply r;
    do {
      REQUIRE(talking.RecvOptReply(&r));
    } while (r.type != 1 /*NBD_REP_ACK*/);
  }
  CHECK(idle.ServerClosed());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s < 9.0);
  // Its place is free again; `talking` is still served.
  CHECK(GreetedWithin(tv.sock, 5.0));
  REQUIRE(talking.Go("vm") > 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(3500));  // idle, but in transmission
  talking.SendRequest(0 /*READ*/, 7, 0, 4096);
  uint32_t err = 1;
  uint64_t cookie = 0;
  REQUIRE(talking.RecvReply(&err, &cookie));
  CHECK(err == 0);
  CHECK(cookie == 7);
  INFO(d.Log());
  CHECK(d.Log().find("no handshake traffic for 3 s") != std::string::npos);
  const nlohmann::json nbd = NbdCountersOf(d);
  INFO(nbd.dump());
  CHECK(nbd["handshake_timeouts"].get<uint64_t>() >= 1);
  talking.Close();
  REQUIRE(d.Stop() == 0);
}

TEST_CASE("dedupd out of file descriptors waits to accept instead of spinning", "[nbd]") {
  // A connection that cannot be accepted (EMFILE) stays in the listen
  // backlog; accepting again at once failed again at once, for ever: a
  // busy loop on the NBD thread, a warning per turn, and the other
  // clients' requests behind it. Now it retries every 100 ms.
  TestVolume tv({{"vm", 8 * kMiB}});
  DedupdProcess d(tv.vol, 1, tv.sock);
  RawClient served(tv.sock);
  REQUIRE(served.Hello());
  REQUIRE(served.Go("vm") > 0);
  const std::string pid = std::to_string(d.pid());
  const std::string prlimit = RequireProgram("prlimit");
  const size_t fds = OpenDescriptors(d.pid());
  // Room for one more descriptor (the soft limit only: raising the hard
  // one back would need CAP_SYS_RESOURCE).
  RunOk({prlimit, "--pid", pid, "--nofile=" + std::to_string(fds + 1) + ":"});
  std::vector<std::unique_ptr<RawClient>> waiting;
  for (int i = 0; i < 8; i++) waiting.push_back(std::make_unique<RawClient>(tv.sock));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const double cpu0 = ProcessCpuSeconds(d.pid());
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const double cpu = ProcessCpuSeconds(d.pid()) - cpu0;
  // The connected client is still served meanwhile.
  served.SendRequest(0, 1, 0, 4096);
  uint32_t error = 1;
  uint64_t cookie = 0;
  const bool replied = served.RecvReply(&error, &cookie);
  RunOk({prlimit, "--pid", pid, "--nofile=" + std::to_string(fds + 64) + ":"});
  INFO("dedupd log: " << d.Log());
  REQUIRE(replied);
  CHECK(error == 0);
  int greeted = 0;
  for (auto& w : waiting) greeted += w->Hello() ? 1 : 0;
  const std::string log = d.Log();
  INFO(log);
  INFO("dedupd CPU over 2 s with connections it cannot accept: " << cpu << " s");
  CHECK(cpu < 0.5);
  CHECK(greeted == 8);
  const uint64_t warnings = CountOf(log, "accepting an NBD connection");
  CHECK(warnings >= 1);
  CHECK(warnings <= 2);
}

}  // namespace
}  // namespace dede

namespace dede {
namespace {

TEST_CASE("dedupd serves a volume on an iSCSI LUN (real tgtd)", "[nbd][iscsi]") {
  TempDir dir;
  std::string lun = dir.file("lun.img");
  CreateSparseFile(lun, 256 * kMiB);
  test::TgtdRig rig(lun);
  Dede({"format", rig.url()});
  Dede({"create", rig.url(), "disk", "--size", std::to_string(16 * kMiB)});
  std::vector<uint8_t> img = MakeImage(16 * kMiB, 31);
  std::string in = dir.file("in.raw");
  WriteFile(in, img);
  {
    DedupdProcess d(rig.url(), 1, dir.file("nbd.sock"));
    RunOk({RequireProgram("qemu-img"), "convert", "-n", "-f", "raw", "-O", "raw", in, d.Uri("disk")});
    REQUIRE(ReadExport(dir, d, "disk") == img);
    REQUIRE(d.Stop() == 0);
  }
  RequireFsckClean(rig.url());
  std::string out = dir.file("out.raw");
  Dede({"export", rig.url(), "disk", out});
  REQUIRE(ReadFile(out) == img);
}

}  // namespace
}  // namespace dede

namespace dede {
namespace {

TEST_CASE("racing writers on one export: the log's latest record is the block's content",
          "[nbd]") {
  // Three fio jobs (three connections), 32 requests in flight each, rewrite
  // the same 256 blocks at random for a few seconds: many writes of one
  // block are in flight at once. The monitor must end with each block's
  // record equal to what the disk holds.
  const uint64_t size = 1 * kMiB;
  TestVolume tv({{"hot", size}});
  DedupdProcess d(tv.vol, 1, tv.sock, {"--log-flush-bytes", "16K"});
  RunOk({RequireProgram("fio"), "--name=race", "--ioengine=nbd", "--uri=" + d.Uri("hot"),
         "--rw=randwrite", "--bs=4k", "--size=" + std::to_string(size), "--iodepth=32",
         "--numjobs=3", "--norandommap", "--time_based", "--runtime=4",
         "--refill_buffers", "--randrepeat=0", "--output-format=terse",
         "--directory=" + tv.dir.path()},
        600);
  std::vector<uint8_t> content = ReadExport(tv.dir, d, "hot");
  REQUIRE(d.Stop() == 0);
  RequireFsckClean(tv.vol);
  std::vector<bool> all(size / kBlk, true);
  RequireLogMatches(ReadLog(tv.vol, "hot"), all, content);
}

}  // namespace
}  // namespace dede

namespace dede {
namespace {

TEST_CASE("dedupd serves with a damaged pass history, which only the report needs", "[nbd]") {
  // Any history that did not open stopped dedupd (exit 2, which systemd
  // does not restart): the host's VMs lost their disks over a report.
  TestVolume tv({{"vm", 1 * kMiB}});
  const std::string history = tv.dir.file("history.db");
  std::ofstream(history) << std::string(4096, 'x');
  DedupdProcess d(tv.vol, 1, tv.sock, {"--history", history});
  const std::string qemu_io = RequireProgram("qemu-io");
  RunOk(
      {qemu_io, "-f", "raw", "-c", "write -P 0x3c 0 64k", "-c", "read -P 0x3c 0 64k", d.Uri("vm")});
  INFO(d.Log());
  CHECK(d.Log().find("pass history: " + history) != std::string::npos);
  CHECK(d.Log().find("serving without one") != std::string::npos);
  REQUIRE(d.Stop() == 0);
}

TEST_CASE("dedupd command line with usage errors and bad volumes and taken host ids and config files",
          "[nbd]") {
  TestVolume tv({{"vm", 1 * kMiB}});
  const std::string dedupd = BinaryPath("dedupd");
  ProcessResult r = RunProcess({dedupd, "--volume", tv.vol, "--socket", tv.sock});
  REQUIRE(r.exit_code == 2);
  REQUIRE(r.err.find("--host-id") != std::string::npos);
  r = RunProcess({dedupd, "--bogus"});
  REQUIRE(r.exit_code == 2);
  r = RunProcess({dedupd, "--help"});
  REQUIRE(r.exit_code == 0);
  REQUIRE(r.out.find("--socket") != std::string::npos);
  // Values that read as numbers but are not usable: an endless fence, a
  // negative io_timeout that the option parser wraps to 2^32 - 1. Durations
  // that overflowed a timer's microseconds to a negative period or rounded
  // to 0 (the timer then fired without pause: a busy CPU), an infinite
  // split threshold (every shard split at every update), and a negative
  // count read as 2^64 - 1. Timeout 20 s: one that is accepted serves (and
  // then with no control socket, history or metrics of the host's).
  const std::vector<std::string> off = {"--control",      "off", "--history", "off",
                                        "--metrics-port", "off"};
  for (const std::vector<std::string>& bad : {std::vector<std::string>{"--fence-after", "inf"},
                                              {"--fence-after", "nan"},
                                              {"--fence-after", "-1"},
                                              {"--lease-io-timeout", "-1"},
                                              {"--lease-io-timeout", "301"},
                                              {"--merge-interval", "1e300"},
                                              {"--log-flush-interval", "1e14"},
                                              {"--policy-refresh", "1e13"},
                                              {"--sync-interval", "inf"},
                                              {"--sync-interval", "0"},
                                              {"--dedup-interval", "1e-7"},
                                              {"--split-after", "inf"},
                                              {"--drain-timeout", "inf"},
                                              {"--open-wait", "nan"},
                                              {"--window-interval", "2592001"},
                                              {"--max-connections", "-1"},
                                              {"--write-log-limit", "-1"},
                                              {"--log-flush-bytes", "1K"},
                                              {"--monitor-memory", "lots"},
                                              {"--read-ahead", "1G"},
                                              {"--nbd-memory", "12Q"}}) {
    std::vector<std::string> args = {dedupd, "--volume", tv.vol, "--host-id",
                                     "1",    "--socket", tv.sock};
    args.insert(args.end(), off.begin(), off.end());
    args.insert(args.end(), bad.begin(), bad.end());
    r = RunProcess(args, 20);
    INFO(bad[0] << " " << bad[1] << ": " << r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find(bad[0]) != std::string::npos);
  }
  // A size that is no size is told apart from one out of range (both said
  // "need a size of at least 4K").
  {
    std::vector<std::string> a = {dedupd, "--volume", tv.vol, "--host-id",
                                  "1",    "--socket", tv.sock};
    a.insert(a.end(), off.begin(), off.end());
    a.insert(a.end(), {"--log-flush-bytes", "10X"});
    r = RunProcess(a, 20);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("--log-flush-bytes: '10X' is not a size") != std::string::npos);
    a.back() = "1K";
    ProcessResult small = RunProcess(a, 20);
    CHECK(small.exit_code == 2);
    CHECK(small.err.find("--log-flush-bytes: at least 4K, not 1K") != std::string::npos);
  }
  // A stray word: dedupd dropped it and started serving.
  {
    std::vector<std::string> a = {dedupd, "--volume", tv.vol, "--host-id",
                                  "1",    "--socket", tv.sock};
    a.insert(a.end(), off.begin(), off.end());
    a.push_back("extra");
    r = RunProcess(a, 20);
    INFO(r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("unexpected argument") != std::string::npos);
  }
  // A host id that is negative (read as 2^32 - 1 by the option parser), or
  // beyond the volume's max-hosts (8): configuration errors, exit 2, which
  // systemd does not restart (it restarted dedupd every 5 s on exit 1).
  std::vector<std::string> args = {dedupd, "--volume", tv.vol, "--host-id",
                                   "-1",   "--socket", tv.sock};
  args.insert(args.end(), off.begin(), off.end());
  r = RunProcess(args, 20);
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--host-id") != std::string::npos);
  args[4] = "9";
  r = RunProcess(args, 20);
  INFO(r.err);
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("out of range 1..8") != std::string::npos);
  // Socket paths that can never work: configuration errors too (exit 1
  // had systemd restart dedupd every 5 s for ever).
  args[4] = "1";
  const std::string long_path = tv.dir.file(std::string(120, 's') + ".sock");
  for (const char* opt : {"--socket", "--control"}) {
    std::vector<std::string> a = {dedupd,    "--volume",       tv.vol, "--host-id",
                                  "1",       "--history",      "off",  opt,
                                  long_path, "--metrics-port", "off"};
    if (std::string(opt) != "--socket") a.insert(a.end(), {"--socket", tv.sock});
    r = RunProcess(a, 20);
    INFO(opt << ": " << r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find(std::string(opt) + ": socket path too long") != std::string::npos);
  }
  const std::string not_socket = tv.dir.file("plain-file");
  std::ofstream(not_socket) << "x";
  {
    std::vector<std::string> a = {dedupd, "--volume", tv.vol,    "--host-id",
                                  "1",    "--socket", not_socket};
    a.insert(a.end(), off.begin(), off.end());
    r = RunProcess(a, 20);
    INFO(r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("exists and is not a socket") != std::string::npos);
  }

  r = RunProcess({dedupd, "--volume", tv.dir.file("missing.img"), "--host-id", "1", "--socket",
                  tv.sock});
  INFO(r.err);
  REQUIRE(r.exit_code == 1);
  REQUIRE(r.err.find("missing.img") != std::string::npos);

  // Options from a config file; the host slot it takes is then refused to a
  // second dedupd.
  std::string cfg = tv.dir.file("dedupd.conf");
  {
    std::ofstream out(cfg);
    out << "volume = " << tv.vol << "\nhost-id = 3\nsocket = " << tv.sock << "\nthreads = 2\n";
  }
  DedupdProcess d(tv.vol, 3, tv.sock, {"--config", cfg});
  {  // the config file is really read: a bad value in it is a usage error
    std::string bad = tv.dir.file("bad.conf");
    std::ofstream out(bad);
    out << "volume = " << tv.vol << "\nhost-id = 5\nsocket = " << tv.dir.file("c.sock")
        << "\nthreads = 0\n";
    out.close();
    ProcessResult b = RunProcess({dedupd, "--config", bad}, 30);
    INFO(b.err);
    REQUIRE(b.exit_code == 2);
    REQUIRE(b.err.find("--threads") != std::string::npos);
    // A name dedupd does not know: the error names the file it is in.
    std::ofstream(bad) << "bogus = 1\n";
    b = RunProcess({dedupd, "--config", bad}, 30);
    INFO(b.err);
    CHECK(b.exit_code == 2);
    CHECK(b.err.find("configuration file " + bad + ": unrecognised option 'bogus'") !=
          std::string::npos);
  }
  r = RunProcess({dedupd, "--volume", tv.vol, "--host-id", "3", "--socket", tv.dir.file("b.sock")},
                 30);
  INFO(r.err);
  REQUIRE(r.exit_code == 1);
  // And a second server cannot steal a live socket.
  r = RunProcess({dedupd, "--volume", tv.vol, "--host-id", "4", "--socket", tv.sock}, 30);
  INFO(r.err);
  REQUIRE(r.exit_code == 1);
  REQUIRE(r.err.find("another server") != std::string::npos);
  RunOk({RequireProgram("qemu-io"), "-f", "raw", "-c", "write -P 0x61 0 4096", d.Uri("vm")});
  REQUIRE(d.Stop() == 0);
}

}  // namespace
}  // namespace dede

namespace dede {
namespace {

// The signals process `pid` ignores (SigIgn of /proc/PID/status: bit n-1
// for signal n); 0 when it cannot be read.
uint64_t IgnoredSignals(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("SigIgn:", 0) == 0) return std::stoull(line.substr(7), nullptr, 16);
  }
  return 0;
}

// SIGUSR1 during the start (the volume open takes ~20 s with sanlock) and
// SIGHUP at any time killed dedupd by their default action: no drain, no
// flush, no lock release.
TEST_CASE("dedupd survives SIGUSR1 and SIGHUP from its first line and SIGHUP re-reads the policy",
          "[nbd]") {
  TestVolume tv({{"vm", 1 * kMiB}});
  const std::string log = tv.dir.file("dedupd.log");
  const std::string ctl = tv.dir.file("dedupd.ctl");
  // Through env, which resets SIGPIPE to its default action and execs
  // dedupd in its place: once SIGPIPE is ignored, dedupd's main() has begun
  // (it ignores SIGPIPE in its first lines).
  int pid = test::StartProcess(
      {"env", "--default-signal=PIPE", BinaryPath("dedupd"), "--volume", tv.vol, "--host-id", "1",
       "--socket", tv.sock, "--control", ctl, "--history", "off", "--metrics-port", "off",
       // The longest refresh taken: only SIGHUP re-reads it here.
       "--policy-refresh", "2592000"},
      {}, log);
  struct Reaper {
    int* pid;
    ~Reaper() {
      if (*pid > 0) {
        ::kill(*pid, SIGKILL);
        int status = 0;
        ::waitpid(*pid, &status, 0);
      }
    }
  } reaper{&pid};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  // Fails the test when dedupd died (or the start took too long). After
  // it, pid is > 0: kill() below never gets -1.
  auto running = [&] {
    const bool alive = test::ChildRunning(&pid);
    if (!alive || std::chrono::steady_clock::now() > deadline) {
      FAIL((alive ? "timed out" : "dedupd died") << "; its log:\n" << test::ReadWholeFileText(log));
    }
  };
  while ((IgnoredSignals(pid) & (uint64_t{1} << (SIGPIPE - 1))) == 0) {
    running();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  // From main()'s first lines to "serving": SIGUSR1 and SIGHUP, over and
  // over.
  uint64_t sent = 0;
  while (!test::CanConnectUnix(tv.sock)) {
    running();
    ::kill(pid, SIGUSR1);
    ::kill(pid, SIGHUP);
    sent++;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  running();
  INFO("signal pairs sent during the start: " << sent);
  CHECK(sent > 0);
  // Serving: SIGHUP re-reads the policy at once and dedupd goes on serving.
  ::kill(pid, SIGHUP);
  while (CountOf(test::ReadWholeFileText(log), "SIGHUP: re-reading the dedup policy") == 0) {
    running();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  running();
  RunOk({BinaryPath("dede"), "status", "--control", ctl});
  CHECK(test::CanConnectUnix(tv.sock));
  // And still stops cleanly.
  ::kill(pid, SIGTERM);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  pid = -1;
  INFO("dedupd log:\n" << test::ReadWholeFileText(log));
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

nlohmann::json StatusJson(const DedupdProcess& d) {
  const std::vector<std::string> argv = {BinaryPath("dede"), "status", "--control", d.control(),
                                         "--json"};
  ProcessResult r = RunOk(argv);
  nlohmann::json j;
  REQUIRE_NOTHROW(j = nlohmann::json::parse(r.out));
  return j;
}

// A time-zone change on the host (`timedatectl set-timezone` replaces
// /etc/localtime) reached the windows only at a restart: localtime_r
// reads the zone once per process. dedupd runs here in a mount namespace
// of its own, its /etc/localtime a file the test rewrites in place, and
// without TZ, as under systemd.
TEST_CASE("dedupd takes up a change of the host's time zone at the next policy re-read", "[nbd]") {
  const std::string utc_zone = "/usr/share/zoneinfo/Etc/UTC";
  const std::string tokyo_zone = "/usr/share/zoneinfo/Asia/Tokyo";  // UTC+9, no DST
  INFO("needs tzdata (" << utc_zone << ", " << tokyo_zone << ") and /etc/localtime");
  REQUIRE(std::filesystem::exists(utc_zone));
  REQUIRE(std::filesystem::exists(tokyo_zone));
  REQUIRE(std::filesystem::exists("/etc/localtime"));
  TestVolume tv({{"vm", 1 * kMiB}});
  // A two-hour window that holds now in Tokyo and not in UTC (9 hours
  // apart), so it cannot close while the test runs.
  const time_t now = ::time(nullptr);
  struct tm utc {};
  REQUIRE(gmtime_r(&now, &utc) != nullptr);
  const int tokyo_hour = (utc.tm_hour + 9) % 24;
  char window[64];
  std::snprintf(window, sizeof window, "windows=daily %02d:00-%02d:00", tokyo_hour,
                (tokyo_hour + 2) % 24);
  Dede({"policy", tv.vol, "set", window});
  const std::string zone = tv.dir.file("localtime");
  std::filesystem::copy_file(utc_zone, zone);
  DedupdProcess d(tv.vol, 1, tv.sock, {"--policy-refresh", "2592000"}, {},
                  {"env", "-u", "TZ", "unshare", "--mount", "--propagation", "private", "sh", "-c",
                   "mount --bind \"$0\" /etc/localtime && exec \"$@\"", zone});
  nlohmann::json st = StatusJson(d);
  INFO(st.dump());
  CHECK(st["policy"]["in_window"] == false);
  CHECK(st["policy"]["time_zone"] == "UTC+00:00 (UTC)");
  // Rewritten in place (the bound inode stays), with another mtime: what
  // glibc's tzset looks at to re-read the file.
  {
    std::ifstream in(tokyo_zone, std::ios::binary);
    std::ofstream out(zone, std::ios::binary | std::ios::trunc);
    out << in.rdbuf();
    REQUIRE(out.good());
  }
  const struct timespec times[2] = {{now + 60, 0}, {now + 60, 0}};
  REQUIRE(::utimensat(AT_FDCWD, zone.c_str(), times, 0) == 0);
  // Not taken up until the next re-read (the refresh is a month here).
  CHECK(StatusJson(d)["policy"]["in_window"] == false);
  REQUIRE(::kill(d.pid(), SIGHUP) == 0);
  const bool logged =
      d.WaitForLog("host time zone changed: UTC+00:00 (UTC) -> UTC+09:00 (JST)", 20);
  INFO("dedupd log:\n" << d.Log());
  REQUIRE(logged);
  st = StatusJson(d);
  INFO(st.dump());
  CHECK(st["policy"]["in_window"] == true);
  CHECK(st["policy"]["window"] == std::string(window + std::strlen("windows=")));
  CHECK(st["policy"]["time_zone"] == "UTC+09:00 (JST)");
  const ProcessResult text = RunOk({BinaryPath("dede"), "status", "--control", d.control()});
  CHECK(text.out.find(", host time UTC+09:00 (JST)") != std::string::npos);
  // `dede policy show` evaluates the windows where it runs, and says so.
  const ProcessResult shown =
      test::RunProcess({BinaryPath("dede"), "policy", tv.vol, "show"}, {"TZ=JST-9"});
  INFO(shown.out << shown.err);
  CHECK(shown.exit_code == 0);
  CHECK(shown.out.find("in window now:  yes") != std::string::npos);
  CHECK(shown.out.find(", here (UTC+09:00 (JST))") != std::string::npos);
  CHECK(d.Stop() == 0);
}

// dedupd that could not read the policy at start ran as if the volume had
// no windows and no rate cap: passes and merge applies at any time,
// uncapped. It must run none, refuse `dede dedup --now`, say why, and
// read the policy once it can.
TEST_CASE("dedupd runs no dedup pass until it has read the volume's policy", "[nbd]") {
  TestVolume tv({{"vm", 1 * kMiB}});
  Dede({"policy", tv.vol, "set", "windows=always", "rate=0"});
  {  // Both slots damaged.
    auto ov = OpenVolumeSpec(tv.vol, OpenOptions{});
    REQUIRE(ov.ok());
    auto f = ov->volume->OpenFile(kPolicyFileName);
    REQUIRE(f.ok());
    const std::vector<uint8_t> junk(kPolicySlots * kBlk, 0x5a);
    REQUIRE((*f)->Write(0, junk.data(), junk.size()).ok());
    REQUIRE((*f)->Flush().ok());
  }
  // A pass every millisecond, were one allowed; the policy is retried
  // every 0.2 s.
  DedupdProcess d(tv.vol, 1, tv.sock, {"--dedup-interval", "0.001", "--policy-refresh", "0.2"});
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  nlohmann::json st = StatusJson(d);
  INFO(st.dump(2) << "\ndedupd log:\n" << d.Log());
  CHECK(st["policy"]["read"] == false);
  CHECK(!st["policy"]["error"].get<std::string>().empty());
  CHECK(st["passes"]["completed"] == 0);
  CHECK(st["passes"]["failed"] == 0);
  CHECK(st["pass"]["running"] == false);
  CHECK(CountOf(d.Log(), "cannot read the volume's dedup policy") > 0);
  const std::vector<std::string> now = {BinaryPath("dede"), "dedup",    tv.vol, "--now",
                                        "--control",        d.control()};
  ProcessResult r = RunProcess(now);
  INFO(Describe(now, r));
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("policy could not be read") != std::string::npos);
  // `dede status` says so in words too.
  const std::vector<std::string> text = {BinaryPath("dede"), "status", "--control", d.control()};
  r = RunOk(text);
  CHECK(r.out.find("UNREADABLE") != std::string::npos);

  // Repaired: the next refresh reads it, and passes run.
  Dede({"policy", tv.vol, "set", "windows=always", "rate=0"});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (true) {
    st = StatusJson(d);
    if (st["policy"]["read"] == true && st["passes"]["completed"].get<uint64_t>() > 0) break;
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  REQUIRE(d.Stop() == 0);
}

// A SIGHUP (or periodic) re-read of the policy that found the policy file
// locked (`dede policy set`, another host reading it) was dropped without
// a word: the new policy waited for the next --policy-refresh (30 s by
// default, here never). It is logged as deferred and retried shortly.
TEST_CASE("dedupd logs and retries a policy re-read that found the policy file locked", "[nbd]") {
  TestVolume tv({{"vm", 1 * kMiB}});
  // The longest refresh taken: only SIGHUP and its retries re-read it.
  DedupdProcess d(tv.vol, 1, tv.sock, {"--policy-refresh", "2592000"});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto wait_for_log = [&](const std::string& line) {
    while (CountOf(d.Log(), line) == 0) {
      INFO("waiting for '" << line << "'; dedupd log:\n" << d.Log());
      REQUIRE(d.Running());
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  };
  wait_for_log("dedup policy generation 0");
  Dede({"policy", tv.vol, "set", "rate=1"});
  {
    // A reader holds the policy file (shared) while dedupd re-reads it.
    OpenOptions oo;
    oo.read_only = true;
    auto ov = OpenVolumeSpec(tv.vol, oo);
    REQUIRE(ov.ok());
    auto held = ov->volume->OpenFile(kPolicyFileName);
    REQUIRE(held.ok());
    ::kill(d.pid(), SIGHUP);
    wait_for_log("re-reading the dedup policy (SIGHUP) deferred");
  }
  // Let go: a retry reads the new policy, long before any refresh would.
  wait_for_log("dedup policy generation 1");
  INFO("dedupd log:\n" << d.Log());
  CHECK(CountOf(d.Log(), "trying again in 1 s (retry 1 of 5)") == 1);
  REQUIRE(d.Stop() == 0);
}

// The control socket took any number of connections at once, each a
// descriptor dedupd's NBD clients need too. Beyond the limit a client gets
// an error that `dede status` shows, and the refusal is counted and logged.
TEST_CASE("dedupd refuses control connections beyond --control-max-connections", "[nbd]") {
  TestVolume tv({{"vm", 1 * kMiB}});
  DedupdProcess d(tv.vol, 1, tv.sock, {"--control-max-connections", "1"});
  const std::vector<std::string> status = {BinaryPath("dede"), "status", "--control", d.control(),
                                           "--json"};
  int fd = test::ConnectUnix(d.control());
  // Accepted in the order they came: the idle one above takes the place.
  ProcessResult r = RunProcess(status);
  ::close(fd);
  INFO(Describe(status, r) << "\ndedupd log:\n" << d.Log());
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("too many control connections") != std::string::npos);
  // The idle client gone, `dede status` is served again (its close is seen
  // a moment later).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((r = RunProcess(status)).exit_code != 0) {
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const nlohmann::json j = nlohmann::json::parse(r.out);
  CHECK(j["control_connections"]["max"] == 1);
  CHECK(j["control_connections"]["refused"].get<uint64_t>() >= 1);
  CHECK(CountOf(d.Log(), "(--control-max-connections)") >= 1);
  // `dede status` says so in words too.
  const std::vector<std::string> text = {BinaryPath("dede"), "status", "--control", d.control()};
  r = RunOk(text);
  INFO(r.out);
  CHECK(std::regex_search(r.out, std::regex("\ncontrol +" + d.control() +
                                            ": 1 of 1 connection open, [1-9][0-9]* refused at "
                                            "--control-max-connections\n")));
  REQUIRE(d.Stop() == 0);
}

// A client that connects and sends nothing (a hung probe, a forgotten
// socat) used to keep its place until dedupd restarted; with the limit
// reached that way, no operator could run `dede status`. Once it has been
// idle for --control-idle-evict, a new client takes its place.
TEST_CASE("dedupd gives an idle control connection's place to a new client", "[nbd]") {
  TestVolume tv({{"vm", 1 * kMiB}});
  DedupdProcess d(tv.vol, 1, tv.sock,
                  {"--control-max-connections", "1", "--control-idle-evict", "1"});
  const std::vector<std::string> status = {BinaryPath("dede"), "status", "--control", d.control()};
  int fd = test::ConnectUnix(d.control(), /*recv_timeout_s=*/10);
  REQUIRE(fd >= 0);
  // One request answered first: from then on the connection is idle (its
  // accept may come a while after the connect on a loaded machine).
  const std::string request = "{\"cmd\":\"status\"}\n";
  REQUIRE(test::SendAll(fd, request.data(), request.size()));
  std::string reply;
  char ch = 0;
  while (test::RecvAll(fd, &ch, 1) && ch != '\n') reply += ch;
  REQUIRE(ch == '\n');
  CHECK(nlohmann::json::parse(reply).contains("host_id"));
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  ProcessResult r = RunProcess(status);
  INFO(Describe(status, r) << "\ndedupd log:\n" << d.Log());
  CHECK(r.exit_code == 0);
  CHECK(std::regex_search(r.out, std::regex("\ncontrol +" + d.control() +
                                            ": 1 of 1 connection open, 1 idle closed to make "
                                            "room\n")));
  CHECK(CountOf(d.Log(), "closed 1 idle connection(s)") == 1);
  // The idle client finds its connection closed (not the 10 s timeout).
  char byte;
  CHECK(::recv(fd, &byte, 1, 0) == 0);
  ::close(fd);
  REQUIRE(d.Stop() == 0);
}

}  // namespace
}  // namespace dede
