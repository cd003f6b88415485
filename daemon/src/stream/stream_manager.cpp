// StreamManager: the life of a weight stream (fd/stream/weight_stream.h) — one transport, at
// most one open update, a watchdog that bounds the gaps between calls. The socket and file I/O
// of a bucket run outside the lock (busy_); a drop() meanwhile shuts the socket down so that the
// bucket stops at once and drops the update itself.
#include "fd/stream/weight_stream.h"

#include "stream_io.h"

#include "fd/weights/rank_delta.h"
#include "fd/weights/weight_delta.h"

#include "fd/kernels/ops.h"
#include "fd/log.h"

#include <sys/socket.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

namespace fd::stream {

namespace fs = std::filesystem;

fd::DType parse_dtype_name(const std::string & s, const std::string & what) {
    if (const std::optional<fd::DType> d = fd::parse_dtype(s)) { return *d; }
    fail(Errc::invalid_argument, "{}: dtype '{}' is not one of F32, F16, BF16 (or torch's float32, float16, bfloat16)", what, s);
}

namespace {

Clock::time_point after(double s) { return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)); }

std::string shape_text(const std::vector<int64_t> & s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) { out += (i ? ", " : "") + std::to_string(s[i]); }
    return out + "]";
}

/// Index of the first NaN/Inf among `t`'s values at `p` (any alignment), or -1.
int64_t first_nonfinite(const TensorSpec & t, const std::byte * p) {
    return stream::first_nonfinite(t.dtype, p, t.nbytes / model::dtype_size(t.dtype));
}

bool optional_tensor(const std::string & name) { return name.find("rotary_emb.inv_freq") != std::string::npos; }

}  // namespace

struct StreamManager::Impl {
    struct Update {
        std::unique_ptr<StagingDir>        dir;
        std::optional<std::string>         version;
        std::map<std::string, std::string> weight_map;     ///< name -> bucket file name
        int64_t                            bytes = 0;     ///< received on the wire
        bool                               sealed = false;
        Clock::time_point                  idle_deadline;
        std::optional<std::string>         base_version;  ///< a delta update's base
        model::TensorIndex                 base;          ///< its tensors (in serving's dir)
        int32_t                            n_delta = 0;
        std::unique_ptr<DeltaFile>         delta_out;     ///< a delta update's weights.fddelta: its tensors land there as they arrive
        nlohmann::json                     delta_entries = nlohmann::json::array();  ///< their header entries, in file order
        bool                               in_place = false;  ///< sealed as a delta file: serving's dir is updated in place
        fs::path                           delta_file;    ///< that file once sealed: every rank maps it
    };

    /// Forget the open update (its staging dir goes).
    void reset_update() noexcept { update.reset(); }

    StreamConfig cfg;
    fs::path     root;
    mutable std::mutex      mu;
    std::condition_variable cv;
    bool                    stopping = false;
    std::thread             watchdog;

    std::map<std::string, TensorSpec> expected;       ///< read from --model at the first init
    // transport
    std::string backend;                              ///< "" = none
    UniqueFd    listener;                             ///< tcp, until the trainer connected
    std::unique_ptr<Receiver> rx;                     ///< the connected trainer
    std::string token;
    double      timeout_s = 0;
    // the open update
    std::optional<Update>       update;
    bool                        busy = false;         ///< start's accept or a bucket runs outside the lock
    std::optional<Error>        abort_reason;         ///< drop() while busy: the busy call drops with it
    std::unique_ptr<StagingDir> serving;              ///< the committed stream's dir (the wakeup source, the base of deltas)
    std::thread                 remover;              ///< removes the dir a commit replaced, off the finish's critical path
    std::string                 serving_version;      ///< the label it was committed as
    std::optional<Error>        last_error;

    /// Run `fn` outside the lock with `busy` set (so no other call starts and drop() only
    /// interrupts), then relock. Returns the error `fn` threw or, taking precedence, the reason a
    /// drop() gave while it ran; nullopt when it finished cleanly.
    template <class Fn>
    std::optional<Error> outside_lock(std::unique_lock<std::mutex> & lk, Fn && fn) {
        busy = true;
        lk.unlock();
        std::optional<Error> err;
        try {
            fn();
        } catch (const Error & e) {
            err = e;
        } catch (const std::exception & e) {
            err = Error(Errc::internal, e.what());
        }
        lk.lock();
        busy = false;
        if (abort_reason) { err = *std::exchange(abort_reason, std::nullopt); }
        return err;
    }

