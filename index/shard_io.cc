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
  r->prefix_ = EntryPrefix(r->header_);
  const ShardHeader& h = r->header_;
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
  if (ahead_done_.valid()) (void)ahead_done_.get();
}

void ShardReader::StartReadAhead() {
  const uint64_t end = 1 + header_.entry_blocks;
  const uint64_t first = next_block_;
  if (first >= end) return;
  const uint64_t n = std::min(kChunkBlocks, end - first);
  if (!ahead_) {
    ahead_.reset(static_cast<uint8_t*>(std::aligned_alloc(kBlockSize, kChunkBlocks * kBlockSize)));
  }
  ahead_first_ = first;
  ahead_blocks_ = n;
  File* f = file_;
  uint8_t* dst = ahead_.get();
  // The read-ahead is the caller's I/O: charge it where the caller's is.
  IoBudget* budget = CurrentIoBudget();
  ahead_done_ = std::async(std::launch::async, [f, dst, first, n, budget] {
    ScopedIoBudget charged(budget);
    return f->Read(first * kBlockSize, dst, n * kBlockSize);
  });
}

Status ShardReader::FillChunk() {
  if (!ahead_done_.valid()) StartReadAhead();
  RETURN_IF_ERROR(ahead_done_.get());
  std::swap(chunk_, ahead_);
  const uint64_t first = ahead_first_;
  const uint64_t n = ahead_blocks_;
  chunk_blocks_ = n;
  next_block_ = first + n;
  StartReadAhead();  // the next chunk, while this one is decoded
  blocks_.clear();
  block_ = 0;
  in_block_ = 0;
  const uint64_t per = EntriesPerBlock(header_.entry_size);
  for (uint64_t i = 0; i < n; i++) {
    const uint8_t* blk = chunk_.get() + i * kBlockSize;
    Result<uint32_t> count = CheckEntryBlock(blk, header_, uuid_, id_, first + i, what_);
    if (count.ok()) {
      blocks_.emplace_back(blk + kShardBlockHeader, *count);
    } else {
      stats_.corrupt_blocks++;
      stats_.lost_entries += per;
    }
  }
  return Status::Ok();
}

Result<bool> ShardReader::Next(IndexEntry* out) {
  const size_t fp_size = HashAlgoSize(header_.algo);
  while (true) {
    while (block_ < blocks_.size()) {
      const auto [base, count] = blocks_[block_];
      // Decoded in place into *out (no temporaries: this loop is the scan).
      EncodedEntry& ee = scratch_;
      DecodeEntry(base + size_t(in_block_) * header_.entry_size, header_, prefix_, &ee);
      if (++in_block_ == count) {
        block_++;
        in_block_ = 0;
      }
      // Keys must ascend and stay in the shard's range; anything else is
      // damage the block crc did not catch (or a bug): skip it.
      if ((have_last_ && std::memcmp(last_.data(), ee.e.fp.data(), fp_size) >= 0) ||
          !header_.range.Contains(KeyPrefix(ee.e.fp))) {
        stats_.lost_entries++;
        continue;
      }
      if (ee.e.kind == EntryKind::kUnique) {
        if (ee.file_ref >= files_.size()) {
          stats_.unresolved_entries++;
          continue;
        }
        ee.e.file = files_[ee.file_ref];
      }
      std::memcpy(last_.data(), ee.e.fp.data(), fp_size);
      have_last_ = true;
      *out = ee.e;
      stats_.entries++;
      return true;
    }
    if (next_block_ >= 1 + header_.entry_blocks && !ahead_done_.valid()) return false;
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
  std::vector<PendingRecord> out;
  const uint64_t size = f->size();
  std::vector<uint8_t> buf(size);
  if (size > 0) RETURN_IF_ERROR(f->Read(0, buf.data(), size));
  uint64_t block = 0;
  const uint64_t blocks = size / kBlockSize;
  while (block < blocks) {
    uint64_t frame_blocks = 0;
    Status s = DecodePendingFrame(buf.data() + block * kBlockSize, (blocks - block) * kBlockSize,
                                  algo, uuid, f->id(), block, &out, &frame_blocks, what);
    if (!s.ok()) {
      stats->corrupt_frames++;
      stats->skipped_bytes += size - block * kBlockSize;
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
