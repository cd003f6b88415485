// stream_manager_impl.h — the StreamManager::Impl struct (internal to src/stream/stream_manager*.cpp):
// the state of a weight stream (its transport, the open update, the serving stream's dir) and the
// delta update's receive and seal, which run on it.
//
// stream_manager.cpp: the manager's start-up and shutdown, init (the transport), start and
// receive_bucket (an update arriving). stream_manager_finish.cpp: seal, committed and drop (an
// update's end) and what is read of the stream (status_json, expected, last_error).
// Public contract: fd/stream/weight_stream.h.
#pragma once

#include "fd/stream/weight_stream.h"

#include "stream_io.h"

#include "fd/checkpoint/layout.h"
#include "fd/checkpoint/stored_names.h"
#include "fd/weights/rank_delta.h"
#include "fd/weights/weight_delta.h"

#include "fd/log.h"

#include <sys/socket.h>

#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace fd::stream {

namespace fs = std::filesystem;

namespace detail {

/// The time point `s` seconds from now.
Clock::time_point after(double s);

/// Index of the first NaN/Inf among `t`'s values at `p` (any alignment), or -1.
int64_t first_nonfinite(const TensorSpec & t, const std::byte * p);

/// True for a tensor an update may leave out (rotary_emb.inv_freq: derived from the config).
bool optional_tensor(const std::string & name);

}  // namespace detail

struct StreamManager::Impl {
    struct Update {
        std::unique_ptr<StagingDir>        dir;
        std::optional<std::string>         version;
        std::map<std::string, std::string> weight_map;     ///< name -> bucket file name (a stacked expert tensor under its stacked name)
        /// Each tensor of `expected` received so far -> the name it came under (itself, or the
        /// stacked expert tensor holding it): the completeness check and the duplicates' check.
        std::map<std::string, std::string> covered;
        int64_t                            bytes = 0;     ///< received on the wire
        bool                               sealed = false;
        Clock::time_point                  idle_deadline;
        std::optional<std::string>         base_version;  ///< a delta update's base
        model::TensorIndex                 base;          ///< its tensors (in serving's dir)
        int32_t                            n_delta = 0;
        std::unique_ptr<DeltaFile>         delta_out;     ///< a delta update's weights.fddelta: its tensors land there as they arrive
        nlohmann::json                     delta_entries = nlohmann::json::array();  ///< their header entries, in file order
        bool                               in_place = false;  ///< sealed as a delta file: serving's dir is updated in place
        fs::path                           delta_file;    ///< that file once sealed: every rank reads it
        int64_t                            recycled_bytes = 0;  ///< bucket bytes written into the spare's pages
        bool                               landed = false;  ///< the trainer lands the tensors on the ranks (no buckets here)
    };

    /// Forget the open update (its staging dir goes).
    void reset_update() noexcept { update.reset(); }

    StreamConfig cfg;
    fs::path     root;
    mutable std::mutex      mu;
    std::condition_variable cv;
    bool                    stopping = false;
    std::thread             watchdog;

    /// Read from --model at the first init: every tensor a full update must cover, with each
    /// stacked expert tensor as its per-expert views (read_tensor_index's names).
    std::map<std::string, TensorSpec> expected;
    std::map<std::string, TensorSpec> own;            ///< --model's tensors under its own names, stacked ones as stored (init lists these)
    /// Each stacked expert tensor of `own` -> the per-expert names of `expected` it holds (file order).
    std::map<std::string, std::vector<std::string>> stacked;

    /// The spec of a name a stream may carry (a name of `expected` or of `own`), or nullptr.
    const TensorSpec * accepted(const std::string & name) const {
        if (auto it = expected.find(name); it != expected.end()) { return &it->second; }
        if (auto it = own.find(name); it != own.end()) { return &it->second; }
        return nullptr;
    }

    /// The tensors of `expected` that a tensor sent as `name` (an accepted name) covers.
    std::vector<std::string> covers(const std::string & name) const {
        if (auto it = stacked.find(name); it != stacked.end()) { return it->second; }
        return {name};
    }

    /// Tensors of the open update received so far, counted as `expected` counts them.
    int32_t n_received() const { return update ? static_cast<int32_t>(update->covered.size()) : 0; }
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
    std::thread                 remover;              ///< removes a retired dir, off the finish's critical path
    /// The dir the last full commit replaced: nothing reads it; the next full update takes its
    /// bucket files one per bucket, in order, and writes over their pages (no fresh tmpfs pages).
    std::unique_ptr<StagingDir> spare;
    std::vector<std::pair<fs::path, int64_t>> spare_files;  ///< its bucket files not taken yet, with their bytes

    /// The bytes the spare's files not taken yet hold (/health spare_bytes). Lock held.
    int64_t spare_bytes() const {
        int64_t n = 0;
        for (const auto & f : spare_files) { n += f.second; }
        return n;
    }

    /// The next spare bucket file (lock held), or an empty path when none is left.
    fs::path take_spare_file() {
        if (spare_files.empty()) { return {}; }
        fs::path f = std::move(spare_files.front().first);
        spare_files.erase(spare_files.begin());
        return f;
    }

