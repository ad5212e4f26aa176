// The volume model harness (see tests/unit/volume_model_test.cc for what
// it checks). Shared by the unit test (MemDevice) and the integration test
// that runs it on the path and iSCSI backends. Included by one translation
// unit per test binary, hence the unnamed namespace.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/random_bytes.h"
#include "tests/seeds.h"
#include "tests/temp_locks.h"
#include "volume/fsck.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;

namespace {

constexpr uint64_t kB = kBlockSize;
// Files reach 4.5 MiB (1152 blocks): past 508 blocks the block map needs a
// second level.
constexpr uint64_t kMaxFileBytes = 1152 * kB;
constexpr size_t kMaxFiles = 6;
constexpr size_t kMaxWrite = 300 * 1024;
constexpr int kPatterns = 6;

// Lock managers on one lock file: like hosts, they exclude each other.
void ModelLockPair(std::shared_ptr<LockManager>* a, std::shared_ptr<LockManager>* b,
                   std::shared_ptr<LockManager>* c = nullptr) {
  std::vector<std::shared_ptr<LockManager>> hosts =
      dede::test::TempLockGroup(c != nullptr ? 3 : 2);
  *a = hosts[0];
  *b = hosts[1];
  if (c != nullptr) *c = hosts[2];
}

struct MFile {
  int fid = 0;
  std::string name;
  uint64_t size = 0;
  bool dedup = true;
  // nblocks * 4 KiB: each block as the volume stores it. Past EOF a block
  // may hold bytes a clone brought along (clone_block shares the whole
  // physical block); truncate must clear them before they become visible.
  std::vector<uint8_t> data;
  std::vector<int64_t> cls;   // per block: sharing class, -1 = hole
  std::unique_ptr<File> f;
  uint64_t nblocks() const { return cls.size(); }
  uint64_t mapped() const {
    return static_cast<uint64_t>(std::count_if(cls.begin(), cls.end(), [](int64_t c) { return c >= 0; }));
  }
};

using PosKey = std::pair<int, uint64_t>;  // (model file id, block index)

// Fails with the seed, the step and the operation in the message.
#define MFAIL(msg)                                                                   \
  FAIL("seed " << seed_ << " step " << step_ << " [" << desc_ << "]: " << msg        \
               << "\n  reproduce: DEDE_SEED=" << seed_ << " DEDE_STEPS=" << step_)

class ModelHarness {
 public:
  // `device` (optional) is the device to format and use; by default a
  // 96 MiB MemDevice.
  explicit ModelHarness(uint64_t seed, BlockDevice* device = nullptr)
      : seed_(seed), rng_(seed) {
    if (device == nullptr) {
      mem_ = std::make_unique<MemDevice>(96ull << 20);
      device = mem_.get();
    }
    device_ = device;
    for (int p = 0; p < kPatterns; p++) {
      patterns_.push_back(RandomBytes(kB));
    }
    patterns_[0].assign(kB, 0);  // the zero block is a pattern too
  }

  void Run(uint64_t steps) {
    // Small groups (about 8 MiB each), so that holding some of them leaves
    // others to allocate from.
    FormatOptions fo;
    fo.group_refblocks = 2;
    REQUIRE(FormatVolume(device_, fo, true).ok());
    // Two hosts (two Volume instances with lock managers that exclude each
    // other) take turns: "switch host" closes every file on one and opens
    // them on the other, so each must see what the other left behind. A
    // third lock manager plays a host that holds allocation groups and
    // never answers (OpWithGroupsHeld).
    ModelLockPair(&host_locks_[0], &host_locks_[1], &holder_locks_);
    cur_ = 1;
    OpenVolume(2);
    cur_ = 0;
    OpenVolume(1);
    // One file larger than one leaf (508 blocks) from the start, so its map
    // has two levels; one small file.
    desc_ = "setup: ";
    CreateFile(3 * 1024 * 1024 + 1234);
    desc_ += ", ";
    CreateFile(256 * 1024);
    Verify();
    bool fsck_missing_reported = false;
    for (step_ = 1; step_ <= steps; step_++) {
      desc_.clear();
      OneOp();
      if (trace_) std::fprintf(stderr, "step %llu: %s\n", (unsigned long long)step_, desc_.c_str());
      {
        std::string kind = desc_.substr(0, desc_.find(' '));
        for (const char* q : {"aligned", "small", "large", "zeros", "random", "patterns",
                              "expect OK", "kMismatch", "kInvalid", "unaligned"}) {
          if (desc_.find(q) != std::string::npos) kind += std::string(" ") + q;
        }
        counts_[kind]++;
      }
      Verify();
      if (step_ % 50 == 0) VerifyAll();
      if (step_ % 500 == 0 || step_ == steps) Fsck(&fsck_missing_reported);
    }
    // Every deferred drop must get applied once nobody holds the groups:
    // then the counts are exact again.
    desc_ = "drain the drop lists";
    for (int round = 0; round < 4 && pending_drops_ > 0; round++) {
      for (int k = 0; k < 2; k++) {
        OpSwitchHost();
        clock_.Advance(1'000'000'000);
        Expect(vol()->Sync(), "sync");
      }
      CheckSpace();
    }
    if (pending_drops_ > 0) MFAIL(pending_drops_ << " drops still pending with no group held");
    VerifyAll();
    // The run must have reached the deferral (a few dozen times per seed).
    INFO("seed " << seed_ << ": operations run with groups held elsewhere: " << held_ops_
                 << ", of which deferred drops: " << drops_deferred_ops_);
    CHECK(drops_deferred_ops_ > 0);
    if (std::getenv("DEDE_VERBOSE") != nullptr) {
      std::ostringstream os;
      os << "seed " << seed_ << " (" << held_ops_ << " ops with groups held elsewhere, "
         << drops_deferred_ops_ << " deferred drops) op counts:";
      for (const auto& [k, v] : counts_) os << "\n  " << k << ": " << v;
      WARN(os.str());
    }
    desc_ = "teardown";
    CloseAll();
    vols_[0].reset();
    vols_[1].reset();
  }

 private:
  // ------------------------------------------------------------ randomness

  uint64_t U(uint64_t lo, uint64_t hi) {  // inclusive
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_);
  }
  bool P(double p) { return std::bernoulli_distribution(p)(rng_); }

