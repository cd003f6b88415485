// Engine::update_from_ipc_delta and the ipc deltas' life across wakeups (fd/engine/engine.h;
// docs/weight_streams.md, "Over ipc publishes"). A delta record (fd/weights/ipc_delta.h) goes
// through the same in-place commit as a delta stream or a store delta: split per rank, every
// rank writes its share keeping the old values, all ranks or none, the label flipping last. The
// wakeup source stays the trainer's weights records: the engine keeps each applied delta (its
// per-rank shares) and a wakeup that reloads the same records applies them again, in order.
#include "fd/engine/engine.h"
#include "fd/weights/fingerprint.h"
#include "fd/log.h"
#include "fd/weights/rank_delta.h"

#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace fd::engine {

namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// A new private dir (mode 0700) for this daemon's ipc deltas, removed with the returned hold:
/// /dev/shm (the temp dir without it)/fdrollout-stream.<port>.<pid>.ipcdelta.<random>, a name the weight
/// streams' start-up sweep removes when the daemon that made it is gone.
std::shared_ptr<void> make_ipc_delta_dir(int port) {
    std::error_code ec;
    const fs::path root = fs::is_directory("/dev/shm", ec) ? fs::path("/dev/shm") : fs::temp_directory_path();
    // mkdtemp: a random suffix another local user cannot take first, mode 0700
    std::string name = (root / fmt::format("fdrollout-stream.{}.{}.ipcdelta.XXXXXX", port, ::getpid())).string();
    if (::mkdtemp(name.data()) == nullptr) {
        fail(Errc::source_unavailable, "cannot create a private dir under {} for ipc deltas: {}", root.string(), std::strerror(errno));
    }
    return std::shared_ptr<fs::path>(new fs::path(name), [](fs::path * p) {
        std::error_code rm;
        fs::remove_all(*p, rm);
        delete p;
    });
}

}  // namespace

const std::vector<model::WeightLayout> & Engine::delta_layouts() {
    if (delta_layouts_.empty()) {
        delta_layouts_ = weights::plan_rank_layouts(model_cfg_, cfg_.model_dir, tensor_parallel_size(), cfg_.expert_parallel_size);
    }
    return delta_layouts_;
}

