// Test helper: a record parked in the pending file of the index shard
// whose range holds its fingerprint, as a dedup pass parks one (a record
// held back by a busy group, a merge post held back).
#pragma once

#include <catch2/catch.hpp>
#include <string>

#include "index/shard_format.h"
#include "index/shard_io.h"
#include "index/shard_map.h"
#include "util/fingerprint.h"
#include "volume/volume.h"

namespace dede::test {

// Appends {fingerprint of `content`, file, block} to the pending file of
// the live shard whose range holds the fingerprint (created if missing).
inline void ParkPendingRecord(Volume* vol, const void* content, FileId file, uint64_t block) {
  const Superblock& sb = vol->superblock();
  const FpKey key = KeyOf(ComputeFingerprint(sb.hash_algo, content, kBlockSize));
  auto m = LoadShardMap(vol);
  REQUIRE(m.ok());
  const ShardSlot* slot = nullptr;
  for (const ShardSlot& sl : m->live) {
    if (sl.range.Contains(KeyPrefix(key))) slot = &sl;
  }
  REQUIRE(slot != nullptr);
  const std::string pname = PendingFileName(slot->range);
  Result<FileId> made = vol->Create(pname, 0, FileKind::kIndexShard);
  REQUIRE((made.ok() || made.status().code() == Status::Code::kExists));
  auto pf = vol->OpenFile(pname);
  REQUIRE(pf.ok());
  REQUIRE(
      AppendPendingFrame(pf->get(), {PendingRecord{key, file, block}}, sb.hash_algo, sb.uuid).ok());
}

}  // namespace dede::test
