// Writing safetensors files atomically (fd/publish/safetensors_write.h).
#include "fd/file_io.h"
#include "fd/publish/safetensors_write.h"

#include "fd/status.h"

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstring>

namespace fd::publish {

using namespace fd::model;

int64_t write_safetensors(const std::filesystem::path & path, const std::vector<SafetensorsEntry> & entries,
                          const std::function<void(size_t, std::byte *)> & fill, int mode) {
    nlohmann::ordered_json h = nlohmann::ordered_json::object();
    std::vector<int64_t> sizes;
    int64_t offset = 0;
    for (const auto & e : entries) {
        int64_t n = dtype_size(e.dtype);
        for (int64_t d : e.shape) { n *= d; }
        h[e.name] = {{"dtype", dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {offset, offset + n}}};
        sizes.push_back(n);
        offset += n;
    }
    std::string header = h.dump();
    header.append((8 - (8 + header.size()) % 8) % 8, ' ');  // data starts 8-byte aligned
    const std::filesystem::path tmp = path.string() + ".tmp";
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    if (fd < 0) { fail(Errc::invalid_argument, "{}: cannot create: {}", tmp.string(), std::strerror(errno)); }
    try {
        const uint64_t n_header = header.size();
        write_all(fd, &n_header, 8, tmp, Errc::invalid_argument);
        write_all(fd, header.data(), static_cast<int64_t>(header.size()), tmp, Errc::invalid_argument);
        std::vector<std::byte> buf;
        for (size_t i = 0; i < entries.size(); ++i) {
            buf.assign(static_cast<size_t>(sizes[i]), std::byte{0});
            fill(i, buf.data());
            write_all(fd, buf.data(), static_cast<int64_t>(buf.size()), tmp, Errc::invalid_argument);
        }
        if (::fsync(fd) != 0) { fail(Errc::invalid_argument, "{}: fsync failed: {}", tmp.string(), std::strerror(errno)); }
        ::close(fd);
    } catch (...) {
        ::close(fd);
        ::unlink(tmp.c_str());
        throw;
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
        const int err = errno;
        ::unlink(tmp.c_str());
        fail(Errc::invalid_argument, "cannot rename {} to {}: {}", tmp.string(), path.string(), std::strerror(err));
    }
    return offset;
}

}  // namespace fd::publish
