// The server side of the NBD protocol (fixed newstyle handshake, simple
// replies), as a sans-I/O state machine: NbdSession consumes the bytes a
// client sent and says what the server must do; it never touches a socket,
// a volume or a thread. The Asio connection (nbd_server.cc) and the fuzz
// target (tests/fuzz/fuzz_nbd_session.cc) drive the same code.
//
// Supported: NBD_OPT_EXPORT_NAME, NBD_OPT_GO, NBD_OPT_INFO, NBD_OPT_LIST,
// NBD_OPT_ABORT (other options get NBD_REP_ERR_UNSUP); a client without
// fixed newstyle may send only NBD_OPT_EXPORT_NAME, as the spec has it;
// commands READ,
// WRITE (+FUA), FLUSH, TRIM (+FUA), WRITE_ZEROES (+FUA, +NO_HOLE), DISC.
// Structured replies are not offered, so every reply is a simple reply.
//
// Protocol reference: https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "util/io_buffer.h"

namespace dede::nbd {

// ---- wire constants (from the NBD protocol; never change)
inline constexpr uint64_t kNbdMagic = 0x4e42444d41474943ull;    // "NBDMAGIC"
inline constexpr uint64_t kIHaveOpt = 0x49484156454F5054ull;    // "IHAVEOPT"
inline constexpr uint64_t kOptReplyMagic = 0x0003e889045565a9ull;
inline constexpr uint32_t kRequestMagic = 0x25609513;
inline constexpr uint32_t kSimpleReplyMagic = 0x67446698;

inline constexpr uint16_t kFlagFixedNewstyle = 1 << 0;
inline constexpr uint16_t kFlagNoZeroes = 1 << 1;
inline constexpr uint32_t kClientFlagFixedNewstyle = 1 << 0;
inline constexpr uint32_t kClientFlagNoZeroes = 1 << 1;

inline constexpr uint32_t kOptExportName = 1;
inline constexpr uint32_t kOptAbort = 2;
inline constexpr uint32_t kOptList = 3;
inline constexpr uint32_t kOptStartTls = 5;
inline constexpr uint32_t kOptInfo = 6;
inline constexpr uint32_t kOptGo = 7;
inline constexpr uint32_t kOptStructuredReply = 8;

inline constexpr uint32_t kRepAck = 1;
inline constexpr uint32_t kRepServer = 2;
inline constexpr uint32_t kRepInfo = 3;
inline constexpr uint32_t kRepErrUnsup = 0x80000001;
inline constexpr uint32_t kRepErrPolicy = 0x80000002;
inline constexpr uint32_t kRepErrInvalid = 0x80000003;
inline constexpr uint32_t kRepErrPlatform = 0x80000004;
inline constexpr uint32_t kRepErrUnknown = 0x80000006;
inline constexpr uint32_t kRepErrShutdown = 0x80000007;
inline constexpr uint32_t kRepErrTooBig = 0x80000009;

inline constexpr uint16_t kInfoExport = 0;
inline constexpr uint16_t kInfoName = 1;
inline constexpr uint16_t kInfoDescription = 2;
inline constexpr uint16_t kInfoBlockSize = 3;

inline constexpr uint16_t kTxHasFlags = 1 << 0;
inline constexpr uint16_t kTxReadOnly = 1 << 1;
inline constexpr uint16_t kTxSendFlush = 1 << 2;
inline constexpr uint16_t kTxSendFua = 1 << 3;
inline constexpr uint16_t kTxSendTrim = 1 << 5;
inline constexpr uint16_t kTxSendWriteZeroes = 1 << 6;
inline constexpr uint16_t kTxCanMultiConn = 1 << 8;

inline constexpr uint16_t kCmdRead = 0;
inline constexpr uint16_t kCmdWrite = 1;
inline constexpr uint16_t kCmdDisc = 2;
inline constexpr uint16_t kCmdFlush = 3;
inline constexpr uint16_t kCmdTrim = 4;
inline constexpr uint16_t kCmdWriteZeroes = 6;

inline constexpr uint16_t kCmdFlagFua = 1 << 0;
inline constexpr uint16_t kCmdFlagNoHole = 1 << 1;

// Error values in simple replies.
inline constexpr uint32_t kEPerm = 1;
inline constexpr uint32_t kEIO = 5;
inline constexpr uint32_t kENoMem = 12;
inline constexpr uint32_t kEInval = 22;
inline constexpr uint32_t kENoSpc = 28;
inline constexpr uint32_t kEOverflow = 75;
inline constexpr uint32_t kENotSup = 95;
inline constexpr uint32_t kEShutdown = 108;

// What an export looks like to clients.
struct ExportInfo {
  uint64_t size = 0;
  bool read_only = false;
  std::string description;
  uint32_t min_block = 1;             // any byte range works (read-modify-write)
  uint32_t preferred_block = 4096;    // the volume's block
  uint32_t max_block = 32u << 20;     // largest READ/WRITE payload
};

// A transmission-phase request that passed validation.
struct Request {
  uint16_t type = 0;   // kCmd*
  uint16_t flags = 0;  // kCmdFlag*
  uint64_t cookie = 0; // "handle": echoed in the reply
  uint64_t offset = 0;
  uint32_t length = 0;
  IoBytes payload;  // WRITE only; 4 KiB-aligned (O_DIRECT without a bounce)
};

struct SessionOptions {
  // Longer option data is read and dropped, and the option refused
  // (NBD_REP_ERR_TOO_BIG; ERR_UNSUP if unknown); for EXPORT_NAME, which
  // has no error reply, the connection is closed.
  uint32_t max_option_bytes = 64 * 1024;
  // Oversized option data dropped in one handshake, all options together:
  // past it the connection is closed (a client could otherwise keep a
  // connection in the handshake for as long as it sends).
  uint64_t max_dropped_option_bytes = uint64_t{64} << 20;
  uint32_t max_payload = 32u << 20;       // WRITE larger: connection closed; READ larger: EINVAL
  uint32_t max_options = 1000;            // more options in one handshake: connection closed
  // True: a valid READ or WRITE is held at Action::kAdmit until Admit(),
  // before any of its payload is taken or it is yielded, so the driver can
  // reserve its bytes (the host-wide NBD memory budget) before they are
  // allocated. False: admitted at once (the fuzz target, most tests).
  bool admit_requests = false;
};

// What the driver must do after Feed() returns.
enum class Action {
  kNeedInput,     // everything fed was consumed; feed more when it arrives
  kListExports,   // client sent NBD_OPT_LIST: call ReplyList()
  kOpenExport,    // GO / INFO / EXPORT_NAME for export_name(): call ReplyExport()
  kRequest,       // a valid request: TakeRequest(), execute, reply (EncodeSimpleReplyHeader)
  kAdmit,         // (admit_requests only) a READ / WRITE of admit_bytes(): Admit() when it fits
  kDisconnect,    // NBD_CMD_DISC or NBD_OPT_ABORT: finish in-flight requests, flush output, close
  kClose,         // protocol violation: flush output, close now; close_reason() says why
};

// Driving a session: feed what the socket delivered; act on the action;
// send TakeOutput() whenever has_output(); feed the unconsumed rest (or,
// after a Reply*() call, at least an empty Feed so a pending close is seen).
// Every message the session queues is complete, so the driver may send
// TakeOutput() between its own replies, never inside one (a READ's
// header and data go out together).
class NbdSession {
 public:
  explicit NbdSession(const SessionOptions& opts = {});

