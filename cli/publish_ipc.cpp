// fdctl publish --strategy ipc_snapshot | ipc: the trainer side of the two same-host strategies
// (docs/weight_sources.md). Both convert a Hugging Face checkpoint (--from) into the rollout's
// state dict per tensor-parallel rank with RolloutModel (q|k|v and gate|up fused by stacking
// rows, Megatron sharding, dtypes kept; F16 becomes F32 like the rollout holds it). --ep (a rollout
// started with --enable-expert-parallel): each rank's record holds only its experts, whole.
//
// ipc_snapshot: MODEL_DIR/model_state.tp{r}.safetensors for every rank, each written as .tmp and
//   renamed; then stale model_state.tp{r}.part*.safetensors (which would shadow the new file) are
//   removed; MODEL_DIR/version.yaml is removed first and, with --version, written ("step: V") the
//   same way last, so it never names other files than the snapshot's.
// ipc: one POSIX shm object per rank, /dev/shm/fdrollout.<port>.weights.tp<r> (mode 0600), laid
//   out as in fd/shm/ipc_weights.h and written under its seqlock (generation odd while writing,
//   +2 when done); an existing object is reused and only ever grown (total_bytes says how much
//   of it this publish uses). fdctl exits and the object stays: shm persists until removed
//   (`rm /dev/shm/fdrollout.<port>.weights.tp*`) or the host reboots. One publisher at a time.
#include "offline.h"

#include "fd/publish/rollout_model.h"
#include "fd/publish/safetensors_write.h"
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

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

