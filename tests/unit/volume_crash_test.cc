// Crash, I/O-error and full-volume tests of the volume.
//
// A FaultDevice over a MemDevice keeps every write since the last flush in
// a side buffer; Crash() keeps each pending sector with probability p (so
// unflushed writes are dropped, torn at sector granularity and reordered).
// Random writes, trims, clones, shares, punches, truncates and syncs run
// against the volume and a model; at a random point the process "dies":
// its Volume is cut off the device (nothing it does afterwards, destructors
// included, reaches the disk) and destroyed, the device crashes, and a new
// Volume opens the device (journal replay, sometimes interrupted by a
// second crash, sometimes by another host slot). Then:
//   * CheckVolume reports a clean volume;
//   * every file's size and every 512-byte sector equal a value it had at
//     or after the last completed Sync(): the synced value or any value
//     written later (writes after the last sync may or may not survive,
//     and may be torn at sector granularity);
//   * reference counts are consistent: positions with refcount r come in
//     groups of r, and used blocks == distinct data blocks + pointer blocks.
// The same checks follow an injected EIO/ENOSPC: the failing operation
// returns the error, the volume refuses every later change (poisoned), and
// a reopen finds the synced data intact. A process that closes its files
// while the device keeps failing must not abort. A full volume returns
// kNoSpace and loses or leaks nothing.
//
// Reproduce one seed with DEDE_SEED=<n>.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tests/forwarding_device.h"
#include "tests/forwarding_locks.h"
#include "tests/fsck_problems.h"
#include "tests/seeds.h"
#include "tests/temp_locks.h"
#include "volume/fsck.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;
using dede::test::CutDevice;
using dede::test::ForwardingDevice;
using dede::test::ForwardingLocks;
using dede::test::FsckLeakedBlocks;
using dede::test::FsckLeaks;
using dede::test::FsckProblems;
using dede::test::TempLockGroup;
using dede::test::TempLocks;

namespace {

constexpr uint64_t kB = kBlockSize;
constexpr uint64_t kSec = kSectorSize;
constexpr uint64_t kCapBlocks = 768;  // files up to 3 MiB; past 508 blocks: two map levels
constexpr uint64_t kCap = kCapBlocks * kB;
constexpr int kPatterns = 5;

// The process died: the device loses (or, with keep > 0, keeps or tears)
// what was not flushed, and the volume is opened again (journal replay).
std::unique_ptr<Volume> CrashAndReopen(FaultDevice* dev, std::mt19937_64& rng, double keep) {
  dev->Crash(rng, keep);
  OpenOptions oo;
  oo.locks = TempLocks();
  auto vol = Volume::Open(dev, oo);
  REQUIRE(vol.ok());
  return std::move(vol.value());
}

uint64_t SecHash(const uint8_t* p) {
  return std::hash<std::string_view>{}(std::string_view(reinterpret_cast<const char*>(p), kSec));
}

struct CFile {
  std::string name;
  uint64_t size = 0;                // always a multiple of 4 KiB here
  std::vector<uint8_t> data;        // kCap bytes, zero beyond size
  std::vector<uint8_t> mapped;      // per block
  // Sectors changed since the last completed sync: every value they had
  // since then (the synced one first). Unlisted sectors hold their synced
  // value, which is the current one.
  std::unordered_map<uint64_t, std::vector<uint64_t>> alt;
  std::set<uint64_t> sizes;         // every size since the last sync
  bool dedup = true;
  std::set<bool> dedups;            // every dedup flag since the last sync
  std::unique_ptr<File> f;
  uint64_t nblocks() const { return size / kB; }
};

#define CFAIL(msg)                                                                      \
  FAIL("seed " << seed_ << " round " << round_ << " op " << op_ << " [" << desc_ << "]: " \
               << msg << "\n  reproduce: DEDE_SEED=" << seed_)

class CrashHarness {
 public:
  explicit CrashHarness(uint64_t seed) : seed_(seed), rng_(seed), base_(64ull << 20), fdev_(&base_) {
    for (int p = 0; p < kPatterns; p++) patterns_.push_back(RandomBytes(kB));
    patterns_[0].assign(kB, 0);
  }

  void Setup() {
    desc_ = "format";
    REQUIRE(FormatVolume(&fdev_, FormatOptions{}, false).ok());
    Open(0);
    const uint64_t sizes[] = {640 * kB, 256 * kB, 128 * kB};
    for (int i = 0; i < 3; i++) {
      CFile m;
      m.name = "c" + std::to_string(i);
      m.size = sizes[i];
      m.data.assign(kCap, 0);
      m.mapped.assign(kCapBlocks, 0);
      auto id = vol_->Create(m.name, m.size);
      if (!id.ok()) CFAIL("create: " << id.status().ToString());
      files_.push_back(std::move(m));
    }
    OpenFiles();
    if (!vol_->Sync().ok()) CFAIL("initial sync failed");
    MarkSynced();
  }

  // Random operations, then a crash at a random point, reopen, verify.
  void CrashRound(int round) {
    round_ = round;
    uint64_t nops = U(1, 150);
    for (op_ = 1; op_ <= nops; op_++) {
      (void)RandomOp(false);
      Trace();
    }
    double keep = std::vector<double>{0.0, 0.5, 1.0}[U(0, 2)];
    desc_ = "crash keep=" + std::to_string(keep);
    CrashAndReopen(keep);
  }

  // Random operations, then an injected write error: the failing call
  // returns the error, the volume is poisoned, a reopen is consistent.
  void ErrorRound(int round) {
    round_ = round;
    uint64_t nops = U(0, 60);
    for (op_ = 1; op_ <= nops; op_++) {
      (void)RandomOp(false);
      Trace();
    }
    int err = P(0.5) ? EIO : ENOSPC;
    Status::Code want = err == EIO ? Status::Code::kIoError : Status::Code::kNoSpace;
    uint64_t budget = U(0, 60);
    fdev_.FailWritesAfter(budget, err);
    std::string armed = "armed " + std::string(err == EIO ? "EIO" : "ENOSPC") + " after " +
                        std::to_string(budget) + " writes";
    Status failed;
    for (op_ = 1; op_ <= 400 && failed.ok(); op_++) {
      failed = RandomOp(true);
      desc_ = armed + "; " + desc_;
      Trace();
    }
    if (failed.ok()) CFAIL("no operation failed within 400 operations of an armed write fault");
    if (failed.code() != want) {
      CFAIL("the failing operation returned '" << failed.ToString() << "' (code "
                                               << failed.CodeName() << "), expected code "
                                               << Status(want == Status::Code::kIoError
                                                             ? Status::IoError("")
                                                             : Status::NoSpace(""))
                                                      .CodeName());
    }
    // The device works again, but the volume must stay poisoned.
    fdev_.ClearFault();
    CheckPoisoned(want);
    if (P(0.5)) {
      // The host dies right away: nothing more reaches the device.
      desc_ = armed + "; crash after the error";
      CrashAndReopen(std::vector<double>{0.0, 0.5, 1.0}[U(0, 2)]);
    } else {
      // The device came back and the process shuts down normally.
      desc_ = armed + "; clean shutdown after the error";
      CloseFiles();
      vol_.reset();
      locks_.reset();
      cut_.reset();
      (void)fdev_.Flush();
      ReopenAndVerify();
    }
  }

  void Finish() {
    desc_ = "final fsck";
    Fsck();
    CloseFiles();
    vol_.reset();
    cut_.reset();
  }

 private:
  uint64_t U(uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_); }
  bool P(double p) { return std::bernoulli_distribution(p)(rng_); }
  std::vector<uint8_t> RandomBytes(size_t n) {
    std::vector<uint8_t> v(n);
    for (size_t i = 0; i < n; i += 8) {
      uint64_t w = rng_();
      std::memcpy(v.data() + i, &w, std::min<size_t>(8, n - i));
    }
    return v;
  }
  uint64_t Idx(uint64_t n) {
    uint64_t r = U(0, 99);
    if (r < 10) return n - 1;
    if (r < 15) return 0;
    if (r < 22 && n > kPointersPerBlock + 1) return U(kPointersPerBlock - 1, kPointersPerBlock);
    return U(0, n - 1);
  }
  CFile& Pick() { return files_[U(0, files_.size() - 1)]; }

  // ------------------------------------------------------------- volume

  void Open(uint32_t host) {
    locks_ = TempLocks();
    cut_ = std::make_unique<CutDevice>(&fdev_);
    OpenOptions oo;
    oo.locks = locks_;
    oo.host_id = host;
    auto v = Volume::Open(cut_.get(), oo);
    if (!v.ok()) CFAIL("open (host " << host << "): " << v.status().ToString());
    vol_ = std::move(v.value());
  }
  void OpenFiles() {
    for (auto& m : files_) {
      auto f = vol_->OpenFile(m.name);
      if (!f.ok()) CFAIL("open " << m.name << ": " << f.status().ToString());
      m.f = std::move(f.value());
    }
  }
  void CloseFiles() {
    for (auto& m : files_) m.f.reset();
  }

  // --------------------------------------------------------------- model

  void Begin(CFile& m, uint64_t lo, uint64_t hi) {
    for (uint64_t s = lo / kSec; s < (hi + kSec - 1) / kSec; s++) {
      if (!m.alt.count(s)) m.alt[s] = {SecHash(m.data.data() + s * kSec)};
    }
  }
  void End(CFile& m, uint64_t lo, uint64_t hi) {
    for (uint64_t s = lo / kSec; s < (hi + kSec - 1) / kSec; s++) {
      uint64_t h = SecHash(m.data.data() + s * kSec);
      auto& v = m.alt[s];
      if (std::find(v.begin(), v.end(), h) == v.end()) v.push_back(h);
    }
  }
  void MarkSynced() {
    for (auto& m : files_) {
      m.alt.clear();
      m.sizes = {m.size};
      m.dedups = {m.dedup};
    }
    if (scratch_removed_) scratch_may_exist_ = false;
  }

  // ----------------------------------------------------------------- ops

  // Runs one random operation. Without `armed` every call must succeed (or
  // return the expected kMismatch); with `armed` the first error is
  // returned and its intended effect is added to the acceptable values.
  Status RandomOp(bool armed) {
    uint64_t r = U(0, 99);
    if (r < 38) return OpWrite(armed);
    if (r < 46) return OpTrim(armed);
    if (r < 60) return OpClone(armed);
    if (r < 74) return OpShare(armed);
    if (r < 80) return OpPunch(armed);
    if (r < 86) return OpTruncate(armed);
    if (r < 88) return OpSetDedup(armed);
    // (Not while a write fault is armed: closing a file on a failing device
    // is the separate "does not abort" test below.)
    if (r < 91) return armed ? OpWrite(armed) : OpScratch(armed);
    desc_ = "sync";
    Status st = vol_->Sync();
    if (st.ok()) {
      MarkSynced();
    } else if (!armed) {
      CFAIL("sync: " << st.ToString());
    }
    return st;
  }

  Status Check(const Status& st, bool armed, const char* what) {
    if (!st.ok() && !armed) CFAIL(what << ": " << st.ToString());
    return st;
  }

  void CheckRange(CFile& m, uint64_t lo, uint64_t hi) {
    hi = std::min(hi, m.size);
    if (lo >= hi) return;
    std::vector<uint8_t> got(hi - lo);
    Status st = m.f->Read(lo, got.data(), got.size());
    if (!st.ok()) CFAIL("read " << m.name << ": " << st.ToString());
    if (std::memcmp(got.data(), m.data.data() + lo, got.size()) != 0) {
      uint64_t i = 0;
      while (got[i] == m.data[lo + i]) i++;
      CFAIL("before any crash, " << m.name << " byte " << lo + i << " reads " << int(got[i])
                                 << ", model " << int(m.data[lo + i]));
    }
  }

