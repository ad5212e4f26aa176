// Little-endian encoding helpers. Every on-disk structure is encoded and
// decoded field by field through these; no struct is ever copied to disk.
#pragma once

#include <boost/endian/conversion.hpp>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace dede {

inline void EncodeU16(uint8_t* p, uint16_t v) { boost::endian::store_little_u16(p, v); }
inline void EncodeU32(uint8_t* p, uint32_t v) { boost::endian::store_little_u32(p, v); }
inline void EncodeU64(uint8_t* p, uint64_t v) { boost::endian::store_little_u64(p, v); }
inline uint16_t DecodeU16(const uint8_t* p) { return boost::endian::load_little_u16(p); }
inline uint32_t DecodeU32(const uint8_t* p) { return boost::endian::load_little_u32(p); }
inline uint64_t DecodeU64(const uint8_t* p) { return boost::endian::load_little_u64(p); }

// Sequential writer over a fixed buffer; the caller sizes the buffer.
class Encoder {
 public:
  Encoder(uint8_t* p, size_t cap) : p_(p), cap_(cap) {}
  void u8(uint8_t v) { p_[pos_++] = v; }
  void u16(uint16_t v) { EncodeU16(p_ + pos_, v); pos_ += 2; }
  void u32(uint32_t v) { EncodeU32(p_ + pos_, v); pos_ += 4; }
  void u64(uint64_t v) { EncodeU64(p_ + pos_, v); pos_ += 8; }
  void bytes(const void* s, size_t n) { std::memcpy(p_ + pos_, s, n); pos_ += n; }
  void zeros(size_t n) { std::memset(p_ + pos_, 0, n); pos_ += n; }
  size_t pos() const { return pos_; }
  size_t capacity() const { return cap_; }

 private:
  uint8_t* p_;
  size_t cap_;
  size_t pos_ = 0;
};

// Sequential reader; callers check remaining() before reading variable data.
class Decoder {
 public:
  Decoder(const uint8_t* p, size_t len) : p_(p), len_(len) {}
  uint8_t u8() { return p_[pos_++]; }
  uint16_t u16() { uint16_t v = DecodeU16(p_ + pos_); pos_ += 2; return v; }
  uint32_t u32() { uint32_t v = DecodeU32(p_ + pos_); pos_ += 4; return v; }
  uint64_t u64() { uint64_t v = DecodeU64(p_ + pos_); pos_ += 8; return v; }
  void bytes(void* d, size_t n) { std::memcpy(d, p_ + pos_, n); pos_ += n; }
  void skip(size_t n) { pos_ += n; }
  size_t pos() const { return pos_; }
  size_t remaining() const { return len_ - pos_; }

 private:
  const uint8_t* p_;
  size_t len_;
  size_t pos_ = 0;
};

}  // namespace dede