namespace fdctl {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

void check_common(const PublishOptions & o) {
    if (o.tp < 1) { fd::fail(fd::Errc::invalid_argument, "--tp must be >= 1, got {}", o.tp); }
    if (!o.version.empty() && !fd::shm::is_valid_version(o.version)) {
        fd::fail(fd::Errc::invalid_argument, "--version '{}' must match [A-Za-z0-9._-]{{1,128}} and not start with '.'", o.version);
    }
}

void print_summary(const PublishOptions & o, const json & j, const std::string & human) {
    if (o.quiet) { return; }
    std::cout << (o.json ? j.dump() : human) << "\n";
}

uint32_t ipc_dtype(fd::DType d) {
    switch (d) {
        case fd::DType::f32: return fd::shm::kIpcF32;
        case fd::DType::bf16: return fd::shm::kIpcBF16;
        case fd::DType::f16: return fd::shm::kIpcF16;
    }
    return fd::shm::kIpcF32;
}

/// A writable shm object, mapped whole.
struct ShmMap {
    int         fd = -1;
    std::byte * base = nullptr;
    size_t      len = 0;
    ~ShmMap() {
        if (base) { ::munmap(base, len); }
        if (fd >= 0) { ::close(fd); }
    }
};

/// Write rank `rank`'s state dict into its shm record; returns {path, tensors, data bytes, generation}.
json publish_rank(const PublishOptions & o, const fd::publish::RolloutModel & m, const fd::model::TensorIndex & idx, int rank) {
    using fd::shm::IpcRecordHeader;
    using fd::shm::IpcTensorEntry;
    const auto srcs = m.training_slices(rank);
    // Layout: header, entries, pad to 4096, then each tensor 64-byte aligned.
    uint64_t off = sizeof(IpcRecordHeader) + srcs.size() * sizeof(IpcTensorEntry);
    off = (off + fd::shm::kIpcDataAlign - 1) / fd::shm::kIpcDataAlign * fd::shm::kIpcDataAlign;
    std::vector<uint64_t> offsets;
    uint64_t data_bytes = 0;
    for (const auto & s : srcs) {
        offsets.push_back(off);
        off = (off + static_cast<uint64_t>(s.tensor.nbytes()) + 63) / 64 * 64;
        data_bytes += static_cast<uint64_t>(s.tensor.nbytes());
    }
    const uint64_t total = off;
    const std::string name = fd::shm::ipc_weights_name(o.port, rank);
    const std::string path = "/dev/shm" + name;
    ShmMap sm;
    sm.fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);  // glibc adds O_NOFOLLOW
    if (sm.fd < 0 && errno == ELOOP) { fd::fail(fd::Errc::forbidden, "{} is a symbolic link, which is never followed: remove it", path); }
    if (sm.fd < 0) { fd::fail(fd::Errc::invalid_argument, "cannot create {}: {}", path, std::strerror(errno)); }
    // Only a record of this user that nobody else can open: an object another local user made
    // first (and holds open) would otherwise get the weights (a probe). forbidden, naming owner and mode.
    fd::check_trusted(sm.fd, path, fd::Trust::secret);
    // One publisher per record at a time (fdrollout.publish takes the same lock): two at once both
    // took an odd generation for a crashed writer's, interleaved their bytes and published the same
    // even generation, which the daemon served under one label (a probe). Held until sm.fd closes.
    if (::flock(sm.fd, LOCK_EX | LOCK_NB) != 0) {
        fd::fail(fd::Errc::wrong_state, "another publisher is writing {} (one publisher per port at a time); nothing was written: "
                                        "retry when it is done", path);
    }
    struct stat st{};
    if (::fstat(sm.fd, &st) != 0) { fd::fail(fd::Errc::invalid_argument, "cannot stat {}: {}", path, std::strerror(errno)); }
    // An existing record: mark it "being written" before it is resized, so no reader takes it.
    uint64_t g = 0;
    if (static_cast<uint64_t>(st.st_size) >= sizeof(IpcRecordHeader)) {
        void * p = ::mmap(nullptr, sizeof(IpcRecordHeader), PROT_READ | PROT_WRITE, MAP_SHARED, sm.fd, 0);
        if (p == MAP_FAILED) { fd::fail(fd::Errc::invalid_argument, "cannot map {}: {}", path, std::strerror(errno)); }
        auto * h = static_cast<IpcRecordHeader *>(p);
        if (h->magic == fd::shm::kIpcMagic) {
            g = h->generation.load(std::memory_order_acquire);
            g = g % 2 == 0 ? g + 1 : g;  // odd; a crashed writer may have left it odd already
            h->generation.store(g, std::memory_order_release);
        }
        ::munmap(p, sizeof(IpcRecordHeader));
    }
    // Grow only: a reader that took the previous generation keeps reading inside the object (its
    // copy is then dropped by the generation check, 503) instead of hitting a short read (422).
    if (static_cast<uint64_t>(st.st_size) < total && ::ftruncate(sm.fd, static_cast<off_t>(total)) != 0) {
        fd::fail(fd::Errc::invalid_argument, "cannot size {} to {} bytes: {}", path, total, std::strerror(errno));
    }
    void * p = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, sm.fd, 0);
    if (p == MAP_FAILED) { fd::fail(fd::Errc::invalid_argument, "cannot map {}: {}", path, std::strerror(errno)); }
    sm.base = static_cast<std::byte *>(p);
    sm.len  = total;
    auto * h = reinterpret_cast<IpcRecordHeader *>(sm.base);
    if (g == 0) {  // a new object (or not ours): initialise under generation 1
        std::memset(static_cast<void *>(h), 0, sizeof(IpcRecordHeader));
        h->magic = fd::shm::kIpcMagic;
        g = 1;
        h->generation.store(g, std::memory_order_release);
    }
    std::atomic_thread_fence(std::memory_order_release);
    h->abi_version = fd::shm::kIpcAbiVersion;
    h->n_tensors   = static_cast<uint32_t>(srcs.size());
    std::memset(h->version, 0, sizeof(h->version));
    std::memcpy(h->version, o.version.data(), o.version.size());
    h->rank        = rank;
    h->tp_size     = o.tp;
    h->total_bytes = total;
    h->data_bytes  = data_bytes;
    auto * entries = reinterpret_cast<IpcTensorEntry *>(sm.base + sizeof(IpcRecordHeader));
    for (size_t i = 0; i < srcs.size(); ++i) {
        const auto & t = srcs[i].tensor;
        IpcTensorEntry & e = entries[i];
        std::memset(&e, 0, sizeof(e));
        std::memcpy(e.name, t.name.data(), std::min(t.name.size(), sizeof(e.name) - 1));
        e.dtype    = ipc_dtype(t.dtype);
        e.location = fd::shm::kIpcInline;
        e.ndim     = static_cast<uint32_t>(t.shape.size());
        for (size_t d = 0; d < t.shape.size(); ++d) { e.shape[d] = t.shape[d]; }
        e.offset = offsets[i];
        e.nbytes = static_cast<uint64_t>(t.nbytes());
        fd::publish::RolloutModel::gather(srcs[i], idx, sm.base + offsets[i]);
    }
    h->generation.store(g + 1, std::memory_order_release);  // even: published
    return {{"rank", rank}, {"path", path}, {"tensors", srcs.size()}, {"bytes", data_bytes}, {"total_bytes", total},
            {"generation", g + 1}};
}

}  // namespace

