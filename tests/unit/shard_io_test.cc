// Tests for streaming shard and pending-file I/O on an in-memory volume
// (index/shard_io.h): ShardWriter -> ShardReader round trips, the reader's
// handling of corrupt entry blocks, headers, file tables and truncation,
// the writer's ordering rules, and pending-file frames.
#include "index/shard_io.h"

#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "tests/temp_locks.h"
#include "util/coding.h"
#include "volume/lock_manager.h"
#include "volume/mem_device.h"

using namespace dede;
using dede::test::TempLocks;

namespace {

constexpr uint64_t kB = kBlockSize;

struct MemVolume {
  explicit MemVolume(HashAlgo algo = HashAlgo::kXxh128, uint64_t bytes = 64 << 20) : dev(bytes) {
    FormatOptions fo;
    fo.hash_algo = algo;
    REQUIRE(FormatVolume(&dev, fo, false).ok());
    OpenOptions oo;
    oo.locks = TempLocks();
    auto v = Volume::Open(&dev, oo);
    REQUIRE(v.ok());
    vol = std::move(v.value());
  }
  const Uuid& uuid() const { return vol->superblock().uuid; }
  MemDevice dev;
  std::unique_ptr<Volume> vol;
};

std::unique_ptr<File> CreateOpen(Volume* vol, const std::string& name) {
  auto c = vol->Create(name, 0, FileKind::kIndexShard);
  REQUIRE(c.ok());
  auto f = vol->OpenFile(name);
  REQUIRE(f.ok());
  return std::move(f.value());
}

FpKey KeyIn(const ShardRange& r, HashAlgo algo, std::mt19937_64& rng) {
  FpKey k{};
  const size_t size = HashAlgoSize(algo);
  for (size_t i = 0; i < size; i++) k[i] = static_cast<uint8_t>(rng());
  uint64_t prefix = rng();
  if (r.depth > 0) prefix = r.lo | (prefix & ((~0ull) >> r.depth));
  for (int i = 0; i < 8; i++) k[size_t(i)] = static_cast<uint8_t>(prefix >> (56 - 8 * i));
  return k;
}

const FileId kFiles[3] = {{17, 1}, {23, 4}, {99, 2}};

// `n` sorted distinct entries: every fourth one Shared, the others Unique
// over the three files.
std::vector<IndexEntry> SampleEntries(HashAlgo algo, const ShardRange& r, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::set<FpKey> keys;
  while (keys.size() < n) keys.insert(KeyIn(r, algo, rng));
  std::vector<IndexEntry> out;
  size_t i = 0;
  for (const FpKey& k : keys) {
    IndexEntry e;
    e.fp = k;
    if (i % 4 == 3) {
      e.kind = EntryKind::kShared;
      e.arena = i * 3 + 1;
    } else {
      e.kind = EntryKind::kUnique;
      e.file = kFiles[i % 3];
      e.block = i * 7 + 5;
    }
    out.push_back(e);
    i++;
  }
  return out;
}

bool SameEntry(const IndexEntry& a, const IndexEntry& b) {
  if (a.fp != b.fp || a.kind != b.kind) return false;
  if (a.kind == EntryKind::kShared) return a.arena == b.arena;
  return a.file == b.file && a.block == b.block;
}

ShardHeader Proto(HashAlgo algo, const ShardRange& r, uint64_t version) {
  ShardHeader h;
  h.range = r;
  h.algo = algo;
  h.version = version;
  h.created_ns = 1'700'000'000'000'000'000ull;
  h.host_id = 1;
  // Garbage the writer must overwrite.
  h.entry_count = 777;
  h.file_count = 5;
  return h;
}

Status WriteShard(Volume* vol, File* f, const ShardHeader& proto,
                  const std::vector<IndexEntry>& entries, uint64_t arena_next = 42424,
                  uint64_t update_ns = 31337) {
  ShardWriter w(vol, f, proto);
  for (const IndexEntry& e : entries) RETURN_IF_ERROR(w.Add(e));
  RETURN_IF_ERROR(w.Finish(arena_next, update_ns));
  if (w.entries() != entries.size()) return Status::Invalid("writer entry count");
  return Status::Ok();
}

struct ReadBack {
  std::vector<IndexEntry> entries;
  ShardScanStats stats;
};

ReadBack ReadAll(File* f, const Uuid& uuid, const std::string& what) {
  auto r = ShardReader::Open(f, uuid, what);
  REQUIRE(r.ok());
  ReadBack out;
  IndexEntry e;
  while (true) {
    auto more = (*r)->Next(&e);
    REQUIRE(more.ok());
    if (!*more) break;
    out.entries.push_back(e);
  }
  // The end is sticky.
  auto again = (*r)->Next(&e);
  REQUIRE(again.ok());
  CHECK_FALSE(*again);
  out.stats = (*r)->stats();
  return out;
}

bool SameEntries(const std::vector<IndexEntry>& a, const std::vector<IndexEntry>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); i++) {
    if (!SameEntry(a[i], b[i])) return false;
  }
  return true;
}

