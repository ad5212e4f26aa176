// Several processes on one volume file with the local lock backend: they
// create, write, share, remove and sync concurrently; one is SIGKILLed in
// the middle. Afterwards fsck is clean and every survivor's data is exact.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <map>
#include <random>

#include "tests/integration/rig.h"
#include "tests/random_bytes.h"
#include "volume/block_device.h"
#include "volume/fsck.h"
#include "volume/volume.h"

using namespace dede;

namespace {

constexpr uint64_t kFileBlocks = 600;  // > 508: two-level block maps

// Deterministic content of block `b` of worker `w` after round `r`.
void Fill(uint8_t* p, int w, int r, uint64_t b) {
  std::mt19937_64 rng((uint64_t(w) << 40) ^ (uint64_t(r) << 20) ^ b);
  dede::test::FillRandom(rng, p, kBlockSize);
}

// A worker: owns file "w<w>"; each round rewrites a seeded subset of blocks,
// clones some blocks onto others inside the file, syncs, and every third
// round also creates and removes a scratch file. Exits 0 on success.
int Worker(const std::string& path, int w, int rounds) {
  auto ov = OpenVolumeSpec(path, OpenOptions{});
  if (!ov.ok()) {
    fprintf(stderr, "worker %d: open: %s\n", w, ov.status().ToString().c_str());
    return 10;
  }
  Volume* vol = ov->volume.get();
  std::string name = "w" + std::to_string(w);
  auto created = vol->Create(name, kFileBlocks * kBlockSize);
  if (!created.ok()) {
    fprintf(stderr, "worker %d: create: %s\n", w, created.status().ToString().c_str());
    return 11;
  }
  auto f = vol->OpenFile(name);
  if (!f.ok()) {
    fprintf(stderr, "worker %d: open file: %s\n", w, f.status().ToString().c_str());
    return 12;
  }
  std::vector<uint8_t> buf(kBlockSize);
  for (int r = 0; r < rounds; r++) {
    for (uint64_t b = 0; b < kFileBlocks; b++) {
      if ((b + r) % 3 != 0 && r > 0) continue;
      Fill(buf.data(), w, r, b);
      Status st = f.value()->Write(b * kBlockSize, buf.data(), kBlockSize);
      if (!st.ok()) {
        fprintf(stderr, "worker %d: write: %s\n", w, st.ToString().c_str());
        return 13;
      }
    }
    // Block 2k+1 becomes a COW copy of block 2k for the first 40 blocks.
    for (uint64_t b = 0; b < 40; b += 2) {
      Status st = vol->CloneBlock(f.value().get(), b, f.value().get(), b + 1);
      if (!st.ok()) {
        fprintf(stderr, "worker %d: clone: %s\n", w, st.ToString().c_str());
        return 14;
      }
    }
    if (r % 3 == 2) {
      std::string scratch = name + "-scratch";
      if (!vol->Create(scratch, 1 << 20).ok()) return 15;
      {
        auto sf = vol->OpenFile(scratch);
        if (!sf.ok()) return 16;
        if (!sf.value()->Write(0, buf.data(), kBlockSize).ok()) return 17;
      }
      if (!vol->Remove(scratch).ok()) return 18;
    }
    Status st = vol->Sync();
    if (!st.ok()) {
      fprintf(stderr, "worker %d: sync: %s\n", w, st.ToString().c_str());
      return 19;
    }
  }
  return 0;
}

// Expected content of a worker's block after all rounds.
void Expected(uint8_t* p, int w, int rounds, uint64_t b) {
  uint64_t src = (b < 40 && b % 2 == 1) ? b - 1 : b;
  int last = 0;
  for (int r = 0; r < rounds; r++) {
    if (r == 0 || (src + r) % 3 == 0) last = r;
  }
  Fill(p, w, last, src);
}

}  // namespace

// Formats `spec`, runs three workers and a SIGKILLed fourth concurrently on
// it, then checks fsck and every surviving worker's bytes.
void RunSharedVolumeScenario(const std::string& spec) {
  {
    auto dev = OpenBlockDevice(spec);
    REQUIRE(dev.ok());
    REQUIRE(FormatVolume(dev.value().get(), FormatOptions{}, true).ok());
  }
  const std::string& path = spec;
  const int kWorkers = 3, kRounds = 6;
  std::map<pid_t, int> kids;
  for (int w = 0; w < kWorkers; w++) {
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) _exit(Worker(path, w, kRounds));
    kids[pid] = w;
  }
  // A fourth process that is killed mid-flight: its journal must be replayed
  // by whoever needs its locks next, and it must not break anyone.
  pid_t victim = fork();
  REQUIRE(victim >= 0);
  if (victim == 0) _exit(Worker(path, 9, 1000));
  usleep(300 * 1000);
  kill(victim, SIGKILL);
  int vstatus = 0;
  REQUIRE(waitpid(victim, &vstatus, 0) == victim);
  for (auto& [pid, w] : kids) {
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    INFO("worker " << w);
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 0);
  }
  auto ov = OpenVolumeSpec(path, OpenOptions{});
  REQUIRE(ov.ok());
  auto rep = CheckVolume(ov->volume.get(), false);
  REQUIRE(rep.ok());
  for (const auto& p : rep->problems) UNSCOPED_INFO(p.where << ": " << p.what);
  REQUIRE(rep->clean());
  std::vector<uint8_t> got(kBlockSize), want(kBlockSize);
  for (int w = 0; w < kWorkers; w++) {
    auto f = ov->volume->OpenFile("w" + std::to_string(w));
    REQUIRE(f.ok());
    for (uint64_t b = 0; b < kFileBlocks; b++) {
      REQUIRE(f.value()->Read(b * kBlockSize, got.data(), kBlockSize).ok());
      Expected(want.data(), w, kRounds, b);
      INFO("worker " << w << " block " << b);
      REQUIRE(got == want);
    }
    for (uint64_t b = 0; b < 40; b++) REQUIRE(f.value()->BlockRefCount(b).value() == 2);
  }
  // The victim's file exists (it was created before the kill) or not at all;
  // either way no scratch file of a finished worker is left behind.
  auto list = ov->volume->List();
  REQUIRE(list.ok());
  for (const auto& fi : list.value()) {
    INFO(fi.name);
    REQUIRE((fi.name.rfind("w", 0) == 0));
    if (fi.name.find("scratch") != std::string::npos) REQUIRE(fi.name == "w9-scratch");
  }
}

TEST_CASE("processes share one volume file safely", "[multiprocess]") {
  test::TempDir dir;
  std::string path = dir.file("vol.img");
  test::CreateSparseFile(path, 256ull << 20);
  RunSharedVolumeScenario(path);
}

TEST_CASE("processes share one volume on an iSCSI LUN safely", "[multiprocess][iscsi]") {
  // The same workload through the iSCSI backend against a real tgtd: each
  // process has its own iSCSI session; the local lock backend keys its lock
  // file by the volume UUID.
  test::TempDir dir;
  std::string lun = dir.file("lun.img");
  test::CreateSparseFile(lun, 256ull << 20);
  test::TgtdRig rig(lun);
  RunSharedVolumeScenario(rig.url());
}
