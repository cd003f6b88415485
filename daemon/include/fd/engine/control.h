// fd/engine/control.h — the one weight-control command type, its typed result, and the engine
// state they change (SPEC §3, §4).
//
// Every transport builds a ControlCommand: the V1 and legacy HTTP routes, every vLLM/SGLang
// alias and the shm mailbox (fdctl) alike, through control::parse_command (fd/control/request.h),
// the one validation. The control service (fd/control/service.h) answers the queries and the
// legacy pair itself and posts the engine operations to the engine inbox; the engine thread runs
// them one at a time between steps and fulfils the promise with a ControlResult. Failures travel
// back as data (ControlResult::error); a rejected command changes nothing.
#pragma once

#include "fd/engine/request.h"
#include "fd/runtime/rank_call.h"
#include "fd/status.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fd::engine {

/// Every command a control transport can carry: the engine operations (pause ... abort_request),
/// then the ones the control service answers without the engine inbox (the is_paused and status
/// queries, the legacy FastDeploy pair).
enum class ControlOp {
    pause, resume, sleep, wakeup, update_weights,
    commit_weights,       ///< two-phase update, phase 2: the staged version goes live
    drop_staged_weights,  ///< two-phase update: discard the staged version
    flush_cache,          ///< drop the prefix cache (vLLM /reset_prefix_cache, SGLang /flush_cache)
    abort_request,        ///< end one request (by id) or every request, without pausing (POST /v1/abort)
    is_paused, status,    ///< queries (control service)
    clear_load_weight, update_model_weight,  ///< the legacy pair (control/legacy.h)
};

/// The operation's name in logs, /metrics (`op` label) and /health control_in_flight:
/// "pause" | "resume" | "sleep" | "wakeup" | "update_weights" | "commit_weights" |
/// "drop_staged_weights" | "flush_cache" | "abort_request" | "is_paused" | "status" |
/// "clear_load_weight" | "update_model_weight".
std::string_view to_string(ControlOp op);
/// The wire name: the mailbox op (cmd_op) and the V1 route's last path segment; to_string()
/// except abort_request, which is "abort" (POST /v1/abort).
std::string_view wire_name(ControlOp op);
/// True for the operations the engine runs (pause ... abort_request).
bool is_engine_op(ControlOp op);

/// What a pause does with the requests in flight (vLLM's pause modes; SPEC §3):
///   abort  every running and queued request ends at once with finish_reason "abort" (default);
///   wait   admission stops, every request already accepted runs to its end, then paused; the
///          pause answers when drained, or at the caller's deadline with `timeout` and admission
///          reopened (nothing changed: invariants 2 and 7);
///   keep   every request is frozen with its KV (no step runs); resume continues it. A weight
///          update while kept recomputes its KV with the new weights and its choice reports
///          the versions it was generated with as spans.
enum class PauseMode { abort, wait, keep };

/// "abort" | "wait" | "keep".
std::string_view to_string(PauseMode m);

/// Parse a pause mode ("" = abort). Errors  fd::Error{invalid_argument} naming it (param "mode").
PauseMode parse_pause_mode(std::string_view text);

/// The memory tags a sleep / wakeup names: the one tag-set type. The V1 routes and fdctl's
/// mailbox send it as text (shm::parse_tag_list: the names), the vLLM / SGLang aliases map
/// their names onto it (api/peer_aliases.cpp), the engine acts on it. What each tag frees:
///   weight      the weights and a staged update copy (allocator regions weight + staging);
///   kv_cache    the KV pool (region kv_cache; with FD_ENABLE_SWAP_SPACE_CLEARING=1 the host swap
///               pool kv_swap too) and the prefix cache in it;
///   cuda_graph  the captured CUDA graphs, their fixed index buffers and the activation buffers
///               they replay into (no allocator region: Worker::release_graphs). Not a sleeping
///               state: nothing is refused while it is released, and each graph is captured
///               again at its first step; a CPU backend has no graphs (0 bytes).
/// The allocator's own tags (memory::Tag) are regions, not this set: the mapping above is the
/// engine's (Engine::do_sleep).
struct TagSet {
    bool weight     = false;
    bool kv_cache   = false;
    bool cuda_graph = false;
    bool empty() const { return !weight && !kv_cache && !cuda_graph; }
    /// Every tag (SGLang's "no tags": GPU_MEMORY_ALL_TYPES).
    static TagSet all() { return {true, true, true}; }
    /// The tags named, comma-separated in the order weight, kv_cache, cuda_graph ("" when empty):
    /// what the wire's `tags` carries.
    std::string text() const;
};

/// Parse `tags=` ("weight,kv_cache,cuda_graph"; spaces trimmed; empty or absent = weight and
/// kv_cache, as in vLLM and FastDeploy: cuda_graph only when named).
/// Errors  fd::Error{invalid_argument} naming the unknown tag.
TagSet parse_tags(std::string_view text);

