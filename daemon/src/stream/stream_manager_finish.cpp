// StreamManager (class: stream_manager_impl.h), an update's end and what is read of the stream:
// seal (the received tensors checked complete and indexed, or a delta update's file sealed),
// committed (the sealed dir becomes the serving stream's, the replaced one removed off the
// finish's critical path), drop, and status_json / expected / last_error for the API.
#include "stream_manager_impl.h"

#include "fd/cpus.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace fd::stream {

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
    if (version && m.update->base_version && *version == *m.update->base_version) {
        throw Error(Errc::invalid_argument,
                    fmt::format("the finish names version '{}', the delta's base: new bytes under the base's label would mislabel them; "
                                "finish with a new version (or none) or abort; the update stays open", *version), "version");
    }
    if (version && m.update->version && *version != *m.update->version) {  // never a silent relabel: the trainer meant one of them
        throw Error(Errc::invalid_argument,
                    fmt::format("the finish names version '{}' but the update was started as '{}'; finish with '{}' (or no version) or abort; "
                                "the update stays open", *version, *m.update->version, *m.update->version), "version");
    }
    if (m.update->landed) {  // the ranks hold the bytes; the engine checks that every part arrived
        m.update->sealed = true;
        if (version) { m.update->version = version; }
        return Sealed{.dir = m.update->dir->path(), .version = m.update->version, .n_tensors = static_cast<int32_t>(m.expected.size()),
                      .base_version = m.update->base_version, .base_dir = m.serving && m.update->base_version ? m.serving->path() : fs::path(),
                      .landed = true};
    }
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
                      .delta_file = f, .base_dir = m.serving ? m.serving->path() : fs::path()};
    }
    const int32_t n_from_base = 0;
    std::vector<std::string> missing;
    // A tied lm_head no rank reads (the embedding serves as the head) may be left out, as
    // RolloutModel's mapping and the landed path leave it out (a probe: 422 "missing lm_head").
    const bool tied_head = m.rank_layouts()[0].tied_lm_head;
    for (const auto & [name, t] : m.expected) {
        if (!m.update->covered.count(name) && !detail::optional_tensor(name) && !(tied_head && name == "lm_head.weight")) {
            missing.push_back(name);
        }
    }
    if (!missing.empty()) {
        // A stacked expert tensor none of whose experts arrived is named as stored (the name the
        // trainer's export uses), not as its per-expert views.
        const std::set<std::string> gone(missing.begin(), missing.end());
        std::vector<std::string> named;
        std::set<std::string> in_whole;
        for (const auto & [whole, views] : m.stacked) {
            if (std::all_of(views.begin(), views.end(), [&](const std::string & v) { return gone.count(v) > 0; })) {
                named.push_back(fmt::format("{} (or its {} per-expert tensors)", whole, views.size()));
                in_whole.insert(views.begin(), views.end());
            }
        }
        for (const auto & n : missing) {
            if (!in_whole.count(n)) { named.push_back(n); }
        }
        missing = std::move(named);
        std::string list;
        for (size_t i = 0; i < missing.size() && i < 8; ++i) { list += (i ? ", " : "") + missing[i]; }
        if (missing.size() > 8) { list += fmt::format(", ... ({} in all)", missing.size()); }
        const Error e(Errc::invalid_checkpoint, fmt::format("the update is missing {} tensor(s): {}; nothing was applied", missing.size(), list),
                      "names");
        m.drop_locked(e);
        throw e;
    }
    int64_t staged_bytes = 0;
    for (const auto & [name, file] : m.update->weight_map) {
        if (const TensorSpec * t = m.accepted(name)) { staged_bytes += t->nbytes; }
    }
    m.update->dir->write_index(m.update->weight_map, staged_bytes);
    m.update->sealed = true;
    if (version) { m.update->version = version; }
    return Sealed{.dir = m.update->dir->path(), .version = m.update->version, .bytes = m.update->bytes,
                  .n_tensors = m.n_received(), .base_version = m.update->base_version,
                  .n_delta = m.update->n_delta, .n_from_base = n_from_base};
}

std::optional<std::string> StreamManager::open_base_version() const {
    std::lock_guard lk(impl_->mu);
    return impl_->update ? impl_->update->base_version : std::nullopt;
}

void StreamManager::committed(const std::string & version, uint64_t weights_epoch) {
    std::lock_guard lk(impl_->mu);
    auto & m = *impl_;
    if (!m.update) { return; }
    m.serving_epoch = weights_epoch;
    if (m.update->landed) {  // no dir holds the new bytes: the last stream's dir is the next spare; deltas go to the ranks alone
        m.serving_version = version;
        m.serving_landed  = true;
        m.update.reset();
        m.retire(std::move(m.spare));
        m.spare_files.clear();
        if (m.serving && m.cfg.recycle_staging) {
            try {
                m.serving->move_to(staging_name(m.serving->path(), "spare"));
                m.spare_files = m.serving->bucket_files();
                m.spare       = std::move(m.serving);
            } catch (const Error & e) {
                log::get("stream")->warn("the replaced staging dir is not kept for recycling: {}", e.what());
            }
        }
        m.retire(std::move(m.serving));
        return;
    }
    if (m.update->in_place) {  // serving's dir now holds the new bytes (the engine wrote them); the delta file goes
        m.serving_version = version;
        m.update.reset();  // its delta file went into serving's dir (a pending delta)
        return;
    }
    m.update->dir->keep();
    m.serving_landed = false;
    auto old  = std::move(m.serving);  // the previous stream's dir: nothing reads it any more
    m.serving = std::move(m.update->dir);
    m.serving_version = version;
    if (m.update->recycled_bytes > 0) {
        log::get("stream")->info("weight stream committed: {} of {} B written into recycled staging pages", m.update->recycled_bytes,
                                 m.update->bytes);
    }
    m.update.reset();
    // The spare's buckets this update did not take go; the replaced dir is the next update's spare.
    m.retire(std::move(m.spare));
    m.spare_files.clear();
    if (old && !m.cfg.recycle_staging) {
        m.retire(std::move(old));
    } else if (old) {
        try {
            old->move_to(staging_name(old->path(), "spare"));  // a name apart: it no longer serves anything
            m.spare_files = old->bucket_files();
            m.spare       = std::move(old);
        } catch (const Error & e) {  // not worth failing a commit over: the next update takes fresh pages
            log::get("stream")->warn("the replaced staging dir is not kept for recycling: {}", e.what());
            m.retire(std::move(old));
        }
    }
}