  Status OpWrite(bool armed) {
    CFile& m = Pick();
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
    std::vector<uint8_t> buf;
    uint64_t kind = U(0, 99);
    if (kind < 15) {
      buf.assign(len, 0);
    } else if (kind < 45) {
      buf.resize(len);
      for (uint64_t i = 0; i < len;) {
        uint64_t in = (off + i) % kB, n = std::min<uint64_t>(kB - in, len - i);
        std::memcpy(buf.data() + i, patterns_[U(0, kPatterns - 1)].data() + in, n);
        i += n;
      }
    } else {
      buf = RandomBytes(len);
    }
    desc_ = "write " + m.name + " off=" + std::to_string(off) + " len=" + std::to_string(len);
    Status st = m.f->Write(off, buf.data(), len);
    Begin(m, off, off + len);
    std::memcpy(m.data.data() + off, buf.data(), len);
    for (uint64_t b = off / kB; b <= (off + len - 1) / kB; b++) m.mapped[b] = 1;
    End(m, off, off + len);
    if (st.ok()) CheckRange(m, off, off + len);
    return Check(st, armed, "write");
  }

  Status OpTrim(bool armed) {
    CFile& m = Pick();
    uint64_t off = U(0, m.size), len = U(0, std::min<uint64_t>(64 * kB, m.size - off));
    if (P(0.5)) {
      off = off / kB * kB;
      len = len / kB * kB;
    }
    desc_ = "trim " + m.name + " off=" + std::to_string(off) + " len=" + std::to_string(len);
    Status st = m.f->Trim(off, len);
    if (len == 0) return Check(st, armed, "trim");
    Begin(m, off, off + len);
    std::memset(m.data.data() + off, 0, len);
    End(m, off, off + len);
    for (uint64_t b = (off + kB - 1) / kB; b < (off + len) / kB; b++) m.mapped[b] = 0;
    // Zeroed partial edges: a hole may or may not get a block; ask.
    for (uint64_t b : {off / kB, (off + len - 1) / kB}) {
      if (st.ok() && !m.mapped[b]) {
        auto rc = m.f->BlockRefCount(b);
        if (!rc.ok()) CFAIL("refcount: " << rc.status().ToString());
        m.mapped[b] = rc.value() > 0;
      }
    }
    if (st.ok()) CheckRange(m, off, off + len);
    return Check(st, armed, "trim");
  }

  Status OpClone(bool armed) {
    CFile& s = Pick();
    CFile& d = P(0.3) ? s : Pick();
    uint64_t si = Idx(s.nblocks()), di = Idx(d.nblocks());
    desc_ = "clone " + s.name + "[" + std::to_string(si) + "] -> " + d.name + "[" +
            std::to_string(di) + "]";
    Status st = vol_->CloneBlock(s.f.get(), si, d.f.get(), di);
    if (!s.dedup || !d.dedup) {
      // A file set dedup=off is never a party to a clone or a share.
      if (!armed && st.code() != Status::Code::kMismatch) {
        CFAIL("clone_block with a dedup=off file should be kMismatch, got "
              << (st.ok() ? std::string("OK") : st.ToString()));
      }
      return st.code() == Status::Code::kMismatch ? Status::Ok() : st;
    }
    std::vector<uint8_t> tmp(s.data.begin() + si * kB, s.data.begin() + (si + 1) * kB);
    Begin(d, di * kB, (di + 1) * kB);
    std::memcpy(d.data.data() + di * kB, tmp.data(), kB);
    d.mapped[di] = s.mapped[si];
    End(d, di * kB, (di + 1) * kB);
    if (st.ok()) CheckRange(d, di * kB, (di + 1) * kB);
    return Check(st, armed, "clone_block");
  }

  Status OpShare(bool armed) {
    CFile& s = Pick();
    CFile& d = Pick();
    uint64_t si = Idx(s.nblocks()), di = Idx(d.nblocks());
    if (P(0.6)) {
      // Make a matching pair first: copy s[si]'s content over d[di].
      std::vector<uint8_t> tmp(s.data.begin() + si * kB, s.data.begin() + (si + 1) * kB);
      desc_ = "dup-write for share " + d.name + "[" + std::to_string(di) + "]";
      Status st = d.f->Write(di * kB, tmp.data(), kB);
      Begin(d, di * kB, (di + 1) * kB);
      std::memcpy(d.data.data() + di * kB, tmp.data(), kB);
      d.mapped[di] = 1;
      End(d, di * kB, (di + 1) * kB);
      if (!Check(st, armed, "write").ok()) return st;
    }
    bool expect = s.dedup && d.dedup && s.mapped[si] && d.mapped[di] &&
                  std::memcmp(s.data.data() + si * kB, d.data.data() + di * kB, kB) == 0;
    desc_ = "share " + s.name + "[" + std::to_string(si) + "] -> " + d.name + "[" +
            std::to_string(di) + "] expect " + (expect ? "OK" : "kMismatch");
    Status st = vol_->CompareAndShare(s.f.get(), si, d.f.get(), di, VerifyMode::kByteCompare);
    if (armed && !st.ok() && st.code() != Status::Code::kMismatch) return st;
    if (expect && !st.ok()) CFAIL("compare_and_share should succeed: " << st.ToString());
    if (!expect && st.code() != Status::Code::kMismatch) {
      CFAIL("compare_and_share should be kMismatch, got " << (st.ok() ? "OK" : st.ToString()));
    }
    CheckRange(d, di * kB, (di + 1) * kB);
    return Status::Ok();
  }

  Status OpPunch(bool armed) {
    CFile& m = Pick();
    uint64_t i = Idx(m.nblocks());
    desc_ = "punch " + m.name + "[" + std::to_string(i) + "]";
    Status st = m.f->Punch(i);
    Begin(m, i * kB, (i + 1) * kB);
    std::memset(m.data.data() + i * kB, 0, kB);
    m.mapped[i] = 0;
    End(m, i * kB, (i + 1) * kB);
    return Check(st, armed, "punch");
  }

  Status OpTruncate(bool armed) {
    CFile& m = Pick();
    uint64_t nb = P(0.5) ? U(1, m.nblocks()) : U(m.nblocks(), kCapBlocks);
    if (nb == 0) nb = 1;
    desc_ = "truncate " + m.name + " " + std::to_string(m.size) + " -> " + std::to_string(nb * kB);
    Status st = m.f->Truncate(nb * kB);
    if (nb < m.nblocks()) {
      Begin(m, nb * kB, m.size);
      std::memset(m.data.data() + nb * kB, 0, m.size - nb * kB);
      std::fill(m.mapped.begin() + nb, m.mapped.end(), 0);
      End(m, nb * kB, m.size);
    }
    m.size = nb * kB;
    m.sizes.insert(m.size);
    if (st.ok() && m.f->size() != m.size) CFAIL("size after truncate is " << m.f->size());
    return Check(st, armed, "truncate");
  }

  Status OpSetDedup(bool armed) {
    CFile& m = Pick();
    bool on = P(0.5);
    desc_ = "set " + m.name + " dedup=" + (on ? "on" : "off");
    Status st = m.f->SetDedup(on);
    m.dedup = on;
    m.dedups.insert(on);
    if (st.ok() && m.f->Info().value().dedup != on) CFAIL("the dedup flag did not change");
    return Check(st, armed, "set dedup");
  }

  // A short-lived file: create, write, clone blocks in and out, remove.
  // After a crash it may exist only if its removal was not yet synced.
  Status OpScratch(bool armed) {
    desc_ = "scratch file create/write/clone/remove";
    scratch_may_exist_ = true;
    scratch_removed_ = false;
    auto id = vol_->Create("s", 64 * kB);
    if (!id.ok()) return Check(id.status(), armed, "create scratch");
    {
      auto sf = vol_->OpenFile("s");
      if (!sf.ok()) return Check(sf.status(), armed, "open scratch");
      File* f = sf.value().get();
      std::vector<uint8_t> buf = RandomBytes(4 * kB);
      Status st = f->Write(0, buf.data(), buf.size());
      if (!st.ok()) return Check(st, armed, "write scratch");
      CFile& a = files_[U(0, files_.size() - 1)];
      st = vol_->CloneBlock(a.f.get(), Idx(a.nblocks()), f, 5);
      // A dedup=off file is never cloned from or into (kMismatch).
      if (!a.dedup && st.code() == Status::Code::kMismatch) st = Status::Ok();
      if (!st.ok()) return Check(st, armed, "clone into scratch");
      CFile& b = files_[U(0, files_.size() - 1)];
      uint64_t bi = Idx(b.nblocks());
      st = vol_->CloneBlock(f, 1, b.f.get(), bi);
      if (b.dedup) {
        Begin(b, bi * kB, (bi + 1) * kB);
        std::memcpy(b.data.data() + bi * kB, buf.data() + kB, kB);
        b.mapped[bi] = 1;
        End(b, bi * kB, (bi + 1) * kB);
      } else if (st.code() == Status::Code::kMismatch) {
        st = Status::Ok();  // b is left as it was
      }
      if (!st.ok()) return Check(st, armed, "clone out of scratch");
      CheckRange(b, bi * kB, (bi + 1) * kB);
    }
    Status st = vol_->Remove("s");
    if (st.ok()) scratch_removed_ = true;
    return Check(st, armed, "remove scratch");
  }

  // ------------------------------------------------------ poison, crash

  void CheckPoisoned(Status::Code want) {
    CFile& m = files_[0];
    std::vector<uint8_t> blk(kB, 0x77);
    auto must_fail = [&](const Status& st, const char* what) {
      if (st.ok()) CFAIL("after a write error the volume accepted " << what);
      if (st.code() != want) {
        CFAIL("after a write error, " << what << " returned '" << st.ToString()
                                      << "' instead of the original error");
      }
    };
    desc_ += "; poisoned checks";
    must_fail(m.f->Write(0, blk.data(), kB), "a whole-block write");
    must_fail(m.f->Write(100, blk.data(), 10), "a partial write");
    must_fail(m.f->Punch(0), "a punch");
    must_fail(m.f->Trim(0, 2 * kB), "a trim");
    must_fail(m.f->Truncate(m.size + kB), "a truncate");
    must_fail(vol_->CloneBlock(files_[1].f.get(), 0, m.f.get(), 1), "a clone");
    must_fail(m.f->SetDedup(false), "a flag change");
    must_fail(vol_->Sync(), "a sync");
    // A share of equal blocks (a block with itself elsewhere) must not
    // happen either; kMismatch is fine for unequal ones.
    Status cs = vol_->CompareAndShare(m.f.get(), 0, files_[1].f.get(), 0, VerifyMode::kByteCompare);
    if (cs.ok()) CFAIL("after a write error the volume accepted a compare_and_share");
  }

  // The process dies: its volume can write nothing more (its destructors
  // run against a cut device), then the device loses or tears every write
  // since its last flush.
  void Die() {
    cut_->Cut();
    CloseFiles();
    vol_.reset();
    locks_.reset();
    cut_.reset();
  }

