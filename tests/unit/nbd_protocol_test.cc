// agent/nbd_protocol.h: the sans-I/O NBD server engine, driven by a small
// test client that builds the wire bytes by hand (big-endian, field by
// field) and parses what the server sends back.
#include "agent/nbd_protocol.h"

#include <boost/endian/conversion.hpp>
#include <catch2/catch.hpp>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

using namespace dede::nbd;

namespace {

using Bytes = std::vector<uint8_t>;
Bytes AsBytes(const dede::IoBytes& b) { return Bytes(b.begin(), b.end()); }

// ---- the test client: message builders

void PutU16(Bytes* b, uint16_t v) {
  uint8_t x[2];
  boost::endian::store_big_u16(x, v);
  b->insert(b->end(), x, x + 2);
}
void PutU32(Bytes* b, uint32_t v) {
  uint8_t x[4];
  boost::endian::store_big_u32(x, v);
  b->insert(b->end(), x, x + 4);
}
void PutU64(Bytes* b, uint64_t v) {
  uint8_t x[8];
  boost::endian::store_big_u64(x, v);
  b->insert(b->end(), x, x + 8);
}
void PutStr(Bytes* b, const std::string& s) {
  b->insert(b->end(), s.begin(), s.end());
}
Bytes Cat(Bytes a, const Bytes& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

Bytes ClientFlags(uint32_t flags) {
  Bytes b;
  PutU32(&b, flags);
  return b;
}

Bytes Option(uint32_t option, const Bytes& data, uint64_t magic = kIHaveOpt) {
  Bytes b;
  PutU64(&b, magic);
  PutU32(&b, option);
  PutU32(&b, static_cast<uint32_t>(data.size()));
  return Cat(b, data);
}

// NBD_OPT_GO / NBD_OPT_INFO data.
Bytes GoData(const std::string& name, const std::vector<uint16_t>& infos = {}) {
  Bytes b;
  PutU32(&b, static_cast<uint32_t>(name.size()));
  PutStr(&b, name);
  PutU16(&b, static_cast<uint16_t>(infos.size()));
  for (uint16_t i : infos) PutU16(&b, i);
  return b;
}

Bytes Req(uint16_t type, uint64_t cookie, uint64_t offset, uint32_t length, uint16_t flags = 0,
          const Bytes& payload = {}, uint32_t magic = kRequestMagic) {
  Bytes b;
  PutU32(&b, magic);
  PutU16(&b, flags);
  PutU16(&b, type);
  PutU64(&b, cookie);
  PutU64(&b, offset);
  PutU32(&b, length);
  return Cat(b, payload);
}

Bytes Pattern(size_t n, uint8_t seed) {
  Bytes b(n);
  for (size_t i = 0; i < n; i++) b[i] = static_cast<uint8_t>(seed + i * 7);
  return b;
}

// ---- the test client: reading what the server sent

class Reader {
 public:
  explicit Reader(Bytes b) : b_(std::move(b)) {}
  uint16_t u16() { return boost::endian::load_big_u16(Take(2)); }
  uint32_t u32() { return boost::endian::load_big_u32(Take(4)); }
  uint64_t u64() { return boost::endian::load_big_u64(Take(8)); }
  Bytes bytes(size_t n) {
    const uint8_t* p = Take(n);
    return Bytes(p, p + n);
  }
  size_t left() const { return b_.size() - pos_; }

 private:
  const uint8_t* Take(size_t n) {
    REQUIRE(left() >= n);
    const uint8_t* p = b_.data() + pos_;
    pos_ += n;
    return p;
  }
  Bytes b_;
  size_t pos_ = 0;
};

struct OptReply {
  uint32_t option = 0;
  uint32_t type = 0;
  Bytes data;
  std::string text() const { return std::string(data.begin(), data.end()); }
};

OptReply ReadOptReply(Reader* r) {
  REQUIRE(r->u64() == kOptReplyMagic);
  OptReply o;
  o.option = r->u32();
  o.type = r->u32();
  o.data = r->bytes(r->u32());
  return o;
}

std::vector<OptReply> OptReplies(Bytes out) {
  Reader r(std::move(out));
  std::vector<OptReply> v;
  while (r.left() > 0) v.push_back(ReadOptReply(&r));
  return v;
}

struct SimpleReply {
  uint32_t error = 0;
  uint64_t cookie = 0;
};

std::vector<SimpleReply> SimpleReplies(Bytes out) {
  Reader r(std::move(out));
  std::vector<SimpleReply> v;
  while (r.left() > 0) {
    REQUIRE(r.u32() == kSimpleReplyMagic);
    SimpleReply s;
    s.error = r.u32();
    s.cookie = r.u64();
    v.push_back(s);
  }
  return v;
}

// Feeds everything; requires that all of it was consumed unless the session
// stopped for the driver.
Action Feed(NbdSession* s, const Bytes& b, size_t* consumed_out = nullptr) {
  size_t consumed = 999999;
  const Action a = s->Feed(b.data(), b.size(), &consumed);
  REQUIRE(consumed <= b.size());
  if (a == Action::kNeedInput) REQUIRE(consumed == b.size());
  if (consumed_out != nullptr) *consumed_out = consumed;
  return a;
}

constexpr uint32_t kBothFlags = kClientFlagFixedNewstyle | kClientFlagNoZeroes;

ExportInfo Export(uint64_t size = 1 << 20, bool read_only = false) {
  ExportInfo info;
  info.size = size;
  info.read_only = read_only;
  info.description = "golden image";
  return info;
}

constexpr uint16_t kFullFlags =
    kTxHasFlags | kTxSendFlush | kTxSendFua | kTxSendTrim | kTxSendWriteZeroes | kTxCanMultiConn;

// A session that went through GO for `info`; output drained.
NbdSession Opened(const ExportInfo& info, const SessionOptions& opts = {}) {
  NbdSession s(opts);
  s.TakeOutput();
  REQUIRE(Feed(&s, Cat(ClientFlags(kBothFlags), Option(kOptGo, GoData("vm")))) ==
          Action::kOpenExport);
  s.ReplyExport(info);
  REQUIRE(s.in_transmission());
  s.TakeOutput();
  return s;
}

// Sends one request that must be rejected; returns the error replied.
uint32_t Rejected(NbdSession* s, const Bytes& request, uint64_t cookie) {
  const uint64_t before = s->rejected_requests();
  REQUIRE(Feed(s, request) == Action::kNeedInput);
  REQUIRE(s->rejected_requests() == before + 1);
  const std::vector<SimpleReply> replies = SimpleReplies(s->TakeOutput());
  REQUIRE(replies.size() == 1);
  CHECK(replies[0].cookie == cookie);
  return replies[0].error;
}

Request Accepted(NbdSession* s, const Bytes& request) {
  REQUIRE(Feed(s, request) == Action::kRequest);
  REQUIRE_FALSE(s->has_output());
  return s->TakeRequest();
}

}  // namespace

// ---------------------------------------------------------------- handshake

TEST_CASE("nbd: greeting is NBDMAGIC, IHAVEOPT, FIXED_NEWSTYLE|NO_ZEROES", "[nbd]") {
  NbdSession s;
  REQUIRE(s.has_output());
  Bytes out = s.TakeOutput();
  CHECK_FALSE(s.has_output());
  REQUIRE(out.size() == 18);
  CHECK(std::string(out.begin(), out.begin() + 8) == "NBDMAGIC");
  CHECK(std::string(out.begin() + 8, out.begin() + 16) == "IHAVEOPT");
  CHECK(out[16] == 0);
  CHECK(out[17] == 3);
  CHECK_FALSE(s.in_transmission());
  // Nothing fed: nothing to do.
  size_t consumed = 1;
  CHECK(s.Feed(nullptr, 0, &consumed) == Action::kNeedInput);
  CHECK(consumed == 0);
}

TEST_CASE("nbd: GO handshake sends INFO_EXPORT, BLOCK_SIZE, ACK and starts transmission", "[nbd]") {
  NbdSession s;
  s.TakeOutput();
  const bool read_only = GENERATE(false, true);
  const Bytes hello =
      Cat(ClientFlags(kBothFlags), Option(kOptGo, GoData("vm-1", {kInfoBlockSize})));
  REQUIRE(Feed(&s, hello) == Action::kOpenExport);
  CHECK(s.export_name() == "vm-1");
  CHECK_FALSE(s.info_only());
  CHECK_FALSE(s.has_output());

  ExportInfo info = Export(10ull << 30, read_only);
  info.max_block = 1 << 20;
  s.ReplyExport(info);
  CHECK(s.in_transmission());
  CHECK(s.export_info().size == 10ull << 30);
  const std::vector<OptReply> replies = OptReplies(s.TakeOutput());
  REQUIRE(replies.size() == 3);
  for (const OptReply& r : replies) CHECK(r.option == kOptGo);

  CHECK(replies[0].type == kRepInfo);
  Reader exp(replies[0].data);
  REQUIRE(replies[0].data.size() == 12);
  CHECK(exp.u16() == kInfoExport);
  CHECK(exp.u64() == 10ull << 30);
  CHECK(exp.u16() == (read_only ? kFullFlags | kTxReadOnly : kFullFlags));

  CHECK(replies[1].type == kRepInfo);
  REQUIRE(replies[1].data.size() == 14);
  Reader bs(replies[1].data);
  CHECK(bs.u16() == kInfoBlockSize);
  CHECK(bs.u32() == 1);
  CHECK(bs.u32() == 4096);
  CHECK(bs.u32() == 1u << 20);

  CHECK(replies[2].type == kRepAck);
  CHECK(replies[2].data.empty());

  // Transmission: the next bytes are requests.
  const Request r = Accepted(&s, Req(kCmdRead, 77, 4096, 512));
  CHECK(r.type == kCmdRead);
  CHECK(r.cookie == 77);
}

TEST_CASE("nbd: GO answers NAME and DESCRIPTION when asked, BLOCK_SIZE always", "[nbd]") {
  NbdSession s;
  s.TakeOutput();
  REQUIRE(Feed(&s, Cat(ClientFlags(kBothFlags),
                       Option(kOptGo, GoData("", {kInfoDescription, 999, kInfoName})))) ==
          Action::kOpenExport);
  CHECK(s.export_name().empty());  // the default export
  s.ReplyExport(Export());
  const std::vector<OptReply> replies = OptReplies(s.TakeOutput());
  std::vector<uint16_t> infos;
  for (const OptReply& r : replies) {
    if (r.type != kRepInfo) continue;
    Reader rd(r.data);
    infos.push_back(rd.u16());
    if (infos.back() == kInfoDescription) {
      CHECK(std::string(r.data.begin() + 2, r.data.end()) == "golden image");
    }
    if (infos.back() == kInfoName) CHECK(r.data.size() == 2);
  }
  CHECK(infos == std::vector<uint16_t>{kInfoExport, kInfoName, kInfoDescription, kInfoBlockSize});
  CHECK(replies.back().type == kRepAck);
  CHECK(s.in_transmission());
}

TEST_CASE("nbd: INFO answers like GO but stays in the handshake", "[nbd]") {
  NbdSession s;
  s.TakeOutput();
  REQUIRE(Feed(&s, Cat(ClientFlags(kBothFlags), Option(kOptInfo, GoData("vm", {kInfoName})))) ==
          Action::kOpenExport);
  CHECK(s.info_only());
  s.ReplyExport(Export(8192));
  CHECK_FALSE(s.in_transmission());
  std::vector<OptReply> replies = OptReplies(s.TakeOutput());
  REQUIRE(replies.size() == 4);
  CHECK(replies[1].text() == std::string("\0\1vm", 4));
  for (const OptReply& r : replies) CHECK(r.option == kOptInfo);
  CHECK(replies.back().type == kRepAck);
  CHECK(s.export_info().size == 0);  // not entered

  // Options go on: GO enters.
  REQUIRE(Feed(&s, Option(kOptGo, GoData("vm"))) == Action::kOpenExport);
  CHECK_FALSE(s.info_only());
  s.ReplyExport(Export(8192));
  CHECK(s.in_transmission());
  CHECK(s.export_info().size == 8192);
}

TEST_CASE("nbd: LIST sends one SERVER reply per export, then ACK", "[nbd]") {
  NbdSession s;
  s.TakeOutput();
  REQUIRE(Feed(&s, Cat(ClientFlags(kBothFlags), Option(kOptList, {}))) == Action::kListExports);
  s.ReplyList({"alpha", "win10-golden"});
  const std::vector<OptReply> replies = OptReplies(s.TakeOutput());
  REQUIRE(replies.size() == 3);
  std::vector<std::string> names;
  for (size_t i = 0; i < 2; i++) {
    CHECK(replies[i].option == kOptList);
    CHECK(replies[i].type == kRepServer);
    Reader r(replies[i].data);
    const uint32_t n = r.u32();
    REQUIRE(n == r.left());
    const Bytes name = r.bytes(n);
    names.emplace_back(name.begin(), name.end());
  }
  CHECK(names == std::vector<std::string>{"alpha", "win10-golden"});
  CHECK(replies[2].type == kRepAck);

  // An empty list is just the ACK.
  REQUIRE(Feed(&s, Option(kOptList, {})) == Action::kListExports);
  s.ReplyList({});
  std::vector<OptReply> again = OptReplies(s.TakeOutput());
  REQUIRE(again.size() == 1);
  CHECK(again[0].type == kRepAck);

  // A failed listing is an error (not an empty list); the handshake goes on.
  REQUIRE(Feed(&s, Option(kOptList, {})) == Action::kListExports);
  s.ReplyListError("listing the volume's files failed: injected");
  std::vector<OptReply> failed = OptReplies(s.TakeOutput());
  REQUIRE(failed.size() == 1);
  CHECK(failed[0].option == kOptList);
  CHECK(failed[0].type == kRepErrPlatform);
  CHECK(failed[0].text().find("injected") != std::string::npos);

  // LIST with data is invalid; the handshake goes on.
  REQUIRE(Feed(&s, Option(kOptList, {1, 2, 3})) == Action::kNeedInput);
  std::vector<OptReply> bad = OptReplies(s.TakeOutput());
  REQUIRE(bad.size() == 1);
  CHECK(bad[0].option == kOptList);
  CHECK(bad[0].type == kRepErrInvalid);
  CHECK_FALSE(bad[0].text().empty());
  CHECK(Feed(&s, Option(kOptList, {})) == Action::kListExports);
}

TEST_CASE("nbd: ABORT is acknowledged and disconnects", "[nbd]") {
  NbdSession s;
  s.TakeOutput();
  const Bytes data = GENERATE(Bytes{}, Bytes{9, 9});  // data is ignored
  const Bytes in = Cat(Cat(ClientFlags(kBothFlags), Option(kOptAbort, data)), Option(kOptList, {}));
  size_t consumed = 0;
  REQUIRE(Feed(&s, in, &consumed) == Action::kDisconnect);
  CHECK(consumed == in.size() - 16);  // the LIST after it is not read
  const std::vector<OptReply> replies = OptReplies(s.TakeOutput());
  REQUIRE(replies.size() == 1);
  CHECK(replies[0].option == kOptAbort);
  CHECK(replies[0].type == kRepAck);
  // Nothing more is consumed.
  CHECK(Feed(&s, Option(kOptList, {}), &consumed) == Action::kDisconnect);
  CHECK(consumed == 0);
  CHECK_FALSE(s.has_output());
}

TEST_CASE("nbd: EXPORT_NAME replies size and flags, with 124 zeroes unless NO_ZEROES", "[nbd]") {
  const bool no_zeroes = GENERATE(false, true);
  // A client without fixed newstyle (very old nbd-client) is served too.
  const bool fixed = GENERATE(true, false);
  INFO("no_zeroes " << no_zeroes << ", fixed newstyle " << fixed);
  NbdSession s;
  s.TakeOutput();
  const uint32_t flags =
      (fixed ? kClientFlagFixedNewstyle : 0) | (no_zeroes ? kClientFlagNoZeroes : 0);
  const Bytes name = {'d', 'i', 's', 'k'};
  const Bytes in =
      Cat(Cat(ClientFlags(flags), Option(kOptExportName, name)), Req(kCmdFlush, 5, 0, 0));
  size_t consumed = 0;
  REQUIRE(Feed(&s, in, &consumed) == Action::kOpenExport);
  CHECK(consumed == in.size() - 28);  // the request waits for the reply
  CHECK(s.export_name() == "disk");
  CHECK_FALSE(s.info_only());
  s.ReplyExport(Export(3ull << 40, true));
  CHECK(s.in_transmission());
  Reader r(s.TakeOutput());
  CHECK(r.u64() == 3ull << 40);
  CHECK(r.u16() == (kFullFlags | kTxReadOnly));
  if (no_zeroes) {
    CHECK(r.left() == 0);
  } else {
    REQUIRE(r.left() == 124);
    CHECK(r.bytes(124) == Bytes(124, 0));
  }
  // The request that followed is read now.
  const Request req = Accepted(&s, Bytes(in.begin() + consumed, in.end()));
  CHECK(req.type == kCmdFlush);
  CHECK(req.cookie == 5);
}

TEST_CASE("nbd: an export that cannot be opened: GO/INFO get the message, EXPORT_NAME closes",
          "[nbd]") {
  NbdSession s;
  s.TakeOutput();
  const uint32_t option = GENERATE(kOptGo, kOptInfo);
  REQUIRE(Feed(&s, Cat(ClientFlags(kBothFlags), Option(option, GoData("nope")))) ==
          Action::kOpenExport);
  const std::string message = "no export named 'nope' on host7 \xc3\xa9";
  s.ReplyExportError(kRepErrUnknown, message);
  CHECK_FALSE(s.in_transmission());
  std::vector<OptReply> replies = OptReplies(s.TakeOutput());
  REQUIRE(replies.size() == 1);
  CHECK(replies[0].option == option);
  CHECK(replies[0].type == kRepErrUnknown);
  CHECK(replies[0].text() == message);

  // A non-error type would end the option as a success: it is sent as an error.
  REQUIRE(Feed(&s, Option(option, GoData("nope"))) == Action::kOpenExport);
  s.ReplyExportError(kRepAck, "oops");
  replies = OptReplies(s.TakeOutput());
  REQUIRE(replies.size() == 1);
  CHECK(replies[0].type == kRepErrUnknown);

  // Options go on; EXPORT_NAME cannot be answered with an error.
  REQUIRE(Feed(&s, Option(kOptExportName, {'x'})) == Action::kOpenExport);
  s.ReplyExportError(kRepErrUnknown, "no export named 'x'");
  CHECK_FALSE(s.has_output());
  size_t consumed = 1;
  CHECK(s.Feed(nullptr, 0, &consumed) == Action::kClose);
  CHECK(consumed == 0);
  CHECK(s.close_reason().find("no export named 'x'") != std::string::npos);
  CHECK_FALSE(s.in_transmission());
}

TEST_CASE("nbd: unsupported options get ERR_UNSUP and their data is skipped", "[nbd]") {
  NbdSession s;
  s.TakeOutput();
  REQUIRE(Feed(&s, ClientFlags(kBothFlags)) == Action::kNeedInput);
  for (uint32_t option : {kOptStartTls, kOptStructuredReply, 4u, 9u, 10u, 42u, 0xffffffffu}) {
    INFO("option " << option);
    REQUIRE(Feed(&s, Option(option, Pattern(option % 50, 1))) == Action::kNeedInput);
    const std::vector<OptReply> replies = OptReplies(s.TakeOutput());
    REQUIRE(replies.size() == 1);
    CHECK(replies[0].option == option);
    CHECK(replies[0].type == kRepErrUnsup);
    CHECK_FALSE(replies[0].text().empty());
  }
  CHECK(Feed(&s, Option(kOptList, {})) == Action::kListExports);
}

TEST_CASE("nbd: option data over the limit is dropped and the option refused", "[nbd]") {
  SessionOptions opts;
  opts.max_option_bytes = 1000;
  NbdSession s(opts);
  s.TakeOutput();
  REQUIRE(Feed(&s, ClientFlags(kBothFlags)) == Action::kNeedInput);
  const std::vector<std::pair<uint32_t, uint32_t>> cases = {
      {kOptGo, kRepErrTooBig},      {kOptInfo, kRepErrTooBig},           {kOptList, kRepErrTooBig},
      {kOptStartTls, kRepErrUnsup}, {kOptStructuredReply, kRepErrUnsup}, {42u, kRepErrUnsup},
      {0xffffffffu, kRepErrUnsup},
  };
  for (const auto& [option, rep] : cases) {
    INFO("option " << option);
    // Fed a byte at a time: the drop spans reads, and the session never
    // holds the data (its output is the one reply).
    const Bytes in = Option(option, Pattern(1001, 7));
    for (size_t i = 0; i < in.size(); i++) {
      REQUIRE(Feed(&s, Bytes(1, in[i])) == Action::kNeedInput);
    }
    const std::vector<OptReply> replies = OptReplies(s.TakeOutput());
    REQUIRE(replies.size() == 1);
    CHECK(replies[0].option == option);
    CHECK(replies[0].type == rep);
    CHECK(replies[0].text().find("1001 bytes") != std::string::npos);
  }
  // Exactly at the limit the data is read as usual (malformed GO data).
  REQUIRE(Feed(&s, Option(kOptGo, Bytes(1000, 0))) == Action::kNeedInput);
  std::vector<OptReply> replies = OptReplies(s.TakeOutput());
  REQUIRE(replies.size() == 1);
  CHECK(replies[0].type == kRepErrInvalid);
  // A declared length past what one handshake may drop in all: closed.
  NbdSession d;
  d.TakeOutput();
  Bytes huge = ClientFlags(kBothFlags);
  PutU64(&huge, kIHaveOpt);
  PutU32(&huge, kOptList);
  PutU32(&huge, 0xffffffff);
  CHECK(Feed(&d, huge) == Action::kClose);
  CHECK(d.close_reason().find("oversized option data") != std::string::npos);
  {
    // Under it, the drops add up: the option that passes the total closes.
    SessionOptions capped = opts;
    capped.max_dropped_option_bytes = 3000;
    NbdSession c(capped);
    c.TakeOutput();
    REQUIRE(Feed(&c, ClientFlags(kBothFlags)) == Action::kNeedInput);
    REQUIRE(Feed(&c, Option(42, Bytes(1500, 0))) == Action::kNeedInput);
    REQUIRE(Feed(&c, Option(42, Bytes(1500, 0))) == Action::kNeedInput);
    CHECK(OptReplies(c.TakeOutput()).size() == 2);
    CHECK(Feed(&c, Option(42, Bytes(1001, 0))) == Action::kClose);
  }
  // ABORT with oversized data is still an abort.
  const Bytes abort = Option(kOptAbort, Bytes(1001, 0));
  CHECK(Feed(&s, abort) == Action::kDisconnect);
  replies = OptReplies(s.TakeOutput());
  REQUIRE(replies.size() == 1);
  CHECK(replies[0].type == kRepAck);
  // The handshake went on throughout: a LIST after the refusals is served.
  NbdSession t(opts);
  t.TakeOutput();
  REQUIRE(Feed(&t, Cat(ClientFlags(kBothFlags), Option(kOptGo, Bytes(5000, 1)))) ==
          Action::kNeedInput);
  CHECK(Feed(&t, Option(kOptList, {})) == Action::kListExports);
}

TEST_CASE("nbd: malformed GO/INFO data gets ERR_INVALID and the handshake goes on", "[nbd]") {
  NbdSession s;
  s.TakeOutput();
  REQUIRE(Feed(&s, ClientFlags(kBothFlags)) == Action::kNeedInput);
  Bytes name_too_long;
  PutU32(&name_too_long, 100);
  PutStr(&name_too_long, "abc");
  PutU16(&name_too_long, 0);
  Bytes count_too_big = GoData("abc", {kInfoName});
  count_too_big[4 + 3 + 1] = 2;  // says two requests, carries one
  Bytes trailing = Cat(GoData("abc"), {0});
  Bytes with_nul = GoData(std::string("a\0b", 3));
  const std::vector<Bytes> bad = {
      {},
      {0, 0, 0, 0, 0},
      name_too_long,
      count_too_big,
      trailing,
      with_nul,
      GoData(std::string(4097, 'n')),
  };
  for (uint32_t option : {kOptGo, kOptInfo}) {
    for (size_t i = 0; i < bad.size(); i++) {
      INFO("option " << option << " case " << i);
      REQUIRE(Feed(&s, Option(option, bad[i])) == Action::kNeedInput);
      const std::vector<OptReply> replies = OptReplies(s.TakeOutput());
      REQUIRE(replies.size() == 1);
      CHECK(replies[0].option == option);
      CHECK(replies[0].type == kRepErrInvalid);
      CHECK_FALSE(replies[0].text().empty());
    }
  }
  // The longest valid name is fine.
  REQUIRE(Feed(&s, Option(kOptGo, GoData(std::string(4096, 'n')))) == Action::kOpenExport);
  CHECK(s.export_name().size() == 4096);
}

TEST_CASE("nbd: handshake violations close the connection", "[nbd]") {
  SessionOptions opts;
  opts.max_option_bytes = 1000;
  NbdSession s(opts);
  s.TakeOutput();
  Bytes in;
  SECTION("unknown client flag") {
    in = ClientFlags(kBothFlags | 4);
  }
  SECTION("no FIXED_NEWSTYLE, then an option other than EXPORT_NAME") {
    in = Cat(ClientFlags(kClientFlagNoZeroes), Option(kOptGo, GoData("vm")));
  }
  SECTION("no flags at all, then LIST") {
    in = Cat(ClientFlags(0), Option(kOptList, {}));
  }
  SECTION("no flags at all, then an unknown option") {
    in = Cat(ClientFlags(0), Option(42, {}));
  }
  SECTION("EXPORT_NAME over the option limit") {
    in = Cat(ClientFlags(kBothFlags), Option(kOptList, {}));
    in = Cat(in, Option(kOptExportName, Bytes(1001, 'a')));
  }
  SECTION("bad option magic") {
    in = Cat(ClientFlags(kBothFlags), Option(kOptList, {}, kNbdMagic));
  }
  SECTION("EXPORT_NAME with a NUL") {
    in = Cat(ClientFlags(kBothFlags), Option(kOptExportName, {'a', 0}));
  }
  Action a = Feed(&s, in);
  if (a == Action::kListExports) {  // the LIST before the oversized option
    s.ReplyList({});
    a = Feed(&s, Option(kOptExportName, Bytes(1001, 'a')));
  }
  CHECK(a == Action::kClose);
  CHECK_FALSE(s.close_reason().empty());
  CHECK_FALSE(s.in_transmission());
  size_t consumed = 1;
  CHECK(s.Feed(in.data(), in.size(), &consumed) == Action::kClose);
  CHECK(consumed == 0);
}

TEST_CASE("nbd: the number of options is capped", "[nbd]") {
  const uint32_t cap = GENERATE(3u, 1000u);
  SessionOptions opts;
  opts.max_options = cap;
  NbdSession s(opts);
  s.TakeOutput();
  REQUIRE(Feed(&s, ClientFlags(kBothFlags)) == Action::kNeedInput);
  for (uint32_t i = 0; i < cap; i++) REQUIRE(Feed(&s, Option(42, {})) == Action::kNeedInput);
  CHECK(OptReplies(s.TakeOutput()).size() == cap);
  CHECK(Feed(&s, Option(42, {})) == Action::kClose);
  CHECK_FALSE(s.close_reason().empty());
}

TEST_CASE("nbd: a pending action is repeated until the driver serves it", "[nbd]") {
  NbdSession s;
  s.TakeOutput();
  const Bytes in = Cat(Cat(ClientFlags(kBothFlags), Option(kOptList, {})), Option(kOptList, {}));
  size_t consumed = 0;
  REQUIRE(Feed(&s, in, &consumed) == Action::kListExports);
  const Bytes rest(in.begin() + consumed, in.end());
  CHECK(Feed(&s, rest, &consumed) == Action::kListExports);
  CHECK(consumed == 0);
  s.ReplyList({"a"});
  CHECK(Feed(&s, rest, &consumed) == Action::kListExports);
  CHECK(consumed == rest.size());
  s.ReplyList({"a"});
  // Replies out of turn are ignored.
  s.ReplyList({"zzz"});
  s.ReplyExport(Export());
  s.ReplyExportError(kRepErrUnknown, "x");
  CHECK(OptReplies(s.TakeOutput()).size() == 4);
  CHECK_FALSE(s.in_transmission());

  NbdSession t = Opened(Export());
  const Bytes two = Cat(Req(kCmdRead, 1, 0, 512), Req(kCmdRead, 2, 512, 512));
  REQUIRE(Feed(&t, two, &consumed) == Action::kRequest);
  CHECK(consumed == 28);
  CHECK(t.Feed(two.data() + 28, 28, &consumed) == Action::kRequest);
  CHECK(consumed == 0);  // request 1 not taken yet
  CHECK(t.TakeRequest().cookie == 1);
  CHECK(t.TakeRequest().cookie == 0);  // nothing pending: a default Request
  CHECK(t.Feed(two.data() + 28, 28, &consumed) == Action::kRequest);
  CHECK(consumed == 28);
  CHECK(t.TakeRequest().cookie == 2);
}

// ------------------------------------------------------------- transmission

TEST_CASE("nbd: valid READ, WRITE, TRIM, WRITE_ZEROES, FLUSH, DISC disconnects", "[nbd]") {
  NbdSession s = Opened(Export(1 << 20));

  Request r = Accepted(&s, Req(kCmdRead, 0x0102030405060708ull, 4096, 8192));
  CHECK(r.type == kCmdRead);
  CHECK(r.flags == 0);
  CHECK(r.cookie == 0x0102030405060708ull);
  CHECK(r.offset == 4096);
  CHECK(r.length == 8192);
  CHECK(r.payload.empty());

  const Bytes data = Pattern(1000, 3);
  r = Accepted(&s, Req(kCmdWrite, 2, (1 << 20) - 1000, 1000, kCmdFlagFua, data));
  CHECK(r.type == kCmdWrite);
  CHECK(r.flags == kCmdFlagFua);
  CHECK(r.offset == (1 << 20) - 1000);
  CHECK(Bytes(r.payload.begin(), r.payload.end()) == data);

  r = Accepted(&s, Req(kCmdTrim, 3, 0, 1 << 20, kCmdFlagFua));
  CHECK(r.type == kCmdTrim);
  CHECK(r.length == 1 << 20);

  r = Accepted(&s, Req(kCmdWriteZeroes, 4, 512, 512, kCmdFlagFua | kCmdFlagNoHole));
  CHECK(r.type == kCmdWriteZeroes);
  CHECK(r.flags == (kCmdFlagFua | kCmdFlagNoHole));

  r = Accepted(&s, Req(kCmdFlush, 5, 0, 0));
  CHECK(r.type == kCmdFlush);
  r = Accepted(&s, Req(kCmdFlush, 6, 123, 456, kCmdFlagFua));  // lenient
  CHECK(r.cookie == 6);
  r = Accepted(&s, Req(kCmdRead, 7, 0, 1, kCmdFlagFua));  // FUA is accepted everywhere
  CHECK(r.cookie == 7);

  CHECK(s.rejected_requests() == 0);
  size_t consumed = 0;
  const Bytes disc = Cat(Req(kCmdDisc, 8, 0, 0), Req(kCmdRead, 9, 0, 1));
  CHECK(Feed(&s, disc, &consumed) == Action::kDisconnect);
  CHECK(consumed == 28);
  CHECK_FALSE(s.has_output());  // DISC has no reply
  CHECK(Feed(&s, disc, &consumed) == Action::kDisconnect);
  CHECK(consumed == 0);
}

TEST_CASE("nbd: a bad request magic closes the connection", "[nbd]") {
  NbdSession s = Opened(Export());
  CHECK(Feed(&s, Req(kCmdRead, 1, 0, 512, 0, {}, kSimpleReplyMagic)) == Action::kClose);
  CHECK_FALSE(s.close_reason().empty());
  CHECK_FALSE(s.in_transmission());
}

TEST_CASE("nbd: an unknown command gets EINVAL with its cookie, the next one is read", "[nbd]") {
  NbdSession s = Opened(Export());
  for (uint16_t type : {uint16_t{5}, uint16_t{7}, uint16_t{8}, uint16_t{0xffff}}) {
    CHECK(Rejected(&s, Req(type, 0xabcdef0000000000ull + type, 0, 512),
                   0xabcdef0000000000ull + type) == kEInval);
  }
  CHECK(Accepted(&s, Req(kCmdRead, 1, 0, 512)).cookie == 1);
  CHECK(s.rejected_requests() == 4);
}

TEST_CASE("nbd: unknown or misplaced flags get EINVAL", "[nbd]") {
  NbdSession s = Opened(Export());
  CHECK(Rejected(&s, Req(kCmdRead, 1, 0, 512, 1 << 2), 1) == kEInval);  // DF: no structured replies
  CHECK(Rejected(&s, Req(kCmdRead, 2, 0, 512, kCmdFlagNoHole), 2) == kEInval);
  CHECK(Rejected(&s, Req(kCmdTrim, 3, 0, 512, kCmdFlagNoHole), 3) == kEInval);
  CHECK(Rejected(&s, Req(kCmdFlush, 4, 0, 0, 0x8000), 4) == kEInval);
  CHECK(Rejected(&s, Req(kCmdWriteZeroes, 5, 0, 512, 1 << 4), 5) == kEInval);  // FAST_ZERO
  // A WRITE with a bad flag: its payload is consumed, then rejected.
  CHECK(Rejected(&s, Req(kCmdWrite, 6, 0, 100, kCmdFlagNoHole, Pattern(100, 0)), 6) == kEInval);
  CHECK(AsBytes(Accepted(&s, Req(kCmdWrite, 7, 0, 3, 0, {1, 2, 3})).payload) == Bytes{1, 2, 3});
}

TEST_CASE("nbd: requests beyond the export end are rejected, overflow included", "[nbd]") {
  const uint64_t size = 1 << 20;
  NbdSession s = Opened(Export(size));
  const uint64_t max = ~uint64_t{0};
  // READ and TRIM: EINVAL.
  CHECK(Rejected(&s, Req(kCmdRead, 1, size - 511, 512), 1) == kEInval);
  CHECK(Rejected(&s, Req(kCmdRead, 2, size, 1), 2) == kEInval);
  CHECK(Rejected(&s, Req(kCmdRead, 3, max - 10, 100), 3) == kEInval);
  CHECK(Rejected(&s, Req(kCmdRead, 4, max, 1), 4) == kEInval);
  CHECK(Rejected(&s, Req(kCmdTrim, 5, size - 1, 2), 5) == kEInval);
  CHECK(Rejected(&s, Req(kCmdTrim, 6, max - 1, 0xffffffff), 6) == kEInval);
  // WRITE and WRITE_ZEROES: ENOSPC (the WRITE's payload is skipped).
  CHECK(Rejected(&s, Req(kCmdWrite, 7, size - 10, 20, 0, Pattern(20, 1)), 7) == kENoSpc);
  CHECK(Rejected(&s, Req(kCmdWrite, 8, max - 5, 10, 0, Pattern(10, 1)), 8) == kENoSpc);
  CHECK(Rejected(&s, Req(kCmdWriteZeroes, 9, size, 1), 9) == kENoSpc);
  CHECK(Rejected(&s, Req(kCmdWriteZeroes, 10, max - 1, 2), 10) == kENoSpc);
  // The last byte is fine.
  CHECK(Accepted(&s, Req(kCmdRead, 11, size - 1, 1)).cookie == 11);
  CHECK(AsBytes(Accepted(&s, Req(kCmdWrite, 12, size - 1, 1, 0, {9})).payload) == Bytes{9});
  CHECK(s.rejected_requests() == 10);
}

TEST_CASE("nbd: zero lengths and unaligned requests get EINVAL", "[nbd]") {
  ExportInfo info = Export(1 << 20);
  info.min_block = 512;
  NbdSession s = Opened(info);
  CHECK(Rejected(&s, Req(kCmdRead, 1, 0, 0), 1) == kEInval);
  CHECK(Rejected(&s, Req(kCmdWrite, 2, 0, 0), 2) == kEInval);
  CHECK(Rejected(&s, Req(kCmdTrim, 3, 0, 0), 3) == kEInval);
  CHECK(Rejected(&s, Req(kCmdWriteZeroes, 4, 0, 0), 4) == kEInval);
  CHECK(Rejected(&s, Req(kCmdRead, 5, 1, 512), 5) == kEInval);
  CHECK(Rejected(&s, Req(kCmdRead, 6, 512, 511), 6) == kEInval);
  CHECK(Rejected(&s, Req(kCmdWrite, 7, 100, 512, 0, Pattern(512, 0)), 7) == kEInval);
  CHECK(Rejected(&s, Req(kCmdTrim, 8, 0, 1000), 8) == kEInval);
  CHECK(Accepted(&s, Req(kCmdRead, 9, 1024, 512)).cookie == 9);
}

TEST_CASE("nbd: READ over the maximum payload gets EINVAL, WRITE over it closes", "[nbd]") {
  SessionOptions opts;
  opts.max_payload = 64 * 1024;
  ExportInfo info = Export(1 << 30);
  info.max_block = 32 * 1024;  // smaller still: what is advertised is enforced
  NbdSession s = Opened(info, opts);
  CHECK(Rejected(&s, Req(kCmdRead, 1, 0, 32 * 1024 + 1), 1) == kEInval);
  CHECK(Rejected(&s, Req(kCmdRead, 2, 0, 0xffffffff), 2) == kEInval);
  CHECK(Accepted(&s, Req(kCmdRead, 3, 0, 32 * 1024)).length == 32 * 1024);
  // Between the advertised and the hard limit: skipped and rejected.
  CHECK(Rejected(&s, Req(kCmdWrite, 4, 0, 40 * 1024, 0, Pattern(40 * 1024, 0)), 4) == kEInval);
  // TRIM / WRITE_ZEROES have no payload: any length in range is fine.
  CHECK(Accepted(&s, Req(kCmdTrim, 5, 0, 1 << 30)).length == 1u << 30);
  CHECK(Accepted(&s, Req(kCmdWriteZeroes, 6, 0, 1 << 29)).length == 1u << 29);
  CHECK(Feed(&s, Req(kCmdWrite, 7, 0, 64 * 1024 + 1)) == Action::kClose);
  CHECK(s.close_reason().find("WRITE") != std::string::npos);

  // The advertised maximum is the smaller of the two limits.
  NbdSession t(opts);
  t.TakeOutput();
  REQUIRE(Feed(&t, Cat(ClientFlags(kBothFlags), Option(kOptGo, GoData("vm")))) ==
          Action::kOpenExport);
  t.ReplyExport(Export());  // max_block 32 MiB
  std::vector<OptReply> replies = OptReplies(t.TakeOutput());
  REQUIRE(replies.size() == 3);
  Reader bs(replies[1].data);
  CHECK(bs.u16() == kInfoBlockSize);
  bs.u32();
  bs.u32();
  CHECK(bs.u32() == 64 * 1024);
}

TEST_CASE("nbd: a read-only export refuses WRITE, TRIM, WRITE_ZEROES with EPERM", "[nbd]") {
  NbdSession s = Opened(Export(1 << 20, true));
  CHECK(Rejected(&s, Req(kCmdWrite, 1, 0, 512, 0, Pattern(512, 5)), 1) == kEPerm);
  CHECK(Rejected(&s, Req(kCmdTrim, 2, 0, 512), 2) == kEPerm);
  CHECK(Rejected(&s, Req(kCmdWriteZeroes, 3, 0, 512, kCmdFlagNoHole), 3) == kEPerm);
  // EPERM wins over the range error.
  CHECK(Rejected(&s, Req(kCmdWrite, 4, 2 << 20, 8, 0, Pattern(8, 5)), 4) == kEPerm);
  CHECK(Accepted(&s, Req(kCmdRead, 5, 0, 512)).cookie == 5);
  CHECK(Accepted(&s, Req(kCmdFlush, 6, 0, 0)).cookie == 6);
}

TEST_CASE("nbd: WRITE payload and headers may arrive in pieces", "[nbd]") {
  NbdSession s = Opened(Export());
  const Bytes data = Pattern(5000, 9);
  const Bytes in = Cat(Req(kCmdWrite, 42, 8192, 5000, 0, data), Req(kCmdRead, 43, 0, 4096));
  size_t fed = 0;
  // Odd piece sizes: header split, payload split, next header glued on.
  for (size_t piece : {1, 2, 20, 5, 1000, 3000, 999}) {
    size_t consumed = 0;
    REQUIRE(s.Feed(in.data() + fed, piece, &consumed) == Action::kNeedInput);
    REQUIRE(consumed == piece);
    fed += piece;
  }
  size_t consumed = 0;
  REQUIRE(s.Feed(in.data() + fed, in.size() - fed, &consumed) == Action::kRequest);
  fed += consumed;
  const Request w = s.TakeRequest();
  CHECK(w.cookie == 42);
  CHECK(AsBytes(w.payload) == data);
  REQUIRE(s.Feed(in.data() + fed, in.size() - fed, &consumed) == Action::kRequest);
  CHECK(fed + consumed == in.size());
  CHECK(s.TakeRequest().cookie == 43);
}

TEST_CASE("nbd: a WRITE payload can be received straight into the request buffer", "[nbd]") {
  // Bigger than the up-front reservation, so the buffer has to grow too.
  const uint32_t len = (8u << 20) + 12345;
  NbdSession s = Opened(Export(64 << 20));
  const Bytes data = Pattern(len, 3);
  Bytes hdr = Req(kCmdWrite, 77, 4096, len);
  size_t consumed = 0;
  // The header and the first 100 payload bytes come through Feed.
  Bytes first = Cat(hdr, Bytes(data.begin(), data.begin() + 100));
  REQUIRE(s.Feed(first.data(), first.size(), &consumed) == Action::kNeedInput);
  REQUIRE(consumed == first.size());
  size_t done = 100;
  std::mt19937 rng(5);
  while (done < len) {
    size_t space = 0;
    uint8_t* p = s.PayloadSpace(&space);
    REQUIRE(p != nullptr);
    REQUIRE(space > 0);
    REQUIRE(space <= len - done);
    size_t n = std::min<size_t>(space, 1 + rng() % (1 << 20));
    std::memcpy(p, data.data() + done, n);
    s.PayloadFilled(n);
    done += n;
    if (done < len) REQUIRE(s.Feed(nullptr, 0, &consumed) == Action::kNeedInput);
  }
  size_t space = 0;
  CHECK(s.PayloadSpace(&space) == nullptr);
  REQUIRE(s.Feed(nullptr, 0, &consumed) == Action::kRequest);
  Request w = s.TakeRequest();
  CHECK(w.cookie == 77);
  CHECK(w.payload.size() == len);
  CHECK(AsBytes(w.payload) == data);
  CHECK(reinterpret_cast<uintptr_t>(w.payload.data()) % 4096 == 0);
  // A rejected WRITE (beyond the end) offers no space: its bytes are skipped.
  Bytes bad = Req(kCmdWrite, 78, 64 << 20, 8192);
  REQUIRE(s.Feed(bad.data(), bad.size(), &consumed) == Action::kNeedInput);
  CHECK(s.PayloadSpace(&space) == nullptr);
  CHECK(space == 0);
}

TEST_CASE("nbd: with admit_requests a READ or WRITE waits for Admit before its payload is taken",
          "[nbd]") {
  // The server reserves a request's bytes in its host-wide budget before
  // they are allocated; a WRITE payload's buffer used to be allocated (up
  // to 8 MiB at once, growing to 32 MiB) as soon as its header was read.
  SessionOptions opts;
  opts.admit_requests = true;
  NbdSession s = Opened(Export(64 << 20), opts);
  const Bytes data = Pattern(3 * 4096, 3);
  const Bytes write = Cat(Req(kCmdWrite, 5, 4096, 3 * 4096), data);
  size_t consumed = 0;
  REQUIRE(s.Feed(write.data(), write.size(), &consumed) == Action::kAdmit);
  CHECK(consumed == 28);  // the header only
  CHECK(s.admit_bytes() == 3 * 4096);
  size_t space = 1;
  CHECK(s.PayloadSpace(&space) == nullptr);  // nothing allocated to read into
  CHECK(space == 0);
  size_t again = 1;
  CHECK(s.Feed(write.data() + consumed, write.size() - consumed, &again) == Action::kAdmit);
  CHECK(again == 0);
  s.Admit();
  CHECK(s.admit_bytes() == 0);
  REQUIRE(s.Feed(write.data() + consumed, write.size() - consumed, &again) == Action::kRequest);
  CHECK(again == write.size() - consumed);
  const Request w = s.TakeRequest();
  CHECK(w.cookie == 5);
  CHECK(AsBytes(w.payload) == data);

  const Bytes read = Req(kCmdRead, 6, 0, 1 << 20);
  REQUIRE(s.Feed(read.data(), read.size(), &consumed) == Action::kAdmit);
  CHECK(s.admit_bytes() == 1 << 20);
  s.Admit();
  REQUIRE(s.Feed(nullptr, 0, &consumed) == Action::kRequest);
  CHECK(s.TakeRequest().cookie == 6);

  // Requests that hold no data, and rejected ones, are not held.
  CHECK(Accepted(&s, Req(kCmdFlush, 7, 0, 0)).cookie == 7);
  CHECK(Accepted(&s, Req(kCmdTrim, 8, 0, 1 << 20)).cookie == 8);
  CHECK(Rejected(&s, Req(kCmdRead, 9, 64 << 20, 4096), 9) == kEInval);
  const Bytes bad = Cat(Req(kCmdWrite, 10, 64 << 20, 4096), Pattern(4096, 1));
  REQUIRE(s.Feed(bad.data(), bad.size(), &consumed) == Action::kNeedInput);
  CHECK(consumed == bad.size());
}

TEST_CASE("nbd: EncodeSimpleReplyHeader is magic, error, cookie, big-endian", "[nbd]") {
  const Bytes h = EncodeSimpleReplyHeader(0x1122334455667788ull, kENoSpc);
  CHECK(h ==
        Bytes{0x67, 0x44, 0x66, 0x98, 0, 0, 0, 28, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88});
}

// --------------------------------------------------- split-feeding property

namespace {

// Everything a driver observes, in order: actions, requests, server bytes.
struct Transcript {
  std::vector<std::string> events;
  Bytes output;
};

// Drives a session over `stream`, delivering it in chunks of next_chunk()
// bytes, answering the handshake like a server would.
Transcript Drive(const Bytes& stream, const std::function<size_t()>& next_chunk,
                 const SessionOptions& opts) {
  Transcript t;
  NbdSession s(opts);
  Bytes pending;  // delivered, not yet consumed
  size_t delivered = 0;
  auto drain = [&] {
    Bytes out = s.TakeOutput();
    t.output.insert(t.output.end(), out.begin(), out.end());
  };
  for (;;) {
    drain();
    size_t consumed = 0;
    const Action a = s.Feed(pending.data(), pending.size(), &consumed);
    REQUIRE(consumed <= pending.size());
    pending.erase(pending.begin(), pending.begin() + consumed);
    drain();
    switch (a) {
      case Action::kNeedInput: {
        REQUIRE(pending.empty());
        if (delivered == stream.size()) {
          t.events.push_back("eof, rejected " + std::to_string(s.rejected_requests()));
          return t;
        }
        const size_t n = std::min(next_chunk(), stream.size() - delivered);
        pending.assign(stream.begin() + delivered, stream.begin() + delivered + n);
        delivered += n;
        break;
      }
      case Action::kListExports:
        t.events.push_back("list");
        s.ReplyList({"vm", "ro"});
        break;
      case Action::kOpenExport:
        t.events.push_back("open " + s.export_name() + (s.info_only() ? " info" : ""));
        if (s.export_name() == "vm" || s.export_name() == "ro") {
          ExportInfo info;
          info.size = 1 << 20;
          info.read_only = s.export_name() == "ro";
          s.ReplyExport(info);
        } else {
          s.ReplyExportError(kRepErrUnknown, "no export " + s.export_name());
        }
        break;
      case Action::kRequest: {
        const Request r = s.TakeRequest();
        t.events.push_back("request after " + std::to_string(s.rejected_requests()) +
                           " rejected: " + std::to_string(r.type) + " " + std::to_string(r.flags) +
                           " " + std::to_string(r.cookie) + " " + std::to_string(r.offset) + " " +
                           std::to_string(r.length) + " " +
                           std::string(r.payload.begin(), r.payload.end()));
        const Bytes h = EncodeSimpleReplyHeader(r.cookie, 0);
        t.output.insert(t.output.end(), h.begin(), h.end());
        break;
      }
      case Action::kAdmit:
        // Admitted at once: the transcript is the one without admission.
        REQUIRE(opts.admit_requests);
        REQUIRE(s.admit_bytes() > 0);
        s.Admit();
        break;
      case Action::kDisconnect:
        t.events.push_back("disconnect");
        return t;
      case Action::kClose:
        t.events.push_back("close " + s.close_reason());
        return t;
    }
  }
}

// A plausible client stream with mistakes sprinkled in.
Bytes RandomStream(std::mt19937_64& rng) {
  auto pick = [&](uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); };
  Bytes b = ClientFlags(pick(20) == 0 ? 7 : kClientFlagFixedNewstyle | (pick(2) ? 2 : 0));
  const int options = static_cast<int>(pick(5));
  for (int i = 0; i < options; i++) {
    switch (pick(6)) {
      case 0:
        b = Cat(b, Option(kOptList, pick(4) == 0 ? Bytes{1} : Bytes{}));
        break;
      case 1:
        b = Cat(b, Option(kOptInfo, GoData(pick(2) ? "vm" : "nope", {kInfoName})));
        break;
      case 2:
        b = Cat(b, Option(kOptGo, GoData("missing")));
        break;
      case 3:
        b = Cat(b, Option(static_cast<uint32_t>(pick(20)), Pattern(pick(40), 1)));
        break;
      case 4:
        b = Cat(b, Option(kOptGo, Pattern(pick(12), 2)));
        break;  // malformed
      default:
        b = Cat(b, Option(kOptStructuredReply, {}));
        break;
    }
  }
  switch (pick(4)) {
    case 0:
      b = Cat(b, Option(kOptExportName, {'v', 'm'}));
      break;
    case 1:
      b = Cat(b, Option(kOptGo, GoData("ro")));
      break;
    default:
      b = Cat(b, Option(kOptGo, GoData("vm", {kInfoBlockSize})));
      break;
  }
  const int requests = static_cast<int>(pick(40));
  for (int i = 0; i < requests; i++) {
    const uint16_t types[] = {kCmdRead,        kCmdWrite, kCmdWrite, kCmdTrim,
                              kCmdWriteZeroes, kCmdFlush, 5,         77};
    const uint16_t type = types[pick(8)];
    const uint16_t flags = pick(4) == 0 ? static_cast<uint16_t>(pick(8)) : 0;
    uint64_t offset = pick(4) == 0 ? ~uint64_t{0} - pick(1 << 21) : pick(1 << 21);
    uint32_t length = static_cast<uint32_t>(pick(3) == 0 ? pick(9000) : pick(600));
    if (pick(50) == 0) length = 1u << 31;
    Bytes payload;
    if (type == kCmdWrite && length <= 8192) payload = Pattern(length, static_cast<uint8_t>(i));
    b = Cat(b, Req(type, rng(), offset, length, flags, payload));
  }
  switch (pick(8)) {
    case 0:
      b = Cat(b, Req(kCmdDisc, 1, 0, 0));
      break;
    case 1:
      b = Cat(b, Req(kCmdRead, 1, 0, 1, 0, {}, 0xdeadbeef));
      break;
    case 2:
      b.resize(b.size() - pick(std::min<size_t>(b.size(), 30)));
      break;  // cut short
    default:
      break;
  }
  return b;
}

}  // namespace

TEST_CASE("nbd: byte-at-a-time and chunked feeding match one big feed", "[nbd]") {
  SessionOptions opts;
  opts.max_payload = 8192;
  for (uint64_t seed = 1; seed <= 300; seed++) {
    std::mt19937_64 rng(seed);
    const Bytes stream = RandomStream(rng);
    INFO("seed " << seed << ", " << stream.size() << " bytes");
    const Transcript whole = Drive(
        stream, [] { return size_t{1} << 30; }, opts);
    const Transcript bytes = Drive(
        stream, [] { return size_t{1}; }, opts);
    std::mt19937_64 chunk_rng(seed * 31);
    const Transcript chunks = Drive(
        stream, [&] { return std::uniform_int_distribution<size_t>(1, 64)(chunk_rng); }, opts);
    REQUIRE(bytes.events == whole.events);
    REQUIRE(bytes.output == whole.output);
    REQUIRE(chunks.events == whole.events);
    REQUIRE(chunks.output == whole.output);
    SessionOptions admitting = opts;
    admitting.admit_requests = true;
    const Transcript admitted = Drive(
        stream, [] { return size_t{7}; }, admitting);
    REQUIRE(admitted.events == whole.events);
    REQUIRE(admitted.output == whole.output);
  }
}