  std::vector<uint8_t> RandomBytes(size_t n) {
    std::vector<uint8_t> v(n);
    // Whole words through FillRandom (the same outputs in the same order);
    // the tail takes one output per byte, as the model's runs always did.
    const size_t words = n / 8 * 8;
    test::FillRandom(rng_, v.data(), words);
    for (size_t i = words; i < n; i++) v[i] = static_cast<uint8_t>(rng_());
    return v;
  }

  // Content for a write of `len` bytes at `off`: random, zeros, or
  // pattern blocks (aligned to the file's blocks so equal blocks appear).
  std::vector<uint8_t> Content(uint64_t off, size_t len, std::string* kind) {
    uint64_t r = U(0, 99);
    if (r < 20) {
      *kind = "zeros";
      return std::vector<uint8_t>(len, 0);
    }
    if (r < 50) {
      *kind = "patterns";
      std::vector<uint8_t> v(len);
      for (size_t i = 0; i < len;) {
        uint64_t pos = off + i;
        size_t in_blk = pos % kB;
        size_t n = std::min<size_t>(kB - in_blk, len - i);
        const auto& pat = patterns_[U(0, kPatterns - 1)];
        std::memcpy(v.data() + i, pat.data() + in_blk, n);
        i += n;
      }
      return v;
    }
    *kind = "random";
    return RandomBytes(len);
  }

  // A block index below n, biased toward the edges that matter: the last
  // (often partial) block, the first, and the 508-block leaf boundary.
  uint64_t Idx(uint64_t n) {
    uint64_t r = U(0, 99);
    if (r < 15) return n - 1;
    if (r < 20) return 0;
    if (r < 27 && n > kPointersPerBlock + 1) return U(kPointersPerBlock - 1, kPointersPerBlock);
    return U(0, n - 1);
  }

  MFile& PickFile() {
    auto it = files_.begin();
    std::advance(it, static_cast<long>(U(0, files_.size() - 1)));
    return it->second;
  }

  // A random mapped position of any file, or false.
  bool PickMapped(PosKey* out) {
    for (int tries = 0; tries < 20; tries++) {
      MFile& m = PickFile();
      if (m.nblocks() == 0) continue;
      uint64_t i = U(0, m.nblocks() - 1);
      for (uint64_t k = 0; k < std::min<uint64_t>(m.nblocks(), 64); k++) {
        uint64_t j = (i + k) % m.nblocks();
        if (m.cls[j] >= 0) {
          *out = {m.fid, j};
          return true;
        }
      }
    }
    return false;
  }

  // --------------------------------------------------------------- model

  void Leave(MFile& m, uint64_t i) {
    int64_t c = m.cls[i];
    touched_pos_.insert({m.fid, i});
    if (c < 0) return;
    affected_.insert(c);
    auto& mem = classes_.at(c);
    mem.erase({m.fid, i});
    if (mem.empty()) classes_.erase(c);
    m.cls[i] = -1;
  }
  void Fresh(MFile& m, uint64_t i) {
    Leave(m, i);
    int64_t c = next_class_++;
    classes_[c].insert({m.fid, i});
    m.cls[i] = c;
    affected_.insert(c);
  }
  void Join(MFile& m, uint64_t i, int64_t c) {
    Leave(m, i);
    classes_.at(c).insert({m.fid, i});
    m.cls[i] = c;
    affected_.insert(c);
  }
  // The effect of writing (any part of) block i: a hole gets a new block,
  // a shared block is copied, an unshared block is written in place.
  void WriteEffect(MFile& m, uint64_t i) {
    touched_pos_.insert({m.fid, i});
    int64_t c = m.cls[i];
    if (c < 0 || classes_.at(c).size() > 1) Fresh(m, i);
  }
  void Touch(const MFile& m, uint64_t lo, uint64_t hi) {
    touched_files_.insert(m.fid);
    touched_ranges_.push_back({m.fid, {lo, hi}});
  }
  uint8_t* Blk(MFile& m, uint64_t i) { return m.data.data() + i * kB; }
  // Whether block i lies entirely inside the file (clone/share need that).
  static bool Whole(const MFile& m, uint64_t i) { return (i + 1) * kB <= m.size; }
  // ---------------------------------------------------------------- volume

  Volume* vol() { return vols_[cur_].get(); }

