// DedupStats as JSON: what `dede dedup --json` prints for a pass it ran,
// and what dedupd hands over its control socket for a pass it ran on
// request (`dede dedup --now --wait`), so both print the same figures.
//
// The counters go by their DedupCounters() names; a member missing from
// the JSON (an older dedupd) reads as 0.
#pragma once

#include <nlohmann/json.hpp>

#include "agent/dedup_pass.h"

namespace dede {

nlohmann::json DedupStatsToJson(const DedupStats& s);
// Only what DedupStatsToJson writes is read back; the shard spans are
// not (their sum, shard_lock_seconds, is).
DedupStats DedupStatsFromJson(const nlohmann::json& j);

}  // namespace dede
