// Fuzzes NbdSession (agent/nbd_protocol.h): whole client byte streams,
// handshake and transmission, delivered in fuzzer-chosen pieces.
//
// Input: byte 0 configures the session and the export (see Config), byte 1
// chooses how the stream is cut into Feed() calls, the rest is what the
// client sends. A driver answers like dedupd would: LIST with a fixed list,
// GO / INFO / EXPORT_NAME with success or an error depending on the name
// and the config byte.
//
// Properties:
//   - Feed never consumes more than it was given, consumes everything when
//     it asks for more input, and keeps answering kDisconnect / kClose
//     (consuming nothing) once it said so; kClose comes with a reason.
//   - the driver loop ends: every Feed either consumes input or hands the
//     driver an action, so the number of calls is bounded by the input.
//   - a request handed out is one the driver may execute without further
//     checks: known type and flags, non-empty and inside the export
//     (offset + length without overflow), aligned, READ / WRITE within the
//     maximum payload, WRITE carrying exactly length bytes, nothing that
//     writes on a read-only export.
//   - everything the server sends is well-framed: option replies during
//     the handshake, 16-byte simple error replies (one per rejected
//     request) during transmission.
//   - cutting the stream differently changes nothing: the split run and a
//     run with the whole stream in one Feed see the same actions, requests
//     and output bytes.
//
// Seeds: started with DEDE_FUZZ_WRITE_SEEDS=DIR, the target writes its seed
// inputs (valid sessions of every kind) to DIR and exits.
// tests/fuzz/corpus/fuzz_nbd_session/ holds their output.
#include <boost/endian/conversion.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "agent/nbd_protocol.h"

using namespace dede::nbd;

namespace {

constexpr const char* kTarget = "fuzz_nbd_session";

using Bytes = std::vector<uint8_t>;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "%s: property violated: %s\n", kTarget, what.c_str());
  std::abort();
}

#define NBD_CHECK(cond, what) \
  do {                        \
    if (!(cond)) Fail(what);  \
  } while (0)

// Byte 0 of the input.
struct Config {
  SessionOptions opts;
  uint64_t size = 0;
  uint32_t min_block = 1;
  uint32_t max_block = 32u << 20;
  bool read_only = false;   // every export, not only "ro"
  bool opens_fail = false;  // every open fails

  explicit Config(uint8_t b) {
    static constexpr uint32_t kMaxPayloads[4] = {32u << 20, 4096, 100, 0};
    static constexpr uint64_t kSizes[4] = {1 << 20, 0, 4097, ~uint64_t{0}};
    opts.max_payload = kMaxPayloads[b & 3];
    size = kSizes[(b >> 2) & 3];
    if (b & 0x10) {
      opts.max_option_bytes = 64;
      opts.max_options = 8;
      max_block = 1024;
    }
    if (b & 0x20) min_block = 512;
    read_only = (b & 0x40) != 0;
    opens_fail = (b & 0x80) != 0;
    // Every bit is taken: half the configurations, by parity, hold READs
    // and WRITEs for admission (the driver admits at once, so the
    // transcript is the same either way).
    opts.admit_requests = __builtin_parity(b) != 0;
  }
};

// Everything the driver observed, in order.
struct Transcript {
  std::vector<std::string> events;
  Bytes output;
};

// Checks that `out` is a sequence of complete option replies.
void CheckOptionReplies(const Bytes& out) {
  size_t pos = 0;
  while (pos < out.size()) {
    NBD_CHECK(out.size() - pos >= 20, "truncated option reply");
    NBD_CHECK(boost::endian::load_big_u64(out.data() + pos) == kOptReplyMagic,
              "option reply without its magic");
    const uint32_t type = boost::endian::load_big_u32(out.data() + pos + 12);
    const uint32_t len = boost::endian::load_big_u32(out.data() + pos + 16);
    NBD_CHECK(out.size() - pos - 20 >= len, "option reply longer than what was queued");
    if (type & 0x80000000u) NBD_CHECK(len <= 4096, "error message over 4096 bytes");
    pos += 20 + size_t{len};
  }
}

