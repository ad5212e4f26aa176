// The NBD server protocol engine: see nbd_protocol.h.
//
// Everything on the wire is big-endian and is read and written field by
// field (boost::endian load_big_* / store_big_*); no struct is ever copied
// to or from the wire.
//
// What a client can get wrong, and what happens:
//   - handshake: bad client flags, an option other than EXPORT_NAME from
//     a client without fixed newstyle, a bad option magic, more than
//     max_options options, or an EXPORT_NAME that is not a valid NBD
//     string or is longer than max_option_bytes: the connection is closed
//     (there is no way to answer). A malformed GO / INFO / LIST gets
//     NBD_REP_ERR_INVALID and an unknown option NBD_REP_ERR_UNSUP; option
//     data longer than max_option_bytes is read and dropped (it is never
//     held), then the option gets NBD_REP_ERR_TOO_BIG (ERR_UNSUP if
//     unknown; ABORT is acknowledged), and the handshake goes on, up to
//     max_dropped_option_bytes of such data in all (then it is closed).
//   - transmission: a bad request magic, or a WRITE whose payload exceeds
//     max_payload, closes the connection (the stream cannot be resynced,
//     or skipping that much is a denial of service). Every other bad
//     request gets a simple error reply and the session reads on:
//       unknown command, unknown flag, NO_HOLE but not WRITE_ZEROES   EINVAL
//       WRITE / TRIM / WRITE_ZEROES on a read-only export             EPERM
//       length 0 (READ, WRITE, TRIM, WRITE_ZEROES)                    EINVAL
//       READ / WRITE longer than the advertised maximum payload       EINVAL
//       offset or length not a multiple of the minimum block          EINVAL
//       beyond the end (offset + length > size, overflow included):
//         WRITE, WRITE_ZEROES                                         ENOSPC
//         READ, TRIM                                                  EINVAL
//     The checks run in that order; the spec asks for these codes. A
//     rejected WRITE's payload is consumed and dropped first. FLUSH is
//     accepted whatever its offset and length (the spec says they must be
//     0, but nothing depends on them). FUA is accepted on every command,
//     as the spec requires once NBD_FLAG_SEND_FUA is advertised.
#include "agent/nbd_protocol.h"

#include <algorithm>
#include <boost/endian/conversion.hpp>
#include <cstring>
#include <utility>

