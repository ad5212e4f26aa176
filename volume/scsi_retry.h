// Which SCSI CHECK CONDITIONs say "not now, send it again" (sense key and
// the ASC/ASCQ pair, as libiscsi reports them: ASC << 8 | ASCQ). Kept apart
// from the iSCSI device so the rule is testable without a target that can
// be made to answer so (tgtd cannot).
#pragma once
#include <cstdint>

namespace dede {

inline constexpr uint8_t kSenseNotReady = 0x02;        // SPC: NOT READY
inline constexpr uint8_t kSenseAbortedCommand = 0x0b;  // SPC: ABORTED COMMAND

// NOT READY while the logical unit is on its way to ready (04/01 becoming
// ready, 04/05..04/09 an operation, rebuild, recalculation, long write or
// self-test in progress, 04/0A an ALUA state transition): the command did
// not run. ABORTED COMMAND: the target ended it (a transport or internal
// problem); sending the same command again is what an initiator does
// (Linux's sd does both). Everything else under NOT READY (04/02 needs an
// initializing command, 04/03 manual intervention, 3A/xx no medium) is for
// an administrator, not a retry.
inline bool IsTransientCheckCondition(uint8_t sense_key, uint16_t asc_ascq) {
  if (sense_key == kSenseAbortedCommand) return true;
  if (sense_key != kSenseNotReady) return false;
  switch (asc_ascq) {
    case 0x0401:
    case 0x0405:
    case 0x0406:
    case 0x0407:
    case 0x0408:
    case 0x0409:
    case 0x040a:
      return true;
    default:
      return false;
  }
}

}  // namespace dede
