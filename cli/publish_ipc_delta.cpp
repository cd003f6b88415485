// fdctl publish --strategy ipc_delta: the trainer side of an ipc delta (docs/weight_streams.md,
// "Over ipc publishes") from two Hugging Face checkpoints: every element of --from whose bytes
// differ from --base-from's goes into the port's delta record, /dev/shm/fdrollout.<port>.
// weights.delta (mode 0600, fd/shm/ipc_weights.h IpcDeltaHeader + a weights.fddelta payload),
// written under its seqlock; fdrollout.publish.publish_ipc_delta writes the same record from
// arrays. Then `fdctl update-weights --version V` applies it in place on a rollout serving
// --base-version. HF names (no per-rank split: the rollout splits by its own layout).
#include "offline.h"

#include "fd/checkpoint/safetensors.h"
#include "fd/shm/ipc_weights.h"
#include "fd/shm/names.h"
#include "fd/status.h"
#include "fd/trust.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <climits>
#include <cstring>
#include <iostream>
#include <vector>

namespace fdctl {
namespace {

using nlohmann::json;

/// The raw bytes of tensor `t`.
std::vector<std::byte> read_tensor(const fd::model::TensorInfo & t) {
    std::vector<std::byte> out(static_cast<size_t>(t.size_bytes));
    const int fd = ::open(t.file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) { fd::fail(fd::Errc::invalid_argument, "cannot open {}: {}", t.file.string(), std::strerror(errno)); }
    try {
        fd::model::pread_exact(fd, out.data(), t.size_bytes, t.offset_bytes, t.file, "tensor " + t.name);
    } catch (...) {
        ::close(fd);
        throw;
    }
    ::close(fd);
    return out;
}

template <class T>
void append(std::string & out, const T * p, size_t n) {
    out.append(reinterpret_cast<const char *>(p), n * sizeof(T));
}

/// Write `payload` into the port's delta record under its seqlock (as publish_ipc_delta does).
uint64_t write_record(int port, const std::string & version, const std::string & base, const std::string & payload) {
    const std::string path = "/dev/shm" + fd::shm::ipc_delta_name(port);
    const uint64_t total = (fd::shm::kIpcDeltaPayload + payload.size() + 4095) / 4096 * 4096;
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) { fd::fail(fd::Errc::invalid_argument, "cannot open {}: {}", path, std::strerror(errno)); }
    try {
        fd::check_trusted(fd, path, fd::Trust::secret);  // not another local user's object (see publish_ipc)
        // One publisher at a time (as publish_ipc): held until the record is complete.
        if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
            fd::fail(fd::Errc::wrong_state, "another publisher is writing {} (one publisher per port at a time); nothing was written: "
                                            "retry when it is done", path);
        }
    } catch (...) {
        ::close(fd);
        throw;
    }
    struct stat st{};
    uint64_t gen = 0;
    if (::fstat(fd, &st) == 0 && st.st_size >= static_cast<off_t>(sizeof(fd::shm::IpcDeltaHeader))) {
        uint64_t head[3] = {};
        if (::pread(fd, head, sizeof(head), 0) == static_cast<ssize_t>(sizeof(head)) && head[0] == fd::shm::kIpcDeltaMagic) {
            gen = head[2] + head[2] % 2;  // a publisher died mid-write: continue from the next even
        }
    }
    // Grow only, as the weight records: a reader of the previous generation never reads past the end.
    if (st.st_size < static_cast<off_t>(total) && ::ftruncate(fd, static_cast<off_t>(total)) != 0) {
        ::close(fd);
        fd::fail(fd::Errc::invalid_argument, "cannot size {} to {} bytes: {}", path, total, std::strerror(errno));
    }
    void * map = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        ::close(fd);
        fd::fail(fd::Errc::invalid_argument, "cannot map {}: {}", path, std::strerror(errno));
    }
    auto * h = static_cast<fd::shm::IpcDeltaHeader *>(map);
    h->generation.store(gen + 1, std::memory_order_release);  // odd: being written
    h->magic         = fd::shm::kIpcDeltaMagic;
    h->abi_version   = fd::shm::kIpcDeltaAbiVersion;
    h->reserved0     = 0;
    h->payload_bytes = payload.size();
    h->total_bytes   = total;
    std::memset(h->version, 0, sizeof(h->version));
    std::memset(h->base_version, 0, sizeof(h->base_version));
    std::memcpy(h->version, version.data(), version.size());
    std::memcpy(h->base_version, base.data(), base.size());
    std::memcpy(static_cast<char *>(map) + fd::shm::kIpcDeltaPayload, payload.data(), payload.size());
    h->generation.store(gen + 2, std::memory_order_release);  // even: complete
    ::munmap(map, total);
    ::close(fd);  // the lock goes with it
    return gen + 2;
}

}  // namespace