  void CrashAndReopen(double keep) {
    Die();
    std::mt19937_64 crng(rng_());
    fdev_.Crash(crng, keep);
    if (P(0.2)) {
      // Crash again in the middle of recovery: replay must be idempotent.
      uint64_t budget = U(0, 40);
      desc_ += "; crash during replay after " + std::to_string(budget) + " writes";
      fdev_.FailWritesAfter(budget, EIO);
      {
        locks_ = TempLocks();
        CutDevice cut(&fdev_);
        OpenOptions oo;
        oo.locks = locks_;
        auto v = Volume::Open(&cut, oo);
        cut.Cut();
        if (v.ok()) v.value().reset();
        locks_.reset();
      }
      std::mt19937_64 crng2(rng_());
      fdev_.Crash(crng2, std::vector<double>{0.0, 0.5, 1.0}[U(0, 2)]);
    }
    fdev_.ClearFault();
    ReopenAndVerify();
  }

  void Trace() {
    if (trace_) std::fprintf(stderr, "round %d op %llu: %s\n", round_, (unsigned long long)op_, desc_.c_str());
  }

  void ReopenAndVerify() {
    Trace();
    // Recover either as the same host slot or as another host.
    uint32_t host = P(0.5) ? 0 : static_cast<uint32_t>(U(2, 3));
    desc_ += "; reopen as host " + std::to_string(host);
    Open(host);
    Fsck();  // leaves the files open
    for (auto& m : files_) VerifyAfterCrash(m);
    std::unique_ptr<File> scratch;
    auto lk = vol_->Lookup("s");
    if (lk.ok()) {
      if (!scratch_may_exist_) CFAIL("the scratch file is back although its removal was synced");
      auto sf = vol_->OpenFile("s");
      if (!sf.ok()) CFAIL("open the scratch file: " << sf.status().ToString());
      scratch = std::move(sf.value());
    } else if (lk.status().code() != Status::Code::kNotFound) {
      CFAIL("lookup: " << lk.status().ToString());
    }
    VerifyRefcounts(scratch.get());
    if (scratch) {
      scratch.reset();
      Status st = vol_->Remove("s");
      if (!st.ok()) CFAIL("remove the scratch file after the crash: " << st.ToString());
    }
    if (!vol_->Sync().ok()) CFAIL("sync after recovery failed");
    scratch_may_exist_ = false;
    scratch_removed_ = false;
    MarkSynced();
  }

  void VerifyAfterCrash(CFile& m) {
    auto fi = m.f->Info();
    if (!fi.ok()) CFAIL("info " << m.name << ": " << fi.status().ToString());
    uint64_t size = fi->size;
    if (!m.sizes.count(size)) {
      std::ostringstream os;
      for (uint64_t s : m.sizes) os << " " << s;
      CFAIL(m.name << " has size " << size << " after the crash; acceptable:" << os.str());
    }
    if (size > kCap) CFAIL("size beyond the model's capacity");
    if (!m.dedups.count(fi->dedup)) CFAIL(m.name << ": dedup flag " << fi->dedup << " was never set since the sync");
    m.dedup = fi->dedup;
    std::vector<uint8_t> got(size);
    Status st = m.f->Read(0, got.data(), size);
    if (!st.ok()) CFAIL("read " << m.name << " after the crash: " << st.ToString());
    for (uint64_t s = 0; s < size / kSec; s++) {
      uint64_t h = SecHash(got.data() + s * kSec);
      auto it = m.alt.find(s);
      bool fine = it == m.alt.end() ? std::memcmp(got.data() + s * kSec, m.data.data() + s * kSec, kSec) == 0
                                    : std::find(it->second.begin(), it->second.end(), h) != it->second.end();
      if (!fine) {
        bool synced_changed = it != m.alt.end();
        CFAIL(m.name << " sector " << s << " (block " << s * kSec / kB << ", byte " << s * kSec
                     << ") after the crash holds a value it never had since the last sync"
                     << (synced_changed ? " (sector was written after the sync)"
                                        : " (sector unchanged since the sync: synced data lost)")
                     << "; first bytes got " << int(got[s * kSec]) << " model "
                     << int(m.data[s * kSec]));
      }
    }
    // The state after recovery is durable: it is the new model.
    std::memset(m.data.data(), 0, kCap);
    std::memcpy(m.data.data(), got.data(), size);
    m.size = size;
    std::fill(m.mapped.begin(), m.mapped.end(), 0);
    for (uint64_t b = 0; b < m.nblocks(); b++) {
      auto rc = m.f->BlockRefCount(b);
      if (!rc.ok()) CFAIL("refcount " << m.name << "[" << b << "]: " << rc.status().ToString());
      m.mapped[b] = rc.value() > 0;
    }
  }

  // Positions with refcount r must come in groups of r, and the used
  // blocks must be exactly the distinct data blocks plus pointer blocks.
  void VerifyRefcounts(File* scratch) {
    std::map<uint32_t, uint64_t> by_refs;
    uint64_t logical = 0;
    if (scratch != nullptr) {
      uint64_t n = scratch->size() / kB, mapped = 0;
      for (uint64_t b = 0; b < n; b++) {
        uint32_t rc = scratch->BlockRefCount(b).value();
        if (rc > 0) by_refs[rc]++, mapped++;
      }
      if (scratch->Info().value().mapped_blocks != mapped) CFAIL("scratch file: mapped_blocks is off");
      logical += mapped;
    }
    for (auto& m : files_) {
      uint64_t mapped = 0;
      for (uint64_t b = 0; b < m.nblocks(); b++) {
        uint32_t rc = m.f->BlockRefCount(b).value();
        if (rc > 0) {
          by_refs[rc]++;
          mapped++;
        }
      }
      auto fi = m.f->Info();
      if (fi->mapped_blocks != mapped) {
        CFAIL(m.name << ": mapped_blocks " << fi->mapped_blocks << " but " << mapped
                     << " positions have a block");
      }
      logical += mapped;
    }
    uint64_t distinct = 0;
    for (auto [r, n] : by_refs) {
      if (n % r != 0) CFAIL(n << " positions have refcount " << r << ": not a multiple of " << r);
      distinct += n / r;
    }
    auto st = vol_->Stats();
    if (!st.ok()) CFAIL("stats: " << st.status().ToString());
    if (st->used_blocks != distinct + st->pointer_blocks) {
      CFAIL("used blocks " << st->used_blocks << " != distinct data blocks " << distinct
                           << " + pointer blocks " << st->pointer_blocks);
    }
    if (st->logical_blocks != logical) CFAIL("logical blocks " << st->logical_blocks << " != " << logical);
  }

  void Fsck() {
    CloseFiles();
    auto rep = CheckVolume(vol_.get(), false);
    if (!rep.ok()) {
      if (rep.status().code() == Status::Code::kUnsupported) {
        CFAIL("CheckVolume is not implemented yet (kUnsupported); the crash tests need it");
      }
      CFAIL("CheckVolume: " << rep.status().ToString());
    }
    if (!rep->clean()) {
      std::ostringstream os;
      for (const auto& p : rep->problems) os << "\n  " << p.where << ": " << p.what;
      CFAIL("fsck found " << rep->problems.size() << " problem(s):" << os.str());
    }
    OpenFiles();
  }

  uint64_t seed_;
  std::mt19937_64 rng_;
  MemDevice base_;
  FaultDevice fdev_;
  std::shared_ptr<LockManager> locks_;
  std::unique_ptr<CutDevice> cut_;  // declared before vol_: outlives it
  std::unique_ptr<Volume> vol_;
  std::vector<CFile> files_;
  std::vector<std::vector<uint8_t>> patterns_;
  const bool trace_ = std::getenv("DEDE_TRACE") != nullptr;
  bool scratch_may_exist_ = false;
  bool scratch_removed_ = false;
  int round_ = 0;
  uint64_t op_ = 0;
  std::string desc_;
};

}  // namespace

TEST_CASE("volume crash: random crash points keep synced data and a clean fsck",
          "[crash][volume][seeded]") {
  uint64_t seed = GENERATE(from_range(dede::test::SeedsFromEnv({101, 102, 103, 104})));
  INFO("seed " << seed << " (reproduce with DEDE_SEED=" << seed << ")");
  CrashHarness h(seed);
  h.Setup();
  for (int round = 1; round <= 55; round++) h.CrashRound(round);
  h.Finish();
}

TEST_CASE("volume crash: injected EIO/ENOSPC fails the call, poisons, reopens consistent",
          "[crash][volume][seeded]") {
  uint64_t seed = GENERATE(from_range(dede::test::SeedsFromEnv({201, 202, 203})));
  INFO("seed " << seed << " (reproduce with DEDE_SEED=" << seed << ")");
  CrashHarness h(seed);
  h.Setup();
  for (int round = 1; round <= 25; round++) h.ErrorRound(round);
  h.Finish();
}

namespace {

// Runs `body` in a forked child; returns its wait status. Used where the
// bug under test kills the process (std::terminate), so one failure does
// not take the rest of the test binary with it.
int RunInChild(const std::function<int()>& body) {
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    // Catch's fatal-signal handlers would report into the parent's run.
    for (int sig : {SIGABRT, SIGSEGV, SIGILL, SIGFPE, SIGBUS}) std::signal(sig, SIG_DFL);
    int rc = 99;
    try {
      rc = body();
    } catch (...) {
      rc = 98;
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  REQUIRE(pid > 0);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return status;
}

std::string DescribeWait(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  }
  return "status " + std::to_string(status);
}

struct SmallVolume {
  explicit SmallVolume(uint64_t bytes, uint32_t max_hosts = 1) : dev(bytes) {
    FormatOptions fo;
    fo.max_hosts = max_hosts;
    REQUIRE(FormatVolume(&dev, fo, false).ok());
    locks = TempLocks();
    OpenOptions oo;
    oo.locks = locks;
    auto v = Volume::Open(&dev, oo);
    REQUIRE(v.ok());
    vol = std::move(v.value());
  }
  uint64_t Free() {
    auto st = vol->Stats();
    REQUIRE(st.ok());
    return st->free_blocks;
  }
  // Files "a" and "b" of 4000 blocks, created and opened.
  std::pair<std::unique_ptr<File>, std::unique_ptr<File>> CreateAB() {
    REQUIRE(vol->Create("a", 4000 * kB).ok());
    REQUIRE(vol->Create("b", 4000 * kB).ok());
    return {std::move(vol->OpenFile("a").value()), std::move(vol->OpenFile("b").value())};
  }
  // Closes the files (fsck wants the volume to itself); fsck finds nothing.
  void CloseAndCheck(std::unique_ptr<File>* a, std::unique_ptr<File>* b) {
    a->reset();
    b->reset();
    std::string problems = FsckProblems(vol.get());
    INFO("fsck:" << problems);
    CHECK(problems.empty());
  }
  // Writes 0x11 blocks into `f` from its start until at most `free_left`
  // blocks are free (fewer when the last write needed a pointer block
  // too), then syncs; returns the next block index.
  uint64_t Fill(File* f, uint64_t free_left) {
    const std::vector<uint8_t> chunk(64 * kB, 0x11);
    uint64_t next = 0;
    while (Free() > free_left + 64 + 4) {
      REQUIRE(f->Write(next * kB, chunk.data(), chunk.size()).ok());
      next += 64;
    }
    while (Free() > free_left) {
      Status w = f->Write(next * kB, chunk.data(), kB);
      if (w.code() == Status::Code::kNoSpace) break;
      REQUIRE(w.ok());
      next++;
    }
    REQUIRE(vol->Sync().ok());
    return next;
  }
  MemDevice dev;
  std::shared_ptr<LockManager> locks;
  std::unique_ptr<Volume> vol;
};

}  // namespace