namespace dede::nbd {

namespace {

using boost::endian::load_big_u16;
using boost::endian::load_big_u32;
using boost::endian::load_big_u64;

constexpr size_t kOptionHeaderBytes = 8 + 4 + 4;
constexpr size_t kRequestHeaderBytes = 4 + 2 + 2 + 8 + 8 + 4;
constexpr size_t kExportNameZeroes = 124;
constexpr uint32_t kKnownClientFlags = kClientFlagFixedNewstyle | kClientFlagNoZeroes;
constexpr uint16_t kKnownCmdFlags = kCmdFlagFua | kCmdFlagNoHole;
constexpr uint32_t kRepErrBit = 0x80000000u;
// Up-front reservation of a WRITE payload: most writes fit, so they are
// received without regrowing; a client announcing 32 MiB and sending nothing
// holds at most this much.
constexpr uint32_t kPayloadReserve = 8 << 20;
// The spec's bound on any string (names, messages, descriptions).
constexpr size_t kMaxStringBytes = 4096;

void PutU16(std::vector<uint8_t>* out, uint16_t v) {
  uint8_t b[2];
  boost::endian::store_big_u16(b, v);
  out->insert(out->end(), b, b + sizeof b);
}
void PutU32(std::vector<uint8_t>* out, uint32_t v) {
  uint8_t b[4];
  boost::endian::store_big_u32(b, v);
  out->insert(out->end(), b, b + sizeof b);
}
void PutU64(std::vector<uint8_t>* out, uint64_t v) {
  uint8_t b[8];
  boost::endian::store_big_u64(b, v);
  out->insert(out->end(), b, b + sizeof b);
}
template <typename Vec>
void PutBytes(Vec* out, const void* data, size_t len) {
  if (len == 0) return;  // data may be null
  const auto* p = static_cast<const uint8_t*>(data);
  out->insert(out->end(), p, p + len);
}

// A string cut to the spec's limit without splitting a UTF-8 sequence
// (clients print these; half a character is garbage on their screen).
std::string ClampString(const std::string& s) {
  if (s.size() <= kMaxStringBytes) return s;
  size_t n = kMaxStringBytes;
  while (n > 0 && (static_cast<uint8_t>(s[n]) & 0xc0) == 0x80) n--;
  return s.substr(0, n);
}

// An export name a client may send: NBD strings contain no NUL and are at
// most 4096 bytes. UTF-8 validity is left to the export lookup (a name
// that is not valid UTF-8 simply matches no export).
bool ValidName(const std::string& name) {
  return name.size() <= kMaxStringBytes && name.find('\0') == std::string::npos;
}

uint16_t TransmissionFlags(const ExportInfo& info) {
  uint16_t flags =
      kTxHasFlags | kTxSendFlush | kTxSendFua | kTxSendTrim | kTxSendWriteZeroes | kTxCanMultiConn;
  if (info.read_only) flags |= kTxReadOnly;
  return flags;
}

const char* OptionName(uint32_t option) {
  switch (option) {
    case kOptExportName:
      return "NBD_OPT_EXPORT_NAME";
    case kOptAbort:
      return "NBD_OPT_ABORT";
    case kOptList:
      return "NBD_OPT_LIST";
    case kOptStartTls:
      return "NBD_OPT_STARTTLS";
    case kOptInfo:
      return "NBD_OPT_INFO";
    case kOptGo:
      return "NBD_OPT_GO";
    case kOptStructuredReply:
      return "NBD_OPT_STRUCTURED_REPLY";
    default:
      return nullptr;
  }
}

std::string Hex(uint64_t v) {
  static const char kDigits[] = "0123456789abcdef";
  std::string s;
  do {
    s.insert(s.begin(), kDigits[v & 0xf]);
    v >>= 4;
  } while (v != 0);
  return "0x" + s;
}

}  // namespace

std::vector<uint8_t> EncodeSimpleReplyHeader(uint64_t cookie, uint32_t error) {
  std::vector<uint8_t> out;
  out.reserve(16);
  PutU32(&out, kSimpleReplyMagic);
  PutU32(&out, error);
  PutU64(&out, cookie);
  return out;
}

NbdSession::NbdSession(const SessionOptions& opts) : opts_(opts) {
  PutU64(&out_, kNbdMagic);
  PutU64(&out_, kIHaveOpt);
  PutU16(&out_, kFlagFixedNewstyle | kFlagNoZeroes);
}

Action NbdSession::Feed(const uint8_t* data, size_t len, size_t* consumed) {
  size_t pos = 0;
  const Action action = Run(data, len, &pos);
  *consumed = pos;
  return action;
}

// Copies input into in_ until it holds `need` bytes. False: all input was
// taken and more is needed.
bool NbdSession::Gather(size_t need, const uint8_t* data, size_t len, size_t* pos) {
  if (in_.size() < need) {
    const size_t take = std::min(need - in_.size(), len - *pos);
    PutBytes(&in_, data + *pos, take);
    *pos += take;
  }
  return in_.size() == need;
}

// Each pass of the loop either consumes input, returns, or moves to a
// phase that needs input before it can pass again, so it cannot spin.
Action NbdSession::Run(const uint8_t* data, size_t len, size_t* pos) {
  if (request_ready_) return Action::kRequest;
  for (;;) {
    switch (phase_) {
      case Phase::kDone:
        return final_action_;
      case Phase::kWaitList:
        return Action::kListExports;
      case Phase::kWaitExport:
        return Action::kOpenExport;
      case Phase::kAdmitWait:
        return Action::kAdmit;

      case Phase::kClientFlags: {
        if (!Gather(4, data, len, pos)) return Action::kNeedInput;
        const uint32_t flags = load_big_u32(in_.data());
        in_.clear();
        // The spec: the server MUST drop a client with flags it does not
        // know.
        if ((flags & ~kKnownClientFlags) != 0) {
          return Finish(Action::kClose, "client flags " + Hex(flags) + " have unknown bits");
        }
        // A plain (non-fixed) newstyle client (very old nbd-client) may
        // only send EXPORT_NAME, and cannot take an option reply.
        fixed_newstyle_ = (flags & kClientFlagFixedNewstyle) != 0;
        no_zeroes_ = (flags & kClientFlagNoZeroes) != 0;
        phase_ = Phase::kOptionHeader;
        break;
      }

      case Phase::kOptionHeader: {
        if (!Gather(kOptionHeaderBytes, data, len, pos)) return Action::kNeedInput;
        const uint64_t magic = load_big_u64(in_.data());
        option_ = load_big_u32(in_.data() + 8);
        option_len_ = load_big_u32(in_.data() + 12);
        in_.clear();
        if (magic != kIHaveOpt) {
          return Finish(Action::kClose, "bad option magic " + Hex(magic));
        }
        if (!fixed_newstyle_ && option_ != kOptExportName) {
          const char* name = OptionName(option_);
          return Finish(Action::kClose,
                        (name ? std::string(name) : "option " + std::to_string(option_)) +
                            " from a client without fixed newstyle, which may "
                            "only send NBD_OPT_EXPORT_NAME");
        }
        if (++options_seen_ > opts_.max_options) {
          return Finish(Action::kClose, "more than " + std::to_string(opts_.max_options) +
                                            " options in one handshake");
        }
        // Option data is buffered whole, so its size is what bounds the
        // memory a client can make us hold during the handshake: longer
        // data is dropped as it arrives.
        if (option_len_ > opts_.max_option_bytes) {
          if (option_ == kOptExportName) {
            return Finish(Action::kClose, "NBD_OPT_EXPORT_NAME has " + std::to_string(option_len_) +
                                              " bytes of data (limit " +
                                              std::to_string(opts_.max_option_bytes) + ")");
          }
          option_bytes_dropped_ += option_len_;
          if (option_bytes_dropped_ > opts_.max_dropped_option_bytes) {
            return Finish(Action::kClose, "more than " +
                                              std::to_string(opts_.max_dropped_option_bytes) +
                                              " bytes of oversized option data in one handshake");
          }
          option_skip_left_ = option_len_;
          phase_ = Phase::kOptionSkip;
          break;
        }
        in_.reserve(option_len_);
        phase_ = Phase::kOptionData;
        break;
      }

      case Phase::kOptionSkip: {
        const size_t take = std::min<size_t>(option_skip_left_, len - *pos);
        *pos += take;
        option_skip_left_ -= static_cast<uint32_t>(take);
        if (option_skip_left_ > 0) return Action::kNeedInput;
        const Action action = RefuseOversizedOption();
        if (action != Action::kNeedInput) return action;
        break;
      }

      case Phase::kOptionData: {
        if (!Gather(option_len_, data, len, pos)) return Action::kNeedInput;
        const Action action = HandleOption();
        if (action != Action::kNeedInput) return action;
        break;
      }

      case Phase::kTransmission: {
        if (!Gather(kRequestHeaderBytes, data, len, pos)) return Action::kNeedInput;
        const Action action = ParseRequestHeader();
        if (action != Action::kNeedInput) return action;
        break;
      }

      case Phase::kRequestPayload: {
        const size_t take = std::min<size_t>(payload_left_, len - *pos);
        if (payload_error_ == 0 && take > 0) {
          GrowPayload(payload_have_ + take);
          std::memcpy(pending_.payload.data() + payload_have_, data + *pos, take);
          payload_have_ += take;
        }
        *pos += take;
        payload_left_ -= static_cast<uint32_t>(take);
        if (payload_left_ > 0) return Action::kNeedInput;
        phase_ = Phase::kTransmission;
        if (payload_error_ != 0) {
          Reject(pending_.cookie, payload_error_);
          pending_ = Request{};
          break;
        }
        request_ready_ = true;
        return Action::kRequest;
      }
    }
  }
}

// The option's data is in in_. Returns kNeedInput to go on reading
// options, or the action for the driver.
Action NbdSession::HandleOption() {
  const std::vector<uint8_t> data = std::move(in_);
  in_.clear();
  phase_ = Phase::kOptionHeader;

  switch (option_) {
    case kOptExportName: {
      std::string name(data.begin(), data.end());
      if (!ValidName(name)) {
        // EXPORT_NAME has no error reply: all we can do is hang up.
        return Finish(Action::kClose,
                      "NBD_OPT_EXPORT_NAME: the export name is not a valid "
                      "NBD string (NUL byte or longer than 4096 bytes)");
      }
      export_name_ = std::move(name);
      info_only_ = false;
      export_name_opt_ = true;
      info_requests_.clear();
      phase_ = Phase::kWaitExport;
      return Action::kOpenExport;
    }

    case kOptGo:
    case kOptInfo: {
      // u32 name length, name, u16 count, count x u16 info requests; the
      // lengths must add up to the option length exactly.
      const char* what = OptionName(option_);
      const size_t n = data.size();
      if (n < 4 + 2) {
        QueueOptionError(
            option_, kRepErrInvalid,
            std::string(what) + ": option data too short (" + std::to_string(n) + " bytes)");
        return Action::kNeedInput;
      }
      const uint32_t name_len = load_big_u32(data.data());
      if (name_len > n - 4 - 2) {
        QueueOptionError(option_, kRepErrInvalid,
                         std::string(what) + ": export name length " + std::to_string(name_len) +
                             " exceeds the option data");
        return Action::kNeedInput;
      }
      const uint8_t* p = data.data() + 4 + name_len;
      const uint16_t count = load_big_u16(p);
      p += 2;
      if (n != 4 + size_t{name_len} + 2 + 2 * size_t{count}) {
        QueueOptionError(option_, kRepErrInvalid,
                         std::string(what) + ": " + std::to_string(count) +
                             " information requests do not fit the option data");
        return Action::kNeedInput;
      }
      std::string name(data.begin() + 4, data.begin() + 4 + name_len);
      if (!ValidName(name)) {
        QueueOptionError(option_, kRepErrInvalid,
                         std::string(what) +
                             ": the export name is not a valid NBD string "
                             "(NUL byte or longer than 4096 bytes)");
        return Action::kNeedInput;
      }
      info_requests_.clear();
      for (uint16_t i = 0; i < count; i++) info_requests_.push_back(load_big_u16(p + 2 * i));
      export_name_ = std::move(name);
      info_only_ = option_ == kOptInfo;
      export_name_opt_ = false;
      phase_ = Phase::kWaitExport;
      return Action::kOpenExport;
    }

    case kOptList:
      if (!data.empty()) {
        QueueOptionError(option_, kRepErrInvalid, "NBD_OPT_LIST: the option takes no data");
        return Action::kNeedInput;
      }
      phase_ = Phase::kWaitList;
      return Action::kListExports;

    case kOptAbort:
      // Any data is ignored, as the spec asks.
      QueueOptionReply(option_, kRepAck, nullptr, 0);
      return Finish(Action::kDisconnect, "client sent NBD_OPT_ABORT");

    case kOptStartTls:
      QueueOptionError(option_, kRepErrUnsup, "NBD_OPT_STARTTLS: this server does not do TLS");
      return Action::kNeedInput;

    case kOptStructuredReply:
      QueueOptionError(option_, kRepErrUnsup,
                       "NBD_OPT_STRUCTURED_REPLY: this server sends simple replies only");
      return Action::kNeedInput;

    default:
      QueueOptionError(option_, kRepErrUnsup,
                       "option " + std::to_string(option_) + " is not supported");
      return Action::kNeedInput;
  }
}

// An option whose data was over max_option_bytes, now dropped.
Action NbdSession::RefuseOversizedOption() {
  phase_ = Phase::kOptionHeader;
  const std::string size = std::to_string(option_len_) + " bytes of option data (limit " +
                           std::to_string(opts_.max_option_bytes) + ")";
  switch (option_) {
    case kOptAbort:
      // Any data is ignored, as the spec asks.
      QueueOptionReply(option_, kRepAck, nullptr, 0);
      return Finish(Action::kDisconnect, "client sent NBD_OPT_ABORT");
    case kOptGo:
    case kOptInfo:
    case kOptList:
      QueueOptionError(option_, kRepErrTooBig, std::string(OptionName(option_)) + ": " + size);
      return Action::kNeedInput;
    default:
      QueueOptionError(option_, kRepErrUnsup,
                       "option " + std::to_string(option_) + " is not supported (" + size + ")");
      return Action::kNeedInput;
  }
}

// The request header is in in_.
Action NbdSession::ParseRequestHeader() {
  const uint8_t* p = in_.data();
  const uint32_t magic = load_big_u32(p);
  Request r;
  r.flags = load_big_u16(p + 4);
  r.type = load_big_u16(p + 6);
  r.cookie = load_big_u64(p + 8);
  r.offset = load_big_u64(p + 16);
  r.length = load_big_u32(p + 24);
  in_.clear();

  if (magic != kRequestMagic) {
    return Finish(Action::kClose, "bad request magic " + Hex(magic));
  }
  // No reply and no further input, whatever the other fields say: the
  // client is going away.
  if (r.type == kCmdDisc) return Finish(Action::kDisconnect, "client sent NBD_CMD_DISC");

  if (r.type == kCmdWrite) {
    if (r.length > opts_.max_payload) {
      return Finish(Action::kClose, "NBD_CMD_WRITE of " + std::to_string(r.length) +
                                        " bytes (limit " + std::to_string(opts_.max_payload) + ")");
    }
    // The payload follows whether or not the request is valid; a rejected
    // one is skipped rather than buffered. Up to kPayloadReserve is
    // reserved at once (pooled, aligned storage: no regrowth for common
    // sizes); beyond that the buffer grows with what arrives, so a client
    // that announces 32 MiB and sends nothing holds at most 8 MiB.
    payload_error_ = CheckRequest(r);
    payload_left_ = r.length;
    payload_have_ = 0;
    pending_ = std::move(r);
    if (payload_error_ == 0 && opts_.admit_requests) {
      // Nothing allocated before the driver has made room for it.
      phase_ = Phase::kAdmitWait;
      return Action::kAdmit;
    }
    phase_ = Phase::kRequestPayload;
    if (payload_error_ == 0) StartAdmitted();
    return Action::kNeedInput;
  }

  const uint32_t error = CheckRequest(r);
  if (error != 0) {
    Reject(r.cookie, error);
    return Action::kNeedInput;
  }
  pending_ = std::move(r);
  if (pending_.type == kCmdRead && opts_.admit_requests) {
    phase_ = Phase::kAdmitWait;
    return Action::kAdmit;
  }
  request_ready_ = true;
  return Action::kRequest;
}

uint32_t NbdSession::admit_bytes() const {
  return phase_ == Phase::kAdmitWait ? pending_.length : 0;
}

uint32_t NbdSession::admit_payload() const {
  return phase_ == Phase::kAdmitWait && pending_.type == kCmdWrite ? pending_.length : 0;
}

void NbdSession::Admit() {
  if (phase_ != Phase::kAdmitWait) return;
  StartAdmitted();
}

// pending_ (a valid READ or WRITE) goes on: a WRITE's payload is received,
// a READ is yielded.
void NbdSession::StartAdmitted() {
  if (pending_.type == kCmdWrite) {
    pending_.payload.resize(std::min<uint32_t>(pending_.length, kPayloadReserve));
    phase_ = Phase::kRequestPayload;
  } else {
    phase_ = Phase::kTransmission;
    request_ready_ = true;
  }
}

// The largest READ / WRITE payload accepted: the one advertised in
// NBD_INFO_BLOCK_SIZE.
uint32_t NbdSession::MaxPayload() const {
  if (export_.max_block == 0) return opts_.max_payload;
  return std::min(export_.max_block, opts_.max_payload);
}

// 0 if the request may be executed, else the NBD error to reply with (the
// order is documented at the top of this file).
uint32_t NbdSession::CheckRequest(const Request& r) const {
  switch (r.type) {
    case kCmdRead:
    case kCmdWrite:
    case kCmdFlush:
    case kCmdTrim:
    case kCmdWriteZeroes:
      break;
    default:
      return kEInval;
  }
  if ((r.flags & ~kKnownCmdFlags) != 0) return kEInval;
  if ((r.flags & kCmdFlagNoHole) != 0 && r.type != kCmdWriteZeroes) return kEInval;
  if (r.type == kCmdFlush) return 0;

  if (r.type != kCmdRead && export_.read_only) return kEPerm;
  if (r.length == 0) return kEInval;
  if ((r.type == kCmdRead || r.type == kCmdWrite) && r.length > MaxPayload()) return kEInval;
  const uint64_t min_block = std::max<uint32_t>(export_.min_block, 1);
  if (r.offset % min_block != 0 || r.length % min_block != 0) return kEInval;
  if (r.offset > export_.size || r.length > export_.size - r.offset) {
    return r.type == kCmdWrite || r.type == kCmdWriteZeroes ? kENoSpc : kEInval;
  }
  return 0;
}

Action NbdSession::Finish(Action action, std::string reason) {
  phase_ = Phase::kDone;
  final_action_ = action;
  close_reason_ = std::move(reason);
  in_.clear();
  in_.shrink_to_fit();
  return action;
}

void NbdSession::ReplyList(const std::vector<std::string>& names) {
  if (phase_ != Phase::kWaitList) return;
  for (const std::string& name : names) {
    std::vector<uint8_t> payload;
    payload.reserve(4 + name.size());
    PutU32(&payload, static_cast<uint32_t>(name.size()));
    PutBytes(&payload, name.data(), name.size());
    QueueOptionReply(kOptList, kRepServer, payload.data(), payload.size());
  }
  QueueOptionReply(kOptList, kRepAck, nullptr, 0);
  phase_ = Phase::kOptionHeader;
}

void NbdSession::ReplyListError(const std::string& message) {
  if (phase_ != Phase::kWaitList) return;
  QueueOptionError(kOptList, kRepErrPlatform, message);
  phase_ = Phase::kOptionHeader;
}

void NbdSession::ReplyExport(const ExportInfo& info) {
  if (phase_ != Phase::kWaitExport) return;
  const uint16_t flags = TransmissionFlags(info);

  if (export_name_opt_) {
    PutU64(&out_, info.size);
    PutU16(&out_, flags);
    if (!no_zeroes_) out_.insert(out_.end(), kExportNameZeroes, 0);
    export_ = info;
    phase_ = Phase::kTransmission;
    return;
  }

  std::vector<uint8_t> item;
  PutU64(&item, info.size);
  PutU16(&item, flags);
  QueueInfo(kInfoExport, item.data(), item.size());
  auto requested = [this](uint16_t type) {
    return std::find(info_requests_.begin(), info_requests_.end(), type) != info_requests_.end();
  };
  if (requested(kInfoName)) QueueInfo(kInfoName, export_name_.data(), export_name_.size());
  if (requested(kInfoDescription)) {
    const std::string description = ClampString(info.description);
    QueueInfo(kInfoDescription, description.data(), description.size());
  }
  // Sent whether asked for or not (the spec allows it): clients that do
  // not understand it ignore it, and the maximum is what the session
  // enforces, never more.
  item.clear();
  PutU32(&item, info.min_block);
  PutU32(&item, info.preferred_block);
  PutU32(&item,
         info.max_block == 0 ? opts_.max_payload : std::min(info.max_block, opts_.max_payload));
  QueueInfo(kInfoBlockSize, item.data(), item.size());
  QueueOptionReply(option_, kRepAck, nullptr, 0);

  if (info_only_) {
    phase_ = Phase::kOptionHeader;
  } else {
    export_ = info;
    phase_ = Phase::kTransmission;
  }
}

void NbdSession::ReplyExportError(uint32_t rep_err, const std::string& message) {
  if (phase_ != Phase::kWaitExport) return;
  if (export_name_opt_) {
    Finish(Action::kClose, "NBD_OPT_EXPORT_NAME '" + ClampString(export_name_) + "': " + message);
    return;
  }
  if ((rep_err & kRepErrBit) == 0) rep_err = kRepErrUnknown;
  QueueOptionError(option_, rep_err, message);
  phase_ = Phase::kOptionHeader;
}

// The payload buffer holds min(length, kPayloadReserve) bytes from the
// start and grows (doubling, never past the request's length) only for
// bigger writes, as their bytes arrive. Its size equals the length once
// the payload is complete.
void NbdSession::GrowPayload(size_t need) {
  IoBytes& p = pending_.payload;
  if (p.size() >= need) return;
  p.resize(std::min<size_t>(pending_.length, std::max(need, 2 * p.size())));
}

uint8_t* NbdSession::PayloadSpace(size_t* len) {
  *len = 0;
  if (phase_ != Phase::kRequestPayload || payload_error_ != 0 || payload_left_ == 0) {
    return nullptr;
  }
  GrowPayload(payload_have_ + 1);
  *len = std::min<size_t>(payload_left_, pending_.payload.size() - payload_have_);
  return pending_.payload.data() + payload_have_;
}

void NbdSession::PayloadFilled(size_t n) {
  if (phase_ != Phase::kRequestPayload || payload_error_ != 0) return;
  n = std::min<size_t>({n, payload_left_, pending_.payload.size() - payload_have_});
  payload_have_ += n;
  payload_left_ -= static_cast<uint32_t>(n);
}

Request NbdSession::TakeRequest() {
  if (!request_ready_) return Request{};
  request_ready_ = false;
  Request r = std::move(pending_);
  pending_ = Request{};
  return r;
}

std::vector<uint8_t> NbdSession::TakeOutput() {
  std::vector<uint8_t> out;
  out.swap(out_);
  return out;
}

void NbdSession::QueueOptionReply(uint32_t option, uint32_t type, const void* data, size_t len) {
  PutU64(&out_, kOptReplyMagic);
  PutU32(&out_, option);
  PutU32(&out_, type);
  PutU32(&out_, static_cast<uint32_t>(len));
  PutBytes(&out_, data, len);
}

void NbdSession::QueueOptionError(uint32_t option, uint32_t rep_err, const std::string& message) {
  const std::string text = ClampString(message);
  QueueOptionReply(option, rep_err, text.data(), text.size());
}

void NbdSession::QueueInfo(uint16_t info, const void* data, size_t len) {
  std::vector<uint8_t> payload;
  payload.reserve(2 + len);
  PutU16(&payload, info);
  PutBytes(&payload, data, len);
  QueueOptionReply(option_, kRepInfo, payload.data(), payload.size());
}

void NbdSession::QueueSimpleReply(uint64_t cookie, uint32_t error) {
  PutU32(&out_, kSimpleReplyMagic);
  PutU32(&out_, error);
  PutU64(&out_, cookie);
}

void NbdSession::Reject(uint64_t cookie, uint32_t error) {
  rejected_++;
  QueueSimpleReply(cookie, error);
}

}  // namespace dede::nbd