void WriteGarbage(File* f, uint64_t block, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> junk(kB);
  for (auto& c : junk) c = static_cast<uint8_t>(rng());
  REQUIRE(f->Write(block * kB, junk.data(), junk.size()).ok());
}

bool Contains(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}

}  // namespace

TEST_CASE("shardio: a written shard reads back entry for entry", "[index]") {
  struct Case {
    HashAlgo algo;
    ShardRange range;
    size_t n;
  };
  const Case cases[] = {
      {HashAlgo::kXxh128, ShardRange{0, 0}, 5000},
      {HashAlgo::kSha256, ShardRange{9, 0xa580000000000000ull}, 3000},
      {HashAlgo::kXxh128, ShardRange{40, 0x1234567890000000ull}, 700},
      {HashAlgo::kXxh128, ShardRange{0, 0}, 1},
  };
  for (const Case& c : cases) {
    CAPTURE(HashAlgoName(c.algo), c.range.ToString(), c.n);
    MemVolume mv(c.algo);
    Volume* vol = mv.vol.get();
    const std::string name = ShardFileName(c.range, 7);
    auto f = CreateOpen(vol, name);
    const auto entries = SampleEntries(c.algo, c.range, c.n, c.n);
    REQUIRE(WriteShard(vol, f.get(), Proto(c.algo, c.range, 7), entries).ok());

    const uint64_t per = EntriesPerBlock(EntrySize(c.algo, c.range));
    const uint64_t eblocks = (c.n + per - 1) / per;
    const uint64_t fblocks = 1;
    CHECK(f->size() == (1 + eblocks + fblocks) * kB);

    auto r = ShardReader::Open(f.get(), mv.uuid(), name);
    REQUIRE(r.ok());
    const ShardHeader& h = (*r)->header();
    CHECK(h.range == c.range);
    CHECK(h.version == 7);
    CHECK(h.algo == c.algo);
    CHECK(h.entry_size == EntrySize(c.algo, c.range));
    CHECK(h.entry_count == c.n);
    CHECK(h.entry_blocks == eblocks);
    uint64_t unique = 0, shared = 0;
    std::vector<FileId> first_use;
    for (const IndexEntry& e : entries) {
      if (e.kind == EntryKind::kShared) {
        shared++;
      } else {
        unique++;
        if (std::find(first_use.begin(), first_use.end(), e.file) == first_use.end()) {
          first_use.push_back(e.file);
        }
      }
    }
    CHECK(h.unique_count == unique);
    CHECK(h.shared_count == shared);
    CHECK(h.file_count == first_use.size());
    CHECK(h.file_count <= 3);
    CHECK(h.file_blocks == fblocks);
    CHECK(h.arena_next == 42424);
    CHECK(h.update_ns == 31337);
    CHECK(h.created_ns == 1'700'000'000'000'000'000ull);
    CHECK(h.host_id == 1);
    CHECK((*r)->file_table() == first_use);

    const ReadBack rb = ReadAll(f.get(), mv.uuid(), name);
    CHECK(SameEntries(rb.entries, entries));
    CHECK(rb.stats.entries == c.n);
    CHECK(rb.stats.corrupt_blocks == 0);
    CHECK(rb.stats.lost_entries == 0);
    CHECK_FALSE(rb.stats.file_table_corrupt);
    CHECK(rb.stats.unresolved_entries == 0);
  }
}

TEST_CASE("shardio: an empty shard and a shared-only shard", "[index]") {
  MemVolume mv;
  Volume* vol = mv.vol.get();
  const ShardRange all{0, 0};
  {
    auto f = CreateOpen(vol, ShardFileName(all, 1));
    REQUIRE(WriteShard(vol, f.get(), Proto(HashAlgo::kXxh128, all, 1), {}, 0, 0).ok());
    CHECK(f->size() == kB);
    const ReadBack rb = ReadAll(f.get(), mv.uuid(), "empty");
    CHECK(rb.entries.empty());
    auto r = ShardReader::Open(f.get(), mv.uuid(), "empty");
    REQUIRE(r.ok());
    CHECK((*r)->header().entry_count == 0);
    CHECK((*r)->header().entry_blocks == 0);
    CHECK((*r)->header().file_blocks == 0);
  }
  {
    auto entries = SampleEntries(HashAlgo::kXxh128, all, 400, 3);
    std::vector<IndexEntry> shared;
    for (const IndexEntry& e : entries) {
      if (e.kind == EntryKind::kShared) shared.push_back(e);
    }
    auto f = CreateOpen(vol, ShardFileName(all, 2));
    REQUIRE(WriteShard(vol, f.get(), Proto(HashAlgo::kXxh128, all, 2), shared).ok());
    auto r = ShardReader::Open(f.get(), mv.uuid(), "shared");
    REQUIRE(r.ok());
    CHECK((*r)->header().file_count == 0);
    CHECK((*r)->header().file_blocks == 0);
    CHECK((*r)->header().shared_count == shared.size());
    const ReadBack rb = ReadAll(f.get(), mv.uuid(), "shared");
    CHECK(SameEntries(rb.entries, shared));
  }
}

