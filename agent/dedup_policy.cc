// The volume's dedup policy: window text, local-time evaluation, the
// "DDPO" slot codec (docs/FORMAT.md section 15) and the A/B slot file.
#include "agent/dedup_policy.h"

#include <time.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <thread>

#include "index/shard_format.h"
#include "util/bytes.h"
#include "util/coding.h"

namespace dede {

namespace {

constexpr int kDaysPerWeek = 7;
constexpr int kMinutesPerWeek = kDaysPerWeek * kMinutesPerDay;
constexpr uint64_t kNsPerSec = 1'000'000'000;
constexpr uint64_t kNsPerMin = 60 * kNsPerSec;

const char* const kDayNames[kDaysPerWeek] = {"mon", "tue", "wed", "thu", "fri", "sat", "sun"};
const char* const kLongDayNames[kDaysPerWeek] = {"monday", "tuesday",  "wednesday", "thursday",
                                                 "friday", "saturday", "sunday"};

// ------------------------------------------------------------ text helpers

std::string Trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) b++;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) e--;
  return s.substr(b, e - b);
}

// Exact equality, lengths first. (std::string's operator== subtracts the
// lengths as unsigned values, a wrap the fuzz build traps on.)
bool Is(const std::string& s, const char* word) {
  const size_t n = std::strlen(word);
  return s.size() == n && std::memcmp(s.data(), word, n) == 0;
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t at = s.find(sep, start);
    parts.push_back(s.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (at == std::string::npos) return parts;
    start = at + 1;
  }
}

