// fd/engine/engine.h — the engine thread: one inbox, continuous batching, sampling, results.
//
// Owns the Scheduler, the KvCache, the Executor (the ranks) and every live Sequence. Other threads
// only submit() into the inbox and read stats(); everything else happens on the engine thread,
// whose loop is: drain the inbox → drop cancelled sequences → schedule() → build the batch →
// Executor::forward() → sample → push ChoiceEvents → release finished sequences.
#pragma once

#include "fd/weights/ipc_delta.h"
#include "fd/weights/weight_delta.h"

#include "fd/engine/control.h"
#include "fd/engine/request.h"
#include "fd/engine/scheduler.h"
#include "fd/kv/kv_cache.h"
#include "fd/metrics/request_metrics.h"
#include "fd/tokenizer/tokenizer.h"
#include "fd/runtime/executor.h"
#include "fd/spec/acceptance.h"
#include "fd/spec/proposer.h"

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <variant>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace fd::engine {

struct EngineConfig {
    SchedulerConfig scheduler;
    int32_t         max_model_len  = 0;    ///< prompt + generated tokens per sequence
    std::string     weight_version = "0";  ///< reported with every output (until an update changes it)
    /// What the start-up bytes are (fd/weights/fingerprint.h; "" = unknown): a wakeup that
    /// loads other bytes that no new version names changes the label (docs/weight_sources.md).
    std::string     weight_fingerprint;
    std::string     model_dir;             ///< --model (update_weights reload_base reads it)
    kernels::WType  kv_cache_dtype = kernels::WType::f32;  ///< --kv-cache-dtype (KV bytes per block: Worker::kv_block_bytes)
    /// --kv-cache-bytes resolved (fd::Resolved::kv_budget_bytes), all ranks together: the KV pool
    /// and, with MTP drafts, the MTP cache are paid from it. /health shows it (kv_cache.budget_bytes).
    int64_t         kv_budget_bytes = 0;
    /// The label of the --model checkpoint itself (version.yaml `step`, else --weight-version):
    /// what update_weights reload_base serves it as.
    std::string     base_weight_version = "0";
    bool            use_cudagraph  = false;///< graphs on: wakeup takes the tags in either order (engine_control.cpp)
    /// --compute-dtype as served (kernels::compute_type_name: "float32" | "bfloat16"), shown in
    /// /health and /v1/models; the ranks' backends were built with it.
    std::string     compute_dtype  = "float32";
    /// --enable-expert-parallel: the expert-parallel size (1 = off). > 1: sleep(weight) also
    /// releases every rank's ep_buffer tag (reported as freed_bytes.ep_buffer).
    int32_t         expert_parallel_size = 1;
    /// sleep(weight) closes the comm group (--shutdown-comm-group-if-worker-idle, resolved:
    /// default on without expert parallelism, off with it). /health reports it.
    bool            shutdown_comm_group_on_sleep = true;
    int32_t         debug_control_delay_ms = 0; ///< tests only (FD_DEBUG_CONTROL_DELAY_MS): stretch every control op
    /// FD_ENABLE_SWAP_SPACE_CLEARING=1: sleep(kv_cache) also unmaps the host swap pool
    /// (--swap-space); wakeup(kv_cache) maps it again. Off: the pool's memory stays (its contents
    /// are dropped either way: sleep aborts every request).
    bool            clear_swap_space_on_sleep = false;
    int32_t         debug_step_delay_ms = 0;    ///< tests only (FD_DEBUG_STEP_DELAY_MS): stretch every step that runs (requests stay in flight)
    /// --speculative-config (fd/spec/spec_config.h; docs/speculative.md): drafts verified exactly.
    spec::SpeculativeConfig speculative;
    /// The --load-strategy source (rsync: the engine reads the store's manifests for delta versions).
    weights::SourceConfig   source;
};

/// A completion request: every prompt is sampled `n` times; choice index = prompt * n + i.
struct GenerateRequest {
    std::vector<std::vector<int32_t>> prompts;    ///< token ids, BOS included when wanted
    int32_t                           n = 1;
    SamplingParams                    params;
    std::shared_ptr<ResultChannel>    channel;
    std::vector<std::string>          request_ids;  ///< ids POST /v1/abort finds it by: the completion id, the client's X-Request-Id
    uint64_t                          prefix_salt = 0;  ///< vLLM's cache_salt, hashed (0 = none): prefix-cache hits only between equal salts
    std::chrono::steady_clock::time_point t_arrival{};  ///< set by submit(); start of TTFT, e2e, queue time
};

/// Step latency histogram bucket bounds, seconds (Prometheus `le`).
inline constexpr std::array<double, 11> kStepLatencyBuckets = {0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0};

/// Per control operation: how often, how long, how often it failed.
struct ControlOpStats {
    int64_t n_total = 0, n_errors = 0;
    double  seconds_sum = 0.0, seconds_last = 0.0;
};

/// Counters and state read by /metrics and /health (a snapshot taken under one mutex).
struct EngineStats {
    EngineState state;
    std::map<std::string, ControlOpStats> control_ops;
    int64_t n_running = 0, n_waiting = 0;
    int64_t n_tokens_generated_total = 0, n_tokens_prompt_total = 0, n_tokens_cached_total = 0;
    int64_t n_requests_total = 0, n_preemptions_total = 0, n_steps_total = 0;
    int64_t n_swap_preemptions_total = 0, n_recompute_preemptions_total = 0;  ///< the two kinds of n_preemptions_total
    int64_t n_kv_blocks_used = 0, n_kv_blocks_free = 0, n_kv_blocks_total = 0;
    std::string kv_cache_dtype = "float32";  ///< --kv-cache-dtype resolved: float32 | bfloat16
    int32_t kv_block_size = 0;               ///< tokens per KV block
    int64_t kv_bytes_per_token = 0;          ///< KV bytes one token takes, all layers, K and V, all ranks together
    int64_t kv_budget_bytes = 0;             ///< EngineConfig::kv_budget_bytes
    int64_t n_swap_blocks_used = 0, n_swap_blocks_total = 0;  ///< host swap pool: blocks holding swapped-out KV / capacity
    int64_t n_swapped = 0;                                    ///< sequences whose KV is in the host pool
    int64_t swap_out_bytes_total = 0, swap_in_bytes_total = 0;///< KV bytes copied device → host / host → device (all ranks)
    // The host KV tier's prefix blocks (prefix caching + --swap-space; fd/kv/host_tier.h).
    bool    host_tier_enabled = false;
    int64_t n_host_tier_blocks_cached = 0;       ///< host blocks holding prefix entries now
    int64_t host_tier_block_bytes     = 0;       ///< bytes of one host block, all ranks together (with MTP: its MTP KV too)
    int64_t n_host_tier_offloads_total = 0;      ///< evicted device prefix blocks copied to the host
    int64_t n_host_tier_hits_total     = 0;      ///< host prefix blocks a request's first admission copied back (= prompt_tokens_host_cached_total / block size)
    int64_t n_host_tier_loads_total    = 0;      ///< every host prefix block copied back (re-admissions after a preemption too)
    int64_t n_host_tier_offloads_background_total = 0;  ///< of the offloads, those copied ahead of eviction in the background
    int64_t n_host_tier_in_flight      = 0;      ///< blocks of background copies not yet waited for
    int64_t n_host_tier_evictions_total = 0;     ///< host prefix entries evicted (LRU) for room
    int64_t n_host_tier_invalidated_total = 0;   ///< host prefix entries dropped (weight change, flush)
    int64_t n_tokens_host_cached_total = 0;      ///< prompt tokens served from the host tier (part of n_tokens_cached_total)
    int64_t host_tier_out_bytes_total = 0, host_tier_in_bytes_total = 0;  ///< tier copy bytes device → host / host → device (all ranks)
    bool    host_tier_transfers_paused = false;  ///< tier copies stopped (paused or draining)
    std::string host_tier_weight_version;        ///< the weight version the host entries were computed under
    std::array<int64_t, kStepLatencyBuckets.size() + 1> step_latency_counts{};  ///< last = +Inf
    double  step_latency_sum_s = 0.0;
    // Speculative decoding (--speculative-config; docs/speculative.md).
    std::string spec_method = "none";            ///< none | ngram | mtp
    int64_t     mtp_cache_bytes = 0;             ///< the MTP draft layer's KV (0 without mtp or while asleep)
    /// The serving version's acceptance collapsed against the version before it
    /// (spec::acceptance_collapsed): both labels, "" when not.
    std::string spec_collapse_version, spec_collapse_previous;
    int32_t     num_speculative_tokens = 0;      ///< k
    /// Verified drafts per weight version (the version serving when they were verified), for the
    /// spec::kVersionsKept versions drafted under most recently (spec::keep_recent_versions).
    std::map<std::string, spec::DraftCounters> spec_by_version;
    spec::DraftCounters spec_total;              ///< verified drafts over every version ever (never pruned)
    int64_t     n_spec_steps_off_total = 0;      ///< steps that verified no draft because the batch exceeded disable_by_batch_size
    int64_t     n_target_forwards_total = 0;     ///< sequence-steps that produced tokens (plain or speculating): tokens / this = tokens per target forward
};

class Engine {
public:
    /// `executor` reaches the ranks (and their weight sources); the engine never sees a Worker.
    Engine(const EngineConfig & cfg, std::unique_ptr<runtime::Executor> executor,
           std::shared_ptr<const tokenizer::Tokenizer> tok, const kv::KvCacheConfig & kv_cfg);
    ~Engine();

    void start();
    /// Abort everything still running (finish_reason "abort") and join the thread.
    void stop();

    /// Queue a request. Errors  fd::Error{engine_paused} while paused, asleep or draining.
    void submit(GenerateRequest req);

    /// Queue a control command; commands run one at a time, in order, on the engine thread.
    std::future<ControlResult> control(ControlCommand cmd);


    /// Refuse new requests from now on (SIGTERM); in-flight ones continue.
    void begin_drain() { draining_.store(true); }
    bool draining() const { return draining_.load(); }
    /// True when no request is queued or running.
    bool idle() const;

    EngineStats stats() const;
    /// Resident bytes of the rank processes outside this one (mp executor; 0 for uni). Any thread.
    int64_t rank_processes_rss_bytes() const { return executor_->rank_processes_rss_bytes(); }
    /// CUDA ranks' device memory as last measured (Executor::rank_devices); any thread.
    std::vector<runtime::RankDevice> rank_devices() const { return executor_->rank_devices(); }
    /// Latency histograms and finish counters (fd/metrics/request_metrics.h); any thread.
    const metrics::RequestMetrics & request_metrics() const { return request_metrics_; }
    const model::ModelConfig & model_config() const { return model_cfg_; }
    const EngineConfig &       config() const { return cfg_; }
    /// The ranks (tensor-parallel size); fixed at construction.
    int32_t                    tensor_parallel_size() const;
    runtime::World             world() const { return executor_->world(); }  ///< where the ranks run (tp, nnodes)
    /// Every weight sleep calls `hook` on the engine thread once the ranks released their
    /// weights: it frees host memory kept outside the ranks for weight updates (the weight
    /// stream's spare staging dir: StreamManager::release_spare) and returns the bytes (logged).
    /// Any thread; nullptr clears it (before what it calls goes away).
    void set_weight_sleep_hook(std::function<int64_t()> hook);

private:
    struct Sequence;

    void loop();
    /// One engine step: take the inbox, reap, then build / run / emit. True when something
    /// happened (a control handled, a row run or rejected).
    bool step();
    /// A step's plan: the scheduler's decision, what each logits row of batch_ is for, its start.
    struct StepPlan {
        /// A logits row: a prompt row to score (pos >= 0: its logits give prompt token pos + 1's
        /// logprob) or the row a sequence samples from (pos = -1).
        /// A sample row (pos = -1) with n_draft > 0 is followed by its n_draft draft rows (pos =
        /// -2): row j scores draft token j (fd/engine/sampler.h, verify_draft_token).
        struct RowUse { Sequence * s; int32_t pos; int32_t n_draft = 0; };
        ScheduleDecision                      d;
        std::vector<RowUse>                   rows;
        std::chrono::steady_clock::time_point t0;
    };
    /// Build: schedule (rejects, preemption, swap and tier copies) and fill batch_ and plan.rows.
    /// False when nothing runs this step.
    bool build_step(StepPlan & plan);
    /// Run: the forward over batch_. Rank 0's logits [n_rows][vocab] f32, valid until the next
    /// executor call; null when a control command arrived first (nothing advanced).
    const float * run_step();
    /// Emit: advance the run sequences, score prompt rows, sample, send events, step stats.
    void emit_step(const StepPlan & plan, const float * step_logits);
    /// R3: copy the step's routed experts (Executor::step_routes) into each sequence that asked,
    /// by position. Before emit_step advances n_computed.
    void keep_routes(const ScheduleDecision & d);
    void admit(GenerateRequest & req);
    /// Send `ev` for `s` (stamped, with the text now safe to send); `why` != none finishes `s`.
    void emit(Sequence & s, FinishReason why, ChoiceEvent ev);
    /// /metrics for a choice that ends with `why`: finished count, e2e time, prompt and generated tokens.
    void count_finished(const Sequence & s, FinishReason why);
    void release_finals() noexcept;  ///< push finals_ (hold_finals_ off)
    /// `logits`: the raw row (logprobs come from it).
    void append_token(Sequence & s, int32_t tok, const float * logits, ChoiceEvent & ev);
    /// append_token without the emit: add `tok` to `s` and `ev`, return what it finishes (none
    /// when the choice goes on). The stop checks run per token, so a token inside an accepted
    /// draft run ends the choice exactly where a run without speculation ends it.
    FinishReason push_token(Sequence & s, int32_t tok, const float * logits, ChoiceEvent & ev);
    // speculative decoding (engine_spec.cpp)
    /// Before schedule(): each running sequence with one token to compute proposes its drafts
    /// (SchedSeq::n_draft), bounded by k, max_tokens and max_model_len; none above
    /// disable_by_batch_size running sequences.
    void propose_drafts();
    /// Emit the sample row `i` of plan.rows and its draft rows: verify the drafts in order, append
    /// the target's tokens up to the first rejection (plus the target's own token there, or the
    /// bonus token after the last draft), count acceptance, keep the accepted drafts' KV, give the
    /// rejected ones' blocks back. `logits`: row i's [1 + n_draft, vocab].
    void emit_draft_rows(const StepPlan::RowUse & row, const float * logits);
    /// MTP (Proposer::uses_draft_layers): after emit_step, run the draft layer over every kept
    /// row of the step (its cache follows each sequence) and chain k drafts for each sequence
    /// about to decode (Sequence::layer_drafts, read by the next propose_drafts).
    /// Errors  as Executor::draft_mtp (an internal error fails the step's sequences).
    void run_draft_layers(const StepPlan & plan);
    /// The token counters (/metrics), bumped before the event that carries the tokens goes out;
    /// `n_forwards`: sequence-steps that produced tokens (n_target_forwards_total).
    void count_tokens(int64_t n_generated, int64_t n_prompt, int64_t n_cached, int64_t n_host_cached, int64_t n_forwards = 0);
    /// Every sequence still alive ends with `e`.
    void fail_step(const Error & e);
    void publish_stats();
    /// Step-aligned end of the host tier's background copies (KvCache::plan_background_offloads):
    /// wait until every rank's landed (an empty swap_kv: bounded by the ranks' timeout), then
    /// release their blocks. Returns the blocks waited for (0: none in flight, no call).
    /// Errors  timeout, rank_failed (the blocks stay held; the next call waits again).
    int64_t finish_background_copies();
    // control (engine_control.cpp; pause modes and abort: engine_pause.cpp)
    ControlResult run_control(const ControlCommand & cmd);
    /// `drain_deadline`: mode=wait gives up at it (the caller's deadline).
    /// `flush_prefix` false: the prefix cache stays (prime-rl's clear_cache=false); its blocks
    /// were computed with the weights still serving, and every weight change flushes it.
    void          do_pause(PauseMode mode, ControlResult & r, std::chrono::steady_clock::time_point drain_deadline = {},
                           bool flush_prefix = true);
    /// pause mode=wait in progress: answer it once no request is left, or at its deadline with
    /// `timeout` (admission reopened); then run the commands held back meanwhile.
    void          poll_drain();
    /// The bookkeeping every finished command gets (state, stats, log, admission).
    ControlResult finish_control(const std::string & op, std::chrono::steady_clock::time_point t0, ControlResult r);
    /// Run a dequeued command (its gate decides), answer it unless it started a drain.
    void          dispatch_control(const std::shared_ptr<PendingControl> & pc);
    void          do_abort_request(const ControlCommand & cmd, ControlResult & r);
    /// Choices still alive (queued, running or kept).
    int32_t       n_live() const;
    /// End every live choice whose request carries `id` (all of them when `all`) with "abort" and
    /// free its KV now. Returns how many.
    int32_t       abort_matching(const std::string & id, bool all);
    /// After the serving weights changed under kept requests: drop their KV so every one is
    /// recomputed (prompt + generated tokens) with the new weights before it samples again.
    void          recompute_kept();
    /// The serving weights changed: no KV computed before is reused (device prefix cache
    /// flushed, host-tier entries keyed to the new epoch; invariant 1).
    void          weights_changed();
    /// A fresh KvCache (device pool and host tier), its counters carried over.
    void          reset_kv();
    void          do_resume(ControlResult & r);
    void          do_sleep(TagSet tags, ControlResult & r);
    void          do_wakeup(TagSet tags, ControlResult & r);
    void          do_update_weights(const ControlCommand & cmd, ControlResult & r);
    void          stage_stream_bucket(const ControlCommand & cmd, ControlResult & r);  ///< update_weights {weight_bucket}
    /// update_weights {land_host}: every rank opens a landing (Worker::land_open), all or none;
    /// r.ranks carry each rank's parts (detail). Nothing live changes, no pause needed.
    void          open_landing(const ControlCommand & cmd, ControlResult & r);
    /// update_weights {weight_land}: every rank's landing completes (Worker::land_close), then
    /// every rank commits, labelled cmd.version (required); any failure drops every rank's copy.
    void          commit_landing(const ControlCommand & cmd, ControlResult & r);
    /// update_weights {weight_land, land_delta}: every rank's delta landing completes and is
    /// written in place (Worker::land_close), or every rank puts its old bytes back (undo_delta);
    /// then the label is the command's version (a delta on any serving base; the weights are
    /// landed from here on: a weight sleep writes them).
    void          commit_landed_delta(const ControlCommand & cmd, ControlResult & r);
    /// The ranks' weights were just replaced by landed bytes (commit_landing, commit_landed_delta):
    /// no file holds them, no dir serves, no pending delta or ipc load is kept.
    void          serving_landed_bytes();
    /// A delta's base still serves: the stream's landed weights (`base_dir` "") or its dir
    /// `base_dir` (no label check: a reused label is not the same bytes).
    bool          delta_base_serves(const std::string & base_dir) const;
    /// After a failed landing call: every rank's staged copy dropped; a failure of that is logged, not thrown.
    void          drop_after_failure();
    /// update_weights {weight_delta, weight_land}: a delta stream on landed weights (no serving
    /// dir): applied in place on every rank (all or none), labelled cmd.version (required).
    void          apply_landed_delta(const ControlCommand & cmd, ControlResult & r, runtime::RankOp ranks);
    /// update_weights while the weights are released (AReaL's colocated loop): the new weights
    /// are loaded into fresh memory at once, all-or-nothing; the weight tag is awake afterwards.
    void          update_while_asleep(const ControlCommand & cmd, ControlResult & r);
    /// update_weights {weight_delta}: a delta's sparse values written in place on every rank
    /// and, lazily, into the serving dir (weight_dir must be it), all ranks or none. `ranks`:
    /// how the ranks read it — RankOp::apply_hf_delta (a stream's: every rank maps the HF delta
    /// file itself and splits it with its own layout) or RankOp::apply_delta (each reads the share
    /// split for it beforehand, weights::rank_delta_file). The engine does not read the delta at
    /// the commit: the file is moved into the serving dir as a pending delta.
    void          apply_weight_delta(const ControlCommand & cmd, ControlResult & r, runtime::RankOp ranks = runtime::RankOp::apply_hf_delta);
    /// The rank half of a delta's commit: every rank writes its part of `file` into its shard in
    /// place with `op` (apply_delta: its share, split beforehand; apply_hf_delta: split from the
    /// HF file by the rank), keeping the old values; on any failure every rank puts its old
    /// values back (undo_delta_on_ranks) and the error is rethrown.
    std::vector<runtime::RankReport> apply_delta_on_ranks(const std::string & file, const std::optional<std::string> & version,
                                                          runtime::RankOp op = runtime::RankOp::apply_delta);
    /// Every rank puts back the values its last apply_delta overwrote. Never throws (logs; a dead
    /// rank degrades the engine, whose recovery reloads the source).
    void          undo_delta_on_ranks() noexcept;
    /// Write the committed deltas not yet in serving_dir_ into it (in commit order) and record
    /// the serving label's fingerprint of the result. Before anything reads the dir (a sleep of
    /// the weights, a wakeup's reload, a recovery) and when they outgrow kPendingDeltaBytes.
    /// `record_label` false: the caller labels the result itself (a commit before its label flips).
    /// Errors  as weights::read_weight_delta / apply_delta_to_dir (what was written is put back;
    ///         the deltas stay pending).
    void          flush_pending_deltas(bool record_label = true);
    /// Forget the pending deltas (their files are removed): serving_dir_ changed, or is gone.
    void          drop_pending_deltas() noexcept;
    /// Where an update's weights come from: the request's dir, the base --model, else the source.
    weights::FetchRequest update_request(const ControlCommand & cmd) const;
    /// The label of an update's new bytes `fp` (docs/weight_sources.md): the request's version,
    /// else the fetched one (version.yaml step: its fingerprint label when this process saw that
    /// version on other bytes), the start-up label for the base model, else the serving label
    /// when the bytes are its own, else fp-<hex>. nullopt: nothing names them.
    std::optional<std::string> update_label(const ControlCommand & cmd, const std::optional<std::string> & fetched, const std::string & fp);
    void          do_commit_weights(const ControlCommand & cmd, ControlResult & r);
    void          drop_staged(ControlResult * r);  ///< drop the staged version if any (r->version names it)
    int32_t       abort_all();
    /// A rank failed (`e` says which): every live request ends with `e`, generation stops until
    /// wakeup recovers the ranks (engine_control.cpp).
    void          enter_degraded(const Error & e);
    /// wakeup while degraded: respawn the failed ranks, rebuild the group, reload the serving
    /// weights and the KV pool on every rank.
    void          recover_ranks(ControlResult & r);
    /// Every rank loads the serving version from the source into fresh memory (after a weight
    /// release); the version the checkpoint carries, bytes and per-rank costs go into `r`.
    void          reload_serving_weights(ControlResult & r);
    /// The events held back while a control command ran (null when none), for its result: the
    /// control service releases them once it has the reply (HeldEvents).
    std::shared_ptr<HeldEvents> take_held();
    /// Fulfil a command's promise: its on_done first (stats are published by then).
    static void   answer(PendingControl & pc, ControlResult r);

    EngineConfig                              cfg_;
    model::ModelConfig                        model_cfg_;
    std::unique_ptr<runtime::Executor>        executor_;   ///< the ranks
    std::shared_ptr<const tokenizer::Tokenizer>   tok_;
    kv::KvCacheConfig                         kv_cfg_;
    kv::KvCache                               kv_;
    uint64_t                                  weight_epoch_ = 0;  ///< bumped whenever the serving weights change (KV keys)
    kv::KvCache::TierCounters                 tier_counted_;      ///< tier counters of the KvCaches replaced so far
    EngineState                               state_;      ///< engine thread only; copied into stats_
    std::string                               staged_fingerprint_;  ///< of the staged bytes (two-phase)
    /// Every label served and the fingerprint of its bytes (weights::label_for keeps a label
    /// from naming other bytes than it named before).
    std::map<std::string, std::string>        known_labels_;
    /// The serving weights came from this checkpoint dir (update_weights weight_dir / reload_base),
    /// not the source: wakeup re-reads it ("" = the source). Owned: see FetchRequest.
    std::string                               serving_dir_;
    bool                                      serving_dir_owned_ = true;
    /// The serving weights were landed (commit_landing) and no file holds them: a weight sleep
    /// first writes each rank's snapshot into landed_snapshot_ (a private dir), which the wakeup
    /// reloads and removes. Any other load forgets both (forget_landed).
    bool                                      serving_landed_ = false;
    std::filesystem::path                     landed_snapshot_;
    void          snapshot_landed_weights(ControlResult & r);  ///< sleep(weight) of landed weights
    void          remove_landed_snapshot() noexcept;
    void          forget_landed() noexcept { serving_landed_ = false; remove_landed_snapshot(); }
    /// Deltas applied in place on the ranks (apply_weight_delta) and not yet written into
    /// serving_dir_: their files (fd/weights/weight_delta.h), moved into serving_dir_ as
    /// .fdrollout-pending-N.fddelta, in commit order. The dir is updated lazily
    /// (flush_pending_deltas), so a commit costs the ranks' writes only. Dropped whenever
    /// serving_dir_ changes. Every file is complete when it is moved here (the ranks read it).
    struct PendingDelta {
        std::filesystem::path file;
    };
    std::vector<PendingDelta>                 pending_deltas_;
    int64_t                                   pending_delta_bytes_ = 0;  ///< their files' sizes
    int64_t                                   pending_delta_seq_ = 0;
    static constexpr int64_t                  kPendingDeltaBytes = int64_t{64} << 20;  ///< flush at the commit past this
    /// Set the serving label to `version` for bytes fingerprinted `fp` and remember the pair (fp
    /// "": the label keeps the fingerprint it had, as a reload that could not fingerprint the same
    /// bytes does). `bytes_changed`: other bytes serve from now on (EngineState::weights_epoch
    /// counts them); false for a reload of the bytes that served before.
    void          set_label(const std::string & version, const std::string & fp, bool bytes_changed = true);
    /// Set the serving label to `version` for bytes no file holds (landed, or written in place
    /// before their dir is): no fingerprint the label named before stays attached to it, so a
    /// later load of those other bytes does not come back under it.
    void          set_label_unfingerprinted(const std::string & version);
    /// The ranks wrote a delta in place (reps: one per rank): the result carries them under
    /// `version`, which names the served bytes from now on; `fp` their fingerprint, or "" when no
    /// file holds them (then no earlier fingerprint stays attached to `version`: a later load of
    /// those other bytes must not come back under it).
    void          serve_delta_label(std::vector<runtime::RankReport> reps, const std::string & version, const std::string & fp,
                                    ControlResult & r);
    Scheduler                                 sched_;
    std::unordered_map<kv::SeqId, std::unique_ptr<Sequence>> seqs_;
    kv::SeqId                                 next_seq_id_ = 1;
    model::StepBatch                          batch_;
    model::DraftBatch                         draft_batch_;  ///< run_draft_layers' (reused)
    std::vector<int32_t>                      layer_drafts_; ///< its output
    std::vector<float>                        scratch_, processed_;  ///< processed_: one row after the logits processors
    std::unique_ptr<spec::Proposer>           proposer_;  ///< --speculative-config's (null: none)
    /// The versions drafts were verified under: the current one and the one before it (the
    /// acceptance-collapse check compares them); collapse_warned_: the version already warned about.
    std::string                               spec_version_, spec_prev_version_, collapse_warned_;
    std::vector<std::string>                  spec_versions_;  ///< stats_.spec_by_version's keys, least recently drafted under first
    bool                                      defer_events_ = false;  ///< emit() holds events back (pause)
    /// Within a step, emit() keeps each final event (a finished choice's answer) in finals_ until
    /// the step freed its blocks and published its stats: a client holding its answer finds the
    /// engine's /health and /metrics already past it (release_finals pushes them).
    bool                                      hold_finals_ = false;
    std::vector<HeldEvents::Item>             finals_;
    std::vector<HeldEvents::Item>             deferred_;  ///< events held back (defer_events_), taken by take_held()
    /// A pause mode=wait waiting for the requests in flight to finish.
    struct Drain {
        std::shared_ptr<PendingControl>       pc;         ///< answered by poll_drain()
        std::chrono::steady_clock::time_point deadline;   ///< the caller's; then timeout, admission reopened
        std::chrono::steady_clock::time_point t0;
        int32_t                               n_at_start = 0;
        int32_t                               n_aborted = 0;        ///< of those, ended by an abort meanwhile (not drained)
        bool                                  flush_prefix = true;  ///< the pause's (see do_pause)
        std::optional<Error>                  rank_error;           ///< a rank failed meanwhile: its requests ended with it (not drained)
    };
    std::optional<Drain>                      drain_;
    std::deque<std::shared_ptr<PendingControl>> held_controls_;  ///< commands queued behind a drain (run in order after it)

    /// update_weights of an rsync store version that the ranks refused to load because it is a
    /// delta (weights::is_store_delta_refusal): pull it (weights::StoreDelta) and apply it in
    /// place (apply_weight_delta) if every rank serves exactly its base's bytes, else 409
    /// wrong_state naming both. Returns false when the store's version is not a delta (after
    /// all): the caller passes the ranks' error on. engine_store_delta.cpp.
    /// Errors  wrong_state (base not served, two-phase, asleep), invalid_checkpoint (a bad delta).
    bool          update_from_store_delta(const ControlCommand & cmd, ControlResult & r);
    std::unique_ptr<weights::WeightSource>    store_source_;  ///< rsync: the engine's own view of the store, made at first use
    /// The private copy of a store version that store deltas were written into (update_from_store_delta):
    /// while it is serving_dir_ it holds the store's `version` (manifest fingerprint `fingerprint`).
    struct StoreServing {
        std::string        version, fingerprint;
        weights::StoreCopy copy;  ///< removed with its hold (replaced by the next copy, or at exit)
    };
    StoreServing                              store_serving_;

    /// Every rank's layout plan (weights::plan_rank_layouts), made at the first ipc delta: the
    /// engine splits those deltas per rank before the ranks apply them.
    const std::vector<model::WeightLayout> & delta_layouts();
    std::vector<model::WeightLayout>          delta_layouts_;

    /// update_weights {"version": V} on --load-strategy ipc when the port's ipc delta record
    /// (fd/weights/ipc_delta.h) makes V: copy it into a private dir, check it (409 unless the
    /// serving weights are exactly its base_version as loaded from this port's weights records, or
    /// deltas applied on them; 422 naming a bad tensor), split it per rank and apply it in place
    /// (apply_delta_on_ranks: all ranks or none), then flip the label. Returns false when the
    /// delta record is absent or makes another version (a full update follows).
    /// engine_ipc_delta.cpp. Errors  wrong_state, invalid_checkpoint, source_unavailable (retry).
    bool          update_from_ipc_delta(const ControlCommand & cmd, ControlResult & r);
    /// After a full load from the ipc weights records (update or wakeup): remember which records
    /// (weights::ipc_record_ids, read `before` the load and again now) the serving bytes are, when
    /// nothing republished them meanwhile (`before` nullopt: not loaded from them); forget the
    /// applied ipc deltas (their files are removed).
    void          note_ipc_load(const std::optional<std::vector<weights::IpcRecordId>> & before);
    /// A wakeup's reload from the ipc weights records, `before` = their ids before it: when ipc
    /// deltas were applied and the records are still the ones they were applied on, apply them
    /// again in order (true: the serving label stays). Else note_ipc_load (false: the label
    /// follows the records). Errors  as apply_delta_on_ranks; then the weights are released again
    /// (asleep), the deltas kept.
    bool          replay_ipc_deltas(const std::optional<std::vector<weights::IpcRecordId>> & before);
    /// The ipc weights records' ids before a load of `req` when it reads them (ipc, no weight_dir), else nullopt.
    std::optional<std::vector<weights::IpcRecordId>> ipc_ids_if_source(const weights::FetchRequest & req) const;
    /// The ipc weights records the serving bytes were loaded from and the ipc deltas applied on them since.
    struct IpcServing {
        std::vector<weights::IpcRecordId>  base;    ///< empty: the serving bytes did not come from the records
        std::vector<std::filesystem::path> deltas;  ///< each delta's weights.fddelta (with its .rank<r> shares), commit order
    };
    IpcServing                                ipc_serving_;
    int64_t                                   ipc_chain_bytes_ = 0;   ///< the kept deltas' files (HF), all of them
    int64_t                                   ipc_merged_bytes_ = 0;  ///< the first kept delta's, right after the last merge
    /// Merge the kept ipc deltas into one (weights::merge_weight_deltas, split per rank again)
    /// when they outgrow max(FD_IPC_DELTA_MERGE_BYTES (default 64 MiB), twice the last merge):
    /// what the wakeups keep and replay stays bounded by about the model's size. A failed merge
    /// keeps the chain (logged). engine_ipc_delta.cpp.
    void          maybe_merge_ipc_deltas() noexcept;
    std::shared_ptr<void>                     ipc_delta_dir_;  ///< the private dir of ipc deltas (removed with its last reference)
    int64_t                                   ipc_delta_seq_ = 0;

    std::mutex                                hook_mu_;
    std::function<int64_t()>                  weight_sleep_hook_;  ///< set_weight_sleep_hook (hook_mu_)

    mutable std::mutex                        inbox_mu_;
    std::condition_variable                   inbox_cv_;
    std::deque<std::variant<GenerateRequest, std::shared_ptr<PendingControl>>> inbox_;
    std::atomic<bool>                         stop_{false};
    std::atomic<bool>                         draining_{false};
    std::atomic<bool>                         accepting_{true};   ///< false while paused/asleep
    bool serving_verified_ = false;  ///< the serving weights were checked against manifest checksums: a wakeup checks again
    /// A sleep released the CUDA graphs (tag cuda_graph, not a sleeping state): the cuda_graph
    /// wakeup after it counts as waking a tag (it resumes), a retried one does not.
    bool graphs_released_ = false;
    /// The source's own name for the serving bytes (an rsync store version), which the label may
    /// not be (an fp- label when that version once named other bytes): what a wakeup pulls again.
    /// "" = not known (then the label).
    std::string serving_source_version_, staged_source_version_;
    bool staged_verified_  = false;  ///< the same for the staged version
    /// The 503 a request gets while admission is stopped (submit) or when it reaches the engine
    /// behind a pause or sleep (admit).
    static constexpr const char * kPausedMessage =
        "generation is paused (weight control in progress); retry after POST /v1/resume or /v1/wakeup";
    /// The same 503 while a pause mode=wait drains (GET /health: state "pausing").
    static constexpr const char * kPauseDrainingMessage =
        "generation is pausing: a pause (mode=wait) is draining, letting the requests in flight finish, and admits no new ones "
        "(GET /health: state \"pausing\"); the engine is paused once they have (or serving again if the pause times out): retry after "
        "POST /v1/resume, or on another replica";
    std::atomic<bool>                         degraded_{false};   ///< a rank failed (state_.degraded, readable by submit())
    std::atomic<bool>                         control_waiting_{false}; ///< a command is queued: drop the step in flight
    std::thread                               thread_;

    mutable std::mutex                        stats_mu_;
    EngineStats                               stats_;
    metrics::RequestMetrics                   request_metrics_;
    std::chrono::steady_clock::time_point     t_step_done_{};  ///< when this step's forward returned
};

}  // namespace fd::engine
