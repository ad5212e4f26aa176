// The `dede` command line, run as a real process against volume files (and
// a real tgtd for iSCSI). Checks the figures commands print against what
// was written, the exit codes (0 / 1 with one stderr line / 2 with usage),
// and that bad input leaves the device untouched.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/rig.h"
#include "tests/random_bytes.h"
#include "util/coding.h"
#include "util/fingerprint.h"
#include "volume/format.h"
#include "volume/lock_manager.h"
#include "volume/volume.h"

namespace dede {
namespace {

using json = nlohmann::json;
using test::BinaryPath;
using test::CreateSparseFile;
using test::ProcessResult;
using test::RunProcess;
using test::TempDir;

constexpr uint64_t kMiB = 1 << 20;

ProcessResult Dede(std::vector<std::string> args, int timeout_s = 120) {
  args.insert(args.begin(), BinaryPath("dede"));
  return RunProcess(args, timeout_s);
}

std::string Describe(const std::vector<std::string>& args, const ProcessResult& r) {
  std::ostringstream s;
  s << "dede";
  for (const auto& a : args) s << ' ' << a;
  s << "\n  exit " << r.exit_code << " signal " << r.signal << "\n  stdout: " << r.out
    << "\n  stderr: " << r.err;
  return s.str();
}

size_t LineCount(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += c == '\n';
  if (!s.empty() && s.back() != '\n') n++;
  return n;
}

// Runs dede and requires success.
ProcessResult DedeOk(const std::vector<std::string>& args) {
  ProcessResult r = Dede(args);
  INFO(Describe(args, r));
  REQUIRE(r.exit_code == 0);
  return r;
}

json DedeJson(const std::vector<std::string>& args) {
  ProcessResult r = DedeOk(args);
  INFO(Describe(args, r));
  json j;
  REQUIRE_NOTHROW(j = json::parse(r.out));
  return j;
}

// An operational error: exit 1, exactly one line on stderr, no crash.
ProcessResult DedeFails(const std::vector<std::string>& args) {
  ProcessResult r = Dede(args);
  INFO(Describe(args, r));
  CHECK(r.signal == 0);
  CHECK(r.exit_code == 1);
  CHECK(LineCount(r.err) == 1);
  CHECK(r.err.rfind("dede: ", 0) == 0);
  return r;
}

// A usage error: exit 2, the error, a usage line and a hint on stderr.
void DedeUsageError(const std::vector<std::string>& args) {
  ProcessResult r = Dede(args);
  INFO(Describe(args, r));
  CHECK(r.signal == 0);
  CHECK(r.exit_code == 2);
  CHECK(r.out.empty());
  CHECK(r.err.rfind("dede: ", 0) == 0);
  CHECK(r.err.find("usage: dede") != std::string::npos);
  CHECK(r.err.find("--help") != std::string::npos);
}

void WriteWholeFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  REQUIRE(out.good());
}

// Fingerprint of a whole (device) file: hashes 1 MiB pieces, then the list.
std::string Digest(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  std::vector<char> buf(kMiB);
  std::string pieces;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto n = static_cast<size_t>(in.gcount());
    if (n == 0) break;
    pieces += ComputeFingerprint(HashAlgo::kXxh128, buf.data(), n).Hex();
  }
  return ComputeFingerprint(HashAlgo::kXxh128, pieces.data(), pieces.size()).Hex();
}

std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  dede::test::FillRandom(rng, s.data(), s.size());
  return s;
}

// A disk image of `blocks` 4 KiB blocks: random data with zero runs of
// assorted lengths, plus blocks that are zero but for one byte (they must
// not be mistaken for holes). Returns the number of non-zero blocks.
uint64_t MakeImage(const std::string& path, uint64_t blocks, uint64_t seed) {
  std::string data = RandomBytes(blocks * kBlockSize, seed);
  uint64_t nonzero = 0;
  for (uint64_t b = 0; b < blocks; b++) {
    char* blk = data.data() + b * kBlockSize;
    const bool zero_run = (b / 37) % 3 == 0 || (b >= 1000 && b < 1600);
    if (zero_run) {
      std::memset(blk, 0, kBlockSize);
      if (b % 101 == 5) blk[kBlockSize - 1] = 1;  // almost zero
      if (b % 103 == 7) blk[0] = 1;
    }
    bool is_zero = true;
    for (uint32_t i = 0; i < kBlockSize && is_zero; i++) is_zero = blk[i] == 0;
    nonzero += is_zero ? 0 : 1;
  }
  WriteWholeFile(path, data);
  return nonzero;
}

const json* FindFile(const json& listing, const std::string& name) {
  for (const auto& f : listing) {
    if (f.at("name") == name) return &f;
  }
  return nullptr;
}

// Rewrites superblock copy `addr` through `edit`, optionally resealing it.
template <typename Edit>
void EditSuperblock(const std::string& path, uint64_t addr, Edit edit) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f.good());
  std::vector<uint8_t> blk(kBlockSize);
  f.seekg(static_cast<std::streamoff>(addr * kBlockSize));
  f.read(reinterpret_cast<char*>(blk.data()), kBlockSize);
  REQUIRE(f.good());
  edit(blk.data());
  f.seekp(static_cast<std::streamoff>(addr * kBlockSize));
  f.write(reinterpret_cast<const char*>(blk.data()), kBlockSize);
  REQUIRE(f.good());
}