std::vector<std::string> SplitWhitespace(const std::string& s) {
  std::vector<std::string> words;
  std::string cur;
  for (char c : s) {
    if (std::isspace(static_cast<unsigned char>(c))) {
      if (!cur.empty()) words.push_back(std::move(cur));
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) words.push_back(std::move(cur));
  return words;
}

std::optional<int> ParseDayName(const std::string& word) {
  const std::string w = Lower(word);
  for (int d = 0; d < kDaysPerWeek; d++) {
    if (Is(w, kDayNames[d]) || Is(w, kLongDayNames[d])) return d;
  }
  return std::nullopt;
}

// "mon-fri", "sat,sun", "mon,wed-fri", "fri-mon" (wraps), "daily".
Result<uint8_t> ParseDays(const std::string& text) {
  if (Is(Lower(text), "daily")) return kAllDays;
  uint8_t days = 0;
  for (const std::string& item : Split(text, ',')) {
    if (item.empty()) return Status::Invalid("empty day in '" + text + "'");
    const size_t dash = item.find('-');
    const std::string first_text = item.substr(0, dash);
    const std::optional<int> first = ParseDayName(first_text);
    if (!first) {
      return Status::Invalid("unknown day '" + first_text +
                             "' (mon, tue, wed, thu, fri, sat, sun or daily)");
    }
    int last = *first;
    if (dash != std::string::npos) {
      const std::string last_text = item.substr(dash + 1);
      const std::optional<int> parsed = ParseDayName(last_text);
      if (!parsed) {
        return Status::Invalid("unknown day '" + last_text +
                               "' (mon, tue, wed, thu, fri, sat, sun)");
      }
      last = *parsed;
    }
    // A range may wrap past Sunday: "fri-mon" is Fri, Sat, Sun, Mon.
    for (int d = *first;; d = (d + 1) % kDaysPerWeek) {
      days = static_cast<uint8_t>(days | (1u << d));
      if (d == last) break;
    }
  }
  return days;
}

// "H:MM" or "HH:MM", 00:00..24:00. Returns minutes since midnight.
Result<uint16_t> ParseClock(const std::string& text) {
  const size_t colon = text.find(':');
  auto bad = [&]() { return Status::Invalid("bad time '" + text + "' (expected HH:MM)"); };
  if (colon == std::string::npos || colon == 0 || colon > 2 || text.size() != colon + 3) {
    return bad();
  }
  for (size_t i = 0; i < text.size(); i++) {
    if (i != colon && !std::isdigit(static_cast<unsigned char>(text[i]))) return bad();
  }
  const int hours = std::stoi(text.substr(0, colon));
  const int minutes = std::stoi(text.substr(colon + 1));
  if (minutes > 59)
    return Status::Invalid("minute " + text.substr(colon + 1) + " in '" + text + "' is past 59");
  if (hours > 24 || (hours == 24 && minutes != 0)) {
    return Status::Invalid("time '" + text + "' is past 24:00");
  }
  return static_cast<uint16_t>(hours * 60 + minutes);
}

std::string FormatClock(uint16_t minute) {
  char b[16];
  std::snprintf(b, sizeof b, "%02u:%02u", unsigned(minute / 60), unsigned(minute % 60));
  return b;
}

std::string FormatDays(uint8_t days) {
  if ((days & kAllDays) == kAllDays) return "daily";
  std::string out;
  int d = 0;
  while (d < kDaysPerWeek) {
    if (!(days & (1u << d))) {
      d++;
      continue;
    }
    int end = d;
    while (end + 1 < kDaysPerWeek && (days & (1u << (end + 1)))) end++;
    auto add = [&](const std::string& s) { out += (out.empty() ? "" : ",") + s; };
    if (end - d >= 2) {
      add(std::string(kDayNames[d]) + "-" + kDayNames[end]);
    } else {
      for (int k = d; k <= end; k++) add(kDayNames[k]);
    }
    d = end + 1;
  }
  return out.empty() ? "none" : out;
}

// ------------------------------------------------------------ time helpers

struct LocalTime {
  LocalMinute minute;
  long gmtoff_s;  // local - UTC, changes at DST transitions
};

LocalTime ToLocalTime(uint64_t epoch_ns) {
  const time_t secs = static_cast<time_t>(epoch_ns / kNsPerSec);
  struct tm tm {};
  localtime_r(&secs, &tm);
  LocalTime lt;
  lt.minute.weekday_mon0 = (tm.tm_wday + 6) % kDaysPerWeek;
  lt.minute.minute = tm.tm_hour * 60 + tm.tm_min;
  lt.gmtoff_s = tm.tm_gmtoff;
  return lt;
}

int MinuteOfWeek(LocalMinute t) {
  return t.weekday_mon0 * kMinutesPerDay + t.minute;
}

bool Contains(const DedupWindow& w, LocalMinute t) {
  auto on = [&](int day) { return (w.days >> ((day + kDaysPerWeek) % kDaysPerWeek)) & 1; };
  if (w.start_min < w.end_min) {
    return on(t.weekday_mon0) && t.minute >= w.start_min && t.minute < w.end_min;
  }
  // Crosses midnight: the evening of a listed day, or the early morning
  // after one.
  return (on(t.weekday_mon0) && t.minute >= w.start_min) ||
         (on(t.weekday_mon0 - 1) && t.minute < w.end_min);
}

// Minutes of the week (0 = Monday 00:00) at which some window starts or
// ends: InWindow can only change there.
std::vector<int> WindowEdges(const std::vector<DedupWindow>& ws) {
  std::vector<int> edges;
  for (const DedupWindow& w : ws) {
    for (int d = 0; d < kDaysPerWeek; d++) {
      if (!((w.days >> d) & 1)) continue;
      edges.push_back(d * kMinutesPerDay + w.start_min);
      const int end_day = w.start_min < w.end_min ? d : d + 1;
      edges.push_back((end_day * kMinutesPerDay + w.end_min) % kMinutesPerWeek);
    }
  }
  return edges;
}

// Minutes from `m` to the next edge strictly after it (1..kMinutesPerWeek).
int MinutesToNextEdge(const std::vector<int>& edges, int m) {
  int best = kMinutesPerWeek;
  for (int e : edges) {
    const int dist = ((e - m) % kMinutesPerWeek + kMinutesPerWeek - 1) % kMinutesPerWeek + 1;
    best = std::min(best, dist);
  }
  return best;
}

// ------------------------------------------------------------ codec layout

// Header field offsets (docs/FORMAT.md 15.2).
constexpr size_t kOffMagic = 0;
constexpr size_t kOffMajor = 4;
constexpr size_t kOffMinor = 6;
constexpr size_t kOffCrc = 8;
constexpr size_t kOffFlags = 12;
constexpr size_t kOffGeneration = 16;
constexpr size_t kOffUpdatedNs = 24;
constexpr size_t kOffRate = 32;
constexpr size_t kOffStableAfter = 40;
constexpr size_t kOffPriority = 48;
constexpr size_t kOffHost = 52;
constexpr size_t kOffSlot = 56;
constexpr size_t kOffWindowCount = 60;
// Window field offsets, relative to the window.
constexpr size_t kWinDays = 0;
constexpr size_t kWinReserved1 = 1;
constexpr size_t kWinStart = 2;
constexpr size_t kWinEnd = 4;
constexpr size_t kWinReserved2 = 6;

std::string Hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08" PRIx32, v);
  return b;
}

