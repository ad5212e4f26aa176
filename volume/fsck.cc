#include "volume/fsck.h"

#include "volume/volume_impl.h"

namespace dede {
Result<FsckReport> CheckVolume(Volume*, bool) { return Status::Unsupported("fsck: not yet"); }
}  // namespace dede
