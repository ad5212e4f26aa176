#include "util/status.h"

#include <cstring>

namespace dede {

Status Status::FromErrno(const std::string& what, int err) {
  std::string m = what + ": " + std::strerror(err);
  // A quota or a file-size limit on the filesystem holding a volume file
  // is "no space" to whoever writes (the NBD spec asks EDQUOT and EFBIG to
  // reach clients as ENOSPC).
  if (err == ENOSPC || err == EDQUOT || err == EFBIG) return NoSpace(m);
  if (err == ENOENT) return NotFound(m);
  if (err == EINVAL) return Invalid(m);
  // Not EACCES: "cannot open /dev/sdb: Permission denied" read as "in use"
  // (a refused fcntl lock, which may also be EACCES, is told apart where
  // locks are taken).
  if (err == EAGAIN || err == EBUSY) return Locked(m);
  return IoError(m);
}

const char* Status::CodeName() const {
  switch (code_) {
    case Code::kOk: return "ok";
    case Code::kIoError: return "I/O error";
    case Code::kCorruption: return "corruption";
    case Code::kNotFound: return "not found";
    case Code::kExists: return "exists";
    case Code::kInvalid: return "invalid argument";
    case Code::kNoSpace: return "no space";
    case Code::kLocked: return "locked";
    case Code::kUnsupported: return "unsupported";
    case Code::kMismatch: return "content mismatch";
    case Code::kUnavailable: return "unavailable";
  }
  return "unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return msg_;
}

}  // namespace dede