TEST_CASE("shardio: a corrupt entry block is skipped and counted", "[index]") {
  MemVolume mv;
  Volume* vol = mv.vol.get();
  const ShardRange all{0, 0};
  const std::string name = ShardFileName(all, 3);
  auto f = CreateOpen(vol, name);
  const auto entries = SampleEntries(HashAlgo::kXxh128, all, 5000, 11);
  REQUIRE(WriteShard(vol, f.get(), Proto(HashAlgo::kXxh128, all, 3), entries).ok());
  const uint64_t per = EntriesPerBlock(EntrySize(HashAlgo::kXxh128, all));
  REQUIRE(per == 177);
  const uint64_t eblocks = (5000 + per - 1) / per;  // 29

  for (uint64_t k : {uint64_t(1), uint64_t(5), eblocks}) {
    CAPTURE(k);
    // Keep the good block to restore it afterwards.
    std::vector<uint8_t> saved(kB);
    REQUIRE(f->Read(k * kB, saved.data(), kB).ok());
    WriteGarbage(f.get(), k, k);
    const ReadBack rb = ReadAll(f.get(), mv.uuid(), name);
    std::vector<IndexEntry> want;
    for (size_t i = 0; i < entries.size(); i++) {
      if (i / per != k - 1) want.push_back(entries[i]);
    }
    CHECK(rb.stats.corrupt_blocks == 1);
    CHECK(rb.stats.lost_entries == per);
    CHECK(rb.entries.size() == want.size());
    CHECK(SameEntries(rb.entries, want));
    CHECK(rb.stats.entries == want.size());
    REQUIRE(f->Write(k * kB, saved.data(), kB).ok());
  }
  // Two corrupt blocks, one a valid block of another position (blocks
  // 2 and 3 swapped: both fail their crc).
  std::vector<uint8_t> b2(kB), b3(kB);
  REQUIRE(f->Read(2 * kB, b2.data(), kB).ok());
  REQUIRE(f->Read(3 * kB, b3.data(), kB).ok());
  REQUIRE(f->Write(2 * kB, b3.data(), kB).ok());
  REQUIRE(f->Write(3 * kB, b2.data(), kB).ok());
  const ReadBack rb = ReadAll(f.get(), mv.uuid(), name);
  CHECK(rb.stats.corrupt_blocks == 2);
  CHECK(rb.entries.size() == 5000 - 2 * per);
}

TEST_CASE("shardio: a shard bigger than one read chunk", "[index]") {
  MemVolume mv;
  Volume* vol = mv.vol.get();
  const ShardRange r{1, 1ull << 63};
  const std::string name = ShardFileName(r, 1);
  auto f = CreateOpen(vol, name);
  const size_t n = 60000;  // 339 entry blocks: two 256-block chunks
  const auto entries = SampleEntries(HashAlgo::kXxh128, r, n, 5);
  // Before Finish the header is not there: the version is incomplete.
  {
    ShardWriter w(vol, f.get(), Proto(HashAlgo::kXxh128, r, 1));
    for (const IndexEntry& e : entries) REQUIRE(w.Add(e).ok());
    CHECK(w.bytes_written() >= 256 * kB);  // a chunk went out already
    auto early = ShardReader::Open(f.get(), mv.uuid(), name);
    REQUIRE_FALSE(early.ok());
    CHECK(early.status().code() == Status::Code::kCorruption);
    REQUIRE(w.Finish(3 * n + 1, 2).ok());  // above every sample arena index
    CHECK(w.entries() == n);
  }
  const uint64_t per = 177;
  ReadBack rb = ReadAll(f.get(), mv.uuid(), name);
  CHECK(SameEntries(rb.entries, entries));
  // The last block of the first chunk and the first of the second.
  WriteGarbage(f.get(), 256, 1);
  WriteGarbage(f.get(), 257, 2);
  rb = ReadAll(f.get(), mv.uuid(), name);
  CHECK(rb.stats.corrupt_blocks == 2);
  std::vector<IndexEntry> want;
  for (size_t i = 0; i < n; i++) {
    if (i / per != 255 && i / per != 256) want.push_back(entries[i]);
  }
  CHECK(SameEntries(rb.entries, want));
}

TEST_CASE("shardio: a corrupt header fails the open and names the shard", "[index]") {
  MemVolume mv;
  Volume* vol = mv.vol.get();
  const ShardRange all{0, 0};
  const std::string name = ShardFileName(all, 4);
  auto f = CreateOpen(vol, name);
  REQUIRE(WriteShard(vol, f.get(), Proto(HashAlgo::kXxh128, all, 4),
                     SampleEntries(HashAlgo::kXxh128, all, 1000, 4))
              .ok());
  REQUIRE(ShardReader::Open(f.get(), mv.uuid(), name).ok());
  SECTION("garbage header") {
    WriteGarbage(f.get(), 0, 9);
  }
  SECTION("one byte changed") {
    uint8_t c = 0;
    REQUIRE(f->Read(100, &c, 1).ok());
    c ^= 0x20;
    REQUIRE(f->Write(100, &c, 1).ok());
  }
  SECTION("header zeroed") {
    std::vector<uint8_t> z(kB, 0);
    REQUIRE(f->Write(0, z.data(), kB).ok());
  }
  auto r = ShardReader::Open(f.get(), mv.uuid(), name);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == Status::Code::kCorruption);
  CHECK(Contains(r.status().message(), name));
}

