// The engine's half of a landed weight stream (fd/stream/landing.h, docs/weight_streams.md
// "Landing"): every rank opens its landing, then every rank's landing completes and all commit,
// or none; the landed weights written at a weight sleep (no other file holds them) and removed
// by the wakeup that reads them back.
#include "engine_reports.h"
#include "fd/engine/engine.h"
#include "fd/log.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace fd::engine {

/// The clean-up after a failed landing call: what the ranks staged goes. Its own failure (the
/// rank that failed the call fails this too) is logged, never thrown over the call's error (a
/// probe: "drop_staged_weights failed: rank 1 ... killed" named the clean-up, not the landing).
void Engine::drop_after_failure() {
    try {
        executor_->drop_staged_weights();
    } catch (const Error & e) {
        log::get("engine")->warn("after a failed landing, dropping what the ranks staged failed too: {}", e.what());
    }
}

void Engine::open_landing(const ControlCommand & cmd, ControlResult & r) {
    if (state_.weight_asleep || state_.degraded || !state_.weights_valid) {
        fail(Errc::wrong_state, "a landed weight stream needs awake, valid weights on every rank{}; POST /v1/wakeup first",
             state_.degraded ? " (a rank failed)" : "");
    }
    drop_staged(nullptr);  // a two-phase copy left staged: the landing writes over it (a delta would leave it stale)
    runtime::RankRequest req{.op = cmd.land_delta ? runtime::RankOp::land_delta_open : runtime::RankOp::land_open,
                             .timeout_s = cmd.land_timeout_s};
    req.fetch.weight_dir = cmd.land_host;
    try {
        accumulate_rank_reports(r, executor_->rank_call(req), std::nullopt);
    } catch (const Error &) {
        drop_after_failure();  // the ranks that opened stop listening
        throw;
    }
}

void Engine::commit_landing(const ControlCommand & cmd, ControlResult & r) {
    if (cmd.land_delta) { return commit_landed_delta(cmd, r); }
    if (state_.weight_asleep) { fail(Errc::wrong_state, "the weights went to sleep while the stream was landing; nothing was applied"); }
    if (!state_.staged_version.empty()) {
        fail(Errc::wrong_state, "a two-phase update (version '{}') was staged over the landing; nothing was applied", state_.staged_version);
    }
    if (!cmd.version) {
        executor_->drop_staged_weights();
        throw Error(Errc::invalid_argument, "a landed weight stream must name its version (start_weight_update {\"version\": ...})", "version");
    }
    std::vector<runtime::RankReport> landed;
    try {
        landed = executor_->rank_call({.op = runtime::RankOp::land_close, .timeout_s = cmd.land_timeout_s});
    } catch (const Error &) {
        drop_after_failure();
        throw;
    }
    accumulate_rank_reports(r, landed, *cmd.version);
    accumulate_rank_reports(r, executor_->commit_weights(), *cmd.version);
    weights_changed();
    set_label_unfingerprinted(*cmd.version);  // no file holds these bytes
    serving_landed_bytes();
    state_.weights_valid = true;
    recompute_kept();
    r.bytes   = landed.empty() ? 0 : landed[0].bytes;
    r.version = *cmd.version;
}

void Engine::serving_landed_bytes() {
    // No file holds these bytes: a weight sleep writes them first (snapshot_landed_weights).
    remove_landed_snapshot();
    serving_landed_ = true;
    serving_dir_.clear();
    serving_dir_owned_ = true;
    drop_pending_deltas();
    note_ipc_load(std::nullopt);
    if (!store_serving_.copy.dir.empty()) { store_serving_ = {}; }
}

void Engine::commit_landed_delta(const ControlCommand & cmd, ControlResult & r) {
    if (state_.weight_asleep || !state_.weights_valid) {
        fail(Errc::wrong_state, "the weights went to sleep (or were invalidated) while the delta was landing; nothing was applied");
    }
    if (!cmd.version) {  // no file to fingerprint: the trainer names the bytes
        executor_->drop_staged_weights();
        throw Error(Errc::invalid_argument, "a landed delta must name its version (start_weight_update {\"version\": ...})", "version");
    }
    // The base is the weights the delta was computed against, not only its label (a probe: a
    // checkpoint-dir update that reused the label took the delta): the stream's landed weights
    // (weight_dir "") or its serving dir, as they still serve.
    if (!delta_base_serves(cmd.weight_dir)) {
        drop_after_failure();
        fail(Errc::wrong_state, "the delta's base ({}) no longer serves: the serving weights came from {} since; nothing was applied; stream "
                                "the full weights", cmd.weight_dir.empty() ? std::string("landed weights") : cmd.weight_dir,
             serving_landed_ ? std::string("another landed stream")
                             : serving_dir_.empty() ? std::string("the --load-strategy source") : serving_dir_);
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<runtime::RankReport> reps;
    try {
        reps = executor_->rank_call({.op = runtime::RankOp::land_close, .timeout_s = cmd.land_timeout_s});
    } catch (const Error &) {
        undo_delta_on_ranks();  // the ranks that wrote put their old bytes back (the failed one did already)
        drop_after_failure();   // and those still listening stop
        throw;
    }
    double write_s = 0;
    for (const auto & rep : reps) { write_s = std::max(write_s, rep.stage_s); }
    const size_t n_ranks = reps.size();
    serve_delta_label(std::move(reps), *cmd.version, "", r);  // r.bytes: elements written, summed over ranks
    serving_landed_bytes();
    log::get("engine")->info("update_weights (landed delta): {} elements written in place on {} rank(s) in {:.3f} s (slowest rank {:.3f} s); "
                             "weight_version {}", r.bytes, n_ranks,
                             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), write_s, *cmd.version);
}

void Engine::snapshot_landed_weights(ControlResult & r) {
    std::error_code ec;
    const std::filesystem::path root = std::filesystem::is_directory("/dev/shm", ec) ? std::filesystem::path("/dev/shm")
                                                                                     : std::filesystem::temp_directory_path();
    std::string tmpl = (root / fmt::format("fdrollout-landed.{}.XXXXXX", ::getpid())).string();
    if (::mkdtemp(tmpl.data()) == nullptr) {  // mode 0700, owned by this user
        fail(Errc::internal, "sleep(weight): cannot create a dir for the landed weights under {}: {}; nothing was released", root.string(),
             std::strerror(errno));
    }
    runtime::RankRequest req{.op = runtime::RankOp::snapshot};
    req.fetch.weight_dir = tmpl;
    try {
        const auto reps = executor_->rank_call(req);
        accumulate_rank_reports(r, reps, std::nullopt);
        log::get("engine")->info("sleep(weight): the landed weights ({} B per rank) written to {} for the wakeup", reps.empty() ? 0 : reps[0].bytes,
                                 tmpl);
    } catch (...) {
        std::filesystem::remove_all(tmpl, ec);
        throw;
    }
    landed_snapshot_ = tmpl;
}

void Engine::remove_landed_snapshot() noexcept {
    if (landed_snapshot_.empty()) { return; }
    std::error_code ec;
    std::filesystem::remove_all(landed_snapshot_, ec);
    landed_snapshot_.clear();
}

}  // namespace fd::engine