// A TCP port on 127.0.0.1 that nobody listens on (bound, then closed).
int ClosedPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  socklen_t len = sizeof addr;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// Every command that must refuse a device that is not a usable volume, and
// must not write to it while refusing.
void RequireRefusedUntouched(const std::string& vol, const std::string& raw,
                             const std::string& expect_in_message = "") {
  const std::string before = Digest(vol);
  const std::vector<std::vector<std::string>> commands = {
      {"info", vol},
      {"info", vol, "--json"},
      {"ls", vol},
      {"ls", vol, "-l"},
      {"stats", vol},
      {"create", vol, "x", "--size", "1M"},
      {"import", vol, "x", raw},
      {"export", vol, "x", raw + ".out"},
      {"rm", vol, "x"},
      {"set", vol, "x", "dedup=off"},
      {"fsck", vol},
      {"fsck", vol, "--repair"},
  };
  for (const auto& args : commands) {
    ProcessResult r = DedeFails(args);
    if (!expect_in_message.empty()) {
      INFO(Describe(args, r));
      CHECK(r.err.find(expect_in_message) != std::string::npos);
    }
    INFO(Describe(args, r));
    REQUIRE(Digest(vol) == before);
  }
  CHECK_FALSE(std::filesystem::exists(raw + ".out"));
}

TEST_CASE("dede format and info on a sparse file", "[cli]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  CreateSparseFile(vol, 256 * kMiB);

  ProcessResult fmt = DedeOk({"format", vol, "--max-hosts", "4", "--hash", "sha256"});
  CHECK(fmt.out.find("formatted") != std::string::npos);

  json info = DedeJson({"info", vol, "--json"});
  INFO(info.dump(2));
  CHECK(info.at("block_size") == kBlockSize);
  CHECK(info.at("hash") == "sha256");
  CHECK(info.at("max_hosts") == 4);
  CHECK(info.at("size_bytes") == 256 * kMiB);
  CHECK(info.at("format_version") ==
        std::to_string(kFormatMajor) + "." + std::to_string(kFormatMinor));
  const std::string uuid = info.at("uuid");
  CHECK(uuid.size() == 36);
  CHECK(info.at("files") == 0);
  CHECK(info.at("free_bytes").get<uint64_t>() > 0);
  CHECK(info.at("free_bytes").get<uint64_t>() <= info.at("data_bytes").get<uint64_t>());
  CHECK(info.at("inode_count").get<uint64_t>() >= 1);
  CHECK(info.at("layout").size() == 6);
  // The regions tile the device in order.
  uint64_t next = 0;
  for (const auto& region : info.at("layout")) {
    CHECK(region.at("start_block") == next);
    next = region.at("start_block").get<uint64_t>() + region.at("blocks").get<uint64_t>();
  }
  CHECK(next == info.at("total_blocks"));
  for (const auto& copy : info.at("superblocks")) CHECK(copy.at("ok") == true);

  ProcessResult human = DedeOk({"info", vol});
  CHECK(human.out.find(uuid) != std::string::npos);
  CHECK(human.out.find("sha256") != std::string::npos);

  SECTION("an existing volume is refused without --force, untouched") {
    const std::string before = Digest(vol);
    ProcessResult r = DedeFails({"format", vol});
    CHECK(r.err.find("--force") != std::string::npos);
    CHECK(Digest(vol) == before);
  }
  SECTION("--force formats again with a new identity") {
    DedeOk({"format", vol, "--force"});
    json again = DedeJson({"info", vol, "--json"});
    CHECK(again.at("uuid") != uuid);
    CHECK(again.at("hash") == "xxh128");
    CHECK(again.at("max_hosts") == 8);
  }
}

