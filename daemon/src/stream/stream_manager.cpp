// StreamManager: the life of a weight stream (fd/stream/weight_stream.h) — one transport, at
// most one open update, a watchdog that bounds the gaps between calls. The socket and file I/O
// of a bucket run outside the lock (busy_); a drop() meanwhile shuts the socket down so that the
// bucket stops at once and drops the update itself. This file: start-up and shutdown, init (the
// transport), start and receive_bucket; an update's end and the status are in
// stream_manager_finish.cpp (class: stream_manager_impl.h).
#include "stream_manager_impl.h"

#include "fd/deadline.h"
#include "fd/kernels/ops.h"

#include <sys/socket.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

namespace fd::stream {

fd::DType parse_dtype_name(const std::string & s, const std::string & what) {
    if (const std::optional<fd::DType> d = fd::parse_dtype(s)) { return *d; }
    fail(Errc::invalid_argument, "{}: dtype '{}' is not one of F32, F16, BF16 (or torch's float32, float16, bfloat16)", what, s);
}

namespace detail {

Clock::time_point after(double s) { return deadline_after(s); }

/// Index of the first NaN/Inf among `t`'s values at `p` (any alignment), or -1.
int64_t first_nonfinite(const TensorSpec & t, const std::byte * p) {
    return stream::first_nonfinite(t.dtype, p, t.nbytes / model::dtype_size(t.dtype));
}

bool optional_tensor(const std::string & name) { return name.find("rotary_emb.inv_freq") != std::string::npos; }

}  // namespace detail

namespace {

std::string shape_text(const std::vector<int64_t> & s);

/// `s` names a tensor of the model (a name of --model's checkpoint, a stacked expert tensor as
/// stored, or one of its per-expert views) with its dtype and shape. Errors  invalid_checkpoint naming it.
void check_spec(const StreamManager::Impl & m, const TensorSpec & s) {
    const TensorSpec * e = m.accepted(s.name);
    if (!e) {
        throw Error(Errc::invalid_checkpoint, fmt::format("tensor '{}' is not a tensor of the model (its training names are "
                                                          "those of --model's checkpoint){}; nothing was applied", s.name,
                                                          m.stacked.empty() ? "" : ", its stacked experts either stacked as stored or "
                                                                                   "split per expert"), "names");
    }
    if (s.dtype != e->dtype) {
        throw Error(Errc::invalid_checkpoint, fmt::format("tensor '{}': dtype {} announced, the model holds {}; cast it before "
                                                          "sending", s.name, model::dtype_name(s.dtype), model::dtype_name(e->dtype)), "dtype_names");
    }
    if (s.shape != e->shape) {
        throw Error(Errc::invalid_checkpoint, fmt::format("tensor '{}': shape {} announced, the model's is {}", s.name,
                                                          shape_text(s.shape), shape_text(e->shape)), "shapes");
    }
}

std::string shape_text(const std::vector<int64_t> & s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) { out += (i ? ", " : "") + std::to_string(s[i]); }
    return out + "]";
}

}  // namespace

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
    for (auto * kept : {&impl_->serving, &impl_->spare}) {  // kept while it served; nothing reads it once the daemon stops
        if (!*kept) { continue; }
        std::error_code ec;
        fs::remove_all((*kept)->path(), ec);
        kept->reset();
    }
    impl_->close_transport();
}

Endpoint StreamManager::init(const InitRequest & req) {
    std::unique_lock lk(impl_->mu);
    auto & m = *impl_;
    if (m.update || m.busy) {
        fail(Errc::wrong_state, "a weight update is open ({} of {} tensors received); POST /finish_weight_update or "
                                "/abort_weight_update first", m.n_received(), m.expected.size());
    }
    if (req.timeout_s && !(*req.timeout_s > 0 && *req.timeout_s <= kMaxWaitS)) {  // fd/deadline.h
        throw Error(Errc::invalid_argument, fmt::format("timeout_s must be > 0 and <= {:g} seconds, got {:g}", kMaxWaitS, *req.timeout_s),
                    "timeout_s");
    }
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
                                     .device = m.cfg.cuda_device}, detail::after(timeout_s));
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