/// The start/cancel handshake of one queued control command, race-free: the command leaves
/// "pending" exactly once, by one atomic transition, either to "started" (the engine runs it) or
/// to "cancelled" (it never runs). Whoever waits for the answer cancels at its deadline; if that
/// fails the command had started and its answer is the truth.
class StartGate {
public:
    virtual ~StartGate() = default;
    /// Engine thread, just before running the command: pending → started, only while the
    /// deadline has not passed (past it: pending → cancelled). True = run it, false = drop it.
    virtual bool start() = 0;
    /// The waiter at its deadline: pending → cancelled. True = the command will never run.
    virtual bool cancel() = 0;
    /// When a command not started by then is dropped (steady_clock = CLOCK_MONOTONIC on Linux).
    virtual std::chrono::steady_clock::time_point deadline() const = 0;
};

/// An in-process gate (the HTTP control routes).
class LocalStartGate final : public StartGate {
public:
    explicit LocalStartGate(std::chrono::steady_clock::time_point deadline) : deadline_(deadline) {}
    bool start() override;
    bool cancel() override;
    std::chrono::steady_clock::time_point deadline() const override { return deadline_; }

private:
    enum : int { pending, started, cancelled };
    std::atomic<int>                      state_{pending};
    std::chrono::steady_clock::time_point deadline_;
};

struct ControlResult;

/// One validated control command (control::parse_command checks the fields against the op).
struct ControlCommand {
    ControlOp                  op = ControlOp::pause;
    TagSet                     tags;               ///< sleep / wakeup
    std::optional<std::string> version;            ///< update_weights; commit_weights: must equal the staged one
    bool                       verify_checksum = false;
    std::shared_ptr<StartGate> gate;               ///< null: run whenever dequeued (internal callers)
    bool                       commit = true;      ///< update_weights: false = stage and validate only (two-phase)
    PauseMode                  pause_mode = PauseMode::abort;  ///< pause
    std::string                request_id;         ///< abort_request: a completion id (cmpl-…) or a client's X-Request-Id
    bool                       abort_all = false;  ///< abort_request: every running and queued request (the engine is not paused)
    std::string                weight_dir;         ///< update_weights: load this absolute HF checkpoint dir (owned by the daemon's user)
    bool                       reload_base = false;///< update_weights: load the base --model checkpoint
    std::string                weight_delta;       ///< update_weights: apply this delta file in place (weight_dir = the serving dir it also updates)
    /// update_weights, internal (the weight-stream routes; no transport carries it): stage the
    /// tensors of this one bucket file on every rank ahead of the stream's finish (Worker::
    /// stage_bucket). Nothing live changes, no pause needed, no label; skipped while a two-phase
    /// copy is staged or the weights sleep (the finish then stages in full).
    std::string                weight_bucket;
    /// update_weights, internal (a landed weight stream, fd/stream/landing.h): not "" = every rank
    /// opens a landing listening on this address (Engine::open_landing; nothing live changes);
    /// weight_land = every rank's landing must be complete, then all commit (Engine::commit_landing).
    /// land_timeout_s bounds each rank's wait.
    std::string                land_host;
    bool                       weight_land = false;
    double                     land_timeout_s = 0;
    /// With land_host / weight_land: a delta landing (sparse changes written in place at the
    /// commit, all ranks or none: Engine::commit_landed_delta).
    bool                       land_delta = false;
    bool                       keep_prefix_cache = false;  ///< pause: leave the prefix cache as it is (update/commit still flush it)
    bool                       keep_host_tier = false;  ///< flush_cache: forget the device prefix cache only (wire: mode "device")
    /// Called on the engine thread once the command finished (or was dropped), just before its
    /// future is ready, with the engine's stats already published (null: none). The legacy word
    /// settles through it (control/legacy.cpp), also after its caller gave up waiting.
    std::function<void(const ControlResult &)> on_done;
};

/// One rank's part of a control command (result.ranks) is the rank's own report
/// (fd/runtime/rank_call.h), folded over the rank calls the command made by
/// accumulate_rank_reports (engine_control.cpp, the one place): freed bytes and durations summed,
/// RSS the last one reported, `version` the weight version the rank serves or staged after the
/// command (nullopt when the command did not touch its weights). Adding a per-rank field is a
/// field of RankReport that the rank fills (and, to show it, a line of control/render.cpp).
/// Deprecated alias for the type's old name, kept for branches written before issue #22.
using RankCost = runtime::RankReport;

/// The final events of the requests a control command ended (a pause mode=abort), held back so
/// that the control reply goes out first and the aborted requests' handlers do not compete with
/// it for the CPUs. The control service releases them (an explicit call, 2 ms after it has its
/// reply: the engine waits for no acknowledgement); the last owner's destructor releases them
/// too, so they are never lost. Thread-safe; release() is idempotent.
class HeldEvents {
public:
    using Item = std::pair<std::shared_ptr<ResultChannel>, ChoiceEvent>;
    explicit HeldEvents(std::vector<Item> items) : items_(std::move(items)) {}
    HeldEvents(const HeldEvents &) = delete;
    HeldEvents & operator=(const HeldEvents &) = delete;
    ~HeldEvents() { release(); }
    /// Push every held event to its channel (once).
    void release();

private:
    std::mutex        mu_;
    std::vector<Item> items_;
};

