// The serving weights coming back (engine thread): a wakeup's reload of what served before the
// sleep (the checkpoint dir, a landed stream's snapshot, the ipc records and their deltas, or the
// source) under a label that names those bytes; a failed rank's degraded state and its recovery
// (every rank reloads the serving version).
#include "engine_reports.h"
#include "fd/engine/engine.h"
#include "fd/log.h"
#include "fd/weights/fingerprint.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>

namespace fd::engine {

void Engine::reload_serving_weights(ControlResult & r) {
    flush_pending_deltas();  // the dir holds what the label names before anything reads it
    if (!serving_dir_.empty()) {
        // A checkpoint dir deleted after its load (AReaL's clear_checkpoint_after_load) cannot give
        // the weights back: wake from the configured source instead, labelled by what it holds
        // (a failed wakeup would leave the weights asleep with nothing able to load them).
        std::error_code ec;
        if (!std::filesystem::exists(serving_dir_, ec) && !ec) {
            log::get("engine")->warn("wakeup: the checkpoint dir {} the weights came from is gone; loading the --load-strategy source "
                                     "instead (its label follows the bytes)", serving_dir_);
            serving_dir_.clear();
            serving_dir_owned_ = true;
            drop_pending_deltas();
        }
    }
    weights::FetchRequest req{.version = std::nullopt, .wakeup = true, .serving_version = state_.weight_version,
                              .serving_source_version = serving_source_version_};
    // Weights that were checked against their manifest's checksums are checked again when they
    // come back (a probe: a store copy damaged in place came back unchecked, under the label
    // the verified bytes had).
    req.verify_checksum = serving_verified_;
    req.weight_dir       = serving_dir_;  // weights loaded from a checkpoint dir come back from it
    req.weight_dir_owned = serving_dir_owned_;
    const bool from_snapshot = !landed_snapshot_.empty();
    if (from_snapshot) {  // landed weights come back from what each rank wrote at the sleep
        req.weight_dir       = landed_snapshot_.string();
        req.weight_dir_owned = true;
    }
    const std::optional<std::vector<weights::IpcRecordId>> ipc_before = ipc_ids_if_source(req);
    const auto reps = executor_->reload_weights(req);
    state_.weight_asleep = false;
    state_.weights_valid = true;
    if (from_snapshot) {  // the same bytes as before the sleep: the label stays; the host copy goes
        remove_landed_snapshot();
        r.bytes = reps[0].bytes;
        accumulate_rank_reports(r, reps, state_.weight_version, /*in_place=*/true);
        return;
    }
    const bool landed_lost = serving_landed_;
    forget_landed();  // reloaded from a file: landed bytes (a recovered rank's lost shard of them) serve no more
    if (cfg_.source.strategy == weights::LoadStrategy::ipc && req.weight_dir.empty() && replay_ipc_deltas(ipc_before)) {
        r.bytes = reps[0].bytes;  // the records, then the ipc deltas applied on them again: the label stays
        accumulate_rank_reports(r, reps, state_.weight_version, /*in_place=*/true);
        return;
    }
    if (!req.weight_dir.empty()) { note_ipc_load(std::nullopt); }  // not from the records: the kept ipc deltas go
    // The label must name the bytes now loaded: the serving one when they did not change, else the
    // source's version (or the serving one), unless this process saw that label on other bytes
    // (fd/weights/fingerprint.h).
    std::vector<std::string> fps;
    for (const auto & rep : reps) { fps.push_back(rep.fingerprint); }
    const std::string fp    = weights::combine_fingerprints(fps);
    const std::string asked = reps[0].version.value_or(state_.weight_version);
    const std::string label = weights::label_after_reload(known_labels_, state_.weight_version, reps[0].version, fp);
    if (label != state_.weight_version && !known_labels_.count(state_.weight_version)) {
        // No file held the serving bytes (a landed stream, or a rank recovery's lost shard of them).
        log::get("engine")->warn("wakeup: the weights served as weight_version {} were in no file (landed by a stream) and could not be "
                                 "reloaded; serving the source's weights as weight_version {} (stream them again)", state_.weight_version,
                                 label);
    } else if (label != asked && label != state_.weight_version) {
        log::get("engine")->warn("wakeup: weight_version {} named other weights than the source now holds (its files changed); "
                                 "serving them as weight_version {}", asked, label);
    }
    set_label(label, fp, /*bytes_changed=*/landed_lost || label != state_.weight_version);
    serving_source_version_ = req.weight_dir.empty() ? reps[0].version.value_or("") : "";
    r.bytes             = reps[0].bytes;
    r.checksum_verified = std::all_of(reps.begin(), reps.end(), [](const runtime::RankReport & x) { return x.checksum_verified; });
    accumulate_rank_reports(r, reps, state_.weight_version, /*in_place=*/true);
}

void Engine::set_label(const std::string & version, const std::string & fp, bool bytes_changed) {
    if (bytes_changed) { ++state_.weights_epoch; }
    state_.weight_version = version;
    if (!fp.empty()) { known_labels_[version] = fp; }
}

void Engine::set_label_unfingerprinted(const std::string & version) {
    ++state_.weights_epoch;
    known_labels_.erase(version);
    state_.weight_version = version;
    serving_source_version_.clear();  // not bytes the source names (a stream, a delta): as before, the label
}

void Engine::enter_degraded(const Error & e) {
    const bool first = !state_.degraded;
    state_.degraded     = true;
    state_.failed_ranks = executor_->failed_ranks();
    state_.paused       = true;
    degraded_.store(true);
    accepting_.store(false);
    publish_stats();  // /health says degraded before any client sees its request fail (answers go out at once)
    if (drain_ && !drain_->rank_error) { drain_->rank_error = e; }  // a pause mode=wait answers it: nothing drained
    fail_step(e);     // every request still alive ends with the rank error
    abort_all();   // (emits nothing more) frees their KV blocks
    kv_.background_done();  // forgotten: each rank waits for its own copies before its next copy or release
    kv_.flush_prefix_cache();
    publish_stats();
    if (first) { log::get("engine")->critical("degraded: rank(s) [{}] failed: {}", fmt::join(state_.failed_ranks, ", "), e.what()); }
}

void Engine::recover_ranks(ControlResult & r) {
    auto lg = log::get("engine");
    lg->warn("wakeup: recovering rank(s) [{}]", fmt::join(executor_->failed_ranks(), ", "));
    // Every rank process is replaced: whatever a two-phase update staged went with the old ones
    // (a later commit_weights is a 409 "nothing is staged", never a commit of nothing).
    if (!state_.staged_version.empty()) {
        lg->warn("wakeup: the staged version '{}' is discarded with the old rank processes", state_.staged_version);
        state_.staged_version.clear();
    }
    executor_->recover();
    state_.degraded = false;
    state_.failed_ranks.clear();
    degraded_.store(false);
    // Respawned ranks hold the --model checkpoint and survivors whatever they had: every rank
    // takes the serving version from the source again, with a fresh KV pool.
    executor_->release(runtime::MemoryTag::weight);
    state_.weight_asleep = true;
    state_.weights_valid = false;
    executor_->acquire_kv();
    reset_kv();  // respawned ranks hold no KV, host tier included
    state_.kv_asleep = false;
    reload_serving_weights(r);
    r.tags_done = {"kv_cache", "weight"};
    r.version   = state_.weight_version;
    state_.paused = false;
    lg->info("wakeup: ranks recovered, serving weight_version {}", state_.weight_version);
}

}  // namespace fd::engine