// Minimal repro: after a device write error, closing the second file (or
// destroying the volume) throws std::out_of_range from a noexcept
// destructor and the process aborts.
TEST_CASE("volume crash: closing files after a device write error does not abort",
          "[crash][volume]") {
  int status = RunInChild([] {
    MemDevice base(64 << 20);
    FaultDevice dev(&base);
    if (!FormatVolume(&dev, FormatOptions{}, false).ok()) return 10;
    auto locks = TempLocks();
    OpenOptions oo;
    oo.locks = locks;
    auto vol = Volume::Open(&dev, oo);
    if (!vol.ok()) return 11;
    if (!vol.value()->Create("a", 1 << 20).ok() || !vol.value()->Create("b", 1 << 20).ok()) {
      return 12;
    }
    auto a = vol.value()->OpenFile("a");
    auto b = vol.value()->OpenFile("b");
    if (!a.ok() || !b.ok()) return 13;
    std::vector<uint8_t> blk(kB, 1);
    if (!a.value()->Write(0, blk.data(), kB).ok()) return 14;
    if (!vol.value()->Sync().ok()) return 15;
    dev.FailWritesAfter(0, EIO);  // the disk goes away
    // A write must fail now and poison the volume ...
    if (a.value()->Write(0, blk.data(), kB).ok()) return 16;
    // ... and shutting down must still be orderly.
    a.value().reset();
    b.value().reset();
    vol.value().reset();
    return 0;
  });
  INFO("child: " << DescribeWait(status));
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
}

// Minimal repro: a write whose data blocks fit but whose new block-map
// blocks do not returns kNoSpace and must leave nothing allocated.
TEST_CASE("volume full: kNoSpace while growing the block map leaks nothing",
          "[crash][volume][nospace]") {
  SmallVolume sv(24ull << 20);
  Volume* vol = sv.vol.get();
  auto [a, b] = sv.CreateAB();
  // Fill "a" until exactly 11 blocks are free.
  std::vector<uint8_t> chunk(64 * kB, 0x11);
  uint64_t next = 0;
  while (sv.Free() > 11 + 64 + 4) {
    REQUIRE(a->Write(next * kB, chunk.data(), chunk.size()).ok());
    next += 64;
  }
  while (sv.Free() > 11) {
    REQUIRE(a->Write(next * kB, chunk.data(), kB).ok());
    next++;
  }
  REQUIRE(vol->Sync().ok());
  auto before = vol->Stats().value();
  REQUIRE(before.free_blocks == 11);
  // b is empty: blocks 505..514 need 10 data blocks, a root and a leaf
  // block for 505..507, and a second root level plus a leaf for 508..514.
  std::vector<uint8_t> ten(10 * kB, 0x22);
  Status st = b->Write(505 * kB, ten.data(), ten.size());
  CHECK(st.code() == Status::Code::kNoSpace);
  // The blocks given back may be deferred drops (the allocator let go of
  // the full group while looking for space): a flush point applies them.
  REQUIRE(vol->Sync().ok());
  auto after = vol->Stats().value();
  CHECK(after.pending_drops == 0);
  INFO("free before " << before.free_blocks << ", after " << after.free_blocks
                      << "; used " << after.used_blocks << ", pointer blocks "
                      << after.pointer_blocks << ", logical " << after.logical_blocks);
  auto bi = b->Info().value();
  uint64_t b_mapped = 0;
  for (uint64_t i = 500; i < 520; i++) b_mapped += b->BlockRefCount(i).value() > 0;
  // Either the write did not happen at all, or it happened in part; in
  // both cases every used block must be reachable.
  CHECK(bi.mapped_blocks == b_mapped);
  CHECK(after.used_blocks == before.used_blocks + b_mapped + (after.pointer_blocks -
                                                               before.pointer_blocks));
  a.reset();
  b.reset();
  std::string problems = FsckProblems(vol);
  INFO("fsck:" << problems);
  CHECK(problems.empty());
  // Not poisoned: space comes back and writes work again.
  a = std::move(vol->OpenFile("a").value());
  b = std::move(vol->OpenFile("b").value());
  for (uint64_t i = 0; i < 32; i++) REQUIRE(a->Punch(i).ok());
  REQUIRE(b->Write(505 * kB, ten.data(), ten.size()).ok());
  std::vector<uint8_t> back(ten.size());
  REQUIRE(b->Read(505 * kB, back.data(), back.size()).ok());
  bool read_back = back == ten;
  REQUIRE(read_back);
  REQUIRE(vol->Sync().ok());
}

// The first write to an empty file far from its start needs two pointer
// blocks (a root and a leaf below a second level). With room for its data
// block and one of them, the write failed kNoSpace and the grown root was
// never stored: its pointer block leaked.
TEST_CASE("volume full: a write whose block map grows part-way before kNoSpace leaks nothing",
          "[crash][volume][nospace]") {
  SmallVolume sv(24ull << 20);
  Volume* vol = sv.vol.get();
  auto [a, b] = sv.CreateAB();
  std::vector<uint8_t> chunk(kB, 0x11);
  const uint64_t next = sv.Fill(a.get(), 2);
  for (uint64_t back = next; sv.Free() < 2 && back > 0;) {
    REQUIRE(a->Punch(--back).ok());
    REQUIRE(vol->Sync().ok());
  }
  REQUIRE(sv.Free() == 2);
  Status st = b->Write(600 * kB, chunk.data(), kB);
  INFO("write: " << st.ToString());
  CHECK(st.code() == Status::Code::kNoSpace);
  REQUIRE(vol->Sync().ok());
  sv.CloseAndCheck(&a, &b);
}

// A clone (a merge post, an arena clone) into a part of its destination
// that has no block-map path yet needs a pointer block: on a full volume
// that allocation failed after the source's count had gone up, and the
// half-done operation poisoned the volume (every later write of the host
// failed until it restarted). The path is now built first.
TEST_CASE("volume full: a clone or clone-if-hash that needs a pointer block fails alone",
          "[crash][volume][nospace]") {
  SmallVolume sv(24ull << 20);
  Volume* vol = sv.vol.get();
  auto [a, b] = sv.CreateAB();
  std::vector<uint8_t> chunk(kB, 0x11);
  sv.Fill(a.get(), 0);
  REQUIRE(sv.Free() < 2);
  const uint64_t refs_before = a->BlockRefCount(0).value();
  // b is empty: block 600 needs a root and a leaf.
  Status st = vol->CloneBlock(a.get(), 0, b.get(), 600);
  INFO("clone: " << st.ToString());
  CHECK(st.code() == Status::Code::kNoSpace);
  std::vector<Volume::BlockOp> ops(1);
  ops[0].kind = Volume::BlockOp::Kind::kCloneIfHash;
  ops[0].src = a.get();
  ops[0].src_index = 1;
  ops[0].dst = b.get();
  ops[0].dst_index = 700;
  ops[0].witness = ComputeFingerprint(vol->superblock().hash_algo, chunk.data(), kB);
  REQUIRE(vol->ApplyBlockOps(&ops, VerifyMode::kByteCompare).ok());
  INFO("clone_if_hash: " << ops[0].result.ToString());
  CHECK(ops[0].result.code() == Status::Code::kNoSpace);
  CHECK_FALSE(ops[0].changed);
  // The clone again, then in the same batch a share whose destination is
  // the clone's source (a:2 holds what a:1 holds). The clone's plan had
  // marked its source position copy-on-write, and when the clone failed
  // only its destination was held back: the share found a pointer
  // without the bit it was decided on, reported "destination pointer
  // changed under lock" and poisoned the volume. It is held back too.
  ops.resize(2);
  ops[0].result = Status::Ok();
  ops[1].kind = Volume::BlockOp::Kind::kShare;
  ops[1].src = a.get();
  ops[1].src_index = 2;
  ops[1].dst = a.get();
  ops[1].dst_index = 1;
  st = vol->ApplyBlockOps(&ops, VerifyMode::kByteCompare);
  INFO("batch: " << st.ToString() << "; clone: " << ops[0].result.ToString()
                 << "; share: " << ops[1].result.ToString());
  REQUIRE(st.ok());
  CHECK(ops[0].result.code() == Status::Code::kNoSpace);
  CHECK(ops[1].result.code() == Status::Code::kLocked);
  CHECK_FALSE(ops[1].changed);
  // Not poisoned: a flush point and writes in place work.
  REQUIRE(vol->Sync().ok());
  CHECK(a->BlockRefCount(0).value() == refs_before);
  CHECK(a->BlockRefCount(1).value() == refs_before);
  REQUIRE(a->Write(0, chunk.data(), kB).ok());
  REQUIRE(vol->Sync().ok());
  sv.CloseAndCheck(&a, &b);
}

// A write of part of a block reads the block's old content first. That
// read failing changes nothing (no block of the round has been written
// yet), but it used to poison the volume: every later write and flush of
// every disk of the host failed until dedupd restarted.
TEST_CASE("volume: a failed read of the old block fails a partial write alone", "[crash][volume]") {
  MemDevice mem(32ull << 20);
  REQUIRE(FormatVolume(&mem, FormatOptions{}, false).ok());
  FaultDevice fdev(&mem);
  OpenOptions oo;
  oo.locks = TempLocks();
  auto opened = Volume::Open(&fdev, oo);
  REQUIRE(opened.ok());
  Volume* vol = opened->get();
  REQUIRE(vol->Create("a", 64 * kB).ok());
  auto a = vol->OpenFile("a");
  REQUIRE(a.ok());
  const std::vector<uint8_t> block(kB, 0x11), ten(10, 0x22);
  REQUIRE((*a)->Write(0, block.data(), kB).ok());
  REQUIRE(vol->Sync().ok());
  std::vector<uint8_t> back(kB);
  REQUIRE((*a)->Read(0, back.data(), kB).ok());  // the map is cached: only the data read fails
  fdev.FailReadsAfter(0, EIO);
  Status st = (*a)->Write(100, ten.data(), ten.size());
  fdev.ClearFault();
  INFO("write: " << st.ToString());
  CHECK(st.code() == Status::Code::kIoError);
  REQUIRE(vol->Sync().ok());  // not poisoned
  REQUIRE((*a)->Read(0, back.data(), kB).ok());
  CHECK(back == block);
  REQUIRE((*a)->Write(100, ten.data(), ten.size()).ok());
  REQUIRE(vol->Sync().ok());
  REQUIRE((*a)->Read(0, back.data(), kB).ok());
  CHECK(std::equal(ten.begin(), ten.end(), back.begin() + 100));
  a->reset();
  std::string problems = FsckProblems(vol);
  INFO("fsck:" << problems);
  CHECK(problems.empty());
}

