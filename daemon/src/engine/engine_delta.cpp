// Engine::apply_weight_delta / flush_pending_deltas (fd/engine/engine.h): a delta weight
// stream's commit (fd/weights/weight_delta.h). The values go in place into every rank's shard
// (each keeps the old ones), all ranks or none; the serving dir (the wakeup source) follows
// lazily, before anything reads it, and the label's fingerprint is recorded then.
#include "fd/engine/engine.h"
#include "fd/log.h"
#include "fd/weights/fingerprint.h"
#include "fd/weights/weight_delta.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

namespace fd::engine {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// The slowest rank's seconds reading its share (or the whole delta file) and writing it in place.
std::pair<double, double> slowest_rank_times(const std::vector<runtime::RankReport> & reps) {
    double read_s = 0, write_s = 0;
    for (const auto & rep : reps) {
        read_s  = std::max(read_s, rep.fetch_s);
        write_s = std::max(write_s, rep.stage_s);
    }
    return {read_s, write_s};
}

}  // namespace

bool Engine::delta_base_serves(const std::string & base_dir) const {
    if (base_dir.empty()) { return serving_landed_; }
    return !serving_landed_ && !serving_dir_.empty() && std::filesystem::path(base_dir) == std::filesystem::path(serving_dir_);
}

void Engine::apply_weight_delta(const ControlCommand & cmd, ControlResult & r, runtime::RankOp ranks) {
    if (state_.weight_asleep || !state_.weights_valid) {
        fail(Errc::wrong_state, "a weight delta applies to the serving weights, and they are {}; stream the full weights",
             state_.weight_asleep ? "asleep" : "invalid");
    }
    if (cmd.weight_land) { return apply_landed_delta(cmd, r, ranks); }
    if (!delta_base_serves(cmd.weight_dir)) {
        fail(Errc::wrong_state, "the serving weights did not come from {} (the delta's base dir) but from {}; stream the full weights",
             cmd.weight_dir, serving_dir_.empty() ? std::string("the --load-strategy source") : serving_dir_);
    }
    drop_staged(nullptr);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<runtime::RankReport> reps = apply_delta_on_ranks(cmd.weight_delta, cmd.version, ranks);
    auto undo_ranks = [&] { undo_delta_on_ranks(); };
    const double ranks_s = seconds_since(t0);
    // The delta stays for the serving dir (written lazily): moved into it, so it lives and goes with the dir.
    const std::filesystem::path kept = std::filesystem::path(serving_dir_) / fmt::format(".fdrollout-pending-{}.fddelta", ++pending_delta_seq_);
    std::error_code ec;
    const auto size = std::filesystem::file_size(cmd.weight_delta, ec);
    if (!ec) { std::filesystem::rename(cmd.weight_delta, kept, ec); }
    if (ec) {
        undo_ranks();
        fail(Errc::source_unavailable, "update_weights (delta): cannot keep the delta {} for the serving dir {} ({}); every rank was put "
             "back", cmd.weight_delta, serving_dir_, ec.message());
    }
    pending_deltas_.push_back({kept});
    pending_delta_bytes_ += static_cast<int64_t>(size);
    const bool lazy = cmd.version.has_value();  // no version: the fingerprint of the updated dir names the bytes now
    const int64_t pending = pending_delta_bytes_;
    const std::string previous = state_.weight_version;
    std::optional<std::string> version = cmd.version;
    std::string fp;
    const auto t1 = std::chrono::steady_clock::now();
    if (!lazy || pending > kPendingDeltaBytes) {
        try {
            flush_pending_deltas(/*record_label=*/false);  // the label is not this delta's yet: set below
        } catch (...) {
            std::filesystem::remove(pending_deltas_.back().file, ec);  // the earlier ones were written and put back: still pending, still right
            pending_deltas_.pop_back();
            pending_delta_bytes_ -= static_cast<int64_t>(size);
            undo_ranks();
            throw;
        }
        const std::vector<std::string> fps(reps.size(), weights::checkpoint_fingerprint(model::read_tensor_index(serving_dir_)));
        fp = weights::combine_fingerprints(fps);
        version = update_label(cmd, std::nullopt, fp);
    }
    FD_CHECK(version.has_value(), "a delta's label: its version or the updated dir's fingerprint");
    const auto [read_s, write_s] = slowest_rank_times(reps);
    const size_t n_ranks = reps.size();
    serve_delta_label(std::move(reps), *version, fp, r);  // fp "" (lazy): recorded when the dir is written (flush_pending_deltas)
    log::get("engine")->info("update_weights (delta): {} {} applied in place on {} rank(s) in {:.3f} s (slowest rank: read {:.3f} s, "
                             "write {:.3f} s; from {}); serving dir {}; weight_version {}", r.bytes,
                             ranks == runtime::RankOp::apply_hf_delta ? "elements" : "B", n_ranks, ranks_s,
                             read_s, write_s, previous,
                             pending_deltas_.empty() ? fmt::format("written in {:.3f} s", seconds_since(t1))
                                                     : fmt::format("pending ({} delta(s), {} B)", pending_deltas_.size(), pending),
                             *version);
}