TEST_CASE("shardio: a shard of another volume or file does not open", "[index]") {
  MemVolume mv;
  Volume* vol = mv.vol.get();
  const ShardRange all{0, 0};
  const std::string name = ShardFileName(all, 4);
  auto f = CreateOpen(vol, name);
  REQUIRE(WriteShard(vol, f.get(), Proto(HashAlgo::kXxh128, all, 4),
                     SampleEntries(HashAlgo::kXxh128, all, 500, 4))
              .ok());
  Uuid other = mv.uuid();
  other[15] ^= 1;
  auto r = ShardReader::Open(f.get(), other, name);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == Status::Code::kCorruption);
  // The same bytes copied into another file (another FileId).
  const std::string copy_name = ShardFileName(all, 5);
  auto copy = CreateOpen(vol, copy_name);
  std::vector<uint8_t> bytes(f->size());
  REQUIRE(f->Read(0, bytes.data(), bytes.size()).ok());
  REQUIRE(copy->Truncate(bytes.size()).ok());
  REQUIRE(copy->Write(0, bytes.data(), bytes.size()).ok());
  auto rc = ShardReader::Open(copy.get(), mv.uuid(), copy_name);
  REQUIRE_FALSE(rc.ok());
  CHECK(rc.status().code() == Status::Code::kCorruption);
}

TEST_CASE("shardio: a truncated shard fails the open", "[index]") {
  MemVolume mv;
  Volume* vol = mv.vol.get();
  const ShardRange all{0, 0};
  const std::string name = ShardFileName(all, 6);
  auto f = CreateOpen(vol, name);
  REQUIRE(WriteShard(vol, f.get(), Proto(HashAlgo::kXxh128, all, 6),
                     SampleEntries(HashAlgo::kXxh128, all, 2000, 6))
              .ok());
  const uint64_t full = f->size();
  REQUIRE(full == (1 + 12 + 1) * kB);
  uint64_t to = 0;
  SECTION("file table cut off") {
    to = full - kB;
  }
  SECTION("cut inside the file table") {
    to = full - 1;
  }
  SECTION("entry blocks cut off") {
    to = 5 * kB;
  }
  SECTION("header only") {
    to = kB;
  }
  SECTION("cut inside the header") {
    to = 100;
  }
  SECTION("empty") {
    to = 0;
  }
  CAPTURE(to);
  REQUIRE(f->Truncate(to).ok());
  auto r = ShardReader::Open(f.get(), mv.uuid(), name);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == Status::Code::kCorruption);
  CHECK(Contains(r.status().message(), name));
}

TEST_CASE("shardio: a corrupt file table drops only the unique entries", "[index]") {
  MemVolume mv;
  Volume* vol = mv.vol.get();
  const ShardRange all{0, 0};
  const std::string name = ShardFileName(all, 8);
  auto f = CreateOpen(vol, name);
  const auto entries = SampleEntries(HashAlgo::kXxh128, all, 5000, 8);
  REQUIRE(WriteShard(vol, f.get(), Proto(HashAlgo::kXxh128, all, 8), entries).ok());
  const uint64_t ft_block = 1 + (5000 + 176) / 177;
  REQUIRE(f->size() == (ft_block + 1) * kB);
  WriteGarbage(f.get(), ft_block, 3);

  auto r = ShardReader::Open(f.get(), mv.uuid(), name);
  REQUIRE(r.ok());
  CHECK((*r)->stats().file_table_corrupt);
  CHECK((*r)->file_table().empty());
  const ReadBack rb = ReadAll(f.get(), mv.uuid(), name);
  std::vector<IndexEntry> shared;
  uint64_t unique = 0;
  for (const IndexEntry& e : entries) {
    if (e.kind == EntryKind::kShared) {
      shared.push_back(e);
    } else {
      unique++;
    }
  }
  REQUIRE(unique > 0);
  REQUIRE_FALSE(shared.empty());
  CHECK(rb.stats.file_table_corrupt);
  CHECK(rb.stats.unresolved_entries == unique);
  CHECK(rb.stats.corrupt_blocks == 0);
  CHECK(SameEntries(rb.entries, shared));
  CHECK(rb.stats.entries == shared.size());
}

