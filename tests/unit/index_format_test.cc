// Tests for the index shard encodings (index/shard_format.h): header, entry
// block, file-table block and pending-frame round trips for both hash
// algorithms and a spread of depths; every damaged, misplaced or foreign
// block is refused; the field checks behind the crc; entry sizes; the file
// name helpers; and ShardRange arithmetic.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "index/shard_format.h"
#include "util/coding.h"

using namespace dede;

namespace {

constexpr Uuid kUuid = {0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe,
                        0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef};
constexpr Uuid kOtherUuid = {0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe,
                             0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xee};
const FileId kShard{41, 7};

constexpr uint32_t kDepths[] = {0, 7, 8, 9, 16, 40};
constexpr HashAlgo kAlgos[] = {HashAlgo::kXxh128, HashAlgo::kSha256};

// Header field offsets (see EncodeShardHeader).
constexpr size_t kHdrMajor = 4, kHdrMinor = 6, kHdrCrc = 8, kHdrDepth = 16, kHdrFpSize = 17,
                 kHdrElided = 18, kHdrEntrySize = 19, kHdrAlgo = 20, kHdrLo = 24,
                 kHdrEntryCount = 40, kHdrEntryBlocks = 48, kHdrUnique = 56, kHdrShared = 64,
                 kHdrFileCount = 72, kHdrFileBlocks = 80, kHdrArenaNext = 88;

using Block = std::vector<uint8_t>;

bool Contains(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}

// A range at `depth` whose lo has "interesting" bits (aligned to the depth).
ShardRange RangeAt(uint32_t depth) {
  if (depth == 0) return ShardRange{0, 0};
  const uint64_t span_mask = (~0ull) >> depth;
  return ShardRange{depth, 0xa5c3'96e1'7b2d'4f08ull & ~span_mask};
}

// A key of `algo` whose 64-bit prefix lies in `r` (bytes past the hash size
// stay zero, as KeyOf leaves them).
FpKey KeyIn(const ShardRange& r, HashAlgo algo, std::mt19937_64& rng) {
  FpKey k{};
  const size_t size = HashAlgoSize(algo);
  for (size_t i = 0; i < size; i++) k[i] = static_cast<uint8_t>(rng());
  uint64_t prefix = rng();
  if (r.depth > 0) prefix = r.lo | (prefix & ((~0ull) >> r.depth));
  for (int i = 0; i < 8; i++) k[size_t(i)] = static_cast<uint8_t>(prefix >> (56 - 8 * i));
  return k;
}

ShardHeader SampleHeader(HashAlgo algo, const ShardRange& r) {
  ShardHeader h;
  h.range = r;
  h.algo = algo;
  h.version = 0x1234'5678'9abcull;
  h.entry_size = EntrySize(algo, r);
  const uint64_t per = EntriesPerBlock(h.entry_size);
  h.unique_count = 6000;
  h.shared_count = 1234;
  h.entry_count = h.unique_count + h.shared_count;
  h.entry_blocks = (h.entry_count + per - 1) / per;
  h.file_count = 300;
  h.file_blocks = (h.file_count + kFilesPerBlock - 1) / kFilesPerBlock;
  h.arena_next = 98765;
  h.created_ns = 1'700'000'000'123'456'789ull;
  h.update_ns = 42'000'000;
  h.host_id = 3;
  return h;
}

Block EncodeHeader(const ShardHeader& h, const Uuid& uuid = kUuid, FileId file = kShard) {
  Block b(kBlockSize, 0xee);
  EncodeShardHeader(h, uuid, file, b.data());
  return b;
}

void ResealHeader(Block& b, const Uuid& uuid = kUuid, FileId file = kShard) {
  EncodeU32(b.data() + kHdrCrc, FileBlockCrc(b.data(), kHdrCrc, uuid, file, 0));
}

void ResealBlock(Block& b, uint64_t index, const Uuid& uuid = kUuid, FileId file = kShard) {
  EncodeU32(b.data() + 4, FileBlockCrc(b.data(), 4, uuid, file, index));
}

bool SameHeader(const ShardHeader& a, const ShardHeader& b) {
  return a.range == b.range && a.version == b.version && a.algo == b.algo &&
         a.entry_size == b.entry_size && a.entry_count == b.entry_count &&
         a.entry_blocks == b.entry_blocks && a.unique_count == b.unique_count &&
         a.shared_count == b.shared_count && a.file_count == b.file_count &&
         a.file_blocks == b.file_blocks && a.arena_next == b.arena_next &&
         a.created_ns == b.created_ns && a.update_ns == b.update_ns && a.host_id == b.host_id;
}

// `n` sorted distinct entries in `r`: every third one Shared, the Unique
// ones spread over `files` file-table slots, extreme field values mixed in.
std::vector<EncodedEntry> SampleEntries(HashAlgo algo, const ShardRange& r, size_t n,
                                        uint32_t files, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::set<FpKey> keys;
  while (keys.size() < n) keys.insert(KeyIn(r, algo, rng));
  std::vector<EncodedEntry> out;
  size_t i = 0;
  for (const FpKey& k : keys) {
    EncodedEntry ee;
    ee.e.fp = k;
    if (i % 3 == 2) {
      ee.e.kind = EntryKind::kShared;
      ee.e.arena = i == 2 ? kMaxArenaIndex : rng() % 100000;
    } else {
      ee.e.kind = EntryKind::kUnique;
      ee.file_ref = i == 0 ? uint32_t(kMaxEntryFileRef) : uint32_t(i % files);
      ee.e.block = i == 1 ? kMaxEntryBlock : rng() % (1ull << 30);
    }
    out.push_back(ee);
    i++;
  }
  return out;
}

bool SameEntry(const EncodedEntry& a, const EncodedEntry& b) {
  if (a.e.fp != b.e.fp || a.e.kind != b.e.kind) return false;
  if (a.e.kind == EntryKind::kShared) return a.e.arena == b.e.arena;
  return a.file_ref == b.file_ref && a.e.block == b.e.block;
}

std::vector<PendingRecord> SampleRecords(HashAlgo algo, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<PendingRecord> out;
  for (size_t i = 0; i < n; i++) {
    PendingRecord r;
    r.fp = KeyIn(ShardRange{0, 0}, algo, rng);
    r.file = FileId{rng() % 1000 + 1, rng() % 5};
    r.block = i == 0 ? ~0ull : rng();
    out.push_back(r);
  }
  return out;
}

bool SameRecord(const PendingRecord& a, const PendingRecord& b) {
  return a.fp == b.fp && a.file == b.file && a.block == b.block;
}

}  // namespace

// ---------------------------------------------------------------- header

TEST_CASE("index: shard header round trip for both algorithms and all depths", "[index]") {
  for (HashAlgo algo : kAlgos) {
    for (uint32_t depth : kDepths) {
      CAPTURE(HashAlgoName(algo), depth);
      const ShardHeader h = SampleHeader(algo, RangeAt(depth));
      Block b = EncodeHeader(h);
      auto d = DecodeShardHeader(b.data(), kUuid, kShard, "shard x");
      REQUIRE(d.ok());
      CHECK(SameHeader(*d, h));
      CHECK(d->entry_size == EntrySize(algo, h.range));
      // The encoding zeroes the whole block first (no stale bytes leak).
      CHECK(std::all_of(b.begin() + 128, b.end(), [](uint8_t c) { return c == 0; }));
      // Canonical: re-encoding the decoded header gives the same bytes.
      CHECK(EncodeHeader(*d) == b);
    }
  }
}

TEST_CASE("index: every single-byte change of a header block is rejected", "[index]") {
  for (HashAlgo algo : kAlgos) {
    CAPTURE(HashAlgoName(algo));
    const Block good = EncodeHeader(SampleHeader(algo, RangeAt(9)));
    REQUIRE(DecodeShardHeader(good.data(), kUuid, kShard, "s").ok());
    size_t accepted = 0;
    for (size_t i = 0; i < kBlockSize; i++) {
      for (uint8_t x : {uint8_t(0x01), uint8_t(0x80), uint8_t(0xff)}) {
        Block b = good;
        b[i] ^= x;
        auto d = DecodeShardHeader(b.data(), kUuid, kShard, "s");
        if (d.ok() || d.status().code() != Status::Code::kCorruption) {
          UNSCOPED_INFO("byte " << i << " xor " << int(x) << " accepted");
          accepted++;
        }
      }
    }
    CHECK(accepted == 0);
  }
}

TEST_CASE("index: a header of another file or volume is rejected", "[index]") {
  const Block b = EncodeHeader(SampleHeader(HashAlgo::kXxh128, RangeAt(8)));
  REQUIRE(DecodeShardHeader(b.data(), kUuid, kShard, "s").ok());
  auto other_uuid = DecodeShardHeader(b.data(), kOtherUuid, kShard, "s");
  auto other_ino =
      DecodeShardHeader(b.data(), kUuid, FileId{kShard.ino + 1, kShard.generation}, "s");
  auto other_gen =
      DecodeShardHeader(b.data(), kUuid, FileId{kShard.ino, kShard.generation + 1}, "s");
  for (auto* r : {&other_uuid, &other_ino, &other_gen}) {
    REQUIRE_FALSE(r->ok());
    CHECK(r->status().code() == Status::Code::kCorruption);
  }
  // The crc binds block index 0: an entry-block-style crc at index 1 fails.
  Block moved = b;
  EncodeU32(moved.data() + kHdrCrc, FileBlockCrc(moved.data(), kHdrCrc, kUuid, kShard, 1));
  CHECK_FALSE(DecodeShardHeader(moved.data(), kUuid, kShard, "s").ok());
  // Other magics (entry block, file table) are not headers.
  Block wrong = b;
  EncodeU32(wrong.data(), kMagicShardEntries);
  ResealHeader(wrong);
  CHECK_FALSE(DecodeShardHeader(wrong.data(), kUuid, kShard, "s").ok());
}

TEST_CASE("index: header versions", "[index]") {
  const ShardHeader h = SampleHeader(HashAlgo::kSha256, RangeAt(16));
  SECTION("newer major is unsupported and named") {
    Block b = EncodeHeader(h);
    EncodeU16(b.data() + kHdrMajor, kShardMajor + 1);
    ResealHeader(b);
    auto d = DecodeShardHeader(b.data(), kUuid, kShard, "shard .dede-ix-10");
    REQUIRE_FALSE(d.ok());
    CHECK(d.status().code() == Status::Code::kUnsupported);
    CHECK(Contains(d.status().message(), "shard .dede-ix-10"));
  }
  SECTION("major 0 is corrupt") {
    Block b = EncodeHeader(h);
    EncodeU16(b.data() + kHdrMajor, 0);
    ResealHeader(b);
    auto d = DecodeShardHeader(b.data(), kUuid, kShard, "s");
    REQUIRE_FALSE(d.ok());
    CHECK(d.status().code() == Status::Code::kCorruption);
  }
  SECTION("newer minor with a non-zero tail still decodes") {
    Block b = EncodeHeader(h);
    EncodeU16(b.data() + kHdrMinor, kShardMinor + 1);
    b[kBlockSize - 1] = 0x77;  // a field a newer minor added
    EncodeU32(b.data() + kHdrCrc + 4, 2);  // and a flag it defined
    ResealHeader(b);
    auto d = DecodeShardHeader(b.data(), kUuid, kShard, "s");
    REQUIRE(d.ok());
    CHECK(SameHeader(*d, h));
  }
}

TEST_CASE("index: header field checks behind the crc", "[index]") {
  const ShardHeader h = SampleHeader(HashAlgo::kXxh128, RangeAt(9));
  auto expect_bad = [&](const std::function<void(Block&)>& edit, const std::string& why) {
    Block b = EncodeHeader(h);
    edit(b);
    ResealHeader(b);
    auto d = DecodeShardHeader(b.data(), kUuid, kShard, "shard q");
    CAPTURE(why);
    REQUIRE_FALSE(d.ok());
    CHECK(d.status().code() == Status::Code::kCorruption);
    CHECK(Contains(d.status().message(), "shard q"));
  };
  expect_bad([](Block& b) { EncodeU32(b.data() + kHdrCrc + 4, 1); }, "flags");
  expect_bad([](Block& b) { EncodeU32(b.data() + kHdrAlgo, 0); }, "algo 0");
  expect_bad([](Block& b) { EncodeU32(b.data() + kHdrAlgo, 3); }, "algo 3");
  expect_bad([](Block& b) { b[kHdrDepth] = 41; }, "depth 41");
  expect_bad([](Block& b) { b[kHdrDepth] = 0xff; }, "depth 255");
  expect_bad([](Block& b) { EncodeU64(b.data() + kHdrLo, DecodeU64(b.data() + kHdrLo) | 1); },
             "lo not aligned");
  expect_bad([](Block& b) { b[kHdrFpSize] = 32; }, "fp size");
  expect_bad([](Block& b) { b[kHdrElided] = 0; }, "elided");
  expect_bad([](Block& b) { b[kHdrEntrySize] = 23; }, "entry size");
  expect_bad([](Block& b) { b[kHdrDepth] = 8; }, "depth 8 leaves lo unaligned");
  expect_bad(
      [](Block& b) {
        EncodeU64(b.data() + kHdrEntryBlocks, DecodeU64(b.data() + kHdrEntryBlocks) + 1);
      },
      "entry blocks");
  expect_bad(
      [](Block& b) { EncodeU64(b.data() + kHdrUnique, DecodeU64(b.data() + kHdrUnique) + 1); },
      "counts disagree");
  expect_bad([](Block& b) { EncodeU64(b.data() + kHdrFileBlocks, 0); }, "file blocks");
  expect_bad(
      [](Block& b) {
        EncodeU64(b.data() + kHdrFileCount, kMaxEntryFileRef + 2);
        EncodeU64(b.data() + kHdrFileBlocks,
                  (kMaxEntryFileRef + 2 + kFilesPerBlock - 1) / kFilesPerBlock);
      },
      "too many files");
  expect_bad([](Block& b) { EncodeU64(b.data() + kHdrArenaNext, kMaxArenaIndex + 2); }, "arena");
  // Counts whose sums wrap around 2^64 must not pass as consistent.
  expect_bad(
      [](Block& b) {
        EncodeU64(b.data() + kHdrEntryCount, ~0ull);
        EncodeU64(b.data() + kHdrEntryBlocks, 0);
        EncodeU64(b.data() + kHdrUnique, ~0ull);
        EncodeU64(b.data() + kHdrShared, 0);
      },
      "entry count wraps the block count");
  expect_bad(
      [](Block& b) {
        EncodeU64(b.data() + kHdrEntryCount, 0);
        EncodeU64(b.data() + kHdrEntryBlocks, 0);
        EncodeU64(b.data() + kHdrUnique, ~0ull);
        EncodeU64(b.data() + kHdrShared, 1);
      },
      "unique + shared wraps");
  expect_bad(
      [&](Block& b) {
        // 2^52 entry blocks: the file would not fit a volume file, and
        // (1 + blocks) * 4096 wraps.
        const uint64_t per = EntriesPerBlock(EntrySize(h.algo, h.range));
        EncodeU64(b.data() + kHdrEntryCount, per << 52);
        EncodeU64(b.data() + kHdrEntryBlocks, 1ull << 52);
        EncodeU64(b.data() + kHdrUnique, per << 52);
        EncodeU64(b.data() + kHdrShared, 0);
      },
      "entry blocks beyond any file");
  expect_bad(
      [&](Block& b) {
        // 2^52 - 1 entry blocks: the count itself is in range, but with
        // the header the file has 2^52 blocks, and 2^52 * 4096 wraps to 0
        // (ShardReader::Open then took any file as long enough).
        const uint64_t per = EntriesPerBlock(EntrySize(h.algo, h.range));
        const uint64_t blocks = (1ull << 52) - 1;
        EncodeU64(b.data() + kHdrEntryCount, per * blocks);
        EncodeU64(b.data() + kHdrEntryBlocks, blocks);
        EncodeU64(b.data() + kHdrUnique, per * blocks);
        EncodeU64(b.data() + kHdrShared, 0);
        EncodeU64(b.data() + kHdrFileCount, 0);
        EncodeU64(b.data() + kHdrFileBlocks, 0);
      },
      "header, entries and file table wrap the byte size");
  // Limits themselves are fine.
  Block b = EncodeHeader(h);
  EncodeU64(b.data() + kHdrFileCount, kMaxEntryFileRef + 1);
  EncodeU64(b.data() + kHdrFileBlocks,
            (kMaxEntryFileRef + 1 + kFilesPerBlock - 1) / kFilesPerBlock);
  EncodeU64(b.data() + kHdrArenaNext, kMaxArenaIndex + 1);
  ResealHeader(b);
  CHECK(DecodeShardHeader(b.data(), kUuid, kShard, "s").ok());
}

// ---------------------------------------------------------------- entries

TEST_CASE("index: entry block round trip for both algorithms and all depths", "[index]") {
  for (HashAlgo algo : kAlgos) {
    for (uint32_t depth : kDepths) {
      CAPTURE(HashAlgoName(algo), depth);
      const ShardRange r = RangeAt(depth);
      const ShardHeader h = SampleHeader(algo, r);
      const uint32_t per = EntriesPerBlock(EntrySize(algo, r));
      for (size_t n : {size_t(1), size_t(2), size_t(per - 1), size_t(per)}) {
        CAPTURE(n);
        const auto entries = SampleEntries(algo, r, n, 5, depth * 100 + n);
        const uint64_t index = 1 + n % 4;
        Block b(kBlockSize, 0xcc);
        EncodeEntryBlock(entries.data(), n, h, kUuid, kShard, index, b.data());
        std::vector<EncodedEntry> out = {EncodedEntry{}};  // appends
        Status s = DecodeEntryBlock(b.data(), h, kUuid, kShard, index, &out, "s");
        REQUIRE(s.ok());
        REQUIRE(out.size() == n + 1);
        bool same = true;
        for (size_t i = 0; i < n; i++) same &= SameEntry(out[i + 1], entries[i]);
        CHECK(same);
        // The elided prefix bytes come back from lo.
        for (size_t i = 1; i < out.size(); i++) {
          CHECK(r.Contains(KeyPrefix(out[i].e.fp)));
        }
        // Bytes past the last entry are zero.
        const size_t used = kShardBlockHeader + n * EntrySize(algo, r);
        CHECK(std::all_of(b.begin() + long(used), b.end(), [](uint8_t c) { return c == 0; }));
      }
    }
  }
}

TEST_CASE("index: the elided prefix is stored once per shard", "[index]") {
  // Two keys that differ only in their elided bytes encode identically:
  // the range decides those bytes.
  const ShardRange r = RangeAt(16);
  const ShardHeader h = SampleHeader(HashAlgo::kXxh128, r);
  std::mt19937_64 rng(5);
  EncodedEntry a;
  a.e.fp = KeyIn(r, HashAlgo::kXxh128, rng);
  a.e.kind = EntryKind::kShared;
  a.e.arena = 9;
  EncodedEntry b = a;
  b.e.fp[0] ^= 0xff;
  b.e.fp[1] ^= 0x0f;
  Block ba(kBlockSize), bb(kBlockSize);
  EncodeEntryBlock(&a, 1, h, kUuid, kShard, 1, ba.data());
  EncodeEntryBlock(&b, 1, h, kUuid, kShard, 1, bb.data());
  CHECK(ba == bb);
  std::vector<EncodedEntry> out;
  REQUIRE(DecodeEntryBlock(bb.data(), h, kUuid, kShard, 1, &out, "s").ok());
  REQUIRE(out.size() == 1);
  CHECK(out[0].e.fp == a.e.fp);
}

TEST_CASE("index: every sampled byte change of an entry block is rejected", "[index]") {
  for (HashAlgo algo : kAlgos) {
    CAPTURE(HashAlgoName(algo));
    const ShardRange r = RangeAt(8);
    const ShardHeader h = SampleHeader(algo, r);
    const uint32_t per = EntriesPerBlock(EntrySize(algo, r));
    const auto entries = SampleEntries(algo, r, per, 3, 77);
    Block good(kBlockSize);
    EncodeEntryBlock(entries.data(), entries.size(), h, kUuid, kShard, 3, good.data());
    std::vector<EncodedEntry> out;
    REQUIRE(DecodeEntryBlock(good.data(), h, kUuid, kShard, 3, &out, "s").ok());
    size_t accepted = 0, tried = 0;
    for (size_t i = 0; i < kBlockSize; i += (i < kShardBlockHeader ? 1 : 7)) {
      for (uint8_t x : {uint8_t(0x01), uint8_t(0xff)}) {
        Block b = good;
        b[i] ^= x;
        out.clear();
        Status s = DecodeEntryBlock(b.data(), h, kUuid, kShard, 3, &out, "s");
        tried++;
        if (s.ok() || s.code() != Status::Code::kCorruption || !out.empty()) {
          UNSCOPED_INFO("byte " << i << " xor " << int(x) << " accepted");
          accepted++;
        }
      }
    }
    CHECK(tried > 1000);
    CHECK(accepted == 0);
  }
}

TEST_CASE("index: an entry block at another index or of another file or volume is rejected",
          "[index]") {
  const ShardRange r = RangeAt(7);
  const ShardHeader h = SampleHeader(HashAlgo::kXxh128, r);
  const auto entries = SampleEntries(HashAlgo::kXxh128, r, 50, 3, 1);
  Block b(kBlockSize);
  EncodeEntryBlock(entries.data(), entries.size(), h, kUuid, kShard, 12, b.data());
  std::vector<EncodedEntry> out;
  REQUIRE(DecodeEntryBlock(b.data(), h, kUuid, kShard, 12, &out, "shard e").ok());
  out.clear();
  for (uint64_t index : {uint64_t(0), uint64_t(11), uint64_t(13), (uint64_t(1) << 32) + 12}) {
    CAPTURE(index);
    Status s = DecodeEntryBlock(b.data(), h, kUuid, kShard, index, &out, "shard e");
    CHECK(s.code() == Status::Code::kCorruption);
    CHECK(Contains(s.message(), "shard e"));
    CHECK(Contains(s.message(), std::to_string(index)));
  }
  CHECK(
      DecodeEntryBlock(b.data(), h, kUuid, FileId{kShard.ino, kShard.generation + 1}, 12, &out, "s")
          .code() == Status::Code::kCorruption);
  CHECK(
      DecodeEntryBlock(b.data(), h, kUuid, FileId{kShard.ino + 1, kShard.generation}, 12, &out, "s")
          .code() == Status::Code::kCorruption);
  CHECK(DecodeEntryBlock(b.data(), h, kOtherUuid, kShard, 12, &out, "s").code() ==
        Status::Code::kCorruption);
  CHECK(out.empty());
  // A header block or file-table block is not an entry block even at the
  // right place.
  Block hb = EncodeHeader(h);
  CHECK_FALSE(DecodeEntryBlock(hb.data(), h, kUuid, kShard, 0, &out, "s").ok());
  const FileId files[2] = {{1, 1}, {2, 1}};
  Block fb(kBlockSize);
  EncodeFileTableBlock(files, 2, kUuid, kShard, 12, fb.data());
  CHECK_FALSE(DecodeEntryBlock(fb.data(), h, kUuid, kShard, 12, &out, "s").ok());
  CHECK(out.empty());
}

TEST_CASE("index: entry block counts out of range are rejected", "[index]") {
  for (HashAlgo algo : kAlgos) {
    const ShardRange r = RangeAt(0);
    const ShardHeader h = SampleHeader(algo, r);
    const uint32_t per = EntriesPerBlock(EntrySize(algo, r));
    const auto entries = SampleEntries(algo, r, 10, 2, 3);
    Block good(kBlockSize);
    EncodeEntryBlock(entries.data(), entries.size(), h, kUuid, kShard, 1, good.data());
    for (uint32_t n : {0u, per + 1, 0xffffu}) {
      CAPTURE(HashAlgoName(algo), n);
      Block b = good;
      EncodeU16(b.data() + 8, uint16_t(n));
      ResealBlock(b, 1);
      std::vector<EncodedEntry> out;
      Status s = DecodeEntryBlock(b.data(), h, kUuid, kShard, 1, &out, "s");
      CHECK(s.code() == Status::Code::kCorruption);
      CHECK(out.empty());
    }
    // A full count is fine (bytes past the 10 real entries decode as
    // zero-keyed entries: the crc, not the count, vouches for them).
    Block b = good;
    EncodeU16(b.data() + 8, uint16_t(per));
    ResealBlock(b, 1);
    std::vector<EncodedEntry> out;
    CHECK(DecodeEntryBlock(b.data(), h, kUuid, kShard, 1, &out, "s").ok());
    CHECK(out.size() == per);
  }
}

TEST_CASE("index: entry sizes", "[index]") {
  for (uint32_t depth : kDepths) {
    CAPTURE(depth);
    const ShardRange r = RangeAt(depth);
    const uint32_t x = EntrySize(HashAlgo::kXxh128, r);
    CHECK(x <= 23);
    CHECK(x == 16 - depth / 8 + 7);
    CHECK(EntrySize(HashAlgo::kSha256, r) == 32 - depth / 8 + 7);
    const uint32_t per = EntriesPerBlock(x);
    CHECK(per * x + kShardBlockHeader <= kBlockSize);
    CHECK((per + 1) * x + kShardBlockHeader > kBlockSize);
    CHECK(kBlockSize / per <= 24);  // a full block averages <= 24 bytes per entry
    CHECK(double(kBlockSize) / per <= 24.0);
  }
  CHECK(EntrySize(HashAlgo::kXxh128, ShardRange{0, 0}) == 23);
  CHECK(EntriesPerBlock(23) == 177);
  // Entry counts fit the u16 count field.
  CHECK(EntriesPerBlock(EntrySize(HashAlgo::kXxh128, RangeAt(40))) <= 0xffff);
  CHECK(kFilesPerBlock == 255);  // (4096 - 12) / 16
}

// ---------------------------------------------------------------- file table

TEST_CASE("index: file table block round trip and damage", "[index]") {
  std::vector<FileId> files;
  for (uint64_t i = 0; i < kFilesPerBlock; i++) files.push_back(FileId{1000 + i * 3, i * i});
  files[0] = FileId{~0ull, ~0ull};
  for (size_t n : {size_t(1), size_t(7), size_t(kFilesPerBlock)}) {
    CAPTURE(n);
    Block b(kBlockSize, 0x5a);
    EncodeFileTableBlock(files.data(), n, kUuid, kShard, 30, b.data());
    std::vector<FileId> out = {FileId{5, 5}};  // appends
    REQUIRE(DecodeFileTableBlock(b.data(), kUuid, kShard, 30, &out, "s").ok());
    REQUIRE(out.size() == n + 1);
    CHECK(std::equal(files.begin(), files.begin() + long(n), out.begin() + 1));

    out.clear();
    CHECK(DecodeFileTableBlock(b.data(), kUuid, kShard, 31, &out, "shard f").code() ==
          Status::Code::kCorruption);
    CHECK(DecodeFileTableBlock(b.data(), kOtherUuid, kShard, 30, &out, "s").code() ==
          Status::Code::kCorruption);
    CHECK(DecodeFileTableBlock(b.data(), kUuid, FileId{kShard.ino, 0}, 30, &out, "s").code() ==
          Status::Code::kCorruption);
    size_t accepted = 0;
    for (size_t i = 0; i < kBlockSize; i += (i < kShardBlockHeader ? 1 : 5)) {
      Block c = b;
      c[i] ^= 0x10;
      if (DecodeFileTableBlock(c.data(), kUuid, kShard, 30, &out, "s").ok()) accepted++;
    }
    CHECK(accepted == 0);
    CHECK(out.empty());
  }
  // Count out of range behind a valid crc.
  Block b(kBlockSize);
  EncodeFileTableBlock(files.data(), 3, kUuid, kShard, 2, b.data());
  for (uint32_t n : {0u, kFilesPerBlock + 1}) {
    Block c = b;
    EncodeU16(c.data() + 8, uint16_t(n));
    ResealBlock(c, 2);
    std::vector<FileId> out;
    CHECK(DecodeFileTableBlock(c.data(), kUuid, kShard, 2, &out, "s").code() ==
          Status::Code::kCorruption);
    CHECK(out.empty());
  }
  // An entry block is not a file-table block.
  const ShardHeader h = SampleHeader(HashAlgo::kXxh128, RangeAt(0));
  const auto entries = SampleEntries(HashAlgo::kXxh128, h.range, 4, 2, 9);
  Block eb(kBlockSize);
  EncodeEntryBlock(entries.data(), entries.size(), h, kUuid, kShard, 2, eb.data());
  std::vector<FileId> out;
  CHECK_FALSE(DecodeFileTableBlock(eb.data(), kUuid, kShard, 2, &out, "s").ok());
}

// ---------------------------------------------------------------- pending

TEST_CASE("index: pending frame round trip", "[index]") {
  for (HashAlgo algo : kAlgos) {
    const uint32_t per = PendingRecordsPerBlock(algo);
    CHECK(PendingRecordSize(algo) == HashAlgoSize(algo) + 24);
    CHECK(per == kBlockSize / (HashAlgoSize(algo) + 24));
    for (size_t n : {size_t(0), size_t(1), size_t(per), size_t(per + 1), size_t(3 * per + 17)}) {
      CAPTURE(HashAlgoName(algo), n);
      const auto recs = SampleRecords(algo, n, n + 1);
      const uint64_t first = 5 + n;
      const std::vector<uint8_t> frame = EncodePendingFrame(recs, algo, kUuid, kShard, first);
      const uint64_t blocks = 1 + (n + per - 1) / per;
      REQUIRE(frame.size() == blocks * kBlockSize);
      // Followed by other bytes (the next frame): only its own blocks count.
      std::vector<uint8_t> buf = frame;
      buf.resize(frame.size() + 2 * kBlockSize, 0x33);
      std::vector<PendingRecord> out;
      uint64_t fb = 99;
      Status s =
          DecodePendingFrame(buf.data(), buf.size(), algo, kUuid, kShard, first, &out, &fb, "p");
      REQUIRE(s.ok());
      CHECK(fb == blocks);
      REQUIRE(out.size() == n);
      bool same = true;
      for (size_t i = 0; i < n; i++) same &= SameRecord(out[i], recs[i]);
      CHECK(same);
      // Canonical.
      CHECK(EncodePendingFrame(out, algo, kUuid, kShard, first) == frame);
    }
  }
}

TEST_CASE("index: damaged misplaced and foreign pending frames are rejected", "[index]") {
  for (HashAlgo algo : kAlgos) {
    CAPTURE(HashAlgoName(algo));
    const uint32_t per = PendingRecordsPerBlock(algo);
    const auto recs = SampleRecords(algo, per + 3, 8);
    const uint64_t first = 4;
    const std::vector<uint8_t> good = EncodePendingFrame(recs, algo, kUuid, kShard, first);
    REQUIRE(good.size() == 3 * kBlockSize);
    std::vector<PendingRecord> out;
    uint64_t fb = 0;
    auto decode = [&](const std::vector<uint8_t>& buf, size_t len, HashAlgo a, const Uuid& u,
                      FileId f, uint64_t at) {
      out.clear();
      return DecodePendingFrame(buf.data(), len, a, u, f, at, &out, &fb, "pending z");
    };
    REQUIRE(decode(good, good.size(), algo, kUuid, kShard, first).ok());

    // Every sampled byte of header and records.
    size_t accepted = 0;
    for (size_t i = 0; i < good.size(); i += (i < 64 ? 1 : 11)) {
      std::vector<uint8_t> b = good;
      b[i] ^= 0x04;
      Status s = decode(b, b.size(), algo, kUuid, kShard, first);
      if (s.ok() || s.code() != Status::Code::kCorruption || !out.empty()) accepted++;
    }
    CHECK(accepted == 0);

    auto expect = [&](Status s, Status::Code code) {
      CHECK(s.code() == code);
      CHECK(Contains(s.message(), "pending z"));
      CHECK(out.empty());
    };
    expect(decode(good, good.size(), algo, kUuid, kShard, first + 1), Status::Code::kCorruption);
    expect(decode(good, good.size(), algo, kOtherUuid, kShard, first), Status::Code::kCorruption);
    expect(decode(good, good.size(), algo, kUuid, FileId{kShard.ino, 9}, first),
           Status::Code::kCorruption);
    const HashAlgo other = algo == HashAlgo::kXxh128 ? HashAlgo::kSha256 : HashAlgo::kXxh128;
    expect(decode(good, good.size(), other, kUuid, kShard, first), Status::Code::kCorruption);
    // Cut short: the header alone, one record block, less than a block.
    expect(decode(good, 2 * kBlockSize, algo, kUuid, kShard, first), Status::Code::kCorruption);
    CHECK(fb == 3);  // the header was valid: its size is known
    expect(decode(good, kBlockSize, algo, kUuid, kShard, first), Status::Code::kCorruption);
    expect(decode(good, kBlockSize - 1, algo, kUuid, kShard, first), Status::Code::kCorruption);
    CHECK(fb == 0);
    expect(decode(good, 0, algo, kUuid, kShard, first), Status::Code::kCorruption);

    // Newer major behind a valid crc: unsupported.
    std::vector<uint8_t> newer = good;
    EncodeU16(newer.data() + 4, kShardMajor + 1);
    EncodeU32(newer.data() + 8, FileBlockCrc(newer.data(), 8, kUuid, kShard, first));
    expect(decode(newer, newer.size(), algo, kUuid, kShard, first), Status::Code::kUnsupported);
    // Major 0 behind a valid crc: corrupt.
    std::vector<uint8_t> zero = good;
    EncodeU16(zero.data() + 4, 0);
    EncodeU32(zero.data() + 8, FileBlockCrc(zero.data(), 8, kUuid, kShard, first));
    expect(decode(zero, zero.size(), algo, kUuid, kShard, first), Status::Code::kCorruption);
    // A count beyond 2^32 behind a valid crc.
    std::vector<uint8_t> huge = good;
    EncodeU64(huge.data() + 16, (1ull << 32) + 1);
    EncodeU32(huge.data() + 8, FileBlockCrc(huge.data(), 8, kUuid, kShard, first));
    expect(decode(huge, huge.size(), algo, kUuid, kShard, first), Status::Code::kCorruption);
    EncodeU64(huge.data() + 16, ~0ull);
    EncodeU32(huge.data() + 8, FileBlockCrc(huge.data(), 8, kUuid, kShard, first));
    expect(decode(huge, huge.size(), algo, kUuid, kShard, first), Status::Code::kCorruption);
    // The frame index field must match where it is, even with a valid crc.
    std::vector<uint8_t> moved = good;
    EncodeU64(moved.data() + 24, first + 1);
    EncodeU32(moved.data() + 8, FileBlockCrc(moved.data(), 8, kUuid, kShard, first));
    expect(decode(moved, moved.size(), algo, kUuid, kShard, first), Status::Code::kCorruption);
  }
}

// ---------------------------------------------------------------- names

TEST_CASE("index: file name round trips", "[index]") {
  CHECK(ShardFileName(ShardRange{0, 0}, 1) == ".dede-ix-00-0000000000000000-0000000000000001");
  CHECK(PendingFileName(ShardRange{9, 0xa580000000000000ull}) == ".dede-ixp-09-a580000000000000");
  CHECK(ArenaFileName(0xff00000000000000ull) == ".dede-arena-ff00000000000000");
  CHECK(ShardFileName(ShardRange{40, 0xffffffffff000000ull}, ~0ull) ==
        ".dede-ix-28-ffffffffff000000-ffffffffffffffff");
  for (uint32_t depth : {0u, 1u, 7u, 8u, 9u, 16u, 39u, 40u}) {
    for (uint64_t version : {uint64_t(0), uint64_t(1), uint64_t(0xdeadbeef), ~uint64_t(0)}) {
      const ShardRange r = RangeAt(depth);
      CAPTURE(depth, version);
      ShardRange pr{99, 99};
      uint64_t pv = 7;
      REQUIRE(ParseShardFileName(ShardFileName(r, version), &pr, &pv));
      CHECK(pr == r);
      CHECK(pv == version);
      ShardRange pp{99, 99};
      REQUIRE(ParsePendingFileName(PendingFileName(r), &pp));
      CHECK(pp == r);
      // The kinds do not parse as each other.
      CHECK_FALSE(ParsePendingFileName(ShardFileName(r, version), &pp));
      CHECK_FALSE(ParseShardFileName(PendingFileName(r), &pr, &pv));
    }
  }
  for (uint64_t lo : {uint64_t(0), uint64_t(1), uint64_t(0x8000000000000000ull), ~uint64_t(0)}) {
    uint64_t out = 5;
    REQUIRE(ParseArenaFileName(ArenaFileName(lo), &out));
    CHECK(out == lo);
  }
}

TEST_CASE("index: malformed file names are rejected", "[index]") {
  ShardRange r;
  uint64_t v = 0;
  const char* bad_shards[] = {
      "",
      ".dede-ix-",
      ".dede-ix",
      "dede-ix-00-0000000000000000-0000000000000001",
      ".dede-ix-0-0000000000000000-0000000000000001",      // depth: 1 digit
      ".dede-ix-000-0000000000000000-0000000000000001",    // depth: 3 digits
      ".dede-ix-00-000000000000000-0000000000000001",      // lo: 15 digits
      ".dede-ix-00-00000000000000000-0000000000000001",    // lo: 17 digits
      ".dede-ix-00-0000000000000000-000000000000001",      // version: 15 digits
      ".dede-ix-00-0000000000000000-00000000000000001",    // version: 17 digits
      ".dede-ix-00-0000000000000000-000000000000000A",     // uppercase hex
      ".dede-ix-01-A000000000000000-0000000000000001",     // uppercase hex
      ".dede-ix-0A-0000000000000000-0000000000000001",     // uppercase hex
      ".dede-ix-00-0000000000000000-00000000000000g1",     // not hex
      ".dede-ix-00-0000000000000000- 000000000000001",     // space
      ".dede-ix-00-0000000000000000-+000000000000001",     // sign
      ".dede-ix-00-8000000000000000-0000000000000001",     // depth 0 with lo != 0
      ".dede-ix-01-4000000000000000-0000000000000001",     // lo not aligned to depth 1
      ".dede-ix-08-00f0000000000000-0000000000000001",     // lo not aligned to depth 8
      ".dede-ix-28-0000000000800000-0000000000000001",     // lo not aligned to depth 40
      ".dede-ix-29-0000000000000000-0000000000000001",     // depth 41
      ".dede-ix-40-0000000000000000-0000000000000001",     // depth 64
      ".dede-ix-ff-0000000000000000-0000000000000001",     // depth 255
      ".dede-ix-00-0000000000000000-0000000000000001-",    // extra (empty) field
      ".dede-ix-00-0000000000000000-0000000000000001-00",  // extra field
      ".dede-ix-00-0000000000000000",                      // missing version
      ".dede-ix--00-0000000000000000-0000000000000001",    // empty field
      ".dede-ix-00--0000000000000000-0000000000000001",
      ".dede-ixp-00-0000000000000000",  // a pending file
      ".dede-arena-0000000000000000",
  };
  for (const char* name : bad_shards) {
    CAPTURE(name);
    CHECK_FALSE(ParseShardFileName(name, &r, &v));
  }
  const char* bad_pending[] = {
      ".dede-ixp-",
      ".dede-ixp-00",
      ".dede-ixp-0-0000000000000000",
      ".dede-ixp-00-000000000000000",
      ".dede-ixp-00-00000000000000000",
      ".dede-ixp-01-C000000000000000",
      ".dede-ixp-01-4000000000000000",
      ".dede-ixp-29-0000000000000000",
      ".dede-ixp-00-0000000000000000-0000000000000001",
      ".dede-ixp-00-0000000000000000-",
      ".dede-ix-00-0000000000000000-0000000000000001",
  };
  for (const char* name : bad_pending) {
    CAPTURE(name);
    CHECK_FALSE(ParsePendingFileName(name, &r));
  }
  const char* bad_arenas[] = {
      ".dede-arena-",
      ".dede-arena-000000000000000",
      ".dede-arena-00000000000000000",
      ".dede-arena-A000000000000000",
      ".dede-arena-0000000000000000-",
      ".dede-arena-0000000000000000-01",
      ".dede-arena0000000000000000",
      ".dede-ix-00-0000000000000000-0000000000000001",
  };
  for (const char* name : bad_arenas) {
    CAPTURE(name);
    CHECK_FALSE(ParseArenaFileName(name, &v));
  }
  // Depth 40 at the very top is valid.
  CHECK(ParseShardFileName(".dede-ix-28-ffffffffff000000-0000000000000001", &r, &v));
  CHECK(r == ShardRange{40, 0xffffffffff000000ull});
}

// ---------------------------------------------------------------- ranges

TEST_CASE("index: shard range arithmetic", "[index]") {
  SECTION("depth 0 is everything") {
    const ShardRange all{0, 0};
    CHECK(all.last() == ~0ull);
    CHECK(all.Contains(0));
    CHECK(all.Contains(~0ull));
    CHECK(all.Lower() == ShardRange{1, 0});
    CHECK(all.Upper() == ShardRange{1, 1ull << 63});
    CHECK(all.Lower().last() == (1ull << 63) - 1);
    CHECK(all.Upper().last() == ~0ull);
    CHECK(ElidedBytes(all) == 0);
    CHECK(ShardLockId(all) == 0);
    CHECK(all.ToString() == "[0000000000000000..ffffffffffffffff]/0");
  }
  SECTION("boundaries at every depth") {
    for (uint32_t depth = 0; depth <= kMaxShardDepth; depth++) {
      CAPTURE(depth);
      const ShardRange r = RangeAt(depth);
      const uint64_t span_minus_1 = (~0ull) >> depth;
      CHECK(r.last() == r.lo + span_minus_1);
      CHECK(r.Contains(r.lo));
      CHECK(r.Contains(r.last()));
      CHECK(r.Contains(r.lo + span_minus_1 / 2));
      if (r.lo > 0) CHECK_FALSE(r.Contains(r.lo - 1));
      if (r.last() < ~0ull) CHECK_FALSE(r.Contains(r.last() + 1));
      CHECK(ElidedBytes(r) == depth / 8);
      if (depth < kMaxShardDepth) {
        const ShardRange lo = r.Lower(), hi = r.Upper();
        CHECK(lo.depth == depth + 1);
        CHECK(hi.depth == depth + 1);
        CHECK(lo.lo == r.lo);
        CHECK(lo.last() + 1 == hi.lo);
        CHECK(hi.last() == r.last());
        CHECK(lo < hi);
        CHECK(r < lo);  // same lo: shallower first
        CHECK_FALSE(lo == hi);
      }
      // depth <= 40 keeps lo a multiple of 2^24: lock ids are exact.
      CHECK((r.lo & 0xffffff) == 0);
      CHECK(ShardLockId(r) << 16 == r.lo);
    }
  }
  SECTION("depth 40 at the top of the space") {
    const ShardRange top{40, 0xffffffffff000000ull};
    CHECK(top.last() == ~0ull);
    CHECK(top.Contains(~0ull));
    CHECK(top.Contains(0xffffffffff000000ull));
    CHECK_FALSE(top.Contains(0xfffffffffeffffffull));
    CHECK(top.ToString() == "[ffffffffff000000..ffffffffffffffff]/40");
    const ShardRange bottom{40, 0};
    CHECK(bottom.last() == 0xffffff);
    CHECK_FALSE(bottom.Contains(0x1000000));
  }
}

TEST_CASE("index: keys and prefixes", "[index]") {
  for (HashAlgo algo : kAlgos) {
    const uint8_t data[5] = {1, 2, 3, 4, 5};
    const Fingerprint fp = ComputeFingerprint(algo, data, sizeof data);
    const FpKey k = KeyOf(fp);
    CHECK(FingerprintOf(k, algo) == fp);
    for (size_t i = HashAlgoSize(algo); i < k.size(); i++) CHECK(k[i] == 0);
    uint64_t want = 0;
    for (int i = 0; i < 8; i++) want = want << 8 | fp.bytes[size_t(i)];
    CHECK(KeyPrefix(k) == want);
  }
  FpKey a{}, b{};
  a[0] = 0x01;
  b[0] = 0x02;
  CHECK(KeyPrefix(a) < KeyPrefix(b));
  CHECK(a < b);
}
