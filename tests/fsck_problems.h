// Test helper: fsck's findings on a volume as one printable string.
#pragma once

#include <cstddef>
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

// fsck's findings split into leaked blocks ("refcount 1 stored, 0
// references found": a reference count with nothing naming the block) and
// every other problem, one line each as FsckProblems prints them.
struct FsckLeaks {
  size_t leaked = 0;
  std::string others;  // empty: nothing but leaks
  std::string error;   // fsck could not run
};
inline FsckLeaks FsckLeakedBlocks(Volume* vol) {
  FsckLeaks out;
  auto rep = CheckVolume(vol, false);
  if (!rep.ok()) {
    out.error = rep.status().ToString();
    return out;
  }
  for (const FsckProblem& p : rep->problems) {
    if (p.what.find("refcount 1 stored, 0 references found") != std::string::npos) {
      out.leaked++;
    } else {
      out.others += "\n  " + p.where + ": " + p.what;
    }
  }
  return out;
}

}  // namespace dede::test
