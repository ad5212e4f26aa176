// The counting core of `dede analyze` (DeDe paper, section 4.1): how much
// exact deduplication would save on a set of raw disk images at block
// sizes 4 KiB .. 1 MiB, what linked clones would save instead, and how
// often each distinct block occurs. No files, no terminal: the command
// (cmd_analyze.cc) reads the images and feeds them here, window by window,
// all images in lockstep; unit tests feed memory.
//
// Definitions (also in `dede analyze --help`):
//  - Chunks. Each image is cut into B-byte chunks from offset 0. A last
//    partial chunk is padded with zeros to B bytes (as a volume with
//    B-byte blocks would store it), so it is equal to a full chunk with the
//    same bytes followed by zeros. Every byte figure is a chunk count
//    times B.
//  - Zero chunks (all bytes zero) are left out of every dedup figure and
//    counted apart.
//  - Exact dedup: among the non-zero chunks of all images together,
//    `distinct` is the number of different contents; physical = distinct x
//    B; savings = 1 - distinct / non-zero chunks.
//  - Linked clones: sharing only between chunks at the same offset (in
//    different images). The sum over offsets of the distinct non-zero
//    contents at that offset replaces `distinct`. It is never smaller than
//    `distinct`, so linked clones never save more than exact dedup.
//  - Histogram: for each distinct non-zero content, its number of
//    occurrences, in buckets 1, 2, 3-4, 5-8, ..., 2^(k-1)+1 .. 2^k.
//
// Equality is decided by fingerprints, never by comparing bytes: a 4 KiB
// block is fingerprinted with XXH3-128; a B-byte chunk's fingerprint is the
// XXH3-128 (seeded with B) of the concatenated fingerprints of its 4 KiB
// blocks. Equal chunks always get equal fingerprints; different chunks
// get equal ones only through an XXH3-128 collision, which at 2^-128 per
// pair is negligible for any number of blocks that fits on disks (2^40
// blocks give about 2^-49 probability of a single collision).
//
// Memory: one count table per block size, 20 bytes per slot (16-byte
// fingerprint + 32-bit count) at a load factor between 3/8 and 3/4, i.e.
// proportional to the number of distinct contents, plus O(images x window)
// for the window being counted. Nothing else grows with the image size.
#pragma once

#include <array>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <utility>
#include <vector>

namespace dede::analyze {

inline constexpr uint32_t kBaseBlock = 4096;
inline constexpr std::array<uint32_t, 6> kBlockSizes = {4096,      8192,       16384,
                                                        64 * 1024, 256 * 1024, 1024 * 1024};
inline constexpr uint32_t kMaxBlock = 1024 * 1024;

// A 128-bit fingerprint, as two words (no padding: hashed as 16 bytes).
struct Key {
  uint64_t lo = 0;
  uint64_t hi = 0;
  friend bool operator==(const Key&, const Key&) = default;
  friend auto operator<=>(const Key&, const Key&) = default;
};
static_assert(sizeof(Key) == 16);

// XXH3-128 of one block of data (any length).
Key HashBlock(const void* data, size_t len);
// Fingerprint of the 4 KiB block of zeros.
const Key& ZeroBlockKey();

// Open-addressing hash table (linear probing) from fingerprint to
// occurrence count. The all-zero key marks empty slots; a real all-zero
// fingerprint is kept aside. Counts past 2^32 - 1 spill into a side map.
class CountTable {
 public:
  // saturate_at: largest count kept in the table itself (a test seam;
  // the default is the 32-bit maximum).
  explicit CountTable(uint32_t saturate_at = UINT32_MAX);

  // Counts one more occurrence of `key`; returns true when it is new.
  bool Add(const Key& key);
  // Occurrences of `key` (0 if never added).
  uint64_t CountOf(const Key& key) const;
  uint64_t distinct() const { return distinct_; }
  // Bytes held by the table's arrays.
  size_t memory_bytes() const;

  // f(uint64_t count) once per distinct key, in no particular order.
  template <typename F>
  void ForEachCount(F f) const {
    if (zero_key_count_ > 0) f(zero_key_count_);
    for (size_t i = 0; i < keys_.size(); i++) {
      if (keys_[i] == Key{}) continue;
      uint64_t c = counts_[i];
      if (c == saturate_at_) c += overflow_.at(keys_[i]);
      f(c);
    }
  }

 private:
  size_t Slot(const Key& key) const;  // the key's slot, or the empty one to take
  void Grow();

