// fd/runtime/rank_call.h — the rank operations: one list, one request, one report (in the
// spirit of vLLM's collective_rpc).
//
// Every control operation a rank runs is a row of FD_RANK_OPS and reaches the rank through
// Executor::rank_call(RankRequest) on every executor: LocalExecutor runs the row's function on
// its Worker in this process; MpExecutor sends the request to every rank process over its link
// (LinkOp::rank_call: the request's fields in the LinkMsg), where the rank's own LocalExecutor
// runs the same row, and gathers one RankReport from each (the op's `detail` travels after the
// reply). So adding a rank operation is one Worker method plus one row here and its function
// in daemon/src/runtime/rank_ops.cpp: no Executor virtual, no LinkOp, no case in the rank
// process. The step (forward), the step-link probe, the KV swap (block lists in the shared
// region) and the communication group's connect / disconnect stay link operations of their own.
//
// A bare rank_call runs the row on every rank and nothing more. The Executor's named methods
// add what a collective needs around it (stage_weights: every rank's version equal, staged
// copies dropped everywhere on a failure; reload_weights: the group rebuilt first, the reload
// undone on a failure; release: ranks sharing a device one at a time): call those for weights
// and memory; call rank_call directly for the ops that have no such rule (describe, mem_info).
#pragma once

#include "fd/memory/allocator.h"
#include "fd/weights/weight_source.h"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace fd::runtime {

/// The rank operations: X(name, what) where `what` names the operation in an error message
/// ("rank 1 (update_weights (commit)): ..."). The order is the wire's (RankOp values).
#define FD_RANK_OPS(X)                                                                                              \
    X(stage, "update_weights (staging)")        /* fetch req.fetch and stage it (Worker::stage_weights) */          \
    X(commit, "update_weights (commit)")        /* the staged copy goes live (Worker::commit_staged) */             \
    X(drop, "drop_staged_weights")              /* forget the staged copy and the fetch (Worker::drop_staged) */    \
    X(release_fetched, "releasing the fetched weights") /* let go of the last fetch (its shared dir) */            \
    X(release, "sleep")                         /* hand req.tag's memory back (Worker::release) */                  \
    X(acquire_kv, "wakeup (kv_cache)")          /* map the KV (and swap) pools again (Worker::acquire_kv) */        \
    X(reload, "wakeup (weights)")               /* fetch req.fetch into fresh memory (Worker::reload_weights) */    \
    X(mem_info, "measuring device memory")      /* nothing: every control reply carries the rank's device memory */ \
    X(describe, "describe")                     /* the rank's tensors (Worker::layout): detail, see below */          \
    X(release_graphs, "sleep (cuda_graph)")     /* destroy the CUDA graphs, free their buffers (Worker::release_graphs) */ \
    X(apply_delta, "update_weights (delta)")    /* write this rank's share of the delta file req.fetch.weight_dir (weights::rank_delta_file) in place (Worker::apply_rank_delta) */ \
    X(undo_delta, "update_weights (delta undo)") /* put back what the last apply_delta / apply_hf_delta wrote (Worker::undo_weight_delta) */ \
    X(apply_hf_delta, "update_weights (delta)") /* split the HF delta file req.fetch.weight_dir with this rank's layout and write its part in place (Worker::apply_hf_delta) */ \
    X(stage_bucket, "update_weights (staging a stream bucket)") /* stage the tensors of the one safetensors file req.fetch.weight_dir ahead of the update (Worker::stage_bucket) */ \
    X(land_open, "update_weights (opening a landing)") /* listen on the address req.fetch.weight_dir for a trainer landing this rank's shard into staging, giving up after req.timeout_s (Worker::land_open): detail {rank, host, port, token, timeout_s, parts} */ \
    X(land_close, "update_weights (landing)")   /* wait at most req.timeout_s for every landed part, then the copy is staged; a delta landing is written in place instead, bytes = elements (Worker::land_close) */ \
    X(snapshot, "sleep (writing the landed weights)") /* write the live weights to req.fetch.weight_dir/model_state.tp<rank>.safetensors (Worker::write_snapshot), read back by a wakeup's reload */ \
    X(land_delta_open, "update_weights (opening a delta landing)") /* as land_open, for sparse changes to the live weights, applied in place by land_close (Worker::land_delta_open); undo_delta puts them back */

