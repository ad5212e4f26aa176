// Fuzzes DecodeSuperblock and PlanLayout, and the lock-table block decoder
// (DecodeLockTableBlock: what it accepts re-encodes to the same records).
//
// Properties: a decoded superblock re-encodes to a block that decodes to
// the same superblock, and describes a layout whose regions are in order,
// inside the device, and whose groups tile the device (checked in 128-bit
// arithmetic so that no wrap-around can hide a bad layout). Any layout
// PlanLayout accepts encodes to a superblock that decodes.
#include <cstdint>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_util.h"

using namespace dede;
using namespace dede::fuzz;

namespace {

constexpr const char* kTarget = "fuzz_superblock";
using u128 = unsigned __int128;

bool Same(const Superblock& a, const Superblock& b) {
  return a.uuid == b.uuid && a.block_size == b.block_size && a.hash_algo == b.hash_algo &&
         a.total_blocks == b.total_blocks && a.max_hosts == b.max_hosts &&
         a.lease_slots == b.lease_slots && a.lease_start == b.lease_start &&
         a.lease_blocks == b.lease_blocks && a.journal_start == b.journal_start &&
         a.journal_blocks == b.journal_blocks && a.inode_start == b.inode_start &&
         a.inode_count == b.inode_count && a.group_start == b.group_start &&
         a.group_count == b.group_count && a.group_refblocks == b.group_refblocks &&
         a.created_ns == b.created_ns && a.compat_features == b.compat_features &&
         a.incompat_features == b.incompat_features;
}

void CheckGroup(const Superblock& sb, uint32_t g) {
  const u128 start = u128{sb.group_start} + u128{g} * sb.FullGroupBlocks();
  FUZZ_CHECK(start < sb.total_blocks, "group starts outside the device");
  FUZZ_CHECK(sb.GroupStart(g) == start, "GroupStart wrapped");
  const uint64_t refs = sb.GroupRefBlocks(g);
  const uint64_t data = sb.GroupDataBlocks(g);
  FUZZ_CHECK(refs >= 1 && refs <= sb.group_refblocks, "refcount blocks out of range");
  FUZZ_CHECK(data >= 1, "group without data blocks");
  FUZZ_CHECK(data <= refs * kRefsPerBlock, "data block without a refcount slot");
  FUZZ_CHECK(start + refs + data <= sb.total_blocks, "group runs past the device end");
  if (g + 1 < sb.group_count) {
    FUZZ_CHECK(refs + data == sb.FullGroupBlocks(), "inner group is not full");
  } else {
    FUZZ_CHECK(sb.total_blocks - (start + refs + data) <= 1, "room left for another group");
  }
  uint32_t lg;
  uint64_t rb;
  uint32_t slot;
  const uint64_t ds = sb.GroupDataStart(g);
  FUZZ_CHECK(!sb.LocateData(ds - 1, &lg, &rb, &slot), "refcount block located as data");
  for (uint64_t b : {ds, ds + data / 2, ds + data - 1}) {
    FUZZ_CHECK(sb.LocateData(b, &lg, &rb, &slot), "data block not located");
    FUZZ_CHECK(lg == g, "data block in the wrong group");
    FUZZ_CHECK(rb >= start && rb < ds && slot < kRefsPerBlock, "slot outside the group");
    FUZZ_CHECK(u128{rb - start} * kRefsPerBlock + slot == b - ds, "slot out of order");
  }
}

// The layout invariants of a superblock that decoded.
void CheckLayout(const Superblock& sb) {
  FUZZ_CHECK(sb.total_blocks < (1ull << 48), "device beyond 2^48 blocks");
  FUZZ_CHECK(sb.max_hosts >= 1 && sb.max_hosts <= kMaxHosts, "max_hosts out of range");
  FUZZ_CHECK(sb.lease_start == kLeaseAreaStartBlock, "lease area moved");
  FUZZ_CHECK(u128{sb.lease_start} + sb.lease_blocks == sb.journal_start, "journal start");
  FUZZ_CHECK(u128{sb.journal_start} + u128{sb.max_hosts} * sb.journal_blocks == sb.inode_start,
             "journals overlap or wrap");
  FUZZ_CHECK(u128{sb.inode_start} + sb.inode_count == sb.group_start, "inode table wraps");
  FUZZ_CHECK(sb.inode_count >= 1 && sb.group_start < sb.total_blocks, "no room for groups");
  FUZZ_CHECK(sb.JournalStart(sb.max_hosts) + sb.journal_blocks == sb.inode_start, "JournalStart");
  FUZZ_CHECK(sb.InodeBlock(sb.inode_count) + 1 == sb.group_start, "InodeBlock");
  FUZZ_CHECK(sb.group_count >= 1, "no groups");
  uint32_t g;
  uint64_t rb;
  uint32_t slot;
  FUZZ_CHECK(!sb.LocateData(sb.group_start - 1, &g, &rb, &slot), "inode located as data");
  FUZZ_CHECK(!sb.LocateData(sb.total_blocks, &g, &rb, &slot), "device end located as data");
  // First and last groups (walking all of them may take too long).
  CheckGroup(sb, 0);
  if (sb.group_count > 1) CheckGroup(sb, 1);
  if (sb.group_count > 2) CheckGroup(sb, sb.group_count - 1);
  if (sb.group_count <= 64) {
    uint64_t total = 0;
    for (uint32_t i = 0; i < sb.group_count; i++) {
      CheckGroup(sb, i);
      total += sb.GroupDataBlocks(i);
    }
    FUZZ_CHECK(sb.DataBlocks() == total, "DataBlocks");
  }
}

void RoundTrip(const Superblock& sb, uint64_t addr) {
  CheckLayout(sb);
  Blk again;
  EncodeSuperblock(sb, addr, again.data());
  Result<Superblock> r = DecodeSuperblock(again.data(), addr);
  FUZZ_CHECK(r.ok(), "re-encoded superblock does not decode: " + r.status().ToString());
  FUZZ_CHECK(Same(*r, sb), "superblock changed in a round trip");
  Blk third;
  EncodeSuperblock(*r, addr, third.data());
  FUZZ_CHECK(third == again, "encoding is not canonical");
}

void DecodeOne(const Blk& blk, uint64_t addr) {
  Result<Superblock> r = DecodeSuperblock(blk.data(), addr);
  if (!r.ok()) {
    FUZZ_CHECK(FailedCleanly(r.status()), "error without a message");
    FUZZ_CHECK(r.status().message().find("superblock at block " + std::to_string(addr)) !=
                   std::string::npos,
               "error does not name the block: " + r.status().message());
    return;
  }
  RoundTrip(*r, addr);
}

// Reads FormatParams from the input; returns false if it is too short.
bool ParamsFrom(const uint8_t* data, size_t size, FormatParams* p) {
  if (size < 40) return false;
  Decoder d(data, size);
  p->device_bytes = d.u64();
  uint8_t shape = d.u8();
  // Mostly plausible sizes (up to 2^52 bytes), sometimes anything.
  if (shape & 1) p->device_bytes &= (1ull << 52) - 1;
  p->max_hosts = d.u32();
  if (shape & 2) p->max_hosts %= kMaxHosts + 2;
  p->hash_algo = (shape & 4) ? HashAlgo::kSha256 : HashAlgo::kXxh128;
  p->inode_count = d.u64();
  if (shape & 8) p->inode_count &= 0xfffff;
  p->lease_slots = d.u32();
  if (shape & 16) p->lease_slots &= 0xff;
  p->journal_blocks = d.u64();
  if (shape & 32) p->journal_blocks &= 0xffff;
  p->group_refblocks = d.u32();
  if (shape & 64) p->group_refblocks &= 0x3f;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::vector<Blk> seeds;
  for (uint64_t bytes : {uint64_t{21} << 20, uint64_t{1} << 30, (uint64_t{5} << 30) + 12345}) {
    FormatParams p;
    p.device_bytes = bytes;
    p.group_refblocks = bytes < (uint64_t{1} << 30) ? 2 : 32;
    Result<Superblock> r = PlanLayout(p);
    if (!r.ok()) Fail(kTarget, "seed layout: " + r.status().ToString());
    Superblock sb = *r;
    sb.uuid = kFuzzUuid;
    sb.created_ns = 1700000000000000000ull;
    for (uint64_t addr : kSuperblockAddrs) {
      seeds.emplace_back();
      EncodeSuperblock(sb, addr, seeds.back().data());
    }
  }
  MaybeWriteSeeds(kTarget, seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Blk raw(data, size);
  const uint64_t header_addr = PeekHeader(raw.data()).addr;

  // As found, at the address it claims and at both superblock addresses.
  DecodeOne(raw, header_addr);
  DecodeOne(raw, 0);
  DecodeOne(raw, 1);

  // With magic and crc fixed up (the UUID is the block's own).
  Uuid uuid;
  std::memcpy(uuid.data(), raw.data() + kHeaderSize, 16);
  for (bool fix_version : {false, true}) {
    Blk fixed(raw);
    FixUp(fixed.data(), kMagicSuperblock, fix_version, uuid);
    DecodeOne(fixed, header_addr);
  }

  // The input as layout parameters.
  FormatParams p;
  if (ParamsFrom(data, size, &p)) {
    Result<Superblock> r = PlanLayout(p);
    if (r.ok()) {
      Superblock sb = *r;
      FUZZ_CHECK(sb.total_blocks == p.device_bytes / kBlockSize, "total_blocks");
      FUZZ_CHECK(sb.max_hosts == p.max_hosts, "max_hosts not kept");
      sb.uuid = kFuzzUuid;
      RoundTrip(sb, 0);
    } else {
      FUZZ_CHECK(FailedCleanly(r.status()), "PlanLayout error without a message");
      const Status::Code c = r.status().code();
      FUZZ_CHECK(c == Status::Code::kInvalid || c == Status::Code::kNoSpace,
                 "PlanLayout: unexpected code " + std::string(r.status().CodeName()));
    }
  }

  // The input as a lock-table block, as found and with magic/crc fixed up.
  for (bool fix : {false, true}) {
    Blk lt(raw);
    if (fix) FixUp(lt.data(), kMagicLockTable, true, kFuzzUuid);
    Result<std::vector<LockRecord>> recs = DecodeLockTableBlock(lt.data(), header_addr, kFuzzUuid);
    if (!recs.ok()) {
      FUZZ_CHECK(FailedCleanly(recs.status()), "lock table: error without a message");
      continue;
    }
    FUZZ_CHECK(recs->size() <= kLockRecordsPerBlock, "lock table: too many records");
    Blk again(raw);
    EncodeLockTableBlock(*recs, 5, header_addr, kFuzzUuid, again.data());
    Result<std::vector<LockRecord>> back = DecodeLockTableBlock(again.data(), header_addr, kFuzzUuid);
    FUZZ_CHECK(back.ok() && *back == *recs, "lock table: re-encoding changed the records");
  }
  return 0;
}
