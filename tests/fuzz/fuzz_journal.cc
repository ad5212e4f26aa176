// Fuzzes DecodeJournalHeader and DecodeJournalTxn (the replay path parses
// whatever it finds in a dead host's journal ring).
//
// Property: whatever decodes re-encodes to a block that decodes to the same
// value, and the encoding is canonical (encode . decode . encode = encode).
#include <cstdint>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_util.h"

using namespace dede;
using namespace dede::fuzz;

namespace {

constexpr const char* kTarget = "fuzz_journal";

void Header(const Blk& blk, const Uuid& uuid, uint64_t addr) {
  Result<JournalHeader> r = DecodeJournalHeader(blk.data(), uuid, addr);
  if (!r.ok()) {
    FUZZ_CHECK(FailedCleanly(r.status()), "error without a message");
    FUZZ_CHECK(r.status().message().find("journal header at block " + std::to_string(addr)) !=
                   std::string::npos,
               "error does not name the block: " + r.status().message());
    return;
  }
  const uint64_t seq = PeekHeader(blk.data()).seq;
  Blk again;
  EncodeJournalHeader(*r, seq, uuid, addr, again.data());
  Result<JournalHeader> r2 = DecodeJournalHeader(again.data(), uuid, addr);
  FUZZ_CHECK(r2.ok(), "re-encoded journal header does not decode");
  FUZZ_CHECK(r2->host == r->host && r2->tail_seq == r->tail_seq && r2->tail_pos == r->tail_pos,
             "journal header changed in a round trip");
  FUZZ_CHECK(PeekHeader(again.data()).seq == seq, "journal header seq changed");
  Blk third;
  EncodeJournalHeader(*r2, seq, uuid, addr, third.data());
  FUZZ_CHECK(third == again, "journal header encoding is not canonical");
}

void Txn(const Blk& blk, const Uuid& uuid, uint64_t addr) {
  Result<JournalTxn> r = DecodeJournalTxn(blk.data(), uuid, addr);
  if (!r.ok()) {
    FUZZ_CHECK(FailedCleanly(r.status()), "error without a message");
    FUZZ_CHECK(r.status().message().find("journal transaction at block " + std::to_string(addr)) !=
                   std::string::npos,
               "error does not name the block: " + r.status().message());
    return;
  }
  FUZZ_CHECK(!r->homes.empty() && r->homes.size() <= kMaxTxnBlocks, "image count");
  FUZZ_CHECK(r->seq == PeekHeader(blk.data()).seq, "txn seq is not the header seq");
  for (uint64_t h : r->homes) FUZZ_CHECK((h & ~kPtrAddrMask) == 0, "home beyond 2^48");
  Blk again;
  EncodeJournalTxn(*r, uuid, addr, again.data());
  Result<JournalTxn> r2 = DecodeJournalTxn(again.data(), uuid, addr);
  FUZZ_CHECK(r2.ok(), "re-encoded journal transaction does not decode");
  FUZZ_CHECK(r2->seq == r->seq && r2->images_crc == r->images_crc && r2->homes == r->homes,
             "journal transaction changed in a round trip");
  Blk third;
  EncodeJournalTxn(*r2, uuid, addr, third.data());
  FUZZ_CHECK(third == again, "journal transaction encoding is not canonical");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::vector<Blk> seeds;
  const uint64_t jstart = 2560;
  JournalHeader jh;
  jh.host = 1;
  seeds.emplace_back();
  EncodeJournalHeader(jh, 1, kFuzzUuid, jstart, seeds.back().data());
  jh.host = 8;
  jh.tail_seq = 123456;
  jh.tail_pos = 200;
  seeds.emplace_back();
  EncodeJournalHeader(jh, 77, kFuzzUuid, jstart + 7 * 256, seeds.back().data());
  JournalTxn t;
  t.seq = 1;
  t.images_crc = 0x1234abcd;
  t.homes = {4608};
  seeds.emplace_back();
  EncodeJournalTxn(t, kFuzzUuid, jstart + 1, seeds.back().data());
  t.seq = 123457;
  t.homes = {4864, 4865, 4700, 90000, 4864};
  seeds.emplace_back();
  EncodeJournalTxn(t, kFuzzUuid, jstart + 201, seeds.back().data());
  MaybeWriteSeeds(kTarget, seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Blk raw(data, size);
  const uint64_t addr = PeekHeader(raw.data()).addr;
  Header(raw, kFuzzUuid, addr);
  Txn(raw, kFuzzUuid, addr);
  Txn(raw, kFuzzUuid, addr + 1);  // misplaced: must fail cleanly
  for (bool fix_version : {false, true}) {
    Blk h(raw);
    FixUp(h.data(), kMagicJournalHeader, fix_version, kFuzzUuid);
    Header(h, kFuzzUuid, addr);
    Blk t(raw);
    FixUp(t.data(), kMagicJournalTxn, fix_version, kFuzzUuid);
    Txn(t, kFuzzUuid, addr);
  }
  return 0;
}