  // Opens the current host's Volume instance.
  void OpenVolume(uint32_t host) {
    OpenOptions oo;
    oo.locks = host_locks_[cur_];
    oo.host_id = host;
    oo.clock = &clock_;
    auto v = Volume::Open(device_, oo);
    if (!v.ok()) MFAIL("open the volume as host " << host << ": " << v.status().ToString());
    vols_[cur_] = std::move(v.value());
    auto st = vol()->Stats();
    REQUIRE(st.ok());
    data_blocks_ = st->data_blocks;
  }

  void CloseAll() {
    for (auto& [fid, m] : files_) m.f.reset();
  }

  void OpenAll() {
    for (auto& [fid, m] : files_) {
      auto f = vol()->OpenFile(m.name);
      if (!f.ok()) MFAIL("reopening '" << m.name << "': " << f.status().ToString());
      m.f = std::move(f.value());
    }
  }

  void CreateFile(uint64_t size) {
    int fid = next_fid_++;
    std::string name = "f" + std::to_string(fid);
    desc_ += "create " + name + " size=" + std::to_string(size);
    auto id = vol()->Create(name, size);
    if (!id.ok()) MFAIL("create " << name << ": " << id.status().ToString());
    auto f = vol()->OpenFile(name);
    if (!f.ok()) MFAIL("open " << name << ": " << f.status().ToString());
    MFile& m = files_[fid];
    m.fid = fid;
    m.name = name;
    m.size = size;
    uint64_t nb = (size + kB - 1) / kB;
    m.data.assign(nb * kB, 0);
    m.cls.assign(nb, -1);
    m.f = std::move(f.value());
    Touch(m, 0, size);
  }

  // ------------------------------------------------------------------- ops

  void OneOp() {
    uint64_t r = U(0, 999);
    if (r < 300) return OpWrite();
    if (r < 380) return OpTrim();
    if (r < 490) return OpClone();
    if (r < 620) return OpShare();
    if (r < 680) return OpPunch();
    if (r < 740) return OpTruncate();
    if (r < 775) return files_.size() < kMaxFiles ? OpCreate() : OpWrite();
    if (r < 800) return files_.size() > 2 ? OpRemove() : OpTruncate();
    if (r < 806) return OpReopen();
    if (r < 812) return OpSwitchHost();
    if (r < 860) return OpSync();
    if (r < 880) return OpSetDedup();
    if (r < 900) return OpDupBlock();
    if (r < 930) return OpWithGroupsHeld();
    return OpInvalid();
  }

  void Expect(const Status& st, const std::string& what) {
    if (!st.ok()) MFAIL(what << " failed: " << st.ToString());
  }

  void DoWrite(MFile& m, uint64_t off, const std::vector<uint8_t>& buf) {
    if (buf.empty()) return;
    Expect(m.f->Write(off, buf.data(), buf.size()), "write");
    for (uint64_t i = off / kB; i <= (off + buf.size() - 1) / kB; i++) WriteEffect(m, i);
    std::memcpy(m.data.data() + off, buf.data(), buf.size());
    Touch(m, off, off + buf.size());
  }

  void OpWrite() {
    MFile& m = PickFile();
    if (m.size == 0) return OpTruncateOf(m, U(1, kMaxFileBytes));
    uint64_t full = m.size / kB;  // whole blocks inside the file
    uint64_t shape = U(0, 99);
    uint64_t off, len;
    if (shape < 35 || full == 0) {
      off = P(0.2) ? (m.size - 1) / kB * kB + U(0, (m.size - 1) % kB) : U(0, m.size - 1);
      len = U(1, std::min<uint64_t>(3 * kB, m.size - off));
      desc_ = "write small";
    } else if (shape < 70) {
      uint64_t b = Idx(full);
      uint64_t n = U(1, std::min<uint64_t>(8, full - b));
      off = b * kB;
      len = n * kB;
      desc_ = "write aligned";
    } else {
      len = U(1, std::min<uint64_t>(kMaxWrite, m.size));
      off = U(0, m.size - len);
      if (P(0.5) && full > 0) {
        off = off / kB * kB;
        len = std::max<uint64_t>(kB, len / kB * kB);
        if (off + len > full * kB) off = full * kB - std::min(len, full * kB);
        len = std::min(len, full * kB - off);
      }
      desc_ = "write large";
    }
    std::string kind;
    std::vector<uint8_t> buf = Content(off, len, &kind);
    desc_ += " " + m.name + " off=" + std::to_string(off) + " len=" + std::to_string(len) + " " +
             kind;
    DoWrite(m, off, buf);
  }

  // Whole-block write that copies another block's content (any file): a
  // compare_and_share candidate.
  void OpDupBlock() {
    PosKey src;
    MFile& d = PickFile();
    if (d.size / kB == 0 || !PickMapped(&src)) return OpWrite();
    uint64_t di = Idx(d.size / kB);
    MFile& s = files_.at(src.first);
    std::vector<uint8_t> buf(Blk(s, src.second), Blk(s, src.second) + kB);
    desc_ = "dup-write " + s.name + "[" + std::to_string(src.second) + "] content to " + d.name +
            "[" + std::to_string(di) + "]";
    DoWrite(d, di * kB, buf);
    candidates_.push_back({src, {d.fid, di}});
    if (candidates_.size() > 64) candidates_.erase(candidates_.begin());
  }

