// The engine's weight-control operations (SPEC §3, §4), run on the engine thread between steps.
// Each checks every precondition before changing anything, so a rejected command is a no-op.
#include "fd/arena.h"
#include "fd/engine/engine.h"
#include "engine_reports.h"
#include "fd/log.h"
#include "fd/progress.h"
#include "fd/weights/fingerprint.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>
#include <utility>

namespace fd::engine {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

/// Fold one rank call's reports into r.ranks: the one place a control result's per-rank entries
/// are built (one entry per rank, in order of first mention). Freed bytes and durations add up
/// over the command's calls, the RSS is the last one reported, `label` (when given) is the weight
/// version the rank serves or staged after this call. `in_place`: the call copied straight into
/// the serving weights (a wakeup's reload), so its stage_s is the applying cost (commit_s) that
/// the render shows as update_cost (control/render.cpp: sync = fetch + stage, update = commit).
void accumulate_rank_reports(ControlResult & r, const std::vector<runtime::RankReport> & reps,
                             const std::optional<std::string> & label, bool in_place) {
    for (const runtime::RankReport & rep : reps) {
        auto it = std::find_if(r.ranks.begin(), r.ranks.end(), [&](const runtime::RankReport & e) { return e.rank == rep.rank; });
        runtime::RankReport & e = it != r.ranks.end() ? *it : r.ranks.emplace_back(runtime::RankReport{.rank = rep.rank});
        if (label) { e.version = *label; }
        if (!rep.fingerprint.empty()) { e.fingerprint = rep.fingerprint; }
        if (rep.bytes != 0) { e.bytes = rep.bytes; }
        e.checksum_verified = e.checksum_verified || rep.checksum_verified;
        e.fetch_s += rep.fetch_s;
        (in_place ? e.commit_s : e.stage_s) += rep.stage_s;
        e.commit_s += rep.commit_s;
        if (rep.freed_bytes >= 0) { e.freed_bytes = std::max<int64_t>(0, e.freed_bytes) + rep.freed_bytes; }
        if (rep.device_freed_bytes >= 0) { e.device_freed_bytes = std::max<int64_t>(0, e.device_freed_bytes) + rep.device_freed_bytes; }
        e.rss_bytes = rep.rss_bytes;
        if (!rep.detail.empty()) { e.detail = rep.detail; }
    }
}


std::future<ControlResult> Engine::control(ControlCommand cmd) {
    auto pc = std::make_shared<PendingControl>();
    pc->cmd = std::move(cmd);
    auto fut = pc->done.get_future();
    {
        std::lock_guard lk(inbox_mu_);
        if (stop_.load()) {
            ControlResult r;
            r.error = Error(Errc::shutting_down, "the server is shutting down");
            answer(*pc, std::move(r));
            return fut;
        }
        inbox_.emplace_back(std::move(pc));
        control_waiting_.store(true);
    }
    inbox_cv_.notify_one();
    return fut;
}

ControlResult Engine::run_control(const ControlCommand & cmd) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string op = !cmd.weight_bucket.empty() ? "stage_stream_bucket" : !cmd.land_host.empty() ? "open_landing" : std::string(to_string(cmd.op));
    const bool was_draining = drain_.has_value();
    state_.control_in_flight = op;
    publish_stats();
    Progress::current().set_op(op);  // the phases this op runs report it (/health progress.op)
    if (cfg_.debug_control_delay_ms > 0) { std::this_thread::sleep_for(std::chrono::milliseconds(cfg_.debug_control_delay_ms)); }
    ControlResult r;
    try {
        // Every control op starts with the host tier's transfers stopped: the background copies
        // in flight land first (the seed's "pause cache transfer"; bounded by the ranks' timeout:
        // a timeout fails the op before it changed anything). No step runs until it answers.
        if (cmd.op != ControlOp::abort_request) { r.n_tier_copies_waited = finish_background_copies(); }
        switch (cmd.op) {
            case ControlOp::pause:
                do_pause(cmd.pause_mode, r, cmd.gate ? cmd.gate->deadline() : t0 + std::chrono::seconds(300), !cmd.keep_prefix_cache);
                break;
            case ControlOp::resume: do_resume(r); break;
            case ControlOp::sleep: do_sleep(cmd.tags, r); break;
            case ControlOp::wakeup: do_wakeup(cmd.tags, r); break;
            case ControlOp::update_weights: do_update_weights(cmd, r); break;
            case ControlOp::commit_weights: do_commit_weights(cmd, r); break;
            case ControlOp::drop_staged_weights: drop_staged(&r); break;
            case ControlOp::flush_cache:
                kv_.flush_prefix_cache();
                if (!cmd.keep_host_tier) { r.n_host_blocks_flushed = kv_.flush_host_tier(); }
                break;
            case ControlOp::abort_request: do_abort_request(cmd, r); break;
            case ControlOp::is_paused:
            case ControlOp::status:
            case ControlOp::clear_load_weight:
            case ControlOp::update_model_weight:
                fail(Errc::internal, "{} is answered by the control service, not the engine", to_string(cmd.op));
        }
    } catch (const Error & e) {
        r.error = e;
        if (e.code() == Errc::rank_failed) { enter_degraded(e); }
    } catch (const std::exception & e) {
        r.error = Error(Errc::internal, e.what());
    }
    Progress::current().set_op("");
    if (!was_draining && drain_) {  // pause mode=wait started draining: poll_drain() answers it
        drain_->t0 = t0;
        accepting_.store(false);
        publish_stats();
        log::get("control")->info("pause mode=wait: admission stopped, waiting for {} choice(s) to finish", drain_->n_at_start);
        return r;
    }
    return finish_control(op, t0, std::move(r));
}

