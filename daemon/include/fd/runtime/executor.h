// fd/runtime/executor.h — how the engine reaches its ranks (ARCHITECTURE.md seam 1).
//
// The engine owns one Executor and never a Worker: it asks for a forward step (logits come
// back from rank 0; sampling stays in the engine) and for collective control. Every control
// call reaches every rank and succeeds only when every rank succeeds:
//   - weights are updated in two phases: stage_weights() makes every rank fetch its own shard
//     from the weight source and stage it; only when all staged may commit_weights() swap them
//     live on all ranks; on any failure the executor drops the staged copies everywhere before
//     throwing, so every rank keeps serving the old version bit-exactly;
//   - release()/acquire() fan a memory tag out to every rank;
//   - swap_kv() runs the scheduler's KV block copies (host swap tier) on every rank.
//   - rank_call() runs any operation of the rank-call table (fd/runtime/rank_call.h) on every
//     rank, the one path from the engine to a Worker method (vLLM's collective_rpc).
// LocalExecutor (tp=1) runs the one rank in-process, calling the Worker directly.
// Called from the engine thread only.
#pragma once

#include "fd/model/worker.h"
#include "fd/status.h"
#include "fd/runtime/rank_call.h"
#include "fd/runtime/world.h"
#include "fd/weights/weight_source.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fd::runtime {

/// One CUDA rank's device memory and group as last measured (Executor::rank_devices).
struct RankDevice {
    int32_t rank   = 0;
    int32_t device = -1;                 ///< CUDA device ordinal in the rank's process (CUDA_VISIBLE_DEVICES applies)
    int64_t free_bytes  = 0;             ///< cudaMemGetInfo of that device (every process's use counts)
    int64_t total_bytes = 0;
    int64_t held_bytes[4] = {};          ///< bytes the rank's allocator holds, by memory::Tag (weight, kv_cache, staging, kv_swap; kv_swap is pinned host memory)
    bool    comm_connected = false;      ///< the rank's own Comm::connected()
    int64_t nccl_comms_live = 0, nccl_comms_created = 0;  ///< the rank process's nccl_comm_counts()
    std::chrono::steady_clock::time_point measured{};     ///< when (this process's clock)
};

class Executor {
public:
    virtual ~Executor() = default;

    /// Ranks (the tensor-parallel size).
    virtual int32_t world_size() const = 0;
    /// Where the ranks run (tp, nnodes, placement; fd/runtime/world.h). Default: world_size()
    /// ranks on this host.
    virtual World world() const { return World{.tp = world_size()}; }
    virtual const model::ModelConfig & model_config() const = 0;

    /// One step on every rank. Shapes  logits [batch.logits_rows.size(), vocab] f32 (rank 0's).
    /// Returns false when `abandon` turned true and the step was dropped (see Worker::forward).
    virtual bool forward(const model::StepBatch & batch, float * logits, const std::atomic<bool> * abandon) = 0;
    /// One step on every rank, rank 0's logits read in place (no copy): memory the executor owns
    /// (mp: the shared region rank 0 wrote them into; uni: a buffer the Worker wrote into), valid
    /// until the next call on this executor, never allocated per step once grown.
    /// Shapes  returned [batch.logits_rows.size(), vocab] f32. Returns nullptr when `abandon`
    /// turned true and the step was dropped. Errors  as forward().
    virtual const float * forward_in_place(const model::StepBatch & batch, const std::atomic<bool> * abandon) = 0;
    /// The MTP draft work after the last forward (Worker::draft_mtp, fd/model/worker.h).
    /// Shapes  drafts [sum of db.chains' k] token ids; -1 ends a chain's drafts early.
    /// Every rank runs it on its shard (mp: LinkOp::draft_mtp, the batch in the shared region);
    /// the ranks agree on every draft (Worker::mtp_argmax), rank 0's come back.
    /// Errors  fd::Error{invalid_argument} on an executor without MTP drafts; as Worker::draft_mtp;
    ///         rank_failed (mp) as any call.
    virtual void draft_mtp(const model::DraftBatch & db, std::vector<int32_t> & drafts) {
        (void)db; (void)drafts;
        fail(Errc::invalid_argument, "this executor ({}) has no MTP draft layers", backend());
    }
    /// Bytes of the MTP cache on every rank together (0 without MTP drafts).
    virtual int64_t mtp_cache_bytes() const { return 0; }
    /// Rank 0's routed experts of the last forward / forward_in_place (R3; Worker::step_routes):
    /// Shapes  [batch.n_tokens(), n_moe_layers, top_k] int32, model::route_cols per token.
    /// nullptr when that batch did not set want_routes or the model is dense. Valid until the
    /// next call on this executor.
    virtual const int32_t * step_routes() const { return nullptr; }

    /// Run `req` on every rank (fd/runtime/rank_call.h: a bare row of the table, none of the
    /// rules the named methods below add around stage, reload and release).
    /// Returns one report per rank, in rank order.
    /// Errors  the first rank's error (every rank answered: "rank r (what): ..." at tp > 1);
    ///         rank_failed (mp) naming a rank that died or missed the deadline.
    virtual std::vector<RankReport> rank_call(const RankRequest & req) = 0;

