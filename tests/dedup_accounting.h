// What a dedup test counts as the volume's physical data: every used block
// but block maps, index shards and write logs. Arena blocks and merge-request
// clones are references to blocks the files hold, not blocks of their own,
// so an exact dedup leaves one block per distinct non-zero content.
#pragma once

#include <catch2/catch.hpp>
#include <cstdint>
#include <vector>

#include "volume/volume.h"

namespace dede::test {

inline uint64_t PhysicalDataBlocks(const VolumeStats& stats, const std::vector<FileInfo>& files) {
  uint64_t internal = 0;
  for (const FileInfo& fi : files) {
    if (fi.kind == FileKind::kIndexShard || fi.kind == FileKind::kWriteLog) {
      internal += fi.mapped_blocks;
    }
  }
  return stats.used_blocks - stats.pointer_blocks - internal;
}

// The same, read from an open volume (a test failure if it cannot be).
inline uint64_t PhysicalDataBlocks(Volume* vol) {
  auto stats = vol->Stats();
  REQUIRE(stats.ok());
  auto files = vol->List();
  REQUIRE(files.ok());
  return PhysicalDataBlocks(*stats, *files);
}

}  // namespace dede::test