struct ControlResult {
    std::optional<Error> error;                    ///< set on failure; nothing else is meaningful then
    bool     is_paused = false;                    ///< state after the command
    int32_t  n_aborted = 0;                        ///< pause (and implicit pauses), abort_request: choices ended
    int32_t  n_kept    = 0;                        ///< pause mode=keep: choices frozen with their KV
    int32_t  n_drained = 0;                        ///< pause mode=wait: choices that ran to their end before the pause
    PauseMode pause_mode = PauseMode::abort;       ///< pause: the mode it ran with
    int64_t  freed_weight_bytes = -1;              ///< sleep: -1 = tag not processed (not asked or already asleep)
    int64_t  freed_kv_bytes     = -1;
    int64_t  freed_ep_buffer_bytes = -1;           ///< sleep(weight) under expert parallelism: the dispatch/combine buffers
    int64_t  freed_swap_bytes   = -1;              ///< sleep(kv_cache) with FD_ENABLE_SWAP_SPACE_CLEARING=1: the host swap pool
    int64_t  freed_graph_bytes  = -1;              ///< sleep(cuda_graph): the ranks' graph buffers (0 on CPU or with graphs off)
    int64_t  n_host_blocks_flushed = 0;            ///< flush_cache: host KV tier prefix blocks forgotten
    int64_t  n_tier_copies_waited = 0;             ///< host KV tier blocks whose background copy the op waited for before it ran
    std::vector<std::string> tags_skipped;         ///< sleep/wakeup: asked but already in that state
    std::vector<std::string> tags_done;            ///< sleep/wakeup: processed, in order
    int64_t  rss_before_bytes = 0, rss_after_bytes = 0;
    int64_t  device_freed_bytes = -1;              ///< sleep on CUDA ranks: the sum of the ranks' device_freed_bytes; -1 = not measured
    std::string           version;                 ///< update_weights/wakeup/commit: version now serving; stage: the staged one; drop: the dropped one ("" = none)
    uint64_t              weights_epoch = 0;       ///< EngineState::weights_epoch after the command
    bool                  staged = false;          ///< update_weights with commit=false: staged, not serving
    int64_t               bytes = 0;               ///< update_weights/wakeup: checkpoint bytes read
    bool                  checksum_verified = false;
    std::vector<runtime::RankReport> ranks;        ///< one per rank (see RankCost above): update_weights/wakeup/commit/sleep
    double                elapsed_s = 0.0;
    std::shared_ptr<HeldEvents> held;              ///< pause mode=abort: the aborted requests' final events (null: none)
};

/// Engine state (SPEC §3): the one state machine, written by the engine thread only.
struct EngineState {
    bool              paused        = false;
    PauseMode         pause_mode    = PauseMode::abort;  ///< how the current pause treated its requests (meaningful while paused)
    int32_t           n_kept        = 0;          ///< choices frozen by a keep pause (0 otherwise)
    /// A pause mode=wait is draining: admission is stopped (new requests get 503) while the
    /// requests in flight finish; not yet paused (`paused` turns true when the drain ends).
    bool              pause_draining = false;
    bool              weight_asleep = false;
    bool              kv_asleep     = false;
    bool              weights_valid = true;
    std::string       weight_version;
    std::string       staged_version;             ///< two-phase update: validated and staged, not serving ("" = none)
    /// The checkpoint dir the serving bytes were loaded from ("" = the --load-strategy source, or
    /// landed by a weight stream: no file holds them); a refused delta's message names it.
    std::string       serving_dir;
    /// Counts the changes of the serving bytes: every update, delta and commit, and a reload that
    /// brought other bytes back (a lost landed shard, changed files); not a sleep and wakeup of
    /// the same bytes. A weight stream records it at its commit (its /health fields, a delta's base).
    uint64_t          weights_epoch = 0;
    bool              degraded      = false;      ///< a rank failed: generation refused until wakeup recovers it
    std::vector<int32_t> failed_ranks;            ///< the failed ranks (may be empty when a group call failed)
    std::string       executor_backend = "uni";   ///< uni | mp
    int32_t           tensor_parallel_size = 1;   ///< ranks (/health; fdctl publish --strategy ipc reads it)
    std::string       comm_group       = "none";  ///< none | connected | disconnected
    int32_t           expert_parallel_size = 1;   ///< --enable-expert-parallel: the ranks the experts are spread over; 1 = off
    bool              comm_group_kept_on_sleep = false;  ///< sleep(weight) keeps the comm group (expert parallel default)
    std::string       comm_backend     = "null";  ///< null | gloo | nccl
    std::string       control_in_flight;          ///< op name while one runs, else empty
    std::string       last_control_error;         ///< message of the last failed command
};

/// A queued command and where its answer goes.
struct PendingControl {
    ControlCommand               cmd;
    std::promise<ControlResult>  done;
};

}  // namespace fd::engine