    void close_transport() {
        if (rx) { rx->interrupt(); }
        rx.reset();
        listener.reset();
        backend.clear();
        token.clear();
    }

    /// Drop the open update and close the transport (lock held, not busy).
    void drop_locked(const Error & why) {
        if (update) {
            log::get("stream")->warn("weight stream dropped ({} of {} tensors received, serving weights unchanged): {}",
                                     update->weight_map.size(), expected.size(), why.what());
        }
        reset_update();  // removes the staging dir
        close_transport();
        last_error = why;
    }

    void watch() {
        std::unique_lock lk(mu);
        while (!stopping) {
            cv.wait_for(lk, std::chrono::milliseconds(50));
            if (stopping || busy) { continue; }
            if (update && !update->sealed && Clock::now() > update->idle_deadline) {
                drop_locked(Error(Errc::timeout, fmt::format("the trainer sent nothing for {:g} s (the stream timeout) while an update "
                                                             "was open", timeout_s)));
            } else if (rx && rx->peer_closed()) {
                if (update && !update->sealed) {
                    drop_locked(Error(Errc::source_unavailable, "the trainer closed its weight-stream connection in the middle of an update"));
                } else {
                    log::get("stream")->info("the trainer closed its weight-stream connection");
                    close_transport();
                }
            }
        }
    }

    /// A bucket of a delta update (lock held, specs checked): its tensors, delta or full, are
    /// received into bucket_buf, checked there (indices sorted, unique, in range; values finite)
    /// and appended to the update's delta file as they came (the wire bytes are the file's);
    /// nothing is copied from the base, nothing widened.
    BucketReport receive_delta_bucket(std::unique_lock<std::mutex> & lk, const std::vector<TensorSpec> & specs, bool packed,
                                      Clock::time_point deadline, Clock::time_point t0) {
        Receiver * r  = rx.get();
        DeltaFile * f = update->delta_out.get();
        std::vector<int64_t> offs(specs.size());
        int64_t total = 0;
        for (size_t i = 0; i < specs.size(); ++i) {
            offs[i] = total;
            total += specs[i].nbytes;
        }
        int32_t n_sparse = 0;
        double socket_s = 0, check_s = 0;
        const auto err = outside_lock(lk, [&] {
            if (!r) { fail(Errc::wrong_state, "no trainer is connected; POST /init_weight_transfer_engine again"); }
            if (static_cast<int64_t>(bucket_buf.size()) < total) { bucket_buf.resize(static_cast<size_t>(total)); }  // grown, never shrunk
            std::byte * base = bucket_buf.data();
            const auto ts = Clock::now();
            r->receive(specs, packed, [&](size_t i, int64_t off, const std::byte * p, size_t n) { std::memcpy(base + offs[i] + off, p, n); },
                       deadline);
            const auto tc = Clock::now();
            socket_s = std::chrono::duration<double>(tc - ts).count();
            for (size_t i = 0; i < specs.size(); ++i) {
                const TensorSpec & s = specs[i];
                if (s.is_delta()) {
                    ++n_sparse;
                    check_delta_bytes(s, base + offs[i]);  // throws naming the tensor and position
                } else if (const int64_t bad = first_nonfinite(s, base + offs[i]); bad >= 0) {
                    fail(Errc::invalid_checkpoint, "tensor '{}' holds a non-finite value (NaN or Inf) at element {}; nothing was applied",
                         s.name, bad);
                }
            }
            check_s = std::chrono::duration<double>(Clock::now() - tc).count();
            f->append(base, total);
        });
        if (err) {
            drop_locked(*err);
            throw *err;
        }
        for (const auto & s : specs) {
            update->weight_map[s.name] = "";  // received (in the delta file, not in a bucket file)
            update->delta_entries.push_back({{"name", s.name}, {"dtype", model::dtype_name(s.dtype)}, {"shape", s.shape}, {"dense", !s.is_delta()},
                                             {"n", s.is_delta() ? s.n_indices : s.numel()}, {"index_bytes", s.is_delta() ? s.index_bytes : 4}});
        }
        update->bytes += total;
        update->n_delta += n_sparse;
        update->idle_deadline = after(timeout_s);
        const double total_s = std::chrono::duration<double>(Clock::now() - t0).count();
        log::get("stream")->info("delta bucket: {} tensor(s), {} B in {:.3f} s (socket {:.3f} s, check {:.3f} s, file {:.3f} s)", specs.size(),
                                 total, total_s, socket_s, check_s, total_s - socket_s - check_s);
        return BucketReport{.n_tensors  = static_cast<int32_t>(specs.size()),
                            .bytes      = total,
                            .n_received = static_cast<int32_t>(update->weight_map.size()),
                            .n_expected = static_cast<int32_t>(expected.size()),
                            .seconds    = total_s};
    }

