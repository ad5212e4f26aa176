// Readiness and stopping notifications to systemd (sd_notify(3) protocol:
// one datagram to the AF_UNIX socket named by $NOTIFY_SOCKET), without
// libsystemd. A no-op when dedupd does not run under systemd.
#pragma once

#include <string>

namespace dede {

// Sends `state` (e.g. "READY=1\nSTATUS=serving 4 exports"); false if
// $NOTIFY_SOCKET is unset or the send failed (never fatal).
bool SdNotify(const std::string& state);

}  // namespace dede
