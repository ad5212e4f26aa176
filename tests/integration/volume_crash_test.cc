// Process crashes: a child process doing seeded random writes, shares,
// clones, punches, trims, truncates and flushes on a volume in a regular
// file (path backend) is SIGKILLed at a random point, again and again.
// After each kill the parent reopens the volume (journal replay), requires
// a clean fsck, and checks every byte against a model: everything written
// before the last flush the child acknowledged reads back exactly; anything
// written after it may or may not be there (a killed process leaves its
// unflushed writes in the page cache, so usually they are), so each
// 512-byte sector must hold a value it had at or after that flush.
//
// The child reports each completed Sync() by writing the step index to a
// pipe. The op sequence is a function of the seed and of the model state at
// fork time (the child inherits the parent's model), so the parent replays
// the same sequence in the model to learn the state at that step and the
// values that may follow it.
//
// Reproduce with DEDE_SEED=<n> (the base seed; default 1).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tests/integration/rig.h"
#include "tests/random_bytes.h"
#include "tests/seeds.h"
#include "volume/block_device.h"
#include "volume/fsck.h"
#include "volume/volume.h"

using namespace dede;

namespace {

constexpr uint64_t kB = kBlockSize;
constexpr uint64_t kSec = kSectorSize;
constexpr uint64_t kCapBlocks = 768;  // 3 MiB; past 508 blocks the map has two levels
constexpr uint64_t kCap = kCapBlocks * kB;
constexpr uint64_t kVolBytes = 64ull << 20;
constexpr int kPatterns = 5;

uint64_t SecHash(const uint8_t* p) {
  return std::hash<std::string_view>{}(std::string_view(reinterpret_cast<const char*>(p), kSec));
}

struct PFile {
  std::string name;
  uint64_t size = 0;             // a multiple of 4 KiB
  std::vector<uint8_t> data;     // kCap bytes, zero beyond size
  std::vector<uint8_t> mapped;   // per block
  uint64_t nblocks() const { return size / kB; }
};

// Values each sector and size may hold after a crash (parent only).
struct Acceptable {
  std::vector<std::unordered_map<uint64_t, std::vector<uint64_t>>> alt;
  std::vector<std::set<uint64_t>> sizes;
};

enum class Op { kWrite, kClone, kShare, kPunch, kTrim, kTruncate, kSync };

// The op generator. The child runs it with a volume (and checks every
// result); the parent runs the same sequence without one to rebuild the
// model. Every decision depends only on the seed and the model.
class Gen {
 public:
  Gen(uint64_t seed, std::vector<PFile>* files, Acceptable* acc)
      : rng_(seed), files_(*files), acc_(acc) {
    for (int p = 0; p < kPatterns; p++) {
      std::vector<uint8_t> v(kB);
      for (auto& c : v) c = static_cast<uint8_t>(rng_());
      patterns_.push_back(std::move(v));
    }
    patterns_[0].assign(kB, 0);
  }

  // One step. With `vol`, performs it on `fs` and returns false (with
  // `err`) if the volume misbehaved.
  bool Step(Volume* vol, std::vector<std::unique_ptr<File>>* fs, Op* op, std::string* err) {
    vol_ = vol;
    fs_ = fs;
    err_ = err;
    uint64_t r = U(0, 99);
    if (r < 40) return *op = Op::kWrite, Write();
    if (r < 54) return *op = Op::kClone, Clone();
    if (r < 68) return *op = Op::kShare, Share();
    if (r < 74) return *op = Op::kPunch, Punch();
    if (r < 80) return *op = Op::kTrim, Trim();
    if (r < 85) return *op = Op::kTruncate, Truncate();
    *op = Op::kSync;
    return !vol_ || Ok(vol_->Sync(), "sync");
  }

 private:
  uint64_t U(uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_); }
  bool P(double p) { return std::bernoulli_distribution(p)(rng_); }
  uint64_t Idx(uint64_t n) {
    uint64_t r = U(0, 99);
    if (r < 10) return n - 1;
    if (r < 15) return 0;
    if (r < 22 && n > kPointersPerBlock + 1) return U(kPointersPerBlock - 1, kPointersPerBlock);
    return U(0, n - 1);
  }
  size_t PickFile() { return U(0, files_.size() - 1); }
  File* F(size_t i) { return (*fs_)[i].get(); }