TEST_CASE("shardio: entries out of order or out of range inside a valid block are skipped",
          "[index]") {
  MemVolume mv;
  Volume* vol = mv.vol.get();
  const ShardRange r{2, 1ull << 62};
  const std::string name = ShardFileName(r, 1);
  auto f = CreateOpen(vol, name);
  const auto entries = SampleEntries(HashAlgo::kXxh128, r, 177 * 2, 21);
  REQUIRE(WriteShard(vol, f.get(), Proto(HashAlgo::kXxh128, r, 1), entries).ok());
  auto opened = ShardReader::Open(f.get(), mv.uuid(), name);
  REQUIRE(opened.ok());
  const ShardHeader h = (*opened)->header();
  // Re-encode block 2 (a valid crc) with its first entry swapped behind
  // the second one: the second entry is then below the first's key.
  std::vector<EncodedEntry> blk2;
  for (size_t i = 177; i < 354; i++) {
    EncodedEntry ee;
    ee.e = entries[i];
    ee.file_ref = 0;
    if (ee.e.kind == EntryKind::kUnique) {
      ee.file_ref = uint32_t(
          std::find((*opened)->file_table().begin(), (*opened)->file_table().end(), ee.e.file) -
          (*opened)->file_table().begin());
    }
    blk2.push_back(ee);
  }
  // Entry 0 of block 2 gets a key equal to the previous block's last
  // (not ascending): skipped.
  blk2[0].e.fp = entries[176].fp;
  std::vector<uint8_t> enc(kB);
  EncodeEntryBlock(blk2.data(), blk2.size(), h, mv.uuid(), f->id(), 2, enc.data());
  REQUIRE(f->Write(2 * kB, enc.data(), kB).ok());
  ReadBack rb = ReadAll(f.get(), mv.uuid(), name);
  CHECK(rb.stats.corrupt_blocks == 0);
  CHECK(rb.stats.lost_entries == 1);
  std::vector<IndexEntry> want = entries;
  want.erase(want.begin() + 177);
  CHECK(SameEntries(rb.entries, want));
  // A file_ref beyond the file table: unresolved, skipped.
  blk2[0].e = entries[177];
  blk2[0].e.kind = EntryKind::kUnique;
  blk2[0].file_ref = 3;
  EncodeEntryBlock(blk2.data(), blk2.size(), h, mv.uuid(), f->id(), 2, enc.data());
  REQUIRE(f->Write(2 * kB, enc.data(), kB).ok());
  rb = ReadAll(f.get(), mv.uuid(), name);
  CHECK(rb.stats.unresolved_entries == 1);
  CHECK(SameEntries(rb.entries, want));
}

// The reader decodes keys with fixed-size copies around the elided bytes
// and compares the 64-bit prefix before the rest of the key: every elided
// width (depth 0..40, both hashes), keys that share their 64-bit prefix,
// and a key whose prefix equals its predecessor's but whose tail is lower.
TEST_CASE("shardio: keys of every elided width and keys sharing a 64-bit prefix", "[index]") {
  for (HashAlgo algo : {HashAlgo::kXxh128, HashAlgo::kSha256}) {
    for (uint32_t depth : {0u, 7u, 8u, 16u, 24u, 31u, 32u, 40u}) {
      const ShardRange r{depth, depth == 0 ? 0 : (0x5a5a5a5a5a5a5a5aull & ~((~0ull) >> depth))};
      CAPTURE(HashAlgoName(algo), r.ToString());
      MemVolume mv(algo);
      Volume* vol = mv.vol.get();
      const std::string name = ShardFileName(r, 2);
      auto f = CreateOpen(vol, name);
      // Runs of three keys with one prefix, told apart by their last byte
      // only.
      std::vector<IndexEntry> entries = SampleEntries(algo, r, 600, depth + 1);
      const size_t fp = HashAlgoSize(algo);
      for (size_t i = 0; i + 2 < entries.size(); i += 3) {
        entries[i + 1].fp = entries[i].fp;
        entries[i + 2].fp = entries[i].fp;
        entries[i].fp[fp - 1] = 0x00;
        entries[i + 1].fp[fp - 1] = 0x01;
        entries[i + 2].fp[fp - 1] = 0xff;
      }
      // (Two runs could share a prefix: keep the keys sorted and distinct.)
      std::sort(entries.begin(), entries.end(),
                [](const IndexEntry& a, const IndexEntry& b) { return a.fp < b.fp; });
      entries.erase(std::unique(entries.begin(), entries.end(),
                                [](const IndexEntry& a, const IndexEntry& b) { return a.fp == b.fp; }),
                    entries.end());
      REQUIRE(WriteShard(vol, f.get(), Proto(algo, r, 2), entries).ok());
      ReadBack rb = ReadAll(f.get(), mv.uuid(), name);
      CHECK(rb.stats.lost_entries == 0);
      CHECK(SameEntries(rb.entries, entries));
      for (const IndexEntry& e : rb.entries) {
        // Bytes past the digest are zero, as KeyOf makes them.
        for (size_t i = fp; i < e.fp.size(); i++) REQUIRE(e.fp[i] == 0);
      }

      // Block 1 re-encoded (valid crc) with entry 1 lower than entry 0 in
      // the last byte only: entry 1 is skipped, entry 2 (above entry 0)
      // is kept.
      auto opened = ShardReader::Open(f.get(), mv.uuid(), name);
      REQUIRE(opened.ok());
      const ShardHeader h = (*opened)->header();
      const uint64_t per = EntriesPerBlock(h.entry_size);
      std::vector<EncodedEntry> blk;
      for (size_t i = 0; i < per && i < entries.size(); i++) {
        EncodedEntry ee;
        ee.e = entries[i];
        if (ee.e.kind == EntryKind::kUnique) {
          const auto& ft = (*opened)->file_table();
          ee.file_ref = uint32_t(std::find(ft.begin(), ft.end(), ee.e.file) - ft.begin());
        }
        blk.push_back(ee);
      }
      blk[0].e.fp[fp - 1] = 0x80;  // entry 1 (0x01) is now below it
      std::vector<uint8_t> enc(kB);
      EncodeEntryBlock(blk.data(), blk.size(), h, mv.uuid(), f->id(), 1, enc.data());
      REQUIRE(f->Write(1 * kB, enc.data(), kB).ok());
      rb = ReadAll(f.get(), mv.uuid(), name);
      CHECK(rb.stats.corrupt_blocks == 0);
      CHECK(rb.stats.lost_entries == 1);
      std::vector<IndexEntry> want = entries;
      want[0].fp[fp - 1] = 0x80;
      want.erase(want.begin() + 1);
      CHECK(SameEntries(rb.entries, want));
    }
  }
}

