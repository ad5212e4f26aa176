// Whether the test binary runs under AddressSanitizer (scripts/test's
// second build), where heavy loops run several times slower: tests that
// repeat an operation for statistical reach scale down with it.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define DEDE_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DEDE_TEST_SANITIZED 1
#endif
#endif
#ifndef DEDE_TEST_SANITIZED
#define DEDE_TEST_SANITIZED 0
#endif

namespace dede::test {
inline constexpr bool kSanitized = DEDE_TEST_SANITIZED != 0;
}  // namespace dede::test