  bool Ok(const Status& st, const std::string& what) {
    if (st.ok()) return true;
    *err_ = what + ": " + st.ToString();
    return false;
  }

  void Begin(size_t i, uint64_t lo, uint64_t hi) {
    if (!acc_) return;
    auto& alt = acc_->alt[i];
    for (uint64_t s = lo / kSec; s < (hi + kSec - 1) / kSec; s++) {
      if (!alt.count(s)) alt[s] = {SecHash(files_[i].data.data() + s * kSec)};
    }
  }
  void End(size_t i, uint64_t lo, uint64_t hi) {
    if (!acc_) return;
    auto& alt = acc_->alt[i];
    for (uint64_t s = lo / kSec; s < (hi + kSec - 1) / kSec; s++) {
      uint64_t h = SecHash(files_[i].data.data() + s * kSec);
      auto& v = alt[s];
      if (std::find(v.begin(), v.end(), h) == v.end()) v.push_back(h);
    }
  }

  // Reads [lo, hi) back (child only) and compares with the model.
  bool Verify(size_t i, uint64_t lo, uint64_t hi, const std::string& what) {
    if (!vol_) return true;
    const PFile& m = files_[i];
    std::vector<uint8_t> got(hi - lo);
    if (!Ok(F(i)->Read(lo, got.data(), got.size()), "read after " + what)) return false;
    if (std::memcmp(got.data(), m.data.data() + lo, got.size()) != 0) {
      uint64_t k = 0;
      while (got[k] == m.data[lo + k]) k++;
      *err_ = "after " + what + ": " + m.name + " byte " + std::to_string(lo + k) + " reads " +
              std::to_string(got[k]) + ", model " + std::to_string(m.data[lo + k]);
      return false;
    }
    return true;
  }

  bool Write() {
    size_t i = PickFile();
    PFile& m = files_[i];
    uint64_t shape = U(0, 99), off, len;
    if (shape < 30) {
      off = U(0, m.size - 1);
      len = U(1, std::min<uint64_t>(2 * kB, m.size - off));
    } else if (shape < 70) {
      uint64_t b = Idx(m.nblocks());
      off = b * kB;
      len = U(1, std::min<uint64_t>(16, m.nblocks() - b)) * kB;
    } else {
      len = U(1, std::min<uint64_t>(128 * 1024, m.size));
      off = U(0, m.size - len);
    }
    std::vector<uint8_t> buf(len);
    uint64_t kind = U(0, 99);
    if (kind < 15) {
      // zeros
    } else if (kind < 45) {
      for (uint64_t k = 0; k < len;) {
        uint64_t in = (off + k) % kB, n = std::min<uint64_t>(kB - in, len - k);
        std::memcpy(buf.data() + k, patterns_[U(0, kPatterns - 1)].data() + in, n);
        k += n;
      }
    } else {
      dede::test::FillRandom(rng_, buf.data(), len);
    }
    std::string what = "write " + m.name + " off=" + std::to_string(off) + " len=" +
                       std::to_string(len);
    if (vol_ && !Ok(F(i)->Write(off, buf.data(), len), what)) return false;
    Begin(i, off, off + len);
    std::memcpy(m.data.data() + off, buf.data(), len);
    for (uint64_t b = off / kB; b <= (off + len - 1) / kB; b++) m.mapped[b] = 1;
    End(i, off, off + len);
    return Verify(i, off, off + len, what);
  }

