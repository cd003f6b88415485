// fd_control_bench — how fast fdrollout's weight control is on this machine, as one JSON object.
//
// Builds the real Engine + ApiServer in-process on a loopback port (as daemon/main.cpp does, with
// weights::make_normal_source(model_dir) and dynamic_load_weight on) and drives it over HTTP with
// cpp-httplib clients. Per model (--model, comma list), in this order:
//   control_rtt     GET /v1/is_paused, POST /v1/pause, POST /v1/resume on an idle engine, one
//                   keep-alive client, --rtt-calls each: p50/p99 (target p50 <= 1 ms)
//   pause           --pause-batch (64) concurrent greedy ignore_eos requests; once all run and decode
//                   has started, the mean step time is read from /metrics (histogram sum/count over
//                   the following steps), then POST /v1/pause is timed at a random point of a step.
//                   Target: pause latency <= 1 mean decode step (worst trial). On small models,
//                   pause_diagnostics repeats it with the B sequences in one request and with one
//                   engine thread (a core left to the HTTP threads).
//   update_weights  POST /v1/pause, then one warm-up and N timed POST /v1/update_weights
//                   {"version": "bench-i"} from the same (unchanged) checkpoint directory.
//                   bytes/s = result.bytes / wall time of the call; p50 ÷ memcpy (target >= 0.8);
//                   per-rank sync_cost / update_cost. The call's p50/p99 wall time is the fixed
//                   overhead of a tiny update (target p50 <= 2 ms, judged on the smallest model).
//   sleep / wakeup  POST /v1/sleep?tags=weight,kv_cache then POST /v1/wakeup (both tags), cycles.
//                   sleep latency (target <= 20 ms); freed bytes ÷ the Worker's weight + staging + KV bytes and
//                   RSS drop ÷ freed bytes (target >= 0.97 each); wakeup bytes/s = checkpoint bytes
//                   / wall time, ÷ memcpy (target >= 0.8).
//   analysis        (engine torn down) the update / wakeup / sleep paths taken apart on the same
//                   checkpoint with fd_core's own functions: fill_weights into a resident staging
//                   arena on 1 and --threads threads, into a fresh arena (wakeup), populate, munmap.
// Reference: single-thread memcpy, --memcpy-mib (512) buffers, best of 3, GB/s of bytes copied.
// Usage: fd_control_bench [--model DIR[,DIR]] [--threads 2] [--kv-cache-bytes auto] [--updates 5]
//                         [--tiny-updates 100] [--rtt-calls 200] [--pause-batch 64] [--pause-trials 0]
//                         [--sleep-cycles 3] [--memcpy-mib 512] [--no-analysis] [--no-pause-diagnostics] [--no-http]
// The analysis times every weight fill with the NaN/Inf check (the default) and without it
// (update_path.*_no_finite_check_vs_memcpy, *_finite_check_cost = time with ÷ time without).
#include "fd/api/server.h"
#include "fd/arena.h"
#include "fd/config.h"
#include "fd/engine/engine.h"
#include "fd/kernels/ops.h"
#include "fd/log.h"
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/tokenizer/tokenizer.h"
#include "fd/model/weights.h"
#include "fd/model/worker.h"
#include "fd/status.h"
#include "fd/weights/weight_source.h"

#include "bench_memory.h"
#include "bench_util.h"
#include "control_analysis.h"

#include <CLI/CLI.hpp>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifndef FD_SOURCE_DIR
#define FD_SOURCE_DIR "."
#endif

