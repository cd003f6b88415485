// fdrollout — the rollout daemon: flags → Config → model → engine → HTTP, then wait for a signal.
#include "fd/api/server.h"
#include "fd/api/throughput_logger.h"
#include "fd/build_info.h"
#include "fd/config.h"
#include "fd/control/service.h"
#include "fd/control/shm_watcher.h"
#include "fd/deadline.h"
#include "fd/engine/engine.h"
#include "fd/kernels/cpu_ops.h"
#include "fd/log.h"
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/tokenizer/tokenizer.h"
#include "fd/model/worker.h"
#include "fd/runtime/mp_executor.h"
#include "fd/runtime/node_join.h"
#include "fd/weights/fingerprint.h"
#include "fd/weights/weight_source.h"

#include <CLI/CLI.hpp>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <cstdlib>
#include <iostream>
#include <thread>
#include <vector>

#ifndef FD_DEFAULT_MODEL_DIR
#define FD_DEFAULT_MODEL_DIR "models/stories260K"
#endif

namespace {

/// The embedded model: next to an installed binary (BIN/../share/fdrollout/models/stories260K),
/// else the source tree this binary was built from.
std::string default_model_dir() {
    std::error_code ec;
    const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) {
        const auto installed = exe.parent_path().parent_path() / "share" / "fdrollout" / "models" / "stories260K";
        if (std::filesystem::is_regular_file(installed / "config.json", ec)) { return installed.string(); }
    }
    return FD_DEFAULT_MODEL_DIR;
}

/// "[default: on] " for a negatable flag's help: CLI11 prints the value the negated name sets
/// (`--no-x{false}`), which reads as the default; this says the real one (issue #26).
std::string on_off(bool dflt) { return fmt::format("[default: {}] ", dflt ? "on" : "off"); }

