// A sparse weight update's file and its write into a checkpoint dir (fd/weights/weight_delta.h).
#include "fd/weights/weight_delta.h"

#include "fd/arena.h"

#include "delta_framing.h"
#include "fd/file_io.h"
#include "fd/log.h"
#include "fd/status.h"

#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <map>
#include <memory>

namespace fd::weights {

namespace {

constexpr char kMagic[8] = {'F', 'D', 'D', 'E', 'L', 'T', 'A', '1'};

/// A file mapped shared for writing; unmapped on destruction.
struct Mapped {
    std::byte * p = nullptr;
    size_t      n = 0;
    ~Mapped() {
        if (p) { ::munmap(p, n); }
    }
};

}  // namespace

int64_t DeltaTensor::numel() const {
    int64_t n = 1;
    for (const int64_t d : shape) { n *= d; }
    return n;
}

int64_t DeltaTensor::n_values() const { return static_cast<int64_t>(values.size()) / model::dtype_size(dtype); }

int64_t WeightDelta::payload_bytes() const {
    int64_t n = 0;
    for (const auto & t : tensors) { n += static_cast<int64_t>(t.indices.size() * sizeof(int64_t) + t.values.size()); }
    return n;
}

namespace {

std::string delta_header(const WeightDelta & d) {
    nlohmann::json ts = nlohmann::json::array();
    for (const auto & t : d.tensors) {
        ts.push_back({{"name", t.name}, {"dtype", model::dtype_name(t.dtype)}, {"shape", t.shape}, {"dense", t.dense}, {"n", t.n_values()},
                      {"index_bytes", t.numel() <= INT32_MAX ? 4 : 8}});
    }
    return nlohmann::json{{"tensors", ts}}.dump();
}

/// Write all n bytes at p to fd at offset `off` (retrying short writes and EINTR).
void pwrite_all(int fd, const void * p, size_t n, off_t off, const std::filesystem::path & file) {
    const auto * b = static_cast<const std::byte *>(p);
    while (n > 0) {
        const ssize_t w = ::pwrite(fd, b, n, off);
        if (w < 0 && errno == EINTR) { continue; }
        if (w <= 0) { fail(Errc::invalid_argument, "{}: writing the weight delta failed: {}", file.string(), std::strerror(errno)); }
        b += w;
        n -= static_cast<size_t>(w);
        off += w;
    }
}

/// Tensors [t0, t1) of `d`, each its indices (int32 when the tensor has < 2^31 elements) then
/// its values, back to back from byte `off` of the file.
void write_tensors(int fd, const std::filesystem::path & file, const WeightDelta & d, size_t t0, size_t t1, off_t off) {
    std::vector<int32_t> narrow;
    for (size_t i = t0; i < t1; ++i) {
        const DeltaTensor & t = d.tensors[i];
        if (t.numel() <= INT32_MAX) {
            narrow.assign(t.indices.begin(), t.indices.end());
            pwrite_all(fd, narrow.data(), narrow.size() * sizeof(int32_t), off, file);
            off += static_cast<off_t>(narrow.size() * sizeof(int32_t));
        } else {
            pwrite_all(fd, t.indices.data(), t.indices.size() * sizeof(int64_t), off, file);
            off += static_cast<off_t>(t.indices.size() * sizeof(int64_t));
        }
        pwrite_all(fd, t.values.data(), t.values.size(), off, file);
        off += static_cast<off_t>(t.values.size());
    }
}

}  // namespace

void write_weight_delta(const std::filesystem::path & file, const WeightDelta & d) {
    const std::string header = delta_header(d);
    const UniqueFd fd = detail::create_framed(file, kMagic, header, "the weight delta");
    write_tensors(fd.get(), file, d, 0, d.tensors.size(), static_cast<off_t>(16 + header.size()));
}

int64_t DeltaView::numel() const {
    int64_t n = 1;
    for (const int64_t d : shape) { n *= d; }
    return n;
}

MappedWeightDelta::~MappedWeightDelta() {
    if (map_) { ::munmap(map_, map_bytes_); }
}

const DeltaView * MappedWeightDelta::find(const std::string & name) const {
    for (const auto & t : tensors) {
        if (t.name == name) { return &t; }
    }
    return nullptr;
}

namespace {

/// One tensor's entry of a weight delta's header, checked: its dtype known, its n values (and,
/// sparse, n indices of 4 or 8 bytes) fitting its shape and the file's bytes from `off` to
/// `size` (no product that can overflow). Errors: invalid_checkpoint naming the file and tensor.
struct DeltaEntry {
    std::string          name;
    fd::DType            dtype = fd::DType::f32;
    std::vector<int64_t> shape;
    bool                 dense = false;
    int64_t              n = 0, numel = 0, index_bytes = 8, value_bytes = 4;

