// Tests for the on-disk codecs in volume/format.h: round trips, every way a
// block can be damaged or misplaced, superblock sanity, and the layout
// arithmetic of PlanLayout (groups tile the device exactly).
#include "volume/format.h"

#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "util/coding.h"
#include "util/crc32c.h"

using namespace dede;

namespace {

using Block = std::array<uint8_t, kBlockSize>;

constexpr Uuid kUuid = {0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe,
                        0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef};
constexpr Uuid kOtherUuid = {0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe,
                             0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xee};

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;

bool Contains(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}

// Rewrites the header (keeping its fields) and the crc after a payload edit.
void Reseal(uint8_t* blk, const Uuid& uuid) {
  SealBlock(blk, PeekHeader(blk), uuid);
}

Superblock Plan(uint64_t bytes, uint32_t group_refblocks = 32, uint32_t max_hosts = 8) {
  FormatParams p;
  p.device_bytes = bytes;
  p.group_refblocks = group_refblocks;
  p.max_hosts = max_hosts;
  Result<Superblock> r = PlanLayout(p);
  INFO("PlanLayout(" << bytes << "): " << r.status().ToString());
  REQUIRE(r.ok());
  Superblock sb = r.value();
  sb.uuid = kUuid;
  sb.created_ns = 1700000000123456789ull;
  return sb;
}

void RequireSameSuperblock(const Superblock& a, const Superblock& b) {
  CHECK(a.uuid == b.uuid);
  CHECK(a.block_size == b.block_size);
  CHECK(a.hash_algo == b.hash_algo);
  CHECK(a.total_blocks == b.total_blocks);
  CHECK(a.max_hosts == b.max_hosts);
  CHECK(a.lease_slots == b.lease_slots);
  CHECK(a.lease_start == b.lease_start);
  CHECK(a.lease_blocks == b.lease_blocks);
  CHECK(a.journal_start == b.journal_start);
  CHECK(a.journal_blocks == b.journal_blocks);
  CHECK(a.inode_start == b.inode_start);
  CHECK(a.inode_count == b.inode_count);
  CHECK(a.group_start == b.group_start);
  CHECK(a.group_count == b.group_count);
  CHECK(a.group_refblocks == b.group_refblocks);
  CHECK(a.created_ns == b.created_ns);
  CHECK(a.compat_features == b.compat_features);
  CHECK(a.drop_blocks == b.drop_blocks);
  REQUIRE(a.incompat_features == b.incompat_features);
}

// A superblock whose layout fields disagree: refused as corrupt, naming it.
void CheckInconsistentLayout(const Superblock& sb) {
  Block blk;
  EncodeSuperblock(sb, 0, blk.data());
  Result<Superblock> r = DecodeSuperblock(blk.data(), 0);
  INFO(r.status().ToString());
  REQUIRE(!r.ok());
  CHECK(r.status().code() == Status::Code::kCorruption);
  CHECK(Contains(r.status().message(), "superblock at block 0"));
  CHECK(Contains(r.status().message(), "inconsistent layout fields"));
}

void RequireSameInode(const Inode& a, const Inode& b) {
  CHECK(a.ino == b.ino);
  CHECK(a.generation == b.generation);
  CHECK(a.flags == b.flags);
  CHECK(a.kind == b.kind);
  CHECK(a.depth == b.depth);
  CHECK(a.size == b.size);
  CHECK(a.root == b.root);
  CHECK(a.mapped_blocks == b.mapped_blocks);
  CHECK(a.ctime_ns == b.ctime_ns);
  CHECK(a.mtime_ns == b.mtime_ns);
  CHECK(a.owner_ino == b.owner_ino);
  REQUIRE(a.name == b.name);
}

// ------------------------------------------------------------ codec table
//
// Every metadata structure, behind one interface, so that the damage tests
// below run against all of them.

struct Codec {
  std::string name;  // the structure's name in error messages
  uint32_t magic;
  uint64_t addr;        // where the sample block lives
  uint64_t other_addr;  // a plausible wrong address
  bool uuid_in_block;   // superblock: the UUID is part of the block itself
  // Encodes sample number `v` (different v: different content and seq).
  std::function<void(int v, const Uuid& uuid, uint64_t addr, uint8_t* blk)> encode;
  std::function<Status(const uint8_t* blk, const Uuid& uuid, uint64_t addr)> decode;
};

template <typename T>
Status StatusOf(const Result<T>& r) {
  return r.status();
}

std::vector<Codec> AllCodecs() {
  std::vector<Codec> c;
  c.push_back({"superblock", kMagicSuperblock, 1, 0, true,
               [](int v, const Uuid& uuid, uint64_t addr, uint8_t* blk) {
                 Superblock sb = Plan(64 * kMiB + uint64_t(v) * 3 * kMiB);
                 sb.uuid = uuid;
                 sb.created_ns = 1000 + v;
                 sb.compat_features = uint64_t(v) << 7;
                 EncodeSuperblock(sb, addr, blk);
               },
               [](const uint8_t* blk, const Uuid&, uint64_t addr) {
                 return StatusOf(DecodeSuperblock(blk, addr));
               }});
  c.push_back({"journal header", kMagicJournalHeader, 2600, 2601, false,
               [](int v, const Uuid& uuid, uint64_t addr, uint8_t* blk) {
                 JournalHeader jh;
                 jh.host = 3;
                 jh.tail_seq = 77 + v;
                 jh.tail_pos = 11 * v + 5;
                 EncodeJournalHeader(jh, 9 + v, uuid, addr, blk);
               },
               [](const uint8_t* blk, const Uuid& uuid, uint64_t addr) {
                 return StatusOf(DecodeJournalHeader(blk, uuid, addr));
               }});
  c.push_back({"journal transaction", kMagicJournalTxn, 2700, 2702, false,
               [](int v, const Uuid& uuid, uint64_t addr, uint8_t* blk) {
                 JournalTxn t;
                 t.seq = 1000 + v;
                 t.images_crc = 0xdeadbeef ^ v;
                 for (uint32_t i = 0; i < kMaxTxnBlocks; i++) t.homes.push_back(5000 + i * 3 + v);
                 EncodeJournalTxn(t, uuid, addr, blk);
               },
               [](const uint8_t* blk, const Uuid& uuid, uint64_t addr) {
                 return StatusOf(DecodeJournalTxn(blk, uuid, addr));
               }});
  c.push_back({"inode", kMagicInode, 4700, 4701, false,
               [](int v, const Uuid& uuid, uint64_t addr, uint8_t* blk) {
                 Inode in;
                 in.ino = 93;
                 in.generation = 4 + v;
                 in.flags = kInodeInUse;
                 in.kind = FileKind::kRegular;
                 in.depth = 2;
                 in.size = 1234567 * (v + 1);
                 in.root = 99999 + v;
                 in.mapped_blocks = 300 + v;
                 in.ctime_ns = 111;
                 in.mtime_ns = 222 + v;
                 in.name = "vm-disk-" + std::to_string(v) + std::string(200, 'x');
                 EncodeInode(in, 5 + v, uuid, addr, blk);
               },
               [](const uint8_t* blk, const Uuid& uuid, uint64_t addr) {
                 return StatusOf(DecodeInode(blk, uuid, addr));
               }});
  c.push_back({"pointer block", kMagicPointerBlock, 80000, 80001, false,
               [](int v, const Uuid& uuid, uint64_t addr, uint8_t* blk) {
                 PointerBlock pb;
                 pb.level = static_cast<uint8_t>(1 + v % 6);
                 for (uint32_t i = 0; i < kPointersPerBlock; i++) {
                   pb.ptrs[i] = (i % 2 ? kPtrCow : 0) | (70000 + i * 7 + v);
                 }
                 EncodePointerBlock(pb, 3 + v, uuid, addr, blk);
               },
               [](const uint8_t* blk, const Uuid& uuid, uint64_t addr) {
                 return StatusOf(DecodePointerBlock(blk, uuid, addr));
               }});
  c.push_back({"refcount block", kMagicRefcountBlock, 4864, 4865, false,
               [](int v, const Uuid& uuid, uint64_t addr, uint8_t* blk) {
                 RefcountBlock rb;
                 for (uint32_t i = 0; i < kRefsPerBlock; i++) rb.refs[i] = i * 13 + 1 + v;
                 EncodeRefcountBlock(rb, 8 + v, uuid, addr, blk);
               },
               [](const uint8_t* blk, const Uuid& uuid, uint64_t addr) {
                 return StatusOf(DecodeRefcountBlock(blk, uuid, addr));
               }});
  return c;
}

// The decoder's verdict on `blk` must be a corruption error that names the
// structure and the address, and mentions `word`. Returns "" when it is.
std::string ExpectCorrupt(const Codec& c, const uint8_t* blk, uint64_t addr,
                          const std::string& word, const Uuid& uuid = kUuid) {
  Status s = c.decode(blk, uuid, addr);
  if (s.ok()) return "decoded OK";
  if (s.code() != Status::Code::kCorruption) return "code " + std::string(s.CodeName());
  const std::string& m = s.message();
  if (!Contains(m, c.name) || !Contains(m, "at block " + std::to_string(addr)) ||
      !Contains(m, word)) {
    return "message: " + m;
  }
  return "";
}

}  // namespace

// ================================================================ header

TEST_CASE("block header: layout, seal, peek and crc definition", "[format]") {
  Block blk;
  for (size_t i = 0; i < blk.size(); i++) blk[i] = static_cast<uint8_t>(i * 31 + 7);
  BlockHeader h{0x11223344, 1, 9, 0xa5a5a5a5, 0x0102030405060708ull, 0x0000123456789abcull};
  SealBlock(blk.data(), h, kUuid);

  // Field offsets, little-endian.
  CHECK(DecodeU32(&blk[0]) == 0x11223344u);
  CHECK(DecodeU16(&blk[4]) == 1);
  CHECK(DecodeU16(&blk[6]) == 9);
  CHECK(DecodeU32(&blk[12]) == 0xa5a5a5a5u);
  CHECK(DecodeU64(&blk[16]) == 0x0102030405060708ull);
  CHECK(DecodeU64(&blk[24]) == 0x0000123456789abcull);
  // The payload is untouched by sealing.
  CHECK(blk[32] == static_cast<uint8_t>(32 * 31 + 7));
  CHECK(blk[4095] == static_cast<uint8_t>(4095 * 31 + 7));

  BlockHeader p = PeekHeader(blk.data());
  CHECK(p.magic == h.magic);
  CHECK(p.major == h.major);
  CHECK(p.minor == h.minor);
  CHECK(p.flags == h.flags);
  CHECK(p.seq == h.seq);
  CHECK(p.addr == h.addr);

  // crc32c over uuid || addr (u64 LE) || block with the crc field zeroed.
  std::vector<uint8_t> buf(16 + 8 + kBlockSize);
  std::memcpy(buf.data(), kUuid.data(), 16);
  EncodeU64(buf.data() + 16, h.addr);
  std::memcpy(buf.data() + 24, blk.data(), kBlockSize);
  std::memset(buf.data() + 24 + 8, 0, 4);
  uint32_t want = Crc32c(buf.data(), buf.size());
  CHECK(DecodeU32(&blk[8]) == want);
  CHECK(BlockCrc(blk.data(), kUuid, h.addr) == want);
  // The stored crc does not feed into the crc.
  Block other = blk;
  EncodeU32(&other[8], 0x12345678);
  CHECK(BlockCrc(other.data(), kUuid, h.addr) == want);
  // But the uuid and the address do.
  CHECK(BlockCrc(blk.data(), kOtherUuid, h.addr) != want);
  CHECK(BlockCrc(blk.data(), kUuid, h.addr + 1) != want);

  REQUIRE(CheckBlock(blk.data(), 0x11223344, h.addr, kUuid, "thing").ok());
}

TEST_CASE("block header: magic numbers spell their names", "[format]") {
  auto ascii = [](uint32_t m) {
    uint8_t b[4];
    EncodeU32(b, m);
    return std::string(reinterpret_cast<char*>(b), 4);
  };
  CHECK(ascii(kMagicSuperblock) == "DDSB");
  CHECK(ascii(kMagicJournalHeader) == "DDJH");
  CHECK(ascii(kMagicJournalTxn) == "DDJT");
  CHECK(ascii(kMagicInode) == "DDIN");
  CHECK(ascii(kMagicPointerBlock) == "DDPP");
  CHECK(ascii(kMagicRefcountBlock) == "DDRC");
  std::vector<uint32_t> all = {kMagicSuperblock, kMagicJournalHeader, kMagicJournalTxn,
                               kMagicInode,      kMagicPointerBlock,  kMagicRefcountBlock};
  std::sort(all.begin(), all.end());
  REQUIRE(std::adjacent_find(all.begin(), all.end()) == all.end());
}

TEST_CASE("block header: geometry constants", "[format]") {
  CHECK(kBlockSize == 4096);
  CHECK(kHeaderSize == 32);
  CHECK(kRefsPerBlock == 1016);
  CHECK(kPointersPerBlock == 508);
  CHECK(kMaxTxnBlocks == 507);
  CHECK(kHeaderSize + 8 + 8 * kMaxTxnBlocks == kBlockSize);
  CHECK(kHeaderSize + 4 * kRefsPerBlock == kBlockSize);
  REQUIRE(kHeaderSize + 8 * kPointersPerBlock == kBlockSize);
}

