// A delta split by the tensor-parallel layout, one rank's share, and its file
// (fd/weights/rank_delta.h).
#include "fd/weights/rank_delta.h"

#include "delta_framing.h"
#include "fd/file_io.h"
#include "fd/status.h"

#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <thread>

namespace fd::weights {

namespace {

constexpr char kMagic[8] = {'F', 'D', 'R', 'D', 'L', 'T', '0', '1'};

/// 4 when every start of `t` fits an int32 (a shard of < 2^31 elements), else 8.
int32_t start_bytes(const RankDeltaTensor & t) {
    int64_t numel = 1;
    for (const int64_t x : t.shape) { numel *= x; }
    return numel <= INT32_MAX ? 4 : 8;
}

std::string shape_text(const std::vector<int64_t> & s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) { out += (i ? ", " : "") + std::to_string(s[i]); }
    return out + "]";
}

/// Builds one inference tensor's share. Points mode (every part it takes is sparse): one start
/// per element, no lens. Runs mode (some part is dense): runs with lens, consecutive ones merged.
struct RunBuilder {
    RankDeltaTensor & t;
    bool              runs_mode;
    int64_t           out_es;
    fd::DType         in_dtype = fd::DType::f32;

    /// Elements [e, e + n) of the shard take the n values at `src` (of in_dtype). Runs mode.
    void run(int64_t e, int64_t n, const std::byte * src) {
        if (n <= 0) { return; }
        if (!t.starts.empty() && t.starts.back() + t.lens.back() == e) {
            t.lens.back() += n;
        } else {
            t.starts.push_back(e);
            t.lens.push_back(n);
        }
        values(n, src);
    }
    /// Elements at `idx` [n] + shift (sorted, unique) take the n values at `src`.
    void points(const int64_t * idx, int64_t n, int64_t shift, const std::byte * src) {
        if (n <= 0) { return; }
        const size_t at = t.starts.size();
        t.starts.resize(at + static_cast<size_t>(n));
        int64_t * out = t.starts.data() + at;
        for (int64_t k = 0; k < n; ++k) { out[k] = idx[k] + shift; }
        if (runs_mode) { t.lens.resize(t.starts.size(), 1); }
        values(n, src);
    }
    void values(int64_t n, const std::byte * src) {
        const size_t at = t.values.size();
        t.values.resize(at + static_cast<size_t>(n * out_es));
        if (in_dtype == t.dtype) {
            std::memcpy(t.values.data() + at, src, static_cast<size_t>(n * out_es));
        } else {  // F16 (or a mixed part) widened to f32, as the loader widens it
            model::convert_to_f32(in_dtype, src, reinterpret_cast<float *>(t.values.data() + at), n);
        }
    }
};

}  // namespace

int64_t RankDeltaTensor::n_values() const { return static_cast<int64_t>(values.size()) / model::dtype_size(dtype); }

int64_t RankDelta::n_values() const {
    int64_t n = 0;
    for (const auto & t : tensors) { n += t.n_values(); }
    return n;
}

int64_t RankDelta::payload_bytes() const {
    int64_t n = 0;
    for (const auto & t : tensors) { n += static_cast<int64_t>((t.starts.size() + t.lens.size()) * sizeof(int64_t) + t.values.size()); }
    return n;
}

