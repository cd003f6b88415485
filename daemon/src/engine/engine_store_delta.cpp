// Engine::update_from_store_delta (fd/engine/engine.h): update_weights of an rsync store version
// that is a delta on another (docs/weight_sources.md, "Delta versions"). The delta goes through
// the same in-place commit as a delta weight stream (apply_weight_delta: every rank or none, the
// label flipping last); its serving dir, the wakeup source the values are also written into, is
// a private copy of the base made from the store at the first delta and kept for the next ones.
#include "fd/engine/engine.h"
#include "fd/log.h"
#include "fd/weights/fingerprint.h"
#include "fd/weights/rank_delta.h"

#include <fmt/ranges.h>

#include <filesystem>

namespace fd::engine {

bool Engine::update_from_store_delta(const ControlCommand & cmd, ControlResult & r) {
    if (cfg_.source.strategy != weights::LoadStrategy::rsync || !cmd.weight_dir.empty() || cmd.reload_base || !cmd.weight_delta.empty()) {
        return false;
    }
    if (!store_serving_.copy.dir.empty() && serving_dir_ != store_serving_.copy.dir.string()) {
        store_serving_ = {};  // the weights moved on (a full update, a stream): the copy is removed
    }
    if (!store_source_) { store_source_ = weights::make_weight_source(cfg_.source); }
    const std::optional<weights::StoreDelta> d = store_source_->fetch_delta(cmd.version);
    if (!d) { return false; }
    const std::string & base = d->base_version;
    if (!cmd.commit) {
        fail(Errc::wrong_state, "version '{}' is a delta on '{}': it is applied in place, never staged; send update_weights without "
                                "\"commit\": false", d->version, base);
    }
    if (state_.degraded || state_.weight_asleep || !state_.weights_valid) {
        fail(Errc::wrong_state, "version '{}' is a delta on '{}', applied to the serving weights, and they are {}; POST /v1/wakeup first",
             d->version, base, state_.degraded ? "degraded" : state_.weight_asleep ? "asleep" : "invalid");
    }
    if (state_.weight_version != base) {
        fail(Errc::wrong_state, "version '{}' is a delta on '{}', but this daemon serves '{}'; update to '{}' (or a full version) first",
             d->version, base, state_.weight_version, base);
    }
    // The bytes served must be the ones the base names: pulled whole from the store (every
    // rank's fingerprint is the base's manifest fingerprint), or this engine's copy of the store
    // with the store's deltas written into it (store_serving_, still the serving dir).
    const int32_t n_ranks = executor_->world_size();
    const auto known = known_labels_.find(base);
    const bool pulled = known != known_labels_.end() &&
                        known->second == weights::combine_fingerprints(std::vector<std::string>(static_cast<size_t>(n_ranks), d->base_fingerprint));
    const bool in_copy = !store_serving_.copy.dir.empty() && serving_dir_ == store_serving_.copy.dir.string() &&
                         store_serving_.version == base && store_serving_.fingerprint == d->base_fingerprint;
    if (!pulled && !in_copy) {
        fail(Errc::wrong_state, "version '{}' is a delta on the store's '{}', but the weights served as '{}' are other bytes (not pulled "
                                "from this store: a stream, a checkpoint dir or --model); update to the store's '{}' first",
                                d->version, base, base, base);
    }
    // The serving dir: the copy the last delta wrote, or a new copy of the base.
    weights::StoreCopy copy;
    if (!in_copy) {
        copy = store_source_->copy_version(base, d->base_fingerprint, cmd.verify_checksum);
        flush_pending_deltas();  // (none after a pull; kept for the invariant: they belong to the old dir)
    }
    weights::WeightDelta delta;
    // Every tensor of the delta must be one the base holds, with its dtype and shape (the ranks
    // would skip a name that maps to nothing): checked on the headers, before any rank writes.
    {
        const model::TensorIndex held = model::read_tensor_index(in_copy ? std::filesystem::path(serving_dir_) : copy.dir);
        delta = weights::read_weight_delta(d->delta_file);
        for (const auto & t : delta.tensors) {
            const auto it = held.tensors.find(t.name);
            if (it == held.tensors.end() || it->second.dtype != t.dtype || it->second.shape != t.shape) {
                fail(Errc::invalid_checkpoint, "store delta '{}': tensor '{}' ({} {}) is not a tensor of its base '{}'{}; nothing changed",
                     d->version, t.name, dtype_name(t.dtype), fmt::join(t.shape, "x"), base,
                     it == held.tensors.end() ? std::string() : fmt::format(" (that holds {} {})", dtype_name(it->second.dtype),
                                                                             fmt::join(it->second.shape, "x")));
            }
        }
    }
    // Each rank reads only its share, split here once per rank as a stream's finish splits it.
    weights::write_rank_shares(d->delta_file, delta,
                               weights::plan_rank_layouts(model_cfg_, cfg_.model_dir, tensor_parallel_size(), cfg_.expert_parallel_size));
    const std::string old_dir   = serving_dir_;
    const bool        old_owned = serving_dir_owned_;
    if (!in_copy) {
        serving_dir_       = copy.dir.string();
        serving_dir_owned_ = true;
    }
    ControlCommand c = cmd;
    c.version      = d->version;
    c.weight_dir   = serving_dir_;
    c.weight_delta = d->delta_file.string();
    try {
        apply_weight_delta(c, r, runtime::RankOp::apply_delta);  // each rank reads the share split for it above
    } catch (...) {
        if (!in_copy) {  // the copy goes (copy.hold); the weights and their source are as before
            serving_dir_       = old_dir;
            serving_dir_owned_ = old_owned;
        }
        throw;
    }
    if (!in_copy) { store_serving_.copy = std::move(copy); }  // the previous copy (if any) is removed
    store_serving_.version     = d->version;
    store_serving_.fingerprint = d->fingerprint;
    log::get("engine")->info("update_weights: store delta {} on {} applied in place{}", d->version, base,
                             in_copy ? "" : fmt::format(" (serving dir: a copy of {} at {})", base, serving_dir_));
    return true;
}

}  // namespace fd::engine