ControlResult Engine::finish_control(const std::string & op, std::chrono::steady_clock::time_point t0, ControlResult r) {
    r.is_paused = state_.paused;
    r.weights_epoch = state_.weights_epoch;
    r.elapsed_s = seconds_since(t0);
    state_.control_in_flight = drain_ ? "pause" : "";  // an abort_request may run while a pause drains
    state_.last_control_error = r.error ? fmt::format("{}: {}", op, r.error->what()) : std::string{};
    accepting_.store(!state_.paused && !drain_);
    {
        std::lock_guard lk(stats_mu_);
        auto & st = stats_.control_ops[op];
        ++st.n_total;
        st.n_errors += r.error ? 1 : 0;
        st.seconds_sum += r.elapsed_s;
        st.seconds_last = r.elapsed_s;
    }
    publish_stats();
    auto lg = log::get("control");
    if (r.error) {
        lg->warn("{} failed after {:.3f} s: {}", op, r.elapsed_s, r.error->what());
    } else {
        lg->info("{} done in {:.3f} s (paused={}, weight_version={})", op, r.elapsed_s, state_.paused, state_.weight_version);
    }
    return r;
}

void Engine::do_resume(ControlResult &) {
    if (state_.degraded) {
        fail(Errc::rank_failed, "cannot resume: rank(s) [{}] failed; POST /v1/wakeup respawns them and reloads the weights",
             fmt::join(state_.failed_ranks, ", "));
    }
    if (state_.weight_asleep || state_.kv_asleep) {
        fail(Errc::wrong_state, "cannot resume while {} asleep; POST /v1/wakeup first",
             state_.weight_asleep && state_.kv_asleep ? "weight and kv_cache are" : state_.weight_asleep ? "weight is" : "kv_cache is");
    }
    if (!state_.weights_valid) { fail(Errc::wrong_state, "cannot resume: weights are not valid; POST /v1/wakeup or /v1/update_weights first"); }
    state_.paused = false;  // kept requests continue from their KV (recomputed if the weights changed)
}

void Engine::set_weight_sleep_hook(std::function<int64_t()> hook) {
    std::lock_guard lk(hook_mu_);
    weight_sleep_hook_ = std::move(hook);
}

