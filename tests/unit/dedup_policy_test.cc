// The volume's dedup policy (agent/dedup_policy.h): window text, local-time
// evaluation (including midnight, the week's wrap and DST), the DDPO slot
// codec against every kind of damage, and the A/B policy file on a volume.
#include "agent/dedup_policy.h"

#include <time.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "index/shard_format.h"
#include "tests/temp_locks.h"
#include "util/coding.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;
using dede::test::TempLocks;

namespace {

constexpr Uuid kUuid = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
constexpr Uuid kOtherUuid = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 17};
const FileId kPolicyFile{6, 2};
constexpr uint64_t kNsPerSec = 1'000'000'000;
constexpr uint64_t kNsPerMin = 60 * kNsPerSec;

DedupWindow W(const std::string& s) {
  Result<DedupWindow> w = ParseWindow(s);
  INFO(s << ": " << w.status().ToString());
  REQUIRE(w.ok());
  return *w;
}

DedupPolicy PolicyWith(const std::string& windows) {
  DedupPolicy p;
  Result<std::vector<DedupWindow>> ws = ParseWindowList(windows);
  INFO(windows << ": " << ws.status().ToString());
  REQUIRE(ws.ok());
  p.windows = *ws;
  return p;
}

// Epoch ns of a local date and time (whatever TZ is in effect).
uint64_t LocalEpoch(int year, int month, int day, int hour, int minute) {
  struct tm tm {};
  tm.tm_year = year - 1900;
  tm.tm_mon = month - 1;
  tm.tm_mday = day;
  tm.tm_hour = hour;
  tm.tm_min = minute;
  tm.tm_isdst = -1;
  const time_t t = mktime(&tm);
  REQUIRE(t != time_t(-1));
  return uint64_t(t) * kNsPerSec;
}

// Sets TZ for the lifetime of the object, then restores it.
class ScopedTimeZone {
 public:
  explicit ScopedTimeZone(const char* tz) {
    if (const char* old = std::getenv("TZ")) old_ = old;
    setenv("TZ", tz, 1);
    tzset();
  }
  ~ScopedTimeZone() {
    if (old_) {
      setenv("TZ", old_->c_str(), 1);
    } else {
      unsetenv("TZ");
    }
    tzset();
  }

 private:
  std::optional<std::string> old_;
};

DedupPolicy SamplePolicy() {
  DedupPolicy p = PolicyWith("mon-fri 01:00-05:00;sat,sun 00:00-24:00;fri 22:00-02:00");
  p.rate_bytes_per_s = 50'000'000;
  p.priority = DedupPriority::kIdle;
  p.stable_after_s = 3600;
  p.generation = 7;
  p.updated_ns = 1'700'000'000'123'456'789ull;
  p.updated_by_host = 3;
  return p;
}

bool SamePolicy(const DedupPolicy& a, const DedupPolicy& b) {
  return a.windows == b.windows && a.rate_bytes_per_s == b.rate_bytes_per_s &&
         a.priority == b.priority && a.stable_after_s == b.stable_after_s &&
         a.generation == b.generation && a.updated_ns == b.updated_ns &&
         a.updated_by_host == b.updated_by_host;
}

std::vector<uint8_t> Encoded(const DedupPolicy& p, uint32_t slot = 0) {
  std::vector<uint8_t> blk(kBlockSize);
  REQUIRE(EncodePolicyBlock(p, kUuid, kPolicyFile, slot, blk.data()).ok());
  return blk;
}

// Recomputes the crc of a block edited on purpose, so the field checks
// behind the crc are reached.
void Reseal(std::vector<uint8_t>* blk, uint32_t slot = 0) {
  EncodeU32(blk->data() + 8, FileBlockCrc(blk->data(), 8, kUuid, kPolicyFile, slot));
}

Status::Code DecodeCode(const std::vector<uint8_t>& blk, uint32_t slot = 0) {
  return DecodePolicyBlock(blk.data(), kUuid, kPolicyFile, slot).status().code();
}

struct TestVolume {
  MemDevice dev{64 << 20};
  std::shared_ptr<LockManager> locks = TempLocks();
  std::unique_ptr<Volume> vol;
  TestVolume() {
    REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
    Reopen();
  }
  void Reopen() {
    vol.reset();
    OpenOptions oo;
    oo.locks = locks;
    auto v = Volume::Open(&dev, oo);
    REQUIRE(v.ok());
    vol = std::move(v).value();
  }
};

// Slot `slot` of the volume's policy file, raw.
std::vector<uint8_t> ReadSlot(Volume* vol, uint32_t slot) {
  auto f = vol->OpenFile(kPolicyFileName);
  REQUIRE(f.ok());
  std::vector<uint8_t> blk(kBlockSize);
  REQUIRE((*f)->Read(uint64_t(slot) * kBlockSize, blk.data(), kBlockSize).ok());
  return blk;
}

void WriteSlot(Volume* vol, uint32_t slot, const std::vector<uint8_t>& blk) {
  auto f = vol->OpenFile(kPolicyFileName);
  REQUIRE(f.ok());
  REQUIRE((*f)->Write(uint64_t(slot) * kBlockSize, blk.data(), kBlockSize).ok());
  REQUIRE((*f)->Flush().ok());
}

FileId PolicyFileId(Volume* vol) {
  auto info = vol->Lookup(kPolicyFileName);
  REQUIRE(info.ok());
  return info->id;
}

}  // namespace

// ---------------------------------------------------------------- text

