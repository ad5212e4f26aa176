// FdCloser: owns a file descriptor and closes it on every path out of a
// scope; Close() closes early and reports the error.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <string>

#include "util/status.h"

namespace dede {

class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(FdCloser&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(FdCloser&&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  int get() const { return fd_; }
  // Closes now, reporting the error a deferred write-back may surface.
  Status Close(const std::string& path) {
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return Status::FromErrno(path + ": close", errno);
    return Status::Ok();
  }

 private:
  int fd_;
};

}  // namespace dede