void add_flags(CLI::App & app, fd::Config & c) {
    c.model.model_dir = default_model_dir();
    app.add_option("--model", c.model.model_dir, "Hugging Face checkpoint dir (config.json, *.safetensors [+ index], tokenizer.json or tokenizer.model)")
        ->envname("FD_MODEL")->capture_default_str();
    app.add_option("--host", c.server.host, "Address to listen on")->envname("FD_HOST")->capture_default_str();
    app.add_option("--port", c.server.port, "TCP port to listen on")->envname("FD_PORT")->capture_default_str();
    app.add_option("--served-model-name", c.server.served_model_names,
                   "Model name(s) clients send (vLLM's flag; default: model dir name): a request's 'model' may be any of them, "
                   "/v1/models lists each, responses report the first")
        ->envname("FD_SERVED_MODEL_NAME");
    app.add_option("--chat-template", c.server.chat_template,
                   "Chat template for /v1/chat/completions instead of the model's (vLLM's flag): a Jinja file, or the template "
                   "itself")->envname("FD_CHAT_TEMPLATE");
    app.add_flag("--trust-request-chat-template", c.server.trust_request_chat_template,
                 "Let a chat request bring its own 'chat_template' (vLLM's flag; refused with 400 otherwise)")
        ->envname("FD_TRUST_REQUEST_CHAT_TEMPLATE");
    app.add_option("--api-key", c.server.api_key,
                   "Require 'Authorization: Bearer KEY' on every route except GET /health, /metrics and /version (generation, "
                   "/v1/models, and the V1 and legacy control routes unless --control-api-key is set); the shm control block "
                   "is guarded only by its mode 0600 (same user)")
        ->envname("FD_API_KEY");
    app.add_option("--control-api-key", c.server.control_api_key,
                   "The key the weight-control routes (V1 and legacy) require instead of --api-key, so a rollout client's "
                   "key cannot pause or replace the weights")->envname("FD_CONTROL_API_KEY");
    app.add_flag("--allow-unauthenticated", c.server.allow_unauthenticated,
                 "Start on a non-loopback --host without --api-key (refused otherwise)")->envname("FD_ALLOW_UNAUTHENTICATED");
    app.add_option("--weight-version", c.model.weight_version, "Weight version reported when the model dir has no version.yaml 'step'")
        ->envname("FD_WEIGHT_VERSION")->capture_default_str();
    app.add_option("--device", c.model.device, "Backend: cpu | cuda (a CUDA build with a visible device; none visible: exit 10)")
        ->envname("FD_DEVICE")->capture_default_str();
    app.add_option("--gpu-memory-utilization", c.model.gpu_memory_utilization,
                   "cuda: fraction (0, 1] of the device's memory this instance may use; the KV pool gets what the weights, "
                   "activations and other processes leave (vLLM's rule). Refused on cpu (use --kv-cache-bytes)")
        ->envname("FD_GPU_MEMORY_UTILIZATION");
    app.add_flag("!--no-batch-invariant", c.model.batch_invariant,
                 std::string(c.model.batch_invariant ? "[default: batch-invariant kernels; this flag turns them off] " : "") + "Allow a row's logits to depend on the batch (cuda: cuBLAS heuristic SGEMM for F32 weights without bias; cpu: the same kernels)");
    app.add_option("--compute-dtype", c.model.compute_dtype,
                   "The linear layers' arithmetic: float32 (x and widened weights in f32: the default, today's numerics) | "
                   "bfloat16 (x rounded to bf16, bf16 weights, exact products summed in f32: a trainer's bf16 autocast "
                   "matmul; AVX512_BF16 when the CPU has it, same bits without; F32 weights are rounded to bf16 as read). "
                   "cpu only; docs/sampling.md")
        ->envname("FD_COMPUTE_DTYPE")->capture_default_str();
    app.add_option("--tensor-parallel-size", c.model.tensor_parallel_size, "Tensor-parallel ranks (must divide the KV heads; > 1 runs one process per rank: mp)")
        ->envname("FD_TENSOR_PARALLEL_SIZE")->capture_default_str();
    app.add_option("--threads", c.model.n_threads, "CPU kernel threads per rank, 0..1024 (0 = every CPU this process may use: its affinity mask, capped by a cgroup CPU quota)")->envname("FD_THREADS")->capture_default_str();
    auto & p = c.parallel;
    app.add_option("--distributed-executor-backend", p.distributed_executor_backend,
                   "uni: the rank runs in the daemon's process; mp: one process per rank (default: uni at tp=1, mp at tp>1)")
        ->envname("FD_DISTRIBUTED_EXECUTOR_BACKEND")->check(CLI::IsMember({"uni", "mp"}));
    app.add_option("--nnodes", p.nnodes, "Hosts the ranks span")->envname("FD_NNODES")->capture_default_str();
    app.add_option("--node-rank", p.node_rank, "This host's index in [0, --nnodes)")->envname("FD_NODE_RANK")->capture_default_str();
    app.add_option("--master-addr", p.master_addr, "Node 0's address (IPv4): its rendezvous store, and where other nodes join; "
                   "node 0's ranks bind it for Gloo")
        ->envname("FD_MASTER_ADDR")->capture_default_str();
    app.add_option("--master-port", p.master_port, "Single node: the rendezvous store's port (0 = any free port). --nnodes > 1: "
                   "the port node 0 listens on for the other nodes (required)")
        ->envname("FD_MASTER_PORT")->capture_default_str();
    app.add_option("--node-addr", p.node_addr, "Node k > 0: the IPv4 address its ranks bind for Gloo and join from "
                   "(default: the one that reaches --master-addr)")->envname("FD_NODE_ADDR");
    app.add_option("--dist-token-file", p.dist_token_file, "--nnodes > 1: file holding the nodes' shared join secret (same bytes on "
                   "every node, owned by you, mode 0600; else the FD_DIST_TOKEN environment variable)")->envname("FD_DIST_TOKEN_FILE");
    app.add_flag("--shutdown-comm-group-if-worker-idle,!--no-shutdown-comm-group-if-worker-idle", p.shutdown_comm_group_if_worker_idle,
                 on_off(p.shutdown_comm_group_if_worker_idle) + "mp backend: sleep with the weight tag closes the ranks' communication group (its sockets), wakeup rebuilds it "
                 "before reloading")->envname("FD_SHUTDOWN_COMM_GROUP_IF_WORKER_IDLE")->capture_default_str();
    app.add_flag("--enable-expert-parallel", p.enable_expert_parallel,
                 "MoE models: spread the experts over the --tensor-parallel-size ranks (vLLM's flag): each rank holds "
                 "num_experts / tp experts whole, attention stays tensor-parallel; tokens' expert outputs are combined in a "
                 "fixed order, bitwise the same for every tp. Keeps the comm group on weight sleep unless "
                 "--shutdown-comm-group-if-worker-idle is given")->envname("FD_ENABLE_EXPERT_PARALLEL");
    app.add_option("--dist-backend", p.dist_backend, "mp backend: the ranks' all-reduce: gloo (TCP), shm (shared memory, every rank "
                   "on this host), nccl (--device cuda, one rank per device, one node) or auto (cuda: nccl when every rank has a "
                   "device of its own, else shm/gloo staged through host memory; cpu: shm when --nnodes 1, else gloo)")
        ->envname("FD_DIST_BACKEND")->check(CLI::IsMember({"auto", "gloo", "shm", "nccl"}))->capture_default_str();
    app.add_option("--rank-heartbeat-s", p.rank_heartbeat_s,
                   "mp backend: each rank process beats over its link every this / 10 while it works; one that sends no beat "
                   "this long (stopped, frozen, its node unreachable) is failed (rank_failed, /health degraded), within 1.2 x; "
                   "one that exits is noticed at once on every backend, whatever this says")
        ->envname("FD_RANK_HEARTBEAT_S")->check(CLI::Range(0.05, 3600.0))->capture_default_str();
    app.add_option("--rank-stuck-s", p.rank_stuck_s,
                   "mp backend: a rank that beats but whose main loop made no progress (no kernel job, no weight bytes, no request "
                   "taken) this long while the daemon waits on it is failed as stuck (a deadlock, a kernel that never returns); "
                   "waiting on a peer in a collective or on an rsync child does not count")
        ->envname("FD_RANK_STUCK_S")->check(CLI::Range(0.05, 86400.0))->capture_default_str();
    app.add_option("--max-num-seqs", c.engine.scheduler.max_num_seqs, "Most sequences in the running batch")
        ->envname("FD_MAX_NUM_SEQS")->capture_default_str();
    app.add_option("--max-num-batched-tokens", c.engine.scheduler.max_num_batched_tokens, "Token budget per engine step (prefill chunks + decodes)")
        ->envname("FD_MAX_NUM_BATCHED_TOKENS")->capture_default_str();
    app.add_option("--max-model-len", c.engine.max_model_len, "Most tokens (prompt + generated) per sequence (0 = model's max_position_embeddings)")
        ->envname("FD_MAX_MODEL_LEN")->capture_default_str();
    app.add_option("--block-size", c.kv.block_size_tokens, "Tokens per KV block (power of two)")->envname("FD_BLOCK_SIZE")->capture_default_str();
    app.add_option("--kv-cache-bytes", c.kv.kv_cache_bytes,
                   "KV pool size: bytes (512MiB, 2G, 1.5GiB), a fraction of available memory (0.3), or 0 = max-num-seqs full-length sequences (<= 2 GiB); the pool is pre-faulted")
        ->envname("FD_KV_CACHE_BYTES")->capture_default_str();
    app.add_option("--swap-space", c.kv.swap_space_gib,
                   "Host KV swap pool per rank, GiB (fractions allowed; 0 = off): a preempted sequence's KV is copied there and "
                   "back instead of being recomputed (recompute when the pool is full); pre-faulted. "
                   "FD_ENABLE_SWAP_SPACE_CLEARING=1: sleep(kv_cache) frees it too")
        ->envname("FD_SWAP_SPACE")->capture_default_str();
    app.add_option("--kv-cache-dtype", c.kv.kv_cache_dtype,
                   "KV cache element type (vLLM's flag): auto = float32 (today's numerics), float32, or bfloat16 (K/V rounded to "
                   "nearest even when stored, widened to f32 in attention: half the bytes per token, twice the blocks in the same "
                   "--kv-cache-bytes / --gpu-memory-utilization budget)")
        ->envname("FD_KV_CACHE_DTYPE")->capture_default_str();
    app.add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", c.kv.enable_prefix_caching,
                 on_off(c.kv.enable_prefix_caching) + "Reuse KV blocks of identical prompt prefixes (vLLM v1 defaults to on)")
        ->envname("FD_ENABLE_PREFIX_CACHING");
    // Every seconds flag is bounded by fd::kMaxWaitS (fd/deadline.h: past it a deadline's ticks overflow).
    app.add_option("--request-timeout-s", c.server.request_timeout_s, "Longest a completion may run before 504")
        ->envname("FD_REQUEST_TIMEOUT_S")->check(CLI::Range(1e-3, fd::kMaxWaitS))->capture_default_str();
    app.add_option("--http-io-threads", c.server.n_io_threads, "HTTP I/O threads (each holds thousands of idle or streaming connections)")
        ->envname("FD_HTTP_IO_THREADS")->check(CLI::Range(1, 64))->capture_default_str();
    app.add_option("--http-read-timeout-s", c.server.http_read_timeout_s,
                   "A request's header and body must arrive within this, else the connection is closed (slow or stalled clients)")
        ->envname("FD_HTTP_READ_TIMEOUT_S")->check(CLI::Range(1e-3, fd::kMaxWaitS))->capture_default_str();
    app.add_option("--http-keep-alive-s", c.server.keep_alive_timeout_s, "Idle HTTP connections are closed after this many seconds")
        ->envname("FD_HTTP_KEEP_ALIVE_S")->check(CLI::Range(1e-3, fd::kMaxWaitS))->capture_default_str();
    app.add_option("--shutdown-grace-s", c.shutdown_grace_s, "On SIGTERM/SIGINT: seconds in-flight requests may take to finish")
        ->envname("FD_SHUTDOWN_GRACE_S")->check(CLI::Range(0.0, fd::kMaxWaitS))->capture_default_str();
    app.add_flag("--dynamic-load-weight", c.control.dynamic_load_weight,
                 "Enable weight control: /v1/sleep, /v1/wakeup, /v1/update_weights and the legacy /clear_load_weight, /update_model_weight")
        ->envname("FD_DYNAMIC_LOAD_WEIGHT");
    // --load_strategy: FastDeploy's docs spell it with an underscore (issue #13)
    app.add_option("--load-strategy,--load_strategy", c.weights.load_strategy,
                   "Where wakeup/update take weights from: normal (the --model dir), ipc_snapshot (model_state.tp<rank>*.safetensors "
                   "in --model), ipc (a trainer's shared-memory record), rsync (a versioned store, see --rsync-config)")
        ->envname("FD_LOAD_STRATEGY")->capture_default_str();
    app.add_option("--rsync-config", c.weights.rsync_config,
                   "rsync strategy: JSON {\"source\": \"rsync://host:port/module\" | \"host:path\" | \"/path\", \"staging_dir\": DIR, "
                   "\"timeout_s\": 300}")
        ->envname("FD_RSYNC_CONFIG");
    app.add_option("--speculative-config", c.speculative_config,
                   "Speculative decoding (vLLM's flag): JSON {\"method\": \"ngram\" | \"mtp\", \"num_speculative_tokens\": k, "
                   "\"prompt_lookup_min\": n, \"prompt_lookup_max\": n (ngram only), \"disable_by_batch_size\": b}; ngram: "
                   "prompt-lookup drafts; mtp: drafts from the checkpoint's own next-token-prediction layer (MiMo, "
                   "num_nextn_predict_layers >= 1); drafts are verified exactly (outputs and logprobs unchanged). docs/speculative.md")
        ->envname("FD_SPECULATIVE_CONFIG");
    app.add_option("--update-staging", c.weights.update_staging,
                   "update_weights staging arena: persistent (kept resident between updates; updates copy at memory bandwidth, "
                   "RSS holds a second copy of the weights while awake) or transient (mapped per update)")
        ->envname("FD_UPDATE_STAGING")->check(CLI::IsMember({"persistent", "transient"}))->capture_default_str();
    app.add_flag("--use-cudagraph", c.engine.use_cudagraph, "CUDA graphs: on --device cuda (tp 1) decode steps run as CUDA graphs captured at start-up per batch-size bucket (1, 2, 4, ... powers of two, then --max-num-seqs), replayed after update_weights (which copies the staged weights into place) and a sleep/wakeup of weight or kv_cache; a cuda_graph release destroys them and each is captured again at its first step. docs/weight_control.md")
        ->envname("FD_USE_CUDAGRAPH");
    app.add_option("--control-timeout-s", c.control.control_timeout_s,
                   "Longest a V1 control call waits for the engine before 504; also the deadline of every weight read (load, wakeup, update)")
        ->envname("FD_CONTROL_TIMEOUT_S")->capture_default_str();
    app.add_flag("--check-finite-weights,!--no-check-finite-weights", c.weights.check_finite_weights,
                 on_off(c.weights.check_finite_weights) + "Refuse weights holding NaN/Inf at load, wakeup and update (checked while copying; 422 naming the tensor)")
        ->envname("FD_CHECK_FINITE_WEIGHTS")->capture_default_str();
    app.add_option("--log-level", c.log_level, "trace, debug, info, warn, error, critical, off")->envname("FD_LOG_LEVEL")->capture_default_str();
    app.add_option("--log-format", c.log_format, "text or json (one JSON object per line: time, level, logger, msg, pid, thread)")
        ->envname("FD_LOG_FORMAT")->check(CLI::IsMember({"text", "json"}))->capture_default_str();
    app.add_option("--log-stats-interval-s", c.log_stats_interval_s, "Seconds between throughput log lines while busy (0 = none)")
        ->envname("FD_LOG_STATS_INTERVAL_S")->check(CLI::Range(0.0, fd::kMaxWaitS))->capture_default_str();
}