  void OpTrim() {
    MFile& m = PickFile();
    if (m.size == 0) return OpWrite();
    uint64_t off, len;
    if (P(0.5) && m.size / kB > 0) {
      uint64_t full = m.size / kB;
      uint64_t b = U(0, full - 1);
      uint64_t n = U(1, std::min<uint64_t>(80, full - b));
      off = b * kB;
      len = n * kB;
      desc_ = "trim aligned";
    } else {
      off = U(0, m.size);
      len = U(0, std::min<uint64_t>(kMaxWrite, m.size - off));
      desc_ = "trim unaligned";
    }
    desc_ += " " + m.name + " off=" + std::to_string(off) + " len=" + std::to_string(len);
    Expect(m.f->Trim(off, len), "trim");
    Touch(m, off, off + len);
    if (len == 0) return;
    uint64_t first_full = (off + kB - 1) / kB, end_full = (off + len) / kB;
    std::vector<uint64_t> edges;
    if (off % kB != 0) edges.push_back(off / kB);
    if ((off + len) % kB != 0 && (edges.empty() || (off + len - 1) / kB != edges[0])) {
      edges.push_back((off + len - 1) / kB);
    }
    for (uint64_t e : edges) {
      if (m.cls[e] >= 0) {
        WriteEffect(m, e);
      } else {
        // Zeroing part of a hole may or may not allocate a (zero) block;
        // both read back as zeros. Follow the volume and let the refcount
        // and free-space checks hold it to whichever it chose.
        auto rc = m.f->BlockRefCount(e);
        if (!rc.ok()) MFAIL("BlockRefCount: " << rc.status().ToString());
        if (rc.value() != 0) Fresh(m, e);
        touched_pos_.insert({m.fid, e});
      }
    }
    for (uint64_t i = first_full; i < end_full; i++) Leave(m, i);
    std::memset(m.data.data() + off, 0, len);
  }

  void OpClone() {
    MFile& s = PickFile();
    MFile& d = P(0.25) ? s : PickFile();
    if (s.nblocks() == 0 || d.nblocks() == 0) return OpWrite();
    uint64_t si = Idx(s.nblocks());
    PosKey pk;
    if (P(0.6) && PickMapped(&pk) && pk.first == s.fid) si = pk.second;
    uint64_t di = Idx(d.nblocks());
    desc_ = "clone " + s.name + "[" + std::to_string(si) + "] -> " + d.name + "[" +
            std::to_string(di) + "]";
    Status st = vol()->CloneBlock(s.f.get(), si, d.f.get(), di);
    touched_pos_.insert({s.fid, si});
    touched_pos_.insert({d.fid, di});
    Touch(d, di * kB, std::min(d.size, (di + 1) * kB));
    Touch(s, si * kB, std::min(s.size, (si + 1) * kB));
    if (!Whole(s, si) || !Whole(d, di)) {
      // A partial last block can neither be cloned nor be cloned over.
      desc_ += " (partial block: expect kInvalid)";
      if (st.code() != Status::Code::kInvalid) {
        MFAIL("clone_block of a partial last block should be kInvalid, got "
              << (st.ok() ? std::string("OK") : st.ToString()));
      }
      return;
    }
    if (!s.dedup || !d.dedup) {
      // A file set dedup=off is never a party to a clone or a share.
      desc_ += " (dedup=off: expect kMismatch)";
      if (st.code() != Status::Code::kMismatch) {
        MFAIL("clone_block with a dedup=off file should be kMismatch, got "
              << (st.ok() ? std::string("OK") : st.ToString()));
      }
      return;
    }
    Expect(st, "clone_block");
    if (s.cls[si] < 0) {
      Leave(d, di);
      std::memset(Blk(d, di), 0, kB);
    } else if (s.cls[si] != d.cls[di]) {
      affected_.insert(s.cls[si]);
      Join(d, di, s.cls[si]);
      std::vector<uint8_t> tmp(Blk(s, si), Blk(s, si) + kB);
      std::memcpy(Blk(d, di), tmp.data(), kB);
    }
  }

