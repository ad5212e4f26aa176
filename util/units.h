// Parsing of sizes and counts typed by people (command lines, config files).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dede {

// "4096", "20M", "1.5G", "64MiB", "2t": binary multiples (K = 1024). The
// result must be a whole number of bytes and fit in 63 bits.
std::optional<uint64_t> ParseSize(const std::string& text);
// What ParseSize takes, for error messages.
inline constexpr char kSizeSyntax[] =
    "a whole number of bytes below 2^63, with an optional binary suffix K, M, G, T or P "
    "(KiB, KB and lower case too), as in 20G or 1.5T";
// Decimal unsigned integer without sign or suffix.
std::optional<uint64_t> ParseUnsigned(const std::string& text);

}  // namespace dede