void Engine::apply_landed_delta(const ControlCommand & cmd, ControlResult & r, runtime::RankOp ranks) {
    if (!delta_base_serves("")) {
        fail(Errc::wrong_state, "the delta's base was landed on the ranks, but the serving weights came from {} since; stream the full weights",
             serving_dir_.empty() ? std::string("the --load-strategy source") : serving_dir_);
    }
    if (!cmd.version) {  // no file to fingerprint: the trainer names the bytes
        throw Error(Errc::invalid_argument, "a delta on landed weights must name its version (start_weight_update {\"version\": ...})", "version");
    }
    drop_staged(nullptr);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<runtime::RankReport> reps = apply_delta_on_ranks(cmd.weight_delta, cmd.version, ranks);
    // The live weights are the only copy (a weight sleep writes them, snapshot_landed_weights):
    // no dir to update, no pending delta to keep, no fingerprint.
    const auto [read_s, write_s] = slowest_rank_times(reps);
    const size_t n_ranks = reps.size();
    serve_delta_label(std::move(reps), *cmd.version, "", r);
    log::get("engine")->info("update_weights (delta): {} elements applied in place on {} landed rank(s) in {:.3f} s (slowest rank: read "
                             "{:.3f} s, write {:.3f} s); weight_version {}", r.bytes, n_ranks, seconds_since(t0), read_s, write_s,
                             *cmd.version);
}

std::vector<runtime::RankReport> Engine::apply_delta_on_ranks(const std::string & file, const std::optional<std::string> & version,
                                                              runtime::RankOp op) {
    // apply_delta: every rank reads its own share (weights::rank_delta_file, split before this
    // call); apply_hf_delta: every rank reads `file` and splits it itself. Each checks what it
    // writes; the engine does not read the delta here.
    weights::FetchRequest req{.version = version, .serving_version = state_.weight_version};
    req.weight_dir = file;
    try {
        return executor_->rank_call({.op = op, .fetch = req});
    } catch (...) {
        undo_delta_on_ranks();
        throw;
    }
}

void Engine::undo_delta_on_ranks() noexcept {
    try {
        executor_->rank_call({.op = runtime::RankOp::undo_delta});
    } catch (const std::exception & e) {  // a dead rank: the engine degrades; recovery reloads the source (without this delta)
        log::get("engine")->error("update_weights (delta): putting the old weights back failed on a rank: {}", e.what());
    }
}

void Engine::flush_pending_deltas(bool record_label) {
    if (pending_deltas_.empty()) { return; }
    std::error_code ec;
    if (!std::filesystem::exists(serving_dir_, ec)) {  // gone (reload_serving_weights falls back to the source): nothing to write
        log::get("engine")->warn("update_weights (delta): {} is gone; {} pending delta(s) dropped with it", serving_dir_, pending_deltas_.size());
        drop_pending_deltas();
        return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<weights::WeightDelta> deltas;  // all read (and checked) before any is written
    for (const auto & p : pending_deltas_) { deltas.push_back(weights::read_weight_delta(p.file)); }
    std::vector<weights::DirUndo> undo(deltas.size());
    size_t n = 0;
    try {
        for (; n < deltas.size(); ++n) { weights::apply_delta_to_dir(serving_dir_, deltas[n], &undo[n]); }
    } catch (...) {
        while (n-- > 0) { weights::restore_dir(undo[n]); }
        throw;
    }
    // The dir now holds the serving label's bytes: a wakeup reading it keeps the label.
    if (record_label) {
        const int32_t ranks = executor_->world_size();
        const std::vector<std::string> fps(static_cast<size_t>(ranks), weights::checkpoint_fingerprint(model::read_tensor_index(serving_dir_)));
        known_labels_[state_.weight_version] = weights::combine_fingerprints(fps);
    }
    log::get("engine")->info("update_weights (delta): {} pending delta(s) written into {} in {:.3f} s", pending_deltas_.size(), serving_dir_,
                             seconds_since(t0));
    drop_pending_deltas();
}

void Engine::drop_pending_deltas() noexcept {
    for (const auto & p : pending_deltas_) {
        std::error_code ec;
        std::filesystem::remove(p.file, ec);
    }
    pending_deltas_.clear();
    pending_delta_bytes_ = 0;
}

void Engine::serve_delta_label(std::vector<runtime::RankReport> reps, const std::string & version, const std::string & fp,
                               ControlResult & r) {
    r.bytes = 0;
    for (auto & rep : reps) {
        rep.version = version;
        r.bytes += rep.bytes;
    }
    r.ranks = std::move(reps);
    weights_changed();
    serving_source_version_.clear();
    if (fp.empty()) {
        set_label_unfingerprinted(version);
    } else {
        set_label(version, fp);
    }
    state_.weights_valid = true;
    recompute_kept();
    r.version = version;
}

}  // namespace fd::engine
