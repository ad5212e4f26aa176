// Fuzzes the dedup-policy decoder (agent/dedup_policy.h): DecodePolicyBlock,
// and the window text parser. The policy file is written by whichever host
// an admin ran `dede policy set` on and read by every dedupd: a slot that
// a torn write, damage or a bug left behind must be refused cleanly.
//
// Input: [selector u8][block...]. The selector's bit 0 is the slot the
// block is decoded as; the rest is one 4 KiB block (fuzz_util.h). Each
// input is also decoded as a "fixed-up" copy: magic, major, slot stamped
// in, the window count clamped to 0..65, and (selector bit 1) the bytes
// past the windows and the windows' reserved bytes cleared, then the crc
// recomputed, so the fuzzer reaches the checks behind the crc.
//
// Properties: an error is kCorruption or kUnsupported and names the policy
// file; a decoded policy keeps the invariants (generation > 0, a known
// priority, at most 64 windows, each valid) and re-encodes to exactly the
// input block when its minor version is this build's (a newer minor may
// carry bytes this build ignores); the same bytes are refused in the other
// slot, in another policy file and on another volume. Every window parsed
// from text formats back to text that parses to the same window.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "agent/dedup_policy.h"
#include "index/shard_format.h"
#include "tests/fuzz/fuzz_util.h"

using namespace dede;
using namespace dede::fuzz;

