// Journal: one host slot's metadata redo log (physical, whole 4 KiB block
// images). A transaction is a descriptor block plus the images; it is
// durable once its blocks are on the device and flushed. Replay rewrites
// every valid transaction after the tail to the images' home addresses, so
// it is idempotent. Checkpointing (after the caller has written every image
// home and flushed) moves the tail to the head: the journal is empty again.
//
// Not thread safe: the volume calls it under its metadata mutex.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "util/status.h"
#include "volume/block_device.h"
#include "volume/format.h"

namespace dede {

class Journal {
 public:
  // Reads the header slots of `host`'s journal.
  static Result<std::unique_ptr<Journal>> Open(BlockDevice* dev, const Superblock& sb,
                                               uint32_t host);

  // Writes fresh, empty headers for `host` (used by format, whose ring
  // holds nothing of this volume yet).
  static Status Initialize(BlockDevice* dev, const Superblock& sb, uint32_t host);

  // Repair of a journal whose headers are damaged (fsck --repair): zeroes
  // the ring, flushes, then writes fresh headers and flushes. Fresh
  // headers alone would put the tail back at sequence 1, position 0, where
  // the ring's first lap may still hold this volume's old transactions
  // with valid checksums: the next replay would write years-old images
  // over current metadata. The caller holds the slot (kRecovery(host)
  // and no live owner).
  static Status Reset(BlockDevice* dev, const Superblock& sb, uint32_t host);

  // True if at least one valid transaction follows the tail.
  Result<bool> HasTransactions();

  // Replays every valid transaction to its home address, flushes, and
  // empties the journal. Returns the number of transactions replayed.
  Result<uint64_t> Replay();

  // Appends one transaction: images[i] (4 KiB each, already sealed for
  // homes[i]). Writes but does not flush. kNoSpace if the ring lacks room.
  Status Append(const std::vector<uint64_t>& homes, const std::vector<const uint8_t*>& images);

  // Everything appended so far has reached its home and is durable: move
  // the tail to the head (writes a header slot; the caller flushes).
  Status Checkpoint();

  // After the flush that made Checkpoint's header durable: writes the same
  // tail to the other header slot too (the next seq), so that damage to
  // either slot alone cannot send a replay back to the older tail, over
  // home blocks other hosts have changed since. Not flushed (durable with
  // the device's next flush, which comes before the next header write); a
  // torn mirror leaves the header it copies intact.
  Status MirrorHeader();

  uint64_t ring_blocks() const { return ring_; }
  uint64_t used_blocks() const { return used_; }
  uint64_t free_blocks() const { return ring_ - used_; }
  uint64_t head_seq() const { return head_seq_; }

 private:
  Journal(BlockDevice* dev, const Superblock& sb, uint32_t host);
  uint64_t RingAddr(uint64_t pos) const { return start_ + kJournalHeaderSlots + pos; }
  Status WriteHeader();
  // Reads the transaction at `pos` expecting `seq`; false if none is valid.
  Result<bool> ReadTxn(uint64_t pos, uint64_t seq, JournalTxn* txn, std::vector<uint8_t>* images);
  Status ReadRing(uint64_t pos, uint64_t n, uint8_t* out);
  Status WriteRing(uint64_t pos, uint64_t n, const uint8_t* in);

  // Replay writes an image home only if it is a block of a journaled kind,
  // sealed for that home (checksum with the address and the volume UUID),
  // and the home lies where that kind lives: a misdirected or forged image
  // behind a valid descriptor would otherwise overwrite a superblock, the
  // lease area, another host's journal or file data.
  Status CheckImage(const uint8_t* image, uint64_t home) const;

  BlockDevice* dev_;
  const Superblock sb_;
  Uuid uuid_;
  uint32_t host_;
  uint64_t start_;
  uint64_t ring_;
  uint64_t header_seq_ = 0;  // seq of the newest valid header slot
  uint64_t tail_seq_ = 1, tail_pos_ = 0;
  uint64_t head_seq_ = 1, head_pos_ = 0;
  uint64_t used_ = 0;
};

}  // namespace dede