  bool Clone() {
    size_t si = PickFile(), di = P(0.3) ? si : PickFile();
    PFile &s = files_[si], &d = files_[di];
    uint64_t sb = Idx(s.nblocks()), db = Idx(d.nblocks());
    std::string what = "clone " + s.name + "[" + std::to_string(sb) + "] -> " + d.name + "[" +
                       std::to_string(db) + "]";
    if (vol_ && !Ok(vol_->CloneBlock(F(si), sb, F(di), db), what)) return false;
    std::vector<uint8_t> tmp(s.data.begin() + sb * kB, s.data.begin() + (sb + 1) * kB);
    Begin(di, db * kB, (db + 1) * kB);
    std::memcpy(d.data.data() + db * kB, tmp.data(), kB);
    d.mapped[db] = s.mapped[sb];
    End(di, db * kB, (db + 1) * kB);
    return Verify(di, db * kB, (db + 1) * kB, what);
  }

  bool Share() {
    size_t si = PickFile(), di = PickFile();
    PFile &s = files_[si], &d = files_[di];
    uint64_t sb = Idx(s.nblocks()), db = Idx(d.nblocks());
    if (P(0.6)) {
      // Make the pair match first, as the dedup agent would find it.
      std::vector<uint8_t> tmp(s.data.begin() + sb * kB, s.data.begin() + (sb + 1) * kB);
      std::string what = "dup-write " + d.name + "[" + std::to_string(db) + "]";
      if (vol_ && !Ok(F(di)->Write(db * kB, tmp.data(), kB), what)) return false;
      Begin(di, db * kB, (db + 1) * kB);
      std::memcpy(d.data.data() + db * kB, tmp.data(), kB);
      d.mapped[db] = 1;
      End(di, db * kB, (db + 1) * kB);
    }
    bool expect = s.mapped[sb] && d.mapped[db] &&
                  std::memcmp(s.data.data() + sb * kB, d.data.data() + db * kB, kB) == 0;
    std::string what = "share " + s.name + "[" + std::to_string(sb) + "] -> " + d.name + "[" +
                       std::to_string(db) + "]";
    if (vol_) {
      Status st = vol_->CompareAndShare(F(si), sb, F(di), db, VerifyMode::kByteCompare);
      if (expect && !st.ok()) return Ok(st, what + " (expected OK)");
      if (!expect && st.code() != Status::Code::kMismatch) {
        *err_ = what + ": expected kMismatch, got " + (st.ok() ? "OK" : st.ToString());
        return false;
      }
    }
    return Verify(di, db * kB, (db + 1) * kB, what);
  }

  bool Punch() {
    size_t i = PickFile();
    PFile& m = files_[i];
    uint64_t b = Idx(m.nblocks());
    std::string what = "punch " + m.name + "[" + std::to_string(b) + "]";
    if (vol_ && !Ok(F(i)->Punch(b), what)) return false;
    Begin(i, b * kB, (b + 1) * kB);
    std::memset(m.data.data() + b * kB, 0, kB);
    m.mapped[b] = 0;
    End(i, b * kB, (b + 1) * kB);
    return Verify(i, b * kB, (b + 1) * kB, what);
  }

  bool Trim() {  // whole blocks only: partial edges are the unit tests' business
    size_t i = PickFile();
    PFile& m = files_[i];
    uint64_t b = Idx(m.nblocks()), n = U(1, std::min<uint64_t>(64, m.nblocks() - b));
    std::string what = "trim " + m.name + " blocks " + std::to_string(b) + "+" + std::to_string(n);
    if (vol_ && !Ok(F(i)->Trim(b * kB, n * kB), what)) return false;
    Begin(i, b * kB, (b + n) * kB);
    std::memset(m.data.data() + b * kB, 0, n * kB);
    std::fill(m.mapped.begin() + b, m.mapped.begin() + b + n, 0);
    End(i, b * kB, (b + n) * kB);
    return Verify(i, b * kB, (b + n) * kB, what);
  }

  bool Truncate() {
    size_t i = PickFile();
    PFile& m = files_[i];
    uint64_t nb = P(0.5) ? U(1, m.nblocks()) : U(m.nblocks(), kCapBlocks);
    std::string what = "truncate " + m.name + " to " + std::to_string(nb) + " blocks";
    if (vol_ && !Ok(F(i)->Truncate(nb * kB), what)) return false;
    if (nb < m.nblocks()) {
      Begin(i, nb * kB, m.size);
      std::memset(m.data.data() + nb * kB, 0, m.size - nb * kB);
      std::fill(m.mapped.begin() + nb, m.mapped.end(), 0);
      End(i, nb * kB, m.size);
    }
    m.size = nb * kB;
    if (acc_) acc_->sizes[i].insert(m.size);
    if (vol_ && F(i)->size() != m.size) {
      *err_ = what + ": size reads " + std::to_string(F(i)->size());
      return false;
    }
    return true;
  }