bool Engine::update_from_ipc_delta(const ControlCommand & cmd, ControlResult & r) {
    if (cfg_.source.strategy != weights::LoadStrategy::ipc || !cmd.version || !cmd.weight_dir.empty() || cmd.reload_base ||
        !cmd.weight_delta.empty()) {
        return false;
    }
    if (!ipc_delta_dir_) { ipc_delta_dir_ = make_ipc_delta_dir(cfg_.source.port); }
    const fs::path sub = *static_cast<const fs::path *>(ipc_delta_dir_.get()) / std::to_string(++ipc_delta_seq_);
    if (::mkdir(sub.c_str(), 0700) != 0) {
        fail(Errc::source_unavailable, "cannot create {} for an ipc delta: {}", sub.string(), std::strerror(errno));
    }
    bool kept = false;
    struct RemoveUnlessKept {
        const fs::path & dir;
        const bool &     kept;
        ~RemoveUnlessKept() {
            std::error_code ec;
            if (!kept) { fs::remove_all(dir, ec); }
        }
    } cleanup{sub, kept};
    const auto t0 = std::chrono::steady_clock::now();
    const std::optional<weights::IpcDelta> d = weights::fetch_ipc_delta(cfg_.source.port, *cmd.version, sub);
    if (!d) { return false; }
    const double copy_s = seconds_since(t0);
    const std::string & base = d->base_version;
    if (!cmd.commit) {
        fail(Errc::wrong_state, "version '{}' is an ipc delta on '{}': it is applied in place, never staged; send update_weights without "
                                "\"commit\": false", d->version, base);
    }
    if (d->version == base) {
        fail(Errc::invalid_checkpoint, "the ipc delta record makes version '{}' from itself (base_version = version); republish it", base);
    }
    if (state_.degraded || state_.weight_asleep || !state_.weights_valid) {
        fail(Errc::wrong_state, "version '{}' is an ipc delta on '{}', applied to the serving weights, and they are {}; POST /v1/wakeup first",
             d->version, base, state_.degraded ? "degraded" : state_.weight_asleep ? "asleep" : "invalid");
    }
    if (state_.weight_version != base) {
        fail(Errc::wrong_state, "version '{}' is an ipc delta on '{}', but this daemon serves '{}'; publish and update to '{}' (or a full "
                                "version) first", d->version, base, state_.weight_version, base);
    }
    if (!serving_dir_.empty() || ipc_serving_.base.empty()) {
        fail(Errc::wrong_state, "version '{}' is an ipc delta on '{}', but the weights served as '{}' did not come from this port's ipc "
                                "weights records ({}); publish '{}' in full (publish_ipc) and update to it first", d->version, base, base,
                                !serving_dir_.empty() ? "they came from " + serving_dir_ : std::string("--model, a two-phase update, or "
                                "records republished during their load"), base);
    }
    // The payload is a weights.fddelta: framing, sorted unique in-range indices (422 naming the tensor).
    const weights::WeightDelta delta = weights::read_weight_delta(d->delta_file);
    {
        const model::TensorIndex held = model::read_tensor_index(cfg_.model_dir);
        for (const auto & t : delta.tensors) {
            const auto it = held.tensors.find(t.name);
            if (it == held.tensors.end() || it->second.dtype != t.dtype || it->second.shape != t.shape ||
                !weights::delta_name_applicable(t.name, delta_layouts())) {
                fail(Errc::invalid_checkpoint, "ipc delta '{}': tensor '{}' ({} {}) is not a tensor of the model{}; nothing changed",
                     d->version, t.name, dtype_name(t.dtype), fmt::join(t.shape, "x"),
                     it == held.tensors.end() ? std::string() : fmt::format(" (that holds {} {})", dtype_name(it->second.dtype),
                                                                             fmt::join(it->second.shape, "x")));
            }
        }
    }
    const double check_s = seconds_since(t0) - copy_s;
    weights::write_rank_shares(d->delta_file, delta, delta_layouts());
    const double split_s = seconds_since(t0) - copy_s - check_s;
    drop_staged(nullptr);
    const auto t1 = std::chrono::steady_clock::now();
    std::vector<runtime::RankReport> reps = apply_delta_on_ranks(d->delta_file.string(), d->version);
    // Committed: kept for the wakeups, then the label flips.
    kept = true;
    if (ipc_serving_.deltas.empty()) { ipc_chain_bytes_ = ipc_merged_bytes_ = 0; }
    ipc_serving_.deltas.push_back(d->delta_file);
    ipc_chain_bytes_ += d->bytes;
    const size_t n_ranks = reps.size();
    // The new bytes' fingerprint: the base's and this delta record's, so a record published later
    // under this version with other weights is not served under it (fd/weights/fingerprint.h).
    const auto        base_fp = known_labels_.find(base);
    const std::string fp      = weights::delta_fingerprint(base_fp == known_labels_.end() ? std::string() : base_fp->second,
                                                           fmt::format("ipc {}:{} {} {}", d->record.dev, d->record.ino,
                                                                       d->record.generation, d->bytes));
    serve_delta_label(std::move(reps), d->version, fp, r);
    log::get("engine")->info("update_weights: ipc delta {} on {} ({} B) applied in place on {} rank(s) in {:.4f} s (before: copy "
                             "{:.4f} s, check {:.4f} s, split {:.4f} s); {} ipc delta(s) on the records kept for wakeups", d->version, base,
                             d->bytes, n_ranks, seconds_since(t1), copy_s, check_s, split_s, ipc_serving_.deltas.size());
    maybe_merge_ipc_deltas();
    return true;
}