int publish_ipc_snapshot(const PublishOptions & o) {
    check_common(o);
    if (o.model_dir.empty()) { fd::fail(fd::Errc::invalid_argument, "publish --strategy ipc_snapshot needs --model (the rollout's --model dir)"); }
    const fs::path dir = o.model_dir;
    if (!fs::is_directory(dir)) { fd::fail(fd::Errc::not_found, "--model {} is not a directory", dir.string()); }
    const fd::model::ModelConfig cfg = fd::model::load_model_config(o.from);
    fd::model::TensorIndex idx = fd::model::read_tensor_index(o.from);
    fd::model::alias_v5_mixtral_names(cfg, idx);  // gather reads the v4 names the state dict maps to
    const fd::publish::RolloutModel m(cfg, idx, o.tp, o.ep);
    // version.yaml names the snapshot files: the old one goes before the first new file (a reader
    // in between sees no version, never the old one on new bytes), the new one (--version) last.
    std::error_code rm_ec;
    fs::remove(dir / "version.yaml", rm_ec);
    if (rm_ec) { fd::fail(fd::Errc::invalid_argument, "cannot remove the old {}: {}", (dir / "version.yaml").string(), rm_ec.message()); }
    // A snapshot is never more readable than its source (as the rsync publisher's copies): the
    // permission bits every source file shares (a probe: a 0600 checkpoint's snapshot was 0644).
    int mode = 0666;
    for (const auto & [name, t] : idx.tensors) {
        struct stat fst{};
        if (::stat(t.file.c_str(), &fst) == 0) { mode &= static_cast<int>(fst.st_mode); }
    }
    // ... and never writable by another user, which the daemon refuses (403) to read: a group-
    // writable source (or umask 002) made a snapshot that published with exit 0 and never loaded.
    mode = (mode & 0644) | 0600;
    json ranks = json::array();
    int64_t total = 0;
    for (int r = 0; r < o.tp; ++r) {
        const auto srcs = m.training_slices(r);
        std::vector<fd::publish::SafetensorsEntry> entries;
        for (const auto & s : srcs) { entries.push_back({s.tensor.name, s.tensor.dtype, s.tensor.shape}); }
        const fs::path file = dir / fmt::format("model_state.tp{}.safetensors", r);
        const int64_t bytes = fd::publish::write_safetensors(file, entries, [&](size_t i, std::byte * dst) {
            fd::publish::RolloutModel::gather(srcs[i], idx, dst);
        }, mode);
        // Parts would shadow the single file: drop stale ones (readers see the old parts or the new file).
        const std::string part_prefix = fmt::format("model_state.tp{}.part", r);
        for (const auto & e : fs::directory_iterator(dir)) {
            const std::string n = e.path().filename().string();
            if (n.rfind(part_prefix, 0) == 0 && e.path().extension() == ".safetensors") { fs::remove(e.path()); }
        }
        total += bytes;
        ranks.push_back({{"rank", r}, {"path", file.string()}, {"tensors", srcs.size()}, {"bytes", bytes}});
    }
    if (!o.version.empty()) {
        const fs::path tmp = dir / fmt::format("version.yaml.tmp-{}", ::getpid());
        {
            std::ofstream out(tmp);
            out << "step: " << o.version << "\n";
            if (!out) { fd::fail(fd::Errc::invalid_argument, "cannot write {}", tmp.string()); }
        }
        fs::rename(tmp, dir / "version.yaml");
    }
    json j = {{"strategy", "ipc_snapshot"}, {"model", dir.string()}, {"tp", o.tp}, {"ep", m.ep_size()}, {"bytes", total}, {"ranks", ranks}};
    if (!o.version.empty()) { j["version"] = o.version; }
    print_summary(o, j, fmt::format("published {} as ipc_snapshot into {} ({} rank(s), {:.1f} MiB){}", o.from, dir.string(), o.tp,
                                    total / 1048576.0, o.version.empty() ? "" : "; version.yaml step " + o.version));
    return 0;
}