int publish_ipc_delta(const PublishOptions & o) {
    for (const auto & [what, v] : {std::pair{"--version", o.version}, std::pair{"--base-version", o.base_version}}) {
        if (!fd::shm::is_valid_version(v)) {
            fd::fail(fd::Errc::invalid_argument, "publish --strategy ipc_delta needs {} matching [A-Za-z0-9._-]{{1,128}} (got '{}')",
                     what, v);
        }
    }
    if (o.version == o.base_version) { fd::fail(fd::Errc::invalid_argument, "--version '{}' cannot be a delta on itself", o.version); }
    if (o.base_from.empty()) {
        fd::fail(fd::Errc::invalid_argument, "publish --strategy ipc_delta needs --base-from: the checkpoint of --base-version");
    }
    const fd::model::TensorIndex now = fd::model::read_tensor_index(o.from), base = fd::model::read_tensor_index(o.base_from);
    json tensors = json::array();
    std::string body;
    int64_t n_changed = 0, n_total = 0;
    for (const auto & [name, t] : now.tensors) {
        const auto it = base.tensors.find(name);
        if (it == base.tensors.end() || it->second.dtype != t.dtype || it->second.shape != t.shape) {
            fd::fail(fd::Errc::invalid_argument, "tensor '{}' of {} is not in {} with the same dtype and shape; publish in full "
                                                 "(--strategy ipc)", name, o.from, o.base_from);
        }
        const std::vector<std::byte> a = read_tensor(it->second), b = read_tensor(t);
        const size_t es = static_cast<size_t>(fd::model::dtype_size(t.dtype)), numel = b.size() / es;
        std::vector<int64_t> idx;
        for (size_t i = 0; i < numel; ++i) {
            if (std::memcmp(a.data() + i * es, b.data() + i * es, es) != 0) { idx.push_back(static_cast<int64_t>(i)); }
        }
        n_total += static_cast<int64_t>(numel);
        if (idx.empty()) { continue; }
        n_changed += static_cast<int64_t>(idx.size());
        const bool narrow = numel <= static_cast<size_t>(INT32_MAX);
        const bool dense  = idx.size() * ((narrow ? 4 : 8) + es) >= b.size();  // sparse would be larger
        tensors.push_back({{"name", name}, {"dtype", fd::model::dtype_name(t.dtype)}, {"shape", t.shape}, {"dense", dense},
                           {"n", dense ? numel : idx.size()}, {"index_bytes", narrow ? 4 : 8}});
        if (dense) {
            append(body, b.data(), b.size());
            continue;
        }
        if (narrow) {
            std::vector<int32_t> i32(idx.begin(), idx.end());
            append(body, i32.data(), i32.size());
        } else {
            append(body, idx.data(), idx.size());
        }
        for (const int64_t i : idx) { append(body, b.data() + static_cast<size_t>(i) * es, es); }
    }
    const std::string header = json{{"tensors", tensors}}.dump();
    std::string payload = "FDDELTA1";
    const uint64_t len = header.size();
    append(payload, &len, 1);
    payload += header;
    payload += body;
    const uint64_t gen = write_record(o.port, o.version, o.base_version, payload);
    if (!o.quiet) {
        const json j = {{"strategy", "ipc_delta"}, {"version", o.version}, {"base_version", o.base_version}, {"port", o.port},
                        {"tensors", tensors.size()}, {"changed", n_changed}, {"elements", n_total}, {"bytes", payload.size()},
                        {"generation", gen}};
        std::cout << (o.json ? j.dump()
                             : fmt::format("published {} as ipc delta {} on {} for port {}: {} of {} elements changed in {} tensors, "
                                           "{} bytes in /dev/shm{}", o.from, o.version, o.base_version, o.port, n_changed, n_total,
                                           tensors.size(), payload.size(), fd::shm::ipc_delta_name(o.port)))
                  << "\n";
    }
    return 0;
}

}  // namespace fdctl