TEST_CASE("dede import/export/ls/stats/set/rm/fsck round trip", "[cli]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  CreateSparseFile(vol, 256 * kMiB);
  DedeOk({"format", vol});
  const json stats0 = DedeJson({"stats", vol, "--json"});
  const uint64_t free0 = stats0.at("free_bytes");
  CHECK(stats0.at("files") == 0);
  CHECK(stats0.at("logical_bytes") == 0);

  // ~12 MiB image with zero runs.
  const uint64_t blocks = 12 * kMiB / kBlockSize;
  const std::string img = dir.file("vm1.raw");
  const uint64_t nonzero = MakeImage(img, blocks, 42);
  REQUIRE(nonzero < blocks);
  REQUIRE(nonzero > blocks / 2);

  ProcessResult imp = DedeOk({"import", vol, "vm1", img});
  CHECK(imp.out.find("imported 12.0 MiB into 'vm1'") != std::string::npos);
  CHECK(imp.out.find("of zero blocks left as holes") != std::string::npos);
  CHECK(imp.err.empty());  // no progress bar when stderr is not a terminal

  const std::string out = dir.file("vm1.out");
  DedeOk({"export", vol, "vm1", out});
  REQUIRE(test::ReadWholeFileText(out) == test::ReadWholeFileText(img));
  // To standard output, a pipe or a file it was redirected to: the image
  // alone (the summary goes to stderr; it used to land in the image).
  {
    ProcessResult piped = DedeOk({"export", vol, "vm1", "/dev/stdout"});
    CHECK(piped.out == test::ReadWholeFileText(img));
    CHECK(piped.err.find("exported 12.0 MiB from 'vm1'") != std::string::npos);
    const std::string redirected = dir.file("vm1.stdout");
    ProcessResult sh =
        RunProcess({"/bin/sh", "-c", "exec \"$0\" export \"$1\" vm1 /dev/stdout > \"$2\"",
                    BinaryPath("dede"), vol, redirected});
    INFO(sh.err);
    REQUIRE(sh.exit_code == 0);
    CHECK(test::ReadWholeFileText(redirected) == test::ReadWholeFileText(img));
  }

  DedeOk({"create", vol, "empty", "--size", "10M"});

  // An image whose size is not a multiple of 4 KiB: the file is rounded up
  // and exports with zero padding.
  const std::string odd = dir.file("odd.raw");
  const std::string odd_data = RandomBytes(3 * kMiB + 1000, 7);
  WriteWholeFile(odd, odd_data);
  DedeOk({"import", vol, "odd", odd});
  DedeOk({"export", vol, "odd", dir.file("odd.out")});
  {
    const std::string exported = test::ReadWholeFileText(dir.file("odd.out"));
    REQUIRE(exported.size() == 3 * kMiB + kBlockSize);
    CHECK(exported.substr(0, odd_data.size()) == odd_data);
    CHECK(exported.substr(odd_data.size()) == std::string(exported.size() - odd_data.size(), '\0'));
  }
  const uint64_t odd_blocks = (odd_data.size() + kBlockSize - 1) / kBlockSize;

  DedeOk({"fsck", vol});

  {
    ProcessResult ls = DedeOk({"ls", vol});
    CHECK(ls.out == "empty\nodd\nvm1\n");
    ProcessResult ls_long = DedeOk({"ls", vol, "-l"});
    CHECK(ls_long.out.find("ALLOCATED") != std::string::npos);
    CHECK(ls_long.out.find("12.0 MiB") != std::string::npos);
  }
  {
    json ls = DedeJson({"ls", vol, "-l", "--json"});
    INFO(ls.dump(2));
    REQUIRE(ls.size() == 3);
    const json* vm1 = FindFile(ls, "vm1");
    REQUIRE(vm1 != nullptr);
    CHECK(vm1->at("kind") == "file");
    CHECK(vm1->at("size") == blocks * kBlockSize);
    CHECK(vm1->at("mapped_blocks") == nonzero);
    CHECK(vm1->at("allocated_bytes") == nonzero * kBlockSize);
    CHECK(vm1->at("allocated_bytes").get<uint64_t>() < vm1->at("size").get<uint64_t>());
    CHECK(vm1->at("unique_blocks") == nonzero);
    CHECK(vm1->at("shared_blocks") == 0);
    CHECK(vm1->at("saved_bytes") == 0);
    CHECK(vm1->at("dedup") == true);
    CHECK(vm1->at("in_use") == false);
    const json* empty = FindFile(ls, "empty");
    REQUIRE(empty != nullptr);
    CHECK(empty->at("size") == 10 * kMiB);
    CHECK(empty->at("mapped_blocks") == 0);
    const json* odd_file = FindFile(ls, "odd");
    REQUIRE(odd_file != nullptr);
    CHECK(odd_file->at("size") == odd_blocks * kBlockSize);
    CHECK(odd_file->at("mapped_blocks") == odd_blocks);
  }
  {
    json stats = DedeJson({"stats", vol, "--json"});
    INFO(stats.dump(2));
    const uint64_t data_bytes = (nonzero + odd_blocks) * kBlockSize;
    CHECK(stats.at("files") == 3);
    CHECK(stats.at("logical_bytes") == data_bytes);
    CHECK(stats.at("physical_bytes") == data_bytes);  // nothing shared yet
    CHECK(stats.at("saved_bytes") == 0);
    CHECK(stats.at("savings_percent") == 0.0);
    // The data plus at least one block-map block per non-empty file.
    CHECK(stats.at("free_bytes").get<uint64_t>() <= free0 - data_bytes - 2 * kBlockSize);
    CHECK(stats.at("pointer_blocks").get<uint64_t>() >= 2);
    CHECK(stats.at("metadata_bytes").get<uint64_t>() >
          stats.at("fixed_metadata_bytes").get<uint64_t>());
    ProcessResult human = DedeOk({"stats", vol});
    CHECK(human.out.find("logical") != std::string::npos);
    CHECK(human.out.find("savings") != std::string::npos);
  }

  SECTION("import draws a progress bar when stderr is a terminal") {
    // script(1) runs the command on a pseudo-terminal and copies its output.
    const std::string command = BinaryPath("dede") + " import " + vol + " tty " + img;
    ProcessResult r = RunProcess({"script", "-qec", command, "/dev/null"});
    INFO(r.out << r.err);
    CHECK(r.exit_code == 0);
    CHECK(r.out.find("\rimporting 'tty' [") != std::string::npos);
    CHECK(r.out.find("%") != std::string::npos);
    CHECK(r.out.find("imported 12.0 MiB into 'tty'") != std::string::npos);
    // fsck shows its two long steps there too, each line cleared when done.
    const std::string check = BinaryPath("dede") + " fsck " + vol;
    ProcessResult f = RunProcess({"script", "-qec", check, "/dev/null"});
    INFO(f.out << f.err);
    CHECK(f.exit_code == 0);
    CHECK(f.out.find("\rchecking file maps [") != std::string::npos);
    CHECK(f.out.find("\rchecking reference counts [") != std::string::npos);
    CHECK(f.out.find("clean") != std::string::npos);
    // Not on a pipe (the progress goes to stderr only on a terminal).
    ProcessResult piped = DedeOk({"fsck", vol});
    CHECK(piped.err.find("checking") == std::string::npos);
  }
  SECTION("import refuses a name that exists, touching nothing") {
    ProcessResult r = DedeFails({"import", vol, "vm1", odd});
    DedeOk({"export", vol, "vm1", out});
    CHECK(test::ReadWholeFileText(out) == test::ReadWholeFileText(img));
  }
  SECTION("import of a missing image fails before opening the volume") {
    const std::string before = Digest(vol);
    DedeFails({"import", vol, "nope", dir.file("missing.raw")});
    CHECK(Digest(vol) == before);
  }
  SECTION("import --size smaller than the image is refused") {
    DedeFails({"import", vol, "small", odd, "--size", "1M"});
    json ls = DedeJson({"ls", vol, "--json"});
    CHECK(FindFile(ls, "small") == nullptr);
  }
  SECTION("import --size of exactly the image's (unaligned) size keeps every byte") {
    // The last partial block used to be written padded to 4 KiB, past the
    // end of a file of exactly the image's size: the import failed.
    const std::string exact = std::to_string(odd_data.size());
    DedeOk({"import", vol, "exact", odd, "--size", exact});
    json ls = DedeJson({"ls", vol, "--json"});
    REQUIRE(FindFile(ls, "exact") != nullptr);
    CHECK(FindFile(ls, "exact")->at("size") == odd_data.size());
    DedeOk({"export", vol, "exact", out});
    CHECK(test::ReadWholeFileText(out) == odd_data);
  }
  SECTION("import --size makes a bigger file with a hole at the end") {
    DedeOk({"import", vol, "big", odd, "--size", "8M"});
    json ls = DedeJson({"ls", vol, "--json"});
    REQUIRE(FindFile(ls, "big") != nullptr);
    CHECK(FindFile(ls, "big")->at("size") == 8 * kMiB);
    CHECK(FindFile(ls, "big")->at("mapped_blocks") == odd_blocks);
  }
  SECTION("set dedup=off and back shows in ls") {
    DedeOk({"set", vol, "vm1", "dedup=off"});
    json ls = DedeJson({"ls", vol, "--json"});
    CHECK(FindFile(ls, "vm1")->at("dedup") == false);
    CHECK(FindFile(ls, "odd")->at("dedup") == true);
    ProcessResult ls_long = DedeOk({"ls", vol, "-l"});
    CHECK(ls_long.out.find("off") != std::string::npos);
    DedeOk({"set", vol, "vm1", "dedup=on"});
    ls = DedeJson({"ls", vol, "--json"});
    CHECK(FindFile(ls, "vm1")->at("dedup") == true);
    DedeFails({"set", vol, "missing", "dedup=on"});
  }
  SECTION("export of a missing file fails and creates nothing") {
    DedeFails({"export", vol, "missing", dir.file("missing.out")});
    CHECK_FALSE(std::filesystem::exists(dir.file("missing.out")));
  }

  // Whatever the section did: remove everything, space comes back.
  {
    json ls = DedeJson({"ls", vol, "--json"});
    for (const auto& f : ls) DedeOk({"rm", vol, f.at("name")});
    DedeFails({"rm", vol, "vm1"});  // gone
    json stats = DedeJson({"stats", vol, "--json"});
    INFO(stats.dump(2));
    CHECK(stats.at("files") == 0);
    CHECK(stats.at("logical_bytes") == 0);
    CHECK(stats.at("free_bytes") == free0);
    CHECK(DedeOk({"ls", vol}).out.empty());
  }
  {
    ProcessResult fsck = DedeOk({"fsck", vol});
    CHECK(fsck.out.find("clean") != std::string::npos);
    json report = DedeJson({"fsck", vol, "--json"});
    CHECK(report.at("clean") == true);
    CHECK(report.at("problems").empty());
    DedeOk({"fsck", vol, "--repair"});
  }
}