void StreamManager::start(std::optional<std::string> version, Clock::time_point deadline, std::optional<std::string> base_version,
                          bool land) {
    std::unique_lock lk(impl_->mu);
    auto & m = *impl_;
    if (land && m.backend != "tcp") {
        fail(Errc::wrong_state, "landing needs the tcp transport (the daemon's connection stays the trainer's liveness channel); POST "
                                "/init_weight_transfer_engine {{\"init_info\": {{\"backend\": \"tcp\"}}}} first");
    }
    if (m.backend.empty()) {
        fail(Errc::wrong_state, "no weight-stream transport{}; POST /init_weight_transfer_engine first",
             m.last_error ? fmt::format(" (the last one was closed: {})", m.last_error->what()) : "");
    }
    if (!m.update && m.busy) {
        fail(Errc::wrong_state, "another call is waiting for the trainer to connect to the stream endpoint (the update opens once it "
                                "does); connect the trainer, or POST /abort_weight_update");
    }
    if (m.update || m.busy) { fail(Errc::wrong_state, "a weight update is already open; send its tensors and POST /finish_weight_update"); }
    model::TensorIndex base;
    if (base_version && version && *version == *base_version) {  // a probe: the bytes changed and the label did not
        throw Error(Errc::invalid_argument,
                    fmt::format("version '{}' is the delta's base_version: a delta makes new bytes, name them with a new version", *version),
                    "version");
    }
    if (base_version) {
        if ((!m.serving && !m.serving_landed) || m.serving_version != *base_version) {
            throw Error(Errc::wrong_state,
                        fmt::format("base_version '{}' is not the version of the last weight stream this daemon committed ({}): a delta "
                                    "applies to streamed bytes the daemon holds; stream the full weights first", *base_version,
                                    m.serving || m.serving_landed ? "'" + m.serving_version + "'" : std::string("none since start-up")),
                        "base_version");
        }
        if (!m.serving && !version) {
            throw Error(Errc::invalid_argument, "a delta on landed weights must name its version (no file holds the bytes to be named by)",
                        "version");
        }
        if (m.serving) {
            base = model::read_tensor_index(m.serving->path());
        } else {  // landed: the ranks hold every tensor of the model
            for (const auto & [name, spec] : m.expected) { base.tensors[name].name = name; }
        }
    }
    m.last_error.reset();
    deadline = std::min(deadline, detail::after(m.timeout_s));
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
    if (base_version && !land) {  // header room: ~200 B per tensor entry; 512 reserved for each of the model's tensors
        delta_out = std::make_unique<DeltaFile>(dir->path() / "weights.fddelta", 1024 + 512 * static_cast<int64_t>(m.expected.size()));
    }
    m.update.emplace();
    m.update->dir           = std::move(dir);
    m.update->version       = std::move(version);
    m.update->idle_deadline = detail::after(m.timeout_s);
    m.update->base_version  = std::move(base_version);
    m.update->base          = std::move(base);
    m.update->delta_out     = std::move(delta_out);
    m.update->landed        = land;
}

void StreamManager::check_specs(const std::vector<TensorSpec> & specs) const {
    std::lock_guard lk(impl_->mu);
    // Without a transport nothing can arrive, and the model's tensors are not known yet: the
    // caller is told to init, not that its names are wrong (a probe: SGLang's first bucket got 422).
    if (impl_->backend.empty()) {
        fail(Errc::wrong_state, "no weight-stream transport; POST /init_weight_transfer_engine (vLLM) or /init_weights_update_group "
                                "(SGLang) first (nothing was done)");
    }
    for (const auto & s : specs) { check_spec(*impl_, s); }
}

