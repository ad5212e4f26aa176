// Seeds and lengths of the randomized tests, from the environment.
//
// Every randomized test (model, crash and fault tests) runs a fixed list of
// seeds in the suite, so a failure reproduces, and takes its seed from
// DEDE_SEED when it is set, so `scripts/soak` can run them over any range
// of seeds and a failing seed can be replayed alone. Such a test carries
// the Catch tag [seeded] and prints its seed on failure
// ("reproduce with DEDE_SEED=<n>").
#pragma once

#include <cstdint>
#include <cstdlib>
#include <vector>

namespace dede::test {

// DEDE_SEED if set (one seed), else `defaults`.
inline std::vector<uint64_t> SeedsFromEnv(std::vector<uint64_t> defaults) {
  const char* s = std::getenv("DEDE_SEED");
  if (s != nullptr && *s != '\0') return {std::strtoull(s, nullptr, 0)};
  return defaults;
}

// The variable `name` (DEDE_STEPS, DEDE_TRIALS) if set, else `def`.
inline uint64_t CountFromEnv(const char* name, uint64_t def) {
  const char* s = std::getenv(name);
  if (s != nullptr && *s != '\0') return std::strtoull(s, nullptr, 0);
  return def;
}

}  // namespace dede::test