namespace {

using ByName = std::map<std::string, const DeltaTensor *>;

ByName by_name_of(const WeightDelta & d) {
    ByName m;
    for (const auto & dt : d.tensors) { m[dt.name] = &dt; }
    return m;
}

/// Errors  invalid_checkpoint when the delta's tensor does not match the layout's part.
void check_part(const model::InferenceTensor & t, const model::WeightPart & p, const DeltaTensor & dt) {
    if (p.hf_shape != dt.shape || (t.dtype != dt.dtype && t.dtype != fd::DType::f32)) {
        fail(Errc::invalid_checkpoint, "delta tensor '{}' ({} {}) does not match the loaded weights ({} {} in '{}'); nothing was "
             "applied", dt.name, model::dtype_name(dt.dtype), shape_text(dt.shape), model::dtype_name(t.dtype),
             shape_text(p.hf_shape), t.name);
    }
}

/// `t`'s share of the delta (no starts when the delta does not touch it).
RankDeltaTensor split_tensor(const model::InferenceTensor & t, const ByName & by_name) {
    RankDeltaTensor rt{.name = t.name, .dtype = t.dtype, .shape = t.shape};
    const int64_t cols = t.shape.size() == 2 ? t.shape[1] : 1;
    bool any_dense = false;
    int64_t bound = 0;  // at most this many elements: reserved once (untouched capacity costs no page)
    for (const model::WeightPart & p : t.parts) {
        auto it = by_name.find(p.hf_name);
        if (it == by_name.end()) { continue; }
        any_dense = any_dense || it->second->dense;
        bound += it->second->dense ? it->second->numel() : static_cast<int64_t>(it->second->indices.size());
    }
    if (bound == 0) { return rt; }
    rt.starts.reserve(static_cast<size_t>(bound));
    if (any_dense) { rt.lens.reserve(static_cast<size_t>(bound)); }
    rt.values.reserve(static_cast<size_t>(bound * model::dtype_size(t.dtype)));
    for (const model::WeightPart & p : t.parts) {
        auto it = by_name.find(p.hf_name);
        if (it == by_name.end()) { continue; }
        const DeltaTensor & dt = *it->second;
        check_part(t, p, dt);
        const int64_t in_es   = model::dtype_size(dt.dtype);
        const int64_t hf_cols = p.hf_shape.size() == 2 ? p.hf_shape[1] : 1;
        RunBuilder b{rt, any_dense, model::dtype_size(t.dtype), dt.dtype};
        const std::byte * vals = dt.values.data();
        if (p.dim == 0) {  // HF rows [src0, src0 + rows) → shard rows [row0, row0 + rows): one shift
            const int64_t lo = p.src0 * cols, hi = (p.src0 + p.rows) * cols, shift = (p.row0 - p.src0) * cols;
            if (dt.dense) {
                b.run(lo + shift, hi - lo, vals + lo * in_es);
            } else {
                const auto k0 = std::lower_bound(dt.indices.begin(), dt.indices.end(), lo) - dt.indices.begin();
                const auto k1 = std::lower_bound(dt.indices.begin() + k0, dt.indices.end(), hi) - dt.indices.begin();
                b.points(dt.indices.data() + k0, k1 - k0, shift, vals + k0 * in_es);
            }
            continue;
        }
        // HF columns [src0, src0 + cols) of every row r → shard row r (fill_weights' add_cols)
        auto cur = dt.indices.begin();
        for (int64_t r = 0; r < p.rows; ++r) {
            const int64_t lo = r * hf_cols + p.src0, hi = lo + cols, shift = r * cols - lo;
            if (dt.dense) {
                b.run(lo + shift, cols, vals + lo * in_es);
                continue;
            }
            cur = std::lower_bound(cur, dt.indices.end(), lo);
            if (cur == dt.indices.end()) { break; }
            const auto end = std::lower_bound(cur, dt.indices.end(), hi);
            const int64_t k0 = cur - dt.indices.begin();
            b.points(dt.indices.data() + k0, end - cur, shift, vals + k0 * in_es);
            cur = end;
        }
    }
    if (rt.lens.size() == rt.starts.size() && rt.n_runs() == rt.n_values()) { rt.lens.clear(); }  // runs mode, every run one element
    return rt;
}

/// Elements [k0, k1) of a sparse delta tensor that land on this rank, at index + shift.
struct Piece {
    const DeltaTensor * dt;
    int64_t             k0, k1, shift;
};

/// The pieces of `t`'s share, in split_tensor's order, when every part the delta touches is
/// sparse; false (nothing planned) when one is dense (split_tensor builds that tensor's runs).
bool plan_points(const model::InferenceTensor & t, const ByName & by_name, std::vector<Piece> & out) {
    out.clear();
    for (const model::WeightPart & p : t.parts) {
        auto it = by_name.find(p.hf_name);
        if (it != by_name.end() && it->second->dense) { return false; }
    }
    const int64_t cols = t.shape.size() == 2 ? t.shape[1] : 1;
    for (const model::WeightPart & p : t.parts) {
        auto it = by_name.find(p.hf_name);
        if (it == by_name.end()) { continue; }
        const DeltaTensor & dt = *it->second;
        check_part(t, p, dt);
        const auto & ix = dt.indices;
        if (p.dim == 0) {
            const int64_t lo = p.src0 * cols, hi = (p.src0 + p.rows) * cols;
            const int64_t k0 = std::lower_bound(ix.begin(), ix.end(), lo) - ix.begin();
            const int64_t k1 = std::lower_bound(ix.begin() + k0, ix.end(), hi) - ix.begin();
            if (k1 > k0) { out.push_back({&dt, k0, k1, (p.row0 - p.src0) * cols}); }
            continue;
        }
        const int64_t hf_cols = p.hf_shape.size() == 2 ? p.hf_shape[1] : 1;
        auto cur = ix.begin();
        for (int64_t r = 0; r < p.rows; ++r) {
            const int64_t lo = r * hf_cols + p.src0, hi = lo + cols;
            cur = std::lower_bound(cur, ix.end(), lo);
            if (cur == ix.end()) { break; }
            const auto end = std::lower_bound(cur, ix.end(), hi);
            if (end > cur) { out.push_back({&dt, cur - ix.begin(), end - ix.begin(), r * cols - lo}); }
            cur = end;
        }
    }
    return true;
}

}  // namespace

