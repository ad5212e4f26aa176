// Streaming access to index shard versions and pending-record files on the
// volume. The caller holds the shard's lock (LockKind::kIndexShard) and has
// the files open (which holds their inode locks).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "index/shard_format.h"
#include "util/io_budget.h"
#include "util/mutex.h"
#include "util/status.h"
#include "volume/volume.h"

namespace dede {

struct ShardScanStats {
  uint64_t entries = 0;          // entries returned
  uint64_t corrupt_blocks = 0;   // entry blocks skipped (bad magic/crc/count)
  uint64_t lost_entries = 0;     // estimate: entries those blocks held
  bool file_table_corrupt = false;  // Unique entries could not be resolved
  uint64_t unresolved_entries = 0;  // Unique entries dropped for that
};

// Reads a shard version front to back in large sequential chunks. Corrupt
// entry blocks are skipped and counted (the index is a hint: losing entries
// loses dedup opportunities, never data); an unreadable header is an error.
// The first Next() starts a helper thread that reads up to 3 MiB ahead; its
// reads are charged to the I/O budget current at that call, which must
// outlive the reader (the destructor stops and joins the helper). One
// thread at a time calls Next().
class ShardReader {
 public:
  ~ShardReader();
  // Reads and checks the header and the file table.
  static Result<std::unique_ptr<ShardReader>> Open(File* f, const Uuid& uuid,
                                                   const std::string& what);
  const ShardHeader& header() const { return header_; }
  const std::vector<FileId>& file_table() const { return files_; }
  // Next entry in fingerprint order; false at the end. Only I/O errors fail.
  Result<bool> Next(IndexEntry* out);
  const ShardScanStats& stats() const { return stats_; }

 private:
  ShardReader(File* f, const Uuid& uuid, std::string what)
      : file_(f), uuid_(uuid), what_(std::move(what)) {}
  Status FillChunk();
  File* file_;
  Uuid uuid_;
  std::string what_;
  FileId id_;
  ShardHeader header_;
  std::vector<FileId> files_;
  // Read-ahead: a helper thread, started by the first Next(), reads the
  // entry blocks in 1 MiB chunks into a ring of kAheadChunks buffers and
  // checks the magic, crc and count of each block, up to kAheadChunks - 1
  // chunks ahead of the one the caller consumes. The device always has a
  // read outstanding, the crc32c runs on the other core, and a scan runs at
  // the device's sequential read rate when decoding keeps up. Buffers are
  // 4 KiB-aligned (no bounce copy for O_DIRECT devices); at most 4 MiB.
  static constexpr uint64_t kAheadChunks = 4;
  struct AlignedFree {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  using Buffer = std::unique_ptr<uint8_t, AlignedFree>;
  // Chunk k lives in ring_[k % kAheadChunks]. The helper owns it until it
  // counts it in filled_, the caller from then until it counts it in
  // consumed_ (the counters, under mu_, order the two).
  struct Chunk {
    Buffer data;
    uint64_t first = 0, blocks = 0;  // entry blocks [first, first + blocks)
    // The checked entry blocks: entry area and entry count.
    std::vector<std::pair<const uint8_t*, uint32_t>> good;
    uint64_t corrupt = 0;            // blocks that failed the check
    Status status;                   // the read's
  };
  void ReadAheadLoop(IoBudget* budget);
  // Reads and checks chunk `c` (on the helper thread).
  static Status ReadAndCheck(File* f, const ShardHeader& h, const Uuid& uuid, FileId id,
                             const std::string& what, Chunk* c);
  Chunk ring_[kAheadChunks];
  uint64_t chunk_count_ = 0;   // chunks of entry blocks (fixed after Open)
  std::thread helper_;
  // The helper's condition variable needs the native mutex; the analysis
  // cannot follow std::unique_lock, so the waits are checked by hand.
  // Lock order: mu_ is a leaf, held only to read or change the three
  // fields below, never across I/O or while taking another lock.
  Mutex mu_;
  std::condition_variable cv_;
  uint64_t filled_ GUARDED_BY(mu_) = 0;    // chunks read and checked
  uint64_t consumed_ GUARDED_BY(mu_) = 0;  // chunks the caller is done with
  bool stop_ GUARDED_BY(mu_) = false;      // the reader is going away
  // Caller only: chunks taken so far; the current one is ring_[(taken_ -
  // 1) % kAheadChunks] while taken_ > consumed_.
  uint64_t taken_ = 0;
  const Chunk* chunk_ = nullptr;
  Status failed_;                 // a read error, returned by every Next()
  // Position in chunk_: the next entry and the end of its block's entries.
  size_t block_ = 0;
  const uint8_t* entry_ = nullptr;
  const uint8_t* block_end_ = nullptr;
  // Entry geometry (from the header): stored fingerprint bytes follow the
  // `elided_` bytes of prefix_, which also holds zeros up to 32 bytes.
  uint32_t entry_size_ = 0, elided_ = 0, stored_fp_ = 0, fp_size_ = 0;
  FpKey prefix_{};
  // The last entry returned: order check on its 64-bit prefix first, the
  // rest of the key only when the prefixes are equal.
  FpKey last_{};
  uint64_t last_prefix_ = 0;
  bool have_last_ = false;
  ShardScanStats stats_;
};

// Writes a new shard version into an empty, freshly created file: entries
// in ascending fingerprint order (at most one per fingerprint), then
// Finish writes the file table, makes everything durable, and only then
// writes the header and makes that durable: a version with a valid header
// is complete.
class ShardWriter {
 public:
  ShardWriter(Volume* vol, File* f, const ShardHeader& proto);
  Status Add(const IndexEntry& e);
  // `update_ns`: how long the update took (stored for the split decision).
  Status Finish(uint64_t arena_next, uint64_t update_ns);
  uint64_t entries() const { return header_.entry_count; }
  uint64_t bytes_written() const { return bytes_; }