TEST_CASE("policy windows parse the documented forms", "[policy]") {
  DedupWindow w = W("mon-fri 01:00-05:00");
  CHECK(w.days == 0x1f);
  CHECK(w.start_min == 60);
  CHECK(w.end_min == 300);

  w = W("sat,sun 00:00-24:00");
  CHECK(w.days == 0x60);
  CHECK(w.start_min == 0);
  CHECK(w.end_min == 1440);

  w = W("daily 22:00-04:00");
  CHECK(w.days == 0x7f);
  CHECK(w.start_min == 1320);
  CHECK(w.end_min == 240);

  w = W("mon,wed-fri 1:00-5:30");
  CHECK(w.days == 0x1d);
  CHECK(w.start_min == 60);
  CHECK(w.end_min == 330);

  // Wrapping day range, long names, any case, extra spaces, no days.
  CHECK(W("fri-mon 10:00-11:00").days == 0x71);
  CHECK(W("  Saturday,SUNDAY   08:00-09:00 ").days == 0x60);
  CHECK(W("01:00-02:00").days == 0x7f);
  // Ending at midnight is ending at 24:00.
  CHECK(W("fri 22:00-00:00").end_min == 1440);
}

TEST_CASE("policy windows reject bad text with a message naming the input", "[policy]") {
  const char* const bad[] = {
      "",
      "mon-fri",
      "mon-fri 01:00",
      "mon-fri 01:00-",
      "mon-fri -05:00",
      "mon-fri 25:00-05:00",
      "mon-fri 01:60-05:00",
      "mon-fri 24:00-05:00",
      "mon-fri 01:00-24:01",
      "mon-fri 1-5",
      "mon-fri 01:00-05:00-06:00",
      "mon-fri 001:00-05:00",
      "mon-fri 01:0-05:00",
      "mon-fri 01:00-05:00 extra",
      "funday 01:00-05:00",
      "mon-funday 01:00-05:00",
      "mon,,fri 01:00-05:00",
      "mon 03:00-03:00",
      "mon 00:00-00:00",
      "mon 01:00 - 05:00",
      "mon +1:00-05:00",
  };
  for (const char* s : bad) {
    Result<DedupWindow> w = ParseWindow(s);
    INFO("'" << s << "' -> " << w.status().ToString());
    CHECK(w.status().code() == Status::Code::kInvalid);
    CHECK(w.status().message().find(std::string("'") + s + "'") != std::string::npos);
  }
}

TEST_CASE("policy window lists split on semicolons and accept always", "[policy]") {
  CHECK(ParseWindowList("").status().code() == Status::Code::kInvalid);
  CHECK(ParseWindowList("  ").status().code() == Status::Code::kInvalid);
  CHECK(ParseWindowList("always")->empty());
  CHECK(ParseWindowList("  Always ")->empty());
  auto ws = ParseWindowList("mon-fri 01:00-05:00; sat,sun 00:00-24:00");
  REQUIRE(ws.ok());
  REQUIRE(ws->size() == 2);
  CHECK((*ws)[1].days == 0x60);
  CHECK(ParseWindowList("mon 01:00-02:00;;tue 01:00-02:00").status().code() ==
        Status::Code::kInvalid);
  CHECK(ParseWindowList("mon 01:00-02:00;").status().code() == Status::Code::kInvalid);
  CHECK(ParseWindowList("always;mon 01:00-02:00").status().code() == Status::Code::kInvalid);
  std::string many;
  for (uint32_t i = 0; i <= kMaxPolicyWindows; i++)
    many += (i ? ";" : "") + std::string("mon 01:00-02:00");
  CHECK(ParseWindowList(many).status().code() == Status::Code::kInvalid);
}

TEST_CASE("policy windows format canonically and round trip", "[policy]") {
  CHECK(FormatWindow(W("mon-fri 1:00-5:00")) == "mon-fri 01:00-05:00");
  CHECK(FormatWindow(W("sat,sun 00:00-24:00")) == "sat,sun 00:00-24:00");
  CHECK(FormatWindow(W("mon-sun 22:00-04:00")) == "daily 22:00-04:00");
  CHECK(FormatWindow(W("mon,wed-fri 1:00-5:30")) == "mon,wed-fri 01:00-05:30");
  CHECK(FormatWindow(W("mon,tue,thu 1:00-5:30")) == "mon,tue,thu 01:00-05:30");
  CHECK(FormatWindow(W("fri-mon 10:00-11:00")) == "mon,fri-sun 10:00-11:00");
  // Every day set and a spread of times round trip exactly.
  for (uint32_t days = 1; days <= 0x7f; days++) {
    for (uint16_t start : {0, 59, 60, 721, 1439}) {
      for (uint16_t end : {1, 300, 722, 1440}) {
        if (start == end) continue;
        DedupWindow w{uint8_t(days), start, end};
        Result<DedupWindow> back = ParseWindow(FormatWindow(w));
        INFO(FormatWindow(w));
        REQUIRE(back.ok());
        CHECK(*back == w);
      }
    }
  }
}

TEST_CASE("policy priorities have stable names and values", "[policy]") {
  CHECK(static_cast<uint32_t>(DedupPriority::kIdle) == 1);
  CHECK(static_cast<uint32_t>(DedupPriority::kLow) == 2);
  CHECK(static_cast<uint32_t>(DedupPriority::kNormal) == 3);
  for (DedupPriority p : {DedupPriority::kIdle, DedupPriority::kLow, DedupPriority::kNormal}) {
    CHECK(ParsePriority(PriorityName(p)) == p);
  }
  CHECK(ParsePriority("NORMAL") == DedupPriority::kNormal);
  CHECK(!ParsePriority("high"));
  CHECK(!ParsePriority(""));
  CHECK(DedupPolicy{}.priority == DedupPriority::kLow);
}

// ---------------------------------------------------------------- time

