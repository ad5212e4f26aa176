// WriteLog: the per-file, append-only log of write-monitor records on the
// volume (paper section 3.1: the "write log" DeDe's index update consumes).
//
// Each VM file F = (ino, generation) has at most one log: a volume file of
// kind kWriteLog named WriteLogName(F), with owner_ino = F.ino. The name
// carries the generation, so a file removed and recreated in the same inode
// gets a fresh log and an orphaned log is recognisable by name.
//
// The log is a sequence of frames, each starting at a 4 KiB-aligned offset
// and padded with zeros to the next 4 KiB boundary. A frame holds one
// MonitorBatch (or part of a big one): invalidated ranges, then records.
// docs/FORMAT.md (section 12, "Write log") gives the exact encoding. Each frame has a
// header crc32c (volume UUID, owner file id and the frame's own log offset
// folded in, so a misdirected or foreign frame fails) and a payload crc32c.
// A reader skips a bad frame (bad header, or a valid header with a bad or
// missing payload) by stepping 4 KiB at a time until the next valid header
// and counts it once. Stepping rather than trusting the bad frame's length
// also finds a frame appended inside the extent of an earlier torn one;
// the header crc binds the frame's own offset, so payload bytes never pass
// as a header. Torn appends therefore cost at most the torn frame.
//
// Whoever appends or consumes a log holds the log file's lock (File) for
// the duration. dedupd keeps a busy file's log open between appends and
// closes it at its flush points once idle (LogFlusher), and lends it to
// its own pass; another process finds it locked meanwhile and retries.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kmod/writemon/write_monitor.h"
#include "util/status.h"
#include "volume/format.h"
#include "volume/volume.h"

namespace dede {

inline constexpr uint32_t kMagicWriteLogFrame = 0x4c574444;  // "DDWL"
inline constexpr uint16_t kWriteLogMajor = 1;
inline constexpr uint16_t kWriteLogMinor = 0;
inline constexpr uint32_t kWriteLogHeaderSize = 128;
// A batch bigger than this is split into several frames.
inline constexpr uint32_t kWriteLogMaxFrameBytes = 8u << 20;

// Frame flags (on disk; never renumber).
inline constexpr uint32_t kFrameRecordsDropped = 1u << 0;

// ".dede-wlog-<ino>-<generation>"
std::string WriteLogName(FileId owner);
std::optional<FileId> ParseWriteLogName(const std::string& name);

// One decoded frame.
struct WriteLogFrame {
  uint64_t log_offset = 0;  // where it starts in the log file
  uint32_t host_id = 0;     // host that wrote it
  FileId owner;
  uint64_t first_ns = 0;
  uint64_t last_ns = 0;
  uint64_t dropped_records = 0;
  uint64_t dropped_since_ns = 0;
  std::vector<InvalidRange> invalidated;
  std::vector<BlockRecord> records;
  uint64_t encoded_bytes = 0;  // padded size on disk
};

// Encodes `batch` into frames to be appended at log byte `log_offset`
// (4 KiB-aligned). The result is a whole number of 4 KiB blocks; empty for
// an empty batch. `batch` must keep the MonitorBatch invariants (sorted,
// disjoint, blocks below 2^52); fingerprints must have the algo's size.
std::vector<uint8_t> EncodeWriteLogFrames(const MonitorBatch& batch, uint32_t host_id,
                                          HashAlgo algo, const Uuid& uuid,
                                          uint64_t log_offset);
// The same into `out` (resized; its capacity is reused).
void EncodeWriteLogFrames(const MonitorBatch& batch, uint32_t host_id, HashAlgo algo,
                          const Uuid& uuid, uint64_t log_offset, std::vector<uint8_t>* out);
// Size EncodeWriteLogFrames would produce (for flush sizing).
uint64_t EncodedWriteLogBytes(const MonitorBatch& batch, HashAlgo algo);
// Bytes one record takes in a frame (for the monitor's flush threshold).
size_t WriteLogRecordBytes(HashAlgo algo);
// Bytes one invalidated range takes in a frame.
size_t WriteLogRangeBytes();

// Decodes the frame at buf[0..len) which was read from log offset
// `log_offset` of the log of `owner`. kCorruption (with what and where)
// for any check failure, kUnsupported for a newer major version. When the
// header is valid (the frame decodes, or only its payload is bad or cut
// short by `len`), *frame_bytes is set to the padded frame size; else 0.
// `frame_bytes` may be nullptr.
Result<WriteLogFrame> DecodeWriteLogFrame(const uint8_t* buf, size_t len, HashAlgo algo,
                                          const Uuid& uuid, FileId owner,
                                          uint64_t log_offset, uint64_t* frame_bytes);

struct WriteLogScanStats {
  uint64_t frames = 0;          // valid frames
  uint64_t corrupt_frames = 0;  // bad header runs or bad payloads skipped
                                // (a newer major version counts here too)
  uint64_t newer_frames = 0;    // of those, sound frames of a newer major
                                // version (a newer dede wrote them)
  uint64_t skipped_bytes = 0;   // bytes of the log not in a valid frame
  uint64_t records = 0;         // fingerprint records in valid frames
  uint64_t invalidations = 0;   // invalidated ranges in valid frames
  uint64_t dropped_records = 0; // sum over valid frames
  uint64_t dropped_since_ns = 0;  // earliest over valid frames; 0 = none
};

// Streams the frames of one log file (opened by the caller, lock held),
// reading it in 4 MiB chunks. The log's size is taken at construction.
class WriteLogReader {
 public:
  WriteLogReader(File* log, HashAlgo algo, const Uuid& uuid, FileId owner);
  // Next valid frame into *out; false at the end of the log. Corrupt
  // frames are skipped and counted; only I/O errors are returned.
  Result<bool> Next(WriteLogFrame* out);
  const WriteLogScanStats& stats() const { return stats_; }