TEST_CASE("block header: CheckBlock order and messages", "[format]") {
  Block blk{};
  SealBlock(blk.data(), BlockHeader{kMagicInode, kFormatMajor, kFormatMinor, 0, 1, 42}, kUuid);
  REQUIRE(CheckBlock(blk.data(), kMagicInode, 42, kUuid, "inode 3").ok());

  Status s = CheckBlock(blk.data(), kMagicSuperblock, 42, kUuid, "superblock");
  CHECK(s.code() == Status::Code::kCorruption);
  CHECK(Contains(s.message(), "superblock at block 42"));
  CHECK(Contains(s.message(), "magic"));

  // Magic is checked before the crc: a wrong magic with a bad crc says magic.
  Block bad = blk;
  bad[100] ^= 1;
  s = CheckBlock(bad.data(), kMagicSuperblock, 42, kUuid, "superblock");
  CHECK(Contains(s.message(), "magic"));
  s = CheckBlock(bad.data(), kMagicInode, 42, kUuid, "inode 3");
  CHECK(s.code() == Status::Code::kCorruption);
  CHECK(Contains(s.message(), "inode 3 at block 42"));
  CHECK(Contains(s.message(), "checksum"));

  // Version 0 is never valid.
  Block v0{};
  SealBlock(v0.data(), BlockHeader{kMagicInode, 0, 0, 0, 1, 42}, kUuid);
  s = CheckBlock(v0.data(), kMagicInode, 42, kUuid, "inode");
  CHECK(s.code() == Status::Code::kCorruption);
  CHECK(Contains(s.message(), "version 0"));

  // Newer major: refused as unsupported, naming both versions.
  Block v2{};
  SealBlock(v2.data(), BlockHeader{kMagicInode, kFormatMajor + 1, 3, 0, 1, 42}, kUuid);
  s = CheckBlock(v2.data(), kMagicInode, 42, kUuid, "inode");
  CHECK(s.code() == Status::Code::kUnsupported);
  CHECK(Contains(s.message(), "newer"));
  CHECK(Contains(s.message(), std::to_string(kFormatMajor + 1) + ".3"));

  // Newer minor: read.
  Block m1{};
  SealBlock(m1.data(), BlockHeader{kMagicInode, kFormatMajor, kFormatMinor + 1, 0, 1, 42}, kUuid);
  REQUIRE(CheckBlock(m1.data(), kMagicInode, 42, kUuid, "inode").ok());
}

TEST_CASE("block header: golden encodings pin the on-disk format", "[format]") {
  // If one of these changes, the format changed: bump kFormatMajor/Minor
  // (1.1: the superblock's drop_blocks and kIncompatDropLists)
  // and update docs/FORMAT.md instead of editing the constant. The values
  // were cross-checked with an independent bitwise CRC-32C over the byte
  // layout that docs/FORMAT.md describes.
  Block blk{};
  SealBlock(blk.data(), BlockHeader{kMagicInode, 1, 0, 0, 1, 4608}, kUuid);
  CHECK(DecodeU32(&blk[8]) == 0xcfd7b018u);

  Inode in;
  in.ino = 1;
  in.generation = 1;
  in.flags = kInodeInUse;
  in.kind = FileKind::kRegular;
  in.name = "golden";
  EncodeInode(in, 1, kUuid, 4608, blk.data());
  CHECK(DecodeU32(&blk[8]) == 0x230095cfu);

  Superblock sb = Plan(64 * kMiB);
  EncodeSuperblock(sb, 0, blk.data());
  REQUIRE(DecodeU32(&blk[8]) == 0x8180110eu);
}

// ============================================== every structure, damaged

TEST_CASE("all structures: round trip of the sample blocks", "[format]") {
  for (const Codec& c : AllCodecs()) {
    INFO(c.name);
    Block blk;
    c.encode(0, kUuid, c.addr, blk.data());
    CHECK(PeekHeader(blk.data()).magic == c.magic);
    CHECK(PeekHeader(blk.data()).addr == c.addr);
    CHECK(PeekHeader(blk.data()).major == kFormatMajor);
    CHECK(PeekHeader(blk.data()).minor == kFormatMinor);
    Status s = c.decode(blk.data(), kUuid, c.addr);
    INFO(s.ToString());
    REQUIRE(s.ok());
  }
}

