// Property test of the volume against an in-memory model.
//
// Thousands of seeded random operations (create, write in every shape,
// trim, clone_block, compare_and_share, punch, truncate, rm, reopen, sync,
// set dedup, invalid calls, and a switch between two hosts: two Volume
// instances on one device whose lock managers exclude each other, each
// seeing what the other left behind) run against the volume and a model that
// keeps every file's bytes and which file positions share one physical
// block. The API hides physical addresses, so sharing is tracked as
// equivalence classes of positions: clone/share moves the destination into
// the source's class; a write to a shared block (COW), punch, trim or
// truncate moves a position out. Clone and share work on whole blocks
// only (a partial last block is kInvalid). After every step the test checks
//   * the bytes of the touched file ranges,
//   * File::BlockRefCount of every touched position and of every member of
//     every class that changed (== class size; 0 for holes),
//   * File::Info (size, mapped_blocks, dedup),
//   * Volume::Stats: used == distinct data blocks + pointer blocks,
//     free == data - used, shared, logical, files;
// every 50 steps everything (all bytes, all refcounts, Usage); every 500
// steps and at the end CheckVolume must report a clean volume.
//
// Reproduce one seed with DEDE_SEED=<n> (DEDE_STEPS=<n> changes the step
// count). The failing seed, step and operation are printed on failure.
#include "tests/sanitized.h"
#include "tests/seeds.h"
#include "tests/volume_model_harness.h"

using namespace dede;

// Sanitizer builds run two seeds instead of three: every step calls
// Volume::Stats, which reads the whole used inode table, and that is slow
// under ASan.
#if DEDE_TEST_SANITIZED
const std::vector<uint64_t> kModelSeeds = {1, 2};
#else
const std::vector<uint64_t> kModelSeeds = {1, 2, 3};
#endif

TEST_CASE("volume model: random operations match the model", "[property][volume][seeded]") {
  uint64_t seed = GENERATE(from_range(dede::test::SeedsFromEnv(kModelSeeds)));
  uint64_t steps = dede::test::CountFromEnv("DEDE_STEPS", 3000);
  INFO("seed " << seed << " (reproduce with DEDE_SEED=" << seed << ")");
  ModelHarness h(seed);
  h.Run(steps);
}

// Regression: clone_block into a file's partial last block once shared the
// whole source block, bytes past the destination's EOF included, and a
// later extension exposed them. Clone and share now refuse partial blocks
// (kInvalid); whatever the volume does, an extension must read zeros.
TEST_CASE("volume model: extending a file after clone_block into its last block reads zeros",
          "[property][volume]") {
  MemDevice dev(64 << 20);
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  OpenOptions oo;
  oo.locks = dede::test::TempLocks();
  auto v = Volume::Open(&dev, oo);
  REQUIRE(v.ok());
  Volume* vol = v.value().get();
  REQUIRE(vol->Create("src", 2 * kB).ok());
  REQUIRE(vol->Create("dst", 5000).ok());  // block 1 holds bytes 4096..4999
  auto src = std::move(vol->OpenFile("src").value());
  auto dst = std::move(vol->OpenFile("dst").value());
  std::vector<uint8_t> x(kB, 0x5A);
  REQUIRE(src->Write(0, x.data(), kB).ok());
  Status st = vol->CloneBlock(src.get(), 0, dst.get(), 1);
  INFO("clone into the partial block: " << (st.ok() ? std::string("OK") : st.ToString()));
  REQUIRE((st.ok() || st.code() == Status::Code::kInvalid));
  // The same for a share of equal content and for the partial block as a
  // source.
  Status cs = vol->CompareAndShare(src.get(), 0, dst.get(), 1, VerifyMode::kByteCompare);
  REQUIRE((cs.ok() || cs.code() == Status::Code::kInvalid || cs.code() == Status::Code::kMismatch));
  REQUIRE(dst->Write(kB, x.data(), 5000 - kB).ok());
  Status out = vol->CloneBlock(dst.get(), 1, src.get(), 1);
  REQUIRE((out.ok() || out.code() == Status::Code::kInvalid));
  REQUIRE(dst->Truncate(2 * kB).ok());
  std::vector<uint8_t> ext(2 * kB - 5000);
  REQUIRE(dst->Read(5000, ext.data(), ext.size()).ok());
  INFO("byte 5000 after the extension: " << int(ext[0]) << " (the source's byte is 0x5A = 90)");
  bool extension_is_zero = ext == std::vector<uint8_t>(ext.size(), 0);
  CHECK(extension_is_zero);
  std::vector<uint8_t> s1(kB);
  REQUIRE(src->Read(kB, s1.data(), kB).ok());
  if (out.ok()) {
    // src's block 1 is dst's old partial block: its last bytes are zeros.
    bool tail_zero = std::all_of(s1.begin() + (5000 - kB), s1.end(), [](uint8_t c) { return c == 0; });
    CHECK(tail_zero);
  }
}
