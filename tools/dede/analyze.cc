#include "tools/dede/analyze.h"

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <stdexcept>
#include <string>

#include "util/bytes.h"

namespace dede::analyze {
namespace {

constexpr size_t kInitialSlots = 1024;  // a power of two

Key FromXxh(XXH128_hash_t h) {
  return Key{h.low64, h.high64};
}

}  // namespace

Key HashBlock(const void* data, size_t len) {
  return FromXxh(XXH3_128bits(data, len));
}

const Key& ZeroBlockKey() {
  static const Key key = [] {
    std::vector<uint8_t> zeros(kBaseBlock, 0);
    return HashBlock(zeros.data(), zeros.size());
  }();
  return key;
}

// ---------------------------------------------------------------- CountTable

CountTable::CountTable(uint32_t saturate_at)
    : saturate_at_(std::max<uint32_t>(saturate_at, 1)),
      keys_(kInitialSlots),
      counts_(kInitialSlots, 0),
      mask_(kInitialSlots - 1) {}

size_t CountTable::Slot(const Key& key) const {
  // Fingerprints are uniformly distributed already: the low word indexes.
  size_t i = static_cast<size_t>(key.lo) & mask_;
  while (!(keys_[i] == key) && !(keys_[i] == Key{})) i = (i + 1) & mask_;
  return i;
}

bool CountTable::Add(const Key& key) {
  if (key == Key{}) {
    distinct_ += zero_key_count_ == 0 ? 1 : 0;
    zero_key_count_++;
    return zero_key_count_ == 1;
  }
  size_t i = Slot(key);
  if (keys_[i] == key) {
    if (counts_[i] == saturate_at_) {
      overflow_[key]++;
    } else {
      counts_[i]++;
      if (counts_[i] == saturate_at_) overflow_[key] = 0;
    }
    return false;
  }
  keys_[i] = key;
  counts_[i] = 1;
  if (saturate_at_ == 1) overflow_[key] = 0;
  used_++;
  distinct_++;
  if (used_ * 4 > keys_.size() * 3) Grow();
  return true;
}

uint64_t CountTable::CountOf(const Key& key) const {
  if (key == Key{}) return zero_key_count_;
  size_t i = Slot(key);
  if (!(keys_[i] == key)) return 0;
  uint64_t c = counts_[i];
  if (c == saturate_at_) c += overflow_.at(key);
  return c;
}

void CountTable::Grow() {
  std::vector<Key> old_keys(keys_.size() * 2);
  std::vector<uint32_t> old_counts(counts_.size() * 2, 0);
  old_keys.swap(keys_);
  old_counts.swap(counts_);
  mask_ = keys_.size() - 1;
  for (size_t j = 0; j < old_keys.size(); j++) {
    if (old_keys[j] == Key{}) continue;
    size_t i = Slot(old_keys[j]);
    keys_[i] = old_keys[j];
    counts_[i] = old_counts[j];
  }
}

size_t CountTable::memory_bytes() const {
  return keys_.capacity() * sizeof(Key) + counts_.capacity() * sizeof(uint32_t) +
         overflow_.size() * (sizeof(Key) + sizeof(uint64_t) + 32);
}

// ---------------------------------------------------------------- histogram

size_t HistogramBucketIndex(uint64_t count) {
  return count <= 1 ? 0 : static_cast<size_t>(std::bit_width(count - 1));
}

Histogram BuildHistogram(const CountTable& table, uint32_t block_size) {
  Histogram h;
  h.block_size = block_size;
  table.ForEachCount([&](uint64_t count) {
    const size_t b = HistogramBucketIndex(count);
    if (h.buckets.size() <= b) h.buckets.resize(b + 1);
    h.buckets[b].distinct++;
    h.buckets[b].blocks += count;
    h.max_count = std::max(h.max_count, count);
  });
  for (size_t b = 0; b < h.buckets.size(); b++) {
    h.buckets[b].min_count = b == 0 ? 1 : (uint64_t{1} << (b - 1)) + 1;
    h.buckets[b].max_count = uint64_t{1} << b;
  }
  return h;
}

// ---------------------------------------------------------------- Analyzer

Analyzer::Analyzer(size_t images, size_t window_bytes)
    : images_(images),
      window_bytes_(window_bytes),
      blocks_per_window_(window_bytes / kBaseBlock),
      ended_(images, false),
      fed_(images, false),
      block_keys_(images * blocks_per_window_),
      block_zero_(images * blocks_per_window_),
      block_count_(images, 0),
      offset_keys_(images) {
  if (window_bytes == 0 || window_bytes % kMaxBlock != 0) {
    throw std::invalid_argument("analyze window must be a positive multiple of 1 MiB");
  }
  for (size_t s = 0; s < kBlockSizes.size(); s++) sizes_[s].figures.block_size = kBlockSizes[s];
}

void Analyzer::FingerprintImage(size_t image, std::span<const uint8_t> slice) {
  Key* keys = block_keys_.data() + image * blocks_per_window_;
  uint8_t* zero = block_zero_.data() + image * blocks_per_window_;
  const size_t full = slice.size() / kBaseBlock;
  const size_t blocks = (slice.size() + kBaseBlock - 1) / kBaseBlock;
  for (size_t b = 0; b < full; b++) {
    const uint8_t* p = slice.data() + b * kBaseBlock;
    zero[b] = IsAllZero(p, kBaseBlock) ? 1 : 0;
    keys[b] = zero[b] ? ZeroBlockKey() : HashBlock(p, kBaseBlock);
  }
  if (blocks > full) {  // partial tail block, padded with zeros
    uint8_t padded[kBaseBlock] = {};
    std::memcpy(padded, slice.data() + full * kBaseBlock, slice.size() - full * kBaseBlock);
    zero[full] = IsAllZero(padded, kBaseBlock) ? 1 : 0;
    keys[full] = zero[full] ? ZeroBlockKey() : HashBlock(padded, kBaseBlock);
  }
  // Past the end: zero padding of the last chunk at every size.
  std::fill(keys + blocks, keys + blocks_per_window_, ZeroBlockKey());
  std::fill(zero + blocks, zero + blocks_per_window_, uint8_t{1});
  block_count_[image] = blocks;
}

void Analyzer::CountSize(size_t size_index) {
  PerSize& ps = sizes_[size_index];
  SizeFigures& fig = ps.figures;
  const size_t per_chunk = fig.block_size / kBaseBlock;  // 4 KiB blocks per chunk
  const size_t chunks_per_window = blocks_per_window_ / per_chunk;
  for (size_t c = 0; c < chunks_per_window; c++) {
    size_t present = 0;  // non-zero chunks at this offset
    for (size_t i = 0; i < images_; i++) {
      const size_t first = c * per_chunk;
      if (first >= block_count_[i]) continue;  // image i ends before this chunk
      fig.chunks++;
      const size_t base = i * blocks_per_window_ + first;
      const uint8_t* zero = block_zero_.data() + base;
      if (std::all_of(zero, zero + per_chunk, [](uint8_t z) { return z != 0; })) {
        fig.zero_chunks++;
        continue;
      }
      fig.nonzero_chunks++;
      const Key key = per_chunk == 1
                          ? block_keys_[base]
                          : FromXxh(XXH3_128bits_withSeed(block_keys_.data() + base,
                                                          per_chunk * sizeof(Key), fig.block_size));
      ps.table.Add(key);
      offset_keys_[present++] = key;
    }
    // Linked clones: the distinct non-zero contents at this offset.
    if (present <= 1) {
      fig.linked_clone_distinct += present;
    } else {
      std::sort(offset_keys_.begin(), offset_keys_.begin() + static_cast<ptrdiff_t>(present));
      fig.linked_clone_distinct += static_cast<uint64_t>(
          std::unique(offset_keys_.begin(),
                      offset_keys_.begin() + static_cast<ptrdiff_t>(present)) -
          offset_keys_.begin());
    }
  }
  fig.distinct = ps.table.distinct();
}

void Analyzer::AddSlice(size_t image, std::span<const uint8_t> bytes) {
  if (image >= images_) {
    throw std::invalid_argument("analyze: no image " + std::to_string(image));
  }
  if (fed_[image] || bytes.size() > window_bytes_ || (ended_[image] && !bytes.empty())) {
    throw std::invalid_argument("analyze: slice of image " + std::to_string(image) +
                                " given twice, longer than the window, or past its end");
  }
  FingerprintImage(image, bytes);
  fed_[image] = true;
  if (bytes.size() < window_bytes_) ended_[image] = true;
}

void Analyzer::EndWindow() {
  for (size_t i = 0; i < images_; i++) {
    if (!fed_[i]) block_count_[i] = 0;  // ended before this window
    ended_[i] = ended_[i] || !fed_[i];
    fed_[i] = false;
  }
  for (size_t s = 0; s < kBlockSizes.size(); s++) CountSize(s);
}

void Analyzer::AddWindow(std::span<const std::span<const uint8_t>> slices) {
  if (slices.size() != images_) {
    throw std::invalid_argument("analyze: " + std::to_string(slices.size()) + " slices for " +
                                std::to_string(images_) + " images");
  }
  for (size_t i = 0; i < images_; i++) AddSlice(i, slices[i]);
  EndWindow();
}

std::vector<SizeFigures> Analyzer::Figures() const {
  std::vector<SizeFigures> out;
  for (const PerSize& ps : sizes_) out.push_back(ps.figures);
  return out;
}

Histogram Analyzer::BuildHistogramAt(size_t size_index) const {
  return BuildHistogram(sizes_.at(size_index).table, kBlockSizes.at(size_index));
}

size_t Analyzer::table_memory_bytes() const {
  size_t n = 0;
  for (const PerSize& ps : sizes_) n += ps.table.memory_bytes();
  return n;
}

}  // namespace dede::analyze
