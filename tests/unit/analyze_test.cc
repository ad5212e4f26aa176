// tools/dede/analyze.h: the count table, the histogram buckets, and the
// analyzer's figures against a byte-by-byte reference (chunk contents as
// strings) on generated images with known sharing.
#include "tools/dede/analyze.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/random_bytes.h"

using namespace dede::analyze;

namespace {

Key RandomKey(std::mt19937_64& rng) {
  return Key{rng(), rng()};
}

// The figures computed the slow, obvious way: chunk bytes (zero-padded to
// B) compared as strings.
struct Reference {
  SizeFigures figures;
  std::map<std::string, uint64_t> counts;
};

Reference ReferenceFigures(const std::vector<std::string>& images, uint32_t b) {
  Reference r;
  r.figures.block_size = b;
  size_t max_chunks = 0;
  std::vector<std::vector<std::string>> chunks(images.size());
  for (size_t i = 0; i < images.size(); i++) {
    for (size_t off = 0; off < images[i].size(); off += b) {
      std::string c = images[i].substr(off, b);
      c.resize(b, '\0');
      chunks[i].push_back(c);
    }
    max_chunks = std::max(max_chunks, chunks[i].size());
  }
  const std::string zero(b, '\0');
  for (size_t k = 0; k < max_chunks; k++) {
    std::set<std::string> here;
    for (size_t i = 0; i < images.size(); i++) {
      if (k >= chunks[i].size()) continue;
      r.figures.chunks++;
      if (chunks[i][k] == zero) {
        r.figures.zero_chunks++;
        continue;
      }
      r.figures.nonzero_chunks++;
      r.counts[chunks[i][k]]++;
      here.insert(chunks[i][k]);
    }
    r.figures.linked_clone_distinct += here.size();
  }
  r.figures.distinct = r.counts.size();
  return r;
}

void Feed(Analyzer& a, const std::vector<std::string>& images) {
  size_t longest = 0;
  for (const auto& img : images) longest = std::max(longest, img.size());
  for (size_t pos = 0; pos < longest; pos += a.window_bytes()) {
    for (size_t i = 0; i < images.size(); i++) {
      if (pos >= images[i].size()) continue;
      const size_t len = std::min(a.window_bytes(), images[i].size() - pos);
      a.AddSlice(i, {reinterpret_cast<const uint8_t*>(images[i].data()) + pos, len});
    }
    a.EndWindow();
  }
}

std::string RandomBlock(std::mt19937_64& rng) {
  std::string s(kBaseBlock, '\0');
  dede::test::FillRandom(rng, s.data(), s.size());
  return s;
}

}  // namespace

TEST_CASE("analyze: count table counts, grows, keeps the all-zero key apart", "[analyze]") {
  std::mt19937_64 rng(1);
  CountTable table;
  std::map<Key, uint64_t> expect;
  std::vector<Key> keys;
  for (int i = 0; i < 20000; i++) keys.push_back(RandomKey(rng));
  keys.push_back(Key{});      // the empty-slot marker is a valid key too
  keys.push_back(Key{0, 1});  // keys sharing the low word collide in the index
  keys.push_back(Key{5, 1});
  keys.push_back(Key{5, 2});
  for (int round = 0; round < 100000; round++) {
    // Skewed: low indexes come back often.
    const size_t i = std::min<size_t>(rng() % keys.size(), rng() % keys.size());
    const bool fresh = expect[keys[i]]++ == 0;
    CHECK(table.Add(keys[i]) == fresh);
  }
  CHECK(table.distinct() == expect.size());
  for (const auto& [k, n] : expect) REQUIRE(table.CountOf(k) == n);
  CHECK(table.CountOf(RandomKey(rng)) == 0);
  std::multiset<uint64_t> want, got;
  for (const auto& [k, n] : expect) want.insert(n);
  table.ForEachCount([&](uint64_t n) { got.insert(n); });
  CHECK(got == want);
  CHECK(table.memory_bytes() >= expect.size() * 20);
  CHECK(table.memory_bytes() <= expect.size() * 20 * 4);
}

TEST_CASE("analyze: counts past the table's 32-bit field spill over exactly", "[analyze]") {
  CountTable table(/*saturate_at=*/3);  // as if 3 were 2^32 - 1
  const Key a{11, 1}, b{12, 2};
  for (int i = 0; i < 10; i++) table.Add(a);
  for (int i = 0; i < 3; i++) table.Add(b);
  for (int i = 0; i < 2000; i++) table.Add(Key{static_cast<uint64_t>(100 + i), 7});  // regrow
  CHECK(table.CountOf(a) == 10);
  CHECK(table.CountOf(b) == 3);
  uint64_t total = 0;
  table.ForEachCount([&](uint64_t n) { total += n; });
  CHECK(total == 10 + 3 + 2000);

  CountTable ones(1);
  ones.Add(a);
  ones.Add(b);
  ones.Add(b);
  CHECK(ones.CountOf(a) == 1);
  CHECK(ones.CountOf(b) == 2);
}

