// The `ipc` load strategy (docs/weight_sources.md, fd/shm/ipc_weights.h): live tensors a trainer
// published into /dev/shm/fdrollout.<port>.weights.tp<rank>.
//
// fetch() maps the record's header, checks magic/ABI and the seqlock generation (0 or odd → 503),
// copies the entry table and turns it into a TensorIndex whose TensorInfo.file is the /dev/shm
// object itself, so the Worker's ordinary parallel preads copy the tensors into staging.
// verify_copied() then re-reads the generation (and that the path still names the same object):
// if the publisher wrote meanwhile the staged copy is dropped with 503 "retry".
#include "fd/weights/weight_source.h"

#include "fd/weights/fingerprint.h"

#include "fd/checkpoint/layout.h"
#include "fd/shm/ipc_weights.h"
#include "fd/memory/cuda_ipc.h"
#include "fd/shm/names.h"
#include "fd/status.h"
#include "fd/trust.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>

namespace fd::weights {
namespace {

using shm::IpcRecordHeader;
using shm::IpcTensorEntry;
using memory::cuda_ipc_available;
using memory::cuda_ipc_copy_to_host;
using memory::cuda_ipc_unavailable_reason;

/// The opened record: its fd and a read-only mapping of the header (the seqlock word).
class Record {
public:
    explicit Record(std::string path) : path_(std::move(path)) {
        fd_ = ::open(path_.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
        if (fd_ < 0) {
            if (errno == ENOENT) {
                fail(Errc::not_found, "no ipc weight record {}: the trainer has not published for this port and rank "
                                      "(fdctl publish --strategy ipc ...)", path_);
            }
            if (errno == ELOOP) {  // a retry cannot help (it was a 503 "retry": a probe); as the other trust failures
                fail(Errc::forbidden, "ipc weight record {} is a symbolic link, which is never followed: remove it and publish again", path_);
            }
            fail(Errc::source_unavailable, "cannot open ipc weight record {}: {}; retry", path_, std::strerror(errno));
        }
        struct stat st{};
        if (::fstat(fd_, &st) != 0) { fail(Errc::source_unavailable, "cannot stat {}: {}", path_, std::strerror(errno)); }
        if (!S_ISREG(st.st_mode)) {
            fail(Errc::invalid_checkpoint, "ipc weight record {} is not a shared-memory object (mode {:o}); remove it", path_, st.st_mode);
        }
        // The record decides what this daemon serves: only one written by its own user, mode
        // 0600, is trusted (another local user could otherwise create it first and inject weights).
        check_trusted(fd_, path_, Trust::secret);
        size_ = st.st_size;
        dev_  = st.st_dev;
        ino_  = st.st_ino;
        if (size_ < shm::kIpcDataAlign) {  // created but not sized yet: a publish is starting
            fail(Errc::source_unavailable, "ipc weight record {} is {} bytes: a publish is in progress; retry", path_, size_);
        }
        void * p = ::mmap(nullptr, sizeof(IpcRecordHeader), PROT_READ, MAP_SHARED, fd_, 0);
        if (p == MAP_FAILED) { fail(Errc::source_unavailable, "cannot map {}: {}", path_, std::strerror(errno)); }
        hdr_ = static_cast<const IpcRecordHeader *>(p);
    }
    ~Record() {
        if (hdr_) { ::munmap(const_cast<IpcRecordHeader *>(hdr_), sizeof(IpcRecordHeader)); }
        if (fd_ >= 0) { ::close(fd_); }
    }
    Record(const Record &) = delete;
    Record & operator=(const Record &) = delete;

    const IpcRecordHeader & header() const { return *hdr_; }
    uint64_t generation() const { return hdr_->generation.load(std::memory_order_acquire); }
    int fd() const { return fd_; }
    uint64_t dev() const { return static_cast<uint64_t>(dev_); }
    uint64_t ino() const { return static_cast<uint64_t>(ino_); }
    int64_t size() const { return size_; }
    const std::string & path() const { return path_; }

    /// Does `path` still name the object we opened (not unlinked and recreated)?
    bool same_object() const {
        struct stat st{};
        return ::stat(path_.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_;
    }

private:
    std::string             path_;
    int                     fd_ = -1;
    int64_t                 size_ = 0;
    dev_t                   dev_{};
    ino_t                   ino_{};
    const IpcRecordHeader * hdr_ = nullptr;
};

/// NUL-terminated string of at most `cap` bytes, or nullopt if unterminated.
std::optional<std::string> c_string(const char * p, size_t cap) {
    const void * nul = std::memchr(p, '\0', cap);
    if (!nul) { return std::nullopt; }
    return std::string(p, static_cast<const char *>(nul));
}

/// One entry → TensorInfo on the record file. Errors  invalid_checkpoint / source_unavailable.
model::TensorInfo to_tensor(const Record & rec, const IpcTensorEntry & e, uint64_t total_bytes, uint64_t table_end) {
    const auto name = c_string(e.name, sizeof(e.name));
    if (!name || name->empty()) {
        fail(Errc::invalid_checkpoint, "{}: a tensor entry has an empty or unterminated name", rec.path());
    }
    if (e.location != shm::kIpcInline && e.location != shm::kIpcCudaIpc) {
        fail(Errc::invalid_checkpoint, "{}: tensor '{}' has unknown location {}", rec.path(), *name, e.location);
    }
    model::TensorInfo t;
    t.name = *name;
    t.file = rec.path();
    switch (e.dtype) {
        case shm::kIpcF32: t.dtype = fd::DType::f32; break;
        case shm::kIpcBF16: t.dtype = fd::DType::bf16; break;
        case shm::kIpcF16: t.dtype = fd::DType::f16; break;
        default: fail(Errc::invalid_checkpoint, "{}: tensor '{}' has unknown dtype code {} (0 F32, 1 BF16, 2 F16)", rec.path(), *name, e.dtype);
    }
    if (e.ndim < 1 || e.ndim > static_cast<uint32_t>(shm::kIpcMaxDims)) {
        fail(Errc::invalid_checkpoint, "{}: tensor '{}' has ndim {} (1..{})", rec.path(), *name, e.ndim, shm::kIpcMaxDims);
    }
    for (uint32_t d = 0; d < e.ndim; ++d) {
        if (e.shape[d] <= 0 || e.shape[d] > (int64_t{1} << 40)) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' has dimension {} = {}", rec.path(), *name, d, e.shape[d]);
        }
        t.shape.push_back(e.shape[d]);
    }
    int64_t need = model::dtype_size(t.dtype);
    for (const int64_t d : t.shape) {
        if (__builtin_mul_overflow(need, d, &need)) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' has a shape whose byte size overflows 64 bits", rec.path(), *name);
        }
    }
    if (e.nbytes != static_cast<uint64_t>(need)) {
        fail(Errc::invalid_checkpoint, "{}: tensor '{}' has {} bytes but shape x dtype needs {}", rec.path(), *name, e.nbytes, need);
    }
    if (e.location == shm::kIpcCudaIpc) {  // offset is into the device allocation: placed by copy_cuda_entries
        t.offset_bytes = static_cast<int64_t>(e.offset);
        t.size_bytes   = static_cast<int64_t>(e.nbytes);
        return t;
    }
    if (e.offset < table_end || e.offset > total_bytes || e.nbytes > total_bytes - e.offset) {
        fail(Errc::invalid_checkpoint, "{}: tensor '{}' data [{}, {}) lies outside the data area [{}, {})", rec.path(),
             *name, e.offset, e.offset + e.nbytes, table_end, total_bytes);
    }
    t.offset_bytes = static_cast<int64_t>(e.offset);
    t.size_bytes   = static_cast<int64_t>(e.nbytes);
    t.file_dev     = rec.dev();  // the Worker reads exactly the object checked here
    t.file_ino     = rec.ino();
    return t;
}

/// Host copies of the record's CUDA IPC tensors, in an anonymous memfd the Worker reads like
/// the record itself (through /proc/self/fd/N).
class CudaCopies {
public:
    ~CudaCopies() {
        if (fd_ >= 0) { ::close(fd_); }
    }
    /// Copy every CUDA entry of `entries` (TensorInfo `ts`, same order) to host and point its
    /// TensorInfo at the copy. Errors  source_unavailable (no CUDA, no device, stale handle).
    void copy(const Record & rec, const std::vector<IpcTensorEntry> & entries, std::vector<model::TensorInfo> & ts) {
        int64_t     total = 0;
        std::string first;
        for (size_t i = 0; i < entries.size(); ++i) {
            if (entries[i].location != shm::kIpcCudaIpc) { continue; }
            total += (ts[i].size_bytes + 63) / 64 * 64;
            if (first.empty()) { first = ts[i].name; }
        }
        if (total == 0) { return; }
        if (!cuda_ipc_available()) {
            fail(Errc::source_unavailable, "{}: tensor '{}' (and any other CUDA entry) is a CUDA IPC handle, but {}; "
                                           "publish host tensors instead", rec.path(), first, cuda_ipc_unavailable_reason());
        }
        fd_ = ::memfd_create("fdrollout-ipc-cuda", MFD_CLOEXEC);
        if (fd_ < 0 || ::ftruncate(fd_, total) != 0) {
            fail(Errc::source_unavailable, "cannot make a {}-byte host buffer for the CUDA tensors: {}", total, std::strerror(errno));
        }
        void * map = ::mmap(nullptr, static_cast<size_t>(total), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
        if (map == MAP_FAILED) { fail(Errc::source_unavailable, "cannot map the CUDA staging buffer: {}", std::strerror(errno)); }
        const std::string path = "/proc/self/fd/" + std::to_string(fd_);
        int64_t pos = 0;
        try {
            for (size_t i = 0; i < entries.size(); ++i) {
                if (entries[i].location != shm::kIpcCudaIpc) { continue; }
                cuda_ipc_copy_to_host(entries[i].cuda_ipc_handle, entries[i].offset, entries[i].nbytes,
                                      static_cast<char *>(map) + pos, rec.path() + ": tensor '" + ts[i].name + "'");
                ts[i].file         = path;
                ts[i].file_dev     = 0;  // our own memfd, read through /proc/self/fd
                ts[i].file_ino     = 0;
                ts[i].offset_bytes = pos;
                pos += (ts[i].size_bytes + 63) / 64 * 64;
            }
        } catch (...) {
            ::munmap(map, static_cast<size_t>(total));
            throw;
        }
        ::munmap(map, static_cast<size_t>(total));
    }

private:
    int fd_ = -1;
};

class IpcSource final : public WeightSource {
public:
    IpcSource(int port, int tp) : port_(port), tp_(tp) {}
    LoadStrategy strategy() const override { return LoadStrategy::ipc; }