TEST_CASE("dede import into a volume too small for the image", "[cli]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  CreateSparseFile(vol, 24 * kMiB);
  DedeOk({"format", vol});
  const json stats0 = DedeJson({"stats", vol, "--json"});
  const std::string img = dir.file("big.raw");
  const uint64_t nonzero = MakeImage(img, 20 * kMiB / kBlockSize, 3);
  REQUIRE(nonzero * kBlockSize > stats0.at("free_bytes").get<uint64_t>());

  DedeFails({"import", vol, "big", img});
  // The partial file is gone and its space with it.
  json ls = DedeJson({"ls", vol, "--json"});
  CHECK(ls.empty());
  json stats = DedeJson({"stats", vol, "--json"});
  CHECK(stats.at("free_bytes") == stats0.at("free_bytes"));
  DedeOk({"fsck", vol});
}

TEST_CASE("dede refuses bad devices without writing to them", "[cli]") {
  TempDir dir;
  const std::string raw = dir.file("small.raw");
  WriteWholeFile(raw, RandomBytes(64 * 1024, 1));

  SECTION("a device too small to format") {
    const std::string vol = dir.file("tiny.img");
    CreateSparseFile(vol, 4 * kMiB);
    const std::string before = Digest(vol);
    DedeFails({"format", vol});
    DedeFails({"format", vol, "--force"});
    CHECK(Digest(vol) == before);
  }
  SECTION("a missing device") {
    DedeFails({"info", dir.file("missing.img")});
    DedeFails({"format", dir.file("missing.img")});
    CHECK_FALSE(std::filesystem::exists(dir.file("missing.img")));
  }
  SECTION("a volume this user may not write says why it needs to") {
    // Only reading, `dede info` still opens the volume read-write (it takes
    // the volume's locks, which are written): the bare "Permission denied"
    // left a user guessing.
    const std::string vol = dir.file("ro.img");
    CreateSparseFile(vol, 64 * kMiB);
    DedeOk({"format", vol});
    std::filesystem::permissions(
        dir.file(""), std::filesystem::perms::owner_all | std::filesystem::perms::group_read |
                          std::filesystem::perms::group_exec | std::filesystem::perms::others_read |
                          std::filesystem::perms::others_exec);
    std::filesystem::permissions(
        vol, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write |
                 std::filesystem::perms::group_read | std::filesystem::perms::others_read);
    const std::vector<std::string> argv = {test::RequireProgram("setpriv"),
                                           "--reuid=65534",
                                           "--regid=65534",
                                           "--clear-groups",
                                           BinaryPath("dede"),
                                           "info",
                                           vol};
    ProcessResult r = RunProcess(argv);
    INFO(Describe(argv, r));
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("Permission denied (dede needs read-write access to a volume even to read "
                     "it") != std::string::npos);
  }
  SECTION("random bytes are not a volume") {
    const std::string vol = dir.file("random.img");
    WriteWholeFile(vol, RandomBytes(32 * kMiB, 99));
    RequireRefusedUntouched(vol, raw);
  }
  SECTION("a volume of a newer format version") {
    const std::string vol = dir.file("newer.img");
    CreateSparseFile(vol, 64 * kMiB);
    DedeOk({"format", vol});
    for (uint64_t addr : kSuperblockAddrs) {
      EditSuperblock(vol, addr, [addr](uint8_t* blk) {
        BlockHeader h = PeekHeader(blk);
        REQUIRE(h.magic == kMagicSuperblock);
        h.major = kFormatMajor + 1;
        Uuid uuid;
        std::memcpy(uuid.data(), blk + kHeaderSize, uuid.size());  // first payload field
        SealBlock(blk, h, uuid);
        REQUIRE(DecodeSuperblock(blk, addr).status().code() == Status::Code::kUnsupported);
      });
    }
    RequireRefusedUntouched(vol, raw, "newer");
    // It is still recognised as a dede volume: format wants --force.
    const std::string before = Digest(vol);
    DedeFails({"format", vol});
    CHECK(Digest(vol) == before);
  }
  SECTION("both superblock copies corrupt") {
    const std::string vol = dir.file("corrupt.img");
    CreateSparseFile(vol, 64 * kMiB);
    DedeOk({"format", vol});
    for (uint64_t addr : kSuperblockAddrs) {
      EditSuperblock(vol, addr, [](uint8_t* blk) { blk[200] ^= 0x5a; });
    }
    RequireRefusedUntouched(vol, raw);
    // Damaged, but recognisably a dede volume: format wants --force.
    const std::string before = Digest(vol);
    ProcessResult r = DedeFails({"format", vol});
    CHECK(r.err.find("--force") != std::string::npos);
    CHECK(Digest(vol) == before);
    DedeOk({"format", vol, "--force"});
    DedeOk({"info", vol});
  }
}

