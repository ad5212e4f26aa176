// The logical unit's identity as the iSCSI device reads it
// (volume/scsi_identity.h): the parsers of the target's VPD pages and MODE
// SENSE data, fed well-formed, truncated and hostile bytes, and the rule
// that says whether a unit is still the one the device opened.
// iscsi_device_test.cc shows the check against a real tgtd.
#include "volume/scsi_identity.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <string>
#include <vector>

using namespace dede;

namespace {

// A VPD page: header (qualifier/type 0, page code, length) then `body`.
std::vector<uint8_t> Page(uint8_t code, const std::vector<uint8_t>& body) {
  std::vector<uint8_t> p = {0x00, code, static_cast<uint8_t>(body.size() >> 8),
                            static_cast<uint8_t>(body.size())};
  p.insert(p.end(), body.begin(), body.end());
  return p;
}

// A designation descriptor: code set, association, type, bytes.
std::vector<uint8_t> Descriptor(uint8_t code_set, uint8_t association, uint8_t type,
                                const std::string& bytes) {
  std::vector<uint8_t> d = {code_set, static_cast<uint8_t>((association << 4) | type), 0,
                            static_cast<uint8_t>(bytes.size())};
  d.insert(d.end(), bytes.begin(), bytes.end());
  return d;
}

std::vector<uint8_t> Concat(std::vector<std::vector<uint8_t>> parts) {
  std::vector<uint8_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

}  // namespace

TEST_CASE("SCSI identity: the unit serial number page", "[iscsi]") {
  std::string sn = "  beaf11  ";
  std::vector<uint8_t> body(sn.begin(), sn.end());
  auto r = ParseUnitSerialNumberPage(Page(0x80, body).data(), Page(0x80, body).size());
  REQUIRE(r.ok());
  CHECK(r.value() == "beaf11");

  // NUL padding too; an empty serial is empty.
  std::vector<uint8_t> nul = {'X', '1', 0, 0};
  CHECK(ParseUnitSerialNumberPage(Page(0x80, nul).data(), 8).value() == "X1");
  CHECK(ParseUnitSerialNumberPage(Page(0x80, {}).data(), 4).value().empty());

  // A page cut short by the allocation length: what arrived.
  auto cut = Page(0x80, body);
  CHECK(ParseUnitSerialNumberPage(cut.data(), 8).value() == "be");

  // Not the page asked for, or no header.
  auto other = Page(0x83, body);
  CHECK(ParseUnitSerialNumberPage(other.data(), other.size()).status().code() ==
        Status::Code::kIoError);
  CHECK(ParseUnitSerialNumberPage(cut.data(), 3).status().code() == Status::Code::kIoError);
  CHECK(ParseUnitSerialNumberPage(nullptr, 0).status().code() == Status::Code::kIoError);
}

TEST_CASE("SCSI identity: only the logical unit's designators, in any order", "[iscsi]") {
  const auto naa = Descriptor(1, 0, 3, std::string("\x60\x01\x02\x03\x04\x05\x06\x07", 8));
  const auto t10 = Descriptor(2, 0, 1, "IET     00010001");
  const auto port = Descriptor(1, 1, 4, std::string("\x00\x00\x00\x01", 4));  // target port
  const auto target = Descriptor(3, 2, 8, "iqn.2026-11.org.example:t");       // target device

  auto a = Page(0x83, Concat({naa, port, t10, target}));
  auto b = Page(0x83, Concat({target, t10, naa}));
  auto ra = ParseLogicalUnitDesignators(a.data(), a.size());
  auto rb = ParseLogicalUnitDesignators(b.data(), b.size());
  REQUIRE(ra.ok());
  REQUIRE(rb.ok());
  CHECK(ra.value().size() == 2);
  CHECK(ra.value() == rb.value());

  // The same bytes as another type, or another code set, are another
  // designator.
  auto c = Page(
      0x83, Concat({Descriptor(1, 0, 2, std::string("\x60\x01\x02\x03\x04\x05\x06\x07", 8)), t10}));
  CHECK(ParseLogicalUnitDesignators(c.data(), c.size()).value() != ra.value());

  // A descriptor whose length runs past the page, or a header cut in two.
  auto bad = a;
  bad[4 + 3] = 200;
  CHECK(ParseLogicalUnitDesignators(bad.data(), bad.size()).status().code() ==
        Status::Code::kIoError);
  auto torn = Page(0x83, {0x01, 0x03});
  CHECK(ParseLogicalUnitDesignators(torn.data(), torn.size()).status().code() ==
        Status::Code::kIoError);
  // The page's own length is what counts, not the bytes after it.
  auto trailing = a;
  trailing.push_back(0xff);
  trailing.push_back(0xff);
  CHECK(ParseLogicalUnitDesignators(trailing.data(), trailing.size()).value() == ra.value());
  // An empty page: no designators.
  auto empty = Page(0x83, {});
  CHECK(ParseLogicalUnitDesignators(empty.data(), empty.size()).value().empty());
  CHECK(ParseLogicalUnitDesignators(b.data(), 3).status().code() == Status::Code::kIoError);
}

TEST_CASE("SCSI identity: MODE SENSE(6) write protect bit", "[iscsi]") {
  std::vector<uint8_t> rw = {0x0b, 0x00, 0x00, 0x08};
  std::vector<uint8_t> ro = {0x0b, 0x00, 0x80, 0x08};
  std::vector<uint8_t> dpofua = {0x0b, 0x00, 0x10, 0x08};  // DPOFUA, not WP
  CHECK(ParseModeSense6WriteProtect(rw.data(), rw.size()).value() == false);
  CHECK(ParseModeSense6WriteProtect(ro.data(), ro.size()).value() == true);
  CHECK(ParseModeSense6WriteProtect(dpofua.data(), dpofua.size()).value() == false);
  CHECK(ParseModeSense6WriteProtect(ro.data(), 3).status().code() == Status::Code::kIoError);
  CHECK(ParseModeSense6WriteProtect(nullptr, 0).status().code() == Status::Code::kIoError);
}

TEST_CASE("SCSI identity: which changes make another unit", "[iscsi]") {
  LuIdentity was;
  was.block_size = 512;
  was.blocks = 1000;
  was.serial = "beaf11";
  was.designators = {{0x01, 0x03, 0x60, 0x01}};

  LuIdentity same = was;
  CHECK(DescribeIdentityChange(was, same).empty());

  LuIdentity grown = was;
  grown.blocks = 2000;  // an administrator grew the LUN
  CHECK(DescribeIdentityChange(was, grown).empty());

  LuIdentity shrunk = was;
  shrunk.blocks = 999;
  CHECK(DescribeIdentityChange(was, shrunk).find("shrank from 1000 to 999") != std::string::npos);

  LuIdentity sector = was;
  sector.block_size = 4096;
  CHECK(DescribeIdentityChange(was, sector).find("block size") != std::string::npos);

  LuIdentity serial = was;
  serial.serial = "beaf12";
  CHECK(DescribeIdentityChange(was, serial).find("'beaf11', now 'beaf12'") != std::string::npos);
  LuIdentity no_serial = was;
  no_serial.serial.clear();  // the page gone is a change too
  CHECK_FALSE(DescribeIdentityChange(was, no_serial).empty());

  LuIdentity ident = was;
  ident.designators = {{0x01, 0x03, 0x60, 0x02}};
  CHECK(DescribeIdentityChange(was, ident).find("83h") != std::string::npos);

  // What the first login did not learn is not held against a later one.
  LuIdentity bare;
  bare.block_size = 512;
  bare.blocks = 1000;
  CHECK(DescribeIdentityChange(bare, was).empty());
}
