// fd_executor_bench: what the multi-process executor costs against the in-process one (issue #9).
// Both executors are built over the same model with the same threads; decode steps of a fixed
// batch are timed in alternating rounds (uni, mp, uni, mp, ...) so machine noise hits both, and
// the result is printed as ratios mp / uni: the step link's overhead per step (goal <= 1.02), and
// the latency of the control calls behind sleep, wakeup and update_weights. One JSON object.
// The mp/uni ratio also carries where the rank process's memory happens to sit (it moves ±15%
// between quiet runs of one binary), so the link's own cost is measured directly in the same
// rounds: `link_empty_us`, the median round trip of a probe request that runs no model;
// `link_us`, the same probe carrying the batch (the daemon encodes it into the shared region, the
// rank decodes it: everything a step adds to the model's work); `encode_us` / `decode_us` alone,
// in process; `link_over_uni_step` = link_us / the uni step; `link_msg_bytes` = one LinkMsg (the
// fixed record sent each way per step over the socket), `region_step_bytes` = the step's share of
// the shared region (batch in, logits out). `memory` lists, for this process (uni)
// and the rank process (mp), the mappings of 2 MiB or more with their transparent-huge-page state
// after the decode rounds; `memory_after_control` the anonymous (arena) share in huge pages after
// the sleep/wakeup/update cycles.
//   fd_executor_bench --model DIR --rank-binary build/fdrollout [--threads 1] [--batches 1,64]
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/runtime/mp_executor.h"
#include "fd/runtime/rank_link.h"
#include "bench_batch.h"
#include "bench_util.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

using json  = nlohmann::ordered_json;
using fd::bench::Clock;
using fd::bench::median;
using namespace fd;

namespace {

struct Options {
    std::string model, rank_binary;
    int32_t threads = 1, ctx = 128, rounds = 7;
    std::vector<int32_t> batches = {1, 64};
    double seconds_min = 0.5;
    int32_t control_trials = 3;
    int32_t probes = 200;
};

/// Median seconds of `n` calls of `f`.
template <typename F>
double median_seconds(int32_t n, F && f) {
    std::vector<double> t;
    t.reserve(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) {
        const auto t0 = Clock::now();
        f();
        t.push_back(fd::bench::seconds_since(t0));
    }
    return median(t);
}

/// This process's children (the rank process), from /proc/self/task/*/children.
std::vector<pid_t> child_pids() {
    std::vector<pid_t> out;
    for (const auto & t : std::filesystem::directory_iterator("/proc/self/task")) {
        std::ifstream f(t.path() / "children");
        for (pid_t p = 0; f >> p;) { out.push_back(p); }
    }
    return out;
}

/// Mappings of `pid` of at least 2 MiB: size, resident, AnonHugePages, THPeligible, and what
/// the mapping is (its path; anonymous ones have none: the arenas and large heap blocks).
json big_mappings(pid_t pid) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/smaps");
    json out = json::array();
    json cur;
    std::string line;
    auto flush = [&] {
        if (!cur.is_null() && cur["size_kb"].get<int64_t>() >= 2048) { out.push_back(cur); }
        cur = nullptr;
    };
    while (std::getline(f, line)) {
        std::istringstream in(line);
        std::string first;
        in >> first;
        if (first.find('-') != std::string::npos && first.back() != ':') {  // a mapping's header line
            flush();
            std::string perms, off, dev, inode, path;
            in >> perms >> off >> dev >> inode;
            std::getline(in, path);
            path.erase(0, path.find_first_not_of(' '));
            cur = {{"what", path.empty() ? "[anon]" : path}, {"size_kb", 0}, {"rss_kb", 0}, {"anon_huge_kb", 0}, {"thp_eligible", 0}};
            continue;
        }
        if (cur.is_null()) { continue; }
        int64_t v = 0;
        in >> v;
        if (first == "Size:") { cur["size_kb"] = v; }
        if (first == "Rss:") { cur["rss_kb"] = v; }
        if (first == "AnonHugePages:") { cur["anon_huge_kb"] = v; }
        if (first == "ShmemPmdMapped:" && v > 0) { cur["anon_huge_kb"] = v; }
        if (first == "THPeligible:") { cur["thp_eligible"] = v; }
    }
    flush();
    return out;
}

/// Seconds per step of `b` as the engine runs it (forward_in_place: the logits read where
/// rank 0 wrote them), repeated for at least `seconds_min`. `sink` keeps the read alive.
double step_seconds(runtime::Executor & ex, const model::StepBatch & b, std::vector<float> & sink, double seconds_min) {
    int64_t n = 0;
    const auto t0 = Clock::now();
    do {
        sink[0] += ex.forward_in_place(b, nullptr)[0];
        ++n;
    } while (fd::bench::seconds_since(t0) < seconds_min);
    return fd::bench::seconds_since(t0) / static_cast<double>(n);
}