    /// The last delta buckets' bytes (the largest one's size, reused: no fresh pages per bucket).
    std::vector<std::byte> bucket_buf;

    /// Every rank's layout plan (as its Worker plans it: --model's index, v4 names), planned at
    /// the first delta, and the HF names some rank reads. Called with busy set.
    std::vector<model::WeightLayout> layouts;
    std::set<std::string>            layout_names;
    const std::vector<model::WeightLayout> & rank_layouts() {
        if (layouts.empty()) {
            layouts = weights::plan_rank_layouts(cfg.model_cfg, cfg.model_dir, cfg.tp_size, cfg.ep_size);
            for (const auto & l : layouts) {
                for (const auto & t : l.tensors) {
                    for (const auto & p : t.parts) { layout_names.insert(p.hf_name); }
                }
            }
        }
        return layouts;
    }

    /// Seal a delta update's file (weights.fddelta: its tensors are in it, the header goes in
    /// its room), the one file every rank maps and splits with its own layout at the commit
    /// (RankOp::apply_hf_delta) and the serving dir takes later as a pending delta. Called with busy set.
    /// Errors  invalid_argument naming a tensor no rank reads under its name (it could not be
    ///         applied in place); the write's error.
    void seal_delta_file() {
        const auto & ls = rank_layouts();
        for (const auto & e : update->delta_entries) {
            const std::string name = e["name"].get<std::string>();
            if (!layout_names.count(name) && !optional_tensor(name) && !(ls[0].tied_lm_head && name == "lm_head.weight")) {
                throw Error(Errc::invalid_argument, fmt::format("tensor '{}': no rank holds it under this name, so a delta update cannot "
                                                                "write it in place; stream the full weights", name), "names");
            }
        }
        update->delta_out->seal(nlohmann::json{{"tensors", update->delta_entries}}.dump());
    }

    void load_expected() {
        if (!expected.empty()) { return; }
        const auto idx = model::read_tensor_index(cfg.model_dir);
        for (const auto & [name, t] : idx.tensors) { expected[name] = TensorSpec{name, t.dtype, t.shape, t.size_bytes}; }
    }
};

StreamManager::StreamManager(StreamConfig cfg) : impl_(std::make_unique<Impl>()) {
    impl_->cfg  = std::move(cfg);
    impl_->root = staging_root(impl_->cfg.staging_root);
    remove_stale_dirs(impl_->root, impl_->cfg.port);
    impl_->watchdog = std::thread([this] { impl_->watch(); });
}

StreamManager::~StreamManager() {
    {
        std::lock_guard lk(impl_->mu);
        impl_->stopping = true;
        if (impl_->rx) { impl_->rx->interrupt(); }
    }
    impl_->cv.notify_all();
    impl_->watchdog.join();
    if (impl_->remover.joinable()) { impl_->remover.join(); }
    std::lock_guard lk(impl_->mu);
    impl_->reset_update();
    if (impl_->serving) {  // kept while it served; nothing reads it once the daemon stops
        std::error_code ec;
        fs::remove_all(impl_->serving->path(), ec);
        impl_->serving.reset();
    }
    impl_->close_transport();
}

