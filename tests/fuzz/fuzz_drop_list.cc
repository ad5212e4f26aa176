// Fuzzes DecodeDropListBlock (a host's deferred-drop list, format 1.1).
//
// The decoder needs a superblock (entries must be data blocks of it): the
// default layout of a 64 MiB volume with kFuzzUuid. Each input block is
// decoded for host 2 and for the owner its payload names (offset 36).
//
// Properties: an error is a clean status whose message names the drop list
// block and its address. Whatever decodes holds at most kDropsPerBlock
// entries, each a data block; it re-encodes (same owner, seq and address)
// to a block that decodes to the same entries, and, for a block of this
// version with no header flags, reproduces the input exactly (everything
// after the entries must be zero, so a drop list block has no free bytes).
// The re-encoded block is refused for another host and at another address.
#include <cstdint>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_util.h"

using namespace dede;
using namespace dede::fuzz;

namespace {

constexpr const char* kTarget = "fuzz_drop_list";
constexpr uint32_t kHost = 2;

const Superblock& Sb() {
  static const Superblock sb = [] {
    FormatParams p;
    p.device_bytes = 64ull << 20;
    Result<Superblock> r = PlanLayout(p);
    if (!r.ok()) Fail(kTarget, "PlanLayout: " + r.status().ToString());
    Superblock s = r.value();
    s.uuid = kFuzzUuid;
    return s;
  }();
  return sb;
}

bool AllZero(const Blk& blk) {
  for (uint32_t i = 0; i < kBlockSize; i++) {
    if (blk.data()[i] != 0) return false;
  }
  return true;
}

void CheckError(const Status& s, uint64_t addr) {
  FUZZ_CHECK(FailedCleanly(s), "error without a message");
  FUZZ_CHECK(s.code() == Status::Code::kCorruption || s.code() == Status::Code::kUnsupported,
             "unexpected error code: " + s.ToString());
  // "drop list block N ..." from the decoder's own checks, "drop list block
  // at block N: ..." from CheckBlock: either way both the structure and the
  // address it was read from.
  FUZZ_CHECK(s.message().find("drop list block") != std::string::npos &&
                 s.message().find("block " + std::to_string(addr)) != std::string::npos,
             "error does not name the block: " + s.message());
}

void DecodeOne(const Blk& blk, uint32_t host, uint64_t addr) {
  const Superblock& sb = Sb();
  Result<std::vector<uint64_t>> r = DecodeDropListBlock(blk.data(), sb, host, addr);
  if (!r.ok()) {
    CheckError(r.status(), addr);
    return;
  }
  const std::vector<uint64_t>& drops = r.value();
  FUZZ_CHECK(drops.size() <= kDropsPerBlock, "more entries than fit a block");
  for (uint64_t a : drops) {
    uint32_t g, slot;
    uint64_t rb;
    FUZZ_CHECK(sb.LocateData(a, &g, &rb, &slot), "an entry that is not a data block");
  }
  const bool zero = AllZero(blk);
  if (zero) FUZZ_CHECK(drops.empty(), "the all-zero block is not empty");

  const BlockHeader h = PeekHeader(blk.data());
  Blk again;
  EncodeDropListBlock(drops, host, h.seq, kFuzzUuid, addr, again.data());
  Result<std::vector<uint64_t>> r2 = DecodeDropListBlock(again.data(), sb, host, addr);
  FUZZ_CHECK(r2.ok(), "re-encoded drop list block does not decode: " + r2.status().ToString());
  FUZZ_CHECK(r2.value() == drops, "drop list changed in a round trip");
  if (!zero && h.major == kFormatMajor && h.minor == kFormatMinor && h.flags == 0) {
    FUZZ_CHECK(again == blk, "re-encoding differs from the input");
  }

  // Owned by one host, sealed for one address.
  Result<std::vector<uint64_t>> other = DecodeDropListBlock(again.data(), sb, host + 1, addr);
  FUZZ_CHECK(!other.ok(), "decoded for another host");
  CheckError(other.status(), addr);
  other = DecodeDropListBlock(again.data(), sb, host, addr + 1);
  FUZZ_CHECK(!other.ok(), "decoded at another address");
  CheckError(other.status(), addr + 1);

  // One more reference (a repeat of the first data block) still fits and
  // round-trips, unless the block is full.
  if (drops.size() < kDropsPerBlock) {
    std::vector<uint64_t> more = drops;
    more.push_back(sb.GroupDataStart(0));
    EncodeDropListBlock(more, host, h.seq + 1, kFuzzUuid, addr, again.data());
    Result<std::vector<uint64_t>> r3 = DecodeDropListBlock(again.data(), sb, host, addr);
    FUZZ_CHECK(r3.ok() && r3.value() == more, "an appended entry did not round-trip");
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const Superblock& sb = Sb();
  const uint64_t ds = sb.GroupDataStart(0);
  const uint64_t n = sb.GroupDataBlocks(0);
  std::vector<Blk> seeds;
  seeds.emplace_back();  // an empty list, as written by fsck --repair
  EncodeDropListBlock({}, kHost, 1, kFuzzUuid, sb.DropListStart(kHost), seeds.back().data());
  seeds.emplace_back();  // one entry
  EncodeDropListBlock({ds}, 1, 3, kFuzzUuid, sb.DropListStart(1) + 1, seeds.back().data());
  seeds.emplace_back();  // one reference at a time: repeats
  EncodeDropListBlock({ds + n - 1, ds + 7, ds + 7, ds + n - 1, ds + 7}, 3, 12, kFuzzUuid,
                      sb.DropListStart(3), seeds.back().data());
  std::vector<uint64_t> full;
  for (uint64_t i = 0; i < kDropsPerBlock; i++) full.push_back(ds + (i * 7919) % n);
  seeds.emplace_back();  // a full block
  EncodeDropListBlock(full, sb.max_hosts, 40, kFuzzUuid,
                      sb.DropListStart(sb.max_hosts) + sb.drop_blocks - 1, seeds.back().data());
  MaybeWriteSeeds(kTarget, seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Blk raw(data, size);
  const uint64_t addr = PeekHeader(raw.data()).addr;
  const uint32_t owner = DecodeU32(raw.data() + kHeaderSize + 4);
  DecodeOne(raw, kHost, addr);
  if (owner != kHost) DecodeOne(raw, owner, addr);
  for (bool fix_version : {false, true}) {
    Blk fixed(raw);
    FixUp(fixed.data(), kMagicDropList, fix_version, kFuzzUuid);
    DecodeOne(fixed, owner, addr);
    if (owner != kHost) DecodeOne(fixed, kHost, addr);
  }
  return 0;
}