/// The same with forward(): the logits copied out into `logits` (what the engine did before
/// forward_in_place), for the copy's cost in the same run.
double step_seconds_copy(runtime::Executor & ex, const model::StepBatch & b, std::vector<float> & logits, double seconds_min) {
    int64_t n = 0;
    const auto t0 = Clock::now();
    do {
        ex.forward(b, logits.data(), nullptr);
        ++n;
    } while (fd::bench::seconds_since(t0) < seconds_min);
    return fd::bench::seconds_since(t0) / static_cast<double>(n);
}

}  // namespace

int main(int argc, char ** argv) {
    CLI::App app{"fd_executor_bench: multi-process executor (mp) vs in-process (uni): step link overhead and control latency"};
    Options o;
    app.add_option("--model", o.model, "Checkpoint dir")->required();
    app.add_option("--rank-binary", o.rank_binary, "The fdrollout binary (rank processes)")->required();
    app.add_option("--threads", o.threads, "Threads per rank");
    app.add_option("--batches", o.batches, "Decode batch sizes")->delimiter(',');
    app.add_option("--ctx", o.ctx, "Context length of every sequence");
    app.add_option("--rounds", o.rounds, "Alternating uni/mp rounds per batch size (median taken)");
    app.add_option("--seconds-min", o.seconds_min, "Seconds per timing");
    app.add_option("--control-trials", o.control_trials, "sleep/wakeup/update cycles per executor");
    app.add_option("--probes", o.probes, "Link probes per round (median taken)");
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError & e) {
        return app.exit(e);
    }
    try {
        const auto cfg = model::load_model_config(o.model);
        const int32_t max_batch = *std::max_element(o.batches.begin(), o.batches.end());
        const int32_t blocks    = max_batch * ((o.ctx + 15) / 16) + 4;
        model::WorkerConfig w{.n_threads = o.threads, .block_size = 16, .n_blocks = blocks, .max_model_len = std::max(o.ctx, 64)};
        weights::SourceConfig src{.strategy = weights::LoadStrategy::normal, .model_dir = o.model};
        auto uni = runtime::make_local_executor(std::make_unique<model::Worker>(cfg, model::read_tensor_index(o.model), w),
                                                weights::make_weight_source(src));
        auto mp = runtime::make_mp_executor({.tensor_parallel_size = 1, .model_dir = o.model, .worker = w, .source = src,
                                             .timeout_s = 600, .rank_binary = o.rank_binary, .log_level = "warn"},
                                            cfg);
        json out;
        out["model"]   = o.model;
        out["threads"] = o.threads;
        out["ctx"]     = o.ctx;
        json steps = json::array();
        std::vector<float> logits;
        for (const int32_t b : o.batches) {
            bench::DecodeBatch db(b, o.ctx);
            logits.assign(1, 0.0f);
            std::vector<float> copied(static_cast<size_t>(b) * cfg.vocab_size);
            step_seconds(*uni, db.b, logits, 0.05);  // warm-up (KV pages touched, threads up)
            step_seconds(*mp, db.b, logits, 0.05);
            step_seconds_copy(*mp, db.b, copied, 0.05);
            // The encode/decode alone, in this process, into a buffer of the region's layout.
            std::vector<int64_t> region(static_cast<size_t>(
                runtime::step_layout(db.b.n_tokens(), static_cast<int64_t>(db.b.logits_rows.size()),
                                     runtime::step_tables(db.b, w.block_size), cfg.vocab_size).total_bytes / 8 + 1));
            model::StepBatch decoded;
            const int64_t region_bytes = static_cast<int64_t>(region.size() * 8);
            std::vector<double> ratios, copy_ratios, t_uni, t_mp, t_copy, t_empty, t_link, t_enc, t_dec, link_ratios;
            for (int32_t r = 0; r < o.rounds; ++r) {
                const double u = step_seconds(*uni, db.b, logits, o.seconds_min);
                const double m = step_seconds(*mp, db.b, logits, o.seconds_min);
                const double c = step_seconds_copy(*mp, db.b, copied, o.seconds_min);
                const double e = median_seconds(o.probes, [&] { runtime::probe_step_link(*mp, nullptr); });
                const double l = median_seconds(o.probes, [&] { runtime::probe_step_link(*mp, &db.b); });
                t_enc.push_back(median_seconds(o.probes, [&] {
                    runtime::step_encode(region.data(), region_bytes, db.b, w.block_size, cfg.vocab_size);
                }));
                t_dec.push_back(median_seconds(o.probes, [&] { runtime::step_decode(region.data(), decoded); }));
                t_uni.push_back(u);
                t_mp.push_back(m);
                t_copy.push_back(c);
                t_empty.push_back(e);
                t_link.push_back(l);
                ratios.push_back(m / u);
                copy_ratios.push_back(c / u);
                link_ratios.push_back(l / u);
            }
            steps.push_back({{"batch", b}, {"uni_step_ms", median(t_uni) * 1e3}, {"mp_step_ms", median(t_mp) * 1e3},
                             {"mp_over_uni", median(ratios)}, {"link_overhead_us", (median(t_mp) - median(t_uni)) * 1e6},
                             {"link_empty_us", median(t_empty) * 1e6}, {"link_us", median(t_link) * 1e6},
                             {"encode_us", median(t_enc) * 1e6}, {"decode_us", median(t_dec) * 1e6},
                             {"link_over_uni_step", median(link_ratios)},
                             {"mp_copy_step_ms", median(t_copy) * 1e3}, {"mp_copy_over_uni", median(copy_ratios)},
                             {"copy_saved_us", (median(t_copy) - median(t_mp)) * 1e6},
                             {"link_msg_bytes", static_cast<int64_t>(sizeof(runtime::LinkMsg))}, {"region_step_bytes", region_bytes}});
        }
        out["decode_step"] = steps;
        // Where each side's memory sits (after the decode rounds: weights, KV, logits all touched).
        json mem = {{"uni_process", big_mappings(::getpid())}};
        for (const pid_t p : child_pids()) { mem["rank_process_" + std::to_string(p)] = big_mappings(p); }
        out["memory"] = mem;
        out["thp"] = {{"enabled", fd::bench::read_first_line("/sys/kernel/mm/transparent_hugepage/enabled")},
                      {"shmem_enabled", fd::bench::read_first_line("/sys/kernel/mm/transparent_hugepage/shmem_enabled")},
                      {"defrag", fd::bench::read_first_line("/sys/kernel/mm/transparent_hugepage/defrag")}};

        // Control calls: the executor part of sleep (release both tags), wakeup (KV, then a
        // reload), update_weights (stage + commit), median over trials.
        auto control = [&](runtime::Executor & ex) {
            std::vector<double> sl, wk, up;
            for (int32_t t = 0; t < o.control_trials; ++t) {
                auto t0 = Clock::now();
                ex.release(runtime::MemoryTag::kv_cache);
                ex.release(runtime::MemoryTag::weight);
                sl.push_back(fd::bench::seconds_since(t0));
                t0 = Clock::now();
                ex.acquire_kv();
                ex.reload_weights({.wakeup = true});
                wk.push_back(fd::bench::seconds_since(t0));
                t0 = Clock::now();
                ex.stage_weights({.version = "b"});
                ex.commit_weights();
                up.push_back(fd::bench::seconds_since(t0));
            }
            return json{{"sleep_s", median(sl)}, {"wakeup_s", median(wk)}, {"update_s", median(up)}};
        };
        const json cu = control(*uni), cm = control(*mp);
        out["control"] = {{"uni", cu}, {"mp", cm},
                          {"mp_over_uni", {{"sleep", cm["sleep_s"].get<double>() / cu["sleep_s"].get<double>()},
                                           {"wakeup", cm["wakeup_s"].get<double>() / cu["wakeup_s"].get<double>()},
                                           {"update", cm["update_s"].get<double>() / cu["update_s"].get<double>()}}}};
        // After sleep/wakeup/update cycles (pages dropped and faulted in again): still huge?
        auto huge_share = [](const json & maps) {
            int64_t rss = 0, huge = 0;
            for (const auto & m : maps) {
                if (m["what"] != "[anon]") { continue; }
                rss += m["rss_kb"].get<int64_t>();
                huge += m["anon_huge_kb"].get<int64_t>();
            }
            return json{{"anon_rss_kb", rss}, {"anon_huge_kb", huge}};
        };
        json after = {{"uni_process", huge_share(big_mappings(::getpid()))}};
        for (const pid_t p : child_pids()) { after["rank_process_" + std::to_string(p)] = huge_share(big_mappings(p)); }
        out["memory_after_control"] = after;
        std::cout << out.dump(2) << std::endl;
        return 0;
    } catch (const std::exception & e) {
        std::cerr << "fd_executor_bench: " << e.what() << "\n";
        return 1;
    }
}
