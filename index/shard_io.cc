#include "index/shard_io.h"

#include <algorithm>
#include <cstring>

#include "util/io_budget.h"
#include "util/clock.h"
#include "util/coding.h"

namespace dede {

namespace {
constexpr uint64_t kChunkBlocks = 256;  // 1 MiB sequential I/O
}  // namespace

// ---------------------------------------------------------------- reader

Result<std::unique_ptr<ShardReader>> ShardReader::Open(File* f, const Uuid& uuid,
                                                       const std::string& what) {
  std::unique_ptr<ShardReader> r(new ShardReader(f, uuid, what));
  r->id_ = f->id();
  std::vector<uint8_t> blk(kBlockSize);
  if (f->size() < kBlockSize) return Status::Corruption(what + ": shorter than its header");
  RETURN_IF_ERROR(f->Read(0, blk.data(), kBlockSize));
  ASSIGN_OR_RETURN(r->header_, DecodeShardHeader(blk.data(), uuid, r->id_, what));
  const ShardHeader& h = r->header_;
  r->prefix_ = EntryPrefix(h);
  r->entry_size_ = h.entry_size;
  r->fp_size_ = uint32_t(HashAlgoSize(h.algo));
  r->elided_ = ElidedBytes(h.range);
  r->stored_fp_ = r->fp_size_ - r->elided_;
  r->chunk_count_ = (h.entry_blocks + kChunkBlocks - 1) / kChunkBlocks;
  const uint64_t need = (1 + h.entry_blocks + h.file_blocks) * kBlockSize;
  if (f->size() < need) {
    return Status::Corruption(what + ": file is " + std::to_string(f->size()) +
                              " bytes, its header needs " + std::to_string(need));
  }
  if (h.file_blocks > 0) {
    std::vector<uint8_t> ft(h.file_blocks * kBlockSize);
    RETURN_IF_ERROR(f->Read((1 + h.entry_blocks) * kBlockSize, ft.data(), ft.size()));
    for (uint64_t i = 0; i < h.file_blocks; i++) {
      Status s = DecodeFileTableBlock(ft.data() + i * kBlockSize, uuid, r->id_,
                                      1 + h.entry_blocks + i, &r->files_, what);
      if (!s.ok()) {
        r->stats_.file_table_corrupt = true;
        r->files_.clear();
        break;
      }
    }
    if (!r->stats_.file_table_corrupt && r->files_.size() != h.file_count) {
      r->stats_.file_table_corrupt = true;
      r->files_.clear();
    }
  }
  return r;
}

ShardReader::~ShardReader() {
  if (!helper_.joinable()) return;
  {
    MutexLock l(&mu_);
    stop_ = true;
  }
  cv_.notify_all();
  helper_.join();
}

Status ShardReader::ReadAndCheck(File* f, const ShardHeader& h, const Uuid& uuid, FileId id,
                                 const std::string& what, Chunk* c) {
  if (!c->data) {
    c->data.reset(
        static_cast<uint8_t*>(std::aligned_alloc(kBlockSize, kChunkBlocks * kBlockSize)));
    if (!c->data) return Status::IoError(what + ": no memory for a read-ahead buffer");
  }
  RETURN_IF_ERROR(f->Read(c->first * kBlockSize, c->data.get(), c->blocks * kBlockSize));
  c->good.clear();
  c->corrupt = 0;
  for (uint64_t i = 0; i < c->blocks; i++) {
    const uint8_t* blk = c->data.get() + i * kBlockSize;
    Result<uint32_t> count = CheckEntryBlock(blk, h, uuid, id, c->first + i, what);
    if (count.ok()) {
      c->good.emplace_back(blk + kShardBlockHeader, *count);
    } else {
      c->corrupt++;
    }
  }
  return Status::Ok();
}

// On the helper thread. It reads only fields fixed after Open (file_,
// header_, uuid_, id_, what_, chunk_count_) and the chunks it owns.
void ShardReader::ReadAheadLoop(IoBudget* budget) NO_THREAD_SAFETY_ANALYSIS {
  // The read-ahead is the caller's I/O: charge it where the caller's is.
  ScopedIoBudget charged(budget);
  const uint64_t end = 1 + header_.entry_blocks;
  for (uint64_t k = 0; k < chunk_count_; k++) {
    {
      std::unique_lock<std::mutex> l(mu_.native());
      cv_.wait(l, [&]() NO_THREAD_SAFETY_ANALYSIS {
        return stop_ || k < consumed_ + kAheadChunks;
      });
      if (stop_) return;
    }
    Chunk* c = &ring_[k % kAheadChunks];
    c->first = 1 + k * kChunkBlocks;
    c->blocks = std::min(kChunkBlocks, end - c->first);
    c->status = ReadAndCheck(file_, header_, uuid_, id_, what_, c);
    {
      MutexLock l(&mu_);
      filled_ = k + 1;
    }
    cv_.notify_all();
    if (!c->status.ok()) return;  // the caller reports it
  }
}

// Hands the chunk in use back to the helper and takes the next one;
// chunk_ is nullptr at the end.
Status ShardReader::FillChunk() NO_THREAD_SAFETY_ANALYSIS {
  if (taken_ == 0 && chunk_count_ > 0) {
    helper_ = std::thread([this, budget = CurrentIoBudget()] { ReadAheadLoop(budget); });
  }
  {
    std::unique_lock<std::mutex> l(mu_.native());
    if (consumed_ < taken_) consumed_ = taken_;  // done with the current one
    chunk_ = nullptr;
    if (taken_ < chunk_count_) {
      cv_.notify_all();
      cv_.wait(l, [&]() NO_THREAD_SAFETY_ANALYSIS { return filled_ > taken_; });
      chunk_ = &ring_[taken_ % kAheadChunks];
      taken_++;
    }
  }
  cv_.notify_all();
  block_ = 0;
  entry_ = block_end_ = nullptr;
  if (chunk_ == nullptr) return Status::Ok();
  if (!chunk_->status.ok()) {
    failed_ = chunk_->status;
    chunk_ = nullptr;
    return failed_;
  }
  const uint64_t per = EntriesPerBlock(header_.entry_size);
  stats_.corrupt_blocks += chunk_->corrupt;
  stats_.lost_entries += chunk_->corrupt * per;
  if (!chunk_->good.empty()) {
    entry_ = chunk_->good[0].first;
    block_end_ = entry_ + size_t(chunk_->good[0].second) * entry_size_;
  }
  return Status::Ok();
}

namespace {

// Copies n bytes (8 <= n <= 32) with at most four fixed-size moves: the
// stored part of a fingerprint is 11..16 (XXH3-128) or 27..32 (SHA-256)
// bytes, and a variable-length memcpy call per entry costs more than the
// rest of the decode.
inline void CopyKeyBytes(uint8_t* dst, const uint8_t* src, uint32_t n) {
  if (n >= 16) {
    std::memcpy(dst, src, 16);
    std::memcpy(dst + n - 16, src + n - 16, 16);
  } else {
    std::memcpy(dst, src, 8);
    std::memcpy(dst + n - 8, src + n - 8, 8);
  }
}

// The 56-bit little-endian meta word at p: two overlapping 4-byte loads
// (byte 3 is in both, at the same position).
inline uint64_t LoadMeta(const uint8_t* p) {
  return uint64_t(DecodeU32(p)) | uint64_t(DecodeU32(p + 3)) << 24;
}

}  // namespace

Result<bool> ShardReader::Next(IndexEntry* out) {
  while (true) {
    while (entry_ != nullptr) {
      const uint8_t* p = entry_;
      entry_ += entry_size_;
      if (entry_ == block_end_) {
        if (++block_ < chunk_->good.size()) {
          entry_ = chunk_->good[block_].first;
          block_end_ = entry_ + size_t(chunk_->good[block_].second) * entry_size_;
        } else {
          entry_ = block_end_ = nullptr;
        }
      }
      // Decoded in place (this loop is the scan): the key is the range's
      // elided bytes, then the stored bytes, then zeros.
      FpKey key = prefix_;
      CopyKeyBytes(key.data() + elided_, p, stored_fp_);
      const uint64_t key_prefix = KeyPrefix(key);
      // Keys must ascend and stay in the shard's range; anything else is
      // damage the block crc did not catch (or a bug): skip it.
      if (have_last_ && (key_prefix < last_prefix_ ||
                         (key_prefix == last_prefix_ &&
                          std::memcmp(last_.data() + 8, key.data() + 8, fp_size_ - 8) >= 0))) {
        stats_.lost_entries++;
        continue;
      }
      if (!header_.range.Contains(key_prefix)) {
        stats_.lost_entries++;
        continue;
      }
      const uint64_t meta = LoadMeta(p + stored_fp_) & ((1ull << 56) - 1);
      if (meta >> 55) {
        // Arena blocks are handed out below arena_next: naming one past it
        // is damage (a block this version does not own, maybe handed to
        // another fingerprint later). Lost, so a pass sweeps the arena.
        if ((meta & kMaxArenaIndex) >= header_.arena_next) {
          stats_.lost_entries++;
          continue;
        }
        out->kind = EntryKind::kShared;
        out->file = FileId{};
        out->block = 0;
        out->arena = meta & kMaxArenaIndex;
      } else {
        const uint64_t file_ref = meta >> 38 & kMaxEntryFileRef;
        if (file_ref >= files_.size()) {
          stats_.unresolved_entries++;
          continue;
        }
        out->kind = EntryKind::kUnique;
        out->file = files_[file_ref];
        out->block = meta & kMaxEntryBlock;
        out->arena = 0;
      }
      out->fp = key;
      last_ = key;
      last_prefix_ = key_prefix;
      have_last_ = true;
      stats_.entries++;
      return true;
    }
    if (!failed_.ok()) return failed_;
    if (taken_ == chunk_count_) {
      if (chunk_ != nullptr) RETURN_IF_ERROR(FillChunk());  // hands the last one back
      return false;
    }
    RETURN_IF_ERROR(FillChunk());
  }
}

// ---------------------------------------------------------------- writer

ShardWriter::ShardWriter(Volume* vol, File* f, const ShardHeader& proto)
    : vol_(vol), file_(f), uuid_(vol->superblock().uuid), id_(f->id()), header_(proto) {
  header_.entry_size = EntrySize(header_.algo, header_.range);
  header_.entry_count = header_.entry_blocks = 0;
  header_.unique_count = header_.shared_count = 0;
  header_.file_count = header_.file_blocks = 0;
  per_block_ = EntriesPerBlock(header_.entry_size);
}

Status ShardWriter::WriteAt(uint64_t block, const uint8_t* data, size_t blocks) {
  const uint64_t end = (block + blocks) * kBlockSize;
  if (file_->size() < end) {
    // Grow ahead in big steps: extension is a hole, so this costs one
    // inode update per step, not per chunk.
    RETURN_IF_ERROR(file_->Truncate(std::max<uint64_t>(end, file_->size() * 2)));
  }
  RETURN_IF_ERROR(file_->Write(block * kBlockSize, data, blocks * kBlockSize));
  bytes_ += blocks * kBlockSize;
  return Status::Ok();
}

Status ShardWriter::FlushChunk() {
  if (chunk_.empty()) return Status::Ok();
  Status s = WriteAt(chunk_first_block_, chunk_.data(), chunk_.size() / kBlockSize);
  chunk_first_block_ += chunk_.size() / kBlockSize;
  chunk_.clear();
  return s;
}

Status ShardWriter::Add(const IndexEntry& e) {
  if (!failed_.ok()) return failed_;
  if (have_last_ && !(last_ < e.fp)) {
    return failed_ = Status::Invalid("shard writer: entries out of order");
  }
  if (!header_.range.Contains(KeyPrefix(e.fp))) {
    return failed_ = Status::Invalid("shard writer: entry outside " + header_.range.ToString());
  }
  EncodedEntry ee;
  ee.e = e;
  if (e.kind == EntryKind::kUnique) {
    if (e.block > kMaxEntryBlock) return Status::Invalid("block index too large for the index");
    auto [it, fresh] = file_refs_.try_emplace(e.file, uint32_t(files_.size()));
    if (fresh) {
      if (files_.size() > kMaxEntryFileRef) {
        file_refs_.erase(it);
        return Status::Invalid("too many files in one shard");
      }
      files_.push_back(e.file);
    }
    ee.file_ref = it->second;
    header_.unique_count++;
  } else {
    if (e.arena > kMaxArenaIndex) return Status::Invalid("arena index too large");
    header_.shared_count++;
  }
  last_ = e.fp;
  have_last_ = true;
  header_.entry_count++;
  block_entries_.push_back(ee);
  if (block_entries_.size() == per_block_) {
    const size_t at = chunk_.size();
    chunk_.resize(at + kBlockSize);
    EncodeEntryBlock(block_entries_.data(), block_entries_.size(), header_, uuid_, id_,
                     next_block_++, chunk_.data() + at);
    block_entries_.clear();
    if (chunk_.size() >= kChunkBlocks * kBlockSize) return failed_ = FlushChunk();
  }
  return Status::Ok();
}

Status ShardWriter::Finish(uint64_t arena_next, uint64_t update_ns) {
  if (!failed_.ok()) return failed_;
  if (!block_entries_.empty()) {
    const size_t at = chunk_.size();
    chunk_.resize(at + kBlockSize);
    EncodeEntryBlock(block_entries_.data(), block_entries_.size(), header_, uuid_, id_,
                     next_block_++, chunk_.data() + at);
    block_entries_.clear();
  }
  RETURN_IF_ERROR(failed_ = FlushChunk());
  header_.entry_blocks = next_block_ - 1;
  header_.file_count = files_.size();
  header_.file_blocks = (files_.size() + kFilesPerBlock - 1) / kFilesPerBlock;
  std::vector<uint8_t> ft(header_.file_blocks * kBlockSize);
  for (uint64_t i = 0; i < header_.file_blocks; i++) {
    const size_t first = i * kFilesPerBlock;
    const size_t n = std::min<size_t>(kFilesPerBlock, files_.size() - first);
    EncodeFileTableBlock(files_.data() + first, n, uuid_, id_, next_block_ + i,
                         ft.data() + i * kBlockSize);
  }
  if (!ft.empty()) RETURN_IF_ERROR(failed_ = WriteAt(next_block_, ft.data(), header_.file_blocks));
  RETURN_IF_ERROR(failed_ = file_->Truncate((next_block_ + header_.file_blocks) * kBlockSize));
  // Entries and file table durable before the header that vouches for them.
  RETURN_IF_ERROR(failed_ = vol_->Sync());
  header_.arena_next = arena_next;
  header_.update_ns = update_ns;
  std::vector<uint8_t> hb(kBlockSize);
  EncodeShardHeader(header_, uuid_, id_, hb.data());
  RETURN_IF_ERROR(failed_ = file_->Write(0, hb.data(), kBlockSize));
  bytes_ += kBlockSize;
  return failed_ = vol_->Sync();
}

// ---------------------------------------------------------------- pending

Result<std::vector<PendingRecord>> ReadPendingFile(File* f, HashAlgo algo, const Uuid& uuid,
                                                   PendingScanStats* stats,
                                                   const std::string& what) {
  // Frame by frame, each allocated only once its header block checks out:
  // memory follows the records really there, not the file's size (which a
  // damaged inode may put anywhere up to 2^60).
  std::vector<PendingRecord> out;
  const uint64_t size = f->size();
  const uint64_t blocks = size / kBlockSize;
  std::vector<uint8_t> buf(kBlockSize);
  uint64_t block = 0;
  while (block < blocks) {
    buf.resize(kBlockSize);
    RETURN_IF_ERROR(f->Read(block * kBlockSize, buf.data(), kBlockSize));
    uint64_t frame_blocks = 0;
    Status s = DecodePendingFrame(buf.data(), kBlockSize, algo, uuid, f->id(), block, &out,
                                  &frame_blocks, what);
    if (!s.ok() && frame_blocks > 1 && frame_blocks <= blocks - block) {
      // A valid header whose records follow it: read them and decode again.
      buf.resize(frame_blocks * kBlockSize);
      RETURN_IF_ERROR(f->Read((block + 1) * kBlockSize, buf.data() + kBlockSize,
                              (frame_blocks - 1) * kBlockSize));
      s = DecodePendingFrame(buf.data(), buf.size(), algo, uuid, f->id(), block, &out,
                             &frame_blocks, what);
    }
    if (!s.ok()) {
      stats->corrupt_frames++;
      stats->skipped_bytes += size - block * kBlockSize;
      stats->newer_frame = s.code() == Status::Code::kUnsupported;
      break;
    }
    stats->frames++;
    block += frame_blocks;
  }
  stats->records = out.size();
  return out;
}

Status AppendPendingFrame(File* f, const std::vector<PendingRecord>& recs, HashAlgo algo,
                          const Uuid& uuid) {
  if (recs.empty()) return Status::Ok();
  const uint64_t at = (f->size() + kBlockSize - 1) / kBlockSize;
  std::vector<uint8_t> frame = EncodePendingFrame(recs, algo, uuid, f->id(), at);
  RETURN_IF_ERROR(f->Truncate(at * kBlockSize + frame.size()));
  return f->Write(at * kBlockSize, frame.data(), frame.size());
}

Result<bool> PendingHasNewerFrame(File* f, HashAlgo algo, const Uuid& uuid) {
  const uint64_t blocks = f->size() / kBlockSize;
  std::vector<uint8_t> hb(kBlockSize);
  std::vector<PendingRecord> ignored;
  for (uint64_t b = 0; b < blocks;) {
    RETURN_IF_ERROR(f->Read(b * kBlockSize, hb.data(), kBlockSize));
    uint64_t frame_blocks = 0;
    ignored.clear();
    Status s = DecodePendingFrame(hb.data(), kBlockSize, algo, uuid, f->id(), b, &ignored,
                                  &frame_blocks, "pending file");
    if (s.code() == Status::Code::kUnsupported) return true;
    // A header that checks sets the frame's size (its records are not
    // read: only a single-block frame decodes whole here).
    if (frame_blocks == 0) return false;
    b += frame_blocks;
  }
  return false;
}

Result<uint64_t> CountPendingRecords(File* f, HashAlgo algo, const Uuid& uuid) {
  uint64_t total = 0;
  const uint64_t blocks = f->size() / kBlockSize;
  std::vector<uint8_t> hb(kBlockSize);
  for (uint64_t b = 0; b < blocks;) {
    RETURN_IF_ERROR(f->Read(b * kBlockSize, hb.data(), kBlockSize));
    if (DecodeU32(hb.data()) != kMagicPendingFrame ||
        DecodeU32(hb.data() + 8) != FileBlockCrc(hb.data(), 8, uuid, f->id(), b)) {
      break;
    }
    const uint64_t count = DecodeU64(hb.data() + 16);
    // DecodePendingFrame's bound: a larger count is a corrupt frame (and
    // would wrap the sums below).
    if (count > (uint64_t{1} << 32)) break;
    const uint32_t per = PendingRecordsPerBlock(algo);
    total += count;
    b += 1 + (count + per - 1) / per;
  }
  return total;
}

}  // namespace dede