int64_t StreamManager::release_spare() {
    std::unique_ptr<StagingDir> spare;
    int64_t bytes = 0;
    {
        std::lock_guard lk(impl_->mu);
        spare = std::move(impl_->spare);
        bytes = impl_->spare_bytes();
        impl_->spare_files.clear();
    }
    if (!spare) { return 0; }
    std::error_code ec;  // now, not in the background: the caller hands this memory back
    fs::remove_all(spare->path(), ec);
    if (ec) { log::get("stream")->warn("cannot remove the spare staging dir {}: {}", spare->path().string(), ec.message()); }
    log::get("stream")->info("removed the spare staging dir ({} B of recyclable pages)", bytes);
    return bytes;
}

void StreamManager::drop(const Error & why) {
    std::lock_guard lk(impl_->mu);
    impl_->drop_open_locked(why);  // a bucket (or accept) in flight drops with this reason
}

bool StreamManager::abort(const Error & why) {
    std::lock_guard lk(impl_->mu);
    auto & m = *impl_;
    // A sealed update's commit is running on the ranks (or about to): dropping it here removed
    // the dir they read and left the label untracked (a probe: the abort said "unchanged", the
    // finish committed, a later wakeup served the --model weights).
    if (m.update && m.update->sealed) {
        fail(Errc::wrong_state, "the weight update is finishing (committing on the ranks) and cannot be aborted; its "
                                "/finish_weight_update answer says whether it went live");
    }
    return m.drop_open_locked(why);  // also a start still waiting for the trainer to connect
}

void StreamManager::out_of_step(const Error & why) {
    std::lock_guard lk(impl_->mu);
    impl_->out_of_step_locked(why);
}

std::optional<Error> StreamManager::last_error() const {
    std::lock_guard lk(impl_->mu);
    return impl_->last_error;
}

bool StreamManager::serves_last_stream(const ServingNow & now) const {
    std::lock_guard lk(impl_->mu);
    return impl_->serves(now);
}

std::string StreamManager::last_stream_version() const {
    std::lock_guard lk(impl_->mu);
    return impl_->serving || impl_->serving_landed ? impl_->serving_version : std::string();
}

std::string StreamManager::status_json(const std::optional<ServingNow> & now) const {
    std::lock_guard lk(impl_->mu);
    const auto & m = *impl_;
    const bool serving = (m.serving || m.serving_landed) && (!now || m.serves(*now));  // an update from elsewhere replaced it
    using nlohmann::json;
    const auto opt = [](const std::optional<std::string> & v) { return v ? json(*v) : json(nullptr); };
    // "connecting": a start (or SGLang's first bucket) waits for the trainer to connect.
    const char * state = !m.update ? (m.busy ? "connecting" : "idle") : m.update->sealed ? "finishing" : m.busy ? "receiving" : "open";
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
           {"n_received", m.n_received()},
           {"n_expected", m.expected.size()},
           {"n_delta", m.update ? m.update->n_delta : 0},
           {"bytes_received", m.update ? m.update->bytes : 0},
           {"recycled_bytes", m.update ? m.update->recycled_bytes : 0},
           {"spare_bytes", m.spare_bytes()},
           {"deadline_in_s", deadline_in_s},
           {"timeout_s", m.backend.empty() ? json(nullptr) : json(m.timeout_s)},
           {"serving_stream_version", serving ? json(m.serving_version) : json(nullptr)},
           {"serving_landed", serving && m.serving_landed},
           {"landing", m.update && m.update->landed},
           {"stage_ahead", m.cfg.stage_ahead},
           {"last_error", m.last_error ? json(m.last_error->what()) : json(nullptr)}};
    return j.dump();
}

bool StreamManager::stage_ahead() const { return impl_->cfg.stage_ahead; }

const std::string & StreamManager::host() const { return impl_->cfg.host; }

double StreamManager::timeout_s() const {
    std::lock_guard lk(impl_->mu);
    return impl_->timeout_s > 0 ? impl_->timeout_s : impl_->cfg.timeout_s;
}

bool stage_ahead_choice(int32_t env, int32_t tp_size) {
    if (env >= 0) { return env != 0; }
    return static_cast<int64_t>(usable_cpus()) >= static_cast<int64_t>(tp_size) + 2;
}

std::map<std::string, TensorSpec> StreamManager::expected() const {
    std::lock_guard lk(impl_->mu);
    return impl_->own;
}

std::vector<ExpertView> StreamManager::expert_views() const {
    std::lock_guard lk(impl_->mu);
    std::vector<ExpertView> out;
    for (const auto & [whole, views] : impl_->stacked) {
        for (const auto & v : views) { out.push_back(ExpertView{whole, impl_->expected.at(v)}); }
    }
    return out;
}

}  // namespace fd::stream
