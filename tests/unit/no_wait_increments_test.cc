// Increments without waiting (issue 5, docs/LOCKING.md "Increments
// without waiting"): a share or clone adds a reference to its source
// block, whose count lives in the block's allocation group. When another
// host holds that group, Volume::ApplyBlockOps with no_wait holds the
// operation back (kLocked, nothing changed) instead of waiting for the
// holder, and announces the wait so the holder hands the group over at its
// next flush point. A dedup pass parks the records held back in their
// shard's pending file; a later pass completes them. Merge-request
// application keeps a request file whose share was held back.
//
// Two Volume objects on one MemDevice, with lock managers on one lock file,
// play two hosts. Host 2 holds the group and never flushes on its own (a
// single-threaded test): a waiting host 1 would wait the whole lock wait
// (60 s, left at its default on purpose) and then fail.
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "agent/dedup_pass.h"
#include "index/shard_format.h"
#include "kmod/writemon/write_log.h"
#include "kmod/writemon/write_monitor.h"
#include "merge/merge_request.h"
#include "tests/dedup_accounting.h"
#include "tests/fsck_problems.h"
#include "tests/pending_records.h"
#include "volume/fsck.h"
#include "volume/lock_manager.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;

namespace {

constexpr uint64_t kB = kBlockSize;
using Op = Volume::BlockOp;
using Kind = Volume::BlockOp::Kind;
using Code = Status::Code;

LockId WantedGroup(uint64_t g) {
  return LockId{LockKind::kWanted, (uint64_t{static_cast<uint16_t>(LockKind::kGroup)} << 40) | g};
}

// A pseudo-random block per id.
std::vector<uint8_t> Content(uint64_t id) {
  std::vector<uint8_t> out(kB);
  uint64_t x = (id + 1) * 0x9e3779b97f4a7c15ULL;
  for (size_t i = 0; i < kB; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(out.data() + i, &x, 8);
  }
  return out;
}

std::vector<uint8_t> ReadBlock(File* f, uint64_t block) {
  std::vector<uint8_t> out(kB);
  REQUIRE(f->Read(block * kB, out.data(), kB).ok());
  return out;
}

uint32_t Refs(File* f, uint64_t block) {
  Result<uint32_t> r = f->BlockRefCount(block);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  return r.value();
}

void RequireFsckClean(Volume* vol) {
  const std::string problems = test::FsckProblems(vol);
  INFO("fsck: " << problems);
  REQUIRE(problems.empty());
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// LooksBusy: a group found held elsewhere is not tried again for 100 ms.
void PastBusyMemo() {
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
}

// Two hosts and an observer (a third lock manager on the same lock file,
// to see announcements). Groups of 4 MiB: host 1 allocates from group 0
// up, host 2 from group 1 up (its share of the groups starts there).
struct Hosts {
  MemDevice dev{64ull << 20};
  std::string lock_path;
  std::shared_ptr<LockManager> lm1, lm2, observer;
  std::unique_ptr<Volume> v1, v2;

  // `drop_blocks`: FormatOptions' (-1: automatic).
  explicit Hosts(int64_t drop_blocks = -1) {
    FormatOptions fo;
    fo.group_refblocks = 1;
    fo.drop_blocks = drop_blocks;
    REQUIRE(FormatVolume(&dev, fo, false).ok());
    lock_path = "/tmp/dede-nowait-" + std::to_string(getpid()) + "-" + std::to_string(rand());
    lm1 = NewLocks();
    lm2 = NewLocks();
    observer = NewLocks();
    v1 = Open(1, lm1);
    v2 = Open(2, lm2);
    REQUIRE(v1->superblock().group_count >= 4);
  }
  ~Hosts() { ::unlink(lock_path.c_str()); }

  // The test's end: with every file handle closed, host 2 goes away and
  // fsck, run by host 1 alone, finds the volume clean.
  void FinishOnHost1() {
    v2.reset();
    RequireFsckClean(v1.get());
  }

  std::shared_ptr<LockManager> NewLocks() {
    auto lm = OpenLocalLockManager(lock_path);
    REQUIRE(lm.ok());
    return std::shared_ptr<LockManager>(std::move(lm.value()));
  }
  std::unique_ptr<Volume> Open(uint32_t host, std::shared_ptr<LockManager> lm) {
    OpenOptions oo;
    oo.host_id = host;
    oo.locks = std::move(lm);
    oo.lock_wait_s = 60;  // a wait would be seen, not cut short
    auto v = Volume::Open(&dev, oo);
    INFO("open as host " << host << ": " << v.status().ToString());
    REQUIRE(v.ok());
    return std::move(v.value());
  }

  // Creates `name` on `vol` with one block per content id and closes it
  // (closing hands the volume's cached group locks back).
  static void Make(Volume* vol, const std::string& name, const std::vector<uint64_t>& contents,
                   WriteMonitor* monitor = nullptr) {
    auto id = vol->Create(name, contents.size() * kB);
    REQUIRE(id.ok());
    auto f = vol->OpenFile(name);
    REQUIRE(f.ok());
    if (monitor != nullptr) monitor->AddFile(*id, true);
    for (size_t b = 0; b < contents.size(); b++) {
      const std::vector<uint8_t> c = Content(contents[b]);
      REQUIRE((*f)->Write(b * kB, c.data(), kB).ok());
      if (monitor != nullptr) monitor->OnWrite(*id, b * kB, c.data(), kB);
    }
    REQUIRE((*f)->Flush().ok());
    if (monitor != nullptr) {
      REQUIRE(AppendToWriteLog(vol, monitor->Take(*id)).ok());
      REQUIRE(vol->Sync().ok());
    }
  }

  // Host 2 writes (and logs) "x" and "y", `blocks` blocks each, closed:
  // their blocks are in group 1, and they share content 1000 at x:3 and
  // y:5 (content 100 + b and 200 + b elsewhere).
  void Host2MakesXAndY(uint64_t blocks, WriteMonitor* monitor) {
    std::vector<uint64_t> xs, ys;
    for (uint64_t b = 0; b < blocks; b++) {
      xs.push_back(b == 3 ? 1000 : 100 + b);
      ys.push_back(b == 5 ? 1000 : 200 + b);
    }
    Make(v2.get(), "x", xs, monitor);
    Make(v2.get(), "y", ys, monitor);
  }

  // Host 2 writes a file of its own and keeps it open: it holds the group
  // it allocated from (group 1) until a flush point where someone waits.
  std::unique_ptr<File> Host2TakesItsGroup() {
    auto id = v2->Create("h", kB);
    REQUIRE(id.ok());
    auto f = v2->OpenFile("h");
    REQUIRE(f.ok());
    const std::vector<uint8_t> c = Content(999);
    REQUIRE((*f)->Write(0, c.data(), kB).ok());
    return std::move(*f);
  }

  bool Announced(uint64_t g) {
    auto held = observer->IsHeldElsewhere(WantedGroup(g));
    REQUIRE(held.ok());
    return *held;
  }

  // With drop_blocks 1 (kDropsPerBlock entries): fills host 1's drop list
  // until `room` entries are left, with drops in group 0, which the
  // observer then holds (as another host would): host 1 can drain none of
  // them without waiting. "fill-c" (host 1's, group 0) and "fill-d", whose
  // blocks first share c's and are then overwritten, each overwrite
  // deferring a drop of c's block. Files made by host 1 from now on go to
  // other groups.
  void FillDropList(uint64_t room) {
    const uint64_t fill = kDropsPerBlock - room;
    std::vector<uint64_t> contents;
    for (uint64_t b = 0; b < fill; b++) contents.push_back(100000 + b);
    Make(v1.get(), "fill-c", contents);
    REQUIRE(v1->Create("fill-d", fill * kB).ok());
    {
      auto c = v1->OpenFile("fill-c");
      auto d = v1->OpenFile("fill-d");
      REQUIRE(c.ok());
      REQUIRE(d.ok());
      for (uint64_t b = 0; b < fill; b++) {
        REQUIRE(v1->CloneBlock(c->get(), b, d->get(), b).ok());
      }
    }
    REQUIRE(v1->Sync().ok());
    const uint64_t groups = v1->superblock().group_count;
    for (uint64_t g = 0; g < groups; g++) {
      REQUIRE(observer->Acquire(WantedGroup(g), LockMode::kShared, false).ok());
    }
    REQUIRE(v1->Sync().ok());
    for (uint64_t g = 0; g < groups; g++) REQUIRE(observer->Release(WantedGroup(g)).ok());
    REQUIRE(observer->Acquire(kGroup0, LockMode::kExclusive, false).ok());
    {
      auto d = v1->OpenFile("fill-d");
      REQUIRE(d.ok());
      for (uint64_t b = 0; b < fill; b++) {
        const std::vector<uint8_t> y = Content(200000 + b);
        Status w = (*d)->Write(b * kB, y.data(), kB);
        INFO("filling the drop list, block " << b << ": " << w.ToString());
        REQUIRE(w.ok());
      }
      REQUIRE((*d)->Flush().ok());
    }
    auto st = v1->Stats();
    REQUIRE(st.ok());
    REQUIRE(st->pending_drops == fill);
  }
  // The observer lets group 0 go; host 1's next flush points drain the list.
  void ReleaseGroup0() {
    REQUIRE(observer->Release(kGroup0).ok());
    PastBusyMemo();
    for (int i = 0; i < 50; i++) {
      REQUIRE(v1->Sync().ok());
      if (v1->drop_counters().pending == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    REQUIRE(v1->drop_counters().pending == 0);
  }
  static constexpr LockId kGroup0{LockKind::kGroup, 0};
};

// One dedup pass on `vol`, lending it the volume's own files; *seconds is
// how long it took.
Result<DedupStats> TimedPass(Volume* vol, const DedupOptions& opts, double* seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  VolumeFileAccess access(vol);
  Result<DedupStats> st = RunDedupPass(vol, &access, opts);
  *seconds = Seconds(t0);
  return st;
}

std::unique_ptr<File> OpenOn(Volume* vol, const std::string& name) {
  auto f = vol->OpenFile(name);
  INFO("open " << name << ": " << f.status().ToString());
  REQUIRE(f.ok());
  return std::move(*f);
}

Op Share(File* src, uint64_t si, File* dst, uint64_t di) {
  Op op;
  op.kind = Kind::kShare;
  op.src = src;
  op.src_index = si;
  op.dst = dst;
  op.dst_index = di;
  return op;
}

}  // namespace

TEST_CASE("no-wait block ops hold back an operation whose group another host holds",
          "[volume][blockops][nowait]") {
  Hosts h;
  // "a" is written by host 2: its blocks are in group 1. "b" (same content
  // as a:0), "c" and "d" (one shared content) and "e" (a:0's content
  // again) by host 1, in group 0.
  Hosts::Make(h.v2.get(), "a", {1, 2});
  Hosts::Make(h.v1.get(), "b", {1});
  Hosts::Make(h.v1.get(), "c", {3});
  Hosts::Make(h.v1.get(), "d", {3});
  Hosts::Make(h.v1.get(), "e", {1});
  std::unique_ptr<File> hf = h.Host2TakesItsGroup();
  REQUIRE_FALSE(h.Announced(1));

  std::unique_ptr<File> a = OpenOn(h.v1.get(), "a");
  std::unique_ptr<File> b = OpenOn(h.v1.get(), "b");
  std::unique_ptr<File> c = OpenOn(h.v1.get(), "c");
  std::unique_ptr<File> d = OpenOn(h.v1.get(), "d");
  std::unique_ptr<File> e = OpenOn(h.v1.get(), "e");
  // 0: a:0 -> b:0 needs group 1 (host 2's). 1: c:0 -> d:0 needs group 0.
  // 2: e:0 -> b:0 needs only group 0 too, but it was planned on b:0 as
  // operation 0 would have left it (a:0's block): with 0 held back it must
  // be held back too (applied as planned, its pointer check would find b's
  // own block and poison the volume).
  std::vector<Op> ops = {Share(a.get(), 0, b.get(), 0), Share(c.get(), 0, d.get(), 0),
                         Share(e.get(), 0, b.get(), 0)};
  Volume::BlockOpsOptions no_wait;
  no_wait.no_wait = true;
  Volume::ReadBuffer buf;
  auto t0 = std::chrono::steady_clock::now();
  Status st = h.v1->ApplyBlockOps(&ops, VerifyMode::kByteCompare, &buf, no_wait);
  const double took = Seconds(t0);
  INFO("ApplyBlockOps: " << st.ToString() << " in " << took << " s");
  REQUIRE(st.ok());
  CHECK(took < 5.0);
  INFO("op 0: " << ops[0].result.ToString() << "; op 1: " << ops[1].result.ToString()
                << "; op 2: " << ops[2].result.ToString());
  CHECK(ops[0].result.code() == Code::kLocked);
  CHECK_FALSE(ops[0].changed);
  CHECK(ops[1].result.ok());
  CHECK(ops[1].changed);
  CHECK(ops[2].result.code() == Code::kLocked);
  CHECK_FALSE(ops[2].changed);
  // Nothing changed for the held-back operations: b and e keep their own
  // blocks (counts in group 0, which host 1 holds).
  CHECK(Refs(b.get(), 0) == 1);
  CHECK(Refs(e.get(), 0) == 1);
  CHECK(Refs(d.get(), 0) == 2);
  CHECK(ReadBlock(b.get(), 0) == Content(1));
  // Host 1 announced that it wants group 1.
  CHECK(h.Announced(1));
  REQUIRE(h.v1->Sync().ok());

  // Host 2's flush point hands the group over; host 1's retry applies
  // both and withdraws its announcement.
  REQUIRE(h.v2->Sync().ok());
  PastBusyMemo();
  std::vector<Op> again = {Share(a.get(), 0, b.get(), 0), Share(b.get(), 0, e.get(), 0)};
  t0 = std::chrono::steady_clock::now();
  st = h.v1->ApplyBlockOps(&again, VerifyMode::kByteCompare, &buf, no_wait);
  INFO("retry: " << st.ToString() << "; op 0: " << again[0].result.ToString()
                 << "; op 1: " << again[1].result.ToString());
  REQUIRE(st.ok());
  CHECK(Seconds(t0) < 5.0);
  CHECK(again[0].result.ok());
  CHECK(again[0].changed);
  CHECK(again[1].result.ok());
  CHECK(again[1].changed);
  CHECK_FALSE(h.Announced(1));
  CHECK(Refs(a.get(), 0) == 3);  // a, b, e
  CHECK(ReadBlock(b.get(), 0) == Content(1));
  CHECK(ReadBlock(e.get(), 0) == Content(1));
  REQUIRE(h.v1->Sync().ok());

  a.reset();
  b.reset();
  c.reset();
  d.reset();
  e.reset();
  hf.reset();
  h.FinishOnHost1();
  auto stats = h.v1->Stats();
  REQUIRE(stats.ok());
  CHECK(stats->shared_blocks == 2);  // a:0's block (3 refs), c:0's (2)
}

TEST_CASE("a dedup pass parks records whose group another host holds and a later pass shares them",
          "[dedup][nowait]") {
  Hosts h;
  WriteMonitorOptions mo;
  mo.algo = h.v1->superblock().hash_algo;
  WriteMonitor monitor(mo);
  // Both files written (and logged) by host 2, so their blocks are in
  // group 1; they share content 1000 at x:3 and y:5.
  // 32 blocks each: 63 entries, so one parked record is well below the
  // batching fraction (5%) and only the busy-parked hint gets it applied.
  constexpr uint64_t kFileBlocks = 32;
  h.Host2MakesXAndY(kFileBlocks, &monitor);
  std::unique_ptr<File> hf = h.Host2TakesItsGroup();

  auto physical = [&]() {
    auto stats = h.v1->Stats();
    REQUIRE(stats.ok());
    auto list = h.v1->List();
    REQUIRE(list.ok());
    return test::PhysicalDataBlocks(*stats, *list);
  };
  // (Counted from host 1 once host 2 has handed its groups back: host 2's
  // counts are in its journal until then.)
  const uint64_t exact = 2 * kFileBlocks - 1 + 1;  // distinct in x and y, and h's block

  DedupOptions opts;  // the default batching fraction
  std::set<uint64_t> busy_parked;
  opts.busy_parked_shards = &busy_parked;
  // Host 2 never reaches a flush point during these passes: revisits
  // within a pass would only wait (the next test has them).
  opts.busy_revisits = 0;
  DedupStats first;
  {
    VolumeFileAccess access(h.v1.get());
    const auto t0 = std::chrono::steady_clock::now();
    auto pass = RunDedupPass(h.v1.get(), &access, opts);
    const double took = Seconds(t0);
    INFO("pass: " << pass.status().ToString() << " in " << took << " s");
    REQUIRE(pass.ok());
    CHECK(took < 5.0);
    first = *pass;
  }
  CHECK(first.logs_consumed == 2);
  CHECK(first.records_parked_busy == 1);  // the second record of content 1000
  CHECK(first.shared_new == 0);
  CHECK(first.stale_records == 0);
  CHECK(first.stale_entries == 0);
  CHECK(first.unique_added == 2 * kFileBlocks - 1);
  CHECK(busy_parked.size() == 1);
  CHECK(h.Announced(1));

  // A pass while host 2 still holds the group: the parked record is taken
  // from the pending file, held back again, and parked again in a pending
  // file that outlives the retire of the one it came from.
  {
    VolumeFileAccess access(h.v1.get());
    const auto t0 = std::chrono::steady_clock::now();
    auto pass = RunDedupPass(h.v1.get(), &access, opts);
    INFO("pass: " << pass.status().ToString());
    REQUIRE(pass.ok());
    CHECK(Seconds(t0) < 5.0);
    CHECK(pass->pending_records_applied == 1);  // not deferred by the fraction
    CHECK(pass->shards_deferred == 0);
    CHECK(pass->records_parked_busy == 1);
    CHECK(pass->shared_new == 0);
    CHECK(pass->stale_records == 0);
    CHECK(pass->stale_entries == 0);
  }

  // Host 2's flush point hands group 1 over; the next pass (no new
  // records: only the parked one) completes the share.
  REQUIRE(h.v2->Sync().ok());
  PastBusyMemo();
  DedupStats second;
  {
    VolumeFileAccess access(h.v1.get());
    auto pass = RunDedupPass(h.v1.get(), &access, opts);
    INFO("pass: " << pass.status().ToString());
    REQUIRE(pass.ok());
    second = *pass;
  }
  CHECK(second.pending_records_applied == 1);
  CHECK(second.records_parked_busy == 0);
  CHECK(busy_parked.empty());
  CHECK(second.shared_new == 1);
  CHECK(second.stale_records == 0);
  auto stats = h.v1->Stats();
  REQUIRE(stats.ok());
  CHECK(stats->pending_drops == 0);  // the logs' blocks, dropped in group 1
  CHECK(physical() == exact);
  {
    auto x = OpenOn(h.v1.get(), "x");
    auto y = OpenOn(h.v1.get(), "y");
    CHECK(Refs(x.get(), 3) == 3);  // x, y, the arena
    CHECK(ReadBlock(x.get(), 3) == Content(1000));
    CHECK(ReadBlock(y.get(), 5) == Content(1000));
  }
  CHECK_FALSE(h.Announced(1));
  hf.reset();
  h.FinishOnHost1();
}

TEST_CASE(
    "a record of a file another host holds is parked with its busy group and gets a merge "
    "request once the entry is shared",
    "[dedup][nowait][merge]") {
  // Parked with the anchor's group busy, the records of files held
  // elsewhere used to be dropped (busy_targets): the holder's own passes
  // never see them again, so their blocks stayed unshared for good.
  Hosts h;
  WriteMonitorOptions mo;
  mo.algo = h.v1->superblock().hash_algo;
  WriteMonitor monitor(mo);
  constexpr uint64_t kFileBlocks = 32;
  h.Host2MakesXAndY(kFileBlocks, &monitor);
  // Host 2 also runs "q" (never logged), whose block 0 holds content
  // 1000; a record of it waits in its shard's pending file.
  Hosts::Make(h.v2.get(), "q", {1000, 301, 302});
  std::unique_ptr<File> q = OpenOn(h.v2.get(), "q");
  test::ParkPendingRecord(h.v2.get(), Content(1000).data(), q->id(), 0);
  std::unique_ptr<File> hf = h.Host2TakesItsGroup();

  DedupOptions opts;
  std::set<uint64_t> busy_parked;
  opts.busy_parked_shards = &busy_parked;
  opts.busy_revisits = 0;  // host 2 reaches no flush point during the pass
  {
    VolumeFileAccess access(h.v1.get());
    auto pass = RunDedupPass(h.v1.get(), &access, opts);
    INFO("pass: " << pass.status().ToString());
    REQUIRE(pass.ok());
    CHECK(pass->shared_new == 0);
    // y:5 (the anchor held back) and q:0 with it (before: dropped).
    CHECK(pass->records_parked_busy == 2);
    CHECK(pass->busy_targets == 0);
    CHECK(pass->merge_requests_posted == 0);
  }
  // Host 2 hands group 1 over; the next pass shares y:5 with x:3 through
  // the arena, and asks host 2 to share q:0.
  REQUIRE(h.v2->Sync().ok());
  PastBusyMemo();
  {
    VolumeFileAccess access(h.v1.get());
    auto pass = RunDedupPass(h.v1.get(), &access, opts);
    INFO("pass: " << pass.status().ToString());
    REQUIRE(pass.ok());
    CHECK(pass->shared_new == 1);
    CHECK(pass->records_parked_busy == 0);
    CHECK(pass->merge_requests_posted == 1);
  }
  auto applied = ApplyMergeRequests(h.v2.get(), q.get(), VerifyMode::kByteCompare);
  INFO(applied.status().ToString());
  REQUIRE(applied.ok());
  CHECK(applied->applied == 1);
  CHECK(ReadBlock(q.get(), 0) == Content(1000));
  auto refs = q->BlockRefCount(0);
  REQUIRE(refs.ok());
  CHECK(*refs == 4);  // x, y, q and the arena
  q.reset();
  hf.reset();
  h.FinishOnHost1();
}

TEST_CASE("merge-request application keeps requests whose group another host holds",
          "[merge][nowait]") {
  Hosts h;
  // The request's clone references a block of host 2's file "s" (group
  // 1); the target "t" is host 1's and holds the same content.
  Hosts::Make(h.v2.get(), "s", {7});
  Hosts::Make(h.v1.get(), "t", {7});
  std::unique_ptr<File> t = OpenOn(h.v1.get(), "t");
  {
    std::unique_ptr<File> s = OpenOn(h.v1.get(), "s");
    const std::vector<uint8_t> c = Content(7);
    const Fingerprint fp = ComputeFingerprint(h.v1->superblock().hash_algo, c.data(), kB);
    REQUIRE(PostMergeRequests(h.v1.get(), t->id(), {MergeRequest{0, fp, 0}}, s.get()).ok());
    REQUIRE(h.v1->Sync().ok());
  }
  // Closing "s" handed group 1 back; host 2 takes it again.
  std::unique_ptr<File> hf = h.Host2TakesItsGroup();
  auto has_requests = [&]() {
    auto list = h.v1->List();
    REQUIRE(list.ok());
    for (const FileInfo& fi : *list) {
      if (fi.name == MergeRequestFileName(t->id().ino)) return true;
    }
    return false;
  };
  REQUIRE(has_requests());

  auto t0 = std::chrono::steady_clock::now();
  auto first = ApplyMergeRequests(h.v1.get(), t.get(), VerifyMode::kByteCompare);
  INFO("apply: " << first.status().ToString() << " in " << Seconds(t0) << " s");
  REQUIRE(first.ok());
  CHECK(Seconds(t0) < 5.0);
  CHECK(first->busy == 1);
  CHECK(first->applied == 0);
  CHECK(first->failed_verification == 0);
  CHECK(Refs(t.get(), 0) == 1);  // t keeps its own block (group 0)
  CHECK(has_requests());         // kept for the next apply
  CHECK(h.Announced(1));

  REQUIRE(h.v2->Sync().ok());  // hands group 1 over
  PastBusyMemo();
  auto second = ApplyMergeRequests(h.v1.get(), t.get(), VerifyMode::kByteCompare);
  INFO("apply: " << second.status().ToString());
  REQUIRE(second.ok());
  CHECK(second->busy == 0);
  CHECK(second->applied == 1);
  CHECK(second->already_shared == 0);
  CHECK_FALSE(has_requests());
  CHECK(Refs(t.get(), 0) == 2);  // s and t (the request's clone went with its file)
  CHECK(ReadBlock(t.get(), 0) == Content(7));
  t.reset();
  hf.reset();
  h.FinishOnHost1();
}

TEST_CASE("a dedup pass gives a reader holding its shard's arena a moment instead of failing",
          "[dedup][nowait]") {
  // `dede stats`, fsck and every dedupd after its own pass (the volume's
  // figures for the pass history) open the arena and pending files for a
  // moment. A pass on another host that met such a reader used to fail at
  // once ("file '.dede-arena-...' is in use"), losing its whole window's
  // work; the three-host cross-dedup test hit it under load.
  Hosts h;
  WriteMonitorOptions mo;
  mo.algo = h.v1->superblock().hash_algo;
  WriteMonitor monitor(mo);
  Hosts::Make(h.v1.get(), "x", {1, 2, 1000, 3}, &monitor);
  Hosts::Make(h.v1.get(), "y", {4, 1000, 5}, &monitor);
  DedupOptions opts;
  opts.force = true;  // every pass rewrites the shard, so it opens the arena
  {
    VolumeFileAccess access(h.v1.get());
    auto pass = RunDedupPass(h.v1.get(), &access, opts);
    INFO("first pass: " << pass.status().ToString());
    REQUIRE(pass.ok());
    REQUIRE(pass->shared_new == 1);  // content 1000: the arena exists now
  }
  Hosts::Make(h.v1.get(), "z", {1000, 6}, &monitor);

  // Host 2 reads the arena for 400 ms while host 1's pass starts.
  std::atomic<bool> opened{false}, pass_done{false};
  std::atomic<std::chrono::steady_clock::time_point::rep> released{0};
  std::string reader_error;
  std::thread reader([&] {
    auto f = h.v2->OpenFile(ArenaFileName(0));
    if (!f.ok()) {
      reader_error = f.status().ToString();
      opened = true;
      return;
    }
    opened = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    f->reset();
    released = std::chrono::steady_clock::now().time_since_epoch().count();
    // Host 2's flush points hand over whatever it cached (the namespace)
    // when host 1 asks, as dedupd's would.
    while (!pass_done) {
      (void)h.v2->Sync();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  while (!opened) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(reader_error.empty());
  double took = 0;
  const Result<DedupStats> second = TimedPass(h.v1.get(), opts, &took);
  const auto pass_end = std::chrono::steady_clock::now().time_since_epoch().count();
  pass_done = true;
  reader.join();
  INFO("second pass: " << second.status().ToString() << " in " << took << " s");
  REQUIRE(second.ok());
  CHECK(second->shared_hits == 1);  // z:0 shares the arena block
  // It did meet the reader: it shared into the arena, so it ended after
  // the reader let the arena go.
  CHECK(released != 0);
  CHECK(pass_end >= released);
  CHECK(took < 5.0);
  auto z = OpenOn(h.v1.get(), "z");
  CHECK(Refs(z.get(), 0) == 4);  // x:2, y:1, z:0 and the arena
  CHECK(ReadBlock(z.get(), 0) == Content(1000));
  z.reset();
  h.FinishOnHost1();
}

TEST_CASE("TryBlockRefCount answers kLocked at once when another host holds the group",
          "[volume][nowait]") {
  Hosts h;
  Hosts::Make(h.v2.get(), "a", {1});  // its block is in group 1
  std::unique_ptr<File> hf = h.Host2TakesItsGroup();
  std::unique_ptr<File> a = OpenOn(h.v1.get(), "a");
  auto t0 = std::chrono::steady_clock::now();
  Result<uint32_t> busy = a->TryBlockRefCount(0);
  INFO("TryBlockRefCount: " << busy.status().ToString() << " in " << Seconds(t0) << " s");
  REQUIRE(busy.status().code() == Code::kLocked);
  CHECK(Seconds(t0) < 5.0);
  CHECK_FALSE(h.Announced(1));  // a count can wait for a later pass: no want
  hf.reset();                   // closing hands host 2's groups back
  PastBusyMemo();
  Result<uint32_t> counted = a->TryBlockRefCount(0);
  INFO(counted.status().ToString());
  REQUIRE(counted.ok());
  CHECK(*counted == 1);
}

TEST_CASE("a dedup pass leaves the garbage check of an arena block in a busy group for later",
          "[dedup][nowait]") {
  Hosts h;
  WriteMonitorOptions mo;
  mo.algo = h.v1->superblock().hash_algo;
  WriteMonitor monitor(mo);
  // Host 2 writes x and y (group 1) with one common content; host 1's pass
  // shares them through the arena (group 1 is free then).
  Hosts::Make(h.v2.get(), "x", {1, 1000, 2}, &monitor);
  Hosts::Make(h.v2.get(), "y", {3, 1000}, &monitor);
  DedupOptions opts;
  opts.force = true;
  auto pass = [&]() {
    double took = 0;
    Result<DedupStats> st = TimedPass(h.v1.get(), opts, &took);
    INFO("pass: " << st.status().ToString() << " in " << took << " s");
    REQUIRE(st.ok());
    CHECK(took < 5.0);
    REQUIRE(h.v1->Sync().ok());
    return *st;
  };
  REQUIRE(pass().shared_new == 1);
  // Host 2 overwrites both copies (no records: the shared content is now
  // only the arena's, garbage) and keeps group 1.
  {
    auto x = OpenOn(h.v2.get(), "x");
    auto y = OpenOn(h.v2.get(), "y");
    const std::vector<uint8_t> c4 = Content(4), c5 = Content(5);
    REQUIRE(x->Write(1 * kB, c4.data(), kB).ok());
    REQUIRE(y->Write(1 * kB, c5.data(), kB).ok());
    REQUIRE(h.v2->Sync().ok());
  }
  std::unique_ptr<File> hf = h.Host2TakesItsGroup();
  const DedupStats busy = pass();
  CHECK(busy.gc_checks_busy == 1);
  CHECK(busy.gc_arena_blocks == 0);  // kept: its count could not be read
  hf.reset();
  PastBusyMemo();
  const DedupStats later = pass();
  CHECK(later.gc_checks_busy == 0);
  CHECK(later.gc_arena_blocks == 1);
  h.FinishOnHost1();
}

TEST_CASE("a want announced for a held-back increment is collected at the next flush point",
          "[volume][nowait]") {
  // Left standing until the held-back work runs again (the next window's
  // pass), the announcement would make the holder hand back every cached
  // lock at each of its flush points.
  Hosts h;
  Hosts::Make(h.v2.get(), "a", {1});  // group 1
  Hosts::Make(h.v1.get(), "b", {1});  // group 0
  std::unique_ptr<File> hf = h.Host2TakesItsGroup();
  std::unique_ptr<File> a = OpenOn(h.v1.get(), "a");
  std::unique_ptr<File> b = OpenOn(h.v1.get(), "b");
  std::vector<Op> ops = {Share(a.get(), 0, b.get(), 0)};
  Volume::BlockOpsOptions no_wait;
  no_wait.no_wait = true;
  Volume::ReadBuffer buf;
  REQUIRE(h.v1->ApplyBlockOps(&ops, VerifyMode::kByteCompare, &buf, no_wait).ok());
  REQUIRE(ops[0].result.code() == Code::kLocked);
  REQUIRE(h.Announced(1));
  REQUIRE(h.v1->Sync().ok());
  CHECK(h.Announced(1));  // still held by host 2: the want stands
  REQUIRE(h.v2->Sync().ok());  // host 2 hands group 1 over
  PastBusyMemo();
  REQUIRE(h.v1->Sync().ok());  // host 1 takes it: the want is withdrawn
  CHECK_FALSE(h.Announced(1));
  // Host 1 holds group 1 now: the held-back share runs without waiting.
  std::vector<Op> again = {Share(a.get(), 0, b.get(), 0)};
  REQUIRE(h.v1->ApplyBlockOps(&again, VerifyMode::kByteCompare, &buf, no_wait).ok());
  INFO(again[0].result.ToString());
  CHECK(again[0].result.ok());
  CHECK(Refs(a.get(), 0) == 2);
  a.reset();
  b.reset();
  hf.reset();
  h.FinishOnHost1();
}

TEST_CASE("a dedup pass revisits the shard whose records waited for a busy group and shares them",
          "[dedup][nowait]") {
  Hosts h;
  WriteMonitorOptions mo;
  mo.algo = h.v1->superblock().hash_algo;
  WriteMonitor monitor(mo);
  Hosts::Make(h.v2.get(), "x", {100, 101, 102, 1000}, &monitor);  // group 1
  Hosts::Make(h.v2.get(), "y", {200, 1000, 201}, &monitor);
  std::unique_ptr<File> hf = h.Host2TakesItsGroup();
  // Host 2 behaves like a dedupd: once host 1 has announced that it wants
  // group 1, host 2's flush points (every 20 ms) hand it over.
  std::atomic<bool> done{false};
  std::thread flusher([&] {
    bool asked = false;
    while (!done) {
      if (!asked) {
        Result<bool> held = h.observer->IsHeldElsewhere(WantedGroup(1));
        asked = held.ok() && *held;
      }
      if (asked) (void)h.v2->Sync();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  DedupOptions opts;
  opts.busy_revisit_delay_ms = 300;
  std::set<uint64_t> busy_parked;
  opts.busy_parked_shards = &busy_parked;
  double took = 0;
  const Result<DedupStats> pass = TimedPass(h.v1.get(), opts, &took);
  done = true;
  flusher.join();
  INFO("pass: " << pass.status().ToString() << " in " << took << " s");
  REQUIRE(pass.ok());
  INFO("parked " << pass->records_parked_busy << ", revisited " << pass->shards_revisited
                 << ", pending applied " << pass->pending_records_applied << ", unique added "
                 << pass->unique_added << ", busy targets " << pass->busy_targets
                 << ", shards rewritten " << pass->shards_rewritten << ", deferred "
                 << pass->shards_deferred);
  CHECK(took < 5.0);
  CHECK(pass->records_parked_busy >= 1);  // held back at first...
  CHECK(pass->shards_revisited >= 1);
  CHECK(pass->shared_new == 1);           // ...and shared by the same pass
  CHECK(pass->stale_records == 0);
  CHECK(busy_parked.empty());             // nothing left for the next pass
  CHECK_FALSE(h.Announced(1));
  {
    auto x = OpenOn(h.v1.get(), "x");
    CHECK(Refs(x.get(), 3) == 3);  // x, y, the arena
    CHECK(ReadBlock(x.get(), 3) == Content(1000));
  }
  hf.reset();
  h.FinishOnHost1();
}

TEST_CASE("a shard split whose arena blocks are in a group another host holds is put off and not waited for",
          "[dedup][nowait]") {
  Hosts h;
  WriteMonitorOptions mo;
  mo.algo = h.v1->superblock().hash_algo;
  WriteMonitor monitor(mo);
  // Host 2 writes x and y (group 1) with 64 contents in common; host 1's
  // pass shares them through the arena: 64 Shared entries whose arena
  // blocks are in group 1, about half of them in the upper half of the
  // shard's key range (the half a split moves to a new arena).
  std::vector<uint64_t> common;
  for (uint64_t i = 0; i < 64; i++) common.push_back(100 + i);
  Hosts::Make(h.v2.get(), "x", common, &monitor);
  Hosts::Make(h.v2.get(), "y", common, &monitor);
  DedupOptions opts;
  opts.force = true;
  opts.split_min_entries = 8;
  opts.split_threshold_ms = 1'000'000;  // no split yet
  auto pass = [&](const char* what) {
    double took = 0;
    Result<DedupStats> st = TimedPass(h.v1.get(), opts, &took);
    INFO(what << ": " << st.status().ToString() << " in " << took << " s");
    REQUIRE(st.ok());
    CHECK(took < 5.0);  // a clone waiting for group 1 would take lock_wait_s (60 s)
    REQUIRE(h.v1->Sync().ok());
    return *st;
  };
  const DedupStats first = pass("first pass");
  REQUIRE(first.shared_new == 64);
  REQUIRE(first.shards_split == 0);
  // New records for the shard (host 1's own file, group 0), so the next
  // pass rewrites it; every update now "took too long".
  Hosts::Make(h.v1.get(), "z", {500, 501, 502, 503}, &monitor);
  opts.split_threshold_ms = 0;
  std::unique_ptr<File> hf = h.Host2TakesItsGroup();  // host 2 keeps group 1
  const DedupStats busy = pass("pass while host 2 holds group 1");
  CHECK(busy.splits_deferred_busy == 1);
  CHECK(busy.shards_split == 0);
  CHECK(busy.shards_rewritten >= 1);  // rewritten unsplit
  CHECK(h.Announced(1));              // host 2 will hand it over
  // Host 2's flush point hands group 1 over; host 1's takes it.
  REQUIRE(h.v2->Sync().ok());
  PastBusyMemo();
  REQUIRE(h.v1->Sync().ok());
  CHECK_FALSE(h.Announced(1));
  Hosts::Make(h.v1.get(), "w", {600, 601}, &monitor);
  const DedupStats later = pass("pass after the hand-over");
  CHECK(later.splits_deferred_busy == 0);
  CHECK(later.shards_split == 1);
  {
    auto x = OpenOn(h.v1.get(), "x");
    auto y = OpenOn(h.v1.get(), "y");
    for (uint64_t b = 0; b < common.size(); b++) {
      CHECK(ReadBlock(x.get(), b) == Content(common[b]));
      CHECK(ReadBlock(y.get(), b) == Content(common[b]));
      CHECK(Refs(x.get(), b) == 3);  // x, y and one arena (moved, not doubled)
    }
  }
  hf.reset();
  h.FinishOnHost1();
}

TEST_CASE("a dedup pass holds back a zero-block punch instead of waiting to drain a full drop list",
          "[dedup][nowait][drops]") {
  // A punch drops its block's reference, so it needs room in the drop
  // list. With the list (nearly) full of drops in a group another host
  // holds, a punch applied without no_wait drained it waiting (up to the
  // lock wait, 60 s here) under the volume mutex every write of this host
  // needs, and then failed the pass. The pass holds the punch back and
  // logs the block again; a later pass punches it.
  Hosts h(/*drop_blocks=*/1);  // one block: kDropsPerBlock (507) drops
  WriteMonitorOptions mo;
  mo.algo = h.v1->superblock().hash_algo;
  WriteMonitor monitor(mo);
  Volume* v1 = h.v1.get();
  // "z": block 1 all zeros, logged (a zero record: the pass punches it).
  {
    auto id = v1->Create("z", 2 * kB);
    REQUIRE(id.ok());
    auto z = OpenOn(v1, "z");
    monitor.AddFile(*id, true);
    const std::vector<uint8_t> c = Content(5);
    const std::vector<uint8_t> zeros(kB, 0);
    REQUIRE(z->Write(0, c.data(), kB).ok());
    monitor.OnWrite(*id, 0, c.data(), kB);
    REQUIRE(z->Write(kB, zeros.data(), kB).ok());
    monitor.OnWrite(*id, kB, zeros.data(), kB);
    REQUIRE(z->Flush().ok());
    REQUIRE(AppendToWriteLog(v1, monitor.Take(*id)).ok());
  }
  // "d" shares every block of "c" (group 0, where host 1 allocates first).
  constexpr uint64_t kFill = kDropsPerBlock - 22;  // leaves less room than a punch asks (32)
  std::vector<uint64_t> contents;
  for (uint64_t b = 0; b < kFill; b++) contents.push_back(100 + b);
  Hosts::Make(v1, "c", contents);
  REQUIRE(v1->Create("d", kFill * kB).ok());
  {
    auto c = OpenOn(v1, "c");
    auto d = OpenOn(v1, "d");
    for (uint64_t b = 0; b < kFill; b++) REQUIRE(v1->CloneBlock(c.get(), b, d.get(), b).ok());
  }
  REQUIRE(v1->Sync().ok());
  // Another host takes group 0 (host 1 hands it over at its flush point).
  const uint64_t groups = v1->superblock().group_count;
  for (uint64_t g = 0; g < groups; g++) {
    REQUIRE(h.observer->Acquire(WantedGroup(g), LockMode::kShared, false).ok());
  }
  REQUIRE(v1->Sync().ok());
  for (uint64_t g = 0; g < groups; g++) REQUIRE(h.observer->Release(WantedGroup(g)).ok());
  const LockId group0{LockKind::kGroup, 0};
  REQUIRE(h.observer->Acquire(group0, LockMode::kExclusive, false).ok());
  // Breaking "d"'s sharing block by block defers a drop of each of "c"'s
  // blocks (group 0 is held elsewhere): the list fills to kFill.
  {
    auto d = OpenOn(v1, "d");
    for (uint64_t b = 0; b < kFill; b++) {
      const std::vector<uint8_t> y = Content(5000 + b);
      Status w = d->Write(b * kB, y.data(), kB);
      INFO("block " << b << ": " << w.ToString());
      REQUIRE(w.ok());
    }
    REQUIRE(d->Flush().ok());
  }
  {
    auto st = v1->Stats();
    REQUIRE(st.ok());
    REQUIRE(st->pending_drops == kFill);
  }
  auto z_mapped = [&]() {
    auto z = OpenOn(v1, "z");
    auto info = z->Info();
    REQUIRE(info.ok());
    return info->mapped_blocks;
  };
  REQUIRE(z_mapped() == 2);

  DedupOptions opts;
  opts.busy_revisits = 0;
  double took = 0;
  {
    Result<DedupStats> pass = TimedPass(v1, opts, &took);
    INFO("pass: " << pass.status().ToString() << " in " << took << " s");
    REQUIRE(pass.ok());
    CHECK(took < 5.0);
    CHECK(pass->zero_blocks_freed == 0);
    CHECK(pass->zero_blocks_busy == 1);
    CHECK(pass->logs_consumed == 1);
  }
  CHECK(z_mapped() == 2);

  // Once the holder lets group 0 go, host 1's flush point applies the
  // drops, and the next pass finds the block logged again and punches it.
  REQUIRE(h.observer->Release(group0).ok());
  PastBusyMemo();
  REQUIRE(v1->Sync().ok());
  {
    Result<DedupStats> pass = TimedPass(v1, opts, &took);
    INFO("pass: " << pass.status().ToString() << " in " << took << " s");
    REQUIRE(pass.ok());
    CHECK(pass->zero_blocks_freed == 1);
    CHECK(pass->zero_blocks_busy == 0);
  }
  CHECK(z_mapped() == 1);
  {
    auto z = OpenOn(v1, "z");
    CHECK(ReadBlock(z.get(), 1) == std::vector<uint8_t>(kB, 0));
    CHECK(ReadBlock(z.get(), 0) == Content(5));
  }
  RequireFsckClean(v1);
}

// ------------------------------------------------------------------------
// Punches and clones that never wait under the volume mutex (2026-11-28,
// docs/LOCKING.md "Increments without waiting"). Each without its change
// waits the lock wait (60 s here) holding host 1's volume mutex.

namespace {

uint64_t Mapped(Volume* vol, const std::string& name) {
  auto f = OpenOn(vol, name);
  auto info = f->Info();
  REQUIRE(info.ok());
  return info->mapped_blocks;
}

}  // namespace

TEST_CASE("TryPunch holds a punch back instead of waiting to drain a full drop list",
          "[volume][nowait][drops]") {
  Hosts h(/*drop_blocks=*/1);
  Hosts::Make(h.v1.get(), "p", {7, 8});  // group 0
  h.FillDropList(15);                    // less room than a punch asks (16)
  {
    auto p = OpenOn(h.v1.get(), "p");
    const auto t0 = std::chrono::steady_clock::now();
    Status st = p->TryPunch(0);
    const double took = Seconds(t0);
    INFO("TryPunch: " << st.ToString() << " in " << took << " s");
    CHECK(st.code() == Code::kLocked);
    CHECK(took < 5.0);
    CHECK(ReadBlock(p.get(), 0) == Content(7));
  }
  CHECK(Mapped(h.v1.get(), "p") == 2);
  REQUIRE(h.v1->Sync().ok());
  // Once the holder lets group 0 go, the list drains and the punch works.
  h.ReleaseGroup0();
  {
    auto p = OpenOn(h.v1.get(), "p");
    Status st = p->TryPunch(0);
    INFO("TryPunch: " << st.ToString());
    REQUIRE(st.ok());
    CHECK(ReadBlock(p.get(), 0) == std::vector<uint8_t>(kB, 0));
    CHECK(ReadBlock(p.get(), 1) == Content(8));
  }
  CHECK(Mapped(h.v1.get(), "p") == 1);
  RequireFsckClean(h.v1.get());
}

TEST_CASE("a clone into a hole asks for no drop-list room", "[volume][nowait][drops]") {
  // A clone into a hole drops no reference (a split's new arena block, a
  // merge request's clone, a pass's anchor). It asked for 32 entries of
  // drop-list room all the same, and with the list full of drops in a
  // group held elsewhere CloneBlock drained it waiting (60 s, under the
  // volume mutex) and failed; ApplyBlockOps with no_wait held it back.
  Hosts h(/*drop_blocks=*/1);
  h.FillDropList(20);                    // less room than a clone asked (32)
  Hosts::Make(h.v1.get(), "s", {7, 8});  // not group 0: the observer holds it
  REQUIRE(h.v1->Create("t", 2 * kB).ok());
  {
    auto s = OpenOn(h.v1.get(), "s");
    auto t = OpenOn(h.v1.get(), "t");
    Volume::BlockOpsOptions no_wait;
    no_wait.no_wait = true;
    auto t0 = std::chrono::steady_clock::now();
    Status st = h.v1->CloneBlock(s.get(), 0, t.get(), 0, no_wait);
    INFO("CloneBlock: " << st.ToString() << " in " << Seconds(t0) << " s");
    REQUIRE(st.ok());
    CHECK(Seconds(t0) < 5.0);
    Op clone;
    clone.kind = Kind::kCloneIfHash;
    clone.src = s.get();
    clone.src_index = 1;
    clone.dst = t.get();
    clone.dst_index = 1;
    const std::vector<uint8_t> c8 = Content(8);
    clone.witness = ComputeFingerprint(h.v1->superblock().hash_algo, c8.data(), kB);
    std::vector<Op> ops = {clone};
    Volume::ReadBuffer buf;
    st = h.v1->ApplyBlockOps(&ops, VerifyMode::kByteCompare, &buf, no_wait);
    INFO("ApplyBlockOps: " << st.ToString() << "; op: " << ops[0].result.ToString());
    REQUIRE(st.ok());
    CHECK(ops[0].result.ok());
    CHECK(ops[0].changed);
    CHECK(ReadBlock(t.get(), 0) == Content(7));
    CHECK(ReadBlock(t.get(), 1) == Content(8));
    CHECK(Refs(s.get(), 0) == 2);
    CHECK(Refs(s.get(), 1) == 2);
  }
  h.ReleaseGroup0();
  RequireFsckClean(h.v1.get());
}

TEST_CASE("a no-wait clone holds back a clone whose source group another host holds",
          "[volume][nowait]") {
  Hosts h;
  Hosts::Make(h.v2.get(), "u", {9});  // group 1
  REQUIRE(h.v1->Create("t", kB).ok());
  auto u = OpenOn(h.v1.get(), "u");
  auto t = OpenOn(h.v1.get(), "t");
  std::unique_ptr<File> hf = h.Host2TakesItsGroup();
  Volume::BlockOpsOptions no_wait;
  no_wait.no_wait = true;
  auto t0 = std::chrono::steady_clock::now();
  Status st = h.v1->CloneBlock(u.get(), 0, t.get(), 0, no_wait);
  INFO("CloneBlock: " << st.ToString() << " in " << Seconds(t0) << " s");
  CHECK(st.code() == Code::kLocked);
  CHECK(Seconds(t0) < 5.0);
  CHECK(h.Announced(1));  // host 2 will hand it over
  CHECK(ReadBlock(t.get(), 0) == std::vector<uint8_t>(kB, 0));
  REQUIRE(h.v1->Sync().ok());
  // Host 2's flush point hands group 1 over; the clone goes through.
  REQUIRE(h.v2->Sync().ok());
  PastBusyMemo();
  st = h.v1->CloneBlock(u.get(), 0, t.get(), 0, no_wait);
  INFO("CloneBlock: " << st.ToString());
  REQUIRE(st.ok());
  CHECK(ReadBlock(t.get(), 0) == Content(9));
  CHECK(Refs(u.get(), 0) == 2);
  REQUIRE(h.v1->Sync().ok());
  u.reset();
  t.reset();
  hf.reset();
  h.FinishOnHost1();
}

TEST_CASE("a merge-request post holds back a clone whose source group another host holds",
          "[merge][nowait]") {
  // A post clones the arena block into the request file. It waited (60 s,
  // under the volume mutex, holding the shard's lock) for the block's
  // group when another host held it.
  Hosts h;
  Hosts::Make(h.v2.get(), "s", {7});  // group 1
  Hosts::Make(h.v1.get(), "t", {7});
  auto t = OpenOn(h.v1.get(), "t");
  auto s = OpenOn(h.v1.get(), "s");
  std::unique_ptr<File> hf = h.Host2TakesItsGroup();
  const std::vector<uint8_t> c = Content(7);
  const Fingerprint fp = ComputeFingerprint(h.v1->superblock().hash_algo, c.data(), kB);
  MergePostOutcome outcome;
  auto t0 = std::chrono::steady_clock::now();
  Status st = PostMergeRequests(h.v1.get(), t->id(), {MergeRequest{0, fp, 0}}, s.get(), &outcome);
  INFO("post: " << st.ToString() << " in " << Seconds(t0) << " s");
  CHECK(st.code() == Code::kLocked);
  CHECK(Seconds(t0) < 5.0);
  CHECK_FALSE(outcome.file_busy);
  CHECK(outcome.posted == 0);
  CHECK(h.Announced(1));
  REQUIRE(h.v1->Sync().ok());
  {
    // The half-built group was taken back: nothing to apply.
    auto ap = ApplyMergeRequests(h.v1.get(), t.get(), VerifyMode::kByteCompare);
    INFO("apply: " << ap.status().ToString());
    REQUIRE(ap.ok());
    CHECK(ap->records == 0);
    CHECK(ap->applied == 0);
  }
  REQUIRE(h.v2->Sync().ok());  // hands group 1 over
  PastBusyMemo();
  st = PostMergeRequests(h.v1.get(), t->id(), {MergeRequest{0, fp, 0}}, s.get(), &outcome);
  INFO("post: " << st.ToString());
  REQUIRE(st.ok());
  CHECK(outcome.posted == 1);
  auto ap = ApplyMergeRequests(h.v1.get(), t.get(), VerifyMode::kByteCompare);
  REQUIRE(ap.ok());
  CHECK(ap->applied == 1);
  CHECK(Refs(t.get(), 0) == 2);  // s and t
  CHECK(ReadBlock(t.get(), 0) == Content(7));
  t.reset();
  s.reset();
  hf.reset();
  h.FinishOnHost1();
}

TEST_CASE("a shard split moves arena references without waiting to drain a full drop list",
          "[dedup][nowait][drops]") {
  // A split clones the upper half's arena references into a new arena
  // (into holes). CloneBlock asked for drop-list room all the same, and
  // with the list full of drops in a group held elsewhere it drained it
  // waiting (60 s) under the volume mutex, then failed the pass.
  Hosts h(/*drop_blocks=*/1);
  WriteMonitorOptions mo;
  mo.algo = h.v1->superblock().hash_algo;
  WriteMonitor monitor(mo);
  std::vector<uint64_t> common;
  for (uint64_t i = 0; i < 64; i++) common.push_back(100 + i);
  Hosts::Make(h.v2.get(), "x", common, &monitor);  // group 1
  Hosts::Make(h.v2.get(), "y", common, &monitor);
  DedupOptions opts;
  opts.force = true;
  opts.busy_revisits = 0;
  opts.split_min_entries = 8;
  opts.split_threshold_ms = 1'000'000;  // no split yet
  auto pass = [&](const char* what) {
    double took = 0;
    Result<DedupStats> st = TimedPass(h.v1.get(), opts, &took);
    INFO(what << ": " << st.status().ToString() << " in " << took << " s");
    REQUIRE(st.ok());
    CHECK(took < 5.0);
    REQUIRE(h.v1->Sync().ok());
    return *st;
  };
  REQUIRE(pass("first pass").shared_new == 64);
  // Room for the pass's truncations and writes (16 each at most), not for
  // a clone's old ask (32).
  h.FillDropList(28);
  Hosts::Make(h.v1.get(), "z", {500, 501, 502, 503}, &monitor);
  opts.split_threshold_ms = 0;
  const DedupStats split = pass("pass with the drop list nearly full");
  CHECK(split.shards_split == 1);
  CHECK(split.split_clones_busy == 0);
  CHECK(split.arena_punches_busy == 0);
  h.ReleaseGroup0();
  {
    auto x = OpenOn(h.v1.get(), "x");
    auto y = OpenOn(h.v1.get(), "y");
    for (uint64_t b = 0; b < common.size(); b++) {
      CHECK(ReadBlock(x.get(), b) == Content(common[b]));
      CHECK(ReadBlock(y.get(), b) == Content(common[b]));
      CHECK(Refs(x.get(), b) == 3);  // x, y and one arena (moved, not doubled)
    }
  }
  h.FinishOnHost1();
}

TEST_CASE(
    "on a volume without drop lists a no-wait punch whose group another host holds is held back",
    "[volume][nowait]") {
  // Without drop lists every drop takes its block's group, waiting for it
  // (60 s, under the volume mutex): a pass's zero-block punch and TryPunch
  // hold back instead.
  Hosts h(/*drop_blocks=*/0);
  {
    auto id = h.v2->Create("p", 2 * kB);  // group 1
    REQUIRE(id.ok());
    auto p = OpenOn(h.v2.get(), "p");
    const std::vector<uint8_t> c = Content(7), zeros(kB, 0);
    REQUIRE(p->Write(0, c.data(), kB).ok());
    REQUIRE(p->Write(kB, zeros.data(), kB).ok());
    REQUIRE(p->Flush().ok());
  }
  auto p = OpenOn(h.v1.get(), "p");
  std::unique_ptr<File> hf = h.Host2TakesItsGroup();
  auto t0 = std::chrono::steady_clock::now();
  Status st = p->TryPunch(0);
  INFO("TryPunch: " << st.ToString() << " in " << Seconds(t0) << " s");
  CHECK(st.code() == Code::kLocked);
  CHECK(Seconds(t0) < 5.0);
  Op punch;
  punch.kind = Kind::kPunchIfZero;
  punch.dst = p.get();
  punch.dst_index = 1;
  std::vector<Op> ops = {punch};
  Volume::BlockOpsOptions no_wait;
  no_wait.no_wait = true;
  Volume::ReadBuffer buf;
  t0 = std::chrono::steady_clock::now();
  st = h.v1->ApplyBlockOps(&ops, VerifyMode::kByteCompare, &buf, no_wait);
  INFO("ApplyBlockOps: " << st.ToString() << " in " << Seconds(t0)
                         << " s; op: " << ops[0].result.ToString());
  REQUIRE(st.ok());
  CHECK(Seconds(t0) < 5.0);
  CHECK(ops[0].result.code() == Code::kLocked);
  CHECK_FALSE(ops[0].changed);
  CHECK(h.Announced(1));
  REQUIRE(h.v1->Sync().ok());
  CHECK(ReadBlock(p.get(), 0) == Content(7));
  // Host 2 hands group 1 over at its flush point: both go through.
  REQUIRE(h.v2->Sync().ok());
  PastBusyMemo();
  REQUIRE(p->TryPunch(0).ok());
  st = h.v1->ApplyBlockOps(&ops, VerifyMode::kByteCompare, &buf, no_wait);
  REQUIRE(st.ok());
  CHECK(ops[0].result.ok());
  CHECK(ops[0].changed);
  auto info = p->Info();
  REQUIRE(info.ok());
  CHECK(info->mapped_blocks == 0);
  REQUIRE(h.v1->Sync().ok());
  p.reset();
  hf.reset();
  h.FinishOnHost1();
}