int publish_ipc(const PublishOptions & given) {
    // One record per rank of the rollout: its tp size is the running daemon's (on --port) unless
    // --tp says it; a --tp that disagrees with a running daemon publishes nothing.
    PublishOptions o = given;
    if (!o.tp_given && o.rollout_tp > 0) { o.tp = o.rollout_tp; }
    if (o.tp_given && o.rollout_tp > 0 && o.rollout_tp != o.tp) {
        fd::fail(fd::Errc::invalid_argument, "the rollout on port {} runs tp={}, --tp {} was given: pass --tp {} (or leave --tp out); "
                                             "nothing published", o.port, o.rollout_tp, o.tp, o.rollout_tp);
    }
    // The expert layout likewise: the running daemon's unless --ep says it; a record cut for the
    // other layout would be refused by every rank (the expert shapes differ).
    if (!o.ep_given && o.rollout_ep > 0) { o.ep = o.rollout_ep > 1; }
    if (o.ep_given && o.rollout_ep == 1 && o.rollout_tp > 1) {
        fd::fail(fd::Errc::invalid_argument, "the rollout on port {} runs without --enable-expert-parallel (each expert sliced over "
                                             "its tp={} ranks), --ep was given: leave --ep out; nothing published", o.port, o.rollout_tp);
    }
    check_common(o);
    if (o.version.empty()) { fd::fail(fd::Errc::invalid_argument, "publish --strategy ipc needs --version"); }
    const fd::model::ModelConfig cfg = fd::model::load_model_config(o.from);
    fd::model::TensorIndex idx = fd::model::read_tensor_index(o.from);
    fd::model::alias_v5_mixtral_names(cfg, idx);  // gather reads the v4 names the state dict maps to
    const fd::publish::RolloutModel m(cfg, idx, o.tp, o.ep);
    json ranks = json::array();
    uint64_t total = 0;
    for (int r = 0; r < o.tp; ++r) {
        ranks.push_back(publish_rank(o, m, idx, r));
        total += ranks.back()["bytes"].get<uint64_t>();
    }
    // A full publish supersedes the port's ipc delta record (as fdrollout.publish.publish_ipc).
    ::unlink(("/dev/shm" + fd::shm::ipc_delta_name(o.port)).c_str());
    json j = {{"strategy", "ipc"}, {"version", o.version}, {"port", o.port}, {"tp", o.tp}, {"ep", m.ep_size()}, {"bytes", total},
              {"ranks", ranks}};
    std::string files;
    for (int r = 0; r < o.tp; ++r) { files += (r ? ", /dev/shm" : "/dev/shm") + fd::shm::ipc_weights_name(o.port, r); }
    print_summary(o, j, fmt::format("published {} as ipc version {} for port {} (tp={}{}, {:.1f} MiB): {}; "
                                    "they stay until removed: rm /dev/shm/fdrollout.{}.weights.tp*",
                                    o.from, o.version, o.port, o.tp,
                                    o.tp_given ? "" : o.rollout_tp > 0 ? ", the running rollout's" : ", no rollout answered on that port",
                                    total / 1048576.0, files, o.port));
    return 0;
}

}  // namespace fdctl
