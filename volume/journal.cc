#include "volume/journal.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "util/crc32c.h"

namespace dede {
namespace {
struct AlignedBuf {
  explicit AlignedBuf(size_t n)
      : p(static_cast<uint8_t*>(std::aligned_alloc(kBlockSize, (n + kBlockSize - 1) / kBlockSize *
                                                                    kBlockSize))) {}
  ~AlignedBuf() { std::free(p); }
  uint8_t* p;
};
}  // namespace

Journal::Journal(BlockDevice* dev, const Superblock& sb, uint32_t host)
    : dev_(dev),
      sb_(sb),
      uuid_(sb.uuid),
      host_(host),
      start_(sb.JournalStart(host)),
      ring_(sb.JournalRingBlocks()) {}

Status Journal::Initialize(BlockDevice* dev, const Superblock& sb, uint32_t host) {
  AlignedBuf buf(2 * kBlockSize);
  JournalHeader jh;
  jh.host = host;
  for (uint64_t i = 0; i < kJournalHeaderSlots; i++) {
    uint64_t addr = sb.JournalStart(host) + i;
    // Slot i always holds header seqs with seq % 2 == i, so the next header
    // (seq 3) goes to slot 1 and never overwrites the newest one (seq 2).
    EncodeJournalHeader(jh, /*seq=*/i == 0 ? 2 : 1, sb.uuid, addr, buf.p + i * kBlockSize);
  }
  return dev->Write(sb.JournalStart(host) * kBlockSize, buf.p, 2 * kBlockSize);
}

Status Journal::Reset(BlockDevice* dev, const Superblock& sb, uint32_t host) {
  const uint64_t first = sb.JournalStart(host) + kJournalHeaderSlots;
  const uint64_t ring = sb.JournalRingBlocks();
  constexpr uint64_t kChunk = 256;
  AlignedBuf zeros(kChunk * kBlockSize);
  std::memset(zeros.p, 0, kChunk * kBlockSize);
  for (uint64_t done = 0; done < ring;) {
    const uint64_t n = std::min(kChunk, ring - done);
    RETURN_IF_ERROR(dev->Write((first + done) * kBlockSize, zeros.p, n * kBlockSize));
    done += n;
  }
  // The ring is empty on the disk before any header points into it.
  RETURN_IF_ERROR(dev->Flush());
  RETURN_IF_ERROR(Initialize(dev, sb, host));
  return dev->Flush();
}

Result<std::unique_ptr<Journal>> Journal::Open(BlockDevice* dev, const Superblock& sb,
                                               uint32_t host) {
  std::unique_ptr<Journal> j(new Journal(dev, sb, host));
  AlignedBuf buf(2 * kBlockSize);
  RETURN_IF_ERROR(dev->Read(j->start_ * kBlockSize, buf.p, 2 * kBlockSize));
  Status first_error;
  bool found = false;
  // The newest header slot a newer dede wrote (sound crc, newer major).
  Status newer;
  uint64_t newer_seq = 0;
  for (uint64_t i = 0; i < kJournalHeaderSlots; i++) {
    const uint8_t* b = buf.p + i * kBlockSize;
    auto jh = DecodeJournalHeader(b, sb.uuid, j->start_ + i);
    if (!jh.ok()) {
      if (jh.status().code() == Status::Code::kUnsupported && PeekHeader(b).seq >= newer_seq) {
        newer = jh.status();
        newer_seq = PeekHeader(b).seq;
      }
      if (first_error.ok()) first_error = jh.status();
      continue;
    }
    uint64_t seq = PeekHeader(b).seq;
    if (jh->host != host || jh->tail_pos >= j->ring_) {
      if (first_error.ok()) {
        first_error = Status::Corruption("journal header of host " + std::to_string(host) +
                                         " at block " + std::to_string(j->start_ + i) +
                                         ": fields out of range");
      }
      continue;
    }
    if (!found || seq > j->header_seq_) {
      found = true;
      j->header_seq_ = seq;
      j->tail_seq_ = jh->tail_seq;
      j->tail_pos_ = jh->tail_pos;
    }
  }
  // A newer dede's header newer than ours says where its log starts: ours
  // would replay from an older tail, over home blocks it has written since.
  if (!newer.ok() && (!found || newer_seq > j->header_seq_)) return newer;
  if (!found) return first_error;
  j->head_seq_ = j->tail_seq_;
  j->head_pos_ = j->tail_pos_;
  j->used_ = 0;
  return j;
}

Status Journal::ReadRing(uint64_t pos, uint64_t n, uint8_t* out) {
  while (n > 0) {
    uint64_t run = std::min(n, ring_ - pos);
    RETURN_IF_ERROR(dev_->Read(RingAddr(pos) * kBlockSize, out, run * kBlockSize));
    out += run * kBlockSize;
    n -= run;
    pos = (pos + run) % ring_;
  }
  return Status::Ok();
}

Status Journal::WriteRing(uint64_t pos, uint64_t n, const uint8_t* in) {
  while (n > 0) {
    uint64_t run = std::min(n, ring_ - pos);
    RETURN_IF_ERROR(dev_->Write(RingAddr(pos) * kBlockSize, in, run * kBlockSize));
    in += run * kBlockSize;
    n -= run;
    pos = (pos + run) % ring_;
  }
  return Status::Ok();
}

Result<bool> Journal::ReadTxn(uint64_t pos, uint64_t seq, JournalTxn* txn,
                              std::vector<uint8_t>* images) {
  AlignedBuf desc(kBlockSize);
  RETURN_IF_ERROR(ReadRing(pos, 1, desc.p));
  auto t = DecodeJournalTxn(desc.p, uuid_, RingAddr(pos));
  if (!t.ok() && t.status().code() == Status::Code::kUnsupported && PeekHeader(desc.p).seq == seq) {
    // The next transaction, written by a newer dede (the header's crc and
    // seq are sound): taken for the end of the log, replay would skip it
    // and every later one, and the checkpoint after it forget them.
    return t.status().WithContext("journal of host " + std::to_string(host_) + ", transaction " +
                                  std::to_string(seq) + " at ring position " + std::to_string(pos));
  }
  // Anything else that is not the next transaction ends the log: an old
  // lap (of this dede or a newer one), a torn descriptor, or never-written
  // space.
  if (!t.ok() || t->seq != seq || t->homes.size() + 1 > ring_) return false;
  AlignedBuf img(t->homes.size() * kBlockSize);
  RETURN_IF_ERROR(ReadRing((pos + 1) % ring_, t->homes.size(), img.p));
  if (Crc32c(img.p, t->homes.size() * kBlockSize) != t->images_crc) return false;
  images->assign(img.p, img.p + t->homes.size() * kBlockSize);
  *txn = std::move(t.value());
  return true;
}

Result<bool> Journal::HasTransactions() {
  JournalTxn txn;
  std::vector<uint8_t> images;
  return ReadTxn(tail_pos_, tail_seq_, &txn, &images);
}

Result<uint64_t> Journal::Replay() {
  uint64_t pos = tail_pos_, seq = tail_seq_, count = 0, used = 0;
  while (used < ring_) {
    JournalTxn txn;
    std::vector<uint8_t> images;
    ASSIGN_OR_RETURN(bool valid, ReadTxn(pos, seq, &txn, &images));
    if (!valid) break;
    // Every image is checked before any is written: a transaction goes
    // home whole or not at all.
    for (size_t i = 0; i < txn.homes.size(); i++) {
      Status ok = CheckImage(images.data() + i * kBlockSize, txn.homes[i]);
      if (!ok.ok()) {
        return ok.WithContext("journal of host " + std::to_string(host_) + ", transaction " +
                              std::to_string(seq) + " at ring position " + std::to_string(pos));
      }
    }
    AlignedBuf blk(kBlockSize);
    for (size_t i = 0; i < txn.homes.size(); i++) {
      std::memcpy(blk.p, images.data() + i * kBlockSize, kBlockSize);
      RETURN_IF_ERROR(dev_->Write(txn.homes[i] * kBlockSize, blk.p, kBlockSize));
    }
    count++;
    seq++;
    used += 1 + txn.homes.size();
    pos = (pos + 1 + txn.homes.size()) % ring_;
  }
  head_seq_ = seq;
  head_pos_ = pos;
  used_ = used;
  if (count > 0) {
    RETURN_IF_ERROR(dev_->Flush());
    RETURN_IF_ERROR(Checkpoint());
    RETURN_IF_ERROR(dev_->Flush());
    RETURN_IF_ERROR(MirrorHeader());
  }
  return count;
}

Status Journal::CheckImage(const uint8_t* image, uint64_t home) const {
  const uint32_t magic = PeekHeader(image).magic;
  const std::string what = "journal image for block " + std::to_string(home);
  auto misplaced = [&](const char* kind) {
    return Status::Corruption(what + ": a " + std::string(kind) + " cannot live there");
  };
  if (home >= sb_.total_blocks) return Status::Corruption(what + ": past the volume's end");
  switch (magic) {
    case kMagicInode:
      if (home < sb_.inode_start || home >= sb_.inode_start + sb_.inode_count) {
        return misplaced("inode");
      }
      break;
    case kMagicPointerBlock: {
      uint32_t g, slot;
      uint64_t rb;
      if (!sb_.LocateData(home, &g, &rb, &slot)) return misplaced("pointer block");
      break;
    }
    case kMagicRefcountBlock: {
      if (home < sb_.group_start) return misplaced("refcount block");
      const uint64_t g = (home - sb_.group_start) / sb_.FullGroupBlocks();
      if (g >= sb_.group_count || home >= sb_.GroupStart(static_cast<uint32_t>(g)) +
                                              sb_.GroupRefBlocks(static_cast<uint32_t>(g))) {
        return misplaced("refcount block");
      }
      break;
    }
    case kMagicDropList: {
      if (sb_.drop_blocks == 0 || home < sb_.journal_start || home >= sb_.inode_start) {
        return misplaced("drop list block");
      }
      const uint64_t within = (home - sb_.journal_start) % sb_.journal_blocks;
      if (within < sb_.journal_blocks - sb_.drop_blocks) return misplaced("drop list block");
      break;
    }
    default: {
      char buf[48];
      std::snprintf(buf, sizeof buf, ": magic 0x%08x is not a journaled kind", magic);
      return Status::Corruption(what + buf);
    }
  }
  return CheckBlock(image, magic, home, uuid_, what);
}

Status Journal::Append(const std::vector<uint64_t>& homes,
                       const std::vector<const uint8_t*>& images) {
  if (homes.empty()) return Status::Ok();
  if (homes.size() > kMaxTxnBlocks || homes.size() != images.size()) {
    return Status::Invalid("journal transaction of " + std::to_string(homes.size()) + " blocks");
  }
  uint64_t n = homes.size() + 1;
  if (n > free_blocks()) {
    return Status::NoSpace("journal of host " + std::to_string(host_) + " is full");
  }
  AlignedBuf buf(n * kBlockSize);
  for (size_t i = 0; i < images.size(); i++) {
    std::memcpy(buf.p + (i + 1) * kBlockSize, images[i], kBlockSize);
  }
  JournalTxn t;
  t.seq = head_seq_;
  t.homes = homes;
  t.images_crc = Crc32c(buf.p + kBlockSize, homes.size() * kBlockSize);
  EncodeJournalTxn(t, uuid_, RingAddr(head_pos_), buf.p);
  RETURN_IF_ERROR(WriteRing(head_pos_, n, buf.p));
  head_seq_++;
  head_pos_ = (head_pos_ + n) % ring_;
  used_ += n;
  return Status::Ok();
}

// Callers flush right after this and append nothing before that flush, so a
// torn header write can only fall back to the previous tail whose
// transactions are all still intact in the ring (replaying them again is
// harmless: they end in the same images the checkpoint wrote home).
Status Journal::Checkpoint() {
  tail_seq_ = head_seq_;
  tail_pos_ = head_pos_;
  used_ = 0;
  return WriteHeader();
}

Status Journal::MirrorHeader() {
  return WriteHeader();
}

Status Journal::WriteHeader() {
  header_seq_++;
  // Alternate slots so a torn header write leaves the other one intact.
  uint64_t slot = header_seq_ % kJournalHeaderSlots;
  AlignedBuf buf(kBlockSize);
  JournalHeader jh;
  jh.host = host_;
  jh.tail_seq = tail_seq_;
  jh.tail_pos = tail_pos_;
  EncodeJournalHeader(jh, header_seq_, uuid_, start_ + slot, buf.p);
  return dev_->Write((start_ + slot) * kBlockSize, buf.p, kBlockSize);
}

}  // namespace dede