  uint32_t saturate_at_;
  std::vector<Key> keys_;
  std::vector<uint32_t> counts_;
  size_t mask_ = 0;
  uint64_t used_ = 0;  // occupied slots
  uint64_t distinct_ = 0;
  uint64_t zero_key_count_ = 0;
  std::map<Key, uint64_t> overflow_;  // count - saturate_at_, for saturated slots
};

struct HistogramBucket {
  uint64_t min_count = 0;  // occurrences, inclusive range
  uint64_t max_count = 0;
  uint64_t distinct = 0;  // distinct contents occurring that often
  uint64_t blocks = 0;    // their occurrences (chunks)
};

struct Histogram {
  uint32_t block_size = 0;
  // Buckets 1, 2, 3-4, 5-8, ... up to the last non-empty one (empty ones
  // in between are listed too).
  std::vector<HistogramBucket> buckets;
  uint64_t max_count = 0;  // occurrences of the most duplicated content
};

// Bucket index of a count >= 1: 1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3, ...
size_t HistogramBucketIndex(uint64_t count);

Histogram BuildHistogram(const CountTable& table, uint32_t block_size);

// Figures for one block size. Byte figures are chunk counts times B.
struct SizeFigures {
  uint32_t block_size = 0;
  uint64_t chunks = 0;  // all chunks of all images, zero ones included
  uint64_t zero_chunks = 0;
  uint64_t nonzero_chunks = 0;
  uint64_t distinct = 0;               // distinct non-zero contents
  uint64_t linked_clone_distinct = 0;  // sum over offsets of distinct contents there

  uint64_t zero_bytes() const { return zero_chunks * block_size; }
  uint64_t nonzero_bytes() const { return nonzero_chunks * block_size; }
  uint64_t physical_bytes() const { return distinct * block_size; }
  uint64_t savings_bytes() const { return (nonzero_chunks - distinct) * block_size; }
  double savings_pct() const { return Percent(nonzero_chunks - distinct); }
  uint64_t linked_clone_physical_bytes() const { return linked_clone_distinct * block_size; }
  uint64_t linked_clone_savings_bytes() const {
    return (nonzero_chunks - linked_clone_distinct) * block_size;
  }
  double linked_clone_savings_pct() const {
    return Percent(nonzero_chunks - linked_clone_distinct);
  }

 private:
  double Percent(uint64_t saved_chunks) const {
    return nonzero_chunks == 0
               ? 0.0
               : 100.0 * static_cast<double>(saved_chunks) / static_cast<double>(nonzero_chunks);
  }
};

// Streams images through the counters. Windows are fed in order from
// offset 0; a window holds the bytes of every image at the same offset.
class Analyzer {
 public:
  static constexpr size_t kDefaultWindowBytes = 4 << 20;

  // window_bytes: a positive multiple of kMaxBlock.
  explicit Analyzer(size_t images, size_t window_bytes = kDefaultWindowBytes);
  Analyzer(const Analyzer&) = delete;
  Analyzer& operator=(const Analyzer&) = delete;

  size_t window_bytes() const { return window_bytes_; }

  // Feeds one window, piece by piece: AddSlice(i, bytes) gives image i's
  // bytes at the window's offset, window_bytes() long, or shorter where
  // image i ends; EndWindow() counts the window. An image given no slice
  // in a window (or a short one) has ended: it must get no more bytes.
  // Throws std::invalid_argument on misuse. Only the fingerprints are kept,
  // so one read buffer serves every image.
  void AddSlice(size_t image, std::span<const uint8_t> bytes);
  void EndWindow();
  // The same in one call: slices[i] for image i.
  void AddWindow(std::span<const std::span<const uint8_t>> slices);

  // One entry per kBlockSizes, in that order.
  std::vector<SizeFigures> Figures() const;
  Histogram BuildHistogramAt(size_t size_index) const;
  size_t table_memory_bytes() const;

 private:
  struct PerSize {
    SizeFigures figures;
    CountTable table;
  };

  void FingerprintImage(size_t image, std::span<const uint8_t> slice);
  void CountSize(size_t size_index);

  size_t images_;
  size_t window_bytes_;
  size_t blocks_per_window_;
  std::vector<bool> ended_;
  std::vector<bool> fed_;  // got its slice in the current window
  // Per window, image-major: image i's 4 KiB fingerprints at
  // [i * blocks_per_window_, (i + 1) * blocks_per_window_); past the
  // image's end in a window it got a slice of, the zero block's (padding).
  // An image with no slice has block_count_ 0 and its entries are unused.
  std::vector<Key> block_keys_;
  std::vector<uint8_t> block_zero_;  // 1 if that 4 KiB block is all zeros
  std::vector<size_t> block_count_;  // per image: 4 KiB blocks in this window
  std::vector<Key> offset_keys_;     // linked clones: one chunk offset, every image
  std::array<PerSize, kBlockSizes.size()> sizes_;
};

}  // namespace dede::analyze
