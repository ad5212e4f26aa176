// Block fingerprints: XXH3-128 (default) or SHA-256 (needed wherever a hash
// is trusted as a witness of content instead of a byte comparison).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace dede {

// On-disk values (superblock field hash_algo): never renumber.
enum class HashAlgo : uint32_t { kXxh128 = 1, kSha256 = 2 };

std::optional<HashAlgo> ParseHashAlgo(const std::string& s);
const char* HashAlgoName(HashAlgo a);
size_t HashAlgoSize(HashAlgo a);

struct Fingerprint {
  std::array<uint8_t, 32> bytes{};
  uint8_t size = 0;
  bool operator==(const Fingerprint& o) const { return size == o.size && bytes == o.bytes; }
  bool operator<(const Fingerprint& o) const { return bytes < o.bytes; }
  std::string Hex() const;
};

Fingerprint ComputeFingerprint(HashAlgo algo, const void* data, size_t len);

}  // namespace dede