void CheckRequest(const Request& r, const ExportInfo& e, const Config& cfg) {
  const std::string what = "request type " + std::to_string(r.type) + " offset " +
                           std::to_string(r.offset) + " length " + std::to_string(r.length) + ": ";
  switch (r.type) {
    case kCmdRead:
    case kCmdWrite:
    case kCmdFlush:
    case kCmdTrim:
    case kCmdWriteZeroes:
      break;
    default:
      Fail(what + "unknown type handed out");
  }
  NBD_CHECK((r.flags & ~(kCmdFlagFua | kCmdFlagNoHole)) == 0, what + "unknown flag accepted");
  NBD_CHECK(!(r.flags & kCmdFlagNoHole) || r.type == kCmdWriteZeroes,
            what + "NO_HOLE accepted outside WRITE_ZEROES");
  NBD_CHECK(r.type == kCmdWrite ? r.payload.size() == r.length : r.payload.empty(),
            what + "payload size does not match");
  if (r.type == kCmdFlush) return;
  NBD_CHECK(r.length > 0, what + "empty request accepted");
  NBD_CHECK(r.offset <= e.size && r.length <= e.size - r.offset, what + "beyond the export end");
  NBD_CHECK(r.offset % e.min_block == 0 && r.length % e.min_block == 0, what + "unaligned");
  if (r.type == kCmdRead || r.type == kCmdWrite) {
    NBD_CHECK(r.length <= cfg.opts.max_payload && r.length <= e.max_block,
              what + "over the maximum payload");
  }
  NBD_CHECK(r.type == kCmdRead || !e.read_only, what + "write on a read-only export");
}

// Runs one session over `stream`, each Feed() given at most next_chunk()
// newly arrived bytes (0: everything).
template <typename Chunker>
Transcript Drive(const Bytes& stream, const Config& cfg, Chunker next_chunk) {
  Transcript t;
  NbdSession s(cfg.opts);
  t.output = s.TakeOutput();
  Bytes pending;
  size_t delivered = 0;
  // Every call consumes a byte or returns an action; actions are bounded
  // by the bytes that caused them, plus the final repeats.
  const size_t max_calls = 4 * stream.size() + 64;
  for (size_t calls = 0;; calls++) {
    NBD_CHECK(calls < max_calls, "driver loop does not end");
    const bool was_transmitting = s.in_transmission();
    const uint64_t rejected_before = s.rejected_requests();
    size_t consumed = ~size_t{0};
    const Action a = s.Feed(pending.data(), pending.size(), &consumed);
    NBD_CHECK(consumed <= pending.size(), "consumed more than fed");
    NBD_CHECK(a != Action::kNeedInput || consumed == pending.size(),
              "asks for input with input left");
    pending.erase(pending.begin(), pending.begin() + consumed);

    const Bytes out = s.TakeOutput();
    NBD_CHECK(!s.has_output(), "output left after TakeOutput");
    const uint64_t rejected = s.rejected_requests() - rejected_before;
    if (was_transmitting) {
      NBD_CHECK(out.size() == 16 * rejected, "transmission output is not one reply per rejection");
      for (size_t i = 0; i < out.size(); i += 16) {
        NBD_CHECK(boost::endian::load_big_u32(out.data() + i) == kSimpleReplyMagic,
                  "simple reply without its magic");
        const uint32_t err = boost::endian::load_big_u32(out.data() + i + 4);
        NBD_CHECK(err == kEInval || err == kEPerm || err == kENoSpc,
                  "unexpected error " + std::to_string(err));
      }
    } else {
      NBD_CHECK(rejected == 0, "request rejected outside transmission");
      CheckOptionReplies(out);
    }
    t.output.insert(t.output.end(), out.begin(), out.end());

    switch (a) {
      case Action::kNeedInput: {
        if (delivered == stream.size()) {
          t.events.push_back("eof");
          return t;
        }
        size_t n = next_chunk();
        if (n == 0 || n > stream.size() - delivered) n = stream.size() - delivered;
        pending.assign(stream.begin() + delivered, stream.begin() + delivered + n);
        delivered += n;
        break;
      }
      case Action::kListExports: {
        NBD_CHECK(!s.in_transmission(), "LIST in transmission");
        t.events.push_back("list");
        s.ReplyList({"", "vm", "ro"});
        const Bytes reply = s.TakeOutput();
        CheckOptionReplies(reply);
        t.output.insert(t.output.end(), reply.begin(), reply.end());
        break;
      }
      case Action::kOpenExport: {
        NBD_CHECK(!s.in_transmission(), "open in transmission");
        const std::string name = s.export_name();
        NBD_CHECK(name.size() <= 4096 && name.find('\0') == std::string::npos,
                  "invalid export name handed out");
        t.events.push_back("open " + name + (s.info_only() ? " (info)" : ""));
        if (cfg.opens_fail || (!name.empty() && name[0] == 'x')) {
          s.ReplyExportError(kRepErrUnknown, "no export named '" + name + "'");
        } else {
          ExportInfo info;
          info.size = cfg.size;
          info.read_only = cfg.read_only || name == "ro";
          info.min_block = cfg.min_block;
          info.max_block = cfg.max_block;
          info.description = "fuzz export " + name;
          s.ReplyExport(info);
          NBD_CHECK(s.in_transmission() == !s.info_only(), "GO did not enter transmission");
        }
        const Bytes reply = s.TakeOutput();
        // EXPORT_NAME's success reply is bare: size, flags, maybe zeroes.
        if (reply.size() >= 8 && boost::endian::load_big_u64(reply.data()) != kOptReplyMagic) {
          NBD_CHECK(s.in_transmission() && (reply.size() == 10 || reply.size() == 134),
                    "reply to EXPORT_NAME is not size, flags and zeroes");
        } else {
          CheckOptionReplies(reply);
        }
        t.output.insert(t.output.end(), reply.begin(), reply.end());
        break;
      }
      case Action::kAdmit: {
        NBD_CHECK(cfg.opts.admit_requests, "admission not asked for");
        NBD_CHECK(s.in_transmission(), "admission outside transmission");
        const uint32_t n = s.admit_bytes();
        NBD_CHECK(n > 0 && n <= cfg.opts.max_payload,
                  "admission of " + std::to_string(n) + " bytes");
        size_t none = ~size_t{0};
        NBD_CHECK(s.Feed(nullptr, 0, &none) == Action::kAdmit && none == 0,
                  "admission not waited for");
        s.Admit();
        break;
      }
      case Action::kRequest: {
        NBD_CHECK(s.in_transmission(), "request outside transmission");
        const Request r = s.TakeRequest();
        CheckRequest(r, s.export_info(), cfg);
        t.events.push_back("request " + std::to_string(r.type) + "/" + std::to_string(r.flags) +
                           " " + std::to_string(r.cookie) + " " + std::to_string(r.offset) + "+" +
                           std::to_string(r.length) + " " +
                           std::string(r.payload.begin(), r.payload.end()));
        const Bytes h = EncodeSimpleReplyHeader(r.cookie, 0);
        t.output.insert(t.output.end(), h.begin(), h.end());
        break;
      }
      case Action::kDisconnect:
      case Action::kClose: {
        NBD_CHECK(a == Action::kDisconnect || !s.close_reason().empty(), "close without a reason");
        t.events.push_back((a == Action::kClose ? "close: " : "disconnect: ") + s.close_reason());
        // Final: nothing more is consumed, whatever is fed.
        const uint8_t more[3] = {1, 2, 3};
        size_t again = 0;
        NBD_CHECK(s.Feed(more, sizeof more, &again) == a && again == 0,
                  "session goes on after its end");
        NBD_CHECK(!s.has_output(), "output after the end");
        return t;
      }
    }
  }
}