std::string SlotName(uint32_t slot) {
  return "slot " + std::to_string(slot) + (slot == 0 ? " (A)" : slot == 1 ? " (B)" : "");
}

bool KnownPriority(uint32_t v) {
  return v >= static_cast<uint32_t>(DedupPriority::kIdle) &&
         v <= static_cast<uint32_t>(DedupPriority::kNormal);
}

// ------------------------------------------------------------ the file

// What one slot of the policy file holds.
struct SlotContent {
  enum class State { kEmpty, kValid, kBad } state = State::kEmpty;
  DedupPolicy policy;  // kValid
  Status error;        // kBad
};

struct PolicyFileContent {
  SlotContent slots[kPolicySlots];
  // The valid slot with the highest generation, if any.
  std::optional<uint32_t> newest;
};

Status CheckIsPolicyFile(const FileInfo& info) {
  if (info.kind != FileKind::kSystem) {
    return Status::Corruption(std::string("'") + kPolicyFileName + "' is of kind '" +
                              FileKindName(info.kind) + "', not the dedup policy");
  }
  return Status::Ok();
}

Result<PolicyFileContent> ReadPolicyFile(Volume* vol, File* f) {
  ASSIGN_OR_RETURN(FileInfo info, f->Info());
  RETURN_IF_ERROR(CheckIsPolicyFile(info));
  const Uuid& uuid = vol->superblock().uuid;
  PolicyFileContent content;
  std::vector<uint8_t> blk(kBlockSize);
  for (uint32_t slot = 0; slot < kPolicySlots; slot++) {
    SlotContent& sc = content.slots[slot];
    // A file cut short (a create that died before its first write) has
    // empty slots past its end.
    if (info.size < uint64_t(slot + 1) * kBlockSize) continue;
    RETURN_IF_ERROR(f->Read(uint64_t(slot) * kBlockSize, blk.data(), kBlockSize));
    // Never written: the file is created with holes, which read as zeros.
    if (IsAllZero(blk.data(), kBlockSize)) continue;
    Result<DedupPolicy> p = DecodePolicyBlock(blk.data(), uuid, info.id, slot);
    if (p.ok()) {
      sc.state = SlotContent::State::kValid;
      sc.policy = std::move(p).value();
      if (!content.newest ||
          sc.policy.generation > content.slots[*content.newest].policy.generation) {
        content.newest = slot;
      }
    } else {
      sc.state = SlotContent::State::kBad;
      sc.error = p.status();
    }
  }
  return content;
}