void Engine::do_sleep(TagSet tags, ControlResult & r) {
    if (tags.weight) { flush_pending_deltas(); }  // the wakeup source holds the served bytes before they are released
    if (tags.weight && !state_.weight_asleep && serving_landed_ && landed_snapshot_.empty()) {
        snapshot_landed_weights(r);  // landed weights: the wakeup's source, written before anything is released
    }
    do_pause(PauseMode::abort, r);  // sleep implies pause mode=abort: kept requests end too (their KV is freed)
    r.rss_before_bytes = process_rss_bytes() + executor_->rank_processes_rss_bytes();
    auto count = [&](const std::vector<runtime::RankReport> & reps, int64_t & freed) {
        freed = 0;
        for (const auto & rep : reps) {
            freed += std::max<int64_t>(0, rep.freed_bytes);
            if (rep.device_freed_bytes >= 0) { r.device_freed_bytes = std::max<int64_t>(0, r.device_freed_bytes) + rep.device_freed_bytes; }
        }
        accumulate_rank_reports(r, reps, std::nullopt);
    };
    auto release = [&](runtime::MemoryTag tag, int64_t & freed) { count(executor_->release(tag), freed); };
    if (tags.kv_cache) {
        if (state_.kv_asleep) {
            r.tags_skipped.push_back("kv_cache");
        } else {
            release(runtime::MemoryTag::kv_cache, r.freed_kv_bytes);
            // The swapped-out sequences went with the aborted requests; the pool's memory, and
            // the host KV tier's prefix blocks in it, stay unless FD_ENABLE_SWAP_SPACE_CLEARING=1
            // (wakeup(kv_cache) maps it again). Kept entries serve only their weight version.
            if (cfg_.clear_swap_space_on_sleep && kv_cfg_.n_host_blocks > 0) {
                release(runtime::MemoryTag::kv_swap, r.freed_swap_bytes);
                reset_kv();
            } else {
                kv_.reset_device();
            }
            state_.kv_asleep = true;
            r.tags_done.push_back("kv_cache");
        }
    }
    if (tags.weight) {
        if (state_.weight_asleep) {
            r.tags_skipped.push_back("weight");
        } else {
            drop_staged(nullptr);  // a staged version is weight memory too
            release(runtime::MemoryTag::weight, r.freed_weight_bytes);
            if (cfg_.expert_parallel_size > 1) { release(runtime::MemoryTag::ep_buffer, r.freed_ep_buffer_bytes); }
            std::lock_guard lk(hook_mu_);
            if (weight_sleep_hook_) {
                if (const int64_t n = weight_sleep_hook_(); n > 0) {
                    log::get("control")->info("sleep(weight): freed {:.1f} MiB of update staging outside the ranks", n / 1048576.0);
                }
            }
            state_.weight_asleep = true;
            state_.weights_valid = false;
            r.tags_done.push_back("weight");
        }
    }
    if (tags.cuda_graph) {
        // Not a sleeping state (TagSet): the graphs and their buffers go back on every rank
        // (nothing on a CPU rank), and each graph is captured again at its first step.
        count(executor_->rank_call({.op = runtime::RankOp::release_graphs}), r.freed_graph_bytes);
        graphs_released_ = true;
        r.tags_done.push_back("cuda_graph");
    }
    r.rss_after_bytes = process_rss_bytes() + executor_->rank_processes_rss_bytes();
}

void Engine::do_wakeup(TagSet tags, ControlResult & r) {
    // Either order, also with --use-cudagraph (SGLang's and vLLM's staged resumes: weights, then
    // the trainer's sync, then kv_cache + cuda_graph): captured graphs hold the weight and KV
    // pool addresses, which a release and reacquire keep (model/worker_graphs.cpp); no step runs
    // until both tags are back, and the first one checks every captured address and captures
    // again if any moved. So nothing here depends on which tag comes back first.
    if (state_.degraded) {
        recover_ranks(r);
        return;
    }
    // Weights first: their fetch is what can fail (missing checkpoint, source down), and a
    // failed wakeup must leave every tag as it was.
    bool weight_woken = false, kv_woken = false;
    if (tags.weight && state_.weight_asleep) {
        drop_staged(nullptr);
        reload_serving_weights(r);
        weights_changed();  // reloaded from the source: maybe other bytes than before the sleep
        serving_verified_ = r.checksum_verified;
        weight_woken = true;
    }
    if (tags.kv_cache) {
        if (!state_.kv_asleep) {
            r.tags_skipped.push_back("kv_cache");
        } else {
            accumulate_rank_reports(r, executor_->acquire_kv(), std::nullopt);
            kv_.reset_device();  // the host tier (when its pool stayed) keeps its entries
            state_.kv_asleep = false;
            kv_woken         = true;
            r.tags_done.push_back("kv_cache");
        }
    }
    if (tags.weight) { (weight_woken ? r.tags_done : r.tags_skipped).push_back("weight"); }  // after kv_cache, as before
    if (tags.cuda_graph) { r.tags_done.push_back("cuda_graph"); }  // nothing now: captured again at the first graph step
    r.version = state_.weight_version;
    // FastDeploy's resume after a wakeup, only when this call woke a tag (a retry that woke nothing
    // left a pause?mode=wait or keep cancelled: a probe); cuda_graph counts after a sleep(cuda_graph).
    const bool graphs_woken = tags.cuda_graph && std::exchange(graphs_released_, false);  // always cleared by a cuda_graph wakeup
    const bool woke = weight_woken || kv_woken || graphs_woken;
    if (woke && !state_.weight_asleep && !state_.kv_asleep && state_.weights_valid) { state_.paused = false; }
}