enum class RankOp : uint32_t {
#define FD_RANK_OP_ENUM(name, what) name,
    FD_RANK_OPS(FD_RANK_OP_ENUM)
#undef FD_RANK_OP_ENUM
};

/// Rows in FD_RANK_OPS.
inline constexpr uint32_t kRankOpCount = 0
#define FD_RANK_OP_COUNT(name, what) +1
    FD_RANK_OPS(FD_RANK_OP_COUNT)
#undef FD_RANK_OP_COUNT
    ;

/// The op's name as in FD_RANK_OPS ("stage", "describe"); "?" outside the list.
std::string_view rank_op_name(RankOp op);
/// What the op is called in an error message ("update_weights (commit)").
const char * rank_op_what(RankOp op);

/// Memory a rank can hand back and take again: the allocator's regions (fd/memory/allocator.h).
/// The sleep tags (engine::TagSet) map onto them: weight = the weight region and the staging
/// copy; kv_cache = kv_cache (and kv_swap, the host swap pool of --swap-space, only with
/// FD_ENABLE_SWAP_SPACE_CLEARING=1); cuda_graph has no region (the release_graphs op).
using MemoryTag = memory::Tag;

/// One rank operation, the same for every rank (the executor sets each rank's FetchRequest::rank).
struct RankRequest {
    RankOp                op = RankOp::mem_info;
    weights::FetchRequest fetch;                  ///< stage, reload: what to fetch
    MemoryTag             tag = MemoryTag::weight;  ///< release: which memory
    double                timeout_s = 0;            ///< land_open, land_close: the bound of the wait (seconds)
};

/// One rank's answer to a rank operation (the fields an op does not fill keep their defaults).
struct RankReport {
    int32_t                    rank = 0;
    std::optional<std::string> version;            ///< stage/reload: the version the fetched checkpoint carries, if it says
    std::string                fingerprint;        ///< stage/reload: FetchedCheckpoint::fingerprint ("" = unknown)
    int64_t                    bytes = 0;          ///< stage/reload: checkpoint bytes copied in
    bool                       checksum_verified = false;
    double                     fetch_s  = 0.0;     ///< locating (and, for rsync, pulling) the shard
    double                     stage_s  = 0.0;     ///< validating and copying it into memory
    double                     commit_s = 0.0;     ///< commit: the pointer swap
    int64_t                    freed_bytes = -1;   ///< release, release_graphs: bytes handed back (-1: not a release)
    int64_t                    rss_bytes = 0;      ///< the rank process's RSS after the call
    /// release / release_graphs on a CUDA rank (in-process or a rank process): how much cudaMemGetInfo's free
    /// memory of its device grew across the call (-1: not measured, a CPU rank). Ranks sharing a
    /// device release one after another, so each delta is that rank's own.
    int64_t                    device_freed_bytes = -1;
    /// The op's own result as JSON text ("" = none), any size up to kRankDetailMaxBytes.
    /// describe: {"rank", "tp_size", "weight_bytes", "arena_bytes", "tied_lm_head",
    ///   "tensors": [{"name", "dtype" (in memory, safetensors' "F32" | "BF16" | "F16"), "shape" [rows, cols] or [n] (this
    ///   rank's shard), "shard" ("replicated" | "rows" | "cols"), "bytes"}] in arena order}.
    std::string                detail;
};

/// The largest `detail` a rank sends back; a larger one fails the call (internal).
inline constexpr int64_t kRankDetailMaxBytes = int64_t{64} << 20;

}  // namespace fd::runtime
