// The volume's dedup policy: when dedup may run (off-peak windows in local
// time), how much I/O it may use, at what priority, and how long a block
// must stay unchanged before it is shared.
//
// The policy lives on the shared volume, so every host follows the same one
// without a config file per host and without host-to-host messages: an
// admin changes it once (`dede policy VOL set ...`) and each dedupd picks
// it up at its next poll.
//
// On disk it is the file ".dede-policy" (FileKind::kSystem) with two 4 KiB
// slots, A (block 0) and B (block 1). Each slot holds one whole encoded
// policy (magic "DDPO") with a generation number; readers take the valid
// slot with the higher generation, and a writer overwrites the *other*
// slot, then flushes. A torn or lost write therefore leaves the previous
// policy readable. The byte layout, crc and decoding rules are
// docs/FORMAT.md section 15 (this header and dedup_policy.cc are its source
// of truth).
//
// Windows are evaluated in the host's local time zone (localtime_r), the
// way admins write them; hosts sharing a volume are expected to share a
// time zone.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "util/clock.h"
#include "util/status.h"
#include "volume/format.h"
#include "volume/volume.h"

namespace dede {

inline constexpr uint32_t kMagicPolicy = 0x4f504444;  // "DDPO"
inline constexpr uint16_t kPolicyMajor = 1;
inline constexpr uint16_t kPolicyMinor = 0;
inline constexpr char kPolicyFileName[] = ".dede-policy";
inline constexpr uint32_t kPolicySlots = 2;
inline constexpr uint32_t kPolicyHeaderBytes = 64;
inline constexpr uint32_t kPolicyWindowBytes = 8;
inline constexpr uint32_t kMaxPolicyWindows = 64;
inline constexpr uint16_t kMinutesPerDay = 1440;
inline constexpr uint8_t kAllDays = 0x7f;

// Days: bit 0 = Monday .. bit 6 = Sunday. Minutes since local midnight.
// start < end: same day; end < start: crosses midnight (the part after
// midnight belongs to the window of the previous day, i.e. "fri 22:00-02:00"
// covers Fri 22:00 .. Sat 02:00). end == 1440 means 24:00. start == end is
// invalid.
struct DedupWindow {
  uint8_t days = kAllDays;
  uint16_t start_min = 0;
  uint16_t end_min = kMinutesPerDay;
  bool operator==(const DedupWindow& o) const {
    return days == o.days && start_min == o.start_min && end_min == o.end_min;
  }
};

// On-disk values, never renumber.
enum class DedupPriority : uint32_t { kIdle = 1, kLow = 2, kNormal = 3 };

// Longest stable-after that counts (one year): `dede policy set` takes no
// more, and StableAfterNs reads more (earlier versions wrote any value)
// as this. Uncapped, a value turned into nanoseconds wraps (2^64 ns is
// 584 years), and a block would be shared almost at once.
inline constexpr uint64_t kMaxStableAfterS = 365ull * 24 * 3600;

struct DedupPolicy {
  std::vector<DedupWindow> windows;  // empty: dedup may run at any time (the default)
  uint64_t rate_bytes_per_s = 0;     // cap on dedup I/O; 0 = unlimited
  DedupPriority priority = DedupPriority::kLow;
  uint64_t stable_after_s = 0;  // share a block only after it stayed unchanged this long; 0 = off
                                // (counts up to kMaxStableAfterS: StableAfterNs)
  // Set by WritePolicy:
  uint64_t generation = 0;
  uint64_t updated_ns = 0;
  uint32_t updated_by_host = 0;
};

// The policy's stable-after in nanoseconds, capped at kMaxStableAfterS.
inline uint64_t StableAfterNs(const DedupPolicy& p) {
  return (p.stable_after_s < kMaxStableAfterS ? p.stable_after_s : kMaxStableAfterS) *
         1'000'000'000ull;
}

// ---------------------------------------------------------------- text

// "mon-fri 01:00-05:00", "sat,sun 00:00-24:00", "daily 22:00-04:00",
// "mon,wed-fri 1:00-5:30", "01:00-05:00" (no days: daily). Day names are
// mon..sun or monday..sunday, any case; a range may wrap ("fri-mon").
// "HH:MM-00:00" is read as "HH:MM-24:00". kInvalid names the input and
// what is wrong with it.
Result<DedupWindow> ParseWindow(const std::string& s);
// ';'-separated windows; "always" -> empty list (dedup at any time); ""
// is refused (an unset variable must not remove every window).
// At most kMaxPolicyWindows.
Result<std::vector<DedupWindow>> ParseWindowList(const std::string& s);
// Canonical text ("daily", runs of three or more days as "mon-fri", others
// as a comma list, two-digit times), round-trips through ParseWindow.
std::string FormatWindow(const DedupWindow& w);
// Checks the invariants above (days 1..0x7f, start < 1440, 1 <= end <= 1440,
// start != end); kInvalid says which.
Status ValidateWindow(const DedupWindow& w);

const char* PriorityName(DedupPriority p);  // "idle", "low", "normal"

// A rate cap as `dede policy set rate=` takes it: "unlimited", "50 MB/s",
// "0.5 MB/s" (decimal megabytes, as rates are quoted).
std::string PolicyRateText(uint64_t bytes_per_s);
std::optional<DedupPriority> ParsePriority(const std::string& s);

// ---------------------------------------------------------------- time

// A moment in local time at minute granularity.
struct LocalMinute {
  int weekday_mon0;  // 0 = Monday .. 6 = Sunday
  int minute;        // 0..1439 since local midnight
};
// Host-local time (localtime_r) of a wall-clock time (Clock::NowNanos()).
LocalMinute ToLocalMinute(uint64_t epoch_ns);
// Takes up a change of the host's time zone (`timedatectl set-timezone`,
// a new /etc/localtime, or TZ changed in this process): localtime_r reads
// the zone once per process, so without this call windows would follow
// the zone dedupd started in until it restarted. It calls tzset(), which
// re-reads /etc/localtime when TZ is unset and the file changed. Returns
// the change at `epoch_ns` ("UTC+00:00 (UTC) -> UTC+09:00 (JST)") when
// the zone's offset or name differs from before the call, "" otherwise.
// Thread-safe (glibc serializes tzset and localtime_r).
std::string ReloadTimeZone(uint64_t epoch_ns);
// The zone in effect at `epoch_ns`, as ReloadTimeZone names it:
// "UTC+09:00 (JST)".
std::string TimeZoneText(uint64_t epoch_ns);

// Whether dedup may run at `t`: true when `ws` is empty.
bool InWindow(const std::vector<DedupWindow>& ws, LocalMinute t);
bool InWindow(const DedupPolicy& p, uint64_t epoch_ns);
// Epoch ns of the first minute boundary after `epoch_ns` at which
// InWindow(p, .) has another value than at `epoch_ns`; nullopt when it
// never changes (no windows, or windows covering the whole week). Follows
// the local clock through DST changes.
std::optional<uint64_t> NextWindowChange(const DedupPolicy& p, uint64_t epoch_ns);
// The first window that contains `epoch_ns`, as FormatWindow text (for logs
// and history); "" when none does or there are no windows.
std::string CurrentWindowText(const DedupPolicy& p, uint64_t epoch_ns);

// ---------------------------------------------------------------- codec

// Encodes `p` (its generation included) as the block of slot `slot` of the
// policy file `file` on the volume `uuid`. kInvalid for a policy that could
// not be read back (a bad window, more than kMaxPolicyWindows, an unknown
// priority, generation 0, slot >= kPolicySlots).
Status EncodePolicyBlock(const DedupPolicy& p, const Uuid& uuid, FileId file, uint32_t slot,
                         uint8_t* out /* kBlockSize bytes */);
// kCorruption (naming the slot and what is wrong) for a block that fails a
// check, including one of another volume, another policy file or the other
// slot; kUnsupported for a newer major version.
Result<DedupPolicy> DecodePolicyBlock(const uint8_t* blk, const Uuid& uuid, FileId file,
                                      uint32_t slot);

// ---------------------------------------------------------------- volume

// The volume's policy. No policy file (or one whose slots were never
// written): the default policy, generation 0. Opens the file (takes its
// lock) only while reading; kLocked passes through (a writer holds it this
// instant: keep the old policy and retry later). Both slots bad:
// kCorruption; a slot of a newer major version: kUnsupported (an older
// slot is not followed instead: it would silently be the wrong policy).
Result<DedupPolicy> ReadPolicy(Volume* vol);

// Read-modify-write under the policy file's lock, so concurrent changes
// from several hosts never lose one another's keys: reads the current
// policy (the default when there is none), lets `change` edit it (an error
// from it is returned and nothing is written), then writes it with
// generation = the highest on disk + 1, updated_ns = `clock`'s wall time
// (nullptr: Clock::Real()) and updated_by_host = vol->host_id(), into the
// slot that does not hold the newest policy, and flushes. Creates the file
// when missing; one that is missing again after each of 8 creates gives
// kNotFound naming it. Waits (up to about 10 s) while another process
// holds the file, then returns kLocked. Returns the policy as written.
Result<DedupPolicy> UpdatePolicy(Volume* vol, const std::function<Status(DedupPolicy*)>& change,
                                 Clock* clock = nullptr);
// UpdatePolicy that replaces the policy with `p` (its generation, time and
// host fields are ignored and set as above).
Status WritePolicy(Volume* vol, DedupPolicy p, Clock* clock = nullptr);

}  // namespace dede
