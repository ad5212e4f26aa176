#include "volume/scsi_identity.h"

#include <algorithm>

namespace dede {

namespace {

std::string TrimBlanks(std::string s) {
  // Serial numbers are ASCII, often padded with spaces (or NULs) to a
  // fixed width on either side.
  auto blank = [](char c) { return c == ' ' || c == '\0'; };
  while (!s.empty() && blank(s.back())) s.pop_back();
  size_t first = 0;
  while (first < s.size() && blank(s[first])) first++;
  return s.substr(first);
}

// A VPD page's header: byte 1 the page code, bytes 2..3 the length of what
// follows. A target may send less than the page (the allocation length
// cut it): only what arrived is read.
Result<size_t> VpdPageEnd(const uint8_t* data, size_t len, uint8_t page, const char* what) {
  if (len < 4 || data[1] != page) {
    return Status::IoError(std::string("malformed ") + what + ": not VPD page " +
                           (page == 0x80 ? "80h" : "83h"));
  }
  const size_t page_len = (size_t{data[2]} << 8) | data[3];
  return std::min(len, 4 + page_len);
}

}  // namespace

Result<std::string> ParseUnitSerialNumberPage(const uint8_t* data, size_t len) {
  ASSIGN_OR_RETURN(const size_t end, VpdPageEnd(data, len, 0x80, "unit serial number page"));
  return TrimBlanks(std::string(reinterpret_cast<const char*>(data) + 4, end - 4));
}

Result<std::vector<Designator>> ParseLogicalUnitDesignators(const uint8_t* data, size_t len) {
  ASSIGN_OR_RETURN(const size_t end, VpdPageEnd(data, len, 0x83, "device identification page"));
  std::vector<Designator> out;
  for (size_t at = 4; at < end;) {
    // Descriptor: byte 0 protocol id (high nibble) and code set, byte 1
    // PIV, association (bits 5..4) and designator type, byte 3 length.
    if (end - at < 4) {
      return Status::IoError("malformed device identification page: a descriptor header at byte " +
                             std::to_string(at) + " runs past the page");
    }
    const size_t n = data[at + 3];
    if (end - at - 4 < n) {
      return Status::IoError("malformed device identification page: the descriptor at byte " +
                             std::to_string(at) + " runs past the page");
    }
    const uint8_t association = (data[at + 1] >> 4) & 0x3;
    if (association == 0) {
      Designator d;
      d.push_back(data[at] & 0x0f);      // code set
      d.push_back(data[at + 1] & 0x0f);  // designator type
      d.insert(d.end(), data + at + 4, data + at + 4 + n);
      out.push_back(std::move(d));
    }
    at += 4 + n;
  }
  std::sort(out.begin(), out.end());
  return out;
}

Result<bool> ParseModeSense6WriteProtect(const uint8_t* data, size_t len) {
  if (len < 4) {
    return Status::IoError("malformed MODE SENSE(6) data: " + std::to_string(len) +
                           " bytes, the header alone is 4");
  }
  return (data[2] & 0x80) != 0;
}

std::string DescribeIdentityChange(const LuIdentity& was, const LuIdentity& now) {
  if (now.block_size != was.block_size) {
    return "its logical block size was " + std::to_string(was.block_size) + " bytes, now " +
           std::to_string(now.block_size);
  }
  if (now.blocks < was.blocks) {
    return "its capacity shrank from " + std::to_string(was.blocks) + " to " +
           std::to_string(now.blocks) + " blocks";
  }
  if (!was.serial.empty() && now.serial != was.serial) {
    return "its serial number was '" + was.serial + "', now '" + now.serial + "'";
  }
  if (!was.designators.empty() && now.designators != was.designators) {
    return "its device identification (VPD page 83h) changed";
  }
  return "";
}

}  // namespace dede
