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
// This file: the per-model driver, the analysis runs' median and the verdicts; the in-process
// daemon and the measurements over HTTP are in control_http.h / control_http.cpp.
#include "fd/kernels/ops.h"
#include "fd/log.h"
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/model/weights.h"
#include "fd/status.h"

#include "bench_memory.h"
#include "bench_util.h"
#include "control_analysis.h"
#include "control_http.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#ifndef FD_SOURCE_DIR
#define FD_SOURCE_DIR "."
#endif

namespace {

using namespace fd::bench;

constexpr int64_t kLargeCheckpoint = 64LL << 20;  ///< above: "large" (few updates, 256 MiB KV default)

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
