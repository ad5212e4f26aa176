// Fuzzes DecodeInode.
//
// Property: whatever decodes satisfies the inode invariants, re-encodes to
// a block that decodes to the same inode, and the encoding is canonical.
#include <cstdint>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_util.h"

using namespace dede;
using namespace dede::fuzz;

namespace {

constexpr const char* kTarget = "fuzz_inode";

bool Same(const Inode& a, const Inode& b) {
  return a.ino == b.ino && a.generation == b.generation && a.flags == b.flags && a.kind == b.kind &&
         a.depth == b.depth && a.size == b.size && a.root == b.root &&
         a.mapped_blocks == b.mapped_blocks && a.ctime_ns == b.ctime_ns &&
         a.mtime_ns == b.mtime_ns && a.owner_ino == b.owner_ino && a.name == b.name;
}

void DecodeOne(const Blk& blk, uint64_t addr) {
  Result<Inode> r = DecodeInode(blk.data(), kFuzzUuid, addr);
  if (!r.ok()) {
    FUZZ_CHECK(FailedCleanly(r.status()), "error without a message");
    FUZZ_CHECK(r.status().message().find("at block " + std::to_string(addr)) != std::string::npos,
               "error does not name the block: " + r.status().message());
    FUZZ_CHECK(r.status().message().find("inode") != std::string::npos,
               "error does not name the structure: " + r.status().message());
    return;
  }
  const Inode& in = *r;
  FUZZ_CHECK((in.flags & ~kInodeKnownFlags) == 0, "unknown flags accepted");
  FUZZ_CHECK(static_cast<uint16_t>(in.kind) <= static_cast<uint16_t>(FileKind::kSystem),
             "unknown kind accepted");
  FUZZ_CHECK(std::string(FileKindName(in.kind)) != "unknown", "kind without a name");
  FUZZ_CHECK(in.name.size() <= kMaxNameLen, "name too long");
  FUZZ_CHECK(in.depth <= 6 && (in.depth == 0) == (in.root == 0), "bad map root accepted");
  FUZZ_CHECK((in.root & ~kPtrAddrMask) == 0, "root with flag bits accepted");
  FUZZ_CHECK(!in.in_use() || (!in.name.empty() && in.kind != FileKind::kNone),
             "in-use inode without name or kind");
  FUZZ_CHECK(in.size <= kMaxFileBytes, "size past 2^60 accepted");

  const uint64_t seq = PeekHeader(blk.data()).seq;
  Blk again;
  EncodeInode(in, seq, kFuzzUuid, addr, again.data());
  Result<Inode> r2 = DecodeInode(again.data(), kFuzzUuid, addr);
  FUZZ_CHECK(r2.ok(), "re-encoded inode does not decode: " + r2.status().ToString());
  FUZZ_CHECK(Same(*r2, in), "inode changed in a round trip");
  Blk third;
  EncodeInode(*r2, seq, kFuzzUuid, addr, third.data());
  FUZZ_CHECK(third == again, "inode encoding is not canonical");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::vector<Blk> seeds;
  const uint64_t istart = 4608;
  Inode in;
  in.ino = 1;
  seeds.emplace_back();  // a free inode
  EncodeInode(in, 1, kFuzzUuid, istart, seeds.back().data());
  in.ino = 2;
  in.generation = 3;
  in.flags = kInodeInUse;
  in.kind = FileKind::kRegular;
  in.depth = 2;
  in.root = 70000;
  in.size = 10ull << 30;
  in.mapped_blocks = 1000;
  in.ctime_ns = 1700000000000000000ull;
  in.mtime_ns = 1700000000000000001ull;
  in.name = "win10-golden.qcow";
  seeds.emplace_back();
  EncodeInode(in, 9, kFuzzUuid, istart + 1, seeds.back().data());
  in.ino = 3;
  in.flags = kInodeInUse | kInodeDedupOff;
  in.kind = FileKind::kWriteLog;
  in.owner_ino = 2;
  in.depth = 1;
  in.root = 70001;
  in.name = std::string(kMaxNameLen, 'w');
  seeds.emplace_back();
  EncodeInode(in, 2, kFuzzUuid, istart + 2, seeds.back().data());
  MaybeWriteSeeds(kTarget, seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Blk raw(data, size);
  const uint64_t addr = PeekHeader(raw.data()).addr;
  DecodeOne(raw, addr);
  for (bool fix_version : {false, true}) {
    Blk fixed(raw);
    FixUp(fixed.data(), kMagicInode, fix_version, kFuzzUuid);
    DecodeOne(fixed, addr);
  }
  return 0;
}