// Whether a volume opens from the backup superblock when the primary copy
// is damaged, and whether fsck --repair rewrites the primary.
TEST_CASE("dede opens a volume whose primary superblock is corrupt", "[cli]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  CreateSparseFile(vol, 64 * kMiB);
  DedeOk({"format", vol});
  DedeOk({"create", vol, "f", "--size", "1M"});
  const json before = DedeJson({"info", vol, "--json"});
  EditSuperblock(vol, 0, [](uint8_t* blk) { blk[200] ^= 0x5a; });

  json info = DedeJson({"info", vol, "--json"});
  CHECK(info.at("uuid") == before.at("uuid"));
  CHECK(info.at("superblocks").at(0).at("ok") == false);
  CHECK(info.at("superblocks").at(1).at("ok") == true);
  CHECK(DedeOk({"ls", vol}).out == "f\n");

  ProcessResult check = Dede({"fsck", vol});
  INFO(Describe({"fsck", vol}, check));
  CHECK(check.exit_code == 1);  // the damaged copy is a problem fsck reports
  CHECK(check.out.find("superblock") != std::string::npos);
  DedeOk({"fsck", vol, "--repair"});
  info = DedeJson({"info", vol, "--json"});
  CHECK(info.at("superblocks").at(0).at("ok") == true);
  DedeOk({"fsck", vol});
}

TEST_CASE("dede over iSCSI: unreachable portal / wrong IQN / a working LUN", "[cli]") {
  SECTION("nobody listening on the portal") {
    const std::string url =
        "iscsi://127.0.0.1:" + std::to_string(ClosedPort()) + "/iqn.2024-01.org.example:none/1";
    ProcessResult r = DedeFails({"info", url});
    DedeFails({"format", url});
    DedeFails({"ls", url});
  }
  SECTION("a real tgtd") {
    TempDir dir;
    const std::string lun = dir.file("lun.img");
    CreateSparseFile(lun, 64 * kMiB);
    test::TgtdRig tgtd(lun);

    const std::string before = Digest(lun);
    const std::string wrong =
        "iscsi://127.0.0.1:" + std::to_string(tgtd.port()) + "/" + tgtd.iqn() + "-wrong/1";
    DedeFails({"format", wrong});
    DedeFails({"info", wrong});
    const std::string wrong_lun =
        "iscsi://127.0.0.1:" + std::to_string(tgtd.port()) + "/" + tgtd.iqn() + "/7";
    DedeFails({"format", wrong_lun});
    CHECK(Digest(lun) == before);

    DedeOk({"format", tgtd.url()});
    json info = DedeJson({"info", tgtd.url(), "--json"});
    CHECK(info.at("size_bytes") == 64 * kMiB);
    DedeOk({"create", tgtd.url(), "over-iscsi", "--size", "4M"});
    json ls = DedeJson({"ls", tgtd.url(), "-l", "--json"});
    REQUIRE(ls.size() == 1);
    CHECK(ls.at(0).at("name") == "over-iscsi");
    DedeOk({"fsck", tgtd.url()});
  }
}