    FetchedCheckpoint fetch(const FetchRequest & req) override {
        auto rec = std::make_shared<Record>("/dev/shm" + shm::ipc_weights_name(port_, req.rank));
        const IpcRecordHeader & h = rec->header();
        if (h.magic != shm::kIpcMagic) {
            fail(Errc::invalid_checkpoint, "{}: not an fdrollout ipc weight record (bad magic {:#x})", rec->path(), h.magic);
        }
        if (h.abi_version != shm::kIpcAbiVersion) {
            fail(Errc::invalid_checkpoint, "{}: record ABI version {}, this fdrollout reads {}; upgrade the publisher",
                 rec->path(), h.abi_version, shm::kIpcAbiVersion);
        }
        const uint64_t g1 = rec->generation();
        if (g1 == 0 || g1 % 2 == 1) {
            fail(Errc::source_unavailable, "{}: {} (generation {}); retry once the trainer's publish finished", rec->path(),
                 g1 == 0 ? "nothing was published yet" : "a publish is in progress", g1);
        }
        // Copy what the header says, then the entry table, then check nothing moved meanwhile.
        const uint32_t n_tensors   = h.n_tensors;
        const uint64_t total_bytes = h.total_bytes;
        const int32_t  rank        = h.rank;
        const int32_t  rec_tp      = h.tp_size;
        const auto     version     = c_string(h.version, sizeof(h.version));
        const uint64_t table_end   = sizeof(IpcRecordHeader) + uint64_t{n_tensors} * sizeof(IpcTensorEntry);
        std::vector<IpcTensorEntry> entries;
        if (total_bytes <= static_cast<uint64_t>(rec->size()) && table_end <= total_bytes) {
            entries.resize(n_tensors);
            model::pread_exact(rec->fd(), entries.data(), static_cast<int64_t>(n_tensors * sizeof(IpcTensorEntry)),
                               sizeof(IpcRecordHeader), rec->path(), "tensor entries");
        }
        if (rec->generation() != g1) {
            fail(Errc::source_unavailable, "{}: the publisher rewrote the record while it was read; retry", rec->path());
        }
        if (rec_tp != tp_) {
            fail(Errc::invalid_checkpoint, "{}: published for tp={}, the rollout runs tp={}: pass --tp {} to fdctl publish "
                 "(or tp_size={} to fdpublish.publish_ipc); nothing applied", rec->path(), rec_tp, tp_, tp_, tp_);
        }
        if (total_bytes > static_cast<uint64_t>(rec->size())) {
            fail(Errc::invalid_checkpoint, "{}: header says {} bytes but the object has {}", rec->path(), total_bytes, rec->size());
        }
        if (table_end > total_bytes) {
            fail(Errc::invalid_checkpoint, "{}: {} tensor entries do not fit in {} bytes", rec->path(), n_tensors, total_bytes);
        }
        if (rank != req.rank) {
            fail(Errc::invalid_checkpoint, "{}: record is for rank {}, expected rank {}", rec->path(), rank, req.rank);
        }
        FetchedCheckpoint out;
        out.index.source = rec->path();
        // What this record holds, as of generation g1 (verify_copied checks it did not move): a
        // publish again under the same version is other bytes, and the label says so.
        out.fingerprint = record_fingerprint(rec->path(), rec->dev(), rec->ino(), g1, total_bytes, entries.data(),
                                             entries.size() * sizeof(IpcTensorEntry));
        std::vector<model::TensorInfo> ts;
        for (const IpcTensorEntry & e : entries) { ts.push_back(to_tensor(*rec, e, total_bytes, table_end)); }
        // Inline tensors must not share bytes (the safetensors rule, less the contiguity: entries
        // are 64-byte aligned, so gaps are allowed).
        std::vector<const model::TensorInfo *> inl;
        for (size_t i = 0; i < ts.size(); ++i) {
            if (entries[i].location == shm::kIpcInline) { inl.push_back(&ts[i]); }
        }
        std::sort(inl.begin(), inl.end(), [](auto * a, auto * b) { return a->offset_bytes < b->offset_bytes; });
        for (size_t i = 1; i < inl.size(); ++i) {
            if (inl[i]->offset_bytes < inl[i - 1]->offset_bytes + inl[i - 1]->size_bytes) {
                fail(Errc::invalid_checkpoint, "{}: tensor '{}' data at offset {} overlaps tensor '{}' [{}, {})", rec->path(), inl[i]->name,
                     inl[i]->offset_bytes, inl[i - 1]->name, inl[i - 1]->offset_bytes, inl[i - 1]->offset_bytes + inl[i - 1]->size_bytes);
            }
        }
        auto cuda = std::make_shared<CudaCopies>();
        if (req.device_destination) {  // a CUDA rank: fill_weights copies these device to device
            for (size_t i = 0; i < entries.size(); ++i) {
                if (entries[i].location != shm::kIpcCudaIpc) { continue; }
                if (!cuda_ipc_available()) {
                    fail(Errc::source_unavailable, "{}: tensor '{}' is a CUDA IPC handle, but {}", rec->path(), ts[i].name,
                         cuda_ipc_unavailable_reason());
                }
                ts[i].on_cuda_ipc = true;
                std::memcpy(ts[i].cuda_ipc_handle.data(), entries[i].cuda_ipc_handle, ts[i].cuda_ipc_handle.size());
            }
        } else {
            cuda->copy(*rec, entries, ts);
        }
        for (model::TensorInfo & t : ts) {
            if (out.index.tensors.count(t.name)) {
                fail(Errc::invalid_checkpoint, "{}: tensor '{}'{} appears twice", rec->path(), t.name, model::expert_of(t.name));
            }
            out.index.total_bytes += t.size_bytes;
            std::string name = t.name;
            out.index.tensors.emplace(std::move(name), std::move(t));
        }
        if (req.version) {
            out.version = req.version;
        } else {
            if (!version || !shm::is_valid_version(*version)) {
                fail(Errc::invalid_checkpoint, "{}: the record's version is not [A-Za-z0-9._-]{{1,128}}", rec->path());
            }
            out.version = *version;
        }
        out.verify_copied = [rec, g1] {
            if (rec->generation() != g1) {
                fail(Errc::source_unavailable, "{}: the publisher rewrote the record during the copy; retry", rec->path());
            }
            if (!rec->same_object()) {
                fail(Errc::source_unavailable, "{}: the publisher replaced the record during the copy; retry", rec->path());
            }
        };
        out.hold = std::make_shared<std::pair<std::shared_ptr<Record>, std::shared_ptr<CudaCopies>>>(rec, cuda);
        return out;
    }

private:
    int port_;
    int tp_;
};

}  // namespace

std::unique_ptr<WeightSource> make_ipc_source(int port, int tp) {
    return std::make_unique<IpcSource>(port, tp);
}

}  // namespace fd::weights