namespace {

using json  = nlohmann::ordered_json;
namespace M = fd::model;
using namespace fd::bench;

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
int free_port() {
    const int s = ::socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) { throw std::runtime_error("socket() failed"); }
    sockaddr_in a{};
    a.sin_family      = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port        = 0;
    socklen_t len = sizeof a;
    if (::bind(s, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0 || ::getsockname(s, reinterpret_cast<sockaddr *>(&a), &len) != 0) {
        ::close(s);
        throw std::runtime_error("cannot find a free loopback port");
    }
    ::close(s);
    return ntohs(a.sin_port);
}

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

constexpr int64_t kLargeCheckpoint = 64LL << 20;  ///< above: "large" (few updates, 256 MiB KV default)

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

std::unique_ptr<httplib::Client> client(int port, bool nodelay) {
    auto c = std::make_unique<httplib::Client>("127.0.0.1", port);
    c->set_keep_alive(true);
    c->set_tcp_nodelay(nodelay);
    c->set_connection_timeout(10, 0);
    c->set_read_timeout(900, 0);
    c->set_write_timeout(60, 0);
    return c;
}

/// POST/GET and parse the JSON answer; throws unless 200.
json call(httplib::Client & c, const std::string & method, const std::string & path, const std::string & body = "",
          double * seconds = nullptr) {
    const auto t0  = Clock::now();
    auto       res = method == "GET" ? c.Get(path) : c.Post(path, body, "application/json");
    const double dt = seconds_since(t0);
    if (seconds) { *seconds = dt; }
    if (!res) { throw std::runtime_error(method + " " + path + ": " + httplib::to_string(res.error())); }
    if (res->status != 200) { throw std::runtime_error(method + " " + path + ": HTTP " + std::to_string(res->status) + " " + res->body); }
    if (path == "/metrics") { return json(res->body); }
    return json::parse(res->body);
}

void wait_healthy(httplib::Client & c) {
    const auto t0 = Clock::now();
    while (true) {
        auto res = c.Get("/health");
        if (res && res->status == 200) { return; }
        if (seconds_since(t0) > 30) { throw std::runtime_error("the in-process server did not answer /health within 30 s"); }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
}

struct Metrics {
    double  step_sum = 0.0;
    int64_t step_count = 0, gen_tokens = 0, running = 0;
};

Metrics read_metrics(httplib::Client & c) {
    const std::string text = call(c, "GET", "/metrics").get<std::string>();
    Metrics m;
    std::istringstream in(text);
    std::string line;
    auto value = [&](const char * key, auto & out) {  // `key value` or `key{labels} value`
        const size_t n = std::strlen(key);
        if (line.size() > n && line.compare(0, n, key) == 0 && (line[n] == ' ' || line[n] == '{')) {
            std::istringstream v(line.substr(line[n] == ' ' ? n + 1 : line.find("} ", n) + 2));
            v >> out;
        }
    };
    while (std::getline(in, line)) {
        value("fdrollout_step_latency_seconds_sum", m.step_sum);
        value("fdrollout_step_latency_seconds_count", m.step_count);
        value("fdrollout_generation_tokens_total", m.gen_tokens);
        value("fdrollout_num_requests_running", m.running);
    }
    return m;
}

// ---------------------------------------------------------------------------------------------
// Measurements over HTTP
// ---------------------------------------------------------------------------------------------

json bench_rtt(Daemon & d, const Options & o) {
    auto c = client(d.port(), o.client_nodelay);
    std::vector<double> is_paused, pause, resume, pair;
    for (int i = 0; i < 10; ++i) {  // warm-up: connection, handler threads, caches
        call(*c, "GET", "/v1/is_paused");
        call(*c, "POST", "/v1/pause");
        call(*c, "POST", "/v1/resume");
    }
    for (int i = 0; i < o.rtt_calls; ++i) {
        double dt = 0.0;
        call(*c, "GET", "/v1/is_paused", "", &dt);
        is_paused.push_back(dt);
    }
    for (int i = 0; i < o.rtt_calls; ++i) {
        double a = 0.0, b = 0.0;
        const json pr = call(*c, "POST", "/v1/pause", "", &a);
        const json rr = call(*c, "POST", "/v1/resume", "", &b);
        if (!pr["result"]["is_paused"].get<bool>() || rr["result"]["is_paused"].get<bool>()) { throw std::runtime_error("pause/resume did not change is_paused"); }
        pause.push_back(a);
        resume.push_back(b);
        pair.push_back(a + b);
    }
    json j;
    j["calls_each"] = o.rtt_calls;
    j["client"] = {{"keep_alive", true}, {"tcp_nodelay", o.client_nodelay}};
    j["is_paused"] = ms_stats(is_paused);
    j["pause"] = ms_stats(pause);
    j["resume"] = ms_stats(resume);
    j["pause_plus_resume"] = ms_stats(pair);
    const double worst = std::max({j["is_paused"]["p50_ms"].get<double>(), j["pause"]["p50_ms"].get<double>(),
                                   j["resume"]["p50_ms"].get<double>()});
    j["target"] = {{"p50_ms_max", kRttP50Ms}, {"worst_p50_ms", worst}, {"met", worst <= kRttP50Ms}};
    return j;
}

/// `one_request`: the B sequences come from one request with B prompts (one HTTP handler thread
/// waiting on one ResultChannel) instead of B concurrent requests (B handler threads).
json bench_pause(Daemon & d, const Options & o, int trials, double idle_pause_p50_ms, bool one_request = false) {
    auto mon = client(d.port(), o.client_nodelay);
    const int B = o.pause_batch, P = o.pause_prompt_len, bs = d.cfg.kv.block_size_tokens;
    const int32_t vocab = d.r.model.vocab_size;
    // Longest generation that fits: B sequences must share the KV pool without preemption.
    const int64_t per_seq_tokens = d.r.n_kv_blocks / B * bs;
    const int max_tokens = static_cast<int>(std::min<int64_t>({per_seq_tokens - P, d.cfg.engine.max_model_len - P, 4096}));
    if (max_tokens < 8) { throw std::runtime_error("KV pool too small for the pause test at batch " + std::to_string(B)); }
    std::mt19937 rng(1234);
    json out = json::array();
    double worst_steps = 0.0, worst_ms = 0.0;
    for (int trial = 0; trial < trials; ++trial) {
        const Metrics m0 = read_metrics(*mon);
        std::atomic<int> n_done{0}, n_abort{0}, n_error{0};
        std::vector<std::thread> clients;
        auto prompt_of = [&](int i) {
            json prompt = json::array();
            prompt.push_back(1);
            for (int k = 1; k < P; ++k) { prompt.push_back((i * 131 + k * 7 + trial * 17 + 3) % vocab); }
            return prompt;
        };
        const int n_requests = one_request ? 1 : B;
        for (int i = 0; i < n_requests; ++i) {
            clients.emplace_back([&, i] {
                json prompt = json::array();
                if (one_request) {
                    for (int k = 0; k < B; ++k) { prompt.push_back(prompt_of(k)); }
                } else {
                    prompt = prompt_of(i);
                }
                const json body = {{"model", d.cfg.server.served_model_name}, {"prompt", prompt}, {"max_tokens", max_tokens},
                                   {"temperature", 0.0}, {"ignore_eos", true}};
                try {
                    auto c = client(d.port(), o.client_nodelay);
                    const json r = call(*c, "POST", "/v1/completions", body.dump());
                    for (const auto & ch : r["choices"]) { n_abort += ch["finish_reason"] == "abort" ? 1 : 0; }
                } catch (const std::exception & e) {
                    ++n_error;
                    std::fprintf(stderr, "fd_control_bench: request %d: %s\n", i, e.what());
                }
                ++n_done;
            });
        }
        // Wait until all B run and at least one decode step (after their prefill) has happened.
        const auto t_start = Clock::now();
        Metrics m = m0;
        while (true) {
            m = read_metrics(*mon);
            if (m.running == B && m.gen_tokens - m0.gen_tokens >= 2LL * B) { break; }
            if (n_done.load() > 0 || seconds_since(t_start) > 600) {
                for (auto & t : clients) { t.join(); }
                throw std::runtime_error("pause test: the batch never reached " + std::to_string(B) + " running sequences");
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        const double ramp_s = seconds_since(t_start);
        // Mean decode step over the next steps (every step here is a pure decode of B rows): the
        // engine's own step time (histogram sum/count) and the step period seen from outside
        // (steps per wall second between two /metrics reads, each timed from its send, so the
        // response delay cancels out).
        const auto ta = Clock::now();
        const Metrics a = read_metrics(*mon);
        Metrics b = a;
        Clock::time_point tb;
        while (true) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
            tb = Clock::now();
            b = read_metrics(*mon);
            const int64_t n = b.step_count - a.step_count;
            if (n >= 3 && (std::chrono::duration<double>(tb - ta).count() >= 0.25 || n >= 64)) { break; }
        }
        const int64_t n_steps = b.step_count - a.step_count;
        const double step_s   = (b.step_sum - a.step_sum) / static_cast<double>(n_steps);
        const double period_s = std::chrono::duration<double>(tb - ta).count() / static_cast<double>(n_steps);
        // Land the pause at a random point of a step.
        std::this_thread::sleep_for(std::chrono::duration<double>(std::uniform_real_distribution<double>(0.0, step_s)(rng)));
        const Metrics before = read_metrics(*mon);
        double pause_s = 0.0;
        const json pr = call(*mon, "POST", "/v1/pause", "", &pause_s);
        for (auto & t : clients) { t.join(); }
        call(*mon, "POST", "/v1/resume");
        const double steps = pause_s / step_s;
        worst_steps = std::max(worst_steps, steps);
        worst_ms = std::max(worst_ms, pause_s * 1e3);
        out.push_back({{"trial", trial},
                       {"running_at_pause", before.running},
                       {"tokens_generated_before_pause", before.gen_tokens - m0.gen_tokens},
                       {"ramp_s", round_to(ramp_s, 3)},
                       {"step_ms_mean", round_to(step_s * 1e3, 3)},
                       {"step_period_ms", round_to(period_s * 1e3, 3)},
                       {"steps_measured", n_steps},
                       {"pause_ms", round_to(pause_s * 1e3, 3)},
                       {"pause_engine_ms", round_to(pr["result"]["elapsed_s"].get<double>() * 1e3, 3)},
                       {"pause_in_steps", round_to(steps, 3)},
                       {"pause_in_step_periods", round_to(pause_s / period_s, 3)},
                       {"pause_minus_idle_pause_p50_ms", round_to(pause_s * 1e3 - idle_pause_p50_ms, 3)},
                       {"pause_minus_idle_pause_p50_in_steps", round_to((pause_s * 1e3 - idle_pause_p50_ms) / (step_s * 1e3), 3)},
                       {"aborted", pr["result"]["aborted"]},
                       {"client_aborts", n_abort.load()},
                       {"client_errors", n_error.load()}});
    }
    json j;
    j["batch"] = B;
    j["requests"] = one_request ? 1 : B;
    j["prompt_len"] = P;
    j["max_tokens"] = max_tokens;
    j["idle_pause_p50_ms"] = idle_pause_p50_ms;
    j["trials"] = out;
    j["pause_ms_max"] = round_to(worst_ms, 3);
    j["pause_in_steps_max"] = round_to(worst_steps, 3);
    j["target"] = {{"pause_in_steps_max", kPauseStepsMax}, {"met", worst_steps <= kPauseStepsMax}};
    return j;
}

json bench_update(Daemon & d, const Options & o, int n_updates, double memcpy_bps) {
    auto c = client(d.port(), o.client_nodelay);
    call(*c, "POST", "/v1/pause");
    std::vector<double> wall, gbs, sync, upd, elapsed, http;
    int64_t bytes = 0;
    for (int i = -1; i < n_updates; ++i) {  // i = -1: warm-up (page cache, staging code paths)
        double dt = 0.0;
        const json body = {{"version", "bench-" + std::to_string(i + 1)}};
        const json r = call(*c, "POST", "/v1/update_weights", body.dump(), &dt)["result"];
        if (i < 0) { continue; }
        bytes = r["bytes"].get<int64_t>();
        wall.push_back(dt);
        gbs.push_back(static_cast<double>(bytes) / dt / 1e9);
        sync.push_back(r["ranks"][0]["sync_cost"].get<double>());
        upd.push_back(r["ranks"][0]["update_cost"].get<double>());
        elapsed.push_back(r["elapsed_s"].get<double>());
        http.push_back(dt - r["elapsed_s"].get<double>());
    }
    json j;
    j["calls"] = n_updates;
    j["warmup_calls"] = 1;
    j["bytes"] = bytes;
    j["call"] = ms_stats(wall);
    const double gbs50 = percentile(gbs, 0.5);
    j["gbs_p50"] = round_to(gbs50, 3);
    j["ratio_vs_memcpy"] = round_to(gbs50 * 1e9 / memcpy_bps, 4);
    j["rank0_sync_cost_s_p50"] = round_to(percentile(sync, 0.5), 6);
    j["rank0_update_cost_s_p50"] = round_to(percentile(upd, 0.5), 6);
    j["engine_elapsed_s_p50"] = round_to(percentile(elapsed, 0.5), 6);
    j["engine_other_s_p50"] = round_to(percentile(elapsed, 0.5) - percentile(sync, 0.5) - percentile(upd, 0.5), 6);
    j["http_overhead_ms_p50"] = round_to(percentile(http, 0.5) * 1e3, 4);
    j["target"] = {{"ratio_vs_memcpy_min", kUpdateRatioMin}, {"ratio_met", gbs50 * 1e9 / memcpy_bps >= kUpdateRatioMin},
                   {"fixed_overhead_p50_ms_max", kTinyUpdateP50Ms}, {"fixed_overhead_met", j["call"]["p50_ms"].get<double>() <= kTinyUpdateP50Ms}};
    return j;
}

json bench_sleep_wakeup(Daemon & d, const Options & o, double memcpy_bps) {
    auto c = client(d.port(), o.client_nodelay);
    json cycles = json::array();
    std::vector<double> sleep_s, wake_s, freed_frac, rss_frac;
    for (int i = 0; i < o.sleep_cycles; ++i) {
        const int64_t rss_idle = call(*c, "GET", "/health")["rss_bytes"].get<int64_t>();
        // What the worker holds now: weights, the update staging arena (after an update with
        // --update-staging persistent) and the KV pool. The engine is idle between calls.
        const int64_t held = d.worker_view->weight_bytes() + d.worker_view->staging_bytes() + d.worker_view->kv_bytes();
        double ts = 0.0, tw = 0.0;
        const json s = call(*c, "POST", "/v1/sleep?tags=weight,kv_cache", "", &ts)["result"];
        const int64_t rss_asleep = call(*c, "GET", "/health")["rss_bytes"].get<int64_t>();
        const json w = call(*c, "POST", "/v1/wakeup?tags=weight,kv_cache", "", &tw)["result"];
        const int64_t rss_awake = call(*c, "GET", "/health")["rss_bytes"].get<int64_t>();
        const int64_t fw = s["freed_bytes"].value("weight", int64_t{0}), fk = s["freed_bytes"].value("kv_cache", int64_t{0});
        const int64_t freed = fw + fk;
        const double  frac = static_cast<double>(freed) / static_cast<double>(held);
        const int64_t drop = s["rss_before_bytes"].get<int64_t>() - s["rss_after_bytes"].get<int64_t>();
        const double  rfrac = freed > 0 ? static_cast<double>(drop) / static_cast<double>(freed) : 0.0;
        const int64_t wbytes = w["bytes"].get<int64_t>();
        sleep_s.push_back(ts);
        wake_s.push_back(tw);
        freed_frac.push_back(frac);
        rss_frac.push_back(rfrac);
        cycles.push_back({{"cycle", i},
                          {"sleep_ms", round_to(ts * 1e3, 3)},
                          {"sleep_engine_ms", round_to(s["elapsed_s"].get<double>() * 1e3, 3)},
                          {"held_bytes", held},
                          {"freed_weight_bytes", fw},
                          {"freed_kv_bytes", fk},
                          {"rss_before_bytes", s["rss_before_bytes"]},
                          {"rss_after_bytes", s["rss_after_bytes"]},
                          {"rss_idle_bytes", rss_idle},
                          {"rss_asleep_bytes", rss_asleep},
                          {"freed_fraction", round_to(frac, 4)},
                          {"rss_drop_over_freed", round_to(rfrac, 4)},
                          {"wakeup_ms", round_to(tw * 1e3, 3)},
                          {"wakeup_engine_ms", round_to(w["elapsed_s"].get<double>() * 1e3, 3)},
                          {"wakeup_bytes", wbytes},
                          {"wakeup_gbs", round_to(static_cast<double>(wbytes) / tw / 1e9, 3)},
                          {"wakeup_rank0_sync_cost_s", w["ranks"].empty() ? json(nullptr) : w["ranks"][0]["sync_cost"]},
                          {"wakeup_rank0_update_cost_s", w["ranks"].empty() ? json(nullptr) : w["ranks"][0]["update_cost"]},
                          {"rss_awake_bytes", rss_awake},
                          {"is_paused_after_wakeup", w["is_paused"]}});
    }
    json j;
    j["worker_weight_bytes"] = d.worker_weight_bytes;
    j["worker_kv_bytes"] = d.worker_kv_bytes;
    j["cycles"] = cycles;
    // Worst cycle for every figure (conservative).
    const double s_max = *std::max_element(sleep_s.begin(), sleep_s.end()) * 1e3;
    const double ff = *std::min_element(freed_frac.begin(), freed_frac.end());
    const double rf = *std::min_element(rss_frac.begin(), rss_frac.end());
    const double wg = static_cast<double>(cycles[0]["wakeup_bytes"].get<int64_t>()) / percentile(wake_s, 0.5) / 1e9;  // at the median time
    j["sleep_ms_max"] = round_to(s_max, 3);
    j["freed_fraction_min"] = round_to(ff, 4);
    j["rss_drop_over_freed_min"] = round_to(rf, 4);
    j["wakeup_ms_p50"] = round_to(percentile(wake_s, 0.5) * 1e3, 3);
    j["wakeup_gbs_p50"] = round_to(wg, 3);
    j["wakeup_ratio_vs_memcpy"] = round_to(wg * 1e9 / memcpy_bps, 4);
    j["target"] = {{"sleep_ms_max", kSleepMsMax}, {"sleep_met", s_max <= kSleepMsMax},
                   {"freed_fraction_min", kFreedFractionMin}, {"freed_met", ff >= kFreedFractionMin && rf >= kFreedFractionMin},
                   {"wakeup_ratio_vs_memcpy_min", kWakeupRatioMin}, {"wakeup_met", wg * 1e9 / memcpy_bps >= kWakeupRatioMin}};
    return j;
}

// ---------------------------------------------------------------------------------------------

/// Per-leaf median of numeric fields of same-shaped JSON objects (first object's other leaves).
json median_merge(const std::vector<json> & runs) {
    json out = runs.front();
    std::function<void(json &, const std::vector<const json *> &)> rec = [&](json & o, const std::vector<const json *> & rs) {
        if (o.is_object()) {
            for (auto & [k, v] : o.items()) {
                std::vector<const json *> sub;
                for (const json * r : rs) { sub.push_back(&(*r)[k]); }
                rec(v, sub);
            }
        } else if (o.is_number_float()) {
            std::vector<double> v;
            for (const json * r : rs) { v.push_back(r->get<double>()); }
            o = percentile(v, 0.5);
        }
    };
    std::vector<const json *> rs;
    for (const auto & r : runs) { rs.push_back(&r); }
    rec(out, rs);
    return out;
}

int64_t checkpoint_bytes(const std::string & dir) { return M::read_tensor_index(dir).total_bytes; }

json bench_model(const std::string & dir, const Options & o, double memcpy_bps) {
    const int64_t ck_bytes = checkpoint_bytes(dir);
    const bool    large    = ck_bytes >= kLargeCheckpoint;
    const std::string kv = o.kv_cache_bytes == "auto" ? (large ? "256MiB" : "0") : o.kv_cache_bytes;
    json j;
    j["model"] = dir;
    j["checkpoint_bytes"] = ck_bytes;
    M::ModelConfig mcfg;
    if (!o.http) {
        mcfg = M::load_model_config(dir);
    } else {
        const auto t_section = Clock::now();
        std::fprintf(stderr, "fd_control_bench: %s: loading (kv %s)...\n", dir.c_str(), kv.c_str());
        Daemon d(dir, o, kv);
        mcfg = d.r.model;
        {
            auto c = client(d.port(), o.client_nodelay);
            wait_healthy(*c);
        }
        const auto idx = M::read_tensor_index(dir);
        j["dtype"] = M::dtype_name(idx.tensors.begin()->second.dtype);
        j["shape"] = {{"layers", mcfg.n_layers}, {"hidden", mcfg.hidden_size}, {"intermediate", mcfg.intermediate_size},
                      {"heads", mcfg.n_heads}, {"kv_heads", mcfg.n_kv_heads}, {"vocab", mcfg.vocab_size}};
        j["weight_bytes"] = d.worker_weight_bytes;
        j["kv_bytes"] = d.worker_kv_bytes;
        j["kv_cache_bytes_flag"] = kv;
        j["kv_blocks"] = d.r.n_kv_blocks;
        j["max_model_len"] = d.cfg.engine.max_model_len;
        j["load_s"] = round_to(d.load_s, 3);
        j["rss_before_load_bytes"] = d.rss_before_load;
        j["rss_after_load_bytes"] = d.rss_after_load;
        std::fprintf(stderr, "fd_control_bench: %s: control round trips...\n", dir.c_str());
        j["control_rtt"] = bench_rtt(d, o);
        const int trials = o.pause_trials > 0 ? o.pause_trials : (large ? 2 : 3);
        std::fprintf(stderr, "fd_control_bench: %s: pause at batch %d (%d trials)...\n", dir.c_str(), o.pause_batch, trials);
        j["pause"] = bench_pause(d, o, trials, j["control_rtt"]["pause"]["p50_ms"].get<double>());
        const int n_up = large ? o.updates : o.tiny_updates;
        std::fprintf(stderr, "fd_control_bench: %s: %d update_weights...\n", dir.c_str(), n_up);
        j["update_weights"] = bench_update(d, o, n_up, memcpy_bps);
        std::fprintf(stderr, "fd_control_bench: %s: sleep/wakeup x%d...\n", dir.c_str(), o.sleep_cycles);
        j["sleep_wakeup"] = bench_sleep_wakeup(d, o, memcpy_bps);
        j["http_section_s"] = round_to(seconds_since(t_section), 1);
        if (!large && o.pause_diagnostics) {
            // Where a small model's pause time goes (its steps are a few ms): the same B sequences
            // from one request (one waiting handler thread instead of B), and both shapes again
            // with one engine thread, which leaves a core to the HTTP threads.
            std::fprintf(stderr, "fd_control_bench: %s: pause diagnostics...\n", dir.c_str());
            json diag;
            const double rtt = j["control_rtt"]["pause"]["p50_ms"].get<double>();
            diag["one_request"] = bench_pause(d, o, trials, rtt, true);
            Options o1 = o;
            o1.threads = 1;
            Daemon d1(dir, o1, kv);
            {
                auto c = client(d1.port(), o.client_nodelay);
                wait_healthy(*c);
            }
            diag["threads_1_requests"] = bench_pause(d1, o1, trials, rtt);
            diag["threads_1_one_request"] = bench_pause(d1, o1, trials, rtt, true);
            j["pause_diagnostics"] = diag;
        }
    }
    if (o.analysis) {
        std::fprintf(stderr, "fd_control_bench: %s: analysis...\n", dir.c_str());
        const auto t0 = Clock::now();
        // Small checkpoints: every stage takes well under a millisecond, so take the median of 21 runs.
        const int reps = large ? 1 : 21;
        std::vector<json> runs;
        for (int r = 0; r < reps; ++r) { runs.push_back(analyse(dir, mcfg, memcpy_bps, o.threads)); }
        j["analysis"] = median_merge(runs);
        j["analysis"]["runs"] = reps;
        j["analysis"]["section_s"] = round_to(seconds_since(t0), 1);
    }
    return j;
}

}  // namespace

int main(int argc, char ** argv) {
    std::signal(SIGPIPE, SIG_IGN);
    Options o;
    std::vector<std::string> models;
    CLI::App app{"fd_control_bench: fdrollout weight-control latency and bandwidth over HTTP (prints one JSON object)"};
    app.add_option("--model", models, "checkpoint directory (repeatable or comma-separated)")
        ->default_str(FD_SOURCE_DIR "/models/stories260K");
    app.add_option("--threads", o.threads, "engine kernel threads")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--kv-cache-bytes", o.kv_cache_bytes,
                   "KV pool (as fdrollout --kv-cache-bytes); auto = 256MiB for checkpoints >= 64 MiB, else 0 (engine default)")
        ->capture_default_str();
    app.add_option("--updates", o.updates, "timed update_weights calls on large checkpoints (>= 64 MiB)")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--tiny-updates", o.tiny_updates, "timed update_weights calls on small checkpoints")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--rtt-calls", o.rtt_calls, "calls of each control route for the round-trip figures")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--pause-batch", o.pause_batch, "concurrent requests running when pause is timed")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--pause-trials", o.pause_trials, "pause trials (0 = 3 on small models, 2 on large)")->capture_default_str();
    app.add_option("--pause-prompt-len", o.pause_prompt_len, "prompt tokens of each pause-test request")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--sleep-cycles", o.sleep_cycles, "sleep + wakeup cycles")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--memcpy-mib", o.memcpy_mib, "memcpy reference buffer, MiB")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_flag("--analysis,!--no-analysis", o.analysis, "take the update/wakeup/sleep paths apart after the HTTP runs")->capture_default_str();
    app.add_flag("--http,!--no-http", o.http, "run the HTTP sections (--no-http: the analysis only, e.g. the NaN/Inf check's cost)")->capture_default_str();
    app.add_flag("--pause-diagnostics,!--no-pause-diagnostics", o.pause_diagnostics,
                 "small models: also time pause with one B-prompt request, and with one engine thread")
        ->capture_default_str();
    app.add_flag("--client-nodelay,!--no-client-nodelay", o.client_nodelay, "TCP_NODELAY on the bench's HTTP clients")->capture_default_str();
    app.add_option("--log-level", o.log_level, "engine log level on stderr")->capture_default_str();
    CLI11_PARSE(app, argc, argv);

    try {
        fd::log::setup(o.log_level);
        o.models = split_commas(models);
        if (o.models.empty()) { o.models.push_back(FD_SOURCE_DIR "/models/stories260K"); }
        json r;
        r["date"] = utc_now();
        r["cpu"] = cpu_model();
        r["n_cpus"] = std::thread::hardware_concurrency();
        r["threads"] = o.threads;
        r["loadavg_start"] = read_first_line("/proc/loadavg");
        r["thp"] = read_first_line("/sys/kernel/mm/transparent_hugepage/enabled");
        r["settings"] = {{"updates", o.updates}, {"tiny_updates", o.tiny_updates}, {"rtt_calls", o.rtt_calls},
                         {"pause_batch", o.pause_batch}, {"pause_trials", o.pause_trials}, {"sleep_cycles", o.sleep_cycles},
                         {"kv_cache_bytes", o.kv_cache_bytes}, {"client_tcp_nodelay", o.client_nodelay}};
        std::fprintf(stderr, "fd_control_bench: memcpy reference (%lld MiB)...\n", static_cast<long long>(o.memcpy_mib));
        const size_t mc_bytes = static_cast<size_t>(o.memcpy_mib) << 20;
        const double mc1 = memcpy_gbs(mc_bytes, 1);
        const double mcn = o.threads > 1 ? memcpy_gbs(mc_bytes, o.threads) : mc1;
        r["memcpy_bw_gbs"] = round_to(mc1, 2);
        r["memcpy_reference"] = {{"buffer_mib", o.memcpy_mib}, {"best_of", 3}, {"single_thread_gbs", round_to(mc1, 2)},
                                 {"threads", o.threads}, {"multi_thread_gbs", round_to(mcn, 2)}};
        const double mc_bps = mc1 * 1e9;

        json models_j = json::array();
        for (const auto & m : o.models) { models_j.push_back(bench_model(m, o, mc_bps)); }

        // Top-level verdicts: bandwidth and sleep on the largest checkpoint, the tiny-update
        // overhead on the smallest, pause and round trips on every model (worst).
        size_t lg = 0, sm = 0;
        for (size_t i = 0; i < models_j.size(); ++i) {
            if (models_j[i]["checkpoint_bytes"] > models_j[lg]["checkpoint_bytes"]) { lg = i; }
            if (models_j[i]["checkpoint_bytes"] < models_j[sm]["checkpoint_bytes"]) { sm = i; }
        }
        const json & L = models_j[lg];
        const json & S = models_j[sm];
        json t = json::object();
        auto add = [&](const char * name, double value, const char * cmp, double target, bool met, const json & on) {
            t[name] = {{"value", value}, {"target", std::string(cmp) + " " + json(target).dump()}, {"met", met}, {"evaluated_on", on}};
        };
        if (o.http) {
            add("update_weights_bw_ratio_vs_memcpy", L["update_weights"]["ratio_vs_memcpy"], ">=", kUpdateRatioMin,
                L["update_weights"]["target"]["ratio_met"], L["model"]);
            add("tiny_update_p50_ms", S["update_weights"]["call"]["p50_ms"], "<=", kTinyUpdateP50Ms,
                S["update_weights"]["target"]["fixed_overhead_met"], S["model"]);
            add("sleep_ms", L["sleep_wakeup"]["sleep_ms_max"], "<=", kSleepMsMax, L["sleep_wakeup"]["target"]["sleep_met"], L["model"]);
            add("sleep_freed_fraction", std::min(L["sleep_wakeup"]["freed_fraction_min"].get<double>(), L["sleep_wakeup"]["rss_drop_over_freed_min"].get<double>()),
                ">=", kFreedFractionMin, L["sleep_wakeup"]["target"]["freed_met"], L["model"]);
            add("wakeup_bw_ratio_vs_memcpy", L["sleep_wakeup"]["wakeup_ratio_vs_memcpy"], ">=", kWakeupRatioMin,
                L["sleep_wakeup"]["target"]["wakeup_met"], L["model"]);
            double pause_worst = 0.0, rtt_worst = 0.0;
            json pause_on, rtt_on;
            for (const auto & m : models_j) {
                const double ps = m["pause"]["pause_in_steps_max"].get<double>();
                const double rt = m["control_rtt"]["target"]["worst_p50_ms"].get<double>();
                if (ps >= pause_worst) { pause_worst = ps; pause_on = m["model"]; }
                if (rt >= rtt_worst) { rtt_worst = rt; rtt_on = m["model"]; }
            }
            add("pause_in_decode_steps_b64", pause_worst, "<=", kPauseStepsMax, pause_worst <= kPauseStepsMax, pause_on);
            add("control_rtt_p50_ms", rtt_worst, "<=", kRttP50Ms, rtt_worst <= kRttP50Ms, rtt_on);
        }
        if (o.analysis) {
            // The weight fill the update runs (NaN/Inf check on, as served), over the pool.
            const std::string key = "fill_resident_" + std::to_string(o.threads) + "_threads";
            const json & up = L["analysis"]["update_path"];
            add("update_fill_with_finite_check_vs_memcpy", up[key + "_vs_memcpy"].get<double>(), ">=", kUpdateRatioMin,
                up[key + "_vs_memcpy"].get<double>() >= kUpdateRatioMin, L["model"]);
        }
        bool all = true;
        for (const auto & [k, v] : t.items()) { all = all && v["met"].get<bool>(); }
        t["all_met"] = all;
        r["targets"] = t;
        r["models"] = models_j;
        r["loadavg_end"] = read_first_line("/proc/loadavg");
        std::cout << r.dump(1) << std::endl;
    } catch (const std::exception & e) {
        std::fprintf(stderr, "fd_control_bench: error: %s\n", e.what());
        return 1;
    }
    return 0;
}