/// Start-up loads what the label names (docs/weight_sources.md, "The version label names the
/// bytes served"). The ranks were built on the --model checkpoint; where the strategy says the
/// label names other bytes they load those through the source (stage + commit on every rank):
///   ipc_snapshot with model_state.tp*.safetensors in --model: the snapshot, labelled with
///     version.yaml `step` (the publisher's --version), else with its fingerprint label;
///   rsync with a version.yaml `step` V in --model: the store's V (--model, labelled V, when the
///     store has no V).
/// Otherwise the --model checkpoint serves under the label config.cpp chose. Sets
/// cfg.engine.weight_version and weight_fingerprint.
/// Errors  the source's (invalid_checkpoint, forbidden, source_unavailable ...): start-up fails.
void load_labelled_startup(fd::Config & cfg, const fd::weights::SourceConfig & scfg, fd::runtime::Executor & ex) {
    namespace fs = std::filesystem;
    auto lg = fd::log::get("weights");
    std::optional<std::string> version;  // the version to fetch (nullopt: the source's own)
    bool through_source = false;
    if (scfg.strategy == fd::weights::LoadStrategy::ipc_snapshot) {
        std::error_code ec;
        for (const auto & e : fs::directory_iterator(scfg.model_dir, ec)) {
            const std::string name = e.path().filename().string();
            if (name.rfind("model_state.tp", 0) == 0 && name.ends_with(".safetensors")) { through_source = true; }
        }
    } else if (scfg.strategy == fd::weights::LoadStrategy::rsync) {
        version        = fd::model::read_version_step(scfg.model_dir);
        through_source = version.has_value();
    }
    if (through_source) {
        try {
            const auto staged = ex.stage_weights({.version = version});
            ex.commit_weights();
            std::vector<std::string> fps;
            for (const auto & rep : staged) { fps.push_back(rep.fingerprint); }
            cfg.engine.weight_fingerprint = fd::weights::combine_fingerprints(fps);
            cfg.engine.weight_version     = staged[0].version ? *staged[0].version : fd::weights::fingerprint_label(cfg.engine.weight_fingerprint);
            lg->info("start-up: serving the {} source's weights, weight_version {}", fd::weights::to_string(scfg.strategy),
                     cfg.engine.weight_version);
            return;
        } catch (const fd::Error & e) {
            if (scfg.strategy != fd::weights::LoadStrategy::rsync || e.code() != fd::Errc::not_found) { throw; }
            lg->warn("start-up: {}; serving --model {} as weight_version {} (its version.yaml)", e.what(), scfg.model_dir.string(),
                     cfg.engine.weight_version);
        }
    }
    // Every rank read the --model files: the fingerprint the ranks' fetches of them combine to.
    const std::string fp = fd::weights::checkpoint_fingerprint(fd::model::read_tensor_index(scfg.model_dir));
    cfg.engine.weight_fingerprint = fd::weights::combine_fingerprints(std::vector<std::string>(ex.world_size(), fp));
}