std::optional<std::vector<weights::IpcRecordId>> Engine::ipc_ids_if_source(const weights::FetchRequest & req) const {
    if (cfg_.source.strategy != weights::LoadStrategy::ipc || !req.weight_dir.empty()) { return std::nullopt; }
    return weights::ipc_record_ids(cfg_.source.port, tensor_parallel_size());
}

weights::FetchRequest Engine::update_request(const ControlCommand & cmd) const {
    weights::FetchRequest req{.version = cmd.version, .verify_checksum = cmd.verify_checksum, .serving_version = state_.weight_version};
    if (cmd.reload_base) {  // prime-rl's /reload_weights: the base --model (anyone's, like `normal`)
        req.weight_dir       = cfg_.model_dir;
        req.weight_dir_owned = false;
    } else if (!cmd.weight_dir.empty()) {  // prime-rl's /update_weights {"weight_dir"}, SGLang's model_path
        req.weight_dir = cmd.weight_dir;
    }
    return req;
}

std::optional<std::string> Engine::update_label(const ControlCommand & cmd, const std::optional<std::string> & fetched, const std::string & fp) {
    std::optional<std::string> version = cmd.version ? cmd.version : fetched;
    // Nothing names the bytes (no version given, no version.yaml step): the base model keeps its
    // start-up label; the bytes the serving label names keep it; any others are named by their
    // fingerprint (AReaL's update_weights_from_disk sends no version).
    if (!version && cmd.reload_base) { version = cfg_.base_weight_version; }
    if (!version && !fp.empty()) { version = weights::label_of_unnamed(known_labels_, state_.weight_version, fp); }
    if (version && !cmd.version) {
        // The source's own version (version.yaml): when this process saw it on other bytes, the
        // label names the new bytes by their fingerprint instead.
        const std::string label = weights::label_for(known_labels_, *version, fp);
        if (label != *version) {
            log::get("engine")->warn("update_weights: the source says version {} but that version named other weights; serving "
                                     "them as weight_version {} (write a new version.yaml step or pass \"version\")", *version, label);
            version = label;
        }
    }
    return version;
}

namespace {
const char * kNoVersion = "no version given and the source names none (no version.yaml 'step', no record version); pass {\"version\": \"...\"}";
}  // namespace