// The policy `content` stands for, or why there is none to follow.
Result<DedupPolicy> ChoosePolicy(const PolicyFileContent& content) {
  // A slot of a newer format is most likely the newest policy: following
  // the older slot instead would silently apply a stale one.
  for (const SlotContent& sc : content.slots) {
    if (sc.state == SlotContent::State::kBad && sc.error.code() == Status::Code::kUnsupported) {
      return sc.error;
    }
  }
  if (content.newest) return content.slots[*content.newest].policy;
  std::string why;
  for (const SlotContent& sc : content.slots) {
    if (sc.state != SlotContent::State::kBad) continue;
    why += (why.empty() ? "" : "; ") + sc.error.message();
  }
  if (why.empty()) return DedupPolicy{};  // never written: the default
  return Status::Corruption("no readable slot in the dedup policy: " + why);
}

constexpr auto kLockedRetryFor = std::chrono::seconds(10);
// An open that finds no file whose create then finds one means another
// host created (or removed) it in between: one more round settles that.
// Rounds beyond this are a file that comes and goes, or a volume whose
// lookup and create disagree: retrying would spin without end.
constexpr int kMaxCreateRounds = 8;

// Opens (creating if missing) the policy file, waiting while another
// process holds it.
Result<std::unique_ptr<File>> OpenPolicyFileForUpdate(Volume* vol) {
  const auto deadline = std::chrono::steady_clock::now() + kLockedRetryFor;
  auto backoff = std::chrono::milliseconds(10);
  int create_rounds = 0;
  while (true) {
    Result<std::unique_ptr<File>> opened = vol->OpenFile(kPolicyFileName);
    if (opened.ok()) return opened;
    const Status& st = opened.status();
    if (st.code() == Status::Code::kNotFound) {
      if (++create_rounds > kMaxCreateRounds) {
        return st.WithContext(std::string("opening ") + kPolicyFileName + ": gave up after " +
                              std::to_string(kMaxCreateRounds) +
                              " rounds of finding it missing and creating it (another host may "
                              "be removing it, or the volume's lookup and create disagree)");
      }
      Result<FileId> created =
          vol->Create(kPolicyFileName, uint64_t(kPolicySlots) * kBlockSize, FileKind::kSystem);
      // kExists: another host created it first; use theirs.
      if (!created.ok() && created.status().code() != Status::Code::kExists) {
        return created.status().WithContext(std::string("creating ") + kPolicyFileName);
      }
      continue;
    }
    if (st.code() != Status::Code::kLocked) return st;
    // Readers and writers hold the file for one read or write: a lock held
    // longer than this is not going away soon.
    if (std::chrono::steady_clock::now() >= deadline) {
      return st.WithContext(std::string(kPolicyFileName) + " stayed busy for 10 s");
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::milliseconds(200));
  }
}

}  // namespace

// ---------------------------------------------------------------- text

Status ValidateWindow(const DedupWindow& w) {
  if (w.days == 0 || (w.days & ~kAllDays) != 0) {
    return Status::Invalid("days " + Hex32(w.days) + " (expected 0x01..0x7f)");
  }
  if (w.start_min >= kMinutesPerDay) {
    return Status::Invalid("start minute " + std::to_string(w.start_min) + " (expected 0..1439)");
  }
  if (w.end_min == 0 || w.end_min > kMinutesPerDay) {
    return Status::Invalid("end minute " + std::to_string(w.end_min) + " (expected 1..1440)");
  }
  if (w.start_min == w.end_min) {
    return Status::Invalid("start and end are both " + FormatClock(w.start_min));
  }
  return Status::Ok();
}

