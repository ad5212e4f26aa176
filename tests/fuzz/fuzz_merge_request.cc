// Fuzzes the merge-request decoders (merge/merge_request.h):
// DecodeMergeGroupBlock and ParseMergeRequestFileName. A request file is
// written by another host and read by the holder of its target: a group a
// torn post, damage or a bug left behind must be refused cleanly.
//
// Input: [selector u8][index u8][block...]. The selector's bit 0 picks the
// hash algorithm; `index` is the block index the group is decoded at. The
// rest is one 4 KiB block (fuzz_util.h). Each input is also decoded as a
// "fixed-up" copy: magic, major, position, target and algorithm stamped
// in, the count clamped to 0..85, each record's clone block set to where
// it belongs unless the selector's bit 1 says otherwise, and the crc
// recomputed, so the fuzzer reaches the checks behind the crc.
//
// Properties: an error is kCorruption or kUnsupported and names what was
// decoded; a decoded group keeps the invariants (1..84 records, each clone
// block in place, target blocks below 2^52, witnesses of the algorithm's
// size) and re-encodes to exactly the input block when its minor version
// is this build's (a newer minor may carry bytes this build ignores); the
// same bytes are refused at another position, for another request file,
// another target or another volume. A parsed file name prints back as
// the same name.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "index/shard_format.h"
#include "merge/merge_request.h"
#include "tests/fuzz/fuzz_util.h"

using namespace dede;
using namespace dede::fuzz;