void Engine::update_while_asleep(const ControlCommand & cmd, ControlResult & r) {
    // AReaL's colocated loop (areal/trainer/rl_trainer.py: _offload_rollout = pause_generation +
    // release_memory_occupation {}; the train step; actor.update_weights = pause_generation +
    // update_weights_from_disk; _onload_rollout = resume_memory_occupation {} +
    // continue_generation) sends the update while the weights are released, and deletes the dir
    // once answered (clear_checkpoint_after_load). So the new weights cannot wait for the wakeup:
    // they are loaded now into fresh memory, as SGLang's update_weights_from_disk loads at once.
    // All-or-nothing: on any failure every rank's weights stay released and the label, the
    // serving dir and what a wakeup loads are as before.
    if (!cmd.commit) {
        fail(Errc::wrong_state, "weights are asleep: a two-phase update cannot stage into released memory; POST /v1/wakeup?tags=weight "
                                "first (or update without \"commit\": false, which loads the new weights at once)");
    }
    const weights::FetchRequest req  = update_request(cmd);
    const auto                  ipc_before = ipc_ids_if_source(req);
    const auto                  reps = executor_->reload_weights(req);
    std::vector<std::string> fps;
    for (const auto & rep : reps) { fps.push_back(rep.fingerprint); }
    const std::string fp      = weights::combine_fingerprints(fps);
    const auto        version = update_label(cmd, reps[0].version, fp);
    if (!version) {
        executor_->release(runtime::MemoryTag::weight);  // as before the call: released
        throw Error(Errc::invalid_argument, kNoVersion, "version");
    }
    state_.weight_asleep = false;
    state_.weights_valid = true;
    weights_changed();
    set_label(*version, fp);
    serving_source_version_ = req.weight_dir.empty() ? reps[0].version.value_or("") : "";
    forget_landed();
    serving_dir_       = req.weight_dir;
    serving_dir_owned_ = req.weight_dir_owned;
    drop_pending_deltas();  // they were for the previous dir
    note_ipc_load(ipc_before);
    accumulate_rank_reports(r, reps, *version);
    r.bytes             = reps[0].bytes;
    r.checksum_verified = reps[0].checksum_verified;
    serving_verified_   = r.checksum_verified;
    r.version           = *version;
    r.tags_done         = {"weight"};  // the weight tag is awake again
    log::get("engine")->info("update_weights while the weights were released: weight_version {} loaded, weight tag awake{}", *version,
                             state_.kv_asleep ? " (kv_cache still asleep)" : "");
}

void Engine::stage_stream_bucket(const ControlCommand & cmd, ControlResult & r) {
    if (!state_.staged_version.empty() || state_.weight_asleep || state_.degraded || !state_.weights_valid) { return; }
    runtime::RankRequest req{.op = runtime::RankOp::stage_bucket};
    req.fetch.weight_dir = cmd.weight_bucket;
    try {
        const auto reps = executor_->rank_call(req);
        r.bytes = reps.empty() ? 0 : reps[0].bytes;
    } catch (const Error & e) {
        if (e.code() == Errc::rank_failed) { throw; }  // a dead rank is noticed now, not at the finish
        // Anything else (a bad tensor): the ranks forgot their buckets; the finish stages in
        // full and reports it.
        log::get("engine")->info("a weight-stream bucket was not staged ahead ({}); the update stages it at its finish", e.what());
    }
}