Result<DedupWindow> ParseWindow(const std::string& s) {
  auto bad = [&](const std::string& why) { return Status::Invalid("window '" + s + "': " + why); };
  const std::vector<std::string> words = SplitWhitespace(s);
  if (words.empty()) return bad("empty (expected e.g. 'mon-fri 01:00-05:00')");
  if (words.size() > 2) return bad("expected DAYS HH:MM-HH:MM, e.g. 'mon-fri 01:00-05:00'");
  DedupWindow w;
  if (words.size() == 2) {
    Result<uint8_t> days = ParseDays(words[0]);
    if (!days.ok()) return bad(days.status().message());
    w.days = *days;
  }
  const std::string& range = words.back();
  if (range.find(':') == std::string::npos) {
    return bad("missing the time range (expected DAYS HH:MM-HH:MM, e.g. 'mon-fri 01:00-05:00')");
  }
  const size_t dash = range.find('-');
  if (dash == std::string::npos || range.find('-', dash + 1) != std::string::npos) {
    return bad("bad time range '" + range + "' (expected HH:MM-HH:MM)");
  }
  Result<uint16_t> start = ParseClock(range.substr(0, dash));
  if (!start.ok()) return bad(start.status().message());
  Result<uint16_t> end = ParseClock(range.substr(dash + 1));
  if (!end.ok()) return bad(end.status().message());
  if (*start == kMinutesPerDay) return bad("a window cannot start at 24:00");
  if (*start == *end) {
    return bad("starts and ends at " + FormatClock(*start) + " (a whole day is 00:00-24:00)");
  }
  w.start_min = *start;
  // "22:00-00:00" ends at midnight: the same as 24:00.
  w.end_min = *end == 0 ? kMinutesPerDay : *end;
  return w;
}

Result<std::vector<DedupWindow>> ParseWindowList(const std::string& s) {
  const std::string trimmed = Trim(s);
  std::vector<DedupWindow> ws;
  // Empty is not "always": `windows=$W` with W unset would drop every
  // window without a word, and dedup would run in business hours.
  if (trimmed.empty()) {
    return Status::Invalid("the window list is empty (say 'always' for dedup at any time)");
  }
  if (Is(Lower(trimmed), "always")) return ws;
  const std::vector<std::string> parts = Split(trimmed, ';');
  for (size_t i = 0; i < parts.size(); i++) {
    if (Trim(parts[i]).empty()) {
      return Status::Invalid("window list '" + s + "': entry " + std::to_string(i + 1) +
                             " is empty");
    }
    ASSIGN_OR_RETURN(DedupWindow w, ParseWindow(parts[i]));
    ws.push_back(w);
  }
  if (ws.size() > kMaxPolicyWindows) {
    return Status::Invalid("window list has " + std::to_string(ws.size()) + " windows (at most " +
                           std::to_string(kMaxPolicyWindows) + ")");
  }
  return ws;
}

std::string FormatWindow(const DedupWindow& w) {
  return FormatDays(w.days) + " " + FormatClock(w.start_min) + "-" + FormatClock(w.end_min);
}

std::string PolicyRateText(uint64_t bytes_per_s) {
  if (bytes_per_s == 0) return "unlimited";
  char b[48];
  std::snprintf(b, sizeof b, "%.6g MB/s", double(bytes_per_s) / 1e6);
  return b;
}

const char* PriorityName(DedupPriority p) {
  switch (p) {
    case DedupPriority::kIdle:
      return "idle";
    case DedupPriority::kLow:
      return "low";
    case DedupPriority::kNormal:
      return "normal";
  }
  return "unknown";
}

std::optional<DedupPriority> ParsePriority(const std::string& s) {
  const std::string l = Lower(s);
  for (DedupPriority p : {DedupPriority::kIdle, DedupPriority::kLow, DedupPriority::kNormal}) {
    if (Is(l, PriorityName(p))) return p;
  }
  return std::nullopt;
}

// ---------------------------------------------------------------- time

std::string TimeZoneText(uint64_t epoch_ns) {
  const time_t secs = static_cast<time_t>(epoch_ns / kNsPerSec);
  struct tm tm {};
  if (localtime_r(&secs, &tm) == nullptr) return "unknown";
  const long off = tm.tm_gmtoff;
  const long abs_min = (off < 0 ? -off : off) / 60;
  char buf[96];
  std::snprintf(buf, sizeof buf, "UTC%c%02ld:%02ld (%s)", off < 0 ? '-' : '+', abs_min / 60,
                abs_min % 60, tm.tm_zone != nullptr ? tm.tm_zone : "?");
  return buf;
}