 private:
  Status FlushChunk();
  Status WriteAt(uint64_t block, const uint8_t* data, size_t blocks);
  Volume* vol_;
  File* file_;
  Uuid uuid_;
  FileId id_;
  ShardHeader header_;
  uint32_t per_block_;
  std::vector<EncodedEntry> block_entries_;
  std::vector<uint8_t> chunk_;       // encoded entry blocks not yet written
  uint64_t chunk_first_block_ = 1;
  uint64_t next_block_ = 1;
  std::vector<FileId> files_;
  struct FileIdHash {
    size_t operator()(const FileId& f) const { return f.ino * 0x9e3779b97f4a7c15ULL ^ f.generation; }
  };
  std::unordered_map<FileId, uint32_t, FileIdHash> file_refs_;
  FpKey last_{};
  bool have_last_ = false;
  uint64_t bytes_ = 0;
  Status failed_;
};

struct PendingScanStats {
  uint64_t frames = 0;
  uint64_t records = 0;
  uint64_t corrupt_frames = 0;  // a bad frame ends the scan (rest skipped)
  uint64_t skipped_bytes = 0;
  // The frame that ended the scan is of a newer version, not damaged: it
  // and what follows belong to a newer dede and must be left alone.
  bool newer_frame = false;
};
// Reads every pending record of a pending file.
Result<std::vector<PendingRecord>> ReadPendingFile(File* f, HashAlgo algo, const Uuid& uuid,
                                                   PendingScanStats* stats,
                                                   const std::string& what);
// Appends one frame at the file's end (its size rounded up to 4 KiB).
Status AppendPendingFrame(File* f, const std::vector<PendingRecord>& recs, HashAlgo algo,
                          const Uuid& uuid);
// Whether a pending file holds a frame of a newer major format version
// (before any damaged frame), reading only frame headers: such a file is
// never removed or cut by this dede.
Result<bool> PendingHasNewerFrame(File* f, HashAlgo algo, const Uuid& uuid);
// Counts the records of a pending file by reading only frame headers.
Result<uint64_t> CountPendingRecords(File* f, HashAlgo algo, const Uuid& uuid);

}  // namespace dede
