#include "fd/file_io.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace fd {

void UniqueFd::reset(int fd) {
    if (fd_ >= 0) { ::close(fd_); }
    fd_ = fd;
}

UniqueFd open_read(const std::filesystem::path & path, Errc on_error) {
    UniqueFd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!f.valid()) { fail(on_error, "{}: cannot open: {}", path.string(), std::strerror(errno)); }
    return f;
}

namespace {

/// fstat the open `f` and require a regular file. Errors  fd::Error{on_error} naming the kind.
void require_regular(const UniqueFd & f, const std::filesystem::path & path, Errc on_error, struct stat & st) {
    if (::fstat(f.get(), &st) != 0) { fail(on_error, "{}: cannot stat: {}", path.string(), std::strerror(errno)); }
    if (S_ISREG(st.st_mode)) { return; }
    const char * kind = S_ISFIFO(st.st_mode) ? "FIFO" : S_ISCHR(st.st_mode) ? "character device"
                      : S_ISBLK(st.st_mode) ? "block device" : S_ISSOCK(st.st_mode) ? "socket"
                      : S_ISDIR(st.st_mode) ? "directory" : "special file";
    fail(on_error, "{}: is a {}, not a regular file (after following symlinks); refusing to read it", path.string(), kind);
}

}  // namespace

UniqueFd open_regular(const std::filesystem::path & path, Errc on_error, struct stat * st_out) {
    UniqueFd f(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
    if (!f.valid()) { fail(on_error, "{}: cannot open: {}", path.string(), std::strerror(errno)); }
    struct stat st{};
    require_regular(f, path, on_error, st);
    if (st_out) { *st_out = st; }
    return f;
}

std::optional<std::string> read_small_file(const std::filesystem::path & path, int64_t max_bytes, Errc on_error) {
    UniqueFd f(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
    if (!f.valid()) {
        if (errno == ENOENT) { return std::nullopt; }
        fail(on_error, "{}: cannot open: {}", path.string(), std::strerror(errno));
    }
    struct stat st{};
    require_regular(f, path, on_error, st);
    if (st.st_size > max_bytes) {
        fail(on_error, "{}: is {} bytes, more than the {} expected of it", path.string(), static_cast<int64_t>(st.st_size), max_bytes);
    }
    std::string out(static_cast<size_t>(st.st_size), '\0');
    size_t got = 0;
    while (got < out.size()) {
        const ssize_t r = ::read(f.get(), out.data() + got, out.size() - got);
        if (r < 0 && errno == EINTR) { continue; }
        if (r < 0) { fail(on_error, "{}: read failed: {}", path.string(), std::strerror(errno)); }
        if (r == 0) { break; }
        got += static_cast<size_t>(r);
    }
    out.resize(got);
    return out;
}

void write_all(int fd, const void * p, int64_t n, const std::filesystem::path & file, Errc on_error) {
    const auto * c = static_cast<const char *>(p);
    while (n > 0) {
        const ssize_t w = ::write(fd, c, static_cast<size_t>(n));
        if (w < 0 && errno == EINTR) { continue; }
        if (w <= 0) { fail(on_error, "{}: write failed: {}", file.string(), std::strerror(errno)); }
        c += w;
        n -= w;
    }
}

void write_file_synced(const std::filesystem::path & file, std::string_view text, Errc on_error) {
    UniqueFd out(::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!out.valid()) { fail(on_error, "{}: cannot create: {}", file.string(), std::strerror(errno)); }
    write_all(out.get(), text.data(), static_cast<int64_t>(text.size()), file, on_error);
    if (::fsync(out.get()) != 0) { fail(on_error, "{}: fsync failed: {}", file.string(), std::strerror(errno)); }
}

bool peer_hung_up(int fd) {
    if (fd < 0) { return true; }
    pollfd p{fd, POLLRDHUP, 0};  // POLLRDHUP: a stream peer's FIN while our end is still open
    if (::poll(&p, 1, 0) <= 0) { return false; }
    return (p.revents & (POLLHUP | POLLERR | POLLRDHUP)) != 0;
}

}  // namespace fd
