// fd_control_bench's HTTP side (control_http.h): the loopback port, the clients and /metrics
// reader, and the measurements over HTTP — control round trips, pause at a decode step,
// update_weights bandwidth, sleep / wakeup — each as its JSON section.
#include "control_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace fd::bench {

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
json call(httplib::Client & c, const std::string & method, const std::string & path, const std::string & body,
          double * seconds) {
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
json bench_pause(Daemon & d, const Options & o, int trials, double idle_pause_p50_ms, bool one_request) {
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

}  // namespace fd::bench