    /// A DeltaView or DeltaTensor holding the fields both have (name and shape moved out).
    template <class T> T head() && {
        T t;
        t.name  = std::move(name);
        t.dtype = dtype;
        t.shape = std::move(shape);
        t.dense = dense;
        return t;
    }
};

/// The frame's header, checked to be {"tensors": [...]}.
const nlohmann::json & delta_entries(const detail::Framed & f, const std::filesystem::path & file) {
    const nlohmann::json & j = f.header;
    if (!j.is_object() || !j.contains("tensors") || !j["tensors"].is_array()) {
        fail(Errc::invalid_checkpoint, "{}: the weight delta's header is not {{\"tensors\": [...]}}", file.string());
    }
    return j["tensors"];
}

DeltaEntry parse_entry(const nlohmann::json & e, const std::filesystem::path & file, int64_t off, int64_t size) {
    DeltaEntry t;
    t.name        = e.value("name", "");
    const auto dt = fd::parse_dtype(e.value("dtype", ""));
    if (!dt) { fail(Errc::invalid_checkpoint, "{}: tensor '{}' has no dtype", file.string(), t.name); }
    t.dtype       = *dt;
    t.shape       = e.value("shape", std::vector<int64_t>{});
    t.dense       = e.value("dense", false);
    t.n           = e.value("n", int64_t{-1});
    t.index_bytes = e.value("index_bytes", int64_t{8});
    t.value_bytes = model::dtype_size(t.dtype);
    t.numel       = 1;
    for (const int64_t d : t.shape) {
        if (d < 0 || (d > 0 && t.numel > INT64_MAX / d)) { t.numel = -1; break; }
        t.numel *= d;
    }
    const int64_t per = (t.dense ? 0 : t.index_bytes) + t.value_bytes;
    if (t.numel < 0 || t.n < 0 || t.n > t.numel || (t.dense && t.n != t.numel) || (t.index_bytes != 4 && t.index_bytes != 8) ||
        off > size || t.n > (size - off) / per) {
        fail(Errc::invalid_checkpoint, "{}: tensor '{}': {} values do not fit its shape or the file", file.string(), t.name, t.n);
    }
    return t;
}

/// `f`'s tensors as views over `base` (the file's bytes from offset 0), each entry checked
/// (parse_entry) before it is added.
void add_views(MappedWeightDelta & m, const detail::Framed & f, const std::filesystem::path & file, const std::byte * base) {
    int64_t off = f.payload_off;
    for (const auto & e : delta_entries(f, file)) {
        DeltaEntry h = parse_entry(e, file, off, f.size);
        DeltaView  t = std::move(h).head<DeltaView>();
        t.n           = h.n;
        t.index_bytes = static_cast<int32_t>(h.index_bytes);
        if (!t.dense) {
            t.indices = base + off;
            off += t.n * h.index_bytes;
        }
        t.values = base + off;
        off += t.n * h.value_bytes;
        m.tensors.push_back(std::move(t));
    }
}

}  // namespace

/// `f` (open, its header's shape checked) mapped read-only, shared, with its views.
std::shared_ptr<const MappedWeightDelta> map_framed(const detail::Framed & f, const std::filesystem::path & file) {
    auto m = std::make_shared<MappedWeightDelta>();
    void * p = ::mmap(nullptr, static_cast<size_t>(f.size), PROT_READ, MAP_SHARED | MAP_POPULATE, f.fd.get(), 0);
    if (p == MAP_FAILED) { fail(Errc::invalid_checkpoint, "{}: cannot map the weight delta: {}", file.string(), std::strerror(errno)); }
    m->map_       = p;
    m->map_bytes_ = static_cast<size_t>(f.size);
    add_views(*m, f, file, static_cast<const std::byte *>(p));
    return m;
}

std::shared_ptr<const MappedWeightDelta> map_weight_delta(const std::filesystem::path & file) {
    const detail::Framed f = detail::open_framed(file, kMagic, "a weight delta");
    delta_entries(f, file);  // the header's shape, before anything is mapped
    return map_framed(f, file);
}

std::shared_ptr<const MappedWeightDelta> read_weight_delta_into(const std::filesystem::path & file, Arena & buffer, int64_t max_copy_bytes) {
    const detail::Framed f = detail::open_framed(file, kMagic, "a weight delta");
    delta_entries(f, file);
    if (f.size > max_copy_bytes) {
        buffer.release();
        return map_framed(f, file);
    }
    if (buffer.capacity_bytes() < f.size) { buffer.reserve(f.size); }  // grown, never shrunk: its pages stay faulted in
    model::pread_exact(f.fd.get(), buffer.data(), f.size, 0, file, "the weight delta");
    auto m = std::make_shared<MappedWeightDelta>();
    add_views(*m, f, file, buffer.data());
    return m;
}

WeightDelta read_weight_delta(const std::filesystem::path & file) {
    const detail::Framed f = detail::open_framed(file, kMagic, "a weight delta");
    const UniqueFd & fd = f.fd;
    const nlohmann::json & entries = delta_entries(f, file);
    WeightDelta d;
    int64_t off = f.payload_off;
    for (const auto & e : entries) {
        DeltaEntry  h = parse_entry(e, file, off, f.size);
        DeltaTensor t = std::move(h).head<DeltaTensor>();
        const int64_t n = h.n, numel = h.numel, es = h.value_bytes, ib = h.index_bytes;
        if (!t.dense) {
            t.indices.resize(static_cast<size_t>(n));
            if (ib == 4) {
                std::vector<int32_t> narrow(static_cast<size_t>(n));
                model::pread_exact(fd.get(), narrow.data(), n * 4, off, file, "indices of " + t.name);
                std::copy(narrow.begin(), narrow.end(), t.indices.begin());
            } else {
                model::pread_exact(fd.get(), t.indices.data(), n * 8, off, file, "indices of " + t.name);
            }
            off += n * ib;
            int64_t prev = -1;
            for (const int64_t i : t.indices) {
                if (i <= prev || i >= numel) {
                    fail(Errc::invalid_checkpoint, "{}: tensor '{}': index {} is out of order or outside [0, {})", file.string(), t.name, i, numel);
                }
                prev = i;
            }
        }
        t.values.resize(static_cast<size_t>(n * es));
        model::pread_exact(fd.get(), t.values.data(), n * es, off, file, "values of " + t.name);
        off += n * es;
        d.tensors.push_back(std::move(t));
    }
    return d;
}

WeightDelta merge_weight_deltas(const WeightDelta & older, const WeightDelta & newer) {
    std::map<std::string, const DeltaTensor *> byname;
    for (const auto & t : older.tensors) { byname[t.name] = &t; }
    std::map<std::string, DeltaTensor> out;
    for (const auto & t : older.tensors) { out[t.name] = t; }
    for (const auto & n : newer.tensors) {
        const auto it = byname.find(n.name);
        if (it == byname.end() || n.dense) {
            if (it != byname.end() && (it->second->dtype != n.dtype || it->second->shape != n.shape)) {
                fail(Errc::invalid_checkpoint, "merging deltas: tensor '{}' changes its dtype or shape", n.name);
            }
            out[n.name] = n;
            continue;
        }
        const DeltaTensor & o = *it->second;
        if (o.dtype != n.dtype || o.shape != n.shape) {
            fail(Errc::invalid_checkpoint, "merging deltas: tensor '{}' changes its dtype or shape", n.name);
        }
        const size_t es = static_cast<size_t>(model::dtype_size(n.dtype));
        DeltaTensor m;
        m.name  = n.name;
        m.dtype = n.dtype;
        m.shape = n.shape;
        if (o.dense) {  // newer's values written over older's dense ones
            m.dense  = true;
            m.values = o.values;
            for (size_t k = 0; k < n.indices.size(); ++k) {
                std::memcpy(m.values.data() + static_cast<size_t>(n.indices[k]) * es, n.values.data() + k * es, es);
            }
        } else {  // sorted union, newer wins on equal indices
            m.indices.reserve(o.indices.size() + n.indices.size());
            m.values.reserve((o.indices.size() + n.indices.size()) * es);
            size_t i = 0, j = 0;
            auto take = [&](const DeltaTensor & src, size_t k) {
                m.indices.push_back(src.indices[k]);
                m.values.insert(m.values.end(), src.values.begin() + static_cast<std::ptrdiff_t>(k * es),
                                src.values.begin() + static_cast<std::ptrdiff_t>((k + 1) * es));
            };
            while (i < o.indices.size() || j < n.indices.size()) {
                if (j == n.indices.size() || (i < o.indices.size() && o.indices[i] < n.indices[j])) {
                    take(o, i++);
                } else {
                    if (i < o.indices.size() && o.indices[i] == n.indices[j]) { ++i; }
                    take(n, j++);
                }
            }
        }
        out[n.name] = std::move(m);
    }
    WeightDelta d;
    for (auto & [name, t] : out) { d.tensors.push_back(std::move(t)); }
    return d;
}

void apply_delta_to_dir(const std::filesystem::path & dir, const WeightDelta & d, DirUndo * undo) {
    const model::TensorIndex idx = model::read_tensor_index(dir);
    std::map<std::filesystem::path, std::vector<const DeltaTensor *>> by_file;
    for (const auto & t : d.tensors) {
        auto it = idx.tensors.find(t.name);
        if (it == idx.tensors.end() || it->second.dtype != t.dtype || it->second.shape != t.shape) {
            fail(Errc::invalid_checkpoint, "{}: the delta's tensor '{}' is not in the dir with its dtype and shape; nothing was written",
                 dir.string(), t.name);
        }
        by_file[it->second.file].push_back(&t);
    }
    DirUndo local;
    DirUndo & u = undo ? *undo : local;
    try {
        for (const auto & [path, ts] : by_file) {
            struct stat st{};
            const UniqueFd fd = open_regular(path, Errc::source_unavailable, &st);
            UniqueFd rw(::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW));
            if (!rw.valid()) { fail(Errc::source_unavailable, "{}: cannot open for writing: {}", path.string(), std::strerror(errno)); }
            Mapped m;
            m.n = static_cast<size_t>(st.st_size);
            void * p = ::mmap(nullptr, m.n, PROT_READ | PROT_WRITE, MAP_SHARED, rw.get(), 0);
            if (p == MAP_FAILED) { fail(Errc::source_unavailable, "{}: cannot map for writing: {}", path.string(), std::strerror(errno)); }
            m.p = static_cast<std::byte *>(p);
            DirUndo::File & f = u.files.emplace_back();
            f.path  = path;
            f.mtime = st.st_mtim;
            for (const DeltaTensor * t : ts) {
                const model::TensorInfo & info = idx.tensors.at(t->name);
                const int64_t es = model::dtype_size(t->dtype);
                std::byte * base = m.p + info.offset_bytes;
                if (t->dense) {
                    f.offsets.push_back(info.offset_bytes);
                    f.sizes.push_back(info.size_bytes);
                    f.old.insert(f.old.end(), base, base + info.size_bytes);
                    std::memcpy(base, t->values.data(), t->values.size());
                    continue;
                }
                const size_t n = t->indices.size(), old0 = f.old.size();
                f.offsets.reserve(f.offsets.size() + n);
                f.sizes.reserve(f.sizes.size() + n);
                f.old.resize(old0 + n * static_cast<size_t>(es));
                for (size_t k = 0; k < n; ++k) {
                    std::byte * at = base + t->indices[k] * es;
                    f.offsets.push_back(info.offset_bytes + t->indices[k] * es);
                    f.sizes.push_back(es);
                    std::memcpy(f.old.data() + old0 + k * static_cast<size_t>(es), at, static_cast<size_t>(es));
                    std::memcpy(at, t->values.data() + static_cast<int64_t>(k) * es, static_cast<size_t>(es));
                }
            }
            ::futimens(rw.get(), nullptr);  // now: the dir's fingerprint names the new bytes
        }
    } catch (...) {
        restore_dir(u);
        u.files.clear();
        throw;
    }
}

void restore_dir(const DirUndo & undo) noexcept {
    for (const auto & f : undo.files) {
        UniqueFd rw(::open(f.path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW));
        struct stat st{};
        if (!rw.valid() || ::fstat(rw.get(), &st) != 0) {
            log::get("stream")->error("{}: cannot put the old weights back: {}", f.path.string(), std::strerror(errno));
            continue;
        }
        const size_t n = static_cast<size_t>(st.st_size);
        void * p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, rw.get(), 0);
        if (p == MAP_FAILED) {
            log::get("stream")->error("{}: cannot map to put the old weights back: {}", f.path.string(), std::strerror(errno));
            continue;
        }
        Mapped m{static_cast<std::byte *>(p), n};
        size_t pos = 0;
        for (size_t k = 0; k < f.offsets.size(); ++k) {
            const size_t sz = static_cast<size_t>(f.sizes[k]);
            std::memcpy(m.p + f.offsets[k], f.old.data() + pos, sz);
            pos += sz;
        }
        const struct timespec times[2] = {{0, UTIME_OMIT}, f.mtime};
        ::futimens(rw.get(), times);
    }
}

}  // namespace fd::weights