// A small generator for the split points (xorshift; the seed is byte 1).
class Splitter {
 public:
  explicit Splitter(uint8_t seed) : max_(seed), state_(0x9e3779b97f4a7c15ull ^ seed) {}
  size_t operator()() {
    if (max_ == 0) return 0;  // whole stream at once
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    return 1 + static_cast<size_t>(state_ % max_);
  }

 private:
  uint8_t max_;
  uint64_t state_;
};

// ---- seeds

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
void Option(Bytes* b, uint32_t option, const Bytes& data) {
  PutU64(b, kIHaveOpt);
  PutU32(b, option);
  PutU32(b, static_cast<uint32_t>(data.size()));
  b->insert(b->end(), data.begin(), data.end());
}
Bytes GoData(const std::string& name, const std::vector<uint16_t>& infos) {
  Bytes d;
  PutU32(&d, static_cast<uint32_t>(name.size()));
  d.insert(d.end(), name.begin(), name.end());
  PutU16(&d, static_cast<uint16_t>(infos.size()));
  for (uint16_t i : infos) PutU16(&d, i);
  return d;
}
void Req(Bytes* b, uint16_t type, uint16_t flags, uint64_t cookie, uint64_t offset, uint32_t length,
         bool with_payload = false) {
  PutU32(b, kRequestMagic);
  PutU16(b, flags);
  PutU16(b, type);
  PutU64(b, cookie);
  PutU64(b, offset);
  PutU32(b, length);
  if (with_payload) {
    for (uint32_t i = 0; i < length; i++) b->push_back(static_cast<uint8_t>('a' + i % 26));
  }
}

Bytes Seed(uint8_t config, uint8_t split, uint32_t client_flags) {
  Bytes b = {config, split};
  PutU32(&b, client_flags);
  return b;
}