  // The server greeting, queued to output at construction.

  // Consumes client bytes from data[0..len). Returns the action and sets
  // *consumed. It returns as soon as there is something for the driver to
  // do, so *consumed may be less than len: feed the rest afterwards.
  // kNeedInput always means *consumed == len. An action that waits for
  // the driver is returned again, consuming nothing, until it is served:
  // kListExports / kOpenExport until the matching Reply*() call, kAdmit
  // until Admit(), kRequest until TakeRequest(); after kDisconnect / kClose nothing more is ever
  // consumed and Feed keeps returning that action.
  Action Feed(const uint8_t* data, size_t len, size_t* consumed);

  // For kOpenExport: the export name asked for and whether the client only
  // asked for information (NBD_OPT_INFO: the export is not entered).
  const std::string& export_name() const { return export_name_; }
  bool info_only() const { return info_only_; }

  // Answer to kListExports: the names, or (the listing failed) an
  // NBD_REP_ERR_PLATFORM with a message; the handshake goes on either way.
  void ReplyList(const std::vector<std::string>& names);
  void ReplyListError(const std::string& message);
  // Answer to kOpenExport: the export's info, or an NBD_REP_ERR_* with a
  // human-readable message (sent to the client; qemu prints it). On success
  // of GO/EXPORT_NAME the session enters the transmission phase. For
  // EXPORT_NAME an error closes the connection (that option has no error
  // reply): nothing is queued and the next Feed() returns kClose, with the
  // message in close_reason(). A rep_err without the error bit (31) is sent
  // as NBD_REP_ERR_UNKNOWN. Calls that answer nothing pending are ignored.
  void ReplyExport(const ExportInfo& info);
  void ReplyExportError(uint32_t rep_err, const std::string& message);

