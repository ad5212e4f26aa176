// Which SCSI CHECK CONDITIONs say "not now, send it again" (sense key and
// the ASC/ASCQ pair, as libiscsi reports them: ASC << 8 | ASCQ). Kept apart
// from the iSCSI device so the rule is testable without a target that can
// be made to answer so (tgtd cannot).
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>

namespace dede {

inline constexpr uint8_t kSenseRecoveredError = 0x01;  // SPC: RECOVERED ERROR
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
    case 0x0414:  // space allocation in progress
    case 0x041a:  // START STOP UNIT in progress
      return true;
    default:
      return false;
  }
}

// Sense data's response code (libiscsi's error_type: byte 0 & 0x7f):
// 0x71 and 0x73 (fixed and descriptor format) are deferred errors (SPC-4
// 4.5.5): they report the failure of an earlier command the target had
// already answered GOOD, typically a WRITE its write-back cache could not
// write; the command that got them was not processed.
inline bool IsDeferredError(uint8_t response_code) {
  return response_code == 0x71 || response_code == 0x73;
}

// What a CHECK CONDITION with sense key RECOVERED ERROR (only sent by a
// target with post-error reporting on) says: current (70h/72h) — this
// command completed, the target corrected something on the way, so it is
// a success (taken for a failure, a WRITE that landed stopped the volume);
// deferred — an earlier command completed after recovery, nothing failed,
// and this one was not processed (send it again, note no failure).
enum class RecoveredError { kNo, kCompleted, kEarlierRecovered };
inline RecoveredError ClassifyRecoveredError(uint8_t sense_key, uint8_t response_code) {
  if (sense_key != kSenseRecoveredError) return RecoveredError::kNo;
  return IsDeferredError(response_code) ? RecoveredError::kEarlierRecovered
                                        : RecoveredError::kCompleted;
}

// How long a command that keeps meeting a transient condition (BUSY, TASK
// SET FULL, TASK ABORTED, or a CHECK CONDITION above) is sent again before
// it fails. It was 20 tries about 2 s in all: an array busy for longer, or
// an ALUA transition of a few seconds, failed a WRITE, which poisons the
// volume until dedupd restarts. Linux's sd keeps trying for (retries + 1)
// command timeouts; a minute of stalled I/O here is the same kind of wait
// as a multipath failover, and far better than a volume that stops.
inline constexpr std::chrono::milliseconds kTransientRetryBudget{60'000};

// The pause before the n-th try again (n from 1): 10 ms doubling, at most
// one second (quick for a momentary TASK SET FULL, no busy loop against a
// target in a long transition).
inline std::chrono::milliseconds TransientRetryDelay(int n) {
  if (n < 1) n = 1;
  if (n > 8) return std::chrono::milliseconds(1000);  // 10 << 7 = 1280 already
  return std::chrono::milliseconds(std::min<int64_t>(1000, int64_t{10} << (n - 1)));
}

}  // namespace dede