 private:
  Status Fill(uint64_t offset, size_t want);
  File* log_;
  HashAlgo algo_;
  Uuid uuid_;
  FileId owner_;
  uint64_t size_ = 0;
  uint64_t pos_ = 0;
  bool in_bad_run_ = false;
  std::vector<uint8_t> buf_;
  uint64_t buf_offset_ = 0;
  WriteLogScanStats stats_;
};

// The state a log describes: applies every valid frame in order (an
// invalidation removes earlier records of its blocks; a record replaces an
// earlier one). `records` is keyed by block.
struct WriteLogState {
  std::map<uint64_t, BlockRecord> records;
  // Every invalidated range seen, in log order (not coalesced): together
  // with `records`, the blocks whose content the log says changed.
  std::vector<InvalidRange> invalidated;
  WriteLogScanStats stats;
  bool saturated = false;  // the last valid frame is a saturation frame
  // More than `max_entries` records and ranges at once: the log describes
  // more than the reader may hold, so it says what a saturation frame
  // says instead: `records` is empty and `invalidated` one range of every
  // block ([0, kWriteLogWholeFileBlocks)) at the newest frame's time.
  bool over_budget = false;
};
// Replays the whole log in memory bounded by `max_entries` (records plus
// ranges held at once; each about 100 bytes in the map): a log of a big
// disk can describe hundreds of millions of blocks (its limit is 3% of
// the disk), and a pass holding them all would take gigabytes.
Result<WriteLogState> ReplayWriteLog(File* log, HashAlgo algo, const Uuid& uuid, FileId owner,
                                     size_t max_entries = SIZE_MAX);

// A log's size limit. Without a pass consuming it, a log grows by about 1%
// of every byte its file is written (one record per 4 KiB block written,
// rewrites included), so a busy VM's log would fill the volume and take
// the space its thin files need. A log that would pass its limit is
// *saturated* instead: the appender writes one saturation frame (below)
// and then drops further batches without writing, until a pass consumes
// the log. Nothing is lost for correctness: the saturation frame says
// every block may have changed, so that pass rehashes the file.
//
// The saturation frame is an ordinary frame (no format change): one
// invalidated range covering every block index [0, 2^52), no records, and
// the batch it replaced counted as dropped. A log whose last frame is one
// is saturated; any later change is already described by it. An append
// with a limit reads the log's last 4 KiB block to tell.
inline constexpr uint64_t kWriteLogWholeFileBlocks = uint64_t{1} << 52;
bool IsSaturationFrame(const WriteLogFrame& frame);

// What an append with a limit did.
enum class LogAppendOutcome {
  kAppended,           // the batch's frames were written
  kSaturated,          // it did not fit: a saturation frame was written instead
  kAlreadySaturated,   // the log ends in a saturation frame: nothing written
};

// Appends `batch` to the log of batch.file, creating the log if needed.
// Opens the log (taking its lock), writes the frames at its end (its size
// rounded up to 4 KiB) in one write, closes it. An empty batch writes
// nothing. Does not Sync: the volume's next flush point makes it durable.
// `max_log_bytes` (0: none) is the log's size limit (see above); `outcome`
// (may be nullptr) says what was done when OK.
// kLocked if someone else holds the log right now (the caller keeps the
// batch); kInvalid if the batch breaks the MonitorBatch invariants or its
// fingerprints are not the volume's algorithm; kCorruption if the name is
// taken by a file that is not this file's write log.
Status AppendToWriteLog(Volume* vol, const MonitorBatch& batch, uint64_t max_log_bytes = 0,
                        LogAppendOutcome* outcome = nullptr);

// Records in the log of `file` that it was set dedup=off: every block is
// marked changed, so the next dedup pass knows the file's index entries
// must go (it then rewrites every shard) even if the file logged nothing
// else. Like AppendToWriteLog (kLocked: try again later).
Status AppendOptOutMarker(Volume* vol, FileId file, uint64_t size_bytes, uint64_t now_ns);
// The batch AppendOptOutMarker appends (empty for an empty file).
MonitorBatch OptOutMarkerBatch(FileId file, uint64_t size_bytes, uint64_t now_ns);

// AppendToWriteLog on a log the caller already holds open (a dedup pass
// writing back records it deferred). Does not Sync.
Status AppendToOpenWriteLog(Volume* vol, File* log, const MonitorBatch& batch,
                            uint64_t max_log_bytes = 0, LogAppendOutcome* outcome = nullptr);

// Replaces the content of a log the caller holds open (a dedup pass that
// consumed it) with `batch` (the records it deferred; empty: the log is
// emptied). Failure-safe: whatever step fails, the log still describes
// every block of `batch` (the old frames, which it was taken from, or the
// new ones), so its blocks reach a later pass; at worst that pass consumes
// frames again that this one consumed (as after a crash before the
// truncation). Emptying the log first and appending the batch after, a
// failed append (ENOSPC, EIO) lost the batch with nothing to say so.
// Does not Sync.
Status ReplaceOpenWriteLog(Volume* vol, File* log, const MonitorBatch& batch);

// Opens the log of `owner` for appending, creating it if there is none
// (another host creating it first is fine: theirs is used). kLocked if
// someone else holds it; kCorruption as for AppendToWriteLog.
Result<std::unique_ptr<File>> OpenOrCreateWriteLog(Volume* vol, FileId owner);

// Opens the log of `owner` read-only style for scanning: kNotFound if there
// is none (kCorruption if the name is taken by something else). Returns
// the open File (lock held) for a WriteLogReader.
Result<std::unique_ptr<File>> OpenWriteLog(Volume* vol, FileId owner);

// Whether the log of `owner` ends in a saturation frame (it reached its
// size limit and no pass has consumed it since); false when there is no
// log. One 4 KiB read. kLocked while someone else holds the log.
Result<bool> WriteLogIsSaturated(Volume* vol, FileId owner);

}  // namespace dede
