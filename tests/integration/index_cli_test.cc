// `dede stats`, `dede ls -l` and `dede fsck` on a volume with a dedup index,
// run as real processes: the figures agree with each other and with
// `dede analyze` of the same images, and damaged index shards and write
// logs are reported, skipped by dedup passes and repaired without any file
// losing a byte.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kmod/writemon/write_log.h"
#include "tests/integration/rig.h"
#include "volume/volume.h"

namespace dede {
namespace {

using json = nlohmann::json;
using test::BinaryPath;
using test::CreateSparseFile;
using test::ProcessResult;
using test::RunProcess;
using test::StartProcess;
using test::TempDir;

constexpr int kImages = 4;

std::string Describe(const std::vector<std::string>& args, const ProcessResult& r) {
  std::ostringstream s;
  for (const auto& a : args) s << a << ' ';
  s << "\n  exit " << r.exit_code << " signal " << r.signal << "\n  stdout: " << r.out
    << "\n  stderr: " << r.err;
  return s.str();
}

ProcessResult Dede(std::vector<std::string> args) {
  args.insert(args.begin(), BinaryPath("dede"));
  return RunProcess(args, 120);
}

ProcessResult DedeOk(const std::vector<std::string>& args) {
  ProcessResult r = Dede(args);
  INFO(Describe(args, r));
  REQUIRE(r.signal == 0);
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

struct Rig {
  TempDir dir;
  std::string vol = dir.file("vol");
  std::string imgs = dir.file("imgs");

  std::string Image(int i) const { return imgs + "/vm-0" + std::to_string(i) + ".img"; }
  std::string Name(int i) const { return "vm" + std::to_string(i); }

  // 4 images of 8 MiB, imported (import logs their fingerprints).
  explicit Rig(bool dedup = true) {
    ProcessResult g = RunProcess({BinaryPath("dede-vmgen"), "--out", imgs, "--images",
                                  std::to_string(kImages), "--size", "8M", "--seed", "7"});
    INFO(g.out << g.err);
    REQUIRE(g.exit_code == 0);
    CreateSparseFile(vol, 512ull << 20);
    DedeOk({"format", vol});
    for (int i = 0; i < kImages; i++) DedeOk({"import", vol, Name(i), Image(i)});
    if (dedup) {
      DedeOk({"dedup", vol});
      physical_after_dedup = DedeJson({"stats", vol, "--json"}).at("physical_data_bytes");
    }
  }
  uint64_t physical_after_dedup = 0;

  // Every file exports byte-identical to its image.
  void RequireExportsIdentical() {
    for (int i = 0; i < kImages; i++) {
      const std::string out = dir.file("out-" + std::to_string(i));
      DedeOk({"export", vol, Name(i), out});
      INFO("file " << Name(i));
      REQUIRE(test::ReadWholeFileText(out) == test::ReadWholeFileText(Image(i)));
    }
  }

  // Opens the volume with the library (no dede process may run meanwhile).
  OpenedVolume Open() {
    OpenOptions o;
    Result<OpenedVolume> v = OpenVolumeSpec(vol, o);
    INFO(v.status().ToString());
    REQUIRE(v.ok());
    return std::move(*v);
  }

  std::string LiveShardName() {
    json ls = DedeJson({"ls", vol, "--all", "--json"});
    std::vector<std::string> shards;
    for (const auto& f : ls) {
      const std::string name = f.at("name");
      if (name.rfind(".dede-ix-", 0) == 0) shards.push_back(name);
    }
    INFO(ls.dump(1));
    REQUIRE(shards.size() == 1);  // small images: one shard, never split
    return shards[0];
  }
};

json FsckJson(const std::string& vol, bool repair, int want_exit) {
  std::vector<std::string> args = {"fsck", vol, "--json"};
  if (repair) args.push_back("--repair");
  ProcessResult r = Dede(args);
  INFO(Describe(args, r));
  REQUIRE(r.signal == 0);
  REQUIRE(r.exit_code == want_exit);
  json j;
  REQUIRE_NOTHROW(j = json::parse(r.out));
  return j;
}

// The index problems fsck --json lists.
std::vector<json> IndexProblems(const json& fsck) {
  std::vector<json> out;
  for (const auto& p : fsck.at("problems")) {
    if (p.at("part") == "index") out.push_back(p);
  }
  return out;
}

void RequireFsckClean(const std::string& vol) {
  ProcessResult r = Dede({"fsck", vol});
  INFO(Describe({"fsck", vol}, r));
  REQUIRE(r.exit_code == 0);
  REQUIRE(r.out.find("clean") != std::string::npos);
}

// Damage seen by fsck (text and JSON), then the data is intact and dedup
// still runs; then repair and a clean fsck. `block` is where fsck must say
// the damage is.
void DamagedShardScenario(Rig& rig, const std::string& shard, uint64_t block) {
  const std::string where = shard + " block " + std::to_string(block);
  {
    ProcessResult r = Dede({"fsck", rig.vol});
    INFO(Describe({"fsck", rig.vol}, r));
    CHECK(r.exit_code == 1);
    CHECK(r.out.find(where) != std::string::npos);
    CHECK(r.err.find("problem") != std::string::npos);
    json j = FsckJson(rig.vol, false, 1);
    INFO(j.dump(1));
    bool named = false;
    for (const auto& p : IndexProblems(j)) {
      named |= p.at("where") == where && p.at("file") == shard && p.at("repaired") == false;
    }
    CHECK(named);
    CHECK(j.at("clean") == false);
  }
  rig.RequireExportsIdentical();
  // stats still work (the header may be fine or not).
  DedeOk({"stats", rig.vol});

  SECTION("dedup skips the damage and replaces the version") {
    // New records for the shard: enough to make the pass rewrite it.
    DedeOk({"import", rig.vol, "again", rig.Image(0)});
    ProcessResult d = DedeOk({"dedup", rig.vol});
    INFO(d.out);
    CHECK(d.out.find("1 rewritten") != std::string::npos);
    RequireFsckClean(rig.vol);
    rig.RequireExportsIdentical();
  }
  SECTION("fsck --repair then dedup --rescan rebuilds the index") {
    FsckJson(rig.vol, true, 0);
    RequireFsckClean(rig.vol);
    json d = DedeJson({"dedup", rig.vol, "--rescan", "--json"});
    INFO(d.dump(1));
    CHECK(d.at("files_rescanned") == kImages);
    json st = DedeJson({"stats", rig.vol, "--json"});
    INFO(st.dump(1));
    CHECK(st.at("index_entries").get<uint64_t>() > 0);
    CHECK(st.at("arena_blocks").get<uint64_t>() > 0);
    // The rebuilt index knows every block again: a forced pass over it
    // leaves exactly the physical data of the original dedup.
    DedeOk({"dedup", rig.vol, "--force"});
    CHECK(DedeJson({"stats", rig.vol, "--json"}).at("physical_data_bytes") ==
          rig.physical_after_dedup);
    RequireFsckClean(rig.vol);
    rig.RequireExportsIdentical();
  }
  SECTION("fsck --repair removes the damaged version") {
    json j = FsckJson(rig.vol, true, 0);
    INFO(j.dump(1));
    CHECK(j.at("clean") == true);
    CHECK(j.at("repaired").get<uint64_t>() >= 1);
    for (const auto& p : IndexProblems(j)) CHECK(p.at("repaired") == true);
    RequireFsckClean(rig.vol);
    // The volume keeps its savings: the files still share their blocks.
    json st = DedeJson({"stats", rig.vol, "--json"});
    CHECK(st.at("index_entries") == 0);
    CHECK(st.at("arena_blocks") == 0);
    CHECK(st.at("savings_percent").get<double>() > 10.0);
    // A later pass works on the repaired index.
    DedeOk({"import", rig.vol, "again", rig.Image(0)});
    ProcessResult d = DedeOk({"dedup", rig.vol});
    INFO(d.out);
    CHECK(d.out.find("1 rewritten") != std::string::npos);
    RequireFsckClean(rig.vol);
    rig.RequireExportsIdentical();
  }
}

TEST_CASE("stats and ls -l agree with each other and with analyze", "[dedup-cli]") {
  Rig rig;
  std::vector<std::string> analyze_args = {"analyze", "--json"};
  for (int i = 0; i < kImages; i++) analyze_args.push_back(rig.Image(i));
  const json an = DedeJson(analyze_args);
  json an4k;
  for (const auto& s : an.at("block_sizes")) {
    if (s.at("block_size") == 4096) an4k = s;
  }
  REQUIRE(!an4k.is_null());

  const json st = DedeJson({"stats", rig.vol, "--json"});
  const json ls = DedeJson({"ls", rig.vol, "-l", "--json"});
  INFO(st.dump(1) << "\n" << an4k.dump(1));

  // Logical: every non-zero block of the images (zeros are holes).
  CHECK(st.at("files") == kImages);
  CHECK(st.at("logical_bytes") == an4k.at("nonzero_bytes"));
  // Physical: within 1% of analyze's exact figure.
  const double phys = st.at("physical_data_bytes").get<double>();
  const double exact = an4k.at("physical_bytes").get<double>();
  CHECK(phys >= exact * 0.99);
  CHECK(phys <= exact * 1.01);
  CHECK(st.at("physical_bytes") == st.at("physical_data_bytes"));
  CHECK(st.at("savings_percent").get<double>() ==
        Approx(an4k.at("savings_pct").get<double>()).margin(1.0));
  // The index: one entry per distinct block; shared ones have an arena block.
  CHECK(st.at("index_entries") == an4k.at("distinct"));
  CHECK(st.at("index_entries").get<uint64_t>() ==
        st.at("index_unique_entries").get<uint64_t>() + st.at("index_shared_entries").get<uint64_t>());
  CHECK(st.at("arena_blocks") == st.at("index_shared_entries"));
  CHECK(st.at("index_shards") == 1);
  CHECK(st.at("index_bytes").get<uint64_t>() > 0);
  CHECK(st.at("index_pending_records") == 0);
  CHECK(st.at("index_stale_files") == 0);
  CHECK(st.at("metadata_overhead_bytes").get<uint64_t>() >=
        st.at("index_bytes").get<uint64_t>() + st.at("arena_pointer_bytes").get<uint64_t>());
  CHECK(st.at("metadata_overhead_percent").get<double>() > 0.0);
  CHECK(st.at("metadata_overhead_percent").get<double>() < 10.0);

  // ls -l: per file, unique + shared = mapped; the files' mapped blocks add
  // up to logical; unique blocks plus the distinct shared blocks (one arena
  // block each) make up physical.
  REQUIRE(ls.size() == kImages);
  uint64_t mapped = 0, unique = 0;
  for (const auto& f : ls) {
    INFO(f.dump());
    CHECK(f.at("unique_blocks").get<uint64_t>() + f.at("shared_blocks").get<uint64_t>() ==
          f.at("mapped_blocks").get<uint64_t>());
    CHECK(f.at("shared_blocks").get<uint64_t>() > 0);
    mapped += f.at("mapped_blocks").get<uint64_t>();
    unique += f.at("unique_blocks").get<uint64_t>();
  }
  CHECK(mapped == st.at("logical_blocks"));
  CHECK(unique == st.at("index_unique_entries"));
  CHECK(unique + st.at("arena_blocks").get<uint64_t>() == st.at("physical_data_blocks"));

  // Text forms.
  ProcessResult text = DedeOk({"stats", rig.vol});
  for (const char* label : {"logical", "physical", "savings", "index", "arena", "overhead"}) {
    CHECK(("\n" + text.out).find(std::string("\n") + label + " ") != std::string::npos);
  }
  ProcessResult table = DedeOk({"ls", rig.vol, "-l"});
  CHECK(table.out.find("UNIQUE") != std::string::npos);
  CHECK(table.out.find("SHARED") != std::string::npos);
  for (const auto& f : ls) {
    // The file's row carries its block counts.
    const std::string name = f.at("name");
    const size_t at = table.out.find("  " + name + "\n");
    REQUIRE(at != std::string::npos);
    const std::string row = table.out.substr(table.out.rfind('\n', at) + 1, at - table.out.rfind('\n', at));
    INFO(row);
    for (const char* k : {"mapped_blocks", "unique_blocks", "shared_blocks"}) {
      CHECK(row.find(" " + std::to_string(f.at(k).get<uint64_t>()) + " ") != std::string::npos);
    }
  }
  RequireFsckClean(rig.vol);
}

TEST_CASE("Ctrl-C stops dede dedup cleanly, and the next pass finishes the work", "[dedup-cli]") {
  // SIGINT used to kill an in-process pass outright: on a sanlock volume
  // its lock records stayed live (keeping other hosts out) until a process
  // of this host collected them. The first signal now stops the pass the
  // way a window's end does: it closes and unlocks what it holds, keeps
  // its work, says so, and fails.
  Rig rig(/*dedup=*/false);
  // A rate cap of 200 kB/s keeps the pass gathering for several seconds
  // (uncapped it takes a tenth of one), so the signal finds it running.
  DedeOk({"policy", rig.vol, "set", "rate=0.2"});
  const std::string log = rig.dir.file("dedup.log");
  const int pid = StartProcess({BinaryPath("dede"), "dedup", rig.vol, "--now"}, {}, log);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  REQUIRE(::kill(pid, SIGINT) == 0);
  int status = 0;
  const auto t0 = std::chrono::steady_clock::now();
  pid_t done = 0;
  while ((done = ::waitpid(pid, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(120)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (done == 0) ::kill(pid, SIGKILL);
  const std::string said = test::ReadWholeFileText(log);
  INFO("dede dedup said: " << said);
  REQUIRE(done == pid);
  REQUIRE(WIFEXITED(status));  // not killed by the signal
  CHECK(WEXITSTATUS(status) == 1);
  CHECK(said.find("interrupted") != std::string::npos);
  DedeOk({"fsck", rig.vol});
  // The next pass, uncapped, does the rest: every image shares what it can.
  DedeOk({"policy", rig.vol, "set", "rate=unlimited"});
  DedeOk({"dedup", rig.vol});
  const json st = DedeJson({"stats", rig.vol, "--json"});
  CHECK(st.at("physical_data_bytes").get<uint64_t>() < st.at("logical_bytes").get<uint64_t>());
  rig.RequireExportsIdentical();
  DedeOk({"fsck", rig.vol});
}

TEST_CASE("fsck finds a corrupt shard entry block and dedup and repair cope", "[dedup-cli]") {
  Rig rig;
  const std::string shard = rig.LiveShardName();
  {
    OpenedVolume v = rig.Open();
    auto f = v.volume->OpenFile(shard);
    REQUIRE(f.ok());
    REQUIRE((*f)->size() > 3 * kBlockSize);
    std::vector<uint8_t> junk(100, 0xA5);
    REQUIRE((*f)->Write(2 * kBlockSize, junk.data(), junk.size()).ok());
    f->reset();
    REQUIRE(v.volume->Sync().ok());
  }
  DamagedShardScenario(rig, shard, 2);
}

TEST_CASE("fsck finds a truncated shard and dedup and repair cope", "[dedup-cli]") {
  Rig rig;
  const std::string shard = rig.LiveShardName();
  {
    OpenedVolume v = rig.Open();
    auto f = v.volume->OpenFile(shard);
    REQUIRE(f.ok());
    REQUIRE((*f)->size() > 3 * kBlockSize);
    REQUIRE((*f)->Truncate(8192).ok());
    f->reset();
    REQUIRE(v.volume->Sync().ok());
  }
  DamagedShardScenario(rig, shard, 2);  // blocks 2.. are missing
}

TEST_CASE("fsck reports a corrupt write-log frame and dedup skips it", "[dedup-cli]") {
  Rig rig(/*dedup=*/false);
  std::string log;
  {
    OpenedVolume v = rig.Open();
    auto info = v.volume->Lookup("vm1");
    REQUIRE(info.ok());
    log = WriteLogName(info->id);
    auto f = v.volume->OpenFile(log);
    REQUIRE(f.ok());
    REQUIRE((*f)->size() > kBlockSize);
    std::vector<uint8_t> junk(100, 0x5A);
    REQUIRE((*f)->Write(200, junk.data(), junk.size()).ok());  // the first frame's payload
    f->reset();
    REQUIRE(v.volume->Sync().ok());
  }
  {
    ProcessResult r = Dede({"fsck", rig.vol});
    INFO(Describe({"fsck", rig.vol}, r));
    CHECK(r.exit_code == 1);
    CHECK(r.out.find(log + " byte 0: 1 corrupt frame") != std::string::npos);
    CHECK(r.err.find("dede dedup") != std::string::npos);
    // Repair leaves write logs alone: the problem stays.
    json j = FsckJson(rig.vol, true, 1);
    INFO(j.dump(1));
    std::vector<json> ps = IndexProblems(j);
    REQUIRE(ps.size() == 1);
    CHECK(ps[0].at("file") == log);
    CHECK(ps[0].at("repaired") == false);
  }
  // The pass skips the bad frame and consumes every log, the damaged one too.
  ProcessResult d = DedeOk({"dedup", rig.vol});
  INFO(d.out);
  CHECK(d.out.find("dedup pass: " + std::to_string(kImages) + " logs") != std::string::npos);
  CHECK(d.out.find("new shared blocks   0\n") == std::string::npos);
  RequireFsckClean(rig.vol);
  rig.RequireExportsIdentical();
}

}  // namespace
}  // namespace dede