TEST_CASE("dede usage errors exit 2 and touch nothing", "[cli]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  const std::string missing = dir.file("not-created.img");
  CreateSparseFile(vol, 64 * kMiB);
  DedeOk({"format", vol});
  DedeOk({"create", vol, "f", "--size", "1M"});
  const std::string before = Digest(vol);

  const std::vector<std::vector<std::string>> cases = {
      {},
      {"bogus"},
      {"--bogus"},
      {"help", "bogus"},
      {"format"},
      {"format", missing, "--bogus"},
      {"format", missing, "--forc"},  // no abbreviations
      {"format", missing, "--max-hosts"},
      {"format", missing, "--max-hosts", "0"},
      {"format", missing, "--max-hosts", "251"},
      {"format", missing, "--max-hosts", "lots"},
      {"format", missing, "--hash", "md5"},
      {"format", missing, "extra"},
      {"info"},
      {"info", vol, "extra"},
      {"info", vol, "--json=yes"},
      {"stats", vol, "-x"},
      {"create", vol, "g"},
      {"create", vol, "g", "--size", "12Q"},
      {"create", vol, "g", "--size", "1.5"},
      {"create", vol, "g", "--size", ""},
      {"import", vol, "g"},
      {"import", vol, "g", vol, "--size", "lots"},
      {"export", vol, "f"},
      {"ls", vol, "-x"},
      {"rm", vol},
      {"set", vol, "f"},
      {"set", vol, "f", "dedup=maybe"},
      {"set", vol, "f", "colour=red"},
      {"set", vol, "f", "dedup"},
      {"fsck", vol, "--repiar"},
      {"fsck"},
      // 2^64 ns / 1e9 + 1 s: in ns it wraps to 0.3 s
      {"policy", vol, "set", "stable-after=18446744074"},
      {"policy", vol, "set", "stable-after=366d"},
      {"dedup", vol, "--split-after", "0"},             // would split every shard at every pass
      {"dedup", vol, "--control", missing},             // --control is for --now
      {"policy", vol, "set", "windows="},               // an unset variable is not "always"
      {"create", vol, ".dede-policy", "--size", "4K"},  // dede's own names
      {"create", vol, "x/y", "--size", "4K"},           // names no file can have
      {"create", vol, std::string(256, 'n'), "--size", "4K"},
      {"create", vol, "..", "--size", "4K"},  // an export name URIs would resolve away
      {"import", vol, ".", vol},
      {"import", vol, "x/y", vol},
      {"set", vol, "x/y", "dedup=off"},
      {"import", vol, ".dede-arena-0000000000000000", vol},
  };
  for (const auto& args : cases) DedeUsageError(args);
  // Environment variables that must be numbers: "1x" is not host 1.
  for (const char* env : {"DEDE_HOST_ID=1x", "DEDE_HOST_ID=251", "DEDE_LEASE_IO_TIMEOUT=ten",
                          "DEDE_LEASE_IO_TIMEOUT=-1"}) {
    ProcessResult r = RunProcess({"env", env, BinaryPath("dede"), "ls", vol});
    INFO(env << ": exit " << r.exit_code << ": " << r.err);
    CHECK(r.exit_code != 0);
    CHECK(r.err.find(std::string(env).substr(0, std::string(env).find('='))) != std::string::npos);
  }
  CHECK(Digest(vol) == before);
  CHECK_FALSE(std::filesystem::exists(missing));
}

// `dede export VOL f VOL` truncated the volume it was reading (and a LUN's
// block device named as the target got file data over its superblock).
TEST_CASE("dede export refuses to write over the volume itself", "[cli]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  CreateSparseFile(vol, 64 * kMiB);
  DedeOk({"format", vol});
  DedeOk({"create", vol, "f", "--size", "1M"});
  const std::string link = dir.file("link.img");
  REQUIRE(::link(vol.c_str(), link.c_str()) == 0);
  const std::string copy = dir.file("copy.img");
  std::filesystem::copy_file(vol, copy);
  const std::string before = Digest(vol), copy_before = Digest(copy);
  for (const std::string& target : {vol, link, copy}) {
    INFO(target);
    ProcessResult r = DedeFails({"export", vol, "f", target});
    CHECK(r.err.find("holds this volume") != std::string::npos);
  }
  CHECK(Digest(vol) == before);
  CHECK(Digest(copy) == copy_before);
}

TEST_CASE("dede help and version", "[cli]") {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--help"}, std::vector<std::string>{"-h"},
        std::vector<std::string>{"help"}}) {
    ProcessResult r = DedeOk(args);
    for (const char* cmd :
         {"format", "info", "create", "import", "export", "ls", "rm", "set", "stats", "fsck"}) {
      CHECK(r.out.find(std::string("\n  ") + cmd + " ") != std::string::npos);
    }
  }
  for (const char* cmd :
       {"format", "info", "create", "import", "export", "ls", "rm", "set", "stats", "fsck"}) {
    for (const std::vector<std::string>& args :
         {std::vector<std::string>{cmd, "--help"}, std::vector<std::string>{cmd, "-h"},
          std::vector<std::string>{"help", cmd}}) {
      ProcessResult r = DedeOk(args);
      CHECK(r.out.rfind(std::string("usage: dede ") + cmd, 0) == 0);
      CHECK(r.err.empty());
    }
  }
  ProcessResult v = DedeOk({"--version"});
  CHECK(v.out.rfind("dede ", 0) == 0);
}

// `dede rm` removed dede's own files like any other (an arena, an index
// shard, the policy) without a word.
TEST_CASE("dede rm leaves dede's own files alone unless forced", "[cli]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  CreateSparseFile(vol, 64 * kMiB);
  DedeOk({"format", vol});
  DedeOk({"policy", vol, "set", "rate=10"});
  ProcessResult r = DedeFails({"rm", vol, ".dede-policy"});
  CHECK(r.err.find("dede's own files") != std::string::npos);
  // Nor does set (it flipped the policy file's flag and gave it a log).
  DedeUsageError({"set", vol, ".dede-policy", "dedup=off"});
  CHECK(Dede({"ls", vol, "--all"}).out.find(".dede-wlog-") == std::string::npos);
  CHECK(DedeJson({"policy", vol, "show", "--json"}).dump().find("10") != std::string::npos);
  DedeOk({"rm", vol, ".dede-policy", "--force"});
  DedeFails({"rm", vol, ".dede-policy"});  // gone now: not found
}

