// What a dedup test counts as the volume's physical data: every used block
// but block maps, index shards and write logs. Arena blocks and merge-request
// clones are references to blocks the files hold, not blocks of their own,
// so an exact dedup leaves one block per distinct non-zero content.
#pragma once

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

}  // namespace dede::test
