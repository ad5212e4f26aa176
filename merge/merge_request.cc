// Posting, reading and applying merge requests (merge/merge_request.h).
#include "merge/merge_request.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "util/clock.h"
#include "util/log.h"

namespace dede {

namespace {

// Blocks of `size` bytes rounded up: where the next group starts, whatever
// a failed or torn post left behind.
uint64_t BlocksCovering(uint64_t size) {
  return (size + kBlockSize - 1) / kBlockSize;
}

Status CheckIsRequestFileOf(const FileInfo& info, uint64_t target_ino) {
  if (info.kind != FileKind::kMergeRequest || info.owner_ino != target_ino) {
    return Status::Corruption("'" + info.name + "' is a " + FileKindName(info.kind) +
                              " of owner inode " + std::to_string(info.owner_ino) +
                              ", not the merge-request file of inode " +
                              std::to_string(target_ino));
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<MergeGroup>> ReadMergeRequestFile(File* request, HashAlgo algo, const Uuid& uuid,
                                                     uint64_t target_ino, MergeScanStats* stats) {
  ASSIGN_OR_RETURN(FileInfo info, request->Info());
  const std::string what = "merge-request file '" + info.name + "'";
  // Only whole blocks can hold a group (posts extend the file by blocks).
  const uint64_t blocks = info.size / kBlockSize;
  std::vector<MergeGroup> groups;
  std::unique_ptr<uint8_t[]> blk(new uint8_t[kBlockSize]);
  bool in_bad_run = false;
  uint64_t bad_run = 0;  // blocks since the last group header
  for (uint64_t b = 0; b < blocks;) {
    if (bad_run >= kMaxMergeBadRunBlocks) {
      // Damage (a post that died leaves far less): the rest is not read,
      // its requests are lost (hints only).
      LOG(kWarning) << what << ": " << bad_run << " blocks without a group header before block "
                    << b << "; the " << blocks - b << " blocks after them are not read";
      stats->gave_up = true;
      break;
    }
    RETURN_IF_ERROR(request->Read(b * kBlockSize, blk.get(), kBlockSize));
    Result<MergeGroup> g =
        DecodeMergeGroupBlock(blk.get(), algo, uuid, info.id, b, target_ino, what);
    if (g.ok() && g->blocks() <= blocks - b) {
      stats->groups++;
      stats->records += g->records.size();
      b += g->blocks();
      groups.push_back(std::move(*g));
      in_bad_run = false;
      bad_run = 0;
      continue;
    }
    // Not a group header: a post that died before its header landed (a
    // hole), damage, or a clone block of a group whose header is gone.
    // Step one block, like a write log's reader: the crc binds each header
    // to its position, so no clone passes as a header by accident. A
    // newer dede's group is stepped over the same way, but counted as
    // what it is, and the blocks after it (its clones, most likely) are
    // not counted as a bad run.
    if (!g.ok() && g.status().code() == Status::Code::kUnsupported) {
      stats->newer_groups++;
      LOG(kDebug) << g.status().message();
      in_bad_run = true;
      bad_run = 0;
      b++;
      continue;
    }
    if (!in_bad_run) {
      stats->corrupt_groups++;
      LOG(kDebug) << (g.ok() ? what + " group at block " + std::to_string(b) +
                                   " runs past the end of the file"
                             : g.status().message());
    }
    in_bad_run = true;
    bad_run++;
    b++;
  }
  return groups;
}

Status PostMergeRequests(Volume* vol, FileId target, const std::vector<MergeRequest>& requests,
                         File* clone_source, MergePostOutcome* outcome) {
  MergePostOutcome ignored;
  if (outcome == nullptr) outcome = &ignored;
  *outcome = MergePostOutcome{};
  if (requests.empty()) return Status::Ok();
  const Superblock& sb = vol->superblock();
  for (const MergeRequest& r : requests) {
    if (r.witness.size != HashAlgoSize(sb.hash_algo) || r.target_block > kMaxMergeBlock) {
      return Status::Invalid("merge request for block " + std::to_string(r.target_block) +
                             " of inode " + std::to_string(target.ino) +
                             ": bad witness or block index");
    }
  }
  const std::string name = MergeRequestFileName(target.ino);
  // OpenFile never waits: a request file another poster or the applier
  // has open right now comes back kLocked, and this post is dropped.
  Result<std::unique_ptr<File>> opened = vol->OpenFile(name);
  // None yet: create it. An applier may find the new, empty file and
  // remove it before we open it (it removes every file it has applied):
  // then create it again, a few times at most (an applier runs once per
  // interval, so a second loss in a row is already unlikely).
  for (int attempt = 0; attempt < 4 && !opened.ok() &&
                        opened.status().code() == Status::Code::kNotFound;
       attempt++) {
    Result<FileId> created = vol->Create(name, 0, FileKind::kMergeRequest, target.ino);
    // kExists: another host created it first; use theirs.
    if (!created.ok() && created.status().code() != Status::Code::kExists) {
      return created.status().WithContext("creating merge-request file " + name);
    }
    opened = vol->OpenFile(name);
  }
  if (!opened.ok()) {
    outcome->file_busy = opened.status().code() == Status::Code::kLocked;
    return opened.status();
  }
  File* mr = opened->get();
  ASSIGN_OR_RETURN(FileInfo info, mr->Info());
  RETURN_IF_ERROR(CheckIsRequestFileOf(info, target.ino));
  uint64_t next = BlocksCovering(info.size);
  Volume::BlockOpsOptions no_wait;
  no_wait.no_wait = true;
  for (size_t first = 0; first < requests.size(); first += kMaxMergeRecordsPerGroup) {
    const size_t n = std::min<size_t>(kMaxMergeRecordsPerGroup, requests.size() - first);
    MergeGroup g;
    g.target = target;
    g.first_block = next;
    g.posted_ns = Clock::Real()->NowNanos();
    g.host_id = vol->host_id();
    const std::string ctx =
        "posting merge requests to " + name + " at block " + std::to_string(next);
    // The clones first, the header last: a group whose header is on disk
    // names only clones that are there. A post that dies in between leaves
    // a headerless run that readers skip (its clone references go when
    // the file is cleared).
    auto build = [&]() -> Status {
      RETURN_IF_ERROR(mr->Truncate((next + 1 + n) * kBlockSize));
      for (size_t i = 0; i < n; i++) {
        const MergeRequest& r = requests[first + i];
        const uint64_t clone_block = next + 1 + i;
        // Never waits for another host under the volume mutex: a source
        // block whose allocation group is held elsewhere is kLocked (the
        // want announced), and the half-built group is taken back below.
        // (Into a hole: no drop-list room is needed.)
        RETURN_IF_ERROR(vol->CloneBlock(clone_source, r.source_index, mr, clone_block, no_wait));
        g.records.push_back(MergeRecord{r.target_block, clone_block, r.witness});
      }
      std::unique_ptr<uint8_t[]> blk(new uint8_t[kBlockSize]);
      EncodeMergeGroupBlock(g, sb.hash_algo, sb.uuid, info.id, blk.get());
      return mr->Write(next * kBlockSize, blk.get(), kBlockSize);
    };
    Status st = build();
    if (!st.ok()) {
      // Best effort: take the half-built group (and its references) back.
      Status undo = mr->Truncate(next * kBlockSize);
      (void)undo;
      return st.WithContext(ctx);
    }
    next += 1 + n;
    outcome->posted += n;
  }
  return Status::Ok();
}

Result<MergeApplyStats> ApplyMergeRequests(Volume* vol, File* target, VerifyMode verify) {
  using Op = Volume::BlockOp;
  MergeApplyStats stats;
  ASSIGN_OR_RETURN(FileInfo ti, target->Info());
  const Superblock& sb = vol->superblock();
  const std::string name = MergeRequestFileName(ti.id.ino);
  Result<std::unique_ptr<File>> opened = vol->OpenFile(name);
  if (!opened.ok()) {
    if (opened.status().code() == Status::Code::kNotFound) return stats;
    if (opened.status().code() == Status::Code::kLocked) {
      // A poster is appending this moment: its requests wait for next time.
      stats.request_files_busy++;
      return stats;
    }
    return opened.status();
  }
  File* mr = opened->get();
  ASSIGN_OR_RETURN(FileInfo mi, mr->Info());
  if (Status st = CheckIsRequestFileOf(mi, ti.id.ino); !st.ok()) {
    // Someone's own file under our name: not ours to read or clear.
    LOG(kWarning) << st.message() << "; left alone";
    return stats;
  }
  MergeScanStats scan;
  ASSIGN_OR_RETURN(std::vector<MergeGroup> groups, ReadMergeRequestFile(mr, sb.hash_algo, sb.uuid, ti.id.ino, &scan));
  stats.records = scan.records;
  stats.corrupt_groups = scan.corrupt_groups;

  // Which records still describe this file: same incarnation, a whole
  // block inside it, and a file that takes part in dedup.
  const uint64_t whole_blocks = ti.size / kBlockSize;
  std::vector<MergeRecord> candidates;
  for (const MergeGroup& g : groups) {
    for (const MergeRecord& r : g.records) {
      if (!(g.target == ti.id) || !ti.dedup || r.target_block >= whole_blocks) {
        stats.stale++;
        continue;
      }
      candidates.push_back(r);
    }
  }
  // The witness: the target block must still hold what the poster saw.
  // (With kHashWitness the volume checks it under the locks itself.) This
  // read is a filter, not the guarantee: the share below re-verifies under
  // both files' locks, so a write racing with it only makes the share fail.
  std::sort(candidates.begin(), candidates.end(), [](const MergeRecord& a, const MergeRecord& b) {
    return a.target_block < b.target_block;
  });
  std::vector<Op> ops;
  {
    std::unique_ptr<uint8_t[]> blk(new uint8_t[kBlockSize]);
    for (const MergeRecord& r : candidates) {
      if (verify == VerifyMode::kByteCompare) {
        RETURN_IF_ERROR(target->Read(r.target_block * kBlockSize, blk.get(), kBlockSize));
        if (!(ComputeFingerprint(sb.hash_algo, blk.get(), kBlockSize) == r.witness)) {
          stats.failed_verification++;
          continue;
        }
      }
      Op op;
      op.kind = Op::Kind::kShare;
      op.src = mr;
      op.src_index = r.clone_block;
      op.dst = target;
      op.dst_index = r.target_block;
      op.witness = r.witness;
      ops.push_back(op);
    }
  }
  // Batches as the dedup pass sends them: sorted by target block already,
  // so 2,048 keep the reads dense, and one buffer for all of them (pages
  // touched before are much cheaper to read into and compare).
  constexpr size_t kBatchOps = 2048;
  Volume::ReadBuffer buffer;
  for (size_t i = 0; i < ops.size(); i += kBatchOps) {
    std::vector<Op> batch(ops.begin() + long(i),
                          ops.begin() + long(std::min(ops.size(), i + kBatchOps)));
    // Never waits for an allocation group another host holds (issue 5):
    // such a share comes back kLocked, and the file keeps its requests.
    Volume::BlockOpsOptions no_wait;
    no_wait.no_wait = true;
    RETURN_IF_ERROR(vol->ApplyBlockOps(&batch, verify, &buffer, no_wait));
    for (const Op& op : batch) {
      if (op.result.code() == Status::Code::kLocked) {
        stats.busy++;
      } else if (op.result.ok()) {
        stats.applied++;
        stats.already_shared += op.changed ? 0 : 1;
      } else if (op.result.code() == Status::Code::kMismatch) {
        // Changed since the witness check, or the clone is a hole.
        stats.failed_verification++;
      } else if (op.result.code() == Status::Code::kInvalid) {
        stats.stale++;  // no longer a whole block of the file
      } else {
        return op.result;
      }
    }
  }
  // The shares are durable before the requests go: a crash in between
  // applies them again, which finds them shared (idempotent).
  RETURN_IF_ERROR(vol->Sync());
  if (scan.newer_groups > 0) {
    // A newer dede's requests: not ours to read or drop. The file stays;
    // the requests applied now are found shared next time.
    LOG(kWarning) << "merge-request file '" << mi.name << "' holds " << scan.newer_groups
                  << " groups of a newer format version than this dede supports; kept";
    stats.newer_files_kept++;
    return stats;
  }
  if (stats.busy > 0) {
    // Some shares were held back: the file stays as it is for the next
    // apply, which finds the ones done now already shared (idempotent, as
    // after a crash) and, the holder having handed the group over at its
    // flush point, applies the rest. Clearing only the done ones would
    // mean rewriting the file's groups; keeping them costs a re-check.
    return stats;
  }
  // Removed while still held: closing first and removing by name would
  // leave a moment in which a poster could open the emptied file, append
  // its groups and close it, and the removal would then take them with it
  // (a three-host test lost 60 requests that way). Posters that come
  // after find no file and create a fresh one.
  RETURN_IF_ERROR(vol->RemoveOpen(std::move(*opened)));
  stats.request_files++;
  return stats;
}

}  // namespace dede