// A shrink to a size inside a block zeroed that block's tail on the device
// first, then changed the map and the size in the running transaction: a
// failure (or a crash) before the commit left the file at its old size
// with bytes of it zeroed. The tail is now zeroed when a file grows over
// it (as it always was), not when it shrinks.
TEST_CASE("volume: a shrink that does not commit leaves every byte of the file as it was",
          "[crash][volume]") {
  MemDevice mem(32ull << 20);
  REQUIRE(FormatVolume(&mem, FormatOptions{}, false).ok());
  const std::vector<uint8_t> data = [] {
    std::vector<uint8_t> d(16 * kB);
    for (size_t i = 0; i < d.size(); i++) d[i] = static_cast<uint8_t>(1 + i % 251);
    return d;
  }();
  {
    OpenOptions oo;
    oo.locks = TempLocks();
    auto vol = Volume::Open(&mem, oo);
    REQUIRE(vol.ok());
    REQUIRE((*vol)->Create("a", 64 * kB).ok());
    auto a = (*vol)->OpenFile("a");
    REQUIRE(a.ok());
    REQUIRE((*a)->Write(0, data.data(), data.size()).ok());
  }
  const std::vector<uint8_t> snapshot = mem.bytes();
  std::mt19937_64 rng(7);
  int kept_old_size = 0;
  for (uint64_t n = 0; n < 12; n++) {
    INFO("writes fail after " << n);
    mem.bytes() = snapshot;
    {
      FaultDevice fdev(&mem);
      OpenOptions oo;
      oo.locks = TempLocks();
      auto vol = Volume::Open(&fdev, oo);
      REQUIRE(vol.ok());
      auto a = (*vol)->OpenFile("a");
      REQUIRE(a.ok());
      fdev.FailWritesAfter(n, EIO);
      (void)(*a)->Truncate(100);
      (void)(*vol)->Sync();
      a->reset();
      vol->reset();
      fdev.Crash(rng, 1.0);  // every write that was made stays
    }
    OpenOptions oo;
    oo.locks = TempLocks();
    auto vol = Volume::Open(&mem, oo);
    REQUIRE(vol.ok());
    auto a = (*vol)->OpenFile("a");
    REQUIRE(a.ok());
    const uint64_t size = (*a)->size();
    INFO("size after reopen " << size);
    REQUIRE((size == 100 || size == 64 * kB));
    if (size == 64 * kB) kept_old_size++;
    const uint64_t want = std::min<uint64_t>(size, data.size());
    std::vector<uint8_t> back(want);
    REQUIRE((*a)->Read(0, back.data(), want).ok());
    CHECK(std::equal(back.begin(), back.end(), data.begin()));
  }
  CHECK(kept_old_size > 0);  // some runs failed before the commit
}