TEST_CASE("dede dedup --now with a --control nobody answers fails instead of running here",
          "[cli]") {
  // It ran the pass itself without a word, skipping as busy every disk the
  // dedupd it meant to ask serves.
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  CreateSparseFile(vol, 64 * kMiB);
  DedeOk({"format", vol});
  ProcessResult r = DedeFails({"dedup", vol, "--now", "--control", dir.file("none.ctl")});
  CHECK(r.err.find("no dedupd at " + dir.file("none.ctl")) != std::string::npos);
  CHECK(r.out.empty());
  // Without --control and no dedupd at the default socket, the pass runs here.
  DedeOk({"dedup", vol, "--now", "--json"});
  // dede status with nobody there says what to check.
  r = DedeFails({"status", "--control", dir.file("none.ctl")});
  CHECK(r.err.find("no dedupd at " + dir.file("none.ctl")) != std::string::npos);
  CHECK(r.err.find("is dedupd running (systemctl status dedupd)?") != std::string::npos);
}

TEST_CASE("dede rm/set/export of a file held open elsewhere fail cleanly", "[cli]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  CreateSparseFile(vol, 64 * kMiB);
  DedeOk({"format", vol});
  DedeOk({"create", vol, "held", "--size", "8M"});
  DedeOk({"create", vol, "free", "--size", "8M"});

  // This process holds "held" open: an OFD lock another process cannot get.
  auto opened = OpenVolumeSpec(vol, OpenOptions{});
  REQUIRE(opened.ok());
  auto file = opened->volume->OpenFile("held");
  REQUIRE(file.ok());
  const std::string block(kBlockSize, 'x');
  REQUIRE((*file)->Write(0, block.data(), block.size()).ok());
  REQUIRE((*file)->Flush().ok());

  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"rm", vol, "held"},
        std::vector<std::string>{"set", vol, "held", "dedup=off"},
        std::vector<std::string>{"export", vol, "held", dir.file("held.out")}}) {
    ProcessResult r = DedeFails(args);
    INFO(Describe(args, r));
    CHECK(r.err.find("in use") != std::string::npos);
    // Said once, not "'held' is in use ... (file 'held' is in use ...)".
    CHECK(r.err.find("in use") == r.err.rfind("in use"));
  }
  CHECK_FALSE(std::filesystem::exists(dir.file("held.out")));
  {
    // A control socket nobody answers on (a dedupd that died): the refusal
    // says so, instead of only "in use by another process".
    const std::string dead = dir.file("dead.ctl");
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", dead.c_str());
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    ::close(fd);  // the socket file stays; connecting to it is refused
    ProcessResult r = DedeFails({"set", vol, "held", "dedup=off", "--control", dead});
    CHECK(r.err.find("in use") != std::string::npos);
    CHECK(r.err.find("did not answer") != std::string::npos);
  }

  json ls = DedeJson({"ls", vol, "-l", "--json"});
  INFO(ls.dump(2));
  REQUIRE(FindFile(ls, "held") != nullptr);
  CHECK(FindFile(ls, "held")->at("in_use") == true);
  // The holder's metadata may still sit in its journal, not at home where
  // other processes read it: the inode figures may lag, but are numbers.
  CHECK(FindFile(ls, "held")->at("mapped_blocks").is_number_unsigned());
  CHECK(FindFile(ls, "held")->at("shared_blocks").is_null());
  CHECK(FindFile(ls, "free")->at("in_use") == false);
  CHECK(DedeOk({"ls", vol, "-l"}).out.find("held  (in use)") != std::string::npos);
  // Other files stay usable meanwhile.
  DedeOk({"rm", vol, "free"});

  file->reset();  // releases the file lock
  opened->volume.reset();
  DedeOk({"rm", vol, "held"});
  DedeOk({"fsck", vol});
}

// A process that has written and then sits idle (its file closed, the
// volume still open) must not hold up a command that needs its groups:
// closing a file hands cached locks back. The command must finish or fail
// cleanly, never wait forever.
TEST_CASE("dede rm next to an idle writer finishes or fails cleanly", "[cli]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  CreateSparseFile(vol, 64 * kMiB);
  DedeOk({"format", vol});
  DedeOk({"create", vol, "f", "--size", "8M"});
  auto opened = OpenVolumeSpec(vol, OpenOptions{});
  REQUIRE(opened.ok());
  {
    auto file = opened->volume->OpenFile("f");
    REQUIRE(file.ok());
    const std::string block(kBlockSize, 'x');
    REQUIRE((*file)->Write(0, block.data(), block.size()).ok());
    REQUIRE((*file)->Flush().ok());
  }
  const std::vector<std::string> args = {"rm", vol, "f"};
  ProcessResult r = Dede(args, /*timeout_s=*/10);
  INFO(Describe(args, r));
  CHECK(r.signal == 0);
  CHECK((r.exit_code == 0 || (r.exit_code == 1 && LineCount(r.err) == 1)));
}

}  // namespace
}  // namespace dede