// A mix of valid and rejected requests against a 1 MiB export.
void Requests(Bytes* b) {
  Req(b, kCmdRead, 0, 1, 0, 4096);
  Req(b, kCmdWrite, kCmdFlagFua, 2, 8192, 37, true);
  Req(b, kCmdTrim, 0, 3, 4096, 8192);
  Req(b, kCmdWriteZeroes, kCmdFlagNoHole, 4, 0, 512);
  Req(b, kCmdFlush, 0, 5, 0, 0);
  Req(b, 5, 0, 6, 0, 512);                             // unknown command
  Req(b, kCmdRead, 0, 7, (1 << 20) - 100, 200);        // beyond the end
  Req(b, kCmdWrite, 0, 8, ~uint64_t{0} - 4, 8, true);  // overflow
  Req(b, kCmdRead, 1 << 2, 9, 0, 512);                 // unknown flag
}

std::vector<Bytes> Seeds() {
  std::vector<Bytes> seeds;
  const uint32_t both = kClientFlagFixedNewstyle | kClientFlagNoZeroes;

  // GO with information requests, then transmission.
  Bytes b = Seed(0, 0, both);
  Option(&b, kOptGo, GoData("vm", {kInfoBlockSize, kInfoName, kInfoDescription}));
  Requests(&b);
  Req(&b, kCmdDisc, 0, 10, 0, 0);
  seeds.push_back(b);

  // EXPORT_NAME (with the 124 zero bytes), fed a byte at a time.
  b = Seed(0, 1, kClientFlagFixedNewstyle);
  Option(&b, kOptExportName, {'v', 'm'});
  Requests(&b);
  seeds.push_back(b);

  // LIST, INFO, an unknown export, then the read-only one; small limits.
  b = Seed(0x10 | 0x01, 7, both);
  Option(&b, kOptList, {});
  Option(&b, kOptInfo, GoData("vm", {}));
  Option(&b, kOptGo, GoData("xnope", {}));
  Option(&b, kOptGo, GoData("ro", {kInfoBlockSize}));
  Requests(&b);
  seeds.push_back(b);

  // Unsupported and malformed options, then ABORT.
  b = Seed(0, 3, both);
  Option(&b, kOptStartTls, {});
  Option(&b, kOptStructuredReply, {});
  Option(&b, 42, {1, 2, 3});
  Option(&b, kOptGo, {0, 0, 0, 9, 'v'});
  Option(&b, kOptList, {0});
  Option(&b, kOptAbort, {});
  seeds.push_back(b);

  // Aligned export with a huge size: overflow checks at the top end.
  b = Seed(0x20 | 0x0c, 64, both);
  Option(&b, kOptGo, GoData("", {}));
  Req(&b, kCmdRead, 0, 1, ~uint64_t{0} - 511, 512);
  Req(&b, kCmdTrim, 0, 2, 512, 100);
  Req(&b, kCmdWrite, 0, 3, 1024, 512, true);
  seeds.push_back(b);

  // A failing EXPORT_NAME closes.
  b = Seed(0x80, 0, both);
  Option(&b, kOptExportName, {'v', 'm'});
  seeds.push_back(b);
  return seeds;
}

void MaybeWriteSeeds() {
  const char* dir = std::getenv("DEDE_FUZZ_WRITE_SEEDS");
  if (dir == nullptr || *dir == '\0') return;
  const std::vector<Bytes> seeds = Seeds();
  for (size_t i = 0; i < seeds.size(); i++) {
    const std::string path = std::string(dir) + "/seed-" + std::to_string(i);
    FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr || std::fwrite(seeds[i].data(), 1, seeds[i].size(), f) != seeds[i].size() ||
        std::fclose(f) != 0) {
      std::fprintf(stderr, "%s: cannot write %s\n", kTarget, path.c_str());
      std::exit(1);
    }
  }
  std::fprintf(stderr, "%s: wrote %zu seeds to %s\n", kTarget, seeds.size(), dir);
  std::exit(0);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  MaybeWriteSeeds();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const Config cfg(data[0]);
  const Bytes stream(data + 2, data + size);
  Splitter split(data[1]);
  const Transcript cut = Drive(stream, cfg, split);
  if (data[1] != 0) {
    const Transcript whole = Drive(stream, cfg, [] { return size_t{0}; });
    NBD_CHECK(cut.events == whole.events, "split feeding changed the actions");
    NBD_CHECK(cut.output == whole.output, "split feeding changed the output");
  }
  return 0;
}