  // After kAdmit: the bytes the request will hold in memory (its READ
  // reply or WRITE payload), else 0. Admit() lets it go on: a WRITE's
  // payload is then received, a READ yielded as kRequest.
  uint32_t admit_bytes() const;
  // After kAdmit: the payload bytes the client still has to send for it
  // (a WRITE's length; 0 for a READ).
  uint32_t admit_payload() const;
  void Admit();

  // After kRequest: the request (payload moved out). Without a pending
  // request: a default Request.
  Request TakeRequest();

  // Zero-copy receive of a WRITE payload. While the payload of a request
  // that will be executed is arriving, returns where the driver may read up
  // to *len bytes straight from the socket (else nullptr, *len = 0). After
  // reading n of them, call PayloadFilled(n), then Feed (even with no bytes)
  // as usual: it yields kRequest once the payload is complete.
  uint8_t* PayloadSpace(size_t* len);
  void PayloadFilled(size_t n);

  // Bytes to send to the client, in order; cleared by the call.
  std::vector<uint8_t> TakeOutput();
  bool has_output() const { return !out_.empty(); }

  bool in_transmission() const {
    return phase_ == Phase::kTransmission || phase_ == Phase::kAdmitWait ||
           phase_ == Phase::kRequestPayload;
  }
  const std::string& close_reason() const { return close_reason_; }
  const ExportInfo& export_info() const { return export_; }

  // Counters for status and tests.
  uint64_t rejected_requests() const { return rejected_; }

 private:
  enum class Phase {
    kClientFlags,
    kOptionHeader,
    kOptionData,
    kOptionSkip,
    kWaitList,
    kWaitExport,
    kTransmission,
    kAdmitWait,
    kRequestPayload,
    kDone,
  };
  Action Run(const uint8_t* data, size_t len, size_t* pos);
  bool Gather(size_t need, const uint8_t* data, size_t len, size_t* pos);
  Action HandleOption();
  Action RefuseOversizedOption();
  Action ParseRequestHeader();
  uint32_t CheckRequest(const Request& r) const;
  uint32_t MaxPayload() const;
  Action Finish(Action action, std::string reason);
  void QueueOptionReply(uint32_t option, uint32_t type, const void* data, size_t len);
  void QueueOptionError(uint32_t option, uint32_t rep_err, const std::string& message);
  void QueueInfo(uint16_t info, const void* data, size_t len);
  void QueueSimpleReply(uint64_t cookie, uint32_t error);
  void GrowPayload(size_t need);
  void StartAdmitted();
  void Reject(uint64_t cookie, uint32_t error);

  SessionOptions opts_;
  Phase phase_ = Phase::kClientFlags;
  bool fixed_newstyle_ = false;  // the client set NBD_FLAG_C_FIXED_NEWSTYLE
  bool no_zeroes_ = false;
  std::vector<uint8_t> in_;   // partial header/option bytes being assembled
  std::vector<uint8_t> out_;
  uint32_t option_ = 0;       // the option being handled (its replies echo it)
  uint32_t option_len_ = 0;
  uint32_t option_skip_left_ = 0;  // kOptionSkip: oversized option data still to drop
  uint64_t option_bytes_dropped_ = 0;  // every oversized option's data, this handshake
  uint32_t options_seen_ = 0;
  std::string export_name_;
  bool info_only_ = false;
  bool export_name_opt_ = false;  // kOpenExport came from NBD_OPT_EXPORT_NAME
  std::vector<uint16_t> info_requests_;
  ExportInfo export_;             // the export in transmission
  Request pending_;               // header parsed; payload being read or awaiting TakeRequest
  bool request_ready_ = false;
  size_t payload_have_ = 0;  // bytes of pending_.payload received so far
  uint32_t payload_left_ = 0;     // WRITE payload bytes still to consume
  uint32_t payload_error_ = 0;    // non-zero: payload is skipped, then this error replied
  Action final_action_ = Action::kClose;  // what Feed keeps returning in kDone
  std::string close_reason_;
  uint64_t rejected_ = 0;
};

// A simple reply: header (+ data for a successful READ).
std::vector<uint8_t> EncodeSimpleReplyHeader(uint64_t cookie, uint32_t error);

}  // namespace dede::nbd