TEST_CASE("policy InWindow on local minutes", "[policy]") {
  const std::vector<DedupWindow> none;
  CHECK(InWindow(none, LocalMinute{3, 700}));

  const std::vector<DedupWindow> nights = {W("mon-fri 01:00-05:00")};
  CHECK(!InWindow(nights, LocalMinute{0, 59}));
  CHECK(InWindow(nights, LocalMinute{0, 60}));
  CHECK(InWindow(nights, LocalMinute{4, 299}));
  CHECK(!InWindow(nights, LocalMinute{4, 300}));
  CHECK(!InWindow(nights, LocalMinute{5, 120}));

  // Crossing midnight: Fri 22:00 .. Sat 02:00 only.
  const std::vector<DedupWindow> friday_night = {W("fri 22:00-02:00")};
  CHECK(!InWindow(friday_night, LocalMinute{4, 1319}));
  CHECK(InWindow(friday_night, LocalMinute{4, 1320}));
  CHECK(InWindow(friday_night, LocalMinute{4, 1439}));
  CHECK(InWindow(friday_night, LocalMinute{5, 0}));
  CHECK(InWindow(friday_night, LocalMinute{5, 119}));
  CHECK(!InWindow(friday_night, LocalMinute{5, 120}));
  CHECK(!InWindow(friday_night, LocalMinute{4, 60}));    // Friday early morning: Thursday's
  CHECK(!InWindow(friday_night, LocalMinute{5, 1320}));  // Saturday evening: not listed

  // Sunday night into Monday morning wraps the week.
  const std::vector<DedupWindow> sunday_night = {W("sun 23:00-03:00")};
  CHECK(InWindow(sunday_night, LocalMinute{6, 1380}));
  CHECK(InWindow(sunday_night, LocalMinute{0, 0}));
  CHECK(InWindow(sunday_night, LocalMinute{0, 179}));
  CHECK(!InWindow(sunday_night, LocalMinute{0, 180}));
  CHECK(!InWindow(sunday_night, LocalMinute{0, 1380}));

  // Any window of several.
  const std::vector<DedupWindow> two = {W("mon 01:00-02:00"), W("sat,sun 00:00-24:00")};
  CHECK(InWindow(two, LocalMinute{0, 90}));
  CHECK(InWindow(two, LocalMinute{6, 1439}));
  CHECK(!InWindow(two, LocalMinute{0, 120}));
}

TEST_CASE("policy local minutes follow localtime", "[policy]") {
  // 2024-01-08 is a Monday.
  LocalMinute t = ToLocalMinute(LocalEpoch(2024, 1, 8, 3, 15) + 59 * kNsPerSec);
  CHECK(t.weekday_mon0 == 0);
  CHECK(t.minute == 195);
  t = ToLocalMinute(LocalEpoch(2024, 1, 14, 23, 59));
  CHECK(t.weekday_mon0 == 6);
  CHECK(t.minute == 1439);

  DedupPolicy p = PolicyWith("fri 22:00-02:00");
  CHECK(InWindow(p, LocalEpoch(2024, 1, 13, 1, 30)));  // Saturday 01:30
  CHECK(!InWindow(p, LocalEpoch(2024, 1, 13, 2, 0)));
  CHECK(CurrentWindowText(p, LocalEpoch(2024, 1, 12, 23, 0)) == "fri 22:00-02:00");
  CHECK(CurrentWindowText(p, LocalEpoch(2024, 1, 12, 21, 0)).empty());
  CHECK(CurrentWindowText(DedupPolicy{}, LocalEpoch(2024, 1, 12, 21, 0)).empty());
  CHECK(InWindow(DedupPolicy{}, LocalEpoch(2024, 1, 12, 21, 0)));
}

TEST_CASE("policy NextWindowChange finds the next edge in local time", "[policy]") {
  DedupPolicy p = PolicyWith("mon-fri 01:00-05:00");
  // Monday 2024-01-08.
  CHECK(NextWindowChange(p, LocalEpoch(2024, 1, 8, 0, 30)) == LocalEpoch(2024, 1, 8, 1, 0));
  CHECK(NextWindowChange(p, LocalEpoch(2024, 1, 8, 0, 59) + 30 * kNsPerSec) ==
        LocalEpoch(2024, 1, 8, 1, 0));
  CHECK(NextWindowChange(p, LocalEpoch(2024, 1, 8, 3, 0)) == LocalEpoch(2024, 1, 8, 5, 0));
  // Exactly on an edge: the next one.
  CHECK(NextWindowChange(p, LocalEpoch(2024, 1, 8, 1, 0)) == LocalEpoch(2024, 1, 8, 5, 0));
  // Friday after the window: Monday's.
  CHECK(NextWindowChange(p, LocalEpoch(2024, 1, 12, 6, 0)) == LocalEpoch(2024, 1, 15, 1, 0));

  // Crossing midnight and the week.
  p = PolicyWith("fri 22:00-02:00");
  CHECK(NextWindowChange(p, LocalEpoch(2024, 1, 12, 23, 0)) == LocalEpoch(2024, 1, 13, 2, 0));
  p = PolicyWith("sun 23:00-03:00");
  CHECK(NextWindowChange(p, LocalEpoch(2024, 1, 14, 23, 30)) == LocalEpoch(2024, 1, 15, 3, 0));
  CHECK(NextWindowChange(p, LocalEpoch(2024, 1, 15, 4, 0)) == LocalEpoch(2024, 1, 21, 23, 0));

  // Touching windows are one stretch: no change where they meet.
  p = PolicyWith("mon 20:00-22:00;mon 22:00-23:00");
  CHECK(NextWindowChange(p, LocalEpoch(2024, 1, 8, 21, 0)) == LocalEpoch(2024, 1, 8, 23, 0));

  // Never changes.
  CHECK(!NextWindowChange(DedupPolicy{}, LocalEpoch(2024, 1, 8, 0, 0)));
  CHECK(!NextWindowChange(PolicyWith("daily 00:00-24:00"), LocalEpoch(2024, 1, 8, 0, 0)));
  CHECK(!NextWindowChange(PolicyWith("mon-wed 00:00-24:00;thu-sun 00:00-24:00"),
                          LocalEpoch(2024, 1, 10, 12, 0)));
}