std::string ReloadTimeZone(uint64_t epoch_ns) {
  const std::string before = TimeZoneText(epoch_ns);
  tzset();
  const std::string after = TimeZoneText(epoch_ns);
  return before == after ? "" : before + " -> " + after;
}

LocalMinute ToLocalMinute(uint64_t epoch_ns) {
  return ToLocalTime(epoch_ns).minute;
}

bool InWindow(const std::vector<DedupWindow>& ws, LocalMinute t) {
  if (ws.empty()) return true;
  for (const DedupWindow& w : ws) {
    if (Contains(w, t)) return true;
  }
  return false;
}

bool InWindow(const DedupPolicy& p, uint64_t epoch_ns) {
  if (p.windows.empty()) return true;
  return InWindow(p.windows, ToLocalMinute(epoch_ns));
}

std::optional<uint64_t> NextWindowChange(const DedupPolicy& p, uint64_t epoch_ns) {
  if (p.windows.empty()) return std::nullopt;
  const std::vector<int> edges = WindowEdges(p.windows);
  const bool now_in = InWindow(p.windows, ToLocalMinute(epoch_ns));
  // Windows repeat every local week; a DST change can stretch that by an
  // hour or so. No change within 8 days: there is none.
  const uint64_t limit = epoch_ns + 8 * 24 * 60 * kNsPerMin;
  uint64_t t = (epoch_ns / kNsPerMin + 1) * kNsPerMin;
  LocalTime lt = ToLocalTime(t);
  while (t <= limit) {
    if (InWindow(p.windows, lt.minute) != now_in) return t;
    // Jump to the next edge in local time. That is exact when the UTC
    // offset is the same at both ends (local time ran evenly in between);
    // across a DST change, step a minute at a time instead.
    const int jump = MinutesToNextEdge(edges, MinuteOfWeek(lt.minute));
    const uint64_t target = t + uint64_t(jump) * kNsPerMin;
    LocalTime at_target = ToLocalTime(target);
    if (jump > 1 && at_target.gmtoff_s != lt.gmtoff_s) {
      t += kNsPerMin;
      lt = ToLocalTime(t);
    } else {
      t = target;
      lt = at_target;
    }
  }
  return std::nullopt;
}

std::string CurrentWindowText(const DedupPolicy& p, uint64_t epoch_ns) {
  if (p.windows.empty()) return "";
  const LocalMinute t = ToLocalMinute(epoch_ns);
  for (const DedupWindow& w : p.windows) {
    if (Contains(w, t)) return FormatWindow(w);
  }
  return "";
}

// ---------------------------------------------------------------- codec

Status EncodePolicyBlock(const DedupPolicy& p, const Uuid& uuid, FileId file, uint32_t slot,
                         uint8_t* out) {
  if (slot >= kPolicySlots) return Status::Invalid("policy slot " + std::to_string(slot));
  if (p.generation == 0) return Status::Invalid("policy generation 0 is never written");
  if (!KnownPriority(static_cast<uint32_t>(p.priority))) {
    return Status::Invalid("unknown dedup priority " +
                           std::to_string(static_cast<uint32_t>(p.priority)));
  }
  if (p.windows.size() > kMaxPolicyWindows) {
    return Status::Invalid(std::to_string(p.windows.size()) + " windows (at most " +
                           std::to_string(kMaxPolicyWindows) + ")");
  }
  for (size_t i = 0; i < p.windows.size(); i++) {
    RETURN_IF_ERROR(ValidateWindow(p.windows[i]).WithContext("window " + std::to_string(i)));
  }
  std::memset(out, 0, kBlockSize);
  Encoder e(out, kBlockSize);
  e.u32(kMagicPolicy);
  e.u16(kPolicyMajor);
  e.u16(kPolicyMinor);
  e.u32(0);  // crc, below
  e.u32(0);  // flags: none defined
  e.u64(p.generation);
  e.u64(p.updated_ns);
  e.u64(p.rate_bytes_per_s);
  e.u64(p.stable_after_s);
  e.u32(static_cast<uint32_t>(p.priority));
  e.u32(p.updated_by_host);
  e.u32(slot);
  e.u32(static_cast<uint32_t>(p.windows.size()));
  for (const DedupWindow& w : p.windows) {
    e.u8(w.days);
    e.u8(0);  // reserved
    e.u16(w.start_min);
    e.u16(w.end_min);
    e.u16(0);  // reserved
  }
  // The crc binds the slot to this volume, this policy file (ino and
  // generation) and its position: a block of another volume, of a policy
  // file removed and recreated, or copied into the other slot fails.
  EncodeU32(out + kOffCrc, FileBlockCrc(out, kOffCrc, uuid, file, slot));
  return Status::Ok();
}

