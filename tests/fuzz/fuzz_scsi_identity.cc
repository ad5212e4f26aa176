// Fuzzes the parsers of what an iSCSI target says about its logical unit
// (volume/scsi_identity.h): VPD pages 80h and 83h and the MODE SENSE(6)
// header. The target is not ours to trust: a page whose lengths lie must be
// refused, never read past.
//
// Input: [selector u8][answer...]. The selector's low two bits pick the
// parser; the answer is passed in a heap buffer of exactly its length, so
// AddressSanitizer catches any read past it. Each input is also parsed as a
// "fixed-up" copy whose header names the page the parser expects (and, for
// a VPD page, whose page length is the answer's), so the fuzzer spends its
// time in the descriptor walk rather than on the first check.
//
// Properties: an error is kIoError with a message; a serial has no blank
// or NUL at either end; designators are sorted, each at least its code set
// and type; parsing is deterministic; an identity always equals itself and
// is never "changed" by growing.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_util.h"
#include "volume/scsi_identity.h"

using namespace dede;
using namespace dede::fuzz;

namespace {

constexpr const char* kTarget = "fuzz_scsi_identity";

void CheckError(const Status& s) {
  FUZZ_CHECK(FailedCleanly(s), "an error without a message");
  FUZZ_CHECK(s.code() == Status::Code::kIoError, "an error that is not kIoError: " + s.ToString());
}

void ParseAll(unsigned which, const std::vector<uint8_t>& answer) {
  // Exactly the answer's bytes, in their own allocation.
  std::unique_ptr<uint8_t[]> copy(new uint8_t[answer.size() + (answer.empty() ? 1 : 0)]);
  if (!answer.empty()) std::memcpy(copy.get(), answer.data(), answer.size());
  const uint8_t* p = answer.empty() ? nullptr : copy.get();
  const size_t n = answer.size();
  switch (which) {
    case 0: {
      auto r = ParseUnitSerialNumberPage(p, n);
      if (!r.ok()) return CheckError(r.status());
      const std::string& s = r.value();
      FUZZ_CHECK(s.empty() ||
                     (s.front() != ' ' && s.front() != '\0' && s.back() != ' ' && s.back() != '\0'),
                 "a serial with blanks at an end");
      FUZZ_CHECK(s.size() + 4 <= n, "a serial longer than the answer");
      auto again = ParseUnitSerialNumberPage(p, n);
      FUZZ_CHECK(again.ok() && again.value() == s, "not deterministic");
      LuIdentity id;
      id.block_size = 512;
      id.blocks = 8;
      id.serial = s;
      FUZZ_CHECK(DescribeIdentityChange(id, id).empty(), "an identity differs from itself");
      break;
    }
    case 1: {
      auto r = ParseLogicalUnitDesignators(p, n);
      if (!r.ok()) return CheckError(r.status());
      size_t bytes = 0;
      for (size_t i = 0; i < r.value().size(); i++) {
        FUZZ_CHECK(r.value()[i].size() >= 2, "a designator without code set and type");
        FUZZ_CHECK(i == 0 || r.value()[i - 1] <= r.value()[i], "designators not sorted");
        bytes += r.value()[i].size() + 2;  // each from a 4-byte descriptor header
      }
      FUZZ_CHECK(bytes + 4 <= n || r.value().empty(), "designators larger than the answer");
      auto again = ParseLogicalUnitDesignators(p, n);
      FUZZ_CHECK(again.ok() && again.value() == r.value(), "not deterministic");
      LuIdentity id;
      id.block_size = 4096;
      id.blocks = 100;
      id.designators = r.value();
      LuIdentity grown = id;
      grown.blocks = 200;
      FUZZ_CHECK(DescribeIdentityChange(id, grown).empty(), "growing made another unit");
      break;
    }
    default: {
      auto r = ParseModeSense6WriteProtect(p, n);
      if (!r.ok()) return CheckError(r.status());
      FUZZ_CHECK(n >= 4, "a MODE SENSE header shorter than 4 bytes parsed");
      FUZZ_CHECK(r.value() == ((answer[2] & 0x80) != 0), "WP is not bit 7 of byte 2");
      break;
    }
  }
}

std::vector<uint8_t> FixedUp(unsigned which, std::vector<uint8_t> a) {
  if (which >= 2) return a;
  if (a.size() < 4) a.resize(4);
  a[1] = which == 0 ? 0x80 : 0x83;
  const size_t len = std::min<size_t>(a.size() - 4, 0xffff);
  a[2] = static_cast<uint8_t>(len >> 8);
  a[3] = static_cast<uint8_t>(len);
  return a;
}

Blk Seed(uint8_t selector, const std::vector<uint8_t>& answer) {
  std::vector<uint8_t> in = {selector};
  in.insert(in.end(), answer.begin(), answer.end());
  return Blk(in.data(), in.size());
}

void WriteSeeds() {
  const std::string sn = "beaf11  ";
  std::vector<uint8_t> serial = {0, 0x80, 0, static_cast<uint8_t>(sn.size())};
  serial.insert(serial.end(), sn.begin(), sn.end());
  // tgtd-like: an NAA and a T10 vendor id for the unit, a relative port.
  std::vector<uint8_t> ident = {0, 0x83, 0, 0};
  const std::vector<uint8_t> descs = {0x01, 0x03, 0,    8,    0x60, 1,   2,   3,   4,   5,   6,
                                      7,    0x02, 0x01, 0,    8,    'I', 'E', 'T', ' ', '0', '0',
                                      '0',  '1',  0x61, 0x94, 0,    4,   0,   0,   0,   1};
  ident.insert(ident.end(), descs.begin(), descs.end());
  ident[3] = static_cast<uint8_t>(descs.size());
  const std::vector<uint8_t> mode = {0x0b, 0x00, 0x80, 0x08, 0, 0, 0, 0, 0, 0, 0x02, 0};
  MaybeWriteSeeds(kTarget, {Seed(0, serial), Seed(1, ident), Seed(2, mode)});
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  WriteSeeds();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const unsigned which = data[0] & 3;
  std::vector<uint8_t> answer(data + 1, data + size);
  ParseAll(which, answer);
  ParseAll(which, FixedUp(which, answer));
  return 0;
}