TEST_CASE("policy NextWindowChange agrees with minute by minute stepping", "[policy]") {
  const std::vector<std::string> lists = {"mon-fri 01:00-05:00;sat,sun 00:00-24:00",
                                          "fri 22:00-02:00", "daily 23:59-00:01",
                                          "tue,thu 12:00-12:01;sun 23:00-24:00", "mon 00:00-24:00"};
  const uint64_t start = LocalEpoch(2024, 1, 8, 0, 0);
  for (const std::string& list : lists) {
    const DedupPolicy p = PolicyWith(list);
    for (uint64_t t = start; t < start + 8 * 24 * 60 * kNsPerMin; t += 397 * kNsPerMin + 13) {
      const bool now = InWindow(p, t);
      uint64_t expect = (t / kNsPerMin + 1) * kNsPerMin;
      while (InWindow(p, expect) == now) expect += kNsPerMin;
      INFO(list << " from " << t);
      CHECK(NextWindowChange(p, t) == expect);
    }
  }
}

TEST_CASE("policy NextWindowChange follows the local clock across DST changes", "[policy]") {
  // Central European time by POSIX rule (no zoneinfo files needed): on
  // 2024-03-31 02:00 CET becomes 03:00 CEST; on 2024-10-27 03:00 CEST
  // becomes 02:00 CET.
  ScopedTimeZone tz("CET-1CEST,M3.5.0,M10.5.0/3");
  // Spring: 01:30 local is in 01:00-02:30; the clock jumps past 02:30 at
  // 01:00 UTC, which is where the window closes.
  DedupPolicy p = PolicyWith("daily 01:00-02:30");
  CHECK(NextWindowChange(p, 1711846800ull * kNsPerSec - 30 * kNsPerMin) ==
        1711846800ull * kNsPerSec);
  // A window inside the skipped hour does not open that day.
  p = PolicyWith("daily 02:15-02:45");
  CHECK(NextWindowChange(p, LocalEpoch(2024, 3, 31, 0, 0)) == LocalEpoch(2024, 4, 1, 2, 15));
  // Autumn: 02:45 CEST is in 02:30-04:00; at 01:00 UTC the clock goes
  // back to 02:00 CET, out of the window, and 02:30 CET reopens it.
  p = PolicyWith("daily 02:30-04:00");
  CHECK(NextWindowChange(p, 1729989000ull * kNsPerSec + 15 * kNsPerMin) ==
        1729990800ull * kNsPerSec);
  CHECK(NextWindowChange(p, 1729990800ull * kNsPerSec) ==
        1729990800ull * kNsPerSec + 30 * kNsPerMin);
}

TEST_CASE("policy windows follow a time-zone change once the zone is reloaded", "[policy]") {
  ScopedTimeZone utc("UTC0");
  // Monday 2024-01-08 02:00 UTC.
  const uint64_t t = 1704679200ull * kNsPerSec;
  const DedupPolicy p = PolicyWith("daily 01:00-05:00");
  REQUIRE(InWindow(p, t));
  CHECK(ReloadTimeZone(t).empty());  // nothing changed
  // The zone changes under the process, as a new /etc/localtime does:
  // localtime_r keeps the zone it read until the reload.
  setenv("TZ", "JST-9", 1);
  CHECK(ReloadTimeZone(t) == "UTC+00:00 (UTC) -> UTC+09:00 (JST)");
  LocalMinute m = ToLocalMinute(t);
  CHECK(m.weekday_mon0 == 0);
  CHECK(m.minute == 11 * 60);
  CHECK_FALSE(InWindow(p, t));
  CHECK(ReloadTimeZone(t).empty());
  // West of UTC by a half hour: the local day is the Sunday before.
  setenv("TZ", "<-0330>3:30", 1);
  CHECK(ReloadTimeZone(t) == "UTC+09:00 (JST) -> UTC-03:30 (-0330)");
  m = ToLocalMinute(t);
  CHECK(m.weekday_mon0 == 6);
  CHECK(m.minute == 22 * 60 + 30);
  CHECK_FALSE(InWindow(p, t));
  CHECK(InWindow(PolicyWith("sun 22:00-23:00"), t));
}

// ---------------------------------------------------------------- codec

TEST_CASE("policy blocks round trip", "[policy]") {
  const DedupPolicy p = SamplePolicy();
  for (uint32_t slot = 0; slot < kPolicySlots; slot++) {
    std::vector<uint8_t> blk = Encoded(p, slot);
    CHECK(DecodeU32(blk.data()) == kMagicPolicy);
    CHECK(std::memcmp(blk.data(), "DDPO", 4) == 0);
    Result<DedupPolicy> back = DecodePolicyBlock(blk.data(), kUuid, kPolicyFile, slot);
    REQUIRE(back.ok());
    CHECK(SamePolicy(*back, p));
    // Canonical: re-encoding gives the same bytes.
    CHECK(Encoded(*back, slot) == blk);
  }
  // No windows, and the most windows.
  DedupPolicy q = SamplePolicy();
  q.windows.clear();
  Result<DedupPolicy> back = DecodePolicyBlock(Encoded(q).data(), kUuid, kPolicyFile, 0);
  REQUIRE(back.ok());
  CHECK(SamePolicy(*back, q));
  for (uint32_t i = 0; i < kMaxPolicyWindows; i++) {
    q.windows.push_back(DedupWindow{uint8_t(1 + i % 0x7f), uint16_t(i), uint16_t(1440 - i)});
  }
  back = DecodePolicyBlock(Encoded(q).data(), kUuid, kPolicyFile, 0);
  REQUIRE(back.ok());
  CHECK(SamePolicy(*back, q));
}