    /// Remove `dir` (and everything in it) off the caller's critical path: renamed out of the
    /// staging dirs' names at once (atomic), removed by the remover thread (freeing a model's
    /// worth of tmpfs pages takes ~15 ms per 100 MB). Lock held.
    void retire(std::unique_ptr<StagingDir> dir) {
        if (!dir) { return; }
        const fs::path doomed = staging_name(dir->path(), "retired");
        std::error_code ec;
        fs::rename(dir->path(), doomed, ec);
        const fs::path gone = ec ? dir->path() : doomed;
        dir->keep();  // removed below, not by its destructor
        if (remover.joinable()) { remover.join(); }  // the previous one's: long done
        remover = std::thread([gone] {
            std::error_code rm;
            fs::remove_all(gone, rm);
            if (rm) { log::get("stream")->warn("cannot remove the replaced staging dir {}: {}", gone.string(), rm.message()); }
        });
    }
    std::string                 serving_version;      ///< the label it was committed as
    /// The last full update was landed on the ranks (no serving dir): a delta on serving_version
    /// is applied on the ranks alone (the engine's landed weights; their snapshot at a sleep).
    bool                        serving_landed = false;

    uint64_t                    serving_epoch = 0;    ///< the engine's weights_epoch after its commit
    /// The ranks serve the last committed stream's bytes (StreamManager::serves_last_stream).
    bool serves(const ServingNow & now) const {
        return (serving || serving_landed) && now.weight_version == serving_version && now.weights_epoch == serving_epoch;
    }
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
                                     update->covered.size(), expected.size(), why.what());
        }
        reset_update();  // removes the staging dir
        close_transport();
        last_error = why;
    }

    /// The call running outside the lock (a bucket, start's accept, a delta seal) stops with
    /// `why`: its socket is shut, and it drops the update when it relocks. Lock held, busy.
    void stop_busy(const Error & why) {
        abort_reason = why;
        if (rx) { rx->interrupt(); }
        if (listener.valid()) { ::shutdown(listener.get(), SHUT_RDWR); }  // wakes an accept (closed after it returns)
    }

    /// Drop what is open (lock held): the call running outside the lock stops with `why` (and
    /// drops the update when it relocks), else the open update drops. False when neither was.
    bool drop_open_locked(const Error & why) {
        if (busy) {
            stop_busy(why);
            return true;
        }
        if (!update) { return false; }
        drop_locked(why);
        return true;
    }

    /// StreamManager::out_of_step, lock held.
    void out_of_step_locked(const Error & why) {
        if (busy) { return stop_busy(why); }
        if (update && !update->sealed) {
            drop_locked(why);
            return;
        }
        if (rx || listener.valid()) {
            log::get("stream")->warn("weight-stream connection closed (a refused bucket's bytes would be read as the next one's): {}", why.what());
        }
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
                } else if (const int64_t bad = detail::first_nonfinite(s, base + offs[i]); bad >= 0) {
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
            update->covered[s.name]    = s.name;  // never a stacked name: receive_bucket refuses those in a delta
            update->delta_entries.push_back({{"name", s.name}, {"dtype", model::dtype_name(s.dtype)}, {"shape", s.shape}, {"dense", !s.is_delta()},
                                             {"n", s.is_delta() ? s.n_indices : s.numel()}, {"index_bytes", s.is_delta() ? s.index_bytes : 4}});
        }
        update->bytes += total;
        update->n_delta += n_sparse;
        update->idle_deadline = detail::after(timeout_s);
        const double total_s = std::chrono::duration<double>(Clock::now() - t0).count();
        log::get("stream")->info("delta bucket: {} tensor(s), {} B in {:.3f} s (socket {:.3f} s, check {:.3f} s, file {:.3f} s)", specs.size(),
                                 total, total_s, socket_s, check_s, total_s - socket_s - check_s);
        return BucketReport{.n_tensors  = static_cast<int32_t>(specs.size()),
                            .bytes      = total,
                            .n_received = n_received(),
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
            if (!layout_names.count(name) && !detail::optional_tensor(name) && !(ls[0].tied_lm_head && name == "lm_head.weight")) {
                throw Error(Errc::invalid_argument, fmt::format("tensor '{}': no rank holds it under this name, so a delta update cannot "
                                                                "write it in place; stream the full weights", name), "names");
            }
        }
        update->delta_out->seal(nlohmann::json{{"tensors", update->delta_entries}}.dump());
    }

    void load_expected() {
        if (!expected.empty()) { return; }
        const model::TensorIndex stored = model::read_tensor_index_as_stored(cfg.model_dir);
        model::TensorIndex idx = stored;
        model::split_stacked_experts(idx);  // as read_tensor_index (and the ranks' loader) splits them
        for (const auto & [name, t] : idx.tensors) { expected[name] = TensorSpec{name, t.dtype, t.shape, t.size_bytes}; }
        for (const auto & [name, t] : stored.tensors) { own[name] = TensorSpec{name, t.dtype, t.shape, t.size_bytes}; }
        stacked = model::stacked_expert_views(stored);
    }
};

}  // namespace fd::stream