TEST_CASE("shardio: the writer refuses entries out of order or outside its range", "[index]") {
  MemVolume mv;
  Volume* vol = mv.vol.get();
  const ShardRange r{1, 0};
  const auto entries = SampleEntries(HashAlgo::kXxh128, r, 10, 1);
  SECTION("descending") {
    auto f = CreateOpen(vol, ShardFileName(r, 1));
    ShardWriter w(vol, f.get(), Proto(HashAlgo::kXxh128, r, 1));
    REQUIRE(w.Add(entries[5]).ok());
    Status s = w.Add(entries[4]);
    CHECK(s.code() == Status::Code::kInvalid);
    // Sticky: the writer stays failed, nothing is finished.
    CHECK(w.Add(entries[6]).code() == Status::Code::kInvalid);
    CHECK(w.Finish(0, 0).code() == Status::Code::kInvalid);
    CHECK_FALSE(ShardReader::Open(f.get(), mv.uuid(), "s").ok());
  }
  SECTION("duplicate key") {
    auto f = CreateOpen(vol, ShardFileName(r, 2));
    ShardWriter w(vol, f.get(), Proto(HashAlgo::kXxh128, r, 2));
    REQUIRE(w.Add(entries[0]).ok());
    IndexEntry dup = entries[0];
    dup.kind = EntryKind::kShared;
    CHECK(w.Add(dup).code() == Status::Code::kInvalid);
  }
  SECTION("outside the range") {
    auto f = CreateOpen(vol, ShardFileName(r, 3));
    ShardWriter w(vol, f.get(), Proto(HashAlgo::kXxh128, r, 3));
    IndexEntry out = entries[9];
    out.fp[0] = 0x80;  // upper half
    CHECK(w.Add(out).code() == Status::Code::kInvalid);
  }
  SECTION("fields too large for the encoding") {
    auto f = CreateOpen(vol, ShardFileName(r, 4));
    ShardWriter w(vol, f.get(), Proto(HashAlgo::kXxh128, r, 4));
    IndexEntry big = entries[0];
    big.kind = EntryKind::kUnique;
    big.block = kMaxEntryBlock + 1;
    CHECK(w.Add(big).code() == Status::Code::kInvalid);
    IndexEntry arena = entries[1];
    arena.kind = EntryKind::kShared;
    arena.arena = kMaxArenaIndex + 1;
    CHECK(w.Add(arena).code() == Status::Code::kInvalid);
    // Refused entries are not counted; the limits themselves are fine.
    big.block = kMaxEntryBlock;
    arena.arena = kMaxArenaIndex;
    REQUIRE(w.Add(big).ok());
    REQUIRE(w.Add(arena).ok());
    REQUIRE(w.Finish(kMaxArenaIndex + 1, 0).ok());  // arena indexes are below it
    CHECK(w.entries() == 2);
    const ReadBack rb = ReadAll(f.get(), mv.uuid(), "s");
    REQUIRE(rb.entries.size() == 2);
    CHECK(rb.entries[0].block == kMaxEntryBlock);
    CHECK(rb.entries[1].arena == kMaxArenaIndex);
  }
}

// ---------------------------------------------------------------- pending

