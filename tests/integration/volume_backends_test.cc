// The volume property test (tests/volume_model_harness.h) on the real
// backends: a file on disk through the path backend (O_DIRECT), and a LUN
// of a real tgtd on 127.0.0.1 through the iSCSI backend. The unit test runs
// the same harness longer on a MemDevice; here every step pays real device
// round trips, so fewer steps.
#include "tests/integration/rig.h"
#include "tests/seeds.h"
#include "tests/volume_model_harness.h"
#include "volume/block_device.h"

namespace {

uint64_t BackendSteps() {
  return dede::test::CountFromEnv("DEDE_BACKEND_STEPS", 1500);
}

}  // namespace

TEST_CASE("volume model on the path backend", "[property][volume][path][seeded]") {
  dede::test::TempDir dir;
  std::string path = dir.file("vol.img");
  dede::test::CreateSparseFile(path, 96ull << 20);
  auto dev = dede::OpenBlockDevice(path);
  REQUIRE(dev.ok());
  ModelHarness h(dede::test::SeedsFromEnv({11}).front(), dev.value().get());
  h.Run(BackendSteps());
}

TEST_CASE("volume model on the iSCSI backend against tgtd", "[property][volume][iscsi][seeded]") {
  dede::test::TempDir dir;
  std::string lun = dir.file("lun.img");
  dede::test::CreateSparseFile(lun, 96ull << 20);
  dede::test::TgtdRig rig(lun);
  auto dev = dede::OpenBlockDevice(rig.url());
  REQUIRE(dev.ok());
  ModelHarness h(dede::test::SeedsFromEnv({12}).front(), dev.value().get());
  h.Run(BackendSteps());
}