void Engine::maybe_merge_ipc_deltas() noexcept {
    const char *  env   = std::getenv("FD_IPC_DELTA_MERGE_BYTES");
    const int64_t limit = std::max<int64_t>(env ? std::atoll(env) : int64_t{64} << 20, 2 * ipc_merged_bytes_);
    if (ipc_serving_.deltas.size() < 2 || ipc_chain_bytes_ <= limit) { return; }
    const auto t0 = std::chrono::steady_clock::now();
    fs::path sub;
    try {
        weights::WeightDelta merged = weights::read_weight_delta(ipc_serving_.deltas[0]);
        for (size_t i = 1; i < ipc_serving_.deltas.size(); ++i) {
            merged = weights::merge_weight_deltas(merged, weights::read_weight_delta(ipc_serving_.deltas[i]));
        }
        sub = *static_cast<const fs::path *>(ipc_delta_dir_.get()) / std::to_string(++ipc_delta_seq_);
        if (::mkdir(sub.c_str(), 0700) != 0) { fail(Errc::source_unavailable, "cannot create {}: {}", sub.string(), std::strerror(errno)); }
        const fs::path file = sub / "weights.fddelta";
        weights::write_rank_shares(file, merged, delta_layouts(), [&] { weights::write_weight_delta(file, merged); });
        const size_t n = ipc_serving_.deltas.size();
        for (const auto & f : ipc_serving_.deltas) {
            std::error_code ec;
            fs::remove_all(f.parent_path(), ec);
        }
        ipc_serving_.deltas = {file};
        ipc_chain_bytes_ = ipc_merged_bytes_ = static_cast<int64_t>(fs::file_size(file));
        log::get("engine")->info("update_weights: {} kept ipc deltas merged into one of {} B in {:.3f} s", n, ipc_chain_bytes_,
                                 seconds_since(t0));
    } catch (const std::exception & e) {
        std::error_code ec;
        if (!sub.empty()) { fs::remove_all(sub, ec); }
        log::get("engine")->warn("update_weights: merging the {} kept ipc deltas failed ({}); they stay as they are",
                                 ipc_serving_.deltas.size(), e.what());
    }
}

void Engine::note_ipc_load(const std::optional<std::vector<weights::IpcRecordId>> & before) {
    for (const auto & f : ipc_serving_.deltas) {  // each delta's dir (its file and per-rank shares)
        std::error_code ec;
        fs::remove_all(f.parent_path(), ec);
    }
    ipc_serving_ = {};
    if (!before) { return; }
    const auto after = weights::ipc_record_ids(cfg_.source.port, tensor_parallel_size());
    if (after && *after == *before) { ipc_serving_.base = *after; }
}

bool Engine::replay_ipc_deltas(const std::optional<std::vector<weights::IpcRecordId>> & before) {
    if (ipc_serving_.deltas.empty()) {
        note_ipc_load(before);
        return false;
    }
    const auto after = weights::ipc_record_ids(cfg_.source.port, tensor_parallel_size());
    if (!before || !after || *before != *after || *after != ipc_serving_.base) {
        log::get("engine")->warn("wakeup: the ipc weights records were republished since the {} ipc delta(s) up to '{}' were applied on "
                                 "them: serving what the records hold now, the deltas are dropped", ipc_serving_.deltas.size(),
                                 state_.weight_version);
        note_ipc_load(before);
        return false;
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto & f : ipc_serving_.deltas) {
        try {
            apply_delta_on_ranks(f.string(), state_.weight_version);
        } catch (...) {
            executor_->release(runtime::MemoryTag::weight);  // as before the wakeup: released; the deltas stay for the next one
            state_.weight_asleep = true;
            state_.weights_valid = false;
            throw;
        }
    }
    log::get("engine")->info("wakeup: {} ipc delta(s) applied again on the reloaded records in {:.3f} s; serving weight_version {}",
                             ipc_serving_.deltas.size(), seconds_since(t0), state_.weight_version);
    return true;
}

}  // namespace fd::engine