namespace dede {
namespace {

// The primary superblock of the volume in file `vol`.
Superblock SuperblockOf(const std::string& vol) {
  const std::string head = test::ReadWholeFileText(vol).substr(0, kBlockSize);
  auto sb = DecodeSuperblock(reinterpret_cast<const uint8_t*>(head.data()), 0);
  REQUIRE(sb.ok());
  return *sb;
}

// Where host h's sanlock delta lease lives in the volume file.
off_t DeltaLeaseOffset(const std::string& vol, uint32_t h) {
  return static_cast<off_t>(LeaseLayoutOf(SuperblockOf(vol)).lockspace_offset +
                            (h - 1) * kBlockSize);
}

// A sanlock delta lease (sanlock's leader record: magic, owner, generation,
// timestamp, io_timeout) for host `h`, written straight into the volume
// file, as a joined host's daemon keeps rewriting it. No Catch macros:
// also called from a thread.
bool WriteDeltaLease(const std::string& vol, off_t at, uint32_t h, uint64_t timestamp) {
  std::vector<uint8_t> lease(kBlockSize, 0);
  EncodeU32(lease.data(), 0x12212010u);
  EncodeU64(lease.data() + 32, h);
  EncodeU64(lease.data() + 40, 1);
  EncodeU64(lease.data() + 152, timestamp);
  EncodeU16(lease.data() + 174, 1);  // io_timeout 1 s: an 8 s watch
  const int fd = ::open(vol.c_str(), O_WRONLY);
  if (fd < 0) return false;
  const bool ok =
      ::pwrite(fd, lease.data(), lease.size(), at) == static_cast<ssize_t>(lease.size());
  ::fsync(fd);
  ::close(fd);
  return ok;
}

}  // namespace

// format --force used to erase a volume still in use: on a sanlock volume
// other processes lock /run/dede/<uuid>.lock, not the device, and other
// hosts only show as renewals of their delta leases; the running VMs lost
// their metadata and every host its lockspace.
TEST_CASE("dede format --force refuses a volume in use, here or on another host", "[cli]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  const std::vector<std::string> env;
  CreateSparseFile(vol, 64 * kMiB);
  auto format = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {BinaryPath("dede"), "format", vol, "--locks", "sanlock"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return RunProcess(argv, env, 120);
  };
  ProcessResult r = format({});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);

  SECTION("a host that stopped renewing does not count") {
    REQUIRE(WriteDeltaLease(vol, DeltaLeaseOffset(vol, 3), 3, 50));
    r = format({"--force"});
    INFO(r.err);
    CHECK(r.exit_code == 0);
  }
  SECTION("a host that renews its lease meanwhile keeps the volume") {
    const off_t at = DeltaLeaseOffset(vol, 2);
    REQUIRE(WriteDeltaLease(vol, at, 2, 100));
    const std::string before = Digest(vol);
    std::atomic<bool> stop{false};
    std::thread renewer([&] {
      for (uint64_t t = 101; !stop; t++) {
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        (void)WriteDeltaLease(vol, at, 2, t);
      }
    });
    r = format({"--force"});
    stop = true;
    renewer.join();
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("host 2") != std::string::npos);
    CHECK(r.err.find("rem_lockspace") != std::string::npos);
    REQUIRE(WriteDeltaLease(vol, at, 2, 100));  // as before the renewals
    CHECK(Digest(vol) == before);
  }
  SECTION("a process of this host with the volume open keeps it") {
    // Its process of the default sanlock daemon (SanlockHostLockPath).
    const std::string path = SanlockHostLockPath(UuidToString(SuperblockOf(vol).uuid));
    auto lm = OpenLocalLockManager(path);
    REQUIRE(lm.ok());
    REQUIRE(lm.value()->Acquire(LockId{LockKind::kVolume, 0}, LockMode::kShared, false).ok());
    const std::string before = Digest(vol);
    r = format({"--force"});
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("in use") != std::string::npos);
    CHECK(Digest(vol) == before);
    lm.value().reset();
    std::filesystem::remove(path);
  }
  SECTION("a process of this host's other sanlock daemon with the volume open keeps it") {
    // format run as that daemon's host (SANLOCK_RUN_DIR) looks at its file.
    const std::string run_dir = dir.file("sanlock run");
    std::filesystem::create_directories(run_dir);
    ::setenv("SANLOCK_RUN_DIR", run_dir.c_str(), 1);
    const std::string path = SanlockHostLockPath(UuidToString(SuperblockOf(vol).uuid));
    ::unsetenv("SANLOCK_RUN_DIR");
    CHECK(path.find("%2F") != std::string::npos);
    CHECK(path != SanlockHostLockPath(UuidToString(SuperblockOf(vol).uuid)));
    auto lm = OpenLocalLockManager(path);
    REQUIRE(lm.ok());
    REQUIRE(lm.value()->Acquire(LockId{LockKind::kVolume, 0}, LockMode::kShared, false).ok());
    const std::string before = Digest(vol);
    ProcessResult other =
        RunProcess({BinaryPath("dede"), "format", vol, "--locks", "sanlock", "--force"},
                   {"SANLOCK_RUN_DIR=" + run_dir}, 120);
    INFO(other.err);
    CHECK(other.exit_code == 1);
    CHECK(other.err.find("in use") != std::string::npos);
    CHECK(Digest(vol) == before);
    lm.value().reset();
    std::filesystem::remove(path);
  }
  SECTION("a lease path that is another file leaves both as they were") {
    const std::string other = dir.file("other.img");
    CreateSparseFile(other, 64 * kMiB);
    const std::string before = Digest(vol), other_before = Digest(other);
    r = format({"--force", "--lease-path", other});
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("--lease-path") != std::string::npos);
    CHECK(Digest(vol) == before);
    CHECK(Digest(other) == other_before);
  }
}

}  // namespace dede