/// vLLM flags typed by habit (issue #26): accepted with vLLM's meaning where fdrollout has it,
/// else a usage error (exit 2) naming the fdrollout equivalent. `fdrollout serve MODEL` (vLLM's
/// form) is main()'s: it reads as --model MODEL.
void add_vllm_flags(CLI::App & app, fd::Config & c) {
    app.add_flag_callback("--enable-sleep-mode", [&c] { c.control.dynamic_load_weight = true; },
                          "vLLM's flag: the same as --dynamic-load-weight (sleep/wake_up and the other weight-control routes)");
    app.add_option_function<std::string>(
        "--dtype",
        [](const std::string & v) {
            if (v != "auto") {
                throw CLI::ValidationError("--dtype", fmt::format("'{}': weights stay in the checkpoint's own dtype (F32 or BF16; F16 is "
                                                                   "widened to F32), so only --dtype auto is accepted; for bf16 "
                                                                   "arithmetic in the linear layers pass --compute-dtype bfloat16", v));
            }
        },
        "vLLM's flag: auto only (the checkpoint's own dtype)");
    app.add_option_function<int64_t>(
        "--seed",
        [](int64_t) {
            throw CLI::ValidationError("--seed", "fdrollout has no server-wide seed: send \"seed\" in each request (vLLM's per-request "
                                                 "field); a request without one draws fresh randomness");
        },
        "vLLM's flag: refused (send \"seed\" per request)");
    app.add_flag("--enable-return-routed-experts", c.server.enable_return_routed_experts,
                 "MoE models: a request with \"return_routed_experts\": true gets each choice's routed experts (rollout routing "
                 "replay, R3; vLLM's flag)")
        ->envname("FD_ENABLE_RETURN_ROUTED_EXPERTS");
    app.add_option("--generation-config", c.server.generation_config,
                   "Default sampling parameters (vLLM's flag): auto = the model's generation_config.json (temperature, top_p, "
                   "top_k, min_p, repetition_penalty for fields a request leaves out; max_new_tokens caps every request's max "
                   "tokens), vllm = the built-in defaults, or a folder whose generation_config.json is read")
        ->envname("FD_GENERATION_CONFIG")->capture_default_str();
    app.add_option("--override-generation-config", c.server.override_generation_config,
                   "vLLM's flag: a JSON object of sampling defaults replacing --generation-config's, e.g. '{\"temperature\": 0.6, "
                   "\"max_new_tokens\": 512}' (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens; null clears one)")
        ->envname("FD_OVERRIDE_GENERATION_CONFIG");
    app.add_option("--max-logprobs", c.server.max_logprobs, "Largest logprobs / top_logprobs / prompt_logprobs a request may ask for (vLLM's flag)")
        ->envname("FD_MAX_LOGPROBS")->check(CLI::Range(0, 1024))->capture_default_str();
}

