// The ipc delta record and the weights records' identities (fd/weights/ipc_delta.h).
#include "fd/weights/ipc_delta.h"

#include "fd/checkpoint/safetensors.h"
#include "fd/shm/ipc_weights.h"
#include "fd/shm/names.h"
#include "fd/status.h"
#include "fd/trust.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace fd::weights {

namespace {

/// An fd closed on scope exit.
struct Fd {
    int fd = -1;
    ~Fd() {
        if (fd >= 0) { ::close(fd); }
    }
};

/// The seqlock word at offset 16 of both record kinds, read with acquire ordering.
uint64_t generation_of(const void * header) {
    return static_cast<const std::atomic<uint64_t> *>(static_cast<const void *>(static_cast<const char *>(header) + 16))
        ->load(std::memory_order_acquire);
}

/// A read-only mapping of the first `n` bytes of `fd`, unmapped on scope exit.
struct Map {
    void * p = MAP_FAILED;
    size_t n = 0;
    Map(int fd, size_t bytes) : p(::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0)), n(bytes) {}
    ~Map() {
        if (p != MAP_FAILED) { ::munmap(p, n); }
    }
};

std::string c_string(const char * p, size_t cap) {
    const void * nul = std::memchr(p, '\0', cap);
    return nul ? std::string(p, static_cast<const char *>(nul)) : std::string();
}

}  // namespace

std::optional<std::vector<IpcRecordId>> ipc_record_ids(int port, int tp) {
    std::vector<IpcRecordId> out;
    for (int r = 0; r < tp; ++r) {
        const std::string path = "/dev/shm" + shm::ipc_weights_name(port, r);
        Fd f{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC)};
        struct stat st{};
        if (f.fd < 0 || ::fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < static_cast<off_t>(sizeof(shm::IpcRecordHeader))) {
            return std::nullopt;
        }
        const Map m(f.fd, sizeof(shm::IpcRecordHeader));
        if (m.p == MAP_FAILED) { return std::nullopt; }
        const uint64_t g = generation_of(m.p);
        if (g == 0 || g % 2 == 1) { return std::nullopt; }
        out.push_back({static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), g});
    }
    return out;
}

std::optional<IpcDelta> fetch_ipc_delta(int port, const std::string & version, const std::filesystem::path & dir) {
    const std::string path = "/dev/shm" + shm::ipc_delta_name(port);
    Fd f{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC)};
    if (f.fd < 0) {
        if (errno == ENOENT) { return std::nullopt; }
        if (errno == ELOOP) { fail(Errc::forbidden, "the ipc delta record {} is a symbolic link, which is never followed: remove it", path); }
        fail(Errc::source_unavailable, "cannot open the ipc delta record {}: {}; retry", path, std::strerror(errno));
    }
    struct stat st{};
    if (::fstat(f.fd, &st) != 0) { fail(Errc::source_unavailable, "cannot stat {}: {}", path, std::strerror(errno)); }
    if (!S_ISREG(st.st_mode)) {
        fail(Errc::invalid_checkpoint, "ipc delta record {} is not a shared-memory object (mode {:o}); remove it", path, st.st_mode);
    }
    // It decides what this daemon serves: only one of its own user's, mode 0600, is trusted.
    check_trusted(f.fd, path, Trust::secret);
    if (st.st_size < shm::kIpcDeltaPayload) {
        fail(Errc::source_unavailable, "ipc delta record {} is {} bytes: a delta publish is in progress; retry", path, st.st_size);
    }
    const Map m(f.fd, sizeof(shm::IpcDeltaHeader));
    if (m.p == MAP_FAILED) { fail(Errc::source_unavailable, "cannot map {}: {}", path, std::strerror(errno)); }
    const uint64_t g1 = generation_of(m.p);
    if (g1 == 0 || g1 % 2 == 1) {
        fail(Errc::source_unavailable, "{}: {} (generation {}); retry once the trainer's delta publish finished", path,
             g1 == 0 ? "nothing was published yet" : "a delta publish is in progress", g1);
    }
    shm::IpcDeltaHeader h;  // a copy: checked below against the generation read again
    std::memcpy(static_cast<void *>(&h), m.p, sizeof(h));
    auto torn = [&] {
        struct stat now{};
        return generation_of(m.p) != g1 || ::stat(path.c_str(), &now) != 0 || now.st_dev != st.st_dev || now.st_ino != st.st_ino;
    };
    if (torn()) { fail(Errc::source_unavailable, "{}: the publisher rewrote the delta record while it was read; retry", path); }
    if (h.magic != shm::kIpcDeltaMagic) {
        fail(Errc::invalid_checkpoint, "{}: not an fdrollout ipc delta record (bad magic {:#x})", path, h.magic);
    }
    if (h.abi_version != shm::kIpcDeltaAbiVersion) {
        fail(Errc::invalid_checkpoint, "{}: delta record ABI version {}, this fdrollout reads {}; upgrade the publisher", path,
             h.abi_version, shm::kIpcDeltaAbiVersion);
    }
    const std::string v    = c_string(h.version, sizeof(h.version));
    const std::string base = c_string(h.base_version, sizeof(h.base_version));
    if (!shm::is_valid_version(v)) {
        fail(Errc::invalid_checkpoint, "{}: the delta record's version is not [A-Za-z0-9._-]{{1,128}} (NUL-terminated)", path);
    }
    if (v != version) { return std::nullopt; }  // another version's delta: this update is a full one
    if (!shm::is_valid_version(base)) {
        fail(Errc::invalid_checkpoint, "{}: the delta record's base_version is not [A-Za-z0-9._-]{{1,128}} (NUL-terminated)", path);
    }
    if (h.total_bytes > static_cast<uint64_t>(st.st_size) || h.payload_bytes > h.total_bytes - shm::kIpcDeltaPayload) {
        fail(Errc::invalid_checkpoint, "{}: payload_bytes {} does not fit: total_bytes {}, the object has {} bytes", path,
             h.payload_bytes, h.total_bytes, st.st_size);
    }
    IpcDelta out{.version = v, .base_version = base, .delta_file = dir / "weights.fddelta",
                 .bytes = static_cast<int64_t>(h.payload_bytes),
                 .record = {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), g1}};
    std::vector<std::byte> buf(static_cast<size_t>(h.payload_bytes));
    model::pread_exact(f.fd, buf.data(), out.bytes, shm::kIpcDeltaPayload, path, "delta payload");
    Fd w{::open(out.delta_file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600)};
    if (w.fd < 0) { fail(Errc::source_unavailable, "cannot create {}: {}", out.delta_file.string(), std::strerror(errno)); }
    const std::byte * p = buf.data();
    size_t left = buf.size();
    while (left > 0) {
        const ssize_t n = ::write(w.fd, p, left);
        if (n < 0 && errno == EINTR) { continue; }
        if (n <= 0) { fail(Errc::source_unavailable, "writing {} failed: {}", out.delta_file.string(), std::strerror(errno)); }
        p += n;
        left -= static_cast<size_t>(n);
    }
    // TEST ONLY: FD_TEST_IPC_DELTA_COPY_DELAY_MS=N waits N ms between the copy and the check below
    // (a test rewrites the record meanwhile, once it sees the copy in the private dir).
    if (const char * ms = std::getenv("FD_TEST_IPC_DELTA_COPY_DELAY_MS")) {
        std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(ms)));
    }
    if (torn()) { fail(Errc::source_unavailable, "{}: the publisher rewrote the delta record during the copy; retry", path); }
    return out;
}

}  // namespace fd::weights