Endpoint StreamManager::init(const InitRequest & req) {
    std::unique_lock lk(impl_->mu);
    auto & m = *impl_;
    if (m.update || m.busy) {
        fail(Errc::wrong_state, "a weight update is open ({} of {} tensors received); POST /finish_weight_update or "
                                "/abort_weight_update first", m.update ? m.update->weight_map.size() : 0, m.expected.size());
    }
    if (req.timeout_s && !(*req.timeout_s > 0)) { throw Error(Errc::invalid_argument, "timeout_s must be > 0 seconds", "timeout_s"); }
    if (m.cfg.nnodes > 1) {
        fail(Errc::wrong_state, "weight streams need every rank on this host: this daemon's ranks span --nnodes {} hosts, whose ranks "
                                "could not read the staged tensors; update them from a checkpoint instead (POST /v1/update_weights)",
             m.cfg.nnodes);
    }
    if (req.backend != "tcp" && req.backend != "nccl") {
        throw Error(Errc::invalid_argument, fmt::format("unknown weight-stream backend '{}' (tcp, nccl)", req.backend), "backend");
    }
    if (req.backend == "nccl" && req.nccl_unique_id.empty()) {
        throw Error(Errc::invalid_argument, "the nccl backend needs init_info.nccl_unique_id: the 256 hex digits of the ncclUniqueId the "
                                            "trainer (rank 0) created; the rendezvous uses no TCP store", "nccl_unique_id");
    }
    m.load_expected();
    m.close_transport();
    m.last_error.reset();
    const double timeout_s = req.timeout_s.value_or(m.cfg.timeout_s);
    if (req.backend == "nccl") {  // the rendezvous is the group's init: the trainer joins it now
        std::unique_ptr<Receiver> rx;
        const auto err = m.outside_lock(lk, [&] {
            rx = make_nccl_receiver({.unique_id_hex = req.nccl_unique_id, .rank = req.rank_offset, .world_size = req.world_size,
                                     .device = m.cfg.cuda_device}, after(timeout_s));
        });
        if (err) {
            m.last_error = err;
            throw *err;
        }
        m.rx        = std::move(rx);
        m.backend   = "nccl";
        m.timeout_s = timeout_s;
        return Endpoint{.backend = "nccl", .timeout_s = timeout_s};
    }
    Endpoint ep{.backend = "tcp", .host = m.cfg.host, .token = random_token(), .timeout_s = timeout_s};
    m.listener  = tcp_listen(m.cfg.host, &ep.port);
    m.token     = ep.token;
    m.backend   = "tcp";
    m.timeout_s = ep.timeout_s;
    log::get("stream")->info("weight stream: listening on {}:{} (timeout {:g} s)", ep.host, ep.port, ep.timeout_s);
    return ep;
}

void StreamManager::start(std::optional<std::string> version, Clock::time_point deadline, std::optional<std::string> base_version) {
    std::unique_lock lk(impl_->mu);
    auto & m = *impl_;
    if (m.backend.empty()) {
        fail(Errc::wrong_state, "no weight-stream transport{}; POST /init_weight_transfer_engine first",
             m.last_error ? fmt::format(" (the last one was closed: {})", m.last_error->what()) : "");
    }
    if (m.update || m.busy) { fail(Errc::wrong_state, "a weight update is already open; send its tensors and POST /finish_weight_update"); }
    model::TensorIndex base;
    if (base_version) {
        if (!m.serving || m.serving_version != *base_version) {
            throw Error(Errc::wrong_state,
                        fmt::format("base_version '{}' is not the version of the last weight stream this daemon committed ({}): a delta "
                                    "applies to streamed bytes the daemon holds; stream the full weights first", *base_version,
                                    m.serving ? "'" + m.serving_version + "'" : "none since start-up"), "base_version");
        }
        base = model::read_tensor_index(m.serving->path());
    }
    m.last_error.reset();
    deadline = std::min(deadline, after(m.timeout_s));
    if (!m.rx) {
        const int listener = m.listener.get();
        const std::string token = m.token;
        UniqueFd c;
        const auto err = m.outside_lock(lk, [&] { c = tcp_accept_trainer(listener, token, deadline); });
        if (err) {
            m.drop_locked(*err);
            throw *err;
        }
        m.rx = make_tcp_receiver(std::move(c));
        m.listener.reset();  // one trainer per transport
    }
    auto dir = std::make_unique<StagingDir>(m.root, m.cfg.port);
    std::unique_ptr<DeltaFile> delta_out;  // a delta update's tensors land in its weights.fddelta as they arrive
    if (base_version) {  // header room: ~200 B per tensor entry; 512 reserved for each of the model's tensors
        delta_out = std::make_unique<DeltaFile>(dir->path() / "weights.fddelta", 1024 + 512 * static_cast<int64_t>(m.expected.size()));
    }
    m.update.emplace();
    m.update->dir           = std::move(dir);
    m.update->version       = std::move(version);
    m.update->idle_deadline = after(m.timeout_s);
    m.update->base_version  = std::move(base_version);
    m.update->base          = std::move(base);
    m.update->delta_out     = std::move(delta_out);
}