TEST_CASE("all structures: every single flipped bit is detected", "[format]") {
  for (const Codec& c : AllCodecs()) {
    INFO(c.name);
    Block good;
    c.encode(0, kUuid, c.addr, good.data());
    std::string first_bad;
    int failures = 0;
    for (uint32_t bit = 0; bit < kBlockSize * 8; bit++) {
      Block blk = good;
      blk[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      const char* word = bit < 32 ? "magic" : "checksum";
      std::string why = ExpectCorrupt(c, blk.data(), c.addr, word);
      if (!why.empty()) {
        if (first_bad.empty()) first_bad = "bit " + std::to_string(bit) + ": " + why;
        failures++;
      }
    }
    INFO(first_bad);
    REQUIRE(failures == 0);
  }
}

TEST_CASE("all structures: wrong magic is reported as such", "[format]") {
  std::vector<Codec> codecs = AllCodecs();
  for (const Codec& written : codecs) {
    Block blk;
    written.encode(0, kUuid, written.addr, blk.data());
    for (const Codec& reader : codecs) {
      if (reader.magic == written.magic) continue;
      INFO(written.name << " read as " << reader.name);
      std::string why = ExpectCorrupt(reader, blk.data(), written.addr, "magic");
      REQUIRE(why.empty());
    }
  }
  // A plain data block (or garbage) is not metadata.
  std::mt19937_64 rng(7);
  for (const Codec& c : codecs) {
    INFO(c.name);
    for (int i = 0; i < 50; i++) {
      Block blk;
      for (auto& b : blk) b = static_cast<uint8_t>(rng());
      REQUIRE(ExpectCorrupt(c, blk.data(), c.addr, "magic").empty());
      // Right magic, random rest: the crc catches it.
      EncodeU32(blk.data(), c.magic);
      REQUIRE(ExpectCorrupt(c, blk.data(), c.addr, "checksum").empty());
    }
  }
}

TEST_CASE("all structures: newer major refused, newer minor read", "[format]") {
  for (const Codec& c : AllCodecs()) {
    INFO(c.name);
    Block blk;
    c.encode(0, kUuid, c.addr, blk.data());

    Block newer = blk;
    BlockHeader h = PeekHeader(newer.data());
    h.major = kFormatMajor + 1;
    SealBlock(newer.data(), h, kUuid);
    Status s = c.decode(newer.data(), kUuid, c.addr);
    CHECK(s.code() == Status::Code::kUnsupported);
    CHECK(Contains(s.message(), "newer"));
    CHECK(Contains(s.message(), c.name));
    CHECK(Contains(s.message(), "at block " + std::to_string(c.addr)));

    h.major = 0xffff;
    SealBlock(newer.data(), h, kUuid);
    CHECK(c.decode(newer.data(), kUuid, c.addr).code() == Status::Code::kUnsupported);

    Block zero_major = blk;
    h = PeekHeader(zero_major.data());
    h.major = 0;
    SealBlock(zero_major.data(), h, kUuid);
    CHECK(c.decode(zero_major.data(), kUuid, c.addr).code() == Status::Code::kCorruption);

    Block minor = blk;
    h = PeekHeader(minor.data());
    h.minor = kFormatMinor + 7;
    SealBlock(minor.data(), h, kUuid);
    s = c.decode(minor.data(), kUuid, c.addr);
    INFO(s.ToString());
    REQUIRE(s.ok());
  }
}

TEST_CASE("all structures: misdirected writes are detected", "[format]") {
  for (const Codec& c : AllCodecs()) {
    INFO(c.name);
    Block blk;
    c.encode(0, kUuid, c.addr, blk.data());
    // Read back from another address (the write landed elsewhere).
    CHECK(ExpectCorrupt(c, blk.data(), c.other_addr, "checksum").empty());
    CHECK(ExpectCorrupt(c, blk.data(), c.addr + (1ull << 40), "checksum").empty());
    // A block sealed for another address but found here.
    Block moved;
    c.encode(0, kUuid, c.other_addr, moved.data());
    CHECK(!c.decode(moved.data(), kUuid, c.addr).ok());
    CHECK(c.decode(moved.data(), kUuid, c.other_addr).ok());
    // The header address edited to match, crc left alone: still refused.
    Block forged = blk;
    EncodeU64(&forged[24], c.other_addr);
    REQUIRE(ExpectCorrupt(c, forged.data(), c.other_addr, "checksum").empty());
  }
}

TEST_CASE("all structures: blocks of another volume are detected", "[format]") {
  for (const Codec& c : AllCodecs()) {
    INFO(c.name);
    Block blk;
    c.encode(0, kUuid, c.addr, blk.data());
    if (c.uuid_in_block) {
      // The superblock carries its UUID: a foreign superblock decodes (the
      // caller compares the UUID), but editing the UUID breaks the crc.
      Result<Superblock> r = DecodeSuperblock(blk.data(), c.addr);
      REQUIRE(r.ok());
      CHECK(r->uuid == kUuid);
      Block edited = blk;
      std::memcpy(&edited[kHeaderSize], kOtherUuid.data(), 16);
      REQUIRE(ExpectCorrupt(c, edited.data(), c.addr, "checksum").empty());
    } else {
      REQUIRE(ExpectCorrupt(c, blk.data(), c.addr, "checksum", kOtherUuid).empty());
      Block foreign;
      c.encode(0, kOtherUuid, c.addr, foreign.data());
      REQUIRE(ExpectCorrupt(c, foreign.data(), c.addr, "checksum").empty());
    }
  }
}

TEST_CASE("all structures: zeroed, truncated and torn blocks fail", "[format]") {
  for (const Codec& c : AllCodecs()) {
    INFO(c.name);
    Block zero{};
    CHECK(ExpectCorrupt(c, zero.data(), c.addr, "magic").empty());
    Block ones;
    ones.fill(0xff);
    CHECK(ExpectCorrupt(c, ones.data(), c.addr, "magic").empty());

    Block oldb, newb;
    c.encode(1, kUuid, c.addr, oldb.data());
    c.encode(2, kUuid, c.addr, newb.data());
    REQUIRE(oldb != newb);
    int torn_detected = 0;
    // Sector-granular tears (512 and 4096-byte sector devices tear on 512
    // boundaries at worst), in both orders, plus a zeroed tail (a block
    // that was never completely written) and byte-granular cuts.
    std::vector<uint32_t> cuts;
    for (uint32_t k = 512; k < kBlockSize; k += 512) cuts.push_back(k);
    for (uint32_t k : {1u, 8u, 12u, 31u, 32u, 33u, 100u, 1000u, 4095u}) cuts.push_back(k);
    for (uint32_t k : cuts) {
      INFO("cut at " << k);
      Block a = newb, b = oldb, z = newb;
      std::memcpy(a.data() + k, oldb.data() + k, kBlockSize - k);  // new head, old tail
      std::memcpy(b.data() + k, newb.data() + k, kBlockSize - k);  // old head, new tail
      std::memset(z.data() + k, 0, kBlockSize - k);                // zeroed tail
      for (const Block* t : {&a, &b, &z}) {
        Status s = c.decode(t->data(), kUuid, c.addr);
        if (*t == newb || *t == oldb) {
          // Nothing differs in the torn part: the block is whole.
          CHECK(s.ok());
        } else {
          CHECK(!s.ok());
          CHECK(s.code() == Status::Code::kCorruption);
          torn_detected++;
        }
      }
    }
    REQUIRE(torn_detected > 0);
  }
}

// ============================================================ superblock

TEST_CASE("superblock: round trip at both copies", "[format]") {
  for (uint64_t bytes : {21 * kMiB, 64 * kMiB, 3 * kGiB, 5 * kGiB + 12345, kGiB << 14}) {
    for (uint64_t addr : kSuperblockAddrs) {
      INFO(bytes << " bytes at " << addr);
      Superblock sb = Plan(bytes);
      sb.hash_algo = HashAlgo::kSha256;
      sb.compat_features = 0x8000000000000001ull;  // unknown compat bits are fine
      sb.created_ns = UINT64_MAX;
      Block blk;
      EncodeSuperblock(sb, addr, blk.data());
      CHECK(PeekHeader(blk.data()).seq == 1);
      CHECK(std::memcmp(&blk[kHeaderSize], sb.uuid.data(), 16) == 0);
      Result<Superblock> r = DecodeSuperblock(blk.data(), addr);
      INFO(r.status().ToString());
      REQUIRE(r.ok());
      RequireSameSuperblock(*r, sb);
      // Copy 0 is not copy 1.
      REQUIRE(!DecodeSuperblock(blk.data(), 1 - addr).ok());
    }
  }
}

TEST_CASE("superblock: unknown features, block size and hash are refused", "[format]") {
  Superblock base = Plan(64 * kMiB);
  Block blk;
  for (uint64_t bit : {2, 17, 63}) {
    Superblock sb = base;
    sb.incompat_features = (1ull << bit) | kIncompatSanlock;
    EncodeSuperblock(sb, 0, blk.data());
    Result<Superblock> r = DecodeSuperblock(blk.data(), 0);
    CHECK(r.status().code() == Status::Code::kUnsupported);
    CHECK(Contains(r.status().message(), "superblock at block 0"));
    CHECK(Contains(r.status().message(), "incompatible features"));
  }
  for (uint32_t bs : {0u, 512u, 8192u}) {
    Superblock sb = base;
    sb.block_size = bs;
    EncodeSuperblock(sb, 0, blk.data());
    Result<Superblock> r = DecodeSuperblock(blk.data(), 0);
    CHECK(r.status().code() == Status::Code::kUnsupported);
    CHECK(Contains(r.status().message(), "block size " + std::to_string(bs)));
  }
  for (uint32_t algo : {0u, 3u, 0xffffffffu}) {
    Superblock sb = base;
    sb.hash_algo = static_cast<HashAlgo>(algo);
    EncodeSuperblock(sb, 1, blk.data());
    Result<Superblock> r = DecodeSuperblock(blk.data(), 1);
    CHECK(r.status().code() == Status::Code::kUnsupported);
    CHECK(Contains(r.status().message(), "hash algorithm"));
  }
}

TEST_CASE("superblock: inconsistent layout fields are refused", "[format]") {
  // 256 MiB with small groups: 30 groups, the last one partial.
  const Superblock base = Plan(256 * kMiB, 2);
  REQUIRE(base.group_count == 30);
  Block blk;
  EncodeSuperblock(base, 0, blk.data());
  REQUIRE(DecodeSuperblock(blk.data(), 0).ok());

  struct Mutation {
    const char* what;
    std::function<void(Superblock&)> apply;
  };
  const uint64_t full = base.FullGroupBlocks();
  std::vector<Mutation> muts = {
      {"max_hosts 0", [](Superblock& s) { s.max_hosts = 0; }},
      {"max_hosts too many", [](Superblock& s) { s.max_hosts = kMaxHosts + 1; }},
      {"max_hosts+1", [](Superblock& s) { s.max_hosts++; }},
      {"lease_slots+1", [](Superblock& s) { s.lease_slots++; }},
      {"lease_start+1", [](Superblock& s) { s.lease_start++; }},
      {"lease_start 0", [](Superblock& s) { s.lease_start = 0; }},
      {"lease_blocks+256", [](Superblock& s) { s.lease_blocks += 256; }},
      {"journal_start+1", [](Superblock& s) { s.journal_start++; }},
      {"journal_blocks+1", [](Superblock& s) { s.journal_blocks++; }},
      {"journal_blocks 8 (consistent)",
       [](Superblock& s) {
         s.journal_blocks = 8;
         s.inode_start = s.journal_start + s.max_hosts * 8;
         s.group_start = s.inode_start + s.inode_count;
       }},
      {"inode_start+1", [](Superblock& s) { s.inode_start++; }},
      {"inode_count+1", [](Superblock& s) { s.inode_count++; }},
      {"inode_count 0 (consistent)",
       [](Superblock& s) {
         s.inode_count = 0;
         s.group_start = s.inode_start;
       }},
      {"group_start+1", [](Superblock& s) { s.group_start++; }},
      {"group_count+1", [](Superblock& s) { s.group_count++; }},
      {"group_count-1", [](Superblock& s) { s.group_count--; }},
      {"group_count 0", [](Superblock& s) { s.group_count = 0; }},
      {"group_refblocks 0", [](Superblock& s) { s.group_refblocks = 0; }},
      {"group_refblocks+1", [](Superblock& s) { s.group_refblocks++; }},
      {"total_blocks at group_start", [](Superblock& s) { s.total_blocks = s.group_start; }},
      {"total_blocks 0", [](Superblock& s) { s.total_blocks = 0; }},
      {"total_blocks one more group", [full](Superblock& s) { s.total_blocks += full; }},
      {"total_blocks 2^48",
       [](Superblock& s) {
         s.total_blocks = 1ull << 48;
         s.group_count =
             static_cast<uint32_t>((s.total_blocks - s.group_start - 2) / s.FullGroupBlocks() + 1);
       }},
      // Values whose sums wrap around 2^64 so that the equalities hold
      // modulo 2^64 (regression tests: these used to be accepted).
      {"journal_blocks wraps", [](Superblock& s) { s.journal_blocks += 1ull << 61; }},
      {"inode_count wraps",
       [](Superblock& s) {
         s.inode_count = 0 - uint64_t{100};
         s.group_start = s.inode_start - 100;
         s.group_count =
             static_cast<uint32_t>((s.total_blocks - s.group_start - 2) / s.FullGroupBlocks() + 1);
       }},
  };
  // max_hosts = 8, so adding 2^61 journal blocks wraps the journal region.
  REQUIRE(base.max_hosts == 8);
  for (const Mutation& m : muts) {
    INFO(m.what);
    Superblock sb = base;
    m.apply(sb);
    CheckInconsistentLayout(sb);
  }
}

TEST_CASE("superblock: group arithmetic that wraps 2^64 is refused", "[format]") {
  // A device of 10000 blocks has one partial group. These values make
  // (group_count - 1) * FullGroupBlocks() == 2^64 + 1100, so the "last
  // group" would seem to start inside the device while every other group
  // starts far beyond it. (Regression test: this used to be accepted.)
  Superblock sb = Plan(10000 * uint64_t{kBlockSize});
  REQUIRE(sb.group_count == 1);
  sb.group_refblocks = 671017796;
  sb.group_count = 27031164;
  REQUIRE((sb.group_count - 1) * sb.FullGroupBlocks() == 1100);  // mod 2^64
  Block blk;
  EncodeSuperblock(sb, 1, blk.data());
  Result<Superblock> r = DecodeSuperblock(blk.data(), 1);
  REQUIRE(!r.ok());
  REQUIRE(r.status().code() == Status::Code::kCorruption);
}

// ============================================================ PlanLayout

namespace {

// Walks the groups of `sb` and checks that they tile [group_start, total)
// exactly, and, for devices small enough, classifies every block. Returns
// "" or the first thing that is wrong (loops too long for one assertion per
// step).
std::string TilingError(const Superblock& sb) {
  auto fail = [](const std::string& what) { return what; };
  // Fixed regions in order.
  if (sb.lease_start != kLeaseAreaStartBlock) return fail("lease_start");
  if (sb.lease_blocks != kLeaseBlocks * (1 + uint64_t{sb.lease_slots})) return fail("lease_blocks");
  if (sb.journal_start != sb.lease_start + sb.lease_blocks) return fail("journal_start");
  if (sb.inode_start != sb.journal_start + sb.max_hosts * sb.journal_blocks) {
    return fail("inode_start");
  }
  if (sb.group_start != sb.inode_start + sb.inode_count) return fail("group_start");
  if (sb.JournalStart(1) != sb.journal_start) return fail("JournalStart(1)");
  if (sb.JournalStart(sb.max_hosts) + sb.journal_blocks != sb.inode_start) {
    return fail("JournalStart(max_hosts)");
  }
  if (sb.InodeBlock(1) != sb.inode_start) return fail("InodeBlock(1)");
  if (sb.InodeBlock(sb.inode_count) != sb.group_start - 1) return fail("InodeBlock(last)");
  if (sb.group_count < 1) return fail("no groups");

  uint64_t next = sb.group_start;
  uint64_t data_total = 0;
  for (uint32_t g = 0; g < sb.group_count; g++) {
    const std::string at = "group " + std::to_string(g) + ": ";
    const uint64_t refs = sb.GroupRefBlocks(g);
    const uint64_t data = sb.GroupDataBlocks(g);
    if (sb.GroupStart(g) != next) return fail(at + "does not start where the previous ended");
    if (sb.GroupDataStart(g) != next + refs) return fail(at + "data start");
    if (refs < 1 || refs > sb.group_refblocks) return fail(at + "refcount block count");
    if (data < 1) return fail(at + "no data blocks");
    if (data > refs * kRefsPerBlock) return fail(at + "a data block without a refcount slot");
    if ((refs - 1) * kRefsPerBlock > data) return fail(at + "an idle refcount block");
    if (g + 1 < sb.group_count && refs + data != sb.FullGroupBlocks()) {
      return fail(at + "not full but not last");
    }
    next += refs + data;
    data_total += data;
  }
  // The last group ends at the device end, or one block short of it (a
  // single block cannot form a group).
  if (next > sb.total_blocks) return fail("groups run past the device end");
  if (sb.total_blocks - next > 1) return fail("room for another group");
  if (next < sb.total_blocks && sb.GroupRefBlocks(sb.group_count - 1) != sb.group_refblocks) {
    return fail("slack after a partial group");
  }
  if (sb.DataBlocks() != data_total) return fail("DataBlocks()");

  uint32_t g;
  uint64_t rb;
  uint32_t slot;
  if (sb.LocateData(sb.total_blocks, &g, &rb, &slot)) return fail("LocateData(total_blocks)");
  if (sb.LocateData(sb.total_blocks + 12345, &g, &rb, &slot)) return fail("LocateData(beyond)");
  if (sb.LocateData(~uint64_t{0}, &g, &rb, &slot)) return fail("LocateData(2^64-1)");

  auto check_block = [&](uint64_t b, bool want_data, uint32_t want_group) -> std::string {
    const std::string at = "block " + std::to_string(b) + ": ";
    bool is = sb.LocateData(b, &g, &rb, &slot);
    if (is != want_data) return at + (is ? "metadata located as data" : "data not located");
    if (!is) return "";
    if (g != want_group) return at + "wrong group";
    if (rb < sb.GroupStart(g) || rb >= sb.GroupDataStart(g)) return at + "refblock outside group";
    if (slot >= kRefsPerBlock) return at + "slot out of range";
    // Slots are assigned in order: data block i of the group is slot i%1016
    // of refcount block i/1016.
    uint64_t i = b - sb.GroupDataStart(g);
    if (rb != sb.GroupStart(g) + i / kRefsPerBlock || slot != i % kRefsPerBlock) {
      return at + "slot out of order";
    }
    return "";
  };

  if (sb.total_blocks <= (1u << 20)) {
    // Every block, and the (refblock, slot) pairs are unique.
    std::unordered_set<uint64_t> seen;
    uint64_t data_seen = 0;
    uint32_t group = 0;
    for (uint64_t b = 0; b < sb.total_blocks; b++) {
      while (group + 1 < sb.group_count && b >= sb.GroupStart(group + 1)) group++;
      bool data =
          b >= sb.GroupDataStart(group) && b < sb.GroupDataStart(group) + sb.GroupDataBlocks(group);
      std::string e = check_block(b, data, group);
      if (!e.empty()) return e;
      if (data) {
        data_seen++;
        if (!seen.insert(rb * kRefsPerBlock + slot).second) {
          return "block " + std::to_string(b) + ": (refblock, slot) used twice";
        }
      }
    }
    if (data_seen != data_total) return fail("data block count");
  } else {
    // Metadata regions, and every boundary of the first and last groups.
    for (uint64_t b : {uint64_t{0}, uint64_t{1}, sb.lease_start, sb.journal_start, sb.inode_start,
                       sb.group_start - 1}) {
      std::string e = check_block(b, false, 0);
      if (!e.empty()) return e;
    }
    std::vector<uint32_t> groups;
    for (uint32_t x = 0; x < std::min<uint32_t>(sb.group_count, 3); x++) groups.push_back(x);
    for (uint32_t x = sb.group_count - std::min<uint32_t>(sb.group_count, 3); x < sb.group_count;
         x++) {
      groups.push_back(x);
    }
    for (uint32_t x : groups) {
      uint64_t s = sb.GroupStart(x), ds = sb.GroupDataStart(x), n = sb.GroupDataBlocks(x);
      for (auto [b, data] : {std::pair{s, false}, std::pair{ds - 1, false}, std::pair{ds, true},
                             std::pair{ds + n / 2, true}, std::pair{ds + n - 1, true}}) {
        std::string e = check_block(b, data, x);
        if (!e.empty()) return e;
      }
    }
  }

  // What PlanLayout produces always decodes.
  Superblock copy = sb;
  copy.uuid = kUuid;
  Block blk;
  EncodeSuperblock(copy, 0, blk.data());
  Result<Superblock> r = DecodeSuperblock(blk.data(), 0);
  if (!r.ok()) return "does not decode: " + r.status().ToString();
  return "";
}

void CheckTiling(const Superblock& sb) {
  INFO("total_blocks " << sb.total_blocks << ", group_refblocks " << sb.group_refblocks
                       << ", group_count " << sb.group_count);
  REQUIRE(TilingError(sb) == "");
}

}  // namespace

TEST_CASE("PlanLayout: groups tile the device exactly", "[format]") {
  // Small groups (2 refcount blocks, 2034 blocks) so that every edge case
  // fits in a small device whose every block can be checked.
  const uint64_t gs = Plan(64 * kMiB, 2).group_start;
  REQUIRE(gs == 4864);
  const uint64_t full = 2 + 2 * kRefsPerBlock;
  const uint64_t B = kBlockSize;
  for (uint64_t blocks : {gs + 257,              // the minimum: one partial group
                          gs + 5 * full,         // exactly five full groups
                          gs + 5 * full + 1,     // one block of slack
                          gs + 5 * full + 2,     // a partial group of 1 + 1 blocks
                          gs + 5 * full + 1017,  // 1 refcount block, 1016 data blocks
                          gs + 5 * full + 1018,  // needs a second refcount block
                          gs + 5 * full + full - 1, gs + 40 * full + 777}) {
    FormatParams p;
    p.device_bytes = blocks * B + 100;  // a ragged tail is ignored
    p.group_refblocks = 2;
    Result<Superblock> r = PlanLayout(p);
    INFO(blocks << " blocks: " << r.status().ToString());
    REQUIRE(r.ok());
    CHECK(r->total_blocks == blocks);
    CheckTiling(*r);
  }
  CHECK(Plan(uint64_t{gs + 5 * full} * B, 2).group_count == 5);
  CHECK(Plan(uint64_t{gs + 5 * full + 1} * B, 2).group_count == 5);
  CHECK(Plan(uint64_t{gs + 5 * full + 2} * B, 2).group_count == 6);
  CHECK(Plan(uint64_t{gs + 5 * full + 2} * B, 2).GroupDataBlocks(5) == 1);
  CHECK(Plan(uint64_t{gs + 5 * full + 1018} * B, 2).GroupRefBlocks(5) == 2);

  // Default groups, bigger devices.
  for (uint64_t bytes : {64 * kMiB, kGiB, 10 * kGiB + 12345, kGiB << 12, (kGiB << 20) + 3 * B}) {
    Superblock sb = Plan(bytes);
    CheckTiling(sb);
  }
  // One refcount block per group.
  CheckTiling(Plan(100 * kMiB, 1));
}

TEST_CASE("PlanLayout: default sizing rules", "[format]") {
  Superblock s = Plan(64 * kMiB);
  CHECK(s.total_blocks == 16384);
  CHECK(s.block_size == kBlockSize);
  CHECK(s.hash_algo == HashAlgo::kXxh128);
  CHECK(s.max_hosts == 8);
  CHECK(s.lease_slots == 8);
  CHECK(s.lease_start == 256);
  CHECK(s.lease_blocks == 256 * 9);
  CHECK(s.journal_start == 256 + 256 * 9);
  CHECK(s.journal_blocks == 256);
  CHECK(s.inode_count == 256);
  CHECK(s.group_refblocks == 32);

  CHECK(Plan(kGiB - 1).journal_blocks == 256);
  CHECK(Plan(kGiB).journal_blocks == 1024);
  CHECK(Plan(4 * kGiB - 1).lease_slots == 8);
  CHECK(Plan(4 * kGiB).lease_slots == 64);
  // One inode per 16 MiB, clamped to [256, 65536].
  CHECK(Plan(4 * kGiB).inode_count == 256);
  CHECK(Plan(8 * kGiB).inode_count == 512);
  CHECK(Plan(uint64_t{1} << 40).inode_count == 65536);
  CHECK(Plan(uint64_t{2} << 40).inode_count == 65536);

  // Explicit values are kept.
  FormatParams p;
  p.device_bytes = 2 * kGiB;
  p.max_hosts = 3;
  p.hash_algo = HashAlgo::kSha256;
  p.inode_count = 1000;
  p.lease_slots = 5;
  p.journal_blocks = 96;
  p.group_refblocks = 7;
  Result<Superblock> r = PlanLayout(p);
  REQUIRE(r.ok());
  CHECK(r->max_hosts == 3);
  CHECK(r->hash_algo == HashAlgo::kSha256);
  CHECK(r->inode_count == 1000);
  CHECK(r->lease_slots == 5);
  CHECK(r->lease_blocks == 256 * 6);
  CHECK(r->journal_blocks == 96);
  CHECK(r->inode_start == 256 + 256 * 6 + 3 * 96);
  CHECK(r->group_refblocks == 7);
  CheckTiling(*r);
}

TEST_CASE("PlanLayout: too small a device", "[format]") {
  // Defaults below 1 GiB: group_start = 4864; plus one refcount block and
  // 256 data blocks.
  const uint64_t min_bytes = (4864 + 1 + 256) * uint64_t{kBlockSize};
  FormatParams p;
  p.device_bytes = min_bytes;
  REQUIRE(PlanLayout(p).ok());
  CHECK(PlanLayout(p)->DataBlocks() == 256);
  for (uint64_t bytes : {min_bytes - 1, min_bytes - kBlockSize, uint64_t{kMiB}, uint64_t{0}}) {
    INFO(bytes);
    p.device_bytes = bytes;
    Result<Superblock> r = PlanLayout(p);
    REQUIRE(!r.ok());
    CHECK(r.status().code() == Status::Code::kNoSpace);
    CHECK(Contains(r.status().message(), "too small"));
    CHECK(Contains(r.status().message(), "at least " + std::to_string(min_bytes) + " bytes"));
  }
  // The minimum follows the settings.
  p.device_bytes = min_bytes;
  p.max_hosts = 9;
  Result<Superblock> r = PlanLayout(p);
  CHECK(r.status().code() == Status::Code::kNoSpace);
  REQUIRE(Contains(r.status().message(), std::to_string(min_bytes + 256 * kBlockSize)));
}

TEST_CASE("PlanLayout: invalid parameters", "[format]") {
  FormatParams p;
  p.device_bytes = 2 * kGiB;
  for (uint32_t hosts : {0u, kMaxHosts + 1, 100000u}) {
    p.max_hosts = hosts;
    Result<Superblock> r = PlanLayout(p);
    CHECK(r.status().code() == Status::Code::kInvalid);
    CHECK(Contains(r.status().message(), "max-hosts"));
    CHECK(Contains(r.status().message(), std::to_string(kMaxHosts)));
  }
  for (uint32_t hosts : {1u, kMaxHosts}) {
    p.max_hosts = hosts;
    Result<Superblock> r = PlanLayout(p);
    INFO(hosts << ": " << r.status().ToString());
    REQUIRE(r.ok());
    CHECK(r->max_hosts == hosts);
    CheckTiling(*r);
  }
  p.max_hosts = 8;
  p.journal_blocks = 15;
  CHECK(PlanLayout(p).status().code() == Status::Code::kInvalid);
  // The ring (after 2 header blocks and a drop list of 1/32 of the journal)
  // must let a transaction hold kMinTxnBlocks: 66 blocks.
  p.journal_blocks = 69;  // drop list 2, ring 65
  Result<Superblock> small = PlanLayout(p);
  CHECK(small.status().code() == Status::Code::kInvalid);
  CHECK(Contains(small.status().message(), "journal is too small"));
  p.journal_blocks = 70;  // ring 66
  CHECK(PlanLayout(p).ok());
  p.journal_blocks = 0;
  p.group_refblocks = 0;
  CHECK(PlanLayout(p).status().code() == Status::Code::kInvalid);
  p.group_refblocks = 32;

  // Sizes whose sums would wrap 2^64 (regression: these used to produce a
  // layout whose journals lie far outside the device).
  p.journal_blocks = (1ull << 61) + 256;
  Result<Superblock> r = PlanLayout(p);
  CHECK(!r.ok());
  p.journal_blocks = 0;
  p.inode_count = 0 - uint64_t{4096};
  r = PlanLayout(p);
  CHECK(!r.ok());
  p.inode_count = 0;
  // A journal or inode table bigger than the device.
  p.journal_blocks = 1ull << 40;
  CHECK(PlanLayout(p).status().code() == Status::Code::kNoSpace);
  // So big that the minimum does not fit 64 bits in bytes: stated in blocks
  // (regression: the byte count used to wrap; found by fuzz_superblock).
  p.max_hosts = kMaxHosts;
  p.journal_blocks = (1ull << 48) - 1;
  r = PlanLayout(p);
  CHECK(r.status().code() == Status::Code::kNoSpace);
  const uint64_t need = 2560 + uint64_t{kMaxHosts} * p.journal_blocks + 256 + 257;
  CHECK(Contains(r.status().message(), "at least " + std::to_string(need) + " blocks"));
  p.max_hosts = 8;
  p.journal_blocks = 0;
  p.inode_count = 1ull << 40;
  CHECK(PlanLayout(p).status().code() == Status::Code::kNoSpace);
  p.inode_count = 0;
  // Beyond 2^48 blocks.
  p.device_bytes = ~uint64_t{0};
  r = PlanLayout(p);
  CHECK(r.status().code() == Status::Code::kInvalid);
  // More than 2^32 groups of one refcount block each.
  p.device_bytes = (1ull << 60) - 1;
  p.group_refblocks = 1;
  r = PlanLayout(p);
  REQUIRE(r.status().code() == Status::Code::kInvalid);
}

// ============================================================== journal

TEST_CASE("journal header: round trip", "[format]") {
  for (JournalHeader jh : {JournalHeader{1, 1, 0}, JournalHeader{kMaxHosts, UINT64_MAX, 1022},
                           JournalHeader{17, 123456789, 77}}) {
    Block blk;
    EncodeJournalHeader(jh, 42, kUuid, 2560, blk.data());
    CHECK(PeekHeader(blk.data()).seq == 42);
    CHECK(PeekHeader(blk.data()).magic == kMagicJournalHeader);
    Result<JournalHeader> r = DecodeJournalHeader(blk.data(), kUuid, 2560);
    REQUIRE(r.ok());
    CHECK(r->host == jh.host);
    CHECK(r->tail_seq == jh.tail_seq);
    REQUIRE(r->tail_pos == jh.tail_pos);
  }
  JournalHeader d;
  CHECK(d.tail_seq == 1);
  REQUIRE(d.tail_pos == 0);
}

TEST_CASE("journal transaction: round trip", "[format]") {
  std::vector<std::vector<uint64_t>> cases = {{0}, {4864, 4865, 4608}, {kPtrAddrMask}};
  std::vector<uint64_t> many;
  for (uint32_t i = 0; i < kMaxTxnBlocks; i++) many.push_back(kPtrAddrMask - i * 1000003);
  cases.push_back(many);
  for (const auto& homes : cases) {
    JournalTxn t;
    t.seq = homes.size() * 1000 + 1;
    t.images_crc = static_cast<uint32_t>(homes.size() * 0x9e3779b9u);
    t.homes = homes;
    Block blk;
    EncodeJournalTxn(t, kUuid, 2561, blk.data());
    CHECK(PeekHeader(blk.data()).seq == t.seq);
    Result<JournalTxn> r = DecodeJournalTxn(blk.data(), kUuid, 2561);
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    CHECK(r->seq == t.seq);
    CHECK(r->images_crc == t.images_crc);
    REQUIRE(r->homes == t.homes);
  }
}

TEST_CASE("journal transaction: bad image counts and homes", "[format]") {
  JournalTxn t;
  t.seq = 5;
  t.homes = {4864};
  Block good;
  EncodeJournalTxn(t, kUuid, 2561, good.data());
  for (uint32_t n : {0u, kMaxTxnBlocks + 1, 100000u, 0xffffffffu}) {
    INFO(n << " images");
    Block blk = good;
    EncodeU32(&blk[kHeaderSize], n);
    Reseal(blk.data(), kUuid);
    Result<JournalTxn> r = DecodeJournalTxn(blk.data(), kUuid, 2561);
    REQUIRE(!r.ok());
    CHECK(r.status().code() == Status::Code::kCorruption);
    CHECK(Contains(r.status().message(), "journal transaction at block 2561"));
    CHECK(Contains(r.status().message(), std::to_string(n) + " images"));
  }
  // The count is the only thing that says how many homes there are.
  Block blk = good;
  EncodeU32(&blk[kHeaderSize], kMaxTxnBlocks);
  Reseal(blk.data(), kUuid);
  Result<JournalTxn> r = DecodeJournalTxn(blk.data(), kUuid, 2561);
  REQUIRE(r.ok());
  CHECK(r->homes.size() == kMaxTxnBlocks);
  CHECK(r->homes[0] == 4864);
  CHECK(r->homes[1] == 0);
  // A home address beyond the 48-bit block space.
  for (int bit : {48, 55, 63}) {
    Block b2 = good;
    EncodeU64(&b2[kHeaderSize + 8], 4864 | (1ull << bit));
    Reseal(b2.data(), kUuid);
    r = DecodeJournalTxn(b2.data(), kUuid, 2561);
    CHECK(r.status().code() == Status::Code::kCorruption);
    CHECK(Contains(r.status().message(), "home address"));
  }
}

// =============================================================== inodes

TEST_CASE("inode: round trip", "[format]") {
  std::vector<Inode> cases;
  Inode free_inode;
  free_inode.ino = 1;
  cases.push_back(free_inode);
  Inode freed_with_name;  // a deleted file may keep its old bytes
  freed_with_name.ino = 2;
  freed_with_name.generation = 9;
  freed_with_name.kind = FileKind::kRegular;
  freed_with_name.name = "old";
  cases.push_back(freed_with_name);
  for (uint16_t k = 1; k <= static_cast<uint16_t>(FileKind::kSystem); k++) {
    Inode in;
    in.ino = 100 + k;
    in.generation = k;
    in.flags = kInodeInUse | (k % 2 ? kInodeDedupOff : 0);
    in.kind = static_cast<FileKind>(k);
    in.depth = static_cast<uint8_t>(k);
    in.root = 5000 + k;
    in.size = uint64_t{k} << 40;
    in.mapped_blocks = 12345;
    in.ctime_ns = 1;
    in.mtime_ns = 2;
    in.owner_ino = k == 4 ? 101 : 0;
    in.name = std::string("file-") + FileKindName(in.kind);
    cases.push_back(in);
  }
  Inode extreme;
  extreme.ino = UINT64_MAX;
  extreme.generation = UINT64_MAX;
  extreme.flags = kInodeKnownFlags;
  extreme.kind = FileKind::kSystem;
  extreme.depth = 6;
  extreme.root = kPtrAddrMask;
  extreme.size = kMaxFileBytes;  // the largest a decoder takes
  extreme.mapped_blocks = UINT64_MAX;
  extreme.ctime_ns = UINT64_MAX;
  extreme.mtime_ns = UINT64_MAX;
  extreme.owner_ino = UINT64_MAX;
  extreme.name = std::string(kMaxNameLen, '\xff');
  cases.push_back(extreme);
  Inode odd_name = extreme;
  odd_name.name = std::string("a\0b/\n\xc3\xa9", 7);  // bytes, not a C string
  cases.push_back(odd_name);

  for (const Inode& in : cases) {
    INFO("ino " << in.ino << " name " << in.name.size() << " bytes");
    Block blk;
    EncodeInode(in, 77, kUuid, 9000, blk.data());
    CHECK(PeekHeader(blk.data()).seq == 77);
    Result<Inode> r = DecodeInode(blk.data(), kUuid, 9000);
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    RequireSameInode(*r, in);
    CHECK(r->in_use() == ((in.flags & kInodeInUse) != 0));
  }
}

TEST_CASE("inode: names longer than the limit are cut, never corrupted", "[format]") {
  // Regression: a 256-byte name used to store length 0 (256 mod 256),
  // making the in-use inode undecodable.
  for (size_t len : {size_t{kMaxNameLen} + 1, size_t{256 + 5}, size_t{1000}}) {
    Inode in;
    in.ino = 5;
    in.flags = kInodeInUse;
    in.kind = FileKind::kRegular;
    in.name = std::string(len, 'n');
    Block blk;
    EncodeInode(in, 1, kUuid, 9000, blk.data());
    Result<Inode> r = DecodeInode(blk.data(), kUuid, 9000);
    INFO(len << ": " << r.status().ToString());
    REQUIRE(r.ok());
    CHECK(r->name == std::string(kMaxNameLen, 'n'));
    // Nothing beyond the name field was touched.
    REQUIRE(blk[128 + kMaxNameLen] == 0);
  }
}

TEST_CASE("inode: unknown flags, kinds and bad maps are refused", "[format]") {
  Inode base;
  base.ino = 7;
  base.flags = kInodeInUse;
  base.kind = FileKind::kRegular;
  base.name = "disk";
  base.depth = 1;
  base.root = 6000;
  Block blk;
  auto decode = [&](const Inode& in) {
    EncodeInode(in, 1, kUuid, 4610, blk.data());
    return DecodeInode(blk.data(), kUuid, 4610);
  };
  REQUIRE(decode(base).ok());

  for (uint32_t bit : {2u, 3u, 16u, 31u}) {
    Inode in = base;
    in.flags |= 1u << bit;
    Result<Inode> r = decode(in);
    CHECK(r.status().code() == Status::Code::kUnsupported);
    CHECK(Contains(r.status().message(), "inode 7 at block 4610"));
    CHECK(Contains(r.status().message(), "unknown flags"));
  }
  for (uint16_t kind : {uint16_t{7}, uint16_t{100}, uint16_t{0xffff}}) {
    Inode in = base;
    in.kind = static_cast<FileKind>(kind);
    Result<Inode> r = decode(in);
    CHECK(r.status().code() == Status::Code::kUnsupported);
    CHECK(Contains(r.status().message(), "inode 7 at block 4610"));
    CHECK(Contains(r.status().message(), "unknown file kind " + std::to_string(kind)));
  }
  struct Bad {
    uint8_t depth;
    uint64_t root;
  };
  for (Bad b : {Bad{7, 6000}, Bad{255, 6000}, Bad{1, 0}, Bad{0, 6000}, Bad{1, kPtrCow | 6000},
                Bad{1, (1ull << 48) | 6000}, Bad{2, 1ull << 62}}) {
    INFO("depth " << int(b.depth) << " root " << b.root);
    Inode in = base;
    in.depth = b.depth;
    in.root = b.root;
    Result<Inode> r = decode(in);
    CHECK(r.status().code() == Status::Code::kCorruption);
    CHECK(Contains(r.status().message(), "inode 7 at block 4610"));
    CHECK(Contains(r.status().message(), "block-map root"));
  }
  Inode nameless = base;
  nameless.name.clear();
  Result<Inode> r = decode(nameless);
  CHECK(r.status().code() == Status::Code::kCorruption);
  CHECK(Contains(r.status().message(), "without a name"));
  Inode kindless = base;
  kindless.kind = FileKind::kNone;
  r = decode(kindless);
  CHECK(r.status().code() == Status::Code::kCorruption);
  // The same fields are fine on a free inode.
  nameless.flags = 0;
  kindless.flags = kInodeDedupOff;
  CHECK(decode(nameless).ok());
  REQUIRE(decode(kindless).ok());

  // A size no create or truncate writes: its block count would wrap.
  Inode limit = base;
  limit.size = kMaxFileBytes;
  CHECK(decode(limit).ok());
  for (uint64_t size : {kMaxFileBytes + 1, UINT64_MAX - 100, UINT64_MAX}) {
    INFO("size " << size);
    Inode in = base;
    in.size = size;
    r = decode(in);
    CHECK(r.status().code() == Status::Code::kCorruption);
    CHECK(Contains(r.status().message(), "inode 7 at block 4610"));
    CHECK(Contains(r.status().message(), "size " + std::to_string(size)));
  }
}

TEST_CASE("inode: kinds and flags keep their numbers", "[format]") {
  CHECK(static_cast<int>(FileKind::kNone) == 0);
  CHECK(static_cast<int>(FileKind::kRegular) == 1);
  CHECK(static_cast<int>(FileKind::kIndexShard) == 2);
  CHECK(static_cast<int>(FileKind::kArena) == 3);
  CHECK(static_cast<int>(FileKind::kWriteLog) == 4);
  CHECK(static_cast<int>(FileKind::kMergeRequest) == 5);
  CHECK(static_cast<int>(FileKind::kSystem) == 6);
  CHECK(kInodeInUse == 1u);
  CHECK(kInodeDedupOff == 2u);
  CHECK(static_cast<int>(HashAlgo::kXxh128) == 1);
  CHECK(static_cast<int>(HashAlgo::kSha256) == 2);
  CHECK(std::string(FileKindName(FileKind::kRegular)) == "file");
  CHECK(std::string(FileKindName(FileKind::kIndexShard)) == "index-shard");
  CHECK(std::string(FileKindName(FileKind::kArena)) == "arena");
  CHECK(std::string(FileKindName(FileKind::kWriteLog)) == "write-log");
  CHECK(std::string(FileKindName(FileKind::kMergeRequest)) == "merge-request");
  CHECK(std::string(FileKindName(FileKind::kSystem)) == "system");
  CHECK(std::string(FileKindName(FileKind::kNone)) == "none");
  REQUIRE(std::string(FileKindName(static_cast<FileKind>(42))) == "unknown");
}

TEST_CASE("inode: field offsets", "[format]") {
  Inode in;
  in.ino = 0x1111;
  in.generation = 0x2222;
  in.flags = kInodeInUse | kInodeDedupOff;
  in.kind = FileKind::kArena;
  in.depth = 3;
  in.size = 0x3333;
  in.root = 0x4444;
  in.mapped_blocks = 0x5555;
  in.ctime_ns = 0x6666;
  in.mtime_ns = 0x7777;
  in.owner_ino = 0x8888;
  in.name = "arena";
  Block blk;
  EncodeInode(in, 1, kUuid, 4700, blk.data());
  CHECK(DecodeU64(&blk[32]) == 0x1111);
  CHECK(DecodeU64(&blk[40]) == 0x2222);
  CHECK(DecodeU32(&blk[48]) == 3);
  CHECK(DecodeU16(&blk[52]) == 3);
  CHECK(blk[54] == 3);
  CHECK(blk[55] == 5);
  CHECK(DecodeU64(&blk[56]) == 0x3333);
  CHECK(DecodeU64(&blk[64]) == 0x4444);
  CHECK(DecodeU64(&blk[72]) == 0x5555);
  CHECK(DecodeU64(&blk[80]) == 0x6666);
  CHECK(DecodeU64(&blk[88]) == 0x7777);
  CHECK(DecodeU64(&blk[96]) == 0x8888);
  CHECK(std::all_of(&blk[104], &blk[128], [](uint8_t b) { return b == 0; }));
  CHECK(std::memcmp(&blk[128], "arena", 5) == 0);
  REQUIRE(std::all_of(&blk[133], blk.end(), [](uint8_t b) { return b == 0; }));
}

// ============================================================ block map

TEST_CASE("block pointers: bit layout", "[format]") {
  CHECK(kPtrAddrMask == 0x0000ffffffffffffull);
  CHECK(kPtrCow == 0x8000000000000000ull);
  CHECK(kPtrReserved == 0x7fff000000000000ull);
  CHECK(PtrAddr(kPtrCow | 1234) == 1234);
  CHECK(PtrCow(kPtrCow | 1234));
  CHECK(!PtrCow(1234));
  REQUIRE(PtrAddr(0) == 0);
}

TEST_CASE("pointer block: round trip", "[format]") {
  std::mt19937_64 rng(99);
  for (uint8_t level = 1; level <= 6; level++) {
    PointerBlock pb;
    pb.level = level;
    for (uint32_t i = 0; i < kPointersPerBlock; i++) {
      switch (i % 4) {
        case 0:
          pb.ptrs[i] = 0;
          break;  // hole
        case 1:
          pb.ptrs[i] = rng() & kPtrAddrMask;
          break;
        case 2:
          pb.ptrs[i] = kPtrCow | (rng() & kPtrAddrMask);
          break;
        case 3:
          pb.ptrs[i] = i == 3 ? kPtrCow | kPtrAddrMask : kPtrAddrMask;
          break;
      }
    }
    Block blk;
    blk.fill(0xcc);  // the encoder must own every byte
    EncodePointerBlock(pb, 1000 + level, kUuid, 70000, blk.data());
    CHECK(PeekHeader(blk.data()).flags == level);
    CHECK(PeekHeader(blk.data()).seq == 1000u + level);
    Result<PointerBlock> r = DecodePointerBlock(blk.data(), kUuid, 70000);
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    CHECK(r->level == level);
    REQUIRE(r->ptrs == pb.ptrs);
    for (uint32_t i = 0; i < kPointersPerBlock; i++) REQUIRE(GetPtr(blk.data(), i) == pb.ptrs[i]);
  }
  PointerBlock empty;
  Block blk;
  EncodePointerBlock(empty, 1, kUuid, 70000, blk.data());
  Result<PointerBlock> r = DecodePointerBlock(blk.data(), kUuid, 70000);
  REQUIRE(r.ok());
  REQUIRE(r->level == 1);
}

TEST_CASE("pointer block: in-place edit then reseal", "[format]") {
  PointerBlock pb;
  Block blk;
  EncodePointerBlock(pb, 1, kUuid, 70000, blk.data());
  SetPtr(blk.data(), 0, 42);
  SetPtr(blk.data(), kPointersPerBlock - 1, kPtrCow | 43);
  // Edited but not resealed: the crc no longer matches.
  CHECK(!DecodePointerBlock(blk.data(), kUuid, 70000).ok());
  BlockHeader h = PeekHeader(blk.data());
  h.seq++;
  SealBlock(blk.data(), h, kUuid);
  Result<PointerBlock> r = DecodePointerBlock(blk.data(), kUuid, 70000);
  REQUIRE(r.ok());
  CHECK(r->ptrs[0] == 42);
  CHECK(r->ptrs[kPointersPerBlock - 1] == (kPtrCow | 43));
  CHECK(r->ptrs[1] == 0);
  REQUIRE(DecodeU64(&blk[kHeaderSize + 8 * (kPointersPerBlock - 1)]) == (kPtrCow | 43));
}

TEST_CASE("pointer block: reserved bits and bad levels are refused", "[format]") {
  PointerBlock pb;
  for (uint32_t i = 0; i < kPointersPerBlock; i++) pb.ptrs[i] = 1000 + i;
  for (int bit = 48; bit <= 62; bit++) {
    for (uint32_t entry : {0u, 250u, kPointersPerBlock - 1}) {
      INFO("bit " << bit << " entry " << entry);
      PointerBlock bad = pb;
      bad.ptrs[entry] |= 1ull << bit;
      Block blk;
      EncodePointerBlock(bad, 1, kUuid, 70000, blk.data());
      Result<PointerBlock> r = DecodePointerBlock(blk.data(), kUuid, 70000);
      REQUIRE(r.status().code() == Status::Code::kCorruption);
      CHECK(Contains(r.status().message(), "pointer block at block 70000"));
      CHECK(Contains(r.status().message(), "entry " + std::to_string(entry)));
      CHECK(Contains(r.status().message(), "reserved bits"));
    }
  }
  for (uint8_t level : {uint8_t{0}, uint8_t{7}, uint8_t{255}}) {
    PointerBlock bad = pb;
    bad.level = level;
    Block blk;
    EncodePointerBlock(bad, 1, kUuid, 70000, blk.data());
    Result<PointerBlock> r = DecodePointerBlock(blk.data(), kUuid, 70000);
    CHECK(r.status().code() == Status::Code::kCorruption);
    CHECK(Contains(r.status().message(), "pointer block at block 70000"));
    CHECK(Contains(r.status().message(), "level " + std::to_string(level)));
  }
  // Level lives in the header flags; a huge value there is refused too.
  Block blk;
  EncodePointerBlock(pb, 1, kUuid, 70000, blk.data());
  BlockHeader h = PeekHeader(blk.data());
  h.flags = 0x101;
  SealBlock(blk.data(), h, kUuid);
  REQUIRE(DecodePointerBlock(blk.data(), kUuid, 70000).status().code() ==
          Status::Code::kCorruption);
}

// ============================================================ refcounts

TEST_CASE("refcount block: round trip and in-place edits", "[format]") {
  RefcountBlock rb;
  for (uint32_t i = 0; i < kRefsPerBlock; i++) {
    rb.refs[i] = i % 3 == 0 ? 0 : (i % 3 == 1 ? 1 : UINT32_MAX - i);
  }
  Block blk;
  blk.fill(0x5a);
  EncodeRefcountBlock(rb, 12, kUuid, 4864, blk.data());
  CHECK(PeekHeader(blk.data()).seq == 12);
  CHECK(PeekHeader(blk.data()).flags == 0);
  Result<RefcountBlock> r = DecodeRefcountBlock(blk.data(), kUuid, 4864);
  REQUIRE(r.ok());
  CHECK(r->refs == rb.refs);
  for (uint32_t i = 0; i < kRefsPerBlock; i++) REQUIRE(GetRef(blk.data(), i) == rb.refs[i]);

  SetRef(blk.data(), 7, 99);
  SetRef(blk.data(), kRefsPerBlock - 1, 5);
  CHECK(DecodeU32(&blk[kHeaderSize + 4 * 7]) == 99);
  CHECK(!DecodeRefcountBlock(blk.data(), kUuid, 4864).ok());
  Reseal(blk.data(), kUuid);
  r = DecodeRefcountBlock(blk.data(), kUuid, 4864);
  REQUIRE(r.ok());
  CHECK(r->refs[7] == 99);
  CHECK(r->refs[kRefsPerBlock - 1] == 5);
  REQUIRE(r->refs[8] == rb.refs[8]);
}

// ================================================================ uuids

TEST_CASE("uuid: text form and random generation", "[format]") {
  CHECK(UuidToString(kUuid) == "10325476-98ba-dcfe-0123-456789abcdef");
  CHECK(UuidToString(Uuid{}) == "00000000-0000-0000-0000-000000000000");
  Uuid a = NewRandomUuid(), b = NewRandomUuid();
  CHECK(a != b);
  for (const Uuid& u : {a, b}) {
    CHECK((u[6] >> 4) == 4);       // version 4
    CHECK((u[8] & 0xc0) == 0x80);  // RFC 4122 variant
    REQUIRE(UuidToString(u).size() == 36);
  }
}

// ------------------------------------------------------------- lock table

namespace {
std::vector<LockRecord> SampleLockRecords(size_t n) {
  std::vector<LockRecord> v;
  for (size_t i = 0; i < n; i++) {
    LockRecord r;
    r.kind = static_cast<uint16_t>(1 + i % 8);
    r.mode = i % 3 ? 2 : 1;
    r.host = static_cast<uint32_t>(1 + i % 250);
    r.id = 0x123456789ull * (i + 1);
    r.generation = 7 + i;
    r.since_ns = 1700000000000000000ull + i;
    v.push_back(r);
  }
  return v;
}
}  // namespace

TEST_CASE("lock table block: round trip and record layout", "[format]") {
  Block blk;
  for (size_t n : {size_t{0}, size_t{1}, size_t{kLockRecordsPerBlock}}) {
    std::vector<LockRecord> recs = SampleLockRecords(n);
    EncodeLockTableBlock(recs, 42, 9000, kUuid, blk.data());
    CHECK(PeekHeader(blk.data()).magic == kMagicLockTable);
    CHECK(PeekHeader(blk.data()).seq == 42);
    auto r = DecodeLockTableBlock(blk.data(), 9000, kUuid);
    REQUIRE(r.ok());
    CHECK(r.value() == recs);
  }
  // Field offsets pin the encoding (docs/FORMAT.md, lock table).
  std::vector<LockRecord> one = SampleLockRecords(1);
  EncodeLockTableBlock(one, 1, 9000, kUuid, blk.data());
  CHECK(DecodeU32(blk.data() + kHeaderSize) == 1);
  const uint8_t* rec = blk.data() + kHeaderSize + 8;
  CHECK(DecodeU16(rec) == one[0].kind);
  CHECK(rec[2] == one[0].mode);
  CHECK(DecodeU32(rec + 4) == one[0].host);
  CHECK(DecodeU64(rec + 8) == one[0].id);
  CHECK(DecodeU64(rec + 16) == one[0].generation);
  CHECK(DecodeU64(rec + 24) == one[0].since_ns);
  CHECK(kLockRecordsPerBlock == 126);
}

TEST_CASE("lock table block: all zero is empty and damage is refused", "[format]") {
  Block blk{};
  auto empty = DecodeLockTableBlock(blk.data(), 9000, kUuid);
  REQUIRE(empty.ok());
  CHECK(empty->empty());

  std::vector<LockRecord> recs = SampleLockRecords(5);
  EncodeLockTableBlock(recs, 3, 9000, kUuid, blk.data());
  CHECK(DecodeLockTableBlock(blk.data(), 9001, kUuid).status().code() ==
        Status::Code::kCorruption);  // misdirected
  CHECK(DecodeLockTableBlock(blk.data(), 9000, kOtherUuid).status().code() ==
        Status::Code::kCorruption);  // another volume's
  for (size_t byte : {size_t{0}, size_t{40}, size_t{100}, size_t{kBlockSize - 1}}) {
    Block bad = blk;
    bad[byte] ^= 0x10;
    auto r = DecodeLockTableBlock(bad.data(), 9000, kUuid);
    CHECK(!r.ok());
    CHECK(Contains(r.status().message(), "lock table block 9000"));
  }
  // A count beyond the block and an unknown mode, with a valid crc.
  Block bad = blk;
  EncodeU32(bad.data() + kHeaderSize, kLockRecordsPerBlock + 1);
  Reseal(bad.data(), kUuid);
  CHECK(Contains(DecodeLockTableBlock(bad.data(), 9000, kUuid).status().message(), "records"));
  bad = blk;
  bad[kHeaderSize + 8 + 2] = 3;
  Reseal(bad.data(), kUuid);
  CHECK(Contains(DecodeLockTableBlock(bad.data(), 9000, kUuid).status().message(), "mode 3"));
}

TEST_CASE("lock table: lease layout of a sanlock volume", "[format]") {
  Superblock sb = Plan(64 * kMiB);
  REQUIRE(sb.lease_slots == 8);
  LeaseLayout l = LeaseLayoutOf(sb);
  CHECK(l.partitions == 6);
  CHECK(l.lockspace_offset == sb.lease_start * kBlockSize);
  CHECK(l.SlotOffset(0) == (sb.lease_start + kLeaseBlocks) * kBlockSize);
  // The table lives in the last slot, inside the lease area.
  CHECK(l.table_block == sb.lease_start + 8 * kLeaseBlocks);
  CHECK(l.PartitionBlock(l.partitions - 1, kLockTableBlocksPerPartition - 1) <
        sb.lease_start + sb.lease_blocks);
  // The last partition lease slot comes before the table's slot.
  CHECK(l.SlotOffset(l.partitions) < l.table_block * kBlockSize);
  Superblock big = Plan(8 * kGiB);
  LeaseLayout lb = LeaseLayoutOf(big);
  CHECK(lb.partitions == kMaxLockTablePartitions);
  CHECK(lb.PartitionBlock(lb.partitions - 1, kLockTableBlocksPerPartition - 1) <
        big.lease_start + big.lease_blocks);
  Superblock tiny = sb;
  tiny.lease_slots = 2;
  CHECK(LeaseLayoutOf(tiny).partitions == 0);
}

// ============================================================ drop lists

namespace {

// The drop-list tests use the 64 MiB default layout: 8 hosts with 256
// journal blocks each, the last 8 of them the host's drop list; one
// partial group of 12 refcount blocks whose data runs to the device end.
struct DropFixture {
  Superblock sb = Plan(64 * kMiB);
  uint64_t data_start = sb.GroupDataStart(0);
  uint64_t data_end = data_start + sb.GroupDataBlocks(0);  // one past the last data block
  uint32_t host = 2;
  uint64_t addr = sb.DropListStart(2);
};

// `n` data-block addresses spread over the group (repeats allowed).
std::vector<uint64_t> SampleDrops(const DropFixture& f, size_t n) {
  std::vector<uint64_t> v;
  const uint64_t span = f.data_end - f.data_start;
  for (size_t i = 0; i < n; i++) v.push_back(f.data_start + (i * 7919) % span);
  return v;
}

// The decoder's verdict on a bad drop-list block read at `addr` for `host`:
// "" when it is a kCorruption whose message names the block ("drop list
// block" and the address) and mentions `word` and `word2`.
std::string DropCorrupt(const uint8_t* blk, const Superblock& sb, uint32_t host, uint64_t addr,
                        const std::string& word, const std::string& word2 = "") {
  Result<std::vector<uint64_t>> r = DecodeDropListBlock(blk, sb, host, addr);
  if (r.ok()) return "decoded OK (" + std::to_string(r->size()) + " entries)";
  const Status& s = r.status();
  if (s.code() != Status::Code::kCorruption) return "code " + std::string(s.CodeName());
  const std::string& m = s.message();
  if (!Contains(m, "drop list block") || !Contains(m, "block " + std::to_string(addr)) ||
      !Contains(m, word) || !Contains(m, word2)) {
    return "message: " + m;
  }
  return "";
}

}  // namespace

TEST_CASE("drop list block: round trip and field layout", "[format]") {
  DropFixture f;
  REQUIRE(f.sb.drop_blocks == 8);
  REQUIRE(f.addr == 3064);
  REQUIRE(f.data_start == 4876);
  REQUIRE(f.data_end == f.sb.total_blocks);
  CHECK(kDropsPerBlock == 507);
  CHECK(kHeaderSize + 8 + 8 * kDropsPerBlock == kBlockSize);
  uint8_t m[4];
  EncodeU32(m, kMagicDropList);
  CHECK(std::string(reinterpret_cast<char*>(m), 4) == "DDDL");

  const uint64_t last = f.data_end - 1;
  const std::vector<std::vector<uint64_t>> cases = {
      {},                              // empty
      {f.data_start},                  // one entry
      SampleDrops(f, kDropsPerBlock),  // a full block
      // The same block more than once: one entry per reference.
      {last, f.data_start + 5, f.data_start + 5, last, f.data_start + 5},
  };
  for (const std::vector<uint64_t>& drops : cases) {
    for (uint32_t host : {1u, 2u, 8u}) {
      for (uint32_t i : {0u, f.sb.drop_blocks - 1}) {
        const uint64_t addr = f.sb.DropListStart(host) + i;
        INFO(drops.size() << " entries, host " << host << ", block " << addr);
        Block blk;
        blk.fill(0xcc);  // the encoder must own every byte
        EncodeDropListBlock(drops, host, 41, kUuid, addr, blk.data());
        const BlockHeader h = PeekHeader(blk.data());
        CHECK(h.magic == kMagicDropList);
        CHECK(h.major == kFormatMajor);
        CHECK(h.minor == kFormatMinor);
        CHECK(h.flags == 0);
        CHECK(h.seq == 41);
        CHECK(h.addr == addr);
        // Offset 32 count, 36 host, 40 the entries, then zeros.
        CHECK(DecodeU32(&blk[32]) == drops.size());
        CHECK(DecodeU32(&blk[36]) == host);
        bool same = true;
        for (size_t e = 0; e < drops.size(); e++) same &= DecodeU64(&blk[40 + 8 * e]) == drops[e];
        CHECK(same);
        CHECK(std::all_of(blk.begin() + 40 + 8 * drops.size(), blk.end(),
                          [](uint8_t b) { return b == 0; }));
        Result<std::vector<uint64_t>> r = DecodeDropListBlock(blk.data(), f.sb, host, addr);
        INFO(r.status().ToString());
        REQUIRE(r.ok());
        REQUIRE(*r == drops);
      }
    }
  }
}

TEST_CASE("drop list block: golden encoding pins the on-disk format", "[format]") {
  // Cross-checked with an independent bitwise CRC-32C over the byte layout
  // that docs/FORMAT.md describes (header DDDL 1.1 seq 7, count 3, host 2).
  Block blk;
  EncodeDropListBlock({4876, 4877, 4876}, 2, 7, kUuid, 3064, blk.data());
  CHECK(PeekHeader(blk.data()).minor == 1);
  REQUIRE(DecodeU32(&blk[8]) == 0x9aae5024u);
}

TEST_CASE("drop list block: the all-zero block decodes as empty", "[format]") {
  DropFixture f;
  Superblock foreign = f.sb;
  foreign.uuid = kOtherUuid;
  Block zero{};
  for (uint32_t host : {1u, 2u, 8u}) {
    for (uint64_t addr : {f.sb.DropListStart(host), f.sb.DropListStart(host) + 7}) {
      INFO("host " << host << " block " << addr);
      for (const Superblock* sb : {&f.sb, &foreign}) {
        Result<std::vector<uint64_t>> r = DecodeDropListBlock(zero.data(), *sb, host, addr);
        INFO(r.status().ToString());
        REQUIRE(r.ok());
        REQUIRE(r->empty());
      }
    }
  }
  // One nonzero byte anywhere makes it a block to check: its magic is wrong.
  for (size_t byte : {size_t{0}, size_t{3}, size_t{8}, size_t{31}, size_t{32}, size_t{36},
                      size_t{40}, size_t{kBlockSize - 1}}) {
    INFO("byte " << byte);
    Block blk{};
    blk[byte] = 1;
    REQUIRE(DropCorrupt(blk.data(), f.sb, f.host, f.addr, "magic") == "");
  }
}

TEST_CASE("drop list block: damaged or misplaced blocks are refused", "[format]") {
  DropFixture f;
  const std::vector<uint64_t> drops = {f.data_start, f.data_start + 100, f.data_end - 1};
  Block good;
  EncodeDropListBlock(drops, f.host, 9, kUuid, f.addr, good.data());
  REQUIRE(DecodeDropListBlock(good.data(), f.sb, f.host, f.addr).ok());

  // Every single flipped bit: in the magic it says magic, elsewhere the crc.
  std::string first_bad;
  int failures = 0;
  for (uint32_t bit = 0; bit < kBlockSize * 8; bit++) {
    Block blk = good;
    blk[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    std::string why =
        DropCorrupt(blk.data(), f.sb, f.host, f.addr, bit < 32 ? "magic" : "checksum");
    if (!why.empty()) {
      if (first_bad.empty()) first_bad = "bit " + std::to_string(bit) + ": " + why;
      failures++;
    }
  }
  INFO(first_bad);
  CHECK(failures == 0);

  // Read at another address (a misdirected write): the crc covers the address.
  for (uint64_t other :
       {f.addr + 1, f.addr - 1, f.sb.DropListStart(3), f.addr + (uint64_t{1} << 40)}) {
    INFO("read at " << other);
    CHECK(DropCorrupt(good.data(), f.sb, f.host, other, "checksum") == "");
  }
  // Sealed for the next block but found here; the header address forged.
  Block moved;
  EncodeDropListBlock(drops, f.host, 9, kUuid, f.addr + 1, moved.data());
  CHECK(DecodeDropListBlock(moved.data(), f.sb, f.host, f.addr + 1).ok());
  CHECK(DropCorrupt(moved.data(), f.sb, f.host, f.addr, "checksum") == "");
  Block forged = good;
  EncodeU64(&forged[24], f.addr + 1);
  CHECK(DropCorrupt(forged.data(), f.sb, f.host, f.addr + 1, "checksum") == "");

  // Another volume's block, or this block read with another volume's uuid.
  Block foreign;
  EncodeDropListBlock(drops, f.host, 9, kOtherUuid, f.addr, foreign.data());
  CHECK(DropCorrupt(foreign.data(), f.sb, f.host, f.addr, "checksum") == "");
  Superblock other = f.sb;
  other.uuid = kOtherUuid;
  CHECK(DecodeDropListBlock(foreign.data(), other, f.host, f.addr).ok());
  CHECK(DropCorrupt(good.data(), other, f.host, f.addr, "checksum") == "");

  // Wrong magic: other structures at this address (a journal ring block,
  // a refcount or lock table block), the magic edited and resealed, garbage.
  Block blk;
  JournalTxn t;
  t.seq = 5;
  t.homes = {f.data_start};
  EncodeJournalTxn(t, kUuid, f.addr, blk.data());
  CHECK(DropCorrupt(blk.data(), f.sb, f.host, f.addr, "magic") == "");
  RefcountBlock rb;
  EncodeRefcountBlock(rb, 1, kUuid, f.addr, blk.data());
  CHECK(DropCorrupt(blk.data(), f.sb, f.host, f.addr, "magic") == "");
  EncodeLockTableBlock({}, 1, f.addr, kUuid, blk.data());
  CHECK(DropCorrupt(blk.data(), f.sb, f.host, f.addr, "magic") == "");
  blk = good;
  BlockHeader h = PeekHeader(blk.data());
  h.magic = kMagicRefcountBlock;
  SealBlock(blk.data(), h, kUuid);
  CHECK(DropCorrupt(blk.data(), f.sb, f.host, f.addr, "bad magic 0x43524444") == "");
  blk.fill(0xff);
  CHECK(DropCorrupt(blk.data(), f.sb, f.host, f.addr, "magic") == "");
  std::mt19937_64 rng(11);
  for (int i = 0; i < 50; i++) {
    for (auto& b : blk) b = static_cast<uint8_t>(rng());
    CHECK(DropCorrupt(blk.data(), f.sb, f.host, f.addr, "magic") == "");
    EncodeU32(blk.data(), kMagicDropList);  // right magic, random rest
    CHECK(DropCorrupt(blk.data(), f.sb, f.host, f.addr, "checksum") == "");
  }

  // Versions: a newer major is refused as such, major 0 is damage, a
  // newer minor is read.
  blk = good;
  h = PeekHeader(blk.data());
  h.major = kFormatMajor + 1;
  SealBlock(blk.data(), h, kUuid);
  CHECK(DecodeDropListBlock(blk.data(), f.sb, f.host, f.addr).status().code() ==
        Status::Code::kUnsupported);
  h.major = 0;
  SealBlock(blk.data(), h, kUuid);
  CHECK(DropCorrupt(blk.data(), f.sb, f.host, f.addr, "version 0") == "");
  h.major = kFormatMajor;
  h.minor = kFormatMinor + 3;
  SealBlock(blk.data(), h, kUuid);
  CHECK(DecodeDropListBlock(blk.data(), f.sb, f.host, f.addr).ok());

  // Torn writes: a new head on an old tail, and a zeroed tail.
  Block newer;
  EncodeDropListBlock(SampleDrops(f, kDropsPerBlock), f.host, 10, kUuid, f.addr, newer.data());
  for (uint32_t cut = 512; cut < kBlockSize; cut += 512) {
    INFO("cut at " << cut);
    Block torn = newer;
    std::memcpy(torn.data() + cut, good.data() + cut, kBlockSize - cut);
    CHECK(DropCorrupt(torn.data(), f.sb, f.host, f.addr, "checksum") == "");
    std::memset(torn.data() + cut, 0, kBlockSize - cut);
    CHECK(DropCorrupt(torn.data(), f.sb, f.host, f.addr, "checksum") == "");
  }
  REQUIRE(DecodeDropListBlock(newer.data(), f.sb, f.host, f.addr).ok());
}

TEST_CASE("drop list block: a block of another host is refused", "[format]") {
  DropFixture f;
  Block blk;
  EncodeDropListBlock({f.data_start}, 3, 1, kUuid, f.addr, blk.data());
  REQUIRE(DecodeDropListBlock(blk.data(), f.sb, 3, f.addr).ok());
  for (uint32_t host : {2u, 1u, 4u, 0u, kMaxHosts}) {
    INFO("decoded as host " << host);
    CHECK(DropCorrupt(blk.data(), f.sb, host, f.addr, "belongs to host 3",
                      "expected host " + std::to_string(host)) == "");
  }
  // An empty list is owned too.
  EncodeDropListBlock({}, 3, 1, kUuid, f.addr, blk.data());
  CHECK(DropCorrupt(blk.data(), f.sb, 2, f.addr, "belongs to host 3") == "");
  // The owner field edited and resealed (host 0, a host past max_hosts).
  for (uint32_t owner : {0u, f.sb.max_hosts + 1, 0xffffffffu}) {
    INFO("owner " << owner);
    EncodeU32(&blk[36], owner);
    Reseal(blk.data(), kUuid);
    CHECK(DropCorrupt(blk.data(), f.sb, 2, f.addr, "belongs to host " + std::to_string(owner)) ==
          "");
  }
  REQUIRE(DecodeDropListBlock(blk.data(), f.sb, 0xffffffffu, f.addr).ok());
}

TEST_CASE("drop list block: counts past the block are refused", "[format]") {
  DropFixture f;
  Block full;
  EncodeDropListBlock(SampleDrops(f, kDropsPerBlock), f.host, 1, kUuid, f.addr, full.data());
  REQUIRE(DecodeDropListBlock(full.data(), f.sb, f.host, f.addr).ok());
  for (uint32_t n : {kDropsPerBlock + 1, 1000u, 0x80000000u, 0xffffffffu}) {
    INFO(n << " entries");
    Block blk = full;
    EncodeU32(&blk[32], n);
    Reseal(blk.data(), kUuid);
    CHECK(DropCorrupt(blk.data(), f.sb, f.host, f.addr, "claims " + std::to_string(n) + " entries",
                      "at most 507") == "");
  }
  // A count above what was written reads the zero padding as an entry:
  // block 0 is not a data block.
  Block blk;
  EncodeDropListBlock({f.data_start, f.data_start + 1, f.data_start + 2}, f.host, 1, kUuid, f.addr,
                      blk.data());
  EncodeU32(&blk[32], 4);
  Reseal(blk.data(), kUuid);
  CHECK(DropCorrupt(blk.data(), f.sb, f.host, f.addr, "entry 3 (0) is not a data block") == "");
  // A count below it leaves an entry after the last one.
  EncodeU32(&blk[32], 2);
  Reseal(blk.data(), kUuid);
  REQUIRE(DropCorrupt(blk.data(), f.sb, f.host, f.addr, "nonzero bytes after entry 2") == "");
}

TEST_CASE("drop list block: entries must be data blocks of the volume", "[format]") {
  DropFixture f;
  const Superblock& sb = f.sb;
  struct Bad {
    const char* what;
    uint64_t a;
  };
  const std::vector<Bad> bad = {
      {"block 0", 0},
      {"superblock copy 1", 1},
      {"lease area", sb.lease_start},
      {"journal header", sb.JournalStart(1)},
      {"journal ring", sb.JournalStart(2) + 2},
      {"this drop list", f.addr},
      {"first inode", sb.inode_start},
      {"inside the inode table", sb.InodeBlock(100)},
      {"last inode", sb.group_start - 1},
      {"first refcount block", sb.group_start},
      {"last refcount block", sb.GroupDataStart(0) - 1},
      {"total_blocks", sb.total_blocks},
      {"past the device end", sb.total_blocks + 1000},
      {"a cow pointer", kPtrCow | f.data_start},
      {"2^48", 1ull << 48},
      {"all ones", UINT64_MAX},
  };
  for (const Bad& b : bad) {
    for (size_t pos : {size_t{0}, size_t{1}, size_t{2}}) {
      INFO(b.what << " (" << b.a << ") as entry " << pos);
      std::vector<uint64_t> drops = {f.data_start, f.data_end - 1};
      drops.insert(drops.begin() + static_cast<std::ptrdiff_t>(pos), b.a);
      Block blk;
      EncodeDropListBlock(drops, f.host, 1, kUuid, f.addr, blk.data());
      CHECK(DropCorrupt(blk.data(), sb, f.host, f.addr,
                        "entry " + std::to_string(pos) + " (" + std::to_string(b.a) +
                            ") is not a data block") == "");
    }
  }

  // Groups in the middle of a device and a slack block at its end: five
  // full groups of 2 refcount blocks, then one block that forms no group.
  const uint64_t full = 2 + 2 * kRefsPerBlock;
  Superblock slack = Plan((4864 + 5 * full + 1) * uint64_t{kBlockSize}, 2);
  REQUIRE(slack.group_count == 5);
  const uint64_t addr = slack.DropListStart(1);
  Block blk;
  for (uint64_t a : {slack.total_blocks - 1, slack.GroupStart(2), slack.GroupStart(2) + 1}) {
    INFO("slack volume block " << a);
    EncodeDropListBlock({a}, 1, 1, kUuid, addr, blk.data());
    CHECK(DropCorrupt(blk.data(), slack, 1, addr, "entry 0", "is not a data block") == "");
  }
  std::vector<uint64_t> edges = {slack.total_blocks - 2, slack.GroupDataStart(2),
                                 slack.GroupStart(2) - 1, slack.GroupDataStart(0)};
  EncodeDropListBlock(edges, 1, 1, kUuid, addr, blk.data());
  Result<std::vector<uint64_t>> r = DecodeDropListBlock(blk.data(), slack, 1, addr);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  REQUIRE(*r == edges);
}

TEST_CASE("drop list block: nonzero bytes after the last entry are refused", "[format]") {
  DropFixture f;
  for (size_t n : {size_t{0}, size_t{3}, size_t{kDropsPerBlock - 1}}) {
    Block good;
    EncodeDropListBlock(SampleDrops(f, n), f.host, 1, kUuid, f.addr, good.data());
    REQUIRE(DecodeDropListBlock(good.data(), f.sb, f.host, f.addr).ok());
    for (size_t off : {40 + 8 * n, 40 + 8 * n + 7, size_t{kBlockSize - 1}}) {
      for (uint8_t v : {uint8_t{0x01}, uint8_t{0x80}}) {
        INFO(n << " entries, byte " << off << " = " << int(v));
        Block blk = good;
        blk[off] = v;
        Reseal(blk.data(), kUuid);
        CHECK(DropCorrupt(blk.data(), f.sb, f.host, f.addr,
                          "nonzero bytes after entry " + std::to_string(n)) == "");
        // A newer minor may use those bytes: read, its entries kept.
        Block newer = blk;
        BlockHeader h = PeekHeader(newer.data());
        h.minor = kFormatMinor + 1;
        SealBlock(newer.data(), h, kUuid);
        auto e = DecodeDropListBlock(newer.data(), f.sb, f.host, f.addr);
        REQUIRE(e.ok());
        CHECK(e->size() == n);
      }
    }
  }
}

TEST_CASE("drop list block: every refusal names drop list block N", "[format]") {
  // Like "lock table block N": whatever the reason, the message names the
  // structure and the address it was read from in one phrase.
  DropFixture f;
  Block good;
  EncodeDropListBlock({f.data_start, f.data_start + 1}, f.host, 4, kUuid, f.addr, good.data());
  struct Case {
    const char* what;
    Block blk;
    uint32_t host;
    uint64_t addr;
    const Superblock* sb;
  };
  Superblock other = f.sb;
  other.uuid = kOtherUuid;
  std::vector<Case> cases;
  cases.push_back({"flipped bit", good, f.host, f.addr, &f.sb});
  cases.back().blk[100] ^= 4;
  cases.push_back({"read at another address", good, f.host, f.addr + 1, &f.sb});
  cases.push_back({"another volume", good, f.host, f.addr, &other});
  cases.push_back({"wrong magic", good, f.host, f.addr, &f.sb});
  EncodeU32(cases.back().blk.data(), kMagicRefcountBlock);
  cases.push_back({"another host", good, 3, f.addr, &f.sb});
  cases.push_back({"count", good, f.host, f.addr, &f.sb});
  EncodeU32(&cases.back().blk[32], kDropsPerBlock + 1);
  Reseal(cases.back().blk.data(), kUuid);
  cases.push_back({"entry", good, f.host, f.addr, &f.sb});
  EncodeU64(&cases.back().blk[40], 0);
  Reseal(cases.back().blk.data(), kUuid);
  cases.push_back({"trailing bytes", good, f.host, f.addr, &f.sb});
  cases.back().blk[kBlockSize - 1] = 1;
  Reseal(cases.back().blk.data(), kUuid);
  for (const Case& c : cases) {
    Result<std::vector<uint64_t>> r = DecodeDropListBlock(c.blk.data(), *c.sb, c.host, c.addr);
    INFO(c.what << ": " << r.status().ToString());
    CHECK(r.status().code() == Status::Code::kCorruption);
    CHECK(Contains(r.status().message(), "drop list block " + std::to_string(c.addr)));
  }
}

// ------------------------------------------- superblock: drop list fields

TEST_CASE("superblock: drop_blocks and kIncompatDropLists round trip", "[format]") {
  CHECK(kIncompatDropLists == 2);
  CHECK((kKnownIncompatFeatures & kIncompatDropLists) != 0);
  CHECK(kFormatMinor == 1);
  Superblock sb = Plan(64 * kMiB);
  CHECK(sb.drop_blocks == 8);
  CHECK(sb.incompat_features == kIncompatDropLists);
  Block blk;
  EncodeSuperblock(sb, 0, blk.data());
  // incompat_features at 152, drop_blocks (u32) at 160, zeros after.
  CHECK(DecodeU64(&blk[152]) == kIncompatDropLists);
  CHECK(DecodeU32(&blk[160]) == 8);
  CHECK(std::all_of(blk.begin() + 164, blk.end(), [](uint8_t b) { return b == 0; }));
  Result<Superblock> r = DecodeSuperblock(blk.data(), 0);
  REQUIRE(r.ok());
  CHECK(r->drop_blocks == 8);
  RequireSameSuperblock(*r, sb);

  struct Ok {
    const char* what;
    uint64_t incompat;
    uint32_t drop_blocks;
  };
  for (Ok o :
       {Ok{"with sanlock", kIncompatSanlock | kIncompatDropLists, 8},
        Ok{"a 1.0 volume: no bit and no list", 0, 0},
        Ok{"a 1.0 sanlock volume", kIncompatSanlock, 0}, Ok{"one block", kIncompatDropLists, 1},
        Ok{"the largest: a ring of 12", kIncompatDropLists, 256 - 2 - 12}}) {
    INFO(o.what);
    Superblock s = sb;
    s.incompat_features = o.incompat;
    s.drop_blocks = o.drop_blocks;
    EncodeSuperblock(s, 1, blk.data());
    r = DecodeSuperblock(blk.data(), 1);
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    CHECK(r->drop_blocks == o.drop_blocks);
    CHECK(r->incompat_features == o.incompat);
    CHECK(r->JournalRingBlocks() == 256 - 2 - o.drop_blocks);
  }
}

TEST_CASE("superblock: inconsistent drop list fields are refused", "[format]") {
  const Superblock base = Plan(64 * kMiB);
  REQUIRE(base.journal_blocks == 256);
  struct Mutation {
    const char* what;
    uint64_t incompat;
    uint32_t drop_blocks;
  };
  const std::vector<Mutation> muts = {
      {"drop_blocks without the feature bit", 0, 8},
      {"drop_blocks with only the sanlock bit", kIncompatSanlock, 8},
      {"the feature bit without drop_blocks", kIncompatDropLists, 0},
      {"the feature bit and sanlock without drop_blocks", kIncompatDropLists | kIncompatSanlock, 0},
      {"a ring of 11", kIncompatDropLists, 256 - 2 - 11},
      {"no ring", kIncompatDropLists, 256 - 2},
      {"the whole journal", kIncompatDropLists, 256},
      {"past the journal", kIncompatDropLists, 257},
      {"2^16", kIncompatDropLists, 1u << 16},
      {"2^31", kIncompatDropLists, 1u << 31},
  };
  Block blk;
  for (const Mutation& m : muts) {
    INFO(m.what);
    Superblock sb = base;
    sb.incompat_features = m.incompat;
    sb.drop_blocks = m.drop_blocks;
    CheckInconsistentLayout(sb);
  }
  // The smallest journal has room for one drop block and no more.
  Superblock small = base;
  small.journal_blocks = 16;
  small.inode_start = small.journal_start + small.max_hosts * 16;
  small.group_start = small.inode_start + small.inode_count;
  small.group_count = 1;
  small.drop_blocks = 2;
  EncodeSuperblock(small, 0, blk.data());
  CHECK(DecodeSuperblock(blk.data(), 0).ok());
  small.drop_blocks = 3;
  EncodeSuperblock(small, 0, blk.data());
  REQUIRE(DecodeSuperblock(blk.data(), 0).status().code() == Status::Code::kCorruption);
  // A journal big enough for more: still at most kMaxDropBlocks, as format
  // makes them (an opener allocates the whole list).
  Superblock big = base;
  big.max_hosts = 1;
  big.journal_blocks = 70000;
  big.inode_start = big.journal_start + big.journal_blocks;
  big.group_start = big.inode_start + big.inode_count;
  big.total_blocks = big.group_start + big.FullGroupBlocks();  // one whole group
  big.group_count = 1;
  big.incompat_features = kIncompatDropLists;
  big.drop_blocks = kMaxDropBlocks;
  EncodeSuperblock(big, 0, blk.data());
  INFO(DecodeSuperblock(blk.data(), 0).status().ToString());
  CHECK(DecodeSuperblock(blk.data(), 0).ok());
  big.drop_blocks = kMaxDropBlocks + 1;
  EncodeSuperblock(big, 0, blk.data());
  CHECK(DecodeSuperblock(blk.data(), 0).status().code() == Status::Code::kCorruption);
}

TEST_CASE("superblock: drop_blocks near 2^32 does not wrap the ring check", "[format]") {
  // drop_blocks + 2 + 12 must not be computed in 32 bits: 2^32 - 14 and
  // above would wrap to a small sum and pass, leaving JournalRingBlocks()
  // and DropListStart() wrapped around 2^64.
  const Superblock base = Plan(64 * kMiB);
  Block blk;
  for (uint32_t d : {0xfffffff1u, 0xfffffff2u, 0xfffffff5u, 0xffffffffu}) {
    INFO("drop_blocks " << d);
    Superblock sb = base;
    sb.drop_blocks = d;
    EncodeSuperblock(sb, 0, blk.data());
    Result<Superblock> r = DecodeSuperblock(blk.data(), 0);
    INFO(r.status().ToString());
    CHECK(r.status().code() == Status::Code::kCorruption);
    CHECK(Contains(r.status().message(), "inconsistent layout fields"));
  }
}

TEST_CASE("superblock: journal ring and drop list arithmetic", "[format]") {
  Superblock s = Plan(64 * kMiB);
  CHECK(s.JournalRingBlocks() == 246);
  CHECK(s.DropListStart(1) == 2560 + 248);
  CHECK(s.DropListStart(2) == 2560 + 256 + 248);
  CHECK(s.DropListStart(8) == 4600);
  CHECK(s.DropListStart(8) + s.drop_blocks == s.inode_start);

  Superblock old = s;  // a 1.0 layout: the list is empty at the region's end
  old.drop_blocks = 0;
  old.incompat_features = 0;
  for (const Superblock& sb : {s, old, Plan(kGiB), Plan(64 * kMiB, 32, 1), Plan(64 * kMiB, 32, 3),
                               Plan(3 * kGiB, 4, 250)}) {
    INFO("journal_blocks " << sb.journal_blocks << ", drop_blocks " << sb.drop_blocks
                           << ", max_hosts " << sb.max_hosts);
    CHECK(sb.JournalRingBlocks() == sb.journal_blocks - 2 - sb.drop_blocks);
    CHECK(sb.JournalRingBlocks() >= 12);
    std::string first_bad;
    for (uint32_t h = 1; h <= sb.max_hosts && first_bad.empty(); h++) {
      const std::string at = "host " + std::to_string(h) + ": ";
      uint32_t g, slot;
      uint64_t rb;
      if (sb.DropListStart(h) + sb.drop_blocks != sb.JournalStart(h) + sb.journal_blocks) {
        first_bad = at + "the list does not end the region";
      } else if (sb.JournalStart(h) + kJournalHeaderSlots + sb.JournalRingBlocks() !=
                 sb.DropListStart(h)) {
        first_bad = at + "the list does not follow the ring";
      } else if (h > 1 && sb.DropListStart(h - 1) + sb.drop_blocks != sb.JournalStart(h)) {
        first_bad = at + "the previous list does not end where this region starts";
      } else if (sb.drop_blocks > 0 &&
                 (sb.LocateData(sb.DropListStart(h), &g, &rb, &slot) ||
                  sb.LocateData(sb.DropListStart(h) + sb.drop_blocks - 1, &g, &rb, &slot))) {
        first_bad = at + "a list block located as data";
      }
    }
    CHECK(first_bad == "");
    REQUIRE(sb.DropListStart(sb.max_hosts) + sb.drop_blocks == sb.inode_start);
  }
}

TEST_CASE("PlanLayout: drop list sizing", "[format]") {
  // Default: journal_blocks / 32, at least 1, with the feature bit.
  CHECK(Plan(64 * kMiB).drop_blocks == 8);
  CHECK(Plan(kGiB - 1).drop_blocks == 8);
  CHECK(Plan(kGiB).drop_blocks == 32);
  CHECK(Plan(10 * kGiB).drop_blocks == 32);
  CHECK(Plan(kGiB << 12).drop_blocks == 32);
  CHECK(Plan(10 * kGiB).incompat_features == kIncompatDropLists);

  FormatParams p;
  p.device_bytes = 2 * kGiB;
  struct Want {
    uint64_t journal_blocks;
    uint32_t drop_blocks;
  };
  for (Want w : {Want{70, 2}, Want{95, 2}, Want{96, 3}, Want{100, 3}, Want{256, 8},
                 Want{1024, 32}, Want{4096, 128}}) {
    INFO("journal_blocks " << w.journal_blocks);
    p.journal_blocks = w.journal_blocks;
    Result<Superblock> r = PlanLayout(p);
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    CHECK(r->drop_blocks == w.drop_blocks);
    CHECK(r->incompat_features == kIncompatDropLists);
    CHECK(r->JournalRingBlocks() == w.journal_blocks - 2 - w.drop_blocks);
    CheckTiling(*r);
  }

  // drop_blocks = 0: no drop list and no feature bit (a 1.0 layout).
  p.journal_blocks = 0;
  p.drop_blocks = 0;
  Result<Superblock> r = PlanLayout(p);
  REQUIRE(r.ok());
  CHECK(r->drop_blocks == 0);
  CHECK(r->incompat_features == 0);
  CHECK(r->JournalRingBlocks() == 1024 - 2);
  CheckTiling(*r);
  // An explicit size is kept.
  p.drop_blocks = 5;
  r = PlanLayout(p);
  REQUIRE(r.ok());
  CHECK(r->drop_blocks == 5);
  CHECK(r->incompat_features == kIncompatDropLists);
  CheckTiling(*r);
  // Any negative value is the default.
  p.drop_blocks = -7;
  CHECK(PlanLayout(p)->drop_blocks == 32);

  // Sizes that leave the ring fewer than 66 blocks (a transaction must hold
  // kMinTxnBlocks, 32), or do not fit.
  struct Bad {
    uint64_t journal_blocks;
    int64_t drop_blocks;
  };
  for (Bad b :
       {Bad{256, 189}, Bad{256, 254}, Bad{256, 256}, Bad{256, 1000}, Bad{16, 3}, Bad{16, 2},
        Bad{69, -1}, Bad{70, 3}, Bad{0, 957},
        Bad{0, int64_t{1} << 32}, Bad{0, (int64_t{1} << 32) + 5}, Bad{0, INT64_MAX}}) {
    INFO("journal_blocks " << b.journal_blocks << ", drop_blocks " << b.drop_blocks);
    p.journal_blocks = b.journal_blocks;
    p.drop_blocks = b.drop_blocks;
    r = PlanLayout(p);
    CHECK(r.status().code() == Status::Code::kInvalid);
    CHECK(Contains(r.status().message(), "drop list"));
  }
  p.journal_blocks = 256;
  p.drop_blocks = 189;
  CHECK(Contains(PlanLayout(p).status().message(), "fewer than 66"));
  // The limits themselves are fine.
  for (Bad b : {Bad{256, 188}, Bad{70, 2}, Bad{70, -1}, Bad{0, 956}}) {
    INFO("journal_blocks " << b.journal_blocks << ", drop_blocks " << b.drop_blocks);
    p.journal_blocks = b.journal_blocks;
    p.drop_blocks = b.drop_blocks;
    r = PlanLayout(p);
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    CHECK(r->JournalRingBlocks() == 66);
    CheckTiling(*r);
  }
}