TEST_CASE("analyze: histogram buckets are 1, 2, 3-4, 5-8, ...", "[analyze]") {
  CHECK(HistogramBucketIndex(1) == 0);
  CHECK(HistogramBucketIndex(2) == 1);
  CHECK(HistogramBucketIndex(3) == 2);
  CHECK(HistogramBucketIndex(4) == 2);
  CHECK(HistogramBucketIndex(5) == 3);
  CHECK(HistogramBucketIndex(8) == 3);
  CHECK(HistogramBucketIndex(9) == 4);
  CHECK(HistogramBucketIndex(uint64_t{1} << 40) == 40);
  CHECK(HistogramBucketIndex((uint64_t{1} << 40) + 1) == 41);

  CountTable t;
  auto add = [&](uint64_t id, int n) {
    for (int i = 0; i < n; i++) t.Add(Key{id, id});
  };
  add(1, 1);
  add(2, 1);
  add(3, 4);
  add(4, 20);
  Histogram h = BuildHistogram(t, 4096);
  CHECK(h.block_size == 4096);
  CHECK(h.max_count == 20);
  REQUIRE(h.buckets.size() == 6);  // 1, 2, 3-4, 5-8, 9-16, 17-32
  const uint64_t want[6][4] = {{1, 1, 2, 2}, {2, 2, 0, 0},  {3, 4, 1, 4},
                               {5, 8, 0, 0}, {9, 16, 0, 0}, {17, 32, 1, 20}};
  for (size_t i = 0; i < 6; i++) {
    INFO("bucket " << i);
    CHECK(h.buckets[i].min_count == want[i][0]);
    CHECK(h.buckets[i].max_count == want[i][1]);
    CHECK(h.buckets[i].distinct == want[i][2]);
    CHECK(h.buckets[i].blocks == want[i][3]);
  }
  CHECK(BuildHistogram(CountTable(), 8192).buckets.empty());
}

