// Fuzzes DecodeRefcountBlock and the in-place slot accessors.
//
// Property: whatever decodes agrees with GetRef, re-encodes to a block that
// decodes to the same counts, and reproduces the input block exactly (a
// refcount block has no unused bytes).
#include <cstdint>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_util.h"

using namespace dede;
using namespace dede::fuzz;

namespace {

constexpr const char* kTarget = "fuzz_refcount_block";

void DecodeOne(const Blk& blk, uint64_t addr) {
  Result<RefcountBlock> r = DecodeRefcountBlock(blk.data(), kFuzzUuid, addr);
  if (!r.ok()) {
    FUZZ_CHECK(FailedCleanly(r.status()), "error without a message");
    FUZZ_CHECK(r.status().message().find("refcount block at block " + std::to_string(addr)) !=
                   std::string::npos,
               "error does not name the block: " + r.status().message());
    return;
  }
  for (uint32_t i = 0; i < kRefsPerBlock; i++) {
    FUZZ_CHECK(GetRef(blk.data(), i) == r->refs[i], "GetRef disagrees with the decoder");
  }
  const BlockHeader h = PeekHeader(blk.data());
  Blk again;
  EncodeRefcountBlock(*r, h.seq, kFuzzUuid, addr, again.data());
  Result<RefcountBlock> r2 = DecodeRefcountBlock(again.data(), kFuzzUuid, addr);
  FUZZ_CHECK(r2.ok(), "re-encoded refcount block does not decode");
  FUZZ_CHECK(r2->refs == r->refs, "refcount block changed in a round trip");
  if (h.major == kFormatMajor && h.minor == kFormatMinor && h.flags == 0) {
    FUZZ_CHECK(again == blk, "re-encoding differs from the input");
  }
  Blk edited(again);
  const uint32_t slot = static_cast<uint32_t>(h.seq % kRefsPerBlock);
  const uint32_t v = r->refs[slot] + 1;
  SetRef(edited.data(), slot, v);
  SealBlock(edited.data(), PeekHeader(edited.data()), kFuzzUuid);
  Result<RefcountBlock> r3 = DecodeRefcountBlock(edited.data(), kFuzzUuid, addr);
  FUZZ_CHECK(r3.ok() && r3->refs[slot] == v, "in-place edit lost");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::vector<Blk> seeds;
  RefcountBlock rb;
  seeds.emplace_back();  // a fresh group: all free
  EncodeRefcountBlock(rb, 1, kFuzzUuid, 4864, seeds.back().data());
  for (uint32_t i = 0; i < 32; i++) rb.refs[i] = i % 4;
  rb.refs[20] = 0xffffffffu;
  seeds.emplace_back();
  EncodeRefcountBlock(rb, 5, kFuzzUuid, 4865, seeds.back().data());
  MaybeWriteSeeds(kTarget, seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Blk raw(data, size);
  const uint64_t addr = PeekHeader(raw.data()).addr;
  DecodeOne(raw, addr);
  for (bool fix_version : {false, true}) {
    Blk fixed(raw);
    FixUp(fixed.data(), kMagicRefcountBlock, fix_version, kFuzzUuid);
    DecodeOne(fixed, addr);
  }
  return 0;
}