Result<DedupPolicy> DecodePolicyBlock(const uint8_t* blk, const Uuid& uuid, FileId file,
                                      uint32_t slot) {
  const std::string where = std::string("dedup policy '") + kPolicyFileName + "' " + SlotName(slot);
  auto bad = [&](const std::string& why) { return Status::Corruption(where + ": " + why); };
  const uint32_t magic = DecodeU32(blk + kOffMagic);
  if (magic != kMagicPolicy) {
    return bad("bad magic " + Hex32(magic) + " (expected " + Hex32(kMagicPolicy) + ")");
  }
  const uint32_t stored = DecodeU32(blk + kOffCrc);
  const uint32_t computed = FileBlockCrc(blk, kOffCrc, uuid, file, slot);
  if (stored != computed) {
    return bad("bad checksum (stored " + Hex32(stored) + ", computed " + Hex32(computed) + ")");
  }
  const uint16_t major = DecodeU16(blk + kOffMajor);
  const uint16_t minor = DecodeU16(blk + kOffMinor);
  if (major > kPolicyMajor) {
    return Status::Unsupported(where + ": policy format version " + std::to_string(major) + "." +
                               std::to_string(minor) + " is newer than this dede supports (" +
                               std::to_string(kPolicyMajor) + "." + std::to_string(kPolicyMinor) +
                               ")");
  }
  if (major == 0) return bad("format version 0");
  const uint32_t slot_field = DecodeU32(blk + kOffSlot);
  if (slot_field != slot) return bad("block claims slot " + std::to_string(slot_field));
  const uint32_t flags = DecodeU32(blk + kOffFlags);
  if (flags != 0) return bad("unknown flags " + Hex32(flags));
  DedupPolicy p;
  p.generation = DecodeU64(blk + kOffGeneration);
  if (p.generation == 0) return bad("generation 0");
  const uint32_t priority = DecodeU32(blk + kOffPriority);
  if (!KnownPriority(priority)) return bad("unknown priority " + std::to_string(priority));
  p.priority = static_cast<DedupPriority>(priority);
  const uint32_t count = DecodeU32(blk + kOffWindowCount);
  if (count > kMaxPolicyWindows) {
    return bad(std::to_string(count) + " windows (at most " + std::to_string(kMaxPolicyWindows) +
               ")");
  }
  const size_t used = kPolicyHeaderBytes + size_t(count) * kPolicyWindowBytes;
  if (minor <= kPolicyMinor) {
    // Reserved bytes are zero in this version; a newer minor may use them.
    for (uint32_t i = 0; i < count; i++) {
      const uint8_t* w = blk + kPolicyHeaderBytes + size_t(i) * kPolicyWindowBytes;
      if (w[kWinReserved1] != 0 || DecodeU16(w + kWinReserved2) != 0) {
        return bad("window " + std::to_string(i) + ": reserved bytes are not zero");
      }
    }
    for (size_t i = used; i < kBlockSize; i++) {
      if (blk[i] != 0) return bad("byte " + std::to_string(i) + " past the windows is not zero");
    }
  }
  p.windows.reserve(count);
  for (uint32_t i = 0; i < count; i++) {
    const uint8_t* wp = blk + kPolicyHeaderBytes + size_t(i) * kPolicyWindowBytes;
    DedupWindow w;
    w.days = wp[kWinDays];
    w.start_min = DecodeU16(wp + kWinStart);
    w.end_min = DecodeU16(wp + kWinEnd);
    Status valid = ValidateWindow(w);
    if (!valid.ok()) return bad("window " + std::to_string(i) + ": " + valid.message());
    p.windows.push_back(w);
  }
  p.updated_ns = DecodeU64(blk + kOffUpdatedNs);
  p.rate_bytes_per_s = DecodeU64(blk + kOffRate);
  // Any value reads back as written (earlier versions wrote any);
  // StableAfterNs caps it where it is used.
  p.stable_after_s = DecodeU64(blk + kOffStableAfter);
  p.updated_by_host = DecodeU32(blk + kOffHost);
  return p;
}

