// Which CHECK CONDITIONs the iSCSI device sends again (volume/scsi_retry.h).
// tgtd cannot be made to answer NOT READY or ABORTED COMMAND, so the rule
// is tested here; the retry loop around it is the one BUSY, TASK SET FULL
// and TASK ABORTED take (iscsi_device_test.cc drives it with a real target).
#include "volume/scsi_retry.h"

#include <catch2/catch.hpp>
#include <cstdint>

using namespace dede;

TEST_CASE("iSCSI: NOT READY on the way to ready and ABORTED COMMAND are sent again", "[iscsi]") {
  for (uint16_t ascq : {0x0401, 0x0405, 0x0406, 0x0407, 0x0408, 0x0409, 0x040a, 0x0414, 0x041a}) {
    INFO(std::hex << ascq);
    CHECK(IsTransientCheckCondition(kSenseNotReady, ascq));
  }
  CHECK(IsTransientCheckCondition(kSenseAbortedCommand, 0x0000));
  CHECK(IsTransientCheckCondition(kSenseAbortedCommand, 0x4700));  // a transport CRC error
  // For an administrator: an initializing command required, manual
  // intervention, no medium; and the other sense keys.
  for (uint16_t ascq : {0x0400, 0x0402, 0x0403, 0x3a00, 0x3a01}) {
    INFO(std::hex << ascq);
    CHECK_FALSE(IsTransientCheckCondition(kSenseNotReady, ascq));
  }
  CHECK_FALSE(IsTransientCheckCondition(0x03, 0x1100));  // MEDIUM ERROR, unrecovered read
  CHECK_FALSE(IsTransientCheckCondition(0x05, 0x2100));  // ILLEGAL REQUEST, LBA out of range
  CHECK_FALSE(IsTransientCheckCondition(0x07, 0x2700));  // DATA PROTECT, write protected
  CHECK_FALSE(IsTransientCheckCondition(0x06, 0x2900));  // UNIT ATTENTION: handled apart
}

// A target busy for seconds (an array's TASK SET FULL, an ALUA transition
// of a few seconds) used to fail a WRITE after 20 tries in about 2 s, which
// poisons the volume; the tries now go on for a minute, at most a second
// apart.
TEST_CASE("iSCSI: transient answers are sent again for a minute at most a second apart",
          "[iscsi]") {
  using std::chrono::milliseconds;
  CHECK(TransientRetryDelay(1) == milliseconds(10));
  CHECK(TransientRetryDelay(2) == milliseconds(20));
  CHECK(TransientRetryDelay(7) == milliseconds(640));
  CHECK(TransientRetryDelay(8) == milliseconds(1000));
  CHECK(TransientRetryDelay(1000) == milliseconds(1000));
  CHECK(TransientRetryDelay(0) == milliseconds(10));
  // The tries a minute allows: more than the old 20, and not a busy loop.
  milliseconds waited{0};
  int tries = 0;
  while (waited < kTransientRetryBudget) waited += TransientRetryDelay(++tries);
  CHECK(tries > 20);
  CHECK(tries < 80);
  CHECK(kTransientRetryBudget >= milliseconds(30'000));
}

// A deferred error reports that an earlier command, answered GOOD, failed
// (a write the target's cache could not write): the device keeps it as a
// flush failure and sends the command that got it again.
TEST_CASE("iSCSI: deferred errors are told from current ones by the response code", "[iscsi]") {
  CHECK(IsDeferredError(0x71));  // fixed format
  CHECK(IsDeferredError(0x73));  // descriptor format
  CHECK_FALSE(IsDeferredError(0x70));
  CHECK_FALSE(IsDeferredError(0x72));
  CHECK_FALSE(IsDeferredError(0x00));
}

TEST_CASE("iSCSI: a RECOVERED ERROR is a completed command, deferred an earlier one", "[iscsi]") {
  // Current sense (70h fixed, 72h descriptor): this command completed.
  CHECK(ClassifyRecoveredError(kSenseRecoveredError, 0x70) == RecoveredError::kCompleted);
  CHECK(ClassifyRecoveredError(kSenseRecoveredError, 0x72) == RecoveredError::kCompleted);
  // Deferred: an earlier one completed after recovery; this one was not
  // processed, and nothing failed.
  CHECK(ClassifyRecoveredError(kSenseRecoveredError, 0x71) == RecoveredError::kEarlierRecovered);
  CHECK(ClassifyRecoveredError(kSenseRecoveredError, 0x73) == RecoveredError::kEarlierRecovered);
  // Every other sense key is not this rule's.
  for (uint8_t key : {0x00, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x0b}) {
    INFO(int{key});
    CHECK(ClassifyRecoveredError(key, 0x70) == RecoveredError::kNo);
    CHECK(ClassifyRecoveredError(key, 0x71) == RecoveredError::kNo);
  }
}