namespace {

constexpr const char* kTarget = "fuzz_merge_request";
constexpr size_t kPrefix = 2;
const FileId kRequestFile{12, 5};
constexpr uint64_t kTargetIno = 7;
const std::string kWhat = "fuzz requests";
constexpr Uuid kOtherUuid = {0xde, 0xde, 0x00, 0x01, 0x02, 0x03, 0x44, 0x05,
                             0x86, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0e};

// Header field offsets (docs/FORMAT.md 14.2).
constexpr size_t kOffMajor = 4, kOffMinor = 6, kOffCrc = 8, kOffAlgo = 16, kOffFpSize = 18,
                 kOffCount = 20, kOffFirstBlock = 24, kOffTargetIno = 32;

void CheckError(const Status& s) {
  FUZZ_CHECK(FailedCleanly(s), "error without a message");
  FUZZ_CHECK(s.code() == Status::Code::kCorruption || s.code() == Status::Code::kUnsupported,
             "unexpected error code: " + s.ToString());
  FUZZ_CHECK(s.message().find(kWhat) != std::string::npos,
             "error does not name what was decoded: " + s.message());
}

void DecodeOne(const Blk& blk, HashAlgo algo, uint64_t index) {
  Result<MergeGroup> r =
      DecodeMergeGroupBlock(blk.data(), algo, kFuzzUuid, kRequestFile, index, kTargetIno, kWhat);
  if (!r.ok()) {
    CheckError(r.status());
    return;
  }
  const MergeGroup& g = *r;
  FUZZ_CHECK(g.first_block == index, "group accepted at another position");
  FUZZ_CHECK(g.target.ino == kTargetIno, "group accepted for another target");
  FUZZ_CHECK(!g.records.empty() && g.records.size() <= kMaxMergeRecordsPerGroup, "record count");
  FUZZ_CHECK(g.first_block + g.blocks() - 1 <= kMaxMergeBlock, "group past the largest file");
  for (size_t i = 0; i < g.records.size(); i++) {
    const MergeRecord& rec = g.records[i];
    FUZZ_CHECK(rec.clone_block == index + 1 + i, "clone block out of place");
    FUZZ_CHECK(rec.target_block <= kMaxMergeBlock, "target block past the largest file");
    FUZZ_CHECK(rec.witness.size == HashAlgoSize(algo), "witness size");
    for (size_t k = rec.witness.size; k < rec.witness.bytes.size(); k++) {
      FUZZ_CHECK(rec.witness.bytes[k] == 0, "witness bytes past the digest");
    }
  }
  // Canonical: this minor's groups re-encode to exactly their block.
  if (DecodeU16(blk.data() + kOffMinor) == kMergeMinor &&
      DecodeU16(blk.data() + kOffMajor) == kMergeMajor) {
    Blk again;
    EncodeMergeGroupBlock(g, algo, kFuzzUuid, kRequestFile, again.data());
    FUZZ_CHECK(again == blk, "group does not re-encode to its input");
  }
  // Bound to its place, its file, its target and its volume.
  FUZZ_CHECK(!DecodeMergeGroupBlock(blk.data(), algo, kFuzzUuid, kRequestFile, index + 1,
                                    kTargetIno, kWhat)
                  .ok(),
             "group accepted at another block");
  FUZZ_CHECK(!DecodeMergeGroupBlock(blk.data(), algo, kFuzzUuid,
                                    FileId{kRequestFile.ino, kRequestFile.generation + 1}, index,
                                    kTargetIno, kWhat)
                  .ok(),
             "group accepted in another request file");
  FUZZ_CHECK(!DecodeMergeGroupBlock(blk.data(), algo, kFuzzUuid, kRequestFile, index,
                                    kTargetIno + 1, kWhat)
                  .ok(),
             "group accepted for another target");
  FUZZ_CHECK(
      !DecodeMergeGroupBlock(blk.data(), algo, kOtherUuid, kRequestFile, index, kTargetIno, kWhat)
           .ok(),
      "group accepted on another volume");
}

void FuzzGroup(const Blk& raw, uint8_t selector, uint64_t index) {
  const HashAlgo algo = (selector & 1) ? HashAlgo::kSha256 : HashAlgo::kXxh128;
  DecodeOne(raw, algo, index);

  Blk fixed(raw);
  uint8_t* p = fixed.data();
  EncodeU32(p, kMagicMergeGroup);
  EncodeU16(p + kOffMajor, kMergeMajor);
  if (selector & 4) EncodeU16(p + kOffMinor, kMergeMinor);
  EncodeU16(p + kOffAlgo, uint16_t(algo));
  EncodeU16(p + kOffFpSize, uint16_t(HashAlgoSize(algo)));
  const uint32_t count = DecodeU32(p + kOffCount) % (kMaxMergeRecordsPerGroup + 2);
  EncodeU32(p + kOffCount, count);
  EncodeU64(p + kOffFirstBlock, index);
  EncodeU64(p + kOffTargetIno, kTargetIno);
  if (!(selector & 2)) {
    for (uint32_t i = 0; i < count && i < kMaxMergeRecordsPerGroup; i++) {
      uint8_t* rec = p + kMergeGroupHeaderBytes + size_t(i) * kMergeRecordBytes;
      EncodeU64(rec + 8, index + 1 + i);
      if (selector & 8) EncodeU64(rec, DecodeU64(rec) & kMaxMergeBlock);
    }
  }
  if (selector & 16) {
    // Clear what the records do not use, so fixed-up groups pass more often.
    const size_t used =
        kMergeGroupHeaderBytes +
        size_t(count < kMaxMergeRecordsPerGroup ? count : kMaxMergeRecordsPerGroup) *
            kMergeRecordBytes;
    std::memset(p + used, 0, kBlockSize - used);
    EncodeU32(p + 60, 0);
    for (uint32_t i = 0; i < count && i < kMaxMergeRecordsPerGroup; i++) {
      uint8_t* rec = p + kMergeGroupHeaderBytes + size_t(i) * kMergeRecordBytes;
      std::memset(rec + 16 + HashAlgoSize(algo), 0, 32 - HashAlgoSize(algo));
    }
  }
  EncodeU32(p + kOffCrc, FileBlockCrc(p, kOffCrc, kFuzzUuid, kRequestFile, index));
  DecodeOne(fixed, algo, index);
}

void FuzzNames(const uint8_t* data, size_t size) {
  const std::string s(reinterpret_cast<const char*>(data), size < 40 ? size : 40);
  for (const std::string& name : {s, ".dede-mr-" + s}) {
    std::optional<uint64_t> ino = ParseMergeRequestFileName(name);
    if (ino) {
      FUZZ_CHECK(*ino != 0, "inode 0 parsed");
      FUZZ_CHECK(MergeRequestFileName(*ino) == name, "name does not print back");
    }
  }
}

std::vector<uint8_t> WithPrefix(uint8_t selector, uint8_t index, const Blk& blk) {
  size_t len = kBlockSize;
  while (len > 0 && blk.data()[len - 1] == 0) len--;
  std::vector<uint8_t> v = {selector, index};
  v.insert(v.end(), blk.data(), blk.data() + len);
  return v;
}

std::vector<Blk> Seeds() {
  std::vector<std::vector<uint8_t>> inputs;
  for (int which = 0; which < 4; which++) {
    const HashAlgo algo = (which & 1) ? HashAlgo::kSha256 : HashAlgo::kXxh128;
    const size_t n = which < 2 ? 3 : kMaxMergeRecordsPerGroup;
    const uint8_t index = uint8_t(4 * which);
    MergeGroup g;
    g.target = FileId{kTargetIno, 2};
    g.first_block = index;
    g.posted_ns = 1'700'000'000'000'000'000ull;
    g.host_id = 3;
    for (size_t i = 0; i < n; i++) {
      uint8_t content[64];
      for (size_t k = 0; k < sizeof content; k++) content[k] = uint8_t(i * 31 + k);
      g.records.push_back(MergeRecord{1000 + 3 * i, index + 1 + i,
                                      ComputeFingerprint(algo, content, sizeof content)});
    }
    Blk blk;
    EncodeMergeGroupBlock(g, algo, kFuzzUuid, kRequestFile, blk.data());
    inputs.push_back(WithPrefix(uint8_t(which & 1), index, blk));
    inputs.push_back(WithPrefix(uint8_t((which & 1) | 16), index, blk));
  }
  std::vector<Blk> seeds;
  for (const auto& in : inputs) seeds.emplace_back(in.data(), in.size());
  return seeds;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  MaybeWriteSeeds(kTarget, Seeds());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const uint8_t selector = size > 0 ? data[0] : 0;
  const uint64_t index = size > 1 ? data[1] : 0;
  const uint8_t* body = size > kPrefix ? data + kPrefix : data;
  const size_t body_size = size > kPrefix ? size - kPrefix : 0;
  const Blk raw(body, body_size);
  FuzzGroup(raw, selector, index);
  FuzzNames(body, body_size);
  return 0;
}