// ---------------------------------------------------------------- volume

Result<DedupPolicy> ReadPolicy(Volume* vol) {
  Result<std::unique_ptr<File>> opened = vol->OpenFile(kPolicyFileName);
  if (!opened.ok()) {
    if (opened.status().code() == Status::Code::kNotFound) return DedupPolicy{};
    return opened.status();
  }
  ASSIGN_OR_RETURN(PolicyFileContent content, ReadPolicyFile(vol, opened->get()));
  return ChoosePolicy(content);
}

Result<DedupPolicy> UpdatePolicy(Volume* vol, const std::function<Status(DedupPolicy*)>& change,
                                 Clock* clock) {
  if (clock == nullptr) clock = Clock::Real();
  ASSIGN_OR_RETURN(std::unique_ptr<File> f, OpenPolicyFileForUpdate(vol));
  ASSIGN_OR_RETURN(PolicyFileContent content, ReadPolicyFile(vol, f.get()));
  Result<DedupPolicy> current = ChoosePolicy(content);
  // Never overwrite a newer format's policy with this version's.
  if (!current.ok() && current.status().code() == Status::Code::kUnsupported) {
    return current.status();
  }
  // Both slots damaged: the change starts over from the default policy
  // (this write is how an admin repairs the file).
  DedupPolicy p = current.ok() ? std::move(current).value() : DedupPolicy{};
  RETURN_IF_ERROR(change(&p));
  // The newest valid slot stays untouched until the new one is durable.
  uint64_t highest = 0;
  for (const SlotContent& sc : content.slots) {
    if (sc.state == SlotContent::State::kValid) highest = std::max(highest, sc.policy.generation);
  }
  const uint32_t slot = content.newest ? (*content.newest + 1) % kPolicySlots : 0;
  p.generation = highest + 1;
  p.updated_ns = clock->NowNanos();
  p.updated_by_host = vol->host_id();
  std::vector<uint8_t> blk(kBlockSize);
  ASSIGN_OR_RETURN(FileInfo info, f->Info());
  RETURN_IF_ERROR(EncodePolicyBlock(p, vol->superblock().uuid, info.id, slot, blk.data()));
  if (info.size < uint64_t(kPolicySlots) * kBlockSize) {
    RETURN_IF_ERROR(f->Truncate(uint64_t(kPolicySlots) * kBlockSize));
  }
  RETURN_IF_ERROR(f->Write(uint64_t(slot) * kBlockSize, blk.data(), kBlockSize));
  RETURN_IF_ERROR(f->Flush());
  return p;
}

Status WritePolicy(Volume* vol, DedupPolicy p, Clock* clock) {
  Result<DedupPolicy> written = UpdatePolicy(
      vol,
      [&p](DedupPolicy* cur) {
        *cur = p;
        return Status::Ok();
      },
      clock);
  return written.status();
}

}  // namespace dede