BucketReport StreamManager::receive_bucket(const std::vector<TensorSpec> & specs, bool packed, Clock::time_point deadline) {
    const auto t0 = Clock::now();
    std::unique_lock lk(impl_->mu);
    auto & m = *impl_;
    if (!m.update) {
        fail(Errc::wrong_state, "no weight update is open{}; POST /start_weight_update first",
             m.last_error ? fmt::format(" (the last one was dropped: {})", m.last_error->what()) : "");
    }
    if (m.busy) { fail(Errc::wrong_state, "another bucket is being received; send buckets one after another"); }
    if (m.update->sealed) { fail(Errc::wrong_state, "the update is finishing; no more tensors are taken"); }
    std::set<std::string> in_bucket;
    try {
        if (specs.empty()) { throw Error(Errc::invalid_argument, "update_info announces no tensor", "update_info"); }
        for (const auto & s : specs) {
            auto it = m.expected.find(s.name);
            if (it == m.expected.end()) {
                throw Error(Errc::invalid_checkpoint, fmt::format("tensor '{}' is not a tensor of the model (its training names are "
                                                                  "those of --model's checkpoint); nothing was applied", s.name), "names");
            }
            const TensorSpec & e = it->second;
            if (s.dtype != e.dtype) {
                throw Error(Errc::invalid_checkpoint, fmt::format("tensor '{}': dtype {} announced, the model holds {}; cast it before "
                                                                  "sending", s.name, model::dtype_name(s.dtype), model::dtype_name(e.dtype)), "dtype_names");
            }
            if (s.shape != e.shape) {
                throw Error(Errc::invalid_checkpoint, fmt::format("tensor '{}': shape {} announced, the model's is {}", s.name,
                                                                  shape_text(s.shape), shape_text(e.shape)), "shapes");
            }
            if (m.update->weight_map.count(s.name) || !in_bucket.insert(s.name).second) {
                throw Error(Errc::invalid_argument, fmt::format("tensor '{}' was sent twice in this update", s.name), "names");
            }
            if (s.is_delta()) {
                if (!m.update->base_version) {
                    throw Error(Errc::invalid_argument, fmt::format("tensor '{}' is a delta but the update has no base_version; start it with "
                                                                    "{{\"base_version\": ...}} or send the tensor in full", s.name), "deltas");
                }
                if (!m.update->base.tensors.count(s.name)) {
                    throw Error(Errc::invalid_argument, fmt::format("tensor '{}' is a delta but base version '{}' does not hold it; send it "
                                                                    "in full", s.name, *m.update->base_version), "deltas");
                }
                if (s.n_indices > s.numel() || (s.index_bytes != 4 && s.index_bytes != 8) ||
                    s.nbytes != s.n_indices * (s.index_bytes + model::dtype_size(s.dtype))) {
                    throw Error(Errc::invalid_argument, fmt::format("tensor '{}': a delta of {} elements ({}-byte indices) into {} elements",
                                                                    s.name, s.n_indices, s.index_bytes, s.numel()), "deltas");
                }
            }
        }
    } catch (const Error & e) {
        m.drop_locked(e);
        throw;
    }
    Receiver * rx     = m.rx.get();  // not reset while busy (drop() only interrupts it)
    if (m.update->base_version) { return m.receive_delta_bucket(lk, specs, packed, std::min(deadline, after(m.timeout_s)), t0); }
    const fs::path f  = m.update->dir->next_bucket_file();
    deadline          = std::min(deadline, after(m.timeout_s));
    // A full update: every tensor lands in the bucket file as it arrives (deltas need a base_version: checked above).
    int64_t bytes = 0;
    const auto err = m.outside_lock(lk, [&] {
        if (!rx) { fail(Errc::wrong_state, "no trainer is connected; POST /init_weight_transfer_engine again"); }
        BucketFile out(f, specs);
        // Each piece is checked and written while it is in cache (kPieceBytes), straight from the socket's copy.
        rx->receive(specs, packed, [&](size_t i, int64_t off, const std::byte * p, size_t n) {
            const TensorSpec & s = specs[i];
            const int64_t es     = model::dtype_size(s.dtype);
            if (const int64_t bad = stream::first_nonfinite(s.dtype, p, static_cast<int64_t>(n) / es); bad >= 0) {
                fail(Errc::invalid_checkpoint, "tensor '{}' holds a non-finite value (NaN or Inf) at element {}; nothing was applied",
                     s.name, off / es + bad);
            }
            out.write(i, off, p, n);
        }, deadline);
        for (const auto & s : specs) { bytes += s.nbytes; }
    });
    if (err) {
        m.drop_locked(*err);
        throw *err;
    }
    for (const auto & s : specs) { m.update->weight_map[s.name] = f.filename().string(); }
    m.update->bytes += bytes;
    m.update->idle_deadline = after(m.timeout_s);
    return BucketReport{.n_tensors  = static_cast<int32_t>(specs.size()),
                        .bytes      = bytes,
                        .n_received = static_cast<int32_t>(m.update->weight_map.size()),
                        .n_expected = static_cast<int32_t>(m.expected.size()),
                        .seconds    = std::chrono::duration<double>(Clock::now() - t0).count()};
}

