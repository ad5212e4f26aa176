// See dedup_stats_json.h.
#include "agent/dedup_stats_json.h"

#include <cstdint>

namespace dede {

namespace {

uint64_t U64(const nlohmann::json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end() || !it->is_number_integer()) return 0;
  return it->is_number_unsigned() || it->get<int64_t>() >= 0 ? it->get<uint64_t>() : 0;
}

uint64_t Nanos(const nlohmann::json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end() || !it->is_number() || !(it->get<double>() >= 0)) return 0;
  return static_cast<uint64_t>(it->get<double>() * 1e9 + 0.5);
}

}  // namespace

nlohmann::json DedupStatsToJson(const DedupStats& s) {
  nlohmann::json j;
  for (const DedupCounter& c : DedupCounters()) j[c.name] = s.*c.field;
  j["rounds"] = s.rounds;
  j["logs_left_over"] = s.logs_left_over;
  j["stopped"] = s.stopped;
  j["shard_lock_seconds"] = double(s.shard_lock_ns) / 1e9;
  {
    nlohmann::json spans = nlohmann::json::array();
    for (const DedupStats::ShardSpan& sp : s.shard_spans())
      spans.push_back({sp.start_ns, sp.end_ns});
    j["shard_spans_ns"] = std::move(spans);
  }
  j["gather_seconds"] = double(s.gather_ns) / 1e9;
  j["merge_seconds"] = double(s.merge_ns) / 1e9;
  j["seconds"] = double(s.total_ns) / 1e9;
  return j;
}

DedupStats DedupStatsFromJson(const nlohmann::json& j) {
  DedupStats s;
  if (!j.is_object()) return s;
  for (const DedupCounter& c : DedupCounters()) s.*c.field = U64(j, c.name);
  s.rounds = U64(j, "rounds");
  s.logs_left_over = U64(j, "logs_left_over");
  auto stopped = j.find("stopped");
  s.stopped = stopped != j.end() && stopped->is_boolean() && stopped->get<bool>();
  s.shard_lock_ns = Nanos(j, "shard_lock_seconds");
  s.gather_ns = Nanos(j, "gather_seconds");
  s.merge_ns = Nanos(j, "merge_seconds");
  s.total_ns = Nanos(j, "seconds");
  return s;
}

}  // namespace dede
