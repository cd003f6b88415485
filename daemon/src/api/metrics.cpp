// GET /metrics (Prometheus text format 0.0.4) and GET /version.
//
// Naming follows Prometheus' rules (https://prometheus.io/docs/practices/naming/): one
// `fdrollout_` prefix, base units in the name (`_seconds`, `_bytes`), counters end in `_total`,
// `_info` gauges carry their data in labels. Request metrics carry `model_name` (as vLLM's
// do); `process_*` are the standard process collector's. tests/e2e/test_metrics.py parses this
// output and checks every family against those rules.
#include "handlers.h"

#include "fd/build_info.h"
#include "fd/metrics/process_stats.h"
#include "fd/utf8.h"

#include <fmt/format.h>

#include <string>

namespace fd::api {
namespace {

/// Prometheus label value: UTF-8 (each ill-formed part as U+FFFD, utf8::lossy: the
/// exposition format is UTF-8), backslash, double quote and newline escaped.
std::string label_value(const std::string & raw) {
    const std::string v = utf8::lossy(raw);
    std::string out;
    for (const char c : v) {
        if (c == '\\' || c == '"') { out += '\\'; }
        if (c == '\n') { out += "\\n"; continue; }
        out += c;
    }
    return out;
}

/// The labels of a per-version series.
std::string version_label(const std::string & v) { return "weight_version=\"" + label_value(v) + "\""; }

/// Writes one metric family at a time: HELP and TYPE once, then its samples.
class PromWriter {
public:
    void family(const char * name, const char * type, const char * help) {
        out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    }
    /// `labels` is the inside of {...} (already escaped), or empty.
    template <typename T>
    void sample(const std::string & name, const std::string & labels, T value) {
        if (labels.empty()) {
            out_ += fmt::format("{} {}\n", name, value);
        } else {
            out_ += fmt::format("{}{{{}}} {}\n", name, labels, value);
        }
    }
    template <typename T>
    void single(const char * name, const char * type, const char * help, T value, const std::string & labels = "") {
        family(name, type, help);
        sample(name, labels, value);
    }
    void histogram(const char * name, const char * help, const metrics::Histogram::Snapshot & h, const std::string & labels) {
        family(name, "histogram", help);
        const std::string sep = labels.empty() ? "" : labels + ",";
        for (size_t i = 0; i < h.upper_bounds.size(); ++i) {
            sample(std::string(name) + "_bucket", fmt::format("{}le=\"{}\"", sep, h.upper_bounds[i]), h.cumulative[i]);
        }
        sample(std::string(name) + "_bucket", sep + "le=\"+Inf\"", h.count);
        sample(std::string(name) + "_sum", labels, h.sum);
        sample(std::string(name) + "_count", labels, h.count);
    }
    std::string take() { return std::move(out_); }

private:
    std::string out_;
};

}  // namespace

void get_metrics(ApiContext & ctx, const Request &, Response & res) {
    const auto st = ctx.engine->stats();
    const auto & es = st.state;
    const auto & rm = ctx.engine->request_metrics();
    const std::string model = "model_name=\"" + label_value(ctx.cfg.served_model_name) + "\"";
    PromWriter w;

    // Requests and tokens (labelled with the model, like vLLM's).
    w.single("fdrollout_requests_total", "counter", "Completion requests accepted.", st.n_requests_total, model);
    w.family("fdrollout_requests_finished_total", "counter", "Choices finished, by finish reason (a request with n choices counts n; a client that went away: abort).");
    for (size_t i = 0; i < metrics::kFinishReasonNames.size(); ++i) {
        w.sample("fdrollout_requests_finished_total", fmt::format("{},finished_reason=\"{}\"", model, metrics::kFinishReasonNames[i]),
                 rm.n_finished[i].load(std::memory_order_relaxed));
    }
    w.single("fdrollout_prompt_tokens_total", "counter", "Prompt tokens admitted, per choice (n choices count their prompt n times).", st.n_tokens_prompt_total, model);
    w.single("fdrollout_prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache.", st.n_tokens_cached_total, model);
    w.single("fdrollout_generation_tokens_total", "counter", "Tokens generated.", st.n_tokens_generated_total, model);
    w.histogram("fdrollout_time_to_first_token_seconds", "Arrival to first sampled token, per choice.", rm.ttft_s.snapshot(), model);
    w.histogram("fdrollout_inter_token_latency_seconds", "Between consecutive tokens of one choice.", rm.itl_s.snapshot(), model);
    w.histogram("fdrollout_e2e_request_latency_seconds", "Arrival to the finishing event, per choice.", rm.e2e_s.snapshot(), model);
    w.histogram("fdrollout_request_queue_time_seconds", "Arrival to first scheduled, per choice.", rm.queue_s.snapshot(), model);

    // Scheduler and KV cache.
    w.single("fdrollout_num_requests_running", "gauge", "Sequences in the running batch.", st.n_running);
    w.single("fdrollout_num_requests_waiting", "gauge", "Sequences waiting for admission.", st.n_waiting);
    w.single("fdrollout_preemptions_total", "counter", "Sequences preempted (swap + recompute).", st.n_preemptions_total);
    w.single("fdrollout_swap_preemptions_total", "counter", "Sequences preempted by swapping their KV to the host pool.",
             st.n_swap_preemptions_total);
    w.single("fdrollout_recompute_preemptions_total", "counter", "Sequences preempted by recompute (KV released).",
             st.n_recompute_preemptions_total);
    w.single("fdrollout_num_requests_swapped", "gauge", "Sequences whose KV is in the host swap pool.", st.n_swapped);
    w.single("fdrollout_kv_swap_blocks_used", "gauge", "Host swap pool blocks holding swapped-out KV.", st.n_swap_blocks_used);
    w.single("fdrollout_kv_swap_blocks_capacity", "gauge", "Blocks in the host swap pool (--swap-space; 0 = off).", st.n_swap_blocks_total);
    w.single("fdrollout_kv_swap_out_bytes_total", "counter", "KV bytes copied device -> host pool (all ranks).", st.swap_out_bytes_total);
    w.single("fdrollout_kv_swap_in_bytes_total", "counter", "KV bytes copied host pool -> device (all ranks).", st.swap_in_bytes_total);
    // The host KV tier's prefix blocks (prefix caching + --swap-space; transfer bytes/s = rate() of the byte counters).
    const int64_t bb = st.host_tier_block_bytes;
    w.single("fdrollout_kv_host_tier_cached_blocks", "gauge", "Host KV tier blocks holding evicted prefix blocks.", st.n_host_tier_blocks_cached);
    w.single("fdrollout_kv_host_tier_cached_bytes", "gauge", "Bytes of those blocks (all ranks).", st.n_host_tier_blocks_cached * bb);
    w.single("fdrollout_kv_host_tier_capacity_bytes", "gauge", "Bytes of the host pool (--swap-space, all ranks).", st.n_swap_blocks_total * bb);
    w.single("fdrollout_kv_host_tier_hits_total", "counter",
             "Prefix blocks a request's first admission took from the host tier (prompt_tokens_host_cached_total / block size).",
             st.n_host_tier_hits_total);
    w.single("fdrollout_kv_host_tier_loads_total", "counter",
             "Prefix blocks copied back from the host tier instead of recomputed (every admission, re-admissions after a preemption too).",
             st.n_host_tier_loads_total);
    w.single("fdrollout_kv_host_tier_offloads_total", "counter", "Reused device prefix blocks copied to the host tier (ahead of or at eviction).",
             st.n_host_tier_offloads_total);
    w.single("fdrollout_kv_host_tier_offloads_background_total", "counter",
             "Of those, the blocks copied ahead of eviction in the background (while a step computed).", st.n_host_tier_offloads_background_total);
    w.single("fdrollout_kv_host_tier_transfers_in_flight", "gauge", "Blocks of background tier copies not yet waited for.",
             st.n_host_tier_in_flight);
    w.single("fdrollout_kv_host_tier_evictions_total", "counter", "Host tier prefix blocks evicted (LRU) to make room.",
             st.n_host_tier_evictions_total);
    w.single("fdrollout_kv_host_tier_invalidated_total", "counter", "Host tier prefix blocks dropped by a weight change or a cache flush.",
             st.n_host_tier_invalidated_total);
    w.single("fdrollout_kv_host_tier_out_bytes_total", "counter", "Prefix KV bytes copied device -> host tier (all ranks).",
             st.host_tier_out_bytes_total);
    w.single("fdrollout_kv_host_tier_in_bytes_total", "counter", "Prefix KV bytes copied host tier -> device (all ranks).",
             st.host_tier_in_bytes_total);
    w.single("fdrollout_kv_host_tier_transfers_paused", "gauge", "1 while tier copies are stopped (paused or draining).",
             st.host_tier_transfers_paused ? 1 : 0);
    w.single("fdrollout_prompt_tokens_host_cached_total", "counter", "Prompt tokens served from the host KV tier (part of the cached ones).",
             st.n_tokens_host_cached_total);
    w.single("fdrollout_kv_blocks_used", "gauge", "KV blocks in use.", st.n_kv_blocks_used);
    w.single("fdrollout_kv_blocks_free", "gauge", "KV blocks free (including evictable cached blocks).", st.n_kv_blocks_free);
    w.single("fdrollout_kv_blocks_capacity", "gauge", "KV blocks in the pool (used + free).", st.n_kv_blocks_total);
    {
        metrics::Histogram::Snapshot h;
        h.upper_bounds.assign(engine::kStepLatencyBuckets.begin(), engine::kStepLatencyBuckets.end());
        int64_t cum = 0;
        for (const int64_t c : st.step_latency_counts) { h.cumulative.push_back(cum += c); }
        h.count = cum;
        h.sum   = st.step_latency_sum_s;
        w.histogram("fdrollout_step_latency_seconds", "Engine step latency.", h, "");
    }

    // Weight control state.
    w.single("fdrollout_weight_version_info", "gauge", "Weight version being served.", 1,
             "weight_version=\"" + label_value(es.weight_version) + "\"");
    w.single("fdrollout_paused", "gauge", "1 while generation is paused.", es.paused ? 1 : 0);
    w.single("fdrollout_pause_draining", "gauge", "1 while a pause mode=wait drains (admission stopped, requests in flight finishing; "
             "not yet paused).", es.pause_draining ? 1 : 0);
    w.single("fdrollout_weights_valid", "gauge", "1 when the loaded weights are valid.", es.weights_valid ? 1 : 0);
    w.single("fdrollout_model_weights_status", "gauge", "Legacy status word: 0 normal, 1 updating, -1 clearing, -2 cleared.",
             static_cast<int>(ctx.control->legacy_word().status()));
    w.single("fdrollout_degraded", "gauge", "1 while a rank has failed (generation refused until wakeup recovers it).", es.degraded ? 1 : 0);
    w.family("fdrollout_rank_failed", "gauge", "Ranks known dead or stuck (value 1).");
    for (const int32_t rk : es.failed_ranks) { w.sample("fdrollout_rank_failed", fmt::format("rank=\"{}\"", rk), 1); }
    w.single("fdrollout_comm_group_connected", "gauge", "1 while the ranks' communication group is connected (also with none).",
             es.comm_group == "disconnected" ? 0 : 1,
             fmt::format("backend=\"{}\",executor=\"{}\"", es.comm_backend, es.executor_backend));
    // CUDA ranks' device memory (absent on cpu), as /health device_memory: at most ~1 s old.
    if (const auto devs = ctx.engine->rank_devices(); !devs.empty()) {
        w.family("fdrollout_device_memory_used_bytes", "gauge", "Device memory in use on each CUDA rank's device (cudaMemGetInfo total - free; every process's).");
        for (const auto & d : devs) { w.sample("fdrollout_device_memory_used_bytes", fmt::format("rank=\"{}\",device=\"{}\"", d.rank, d.device), d.total_bytes - d.free_bytes); }
        w.family("fdrollout_device_memory_total_bytes", "gauge", "Memory of each CUDA rank's device.");
        for (const auto & d : devs) { w.sample("fdrollout_device_memory_total_bytes", fmt::format("rank=\"{}\",device=\"{}\"", d.rank, d.device), d.total_bytes); }
        w.family("fdrollout_device_memory_held_bytes", "gauge", "Bytes each CUDA rank's allocator holds, by memory tag (kv_swap is pinned host memory).");
        for (const auto & d : devs) {
            int t = 0;
            for (const char * tag : {"weight", "kv_cache", "staging", "kv_swap"}) {
                w.sample("fdrollout_device_memory_held_bytes", fmt::format("rank=\"{}\",tag=\"{}\"", d.rank, tag), d.held_bytes[t++]);
            }
        }
    }
    w.family("fdrollout_sleeping", "gauge", "Memory tags asleep.");
    w.sample("fdrollout_sleeping", "tag=\"weight\"", es.weight_asleep ? 1 : 0);
    w.sample("fdrollout_sleeping", "tag=\"kv_cache\"", es.kv_asleep ? 1 : 0);
    w.family("fdrollout_control_in_flight", "gauge", "Control operation running now.");
    // Every op the engine runs (engine::Engine::run_control's names), so a series exists before
    // its first run; an op not listed still shows while it runs (a probe: flush_cache,
    // commit_weights, drop_staged_weights and abort_request never showed).
    bool listed = es.control_in_flight.empty();
    for (const char * op : {"pause", "resume", "sleep", "wakeup", "update_weights", "commit_weights", "drop_staged_weights",
                            "flush_cache", "abort_request", "stage_stream_bucket", "open_landing"}) {
        listed = listed || es.control_in_flight == op;
        w.sample("fdrollout_control_in_flight", fmt::format("op=\"{}\"", op), es.control_in_flight == op ? 1 : 0);
    }
    if (!listed) { w.sample("fdrollout_control_in_flight", fmt::format("op=\"{}\"", label_value(es.control_in_flight)), 1); }
    w.family("fdrollout_control_ops_total", "counter", "Control operations run.");
    for (const auto & [op, c] : st.control_ops) { w.sample("fdrollout_control_ops_total", fmt::format("op=\"{}\"", op), c.n_total); }
    w.family("fdrollout_control_errors_total", "counter", "Control operations that failed.");
    for (const auto & [op, c] : st.control_ops) { w.sample("fdrollout_control_errors_total", fmt::format("op=\"{}\"", op), c.n_errors); }
    w.family("fdrollout_control_seconds_total", "counter", "Total seconds spent in control operations.");
    for (const auto & [op, c] : st.control_ops) { w.sample("fdrollout_control_seconds_total", fmt::format("op=\"{}\"", op), c.seconds_sum); }
    w.family("fdrollout_control_last_seconds", "gauge", "Duration of the latest control operation.");
    for (const auto & [op, c] : st.control_ops) { w.sample("fdrollout_control_last_seconds", fmt::format("op=\"{}\"", op), c.seconds_last); }
    const auto progress = Progress::current().snapshot();
    w.single("fdrollout_progress_done_bytes", "gauge", "Bytes done by the long phase running now (0 when none).",
             progress ? progress->bytes_done : 0);
    w.single("fdrollout_progress_total_bytes", "gauge", "Bytes the long phase running now moves (0 when none or unknown).",
             progress ? progress->bytes_total : 0);

    // vLLM's names (vllm/v1/metrics/loggers.py) for the series whose meaning is the same, beside
    // ours, so vLLM dashboards and autoscalers read fdrollout unchanged (docs/operations.md has the
    // mapping). Counters carry `_total` as prometheus_client exposes them; labelled model_name.
    w.single("vllm:num_requests_running", "gauge", "Number of requests in model execution batches (= fdrollout_num_requests_running).",
             st.n_running, model);
    w.single("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed (= fdrollout_num_requests_waiting).",
             st.n_waiting, model);
    w.single("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage (fdrollout_kv_blocks_used / _capacity).",
             st.n_kv_blocks_total > 0 ? static_cast<double>(st.n_kv_blocks_used) / static_cast<double>(st.n_kv_blocks_total) : 0.0, model);
    w.single("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens (= fdrollout_prompt_tokens_total).",
             st.n_tokens_prompt_total, model);
    w.single("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens (= fdrollout_prompt_tokens_cached_total).",
             st.n_tokens_cached_total, model);
    w.single("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine (= fdrollout_preemptions_total).",
             st.n_preemptions_total, model);
    w.single("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed (= fdrollout_prompt_tokens_total).", st.n_tokens_prompt_total, model);
    w.single("vllm:generation_tokens_total", "counter", "Number of generation tokens processed (= fdrollout_generation_tokens_total).",
             st.n_tokens_generated_total, model);
    w.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed, per finished choice.", rm.prompt_tokens.snapshot(), model);
    w.histogram("vllm:request_generation_tokens", "Number of generation tokens processed, per finished choice.", rm.generation_tokens.snapshot(), model);
    w.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds (= fdrollout_time_to_first_token_seconds).",
                rm.ttft_s.snapshot(), model);
    w.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds (= fdrollout_inter_token_latency_seconds).",
                rm.itl_s.snapshot(), model);
    w.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds (= fdrollout_e2e_request_latency_seconds).",
                rm.e2e_s.snapshot(), model);
    w.histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request (= fdrollout_request_queue_time_seconds).",
                rm.queue_s.snapshot(), model);

    // Speculative decoding (--speculative-config): per recent weight version (spec::kVersionsKept), and vLLM's names over all versions.
    w.family("fdrollout_spec_decode_num_drafts_total", "counter", "Draft proposals verified (one per speculating sequence per step), by weight version.");
    for (const auto & [v, c] : st.spec_by_version) { w.sample("fdrollout_spec_decode_num_drafts_total", version_label(v), c.n_drafts); }
    w.family("fdrollout_spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed and verified, by weight version.");
    for (const auto & [v, c] : st.spec_by_version) { w.sample("fdrollout_spec_decode_num_draft_tokens_total", version_label(v), c.n_draft_tokens); }
    w.family("fdrollout_spec_decode_num_accepted_tokens_total", "counter", "Draft tokens the target accepted, by weight version.");
    for (const auto & [v, c] : st.spec_by_version) { w.sample("fdrollout_spec_decode_num_accepted_tokens_total", version_label(v), c.n_accepted_tokens); }
    w.family("fdrollout_spec_decode_mean_accepted_length", "gauge", "1 + accepted / drafts: tokens per target forward of a speculating sequence, by weight version.");
    for (const auto & [v, c] : st.spec_by_version) { w.sample("fdrollout_spec_decode_mean_accepted_length", version_label(v), c.mean_accepted_length()); }
    w.single("fdrollout_spec_decode_disabled_steps_total", "counter", "Steps that verified no draft because more sequences ran than disable_by_batch_size.",
             st.n_spec_steps_off_total);
    w.single("fdrollout_sequence_forwards_total", "counter", "Sequence-steps that produced tokens (generation tokens / this = tokens per target forward).",
             st.n_target_forwards_total);
    {
        // Over every version ever, not the sum of the kept ones: a counter never goes down when an
        // old version's series leave (spec::keep_recent_versions).
        const spec::DraftCounters & all = st.spec_total;
        if (st.spec_method != "none") {
            w.single("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.", all.n_drafts, model);
            w.single("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.", all.n_draft_tokens, model);
            w.single("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.", all.n_accepted_tokens, model);
            w.family("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted tokens per draft position.");
            for (int32_t i = 0; i < st.num_speculative_tokens; ++i) {
                const int64_t n = static_cast<size_t>(i) < all.accepted_per_pos.size() ? all.accepted_per_pos[static_cast<size_t>(i)] : 0;
                w.sample("vllm:spec_decode_num_accepted_tokens_per_pos_total", model + fmt::format(",position=\"{}\"", i), n);
            }
        }
    }

    // Build and process.
    w.single("fdrollout_build_info", "gauge", "Build of this fdrollout (value 1).", 1,
             fmt::format("version=\"{}\",git_commit=\"{}\"", label_value(kVersion), label_value(kGitCommit)));
    const metrics::ProcessStats ps = metrics::read_process_stats();
    w.single("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.", ps.cpu_seconds_total);
    w.single("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", ps.resident_memory_bytes);
    w.single("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", ps.virtual_memory_bytes);
    w.single("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.", ps.start_time_seconds);
    w.single("process_open_fds", "gauge", "Number of open file descriptors.", ps.open_fds);
    w.single("process_max_fds", "gauge", "Maximum number of open file descriptors.", ps.max_fds);
    res.set_content(w.take(), "text/plain; version=0.0.4; charset=utf-8");
}

void get_version(ApiContext &, const Request &, Response & res) {
    res.set_content(dump(nlohmann::json{{"version", kVersion}, {"git_commit", kGitCommit}}), "application/json");
}

}  // namespace fd::api