  void OpShare() {
    PosKey a{-1, 0}, b{-1, 0};
    uint64_t how = U(0, 99);
    if (how < 45 && !candidates_.empty()) {
      auto c = candidates_[U(0, candidates_.size() - 1)];
      a = c.first;
      b = c.second;
      if (P(0.5)) std::swap(a, b);
      desc_ = "share (dup candidate)";
    } else if (how < 80 && PickMapped(&a)) {
      // Look for a block with equal content among random mapped positions.
      desc_ = "share (random mapped)";
      PosKey best{-1, 0};
      for (int t = 0; t < 200; t++) {
        PosKey o;
        if (!PickMapped(&o)) break;
        if (o == a) continue;
        if (best.first < 0) best = o;
        if (std::memcmp(Blk(files_.at(a.first), a.second), Blk(files_.at(o.first), o.second),
                        kB) == 0) {
          best = o;
          desc_ = "share (random equal)";
          break;
        }
      }
      if (best.first < 0) return OpWrite();
      b = best;
    } else {
      MFile& x = PickFile();
      MFile& y = PickFile();
      if (x.nblocks() == 0 || y.nblocks() == 0) return OpWrite();
      a = {x.fid, Idx(x.nblocks())};
      b = {y.fid, Idx(y.nblocks())};
      desc_ = "share (random any)";
    }
    // Candidates go stale when files shrink or go away.
    if (!files_.count(a.first) || !files_.count(b.first)) return OpWrite();
    MFile& s = files_.at(a.first);
    MFile& d = files_.at(b.first);
    if (a.second >= s.nblocks() || b.second >= d.nblocks()) return OpWrite();
    uint64_t si = a.second, di = b.second;
    bool whole = Whole(s, si) && Whole(d, di);
    bool expect_ok = whole && s.dedup && d.dedup && s.cls[si] >= 0 && d.cls[di] >= 0 &&
                     (s.cls[si] == d.cls[di] || std::memcmp(Blk(s, si), Blk(d, di), kB) == 0);
    Status::Code expect_code = whole ? Status::Code::kMismatch : Status::Code::kInvalid;
    desc_ += " " + s.name + "[" + std::to_string(si) + "] -> " + d.name + "[" +
             std::to_string(di) + "] expect " +
             (expect_ok ? "OK" : whole ? "kMismatch" : "kInvalid (partial block)");
    Status st = vol()->CompareAndShare(s.f.get(), si, d.f.get(), di, VerifyMode::kByteCompare);
    touched_pos_.insert({s.fid, si});
    touched_pos_.insert({d.fid, di});
    if (s.cls[si] >= 0) affected_.insert(s.cls[si]);
    if (d.cls[di] >= 0) affected_.insert(d.cls[di]);
    Touch(s, si * kB, std::min(s.size, (si + 1) * kB));
    Touch(d, di * kB, std::min(d.size, (di + 1) * kB));
    if (expect_ok) {
      if (!st.ok()) MFAIL("compare_and_share should succeed: " << st.ToString());
      if (s.cls[si] != d.cls[di]) Join(d, di, s.cls[si]);
    } else {
      if (st.code() != expect_code) {
        MFAIL("compare_and_share should return "
              << (whole ? "kMismatch" : "kInvalid") << ", got "
              << (st.ok() ? std::string("OK") : st.ToString()));
      }
    }
  }

  void OpPunch() {
    MFile& m = PickFile();
    if (m.nblocks() == 0) return OpWrite();
    uint64_t i = Idx(m.nblocks());
    PosKey pk;
    if (P(0.5) && PickMapped(&pk) && pk.first == m.fid) i = pk.second;
    desc_ = "punch " + m.name + "[" + std::to_string(i) + "]";
    Expect(m.f->Punch(i), "punch");
    Leave(m, i);
    std::memset(Blk(m, i), 0, kB);
    Touch(m, i * kB, std::min(m.size, (i + 1) * kB));
  }

  void OpTruncate() {
    MFile& m = PickFile();
    uint64_t r = U(0, 99);
    uint64_t size;
    if (r < 10) {
      size = 0;
    } else if (r < 45) {
      size = U(0, m.size);  // shrink
    } else if (r < 60) {
      size = U(0, m.size) / kB * kB;
    } else {
      size = U(m.size, kMaxFileBytes);  // grow
      if (P(0.3)) size = size / kB * kB;
    }
    OpTruncateOf(m, size);
  }

  void OpTruncateOf(MFile& m, uint64_t size) {
    desc_ += (desc_.empty() ? "" : " -> ") + std::string("truncate ") + m.name + " " +
             std::to_string(m.size) + " -> " + std::to_string(size);
    Expect(m.f->Truncate(size), "truncate");
    uint64_t old = m.size;
    uint64_t nb = (size + kB - 1) / kB;
    // A grow exposes the bytes past the old end in the block it ended in
    // (what a shrink left there, or what a cloned block carried past EOF):
    // they must read as zeros. An already-zero tail is left alone, sharing
    // included; otherwise it is zeroed, copied first if the block is
    // shared. A shrink leaves them as they are (the volume zeroes them at
    // the next grow, not before the cut's commit: a shrink that failed
    // would have left zeroed bytes inside the file).
    const uint64_t edge = old;
    if (size > old && edge % kB != 0 && m.cls[edge / kB] >= 0) {
      uint8_t* tail = Blk(m, edge / kB) + edge % kB;
      size_t n = kB - edge % kB;
      if (!std::all_of(tail, tail + n, [](uint8_t c) { return c == 0; })) {
        WriteEffect(m, edge / kB);
        std::memset(tail, 0, n);
      }
      touched_pos_.insert({m.fid, edge / kB});
    }
    for (uint64_t i = nb; i < m.nblocks(); i++) Leave(m, i);
    m.size = size;
    m.cls.resize(nb, -1);
    m.data.resize(nb * kB, 0);
    touched_files_.insert(m.fid);
    uint64_t lo = std::min(old, size);
    Touch(m, lo >= kB ? lo - kB : 0, std::max(old, size));
  }

  void OpCreate() {
    uint64_t r = U(0, 99);
    uint64_t size = r < 10 ? 0 : r < 30 ? U(1, 64) * kB : U(1, kMaxFileBytes);
    CreateFile(size);
  }

  void OpRemove() {
    MFile& m = PickFile();
    desc_ = "rm " + m.name;
    // An open file cannot be removed.
    Status busy = vol()->Remove(m.name);
    if (busy.code() != Status::Code::kLocked) {
      MFAIL("remove of an open file should be kLocked, got "
           << (busy.ok() ? std::string("OK") : busy.ToString()));
    }
    m.f.reset();
    Expect(vol()->Remove(m.name), "remove");
    for (uint64_t i = 0; i < m.nblocks(); i++) Leave(m, i);
    auto lk = vol()->Lookup(m.name);
    if (lk.status().code() != Status::Code::kNotFound) {
      MFAIL("lookup after remove: " << (lk.ok() ? std::string("found") : lk.status().ToString()));
    }
    int fid = m.fid;
    // Positions of a removed file are not checked any more.
    for (auto it = touched_pos_.begin(); it != touched_pos_.end();) {
      it = it->first == fid ? touched_pos_.erase(it) : std::next(it);
    }
    for (auto it = candidates_.begin(); it != candidates_.end();) {
      it = (it->first.first == fid || it->second.first == fid) ? candidates_.erase(it)
                                                                : std::next(it);
    }
    files_.erase(fid);
  }

