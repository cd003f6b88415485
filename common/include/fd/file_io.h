// fd/file_io.h — the few POSIX file operations the checkpoint, store and publish code share:
// an owned descriptor, opening for reading, writing everything, writing a small file durably.
// Each error is an fd::Error with the caller's code (what the failure means depends on who
// reads or writes: a bad checkpoint, an unavailable source, a bad argument) and names the file.
#pragma once

#include "fd/status.h"

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

struct stat;

namespace fd {

/// An owned file descriptor (-1 = none), closed on destruction. Move-only.
class UniqueFd {
public:
    UniqueFd() = default;
    explicit UniqueFd(int fd) : fd_(fd) {}
    ~UniqueFd() { reset(); }
    UniqueFd(UniqueFd && o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
    UniqueFd & operator=(UniqueFd && o) noexcept {
        if (this != &o) { reset(std::exchange(o.fd_, -1)); }
        return *this;
    }
    UniqueFd(const UniqueFd &) = delete;
    UniqueFd & operator=(const UniqueFd &) = delete;

    int  get() const { return fd_; }
    bool valid() const { return fd_ >= 0; }
    void reset(int fd = -1);

private:
    int fd_ = -1;
};

/// Open `path` read-only (O_CLOEXEC).   Errors  fd::Error{on_error}: "<path>: cannot open: <why>".
UniqueFd open_read(const std::filesystem::path & path, Errc on_error);

/// Open `path` for reading without ever blocking, and require a regular file: O_RDONLY |
/// O_NONBLOCK | O_CLOEXEC (symlinks are followed, so Hugging Face cache snapshots, which link
/// into blobs/, work), then fstat the descriptor. A FIFO, socket or device (/dev/zero) would block
/// or never end; it is refused before anything is read. `st_out` (optional) receives the fstat.
/// Errors  fd::Error{on_error}: "<path>: cannot open: <why>" or "<path>: is a <kind>, not a
///         regular file".
UniqueFd open_regular(const std::filesystem::path & path, Errc on_error, struct stat * st_out = nullptr);

/// The whole content of the small regular file `path` (opened with open_regular), or nullopt
/// when it does not exist. Errors  fd::Error{on_error} when it is not a regular file, larger
///         than `max_bytes`, or unreadable.
std::optional<std::string> read_small_file(const std::filesystem::path & path, int64_t max_bytes, Errc on_error);

/// Write all `n` bytes of `p` to `fd` (retries short writes and EINTR).
/// Errors  fd::Error{on_error} naming `file`.
void write_all(int fd, const void * p, int64_t n, const std::filesystem::path & file, Errc on_error);

/// Create or truncate `file` (mode 0644), write `text`, fsync.   Errors  fd::Error{on_error}.
void write_file_synced(const std::filesystem::path & file, std::string_view text, Errc on_error);

/// True when the peer of the connected socket `fd` has closed its end (a stream's FIN, a
/// seqpacket's close) or the socket failed; never blocks, never reads. Bytes or records waiting to
/// be read do not count (they may be a late answer), so this is a liveness test, not a "nothing
/// was sent" test. A negative `fd` counts as hung up.
bool peer_hung_up(int fd);

}  // namespace fd
