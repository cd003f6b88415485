// fd/trust.h — may the daemon trust a file another process could have planted?
//
// Files and shared-memory objects whose contents the daemon acts on (an `ipc` weight record in
// /dev/shm, the control block it reclaims, ipc_snapshot files and their directory, the rsync
// staging dir) must belong to the daemon's effective user and must not be writable by group or
// others; secrets (the control block, ipc records: documented 0600) must not be readable by them
// either. Otherwise another local user could inject weights or commands (SPEC §8.6).
// The check runs on an already opened descriptor (fstat), so what was checked is what is read:
// no window between a check by path and the open.
#pragma once

#include "fd/status.h"

#include <sys/stat.h>

#include <string>

namespace fd {

enum class Trust {
    owned,   ///< owned by geteuid(), no group/other write bit
    secret,  ///< owned by geteuid(), no group/other bit at all (mode 0600 / 0700)
};

/// Whether the object `st` describes (from fstat/lstat) passes `trust` for this process: owned
/// by geteuid() and without the group/other bits `trust` forbids. No errors.
bool is_trusted(const struct stat & st, Trust trust);

/// Check the object open on `fd` (file, directory or shm object; `path` only names it in the
/// message). Errors  fd::Error{forbidden} naming `path`, its owner uid and mode, and what to do;
///         fd::Error{internal} if fstat fails (a valid fd cannot make it fail).
void check_trusted(int fd, const std::string & path, Trust trust);

/// The same check on the object `path` names (symlinks followed: the directory or file reached
/// is checked), opened with O_PATH. Errors  as check_trusted; fd::Error{not_found} when absent.
void check_trusted_path(const std::string & path, Trust trust);

}  // namespace fd