    /// Phase 1 of an update: every rank fetches `req` (its rank set by the executor) from the
    /// weight source and stages it. Errors  the first rank's error (not_found,
    /// source_unavailable, invalid_checkpoint, checksum_mismatch, ...) after every staged copy
    /// was dropped; invalid_checkpoint too when ranks fetched different versions.
    virtual std::vector<RankReport> stage_weights(const weights::FetchRequest & req) = 0;
    /// Phase 2: every rank's staged copy goes live. Requires a successful stage_weights().
    virtual std::vector<RankReport> commit_weights() = 0;
    /// Drop every rank's staged copy (no-op where none).
    virtual void drop_staged_weights() = 0;

    /// Hand `tag`'s memory back on every rank (weights: unusable until reload_weights()).
    virtual std::vector<RankReport> release(MemoryTag tag) = 0;
    /// Map the KV pool, and the swap pool if released, again on every rank (same geometry;
    /// contents lost).
    virtual std::vector<RankReport> acquire_kv() = 0;
    /// On every rank: wait for the background copies an earlier call started, copy the `n_out`
    /// blocks of `out` device → host, then the `n_in` blocks of `in` host → device
    /// (fd/kv/block_copy.h; a scheduler decision's swap_out / swap_in), then START the `n_bg`
    /// device → host copies of `bg` in the background (the host tier's write-ahead offloads,
    /// Worker::swap_out_background) and return: they run while the next forward computes; the
    /// caller keeps their blocks untouched until its next swap_kv call returned (a call with
    /// nothing in it is the wait alone).
    /// Errors  fd::Error{internal} on a block id outside the pools; timeout when background
    ///         copies did not land within the rank's io timeout; rank_failed (mp).
    virtual void swap_kv(const kv::BlockCopy * out, int64_t n_out, const kv::BlockCopy * in, int64_t n_in,
                         const kv::BlockCopy * bg = nullptr, int64_t n_bg = 0) = 0;
    /// After release(weight): every rank fetches `req` and loads it into fresh memory.
    /// Errors  as stage_weights; the weights then stay released on every rank.
    virtual std::vector<RankReport> reload_weights(const weights::FetchRequest & req) = 0;

    /// Rank 0's weight and KV bytes (for /health and the benches).
    virtual int64_t weight_bytes() const = 0;
    virtual int64_t kv_bytes() const = 0;

    // --- rank health (the multi-process executor; in-process ranks cannot fail alone) ---

    /// "uni" (ranks in this process) | "mp" (one process per rank): --distributed-executor-backend.
    virtual const char * backend() const { return "uni"; }
    /// Ranks known dead or stuck: a call timed out on them, or their process exited. Cheap (no
    /// message is sent; exited rank processes are reaped). Empty while every rank is fine.
    virtual std::vector<int32_t> failed_ranks() { return {}; }
    /// Kill and respawn every failed rank, then rebuild the communication group on all ranks.
    /// Afterwards every rank runs, but a respawned rank holds the --model checkpoint and an
    /// empty KV pool: the caller reloads the serving weights on every rank.
    /// Errors  fd::Error{rank_failed} naming the ranks that could not be brought back.
    virtual void recover() {}
    /// The ranks' communication group: "none" (a single in-process rank), "connected" or
    /// "disconnected" (torn down by sleep with --shutdown-comm-group-if-worker-idle).
    virtual const char * comm_state() const { return "none"; }
    /// Resident bytes of the rank processes other than this one (mp: the local ranks read from
    /// /proc now, plus each rank on another node as it reported with its last control reply -
    /// start-up, sleep, wakeup, update; uni: 0, the rank is this process). Any thread.
    virtual int64_t rank_processes_rss_bytes() const { return 0; }
    /// Let go of the checkpoint the last stage_weights / reload_weights fetched, kept by a rank
    /// process (make_local_executor's hold_fetched) so that every rank shares one fetch (the rsync
    /// source's staged dir); the multi-process executor calls it on every rank once all replied.
    virtual void release_fetched() {}
    /// The group's backend: "null" | "gloo" | "shm" | "nccl".
    virtual const char * comm_backend() const { return "null"; }

    /// CUDA ranks: each rank's device memory as last measured, in rank order; empty on cpu.
    /// Any thread (a copy under a lock; never asks the ranks).
    virtual std::vector<RankDevice> rank_devices() const { return {}; }
    /// Engine thread, between steps: measure again when the last measurement is older than
    /// `max_age_s` (mp: one mem_info round trip to every rank, skipped while a rank is failed;
    /// every control reply refreshes it too). No-op on cpu.
    /// Errors  rank_failed (mp) as any call.
    virtual void refresh_rank_devices(double max_age_s) { (void)max_age_s; }
};

/// tp=1: the one rank in this process, the Worker called directly (no link, no copy).
/// `source` is the rank's weight source. A rank process of the multi-process executor serves
/// its own rank `rank` through one too (its reports and fetches carry that rank).
/// `hold_fetched` (rank processes): the fetched checkpoint (FetchedCheckpoint::hold, e.g. the
/// rsync source's staged dir that every rank of one daemon shares) is kept after stage_weights and
/// reload_weights until release_fetched() (or drop_staged_weights), so a slow rank still finds
/// the dir the first rank pulled instead of pulling again; the multi-process executor calls
/// release_fetched on every rank once all replied. Off (in-process tp=1): the hold ends with the call.
std::unique_ptr<Executor> make_local_executor(std::unique_ptr<model::Worker> worker, std::unique_ptr<weights::WeightSource> source,
                                              int32_t rank = 0, bool hold_fetched = false);

}  // namespace fd::runtime
