// Status and Result<T>: errors travel as values.
//
// A Status is either OK or carries a code and a one-line message that says
// what failed and where ("superblock at block 0: bad checksum"). Code is
// coarse on purpose: callers branch on it (EBUSY-like kLocked, ENOSPC-like
// kNoSpace); people read the message.
#pragma once

#include <cerrno>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace dede {

class [[nodiscard]] Status {
 public:
  enum class Code {
    kOk = 0,
    kIoError,        // device said no (EIO, short read, transport failure)
    kCorruption,     // on-disk bytes failed a check (magic, crc, bounds)
    kNotFound,       // no such file, lock, or entry
    kExists,         // name already taken
    kInvalid,        // bad argument from the caller
    kNoSpace,        // out of blocks, inodes, or journal
    kLocked,         // resource held by another process or host
    kUnsupported,    // newer on-disk version or feature we do not know
    kMismatch,       // compare_and_share: content differs (not an error of the volume)
    kUnavailable,    // component not reachable (iSCSI portal, lock daemon)
  };

  Status() = default;
  static Status Ok() { return Status(); }
  static Status IoError(std::string m) { return Status(Code::kIoError, std::move(m)); }
  static Status Corruption(std::string m) { return Status(Code::kCorruption, std::move(m)); }
  static Status NotFound(std::string m) { return Status(Code::kNotFound, std::move(m)); }
  static Status Exists(std::string m) { return Status(Code::kExists, std::move(m)); }
  static Status Invalid(std::string m) { return Status(Code::kInvalid, std::move(m)); }
  static Status NoSpace(std::string m) { return Status(Code::kNoSpace, std::move(m)); }
  static Status Locked(std::string m) { return Status(Code::kLocked, std::move(m)); }
  static Status Unsupported(std::string m) { return Status(Code::kUnsupported, std::move(m)); }
  static Status Mismatch(std::string m) { return Status(Code::kMismatch, std::move(m)); }
  static Status Unavailable(std::string m) { return Status(Code::kUnavailable, std::move(m)); }
  // errno-based I/O error: "what: strerror(err)".
  static Status FromErrno(const std::string& what, int err);

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return msg_; }
  std::string ToString() const;
  const char* CodeName() const;

  // Prefix context to the message: "opening /dev/x: " + msg.
  Status WithContext(const std::string& ctx) const {
    if (ok()) return *this;
    return Status(code_, ctx + ": " + msg_);
  }

 private:
  Status(Code c, std::string m) : code_(c), msg_(std::move(m)) {}
  Code code_ = Code::kOk;
  std::string msg_;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T v) : v_(std::move(v)) {}  // NOLINT: implicit by design
  Result(Status s) : v_(std::move(s)) {}  // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace dede

#define DEDE_CONCAT_INNER(a, b) a##b
#define DEDE_CONCAT(a, b) DEDE_CONCAT_INNER(a, b)

// Return the status from the enclosing function if it is not OK.
#define RETURN_IF_ERROR(expr)               \
  do {                                      \
    ::dede::Status _st = (expr);            \
    if (!_st.ok()) return _st;              \
  } while (0)

// ASSIGN_OR_RETURN(auto x, Foo()); declares x from a Result or returns its status.
#define ASSIGN_OR_RETURN(lhs, expr) ASSIGN_OR_RETURN_IMPL(DEDE_CONCAT(_res_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()
