// placeholder, being written
#include "volume/block_device.h"
namespace dede {
Result<std::unique_ptr<BlockDevice>> OpenIscsiDevice(const std::string& url, const DeviceOptions&) {
  return Status::Unsupported("iSCSI backend not built yet: " + url);
}
}  // namespace dede
