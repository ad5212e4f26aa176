// Test helper: pseudo-random test data, the same bytes the tests' own
// loops made (each 8 bytes one output of the engine, stored in host
// order, the last output cut to what is left), from one function built
// with optimisation. The test code is built at -O0 (tests/CMakeLists.txt),
// where a byte-filling loop over std::mt19937_64 was most of some tests'
// time under ASan (a write monitor test: 32 s against 7 s at -O2).
#pragma once

#include <cstddef>
#include <random>

namespace dede::test {

// Fills dst[0, n) with the next ceil(n / 8) outputs of `rng`.
void FillRandom(std::mt19937_64& rng, void* dst, size_t n);

}  // namespace dede::test
