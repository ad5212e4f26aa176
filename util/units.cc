#include "util/units.h"

#include <cctype>

namespace dede {

std::optional<uint64_t> ParseUnsigned(const std::string& text) {
  if (text.empty() || text.size() > 19) return std::nullopt;
  uint64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

std::optional<uint64_t> ParseSize(const std::string& text) {
  size_t i = 0;
  unsigned __int128 mantissa = 0;
  unsigned __int128 scale = 1;
  size_t digits = 0;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; i++, digits++) {
    mantissa = mantissa * 10 + static_cast<unsigned>(text[i] - '0');
    if (digits > 20) return std::nullopt;
  }
  if (i < text.size() && text[i] == '.') {
    i++;
    size_t frac = 0;
    for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; i++, frac++, digits++) {
      mantissa = mantissa * 10 + static_cast<unsigned>(text[i] - '0');
      scale *= 10;
      if (digits > 20) return std::nullopt;
    }
    if (frac == 0) return std::nullopt;
  }
  if (digits == 0) return std::nullopt;
  std::string suffix = text.substr(i);
  for (char& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  unsigned shift = 0;
  if (!suffix.empty() && suffix != "B") {
    const std::string kUnits = "KMGTP";
    size_t unit = kUnits.find(suffix[0]);
    if (unit == std::string::npos) return std::nullopt;
    std::string rest = suffix.substr(1);
    if (!rest.empty() && rest != "B" && rest != "IB") return std::nullopt;
    shift = 10 * static_cast<unsigned>(unit + 1);
  }
  unsigned __int128 bytes = mantissa << shift;
  if (bytes % scale != 0) return std::nullopt;  // not a whole number of bytes
  bytes /= scale;
  if (bytes > static_cast<unsigned __int128>(INT64_MAX)) return std::nullopt;
  return static_cast<uint64_t>(bytes);
}

}  // namespace dede