/// Until serving begins a SIGTERM/SIGINT stops start-up at once (a probe: loading a checkpoint,
/// pre-faulting the KV pool or waiting for other nodes held it for minutes, then the daemon
/// served and drained). Nothing serves yet, so nothing is drained: the control block this
/// daemon created is removed and the process exits 0; its rank processes exit when their links
/// close. stop() hands the signals back to main's sigwait.
class StartupSignals {
public:
    StartupSignals(sigset_t & signals, int port) : port_(port) {
        thread_ = std::thread([this, &signals] {
            const timespec tick{0, 50'000'000};
            while (!done_.load()) {
                const int sig = sigtimedwait(&signals, nullptr, &tick);
                if (sig <= 0) { continue; }
                fd::log::get("engine")->warn("signal {} during start-up: stopping now (exit 0)", sig);
                std::lock_guard lk(block_mu_);  // a create under way completes first: its block is removed, another daemon's never
                if (block_created_) { fd::shm::MappedBlock::remove(port_); }
                std::fflush(nullptr);
                std::_Exit(0);
            }
        });
    }
    ~StartupSignals() { stop(); }
    /// Create this port's control block, so that a signal meanwhile removes it before exiting.
    fd::shm::MappedBlock create_block() {
        std::lock_guard lk(block_mu_);
        auto b         = fd::shm::MappedBlock::create(port_);
        block_created_ = true;
        return b;
    }
    void stop() {
        done_.store(true);
        if (thread_.joinable()) { thread_.join(); }
    }

private:
    int               port_;
    std::atomic<bool> done_{false};
    std::mutex        block_mu_;
    bool              block_created_ = false;  ///< under block_mu_
    std::thread       thread_;
};

