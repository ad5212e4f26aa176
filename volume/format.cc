#include "volume/format.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "util/coding.h"
#include "util/crc32c.h"

namespace dede {

std::string UuidToString(const Uuid& u) {
  char buf[37];
  std::snprintf(buf, sizeof buf,
                "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
                u[15]);
  return buf;
}

Uuid NewRandomUuid() {
  Uuid u{};
  std::random_device rd;
  for (auto& b : u) b = static_cast<uint8_t>(rd());
  u[6] = static_cast<uint8_t>((u[6] & 0x0f) | 0x40);  // version 4
  u[8] = static_cast<uint8_t>((u[8] & 0x3f) | 0x80);  // RFC 4122 variant
  return u;
}

uint32_t BlockCrc(const uint8_t* blk, const Uuid& uuid, uint64_t addr) {
  uint8_t prefix[24];
  std::memcpy(prefix, uuid.data(), 16);
  EncodeU64(prefix + 16, addr);
  uint32_t crc = Crc32cExtend(0, prefix, sizeof prefix);
  crc = Crc32cExtend(crc, blk, 8);
  static const uint8_t kZero[4] = {0, 0, 0, 0};
  crc = Crc32cExtend(crc, kZero, 4);
  return Crc32cExtend(crc, blk + 12, kBlockSize - 12);
}

void SealBlock(uint8_t* blk, const BlockHeader& h, const Uuid& uuid) {
  Encoder e(blk, kHeaderSize);
  e.u32(h.magic);
  e.u16(h.major);
  e.u16(h.minor);
  e.u32(0);
  e.u32(h.flags);
  e.u64(h.seq);
  e.u64(h.addr);
  EncodeU32(blk + 8, BlockCrc(blk, uuid, h.addr));
}

BlockHeader PeekHeader(const uint8_t* blk) {
  Decoder d(blk, kHeaderSize);
  BlockHeader h;
  h.magic = d.u32();
  h.major = d.u16();
  h.minor = d.u16();
  d.u32();
  h.flags = d.u32();
  h.seq = d.u64();
  h.addr = d.u64();
  return h;
}

Status CheckBlock(const uint8_t* blk, uint32_t magic, uint64_t addr, const Uuid& uuid,
                  const std::string& what) {
  BlockHeader h = PeekHeader(blk);
  std::string where = what + " at block " + std::to_string(addr);
  if (h.magic != magic) {
    char buf[64];
    std::snprintf(buf, sizeof buf, ": bad magic 0x%08x (expected 0x%08x)", h.magic, magic);
    return Status::Corruption(where + buf);
  }
  uint32_t stored = DecodeU32(blk + 8);
  uint32_t actual = BlockCrc(blk, uuid, addr);
  if (stored != actual) {
    char buf[64];
    std::snprintf(buf, sizeof buf, ": bad checksum (stored 0x%08x, computed 0x%08x)", stored,
                  actual);
    return Status::Corruption(where + buf);
  }
  if (h.major > kFormatMajor) {
    return Status::Unsupported(where + ": format version " + std::to_string(h.major) + "." +
                               std::to_string(h.minor) + " is newer than this dede supports (" +
                               std::to_string(kFormatMajor) + "." + std::to_string(kFormatMinor) +
                               ")");
  }
  if (h.major == 0) return Status::Corruption(where + ": format version 0");
  if (h.addr != addr) {
    return Status::Corruption(where + ": block claims address " + std::to_string(h.addr));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------- superblock

namespace {
// Groups in `span` blocks when each full group has `full` blocks: group g
// exists when it has at least 2 blocks (one refcount block, one data block).
uint64_t GroupCountFor(uint64_t span, uint64_t full) {
  return span < 2 ? 0 : (span - 2) / full + 1;
}
}  // namespace

uint64_t Superblock::GroupStart(uint32_t g) const { return group_start + g * FullGroupBlocks(); }

uint32_t Superblock::GroupRefBlocks(uint32_t g) const {
  uint64_t avail = total_blocks - GroupStart(g);
  if (avail >= FullGroupBlocks()) return group_refblocks;
  return static_cast<uint32_t>((avail + kRefsPerBlock) / (kRefsPerBlock + 1));
}

uint64_t Superblock::GroupDataBlocks(uint32_t g) const {
  uint64_t avail = total_blocks - GroupStart(g);
  if (avail >= FullGroupBlocks()) return uint64_t{group_refblocks} * kRefsPerBlock;
  return avail - GroupRefBlocks(g);
}

uint64_t Superblock::DataBlocks() const {
  uint64_t n = 0;
  for (uint32_t g = 0; g < group_count; g++) n += GroupDataBlocks(g);
  return n;
}

bool Superblock::LocateData(uint64_t b, uint32_t* group, uint64_t* refblock,
                            uint32_t* slot) const {
  if (b < group_start || b >= total_blocks) return false;
  uint64_t g = (b - group_start) / FullGroupBlocks();
  if (g >= group_count) return false;
  uint64_t ds = GroupDataStart(static_cast<uint32_t>(g));
  if (b < ds || b >= ds + GroupDataBlocks(static_cast<uint32_t>(g))) return false;
  uint64_t idx = b - ds;
  *group = static_cast<uint32_t>(g);
  *refblock = GroupStart(static_cast<uint32_t>(g)) + idx / kRefsPerBlock;
  *slot = static_cast<uint32_t>(idx % kRefsPerBlock);
  return true;
}

void EncodeSuperblock(const Superblock& sb, uint64_t addr, uint8_t* blk) {
  std::memset(blk, 0, kBlockSize);
  Encoder e(blk + kHeaderSize, kBlockSize - kHeaderSize);
  e.bytes(sb.uuid.data(), 16);
  e.u32(sb.block_size);
  e.u32(static_cast<uint32_t>(sb.hash_algo));
  e.u64(sb.total_blocks);
  e.u32(sb.max_hosts);
  e.u32(sb.lease_slots);
  e.u64(sb.lease_start);
  e.u64(sb.lease_blocks);
  e.u64(sb.journal_start);
  e.u64(sb.journal_blocks);
  e.u64(sb.inode_start);
  e.u64(sb.inode_count);
  e.u64(sb.group_start);
  e.u32(sb.group_count);
  e.u32(sb.group_refblocks);
  e.u64(sb.created_ns);
  e.u64(sb.compat_features);
  e.u64(sb.incompat_features);
  e.u32(sb.drop_blocks);
  BlockHeader h;
  h.magic = kMagicSuperblock;
  h.seq = 1;
  h.addr = addr;
  SealBlock(blk, h, sb.uuid);
}

Result<Superblock> DecodeSuperblock(const uint8_t* blk, uint64_t addr) {
  Superblock sb;
  std::memcpy(sb.uuid.data(), blk + kHeaderSize, 16);
  RETURN_IF_ERROR(CheckBlock(blk, kMagicSuperblock, addr, sb.uuid, "superblock"));
  Decoder d(blk + kHeaderSize + 16, kBlockSize - kHeaderSize - 16);
  sb.block_size = d.u32();
  uint32_t algo = d.u32();
  sb.total_blocks = d.u64();
  sb.max_hosts = d.u32();
  sb.lease_slots = d.u32();
  sb.lease_start = d.u64();
  sb.lease_blocks = d.u64();
  sb.journal_start = d.u64();
  sb.journal_blocks = d.u64();
  sb.inode_start = d.u64();
  sb.inode_count = d.u64();
  sb.group_start = d.u64();
  sb.group_count = d.u32();
  sb.group_refblocks = d.u32();
  sb.created_ns = d.u64();
  sb.compat_features = d.u64();
  sb.incompat_features = d.u64();
  sb.drop_blocks = d.u32();
  std::string where = "superblock at block " + std::to_string(addr);
  if (sb.block_size != kBlockSize) {
    return Status::Unsupported(where + ": block size " + std::to_string(sb.block_size));
  }
  if (algo != 1 && algo != 2) {
    return Status::Unsupported(where + ": unknown hash algorithm " + std::to_string(algo));
  }
  sb.hash_algo = static_cast<HashAlgo>(algo);
  if ((sb.incompat_features & ~kKnownIncompatFeatures) != 0) {
    return Status::Unsupported(where + ": unknown incompatible features");
  }
  // Structural sanity: regions in order, inside the device. Every count is
  // bounded by 2^48 first so that none of the sums below can wrap.
  const uint64_t kLimit = 1ull << 48;
  bool sane = sb.max_hosts >= 1 && sb.max_hosts <= kMaxHosts && sb.journal_blocks >= 16 &&
              sb.journal_blocks < kLimit && sb.inode_count >= 1 && sb.inode_count < kLimit &&
              sb.total_blocks < kLimit && sb.lease_start == kLeaseAreaStartBlock &&
              sb.lease_blocks == kLeaseBlocks * (1 + uint64_t{sb.lease_slots}) &&
              sb.journal_start == sb.lease_start + sb.lease_blocks &&
              sb.inode_start == sb.journal_start + sb.max_hosts * sb.journal_blocks &&
              sb.group_start == sb.inode_start + sb.inode_count && sb.group_refblocks >= 1 &&
              sb.group_start < sb.total_blocks;
  // The drop lists come with their feature bit, leave a ring of at least
  // 12 blocks (a few transactions), and have at most 65535 blocks, as
  // format makes them (an opener holds a host's whole list in memory).
  sane = sane && (sb.drop_blocks > 0) == ((sb.incompat_features & kIncompatDropLists) != 0) &&
         sb.drop_blocks <= kMaxDropBlocks && uint64_t{sb.drop_blocks} + 2 + 12 <= sb.journal_blocks;
  // group_count must tile the rest of the device exactly: every group has
  // at least 2 blocks (a refcount block and a data block) and there is no
  // room for another one.
  sane = sane && sb.group_count >= 1 &&
         sb.group_count == GroupCountFor(sb.total_blocks - sb.group_start, sb.FullGroupBlocks());
  if (!sane) return Status::Corruption(where + ": inconsistent layout fields");
  return sb;
}

Result<Superblock> PlanLayout(const FormatParams& p) {
  Superblock sb;
  sb.total_blocks = p.device_bytes / kBlockSize;
  if (p.max_hosts < 1 || p.max_hosts > kMaxHosts) {
    return Status::Invalid("--max-hosts must be between 1 and " + std::to_string(kMaxHosts));
  }
  const uint64_t kGiB = 1ull << 30;
  sb.max_hosts = p.max_hosts;
  sb.hash_algo = p.hash_algo;
  sb.lease_slots = p.lease_slots ? p.lease_slots : (p.device_bytes < 4 * kGiB ? 8 : 64);
  sb.lease_start = kLeaseAreaStartBlock;
  sb.lease_blocks = kLeaseBlocks * (1 + uint64_t{sb.lease_slots});
  sb.journal_blocks = p.journal_blocks ? p.journal_blocks : (p.device_bytes < kGiB ? 256 : 1024);
  if (sb.journal_blocks < 16) return Status::Invalid("journal must be at least 16 blocks");
  // Bound the sizes before adding them up so that nothing wraps.
  const uint64_t kLimit = 1ull << 48;
  if (sb.journal_blocks >= kLimit) return Status::Invalid("journal size is out of range");
  if (p.inode_count >= kLimit) return Status::Invalid("inode count is out of range");
  const uint64_t drop_blocks =
      p.drop_blocks >= 0 ? static_cast<uint64_t>(p.drop_blocks)
                         : std::clamp<uint64_t>(sb.journal_blocks / 32, 1, 0xffff);
  // The ring must let one transaction hold kMinTxnBlocks (MaxTxnBlocks()
  // is half the ring, less one).
  const uint64_t min_ring = 2 * (uint64_t{kMinTxnBlocks} + 1);
  if (drop_blocks > kMaxDropBlocks || drop_blocks + 2 + min_ring > sb.journal_blocks) {
    return Status::Invalid("the drop list (" + std::to_string(drop_blocks) + " blocks) leaves the " +
                           std::to_string(sb.journal_blocks) + "-block journal's ring fewer than " +
                           std::to_string(min_ring) + " blocks: the journal is too small");
  }
  sb.drop_blocks = static_cast<uint32_t>(drop_blocks);
  if (sb.drop_blocks > 0) sb.incompat_features |= kIncompatDropLists;
  sb.journal_start = sb.lease_start + sb.lease_blocks;
  sb.inode_start = sb.journal_start + sb.max_hosts * sb.journal_blocks;
  sb.inode_count = p.inode_count
                       ? p.inode_count
                       : std::clamp<uint64_t>(sb.total_blocks / 4096, 256, 65536);
  sb.group_start = sb.inode_start + sb.inode_count;
  sb.group_refblocks = p.group_refblocks;
  if (sb.group_refblocks < 1) return Status::Invalid("groups need at least one refcount block");
  // A volume must hold at least 256 data blocks (1 MiB) to be of any use.
  const uint64_t min_blocks = sb.group_start + 1 + 256;
  if (sb.total_blocks < min_blocks) {
    // min_blocks < 2^57 here; in bytes that may not fit 64 bits.
    std::string need = std::to_string(min_blocks) + " blocks";
    if (min_blocks < kLimit) need = std::to_string(min_blocks * kBlockSize) + " bytes";
    return Status::NoSpace("device is too small: " + std::to_string(p.device_bytes) +
                           " bytes, a volume with these settings needs at least " + need);
  }
  if (sb.total_blocks >= (1ull << 48)) return Status::Invalid("device is larger than 1 EiB");
  uint64_t groups = GroupCountFor(sb.total_blocks - sb.group_start, sb.FullGroupBlocks());
  if (groups > UINT32_MAX) {
    return Status::Invalid("device needs more than 2^32 allocation groups; use larger groups");
  }
  sb.group_count = static_cast<uint32_t>(groups);
  return sb;
}

// ---------------------------------------------------------------- journal

void EncodeJournalHeader(const JournalHeader& jh, uint64_t seq, const Uuid& uuid, uint64_t addr,
                         uint8_t* blk) {
  std::memset(blk, 0, kBlockSize);
  Encoder e(blk + kHeaderSize, kBlockSize - kHeaderSize);
  e.u32(jh.host);
  e.u32(0);
  e.u64(jh.tail_seq);
  e.u64(jh.tail_pos);
  SealBlock(blk, BlockHeader{kMagicJournalHeader, kFormatMajor, kFormatMinor, 0, seq, addr}, uuid);
}

Result<JournalHeader> DecodeJournalHeader(const uint8_t* blk, const Uuid& uuid, uint64_t addr) {
  RETURN_IF_ERROR(CheckBlock(blk, kMagicJournalHeader, addr, uuid, "journal header"));
  Decoder d(blk + kHeaderSize, kBlockSize - kHeaderSize);
  JournalHeader jh;
  jh.host = d.u32();
  d.u32();
  jh.tail_seq = d.u64();
  jh.tail_pos = d.u64();
  return jh;
}

void EncodeJournalTxn(const JournalTxn& t, const Uuid& uuid, uint64_t addr, uint8_t* blk) {
  if (t.homes.size() > kMaxTxnBlocks) {
    // A caller bug: the homes would overrun the block.
    std::fprintf(stderr, "EncodeJournalTxn: %zu images (at most %u fit)\n", t.homes.size(),
                 kMaxTxnBlocks);
    std::abort();
  }
  std::memset(blk, 0, kBlockSize);
  Encoder e(blk + kHeaderSize, kBlockSize - kHeaderSize);
  e.u32(static_cast<uint32_t>(t.homes.size()));
  e.u32(t.images_crc);
  for (uint64_t h : t.homes) e.u64(h);
  SealBlock(blk, BlockHeader{kMagicJournalTxn, kFormatMajor, kFormatMinor, 0, t.seq, addr}, uuid);
}

Result<JournalTxn> DecodeJournalTxn(const uint8_t* blk, const Uuid& uuid, uint64_t addr) {
  RETURN_IF_ERROR(CheckBlock(blk, kMagicJournalTxn, addr, uuid, "journal transaction"));
  Decoder d(blk + kHeaderSize, kBlockSize - kHeaderSize);
  JournalTxn t;
  t.seq = PeekHeader(blk).seq;
  uint32_t n = d.u32();
  t.images_crc = d.u32();
  if (n == 0 || n > kMaxTxnBlocks) {
    return Status::Corruption("journal transaction at block " + std::to_string(addr) + ": " +
                              std::to_string(n) + " images");
  }
  t.homes.resize(n);
  for (uint32_t i = 0; i < n; i++) {
    t.homes[i] = d.u64();
    if (t.homes[i] & ~kPtrAddrMask) {
      return Status::Corruption("journal transaction at block " + std::to_string(addr) +
                                ": image " + std::to_string(i) + " has home address " +
                                std::to_string(t.homes[i]) + " beyond 2^48");
    }
  }
  return t;
}

// ---------------------------------------------------------------- inodes

const char* FileKindName(FileKind k) {
  switch (k) {
    case FileKind::kNone: return "none";
    case FileKind::kRegular: return "file";
    case FileKind::kIndexShard: return "index-shard";
    case FileKind::kArena: return "arena";
    case FileKind::kWriteLog: return "write-log";
    case FileKind::kMergeRequest: return "merge-request";
    case FileKind::kSystem: return "system";
  }
  return "unknown";
}

namespace {
constexpr size_t kInodeNameOff = 128;
}

void EncodeInode(const Inode& in, uint64_t seq, const Uuid& uuid, uint64_t addr, uint8_t* blk) {
  std::memset(blk, 0, kBlockSize);
  Encoder e(blk + kHeaderSize, kBlockSize - kHeaderSize);
  e.u64(in.ino);
  e.u64(in.generation);
  e.u32(in.flags);
  e.u16(static_cast<uint16_t>(in.kind));
  e.u8(in.depth);
  const size_t name_len = std::min<size_t>(in.name.size(), kMaxNameLen);
  e.u8(static_cast<uint8_t>(name_len));
  e.u64(in.size);
  e.u64(in.root);
  e.u64(in.mapped_blocks);
  e.u64(in.ctime_ns);
  e.u64(in.mtime_ns);
  e.u64(in.owner_ino);
  std::memcpy(blk + kInodeNameOff, in.name.data(), name_len);
  SealBlock(blk, BlockHeader{kMagicInode, kFormatMajor, kFormatMinor, 0, seq, addr}, uuid);
}

Result<Inode> DecodeInode(const uint8_t* blk, const Uuid& uuid, uint64_t addr) {
  RETURN_IF_ERROR(CheckBlock(blk, kMagicInode, addr, uuid, "inode"));
  Decoder d(blk + kHeaderSize, kBlockSize - kHeaderSize);
  Inode in;
  in.ino = d.u64();
  in.generation = d.u64();
  in.flags = d.u32();
  uint16_t kind = d.u16();
  in.depth = d.u8();
  uint8_t name_len = d.u8();
  in.size = d.u64();
  in.root = d.u64();
  in.mapped_blocks = d.u64();
  in.ctime_ns = d.u64();
  in.mtime_ns = d.u64();
  in.owner_ino = d.u64();
  in.name.assign(reinterpret_cast<const char*>(blk + kInodeNameOff), name_len);
  std::string where = "inode " + std::to_string(in.ino) + " at block " + std::to_string(addr);
  if (in.flags & ~kInodeKnownFlags) return Status::Unsupported(where + ": unknown flags");
  if (kind > static_cast<uint16_t>(FileKind::kSystem)) {
    return Status::Unsupported(where + ": unknown file kind " + std::to_string(kind));
  }
  in.kind = static_cast<FileKind>(kind);
  if (in.depth > 6 || (in.depth == 0) != (in.root == 0) || (in.root & ~kPtrAddrMask)) {
    return Status::Corruption(where + ": bad block-map root");
  }
  if (in.in_use() && (in.name.empty() || in.kind == FileKind::kNone)) {
    return Status::Corruption(where + ": in use without a name or kind");
  }
  // Nothing writes a larger size (create and truncate refuse it), and the
  // block arithmetic above the decoder relies on it: a size near 2^64
  // rounds its block count up to 0.
  if (in.size > kMaxFileBytes) {
    return Status::Corruption(where + ": size " + std::to_string(in.size) +
                              " is past the 2^60-byte limit");
  }
  return in;
}

// ---------------------------------------------------------------- block map

uint64_t GetPtr(const uint8_t* blk, uint32_t i) { return DecodeU64(blk + kHeaderSize + 8 * i); }
void SetPtr(uint8_t* blk, uint32_t i, uint64_t v) { EncodeU64(blk + kHeaderSize + 8 * i, v); }
uint32_t GetRef(const uint8_t* blk, uint32_t i) { return DecodeU32(blk + kHeaderSize + 4 * i); }
void SetRef(uint8_t* blk, uint32_t i, uint32_t v) { EncodeU32(blk + kHeaderSize + 4 * i, v); }

void EncodePointerBlock(const PointerBlock& pb, uint64_t seq, const Uuid& uuid, uint64_t addr,
                        uint8_t* blk) {
  for (uint32_t i = 0; i < kPointersPerBlock; i++) SetPtr(blk, i, pb.ptrs[i]);
  SealBlock(blk, BlockHeader{kMagicPointerBlock, kFormatMajor, kFormatMinor, pb.level, seq, addr},
            uuid);
}

Result<PointerBlock> DecodePointerBlock(const uint8_t* blk, const Uuid& uuid, uint64_t addr) {
  RETURN_IF_ERROR(CheckBlock(blk, kMagicPointerBlock, addr, uuid, "pointer block"));
  PointerBlock pb;
  uint32_t level = PeekHeader(blk).flags;
  if (level < 1 || level > 6) {
    return Status::Corruption("pointer block at block " + std::to_string(addr) + ": level " +
                              std::to_string(level));
  }
  pb.level = static_cast<uint8_t>(level);
  for (uint32_t i = 0; i < kPointersPerBlock; i++) {
    pb.ptrs[i] = GetPtr(blk, i);
    if (pb.ptrs[i] & kPtrReserved) {
      return Status::Corruption("pointer block at block " + std::to_string(addr) + ": entry " +
                                std::to_string(i) + " has reserved bits set");
    }
  }
  return pb;
}

void EncodeRefcountBlock(const RefcountBlock& rb, uint64_t seq, const Uuid& uuid, uint64_t addr,
                         uint8_t* blk) {
  for (uint32_t i = 0; i < kRefsPerBlock; i++) SetRef(blk, i, rb.refs[i]);
  SealBlock(blk, BlockHeader{kMagicRefcountBlock, kFormatMajor, kFormatMinor, 0, seq, addr}, uuid);
}

Result<RefcountBlock> DecodeRefcountBlock(const uint8_t* blk, const Uuid& uuid, uint64_t addr) {
  RETURN_IF_ERROR(CheckBlock(blk, kMagicRefcountBlock, addr, uuid, "refcount block"));
  RefcountBlock rb;
  for (uint32_t i = 0; i < kRefsPerBlock; i++) rb.refs[i] = GetRef(blk, i);
  return rb;
}

// ============================================================== drop lists

void EncodeDropListBlock(const std::vector<uint64_t>& drops, uint32_t host, uint64_t seq,
                         const Uuid& uuid, uint64_t addr, uint8_t* blk) {
  std::memset(blk, 0, kBlockSize);
  Encoder e(blk + kHeaderSize, kBlockSize - kHeaderSize);
  e.u32(static_cast<uint32_t>(drops.size()));
  e.u32(host);
  for (uint64_t a : drops) e.u64(a);
  SealBlock(blk, BlockHeader{kMagicDropList, kFormatMajor, kFormatMinor, 0, seq, addr}, uuid);
}

Result<std::vector<uint64_t>> DecodeDropListBlock(const uint8_t* blk, const Superblock& sb,
                                                  uint32_t host, uint64_t addr) {
  std::vector<uint64_t> out;
  bool zero = true;
  for (uint32_t i = 0; i < kBlockSize && zero; i++) zero = blk[i] == 0;
  if (zero) return out;
  const std::string where = "drop list block " + std::to_string(addr);
  RETURN_IF_ERROR(CheckBlock(blk, kMagicDropList, addr, sb.uuid, where));
  Decoder d(blk + kHeaderSize, kBlockSize - kHeaderSize);
  uint32_t n = d.u32();
  uint32_t owner = d.u32();
  if (owner != host) {
    return Status::Corruption(where + " belongs to host " + std::to_string(owner) +
                              ", expected host " + std::to_string(host));
  }
  if (n > kDropsPerBlock) {
    return Status::Corruption(where + " claims " + std::to_string(n) + " entries (at most " +
                              std::to_string(kDropsPerBlock) + ")");
  }
  for (uint32_t i = 0; i < n; i++) {
    uint64_t a = d.u64();
    uint32_t g, slot;
    uint64_t rb;
    if (!sb.LocateData(a, &g, &rb, &slot)) {
      return Status::Corruption(where + ": entry " + std::to_string(i) + " (" +
                                std::to_string(a) + ") is not a data block");
    }
    out.push_back(a);
  }
  // A newer minor may use the bytes after the entries.
  const bool tail_is_ours = PeekHeader(blk).minor <= kFormatMinor;
  for (uint32_t i = kHeaderSize + 8 + n * 8; tail_is_ours && i < kBlockSize; i++) {
    if (blk[i] != 0) {
      return Status::Corruption(where + ": nonzero bytes after entry " + std::to_string(n));
    }
  }
  return out;
}

}  // namespace dede

namespace dede {

// ============================================================== lock table

LeaseLayout LeaseLayoutOf(const Superblock& sb) {
  LeaseLayout l;
  l.lockspace_offset = sb.lease_start * kBlockSize;
  if (sb.lease_slots >= 3) {
    l.partitions = std::min<uint32_t>(sb.lease_slots - 2, kMaxLockTablePartitions);
    // The last slot holds the table.
    l.table_block = sb.lease_start + uint64_t{sb.lease_slots} * kLeaseBlocks;
  }
  return l;
}

void EncodeLockTableBlock(const std::vector<LockRecord>& recs, uint64_t seq, uint64_t addr,
                          const Uuid& uuid, uint8_t* blk) {
  std::memset(blk, 0, kBlockSize);
  Encoder e(blk + kHeaderSize, kBlockSize - kHeaderSize);
  const size_t n = std::min<size_t>(recs.size(), kLockRecordsPerBlock);
  e.u32(static_cast<uint32_t>(n));
  e.u32(0);
  for (size_t i = 0; i < n; i++) {
    const LockRecord& r = recs[i];
    e.u16(r.kind);
    e.u8(r.mode);
    e.u8(0);
    e.u32(r.host);
    e.u64(r.id);
    e.u64(r.generation);
    e.u64(r.since_ns);
  }
  BlockHeader h;
  h.magic = kMagicLockTable;
  h.seq = seq;
  h.addr = addr;
  SealBlock(blk, h, uuid);
}

Result<std::vector<LockRecord>> DecodeLockTableBlock(const uint8_t* blk, uint64_t addr,
                                                     const Uuid& uuid) {
  std::vector<LockRecord> recs;
  bool zero = true;
  for (uint32_t i = 0; i < kBlockSize && zero; i++) zero = blk[i] == 0;
  if (zero) return recs;
  std::string what = "lock table block " + std::to_string(addr);
  RETURN_IF_ERROR(CheckBlock(blk, kMagicLockTable, addr, uuid, what));
  Decoder d(blk + kHeaderSize, kBlockSize - kHeaderSize);
  uint32_t n = d.u32();
  d.u32();
  if (n > kLockRecordsPerBlock) {
    return Status::Corruption(what + ": " + std::to_string(n) + " records (at most " +
                              std::to_string(kLockRecordsPerBlock) + ")");
  }
  recs.resize(n);
  for (uint32_t i = 0; i < n; i++) {
    LockRecord& r = recs[i];
    r.kind = d.u16();
    r.mode = d.u8();
    d.u8();
    r.host = d.u32();
    r.id = d.u64();
    r.generation = d.u64();
    r.since_ns = d.u64();
    if (r.mode != 1 && r.mode != 2) {
      return Status::Corruption(what + ": record " + std::to_string(i) + " has mode " +
                                std::to_string(r.mode));
    }
  }
  return recs;
}

}  // namespace dede