  std::mt19937_64 rng_;
  std::vector<PFile>& files_;
  Acceptable* acc_;
  std::vector<std::vector<uint8_t>> patterns_;
  Volume* vol_ = nullptr;
  std::vector<std::unique_ptr<File>>* fs_ = nullptr;
  std::string* err_ = nullptr;
};

constexpr uint64_t kMaxChildSteps = 200000;

// The child: opens the volume, runs the generator, acknowledges every
// completed sync on `ack_fd`. Never returns.
// `files` is the parent's model, which the child has as a copy-on-write
// copy after fork (copying it again would cost more than the kill delay).
[[noreturn]] void ChildMain(const std::string& path, uint64_t seed, std::vector<PFile>* files,
                            int ack_fd) {
  for (int sig : {SIGABRT, SIGSEGV, SIGILL, SIGFPE, SIGBUS}) std::signal(sig, SIG_DFL);
  auto ov = OpenVolumeSpec(path, OpenOptions{});
  if (!ov.ok()) {
    std::fprintf(stderr, "crash child (seed %llu): open: %s\n", (unsigned long long)seed,
                 ov.status().ToString().c_str());
    ::_exit(2);
  }
  std::vector<std::unique_ptr<File>> fs;
  for (const auto& m : *files) {
    auto f = ov->volume->OpenFile(m.name);
    if (!f.ok()) {
      std::fprintf(stderr, "crash child: open %s: %s\n", m.name.c_str(),
                   f.status().ToString().c_str());
      ::_exit(2);
    }
    fs.push_back(std::move(f.value()));
  }
  Gen gen(seed, files, nullptr);
  for (uint64_t step = 1; step <= kMaxChildSteps; step++) {
    Op op;
    std::string err;
    if (!gen.Step(ov->volume.get(), &fs, &op, &err)) {
      std::fprintf(stderr, "crash child (seed %llu) step %llu: %s\n", (unsigned long long)seed,
                   (unsigned long long)step, err.c_str());
      ::_exit(3);
    }
    if (op == Op::kSync) {
      if (::write(ack_fd, &step, sizeof step) != sizeof step) ::_exit(4);
    }
  }
  ::_exit(0);
}

class ProcessCrashTest {
 public:
  explicit ProcessCrashTest(uint64_t seed) : seed_(seed), rng_(seed), path_(dir_.file("vol.img")) {
    test::CreateSparseFile(path_, kVolBytes);
  }

  void Run(int kills) {
    for (kill_ = 1; kill_ <= kills; kill_++) {
      if (kill_ % 10 == 1) FreshVolume();
      OneKill();
    }
  }

  int acked_kills() const { return acked_kills_; }
  uint64_t total_steps() const { return total_steps_; }

 private:
#define PFAIL(msg) \
  FAIL("base seed " << seed_ << " kill " << kill_ << " (child seed " << child_seed_ << "): " << msg)