TEST_CASE("policy encoding refuses what could not be read back", "[policy]") {
  std::vector<uint8_t> blk(kBlockSize);
  DedupPolicy p = SamplePolicy();
  CHECK(EncodePolicyBlock(p, kUuid, kPolicyFile, 2, blk.data()).code() == Status::Code::kInvalid);
  p.generation = 0;
  CHECK(EncodePolicyBlock(p, kUuid, kPolicyFile, 0, blk.data()).code() == Status::Code::kInvalid);
  p = SamplePolicy();
  p.priority = static_cast<DedupPriority>(9);
  CHECK(EncodePolicyBlock(p, kUuid, kPolicyFile, 0, blk.data()).code() == Status::Code::kInvalid);
  p = SamplePolicy();
  p.windows.push_back(DedupWindow{0x7f, 600, 600});
  CHECK(EncodePolicyBlock(p, kUuid, kPolicyFile, 0, blk.data()).code() == Status::Code::kInvalid);
  p = SamplePolicy();
  p.windows.push_back(DedupWindow{0x80, 0, 1440});
  CHECK(EncodePolicyBlock(p, kUuid, kPolicyFile, 0, blk.data()).code() == Status::Code::kInvalid);
  p = SamplePolicy();
  p.windows.assign(kMaxPolicyWindows + 1, DedupWindow{});
  CHECK(EncodePolicyBlock(p, kUuid, kPolicyFile, 0, blk.data()).code() == Status::Code::kInvalid);
}

