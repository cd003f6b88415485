// fd/process.h — another process's liveness and state, read from /proc/PID/stat (proc(5)): the
// control block's daemon pid (fdctl, a restarted daemon), a weight stream's staging-dir owner,
// a rank process that stopped answering.
#pragma once

#include <cstdint>

namespace fd {

/// Process `pid`'s state letter (/proc/PID/stat field 3: 'R', 'S', 'T' stopped, 'Z' zombie, ...),
/// or 0 when it has none (no such process, /proc unreadable).
char process_state(int64_t pid);

/// Process `pid`'s start time in clock ticks since boot (/proc/PID/stat field 22), or -1 when it
/// has none.
int64_t process_start_ticks(int64_t pid);

/// True if process `pid` runs: it exists (kill(pid, 0) succeeds or fails with EPERM) and is not a
/// zombie (killed, not yet reaped by its parent: a trainer that Popen'd the daemon and never
/// waited); with `start_ticks` > 0, it is also the process that started then, not a later one
/// that reused the pid. Without /proc, existence alone.
bool pid_alive(int64_t pid, int64_t start_ticks = 0);

}  // namespace fd
