#include "fd/file_io.h"

#include <fcntl.h>
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

}  // namespace fd
