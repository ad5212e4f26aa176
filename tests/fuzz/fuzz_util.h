// Shared helpers for the libFuzzer targets of the on-disk parsers.
//
// Every target feeds its input to the decoders as one 4 KiB block in a heap
// buffer of exactly kBlockSize bytes (shorter input is zero-padded, longer
// input truncated), so AddressSanitizer catches any read past the block.
// Decoders take no length: a block is always 4 KiB, so that is the only
// size worth testing.
//
// Random bytes almost never pass the crc, so each target also decodes a
// "fixed-up" copy: the structure's magic stamped in and the crc recomputed,
// which lets the fuzzer explore the field checks behind the crc.
//
// Seeds: started with DEDE_FUZZ_WRITE_SEEDS=DIR, a target writes its seed
// blocks (valid encodings, trailing zero bytes trimmed: the padding restores
// them) to DIR and exits. tests/fuzz/corpus/<target>/ holds their output.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "util/coding.h"
#include "volume/format.h"

namespace dede::fuzz {

inline constexpr Uuid kFuzzUuid = {0xde, 0xde, 0x00, 0x01, 0x02, 0x03, 0x44, 0x05,
                                   0x86, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d};

// A 4 KiB block in its own heap allocation.
class Blk {
 public:
  Blk() : p_(new uint8_t[kBlockSize]) { std::memset(p_.get(), 0, kBlockSize); }
  Blk(const uint8_t* data, size_t size) : Blk() {
    std::memcpy(p_.get(), data, size < kBlockSize ? size : kBlockSize);
  }
  Blk(const Blk& o) : Blk() { std::memcpy(p_.get(), o.p_.get(), kBlockSize); }
  Blk& operator=(const Blk&) = delete;
  uint8_t* data() { return p_.get(); }
  const uint8_t* data() const { return p_.get(); }
  bool operator==(const Blk& o) const { return std::memcmp(p_.get(), o.p_.get(), kBlockSize) == 0; }

 private:
  std::unique_ptr<uint8_t[]> p_;
};

[[noreturn]] inline void Fail(const char* target, const std::string& what) {
  std::fprintf(stderr, "%s: property violated: %s\n", target, what.c_str());
  std::abort();
}

// Aborts (a crash libFuzzer reports) when `cond` is false.
#define FUZZ_CHECK(cond, what)                      \
  do {                                              \
    if (!(cond)) ::dede::fuzz::Fail(kTarget, what); \
  } while (0)

// Stamps `magic` (and, if `fix_version`, the current major) into the
// header and recomputes the crc for the address the header names.
inline void FixUp(uint8_t* blk, uint32_t magic, bool fix_version, const Uuid& uuid) {
  BlockHeader h = PeekHeader(blk);
  h.magic = magic;
  if (fix_version) h.major = kFormatMajor;
  SealBlock(blk, h, uuid);
}

// A decoder must fail cleanly: an error status with a message.
inline bool FailedCleanly(const Status& s) {
  return !s.ok() && !s.message().empty() && s.code() != Status::Code::kOk;
}

// Writes the seeds if DEDE_FUZZ_WRITE_SEEDS is set, then exits.
inline void MaybeWriteSeeds(const char* target, const std::vector<Blk>& seeds) {
  const char* dir = std::getenv("DEDE_FUZZ_WRITE_SEEDS");
  if (dir == nullptr || *dir == '\0') return;
  for (size_t i = 0; i < seeds.size(); i++) {
    size_t len = kBlockSize;
    while (len > 0 && seeds[i].data()[len - 1] == 0) len--;
    std::string path = std::string(dir) + "/seed-" + std::to_string(i);
    FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr || std::fwrite(seeds[i].data(), 1, len, f) != len || std::fclose(f) != 0) {
      std::fprintf(stderr, "%s: cannot write %s\n", target, path.c_str());
      std::exit(1);
    }
  }
  std::fprintf(stderr, "%s: wrote %zu seeds to %s\n", target, seeds.size(), dir);
  std::exit(0);
}

}  // namespace dede::fuzz