// A stable-after past the cap (earlier versions wrote any value) is kept
// as written, round trips, and counts as the cap: in nanoseconds,
// 18446744074 s wrapped to 0.3 s and blocks were shared almost at once.
TEST_CASE("policy stable-after counts at most a year", "[policy]") {
  std::vector<uint8_t> blk(kBlockSize);
  DedupPolicy p = SamplePolicy();
  p.stable_after_s = 18446744074ull;
  REQUIRE(EncodePolicyBlock(p, kUuid, kPolicyFile, 0, blk.data()).ok());
  Result<DedupPolicy> r = DecodePolicyBlock(blk.data(), kUuid, kPolicyFile, 0);
  REQUIRE(r.ok());
  CHECK(r->stable_after_s == 18446744074ull);
  CHECK(StableAfterNs(*r) == kMaxStableAfterS * 1'000'000'000ull);
  p.stable_after_s = 90;
  CHECK(StableAfterNs(p) == 90'000'000'000ull);
}

TEST_CASE("policy blocks reject every single byte corruption", "[policy]") {
  const std::vector<uint8_t> good = Encoded(SamplePolicy(), 1);
  for (size_t i = 0; i < kBlockSize; i++) {
    for (uint8_t flip : {uint8_t(0x01), uint8_t(0x80), uint8_t(0xff)}) {
      std::vector<uint8_t> bad = good;
      bad[i] ^= flip;
      Result<DedupPolicy> r = DecodePolicyBlock(bad.data(), kUuid, kPolicyFile, 1);
      if (r.ok()) FAIL("byte " << i << " ^ " << int(flip) << " accepted");
      if (r.status().code() != Status::Code::kCorruption) {
        FAIL("byte " << i << ": " << r.status().ToString());
      }
    }
  }
  // A torn write: the first sectors new, the rest zeros.
  std::vector<uint8_t> torn = good;
  std::memset(torn.data() + 512, 0, kBlockSize - 512);
  torn[600] = 1;
  CHECK(DecodeCode(torn, 1) == Status::Code::kCorruption);
  std::vector<uint8_t> zeros(kBlockSize);
  CHECK(DecodeCode(zeros, 1) == Status::Code::kCorruption);
}

TEST_CASE("policy blocks are bound to their volume file and slot", "[policy]") {
  const std::vector<uint8_t> blk = Encoded(SamplePolicy(), 0);
  CHECK(DecodePolicyBlock(blk.data(), kUuid, kPolicyFile, 0).ok());
  CHECK(DecodePolicyBlock(blk.data(), kOtherUuid, kPolicyFile, 0).status().code() ==
        Status::Code::kCorruption);
  CHECK(DecodePolicyBlock(blk.data(), kUuid, FileId{kPolicyFile.ino + 1, kPolicyFile.generation}, 0)
            .status()
            .code() == Status::Code::kCorruption);
  CHECK(DecodePolicyBlock(blk.data(), kUuid, FileId{kPolicyFile.ino, kPolicyFile.generation + 1}, 0)
            .status()
            .code() == Status::Code::kCorruption);
  Result<DedupPolicy> other_slot = DecodePolicyBlock(blk.data(), kUuid, kPolicyFile, 1);
  CHECK(other_slot.status().code() == Status::Code::kCorruption);
  CHECK(other_slot.status().message().find("slot 1") != std::string::npos);
  CHECK(other_slot.status().message().find("checksum") != std::string::npos);
}

TEST_CASE("policy blocks check the fields behind the crc", "[policy]") {
  const std::vector<uint8_t> good = Encoded(SamplePolicy(), 0);
  auto edited = [&](size_t off, auto encode) {
    std::vector<uint8_t> b = good;
    encode(b.data() + off);
    Reseal(&b);
    return b;
  };
  auto expect = [&](const std::vector<uint8_t>& b, Status::Code code, const std::string& words) {
    Result<DedupPolicy> r = DecodePolicyBlock(b.data(), kUuid, kPolicyFile, 0);
    INFO(r.status().ToString());
    CHECK(r.status().code() == code);
    CHECK(r.status().message().find(words) != std::string::npos);
    CHECK(r.status().message().find(".dede-policy' slot 0") != std::string::npos);
  };
  expect(edited(4, [](uint8_t* p) { EncodeU16(p, 2); }), Status::Code::kUnsupported,
         "newer than this dede supports");
  expect(edited(4, [](uint8_t* p) { EncodeU16(p, 0); }), Status::Code::kCorruption,
         "format version 0");
  expect(edited(12, [](uint8_t* p) { EncodeU32(p, 1); }), Status::Code::kCorruption,
         "unknown flags");
  expect(edited(16, [](uint8_t* p) { EncodeU64(p, 0); }), Status::Code::kCorruption,
         "generation 0");
  expect(edited(48, [](uint8_t* p) { EncodeU32(p, 4); }), Status::Code::kCorruption,
         "unknown priority 4");
  expect(edited(48, [](uint8_t* p) { EncodeU32(p, 0); }), Status::Code::kCorruption,
         "unknown priority 0");
  expect(edited(56, [](uint8_t* p) { EncodeU32(p, 1); }), Status::Code::kCorruption,
         "claims slot 1");
  expect(edited(60, [](uint8_t* p) { EncodeU32(p, 65); }), Status::Code::kCorruption, "65 windows");
  expect(edited(60, [](uint8_t* p) { EncodeU32(p, 2); }), Status::Code::kCorruption,
         "past the windows is not zero");
  expect(edited(64, [](uint8_t* p) { p[0] = 0; }), Status::Code::kCorruption, "window 0: days");
  expect(edited(64, [](uint8_t* p) { p[1] = 1; }), Status::Code::kCorruption, "window 0: reserved");
  expect(edited(72, [](uint8_t* p) { EncodeU16(p + 2, 1440); }), Status::Code::kCorruption,
         "window 1: start minute 1440");
  expect(edited(72, [](uint8_t* p) { EncodeU16(p + 4, 1441); }), Status::Code::kCorruption,
         "window 1: end minute 1441");
  expect(edited(72, [](uint8_t* p) { EncodeU16(p + 4, 0); }), Status::Code::kCorruption,
         "window 1: end minute 0");
  expect(edited(64, [](uint8_t* p) { EncodeU16(p + 4, DecodeU16(p + 2)); }),
         Status::Code::kCorruption, "window 0: start and end are both 01:00");
  expect(edited(72, [](uint8_t* p) { EncodeU16(p + 6, 9); }), Status::Code::kCorruption,
         "window 1: reserved");
  expect(edited(4000, [](uint8_t* p) { p[0] = 1; }), Status::Code::kCorruption,
         "byte 4000 past the windows");

  {
    std::vector<uint8_t> b = good;
    EncodeU32(b.data(), 0x12345678);
    expect(b, Status::Code::kCorruption, "bad magic 0x12345678");
  }
  // A newer minor may use the reserved bytes.
  std::vector<uint8_t> newer = edited(6, [](uint8_t* p) { EncodeU16(p, kPolicyMinor + 1); });
  newer[4000] = 7;
  newer[64 + 1] = 3;
  Reseal(&newer);
  Result<DedupPolicy> r = DecodePolicyBlock(newer.data(), kUuid, kPolicyFile, 0);
  REQUIRE(r.ok());
  CHECK(SamePolicy(*r, SamplePolicy()));
}

// ---------------------------------------------------------------- volume

TEST_CASE("policy on a volume is the default until written", "[policy]") {
  TestVolume tv;
  Result<DedupPolicy> p = ReadPolicy(tv.vol.get());
  REQUIRE(p.ok());
  CHECK(p->generation == 0);
  CHECK(p->windows.empty());
  CHECK(p->rate_bytes_per_s == 0);
  CHECK(p->priority == DedupPriority::kLow);
  CHECK(p->stable_after_s == 0);
  CHECK(!tv.vol->Lookup(kPolicyFileName).ok());  // reading creates nothing
  // A policy file created but never written (a writer died) reads as the default too.
  REQUIRE(tv.vol->Create(kPolicyFileName, 2 * kBlockSize, FileKind::kSystem).ok());
  p = ReadPolicy(tv.vol.get());
  REQUIRE(p.ok());
  CHECK(p->generation == 0);
}

TEST_CASE("policy writes alternate slots and read back the newest", "[policy]") {
  TestVolume tv;
  ManualClock clock(1'700'000'000'000'000'000ull);
  DedupPolicy want = SamplePolicy();
  REQUIRE(WritePolicy(tv.vol.get(), want, &clock).ok());
  Result<DedupPolicy> got = ReadPolicy(tv.vol.get());
  REQUIRE(got.ok());
  want.generation = 1;
  want.updated_ns = clock.NowNanos();
  want.updated_by_host = tv.vol->host_id();
  CHECK(want.updated_by_host != 0);
  CHECK(SamePolicy(*got, want));
  auto info = tv.vol->Lookup(kPolicyFileName);
  REQUIRE(info.ok());
  CHECK(info->kind == FileKind::kSystem);
  CHECK(info->size == 2 * kBlockSize);

  const FileId id = PolicyFileId(tv.vol.get());
  const Uuid& uuid = tv.vol->superblock().uuid;
  for (uint64_t gen = 2; gen <= 5; gen++) {
    clock.Advance(kNsPerSec);
    want.rate_bytes_per_s = gen * 1'000'000;
    REQUIRE(WritePolicy(tv.vol.get(), want, &clock).ok());
    got = ReadPolicy(tv.vol.get());
    REQUIRE(got.ok());
    CHECK(got->generation == gen);
    CHECK(got->rate_bytes_per_s == gen * 1'000'000);
    CHECK(got->updated_ns == clock.NowNanos());
    // Generation g lives in slot (g - 1) % 2; the other slot keeps g - 1.
    const uint32_t slot = uint32_t((gen - 1) % 2);
    Result<DedupPolicy> in_slot =
        DecodePolicyBlock(ReadSlot(tv.vol.get(), slot).data(), uuid, id, slot);
    REQUIRE(in_slot.ok());
    CHECK(in_slot->generation == gen);
    Result<DedupPolicy> other =
        DecodePolicyBlock(ReadSlot(tv.vol.get(), 1 - slot).data(), uuid, id, 1 - slot);
    REQUIRE(other.ok());
    CHECK(other->generation == gen - 1);
  }
  // Durable across a reopen.
  tv.Reopen();
  got = ReadPolicy(tv.vol.get());
  REQUIRE(got.ok());
  CHECK(got->generation == 5);
  CHECK(got->windows == SamplePolicy().windows);
}

TEST_CASE("policy falls back to the older slot when the newer one is torn", "[policy]") {
  TestVolume tv;
  DedupPolicy p = SamplePolicy();
  p.rate_bytes_per_s = 1;
  REQUIRE(WritePolicy(tv.vol.get(), p).ok());  // gen 1, slot 0
  p.rate_bytes_per_s = 2;
  REQUIRE(WritePolicy(tv.vol.get(), p).ok());  // gen 2, slot 1
  p.rate_bytes_per_s = 3;
  REQUIRE(WritePolicy(tv.vol.get(), p).ok());  // gen 3, slot 0

  // Slot 0 torn: its second half never made it.
  std::vector<uint8_t> blk = ReadSlot(tv.vol.get(), 0);
  std::memset(blk.data() + 40, 0xee, kBlockSize - 40);
  WriteSlot(tv.vol.get(), 0, blk);
  Result<DedupPolicy> got = ReadPolicy(tv.vol.get());
  REQUIRE(got.ok());
  CHECK(got->generation == 2);
  CHECK(got->rate_bytes_per_s == 2);

  // The next write goes over the torn slot, above every generation seen.
  p.rate_bytes_per_s = 4;
  REQUIRE(WritePolicy(tv.vol.get(), p).ok());
  got = ReadPolicy(tv.vol.get());
  REQUIRE(got.ok());
  CHECK(got->generation == 3);
  CHECK(got->rate_bytes_per_s == 4);
  const FileId id = PolicyFileId(tv.vol.get());
  CHECK(DecodePolicyBlock(ReadSlot(tv.vol.get(), 0).data(), tv.vol->superblock().uuid, id, 0)
            ->generation == 3);
  CHECK(DecodePolicyBlock(ReadSlot(tv.vol.get(), 1).data(), tv.vol->superblock().uuid, id, 1)
            ->generation == 2);

  // Both slots bad: kCorruption naming both, until a write repairs it.
  std::vector<uint8_t> junk(kBlockSize, 0x5a);
  WriteSlot(tv.vol.get(), 0, junk);
  WriteSlot(tv.vol.get(), 1, junk);
  got = ReadPolicy(tv.vol.get());
  CHECK(got.status().code() == Status::Code::kCorruption);
  CHECK(got.status().message().find("slot 0") != std::string::npos);
  CHECK(got.status().message().find("slot 1") != std::string::npos);
  Result<DedupPolicy> repaired = UpdatePolicy(tv.vol.get(), [](DedupPolicy* cur) {
    cur->priority = DedupPriority::kNormal;
    return Status::Ok();
  });
  REQUIRE(repaired.ok());
  CHECK(repaired->generation == 1);
  CHECK(repaired->rate_bytes_per_s == 0);  // started over from the default
  got = ReadPolicy(tv.vol.get());
  REQUIRE(got.ok());
  CHECK(got->priority == DedupPriority::kNormal);
}

TEST_CASE("policy of a newer major version is neither followed nor overwritten", "[policy]") {
  TestVolume tv;
  DedupPolicy p = SamplePolicy();
  REQUIRE(WritePolicy(tv.vol.get(), p).ok());  // gen 1, slot 0
  REQUIRE(WritePolicy(tv.vol.get(), p).ok());  // gen 2, slot 1
  const FileId id = PolicyFileId(tv.vol.get());
  std::vector<uint8_t> blk = ReadSlot(tv.vol.get(), 1);
  EncodeU16(blk.data() + 4, kPolicyMajor + 1);
  EncodeU32(blk.data() + 8, FileBlockCrc(blk.data(), 8, tv.vol->superblock().uuid, id, 1));
  WriteSlot(tv.vol.get(), 1, blk);
  CHECK(ReadPolicy(tv.vol.get()).status().code() == Status::Code::kUnsupported);
  CHECK(WritePolicy(tv.vol.get(), p).code() == Status::Code::kUnsupported);
  CHECK(ReadSlot(tv.vol.get(), 1) == blk);
}

TEST_CASE("policy update keeps the keys it does not change", "[policy]") {
  TestVolume tv;
  REQUIRE(WritePolicy(tv.vol.get(), SamplePolicy()).ok());
  Result<DedupPolicy> p = UpdatePolicy(tv.vol.get(), [](DedupPolicy* cur) {
    cur->stable_after_s = 60;
    return Status::Ok();
  });
  REQUIRE(p.ok());
  CHECK(p->generation == 2);
  CHECK(p->stable_after_s == 60);
  CHECK(p->windows == SamplePolicy().windows);
  CHECK(p->rate_bytes_per_s == SamplePolicy().rate_bytes_per_s);
  // A change that fails writes nothing.
  Result<DedupPolicy> failed =
      UpdatePolicy(tv.vol.get(), [](DedupPolicy*) { return Status::Invalid("no thanks"); });
  CHECK(failed.status().code() == Status::Code::kInvalid);
  CHECK(ReadPolicy(tv.vol.get())->generation == 2);
  // A change that makes an unencodable policy writes nothing either.
  failed = UpdatePolicy(tv.vol.get(), [](DedupPolicy* cur) {
    cur->windows.push_back(DedupWindow{0, 0, 1});
    return Status::Ok();
  });
  CHECK(failed.status().code() == Status::Code::kInvalid);
  CHECK(ReadPolicy(tv.vol.get())->generation == 2);
}

TEST_CASE("policy readers and writers meet on the file lock", "[policy]") {
  TestVolume tv;
  REQUIRE(WritePolicy(tv.vol.get(), SamplePolicy()).ok());
  auto held = tv.vol->OpenFile(kPolicyFileName);
  REQUIRE(held.ok());
  // A reader does not wait: the caller keeps its old policy.
  CHECK(ReadPolicy(tv.vol.get()).status().code() == Status::Code::kLocked);
  // A writer waits for the holder to let go.
  std::thread releaser([&held] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    held->reset();
  });
  Status st = WritePolicy(tv.vol.get(), SamplePolicy());
  releaser.join();
  REQUIRE(st.ok());
  CHECK(ReadPolicy(tv.vol.get())->generation == 2);
}

TEST_CASE("policy file of the wrong kind is not taken for the policy", "[policy]") {
  TestVolume tv;
  REQUIRE(tv.vol->Create(kPolicyFileName, 2 * kBlockSize).ok());
  Result<DedupPolicy> p = ReadPolicy(tv.vol.get());
  CHECK(p.status().code() == Status::Code::kCorruption);
  CHECK(p.status().message().find("not the dedup policy") != std::string::npos);
  CHECK(WritePolicy(tv.vol.get(), SamplePolicy()).code() == Status::Code::kCorruption);
}

namespace {

// A volume on which the policy file is never there to open, and always
// there to create: what two hosts racing to remove and create it look
// like to a third, every round. Everything else goes to `inner`.
class VanishingPolicyVolume : public Volume {
 public:
  // Rounds after which Create stops the loop itself, so that a caller
  // without a bound of its own fails this test instead of hanging it.
  static constexpr int kTestGivesUpAfter = 1000;
  explicit VanishingPolicyVolume(Volume* inner) : inner_(inner) {}
  int creates() const { return creates_; }

  const Superblock& superblock() const override { return inner_->superblock(); }
  uint32_t host_id() const override { return inner_->host_id(); }
  LockManager* lock_manager() const override { return inner_->lock_manager(); }
  Result<FileId> Create(const std::string& name, uint64_t size, FileKind kind,
                        uint64_t owner_ino) override {
    if (name != kPolicyFileName) return inner_->Create(name, size, kind, owner_ino);
    if (++creates_ > kTestGivesUpAfter) return Status::Invalid("the test stopped the loop");
    return Status::Exists("file '" + name + "' exists");
  }
  Result<FileInfo> Lookup(const std::string& name) override { return inner_->Lookup(name); }
  Result<std::vector<FileInfo>> List() override { return inner_->List(); }
  Status Remove(const std::string& name) override { return inner_->Remove(name); }
  Status RemoveOpen(std::unique_ptr<File> f) override { return inner_->RemoveOpen(std::move(f)); }
  Result<std::unique_ptr<File>> OpenFile(const std::string& name) override {
    if (name == kPolicyFileName) return Status::NotFound("no file named '" + name + "'");
    return inner_->OpenFile(name);
  }
  Result<std::unique_ptr<File>> OpenFileById(FileId id) override {
    return inner_->OpenFileById(id);
  }
  Status AnnounceOpenWait(FileId id, bool on) override { return inner_->AnnounceOpenWait(id, on); }
  bool IsOpenHere(const std::string& name) override { return inner_->IsOpenHere(name); }
  Status CompareAndShare(File* src, uint64_t src_index, File* dst, uint64_t dst_index,
                         VerifyMode mode, const Fingerprint* witness) override {
    return inner_->CompareAndShare(src, src_index, dst, dst_index, mode, witness);
  }
  using Volume::CloneBlock;
  Status CloneBlock(File* src, uint64_t src_index, File* dst, uint64_t dst_index,
                    const BlockOpsOptions& options) override {
    return inner_->CloneBlock(src, src_index, dst, dst_index, options);
  }
  using Volume::ApplyBlockOps;
  Status ApplyBlockOps(std::vector<BlockOp>* ops, VerifyMode mode, ReadBuffer* buffer,
                       const BlockOpsOptions& options) override {
    return inner_->ApplyBlockOps(ops, mode, buffer, options);
  }
  Status Sync() override { return inner_->Sync(); }
  Result<VolumeStats> Stats() override { return inner_->Stats(); }
  DropCounters drop_counters() override { return inner_->drop_counters(); }
  WaitCounters wait_counters() override { return inner_->wait_counters(); }
  ReservationCounters reservation_counters() override { return inner_->reservation_counters(); }
  FlushCounters flush_counters() override { return inner_->flush_counters(); }

 private:
  Volume* const inner_;
  int creates_ = 0;
};

}  // namespace

// An update that found the file missing, then found it created by
// another host, looped on that with no bound: a file that keeps coming
// and going held `dede policy set` forever.
TEST_CASE("policy update gives up on a policy file that keeps vanishing", "[policy]") {
  TestVolume tv;
  VanishingPolicyVolume vanishing(tv.vol.get());
  const auto start = std::chrono::steady_clock::now();
  Status st = WritePolicy(&vanishing, SamplePolicy());
  const auto took = std::chrono::steady_clock::now() - start;
  INFO(st.ToString() << " after " << vanishing.creates() << " creates");
  CHECK(st.code() == Status::Code::kNotFound);
  CHECK(st.message().find(kPolicyFileName) != std::string::npos);
  CHECK(st.message().find("gave up") != std::string::npos);
  CHECK(vanishing.creates() < VanishingPolicyVolume::kTestGivesUpAfter);
  CHECK(took < std::chrono::seconds(5));
}