TEST_CASE("analyze: figures match a byte-by-byte reference at every block size", "[analyze]") {
  const uint64_t seed = GENERATE(1, 2, 3, 4);
  std::mt19937_64 rng(seed);
  // A palette of 4 KiB blocks (index 0: zeros; 1: zeros but one byte), so
  // that chunks of every size repeat.
  std::vector<std::string> palette = {std::string(kBaseBlock, '\0'), std::string(kBaseBlock, '\0')};
  palette[1][kBaseBlock / 2] = 1;
  for (int i = 0; i < 12; i++) palette.push_back(RandomBlock(rng));
  // A base image of runs; the others diverge from it: overwritten blocks,
  // ranges copied to other (shifted) offsets, zeroed ranges, other lengths.
  const size_t base_blocks = 700 + rng() % 300;  // 2.7 .. 3.9 MiB
  std::string base;
  while (base.size() < base_blocks * kBaseBlock) {
    const std::string& blk = palette[rng() % 3 == 0 ? 0 : rng() % palette.size()];
    const size_t run = 1 + rng() % 40;
    for (size_t r = 0; r < run; r++) base += blk;
  }
  std::vector<std::string> images;
  const size_t n = 2 + seed % 3;
  for (size_t i = 0; i < n; i++) {
    std::string img = base;
    for (int m = 0; m < 30; m++) {
      const size_t at = (rng() % base_blocks) * kBaseBlock;
      img.replace(at, kBaseBlock, RandomBlock(rng));
    }
    for (int m = 0; m < 4; m++) {  // shifted copies, at 4K and 64K alignment
      const size_t unit = m % 2 == 0 ? kBaseBlock : 64 * 1024;
      const size_t len = (1 + rng() % 8) * unit;
      const size_t from = rng() % (img.size() / unit - 8) * unit;
      const size_t to = rng() % (img.size() / unit - 8) * unit;
      img.replace(to, len, base.substr(from, len));
    }
    const size_t z = rng() % (img.size() - 100000);
    std::fill(img.begin() + static_cast<ptrdiff_t>(z),
              img.begin() + static_cast<ptrdiff_t>(z) + 90000, '\0');
    img.resize(img.size() - rng() % (600 * 1024));  // mostly not a multiple of 4 KiB
    images.push_back(img);
  }
  images.push_back(images[0]);                // a full clone
  images.push_back(std::string(5000, '\0'));  // a small all-zero image
  images.push_back("");                       // an empty one

  Analyzer a(images.size(), 1 << 20);  // small windows: many of them
  Feed(a, images);
  const auto figures = a.Figures();
  REQUIRE(figures.size() == kBlockSizes.size());
  for (size_t s = 0; s < kBlockSizes.size(); s++) {
    const Reference ref = ReferenceFigures(images, kBlockSizes[s]);
    INFO("seed " << seed << " block size " << kBlockSizes[s]);
    const SizeFigures& f = figures[s];
    CHECK(f.block_size == kBlockSizes[s]);
    CHECK(f.chunks == ref.figures.chunks);
    CHECK(f.zero_chunks == ref.figures.zero_chunks);
    CHECK(f.nonzero_chunks == ref.figures.nonzero_chunks);
    CHECK(f.distinct == ref.figures.distinct);
    CHECK(f.linked_clone_distinct == ref.figures.linked_clone_distinct);
    CHECK(f.distinct <= f.linked_clone_distinct);
    CHECK(f.savings_pct() >= f.linked_clone_savings_pct());
    // Histogram against the reference counts.
    Histogram h = a.BuildHistogramAt(s);
    std::map<size_t, std::pair<uint64_t, uint64_t>> want;  // bucket -> distinct, blocks
    uint64_t max_count = 0;
    for (const auto& [content, count] : ref.counts) {
      auto& w = want[HistogramBucketIndex(count)];
      w.first++;
      w.second += count;
      max_count = std::max(max_count, count);
    }
    CHECK(h.max_count == max_count);
    for (size_t b = 0; b < h.buckets.size(); b++) {
      CHECK(h.buckets[b].distinct == want[b].first);
      CHECK(h.buckets[b].blocks == want[b].second);
    }
    CHECK(h.buckets.size() == (want.empty() ? 0 : want.rbegin()->first + 1));
  }
  // The images do exercise both kinds of sharing at 4K and 64K: copies at
  // the same offset (the clone) and shifted copies (exact dedup only).
  for (size_t s : {0, 3}) {
    INFO("block size " << kBlockSizes[s]);
    CHECK(figures[s].linked_clone_distinct < figures[s].nonzero_chunks);
    CHECK(figures[s].distinct < figures[s].linked_clone_distinct);
  }
  // The same images through the default (4 MiB) window give the same figures.
  Analyzer big(images.size());
  Feed(big, images);
  const auto again = big.Figures();
  for (size_t s = 0; s < kBlockSizes.size(); s++) {
    CHECK(again[s].distinct == figures[s].distinct);
    CHECK(again[s].linked_clone_distinct == figures[s].linked_clone_distinct);
    CHECK(again[s].zero_chunks == figures[s].zero_chunks);
  }
}

TEST_CASE("analyze: derived figures and misuse", "[analyze]") {
  SizeFigures f;
  f.block_size = 8192;
  f.nonzero_chunks = 8;
  f.distinct = 2;
  f.linked_clone_distinct = 6;
  f.zero_chunks = 3;
  CHECK(f.zero_bytes() == 3 * 8192);
  CHECK(f.physical_bytes() == 2 * 8192);
  CHECK(f.savings_bytes() == 6 * 8192);
  CHECK(f.savings_pct() == Approx(75.0));
  CHECK(f.linked_clone_savings_bytes() == 2 * 8192);
  CHECK(f.linked_clone_savings_pct() == Approx(25.0));
  CHECK(SizeFigures{}.savings_pct() == 0.0);

  CHECK_THROWS_AS(Analyzer(1, 4096), std::invalid_argument);
  CHECK_THROWS_AS(Analyzer(1, 0), std::invalid_argument);
  Analyzer a(2, 1 << 20);
  std::vector<uint8_t> data((1 << 20) + 1, 7);
  CHECK_THROWS_AS(a.AddSlice(0, {data.data(), data.size()}), std::invalid_argument);
  CHECK_THROWS_AS(a.AddSlice(2, {data.data(), 10}), std::invalid_argument);
  a.AddSlice(0, {data.data(), 100});  // image 0 ends in the first window
  CHECK_THROWS_AS(a.AddSlice(0, {data.data(), 100}), std::invalid_argument);
  a.EndWindow();  // image 1 got nothing: it is empty
  CHECK_THROWS_AS(a.AddSlice(0, {data.data(), 1}), std::invalid_argument);
  CHECK_THROWS_AS(a.AddSlice(1, {data.data(), 1}), std::invalid_argument);
  a.AddSlice(0, {});
  a.EndWindow();
  const auto figures = a.Figures();
  CHECK(figures[0].chunks == 1);
  CHECK(figures[0].nonzero_chunks == 1);
  CHECK(figures[5].chunks == 1);
  CHECK(figures[5].distinct == 1);
}