  void OpSwitchHost() {
    desc_ = "switch from host " + std::to_string(vol()->host_id());
    CloseAll();
    cur_ = 1 - cur_;
    desc_ += " to host " + std::to_string(vol()->host_id());
    OpenAll();
    for (auto& [fid, m] : files_) {
      touched_files_.insert(fid);
      touched_ranges_.push_back({fid, {0, m.size}});
    }
  }

  void OpReopen() {
    // Any slot but the other host's (0 = the first free one).
    uint32_t other = vols_[1 - cur_]->host_id();
    uint32_t host = 0;
    if (P(0.5)) {
      do host = static_cast<uint32_t>(U(1, 4)); while (host == other);
    }
    desc_ = "reopen host " + std::to_string(vol()->host_id()) + " as host " + std::to_string(host);
    CloseAll();
    vols_[cur_].reset();
    OpenVolume(host);
    OpenAll();
    auto list = vol()->List();
    if (!list.ok()) MFAIL("list: " << list.status().ToString());
    std::map<std::string, uint64_t> got, want;
    for (const auto& fi : list.value()) got[fi.name] = fi.size;
    for (const auto& [fid, m] : files_) want[m.name] = m.size;
    if (got != want) MFAIL("file list after reopen differs from the model");
    for (auto& [fid, m] : files_) touched_files_.insert(fid);
  }

  // Another host takes some allocation groups and never gives them back
  // while one operation that drops references runs: the operation must not
  // wait (it would time out after a minute) and its drops are deferred.
  // Then that host lets go (as a dead host's leases expire).
  void OpWithGroupsHeld() {
    const Superblock& sb = vol()->superblock();
    // Ask the active host to hand its cached groups back (it does at its
    // next flush point), then take a few.
    std::vector<LockId> wanted, held;
    for (uint32_t g = 0; g < sb.group_count; g++) {
      LockId w{LockKind::kWanted, (uint64_t{static_cast<uint16_t>(LockKind::kGroup)} << 40) | g};
      if (holder_locks_->Acquire(w, LockMode::kShared, false).ok()) wanted.push_back(w);
    }
    Expect(vol()->Sync(), "sync");
    for (const LockId& w : wanted) (void)holder_locks_->Release(w);
    // Each group with even odds (the files' blocks sit in a few of them),
    // but never all of them: a write that needs a new block must then wait
    // for one, which the holder here never gives (it would hand it back at
    // its next flush point), and the write fails after a minute.
    const uint32_t left_free = static_cast<uint32_t>(U(0, sb.group_count - 1));
    for (uint32_t k = 0; k < sb.group_count; k++) {
      LockId g{LockKind::kGroup, k};
      if (k != left_free && P(0.5) && holder_locks_->Acquire(g, LockMode::kExclusive, false).ok()) {
        held.push_back(g);
      }
    }
    auto before = vol()->Stats();
    REQUIRE(before.ok());
    const uint64_t r = U(0, 99);
    if (r < 50) {
      OpWrite();
    } else if (r < 65) {
      OpTrim();
    } else if (r < 80) {
      OpPunch();
    } else if (r < 92) {
      OpTruncate();
    } else {
      files_.size() > 2 ? OpRemove() : OpTruncate();
    }
    desc_ = "with " + std::to_string(held.size()) + " groups held elsewhere: " + desc_;
    held_ops_++;
    auto after = vol()->Stats();
    REQUIRE(after.ok());
    if (after->pending_drops > before->pending_drops) drops_deferred_ops_++;
    for (const LockId& g : held) (void)holder_locks_->Release(g);
  }

  void OpSync() {
    desc_ = "sync";
    clock_.Advance(200'000'000);  // past the drain's retry interval
    if (P(0.5)) {
      Expect(vol()->Sync(), "sync");
    } else {
      Expect(PickFile().f->Flush(), "flush");
    }
  }

  void OpSetDedup() {
    MFile& m = PickFile();
    bool on = P(0.5);
    desc_ = "set " + m.name + " dedup=" + (on ? "on" : "off");
    Expect(m.f->SetDedup(on), "set dedup");
    m.dedup = on;
    touched_files_.insert(m.fid);
  }