namespace {

constexpr const char* kTarget = "fuzz_policy";
constexpr size_t kPrefix = 1;
const FileId kPolicyFile{3, 1};
constexpr Uuid kOtherUuid = {0xde, 0xde, 0x00, 0x01, 0x02, 0x03, 0x44, 0x05,
                             0x86, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0e};

// Header field offsets (docs/FORMAT.md 15.2).
constexpr size_t kOffMajor = 4, kOffMinor = 6, kOffCrc = 8, kOffSlot = 56, kOffWindowCount = 60;

void CheckError(const Status& s) {
  FUZZ_CHECK(FailedCleanly(s), "error without a message");
  FUZZ_CHECK(s.code() == Status::Code::kCorruption || s.code() == Status::Code::kUnsupported,
             "unexpected error code: " + s.ToString());
  FUZZ_CHECK(s.message().find(kPolicyFileName) != std::string::npos,
             "error does not name the policy file: " + s.message());
}

void DecodeOne(const Blk& blk, uint32_t slot) {
  Result<DedupPolicy> r = DecodePolicyBlock(blk.data(), kFuzzUuid, kPolicyFile, slot);
  if (!r.ok()) {
    CheckError(r.status());
    return;
  }
  const DedupPolicy& p = *r;
  FUZZ_CHECK(p.generation != 0, "generation 0 accepted");
  FUZZ_CHECK(std::string(PriorityName(p.priority)) != "unknown", "unknown priority accepted");
  FUZZ_CHECK(p.windows.size() <= kMaxPolicyWindows, "too many windows");
  for (const DedupWindow& w : p.windows) {
    FUZZ_CHECK(ValidateWindow(w).ok(), "invalid window accepted");
    Result<DedupWindow> back = ParseWindow(FormatWindow(w));
    FUZZ_CHECK(back.ok() && *back == w, "window does not round trip as text");
  }
  // Canonical: this minor's policies re-encode to exactly their block.
  if (DecodeU16(blk.data() + kOffMinor) == kPolicyMinor &&
      DecodeU16(blk.data() + kOffMajor) == kPolicyMajor) {
    Blk again;
    FUZZ_CHECK(EncodePolicyBlock(p, kFuzzUuid, kPolicyFile, slot, again.data()).ok(),
               "decoded policy does not encode");
    FUZZ_CHECK(again == blk, "policy does not re-encode to its input");
  }
  // Bound to its slot, its file and its volume.
  FUZZ_CHECK(!DecodePolicyBlock(blk.data(), kFuzzUuid, kPolicyFile, 1 - slot).ok(),
             "policy accepted in the other slot");
  FUZZ_CHECK(!DecodePolicyBlock(blk.data(), kFuzzUuid,
                                FileId{kPolicyFile.ino, kPolicyFile.generation + 1}, slot)
                  .ok(),
             "policy accepted in another policy file");
  FUZZ_CHECK(!DecodePolicyBlock(blk.data(), kOtherUuid, kPolicyFile, slot).ok(),
             "policy accepted on another volume");
}

void FuzzBlock(const Blk& raw, uint8_t selector) {
  const uint32_t slot = selector & 1;
  DecodeOne(raw, slot);

  Blk fixed(raw);
  uint8_t* p = fixed.data();
  EncodeU32(p, kMagicPolicy);
  EncodeU16(p + kOffMajor, kPolicyMajor);
  if (selector & 4) EncodeU16(p + kOffMinor, kPolicyMinor);
  EncodeU32(p + kOffSlot, slot);
  const uint32_t count = DecodeU32(p + kOffWindowCount) % (kMaxPolicyWindows + 2);
  EncodeU32(p + kOffWindowCount, count);
  if (selector & 2) {
    const uint32_t used_windows = count < kMaxPolicyWindows ? count : kMaxPolicyWindows;
    const size_t used = kPolicyHeaderBytes + size_t(used_windows) * kPolicyWindowBytes;
    std::memset(p + used, 0, kBlockSize - used);
    EncodeU32(p + 12, 0);  // flags
    for (uint32_t i = 0; i < used_windows; i++) {
      uint8_t* w = p + kPolicyHeaderBytes + size_t(i) * kPolicyWindowBytes;
      w[1] = 0;
      EncodeU16(w + 6, 0);
    }
  }
  EncodeU32(p + kOffCrc, FileBlockCrc(p, kOffCrc, kFuzzUuid, kPolicyFile, slot));
  DecodeOne(fixed, slot);
}

void FuzzText(const uint8_t* data, size_t size) {
  const std::string s(reinterpret_cast<const char*>(data), size < 80 ? size : 80);
  Result<DedupWindow> w = ParseWindow(s);
  if (w.ok()) {
    FUZZ_CHECK(ValidateWindow(*w).ok(), "parsed an invalid window from '" + s + "'");
    Result<DedupWindow> back = ParseWindow(FormatWindow(*w));
    FUZZ_CHECK(back.ok() && *back == *w, "window text does not round trip: '" + s + "'");
  } else {
    FUZZ_CHECK(w.status().code() == Status::Code::kInvalid, "window text error code");
  }
  Result<std::vector<DedupWindow>> ws = ParseWindowList(s);
  if (ws.ok()) {
    FUZZ_CHECK(ws->size() <= kMaxPolicyWindows, "too many windows parsed");
    for (const DedupWindow& x : *ws) FUZZ_CHECK(ValidateWindow(x).ok(), "invalid window in list");
  }
}

std::vector<uint8_t> WithPrefix(uint8_t selector, const Blk& blk) {
  size_t len = kBlockSize;
  while (len > 0 && blk.data()[len - 1] == 0) len--;
  std::vector<uint8_t> v = {selector};
  v.insert(v.end(), blk.data(), blk.data() + len);
  return v;
}

std::vector<Blk> Seeds() {
  std::vector<std::vector<uint8_t>> inputs;
  const char* const lists[] = {"always", "mon-fri 01:00-05:00;sat,sun 00:00-24:00",
                               "daily 22:00-04:00",
                               "mon,wed-fri 01:00-05:30;fri 22:00-02:00;sun 23:00-03:00"};
  for (uint32_t which = 0; which < 4; which++) {
    DedupPolicy p;
    p.windows = ParseWindowList(lists[which]).value();
    p.rate_bytes_per_s = which * 25'000'000ull;
    p.priority = static_cast<DedupPriority>(1 + which % 3);
    p.stable_after_s = which * 3600;
    p.generation = 1 + which;
    p.updated_ns = 1'700'000'000'000'000'000ull + which;
    p.updated_by_host = 1 + which;
    const uint32_t slot = which & 1;
    Blk blk;
    if (!EncodePolicyBlock(p, kFuzzUuid, kPolicyFile, slot, blk.data()).ok()) {
      Fail(kTarget, "seed policy does not encode");
    }
    inputs.push_back(WithPrefix(uint8_t(slot), blk));
    inputs.push_back(WithPrefix(uint8_t(slot | 2), blk));
  }
  // A full table of windows.
  DedupPolicy full;
  for (uint32_t i = 0; i < kMaxPolicyWindows; i++) {
    full.windows.push_back(DedupWindow{uint8_t(1 + i), uint16_t(i * 20), uint16_t(1440 - i * 7)});
  }
  full.generation = 99;
  Blk blk;
  if (!EncodePolicyBlock(full, kFuzzUuid, kPolicyFile, 0, blk.data()).ok()) {
    Fail(kTarget, "seed policy does not encode");
  }
  inputs.push_back(WithPrefix(0, blk));
  std::vector<Blk> seeds;
  for (const auto& in : inputs) seeds.emplace_back(in.data(), in.size());
  return seeds;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  MaybeWriteSeeds(kTarget, Seeds());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const uint8_t selector = size > 0 ? data[0] : 0;
  const uint8_t* body = size > kPrefix ? data + kPrefix : data;
  const size_t body_size = size > kPrefix ? size - kPrefix : 0;
  const Blk raw(body, body_size);
  FuzzBlock(raw, selector);
  FuzzText(body, body_size);
  return 0;
}