Sealed StreamManager::seal(std::optional<std::string> version) {
    std::unique_lock lk(impl_->mu);
    auto & m = *impl_;
    if (!m.update) {
        if (m.last_error) {
            throw Error(m.last_error->code(), fmt::format("the weight update was dropped, nothing was applied: {}", m.last_error->what()));
        }
        fail(Errc::wrong_state, "no weight update is open; POST /start_weight_update first");
    }
    if (m.busy) { fail(Errc::wrong_state, "a bucket is still being received; finish after its /update_weights answered"); }
    if (m.update->sealed) { fail(Errc::wrong_state, "the update is already finishing"); }
    if (m.update->base_version) {  // a delta update: its tensors go in place; every other keeps the base's bytes
        const fs::path f = m.update->delta_out->path();
        const auto t0  = Clock::now();
        const auto err = m.outside_lock(lk, [&] { m.seal_delta_file(); });
        m.update->delta_file = f;
        log::get("stream")->info("delta update sealed: {} tensor(s), {} B in {} for {} rank(s) in {:.3f} s", m.update->delta_entries.size(),
                                 m.update->bytes, f.string(), m.layouts.size(), std::chrono::duration<double>(Clock::now() - t0).count());
        if (err) {
            m.drop_locked(*err);
            throw *err;
        }
        m.update->sealed   = true;
        m.update->in_place = true;
        if (version) { m.update->version = version; }
        const int32_t n_sent = static_cast<int32_t>(m.update->weight_map.size());
        return Sealed{.dir = m.update->dir->path(), .version = m.update->version, .bytes = m.update->bytes,
                      .n_tensors = static_cast<int32_t>(m.expected.size()), .base_version = m.update->base_version,
                      .n_delta = m.update->n_delta, .n_from_base = static_cast<int32_t>(m.expected.size()) - n_sent,
                      .delta_file = f, .base_dir = m.serving->path()};
    }
    const int32_t n_from_base = 0;
    std::vector<std::string> missing;
    for (const auto & [name, t] : m.expected) {
        if (!m.update->weight_map.count(name) && !optional_tensor(name)) { missing.push_back(name); }
    }
    if (!missing.empty()) {
        std::string list;
        for (size_t i = 0; i < missing.size() && i < 8; ++i) { list += (i ? ", " : "") + missing[i]; }
        if (missing.size() > 8) { list += fmt::format(", ... ({} in all)", missing.size()); }
        const Error e(Errc::invalid_checkpoint, fmt::format("the update is missing {} tensor(s): {}; nothing was applied", missing.size(), list),
                      "names");
        m.drop_locked(e);
        throw e;
    }
    int64_t staged_bytes = 0;
    for (const auto & [name, file] : m.update->weight_map) { staged_bytes += m.expected.count(name) ? m.expected.at(name).nbytes : 0; }
    m.update->dir->write_index(m.update->weight_map, staged_bytes);
    m.update->sealed = true;
    if (version) { m.update->version = version; }
    return Sealed{.dir = m.update->dir->path(), .version = m.update->version, .bytes = m.update->bytes,
                  .n_tensors = static_cast<int32_t>(m.update->weight_map.size()), .base_version = m.update->base_version,
                  .n_delta = m.update->n_delta, .n_from_base = n_from_base};
}