void write_rank_share(const std::filesystem::path & file, const WeightDelta & d, const model::WeightLayout & layout) {
    const ByName by_name = by_name_of(d);
    struct Planned {
        const model::InferenceTensor * t;
        std::vector<Piece>             pieces;  ///< all sparse: one start per element, written straight from the delta
        RankDeltaTensor                built;   ///< else: split_tensor's runs
        bool                           points = false;
        int64_t                        n = 0, n_runs = 0, sb = 8;
    };
    std::vector<Planned> plan;
    nlohmann::json ts = nlohmann::json::array();
    int64_t payload = 0;
    for (const model::InferenceTensor & t : layout.tensors) {
        Planned pl{.t = &t};
        pl.points = plan_points(t, by_name, pl.pieces);
        if (pl.points) {
            for (const Piece & pc : pl.pieces) { pl.n += pc.k1 - pc.k0; }
            pl.n_runs = pl.n;
        } else {
            pl.built  = split_tensor(t, by_name);
            pl.n      = pl.built.n_values();
            pl.n_runs = pl.built.n_runs();
        }
        if (pl.n_runs == 0) { continue; }
        int64_t numel = 1;
        for (const int64_t x : t.shape) { numel *= x; }
        pl.sb = numel <= INT32_MAX ? 4 : 8;
        payload += pl.n_runs * pl.sb + (pl.n_runs == pl.n ? 0 : pl.n_runs * 8) + pl.n * model::dtype_size(t.dtype);
        ts.push_back({{"name", t.name}, {"dtype", model::dtype_name(t.dtype)}, {"shape", t.shape}, {"n_runs", pl.n_runs}, {"n", pl.n},
                      {"start_bytes", pl.sb}});
        plan.push_back(std::move(pl));
    }
    const std::string header = nlohmann::json{{"rank", layout.tp.rank}, {"tp", layout.tp.size}, {"ep", layout.tp.ep}, {"tensors", ts}}.dump();
    const UniqueFd fd = detail::create_framed(file, kMagic, header, "a rank's weight delta");
    if (payload == 0) { return; }
    // The payload is written straight into the file's pages (mapped shared): no staging copy.
    const int64_t off = 16 + static_cast<int64_t>(header.size()), total = off + payload;
    if (::ftruncate(fd.get(), static_cast<off_t>(total)) != 0) {
        fail(Errc::invalid_argument, "{}: cannot size a rank's weight delta to {} B: {}", file.string(), total, std::strerror(errno));
    }
    void * m = ::mmap(nullptr, static_cast<size_t>(total), PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (m == MAP_FAILED) { fail(Errc::invalid_argument, "{}: cannot map a rank's weight delta: {}", file.string(), std::strerror(errno)); }
    struct Unmap {
        void * p;
        size_t n;
        ~Unmap() { ::munmap(p, n); }
    } unmap{m, static_cast<size_t>(total)};
    std::byte * w = static_cast<std::byte *>(m) + off;
    for (const Planned & pl : plan) {
        const int64_t es = model::dtype_size(pl.t->dtype);
        if (pl.points) {
            for (const Piece & pc : pl.pieces) {  // starts
                const int64_t * ix = pc.dt->indices.data();
                if (pl.sb == 4) {
                    auto * o = reinterpret_cast<int32_t *>(w);
                    for (int64_t k = pc.k0; k < pc.k1; ++k) { *o++ = static_cast<int32_t>(ix[k] + pc.shift); }
                } else {
                    auto * o = reinterpret_cast<int64_t *>(w);
                    for (int64_t k = pc.k0; k < pc.k1; ++k) { *o++ = ix[k] + pc.shift; }
                }
                w += (pc.k1 - pc.k0) * pl.sb;
            }
            for (const Piece & pc : pl.pieces) {  // values, in the shard's dtype
                const int64_t in_es = model::dtype_size(pc.dt->dtype), n = pc.k1 - pc.k0;
                const std::byte * src = pc.dt->values.data() + pc.k0 * in_es;
                if (pc.dt->dtype == pl.t->dtype) {
                    std::memcpy(w, src, static_cast<size_t>(n * es));
                } else {  // F16 widened to f32, as the loader widens it
                    std::vector<float> f(static_cast<size_t>(n));
                    model::convert_to_f32(pc.dt->dtype, src, f.data(), n);
                    std::memcpy(w, f.data(), f.size() * sizeof(float));
                }
                w += n * es;
            }
            continue;
        }
        const RankDeltaTensor & t = pl.built;
        for (const int64_t st : t.starts) {
            if (pl.sb == 4) {
                const auto v = static_cast<int32_t>(st);
                std::memcpy(w, &v, 4);
            } else {
                std::memcpy(w, &st, 8);
            }
            w += pl.sb;
        }
        std::memcpy(w, t.lens.data(), t.lens.size() * sizeof(int64_t));
        w += static_cast<int64_t>(t.lens.size() * sizeof(int64_t));
        std::memcpy(w, t.values.data(), t.values.size());
        w += static_cast<int64_t>(t.values.size());
    }
    FD_CHECK(w == static_cast<std::byte *>(m) + total, "a rank's weight delta: the payload fills the file exactly");
}

RankDelta split_delta(const WeightDelta & d, const model::WeightLayout & layout) {
    const ByName by_name = by_name_of(d);
    RankDelta out{.rank = layout.tp.rank, .tp = layout.tp.size, .ep = layout.tp.ep};
    for (const model::InferenceTensor & t : layout.tensors) {
        RankDeltaTensor rt = split_tensor(t, by_name);
        if (!rt.starts.empty()) { out.tensors.push_back(std::move(rt)); }
    }
    return out;
}

std::filesystem::path rank_delta_file(const std::filesystem::path & delta_file, int32_t rank) {
    return std::filesystem::path(delta_file.string() + ".rank" + std::to_string(rank));
}

void write_rank_delta(const std::filesystem::path & file, const RankDelta & d) {
    nlohmann::json ts = nlohmann::json::array();
    for (const auto & t : d.tensors) {
        ts.push_back({{"name", t.name}, {"dtype", model::dtype_name(t.dtype)}, {"shape", t.shape}, {"n_runs", t.n_runs()}, {"n", t.n_values()},
                      {"start_bytes", start_bytes(t)}});
    }
    const std::string header = nlohmann::json{{"rank", d.rank}, {"tp", d.tp}, {"ep", d.ep}, {"tensors", ts}}.dump();
    const UniqueFd fd = detail::create_framed(file, kMagic, header, "a rank's weight delta");
    std::vector<int32_t> narrow;
    for (const auto & t : d.tensors) {
        if (start_bytes(t) == 4) {
            narrow.assign(t.starts.begin(), t.starts.end());
            detail::write_all(fd.get(), narrow.data(), narrow.size() * sizeof(int32_t), file, "a rank's weight delta");
        } else {
            detail::write_all(fd.get(), t.starts.data(), t.starts.size() * sizeof(int64_t), file, "a rank's weight delta");
        }
        detail::write_all(fd.get(), t.lens.data(), t.lens.size() * sizeof(int64_t), file, "a rank's weight delta");
        detail::write_all(fd.get(), t.values.data(), t.values.size(), file, "a rank's weight delta");
    }
}

RankDelta read_rank_delta(const std::filesystem::path & file) {
    const detail::Framed f = detail::open_framed(file, kMagic, "a rank's weight delta");
    const UniqueFd & fd = f.fd;
    const int64_t size = f.size;
    const nlohmann::json & j = f.header;
    if (!j.is_object() || !j.contains("tensors") || !j["tensors"].is_array()) {
        fail(Errc::invalid_checkpoint, "{}: the rank delta's header is not {{\"rank\", \"tp\", \"ep\", \"tensors\": [...]}}", file.string());
    }
    RankDelta d{.rank = j.value("rank", -1), .tp = j.value("tp", 0), .ep = j.value("ep", 0)};
    int64_t off = f.payload_off;
    // The file mapped read-only (tmpfs: its page-cache pages, nothing copied); every range is
    // checked against its size before it is read (map.at).
    struct Map {
        const std::byte * p = nullptr;
        size_t            n = 0;
        ~Map() {
            if (p) { ::munmap(const_cast<std::byte *>(p), n); }
        }
        const std::byte * at(int64_t o, int64_t len) const {
            FD_CHECK(o >= 0 && len >= 0 && static_cast<size_t>(o + len) <= n, "a rank delta's range outside its mapped file");
            return p + o;
        }
    } map;
    if (size > 0) {
        void * m = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd.get(), 0);
        if (m == MAP_FAILED) { fail(Errc::invalid_checkpoint, "{}: cannot map a rank's weight delta: {}", file.string(), std::strerror(errno)); }
        map.p = static_cast<const std::byte *>(m);
        map.n = static_cast<size_t>(size);
    }
    for (const auto & e : j["tensors"]) {
        RankDeltaTensor t;
        t.name = e.value("name", "");
        const auto dt = fd::parse_dtype(e.value("dtype", ""));
        if (!dt) { fail(Errc::invalid_checkpoint, "{}: tensor '{}' has no dtype", file.string(), t.name); }
        t.dtype = *dt;
        t.shape = e.value("shape", std::vector<int64_t>{});
        const int64_t n_runs = e.value("n_runs", int64_t{-1}), n = e.value("n", int64_t{-1}), es = model::dtype_size(t.dtype);
        const int64_t sb = e.value("start_bytes", int64_t{8});
        const int64_t table = n_runs * sb + (n_runs == n ? 0 : n_runs * 8);
        if (n_runs < 0 || n < n_runs || (sb != 4 && sb != 8) || off + table + n * es > size) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}': {} runs of {} values do not fit the file", file.string(), t.name, n_runs, n);
        }
        t.starts.resize(static_cast<size_t>(n_runs));
        if (sb == 4) {  // widened straight from the file's pages (no staging copy)
            const std::byte * src = map.at(off, n_runs * 4);
            for (int64_t k = 0; k < n_runs; ++k) {
                int32_t v;
                std::memcpy(&v, src + 4 * k, 4);
                t.starts[static_cast<size_t>(k)] = v;
            }
        } else {
            std::memcpy(t.starts.data(), map.at(off, n_runs * 8), static_cast<size_t>(n_runs * 8));
        }
        off += n_runs * sb;
        if (n_runs != n) {
            t.lens.resize(static_cast<size_t>(n_runs));
            std::memcpy(t.lens.data(), map.at(off, n_runs * 8), static_cast<size_t>(n_runs * 8));
            off += n_runs * 8;
            int64_t sum = 0;
            for (const int64_t l : t.lens) {
                if (l < 1 || l > n) { fail(Errc::invalid_checkpoint, "{}: tensor '{}': a run of {} elements", file.string(), t.name, l); }
                sum += l;
            }
            if (sum != n) { fail(Errc::invalid_checkpoint, "{}: tensor '{}': runs of {} elements for {} values", file.string(), t.name, sum, n); }
        }
        t.values.resize(static_cast<size_t>(n * es));
        std::memcpy(t.values.data(), map.at(off, n * es), static_cast<size_t>(n * es));
        off += n * es;
        d.tensors.push_back(std::move(t));
    }
    return d;
}

