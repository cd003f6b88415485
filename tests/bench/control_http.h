// tests/bench/control_http.h — fd_control_bench's HTTP side: the in-process daemon it drives
// (the real Config → Worker → Engine → ApiServer on a loopback port), its keep-alive clients and
// /metrics reader, and the measurements over HTTP (control round trips, pause, update_weights,
// sleep / wakeup), each returning its JSON section. Definitions: control_http.cpp; the driver,
// the analysis merge and the verdicts: fd_control_bench.cpp.
#pragma once

#include "fd/api/server.h"
#include "fd/arena.h"
#include "fd/config.h"
#include "fd/engine/engine.h"
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/tokenizer/tokenizer.h"
#include "fd/model/weights.h"
#include "fd/model/worker.h"
#include "fd/status.h"
#include "fd/weights/weight_source.h"

#include "bench_util.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace fd::bench {

using json  = nlohmann::ordered_json;
namespace M = fd::model;

// Targets (the numbers).
constexpr double kUpdateRatioMin   = 0.8;   ///< update bytes/s ÷ memcpy bytes/s
constexpr double kTinyUpdateP50Ms  = 2.0;   ///< fixed overhead of a tiny update
constexpr double kSleepMsMax       = 20.0;  ///< sleep (both tags) latency
constexpr double kFreedFractionMin = 0.97;  ///< freed ÷ resident, RSS drop ÷ freed
constexpr double kWakeupRatioMin   = 0.8;   ///< wakeup bytes/s ÷ memcpy bytes/s
constexpr double kPauseStepsMax    = 1.0;   ///< pause latency in mean decode steps
constexpr double kRttP50Ms         = 1.0;   ///< control round trip p50

/// `key` of /proc/self/smaps_rollup ("AnonHugePages:") in bytes, 0 if absent.
// ---------------------------------------------------------------------------------------------
// In-process daemon
// ---------------------------------------------------------------------------------------------

/// A loopback port nobody listens on now (the kernel's choice).
int free_port();

struct Options {
    std::vector<std::string> models;
    int         threads       = 2;
    std::string kv_cache_bytes = "auto";
    int         updates       = 5;
    int         tiny_updates  = 100;
    int         rtt_calls     = 200;
    int         pause_batch   = 64;
    int         pause_trials  = 0;   ///< 0 = 3 on small models, 2 on large ones
    int         pause_prompt_len = 8;
    int         sleep_cycles  = 3;
    int64_t     memcpy_mib    = 512;
    bool        http          = true;   ///< false: skip the HTTP sections, run the analysis only
    bool        analysis      = true;
    std::string log_level     = "warn";
    bool        client_nodelay = true;
    bool        pause_diagnostics = true;
};

/// Config → Worker → Engine → ApiServer, exactly as daemon/main.cpp wires them.
struct Daemon {
    fd::Config                                   cfg;
    fd::Resolved                                 r;
    std::shared_ptr<const fd::tokenizer::Tokenizer>          tok;
    std::unique_ptr<fd::engine::Engine>          engine;
    std::unique_ptr<fd::control::ControlService> control;
    std::unique_ptr<fd::api::ApiServer>          server;
    std::thread                                  http;
    int64_t                                      worker_weight_bytes = 0, worker_kv_bytes = 0;
    const M::Worker *                            worker_view = nullptr;  ///< read between control calls only
    double                                       load_s = 0.0;
    int64_t                                      rss_before_load = 0, rss_after_load = 0;

