// Dedup passes racing NBD writers: dedupd runs passes every few hundred
// milliseconds (and on SIGUSR1) while qemu-io processes keep rewriting
// blocks of its exports with a handful of patterns (so most blocks are
// duplicates of blocks in other files and in the same file) and check what
// they read back. Nothing may ever read back wrong; the passes must really
// share blocks meanwhile; at the end every byte matches the model, through
// NBD and through `dede export`, and fsck is clean.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/rig.h"

using namespace dede;
using namespace dede::test;

namespace {

constexpr uint64_t kBlk = 4096;

ProcessResult MustRun(const std::vector<std::string>& argv, int timeout_s = 300) {
  ProcessResult r = RunProcess(argv, timeout_s);
  INFO(DescribeRun(argv, r));
  REQUIRE(r.exit_code == 0);
  return r;
}

void DedeOk(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {BinaryPath("dede")};
  argv.insert(argv.end(), args.begin(), args.end());
  MustRun(argv);
}

// One file's writer: a qemu-io script of aligned pattern writes, zero
// writes and verifying reads; the model is the pattern byte per block
// (0 = zeros), and only this script writes the file.
struct Writer {
  std::string name;
  std::vector<uint8_t> model;  // per block
  std::mt19937_64 rng;

  Writer(std::string n, uint64_t blocks, uint64_t seed)
      : name(std::move(n)), model(blocks, 0), rng(seed) {}

  uint64_t Below(uint64_t n) { return rng() % n; }

  // A read -P of a run of equal-pattern blocks starting at `b`.
  std::string VerifyRun(uint64_t b) const {
    uint64_t e = b;
    while (e < model.size() && model[e] == model[b] && e - b < 64) e++;
    return "read -P " + std::to_string(model[b]) + " " + std::to_string(b * kBlk) + " " +
           std::to_string((e - b) * kBlk);
  }

  std::vector<std::string> Round(const std::string& uri, int ops) {
    std::vector<std::string> argv = {RequireProgram("qemu-io"), "-f", "raw"};
    for (int i = 0; i < ops; i++) {
      const uint64_t b = Below(model.size());
      const uint64_t n = 1 + Below(std::min<uint64_t>(16, model.size() - b));
      std::string c;
      if (Below(10) == 0) {
        c = "write -z " + std::to_string(b * kBlk) + " " + std::to_string(n * kBlk);
        std::fill(model.begin() + long(b), model.begin() + long(b + n), 0);
      } else {
        // Eight patterns: nearly every block has many twins.
        const uint8_t p = uint8_t(1 + Below(8));
        c = "write -P " + std::to_string(p) + " " + std::to_string(b * kBlk) + " " +
            std::to_string(n * kBlk);
        std::fill(model.begin() + long(b), model.begin() + long(b + n), p);
      }
      argv.insert(argv.end(), {"-c", c});
      if (Below(3) == 0) argv.insert(argv.end(), {"-c", VerifyRun(Below(model.size()))});
    }
    argv.push_back(uri);
    return argv;
  }

  std::vector<std::string> VerifyAll(const std::string& uri) const {
    std::vector<std::string> argv = {RequireProgram("qemu-io"), "-f", "raw"};
    for (uint64_t b = 0; b < model.size();) {
      uint64_t e = b;
      while (e < model.size() && model[e] == model[b] && e - b < 256) e++;
      argv.insert(argv.end(), {"-c", "read -P " + std::to_string(model[b]) + " " +
                                         std::to_string(b * kBlk) + " " +
                                         std::to_string((e - b) * kBlk)});
      b = e;
    }
    argv.push_back(uri);
    return argv;
  }
};

void RequireNoMismatch(const std::vector<std::string>& argv, const ProcessResult& r) {
  INFO(DescribeRun({argv[0], "(script)", argv.back()}, r));
  REQUIRE(r.exit_code == 0);
  REQUIRE(r.out.find("Pattern verification failed") == std::string::npos);
  REQUIRE(r.out.find("fail") == std::string::npos);
  REQUIRE(r.err.find("error") == std::string::npos);
}

// Sums "<n> new shared, <m> shared again" over the passes dedupd logged.
void PassTotals(const std::string& log, uint64_t* passes, uint64_t* shared) {
  static const std::regex re(
      R"(dedup pass \d+: \d+ records from \d+ logs, (\d+) new shared, (\d+) shared again)");
  *passes = 0;
  *shared = 0;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), re); it != std::sregex_iterator();
       ++it) {
    (*passes)++;
    *shared += std::stoull((*it)[1]) + std::stoull((*it)[2]);
  }
}

}  // namespace

