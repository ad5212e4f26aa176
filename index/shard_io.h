// Streaming access to index shard versions and pending-record files on the
// volume. The caller holds the shard's lock (LockKind::kIndexShard) and has
// the files open (which holds their inode locks).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "index/shard_format.h"
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
  // Read-ahead: while one chunk is decoded the next one is read on a
  // helper thread, so a scan runs at the device's sequential read rate
  // rather than read time plus decode time. Buffers are 4 KiB-aligned (no
  // bounce copy for O_DIRECT devices).
  struct AlignedFree {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  using Buffer = std::unique_ptr<uint8_t, AlignedFree>;
  void StartReadAhead();
  Buffer chunk_, ahead_;
  uint64_t chunk_blocks_ = 0;
  uint64_t ahead_first_ = 0, ahead_blocks_ = 0;
  std::future<Status> ahead_done_;
  uint64_t next_block_ = 1;       // next entry block to decode
  // The checked entry blocks of chunk_ (start, count); entries are decoded
  // one at a time straight from the buffer.
  std::vector<std::pair<const uint8_t*, uint32_t>> blocks_;
  size_t block_ = 0;
  uint32_t in_block_ = 0;
  FpKey prefix_{};
  EncodedEntry scratch_;
  FpKey last_{};
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
};
// Reads every pending record of a pending file.
Result<std::vector<PendingRecord>> ReadPendingFile(File* f, HashAlgo algo, const Uuid& uuid,
                                                   PendingScanStats* stats,
                                                   const std::string& what);
// Appends one frame at the file's end (its size rounded up to 4 KiB).
Status AppendPendingFrame(File* f, const std::vector<PendingRecord>& recs, HashAlgo algo,
                          const Uuid& uuid);
// Counts the records of a pending file by reading only frame headers.
Result<uint64_t> CountPendingRecords(File* f, HashAlgo algo, const Uuid& uuid);

}  // namespace dede
