// util/fingerprint.h: known answers for both algorithms, and the helpers.
#include "util/fingerprint.h"

#include <xxhash.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

using namespace dede;

TEST_CASE("fingerprint: SHA-256 known answers", "[fingerprint]") {
  std::vector<uint8_t> zeros(4096, 0);
  Fingerprint f = ComputeFingerprint(HashAlgo::kSha256, zeros.data(), zeros.size());
  CHECK(f.size == 32);
  CHECK(f.Hex() == "ad7facb2586fc6e966c004d7d1d16b024f5805ff7cb47c7a85dabd8b48892ca7");
  Fingerprint abc = ComputeFingerprint(HashAlgo::kSha256, "abc", 3);
  REQUIRE(abc.Hex() == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST_CASE("fingerprint: XXH3-128 known answers, canonical byte order", "[fingerprint]") {
  // Published XXH3-128 (seed 0) vectors, printed high half first.
  Fingerprint empty = ComputeFingerprint(HashAlgo::kXxh128, "", 0);
  CHECK(empty.size == 16);
  CHECK(empty.Hex() == "99aa06d3014798d86001c324468d497f");
  Fingerprint abc = ComputeFingerprint(HashAlgo::kXxh128, "abc", 3);
  REQUIRE(abc.Hex() == "06b05ab6733a618578af5f94892f3950");
}

TEST_CASE("fingerprint: XXH3-128 agrees with the library's plain entry point at every size",
          "[fingerprint]") {
  // ComputeFingerprint calls libxxhash's run-time dispatching entry point
  // (AVX2 where the CPU has it); volumes written before that change, and
  // hosts without AVX2, use the plain one. They must agree byte for byte
  // across every code path of the hash: short inputs, the mid sizes, and
  // the long-input loop that 4 KiB blocks take (stripes, a partial last
  // stripe, several blocks of stripes).
  std::vector<uint8_t> buf(3 * 4096 + 17);
  for (size_t i = 0; i < buf.size(); i++) buf[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  std::vector<size_t> sizes = {0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 1025,
                               4095, 4096, 4097, 8192, buf.size()};
  for (size_t len : sizes) {
    INFO("length " << len);
    const XXH128_hash_t h = XXH3_128bits(buf.data(), len);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, h);
    const Fingerprint f = ComputeFingerprint(HashAlgo::kXxh128, buf.data(), len);
    REQUIRE(f.size == 16);
    for (size_t i = 0; i < 16; i++) REQUIRE(f.bytes[i] == c.digest[i]);
  }
}

TEST_CASE("fingerprint: deterministic, and different data differ", "[fingerprint]") {
  for (HashAlgo algo : {HashAlgo::kXxh128, HashAlgo::kSha256}) {
    INFO(HashAlgoName(algo));
    std::vector<uint8_t> block(4096);
    for (size_t i = 0; i < block.size(); i++) block[i] = static_cast<uint8_t>(i * 7 + 1);
    Fingerprint a = ComputeFingerprint(algo, block.data(), block.size());
    Fingerprint b = ComputeFingerprint(algo, block.data(), block.size());
    CHECK(a == b);
    CHECK(!(a < b));
    CHECK(a.size == HashAlgoSize(algo));
    // Bytes past size stay zero, so == compares only the digest.
    for (size_t i = a.size; i < a.bytes.size(); i++) REQUIRE(a.bytes[i] == 0);

    // Every single-bit change gives a different fingerprint, and all differ
    // from each other.
    std::set<std::string> seen = {a.Hex()};
    for (size_t bit = 0; bit < 4096 * 8; bit += 61) {
      std::vector<uint8_t> c = block;
      c[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      Fingerprint f = ComputeFingerprint(algo, c.data(), c.size());
      REQUIRE(!(f == a));
      REQUIRE(seen.insert(f.Hex()).second);
    }
    // Length matters.
    REQUIRE(!(ComputeFingerprint(algo, block.data(), 4095) == a));
  }
  // Same bytes, different algorithm: different fingerprints.
  REQUIRE(!(ComputeFingerprint(HashAlgo::kXxh128, "x", 1) ==
            ComputeFingerprint(HashAlgo::kSha256, "x", 1)));
}

TEST_CASE("fingerprint: Hex, ordering and algorithm names", "[fingerprint]") {
  Fingerprint f;
  CHECK(f.Hex().empty());
  f.size = 4;
  f.bytes[0] = 0x00;
  f.bytes[1] = 0x01;
  f.bytes[2] = 0xab;
  f.bytes[3] = 0xff;
  f.bytes[4] = 0x99;  // beyond size: not printed
  CHECK(f.Hex() == "0001abff");

  Fingerprint lo, hi;
  lo.size = hi.size = 16;
  lo.bytes[0] = 0x01;
  hi.bytes[0] = 0x02;
  CHECK(lo < hi);
  CHECK(!(hi < lo));
  // Ordering is bytewise from the first byte (the canonical XXH3 order
  // sorts like the 128-bit number).
  lo.bytes[15] = 0xff;
  CHECK(lo < hi);

  CHECK(ParseHashAlgo("xxh128") == HashAlgo::kXxh128);
  CHECK(ParseHashAlgo("sha256") == HashAlgo::kSha256);
  CHECK(!ParseHashAlgo("md5").has_value());
  CHECK(!ParseHashAlgo("").has_value());
  CHECK(std::string(HashAlgoName(HashAlgo::kXxh128)) == "xxh128");
  CHECK(std::string(HashAlgoName(HashAlgo::kSha256)) == "sha256");
  CHECK(HashAlgoSize(HashAlgo::kXxh128) == 16);
  REQUIRE(HashAlgoSize(HashAlgo::kSha256) == 32);
}
