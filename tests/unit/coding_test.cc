// util/coding.h: little-endian helpers and the sequential Encoder/Decoder
// that every on-disk structure goes through.
#include "util/coding.h"

#include <array>
#include <catch2/catch.hpp>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "util/status.h"

using namespace dede;

TEST_CASE("coding: fixed-width values are little-endian", "[coding]") {
  uint8_t b[8] = {};
  EncodeU16(b, 0x0102);
  CHECK(b[0] == 0x02);
  CHECK(b[1] == 0x01);
  EncodeU32(b, 0x01020304u);
  CHECK(std::vector<uint8_t>(b, b + 4) == std::vector<uint8_t>{0x04, 0x03, 0x02, 0x01});
  EncodeU64(b, 0x0102030405060708ull);
  CHECK(std::vector<uint8_t>(b, b + 8) ==
        std::vector<uint8_t>{0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01});
  CHECK(DecodeU64(b) == 0x0102030405060708ull);
  CHECK(DecodeU32(b) == 0x05060708u);
  CHECK(DecodeU16(b) == 0x0708);
  // Unaligned access works.
  uint8_t u[11] = {};
  EncodeU64(u + 3, 0xfedcba9876543210ull);
  CHECK(u[3] == 0x10);
  CHECK(u[10] == 0xfe);
  REQUIRE(DecodeU64(u + 3) == 0xfedcba9876543210ull);
}

TEST_CASE("coding: extreme values round trip", "[coding]") {
  uint8_t b[8];
  for (uint16_t v : {uint16_t{0}, uint16_t{1}, uint16_t{0x8000}, uint16_t{0xffff}}) {
    EncodeU16(b, v);
    REQUIRE(DecodeU16(b) == v);
  }
  for (uint32_t v : {0u, 1u, 0x80000000u, 0xffffffffu}) {
    EncodeU32(b, v);
    REQUIRE(DecodeU32(b) == v);
  }
  for (uint64_t v : {uint64_t{0}, uint64_t{1}, uint64_t{1} << 63, ~uint64_t{0}}) {
    EncodeU64(b, v);
    REQUIRE(DecodeU64(b) == v);
  }
}

TEST_CASE("coding: Encoder and Decoder walk the same layout", "[coding]") {
  std::array<uint8_t, 64> buf;
  buf.fill(0xee);
  Encoder e(buf.data(), buf.size());
  CHECK(e.capacity() == 64);
  CHECK(e.pos() == 0);
  e.u8(0xab);
  e.u16(0x1234);
  e.u32(0xdeadbeef);
  e.u64(0x0123456789abcdefull);
  e.bytes("hello", 5);
  e.zeros(3);
  e.u8(0x7f);
  CHECK(e.pos() == 1 + 2 + 4 + 8 + 5 + 3 + 1);
  // Exact bytes: the Encoder adds no padding.
  CHECK(buf[0] == 0xab);
  CHECK(buf[1] == 0x34);
  CHECK(buf[2] == 0x12);
  CHECK(DecodeU32(&buf[3]) == 0xdeadbeefu);
  CHECK(DecodeU64(&buf[7]) == 0x0123456789abcdefull);
  CHECK(std::memcmp(&buf[15], "hello", 5) == 0);
  CHECK(buf[20] == 0);
  CHECK(buf[22] == 0);
  CHECK(buf[23] == 0x7f);
  CHECK(buf[24] == 0xee);  // nothing written past pos()

  Decoder d(buf.data(), 24);
  CHECK(d.remaining() == 24);
  CHECK(d.u8() == 0xab);
  CHECK(d.u16() == 0x1234);
  CHECK(d.u32() == 0xdeadbeefu);
  CHECK(d.u64() == 0x0123456789abcdefull);
  char s[5];
  d.bytes(s, 5);
  CHECK(std::memcmp(s, "hello", 5) == 0);
  CHECK(d.pos() == 20);
  d.skip(3);
  CHECK(d.remaining() == 1);
  CHECK(d.u8() == 0x7f);
  CHECK(d.pos() == 24);
  REQUIRE(d.remaining() == 0);
}

TEST_CASE("coding: random sequences round trip", "[coding]") {
  std::mt19937_64 rng(12345);
  for (int round = 0; round < 200; round++) {
    std::vector<uint8_t> buf(1024);
    std::vector<std::pair<int, uint64_t>> ops;  // (width, value)
    Encoder e(buf.data(), buf.size());
    while (e.pos() + 8 <= buf.size()) {
      int w = 1 << (rng() % 4);
      uint64_t v = rng();
      switch (w) {
        case 1:
          v &= 0xff;
          e.u8(static_cast<uint8_t>(v));
          break;
        case 2:
          v &= 0xffff;
          e.u16(static_cast<uint16_t>(v));
          break;
        case 4:
          v &= 0xffffffff;
          e.u32(static_cast<uint32_t>(v));
          break;
        default:
          e.u64(v);
          break;
      }
      ops.emplace_back(w, v);
    }
    Decoder d(buf.data(), e.pos());
    for (auto [w, v] : ops) {
      uint64_t got = w == 1 ? d.u8() : w == 2 ? d.u16() : w == 4 ? d.u32() : d.u64();
      REQUIRE(got == v);
    }
    REQUIRE(d.remaining() == 0);
  }
}

// errno values as Status codes: a refused permission is not "in use"
// (kLocked made `dede` and dedupd say a device they may not open was in
// use elsewhere).
TEST_CASE("Status::FromErrno maps errno values to codes", "[util]") {
  using dede::Status;
  CHECK(Status::FromErrno("x", ENOSPC).code() == Status::Code::kNoSpace);
  CHECK(Status::FromErrno("x", EDQUOT).code() == Status::Code::kNoSpace);
  CHECK(Status::FromErrno("x", EFBIG).code() == Status::Code::kNoSpace);
  CHECK(Status::FromErrno("x", ENOENT).code() == Status::Code::kNotFound);
  CHECK(Status::FromErrno("x", EINVAL).code() == Status::Code::kInvalid);
  CHECK(Status::FromErrno("x", EAGAIN).code() == Status::Code::kLocked);
  CHECK(Status::FromErrno("x", EBUSY).code() == Status::Code::kLocked);
  CHECK(Status::FromErrno("x", EACCES).code() == Status::Code::kIoError);
  CHECK(Status::FromErrno("x", EPERM).code() == Status::Code::kIoError);
  CHECK(Status::FromErrno("x", EIO).code() == Status::Code::kIoError);
  CHECK(Status::FromErrno("cannot open /dev/sdb", EACCES).message() ==
        "cannot open /dev/sdb: Permission denied");
}