std::vector<model::WeightLayout> plan_rank_layouts(const model::ModelConfig & cfg, const std::filesystem::path & model_dir,
                                                   int32_t tp, int32_t ep) {
    const model::TensorIndex idx = model::read_tensor_index(model_dir);
    model::TensorIndex renamed;
    const model::TensorIndex & v4 = model::with_v4_names(cfg, idx, renamed);
    std::vector<model::WeightLayout> ls;
    for (int32_t r = 0; r < std::max(1, tp); ++r) { ls.push_back(model::plan_layout(cfg, v4, {r, std::max(1, tp), std::max(1, ep)})); }
    return ls;
}

void write_rank_shares(const std::filesystem::path & delta_file, const WeightDelta & d,
                       const std::vector<model::WeightLayout> & layouts, const std::function<void()> & alongside) {
    std::vector<std::optional<Error>> errs(layouts.size() + 1);
    auto guarded = [&](size_t i, auto && fn) {
        try {
            fn();
        } catch (const Error & e) {
            errs[i] = e;
        } catch (const std::exception & e) {
            errs[i] = Error(Errc::internal, e.what());
        }
    };
    std::vector<std::thread> ts;
    for (size_t r = 0; r < layouts.size(); ++r) {
        ts.emplace_back([&, r] {
            guarded(r, [&] { write_rank_share(rank_delta_file(delta_file, static_cast<int32_t>(r)), d, layouts[r]); });
        });
    }
    if (alongside) { guarded(layouts.size(), alongside); }
    for (auto & t : ts) { t.join(); }
    for (auto & e : errs) {
        if (e) { throw *e; }
    }
}

bool delta_name_applicable(const std::string & name, const std::vector<model::WeightLayout> & layouts) {
    if (name.find("rotary_emb.inv_freq") != std::string::npos) { return true; }
    if (!layouts.empty() && layouts[0].tied_lm_head && name == "lm_head.weight") { return true; }
    for (const auto & l : layouts) {
        for (const auto & t : l.tensors) {
            for (const auto & p : t.parts) {
                if (p.hf_name == name) { return true; }
            }
        }
    }
    return false;
}

}  // namespace fd::weights