  uint64_t U(uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_); }

  void FreshVolume() {
    {
      auto dev = OpenBlockDevice(path_);
      REQUIRE(dev.ok());
      REQUIRE(FormatVolume(dev.value().get(), FormatOptions{}, true).ok());
    }
    auto ov = OpenVolumeSpec(path_, OpenOptions{});
    REQUIRE(ov.ok());
    files_.clear();
    const uint64_t blocks[] = {640, 256, 128};
    for (int i = 0; i < 3; i++) {
      PFile m;
      m.name = "p" + std::to_string(i);
      m.size = blocks[i] * kB;
      m.data.assign(kCap, 0);
      m.mapped.assign(kCapBlocks, 0);
      REQUIRE(ov->volume->Create(m.name, m.size).ok());
      files_.push_back(std::move(m));
    }
    REQUIRE(ov->volume->Sync().ok());
  }

  void OneKill() {
    child_seed_ = seed_ * 1000003 + kill_;
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    std::fflush(nullptr);
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(fds[0]);
      ChildMain(path_, child_seed_, &files_, fds[1]);
    }
    ::close(fds[1]);
    // Let it run for a few ms to ~200 ms, collecting acknowledgements.
    // The clock starts at its first acknowledged flush: a slow machine or a
    // sanitizer build must not turn every kill into one before any flush.
    uint64_t delay_ms = U(2, 200);
    uint64_t last_ack = 0;
    bool eof = false;
    auto drain = [&](int timeout_ms) {
      pollfd p{fds[0], POLLIN, 0};
      if (::poll(&p, 1, timeout_ms) <= 0) return;
      uint64_t buf[512];
      ssize_t n = ::read(fds[0], buf, sizeof buf);
      if (n == 0) eof = true;
      for (ssize_t k = 0; k < n / 8; k++) last_ack = std::max(last_ack, buf[k]);
    };
    // One kill in ten instead lands 0-30 ms after the fork: while the child
    // opens the volume and replays the previous child's journal.
    bool early = U(0, 9) == 0;
    if (early) {
      delay_ms = U(0, 30);
    } else {
      auto first_ack_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!eof && last_ack == 0 && std::chrono::steady_clock::now() < first_ack_deadline) {
        drain(100);
      }
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(delay_ms);
    while (!eof) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                      deadline - std::chrono::steady_clock::now())
                      .count();
      if (left <= 0) break;
      drain(static_cast<int>(left));
    }
    ::kill(pid, SIGKILL);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    while (!eof) drain(1000);
    ::close(fds[0]);
    bool finished = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!finished && !(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)) {
      PFAIL("the child failed on its own before the kill ("
            << (WIFEXITED(status) ? "exit code " + std::to_string(WEXITSTATUS(status))
                                  : "signal " + std::to_string(WTERMSIG(status)))
            << "; its message is on stderr)");
    }
    if (last_ack > 0) acked_kills_++;

    // Replay: the state at the last acknowledged sync, then every value
    // the steps up to the next sync may have left behind.
    Acceptable acc;
    acc.alt.resize(files_.size());
    acc.sizes.resize(files_.size());
    auto mark_synced = [&] {
      for (size_t i = 0; i < files_.size(); i++) {
        acc.alt[i].clear();
        acc.sizes[i] = {files_[i].size};
      }
    };
    mark_synced();
    Gen gen(child_seed_, &files_, &acc);
    uint64_t step = 0;
    for (;;) {
      if (step >= kMaxChildSteps) break;
      step++;
      Op op;
      std::string err;
      (void)gen.Step(nullptr, nullptr, &op, &err);
      if (op == Op::kSync) {
        if (step <= last_ack) {
          mark_synced();
        } else {
          break;  // the child cannot have got past an unacknowledged sync
        }
      }
    }
    total_steps_ += last_ack;
    desc_ = "last acknowledged sync at step " + std::to_string(last_ack) +
            ", the child may have reached step " + std::to_string(step) + ", killed " +
            std::to_string(delay_ms) + " ms after " + (early ? "the fork" : "its first flush");
    Verify(acc);
  }

  void Verify(const Acceptable& acc) {
    OpenOptions oo;
    oo.host_id = U(0, 1) ? 0 : 2;  // recover as the dead slot's successor or as another host
    auto ov = OpenVolumeSpec(path_, oo);
    if (!ov.ok()) PFAIL(desc_ << ": reopen: " << ov.status().ToString());
    Volume* vol = ov->volume.get();
    auto rep = CheckVolume(vol, false);
    if (!rep.ok()) PFAIL(desc_ << ": CheckVolume: " << rep.status().ToString());
    if (!rep->clean()) {
      std::ostringstream os;
      for (const auto& p : rep->problems) os << "\n  " << p.where << ": " << p.what;
      PFAIL(desc_ << ": fsck found " << rep->problems.size() << " problem(s):" << os.str());
    }
    std::map<uint32_t, uint64_t> by_refs;
    for (size_t i = 0; i < files_.size(); i++) {
      PFile& m = files_[i];
      auto f = vol->OpenFile(m.name);
      if (!f.ok()) PFAIL(desc_ << ": open " << m.name << ": " << f.status().ToString());
      uint64_t size = f.value()->size();
      if (!acc.sizes[i].count(size) || size % kB != 0 || size > kCap) {
        PFAIL(desc_ << ": " << m.name << " has size " << size << ", not one it had since the sync");
      }
      std::vector<uint8_t> got(size);
      Status st = f.value()->Read(0, got.data(), size);
      if (!st.ok()) PFAIL(desc_ << ": read " << m.name << ": " << st.ToString());
      for (uint64_t s = 0; s < size / kSec; s++) {
        auto it = acc.alt[i].find(s);
        bool fine;
        if (it == acc.alt[i].end()) {
          fine = std::memcmp(got.data() + s * kSec, m.data.data() + s * kSec, kSec) == 0;
        } else {
          uint64_t h = SecHash(got.data() + s * kSec);
          fine = std::find(it->second.begin(), it->second.end(), h) != it->second.end();
        }
        if (!fine) {
          PFAIL(desc_ << ": " << m.name << " sector " << s << " (block " << s * kSec / kB
                      << ") holds a value it never had since the last acknowledged sync"
                      << (it == acc.alt[i].end() ? " (unchanged since then: synced data lost)"
                                                 : ""));
        }
      }
      // The recovered state is the model the next child starts from.
      std::memset(m.data.data(), 0, kCap);
      std::memcpy(m.data.data(), got.data(), size);
      m.size = size;
      std::fill(m.mapped.begin(), m.mapped.end(), 0);
      uint64_t mapped = 0;
      for (uint64_t b = 0; b < m.nblocks(); b++) {
        auto rc = f.value()->BlockRefCount(b);
        if (!rc.ok()) PFAIL(desc_ << ": refcount: " << rc.status().ToString());
        m.mapped[b] = rc.value() > 0;
        if (rc.value() > 0) by_refs[rc.value()]++, mapped++;
      }
      auto fi = f.value()->Info();
      if (!fi.ok() || fi->mapped_blocks != mapped) {
        PFAIL(desc_ << ": " << m.name << " mapped_blocks disagrees with its block map");
      }
    }
    uint64_t distinct = 0;
    for (auto [r, n] : by_refs) {
      if (n % r != 0) PFAIL(desc_ << ": " << n << " positions share blocks with refcount " << r);
      distinct += n / r;
    }
    auto st = vol->Stats();
    if (!st.ok()) PFAIL(desc_ << ": stats: " << st.status().ToString());
    if (st->used_blocks != distinct + st->pointer_blocks) {
      PFAIL(desc_ << ": used blocks " << st->used_blocks << " != distinct data blocks " << distinct
                  << " + pointer blocks " << st->pointer_blocks);
    }
  }
#undef PFAIL

  uint64_t seed_;
  std::mt19937_64 rng_;
  test::TempDir dir_;
  std::string path_;
  std::vector<PFile> files_;
  int kill_ = 0;
  uint64_t child_seed_ = 0;
  int acked_kills_ = 0;
  uint64_t total_steps_ = 0;
  std::string desc_;
};

}  // namespace

TEST_CASE("volume crash: SIGKILLed writer, replay, fsck clean, synced bytes intact",
          "[crash-process][crash][volume][seeded]") {
  const uint64_t seed = dede::test::SeedsFromEnv({1}).front();
  INFO("base seed " << seed << " (reproduce with DEDE_SEED=" << seed << ")");
  ProcessCrashTest t(seed);
  const int kKills = 64;
  t.Run(kKills);
  // Most kills must land after at least one acknowledged flush, or the
  // test checked little.
  CHECK(t.acked_kills() >= kKills / 2);
  CHECK(t.total_steps() > 1000);
}