int run(fd::Config & cfg, sigset_t & signals) {
    auto lg = fd::log::get("engine");
    const fd::Resolved r = fd::resolve(cfg);
    const auto & par = cfg.parallel;
    if (par.nnodes > 1 && par.node_rank > 0) {
        // Node k > 0: no HTTP, no engine; its ranks take every engine option from node 0.
        return fd::runtime::node_agent_main({.nnodes = par.nnodes, .node_rank = par.node_rank, .tp = cfg.model.tensor_parallel_size,
                                             .master_addr = par.master_addr, .node_addr = par.node_addr, .model_dir = cfg.model.model_dir,
                                             .token = fd::runtime::load_dist_token(par.dist_token_file), .master_port = par.master_port,
                                             .timeout_s = cfg.control.control_timeout_s},
                                            signals);
    }
    const std::string dist_token = par.nnodes > 1 ? fd::runtime::load_dist_token(par.dist_token_file) : std::string();
    if (!fd::is_loopback_host(cfg.server.host) && cfg.server.api_key.empty()) {
        lg->warn("****************************************************************************************");
        lg->warn("--allow-unauthenticated: listening on {} WITHOUT an API key. Anyone who can reach this port", cfg.server.host);
        lg->warn("can generate, pause, put to sleep and REPLACE THE WEIGHTS of this daemon. Set --api-key and");
        lg->warn("--control-api-key unless this network is trusted.");
        lg->warn("****************************************************************************************");
    } else if (cfg.server.control_api_key.empty() && cfg.server.api_key.empty()) {
        lg->info("no --api-key: any local user can drive the weight-control routes over loopback (the shm control block "
                 "is guarded by its 0600 mode only)");
    }
    StartupSignals startup_signals(signals, cfg.server.port);
    // The control block first: it refuses to start when a live daemon owns this port.
    auto block = startup_signals.create_block();
    lg->info("model {} ({}): {} layers, hidden {}, heads {}/{}, vocab {}; weight_version {}", cfg.model.model_dir,
             r.model.architecture, r.model.n_layers, r.model.hidden_size, r.model.n_heads, r.model.n_kv_heads,
             r.model.vocab_size, cfg.engine.weight_version);
    if (!cfg.server.sampling_defaults.empty()) {  // vLLM warns the same way
        const std::string from = cfg.server.generation_config == "vllm" ? std::string("--override-generation-config")
                                 : fmt::format("the model's generation config ({}{})",
                                               cfg.server.generation_config == "auto" ? "generation_config.json" : cfg.server.generation_config,
                                               cfg.server.override_generation_config.empty() ? "" : " and --override-generation-config");
        lg->warn("default sampling parameters overridden by {}: {}; a request's own fields win, max_tokens caps every request. Start "
                 "with --generation-config vllm{} if this is not intended", from, cfg.server.sampling_defaults.describe(),
                 cfg.server.override_generation_config.empty() ? "" : " and without --override-generation-config");
    }
    auto tok = fd::tokenizer::load_tokenizer(cfg.model.model_dir, {.bos_token_id = r.model.bos_token_id});
    lg->info("tokenizer: {} ({} ids)", tok->kind(), tok->vocab_size());
    if (tok->vocab_size() > r.model.vocab_size) {
        lg->warn("the tokenizer has {} ids but config.json's vocab_size is {}: a prompt that encodes to an id >= {} (an added token "
                 "without a resized embedding) is refused with 400", tok->vocab_size(), r.model.vocab_size, r.model.vocab_size);
    }
    const bool graphs = cfg.engine.use_cudagraph && r.device == fd::kernels::DeviceKind::cuda;
    if (graphs) {
        lg->info("--use-cudagraph on cuda: decode steps of up to {} sequences run as CUDA graphs (captured at start-up){}",
                 cfg.engine.scheduler.max_num_seqs,
                 cfg.model.tensor_parallel_size > 1 ? "; not at tensor_parallel_size > 1, whose steps run eagerly" : "");
    }
    if (!cfg.model.batch_invariant) {
        lg->info("--no-batch-invariant: {}", r.device == fd::kernels::DeviceKind::cuda
                                                 ? "F32 linear layers without bias use cuBLAS's heuristic SGEMM"
                                                 : "accepted; the cpu backend's kernels are batch-invariant anyway");
    }
    const char * staged_fill_env = std::getenv("FD_TEST_STAGED_FILL");
    // --speculative-config method "mtp": every rank's worker runs its shard of MTP layer 0 as the draft.
    const int32_t mtp_k = cfg.engine.speculative.method == fd::spec::SpecMethod::mtp ? cfg.engine.speculative.num_speculative_tokens : 0;
    const fd::model::WorkerConfig wcfg{
        .rank = 0, .ep_size = r.world.ep, .device = r.device, .device_id = 0, .batch_invariant = cfg.model.batch_invariant,
        .compute = r.compute,
        .reserve_tokens = graphs ? cfg.engine.scheduler.max_num_batched_tokens : 0,
        .graph_max_batch = graphs ? cfg.engine.scheduler.max_num_seqs : 0,
        .test_device_paths = staged_fill_env && std::string(staged_fill_env) == "1",  // test-only hook (README)
        .n_threads = cfg.model.n_threads, .block_size = cfg.kv.block_size_tokens,
        .n_blocks = r.n_kv_blocks, .n_swap_blocks = r.n_swap_blocks, .kv_dtype = r.kv_dtype, .max_model_len = cfg.engine.max_model_len,
        .keep_update_staging = cfg.weights.update_staging == "persistent",
        .mtp_draft_tokens = mtp_k,
        .mtp_scratch_blocks = r.n_mtp_scratch_blocks,
        .check_finite_weights = cfg.weights.check_finite_weights, .io_timeout_s = cfg.control.control_timeout_s};
    {  // all ranks together (tp 1's block bytes)
        const int64_t target = r.n_kv_blocks * fd::model::Worker::kv_block_bytes(r.model, cfg.kv.block_size_tokens, 1, r.kv_dtype);
        const int64_t mtp    = mtp_k > 0 ? (r.n_kv_blocks + r.n_mtp_scratch_blocks) *
                                               fd::model::Worker::mtp_block_bytes(r.model, cfg.kv.block_size_tokens, 1) : 0;
        lg->info("KV budget (--kv-cache-bytes) {:.1f} MiB: target KV {} blocks = {:.1f} MiB{}", r.kv_budget_bytes / 1048576.0,
                 r.n_kv_blocks, target / 1048576.0,
                 mtp_k > 0 ? fmt::format(", MTP cache {} + {} scratch blocks = {:.1f} MiB", r.n_kv_blocks, r.n_mtp_scratch_blocks,
                                         mtp / 1048576.0) : std::string());
    }
    const fd::weights::SourceConfig scfg{.strategy = fd::weights::parse_load_strategy(cfg.weights.load_strategy),
                                         .model_dir = cfg.model.model_dir, .port = cfg.server.port,
                                         .rsync_config = cfg.weights.rsync_config, .tp = cfg.model.tensor_parallel_size};
    std::unique_ptr<fd::runtime::Executor> executor;
    if (r.executor_backend == fd::runtime::ExecutorKind::mp) {
        fd::runtime::MpExecutorConfig mp{.tensor_parallel_size = cfg.model.tensor_parallel_size, .model_dir = cfg.model.model_dir,
                                         .worker = wcfg, .source = scfg, .master_addr = cfg.parallel.master_addr,
                                         .master_port = cfg.parallel.master_port, .nnodes = par.nnodes, .dist_token = dist_token,
                                         .shutdown_comm_group_if_worker_idle = cfg.parallel.shutdown_comm_group_if_worker_idle,
                                         .dist_backend = r.dist_backend,
                                         .timeout_s = cfg.control.control_timeout_s,
                                         .heartbeat_s = cfg.parallel.rank_heartbeat_s, .stuck_s = cfg.parallel.rank_stuck_s, .log_level = cfg.log_level,
                                         .log_format = cfg.log_format};
        // A weight read that hangs fails inside the rank before the daemon gives up on the rank.
        mp.worker.io_timeout_s = 0.8 * cfg.control.control_timeout_s;
        executor = fd::runtime::make_mp_executor(mp, r.model);
    } else {
        auto worker = std::make_unique<fd::model::Worker>(r.model, fd::model::read_tensor_index(cfg.model.model_dir), wcfg);
        executor = fd::runtime::make_local_executor(std::move(worker), fd::weights::make_weight_source(scfg));
    }
    lg->info("executor: {} ({} rank(s), {} thread(s) per rank)", executor->backend(), executor->world_size(), cfg.model.n_threads);
    lg->info("compute dtype: {}{}", fd::kernels::compute_type_name(r.compute),
             r.compute == fd::kernels::ComputeType::bf16 ? fmt::format(" (linears on {})", fd::kernels::bf16_isa_name(fd::kernels::bf16_best_isa())) : std::string());
    cfg.engine.model_dir           = cfg.model.model_dir;
    cfg.engine.source              = scfg;
    cfg.engine.kv_cache_dtype      = r.kv_dtype;
    cfg.engine.kv_budget_bytes     = r.kv_budget_bytes;
    cfg.engine.compute_dtype       = fd::kernels::compute_type_name(r.compute);
    cfg.engine.expert_parallel_size = r.world.ep;
    cfg.engine.shutdown_comm_group_on_sleep = r.executor_backend == fd::runtime::ExecutorKind::mp &&
                                              cfg.parallel.shutdown_comm_group_if_worker_idle;
    cfg.engine.base_weight_version = cfg.engine.weight_version;  // config.cpp: --model's own label
    load_labelled_startup(cfg, scfg, *executor);
    fd::engine::Engine engine(cfg.engine, std::move(executor), tok,
                              {.n_blocks = r.n_kv_blocks, .block_size_tokens = cfg.kv.block_size_tokens,
                               .enable_prefix_caching = cfg.kv.enable_prefix_caching, .n_host_blocks = r.n_swap_blocks});
    fd::control::ControlService control(cfg.control, engine);
    fd::api::ApiServer server(cfg.server, engine, control, *tok);
    fd::control::ShmWatcher watcher(std::move(block), cfg.server.port, engine, control);
    watcher.add_status_field("weight_stream", [&server] { return server.weight_stream_status(); });  // as /health has it
    fd::api::ThroughputLogger throughput(engine, cfg.log_stats_interval_s);
    engine.start();  // (pre-faults the KV pool: long; a signal meanwhile still stops start-up)
    // Before the port is reachable: a signal from here on is main's (sigwait below, a drain),
    // never the start-up thread's _Exit under requests already admitted.
    startup_signals.stop();
    server.bind();
    watcher.start();
    throughput.start();
    std::thread http([&] { server.serve(); });
    lg->info("serving '{}' (max_model_len {}, max_num_seqs {}, prefix caching {})", cfg.server.served_model_name,
             cfg.engine.max_model_len, cfg.engine.scheduler.max_num_seqs, cfg.kv.enable_prefix_caching ? "on" : "off");

    int sig = 0;
    sigwait(&signals, &sig);
    {
        const auto st = engine.stats();
        lg->info("signal {}: draining {} choice(s), up to {} s (--shutdown-grace-s); Ctrl-C (or another SIGTERM) again to stop now",
                 sig, st.n_running + st.n_waiting, cfg.shutdown_grace_s);
    }
    engine.begin_drain();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(cfg.shutdown_grace_s);
    const timespec tick{0, 20'000'000};  // 20 ms
    while (!engine.idle() && std::chrono::steady_clock::now() < deadline) {
        if (sigtimedwait(&signals, nullptr, &tick) > 0) {  // a second signal: what is left is aborted now
            lg->warn("second signal: stopping now; the requests still running end with finish_reason \"abort\"");
            break;
        }
    }
    throughput.stop();
    watcher.stop();  // removes the control block
    engine.stop();   // aborts whatever outlived the grace period
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let handlers write their last chunks
    server.stop();
    http.join();
    lg->info("stopped (exit 0)");
    return 0;
}

}  // namespace

