#include "volume/block_device.h"

#include <string>

namespace dede {

Status BlockDevice::CheckRange(uint64_t offset, size_t len) const {
  if (offset % kSectorSize != 0 || len % kSectorSize != 0) {
    return Status::Invalid(name() + ": unaligned I/O at offset " + std::to_string(offset) +
                           " length " + std::to_string(len));
  }
  if (offset > size_bytes() || len > size_bytes() - offset) {
    return Status::Invalid(name() + ": I/O at offset " + std::to_string(offset) + " length " +
                           std::to_string(len) + " is past the end of the device (" +
                           std::to_string(size_bytes()) + " bytes)");
  }
  return Status::Ok();
}

Result<std::unique_ptr<BlockDevice>> OpenBlockDevice(const std::string& spec,
                                                     const DeviceOptions& opts) {
  if (spec.rfind("iscsi://", 0) == 0) return OpenIscsiDevice(spec, opts);
  if (spec.find("://") != std::string::npos) {
    return Status::Invalid("unsupported volume URL '" + spec +
                           "' (expected a path or iscsi://host[:port]/target-iqn/lun)");
  }
  return OpenPathDevice(spec, opts);
}

}  // namespace dede
