// What tells one SCSI logical unit from another, as an initiator can learn
// it over any session: its geometry (READ CAPACITY), its unit serial number
// (VPD page 80h) and the designators the target gives the logical unit
// itself (VPD page 83h, association 00b: NAA, EUI-64, T10 vendor id...).
//
// The iSCSI device learns this at its first login and checks it again
// after every later login and every unit attention: a target reconfigured
// meanwhile (the LUN number given to another disk, the LU recreated on a
// smaller backing store) would otherwise take our WRITEs into a disk that
// is not the volume's, or answer READs with another disk's blocks.
//
// Pure functions over the bytes a target sent, kept apart from the device
// so that every case is testable (tgtd can be made to show only some).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "util/status.h"

namespace dede {

using Designator = std::vector<uint8_t>;

struct LuIdentity {
  uint32_t block_size = 0;
  uint64_t blocks = 0;
  // VPD 80h's PRODUCT SERIAL NUMBER, blanks trimmed at both ends; empty
  // when the target has no such page.
  std::string serial;
  // VPD 83h's designation descriptors with association 00b (the logical
  // unit, not the port or target), each as its code set, type and bytes;
  // sorted, so the order a target lists them in does not matter.
  std::vector<Designator> designators;
};

// VPD page 80h (unit serial number). kIoError (malformed answer) for a page that is not
// 80h or whose length runs past `len`.
Result<std::string> ParseUnitSerialNumberPage(const uint8_t* data, size_t len);

// VPD page 83h (device identification): the logical unit's designators.
// kIoError for a page that is not 83h, or a descriptor whose length runs
// past the page.
Result<std::vector<Designator>> ParseLogicalUnitDesignators(const uint8_t* data, size_t len);

// MODE SENSE(6) parameter data: the WP bit of the device-specific
// parameter (SBC: the medium is write-protected). kIoError when the
// header is short.
Result<bool> ParseModeSense6WriteProtect(const uint8_t* data, size_t len);

// Empty when `now` is the logical unit `was` described; otherwise what
// differs, for an error message. A capacity that grew is the same unit (an
// administrator grew the LUN; the volume uses what it was formatted with);
// one that shrank, another block size, serial or designator is not. A
// serial or designators that `was` lacked are not compared (a target that
// did not give them at first gives nothing to hold it to).
std::string DescribeIdentityChange(const LuIdentity& was, const LuIdentity& now);

}  // namespace dede