TEST_CASE("dedup passes racing NBD writers never corrupt a block", "[dedup-nbd]") {
  TempDir dir;
  const std::string vol = dir.file("vol.img");
  const std::string sock = dir.file("nbd.sock");
  CreateSparseFile(vol, 512ull << 20);
  DedeOk({"format", vol});
  const uint64_t blocks = 2048;  // 8 MiB files
  std::vector<Writer> writers;
  for (int i = 0; i < 3; i++) {
    writers.emplace_back("vm" + std::to_string(i), blocks, 100 + uint64_t(i));
    DedeOk({"create", vol, writers.back().name, "--size", std::to_string(blocks * kBlk)});
  }
  uint64_t passes = 0, shared = 0;
  {
    DedupdProcess d(vol, 1, sock,
                    {"--dedup-interval", "0.25", "--log-flush-interval", "0.1",
                     "--sync-interval", "0.2", "--dedup-fraction", "0"});
    for (int round = 0; round < 8; round++) {
      std::vector<std::vector<std::string>> argvs;
      for (Writer& w : writers) argvs.push_back(w.Round(d.Uri(w.name), 250));
      std::vector<ProcessResult> results(writers.size());
      std::vector<std::thread> threads;
      for (size_t i = 0; i < writers.size(); i++) {
        threads.emplace_back([&, i] { results[i] = RunProcess(argvs[i], 300); });
      }
      // Extra passes right in the middle of the writing.
      for (int k = 0; k < 3; k++) {
        ::kill(d.pid(), SIGUSR1);
        std::this_thread::sleep_for(std::chrono::milliseconds(150));
      }
      for (auto& t : threads) t.join();
      for (size_t i = 0; i < writers.size(); i++) {
        INFO("round " << round << " writer " << writers[i].name);
        RequireNoMismatch(argvs[i], results[i]);
      }
    }
    // Let a last pass or two run over what was written, then read all.
    ::kill(d.pid(), SIGUSR1);
    std::this_thread::sleep_for(std::chrono::seconds(1));
    for (Writer& w : writers) {
      auto argv = w.VerifyAll(d.Uri(w.name));
      RequireNoMismatch(argv, RunProcess(argv, 300));
    }
    REQUIRE(d.Stop() == 0);
    PassTotals(d.Log(), &passes, &shared);
    INFO(d.Log().substr(0, 6000));
    CHECK(passes >= 4);
    // The passes did share blocks while the writers ran.
    CHECK(shared > 500);
  }
  // At rest: fsck clean, and the bytes are the model's through the CLI too.
  MustRun({BinaryPath("dede"), "fsck", vol});
  for (const Writer& w : writers) {
    const std::string out = dir.file(w.name + ".raw");
    DedeOk({"export", vol, w.name, out});
    std::vector<uint8_t> got = ReadWholeFile(out);
    REQUIRE(got.size() == blocks * kBlk);
    for (uint64_t b = 0; b < blocks; b++) {
      const bool same = std::all_of(got.begin() + long(b * kBlk),
                                    got.begin() + long((b + 1) * kBlk),
                                    [&](uint8_t c) { return c == w.model[b]; });
      INFO(w.name << " block " << b << " should be all " << int(w.model[b]));
      REQUIRE(same);
    }
  }
  // One more pass with nothing running: the 8 patterns end up as a handful
  // of physical blocks.
  DedeOk({"dedup", vol, "--force"});
  ProcessResult st = MustRun({BinaryPath("dede"), "stats", vol, "--json"});
  const std::smatch none;
  std::smatch m;
  REQUIRE(std::regex_search(st.out, m, std::regex(R"re("physical_data_bytes"\s*:\s*(\d+))re")));
  INFO(st.out);
  CHECK(std::stoull(m[1]) <= 8 * kBlk);
  MustRun({BinaryPath("dede"), "fsck", vol});
}