    Daemon(const std::string & dir, const Options & o, const std::string & kv_bytes) {
        cfg.model.model_dir            = dir;
        cfg.model.n_threads            = o.threads;
        cfg.kv.kv_cache_bytes          = kv_bytes;
        cfg.server.host                = "127.0.0.1";
        cfg.control.dynamic_load_weight = true;
        cfg.server.port                = free_port();
        r = fd::resolve(cfg);
        rss_before_load = fd::process_rss_bytes();
        const auto t0 = Clock::now();
        tok = fd::tokenizer::load_tokenizer(cfg.model.model_dir, {.bos_token_id = r.model.bos_token_id});
        const auto idx = M::read_tensor_index(cfg.model.model_dir);
        auto worker = std::make_unique<M::Worker>(r.model, idx, M::WorkerConfig{
            .rank = 0, .n_threads = cfg.model.n_threads, .block_size = cfg.kv.block_size_tokens,
            .n_blocks = r.n_kv_blocks, .max_model_len = cfg.engine.max_model_len});
        load_s = seconds_since(t0);
        worker_weight_bytes = worker->weight_bytes();
        worker_kv_bytes     = worker->kv_bytes();
        worker_view         = worker.get();
        engine = std::make_unique<fd::engine::Engine>(cfg.engine,
                                                      fd::runtime::make_local_executor(std::move(worker), fd::weights::make_normal_source(cfg.model.model_dir)),
                                                      tok,
                                                      fd::kv::KvCacheConfig{.n_blocks = r.n_kv_blocks, .block_size_tokens = cfg.kv.block_size_tokens,
                                                                            .enable_prefix_caching = cfg.kv.enable_prefix_caching});
        control = std::make_unique<fd::control::ControlService>(cfg.control, *engine);
        engine->start();
        rss_after_load = fd::process_rss_bytes();
        for (int attempt = 0;; ++attempt) {
            server = std::make_unique<fd::api::ApiServer>(cfg.server, *engine, *control, *tok);
            try {
                server->bind();
                break;
            } catch (const fd::Error &) {
                if (attempt >= 5) { throw; }
                cfg.server.port = free_port();
            }
        }
        http = std::thread([this] { server->serve(); });
    }
    ~Daemon() {
        engine->stop();
        server->stop();
        if (http.joinable()) { http.join(); }
        server.reset();
        engine.reset();
    }
    int port() const { return cfg.server.port; }
};

/// A client of the in-process server on 127.0.0.1:`port`: keep-alive, TCP_NODELAY if `nodelay`,
/// timeouts 10 s (connect), 900 s (read), 60 s (write).
std::unique_ptr<httplib::Client> client(int port, bool nodelay);

/// POST/GET and parse the JSON answer; throws unless 200.
/// `seconds`: if set, the call's wall time in s. /metrics: its text as one JSON string.
json call(httplib::Client & c, const std::string & method, const std::string & path, const std::string & body = "",
          double * seconds = nullptr);

/// Wait until /health answers 200 (5 ms polls). Errors  std::runtime_error after 30 s.
void wait_healthy(httplib::Client & c);

struct Metrics {
    double  step_sum = 0.0;
    int64_t step_count = 0, gen_tokens = 0, running = 0;
};

/// The engine's step-latency histogram sum and count, generated tokens and running requests, read
/// from /metrics (0 where absent).
Metrics read_metrics(httplib::Client & c);

// ---------------------------------------------------------------------------------------------
// Measurements over HTTP (fd_control_bench.cpp's header says what each times, and its target)
// ---------------------------------------------------------------------------------------------

/// GET /v1/is_paused, POST /v1/pause, POST /v1/resume, o.rtt_calls each on one keep-alive
/// client after 10 warm-ups: p50/p99 in ms, the worst p50 against kRttP50Ms.
json bench_rtt(Daemon & d, const Options & o);

/// POST /v1/pause landing at a random point of a decode step with o.pause_batch sequences
/// running, `trials` times: its latency in ms and in mean decode steps (the worst against
/// kPauseStepsMax); `idle_pause_p50_ms` (bench_rtt's) is subtracted for the extra figures.
/// `one_request`: the B sequences come from one request with B prompts (one HTTP handler thread
/// waiting on one ResultChannel) instead of B concurrent requests (B handler threads).
/// Errors  std::runtime_error when the KV pool cannot hold the batch or it never runs in full.
json bench_pause(Daemon & d, const Options & o, int trials, double idle_pause_p50_ms, bool one_request = false);

/// POST /v1/pause, one warm-up and `n_updates` timed POST /v1/update_weights from the same
/// checkpoint: call time, GB/s ÷ `memcpy_bps` (bytes/s), rank 0's sync / update costs.
json bench_update(Daemon & d, const Options & o, int n_updates, double memcpy_bps);

/// o.sleep_cycles of POST /v1/sleep + /v1/wakeup (both tags): sleep latency, freed bytes ÷ held,
/// RSS drop ÷ freed, wakeup GB/s ÷ `memcpy_bps` (bytes/s); the worst cycle for each.
json bench_sleep_wakeup(Daemon & d, const Options & o, double memcpy_bps);

}  // namespace fd::bench