// Random writes, clones and trims into a small volume until it is full,
// several times over: each kNoSpace leaves every block accounted for and
// every byte either as it was or as written; the volume stays usable.
TEST_CASE("volume full: random fill to kNoSpace keeps data and accounting",
          "[crash][volume][nospace][seeded]") {
  uint64_t seed = GENERATE(from_range(dede::test::SeedsFromEnv({301, 302})));
  INFO("seed " << seed << " (reproduce with DEDE_SEED=" << seed << ")");
  std::mt19937_64 rng(seed);
  auto U = [&](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  SmallVolume sv(24ull << 20);
  Volume* vol = sv.vol.get();
  const uint64_t nb = 2600;
  std::vector<std::unique_ptr<File>> f;
  std::vector<std::vector<uint8_t>> model(2, std::vector<uint8_t>(nb * kB, 0));
  for (int i = 0; i < 2; i++) {
    REQUIRE(vol->Create("f" + std::to_string(i), nb * kB).ok());
    f.push_back(std::move(vol->OpenFile("f" + std::to_string(i)).value()));
  }
  auto check_accounting = [&](const std::string& when) {
    std::map<uint32_t, uint64_t> by_refs;
    for (int i = 0; i < 2; i++) {
      uint64_t mapped = 0;
      for (uint64_t b = 0; b < nb; b++) {
        uint32_t rc = f[i]->BlockRefCount(b).value();
        if (rc) by_refs[rc]++, mapped++;
      }
      INFO(when << ": file " << i);
      REQUIRE(f[i]->Info().value().mapped_blocks == mapped);
    }
    uint64_t distinct = 0;
    for (auto [r, n] : by_refs) {
      INFO(when << ": " << n << " positions with refcount " << r);
      REQUIRE(n % r == 0);
      distinct += n / r;
    }
    auto st = vol->Stats().value();
    INFO(when << ": used " << st.used_blocks << ", distinct data " << distinct << ", pointer "
              << st.pointer_blocks << ", free " << st.free_blocks);
    REQUIRE(st.used_blocks == distinct + st.pointer_blocks);
  };
  // After a failed write: each touched block reads as before or as written.
  auto adopt = [&](int i, uint64_t off, const std::vector<uint8_t>& buf) {
    uint64_t lo = off / kB * kB, hi = (off + buf.size() + kB - 1) / kB * kB;
    std::vector<uint8_t> got(hi - lo), want(model[i].begin() + lo, model[i].begin() + hi);
    REQUIRE(f[i]->Read(lo, got.data(), got.size()).ok());
    std::memcpy(want.data() + (off - lo), buf.data(), buf.size());
    for (uint64_t b = 0; b < (hi - lo) / kB; b++) {
      bool old_ok = std::memcmp(got.data() + b * kB, model[i].data() + lo + b * kB, kB) == 0;
      bool new_ok = std::memcmp(got.data() + b * kB, want.data() + b * kB, kB) == 0;
      INFO("failed write, file " << i << " block " << lo / kB + b);
      REQUIRE((old_ok || new_ok));
    }
    std::memcpy(model[i].data() + lo, got.data(), got.size());
  };
  int full = 0;
  for (int op = 0; op < 3000 && full < 6; op++) {
    int i = static_cast<int>(U(0, 1));
    uint64_t r = U(0, 99);
    INFO("op " << op << " r " << r);
    if (r < 60) {
      uint64_t len = U(1, 64 * kB), off = U(0, nb * kB - len);
      if (r < 30) off = off / kB * kB, len = std::max<uint64_t>(kB, len / kB * kB);
      if (off + len > nb * kB) len = nb * kB - off;
      std::vector<uint8_t> buf(len);
      for (auto& c : buf) c = static_cast<uint8_t>(rng());
      Status st = f[i]->Write(off, buf.data(), len);
      if (st.ok()) {
        std::memcpy(model[i].data() + off, buf.data(), len);
      } else {
        REQUIRE(st.code() == Status::Code::kNoSpace);
        adopt(i, off, buf);
        check_accounting("after kNoSpace from a write");
        full++;
        // Make room again: trim a random range of the other file.
        int j = 1 - i;
        uint64_t toff = U(0, nb - 400) * kB;
        REQUIRE(f[j]->Trim(toff, 400 * kB).ok());
        std::memset(model[j].data() + toff, 0, 400 * kB);
      }
    } else if (r < 80) {
      int j = static_cast<int>(U(0, 1));
      uint64_t si = U(0, nb - 1), di = U(0, nb - 1);
      Status st = vol->CloneBlock(f[i].get(), si, f[j].get(), di);
      if (st.ok()) {
        std::vector<uint8_t> tmp(model[i].begin() + si * kB, model[i].begin() + (si + 1) * kB);
        std::memcpy(model[j].data() + di * kB, tmp.data(), kB);
      } else {
        REQUIRE(st.code() == Status::Code::kNoSpace);
        check_accounting("after kNoSpace from a clone");
      }
    } else if (r < 95) {
      uint64_t off = U(0, nb - 1) * kB, len = U(1, 16) * kB;
      len = std::min(len, nb * kB - off);
      REQUIRE(f[i]->Trim(off, len).ok());
      std::memset(model[i].data() + off, 0, len);
    } else {
      REQUIRE(vol->Sync().ok());
    }
  }
  CHECK(full > 0);
  check_accounting("end");
  for (int i = 0; i < 2; i++) {
    std::vector<uint8_t> got(nb * kB);
    REQUIRE(f[i]->Read(0, got.data(), got.size()).ok());
    INFO("file " << i);
    bool matches_model = got == model[i];
    REQUIRE(matches_model);
  }
  f.clear();
  std::string problems = FsckProblems(vol);
  INFO("fsck:" << problems);
  CHECK(problems.empty());
  // Removing everything gives every block back.
  REQUIRE(vol->Remove("f0").ok());
  REQUIRE(vol->Remove("f1").ok());
  auto st = vol->Stats().value();
  CHECK(st.free_blocks == st.data_blocks);
}

// Minimal repro: Sync() is the flush point even when the only change since
// the last one is an in-place overwrite of an unshared block (which, by
// design, needs no metadata): after Sync returns OK the new data must
// survive a crash that drops every unflushed write.
TEST_CASE("volume crash: Sync makes in-place overwrites durable", "[crash][volume]") {
  MemDevice base(64 << 20);
  FaultDevice dev(&base);
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  std::vector<uint8_t> first(kB, 0xA1), second(kB, 0xB2);
  {
    CutDevice cut(&dev);
    OpenOptions oo;
    oo.locks = TempLocks();
    auto vol = Volume::Open(&cut, oo);
    REQUIRE(vol.ok());
    REQUIRE(vol.value()->Create("a", 1 << 20).ok());
    auto a = vol.value()->OpenFile("a");
    REQUIRE(a.ok());
    REQUIRE(a.value()->Write(0, first.data(), kB).ok());  // allocates: metadata
    REQUIRE(vol.value()->Sync().ok());
    REQUIRE(a.value()->Write(0, second.data(), kB).ok());  // in place: no metadata
    REQUIRE(vol.value()->Sync().ok());
    cut.Cut();  // the process dies here
    a.value().reset();
    vol.value().reset();
  }
  std::mt19937_64 rng(1);
  auto vol = CrashAndReopen(&dev, rng, 0.0);  // every unflushed write is lost
  auto a = vol->OpenFile("a");
  REQUIRE(a.ok());
  std::vector<uint8_t> got(kB);
  REQUIRE(a.value()->Read(0, got.data(), kB).ok());
  INFO("first byte after the crash: 0x" << std::hex << int(got[0])
                                        << " (0xa1 = the write before the first sync, 0xb2 = "
                                           "the write before the second sync)");
  bool synced_data_survived = got == second;
  CHECK(synced_data_survived);
}

// Two hosts on one device. Host 1 syncs a write (its journal holds the
// transaction, the home blocks do not yet), then loses its disk and closes
// the file. Host 1 is still alive, so nobody replays its journal: if it
// handed the file's lock back, host 2 would read the file's metadata from
// the stale home blocks and miss the acknowledged write (and a later replay
// of host 1's journal would overwrite whatever host 2 did meanwhile). So
// host 2 must either find the file locked or read the synced data; once
// host 1 is gone, host 2 replays its journal and reads the synced data.
TEST_CASE("volume crash: a host that lost its disk does not expose stale metadata",
          "[crash][volume][multihost]") {
  MemDevice base(64 << 20);
  FaultDevice d1(&base);  // host 1's path to the disk; host 2 uses `base`
  REQUIRE(FormatVolume(&base, FormatOptions{}, false).ok());
  auto hosts = TempLockGroup(2);  // separate descriptions: they conflict
  OpenOptions o1, o2;
  o1.locks = std::move(hosts[0]);
  o1.host_id = 1;
  o2.locks = std::move(hosts[1]);
  o2.host_id = 2;
  std::vector<uint8_t> synced(kB, 0x77);
  auto v1 = Volume::Open(&d1, o1);
  REQUIRE(v1.ok());
  REQUIRE(v1.value()->Create("a", 1 << 20).ok());
  {
    auto a = v1.value()->OpenFile("a");
    REQUIRE(a.ok());
    REQUIRE(a.value()->Write(0, synced.data(), kB).ok());
    REQUIRE(v1.value()->Sync().ok());
    d1.FailWritesAfter(0, EIO);  // host 1 loses its path to the disk
    CHECK_FALSE(a.value()->Write(kB, synced.data(), kB).ok());
  }  // host 1 closes the file (its checkpoint fails)
  auto v2 = Volume::Open(&base, o2);
  REQUIRE(v2.ok());
  std::vector<uint8_t> got(kB);
  {
    auto b = v2.value()->OpenFile("a");
    INFO("host 2 opening 'a' while host 1 lives: "
         << (b.ok() ? std::string("OK") : b.status().ToString()));
    REQUIRE((b.ok() || b.status().code() == Status::Code::kLocked));
    if (b.ok()) {
      REQUIRE(b.value()->Read(0, got.data(), kB).ok());
      INFO("host 2 reads 0x" << std::hex << int(got[0]) << " at byte 0 (host 1 synced 0x77)");
      bool sees_synced_write = got == synced;
      CHECK(sees_synced_write);
    }
  }
  // Host 1 goes away for good; host 2 recovers its journal.
  v1.value().reset();
  o1.locks.reset();
  auto b = v2.value()->OpenFile("a");
  REQUIRE(b.ok());
  REQUIRE(b.value()->Read(0, got.data(), kB).ok());
  INFO("after host 1 is gone host 2 reads 0x" << std::hex << int(got[0]));
  bool sees_synced_write = got == synced;
  CHECK(sees_synced_write);
  b.value().reset();
  std::string problems = FsckProblems(v2.value().get());
  INFO("fsck:" << problems);
  CHECK(problems.empty());
}

namespace {

// Holds every write whose first bytes are `mark` until Open(): a write
// request parked in the middle of its device I/O (WriteData's phase 2).
class GateDevice : public ForwardingDevice {
 public:
  GateDevice(BlockDevice* base, uint8_t mark) : ForwardingDevice(base, "gate"), mark_(mark) {}
  Status Write(uint64_t offset, const void* buf, size_t len) override {
    const auto* p = static_cast<const uint8_t*>(buf);
    if (len >= 64 && std::all_of(p, p + 64, [&](uint8_t c) { return c == mark_; })) {
      std::unique_lock<std::mutex> l(mu_);
      held_++;
      cv_.notify_all();
      cv_.wait(l, [&] { return open_; });
    }
    return ForwardingDevice::Write(offset, buf, len);
  }
  // Waits until a marked write is parked (false after 10 s).
  bool WaitHeld() {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, std::chrono::seconds(10), [&] { return held_ > 0; });
  }
  void Open() {
    std::lock_guard<std::mutex> l(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  const uint8_t mark_;
  std::mutex mu_;
  std::condition_variable cv_;
  int held_ = 0;
  bool open_ = false;
};

}  // namespace

// A write allocates its blocks, then writes their data without the volume
// mutex, then publishes the pointers. Another thread's flush point (the
// Sync timer, a FUA) in between commits whatever the running transaction
// holds; the host then dies before the pointers are committed. The blocks
// must come back free: seen as "refcount 1 stored, 0 references found"
// (three blocks, every byte 0x08) after the killed-host test.
TEST_CASE("volume crash: a flush point during a write's data I/O, then a crash, leaks nothing",
          "[crash][volume]") {
  MemDevice base(64 << 20);
  FaultDevice dev(&base);
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  const std::vector<uint8_t> synced(kB, 0x77), inflight(3 * kB, 0x08);
  {
    CutDevice cut(&dev);
    GateDevice gate(&cut, 0x08);
    OpenOptions oo;
    oo.locks = TempLocks();
    auto vol = Volume::Open(&gate, oo);
    REQUIRE(vol.ok());
    REQUIRE(vol.value()->Create("a", 1 << 20).ok());
    auto a = vol.value()->OpenFile("a");
    REQUIRE(a.ok());
    REQUIRE(a.value()->Write(0, synced.data(), kB).ok());
    REQUIRE(vol.value()->Sync().ok());
    Status write_status;
    std::thread writer(
        [&] { write_status = a.value()->Write(64 * kB, inflight.data(), inflight.size()); });
    const bool parked = gate.WaitHeld();
    CHECK(parked);
    // The flush point: it must not make the new blocks' counts durable.
    const Volume::ReservationCounters during = vol.value()->reservation_counters();
    CHECK(during.reserved_now == 3);
    CHECK(vol.value()->Sync().ok());
    cut.Cut();  // the host dies with the write's data I/O in flight
    gate.Open();
    writer.join();
    INFO("the write, finishing on a dead device: " << write_status.ToString());
    CHECK(vol.value()->reservation_counters().reserved_now == 0);
    a.value().reset();
    vol.value().reset();
  }
  std::mt19937_64 rng(1);
  auto vol = CrashAndReopen(&dev, rng, 0.0);  // every unflushed write is lost
  {
    auto a = vol->OpenFile("a");
    REQUIRE(a.ok());
    std::vector<uint8_t> got(kB);
    REQUIRE(a.value()->Read(0, got.data(), kB).ok());
    bool synced_data_survived = got == synced;
    CHECK(synced_data_survived);
  }
  std::string problems = FsckProblems(vol.get());
  INFO("fsck after the crash:" << problems);
  CHECK(problems.empty());
}

// The other way a group with reservations can be given back: a wait for a
// lock another host holds gives back every cached lock first (no host may
// wait holding what others wait for). The in-flight write's blocks are
// then counted before their group goes (materialized), so the next holder
// of the group cannot allocate them, and the write's publication does not
// count them twice.
TEST_CASE("volume: a wait that gives back a group with a write in flight counts its blocks first",
          "[volume][multihost]") {
  // Small groups (about 4 MiB) and two host shares: host 1 allocates
  // from group 0 up, host 2 from the middle; host 2's big file below runs
  // through its share into group 0, where host 1's write is in flight.
  MemDevice base(128 << 20);
  FormatOptions fo;
  fo.max_hosts = 2;
  fo.group_refblocks = 1;
  REQUIRE(FormatVolume(&base, fo, false).ok());
  auto hosts = TempLockGroup(2);
  OpenOptions o1, o2;
  o1.locks = std::move(hosts[0]);
  o1.host_id = 1;
  o2.locks = std::move(hosts[1]);
  o2.host_id = 2;
  GateDevice gate(&base, 0x08);
  auto v1 = Volume::Open(&gate, o1);
  REQUIRE(v1.ok());
  auto v2 = Volume::Open(&base, o2);
  REQUIRE(v2.ok());
  const std::vector<uint8_t> shared(kB, 0x33), inflight(3 * kB, 0x08), other(kB, 0x44);
  REQUIRE(v1.value()->Create("a", 1 << 20).ok());
  REQUIRE(v1.value()->Create("d", 1 << 20).ok());
  REQUIRE(v2.value()->Create("b", 1 << 20).ok());
  constexpr uint64_t kBigBlocks = (80ull << 20) / kB;
  REQUIRE(v2.value()->Create("c", kBigBlocks * kB).ok());
  {
    auto b = v2.value()->OpenFile("b");
    REQUIRE(b.ok());
    REQUIRE(b.value()->Write(0, shared.data(), kB).ok());
  }  // closing b hands host 2's groups back
  auto c = v2.value()->OpenFile("c");
  REQUIRE(c.ok());
  REQUIRE(c.value()->Write(0, other.data(), kB).ok());  // host 2 holds its group again
  REQUIRE(v2.value()->Sync().ok());
  auto a = v1.value()->OpenFile("a");
  auto d = v1.value()->OpenFile("d");
  auto b = v1.value()->OpenFile("b");
  REQUIRE(a.ok());
  REQUIRE(d.ok());
  REQUIRE(b.ok());
  Status write_status, clone_status;
  std::thread writer(
      [&] { write_status = a.value()->Write(16 * kB, inflight.data(), inflight.size()); });
  REQUIRE(gate.WaitHeld());
  REQUIRE(v1.value()->reservation_counters().reserved_now == 3);
  // b's block is in host 2's group: the clone's count increment waits for
  // it, giving back host 1's groups first; host 2 hands its group over at
  // its flush points.
  std::atomic<bool> clone_done{false};
  std::thread cloner([&] {
    clone_status = v1.value()->CloneBlock(b.value().get(), 0, d.value().get(), 0);
    clone_done = true;
  });
  for (int i = 0; i < 2000 && !clone_done; i++) {
    REQUIRE(v2.value()->Sync().ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  cloner.join();
  INFO("clone: " << clone_status.ToString());
  REQUIRE(clone_status.ok());
  const Volume::ReservationCounters after_wait = v1.value()->reservation_counters();
  CHECK(after_wait.materialized == 3);
  CHECK(after_wait.reserved_now == 3);  // still in flight, now counted
  // Host 2 fills its share and goes on into group 0 (host 1 gave it back)
  // while the write is still in flight: it must not get the in-flight
  // blocks.
  const std::vector<uint8_t> chunk(256 * kB, 0x44);
  for (uint64_t i = 0; i < kBigBlocks; i += 256) {
    REQUIRE(c.value()->Write(i * kB, chunk.data(), chunk.size()).ok());
  }
  REQUIRE(v2.value()->Sync().ok());
  gate.Open();
  writer.join();
  INFO("write: " << write_status.ToString());
  REQUIRE(write_status.ok());
  CHECK(v1.value()->reservation_counters().reserved_now == 0);
  REQUIRE(v1.value()->Sync().ok());
  std::vector<uint8_t> got(3 * kB);
  REQUIRE(a.value()->Read(16 * kB, got.data(), got.size()).ok());
  bool inflight_write_reads_back = got == inflight;
  CHECK(inflight_write_reads_back);
  got.resize(kB);
  REQUIRE(d.value()->Read(0, got.data(), kB).ok());
  bool clone_reads_back = got == shared;
  CHECK(clone_reads_back);
  std::vector<uint8_t> big(chunk.size());
  for (uint64_t i = 0; i < kBigBlocks; i += 256) {
    REQUIRE(c.value()->Read(i * kB, big.data(), big.size()).ok());
    if (big != chunk) FAIL("host 2's file c changed near block " << i);
  }
  a.value().reset();
  b.value().reset();
  d.value().reset();
  c.value().reset();
  v2.value().reset();
  o2.locks.reset();
  std::string problems = FsckProblems(v1.value().get());
  INFO("fsck:" << problems);
  CHECK(problems.empty());
}

namespace {

// Cuts `cut` (the process dies) when the volume announces that it is
// blocked in a wait for a lock (kWaiting), once armed.
class CutAtWait : public ForwardingLocks {
 public:
  CutAtWait(std::shared_ptr<LockManager> base, CutDevice* cut)
      : ForwardingLocks(std::move(base)), cut_(cut) {}
  std::atomic<bool> armed{false}, fired{false};
  Status Acquire(LockId id, LockMode mode, bool wait) override {
    if (id.kind == LockKind::kWaiting && armed && !fired.exchange(true)) cut_->Cut();
    return ForwardingLocks::Acquire(id, mode, wait);
  }

 private:
  CutDevice* const cut_;
};

}  // namespace

// A write's round publishes its new blocks in one transaction: counts,
// pointers, then the inode (root, depth, mapped count). A pointer block
// allocated in the middle of that (the map grows to cover the round's
// later blocks) could reach the allocator's last resort, which checkpoints
// the running transaction before it waits: a crash during the wait left
// the first blocks' pointers and counts durable without the inode (its
// mapped count too low) and the grown root and the claimed block of the
// failing position counted with no reference (leaked). The map's paths
// are now built before the round's blocks are reserved, so the wait
// checkpoints only finished steps. Within one path, a root grown before a
// lower level's allocation waited was not stored with the inode yet (the
// caller stores it): leaked the same way; a path's blocks are now
// allocated in one call before the map changes.
TEST_CASE("volume crash: a crash while a write waits for a pointer block leaks nothing",
          "[crash][volume][nospace]") {
  // 11 free: the write's 10 data blocks fit, and the wait came for the
  // second of the two pointer blocks blocks 508..514 need, in the middle
  // of publishing (505..507 published). 1 free: the first pointer block
  // (the new root) fits and the wait comes for the leaf under it.
  uint64_t free_target = 0;
  SECTION("the wait in the middle of a round's publication") {
    free_target = 11;
  }
  SECTION("the wait in the middle of a map path") {
    free_target = 1;
  }
  MemDevice base(24ull << 20);
  FaultDevice dev(&base);
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  const std::vector<uint8_t> first(kB, 0x5a), ten(10 * kB, 0x22), chunk(64 * kB, 0x11);
  {
    CutDevice cut(&dev);
    auto locks = std::make_shared<CutAtWait>(TempLocks(), &cut);
    OpenOptions oo;
    oo.locks = locks;
    auto v = Volume::Open(&cut, oo);
    REQUIRE(v.ok());
    Volume* vol = v.value().get();
    auto free_blocks = [&] {
      auto st = vol->Stats();
      REQUIRE(st.ok());
      return st->free_blocks;
    };
    REQUIRE(vol->Create("a", 4000 * kB).ok());
    REQUIRE(vol->Create("b", 4000 * kB).ok());
    auto a = vol->OpenFile("a");
    auto b = vol->OpenFile("b");
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    // b maps block 0: one level, whose leaf (the root) covers 0..507.
    REQUIRE(b.value()->Write(0, first.data(), kB).ok());
    // Exactly free_target blocks free: fill with a, then punch back.
    uint64_t next = 0;
    while (free_blocks() > free_target + 64 + 4) {
      REQUIRE(a.value()->Write(next * kB, chunk.data(), chunk.size()).ok());
      next += 64;
    }
    while (free_blocks() > free_target) {
      REQUIRE(a.value()->Write(next * kB, chunk.data(), kB).ok());
      next++;
    }
    REQUIRE(vol->Sync().ok());
    while (free_blocks() < free_target) {
      REQUIRE(a.value()->Punch(--next).ok());
      REQUIRE(vol->Sync().ok());
    }
    REQUIRE(free_blocks() == free_target);
    // Blocks 505..514 of b: 10 data blocks, and for 508..514 a second
    // level (a new root) and a leaf under it: 12 blocks.
    locks->armed = true;
    Status st = b.value()->Write(505 * kB, ten.data(), ten.size());
    INFO("the write: " << st.ToString());
    CHECK_FALSE(st.ok());
    CHECK(locks->fired);  // the host died in the allocator's wait
    a.value().reset();
    b.value().reset();
  }
  std::mt19937_64 rng(3);
  auto vol = CrashAndReopen(&dev, rng, 0.0);  // nothing unflushed survives
  {
    auto b = vol->OpenFile("b");
    REQUIRE(b.ok());
    std::vector<uint8_t> got(kB);
    REQUIRE(b.value()->Read(0, got.data(), kB).ok());
    bool synced_block_survived = got == first;
    CHECK(synced_block_survived);
    auto info = b.value()->Info();
    REQUIRE(info.ok());
    uint64_t mapped = 0;
    for (uint64_t i = 0; i < 520; i++) mapped += b.value()->BlockRefCount(i).value() > 0;
    CHECK(info->mapped_blocks == mapped);
  }
  std::string problems = FsckProblems(vol.get());
  INFO("fsck after the crash:" << problems);
  CHECK(problems.empty());
}

// A write whose publication (phase 3) finds the drop list too full for its
// round waits for the group its drops are in; when that wait times out the
// round is given back. The wait first counted the round's reserved blocks
// (materialized) and gave their group back, so each went back as a drop:
// into the full list, which overflowed and poisoned the volume (every
// later write and flush of the host failed) for one failed write. Now a
// block goes back at once when its group is free, into the list while it
// has room, and is left leaked (counted, for fsck --repair) past that.
TEST_CASE("volume: a write whose drop-list wait times out gives its blocks back without poisoning",
          "[volume][multihost]") {
  constexpr uint64_t kSrc = 500;  // shared blocks, one map level
  MemDevice base(64 << 20);
  FormatOptions fo;
  fo.group_refblocks = 2;
  fo.drop_blocks = 1;  // kDropsPerBlock entries
  REQUIRE(FormatVolume(&base, fo, false).ok());
  auto hosts = TempLockGroup(2);
  std::shared_ptr<LockManager> holder = hosts[1];
  auto group = [](uint64_t g) { return LockId{LockKind::kGroup, g}; };
  auto about = [](LockKind kind, uint64_t g) {
    return LockId{kind, (uint64_t{static_cast<uint16_t>(LockKind::kGroup)} << 40) | g};
  };
  OpenOptions o1;
  o1.locks = hosts[0];
  o1.host_id = 1;
  o1.lock_wait_s = 3;  // the other host takes group 1 during this wait: room for a slow machine
  GateDevice gate(&base, 0x08);
  auto v = Volume::Open(&gate, o1);
  REQUIRE(v.ok());
  Volume* vol = v.value().get();
  std::vector<uint8_t> x(kSrc * kB), y(kSrc * kB);
  for (size_t i = 0; i < x.size(); i++) {
    x[i] = static_cast<uint8_t>(0x31 + i * 7 + i / kB);
    y[i] = static_cast<uint8_t>(0x57 + i * 5 + i / kB);
  }
  const std::vector<uint8_t> inflight(20 * kB, 0x08);
  REQUIRE(vol->Create("src", kSrc * kB).ok());
  REQUIRE(vol->Create("dst", kSrc * kB).ok());
  REQUIRE(vol->Create("w", 1000 * kB).ok());
  auto src = vol->OpenFile("src");
  auto dst = vol->OpenFile("dst");
  auto w = vol->OpenFile("w");
  REQUIRE(src.ok());
  REQUIRE(dst.ok());
  REQUIRE(w.ok());
  // src's blocks, in group 0 (the first of an empty volume), shared by dst.
  REQUIRE(src.value()->Write(0, x.data(), x.size()).ok());
  for (uint64_t i = 0; i < kSrc; i++) {
    REQUIRE(vol->CloneBlock(src.value().get(), i, dst.value().get(), i).ok());
  }
  // Another host takes group 0 (host 1 hands its groups over at a flush
  // point) and never answers.
  const uint64_t groups = vol->superblock().group_count;
  for (uint64_t g = 0; g < groups; g++) {
    REQUIRE(holder->Acquire(about(LockKind::kWanted, g), LockMode::kShared, false).ok());
  }
  REQUIRE(vol->Sync().ok());
  for (uint64_t g = 0; g < groups; g++) REQUIRE(holder->Release(about(LockKind::kWanted, g)).ok());
  REQUIRE(holder->Acquire(group(0), LockMode::kExclusive, false).ok());
  // A write of 20 new blocks at 600.. (two map levels) reserves them and
  // parks in its data I/O.
  Status write_status;
  std::thread writer(
      [&] { write_status = w.value()->Write(600 * kB, inflight.data(), inflight.size()); });
  REQUIRE(gate.WaitHeld());
  REQUIRE(vol->reservation_counters().reserved_now == 20);
  // Meanwhile copy-on-write breaks of dst defer their drops (group 0 is
  // held elsewhere) until the list has room for 12: what a one-level
  // write's round needs, less than the two-level round's publication.
  auto room = [&] { return kDropsPerBlock - vol->drop_counters().pending; };
  uint64_t next = 0;
  while (room() > 12) {
    const uint64_t k = std::min<uint64_t>({32, room() - 12, kSrc - next});
    REQUIRE(k > 0);
    REQUIRE(dst.value()->Write(next * kB, y.data() + next * kB, k * kB).ok());
    next += k;
  }
  REQUIRE(room() == 12);
  // The publication waits for group 0 (3 s), having given back the group
  // of its blocks; the other host takes that one meanwhile.
  gate.Open();
  bool waiting = false;
  for (int i = 0; i < 500 && !waiting; i++) {
    auto held = holder->IsHeldElsewhere(about(LockKind::kWaiting, 0));
    waiting = held.ok() && *held;
    if (!waiting) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  REQUIRE(waiting);
  const uint64_t g1 = 1;
  Status took = holder->Acquire(group(g1), LockMode::kExclusive, false);
  INFO("the other host taking group 1: " << took.ToString());
  REQUIRE(took.ok());
  writer.join();
  INFO("the write: " << write_status.ToString());
  CHECK(write_status.code() == Status::Code::kLocked);
  // 12 blocks went into the list, the other 8 are left leaked; the volume
  // is not poisoned.
  CHECK(vol->drop_counters().pending == kDropsPerBlock);
  CHECK(vol->reservation_counters().leaked == 8);
  CHECK(vol->reservation_counters().reserved_now == 0);
  Status sync = vol->Sync();
  INFO("flush point after the failed write: " << sync.ToString());
  REQUIRE(sync.ok());
  // The other host lets go: the drops are applied and writes work again.
  REQUIRE(holder->Release(group(0)).ok());
  REQUIRE(holder->Release(group(g1)).ok());
  for (int i = 0; i < 100 && vol->drop_counters().pending > 0; i++) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    REQUIRE(vol->Sync().ok());
  }
  REQUIRE(vol->drop_counters().pending == 0);
  REQUIRE(w.value()->Write(600 * kB, inflight.data(), inflight.size()).ok());
  REQUIRE(vol->Sync().ok());
  std::vector<uint8_t> got(inflight.size());
  REQUIRE(w.value()->Read(600 * kB, got.data(), got.size()).ok());
  bool write_reads_back = got == inflight;
  CHECK(write_reads_back);
  got.resize(kSrc * kB);
  REQUIRE(dst.value()->Read(0, got.data(), next * kB).ok());
  bool cow_breaks_read_back = std::equal(got.begin(), got.begin() + next * kB, y.begin());
  CHECK(cow_breaks_read_back);
  src.value().reset();
  dst.value().reset();
  w.value().reset();
  // fsck finds the 8 leaked blocks, and nothing else; --repair frees them.
  const FsckLeaks found = FsckLeakedBlocks(vol);
  INFO("fsck: " << found.error << "; other problems:" << found.others);
  REQUIRE(found.error.empty());
  CHECK(found.others.empty());
  CHECK(found.leaked == 8);
  REQUIRE(CheckVolume(vol, true).ok());
  std::string problems = FsckProblems(vol);
  INFO("fsck after --repair:" << problems);
  CHECK(problems.empty());
}

// The same failure on a volume without drop lists: there every drop takes
// its block's group, and a failed write's materialized blocks, whose group
// the other host took while the write waited, were dropped through
// DropRef, which waited for that group again (the lock wait, 3 s here,
// per block, under the volume mutex) and then failed, the error ignored:
// the blocks leaked uncounted. Now each is left leaked at once, counted.
TEST_CASE("volume: without drop lists a failed write leaves its blocks leaked instead of waiting",
          "[volume][multihost]") {
  constexpr uint64_t kBlocks = 8;
  MemDevice base(64 << 20);
  FormatOptions fo;
  fo.group_refblocks = 1;  // 4 MiB groups: host 2's first group is not host 1's
  fo.drop_blocks = 0;
  REQUIRE(FormatVolume(&base, fo, false).ok());
  auto hosts = TempLockGroup(3);
  std::shared_ptr<LockManager> holder = hosts[2];
  auto group = [](uint64_t g) { return LockId{LockKind::kGroup, g}; };
  auto about = [](LockKind kind, uint64_t g) {
    return LockId{kind, (uint64_t{static_cast<uint16_t>(LockKind::kGroup)} << 40) | g};
  };
  std::vector<uint8_t> x(kBlocks * kB);
  for (size_t i = 0; i < x.size(); i++) x[i] = static_cast<uint8_t>(0x31 + i * 7 + i / kB);
  const std::vector<uint8_t> inflight(kBlocks * kB, 0x08);
  {
    // Host 2 writes "src" and shares its blocks with "dst" (its groups).
    OpenOptions o2;
    o2.locks = hosts[1];
    o2.host_id = 2;
    auto v2 = Volume::Open(&base, o2);
    REQUIRE(v2.ok());
    REQUIRE(v2.value()->Create("src", kBlocks * kB).ok());
    REQUIRE(v2.value()->Create("dst", kBlocks * kB).ok());
    auto src = v2.value()->OpenFile("src");
    auto dst = v2.value()->OpenFile("dst");
    REQUIRE(src.ok());
    REQUIRE(dst.ok());
    REQUIRE(src.value()->Write(0, x.data(), x.size()).ok());
    for (uint64_t i = 0; i < kBlocks; i++) {
      REQUIRE(v2.value()->CloneBlock(src.value().get(), i, dst.value().get(), i).ok());
    }
  }
  OpenOptions o1;
  o1.locks = hosts[0];
  o1.host_id = 1;
  o1.lock_wait_s = 3;
  GateDevice gate(&base, 0x08);
  auto v = Volume::Open(&gate, o1);
  REQUIRE(v.ok());
  Volume* vol = v.value().get();
  auto dst = vol->OpenFile("dst");
  REQUIRE(dst.ok());
  // Host 1 holds its group 0 (allocations prefer groups held already;
  // closing a file would give them back).
  REQUIRE(vol->Create("w0", kB).ok());
  auto w0 = vol->OpenFile("w0");
  REQUIRE(w0.ok());
  REQUIRE(w0.value()->Write(0, x.data(), kB).ok());
  // Host 1 breaks dst's sharing: phase 1 takes the shared blocks' group
  // (G, host 2's) and reserves new blocks in its own group 0; the data
  // write parks.
  Status write_status;
  std::chrono::steady_clock::time_point t0;
  double took = 0;
  std::thread writer([&] {
    write_status = dst.value()->Write(0, inflight.data(), inflight.size());
    took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  REQUIRE(gate.WaitHeld());
  REQUIRE(vol->reservation_counters().reserved_now == kBlocks);
  // Another host takes G (host 1's flush point hands it over; group 0,
  // with the reservations, stays). G: the group besides 0 host 1 holds.
  const uint64_t groups = vol->superblock().group_count;
  uint64_t g_shared = groups;
  for (uint64_t g = 1; g < groups && g_shared == groups; g++) {
    auto held = holder->IsHeldElsewhere(group(g));
    REQUIRE(held.ok());
    if (*held) g_shared = g;
  }
  REQUIRE(g_shared < groups);
  {
    auto held = holder->IsHeldElsewhere(group(0));
    REQUIRE(held.ok());
    REQUIRE(*held);  // the reservations' group
  }
  for (uint64_t g = 0; g < groups; g++) {
    REQUIRE(holder->Acquire(about(LockKind::kWanted, g), LockMode::kShared, false).ok());
  }
  REQUIRE(vol->Sync().ok());
  for (uint64_t g = 0; g < groups; g++) REQUIRE(holder->Release(about(LockKind::kWanted, g)).ok());
  REQUIRE(holder->Acquire(group(g_shared), LockMode::kExclusive, false).ok());
  // Phase 3 must drop the shared blocks' references: it gives back group 0
  // (its reservations counted first) and waits for G (3 s); the other host
  // takes group 0 meanwhile.
  t0 = std::chrono::steady_clock::now();
  gate.Open();
  bool waiting = false;
  for (int i = 0; i < 1000 && !waiting; i++) {
    auto held = holder->IsHeldElsewhere(about(LockKind::kWaiting, g_shared));
    waiting = held.ok() && *held;
    if (!waiting) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  REQUIRE(waiting);
  Status took0 = holder->Acquire(group(0), LockMode::kExclusive, false);
  INFO("the other host taking group 0: " << took0.ToString());
  REQUIRE(took0.ok());
  writer.join();
  INFO("the write: " << write_status.ToString() << " after " << took << " s");
  CHECK(write_status.code() == Status::Code::kLocked);
  // One wait (3 s) for G, none for group 0 per block (8 x 3 s).
  CHECK(took < 9.0);
  CHECK(vol->reservation_counters().leaked == kBlocks);
  CHECK(vol->reservation_counters().reserved_now == 0);
  REQUIRE(holder->Release(group(0)).ok());
  REQUIRE(holder->Release(group(g_shared)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(150));  // past LooksBusy
  REQUIRE(vol->Sync().ok());
  std::vector<uint8_t> got(x.size());
  REQUIRE(dst.value()->Read(0, got.data(), got.size()).ok());
  bool dst_unchanged = got == x;
  CHECK(dst_unchanged);
  dst.value().reset();
  w0.value().reset();
  const FsckLeaks found = FsckLeakedBlocks(vol);
  INFO("fsck: " << found.error << "; other problems:" << found.others);
  REQUIRE(found.error.empty());
  CHECK(found.others.empty());
  CHECK(found.leaked == kBlocks);
  REQUIRE(CheckVolume(vol, true).ok());
  std::string problems = FsckProblems(vol);
  INFO("fsck after --repair:" << problems);
  CHECK(problems.empty());
}

namespace {

// Slows data writes a little (not metadata: the journal and home blocks
// start with a block header), so a write's data I/O overlaps other
// threads' flush points as it does on a real disk.
class SlowDataDevice : public ForwardingDevice {
 public:
  explicit SlowDataDevice(BlockDevice* base) : ForwardingDevice(base, "slow") {}
  Status Write(uint64_t offset, const void* buf, size_t len) override {
    if (len >= kSec && static_cast<const uint8_t*>(buf)[0] == 0xD5) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return ForwardingDevice::Write(offset, buf, len);
  }
};

// Every 512-byte sector a writer writes: 0xD5, then who wrote it (file,
// block, version, sector), then a byte derived from those. A sector read
// back after a crash must be all zeros or one of these, whole.
void FillSector(uint8_t* s, uint64_t file, uint64_t block, uint64_t version, uint64_t sector) {
  const uint64_t f[4] = {file, block, version, sector};
  s[0] = 0xD5;
  std::memcpy(s + 8, f, sizeof f);
  const uint8_t fill = static_cast<uint8_t>(file * 31 + block * 7 + version * 3 + sector);
  std::memset(s + 40, fill, kSec - 40);
  std::memset(s + 1, fill, 7);
}

bool SectorWellFormed(const uint8_t* s) {
  if (std::all_of(s, s + kSec, [](uint8_t c) { return c == 0; })) return true;
  if (s[0] != 0xD5) return false;
  uint64_t f[4];
  std::memcpy(f, s + 8, sizeof f);
  const uint8_t fill = static_cast<uint8_t>(f[0] * 31 + f[1] * 7 + f[2] * 3 + f[3]);
  return std::all_of(s + 1, s + 8, [&](uint8_t c) { return c == fill; }) &&
         std::all_of(s + 40, s + kSec, [&](uint8_t c) { return c == fill; });
}

}  // namespace

// The whole class of "a flush point in the middle of another thread's
// operation": writer threads allocate (new and copy-on-write blocks),
// overwrite in place and clone between two files while a flush thread
// calls Sync every millisecond; the process dies at a random moment and
// the device loses or tears what was not flushed. After the replay fsck
// must find every count equal to its references (nothing leaked, nothing
// counted twice), and every sector must be zeros or one a writer wrote.
TEST_CASE("volume crash: concurrent writers and flush points, crash at a random moment",
          "[crash][volume][seeded]") {
  for (uint64_t seed : dede::test::SeedsFromEnv({11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22})) {
    INFO("seed " << seed << " (reproduce: DEDE_SEED=" << seed << ")");
    std::mt19937_64 rng(seed);
    MemDevice base(64 << 20);
    FaultDevice dev(&base);
    REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
    constexpr uint64_t kFileBlocks = 512;
    {
      CutDevice cut(&dev);
      SlowDataDevice slow(&cut);
      OpenOptions oo;
      oo.locks = TempLocks();
      auto vol = Volume::Open(&slow, oo);
      REQUIRE(vol.ok());
      std::vector<std::unique_ptr<File>> files;
      for (int i = 0; i < 2; i++) {
        const std::string name = "w" + std::to_string(i);
        REQUIRE(vol.value()->Create(name, kFileBlocks * kB).ok());
        auto f = vol.value()->OpenFile(name);
        REQUIRE(f.ok());
        files.push_back(std::move(f.value()));
      }
      std::atomic<bool> stop{false};
      std::atomic<uint64_t> version{1}, writes{0}, clones{0}, syncs{0};
      auto writer = [&](int t) {
        std::mt19937_64 r(seed * 100 + t);
        std::vector<uint8_t> buf;
        while (!stop) {
          File* f = files[t].get();
          if (r() % 8 == 0) {
            // Copy-on-write sources: the other file's block becomes shared.
            File* src = files[1 - t].get();
            (void)vol.value()->CloneBlock(src, r() % kFileBlocks, f, r() % kFileBlocks);
            clones++;
            continue;
          }
          const uint64_t n = 1 + r() % 24;
          const uint64_t b0 = r() % (kFileBlocks - n);
          const uint64_t v = version++;
          buf.resize(n * kB);
          for (uint64_t b = 0; b < n; b++) {
            for (uint64_t s = 0; s < kB / kSec; s++) {
              FillSector(buf.data() + b * kB + s * kSec, t, b0 + b, v, s);
            }
          }
          if (!f->Write(b0 * kB, buf.data(), buf.size()).ok()) break;
          writes++;
        }
      };
      std::thread w0(writer, 0), w1(writer, 1);
      std::thread flusher([&] {
        while (!stop) {
          if (!vol.value()->Sync().ok()) break;
          syncs++;
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      });
      // A random point measured in completed writes, not time, so a slow
      // machine (ASan, CI) cuts as far into the work as a fast one.
      const uint64_t cut_after = 1 + rng() % 300;
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (writes.load() < cut_after && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      cut.Cut();  // the process dies here; its threads go on into the void
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      stop = true;
      w0.join();
      w1.join();
      flusher.join();
      INFO(writes.load() << " writes, " << clones.load() << " clones, " << syncs.load()
                         << " flush points");
      CHECK(writes.load() > 0);
      files.clear();
      vol.value().reset();
    }
    auto vol = CrashAndReopen(&dev, rng, std::vector<double>{0.0, 0.5, 1.0}[rng() % 3]);
    std::string problems = FsckProblems(vol.get());
    INFO("fsck after the crash:" << problems);
    CHECK(problems.empty());
    for (int i = 0; i < 2; i++) {
      auto f = vol->OpenFile("w" + std::to_string(i));
      REQUIRE(f.ok());
      std::vector<uint8_t> all(kFileBlocks * kB);
      REQUIRE(f.value()->Read(0, all.data(), all.size()).ok());
      for (uint64_t s = 0; s < all.size() / kSec; s++) {
        if (!SectorWellFormed(all.data() + s * kSec)) {
          FAIL("file w" << i << " sector " << s << " holds bytes no writer wrote");
        }
      }
    }
  }
}