BucketReport StreamManager::receive_bucket(const std::vector<TensorSpec> & specs, bool packed, Clock::time_point deadline) {
    const auto t0 = Clock::now();
    std::unique_lock lk(impl_->mu);
    auto & m = *impl_;
    // Refused here, the bucket's bytes are already on their way: the transport closes (out_of_step).
    auto refuse = [&](std::string why) {
        const Error e(Errc::wrong_state, why + "; the weight-stream connection was closed (the bucket's bytes would be read as the next "
                                               "one's): init the transfer again");
        m.out_of_step_locked(e);
        throw e;
    };
    if (!m.update) {
        refuse(fmt::format("no weight update is open{}; POST /start_weight_update first",
                           m.last_error ? fmt::format(" (the last one was dropped: {})", m.last_error->what()) : ""));
    }
    if (m.busy) { refuse("another bucket is being received (it stops too); send buckets one after another"); }
    if (m.update->sealed) { refuse("the update is finishing; no more tensors are taken"); }
    if (m.update->landed) {
        refuse("this update lands on the ranks (start_weight_update {\"land\": true}): send each rank its parts on its own connection, "
               "not /update_weights buckets");
    }
    std::set<std::string> in_bucket;
    std::map<std::string, std::string> bucket_covered;  // as Update::covered, for this bucket's tensors
    try {
        if (specs.empty()) { throw Error(Errc::invalid_argument, "update_info announces no tensor", "update_info"); }
        for (const auto & s : specs) {
            check_spec(m, s);
            if (m.update->weight_map.count(s.name) || !in_bucket.insert(s.name).second) {
                throw Error(Errc::invalid_argument, fmt::format("tensor '{}' was sent twice in this update", s.name), "names");
            }
            const bool is_stacked = m.stacked.count(s.name) > 0;
            if (is_stacked && m.update->base_version) {
                throw Error(Errc::invalid_argument,
                            fmt::format("tensor '{}' is a stacked expert tensor: a delta update (base_version) takes its per-expert "
                                        "names ('{}', ... as the init answer's expert_tensors list them); send them instead", s.name,
                                        m.stacked.at(s.name).front()), "names");
            }
            for (const std::string & u : m.covers(s.name)) {  // the same expert stacked and split: one of them would be lost
                const auto prev = m.update->covered.find(u);
                const auto here = bucket_covered.find(u);
                if (prev != m.update->covered.end() || here != bucket_covered.end()) {
                    const std::string & as = prev != m.update->covered.end() ? prev->second : here->second;
                    throw Error(Errc::invalid_argument, fmt::format("tensor '{}'{} was sent twice in this update: as '{}' and as '{}'", u,
                                                                    model::expert_of(u), as, s.name), "names");
                }
                bucket_covered.emplace(u, s.name);
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
    if (m.update->base_version) { return m.receive_delta_bucket(lk, specs, packed, std::min(deadline, detail::after(m.timeout_s)), t0); }
    const fs::path f        = m.update->dir->next_bucket_file();
    const fs::path recycled = m.take_spare_file();  // the replaced stream's pages, written over in place
    deadline                = std::min(deadline, detail::after(m.timeout_s));
    // A full update: every tensor lands in the bucket file as it arrives (deltas need a base_version: checked above).
    int64_t bytes = 0, recycled_bytes = 0;
    const auto err = m.outside_lock(lk, [&] {
        if (!rx) { fail(Errc::wrong_state, "no trainer is connected; POST /init_weight_transfer_engine again"); }
        BucketFile out(f, specs, recycled);
        recycled_bytes = out.recycled_bytes();
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
    m.update->covered.insert(bucket_covered.begin(), bucket_covered.end());
    m.update->bytes += bytes;
    m.update->recycled_bytes += recycled_bytes;
    m.update->idle_deadline = detail::after(m.timeout_s);
    return BucketReport{.n_tensors  = static_cast<int32_t>(specs.size()),
                        .bytes      = bytes,
                        .n_received = m.n_received(),
                        .n_expected = static_cast<int32_t>(m.expected.size()),
                        .seconds    = std::chrono::duration<double>(Clock::now() - t0).count(),
                        .file       = f};
}

}  // namespace fd::stream