  // Calls that must fail cleanly and change nothing.
  void OpInvalid() {
    MFile& m = PickFile();
    uint64_t r = U(0, 6);
    auto expect_code = [&](const Status& st, Status::Code code, const char* what) {
      if (st.code() != code) {
        MFAIL(what << ": expected code " << static_cast<int>(code) << ", got "
                  << (st.ok() ? std::string("OK") : st.ToString()));
      }
    };
    touched_files_.insert(m.fid);
    switch (r) {
      case 0: {
        desc_ = "invalid: read past EOF of " + m.name;
        std::vector<uint8_t> b(kB + 1);
        Status st = m.f->Read(m.size, b.data(), 1);
        expect_code(st, Status::Code::kInvalid, "read past EOF");
        if (m.size >= 10) {
          st = m.f->Read(m.size - 10, b.data(), 11);
          expect_code(st, Status::Code::kInvalid, "read across EOF");
        }
        break;
      }
      case 1: {
        desc_ = "invalid: write across EOF of " + m.name;
        uint64_t off = m.size >= kB ? m.size - kB + 1 : 0;
        std::vector<uint8_t> b(kB, 0xAB);
        expect_code(m.f->Write(off, b.data(), b.size()), Status::Code::kInvalid,
                    "write across EOF");
        Touch(m, off, m.size);
        break;
      }
      case 2: {
        desc_ = "invalid: punch past EOF of " + m.name;
        expect_code(m.f->Punch(m.nblocks()), Status::Code::kInvalid, "punch past EOF");
        break;
      }
      case 3: {
        MFile& s = PickFile();
        if (s.nblocks() == 0) break;
        desc_ = "invalid: clone into " + m.name + " past EOF";
        expect_code(vol()->CloneBlock(s.f.get(), 0, m.f.get(), m.nblocks()),
                    Status::Code::kInvalid, "clone past EOF");
        break;
      }
      case 4: {
        desc_ = "invalid: open " + m.name + " twice";
        auto f2 = vol()->OpenFile(m.name);
        expect_code(f2.status(), Status::Code::kLocked, "second open");
        break;
      }
      case 5: {
        desc_ = "invalid: create existing " + m.name;
        expect_code(vol()->Create(m.name, 1).status(), Status::Code::kExists, "create existing");
        break;
      }
      case 6: {
        MFile& s = PickFile();
        if (s.nblocks() == 0) break;
        desc_ = "invalid: share past EOF of " + m.name;
        expect_code(vol()->CompareAndShare(s.f.get(), 0, m.f.get(), m.nblocks(),
                                          VerifyMode::kByteCompare),
                    Status::Code::kInvalid, "share past EOF");
        break;
      }
    }
  }

  // -------------------------------------------------------------- checking

  void CheckBytes(MFile& m, uint64_t lo, uint64_t hi) {
    hi = std::min(hi, m.size);
    if (lo >= hi) return;
    // One buffer for all reads: fresh multi-MiB allocations per step cost
    // more than the checks (page faults, especially under ASan).
    if (rbuf_.size() < kMaxFileBytes) rbuf_.assign(kMaxFileBytes, 0);
    uint8_t* got = rbuf_.data();
    Status st = m.f->Read(lo, got, hi - lo);
    if (!st.ok()) MFAIL("read " << m.name << " [" << lo << "," << hi << "): " << st.ToString());
    if (std::memcmp(got, m.data.data() + lo, hi - lo) != 0) {
      uint64_t i = 0;
      while (got[i] == m.data[lo + i]) i++;
      MFAIL("content of " << m.name << " differs from the model at byte " << lo + i << " (block "
                         << (lo + i) / kB << " +" << (lo + i) % kB << "): got "
                         << int(got[i]) << " expected " << int(m.data[lo + i])
                         << "; block is " << (m.cls[(lo + i) / kB] < 0 ? "a hole" : "mapped")
                         << " in the model, file size " << m.size);
    }
  }

  void CheckPos(const PosKey& p) {
    MFile& m = files_.at(p.first);
    if (p.second >= m.nblocks()) return;
    int64_t c = m.cls[p.second];
    uint32_t want = c < 0 ? 0 : static_cast<uint32_t>(classes_.at(c).size());
    auto rc = m.f->BlockRefCount(p.second);
    if (!rc.ok()) MFAIL("BlockRefCount " << m.name << "[" << p.second << "]: " << rc.status().ToString());
    // A deferred drop still counts until its host applies it.
    const bool within_pending = c >= 0 && rc.value() > want && rc.value() - want <= pending_drops_;
    if (rc.value() != want && !within_pending) {
      MFAIL("refcount of " << m.name << "[" << p.second << "] is " << rc.value() << ", model says "
                          << want << (c < 0 ? " (hole)" : " (sharers in the model)"));
    }
  }

  void CheckInfo(MFile& m) {
    auto fi = m.f->Info();
    if (!fi.ok()) MFAIL("info " << m.name << ": " << fi.status().ToString());
    if (fi->size != m.size) MFAIL("size of " << m.name << " is " << fi->size << ", model " << m.size);
    if (fi->mapped_blocks != m.mapped()) {
      MFAIL("mapped_blocks of " << m.name << " is " << fi->mapped_blocks << ", model "
                               << m.mapped());
    }
    if (fi->dedup != m.dedup) MFAIL("dedup flag of " << m.name << " differs from the model");
    if (m.f->size() != m.size) MFAIL("File::size() of " << m.name << " differs from Info");
  }