int main(int argc, char ** argv) {
    // A rank process of the mp executor (spawned by a daemon, never by hand).
    if (argc >= 2 && std::string(argv[1]) == fd::runtime::kRankProcessFlag) { return fd::runtime::rank_process_main(argc, argv); }
    // Signals are taken synchronously by main (sigwait); every thread inherits this mask.
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGTERM);
    sigaddset(&signals, SIGINT);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    std::signal(SIGPIPE, SIG_IGN);

    CLI::App app{"fdrollout — rollout engine for RL training loops: OpenAI-compatible generation with weight control.\n"
                 "A flag can also be set by the FD_* environment variable shown with it (all but --no-batch-invariant and vLLM's "
                 "--enable-sleep-mode, --dtype and --seed)."};
    fd::Config cfg;
    add_flags(app, cfg);
    add_vllm_flags(app, cfg);
    app.set_version_flag("--version", fmt::format("fdrollout {} (git {})", fd::kVersion, fd::kGitCommit));
    app.footer("Exit codes: 0 stopped cleanly (SIGTERM/SIGINT), 2 usage error (a flag not understood; nothing started),\n"
               "10 invalid configuration (e.g. --model, --kv-cache-bytes), other start-up failures by fd::Errc (fdctl --help).\n"
               "Environment: FD_ENABLE_V1_UPDATE_WEIGHTS=1 makes /clear_load_weight and /update_model_weight behave as\n"
               "/v1/sleep and /v1/wakeup (both tags); 0 (default) keeps the legacy status-word protocol.\n"
               "FD_ENABLE_SWAP_SPACE_CLEARING=1: with --swap-space, sleep(kv_cache) also frees the host swap pool (re-created on wakeup).\n"
               "FD_STREAM_RECYCLE_STAGING=0: a weight stream's commit removes the replaced staging dir at once instead of keeping\n"
               "its tmpfs pages for the next stream to write over (docs/weight_streams.md, Staging).\n"
               "FD_STREAM_STAGE_AHEAD=1|0: the ranks stage each weight-stream bucket as it arrives (1) or all at the finish (0);\n"
               "unset: only where the daemon may use tensor-parallel size + 2 CPUs (docs/weight_streams.md, Staging).");
    const char * v1 = std::getenv("FD_ENABLE_V1_UPDATE_WEIGHTS");
    cfg.control.v1_update_weights = v1 && std::string(v1) == "1";
    const char * clear_swap = std::getenv("FD_ENABLE_SWAP_SPACE_CLEARING");
    cfg.engine.clear_swap_space_on_sleep = clear_swap && std::string(clear_swap) == "1";
    const char * recycle = std::getenv("FD_STREAM_RECYCLE_STAGING");
    cfg.server.stream_recycle_staging = !(recycle && std::string(recycle) == "0");
    if (const char * ahead = std::getenv("FD_STREAM_STAGE_AHEAD"); ahead && *ahead) { cfg.server.stream_stage_ahead = std::string(ahead) == "0" ? 0 : 1; }
    if (const char * d = std::getenv("FD_DEBUG_CONTROL_DELAY_MS")) { cfg.engine.debug_control_delay_ms = std::atoi(d); }
    if (const char * d = std::getenv("FD_DEBUG_STEP_DELAY_MS")) { cfg.engine.debug_step_delay_ms = std::atoi(d); }
    // vLLM's `serve MODEL`: the same as --model MODEL
    std::vector<char *> args(argv, argv + argc);
    std::string         model_flag = "--model";
    if (args.size() >= 2 && std::string(args[1]) == "serve") {
        args.erase(args.begin() + 1);
        if (args.size() >= 2 && args[1][0] != '-') { args.insert(args.begin() + 1, model_flag.data()); }
    }
    try {
        app.parse(static_cast<int>(args.size()), args.data());
        cfg.parallel.shutdown_comm_group_given = app.get_option("--shutdown-comm-group-if-worker-idle")->count() > 0;
    } catch (const CLI::ParseError & e) {
        // --help and --version exit 0; every usage error exits 2 (CLI11's own codes, 105-115,
        // would collide with nothing documented and mean nothing to a script).
        const int rc = app.exit(e);
        return rc == 0 ? 0 : fd::kExitUsage;
    }
    try {
        fd::log::setup(cfg.log_level, cfg.log_format);
        return run(cfg, signals);
    } catch (const fd::Error & e) {
        std::cerr << "fdrollout: " << e.what() << "\n";
        return fd::errc_info(e.code()).exit_code;
    } catch (const std::exception & e) {
        std::cerr << "fdrollout: internal error: " << e.what() << "\n";
        return 70;
    }
}