std::optional<std::string> StreamManager::open_base_version() const {
    std::lock_guard lk(impl_->mu);
    return impl_->update ? impl_->update->base_version : std::nullopt;
}

void StreamManager::committed(const std::string & version) {
    std::lock_guard lk(impl_->mu);
    auto & m = *impl_;
    if (!m.update) { return; }
    if (m.update->in_place) {  // serving's dir now holds the new bytes (the engine wrote them); the delta file goes
        m.serving_version = version;
        m.update.reset();  // its delta file went into serving's dir (a pending delta)
        return;
    }
    m.update->dir->keep();
    auto old  = std::move(m.serving);  // the previous stream's dir: nothing reads it any more
    m.serving = std::move(m.update->dir);
    m.serving_version = version;
    m.update.reset();
    if (old) {
        // Freeing a model's worth of tmpfs pages takes ~15 ms per 100 MB: renamed out of the
        // staging dirs' names at once (atomic), removed by a thread after the finish answered.
        const fs::path doomed = retired_name(old->path());
        std::error_code ec;
        fs::rename(old->path(), doomed, ec);
        const fs::path gone = ec ? old->path() : doomed;
        if (m.remover.joinable()) { m.remover.join(); }  // the previous commit's: long done
        m.remover = std::thread([gone] {
            std::error_code rm;
            fs::remove_all(gone, rm);
            if (rm) { log::get("stream")->warn("cannot remove the replaced staging dir {}: {}", gone.string(), rm.message()); }
        });
    }
}

void StreamManager::drop(const Error & why) {
    std::lock_guard lk(impl_->mu);
    auto & m = *impl_;
    if (m.busy) {  // the bucket (or accept) in flight sees its socket shut and drops with this reason
        m.abort_reason = why;
        if (m.rx) { m.rx->interrupt(); }
        if (m.listener.valid()) { ::shutdown(m.listener.get(), SHUT_RDWR); }  // wakes an accept (closed after it returns)
        return;
    }
    if (!m.update) { return; }
    m.drop_locked(why);
}

std::optional<Error> StreamManager::last_error() const {
    std::lock_guard lk(impl_->mu);
    return impl_->last_error;
}

std::string StreamManager::status_json() const {
    std::lock_guard lk(impl_->mu);
    const auto & m = *impl_;
    using nlohmann::json;
    const auto opt = [](const std::optional<std::string> & v) { return v ? json(*v) : json(nullptr); };
    const char * state = !m.update ? "idle" : m.update->sealed ? "finishing" : m.busy ? "receiving" : "open";
    json deadline_in_s = nullptr;
    if (m.update && !m.update->sealed) {
        deadline_in_s = std::max(0.0, std::chrono::duration<double>(m.update->idle_deadline - Clock::now()).count());
    }
    json j{{"state", state},
           {"transport", m.backend.empty() ? json(nullptr) : json(m.backend)},
           {"connected", m.rx != nullptr},
           {"update_open", m.update.has_value()},
           {"version", m.update ? opt(m.update->version) : json(nullptr)},
           {"base_version", m.update ? opt(m.update->base_version) : json(nullptr)},
           {"n_received", m.update ? m.update->weight_map.size() : 0},
           {"n_expected", m.expected.size()},
           {"n_delta", m.update ? m.update->n_delta : 0},
           {"bytes_received", m.update ? m.update->bytes : 0},
           {"deadline_in_s", deadline_in_s},
           {"timeout_s", m.backend.empty() ? json(nullptr) : json(m.timeout_s)},
           {"serving_stream_version", m.serving ? json(m.serving_version) : json(nullptr)},
           {"last_error", m.last_error ? json(m.last_error->what()) : json(nullptr)}};
    return j.dump();
}

std::map<std::string, TensorSpec> StreamManager::expected() const {
    std::lock_guard lk(impl_->mu);
    return impl_->expected;
}

}  // namespace fd::stream