  void CheckSpace() {
    auto st = vol()->Stats();
    if (!st.ok()) MFAIL("stats: " << st.status().ToString());
    uint64_t distinct = classes_.size();
    uint64_t shared = 0, logical = 0;
    for (const auto& [c, mem] : classes_) shared += mem.size() > 1;
    for (const auto& [fid, m] : files_) logical += m.mapped();
    if (st->data_blocks != data_blocks_) MFAIL("data_blocks changed");
    // Deferred drops keep their blocks counted (and maybe shared) until
    // applied: then used and shared may exceed the model by at most that.
    pending_drops_ = st->pending_drops;
    const uint64_t slack = pending_drops_;
    if (st->free_blocks + st->used_blocks != st->data_blocks) {
      MFAIL("stats: free " << st->free_blocks << " + used " << st->used_blocks
                          << " != data blocks " << st->data_blocks);
    }
    if (st->used_blocks < distinct + st->pointer_blocks ||
        st->used_blocks > distinct + st->pointer_blocks + slack) {
      MFAIL("stats: used blocks " << st->used_blocks << " != distinct data blocks in the model "
                                 << distinct << " + pointer blocks " << st->pointer_blocks
                                 << " (difference " << int64_t(st->used_blocks) -
                                        int64_t(distinct + st->pointer_blocks)
                                 << ")");
    }
    if (st->shared_blocks < shared || st->shared_blocks > shared + slack) {
      MFAIL("stats: shared blocks " << st->shared_blocks << ", model " << shared);
    }
    if (st->logical_blocks != logical) {
      MFAIL("stats: logical blocks " << st->logical_blocks << ", model " << logical);
    }
    if (st->files != files_.size()) MFAIL("stats: files " << st->files << ", model " << files_.size());
  }

  void Verify() {
    CheckSpace();  // first: it reads the pending drops the checks allow for
    for (int fid : touched_files_) {
      if (files_.count(fid)) CheckInfo(files_.at(fid));
    }
    for (auto& [fid, range] : touched_ranges_) {
      if (!files_.count(fid)) continue;
      MFile& m = files_.at(fid);
      uint64_t lo = range.first / kB * kB;
      lo = lo >= kB ? lo - kB : 0;
      uint64_t hi = (range.second + 2 * kB - 1) / kB * kB;
      CheckBytes(m, lo, hi);
    }
    for (const PosKey& p : touched_pos_) {
      if (files_.count(p.first)) CheckPos(p);
    }
    for (int64_t c : affected_) {
      auto it = classes_.find(c);
      if (it == classes_.end()) continue;
      for (const PosKey& p : it->second) CheckPos(p);
    }
    touched_files_.clear();
    touched_ranges_.clear();
    touched_pos_.clear();
    affected_.clear();
  }

  void VerifyAll() {
    CheckSpace();
    for (auto& [fid, m] : files_) {
      CheckInfo(m);
      CheckBytes(m, 0, m.size);
      uint64_t shared = 0, unique = 0;
      for (uint64_t i = 0; i < m.nblocks(); i++) {
        CheckPos({fid, i});
        if (m.cls[i] >= 0) (classes_.at(m.cls[i]).size() > 1 ? shared : unique)++;
      }
      auto u = m.f->Usage();
      if (!u.ok()) MFAIL("usage " << m.name << ": " << u.status().ToString());
      // Shared and unique come from the counts, which pending drops inflate.
      if (u->mapped_blocks != m.mapped() ||
          (pending_drops_ == 0 && (u->shared_blocks != shared || u->unique_blocks != unique))) {
        MFAIL("usage of " << m.name << ": mapped/shared/unique " << u->mapped_blocks << "/"
                         << u->shared_blocks << "/" << u->unique_blocks << ", model "
                         << m.mapped() << "/" << shared << "/" << unique);
      }
    }
    CheckSpace();
  }

  void Fsck(bool* missing_reported) {
    // fsck wants the volume to itself: close the files, check, reopen.
    CloseAll();
    auto rep = CheckVolume(vol(), false);
    if (!rep.ok()) {
      if (rep.status().code() == Status::Code::kUnsupported) {
        if (!*missing_reported) {
          FAIL_CHECK("CheckVolume is not implemented yet (kUnsupported: "
                     << rep.status().ToString()
                     << "); this property test requires a clean fsck report");
          *missing_reported = true;
        }
      } else {
        MFAIL("CheckVolume failed: " << rep.status().ToString());
      }
    } else if (!rep->clean()) {
      std::ostringstream os;
      for (const auto& p : rep->problems) os << "\n  " << p.where << ": " << p.what;
      MFAIL("fsck found " << rep->problems.size() << " problem(s):" << os.str());
    }
    OpenAll();
    CheckSpace();
  }

  uint64_t seed_;
  std::mt19937_64 rng_;
  std::unique_ptr<MemDevice> mem_;
  BlockDevice* device_ = nullptr;
  std::shared_ptr<LockManager> host_locks_[2];
  std::shared_ptr<LockManager> holder_locks_;  // the host that holds groups
  ManualClock clock_;
  uint64_t pending_drops_ = 0;  // as of the last CheckSpace
  uint64_t held_ops_ = 0;
  uint64_t drops_deferred_ops_ = 0;
  std::unique_ptr<Volume> vols_[2];
  int cur_ = 0;
  uint64_t data_blocks_ = 0;
  uint64_t step_ = 0;
  std::string desc_;
  std::map<std::string, int> counts_;
  std::vector<uint8_t> rbuf_;
  const bool trace_ = std::getenv("DEDE_TRACE") != nullptr;
  std::vector<std::vector<uint8_t>> patterns_;

  std::map<int, MFile> files_;
  std::map<int64_t, std::set<PosKey>> classes_;
  int64_t next_class_ = 1;
  int next_fid_ = 1;
  std::vector<std::pair<PosKey, PosKey>> candidates_;

  std::set<int> touched_files_;
  std::vector<std::pair<int, std::pair<uint64_t, uint64_t>>> touched_ranges_;
  std::set<PosKey> touched_pos_;
  std::set<int64_t> affected_;
};

}  // namespace
