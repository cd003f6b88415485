// daemon/src/weights/delta_framing.h — the framing the weight-delta files share (internal to
// daemon/src/weights): 8 magic bytes, a u64 LE header length, a JSON header, then the payload.
// weights.fddelta (weight_delta.cpp, "FDDELTA1") and a rank's share (rank_delta.cpp, "FDRDLT01").
#pragma once

#include "fd/checkpoint/safetensors.h"
#include "fd/file_io.h"
#include "fd/status.h"

#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

namespace fd::weights::detail {

/// Write n bytes at p to fd (retrying short writes and EINTR).
/// Errors  fd::Error{invalid_argument} "<file>: writing <what> failed: <errno text>".
inline void write_all(int fd, const void * p, size_t n, const std::filesystem::path & file, const char * what) {
    const auto * b = static_cast<const std::byte *>(p);
    while (n > 0) {
        const ssize_t w = ::write(fd, b, n);
        if (w < 0 && errno == EINTR) { continue; }
        if (w <= 0) { fail(Errc::invalid_argument, "{}: writing {} failed: {}", file.string(), what, std::strerror(errno)); }
        b += w;
        n -= static_cast<size_t>(w);
    }
}

/// Create `file` (mode 0600, truncated) and write the magic, the header's length and the header;
/// the payload follows through write_all. Errors  fd::Error{invalid_argument} naming the file.
inline UniqueFd create_framed(const std::filesystem::path & file, const char (&magic)[8], const std::string & header, const char * what) {
    UniqueFd fd(::open(file.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));  // read too: write_rank_share maps it
    if (!fd.valid()) { fail(Errc::invalid_argument, "{}: cannot create {} file: {}", file.string(), what, std::strerror(errno)); }
    const uint64_t len = header.size();
    write_all(fd.get(), magic, sizeof magic, file, what);
    write_all(fd.get(), &len, sizeof len, file, what);
    write_all(fd.get(), header.data(), header.size(), file, what);
    return fd;
}

/// A framed file opened for reading: its fd (a regular file), its size in bytes, its parsed
/// header (a discarded JSON value when it does not parse) and the payload's offset.
struct Framed {
    UniqueFd       fd;
    int64_t        size = 0;
    nlohmann::json header;
    int64_t        payload_off = 0;
};

/// Open `file` and read its framing. Errors  fd::Error{invalid_checkpoint} "<file>: not <what>
/// file" when it is too short, the magic differs or the header length passes the end.
inline Framed open_framed(const std::filesystem::path & file, const char (&magic)[8], const char * what) {
    struct stat st{};
    Framed f{.fd = open_regular(file, Errc::invalid_checkpoint, &st)};
    f.size = st.st_size;
    char got[8] = {};
    uint64_t len = 0;
    if (f.size < 16) { fail(Errc::invalid_checkpoint, "{}: not {} file (too short)", file.string(), what); }
    model::pread_exact(f.fd.get(), got, 8, 0, file, "magic");
    model::pread_exact(f.fd.get(), &len, 8, 8, file, "header length");
    if (std::memcmp(got, magic, 8) != 0 || len > static_cast<uint64_t>(f.size - 16)) {
        fail(Errc::invalid_checkpoint, "{}: not {} file", file.string(), what);
    }
    std::string header(len, '\0');
    model::pread_exact(f.fd.get(), header.data(), static_cast<int64_t>(len), 16, file, "header");
    f.header      = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
    f.payload_off = 16 + static_cast<int64_t>(len);
    return f;
}

}  // namespace fd::weights::detail