void Engine::do_update_weights(const ControlCommand & cmd, ControlResult & r) {
    if (!cmd.weight_bucket.empty()) { return stage_stream_bucket(cmd, r); }
    if (!cmd.land_host.empty()) { return open_landing(cmd, r); }
    if (!state_.paused) { fail(Errc::wrong_state, "update_weights needs a paused engine; POST /v1/pause first"); }
    if (!state_.staged_version.empty()) {
        // The ranks hold one staged copy: an update that replaced it and then failed would lose
        // it, against invariant 2 (a probe: a failed stage emptied staged_weight_version).
        fail(Errc::wrong_state, "version '{}' is staged (two-phase); POST /v1/commit_weights or /v1/drop_staged_weights first (an update "
                                "never replaces a staged version, so a failed one cannot lose it)", state_.staged_version);
    }
    if (!cmd.weight_delta.empty()) { return apply_weight_delta(cmd, r); }  // weight_land: on the landed weights
    if (cmd.weight_land) { return commit_landing(cmd, r); }
    if (update_from_ipc_delta(cmd, r)) { return; }  // the port's ipc delta record makes cmd.version
    if (state_.weight_asleep) { return update_while_asleep(cmd, r); }
    // Phase 1 on every rank (the executor drops every staged copy if any rank fails).
    const weights::FetchRequest req = update_request(cmd);
    const auto ipc_before = ipc_ids_if_source(req);
    std::vector<runtime::RankReport> staged;
    try {
        staged = executor_->stage_weights(req);
    } catch (const Error & e) {  // an rsync store version that is a delta: applied in place instead
        if (!weights::is_store_delta_refusal(e) || !update_from_store_delta(cmd, r)) { throw; }
        return;
    }
    std::vector<std::string> fps;
    for (const auto & rep : staged) { fps.push_back(rep.fingerprint); }
    staged_fingerprint_ = weights::combine_fingerprints(fps);
    const std::optional<std::string> version = update_label(cmd, staged[0].version, staged_fingerprint_);
    if (!version) {
        executor_->drop_staged_weights();
        throw Error(Errc::invalid_argument, kNoVersion, "version");
    }
    accumulate_rank_reports(r, staged, *version);
    r.bytes             = staged[0].bytes;
    r.checksum_verified = staged[0].checksum_verified;
    r.version           = *version;
    if (!cmd.commit) {  // two-phase: validated and staged on every rank; serving is unchanged
        state_.staged_version  = *version;
        staged_source_version_ = req.weight_dir.empty() ? staged[0].version.value_or("") : "";
        staged_verified_      = r.checksum_verified;
        r.staged              = true;
        return;
    }
    // Phase 2: every rank staged, so every rank commits.
    accumulate_rank_reports(r, executor_->commit_weights(), *version);
    weights_changed();
    serving_verified_ = r.checksum_verified;
    set_label(*version, staged_fingerprint_);
    serving_source_version_ = req.weight_dir.empty() ? staged[0].version.value_or("") : "";
    forget_landed();
    serving_dir_       = req.weight_dir;
    serving_dir_owned_ = req.weight_dir_owned;
    drop_pending_deltas();  // they were for the previous dir
    note_ipc_load(ipc_before);
    state_.weights_valid  = true;
    recompute_kept();
    if (!store_serving_.copy.dir.empty()) { store_serving_ = {}; }  // a store delta's copy, no longer served: removed
}

void Engine::do_commit_weights(const ControlCommand & cmd, ControlResult & r) {
    if (state_.staged_version.empty()) {
        fail(Errc::wrong_state, "nothing is staged; POST /v1/update_weights {{\"version\": ..., \"commit\": false}} first");
    }
    if (cmd.version && *cmd.version != state_.staged_version) {
        fail(Errc::wrong_state, "version '{}' is not the staged one ('{}'); nothing changed", *cmd.version, state_.staged_version);
    }
    if (!state_.paused) { fail(Errc::wrong_state, "commit_weights needs a paused engine; POST /v1/pause first"); }
    accumulate_rank_reports(r, executor_->commit_weights(), state_.staged_version);
    weights_changed();  // no KV computed with the old weights is reused (invariant 1)
    serving_verified_ = staged_verified_;
    set_label(state_.staged_version, staged_fingerprint_);
    serving_source_version_ = staged_source_version_;
    forget_landed();
    serving_dir_.clear();  // staged updates come from the source only
    drop_pending_deltas();
    note_ipc_load(std::nullopt);  // staged earlier: the records may have changed since (a delta then needs a full update first)
    state_.weights_valid  = true;
    state_.staged_version.clear();
    r.version = state_.weight_version;
    recompute_kept();
}

void Engine::weights_changed() {
    serving_verified_ = false;  // the paths that checked the new bytes' checksums set it after
    kv_.flush_prefix_cache();
    const int64_t n = kv_.set_weight_epoch(++weight_epoch_);
    if (n > 0) { log::get("engine")->info("weights changed: {} host KV tier block(s) of the old weights dropped", n); }
}

void Engine::reset_kv() {
    const auto c = kv_.tier_counters();
    tier_counted_.offloaded += c.offloaded;
    tier_counted_.offloaded_background += c.offloaded_background;
    tier_counted_.loaded += c.loaded;
    tier_counted_.evicted += c.evicted;
    tier_counted_.invalidated += c.invalidated + kv_.n_host_blocks_cached();
    kv_ = kv::KvCache(kv_cfg_);
    kv_.set_weight_epoch(weight_epoch_);
}

void Engine::drop_staged(ControlResult * r) {
    if (state_.staged_version.empty()) { return; }
    executor_->drop_staged_weights();
    if (r) { r->version = state_.staged_version; }
    state_.staged_version.clear();
}

}  // namespace fd::engine
