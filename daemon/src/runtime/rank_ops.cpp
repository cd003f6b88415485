// The rank-call table's rank side (rank_ops.h): one function per row of FD_RANK_OPS
// (fd/runtime/rank_call.h), each calling one Worker method, and the dispatch the X-macro builds.
// A new rank operation: its row in rank_call.h and its run_<name> function here.
#include "rank_ops.h"

#include "fd/arena.h"
#include "fd/checkpoint/model_config.h"
#include "fd/status.h"

#include <nlohmann/json.hpp>

#include <array>
#include <chrono>
#include <filesystem>

namespace fd::runtime {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

bool on_cuda(const RankSite & s) { return s.worker->backend().kind() == kernels::DeviceKind::cuda; }

/// A checkpoint dir's config.json must describe the model this rank serves: an update keeps the
/// running structure and math, so a config that differs (another num_experts_per_tok, rope_theta,
/// ...) would be served wrong under the new label. Sources without a dir (ipc records) pass.
/// Errors  invalid_checkpoint naming the file and the field (or what load_model_config refuses).
void check_same_model(const RankSite & s, const weights::FetchedCheckpoint & ckpt) {
    std::error_code ec;
    if (ckpt.config_dir.empty() || !std::filesystem::is_regular_file(ckpt.config_dir / "config.json", ec)) { return; }
    if (const auto d = model::model_config_difference(s.worker->config(), model::load_model_config(ckpt.config_dir))) {
        fail(Errc::invalid_checkpoint, "{}: {}; a weight update keeps the running model's structure and math, so these weights would "
                                       "be served wrong: start a daemon on this checkpoint instead; nothing changed",
             (ckpt.config_dir / "config.json").string(), *d);
    }
}

/// This rank's checkpoint for `req` (a wakeup whose weight_dir holds this rank's snapshot, the
/// snapshot op's: read as the ipc_snapshot source reads it); the time it took goes to r.fetch_s.
weights::FetchedCheckpoint fetch(RankSite & s, const weights::FetchRequest & req, RankReport & r) {
    const auto t0 = Clock::now();
    weights::FetchRequest mine = req;
    mine.rank               = s.rank;
    mine.device_destination = on_cuda(s);  // ipc: device to device
    const bool snapshot = req.wakeup && !req.weight_dir.empty() && std::filesystem::exists(weights::ipc_snapshot_file(req.weight_dir, s.rank));
    weights::FetchedCheckpoint ckpt = req.weight_dir.empty() ? s.source->fetch(mine)
                                      : snapshot             ? weights::make_ipc_snapshot_source(req.weight_dir)->fetch(mine)  // landed weights
                                                             : weights::fetch_checkpoint_dir(req.weight_dir, req.weight_dir_owned);
    check_same_model(s, ckpt);
    r.fetch_s = seconds_since(t0);
    return ckpt;
}

// ---- one function per row (same order as FD_RANK_OPS)

void run_stage(RankSite & s, const RankRequest & req, RankReport & r) {
    weights::FetchedCheckpoint ckpt = fetch(s, req.fetch, r);
    const auto t1 = Clock::now();
    r.bytes = s.worker->stage_weights(ckpt.index, ckpt.verify_copied);
    if (s.hold_fetched) { s.fetch_hold = ckpt.hold; }
    r.stage_s           = seconds_since(t1);
    r.version           = ckpt.version;
    r.fingerprint       = ckpt.fingerprint;
    r.checksum_verified = ckpt.checksum_verified;
}

void run_commit(RankSite & s, const RankRequest &, RankReport & r) {
    const auto t0 = Clock::now();
    s.worker->commit_staged();
    r.commit_s = seconds_since(t0);
}

void run_drop(RankSite & s, const RankRequest &, RankReport &) {
    s.worker->drop_staged();
    s.fetch_hold.reset();
}

void run_release_fetched(RankSite & s, const RankRequest &, RankReport &) { s.fetch_hold.reset(); }

void run_release(RankSite & s, const RankRequest & req, RankReport & r) {
    const bool    cuda  = on_cuda(s);
    const int64_t free0 = cuda ? s.worker->backend().mem_info().free_bytes : 0;
    r.freed_bytes = s.worker->release(req.tag);
    if (cuda) { r.device_freed_bytes = s.worker->backend().mem_info().free_bytes - free0; }
}

void run_acquire_kv(RankSite & s, const RankRequest &, RankReport &) { s.worker->acquire_kv(); }

void run_reload(RankSite & s, const RankRequest & req, RankReport & r) {
    weights::FetchedCheckpoint ckpt = fetch(s, req.fetch, r);
    const auto t1 = Clock::now();
    s.worker->reload_weights(ckpt.index, ckpt.verify_copied);
    if (s.hold_fetched) { s.fetch_hold = ckpt.hold; }
    r.stage_s     = seconds_since(t1);
    r.bytes       = ckpt.index.total_bytes;
    r.version     = ckpt.version;
    r.fingerprint = ckpt.fingerprint;
    r.checksum_verified = ckpt.checksum_verified;
}

void run_apply_delta(RankSite & s, const RankRequest & req, RankReport & r) {
    s.worker->forget_weight_delta();  // a failed read below must not leave an older delta's undo log for undo_delta
    const auto t0 = Clock::now();
    // This rank's share of the delta file req.fetch.weight_dir, split by the daemon (fd/weights/rank_delta.h).
    weights::RankDelta d = weights::read_rank_delta(weights::rank_delta_file(req.fetch.weight_dir, s.rank));
    r.fetch_s = seconds_since(t0);
    r.bytes   = d.payload_bytes();
    const auto t1 = Clock::now();
    s.worker->apply_rank_delta(std::move(d));
    r.stage_s = seconds_since(t1);
}

void run_undo_delta(RankSite & s, const RankRequest &, RankReport &) { s.worker->undo_weight_delta(); }

void run_apply_hf_delta(RankSite & s, const RankRequest & req, RankReport & r) {
    const auto t0 = Clock::now();
    // The delta file itself (weights.fddelta, in HF names, the same for every rank), read into the
    // rank's kept delta buffer; read_hf_delta forgets the older undo log first (as run_apply_delta:
    // a failed read leaves none).
    std::shared_ptr<const weights::MappedWeightDelta> d = s.worker->read_hf_delta(req.fetch.weight_dir);
    r.fetch_s = seconds_since(t0);
    const auto t1 = Clock::now();
    const int64_t n = s.worker->apply_hf_delta(std::move(d));
    r.stage_s = seconds_since(t1);
    r.bytes   = n;  // elements written in place
}

void run_stage_bucket(RankSite & s, const RankRequest & req, RankReport & r) {
    // One bucket file of a weight stream, in the daemon's private staging dir (as weight_dir's
    // files: the dir and the file must be the daemon user's and not writable by others).
    const auto t0 = Clock::now();
    const std::filesystem::path file = req.fetch.weight_dir;
    const model::TensorIndex idx = weights::read_owned_files(file.parent_path(), {file});
    r.fetch_s = seconds_since(t0);
    const auto t1 = Clock::now();
    r.bytes   = s.worker->stage_bucket(idx);
    r.stage_s = seconds_since(t1);
}

void run_land_open(RankSite & s, const RankRequest & req, RankReport & r) {
    r.detail = s.worker->land_open(req.fetch.weight_dir, req.timeout_s);  // weight_dir carries the address to listen on
}

void run_land_delta_open(RankSite & s, const RankRequest & req, RankReport & r) {
    r.detail = s.worker->land_delta_open(req.fetch.weight_dir, req.timeout_s);  // weight_dir carries the address to listen on
}

void run_land_close(RankSite & s, const RankRequest & req, RankReport & r) {
    const auto t0 = Clock::now();
    r.bytes   = s.worker->land_close(req.timeout_s);
    r.stage_s = seconds_since(t0);
}

void run_snapshot(RankSite & s, const RankRequest & req, RankReport & r) {
    const auto t0 = Clock::now();
    r.bytes   = s.worker->write_snapshot(weights::ipc_snapshot_file(req.fetch.weight_dir, s.rank));
    r.stage_s = seconds_since(t0);
}

void run_mem_info(RankSite &, const RankRequest &, RankReport &) {}  // the executor measures after every call

void run_describe(RankSite & s, const RankRequest &, RankReport & r) {
    static constexpr const char * kShard[] = {"replicated", "rows", "cols"};
    const model::WeightLayout & l = s.worker->layout();
    nlohmann::json tensors = nlohmann::json::array();
    for (const auto & t : l.tensors) {
        tensors.push_back({{"name", t.name}, {"dtype", model::dtype_name(t.dtype)}, {"shape", t.shape},
                           {"shard", kShard[static_cast<int>(t.shard)]}, {"bytes", t.bytes}});
    }
    r.detail = nlohmann::json{{"rank", s.rank},
                              {"tp_size", s.worker->tp_size()},
                              {"weight_bytes", s.worker->weight_bytes()},
                              {"arena_bytes", l.arena_bytes},
                              {"tied_lm_head", l.tied_lm_head},
                              {"tensors", std::move(tensors)}}
                   .dump();
}

void run_release_graphs(RankSite & s, const RankRequest &, RankReport & r) {
    const bool    cuda  = on_cuda(s);
    const int64_t free0 = cuda ? s.worker->backend().mem_info().free_bytes : 0;
    r.freed_bytes = s.worker->release_graphs();
    if (cuda) { r.device_freed_bytes = s.worker->backend().mem_info().free_bytes - free0; }
}

using RunFn = void (*)(RankSite &, const RankRequest &, RankReport &);

struct Row {
    std::string_view name;
    const char *     what;
    RunFn            run;
};

constexpr std::array<Row, kRankOpCount> kRows = {{
#define FD_RANK_OP_ROW(name, what) {#name, what, &run_##name},
    FD_RANK_OPS(FD_RANK_OP_ROW)
#undef FD_RANK_OP_ROW
}};

const Row * row_of(RankOp op) {
    const auto i = static_cast<uint32_t>(op);
    return i < kRows.size() ? &kRows[i] : nullptr;
}

}  // namespace

std::string_view rank_op_name(RankOp op) {
    const Row * row = row_of(op);
    return row ? row->name : std::string_view("?");
}

const char * rank_op_what(RankOp op) {
    const Row * row = row_of(op);
    return row ? row->what : "an unknown rank operation";
}

RankReport run_rank_op(RankSite & site, const RankRequest & req) {
    const Row * row = row_of(req.op);
    if (!row) { fail(Errc::internal, "rank {}: unknown rank operation {}", site.rank, static_cast<uint32_t>(req.op)); }
    RankReport r{.rank = site.rank};
    row->run(site, req, r);
    if (static_cast<int64_t>(r.detail.size()) > kRankDetailMaxBytes) {
        fail(Errc::internal, "rank {}: {}'s result is {} bytes (at most {})", site.rank, row->name, r.detail.size(), kRankDetailMaxBytes);
    }
    r.rss_bytes = process_rss_bytes();
    return r;
}

}  // namespace fd::runtime
