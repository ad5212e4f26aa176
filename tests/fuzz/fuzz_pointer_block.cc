// Fuzzes DecodePointerBlock and the in-place slot accessors.
//
// Property: whatever decodes has a level in 1..6 and no reserved pointer
// bits, GetPtr agrees with the decoded entries, the block re-encodes to a
// block that decodes to the same value, and the encoding reproduces the
// input block exactly (a pointer block has no unused bytes).
#include <cstdint>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_util.h"

using namespace dede;
using namespace dede::fuzz;

namespace {

constexpr const char* kTarget = "fuzz_pointer_block";

void DecodeOne(const Blk& blk, uint64_t addr) {
  Result<PointerBlock> r = DecodePointerBlock(blk.data(), kFuzzUuid, addr);
  if (!r.ok()) {
    FUZZ_CHECK(FailedCleanly(r.status()), "error without a message");
    FUZZ_CHECK(r.status().message().find("pointer block at block " + std::to_string(addr)) !=
                   std::string::npos,
               "error does not name the block: " + r.status().message());
    return;
  }
  const PointerBlock& pb = *r;
  FUZZ_CHECK(pb.level >= 1 && pb.level <= 6, "level out of range accepted");
  for (uint32_t i = 0; i < kPointersPerBlock; i++) {
    FUZZ_CHECK((pb.ptrs[i] & kPtrReserved) == 0, "reserved bits accepted");
    FUZZ_CHECK(GetPtr(blk.data(), i) == pb.ptrs[i], "GetPtr disagrees with the decoder");
    FUZZ_CHECK(PtrAddr(pb.ptrs[i]) <= kPtrAddrMask, "PtrAddr");
  }
  const BlockHeader h = PeekHeader(blk.data());
  Blk again;
  EncodePointerBlock(pb, h.seq, kFuzzUuid, addr, again.data());
  Result<PointerBlock> r2 = DecodePointerBlock(again.data(), kFuzzUuid, addr);
  FUZZ_CHECK(r2.ok(), "re-encoded pointer block does not decode");
  FUZZ_CHECK(r2->level == pb.level && r2->ptrs == pb.ptrs, "pointer block changed");
  // Every byte is defined: the re-encoding equals the input, apart from the
  // minor version (written as the current one).
  if (h.major == kFormatMajor && h.minor == kFormatMinor) {
    FUZZ_CHECK(again == blk, "re-encoding differs from the input");
  }
  // An in-place edit then reseal, as the volume's cache does.
  Blk edited(again);
  const uint32_t slot = static_cast<uint32_t>(h.seq % kPointersPerBlock);
  const uint64_t v = kPtrCow | (h.seq & kPtrAddrMask);
  SetPtr(edited.data(), slot, v);
  SealBlock(edited.data(), PeekHeader(edited.data()), kFuzzUuid);
  Result<PointerBlock> r3 = DecodePointerBlock(edited.data(), kFuzzUuid, addr);
  FUZZ_CHECK(r3.ok() && r3->ptrs[slot] == v, "in-place edit lost");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::vector<Blk> seeds;
  PointerBlock pb;
  seeds.emplace_back();  // all holes
  EncodePointerBlock(pb, 1, kFuzzUuid, 70000, seeds.back().data());
  pb.ptrs[0] = 80000;
  pb.ptrs[1] = kPtrCow | 80001;
  pb.ptrs[5] = kPtrAddrMask;
  seeds.emplace_back();
  EncodePointerBlock(pb, 2, kFuzzUuid, 70001, seeds.back().data());
  pb.level = 3;
  for (uint32_t i = 0; i < 40; i++) pb.ptrs[i] = 90000 + i;
  seeds.emplace_back();
  EncodePointerBlock(pb, 3, kFuzzUuid, 70002, seeds.back().data());
  MaybeWriteSeeds(kTarget, seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Blk raw(data, size);
  const uint64_t addr = PeekHeader(raw.data()).addr;
  DecodeOne(raw, addr);
  for (bool fix_version : {false, true}) {
    Blk fixed(raw);
    FixUp(fixed.data(), kMagicPointerBlock, fix_version, kFuzzUuid);
    DecodeOne(fixed, addr);
  }
  return 0;
}