namespace {

std::vector<PendingRecord> Records(HashAlgo algo, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<PendingRecord> out;
  for (size_t i = 0; i < n; i++) {
    PendingRecord r;
    r.fp = KeyIn(ShardRange{0, 0}, algo, rng);
    r.file = kFiles[i % 3];
    r.block = rng() % 100000;
    out.push_back(r);
  }
  return out;
}

bool SameRecords(const std::vector<PendingRecord>& a, const std::vector<PendingRecord>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); i++) {
    if (!(a[i].fp == b[i].fp && a[i].file == b[i].file && a[i].block == b[i].block)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("shardio: pending frames append and read back in order", "[index]") {
  for (HashAlgo algo : {HashAlgo::kXxh128, HashAlgo::kSha256}) {
    CAPTURE(HashAlgoName(algo));
    MemVolume mv(algo);
    Volume* vol = mv.vol.get();
    const ShardRange r{3, 0x6000000000000000ull};
    auto f = CreateOpen(vol, PendingFileName(r));
    const uint32_t per = PendingRecordsPerBlock(algo);
    const std::vector<size_t> sizes = {1, per, per + 1, 40, 3 * per + 2};
    std::vector<PendingRecord> all;
    uint64_t expect_blocks = 0;
    for (size_t i = 0; i < sizes.size(); i++) {
      const auto recs = Records(algo, sizes[i], i);
      REQUIRE(AppendPendingFrame(f.get(), recs, algo, mv.uuid()).ok());
      all.insert(all.end(), recs.begin(), recs.end());
      expect_blocks += 1 + (sizes[i] + per - 1) / per;
      CHECK(f->size() == expect_blocks * kB);
      auto count = CountPendingRecords(f.get(), algo, mv.uuid());
      REQUIRE(count.ok());
      CHECK(*count == all.size());
    }
    // Nothing to append: nothing written.
    REQUIRE(AppendPendingFrame(f.get(), {}, algo, mv.uuid()).ok());
    CHECK(f->size() == expect_blocks * kB);

    PendingScanStats st;
    auto got = ReadPendingFile(f.get(), algo, mv.uuid(), &st, "pending");
    REQUIRE(got.ok());
    CHECK(SameRecords(*got, all));
    CHECK(st.frames == sizes.size());
    CHECK(st.records == all.size());
    CHECK(st.corrupt_frames == 0);
    CHECK(st.skipped_bytes == 0);
  }
}

TEST_CASE("shardio: an empty pending file has no records", "[index]") {
  MemVolume mv;
  auto f = CreateOpen(mv.vol.get(), PendingFileName(ShardRange{0, 0}));
  PendingScanStats st;
  auto got = ReadPendingFile(f.get(), HashAlgo::kXxh128, mv.uuid(), &st, "p");
  REQUIRE(got.ok());
  CHECK(got->empty());
  CHECK(st.frames == 0);
  CHECK(st.corrupt_frames == 0);
  auto count = CountPendingRecords(f.get(), HashAlgo::kXxh128, mv.uuid());
  REQUIRE(count.ok());
  CHECK(*count == 0);
}

// ReadPendingFile allocated the file's whole size before reading a byte: a
// pending file whose inode said 1 TiB (a damaged or foreign inode; the
// rest a hole) threw bad_alloc, which ended dedupd. It now reads frame by
// frame and stops at the hole.
TEST_CASE("shardio: a pending file with a huge size reads only its frames", "[index]") {
  MemVolume mv;
  const HashAlgo algo = HashAlgo::kXxh128;
  auto f = CreateOpen(mv.vol.get(), PendingFileName(ShardRange{0, 0}));
  const auto recs = Records(algo, 40, 5);
  REQUIRE(AppendPendingFrame(f.get(), recs, algo, mv.uuid()).ok());
  const uint64_t frame_bytes = f->size();
  REQUIRE(f->Truncate(uint64_t{1} << 40).ok());
  PendingScanStats st;
  auto got = ReadPendingFile(f.get(), algo, mv.uuid(), &st, "p");
  REQUIRE(got.ok());
  CHECK(SameRecords(*got, recs));
  CHECK(st.frames == 1);
  CHECK(st.corrupt_frames == 1);
  CHECK(st.skipped_bytes == (uint64_t{1} << 40) - frame_bytes);
}

TEST_CASE("shardio: a corrupt pending frame ends the scan", "[index]") {
  MemVolume mv;
  Volume* vol = mv.vol.get();
  const HashAlgo algo = HashAlgo::kXxh128;
  const uint32_t per = PendingRecordsPerBlock(algo);
  auto f = CreateOpen(vol, PendingFileName(ShardRange{0, 0}));
  const auto first = Records(algo, per + 5, 1);  // 3 blocks
  const auto second = Records(algo, 30, 2);      // 2 blocks
  const auto third = Records(algo, 7, 3);        // 2 blocks
  REQUIRE(AppendPendingFrame(f.get(), first, algo, mv.uuid()).ok());
  REQUIRE(AppendPendingFrame(f.get(), second, algo, mv.uuid()).ok());
  REQUIRE(AppendPendingFrame(f.get(), third, algo, mv.uuid()).ok());
  REQUIRE(f->size() == 7 * kB);

  SECTION("second frame's header") {
    WriteGarbage(f.get(), 3, 1);
    PendingScanStats st;
    auto got = ReadPendingFile(f.get(), algo, mv.uuid(), &st, "p");
    REQUIRE(got.ok());
    CHECK(SameRecords(*got, first));
    CHECK(st.frames == 1);
    CHECK(st.records == first.size());
    CHECK(st.corrupt_frames == 1);
    CHECK(st.skipped_bytes == 4 * kB);
    auto count = CountPendingRecords(f.get(), algo, mv.uuid());
    REQUIRE(count.ok());
    CHECK(*count == first.size());
  }
  SECTION("second frame's records") {
    uint8_t c = 0;
    REQUIRE(f->Read(4 * kB + 10, &c, 1).ok());
    c ^= 1;
    REQUIRE(f->Write(4 * kB + 10, &c, 1).ok());
    PendingScanStats st;
    auto got = ReadPendingFile(f.get(), algo, mv.uuid(), &st, "p");
    REQUIRE(got.ok());
    CHECK(SameRecords(*got, first));
    CHECK(st.corrupt_frames == 1);
    CHECK(st.skipped_bytes == 4 * kB);
    // CountPendingRecords reads headers only (documented): it still counts
    // the damaged frame's records, so it is an upper bound here.
    auto count = CountPendingRecords(f.get(), algo, mv.uuid());
    REQUIRE(count.ok());
    CHECK(*count == first.size() + second.size() + third.size());
  }
  SECTION("first frame's header: nothing") {
    WriteGarbage(f.get(), 0, 4);
    PendingScanStats st;
    auto got = ReadPendingFile(f.get(), algo, mv.uuid(), &st, "p");
    REQUIRE(got.ok());
    CHECK(got->empty());
    CHECK(st.corrupt_frames == 1);
    CHECK(st.skipped_bytes == 7 * kB);
    auto count = CountPendingRecords(f.get(), algo, mv.uuid());
    REQUIRE(count.ok());
    CHECK(*count == 0);
  }
  SECTION("torn tail: the last frame cut short") {
    REQUIRE(f->Truncate(6 * kB).ok());
    PendingScanStats st;
    auto got = ReadPendingFile(f.get(), algo, mv.uuid(), &st, "p");
    REQUIRE(got.ok());
    std::vector<PendingRecord> want = first;
    want.insert(want.end(), second.begin(), second.end());
    CHECK(SameRecords(*got, want));
    CHECK(st.frames == 2);
    CHECK(st.corrupt_frames == 1);
    CHECK(st.skipped_bytes == kB);
  }
  SECTION("read with the other hash algorithm") {
    PendingScanStats st;
    auto got = ReadPendingFile(f.get(), HashAlgo::kSha256, mv.uuid(), &st, "p");
    REQUIRE(got.ok());
    CHECK(got->empty());
    CHECK(st.corrupt_frames == 1);
  }
}

TEST_CASE("shardio: pending frame counts out of range stop the count", "[index]") {
  MemVolume mv;
  Volume* vol = mv.vol.get();
  const HashAlgo algo = HashAlgo::kXxh128;
  auto f = CreateOpen(vol, PendingFileName(ShardRange{0, 0}));
  const auto recs = Records(algo, 10, 1);
  REQUIRE(AppendPendingFrame(f.get(), recs, algo, mv.uuid()).ok());
  REQUIRE(AppendPendingFrame(f.get(), recs, algo, mv.uuid()).ok());
  // The second frame's header (block 2) claims 2^64-1 records behind a
  // valid crc: both readers must stop there, not wrap around.
  std::vector<uint8_t> hb(kB);
  REQUIRE(f->Read(2 * kB, hb.data(), kB).ok());
  EncodeU64(hb.data() + 16, ~0ull);
  EncodeU32(hb.data() + 8, FileBlockCrc(hb.data(), 8, mv.uuid(), f->id(), 2));
  REQUIRE(f->Write(2 * kB, hb.data(), kB).ok());
  PendingScanStats st;
  auto got = ReadPendingFile(f.get(), algo, mv.uuid(), &st, "p");
  REQUIRE(got.ok());
  CHECK(got->size() == 10);
  CHECK(st.corrupt_frames == 1);
  auto count = CountPendingRecords(f.get(), algo, mv.uuid());
  REQUIRE(count.ok());
  CHECK(*count == 10);
}

TEST_CASE("shardio: a shared entry naming an arena block at or past arena_next is skipped",
          "[index]") {
  // Arena indexes are handed out below the header's arena_next, so an entry
  // naming one at or past it is damage (fsck counts it so): the reader
  // drops it as lost, and a pass then sweeps the arena rather than keep a
  // name for a block it may hand to another fingerprint.
  MemVolume mv;
  Volume* vol = mv.vol.get();
  const ShardRange r{0, 0};
  const std::string name = ShardFileName(r, 1);
  auto f = CreateOpen(vol, name);
  const auto entries = SampleEntries(HashAlgo::kXxh128, r, 600, 33);
  uint64_t max_arena = 0;
  for (const IndexEntry& e : entries) {
    if (e.kind == EntryKind::kShared) max_arena = std::max(max_arena, e.arena);
  }
  REQUIRE(max_arena > 1);
  const uint64_t arena_next = max_arena / 2;
  std::vector<IndexEntry> want;
  for (const IndexEntry& e : entries) {
    if (e.kind == EntryKind::kUnique || e.arena < arena_next) want.push_back(e);
  }
  REQUIRE(want.size() < entries.size());
  REQUIRE(WriteShard(vol, f.get(), Proto(HashAlgo::kXxh128, r, 1), entries, arena_next).ok());
  ReadBack rb = ReadAll(f.get(), mv.uuid(), name);
  CHECK(rb.stats.corrupt_blocks == 0);
  CHECK(rb.stats.lost_entries == entries.size() - want.size());
  CHECK(SameEntries(rb.entries, want));
}
