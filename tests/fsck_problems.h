// Test helper: fsck's findings on a volume as one printable string.
#pragma once

#include <string>

#include "volume/fsck.h"
#include "volume/volume.h"

namespace dede::test {

// Empty when fsck finds the volume clean; otherwise one line per problem
// ("where: what"), or why fsck could not run.
inline std::string FsckProblems(Volume* vol) {
  auto rep = CheckVolume(vol, false);
  if (!rep.ok()) return "fsck failed: " + rep.status().ToString();
  std::string s;
  for (const auto& p : rep->problems) s += "\n  " + p.where + ": " + p.what;
  return s;
}

}  // namespace dede::test
