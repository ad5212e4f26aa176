// Blocking Unix-socket helpers for tests that speak a protocol byte by byte
// (the raw NBD clients of the unit and integration tests, the control
// socket's client): connect, send and receive whole buffers, big-endian
// fields as the NBD protocol puts them.
#pragma once

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <boost/endian/conversion.hpp>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace dede::test {

// A connected stream socket to `path` (the test fails if it cannot be
// made). Receives, and sends too when `send_timeout_s` is set, give up
// after their timeout (0: wait for ever), so a server that goes silent
// fails the test rather than hangs it.
inline int ConnectUnix(const std::string& path, int recv_timeout_s = 0, int send_timeout_s = 0) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  REQUIRE(path.size() < sizeof(a.sun_path));
  std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    FAIL("connecting to " << path << ": " << std::strerror(errno));
  }
  if (recv_timeout_s > 0) {
    timeval tv{recv_timeout_s, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  if (send_timeout_s > 0) {
    timeval tv{send_timeout_s, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  }
  return fd;
}

// All of `n` bytes; false if the peer closed, an error or a timeout came.
inline bool SendAll(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Exactly `n` bytes; false at end of file, on an error or a timeout.
inline bool RecvAll(int fd, void* data, size_t n) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

inline void PutBig16(std::vector<uint8_t>* v, uint16_t x) {
  uint8_t b[2];
  boost::endian::store_big_u16(b, x);
  v->insert(v->end(), b, b + 2);
}
inline void PutBig32(std::vector<uint8_t>* v, uint32_t x) {
  uint8_t b[4];
  boost::endian::store_big_u32(b, x);
  v->insert(v->end(), b, b + 4);
}
inline void PutBig64(std::vector<uint8_t>* v, uint64_t x) {
  uint8_t b[8];
  boost::endian::store_big_u64(b, x);
  v->insert(v->end(), b, b + 8);
}

}  // namespace dede::test
