#include "volume/lock_watch.h"

#include <algorithm>
#include <thread>

namespace dede {

Status WatchAndTake(LockManager* lm, LockId id, LockMode mode, LockWatch* w) {
  int poll_ms = 2;
  while (true) {
    if (LockWatch::Clock::now() >= w->first_try) {
      w->tries++;
      Status st = lm->Acquire(id, mode, false);
      if (st.code() != Status::Code::kLocked) return st;
    }
    if (LockWatch::Clock::now() >= w->deadline) {
      return Status::Locked(id.ToString() + " is held by another process or host");
    }
    do {
      if (w->between) RETURN_IF_ERROR(w->between());
      std::this_thread::sleep_for(std::chrono::milliseconds(poll_ms));
      poll_ms = std::min<int>(poll_ms * 2, static_cast<int>(w->max_poll.count()));
      // A look that fails is answered by a try, which reports the error if
      // it is real.
      Result<bool> held = lm->IsHeldElsewhere(id);
      if (held.ok() && !*held) w->seen_free++;
      if (!held.ok() || !*held) break;
    } while (LockWatch::Clock::now() < w->deadline);
  }
}

}  // namespace dede
